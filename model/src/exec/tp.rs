//! Tensor parallelism: one OS process per rank, each holding its shard of the weights on its
//! device (GPU R for rank R, or the CPU), summing partial results with the all-reduce of its
//! backend — shared memory on the CPU and on `cuda-emulated`, CUDA IPC on GPUs.
//!
//! Rank 0 is the process the user started: it holds the decode loop or the serving engine and
//! decides every step. It starts ranks 1..N as copies of its own command with `--tp-rank R`,
//! and sends each of them every call it makes on its runner (a line of JSON on the rank's
//! stdin); a follower makes the same call on its own runner, so every rank takes the same
//! steps and the collectives meet ([`TpLeader`], [`follow`]). Only rank 0 reads results back.
//!
//! Failure: a follower that exits is noticed by a watcher thread at once; rank 0's next call
//! fails naming it (the serving engine then fails its requests and stops answering `/health`
//! with 200), and a collective it left waiting fails on the peer's death (CPU) or its timeout.
//! Followers die with rank 0, however it ends: each gets SIGTERM as its parent-death signal
//! (`PR_SET_PDEATHSIG`, set between fork and exec), and a watchdog thread in each also stops it
//! when its parent changes (the signal's blind spots: a parent that died before the signal was
//! armed). While rank 0 lives, a follower ignores SIGINT and SIGTERM: rank 0 decides when the
//! group stops (the server drains first). Either way a rank unlinks the all-reduce segment name on its way out, so nothing is
//! left in `/dev/shm`.

use std::io::{BufRead, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use kernels::mla::cache::SeqId;
use kernels::process::{STOPPED_PEER_GRACE, StoppedClock, process_state};
use serde::{Deserialize, Serialize};

use super::backend::{BackendArgs, RankGroup, RunnerSizing, TpArgs};
use super::error::ExecError;
use super::ops::{LogitRows, Logits, SeqInput};
use super::runner::ModelRunner;
use super::sampler::SampleRow;
use crate::arch::config::ModelConfig;
use crate::checkpoint::weights::Model;

/// A tensor-parallel rank that failed, as rank 0 reports it.
#[derive(Debug, thiserror::Error)]
#[error("tensor-parallel rank {rank} of {world} failed ({status})")]
pub struct RankFailed {
    pub rank: usize,
    pub world: usize,
    pub status: RankEnd,
}

/// How a follower left the group.
#[derive(Clone, Copy, Debug)]
pub enum RankEnd {
    Exited(ExitStatus),
    /// Stopped by a signal (SIGSTOP) and not continued within [`STOPPED_PEER_GRACE`]: the
    /// group cannot step without it, and waiting out the collectives' timeout helps nobody.
    Stopped,
}

impl RankEnd {
    /// The exit code, for a follower that exited with one.
    pub fn code(&self) -> Option<i32> {
        match self {
            Self::Exited(status) => status.code(),
            Self::Stopped => None,
        }
    }
}

impl std::fmt::Display for RankEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exited(status) => write!(f, "{status}"),
            Self::Stopped => write!(
                f,
                "stopped by a signal for over {} s; continue it with SIGCONT or end it",
                STOPPED_PEER_GRACE.as_secs()
            ),
        }
    }
}

/// What this process runs as, for a command that may run over several ranks.
pub enum RankRole {
    /// The whole model, or rank 0 of a group driving its followers: the command's work.
    Lead(Box<dyn ModelRunner>),
    /// A follower, which followed rank 0's calls until it stopped: nothing more to do.
    Followed,
}

/// The runner of this process for a command: alone (`--tp 1`), rank 0 of `--tp N` (the
/// followers started, then this rank's shard loaded and wrapped in a [`TpLeader`]), or a
/// follower started by rank 0 (its shard loaded, rank 0's calls followed until it stops).
/// `load` loads a rank's shard of the model; every rank computes `sizing` from the same
/// command line.
pub fn open_ranks(
    backend: &BackendArgs,
    tp: &TpArgs,
    sizing: RunnerSizing,
    load: impl FnOnce(crate::arch::shard::TpShard) -> Result<Model>,
    quiet: bool,
) -> Result<RankRole> {
    let world = tp.world();
    if world == 1 {
        let model = load(tp.shard())?;
        return Ok(RankRole::Lead(
            backend.open_runner(&model, None, sizing, quiet)?,
        ));
    }
    if let Some(rank) = tp.tp_rank.filter(|&r| r > 0) {
        watch_parent(Duration::from_millis(100));
        crate::cleanup::interruptions_follow_parent();
        // Load (and shard) before joining the collective, so a model that cannot be split
        // fails alone instead of leaving its peers waiting.
        let model = load(tp.shard())?;
        let group = tp.group()?.context("a follower belongs to a group")?;
        let mut runner = backend.open_runner(&model, Some(&group), sizing, true)?;
        follow(runner.as_mut(), std::io::stdin().lock())
            .with_context(|| format!("tensor-parallel rank {rank} of {world}"))?;
        return Ok(RankRole::Followed);
    }
    let segment = kernels::allreduce::shm::unique_segment_name("model-tp");
    // Interrupted, rank 0 unlinks the name itself; its followers follow it (see above).
    let registration = crate::cleanup::register_segment(&segment);
    let followers = start_followers(world, &segment)?;
    let model = load(tp.shard())?;
    let group = RankGroup {
        segment: segment.clone(),
        rank: 0,
        world,
        timeout: Duration::from_secs(tp.tp_timeout_secs),
        peer_pids: followers.pids(),
    };
    let local = backend
        .open_runner(&model, Some(&group), sizing, quiet)
        // The watcher may know more than the join saw (a stopped rank it ended).
        .map_err(
            |e| match followers.failure_within(Duration::from_millis(100)) {
                Some(failed) => e.context(failed),
                None => e,
            },
        )?;
    Ok(RankRole::Lead(Box::new(TpLeader {
        local,
        followers,
        segment,
        _registration: registration,
    })))
}

/// The followers of a group: their command pipes, and what their watchers found.
struct Followers {
    world: usize,
    pipes: Vec<(usize, ChildStdin)>,
    /// The first follower that exited while the group was running.
    failed: Arc<Mutex<Option<RankFailed>>>,
    children: Arc<Mutex<Vec<(usize, Child)>>>,
}

impl Followers {
    /// Process ids by rank (0 for rank 0 itself and for a follower already gone).
    fn pids(&self) -> Vec<u32> {
        let mut pids = vec![0; self.world];
        if let Ok(children) = self.children.lock() {
            for (rank, child) in children.iter() {
                pids[*rank] = child.id();
            }
        }
        pids
    }

    /// The first follower that exited, if one has.
    fn failed(&self) -> Option<String> {
        self.failed
            .lock()
            .ok()
            .and_then(|f| f.as_ref().map(ToString::to_string))
    }

    /// The first follower that exited, waiting up to `wait` for its watcher to see it (a
    /// watcher sees an exit within tens of milliseconds; a collective may notice first).
    fn failure_within(&self, wait: Duration) -> Option<String> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            let failed = self.failed();
            if failed.is_some() || std::time::Instant::now() > deadline {
                return failed;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Starts ranks 1..`world` as copies of this command with `--tp-rank R --tp-segment S`, each
/// reading rank 0's calls from its stdin, and a watcher of each.
fn start_followers(world: usize, segment: &str) -> Result<Followers> {
    if !(2..=8).contains(&world) {
        return Err(crate::input::InvalidInput(format!(
            "--tp {world}: tensor parallelism runs 2 to 8 ranks"
        ))
        .into());
    }
    let exe = std::env::current_exe().context("locating the model binary")?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let leader = std::process::id();
    let failed = Arc::new(Mutex::new(None));
    let children = Arc::new(Mutex::new(Vec::new()));
    let mut pipes = Vec::new();
    for rank in 1..world {
        let mut command = Command::new(&exe);
        command
            .args(&args)
            .args(["--tp-rank", &rank.to_string(), "--tp-segment", segment])
            .stdin(Stdio::piped());
        // SAFETY: between fork and exec only async-signal-safe calls (prctl, getppid, _exit).
        unsafe {
            command.pre_exec(move || {
                die_with_parent(leader);
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting tensor-parallel rank {rank}"))?;
        let stdin = child.stdin.take().context("a follower's command pipe")?;
        pipes.push((rank, stdin));
        children
            .lock()
            .map_err(|_| anyhow::anyhow!("follower list lock poisoned"))?
            .push((rank, child));
    }
    // One watcher for all: polls the followers, and records the first that ends or stays
    // stopped.
    {
        let (failed, children) = (failed.clone(), children.clone());
        let mut stopped_clocks: Vec<StoppedClock> =
            (0..world).map(|_| Default::default()).collect();
        std::thread::Builder::new()
            .name("tp-watcher".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_millis(20));
                    let Ok(mut list) = children.lock() else {
                        return;
                    };
                    if list.is_empty() {
                        return;
                    }
                    let mut ended = None;
                    for (rank, child) in list.iter_mut() {
                        if let Ok(Some(status)) = child.try_wait() {
                            ended = Some((*rank, RankEnd::Exited(status)));
                            break;
                        }
                        let state = process_state(child.id());
                        if stopped_clocks[*rank].stopped_beyond(state, STOPPED_PEER_GRACE) {
                            // A stopped process keeps a pending SIGTERM (its parent-death
                            // signal) until continued: end it here, while it is still known.
                            let _ = child.kill();
                            let _ = child.wait();
                            ended = Some((*rank, RankEnd::Stopped));
                            break;
                        }
                    }
                    if let Some((rank, status)) = ended {
                        list.retain(|(r, _)| *r != rank);
                        if let Ok(mut f) = failed.lock()
                            && f.is_none()
                        {
                            *f = Some(RankFailed {
                                rank,
                                world,
                                status,
                            });
                        }
                    }
                }
            })
            .context("starting the follower watcher")?;
    }
    Ok(Followers {
        world,
        pipes,
        failed,
        children,
    })
}

/// A call of rank 0 on its runner, as its followers receive it.
#[derive(Debug, Serialize, Deserialize)]
enum TpCommand {
    AddSequence {
        seq: u32,
    },
    FreeSequence {
        seq: u32,
    },
    Reserve {
        seq: u32,
        tokens: usize,
    },
    Step {
        inputs: Vec<(u32, Vec<u32>)>,
        draws: Vec<Draw>,
    },
    Logits {
        inputs: Vec<(u32, Vec<u32>)>,
        all_rows: bool,
    },
    WarmUp {
        max_batch: usize,
    },
}

/// A [`SampleRow`] on the wire.
#[derive(Debug, Serialize, Deserialize)]
struct Draw {
    temperature: f32,
    top_k: i32,
    top_p: f32,
    seed: u64,
    counter: u64,
}

impl From<&SampleRow> for Draw {
    fn from(r: &SampleRow) -> Self {
        Self {
            temperature: r.temperature,
            top_k: r.top_k,
            top_p: r.top_p,
            seed: r.seed,
            counter: r.counter,
        }
    }
}

impl From<&Draw> for SampleRow {
    fn from(d: &Draw) -> Self {
        SampleRow {
            temperature: d.temperature,
            top_k: d.top_k,
            top_p: d.top_p,
            reserved: 0,
            seed: d.seed,
            counter: d.counter,
        }
    }
}

fn wire_inputs(inputs: &[SeqInput<'_>]) -> Vec<(u32, Vec<u32>)> {
    inputs
        .iter()
        .map(|i| (i.seq.0, i.tokens.to_vec()))
        .collect()
}

/// Writes `bytes` into a follower's command pipe, a dead follower giving `EPIPE` rather than
/// the SIGPIPE that would kill rank 0 without a word (`model` commands other than `serve` take
/// SIGPIPE's default action, so that output into a closed pipe ends them quietly). The
/// signal is blocked for this thread while it writes, and one the write raised is consumed
/// before it is unblocked.
fn write_without_sigpipe(pipe: &mut ChildStdin, bytes: &[u8]) -> std::io::Result<()> {
    // SAFETY: plain signal-mask calls on this thread's mask with initialised sets.
    unsafe {
        let mut pipe_signal: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut pipe_signal);
        libc::sigaddset(&mut pipe_signal, libc::SIGPIPE);
        let mut previous: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, &pipe_signal, &mut previous);
        let written = pipe.write_all(bytes).and_then(|()| pipe.flush());
        if written
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
        {
            let no_wait = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            libc::sigtimedwait(&pipe_signal, std::ptr::null_mut(), &no_wait);
        }
        libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut());
        written
    }
}

/// Rank 0's runner: every call goes to each follower first, then to the local runner.
pub struct TpLeader {
    local: Box<dyn ModelRunner>,
    followers: Followers,
    segment: String,
    _registration: crate::cleanup::Registration,
}

impl TpLeader {
    /// The follower that exited, if one did.
    /// A step that failed as a group: named after the follower that died, where one did.
    fn blame(&self, e: ExecError) -> ExecError {
        if !e.is_fatal() {
            return e;
        }
        match self.followers.failure_within(Duration::from_millis(500)) {
            Some(f) => ExecError::RankLost(format!("{f}; on rank 0: {e}")),
            None => e,
        }
    }

    /// Fails if a follower has exited; else sends `command` to every follower.
    fn send(&mut self, command: &TpCommand) -> Result<(), ExecError> {
        if let Some(f) = self.followers.failed() {
            return Err(ExecError::RankLost(f));
        }
        let mut line = serde_json::to_string(command)
            .map_err(|e| ExecError::Device(format!("encoding a rank command: {e}")))?;
        line.push('\n');
        for (rank, pipe) in &mut self.followers.pipes {
            write_without_sigpipe(pipe, line.as_bytes()).map_err(|e| {
                ExecError::RankLost(format!(
                    "tensor-parallel rank {rank} of {} stopped taking commands: {e}",
                    self.followers.world
                ))
            })?;
        }
        Ok(())
    }
}

impl ModelRunner for TpLeader {
    fn config(&self) -> &ModelConfig {
        self.local.config()
    }

    fn describe(&self) -> String {
        format!(
            "{}, rank 0 of {} (segment {})",
            self.local.describe(),
            self.followers.world,
            self.segment
        )
    }

    fn add_sequence(&mut self) -> SeqId {
        let seq = self.local.add_sequence();
        // A follower that cannot be told fails the next call that returns a result.
        let _ = self.send(&TpCommand::AddSequence { seq: seq.0 });
        seq
    }

    fn free_sequence(&mut self, seq: SeqId) -> Result<(), ExecError> {
        self.send(&TpCommand::FreeSequence { seq: seq.0 })?;
        self.local.free_sequence(seq)
    }

    fn reserve(&mut self, seq: SeqId, tokens: usize) -> Result<(), ExecError> {
        self.send(&TpCommand::Reserve { seq: seq.0, tokens })?;
        self.local.reserve(seq, tokens)
    }

    fn free_pages(&self) -> usize {
        self.local.free_pages()
    }

    fn total_pages(&self) -> usize {
        self.local.total_pages()
    }

    fn step(
        &mut self,
        inputs: &[SeqInput<'_>],
        draws: &[SampleRow],
    ) -> Result<Vec<u32>, ExecError> {
        self.send(&TpCommand::Step {
            inputs: wire_inputs(inputs),
            draws: draws.iter().map(Draw::from).collect(),
        })?;
        self.local.step(inputs, draws).map_err(|e| self.blame(e))
    }

    fn logits(&mut self, inputs: &[SeqInput<'_>], rows: LogitRows) -> Result<Logits, ExecError> {
        self.send(&TpCommand::Logits {
            inputs: wire_inputs(inputs),
            all_rows: rows == LogitRows::All,
        })?;
        self.local.logits(inputs, rows).map_err(|e| self.blame(e))
    }

    fn profile_ops(&mut self) {
        self.local.profile_ops();
    }

    fn op_profile_report(&self) -> Option<String> {
        self.local.op_profile_report()
    }

    fn warm_up(&mut self, max_batch: usize) -> Result<(), ExecError> {
        self.send(&TpCommand::WarmUp { max_batch })?;
        self.local.warm_up(max_batch).map_err(|e| self.blame(e))
    }
}

impl Drop for TpLeader {
    /// Closes the command pipes (each follower then ends its loop and exits) and waits for the
    /// followers a little; the watcher sees no failure in an orderly end.
    fn drop(&mut self) {
        if let Ok(mut children) = self.followers.children.lock() {
            self.followers.pipes.clear();
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            for (_, child) in children.iter_mut() {
                while std::time::Instant::now() < deadline {
                    match child.try_wait() {
                        Ok(Some(_)) | Err(_) => break,
                        Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
                let _ = child.kill();
                let _ = child.wait();
            }
            children.clear();
        }
    }
}

/// A follower's loop: every call rank 0 sends, made on `runner`, until its pipe closes.
pub fn follow(runner: &mut dyn ModelRunner, commands: impl BufRead) -> Result<()> {
    for line in commands.lines() {
        let line = line.context("reading rank 0's commands")?;
        let command: TpCommand =
            serde_json::from_str(&line).with_context(|| format!("a rank command: {line}"))?;
        let inputs_of = |inputs: &[(u32, Vec<u32>)]| -> Vec<(SeqId, Vec<u32>)> {
            inputs.iter().map(|(s, t)| (SeqId(*s), t.clone())).collect()
        };
        match command {
            TpCommand::AddSequence { seq } => {
                let mine = runner.add_sequence();
                if mine.0 != seq {
                    anyhow::bail!("rank 0 made sequence {seq}, this rank {}", mine.0);
                }
            }
            TpCommand::FreeSequence { seq } => runner.free_sequence(SeqId(seq))?,
            TpCommand::Reserve { seq, tokens } => runner.reserve(SeqId(seq), tokens)?,
            TpCommand::Step { inputs, draws } => {
                let owned = inputs_of(&inputs);
                let inputs: Vec<SeqInput<'_>> = owned
                    .iter()
                    .map(|(seq, tokens)| SeqInput { seq: *seq, tokens })
                    .collect();
                let draws: Vec<SampleRow> = draws.iter().map(SampleRow::from).collect();
                // A step that fails on rank 0 fails here too (the same inputs); rank 0 reports it.
                let _ = runner.step(&inputs, &draws);
            }
            TpCommand::Logits { inputs, all_rows } => {
                let owned = inputs_of(&inputs);
                let inputs: Vec<SeqInput<'_>> = owned
                    .iter()
                    .map(|(seq, tokens)| SeqInput { seq: *seq, tokens })
                    .collect();
                let rows = if all_rows {
                    LogitRows::All
                } else {
                    LogitRows::Last
                };
                let _ = runner.logits(&inputs, rows);
            }
            TpCommand::WarmUp { max_batch } => runner.warm_up(max_batch)?,
        }
    }
    Ok(())
}

/// Reports a failed follower as rank 0's error, with the follower's exit code kept where it
/// means refused input (2).
pub fn exit_code_of(failed: &RankFailed) -> u8 {
    if failed.status.code() == Some(2) {
        2
    } else {
        1
    }
}

/// In a freshly forked rank: arms SIGTERM as the parent-death signal, and exits at once if the
/// parent already died before it was armed. Async-signal-safe.
fn die_with_parent(parent: u32) {
    #[cfg(target_os = "linux")]
    // SAFETY: prctl, getppid and _exit are async-signal-safe and touch no Rust state.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
        if libc::getppid() as u32 != parent {
            libc::_exit(1);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = parent;
}

/// In a follower: a thread that stops it within `period` of its parent (rank 0) exiting,
/// removing what [`crate::cleanup`] holds first.
fn watch_parent(period: Duration) {
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    let spawned = std::thread::Builder::new()
        .name("rank-0-watchdog".into())
        .spawn(move || {
            loop {
                std::thread::sleep(period);
                // SAFETY: as above.
                if unsafe { libc::getppid() } != parent {
                    crate::cleanup::remove_all();
                    eprintln!(
                        "Error: tensor-parallel rank 0 (pid {parent}) exited; stopping this rank"
                    );
                    std::process::exit(1);
                }
            }
        });
    drop(spawned);
}

/// Whether a follower's exit status is the SIGPIPE of a closed output, as a lone process would
/// end on `| head -1`.
pub fn ended_by_closed_pipe(status: &ExitStatus) -> bool {
    status.signal() == Some(libc::SIGPIPE)
}

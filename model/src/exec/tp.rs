//! Tensor parallelism on CPU: one OS process per rank, each holding its shard of the weights,
//! summing partial results with the shared-memory all-reduce of `kernels::allreduce` — the
//! same protocol the GPUs will run over CUDA IPC.
//!
//! `model run --tp N` / `model logits --tp N` re-run this binary N times with `--tp-rank R`;
//! rank 0 prints or writes the result, the parent waits for every rank and fails if any does.
//!
//! Ranks die with their launcher, however it ends: each gets SIGTERM as its parent-death signal
//! (`PR_SET_PDEATHSIG`, set between fork and exec), and a watchdog thread in each rank also
//! stops it when its parent changes (the signal's blind spots: a launcher that died before the
//! signal was armed, or a rank started by something else). Either way the rank unlinks the
//! all-reduce segment name on its way out, so nothing is left in `/dev/shm`.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result};
use kernels::allreduce::{AllReduce, CpuCommunicator, CpuConfig};
use kernels::matrix::MatrixView;
use kernels::mla::cache::{CacheError, PagedLatentCache};
use kernels::mla::reference::MlaProblem;
use kernels::moe_gemm::reference::{ExpertInputAmax, ExpertView, Routing};

use crate::exec::cpu::backend::{Backend, TunedCpuBackend};

/// The CPU backend of one tensor-parallel rank.
pub struct TpCpuBackend {
    compute: TunedCpuBackend,
    communicator: Mutex<CpuCommunicator>,
    /// Unlinks the segment name if this rank is interrupted before rank 0 has done so.
    _segment_cleanup: crate::cleanup::Registration,
}

impl TpCpuBackend {
    /// Joins the all-reduce segment `segment` as `rank` of `world`. `max_elements` bounds the
    /// largest partial sum (tokens per forward × hidden); `compute` runs this rank's kernels.
    pub fn join(
        compute: TunedCpuBackend,
        segment: &str,
        rank: usize,
        world: usize,
        max_elements: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let config = CpuConfig {
            timeout,
            capacity_bytes: (max_elements * 4).max(1 << 16),
            ..CpuConfig::default()
        };
        let segment_cleanup = crate::cleanup::register_segment(segment);
        let communicator =
            CpuCommunicator::new(segment, rank, world, config).with_context(|| {
                format!("rank {rank} of {world}: joining all-reduce segment {segment}")
            })?;
        Ok(Self {
            compute,
            communicator: Mutex::new(communicator),
            _segment_cleanup: segment_cleanup,
        })
    }
}

impl Backend for TpCpuBackend {
    fn name(&self) -> &'static str {
        "cpu-tp"
    }

    fn matmul(&self, x: &[f32], tokens: usize, w: MatrixView<'_>, out: &mut [f32]) {
        self.compute.matmul(x, tokens, w, out);
    }

    fn matmul_per_head(&self, x: &[f32], tokens: usize, w: &[MatrixView<'_>], out: &mut [f32]) {
        self.compute.matmul_per_head(x, tokens, w, out);
    }

    fn matmul_many(
        &self,
        x: &[f32],
        tokens: usize,
        ws: &[MatrixView<'_>],
        outs: &mut [&mut [f32]],
    ) {
        self.compute.matmul_many(x, tokens, ws, outs);
    }

    fn moe(
        &self,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
        experts: &[ExpertView<'_>],
        out: &mut [f32],
        amax: Option<&mut ExpertInputAmax>,
    ) {
        self.compute.moe(x, hidden, routing, experts, out, amax);
    }

    fn mla_attention(
        &self,
        cache: &PagedLatentCache,
        problem: &MlaProblem<'_>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result<(), CacheError> {
        self.compute.mla_attention(cache, problem, out, lse)
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), String> {
        let mut communicator = self
            .communicator
            .lock()
            .map_err(|_| "all-reduce lock poisoned".to_string())?;
        // A message larger than the segment's slots (the gathered logits of a long prompt)
        // goes in slot-sized pieces; every rank cuts the same pieces.
        let piece = (communicator.capacity_bytes() / 4).max(1);
        for chunk in data.chunks_mut(piece) {
            communicator
                .all_reduce_f32(chunk, None)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// A rank process that failed, as its launcher reports it.
#[derive(Debug, thiserror::Error)]
#[error("tensor-parallel rank {rank} of {world} failed ({status})")]
pub struct RankFailed {
    pub rank: usize,
    pub world: usize,
    pub status: ExitStatus,
}

/// Starts `world` rank processes of this binary with `args` plus `--tp-rank R --tp-segment S`,
/// and waits for all of them. If one fails, the others are stopped and the error names it.
pub fn launch_ranks(world: usize, args: &[String]) -> Result<()> {
    if !(2..=8).contains(&world) {
        return Err(crate::input::InvalidInput(format!(
            "--tp {world}: tensor parallelism on CPU runs 2 to 8 ranks"
        ))
        .into());
    }
    let exe = std::env::current_exe().context("locating the model binary")?;
    let segment = kernels::allreduce::shm::unique_segment_name("model-tp");
    // Interrupted, the launcher unlinks the name itself; its ranks follow it (see above).
    let _registration = crate::cleanup::register_segment(&segment);
    let launcher = std::process::id();
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..world {
        let mut command = Command::new(&exe);
        command
            .args(args)
            .args(["--tp-rank", &rank.to_string(), "--tp-segment", &segment]);
        // SAFETY: between fork and exec only async-signal-safe calls (prctl, getppid, _exit).
        unsafe {
            command.pre_exec(move || {
                die_with_parent(launcher);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting rank {rank}"))?;
        children.push(child);
    }
    let mut failure = None;
    loop {
        let mut running = 0;
        for (rank, child) in children.iter_mut().enumerate() {
            match child.try_wait()? {
                Some(status) if !status.success() && failure.is_none() => {
                    failure = Some((rank, status))
                }
                Some(_) => {}
                None => running += 1,
            }
        }
        if running == 0 {
            break;
        }
        if failure.is_some() {
            // The survivors' collectives fail by themselves within their timeout; killing
            // them now just saves the wait.
            for child in children.iter_mut() {
                let _ = child.kill();
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // Ranks clean up after themselves; a killed rank 0 may not have, so make sure.
    kernels::allreduce::shm::remove_segment(&segment)
        .with_context(|| format!("removing {segment}"))?;
    match failure {
        // Rank 0 writing into a closed pipe (`model run --tp 2 | head -1`) ends quietly, and
        // so does its launcher, the way a single process would.
        Some((_, status)) if status.signal() == Some(libc::SIGPIPE) => {
            // SAFETY: plain libc calls; SIGPIPE's default action ends the process.
            unsafe {
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                libc::raise(libc::SIGPIPE);
            }
            Err(RankFailed {
                rank: 0,
                world,
                status,
            }
            .into())
        }
        Some((rank, status)) => Err(RankFailed {
            rank,
            world,
            status,
        }
        .into()),
        None => Ok(()),
    }
}

/// In a freshly forked rank: arms SIGTERM as the parent-death signal, and exits at once if the
/// launcher already died before it was armed. Async-signal-safe.
fn die_with_parent(launcher: u32) {
    #[cfg(target_os = "linux")]
    // SAFETY: prctl, getppid and _exit are async-signal-safe and touch no Rust state.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
        if libc::getppid() as u32 != launcher {
            libc::_exit(1);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = launcher;
}

/// In a rank process: a thread that stops the rank within `period` of its parent (the
/// launcher) exiting, removing what [`crate::cleanup`] holds first.
pub fn watch_launcher(period: Duration) {
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    let spawned = std::thread::Builder::new()
        .name("launcher-watchdog".into())
        .spawn(move || {
            loop {
                std::thread::sleep(period);
                // SAFETY: as above.
                if unsafe { libc::getppid() } != parent {
                    crate::cleanup::remove_all();
                    eprintln!("Error: the tensor-parallel launcher (pid {parent}) exited; stopping this rank");
                    std::process::exit(1);
                }
            }
        });
    drop(spawned);
}

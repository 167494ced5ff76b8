//! The all-reduce protocol over POSIX shared memory, one rank per OS process (or thread).
//!
//! The segment layout is [`super::layout::SegmentLayout`]; on the GPU each rank's region is its
//! own CUDA IPC allocation, here they share one segment. Untouched pages cost nothing (tmpfs
//! allocates on first write), so the sparse push inboxes are cheap unless used.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::algorithm::{Algorithm, Transfer, chunk_range, intersect};
use super::element::Element;
use super::layout::{
    HEADER_ABORT, HEADER_CAPACITY, HEADER_MAGIC, HEADER_PUSH, HEADER_WORLD, MAGIC,
    SegmentLayout as Layout,
};
use super::shm::{JoinError, SharedSegment, create_or_join};
use super::topology::Islands;
use super::{AlgorithmPolicy, AllReduce, AllReduceError, ReduceData};

pub use super::layout::MAX_WORLD;
use crate::process::{ProcessState, STOPPED_PEER_GRACE, StoppedClock, process_state};

/// Reasons written into the abort word, so survivors can say why.
const ABORT_TIMEOUT: u64 = 1;
const ABORT_PEER_DIED: u64 = 2;
const ABORT_MISMATCH: u64 = 3;
const ABORT_DROPPED: u64 = 4;
const ABORT_PEER_STOPPED: u64 = 5;

fn abort_reason(code: u64) -> &'static str {
    match code {
        ABORT_TIMEOUT => "it timed out waiting for a peer",
        ABORT_PEER_DIED => "it saw a peer process exit",
        ABORT_MISMATCH => "it saw mismatched collectives",
        ABORT_DROPPED => "it was dropped mid-collective",
        ABORT_PEER_STOPPED => "it saw a peer process stopped",
        _ => "unknown reason",
    }
}

/// How a CPU communicator is set up.
#[derive(Debug, Clone)]
pub struct CpuConfig {
    /// Longest a rank waits for any one peer before failing the collective (and making every
    /// other rank fail too, through the abort word).
    pub timeout: Duration,
    /// Largest message in bytes.
    pub capacity_bytes: usize,
    /// Allocate push inboxes (world × capacity per phase per rank, untouched pages are free).
    pub enable_push: bool,
    /// Islands for the hierarchical algorithm; `None` means two contiguous halves (or one
    /// island for odd world sizes below 4).
    pub islands: Option<Islands>,
    /// Algorithm per message size when called through [`AllReduce`].
    pub policy: AlgorithmPolicy,
    /// The peers' process ids where this rank knows them before they attach (rank 0 started
    /// them), indexed by rank, 0 for unknown: a peer that exits or stays stopped before it
    /// attaches fails the setup at once instead of at `timeout`.
    pub peer_pids: Vec<u32>,
}

impl Default for CpuConfig {
    fn default() -> Self {
        CpuConfig {
            timeout: Duration::from_secs(10),
            capacity_bytes: 1 << 20,
            enable_push: true,
            islands: None,
            policy: AlgorithmPolicy::fixed(Algorithm::OneShot(Transfer::Pull)),
            peer_pids: Vec::new(),
        }
    }
}

/// Default islands: two contiguous halves, as on a 4+4 two-socket host.
pub fn default_islands(world: usize) -> Islands {
    if world >= 2 {
        Islands::contiguous(&[world / 2, world - world / 2]).expect("halves partition")
    } else {
        Islands::single(world)
    }
}

/// One rank's handle on the shared segment.
pub struct CpuCommunicator {
    segment: SharedSegment,
    layout: Layout,
    rank: usize,
    generation: u64,
    config: CpuConfig,
    islands: Islands,
    pids: Vec<u32>,
    stopped_clocks: Vec<StoppedClock>,
    poisoned: Option<String>,
    in_collective: bool,
}

impl CpuCommunicator {
    /// Joins (rank 0: creates) the segment `name` for `world` ranks.
    ///
    /// Rank 0 creates the segment, waits until every rank has mapped it, then unlinks the name,
    /// so nothing is left in `/dev/shm` whatever happens to the ranks afterwards. Other ranks
    /// retry opening until rank 0 has made it. Both sides give up after `config.timeout`.
    pub fn new(
        name: &str,
        rank: usize,
        world: usize,
        config: CpuConfig,
    ) -> Result<Self, AllReduceError> {
        if world == 0 || world > MAX_WORLD || rank >= world {
            return Err(AllReduceError::Setup(format!(
                "rank {rank} of world {world} (1..={MAX_WORLD} ranks)"
            )));
        }
        let islands = config
            .islands
            .clone()
            .unwrap_or_else(|| default_islands(world));
        if islands.world_size() != world {
            return Err(AllReduceError::Setup(format!(
                "islands {} do not cover world {world}",
                islands.to_spec()
            )));
        }
        let layout = Layout::new(world, config.capacity_bytes, config.enable_push);
        let shm_err = |op, source| AllReduceError::Shm {
            op,
            name: name.to_string(),
            source,
        };
        let deadline = Instant::now() + config.timeout;
        let segment = create_or_join(
            name,
            rank,
            layout.total(),
            HEADER_MAGIC,
            MAGIC,
            deadline,
            |s| {
                s.atomic(HEADER_WORLD)
                    .store(world as u64, Ordering::Relaxed);
                s.atomic(HEADER_CAPACITY)
                    .store(layout.capacity as u64, Ordering::Relaxed);
                s.atomic(HEADER_PUSH)
                    .store(u64::from(layout.push), Ordering::Relaxed);
            },
        )
        .map_err(|e| match e {
            JoinError::Io { op, source } => shm_err(op, source),
            JoinError::NotPublished => AllReduceError::Setup(format!(
                "rank {rank}: segment {name:?} did not appear within {:?}",
                config.timeout
            )),
        })?;
        let found = (
            segment.atomic(HEADER_WORLD).load(Ordering::Relaxed),
            segment.atomic(HEADER_CAPACITY).load(Ordering::Relaxed),
            segment.atomic(HEADER_PUSH).load(Ordering::Relaxed),
        );
        let expected = (world as u64, layout.capacity as u64, u64::from(layout.push));
        if found != expected || segment.len() < layout.total() {
            return Err(AllReduceError::Setup(format!(
                "rank {rank}: segment {name:?} has (world, capacity, push) = {found:?}, this rank expects {expected:?}"
            )));
        }
        segment
            .atomic(layout.pid(rank))
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        segment
            .atomic(layout.attached(rank))
            .store(1, Ordering::Release);

        let pids = (0..world)
            .map(|peer| config.peer_pids.get(peer).copied().unwrap_or(0))
            .collect();
        let mut comm = CpuCommunicator {
            segment,
            layout,
            rank,
            generation: 0,
            config,
            islands,
            pids,
            stopped_clocks: (0..world).map(|_| StoppedClock::default()).collect(),
            poisoned: None,
            in_collective: false,
        };
        if rank == 0 {
            for peer in 1..world {
                while comm
                    .segment
                    .atomic(layout.attached(peer))
                    .load(Ordering::Acquire)
                    == 0
                {
                    if Instant::now() > deadline {
                        // Dropping the segment unlinks it.
                        return Err(AllReduceError::Setup(format!(
                            "rank 0: rank {peer} did not attach to {name:?} within {:?}",
                            comm.config.timeout
                        )));
                    }
                    if let Some((pid, state)) = comm.peer_lost(peer) {
                        let what = match state {
                            ProcessState::Gone => "exited",
                            _ => "is stopped (SIGSTOP)",
                        };
                        return Err(AllReduceError::Setup(format!(
                            "rank 0: rank {peer} (pid {pid}) {what} before attaching to {name:?}"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            comm.segment.unlink().map_err(|e| shm_err("unlink", e))?;
        }
        Ok(comm)
    }

    pub fn islands(&self) -> &Islands {
        &self.islands
    }

    pub fn capacity_bytes(&self) -> usize {
        self.layout.capacity
    }

    /// Runs `algorithm` on `data` in place (see [`super::reference_reduce`] for the order).
    pub fn all_reduce_with<T: Element>(
        &mut self,
        algorithm: Algorithm,
        data: &mut [T],
        residual: Option<&[T]>,
    ) -> Result<(), AllReduceError> {
        if let Some(why) = &self.poisoned {
            return Err(AllReduceError::Poisoned(why.clone()));
        }
        let bytes = std::mem::size_of_val(data);
        if bytes > self.layout.capacity {
            return Err(AllReduceError::TooLarge {
                bytes,
                capacity: self.layout.capacity,
            });
        }
        if let Some(r) = residual
            && r.len() != data.len()
        {
            return Err(AllReduceError::ResidualLength {
                residual: r.len(),
                data: data.len(),
            });
        }
        if algorithm.transfer() == Transfer::Push && !self.layout.push {
            return Err(AllReduceError::PushDisabled(algorithm));
        }
        self.generation += 1;
        // The descriptor goes out before any flag of this call; the flags' release stores carry it.
        let descriptor = describe::<T>(algorithm, data.len());
        self.segment
            .atomic(self.layout.descriptor(self.rank, self.parity()))
            .store(descriptor, Ordering::Relaxed);
        self.in_collective = true;
        let result = match algorithm {
            Algorithm::OneShot(t) => self.one_shot(t, data, residual),
            Algorithm::TwoShot(t) => self.two_shot(t, data, residual),
            Algorithm::IslandHierarchical(t) => self.hierarchical(t, data, residual),
        };
        self.in_collective = false;
        if let Err(e) = &result {
            self.poisoned = Some(e.to_string());
        }
        result
    }

    fn parity(&self) -> usize {
        (self.generation % 2) as usize
    }

    fn others(&self) -> Vec<usize> {
        (0..self.layout.world).filter(|&r| r != self.rank).collect()
    }

    /// Makes `src` (elements `range` of the logical message) available to `consumers`, each of
    /// which will read its own sub-range. Pull writes once into this rank's outbox; push writes
    /// each consumer's sub-range into that consumer's inbox.
    fn publish<T: Element>(
        &self,
        transfer: Transfer,
        phase: usize,
        consumers: &[(usize, Range<usize>)],
        range: Range<usize>,
        src: &[T],
    ) {
        debug_assert_eq!(src.len(), range.len());
        let size = std::mem::size_of::<T>();
        let copy = |dst_offset: usize, sub: &Range<usize>| {
            let from = &src[sub.start - range.start..sub.end - range.start];
            // SAFETY: dst_offset + sub.end * size <= capacity (checked at call entry) inside this
            // slot; the protocol guarantees no reader uses this slot (parity) until our flag.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    from.as_ptr().cast::<u8>(),
                    self.segment.base().add(dst_offset + sub.start * size),
                    std::mem::size_of_val(from),
                );
            }
        };
        match transfer {
            Transfer::Pull => copy(self.layout.outbox(self.rank, self.parity(), phase), &range),
            Transfer::Push => {
                for (consumer, sub) in consumers.iter().filter(|(_, sub)| !sub.is_empty()) {
                    debug_assert!(sub.start >= range.start && sub.end <= range.end);
                    copy(
                        self.layout
                            .inbox(*consumer, self.parity(), phase, self.rank),
                        sub,
                    );
                }
            }
        }
    }

    /// Posts this call's generation for `phase` to `consumers` (release: the data written by
    /// `publish` is visible to whoever acquires the flag).
    fn signal(&self, transfer: Transfer, phase: usize, consumers: &[(usize, Range<usize>)]) {
        match transfer {
            Transfer::Pull => self
                .segment
                .atomic(self.layout.pull_flag(self.rank, phase))
                .store(self.generation, Ordering::Release),
            Transfer::Push => {
                for (consumer, _) in consumers {
                    self.segment
                        .atomic(self.layout.push_flag(*consumer, phase, self.rank))
                        .store(self.generation, Ordering::Release);
                }
            }
        }
    }

    /// Waits until `producer` has signalled `phase` of this generation, or fails: on timeout,
    /// on a peer's abort, or when the producer's process is gone.
    fn wait(
        &mut self,
        transfer: Transfer,
        phase: usize,
        producer: usize,
    ) -> Result<(), AllReduceError> {
        let flag_offset = match transfer {
            Transfer::Pull => self.layout.pull_flag(producer, phase),
            Transfer::Push => self.layout.push_flag(self.rank, phase, producer),
        };
        let generation = self.generation;
        let start = Instant::now();
        let mut polls: u64 = 0;
        loop {
            // Flags only grow; a producer can be at most one generation ahead (it cannot start
            // generation g + 2 before we post in g + 1), so ">=" is exact.
            if self.segment.atomic(flag_offset).load(Ordering::Acquire) >= generation {
                break;
            }
            polls += 1;
            if polls < 128 {
                std::hint::spin_loop();
                continue;
            }
            // Oversubscribed hosts (8 ranks on 2 cores) need the producer to get the CPU.
            std::thread::yield_now();
            if polls.is_multiple_of(16) {
                let abort = self.segment.atomic(HEADER_ABORT).load(Ordering::Acquire);
                if abort != 0 {
                    return Err(AllReduceError::Aborted {
                        rank: self.rank,
                        aborted_by: (abort >> 8) as usize - 1,
                        reason: abort_reason(abort & 0xff).into(),
                    });
                }
                let waited = start.elapsed();
                if waited > self.config.timeout {
                    self.abort(ABORT_TIMEOUT);
                    return Err(AllReduceError::Timeout {
                        rank: self.rank,
                        peer: producer,
                        phase,
                        generation,
                        waited,
                    });
                }
                if polls.is_multiple_of(1024) {
                    match self.peer_lost(producer) {
                        Some((pid, ProcessState::Gone)) => {
                            self.abort(ABORT_PEER_DIED);
                            return Err(AllReduceError::PeerDied {
                                rank: self.rank,
                                peer: producer,
                                pid,
                                generation,
                            });
                        }
                        Some((pid, _)) => {
                            self.abort(ABORT_PEER_STOPPED);
                            return Err(AllReduceError::PeerStopped {
                                rank: self.rank,
                                peer: producer,
                                pid,
                                generation,
                            });
                        }
                        None => {}
                    }
                }
            }
        }
        let theirs = self
            .segment
            .atomic(self.layout.descriptor(producer, self.parity()))
            .load(Ordering::Relaxed);
        let ours = self
            .segment
            .atomic(self.layout.descriptor(self.rank, self.parity()))
            .load(Ordering::Relaxed);
        if theirs != ours {
            self.abort(ABORT_MISMATCH);
            return Err(AllReduceError::Mismatch {
                rank: self.rank,
                peer: producer,
                generation,
                theirs: explain(theirs),
                ours: explain(ours),
            });
        }
        Ok(())
    }

    /// The pid of `peer` and its state if it lives in another process that no longer exists,
    /// or that has stayed stopped for [`STOPPED_PEER_GRACE`].
    fn peer_lost(&mut self, peer: usize) -> Option<(u32, ProcessState)> {
        if self.pids[peer] == 0 {
            self.pids[peer] = self
                .segment
                .atomic(self.layout.pid(peer))
                .load(Ordering::Relaxed) as u32;
        }
        let pid = self.pids[peer];
        if pid == 0 || pid == std::process::id() {
            return None;
        }
        match process_state(pid) {
            ProcessState::Gone => Some((pid, ProcessState::Gone)),
            state if self.stopped_clocks[peer].stopped_beyond(state, STOPPED_PEER_GRACE) => {
                Some((pid, state))
            }
            _ => None,
        }
    }

    /// Tells every rank to stop: the first abort wins (a store, not a compare-exchange, to keep
    /// to operations PCIe peers support; any non-zero value makes everyone stop).
    fn abort(&self, reason: u64) {
        let word = self.segment.atomic(HEADER_ABORT);
        if word.load(Ordering::Acquire) == 0 {
            word.store(((self.rank as u64 + 1) << 8) | reason, Ordering::Release);
        }
    }

    /// Elements `range` that `producer` published for `phase` to this rank.
    fn fetch<T: Element>(
        &self,
        transfer: Transfer,
        phase: usize,
        producer: usize,
        range: Range<usize>,
    ) -> &[T] {
        let size = std::mem::size_of::<T>();
        let slot = match transfer {
            Transfer::Pull => self.layout.outbox(producer, self.parity(), phase),
            Transfer::Push => self.layout.inbox(self.rank, self.parity(), phase, producer),
        };
        // SAFETY: in bounds (capacity checked at entry); slots are page aligned so aligned for T;
        // the producer's release flag, acquired in `wait`, orders its writes before these reads,
        // and it does not write this slot again before we signal in the next generation.
        unsafe {
            std::slice::from_raw_parts(
                self.segment
                    .base()
                    .add(slot + range.start * size)
                    .cast::<T>(),
                range.len(),
            )
        }
    }

    /// Waits for `phase` from each of `producers` (in the given order).
    fn wait_all(
        &mut self,
        transfer: Transfer,
        phase: usize,
        producers: &[usize],
    ) -> Result<(), AllReduceError> {
        producers
            .iter()
            .try_for_each(|&p| self.wait(transfer, phase, p))
    }

    /// The fixed-order terms for `range`: `Local` for this rank (its value is in the output
    /// buffer), the producer's published slice for everyone else. Call after `wait_all`.
    fn terms<'a, T: Element>(
        &'a self,
        transfer: Transfer,
        phase: usize,
        order: &[usize],
        range: Range<usize>,
    ) -> Vec<Term<'a, T>> {
        order
            .iter()
            .map(|&r| {
                if r == self.rank {
                    Term::Local
                } else {
                    Term::Remote(self.fetch(transfer, phase, r, range.clone()))
                }
            })
            .collect()
    }

    fn one_shot<T: Element>(
        &mut self,
        t: Transfer,
        data: &mut [T],
        residual: Option<&[T]>,
    ) -> Result<(), AllReduceError> {
        let n = data.len();
        let others = self.others();
        let consumers: Vec<_> = others.iter().map(|&r| (r, 0..n)).collect();
        self.publish(t, 0, &consumers, 0..n, data);
        self.signal(t, 0, &consumers);
        self.wait_all(t, 0, &others)?;
        let order: Vec<usize> = (0..self.layout.world).collect();
        reduce_tiles(data, &self.terms(t, 0, &order, 0..n), residual);
        Ok(())
    }

    fn two_shot<T: Element>(
        &mut self,
        t: Transfer,
        data: &mut [T],
        residual: Option<&[T]>,
    ) -> Result<(), AllReduceError> {
        let (n, world, me) = (data.len(), self.layout.world, self.rank);
        let chunk = |r| chunk_range(n, world, r);
        let mine = chunk(me);
        let others = self.others();
        // Reduce-scatter: rank r reduces chunk r.
        let scatter: Vec<_> = others.iter().map(|&r| (r, chunk(r))).collect();
        self.publish(t, 0, &scatter, 0..n, data);
        self.signal(t, 0, &scatter);
        self.wait_all(t, 0, &others)?;
        let order: Vec<usize> = (0..world).collect();
        reduce_tiles(
            &mut data[mine.clone()],
            &self.terms(t, 0, &order, mine.clone()),
            residual.map(|x| &x[mine.clone()]),
        );
        // All-gather: everyone copies chunk r from rank r.
        let gather: Vec<_> = others.iter().map(|&r| (r, mine.clone())).collect();
        self.publish(t, 1, &gather, mine.clone(), &data[mine.clone()]);
        self.signal(t, 1, &gather);
        for &r in &others {
            self.wait(t, 1, r)?;
            data[chunk(r)].copy_from_slice(self.fetch(t, 1, r, chunk(r)));
        }
        Ok(())
    }

    fn hierarchical<T: Element>(
        &mut self,
        t: Transfer,
        data: &mut [T],
        residual: Option<&[T]>,
    ) -> Result<(), AllReduceError> {
        let (n, me) = (data.len(), self.rank);
        let islands = self.islands.clone();
        let my_island = islands.island_of(me);
        // Each island splits the message into island_size parts; rank at position p owns part p.
        let owned = |r: usize| {
            chunk_range(
                n,
                islands.groups()[islands.island_of(r)].len(),
                islands.position_of(r),
            )
        };
        let mine = owned(me);
        let island = &islands.groups()[my_island];
        let island_peers: Vec<usize> = island.iter().copied().filter(|&r| r != me).collect();
        let remote: Vec<usize> = (0..self.layout.world)
            .filter(|&r| islands.island_of(r) != my_island)
            .collect();

        // Phase 0: reduce-scatter inside the island. The island partial replaces this rank's
        // input in data[mine], rounded to the element type: that is what crosses the slow link
        // (half the bytes for bf16), and the reference rounds there too.
        let scatter: Vec<_> = island_peers.iter().map(|&q| (q, owned(q))).collect();
        self.publish(t, 0, &scatter, 0..n, data);
        self.signal(t, 0, &scatter);
        self.wait_all(t, 0, &island_peers)?;
        reduce_tiles(
            &mut data[mine.clone()],
            &self.terms(t, 0, island, mine.clone()),
            None,
        );

        // Phase 1: exchange partials across islands. Every rank signals every remote rank, even
        // where the ranges do not overlap (tiny messages): that keeps the invariant that each call
        // waits on every rank, which double buffering relies on.
        let exchange: Vec<_> = remote
            .iter()
            .map(|&u| (u, intersect(&owned(u), &mine)))
            .collect();
        self.publish(t, 1, &exchange, mine.clone(), &data[mine.clone()]);
        self.signal(t, 1, &exchange);
        self.wait_all(t, 1, &remote)?;
        // Within a segment between ownership boundaries, each island's partial comes from one
        // rank; reduce segment by segment in island order.
        let mut cuts: Vec<usize> = vec![mine.start, mine.end];
        cuts.extend(
            remote
                .iter()
                .flat_map(|&u| [owned(u).start, owned(u).end])
                .filter(|c| mine.contains(c)),
        );
        cuts.sort_unstable();
        cuts.dedup();
        for segment in cuts.windows(2).map(|w| w[0]..w[1]) {
            let terms: Vec<Term<'_, T>> = islands
                .groups()
                .iter()
                .enumerate()
                .map(|(k, group)| {
                    if k == my_island {
                        return Term::Local;
                    }
                    let owner = *group
                        .iter()
                        .find(|&&u| owned(u).contains(&segment.start))
                        .expect("island parts cover the message");
                    Term::Remote(self.fetch(t, 1, owner, segment.clone()))
                })
                .collect();
            reduce_tiles(
                &mut data[segment.clone()],
                &terms,
                residual.map(|x| &x[segment.clone()]),
            );
        }

        // Phase 2: all-gather inside the island.
        let gather: Vec<_> = island_peers.iter().map(|&q| (q, mine.clone())).collect();
        self.publish(t, 2, &gather, mine.clone(), &data[mine.clone()]);
        self.signal(t, 2, &gather);
        for &q in &island_peers {
            self.wait(t, 2, q)?;
            data[owned(q)].copy_from_slice(self.fetch(t, 2, q, owned(q)));
        }
        Ok(())
    }
}

/// One term of a fixed-order sum.
enum Term<'a, T> {
    /// This rank's own value, read from the output buffer before it is overwritten.
    Local,
    /// A peer's published values for the same range.
    Remote(&'a [T]),
}

/// `out = round(((t0 + t1) + ...) [+ residual])` in f32, element-wise, in tiles small enough for
/// the accumulator to stay in L1 while every term streams through once.
fn reduce_tiles<T: Element>(out: &mut [T], terms: &[Term<'_, T>], residual: Option<&[T]>) {
    const TILE: usize = 1024;
    let mut acc = [0f32; TILE];
    for start in (0..out.len()).step_by(TILE) {
        let end = (start + TILE).min(out.len());
        let acc = &mut acc[..end - start];
        for (i, term) in terms.iter().enumerate() {
            let src = match term {
                Term::Local => &out[start..end],
                Term::Remote(values) => &values[start..end],
            };
            // Start from the first term rather than 0.0: 0.0 + -0.0 would lose the sign.
            if i == 0 {
                acc.iter_mut().zip(src).for_each(|(a, s)| *a = s.to_acc());
            } else {
                acc.iter_mut().zip(src).for_each(|(a, s)| *a += s.to_acc());
            }
        }
        let out = &mut out[start..end];
        match residual {
            Some(r) => out
                .iter_mut()
                .zip(acc.iter())
                .zip(&r[start..end])
                .for_each(|((o, a), r)| *o = T::from_acc(a + r.to_acc())),
            None => out
                .iter_mut()
                .zip(acc.iter())
                .for_each(|(o, a)| *o = T::from_acc(*a)),
        }
    }
}

impl Drop for CpuCommunicator {
    fn drop(&mut self) {
        // A rank unwinding out of a collective must not leave peers waiting out the timeout.
        if self.in_collective {
            self.abort(ABORT_DROPPED);
        }
    }
}

/// Packs (algorithm, dtype, length) so ranks can detect mismatched calls.
fn describe<T: Element>(algorithm: Algorithm, len: usize) -> u64 {
    (algorithm.code() << 56) | (T::DTYPE.code() << 48) | (len as u64 & ((1 << 48) - 1))
}

fn explain(descriptor: u64) -> String {
    let algorithm = Algorithm::ALL
        .get(((descriptor >> 56) as usize).wrapping_sub(1))
        .map_or("?", |a| a.id());
    let dtype = match (descriptor >> 48) & 0xff {
        1 => "bf16",
        2 => "f32",
        _ => "?",
    };
    format!("{algorithm} {dtype} x {}", descriptor & ((1 << 48) - 1))
}

impl AllReduce for CpuCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.layout.world
    }
    fn all_reduce(&mut self, data: ReduceData<'_>) -> Result<Algorithm, AllReduceError> {
        let algorithm = self.config.policy.choose(data.bytes());
        match data {
            ReduceData::Bf16 { data, residual } => {
                self.all_reduce_with(algorithm, data, residual)?
            }
            ReduceData::F32 { data, residual } => {
                self.all_reduce_with(algorithm, data, residual)?
            }
        }
        Ok(algorithm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allreduce::shm::{live_segments, unique_segment_name};
    use half::bf16;

    fn run_threads<F>(
        world: usize,
        config: CpuConfig,
        body: F,
    ) -> Vec<Result<Vec<f32>, AllReduceError>>
    where
        F: Fn(&mut CpuCommunicator) -> Result<Vec<f32>, AllReduceError> + Sync,
    {
        let name = unique_segment_name("unit");
        let results = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let (name, config, body) = (&name, config.clone(), &body);
                    s.spawn(move || {
                        let mut comm = CpuCommunicator::new(name, rank, world, config)?;
                        body(&mut comm)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread panicked"))
                .collect()
        });
        assert!(live_segments(&name).is_empty(), "segment leaked");
        results
    }

    #[test]
    fn every_algorithm_sums_small_integers_exactly() {
        let config = CpuConfig {
            capacity_bytes: 4096,
            timeout: Duration::from_secs(20),
            ..CpuConfig::default()
        };
        let results = run_threads(4, config, |comm| {
            let mut out = Vec::new();
            for algorithm in Algorithm::ALL {
                let mut data: Vec<f32> = (0..37).map(|i| (i * 10 + comm.rank()) as f32).collect();
                comm.all_reduce_with(algorithm, &mut data, None)?;
                out.extend(data);
            }
            Ok(out)
        });
        let expected: Vec<f32> = (0..6)
            .flat_map(|_| (0..37).map(|i| (40 * i + 6) as f32))
            .collect();
        for r in results {
            assert_eq!(r.unwrap(), expected);
        }
    }

    #[test]
    fn fused_residual_and_trait_dispatch() {
        let config = CpuConfig {
            capacity_bytes: 4096,
            policy: AlgorithmPolicy::fixed(Algorithm::TwoShot(Transfer::Push)),
            ..CpuConfig::default()
        };
        let results = run_threads(3, config, |comm| {
            let mut data = vec![bf16::from_f32(1.0 + comm.rank() as f32); 10];
            let residual = vec![bf16::from_f32(0.5); 10];
            let used = comm.all_reduce(ReduceData::Bf16 {
                data: &mut data,
                residual: Some(&residual),
            })?;
            assert_eq!(used, Algorithm::TwoShot(Transfer::Push));
            // The model holds the backend as a trait object.
            let as_trait: &mut dyn AllReduce = comm;
            let mut ones = vec![1.0f32; 4];
            as_trait.all_reduce_f32(&mut ones, None)?;
            assert_eq!(ones, vec![3.0; 4]);
            Ok(data.iter().map(|x| x.to_f32()).collect())
        });
        for r in results {
            assert_eq!(r.unwrap(), vec![6.5; 10]);
        }
    }

    #[test]
    fn mismatched_calls_are_detected_not_summed() {
        let config = CpuConfig {
            capacity_bytes: 4096,
            timeout: Duration::from_secs(5),
            ..CpuConfig::default()
        };
        let results = run_threads(2, config, |comm| {
            let len = if comm.rank() == 0 { 8 } else { 9 };
            let mut data = vec![1.0f32; len];
            comm.all_reduce_with(Algorithm::OneShot(Transfer::Pull), &mut data, None)?;
            Ok(data)
        });
        for r in results {
            let e = r.unwrap_err();
            assert!(
                matches!(
                    e,
                    AllReduceError::Mismatch { .. } | AllReduceError::Aborted { .. }
                ),
                "{e}"
            );
        }
    }

    #[test]
    fn a_stalled_rank_times_out_everyone_and_poisons() {
        let config = CpuConfig {
            capacity_bytes: 4096,
            timeout: Duration::from_millis(300),
            ..CpuConfig::default()
        };
        let start = Instant::now();
        let results = run_threads(3, config, |comm| {
            let mut data = vec![1.0f32; 16];
            comm.all_reduce_with(Algorithm::TwoShot(Transfer::Pull), &mut data, None)?;
            if comm.rank() == 2 {
                // Rank 2 never joins the second collective (stalls until after the others fail).
                std::thread::sleep(Duration::from_millis(900));
                return Ok(data);
            }
            let err = comm
                .all_reduce_with(Algorithm::OneShot(Transfer::Push), &mut data, None)
                .unwrap_err();
            assert!(matches!(
                comm.all_reduce_with(Algorithm::OneShot(Transfer::Push), &mut data, None),
                Err(AllReduceError::Poisoned(_))
            ));
            Err(err)
        });
        assert!(start.elapsed() < Duration::from_secs(3));
        for r in &results[..2] {
            let e = r.as_ref().unwrap_err();
            assert!(
                matches!(
                    e,
                    AllReduceError::Timeout { peer: 2, .. } | AllReduceError::Aborted { .. }
                ),
                "{e}"
            );
        }
    }

    #[test]
    fn rejects_oversized_messages_and_disabled_push() {
        let config = CpuConfig {
            capacity_bytes: 4096,
            enable_push: false,
            ..CpuConfig::default()
        };
        let results = run_threads(1, config, |comm| {
            let mut big = vec![0f32; 2000];
            assert!(matches!(
                comm.all_reduce_with(Algorithm::OneShot(Transfer::Pull), &mut big, None),
                Err(AllReduceError::TooLarge { .. })
            ));
            let mut small = vec![0f32; 4];
            assert!(matches!(
                comm.all_reduce_with(Algorithm::OneShot(Transfer::Push), &mut small, None),
                Err(AllReduceError::PushDisabled(_))
            ));
            Ok(vec![])
        });
        assert!(results[0].is_ok());
    }
}

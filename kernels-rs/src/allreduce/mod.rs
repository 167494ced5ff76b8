//! PCIe-aware all-reduce for tensor parallelism on GPUs without NVLink.
//!
//! * [`topology`]: GPUs, PCIe placement, islands, P2P capability; parsers for
//!   `nvidia-smi topo -m` and sysfs paths.
//! * [`algorithm`]: one-shot, two-shot and island-hierarchical all-reduce, each with push and
//!   pull transfers, their stable ids and the fixed reduction order ([`reference_reduce`]).
//! * [`cpu`]: the protocol run by OS processes (or threads) over POSIX shared memory. It is the
//!   same protocol the CUDA backend will run over CUDA IPC buffers: per-rank buffers that peers
//!   map, generation-counter flags written with release stores and polled with acquire loads
//!   (`st.release.sys` / `ld.acquire.sys` on the GPU), never an atomic read-modify-write on a
//!   peer's memory (peer atomics do not exist over PCIe).
//! * [`tactic`] and `allreduce.cu`: the CUDA kernels' tactics, parameter block and layout view;
//!   [`cuda`] (feature `cuda`): `CudaIpcCommunicator`, the same protocol over CUDA IPC buffers
//!   with an NCCL fallback (feature `nccl`).
//! * [`cost`]: a link-level cost model and simulator that picks the algorithm per size and host,
//!   with parameters fittable from measurements.
//!
//! The model crate calls collectives through the small [`AllReduce`] trait.
//!
//! Binaries: `allreduce-sim` (cost-model table per size and host, writes
//! `bench/results/allreduce-sim.txt`), `allreduce-cpu-bench` (CPU processes, writes
//! `bench/results/allreduce-cpu.txt`), and `allreduce-rank` (one rank process, used by both the
//! multi-process tests and the benchmark).
//!
//! ## Protocol invariants
//!
//! Each call has a generation `g` (1, 2, ...); buffers are double-buffered by `g % 2` and flags
//! hold the generation that last wrote them (monotonic, so they never need resetting). In every
//! call, of every algorithm, each rank waits — directly or through a peer it waits on — for a flag
//! that every other rank posted in that call. So when a rank finishes call `g`, every rank has
//! finished call `g - 1`, and the buffers of parity `g % 2` that the rank overwrites in call
//! `g + 2` are no longer being read. That is why no closing barrier is needed.

pub mod algorithm;
pub mod cost;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod element;
mod kernel_model;
pub mod layout;
pub mod shm;
pub mod tactic;
pub mod testing;
pub mod topology;

pub use algorithm::{Algorithm, Transfer, reference_reduce};
pub use element::{DType, Element};
pub use topology::{IslandLevel, Islands, LinkKind, Topology};

use half::bf16;
use std::time::Duration;

/// Why a collective failed. Every variant is final for the communicator: after an error the
/// shared state is unknown, so later calls return [`AllReduceError::Poisoned`].
#[derive(Debug, thiserror::Error)]
pub enum AllReduceError {
    #[error(
        "rank {rank}: timed out after {waited:?} waiting for rank {peer} (phase {phase}, generation {generation}); that rank stalled or died"
    )]
    Timeout {
        rank: usize,
        peer: usize,
        phase: usize,
        generation: u64,
        waited: Duration,
    },
    #[error("rank {rank}: rank {peer} (pid {pid}) exited during generation {generation}")]
    PeerDied {
        rank: usize,
        peer: usize,
        pid: u32,
        generation: u64,
    },
    #[error(
        "rank {rank}: rank {peer} (pid {pid}) is stopped (SIGSTOP) during generation {generation}; \
         continue it with SIGCONT or end it"
    )]
    PeerStopped {
        rank: usize,
        peer: usize,
        pid: u32,
        generation: u64,
    },
    #[error("rank {rank}: collective aborted by rank {aborted_by} ({reason})")]
    Aborted {
        rank: usize,
        aborted_by: usize,
        reason: String,
    },
    #[error(
        "rank {rank}: rank {peer} called a different collective in generation {generation} (theirs {theirs}, ours {ours})"
    )]
    Mismatch {
        rank: usize,
        peer: usize,
        generation: u64,
        theirs: String,
        ours: String,
    },
    #[error("message of {bytes} bytes exceeds the buffer capacity of {capacity} bytes")]
    TooLarge { bytes: usize, capacity: usize },
    #[error("residual has {residual} elements but data has {data}")]
    ResidualLength { residual: usize, data: usize },
    #[error("{0} needs push inboxes, but the communicator was created with enable_push = false")]
    PushDisabled(Algorithm),
    #[error("communicator is unusable after an earlier error: {0}")]
    Poisoned(String),
    #[error("shared memory {op} of {name:?} failed: {source}")]
    Shm {
        op: &'static str,
        name: String,
        source: std::io::Error,
    },
    #[error("setup failed: {0}")]
    Setup(String),
    /// The GPU backend: no driver, a refused driver call, a missing kernel image, NCCL.
    #[error("device: {0}")]
    Device(String),
}

/// One collective's data: summed across ranks in place, optionally with a fused residual add.
///
/// The residual must be the same on every rank (the replicated hidden state): reducing ranks add
/// their copy once, before the final rounding, and the result is broadcast.
pub enum ReduceData<'a> {
    Bf16 {
        data: &'a mut [bf16],
        residual: Option<&'a [bf16]>,
    },
    F32 {
        data: &'a mut [f32],
        residual: Option<&'a [f32]>,
    },
}

impl ReduceData<'_> {
    pub fn bytes(&self) -> usize {
        match self {
            ReduceData::Bf16 { data, .. } => std::mem::size_of_val(*data),
            ReduceData::F32 { data, .. } => std::mem::size_of_val(*data),
        }
    }
}

/// The collective the tensor-parallel model calls. Object safe so the model can hold a
/// `Box<dyn AllReduce>` and not care which backend (CPU processes, CUDA IPC) is underneath.
pub trait AllReduce {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Sums `data` across all ranks in place; every rank gets identical bits. Returns the
    /// algorithm that ran (chosen by the backend's [`AlgorithmPolicy`]).
    fn all_reduce(&mut self, data: ReduceData<'_>) -> Result<Algorithm, AllReduceError>;

    /// `all_reduce` on bf16 activations, with the residual add fused when given.
    fn all_reduce_bf16(
        &mut self,
        data: &mut [bf16],
        residual: Option<&[bf16]>,
    ) -> Result<Algorithm, AllReduceError> {
        self.all_reduce(ReduceData::Bf16 { data, residual })
    }

    /// `all_reduce` on f32 values.
    fn all_reduce_f32(
        &mut self,
        data: &mut [f32],
        residual: Option<&[f32]>,
    ) -> Result<Algorithm, AllReduceError> {
        self.all_reduce(ReduceData::F32 { data, residual })
    }
}

/// Which algorithm to run for a message size: the cost model's choices, as size thresholds.
#[derive(Debug, Clone, PartialEq)]
pub struct AlgorithmPolicy {
    /// `(largest message in bytes, algorithm)`, ascending by size.
    pub thresholds: Vec<(usize, Algorithm)>,
    /// For messages above every threshold.
    pub largest: Algorithm,
}

impl AlgorithmPolicy {
    pub fn fixed(algorithm: Algorithm) -> Self {
        AlgorithmPolicy {
            thresholds: Vec::new(),
            largest: algorithm,
        }
    }

    pub fn choose(&self, bytes: usize) -> Algorithm {
        self.thresholds
            .iter()
            .find(|(max, _)| bytes <= *max)
            .map(|(_, a)| *a)
            .unwrap_or(self.largest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_picks_by_threshold() {
        let p = AlgorithmPolicy {
            thresholds: vec![
                (16 << 10, Algorithm::OneShot(Transfer::Push)),
                (1 << 20, Algorithm::TwoShot(Transfer::Pull)),
            ],
            largest: Algorithm::IslandHierarchical(Transfer::Pull),
        };
        assert_eq!(p.choose(14336), Algorithm::OneShot(Transfer::Push));
        assert_eq!(p.choose(16 << 10), Algorithm::OneShot(Transfer::Push));
        assert_eq!(p.choose(64 << 10), Algorithm::TwoShot(Transfer::Pull));
        assert_eq!(
            p.choose(8 << 20),
            Algorithm::IslandHierarchical(Transfer::Pull)
        );
    }
}

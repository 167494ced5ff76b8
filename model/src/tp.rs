//! Tensor parallelism on CPU: one OS process per rank, each holding its shard of the weights,
//! summing partial results with the shared-memory all-reduce of `kernels::allreduce` — the
//! same protocol the GPUs will run over CUDA IPC.
//!
//! `model run --tp N` / `model logits --tp N` re-run this binary N times with `--tp-rank R`;
//! rank 0 prints or writes the result, the parent waits for every rank and fails if any does.

use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kernels::allreduce::{AllReduce, CpuCommunicator, CpuConfig};
use kernels::matrix::MatrixView;
use kernels::mla::cache::{CacheError, PagedLatentCache};
use kernels::mla::reference::MlaProblem;
use kernels::moe_gemm::reference::{ExpertInputAmax, ExpertView, Routing};

use crate::backend::{Backend, CpuBackend};

/// The CPU backend of one tensor-parallel rank.
pub struct TpCpuBackend {
    compute: CpuBackend,
    communicator: Mutex<CpuCommunicator>,
}

impl TpCpuBackend {
    /// Joins the all-reduce segment `segment` as `rank` of `world`. `max_elements` bounds the
    /// largest partial sum (tokens per forward × hidden).
    pub fn join(
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
        let communicator =
            CpuCommunicator::new(segment, rank, world, config).with_context(|| {
                format!("rank {rank} of {world}: joining all-reduce segment {segment}")
            })?;
        Ok(Self {
            compute: CpuBackend,
            communicator: Mutex::new(communicator),
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
        communicator
            .all_reduce_f32(data, None)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// Starts `world` rank processes of this binary with `args` plus `--tp-rank R --tp-segment S`,
/// and waits for all of them. If one fails, the others are stopped and the error names it.
pub fn launch_ranks(world: usize, args: &[String]) -> Result<()> {
    if !(2..=8).contains(&world) {
        bail!("--tp {world}: tensor parallelism on CPU runs 2 to 8 ranks");
    }
    let exe = std::env::current_exe().context("locating the model binary")?;
    let segment = kernels::allreduce::shm::unique_segment_name("model-tp");
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..world {
        let child = Command::new(&exe)
            .args(args)
            .args(["--tp-rank", &rank.to_string(), "--tp-segment", &segment])
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
        Some((rank, status)) => bail!("tensor-parallel rank {rank} of {world} failed ({status})"),
        None => Ok(()),
    }
}

//! Where the model runs (`--backend cpu|cuda|cuda-emulated`, `--tp N`), and the runner each
//! makes: the one place `model run`, `model logits`, `model chat` and `model serve` open one.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use kernels::allreduce::cpu::{CpuCommunicator, CpuConfig};
use kernels::arch::Sm;
use kernels::blas::DenseTactic;
use kernels::mla::cache::KvCacheDtype;

use super::cpu::choice::CpuTacticArgs;
use super::cpu::pool::CpuCompute;
use super::cpu::{CpuOptions, cpu_runner};
use super::device::{
    DeviceOps, DeviceOptions, ShmAllReduce, StepCapacity, TpAllReduce, device_runner,
};
use super::error::ExecError;
use super::runner::{ModelRunner, Runner};
use super::tactics::TacticSelector;
use crate::checkpoint::weights::Model;
use crate::checkpoint::{Checkpoint, WeightPlacement};
use crate::input::InvalidInput;

/// Where the forward pass runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The CPU kernels (the reference engine).
    Cpu,
    /// The device executor on a GPU through the CUDA driver (a binary built with
    /// `--features cuda`; kernel images from --ptx-dir).
    Cuda,
    /// The same executor, kernels and launch arguments, run on the CPU by the host execution
    /// layer: what the GPU would compute, without one.
    CudaEmulated,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::CudaEmulated => "cuda-emulated",
        }
    }

    pub fn is_device(self) -> bool {
        self != Self::Cpu
    }
}

/// The backend options every command that runs the model takes.
#[derive(clap::Args, Clone, Debug)]
pub struct BackendArgs {
    /// Where the forward pass runs: `cpu`, `cuda` (a GPU) or `cuda-emulated` (the GPU's
    /// kernels run on the CPU).
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: Backend,
    /// The SM whose kernels and limits `--backend cuda-emulated` runs (120 or 90).
    #[arg(long, default_value = "120", value_parser = parse_sm)]
    pub emulate_sm: Sm,
    /// The compiled kernel images (`scripts/compile-gates.sh` writes them) for `--backend cuda`.
    #[arg(long, env = "KIMI_PTX_DIR", default_value = "ptx")]
    pub ptx_dir: PathBuf,
    /// Who runs the device executor's dense BF16 products: `dense_bf16` (our kernel) or
    /// `cublaslt` (activations rounded to BF16; on `cuda-emulated`, a reference of cuBLASLt's
    /// semantics stands in for the library).
    #[arg(long, default_value = "dense_bf16", value_parser = parse_dense_tactic)]
    pub dense_tactic: DenseTactic,
    /// Share of each GPU's memory the runner may hold (weights, step workspace, latent cache):
    /// the latent cache takes what the weights and the workspace leave of it. `cuda` only.
    #[arg(long, default_value_t = 0.9, value_parser = fraction)]
    pub gpu_memory_utilization: f64,
    #[command(flatten)]
    pub cpu: CpuTacticArgs,
    /// The tuning lab's tactic cache (`autotune --out FILE`, `autotune --cpu --out FILE`): the
    /// tactic of every kernel family per shape bucket, chosen at run time for the step's batch
    /// and context. A missing, corrupt or stale cache warns once and runs the defaults.
    #[arg(long, value_parser = kernels::tactic::cache::cache_path_arg)]
    pub tactics: Option<PathBuf>,
}

impl Default for BackendArgs {
    /// What the command line gives when no backend option is set.
    fn default() -> Self {
        Self {
            backend: Backend::Cpu,
            emulate_sm: Sm::Sm120,
            ptx_dir: PathBuf::from("ptx"),
            dense_tactic: DenseTactic::Ours,
            gpu_memory_utilization: 0.9,
            cpu: CpuTacticArgs::default(),
            tactics: None,
        }
    }
}

/// Tensor parallelism: one rank process per device (or per CPU shard).
#[derive(clap::Args, Clone, Debug)]
pub struct TpArgs {
    /// Ranks (1 = no tensor parallelism; at most 8). The heads, every MLP's intermediate size
    /// and the vocabulary are split over them.
    #[arg(long, visible_alias = "tensor-parallel-size", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=8))]
    pub tp: u16,
    /// Seconds a rank waits for its peers in a collective before failing.
    #[arg(long, default_value_t = 300)]
    pub tp_timeout_secs: u64,
    /// This process's rank, given by the launcher of `--tp N` to the ranks it starts.
    #[arg(long, hide = true)]
    pub tp_rank: Option<usize>,
    /// The shared-memory segment of the ranks' collectives, given by the launcher.
    #[arg(long, hide = true)]
    pub tp_segment: Option<String>,
}

impl Default for TpArgs {
    /// One rank.
    fn default() -> Self {
        Self {
            tp: 1,
            tp_timeout_secs: 300,
            tp_rank: None,
            tp_segment: None,
        }
    }
}

impl TpArgs {
    pub fn world(&self) -> usize {
        usize::from(self.tp)
    }

    pub fn shard(&self) -> crate::arch::shard::TpShard {
        crate::arch::shard::TpShard {
            rank: self.tp_rank.unwrap_or(0),
            world: self.world(),
        }
    }

    /// Whether this process logs nothing of its own: the launcher of `--tp N` ranks (rank 0
    /// speaks for them) or a rank other than 0.
    pub fn quiet(&self) -> bool {
        self.is_launcher() || self.tp_rank.is_some_and(|r| r != 0)
    }

    /// Whether this process is the launcher of `--tp N` ranks (not a rank, not alone).
    pub fn is_launcher(&self) -> bool {
        self.tp > 1 && self.tp_rank.is_none()
    }

    /// This process's place in its group (`None` without tensor parallelism).
    pub fn group(&self) -> Result<Option<RankGroup>> {
        if self.tp == 1 {
            return Ok(None);
        }
        Ok(Some(RankGroup {
            segment: self
                .tp_segment
                .clone()
                .context("--tp-rank needs --tp-segment")?,
            rank: self
                .tp_rank
                .context("a tensor-parallel rank needs --tp-rank")?,
            world: self.world(),
            timeout: Duration::from_secs(self.tp_timeout_secs),
            peer_pids: Vec::new(),
        }))
    }
}

/// A rank's place in its tensor-parallel group: the all-reduce segment every rank joins.
#[derive(Clone, Debug)]
pub struct RankGroup {
    pub segment: String,
    pub rank: usize,
    pub world: usize,
    pub timeout: Duration,
    /// The other ranks' process ids by rank, where this rank started them (rank 0); empty
    /// on a follower.
    pub peer_pids: Vec<u32>,
}

/// What a runner is sized for.
#[derive(Clone, Copy, Debug)]
pub struct RunnerSizing {
    pub kv_dtype: KvCacheDtype,
    /// Latent cache tokens over every sequence (on `cuda`, at least this many; the cache takes
    /// what `--gpu-memory-utilization` leaves).
    pub cache_tokens: usize,
    /// Tokens per step and rows of logits per step.
    pub capacity: StepCapacity,
    /// On a GPU, the cache takes what `--gpu-memory-utilization` leaves (at least
    /// `cache_tokens`), as a server's does; else exactly `cache_tokens`, as a run's.
    pub fill_memory: bool,
}

pub fn parse_sm(s: &str) -> std::result::Result<Sm, String> {
    Sm::parse(s).ok_or_else(|| format!("{s:?}: expected 120 or 90"))
}

fn parse_dense_tactic(s: &str) -> std::result::Result<DenseTactic, String> {
    s.parse()
        .map_err(|e: kernels::tactic::TacticError| e.to_string())
}

fn fraction(text: &str) -> std::result::Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("{text:?}: expected a fraction in (0, 1]")),
    }
}

impl BackendArgs {
    /// Refuses, before anything is read, what cannot run: `--backend cuda` in a binary without
    /// the `cuda` feature or on a machine without the driver library, and device options given
    /// to the CPU backend.
    pub fn check_available(&self) -> Result<()> {
        if self.backend == Backend::Cpu && self.dense_tactic != DenseTactic::Ours {
            return Err(InvalidInput(format!(
                "--dense-tactic {} chooses the device executor's dense products; the CPU backend \
                 has its own (use --backend cuda or cuda-emulated)",
                self.dense_tactic
            ))
            .into());
        }
        if self.backend != Backend::Cuda {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        if !kernels::cuda::driver_present() {
            return Err(InvalidInput(format!(
                "--backend cuda: {}",
                kernels::device::DeviceError::NoDriver
            ))
            .into());
        }
        #[cfg(not(feature = "cuda"))]
        return Err(InvalidInput(NO_CUDA.into()).into());
        #[cfg(feature = "cuda")]
        Ok(())
    }

    /// [`check_available`](Self::check_available), and a latent cache the backend reads: the
    /// device kernels read BF16 and FP8, not the CPU reference's FP32.
    pub fn check(&self, kv_dtype: KvCacheDtype) -> Result<()> {
        self.check_available()?;
        if self.backend.is_device() && kv_dtype == KvCacheDtype::F32 {
            return Err(InvalidInput(
                "the device kernels read a bf16 or fp8 latent cache; pass --kv-dtype bf16 or fp8 \
                 (f32 is the CPU reference's)"
                    .into(),
            )
            .into());
        }
        Ok(())
    }

    /// Where this backend reads `checkpoint`'s weights from: the CPU as `--weights` asks; a
    /// device uploads from the populated file mapping (a host copy would only be read once).
    pub fn weight_placement(&self, checkpoint: &Checkpoint) -> WeightPlacement {
        match self.backend {
            Backend::Cpu => self.cpu.placement(checkpoint),
            Backend::Cuda | Backend::CudaEmulated => WeightPlacement::Mapped,
        }
    }

    /// Makes the runner of `model` (this rank's shard under tensor parallelism) on this
    /// backend, joining `group`'s all-reduce. Logs the device, the tactics and the memory held
    /// unless `quiet`.
    pub fn open_runner(
        &self,
        model: &Model,
        group: Option<&RankGroup>,
        sizing: RunnerSizing,
        quiet: bool,
    ) -> Result<Box<dyn ModelRunner>> {
        super::tactics::check_cache_model(self.tactics.as_deref(), &model.config)?;
        match self.backend {
            Backend::Cpu => {
                let tactic = self
                    .cpu
                    .choose(self.tactics.as_deref(), &model.config, quiet);
                let compute = CpuCompute::tuned(tactic).map_err(anyhow::Error::msg)?;
                let mut runner = cpu_runner(
                    model,
                    CpuOptions {
                        kv_dtype: sizing.kv_dtype,
                        cache_tokens: sizing.cache_tokens,
                        compute,
                        device_roundings: false,
                    },
                );
                if let Some(g) = group {
                    let (communicator, registration) = join_cpu_group(
                        g,
                        sizing.capacity.tokens.max(sizing.capacity.logit_rows)
                            * model.config.hidden_size,
                    )?;
                    runner
                        .ops_mut()
                        .set_communicator(communicator, registration);
                }
                Ok(Box::new(runner))
            }
            Backend::CudaEmulated => {
                let dev = cuda_host::HostDevice::new(self.emulate_sm);
                self.open_device(dev, model, group, sizing, quiet, |dev, g| {
                    let joined = ShmAllReduce::join(
                        dev,
                        &g.segment,
                        g.rank,
                        g.world,
                        largest_message(model, sizing),
                        g.timeout,
                    )
                    .with_context(|| {
                        format!(
                            "rank {} of {}: joining the device all-reduce",
                            g.rank, g.world
                        )
                    })?;
                    Ok(Box::new(joined))
                })
            }
            Backend::Cuda => self.open_gpu(model, group, sizing, quiet),
        }
    }

    /// The device executor of `model` on `dev`, joined to `group`'s all-reduce through `join`
    /// (each device kind has its own), its memory logged unless `quiet`.
    fn open_device<D: kernels::device::Device + 'static>(
        &self,
        dev: D,
        model: &Model,
        group: Option<&RankGroup>,
        sizing: RunnerSizing,
        quiet: bool,
        join: impl FnOnce(&D, &RankGroup) -> Result<Box<dyn TpAllReduce<D>>>,
    ) -> Result<Box<dyn ModelRunner>> {
        let world = group.map_or(1, |g| g.world);
        let options = self.device_options(model, world, sizing, quiet, &dev)?;
        let mut runner = device_runner(dev, model, options).map_err(refuse)?;
        if let Some(g) = group {
            let joined = join(runner.ops().device(), g)?;
            runner.ops_mut().set_all_reduce(joined)?;
        }
        log_memory(&runner, sizing.kv_dtype, quiet);
        Ok(Box::new(runner))
    }

    /// The device executor's options for `dev`: the tactics for its SM and this rank's share
    /// of `world` (with `--tactics FILE`, chosen per step from the cache), logged.
    fn device_options<D: kernels::device::Device>(
        &self,
        model: &Model,
        world: usize,
        sizing: RunnerSizing,
        quiet: bool,
        dev: &D,
    ) -> Result<DeviceOptions> {
        let sm = dev.sm()?;
        // A driver-only machine has no cuBLASLt: its products then run on our kernel.
        let (dense, fallback) = self.dense_tactic.available_on(dev)?;
        if let Some(why) = fallback.filter(|_| !quiet) {
            eprintln!("{why}");
        }
        let (selector, warning) = TacticSelector::from_cache(
            self.tactics.as_deref(),
            sm,
            &model.config,
            sizing.kv_dtype,
            world,
            dense,
        );
        if let Some(w) = warning.filter(|_| !quiet) {
            eprintln!("{w}");
        }
        // The tactics of a one-sequence decode step, also what a run without a cache runs.
        let first = selector.select(1, 4096).map_err(refuse)?.executor();
        if !quiet && crate::start_details::start_details_shown() {
            eprintln!(
                "device: {}; tactics{}: mla_decode {}, moe_gemm {}, dense {}",
                dev.describe(),
                if self.tactics.is_some() {
                    " per step from the tactic cache, first"
                } else {
                    ""
                },
                first.mla.id(),
                first.moe.map_or("-".into(), |t| t.id()),
                first.dense
            );
        }
        Ok(DeviceOptions {
            kv_dtype: sizing.kv_dtype,
            cache_tokens: sizing.cache_tokens,
            capacity: sizing.capacity,
            tactics: first,
            selector: self.tactics.is_some().then_some(selector),
            fill_memory: sizing.fill_memory.then_some(self.gpu_memory_utilization),
            quiet,
        })
    }

    /// One GPU per rank: rank R on device R, round-robin where the ranks outnumber the devices.
    #[cfg(feature = "cuda")]
    fn open_gpu(
        &self,
        model: &Model,
        group: Option<&RankGroup>,
        sizing: RunnerSizing,
        quiet: bool,
    ) -> Result<Box<dyn ModelRunner>> {
        let ordinal = match group {
            Some(g) => kernels::cuda::rank_device(g.rank)
                .map_err(|e| InvalidInput(format!("--backend cuda: {e}")))?,
            None => 0,
        };
        let dev = kernels::cuda::GpuContext::new(ordinal, &self.ptx_dir)
            .map_err(|e| InvalidInput(format!("--backend cuda: {e}")))?;
        self.open_device(dev, model, group, sizing, quiet, |_, g| {
            let joined = super::device::IpcAllReduce::join(
                ordinal,
                &self.ptx_dir,
                &g.segment,
                g.rank,
                g.world,
                largest_message(model, sizing),
                g.timeout,
            )
            .with_context(|| {
                format!(
                    "rank {} of {}: joining the CUDA IPC all-reduce",
                    g.rank, g.world
                )
            })?;
            Ok(Box::new(joined))
        })
    }

    #[cfg(not(feature = "cuda"))]
    fn open_gpu(
        &self,
        _: &Model,
        _: Option<&RankGroup>,
        _: RunnerSizing,
        _: bool,
    ) -> Result<Box<dyn ModelRunner>> {
        Err(InvalidInput(NO_CUDA.into()).into())
    }
}

#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str = "--backend cuda: no CUDA driver support in this binary (built without the \
     `cuda` feature; rebuild with `cargo build --release -p model --features cuda`)";

/// Joins the CPU all-reduce segment `segment` as `rank` of `world` (see
/// [`CpuOps::set_communicator`](crate::exec::cpu::CpuOps::set_communicator)).
/// `max_elements` bounds the largest partial sum (tokens per forward × hidden).
pub fn join_cpu_group(
    group: &RankGroup,
    max_elements: usize,
) -> Result<(CpuCommunicator, crate::cleanup::Registration)> {
    let RankGroup {
        segment,
        rank,
        world,
        timeout,
        peer_pids,
    } = group;
    let (rank, world) = (*rank, *world);
    let config = CpuConfig {
        timeout: *timeout,
        capacity_bytes: (max_elements * 4).max(1 << 16),
        peer_pids: peer_pids.clone(),
        ..CpuConfig::default()
    };
    // Unlinks the segment name if this rank is interrupted before rank 0 has done so.
    let registration = crate::cleanup::register_segment(segment);
    let communicator = CpuCommunicator::new(segment, rank, world, config)
        .with_context(|| format!("rank {rank} of {world}: joining all-reduce segment {segment}"))?;
    Ok((communicator, registration))
}

/// Bytes of the largest partial sum a step all-reduces.
fn largest_message(model: &Model, sizing: RunnerSizing) -> usize {
    sizing.capacity.tokens.max(sizing.capacity.logit_rows) * model.config.hidden_size * 4
}

/// A model or option the device kernels do not run is refused before any work (exit code 2).
fn refuse(e: ExecError) -> anyhow::Error {
    if e.is_unsupported() {
        InvalidInput(e.to_string()).into()
    } else {
        e.into()
    }
}

fn log_memory<D: kernels::device::Device>(
    runner: &Runner<DeviceOps<D>>,
    kv_dtype: KvCacheDtype,
    quiet: bool,
) {
    if quiet || !crate::start_details::start_details_shown() {
        return;
    }
    let bytes = runner.ops().device_bytes();
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "device memory: weights {:.1} MiB, latent cache {:.1} MiB ({}, {} tokens), workspace {:.1} MiB",
        mib(bytes.weights),
        mib(bytes.cache),
        kv_dtype.id(),
        runner.total_pages() * kernels::mla::cache::PAGE_TOKENS,
        mib(bytes.workspace)
    );
}

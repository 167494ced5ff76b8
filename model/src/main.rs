//! `model`: the command-line front end.
//!
//! Errors print as one `Error:` line with the cause chain; the exit code is 2 for input the
//! engine refuses (arguments, config, checkpoint files, outputs that would destroy an input)
//! and 1 for a failure while working. A panic is a bug: it is reported the same way with exit
//! code 1, never Rust's 101.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use kernels::cpu_tactic::CpuTactic;
use kernels::formats::NVFP4_BLOCK;
use kernels::formats::nvfp4::Nvfp4Matrix;
use kernels::mla::cache::{KvCacheDtype, PAGE_TOKENS};
use model::backend::{Backend, CpuBackend, TunedCpuBackend};
use model::checkpoint::{Checkpoint, CheckpointError, WeightPlacement};
use model::checkpoint_writer::{OutputKind, OwnedTensor, StagedOutput, write_file};
use model::config::{ConfigError, KvCacheQuant, ModelConfig};
use model::cpu_choice::CpuTacticArgs;
use model::executor::{ShmAllReduce, TpAllReduce};
use model::forward::{ForwardError, LogitRows, Model, SeqInput, forward_bytes};
use model::generate::{
    GenerationRequest, GenerationResult, GenerationTiming, generate, generate_with,
};
use model::generator::{Preset, default_checkpoint, generate_checkpoint};
use model::input::{InvalidInput, TokenIds, check_memory, largest_fitting};
use model::nvfp4_file::{nvfp4_weight_names, read_nvfp4};
use model::op_profile::ProfiledBackend;
use model::plan::{PlanRequest, plan};
use model::quantize::{quantize_checkpoint, random_tokens};
use model::sampler::SamplingParams;
use model::serving_cli::{self, ChatArgs, ServeArgs, TokenizeArgs};
use model::tensor_file::{TensorFile, TensorFileError};
use model::tp::{self, RankFailed, TpCpuBackend};
use model::weights::TpShard;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

#[derive(Parser)]
#[command(
    name = "model",
    version,
    about = "Kimi-K2.5-NVFP4 on CPU and GPU: chat, serve, run, score, generate, quantize, plan, inspect"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum KvDtypeArg {
    /// What the checkpoint asks for (`kv_cache_quant_algo`), else BF16.
    Auto,
    /// Full precision (a reference, not a deployment choice).
    F32,
    Bf16,
    Fp8,
}

#[derive(Subcommand)]
enum Command {
    /// Chat in the terminal: streamed answers, reasoning dimmed, tok/s (default: the small
    /// trained `kimi-chat-tiny`). With no command at all, `model` asks it one question.
    Chat(ChatArgs),
    /// An OpenAI-compatible HTTP server with continuous batching (`/v1/chat/completions`,
    /// `/v1/completions`, `/v1/models`, `/health`, `/metrics`).
    Serve(ServeArgs),
    /// Text on stdin to token ids, printed as one JSON array (needs only the tokenizer files).
    Tokenize(TokenizeArgs),
    /// Run the decode loop on CPU (default: the generated `mini` model, made once and cached).
    Run(RunArgs),
    /// Score a prompt: logits for every position from one prefill, as float32 `[T, vocab]`.
    Logits(LogitsArgs),
    /// Compare two `[T, vocab]` logits tensors per position (rel L2, top-1), e.g. a device
    /// backend's against the CPU's or a golden; exit 1 when a position exceeds the bound.
    CompareLogits {
        /// `FILE[:TENSOR]` (default tensor `logits`).
        candidate: String,
        /// `FILE[:TENSOR]`, e.g. `golden.safetensors:logits_w4a4`.
        reference: String,
        /// The largest relative L2 error a position may have (unless --as-close-as).
        #[arg(long, default_value_t = 1e-2)]
        max_rel_l2: f64,
        /// Instead of --max-rel-l2: pass when the candidate's median error is at most 1.5×
        /// this other candidate's and its top-1 agreement at most 0.1 lower (a device backend
        /// "as close to the golden as the CPU", where a random model's near-tied expert
        /// choices make pointwise bounds meaningless).
        #[arg(long, value_name = "FILE[:TENSOR]")]
        as_close_as: Option<String>,
    },
    /// Write a random-weight model in the Kimi-K2.5-NVFP4 layout.
    GenerateCheckpoint {
        #[arg(long, value_enum)]
        preset: Preset,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 20261129)]
        seed: u64,
        /// Replace an existing output as a whole (without it, only a new or empty folder).
        #[arg(long)]
        force: bool,
    },
    /// Quantize a BF16 DeepSeek-V3 / Kimi checkpoint's routed experts to NVFP4 (ModelOpt
    /// layout), calibrating `input_scale` on a forward pass. Given a single `.safetensors`
    /// file instead, quantizes each 2-D `*.weight` tensor in it.
    Quantize {
        #[arg(long)]
        input: PathBuf,
        /// A new folder (or file); never the input, inside it, or around it.
        #[arg(long)]
        output: PathBuf,
        #[arg(long, default_value_t = 256)]
        calib_tokens: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Replace an existing output as a whole (without it, only a new or empty folder).
        #[arg(long)]
        force: bool,
    },
    /// Memory per GPU under tensor parallelism and the longest context that fits.
    Plan(PlanArgs),
    /// The launch list of one decode step of a rank, recorded from the device executor on a
    /// dry device (no kernel runs, no weights are held): kernel, grid, bytes per launch, and
    /// totals per kernel.
    LaunchList(LaunchListArgs),
    /// Summarize a checkpoint directory or one safetensors file.
    Inspect { path: PathBuf },
}

/// Where `checkpoint`'s weights go for `backend`: the CPU backend's choice, the mapping for
/// the others.
fn placement(cpu: &CpuTacticArgs, backend: BackendArg, checkpoint: &Checkpoint) -> WeightPlacement {
    match backend {
        BackendArg::Cpu => cpu.placement(checkpoint),
        _ => WeightPlacement::Mapped,
    }
}

/// Tensor parallelism: N rank processes on CPU with the shared-memory all-reduce.
#[derive(clap::Args, Clone)]
struct TpArgs {
    /// Ranks (1 = no tensor parallelism; at most 8).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=8))]
    tp: u16,
    /// Seconds a rank waits for its peers in a collective before failing.
    #[arg(long, default_value_t = 300)]
    tp_timeout_secs: u64,
    #[arg(long, hide = true)]
    tp_rank: Option<usize>,
    #[arg(long, hide = true)]
    tp_segment: Option<String>,
}

/// `model run` on a device: the decode loop over the executor.
struct RunOnDevice<'a> {
    model: &'a Model,
    kv_dtype: KvCacheDtype,
    cache_tokens: usize,
    max_rows: usize,
    batch: usize,
    requests: &'a [GenerationRequest],
    quiet: bool,
    /// Tensor-parallel ranks (the model is this rank's shard).
    world: usize,
    dense: kernels::blas::DenseTactic,
}

impl DeviceJob for RunOnDevice<'_> {
    type Output = (Vec<GenerationResult>, GenerationTiming);
    fn run<D: kernels::device::Device + 'static>(
        self,
        dev: D,
        all_reduce: Option<Box<dyn TpAllReduce<D>>>,
    ) -> Result<Self::Output> {
        let capacity = model::executor::StepCapacity {
            tokens: self.max_rows,
            logit_rows: self.batch,
        };
        let mut ex = executor_on(
            dev,
            self.model,
            self.kv_dtype,
            self.cache_tokens,
            capacity,
            self.quiet,
            (self.world, self.dense),
        )?;
        if let Some(all_reduce) = all_reduce {
            ex.set_all_reduce(all_reduce)?;
        }
        ex.set_graphs(true);
        Ok(generate_with(&mut ex, self.requests, |_, _| {})?)
    }
}

/// `model logits` on a device: one prefill step, every row's logits read back.
struct LogitsOnDevice<'a> {
    model: &'a Model,
    kv_dtype: KvCacheDtype,
    tokens: &'a [u32],
    quiet: bool,
    world: usize,
    dense: kernels::blas::DenseTactic,
}

impl DeviceJob for LogitsOnDevice<'_> {
    type Output = model::forward::Logits;
    fn run<D: kernels::device::Device + 'static>(
        self,
        dev: D,
        all_reduce: Option<Box<dyn TpAllReduce<D>>>,
    ) -> Result<Self::Output> {
        use model::executor::{StepOutput, StepResult};
        let n = self.tokens.len();
        let capacity = model::executor::StepCapacity {
            tokens: n,
            logit_rows: n,
        };
        let mut ex = executor_on(
            dev,
            self.model,
            self.kv_dtype,
            n,
            capacity,
            self.quiet,
            (self.world, self.dense),
        )?;
        if let Some(all_reduce) = all_reduce {
            ex.set_all_reduce(all_reduce)?;
        }
        let seq = ex.add_sequence();
        let step = ex.step(
            &[SeqInput {
                seq,
                tokens: self.tokens,
            }],
            LogitRows::All,
            StepOutput::Logits,
        );
        match step.map_err(ForwardError::from)? {
            StepResult::Logits(l) => Ok(l),
            StepResult::Greedy(_) | StepResult::Sampled(_) => unreachable!("asked for logits"),
        }
    }
}

/// Where the forward pass runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum BackendArg {
    /// The CPU forward pass (the reference engine).
    Cpu,
    /// The device-resident executor on a GPU through the CUDA driver (a binary built with
    /// `--features cuda`; kernel images from --ptx-dir).
    Cuda,
    /// The same executor, kernels and launch arguments, run on the CPU by the host execution
    /// layer: what the GPU would compute, without one.
    CudaEmulated,
}

impl BackendArg {
    fn name(self) -> &'static str {
        match self {
            BackendArg::Cpu => "cpu",
            BackendArg::Cuda => "cuda",
            BackendArg::CudaEmulated => "cuda-emulated",
        }
    }
}

#[derive(clap::Args, Clone)]
struct DeviceArgs {
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendArg,
    /// The SM whose kernels and limits `--backend cuda-emulated` runs (120 or 90).
    #[arg(long, default_value = "120", value_parser = parse_sm)]
    emulate_sm: kernels::arch::Sm,
    /// The compiled kernel images (`scripts/compile-gates.sh` writes them) for `--backend cuda`.
    #[arg(long, env = "KIMI_PTX_DIR", default_value = "ptx")]
    ptx_dir: PathBuf,
    /// Who runs the device executor's dense BF16 products: `dense_bf16` (our kernel) or
    /// `cublaslt` (activations rounded to BF16; on `cuda-emulated`, a reference of cuBLASLt's
    /// semantics stands in for the library).
    #[arg(long, default_value = "dense_bf16", value_parser = parse_dense_tactic)]
    dense_tactic: kernels::blas::DenseTactic,
}

fn parse_dense_tactic(s: &str) -> std::result::Result<kernels::blas::DenseTactic, String> {
    s.parse()
        .map_err(|e: kernels::tactic::TacticError| e.to_string())
}

/// Work that runs on whichever device `--backend` names, as one rank of a tensor-parallel
/// group when `all_reduce` is given.
trait DeviceJob {
    type Output;
    fn run<D: kernels::device::Device + 'static>(
        self,
        dev: D,
        all_reduce: Option<Box<dyn TpAllReduce<D>>>,
    ) -> Result<Self::Output>;
}

/// This process's place in a tensor-parallel group on a device backend.
struct DeviceRank<'a> {
    segment: &'a str,
    rank: usize,
    world: usize,
    /// The largest partial sum a step all-reduces.
    capacity_bytes: usize,
    timeout: std::time::Duration,
}

impl TpArgs {
    /// This rank's place in its group (`None` without tensor parallelism); `max_elements`
    /// bounds the FP32 partial sums of one step.
    fn device_rank(&self, max_elements: usize) -> Result<Option<DeviceRank<'_>>> {
        if self.tp == 1 {
            return Ok(None);
        }
        Ok(Some(DeviceRank {
            segment: self
                .tp_segment
                .as_deref()
                .context("--tp-rank needs --tp-segment")?,
            rank: self
                .tp_rank
                .context("a tensor-parallel rank needs --tp-rank")?,
            world: self.world(),
            capacity_bytes: max_elements * 4,
            timeout: std::time::Duration::from_secs(self.tp_timeout_secs),
        }))
    }
}

/// Opens the device of `args` (not `cpu`) and runs `job` on it, joining the tensor-parallel
/// group of `tp` if there is one. No driver, no device, or a binary without the `cuda`
/// feature is refused at once (exit code 2).
fn on_device<J: DeviceJob>(
    args: &DeviceArgs,
    tp: &TpArgs,
    max_elements: usize,
    job: J,
) -> Result<J::Output> {
    let group = tp.device_rank(max_elements)?;
    // Interrupted before every rank attached (the segment unlinks itself after), the name goes.
    let _segment_cleanup = group
        .as_ref()
        .map(|g| model::cleanup::register_segment(g.segment));
    match args.backend {
        BackendArg::Cpu => unreachable!("the CPU backend does not use the device executor"),
        BackendArg::CudaEmulated => {
            let dev = cuda_host::HostDevice::new(args.emulate_sm);
            let all_reduce = match &group {
                Some(g) => {
                    let joined = ShmAllReduce::join(
                        &dev,
                        g.segment,
                        g.rank,
                        g.world,
                        g.capacity_bytes,
                        g.timeout,
                    )
                    .with_context(|| {
                        format!(
                            "rank {} of {}: joining the device all-reduce",
                            g.rank, g.world
                        )
                    })?;
                    Some(Box::new(joined) as Box<dyn TpAllReduce<_>>)
                }
                None => None,
            };
            job.run(dev, all_reduce)
        }
        BackendArg::Cuda => open_gpu(args, group.as_ref(), job),
    }
}

/// Refuses `--backend cuda` at once, before any work, where it cannot run: a binary without
/// the `cuda` feature, or no driver library on this machine; and a device option given to the
/// CPU backend.
fn check_backend_available(args: &DeviceArgs) -> Result<()> {
    if args.backend == BackendArg::Cpu && args.dense_tactic != kernels::blas::DenseTactic::Ours {
        return Err(InvalidInput(format!(
            "--dense-tactic {} chooses the device executor's dense products; the CPU backend \
             has its own (use --backend cuda or cuda-emulated)",
            args.dense_tactic
        ))
        .into());
    }
    if args.backend != BackendArg::Cuda {
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
    return Err(InvalidInput(
        "--backend cuda: no CUDA driver support in this binary (built without the `cuda` \
         feature; rebuild with `cargo build --release -p model --features cuda`)"
            .into(),
    )
    .into());
    #[cfg(feature = "cuda")]
    Ok(())
}

/// One GPU per rank: rank R runs on device R.
#[cfg(feature = "cuda")]
fn open_gpu<J: DeviceJob>(
    args: &DeviceArgs,
    group: Option<&DeviceRank<'_>>,
    job: J,
) -> Result<J::Output> {
    let ordinal = match group {
        Some(g) => kernels::cuda::rank_device(g.rank)
            .map_err(|e| InvalidInput(format!("--backend cuda: {e}")))?,
        None => 0,
    };
    let dev = kernels::cuda::GpuContext::new(ordinal, &args.ptx_dir)
        .map_err(|e| InvalidInput(format!("--backend cuda: {e}")))?;
    let all_reduce = match group {
        Some(g) => {
            let joined = model::executor::IpcAllReduce::join(
                ordinal,
                &args.ptx_dir,
                g.segment,
                g.rank,
                g.world,
                g.capacity_bytes,
                g.timeout,
            )
            .with_context(|| {
                format!(
                    "rank {} of {}: joining the CUDA IPC all-reduce",
                    g.rank, g.world
                )
            })?;
            Some(Box::new(joined) as Box<dyn TpAllReduce<_>>)
        }
        None => None,
    };
    job.run(dev, all_reduce)
}

#[cfg(not(feature = "cuda"))]
fn open_gpu<J: DeviceJob>(
    _args: &DeviceArgs,
    _group: Option<&DeviceRank<'_>>,
    _job: J,
) -> Result<J::Output> {
    Err(InvalidInput(
        "--backend cuda: no CUDA driver support in this binary (built without the `cuda` \
         feature; rebuild with `cargo build --release -p model --features cuda`)"
            .into(),
    )
    .into())
}

/// The executor's tactics: the heuristic defaults for the device's SM and this rank's share of
/// `world` ranks, with the dense products on `dense`; logged.
fn executor_on<D: kernels::device::Device>(
    dev: D,
    model: &Model,
    kv_dtype: KvCacheDtype,
    cache_tokens: usize,
    capacity: model::executor::StepCapacity,
    quiet: bool,
    (world, dense): (usize, kernels::blas::DenseTactic),
) -> Result<model::executor::DeviceExecutor<D>> {
    use model::executor::{DeviceExecutor, ExecutorError, ExecutorTactics};
    let refuse = |e: ExecutorError| -> anyhow::Error {
        match e {
            ExecutorError::Unsupported(_) | ExecutorError::Weights(_) => {
                InvalidInput(e.to_string()).into()
            }
            other => other.into(),
        }
    };
    let describe = dev.describe();
    let sm = dev.sm()?;
    let (dense, fallback) = dense.available_on(&dev)?;
    if let Some(why) = fallback {
        eprintln!("{why}");
    }
    let tactics = ExecutorTactics {
        dense,
        ..ExecutorTactics::defaults_for_rank(sm, &model.config, kv_dtype, world).map_err(refuse)?
    };
    if !quiet {
        eprintln!(
            "device: {describe}; tactics: mla_decode {}, moe_gemm {}, dense {}",
            tactics.mla.id(),
            tactics.moe.map_or("-".into(), |t| t.id()),
            tactics.dense
        );
    }
    let ex = DeviceExecutor::new(dev, model, kv_dtype, cache_tokens, capacity, tactics, quiet)
        .map_err(refuse)?;
    let bytes = ex.device_bytes();
    if quiet {
        return Ok(ex);
    }
    eprintln!(
        "device memory: weights {:.1} MiB, latent cache {:.1} MiB ({}), workspace {:.1} MiB",
        bytes.weights as f64 / (1 << 20) as f64,
        bytes.cache as f64 / (1 << 20) as f64,
        kv_dtype.id(),
        bytes.workspace as f64 / (1 << 20) as f64
    );
    Ok(ex)
}

fn refuse_f32_cache(device: &DeviceArgs, kv_dtype: KvCacheDtype) -> Result<KvCacheDtype> {
    if device.backend != BackendArg::Cpu && kv_dtype == KvCacheDtype::F32 {
        return Err(InvalidInput(
            "the device kernels read a bf16 or fp8 latent cache; pass --kv-dtype bf16 or fp8 \
             (f32 is the CPU reference's)"
                .into(),
        )
        .into());
    }
    Ok(kv_dtype)
}

#[derive(clap::Args, Clone)]
struct LogitsArgs {
    #[arg(long)]
    checkpoint: PathBuf,
    /// Comma-separated token ids.
    #[arg(long)]
    tokens: TokenIds,
    #[arg(long)]
    out: PathBuf,
    /// Latent cache dtype. Scoring defaults to FP32, the reference; `bf16`/`fp8` (or `auto`,
    /// what the checkpoint asks for) show what a deployment's cache costs.
    #[arg(long, value_enum, default_value = "f32")]
    kv_dtype: KvDtypeArg,
    #[command(flatten)]
    tp: TpArgs,
    #[command(flatten)]
    device: DeviceArgs,
    #[command(flatten)]
    cpu: CpuTacticArgs,
    #[command(flatten)]
    tactics: TacticsArgs,
}

/// The tuning lab's tactic cache (`autotune --out FILE`).
#[derive(clap::Args, Clone)]
struct TacticsArgs {
    /// Tactic cache to read at start; the tactic per kernel family (or the warning and the
    /// heuristic default, for a missing, corrupt or stale cache) is logged to stderr.
    #[arg(long)]
    tactics: Option<PathBuf>,
    /// The SM whose tactics the GPU executor would run: 120 (RTX PRO 6000) or 90 (H200).
    #[arg(long, default_value = "120", value_parser = parse_sm)]
    tactics_sm: kernels::arch::Sm,
}

fn parse_sm(s: &str) -> std::result::Result<kernels::arch::Sm, String> {
    kernels::arch::Sm::parse(s).ok_or_else(|| format!("{s:?}: expected 120 or 90"))
}

/// Logs, once per command (not per rank), the tactic each GPU family uses for this run.
fn log_tactics(
    args: &TacticsArgs,
    tp: &TpArgs,
    config: &model::config::ModelConfig,
    tokens: usize,
    context: usize,
    kv: KvCacheDtype,
) {
    if tp.tp_rank.is_some() || args.tactics.is_none() {
        return;
    }
    let run = model::tactics::RunShapes {
        sm: args.tactics_sm,
        tp: tp.world() as u32,
        tokens: tokens as u32,
        context: context as u32,
        fp8_cache: kv == KvCacheDtype::Fp8E4m3,
    };
    eprintln!(
        "tactics for {} (the GPU executor's kernels; this run computes on the CPU):",
        args.tactics_sm
    );
    for line in model::tactics::tactic_lines(args.tactics.as_deref(), config, &run) {
        eprintln!("  {line}");
    }
}

#[derive(clap::Args, Clone)]
struct RunArgs {
    /// A checkpoint directory; default: the `mini` preset, generated on first use.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Where the default model is cached.
    #[arg(long, env = "KIMI_SM120_CACHE")]
    cache_dir: Option<PathBuf>,
    /// Comma-separated prompt token ids (default: --prompt-len seeded random tokens).
    #[arg(long)]
    prompt: Option<TokenIds>,
    #[arg(long, default_value_t = 32, value_parser = at_least_one)]
    prompt_len: usize,
    /// New tokens per sequence; prompt plus these must fit the model's context.
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    max_new_tokens: usize,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    batch: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus mass in (0, 1]; 1 = no cut.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value = "auto")]
    kv_dtype: KvDtypeArg,
    /// Decode all --max-new-tokens even past an end-of-sequence token (benchmarks: the decode
    /// rate over a fixed length; a small model may otherwise stop after a few tokens).
    #[arg(long)]
    ignore_eos: bool,
    /// Run the same requests once, untimed, before the timed run (benchmarks: the first
    /// forward pass also pays page faults, the thread pool's start and first-touch buffers,
    /// as llama-bench's warm-up run does for llama.cpp). CPU backend.
    #[arg(long)]
    warmup: bool,
    /// Time every backend call of the timed run and print where a step's time goes, by
    /// operation and shape, with the rate each product read its weights at. CPU backend.
    #[arg(long)]
    profile_ops: bool,
    #[command(flatten)]
    tp: TpArgs,
    #[command(flatten)]
    device: DeviceArgs,
    #[command(flatten)]
    cpu: CpuTacticArgs,
    #[command(flatten)]
    tactics: TacticsArgs,
}

#[derive(clap::Args)]
struct PlanArgs {
    #[arg(long, conflicts_with = "preset")]
    checkpoint: Option<PathBuf>,
    #[arg(long, value_enum)]
    preset: Option<Preset>,
    /// GPUs in the tensor-parallel group; the model must split evenly over them.
    #[arg(long, default_value_t = 8, value_parser = at_least_one)]
    gpus: usize,
    #[arg(long, default_value_t = 96.0, value_parser = positive_finite)]
    gpu_mem_gib: f64,
    /// Share of each GPU's memory the engine may use, in (0, 1].
    #[arg(long, default_value_t = 0.90, value_parser = fraction)]
    memory_utilization: f64,
    /// `bf16` or `fp8`; without it both are shown.
    #[arg(long)]
    kv_dtype: Option<String>,
    /// Default: the model's max_position_embeddings.
    #[arg(long, value_parser = at_least_one)]
    max_model_len: Option<usize>,
    #[arg(long, default_value_t = 8192, value_parser = at_least_one)]
    max_batched_tokens: usize,
    /// Sequences per step (rows of logits the workspace holds).
    #[arg(long, default_value_t = 256, value_parser = at_least_one)]
    max_num_seqs: usize,
}

#[derive(clap::Args)]
struct LaunchListArgs {
    #[arg(long, value_enum, default_value = "kimi-k2.5")]
    preset: Preset,
    /// Ranks of the tensor-parallel group; the list is rank `--rank`'s.
    #[arg(long, default_value_t = 8, value_parser = at_least_one)]
    tp: usize,
    #[arg(long, default_value_t = 0)]
    rank: usize,
    /// Sequences in the decode step.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    batch: usize,
    /// Tokens every sequence attends over (its new one included).
    #[arg(long, default_value_t = 4096, value_parser = at_least_one)]
    context: usize,
    /// `bf16` or `fp8`.
    #[arg(long, default_value = "bf16")]
    kv_dtype: String,
    /// The SM whose limits and tactics apply: 120 (RTX PRO 6000) or 90 (H200).
    #[arg(long, default_value = "120", value_parser = parse_sm)]
    sm: kernels::arch::Sm,
    /// Tactic cache (`autotune ... --out FILE`) to take the MoE and MLA tactics from; without
    /// it, the heuristic defaults.
    #[arg(long)]
    tactics: Option<PathBuf>,
    /// Also write the list to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn launch_list_command(args: LaunchListArgs) -> Result<()> {
    use model::executor::{DryStep, decode_tactics};
    let config = args.preset.model_config();
    if args.rank >= args.tp {
        bail!(InvalidInput(format!(
            "--rank {} of --tp {}: ranks are 0..{}",
            args.rank, args.tp, args.tp
        )));
    }
    check_tensor_parallel(Path::new(args.preset.id()), &config, args.tp)?;
    let kv_dtype = KvCacheDtype::parse(&args.kv_dtype).ok_or_else(|| {
        InvalidInput(format!(
            "--kv-dtype {}: expected bf16 or fp8",
            args.kv_dtype
        ))
    })?;
    if args.context > config.max_position_embeddings {
        bail!(InvalidInput(format!(
            "--context {}: the model's max_position_embeddings is {}",
            args.context, config.max_position_embeddings
        )));
    }
    let (tactics, tactics_source) = decode_tactics(
        args.tactics.as_deref(),
        args.sm,
        &config,
        args.tp,
        args.batch,
        args.context,
        kv_dtype,
    )?;
    let step = DryStep {
        model: args.preset.id().into(),
        config,
        sm: args.sm,
        shard: TpShard {
            rank: args.rank,
            world: args.tp,
        },
        batch: args.batch,
        context: args.context,
        kv_dtype,
        tactics,
        tactics_source,
    }
    .record()?;
    let mut regenerate = format!(
        "cargo run --release -p model -- launch-list --preset {} --tp {} --rank {} --batch {} \
         --context {} --kv-dtype {} --sm {}",
        args.preset.id(),
        args.tp,
        args.rank,
        args.batch,
        args.context,
        kv_dtype.id(),
        args.sm
    );
    if let Some(t) = &args.tactics {
        regenerate += &format!(" --tactics {}", t.display());
    }
    if let Some(o) = &args.out {
        regenerate += &format!(" --out {}", o.display());
    }
    let text = step.render(&regenerate);
    print!("{text}");
    if let Some(path) = &args.out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("expected a whole number >= 1".into()),
    }
}

fn positive_finite(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err("expected a positive finite number".into()),
    }
}

fn fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err("expected a number in (0, 1]".into()),
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help and --version.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let text = e.render().to_string();
            let text = text.strip_prefix("error: ").unwrap_or(&text);
            eprint!("Error: {text}");
            return ExitCode::from(2);
        }
    };
    // Output into a closed pipe (`model inspect DIR | head -1`) ends the process quietly, as
    // it does every Unix tool, instead of a panic in `println!`. Not for the server: a client
    // that hangs up must cost it a write error, not its life.
    if !matches!(cli.command, Some(Command::Serve(_))) {
        // SAFETY: setting a signal disposition before any thread exists.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    model::heap::keep_freed_activations();
    std::panic::set_hook(Box::new(|info| {
        eprintln!("Error: internal failure (a bug, please report it): {info}");
    }));
    match std::panic::catch_unwind(|| dispatch(cli)) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(error)) => {
            model::cleanup::wait_if_interrupted();
            eprintln!("Error: {}", cause_chain(&error));
            ExitCode::from(exit_code(&error))
        }
        // The hook has reported it.
        Err(_) => ExitCode::from(1),
    }
}

/// The error and its causes on one line, each said once.
fn cause_chain(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        // A cause that brings its own prefix (a library's message) must not double ours.
        let cause = cause.trim_start_matches("Error: ");
        if text.contains(cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(cause);
    }
    text
}

/// 2 when the error is about input the engine refuses, 1 otherwise (a rank reports its own
/// code through the launcher).
fn exit_code(error: &anyhow::Error) -> u8 {
    for cause in error.chain() {
        let refused = cause.is::<InvalidInput>()
            || cause.is::<ConfigError>()
            || cause.is::<CheckpointError>()
            || cause.is::<TensorFileError>()
            || cause
                .downcast_ref::<ForwardError>()
                .is_some_and(ForwardError::is_invalid_input);
        if refused {
            return 2;
        }
        if let Some(failed) = cause.downcast_ref::<RankFailed>() {
            return if failed.status.code() == Some(2) {
                2
            } else {
                1
            };
        }
    }
    1
}

fn dispatch(cli: Cli) -> Result<()> {
    // No subcommand: the front door's main job, a question in, reasoning and answer out.
    let command = match cli.command {
        Some(command) => command,
        None => Command::Chat(serving_cli::demo_chat_args()),
    };
    match command {
        Command::Chat(args) => serving_cli::run_chat(args),
        Command::Serve(args) => serving_cli::run_serve(args),
        Command::Tokenize(args) => serving_cli::run_tokenize(args),
        Command::Run(args) => run(args),
        Command::Logits(args) => logits(args),
        Command::CompareLogits {
            candidate,
            reference,
            max_rel_l2,
            as_close_as,
        } => compare_logits(&candidate, &reference, max_rel_l2, as_close_as.as_deref()),
        Command::GenerateCheckpoint {
            preset,
            out,
            seed,
            force,
        } => {
            generate_checkpoint(preset, &out, seed, &CpuBackend, force)?;
            println!("wrote the {} preset to {}", preset.id(), out.display());
            Ok(())
        }
        Command::Quantize {
            input,
            output,
            calib_tokens,
            seed,
            force,
        } => {
            if input.is_file() {
                quantize_file(&input, &output, force)
            } else {
                quantize_checkpoint(
                    &input,
                    &output,
                    &CpuBackend,
                    calib_tokens,
                    seed,
                    4 << 30,
                    force,
                )?;
                println!("wrote NVFP4 checkpoint {}", output.display());
                Ok(())
            }
        }
        Command::Plan(args) => plan_command(args),
        Command::LaunchList(args) => launch_list_command(args),
        Command::Inspect { path } => {
            if path.is_dir() {
                inspect_checkpoint(&path)
            } else {
                inspect_file(&path)
            }
        }
    }
}

fn resolve_kv_dtype(arg: KvDtypeArg, checkpoint: &Checkpoint) -> KvCacheDtype {
    let asked = checkpoint
        .config
        .quant
        .as_ref()
        .and_then(|q| q.kv_cache_quant_algo);
    kv_dtype_for(arg, asked)
}

/// The cache dtype `arg` means: `Auto` follows the checkpoint's `kv_cache_quant_algo`
/// (`asked`), else BF16. Memory estimates made before the weights are loaded pass `None`,
/// which errs on the larger BF16 side.
fn kv_dtype_for(arg: KvDtypeArg, asked: Option<KvCacheQuant>) -> KvCacheDtype {
    match arg {
        KvDtypeArg::F32 => KvCacheDtype::F32,
        KvDtypeArg::Bf16 => KvCacheDtype::Bf16,
        KvDtypeArg::Fp8 => KvCacheDtype::Fp8E4m3,
        KvDtypeArg::Auto => match asked {
            Some(KvCacheQuant::Fp8) => KvCacheDtype::Fp8E4m3,
            None => KvCacheDtype::Bf16,
        },
    }
}

fn load(
    dir: &Path,
    shard: TpShard,
    placement: impl FnOnce(&Checkpoint) -> WeightPlacement,
) -> Result<(Checkpoint, Model)> {
    let mut checkpoint = Checkpoint::open(dir)?;
    let config = checkpoint.model_config().clone();
    check_tensor_parallel(dir, &config, shard.world)?;
    let asked = placement(&checkpoint);
    if let Some(copied) = checkpoint.place_weights_timed(asked)
        && shard.rank == 0
    {
        eprintln!(
            "weights: a copy on 2 MiB pages ({copied}; --weights mapped reads the files' mapping)"
        );
    }
    let weights = checkpoint
        .load_weights()?
        .shard(&config, shard)
        .map_err(InvalidInput)?;
    Ok((checkpoint, Model::new(config, weights)))
}

fn check_tensor_parallel(dir: &Path, config: &ModelConfig, world: usize) -> Result<()> {
    config.check_tensor_parallel(world).map_err(|e| {
        InvalidInput(format!(
            "{}: tensor parallelism over {world} ranks: {e}",
            dir.display()
        ))
    })?;
    Ok(())
}

impl TpArgs {
    fn world(&self) -> usize {
        usize::from(self.tp)
    }

    fn shard(&self) -> TpShard {
        TpShard {
            rank: self.tp_rank.unwrap_or(0),
            world: self.world(),
        }
    }

    /// Whether this process logs nothing of its own: the launcher of `--tp N` ranks (rank 0
    /// speaks for them) or a rank other than 0.
    fn quiet(&self) -> bool {
        self.is_launcher() || self.tp_rank.is_some_and(|r| r != 0)
    }

    /// Whether this process is the launcher of `--tp N` ranks (not a rank, not alone).
    fn is_launcher(&self) -> bool {
        self.tp > 1 && self.tp_rank.is_none()
    }
}

/// The backend of this process as one rank (the single rank when `--tp 1`).
fn rank_backend(
    tp: &TpArgs,
    max_elements: usize,
    tactic: CpuTactic,
) -> Result<(TpShard, Box<dyn Backend>)> {
    let compute = TunedCpuBackend::new(tactic).map_err(anyhow::Error::msg)?;
    if tp.tp == 1 {
        return Ok((TpShard::SINGLE, Box::new(compute)));
    }
    let rank = tp
        .tp_rank
        .context("a tensor-parallel rank needs --tp-rank")?;
    let segment = tp
        .tp_segment
        .as_deref()
        .context("--tp-rank needs --tp-segment")?;
    let timeout = std::time::Duration::from_secs(tp.tp_timeout_secs);
    let backend = TpCpuBackend::join(compute, segment, rank, tp.world(), max_elements, timeout)?;
    Ok((tp.shard(), Box::new(backend)))
}

/// In a rank process: stop when the launcher does (see [`tp`]).
fn watch_launcher_if_rank(tp: &TpArgs) {
    if tp.tp_rank.is_some() {
        tp::watch_launcher(std::time::Duration::from_millis(100));
    }
}

/// This invocation's arguments, for re-running it as each rank.
fn own_args() -> Vec<String> {
    std::env::args().skip(1).collect()
}

/// The requests of `model run`, checked against the model: prompt tokens in the vocabulary,
/// prompt plus new tokens within the context, sampling parameters in range, and the whole
/// batch's cache within the memory available.
fn run_requests(args: &RunArgs, c: &ModelConfig, dir: &Path) -> Result<Vec<GenerationRequest>> {
    let requests: Vec<GenerationRequest> = (0..args.batch)
        .map(|i| GenerationRequest {
            prompt: match &args.prompt {
                Some(TokenIds(tokens)) => tokens.clone(),
                None => random_tokens(args.prompt_len, c.vocab_size, args.seed + i as u64),
            },
            max_new_tokens: args.max_new_tokens,
            sampling: SamplingParams {
                temperature: args.temperature,
                top_k: args.top_k,
                top_p: args.top_p,
                seed: args.seed + i as u64,
            },
        })
        .collect();
    if let Some(request) = requests.first() {
        request
            .validate(c)
            .map_err(|e| InvalidInput(format!("{}: {e}", dir.display())))?;
    }
    let prompt = requests.first().map_or(0, |r| r.prompt.len());
    let needed = |new_tokens: usize| {
        // Pages are per sequence: round each sequence up to whole pages.
        let per_sequence = (prompt + new_tokens).div_ceil(PAGE_TOKENS) * PAGE_TOKENS;
        let rows = prompt.max(args.batch);
        let one_rank = forward_bytes(
            c,
            kv_dtype_for(args.kv_dtype, None),
            per_sequence.saturating_mul(args.batch),
            rows,
            args.batch,
        );
        // Every rank holds the whole latent cache.
        one_rank.saturating_mul(args.tp.world() as u64)
    };
    check_memory(
        &format!(
            "the latent cache and activations of {} sequences of {} tokens",
            args.batch,
            prompt + args.max_new_tokens
        ),
        needed(args.max_new_tokens),
        |available| match largest_fitting(args.max_new_tokens, |n| needed(n) <= available) {
            Some(n) => format!("--max-new-tokens {n} fits at --batch {}", args.batch),
            None => format!("lower --batch {} or the prompt", args.batch),
        },
    )?;
    Ok(requests)
}

fn run(args: RunArgs) -> Result<()> {
    watch_launcher_if_rank(&args.tp);
    check_backend_available(&args.device)?;
    let dir = match &args.checkpoint {
        Some(dir) => dir.clone(),
        None => default_checkpoint(args.cache_dir.clone())?,
    };
    let started = std::time::Instant::now();
    let opened = Checkpoint::open(&dir)?;
    let config = opened.model_config().clone();
    let requests = run_requests(&args, &config, &dir)?;
    log_tactics(
        &args.tactics,
        &args.tp,
        &config,
        args.batch,
        requests[0].prompt.len() + args.max_new_tokens,
        resolve_kv_dtype(args.kv_dtype, &opened),
    );
    drop(opened);
    let max_rows = requests[0].prompt.len().max(args.batch);
    let tactic = args
        .cpu
        .choose(args.tactics.tactics.as_deref(), &config, args.tp.quiet());
    if args.tp.is_launcher() {
        check_tensor_parallel(&dir, &config, args.tp.world())?;
        let mut rank_args = own_args();
        if args.checkpoint.is_none() {
            // The ranks must not race to generate the default model: pass the one made.
            rank_args.extend(["--checkpoint".to_string(), dir.display().to_string()]);
        }
        return tp::launch_ranks(args.tp.world(), &rank_args);
    }
    for (flag, set) in [
        ("--warmup", args.warmup),
        ("--profile-ops", args.profile_ops),
    ] {
        if set && args.device.backend != BackendArg::Cpu {
            return Err(InvalidInput(format!(
                "{flag} is for --backend cpu, not {}",
                args.device.backend.name()
            ))
            .into());
        }
    }
    let (checkpoint, mut model) = load(&dir, args.tp.shard(), |c| {
        placement(&args.cpu, args.device.backend, c)
    })?;
    if args.ignore_eos {
        model.config.eos_token_ids.clear();
    }
    let kv_dtype = resolve_kv_dtype(args.kv_dtype, &checkpoint);
    // Pages are per sequence: round each sequence up to whole pages.
    let total_tokens: usize = requests
        .iter()
        .map(|r| (r.prompt.len() + r.max_new_tokens).div_ceil(PAGE_TOKENS) * PAGE_TOKENS)
        .sum();
    let header = |backend: &str, world: usize| {
        let c = &model.config;
        println!(
            "model {} ({} layers, hidden {}, {} experts top-{}), loaded in {:.2} s; KV cache {}; backend {} (TP {})",
            dir.display(),
            c.num_hidden_layers,
            c.hidden_size,
            c.n_routed_experts,
            c.num_experts_per_tok,
            started.elapsed().as_secs_f64(),
            kv_dtype.id(),
            backend,
            world
        );
    };
    let (results, timing) = if args.device.backend == BackendArg::Cpu {
        let (shard, backend) = rank_backend(&args.tp, max_rows * config.hidden_size, tactic)?;
        let quiet = shard.rank != 0;
        if !quiet {
            header(backend.name(), shard.world);
        }
        if args.warmup {
            let mut cache = model.new_cache(kv_dtype, total_tokens);
            generate(&model, backend.as_ref(), &mut cache, &requests, |_, _| {})?;
        }
        let mut cache = model.new_cache(kv_dtype, total_tokens);
        let profiled = args
            .profile_ops
            .then(|| ProfiledBackend::new(backend.as_ref()));
        let timed: &dyn Backend = match &profiled {
            Some(p) => p,
            None => backend.as_ref(),
        };
        let out = generate(&model, timed, &mut cache, &requests, |_, _| {})?;
        if let Some(p) = profiled.filter(|_| !quiet) {
            print!("{}", p.report());
        }
        if quiet {
            return Ok(());
        }
        out
    } else {
        let kv_dtype = refuse_f32_cache(&args.device, kv_dtype)?;
        let job = RunOnDevice {
            model: &model,
            kv_dtype,
            cache_tokens: total_tokens,
            max_rows,
            batch: args.batch,
            requests: &requests,
            quiet: args.tp.quiet(),
            world: args.tp.world(),
            dense: args.device.dense_tactic,
        };
        let rank = args.tp.shard().rank;
        if rank == 0 {
            header(args.device.backend.name(), args.tp.world());
        }
        let out = on_device(&args.device, &args.tp, max_rows * config.hidden_size, job)?;
        if rank != 0 {
            return Ok(());
        }
        out
    };
    for (i, r) in results.iter().enumerate() {
        println!(
            "sequence {i}: {:?} ({} tokens): {:?}",
            r.stop,
            r.tokens.len(),
            r.tokens
        );
    }
    println!(
        "prefill: {} tokens in {:.3} s = {:.1} tok/s",
        timing.prefill_tokens,
        timing.prefill_time.as_secs_f64(),
        timing.prefill_tokens_per_second()
    );
    println!(
        "decode: {} tokens in {} steps, {:.3} s = {:.1} tok/s",
        timing.decode_tokens,
        timing.decode_steps,
        timing.decode_time.as_secs_f64(),
        timing.decode_tokens_per_second()
    );
    Ok(())
}

fn logits(args: LogitsArgs) -> Result<()> {
    watch_launcher_if_rank(&args.tp);
    check_backend_available(&args.device)?;
    let (dir, TokenIds(tokens), out) = (&args.checkpoint, &args.tokens, &args.out);
    let opened = Checkpoint::open(dir)?;
    let config = opened.model_config().clone();
    check_scoring_request(&args, &config)?;
    log_tactics(
        &args.tactics,
        &args.tp,
        &config,
        tokens.len(),
        tokens.len(),
        resolve_kv_dtype(args.kv_dtype, &opened),
    );
    drop(opened);
    let tactic = args
        .cpu
        .choose(args.tactics.tactics.as_deref(), &config, args.tp.quiet());
    // Checked here, before any work; the file itself is written by rank 0 at the end.
    drop(logits_output(out, dir)?);
    if args.tp.is_launcher() {
        check_tensor_parallel(dir, &config, args.tp.world())?;
        return tp::launch_ranks(args.tp.world(), &own_args());
    }
    // Load (and shard) before joining the collective, so a model that cannot be split fails
    // alone instead of leaving its peers waiting.
    let (checkpoint, model) = load(dir, args.tp.shard(), |c| {
        placement(&args.cpu, args.device.backend, c)
    })?;
    let kv_dtype = resolve_kv_dtype(args.kv_dtype, &checkpoint);
    let logits = if args.device.backend == BackendArg::Cpu {
        let (shard, backend) = rank_backend(&args.tp, tokens.len() * config.hidden_size, tactic)?;
        let mut cache = model.new_cache(kv_dtype, tokens.len());
        let seq = cache.add_sequence();
        let logits = model.forward(
            backend.as_ref(),
            &mut cache,
            &[SeqInput { seq, tokens }],
            LogitRows::All,
            None,
        )?;
        if shard.rank != 0 {
            return Ok(());
        }
        logits
    } else {
        let kv_dtype = refuse_f32_cache(&args.device, kv_dtype)?;
        let logits = on_device(
            &args.device,
            &args.tp,
            tokens.len() * config.hidden_size,
            LogitsOnDevice {
                model: &model,
                kv_dtype,
                tokens,
                quiet: args.tp.quiet(),
                world: args.tp.world(),
                dense: args.device.dense_tactic,
            },
        )?;
        if args.tp.shard().rank != 0 {
            return Ok(());
        }
        logits
    };
    let bytes: &[u8] = bytemuck::cast_slice(&logits.values);
    let view = TensorView::new(Dtype::F32, vec![logits.rows, logits.vocab], bytes)?;
    let stage = logits_output(out, dir)?;
    safetensors::serialize_to_file([("logits", view)], None, stage.path())
        .with_context(|| format!("writing {}", out.display()))?;
    stage.commit()?;
    println!(
        "wrote logits [{}, {}] to {}",
        logits.rows,
        logits.vocab,
        out.display()
    );
    Ok(())
}

/// The logits file: replaced if it exists (a result, not a checkpoint), never inside the
/// checkpoint, written whole or not at all.
fn compare_logits(
    candidate: &str,
    reference: &str,
    max_rel_l2: f64,
    as_close_as: Option<&str>,
) -> Result<()> {
    let (b, vocab) = model::compare::read_logits(reference)?;
    let against = |spec: &str| -> Result<model::compare::LogitsAgreement> {
        let (a, width) = model::compare::read_logits(spec)?;
        if width != vocab {
            anyhow::bail!("{spec} has rows of {width}, {reference} of {vocab}");
        }
        let agreement = model::compare::compare(&a, &b, vocab)?;
        println!("{spec} vs {reference}: {}", agreement.summary());
        Ok(agreement)
    };
    let ours = against(candidate)?;
    match as_close_as {
        None if ours.max() > max_rel_l2 => anyhow::bail!(
            "a position's relative L2 error {:.3e} exceeds --max-rel-l2 {max_rel_l2:.1e}",
            ours.max()
        ),
        None => Ok(()),
        Some(peer) => {
            let theirs = against(peer)?;
            if !ours.as_close_as(&theirs) {
                anyhow::bail!("{candidate} is further from {reference} than {peer} allows");
            }
            Ok(())
        }
    }
}

fn logits_output(out: &Path, checkpoint: &Path) -> Result<StagedOutput> {
    StagedOutput::new(out, &[checkpoint], OutputKind::File, true)
}

/// Tokens in the vocabulary and within the context; cache, activations and the `[T, vocab]`
/// logits within the memory available.
fn check_scoring_request(args: &LogitsArgs, c: &ModelConfig) -> Result<()> {
    let TokenIds(tokens) = &args.tokens;
    let dir = args.checkpoint.display();
    if let Some(&token) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        bail!(InvalidInput(format!(
            "{dir}: --tokens holds {token}, outside the vocabulary of {}",
            c.vocab_size
        )));
    }
    if tokens.len() > c.max_position_embeddings {
        bail!(InvalidInput(format!(
            "{dir}: --tokens holds {} tokens, more than the context of {} (max_position_embeddings)",
            tokens.len(),
            c.max_position_embeddings
        )));
    }
    let kv_dtype = kv_dtype_for(args.kv_dtype, None);
    let needed =
        |t: usize| forward_bytes(c, kv_dtype, t, t, t).saturating_mul(args.tp.world() as u64);
    check_memory(
        &format!("scoring {} tokens", tokens.len()),
        needed(tokens.len()),
        |available| match largest_fitting(tokens.len(), |t| needed(t) <= available) {
            Some(t) => format!("{t} tokens fit"),
            None => "not even one token fits".into(),
        },
    )?;
    Ok(())
}

fn plan_command(args: PlanArgs) -> Result<()> {
    let (config, nvfp4, model) = match (&args.checkpoint, args.preset) {
        (Some(dir), _) => {
            let checkpoint = Checkpoint::open(dir)?;
            let nvfp4 = checkpoint.config.quant.is_some();
            (checkpoint.model_config().clone(), nvfp4, dir.clone())
        }
        (None, Some(preset)) => (preset.model_config(), true, PathBuf::from(preset.id())),
        (None, None) => bail!(InvalidInput(
            "give --checkpoint DIR or --preset NAME".into()
        )),
    };
    // The split `run --tp` would refuse is no plan.
    check_tensor_parallel(&model, &config, args.gpus)?;
    let dtypes = match &args.kv_dtype {
        Some(text) => vec![
            KvCacheDtype::parse(text)
                .ok_or_else(|| InvalidInput(format!("--kv-dtype {text}: expected bf16 or fp8")))?,
        ],
        None => vec![KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3],
    };
    let mut contexts = Vec::new();
    for kv_dtype in dtypes {
        let request = PlanRequest {
            gpus: args.gpus,
            gpu_mem_gib: args.gpu_mem_gib,
            memory_utilization: args.memory_utilization,
            kv_dtype,
            max_model_len: args.max_model_len.unwrap_or(config.max_position_embeddings),
            max_batched_tokens: args.max_batched_tokens,
            max_num_seqs: args.max_num_seqs,
            nvfp4_experts: nvfp4,
        };
        let result = plan(&config, &request);
        println!("{}", result.render(&request));
        contexts.push((kv_dtype, result.max_context_tokens));
    }
    if let [(_, bf16), (_, fp8)] = contexts.as_slice()
        && *bf16 > 0
    {
        println!(
            "an FP8 latent cache holds {:.2}x the context of a BF16 one ({fp8} vs {bf16} tokens)",
            *fp8 as f64 / *bf16 as f64
        );
    }
    Ok(())
}

fn inspect_checkpoint(dir: &Path) -> Result<()> {
    let checkpoint = Checkpoint::open(dir)?;
    let c = checkpoint.model_config();
    println!(
        "{}: model_type {} (prefix `{}`)",
        dir.display(),
        checkpoint.config.model_type,
        checkpoint.prefix
    );
    println!(
        "  {} layers ({} dense), hidden {}, heads {}, q_lora {:?}, kv_lora {}, experts {} (top-{}, {} shared, groups {}/{}), vocab {}",
        c.num_hidden_layers,
        c.first_k_dense_replace,
        c.hidden_size,
        c.num_attention_heads,
        c.q_lora_rank,
        c.kv_lora_rank,
        c.n_routed_experts,
        c.num_experts_per_tok,
        c.n_shared_experts,
        c.n_group,
        c.topk_group,
        c.vocab_size
    );
    match &checkpoint.config.quant {
        Some(q) => println!(
            "  quantization {:?} group {} (producer {}), KV cache {:?}, {} exclude patterns",
            q.quant_algo,
            q.group_size,
            q.producer.as_deref().unwrap_or("?"),
            q.kv_cache_quant_algo,
            q.exclude_modules.len()
        ),
        None => println!("  not quantized"),
    }
    let mut by_dtype: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for (name, file) in checkpoint.tensor_names() {
        let info = file.info(name)?;
        let e = by_dtype.entry(format!("{:?}", info.dtype)).or_default();
        e.0 += 1;
        e.1 += info.numel() * info.dtype.bitsize() / 8;
    }
    println!("  {} shards", checkpoint.shards().len());
    for (dtype, (count, bytes)) in by_dtype {
        println!(
            "  {dtype:>8}: {count:>6} tensors, {:>10.3} MiB",
            bytes as f64 / (1 << 20) as f64
        );
    }
    let weights = checkpoint.load_weights()?;
    println!("  all {} layers load and validate", weights.layers.len());
    let non_finite = checkpoint.non_finite_tensors()?;
    refuse_non_finite(
        non_finite
            .iter()
            .map(|(name, file, i)| (name.as_str(), file.as_path(), *i)),
    )?;
    println!("  every floating-point weight is finite");
    Ok(())
}

/// Fails naming each tensor that holds NaN or Inf (`(tensor, file, first element)`).
fn refuse_non_finite<'a>(found: impl Iterator<Item = (&'a str, &'a Path, usize)>) -> Result<()> {
    let found: Vec<String> = found
        .map(|(name, file, i)| format!("`{name}` ({}) at element {i}", file.display()))
        .collect();
    if found.is_empty() {
        return Ok(());
    }
    bail!(InvalidInput(format!(
        "{} tensor(s) hold NaN or Inf: {}",
        found.len(),
        found.join(", ")
    )))
}

fn inspect_file(path: &Path) -> Result<()> {
    let file = TensorFile::open(path)?;
    println!("{}: {} tensors", path.display(), file.names().count());
    for (key, value) in file.metadata() {
        println!("  metadata {key} = {value}");
    }
    let mut by_dtype: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for name in file.names() {
        let info = file.info(name)?;
        let entry = by_dtype.entry(format!("{:?}", info.dtype)).or_default();
        entry.0 += 1;
        entry.1 += info.numel() * info.dtype.bitsize() / 8;
    }
    for (dtype, (count, bytes)) in &by_dtype {
        println!("  {dtype:>8}: {count:>5} tensors, {bytes:>12} bytes");
    }
    let mut non_finite = Vec::new();
    for name in file.names() {
        if let Some(i) = file.first_non_finite(name)? {
            non_finite.push((name, path, i));
        }
    }
    refuse_non_finite(non_finite.into_iter())?;
    let nvfp4 = nvfp4_weight_names(&file);
    if !nvfp4.is_empty() {
        println!("\n  NVFP4 weights ({}):", nvfp4.len());
        println!(
            "  {:<48} {:>12} {:>12} {:>10} {:>10}",
            "tensor", "shape", "scale_2", "|w| max", "zero blks"
        );
    }
    for name in &nvfp4 {
        let matrix = read_nvfp4(&file, name)?;
        let values = matrix.dequantize();
        let max = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let zero_blocks = values
            .chunks(NVFP4_BLOCK)
            .filter(|b| b.iter().all(|&v| v == 0.0))
            .count();
        println!(
            "  {:<48} {:>12} {:>12.4e} {:>10.4e} {:>10}",
            name,
            format!("{}x{}", matrix.rows, matrix.cols),
            matrix.global_scale,
            max,
            zero_blocks
        );
    }
    Ok(())
}

fn quantize_file(input: &Path, output: &Path, force: bool) -> Result<()> {
    let file = TensorFile::open(input)?;
    let stage = StagedOutput::new(output, &[input], OutputKind::File, force)?;
    let mut out = Vec::new();
    for name in file.names() {
        let info = file.info(name)?;
        let is_float = matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16);
        if !(name.ends_with("weight") && is_float && info.shape.len() == 2) {
            continue;
        }
        let (rows, cols) = (info.shape[0], info.shape[1]);
        let matrix = Nvfp4Matrix::quantize_weight(&file.f32_values(name)?, rows, cols)
            .map_err(|e| InvalidInput(format!("{}: tensor `{name}`: {e}", input.display())))?;
        out.push(OwnedTensor::new(
            name,
            Dtype::U8,
            vec![rows, cols / 2],
            matrix.packed,
        ));
        out.push(OwnedTensor::new(
            format!("{name}_scale"),
            Dtype::F8_E4M3,
            vec![rows, cols / NVFP4_BLOCK],
            matrix.block_scales,
        ));
        out.push(OwnedTensor::f32_scalar(
            format!("{name}_scale_2"),
            matrix.global_scale,
        ));
        println!("quantized {name} [{rows}, {cols}]");
    }
    if out.is_empty() {
        bail!(InvalidInput(format!(
            "{}: no 2-D floating-point `*.weight` tensor to quantize",
            input.display()
        )));
    }
    write_file(stage.path(), &out)?;
    stage.commit()?;
    println!("wrote {}", output.display());
    Ok(())
}

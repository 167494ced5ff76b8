//! `model`: the command-line front end.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use kernels::formats::NVFP4_BLOCK;
use kernels::formats::nvfp4::Nvfp4Matrix;
use kernels::mla::cache::{KvCacheDtype, PAGE_TOKENS};
use model::backend::{Backend, CpuBackend};
use model::checkpoint::Checkpoint;
use model::checkpoint_writer::{OwnedTensor, write_file};
use model::forward::{LogitRows, Model, SeqInput};
use model::generate::{GenerationRequest, generate};
use model::generator::{Preset, default_checkpoint, generate_checkpoint};
use model::nvfp4_file::{nvfp4_weight_names, read_nvfp4};
use model::plan::{PlanRequest, plan};
use model::quantize::{quantize_checkpoint, random_tokens};
use model::sampler::SamplingParams;
use model::serving_cli::{self, ChatArgs, ServeArgs, TokenizeArgs};
use model::tensor_file::TensorFile;
use model::tp::{self, TpCpuBackend};
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
    /// Write a random-weight model in the Kimi-K2.5-NVFP4 layout.
    GenerateCheckpoint {
        #[arg(long, value_enum)]
        preset: Preset,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 20261129)]
        seed: u64,
    },
    /// Quantize a BF16 DeepSeek-V3 / Kimi checkpoint's routed experts to NVFP4 (ModelOpt
    /// layout), calibrating `input_scale` on a forward pass. Given a single `.safetensors`
    /// file instead, quantizes each 2-D `*.weight` tensor in it.
    Quantize {
        #[arg(long)]
        input: PathBuf,
        #[arg(long)]
        output: PathBuf,
        #[arg(long, default_value_t = 256)]
        calib_tokens: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Memory per GPU under tensor parallelism and the longest context that fits.
    Plan(PlanArgs),
    /// Summarize a checkpoint directory or one safetensors file.
    Inspect { path: PathBuf },
}

/// Tensor parallelism: N rank processes on CPU with the shared-memory all-reduce.
#[derive(clap::Args, Clone)]
struct TpArgs {
    /// Ranks (1 = no tensor parallelism).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Seconds a rank waits for its peers in a collective before failing.
    #[arg(long, default_value_t = 300)]
    tp_timeout_secs: u64,
    #[arg(long, hide = true)]
    tp_rank: Option<usize>,
    #[arg(long, hide = true)]
    tp_segment: Option<String>,
}

#[derive(clap::Args, Clone)]
struct LogitsArgs {
    #[arg(long)]
    checkpoint: PathBuf,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    #[arg(long)]
    out: PathBuf,
    /// Latent cache dtype. Scoring defaults to FP32, the reference; `bf16`/`fp8` (or `auto`,
    /// what the checkpoint asks for) show what a deployment's cache costs.
    #[arg(long, value_enum, default_value = "f32")]
    kv_dtype: KvDtypeArg,
    #[command(flatten)]
    tp: TpArgs,
}

#[derive(clap::Args, Clone)]
struct RunArgs {
    /// A checkpoint directory; default: the `mini` preset, generated on first use.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Where the default model is cached.
    #[arg(long, env = "KIMI_SM120_CACHE")]
    cache_dir: Option<PathBuf>,
    /// Comma-separated prompt token ids (default: 32 seeded random tokens).
    #[arg(long, value_delimiter = ',')]
    prompt: Vec<u32>,
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value = "auto")]
    kv_dtype: KvDtypeArg,
    #[command(flatten)]
    tp: TpArgs,
}

#[derive(clap::Args)]
struct PlanArgs {
    #[arg(long, conflicts_with = "preset")]
    checkpoint: Option<PathBuf>,
    #[arg(long, value_enum)]
    preset: Option<Preset>,
    #[arg(long, default_value_t = 8)]
    gpus: usize,
    #[arg(long, default_value_t = 96.0)]
    gpu_mem_gib: f64,
    #[arg(long, default_value_t = 0.90)]
    memory_utilization: f64,
    /// `bf16` or `fp8`; without it both are shown.
    #[arg(long)]
    kv_dtype: Option<String>,
    /// Default: the model's max_position_embeddings.
    #[arg(long)]
    max_model_len: Option<usize>,
    #[arg(long, default_value_t = 8192)]
    max_batched_tokens: usize,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
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
        Command::GenerateCheckpoint { preset, out, seed } => {
            generate_checkpoint(preset, &out, seed, &CpuBackend)?;
            println!("wrote the {} preset to {}", preset.id(), out.display());
            Ok(())
        }
        Command::Quantize {
            input,
            output,
            calib_tokens,
            seed,
        } => {
            if input.is_file() {
                quantize_file(&input, &output)
            } else {
                quantize_checkpoint(&input, &output, &CpuBackend, calib_tokens, seed, 4 << 30)?;
                println!("wrote NVFP4 checkpoint {}", output.display());
                Ok(())
            }
        }
        Command::Plan(args) => plan_command(args),
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
    match arg {
        KvDtypeArg::F32 => KvCacheDtype::F32,
        KvDtypeArg::Bf16 => KvCacheDtype::Bf16,
        KvDtypeArg::Fp8 => KvCacheDtype::Fp8E4m3,
        KvDtypeArg::Auto => checkpoint.kv_cache_dtype(),
    }
}

fn load(dir: &Path, shard: TpShard) -> Result<(Checkpoint, Model)> {
    let checkpoint = Checkpoint::open(dir)?;
    let config = checkpoint.model_config().clone();
    let weights = checkpoint
        .load_weights()?
        .shard(&config, shard)
        .map_err(|e| {
            anyhow::anyhow!(
                "{}: tensor parallelism over {} ranks: {e}",
                dir.display(),
                shard.world
            )
        })?;
    Ok((checkpoint, Model::new(config, weights)))
}

impl TpArgs {
    fn shard(&self) -> TpShard {
        TpShard {
            rank: self.tp_rank.unwrap_or(0),
            world: self.tp,
        }
    }
}

/// The backend of this process as one rank (the single rank when `--tp 1`).
fn rank_backend(tp: &TpArgs, max_elements: usize) -> Result<(TpShard, Box<dyn Backend>)> {
    if tp.tp == 1 {
        return Ok((TpShard::SINGLE, Box::new(CpuBackend)));
    }
    let rank = tp
        .tp_rank
        .context("a tensor-parallel rank needs --tp-rank")?;
    let segment = tp
        .tp_segment
        .as_deref()
        .context("--tp-rank needs --tp-segment")?;
    let timeout = std::time::Duration::from_secs(tp.tp_timeout_secs);
    let backend = TpCpuBackend::join(segment, rank, tp.tp, max_elements, timeout)?;
    Ok((tp.shard(), Box::new(backend)))
}

/// This invocation's arguments, for re-running it as each rank.
fn own_args() -> Vec<String> {
    std::env::args().skip(1).collect()
}

fn run(args: RunArgs) -> Result<()> {
    let dir = match &args.checkpoint {
        Some(dir) => dir.clone(),
        None => default_checkpoint(args.cache_dir.clone())?,
    };
    let started = std::time::Instant::now();
    let max_rows = args.prompt_len.max(args.prompt.len()).max(args.batch);
    let hidden = Checkpoint::open(&dir)?.model_config().hidden_size;
    if args.tp.tp > 1 && args.tp.tp_rank.is_none() {
        let mut rank_args = own_args();
        if args.checkpoint.is_none() {
            // The ranks must not race to generate the default model: pass the one made.
            rank_args.extend(["--checkpoint".to_string(), dir.display().to_string()]);
        }
        return tp::launch_ranks(args.tp.tp, &rank_args);
    }
    let (checkpoint, model) = load(&dir, args.tp.shard())?;
    let (shard, backend) = rank_backend(&args.tp, max_rows * hidden)?;
    let quiet = shard.rank != 0;
    let kv_dtype = resolve_kv_dtype(args.kv_dtype, &checkpoint);
    let c = &model.config;
    if !quiet {
        println!(
            "model {} ({} layers, hidden {}, {} experts top-{}), loaded in {:.2} s; KV cache {}; backend {} (TP {})",
            dir.display(),
            c.num_hidden_layers,
            c.hidden_size,
            c.n_routed_experts,
            c.num_experts_per_tok,
            started.elapsed().as_secs_f64(),
            kv_dtype.id(),
            backend.name(),
            shard.world
        );
    }
    let requests: Vec<GenerationRequest> = (0..args.batch.max(1))
        .map(|i| GenerationRequest {
            prompt: if args.prompt.is_empty() {
                random_tokens(args.prompt_len, c.vocab_size, args.seed + i as u64)
            } else {
                args.prompt.clone()
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
    // Pages are per sequence: round each sequence up to whole pages.
    let total_tokens: usize = requests
        .iter()
        .map(|r| (r.prompt.len() + r.max_new_tokens).div_ceil(PAGE_TOKENS) * PAGE_TOKENS)
        .sum();
    let mut cache = model.new_cache(kv_dtype, total_tokens);
    let (results, timing) = generate(&model, backend.as_ref(), &mut cache, &requests, |_, _| {})?;
    if quiet {
        return Ok(());
    }
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
    let (dir, tokens, out) = (&args.checkpoint, &args.tokens, &args.out);
    let hidden = Checkpoint::open(dir)?.model_config().hidden_size;
    if args.tp.tp > 1 && args.tp.tp_rank.is_none() {
        return tp::launch_ranks(args.tp.tp, &own_args());
    }
    // Load (and shard) before joining the collective, so a model that cannot be split fails
    // alone instead of leaving its peers waiting.
    let (checkpoint, model) = load(dir, args.tp.shard())?;
    let (shard, backend) = rank_backend(&args.tp, tokens.len() * hidden)?;
    let mut cache = model.new_cache(resolve_kv_dtype(args.kv_dtype, &checkpoint), tokens.len());
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
    let bytes: &[u8] = bytemuck::cast_slice(&logits.values);
    let view = TensorView::new(Dtype::F32, vec![logits.rows, logits.vocab], bytes)?;
    safetensors::serialize_to_file([("logits", view)], None, out)
        .with_context(|| format!("writing {}", out.display()))?;
    println!(
        "wrote logits [{}, {}] to {}",
        logits.rows,
        logits.vocab,
        out.display()
    );
    Ok(())
}

fn plan_command(args: PlanArgs) -> Result<()> {
    let (config, nvfp4) = match (&args.checkpoint, args.preset) {
        (Some(dir), _) => {
            let checkpoint = Checkpoint::open(dir)?;
            let nvfp4 = checkpoint.config.quant.is_some();
            (checkpoint.model_config().clone(), nvfp4)
        }
        (None, Some(preset)) => (preset.model_config(), true),
        (None, None) => bail!("give --checkpoint DIR or --preset NAME"),
    };
    let dtypes = match &args.kv_dtype {
        Some(text) => vec![
            KvCacheDtype::parse(text)
                .with_context(|| format!("--kv-dtype {text}: expected bf16 or fp8"))?,
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
            nvfp4_experts: nvfp4,
        };
        let result = plan(&config, &request);
        println!("{}", result.render(&request));
        contexts.push((kv_dtype, result.max_context_tokens));
    }
    if let [(_, bf16), (_, fp8)] = contexts.as_slice() {
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
    Ok(())
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

fn quantize_file(input: &Path, output: &Path) -> Result<()> {
    let file = TensorFile::open(input)?;
    let mut out = Vec::new();
    for name in file.names() {
        let info = file.info(name)?;
        let is_float = matches!(info.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16);
        if !(name.ends_with("weight") && is_float && info.shape.len() == 2) {
            continue;
        }
        let (rows, cols) = (info.shape[0], info.shape[1]);
        let matrix = Nvfp4Matrix::quantize_weight(&file.f32_values(name)?, rows, cols)
            .with_context(|| format!("{}: tensor `{name}`", input.display()))?;
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
        bail!(
            "{}: no 2-D floating-point `*.weight` tensor to quantize",
            input.display()
        );
    }
    write_file(output, &out)?;
    println!("wrote {}", output.display());
    Ok(())
}

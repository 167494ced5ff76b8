//! `model run`: prefill and batched decode on token ids, on any backend and any number of
//! tensor-parallel ranks; prefill and decode tok/s printed apart.

use std::path::{Path, PathBuf};

use anyhow::Result;
use kernels::mla::cache::{KvCacheDtype, PAGE_TOKENS};

use super::args::{
    KvDtypeArg, at_least_one, counted, kv_dtype_for, resolve_kv_dtype, temperature, top_p,
};
use crate::arch::config::ModelConfig;
use crate::checkpoint::hub::resolve_checkpoint;
use crate::checkpoint::{Checkpoint, check_tensor_parallel, load_model as load};
use crate::exec::backend::{Backend, BackendArgs, RunnerSizing, TpArgs, parse_sm};
use crate::exec::device::StepCapacity;
use crate::exec::footprint::forward_bytes;
use crate::exec::generate::{GenerationRequest, GenerationResult, StopReason, generate};
use crate::exec::sampler::SamplingParams;
use crate::exec::tp::{RankRole, open_ranks};
use crate::input::{InvalidInput, TokenIds, check_memory, largest_fitting};
use crate::quantize::generator::default_checkpoint;
use crate::quantize::random_tokens;

#[derive(clap::Args, Clone)]
pub struct RunArgs {
    /// A checkpoint folder, or a Hugging Face repository id in the local cache
    /// (`nvidia/Kimi-K2.5-NVFP4`); default: the `mini` preset, generated on first use.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Where the default model is cached.
    #[arg(long, env = "KIMI_SM120_CACHE")]
    cache_dir: Option<PathBuf>,
    /// Comma-separated prompt token ids (default: --prompt-len seeded random tokens).
    #[arg(long)]
    prompt: Option<TokenIds>,
    /// Tokens of the random prompt when --prompt is not given.
    #[arg(long, default_value_t = 32, value_parser = at_least_one)]
    prompt_len: usize,
    /// New tokens per sequence; prompt plus these must fit the model's context.
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    max_new_tokens: usize,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    batch: usize,
    /// Sampling temperature, >= 0; 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = temperature)]
    temperature: f32,
    /// Sample among the k most likely tokens only; 0 = no cut.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus mass in (0, 1]; 1 = no cut.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = top_p)]
    top_p: f32,
    /// Seed of the random prompt and of sampling; sequence i uses seed + i.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The latent cache's dtype (vLLM's `--kv-cache-dtype`).
    #[arg(
        long,
        visible_alias = "kv-cache-dtype",
        value_enum,
        default_value = "auto"
    )]
    kv_dtype: KvDtypeArg,
    /// Decode all --max-new-tokens even past an end-of-sequence token (benchmarks: the decode
    /// rate over a fixed length; a small model may otherwise stop after a few tokens).
    #[arg(long)]
    ignore_eos: bool,
    /// Run the same requests once, untimed, before the timed run (benchmarks: the first
    /// forward pass also pays page faults, the thread pool's start and first-touch buffers,
    /// a device its graph captures, as llama-bench's warm-up run does for llama.cpp).
    #[arg(long)]
    warmup: bool,
    /// Time every operation of the timed run and print where a step's time goes, by
    /// operation and shape, with the rate each product read its weights at (on a GPU the
    /// launches are timed as issued).
    #[arg(long)]
    profile_ops: bool,
    /// The SM whose GPU tactics a CPU run logs from `--tactics` (120: RTX PRO 6000, 90: H200).
    #[arg(long, default_value = "120", value_parser = parse_sm)]
    tactics_sm: kernels::arch::Sm,
    #[command(flatten)]
    tp: TpArgs,
    #[command(flatten)]
    backend: BackendArgs,
}

/// The requests of `model run`, checked against the model: prompt tokens in the vocabulary,
/// prompt plus new tokens within the context, sampling parameters in range, and the whole
/// batch's cache within the memory available.
fn run_requests(args: &RunArgs, c: &ModelConfig, dir: &Path) -> Result<Vec<GenerationRequest>> {
    // Made one at a time, after the checks: a --batch of 10⁹ must be refused, not built.
    let request = |i: usize| GenerationRequest {
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
    };
    let first = request(0);
    first
        .validate(c)
        .map_err(|e| InvalidInput(format!("{}: {e}", dir.display())))?;
    let prompt = first.prompt.len();
    let bytes = |batch: usize, new_tokens: usize| {
        // Pages are per sequence: round each sequence up to whole pages.
        let per_sequence = (prompt + new_tokens).div_ceil(PAGE_TOKENS) * PAGE_TOKENS;
        let one_rank = forward_bytes(
            c,
            kv_dtype_for(args.kv_dtype, None),
            per_sequence.saturating_mul(batch),
            prompt.max(batch),
            batch,
        );
        // Every rank holds the whole latent cache; each request holds its prompt.
        one_rank
            .saturating_mul(args.tp.world() as u64)
            .saturating_add((batch as u64).saturating_mul(4 * prompt as u64 + 256))
    };
    check_memory(
        &format!(
            "the latent cache and activations of {} sequences of {} tokens",
            args.batch,
            prompt + args.max_new_tokens
        ),
        bytes(args.batch, args.max_new_tokens),
        |available| {
            let fits = |batch, new_tokens| bytes(batch, new_tokens) <= available;
            match largest_fitting(args.max_new_tokens, |n| fits(args.batch, n)) {
                Some(n) => format!("--max-new-tokens {n} fits at --batch {}", args.batch),
                None => match largest_fitting(args.batch, |b| fits(b, args.max_new_tokens)) {
                    Some(b) => format!("--batch {b} fits"),
                    None => format!("lower --batch {} or the prompt", args.batch),
                },
            }
        },
    )?;
    Ok(std::iter::once(first)
        .chain((1..args.batch).map(request))
        .collect())
}

pub fn run(args: RunArgs) -> Result<()> {
    args.backend.check_available()?;
    let dir = match &args.checkpoint {
        Some(arg) => resolve_checkpoint("--checkpoint", arg)?,
        None => default_checkpoint(args.cache_dir.clone())?,
    };
    let started = std::time::Instant::now();
    let opened = Checkpoint::open(&dir)?;
    let config = opened.model_config().clone();
    check_tensor_parallel(&dir, &config, args.tp.world())?;
    let requests = run_requests(&args, &config, &dir)?;
    let kv_dtype = resolve_kv_dtype(args.kv_dtype, &opened);
    args.backend.check(kv_dtype)?;
    let quiet = args.tp.tp_rank.is_some_and(|r| r > 0);
    if !quiet && args.backend.backend == Backend::Cpu {
        super::logits::log_gpu_tactics(
            args.backend.tactics.as_deref(),
            args.tactics_sm,
            args.tp.world(),
            &config,
            args.batch,
            requests[0].prompt.len() + args.max_new_tokens,
            kv_dtype,
        );
    }
    let placement = args.backend.weight_placement(&opened);
    drop(opened);
    // Pages are per sequence: round each sequence up to whole pages.
    let total_tokens: usize = requests
        .iter()
        .map(|r| (r.prompt.len() + r.max_new_tokens).div_ceil(PAGE_TOKENS) * PAGE_TOKENS)
        .sum();
    let sizing = RunnerSizing {
        kv_dtype,
        cache_tokens: total_tokens,
        capacity: StepCapacity {
            tokens: requests[0].prompt.len().max(args.batch),
            logit_rows: args.batch,
        },
        fill_memory: false,
    };
    let ignore_eos = args.ignore_eos;
    let role = open_ranks(
        &args.backend,
        &args.tp,
        sizing,
        |shard| {
            let mut model = load(&dir, shard, |_| placement)?;
            if ignore_eos {
                model.config.eos_token_ids.clear();
            }
            Ok(model)
        },
        quiet,
    )?;
    let RankRole::Lead(mut runner) = role else {
        return Ok(());
    };
    header(
        &dir,
        runner.config(),
        started,
        kv_dtype,
        &args.backend,
        args.tp.world(),
    );
    if args.warmup {
        generate(runner.as_mut(), &requests, |_, _| {})?;
    }
    if args.profile_ops {
        runner.profile_ops();
    }
    let (results, timing) = generate(runner.as_mut(), &requests, |_, _| {})?;
    if let Some(report) = runner.op_profile_report() {
        print!("{report}");
    }
    for (i, r) in results.iter().enumerate() {
        println!("{}", sequence_line(i, r));
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

/// `sequence I: STOP (N tokens): ID,ID,…`: why it stopped (`eos`, the end-of-sequence
/// token, or `length`, --max-new-tokens) and its ids as `--prompt` takes them.
fn sequence_line(i: usize, result: &GenerationResult) -> String {
    let stop = match result.stop {
        StopReason::Eos => "eos",
        StopReason::Length => "length",
    };
    let ids: Vec<String> = result.tokens.iter().map(u32::to_string).collect();
    format!(
        "sequence {i}: {stop} ({}): {}",
        counted(result.tokens.len(), "token"),
        ids.join(",")
    )
}

fn header(
    dir: &Path,
    c: &ModelConfig,
    started: std::time::Instant,
    kv_dtype: KvCacheDtype,
    backend: &BackendArgs,
    world: usize,
) {
    println!(
        "model {} ({} layers, hidden {}, {} experts top-{}), loaded in {:.2} s; KV cache {}; backend {} (TP {})",
        dir.display(),
        c.num_hidden_layers,
        c.hidden_size,
        c.n_routed_experts,
        c.num_experts_per_tok,
        started.elapsed().as_secs_f64(),
        kv_dtype.id(),
        backend.backend.name(),
        world
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_line_is_plain_text_its_ids_as_the_prompt_takes_them() {
        let result = GenerationResult {
            tokens: vec![7, 0, 123],
            stop: StopReason::Length,
        };
        let line = sequence_line(2, &result);
        assert_eq!(line, "sequence 2: length (3 tokens): 7,0,123");
        let ids = line.rsplit(": ").next().unwrap();
        let TokenIds(parsed) = ids.parse().unwrap();
        assert_eq!(parsed, result.tokens);
        let eos = GenerationResult {
            tokens: vec![5],
            stop: StopReason::Eos,
        };
        assert_eq!(sequence_line(0, &eos), "sequence 0: eos (1 token): 5");
    }
}

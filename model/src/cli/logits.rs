//! `model logits` (one prefill's logits of every position, written as float32 `[T, vocab]`)
//! and `model compare-logits`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use kernels::mla::cache::KvCacheDtype;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

use super::args::{KvDtypeArg, kv_dtype_for, resolve_kv_dtype};
use crate::arch::config::ModelConfig;
use crate::checkpoint::hub::resolve_checkpoint;
use crate::checkpoint::writer::{OutputKind, StagedOutput};
use crate::checkpoint::{Checkpoint, check_tensor_parallel, load_model as load};
use crate::exec::backend::{Backend, BackendArgs, RunnerSizing, TpArgs, parse_sm};
use crate::exec::device::StepCapacity;
use crate::exec::footprint::forward_bytes;
use crate::exec::ops::{LogitRows, SeqInput};
use crate::exec::tp::{RankRole, open_ranks};
use crate::input::{InvalidInput, TokenIds, check_memory, largest_fitting};

#[derive(clap::Args, Clone)]
pub struct LogitsArgs {
    /// A checkpoint folder, or a Hugging Face repository id in the local cache
    /// (`nvidia/Kimi-K2.5-NVFP4`).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Comma-separated token ids.
    #[arg(long)]
    tokens: TokenIds,
    /// The safetensors file to write (tensor `logits`, float32 `[T, vocab]`); replaced if it
    /// exists, never inside the checkpoint.
    #[arg(long)]
    out: PathBuf,
    /// Latent cache dtype. Scoring defaults to FP32, the reference; `bf16`/`fp8` (or `auto`,
    /// what the checkpoint asks for) show what a deployment's cache costs.
    #[arg(
        long,
        visible_alias = "kv-cache-dtype",
        value_enum,
        default_value = "f32"
    )]
    kv_dtype: KvDtypeArg,
    /// The SM whose GPU tactics a CPU run logs from `--tactics` (120: RTX PRO 6000, 90: H200).
    #[arg(long, default_value = "120", value_parser = parse_sm)]
    tactics_sm: kernels::arch::Sm,
    #[command(flatten)]
    tp: TpArgs,
    #[command(flatten)]
    backend: BackendArgs,
}

pub fn logits(args: LogitsArgs) -> Result<()> {
    let dir = &resolve_checkpoint("--checkpoint", &args.checkpoint)?;
    let (TokenIds(tokens), out) = (&args.tokens, &args.out);
    args.backend.check_available()?;
    let opened = Checkpoint::open(dir)?;
    let config = opened.model_config().clone();
    check_tensor_parallel(dir, &config, args.tp.world())?;
    check_scoring_request(&args, &config)?;
    let kv_dtype = resolve_kv_dtype(args.kv_dtype, &opened);
    args.backend.check(kv_dtype)?;
    let quiet = args.tp.tp_rank.is_some_and(|r| r > 0);
    if !quiet && args.backend.backend == Backend::Cpu {
        log_gpu_tactics(
            args.backend.tactics.as_deref(),
            args.tactics_sm,
            args.tp.world(),
            &config,
            tokens.len(),
            tokens.len(),
            kv_dtype,
        );
    }
    let placement = args.backend.weight_placement(&opened);
    drop(opened);
    // Checked here, before any work; the file itself is written by rank 0 at the end.
    if !quiet {
        drop(logits_output(out, dir)?);
    }
    let sizing = RunnerSizing {
        kv_dtype,
        cache_tokens: tokens.len(),
        capacity: StepCapacity {
            tokens: tokens.len(),
            logit_rows: tokens.len(),
        },
        fill_memory: false,
    };
    let role = open_ranks(
        &args.backend,
        &args.tp,
        sizing,
        |shard| load(dir, shard, |_| placement),
        quiet,
    )?;
    let RankRole::Lead(mut runner) = role else {
        return Ok(());
    };
    let seq = runner.add_sequence();
    let logits = runner.logits(&[SeqInput { seq, tokens }], LogitRows::All)?;
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

/// Logs, once per command (not per rank), the tactic each GPU family of `sm` would use for this
/// run's shapes from the cache at `tactics`: what the tuning lab chose, where this run computes
/// on the CPU.
#[allow(clippy::too_many_arguments)]
pub fn log_gpu_tactics(
    tactics: Option<&Path>,
    sm: kernels::arch::Sm,
    world: usize,
    config: &ModelConfig,
    tokens: usize,
    context: usize,
    kv: KvCacheDtype,
) {
    if tactics.is_none() {
        return;
    }
    let run = crate::exec::tactics::RunShapes {
        sm,
        tp: world as u32,
        tokens: tokens as u32,
        context: context as u32,
        fp8_cache: kv == KvCacheDtype::Fp8E4m3,
    };
    let lines = crate::exec::tactics::tactic_lines(tactics, config, &run);
    // None for a CPU cache: the CPU backend logs its tactic.
    if lines.is_empty() {
        return;
    }
    eprintln!("tactics for {sm} (the GPU executor's kernels; this run computes on the CPU):");
    for line in lines {
        eprintln!("  {line}");
    }
}

/// The logits file: replaced if it exists (a result, not a checkpoint), never inside the
/// checkpoint, written whole or not at all.
pub fn compare_logits(
    candidate: &str,
    reference: &str,
    max_rel_l2: f64,
    as_close_as: Option<&str>,
) -> Result<()> {
    let (b, vocab) = super::compare::read_logits(reference)?;
    let against = |spec: &str| -> Result<super::compare::LogitsAgreement> {
        let (a, width) = super::compare::read_logits(spec)?;
        if width != vocab {
            anyhow::bail!(InvalidInput(format!(
                "{spec} has rows of {width}, {reference} of {vocab}"
            )));
        }
        let agreement = super::compare::compare(&a, &b, vocab)?;
        println!("{spec} vs {reference}: {}", agreement.summary());
        Ok(agreement)
    };
    let ours = against(candidate)?;
    if ours.non_finite > 0 {
        anyhow::bail!(
            "{candidate} holds {} NaN or infinite values: no bound passes it",
            ours.non_finite
        );
    }
    match as_close_as {
        None if !ours.within(max_rel_l2) => anyhow::bail!(
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

//! Whole decode steps of a model under each prefetch reach ([`PrefetchReach`]), alternating
//! step by step in one process: the machine's bandwidth drifts between runs (on a shared VM
//! by ±12 % between processes, and between ~33 and ~55 GB/s within minutes), so only steps
//! taken side by side compare reaches. Batch 1 (or `--batch N` sequences) after random
//! prompts, the weights where `model run` reads them (`--weights auto`), the backend
//! `model run` uses (`TunedCpuBackend`, default tactic). Every round measures the read bandwidth, then takes a block of steps per
//! reach, in an order rotating with the round; the report is each reach's median step time
//! and, per round, its time over the default reach's, with the medians of those ratios.
//!
//! ```sh
//! cargo run --release -p bench --example decode_prefetch [-- --checkpoint DIR --rounds N --steps N --batch N]
//! ```
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use bench::cpu_tactics::median_spread;
use kernels::cpu_tactic::CpuTactic;
use kernels::mla::cache::KvCacheDtype;
use kernels::moe_gemm::cpu_simd::PrefetchReach;
use model::backend::TunedCpuBackend;
use model::checkpoint::{Checkpoint, WeightPlacement};
use model::forward::{LogitRows, Model, SeqInput};
use model::quantize::random_tokens;

struct Options {
    checkpoint: Option<PathBuf>,
    rounds: usize,
    /// Steps per reach and round.
    steps: usize,
    prompt: usize,
    /// Sequences decoded together.
    batch: usize,
}

fn options() -> Result<Options> {
    let mut o = Options {
        checkpoint: None,
        rounds: 8,
        steps: 24,
        prompt: 128,
        batch: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--checkpoint" => o.checkpoint = Some(PathBuf::from(value()?)),
            "--rounds" => o.rounds = value()?.parse()?,
            "--steps" => o.steps = value()?.parse()?,
            "--prompt" => o.prompt = value()?.parse()?,
            "--batch" => o.batch = value()?.parse()?,
            other => anyhow::bail!(
                "unknown option {other} (--checkpoint DIR, --rounds N, --steps N, --prompt N, --batch N)"
            ),
        }
    }
    anyhow::ensure!(
        o.rounds > 0 && o.steps > 0 && o.batch > 0,
        "--rounds, --steps and --batch must be positive"
    );
    Ok(o)
}

fn main() -> Result<()> {
    model::heap::keep_freed_activations();
    let o = options()?;
    let dir = match &o.checkpoint {
        Some(dir) => dir.clone(),
        None => model::generator::default_checkpoint(None)?,
    };
    let mut checkpoint = Checkpoint::open(&dir)?;
    checkpoint.place_weights(WeightPlacement::auto(checkpoint.file_bytes()));
    let model = Model::new(
        checkpoint.model_config().clone(),
        checkpoint.load_weights()?,
    );
    let backend = TunedCpuBackend::new(CpuTactic::default()).map_err(anyhow::Error::msg)?;
    let default_reach = PrefetchReach::current();
    let reaches = PrefetchReach::ALL;
    let total_steps = o.rounds * o.steps * reaches.len();
    let mut cache = model.new_cache(KvCacheDtype::Bf16, o.batch * (o.prompt + total_steps + 1));
    let seqs: Vec<_> = (0..o.batch).map(|_| cache.add_sequence()).collect();
    let prompts: Vec<Vec<u32>> = (0..o.batch)
        .map(|b| random_tokens(o.prompt, model.config.vocab_size, 1 + b as u64))
        .collect();
    let inputs: Vec<SeqInput<'_>> = seqs
        .iter()
        .zip(&prompts)
        .map(|(&seq, prompt)| SeqInput {
            seq,
            tokens: prompt,
        })
        .collect();
    let logits = model.forward(&backend, &mut cache, &inputs, LogitRows::Last, None)?;
    let mut tokens: Vec<[u32; 1]> = (0..o.batch)
        .map(|b| [model::sampler::argmax(logits.row(b))])
        .collect();
    println!(
        "{} (batch {}, prompt {}), {} rounds of {} steps per reach; default reach {}",
        dir.display(),
        o.batch,
        o.prompt,
        o.rounds,
        o.steps,
        default_reach.name()
    );
    // [reach]: every step's seconds; the per-round median over the default's.
    let mut step_times = vec![Vec::new(); reaches.len()];
    let mut over_default = vec![Vec::new(); reaches.len()];
    for round in 0..o.rounds {
        let (_, read) = bench::bandwidth(2);
        let mut round_medians = vec![0.0; reaches.len()];
        for i in 0..reaches.len() {
            let k = (i + round) % reaches.len();
            reaches[k].set();
            let mut times = Vec::with_capacity(o.steps);
            for _ in 0..o.steps {
                let start = Instant::now();
                let inputs: Vec<SeqInput<'_>> = seqs
                    .iter()
                    .zip(&tokens)
                    .map(|(&seq, token)| SeqInput { seq, tokens: token })
                    .collect();
                let logits = model.forward(&backend, &mut cache, &inputs, LogitRows::Last, None)?;
                for (b, token) in tokens.iter_mut().enumerate() {
                    token[0] = model::sampler::argmax(logits.row(b));
                }
                times.push(start.elapsed().as_secs_f64());
            }
            step_times[k].extend_from_slice(&times);
            round_medians[k] = median_spread(&mut times).0;
        }
        let default_index = reaches.iter().position(|&r| r == default_reach);
        let base = round_medians[default_index.context("the default reach is one of ALL")?];
        let mut line = format!("round {round}: read {read:.1} GB/s; median step ms:");
        for (k, reach) in reaches.iter().enumerate() {
            over_default[k].push(round_medians[k] / base);
            line += &format!(" {} {:.3}", reach.name(), round_medians[k] * 1e3);
        }
        println!("{line}");
    }
    default_reach.set();
    println!("over all rounds:");
    for (k, reach) in reaches.iter().enumerate() {
        println!(
            "  {:<7} median step {:.3} ms; median of per-round ratios to {}: {:.3}",
            reach.name(),
            median_spread(&mut step_times[k]).0 * 1e3,
            default_reach.name(),
            median_spread(&mut over_default[k]).0
        );
    }
    Ok(())
}

//! Whole decode steps of a model under each prefetch reach ([`PrefetchReach`]), alternating
//! step by step in one process: the machine's bandwidth drifts between runs (on a shared VM
//! by ±12 % between processes, and between ~33 and ~55 GB/s within minutes), so only steps
//! taken side by side compare reaches. Batch 1 (or `--batch N` sequences) after random
//! prompts, the weights where `model run` reads them (`--weights auto`), the backend
//! `model run` uses (the tuned CPU runner, default tactic). Every round measures the read
//! bandwidth, then takes a block of steps per reach, in an order rotating with the round; the
//! report is each reach's median step time and, per round, its time over the default
//! reach's, with the medians of those ratios.
//!
//! ```sh
//! cargo run --release -p bench --example decode_prefetch [-- --checkpoint DIR --rounds N --steps N --batch N]
//! ```
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use bench::cpu_tactics::median_spread;
use clap::Parser;
use kernels::cpu_tactic::CpuTactic;
use kernels::mla::cache::{KvCacheDtype, PAGE_TOKENS};
use kernels::prefetch::PrefetchReach;
use model::exec::cpu::pool::CpuCompute;
use model::exec::cpu::{CpuOptions, cpu_runner};
use model::exec::sampler::SampleRow;
use model::exec::{ModelRunner, SeqInput};
use model::quantize::random_tokens;

/// Whole decode steps under each prefetch reach, alternating in one process.
#[derive(Parser)]
struct Options {
    /// The checkpoint directory (default: `model run`'s default `mini` model).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Rounds, each a block of steps per reach.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Steps per reach and round.
    #[arg(long, default_value_t = 24, value_parser = clap::value_parser!(u32).range(1..))]
    steps: u32,
    /// Prompt tokens per sequence before the decode steps.
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
}

fn main() -> Result<()> {
    model::exec::cpu::heap::keep_freed_activations();
    let o = Options::parse();
    let (rounds, steps, batch) = (o.rounds as usize, o.steps as usize, o.batch as usize);
    let (dir, model) = bench::load_model_as_run(o.checkpoint.as_deref())?;
    let default_reach = PrefetchReach::current();
    let reaches = PrefetchReach::ALL;
    let total_steps = rounds * steps * reaches.len();
    // Each sequence's tokens fill whole pages of its own.
    let per_sequence = (o.prompt + total_steps + 1).next_multiple_of(PAGE_TOKENS);
    let mut runner = cpu_runner(
        &model,
        CpuOptions {
            compute: CpuCompute::tuned(CpuTactic::default()).map_err(anyhow::Error::msg)?,
            ..CpuOptions::new(KvCacheDtype::Bf16, batch * per_sequence)
        },
    );
    let seqs: Vec<_> = (0..batch).map(|_| runner.add_sequence()).collect();
    let greedy = vec![SampleRow::default(); batch];
    let prompts: Vec<Vec<u32>> = (0..batch)
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
    let mut tokens: Vec<[u32; 1]> = runner
        .step(&inputs, &greedy)?
        .into_iter()
        .map(|t| [t])
        .collect();
    println!(
        "{} (batch {}, prompt {}), {} rounds of {} steps per reach; default reach {}",
        dir.display(),
        batch,
        o.prompt,
        rounds,
        steps,
        default_reach.name()
    );
    // [reach]: every step's seconds; the per-round median over the default's.
    let mut step_times = vec![Vec::new(); reaches.len()];
    let mut over_default = vec![Vec::new(); reaches.len()];
    for round in 0..rounds {
        let (_, read) = bench::bandwidth(2);
        let mut round_medians = vec![0.0; reaches.len()];
        for i in 0..reaches.len() {
            let k = (i + round) % reaches.len();
            reaches[k].set();
            let mut times = Vec::with_capacity(steps);
            for _ in 0..steps {
                let start = Instant::now();
                let inputs: Vec<SeqInput<'_>> = seqs
                    .iter()
                    .zip(&tokens)
                    .map(|(&seq, token)| SeqInput { seq, tokens: token })
                    .collect();
                let next = runner.step(&inputs, &greedy)?;
                for (token, next) in tokens.iter_mut().zip(next) {
                    token[0] = next;
                }
                times.push(start.elapsed().as_secs_f64());
            }
            step_times[k].extend_from_slice(&times);
            round_medians[k] = median_spread(&mut times).0;
        }
        let base = round_medians[default_reach.index()];
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

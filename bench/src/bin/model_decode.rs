//! The CPU decode step of the `mini` model at batch 1 against the machine's memory bandwidth,
//! measured in the same run.
//!
//! ```sh
//! cargo run --release -p bench --bin model-decode                     # the table on stdout
//! cargo run --release -p bench --bin model-decode -- --write-results  # and bench/results/model_decode.txt
//! cargo run --release -p bench --bin model-decode -- --checkpoint DIR --steps 32
//! ```
//!
//! A decode step reads every weight it multiplies with once (attention, dense and shared MLPs,
//! the router, `lm_head`, the routed experts the token chose) and the latent cache of every
//! layer. The runner's operation profile adds the weights' bytes up as the step runs (the
//! routed experts the routing chose, each once), the cache's are its tokens, so the figure is the bytes
//! the step actually read, divided by its wall time, and compared with the copy and read
//! bandwidth of this machine taken just before.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use bench::{bandwidth, cpu_model, load_average, utc_date};
use kernels::mla::cache::{KvCacheDtype, LatentCacheShape};
use model::exec::cpu::{CpuOptions, cpu_runner};
use model::exec::sampler::SampleRow;
use model::exec::{ModelRunner, SeqInput};
use model::quantize::random_tokens;

/// The CPU decode step at batch 1 against the memory bandwidth measured in the same run; the
/// table goes to stdout.
#[derive(clap::Parser, Debug)]
#[command(name = "model-decode")]
struct Options {
    /// A checkpoint folder (default: the generated `mini`, as `model run`).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Decode steps timed per latent-cache type.
    #[arg(long, default_value_t = 48)]
    steps: usize,
    /// Prompt tokens prefilled before the timed steps.
    #[arg(long, default_value_t = 512)]
    prompt: usize,
    /// Also write the table to this file.
    #[arg(long, conflicts_with = "write_results")]
    out: Option<PathBuf>,
    /// Also write the table to bench/results/model_decode.txt (from the repository root; the
    /// default model only).
    #[arg(long, conflicts_with = "checkpoint")]
    write_results: bool,
}

fn main() -> Result<()> {
    // As `model run` does: its steps' freed activations stay in the heap.
    model::exec::cpu::heap::keep_freed_activations();
    let o: Options = clap::Parser::parse();
    let out = bench::report_path(o.out.as_deref(), o.write_results, "model_decode.txt");
    let (dir, model) = bench::load_model_as_run(o.checkpoint.as_deref())?;
    let c = &model.config;
    let load_start = load_average();
    let (copy, read) = bandwidth(15);
    let mut report = String::new();
    writeln!(
        report,
        "# date: {}; cpu: {}; rayon threads: {}",
        utc_date(),
        cpu_model(),
        rayon::current_num_threads()
    )?;
    writeln!(
        report,
        "# model: {} ({} layers, hidden {}, {} experts top-{})",
        // The folder's name: a committed report names no machine's paths.
        dir.file_name().unwrap_or(dir.as_os_str()).to_string_lossy(),
        c.num_hidden_layers,
        c.hidden_size,
        c.n_routed_experts,
        c.num_experts_per_tok
    )?;
    writeln!(
        report,
        "# copy: {copy:.2} GB/s (read + written bytes); read: {read:.2} GB/s; best of 15, 512 MiB"
    )?;
    writeln!(
        report,
        "# bytes/step = weights multiplied (attention, dense, shared, router, lm_head, the routed experts chosen) + latent cache read, counted as the step runs"
    )?;
    writeln!(
        report,
        "# batch 1, prompt {} tokens then {} decode steps; GB/s over all steps; best_step_ms = the fastest step",
        o.prompt, o.steps
    )?;
    let mut summary = Vec::new();
    for dtype in [KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
        let mut runner = cpu_runner(&model, CpuOptions::new(dtype, o.prompt + o.steps + 1));
        let seq = runner.add_sequence();
        let prompt = random_tokens(o.prompt, c.vocab_size, 1);
        let greedy = [SampleRow::default()];
        let mut token = runner.step(
            &[SeqInput {
                seq,
                tokens: &prompt,
            }],
            &greedy,
        )?[0];
        runner.profile_ops();
        let shape = LatentCacheShape {
            layers: c.num_hidden_layers,
            latent_dim: c.kv_lora_rank,
            rope_dim: c.qk_rope_head_dim,
        };
        let cache_token = (dtype.bytes_per_token(&shape) * c.num_hidden_layers) as u64;
        let (mut cache_bytes, mut seconds, mut best) = (0u64, 0f64, f64::MAX);
        for step in 0..o.steps {
            let start = Instant::now();
            token = runner.step(
                &[SeqInput {
                    seq,
                    tokens: &[token],
                }],
                &greedy,
            )?[0];
            let elapsed = start.elapsed().as_secs_f64();
            // Every layer's attention reads the cache up to and including the new token.
            cache_bytes += (o.prompt + step + 1) as u64 * cache_token;
            seconds += elapsed;
            best = best.min(elapsed);
        }
        let profile = runner.op_profile().context("profiled steps")?;
        let weights: u64 = profile.totals().0.iter().map(|(_, t)| t.weight_bytes).sum();
        // The embedding row each step gathers is not a product's weight.
        let bytes = weights + cache_bytes + (o.steps * c.hidden_size * 2) as u64;
        let gbs = bytes as f64 / seconds / 1e9;
        let line = format!(
            "model_decode kv={} tok/s={:.1} bytes/step={:.1}MB GB/s={gbs:.2} copy_ratio={:.3} read_ratio={:.3} best_step_ms={:.2}",
            dtype.id(),
            o.steps as f64 / seconds,
            bytes as f64 / o.steps as f64 / 1e6,
            gbs / copy,
            gbs / read,
            best * 1e3
        );
        println!("{line}");
        summary.push(line);
    }
    writeln!(
        report,
        "# load average (1 min) at start / end: {load_start} / {}",
        load_average()
    )?;
    for line in summary {
        writeln!(report, "{line}")?;
    }
    bench::emit_report(&report, out.as_deref())
}

//! `autotune`: see the crate documentation and `autotune/README.md`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "autotune",
    about = "The tuning lab: tactics gated, checked and timed per shape"
)]
struct Cli {
    /// Tune the CPU kernels on this machine, measured (tile sizes, parallel thresholds,
    /// threads), on the decode of `--model` (a checkpoint folder; default: the embedded
    /// kimi-chat-tiny).
    #[arg(long)]
    cpu: bool,
    /// `--cpu`: a checkpoint folder.
    #[arg(long)]
    model: Option<String>,
    /// Where the tactic cache is written.
    #[arg(long)]
    out: Option<PathBuf>,
    /// `--cpu`: seconds per kernel family and shape.
    #[arg(long, default_value_t = 2.0)]
    cpu_kernel_secs: f64,
    /// `--cpu`: seconds per knob of the decode stage.
    #[arg(long, default_value_t = 4.0)]
    cpu_decode_secs: f64,
    /// `--cpu`: prompt tokens of each timed decode (prefilled, not timed).
    #[arg(long, default_value_t = 16)]
    cpu_prompt_len: usize,
    /// `--cpu`: tokens each timed decode generates (a bigger model wants fewer).
    #[arg(long, default_value_t = 24)]
    cpu_decode_tokens: usize,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if cli.cpu {
        let secs = |s: f64| Duration::from_secs_f64(s.clamp(0.0, 3600.0));
        autotune::cpu::run(&autotune::cpu::CpuOptions {
            model: cli.model.map(PathBuf::from),
            out: cli.out.unwrap_or_else(|| PathBuf::from("cpu-tactics.json")),
            kernel_budget: secs(cli.cpu_kernel_secs),
            decode_budget: secs(cli.cpu_decode_secs),
            prompt_len: cli.cpu_prompt_len.max(1),
            new_tokens: cli.cpu_decode_tokens.max(2),
            // Without the binary's own path (a machine path).
            command: std::iter::once("autotune".to_string())
                .chain(std::env::args().skip(1))
                .collect::<Vec<_>>()
                .join(" "),
        })?;
    }
    Ok(())
}

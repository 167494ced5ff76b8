//! `autotune`: see the crate documentation and `autotune/README.md`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use autotune::tune::{self, GPU_FAMILIES, Options};
use clap::{Parser, Subcommand};
use kernels::arch::Sm;
use kernels::tactic::KernelFamily;
use model::config::CheckpointConfig;
use model::generator::Preset;

#[derive(Parser, Debug)]
#[command(
    name = "autotune",
    about = "The tuning lab: every tactic gated (static), checked against the goldens (correct) \
             and timed or, without a device, predicted, per problem shape; writes the tactic cache"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// The SM to tune for: 120 (RTX PRO 6000) or 90 (H200).
    #[arg(long, default_value = "120")]
    sm: String,
    /// The model whose shapes are tuned (a preset).
    #[arg(
        long,
        value_enum,
        default_value = "kimi-k2.5",
        conflicts_with = "checkpoint"
    )]
    model: Preset,
    /// A checkpoint folder whose config.json gives the shapes instead of a preset.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Tensor-parallel ranks (shapes are per rank).
    #[arg(long, default_value_t = 8)]
    tp: u32,
    /// Where to write the tactic cache (JSON).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Families to tune (comma-separated: moe_gemm, mla, allreduce, layers); default all.
    #[arg(long, value_delimiter = ',')]
    families: Vec<String>,
    /// Only tactics whose id contains this.
    #[arg(long)]
    filter: Option<String>,
    /// Mutation test: perturb the launches of this tactic (its grid one block short in x);
    /// the correct stage must prune it.
    #[arg(long)]
    perturb: Option<String>,
    /// The compile gate's manifest.
    #[arg(long, default_value = "ptx/manifest.json")]
    manifest: PathBuf,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Tune the CPU kernels on this machine instead, measured (tile sizes, parallel
    /// thresholds, threads), on the decode of `--checkpoint DIR` (default: the embedded
    /// kimi-chat-tiny); writes family `cpu` entries.
    #[arg(long)]
    cpu: bool,
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

#[derive(Subcommand, Debug)]
enum Command {
    /// Predicted decode tok/s of the model on 8× RTX PRO 6000 (the step-time model).
    StepTime {
        /// Folder for the table (txt, json) and the chart (svg).
        #[arg(long, default_value = "bench/results")]
        out_dir: PathBuf,
        /// A tactic cache whose winners are compared with the heuristic defaults.
        #[arg(long)]
        tactics: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<ExitCode> {
    let cli = Cli::parse();
    if cli.cpu {
        let secs = |s: f64| Duration::from_secs_f64(s.clamp(0.0, 3600.0));
        autotune::cpu::run(&autotune::cpu::CpuOptions {
            model: cli.checkpoint.clone(),
            out: cli
                .out
                .clone()
                .unwrap_or_else(|| PathBuf::from("cpu-tactics.json")),
            kernel_budget: secs(cli.cpu_kernel_secs),
            decode_budget: secs(cli.cpu_decode_secs),
            prompt_len: cli.cpu_prompt_len.max(1),
            new_tokens: cli.cpu_decode_tokens.max(2),
            // Without argv[0]: a machine path has no place in a committed cache.
            command: std::iter::once("autotune".to_string())
                .chain(std::env::args().skip(1))
                .collect::<Vec<_>>()
                .join(" "),
        })?;
        return Ok(ExitCode::SUCCESS);
    }
    let sm = Sm::parse(&cli.sm).with_context(|| format!("--sm {}: expected 120 or 90", cli.sm))?;
    let (model, model_name) = match &cli.checkpoint {
        Some(dir) => (
            CheckpointConfig::from_dir(dir)
                .with_context(|| format!("{}", dir.display()))?
                .model,
            dir.display().to_string(),
        ),
        None => (cli.model.model_config(), cli.model.id().to_string()),
    };
    if cli.tp == 0 || model.num_attention_heads % cli.tp as usize != 0 {
        bail!(
            "--tp {}: must divide the {} heads",
            cli.tp,
            model.num_attention_heads
        );
    }
    if let Some(Command::StepTime { out_dir, tactics }) = &cli.command {
        let text = autotune::steptime::write_report(
            &model,
            &model_name,
            cli.tp,
            out_dir,
            &cli.manifest,
            tactics.as_deref(),
        )?;
        print!("{text}");
        return Ok(ExitCode::SUCCESS);
    }
    let Some(out) = cli.out.clone() else {
        bail!("--out FILE is required (where the tactic cache goes)");
    };
    let families = if cli.families.is_empty() {
        GPU_FAMILIES.to_vec()
    } else {
        cli.families
            .iter()
            .map(|f| {
                KernelFamily::parse(f)
                    .filter(|f| GPU_FAMILIES.contains(f))
                    .with_context(|| format!("--families: unknown GPU family {f:?}"))
            })
            .collect::<Result<_>>()?
    };
    let opts = Options {
        sm,
        tp: cli.tp,
        model,
        model_name: model_name.clone(),
        manifest: cli.manifest.clone(),
        families,
        perturb: cli.perturb.clone(),
        filter: cli.filter.clone(),
        progress: !cli.quiet,
        // Without argv[0]: a machine path has no place in a committed cache.
        command: std::iter::once("autotune".to_string())
            .chain(std::env::args().skip(1))
            .collect::<Vec<_>>()
            .join(" "),
    };
    eprintln!(
        "autotune: {model_name} at TP{} on {} — stages: static (manifest), correct (goldens), \
         timed (predicted)",
        cli.tp, sm
    );
    let report = tune::run(&opts)?;
    for n in &report.notes {
        eprintln!("note: {n}");
    }
    for p in &report.pruned {
        eprintln!("pruned [{}] {} {}: {}", p.stage, p.family, p.tactic, p.why);
    }
    print!("{}", report.table(sm));
    for e in &report.cache.entries {
        println!(
            "{:<10} {:<34} {:<44} {:>9.2} µs {}",
            e.family.id(),
            e.bucket,
            e.winner.tactic,
            e.winner.median_us,
            e.winner.source
        );
    }
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&out, report.cache.to_json())
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "autotune: wrote {} ({} entries, every figure predicted)",
        out.display(),
        report.cache.entries.len()
    );
    Ok(ExitCode::SUCCESS)
}

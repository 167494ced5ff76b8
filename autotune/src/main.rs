//! `autotune`: see the crate documentation and `autotune/README.md`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use autotune::refit;
use autotune::tune::{self, GPU_FAMILIES, Options, Predictor, Timing};
use bench::gpu_timing::TimingOptions;
use clap::{Parser, Subcommand};
use kernels::arch::Sm;
use kernels::tactic::KernelFamily;
use kernels::timed_device::{TimedDevice, WithTimedDevice, with_timed_device};
use model::arch::config::CheckpointConfig;
use model::arch::presets::Preset;

#[derive(Parser, Debug)]
#[command(
    name = "autotune",
    about = "The tuning lab: every tactic gated (static), checked against the goldens (correct) \
             and timed on the device or, without one, predicted, per problem shape; writes the \
             tactic cache to --out FILE, else to stdout (and, after a device run with --out, \
             the refitted cost model and the predicted-vs-measured gap table beside it)"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// The SM to tune for: 120 (RTX PRO 6000) or 90 (H200), or `auto`: the GPU's (`--device`;
    /// refused without one).
    #[arg(long, default_value = "120")]
    sm: String,
    /// The model whose shapes are tuned (a preset; the GPU families).
    #[arg(
        long,
        value_enum,
        default_value = "kimi-k2.5",
        conflicts_with = "checkpoint"
    )]
    model: Preset,
    /// A checkpoint folder whose config.json gives the shapes instead of a preset; with
    /// --cpu, the model whose decode is tuned (default: `model run`'s, the generated mini).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Tensor-parallel ranks (shapes are per rank).
    #[arg(long, default_value_t = 8)]
    tp: u32,
    /// Where to write the tactic cache (JSON); default: stdout (the table then goes to
    /// stderr).
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
    /// The timed stage: `auto` measures on the device when one of the SM is present (a binary
    /// built with --features cuda) and predicts otherwise; `measure` refuses (exit 2, with
    /// the reason) where it cannot measure; `predict` never measures.
    #[arg(long, default_value = "auto")]
    timing: String,
    /// The GPU to measure on.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Kernel images (the compile gate's cubins) for the device.
    #[arg(long, env = "KIMI_PTX_DIR", default_value = "ptx")]
    ptx_dir: PathBuf,
    /// Timed stage: shape buckets not started within this many seconds are predicted.
    #[arg(long, default_value_t = 120.0)]
    time_budget: f64,
    /// Timed stage: untimed runs before the timed ones, per (tactic, shape).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed stage: timed runs per (tactic, shape) (their median, spread and count go into
    /// the cache).
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Timed stage: do not flush the L2 before each run.
    #[arg(long)]
    no_l2_flush: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Tune the CPU kernels on this machine instead, measured (tile sizes, parallel
    /// thresholds, threads), on the decode of `--checkpoint DIR` (default: the model `model
    /// run` runs by default, the generated mini); writes family `cpu` entries.
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
        /// Folder for the table (txt, json) and the chart (svg); without it (or
        /// --write-results) the table goes to stdout only.
        #[arg(long, conflicts_with = "write_results")]
        out_dir: Option<PathBuf>,
        /// Write them into bench/results (from the repository root).
        #[arg(long)]
        write_results: bool,
        /// A tactic cache whose winners are compared with the heuristic defaults.
        #[arg(long, value_parser = kernels::tactic::cache::cache_path_arg)]
        tactics: Option<PathBuf>,
        /// The cost model fitted by a device run (`<cache>.cost-model.json`); used when fitted
        /// on the SM the step-time model prices.
        #[arg(long, value_parser = kernels::tactic::cache::cache_path_arg)]
        cost_model: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    // The timed stage runs the all-reduce's ranks as streams of one GPU whose kernels spin
    // until their peers' run: each needs a hardware work queue of its own (the default is 8,
    // exactly TP8). Set before the driver starts.
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        // SAFETY: first thing in main, before any other thread exists.
        unsafe { std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32") };
    }
    // The CPU tactics are timed on the model's steps, with the heap as `model run` keeps it.
    model::exec::cpu::heap::keep_freed_activations();
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("Error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// The SM of GPU `device`, for `--sm auto`.
fn device_sm(device: usize, ptx_dir: &std::path::Path) -> Result<Sm> {
    struct Probe;
    impl WithTimedDevice for Probe {
        type Output = Sm;
        fn run<D: TimedDevice>(self, dev: &D) -> Sm {
            dev.identity().sm
        }
    }
    with_timed_device(device, ptx_dir, None, Probe)
        .map_err(|why| anyhow::anyhow!("--sm auto: {why}"))
}

fn run() -> Result<ExitCode> {
    let cli = Cli::parse();
    if cli.cpu {
        let secs = |s: f64| Duration::from_secs_f64(s.clamp(0.0, 3600.0));
        autotune::cpu::run(&autotune::cpu::CpuOptions {
            model: cli.checkpoint.clone(),
            out: cli.out.clone(),
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
    let sm = if cli.sm == "auto" {
        device_sm(cli.device, &cli.ptx_dir)?
    } else {
        Sm::parse(&cli.sm).with_context(|| format!("--sm {}: expected 120, 90 or auto", cli.sm))?
    };
    let (model, model_name) = match &cli.checkpoint {
        Some(dir) => {
            let model = CheckpointConfig::from_dir(dir)
                .with_context(|| format!("{}", dir.display()))?
                .model;
            // The name the cache records: a preset's id, else the folder's (never a path).
            let name = model::exec::tactics::model_record_name(&model, Some(dir));
            (model, name)
        }
        None => (cli.model.model_config(), cli.model.id().to_string()),
    };
    if cli.tp == 0 || model.num_attention_heads % cli.tp as usize != 0 {
        bail!(
            "--tp {}: must divide the {} heads",
            cli.tp,
            model.num_attention_heads
        );
    }
    if let Some(Command::StepTime {
        out_dir,
        write_results,
        tactics,
        cost_model,
    }) = &cli.command
    {
        // A cache of another model would price this one with that model's winners.
        model::exec::tactics::check_cache_model(tactics.as_deref(), &model)?;
        let out_dir = match out_dir {
            Some(dir) => Some(dir.clone()),
            None => write_results.then(bench::results_dir_for_write_results),
        };
        let text = autotune::steptime::write_report(
            &model,
            &model_name,
            cli.tp,
            out_dir.as_deref(),
            &cli.manifest,
            tactics.as_deref(),
            cost_model.as_deref(),
        )?;
        print!("{text}");
        return Ok(ExitCode::SUCCESS);
    }
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
    let timing = Timing::parse(&cli.timing)
        .with_context(|| format!("--timing {}: expected auto, measure or predict", cli.timing))?;
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
        timing,
        device: cli.device,
        ptx_dir: cli.ptx_dir.clone(),
        time_budget: Duration::from_secs_f64(cli.time_budget.clamp(0.0, 86_400.0)),
        timing_options: TimingOptions {
            warmup: cli.warmup,
            reps: cli.reps.max(2),
            flush_l2: !cli.no_l2_flush,
            ..TimingOptions::default()
        },
    };
    eprintln!(
        "autotune: {model_name} at TP{} on {} — stages: static (manifest), correct (goldens), \
         timed (--timing {})",
        cli.tp, sm, cli.timing
    );
    let report = tune::run(&opts)?;
    for n in &report.notes {
        eprintln!("note: {n}");
    }
    for p in &report.pruned {
        eprintln!("pruned [{}] {} {}: {}", p.stage, p.family, p.tactic, p.why);
    }
    let mut table = report.table(sm);
    for e in &report.cache.entries {
        table += &format!(
            "{:<10} {:<34} {:<44} {:>9.2} µs {}\n",
            e.family.id(),
            e.bucket,
            e.winner.tactic,
            e.winner.median_us,
            e.winner.source
        );
    }
    // Without --out the cache is stdout's, whole: the table goes to stderr.
    let Some(out) = cli.out.clone() else {
        eprint!("{table}");
        print!("{}", report.cache.to_json());
        if !report.measured.is_empty() {
            eprintln!(
                "note: the refitted cost model and the gap table are written beside --out FILE \
                 only"
            );
        }
        return Ok(ExitCode::SUCCESS);
    };
    print!("{table}");
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&out, report.cache.to_json())
        .with_context(|| format!("writing {}", out.display()))?;
    let measured = report
        .cache
        .entries
        .iter()
        .filter(|e| e.winner.source == kernels::tactic::cache::FigureSource::Measured)
        .count();
    eprintln!(
        "autotune: wrote {} ({} entries: {measured} measured, {} predicted)",
        out.display(),
        report.cache.entries.len(),
        report.cache.entries.len() - measured
    );
    // A device run: refit the cost model and the all-reduce link model, and compare.
    let manifest = autotune::manifest::Manifest::load(&opts.manifest)?;
    let predictor = Predictor::new(sm, &opts.model, opts.tp, &manifest);
    if let Some(r) = refit::refit(&report, &predictor, opts.tp) {
        let sidecar = out.with_extension("cost-model.json");
        std::fs::write(&sidecar, r.file.to_json())
            .with_context(|| format!("writing {}", sidecar.display()))?;
        let gap = refit::gap_table(&r.gaps, &r.file.measured_on);
        let gap_path = out.with_extension("gap.txt");
        std::fs::write(&gap_path, &gap)
            .with_context(|| format!("writing {}", gap_path.display()))?;
        // The widest gaps only: every row is in the file.
        print!("{}", gap.split("\nevery point").next().unwrap_or(&gap));
        println!();
        if let Some(k) = &r.file.kernels {
            println!(
                "cost model refitted to {} points: rms relative residual {:.3} (assumed \
                 parameters {:.3}); held (not determined): {:?}",
                k.points, k.rms_relative_residual, k.assumed_rms_relative_residual, k.held
            );
        }
        if let Some(a) = &r.file.allreduce {
            println!(
                "all-reduce link model calibrated to {} points ({}): launch {:.2} µs, phase \
                 sync {:.2} µs, bandwidth scale {:.3}, rms {:.2} µs",
                a.points, a.measured_as, a.launch_us, a.phase_sync_us, a.bandwidth_scale, a.rms_us
            );
        }
        for n in &r.file.notes {
            eprintln!("note: {n}");
        }
        eprintln!(
            "autotune: wrote {} and {}",
            sidecar.display(),
            gap_path.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

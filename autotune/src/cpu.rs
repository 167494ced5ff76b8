//! `autotune --cpu [--checkpoint DIR] [--out FILE]`: measured tuning of the CPU kernels on this
//! machine, into the tactic cache (on stdout without `--out`). The model is `--checkpoint DIR`,
//! else the one `model run` runs by default (the generated `mini`): a cache serves only the
//! model it was tuned for, which it records ([`TunedModel`]).
//!
//! The search itself is `bench::cpu_tune` (kernels per family on the model's decode shapes,
//! then whole decode steps one knob group at a time, a change kept only beyond noise); this
//! module drives it with a progress bar and writes what it found as cache entries of family
//! [`KernelFamily::Cpu`] on target [`CPU_TARGET`], every figure `measured`:
//! - per kernel shape: bucket `cpu_<family>_<shape bucket>` (e.g. `cpu_moe_moe_t1_e8_h…`), the
//!   family's tactics fastest first, in µs per call;
//! - per knob of the decode stage: bucket `cpu_decode_knob_<knob>_<model>`, in µs per step;
//! - the verdict: bucket [`DECODE_BUCKET_PREFIX`]`<model>`, whose winner is the one tactic
//!   `model run --tactics FILE` applies; its runners-up are the default (when they differ) or
//!   the descent's result the confirmation round rejected, with their figures from that round.
//!
//! The decode entries' shape is the model's MoE layer at one token: it names which model the
//! step belongs to (a reader picks the entry of the model it runs, else any).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use bench::cpu_tactics::Shape;
use bench::cpu_tune::{self, DecodeBench, Figure, Progress, Ranked, Tuned};
use indicatif::{ProgressBar, ProgressStyle};
use kernels::cpu_tactic::{
    CPU_SOURCES_KEY, DECODE_BUCKET_PREFIX, cpu_kernel_source_hash, decode_entry_shape,
};
use kernels::isa::Isa;
use kernels::mla::MlaDims;
use kernels::tactic::cache::{
    CPU_TARGET, CacheEntry, FORMAT, FigureSource, NO_GPU, Provenance, TacticCache, TacticFigure,
    TunedModel, fnv1a64,
};
use kernels::tactic::{KernelFamily, ProblemShape};
use model::arch::config::ModelConfig;

/// Options of `autotune --cpu`.
#[derive(Clone, Debug)]
pub struct CpuOptions {
    /// A checkpoint folder; `None`: `model run`'s default model (the generated `mini`).
    pub model: Option<PathBuf>,
    /// Where the cache goes; `None`: stdout.
    pub out: Option<PathBuf>,
    /// Time per kernel family and shape.
    pub kernel_budget: Duration,
    /// Time per knob group of the decode stage.
    pub decode_budget: Duration,
    /// Prompt tokens each decode sample prefills (untimed).
    pub prompt_len: usize,
    /// Tokens each decode sample generates.
    pub new_tokens: usize,
    /// The command line, for the provenance.
    pub command: String,
}

struct Bar(ProgressBar);

impl Progress for Bar {
    fn stage(&mut self, name: &str, steps: u64) {
        self.0.set_length(steps);
        self.0.set_position(0);
        self.0.set_prefix(name.to_string());
    }
    fn step(&mut self, what: &str) {
        if self.0.message().is_empty() {
            self.0.set_message(what.to_string());
        } else {
            self.0.inc(1);
            self.0.set_message(what.to_string());
        }
    }
}

/// Runs the tuning and writes the cache; returns it.
pub fn run(o: &CpuOptions) -> Result<TacticCache> {
    let dir = match &o.model {
        Some(dir) => dir.clone(),
        None => model::quantize::generator::default_checkpoint(None)?,
    };
    let bench = DecodeBench::load(&dir, o.prompt_len, o.new_tokens)
        .with_context(|| format!("loading {}", dir.display()))?;
    let record = model::exec::tactics::tuned_model(
        &model::exec::tactics::model_record_name(&bench.model.config, Some(&dir)),
        &bench.model.config,
    );
    eprintln!("autotune --cpu: tuning for model {}", record.name);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let bar = ProgressBar::new(1);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>8} [{bar:30}] {pos}/{len} {elapsed} {msg}")
            .expect("a valid template"),
    );
    let mut progress = Bar(bar);
    let tuned = cpu_tune::tune(
        &bench,
        cores,
        o.kernel_budget,
        o.decode_budget,
        &mut progress,
    )?;
    progress.0.finish_and_clear();
    let cache = to_cache(&tuned, &bench, record, o)?;
    eprintln!("{}", summary(&tuned, cores));
    match &o.out {
        Some(out) => {
            std::fs::write(out, cache.to_json())
                .with_context(|| format!("writing {}", out.display()))?;
            eprintln!("wrote {}", out.display());
        }
        None => print!("{}", cache.to_json()),
    }
    Ok(cache)
}

/// What the run found, for the terminal.
pub fn summary(t: &Tuned, cores: usize) -> String {
    let mut s = format!(
        "autotune --cpu (measured, {} threads): {} tactics timed\n",
        cores, t.timed
    );
    for r in &t.kernels {
        let w = &r.figures[0];
        s.push_str(&format!(
            "  {} {}: {} ({:.1} us)\n",
            r.family,
            r.bucket,
            w.tactic,
            w.median * 1e6
        ));
    }
    if let Some(r) = &t.rejected {
        s.push_str(&format!(
            "  not confirmed against the default: {} ({:.1} us, spread {:.1})\n",
            r.tactic,
            r.median * 1e6,
            r.spread * 1e6
        ));
    }
    s.push_str(&format!(
        "  decode step: default {:.1} us (spread {:.1}), tuned {:.1} us (spread {:.1}) -> {}\n",
        t.default_step.median * 1e6,
        t.default_step.spread * 1e6,
        t.tuned_step.median * 1e6,
        t.tuned_step.spread * 1e6,
        if t.tactic == kernels::cpu_tactic::CpuTactic::DEFAULT {
            "the constants were already best".to_string()
        } else {
            format!("tuned: {}", t.tactic)
        }
    ));
    s
}

fn figure(f: &Figure) -> TacticFigure {
    TacticFigure {
        tactic: f.tactic.id(),
        median_us: f.median * 1e6,
        spread_us: f.spread * 1e6,
        n: f.n as u32,
        source: FigureSource::Measured,
    }
}

/// The cache's shape of a CPU workload shape.
pub fn problem_shape(shape: &Shape) -> ProblemShape {
    match *shape {
        Shape::Moe {
            tokens,
            hidden,
            inter,
            experts,
            top_k,
        } => {
            let active = (tokens * top_k).min(experts).max(1);
            ProblemShape::Moe {
                tokens_per_expert: (tokens * top_k).div_ceil(active) as u32,
                active_experts: active as u32,
                hidden: hidden as u32,
                inter: inter as u32,
            }
        }
        Shape::Dense { tokens, rows, cols } => ProblemShape::Dense {
            m: tokens as u32,
            n: rows as u32,
            k: cols as u32,
        },
        Shape::Mla {
            batch,
            context,
            heads,
            latent,
            rope,
        } => ProblemShape::mla(
            batch as u32,
            heads as u32,
            context as u32,
            false,
            MlaDims { latent, rope },
        ),
    }
}

/// The decode entries' shape: the model's MoE layer at one token.
pub fn decode_shape(config: &ModelConfig) -> ProblemShape {
    decode_entry_shape(
        config.hidden_size,
        config.moe_intermediate_size,
        config.n_routed_experts,
        config.num_experts_per_tok,
    )
}

fn entry(bucket: String, shape: ProblemShape, figures: &[Figure]) -> CacheEntry {
    CacheEntry {
        family: KernelFamily::Cpu,
        sm: CPU_TARGET.to_string(),
        bucket,
        shape,
        winner: figure(&figures[0]),
        runners_up: figures[1..].iter().map(figure).collect(),
    }
}

fn bucket_name(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The provenance of a CPU cache of `model` written now by `command`.
pub fn cpu_provenance(command: &str, model: TunedModel) -> Provenance {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ptx/manifest.json");
    Provenance {
        gpu_or_cpu_model: format!("{} ({})", bench::cpu_model(), Isa::detect()),
        sm: CPU_TARGET.to_string(),
        driver_version: NO_GPU.to_string(),
        cuda_version: NO_GPU.to_string(),
        commit: crate::tune::git_commit().unwrap_or_else(|| "unknown".into()),
        manifest_hash: kernels::files::read_bounded(&manifest, kernels::files::TEXT_FILE_LIMIT)
            .map_or_else(|_| "none".into(), |b| fnv1a64(&b)),
        kernel_source_hashes: BTreeMap::from([(
            CPU_SOURCES_KEY.to_string(),
            cpu_kernel_source_hash(),
        )]),
        command: command.to_string(),
        model: Some(model),
    }
}

/// The cache of a tuning run of the model `record` describes.
pub fn to_cache(
    t: &Tuned,
    bench: &DecodeBench,
    record: TunedModel,
    o: &CpuOptions,
) -> Result<TacticCache> {
    let config = &bench.model.config;
    let model = bucket_name(&bench.name);
    let mut entries = Vec::new();
    let shapes = cpu_tune::model_shapes(config, bench.context());
    for (r, shape) in t.kernels.iter().zip(&shapes) {
        let ps = problem_shape(shape);
        entries.push(entry(
            format!("{}_{}", bucket_name(&r.family), ps.bucket()),
            ps,
            &r.figures,
        ));
    }
    for Ranked {
        bucket, figures, ..
    } in &t.decode
    {
        entries.push(entry(
            format!("cpu_{}", bucket_name(bucket)),
            decode_shape(config),
            figures,
        ));
    }
    // The winner is the tactic to run; the runners-up what it was confirmed against.
    let mut verdict = vec![t.tuned_step];
    if t.tuned_step.tactic != t.default_step.tactic {
        verdict.push(t.default_step);
    }
    verdict.extend(t.rejected);
    entries.push(entry(
        format!("{DECODE_BUCKET_PREFIX}{model}"),
        decode_shape(config),
        &verdict,
    ));
    Ok(TacticCache {
        format: FORMAT,
        provenance: cpu_provenance(&o.command, record),
        entries,
    })
}

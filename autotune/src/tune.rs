//! The pipeline: enumerate → static → correct → timed (predicted without a device), per
//! family, into a tactic cache with complete provenance.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use kernels::allreduce::tactic::AllReduceTactic;
use kernels::arch::Sm;
use kernels::layers::LayersTactic;
use kernels::mla::MlaSplitTactic;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::tactic::cache::{
    CacheEntry, FORMAT, FigureSource, NO_GPU, Provenance, TacticCache, TacticFigure,
    built_source_hashes,
};
use kernels::tactic::{KernelFamily, ProblemShape, Tactic};
use model::config::ModelConfig;

use crate::correct::{self, Goldens};
use crate::cost::{self, Model, Predicted};
use crate::manifest::Manifest;
use crate::mutation::Perturbed;
use crate::shapes;

/// The GPU families the lab tunes (the CPU family is tuned by `autotune --cpu`).
pub const GPU_FAMILIES: [KernelFamily; 4] = [
    KernelFamily::MoeGemm,
    KernelFamily::MlaDecode,
    KernelFamily::AllReduce,
    KernelFamily::Layers,
];

pub struct Options {
    pub sm: Sm,
    pub tp: u32,
    pub model: ModelConfig,
    pub model_name: String,
    pub manifest: PathBuf,
    pub families: Vec<KernelFamily>,
    /// A tactic id whose launches the correct stage perturbs (the mutation test).
    pub perturb: Option<String>,
    /// Only tactics whose id contains this (tests keep the correct stage short).
    pub filter: Option<String>,
    pub progress: bool,
    pub command: String,
}

/// Tactics of one family left after each stage.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageCounts {
    pub enumerated: usize,
    pub static_ok: usize,
    pub correct_ok: usize,
    /// Shape buckets with a winner.
    pub buckets: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Pruned {
    pub family: KernelFamily,
    pub tactic: String,
    pub stage: &'static str,
    pub why: String,
}

pub struct Report {
    pub cache: TacticCache,
    pub counts: BTreeMap<KernelFamily, StageCounts>,
    pub pruned: Vec<Pruned>,
    /// One line per notable fact (stale manifest, gate outside the manifest, no device).
    pub notes: Vec<String>,
}

/// A tactic that survived the static stage, type-erased for the pipeline.
#[derive(Clone, Debug)]
enum Any {
    Moe(MoeGemmTactic),
    Mla(MlaSplitTactic),
    Ar(AllReduceTactic),
    Layers(LayersTactic),
}

impl Any {
    fn id(&self) -> String {
        match self {
            Any::Moe(t) => t.tactic_id(),
            Any::Mla(t) => t.tactic_id(),
            Any::Ar(t) => t.tactic_id(),
            Any::Layers(t) => t.tactic_id(),
        }
    }

    fn image_id(&self) -> String {
        match self {
            Any::Moe(t) => t.image_id(),
            Any::Mla(t) => t.image_id(),
            Any::Ar(t) => Tactic::image_id(t),
            Any::Layers(t) => t.image_id(),
        }
    }

    fn serves(&self, s: &ProblemShape) -> bool {
        match self {
            Any::Moe(t) => t.serves(s),
            Any::Mla(t) => t.serves(s),
            Any::Ar(t) => t.serves(s),
            Any::Layers(t) => t.serves(s),
        }
    }

    fn fits_on(&self, sm: Sm) -> Result<(), String> {
        let r = match self {
            Any::Moe(t) => t.validate_for(sm),
            Any::Mla(t) => t.validate_for(sm),
            Any::Ar(t) => t.validate_for(sm),
            Any::Layers(t) => t.validate_for(sm),
        };
        r.map_err(|e| e.to_string())
    }
}

fn space(family: KernelFamily, sm: Sm) -> Vec<Any> {
    match family {
        KernelFamily::MoeGemm => MoeGemmTactic::space(sm).into_iter().map(Any::Moe).collect(),
        KernelFamily::MlaDecode => MlaSplitTactic::space(sm)
            .into_iter()
            .map(Any::Mla)
            .collect(),
        KernelFamily::AllReduce => AllReduceTactic::space(sm)
            .into_iter()
            .map(Any::Ar)
            .collect(),
        KernelFamily::Layers => LayersTactic::space(sm)
            .into_iter()
            .map(Any::Layers)
            .collect(),
        KernelFamily::Cpu => Vec::new(),
    }
}

/// `git rev-parse HEAD` (with `-dirty` when the tree has changes), or `None` outside a checkout.
pub fn git_commit() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let mut commit = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if let Ok(st) = std::process::Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .output()
        && st.status.success()
        && !st.stdout.is_empty()
    {
        commit.push_str("-dirty");
    }
    (!commit.is_empty()).then_some(commit)
}

/// The static stage of one tactic: where the gate put it, and whether it passed.
fn static_check(t: &Any, family: KernelFamily, sm: Sm, manifest: &Manifest) -> Result<(), String> {
    t.fits_on(sm)?;
    if family == KernelFamily::Layers {
        // The layers family is gated by compile-gates.sh outside the manifest.
        return Ok(());
    }
    let image = manifest
        .image(family, sm, &t.image_id())
        .ok_or_else(|| format!("no {} image {} in ptx/manifest.json", sm, t.image_id()))?;
    if !image.ok {
        return Err("the compile gate failed it".into());
    }
    if image.spills() {
        return Err("spills registers".into());
    }
    if image.max_smem() > sm.smem_optin_per_block() {
        return Err(format!(
            "{} B of shared memory > {} B",
            image.max_smem(),
            sm.smem_optin_per_block()
        ));
    }
    Ok(())
}

fn correct_check(
    t: &Any,
    sm: Sm,
    goldens: &Goldens,
    perturb: Option<&str>,
) -> Result<String, String> {
    let dev = correct::host_device(sm);
    match (t, perturb) {
        (Any::Moe(m), Some(p)) if p == m.id() => correct::moe(
            &Perturbed {
                inner: &dev,
                tactic: p.to_string(),
            },
            *m,
            goldens,
        ),
        (Any::Mla(m), Some(p)) if p == m.id() => correct::mla(
            &Perturbed {
                inner: &dev,
                tactic: p.to_string(),
            },
            *m,
            goldens,
        ),
        (Any::Moe(m), _) => correct::moe(&dev, *m, goldens),
        (Any::Mla(m), _) => correct::mla(&dev, *m, goldens),
        (Any::Ar(a), _) => correct::allreduce(a),
        (Any::Layers(_), _) => correct::layers(&dev),
    }
}

/// The timed stage without a device: the cost model, the manifest's resources, the
/// all-reduce host.
struct Predictor<'a> {
    sm: Sm,
    model: Model<'a>,
    manifest: &'a Manifest,
    experts: u32,
    top_k: u32,
    ar_host: kernels::allreduce::cost::Host,
}

impl Predictor<'_> {
    fn predict(&self, t: &Any, family: KernelFamily, shape: &ProblemShape) -> Option<Predicted> {
        let image = self.manifest.image(family, self.sm, &t.image_id());
        match t {
            Any::Moe(m) => {
                let bounds = cost::moe_grid_bounds(shape, self.experts, self.top_k)?;
                self.model.moe(m, image, shape, &bounds)
            }
            Any::Mla(m) => self.model.mla(m, image, shape),
            Any::Ar(a) => cost::allreduce(&self.ar_host, a, shape),
            Any::Layers(_) => self.model.dense(shape),
        }
    }
}

pub fn run(opts: &Options) -> Result<Report> {
    let sm = opts.sm;
    let manifest = Manifest::load(&opts.manifest)?;
    let current = built_source_hashes();
    let gpu = sm.reference_gpu();
    let predictor = Predictor {
        sm,
        model: Model::new(gpu),
        manifest: &manifest,
        experts: opts.model.n_routed_experts as u32,
        top_k: opts.model.num_experts_per_tok as u32,
        ar_host: cost::allreduce_host(opts.tp),
    };
    let mut notes = vec![format!(
        "no {} here: correct = host execution layer, timed = predicted by the cost model",
        gpu.name
    )];
    let goldens = Goldens::load().map_err(anyhow::Error::msg)?;
    let mut counts = BTreeMap::new();
    let mut pruned = Vec::new();
    let mut entries = Vec::new();
    for &family in &opts.families {
        let mut c = StageCounts::default();
        let all: Vec<Any> = space(family, sm)
            .into_iter()
            .filter(|t| opts.filter.as_deref().is_none_or(|f| t.id().contains(f)))
            .collect();
        c.enumerated = all.len();
        // (a) static.
        let stale = (family != KernelFamily::Layers)
            .then(|| manifest.stale(family, &current))
            .flatten();
        if family == KernelFamily::Layers {
            notes.push(
                "layers: one image, gated by compile-gates.sh outside ptx/manifest.json".into(),
            );
        }
        let mut passed_static = Vec::new();
        for t in all {
            let r = match &stale {
                Some(why) => Err(why.clone()),
                None => static_check(&t, family, sm, &manifest),
            };
            match r {
                Ok(()) => passed_static.push(t),
                Err(why) => pruned.push(Pruned {
                    family,
                    tactic: t.id(),
                    stage: "static",
                    why,
                }),
            }
        }
        if let Some(why) = &stale {
            notes.push(format!("{family}: {why}"));
        }
        c.static_ok = passed_static.len();
        // (b) correct.
        let bar = if opts.progress {
            let b = ProgressBar::new(passed_static.len() as u64);
            b.set_style(
                ProgressStyle::with_template("{prefix:>10} correct [{bar:30}] {pos}/{len} {msg}")
                    .expect("template")
                    .progress_chars("=> "),
            );
            b.set_prefix(family.id());
            b
        } else {
            ProgressBar::hidden()
        };
        let mut passed_correct = Vec::new();
        for t in passed_static {
            bar.set_message(t.id());
            match correct_check(&t, sm, &goldens, opts.perturb.as_deref()) {
                Ok(_) => passed_correct.push(t),
                Err(why) => pruned.push(Pruned {
                    family,
                    tactic: t.id(),
                    stage: "correct",
                    why: why.lines().next().unwrap_or("").chars().take(300).collect(),
                }),
            }
            bar.inc(1);
        }
        bar.finish_and_clear();
        c.correct_ok = passed_correct.len();
        // (c) timed: predicted.
        for shape in shapes::shapes(&opts.model, opts.tp, family) {
            let mut figs: Vec<(f64, String)> = passed_correct
                .iter()
                .filter(|t| t.serves(&shape))
                .filter_map(|t| predictor.predict(t, family, &shape).map(|p| (p.us, t.id())))
                .collect();
            figs.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let mut figs = figs.into_iter().map(|(us, tactic)| TacticFigure {
                tactic,
                median_us: us,
                spread_us: 0.0,
                n: 1,
                source: FigureSource::Predicted,
            });
            let Some(winner) = figs.next() else { continue };
            entries.push(CacheEntry {
                family,
                sm: sm.arch().to_string(),
                bucket: shape.bucket(),
                shape,
                winner,
                runners_up: figs.take(3).collect(),
            });
            c.buckets += 1;
        }
        counts.insert(family, c);
    }
    let commit = git_commit().unwrap_or_else(|| {
        notes.push("warning: no git commit available; provenance commit is `unknown`".into());
        "unknown".to_string()
    });
    let cache = TacticCache {
        format: FORMAT,
        provenance: Provenance {
            gpu_or_cpu_model: format!("{} (cost model; no device present)", gpu.name),
            sm: sm.arch().to_string(),
            driver_version: NO_GPU.to_string(),
            cuda_version: NO_GPU.to_string(),
            commit,
            manifest_hash: manifest.hash.clone(),
            kernel_source_hashes: current,
            command: opts.command.clone(),
        },
        entries,
    };
    Ok(Report {
        cache,
        counts,
        pruned,
        notes,
    })
}

impl Report {
    /// The per-stage count table.
    pub fn table(&self, sm: Sm) -> String {
        let mut s = format!(
            "{:<10} {:<8} {:>10} {:>7} {:>8} {:>18}\n",
            "family", "sm", "enumerated", "static", "correct", "buckets (predicted)"
        );
        for (f, c) in &self.counts {
            let _ = writeln!(
                s,
                "{:<10} {:<8} {:>10} {:>7} {:>8} {:>18}",
                f.id(),
                sm.arch(),
                c.enumerated,
                c.static_ok,
                c.correct_ok,
                c.buckets
            );
        }
        s
    }
}

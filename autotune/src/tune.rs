//! The pipeline: enumerate → static → correct → timed (on the device when one of the SM is
//! present, else predicted), per family, into a tactic cache with complete provenance.
//!
//! Every stage is written once, generic over the families' [`Tactic`] trait (plus
//! [`LabTactic`]: how the lab checks and predicts a family), and generic over the device the
//! correct stage runs on: the host execution layer without a GPU, the GPU itself with one.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use bench::gpu_timing::{MoeSetup, Timer, TimingOptions};
use indicatif::{ProgressBar, ProgressStyle};
use kernels::allreduce::cost::{Host, LinkParams};
use kernels::allreduce::tactic::AllReduceTactic;
use kernels::arch::Sm;
use kernels::device::Device;
use kernels::layers::LayersTactic;
use kernels::mla::MlaSplitTactic;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::tactic::cache::{
    CacheEntry, FORMAT, NO_GPU, Provenance, TacticCache, TacticFigure, built_source_hashes,
};
use kernels::tactic::timing::{DeviceIdentity, Samples};
use kernels::tactic::{KernelFamily, ProblemShape, Tactic};
use kernels::timed_device::{TimedDevice, WithTimedDevice, with_timed_device};
use model::arch::config::ModelConfig;

use crate::correct::{self, Goldens};
use crate::cost::{self, CostParams, Model, Predicted};
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

/// How the timed stage gets its figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    /// Measured on the device when one of the SM is present, else predicted.
    Auto,
    /// Measured on the device; refused when there is none of the SM.
    Measure,
    /// Predicted by the cost model even with a device present.
    Predict,
}

impl Timing {
    pub fn parse(s: &str) -> Option<Timing> {
        match s {
            "auto" => Some(Timing::Auto),
            "measure" => Some(Timing::Measure),
            "predict" => Some(Timing::Predict),
            _ => None,
        }
    }
}

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
    pub timing: Timing,
    /// The GPU to measure on, and where its kernel images are.
    pub device: usize,
    pub ptx_dir: PathBuf,
    /// Buckets not started within this time since the timed stage began are predicted.
    pub time_budget: Duration,
    pub timing_options: TimingOptions,
}

/// Tactics of one family left after each stage.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageCounts {
    pub enumerated: usize,
    pub static_ok: usize,
    pub correct_ok: usize,
    /// Tactics timed on the device at least once (0 without one).
    pub timed: usize,
    /// Shape buckets with a winner: measured, predicted.
    pub measured_buckets: usize,
    pub predicted_buckets: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Pruned {
    pub family: KernelFamily,
    pub tactic: String,
    pub stage: &'static str,
    pub why: String,
}

/// One (family, tactic, shape) timed on the device, with the cost model's prediction for it.
#[derive(Clone, Debug)]
pub struct MeasuredPoint {
    pub family: KernelFamily,
    pub tactic: String,
    pub shape: ProblemShape,
    pub samples: Samples,
    /// The prediction with the model's assumed parameters (`None`: it predicts no figure).
    pub predicted_us: Option<f64>,
}

pub struct Report {
    pub cache: TacticCache,
    pub counts: BTreeMap<KernelFamily, StageCounts>,
    pub pruned: Vec<Pruned>,
    /// One line per notable fact (stale manifest, gate outside the manifest, no device).
    pub notes: Vec<String>,
    /// The device that measured, if one did.
    pub device: Option<DeviceIdentity>,
    /// Every point timed on the device.
    pub measured: Vec<MeasuredPoint>,
}

/// The timed stage without a device, and the reference every measurement is compared with:
/// the cost model on the SM's reference GPU, the manifest's resources, the all-reduce host.
pub struct Predictor<'a> {
    pub sm: Sm,
    pub model: Model<'a>,
    pub manifest: &'a Manifest,
    pub experts: u32,
    pub top_k: u32,
    pub ar_host: Host,
    pub ar_params: LinkParams,
}

impl<'a> Predictor<'a> {
    pub fn new(sm: Sm, cfg: &ModelConfig, tp: u32, manifest: &'a Manifest) -> Self {
        Predictor {
            sm,
            model: Model::new(sm.reference_gpu()),
            manifest,
            experts: cfg.n_routed_experts as u32,
            top_k: cfg.num_experts_per_tok as u32,
            ar_host: cost::allreduce_host(tp),
            ar_params: LinkParams::default(),
        }
    }

    /// The same predictor with other cost-model parameters.
    pub fn with_params(&self, params: CostParams) -> Predictor<'a> {
        Predictor {
            sm: self.sm,
            model: Model::with_params(self.model.gpu, params),
            manifest: self.manifest,
            experts: self.experts,
            top_k: self.top_k,
            ar_host: self.ar_host.clone(),
            ar_params: self.ar_params.clone(),
        }
    }

    /// The prediction for the tactic `id` of `family` on `shape`.
    pub fn predict_id(
        &self,
        family: KernelFamily,
        id: &str,
        shape: &ProblemShape,
    ) -> Option<Predicted> {
        fn go<T: LabTactic>(p: &Predictor<'_>, id: &str, s: &ProblemShape) -> Option<Predicted> {
            T::parse_id(id).ok()?.predict(p, s)
        }
        match family {
            KernelFamily::MoeGemm => go::<MoeGemmTactic>(self, id, shape),
            KernelFamily::MlaDecode => go::<MlaSplitTactic>(self, id, shape),
            KernelFamily::AllReduce => go::<AllReduceTactic>(self, id, shape),
            KernelFamily::Layers => go::<LayersTactic>(self, id, shape),
            KernelFamily::Cpu => None,
        }
    }
}

/// What the lab does with a family beyond the shared [`Tactic`] trait: check a tactic against
/// the goldens on a device, and predict its time.
pub trait LabTactic: Tactic + Copy {
    /// Whether a measurement on the one device present is the figure the cache wants. Not so
    /// for the all-reduce: its ranks on one GPU time the kernels, not a PCIe host's links
    /// (those measurements refit the link model instead, see `crate::fit`).
    const CACHE_MEASURED: bool = true;
    /// Whether the compile gate's manifest lists the family's images.
    const IN_MANIFEST: bool = true;

    /// The goldens on `dev` (the GPU, or the host execution layer emulating it).
    fn correct<D: Device>(&self, dev: &D, goldens: &Goldens) -> Result<String, String>;
    fn predict(&self, p: &Predictor<'_>, shape: &ProblemShape) -> Option<Predicted>;
}

impl LabTactic for MoeGemmTactic {
    fn correct<D: Device>(&self, dev: &D, goldens: &Goldens) -> Result<String, String> {
        correct::moe(dev, *self, goldens)
    }

    fn predict(&self, p: &Predictor<'_>, shape: &ProblemShape) -> Option<Predicted> {
        let image = p.manifest.image(Self::FAMILY, p.sm, &self.image_id());
        let bounds = cost::moe_grid_bounds(shape, p.experts, p.top_k)?;
        p.model.moe(self, image, shape, &bounds)
    }
}

impl LabTactic for MlaSplitTactic {
    fn correct<D: Device>(&self, dev: &D, goldens: &Goldens) -> Result<String, String> {
        correct::mla(dev, *self, goldens)
    }

    fn predict(&self, p: &Predictor<'_>, shape: &ProblemShape) -> Option<Predicted> {
        let image = p.manifest.image(Self::FAMILY, p.sm, &self.image_id());
        p.model.mla(self, image, shape)
    }
}

impl LabTactic for AllReduceTactic {
    const CACHE_MEASURED: bool = false;

    /// Bit for bit through the host execution layer (`allreduce-gpu-check` checks the device's
    /// ranks bit for bit in the same GPU run).
    fn correct<D: Device>(&self, _dev: &D, _goldens: &Goldens) -> Result<String, String> {
        correct::allreduce(self)
    }

    fn predict(&self, p: &Predictor<'_>, shape: &ProblemShape) -> Option<Predicted> {
        cost::allreduce(&p.ar_host, &p.ar_params, self, shape)
    }
}

impl LabTactic for LayersTactic {
    const IN_MANIFEST: bool = false;

    fn correct<D: Device>(&self, dev: &D, _goldens: &Goldens) -> Result<String, String> {
        correct::layers(dev)
    }

    fn predict(&self, p: &Predictor<'_>, shape: &ProblemShape) -> Option<Predicted> {
        p.model.dense(shape)
    }
}

/// The timed stage's access to a device: times the tactic `id` of `family` on `shape`.
pub trait Measure {
    fn time(
        &mut self,
        family: KernelFamily,
        id: &str,
        shape: &ProblemShape,
    ) -> kernels::device::Result<Samples>;
}

impl<D: TimedDevice> Measure for Timer<'_, D> {
    fn time(
        &mut self,
        family: KernelFamily,
        id: &str,
        shape: &ProblemShape,
    ) -> kernels::device::Result<Samples> {
        self.time_id(family, id, shape)
    }
}

/// `git rev-parse HEAD` (with `-dirty` when the tree has changes); outside a checkout the
/// `KIMI_COMMIT` the GPU bundle carries; else `None`.
pub fn git_commit() -> Option<String> {
    let from_git = || {
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
    };
    from_git().or_else(|| {
        std::env::var("KIMI_COMMIT")
            .ok()
            .map(|c| c.trim().to_string())
            .filter(|c| !c.is_empty())
    })
}

/// The static stage of one tactic: where the gate put it, and whether it passed.
fn static_check<T: LabTactic>(t: &T, sm: Sm, manifest: &Manifest) -> Result<(), String> {
    t.validate_for(sm).map_err(|e| e.to_string())?;
    if !T::IN_MANIFEST {
        return Ok(());
    }
    let image = manifest
        .image(T::FAMILY, sm, &t.image_id())
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

/// The correct stage of one tactic on `dev`; the perturbed tactic's kernels run one block short.
fn correct_check<T: LabTactic, D: Device>(
    t: &T,
    dev: &D,
    goldens: &Goldens,
    perturb: Option<&str>,
) -> Result<String, String> {
    match perturb {
        Some(p) if p == t.tactic_id() => t.correct(
            &Perturbed {
                inner: dev,
                tactic: t.image_id(),
            },
            goldens,
        ),
        _ => t.correct(dev, goldens),
    }
}

/// What every family's run shares.
struct Lab<'a, 'm> {
    opts: &'a Options,
    manifest: &'a Manifest,
    current: &'a BTreeMap<String, String>,
    goldens: &'a Goldens,
    predictor: &'a Predictor<'a>,
    measure: Option<&'m mut dyn Measure>,
    /// When the timed stage began (the first bucket timed on the device).
    timed_since: Option<Instant>,
    notes: Vec<String>,
    pruned: Vec<Pruned>,
    entries: Vec<CacheEntry>,
    measured: Vec<MeasuredPoint>,
}

impl Lab<'_, '_> {
    fn within_budget(&mut self) -> bool {
        let since = *self.timed_since.get_or_insert_with(Instant::now);
        since.elapsed() <= self.opts.time_budget
    }

    fn family<T: LabTactic, D: Device>(&mut self, dev: &D) -> StageCounts {
        let opts = self.opts;
        let sm = opts.sm;
        let family = T::FAMILY;
        let mut c = StageCounts::default();
        let all: Vec<T> = T::space(sm)
            .into_iter()
            .filter(|t| {
                opts.filter
                    .as_deref()
                    .is_none_or(|f| t.tactic_id().contains(f))
            })
            .collect();
        c.enumerated = all.len();
        // (a) static.
        let stale = T::IN_MANIFEST
            .then(|| self.manifest.stale(family, self.current))
            .flatten();
        if !T::IN_MANIFEST {
            self.notes.push(format!(
                "{family}: one image, gated by compile-gates.sh outside ptx/manifest.json"
            ));
        }
        let mut passed_static = Vec::new();
        for t in all {
            let r = match &stale {
                Some(why) => Err(why.clone()),
                None => static_check(&t, sm, self.manifest),
            };
            match r {
                Ok(()) => passed_static.push(t),
                Err(why) => self.pruned.push(Pruned {
                    family,
                    tactic: t.tactic_id(),
                    stage: "static",
                    why,
                }),
            }
        }
        if let Some(why) = &stale {
            self.notes.push(format!("{family}: {why}"));
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
            bar.set_message(t.tactic_id());
            match correct_check(&t, dev, self.goldens, opts.perturb.as_deref()) {
                Ok(_) => passed_correct.push(t),
                Err(why) => self.pruned.push(Pruned {
                    family,
                    tactic: t.tactic_id(),
                    stage: "correct",
                    why: why.lines().next().unwrap_or("").chars().take(300).collect(),
                }),
            }
            bar.inc(1);
        }
        bar.finish_and_clear();
        c.correct_ok = passed_correct.len();
        // (c) timed: on the device within the budget, else predicted.
        let mut timed_ok: std::collections::BTreeSet<String> = Default::default();
        let mut over_budget = 0;
        for shape in shapes::shapes(&opts.model, opts.tp, family) {
            let serving: Vec<&T> = passed_correct.iter().filter(|t| t.serves(&shape)).collect();
            let predicted: Vec<(String, Option<Predicted>)> = serving
                .iter()
                .map(|t| (t.tactic_id(), t.predict(self.predictor, &shape)))
                .collect();
            let mut measured_figs = Vec::new();
            if self.measure.is_some() {
                if self.within_budget() {
                    for (id, pred) in &predicted {
                        let measure = self.measure.as_deref_mut().expect("checked above");
                        match measure.time(family, id, &shape) {
                            Ok(samples) => {
                                timed_ok.insert(id.clone());
                                measured_figs.push(TacticFigure::measured(id.clone(), &samples));
                                self.measured.push(MeasuredPoint {
                                    family,
                                    tactic: id.clone(),
                                    shape: shape.clone(),
                                    samples,
                                    predicted_us: pred.as_ref().map(|p| p.us),
                                });
                            }
                            Err(e) => self.pruned.push(Pruned {
                                family,
                                tactic: id.clone(),
                                stage: "timed",
                                why: format!("{}: {e}", shape.bucket()),
                            }),
                        }
                    }
                } else {
                    over_budget += 1;
                }
            }
            let mut figs: Vec<TacticFigure> = if T::CACHE_MEASURED && !measured_figs.is_empty() {
                measured_figs
            } else {
                predicted
                    .into_iter()
                    .filter_map(|(id, p)| p.map(|p| TacticFigure::predicted(id, p.us)))
                    .collect()
            };
            figs.sort_by(|a, b| {
                a.median_us
                    .total_cmp(&b.median_us)
                    .then(a.tactic.cmp(&b.tactic))
            });
            let mut figs = figs.into_iter();
            let Some(winner) = figs.next() else { continue };
            match winner.source {
                kernels::tactic::cache::FigureSource::Measured => c.measured_buckets += 1,
                kernels::tactic::cache::FigureSource::Predicted => c.predicted_buckets += 1,
            }
            self.entries.push(CacheEntry {
                family,
                sm: sm.arch().to_string(),
                bucket: shape.bucket(),
                shape,
                winner,
                runners_up: figs.take(3).collect(),
            });
        }
        c.timed = timed_ok.len();
        if over_budget > 0 {
            self.notes.push(format!(
                "{family}: {over_budget} shape buckets not timed (past the {} s time budget): \
                 predicted",
                opts.time_budget.as_secs()
            ));
        }
        if self.measure.is_some() && !T::CACHE_MEASURED {
            self.notes.push(format!(
                "{family}: timed as {} ranks on this one GPU (its memory, not PCIe): the \
                 measurements refit the link model; the cache keeps the PCIe host's predictions",
                opts.tp
            ));
        }
        c
    }
}

/// Runs the pipeline with the correct stage on `dev` and, when `measure` is given, the timed
/// stage on the device it measures.
fn pipeline<D: Device>(
    opts: &Options,
    dev: &D,
    measure: Option<&mut dyn Measure>,
    identity: Option<DeviceIdentity>,
    mut notes: Vec<String>,
) -> Result<Report> {
    let sm = opts.sm;
    let manifest = Manifest::load(&opts.manifest)?;
    let current = built_source_hashes();
    let gpu = sm.reference_gpu();
    let predictor = Predictor::new(sm, &opts.model, opts.tp, &manifest);
    let goldens = Goldens::load().map_err(anyhow::Error::msg)?;
    let mut lab = Lab {
        opts,
        manifest: &manifest,
        current: &current,
        goldens: &goldens,
        predictor: &predictor,
        measure,
        timed_since: None,
        notes: Vec::new(),
        pruned: Vec::new(),
        entries: Vec::new(),
        measured: Vec::new(),
    };
    let mut counts = BTreeMap::new();
    for &family in &opts.families {
        let c = match family {
            KernelFamily::MoeGemm => lab.family::<MoeGemmTactic, D>(dev),
            KernelFamily::MlaDecode => lab.family::<MlaSplitTactic, D>(dev),
            KernelFamily::AllReduce => lab.family::<AllReduceTactic, D>(dev),
            KernelFamily::Layers => lab.family::<LayersTactic, D>(dev),
            KernelFamily::Cpu => bail!("the CPU family is tuned by autotune --cpu"),
        };
        counts.insert(family, c);
    }
    notes.append(&mut lab.notes);
    let commit = git_commit().unwrap_or_else(|| {
        notes.push("warning: no git commit available; provenance commit is `unknown`".into());
        "unknown".to_string()
    });
    let (model_name, driver, cuda) = match &identity {
        Some(d) => {
            if d.name != gpu.name {
                notes.push(format!(
                    "the cost model's figures are the {}'s (kernels::arch); measured on {}",
                    gpu.name, d.name
                ));
            }
            (
                format!("{} (measured)", d.name),
                d.driver_version.clone(),
                d.cuda_version.clone(),
            )
        }
        None => (
            format!("{} (cost model; no device present)", gpu.name),
            NO_GPU.to_string(),
            NO_GPU.to_string(),
        ),
    };
    let cache = TacticCache {
        format: FORMAT,
        provenance: Provenance {
            gpu_or_cpu_model: model_name,
            sm: sm.arch().to_string(),
            driver_version: driver,
            cuda_version: cuda,
            commit,
            manifest_hash: manifest.hash.clone(),
            kernel_source_hashes: current.clone(),
            command: opts.command.clone(),
            model: Some(model::exec::tactics::tuned_model(
                &opts.model_name,
                &opts.model,
            )),
        },
        entries: lab.entries,
    };
    Ok(Report {
        cache,
        counts,
        pruned: lab.pruned,
        notes,
        device: identity,
        measured: lab.measured,
    })
}

/// The pipeline on the GPU handed over by [`with_timed_device`].
struct OnDevice<'a> {
    opts: &'a Options,
}

impl WithTimedDevice for OnDevice<'_> {
    type Output = Result<Report>;

    fn run<D: TimedDevice>(self, dev: &D) -> Result<Report> {
        let opts = self.opts;
        let identity = dev.identity();
        let mut timer = Timer::new(
            dev,
            opts.timing_options,
            MoeSetup {
                experts: opts.model.n_routed_experts,
                top_k: opts.model.num_experts_per_tok,
            },
        )
        .map_err(|e| anyhow::anyhow!("setting up the timed stage on {}: {e}", identity.name))?;
        let notes = vec![format!(
            "{} ({}, driver {}, CUDA {}): correct = on the device, timed = measured (CUDA \
             events, {} warm-up + {} runs, L2 flushed before each)",
            identity.name,
            identity.sm,
            identity.driver_version,
            identity.cuda_version,
            opts.timing_options.warmup,
            opts.timing_options.reps
        )];
        run_measured(opts, dev, &mut timer, identity, notes)
    }
}

/// The pipeline with the correct stage on `dev` and the timed stage through `measure` (the
/// device `identity` describes): what a GPU run does, open to any [`Measure`].
pub fn run_measured<D: Device>(
    opts: &Options,
    dev: &D,
    measure: &mut dyn Measure,
    identity: DeviceIdentity,
    notes: Vec<String>,
) -> Result<Report> {
    pipeline(opts, dev, Some(measure), Some(identity), notes)
}

/// The pipeline: on the device when [`Options::timing`] asks for it and one of the SM is
/// present, else with the correct stage on the host execution layer and predicted times.
/// `Timing::Measure` without such a device is an error saying why.
pub fn run(opts: &Options) -> Result<Report> {
    let gpu = opts.sm.reference_gpu();
    let host = || correct::host_device(opts.sm);
    let predicted_note = |why: String| {
        vec![format!(
            "{why}: correct = host execution layer, timed = predicted by the cost model \
             (the {}'s figures)",
            gpu.name
        )]
    };
    if opts.timing == Timing::Predict {
        return pipeline(
            opts,
            &host(),
            None,
            None,
            predicted_note("--timing predict".into()),
        );
    }
    match with_timed_device(opts.device, &opts.ptx_dir, Some(opts.sm), OnDevice { opts }) {
        Ok(report) => report,
        Err(why) if opts.timing == Timing::Measure => {
            bail!("--timing measure: nothing can be measured: {why}")
        }
        Err(why) => pipeline(
            opts,
            &host(),
            None,
            None,
            predicted_note(format!("no {} to measure on ({why})", opts.sm)),
        ),
    }
}

impl Report {
    /// The per-stage count table.
    pub fn table(&self, sm: Sm) -> String {
        let mut s = format!(
            "{:<10} {:<8} {:>10} {:>7} {:>8} {:>6} {:>17} {:>18}\n",
            "family",
            "sm",
            "enumerated",
            "static",
            "correct",
            "timed",
            "buckets measured",
            "buckets predicted"
        );
        for (f, c) in &self.counts {
            let _ = writeln!(
                s,
                "{:<10} {:<8} {:>10} {:>7} {:>8} {:>6} {:>17} {:>18}",
                f.id(),
                sm.arch(),
                c.enumerated,
                c.static_ok,
                c.correct_ok,
                c.timed,
                c.measured_buckets,
                c.predicted_buckets
            );
        }
        s
    }
}

//! Criterion sweeps of the CUDA tactics on a GPU: per family (MoE grouped GEMM, MLA decode,
//! the all-reduce as ranks of one GPU, the layers' dense products), every tactic the gate built
//! for the device's SM × Kimi-K2.5's TP8 decode shapes at a few batches, each iteration timed on
//! the device (CUDA events around the launches, the L2 flushed before each: `bench::gpu_timing`).
//! Writes per family an SVG chart (µs against shape, one line per tactic, the winner per shape
//! marked) and one table:
//!
//! ```sh
//! cargo bench -p bench --features cuda --bench gpu_tactics     # bench/results/gpu-tactics-*
//! cargo bench -p bench --features cuda --bench gpu_tactics -- --quick   # no files
//! ```
//!
//! Without the `cuda` feature, a driver or a device of a built SM it prints why and runs
//! nothing. `KIMI_PTX_DIR` names the kernel images (default `ptx/`), `KIMI_SWEEP_OUT` the results
//! folder, `KIMI_SWEEP_MEASURE_MS` criterion's measurement time per point (default 100 ms, after
//! 50 ms of warm-up; 10 samples).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use bench::gpu_timing::{MoeSetup, Timer, TimingOptions};
use bench::sweep::{Point, SweepChart, read_point};
use criterion::{BenchmarkId, Criterion, SamplingMode};
use kernels::allreduce::tactic::AllReduceTactic;
use kernels::arch::Sm;
use kernels::layers::LayersTactic;
use kernels::mla::MlaSplitTactic;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::tactic::{KernelFamily, ProblemShape, Tactic};
use kernels::timed_device::{TimedDevice, WithTimedDevice, with_timed_device};
use model::arch::presets::Preset;
use model::exec::tactics::shapes;

/// Decode batches the sweeps cover (the lab's `autotune` covers all of `model::exec::tactics`).
const SWEEP_BATCHES: [u32; 3] = [1, 8, 64];
/// MLA: one context length.
const SWEEP_CONTEXT: u32 = 8192;

/// One family's sweep: its shapes, and per tactic the ids that serve them.
struct FamilySweep {
    family: KernelFamily,
    shapes: Vec<ProblemShape>,
    tactics: Vec<String>,
    default: Vec<Option<String>>,
}

fn sweeps(sm: Sm) -> Vec<FamilySweep> {
    let cfg = Preset::KimiK25.model_config();
    let batch_of = |s: &ProblemShape| -> Option<u32> {
        match s {
            ProblemShape::Mla { batch, context, .. } => {
                (*context == SWEEP_CONTEXT).then_some(*batch)
            }
            ProblemShape::AllReduce { elements, .. } => {
                Some((*elements / cfg.hidden_size as u64) as u32)
            }
            ProblemShape::Dense { m, .. } => Some(*m),
            ProblemShape::Moe { .. } => None,
        }
    };
    let pick = |family: KernelFamily| -> Vec<ProblemShape> {
        let all = shapes(&cfg, 8, family);
        if family == KernelFamily::MoeGemm {
            // One MoE shape per batch of model::exec::tactics::BATCHES, in order.
            return model::exec::tactics::BATCHES
                .iter()
                .zip(all)
                .filter(|(b, _)| SWEEP_BATCHES.contains(b))
                .map(|(_, s)| s)
                .collect();
        }
        let mut out: Vec<ProblemShape> = all
            .into_iter()
            .filter(|s| batch_of(s).is_some_and(|b| SWEEP_BATCHES.contains(&b)))
            .collect();
        if family == KernelFamily::Layers {
            // The products of one batch size is plenty for a chart: the decode one and 64.
            out.retain(|s| matches!(s, ProblemShape::Dense { m: 1 | 64, .. }));
        }
        out
    };
    fn family<T: Tactic>(sm: Sm, shapes: Vec<ProblemShape>) -> FamilySweep {
        let tactics: Vec<T> = T::space(sm).into_iter().filter(|t| t.fits_on(sm)).collect();
        FamilySweep {
            family: T::FAMILY,
            default: shapes
                .iter()
                .map(|s| T::heuristic_default(sm, s).map(|t| t.tactic_id()))
                .collect(),
            tactics: tactics.iter().map(Tactic::tactic_id).collect(),
            shapes,
        }
    }
    let mut ar = family::<AllReduceTactic>(sm, pick(KernelFamily::AllReduce));
    // The 512-thread images: the block count and algorithm are what the sweep shows.
    ar.tactics.retain(|id| id.contains("_bf16_t512"));
    vec![
        family::<MoeGemmTactic>(sm, pick(KernelFamily::MoeGemm)),
        family::<MlaSplitTactic>(sm, pick(KernelFamily::MlaDecode)),
        ar,
        family::<LayersTactic>(sm, pick(KernelFamily::Layers)),
    ]
}

fn serves(family: KernelFamily, id: &str, shape: &ProblemShape) -> bool {
    fn go<T: Tactic>(id: &str, s: &ProblemShape) -> bool {
        T::parse_id(id).is_ok_and(|t| t.serves(s))
    }
    match family {
        KernelFamily::MoeGemm => go::<MoeGemmTactic>(id, shape),
        KernelFamily::MlaDecode => go::<MlaSplitTactic>(id, shape),
        KernelFamily::AllReduce => go::<AllReduceTactic>(id, shape),
        KernelFamily::Layers => go::<LayersTactic>(id, shape),
        KernelFamily::Cpu => false,
    }
}

struct Sweeps {
    quick: bool,
    out_dir: PathBuf,
    results: PathBuf,
}

impl WithTimedDevice for Sweeps {
    type Output = Result<()>;

    fn run<D: TimedDevice>(self, dev: &D) -> Result<()> {
        let identity = dev.identity();
        let sm = identity.sm;
        let cfg = Preset::KimiK25.model_config();
        let mut timer = Timer::new(
            dev,
            TimingOptions::default(),
            MoeSetup {
                experts: cfg.n_routed_experts,
                top_k: cfg.num_experts_per_tok,
            },
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        let measure_ms = std::env::var("KIMI_SWEEP_MEASURE_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(100u64);
        let mut c = Criterion::default()
            .output_directory(&self.out_dir)
            .sample_size(10)
            .warm_up_time(Duration::from_millis(50))
            .measurement_time(Duration::from_millis(measure_ms))
            .without_plots()
            .configure_from_args();
        let plan = sweeps(sm);
        let mut failures: BTreeMap<(usize, usize, usize), String> = BTreeMap::new();
        for (fi, f) in plan.iter().enumerate() {
            let mut group = c.benchmark_group(format!("gpu-{}", f.family.id()));
            group.sampling_mode(SamplingMode::Flat);
            for (si, shape) in f.shapes.iter().enumerate() {
                for (ti, id) in f.tactics.iter().enumerate() {
                    if !serves(f.family, id, shape) {
                        continue;
                    }
                    group.bench_function(
                        BenchmarkId::new(format!("tactic{ti:03}"), shape.bucket()),
                        |b| {
                            b.iter_custom(|iters| {
                                // `iters` runs, each between its own device timestamps: their
                                // sum is the time criterion divides by `iters`.
                                let iters = iters.max(1) as usize;
                                let (reps, calls) = if f.family == KernelFamily::AllReduce {
                                    (1, iters)
                                } else {
                                    (iters, 1)
                                };
                                timer.options = TimingOptions {
                                    warmup: 0,
                                    reps,
                                    allreduce_calls: calls,
                                    ..TimingOptions::default()
                                };
                                match timer.time_id(f.family, id, shape) {
                                    Ok(s) => {
                                        let per_run: f64 = s.us.iter().sum::<f64>() / reps as f64;
                                        Duration::from_secs_f64(per_run * 1e-6 * iters as f64)
                                    }
                                    Err(e) => {
                                        failures.insert((fi, si, ti), e.to_string());
                                        Duration::from_nanos(1)
                                    }
                                }
                            })
                        },
                    );
                }
            }
            group.finish();
        }
        c.final_summary();
        if self.quick {
            return Ok(());
        }
        std::fs::create_dir_all(&self.results)?;
        let mut text = format!(
            "# CUDA tactic sweeps (MEASURED on {}, {sm}, driver {}, CUDA {}; criterion, 10 \
             samples per point, each iteration between CUDA events with the L2 flushed before \
             it)\n# the all-reduce: {} ranks as streams of this one GPU (its memory, not PCIe)\n\
             # * = the fastest at that shape; (default) = the heuristic default\n\n",
            identity.name, identity.driver_version, identity.cuda_version, 8
        );
        for (fi, f) in plan.iter().enumerate() {
            let mut values = vec![vec![f64::NAN; f.shapes.len()]; f.tactics.len()];
            for (si, shape) in f.shapes.iter().enumerate() {
                for (ti, _) in f.tactics.iter().enumerate() {
                    if failures.contains_key(&(fi, si, ti)) {
                        continue;
                    }
                    let dir = self
                        .out_dir
                        .join(format!("gpu-{}", f.family.id()))
                        .join(format!("tactic{ti:03}"))
                        .join(shape.bucket())
                        .join("new");
                    if let Ok(p) = read_point(&dir) {
                        values[ti][si] = p.median * 1e6;
                        record(&mut text, f, si, ti, &p);
                    }
                }
            }
            let chart = SweepChart {
                title: format!(
                    "{}: µs per call (MEASURED, {}, {sm})",
                    f.family.id(),
                    identity.name
                ),
                y_desc: "µs per call (CUDA events)",
                shapes: f.shapes.iter().map(ProblemShape::bucket).collect(),
                series: f.tactics.clone(),
                values,
                emphasize: None,
                log_y: true,
            };
            for si in 0..f.shapes.len() {
                if let Some(w) = chart.winner(si) {
                    let _ = writeln!(
                        text,
                        "winner {} {}: {} ({:.2} µs; default {})",
                        f.family.id(),
                        f.shapes[si].bucket(),
                        f.tactics[w],
                        chart.values[w][si],
                        f.default[si].as_deref().unwrap_or("-")
                    );
                }
            }
            chart.draw(&self.results.join(format!(
                "gpu-tactics-{}-{}.svg",
                f.family.id(),
                sm.arch()
            )))?;
        }
        for ((fi, si, ti), e) in &failures {
            let f = &plan[*fi];
            let _ = writeln!(
                text,
                "FAILED {} {} {}: {e}",
                f.family.id(),
                f.tactics[*ti],
                f.shapes[*si].bucket()
            );
        }
        let table = self.results.join(format!("gpu-tactics-{}.txt", sm.arch()));
        std::fs::write(&table, &text).with_context(|| format!("writing {}", table.display()))?;
        print!("{text}");
        Ok(())
    }
}

fn record(text: &mut String, f: &FamilySweep, si: usize, ti: usize, p: &Point) {
    let _ = writeln!(
        text,
        "{:<10} {:<34} {:<44} {:>10.2} µs  spread {:>5.1}%  n {:>2}",
        f.family.id(),
        f.shapes[si].bucket(),
        f.tactics[ti],
        p.median * 1e6,
        p.spread * 100.0,
        p.n
    );
}

fn main() -> Result<()> {
    // The all-reduce's ranks are streams of one GPU whose kernels wait on each other: each
    // needs a hardware queue of its own. Set before the driver starts.
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        // SAFETY: first thing in main, before any other thread exists.
        unsafe { std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32") };
    }
    // Files only from a real run (`--bench`, as cargo bench passes it): criterion's test mode
    // and --quick measure nothing worth charting.
    let args: Vec<String> = std::env::args().collect();
    let quick = !args.iter().any(|a| a == "--bench")
        || args
            .iter()
            .any(|a| a == "--quick" || a == "--test" || a == "--list");
    let ptx_dir = kernels::tactic::timing::default_ptx_dir();
    let results = std::env::var_os("KIMI_SWEEP_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("results"));
    let out_dir =
        std::env::temp_dir().join(format!("kimi-sm120-gpu-criterion-{}", std::process::id()));
    let sweeps = Sweeps {
        quick,
        out_dir: out_dir.clone(),
        results,
    };
    let r = match with_timed_device(0, &ptx_dir, None, sweeps) {
        Ok(r) => r,
        Err(why) => {
            println!("gpu_tactics: not run: {why}");
            return Ok(());
        }
    };
    let _ = std::fs::remove_dir_all(&out_dir);
    r
}

//! Criterion sweeps of the CPU kernels' tactics: per family (grouped NVFP4 GEMM, dense BF16
//! products, MLA split-KV), every tactic of the family's knobs × Kimi-like decode shapes
//! scaled to this machine, measured here. Writes per family an SVG chart, time relative to the
//! default tactic per shape with one mark per tactic and the winner per shape ringed, and one
//! results table (from which `cargo run -p bench --bin charts` redraws the charts):
//!
//! ```sh
//! cargo bench -p bench --bench cpu_tactics        # bench/results/cpu-tactics-*.svg, .txt
//! cargo bench -p bench --bench cpu_tactics -- --quick   # criterion's quick mode, no files
//! ```
//!
//! The kernels are called from the main thread into rayon's global pool, as the model calls
//! them, so the thread count (which needs a pool of its own) is tuned by `autotune --cpu` on
//! whole decode steps, not here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use bench::cpu_tactics::{CpuFamily, Shape};
use bench::sweep::{Point, read_point};
use criterion::{BenchmarkId, Criterion, SamplingMode};
use kernels::cpu_tactic::{CpuTactic, CpuTacticSpace};
use kernels::isa::Isa;

/// The sweep's subset of the tactic space: fewer dense and MLA points than autotune tries, so
/// that the whole sweep takes a few minutes on two cores.
fn sweep_space(cores: usize) -> CpuTacticSpace {
    let mut space = CpuTactic::space(cores);
    space.dense_parallel_min_bytes = vec![0, 128 << 10, 512 << 10, 4 << 20];
    space.dense_rows_per_task = vec![16, 64, 256];
    space.mla_min_chunk = vec![64, 256, 1024];
    space.mla_tasks_per_thread = vec![1, 4, 8];
    space
}

fn main() -> Result<()> {
    let quick = std::env::args().any(|a| a == "--quick" || a == "--test" || a == "--list");
    let out_dir = std::env::temp_dir().join(format!("kimi-sm120-criterion-{}", std::process::id()));
    let mut c = Criterion::default()
        .output_directory(&out_dir)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .without_plots()
        .configure_from_args();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let space = sweep_space(cores);
    let mut tables = Vec::new();
    for family in CpuFamily::ALL {
        let tactics = family.tactics(&space, CpuTactic::DEFAULT);
        let shapes = family.shapes();
        let mut group = c.benchmark_group(family.id());
        // Flat: every sample the same number of calls, so a 100 ms call needs 10, not 55.
        group.sampling_mode(SamplingMode::Flat);
        for shape in &shapes {
            let case = shape.build(1);
            for (i, t) in tactics.iter().enumerate() {
                group.bench_function(BenchmarkId::new(format!("tactic{i:02}"), shape.id()), |b| {
                    b.iter(|| case.run(t))
                });
            }
        }
        group.finish();
        tables.push((family, tactics, shapes));
    }
    c.final_summary();
    if quick {
        return Ok(());
    }

    let results = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results");
    let mut text = header(cores);
    for (family, tactics, shapes) in &tables {
        let mut points = BTreeMap::new();
        for (i, _) in tactics.iter().enumerate() {
            for (s, shape) in shapes.iter().enumerate() {
                let dir = out_dir
                    .join(family.id())
                    .join(format!("tactic{i:02}"))
                    .join(shape.id())
                    .join("new");
                points.insert((i, s), read_point(&dir)?);
            }
        }
        let default = tactics
            .iter()
            .position(|t| *t == CpuTactic::DEFAULT)
            .context("the default is in every family's space")?;
        text.push_str(&table(*family, tactics, shapes, &points, default));
        chart(
            &results.join(bench::cpu_tactics::chart_file(*family)),
            *family,
            tactics,
            shapes,
            &points,
            default,
        )?;
    }
    let _ = std::fs::remove_dir_all(&out_dir);
    std::fs::write(results.join("cpu-tactics.txt"), &text)?;
    print!("{text}");
    Ok(())
}

fn header(cores: usize) -> String {
    format!(
        "# CPU kernel tactic sweeps (measured; criterion, 10 samples per point)\n\
         # CPU: {} ({} threads, kernels' ISA {:?}); load average at the end: {}; {}\n\
         # time per call: median over samples; spread = (max - min) / median; ratio = time / the default's\n\
         # tactic ids are `kernels::cpu_tactic::CpuTactic` ids; * = the fastest at that shape\n\n",
        bench::cpu_model(),
        cores,
        Isa::detect(),
        bench::load_average(),
        bench::utc_date()
    )
}

fn table(
    family: CpuFamily,
    tactics: &[CpuTactic],
    shapes: &[Shape],
    points: &BTreeMap<(usize, usize), Point>,
    default: usize,
) -> String {
    let mut s = format!("## {family} (measured)\n");
    for (si, shape) in shapes.iter().enumerate() {
        let best = (0..tactics.len())
            .min_by(|&a, &b| points[&(a, si)].median.total_cmp(&points[&(b, si)].median))
            .unwrap_or(default);
        let base = points[&(default, si)].median;
        s.push_str(&format!("shape {shape}\n"));
        for (ti, t) in tactics.iter().enumerate() {
            let p = points[&(ti, si)];
            s.push_str(&format!(
                "  {} {:<24} {:>10.1} us  spread {:>5.1}%  n {:>2}  ratio {:.3}{}\n",
                if ti == best { "*" } else { " " },
                family.label(t),
                p.median * 1e6,
                p.spread * 100.0,
                p.n,
                p.median / base,
                if ti == default { "  (default)" } else { "" }
            ));
        }
        s.push_str(&format!("  winner: {}\n", tactics[best]));
    }
    s.push('\n');
    s
}

fn chart(
    path: &Path,
    family: CpuFamily,
    tactics: &[CpuTactic],
    shapes: &[Shape],
    points: &BTreeMap<(usize, usize), Point>,
    default: usize,
) -> Result<()> {
    let ratio = |ti: usize, si: usize| points[&(ti, si)].median / points[&(default, si)].median;
    bench::cpu_tactics::family_chart(
        family,
        &format!("{}, {:?}", bench::cpu_model(), Isa::detect()),
        shapes.iter().map(Shape::id).collect(),
        tactics.iter().map(|t| family.label(t)).collect(),
        (0..tactics.len())
            .map(|ti| (0..shapes.len()).map(|si| ratio(ti, si)).collect())
            .collect(),
        default,
    )
    .draw(path)
}

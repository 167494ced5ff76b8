//! Every chart drawn from a small fixed data set into a temporary folder, checked for what
//! made charts illegible before: text clipped by the canvas, texts overlapping each other,
//! lines joining unrelated shapes, ticks that are not the values shown. And the committed
//! charts pass the same text check.

use std::path::Path;

use bench::charts::{self, layout};
use bench::cpu_tactics::CpuFamily;
use serde_json::json;

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The SVG at `path` with its text legible; returns it.
fn legible(path: &Path) -> String {
    let svg = read(path);
    let problems = layout::problems(&svg).unwrap();
    assert!(
        problems.is_empty(),
        "{}:\n{}",
        path.display(),
        problems.join("\n")
    );
    svg
}

fn texts(svg: &str) -> Vec<String> {
    layout::text_boxes(svg)
        .unwrap()
        .1
        .into_iter()
        .map(|b| b.text)
        .collect()
}

/// Point counts of the SVG's polylines (plotters draws each line series as one).
fn polyline_points(svg: &str) -> Vec<usize> {
    svg.split("<polyline")
        .skip(1)
        .map(|p| {
            let at = p.find("points=\"").unwrap() + "points=\"".len();
            p[at..]
                .split('"')
                .next()
                .unwrap()
                .split_whitespace()
                .count()
        })
        .collect()
}

/// A family as long-named as the dense CPU sweep: 12 tactics, 6 shapes, a winner per shape.
fn dense_like_chart() -> bench::sweep::SweepChart<'static> {
    let shapes: Vec<String> = ["t1.256x512", "t1.1024x1024", "t1.1536x7168", "t4.1024x1024"]
        .into_iter()
        .chain(["t16.1024x1024", "t64.1024x1024"])
        .map(String::from)
        .collect();
    let tactics: Vec<String> = [0, 128, 512, 4096]
        .into_iter()
        .flat_map(|min| [16, 64, 256].map(move |rows| format!("min {min}k rows {rows}")))
        .collect();
    let ratios: Vec<Vec<f64>> = (0..tactics.len())
        .map(|t| {
            (0..shapes.len())
                .map(|s| {
                    if t == 7 {
                        1.0
                    } else {
                        0.4 + ((t * 7 + s * 3) % 11) as f64 * 0.27
                    }
                })
                .collect()
        })
        .collect();
    bench::cpu_tactics::family_chart(
        CpuFamily::Dense,
        "AMD EPYC 9B14 96-Core Processor, Avx512",
        shapes,
        tactics,
        ratios,
        7,
    )
}

#[test]
fn a_sweep_chart_marks_each_shape_apart_and_names_every_winner_legibly() {
    let dir = tempfile::tempdir().unwrap();
    let chart = dense_like_chart();
    let path = dir.path().join("sweep.svg");
    chart.draw(&path).unwrap();
    let svg = legible(&path);
    let texts = texts(&svg);
    for shape in 0..chart.shapes.len() {
        let winner = &chart.series[chart.winner(shape).unwrap()];
        assert!(texts.contains(&format!("fastest: {winner}")), "{texts:?}");
        assert!(texts.contains(&chart.shapes[shape]), "{texts:?}");
    }
    assert!(texts.contains(&"min 512k rows 64 (default)".to_string()));
    // No line joins two shapes: only the axes and the slots' borders (two points each).
    assert!(
        polyline_points(&svg).iter().all(|&n| n <= 2),
        "{:?}",
        polyline_points(&svg)
    );
    // The default's marks and its legend swatch are the same black squares: one per shape
    // and one in the legend.
    let black_squares = svg
        .split("<rect")
        .skip(1)
        .filter(|r| r.split('>').next().unwrap().contains("fill=\"#000000\""))
        .count();
    assert_eq!(black_squares, chart.shapes.len() + 1);

    // The same on a log axis with a few missing points (the GPU sweeps).
    let mut log = dense_like_chart();
    log.log_y = true;
    log.emphasize = None;
    log.values[3][2] = f64::NAN;
    let path = dir.path().join("sweep-log.svg");
    log.draw(&path).unwrap();
    legible(&path);
}

#[test]
fn a_peer_chart_wraps_a_long_title_and_lists_only_the_engines_that_ran() {
    let dir = tempfile::tempdir().unwrap();
    let cpu = "Intel(R) Xeon(R) Platinum 8480+ Processor @ 2.80GHz (family 6h, model 8fh)";
    let median = |hf: Option<f64>| {
        json!({
            "prefill-128": {"ours": 1142.0, "llama.cpp": 673.0, "hf": hf},
            "prefill-512": {"ours": 878.0, "llama.cpp": 604.0, "hf": hf},
            "decode-b1": {"ours": 189.0, "llama.cpp": 112.0, "hf": hf.map(|_| 17.0)},
            "decode-b4": {"ours": 489.0, "llama.cpp": 269.0, "hf": hf.map(|_| 28.0)},
        })
    };
    for (name, hf) in [("with-hf.svg", Some(394.0)), ("without-hf.svg", None)] {
        let data = json!({"cpu": cpu, "threads": 2, "median": median(hf)});
        let path = dir.path().join(name);
        charts::peer::draw(&data, &path).unwrap();
        let texts = texts(&legible(&path));
        assert!(
            texts.iter().any(|t| t.contains("(family 6h, model 8fh)")),
            "{texts:?}"
        );
        assert_eq!(
            texts.iter().any(|t| t.starts_with("HF transformers")),
            hf.is_some(),
            "{texts:?}"
        );
        // The log axis's ticks are round numbers without a decimal point.
        assert!(texts.contains(&"100".to_string()), "{texts:?}");
        assert!(!texts.iter().any(|t| t.ends_with(".0")), "{texts:?}");
    }
}

#[test]
fn the_step_time_chart_ticks_the_batches_shown() {
    let dir = tempfile::tempdir().unwrap();
    let row = |batch: u32, tok_s: f64| {
        json!({"batch": batch, "tok_s": tok_s, "roofline_tok_s": tok_s * 3.0,
               "roofline_launch_list_tok_s": tok_s * 2.5})
    };
    let doc = json!({
        "model": "kimi-k2.5", "tp": 8, "gpu": "NVIDIA RTX PRO 6000 Blackwell",
        "context_tokens": 4096,
        "vllm_measured_by_others_tok_s": {"first_request": 16.0, "steady": 60.0},
        "defaults": [row(1, 91.1), row(8, 365.7), row(32, 539.2)],
        "tuned": [row(1, 106.0), row(8, 437.8), row(32, 728.5)],
    });
    let path = dir.path().join("step-time.svg");
    charts::step_time::draw(&doc, &path).unwrap();
    let texts = texts(&legible(&path));
    for batch in ["1", "8", "32"] {
        assert!(texts.contains(&batch.to_string()), "{texts:?}");
    }
    // No decade ticks between the batches.
    for decade in ["10", "10.0", "2.0", "1.0"] {
        assert_eq!(
            texts.iter().filter(|t| *t == decade).count(),
            usize::from(decade == "10"),
            "{decade}: {texts:?}"
        );
    }
    // Lines join one series' batches only: four series of three points; vLLM's levels are
    // dashes, not series.
    let series: Vec<usize> = polyline_points(&read(&path))
        .into_iter()
        .filter(|&n| n > 2)
        .collect();
    assert_eq!(series, [3, 3, 3, 3]);
}

#[test]
fn the_allreduce_chart_ticks_whole_binary_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("allreduce.svg");
    charts::allreduce::draw(&path).unwrap();
    let texts = texts(&legible(&path));
    for tick in ["64 B", "1 KiB", "16 KiB", "1 MiB"] {
        assert!(texts.contains(&tick.to_string()), "{tick}: {texts:?}");
    }
    assert!(
        !texts.iter().any(|t| t == "98 KiB" || t == "1000 B"),
        "{texts:?}"
    );
}

#[test]
fn every_chart_is_redrawn_from_the_data_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
    for name in [
        "cpu-tactics.txt",
        "peer-llamacpp-xeon.json",
        "step-time.json",
    ] {
        std::fs::copy(results.join(name), dir.path().join(name)).unwrap();
    }
    let written = charts::redraw_all(dir.path()).unwrap();
    let names: Vec<String> = written
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "cpu-tactics-moe.svg",
            "cpu-tactics-dense.svg",
            "cpu-tactics-mla.svg",
            "peer-llamacpp-xeon.svg",
            "step-time.svg",
            "allreduce-sim-8gpu.svg"
        ]
    );
    for path in &written {
        legible(path);
    }
}

#[test]
fn the_committed_charts_are_legible() {
    let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
    let mut checked = 0;
    for entry in std::fs::read_dir(&results).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "svg") {
            legible(&path);
            checked += 1;
        }
    }
    assert!(checked > 0, "no chart in {}", results.display());
}

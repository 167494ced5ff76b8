//! The Rust half of the peer benchmark against llama.cpp (`bench/peer/run.sh` runs it):
//!
//! - `peer-llamacpp bandwidth [--mib N] [--window-ms M]`: the machine's read and copy
//!   bandwidth on every thread (best of 10 passes over 512 MiB, or N MiB), on 4 KiB and on
//!   2 MiB pages, and the better of the two as `read_gb_s`/`copy_gb_s`; and the read bandwidth
//!   sustained over M ms (1000) of back-to-back passes on 2 MiB pages as
//!   `read_sustained_gb_s` ([`bench::sustained_read`]), as one JSON line;
//! - `peer-llamacpp chart --json bench/results/peer-llamacpp.json --out FILE.svg`: the
//!   measured medians as grouped bars, one group per row (prefill 128/512, decode b1/b4),
//!   one bar per engine, tok/s on a log axis.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use plotters::prelude::*;
use serde_json::Value;

const ENGINES: [(&str, &str); 3] = [
    ("ours", "ours (NVFP4 experts)"),
    ("llama.cpp", "llama.cpp (same NVFP4 bytes, GGUF)"),
    ("hf", "HF transformers (float32)"),
];
/// The table's rows, in the order the chart draws them.
const ROWS: [&str; 4] = ["prefill-128", "prefill-512", "decode-b1", "decode-b4"];
const BANDWIDTH_PASSES: usize = 10;
/// How long `bandwidth` sustains its read by default: longer than a batch-1 decode run of the
/// peer benchmark (32 tokens, about 0.2 s), short enough to run before and after each.
const SUSTAINED_WINDOW_MS: usize = 1000;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("bandwidth") => {
            let number = |flag: &str, default: usize| match args.iter().position(|a| a == flag) {
                Some(i) => args
                    .get(i + 1)
                    .and_then(|v| v.parse::<usize>().ok())
                    .filter(|&v| v > 0)
                    .with_context(|| format!("{flag} needs a positive whole number")),
                None => Ok(default),
            };
            let mib = number("--mib", bench::COPY_BYTES >> 20)?;
            let window_ms = number("--window-ms", SUSTAINED_WINDOW_MS)?;
            let small = bench::bandwidth_on(bench::Pages::Small, mib << 20, BANDWIDTH_PASSES);
            let huge = bench::bandwidth_on(bench::Pages::Huge, mib << 20, BANDWIDTH_PASSES);
            let window = std::time::Duration::from_millis(window_ms as u64);
            let sustained = bench::sustained_read(bench::Pages::Huge, mib << 20, window);
            println!(
                "{}",
                serde_json::json!({
                    "read_gb_s": small.1.max(huge.1),
                    "copy_gb_s": small.0.max(huge.0),
                    "read_4k_pages_gb_s": small.1,
                    "read_2m_pages_gb_s": huge.1,
                    "read_sustained_gb_s": sustained,
                    "sustained_window_ms": window_ms,
                    "buffer_mib": mib,
                    "threads": rayon::current_num_threads(),
                })
            );
            Ok(())
        }
        Some("chart") => {
            let value = |flag: &str| {
                args.iter()
                    .position(|a| a == flag)
                    .and_then(|i| args.get(i + 1))
                    .map(PathBuf::from)
                    .with_context(|| format!("chart needs {flag} FILE"))
            };
            chart(&value("--json")?, &value("--out")?)
        }
        _ => bail!(
            "usage: peer-llamacpp bandwidth [--mib N] [--window-ms M] | chart --json FILE --out FILE.svg"
        ),
    }
}

fn chart(json: &Path, out: &PathBuf) -> Result<()> {
    let data: Value = serde_json::from_str(&kernels::files::read_text_bounded(
        json,
        kernels::files::TEXT_FILE_LIMIT,
    )?)?;
    let median = data["median"]
        .as_object()
        .context("no `median` object in the results")?;
    let rows: Vec<(&str, [Option<f64>; 3])> = ROWS
        .iter()
        .filter_map(|row| {
            median
                .get(*row)
                .map(|m| (*row, ENGINES.map(|(id, _)| m[id].as_f64())))
        })
        .collect();
    let values = rows.iter().flat_map(|(_, v)| v.iter().flatten().copied());
    let (lo, hi) = values.fold((f64::MAX, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if hi <= 0.0 {
        bail!("no measured value to draw");
    }
    let (y_lo, y_hi) = (lo / 2.0, hi * 2.0);

    let root = SVGBackend::new(out, (960, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let caption = format!(
        "Measured tok/s on CPU, same random DeepSeek-V3 `mini` model, {} threads ({}), shared machine",
        data["threads"],
        data["cpu"].as_str().unwrap_or("?")
    );
    let groups = rows.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 17))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..groups, (y_lo..y_hi).log_scale())?;
    let names: Vec<String> = rows.iter().map(|(r, _)| r.to_string()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(rows.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 1e-6 && i < names.len() {
                names[i].clone()
            } else {
                String::new()
            }
        })
        .y_desc("tok/s (median of the rounds, log scale)")
        .draw()?;
    let bar = 0.8 / ENGINES.len() as f64;
    for (e, (_, label)) in ENGINES.iter().enumerate() {
        let color = Palette99::pick(e).to_rgba();
        let bars: Vec<(f64, f64)> = rows
            .iter()
            .enumerate()
            .filter_map(|(g, (_, v))| v[e].map(|v| (g as f64 + 0.1 + e as f64 * bar, v)))
            .collect();
        chart
            .draw_series(
                bars.iter().map(|&(x, v)| {
                    Rectangle::new([(x, y_lo), (x + bar * 0.92, v)], color.filled())
                }),
            )?
            .label(*label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
        chart.draw_series(bars.iter().map(|&(x, v)| {
            Text::new(
                format!("{v:.0}"),
                (x + bar * 0.1, v * 1.12),
                ("sans-serif", 13).into_font(),
            )
        }))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    println!("wrote {}", out.display());
    Ok(())
}

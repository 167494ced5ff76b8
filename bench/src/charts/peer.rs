//! The peer benchmark's chart (`peer-llamacpp chart`): the measured medians of
//! `peer-llamacpp*.json` as grouped bars, one group per row (prefill 128/512, decode b1/b4),
//! one bar per engine that ran, tok/s on a log axis.

use std::path::Path;

use anyhow::{Context, Result, bail};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, VPos};
use serde_json::Value;

use super::{Header, LABEL_PX, LegendEntry, Swatch};

/// The engines: id in the results, legend label.
pub const ENGINES: [(&str, &str); 3] = [
    ("ours", "ours (NVFP4 experts)"),
    ("llama.cpp", "llama.cpp (same NVFP4 bytes, GGUF)"),
    ("hf", "HF transformers (float32)"),
];
/// The table's rows, in the order the chart draws them.
pub const ROWS: [&str; 4] = ["prefill-128", "prefill-512", "decode-b1", "decode-b4"];

const WIDTH: u32 = 960;
const PLOT_HEIGHT: u32 = 480;

/// Draws the medians of the peer results `data` (the JSON `bench/peer/run.sh` writes) to
/// `out`.
pub fn draw(data: &Value, out: &Path) -> Result<()> {
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
    // Only the engines that ran: an engine without a value would be a legend entry for nothing.
    let engines: Vec<usize> = (0..ENGINES.len())
        .filter(|&e| rows.iter().any(|(_, v)| v[e].is_some()))
        .collect();
    let values = rows.iter().flat_map(|(_, v)| v.iter().flatten().copied());
    let (lo, hi) = values.fold((f64::MAX, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if hi <= 0.0 {
        bail!("no measured value to draw");
    }
    // The bars stand on a tick, and the tallest's label fits under the top.
    let (y_lo, y_hi) = (super::nice_floor(lo / 1.5), super::nice_ceil(hi * 1.3));
    let ticks = super::log_ticks(y_lo, y_hi);

    let title = format!(
        "Measured tok/s on CPU, same random DeepSeek-V3 `mini` model, {} threads ({}), shared machine",
        data["threads"],
        data["cpu"].as_str().unwrap_or("?")
    );
    let legend = engines
        .iter()
        .map(|&e| LegendEntry::new(ENGINES[e].1, Swatch::Bar(color(e))))
        .collect();
    let header = Header::new(WIDTH, &title, legend);
    let (root, plot) = super::canvas(out, &header, PLOT_HEIGHT)?;
    let groups = rows.len() as f64;
    let mut chart = ChartBuilder::on(&plot)
        .margin(super::MARGIN as u32)
        .x_label_area_size(30)
        .y_label_area_size(64)
        .build_cartesian_2d(
            0f64..groups,
            (y_lo..y_hi).log_scale().with_key_points(ticks),
        )?;
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
        .y_label_formatter(&|v| super::number_label(*v))
        .label_style(super::font(LABEL_PX))
        .axis_desc_style(super::font(LABEL_PX))
        .y_desc("tok/s (median of the rounds, log scale)")
        .draw()?;
    let bar = 0.8 / engines.len() as f64;
    for (slot, &e) in engines.iter().enumerate() {
        let bars: Vec<(f64, f64)> = rows
            .iter()
            .enumerate()
            .filter_map(|(g, (_, v))| v[e].map(|v| (g as f64 + 0.1 + slot as f64 * bar, v)))
            .collect();
        chart
            .draw_series(bars.iter().map(|&(x, v)| {
                Rectangle::new([(x, y_lo), (x + bar * 0.92, v)], color(e).filled())
            }))?;
        // Each value centred over its bar, no wider than the bar.
        for &(x, v) in &bars {
            let (px, py) = chart.backend_coord(&(x + bar * 0.46, v));
            root.draw(&Text::new(
                format!("{v:.0}"),
                (px, py - 3),
                super::text_style(LABEL_PX, HPos::Center, VPos::Bottom),
            ))?;
        }
    }
    root.present()?;
    Ok(())
}

/// Draws the medians in the JSON file `json` to `out`.
pub fn draw_file(json: &Path, out: &Path) -> Result<()> {
    let data: Value = serde_json::from_str(&kernels::files::read_text_bounded(
        json,
        kernels::files::TEXT_FILE_LIMIT,
    )?)
    .with_context(|| format!("reading {}", json.display()))?;
    draw(&data, out)
}

/// Engine `e`'s colour, the same whichever engines ran.
fn color(e: usize) -> RGBColor {
    super::PALETTE[[2, 4, 0][e]]
}

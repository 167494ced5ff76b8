//! The step-time model's chart (`autotune step-time`): predicted decode tok/s against batch,
//! with the heuristic defaults, the tactic cache's winners, the two memory rooflines and
//! vLLM's figures as reference levels. Drawn from the report's JSON (`step-time.json`), so
//! that the chart can be redrawn without the model.

use std::path::Path;

use anyhow::{Context, Result, bail};
use plotters::prelude::*;
use serde_json::Value;

use super::{Header, LABEL_PX, LegendEntry, Marker, Swatch};

const WIDTH: u32 = 960;
const PLOT_HEIGHT: u32 = 500;

/// A series of the chart: one value per batch.
struct Series {
    label: String,
    values: Vec<f64>,
    color: RGBColor,
    width: u32,
}

/// Draws the step-time report `doc` (what `autotune step-time` writes as `step-time.json`)
/// to `out`.
pub fn draw(doc: &Value, out: &Path) -> Result<()> {
    let rows = |key: &str| doc[key].as_array().cloned();
    let defaults = rows("defaults").context("no `defaults` in the step-time report")?;
    let batches: Vec<f64> = defaults
        .iter()
        .map(|r| r["batch"].as_f64().context("a row without `batch`"))
        .collect::<Result<_>>()?;
    if batches.is_empty() || batches.windows(2).any(|w| w[1] <= w[0]) {
        bail!("the step-time rows' batches are not increasing: {batches:?}");
    }
    let column = |rows: &[Value], key: &str| -> Result<Vec<f64>> {
        rows.iter()
            .map(|r| {
                r[key]
                    .as_f64()
                    .with_context(|| format!("a row without `{key}`"))
            })
            .collect()
    };
    let mut series = vec![Series {
        label: "predicted, heuristic default tactics".into(),
        values: column(&defaults, "tok_s")?,
        color: super::PALETTE[0],
        width: 2,
    }];
    if let Some(tuned) = rows("tuned") {
        let tuned_batches = column(&tuned, "batch")?;
        if tuned_batches != batches {
            bail!("the tuned rows' batches {tuned_batches:?} are not the defaults' {batches:?}");
        }
        series.push(Series {
            label: "predicted, tactic cache winners".into(),
            values: column(&tuned, "tok_s")?,
            color: super::PALETTE[4],
            width: 3,
        });
    }
    series.push(Series {
        label: "memory roofline: the config's minimum bytes at the data-sheet bandwidth".into(),
        values: column(&defaults, "roofline_tok_s")?,
        color: BLACK,
        width: 1,
    });
    series.push(Series {
        label: "memory roofline: the recorded launch list's bytes at that bandwidth".into(),
        values: column(&defaults, "roofline_launch_list_tok_s")?,
        color: RGBColor(120, 120, 120),
        width: 1,
    });
    let vllm = &doc["vllm_measured_by_others_tok_s"];
    let references: Vec<(String, f64, RGBColor)> = [
        ("steady", "vLLM steady state", super::PALETTE[2]),
        ("first_request", "vLLM first request", super::PALETTE[6]),
    ]
    .into_iter()
    .filter_map(|(key, name, color)| {
        vllm[key].as_f64().map(|v| {
            (
                format!("{name}, {v:.0} tok/s (measured by others, batch not stated)"),
                v,
                color,
            )
        })
    })
    .collect();

    let all = series
        .iter()
        .flat_map(|s| s.values.iter().copied())
        .chain(references.iter().map(|r| r.1));
    let (lo, hi) = all.fold((f64::MAX, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (y_lo, y_hi) = (super::nice_floor(lo / 1.3), super::nice_ceil(hi * 1.3));
    let (x0, x1) = (batches[0], batches[batches.len() - 1]);
    let title = format!(
        "PREDICTED decode tok/s, {}, {}x {} (PCIe), {}-token contexts",
        doc["model"].as_str().unwrap_or("?"),
        doc["tp"],
        doc["gpu"].as_str().unwrap_or("?"),
        doc["context_tokens"]
    );
    let legend =
        series
            .iter()
            .map(|s| LegendEntry::new(s.label.clone(), Swatch::LinePoints(s.color, s.width)))
            .chain(references.iter().map(|(label, _, color)| {
                LegendEntry::new(label.clone(), Swatch::Dashed(*color, 2))
            }))
            .collect();
    let header = Header::new(WIDTH, &title, legend);
    let (root, plot) = super::canvas(out, &header, PLOT_HEIGHT)?;
    let mut chart = ChartBuilder::on(&plot)
        .margin(super::MARGIN as u32)
        .margin_right(3 * super::MARGIN as u32)
        .x_label_area_size(45)
        .y_label_area_size(64)
        .build_cartesian_2d(
            // The ticks are the batches shown, not the decades of the log axis.
            (x0 / 1.25..x1 * 1.25)
                .log_scale()
                .with_key_points(batches.clone()),
            (y_lo..y_hi)
                .log_scale()
                .with_key_points(super::log_ticks(y_lo, y_hi)),
        )?;
    chart
        .configure_mesh()
        .x_label_formatter(&|b| super::number_label(*b))
        .y_label_formatter(&|v| super::number_label(*v))
        .label_style(super::font(LABEL_PX))
        .axis_desc_style(super::font(LABEL_PX))
        .x_desc("decode batch (sequences; log scale)")
        .y_desc("tokens/s (all sequences; log scale)")
        .draw()?;
    for (_, v, color) in &references {
        let from = chart.backend_coord(&(x0 / 1.25, *v));
        let to = chart.backend_coord(&(x1 * 1.25, *v));
        super::draw_dashed(&root, from, to, color.stroke_width(2), 8)?;
    }
    for s in &series {
        let points: Vec<(f64, f64)> = batches
            .iter()
            .copied()
            .zip(s.values.iter().copied())
            .collect();
        chart.draw_series(LineSeries::new(
            points.clone(),
            s.color.stroke_width(s.width),
        ))?;
        for p in &points {
            super::draw_mark(&root, chart.backend_coord(p), s.color, Marker::Circle)?;
        }
    }
    root.present()?;
    Ok(())
}

/// Draws the report in the JSON file `json` to `out`.
pub fn draw_file(json: &Path, out: &Path) -> Result<()> {
    let doc: Value = serde_json::from_str(&kernels::files::read_text_bounded(
        json,
        kernels::files::TEXT_FILE_LIMIT,
    )?)
    .with_context(|| format!("reading {}", json.display()))?;
    draw(&doc, out)
}

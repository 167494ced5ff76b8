//! The all-reduce cost model as a chart (`allreduce-chart`): predicted latency per algorithm
//! against message size on an 8-GPU 4+4 two-socket PCIe host, with NCCL and the per-token
//! message (14,336 B) marked. Computed from the cost model each time (it takes no time).

use std::path::Path;

use anyhow::{Result, anyhow};
use kernels::allreduce::Algorithm;
use kernels::allreduce::cost::{Host, LinkParams, table_sizes};
use kernels::allreduce::topology::{Topology, fixtures};
use plotters::prelude::*;

use super::{Header, LABEL_PX, LegendEntry, Swatch};

/// The chart's file name in `bench/results`.
pub const CHART_FILE: &str = "allreduce-sim-8gpu.svg";
/// One token's all-reduce at TP8: Kimi's hidden size in BF16.
pub const FOCUS_BYTES: usize = 14_336;

const WIDTH: u32 = 960;
const PLOT_HEIGHT: u32 = 520;

/// A line of the chart: name, (bytes, µs) points, colour, stroke width.
type Line = (String, Vec<(f64, f64)>, RGBColor, u32);

/// Draws the chart to `path`.
pub fn draw(path: &Path) -> Result<()> {
    let text = fixtures::named("two-sockets-4x4")
        .ok_or_else(|| anyhow!("fixture two-sockets-4x4 is missing"))?;
    let topology = Topology::from_nvidia_smi(text).map_err(|e| anyhow!("{e}"))?;
    let host = Host::new(topology.prefix(8));
    let params = LinkParams::default();
    let sizes = table_sizes();
    let mut series: Vec<Line> = Algorithm::ALL
        .iter()
        .filter(|a| host.supports(**a))
        .enumerate()
        .map(|(i, a)| {
            (
                a.id().to_string(),
                sizes
                    .iter()
                    .map(|&b| (b as f64, host.predict_us(*a, b, &params)))
                    .collect(),
                super::PALETTE[i % super::PALETTE.len()],
                2,
            )
        })
        .collect();
    series.push((
        "nccl".into(),
        sizes
            .iter()
            .map(|&b| (b as f64, host.nccl_us(b, &params)))
            .collect(),
        BLACK,
        3,
    ));
    let values = series
        .iter()
        .flat_map(|(_, p, _, _)| p.iter().map(|(_, y)| *y));
    let (lo, hi) = values.fold((f64::MAX, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (y_lo, y_hi) = (super::nice_floor(lo / 1.3), super::nice_ceil(hi * 1.3));
    let (x_lo, x_hi) = (sizes[0] as f64, *sizes.last().unwrap_or(&1) as f64);
    // Ticks at powers of four bytes: whole binary units (64 B, 1 KiB, 16 KiB, 1 MiB …).
    let x_ticks: Vec<f64> = (0..64)
        .map(|e| 4f64.powi(e))
        .filter(|&b| b >= x_lo && b <= x_hi)
        .collect();

    // A colour no algorithm has.
    let focus_color = super::PALETTE[(series.len() - 1) % super::PALETTE.len()];
    let legend = series
        .iter()
        .map(|(name, _, color, width)| LegendEntry::new(name.clone(), Swatch::Line(*color, *width)))
        .chain([LegendEntry::new(
            "14,336 B: one token's all-reduce at TP8",
            Swatch::Dashed(focus_color, 1),
        )])
        .collect();
    let header = Header::new(
        WIDTH,
        "Predicted all-reduce latency, 8 GPUs, PCIe 4+4 across two sockets",
        legend,
    );
    let (root, plot) = super::canvas(path, &header, PLOT_HEIGHT)?;
    let mut chart = ChartBuilder::on(&plot)
        .margin(super::MARGIN as u32)
        .margin_right(3 * super::MARGIN as u32)
        .x_label_area_size(45)
        .y_label_area_size(64)
        .build_cartesian_2d(
            (x_lo..x_hi).log_scale().with_key_points(x_ticks),
            (y_lo..y_hi)
                .log_scale()
                .with_key_points(super::log_ticks(y_lo, y_hi)),
        )?;
    chart
        .configure_mesh()
        .x_desc("message bytes (log scale)")
        .y_desc("latency (µs, log scale)")
        .x_label_formatter(&|b| human_bytes(*b))
        .y_label_formatter(&|v| super::number_label(*v))
        .label_style(super::font(LABEL_PX))
        .axis_desc_style(super::font(LABEL_PX))
        .draw()?;
    let from = chart.backend_coord(&(FOCUS_BYTES as f64, y_lo));
    let to = chart.backend_coord(&(FOCUS_BYTES as f64, y_hi));
    super::draw_dashed(&root, from, to, focus_color.stroke_width(1), 6)?;
    for (_, points, color, width) in &series {
        chart.draw_series(LineSeries::new(
            points.iter().copied(),
            color.stroke_width(*width),
        ))?;
    }
    root.present()?;
    Ok(())
}

/// Bytes in whole binary units.
fn human_bytes(b: f64) -> String {
    match b {
        b if b >= (1 << 20) as f64 => format!("{} MiB", super::number_label(b / (1 << 20) as f64)),
        b if b >= 1024.0 => format!("{} KiB", super::number_label(b / 1024.0)),
        b => format!("{b:.0} B"),
    }
}

//! The all-reduce cost model as a chart: predicted latency per algorithm against message size
//! on an 8-GPU 4+4 two-socket PCIe host, with NCCL and the per-token message (14,336 B)
//! marked. Writes `bench/results/allreduce-sim-8gpu.svg`.
//!
//! ```sh
//! cargo run --release -p bench --bin allreduce-chart
//! ```

use std::path::PathBuf;

use anyhow::{Result, anyhow};
use kernels::allreduce::Algorithm;
use kernels::allreduce::cost::{Host, LinkParams, table_sizes};
use kernels::allreduce::topology::{Topology, fixtures};
use plotters::prelude::*;

const FOCUS_BYTES: usize = 14_336;

fn main() -> Result<()> {
    let text = fixtures::named("two-sockets-4x4")
        .ok_or_else(|| anyhow!("fixture two-sockets-4x4 is missing"))?;
    let topology = Topology::from_nvidia_smi(text).map_err(|e| anyhow!("{e}"))?;
    let host = Host::new(topology.prefix(8));
    let params = LinkParams::default();
    let sizes = table_sizes();
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Algorithm::ALL
        .iter()
        .filter(|a| host.supports(**a))
        .map(|a| {
            (
                a.id().to_string(),
                sizes
                    .iter()
                    .map(|&b| (b as f64, host.predict_us(*a, b, &params)))
                    .collect(),
            )
        })
        .collect();
    series.push((
        "nccl".into(),
        sizes
            .iter()
            .map(|&b| (b as f64, host.nccl_us(b, &params)))
            .collect(),
    ));
    let y_max = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(_, y)| *y))
        .fold(1.0f64, f64::max);

    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results/allreduce-sim-8gpu.svg");
    let root = SVGBackend::new(&path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Predicted all-reduce latency, 8 GPUs, PCIe 4+4 across two sockets",
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (sizes[0] as f64..*sizes.last().unwrap() as f64).log_scale(),
            (1.0f64..y_max * 1.2).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("message bytes")
        .y_desc("latency (µs)")
        .x_label_formatter(&|b| human_bytes(*b))
        .draw()?;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let style = if name == "nccl" {
            BLACK.stroke_width(3)
        } else {
            color.stroke_width(2)
        };
        chart
            .draw_series(LineSeries::new(points.iter().copied(), style))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    let focus: Vec<(f64, f64)> = vec![(FOCUS_BYTES as f64, 1.0), (FOCUS_BYTES as f64, y_max * 1.2)];
    chart
        .draw_series(LineSeries::new(focus, RED.mix(0.5).stroke_width(1)))?
        .label("14,336 B: one token's all-reduce at TP8")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.mix(0.5)));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()?;
    println!("wrote {}", path.display());
    Ok(())
}

fn human_bytes(b: f64) -> String {
    match b {
        b if b >= (1 << 20) as f64 => format!("{:.0} MiB", b / (1 << 20) as f64),
        b if b >= 1024.0 => format!("{:.0} KiB", b / 1024.0),
        b => format!("{b:.0} B"),
    }
}

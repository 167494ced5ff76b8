//! What the criterion sweeps (`benches/cpu_tactics.rs`, `benches/gpu_tactics.rs`) share:
//! reading criterion's samples back, and the chart of a family (one line per tactic against
//! shape, the winner per shape marked), drawn with plotters' SVG backend (text as SVG text:
//! no system fonts are read).

use std::path::Path;

use anyhow::Result;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::cpu_tactics::median_spread;

/// One measured point: seconds per call (median over criterion's samples), the spread
/// (`(max − min) / median`), and the number of samples.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    pub median: f64,
    pub spread: f64,
    pub n: usize,
}

/// Median and spread of seconds per iteration over the samples criterion wrote into `dir`
/// (`sample.json`).
pub fn read_point(dir: &Path) -> Result<Point> {
    let path = dir.join("sample.json");
    let json: serde_json::Value = serde_json::from_slice(&kernels::files::read_bounded(
        &path,
        kernels::files::TEXT_FILE_LIMIT,
    )?)?;
    let nums = |key: &str| -> Vec<f64> {
        json[key]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_f64()).collect())
            .unwrap_or_default()
    };
    let (iters, times) = (nums("iters"), nums("times"));
    let mut per_iter: Vec<f64> = iters.iter().zip(&times).map(|(i, t)| t / i / 1e9).collect();
    let n = per_iter.len();
    let (median, spread) = median_spread(&mut per_iter);
    Ok(Point { median, spread, n })
}

/// A family's chart: `values[series][shape]` (NaN: not measured), one line per series, the
/// lowest value per shape ringed and named; `emphasize` draws one series thick and black (the
/// default tactic).
pub struct SweepChart<'a> {
    pub title: String,
    pub y_desc: &'a str,
    pub shapes: Vec<String>,
    pub series: Vec<String>,
    pub values: Vec<Vec<f64>>,
    pub emphasize: Option<usize>,
    pub log_y: bool,
}

impl SweepChart<'_> {
    /// The series with the lowest value at `shape`.
    pub fn winner(&self, shape: usize) -> Option<usize> {
        (0..self.series.len())
            .filter(|&s| self.values[s][shape].is_finite())
            .min_by(|&a, &b| self.values[a][shape].total_cmp(&self.values[b][shape]))
    }

    pub fn draw(&self, path: &Path) -> Result<()> {
        let finite = || {
            self.values
                .iter()
                .flatten()
                .copied()
                .filter(|v| v.is_finite())
        };
        let lo = finite().fold(f64::INFINITY, f64::min);
        let hi = finite().fold(f64::NEG_INFINITY, f64::max);
        let (lo, hi) = if lo.is_finite() && hi.is_finite() {
            (lo, hi)
        } else {
            (1.0, 1.0)
        };
        let root = SVGBackend::new(path, (1000, 620)).into_drawing_area();
        root.fill(&WHITE)?;
        let x_range = -0.3f64..(self.shapes.len() as f64 - 0.7);
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(&self.title, ("sans-serif", 18))
            .margin(15)
            .x_label_area_size(50)
            .y_label_area_size(60);
        if self.log_y {
            let mut chart = builder
                .build_cartesian_2d(x_range, ((lo * 0.8).max(1e-12)..hi * 1.25).log_scale())?;
            self.draw_chart(&mut chart, lo, hi)?;
        } else {
            let mut chart = builder.build_cartesian_2d(x_range, (lo * 0.95)..(hi * 1.05))?;
            self.draw_chart(&mut chart, lo, hi)?;
        }
        root.present()?;
        Ok(())
    }

    /// The mesh (shapes named on the x axis), one line per series, the winners ringed.
    fn draw_chart<'b, Y>(
        &self,
        chart: &mut ChartContext<'b, SVGBackend<'b>, Cartesian2d<RangedCoordf64, Y>>,
        lo: f64,
        hi: f64,
    ) -> Result<()>
    where
        Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
    {
        let labels = &self.shapes;
        let x_fmt = |x: &f64| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        chart
            .configure_mesh()
            .x_labels(self.shapes.len())
            .x_label_formatter(&x_fmt)
            .x_desc("shape")
            .y_desc(self.y_desc)
            .draw()?;
        for (si, name) in self.series.iter().enumerate() {
            let color = Palette99::pick(si).to_rgba();
            let style = if Some(si) == self.emphasize {
                BLACK.stroke_width(3)
            } else {
                color.stroke_width(1)
            };
            let points: Vec<(f64, f64)> = self.values[si]
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(x, &v)| (x as f64, v))
                .collect();
            let label = if Some(si) == self.emphasize {
                format!("{name} (default)")
            } else {
                name.clone()
            };
            chart
                .draw_series(LineSeries::new(points, style))?
                .label(label)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], style));
        }
        for shape in 0..self.shapes.len() {
            let Some(best) = self.winner(shape) else {
                continue;
            };
            let v = self.values[best][shape];
            let color = Palette99::pick(best).to_rgba();
            chart.draw_series([Circle::new((shape as f64, v), 7, color.stroke_width(3))])?;
            chart.draw_series([Text::new(
                format!("winner: {}", self.series[best]),
                (shape as f64 - 0.25, v - (hi - lo) * 0.03),
                ("sans-serif", 12),
            )])?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 11))
            .position(SeriesLabelPosition::UpperRight)
            .draw()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_marks_the_fastest_series_per_shape_and_skips_missing_points() {
        let chart = SweepChart {
            title: "t".into(),
            y_desc: "µs",
            shapes: vec!["a".into(), "b".into()],
            series: vec!["x".into(), "y".into()],
            values: vec![vec![2.0, f64::NAN], vec![3.0, 1.0]],
            emphasize: Some(0),
            log_y: true,
        };
        assert_eq!((chart.winner(0), chart.winner(1)), (Some(0), Some(1)));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.svg");
        chart.draw(&path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(
            svg.contains("winner: y") && svg.contains("x (default)"),
            "{svg}"
        );
    }
}

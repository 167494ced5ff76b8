//! What the criterion sweeps (`benches/cpu_tactics.rs`, `benches/gpu_tactics.rs`) share:
//! reading criterion's samples back, and the chart of a family (one mark per tactic in each
//! shape's slot, the winner per shape ringed and named), drawn with plotters' SVG backend and the helpers of
//! [`crate::charts`].

use std::path::Path;

use anyhow::Result;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, VPos};

use crate::charts::{self, Header, LABEL_PX, LegendEntry, MARK_RADIUS, Marker, SMALL_PX, Swatch};
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

/// A family's chart: `values[series][shape]` (NaN: not measured). The shapes are unrelated
/// problems, so no line joins them: each shape has a slot with one mark per series, in the
/// legend's order; the lowest value per shape is ringed and named under the shape.
/// `emphasize` draws one series as black squares (the default tactic), in the legend as well.
pub struct SweepChart<'a> {
    pub title: String,
    pub y_desc: &'a str,
    pub shapes: Vec<String>,
    pub series: Vec<String>,
    pub values: Vec<Vec<f64>>,
    pub emphasize: Option<usize>,
    pub log_y: bool,
}

/// Height of the plot below the header.
const PLOT_HEIGHT: u32 = 520;
const Y_LABEL_AREA: u32 = 70;
/// Below the x axis: the shape, the winner, the axis' name.
const X_LABEL_AREA: u32 = 66;

impl SweepChart<'_> {
    /// The series with the lowest value at `shape`.
    pub fn winner(&self, shape: usize) -> Option<usize> {
        (0..self.series.len())
            .filter(|&s| self.values[s][shape].is_finite())
            .min_by(|&a, &b| self.values[a][shape].total_cmp(&self.values[b][shape]))
    }

    /// Series `s`'s colour and mark, in the plot and the legend alike.
    pub fn style(&self, s: usize) -> (RGBColor, Marker) {
        if Some(s) == self.emphasize {
            (BLACK, Marker::Square)
        } else {
            // The palette's order skips the emphasized series, so that no colour is unused.
            let rank = s - usize::from(self.emphasize.is_some_and(|e| e < s));
            charts::series_style(rank)
        }
    }

    fn legend_label(&self, s: usize) -> String {
        if Some(s) == self.emphasize {
            format!("{} (default)", self.series[s])
        } else {
            self.series[s].clone()
        }
    }

    fn winner_label(&self, shape: usize) -> String {
        self.winner(shape)
            .map(|w| format!("fastest: {}", self.series[w]))
            .unwrap_or_default()
    }

    /// Width of one shape's slot: its name and its winner's fit, and every series' mark.
    fn slot_width(&self) -> f64 {
        let labels = (0..self.shapes.len()).map(|i| {
            charts::text_width(&self.shapes[i], LABEL_PX)
                .max(charts::text_width(&self.winner_label(i), SMALL_PX))
        });
        let marks = self.series.len() as f64 * f64::from(2 * MARK_RADIUS + 4) / 0.8;
        labels.fold(marks.max(60.0), f64::max) + 24.0
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
        let plot_width = (self.slot_width() * self.shapes.len().max(1) as f64).ceil() as u32;
        let width = (plot_width + Y_LABEL_AREA + 3 * charts::MARGIN as u32).max(720);
        let mut legend: Vec<LegendEntry> = (0..self.series.len())
            .map(|s| {
                let (color, marker) = self.style(s);
                LegendEntry::new(self.legend_label(s), Swatch::Mark(color, marker))
            })
            .collect();
        legend.push(LegendEntry::new(
            "fastest at the shape (named under it)",
            Swatch::Ring(BLACK),
        ));
        let header = Header::new(width, &self.title, legend);
        let (root, plot) = charts::canvas(path, &header, PLOT_HEIGHT)?;
        let x_range = -0.5f64..(self.shapes.len() as f64 - 0.5);
        let mut builder = ChartBuilder::on(&plot);
        builder
            .margin(charts::MARGIN as u32)
            .x_label_area_size(X_LABEL_AREA)
            .y_label_area_size(Y_LABEL_AREA);
        if self.log_y {
            let (y_lo, y_hi) = (charts::nice_floor(lo / 1.2), charts::nice_ceil(hi * 1.2));
            let y = (y_lo..y_hi)
                .log_scale()
                .with_key_points(charts::log_ticks(y_lo, y_hi));
            let mut chart = builder.build_cartesian_2d(x_range, y)?;
            self.draw_chart(&root, &mut chart)?;
        } else {
            let pad = ((hi - lo) * 0.06).max(hi.abs() * 0.02).max(1e-9);
            let mut chart = builder.build_cartesian_2d(x_range, (lo - pad)..(hi + pad))?;
            self.draw_chart(&root, &mut chart)?;
        }
        root.present()?;
        Ok(())
    }

    /// The mesh, the shapes' slots, one mark per series and shape, the winners ringed and
    /// named.
    fn draw_chart<'b, Y>(
        &self,
        root: &charts::Area<'b>,
        chart: &mut ChartContext<'b, SVGBackend<'b>, Cartesian2d<RangedCoordf64, Y>>,
    ) -> Result<()>
    where
        Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
    {
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_label_formatter(&|v| charts::number_label(*v))
            .label_style(charts::font(LABEL_PX))
            .axis_desc_style(charts::font(LABEL_PX))
            .x_desc("shape")
            .y_desc(self.y_desc)
            .draw()?;
        let y_range = chart.y_range();
        let (y_lo, y_hi) = (y_range.start, y_range.end);
        // Slot boundaries.
        for b in 1..self.shapes.len() {
            let x = b as f64 - 0.5;
            chart.draw_series(LineSeries::new(
                [(x, y_lo), (x, y_hi)],
                BLACK.mix(0.25).stroke_width(1),
            ))?;
        }
        let step = 0.8 / self.series.len().max(1) as f64;
        let offset = |s: usize| (s as f64 - (self.series.len() as f64 - 1.0) / 2.0) * step;
        for (shape, name) in self.shapes.iter().enumerate() {
            for s in 0..self.series.len() {
                let v = self.values[s][shape];
                if v.is_finite() {
                    let (color, marker) = self.style(s);
                    let at = chart.backend_coord(&(shape as f64 + offset(s), v));
                    charts::draw_mark(root, at, color, marker)?;
                }
            }
            if let Some(best) = self.winner(shape) {
                let at =
                    chart.backend_coord(&(shape as f64 + offset(best), self.values[best][shape]));
                charts::draw_ring(root, at, BLACK)?;
            }
            let (cx, axis_y) = chart.backend_coord(&(shape as f64, y_lo));
            root.draw(&Text::new(
                name.clone(),
                (cx, axis_y + 8),
                charts::text_style(LABEL_PX, HPos::Center, VPos::Top),
            ))?;
            root.draw(&Text::new(
                self.winner_label(shape),
                (cx, axis_y + 8 + (LABEL_PX * 1.4) as i32),
                charts::text_style(SMALL_PX, HPos::Center, VPos::Top),
            ))?;
        }
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
            svg.contains("fastest: y") && svg.contains("x (default)"),
            "{svg}"
        );
        assert_eq!(
            charts::layout::problems(&svg).unwrap(),
            Vec::<String>::new()
        );
    }
}

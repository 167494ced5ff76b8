//! What the project's charts share, drawn with plotters' SVG backend (text as SVG text: no
//! system fonts are read, so every layout decision here rests on [`text_width`], an estimate):
//!
//! - a header above the plot: the title wrapped to the canvas's width, then the legend in
//!   rows, so that neither is clipped nor covers data ([`Header`]);
//! - one style per series, used for its marks and its legend swatch alike ([`Swatch`]);
//! - log axes with their ticks at 1, 2 and 5 per decade or at the values shown
//!   ([`log_ticks`]), labelled without a meaningless `.0` ([`number_label`]);
//! - [`layout`]: the check that a drawn SVG's text lies within its canvas and no two texts
//!   overlap.
//!
//! Every chart is redrawn from the data stored beside it by `cargo run -p bench --bin charts`.

pub mod allreduce;
pub mod layout;
pub mod peer;
pub mod step_time;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// A drawing area of an SVG chart.
pub type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// Pixels between the canvas's edge and anything drawn.
pub const MARGIN: i32 = 12;
/// Font sizes in pixels (the SVG's `font-size`).
pub const TITLE_PX: f64 = 17.0;
pub const LEGEND_PX: f64 = 12.0;
pub const LABEL_PX: f64 = 12.0;
pub const SMALL_PX: f64 = 11.0;

/// A font of `px` pixels as plotters' SVG backend writes it (it divides the size by 1.24).
pub fn font(px: f64) -> FontDesc<'static> {
    ("sans-serif", px * 1.24).into_font()
}

/// [`font`] anchored at `h`, `v`.
pub fn text_style(px: f64, h: HPos, v: VPos) -> TextStyle<'static> {
    font(px).color(&BLACK).pos(Pos::new(h, v))
}

/// Estimated advance width in pixels of `text` at `px` pixels: DejaVu Sans's widths (the
/// widest of the common sans-serif faces a viewer substitutes), rounded up per class.
pub fn text_width(text: &str, px: f64) -> f64 {
    text.chars().map(char_em).sum::<f64>() * px
}

fn char_em(c: char) -> f64 {
    match c {
        'i' | 'j' | 'l' | '\'' | '|' => 0.28,
        ' ' | '.' | ',' | ':' | ';' | '!' | 'I' | 'J' => 0.34,
        'f' | 't' | 'r' | '(' | ')' | '[' | ']' | '{' | '}' | '/' | '\\' | '-' | '`' => 0.41,
        'm' | 'M' | 'W' | '%' | '@' => 1.0,
        'w' => 0.82,
        'A'..='Z' => 0.79,
        '0'..='9' | 'a'..='z' => 0.64,
        '+' | '=' | '<' | '>' | '~' | '×' | '−' | '#' => 0.84,
        _ => 0.7,
    }
}

/// `text` broken at spaces into lines of at most `max_width` pixels at `px` (a single word
/// wider than that keeps a line of its own).
pub fn wrap(text: &str, max_width: f64, px: f64) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in text.split_whitespace() {
        match lines.last_mut() {
            Some(line) if text_width(&format!("{line} {word}"), px) <= max_width => {
                line.push(' ');
                line.push_str(word);
            }
            _ => lines.push(word.to_string()),
        }
    }
    lines
}

/// A number as a tick or bar label: whole numbers without a decimal point, others to three
/// significant digits.
pub fn number_label(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    if (v - v.round()).abs() < 1e-9 * v.abs().max(1.0) && v.abs() >= 1.0 {
        return format!("{v:.0}");
    }
    let decimals = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Ticks of a log axis over `lo..hi`: 1, 2 and 5 per decade, or only the powers of ten where
/// that would be more than ten ticks.
pub fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let ticks = |steps: &[f64]| -> Vec<f64> {
        let mut out = Vec::new();
        let mut decade = 10f64.powi(lo.log10().floor() as i32);
        while decade <= hi {
            for s in steps {
                let v = s * decade;
                if v >= lo * (1.0 - 1e-9) && v <= hi * (1.0 + 1e-9) {
                    out.push(v);
                }
            }
            decade *= 10.0;
        }
        out
    };
    let dense = ticks(&[1.0, 2.0, 5.0]);
    if dense.len() <= 10 {
        dense
    } else {
        ticks(&[1.0])
    }
}

/// The largest of 1, 2 and 5 times a power of ten at or below `v` (the floor of a log axis
/// that starts at a tick).
pub fn nice_floor(v: f64) -> f64 {
    let decade = 10f64.powi(v.log10().floor() as i32);
    [5.0, 2.0, 1.0]
        .into_iter()
        .map(|s| s * decade)
        .find(|&t| t <= v * (1.0 + 1e-9))
        .unwrap_or(decade)
}

/// The smallest of 1, 2 and 5 times a power of ten at or above `v`.
pub fn nice_ceil(v: f64) -> f64 {
    let decade = 10f64.powi(v.log10().floor() as i32);
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|s| s * decade)
        .find(|&t| t >= v * (1.0 - 1e-9))
        .unwrap_or(10.0 * decade)
}

/// Colours of the series, distinguishable on white (Tableau 10); series beyond ten take the
/// colours again with another [`Marker`] ([`series_style`]). Black is left to the series a
/// chart emphasizes.
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(0x4E, 0x79, 0xA7),
    RGBColor(0xF2, 0x8E, 0x2B),
    RGBColor(0xE1, 0x57, 0x59),
    RGBColor(0x76, 0xB7, 0xB2),
    RGBColor(0x59, 0xA1, 0x4F),
    RGBColor(0xED, 0xC9, 0x48),
    RGBColor(0xB0, 0x7A, 0xA1),
    RGBColor(0xFF, 0x9D, 0xA7),
    RGBColor(0x9C, 0x75, 0x5F),
    RGBColor(0x8C, 0x86, 0x82),
];

/// The shape of a point's mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Marker {
    Circle,
    Triangle,
    Diamond,
    Square,
}

/// The colour and mark of series `i` of a chart: every colour of [`PALETTE`] with circles,
/// then with triangles, then diamonds.
pub fn series_style(i: usize) -> (RGBColor, Marker) {
    let marker = [Marker::Circle, Marker::Triangle, Marker::Diamond][(i / PALETTE.len()) % 3];
    (PALETTE[i % PALETTE.len()], marker)
}

/// How a series is drawn, for its marks and its legend entry alike.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Swatch {
    /// A line `width` pixels wide.
    Line(RGBColor, u32),
    /// A line `width` pixels wide with its points marked.
    LinePoints(RGBColor, u32),
    /// A dashed line without marks: a reference level, not a series of points.
    Dashed(RGBColor, u32),
    /// Filled marks, no line.
    Mark(RGBColor, Marker),
    /// A ring around another mark.
    Ring(RGBColor),
    /// A filled bar.
    Bar(RGBColor),
}

/// One legend entry.
#[derive(Clone, Debug)]
pub struct LegendEntry {
    pub label: String,
    pub swatch: Swatch,
}

impl LegendEntry {
    pub fn new(label: impl Into<String>, swatch: Swatch) -> Self {
        LegendEntry {
            label: label.into(),
            swatch,
        }
    }
}

/// Radius in pixels of a point's mark.
pub const MARK_RADIUS: i32 = 4;
const SWATCH_WIDTH: i32 = 24;
const SWATCH_GAP: i32 = 6;
const ENTRY_GAP: i32 = 20;
const TITLE_LINE: f64 = 1.3;
const LEGEND_ROW: f64 = 1.7;

/// The title and legend above a chart's plot, laid out for a canvas `width` wide.
pub struct Header {
    width: u32,
    title: Vec<String>,
    /// Each legend entry with the top-left corner of its swatch cell.
    legend: Vec<(i32, i32, LegendEntry)>,
    height: u32,
}

impl Header {
    /// The title wrapped to the canvas, the legend's entries in rows beneath it.
    pub fn new(width: u32, title: &str, entries: Vec<LegendEntry>) -> Self {
        let usable = f64::from(width) - 2.0 * f64::from(MARGIN);
        let title_lines = wrap(title, usable, TITLE_PX);
        let mut y = MARGIN + (title_lines.len() as f64 * TITLE_PX * TITLE_LINE).ceil() as i32;
        let row = (LEGEND_PX * LEGEND_ROW).ceil() as i32;
        let mut legend = Vec::new();
        let mut x = MARGIN;
        if !entries.is_empty() {
            y += MARGIN / 2;
        }
        for (i, entry) in entries.into_iter().enumerate() {
            let w = SWATCH_WIDTH + SWATCH_GAP + text_width(&entry.label, LEGEND_PX).ceil() as i32;
            if i > 0 && x + w > width as i32 - MARGIN {
                x = MARGIN;
                y += row;
            }
            legend.push((x, y, entry));
            x += w + ENTRY_GAP;
        }
        if !legend.is_empty() {
            y += row;
        }
        Header {
            width,
            title: title_lines,
            legend,
            height: (y + MARGIN / 2) as u32,
        }
    }

    pub fn height(&self) -> u32 {
        self.height
    }

    /// Draws the header at the top of `root` (the whole canvas).
    pub fn draw(&self, root: &Area<'_>) -> Result<()> {
        let line = (TITLE_PX * TITLE_LINE).ceil() as i32;
        for (i, text) in self.title.iter().enumerate() {
            root.draw(&Text::new(
                text.clone(),
                (self.width as i32 / 2, MARGIN + i as i32 * line),
                text_style(TITLE_PX, HPos::Center, VPos::Top),
            ))?;
        }
        let row = (LEGEND_PX * LEGEND_ROW).ceil() as i32;
        for (x, y, entry) in &self.legend {
            let mid = y + row / 2;
            draw_swatch(root, (x + SWATCH_WIDTH / 2, mid), entry.swatch)?;
            root.draw(&Text::new(
                entry.label.clone(),
                (x + SWATCH_WIDTH + SWATCH_GAP, mid),
                text_style(LEGEND_PX, HPos::Left, VPos::Center),
            ))?;
        }
        Ok(())
    }
}

/// A white canvas of `width` × (`header` + `plot_height`) pixels at `path` with the header
/// drawn; returns the whole canvas and the area below the header.
pub fn canvas<'a>(
    path: &'a Path,
    header: &Header,
    plot_height: u32,
) -> Result<(Area<'a>, Area<'a>)> {
    let root =
        SVGBackend::new(path, (header.width, header.height + plot_height)).into_drawing_area();
    root.fill(&WHITE)?;
    header.draw(&root)?;
    let plot = root.split_vertically(header.height).1;
    Ok((root.clone(), plot))
}

/// A mark centred on `at` (canvas pixels).
pub fn draw_mark(root: &Area<'_>, at: (i32, i32), color: RGBColor, marker: Marker) -> Result<()> {
    let r = MARK_RADIUS;
    let fill = color.filled();
    match marker {
        Marker::Circle => root.draw(&Circle::new(at, r, fill))?,
        Marker::Triangle => root.draw(&TriangleMarker::new(at, r + 1, fill))?,
        Marker::Square => root.draw(&Rectangle::new(
            [(at.0 - r, at.1 - r), (at.0 + r, at.1 + r)],
            fill,
        ))?,
        Marker::Diamond => root.draw(&Polygon::new(
            vec![
                (at.0, at.1 - r - 1),
                (at.0 + r + 1, at.1),
                (at.0, at.1 + r + 1),
                (at.0 - r - 1, at.1),
            ],
            fill,
        ))?,
    }
    Ok(())
}

/// A ring around a mark centred on `at`.
pub fn draw_ring(root: &Area<'_>, at: (i32, i32), color: RGBColor) -> Result<()> {
    root.draw(&Circle::new(at, MARK_RADIUS + 4, color.stroke_width(2)))?;
    Ok(())
}

/// A legend swatch centred on `at`.
fn draw_swatch(root: &Area<'_>, at: (i32, i32), swatch: Swatch) -> Result<()> {
    let half = SWATCH_WIDTH / 2;
    let (x0, x1, y) = (at.0 - half, at.0 + half, at.1);
    match swatch {
        Swatch::Line(color, width) | Swatch::LinePoints(color, width) => {
            root.draw(&PathElement::new(
                vec![(x0, y), (x1, y)],
                color.stroke_width(width),
            ))?;
            if matches!(swatch, Swatch::LinePoints(..)) {
                draw_mark(root, at, color, Marker::Circle)?;
            }
        }
        Swatch::Dashed(color, width) => {
            for x in (x0..x1).step_by(8) {
                root.draw(&PathElement::new(
                    vec![(x, y), ((x + 5).min(x1), y)],
                    color.stroke_width(width),
                ))?;
            }
        }
        Swatch::Mark(color, marker) => draw_mark(root, at, color, marker)?,
        Swatch::Ring(color) => draw_ring(root, at, color)?,
        Swatch::Bar(color) => {
            root.draw(&Rectangle::new(
                [(x0 + 4, y - 6), (x1 - 4, y + 6)],
                color.filled(),
            ))?;
        }
    }
    Ok(())
}

/// A dashed horizontal or sloped line between two canvas points, dashes of `dash` pixels.
pub fn draw_dashed(
    root: &Area<'_>,
    from: (i32, i32),
    to: (i32, i32),
    style: ShapeStyle,
    dash: i32,
) -> Result<()> {
    let (dx, dy) = (f64::from(to.0 - from.0), f64::from(to.1 - from.1));
    let len = dx.hypot(dy);
    let mut s = 0.0;
    while s < len {
        let e = (s + f64::from(dash)).min(len);
        let at = |t: f64| {
            (
                from.0 + (dx * t / len).round() as i32,
                from.1 + (dy * t / len).round() as i32,
            )
        };
        root.draw(&PathElement::new(vec![at(s), at(e)], style))?;
        s += f64::from(dash) * 1.6;
    }
    Ok(())
}

/// Redraws every chart in `dir` from the data stored beside it: `cpu-tactics-*.svg` from
/// `cpu-tactics.txt`, each `peer-llamacpp*.svg` from its `.json`, `step-time.svg` from
/// `step-time.json`, and `allreduce-sim-8gpu.svg` from the all-reduce cost model. Returns the
/// charts written.
pub fn redraw_all(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let tactics = dir.join("cpu-tactics.txt");
    if tactics.exists() {
        let text = kernels::files::read_text_bounded(&tactics, kernels::files::TEXT_FILE_LIMIT)?;
        let charts = crate::cpu_tactics::charts_from_table(&text)
            .with_context(|| format!("reading {}", tactics.display()))?;
        for (family, chart) in charts {
            let out = dir.join(crate::cpu_tactics::chart_file(family));
            chart.draw(&out)?;
            written.push(out);
        }
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.sort();
    for json in files {
        let name = json.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("peer-llamacpp") && name.ends_with(".json") {
            let out = json.with_extension("svg");
            peer::draw_file(&json, &out)?;
            written.push(out);
        }
    }
    let step_time = dir.join("step-time.json");
    if step_time.exists() {
        let out = dir.join("step-time.svg");
        step_time::draw_file(&step_time, &out)?;
        written.push(out);
    }
    let out = dir.join(allreduce::CHART_FILE);
    allreduce::draw(&out)?;
    written.push(out);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_ticks_are_one_two_five_per_decade_or_decades_when_too_many() {
        assert_eq!(
            log_ticks(8.0, 600.0),
            vec![10.0, 20.0, 50.0, 100.0, 200.0, 500.0]
        );
        assert_eq!(
            log_ticks(1.0, 1e6),
            vec![1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6]
        );
        assert_eq!((nice_floor(17.0), nice_floor(0.3)), (10.0, 0.2));
        assert_eq!((nice_ceil(1142.0), nice_ceil(3.0)), (2000.0, 5.0));
    }

    #[test]
    fn number_labels_drop_a_meaningless_decimal_point() {
        let labels: Vec<String> = [1000.0, 1.0, 2.5, 0.5, 0.125, 12.345, 0.0]
            .into_iter()
            .map(number_label)
            .collect();
        assert_eq!(labels, ["1000", "1", "2.5", "0.5", "0.125", "12.3", "0"]);
    }

    #[test]
    fn a_long_title_wraps_within_the_canvas() {
        let title = "Measured tok/s on CPU, same random DeepSeek-V3 `mini` model, 2 threads \
                     (Intel(R) Xeon(R) Processor @ 2.80GHz (family 6h, model 6ah)), shared machine";
        let lines = wrap(title, 900.0, TITLE_PX);
        assert!(lines.len() >= 2, "{lines:?}");
        assert!(lines.iter().all(|l| text_width(l, TITLE_PX) <= 900.0));
        assert_eq!(
            lines.join(" "),
            title.split_whitespace().collect::<Vec<_>>().join(" ")
        );
    }

    #[test]
    fn series_beyond_the_palette_change_their_mark() {
        assert_eq!(series_style(0), (PALETTE[0], Marker::Circle));
        assert_eq!(series_style(10), (PALETTE[0], Marker::Triangle));
        assert_ne!(series_style(3), series_style(13));
    }
}

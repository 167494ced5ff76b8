//! The check that a chart's text is legible: every `<text>` of an SVG lies within the canvas
//! and no two overlap. Each text's box comes from its `x`, `y`, `dy`, `text-anchor`,
//! `font-size` and `transform="rotate(…)"` (as plotters' SVG backend writes them), its width
//! from [`super::text_width`].

use anyhow::{Context, Result, bail};

/// The box a text covers on the canvas, in pixels.
#[derive(Clone, Debug, PartialEq)]
pub struct TextBox {
    pub text: String,
    pub x0: f64,
    pub y0: f64,
    pub x1: f64,
    pub y1: f64,
}

impl TextBox {
    /// Whether the two boxes share more than `slack` pixels in both directions.
    fn overlaps(&self, other: &TextBox, slack: f64) -> bool {
        self.x0 + slack < other.x1
            && other.x0 + slack < self.x1
            && self.y0 + slack < other.y1
            && other.y0 + slack < self.y1
    }
}

/// Pixels two texts may share (anti-aliasing, the width estimate's rounding).
const SLACK: f64 = 1.0;

/// The canvas's size and the box of every non-empty text of `svg`.
pub fn text_boxes(svg: &str) -> Result<((f64, f64), Vec<TextBox>)> {
    let root = tag_at(svg, "<svg").context("no <svg> element")?;
    let width: f64 = attr(root, "width").context("<svg> has no width")?.parse()?;
    let height: f64 = attr(root, "height")
        .context("<svg> has no height")?
        .parse()?;
    let mut boxes = Vec::new();
    let mut rest = svg;
    while let Some(start) = rest.find("<text") {
        let after = &rest[start..];
        let open_end = after.find('>').context("unterminated <text>")?;
        let open = &after[..open_end];
        let close = after.find("</text>").context("<text> without </text>")?;
        let text = unescape(after[open_end + 1..close].trim());
        rest = &after[close + "</text>".len()..];
        if text.is_empty() {
            continue;
        }
        let num = |name: &str| -> Result<f64> {
            attr(open, name)
                .with_context(|| format!("<text> {text:?} has no {name}"))?
                .parse::<f64>()
                .with_context(|| format!("<text> {text:?}: {name}"))
        };
        let (x, y, size) = (num("x")?, num("y")?, num("font-size")?);
        let width = super::text_width(&text, size);
        // The baseline's offset from `y` (plotters: top 0.76em, centre 0.5ex, bottom -0.5ex;
        // an ex taken as half an em); the box spans 0.76em above the baseline, 0.24em below.
        let baseline = match attr(open, "dy").unwrap_or("0") {
            "0.76em" => 0.76 * size,
            "0.5ex" => 0.25 * size,
            "-0.5ex" => -0.25 * size,
            "0" => 0.0,
            other => bail!("<text> {text:?}: unknown dy {other}"),
        };
        let (dx0, dx1) = match attr(open, "text-anchor").unwrap_or("start") {
            "start" => (0.0, width),
            "middle" => (-width / 2.0, width / 2.0),
            "end" => (-width, 0.0),
            other => bail!("<text> {text:?}: unknown text-anchor {other}"),
        };
        let (dy0, dy1) = (baseline - 0.76 * size, baseline + 0.24 * size);
        // Offsets from (x, y) before the rotation about (x, y).
        let rotation = match attr(open, "transform") {
            None => 0,
            Some(t) => t
                .strip_prefix("rotate(")
                .and_then(|r| r.split(',').next())
                .and_then(|deg| deg.trim().parse::<i32>().ok())
                .with_context(|| format!("<text> {text:?}: unknown transform {t}"))?,
        };
        let turn = |(dx, dy): (f64, f64)| match rotation.rem_euclid(360) {
            0 => Ok((dx, dy)),
            90 => Ok((-dy, dx)),
            180 => Ok((-dx, -dy)),
            270 => Ok((dy, -dx)),
            r => Err(anyhow::anyhow!("<text> {text:?}: rotation by {r}°")),
        };
        let ((ax, ay), (bx, by)) = (turn((dx0, dy0))?, turn((dx1, dy1))?);
        boxes.push(TextBox {
            text,
            x0: x + ax.min(bx),
            y0: y + ay.min(by),
            x1: x + ax.max(bx),
            y1: y + ay.max(by),
        });
    }
    Ok(((width, height), boxes))
}

/// What makes `svg`'s text illegible: a text not wholly within the canvas, two texts that
/// overlap. Empty when there is nothing.
pub fn problems(svg: &str) -> Result<Vec<String>> {
    let ((width, height), boxes) = text_boxes(svg)?;
    let mut out = Vec::new();
    for b in &boxes {
        if b.x0 < -SLACK || b.y0 < -SLACK || b.x1 > width + SLACK || b.y1 > height + SLACK {
            out.push(format!(
                "{:?} ({:.0}..{:.0} × {:.0}..{:.0}) is clipped by the {width}×{height} canvas",
                b.text, b.x0, b.x1, b.y0, b.y1
            ));
        }
    }
    for (i, a) in boxes.iter().enumerate() {
        for b in &boxes[i + 1..] {
            if a.overlaps(b, SLACK) {
                out.push(format!(
                    "{:?} ({:.0}..{:.0} × {:.0}..{:.0}) overlaps {:?} ({:.0}..{:.0} × {:.0}..{:.0})",
                    a.text, a.x0, a.x1, a.y0, a.y1, b.text, b.x0, b.x1, b.y0, b.y1
                ));
            }
        }
    }
    Ok(out)
}

/// The opening tag that starts with `start`, up to its `>`.
fn tag_at<'a>(svg: &'a str, start: &str) -> Option<&'a str> {
    let at = svg.find(start)?;
    let end = svg[at..].find('>')?;
    Some(&svg[at..at + end])
}

/// The value of attribute `name` in an opening tag.
fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let at = tag.find(&key)? + key.len();
    let len = tag[at..].find('"')?;
    Some(&tag[at..at + len])
}

fn unescape(text: &str) -> String {
    text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svg(texts: &[&str]) -> String {
        let mut s = String::from(
            "<svg width=\"400\" height=\"200\" viewBox=\"0 0 400 200\" \
             xmlns=\"http://www.w3.org/2000/svg\">\n",
        );
        for t in texts {
            s.push_str(t);
            s.push('\n');
        }
        s + "</svg>\n"
    }

    #[test]
    fn separate_texts_inside_the_canvas_pass() {
        let good = svg(&[
            "<text x=\"200\" y=\"10\" dy=\"0.76em\" text-anchor=\"middle\" font-size=\"14\">A title</text>",
            "<text x=\"60\" y=\"100\" dy=\"0.5ex\" text-anchor=\"end\" font-size=\"10\">1000</text>",
            "<text x=\"15\" y=\"100\" dy=\"0.76em\" text-anchor=\"middle\" font-size=\"10\" \
             transform=\"rotate(270, 15, 100)\">tok/s</text>",
            "<text x=\"100\" y=\"60\" dy=\"0.76em\" text-anchor=\"start\" font-size=\"10\"></text>",
        ]);
        assert_eq!(problems(&good).unwrap(), Vec::<String>::new());
        let (_, boxes) = text_boxes(&good).unwrap();
        // The rotated label stands upright: taller than wide, centred on y.
        let rotated = &boxes[2];
        assert!(
            rotated.y1 - rotated.y0 > rotated.x1 - rotated.x0,
            "{rotated:?}"
        );
        assert!(
            (rotated.y0 + rotated.y1 - 200.0).abs() < 1e-9,
            "{rotated:?}"
        );
        assert_eq!(boxes.len(), 3, "empty texts are skipped");
    }

    #[test]
    fn a_clipped_title_and_overlapping_labels_are_reported() {
        let bad = svg(&[
            "<text x=\"200\" y=\"10\" dy=\"0.76em\" text-anchor=\"middle\" font-size=\"14\">\
             A title far too long for a canvas four hundred pixels wide, clipped at both ends</text>",
            "<text x=\"100\" y=\"100\" dy=\"0.76em\" text-anchor=\"start\" font-size=\"12\">winner: item 64k</text>",
            "<text x=\"140\" y=\"104\" dy=\"0.76em\" text-anchor=\"start\" font-size=\"12\">winner: item 16k</text>",
        ]);
        let found = problems(&bad).unwrap();
        assert_eq!(found.len(), 2, "{found:#?}");
        assert!(found[0].contains("clipped"), "{found:#?}");
        assert!(found[1].contains("overlaps"), "{found:#?}");
    }
}

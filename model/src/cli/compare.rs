//! `model compare-logits`: two `[T, vocab]` logits tensors side by side (another backend, a
//! golden), per position — the check `scripts/gpu-check.sh` runs on a device, where there is
//! no Python to do it.

use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::checkpoint::tensor_file::TensorFile;
use crate::exec::sampler::argmax;
use crate::input::InvalidInput;

/// Per-position agreement of a candidate's logits with a reference's.
#[derive(Clone, Debug, PartialEq)]
pub struct LogitsAgreement {
    pub positions: usize,
    pub vocab: usize,
    /// Relative L2 error of each position's row; infinite for a row holding a NaN or an
    /// infinity, so that no bound passes it.
    pub row_rel_l2: Vec<f64>,
    /// Positions whose argmax agrees (a row with a non-finite value never does).
    pub top1_agree: usize,
    /// Candidate values that are NaN or infinite.
    pub non_finite: usize,
}

impl LogitsAgreement {
    /// The largest position error. `f64::max` would skip a NaN, and a device returning NaN
    /// would then pass the gate.
    pub fn max(&self) -> f64 {
        self.row_rel_l2.iter().copied().fold(0.0, |worst, e| {
            if e.is_nan() {
                f64::INFINITY
            } else {
                worst.max(e)
            }
        })
    }

    pub fn median(&self) -> f64 {
        let mut v = self.row_rel_l2.clone();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    }

    /// Positions whose argmax agrees, as a fraction.
    pub fn top1(&self) -> f64 {
        self.top1_agree as f64 / self.positions.max(1) as f64
    }

    /// Whether these logits sit as close to the reference as `peer`'s (another backend's
    /// against the same reference): a median position error at most 1.5× the peer's and a
    /// top-1 agreement at most 0.2 below it. The device backends' criterion against HF's
    /// goldens beside the CPU backend (`compare-logits --as-close-as`, the executor tests).
    /// The top-1 margin is a GPU's: its FMA contraction and approximate `expf` flip near-tied
    /// NVFP4 codes of the random golden models (the host layer's `gpu-numerics` build: 8 of 20
    /// top-1 positions on `kimi-kernel-dims`' FP8 cache against the CPU's 11).
    pub fn as_close_as(&self, peer: &LogitsAgreement) -> bool {
        self.non_finite == 0
            && self.median() <= 1.5 * peer.median()
            && self.top1() >= peer.top1() - 0.2
    }

    /// Whether every position is finite and within `max_rel_l2` (itself finite: a NaN bound
    /// would pass anything, and the command line refuses one).
    pub fn within(&self, max_rel_l2: f64) -> bool {
        self.non_finite == 0 && max_rel_l2.is_finite() && self.max() <= max_rel_l2
    }

    pub fn summary(&self) -> String {
        let non_finite = match self.non_finite {
            0 => String::new(),
            n => format!("; {n} values NaN or infinite"),
        };
        format!(
            "{} positions × {} vocab: rel L2 per position median {:.3e}, max {:.3e}; top-1 {}/{}{non_finite}",
            self.positions,
            self.vocab,
            self.median(),
            self.max(),
            self.top1_agree,
            self.positions
        )
    }
}

/// Compares `candidate` with `reference`, both `[positions][vocab]` row-major. Shapes that
/// do not match, and a reference that is not finite, are refused as input.
pub fn compare(candidate: &[f32], reference: &[f32], vocab: usize) -> Result<LogitsAgreement> {
    if vocab == 0 || reference.len() != candidate.len() || !reference.len().is_multiple_of(vocab) {
        bail!(InvalidInput(format!(
            "{} candidate values against {} reference values in rows of {vocab}",
            candidate.len(),
            reference.len()
        )));
    }
    if let Some(at) = reference.iter().position(|y| !y.is_finite()) {
        bail!(InvalidInput(format!(
            "the reference holds {} at position {}, index {}: it cannot be a reference",
            reference[at],
            at / vocab,
            at % vocab
        )));
    }
    let rows = || {
        candidate
            .chunks_exact(vocab)
            .zip(reference.chunks_exact(vocab))
    };
    let finite = |row: &[f32]| row.iter().all(|x| x.is_finite());
    let row_rel_l2 = rows()
        .map(|(a, b)| {
            if !finite(a) {
                return f64::INFINITY;
            }
            let diff: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
            let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
            (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
        })
        .collect::<Vec<_>>();
    let top1_agree = rows()
        .filter(|(a, b)| finite(a) && argmax(a) == argmax(b))
        .count();
    Ok(LogitsAgreement {
        positions: row_rel_l2.len(),
        vocab,
        row_rel_l2,
        top1_agree,
        non_finite: candidate.iter().filter(|x| !x.is_finite()).count(),
    })
}

/// `FILE` or `FILE:TENSOR` (default tensor `logits`): its values and its row width.
pub fn read_logits(spec: &str) -> Result<(Vec<f32>, usize)> {
    let (path, tensor) = match spec.rsplit_once(':') {
        Some((p, t)) if !t.is_empty() && !t.contains('/') => (p, t),
        _ => (spec, "logits"),
    };
    let file = TensorFile::open(Path::new(path)).with_context(|| format!("opening {path}"))?;
    let info = file.info(tensor)?;
    let vocab = *info
        .shape
        .last()
        .with_context(|| format!("{path}: tensor {tensor} is a scalar, not [T, vocab] logits"))?;
    Ok((file.f32_values(tensor)?, vocab))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_rows_agree_and_a_moved_row_shows_its_error() {
        let reference = [1.0f32, 2.0, 3.0, 0.0, 5.0, 1.0];
        let same = compare(&reference, &reference, 3).unwrap();
        assert_eq!((same.max(), same.top1_agree), (0.0, 2));
        let mut moved = reference;
        moved[3] = 6.0;
        let c = compare(&moved, &reference, 3).unwrap();
        assert_eq!(c.row_rel_l2[0], 0.0);
        assert!((c.row_rel_l2[1] - 6.0 / 26f64.sqrt()).abs() < 1e-12);
        assert_eq!(c.top1_agree, 1);
        assert!(compare(&reference[..3], &reference, 3).is_err());
    }

    #[test]
    fn a_non_finite_candidate_fails_every_bound_and_a_non_finite_reference_is_refused() {
        let reference = [1.0f32, 2.0, 3.0, 0.0, 5.0, 1.0];
        let nan = [f32::NAN; 6];
        let c = compare(&nan, &reference, 3).unwrap();
        assert_eq!((c.non_finite, c.top1_agree), (6, 0));
        assert_eq!(c.max(), f64::INFINITY);
        assert!(!c.within(1e30));
        assert!(!c.as_close_as(&compare(&reference, &reference, 3).unwrap()));
        let mut one_inf = reference;
        one_inf[4] = f32::INFINITY;
        let c = compare(&one_inf, &reference, 3).unwrap();
        assert_eq!((c.row_rel_l2[0], c.non_finite), (0.0, 1));
        assert!(!c.within(f64::MAX));
        let same = compare(&reference, &reference, 3).unwrap();
        assert!(same.within(0.0) && !same.within(f64::NAN));
        let refused = compare(&reference, &nan, 3).unwrap_err();
        assert!(refused.is::<InvalidInput>(), "{refused}");
    }
}

//! Interleaved RoPE with YaRN frequency scaling, computed as HF transformers' DeepSeek-V3 does
//! (FP32 inverse frequencies, FP32 angles), so that logits agree with the reference.
//!
//! Its parameters are its own ([`RopeParams`], [`YarnScaling`]), below the config that parses
//! them: the config checks its values by computing their RoPE, and a
//! [`ModelConfig`](crate::arch::config::ModelConfig) converts into [`RopeParams`].

use serde::{Deserialize, Serialize};

/// YaRN RoPE scaling, as DeepSeek-V3 and Kimi use it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct YarnScaling {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
}

/// YaRN's attention-temperature correction `0.1 · m · ln(factor) + 1` (1 for factor ≤ 1).
pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

/// What RoPE is computed from: a model's `qk_rope_head_dim`, `rope_theta` and `rope_scaling`
/// (a `&ModelConfig` converts into it).
#[derive(Clone, Copy, Debug)]
pub struct RopeParams<'a> {
    /// Values rotated per head (`qk_rope_head_dim`).
    pub dim: usize,
    /// `rope_theta`.
    pub theta: f64,
    pub scaling: Option<&'a YarnScaling>,
}

#[derive(Clone, Debug)]
pub struct Rope {
    /// One inverse frequency per rotated pair.
    inv_freq: Vec<f32>,
    /// YaRN's cos/sin multiplier (1 when `mscale == mscale_all_dim`, as in Kimi).
    attention_factor: f32,
}

impl Rope {
    pub fn new<'a>(params: impl Into<RopeParams<'a>>) -> Self {
        let params = params.into();
        let dim = params.dim;
        let base = params.theta;
        let half = dim / 2;
        let pos_freqs: Vec<f32> = (0..half)
            .map(|i| (base as f32).powf((2 * i) as f32 / dim as f32))
            .collect();
        let Some(yarn) = params.scaling else {
            return Self {
                inv_freq: pos_freqs.iter().map(|p| 1.0 / p).collect(),
                attention_factor: 1.0,
            };
        };
        let factor = yarn.factor;
        let attention_factor = if yarn.mscale != 0.0 && yarn.mscale_all_dim != 0.0 {
            yarn_mscale(factor, yarn.mscale) / yarn_mscale(factor, yarn.mscale_all_dim)
        } else {
            yarn_mscale(factor, 1.0)
        };
        let correction_dim = |rotations: f64| {
            (dim as f64
                * (yarn.original_max_position_embeddings as f64
                    / (rotations * 2.0 * std::f64::consts::PI))
                    .ln())
                / (2.0 * base.ln())
        };
        let low = correction_dim(yarn.beta_fast).floor().max(0.0);
        let mut high = correction_dim(yarn.beta_slow).ceil().min((dim - 1) as f64);
        if low == high {
            high += 0.001;
        }
        let inv_freq = pos_freqs
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                let extrapolation_weight = 1.0 - ramp;
                let interpolated = 1.0 / (factor as f32 * p);
                let extrapolated = 1.0 / p;
                interpolated * (1.0 - extrapolation_weight) + extrapolated * extrapolation_weight
            })
            .collect();
        Self {
            inv_freq,
            attention_factor: attention_factor as f32,
        }
    }

    /// Whether every frequency and the scale are finite and the scale positive (what
    /// [`crate::arch::config`] requires of the values it accepts).
    pub fn is_finite(&self) -> bool {
        self.attention_factor.is_finite()
            && self.attention_factor > 0.0
            && self.inv_freq.iter().all(|f| f.is_finite())
    }

    /// One inverse frequency per rotated pair (what a device kernel is given).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The cos/sin multiplier.
    pub fn attention_factor(&self) -> f32 {
        self.attention_factor
    }

    /// Rotates `x` (`qk_rope_head_dim` values, pairs `(2i, 2i+1)`) for position `pos`, in place.
    #[inline]
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        self.apply_heads(x, x.len().max(1), pos);
    }

    /// [`Rope::apply`] to each `width`-value head of `x`, all at position `pos`: the angles'
    /// cosines and sines are computed once for all heads (the same values, so the same bits).
    pub fn apply_heads(&self, x: &mut [f32], width: usize, pos: usize) {
        self.apply_slices(x, 0, width, width, pos);
    }

    /// [`Rope::apply`] to the `width` values at `offset` of every `stride`-value head of `x`
    /// (the RoPE part of each head of a query row), all at position `pos`, the angles computed
    /// once for all heads.
    pub fn apply_slices(
        &self,
        x: &mut [f32],
        offset: usize,
        width: usize,
        stride: usize,
        pos: usize,
    ) {
        let pairs = (width / 2).min(self.inv_freq.len());
        let stride = stride.max(1);
        for (i, &freq) in self.inv_freq[..pairs].iter().enumerate() {
            let angle = pos as f32 * freq;
            let (cos, sin) = (
                angle.cos() * self.attention_factor,
                angle.sin() * self.attention_factor,
            );
            for head in x.chunks_mut(stride) {
                if let Some(pair) = head.get_mut(offset + 2 * i..offset + 2 * i + 2) {
                    let (a, b) = (pair[0], pair[1]);
                    pair[0] = a * cos - b * sin;
                    pair[1] = b * cos + a * sin;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kimi's RoPE part: 64 values per head, `rope_theta` 50000.
    fn params(yarn: Option<&YarnScaling>) -> RopeParams<'_> {
        RopeParams {
            dim: 64,
            theta: 50000.0,
            scaling: yarn,
        }
    }

    #[test]
    fn rotation_preserves_norm_and_relative_positions() {
        let rope = Rope::new(params(None));
        let q: Vec<f32> = (0..64).map(|i| (i as f32 * 0.3).sin()).collect();
        let k: Vec<f32> = (0..64).map(|i| (i as f32 * 0.7).cos()).collect();
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        let at = |v: &[f32], p| {
            let mut v = v.to_vec();
            rope.apply(&mut v, p);
            v
        };
        assert!((dot(&at(&q, 5), &at(&q, 5)) - dot(&q, &q)).abs() < 1e-3);
        assert!((dot(&at(&q, 10), &at(&k, 7)) - dot(&at(&q, 103), &at(&k, 100))).abs() < 1e-3);
    }

    #[test]
    fn heads_rotated_together_get_the_bits_of_each_alone() {
        let rope = Rope::new(params(None));
        let heads: Vec<f32> = (0..3 * 64).map(|i| (i as f32 * 0.37).cos() * 3.0).collect();
        for pos in [0, 1, 17, 4095, 100_000] {
            let mut together = heads.clone();
            rope.apply_heads(&mut together, 64, pos);
            let mut alone = heads.clone();
            for head in alone.chunks_exact_mut(64) {
                rope.apply(head, pos);
            }
            assert_eq!(
                together.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "position {pos}"
            );
            if pos > 0 {
                assert_ne!(together, heads, "position {pos} rotated nothing");
            }
        }
    }

    #[test]
    fn kimi_yarn_keeps_fast_dims_and_stretches_slow_ones() {
        let yarn = YarnScaling {
            factor: 64.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        };
        let plain = Rope::new(params(None));
        let scaled = Rope::new(params(Some(&yarn)));
        assert_eq!(scaled.attention_factor, 1.0);
        assert_eq!(scaled.inv_freq[0], plain.inv_freq[0]);
        let last = plain.inv_freq.len() - 1;
        assert!(
            (scaled.inv_freq[last] * 64.0 - plain.inv_freq[last]).abs()
                < 1e-6 * plain.inv_freq[last]
        );
    }
}

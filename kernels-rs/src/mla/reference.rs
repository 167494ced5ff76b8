//! CPU reference of absorbed MLA attention over the paged latent cache.
//!
//! FP32 throughout, two passes over the keys (scores, then softmax-weighted latent sum): the
//! plainest correct version, against which faster CPU and GPU kernels are checked.

use rayon::prelude::*;

use super::cache::{CacheError, PagedLatentCache, SeqId};

/// One query row: the sequence it belongs to and how many cached tokens it attends to
/// (`context` = its own position + 1 for causal attention).
#[derive(Clone, Copy, Debug)]
pub struct AttentionQuery {
    pub seq: SeqId,
    pub context: usize,
}

/// Query and output tensors of one attention call, for `queries.len()` rows and `heads` heads.
pub struct MlaProblem<'a> {
    pub layer: usize,
    pub heads: usize,
    pub queries: &'a [AttentionQuery],
    /// `[rows, heads, latent_dim]`
    pub q_abs: &'a [f32],
    /// `[rows, heads, rope_dim]`
    pub q_pe: &'a [f32],
    pub softmax_scale: f32,
}

impl MlaProblem<'_> {
    /// Checks the tensor sizes against the cache's shape and returns, per query row, the
    /// physical cache slots of the tokens it attends to.
    pub fn slots(
        &self,
        cache: &PagedLatentCache,
        out: &[f32],
        lse: &[f32],
    ) -> Result<Vec<Vec<usize>>, CacheError> {
        let shape = cache.shape();
        let (l, r, h) = (shape.latent_dim, shape.rope_dim, self.heads);
        let rows = self.queries.len();
        assert_eq!(
            self.q_abs.len(),
            rows * h * l,
            "q_abs is not [{rows}, {h}, {l}]"
        );
        assert_eq!(
            self.q_pe.len(),
            rows * h * r,
            "q_pe is not [{rows}, {h}, {r}]"
        );
        assert_eq!(out.len(), rows * h * l, "out is not [{rows}, {h}, {l}]");
        assert_eq!(lse.len(), rows * h, "lse is not [{rows}, {h}]");
        self.queries
            .iter()
            .map(|q| cache.slots(q.seq, q.context))
            .collect()
    }
}

/// Computes `out[row, h] = Σ_t softmax_t(score) · c_t` (`[rows, heads, latent_dim]`) and the
/// log-sum-exp of the scaled scores (`[rows, heads]`).
pub fn mla_attention_reference(
    cache: &PagedLatentCache,
    problem: &MlaProblem<'_>,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<(), CacheError> {
    let shape = cache.shape();
    let (l, r, h) = (shape.latent_dim, shape.rope_dim, problem.heads);
    let slots = problem.slots(cache, out, lse)?;

    out.par_chunks_mut(h * l)
        .zip(lse.par_chunks_mut(h))
        .enumerate()
        .for_each(|(row, (out_row, lse_row))| {
            let q_abs = &problem.q_abs[row * h * l..(row + 1) * h * l];
            let q_pe = &problem.q_pe[row * h * r..(row + 1) * h * r];
            let context = slots[row].len();
            let mut scores = vec![0.0f32; h * context];
            let (mut latent, mut rope) = (vec![0.0f32; l], vec![0.0f32; r]);
            for (t, &slot) in slots[row].iter().enumerate() {
                cache.read_slot(problem.layer, slot, &mut latent, &mut rope);
                for head in 0..h {
                    let s = dot(&q_abs[head * l..(head + 1) * l], &latent)
                        + dot(&q_pe[head * r..(head + 1) * r], &rope);
                    scores[head * context + t] = s * problem.softmax_scale;
                }
            }
            for head in 0..h {
                let row_scores = &mut scores[head * context..(head + 1) * context];
                let max = row_scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                let mut sum = 0.0f32;
                for s in row_scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                for s in row_scores.iter_mut() {
                    *s /= sum;
                }
                lse_row[head] = max + sum.ln();
            }
            out_row.fill(0.0);
            for (t, &slot) in slots[row].iter().enumerate() {
                cache.read_slot(problem.layer, slot, &mut latent, &mut rope);
                for head in 0..h {
                    let p = scores[head * context + t];
                    for (o, &c) in out_row[head * l..(head + 1) * l].iter_mut().zip(&latent) {
                        *o += p * c;
                    }
                }
            }
        });
    Ok(())
}

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mla::cache::{KvCacheDtype, LatentCacheShape};

    /// Attention computed the non-paged way, straight from the written values.
    fn dense_attention(
        keys: &[(Vec<f32>, Vec<f32>)],
        q_abs: &[f32],
        q_pe: &[f32],
        scale: f32,
    ) -> Vec<f32> {
        let scores: Vec<f32> = keys
            .iter()
            .map(|(c, k)| (dot(q_abs, c) + dot(q_pe, k)) * scale)
            .collect();
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f32 = weights.iter().sum();
        let mut out = vec![0.0; q_abs.len()];
        for (w, (c, _)) in weights.iter().zip(keys) {
            for (o, v) in out.iter_mut().zip(c) {
                *o += w / sum * v;
            }
        }
        out
    }

    #[test]
    fn paged_attention_equals_dense_attention_across_page_boundaries() {
        let shape = LatentCacheShape {
            layers: 1,
            latent_dim: 16,
            rope_dim: 4,
        };
        let mut cache = PagedLatentCache::new(shape, KvCacheDtype::Bf16, 8);
        let _other = cache.add_sequence();
        let seq = cache.add_sequence();
        let value =
            |i: usize| half::bf16::from_f32(((i * 7919 % 1000) as f32 / 500.0) - 1.0).to_f32();
        let n = 130;
        cache.reserve(seq, n).unwrap();
        let mut keys = Vec::new();
        for t in 0..n {
            let c: Vec<f32> = (0..16).map(|i| value(t * 31 + i)).collect();
            let k: Vec<f32> = (0..4).map(|i| value(t * 17 + i + 5)).collect();
            cache.write(0, seq, t, &c, &k).unwrap();
            keys.push((c, k));
        }
        cache.commit(seq, n).unwrap();
        let q_abs: Vec<f32> = (0..32).map(|i| value(i + 3)).collect();
        let q_pe: Vec<f32> = (0..8).map(|i| value(i + 99)).collect();
        for context in [1, 63, 64, 65, 128, 130] {
            let queries = [AttentionQuery { seq, context }];
            let problem = MlaProblem {
                layer: 0,
                heads: 2,
                queries: &queries,
                q_abs: &q_abs,
                q_pe: &q_pe,
                softmax_scale: 0.3,
            };
            let (mut out, mut lse) = (vec![0.0; 32], vec![0.0; 2]);
            mla_attention_reference(&cache, &problem, &mut out, &mut lse).unwrap();
            for head in 0..2 {
                let expected = dense_attention(
                    &keys[..context],
                    &q_abs[head * 16..(head + 1) * 16],
                    &q_pe[head * 4..(head + 1) * 4],
                    0.3,
                );
                for (a, b) in out[head * 16..(head + 1) * 16].iter().zip(&expected) {
                    assert!((a - b).abs() < 1e-5, "context {context}: {a} vs {b}");
                }
            }
        }
    }
}

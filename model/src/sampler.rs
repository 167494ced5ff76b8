//! Token sampling: greedy, or temperature with top-k and top-p, from a seeded ChaCha stream so
//! that a seed reproduces a run exactly.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// Refuses values that would sample from NaN probabilities or an empty nucleus.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!(
                "--temperature {}: it must be a finite number >= 0 (0 = greedy)",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!(
                "--top-p {}: it must lie in (0, 1] (1 = no nucleus cut)",
                self.top_p
            ));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if self.params.top_k > 0 {
            order.truncate(self.params.top_k);
        }
        let max = logits[order[0]];
        let mut probs: Vec<f32> = order
            .iter()
            .map(|&i| ((logits[i] - max) / self.params.temperature).exp())
            .collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.params.top_p < 1.0 {
            let mut cumulative = 0.0;
            let keep = probs
                .iter()
                .position(|&p| {
                    cumulative += p;
                    cumulative >= self.params.top_p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            let kept: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= kept);
        }
        let draw: f32 = self.rng.random();
        let mut cumulative = 0.0;
        for (p, &i) in probs.iter().zip(&order) {
            cumulative += p;
            if draw < cumulative {
                return i as u32;
            }
        }
        order[probs.len() - 1] as u32
    }
}

/// Index of the largest logit, the first one on ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_top_k_one_and_seeded_runs_are_deterministic() {
        let logits = [0.1, 2.0, 1.9, -1.0, 2.0];
        assert_eq!(Sampler::new(SamplingParams::greedy()).sample(&logits), 1);
        let top1 = SamplingParams {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: 3,
        };
        assert_eq!(Sampler::new(top1).sample(&logits), 1);
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.9,
            seed: 42,
        };
        let run = |p| {
            let mut s = Sampler::new(p);
            (0..32).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(params), run(params));
        assert_ne!(run(params), run(SamplingParams { seed: 43, ..params }));
        assert!(
            !run(params).contains(&3),
            "top-p 0.9 must cut the unlikely token"
        );
    }

    #[test]
    fn frequencies_follow_the_softmax() {
        let logits = [0.0f32, (3.0f32).ln()];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 7,
        });
        let ones = (0..4000).filter(|_| s.sample(&logits) == 1).count();
        assert!((ones as f32 / 4000.0 - 0.75).abs() < 0.03, "{ones}");
    }
}

//! Token sampling: greedy, or temperature with top-k and top-p. A draw is a pure function of
//! the logits and a [`SampleRow`] — the parameters plus the sequence's seed and the draw's
//! index, fed to a counter-based generator (Philox) — so a seed reproduces a run exactly, and
//! the CPU and the device (`sample_rows`) draw the same token from the same logits: both run
//! [`kernels::layers::sampling`]'s definition.

pub use kernels::layers::sampling::{SampleRow, greedy as argmax, sample_row};

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

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
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

/// One sequence's draws: its parameters and how many tokens it has drawn.
pub struct Sampler {
    params: SamplingParams,
    draws: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self { params, draws: 0 }
    }

    /// The parameters of the next draw (and counts it): what the device sampler is given.
    pub fn next_row(&mut self) -> SampleRow {
        let row = self.peek_row();
        self.draws += 1;
        row
    }

    /// The parameters of the next draw, without counting it (a step that draws a token nobody
    /// takes: a prompt's row before its last chunk).
    pub fn peek_row(&self) -> SampleRow {
        SampleRow {
            temperature: self.params.temperature,
            // Beyond i32::MAX the cut keeps everything, as no cut does.
            top_k: i32::try_from(self.params.top_k).unwrap_or(0),
            top_p: self.params.top_p,
            reserved: 0,
            seed: self.params.seed,
            counter: self.draws,
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let row = self.next_row();
        sample_row(logits, &row)
    }
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

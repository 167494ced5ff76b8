//! Token sampling: greedy, or temperature with top-k and top-p. A draw is a pure function of
//! the logits and a [`SampleRow`] — the parameters plus the sequence's seed and the draw's
//! index, fed to a counter-based generator (Philox) — so a seed reproduces a run exactly, and
//! the CPU and the device (`sample_rows`) draw the same token from the same logits: both run
//! [`kernels::layers::sampling`]'s definition.
//!
//! What the device's sampler does not do runs on the host, before that same draw
//! ([`HostSampling`]): vLLM's repetition, frequency and presence penalties, `min_tokens`, and
//! the logprobs of each drawn token (of the raw logits, as vLLM's default `raw_logprobs`).

use std::collections::{HashMap, HashSet};

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

/// What a sequence's draws do on the host, past the device's sampler (vLLM's sampling
/// parameters of the same names). The default does nothing: such a sequence draws where its
/// logits are.
#[derive(Clone, Debug, PartialEq)]
pub struct HostSampling {
    /// Over prompt and output tokens: their positive logits are divided by it, their negative
    /// ones multiplied. 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted from an output token's logit once per time it was drawn. 0 is off.
    pub frequency_penalty: f32,
    /// Subtracted from an output token's logit once it was drawn at all. 0 is off.
    pub presence_penalty: f32,
    /// The stop tokens cannot be drawn before this many tokens are.
    pub min_tokens: usize,
    /// The logprobs of each drawn token and of this many most likely ones; `None`: none.
    pub logprobs: Option<usize>,
}

impl Default for HostSampling {
    fn default() -> Self {
        Self {
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            min_tokens: 0,
            logprobs: None,
        }
    }
}

impl HostSampling {
    fn penalizes(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }
}

/// A drawn token's log-probability and the most likely tokens', under the model's raw logits.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens, most likely first (the lower id first on ties).
    pub top: Vec<(u32, f32)>,
}

/// One draw: the token, with its logprobs where they were asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Drawn {
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

/// `log_softmax(logits)[token]` for `token` and the `top` most likely tokens. The sum runs in
/// f64 so a long row loses nothing to rounding.
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .map(|&l| (f64::from(l) - f64::from(max)).exp())
        .sum();
    let log_sum = f64::from(max) + sum.ln();
    let logprob = |id: u32| (f64::from(logits[id as usize]) - log_sum) as f32;
    TokenLogprobs {
        token,
        logprob: logprob(token),
        top: most_likely(logits, top)
            .into_iter()
            .map(|id| (id, logprob(id)))
            .collect(),
    }
}

/// The ids of the `n` largest logits, largest first, the lower id first on ties (NaNs last).
fn most_likely(logits: &[f32], n: usize) -> Vec<u32> {
    // Ordered by logit descending, then id ascending; a handful kept, so a row is one pass.
    let before = |a: (f32, u32), b: (f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    let key = |id: usize| {
        let l = logits[id];
        (if l.is_nan() { f32::NEG_INFINITY } else { l }, id as u32)
    };
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(n + 1);
    for id in 0..logits.len() {
        let candidate = key(id);
        if best.len() == n
            && best
                .last()
                .is_none_or(|&worst| before(worst, candidate).is_lt())
        {
            continue;
        }
        let at = best.partition_point(|&b| before(b, candidate).is_lt());
        best.insert(at, candidate);
        best.truncate(n);
    }
    best.into_iter().map(|(_, id)| id).collect()
}

/// One sequence's draws: its parameters, how many tokens it has drawn, and what the host does
/// before a draw ([`HostSampling`]) with what it needs for that: the prompt's tokens and the
/// output's counts.
pub struct Sampler {
    params: SamplingParams,
    draws: u64,
    host: HostSampling,
    stop_ids: Vec<u32>,
    /// The prompt's distinct tokens (for the repetition penalty).
    prompt_tokens: HashSet<u32>,
    /// How often each token was drawn.
    output_counts: HashMap<u32, u32>,
    generated: usize,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self::with_host(params, HostSampling::default(), &[], &[])
    }

    /// A sampler that also applies `host` to its draws: penalties over `prompt` and the output,
    /// `stop_ids` held off until `min_tokens`.
    pub fn with_host(
        params: SamplingParams,
        host: HostSampling,
        prompt: &[u32],
        stop_ids: &[u32],
    ) -> Self {
        let prompt_tokens = if host.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Self {
            params,
            draws: 0,
            host,
            stop_ids: stop_ids.to_vec(),
            prompt_tokens,
            output_counts: HashMap::new(),
            generated: 0,
        }
    }

    /// Whether the next draw needs the logits on the host ([`draw`](Self::draw)): a penalty,
    /// stop tokens still held off, or logprobs. Otherwise the device's draw
    /// ([`next_row`](Self::next_row), then [`accept`](Self::accept)) is the same.
    pub fn needs_logits(&self) -> bool {
        self.host.logprobs.is_some()
            || self.host.penalizes()
            || (self.generated < self.host.min_tokens && !self.stop_ids.is_empty())
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

    /// Records a token drawn elsewhere under [`next_row`](Self::next_row)'s parameters (the
    /// penalties and `min_tokens` count it).
    pub fn accept(&mut self, token: u32) {
        self.generated += 1;
        if self.host.penalizes() {
            *self.output_counts.entry(token).or_default() += 1;
        }
    }

    /// Draws from one row of raw logits: the logprobs of the raw logits if asked for, then the
    /// penalties and the `min_tokens` mask, then [`sample_row`] under the next draw's
    /// parameters.
    pub fn draw(&mut self, logits: &[f32]) -> Drawn {
        let processed = self.process(logits);
        let row = self.next_row();
        let token = sample_row(processed.as_deref().unwrap_or(logits), &row);
        self.accept(token);
        Drawn {
            token,
            logprobs: self
                .host
                .logprobs
                .map(|top| token_logprobs(logits, token, top)),
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.draw(logits).token
    }

    /// The logits the draw sees, where the penalties or the `min_tokens` mask change them
    /// (vLLM's order: repetition, frequency, presence, then the mask).
    fn process(&self, logits: &[f32]) -> Option<Vec<f32>> {
        let hold_stops = self.generated < self.host.min_tokens && !self.stop_ids.is_empty();
        if !self.host.penalizes() && !hold_stops {
            return None;
        }
        let mut out = logits.to_vec();
        let repetition = self.host.repetition_penalty;
        if repetition != 1.0 {
            // Each token once, whether it is in the prompt, the output or both.
            let output_only = self
                .output_counts
                .keys()
                .filter(|id| !self.prompt_tokens.contains(id));
            for &id in self.prompt_tokens.iter().chain(output_only) {
                if let Some(l) = out.get_mut(id as usize) {
                    *l = if *l > 0.0 {
                        *l / repetition
                    } else {
                        *l * repetition
                    };
                }
            }
        }
        for (&id, &count) in &self.output_counts {
            if let Some(l) = out.get_mut(id as usize) {
                *l -= self.host.frequency_penalty * count as f32;
                *l -= self.host.presence_penalty;
            }
        }
        if hold_stops {
            let kept = |out: &[f32]| {
                out.iter()
                    .enumerate()
                    .any(|(id, &l)| l > f32::NEG_INFINITY && !self.stop_ids.contains(&(id as u32)))
            };
            // A row whose only drawable tokens are stop tokens keeps them: a draw needs one.
            if kept(&out) {
                for &id in &self.stop_ids {
                    if let Some(l) = out.get_mut(id as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
        Some(out)
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

    /// A row of logits from a small LCG, spread over [-8, 8).
    fn pseudo_logits(vocab: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..vocab)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0
            })
            .collect()
    }

    /// `log_softmax(logits)[id]`, in f64 from the definition.
    fn reference_logprob(logits: &[f32], id: usize) -> f64 {
        let sum: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        f64::from(logits[id]) - sum.ln()
    }

    #[test]
    fn a_host_draw_without_penalties_is_the_device_draw() {
        // Logprobs and a finished min_tokens send draws to the host; the token must be the one
        // `sample_row` (what `sample_rows` on a device computes) draws for the same counter.
        for (case, (temperature, top_k, top_p)) in [
            (0.0, 0, 1.0),
            (0.7, 0, 1.0),
            (1.0, 5, 1.0),
            (1.3, 0, 0.8),
            (0.9, 40, 0.95),
        ]
        .into_iter()
        .enumerate()
        {
            let params = SamplingParams {
                temperature,
                top_k,
                top_p,
                seed: 1000 + case as u64,
            };
            let host = HostSampling {
                logprobs: Some(2),
                min_tokens: 0,
                ..HostSampling::default()
            };
            let mut sampler = Sampler::with_host(params, host, &[1, 2, 3], &[7]);
            assert!(sampler.needs_logits());
            for counter in 0..20u64 {
                let logits = pseudo_logits(300, counter * 31 + case as u64);
                let want = sample_row(
                    &logits,
                    &SampleRow {
                        temperature,
                        top_k: top_k as i32,
                        top_p,
                        reserved: 0,
                        seed: params.seed,
                        counter,
                    },
                );
                assert_eq!(
                    sampler.draw(&logits).token,
                    want,
                    "case {case} draw {counter}"
                );
            }
        }
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() {
        let logits = [2.0f32, -1.0, 0.5, 1.5, -0.5];
        let host = HostSampling {
            repetition_penalty: 2.0,
            ..HostSampling::default()
        };
        // Token 0 and 1 are in the prompt; token 4 will be drawn into the output.
        let mut sampler = Sampler::with_host(SamplingParams::greedy(), host, &[0, 1, 0], &[]);
        assert!(sampler.needs_logits());
        let processed = sampler.process(&logits).unwrap();
        // Seen: 2 (positive) divided by 2, -1 (negative) multiplied by 2; unseen: as they were.
        let want: Vec<f64> = vec![1.0, -2.0, 0.5, 1.5, -0.5];
        for (id, (&got, want)) in processed.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(got) - want).abs() < 1e-6,
                "token {id}: {got} vs {want}"
            );
        }
        // Without the penalty token 0 wins; with it token 3 does.
        assert_eq!(argmax(&logits), 0);
        assert_eq!(sampler.draw(&logits).token, 3);
        sampler.accept(4);
        let processed = sampler.process(&logits).unwrap();
        assert!((f64::from(processed[4]) - (-0.5 * 2.0)).abs() < 1e-6);
        // Token 3 was drawn once: penalized once, not per occurrence.
        assert!((f64::from(processed[3]) - 1.5 / 2.0).abs() < 1e-6);
    }

    #[test]
    fn frequency_and_presence_penalties_follow_the_output_counts() {
        // Quarters, so every adjusted logit is exact and ties are ties.
        let logits = [1.0f32, 0.75, 0.5, 0.0];
        let host = HostSampling {
            frequency_penalty: 0.25,
            presence_penalty: 0.5,
            ..HostSampling::default()
        };
        let mut sampler = Sampler::with_host(SamplingParams::greedy(), host.clone(), &[0], &[]);
        let drawn: Vec<u32> = (0..6).map(|_| sampler.draw(&logits).token).collect();
        // By hand: logit - 0.25·count - 0.5·(count > 0), the first maximum drawn:
        // [1, .75, .5, 0] → 0; [.25, .75, .5, 0] → 1; [.25, 0, .5, 0] → 2;
        // [.25, 0, -.25, 0] → 0; [0, 0, -.25, 0] → 0; [-.25, 0, -.25, 0] → 1.
        assert_eq!(drawn, [0, 1, 2, 0, 0, 1]);
        // The prompt is not an output: token 0 of the prompt was not penalized by either.
        let fresh = Sampler::with_host(SamplingParams::greedy(), host.clone(), &[0], &[]);
        assert_eq!(fresh.process(&logits).unwrap(), logits);
        // Negative penalties reward repeats.
        let mut repeat = Sampler::with_host(
            SamplingParams::greedy(),
            HostSampling {
                frequency_penalty: -0.25,
                presence_penalty: 0.0,
                ..host
            },
            &[],
            &[],
        );
        let drawn: Vec<u32> = (0..4).map(|_| repeat.draw(&logits).token).collect();
        assert_eq!(drawn, [0, 0, 0, 0]);
        let counted = repeat.process(&logits).unwrap();
        assert!((f64::from(counted[0]) - (1.0 + 0.25 * 4.0)).abs() < 1e-6);
    }

    #[test]
    fn min_tokens_holds_the_stop_tokens_off() {
        let logits = [0.5f32, 1.0, 3.0, 2.0];
        let host = HostSampling {
            min_tokens: 3,
            ..HostSampling::default()
        };
        let mut sampler = Sampler::with_host(SamplingParams::greedy(), host.clone(), &[], &[2, 3]);
        let mut drawn = Vec::new();
        while sampler.needs_logits() {
            drawn.push(sampler.draw(&logits).token);
        }
        // Stop tokens 2 and 3 masked: token 1 three times, then the device's draw (token 2).
        assert_eq!(drawn, [1, 1, 1]);
        assert_eq!(sampler.process(&logits), None);
        assert_eq!(sampler.draw(&logits).token, 2);
        // At a temperature too: a masked token is never drawn.
        let mut hot = Sampler::with_host(
            SamplingParams {
                temperature: 1.5,
                top_k: 0,
                top_p: 1.0,
                seed: 9,
            },
            HostSampling {
                min_tokens: 200,
                ..host.clone()
            },
            &[],
            &[2, 3],
        );
        assert!((0..200).all(|_| hot.draw(&logits).token < 2));
        // A row of stop tokens only keeps them.
        let mut only_stops = Sampler::with_host(SamplingParams::greedy(), host, &[], &[0, 1, 2, 3]);
        assert_eq!(only_stops.draw(&logits).token, 2);
        // Without stop tokens (ignore_eos) nothing is held off, and the device draws.
        let free = Sampler::with_host(
            SamplingParams::greedy(),
            HostSampling {
                min_tokens: 3,
                ..HostSampling::default()
            },
            &[],
            &[],
        );
        assert!(!free.needs_logits());
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax_with_the_top_tokens_by_id_on_ties() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, 0.5];
        let drawn = Sampler::with_host(
            SamplingParams::greedy(),
            HostSampling {
                logprobs: Some(3),
                // Pushes the draw off token 1; the logprobs stay the model's.
                repetition_penalty: 4.0,
                ..HostSampling::default()
            },
            &[1],
            &[],
        )
        .draw(&logits);
        assert_eq!(drawn.token, 2);
        let logprobs = drawn.logprobs.unwrap();
        assert_eq!(logprobs.token, 2);
        assert!((f64::from(logprobs.logprob) - reference_logprob(&logits, 2)).abs() < 1e-6);
        let ids: Vec<u32> = logprobs.top.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, [1, 2, 0]);
        for &(id, lp) in &logprobs.top {
            let want = reference_logprob(&logits, id as usize);
            assert!((f64::from(lp) - want).abs() < 1e-6, "{id}: {lp} vs {want}");
        }
        // A long row: the probabilities sum to 1, the top list is the sorted head.
        let long = pseudo_logits(5000, 3);
        let all = token_logprobs(&long, 0, long.len());
        let mass: f64 = all.top.iter().map(|&(_, lp)| f64::from(lp).exp()).sum();
        assert!((mass - 1.0).abs() < 1e-4, "{mass}");
        let mut by_hand: Vec<u32> = (0..long.len() as u32).collect();
        by_hand.sort_by(|&a, &b| {
            long[b as usize]
                .total_cmp(&long[a as usize])
                .then(a.cmp(&b))
        });
        let top20 = token_logprobs(&long, 0, 20);
        assert_eq!(
            top20.top.iter().map(|&(id, _)| id).collect::<Vec<_>>(),
            by_hand[..20]
        );
        assert!(token_logprobs(&long, 0, 0).top.is_empty());
        assert!(token_logprobs(&long, 7, 0).logprob <= 0.0);
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

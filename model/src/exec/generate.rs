//! The decode loop: prefill every request, then decode one token per live sequence per step,
//! batched, until each hits an EOS id or its token budget.

use std::time::{Duration, Instant};

use super::error::ExecError;
use super::ops::SeqInput;
use super::runner::ModelRunner;
use super::sampler::{SampleRow, Sampler, SamplingParams};
use crate::arch::config::ModelConfig;

#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
}

impl GenerationRequest {
    /// Refuses a request the model cannot serve: an empty prompt, a token outside the
    /// vocabulary, more positions than the context holds (saying how many new tokens fit), or
    /// sampling parameters out of range.
    pub fn validate(&self, config: &ModelConfig) -> Result<(), String> {
        if self.prompt.is_empty() {
            return Err("the prompt is empty".into());
        }
        if let Some(&token) = self
            .prompt
            .iter()
            .find(|&&t| t as usize >= config.vocab_size)
        {
            return Err(format!(
                "prompt token {token} is outside the vocabulary of {}",
                config.vocab_size
            ));
        }
        if self.max_new_tokens == 0 {
            return Err("--max-new-tokens 0: nothing to generate".into());
        }
        let context = config.max_position_embeddings;
        let prompt = self.prompt.len();
        if prompt.saturating_add(self.max_new_tokens) > context {
            return Err(if prompt >= context {
                format!(
                    "a {prompt}-token prompt leaves no room to generate in the context of {context} tokens (max_position_embeddings)"
                )
            } else {
                format!(
                    "--max-new-tokens {} after a {prompt}-token prompt exceeds the context of {context} tokens (max_position_embeddings): at most {} new tokens fit",
                    self.max_new_tokens,
                    context - prompt
                )
            });
        }
        self.sampling.validate()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    Length,
}

#[derive(Clone, Debug)]
pub struct GenerationResult {
    pub tokens: Vec<u32>,
    pub stop: StopReason,
}

/// Wall-clock split between prefill and decode.
#[derive(Clone, Copy, Debug, Default)]
pub struct GenerationTiming {
    pub prefill_tokens: usize,
    pub prefill_time: Duration,
    pub decode_tokens: usize,
    pub decode_steps: usize,
    pub decode_time: Duration,
}

impl GenerationTiming {
    pub fn prefill_tokens_per_second(&self) -> f64 {
        self.prefill_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    pub fn decode_tokens_per_second(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Runs every request to completion on `runner`; `on_token(request, token)` sees tokens as
/// they come.
pub fn generate(
    runner: &mut dyn ModelRunner,
    requests: &[GenerationRequest],
    mut on_token: impl FnMut(usize, u32),
) -> Result<(Vec<GenerationResult>, GenerationTiming), ExecError> {
    for request in requests {
        request
            .validate(runner.config())
            .map_err(ExecError::InvalidRequest)?;
    }
    let eos = runner.config().eos_token_ids.clone();
    let mut timing = GenerationTiming::default();
    let mut samplers: Vec<Sampler> = requests.iter().map(|r| Sampler::new(r.sampling)).collect();
    let mut results: Vec<GenerationResult> = requests
        .iter()
        .map(|_| GenerationResult {
            tokens: Vec::new(),
            stop: StopReason::Length,
        })
        .collect();
    let seqs: Vec<_> = requests.iter().map(|_| runner.add_sequence()).collect();
    let mut live: Vec<usize> = Vec::new();

    let start = Instant::now();
    for (i, request) in requests.iter().enumerate() {
        if request.max_new_tokens == 0 || request.prompt.is_empty() {
            continue;
        }
        let token = runner.step(
            &[SeqInput {
                seq: seqs[i],
                tokens: &request.prompt,
            }],
            &[samplers[i].next_row()],
        )?[0];
        timing.prefill_tokens += request.prompt.len();
        results[i].tokens.push(token);
        on_token(i, token);
        if eos.contains(&token) {
            results[i].stop = StopReason::Eos;
        } else if results[i].tokens.len() < request.max_new_tokens {
            live.push(i);
        }
    }
    timing.prefill_time = start.elapsed();

    let start = Instant::now();
    while !live.is_empty() {
        let last: Vec<[u32; 1]> = live
            .iter()
            .map(|&i| [*results[i].tokens.last().expect("prefilled")])
            .collect();
        let inputs: Vec<SeqInput<'_>> = live
            .iter()
            .zip(&last)
            .map(|(&i, token)| SeqInput {
                seq: seqs[i],
                tokens: token,
            })
            .collect();
        let draws: Vec<SampleRow> = live.iter().map(|&i| samplers[i].next_row()).collect();
        let tokens = runner.step(&inputs, &draws)?;
        timing.decode_steps += 1;
        timing.decode_tokens += live.len();
        let mut still_live = Vec::with_capacity(live.len());
        for (&token, &i) in tokens.iter().zip(&live) {
            results[i].tokens.push(token);
            on_token(i, token);
            if eos.contains(&token) {
                results[i].stop = StopReason::Eos;
            } else if results[i].tokens.len() < requests[i].max_new_tokens {
                still_live.push(i);
            }
        }
        live = still_live;
    }
    timing.decode_time = start.elapsed();
    for seq in seqs {
        runner.free_sequence(seq)?;
    }
    Ok((results, timing))
}

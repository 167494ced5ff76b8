//! What serving needs from a checkpoint folder: the model on its engine thread, the
//! tokenizer, the chat template and the stop tokens; and the per-choice generation driver
//! that turns the engine's token ids into parsed, stop-string-checked deltas.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use kernels::mla::cache::KvCacheDtype;
use tokio::sync::mpsc;

use crate::checkpoint::{Checkpoint, WeightPlacement};
use crate::exec::backend::{Backend, BackendArgs, RunnerSizing, TpArgs};
use crate::exec::device::StepCapacity;
use crate::exec::footprint::forward_bytes;
use crate::exec::sampler::{SamplingParams, TokenLogprobs};
use crate::exec::tp::{RankRole, open_ranks};
use crate::input::InvalidInput;
use crate::serve::engine::{
    EngineConfig, EngineHandle, EngineRequest, FinishReason, SubmitError, TokenEvent, start_engine,
};
use crate::text::chat_template::{ChatTemplate, RenderRequest};
use crate::text::parsers::{OutputEvent, OutputParser};
use crate::text::tokenizer::{StreamDecoder, Tokenizer};

use super::api::{ApiError, ChatRequest, SamplingRequest, ToolChoice, thinking_requested};

/// Engine and context settings of `model serve` / `model chat`.
#[derive(Clone, Debug)]
pub struct RuntimeOptions {
    pub checkpoint: PathBuf,
    pub max_num_seqs: usize,
    /// Default: the model's `max_position_embeddings`, at most 8192.
    pub max_model_len: Option<usize>,
    pub max_num_batched_tokens: usize,
    pub max_waiting: usize,
    /// Default: room for `max_num_seqs` sequences of `max_model_len` tokens.
    pub kv_cache_tokens: Option<usize>,
    /// Default: what the checkpoint asks for (`kv_cache_quant_algo`), else BF16.
    pub kv_dtype: Option<KvCacheDtype>,
    /// Where the model runs, with its tactics and (on the CPU) where the weights are read from.
    pub backend: BackendArgs,
    pub tp: TpArgs,
    /// Warm the runner up before serving (decode graphs captured, a first step run).
    pub warm_up: bool,
}

pub struct Runtime {
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub engine: EngineHandle,
    pub stop_ids: Vec<u32>,
    pub max_model_len: usize,
    pub checkpoint: PathBuf,
}

/// What every rank of a serving group derives alike from the options and the checkpoint: the
/// model's shape, the context, and the runner's sizing.
struct ServingPlan {
    config: crate::arch::config::ModelConfig,
    max_model_len: usize,
    sizing: RunnerSizing,
    placement: WeightPlacement,
}

impl RuntimeOptions {
    fn plan(&self, checkpoint: &Checkpoint) -> Result<ServingPlan> {
        let config = checkpoint.model_config().clone();
        crate::checkpoint::check_tensor_parallel(&self.checkpoint, &config, self.tp.world())?;
        let kv_dtype = self.kv_dtype.unwrap_or_else(|| checkpoint.kv_cache_dtype());
        let max_model_len = self
            .max_model_len
            .unwrap_or(config.max_position_embeddings.min(8192));
        if max_model_len > config.max_position_embeddings {
            return Err(InvalidInput(format!(
                "--max-model-len {max_model_len} exceeds the model's max_position_embeddings {}",
                config.max_position_embeddings
            ))
            .into());
        }
        self.backend.check(kv_dtype)?;
        let max_num_seqs = self.max_num_seqs.max(1);
        let sizing = RunnerSizing {
            kv_dtype,
            cache_tokens: self
                .kv_cache_tokens
                .unwrap_or(max_num_seqs.saturating_mul(max_model_len)),
            capacity: StepCapacity {
                tokens: self.max_num_batched_tokens.max(1).max(max_num_seqs),
                logit_rows: max_num_seqs,
            },
            fill_memory: self.kv_cache_tokens.is_none(),
        };
        self.check_host_memory(&config, &sizing)?;
        // The CPU reads its weights by default from huge pages where they fit.
        let placement = self.backend.weight_placement(checkpoint);
        Ok(ServingPlan {
            config,
            max_model_len,
            sizing,
            placement,
        })
    }

    /// Refuses sizes the host cannot hold before anything is allocated (an allocation that
    /// fails aborts the process). The CPU backends hold the cache and the step's activations
    /// in host memory on every rank; a GPU holds them itself, and the host only the logits.
    fn check_host_memory(
        &self,
        config: &crate::arch::config::ModelConfig,
        sizing: &RunnerSizing,
    ) -> Result<(), InvalidInput> {
        let (cache_tokens, rows) = (sizing.cache_tokens, sizing.capacity.logit_rows);
        let needed = match self.backend.backend {
            Backend::Cuda => forward_bytes(config, sizing.kv_dtype, 0, 0, rows),
            Backend::Cpu | Backend::CudaEmulated => forward_bytes(
                config,
                sizing.kv_dtype,
                cache_tokens,
                sizing.capacity.tokens,
                rows,
            )
            .saturating_mul(self.tp.world() as u64),
        };
        crate::input::check_memory(
            &format!("a latent cache of {cache_tokens} tokens and steps of {rows} sequences"),
            needed,
            |_| "lower --kv-cache-tokens, --max-num-seqs or --max-model-len".into(),
        )
    }

    /// Whether this process is a follower rank of a serving group (started by rank 0, which
    /// serves).
    pub fn is_follower(&self) -> bool {
        self.tp.tp_rank.is_some_and(|r| r > 0)
    }

    /// A follower rank's work: its shard loaded, rank 0's calls followed until it stops.
    pub fn follow(&self) -> Result<()> {
        let checkpoint = Checkpoint::open(&self.checkpoint)?;
        let plan = self.plan(&checkpoint)?;
        drop(checkpoint);
        let dir = self.checkpoint.clone();
        match open_ranks(
            &self.backend,
            &self.tp,
            plan.sizing,
            |shard| crate::checkpoint::load_model(&dir, shard, |_| plan.placement),
            true,
        )? {
            RankRole::Followed => Ok(()),
            RankRole::Lead(_) => bail!("rank 0 serves; a follower only follows"),
        }
    }
}

impl Runtime {
    /// Loads the tokenizer and the template, and starts the engine, whose thread makes the
    /// runner (over `--tp` ranks: starting the followers) and warms it up.
    pub fn load(options: &RuntimeOptions) -> Result<Self> {
        options.backend.check_available()?;
        // Absolute from here on, so that every path derived from it (the template's, the
        // tokenizer's) is one the server redacts from what clients read.
        let dir = &std::fs::canonicalize(&options.checkpoint)
            .unwrap_or_else(|_| options.checkpoint.clone());
        let tokenizer = Tokenizer::from_dir(dir)
            .with_context(|| format!("{}: loading the tokenizer", dir.display()))?;
        let template = ChatTemplate::from_dir(dir)?;
        let checkpoint = Checkpoint::open(dir)?;
        let plan = options.plan(&checkpoint)?;
        drop(checkpoint);
        let config = &plan.config;
        if tokenizer.vocab_size() > config.vocab_size {
            bail!(
                "{}: the tokenizer has {} ids but the model's vocabulary is {}",
                dir.display(),
                tokenizer.vocab_size(),
                config.vocab_size
            );
        }
        let mut stop_ids = config.eos_token_ids.clone();
        for name in ["<|im_end|>", "[EOS]"] {
            if let Some(id) = tokenizer.special_id(name)
                && !stop_ids.contains(&id)
            {
                stop_ids.push(id);
            }
        }
        let (backend, tp, load_dir) = (options.backend.clone(), options.tp.clone(), dir.clone());
        let (sizing, placement) = (plan.sizing, plan.placement);
        let engine = start_engine(
            move || {
                let load = |shard| crate::checkpoint::load_model(&load_dir, shard, |_| placement);
                match open_ranks(&backend, &tp, sizing, load, false)? {
                    RankRole::Lead(runner) => Ok(runner),
                    RankRole::Followed => bail!("a follower rank does not serve"),
                }
            },
            EngineConfig {
                max_num_seqs: options.max_num_seqs.max(1),
                max_model_len: plan.max_model_len,
                max_batched_tokens: options.max_num_batched_tokens.max(1),
                max_waiting: options.max_waiting,
                warm_up: options.warm_up,
            },
        )?;
        if crate::start_details::start_details_shown() {
            eprintln!(
                "latent cache: {} tokens ({}, {} pages of {}); context {} tokens",
                engine.cache_tokens(),
                sizing.kv_dtype.id(),
                engine.cache_tokens() / kernels::mla::cache::PAGE_TOKENS,
                kernels::mla::cache::PAGE_TOKENS,
                plan.max_model_len,
            );
        }
        Ok(Self {
            tokenizer: Arc::new(tokenizer),
            template,
            engine,
            stop_ids,
            max_model_len: plan.max_model_len,
            checkpoint: dir.clone(),
        })
    }

    /// Waits until the engine is ready (its runner warmed up), or says why it failed.
    pub fn wait_ready(&self) -> Result<()> {
        self.engine.wait_ready()
    }

    /// The chat prompt's ids, whether it opened a `<think>` block, whether tool calls are parsed.
    pub fn chat_prompt(&self, request: &ChatRequest) -> Result<(Vec<u32>, bool, bool), ApiError> {
        let use_tools = !request.tools.is_empty() && request.tool_choice != ToolChoice::None;
        let ids = self
            .template
            .render_ids(
                &RenderRequest {
                    messages: &request.messages,
                    tools: use_tools.then_some(request.tools.as_slice()),
                    add_generation_prompt: true,
                    kwargs: Some(&request.template_kwargs),
                },
                &self.tokenizer,
            )
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        let thinking = thinking_requested(&request.template_kwargs);
        Ok((ids, thinking, use_tools))
    }

    /// Submits `n` generations of `prompt`; the receivers stream their token events.
    pub fn submit(
        &self,
        prompt: &[u32],
        sampling: &SamplingRequest,
    ) -> Result<Vec<mpsc::UnboundedReceiver<TokenEvent>>, ApiError> {
        self.submit_request(None, prompt, sampling)
    }

    /// [`submit`](Self::submit), with a log line on stderr as each generation ends, under
    /// `request_id` (vLLM's `INDEX_ID` for each of `n` > 1 choices).
    pub fn submit_logged(
        &self,
        request_id: &str,
        prompt: &[u32],
        sampling: &SamplingRequest,
    ) -> Result<Vec<mpsc::UnboundedReceiver<TokenEvent>>, ApiError> {
        self.submit_request(Some(request_id), prompt, sampling)
    }

    fn submit_request(
        &self,
        request_id: Option<&str>,
        prompt: &[u32],
        sampling: &SamplingRequest,
    ) -> Result<Vec<mpsc::UnboundedReceiver<TokenEvent>>, ApiError> {
        if prompt.len() >= self.max_model_len {
            return Err(ApiError::invalid(
                "messages",
                format!(
                    "the prompt is {} tokens; this model's maximum context length is {}",
                    prompt.len(),
                    self.max_model_len
                ),
            ));
        }
        // The `n` choices wait for admission together; more than the queue holds would be
        // refused however long the client retried.
        let max_waiting = self.engine.config().max_waiting;
        if sampling.n > max_waiting {
            return Err(ApiError::invalid(
                "n",
                format!(
                    "`n` is {}, more than the {max_waiting} requests this server queues (--max-waiting)",
                    sampling.n
                ),
            ));
        }
        // Without max_tokens: whatever room is left, in the context and in the cache.
        let room = self.max_model_len.min(self.engine.cache_tokens());
        let max_new = sampling
            .max_tokens
            .unwrap_or(room.saturating_sub(prompt.len()).max(1));
        let base_seed = sampling.seed.unwrap_or_else(rand::random);
        let mut receivers = Vec::with_capacity(sampling.n);
        for i in 0..sampling.n {
            let (tx, rx) = mpsc::unbounded_channel();
            self.engine
                .submit(EngineRequest {
                    request_id: request_id.map(|id| match sampling.n {
                        1 => id.to_string(),
                        _ => format!("{i}_{id}"),
                    }),
                    prompt: prompt.to_vec(),
                    max_new_tokens: max_new,
                    sampling: SamplingParams {
                        temperature: sampling.temperature,
                        top_k: sampling.top_k,
                        top_p: sampling.top_p,
                        seed: base_seed.wrapping_add(i as u64),
                    },
                    host_sampling: sampling.host_sampling.clone(),
                    stop_ids: if sampling.ignore_eos {
                        Vec::new()
                    } else {
                        self.stop_ids.clone()
                    },
                    events: tx,
                })
                .map_err(|e| match e {
                    SubmitError::QueueFull(_) => ApiError::too_many_requests(e.to_string()),
                    SubmitError::NeverFits(m) => ApiError::invalid("max_tokens", m),
                    SubmitError::ShuttingDown | SubmitError::NotReady | SubmitError::Failed(_) => {
                        ApiError::unavailable(e.to_string())
                    }
                })?;
            receivers.push(rx);
        }
        Ok(receivers)
    }
}

/// One piece of a choice's output: the parsers' events.
pub type Delta = OutputEvent;

/// How a choice ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChoiceEnd {
    /// `stop`, `length`, `tool_calls`, or `error`.
    pub finish_reason: &'static str,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub error: Option<String>,
}

/// Holds back text that could be the start of a stop string; cuts the output at the first
/// stop string (which is not sent).
struct StopMatcher {
    stops: Vec<String>,
    hold_chars: usize,
    pending: Vec<Delta>,
}

impl StopMatcher {
    fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.to_vec(),
            hold_chars: stops.iter().map(|s| s.chars().count()).max().unwrap_or(1) - 1,
            pending: Vec::new(),
        }
    }

    /// Returns the deltas that are now safe to send, and whether a stop string was hit.
    fn push(&mut self, delta: Delta) -> (Vec<Delta>, bool) {
        if self.stops.is_empty() {
            return (vec![delta], false);
        }
        if delta.text().is_none() {
            let mut out = std::mem::take(&mut self.pending);
            out.push(delta);
            return (out, false);
        }
        self.pending.push(delta);
        let combined: String = self.pending.iter().filter_map(Delta::text).collect();
        if let Some(cut) = self
            .stops
            .iter()
            .filter_map(|s| combined.find(s.as_str()))
            .min()
        {
            let out = self.take_prefix(cut);
            self.pending.clear();
            return (out, true);
        }
        let keep_from = combined
            .char_indices()
            .rev()
            .nth(self.hold_chars.saturating_sub(1))
            .map_or(0, |(i, _)| i);
        let keep_from = if self.hold_chars == 0 {
            combined.len()
        } else {
            keep_from
        };
        (self.take_prefix(keep_from), false)
    }

    /// Everything still held (the output ended without a stop string).
    fn flush(&mut self) -> Vec<Delta> {
        std::mem::take(&mut self.pending)
    }

    /// Removes and returns the first `bytes` bytes of pending text, as deltas.
    fn take_prefix(&mut self, bytes: usize) -> Vec<Delta> {
        let mut out = Vec::new();
        let mut left = bytes;
        let mut rest = Vec::new();
        for delta in self.pending.drain(..) {
            let text = delta.text().expect("only text is held").to_string();
            if left >= text.len() {
                left -= text.len();
                out.push(delta);
            } else if left > 0 {
                out.push(delta.with_text(text[..left].to_string()));
                rest.push(delta.with_text(text[left..].to_string()));
                left = 0;
            } else {
                rest.push(delta);
            }
        }
        self.pending = rest;
        out.retain(|d| d.text().is_none_or(|t| !t.is_empty()));
        out
    }
}

/// Which parse a choice's output gets.
#[derive(Clone, Copy, Debug)]
pub enum OutputMode {
    /// Chat: reasoning / content / tool calls.
    Chat { thinking: bool, parse_tools: bool },
    /// Completions: plain text (special tokens dropped).
    Text,
}

/// Drives one choice: reads its engine events, parses and stop-checks them, and sends deltas
/// through `send` (which returns false once nobody listens: the choice then stops, and
/// dropping `events` frees its sequence in the engine).
pub async fn drive_choice<F, Fut>(
    tokenizer: Arc<Tokenizer>,
    events: mpsc::UnboundedReceiver<TokenEvent>,
    mode: OutputMode,
    stops: Vec<String>,
    mut send: F,
) -> ChoiceEnd
where
    F: FnMut(Delta) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut logprobs = Vec::new();
    drive(
        tokenizer,
        events,
        mode,
        stops,
        0,
        &mut logprobs,
        |delta, _| send(delta),
    )
    .await
}

/// [`drive_choice`], each delta sent with the logprobs of the tokens generated since the
/// previous one; those of tokens after the last delta come back with the end. Stop strings
/// are looked for once more than `min_tokens` tokens are generated (as vLLM does).
pub async fn drive_choice_scored<F, Fut>(
    tokenizer: Arc<Tokenizer>,
    events: mpsc::UnboundedReceiver<TokenEvent>,
    mode: OutputMode,
    stops: Vec<String>,
    min_tokens: usize,
    send: F,
) -> (ChoiceEnd, Vec<TokenLogprobs>)
where
    F: FnMut(Delta, Vec<TokenLogprobs>) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut logprobs = Vec::new();
    let end = drive(
        tokenizer,
        events,
        mode,
        stops,
        min_tokens,
        &mut logprobs,
        send,
    )
    .await;
    (end, logprobs)
}

async fn drive<F, Fut>(
    tokenizer: Arc<Tokenizer>,
    mut events: mpsc::UnboundedReceiver<TokenEvent>,
    mode: OutputMode,
    stops: Vec<String>,
    min_tokens: usize,
    logprobs: &mut Vec<TokenLogprobs>,
    mut send: F,
) -> ChoiceEnd
where
    F: FnMut(Delta, Vec<TokenLogprobs>) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let (thinking, parse_tools, text_only) = match mode {
        OutputMode::Chat {
            thinking,
            parse_tools,
        } => (thinking, parse_tools, false),
        OutputMode::Text => (false, false, true),
    };
    let mut parser = OutputParser::new(&tokenizer, thinking, parse_tools);
    let mut text_decoder = StreamDecoder::new(true);
    let mut matcher = StopMatcher::new(&stops);
    let mut parsed = Vec::new();
    let mut generated = 0;
    loop {
        let Some(event) = events.recv().await else {
            return ChoiceEnd {
                finish_reason: "error",
                prompt_tokens: 0,
                completion_tokens: generated,
                error: Some("the engine stopped".into()),
            };
        };
        let finished = match event {
            TokenEvent::Logprobs(token) => {
                logprobs.push(token);
                continue;
            }
            TokenEvent::Token(id) => {
                generated += 1;
                if text_only {
                    let text = text_decoder.push(&tokenizer, id);
                    if !text.is_empty() {
                        parsed.push(OutputEvent::Content(text));
                    }
                } else {
                    parser.push(id, &mut parsed);
                }
                None
            }
            TokenEvent::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
            } => {
                if text_only {
                    let text = text_decoder.finish();
                    if !text.is_empty() {
                        parsed.push(OutputEvent::Content(text));
                    }
                } else {
                    parser.finish(&mut parsed);
                }
                Some((reason, prompt_tokens, completion_tokens))
            }
            TokenEvent::Failed(message) => {
                return ChoiceEnd {
                    finish_reason: "error",
                    prompt_tokens: 0,
                    completion_tokens: generated,
                    error: Some(message),
                };
            }
        };
        for event in parsed.drain(..) {
            let (ready, stopped) = if generated > min_tokens {
                matcher.push(event)
            } else {
                let mut ready = matcher.flush();
                ready.push(event);
                (ready, false)
            };
            for delta in ready {
                if !send(delta, std::mem::take(logprobs)).await {
                    return ChoiceEnd {
                        finish_reason: "abort",
                        prompt_tokens: 0,
                        completion_tokens: generated,
                        error: None,
                    };
                }
            }
            if stopped {
                return ChoiceEnd {
                    finish_reason: "stop",
                    prompt_tokens: 0,
                    completion_tokens: generated,
                    error: None,
                };
            }
        }
        if let Some((reason, prompt_tokens, completion_tokens)) = finished {
            for delta in matcher.flush() {
                send(delta, std::mem::take(logprobs)).await;
            }
            let finish_reason = match reason {
                FinishReason::Length => "length",
                FinishReason::Stop if parser.tool_calls() > 0 => "tool_calls",
                FinishReason::Stop => "stop",
            };
            return ChoiceEnd {
                finish_reason,
                prompt_tokens,
                completion_tokens,
                error: None,
            };
        }
    }
}

/// The embedded default checkpoint's folder name inside the cache directory.
pub fn checkpoint_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(deltas: &[Delta]) -> String {
        deltas.iter().filter_map(Delta::text).collect()
    }

    #[test]
    fn stop_strings_cut_across_deltas_and_channels() {
        let mut m = StopMatcher::new(&["STOP".to_string()]);
        let (a, stopped) = m.push(Delta::Reasoning("think ST".into()));
        assert!(!stopped);
        assert_eq!(texts(&a), "think");
        let (b, stopped) = m.push(Delta::Content("OP here".into()));
        assert!(stopped);
        assert_eq!(b, vec![Delta::Reasoning(" ".into())]);
        let mut m = StopMatcher::new(&["\n\n".to_string(), "END".to_string()]);
        let (a, _) = m.push(Delta::Content("abc".into()));
        let (b, _) = m.push(Delta::Content("déf".into()));
        assert_eq!(texts(&a) + &texts(&b) + &texts(&m.flush()), "abcdéf");
    }
}

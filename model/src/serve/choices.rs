//! A request's choices, generated and delivered: each choice's engine events driven to text in
//! a task, gathered whole for a plain answer or sent as SSE chunks for a stream. The tasks
//! belong to the request's future or to the stream's body, so a client that goes away stops
//! them, and the drain's grace period ends them with an error the client can read.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;

use super::api::{ApiError, SamplingRequest};
use super::engine::TokenEvent;
use super::runtime::{ChoiceEnd, Delta, OutputMode, drive_choice_scored};
use super::state::Shared;
use crate::exec::sampler::TokenLogprobs;
use crate::text::tokenizer::Tokenizer;

/// The tasks generating one request's choices. Dropping it aborts them, and with them their
/// engine receivers, so the engine frees their sequences at its next step. It lives in the
/// handler's future for a plain request and in the response body for a stream: a client that
/// hangs up drops either, whatever kind of request it made.
struct ChoiceTasks<T>(Vec<JoinHandle<T>>);

impl<T> ChoiceTasks<T> {
    async fn join(&mut self) -> Result<Vec<T>, ApiError> {
        let mut outputs = Vec::with_capacity(self.0.len());
        for task in &mut self.0 {
            outputs.push(
                task.await
                    .map_err(|e| ApiError::internal(format!("a choice's task failed: {e}")))?,
            );
        }
        Ok(outputs)
    }
}

impl<T> Drop for ChoiceTasks<T> {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// Runs `work` unless the drain's grace period ends first (`None`): then what `work` held, its
/// engine receiver included, is dropped.
async fn unless_grace_over<T>(
    mut grace_over: watch::Receiver<bool>,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        output = work => Some(output),
        Ok(_) = grace_over.wait_for(|&over| over) => None,
    }
}

fn cut_by_shutdown() -> ApiError {
    ApiError::unavailable(
        "the server shut down before the answer was complete (the drain's grace period ended)"
            .into(),
    )
}

/// One choice's accumulated output (non-streaming): a completion's text is its `content`.
#[derive(Default)]
pub(super) struct Collected {
    pub(super) reasoning: String,
    pub(super) content: String,
    pub(super) tool_calls: Vec<(String, String, String)>,
    /// Every generated token's, where the request asked for logprobs.
    pub(super) logprobs: Vec<TokenLogprobs>,
}

impl Collected {
    fn apply(&mut self, delta: Delta) {
        match delta {
            Delta::Reasoning(t) => self.reasoning.push_str(&t),
            Delta::Content(t) => self.content.push_str(&t),
            Delta::ToolCallStart { id, name, .. } => {
                self.tool_calls.push((id, name, String::new()))
            }
            Delta::ToolCallArguments { index, fragment } => {
                if let Some(call) = self.tool_calls.get_mut(index) {
                    call.2.push_str(&fragment);
                }
            }
        }
    }
}

pub(super) fn usage(prompt_tokens: usize, ends: &[ChoiceEnd]) -> Value {
    let completion: usize = ends.iter().map(|e| e.completion_tokens).sum();
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion,
           "total_tokens": prompt_tokens + completion})
}

/// Generates every choice of a plain (non-streaming) request to its end.
pub(super) async fn collect_choices(
    state: &Shared,
    receivers: Vec<mpsc::UnboundedReceiver<TokenEvent>>,
    mode: OutputMode,
    sampling: &SamplingRequest,
) -> Result<Vec<(Collected, ChoiceEnd)>, ApiError> {
    let mut tasks = ChoiceTasks(
        receivers
            .into_iter()
            .map(|events| {
                let tokenizer = state.runtime.tokenizer.clone();
                let stops = sampling.stop.clone();
                let min_tokens = sampling.host_sampling.min_tokens;
                let grace_over = state.grace_over.clone();
                tokio::spawn(async move {
                    let mut collected = Collected::default();
                    let driven = drive_choice_scored(
                        tokenizer,
                        events,
                        mode,
                        stops,
                        min_tokens,
                        |delta, logprobs| {
                            collected.apply(delta);
                            collected.logprobs.extend(logprobs);
                            async { true }
                        },
                    );
                    let (end, rest) = unless_grace_over(grace_over, driven).await?;
                    collected.logprobs.extend(rest);
                    Some((collected, end))
                })
            })
            .collect(),
    );
    let mut choices = Vec::new();
    for choice in tasks.join().await? {
        let (collected, end) = choice.ok_or_else(cut_by_shutdown)?;
        if let Some(message) = &end.error {
            return Err(ApiError::internal(format!("generation failed: {message}")));
        }
        choices.push((collected, end));
    }
    Ok(choices)
}

/// How one streamed choice ended.
enum StreamedChoice {
    /// Its last chunk (or its error frame) is sent.
    Ended(ChoiceEnd),
    /// The drain's grace period ended first.
    Cut,
    /// Nobody reads the stream any more.
    ClientGone,
}

/// The events of a stream, owning the tasks that produce them: when the client hangs up the
/// body is dropped, and with it every choice's generation.
struct ChoiceEvents {
    events: ReceiverStream<Result<Event, Infallible>>,
    _tasks: ChoiceTasks<()>,
}

impl Stream for ChoiceEvents {
    type Item = Result<Event, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.events).poll_next(cx)
    }
}

/// An SSE response: per choice a role delta first (chat), then its deltas, then a final chunk
/// with its finish reason, or an error frame (`{"error": {…}}`) where the engine failed or the
/// drain's grace period ended; with `include_usage` a usage chunk with empty `choices`;
/// always `data: [DONE]` last. A client that goes away drops the stream, which stops every
/// choice.
#[allow(clippy::too_many_arguments)]
pub(super) fn stream_response(
    state: Shared,
    receivers: Vec<mpsc::UnboundedReceiver<TokenEvent>>,
    mode: OutputMode,
    sampling: SamplingRequest,
    prompt_tokens: usize,
    id: String,
    created: u64,
    chat: bool,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Event, Infallible>>(64);
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let model = state.model_name.clone();
    let include_usage = sampling.include_usage;
    let chunk = {
        let (id, model) = (id.clone(), model.clone());
        move |choice: Value| {
            let mut c = json!({"id": id, "object": object, "created": created, "model": model,
                               "choices": [choice]});
            if include_usage {
                c["usage"] = Value::Null;
            }
            Event::default().data(c.to_string())
        }
    };
    let mut tasks = Vec::new();
    let wants_logprobs = sampling.host_sampling.logprobs.is_some();
    for (index, events) in receivers.into_iter().enumerate() {
        let tx = tx.clone();
        let chunk = chunk.clone();
        let state = state.clone();
        let stops = sampling.stop.clone();
        let min_tokens = sampling.host_sampling.min_tokens;
        tasks.push(tokio::spawn(async move {
            let tokenizer = state.runtime.tokenizer.clone();
            // The text offset of a completion's tokens runs on from chunk to chunk.
            let mut text_logprobs = TextLogprobs::default();
            let mut logprobs_json = |tokens: &[TokenLogprobs]| -> Value {
                if !wants_logprobs {
                    Value::Null
                } else if chat {
                    chat_logprobs(&tokenizer, tokens)
                } else {
                    text_logprobs.render(&tokenizer, tokens)
                }
            };
            if chat {
                let role = json!({"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": null, "finish_reason": null});
                if tx.send(Ok(chunk(role))).await.is_err() {
                    return StreamedChoice::ClientGone;
                }
            }
            let driven = drive_choice_scored(state.runtime.tokenizer.clone(), events, mode, stops, min_tokens, |delta, tokens| {
                let payload = if chat { chat_delta(&delta) } else { text_delta(&delta) };
                // A delta with no text of its own still carries its tokens' logprobs.
                let payload = payload.or_else(|| {
                    (!tokens.is_empty()).then(|| if chat { json!({}) } else { json!("") })
                });
                let event = payload.map(|delta_json| {
                    let logprobs = logprobs_json(&tokens);
                    chunk(if chat {
                        json!({"index": index, "delta": delta_json, "logprobs": logprobs, "finish_reason": null})
                    } else {
                        json!({"index": index, "text": delta_json, "logprobs": logprobs, "finish_reason": null})
                    })
                });
                let tx = tx.clone();
                // A closed channel means the client went away: the choice stops.
                async move {
                    match event {
                        Some(event) => tx.send(Ok(event)).await.is_ok(),
                        None => true,
                    }
                }
            });
            let Some((end, rest)) = unless_grace_over(state.grace_over.clone(), driven).await else {
                return StreamedChoice::Cut;
            };
            if end.finish_reason == "abort" {
                return StreamedChoice::ClientGone;
            }
            if let Some(message) = &end.error {
                // As vLLM streams a failure: an error frame, then `[DONE]` (the OpenAI
                // clients raise on it rather than return a truncated answer).
                let error = state.public(ApiError::internal(message.clone())).body();
                let _ = tx.send(Ok(Event::default().data(error.to_string()))).await;
                return StreamedChoice::Ended(end);
            }
            // The tokens after the last delta (a stop token, text a stop string cut).
            let logprobs = if rest.is_empty() { Value::Null } else { logprobs_json(&rest) };
            let last = if chat {
                json!({"index": index, "delta": {}, "logprobs": logprobs, "finish_reason": end.finish_reason})
            } else {
                json!({"index": index, "text": "", "logprobs": logprobs, "finish_reason": end.finish_reason})
            };
            if tx.send(Ok(chunk(last))).await.is_err() {
                return StreamedChoice::ClientGone;
            }
            StreamedChoice::Ended(end)
        }));
    }
    let mut choices = ChoiceTasks(tasks);
    let finish = tokio::spawn(async move {
        let (mut ends, mut cut) = (Vec::new(), false);
        let last_words = match choices.join().await {
            Err(e) => Some(e),
            Ok(outcomes) => {
                for outcome in outcomes {
                    match outcome {
                        StreamedChoice::Ended(end) => ends.push(end),
                        StreamedChoice::Cut => cut = true,
                        StreamedChoice::ClientGone => return,
                    }
                }
                cut.then(cut_by_shutdown)
            }
        };
        if let Some(error) = last_words {
            let frame = Event::default().data(error.body().to_string());
            if tx.send(Ok(frame)).await.is_err() {
                return;
            }
        } else if include_usage {
            let usage_chunk = json!({"id": id, "object": object, "created": created,
                                     "model": model, "choices": [], "usage": usage(prompt_tokens, &ends)});
            if tx
                .send(Ok(Event::default().data(usage_chunk.to_string())))
                .await
                .is_err()
            {
                return;
            }
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]"))).await;
    });
    let events = ChoiceEvents {
        events: ReceiverStream::new(rx),
        _tasks: ChoiceTasks(vec![finish]),
    };
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

pub(super) fn chat_delta(delta: &Delta) -> Option<Value> {
    Some(match delta {
        // vLLM sends both names: `reasoning` now, `reasoning_content` as before.
        Delta::Reasoning(t) => json!({"reasoning": t, "reasoning_content": t}),
        Delta::Content(t) => json!({"content": t}),
        Delta::ToolCallStart { index, id, name } => json!({"tool_calls": [{
            "index": index, "id": id, "type": "function",
            "function": {"name": name, "arguments": ""}}]}),
        Delta::ToolCallArguments { index, fragment } => json!({"tool_calls": [{
            "index": index, "function": {"arguments": fragment}}]}),
    })
}

pub(super) fn text_delta(delta: &Delta) -> Option<Value> {
    match delta {
        Delta::Content(t) | Delta::Reasoning(t) => Some(Value::String(t.clone())),
        _ => None,
    }
}

/// A logprob as JSON: vLLM's -9999 where it is -inf (JSON has no infinity).
fn logprob_json(logprob: f32) -> Value {
    json!(if logprob.is_finite() {
        logprob
    } else {
        -9999.0
    })
}

/// A token's text (bytes that are not UTF-8 on their own as U+FFFD) and its bytes.
fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.token_bytes(id).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// OpenAI's chat `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs: [{token,
/// logprob, bytes}]}]}`, one entry per token.
pub(super) fn chat_logprobs(tokenizer: &Tokenizer, tokens: &[TokenLogprobs]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let (token, bytes) = token_text(tokenizer, id);
        json!({"token": token, "logprob": logprob_json(logprob), "bytes": bytes})
    };
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(t.token, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
            e
        })
        .collect();
    json!({"content": content})
}

/// OpenAI's completions `logprobs` (`tokens`, `token_logprobs`, `top_logprobs` as one
/// token-to-logprob object per token, the drawn token's included, and `text_offset`), with
/// the text offset carried from one rendered piece to the next.
#[derive(Default)]
pub(super) struct TextLogprobs {
    /// Characters of the tokens rendered so far.
    offset: usize,
}

impl TextLogprobs {
    pub(super) fn render(&mut self, tokenizer: &Tokenizer, tokens: &[TokenLogprobs]) -> Value {
        let mut texts = Vec::with_capacity(tokens.len());
        let mut logprobs = Vec::with_capacity(tokens.len());
        let mut tops = Vec::with_capacity(tokens.len());
        let mut offsets = Vec::with_capacity(tokens.len());
        for t in tokens {
            let (text, _) = token_text(tokenizer, t.token);
            offsets.push(self.offset);
            self.offset += text.chars().count();
            let mut top = serde_json::Map::new();
            for &(id, lp) in &t.top {
                top.entry(token_text(tokenizer, id).0)
                    .or_insert_with(|| logprob_json(lp));
            }
            top.entry(text.clone())
                .or_insert_with(|| logprob_json(t.logprob));
            texts.push(text);
            logprobs.push(logprob_json(t.logprob));
            tops.push(Value::Object(top));
        }
        json!({"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops,
               "text_offset": offsets})
    }
}

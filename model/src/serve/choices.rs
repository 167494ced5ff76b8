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
use super::runtime::{ChoiceEnd, Delta, OutputMode, drive_choice};
use super::state::Shared;

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
    stops: &[String],
) -> Result<Vec<(Collected, ChoiceEnd)>, ApiError> {
    let mut tasks = ChoiceTasks(
        receivers
            .into_iter()
            .map(|events| {
                let tokenizer = state.runtime.tokenizer.clone();
                let stops = stops.to_vec();
                let grace_over = state.grace_over.clone();
                tokio::spawn(async move {
                    let mut collected = Collected::default();
                    let driven = drive_choice(tokenizer, events, mode, stops, |delta| {
                        collected.apply(delta);
                        async { true }
                    });
                    let end = unless_grace_over(grace_over, driven).await?;
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
    for (index, events) in receivers.into_iter().enumerate() {
        let tx = tx.clone();
        let chunk = chunk.clone();
        let state = state.clone();
        let stops = sampling.stop.clone();
        tasks.push(tokio::spawn(async move {
            if chat {
                let role = json!({"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": null, "finish_reason": null});
                if tx.send(Ok(chunk(role))).await.is_err() {
                    return StreamedChoice::ClientGone;
                }
            }
            let driven = drive_choice(state.runtime.tokenizer.clone(), events, mode, stops, |delta| {
                let payload = if chat { chat_delta(&delta) } else { text_delta(&delta) };
                let event = payload.map(|delta_json| {
                    chunk(if chat {
                        json!({"index": index, "delta": delta_json, "logprobs": null, "finish_reason": null})
                    } else {
                        json!({"index": index, "text": delta_json, "logprobs": null, "finish_reason": null})
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
            let Some(end) = unless_grace_over(state.grace_over.clone(), driven).await else {
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
            let last = if chat {
                json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": end.finish_reason})
            } else {
                json!({"index": index, "text": "", "logprobs": null, "finish_reason": end.finish_reason})
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
        Delta::Reasoning(t) => json!({"reasoning": t}),
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

//! `model serve`: an OpenAI-compatible HTTP server (axum on tokio) over the continuous-batching
//! engine. `/v1/chat/completions` (JSON or SSE), `/v1/completions`, `/v1/models`, `/health`,
//! `/metrics` (Prometheus text). SIGTERM or Ctrl-C: stop accepting, let in-flight requests
//! finish within the grace period, then exit.

pub mod api;
pub mod engine;
pub mod runtime;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, Uri, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use api::{ApiError, PromptInput, SamplingRequest, parse_body, parse_chat, parse_completion};
use engine::EngineState;
use runtime::{ChoiceEnd, Delta, OutputMode, Runtime, drive_choice};

pub use runtime::RuntimeOptions;

/// Server settings beyond the engine's.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    pub served_model_name: String,
    /// How long in-flight requests may run after SIGTERM.
    pub shutdown_grace: Duration,
}

struct AppState {
    runtime: Runtime,
    model_name: String,
    created: u64,
    shutting_down: AtomicBool,
}

type Shared = Arc<AppState>;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn request_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

/// The router over a loaded runtime (also used by tests in-process).
fn router(state: Shared) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|uri: Uri| async move { ApiError::not_found_route(uri.path()) })
        .with_state(state)
}

/// Loads the model and serves until SIGTERM / Ctrl-C.
pub fn serve(runtime_options: RuntimeOptions, options: ServeOptions) -> Result<()> {
    serve_until(runtime_options, options, wait_for_signal(), |_| {})
}

/// Loads the model and serves until `stop` completes (then drains as on SIGTERM); `ready`
/// gets the bound address.
pub fn serve_until(
    runtime_options: RuntimeOptions,
    options: ServeOptions,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
    ready: impl FnOnce(SocketAddr),
) -> Result<()> {
    // The server drains on SIGTERM and SIGINT itself; the orderly end below removes what an
    // interruption would have to.
    crate::cleanup::leave_interruptions_to_the_process();
    let runtime = Runtime::load(&runtime_options)?;
    let engine = runtime.engine.clone();
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    tokio.block_on(async move {
        let state = Arc::new(AppState {
            runtime,
            model_name: options.served_model_name.clone(),
            created: unix_now(),
            shutting_down: AtomicBool::new(false),
        });
        let addr = format!("{}:{}", options.host, options.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local: SocketAddr = listener.local_addr()?;
        let engine = state.runtime.engine.config();
        println!(
            "serving {} ({}) on http://{local} — max {} sequences, context {} tokens, KV cache {} pages",
            options.served_model_name,
            state.runtime.checkpoint.display(),
            engine.max_num_seqs,
            engine.max_model_len,
            state.runtime.engine.metrics.kv_pages_total.get(),
        );
        ready(local);
        let (signal_tx, mut signal_rx) = tokio::sync::watch::channel(false);
        let shutdown_state = state.clone();
        let graceful = async move {
            stop.await;
            eprintln!(
                "shutting down: no new requests; in-flight requests have {} s",
                options.shutdown_grace.as_secs_f64()
            );
            shutdown_state.shutting_down.store(true, Ordering::SeqCst);
            shutdown_state.runtime.engine.shutdown();
            let _ = signal_tx.send(true);
        };
        let server = axum::serve(listener, router(state.clone())).with_graceful_shutdown(graceful);
        let grace = options.shutdown_grace;
        let deadline = async move {
            while !*signal_rx.borrow() {
                if signal_rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            tokio::time::sleep(grace).await;
        };
        tokio::select! {
            result = server => result.context("serving")?,
            _ = deadline => eprintln!("grace period over: closing the remaining connections"),
        }
        state.runtime.engine.shutdown();
        Ok::<(), anyhow::Error>(())
    })?;
    // What was still in flight was cancelled with the connections. The engine thread ends,
    // dropping its runner: over tensor-parallel ranks the followers' command pipes close and
    // each stops after its last step.
    engine.join();
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != &state.model_name => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

fn check_accepting(state: &AppState) -> Result<(), ApiError> {
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable("the server is shutting down".into()));
    }
    Ok(())
}

/// 200 once the engine is ready (the weights loaded, every decode graph captured, a first step
/// run) and until it stops; 503 with the reason before, after a failure (a tensor-parallel
/// rank or the device died) and while shutting down.
async fn health(State(state): State<Shared>) -> Response {
    let unavailable = |status: &str, why: Option<String>| {
        let body = json!({"status": status, "reason": why});
        (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
    };
    if state.shutting_down.load(Ordering::SeqCst) {
        return unavailable("shutting down", None);
    }
    match state.runtime.engine.state() {
        EngineState::Ready => StatusCode::OK.into_response(),
        EngineState::Starting => unavailable("starting", None),
        EngineState::Failed(why) => unavailable("failed", Some(why)),
    }
}

async fn metrics(State(state): State<Shared>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.runtime.engine.metrics.render(),
    )
        .into_response()
}

async fn models(State(state): State<Shared>) -> Response {
    axum::Json(json!({"object": "list", "data": [{
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "kimi-sm120",
        "root": state.runtime.checkpoint.display().to_string(),
        "max_model_len": state.runtime.max_model_len,
    }]}))
    .into_response()
}

/// One choice's accumulated output (non-streaming).
#[derive(Default)]
struct Collected {
    reasoning: String,
    content: String,
    tool_calls: Vec<(String, String, String)>,
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

fn usage(prompt_tokens: usize, ends: &[ChoiceEnd]) -> Value {
    let completion: usize = ends.iter().map(|e| e.completion_tokens).sum();
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion,
           "total_tokens": prompt_tokens + completion})
}

fn error_of(ends: &[ChoiceEnd]) -> Option<ApiError> {
    ends.iter()
        .find_map(|e| e.error.clone())
        .map(|m| ApiError::internal(format!("generation failed: {m}")))
}

async fn chat_completions(State(state): State<Shared>, body: Bytes) -> Response {
    match chat_inner(state, body).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(state: Shared, body: Bytes) -> Result<Response, ApiError> {
    check_accepting(&state)?;
    let body = parse_body(&body)?;
    let request = parse_chat(&body)?;
    check_model(&state, &request.model)?;
    let (prompt, thinking, parse_tools) = state.runtime.chat_prompt(&request)?;
    let receivers = state.runtime.submit(&prompt, &request.sampling)?;
    let mode = OutputMode::Chat {
        thinking,
        parse_tools,
    };
    let id = request_id("chatcmpl");
    let created = unix_now();
    if request.sampling.stream {
        return Ok(stream_response(
            state,
            receivers,
            mode,
            request.sampling,
            prompt.len(),
            id,
            created,
            true,
        ));
    }
    let mut tasks = Vec::new();
    for rx in receivers {
        let tokenizer = state.runtime.tokenizer.clone();
        let stops = request.sampling.stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut collected = Collected::default();
            let end = drive_choice(tokenizer, rx, mode, stops, |d| {
                collected.apply(d);
                async { true }
            })
            .await;
            (collected, end)
        }));
    }
    let mut choices = Vec::new();
    let mut ends = Vec::new();
    for (index, task) in tasks.into_iter().enumerate() {
        let (collected, end) = task.await.map_err(|e| ApiError::internal(e.to_string()))?;
        let tool_calls: Vec<Value> = collected
            .tool_calls
            .iter()
            .map(|(id, name, args)| {
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": args.trim()}})
            })
            .collect();
        let mut message = json!({
            "role": "assistant",
            "content": (!collected.content.is_empty()).then_some(&collected.content),
            "reasoning": (!collected.reasoning.is_empty()).then_some(&collected.reasoning),
        });
        if !tool_calls.is_empty() {
            message["tool_calls"] = Value::Array(tool_calls);
        }
        choices.push(json!({"index": index, "message": message, "logprobs": null,
                            "finish_reason": end.finish_reason}));
        ends.push(end);
    }
    if let Some(e) = error_of(&ends) {
        return Err(e);
    }
    Ok(axum::Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": state.model_name,
        "choices": choices, "usage": usage(prompt.len(), &ends),
    }))
    .into_response())
}

async fn completions(State(state): State<Shared>, body: Bytes) -> Response {
    match completions_inner(state, body).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(state: Shared, body: Bytes) -> Result<Response, ApiError> {
    check_accepting(&state)?;
    let body = parse_body(&body)?;
    let request = parse_completion(&body)?;
    check_model(&state, &request.model)?;
    let tokenizer = state.runtime.tokenizer.clone();
    let (prompt, prompt_text) = match &request.prompt {
        PromptInput::Text(t) => (tokenizer.encode(t), t.clone()),
        PromptInput::Tokens(ids) => {
            if let Some(bad) = ids
                .iter()
                .find(|&&id| id as usize >= tokenizer.vocab_size())
            {
                return Err(ApiError::invalid(
                    "prompt",
                    format!(
                        "token id {bad} is outside the vocabulary of {}",
                        tokenizer.vocab_size()
                    ),
                ));
            }
            (ids.clone(), tokenizer.decode(ids, false))
        }
    };
    let receivers = state.runtime.submit(&prompt, &request.sampling)?;
    let id = request_id("cmpl");
    let created = unix_now();
    if request.sampling.stream {
        return Ok(stream_response(
            state,
            receivers,
            OutputMode::Text,
            request.sampling,
            prompt.len(),
            id,
            created,
            false,
        ));
    }
    let mut tasks = Vec::new();
    for rx in receivers {
        let tokenizer = tokenizer.clone();
        let stops = request.sampling.stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut text = String::new();
            let end = drive_choice(tokenizer, rx, OutputMode::Text, stops, |d| {
                if let Delta::Content(t) = d {
                    text.push_str(&t);
                }
                async { true }
            })
            .await;
            (text, end)
        }));
    }
    let mut choices = Vec::new();
    let mut ends = Vec::new();
    for (index, task) in tasks.into_iter().enumerate() {
        let (text, end) = task.await.map_err(|e| ApiError::internal(e.to_string()))?;
        let text = if request.echo {
            format!("{prompt_text}{text}")
        } else {
            text
        };
        choices.push(json!({"index": index, "text": text, "logprobs": null,
                            "finish_reason": end.finish_reason}));
        ends.push(end);
    }
    if let Some(e) = error_of(&ends) {
        return Err(e);
    }
    Ok(axum::Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": state.model_name,
        "choices": choices, "usage": usage(prompt.len(), &ends),
    }))
    .into_response())
}

/// An SSE response: per choice a role delta first (chat), then its deltas, then a final chunk
/// with its finish reason, or an error frame (`{"error": {…}}`) where the engine failed; with
/// `include_usage` a usage chunk with empty `choices`; always `data: [DONE]` last. A client that goes away drops the stream, which stops every choice.
#[allow(clippy::too_many_arguments)]
fn stream_response(
    state: Shared,
    receivers: Vec<mpsc::UnboundedReceiver<crate::serve::engine::TokenEvent>>,
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
        let tokenizer = state.runtime.tokenizer.clone();
        let stops = sampling.stop.clone();
        tasks.push(tokio::spawn(async move {
            if chat {
                let role = json!({"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": null, "finish_reason": null});
                if tx.send(Ok(chunk(role))).await.is_err() {
                    return None;
                }
            }
            let end = drive_choice(tokenizer, events, mode, stops, |delta| {
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
            })
            .await;
            if end.finish_reason == "abort" {
                return None;
            }
            if let Some(message) = &end.error {
                // As vLLM streams a failure: an error frame, then `[DONE]` (the OpenAI
                // clients raise on it rather than return a truncated answer).
                let error = ApiError::internal(message.clone()).body();
                let _ = tx.send(Ok(Event::default().data(error.to_string()))).await;
                return Some(end);
            }
            let last = if chat {
                json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": end.finish_reason})
            } else {
                json!({"index": index, "text": "", "logprobs": null, "finish_reason": end.finish_reason})
            };
            if tx.send(Ok(chunk(last))).await.is_err() {
                return None;
            }
            Some(end)
        }));
    }
    let (id2, model2) = (id, model);
    tokio::spawn(async move {
        let mut ends = Vec::new();
        for task in tasks {
            match task.await {
                Ok(Some(end)) => ends.push(end),
                _ => return,
            }
        }
        if include_usage {
            let usage_chunk = json!({"id": id2, "object": object, "created": created,
                                     "model": model2, "choices": [], "usage": usage(prompt_tokens, &ends)});
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
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

fn chat_delta(delta: &Delta) -> Option<Value> {
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

fn text_delta(delta: &Delta) -> Option<Value> {
    match delta {
        Delta::Content(t) | Delta::Reasoning(t) => Some(Value::String(t.clone())),
        _ => None,
    }
}

//! `model serve`: an OpenAI-compatible HTTP server (axum on tokio) over the continuous-batching
//! engine. `/v1/chat/completions` (JSON or SSE), `/v1/completions`, `/v1/models`, `/health`,
//! `/metrics` (OpenMetrics text, vLLM's `vllm:` names). With an API key every `/v1/*` route
//! wants `Authorization: Bearer KEY` (401 without), while `/health` and `/metrics` stay open,
//! as in vLLM. SIGTERM or Ctrl-C: refuse new requests (`/health` answers 503, on new
//! connections too), let in-flight requests finish within the grace period, then end what is
//! left with an error (a stream's error frame and `[DONE]`, a plain request's 503) and exit.
//! Each request's end is logged on stderr: its id, token counts, time to first token, decode
//! speed and finish reason.
//!
//! No client can hold the server: connections time out ([`conn`]), bodies are capped in size and
//! time, renders run off the async workers, and a request whose client hangs up, streaming or
//! not, stops generating.

pub mod api;
mod api_key;
mod choices;
pub mod conn;
pub mod engine;
pub mod runtime;
mod state;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result};
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::{Semaphore, watch};

use api::{ApiError, PromptInput, parse_body, parse_chat, parse_completion};
use choices::{TextLogprobs, chat_logprobs, collect_choices, stream_response, usage};
use conn::Connections;
use engine::EngineState;
use runtime::{ChoiceEnd, OutputMode, Runtime, checkpoint_name};
use state::{AppState, Shared};

pub use api_key::{ApiKey, ApiKeyParser};
pub use conn::ConnectionLimits;
pub use runtime::RuntimeOptions;

/// Server settings beyond the engine's.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    pub served_model_name: String,
    /// Required of every `/v1/*` request when set.
    pub api_key: Option<ApiKey>,
    /// How long in-flight requests may run after SIGTERM.
    pub shutdown_grace: Duration,
    /// How long a client may take, and how many connections it may hold.
    pub limits: ConnectionLimits,
}

/// The largest request body read (axum's default limit).
const MAX_BODY_BYTES: usize = 2 << 20;

/// How long the answers cut at the end of the grace period (an error frame and `[DONE]`, or
/// a 503) have to reach their clients before the connections are dropped.
const CUT_FLUSH: Duration = Duration::from_secs(5);

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn request_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

/// The router over a loaded runtime.
fn router(state: Shared) -> Router {
    let routes = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|uri: Uri| async move { ApiError::not_found_route(uri.path()) })
        .with_state(state.clone());
    // Around the whole router, so that it sees each answer as sent: a 405's `Allow` header is
    // added by the route's method router, past any layer on the routes.
    Router::new()
        .fallback_service(routes)
        .layer(axum::middleware::from_fn_with_state(state, require_api_key))
        .layer(axum::middleware::from_fn(json_errors))
}

/// With an API key, a `/v1/*` request without it gets 401 (OpenAI's `invalid_api_key` error);
/// `/health` and `/metrics` stay open, and CORS preflights (`OPTIONS`) pass, as in vLLM.
async fn require_api_key(State(state): State<Shared>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    let guarded = path == "/v1" || path.starts_with("/v1/");
    match &state.api_key {
        Some(key)
            if guarded
                && request.method() != Method::OPTIONS
                && !key.authorizes(request.headers().get(header::AUTHORIZATION)) =>
        {
            let mut refusal = ApiError {
                status: StatusCode::UNAUTHORIZED,
                message: "Incorrect or missing API key: send it as `Authorization: Bearer KEY`"
                    .into(),
                kind: "invalid_request_error",
                param: None,
                code: Some("invalid_api_key"),
            }
            .into_response();
            refusal
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            refusal
        }
        _ => next.run(request).await,
    }
}

/// Gives the router's own refusals (a wrong method, an extractor's rejection) the error body
/// every endpoint answers with, keeping their status and headers.
async fn json_errors(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let message = if status == StatusCode::METHOD_NOT_ALLOWED {
        let allowed = parts
            .headers
            .get(header::ALLOW)
            .and_then(|a| a.to_str().ok())
            .unwrap_or("");
        format!("{method} is not allowed on {path} (allowed: {allowed})")
    } else if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    let mut error = ApiError::with_status(status, message).into_response();
    parts.headers.remove(header::CONTENT_TYPE);
    parts.headers.remove(header::CONTENT_LENGTH);
    error.headers_mut().extend(parts.headers);
    error
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
    stop: impl std::future::Future<Output = ()>,
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
    let served = tokio.block_on(async move {
        let (grace_over_tx, grace_over) = watch::channel(false);
        let checkpoint = &runtime.checkpoint;
        let checkpoint_paths = [
            Some(checkpoint.clone()).filter(|p| p.is_absolute()),
            std::fs::canonicalize(checkpoint).ok(),
        ]
        .into_iter()
        .flatten()
        .map(|p| p.display().to_string())
        .collect();
        let state = Arc::new(AppState {
            model_name: options.served_model_name.clone(),
            checkpoint_name: checkpoint_name(checkpoint),
            checkpoint_paths,
            created: unix_now(),
            api_key: options.api_key.clone(),
            shutting_down: AtomicBool::new(false),
            body_read_timeout: options.limits.body_read_timeout,
            grace_over,
            prompt_workers: Arc::new(Semaphore::new(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            )),
            runtime,
        });
        let addr = format!("{}:{}", options.host, options.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local: SocketAddr = listener.local_addr()?;
        let engine = state.runtime.engine.config();
        let max_connections = options.limits.effective_max_connections();
        println!(
            "serving {} ({}) on http://{local} — max {} sequences, context {} tokens, KV cache {} pages, {max_connections} connections",
            options.served_model_name,
            state.runtime.checkpoint.display(),
            engine.max_num_seqs,
            engine.max_model_len,
            state.runtime.engine.metrics.kv_pages_total.get(),
        );
        if options.api_key.is_some() {
            eprintln!("/v1/* requires the API key (`Authorization: Bearer KEY`)");
        } else if !local.ip().is_loopback() {
            eprintln!(
                "warning: serving on {local}, not a loopback address, without --api-key: anyone who reaches it can use the model"
            );
        }
        ready(local);
        let connections = Connections::new(max_connections);
        let (draining_tx, draining) = watch::channel(false);
        let accepting = tokio::spawn(conn::accept_loop(
            listener,
            router(state.clone()),
            options.limits,
            connections.clone(),
            draining,
        ));
        stop.await;
        eprintln!(
            "shutting down: no new requests; in-flight requests have {} s",
            options.shutdown_grace.as_secs_f64()
        );
        state.shutting_down.store(true, Ordering::SeqCst);
        state.runtime.engine.shutdown();
        draining_tx.send_replace(true);
        let drained = tokio::time::timeout(options.shutdown_grace, connections.all_closed()).await;
        if drained.is_err() {
            eprintln!("grace period over: ending the remaining requests");
            grace_over_tx.send_replace(true);
            let _ = tokio::time::timeout(CUT_FLUSH, connections.all_closed()).await;
        }
        accepting.abort();
        Ok::<(), anyhow::Error>(())
    });
    // Dropping the runtime drops every connection left (a client that did not read its cut
    // answer) and with it its receivers: the engine, shut down, frees what they held and its
    // thread ends, dropping its runner: over tensor-parallel ranks the followers' command
    // pipes close and each stops after its last step. A render still on a blocking thread is
    // bounded by the template's own limit; it is not waited for.
    tokio.shutdown_timeout(Duration::from_secs(1));
    engine.shutdown();
    engine.join();
    served
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
        EngineState::Failed(why) => unavailable("failed", Some(state.redact(&why))),
    }
}

/// The metrics in the OpenMetrics text format: what the registry's encoder writes (counters'
/// `_total`, the closing `# EOF`), labelled as such; Prometheus scrapes it as it does vLLM's.
async fn metrics(State(state): State<Shared>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.runtime.engine.metrics.render(&state.model_name),
    )
        .into_response()
}

async fn models(State(state): State<Shared>) -> Response {
    axum::Json(json!({"object": "list", "data": [{
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "kimi-sm120",
        "root": state.checkpoint_name,
        "max_model_len": state.runtime.max_model_len,
    }]}))
    .into_response()
}

/// Reads a request's body within the size limit and the body-read timeout.
async fn read_body(state: &AppState, request: Request) -> Result<Vec<u8>, ApiError> {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(ApiError::payload_too_large(MAX_BODY_BYTES));
    }
    let mut chunks = request.into_body().into_data_stream();
    let read = async {
        let mut body = Vec::new();
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk
                .map_err(|e| ApiError::invalid(None, format!("reading the request body: {e}")))?;
            if body.len() + chunk.len() > MAX_BODY_BYTES {
                return Err(ApiError::payload_too_large(MAX_BODY_BYTES));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    };
    tokio::time::timeout(state.body_read_timeout, read)
        .await
        .unwrap_or_else(|_| Err(ApiError::body_timeout(state.body_read_timeout)))
}

/// Runs `work` on a blocking thread, one per core at most: a template render or a long
/// prompt's tokenization can take seconds of CPU, which on the async workers would stall
/// every other request, `/health`'s included.
async fn on_prompt_worker<T: Send + 'static>(
    state: &Shared,
    work: impl FnOnce(&Runtime) -> T + Send + 'static,
) -> Result<T, ApiError> {
    let permit = state
        .prompt_workers
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::unavailable("the server is shutting down".into()))?;
    let state = state.clone();
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        work(&state.runtime)
    })
    .await
    .map_err(|e| ApiError::internal(format!("preparing the prompt failed: {e}")))
}

async fn chat_completions(State(state): State<Shared>, request: Request) -> Response {
    match chat_inner(&state, request).await {
        Ok(response) => response,
        Err(e) => state.public(e).into_response(),
    }
}

async fn chat_inner(state: &Shared, request: Request) -> Result<Response, ApiError> {
    check_accepting(state)?;
    let body = parse_body(&read_body(state, request).await?)?;
    let request = parse_chat(&body)?;
    check_model(state, &request.model)?;
    let (request, prompt) = on_prompt_worker(state, move |runtime| {
        let prompt = runtime.chat_prompt(&request);
        (request, prompt)
    })
    .await?;
    let (prompt, thinking, parse_tools) = prompt?;
    let id = request_id("chatcmpl");
    let receivers = state
        .runtime
        .submit_logged(&id, &prompt, &request.sampling)?;
    let mode = OutputMode::Chat {
        thinking,
        parse_tools,
    };
    let created = unix_now();
    if request.sampling.stream {
        return Ok(stream_response(
            state.clone(),
            receivers,
            mode,
            request.sampling,
            prompt.len(),
            id,
            created,
            true,
        ));
    }
    let collected = collect_choices(state, receivers, mode, &request.sampling).await?;
    let wants_logprobs = request.sampling.host_sampling.logprobs.is_some();
    let ends: Vec<ChoiceEnd> = collected.iter().map(|(_, end)| end.clone()).collect();
    let choices: Vec<Value> = collected
        .into_iter()
        .enumerate()
        .map(|(index, (collected, end))| {
            let tool_calls: Vec<Value> = collected
                .tool_calls
                .iter()
                .map(|(id, name, args)| {
                    json!({"id": id, "type": "function", "function": {"name": name, "arguments": args.trim()}})
                })
                .collect();
            let reasoning = (!collected.reasoning.is_empty()).then_some(&collected.reasoning);
            // vLLM sends both names: `reasoning` now, `reasoning_content` as before.
            let mut message = json!({
                "role": "assistant",
                "content": (!collected.content.is_empty()).then_some(&collected.content),
                "reasoning": reasoning,
                "reasoning_content": reasoning,
            });
            if !tool_calls.is_empty() {
                message["tool_calls"] = Value::Array(tool_calls);
            }
            let logprobs = if wants_logprobs {
                chat_logprobs(&state.runtime.tokenizer, &collected.logprobs)
            } else {
                Value::Null
            };
            json!({"index": index, "message": message, "logprobs": logprobs,
                   "finish_reason": end.finish_reason})
        })
        .collect();
    Ok(axum::Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": state.model_name,
        "choices": choices, "usage": usage(prompt.len(), &ends),
    }))
    .into_response())
}

async fn completions(State(state): State<Shared>, request: Request) -> Response {
    match completions_inner(&state, request).await {
        Ok(response) => response,
        Err(e) => state.public(e).into_response(),
    }
}

/// A completion's prompt ids and its text (what `echo` repeats).
fn completion_prompt(
    runtime: &Runtime,
    prompt: &PromptInput,
) -> Result<(Vec<u32>, String), ApiError> {
    let tokenizer = &runtime.tokenizer;
    match prompt {
        PromptInput::Text(t) => Ok((tokenizer.encode(t), t.clone())),
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
            Ok((ids.clone(), tokenizer.decode(ids, false)))
        }
    }
}

async fn completions_inner(state: &Shared, request: Request) -> Result<Response, ApiError> {
    check_accepting(state)?;
    let body = parse_body(&read_body(state, request).await?)?;
    let request = parse_completion(&body)?;
    check_model(state, &request.model)?;
    let (request, prompt) = on_prompt_worker(state, move |runtime| {
        let prompt = completion_prompt(runtime, &request.prompt);
        (request, prompt)
    })
    .await?;
    let (prompt, prompt_text) = prompt?;
    let id = request_id("cmpl");
    let receivers = state
        .runtime
        .submit_logged(&id, &prompt, &request.sampling)?;
    let created = unix_now();
    if request.sampling.stream {
        return Ok(stream_response(
            state.clone(),
            receivers,
            OutputMode::Text,
            request.sampling,
            prompt.len(),
            id,
            created,
            false,
        ));
    }
    let collected = collect_choices(state, receivers, OutputMode::Text, &request.sampling).await?;
    let wants_logprobs = request.sampling.host_sampling.logprobs.is_some();
    let ends: Vec<ChoiceEnd> = collected.iter().map(|(_, end)| end.clone()).collect();
    let choices: Vec<Value> = collected
        .into_iter()
        .enumerate()
        .map(|(index, (collected, end))| {
            let text = if request.echo {
                format!("{prompt_text}{}", collected.content)
            } else {
                collected.content
            };
            // `echo` with logprobs is refused: the offsets start at the completion.
            let logprobs = if wants_logprobs {
                TextLogprobs::default().render(&state.runtime.tokenizer, &collected.logprobs)
            } else {
                Value::Null
            };
            json!({"index": index, "text": text, "logprobs": logprobs,
                   "finish_reason": end.finish_reason})
        })
        .collect();
    Ok(axum::Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": state.model_name,
        "choices": choices, "usage": usage(prompt.len(), &ends),
    }))
    .into_response())
}

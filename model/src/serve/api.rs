//! The OpenAI request surface: parsing and validating request bodies field by field (so that
//! every bad input gets a 4xx naming its field), and the error body
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::exec::sampler::HostSampling;

/// An OpenAI-style error response.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(param: impl Into<Option<&'static str>>, message: impl Into<String>) -> Self {
        let param: Option<&'static str> = param.into();
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(String::from),
            code: None,
        }
    }

    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn too_many_requests(message: String) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            message,
            kind: "rate_limit_error",
            param: None,
            code: Some("rate_limit_exceeded"),
        }
    }

    pub fn unavailable(message: String) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message,
            kind: "server_error",
            param: None,
            code: Some("service_unavailable"),
        }
    }

    pub fn internal(message: String) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message,
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// An error the router or the connection layer answers (a wrong method, a body too large
    /// or too slow), in the same body as the endpoints' own.
    pub fn with_status(status: StatusCode, message: String) -> Self {
        Self {
            status,
            message,
            kind: if status.is_server_error() {
                "server_error"
            } else {
                "invalid_request_error"
            },
            param: None,
            code: None,
        }
    }

    pub fn payload_too_large(limit_bytes: usize) -> Self {
        Self::with_status(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {limit_bytes} bytes"),
        )
    }

    pub fn body_timeout(timeout: std::time::Duration) -> Self {
        Self::with_status(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} s",
                timeout.as_secs_f64()
            ),
        )
    }

    pub fn not_found_route(path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("No route {path}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        // The rest of a body refused as too large or too slow is not read, so the connection
        // cannot carry another request.
        if matches!(
            self.status,
            StatusCode::PAYLOAD_TOO_LARGE | StatusCode::REQUEST_TIMEOUT
        ) {
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        response
    }
}

/// Sampling and length settings shared by both endpoints.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingRequest {
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// vLLM's `ignore_eos`: generate `max_tokens` past the stop tokens (benchmarks).
    pub ignore_eos: bool,
    /// Penalties, `min_tokens` and logprobs (the top-N count under both endpoints' spelling).
    pub host_sampling: HostSampling,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Function(String),
}

#[derive(Clone, Debug)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<Value>,
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
    pub template_kwargs: Map<String, Value>,
    pub sampling: SamplingRequest,
}

#[derive(Clone, Debug)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: PromptInput,
    pub echo: bool,
    pub sampling: SamplingRequest,
}

const MAX_N: usize = 16;

/// The most top logprobs a token gets (OpenAI's `top_logprobs` bound, vLLM's default
/// `max_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Which endpoint a body is for: `logprobs` is a boolean in chat, a count in completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
}

/// Fields the server reads (or, like `user`, accepts and ignores as OpenAI does).
const HONOURED: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "echo",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "best_of",
    "stream",
    "stream_options",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_tokens",
    // Bookkeeping that changes no output.
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "request_id",
    "cache_salt",
    "add_special_tokens",
    "spaces_between_special_tokens",
    "skip_special_tokens",
];

fn is_false(v: &Value) -> bool {
    v == &Value::Bool(false)
}

fn is_true(v: &Value) -> bool {
    v == &Value::Bool(true)
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

fn is_number(v: &Value, value: f64) -> bool {
    v.as_f64() == Some(value)
}

/// Whether a field's value asks for nothing the server skips.
type Harmless = fn(&Value) -> bool;

/// Fields OpenAI or vLLM define that this server does not honour, each with the values that
/// ask for nothing it skips (null always does): any other value is refused, naming the field,
/// rather than answered as if it had been followed.
const NOT_HONOURED: &[(&str, Harmless)] = &[
    ("response_format", |v| {
        v.as_object()
            .is_some_and(|o| o.len() == 1 && o.get("type") == Some(&json!("text")))
    }),
    ("logit_bias", is_empty),
    ("prompt_logprobs", |_| false),
    ("suffix", is_empty),
    ("audio", |_| false),
    ("modalities", |v| v == &json!(["text"])),
    ("prediction", |_| false),
    ("functions", is_empty),
    ("function_call", |v| {
        v == &json!("none") || v == &json!("auto")
    }),
    ("parallel_tool_calls", is_true),
    ("reasoning_effort", |_| false),
    ("web_search_options", |_| false),
    ("verbosity", |_| false),
    ("include_reasoning", is_true),
    ("min_p", |v| is_number(v, 0.0)),
    ("use_beam_search", is_false),
    ("length_penalty", |v| is_number(v, 1.0)),
    ("stop_token_ids", is_empty),
    ("include_stop_str_in_output", is_false),
    ("allowed_token_ids", is_empty),
    ("bad_words", is_empty),
    ("logits_processors", is_empty),
    ("truncate_prompt_tokens", |_| false),
    ("return_tokens_as_token_ids", is_false),
    ("return_token_ids", is_false),
    ("prompt_embeds", |_| false),
    ("chat_template", |_| false),
    ("documents", |_| false),
    ("continue_final_message", is_false),
    ("add_generation_prompt", is_true),
    ("guided_json", |_| false),
    ("guided_regex", |_| false),
    ("guided_choice", |_| false),
    ("guided_grammar", |_| false),
    ("guided_decoding_backend", |_| false),
    ("guided_whitespace_pattern", |_| false),
    ("structured_outputs", |_| false),
    ("structural_tag", |_| false),
    ("priority", |v| is_number(v, 0.0)),
    ("mm_processor_kwargs", is_empty),
    ("kv_transfer_params", |_| false),
    ("vllm_xargs", is_empty),
];

/// Refuses a field the server would not honour; warns (once per request) of fields neither
/// OpenAI nor vLLM defines, which are ignored, as vLLM ignores them.
fn check_fields(body: &Map<String, Value>, endpoint: Endpoint) -> Result<(), ApiError> {
    let mut unknown = Vec::new();
    for (key, value) in body {
        // Completions count their top logprobs in `logprobs`; neither API has this there.
        let foreign = endpoint == Endpoint::Completions && key == "top_logprobs";
        if HONOURED.contains(&key.as_str()) && !foreign {
            continue;
        }
        if let Some((field, harmless)) = NOT_HONOURED.iter().find(|(field, _)| field == key) {
            if !value.is_null() && !harmless(value) {
                return Err(ApiError::invalid(
                    *field,
                    format!("`{field}` is not supported by this server (got {value})"),
                ));
            }
            continue;
        }
        unknown.push(format!("`{key}`"));
    }
    // Chat has no `echo` of OpenAI's; vLLM's repeats the last message, which this server
    // does not.
    if endpoint == Endpoint::Chat && present(body, "echo").is_some_and(|v| !is_false(v)) {
        return Err(ApiError::invalid(
            "echo",
            "`echo` is not supported by this server's chat completions",
        ));
    }
    if !unknown.is_empty() {
        eprintln!(
            "warning: the request's fields {} are not in OpenAI's or vLLM's API: ignored",
            unknown.join(", ")
        );
    }
    Ok(())
}

/// Parses a body as a JSON object.
pub fn parse_body(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid(None, format!("the request body is not valid JSON: {e}")))?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ApiError::invalid(
            None,
            format!(
                "the request body must be a JSON object, not {}",
                kind(&other)
            ),
        )),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn present<'a>(body: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    body.get(key).filter(|v| !v.is_null())
}

fn opt_string(body: &Map<String, Value>, key: &'static str) -> Result<Option<String>, ApiError> {
    match present(body, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(ApiError::invalid(
            key,
            format!("`{key}` must be a string, not {}", kind(other)),
        )),
    }
}

fn opt_bool(body: &Map<String, Value>, key: &'static str) -> Result<Option<bool>, ApiError> {
    match present(body, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(ApiError::invalid(
            key,
            format!("`{key}` must be a boolean, not {}", kind(other)),
        )),
    }
}

fn opt_number(body: &Map<String, Value>, key: &'static str) -> Result<Option<f64>, ApiError> {
    match present(body, key) {
        None => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(other) => Err(ApiError::invalid(
            key,
            format!("`{key}` must be a number, not {}", kind(other)),
        )),
    }
}

fn opt_integer(body: &Map<String, Value>, key: &'static str) -> Result<Option<i64>, ApiError> {
    match present(body, key) {
        None => Ok(None),
        Some(Value::Number(n)) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Ok(Some(i)),
            (None, Some(u)) => Ok(Some(i64::try_from(u).unwrap_or(i64::MAX))),
            _ => Err(ApiError::invalid(
                key,
                format!("`{key}` must be an integer, not {n}"),
            )),
        },
        Some(other) => Err(ApiError::invalid(
            key,
            format!("`{key}` must be an integer, not {}", kind(other)),
        )),
    }
}

fn parse_sampling(
    body: &Map<String, Value>,
    endpoint: Endpoint,
    default_max_tokens: Option<usize>,
) -> Result<SamplingRequest, ApiError> {
    // `max_completion_tokens` wins over the deprecated `max_tokens`.
    let max_tokens = match opt_integer(body, "max_completion_tokens")? {
        Some(v) => Some(("max_completion_tokens", v)),
        None => opt_integer(body, "max_tokens")?.map(|v| ("max_tokens", v)),
    };
    let max_tokens = match max_tokens {
        Some((key, v)) if v < 1 => {
            return Err(ApiError::invalid(
                if key == "max_tokens" {
                    "max_tokens"
                } else {
                    "max_completion_tokens"
                },
                format!("`{key}` must be at least 1, got {v}"),
            ));
        }
        Some((_, v)) => Some(v as usize),
        None => default_max_tokens,
    };
    // Checked as the sampler holds them (f32): a top_p of 1e-46 is 0 there, and an empty
    // nucleus draws id 0. A temperature that rounds to 0 is greedy, as the limit is.
    let requested = opt_number(body, "temperature")?.unwrap_or(1.0);
    let temperature = requested as f32;
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("`temperature` must be between 0 and 2, got {requested}"),
        ));
    }
    let requested = opt_number(body, "top_p")?.unwrap_or(1.0);
    let top_p = requested as f32;
    if !(top_p.is_normal() && top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            "top_p",
            format!(
                "`top_p` must be in (0, 1] and at least {:e} (the smallest normal f32), got {requested}",
                f32::MIN_POSITIVE
            ),
        ));
    }
    let top_k = match opt_integer(body, "top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1 (off) or positive, got {k}"),
            ));
        }
    };
    let seed = opt_integer(body, "seed")?.map(|s| s as u64);
    let stop = match present(body, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| {
                s.as_str().map(String::from).ok_or_else(|| {
                    ApiError::invalid("stop", "`stop` must be a string or a list of strings")
                })
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "`stop` must be a string or a list of strings, not {}",
                    kind(other)
                ),
            ));
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "`stop` strings must not be empty",
        ));
    }
    let n = opt_integer(body, "n")?.unwrap_or(1);
    if !(1..=MAX_N as i64).contains(&n) {
        return Err(ApiError::invalid(
            "n",
            format!("`n` must be between 1 and {MAX_N}, got {n}"),
        ));
    }
    let stream = opt_bool(body, "stream")?.unwrap_or(false);
    let ignore_eos = opt_bool(body, "ignore_eos")?.unwrap_or(false);
    let include_usage = match present(body, "stream_options") {
        None => false,
        Some(Value::Object(o)) => opt_bool(o, "include_usage")
            .map_err(|_| {
                ApiError::invalid(
                    "stream_options",
                    "`stream_options.include_usage` must be a boolean",
                )
            })?
            .unwrap_or(false),
        Some(other) => {
            return Err(ApiError::invalid(
                "stream_options",
                format!("`stream_options` must be an object, not {}", kind(other)),
            ));
        }
    };
    // `best_of` candidates, the best `n` returned: only `best_of == n` is what runs.
    if let Some(best_of) = opt_integer(body, "best_of")?
        && best_of != n
    {
        return Err(ApiError::invalid(
            "best_of",
            format!(
                "`best_of` must equal `n` ({n}): this server returns every sequence it generates, got {best_of}"
            ),
        ));
    }
    let host_sampling = HostSampling {
        repetition_penalty: parse_repetition_penalty(body)?,
        frequency_penalty: parse_penalty(body, "frequency_penalty")?,
        presence_penalty: parse_penalty(body, "presence_penalty")?,
        min_tokens: parse_min_tokens(body, max_tokens)?,
        logprobs: parse_logprobs(body, endpoint)?,
    };
    Ok(SamplingRequest {
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        stop,
        n: n as usize,
        stream,
        include_usage,
        ignore_eos,
        host_sampling,
    })
}

/// `frequency_penalty` or `presence_penalty`: OpenAI's range, -2 to 2 (0 is off).
fn parse_penalty(body: &Map<String, Value>, key: &'static str) -> Result<f32, ApiError> {
    let requested = opt_number(body, key)?.unwrap_or(0.0);
    if !(-2.0..=2.0).contains(&requested) {
        return Err(ApiError::invalid(
            key,
            format!("`{key}` must be between -2 and 2, got {requested}"),
        ));
    }
    Ok(requested as f32)
}

/// vLLM's `repetition_penalty`: above 0 (1 is off), finite as the sampler holds it.
fn parse_repetition_penalty(body: &Map<String, Value>) -> Result<f32, ApiError> {
    let requested = opt_number(body, "repetition_penalty")?.unwrap_or(1.0);
    let penalty = requested as f32;
    if !(penalty.is_normal() && penalty > 0.0) {
        return Err(ApiError::invalid(
            "repetition_penalty",
            format!(
                "`repetition_penalty` must be a finite number above 0 (1 is off), got {requested}"
            ),
        ));
    }
    Ok(penalty)
}

/// vLLM's `min_tokens`: at least 0, at most `max_tokens`.
fn parse_min_tokens(
    body: &Map<String, Value>,
    max_tokens: Option<usize>,
) -> Result<usize, ApiError> {
    let min_tokens = opt_integer(body, "min_tokens")?.unwrap_or(0);
    if min_tokens < 0 {
        return Err(ApiError::invalid(
            "min_tokens",
            format!("`min_tokens` must be at least 0, got {min_tokens}"),
        ));
    }
    let min_tokens = min_tokens as usize;
    if let Some(max) = max_tokens
        && min_tokens > max
    {
        return Err(ApiError::invalid(
            "min_tokens",
            format!("`min_tokens` ({min_tokens}) must not exceed `max_tokens` ({max})"),
        ));
    }
    Ok(min_tokens)
}

/// How many top logprobs each token gets, `None` for no logprobs. Chat: `logprobs` a boolean
/// and `top_logprobs` the count; completions: `logprobs` the count.
fn parse_logprobs(
    body: &Map<String, Value>,
    endpoint: Endpoint,
) -> Result<Option<usize>, ApiError> {
    let in_range = |key: &'static str, n: i64| {
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= MAX_TOP_LOGPROBS)
            .ok_or_else(|| {
                ApiError::invalid(
                    key,
                    format!("`{key}` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
                )
            })
    };
    match endpoint {
        Endpoint::Chat => {
            let logprobs = opt_bool(body, "logprobs")?.unwrap_or(false);
            let top = opt_integer(body, "top_logprobs")?
                .map(|n| in_range("top_logprobs", n))
                .transpose()?;
            match (logprobs, top) {
                (false, Some(top)) if top > 0 => Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                )),
                (false, _) => Ok(None),
                (true, top) => Ok(Some(top.unwrap_or(0))),
            }
        }
        // `false` is read as chat spells "none"; `true` names no count.
        Endpoint::Completions if present(body, "logprobs") == Some(&Value::Bool(false)) => Ok(None),
        Endpoint::Completions => opt_integer(body, "logprobs")?
            .map(|n| in_range("logprobs", n))
            .transpose(),
    }
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

fn parse_message(index: usize, message: &Value) -> Result<Value, ApiError> {
    let at = |what: String| ApiError::invalid("messages", format!("messages[{index}]: {what}"));
    let Value::Object(m) = message else {
        return Err(at(format!("must be an object, not {}", kind(message))));
    };
    let role = match m.get("role") {
        Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.clone(),
        Some(Value::String(r)) => {
            return Err(at(format!(
                "unknown role `{r}` (expected one of {})",
                ROLES.join(", ")
            )));
        }
        Some(other) => return Err(at(format!("`role` must be a string, not {}", kind(other)))),
        None => return Err(at("has no `role`".into())),
    };
    let mut out = m.clone();
    match m.get("content") {
        None | Some(Value::Null) => {
            let has_calls = matches!(m.get("tool_calls"), Some(Value::Array(c)) if !c.is_empty());
            if !(role == "assistant" && has_calls) {
                return Err(at("has no `content`".into()));
            }
        }
        Some(Value::String(_)) => {}
        Some(Value::Array(parts)) => {
            for (j, part) in parts.iter().enumerate() {
                let ok = match part {
                    Value::Object(p) => match p.get("type").and_then(Value::as_str) {
                        Some("text") => p.get("text").is_some_and(Value::is_string),
                        Some(_) => true,
                        None => false,
                    },
                    _ => false,
                };
                if !ok {
                    return Err(at(format!(
                        "content[{j}] must be an object with a `type` (and a string `text` for text parts)"
                    )));
                }
            }
        }
        Some(other) => {
            return Err(at(format!(
                "`content` must be a string, a list of parts or null, not {}",
                kind(other)
            )));
        }
    }
    if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
        let Value::Array(calls) = calls else {
            return Err(at("`tool_calls` must be a list".into()));
        };
        for (j, call) in calls.iter().enumerate() {
            let name = call.pointer("/function/name").and_then(Value::as_str);
            let args = call.pointer("/function/arguments");
            if name.is_none() || !matches!(args, Some(Value::String(_)) | Some(Value::Object(_))) {
                return Err(at(format!(
                    "tool_calls[{j}] needs `function.name` (a string) and `function.arguments` (a JSON string)"
                )));
            }
        }
    }
    // Earlier reasoning comes back as `reasoning` (vLLM's output name) or `reasoning_content`.
    if let Some(reasoning) = m.get("reasoning").filter(|r| r.is_string())
        && !m.get("reasoning_content").is_some_and(Value::is_string)
    {
        out.insert("reasoning_content".into(), reasoning.clone());
    }
    if out.get("reasoning_content").is_some_and(Value::is_null) {
        out.remove("reasoning_content");
    }
    Ok(Value::Object(out))
}

/// Template variables the server sets from the request itself; a `chat_template_kwargs` entry
/// would bypass the checks on `messages` and `tools` and `tool_choice: "none"`.
pub const SERVER_TEMPLATE_VARIABLES: [&str; 4] =
    ["messages", "tools", "tools_ts_str", "add_generation_prompt"];

/// Whether `chat_template_kwargs` asks for thinking: absent means on (as Kimi's tokenizer
/// passes it), present means its Jinja truthiness (`0`, `null`, `""`, `[]` and `false` are
/// off), as a template's `{% if thinking %}` reads it.
pub fn thinking_requested(kwargs: &Map<String, Value>) -> bool {
    kwargs
        .get("thinking")
        .is_none_or(|value| minijinja::Value::from(minijinja::value::Serde(value)).is_true())
}

/// Parses a `/v1/chat/completions` body.
pub fn parse_chat(body: &Map<String, Value>) -> Result<ChatRequest, ApiError> {
    let model = opt_string(body, "model")?;
    let messages = match body.get("messages") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("messages", "`messages` is required"));
        }
        Some(Value::Array(m)) if m.is_empty() => {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must not be empty",
            ));
        }
        Some(Value::Array(m)) => m
            .iter()
            .enumerate()
            .map(|(i, msg)| parse_message(i, msg))
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => {
            return Err(ApiError::invalid(
                "messages",
                format!("`messages` must be a list, not {}", kind(other)),
            ));
        }
    };
    let tools = match present(body, "tools") {
        None => Vec::new(),
        Some(Value::Array(tools)) => {
            for (i, tool) in tools.iter().enumerate() {
                let ok = tool.get("type").and_then(Value::as_str) == Some("function")
                    && tool.pointer("/function/name").is_some_and(Value::is_string);
                if !ok {
                    return Err(ApiError::invalid(
                        "tools",
                        format!(
                            "tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
                        ),
                    ));
                }
            }
            tools.clone()
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "tools",
                format!("`tools` must be a list, not {}", kind(other)),
            ));
        }
    };
    let tool_choice = match present(body, "tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` must be none, auto, required or a function, not `{other}`"
                    ),
                ));
            }
        },
        Some(v @ Value::Object(_)) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(name) => ToolChoice::Function(name.to_string()),
            None => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice.function.name` is required",
                ));
            }
        },
        Some(other) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "`tool_choice` must be a string or an object, not {}",
                    kind(other)
                ),
            ));
        }
    };
    if matches!(tool_choice, ToolChoice::Required | ToolChoice::Function(_)) && tools.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` asks for a tool but `tools` is empty",
        ));
    }
    if let ToolChoice::Function(name) = &tool_choice
        && !tools
            .iter()
            .any(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name))
    {
        return Err(ApiError::invalid(
            "tool_choice",
            format!("`tool_choice` names `{name}`, which is not in `tools`"),
        ));
    }
    let template_kwargs = match present(body, "chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(k)) => {
            if let Some(key) = SERVER_TEMPLATE_VARIABLES
                .iter()
                .find(|key| k.contains_key(**key))
            {
                return Err(ApiError::invalid(
                    "chat_template_kwargs",
                    format!(
                        "`chat_template_kwargs` must not set `{key}`: the server sets it from the request"
                    ),
                ));
            }
            let mut kwargs = k.clone();
            // The template and the reasoning parser must agree on whether the answer opens with
            // reasoning: both read this one bool.
            if kwargs.contains_key("thinking") {
                kwargs.insert("thinking".into(), thinking_requested(k).into());
            }
            kwargs
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "chat_template_kwargs",
                format!(
                    "`chat_template_kwargs` must be an object, not {}",
                    kind(other)
                ),
            ));
        }
    };
    check_fields(body, Endpoint::Chat)?;
    Ok(ChatRequest {
        model,
        messages,
        tools,
        tool_choice,
        template_kwargs,
        sampling: parse_sampling(body, Endpoint::Chat, None)?,
    })
}

/// Parses a `/v1/completions` body (OpenAI's default `max_tokens` there is 16).
pub fn parse_completion(body: &Map<String, Value>) -> Result<CompletionRequest, ApiError> {
    let model = opt_string(body, "model")?;
    let prompt = match body.get("prompt") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("prompt", "`prompt` is required"));
        }
        Some(Value::String(s)) => PromptInput::Text(s.clone()),
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            PromptInput::Text(items[0].as_str().expect("checked").to_string())
        }
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_u64) => {
            PromptInput::Tokens(
                items
                    .iter()
                    .map(|v| u32::try_from(v.as_u64().expect("checked")).unwrap_or(u32::MAX))
                    .collect(),
            )
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "prompt",
                "`prompt` must be a string, a list with one string, or a list of token ids",
            ));
        }
    };
    if matches!(&prompt, PromptInput::Text(t) if t.is_empty()) {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    let echo = opt_bool(body, "echo")?.unwrap_or(false);
    let sampling = parse_sampling(body, Endpoint::Completions, Some(16))?;
    // Echoed logprobs would be the prompt's too (its `prompt_logprobs`), which are not computed.
    if echo && sampling.host_sampling.logprobs.is_some() {
        return Err(ApiError::invalid(
            "echo",
            "`echo` with `logprobs` is not supported by this server (the prompt's logprobs are not computed)",
        ));
    }
    check_fields(body, Endpoint::Completions)?;
    Ok(CompletionRequest {
        model,
        prompt,
        echo,
        sampling,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Result<ChatRequest, ApiError> {
        parse_chat(body.as_object().unwrap())
    }

    #[test]
    fn the_smoke_test_body_parses() {
        let r = chat(
            json!({"model": "nvidia/Kimi-K2.5-NVFP4", "messages": [{"role": "user",
            "content": "What is the capital of France? Answer in one sentence."}],
            "max_tokens": 256, "temperature": 0.6, "unknown_field": [1]}),
        )
        .unwrap();
        assert_eq!(r.sampling.max_tokens, Some(256));
        assert_eq!(r.sampling.temperature, 0.6);
        assert_eq!(r.tool_choice, ToolChoice::Auto);
    }

    #[test]
    fn bad_fields_name_themselves() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let cases = [
            (json!({"messages": []}), "messages"),
            (json!({"messages": "hi"}), "messages"),
            (
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
                "messages",
            ),
            (json!({"messages": [{"role": "user"}]}), "messages"),
            (
                json!({"messages": user, "temperature": -0.5}),
                "temperature",
            ),
            (
                json!({"messages": user, "temperature": "hot"}),
                "temperature",
            ),
            (json!({"messages": user, "max_tokens": 0}), "max_tokens"),
            (
                json!({"messages": user, "max_completion_tokens": -3}),
                "max_completion_tokens",
            ),
            (json!({"messages": user, "top_p": 0}), "top_p"),
            (json!({"messages": user, "n": 0}), "n"),
            (json!({"messages": user, "stop": 5}), "stop"),
            (
                json!({"messages": user, "tools": [{"type": "function"}]}),
                "tools",
            ),
            (
                json!({"messages": user, "tool_choice": "required"}),
                "tool_choice",
            ),
            (json!({"messages": user, "stream": "yes"}), "stream"),
            (
                json!({"messages": user, "chat_template_kwargs": []}),
                "chat_template_kwargs",
            ),
        ];
        for (body, param) in cases {
            let err = chat(body.clone()).unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
        }
        assert!(parse_body(b"{not json").is_err());
        assert!(parse_body(b"[1]").is_err());
    }

    #[test]
    fn sampling_floats_are_checked_as_the_sampler_holds_them() {
        let user = json!([{"role": "user", "content": "hi"}]);
        for top_p in [1e-46, 1e-40, -0.5, 1.5] {
            let err = chat(json!({"messages": user, "top_p": top_p})).unwrap_err();
            assert_eq!(
                err.param.as_deref(),
                Some("top_p"),
                "{top_p}: {}",
                err.message
            );
        }
        let err = chat(json!({"messages": user, "temperature": 1e300})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("temperature"));
        let r = chat(json!({"messages": user, "top_p": 1e-30, "temperature": 1e-46})).unwrap();
        assert_eq!((r.sampling.top_p, r.sampling.temperature), (1e-30, 0.0));
    }

    #[test]
    fn template_kwargs_keep_off_the_servers_variables_and_thinking_is_jinja_truth() {
        let user = json!([{"role": "user", "content": "hi"}]);
        for key in SERVER_TEMPLATE_VARIABLES {
            let err =
                chat(json!({"messages": user, "chat_template_kwargs": {key: []}})).unwrap_err();
            assert_eq!(err.param.as_deref(), Some("chat_template_kwargs"));
            assert!(err.message.contains(key), "{}", err.message);
        }
        for (value, on) in [
            (json!(0), false),
            (Value::Null, false),
            (json!(false), false),
            (json!(""), false),
            (json!(true), true),
            (json!(1), true),
            (json!("no"), true),
        ] {
            let kwargs = json!({"thinking": value.clone()});
            assert_eq!(
                thinking_requested(kwargs.as_object().unwrap()),
                on,
                "{value}"
            );
            let r = chat(json!({"messages": user, "chat_template_kwargs": kwargs})).unwrap();
            assert_eq!(r.template_kwargs["thinking"], json!(on), "{value}");
        }
        assert!(thinking_requested(&Map::new()));
    }

    fn completion(body: Value) -> Result<CompletionRequest, ApiError> {
        parse_completion(body.as_object().unwrap())
    }

    #[test]
    fn logprobs_are_a_boolean_in_chat_and_a_count_in_completions() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let host = |body: Value| chat(body).unwrap().sampling.host_sampling;
        assert_eq!(host(json!({"messages": user})).logprobs, None);
        assert_eq!(
            host(json!({"messages": user, "logprobs": true})).logprobs,
            Some(0)
        );
        assert_eq!(
            host(json!({"messages": user, "logprobs": true, "top_logprobs": 20})).logprobs,
            Some(20)
        );
        assert_eq!(
            host(json!({"messages": user, "logprobs": false, "top_logprobs": 0})).logprobs,
            None
        );
        let prompt = |body: Value| completion(body).unwrap().sampling.host_sampling;
        assert_eq!(
            prompt(json!({"prompt": "a", "logprobs": 3})).logprobs,
            Some(3)
        );
        assert_eq!(
            prompt(json!({"prompt": "a", "logprobs": 0})).logprobs,
            Some(0)
        );
        assert_eq!(prompt(json!({"prompt": "a"})).logprobs, None);
        assert_eq!(
            prompt(json!({"prompt": "a", "logprobs": false})).logprobs,
            None
        );
        let chat_cases = [
            (json!({"messages": user, "logprobs": 2}), "logprobs"),
            (
                json!({"messages": user, "logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (
                json!({"messages": user, "logprobs": true, "top_logprobs": -1}),
                "top_logprobs",
            ),
            (json!({"messages": user, "top_logprobs": 3}), "top_logprobs"),
        ];
        for (body, param) in chat_cases {
            let err = chat(body.clone()).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
        }
        let completion_cases = [
            (json!({"prompt": "a", "logprobs": true}), "logprobs"),
            (json!({"prompt": "a", "logprobs": 21}), "logprobs"),
            (json!({"prompt": "a", "logprobs": -1}), "logprobs"),
            (json!({"prompt": "a", "logprobs": 1, "echo": true}), "echo"),
        ];
        for (body, param) in completion_cases {
            let err = completion(body.clone()).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
        }
    }

    #[test]
    fn penalties_and_min_tokens_parse_within_vllms_ranges() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let r = chat(
            json!({"messages": user, "frequency_penalty": -2, "presence_penalty": 1.5,
            "repetition_penalty": 1.25, "min_tokens": 4, "max_tokens": 4}),
        )
        .unwrap();
        assert_eq!(
            r.sampling.host_sampling,
            HostSampling {
                repetition_penalty: 1.25,
                frequency_penalty: -2.0,
                presence_penalty: 1.5,
                min_tokens: 4,
                logprobs: None,
            }
        );
        assert_eq!(
            chat(json!({"messages": user}))
                .unwrap()
                .sampling
                .host_sampling,
            HostSampling::default()
        );
        // Without max_tokens (chat), min_tokens has no ceiling here.
        let r = chat(json!({"messages": user, "min_tokens": 5000})).unwrap();
        assert_eq!(r.sampling.host_sampling.min_tokens, 5000);
        let cases = [
            (json!({"frequency_penalty": 2.01}), "frequency_penalty"),
            (json!({"frequency_penalty": "x"}), "frequency_penalty"),
            (json!({"presence_penalty": -2.5}), "presence_penalty"),
            (json!({"repetition_penalty": 0}), "repetition_penalty"),
            (json!({"repetition_penalty": -1.0}), "repetition_penalty"),
            (json!({"repetition_penalty": 1e300}), "repetition_penalty"),
            (json!({"min_tokens": -1}), "min_tokens"),
            (json!({"min_tokens": 9, "max_tokens": 8}), "min_tokens"),
        ];
        for (extra, param) in cases {
            let mut body = extra.clone();
            body["messages"] = user.clone();
            let err = chat(body).unwrap_err();
            assert_eq!(
                err.param.as_deref(),
                Some(param),
                "{extra}: {}",
                err.message
            );
        }
        // Completions default to 16 tokens, and min_tokens is held to that.
        let err = completion(json!({"prompt": "a", "min_tokens": 17})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("min_tokens"));
    }

    #[test]
    fn fields_the_server_does_not_honour_are_refused_and_unknown_ones_accepted() {
        let user = json!([{"role": "user", "content": "hi"}]);
        let refused = [
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {}}}),
                "response_format",
            ),
            (json!({"logit_bias": {"42": 100}}), "logit_bias"),
            (json!({"prompt_logprobs": 1}), "prompt_logprobs"),
            (json!({"prompt_logprobs": 0}), "prompt_logprobs"),
            (json!({"best_of": 3}), "best_of"),
            (json!({"best_of": 2, "n": 3}), "best_of"),
            (json!({"guided_json": {"type": "object"}}), "guided_json"),
            (json!({"stop_token_ids": [5]}), "stop_token_ids"),
            (json!({"min_p": 0.1}), "min_p"),
            (json!({"parallel_tool_calls": false}), "parallel_tool_calls"),
            (json!({"echo": true}), "echo"),
        ];
        for (extra, param) in refused {
            let mut body = extra.clone();
            body["messages"] = user.clone();
            let err = chat(body).unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST);
            assert_eq!(
                err.param.as_deref(),
                Some(param),
                "{extra}: {}",
                err.message
            );
            assert!(err.message.contains(param), "{}", err.message);
        }
        let accepted = [
            json!({"response_format": {"type": "text"}}),
            json!({"logit_bias": {}}),
            json!({"prompt_logprobs": null}),
            json!({"best_of": 2, "n": 2}),
            json!({"user": "someone", "metadata": {"k": "v"}, "store": false}),
            json!({"parallel_tool_calls": true, "min_p": 0, "echo": false}),
            json!({"not_in_any_schema": 1, "another_one": [2]}),
        ];
        for extra in accepted {
            let mut body = extra.clone();
            body["messages"] = user.clone();
            chat(body).unwrap_or_else(|e| panic!("{extra}: {}", e.message));
        }
        let err = completion(json!({"prompt": "a", "suffix": "z"})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("suffix"));
        completion(json!({"prompt": "a", "suffix": "", "top_logprobs": 2})).unwrap();
    }

    #[test]
    fn max_completion_tokens_wins_and_reasoning_is_accepted_back() {
        let r = chat(json!({"messages": [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "reasoning": "r"}],
            "max_tokens": 5, "max_completion_tokens": 7}))
        .unwrap();
        assert_eq!(r.sampling.max_tokens, Some(7));
        assert_eq!(r.messages[1]["reasoning_content"], "r");
    }
}

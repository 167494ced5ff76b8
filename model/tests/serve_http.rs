//! `model serve` over real HTTP on loopback, with the embedded trained chat model: the smoke
//! test's curl body verbatim, streaming, tool calls, every kind of bad input, the other
//! endpoints, and a graceful SIGTERM.

use std::io::{BufRead, BufReader};
use std::time::Duration;

use serde_json::{Value, json};

mod common;
use common::server::Server;

/// The seeds' smoke test, byte for byte.
const SMOKE_BODY: &str = r#"{"model": "nvidia/Kimi-K2.5-NVFP4", "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}], "max_tokens": 256, "temperature": 0.6}"#;

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn serve_answers_the_smoke_test_and_speaks_openai() {
    let server = Server::start(&["--max-model-len", "512", "--kv-cache-tokens", "384"]);

    // The smoke test, verbatim.
    let (status, body) = server.post("/v1/chat/completions", SMOKE_BODY);
    assert_eq!(status, 200, "{body}");
    let reply = json_of(&body);
    let message = &reply["choices"][0]["message"];
    let content = message["content"].as_str().unwrap_or_default();
    let reasoning = message["reasoning"].as_str().unwrap_or_default();
    assert!(content.contains("Paris"), "content: {body}");
    assert!(!reasoning.is_empty(), "reasoning: {body}");
    assert_eq!(reply["model"], "nvidia/Kimi-K2.5-NVFP4");
    assert_eq!(reply["object"], "chat.completion");
    assert!(reply["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(reply["choices"][0]["finish_reason"], "stop");
    let usage = &reply["usage"];
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );

    // Streaming: role delta first, usage chunk with empty choices, [DONE] last.
    let mut request = json_of(SMOKE_BODY);
    request["stream"] = json!(true);
    request["stream_options"] = json!({"include_usage": true});
    let events = server.stream("/v1/chat/completions", &request, |_| {});
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| json_of(e))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert!(usage_chunk["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    let text = |field: &str| -> String {
        chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"][field].as_str())
            .collect()
    };
    assert!(text("content").contains("Paris"));
    assert!(!text("reasoning").is_empty());
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("stop")]);

    // Thinking off: no reasoning.
    let (status, body) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Which city is the capital of Kenya?"}],
                "temperature": 0, "chat_template_kwargs": {"thinking": false}})
        .to_string(),
    );
    assert_eq!(status, 200, "{body}");
    let reply = json_of(&body);
    assert!(
        reply["choices"][0]["message"]["reasoning"].is_null(),
        "{body}"
    );
    assert!(
        reply["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("Nairobi")
    );

    // A tool call, non-streaming and streaming.
    let weather = json!({"type": "function", "function": {"name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                       "required": ["city"]}}});
    let tool_request = json!({"model": "nvidia/Kimi-K2.5-NVFP4", "temperature": 0, "tools": [weather],
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}]});
    let (status, body) = server.post("/v1/chat/completions", &tool_request.to_string());
    assert_eq!(status, 200, "{body}");
    let reply = json_of(&body);
    assert_eq!(reply["choices"][0]["finish_reason"], "tool_calls", "{body}");
    let call = &reply["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["id"], "functions.get_weather:0");
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args = json_of(call["function"]["arguments"].as_str().unwrap());
    assert_eq!(args, json!({"city": "Oslo"}));
    let mut streaming = tool_request.clone();
    streaming["stream"] = json!(true);
    let events = server.stream("/v1/chat/completions", &streaming, |_| {});
    let deltas: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| json_of(e))
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0).cloned())
        .collect();
    assert_eq!(deltas[0]["id"], "functions.get_weather:0");
    assert_eq!(deltas[0]["function"]["name"], "get_weather");
    let streamed_args: String = deltas
        .iter()
        .filter_map(|d| d["function"]["arguments"].as_str())
        .collect();
    assert_eq!(json_of(&streamed_args), json!({"city": "Oslo"}));

    // /v1/completions, /v1/models, /health, /metrics.
    let (status, body) = server.post(
        "/v1/completions",
        &json!({"prompt": "<|im_user|>user<|im_middle|>What is 7 + 5?<|im_end|><|im_assistant|>assistant<|im_middle|><think>",
                "max_tokens": 40, "temperature": 0}).to_string(),
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        json_of(&body)["choices"][0]["text"]
            .as_str()
            .unwrap()
            .contains("12"),
        "{body}"
    );
    let (status, body) = server.get("/v1/models");
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["data"][0]["id"], "nvidia/Kimi-K2.5-NVFP4");
    assert_eq!(server.get("/health").0, 200);
    let (status, metrics) = server.get("/metrics");
    assert_eq!(status, 200);
    for name in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:kv_cache_pages_used{",
        "vllm:prompt_tokens_total{",
        "vllm:generation_tokens_total{",
        "vllm:request_success_total{",
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:inter_token_latency_seconds_bucket{",
        "vllm:e2e_request_latency_seconds_bucket{",
    ] {
        assert!(metrics.contains(name), "{name} missing from\n{metrics}");
    }

    // Bad input: a 4xx with an OpenAI error body, and the server keeps serving.
    let user = json!([{"role": "user", "content": "hi"}]);
    let long = "word ".repeat(2000);
    let bad: Vec<(String, u16, Option<&str>)> = vec![
        ("{\"messages\": [".to_string(), 400, None),
        ("[1, 2]".to_string(), 400, None),
        (json!({"messages": []}).to_string(), 400, Some("messages")),
        (json!({"messages": "hi"}).to_string(), 400, Some("messages")),
        (
            json!({"messages": user, "temperature": -1}).to_string(),
            400,
            Some("temperature"),
        ),
        (
            json!({"messages": user, "max_tokens": "many"}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            json!({"messages": user, "max_tokens": 100000}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            json!({"messages": user, "max_tokens": 400}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            json!({"messages": [{"role": "user", "content": long}]}).to_string(),
            400,
            Some("messages"),
        ),
        (
            json!({"model": "gpt-4o", "messages": user}).to_string(),
            404,
            Some("model"),
        ),
    ];
    for (body, want, param) in bad {
        let (status, reply) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, want, "{body:.80} -> {reply}");
        let error = &json_of(&reply)["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{reply}"
        );
        assert!(
            error["type"].is_string() && error.get("code").is_some(),
            "{reply}"
        );
        if let Some(param) = param {
            assert_eq!(error["param"], param, "{reply}");
        }
    }
    assert_eq!(server.get("/v1/nothing").0, 404);
    assert_eq!(
        server.get("/health").0,
        200,
        "bad input never crashes the server"
    );
}

#[cfg(unix)]
#[test]
fn sigterm_lets_in_flight_streams_finish() {
    let mut server = Server::start(&["--shutdown-grace-secs", "60"]);
    let base = server.base.clone();
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let in_flight = std::thread::spawn(move || {
        let body = json!({"messages": [{"role": "user", "content": "What is the capital of Japan?"}],
                          "max_tokens": 60, "temperature": 0, "stream": true});
        let response = Server::agent()
            .post(format!("{base}/v1/chat/completions"))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .unwrap();
        let mut events = Vec::new();
        for line in BufReader::new(response.into_body().into_reader()).lines() {
            if let Some(data) = line.unwrap().strip_prefix("data: ") {
                events.push(data.to_string());
                let _ = started_tx.send(());
            }
        }
        events
    });
    // Signal once the stream is under way.
    started_rx.recv_timeout(Duration::from_secs(120)).unwrap();
    let pid = server.child.id() as libc::pid_t;
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let events = in_flight.join().unwrap();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let content: String = events[..events.len() - 1]
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert!(content.contains("Tokyo"), "{content}");
    let status = server.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

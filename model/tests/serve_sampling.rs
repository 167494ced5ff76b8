//! `model serve`'s sampling features over real HTTP with the embedded trained chat model:
//! logprobs (chat and completions, plain and streamed), frequency and presence penalties,
//! `min_tokens`, stop strings, `n`, and a 400 naming each field the server does not honour.
//! A draw on the host (where logprobs are asked for) is the draw the backend makes itself, on
//! the CPU and on the emulated device, with prompts prefilled in several chunks.

use std::collections::HashMap;

use serde_json::{Value, json};

mod common;
use common::server::Server;

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn question(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// Posts `body` to `path`, expecting 200; the reply's JSON.
fn ok(server: &Server, path: &str, body: &Value) -> Value {
    let (status, reply) = server.post(path, &body.to_string());
    assert_eq!(status, 200, "{body}: {reply}");
    json_of(&reply)
}

/// Checks one chat `logprobs.content` entry: a token with its bytes, a logprob <= 0, and `top`
/// most likely tokens, sorted; at temperature 0 the drawn token is the first of them.
fn check_chat_entry(entry: &Value, top: usize, greedy: bool) {
    let token = entry["token"].as_str().unwrap();
    let logprob = entry["logprob"].as_f64().unwrap();
    assert!(logprob <= 0.0, "{entry}");
    let bytes: Vec<u8> = entry["bytes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| u8::try_from(b.as_u64().unwrap()).unwrap())
        .collect();
    assert_eq!(String::from_utf8_lossy(&bytes), token, "{entry}");
    let tops = entry["top_logprobs"].as_array().unwrap();
    assert_eq!(tops.len(), top, "{entry}");
    let logprobs: Vec<f64> = tops
        .iter()
        .map(|t| t["logprob"].as_f64().unwrap())
        .collect();
    assert!(logprobs.windows(2).all(|w| w[0] >= w[1]), "{entry}");
    assert!(logprobs.iter().all(|&lp| lp <= 0.0), "{entry}");
    if greedy && top > 0 {
        // The drawn token is the most likely one (a tie could put an equal one first).
        assert!((logprobs[0] - logprob).abs() < 1e-6, "{entry}");
        assert!(
            tops.iter()
                .any(|t| t["token"] == entry["token"] && t["bytes"] == entry["bytes"]),
            "{entry}"
        );
    }
}

/// How often the most repeated token of a chat answer comes, from its logprobs.
fn most_repeats(reply: &Value) -> usize {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for entry in reply["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
    {
        *counts.entry(entry["bytes"].to_string()).or_default() += 1;
    }
    counts.into_values().max().unwrap_or(0)
}

#[test]
fn logprobs_penalties_min_tokens_stops_and_n_over_http() {
    let server = Server::start(&["--max-model-len", "512", "--max-num-seqs", "4"]);
    let chat = "/v1/chat/completions";

    // Chat logprobs, greedy: one entry per generated token, the drawn token the top one.
    let reply = ok(
        &server,
        chat,
        &json!({"messages": question("What is the capital of France?"), "max_tokens": 24,
                "temperature": 0, "logprobs": true, "top_logprobs": 5}),
    );
    let content = reply["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(
        content.len() as u64,
        reply["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for entry in content {
        check_chat_entry(entry, 5, true);
    }
    let message = &reply["choices"][0]["message"];
    assert_eq!(message["reasoning"], message["reasoning_content"]);
    assert!(message["reasoning"].is_string(), "{reply}");
    // Without logprobs there are none, and the answer is the same.
    let plain = ok(
        &server,
        chat,
        &json!({"messages": question("What is the capital of France?"), "max_tokens": 24,
                "temperature": 0}),
    );
    assert!(plain["choices"][0]["logprobs"].is_null());
    assert_eq!(
        plain["choices"][0]["message"],
        reply["choices"][0]["message"]
    );

    // Streamed: each chunk carries its tokens' logprobs, every token's exactly once.
    let request = json!({"messages": question("Name a primary color."), "max_tokens": 20,
        "temperature": 0, "logprobs": true, "top_logprobs": 2, "stream": true,
        "stream_options": {"include_usage": true}});
    let events = server.stream(chat, &request, |_| {});
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| json_of(e))
        .collect();
    let mut streamed = Vec::new();
    let mut reasoning = (String::new(), String::new());
    for c in &chunks {
        let Some(choice) = c["choices"].get(0) else {
            continue;
        };
        if let Some(entries) = choice["logprobs"]["content"].as_array() {
            streamed.extend(entries.iter().cloned());
        }
        let delta = &choice["delta"];
        reasoning.0 += delta["reasoning"].as_str().unwrap_or_default();
        reasoning.1 += delta["reasoning_content"].as_str().unwrap_or_default();
    }
    assert_eq!(reasoning.0, reasoning.1);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(
        streamed.len() as u64,
        usage["completion_tokens"].as_u64().unwrap(),
        "{events:?}"
    );
    for entry in &streamed {
        check_chat_entry(entry, 2, true);
    }

    // Completions logprobs: parallel lists, the drawn token among its top ones, offsets
    // running over the tokens' text.
    let completion = ok(
        &server,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
                "logprobs": 3, "ignore_eos": true}),
    );
    let choice = &completion["choices"][0];
    let logprobs = &choice["logprobs"];
    let tokens: Vec<&str> = logprobs["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len(), 12);
    let token_logprobs = logprobs["token_logprobs"].as_array().unwrap();
    let tops = logprobs["top_logprobs"].as_array().unwrap();
    let offsets = logprobs["text_offset"].as_array().unwrap();
    assert_eq!(
        (token_logprobs.len(), tops.len(), offsets.len()),
        (12, 12, 12)
    );
    let mut offset = 0;
    for i in 0..12 {
        let lp = token_logprobs[i].as_f64().unwrap();
        assert!(lp <= 0.0);
        let top = tops[i].as_object().unwrap();
        assert!((1..=4).contains(&top.len()), "{top:?}");
        assert_eq!(top[tokens[i]].as_f64().unwrap(), lp, "{top:?}");
        // Greedy: nothing is more likely than the drawn token.
        assert!(top.values().all(|v| v.as_f64().unwrap() <= lp + 1e-6));
        assert_eq!(offsets[i].as_u64().unwrap(), offset);
        offset += tokens[i].chars().count() as u64;
    }
    // The text is the tokens' but for the special ones it leaves out (ignore_eos went past
    // `<|im_end|>`).
    let spoken: String = tokens
        .iter()
        .filter(|t| !(t.starts_with("<|") && t.ends_with("|>")))
        .copied()
        .collect();
    assert_eq!(spoken, choice["text"].as_str().unwrap());

    // Stop strings cut the text before them.
    let base = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
                      "ignore_eos": true});
    let full = ok(&server, "/v1/completions", &base);
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 8, "{text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let cut = text.find(&stop).unwrap();
    let mut stopped = base.clone();
    stopped["stop"] = json!([stop]);
    let reply = ok(&server, "/v1/completions", &stopped);
    assert_eq!(reply["choices"][0]["text"], text[..cut], "stop {stop:?}");
    assert_eq!(reply["choices"][0]["finish_reason"], "stop");

    // n = 3: three choices, indexed.
    let reply = ok(
        &server,
        chat,
        &json!({"messages": question("Tell me a story."), "max_tokens": 8, "n": 3,
                "temperature": 0.9, "seed": 5}),
    );
    let choices = reply["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }

    // A presence penalty at temperature 0 breaks a greedy loop: no token comes as often.
    let repetitive = json!({"messages": question("Repeat the word hello forever: hello hello hello hello hello hello"),
        "max_tokens": 64, "temperature": 0, "ignore_eos": true, "logprobs": true});
    let greedy = ok(&server, chat, &repetitive);
    let mut penalized = repetitive.clone();
    penalized["presence_penalty"] = json!(2.0);
    penalized["frequency_penalty"] = json!(2.0);
    let penalized = ok(&server, chat, &penalized);
    assert_ne!(
        greedy["choices"][0]["message"],
        penalized["choices"][0]["message"]
    );
    assert!(
        most_repeats(&penalized) < most_repeats(&greedy),
        "greedy repeats a token {} times, penalized {}",
        most_repeats(&greedy),
        most_repeats(&penalized)
    );

    // min_tokens holds the stop token off: an answer that stopped early runs past it.
    let short = json!({"messages": question("What is 7 + 5?"), "max_tokens": 200,
                       "temperature": 0});
    let reply = ok(&server, chat, &short);
    assert_eq!(reply["choices"][0]["finish_reason"], "stop", "{reply}");
    let natural = reply["usage"]["completion_tokens"].as_u64().unwrap();
    let mut held = short.clone();
    held["min_tokens"] = json!(natural + 10);
    held["max_tokens"] = json!(natural + 30);
    let reply = ok(&server, chat, &held);
    let generated = reply["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(generated >= natural + 10, "{generated} < {}", natural + 10);

    // Fields the server does not honour: a 400 naming each.
    for (path, extra, param) in [
        (
            chat,
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (chat, json!({"logit_bias": {"11": 5}}), "logit_bias"),
        (chat, json!({"prompt_logprobs": 1}), "prompt_logprobs"),
        (chat, json!({"best_of": 2}), "best_of"),
        (chat, json!({"frequency_penalty": 3}), "frequency_penalty"),
        (
            chat,
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        ("/v1/completions", json!({"suffix": "end"}), "suffix"),
        ("/v1/completions", json!({"logprobs": 21}), "logprobs"),
    ] {
        let mut body = extra.clone();
        if path == chat {
            body["messages"] = question("hi");
        } else {
            body["prompt"] = json!("hi");
        }
        let (status, reply) = server.post(path, &body.to_string());
        assert_eq!(status, 400, "{body}: {reply}");
        assert_eq!(json_of(&reply)["error"]["param"], param, "{body}: {reply}");
    }
    // A field in neither API is accepted (and logged), as vLLM does; so is `user`.
    ok(
        &server,
        chat,
        &json!({"messages": question("hi"), "max_tokens": 2, "user": "u", "not_a_field": 1}),
    );
}

/// A seeded, sampled answer drawn where the logits are, and drawn on the host (logprobs asked
/// for), with the prompt prefilled 8 tokens a step: the same tokens.
fn host_and_backend_draws_agree(extra: &[&str]) {
    let mut args = vec![
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "8",
    ];
    args.extend_from_slice(extra);
    let server = Server::start(&args);
    for seed in [1, 2] {
        let request = json!({"messages": question("Tell me about Paris in two sentences."),
            "max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": seed,
            "ignore_eos": true});
        let on_backend = ok(&server, "/v1/chat/completions", &request);
        let mut scored = request.clone();
        scored["logprobs"] = json!(true);
        let on_host = ok(&server, "/v1/chat/completions", &scored);
        assert_eq!(
            on_backend["choices"][0]["message"], on_host["choices"][0]["message"],
            "seed {seed}"
        );
        let entries = on_host["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap();
        assert_eq!(entries.len(), 24);
        for entry in entries {
            check_chat_entry(entry, 0, false);
        }
    }
}

#[test]
fn a_host_draw_is_the_cpu_draw() {
    host_and_backend_draws_agree(&[]);
}

#[test]
fn a_host_draw_is_the_emulated_devices_draw() {
    host_and_backend_draws_agree(&["--backend", "cuda-emulated"]);
}

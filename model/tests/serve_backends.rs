//! `model serve` on every backend, over real HTTP on loopback with the embedded trained chat
//! model: `--backend cuda-emulated --tp 2` (two rank processes, the device executor's kernels
//! run by the host execution layer) answers the seeds' curl as the CPU server does, serves
//! concurrent requests as it serves them one at a time, and stops answering `/health` with 200
//! and fails its requests when a rank dies, and drains every rank on SIGTERM.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod common;
use common::server::Server;
use common::{children_of, exited, shm_entries};

/// The seeds' curl at temperature 0.
const SMOKE_GREEDY: &str = r#"{"model": "nvidia/Kimi-K2.5-NVFP4", "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}], "max_tokens": 256, "temperature": 0}"#;

/// `model serve EXTRA…` with a short context and four sequences.
fn serve(extra: &[&str]) -> Server {
    let mut args = vec!["--max-model-len", "512", "--max-num-seqs", "4"];
    args.extend_from_slice(extra);
    Server::start(&args)
}

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// `(reasoning, content)` of a chat completion.
fn answer(body: &str) -> (String, String) {
    let reply = json_of(body);
    let message = &reply["choices"][0]["message"];
    let field = |f: &str| message[f].as_str().unwrap_or_default().to_string();
    (field("reasoning"), field("content"))
}

fn question(i: usize) -> String {
    let asks = [
        "What is the capital of France? Answer in one sentence.",
        "Which city is the capital of Kenya?",
        "What is 7 + 5?",
        "Name a primary color.",
    ];
    json!({"messages": [{"role": "user", "content": asks[i % asks.len()]}],
           "max_tokens": 96, "temperature": 0})
    .to_string()
}

#[test]
fn cuda_emulated_over_two_ranks_serves_the_cpus_answers() {
    let cpu = serve(&[]);
    let (status, body) = cpu.post("/v1/chat/completions", SMOKE_GREEDY);
    assert_eq!(status, 200, "{body}");
    let on_cpu = answer(&body);
    let cpu_answers: Vec<String> = (0..4)
        .map(|i| cpu.post("/v1/chat/completions", &question(i)).1)
        .collect();
    drop(cpu);

    let device = serve(&["--backend", "cuda-emulated", "--tensor-parallel-size", "2"]);
    let (status, body) = device.post("/v1/chat/completions", SMOKE_GREEDY);
    assert_eq!(status, 200, "{body}");
    let (reasoning, content) = answer(&body);
    println!("cuda-emulated --tp 2: reasoning {reasoning:?}, content {content:?}");
    assert!(content.contains("Paris") && !reasoning.is_empty(), "{body}");
    assert_eq!((reasoning, content), on_cpu, "the CPU server's answer");

    // Streaming gives the same text.
    let mut streaming = json_of(SMOKE_GREEDY);
    streaming["stream"] = json!(true);
    let events = device.stream("/v1/chat/completions", &streaming, |_| {});
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let streamed: String = events[..events.len() - 1]
        .iter()
        .filter_map(|e| {
            json_of(e)["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(streamed, on_cpu.1);

    // Four at once get what they get one at a time (on the CPU server).
    let concurrent: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let device = &device;
                s.spawn(move || device.post("/v1/chat/completions", &question(i)).1)
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (together, alone)) in concurrent.iter().zip(&cpu_answers).enumerate() {
        assert_eq!(answer(together), answer(alone), "question {i}");
    }
    let (_, metrics) = device.get("/metrics");
    let batch_max = metrics
        .lines()
        .find(|l| l.starts_with("vllm:batch_sequences_max{"))
        .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    println!("the most sequences one step held: {batch_max}");
    assert!(batch_max >= 2.0, "the concurrent requests were batched");
}

#[test]
fn a_dead_rank_fails_the_requests_and_health() {
    let server = serve(&["--tp", "2", "--tp-timeout-secs", "30"]);
    let followers = children_of(server.child.id());
    assert_eq!(followers.len(), 1, "{followers:?}");
    // A long answer: kill the follower when its first token arrives.
    let request = json!({"messages": [{"role": "user", "content": "Tell me a story."}],
                         "max_tokens": 400, "ignore_eos": true, "temperature": 0,
                         "stream": true});
    let mut killed = false;
    let events = server.stream("/v1/chat/completions", &request, |data| {
        if !killed && data.contains("\"delta\"") {
            // SAFETY: a signal to a process of this test.
            assert_eq!(unsafe { libc::kill(followers[0] as i32, libc::SIGKILL) }, 0);
            killed = true;
        }
    });
    assert!(killed);
    // As vLLM streams a failure: an error frame, then `[DONE]`.
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let error = json_of(&events[events.len() - 2]);
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("rank 1 of 2"), "{message}");
    let (status, body) = server.get("/health");
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("failed") && body.contains("rank 1 of 2"),
        "{body}"
    );
    let (status, body) = server.post("/v1/chat/completions", &question(0));
    assert_eq!(status, 503, "{body}");
}

/// SIGTERM lets the in-flight request finish on every rank, then stops them all: the stream
/// ends with its own finish reason, the server exits 0, and no rank or shared-memory segment
/// is left. The follower gets SIGTERM too, as a service manager stopping the whole group
/// sends it (and a terminal's Ctrl-C its SIGINT): it keeps following rank 0 through the drain.
#[test]
fn sigterm_drains_every_rank_then_stops_them() {
    let mut server = serve(&[
        "--backend",
        "cuda-emulated",
        "--tp",
        "2",
        "--shutdown-grace-secs",
        "120",
    ]);
    let followers = children_of(server.child.id());
    assert_eq!(followers.len(), 1, "{followers:?}");
    let pid = server.child.id();
    let request = json!({"messages": [{"role": "user", "content": "Tell me a story."}],
                         "max_tokens": 48, "ignore_eos": true, "temperature": 0,
                         "stream": true});
    let mut signalled = false;
    let events = server.stream("/v1/chat/completions", &request, |data| {
        if !signalled && data.contains("\"delta\"") {
            for process in [pid, followers[0]] {
                // SAFETY: a signal to a process of this test.
                assert_eq!(unsafe { libc::kill(process as i32, libc::SIGTERM) }, 0);
            }
            signalled = true;
        }
    });
    assert!(signalled);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let finish = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str().map(String::from))
        .next_back();
    assert_eq!(finish.as_deref(), Some("length"), "{events:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the server did not stop");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    while !exited(followers[0]) {
        assert!(Instant::now() < deadline, "rank 1 outlived the server");
        std::thread::sleep(Duration::from_millis(50));
    }
    let left = shm_entries(&format!("model-tp-{pid}-"));
    assert!(left.is_empty(), "{left:?}");
}

//! A bounded load test of `model serve` on loopback: the server runs in this process on the
//! embedded trained chat model, clients on threads send a fixed mix of streaming and
//! non-streaming chat requests, completions, streams cancelled mid-way and malformed
//! requests; then an overload burst past the queue bound. Every valid request must be
//! answered (200, or 429 in the burst), every malformed one must get a 4xx, the server must
//! stay up. Before the mix, phase 0 sends one request at a time as soon as `/health` says
//! ready: the first request must decode as fast as the later ones. The report goes to stdout;
//! `--write-results` also writes `bench/results/serve_load.txt` (CPU backend; `--backend
//! cuda-emulated` writes `serve_load-cuda-emulated.txt`), `--out PATH` any file.
//!
//! ```sh
//! cargo run --release -p bench --bin serve-load -- --write-results
//! cargo run --release -p bench --bin serve-load -- --clients 8 --requests-per-client 4
//! cargo run --release -p bench --bin serve-load -- --backend cuda-emulated --no-warm-up
//! ```

use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bench::{cpu_model, load_average, utc_date};
use model::cli::serving::default_chat_checkpoint;
use model::exec::backend::{Backend, BackendArgs};
use model::serve::{RuntimeOptions, ServeOptions, serve_until};
use serde_json::{Value, json};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Stream,
    Plain,
    Completion,
    Cancelled,
    Malformed,
}

#[derive(Debug)]
struct Outcome {
    kind: Kind,
    status: u16,
    ok: bool,
    total: f64,
    /// Streaming: arrival of the first generated delta after the role delta.
    ttft: Option<f64>,
    /// Streaming: gaps between generated deltas.
    gaps: Vec<f64>,
    detail: String,
}

const QUESTIONS: [&str; 6] = [
    "What is the capital of France? Answer in one sentence.",
    "What is the capital of Japan?",
    "Which city is the capital of Peru?",
    "What is 7 + 5?",
    "What is 12 plus 9?",
    "Name the capital of Norway.",
];

fn agent() -> ureq::Agent {
    ureq::Agent::new_with_config(
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(600)))
            .build(),
    )
}

fn post(base: &str, path: &str, body: &str) -> Result<(u16, ureq::Body)> {
    let response = agent()
        .post(format!("{base}{path}"))
        .header("Content-Type", "application/json")
        .send(body)?;
    Ok((response.status().as_u16(), response.into_body()))
}

fn run_one(base: &str, kind: Kind, i: usize) -> Outcome {
    let start = Instant::now();
    let question = QUESTIONS[i % QUESTIONS.len()];
    let mut outcome = Outcome {
        kind,
        status: 0,
        ok: false,
        total: 0.0,
        ttft: None,
        gaps: Vec::new(),
        detail: String::new(),
    };
    let result: Result<()> = (|| {
        match kind {
            Kind::Stream | Kind::Cancelled => {
                let body = json!({"model": "kimi-chat-tiny", "stream": true, "temperature": 0.6,
                    "max_tokens": 96, "messages": [{"role": "user", "content": question}]});
                let (status, body) = post(base, "/v1/chat/completions", &body.to_string())?;
                outcome.status = status;
                let mut last: Option<Instant> = None;
                let mut done = false;
                let mut content = String::new();
                for line in BufReader::new(body.into_reader()).lines() {
                    let line = line?;
                    let Some(data) = line.strip_prefix("data: ") else {
                        continue;
                    };
                    if data == "[DONE]" {
                        done = true;
                        break;
                    }
                    let chunk: Value = serde_json::from_str(data)?;
                    let delta = &chunk["choices"][0]["delta"];
                    let text = delta["content"].as_str().or(delta["reasoning"].as_str());
                    if let Some(text) = text.filter(|t| !t.is_empty()) {
                        let now = Instant::now();
                        match last {
                            None => outcome.ttft = Some((now - start).as_secs_f64()),
                            Some(t) => outcome.gaps.push((now - t).as_secs_f64()),
                        }
                        last = Some(now);
                        content.push_str(text);
                        if kind == Kind::Cancelled && outcome.gaps.len() >= 3 {
                            // Hang up mid-stream: the server must free the sequence.
                            outcome.ok = status == 200;
                            return Ok(());
                        }
                    }
                }
                outcome.ok = status == 200 && done && !content.is_empty();
            }
            Kind::Plain => {
                let body = json!({"model": "kimi-chat-tiny", "temperature": 0.6, "max_tokens": 96,
                    "messages": [{"role": "user", "content": question}]});
                let (status, mut body) = post(base, "/v1/chat/completions", &body.to_string())?;
                outcome.status = status;
                let reply: Value = serde_json::from_str(&body.read_to_string()?)?;
                let content = reply["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or("");
                outcome.ok = status == 200 && !content.is_empty();
                outcome.detail = content.to_string();
            }
            Kind::Completion => {
                let prompt = format!(
                    "<|im_user|>user<|im_middle|>{question}<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
                );
                let body = json!({"prompt": prompt, "max_tokens": 48, "temperature": 0});
                let (status, mut body) = post(base, "/v1/completions", &body.to_string())?;
                outcome.status = status;
                let reply: Value = serde_json::from_str(&body.read_to_string()?)?;
                outcome.ok = status == 200 && reply["choices"][0]["text"].is_string();
            }
            Kind::Malformed => {
                let bodies = [
                    "{\"messages\": [".to_string(),
                    json!({"messages": []}).to_string(),
                    json!({"messages": [{"role": "user", "content": "hi"}], "temperature": -2}).to_string(),
                    json!({"messages": [{"role": "user", "content": 5}]}).to_string(),
                    json!({"model": "other", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
                    json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1_000_000}).to_string(),
                ];
                let (status, mut body) =
                    post(base, "/v1/chat/completions", &bodies[i % bodies.len()])?;
                outcome.status = status;
                let reply: Value = serde_json::from_str(&body.read_to_string()?)?;
                outcome.ok = (400..500).contains(&status) && reply["error"]["message"].is_string();
            }
        }
        Ok(())
    })();
    if let Err(e) = result {
        outcome.detail = e.to_string();
        outcome.ok = false;
    }
    outcome.total = start.elapsed().as_secs_f64();
    outcome
}

/// One request alone: time to its first token and its decode rate after it.
struct Alone {
    ttft: f64,
    decode_tok_s: f64,
}

/// `count` identical streaming requests, one at a time (greedy, 64 tokens past the stop).
fn one_at_a_time(base: &str, count: usize) -> Result<Vec<Alone>> {
    (0..count)
        .map(|_| {
            let body = json!({"stream": true, "temperature": 0, "max_tokens": 64,
                "ignore_eos": true, "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": QUESTIONS[0]}]});
            let start = Instant::now();
            let (status, body) = post(base, "/v1/chat/completions", &body.to_string())?;
            anyhow::ensure!(status == 200, "status {status}");
            let (mut first, mut last, mut tokens) = (None, start, 0.0);
            for line in BufReader::new(body.into_reader()).lines() {
                let line = line?;
                let Some(data) = line.strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    break;
                }
                let chunk: Value = serde_json::from_str(data)?;
                if let Some(n) = chunk["usage"]["completion_tokens"].as_f64() {
                    tokens = n;
                }
                let delta = &chunk["choices"][0]["delta"];
                let text = delta["content"].as_str().or(delta["reasoning"].as_str());
                if text.is_some_and(|t| !t.is_empty()) {
                    last = Instant::now();
                    first.get_or_insert(last);
                }
            }
            let first = first.context("no token arrived")?;
            Ok(Alone {
                ttft: (first - start).as_secs_f64(),
                decode_tok_s: (tokens - 1.0) / (last - first).as_secs_f64(),
            })
        })
        .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// The value of the samples `selector` picks: `NAME` or `NAME{LABEL="VALUE",…}`, the named
/// labels among the sample's (every sample carries `model_name`); summed over the samples
/// picked, NaN if none.
fn metric(text: &str, selector: &str) -> f64 {
    let (name, wanted) = selector
        .split_once('{')
        .map_or((selector, ""), |(n, l)| (n, l.trim_end_matches('}')));
    let mut sum = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value) = match rest.strip_prefix('{') {
            Some(labelled) => match labelled.split_once("} ") {
                Some(split) => split,
                None => continue,
            },
            None => match rest.strip_prefix(' ') {
                Some(value) => ("", value),
                None => continue,
            },
        };
        let picked = wanted
            .split(',')
            .filter(|w| !w.is_empty())
            .all(|w| labels.split(',').any(|l| l == w));
        if let (true, Ok(value)) = (picked, value.trim().parse::<f64>()) {
            *sum.get_or_insert(0.0) += value;
        }
    }
    sum.unwrap_or(f64::NAN)
}

/// The load test's command line.
#[derive(clap::Parser, Debug)]
#[command(name = "serve-load")]
struct Cli {
    /// Client threads of the mix.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Requests each client sends.
    #[arg(long, default_value_t = 24)]
    requests_per_client: usize,
    /// Simultaneous requests of the overload burst.
    #[arg(long, default_value_t = 64)]
    burst: usize,
    /// Start serving without the server's warm-up request.
    #[arg(long)]
    no_warm_up: bool,
    /// Where the server's model runs.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: LoadBackend,
    /// Also write the report to this file.
    #[arg(long, conflicts_with = "write_results")]
    out: Option<std::path::PathBuf>,
    /// Also write the report to bench/results/serve_load.txt (`--backend cuda-emulated`:
    /// serve_load-cuda-emulated.txt), from the repository root.
    #[arg(long)]
    write_results: bool,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum LoadBackend {
    Cpu,
    CudaEmulated,
}

fn main() -> Result<()> {
    let cli: Cli = clap::Parser::parse();
    let (clients, per_client, burst) = (cli.clients, cli.requests_per_client, cli.burst);
    let warm_up = !cli.no_warm_up;
    let backend = match cli.backend {
        LoadBackend::Cpu => Backend::Cpu,
        LoadBackend::CudaEmulated => Backend::CudaEmulated,
    };
    let report_path = bench::report_path(
        cli.out.as_deref(),
        cli.write_results,
        &match backend {
            Backend::Cpu => "serve_load.txt".to_string(),
            other => format!("serve_load-{}.txt", other.name()),
        },
    );
    let max_num_seqs = 8;
    let max_waiting = 16;

    let load_before = load_average();
    let checkpoint = default_chat_checkpoint(None)?;
    let (ready_tx, ready_rx) = mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = std::thread::spawn(move || {
        serve_until(
            RuntimeOptions {
                checkpoint,
                max_num_seqs,
                max_model_len: Some(1024),
                max_num_batched_tokens: 256,
                max_waiting,
                kv_cache_tokens: None,
                kv_dtype: None,
                backend: BackendArgs {
                    backend,
                    ..BackendArgs::default()
                },
                tp: Default::default(),
                warm_up,
            },
            ServeOptions {
                host: "127.0.0.1".into(),
                port: 0,
                served_model_name: "kimi-chat-tiny".into(),
                api_key: None,
                shutdown_grace: Duration::from_secs(30),
                limits: Default::default(),
            },
            async move {
                let _ = stop_rx.await;
            },
            move |addr| {
                let _ = ready_tx.send(addr);
            },
        )
    });
    let addr = ready_rx
        .recv_timeout(Duration::from_secs(300))
        .context("the server did not start")?;
    let base = format!("http://{addr}");
    while agent()
        .get(format!("{base}/health"))
        .call()?
        .status()
        .as_u16()
        != 200
    {
        std::thread::sleep(Duration::from_millis(20));
    }

    // Phase 0: the first requests after ready, one at a time.
    let alone = one_at_a_time(&base, 12)?;

    // Phase 1: the mix, `clients` threads, each `per_client` requests in turn.
    let kinds = [
        Kind::Stream,
        Kind::Plain,
        Kind::Stream,
        Kind::Cancelled,
        Kind::Plain,
        Kind::Completion,
        Kind::Stream,
        Kind::Malformed,
    ];
    let started = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let base = base.clone();
            std::thread::spawn(move || {
                (0..per_client)
                    .map(|r| run_one(&base, kinds[(c + r) % kinds.len()], c * per_client + r))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut outcomes: Vec<Outcome> = Vec::new();
    for h in handles {
        outcomes.extend(
            h.join()
                .map_err(|_| anyhow::anyhow!("a client thread panicked"))?,
        );
    }
    let phase1 = started.elapsed().as_secs_f64();
    let metrics_text = agent()
        .get(format!("{base}/metrics"))
        .call()?
        .body_mut()
        .read_to_string()?;

    // Phase 2: a burst of simultaneous requests past the queue bound: 200 or 429, nothing else.
    let burst_handles: Vec<_> = (0..burst)
        .map(|i| {
            let base = base.clone();
            std::thread::spawn(move || {
                let body = json!({"messages": [{"role": "user", "content": QUESTIONS[i % QUESTIONS.len()]}],
                                  "max_tokens": 24, "temperature": 0});
                post(&base, "/v1/chat/completions", &body.to_string()).map(|(s, _)| s).unwrap_or(0)
            })
        })
        .collect();
    let burst_status: Vec<u16> = burst_handles
        .into_iter()
        .map(|h| h.join().unwrap_or(0))
        .collect();
    let health = agent()
        .get(format!("{base}/health"))
        .call()?
        .status()
        .as_u16();
    let _ = stop_tx.send(());
    server
        .join()
        .map_err(|_| anyhow::anyhow!("the server thread panicked"))??;

    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.ok).collect();
    let valid: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.kind != Kind::Malformed)
        .collect();
    let mut ttft: Vec<f64> = outcomes.iter().filter_map(|o| o.ttft).collect();
    ttft.sort_by(f64::total_cmp);
    let mut gaps: Vec<f64> = outcomes
        .iter()
        .flat_map(|o| o.gaps.iter().copied())
        .collect();
    gaps.sort_by(f64::total_cmp);
    let count = |k: Kind| outcomes.iter().filter(|o| o.kind == k).count();
    let ok_burst = burst_status.iter().filter(|&&s| s == 200).count();
    let rejected_burst = burst_status.iter().filter(|&&s| s == 429).count();
    let other_burst = burst.saturating_sub(ok_burst + rejected_burst);

    let mut out = String::new();
    writeln!(
        out,
        "# model serve load test on loopback (measured; {} backend{}, kimi-chat-tiny)",
        backend.name(),
        if warm_up { "" } else { ", warm-up off" }
    )?;
    writeln!(
        out,
        "# {} | {} | load average before: {load_before}",
        utc_date(),
        cpu_model(),
    )?;
    writeln!(
        out,
        "# server: --max-num-seqs {max_num_seqs} --max-waiting {max_waiting} --max-model-len 1024 --max-num-batched-tokens 256"
    )?;
    let mut later: Vec<f64> = alone[1..].iter().map(|a| a.decode_tok_s).collect();
    later.sort_by(f64::total_cmp);
    let mut later_ttft: Vec<f64> = alone[1..].iter().map(|a| a.ttft).collect();
    later_ttft.sort_by(f64::total_cmp);
    writeln!(
        out,
        "phase 0 (one request at a time from ready, 64 greedy tokens): first request {:.1} tok/s, time to first token {:.3} s; requests 2-{}: median {:.1} tok/s, {:.3} s; first / later {:.2}",
        alone[0].decode_tok_s,
        alone[0].ttft,
        alone.len(),
        percentile(&later, 50.0),
        percentile(&later_ttft, 50.0),
        alone[0].decode_tok_s / percentile(&later, 50.0)
    )?;
    writeln!(
        out,
        "# phase 1: {clients} client threads x {per_client} requests, each client sends its next request when the last is answered"
    )?;
    writeln!(
        out,
        "requests: {} ({} streaming, {} non-streaming chat, {} completions, {} cancelled mid-stream, {} malformed)",
        outcomes.len(),
        count(Kind::Stream),
        count(Kind::Plain),
        count(Kind::Completion),
        count(Kind::Cancelled),
        count(Kind::Malformed)
    )?;
    writeln!(
        out,
        "answered as expected: {} of {} (failures: {})",
        outcomes.len() - failed.len(),
        outcomes.len(),
        failed.len()
    )?;
    writeln!(
        out,
        "wall time: {phase1:.2} s; valid requests/s: {:.2}",
        valid.len() as f64 / phase1
    )?;
    writeln!(
        out,
        "time to first token (streams, client side): p50 {:.3} s, p99 {:.3} s over {} streams",
        percentile(&ttft, 50.0),
        percentile(&ttft, 99.0),
        ttft.len()
    )?;
    writeln!(
        out,
        "inter-token latency (streams, client side): p50 {:.4} s, p99 {:.4} s over {} gaps",
        percentile(&gaps, 50.0),
        percentile(&gaps, 99.0),
        gaps.len()
    )?;
    writeln!(
        out,
        "batch: up to {} sequences in one forward step (vllm:batch_sequences_max), {:.2} on average over {} steps",
        metric(&metrics_text, "vllm:batch_sequences_max"),
        metric(&metrics_text, "vllm:batch_sequences_sum")
            / metric(&metrics_text, "vllm:batch_sequences_count"),
        metric(&metrics_text, "vllm:batch_sequences_count"),
    )?;
    let ended = |reason: &str| {
        let selector = format!("vllm:request_success_total{{finished_reason=\"{reason}\"}}");
        metric(&metrics_text, &selector)
    };
    writeln!(
        out,
        "server counters: {} prompt tokens, {} generated tokens, {} requests finished, {} cancelled (client gone)",
        metric(&metrics_text, "vllm:prompt_tokens_total"),
        metric(&metrics_text, "vllm:generation_tokens_total"),
        ended("stop") + ended("length"),
        ended("abort"),
    )?;
    writeln!(
        out,
        "phase 2 (overload): {burst} simultaneous requests: {ok_burst} answered 200, {rejected_burst} refused 429 (queue full), {other_burst} other"
    )?;
    writeln!(out, "server healthy afterwards: {}", health == 200)?;
    for f in &failed {
        writeln!(
            out,
            "FAILED {:?} status {} after {:.2} s: {}",
            f.kind, f.status, f.total, f.detail
        )?;
    }
    bench::emit_report(&out, report_path.as_deref())?;
    if !failed.is_empty() || other_burst > 0 || health != 200 {
        bail!("the load test failed");
    }
    Ok(())
}

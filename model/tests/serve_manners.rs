//! `model serve`'s manners toward vLLM's clients and operators, over real HTTP with the
//! embedded chat model: the API key on `/v1/*` (and nowhere else), the metrics under vLLM's
//! names in a well-formed OpenMetrics exposition, a log line per request on stderr with its
//! token counts, and `/health` answering 503 on new connections through the drain.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod common;
use common::server::Server;

const KEY: &str = "sk-manners-7f3a9c";

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// `model serve EXTRA…` with `env` set, its stderr collected line by line (and echoed).
fn start_logged(extra: &[&str], env: &[(&str, &str)]) -> (Server, Arc<Mutex<Vec<String>>>) {
    let mut model = Command::new(common::model_binary());
    model.env_remove("VLLM_API_KEY").stderr(Stdio::piped());
    for (name, value) in env {
        model.env(name, value);
    }
    let mut server = Server::start_with(model, extra);
    let stderr = server.child.stderr.take().expect("stderr is piped");
    let lines = Arc::new(Mutex::new(Vec::new()));
    let collected = lines.clone();
    thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            eprintln!("[server] {line}");
            collected.lock().unwrap().push(line);
        }
    });
    (server, lines)
}

/// A request with an optional `Authorization` header: its status, body, and
/// `WWW-Authenticate` header.
fn call(
    server: &Server,
    method: &str,
    path: &str,
    authorization: Option<&str>,
    body: Option<&Value>,
) -> (u16, String, Option<String>) {
    let url = format!("{}{path}", server.base);
    let agent = Server::agent();
    let result = match (method, body) {
        ("GET", _) => {
            let mut request = agent.get(&url);
            if let Some(a) = authorization {
                request = request.header("Authorization", a);
            }
            request.call()
        }
        ("POST", Some(body)) => {
            let mut request = agent.post(&url).header("Content-Type", "application/json");
            if let Some(a) = authorization {
                request = request.header("Authorization", a);
            }
            request.send(body.to_string())
        }
        _ => panic!("{method} {path}"),
    };
    let mut response = result.unwrap();
    let status = response.status().as_u16();
    let challenge = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_string());
    (
        status,
        response.body_mut().read_to_string().unwrap(),
        challenge,
    )
}

/// `GET PATH` on a connection of its own: its status line's code and its body.
fn get_on_new_connection(server: &Server, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(server.base.trim_start_matches("http://")).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"));
    let body = answer
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

#[test]
fn the_api_key_guards_v1_and_leaves_health_and_metrics_open() {
    // From the environment, as vLLM reads it.
    let (server, stderr) = start_logged(&[], &[("VLLM_API_KEY", KEY)]);
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    let bearer = format!("Bearer {KEY}");
    let wrong = [
        None,
        Some("Bearer wrong".to_string()),
        Some(format!("Bearer {}", &KEY[..KEY.len() - 1])),
        Some(format!("Bearer {KEY}x")),
        Some(KEY.to_string()),
        Some(format!("Basic {KEY}")),
    ];
    for authorization in &wrong {
        for (method, path, body) in [
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", Some(&chat)),
            ("GET", "/v1/nothing", None),
        ] {
            let (status, body, challenge) =
                call(&server, method, path, authorization.as_deref(), body);
            let what = format!("{method} {path} with {authorization:?}");
            assert_eq!(status, 401, "{what}: {body}");
            assert_eq!(challenge.as_deref(), Some("Bearer"), "{what}");
            let error = &json_of(&body)["error"];
            assert_eq!(error["code"], "invalid_api_key", "{what}: {body}");
            assert_eq!(error["type"], "invalid_request_error", "{what}: {body}");
            assert!(error["param"].is_null(), "{what}: {body}");
            assert!(
                error["message"].as_str().is_some_and(|m| !m.is_empty()),
                "{what}: {body}"
            );
            assert!(!body.contains(KEY), "{what}: the key in {body}");
        }
    }
    let (status, body, _) = call(&server, "GET", "/v1/models", Some(&bearer), None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(json_of(&body)["data"][0]["id"], "nvidia/Kimi-K2.5-NVFP4");
    // The scheme's case does not matter (RFC 7235).
    let lower = format!("bearer {KEY}");
    let (status, body, _) = call(
        &server,
        "POST",
        "/v1/chat/completions",
        Some(&lower),
        Some(&chat),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(json_of(&body)["object"], "chat.completion");
    let (status, _, _) = call(&server, "GET", "/v1/nothing", Some(&bearer), None);
    assert_eq!(status, 404, "past the key, an unknown route is unknown");
    for open in ["/health", "/metrics"] {
        let (status, body, _) = call(&server, "GET", open, None, None);
        assert_eq!(status, 200, "{open} without a key: {body}");
    }
    let logged = stderr.lock().unwrap().join("\n");
    assert!(!logged.contains(KEY), "the key on stderr:\n{logged}");
    assert!(
        !logged.contains("without --api-key"),
        "a loopback server with a key warns of nothing:\n{logged}"
    );
}

#[test]
fn a_server_open_to_the_network_without_a_key_warns_once() {
    let cache = tempfile::tempdir().unwrap();
    let mut child = Command::new(common::model_binary())
        .args(["serve", "--host", "0.0.0.0", "--port", "0", "--cache-dir"])
        .arg(cache.path())
        .env_remove("VLLM_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let reader = thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    let listening = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .find(|line| line.contains("http://"));
    assert!(listening.is_some(), "the server exited before listening");
    // The warning comes before `/health` can answer: once it answers, the line is out.
    let address = listening.unwrap();
    let at = address.find("http://").unwrap();
    let base = address[at..].split_whitespace().next().unwrap().to_string();
    wait_for("/health", || {
        Server::agent()
            .get(format!("{base}/health"))
            .call()
            .ok()
            .filter(|r| r.status().as_u16() == 200)
    });
    let _ = child.kill();
    let _ = child.wait();
    let warnings: Vec<String> = reader
        .join()
        .unwrap()
        .into_iter()
        .filter(|l| l.contains("--api-key"))
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].starts_with("warning:"), "{warnings:?}");
}

/// One sample of an exposition.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

impl Sample {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

fn is_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `{k="v",…}` at the start of `text`: the labels and what follows the closing brace.
fn parse_labels(text: &str) -> (Vec<(String, String)>, &str) {
    let mut labels = Vec::new();
    let mut rest = text.strip_prefix('{').expect("labels open with {");
    loop {
        if let Some(after) = rest.strip_prefix('}') {
            return (labels, after);
        }
        let (key, after) = rest.split_once("=\"").expect("a label is key=\"value\"");
        assert!(
            is_metric_name(key) && !key.contains(':'),
            "label name {key:?}"
        );
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next().expect("a label value ends with \"") {
                (i, '"') => break i,
                (_, '\\') => match chars.next().expect("an escape") {
                    (_, 'n') => value.push('\n'),
                    (_, c @ ('\\' | '"')) => value.push(c),
                    (_, c) => panic!("bad escape \\{c}"),
                },
                (_, c) => value.push(c),
            }
        };
        labels.push((key.to_string(), value));
        rest = &after[end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

/// Parses an OpenMetrics text exposition, checking what a scraper relies on: `# EOF` once, as
/// the last line; one `# TYPE` per family, before its samples; every sample under its family
/// with the suffixes its type allows (a counter's `_total`, a histogram's `_bucket` with `le`,
/// `_sum`, `_count`); names, labels and values well formed. Returns the families' types and
/// the samples.
fn parse_openmetrics(text: &str) -> (HashMap<String, String>, Vec<Sample>) {
    assert!(text.ends_with("# EOF\n"), "no closing # EOF:\n{text}");
    let body = &text[..text.len() - "# EOF\n".len()];
    let mut types = HashMap::new();
    let mut samples = Vec::new();
    let mut family: Option<(String, String)> = None;
    for line in body.lines() {
        assert!(!line.is_empty(), "an empty line in\n{text}");
        if let Some(comment) = line.strip_prefix("# ") {
            let mut parts = comment.splitn(3, ' ');
            let (keyword, name) = (parts.next().unwrap(), parts.next().expect("a name"));
            assert!(is_metric_name(name), "{line}");
            match keyword {
                "TYPE" => {
                    let kind = parts.next().expect("a type").to_string();
                    assert!(
                        [
                            "counter",
                            "gauge",
                            "histogram",
                            "summary",
                            "info",
                            "stateset",
                            "unknown"
                        ]
                        .contains(&kind.as_str()),
                        "{line}"
                    );
                    assert!(
                        types.insert(name.to_string(), kind.clone()).is_none(),
                        "{name} declared twice"
                    );
                    family = Some((name.to_string(), kind));
                }
                "HELP" | "UNIT" => {}
                _ => panic!("unknown comment {line:?} (# EOF only at the end)"),
            }
            continue;
        }
        let name_end = line.find(['{', ' ']).expect("a sample has a value");
        let name = &line[..name_end];
        assert!(is_metric_name(name), "{line}");
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..])
        } else {
            (Vec::new(), &line[name_end..])
        };
        let value = rest.strip_prefix(' ').expect("a space before the value");
        let value = value.split(' ').next().unwrap();
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("value {v:?} in {line}")),
        };
        let (family_name, kind) = family
            .as_ref()
            .unwrap_or_else(|| panic!("{line} before any # TYPE"));
        let suffix = name
            .strip_prefix(family_name.as_str())
            .unwrap_or_else(|| panic!("{name} under the family {family_name}"));
        let allowed: &[&str] = match kind.as_str() {
            "counter" => &["_total", "_created"],
            "gauge" | "unknown" => &[""],
            "histogram" => &["_bucket", "_sum", "_count", "_created"],
            _ => &["", "_sum", "_count", "_created", "_info"],
        };
        assert!(allowed.contains(&suffix), "{name} in a {kind}");
        let sample = Sample {
            name: name.to_string(),
            labels,
            value,
        };
        if suffix == "_bucket" {
            assert!(sample.label("le").is_some(), "{line}");
        }
        samples.push(sample);
    }
    (types, samples)
}

/// The sum of the samples named `name` whose labels include `labels`.
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let picked: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(v)))
        .collect();
    assert!(!picked.is_empty(), "no {name} with {labels:?}");
    picked.iter().map(|s| s.value).sum()
}

fn scrape(server: &Server) -> (HashMap<String, String>, Vec<Sample>) {
    let mut response = Server::agent()
        .get(format!("{}/metrics", server.base))
        .call()
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let content_type = response
        .headers()
        .get("content-type")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(
        content_type,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    parse_openmetrics(&response.body_mut().read_to_string().unwrap())
}

/// `request ID finished: key=value, …` lines on stderr, by request id.
fn request_lines(stderr: &Mutex<Vec<String>>) -> HashMap<String, HashMap<String, String>> {
    stderr
        .lock()
        .unwrap()
        .iter()
        .filter_map(|line| {
            let (id, fields) = line.strip_prefix("request ")?.split_once(" finished: ")?;
            let fields = fields
                .split(", ")
                .map(|field| {
                    let (k, v) = field.split_once('=').expect("key=value");
                    (k.to_string(), v.to_string())
                })
                .collect();
            Some((id.to_string(), fields))
        })
        .collect()
}

fn wait_for<T>(what: &str, mut found: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(t) = found() {
            return t;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn metrics_carry_vllms_names_and_each_request_logs_its_end() {
    let (server, stderr) = start_logged(&[], &[]);
    let model = "nvidia/Kimi-K2.5-NVFP4";
    let (types, before) = scrape(&server);
    for (family, kind) in [
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:prompt_tokens", "counter"),
        ("vllm:generation_tokens", "counter"),
        ("vllm:request_success", "counter"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:inter_token_latency_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
    ] {
        assert_eq!(
            types.get(family).map(String::as_str),
            Some(kind),
            "{family}"
        );
    }
    for family in types.keys() {
        assert!(family.starts_with("vllm:"), "{family} outside vllm:");
    }
    for sample in &before {
        assert_eq!(sample.label("model_name"), Some(model), "{sample:?}");
    }
    for reason in ["stop", "length", "abort", "error"] {
        let count = value(
            &before,
            "vllm:request_success_total",
            &[("finished_reason", reason)],
        );
        assert_eq!(count, 0.0, "{reason} before any request");
    }

    // A plain chat request generating exactly `max_tokens`, and a stream whose client reads
    // two chunks and leaves.
    let max_tokens = 9;
    let (status, body, _) = call(
        &server,
        "POST",
        "/v1/chat/completions",
        None,
        Some(
            &json!({"messages": [{"role": "user", "content": "Count to twenty."}],
                     "max_tokens": max_tokens, "ignore_eos": true}),
        ),
    );
    assert_eq!(status, 200, "{body}");
    let reply = json_of(&body);
    let id = reply["id"].as_str().unwrap().to_string();
    let prompt_tokens = reply["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(reply["usage"]["completion_tokens"], max_tokens);
    let streamed_id = {
        let response = Server::agent()
            .post(format!("{}/v1/completions", server.base))
            .header("Content-Type", "application/json")
            .send(
                json!({"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": true,
                       "stream": true})
                .to_string(),
            )
            .unwrap();
        let mut lines = BufReader::new(response.into_body().into_reader()).lines();
        let first = lines
            .find_map(|l| l.unwrap().strip_prefix("data: ").map(String::from))
            .unwrap();
        json_of(&first)["id"].as_str().unwrap().to_string()
        // The response drops here: the client is gone.
    };

    let logged = wait_for("both requests' log lines", || {
        let lines = request_lines(&stderr);
        (lines.contains_key(&id) && lines.contains_key(&streamed_id)).then_some(lines)
    });
    let line = &logged[&id];
    assert_eq!(line["finish_reason"], "length", "{line:?}");
    assert_eq!(line["prompt_tokens"], prompt_tokens.to_string(), "{line:?}");
    assert_eq!(
        line["completion_tokens"],
        max_tokens.to_string(),
        "{line:?}"
    );
    let seconds = |v: &str| -> f64 { v.strip_suffix('s').unwrap().parse().unwrap() };
    let (ttft, e2e) = (seconds(&line["ttft"]), seconds(&line["e2e"]));
    assert!(ttft > 0.0 && ttft <= e2e, "{line:?}");
    let decode: f64 = line["decode"]
        .strip_suffix(" tok/s")
        .unwrap()
        .parse()
        .unwrap();
    assert!(decode > 0.0, "{line:?}");
    // The rest of the tokens took at least the time from the first token to the end.
    assert!(
        (max_tokens - 1) as f64 / decode <= e2e - ttft + 0.002,
        "{line:?}"
    );
    let gone = &logged[&streamed_id];
    assert_eq!(gone["finish_reason"], "abort", "{gone:?}");
    assert!(
        gone["completion_tokens"].parse::<u64>().unwrap() >= 1,
        "{gone:?}"
    );

    let (_, after) = wait_for("the stream's sequence to leave", || {
        let (types, samples) = scrape(&server);
        (value(&samples, "vllm:num_requests_running", &[]) == 0.0).then_some((types, samples))
    });
    let grew = |name: &str, labels: &[(&str, &str)]| {
        value(&after, name, labels) - value(&before, name, labels)
    };
    assert_eq!(
        grew(
            "vllm:request_success_total",
            &[("finished_reason", "length")]
        ),
        1.0
    );
    assert_eq!(
        grew(
            "vllm:request_success_total",
            &[("finished_reason", "abort")]
        ),
        1.0
    );
    assert_eq!(grew("vllm:e2e_request_latency_seconds_count", &[]), 2.0);
    assert_eq!(grew("vllm:time_to_first_token_seconds_count", &[]), 2.0);
    let streamed_tokens: f64 = gone["completion_tokens"].parse().unwrap();
    assert_eq!(
        grew("vllm:generation_tokens_total", &[]),
        max_tokens as f64 + streamed_tokens
    );
    assert!(grew("vllm:prompt_tokens_total", &[]) >= prompt_tokens as f64 + 1.0);
    let usage = value(&after, "vllm:kv_cache_usage_perc", &[]);
    assert_eq!(usage, 0.0, "no sequence holds the cache");
}

#[cfg(unix)]
#[test]
fn health_answers_503_on_new_connections_while_the_drain_runs() {
    let (mut server, stderr) =
        start_logged(&["--shutdown-grace-secs", "60", "--api-key", KEY], &[]);
    let seen = Arc::new(AtomicUsize::new(0));
    let ended = Arc::new(AtomicBool::new(false));
    let stream = {
        let (base, seen, ended) = (server.base.clone(), seen.clone(), ended.clone());
        thread::spawn(move || {
            // As long as the context allows: the stream outlasts the checks below.
            let body = json!({"messages": [{"role": "user", "content": "Tell me a long story."}],
                              "max_tokens": 8000, "ignore_eos": true, "stream": true});
            let response = Server::agent()
                .post(format!("{base}/v1/chat/completions"))
                .header("Content-Type", "application/json")
                .header("Authorization", format!("Bearer {KEY}"))
                .send(body.to_string())
                .unwrap();
            assert_eq!(response.status().as_u16(), 200);
            let mut events = Vec::new();
            for line in BufReader::new(response.into_body().into_reader()).lines() {
                let Ok(line) = line else { break };
                if let Some(data) = line.strip_prefix("data: ") {
                    events.push(data.to_string());
                    seen.fetch_add(1, Ordering::SeqCst);
                }
            }
            ended.store(true, Ordering::SeqCst);
            events
        })
    };
    wait_for("the stream to generate", || {
        (seen.load(Ordering::SeqCst) >= 3).then_some(())
    });
    // SAFETY: a signal to this test's own child.
    assert_eq!(
        unsafe { libc::kill(server.child.id() as libc::pid_t, libc::SIGTERM) },
        0
    );
    let (status, body) = wait_for("/health to answer 503", || {
        let (status, body) = get_on_new_connection(&server, "/health");
        (status != 200).then_some((status, body))
    });
    let (running_then, seen_then) = (!ended.load(Ordering::SeqCst), seen.load(Ordering::SeqCst));
    assert_eq!(
        status, 503,
        "/health on a new connection during the drain: {body}"
    );
    assert!(body.contains("shutting down"), "{body}");
    assert!(running_then, "the stream ended before /health answered 503");
    // The stream goes on past that answer, and new `/v1` requests are refused meanwhile.
    wait_for("more of the stream", || {
        (seen.load(Ordering::SeqCst) > seen_then + 3 || ended.load(Ordering::SeqCst)).then_some(())
    });
    assert!(
        seen.load(Ordering::SeqCst) > seen_then,
        "nothing arrived after the 503"
    );
    let bearer = format!("Bearer {KEY}");
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    if !ended.load(Ordering::SeqCst) {
        let (status, body, _) = call(
            &server,
            "POST",
            "/v1/chat/completions",
            Some(&bearer),
            Some(&chat),
        );
        assert_eq!(status, 503, "a new request during the drain: {body}");
    }
    // The grace is long enough: the stream ends whole, and the server exits cleanly.
    let events = stream.join().unwrap();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert!(
        events.iter().all(|e| !e.contains("\"error\"")),
        "an error frame in a stream that had time to finish"
    );
    let finish = json_of(&events[events.len() - 2])["choices"][0]["finish_reason"].clone();
    assert_eq!(finish, "length");
    let status = server.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let lines = request_lines(&stderr);
    assert!(
        lines
            .values()
            .any(|l| l["finish_reason"] == "length" && l["completion_tokens"] == "8000"),
        "the drained request's log line: {lines:?}"
    );
}

#[test]
fn a_refused_key_exits_2_naming_the_flag_and_not_the_key() {
    for (flag, env) in [(Some("sk-with space"), None), (None, Some(""))] {
        let mut model = Command::new(common::model_binary());
        model.args(["serve", "--host", "127.0.0.1", "--port", "0"]);
        model.env_remove("VLLM_API_KEY");
        if let Some(key) = flag {
            model.args(["--api-key", key]);
        }
        if let Some(key) = env {
            model.env("VLLM_API_KEY", key);
        }
        let output = model.output().unwrap();
        let said = String::from_utf8_lossy(&output.stderr).into_owned()
            + &String::from_utf8_lossy(&output.stdout);
        assert_eq!(output.status.code(), Some(2), "{said}");
        assert!(said.contains("--api-key"), "{said}");
        if let Some(key) = flag {
            assert!(!said.contains(key), "the key echoed: {said}");
        }
    }
}

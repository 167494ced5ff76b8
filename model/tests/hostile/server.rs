//! `model serve` against clients that stall, walk away, flood it with connections or send
//! what a client should not: each case ends with the server answering `/health` within 1 s,
//! every refusal is the API's JSON error object, and nothing a client sees names a server path.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::server::Server;
use crate::{golden_model, wait_until};

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn connect(server: &Server) -> TcpStream {
    TcpStream::connect(server.base.trim_start_matches("http://")).expect("connecting")
}

/// A request written by hand, so that a test can stop anywhere in it.
fn post_bytes(path: &str, body: &Value) -> Vec<u8> {
    let body = body.to_string();
    format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Reads `stream` until the server closes it; returns what came and how long it took. Still
/// open after `limit` fails the test.
fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> (String, Duration) {
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        let left = limit.saturating_sub(started.elapsed());
        assert!(
            !left.is_zero(),
            "still open after {limit:?}, having sent {:?}",
            String::from_utf8_lossy(&got)
        );
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buffer[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            // A reset is the server closing too.
            Err(_) => break,
        }
    }
    (
        String::from_utf8_lossy(&got).into_owned(),
        started.elapsed(),
    )
}

/// The status of `GET PATH` within `limit`, or why there was none.
fn get_within(server: &Server, path: &str, limit: Duration) -> Result<(u16, String), String> {
    let agent = ureq::Agent::new_with_config(
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(limit))
            .build(),
    );
    let mut response = agent
        .get(format!("{}{path}", server.base))
        .call()
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response
        .body_mut()
        .read_to_string()
        .map_err(|e| e.to_string())?;
    Ok((status, body))
}

fn health_answers_within_a_second(server: &Server, during: &str) {
    let started = Instant::now();
    let answer = get_within(server, "/health", Duration::from_secs(1));
    assert!(
        matches!(answer, Ok((200, _))),
        "/health during {during}: {answer:?} after {:?}",
        started.elapsed()
    );
}

/// The value of the sample `name` (a gauge or a counter's `_total`) whose labels include
/// `labels` (`k="v"` each; every sample also carries `model_name`).
fn metric_with(server: &Server, name: &str, labels: &[&str]) -> f64 {
    let (_, text) = server.get("/metrics");
    text.lines()
        .find_map(|line| {
            let (sample_labels, value) = line
                .strip_prefix(name)?
                .strip_prefix('{')?
                .split_once("} ")?;
            labels
                .iter()
                .all(|l| sample_labels.split(',').any(|s| s == *l))
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or_else(|| panic!("{name}{labels:?} in\n{text}"))
}

fn metric(server: &Server, name: &str) -> f64 {
    metric_with(server, name, &[])
}

/// The error object of a refusal: a non-empty message, a type, and `param` and `code` keys.
fn assert_error_object(body: &str, what: &str) -> Value {
    let reply: Value = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("{what}: the answer is not JSON ({e}): {body:?}"));
    let error = &reply["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {body}"
    );
    assert!(error["type"].is_string(), "{what}: {body}");
    assert!(
        error.get("param").is_some() && error.get("code").is_some(),
        "{what}: {body}"
    );
    error.clone()
}

fn long_generation(path: &str) -> Value {
    if path == "/v1/completions" {
        json!({"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": true})
    } else {
        json!({"messages": [{"role": "user", "content": "Tell me a long story."}],
               "max_tokens": 4000, "ignore_eos": true})
    }
}

#[test]
fn clients_that_give_up_on_plain_requests_free_their_sequences() {
    let server = Server::start(&["--max-num-seqs", "2"]);
    let paths = ["/v1/chat/completions", "/v1/completions"];
    let abandoned: Vec<TcpStream> = (0..6)
        .map(|i| {
            let path = paths[i % 2];
            let mut stream = connect(&server);
            stream
                .write_all(&post_bytes(path, &long_generation(path)))
                .unwrap();
            stream
        })
        .collect();
    wait_until(
        "the six requests queued or running",
        Duration::from_secs(60),
        || {
            metric(&server, "vllm:num_requests_running")
                + metric(&server, "vllm:num_requests_waiting")
                == 6.0
        },
    );
    // As `curl -m 0.3` gives up: the connection closes under a request in flight.
    drop(abandoned);
    wait_until(
        "no sequence left once their clients left",
        Duration::from_secs(10),
        || {
            metric(&server, "vllm:num_requests_running") == 0.0
                && metric(&server, "vllm:num_requests_waiting") == 0.0
        },
    );
    assert_eq!(
        metric_with(
            &server,
            "vllm:request_success_total",
            &["finished_reason=\"abort\""]
        ),
        6.0
    );
    let started = Instant::now();
    let (status, body) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}).to_string(),
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "a new request waited {:?}",
        started.elapsed()
    );
    health_answers_within_a_second(&server, "the cancellations");
}

#[test]
fn stalled_connections_are_closed_by_their_timeouts() {
    let server = Server::start(&[
        "--header-read-timeout-secs",
        "1",
        "--body-read-timeout-secs",
        "1",
        "--keep-alive-timeout-secs",
        "3",
    ]);
    let (header, keep_alive) = (Duration::from_secs(1), Duration::from_secs(3));
    // Generous against a loaded machine, yet well apart: a head timed out by the keep-alive
    // timeout (or not at all) fails.
    let slack = Duration::from_millis(1500);
    thread::scope(|scope| {
        let silent = scope.spawn(|| {
            let mut stream = connect(&server);
            read_until_closed(&mut stream, keep_alive * 3)
        });
        let half_head = scope.spawn(|| {
            let mut stream = connect(&server);
            stream
                .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Le")
                .unwrap();
            read_until_closed(&mut stream, keep_alive * 3)
        });
        let dripping_head = scope.spawn(|| {
            let mut stream = connect(&server);
            let started = Instant::now();
            let head = b"GET /health HTTP/1.1\r\nHost: test\r\nX-Padding: ";
            for byte in head.iter().chain(std::iter::repeat(&b'a')) {
                if stream.write_all(&[*byte]).is_err() || started.elapsed() > keep_alive * 3 {
                    break;
                }
                thread::sleep(Duration::from_millis(100));
            }
            let (got, _) = read_until_closed(&mut stream, Duration::from_secs(1));
            (got, started.elapsed())
        });
        let kept_alive = scope.spawn(|| {
            let mut stream = connect(&server);
            stream
                .write_all(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
                .unwrap();
            let mut answer = [0u8; 12];
            stream.read_exact(&mut answer).unwrap();
            assert_eq!(&answer, b"HTTP/1.1 200");
            read_until_closed(&mut stream, keep_alive * 3)
        });
        let slow_body = scope.spawn(|| {
            let mut stream = connect(&server);
            stream
                .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
                .unwrap();
            read_until_closed(&mut stream, keep_alive * 3)
        });
        for _ in 0..10 {
            health_answers_within_a_second(&server, "stalled connections");
            thread::sleep(Duration::from_millis(200));
        }
        let (_, took) = silent.join().unwrap();
        assert!(
            took > keep_alive - Duration::from_millis(500) && took < keep_alive + slack,
            "a connection that sent nothing closed after {took:?}"
        );
        let (_, took) = half_head.join().unwrap();
        assert!(took < header + slack, "a half-sent head held {took:?}");
        let (_, took) = dripping_head.join().unwrap();
        assert!(
            took < header + slack,
            "a head sent byte by byte held {took:?}"
        );
        let (_, took) = kept_alive.join().unwrap();
        assert!(
            took > keep_alive - Duration::from_millis(500) && took < keep_alive + slack,
            "an idle kept-alive connection closed after {took:?}"
        );
        let (answer, took) = slow_body.join().unwrap();
        assert!(took < header + slack, "a slow body held {took:?}");
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        let body = &answer[answer.find("\r\n\r\n").expect("a head") + 4..];
        assert_error_object(body, "a slow body");
    });
}

#[test]
fn idle_connections_past_the_file_limit_leave_health_answerable() {
    let mut command = Command::new(crate::common::model_binary());
    // 256 open files: the server must cap its connections below what its table holds.
    // SAFETY: setrlimit is async-signal-safe; the closure touches nothing else.
    unsafe {
        use std::os::unix::process::CommandExt;
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 256,
                rlim_max: 256,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let long = ["--keep-alive-timeout-secs", "300"];
    let server = Server::start_with(
        command,
        &[&long[..], &["--header-read-timeout-secs", "300"]].concat(),
    );
    let address: std::net::SocketAddr = server.base.trim_start_matches("http://").parse().unwrap();
    let held: Vec<TcpStream> = (0..400)
        .map(|i| {
            // A server that stopped accepting fills its listen queue, and then a connect waits.
            let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("connection {i}: {e}: the server stopped accepting"));
            if i % 2 == 1 {
                stream.write_all(b"GET /health HTTP/1.1\r\nHo").unwrap();
            }
            stream
        })
        .collect();
    for _ in 0..5 {
        health_answers_within_a_second(&server, "400 idle connections");
        thread::sleep(Duration::from_millis(100));
    }
    let (status, body) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).to_string(),
    );
    assert_eq!(status, 200, "{body}");
    drop(held);
}

#[test]
fn refusals_are_json_error_objects() {
    let server = Server::start(&[]);
    let agent = Server::agent();
    let mut response = agent
        .get(format!("{}/v1/chat/completions", server.base))
        .call()
        .unwrap();
    assert_eq!(response.status().as_u16(), 405);
    let body = response.body_mut().read_to_string().unwrap();
    let error = assert_error_object(&body, "GET on a POST route");
    assert!(
        error["message"].as_str().unwrap().contains("POST"),
        "{body}"
    );

    // A declared length over the limit is refused before its body is read.
    let mut stream = connect(&server);
    stream
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: 3000000\r\n\r\n")
        .unwrap();
    let (answer, _) = read_until_closed(&mut stream, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert_error_object(&answer[answer.find("\r\n\r\n").unwrap() + 4..], "413");

    // And so is a body that grows past it without a declared length.
    let mut stream = connect(&server);
    stream
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        .unwrap();
    let chunk = format!("{:x}\r\n{}\r\n", 1 << 20, "a".repeat(1 << 20));
    for _ in 0..3 {
        if stream.write_all(chunk.as_bytes()).is_err() {
            break;
        }
    }
    let (answer, _) = read_until_closed(&mut stream, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert_error_object(
        &answer[answer.find("\r\n\r\n").unwrap() + 4..],
        "chunked 413",
    );

    for (content_type, body) in [
        ("application/json", "{\"messages\": ["),
        ("application/json", ""),
        ("text/plain", "hello"),
        ("application/x-www-form-urlencoded", "messages=hi"),
        ("application/json", "\u{feff}{}"),
    ] {
        let mut response = agent
            .post(format!("{}/v1/chat/completions", server.base))
            .header("Content-Type", content_type)
            .send(body)
            .unwrap();
        let status = response.status().as_u16();
        let reply = response.body_mut().read_to_string().unwrap();
        assert_eq!(status, 400, "{content_type} {body:?}: {reply}");
        assert_error_object(&reply, &format!("{content_type} {body:?}"));
    }
    let (status, body) = server.get("/v1/nothing");
    assert_eq!(status, 404);
    assert_error_object(&body, "an unknown route");
    health_answers_within_a_second(&server, "refusals");
}

#[test]
fn answers_name_the_model_not_its_path() {
    let folder = tempfile::tempdir().unwrap();
    let checkpoint = folder.path().join("private-model");
    std::fs::create_dir(&checkpoint).unwrap();
    for entry in std::fs::read_dir(golden_model("kimi-chat-tiny")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), checkpoint.join(entry.file_name())).unwrap();
    }
    // A template that fails on one message: its error names the template's file.
    let template = checkpoint.join("chat_template.jinja");
    let text = std::fs::read_to_string(&template).unwrap();
    std::fs::write(
        &template,
        format!(
            "{{%- if messages[0]['content'] == 'explode' %}}{{{{ raise_exception('this template refuses') }}}}{{% endif -%}}\n{text}"
        ),
    )
    .unwrap();
    let server = Server::start(&["--checkpoint", checkpoint.to_str().unwrap()]);
    let private = folder.path().to_str().unwrap();

    let (status, body) = server.get("/v1/models");
    assert_eq!(status, 200);
    assert!(!body.contains(private), "{body}");
    assert_eq!(json_of(&body)["data"][0]["root"], "private-model", "{body}");

    let (status, body) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "explode"}]}).to_string(),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("this template refuses"), "{body}");
    assert!(!body.contains(private), "{body}");
    drop(server);

    // Given as a relative path, the folders above it stay private too.
    let above = folder.path().parent().unwrap();
    let relative = checkpoint.strip_prefix(above).unwrap();
    let mut command = Command::new(crate::common::model_binary());
    command.current_dir(above);
    let server = Server::start_with(command, &["--checkpoint", relative.to_str().unwrap()]);
    let (status, body) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "explode"}]}).to_string(),
    );
    assert_eq!(status, 400, "{body}");
    let hidden = folder.path().file_name().unwrap().to_str().unwrap();
    assert!(!body.contains(hidden), "{body}");
}

#[cfg(unix)]
#[test]
fn streams_cut_at_the_end_of_the_grace_get_an_error_frame_then_done() {
    let mut server = Server::start(&["--shutdown-grace-secs", "2"]);
    let (events_tx, events) = mpsc::channel::<Option<String>>();
    let base = server.base.clone();
    thread::spawn(move || {
        let mut body = long_generation("/v1/chat/completions");
        body["stream"] = json!(true);
        let response = Server::agent()
            .post(format!("{base}/v1/chat/completions"))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .unwrap();
        use std::io::BufRead;
        for line in std::io::BufReader::new(response.into_body().into_reader()).lines() {
            let Ok(line) = line else { break };
            if let Some(data) = line.strip_prefix("data: ") {
                let _ = events_tx.send(Some(data.to_string()));
            }
        }
        let _ = events_tx.send(None);
    });
    let first = events
        .recv_timeout(Duration::from_secs(120))
        .expect("the stream starts");
    let mut seen = vec![first.expect("an event")];
    // And a plain request, cut as well: its answer is a 503.
    let plain = {
        let base = server.base.clone();
        thread::spawn(move || {
            let mut response = Server::agent()
                .post(format!("{base}/v1/completions"))
                .header("Content-Type", "application/json")
                .send(long_generation("/v1/completions").to_string())
                .unwrap();
            let status = response.status().as_u16();
            (status, response.body_mut().read_to_string().unwrap())
        })
    };
    wait_until("both requests running", Duration::from_secs(60), || {
        metric(&server, "vllm:num_requests_running") == 2.0
    });
    // SAFETY: a signal to this test's own child.
    assert_eq!(
        unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) },
        0
    );
    // Through the drain `/health` answers 503, so that a balancer stops sending.
    let mut during_drain = Err(String::new());
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline {
        during_drain = get_within(&server, "/health", Duration::from_secs(1));
        if matches!(during_drain, Ok((503, _))) {
            break;
        }
        thread::sleep(Duration::from_millis(50));
    }
    assert!(
        matches!(&during_drain, Ok((503, body)) if body.contains("shutting down")),
        "/health during the drain: {during_drain:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match events.recv_timeout(left) {
            Ok(Some(event)) => seen.push(event),
            Ok(None) => break,
            Err(_) => panic!(
                "the stream was not cut 20 s after SIGTERM with a 2 s grace ({} events)",
                seen.len()
            ),
        }
    }
    assert_eq!(seen.last().map(String::as_str), Some("[DONE]"), "{seen:?}");
    let error = assert_error_object(&seen[seen.len() - 2], "the cut stream's last frame");
    assert!(
        error["message"].as_str().unwrap().contains("shut down"),
        "{error}"
    );
    let (status, body) = plain.join().unwrap();
    assert_eq!(status, 503, "{body}");
    let error = assert_error_object(&body, "the cut plain request");
    assert!(
        error["message"].as_str().unwrap().contains("shut down"),
        "{error}"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the server did not stop");
        thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
}

#[test]
fn sampling_and_template_values_the_server_cannot_honour_are_refused() {
    let server = Server::start(&["--max-waiting", "2"]);
    let user = json!([{"role": "user", "content": "Hi"}]);
    let refused = |body: Value, param: &str, mentions: &str| {
        let (status, reply) = server.post("/v1/chat/completions", &body.to_string());
        assert_eq!(status, 400, "{body} -> {reply}");
        let error = assert_error_object(&reply, &body.to_string());
        assert_eq!(error["param"], param, "{reply}");
        assert!(
            error["message"].as_str().unwrap().contains(mentions),
            "{reply}"
        );
    };
    // More choices than the queue holds could never be admitted: not a 429 to retry.
    refused(
        json!({"messages": user, "n": 3, "max_tokens": 4}),
        "n",
        "--max-waiting",
    );
    let (status, body) = server.post(
        "/v1/chat/completions",
        &json!({"messages": user, "n": 2, "max_tokens": 4}).to_string(),
    );
    assert_eq!(status, 200, "{body}");
    // 1e-46 is 0 in f32 (an empty nucleus), 1e-40 subnormal.
    for top_p in [1e-46, 1e-40] {
        refused(
            json!({"messages": user, "top_p": top_p, "max_tokens": 4}),
            "top_p",
            "top_p",
        );
    }
    for key in ["messages", "tools", "add_generation_prompt"] {
        refused(
            json!({"messages": user, "max_tokens": 4,
                   "chat_template_kwargs": {key: [{"role": "system", "content": "obey"}]}}),
            "chat_template_kwargs",
            key,
        );
    }
}

#[test]
fn thinking_is_read_alike_by_the_template_and_the_reasoning_parser() {
    let server = Server::start(&[]);
    for (thinking, on) in [
        (json!(0), false),
        (Value::Null, false),
        (json!(false), false),
        (json!(true), true),
    ] {
        let (status, body) = server.post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Which city is the capital of Kenya?"}],
                    "temperature": 0, "max_tokens": 200,
                    "chat_template_kwargs": {"thinking": thinking}})
            .to_string(),
        );
        assert_eq!(status, 200, "{body}");
        let message = &json_of(&body)["choices"][0]["message"];
        if on {
            assert!(
                message["reasoning"].as_str().is_some_and(|r| !r.is_empty()),
                "thinking {thinking}: {body}"
            );
        } else {
            assert!(
                message["reasoning"].is_null(),
                "thinking {thinking}: {body}"
            );
            assert!(
                message["content"]
                    .as_str()
                    .is_some_and(|c| c.contains("Nairobi")),
                "thinking {thinking}: {body}"
            );
        }
    }
}

#[test]
fn costly_template_renders_leave_health_answerable() {
    let server = Server::start(&[]);
    let calls: Vec<Value> = (0..12_000)
        .map(|i| {
            json!({"id": format!("c{i}"), "type": "function",
                        "function": {"name": "f", "arguments": "{}"}})
        })
        .collect();
    let body = json!({"max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": calls}]})
    .to_string();
    thread::scope(|scope| {
        let costly: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| server.post("/v1/chat/completions", &body)))
            .collect();
        while !costly.iter().all(|c| c.is_finished()) {
            health_answers_within_a_second(&server, "costly renders");
            thread::sleep(Duration::from_millis(100));
        }
        for request in costly {
            let (status, reply) = request.join().unwrap();
            assert!((400..500).contains(&status), "{status}: {reply:.300}");
            assert_error_object(&reply, "a costly render");
        }
    });
}

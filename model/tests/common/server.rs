//! `model serve` as a child process on a free loopback port, with the embedded chat model
//! unpacked into a temporary cache folder; killed when dropped.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub struct Server {
    pub child: Child,
    pub base: String,
    _cache: tempfile::TempDir,
}

impl Server {
    /// Starts `model serve EXTRA…` with `model`, the binary and its environment (its stderr
    /// stays the caller's choice; by default the test's), and waits until `/health` answers
    /// 200. The model crate's tests start theirs with `Server::start` (`common/mod.rs`); the
    /// stand-in driver's tests, in another crate, include this file.
    pub fn start_with(mut model: Command, extra: &[&str]) -> Self {
        let cache = tempfile::tempdir().unwrap();
        let mut child = model
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(["--served-model-name", "nvidia/Kimi-K2.5-NVFP4"])
            .args(extra)
            .arg("--cache-dir")
            .arg(cache.path())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        let deadline = Instant::now() + Duration::from_secs(300);
        let base = loop {
            line.clear();
            assert!(
                stdout.read_line(&mut line).unwrap() > 0,
                "the server exited before listening"
            );
            if let Some(at) = line.find("http://") {
                break line[at..].split_whitespace().next().unwrap().to_string();
            }
            assert!(Instant::now() < deadline, "not listening in time");
        };
        std::thread::spawn(move || {
            let mut rest = String::new();
            let _ = stdout.read_to_string(&mut rest);
        });
        let server = Self {
            child,
            base,
            _cache: cache,
        };
        server.wait_ready(deadline);
        server
    }

    /// Waits until `/health` answers 200: the runner warmed up. Before, it answers 503 with
    /// the engine's state.
    fn wait_ready(&self, deadline: Instant) {
        loop {
            let (status, body) = self.get("/health");
            if status == 200 {
                return;
            }
            assert_eq!(status, 503, "{body}");
            assert!(body.contains("starting"), "{body}");
            assert!(Instant::now() < deadline, "not ready in time: {body}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn agent() -> ureq::Agent {
        ureq::Agent::new_with_config(
            ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(Duration::from_secs(600)))
                .build(),
        )
    }

    pub fn post(&self, path: &str, body: &str) -> (u16, String) {
        let mut response = Self::agent()
            .post(format!("{}{path}", self.base))
            .header("Content-Type", "application/json")
            .send(body)
            .unwrap();
        let status = response.status().as_u16();
        (status, response.body_mut().read_to_string().unwrap())
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        let mut response = Self::agent()
            .get(format!("{}{path}", self.base))
            .call()
            .unwrap();
        let status = response.status().as_u16();
        (status, response.body_mut().read_to_string().unwrap())
    }

    /// Posts a streaming request; returns every `data:` payload in order, each handed to
    /// `each` as it arrives.
    pub fn stream(&self, path: &str, body: &Value, mut each: impl FnMut(&str)) -> Vec<String> {
        let response = Self::agent()
            .post(format!("{}{path}", self.base))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
        let mut events = Vec::new();
        for line in BufReader::new(response.into_body().into_reader()).lines() {
            if let Some(data) = line.unwrap().strip_prefix("data: ") {
                each(data);
                events.push(data.to_string());
            }
        }
        events
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

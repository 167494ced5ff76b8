//! Running the `model` binary from a test: its command, a refusal's checks, a run bounded in
//! time, the golden checkpoints and the folders a writer leaves.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn golden_model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../golden/data/models")
        .join(name)
}

/// The binary under test ([`super::model_binary`]), without backtraces.
pub fn model() -> Command {
    let mut cmd = Command::new(super::model_binary());
    cmd.env("RUST_BACKTRACE", "0");
    cmd
}

pub fn path_str(path: &Path) -> &str {
    path.to_str().expect("test paths are UTF-8")
}

/// Runs `model ARGS` (with `stdin` closed) and checks the refusal: exit `code`, one `Error:`
/// line first, no panic, and `expected` in the message. A run over 60 s is a hang.
pub fn refused(args: &[&str], code: i32, expected: &str) -> String {
    let out = run_bounded(model().args(args), Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(
        out.status.code(),
        Some(code),
        "{args:?} exits {code}:\n{stderr}"
    );
    assert!(stderr.starts_with("Error: "), "{args:?}:\n{stderr}");
    assert_eq!(stderr.matches("Error:").count(), 1, "{args:?}:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}:\n{stderr}");
    assert!(
        stderr.contains(expected),
        "{args:?}: `{expected}` in\n{stderr}"
    );
    stderr
}

/// Runs `command` to its end, killing it (and failing the test as a hang) after `limit`.
pub fn run_bounded(command: &mut Command, limit: Duration) -> Output {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("model starts");
    let pid = child.id();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(child.wait_with_output());
    });
    match done_rx.recv_timeout(limit) {
        Ok(out) => out.expect("model runs"),
        Err(_) => {
            // SAFETY: plain kill(2) on a pid this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("{command:?} hung for {limit:?}");
        }
    }
}

/// Waits until `done` holds, polling every 10 ms; fails naming `what` after `limit`.
pub fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A writable copy of a golden checkpoint folder.
pub fn copy_model(name: &str, dir: &Path) -> PathBuf {
    let target = dir.join(name);
    std::fs::create_dir_all(&target).unwrap();
    for entry in std::fs::read_dir(golden_model(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, target.join(path.file_name().unwrap())).unwrap();
    }
    target
}

/// Names starting with `.` in `dir`: a writer's staging folders and lock files.
pub fn hidden_entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with('.'))
        .collect()
}

/// Starts `generate-checkpoint --preset mini --out OUT EXTRA…` (slow enough to interrupt) and
/// returns once its staging folder exists; its stderr is piped.
pub fn start_generation(out: &Path, extra: &[&str]) -> Child {
    let child = model()
        .args(["generate-checkpoint", "--preset", "mini", "--out"])
        .arg(out)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let staging = out.with_file_name(format!(
        ".{}.partial-{}",
        out.file_name().unwrap().to_string_lossy(),
        child.id()
    ));
    wait_until("the staging folder", Duration::from_secs(30), || {
        staging.exists()
    });
    child
}

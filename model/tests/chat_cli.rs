//! The text commands of the `model` binary: the front door (`model` alone asks the demo
//! question), `model chat`, and `model tokenize` against Python tiktoken's ids.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;

fn model(cache: &std::path::Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_model"));
    cmd.env("RUST_BACKTRACE", "0")
        .env("KIMI_SM120_CACHE", cache);
    cmd
}

/// Runs `cmd` with `input` on stdin.
fn run_with_stdin(cmd: &mut Command, input: &[u8]) -> std::process::Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn the_front_door_answers_with_reasoning() {
    let cache = tempfile::tempdir().unwrap();
    let out = model(cache.path()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("> What is the capital of France?"),
        "{stdout}"
    );
    let thinking = stdout
        .lines()
        .find(|l| l.starts_with("thinking: "))
        .expect("reasoning shown");
    assert!(thinking.len() > "thinking: ".len(), "{stdout}");
    assert!(stdout.contains("Paris"), "{stdout}");
    assert!(stdout.contains("tok/s"), "{stdout}");
    // Not a terminal: no escape codes.
    assert!(!stdout.contains('\u{1b}'), "{stdout}");
}

#[test]
fn chat_keeps_the_conversation_and_can_answer_without_thinking() {
    let cache = tempfile::tempdir().unwrap();
    let out = run_with_stdin(
        model(cache.path()).args(["chat", "--temperature", "0", "--no-thinking"]),
        b"What is the capital of Japan?\nWhat is 7 + 5?\n/exit\n",
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("Tokyo") && stdout.contains("12"),
        "{stdout}"
    );
    assert!(!stdout.contains("thinking: "), "{stdout}");
}

#[test]
fn tokenize_prints_the_ids_python_tiktoken_gives() {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../golden/data/serving/chat_model_golden.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let case = &golden["cases"][0];
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/data/models/kimi-chat-tiny");
    // Only the tokenizer files are needed.
    let tokenizer_only = tempfile::tempdir().unwrap();
    for file in ["tiktoken.model", "tokenizer_config.json"] {
        std::fs::copy(dir.join(file), tokenizer_only.path().join(file)).unwrap();
    }
    let cache = tempfile::tempdir().unwrap();
    let out = run_with_stdin(
        model(cache.path())
            .arg("tokenize")
            .arg("--checkpoint")
            .arg(tokenizer_only.path()),
        case["prompt"].as_str().unwrap().as_bytes(),
    );
    assert!(out.status.success());
    let ids: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ids, case["prompt_ids"]);
    // A folder without the vocabulary names the missing file.
    let empty = tempfile::tempdir().unwrap();
    let out = model(cache.path())
        .arg("tokenize")
        .arg("--checkpoint")
        .arg(empty.path())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("tiktoken.model"));
}

#[test]
fn chat_takes_the_cpu_tactic_and_the_weights_placement_from_its_flags() {
    let cache = tempfile::tempdir().unwrap();
    let out = model(cache.path())
        .args(["chat", "--temperature", "0", "--no-thinking"])
        .args(["--prompt", "What is 7 + 5?"])
        .args(["--cpu-tactic", "threads=1", "--weights", "mapped"])
        // The start-up details (the tactic line) are shown on request.
        .arg("--verbose")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("12"), "{stdout}");
    let tactic = stderr
        .lines()
        .find(|l| l.starts_with("tactic cpu: "))
        .unwrap_or_else(|| panic!("the tactic is logged: {stderr}"));
    assert!(
        tactic.contains("threads=1") && tactic.ends_with("(--cpu-tactic)"),
        "{tactic}"
    );
    // Read from the files' mapping: no copy on huge pages.
    assert!(!stderr.contains("a copy on 2 MiB pages"), "{stderr}");

    // A tactic cache that does not exist: the default, and the line says why.
    let missing = cache.path().join("no-such-cache.json");
    let out = model(cache.path())
        .args(["chat", "--temperature", "0", "--no-thinking"])
        .args(["--prompt", "What is 7 + 5?", "--verbose", "--tactics"])
        .arg(&missing)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let tactic = stderr
        .lines()
        .find(|l| l.starts_with("tactic cpu: "))
        .unwrap_or_else(|| panic!("the tactic is logged: {stderr}"));
    assert!(tactic.contains("(default; "), "{tactic}");
}

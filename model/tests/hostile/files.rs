//! Odd files and racing writers: a FIFO or a device where a checkpoint file should be, a
//! tactic cache that never ends, two writers of one output, a damaged or bit-flipped default
//! model cache, and inputs that are not what they must be. Each is refused with exit code 2
//! naming the file, or repaired, and nothing blocks.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::common::cli::{copy_model, hidden_entries, start_generation};
use crate::{golden_model, model, path_str, refused, run_bounded};

fn make_fifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let name = std::ffi::CString::new(path_str(path)).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0, "{path:?}");
}

/// The commands that open a checkpoint: each must refuse it, naming `file`, without waiting.
fn every_reader_refuses(checkpoint: &Path, file: &str) {
    let dir = path_str(checkpoint);
    refused(&["inspect", dir], 2, file);
    refused(
        &[
            "run",
            "--checkpoint",
            dir,
            "--prompt-len",
            "2",
            "--max-new-tokens",
            "1",
        ],
        2,
        file,
    );
    refused(&["plan", "--checkpoint", dir], 2, file);
}

#[test]
fn a_fifo_as_config_index_or_shard_is_refused_not_waited_on() {
    let tmp = tempfile::tempdir().unwrap();
    let shard = "model-00001-of-00002.safetensors";
    for file in ["config.json", "model.safetensors.index.json", shard] {
        let checkpoint = copy_model("kimi-tiny", &tmp.path().join(file));
        make_fifo(&checkpoint.join(file));
        every_reader_refuses(&checkpoint, file);
    }

    // An index entry naming a FIFO beside the shards.
    let checkpoint = copy_model("kimi-tiny", &tmp.path().join("entry"));
    let index_path = checkpoint.join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    let first = index["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();
    index["weight_map"][first] = "pipe.safetensors".into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    make_fifo(&checkpoint.join("pipe.safetensors"));
    every_reader_refuses(&checkpoint, "pipe.safetensors");
}

#[test]
fn a_config_linked_to_a_device_or_too_large_is_refused_naming_the_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let checkpoint = copy_model("kimi-tiny", tmp.path());
    let config = checkpoint.join("config.json");
    std::fs::remove_file(&config).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &config).unwrap();
    let stderr = refused(&["inspect", path_str(&checkpoint)], 2, "config.json");
    assert!(stderr.contains("not a regular file"), "{stderr}");

    std::fs::remove_file(&config).unwrap();
    let sparse = std::fs::File::create(&config).unwrap();
    sparse.set_len(65 << 20).unwrap();
    drop(sparse);
    let stderr = refused(&["inspect", path_str(&checkpoint)], 2, "config.json");
    assert!(stderr.contains("64 MiB"), "{stderr}");
}

#[test]
fn a_tactic_cache_that_never_ends_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("tactics.json");
    make_fifo(&fifo);
    let checkpoint = golden_model("kimi-tiny");
    for tactics in ["/dev/zero", path_str(&fifo)] {
        refused(&["launch-list", "--tactics", tactics], 2, tactics);
        let run = [
            "run",
            "--checkpoint",
            path_str(&checkpoint),
            "--max-new-tokens",
            "1",
        ];
        refused(&[&run[..], &["--tactics", tactics]].concat(), 2, tactics);
    }
}

#[test]
fn a_second_writer_of_one_output_is_refused_while_the_first_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().canonicalize().unwrap().join("model");
    let first = start_generation(&out, &[]);
    let stderr = refused(
        &[
            "generate-checkpoint",
            "--preset",
            "tiny",
            "--out",
            path_str(&out),
            "--force",
        ],
        2,
        "another writer",
    );
    assert!(stderr.contains(path_str(&out)), "{stderr}");
    let done = first.wait_with_output().unwrap();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let config: Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    let text = config.get("text_config").unwrap_or(&config);
    assert_eq!(
        text["hidden_size"], 1024,
        "the first writer's (mini) output stands"
    );
    assert!(hidden_entries(tmp.path()).is_empty(), "no lock left behind");
}

#[test]
fn a_lock_file_left_by_a_killed_writer_does_not_block() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().canonicalize().unwrap().join("model");
    let mut killed = start_generation(&out, &[]);
    killed.kill().unwrap();
    killed.wait().unwrap();
    assert!(
        tmp.path().join(".model.lock").exists(),
        "a killed writer leaves its lock file"
    );
    let args = ["generate-checkpoint", "--preset", "tiny", "--out"];
    let done = run_bounded(
        model().args([&args[..], &[path_str(&out), "--force"]].concat()),
        Duration::from_secs(60),
    );
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert!(hidden_entries(tmp.path()).is_empty(), "swept");
}

/// `model tokenize` of no text on the default (embedded) model, unpacked into `cache`.
fn tokenize_default(cache: &Path) -> std::process::Output {
    run_bounded(
        model().args(["tokenize", "--cache-dir", path_str(cache)]),
        Duration::from_secs(60),
    )
}

fn unpacked_model(cache: &Path) -> PathBuf {
    std::fs::read_dir(cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("kimi-chat-tiny-")
        })
        .expect("the unpacked default model")
}

#[test]
fn a_damaged_default_model_cache_is_unpacked_again() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    assert!(tokenize_default(&cache).status.success());
    let dir = unpacked_model(&cache);
    std::fs::remove_file(dir.join(".complete")).unwrap();
    std::fs::remove_file(dir.join("tiktoken.model")).unwrap();
    let out = tokenize_default(&cache);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dir.join(".complete").exists() && dir.join("tiktoken.model").exists());
}

#[test]
fn bit_flipped_default_model_weights_are_noticed_and_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    assert!(tokenize_default(&cache).status.success());
    let shard = unpacked_model(&cache).join("model-00002-of-00002.safetensors");
    let golden = std::fs::read(golden_model("kimi-chat-tiny").join(shard.file_name().unwrap()));
    let mut bytes = golden.unwrap();
    let flipped = bytes.len() - 100;
    bytes[flipped] ^= 0x10;
    std::fs::write(&shard, &bytes).unwrap();
    let out = tokenize_default(&cache);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("model-00002-of-00002.safetensors"),
        "{stderr}"
    );
    bytes[flipped] ^= 0x10;
    assert!(
        std::fs::read(&shard).unwrap() == bytes,
        "the cached shard is restored"
    );
}

#[test]
fn a_checkpoint_without_its_tokenizer_file_is_refused_with_exit_code_2() {
    let tmp = tempfile::tempdir().unwrap();
    let checkpoint = copy_model("kimi-chat-tiny", tmp.path());
    std::fs::remove_file(checkpoint.join("tiktoken.model")).unwrap();
    let dir = path_str(&checkpoint);
    refused(&["tokenize", "--checkpoint", dir], 2, "tiktoken.model");
    refused(
        &["chat", "--checkpoint", dir, "--prompt", "hi"],
        2,
        "tiktoken.model",
    );
}

#[test]
fn a_fifo_or_a_device_as_a_tokenizer_or_template_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for file in [
        "tiktoken.model",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        let checkpoint = copy_model("kimi-chat-tiny", &tmp.path().join(file));
        make_fifo(&checkpoint.join(file));
        let dir = path_str(&checkpoint);
        refused(&["chat", "--checkpoint", dir, "--prompt", "hi"], 2, file);
    }
    let checkpoint = copy_model("kimi-chat-tiny", &tmp.path().join("zero"));
    let ranks = checkpoint.join("tiktoken.model");
    std::fs::remove_file(&ranks).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &ranks).unwrap();
    refused(
        &["tokenize", "--checkpoint", path_str(&checkpoint)],
        2,
        "tiktoken.model",
    );
}

#[test]
fn invalid_utf8_on_stdin_is_refused_with_exit_code_2() {
    let checkpoint = golden_model("kimi-chat-tiny");
    let mut child = Command::new(crate::common::model_binary())
        .args(["tokenize", "--checkpoint", path_str(&checkpoint)])
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"caf\xc3 \xff\xfe text").unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with("Error: ") && stderr.contains("stdin"),
        "{stderr}"
    );
}

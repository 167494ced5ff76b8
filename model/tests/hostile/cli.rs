//! The command line: a verification gate that cannot pass NaN, sizes that do not fit refused
//! before anything is allocated, values that would sample from nothing, a stopped rank.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use super::common::children_of;
use super::{golden_model, model, path_str, refused, run_bounded};

/// A `[rows, values.len() / rows]` f32 tensor `logits` in a safetensors file.
fn write_logits(path: &Path, rows: usize, values: &[f32]) {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(
        safetensors::Dtype::F32,
        vec![rows, values.len() / rows],
        &bytes,
    )
    .unwrap();
    safetensors::serialize_to_file([("logits", view)], None, path).unwrap();
}

#[test]
fn compare_logits_never_passes_nan() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("reference.safetensors");
    write_logits(&reference, 2, &[1.0, 2.0, 3.0, 0.5, 0.1, 4.0]);
    let nan = dir.path().join("nan.safetensors");
    write_logits(&nan, 2, &[f32::NAN; 6]);
    let one_inf = dir.path().join("inf.safetensors");
    write_logits(&one_inf, 2, &[1.0, 2.0, 3.0, 0.5, f32::INFINITY, 4.0]);
    let narrow = dir.path().join("narrow.safetensors");
    write_logits(&narrow, 3, &[1.0, 2.0, 3.0, 0.5, 0.1, 4.0]);
    let (reference, nan, one_inf, narrow) = (
        path_str(&reference),
        path_str(&nan),
        path_str(&one_inf),
        path_str(&narrow),
    );
    // The gate itself: identical logits pass, so the refusals below are about NaN.
    let same = run_bounded(
        model().args(["compare-logits", reference, reference]),
        Duration::from_secs(60),
    );
    assert!(
        same.status.success(),
        "{}",
        String::from_utf8_lossy(&same.stderr)
    );
    // A candidate with NaN or an infinity fails the check (exit 1), under any bound.
    refused(&["compare-logits", nan, reference], 1, "NaN or infinite");
    refused(
        &["compare-logits", nan, reference, "--max-rel-l2", "1e300"],
        1,
        "NaN or infinite",
    );
    refused(
        &["compare-logits", one_inf, reference],
        1,
        "1 NaN or infinite",
    );
    refused(
        &["compare-logits", nan, reference, "--as-close-as", reference],
        1,
        "NaN or infinite",
    );
    // A bound that is no number, and inputs that cannot be compared, are refused input.
    for bound in ["nan", "inf", "-1"] {
        let bound = format!("--max-rel-l2={bound}");
        refused(
            &["compare-logits", reference, reference, &bound],
            2,
            "--max-rel-l2",
        );
    }
    refused(&["compare-logits", nan, nan], 2, "cannot be a reference");
    refused(&["compare-logits", narrow, reference], 2, "rows of 2");
}

#[test]
fn sizes_that_do_not_fit_are_refused_before_anything_is_allocated() {
    let chat = golden_model("kimi-chat-tiny");
    let chat = path_str(&chat);
    refused(
        &["run", "--checkpoint", chat, "--batch", "1000000000"],
        2,
        "--batch",
    );
    refused(
        &["launch-list", "--batch", "1000000000"],
        2,
        "--batch 1000000000",
    );
    let serve = |extra: &[&str]| {
        let mut args = vec![
            "serve",
            "--checkpoint",
            chat,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ];
        args.extend_from_slice(extra);
        args.into_iter().map(String::from).collect::<Vec<_>>()
    };
    for extra in [
        &["--kv-cache-tokens", "1000000000000"][..],
        &["--kv-cache-tokens", "18446744073709551615"],
        &["--max-num-seqs", "18446744073709551615"],
    ] {
        let args = serve(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refused(&args, 2, "GiB of memory is available");
    }
    for flag in [
        "--max-model-len",
        "--kv-cache-tokens",
        "--max-waiting",
        "--max-num-seqs",
    ] {
        let args = serve(&[flag, "0"]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refused(&args, 2, flag);
    }
}

#[test]
fn sampling_values_the_sampler_cannot_use_are_refused() {
    let chat = golden_model("kimi-chat-tiny");
    let chat = path_str(&chat);
    for (flag, value) in [
        ("--temperature", "nan"),
        ("--temperature", "inf"),
        ("--temperature", "-1"),
        ("--top-p", "1e-46"),
        ("--top-p", "0"),
        ("--top-p", "nan"),
        ("--top-p", "1.5"),
    ] {
        let value = format!("{flag}={value}");
        refused(
            &["chat", "--checkpoint", chat, "--prompt", "hi", &value],
            2,
            flag,
        );
        refused(
            &["run", "--checkpoint", chat, "--prompt", "1", &value],
            2,
            flag,
        );
    }
}

/// Starts `model run --tp 2` on the chat model for a long decode; returns it and its follower
/// once `ready` (rank 0's stderr line) has been printed, or at once when `ready` is `None`.
fn tp2_run(ready: Option<&str>) -> (std::process::Child, u32, std::thread::JoinHandle<String>) {
    let chat = golden_model("kimi-chat-tiny");
    let mut child = model()
        .args([
            "run",
            "--checkpoint",
            path_str(&chat),
            "--tp",
            "2",
            "--prompt-len",
            "8",
        ])
        .args(["--max-new-tokens", "200000", "--ignore-eos"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let wanted = ready.map(String::from);
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in stderr.lines().map_while(Result::ok) {
            if wanted.as_deref().is_some_and(|w| line.contains(w)) {
                let _ = ready_tx.send(());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    if ready.is_some() {
        ready_rx
            .recv_timeout(Duration::from_secs(120))
            .expect("rank 0 reaches its decode loop");
        // A few steps in, both ranks inside the decode loop.
        std::thread::sleep(Duration::from_millis(500));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let follower = loop {
        if let Some(&pid) = children_of(child.id()).first() {
            break pid;
        }
        assert!(Instant::now() < deadline, "rank 0 starts its follower");
        std::thread::sleep(Duration::from_millis(2));
    };
    (child, follower, reader)
}

/// A follower stopped with SIGSTOP (before it joins the group, or mid-decode) ends the run
/// within seconds, naming the stop, instead of leaving rank 0 waiting out --tp-timeout-secs
/// (300 s by default).
#[test]
fn a_stopped_rank_ends_the_run_within_seconds() {
    for ready in [None, Some("tactic cpu:")] {
        let (mut child, follower, reader) = tp2_run(ready);
        unsafe { libc::kill(follower as i32, libc::SIGSTOP) };
        let stopped_at = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if stopped_at.elapsed() > Duration::from_secs(30) {
                unsafe { libc::kill(follower as i32, libc::SIGKILL) };
                let _ = child.kill();
                panic!("stopped at {ready:?}: rank 0 still waits after 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let stderr = reader.join().unwrap();
        assert_eq!(status.code(), Some(1), "stopped at {ready:?}:\n{stderr}");
        assert!(
            stderr.contains("stopped"),
            "stopped at {ready:?}:\n{stderr}"
        );
        assert!(
            super::common::exited(follower),
            "the stopped follower is ended"
        );
    }
}

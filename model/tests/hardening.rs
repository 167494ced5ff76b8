//! Hostile but fair inputs, as a broken download or a typo produces them: the `model` binary
//! refuses them with one `Error:` line and exit code 2, fails while working with exit code 1,
//! never panics, never destroys its input, and leaves no temporary, rank process or shared
//! segment behind when it is interrupted or killed.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
use common::cli::{
    copy_model, golden_model, hidden_entries, model, path_str, refused, start_generation,
    wait_until,
};
use common::{children_of, shm_entries};

fn succeeds(args: &[&str]) -> Output {
    let out = model().args(args).output().expect("model runs");
    assert!(
        out.status.success(),
        "{args:?}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut value: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(path, value.to_string()).unwrap();
}

/// Every file of a folder, by name, with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            (name, std::fs::read(&p).unwrap_or_default())
        })
        .collect()
}

fn send(pid: u32, signal: i32) {
    // SAFETY: plain kill(2) on a pid this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0, "kill {pid}");
}

/// Whether `pid` is a running process (a zombie waiting for a reaper counts as gone).
fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(stat) => {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        }
    }
}

/// SIGKILLs what a failed test would otherwise leave running.
struct KillOnDrop(Vec<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for &pid in &self.0 {
            if running(pid) {
                // SAFETY: kill(2) on a process this test started.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
        }
    }
}

/// Sets one element of a BF16 tensor of a checkpoint folder to NaN, in place.
fn poison_bf16(dir: &Path, tensor: &str, element: usize) {
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shard = dir.join(index["weight_map"][tensor].as_str().unwrap());
    let mut bytes = std::fs::read(&shard).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    assert_eq!(header[tensor]["dtype"], "BF16");
    let start = header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    let at = 8 + header_len + start + 2 * element;
    bytes[at..at + 2].copy_from_slice(&0x7FC0u16.to_le_bytes());
    std::fs::write(&shard, bytes).unwrap();
}

#[test]
fn refused_quantize_leaves_the_input_byte_for_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let input = copy_model("dsv3-mini-unsharded-bf16", tmp.path());
    std::os::unix::fs::symlink(&input, tmp.path().join("link")).unwrap();
    let before = snapshot(&input);
    let dotted = format!("{}/./", path_str(&input));
    let link = tmp.path().join("link");
    let inside = input.join("nvfp4");
    let shard = input.join("model.safetensors");
    let cases: [(&str, &str, &[&str]); 6] = [
        (path_str(&input), "is the input", &[]),
        (&dotted, "is the input", &[]),
        (path_str(&link), "is the input", &["--force"]),
        (path_str(&inside), "lies inside the input", &[]),
        (path_str(tmp.path()), "lies inside the output", &["--force"]),
        (path_str(&shard), "is the input", &["--force"]),
    ];
    for (output, expected, extra) in cases {
        let source = if output == path_str(&shard) {
            path_str(&shard)
        } else {
            path_str(&input)
        };
        let mut args = vec!["quantize", "--input", source, "--output", output];
        args.extend(extra);
        refused(&args, 2, expected);
        assert_eq!(snapshot(&input), before, "{output}: the input changed");
    }
    assert!(!inside.exists());
    assert!(hidden_entries(tmp.path()).is_empty());
}

#[test]
fn quantize_refuses_a_non_empty_output_and_force_replaces_it_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let input = copy_model("dsv3-mini-unsharded-bf16", tmp.path());
    let output = tmp.path().join("nvfp4");
    std::fs::create_dir(&output).unwrap();
    std::fs::write(output.join("model-00009-of-00009.safetensors"), b"stale").unwrap();
    let args = |force: bool| {
        let mut args = vec![
            "quantize",
            "--input",
            path_str(&input),
            "--output",
            path_str(&output),
            "--calib-tokens",
            "16",
        ];
        if force {
            args.push("--force");
        }
        args
    };
    refused(&args(false), 2, "pass --force to replace it as a whole");
    assert!(output.join("model-00009-of-00009.safetensors").exists());
    succeeds(&args(true));
    assert!(
        !output.join("model-00009-of-00009.safetensors").exists(),
        "the old output is replaced as a whole"
    );
    let text = String::from_utf8(succeeds(&["inspect", path_str(&output)]).stdout).unwrap();
    assert!(text.contains("quantization NVFP4"), "{text}");
    assert!(hidden_entries(tmp.path()).is_empty());
}

#[test]
fn interrupted_writers_leave_the_old_output_or_none_and_no_temporary() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().canonicalize().unwrap().join("model");
    for signal in [libc::SIGINT, libc::SIGTERM] {
        let mut child = start_generation(&out, &[]);
        send(child.id(), signal);
        assert_eq!(child.wait().unwrap().signal(), Some(signal));
        assert!(!out.exists(), "no half-written checkpoint");
        assert!(hidden_entries(tmp.path()).is_empty(), "signal {signal}");
    }

    succeeds(&[
        "generate-checkpoint",
        "--preset",
        "tiny",
        "--out",
        path_str(&out),
    ]);
    let old = snapshot(&out);
    let mut child = start_generation(&out, &["--force"]);
    send(child.id(), libc::SIGTERM);
    child.wait().unwrap();
    assert_eq!(snapshot(&out), old, "the old checkpoint survives");
    assert!(hidden_entries(tmp.path()).is_empty());

    // SIGKILL cannot be caught: the staging folder and the (released) lock file stay until
    // the next writer sweeps them.
    let mut child = start_generation(&out, &["--force"]);
    child.kill().unwrap();
    child.wait().unwrap();
    let mut left = hidden_entries(tmp.path());
    left.sort();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left[0].starts_with(".model.lock") && left[1].starts_with(".model.partial-"));
    assert_eq!(snapshot(&out), old);
    let args = ["generate-checkpoint", "--preset", "tiny", "--out"];
    succeeds(&[&args[..], &[path_str(&out), "--force", "--seed", "3"]].concat());
    assert!(hidden_entries(tmp.path()).is_empty(), "swept");
    assert_ne!(snapshot(&out), old, "replaced");
}

/// `kimi-tiny` without stop tokens, so that a run lasts until it is killed.
fn endless_model(dir: &Path) -> PathBuf {
    let model = copy_model("kimi-tiny", dir);
    edit_json(&model.join("config.json"), |c| {
        c["eos_token_id"] = Value::Array(vec![]);
        c["text_config"]["eos_token_id"] = Value::Array(vec![]);
    });
    std::fs::remove_file(model.join("generation_config.json")).unwrap();
    model
}

/// Starts `command` and reads the first line of its stdout. The reader is returned open, so
/// that no process it started ends on a closed pipe instead.
fn first_line(command: &mut Command) -> (Child, String, BufReader<std::process::ChildStdout>) {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    (child, line, stdout)
}

/// Waits until none of `pids` runs and no `/dev/shm` entry contains `segment`.
fn gone_within_5s(pids: &[u32], segment: &str) {
    wait_until(
        &format!("{pids:?} stopping"),
        Duration::from_secs(5),
        || pids.iter().all(|&pid| !running(pid)),
    );
    wait_until(
        &format!("{segment} removed"),
        Duration::from_secs(5),
        || shm_entries(segment).is_empty(),
    );
}

/// Rank 0 is the process the user started, and it starts the followers: however it dies,
/// they stop and no all-reduce segment is left.
#[test]
fn a_killed_rank_0_leaves_no_follower_and_no_segment() {
    let tmp = tempfile::tempdir().unwrap();
    let checkpoint = endless_model(tmp.path());
    for signal in [libc::SIGKILL, libc::SIGTERM, libc::SIGINT] {
        let mut leader = model();
        leader
            .args(["run", "--tp", "2", "--max-new-tokens", "200000"])
            .args(["--checkpoint", path_str(&checkpoint)]);
        // Rank 0's first line: both ranks have loaded and joined the all-reduce.
        let (mut leader, line, stdout) = first_line(&mut leader);
        assert!(line.starts_with("model "), "{line}");
        let followers = children_of(leader.id());
        let _guard = KillOnDrop(followers.clone());
        assert_eq!(followers.len(), 1, "{followers:?}");
        let segment_tag = format!("model-tp-{}-", leader.id());
        send(leader.id(), signal);
        leader.wait().unwrap();
        gone_within_5s(&followers, &segment_tag);
        drop(stdout);
    }
}

/// A follower that dies mid-run stops rank 0 within seconds, with exit code 1 and an error
/// naming the rank; nothing is left behind.
#[test]
fn a_dead_follower_stops_rank_0_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let checkpoint = endless_model(tmp.path());
    let mut leader = model();
    leader
        .args(["run", "--tp", "2", "--max-new-tokens", "200000"])
        .args(["--checkpoint", path_str(&checkpoint)])
        .stderr(Stdio::piped());
    let (mut leader, line, stdout) = first_line_keeping_stderr(&mut leader);
    assert!(line.starts_with("model "), "{line}");
    let followers = children_of(leader.id());
    let _guard = KillOnDrop([followers.clone(), vec![leader.id()]].concat());
    assert_eq!(followers.len(), 1, "{followers:?}");
    let segment_tag = format!("model-tp-{}-", leader.id());
    send(followers[0], libc::SIGKILL);
    let started = Instant::now();
    let status = leader.wait().unwrap();
    let mut err = String::new();
    leader
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(20), "{err}");
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("rank 1 of 2"), "{err}");
    gone_within_5s(&followers, &segment_tag);
    drop(stdout);
}

/// [`first_line`], with the command's stderr left as it was set.
fn first_line_keeping_stderr(
    command: &mut Command,
) -> (Child, String, BufReader<std::process::ChildStdout>) {
    let mut child = command.stdout(Stdio::piped()).spawn().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    (child, line, stdout)
}

#[test]
fn a_closed_stdout_ends_quietly() {
    let tiny = golden_model("kimi-tiny");
    let shard = tiny.join("model-00001-of-00002.safetensors");
    let runs: [&[&str]; 3] = [
        &["inspect", path_str(&tiny)],
        &["inspect", path_str(&shard)],
        &[
            "run",
            "--tp",
            "2",
            "--max-new-tokens",
            "2",
            "--checkpoint",
            path_str(&tiny),
        ],
    ];
    for args in runs {
        let mut child = model()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // As `| head -0` would: the reader is gone before the first line.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.signal() == Some(libc::SIGPIPE) || out.status.success(),
            "{args:?}: {:?}\n{stderr}",
            out.status
        );
        assert!(!stderr.contains("panicked"), "{args:?}:\n{stderr}");
        // With --tp, rank 1 may report that rank 0 vanished before the launcher stops it.
        if args[0] == "inspect" {
            assert!(stderr.is_empty(), "{args:?}: quiet, got\n{stderr}");
        }
    }
}

#[test]
fn bad_values_are_refused_with_exit_code_2() {
    let tiny = golden_model("kimi-tiny");
    let tiny = path_str(&tiny);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.safetensors");
    let out = path_str(&out);
    let bf16 = golden_model("dsv3-mini-unsharded-bf16");
    let quantized = tmp.path().join("q");
    let quantize = [
        "quantize",
        "--input",
        path_str(&bf16),
        "--output",
        path_str(&quantized),
    ];
    let run = ["run", "--checkpoint", tiny];
    let plan = ["plan", "--preset", "kimi-k2.5"];
    let logits = ["logits", "--checkpoint", tiny, "--out", out];
    let cases: [(&[&str], &[&str], &str); 19] = [
        (&["run"], &["--batch", "0"], "--batch"),
        (&run, &["--temperature", "-1"], "'-1' for '--temperature"),
        (&run, &["--temperature", "NaN"], "'NaN' for '--temperature"),
        (&run, &["--top-p", "0"], "'0' for '--top-p"),
        (&run, &["--top-p", "1.5"], "'1.5' for '--top-p"),
        (
            &run,
            &["--max-new-tokens", "1000000000"],
            "at most 262112 new tokens fit",
        ),
        (
            &run,
            &["--batch", "100000", "--max-new-tokens", "200000"],
            "fits at --batch 100000",
        ),
        (&run, &["--prompt", "5,9999"], "outside the vocabulary"),
        (&["run"], &["--tp", "9"], "--tp"),
        (&plan, &["--gpus", "0"], "--gpus"),
        (
            &plan,
            &["--gpus", "3"],
            "num_attention_heads = 64 cannot be split over 3 ranks",
        ),
        (
            &plan,
            &["--memory-utilization", "2"],
            "--memory-utilization",
        ),
        (
            &plan,
            &["--memory-utilization", "0"],
            "--memory-utilization",
        ),
        (&quantize, &["--calib-tokens", "0"], "--calib-tokens 0"),
        (
            &quantize,
            &["--calib-tokens", "1000000000"],
            "--calib-tokens 1000000000",
        ),
        (&logits, &["--tokens", "1,x"], "item 2 `x`"),
        (&logits, &["--tokens", "1,9999"], "outside the vocabulary"),
        (
            &["generate-checkpoint", "--preset", "kimi-k2.5", "--out", out],
            &[],
            "1 T parameters",
        ),
        (&["frobnicate"], &[], "frobnicate"),
    ];
    std::thread::scope(|scope| {
        for (command, values, expected) in cases {
            scope.spawn(move || refused(&[command, values].concat(), 2, expected));
        }
    });
    assert!(!Path::new(out).exists() && !quantized.exists());
}

/// A way a checkpoint can be broken.
enum Damage {
    /// A value of config.json's `text_config`, at a key path.
    Config(&'static [&'static str], Value),
    /// The shard the index names for one tensor.
    IndexEntry(&'static str),
    /// Neither hf_quant_config.json nor the `quantization_config` Kimi-K2.5-NVFP4 also embeds
    /// in config.json.
    NoQuantizationConfig,
    /// One NaN in a BF16 weight.
    NanWeight,
}

impl Damage {
    fn apply(&self, dir: &Path) {
        match self {
            Damage::Config(keys, value) => edit_json(&dir.join("config.json"), |c| {
                let mut node = &mut c["text_config"];
                for key in *keys {
                    node = &mut node[*key];
                }
                *node = value.clone();
            }),
            Damage::IndexEntry(shard) => {
                edit_json(&dir.join("model.safetensors.index.json"), |index| {
                    let map = index["weight_map"].as_object_mut().unwrap();
                    *map.values_mut().next().unwrap() = Value::from(*shard);
                })
            }
            Damage::NoQuantizationConfig => {
                std::fs::remove_file(dir.join("hf_quant_config.json")).unwrap();
                edit_json(&dir.join("config.json"), |c| {
                    c.as_object_mut().unwrap().remove("quantization_config");
                });
            }
            Damage::NanWeight => poison_bf16(
                dir,
                "language_model.model.layers.1.self_attn.o_proj.weight",
                5,
            ),
        }
    }
}

#[test]
fn bad_configs_and_checkpoints_are_refused_with_exit_code_2() {
    let cases = [
        (
            Damage::Config(&["num_experts_per_tok"], 0.into()),
            "`num_experts_per_tok` is 0",
        ),
        (
            Damage::Config(&["num_hidden_layers"], 1_000_000_000_000u64.into()),
            "`num_hidden_layers` is 1000000000000",
        ),
        (
            Damage::Config(&["num_hidden_layers"], 2.into()),
            "holds layers 2 to 2, which config.json does not list",
        ),
        (
            Damage::Config(&["rms_norm_eps"], (-1e-5).into()),
            "`rms_norm_eps` is -0.00001",
        ),
        (
            Damage::Config(&["rope_theta"], 0.into()),
            "`rope_theta` is 0",
        ),
        (
            Damage::Config(&["rope_scaling", "factor"], (-64.0).into()),
            "`rope_scaling.factor` is -64",
        ),
        (
            Damage::IndexEntry("../model-00001-of-00002.safetensors"),
            "not a file inside the checkpoint folder",
        ),
        (
            Damage::IndexEntry("/etc/passwd"),
            "\"/etc/passwd\", which is not a file inside the checkpoint folder",
        ),
        (Damage::NoQuantizationConfig, "has no hf_quant_config.json"),
        (
            Damage::NanWeight,
            "`language_model.model.layers.1.self_attn.o_proj.weight`",
        ),
    ];
    std::thread::scope(|scope| {
        for (damage, expected) in &cases {
            scope.spawn(move || {
                let tmp = tempfile::tempdir().unwrap();
                let dir = copy_model("kimi-tiny", tmp.path());
                damage.apply(&dir);
                let stderr = refused(&["inspect", path_str(&dir)], 2, expected);
                assert!(
                    stderr.contains(path_str(&dir)),
                    "names the checkpoint: {stderr}"
                );
            });
        }
    });
}

#[test]
fn non_finite_weights_stop_the_run_naming_the_layer_with_exit_code_1() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_model("kimi-tiny", tmp.path());
    poison_bf16(
        &dir,
        "language_model.model.layers.1.self_attn.o_proj.weight",
        5,
    );
    for tp in ["1", "2"] {
        let args = ["run", "--max-new-tokens", "2", "--tp", tp, "--checkpoint"];
        let stderr = {
            let out = model().args(args).arg(&dir).output().unwrap();
            assert_eq!(out.status.code(), Some(1), "--tp {tp}");
            String::from_utf8_lossy(&out.stderr).to_string()
        };
        assert!(
            stderr.contains("the output of layer 1 (self_attn) is not finite"),
            "--tp {tp}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    // A failure while working (here: an output folder that cannot be created) is exit code 1.
    refused(
        &[
            "generate-checkpoint",
            "--preset",
            "tiny",
            "--out",
            "/proc/self/kimi-model",
        ],
        1,
        "creating",
    );
}

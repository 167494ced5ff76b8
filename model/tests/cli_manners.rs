//! The `model` command's manners: plain-text output (no Rust debug strings), a one-line chat
//! start, an honest decode rate, chat commands that never reach the model, exit code 2 naming
//! a missing checkpoint in every subcommand, `--checkpoint OWNER/NAME` from the Hugging Face
//! cache, and a plan that refuses weights that do not fit.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::cli::{golden_model, model, path_str, refused, run_bounded};

const LIMIT: Duration = Duration::from_secs(120);

/// `model` with the default chat model unpacked into `cache` and no Hugging Face variables
/// from the environment of the test run.
fn model_in(cache: &Path) -> Command {
    let mut cmd = model();
    cmd.env("KIMI_SM120_CACHE", cache)
        .env_remove("RUST_LOG")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_HOME");
    cmd
}

/// Runs `cmd` with `input` on stdin, killed (and the test failed) after [`LIMIT`].
fn run_with_stdin(cmd: &mut Command, input: &[u8]) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("model starts");
    child.stdin.take().unwrap().write_all(input).unwrap();
    let pid = child.id();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(child.wait_with_output());
    });
    match done_rx.recv_timeout(LIMIT) {
        Ok(out) => out.expect("model runs"),
        Err(_) => {
            // SAFETY: plain kill(2) on a pid this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("{cmd:?} hung for {LIMIT:?}");
        }
    }
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn succeeded(out: &Output, what: &str) -> (String, String) {
    let (stdout, stderr) = text(out);
    assert!(
        out.status.success(),
        "{what}: exit {:?}\n{stdout}\n{stderr}",
        out.status.code()
    );
    (stdout, stderr)
}

/// Rust's `Debug` spellings that plain output never holds.
fn assert_no_debug_strings(output: &str) {
    for debug in [
        "Some(", "None", "Length", "Eos", "Fp8", "Nvfp4", "Avx2Fma", "Avx512", "Bf16",
    ] {
        assert!(
            !output.contains(debug),
            "`{debug}` in the output:\n{output}"
        );
    }
}

/// The summary lines after each answer (`[N tokens in T s; …]`).
fn summaries(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .filter(|l| l.starts_with('[') && l.contains(" in ") && l.contains("finish: "))
        .collect()
}

/// A summary's field that ends with `suffix` (`25 prompt tokens` → 25).
fn number_before(summary: &str, suffix: &str) -> f64 {
    let at = summary
        .find(suffix)
        .unwrap_or_else(|| panic!("`{suffix}` in {summary}"));
    summary[..at]
        .rsplit([' ', '['])
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("a number before `{suffix}` in {summary}"))
}

#[test]
fn a_missing_checkpoint_is_exit_2_naming_it_in_every_subcommand() {
    let cache = tempfile::tempdir().unwrap();
    let missing = cache.path().join("no-such-checkpoint");
    let m = path_str(&missing);
    let out = cache.path().join("out.safetensors");
    let out = path_str(&out);
    let cases: Vec<Vec<&str>> = vec![
        vec!["chat", "--checkpoint", m, "--prompt", "hi"],
        vec!["serve", "--checkpoint", m, "--port", "0"],
        vec!["tokenize", "--checkpoint", m],
        vec!["run", "--checkpoint", m],
        vec!["logits", "--checkpoint", m, "--tokens", "1,2", "--out", out],
        vec!["plan", "--checkpoint", m],
        vec!["inspect", m],
        vec!["quantize", "--input", m, "--output", out],
    ];
    for args in cases {
        let mut cmd = model_in(cache.path());
        let output = run_bounded(cmd.args(&args), LIMIT);
        let (_, stderr) = text(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}:\n{stderr}");
        assert!(stderr.starts_with("Error: "), "{args:?}:\n{stderr}");
        assert!(
            stderr.contains(&format!("{m}: no such file or folder")),
            "{args:?} names the path:\n{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{args:?}:\n{stderr}");
    }
}

/// A Hugging Face cache holding `repo` as `hf download` leaves it: the files in `blobs/` (named
/// by a digest), the snapshot's names symbolic links into them, `refs/main` the commit.
fn fake_hub_cache(cache: &Path, repo: &str, model: &Path) -> PathBuf {
    let (owner, name) = repo.split_once('/').unwrap();
    let root = cache.join(format!("models--{owner}--{name}"));
    let commit = "5f1c0ffee0ddba11c0de5eed0fba5eba11ad0001";
    let snapshot = root.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(root.join("blobs")).unwrap();
    std::fs::create_dir_all(root.join("refs")).unwrap();
    for (i, entry) in std::fs::read_dir(model).unwrap().enumerate() {
        let path = entry.unwrap().path();
        let blob = format!("{i:040x}");
        std::fs::copy(&path, root.join("blobs").join(&blob)).unwrap();
        std::os::unix::fs::symlink(
            format!("../../blobs/{blob}"),
            snapshot.join(path.file_name().unwrap()),
        )
        .unwrap();
    }
    std::fs::write(root.join("refs").join("main"), commit).unwrap();
    snapshot
}

#[test]
fn a_repository_id_resolves_from_the_hugging_face_cache() {
    let work = tempfile::tempdir().unwrap();
    let hub = work.path().join("hub");
    let repo = "someone/kimi-chat-tiny";
    fake_hub_cache(&hub, repo, &golden_model("kimi-chat-tiny"));
    let in_hub = |cmd: &mut Command| {
        // A folder where no `someone/` exists: the id is no path.
        cmd.current_dir(work.path()).env("HF_HUB_CACHE", &hub);
    };

    let mut chat = model_in(work.path());
    in_hub(&mut chat);
    let out = run_bounded(
        chat.args(["chat", "--checkpoint", repo, "--temperature", "0"])
            .args(["--no-thinking", "--max-tokens", "4", "--prompt", "Hi"]),
        LIMIT,
    );
    let (stdout, stderr) = succeeded(&out, "chat from the cache");
    assert!(
        stderr.starts_with(&format!("{repo} loaded in ")),
        "the start line names the repository:\n{stderr}"
    );
    assert_eq!(summaries(&stdout).len(), 1, "{stdout}");

    let mut tokenize = model_in(work.path());
    in_hub(&mut tokenize);
    let out = run_with_stdin(tokenize.args(["tokenize", "--checkpoint", repo]), b"Hello");
    let (stdout, _) = succeeded(&out, "tokenize from the cache");
    let ids: Vec<u32> = serde_json::from_str(stdout.trim()).unwrap();
    // The same ids as from the golden folder itself.
    let direct = run_with_stdin(
        model_in(work.path())
            .args(["tokenize", "--checkpoint"])
            .arg(golden_model("kimi-chat-tiny")),
        b"Hello",
    );
    let (direct, _) = succeeded(&direct, "tokenize from the folder");
    assert_eq!(
        ids,
        serde_json::from_str::<Vec<u32>>(direct.trim()).unwrap()
    );

    for args in [
        vec!["inspect", repo],
        vec!["plan", "--checkpoint", repo, "--gpus", "1"],
        vec![
            "run",
            "--checkpoint",
            repo,
            "--max-new-tokens",
            "2",
            "--prompt-len",
            "4",
        ],
    ] {
        let mut cmd = model_in(work.path());
        in_hub(&mut cmd);
        let out = run_bounded(cmd.args(&args), LIMIT);
        let (stdout, stderr) = succeeded(&out, &format!("{args:?}"));
        assert_no_debug_strings(&format!("{stdout}{stderr}"));
    }

    // HF_HOME/hub when HF_HUB_CACHE is unset.
    let home = work.path().join("hf-home");
    fake_hub_cache(&home.join("hub"), repo, &golden_model("kimi-chat-tiny"));
    let out = run_bounded(
        model_in(work.path())
            .current_dir(work.path())
            .env("HF_HOME", &home)
            .args(["inspect", repo]),
        LIMIT,
    );
    succeeded(&out, "inspect from HF_HOME/hub");

    // Nothing is downloaded: a repository not in the cache is refused, saying where it looked
    // and how to get it.
    let mut cmd = model_in(work.path());
    in_hub(&mut cmd);
    let out = run_bounded(
        cmd.args([
            "chat",
            "--checkpoint",
            "nvidia/Kimi-K2.5-NVFP4",
            "--prompt",
            "x",
        ]),
        LIMIT,
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "--checkpoint nvidia/Kimi-K2.5-NVFP4: not in the Hugging Face cache (looked in {})",
            hub.display()
        )) && stderr.contains("download it with `hf download nvidia/Kimi-K2.5-NVFP4`"),
        "{stderr}"
    );
    // A snapshot without its config (an interrupted download) is not a checkpoint either.
    let partial = fake_hub_cache(&hub, "someone/partial", &golden_model("kimi-chat-tiny"));
    std::fs::remove_file(partial.join("config.json")).unwrap();
    let mut cmd = model_in(work.path());
    in_hub(&mut cmd);
    let out = run_bounded(cmd.args(["inspect", "someone/partial"]), LIMIT);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out).1);
}

#[test]
fn chat_starts_with_one_line_and_shows_internals_only_when_asked() {
    let cache = tempfile::tempdir().unwrap();
    let chat = |extra: &[&str], env: Option<(&str, &str)>| {
        let mut cmd = model_in(cache.path());
        cmd.args(["chat", "--temperature", "0", "--max-tokens", "3"])
            .args(["--prompt", "Hi"])
            .args(extra);
        if let Some((key, value)) = env {
            cmd.env(key, value);
        }
        let out = run_bounded(&mut cmd, LIMIT);
        succeeded(&out, &format!("chat {extra:?} {env:?}"))
    };
    let (_, stderr) = chat(&["--no-thinking"], None);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one start line:\n{stderr}");
    assert!(
        lines[0].starts_with("kimi-chat-tiny loaded in "),
        "{stderr}"
    );
    // Without reasoning, nothing says it is shown.
    assert!(!stderr.contains("reasoning"), "{stderr}");
    for internal in ["tactic cpu:", "latent cache:"] {
        assert!(!stderr.contains(internal), "{internal} hidden:\n{stderr}");
    }
    for (extra, env) in [
        (&["-v"][..], None),
        (&["--verbose"][..], None),
        (&[][..], Some(("RUST_LOG", "info"))),
    ] {
        let (_, stderr) = chat(extra, env);
        for internal in ["tactic cpu:", "latent cache:"] {
            assert!(
                stderr.contains(internal),
                "{internal} with {extra:?} {env:?}:\n{stderr}"
            );
        }
        assert_no_debug_strings(&stderr);
    }
}

#[test]
fn the_decode_rate_is_over_the_tokens_after_the_first() {
    let cache = tempfile::tempdir().unwrap();
    let chat = |max_tokens: &str| {
        let out = run_bounded(
            model_in(cache.path())
                .args(["chat", "--temperature", "0", "--no-thinking"])
                .args(["--max-tokens", max_tokens, "--prompt", "Hi"]),
            LIMIT,
        );
        let (stdout, _) = succeeded(&out, "chat");
        summaries(&stdout)
            .first()
            .unwrap_or_else(|| panic!("a summary:\n{stdout}"))
            .to_string()
    };
    // One token: no time after it, so no rate.
    let one = chat("1");
    assert!(one.starts_with("[1 token in "), "{one}");
    assert!(one.contains("decode tok/s n/a"), "{one}");
    assert!(one.contains("finish: length"), "{one}");

    let many = chat("8");
    let tokens = number_before(&many, " tokens in ");
    assert!(tokens >= 2.0, "{many}");
    let elapsed = number_before(&many, " s;");
    let first_ms = number_before(&many, " ms;");
    let rate = number_before(&many, " tok/s");
    // The printed rate agrees with the printed times, within their rounding.
    let longest = (elapsed + 0.005) - (first_ms - 0.5) / 1e3;
    let shortest = (elapsed - 0.005) - (first_ms + 0.5) / 1e3;
    assert!(rate >= (tokens - 1.0) / longest * 0.999, "{many}");
    if shortest > 0.0 {
        assert!(rate <= (tokens - 1.0) / shortest * 1.001, "{many}");
    }
}

#[test]
fn chat_commands_on_piped_stdin_never_reach_the_model() {
    let cache = tempfile::tempdir().unwrap();
    let chat = |input: &str| {
        let out = run_with_stdin(
            model_in(cache.path())
                .args(["chat", "--temperature", "0", "--no-thinking"])
                .args(["--max-tokens", "2"]),
            input.as_bytes(),
        );
        succeeded(&out, input).0
    };
    // A question alone: its prompt length.
    let alone = chat("What is 7 + 5?\n");
    let alone = summaries(&alone);
    assert_eq!(alone.len(), 1);
    let fresh_prompt = number_before(alone[0], " prompt tokens");

    let stdout = chat(
        "/help\n/nonsense and more\n/\nWhat is 7 + 5?\nWhat is 7 + 5?\n/reset\nWhat is 7 + 5?\n\
         /exit\nWhat is never asked?\n",
    );
    for (command, _) in [("/help", ()), ("/reset", ()), ("/exit", ())] {
        assert!(
            stdout.lines().any(|l| l.trim_start().starts_with(command)),
            "/help lists {command}:\n{stdout}"
        );
    }
    assert!(
        stdout.contains("unknown command /nonsense; /help lists them"),
        "{stdout}"
    );
    assert!(
        stdout.contains("unknown command /; /help lists them"),
        "{stdout}"
    );
    let asked = summaries(&stdout);
    // Three questions answered; the one after /exit never asked.
    assert_eq!(asked.len(), 3, "{stdout}");
    assert!(!stdout.contains("> What is never asked?"), "{stdout}");
    let prompts: Vec<f64> = asked
        .iter()
        .map(|s| number_before(s, " prompt tokens"))
        .collect();
    // The unknown commands were not sent: the first question's prompt is a fresh one.
    assert_eq!(prompts[0], fresh_prompt, "{stdout}");
    // The second asks within the conversation; /reset forgets it.
    assert!(prompts[1] > prompts[0], "{stdout}");
    assert_eq!(prompts[2], prompts[0], "{stdout}");

    // The end of the input ends the chat like Ctrl-D, exit 0.
    let stdout = chat("/help\n");
    assert!(summaries(&stdout).is_empty(), "{stdout}");
}

#[test]
fn plan_refuses_weights_that_do_not_fit_and_says_how_many_gpus_do() {
    let cache = tempfile::tempdir().unwrap();
    let stderr = refused(
        &["plan", "--preset", "kimi-k2.5", "--gpus", "4"],
        2,
        "--gpus 4: weights ",
    );
    assert!(stderr.contains("GiB > usable "), "{stderr}");
    assert!(stderr.contains(" GiB per GPU"), "{stderr}");
    let need = stderr
        .split("need >= ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("`need >= N GPUs` in {stderr}"));
    assert!(need > 4, "{stderr}");
    // The count it names is a plan that fits: a context of more than 0 tokens.
    let out = run_bounded(
        model_in(cache.path()).args(["plan", "--preset", "kimi-k2.5", "--gpus", &need.to_string()]),
        LIMIT,
    );
    let (stdout, _) = succeeded(&out, "plan at the named count");
    let largest = stdout
        .lines()
        .find_map(|l| l.strip_prefix("largest context that fits: "))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(largest > 0, "{stdout}");
}

#[test]
fn user_facing_lines_are_plain_text() {
    let cache = tempfile::tempdir().unwrap();
    // A model without q_lora and one with an FP8 cache and NVFP4 experts.
    for name in ["dsv3-noqlora-grouped", "kimi-tiny"] {
        let out = run_bounded(
            model_in(cache.path())
                .arg("inspect")
                .arg(golden_model(name)),
            LIMIT,
        );
        let (stdout, stderr) = succeeded(&out, name);
        assert_no_debug_strings(&format!("{stdout}{stderr}"));
        assert!(stdout.contains(", q_lora "), "{stdout}");
    }
    let out = run_bounded(
        model_in(cache.path())
            .arg("inspect")
            .arg(golden_model("dsv3-noqlora-grouped")),
        LIMIT,
    );
    assert!(text(&out).0.contains("q_lora none"), "{}", text(&out).0);
    let out = run_bounded(
        model_in(cache.path())
            .arg("inspect")
            .arg(golden_model("kimi-tiny")),
        LIMIT,
    );
    assert!(text(&out).0.contains("KV cache fp8"), "{}", text(&out).0);

    // `run`: why each sequence stopped, in words, and its ids as --prompt takes them.
    let out = run_bounded(
        model_in(cache.path())
            .args(["run", "--checkpoint"])
            .arg(golden_model("kimi-tiny"))
            .args(["--max-new-tokens", "3", "--prompt-len", "4", "--ignore-eos"]),
        LIMIT,
    );
    let (stdout, stderr) = succeeded(&out, "run");
    assert_no_debug_strings(&format!("{stdout}{stderr}"));
    let line = stdout
        .lines()
        .find(|l| l.starts_with("sequence 0: "))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        line.starts_with("sequence 0: length (3 tokens): "),
        "{line}"
    );
    let ids = line.rsplit(": ").next().unwrap();
    assert_eq!(ids.split(',').count(), 3, "{line}");
    assert!(ids.split(',').all(|id| id.parse::<u32>().is_ok()), "{line}");

    // An instruction set the CPU does not have, or no such name: the warning in words.
    let out = run_bounded(
        model_in(cache.path())
            .env("KIMI_CPU_ISA", "no-such-isa")
            .args(["run", "--checkpoint"])
            .arg(golden_model("kimi-tiny"))
            .args(["--max-new-tokens", "1", "--prompt-len", "2"]),
        LIMIT,
    );
    let (stdout, stderr) = succeeded(&out, "run with an unknown ISA");
    assert!(stderr.contains("KIMI_CPU_ISA=no-such-isa"), "{stderr}");
    assert_no_debug_strings(&format!("{stdout}{stderr}"));
}

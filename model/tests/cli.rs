//! The `model` binary end to end: logits with and without tensor parallelism, the decode loop,
//! checkpoint generation and the planner.

use std::path::{Path, PathBuf};
use std::process::Command;

use model::checkpoint::tensor_file::TensorFile;

fn golden_model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../golden/data/models")
        .join(name)
}

fn model_cmd() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_model"));
    cmd.env("RUST_BACKTRACE", "0");
    cmd
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().expect("model runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

fn logits(checkpoint: &Path, tokens: &str, tp: usize, out: &Path) -> Vec<f32> {
    run_ok(
        model_cmd()
            .args([
                "logits",
                "--kv-dtype",
                "f32",
                "--tokens",
                tokens,
                "--tp",
                &tp.to_string(),
            ])
            .arg("--checkpoint")
            .arg(checkpoint)
            .arg("--out")
            .arg(out),
    );
    TensorFile::open(out).unwrap().f32_values("logits").unwrap()
}

fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    (diff / b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>()).sqrt()
}

#[test]
fn tensor_parallel_logits_equal_single_rank_logits() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = "421,168,57,247,219,349,491,24,456,371,103,485";
    for name in ["kimi-tiny", "dsv3-noqlora-grouped"] {
        let checkpoint = golden_model(name);
        let single = logits(&checkpoint, tokens, 1, &dir.path().join("tp1.safetensors"));
        for tp in [2, 4] {
            let sharded = logits(
                &checkpoint,
                tokens,
                tp,
                &dir.path().join(format!("tp{tp}.safetensors")),
            );
            let err = relative_l2(&sharded, &single);
            println!("{name}: --tp {tp} vs --tp 1 logits rel L2 {err:.2e}");
            assert!(err <= 1e-5, "{name} tp {tp}: {err}");
        }
    }
}

#[test]
fn unsplittable_model_fails_cleanly_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let out = model_cmd()
        .args(["logits", "--tokens", "1,2,3", "--tp", "4"])
        .arg("--checkpoint")
        .arg(golden_model("dsv3-mini-unsharded"))
        .arg("--out")
        .arg(dir.path().join("x.safetensors"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("moe_intermediate_size = 32 cannot be split over 4 ranks"),
        "{stderr}"
    );
}

#[test]
fn decode_loop_is_identical_with_tensor_parallelism() {
    let checkpoint = golden_model("kimi-tiny");
    let run = |tp: usize| {
        let text = run_ok(
            model_cmd()
                .args([
                    "run",
                    "--max-new-tokens",
                    "6",
                    "--prompt",
                    "5,6,7,8",
                    "--batch",
                    "2",
                    "--tp",
                    &tp.to_string(),
                ])
                .arg("--checkpoint")
                .arg(&checkpoint),
        );
        assert!(text.contains("decode:") && text.contains("tok/s"), "{text}");
        text.lines()
            .filter(|l| l.starts_with("sequence"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let single = run(1);
    assert_eq!(single.len(), 2);
    assert_eq!(run(2), single);
}

#[test]
fn generated_tiny_checkpoint_has_the_kimi_layout_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny");
    run_ok(
        model_cmd()
            .args(["generate-checkpoint", "--preset", "tiny", "--out"])
            .arg(&out),
    );
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let names: Vec<&String> = index["weight_map"].as_object().unwrap().keys().collect();
    assert!(
        names.iter().all(|n| n.starts_with("language_model.")),
        "prefix"
    );
    for suffix in ["weight", "weight_scale", "weight_scale_2", "input_scale"] {
        let name = format!("language_model.model.layers.1.mlp.experts.7.down_proj.{suffix}");
        assert!(names.iter().any(|n| **n == name), "{name}");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "kimi_k25");
    assert_eq!(config["text_config"]["model_type"], "kimi_k2");
    let quant: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("hf_quant_config.json")).unwrap())
            .unwrap();
    assert_eq!(quant["quantization"]["quant_algo"], "NVFP4");
    assert_eq!(quant["quantization"]["kv_cache_quant_algo"], "FP8");
    let text = run_ok(model_cmd().args(["inspect"]).arg(&out));
    assert!(text.contains("all 3 layers load and validate"), "{text}");
    let text = run_ok(
        model_cmd()
            .args(["run", "--max-new-tokens", "4"])
            .arg("--checkpoint")
            .arg(&out),
    );
    assert!(
        text.contains("KV cache fp8"),
        "the checkpoint's FP8 KV cache request is honoured: {text}"
    );
}

#[test]
fn plan_reports_the_deployment_figures() {
    let text = run_ok(model_cmd().args([
        "plan",
        "--preset",
        "kimi-k2.5",
        "--gpus",
        "8",
        "--gpu-mem-gib",
        "96",
    ]));
    // 70.81 GiB measured by vLLM, plus our transposed W_UK copy (0.06 GiB).
    assert!(text.contains("weights total         71.0"), "{text}");
    assert!(
        text.contains("KV cache bf16") && text.contains("max_model_len 262144: does NOT fit"),
        "{text}"
    );
    assert!(
        text.contains("KV cache fp8") && text.contains("max_model_len 262144: fits"),
        "{text}"
    );
    let bf16_only = run_ok(model_cmd().args([
        "plan",
        "--preset",
        "kimi-k2.5",
        "--kv-dtype",
        "bf16",
        "--max-model-len",
        "131072",
    ]));
    assert!(
        bf16_only.contains("max_model_len 131072: fits"),
        "{bf16_only}"
    );
}

fn run_fails(cmd: &mut Command) -> (i32, String) {
    let out = cmd.output().expect("model runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{cmd:?} succeeded:\n{text}");
    (out.status.code().unwrap_or(-1), text)
}

/// `--backend cuda` where no GPU can be used is refused at once, before loading anything
/// (the checkpoint named does not exist), with exit code 2 and no panic.
#[test]
fn backend_cuda_without_a_driver_fails_at_once_with_exit_code_2() {
    if std::path::Path::new("/dev/nvidia0").exists() {
        println!("skipped: this machine has a GPU");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (code, text) = run_fails(
        model_cmd()
            .args(["logits", "--backend", "cuda", "--tokens", "1,2"])
            .arg("--checkpoint")
            .arg(golden_model("kimi-tiny"))
            .arg("--out")
            .arg(dir.path().join("l.safetensors")),
    );
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("no CUDA driver"), "{text}");
    assert!(!text.contains("panicked"), "{text}");
}

/// `--backend cuda-emulated` scores a prompt through the device executor and writes what the
/// CPU writes, up to the kernels' roundings: on this random model those flip NVFP4 activation
/// codes and expert choices, which moves logits by ~0.1 relative (the executor's precision is
/// checked in tests/tests/device_executor.rs); a wrong row or layer would move them by ~1.
#[test]
fn logits_on_cuda_emulated_agree_with_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoint = golden_model("kimi-kernel-dims");
    let tokens = "421,168,57,247,219,349";
    let score = |backend: &str, out: &str| {
        let out = dir.path().join(out);
        let text = run_ok(
            model_cmd()
                .args(["logits", "--kv-dtype", "bf16", "--tokens", tokens])
                .args(["--backend", backend])
                .arg("--checkpoint")
                .arg(&checkpoint)
                .arg("--out")
                .arg(&out),
        );
        (
            TensorFile::open(&out)
                .unwrap()
                .f32_values("logits")
                .unwrap(),
            text,
        )
    };
    let (cpu, _) = score("cpu", "cpu.safetensors");
    let (emulated, text) = score("cuda-emulated", "emulated.safetensors");
    assert!(
        text.contains("host execution layer emulating sm_120a"),
        "{text}"
    );
    assert!(text.contains("mla_decode bf16_"), "{text}");
    assert_eq!(cpu.len(), emulated.len());
    let vocab = cpu.len() / 6;
    for (row, (e, c)) in emulated.chunks(vocab).zip(cpu.chunks(vocab)).enumerate() {
        let err = relative_l2(e, c);
        assert!(err <= 0.5, "position {row}: {err}");
    }
    assert!(emulated.iter().all(|v| v.is_finite()));
}

/// What the device kernels cannot run is refused with the reason and exit code 2: routed
/// experts in BF16 (the MoE kernels read NVFP4), and an FP32 cache.
#[test]
fn cuda_emulated_refuses_what_the_kernels_cannot_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("l.safetensors");
    let cases: [(&str, &[&str], &str); 2] = [
        (
            "dsv3-mini-unsharded-bf16",
            &["--kv-dtype", "bf16"],
            "is BF16",
        ),
        (
            "kimi-kernel-dims",
            &["--kv-dtype", "f32"],
            "--kv-dtype bf16 or fp8",
        ),
    ];
    for (model, extra, want) in cases {
        let (code, text) = run_fails(
            model_cmd()
                .args(["logits", "--backend", "cuda-emulated", "--tokens", "1,2,3"])
                .args(extra)
                .arg("--checkpoint")
                .arg(golden_model(model))
                .arg("--out")
                .arg(&out),
        );
        assert_eq!(code, 2, "{model} {extra:?}: {text}");
        assert!(text.contains(want), "{model} {extra:?}: {text}");
    }
}

/// Greedy `model run` of the trained `kimi-chat-tiny` (the model `model` answers with by
/// default) on `--backend cuda-emulated` prints the tokens `--backend cpu` prints, with either
/// cache, for the golden chat prompt (`golden/data/serving/chat_model_golden.json`).
/// `--weights huge-pages` (a copy of the checkpoint on 2 MiB pages) and `--weights mapped` (the
/// files' mapping) decode the same tokens, and the copy says what it did.
#[test]
fn weights_on_huge_pages_or_mapped_decode_the_same_tokens() {
    let checkpoint = golden_model("kimi-tiny");
    let run = |weights: &str| {
        let text = run_ok(
            model_cmd()
                .args(["run", "--max-new-tokens", "6", "--prompt", "5,6,7,8"])
                .args(["--weights", weights])
                .arg("--checkpoint")
                .arg(&checkpoint),
        );
        let sequences = text
            .lines()
            .filter(|l| l.starts_with("sequence"))
            .map(str::to_string)
            .collect::<Vec<_>>();
        (text, sequences)
    };
    let (copied_text, copied) = run("huge-pages");
    let (mapped_text, mapped) = run("mapped");
    assert!(
        copied_text.contains("weights: a copy on 2 MiB pages"),
        "{copied_text}"
    );
    assert!(!mapped_text.contains("weights: a copy"), "{mapped_text}");
    assert_eq!(copied.len(), 1, "{copied_text}");
    assert_eq!(copied, mapped);
}

#[test]
fn profiled_runs_decode_the_same_tokens_and_show_where_a_step_goes() {
    let checkpoint = golden_model("kimi-tiny");
    let run = |profile: bool| {
        let mut cmd = model_cmd();
        cmd.args(["run", "--max-new-tokens", "5", "--prompt", "5,6,7,8"])
            .arg("--checkpoint")
            .arg(&checkpoint);
        if profile {
            cmd.arg("--profile-ops");
        }
        run_ok(&mut cmd)
    };
    let sequences = |text: &str| {
        text.lines()
            .filter(|l| l.starts_with("sequence"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let (plain, profiled) = (run(false), run(true));
    assert_eq!(sequences(&plain), sequences(&profiled));
    // Prefill is one step of the prompt's 4 rows; decode is 4 steps of one row (the fifth
    // token comes from the last step's logits).
    assert!(profiled.contains("1 steps of 4 row(s)"), "{profiled}");
    assert!(profiled.contains("4 steps of 1 row(s)"), "{profiled}");
    for part in [
        "mla attention",
        "moe 16 x nvfp4",
        "per-head",
        "(between the calls)",
        "GB/s",
    ] {
        assert!(profiled.contains(part), "no {part:?} in:\n{profiled}");
    }
    assert!(!plain.contains("(between the calls)"), "{plain}");
}

#[test]
fn greedy_run_on_cuda_emulated_decodes_the_cpus_tokens() {
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../golden/data/serving/chat_model_golden.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let case = &golden["cases"][0];
    let prompt: Vec<String> = case["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    let new_tokens = case["greedy_ids"].as_array().unwrap().len().to_string();
    let checkpoint = golden_model("kimi-chat-tiny");
    for kv in ["bf16", "fp8"] {
        let run = |backend: &str| {
            let text = run_ok(
                model_cmd()
                    .args(["run", "--backend", backend, "--kv-dtype", kv])
                    .args(["--prompt", &prompt.join(",")])
                    .args(["--max-new-tokens", &new_tokens])
                    .arg("--checkpoint")
                    .arg(&checkpoint),
            );
            text.lines()
                .filter(|l| l.starts_with("sequence"))
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        let cpu = run("cpu");
        let emulated = run("cuda-emulated");
        println!("{kv} cache: cpu {cpu:?}\ncuda-emulated {emulated:?}");
        assert_eq!(cpu.len(), 1, "{cpu:?}");
        assert_eq!(emulated, cpu, "{kv} cache");
    }
}

/// `model launch-list` records Kimi-K2.5's decode step of rank 0 of TP8 on a dry device and
/// writes the same text it prints; a rank outside the group is refused as input (exit 2).
#[test]
fn launch_list_records_kimi_tp8_on_a_dry_device() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("list.txt");
    let printed = run_ok(
        model_cmd()
            .args([
                "launch-list",
                "--preset",
                "kimi-k2.5",
                "--tp",
                "8",
                "--batch",
                "2",
                "--context",
                "256",
                "--kv-dtype",
                "fp8",
            ])
            .arg("--out")
            .arg(&out),
    );
    let written = std::fs::read_to_string(&out).unwrap();
    assert!(printed.contains(&written), "the file is what was printed");
    assert!(written.starts_with("# Launch list of one decode step, RECORDED"));
    assert!(written.contains("rank 0 of TP8, batch 2, context 256"));
    assert!(written.contains("FP8 cache"));
    let launches = written.lines().filter(|l| l.contains(" grid (")).count();
    let total = written
        .lines()
        .find_map(|l| l.strip_prefix("total: "))
        .expect("a total line");
    assert!(
        total.starts_with(&format!("{launches} launches")),
        "{total}"
    );
    let (code, text) = run_fails(model_cmd().args(["launch-list", "--tp", "8", "--rank", "8"]));
    assert_eq!(code, 2, "{text}");
}

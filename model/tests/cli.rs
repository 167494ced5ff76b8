//! The `model` binary end to end: logits with and without tensor parallelism, the decode loop,
//! checkpoint generation and the planner.

use std::path::{Path, PathBuf};
use std::process::Command;

use model::tensor_file::TensorFile;

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
    assert!(text.contains("weights total         70.9"), "{text}");
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

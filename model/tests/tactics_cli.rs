//! `model run` / `model logits` with `--tactics FILE`: the tactic per family is logged, from the
//! cache when it is fresh, else after a one-line warning from the heuristic default — for a
//! missing, corrupt or stale cache alike (one that records no model included). A cache tuned
//! for another model is refused (exit code 2).

use std::path::{Path, PathBuf};
use std::process::Command;

use std::collections::BTreeMap;

use kernels::arch::Sm;
use kernels::cpu_tactic::{
    CPU_SOURCES_KEY, CpuTactic, DECODE_BUCKET_PREFIX, cpu_kernel_source_hash,
};
use kernels::mla::MlaSplitTactic;
use kernels::tactic::cache::{
    CPU_TARGET, CacheEntry, FORMAT, FigureSource, NO_GPU, Provenance, TacticCache, TacticFigure,
    built_source_hashes,
};
use kernels::tactic::{KernelFamily, ProblemShape, Tactic};
use model::arch::config::CheckpointConfig;
use model::arch::presets::Preset;

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/data/models/kimi-tiny")
}

/// Runs `model ARGS --tactics cache`; returns stderr, asserting success.
fn run_with(args: &[&str], cache: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_model"))
        .env("RUST_BACKTRACE", "0")
        .args(args)
        .arg("--checkpoint")
        .arg(tiny())
        .arg("--tactics")
        .arg(cache)
        .output()
        .expect("model runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{args:?} failed:\n{}{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

/// A cache for SM120 whose MLA entry (BF16 cache, the tiny model's heads and cache widths)
/// names a tactic other than the heuristic default.
fn fresh_cache() -> (TacticCache, String) {
    let config = CheckpointConfig::from_dir(&tiny()).unwrap().model;
    let shape = ProblemShape::mla(
        1,
        config.num_attention_heads as u32,
        64,
        false,
        config.mla_dims(),
    );
    let default = MlaSplitTactic::heuristic_default(Sm::Sm120, &shape).unwrap();
    // The most splits: the heuristic default of no short prompt these runs log (a tactic that
    // happened to be the default of a run's own shape would read as tuned when it is not).
    let tuned = MlaSplitTactic::space(Sm::Sm120)
        .into_iter()
        .filter(|t| t.serves(&shape) && *t != default)
        .max_by_key(|t| t.splits)
        .unwrap();
    let fig = TacticFigure {
        tactic: tuned.id(),
        median_us: 3.5,
        spread_us: 0.0,
        n: 1,
        source: FigureSource::Predicted,
    };
    let cache = TacticCache {
        format: FORMAT,
        provenance: Provenance {
            gpu_or_cpu_model: "NVIDIA RTX PRO 6000 Blackwell (cost model; no device present)"
                .into(),
            sm: "sm_120a".into(),
            driver_version: NO_GPU.into(),
            cuda_version: NO_GPU.into(),
            commit: "unknown".into(),
            manifest_hash: "0".into(),
            kernel_source_hashes: built_source_hashes(),
            command: "test".into(),
            model: Some(model::exec::tactics::tuned_model("kimi-tiny", &config)),
        },
        entries: vec![CacheEntry {
            family: KernelFamily::MlaDecode,
            sm: "sm_120a".into(),
            bucket: shape.bucket(),
            shape,
            winner: fig,
            runners_up: Vec::new(),
        }],
    };
    (cache, tuned.id())
}

const LOGITS: [&str; 7] = [
    "logits",
    "--kv-dtype",
    "bf16",
    "--tokens",
    "1,2,3",
    "--out",
    "",
];

fn logits_args(out: &Path) -> Vec<String> {
    let mut a: Vec<String> = LOGITS.iter().map(|s| s.to_string()).collect();
    a[6] = out.display().to_string();
    a
}

#[test]
fn a_fresh_cache_gives_its_tactic_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (cache, tuned) = fresh_cache();
    let path = dir.path().join("tactics.json");
    std::fs::write(&path, cache.to_json()).unwrap();
    let args = logits_args(&dir.path().join("l.safetensors"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let err = run_with(&args, &path);
    println!("{err}");
    assert!(!err.contains("warning"), "{err}");
    let mla = err
        .lines()
        .find(|l| l.trim_start().starts_with("mla:"))
        .unwrap();
    assert!(
        mla.contains(&format!("{tuned} ("))
            && mla.contains("tactic cache")
            && mla.contains("predicted"),
        "{mla}"
    );
    // Every GPU family is named.
    for family in ["moe_gemm", "mla", "layers"] {
        assert!(
            err.lines().any(|l| l.trim_start().starts_with(family)),
            "{family}: {err}"
        );
    }
}

#[test]
fn missing_corrupt_and_stale_caches_warn_once_and_run_with_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let (cache, tuned) = fresh_cache();
    let mut stale_sm = cache.clone();
    stale_sm.provenance.sm = "sm_90a".into();
    let mut stale_src = cache.clone();
    stale_src
        .provenance
        .kernel_source_hashes
        .insert("mla".into(), "0123456789abcdef".into());
    let text = cache.to_json();
    let cases: Vec<(&str, Option<String>, &str)> = vec![
        ("missing", None, "not found"),
        (
            "corrupt",
            Some(text[..text.len() / 3].to_string()),
            "corrupt",
        ),
        (
            "stale-sm",
            Some(stale_sm.to_json()),
            "stale: tuned for sm_90a",
        ),
        (
            "stale-source",
            Some(stale_src.to_json()),
            "other mla kernel sources",
        ),
    ];
    for (name, content, why) in cases {
        let path = dir.path().join(format!("{name}.json"));
        if let Some(c) = &content {
            std::fs::write(&path, c).unwrap();
        }
        // `run` for one case, `logits` for the others: both read the cache.
        let err = if name == "stale-sm" {
            run_with(
                &[
                    "run",
                    "--max-new-tokens",
                    "2",
                    "--prompt-len",
                    "4",
                    "--kv-dtype",
                    "bf16",
                ],
                &path,
            )
        } else {
            let out = dir.path().join(format!("{name}.safetensors"));
            let args = logits_args(&out);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run_with(&args, &path)
        };
        let warnings: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
        assert_eq!(warnings.len(), 1, "{name}: {err}");
        assert!(
            warnings[0].contains(why) && warnings[0].contains("heuristic default"),
            "{name}: {}",
            warnings[0]
        );
        let mla = err
            .lines()
            .find(|l| l.trim_start().starts_with("mla:"))
            .unwrap();
        assert!(
            mla.contains("heuristic default") && !mla.contains(&format!("{tuned} (")),
            "{name}: {mla}"
        );
    }
}

/// On a device backend the cache reaches the run: each decode step runs, per family, the
/// cache's tactic for its batch and context, and the log names it with its bucket.
#[test]
fn a_device_run_logs_the_tactic_each_step_ran_and_its_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let (cache, tuned) = fresh_cache();
    let path = dir.path().join("tactics.json");
    std::fs::write(&path, cache.to_json()).unwrap();
    let err = run_with(
        &[
            "run",
            "--backend",
            "cuda-emulated",
            "--kv-dtype",
            "bf16",
            "--prompt-len",
            "4",
            "--max-new-tokens",
            "3",
        ],
        &path,
    );
    println!("{err}");
    let step = err
        .find("step tactics (batch 1, context")
        .unwrap_or_else(|| panic!("no step's tactics logged: {err}"));
    let mla = err[step..]
        .lines()
        .find(|l| l.trim_start().starts_with("mla:"))
        .unwrap();
    assert!(
        mla.contains(&format!("{tuned} (tactic cache, bucket ")),
        "{mla}"
    );
    for family in ["moe_gemm", "dense"] {
        assert!(
            err[step..]
                .lines()
                .any(|l| l.trim_start().starts_with(family)),
            "{family}: {err}"
        );
    }
}

/// Runs `model ARGS --tactics cache` on the tiny checkpoint; returns the exit code and stderr.
fn run_status(args: &[&str], cache: &Path) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_model"))
        .env("RUST_BACKTRACE", "0")
        .args(args)
        .arg("--checkpoint")
        .arg(tiny())
        .arg("--tactics")
        .arg(cache)
        .output()
        .expect("model runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const CPU_RUN: [&str; 7] = [
    "run",
    "--max-new-tokens",
    "2",
    "--prompt-len",
    "4",
    "--kv-dtype",
    "bf16",
];

/// A cache of the CPU kernels for the tiny model, as `autotune --cpu` writes it: its decode
/// entry names a tactic other than the default.
fn cpu_cache() -> (TacticCache, CpuTactic) {
    let config = CheckpointConfig::from_dir(&tiny()).unwrap().model;
    let tuned = CpuTactic {
        threads: 1,
        ..CpuTactic::DEFAULT
    };
    let fig = |tactic: &CpuTactic| TacticFigure {
        tactic: tactic.id(),
        median_us: 100.0,
        spread_us: 1.0,
        n: 5,
        source: FigureSource::Measured,
    };
    let cache = TacticCache {
        format: FORMAT,
        provenance: Provenance {
            gpu_or_cpu_model: "test CPU".into(),
            sm: CPU_TARGET.into(),
            driver_version: NO_GPU.into(),
            cuda_version: NO_GPU.into(),
            commit: "unknown".into(),
            manifest_hash: "none".into(),
            kernel_source_hashes: BTreeMap::from([(
                CPU_SOURCES_KEY.to_string(),
                cpu_kernel_source_hash(),
            )]),
            command: "test".into(),
            model: Some(model::exec::tactics::tuned_model("kimi-tiny", &config)),
        },
        entries: vec![CacheEntry {
            family: KernelFamily::Cpu,
            sm: CPU_TARGET.into(),
            bucket: format!("{DECODE_BUCKET_PREFIX}kimi_tiny"),
            shape: model::exec::cpu::choice::decode_shape(&config),
            winner: fig(&tuned),
            runners_up: vec![fig(&CpuTactic::DEFAULT)],
        }],
    };
    (cache, tuned)
}

/// A CPU run given a CPU cache of its model runs the cache's tactic and says nothing about the
/// GPU families (the cache has none): no warning, no `stale: tuned for cpu` against an SM.
#[test]
fn a_cpu_run_with_a_cpu_cache_of_its_model_uses_it_and_warns_of_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (cache, tuned) = cpu_cache();
    let path = dir.path().join("cpu.json");
    std::fs::write(&path, cache.to_json()).unwrap();
    let (code, err) = run_status(&CPU_RUN, &path);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        !err.contains("warning") && !err.contains("stale") && !err.contains("tactics for sm_"),
        "{err}"
    );
    let line = err
        .lines()
        .find(|l| l.starts_with("tactic cpu:"))
        .unwrap_or_else(|| panic!("no CPU tactic line: {err}"));
    assert!(
        line.contains(&format!(
            "{tuned} (tactic cache, bucket {DECODE_BUCKET_PREFIX}"
        )),
        "{line}"
    );
}

/// A cache tuned for another model is refused with exit code 2, naming the file, the cache's
/// model and this run's, whether it holds CPU or GPU tactics and whatever reads it.
#[test]
fn a_cache_of_another_model_is_refused_naming_the_file_and_both_models() {
    let dir = tempfile::tempdir().unwrap();
    let mini = model::exec::tactics::tuned_model("mini", &Preset::Mini.model_config());
    let (mut gpu, _) = fresh_cache();
    gpu.provenance.model = Some(mini.clone());
    let (mut cpu, _) = cpu_cache();
    cpu.provenance.model = Some(mini);
    let logits_out = dir.path().join("l.safetensors");
    let logits = logits_args(&logits_out);
    let logits: Vec<&str> = logits.iter().map(String::as_str).collect();
    let emulated = [
        "run",
        "--backend",
        "cuda-emulated",
        "--kv-dtype",
        "bf16",
        "--prompt-len",
        "4",
        "--max-new-tokens",
        "2",
    ];
    for (name, cache, args) in [
        ("gpu-cpu-run", &gpu, &CPU_RUN[..]),
        ("cpu-cpu-run", &cpu, &CPU_RUN[..]),
        ("gpu-logits", &gpu, &logits[..]),
        ("gpu-device-run", &gpu, &emulated[..]),
    ] {
        let path = dir.path().join(format!("{name}.json"));
        std::fs::write(&path, cache.to_json()).unwrap();
        let (code, err) = run_status(args, &path);
        assert_eq!(code, Some(2), "{name}: {err}");
        let refusal = err
            .lines()
            .find(|l| l.contains("tuned for model"))
            .unwrap_or_else(|| panic!("{name}: no refusal: {err}"));
        assert!(
            refusal.contains(&path.display().to_string())
                && refusal.contains("tuned for model mini")
                && refusal.contains("this run's model is the checkpoint's (3 layers, hidden 256")
                && refusal.contains("hidden_size 1024→256"),
            "{name}: {refusal}"
        );
        // Refused before any tactic was logged as if it applied.
        assert!(!err.contains("tactic cache, bucket"), "{name}: {err}");
        assert!(!logits_out.exists(), "{name}: wrote logits");
    }
}

/// A cache written before caches recorded their model is not used: one warning that says how
/// to regenerate it, and the run goes on with the defaults.
#[test]
fn a_cache_without_a_model_record_warns_once_and_runs_with_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let (mut gpu, tuned) = fresh_cache();
    gpu.provenance.model = None;
    gpu.provenance.command = "autotune --sm 120 --checkpoint kimi-tiny --out old.json".into();
    let path = dir.path().join("old.json");
    std::fs::write(&path, gpu.to_json()).unwrap();
    let out = dir.path().join("old.safetensors");
    let args = logits_args(&out);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let err = run_with(&args, &path);
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(
        warnings[0].contains("records no model")
            && warnings[0].contains("autotune --sm 120 --checkpoint kimi-tiny --out old.json"),
        "{}",
        warnings[0]
    );
    let mla = err
        .lines()
        .find(|l| l.trim_start().starts_with("mla:"))
        .unwrap();
    assert!(
        mla.contains("heuristic default") && !mla.contains(&format!("{tuned} (")),
        "{mla}"
    );
}

//! `model run` / `model logits` with `--tactics FILE`: the tactic per family is logged, from the
//! cache when it is fresh, else after a one-line warning from the heuristic default — for a
//! missing, corrupt or stale cache alike, and never a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

use kernels::arch::Sm;
use kernels::mla::MlaSplitTactic;
use kernels::tactic::cache::{
    CacheEntry, FORMAT, FigureSource, NO_GPU, Provenance, TacticCache, TacticFigure,
    built_source_hashes,
};
use kernels::tactic::{KernelFamily, ProblemShape, Tactic};
use model::arch::config::CheckpointConfig;

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

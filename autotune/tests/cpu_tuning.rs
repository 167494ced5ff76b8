//! `autotune --cpu`: without `--checkpoint` it tunes the model `model run` runs by default
//! (the generated `mini`, found in the model cache folder), records that model in the cache,
//! and prints the cache on stdout without `--out`, writing nothing; the cache then serves that
//! model and is refused for another.

use std::path::Path;
use std::process::Command;

use kernels::cpu_tactic::choose_from_cache;
use kernels::tactic::cache::{CPU_TARGET, TacticCache};
use model::arch::config::CheckpointConfig;
use model::arch::presets::Preset;
use model::exec::cpu::choice::decode_shape;
use model::exec::tactics::{check_cache_model, tuned_model};

fn kimi_tiny() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/data/models/kimi-tiny")
}

#[test]
fn without_a_checkpoint_it_tunes_model_runs_default_and_records_it() {
    let scratch = tempfile::tempdir().unwrap();
    let cache_home = scratch.path().join("cache-home");
    // What `model run` finds as its default model (`default_checkpoint`): a complete `mini`
    // folder under $XDG_CACHE_HOME/kimi-sm120, here holding the tiny checkpoint's files so that
    // the tuning takes a second.
    let base = cache_home.join("kimi-sm120");
    let mini_dir = base.join(format!(
        "{}-{}",
        Preset::Mini.id(),
        env!("CARGO_PKG_VERSION")
    ));
    std::fs::create_dir_all(&mini_dir).unwrap();
    for entry in std::fs::read_dir(kimi_tiny()).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, mini_dir.join(p.file_name().unwrap())).unwrap();
    }
    std::fs::write(mini_dir.join(".complete"), b"").unwrap();
    assert_eq!(
        model::quantize::generator::default_checkpoint(Some(base)).unwrap(),
        mini_dir,
        "the folder `model run` takes by default"
    );
    let cwd = scratch.path().join("cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_autotune"))
        .current_dir(&cwd)
        .env("XDG_CACHE_HOME", &cache_home)
        .args([
            "--cpu",
            "--quiet",
            "--cpu-kernel-secs",
            "0.02",
            "--cpu-decode-secs",
            "0.02",
            "--cpu-prompt-len",
            "2",
            "--cpu-decode-tokens",
            "2",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        std::fs::read_dir(&cwd).unwrap().count(),
        0,
        "wrote into the working directory"
    );
    let cache = TacticCache::from_json(&String::from_utf8_lossy(&out.stdout))
        .unwrap_or_else(|e| panic!("stdout is no cache ({e}): {stderr}"));
    assert_eq!(cache.provenance.sm, CPU_TARGET);
    let config = CheckpointConfig::from_dir(&kimi_tiny()).unwrap().model;
    let record = cache
        .provenance
        .model
        .clone()
        .expect("the model is recorded");
    // Not a preset's dimensions: named after its folder.
    assert_eq!(
        record,
        tuned_model(&mini_dir.file_name().unwrap().to_string_lossy(), &config)
    );

    // The cache serves that model's CPU runs, and is refused for another model's.
    let path = scratch.path().join("cpu.json");
    std::fs::write(&path, cache.to_json()).unwrap();
    let choice = choose_from_cache(&path, &decode_shape(&config));
    assert!(
        choice.warning.is_none() && choice.description.contains("tactic cache"),
        "{choice:?}"
    );
    check_cache_model(Some(&path), &config).unwrap();
    let refusal = check_cache_model(Some(&path), &Preset::Mini.model_config())
        .unwrap_err()
        .to_string();
    assert!(
        refusal.contains(&format!("tuned for model {}", record.name))
            && refusal.contains("this run's model is mini"),
        "{refusal}"
    );
}

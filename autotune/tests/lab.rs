//! The tuning lab end to end, without a device: the stages prune what they must, the cache
//! holds only tactics that passed the static and correct stages, every figure is labelled
//! predicted, the provenance is complete, and the model reads the cache back.

use std::collections::BTreeSet;
use std::path::PathBuf;

use autotune::tune::{self, Options, Report};
use kernels::arch::Sm;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::tactic::cache::{self, Expected, FigureSource, NO_GPU};
use kernels::tactic::{KernelFamily, Tactic};
use model::generator::Preset;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn options(sm: Sm, families: &[KernelFamily], filter: Option<&str>) -> Options {
    Options {
        sm,
        tp: 8,
        model: Preset::KimiK25.model_config(),
        model_name: "kimi-k2.5".into(),
        manifest: root().join("ptx/manifest.json"),
        families: families.to_vec(),
        perturb: None,
        filter: filter.map(str::to_string),
        progress: false,
        command: "test".into(),
    }
}

fn passed(r: &Report, family: KernelFamily, sm: Sm) -> BTreeSet<String> {
    let pruned: BTreeSet<&str> = r
        .pruned
        .iter()
        .filter(|p| p.family == family)
        .map(|p| p.tactic.as_str())
        .collect();
    let all: Vec<String> = match family {
        KernelFamily::MoeGemm => MoeGemmTactic::space(sm).iter().map(|t| t.id()).collect(),
        KernelFamily::MlaDecode => kernels::mla::MlaTactic::space(sm)
            .iter()
            .map(|t| t.id())
            .collect(),
        _ => unreachable!(),
    };
    all.into_iter()
        .filter(|t| !pruned.contains(t.as_str()))
        .collect()
}

#[test]
fn the_sm120_cache_holds_only_checked_tactics_with_predicted_figures_and_full_provenance() {
    let sm = Sm::Sm120;
    let families = [KernelFamily::MoeGemm, KernelFamily::MlaDecode];
    let r = tune::run(&options(sm, &families, None)).unwrap();
    println!("{}", r.table(sm));
    for p in &r.pruned {
        println!("pruned [{}] {} {}: {}", p.stage, p.family, p.tactic, p.why);
    }
    for f in families {
        let c = &r.counts[&f];
        assert!(
            c.enumerated > 0 && c.correct_ok > 0 && c.buckets > 0,
            "{f}: {c:?}"
        );
        assert!(c.enumerated >= c.static_ok && c.static_ok >= c.correct_ok);
        let ok = passed(&r, f, sm);
        assert_eq!(ok.len(), c.correct_ok, "{f}");
        for e in r.cache.entries.iter().filter(|e| e.family == f) {
            assert_eq!(e.sm, "sm_120a");
            for fig in std::iter::once(&e.winner).chain(&e.runners_up) {
                assert!(
                    ok.contains(&fig.tactic),
                    "{f} {}: {} was pruned",
                    e.bucket,
                    fig.tactic
                );
                assert_eq!(fig.source, FigureSource::Predicted);
                assert!(fig.median_us.is_finite() && fig.median_us > 0.0);
            }
            assert!(
                e.runners_up
                    .iter()
                    .all(|x| x.median_us >= e.winner.median_us),
                "{}: the winner is not the fastest",
                e.bucket
            );
        }
    }
    let p = &r.cache.provenance;
    assert_eq!(p.sm, "sm_120a");
    assert!(p.gpu_or_cpu_model.contains("RTX PRO 6000"));
    assert_eq!(
        (p.driver_version.as_str(), p.cuda_version.as_str()),
        (NO_GPU, NO_GPU)
    );
    assert!(!p.commit.is_empty() && p.manifest_hash.len() == 16);
    for family in ["moe_gemm", "mla", "allreduce", "layers", "ptx_helpers"] {
        assert!(p.kernel_source_hashes.contains_key(family), "{family}");
    }
    // The model reads it back: fresh, and its MoE winner for batch 1 is the cache's.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tactics.json");
    std::fs::write(&path, r.cache.to_json()).unwrap();
    let lookup = cache::load(&path, &Expected::for_sm(sm, None));
    assert_eq!(lookup.warning, None);
    let cfg = Preset::KimiK25.model_config();
    let run = model::tactics::RunShapes {
        sm,
        tp: 8,
        tokens: 1,
        context: 4096,
        fp8_cache: true,
    };
    let lines = model::tactics::tactic_lines(Some(&path), &cfg, &run);
    println!("{}", lines.join("\n"));
    let moe = lines.iter().find(|l| l.starts_with("moe_gemm:")).unwrap();
    let e = r
        .cache
        .entries
        .iter()
        .find(|e| e.family == KernelFamily::MoeGemm && e.bucket.starts_with("moe_t1_e8_"))
        .unwrap();
    assert!(
        moe.contains(&e.winner.tactic) && moe.contains("tactic cache") && moe.contains("predicted"),
        "{moe}"
    );
}

#[test]
fn a_tactic_with_a_perturbed_launch_fails_the_correct_stage_and_is_pruned() {
    let sm = Sm::Sm120;
    // Two decode tactics differing only in stages; the first one's grid is cut one block short.
    let filter = "native_n128_m8_k256_w4_s";
    let mut opts = options(sm, &[KernelFamily::MoeGemm], Some(filter));
    let victims: Vec<String> = MoeGemmTactic::space(sm)
        .iter()
        .map(|t| t.id())
        .filter(|id| id.contains(filter))
        .collect();
    assert!(victims.len() >= 2, "{victims:?}");
    let mutant = victims[0].clone();
    opts.perturb = Some(mutant.clone());
    let r = tune::run(&opts).unwrap();
    for p in &r.pruned {
        println!("pruned [{}] {} {}: {}", p.stage, p.family, p.tactic, p.why);
    }
    let c = &r.counts[&KernelFamily::MoeGemm];
    assert_eq!(c.static_ok, victims.len());
    assert_eq!(c.correct_ok, victims.len() - 1, "only the mutant fails");
    let p = r
        .pruned
        .iter()
        .find(|p| p.tactic == mutant)
        .expect("the mutant is pruned");
    assert_eq!(p.stage, "correct");
    for e in &r.cache.entries {
        assert!(e.winner.tactic != mutant && e.runners_up.iter().all(|f| f.tactic != mutant));
    }
    // Unperturbed, the same tactic passes: the failure was the mutation.
    opts.perturb = None;
    opts.filter = Some(mutant.clone());
    let clean = tune::run(&opts).unwrap();
    assert_eq!(
        clean.counts[&KernelFamily::MoeGemm].correct_ok,
        1,
        "{:?}",
        clean.pruned
    );
}

#[test]
fn a_stale_manifest_prunes_its_family_at_the_static_stage() {
    let sm = Sm::Sm120;
    let text = std::fs::read_to_string(root().join("ptx/manifest.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["sources"]["mla"]["fnv1a64"] = "0000000000000000".into();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("manifest.json");
    std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
    let mut opts = options(sm, &[KernelFamily::MlaDecode], None);
    opts.manifest = path;
    let r = tune::run(&opts).unwrap();
    let c = &r.counts[&KernelFamily::MlaDecode];
    assert!(c.enumerated > 0);
    assert_eq!((c.static_ok, c.correct_ok, c.buckets), (0, 0, 0));
    assert!(
        r.pruned
            .iter()
            .all(|p| p.stage == "static" && p.why.contains("stale manifest"))
    );
    assert!(r.notes.iter().any(|n| n.contains("stale manifest")));
}

#[test]
fn allreduce_tactics_pass_the_host_check_and_the_cost_model_ranks_them() {
    let sm = Sm::Sm120;
    let r = tune::run(&options(
        sm,
        &[KernelFamily::AllReduce],
        Some("one-shot-pull_bf16_t512"),
    ))
    .unwrap();
    let c = &r.counts[&KernelFamily::AllReduce];
    assert_eq!((c.enumerated, c.correct_ok), (4, 4), "{:?}", r.pruned);
    assert!(c.buckets > 0);
}

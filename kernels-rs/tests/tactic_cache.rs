//! The tactic cache choosing real families' tactics: a fresh cache's winner, the nearest
//! bucket, another family's default, and the default with a one-line warning whenever a cache
//! is missing, corrupt, stale or names a tactic that does not fit.

use std::path::Path;

use kernels::arch::Sm;
use kernels::mla::{MlaDims, MlaTactic};
use kernels::moe_gemm::MoeGemmTactic;
use kernels::tactic::cache::{
    CacheEntry, CacheLookup, Expected, FORMAT, FigureSource, NO_GPU, Provenance, TacticCache,
    TacticFigure, TunedModel, built_source_hashes, load,
};
use kernels::tactic::{KernelFamily, ProblemShape, Tactic};

fn shape(tpe: u32) -> ProblemShape {
    ProblemShape::Moe {
        tokens_per_expert: tpe,
        active_experts: 8,
        hidden: 7168,
        inter: 256,
    }
}

fn cache_for(sm: Sm) -> (TacticCache, MoeGemmTactic) {
    // The last tactic of the space: not the heuristic default for one token.
    let t = *MoeGemmTactic::enumerate(sm).last().unwrap();
    let fig = |id: String, us| TacticFigure {
        tactic: id,
        median_us: us,
        spread_us: 0.0,
        n: 1,
        source: FigureSource::Predicted,
    };
    let cache = TacticCache {
        format: FORMAT,
        provenance: Provenance {
            gpu_or_cpu_model: sm.reference_gpu().name.into(),
            sm: sm.arch().into(),
            driver_version: NO_GPU.into(),
            cuda_version: NO_GPU.into(),
            commit: "unknown".into(),
            manifest_hash: "0".into(),
            kernel_source_hashes: built_source_hashes(),
            command: "test".into(),
            model: Some(TunedModel {
                name: "test".into(),
                dims: Default::default(),
            }),
        },
        entries: vec![CacheEntry {
            family: KernelFamily::MoeGemm,
            sm: sm.arch().into(),
            bucket: shape(1).bucket(),
            shape: shape(1),
            winner: fig(t.id(), 10.0),
            runners_up: vec![fig("x".into(), 11.0)],
        }],
    };
    (cache, t)
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn tmp() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "tactic-cache-test-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_fresh_cache_is_used_and_its_winner_chosen() {
    let sm = Sm::Sm120;
    let (cache, t) = cache_for(sm);
    let dir = tmp();
    let p = write(&dir, "fresh.json", &cache.to_json());
    let lookup = load(&p, &Expected::for_sm(sm, None));
    assert_eq!(lookup.warning, None);
    assert_eq!(lookup.cache.as_ref(), Some(&cache));
    let chosen = lookup.choose::<MoeGemmTactic>(sm, &shape(1)).unwrap();
    assert_eq!(chosen.tactic, t);
    assert!(
        chosen.describe().contains("predicted"),
        "{}",
        chosen.describe()
    );
    // A nearby shape (2 tokens per expert) uses the nearest bucket.
    let near = lookup.choose::<MoeGemmTactic>(sm, &shape(2)).unwrap();
    assert_eq!(near.tactic, t);
    // Another family has no entry: its default.
    let mla = ProblemShape::mla(1, 8, 128, false, MlaDims::KIMI);
    let d = lookup.choose::<MlaTactic>(sm, &mla).unwrap();
    assert!(d.figure.is_none() && d.describe().contains("heuristic default"));
    std::fs::remove_dir_all(dir).unwrap();
}

fn assert_default(lookup: &CacheLookup, what: &str) {
    let w = lookup
        .warning
        .as_deref()
        .unwrap_or_else(|| panic!("{what}: no warning"));
    assert!(!w.contains('\n'), "{what}: {w}");
    assert!(w.contains(what), "{what}: {w}");
    assert!(lookup.cache.is_none());
    let sm = Sm::Sm120;
    let chosen = lookup.choose::<MoeGemmTactic>(sm, &shape(1)).unwrap();
    assert_eq!(
        chosen.tactic,
        MoeGemmTactic::heuristic_default(sm, &shape(1)).unwrap()
    );
    assert!(chosen.figure.is_none());
}

#[test]
fn missing_corrupt_and_stale_caches_warn_and_give_the_default() {
    let sm = Sm::Sm120;
    let dir = tmp();
    let expected = Expected::for_sm(sm, None);
    assert_default(&load(&dir.join("absent.json"), &expected), "not found");
    let (cache, _) = cache_for(sm);
    let text = cache.to_json();
    for (name, bad) in [
        ("truncated", &text[..text.len() / 2]),
        ("empty", ""),
        ("not-json", "\u{0}\u{1}garbage"),
        ("wrong-type", "{\"format\": \"one\"}"),
    ] {
        let p = write(&dir, name, bad);
        assert_default(&load(&p, &expected), "corrupt");
    }
    // Written for SM90.
    let (other_sm, _) = cache_for(Sm::Sm90);
    let p = write(&dir, "sm90.json", &other_sm.to_json());
    assert_default(&load(&p, &expected), "stale: tuned for sm_90a");
    // Other kernel sources.
    let mut edited = cache.clone();
    edited
        .provenance
        .kernel_source_hashes
        .insert("moe_gemm".into(), "0123456789abcdef".into());
    let p = write(&dir, "src.json", &edited.to_json());
    assert_default(&load(&p, &expected), "other moe_gemm kernel sources");
    // Another driver, when the reader has one.
    let p = write(&dir, "drv.json", &cache.to_json());
    let with_driver = Expected::for_sm(sm, Some("580.95".into()));
    assert_default(&load(&p, &with_driver), "driver");
    // Another format version.
    let mut v2 = cache.clone();
    v2.format = FORMAT + 1;
    let p = write(&dir, "v2.json", &v2.to_json());
    assert_default(&load(&p, &expected), "format");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_cached_tactic_that_does_not_fit_is_ignored() {
    let sm = Sm::Sm120;
    let (mut cache, _) = cache_for(sm);
    // An SM90-only tactic recorded in an SM120 cache (hand-edited): never offered.
    cache.entries[0].winner.tactic = MoeGemmTactic::enumerate(Sm::Sm90)[0].id();
    let lookup = CacheLookup {
        cache: Some(cache),
        warning: None,
    };
    let chosen = lookup.choose::<MoeGemmTactic>(sm, &shape(1)).unwrap();
    assert!(chosen.figure.is_none());
    assert!(chosen.tactic.fits(sm));
}

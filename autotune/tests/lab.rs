//! The tuning lab end to end, without a device: the stages prune what they must, the cache
//! holds only tactics that passed the static and correct stages, every figure is labelled
//! predicted, the provenance is complete, and the model reads the cache back.

use std::collections::BTreeSet;
use std::path::PathBuf;

use std::time::Duration;

use autotune::tune::{self, Options, Report, Timing};
use bench::gpu_timing::TimingOptions;
use kernels::arch::Sm;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::tactic::cache::{self, Expected, FigureSource, NO_GPU};
use kernels::tactic::{KernelFamily, Tactic};
use model::arch::presets::Preset;

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
        timing: Timing::Predict,
        device: 0,
        ptx_dir: root().join("ptx"),
        time_budget: Duration::from_secs(60),
        timing_options: TimingOptions::default(),
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
        KernelFamily::MlaDecode => kernels::mla::MlaSplitTactic::space(sm)
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
            c.enumerated > 0 && c.correct_ok > 0 && c.predicted_buckets > 0,
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
    let run = model::exec::tactics::RunShapes {
        sm,
        tp: 8,
        tokens: 1,
        context: 4096,
        fp8_cache: true,
    };
    let lines = model::exec::tactics::tactic_lines(Some(&path), &cfg, &run);
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
    assert_eq!(
        (
            c.static_ok,
            c.correct_ok,
            c.predicted_buckets,
            c.measured_buckets
        ),
        (0, 0, 0, 0)
    );
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
    assert!(c.predicted_buckets > 0);
}

/// A device ordinal that exists nowhere: what every machine without a GPU sees.
const NO_SUCH_DEVICE: usize = 9999;

#[test]
fn asked_to_measure_without_a_device_the_lab_refuses_and_says_why() {
    let mut opts = options(Sm::Sm120, &[KernelFamily::Layers], None);
    opts.timing = Timing::Measure;
    opts.device = NO_SUCH_DEVICE;
    let e = tune::run(&opts)
        .err()
        .expect("nothing to measure on")
        .to_string();
    assert!(e.contains("--timing measure"), "{e}");
    assert!(e.contains("no GPU") || e.contains("`cuda` feature"), "{e}");
    // `auto` falls back to predictions, and says so.
    opts.timing = Timing::Auto;
    let r = tune::run(&opts).unwrap();
    assert!(r.device.is_none() && r.measured.is_empty());
    assert!(
        r.notes
            .iter()
            .any(|n| n.contains("no sm_120a to measure on")),
        "{:?}",
        r.notes
    );
    assert!(
        r.cache
            .entries
            .iter()
            .all(|e| e.winner.source == FigureSource::Predicted)
    );
}

/// On the GPU (gpu-check.sh runs the binary; this is the same path as a test): every timed
/// figure is measured, with its median, spread and count, and the provenance names the device.
/// Without a GPU it fails with "no GPU", never passes.
#[test]
#[ignore = "needs a GPU of sm_90a or sm_120a and --features cuda"]
fn the_timed_stage_measures_on_the_device() {
    let sm = match std::env::var("KIMI_SM").as_deref() {
        Ok("90") => Sm::Sm90,
        _ => Sm::Sm120,
    };
    let mut opts = options(sm, &[KernelFamily::Layers], None);
    // On the stand-in driver the kernels run on the CPU, where Kimi's TP8 shapes outlast the
    // stage's time budget: CI times the generated `tiny` model's shapes on one rank instead.
    match std::env::var("LAB_TIMED_PRESET").as_deref() {
        Ok("tiny") => {
            opts.model = Preset::Tiny.model_config();
            opts.model_name = Preset::Tiny.id().into();
            opts.tp = 1;
        }
        Ok(other) => panic!("LAB_TIMED_PRESET={other}: only `tiny`"),
        Err(_) => {}
    }
    opts.timing = Timing::Measure;
    // KIMI_PTX_DIR where set (a bundle, the stand-in driver's images), else ptx/.
    opts.ptx_dir = kernels::tactic::timing::default_ptx_dir();
    let r = match tune::run(&opts) {
        Ok(r) => r,
        Err(e) => panic!("no GPU: {e}"),
    };
    let d = r.device.as_ref().expect("measured on a device");
    assert_eq!(r.cache.provenance.driver_version, d.driver_version);
    assert_ne!(r.cache.provenance.cuda_version, NO_GPU);
    for e in &r.cache.entries {
        assert_eq!(e.winner.source, FigureSource::Measured, "{}", e.bucket);
        assert!(e.winner.n >= 2 && e.winner.median_us > 0.0);
    }
}

/// The timed stage and the refit end to end, with a stand-in for the device's clock: each
/// (tactic, shape) "measures" the cost model's time under known parameters (±1%), the
/// all-reduce the link model's for ranks sharing one GPU. Every kernel figure in the cache is
/// then measured, the all-reduce's stay predicted, the refit finds the known parameters, and
/// the gap table names the widest gap per family.
#[test]
fn measured_figures_fill_the_cache_and_the_refit_recovers_the_parameters_behind_them() {
    use autotune::cost::CostParams;
    use autotune::manifest::Manifest;
    use autotune::refit::{self, one_gpu_host};
    use autotune::tune::{Measure, Predictor};
    use kernels::allreduce::cost::LinkParams;
    use kernels::allreduce::tactic::AllReduceTactic;
    use kernels::tactic::ProblemShape;
    use kernels::tactic::timing::{DeviceIdentity, Samples};

    struct KnownClock<'a> {
        truth: Predictor<'a>,
        links: LinkParams,
        calls: usize,
    }
    impl Measure for KnownClock<'_> {
        fn time(
            &mut self,
            family: KernelFamily,
            id: &str,
            shape: &ProblemShape,
        ) -> kernels::device::Result<Samples> {
            self.calls += 1;
            let us = if family == KernelFamily::AllReduce {
                let (host, _) = one_gpu_host(8);
                autotune::cost::allreduce(
                    &host,
                    &self.links,
                    &AllReduceTactic::parse_id(id).unwrap(),
                    shape,
                )
                .map(|p| p.us)
            } else {
                self.truth.predict_id(family, id, shape).map(|p| p.us)
            }
            .ok_or_else(|| kernels::device::DeviceError::Invalid("no time".into()))?;
            let noise = 1.0 + 0.01 * ((self.calls * 7 % 5) as f64 - 2.0) / 2.0;
            Ok(Samples {
                us: vec![us * noise * 0.995, us * noise, us * noise * 1.005],
            })
        }
    }

    let sm = Sm::Sm120;
    let opts = options(
        sm,
        &[
            KernelFamily::MoeGemm,
            KernelFamily::Layers,
            KernelFamily::AllReduce,
        ],
        None,
    );
    let manifest = Manifest::load(&opts.manifest).unwrap();
    let assumed = Predictor::new(sm, &opts.model, opts.tp, &manifest);
    let truth_params = CostParams {
        stream_efficiency: 0.7,
        launch_us: 3.5,
        ..CostParams::for_gpu(sm.reference_gpu())
    };
    let (_, one_gpu) = one_gpu_host(8);
    let mut clock = KnownClock {
        truth: assumed.with_params(truth_params.clone()),
        links: LinkParams {
            launch_us: 6.0,
            phase_sync_us: 1.5,
            ..one_gpu
        },
        calls: 0,
    };
    let identity = DeviceIdentity {
        name: "a known clock".into(),
        sm,
        multiprocessors: 188,
        l2_bytes: 128 << 20,
        driver_version: "580.0".into(),
        cuda_version: "13.0".into(),
    };
    let host = autotune::correct::host_device(sm);
    let r = tune::run_measured(&opts, &host, &mut clock, identity, Vec::new()).unwrap();
    println!("{}", r.table(sm));
    assert!(clock.calls > 0);
    let p = &r.cache.provenance;
    assert_eq!(
        (p.driver_version.as_str(), p.cuda_version.as_str()),
        ("580.0", "13.0")
    );
    assert!(p.gpu_or_cpu_model.contains("a known clock (measured)"));
    for e in &r.cache.entries {
        let want = if e.family == KernelFamily::AllReduce {
            FigureSource::Predicted
        } else {
            FigureSource::Measured
        };
        for f in std::iter::once(&e.winner).chain(&e.runners_up) {
            assert_eq!(f.source, want, "{} {}", e.bucket, f.tactic);
            if want == FigureSource::Measured {
                assert_eq!(f.n, 3);
                assert!(f.spread_us > 0.0 && f.median_us > 0.0);
            }
        }
    }
    let c = &r.counts[&KernelFamily::MoeGemm];
    assert_eq!(c.timed, c.correct_ok);
    assert!(c.measured_buckets > 0 && c.predicted_buckets == 0);
    assert!(r.counts[&KernelFamily::AllReduce].measured_buckets == 0);

    let refit = refit::refit(&r, &assumed, opts.tp).expect("measurements to refit");
    let k = refit.file.kernels.as_ref().expect("a kernel fit");
    println!(
        "kernel fit: {} points, rms {:.4} (assumed {:.3}), {:?}, held {:?}",
        k.points, k.rms_relative_residual, k.assumed_rms_relative_residual, k.params, k.held
    );
    assert!(k.rms_relative_residual < 0.02);
    assert!(k.assumed_rms_relative_residual > k.rms_relative_residual);
    assert!(
        (k.params.launch_us / 3.5 - 1.0).abs() < 0.05,
        "{:?}",
        k.params
    );
    assert!(
        (k.params.stream_efficiency / 0.7 - 1.0).abs() < 0.05,
        "{:?}",
        k.params
    );
    let a = refit.file.allreduce.as_ref().expect("an all-reduce fit");
    assert!(
        (a.launch_us - 6.0).abs() < 0.3 && (a.phase_sync_us - 1.5).abs() < 0.3,
        "{a:?}"
    );
    let table = refit::gap_table(&refit.gaps, &refit.file.measured_on);
    for family in ["moe_gemm", "layers", "allreduce"] {
        assert!(
            table
                .lines()
                .skip_while(|l| !l.starts_with("widest"))
                .skip(2)
                .take(3)
                .any(|l| l.starts_with(family)),
            "{family}: {table}"
        );
    }
    // The file reads back (floats to within their printed digits).
    let back = refit::CostModelFile::from_json(&refit.file.to_json()).unwrap();
    assert_eq!(
        (back.sm.as_str(), back.kernels.as_ref().map(|k| k.points)),
        ("sm_120a", Some(k.points))
    );
    assert!((back.kernels.unwrap().params.launch_us - k.params.launch_us).abs() < 1e-9);
}

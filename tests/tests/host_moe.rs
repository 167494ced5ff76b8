//! Every gated MoE tactic — the real `moe_gemm.cu`, compiled for the CPU and run by the host
//! execution layer (`cuda-host`) — against the PyTorch + ModelOpt goldens.
//!
//! The same launcher (`moe_gemm::launch`) and harness (`moe_gemm::check`) a GPU run uses:
//! buffers poisoned before each run (the NVFP4 intermediate with E4M3 NaN, so an unwritten
//! scale fails), two runs per case in different thread and block orders (forward, then a
//! seeded shuffle), and the GPU check's tolerance. The native SM120 tactics execute the
//! block-scaled FP4 `mma.sync` through the host layer's implementation of the instruction;
//! the portable ones the BF16 `mma.sync`; the emulated ones their shuffle-based emulation.

use std::time::Instant;

use cuda_host::{HostDevice, Schedule};
use kernels::arch::Sm;
use kernels::moe_gemm::check::check_case_with;
use kernels::moe_gemm::launch::{GroupedRouting, MoeDeviceRouting, MoeDeviceWeights, MoeKernels};
use kernels::moe_gemm::tactic::check_problem;
use kernels::moe_gemm::{MoeGemmTactic, ScaleLoad};
use project_tests::moe_goldens::kernel_golden_cases;

#[test]
fn every_moe_tactic_matches_the_goldens_on_the_host() {
    let filter = std::env::var("HOST_TACTICS").unwrap_or_default();
    let cases = kernel_golden_cases();
    let layouts = [ScaleLoad::Swizzled128x4, ScaleLoad::RowMajor];
    let mut failures = Vec::new();
    let mut ran = 0;
    let mut worst = (0.0f64, String::new());
    for sm in Sm::ALL {
        let dev = HostDevice::new(sm);
        let uploaded: Vec<_> = cases
            .iter()
            .map(|c| {
                let w = MoeDeviceWeights::upload(&dev, &c.weights, &layouts).unwrap();
                let g = GroupedRouting::new(&c.routing, c.experts()).unwrap();
                (w, MoeDeviceRouting::upload(&dev, g).unwrap())
            })
            .collect();
        for t in MoeGemmTactic::enumerate(sm) {
            if !t.id().contains(&filter) {
                continue;
            }
            let k = MoeKernels::load(&dev, t).unwrap();
            for (case, up) in cases.iter().zip(&uploaded) {
                check_problem(&t, case.hidden, case.inter).unwrap();
                let start = Instant::now();
                let result = check_case_with(&dev, &k, up, case, |run| {
                    dev.set_schedule(if run == 0 {
                        Schedule::Forward
                    } else {
                        Schedule::Shuffled(0x5eed + run as u64)
                    })
                });
                let history = dev.take_history();
                let mma: u64 = history.iter().map(|h| h.stats.mma).sum();
                ran += 1;
                match result {
                    Ok(c) => {
                        println!(
                            "{} {sm} {t} {}: rel L2 {:.2e} max {:.2e} rerun {:.0e}; {} launches, {mma} \
                             MMAs, {:.2} s",
                            if c.passed() { "PASS" } else { "FAIL" },
                            case.name,
                            c.rel_l2,
                            c.max_abs_rel,
                            c.run_to_run,
                            history.len(),
                            start.elapsed().as_secs_f64()
                        );
                        if c.rel_l2 > worst.0 {
                            worst = (c.rel_l2, format!("{t} on {}", case.name));
                        }
                        if !c.passed() {
                            failures.push(format!("{t} {}: {c:?}", case.name));
                        }
                    }
                    Err(e) => failures.push(format!("{t} {}: {e}", case.name)),
                }
            }
        }
    }
    println!(
        "host MoE: {ran} (tactic, case) runs; worst rel L2 {:.2e} ({})",
        worst.0, worst.1
    );
    assert!(ran > 0, "no tactic matched HOST_TACTICS={filter:?}");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The golden checkpoints' expert shapes — hidden 128 and 256, experts of 16 to 128
/// intermediate columns, padded by the executor to the kernels' 64 (`kernel_inter`,
/// `MoeWeightsHost::padded_inter`) — through every tactic that serves them, on the host for
/// both SMs: ModelOpt's `heavy_h128_i64` (24 tokens, several token tiles per expert) as it is
/// and padded to 128 columns, and random cases of 32 columns (`dsv3-mini-unsharded`, a TP2 rank
/// of `kimi-tiny`) and 16 (a TP2 rank of `dsv3-mini-unsharded`) against the CPU reference.
/// Zero columns must change nothing: the same tolerance as the unpadded goldens.
#[test]
fn the_golden_models_padded_expert_shapes_match_on_the_host() {
    use kernels::moe_gemm::check::{Case, random_case};
    use kernels::moe_gemm::launch::kernel_inter;
    use kernels::rng::Rng;
    use project_tests::moe_goldens::{WeightSource, kernel_case, load_file};
    let heavy = load_file("moe/small.safetensors", |_| WeightSource::Stored)
        .into_iter()
        .find(|c| c.name == "heavy_h128_i64")
        .expect("heavy_h128_i64 in small.safetensors");
    let padded = |case: Case, inter: usize| Case {
        name: format!("{} padded to {inter}", case.name),
        inter,
        weights: case.weights.padded_inter(inter),
        ..case
    };
    let mut rng = Rng(0x5eed_0010);
    let mut cases = vec![kernel_case(&heavy), padded(kernel_case(&heavy), 128)];
    for (name, hidden, inter) in [
        ("h128_i32", 128, 32),
        ("h256_i32", 256, 32),
        ("h128_i16", 128, 16),
    ] {
        let case = random_case(name, &mut rng, 20, 2, 8, hidden, inter);
        cases.push(padded(case, kernel_inter(inter)));
    }
    let mut failures = Vec::new();
    for sm in Sm::ALL {
        let dev = HostDevice::new(sm);
        for case in &cases {
            let layouts = [ScaleLoad::Swizzled128x4, ScaleLoad::RowMajor];
            let w = MoeDeviceWeights::upload(&dev, &case.weights, &layouts).unwrap();
            let g = GroupedRouting::new(&case.routing, case.experts()).unwrap();
            let up = (w, MoeDeviceRouting::upload(&dev, g).unwrap());
            let serving: Vec<MoeGemmTactic> = MoeGemmTactic::enumerate(sm)
                .into_iter()
                .filter(|t| check_problem(t, case.hidden, case.inter).is_ok())
                .collect();
            if serving.is_empty() {
                failures.push(format!("{sm} {}: no tactic serves it", case.name));
            }
            for t in serving {
                let k = MoeKernels::load(&dev, t).unwrap();
                match check_case_with(&dev, &k, &up, case, |_| {}) {
                    Ok(c) => {
                        println!(
                            "{} {sm} {t} {} (hidden {}, inter {}): rel L2 {:.2e} max {:.2e}",
                            if c.passed() { "PASS" } else { "FAIL" },
                            case.name,
                            case.hidden,
                            case.inter,
                            c.rel_l2,
                            c.max_abs_rel
                        );
                        if !c.passed() {
                            failures.push(format!("{sm} {t} {}: {c:?}", case.name));
                        }
                    }
                    Err(e) => failures.push(format!("{sm} {t} {}: {e}", case.name)),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

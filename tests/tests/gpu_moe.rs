//! GPU tests of the NVFP4 MoE kernels (feature `cuda`).
//!
//! Compiled only with `--features cuda`, and `#[ignore]`d so that a build without a GPU
//! reports them as ignored, never as passed. Run them on a machine with a GPU and the gate's
//! cubins (`scripts/compile-gates.sh`):
//!
//! ```sh
//! cargo test -p project-tests --features cuda --test gpu_moe -- --ignored --nocapture
//! ```
//!
//! A plain `cargo test` lists them as ignored (the skip, with its reason). Asked to run them
//! (`--ignored`) on a machine without a GPU, each fails with "no GPU": a GPU test never passes
//! without running. A present GPU with missing kernel images fails too: a setup error. The
//! same checks run on the CPU through the host execution layer in `host_moe.rs`.

#![cfg(feature = "cuda")]

use kernels::cuda::{GpuContext, default_ptx_dir};
use kernels::moe_gemm::check::{check_case, random_case};
use kernels::moe_gemm::launch::{
    GroupedRouting, MoeDeviceActivations, MoeDeviceRouting, MoeDeviceWeights, MoeKernels,
};
use kernels::moe_gemm::reference::Routing;
use kernels::moe_gemm::{MoeGemmTactic, ScaleLoad};
use kernels::rng::Rng;

/// The device; without one the test fails, naming why.
fn gpu(test: &str, ptx_dir: std::path::PathBuf) -> GpuContext {
    GpuContext::new(0, ptx_dir).unwrap_or_else(|e| panic!("{test}: no GPU: {e}"))
}

#[test]
#[ignore = "needs an NVIDIA GPU (sm_90 or sm_120) and the gate's cubins: run with --ignored"]
fn gpu_moe_every_tactic_matches_the_cpu_reference() {
    let gpu = gpu("gpu_moe_every_tactic", default_ptx_dir());
    let sm = gpu.sm().expect("kernels are built for this GPU");
    // Small but legal for every tactic: hidden a multiple of 256, inter of 128 and 2·128.
    let seed = 0x5eed_0001;
    let case = random_case("small", &mut Rng(seed), 12, 4, 8, 512, 256);
    let weights = MoeDeviceWeights::upload(
        &gpu,
        &case.weights,
        &[ScaleLoad::Swizzled128x4, ScaleLoad::RowMajor],
    )
    .unwrap();
    let routing =
        MoeDeviceRouting::upload(&gpu, GroupedRouting::new(&case.routing, 8).unwrap()).unwrap();
    let dev = (weights, routing);
    let mut failures = Vec::new();
    let tactics = MoeGemmTactic::enumerate(sm);
    for &t in &tactics {
        let result = MoeKernels::load(&gpu, t)
            .map_err(|e| e.to_string())
            .and_then(|k| check_case(&gpu, &k, &dev, &case));
        match result {
            Ok(c) if c.passed() => println!("PASS {t}: rel_l2 {:.1e}", c.rel_l2),
            Ok(c) => failures.push(format!("{t}: {c:?}")),
            Err(e) => failures.push(format!("{t}: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "seed {seed:#x}: {} of {} tactics failed:\n{}",
        failures.len(),
        tactics.len(),
        failures.join("\n")
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU (sm_90 or sm_120) and the gate's cubins: run with --ignored"]
fn gpu_moe_without_tokens_launches_nothing() {
    let gpu = gpu("gpu_moe_without_tokens", default_ptx_dir());
    let sm = gpu.sm().expect("kernels are built for this GPU");
    let case = random_case("small", &mut Rng(7), 2, 2, 4, 512, 256);
    let empty = Routing {
        top_k: 2,
        experts: vec![],
        weights: vec![],
    };
    let w = MoeDeviceWeights::upload(&gpu, &case.weights, &[ScaleLoad::Swizzled128x4]).unwrap();
    let r = MoeDeviceRouting::upload(&gpu, GroupedRouting::new(&empty, 4).unwrap()).unwrap();
    let mut a = MoeDeviceActivations::new(&gpu, &[], 0, 512, 256, 0).unwrap();
    let t = MoeGemmTactic::enumerate(sm)[0];
    let k = MoeKernels::load(&gpu, t).unwrap();
    // A zero grid dimension is an invalid launch: the launcher must not issue it.
    k.run(&gpu, &w, &r, &mut a).unwrap();
    gpu.synchronize().unwrap();
    assert!(a.read_out(&gpu).unwrap().is_empty());
}

#[test]
#[ignore = "needs an NVIDIA GPU (sm_90 or sm_120): run with --ignored"]
fn gpu_missing_kernel_image_names_the_files_tried() {
    let dir = tempfile::tempdir().unwrap();
    let gpu = gpu("gpu_missing_kernel_image", dir.path().to_path_buf());
    let sm = gpu.sm().expect("kernels are built for this GPU");
    let t = MoeGemmTactic::enumerate(sm)[0];
    let msg = match MoeKernels::load(&gpu, t) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("loaded {t} from an empty folder"),
    };
    assert!(msg.contains(&format!("{}.cubin", t.id())), "{msg}");
    assert!(msg.contains(&format!("{}.ptx", t.id())), "{msg}");
}

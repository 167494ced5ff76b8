//! GPU test of the decode step's small kernels (feature `cuda`): every check of
//! `project_tests::layer_checks` on the GPU, with the gate's cubins (`ptx/layers/<sm>/`).
//!
//! `#[ignore]`d, so a build without a GPU reports it as ignored, never as passed; asked to run
//! (`--ignored`) without a GPU it fails with "no GPU". Run it with
//!
//! ```sh
//! cargo test -p project-tests --features cuda --test gpu_layers -- --ignored --nocapture
//! ```

#![cfg(feature = "cuda")]

use kernels::cuda::{GpuContext, default_ptx_dir};
use kernels::layers::LayerKernels;
use project_tests::layer_checks;

#[test]
#[ignore = "needs an NVIDIA GPU (sm_90 or sm_120) and the gate's cubins: run with --ignored"]
fn gpu_layers_match_the_cpu_forward_pass() {
    let gpu =
        GpuContext::new(0, default_ptx_dir()).unwrap_or_else(|e| panic!("gpu_layers: no GPU: {e}"));
    let kernels = LayerKernels::load(&gpu).expect("layers cubins (scripts/compile-gates.sh)");
    for (name, check) in layer_checks::all::<GpuContext>() {
        check(&gpu, &kernels);
        println!("PASS {name}");
    }
}

//! The dense products' two tactics on the host execution layer, through the checks of
//! `project_tests::dense_checks` (the ones `gpu_dense.rs` runs on a GPU, where the vendor side
//! is cuBLASLt): here the vendor side is the reference of cuBLASLt's semantics the host layer
//! stands in with, so they check its plumbing (strided output, β, graph capture) and our
//! `dense_bf16` against exact products.

use cuda_host::HostDevice;
use kernels::arch::Sm;
use kernels::layers::LayerKernels;
use project_tests::dense_checks::{check_products, kimi_products};

/// Kimi-K2.5's TP8 decode products but the two widest (lm_head, the dense layer's gate/up),
/// which the host layer's one-thread reference would take minutes over; a GPU runs all.
#[test]
fn both_dense_tactics_compute_kimi_tp8_decode_products() {
    let dev = HostDevice::new(Sm::Sm120);
    let kernels = LayerKernels::load(&dev).unwrap();
    let products: Vec<_> = kimi_products(8)
        .into_iter()
        .filter(|p| p.n * p.k <= 4096 * 7168)
        .collect();
    assert!(products.len() >= 8, "{products:?}");
    for line in check_products(&dev, &kernels, &products, &[1, 3]) {
        println!("{line}");
    }
}

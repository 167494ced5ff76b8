//! GPU test of the dense products' two tactics (feature `cuda`): our `dense_bf16` and
//! cuBLASLt (`Device::blas_gemm`) on every dense product of a Kimi-K2.5 TP8 decode step at 1,
//! 8 and 32 tokens, each against exact products of its inputs and the two against each other
//! (`project_tests::dense_checks`), then both timed: the median of CUDA-event-timed runs,
//! cuBLASLt with the BF16 conversion of its input the executor launches before it.
//!
//! `#[ignore]`d, so a build without a GPU reports it as ignored, never as passed; asked to run
//! (`--ignored`) without a GPU it fails with "no GPU". Run it with
//!
//! ```sh
//! cargo test -p project-tests --features cuda --test gpu_dense -- --ignored --nocapture
//! ```

#![cfg(feature = "cuda")]

use kernels::cuda::{GpuContext, default_ptx_dir};
use kernels::device::DeviceExt;
use kernels::layers::{DenseOutput, LayerKernels};
use project_tests::dense_checks::{Case, check_products, kimi_products, vendor_ready};

const TOKENS: [usize; 3] = [1, 8, 32];
const WARMUP: usize = 3;
const ITERS: usize = 20;

/// Median milliseconds of `iters` runs of `f`, each between two events.
fn time_ms(gpu: &GpuContext, mut f: impl FnMut()) -> f64 {
    let (start, end) = (gpu.timing_event().unwrap(), gpu.timing_event().unwrap());
    let mut times = Vec::with_capacity(ITERS);
    for i in 0..WARMUP + ITERS {
        gpu.record(&start).unwrap();
        f();
        gpu.record(&end).unwrap();
        end.synchronize().unwrap();
        if i >= WARMUP {
            times.push(start.elapsed_ms(&end).unwrap() as f64);
        }
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

#[test]
#[ignore = "needs an NVIDIA GPU (sm_90 or sm_120) and the gate's cubins (cuBLASLt, where present, too): run with --ignored"]
fn gpu_dense_ours_and_cublaslt_agree_and_are_timed() {
    let gpu =
        GpuContext::new(0, default_ptx_dir()).unwrap_or_else(|e| panic!("gpu_dense: no GPU: {e}"));
    let k = LayerKernels::load(&gpu).expect("layers cubins (scripts/compile-gates.sh)");
    let products = kimi_products(8);
    for line in check_products(&gpu, &k, &products, &TOKENS) {
        match line.strip_prefix("SKIP ") {
            Some(why) => println!("SKIP {why}"),
            None => println!("PASS {line}"),
        }
    }
    if std::env::var("GPU_DENSE_TIMING").as_deref() == Ok("0") {
        // `gpu-check.sh --first-run`: the checks above only.
        println!("timing skipped (GPU_DENSE_TIMING=0)");
        return;
    }
    let vendor = vendor_ready(&gpu).is_ok();
    println!("timing (measured, median of {ITERS} runs; weight bytes read / time):");
    let mut totals = [[0.0f64; 2]; TOKENS.len()];
    for (i, &product) in products.iter().enumerate() {
        for (ti, &m) in TOKENS.iter().enumerate() {
            let case = Case::new(&gpu, product, m, 0x7e + i as u64);
            let y = gpu.alloc_elements::<f32>(m * product.n).unwrap();
            let ours = time_ms(&gpu, || case.ours(&gpu, &k, &y, false));
            let vendor = if !vendor {
                f64::NAN
            } else {
                time_ms(&gpu, || {
                    k.to_bf16_strided(
                        &gpu,
                        &case.x_d,
                        m,
                        product.k,
                        0,
                        0,
                        1,
                        product.k,
                        &case.x_bf16_d,
                    )
                    .unwrap();
                    case.vendor(&gpu, &y, DenseOutput::packed(product.n), false);
                })
            };
            totals[ti][0] += ours;
            totals[ti][1] += vendor;
            let gbs = |ms: f64| (product.n * product.k * 2) as f64 / (ms * 1e-3) / 1e9;
            println!(
                "  {:<20} m {m:>2} n {:>6} k {:>5}: dense_bf16 {:>8.2} us ({:>6.0} GB/s), \
                 cublaslt {:>8.2} us ({:>6.0} GB/s)",
                product.name,
                product.n,
                product.k,
                ours * 1e3,
                gbs(ours),
                vendor * 1e3,
                gbs(vendor)
            );
        }
    }
    for (ti, &m) in TOKENS.iter().enumerate() {
        println!(
            "  all products once, m {m:>2}: dense_bf16 {:.1} us, cublaslt {:.1} us",
            totals[ti][0] * 1e3,
            totals[ti][1] * 1e3
        );
    }
    gpu.synchronize().unwrap();
}

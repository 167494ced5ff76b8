//! Single-thread speed of the NVFP4 row kernels, f32 FMA against integer W4A4 dots, on weights
//! that stay in the last-level cache: the compute cost per weight byte, without DRAM. The
//! minimum over many repetitions is reported (robust to preemption on a shared machine).
//!
//! ```sh
//! cargo run --release -p bench --example int_dot_speed [-- ROWSxCOLS ...]
//! ```
//! The default shapes are Kimi's expert and dense shapes (megabytes: the last-level cache);
//! the `mini` experts' `384x1024` and `1024x384` fit in L2.

use std::time::Instant;

use kernels::formats::nvfp4::{NVFP4_BLOCK, Nvfp4View};
use kernels::isa::Isa;
use kernels::moe_gemm::cpu_int::{
    IntActs, IntKernel, nvfp4_rows_dots_int, padded_blocks, padded_cols, quantize_row_int,
};
use kernels::moe_gemm::cpu_simd::{interleave_blocks, nvfp4_rows_dots};

fn main() {
    let reps = 40;
    let mut shapes: Vec<(usize, usize)> = std::env::args()
        .skip(1)
        .map(|s| {
            let (r, c) = s.split_once('x').expect("a shape ROWSxCOLS");
            (r.parse().expect("rows"), c.parse().expect("cols"))
        })
        .collect();
    if shapes.is_empty() {
        shapes = vec![(1024, 7168), (7168, 256), (4096, 1024), (8192, 384)];
    }
    for (rows, cols) in shapes {
        let packed: Vec<u8> = (0..rows * cols / 2)
            .map(|i| (i * 7919 % 251) as u8)
            .collect();
        let scales: Vec<u8> = (0..rows * cols / NVFP4_BLOCK)
            .map(|i| 0x30 | (i % 16) as u8)
            .collect();
        let w = Nvfp4View {
            rows,
            cols,
            packed: &packed,
            block_scales: &scales,
            global_scale: 1e-3,
        };
        let bytes = (packed.len() + scales.len()) as f64;
        for n in [1usize, 4] {
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 104729) % 1999) as f32 / 999.0 - 1.0)
                .collect();
            let mut xi = x.clone();
            xi.chunks_exact_mut(cols).for_each(interleave_blocks);
            let (pc, pb) = (padded_cols(cols), padded_blocks(cols));
            let mut codes = vec![0i8; n * pc];
            let mut corr = vec![0i32; n * pb];
            let mut sa = vec![0f32; n * pb];
            for t in 0..n {
                quantize_row_int(
                    &x[t * cols..(t + 1) * cols],
                    1.0 / 2688.0,
                    &mut codes[t * pc..(t + 1) * pc],
                    &mut corr[t * pb..(t + 1) * pb],
                    &mut sa[t * pb..(t + 1) * pb],
                );
            }
            let acts = IntActs {
                cols,
                codes: &codes,
                corr: &corr,
                scales: &sa,
                input_scale: 1.0 / 2688.0,
            };
            let mut out = vec![0f32; n * rows];
            for isa in Isa::all_supported() {
                if isa == Isa::Scalar {
                    continue;
                }
                let time = |f: &mut dyn FnMut()| {
                    f();
                    (0..reps)
                        .map(|_| {
                            let t = Instant::now();
                            f();
                            t.elapsed().as_secs_f64()
                        })
                        .fold(f64::INFINITY, f64::min)
                };
                let f32_s = time(&mut || nvfp4_rows_dots(isa, &w, 0..rows, &xi, n, &mut out, rows));
                let int_s =
                    time(&mut || nvfp4_rows_dots_int(isa, &w, 0..rows, &acts, n, &mut out, rows));
                println!(
                    "rows={rows} cols={cols} tokens={n} isa={isa:?} int_kernel={:?} \
                     f32={:.1} GB/s int={:.1} GB/s ratio={:.2}",
                    IntKernel::for_isa(isa),
                    bytes / f32_s / 1e9,
                    bytes / int_s / 1e9,
                    f32_s / int_s
                );
            }
        }
    }
}

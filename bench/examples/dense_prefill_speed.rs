//! Speed of the dense BF16 product at prefill shapes (many tokens per weight read): the f32
//! panel path against the register tiles, interleaved in one run, as GFLOP/s. The best of
//! many repetitions is reported (robust to preemption on a shared machine).
//!
//! ```sh
//! cargo run --release -p bench --example dense_prefill_speed
//! ```
use std::time::Instant;

use half::bf16;
use kernels::cpu_tactic::CpuTactic;
use kernels::dense::matmul_transposed_tuned;
use kernels::matrix::MatrixView;

fn main() {
    let panel = CpuTactic {
        dense_panel_min_tokens: 2,
        ..CpuTactic::DEFAULT
    };
    let tiles = CpuTactic {
        dense_panel_min_tokens: 1 << 20,
        ..CpuTactic::DEFAULT
    };
    println!("shape (tokens x rows x cols): register tiles | f32 panel  GFLOP/s, best of 15");
    for (tokens, rows, cols) in [
        (128usize, 1024usize, 1024usize),
        (128, 576, 1024),
        (128, 2816, 1024),
        (128, 1024, 2816),
        (512, 1024, 1024),
        (512, 1536, 384),
        (16, 1024, 1024),
        (8, 1024, 1024),
        (4, 1024, 1024),
        (4, 2816, 1024),
        (4, 1024, 2816),
        (4, 32768, 1024),
        (3, 1024, 1024),
        (2, 1024, 1024),
    ] {
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let w: Vec<bf16> = (0..rows * cols)
            .map(|i| bf16::from_f32(((i * 53 % 97) as f32 - 48.0) / 40.0))
            .collect();
        let view = MatrixView::Bf16 {
            rows,
            cols,
            data: &w,
        };
        let mut out = vec![0.0f32; tokens * rows];
        let mut best = [f64::MAX; 2];
        for _ in 0..15 {
            for (b, tactic) in best.iter_mut().zip([&tiles, &panel]) {
                let start = Instant::now();
                matmul_transposed_tuned(tactic, &x, tokens, view, &mut out);
                *b = b.min(start.elapsed().as_secs_f64());
            }
        }
        let flops = 2.0 * (tokens * rows * cols) as f64;
        println!(
            "{tokens}x{rows}x{cols}: {:.1} | {:.1}  ({:.2}x)",
            flops / best[0] / 1e9,
            flops / best[1] / 1e9,
            best[0] / best[1]
        );
    }
}

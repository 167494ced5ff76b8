//! Speed of the integer activation quantization (`quantize_row_int`) per element, single
//! thread, at the hidden and intermediate widths of the `mini` preset and Kimi-K2.5, for every
//! instruction set this CPU has. Best of 2000 calls.
//!
//! ```sh
//! cargo run --release -p bench --example quantize_speed
//! ```
use std::time::Instant;

use kernels::isa::Isa;
use kernels::moe_gemm::cpu_int::{padded_blocks, padded_cols, quantize_row_int_with};

fn main() {
    for isa in Isa::all_supported() {
        for cols in [384usize, 1024, 2048, 7168] {
            let row: Vec<f32> = (0..cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            let (mut codes, mut corr, mut scales) = (
                vec![0i8; padded_cols(cols)],
                vec![0i32; padded_blocks(cols)],
                vec![0f32; padded_blocks(cols)],
            );
            let best = (0..2000)
                .map(|_| {
                    let start = Instant::now();
                    quantize_row_int_with(isa, &row, 0.01, &mut codes, &mut corr, &mut scales);
                    start.elapsed().as_secs_f64()
                })
                .fold(f64::MAX, f64::min);
            println!(
                "{isa:?} {cols:>5} columns: {:6.2} µs, {:.2} ns per element",
                best * 1e6,
                best * 1e9 / cols as f64
            );
        }
    }
}

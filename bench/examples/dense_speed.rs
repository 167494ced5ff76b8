//! Speed of the dense BF16 product at decode shapes, against the read bandwidth.
use half::bf16;
use kernels::dense::matmul_transposed;
use kernels::matrix::MatrixView;
use std::time::Instant;
fn main() {
    let (_, read) = bench::bandwidth(5);
    for (rows, cols) in [
        (32768usize, 1024usize),
        (2816, 1024),
        (1024, 2816),
        (576, 1024),
        (64, 1024),
        (8192, 1024),
    ] {
        let sets = (256usize << 20) / (rows * cols * 2) + 1;
        let w: Vec<Vec<bf16>> = (0..sets)
            .map(|s| {
                (0..rows * cols)
                    .map(|i| bf16::from_f32(((i + s) % 7) as f32 * 0.1))
                    .collect()
            })
            .collect();
        let x = vec![0.5f32; cols];
        let mut out = vec![0.0f32; rows];
        let mut best = f64::MAX;
        for it in 0..20 {
            let start = Instant::now();
            matmul_transposed(
                &x,
                1,
                MatrixView::Bf16 {
                    rows,
                    cols,
                    data: &w[it % sets],
                },
                &mut out,
            );
            best = best.min(start.elapsed().as_secs_f64());
        }
        let gbs = (rows * cols * 2) as f64 / best / 1e9;
        println!(
            "{rows}x{cols}: {:.3} ms, {gbs:.1} GB/s, {:.2} of read {read:.1}",
            best * 1e3,
            gbs / read
        );
    }
}

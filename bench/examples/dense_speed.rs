//! Speed of the dense BF16 product at decode shapes (one token), against the read bandwidth,
//! with the weights on 2 MiB pages as `model run` reads them (`--weights auto`) and a weight
//! set larger than the last-level cache rotated through, so every call streams from DRAM.
//!
//! ```sh
//! cargo run --release -p bench --example dense_speed
//! ```
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
        (2048, 1024),
        (1536, 384),
        (576, 1024),
        (512, 128),
    ] {
        let sets = (512usize << 20) / (rows * cols * 2) + 1;
        let bytes = sets * rows * cols * 2;
        let mut map = memmap2::MmapMut::map_anon(bytes).expect("anonymous memory");
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        // SAFETY: the mapping is page-aligned and holds `bytes / 2` BF16 values.
        let all: &mut [bf16] =
            unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr().cast(), bytes / 2) };
        for (i, v) in all.iter_mut().enumerate() {
            *v = bf16::from_f32((i % 7) as f32 * 0.1);
        }
        let x = vec![0.5f32; cols];
        let mut out = vec![0.0f32; rows];
        let mut best = f64::MAX;
        for it in 0..60 {
            let set = &all[(it % sets) * rows * cols..][..rows * cols];
            let start = Instant::now();
            matmul_transposed(
                &x,
                1,
                MatrixView::Bf16 {
                    rows,
                    cols,
                    data: set,
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

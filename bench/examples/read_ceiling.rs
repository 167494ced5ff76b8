//! What a one-token dense BF16 product leaves of the read bandwidth, and whether weights
//! pulled into the caches during arithmetic-bound work make the next product cheaper.
//!
//! 1. `lm_head`'s shape (32768 × 1024 BF16, on 2 MiB pages, rotated through 512 MiB so each
//!    call streams from DRAM) through the kernel, beside a plain sum of the same bytes cut
//!    into the same 64-row tasks: the sum is what the task split itself allows, the kernel
//!    what its arithmetic leaves of it.
//! 2. Arithmetic standing in for MLA attention (both threads, no memory traffic), then a
//!    1024 × 1024 product (`o_proj`'s shape): cold, or with its weights prefetched (`T0` or
//!    `T1`) from inside the arithmetic loop, spread evenly over it.
//!
//! ```sh
//! cargo run --release -p bench --example read_ceiling [-- ROUNDS]
//! ```
use half::bf16;
use kernels::dense::matmul_transposed;
use kernels::matrix::MatrixView;
use kernels::prefetch::PrefetchHint;
use rayon::prelude::*;
use std::hint::black_box;
use std::time::Instant;

/// Bytes of weights the calls rotate through: far beyond any last-level cache.
const ROTATED_BYTES: usize = 512 << 20;
/// Calls per variant and round; the fastest counts.
const CALLS: usize = 10;
/// The kernel's task size at one token (the default `dense_rows`), in rows.
const TASK_ROWS: usize = 64;
/// Iterations of the stand-in arithmetic per thread (about 55 µs on a Zen 4 EPYC).
const ARITHMETIC_ITERATIONS: usize = 12_000;

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(6, |s| s.parse().expect("a number of rounds"));
    let weights = bench::RotatedBf16::new(ROTATED_BYTES);
    let mut rotation = weights.rotation();
    let mut next = |rows: usize, cols: usize| rotation.next(rows * cols);
    println!("1. 32768x1024 BF16, one token: GB/s (share of the round's read bandwidth)");
    let (rows, cols) = (32768, 1024);
    let (x, mut out) = (vec![0.5f32; cols], vec![0.0f32; rows]);
    for round in 0..rounds {
        let (_, read) = bench::bandwidth_on(bench::Pages::Huge, bench::COPY_BYTES, 3);
        let (mut kernel, mut sum) = (f64::MAX, f64::MAX);
        for _ in 0..CALLS {
            let w = next(rows, cols);
            let start = Instant::now();
            one_token_product(&x, w, &mut out);
            kernel = kernel.min(start.elapsed().as_secs_f64());
            let w = next(rows, cols);
            let start = Instant::now();
            black_box(w.par_chunks(TASK_ROWS * cols).map(sum_words).sum::<u64>());
            sum = sum.min(start.elapsed().as_secs_f64());
        }
        let gbs = |t: f64| (rows * cols * 2) as f64 / t / 1e9;
        println!(
            "  round {round}: read {read:.1}; kernel {:.1} ({:.2}); plain sum, same tasks {:.1} ({:.2})",
            gbs(kernel),
            gbs(kernel) / read,
            gbs(sum),
            gbs(sum) / read
        );
    }
    println!(
        "2. arithmetic on both threads, then a 1024x1024 BF16 product: µs, fastest of {CALLS}"
    );
    let (rows, cols) = (1024, 1024);
    let (x, mut out) = (vec![0.5f32; cols], vec![0.0f32; rows]);
    for round in 0..rounds {
        let mut best = [f64::MAX; 4];
        for _ in 0..CALLS {
            // (the product after the arithmetic, what the arithmetic prefetches)
            let variants = [
                (false, None),
                (true, None),
                (true, Some(PrefetchHint::L1)),
                (true, Some(PrefetchHint::L2)),
            ];
            for (k, (product, hint)) in variants.into_iter().enumerate() {
                let w = next(rows, cols);
                let (first, second) = w.split_at(w.len() / 2);
                let start = Instant::now();
                black_box(rayon::join(
                    || arithmetic(hint.map(|h| (first, h))),
                    || arithmetic(hint.map(|h| (second, h))),
                ));
                if product {
                    one_token_product(&x, w, &mut out);
                }
                best[k] = best[k].min(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        let [alone, cold, t0, t1] = best;
        println!(
            "  round {round}: arithmetic {alone:.1}; then cold product {cold:.1} (+{:.1}); warmed by T0 {t0:.1} (+{:.1}); by T1 {t1:.1} (+{:.1})",
            cold - alone,
            t0 - alone,
            t1 - alone
        );
    }
}

/// `out = x · wᵀ` for one token, `w` of `out.len()` rows of `x.len()` columns.
fn one_token_product(x: &[f32], w: &[bf16], out: &mut [f32]) {
    let (rows, cols) = (out.len(), x.len());
    matmul_transposed(
        x,
        1,
        MatrixView::Bf16 {
            rows,
            cols,
            data: w,
        },
        out,
    );
}

/// The wrapping sum of `w`'s bytes read as `u64` words by the read-bandwidth loop's own sum
/// ([`bench::read_sum`]): the loads alone.
fn sum_words(w: &[bf16]) -> u64 {
    // SAFETY: every bit pattern is a valid u64; the unaligned ends are summed apart.
    let (head, words, tail) = unsafe { w.align_to::<u64>() };
    let ends = head.iter().chain(tail).map(|b| u64::from(b.to_bits()));
    ends.fold(bench::read_sum(words), u64::wrapping_add)
}

/// A dependent multiply-add chain per lane for [`ARITHMETIC_ITERATIONS`] steps; with `warm`,
/// prefetches of its lines under its hint, spread evenly over the steps.
fn arithmetic(warm: Option<(&[bf16], PrefetchHint)>) -> f32 {
    let mut a = [1.0f32; 16];
    let lines = warm.map_or(0, |(w, _)| w.len() * 2 / 64);
    let every = ARITHMETIC_ITERATIONS
        .checked_div(lines)
        .unwrap_or(usize::MAX)
        .max(1);
    let mut line = 0;
    for i in 0..ARITHMETIC_ITERATIONS {
        for v in a.iter_mut() {
            *v = *v * 0.999_9 + 0.000_1;
        }
        black_box(&mut a);
        if let Some((w, hint)) = warm
            && i % every == 0
            && line < lines
        {
            hint.line(w.as_ptr().cast::<u8>().wrapping_add(line * 64));
            line += 1;
        }
    }
    a.iter().sum()
}

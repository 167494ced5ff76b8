//! Whether a batch-1 decode on two vCPUs gains by giving one of them to the memory stream:
//! `lm_head`'s shape (32768 × 1024 BF16, one token, on 2 MiB pages, rotated through 512 MiB so
//! each call streams from DRAM) computed
//! - by the kernel on both threads (guided claims, as the model runs it);
//! - by one thread alone, 64-row blocks in order;
//! - by one thread while the other only loads each 64-byte line of the rows ahead of it, at
//!   most a lead of bytes ahead of the rows already done (it waits when that far ahead).
//!
//! If the second vCPU's arithmetic adds little (the two sharing one core's units), its loads
//! should keep the rows in the caches ahead of the computing thread and read more of the
//! bandwidth than both threads computing. Each round measures the read bandwidth first and
//! prints each variant's share of it (fastest of its calls).
//!
//! ```sh
//! cargo run --release -p bench --example stream_helper [-- ROUNDS]
//! ```
use half::bf16;
use kernels::dense::matmul_transposed;
use kernels::matrix::MatrixView;
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Bytes of weights the calls rotate through: far beyond any last-level cache.
const ROTATED_BYTES: usize = 512 << 20;
/// Calls per variant and round; the fastest counts.
const CALLS: usize = 6;
/// Rows the computing thread takes per block: the kernel's task at one token (`dense_rows`).
const BLOCK_ROWS: usize = 64;
/// How far ahead of the computing thread the helper may load: L2's share of a core, up to most
/// of the last-level cache (Zen 4: 1-2 MiB L2 per core, 32 MiB L3).
const LEADS: [usize; 6] = [256 << 10, 1 << 20, 3 << 20, 6 << 20, 12 << 20, 24 << 20];

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(6, |s| s.parse().expect("a number of rounds"));
    let (rows, cols) = (32768, 1024);
    let weights = bench::RotatedBf16::new(ROTATED_BYTES);
    let mut rotation = weights.rotation();
    let (x, mut out) = (vec![0.5f32; cols], vec![0.0f32; rows]);
    for round in 0..rounds {
        let (_, read) = bench::bandwidth_on(bench::Pages::Huge, bench::COPY_BYTES, 3);
        let mut best = vec![f64::MAX; 2 + LEADS.len()];
        for _ in 0..CALLS {
            for (k, best) in best.iter_mut().enumerate() {
                let w = rotation.next(rows * cols);
                let start = Instant::now();
                match k {
                    0 => matmul_transposed(&x, 1, view(w, rows, cols), &mut out),
                    1 => serial(&x, w, &mut out, None),
                    _ => {
                        let done = AtomicUsize::new(0);
                        let lead = LEADS[k - 2];
                        rayon::join(
                            || serial(&x, w, &mut out, Some(&done)),
                            || stream_ahead(w, &done, lead),
                        );
                    }
                }
                *best = best.min(start.elapsed().as_secs_f64());
            }
        }
        let gbs = |t: f64| (rows * cols * 2) as f64 / t / 1e9;
        let mut line = format!(
            "round {round}: read {read:.1}; both threads {:.2}; one thread {:.2}; helper lead",
            gbs(best[0]) / read,
            gbs(best[1]) / read
        );
        for (i, lead) in LEADS.iter().enumerate() {
            line += &format!(" {}K {:.2}", lead >> 10, gbs(best[2 + i]) / read);
        }
        println!("{line}");
    }
}

fn view(w: &[bf16], rows: usize, cols: usize) -> MatrixView<'_> {
    MatrixView::Bf16 {
        rows,
        cols,
        data: w,
    }
}

/// `out = x · wᵀ` on this thread, 64-row blocks in order, each block's end stored in `done`
/// (bytes of `w`) as it is reached.
fn serial(x: &[f32], w: &[bf16], out: &mut [f32], done: Option<&AtomicUsize>) {
    let cols = x.len();
    for (b, (w, out)) in w
        .chunks(BLOCK_ROWS * cols)
        .zip(out.chunks_mut(BLOCK_ROWS))
        .enumerate()
    {
        matmul_transposed(x, 1, view(w, out.len(), cols), out);
        if let Some(done) = done {
            done.store((b + 1) * BLOCK_ROWS * cols * 2, Ordering::Release);
        }
    }
}

/// Loads one word of every 64-byte line of `w`, in order, never more than `lead` bytes past
/// `done`.
fn stream_ahead(w: &[bf16], done: &AtomicUsize, lead: usize) {
    let bytes = w.len() * 2;
    let base = w.as_ptr().cast::<u8>();
    let mut at = 0usize;
    let mut acc = 0u64;
    while at < bytes {
        let limit = done.load(Ordering::Acquire) + lead;
        if at >= limit {
            std::hint::spin_loop();
            continue;
        }
        let end = limit.min(bytes).min(at + (64 << 10));
        while at < end {
            // SAFETY: at < bytes.
            acc = acc.wrapping_add(unsafe { base.add(at).cast::<u64>().read_volatile() });
            at += 64;
        }
    }
    black_box(acc);
}

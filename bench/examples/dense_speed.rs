//! Speed of the dense BF16 product at decode shapes (one token) under each prefetch reach
//! ([`PrefetchReach`]: near, far, off, far-l2), against the read bandwidth measured in the
//! same round: the weights on 2 MiB pages as `model run` reads them (`--weights auto`), a
//! weight set larger than the last-level cache rotated through so every call streams from
//! DRAM. The reaches alternate
//! within each round, so a drift of the machine's bandwidth (which moves between ~40 and
//! ~80 GB/s within minutes on a shared VM) falls on all; the summary is the median over the
//! rounds of each reach's time over near's, and of each reach's share of the round's read
//! bandwidth.
//! Each call comes from outside the rayon pool and wakes it, so the products of about a MB
//! (1536 × 384, 576 × 1024) read well below the bandwidth here for that wake-up alone; in
//! `model run` a step's calls come from a pool thread whose helpers spin.
//!
//! ```sh
//! cargo run --release -p bench --example dense_speed [-- ROUNDS]
//! ```
use bench::cpu_tactics::median_spread;
use kernels::dense::matmul_transposed;
use kernels::matrix::MatrixView;
use kernels::prefetch::PrefetchReach;
use std::time::Instant;

/// Bytes of weights the calls rotate through: far beyond any last-level cache.
const ROTATED_BYTES: usize = 512 << 20;
/// Calls per shape, reach and round; the fastest counts.
const CALLS: usize = 12;

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(8, |s| s.parse().expect("a number of rounds"));
    let shapes = [
        (32768usize, 1024usize),
        (2816, 1024),
        (1024, 2816),
        (2048, 1024),
        (1536, 384),
        (576, 1024),
        (512, 128),
    ];
    let weights = bench::RotatedBf16::new(ROTATED_BYTES);
    let mut rotation = weights.rotation();
    let reaches = PrefetchReach::ALL;
    // [shape][reach]: GB/s over the round's read bandwidth.
    let mut shares = vec![[const { Vec::new() }; PrefetchReach::ALL.len()]; shapes.len()];
    // [shape][reach]: near's GB/s over the reach's (its time over near's).
    let mut over_near = vec![[const { Vec::new() }; PrefetchReach::ALL.len()]; shapes.len()];
    for round in 0..rounds {
        let (_, read) = bench::bandwidth_on(bench::Pages::Huge, bench::COPY_BYTES, 3);
        println!("round {round}: read bandwidth {read:.1} GB/s");
        for (s, &(rows, cols)) in shapes.iter().enumerate() {
            let x = vec![0.5f32; cols];
            let mut out = vec![0.0f32; rows];
            let mut gbs = [0.0f64; PrefetchReach::ALL.len()];
            for (k, reach) in reaches.iter().enumerate() {
                reach.set();
                let mut best = f64::MAX;
                for _ in 0..CALLS {
                    let set = rotation.next(rows * cols);
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
                gbs[k] = (rows * cols * 2) as f64 / best / 1e9;
                shares[s][k].push(gbs[k] / read);
            }
            let mut line = format!("  {rows}x{cols}:");
            for (k, reach) in reaches.iter().enumerate() {
                over_near[s][k].push(gbs[0] / gbs[k]);
                let (name, g) = (reach.name(), gbs[k]);
                line += &format!(" {name} {g:.1} GB/s ({:.2} of read)", g / read);
            }
            println!("{line}");
        }
    }
    println!("medians over {rounds} rounds:");
    for (s, &(rows, cols)) in shapes.iter().enumerate() {
        let mut line = format!("  {rows}x{cols}:");
        for (k, reach) in reaches.iter().enumerate() {
            let time = median_spread(&mut over_near[s][k]).0;
            let share = median_spread(&mut shares[s][k]).0;
            line += &format!(
                " {} {time:.3} of near's time, {share:.2} of read;",
                reach.name()
            );
        }
        println!("{}", line.trim_end_matches(';'));
    }
}

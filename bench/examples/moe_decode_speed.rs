//! Speed of the routed experts at decode shapes (the `mini` preset's 64 experts of 384 × 1024,
//! top-8, one token), inside a step as `model run` runs it (`CpuCompute::run_step`: the
//! pool's other threads waiting awake), on 2 MiB pages. Each expert's tensors lie together as
//! in a checkpoint. Every round measures, side by side:
//! - the read bandwidth;
//! - cold calls, rotating through more expert weights than the last-level cache holds, so that
//!   every call streams from DRAM: µs per call and the rate the routed bytes were read at, under
//!   each prefetch reach ([`PrefetchReach`], in an order rotating with the round);
//! - the same cold routed bytes read by a plain sum, one task per expert as the calls split
//!   them (each expert's three matrices lie together, one run): what the access pattern and
//!   the split leave of the read bandwidth before any arithmetic;
//! - hot calls over a set of experts that stays in the last-level cache: the arithmetic alone;
//! - how much of the arithmetic hid under the memory traffic (`overlap`: 1 when a cold call
//!   takes only the longer of the hot time and the bytes' time at the read bandwidth, 0 when it
//!   takes their sum).
//!
//! ```sh
//! cargo run --release -p bench --example moe_decode_speed [-- HIDDEN INTER EXPERTS TOP_K ROUNDS]
//! ```
use std::time::Instant;

use kernels::cpu_tactic::CpuTactic;
use kernels::formats::nvfp4::Nvfp4View;
use kernels::matrix::MatrixView;
use kernels::moe_gemm::reference::{ExpertView, Routing};
use kernels::prefetch::PrefetchReach;
use model::exec::cpu::pool::CpuCompute;

fn main() {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .map_or(default, |s| s.parse().expect("a number"))
    };
    let (hidden, inter, experts, top_k) = (arg(1, 1024), arg(2, 384), arg(3, 64), arg(4, 8));
    let rounds = arg(5, 6);
    let matrix_bytes = |rows: usize, cols: usize| rows * cols / 2 + rows * cols / 16;
    let expert_bytes = 2 * matrix_bytes(inter, hidden) + matrix_bytes(hidden, inter);
    let layers = (768usize << 20) / (experts * expert_bytes) + 1;
    let total = layers * experts * expert_bytes;
    let mut map =
        model::checkpoint::tensor_file::huge_page_memory(total).expect("anonymous memory");
    for (i, b) in map.iter_mut().enumerate() {
        *b = (i.wrapping_mul(2654435761) >> 13) as u8;
    }
    // Each expert's tensors lie together, as in the checkpoint (safetensors sorts by name):
    // down, gate, up, each its packed bytes then its scales. Scale bytes must be finite E4M3:
    // keep them in the normal range.
    let scale_bytes = inter * hidden / 16;
    let packed_bytes = inter * hidden / 2;
    for e in 0..layers * experts {
        for k in 0..3 {
            let at = e * expert_bytes + k * (packed_bytes + scale_bytes) + packed_bytes;
            for (i, s) in map[at..at + scale_bytes].iter_mut().enumerate() {
                *s = 0x30 | (i % 16) as u8;
            }
        }
    }
    let bytes: &[u8] = &map;
    let mut layer_views = Vec::new();
    for l in 0..layers {
        let mut views = Vec::new();
        for e in 0..experts {
            let base = (l * experts + e) * expert_bytes;
            let m = |k: usize, rows: usize, cols: usize| {
                let at = base + k * (packed_bytes + scale_bytes);
                MatrixView::Nvfp4(Nvfp4View {
                    rows,
                    cols,
                    packed: &bytes[at..at + packed_bytes],
                    block_scales: &bytes[at + packed_bytes..at + packed_bytes + scale_bytes],
                    global_scale: 1e-3,
                })
            };
            views.push(ExpertView {
                gate: m(1, inter, hidden),
                up: m(2, inter, hidden),
                down: m(0, hidden, inter),
                gate_up_input_scale: Some(1.0 / 2688.0),
                down_input_scale: Some(1.0 / 2688.0),
            });
        }
        layer_views.push(views);
    }
    let x: Vec<f32> = (0..hidden)
        .map(|i| ((i * 7919) % 199) as f32 / 99.0 - 1.0)
        .collect();
    let tactic = CpuTactic::default();
    let backend = CpuCompute::tuned(tactic).expect("the default tactic");
    let routed_bytes = top_k * (3 * matrix_bytes(inter, hidden));
    // The hot set: the first layer's experts that fit in half of a 32 MB last-level cache
    // (at least top-k of them), called over and over so that they stay cached: the same
    // calls without DRAM, what the kernels' arithmetic alone costs.
    let hot_experts = ((16usize << 20) / expert_bytes).clamp(top_k, experts);
    let time_calls = |calls: usize,
                      layer_of: &(dyn Fn(usize) -> usize + Sync),
                      expert_of: &(dyn Fn(usize, usize) -> u32 + Sync)| {
        let mut time = 0.0;
        let mut out = vec![0.0f32; hidden];
        backend.run_step(&mut || {
            let start = Instant::now();
            for c in 0..calls {
                let routing = Routing {
                    top_k,
                    experts: (0..top_k).map(|k| expert_of(c, k)).collect(),
                    weights: vec![1.0 / top_k as f32; top_k],
                };
                backend.run(|| {
                    kernels::moe_gemm::cpu::moe_cpu_tuned(
                        &tactic,
                        kernels::isa::Isa::detect(),
                        &x,
                        hidden,
                        &routing,
                        &layer_views[layer_of(c)],
                        &mut out,
                        None,
                    )
                });
            }
            time = start.elapsed().as_secs_f64() / calls as f64;
        });
        time
    };
    // Call `c`'s k-th routed expert in the cold calls (of layer c % layers).
    let cold_expert = |c: usize, k: usize| ((c * 13 + k * 7) % experts) as u32;
    // The routed experts' bytes of call `c` summed, one rayon task per expert, as `ByExpert`
    // streams them: the ceiling the access pattern sets.
    let time_sums = |calls: usize| {
        use rayon::prelude::*;
        let mut time = 0.0;
        backend.run_step(&mut || {
            let start = Instant::now();
            for c in 0..calls {
                let sum: u64 = (0..top_k)
                    .into_par_iter()
                    .map(|k| {
                        let e = (c % layers) * experts + cold_expert(c, k) as usize;
                        bench::read_sum_bytes(&bytes[e * expert_bytes..(e + 1) * expert_bytes])
                    })
                    .sum();
                std::hint::black_box(sum);
            }
            time = start.elapsed().as_secs_f64() / calls as f64;
        });
        time
    };
    let mut sum_shares = Vec::new();
    let mut overlaps = Vec::new();
    let default_reach = PrefetchReach::current();
    // [reach]: the cold call's time over the default reach's, per round.
    let mut over_default = vec![Vec::new(); PrefetchReach::ALL.len()];
    for round in 0..rounds {
        let (_, read) = bench::bandwidth(2);
        // Cold calls under every prefetch reach, in an order that rotates with the round; the
        // default reach's time is the round's cold time.
        let mut cold_by_reach = [0.0f64; PrefetchReach::ALL.len()];
        for i in 0..PrefetchReach::ALL.len() {
            let k = (i + round) % PrefetchReach::ALL.len();
            PrefetchReach::ALL[k].set();
            cold_by_reach[k] = time_calls(layers * 20, &|c| c % layers, &cold_expert);
        }
        default_reach.set();
        let cold = cold_by_reach[default_reach.index()];
        for (ratios, t) in over_default.iter_mut().zip(cold_by_reach) {
            ratios.push(t / cold);
        }
        let summed = time_sums(layers * 20);
        let hot = time_calls(200, &|_| 0, &|c, k| ((c * 5 + k) % hot_experts) as u32);
        // The time the routed bytes take at the read bandwidth of this round.
        let memory = routed_bytes as f64 / (read * 1e9);
        // 1: the arithmetic hides entirely under the memory traffic (cold = the longer of
        // the two); 0: none of it does (cold = their sum).
        let overlap = 1.0 - (cold - hot.max(memory)) / hot.min(memory);
        overlaps.push(overlap);
        let gbs = routed_bytes as f64 / cold / 1e9;
        let sum_gbs = routed_bytes as f64 / summed / 1e9;
        sum_shares.push(sum_gbs / read);
        println!(
            "round {round}: read {read:.1} GB/s; cold {:.1} µs per call ({:.2} MB at {gbs:.1} GB/s, {:.2} of read); \
             plain sum {:.1} µs ({sum_gbs:.1} GB/s, {:.2} of read); hot {:.1} µs; memory alone {:.1} µs; \
             overlap {overlap:.2}",
            cold * 1e6,
            routed_bytes as f64 / 1e6,
            gbs / read,
            summed * 1e6,
            sum_gbs / read,
            hot * 1e6,
            memory * 1e6,
        );
        let mut line = String::from("  cold µs per call by prefetch reach:");
        for (reach, t) in PrefetchReach::ALL.iter().zip(cold_by_reach) {
            line += &format!(" {} {:.1}", reach.name(), t * 1e6);
        }
        println!("{line}");
    }
    let mut line = format!(
        "median over the rounds of each reach's cold time over the default's ({}):",
        default_reach.name()
    );
    for (reach, ratios) in PrefetchReach::ALL.iter().zip(&mut over_default) {
        line += &format!(
            " {} {:.3}",
            reach.name(),
            bench::cpu_tactics::median_spread(ratios).0
        );
    }
    println!("{line}");
    println!(
        "median share of read of the plain sum over the same routed bytes: {:.2}",
        bench::cpu_tactics::median_spread(&mut sum_shares).0
    );
    println!(
        "median overlap of arithmetic and memory: {:.2}",
        bench::cpu_tactics::median_spread(&mut overlaps).0
    );
}

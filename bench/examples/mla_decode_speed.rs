//! Speed of MLA decode attention (batch 1, the `mini` preset's 8 heads of 512 + 64 over a BF16
//! cache) at several contexts, on one thread and on the machine's threads: µs per call, ns per
//! key and the arithmetic rate (a key costs `2 · heads · (2·latent + rope)` flops: its score and
//! its share of the weighted sum). The cache stays in the last-level cache: this is the
//! arithmetic, not the memory.
//!
//! ```sh
//! cargo run --release -p bench --example mla_decode_speed [-- ROUNDS [THREADS,...]]
//! ```
use std::time::Instant;

use kernels::cpu_tactic::CpuTactic;
use kernels::mla::cache::{KvCacheDtype, LatentCacheShape, PAGE_TOKENS, PagedLatentCache};
use kernels::mla::cpu::mla_attention_tuned;
use kernels::mla::reference::{AttentionQuery, MlaProblem};

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(5, |s| s.parse().expect("a number"));
    let (heads, latent, rope) = (8, 512, 64);
    // Thread counts to run (default: one and the machine's cores).
    let threads: Vec<usize> = match std::env::args().nth(2) {
        Some(list) => list
            .split(',')
            .map(|n| n.parse().expect("a number"))
            .collect(),
        None => vec![1, kernels::cpu_tactic::machine_cores()],
    };
    println!("contexts x threads: us/call (best of {rounds} rounds), ns/key, GFLOP/s");
    for context in [128usize, 256, 512, 1024, 2048] {
        let shape = LatentCacheShape {
            layers: 1,
            latent_dim: latent,
            rope_dim: rope,
        };
        let mut cache =
            PagedLatentCache::new(shape, KvCacheDtype::Bf16, context.div_ceil(PAGE_TOKENS));
        let seq = cache.add_sequence();
        cache.reserve(seq, context).expect("pages reserved");
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut random = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                })
                .collect()
        };
        for t in 0..context {
            let (c, k) = (random(latent), random(rope));
            cache.write(0, seq, t, &c, &k).expect("slot reserved");
        }
        cache.commit(seq, context).expect("written");
        let queries = [AttentionQuery { seq, context }];
        let (q_abs, q_pe) = (random(heads * latent), random(heads * rope));
        let problem = MlaProblem {
            layer: 0,
            heads,
            queries: &queries,
            q_abs: &q_abs,
            q_pe: &q_pe,
            softmax_scale: 0.1446796,
        };
        let (mut out, mut lse) = (vec![0.0f32; heads * latent], vec![0.0f32; heads]);
        let flops_per_key = (2 * heads * (2 * latent + rope)) as f64;
        let mut line = format!("{context:>5} keys:");
        for &n in &threads {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .expect("a pool");
            let tactic = CpuTactic {
                threads: n,
                ..CpuTactic::DEFAULT
            };
            let calls = (200_000 / context).max(20);
            let best = pool.install(|| {
                (0..rounds)
                    .map(|_| {
                        let start = Instant::now();
                        for _ in 0..calls {
                            mla_attention_tuned(&tactic, &cache, &problem, &mut out, &mut lse)
                                .expect("valid problem");
                        }
                        start.elapsed().as_secs_f64() / calls as f64
                    })
                    .fold(f64::INFINITY, f64::min)
            });
            let best: f64 = best;
            let per_key = best / context as f64;
            line += &format!(
                "  {n}t {:7.1} us {:6.1} ns/key {:5.1} GFLOP/s",
                best * 1e6,
                per_key * 1e9,
                flops_per_key / per_key * 1e-9
            );
        }
        println!("{line}");
    }
    prefill(rounds, &threads, heads, latent, rope);
}

/// A prefill's causal attention: every position of a 512-token sequence attends its prefix in
/// one call (rows in blocks that share each cache tile).
fn prefill(rounds: usize, threads: &[usize], heads: usize, latent: usize, rope: usize) {
    let tokens = 512usize;
    let shape = LatentCacheShape {
        layers: 1,
        latent_dim: latent,
        rope_dim: rope,
    };
    let mut cache = PagedLatentCache::new(shape, KvCacheDtype::Bf16, tokens.div_ceil(PAGE_TOKENS));
    let seq = cache.add_sequence();
    cache.reserve(seq, tokens).expect("pages reserved");
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    };
    for t in 0..tokens {
        let (c, k) = (random(latent), random(rope));
        cache.write(0, seq, t, &c, &k).expect("slot reserved");
    }
    cache.commit(seq, tokens).expect("written");
    let queries: Vec<AttentionQuery> = (1..=tokens)
        .map(|context| AttentionQuery { seq, context })
        .collect();
    let (q_abs, q_pe) = (
        random(tokens * heads * latent),
        random(tokens * heads * rope),
    );
    let problem = MlaProblem {
        layer: 0,
        heads,
        queries: &queries,
        q_abs: &q_abs,
        q_pe: &q_pe,
        softmax_scale: 0.1446796,
    };
    let (mut out, mut lse) = (
        vec![0.0f32; tokens * heads * latent],
        vec![0.0f32; tokens * heads],
    );
    // Pairs of (query, key) a causal prefill attends: n(n+1)/2.
    let pairs = (tokens * (tokens + 1) / 2) as f64;
    let flops = pairs * (2 * heads * (2 * latent + rope)) as f64;
    let mut line = format!("prefill {tokens}:");
    for &n in threads {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .expect("a pool");
        let tactic = CpuTactic {
            threads: n,
            ..CpuTactic::DEFAULT
        };
        let best: f64 = pool.install(|| {
            (0..rounds)
                .map(|_| {
                    let start = Instant::now();
                    mla_attention_tuned(&tactic, &cache, &problem, &mut out, &mut lse)
                        .expect("valid problem");
                    start.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        });
        line += &format!(
            "  {n}t {:8.2} ms {:5.1} GFLOP/s",
            best * 1e3,
            flops / best * 1e-9
        );
    }
    println!("{line}");
}

//! Speed of MLA attention at the `mini` preset's shapes (8 heads of 512 + 64 over a BF16 cache),
//! on one thread and on the machine's threads:
//! - decode (batch 1) at several contexts: µs per call, ns per key and the arithmetic rate (a
//!   key costs `2 · heads · (2·latent + rope)` flops: its score and its share of the weighted
//!   sum);
//! - a 512-token prefill's causal attention (every position in one call): ms per call.
//!
//! The cache stays in the last-level cache: this is the arithmetic, not the memory.
//!
//! ```sh
//! cargo run --release -p bench --example mla_decode_speed [-- ROUNDS [THREADS,... [CONTEXTS,...]]]
//! ```
use std::time::Instant;

use kernels::cpu_tactic::CpuTactic;
use kernels::mla::cache::{KvCacheDtype, LatentCacheShape, PAGE_TOKENS, PagedLatentCache};
use kernels::mla::cpu::mla_attention_tuned;
use kernels::mla::reference::{AttentionQuery, MlaProblem};
use kernels::rng::Rng;

const HEADS: usize = 8;
const LATENT: usize = 512;
const ROPE: usize = 64;

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(5, |s| s.parse().expect("a number"));
    // Thread counts to run (default: one and the machine's cores) and decode contexts.
    let threads = list_arg(2, vec![1, kernels::cpu_tactic::machine_cores()]);
    let contexts = list_arg(3, vec![128, 256, 512, 1024, 2048]);
    let flops_per_key = (2 * HEADS * (2 * LATENT + ROPE)) as f64;
    println!("contexts x threads: us/call (best of {rounds} rounds), ns/key, GFLOP/s");
    for &context in &contexts {
        let workload = Workload::new(context, &[context]);
        let calls = (200_000 / context).max(200);
        let mut line = format!("{context:>5} keys:");
        for &n in &threads {
            let per_call = workload.best_call(n, rounds, calls);
            let per_key = per_call / context as f64;
            line += &format!(
                "  {n}t {:7.1} us {:6.1} ns/key {:5.1} GFLOP/s",
                per_call * 1e6,
                per_key * 1e9,
                flops_per_key / per_key * 1e-9
            );
        }
        println!("{line}");
    }
    let tokens = 512usize;
    let contexts: Vec<usize> = (1..=tokens).collect();
    let workload = Workload::new(tokens, &contexts);
    // The (query, key) pairs a causal prefill attends: n(n+1)/2.
    let flops = (tokens * (tokens + 1) / 2) as f64 * flops_per_key;
    let mut line = format!("prefill {tokens}:");
    for &n in &threads {
        let per_call = workload.best_call(n, rounds, 1);
        line += &format!(
            "  {n}t {:8.2} ms {:5.1} GFLOP/s",
            per_call * 1e3,
            flops / per_call * 1e-9
        );
    }
    println!("{line}");
}

/// Argument `index`, a comma-separated list of numbers, or `default` where it is absent.
fn list_arg(index: usize, default: Vec<usize>) -> Vec<usize> {
    std::env::args().nth(index).map_or(default, |list| {
        list.split(',')
            .map(|n| n.parse().expect("a number"))
            .collect()
    })
}

/// One sequence of random cache entries and one query row per context.
struct Workload {
    cache: PagedLatentCache,
    queries: Vec<AttentionQuery>,
    q_abs: Vec<f32>,
    q_pe: Vec<f32>,
}

impl Workload {
    fn new(tokens: usize, contexts: &[usize]) -> Self {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut random = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.sym()).collect() };
        let shape = LatentCacheShape {
            layers: 1,
            latent_dim: LATENT,
            rope_dim: ROPE,
        };
        let mut cache =
            PagedLatentCache::new(shape, KvCacheDtype::Bf16, tokens.div_ceil(PAGE_TOKENS));
        let seq = cache.add_sequence();
        cache.reserve(seq, tokens).expect("pages reserved");
        for t in 0..tokens {
            let (c, k) = (random(LATENT), random(ROPE));
            cache.write(0, seq, t, &c, &k).expect("slot reserved");
        }
        cache.commit(seq, tokens).expect("written");
        let queries: Vec<AttentionQuery> = contexts
            .iter()
            .map(|&context| AttentionQuery { seq, context })
            .collect();
        let rows = queries.len();
        let (q_abs, q_pe) = (random(rows * HEADS * LATENT), random(rows * HEADS * ROPE));
        Self {
            cache,
            queries,
            q_abs,
            q_pe,
        }
    }

    /// Seconds per call on `threads` threads: the best of `rounds` loops of `calls` calls.
    fn best_call(&self, threads: usize, rounds: usize, calls: usize) -> f64 {
        let problem = MlaProblem {
            layer: 0,
            heads: HEADS,
            queries: &self.queries,
            q_abs: &self.q_abs,
            q_pe: &self.q_pe,
            softmax_scale: 0.1446796,
        };
        let rows = self.queries.len();
        let (mut out, mut lse) = (
            vec![0.0f32; rows * HEADS * LATENT],
            vec![0.0f32; rows * HEADS],
        );
        let tactic = CpuTactic {
            threads,
            ..CpuTactic::DEFAULT
        };
        let pool = tactic.build_pool().expect("a pool");
        pool.install(|| {
            (0..rounds)
                .map(|_| {
                    let start = Instant::now();
                    for _ in 0..calls {
                        mla_attention_tuned(&tactic, &self.cache, &problem, &mut out, &mut lse)
                            .expect("valid problem");
                    }
                    start.elapsed().as_secs_f64() / calls as f64
                })
                .fold(f64::INFINITY, f64::min)
        })
    }
}

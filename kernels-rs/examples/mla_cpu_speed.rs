//! Speed of the fast CPU MLA path (`kernels::mla::cpu`) on Kimi-K2.5 shapes (512 latent + 64
//! RoPE values per token):
//! - against the reference, at long contexts (best of 3, ms);
//! - at decode (one query row, short contexts): the fixed cost per call and the cost per
//!   cached key, on one thread and on the whole pool (best of 200, µs).
//!
//! `cargo run --release -p kernels --example mla_cpu_speed [-- --decode]`

use std::time::Instant;

use kernels::mla::cache::{KvCacheDtype, LatentCacheShape, PagedLatentCache};
use kernels::mla::cpu::mla_attention;
use kernels::mla::reference::{AttentionQuery, MlaProblem, mla_attention_reference};

fn value(i: usize) -> f32 {
    ((i.wrapping_mul(2_654_435_761) >> 7) % 2001) as f32 / 1000.0 - 1.0
}

/// A cache of `batch` sequences of `context` tokens and their queries for `heads` heads.
struct Case {
    cache: PagedLatentCache,
    queries: Vec<AttentionQuery>,
    q_abs: Vec<f32>,
    q_pe: Vec<f32>,
    heads: usize,
}

impl Case {
    fn new(dtype: KvCacheDtype, batch: usize, context: usize, heads: usize) -> Self {
        let shape = LatentCacheShape {
            layers: 1,
            latent_dim: 512,
            rope_dim: 64,
        };
        let mut cache = PagedLatentCache::with_capacity_tokens(shape, dtype, batch * context);
        let mut queries = Vec::new();
        let (mut latent, mut rope) = (vec![0f32; 512], vec![0f32; 64]);
        for b in 0..batch {
            let seq = cache.add_sequence();
            cache.reserve(seq, context).unwrap();
            for t in 0..context {
                for (j, v) in latent.iter_mut().enumerate() {
                    *v = value((b * context + t) * 576 + j);
                }
                for (j, v) in rope.iter_mut().enumerate() {
                    *v = value((b * context + t) * 576 + 512 + j);
                }
                cache.write(0, seq, t, &latent, &rope).unwrap();
            }
            cache.commit(seq, context).unwrap();
            queries.push(AttentionQuery { seq, context });
        }
        Self {
            cache,
            queries,
            q_abs: (0..batch * heads * 512)
                .map(|i| 0.3 * value(i + 1))
                .collect(),
            q_pe: (0..batch * heads * 64)
                .map(|i| 0.3 * value(i + 7))
                .collect(),
            heads,
        }
    }

    fn problem(&self) -> MlaProblem<'_> {
        MlaProblem {
            layer: 0,
            heads: self.heads,
            queries: &self.queries,
            q_abs: &self.q_abs,
            q_pe: &self.q_pe,
            softmax_scale: 0.1447,
        }
    }

    /// The best of `runs` calls of `f` on fresh outputs, in seconds.
    fn best(&self, runs: usize, f: impl Fn(&MlaProblem<'_>, &mut [f32], &mut [f32])) -> f64 {
        let rows = self.queries.len();
        let (mut out, mut lse) = (
            vec![0f32; rows * self.heads * 512],
            vec![0f32; rows * self.heads],
        );
        let problem = self.problem();
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                f(&problem, &mut out, &mut lse);
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min)
    }
}

fn main() {
    println!(
        "threads {}; times are the best of 3",
        rayon::current_num_threads()
    );
    println!(
        "{:<6} {:>5} {:>6} {:>6} {:>11} {:>11} {:>8}",
        "dtype", "batch", "ctx", "heads", "ref ms", "fast ms", "speedup"
    );
    // `--decode`: only the decode table (for profiling its fixed cost).
    let long_contexts = !std::env::args().any(|a| a == "--decode");
    for dtype in [KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
        if !long_contexts {
            break;
        }
        for (batch, context, heads) in [(1, 8192, 8), (1, 65536, 8), (16, 2048, 8), (4, 4096, 64)] {
            let case = Case::new(dtype, batch, context, heads);
            let reference = 1e3
                * case.best(3, |p, o, l| {
                    mla_attention_reference(&case.cache, p, o, l).unwrap()
                });
            let fast = 1e3 * case.best(3, |p, o, l| mla_attention(&case.cache, p, o, l).unwrap());
            println!(
                "{:<6} {batch:>5} {context:>6} {heads:>6} {reference:>11.1} {fast:>11.1} {:>7.1}x",
                dtype.id(),
                reference / fast
            );
        }
    }

    println!("\ndecode, one query row, bf16: µs per call, best of 200 (1 thread | every thread)");
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a pool");
    for (context, heads) in [(16, 8), (150, 8), (512, 8), (2048, 8), (2048, 16)] {
        let case = Case::new(KvCacheDtype::Bf16, 1, context, heads);
        let fast = |p: &MlaProblem<'_>, o: &mut [f32], l: &mut [f32]| {
            mla_attention(&case.cache, p, o, l).unwrap()
        };
        let one = 1e6 * case.best(200, |p, o, l| one_thread.install(|| fast(p, o, l)));
        let all = 1e6 * case.best(200, |p, o, l| rayon::scope(|_| fast(p, o, l)));
        println!("{heads:>5} heads {context:>6} keys: {one:8.1} | {all:8.1}");
    }
}

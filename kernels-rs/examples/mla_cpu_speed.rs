//! Speed of the fast CPU MLA path (`kernels::mla::cpu`) against the reference, on Kimi-K2.5
//! shapes (512 latent + 64 RoPE values per token).
//!
//! `cargo run --release -p kernels --example mla_cpu_speed`

use std::time::Instant;

use kernels::mla::cache::{KvCacheDtype, LatentCacheShape, PagedLatentCache};
use kernels::mla::cpu::mla_attention;
use kernels::mla::reference::{AttentionQuery, MlaProblem, mla_attention_reference};

fn value(i: usize) -> f32 {
    ((i.wrapping_mul(2_654_435_761) >> 7) % 2001) as f32 / 1000.0 - 1.0
}

fn main() {
    let shape = LatentCacheShape {
        layers: 1,
        latent_dim: 512,
        rope_dim: 64,
    };
    println!(
        "threads {}; times are the best of 3",
        rayon::current_num_threads()
    );
    println!(
        "{:<6} {:>5} {:>6} {:>6} {:>11} {:>11} {:>8}",
        "dtype", "batch", "ctx", "heads", "ref ms", "fast ms", "speedup"
    );
    for dtype in [KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
        for (batch, context, heads) in [(1, 8192, 8), (1, 65536, 8), (16, 2048, 8), (4, 4096, 64)] {
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
            let q_abs: Vec<f32> = (0..batch * heads * 512)
                .map(|i| 0.3 * value(i + 1))
                .collect();
            let q_pe: Vec<f32> = (0..batch * heads * 64)
                .map(|i| 0.3 * value(i + 7))
                .collect();
            let problem = MlaProblem {
                layer: 0,
                heads,
                queries: &queries,
                q_abs: &q_abs,
                q_pe: &q_pe,
                softmax_scale: 0.1447,
            };
            let mut out = vec![0f32; batch * heads * 512];
            let mut lse = vec![0f32; batch * heads];
            let mut best = |f: &dyn Fn(&mut [f32], &mut [f32])| {
                (0..3)
                    .map(|_| {
                        let t = Instant::now();
                        f(&mut out, &mut lse);
                        t.elapsed().as_secs_f64() * 1e3
                    })
                    .fold(f64::INFINITY, f64::min)
            };
            let reference = best(&|o, l| mla_attention_reference(&cache, &problem, o, l).unwrap());
            let fast = best(&|o, l| mla_attention(&cache, &problem, o, l).unwrap());
            println!(
                "{:<6} {batch:>5} {context:>6} {heads:>6} {reference:>11.1} {fast:>11.1} {:>7.1}x",
                dtype.id(),
                reference / fast
            );
        }
    }
}

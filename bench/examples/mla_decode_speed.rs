//! Speed of the CPU MLA attention at decode (one query row) over a BF16 latent cache, at the
//! `mini` preset's widths (8 heads, latent 512, rope 64) and Kimi-K2.5's per-rank heads, on
//! one thread and on the whole pool: the fixed cost per call and the cost per cached key.
//!
//! ```sh
//! cargo run --release -p bench --example mla_decode_speed
//! ```

use std::time::Instant;

use kernels::cpu_tactic::CpuTactic;
use kernels::mla::cache::{KvCacheDtype, LatentCacheShape, PAGE_TOKENS, PagedLatentCache};
use kernels::mla::cpu::mla_attention_tuned;
use kernels::mla::reference::{AttentionQuery, MlaProblem};
use kernels::moe_gemm::check::Rng;

fn main() {
    let mut rng = Rng(7);
    let pool1 = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a pool");
    println!("heads latent+rope context: µs per call, best of 200 (1 thread | every thread)");
    for (heads, context) in std::env::args().nth(1).map_or(
        vec![(8usize, 16usize), (8, 150), (8, 512), (8, 2048), (16, 2048)],
        |c| vec![(8, c.parse().expect("a context length"))],
    ) {
        let shape = LatentCacheShape {
            layers: 1,
            latent_dim: 512,
            rope_dim: 64,
        };
        let mut cache =
            PagedLatentCache::new(shape, KvCacheDtype::Bf16, context.div_ceil(PAGE_TOKENS));
        let seq = cache.add_sequence();
        cache.reserve(seq, context).expect("pages reserved");
        for t in 0..context {
            let c: Vec<f32> = (0..512).map(|_| rng.sym()).collect();
            let k: Vec<f32> = (0..64).map(|_| rng.sym()).collect();
            cache.write(0, seq, t, &c, &k).expect("slot reserved");
        }
        cache.commit(seq, context).expect("written");
        let queries = [AttentionQuery { seq, context }];
        let q_abs: Vec<f32> = (0..heads * 512).map(|_| rng.sym()).collect();
        let q_pe: Vec<f32> = (0..heads * 64).map(|_| rng.sym()).collect();
        let problem = MlaProblem {
            layer: 0,
            heads,
            queries: &queries,
            q_abs: &q_abs,
            q_pe: &q_pe,
            softmax_scale: 0.1446796,
        };
        let (mut out, mut lse) = (vec![0.0f32; heads * 512], vec![0.0f32; heads]);
        let time = |run: &mut dyn FnMut()| {
            (0..200)
                .map(|_| {
                    let start = Instant::now();
                    run();
                    start.elapsed().as_secs_f64() * 1e6
                })
                .fold(f64::MAX, f64::min)
        };
        let tactic = CpuTactic::DEFAULT;
        let one = time(&mut || {
            pool1.install(|| {
                mla_attention_tuned(&tactic, &cache, &problem, &mut out, &mut lse).expect("valid")
            })
        });
        let all = time(&mut || {
            rayon::scope(|_| {
                mla_attention_tuned(&tactic, &cache, &problem, &mut out, &mut lse).expect("valid")
            })
        });
        println!("{heads:>5} 512+64 {context:>7}: {one:8.1} | {all:8.1}");
    }
}

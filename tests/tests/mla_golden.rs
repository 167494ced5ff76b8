//! MLA decode attention (CPU reference and fast CPU path) against the PyTorch goldens of
//! `golden/gen_mla.py`, and the absorbed formulation against HF transformers'
//! `DeepseekV3Attention` (expanded K/V).
//!
//! Cache contents are not stored in the goldens: both sides compute them from the same integer
//! hash (see the generator's docstring), so 64K-token contexts cost only their queries.
//!
//! Bounds (per (request, head) row, ‖ours − golden‖∞ / ‖golden‖∞):
//! - ours vs PyTorch float64 over the same stored cache (BF16 or FP8, emulated with torch's
//!   casts): ≤ 1e-4 up to 4K tokens and ≤ 1e-3 (the requirement) at 64K, for every dtype; LSE
//!   within 1e-5 (1e-4 at 64K) of 1 + |lse|. FP32 accumulation order is the only difference, so
//!   this also shows the FP8 encoder agrees with torch's.
//! - the storage format itself (same code, vs the unquantized values), a regression bound on
//!   these random data: BF16 ≤ 2e-2, FP8 E4M3 with per-token scales ≤ 0.25. FP8's error is
//!   dominated by score perturbations on diffuse attention (E4M3 keeps 4 significant bits);
//!   it is why the BF16 cache stays the default where memory allows.

use kernels::mla::PAGE_TOKENS;
use kernels::mla::cache::{CacheError, KvCacheDtype, LatentCacheShape, PagedLatentCache, SeqId};
use kernels::mla::cpu::mla_attention;
use kernels::mla::golden_hash::token_values;
use kernels::mla::reference::{AttentionQuery, MlaProblem, mla_attention_reference};
use model::checkpoint::tensor_file::TensorFile;
use project_tests::golden_path;

type Attention =
    fn(&PagedLatentCache, &MlaProblem<'_>, &mut [f32], &mut [f32]) -> Result<(), CacheError>;
const IMPLEMENTATIONS: [(&str, Attention); 2] = [
    ("reference", mla_attention_reference),
    ("fast", mla_attention),
];

/// Per-row relative error: max over rows of ‖a − b‖∞ / ‖b‖∞.
fn rel_err(a: &[f32], b: &[f32], row: usize) -> f32 {
    a.chunks(row)
        .zip(b.chunks(row))
        .map(|(x, y)| {
            let num = x
                .iter()
                .zip(y)
                .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
            let den = y.iter().fold(0.0f32, |m, q| m.max(q.abs())).max(1e-30);
            num / den
        })
        .fold(0.0, f32::max)
}

fn lse_err(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f32::max)
}

struct Case {
    name: &'static str,
    dtype: KvCacheDtype,
    static_scale: bool,
    storage_bound: f32,
}

/// Builds the case's cache with the requests' pages interleaved (so block tables are not
/// contiguous), runs both CPU implementations and checks them against the golden. The cache
/// widths are the golden's (its `q_abs` and `q_pe` shapes).
#[allow(non_snake_case)]
fn check_case(case: &Case) {
    let file = TensorFile::open(golden_path(&format!("mla/{}.safetensors", case.name))).unwrap();
    let width = |name: &str| *file.info(name).unwrap().shape.last().unwrap();
    let (L, R) = (width("q_abs"), width("q_pe"));
    let lens: Vec<usize> = file
        .i64_values("lens")
        .unwrap()
        .iter()
        .map(|&n| n as usize)
        .collect();
    let seeds = file.i64_values("seeds").unwrap();
    let scale = file.f32_values("softmax_scale").unwrap()[0];
    let q_abs = file.f32_values("q_abs").unwrap();
    let q_pe = file.f32_values("q_pe").unwrap();
    let heads = q_abs.len() / (lens.len() * L);
    let provenance = &file.metadata()["provenance"];
    assert!(provenance.contains(case.name), "{provenance}");

    let shape = LatentCacheShape {
        layers: 2,
        latent_dim: L,
        rope_dim: R,
    };
    let pages: usize = lens.iter().map(|n| n.div_ceil(PAGE_TOKENS)).sum();
    let mut cache = PagedLatentCache::new(shape, case.dtype, pages + 1);
    if case.static_scale {
        let meta: &str = provenance;
        let bits: u32 = meta
            .split("\"static_scale_bits\": ")
            .nth(1)
            .and_then(|s| s.split([',', '}']).next())
            .and_then(|s| s.trim().parse().ok())
            .expect("static_scale_bits in provenance");
        cache.set_fp8_static_scale(Some(f32::from_bits(bits)));
    }
    let seqs: Vec<SeqId> = lens.iter().map(|_| cache.add_sequence()).collect();
    // Round-robin page allocation: request i's pages are interleaved with the others'.
    let mut reserved = vec![0usize; lens.len()];
    while reserved.iter().zip(&lens).any(|(r, n)| r < n) {
        for (i, &n) in lens.iter().enumerate() {
            if reserved[i] < n {
                let more = PAGE_TOKENS.min(n - reserved[i]);
                cache
                    .reserve(
                        seqs[i],
                        reserved[i] + more - cache.seq_len(seqs[i]).unwrap(),
                    )
                    .unwrap();
                reserved[i] += more;
            }
        }
    }
    let (mut latent, mut rope) = (vec![0.0f32; L], vec![0.0f32; R]);
    for (i, &n) in lens.iter().enumerate() {
        for t in 0..n {
            token_values(seeds[i] as u64, t, &mut latent, &mut rope);
            // Layer 1: layer 0 stays zero, so a layer mix-up cannot pass.
            cache.write(1, seqs[i], t, &latent, &rope).unwrap();
        }
        cache.commit(seqs[i], n).unwrap();
    }
    // With several requests, a multi-page one must have non-consecutive pages.
    let longest = (0..lens.len()).max_by_key(|&i| lens[i]).unwrap();
    let table = cache.block_table(seqs[longest]).unwrap();
    if lens.len() > 1 && table.len() > 1 {
        assert!(
            table.windows(2).any(|w| w[1] != w[0] + 1),
            "pages should interleave"
        );
    }

    let queries: Vec<AttentionQuery> = seqs
        .iter()
        .zip(&lens)
        .map(|(&seq, &context)| AttentionQuery { seq, context })
        .collect();
    let problem = MlaProblem {
        layer: 1,
        heads,
        queries: &queries,
        q_abs: &q_abs,
        q_pe: &q_pe,
        softmax_scale: scale,
    };
    let golden = file.f32_values("out").unwrap();
    let golden_lse = file.f32_values("lse").unwrap();
    let exact = file.f32_values("out_exact").unwrap();
    let rows = lens.len() * heads;
    // FP32 accumulation error grows with the context: 64K-token sums get the required 1e-3.
    let long = lens.iter().any(|&n| n > 8192);
    let (bound, lse_bound) = if long { (1e-3, 1e-4) } else { (1e-4, 1e-5) };
    for (which, run) in IMPLEMENTATIONS {
        let (mut out, mut lse) = (vec![f32::NAN; rows * L], vec![f32::NAN; rows]);
        run(&cache, &problem, &mut out, &mut lse).unwrap();
        let err = rel_err(&out, &golden, L);
        let l_err = lse_err(&lse, &golden_lse);
        let storage = rel_err(&out, &exact, L);
        println!(
            "{:<18} {which:<9} rel err {err:.2e}  lse err {l_err:.2e}  storage err {storage:.2e}",
            case.name
        );
        assert!(err <= bound, "{} {which}: rel err {err:e}", case.name);
        assert!(
            l_err <= lse_bound,
            "{} {which}: lse err {l_err:e}",
            case.name
        );
        assert!(
            storage <= case.storage_bound,
            "{} {which}: storage err {storage:e}",
            case.name
        );
    }
    // The golden really encodes the storage format: the unquantized answer is far from it.
    assert!(
        rel_err(&exact, &golden, L) > 1e-3,
        "{}: storage left no trace",
        case.name
    );
}

const fn bf16(name: &'static str) -> Case {
    Case {
        name,
        dtype: KvCacheDtype::Bf16,
        static_scale: false,
        storage_bound: 2e-2,
    }
}

const fn fp8(name: &'static str) -> Case {
    Case {
        name,
        dtype: KvCacheDtype::Fp8E4m3,
        static_scale: false,
        storage_bound: 0.25,
    }
}

#[test]
fn bf16_single_token_and_page_boundaries() {
    check_case(&bf16("bf16_single"));
    check_case(&bf16("bf16_pages"));
}

#[test]
fn bf16_ragged_batch() {
    check_case(&bf16("bf16_ragged"));
}

#[test]
fn bf16_64k_context() {
    check_case(&bf16("bf16_long"));
}

#[test]
fn fp8_page_boundaries_and_ragged_batch() {
    check_case(&fp8("fp8_pages"));
    check_case(&fp8("fp8_ragged"));
}

#[test]
fn fp8_with_a_per_tensor_k_scale() {
    check_case(&Case {
        static_scale: true,
        ..fp8("fp8_static_scale")
    });
}

#[test]
fn fp8_64k_context() {
    check_case(&fp8("fp8_long"));
}

/// The small golden checkpoints' widths (latent 64, RoPE 16) with 2–8 heads.
#[test]
fn small_widths_every_storage() {
    for name in ["l64r16_bf16_pages", "l64r16_bf16_ragged"] {
        check_case(&bf16(name));
    }
    for name in ["l64r16_fp8_pages", "l64r16_fp8_ragged"] {
        check_case(&fp8(name));
    }
    check_case(&Case {
        static_scale: true,
        ..fp8("l64r16_fp8_static_scale")
    });
}

/// The absorbed attention over the latent cache reproduces HF's expanded-K/V attention:
/// the generator checked absorbed == HF (float64, ≤ 1e-6 with HF's float32 softmax) and stored
/// the absorbed inputs and latent outputs; here both CPU paths must reproduce those.
#[test]
fn absorbed_attention_matches_hf_deepseek_v3() {
    let file = TensorFile::open(golden_path("mla/hf_absorbed.safetensors")).unwrap();
    let latent = file.f32_values("latent").unwrap();
    let rope = file.f32_values("rope").unwrap();
    let q_abs = file.f32_values("q_abs").unwrap();
    let q_pe = file.f32_values("q_pe").unwrap();
    let scale = file.f32_values("softmax_scale").unwrap()[0];
    let golden = file.f32_values("out").unwrap();
    let golden_lse = file.f32_values("lse").unwrap();
    let (l, r) = (64, 16);
    let tokens = latent.len() / l;
    let heads = q_abs.len() / (tokens * l);
    assert!(file.metadata()["provenance"].contains("hf_rel_diff"));
    let shape = LatentCacheShape {
        layers: 1,
        latent_dim: l,
        rope_dim: r,
    };
    let mut cache = PagedLatentCache::new(shape, KvCacheDtype::F32, 1);
    let seq = cache.add_sequence();
    cache.reserve(seq, tokens).unwrap();
    for t in 0..tokens {
        cache
            .write(
                0,
                seq,
                t,
                &latent[t * l..(t + 1) * l],
                &rope[t * r..(t + 1) * r],
            )
            .unwrap();
    }
    cache.commit(seq, tokens).unwrap();
    // Causal prefill as decode rows: query t attends to tokens 0..=t.
    let queries: Vec<AttentionQuery> = (0..tokens)
        .map(|t| AttentionQuery {
            seq,
            context: t + 1,
        })
        .collect();
    let problem = MlaProblem {
        layer: 0,
        heads,
        queries: &queries,
        q_abs: &q_abs,
        q_pe: &q_pe,
        softmax_scale: scale,
    };
    for (_, run) in IMPLEMENTATIONS {
        let (mut out, mut lse) = (vec![0.0; golden.len()], vec![0.0; golden_lse.len()]);
        run(&cache, &problem, &mut out, &mut lse).unwrap();
        let err = rel_err(&out, &golden, l);
        assert!(err <= 1e-5, "rel err {err:e}");
        assert!(lse_err(&lse, &golden_lse) <= 1e-5);
    }
}

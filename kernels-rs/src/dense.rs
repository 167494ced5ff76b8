//! Dense products `y = x · Wᵀ` with BF16 or NVFP4 weights: the CPU path of every linear
//! layer that is not a routed expert (attention projections, shared experts, the dense MLP,
//! the router, `lm_head`).

use rayon::prelude::*;

use half::bf16;

use crate::cpu_tactic::CpuTactic;
use crate::matrix::MatrixView;

/// `out[t, j] = Σ_i x[t, i] · w[j, i]` for `x: [tokens, cols]`, `w: [rows, cols]`,
/// `out: [tokens, rows]`. Each weight row is read once for all tokens, since at decode the
/// weights are the traffic.
pub fn matmul_transposed(x: &[f32], tokens: usize, w: MatrixView<'_>, out: &mut [f32]) {
    matmul_transposed_tuned(&CpuTactic::DEFAULT, x, tokens, w, out);
}

/// [`matmul_transposed`] under a tactic: BF16 products below
/// [`dense_parallel_min_bytes`](CpuTactic::dense_parallel_min_bytes) of weights run on the
/// calling thread (waking the pool costs tens of microseconds, more than reading a few hundred
/// KB takes), larger ones in tasks of [`dense_rows_per_task`](CpuTactic::dense_rows_per_task)
/// weight rows (enough work to amortize scheduling, few enough tasks to balance across cores
/// for the narrowest layers). Every valid tactic gives bit-identical results.
///
/// # Panics
/// If shapes disagree or the tactic is invalid.
pub fn matmul_transposed_tuned(
    tactic: &CpuTactic,
    x: &[f32],
    tokens: usize,
    w: MatrixView<'_>,
    out: &mut [f32],
) {
    if let Err(e) = tactic.validate() {
        panic!("{e}");
    }
    let (parallel_min_bytes, rows_per_task) =
        (tactic.dense_parallel_min_bytes, tactic.dense_rows_per_task);
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(
        x.len(),
        tokens * cols,
        "matmul: x is not [{tokens}, {cols}]"
    );
    assert_eq!(
        out.len(),
        tokens * rows,
        "matmul: out is not [{tokens}, {rows}]"
    );
    if tokens == 0 || rows == 0 {
        return;
    }
    // Row-major in weight rows (`[rows, tokens]`) so that threads own disjoint chunks.
    let mut transposed = vec![0.0f32; rows * tokens];
    match w {
        // BF16 rows are dotted straight from the mapping: widening a BF16 is a shift, cheaper
        // than a round trip through a buffer, and the row stays in L1 across tokens.
        MatrixView::Bf16 { data, .. } => {
            let dot_bf16 = dot_bf16_kernel();
            let task = |(task, chunk): (usize, &mut [f32])| {
                for (i, out_row) in chunk.chunks_exact_mut(tokens).enumerate() {
                    let row = task * rows_per_task + i;
                    let weights = &data[row * cols..(row + 1) * cols];
                    for (t, o) in out_row.iter_mut().enumerate() {
                        *o = dot_bf16(&x[t * cols..(t + 1) * cols], weights);
                    }
                }
            };
            if w.bytes() < parallel_min_bytes {
                transposed
                    .chunks_mut(rows_per_task * tokens)
                    .enumerate()
                    .for_each(task);
            } else {
                transposed
                    .par_chunks_mut(rows_per_task * tokens)
                    .enumerate()
                    .for_each(task);
            }
        }
        MatrixView::Nvfp4(_) => {
            transposed
                .par_chunks_mut(rows_per_task * tokens)
                .enumerate()
                .for_each(|(task, chunk)| {
                    let mut row_values = vec![0.0f32; cols];
                    for (i, out_row) in chunk.chunks_exact_mut(tokens).enumerate() {
                        w.row_into(task * rows_per_task + i, &mut row_values);
                        for (t, o) in out_row.iter_mut().enumerate() {
                            *o = dot(&x[t * cols..(t + 1) * cols], &row_values);
                        }
                    }
                });
        }
    }
    for (j, column) in transposed.chunks_exact(tokens).enumerate() {
        for (t, &v) in column.iter().enumerate() {
            out[t * rows + j] = v;
        }
    }
}

/// `x · w` for a BF16 `w`, with the widest SIMD the CPU has (chosen once).
pub type DotBf16 = fn(&[f32], &[bf16]) -> f32;

pub fn dot_bf16_kernel() -> DotBf16 {
    static KERNEL: std::sync::OnceLock<DotBf16> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return |x, w| {
                    // SAFETY: the CPU supports AVX-512F, checked just above.
                    unsafe { dot_bf16_avx512(x, w) }
                };
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return |x, w| {
                    // SAFETY: the CPU supports AVX2 and FMA, checked just above.
                    unsafe { dot_bf16_avx2(x, w) }
                };
            }
        }
        dot_bf16_portable
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn dot_bf16_avx512(x: &[f32], w: &[bf16]) -> f32 {
    use std::arch::x86_64::*;
    assert_eq!(x.len(), w.len());
    // Four 16-lane accumulators: enough independent FMAs in flight to cover their latency.
    const STEP: usize = 64;
    let full = x.len() / STEP * STEP;
    let widen = |p: *const half::bf16| {
        // SAFETY: the caller keeps `p..p+16` inside `w`; BF16 widens to F32 by a 16-bit shift.
        unsafe {
            let halves = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
        }
    };
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i < full {
        for (k, a) in acc.iter_mut().enumerate() {
            let offset = i + 16 * k;
            // SAFETY: offset + 16 <= full <= len of both slices.
            unsafe {
                let xs = _mm512_loadu_ps(x.as_ptr().add(offset));
                *a = _mm512_fmadd_ps(xs, widen(w.as_ptr().add(offset)), *a);
            }
        }
        i += STEP;
    }
    let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    let mut total = _mm512_reduce_add_ps(sum);
    for (a, b) in x[full..].iter().zip(&w[full..]) {
        total += a * b.to_f32();
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_bf16_avx2(x: &[f32], w: &[bf16]) -> f32 {
    dot_bf16_lanes::<8>(x, w)
}

fn dot_bf16_portable(x: &[f32], w: &[bf16]) -> f32 {
    dot_bf16_lanes::<8>(x, w)
}

/// `LANES` independent accumulators over 2·LANES elements per step (two vectors in flight),
/// in a shape the compiler turns into SIMD inside the `target_feature` wrappers above.
#[inline(always)]
fn dot_bf16_lanes<const LANES: usize>(x: &[f32], w: &[bf16]) -> f32 {
    let step = 2 * LANES;
    let full = x.len() / step * step;
    let mut acc = [[0.0f32; LANES]; 2];
    for (xs, ws) in x[..full]
        .chunks_exact(step)
        .zip(w[..full].chunks_exact(step))
    {
        for half in 0..2 {
            for k in 0..LANES {
                let widened = f32::from_bits((ws[half * LANES + k].to_bits() as u32) << 16);
                acc[half][k] += xs[half * LANES + k] * widened;
            }
        }
    }
    let mut sum: f32 = acc[0].iter().zip(&acc[1]).map(|(a, b)| a + b).sum();
    for (a, b) in x[full..].iter().zip(&w[full..]) {
        sum += a * b.to_f32();
    }
    sum
}

/// Dot product with 8 independent accumulators, so the compiler can vectorize it without
/// reassociating floating-point sums itself.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for (ca, cb) in a[..chunks * 8]
        .chunks_exact(8)
        .zip(b[..chunks * 8].chunks_exact(8))
    {
        for k in 0..8 {
            acc[k] += ca[k] * cb[k];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in a[chunks * 8..].iter().zip(&b[chunks * 8..]) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::nvfp4::Nvfp4Matrix;

    #[test]
    fn bf16_and_nvfp4_products_match_a_naive_loop() {
        let (tokens, rows, cols) = (3, 37, 80);
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 40.0)
            .collect();
        let w_bf16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let q = Nvfp4Matrix::quantize_weight(&w, rows, cols).unwrap();
        let deq = q.dequantize();
        for (view, values) in [
            (
                MatrixView::Bf16 {
                    rows,
                    cols,
                    data: &w_bf16,
                },
                w_bf16.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
            ),
            (MatrixView::Nvfp4(q.view()), deq),
        ] {
            let mut out = vec![0.0; tokens * rows];
            matmul_transposed(&x, tokens, view, &mut out);
            for t in 0..tokens {
                for j in 0..rows {
                    let expected: f32 = (0..cols)
                        .map(|i| x[t * cols + i] * values[j * cols + i])
                        .sum();
                    assert!((out[t * rows + j] - expected).abs() < 1e-4, "t{t} j{j}");
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]
        /// The split is only who computes which row: any valid tactic is bit-identical to the
        /// default, serial or parallel, for BF16 and NVFP4 weights.
        #[test]
        fn every_tactic_is_bit_identical_to_the_default(
            min_kib in 0usize..64,
            rows_per_task in 1usize..100,
            threads in 1usize..4,
            tokens in 1usize..6,
            rows in 1usize..300,
            blocks in 1usize..12,
        ) {
            let tactic = CpuTactic {
                dense_parallel_min_bytes: min_kib << 10,
                dense_rows_per_task: rows_per_task,
                threads,
                ..CpuTactic::DEFAULT
            };
            let cols = 16 * blocks;
            let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
            let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 53 % 97) as f32 - 48.0) / 40.0).collect();
            let w_bf16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let q = Nvfp4Matrix::quantize_weight(&w, rows, cols).unwrap();
            let pool = tactic.build_pool().unwrap();
            for view in [MatrixView::Bf16 { rows, cols, data: &w_bf16 }, MatrixView::Nvfp4(q.view())] {
                let mut want = vec![0.0; tokens * rows];
                matmul_transposed(&x, tokens, view, &mut want);
                let mut got = vec![f32::NAN; tokens * rows];
                pool.install(|| matmul_transposed_tuned(&tactic, &x, tokens, view, &mut got));
                proptest::prop_assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{tactic}"
                );
            }
        }
    }
}

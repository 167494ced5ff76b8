//! The inner kernel of the fast CPU grouped GEMM: one NVFP4 weight row against the activation
//! rows of up to [`MAX_GROUP`] tokens, `out[t] = Σ_c x[t, c] · w[c]`.
//!
//! At decode the weights are the memory traffic, so every packed byte is read exactly once and
//! never written back dequantized: the E2M1 nibbles are widened to 32-bit lanes and decoded by
//! a register-resident 16-entry table (`vpermps`), scaled by the block factor
//! `f32(e4m3) · global` (the same single rounding as [`Nvfp4View::dequantize_row_into`], so the
//! weight values are bit-identical to the reference's), and FMA'd into per-token accumulators.
//! The products and sums differ from the reference only in accumulation order and FMA fusion.
//!
//! Three implementations are selected at run time: AVX-512 (one 16-element block per `zmm`),
//! AVX2+FMA (a block is two `ymm`; the 8-entry `vpermps` covers the magnitudes and a blend on
//! the sign bit picks the negative table) and a portable scalar loop.
//!
//! [`Nvfp4View::dequantize_row_into`]: crate::formats::nvfp4::Nvfp4View::dequantize_row_into

use crate::formats::e2m1::E2M1_VALUES;
use crate::formats::e4m3::e4m3_to_f32;
use crate::formats::nvfp4::NVFP4_BLOCK;

/// Most tokens one kernel call accumulates at once: 8 tokens × 2 accumulators fill half of the
/// 32 `zmm` registers, leaving room for the decoded weights and the table.
pub const MAX_GROUP: usize = 8;

/// The instruction set a kernel is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// AVX-512F (+BW for the byte shuffles).
    Avx512,
    /// AVX2 with FMA.
    Avx2Fma,
    /// Portable Rust; the compiler may still auto-vectorize it for the baseline target.
    Scalar,
}

impl Isa {
    /// The best instruction set this CPU supports.
    pub fn detect() -> Self {
        [Self::Avx512, Self::Avx2Fma]
            .into_iter()
            .find(|isa| isa.is_supported())
            .unwrap_or(Self::Scalar)
    }

    /// Whether this CPU can run the kernels compiled for `self`.
    pub fn is_supported(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx2Fma => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx512 | Self::Avx2Fma => false,
            Self::Scalar => true,
        }
    }

    /// Every instruction set this CPU supports, best first (for tests and benchmarks).
    pub fn all_supported() -> Vec<Self> {
        [Self::Avx512, Self::Avx2Fma, Self::Scalar]
            .into_iter()
            .filter(|isa| isa.is_supported())
            .collect()
    }

    /// Tokens per kernel call: AVX2 has 16 registers, so its groups are half as wide.
    pub fn group(self) -> usize {
        match self {
            Self::Avx2Fma => MAX_GROUP / 2,
            Self::Avx512 | Self::Scalar => MAX_GROUP,
        }
    }
}

/// One NVFP4 weight row: `cols / 2` packed bytes and `cols / 16` E4M3 block scales.
#[derive(Clone, Copy, Debug)]
pub struct Nvfp4Row<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [u8],
    pub global: f32,
}

/// `out[t] = Σ_c x[t·cols + c] · row[c]` for `t < out.len()`.
///
/// `isa` must be supported by this CPU (the caller checks it once per GEMM: see
/// [`super::cpu::moe_cpu_with`]); `out.len()` must be at most `isa.group()`.
pub fn nvfp4_row_dots(isa: Isa, row: Nvfp4Row<'_>, x: &[f32], cols: usize, out: &mut [f32]) {
    let n = out.len();
    // These bounds are what the SIMD kernels rely on for their unchecked loads.
    assert!(
        cols.is_multiple_of(NVFP4_BLOCK),
        "cols {cols} not block-aligned"
    );
    assert!(row.packed.len() >= cols / 2 && row.scales.len() >= cols / NVFP4_BLOCK);
    assert!(x.len() >= n * cols, "x holds fewer than {n} rows of {cols}");
    assert!(n <= isa.group(), "{n} tokens exceed the {isa:?} group");
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            assert!(Isa::Avx512.is_supported());
            // SAFETY: the CPU supports AVX-512F/BW (checked above; the check is a cached
            // atomic load), and the slice lengths asserted above cover every load.
            unsafe { x86::dots_avx512(row, x, cols, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => {
            assert!(Isa::Avx2Fma.is_supported());
            // SAFETY: as above, for AVX2 and FMA.
            unsafe { x86::dots_avx2(row, x, cols, out) }
        }
        _ => dots_scalar(row, x, cols, out),
    }
}

/// The portable kernel: decode a block to 16 floats on the stack, then one pass per token with
/// eight partial sums (an order the compiler may vectorize without reassociating).
fn dots_scalar(row: Nvfp4Row<'_>, x: &[f32], cols: usize, out: &mut [f32]) {
    let mut acc = [[0.0f32; 8]; MAX_GROUP];
    let mut w = [0.0f32; NVFP4_BLOCK];
    for (b, (&scale, bytes)) in row
        .scales
        .iter()
        .zip(row.packed.chunks_exact(NVFP4_BLOCK / 2))
        .take(cols / NVFP4_BLOCK)
        .enumerate()
    {
        let factor = e4m3_to_f32(scale) * row.global;
        for (pair, &byte) in w.chunks_exact_mut(2).zip(bytes) {
            pair[0] = E2M1_VALUES[(byte & 0x0F) as usize] * factor;
            pair[1] = E2M1_VALUES[(byte >> 4) as usize] * factor;
        }
        for (t, acc) in acc.iter_mut().enumerate().take(out.len()) {
            let xb = &x[t * cols + b * NVFP4_BLOCK..t * cols + (b + 1) * NVFP4_BLOCK];
            for (i, (&xv, &wv)) in xb.iter().zip(&w).enumerate() {
                acc[i % 8] += xv * wv;
            }
        }
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{MAX_GROUP, Nvfp4Row};
    use crate::formats::e4m3::e4m3_to_f32;
    use crate::formats::nvfp4::NVFP4_BLOCK;

    /// Dispatches on the token count so that each accumulator array has a constant length and
    /// lives in registers.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and AVX-512BW; `row` must hold `cols / 2` packed bytes and
    /// `cols / 16` scales, `x` at least `out.len() · cols` floats, and `out.len() ≤ 8`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn dots_avx512(row: Nvfp4Row<'_>, x: &[f32], cols: usize, out: &mut [f32]) {
        // SAFETY (all arms): forwarded from this function's contract.
        unsafe {
            match out.len() {
                0 => {}
                1 => avx512_n::<1>(row, x, cols, out),
                2 => avx512_n::<2>(row, x, cols, out),
                3 => avx512_n::<3>(row, x, cols, out),
                4 => avx512_n::<4>(row, x, cols, out),
                5 => avx512_n::<5>(row, x, cols, out),
                6 => avx512_n::<6>(row, x, cols, out),
                7 => avx512_n::<7>(row, x, cols, out),
                8 => avx512_n::<8>(row, x, cols, out),
                n => unreachable!("group of {n} > {MAX_GROUP}"),
            }
        }
    }

    /// Decodes 16 E2M1 codes (the low nibbles of 16 bytes widened to 32-bit lanes) through the
    /// table and scales them by the block factor.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn decode16(codes: __m128i, table: __m512, factor: f32) -> __m512 {
        // vpermps only reads the low 4 bits of each index, so the high nibble riding along in
        // each byte needs no mask.
        let idx = _mm512_cvtepu8_epi32(codes);
        _mm512_mul_ps(_mm512_permutexvar_ps(idx, table), _mm512_set1_ps(factor))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn avx512_n<const N: usize>(row: Nvfp4Row<'_>, x: &[f32], cols: usize, out: &mut [f32]) {
        let table = _mm512_setr_ps(
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        );
        let blocks = cols / NVFP4_BLOCK;
        let packed = row.packed.as_ptr();
        let xp = x.as_ptr();
        // Two accumulators per token (even and odd blocks) so that the FMA latency chain of a
        // single token is split in two.
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        let mut b = 0;
        while b + 2 <= blocks {
            // SAFETY: b + 2 ≤ blocks, so bytes [8b, 8b + 16) lie within the row's cols/2
            // packed bytes, and x[t·cols + 16b .. + 32) within token t's row (t < N).
            unsafe {
                let bytes = _mm_loadu_si128(packed.add(b * 8).cast());
                // Byte i of `hi` has the high nibble of byte i in its low 4 bits; interleaving
                // puts the elements back in order (low nibble first, as packed).
                let hi = _mm_srli_epi16(bytes, 4);
                let w0 = decode16(
                    _mm_unpacklo_epi8(bytes, hi),
                    table,
                    e4m3_to_f32(row.scales[b]) * row.global,
                );
                let w1 = decode16(
                    _mm_unpackhi_epi8(bytes, hi),
                    table,
                    e4m3_to_f32(row.scales[b + 1]) * row.global,
                );
                for (t, acc) in acc.iter_mut().enumerate() {
                    let xt = xp.add(t * cols + b * NVFP4_BLOCK);
                    acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xt), w0, acc[0]);
                    acc[1] = _mm512_fmadd_ps(_mm512_loadu_ps(xt.add(16)), w1, acc[1]);
                }
            }
            b += 2;
        }
        if b < blocks {
            // SAFETY: b < blocks: bytes [8b, 8b + 8) and x[t·cols + 16b .. + 16) are in bounds.
            unsafe {
                let bytes = _mm_loadl_epi64(packed.add(b * 8).cast());
                let hi = _mm_srli_epi16(bytes, 4);
                let w0 = decode16(
                    _mm_unpacklo_epi8(bytes, hi),
                    table,
                    e4m3_to_f32(row.scales[b]) * row.global,
                );
                for (t, acc) in acc.iter_mut().enumerate() {
                    let xt = xp.add(t * cols + b * NVFP4_BLOCK);
                    acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xt), w0, acc[0]);
                }
            }
        }
        for (o, acc) in out.iter_mut().zip(&acc) {
            *o = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
        }
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; lengths as for [`dots_avx512`], `out.len() ≤ 4`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dots_avx2(row: Nvfp4Row<'_>, x: &[f32], cols: usize, out: &mut [f32]) {
        // SAFETY (all arms): forwarded from this function's contract.
        unsafe {
            match out.len() {
                0 => {}
                1 => avx2_n::<1>(row, x, cols, out),
                2 => avx2_n::<2>(row, x, cols, out),
                3 => avx2_n::<3>(row, x, cols, out),
                4 => avx2_n::<4>(row, x, cols, out),
                n => unreachable!("AVX2 group of {n} > {}", MAX_GROUP / 2),
            }
        }
    }

    /// Decodes 8 E2M1 codes (low nibbles of 8 bytes) with two 8-entry tables: `vpermps` reads
    /// the 3 magnitude bits, and shifting the sign bit (bit 3) to bit 31 lets `vblendvps` pick
    /// the negative table. Code 8 ("−0") decodes to +0.0 as in ModelOpt's table.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn decode8(codes: __m128i, pos: __m256, neg: __m256, factor: __m256) -> __m256 {
        let idx = _mm256_cvtepu8_epi32(codes);
        let sign = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
        let v = _mm256_blendv_ps(
            _mm256_permutevar8x32_ps(pos, idx),
            _mm256_permutevar8x32_ps(neg, idx),
            sign,
        );
        _mm256_mul_ps(v, factor)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_n<const N: usize>(row: Nvfp4Row<'_>, x: &[f32], cols: usize, out: &mut [f32]) {
        let pos = _mm256_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
        let neg = _mm256_setr_ps(0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0);
        let packed = row.packed.as_ptr();
        let xp = x.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..cols / NVFP4_BLOCK {
            // SAFETY: b < cols/16: bytes [8b, 8b + 8) and x[t·cols + 16b .. + 16) are in bounds.
            unsafe {
                let bytes = _mm_loadl_epi64(packed.add(b * 8).cast());
                let codes = _mm_unpacklo_epi8(bytes, _mm_srli_epi16(bytes, 4));
                let factor = _mm256_set1_ps(e4m3_to_f32(row.scales[b]) * row.global);
                let w0 = decode8(codes, pos, neg, factor);
                let w1 = decode8(_mm_srli_si128(codes, 8), pos, neg, factor);
                for (t, acc) in acc.iter_mut().enumerate() {
                    let xt = xp.add(t * cols + b * NVFP4_BLOCK);
                    acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xt), w0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(xt.add(8)), w1, acc[1]);
                }
            }
        }
        for (o, acc) in out.iter_mut().zip(&acc) {
            let s = _mm256_add_ps(acc[0], acc[1]);
            let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            *o = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::nvfp4::Nvfp4Matrix;

    #[test]
    fn every_supported_isa_matches_dequantize_then_dot() {
        for cols in [16, 32, 48, 256, 7168] {
            let rows = 3;
            let w: Vec<f32> = (0..rows * cols)
                .map(|i| (((i * 7919) % 2003) as f32 / 1001.0 - 1.0) * (1 + i % 5) as f32)
                .collect();
            let q = Nvfp4Matrix::quantize_weight(&w, rows, cols).unwrap();
            let deq = q.dequantize();
            let x: Vec<f32> = (0..MAX_GROUP * cols)
                .map(|i| ((i * 104729) % 1999) as f32 / 999.0 - 1.0)
                .collect();
            for isa in Isa::all_supported() {
                for n in 0..=isa.group() {
                    for r in 0..rows {
                        let row = Nvfp4Row {
                            packed: &q.packed[r * cols / 2..],
                            scales: &q.block_scales[r * cols / 16..],
                            global: q.global_scale,
                        };
                        let mut out = vec![0.0; n];
                        nvfp4_row_dots(isa, row, &x, cols, &mut out);
                        for (t, &o) in out.iter().enumerate() {
                            let expected: f64 = (0..cols)
                                .map(|c| x[t * cols + c] as f64 * deq[r * cols + c] as f64)
                                .sum();
                            let mass: f64 = (0..cols)
                                .map(|c| (x[t * cols + c] * deq[r * cols + c]).abs() as f64)
                                .sum();
                            assert!(
                                (o as f64 - expected).abs() <= 1e-6 * mass,
                                "{isa:?} cols {cols} n {n} row {r} token {t}: {o} vs {expected}"
                            );
                        }
                    }
                }
            }
        }
    }
}

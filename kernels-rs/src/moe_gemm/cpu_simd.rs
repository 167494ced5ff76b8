//! The inner kernels of the fast CPU grouped GEMM: NVFP4 weight rows against the activation
//! rows of up to [`MAX_GROUP`] tokens, `out[t] = Σ_c x[t, c] · w[c]`.
//!
//! At decode the weights are the memory traffic, so every packed byte is read exactly once and
//! never written back dequantized. Per 16-element block the AVX-512 kernel does three ALU
//! operations besides the FMAs:
//! 1. the block's 8 packed bytes are broadcast to every 64-bit lane straight from memory, and
//!    one variable shift (`vpsrlvd`) puts nibble `m` of the low and high 32-bit halves in lanes
//!    `2m` and `2m + 1`;
//! 2. `vpermps` decodes all 16 codes through a register-resident 16-entry E2M1 table (it reads
//!    only the low 4 bits of each lane, so no mask is needed);
//! 3. one multiply by the block factor `f32(e4m3) · global`, broadcast from a small per-row
//!    array that is computed 16 blocks at a time (`factors16`): the same single rounding as
//!    [`Nvfp4View::dequantize_row_into`], so the weights are bit-identical to the reference's.
//!
//! Step 1 leaves the elements of a block in the order `0, 8, 1, 9, …, 7, 15`. Rather than undo
//! that per weight block, the activations are stored in the same order once per call
//! ([`interleave_blocks`]): a dot product does not care about the order of its terms. The
//! products and sums differ from the reference's only in accumulation order and FMA fusion.
//!
//! AVX-512 takes weight rows four at a time for groups of up to four tokens, so that each
//! activation load and each horizontal sum serves four rows, and prefetches the lines of the
//! next four rows: consecutive row groups are contiguous, but to the hardware prefetcher each
//! group is four new streams, and asking early doubled the DRAM throughput.
//!
//! Three implementations are selected at run time: AVX-512 (one block per `zmm`), AVX2+FMA (a
//! block is two `ymm`; the 8-entry `vpermps` covers the magnitudes and a blend on the sign bit
//! picks the negative table) and portable Rust.
//!
//! Where the time goes at decode (2 Zen 4 cores, `bench/results/cpu_grouped_gemm.txt`): with
//! one token per expert the kernels stream weights at about 0.9 of the copy bandwidth (Kimi's
//! unsharded intermediate; the TP8 shard's 256-column down rows cost more per byte); each
//! further token adds one FP32 FMA per 16 weights, so from two tokens per expert on the FMA
//! throughput (about one `zmm` FMA per cycle per core), not the memory, sets the pace.
//!
//! Possible next step for 4–8 tokens: `vdpbf16ps` (AVX512-BF16) does two multiply-adds per lane
//! per instruction, and both operands are exact in BF16 once the global scales are factored
//! out (`e2m1 · e4m3` has at most 6 significant bits); the price is a different rounding of the
//! per-element factors than the reference's `e2m1 · (e4m3 · global)`.
//!
//! [`Nvfp4View::dequantize_row_into`]: crate::formats::nvfp4::Nvfp4View::dequantize_row_into

use crate::formats::e2m1::E2M1_VALUES;
use crate::formats::e4m3::e4m3_to_f32;
use std::ops::Range;

use crate::formats::nvfp4::{NVFP4_BLOCK, Nvfp4View, block_dequant_factor, block_scale_code};
use crate::isa::Isa;

/// Most tokens one kernel call accumulates at once (see [`token_group`]).
pub const MAX_GROUP: usize = 8;

/// Tokens per kernel call of `isa`. AVX2 has 16 registers. AVX-512 takes four weight rows at a
/// time, and four rows × four tokens is 16 accumulators; measured, two passes of four tokens
/// over a tile (the second from cache) beat one pass of eight tokens over single rows by about
/// 2× at 8 tokens per expert.
pub fn token_group(isa: Isa) -> usize {
    match isa {
        Isa::Avx2Fma | Isa::Avx512 => MAX_GROUP / 2,
        Isa::Scalar => MAX_GROUP,
    }
}

/// One NVFP4 weight row: `cols / 2` packed bytes and `cols / 16` E4M3 block scales.
#[derive(Clone, Copy, Debug)]
pub struct Nvfp4Row<'a> {
    pub packed: &'a [u8],
    pub scales: &'a [u8],
    pub global: f32,
}

/// `out[t · stride + (r − rows.start)] = Σ_c x[t · cols + c] · w[r, c]` for every token
/// `t < n` and weight row `r` in `rows`: one tile of a grouped GEMM. Tokens are taken in groups
/// of [`token_group`]`(isa)`, so each weight row is decoded once per group (once in all at decode).
///
/// # Panics
/// If this CPU does not support `isa`, or if the slices are too short for the shapes.
pub fn nvfp4_rows_dots(
    isa: Isa,
    w: &Nvfp4View<'_>,
    rows: Range<usize>,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    let cols = w.cols;
    // These bounds are what the SIMD kernels rely on for their unchecked loads.
    assert!(
        cols.is_multiple_of(NVFP4_BLOCK),
        "cols {cols} not block-aligned"
    );
    assert!(
        rows.start <= rows.end && rows.end <= w.rows,
        "rows {rows:?} of {}",
        w.rows
    );
    assert!(w.packed.len() >= w.rows * cols / 2);
    assert!(w.block_scales.len() >= w.rows * cols / NVFP4_BLOCK);
    assert!(x.len() >= n * cols, "x holds fewer than {n} rows of {cols}");
    if n == 0 || rows.is_empty() {
        return;
    }
    assert!(stride >= rows.len() && out.len() >= (n - 1) * stride + rows.len());
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    let group = token_group(isa);
    for g0 in (0..n).step_by(group) {
        let g = group.min(n - g0);
        let (x, out) = (&x[g0 * cols..], &mut out[g0 * stride..]);
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU supports AVX-512F/BW (checked above), and the lengths asserted
            // above cover every load: rows < w.rows, g ≤ 8 rows of x, g rows of out.
            Isa::Avx512 => unsafe { x86::rows_avx512(w, rows.clone(), x, g, out, stride) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for AVX2 and FMA, with g ≤ 4.
            Isa::Avx2Fma => unsafe { x86::rows_avx2(w, rows.clone(), x, g, out, stride) },
            _ => {
                let mut acc = [0.0f32; MAX_GROUP];
                for (j, r) in rows.clone().enumerate() {
                    dots_scalar(row_of(w, r), x, cols, &mut acc[..g]);
                    for (t, &v) in acc[..g].iter().enumerate() {
                        out[t * stride + j] = v;
                    }
                }
            }
        }
    }
}

/// Row `r` of `w`.
#[inline]
fn row_of<'a>(w: &Nvfp4View<'a>, r: usize) -> Nvfp4Row<'a> {
    let cols = w.cols;
    Nvfp4Row {
        packed: &w.packed[r * cols / 2..(r + 1) * cols / 2],
        scales: &w.block_scales[r * cols / NVFP4_BLOCK..(r + 1) * cols / NVFP4_BLOCK],
        global: w.global_scale,
    }
}

/// Reorders every whole 16-element block of `row` to `0, 8, 1, 9, …, 7, 15`, the order in
/// which the kernels decode weight blocks (a trailing partial block stays as it is). Activation
/// rows go through this once before [`nvfp4_rows_dots`].
pub fn interleave_blocks(row: &mut [f32]) {
    for block in row.chunks_exact_mut(NVFP4_BLOCK) {
        let natural: [f32; NVFP4_BLOCK] = block.try_into().expect("16 elements");
        for m in 0..NVFP4_BLOCK / 2 {
            block[2 * m] = natural[m];
            block[2 * m + 1] = natural[NVFP4_BLOCK / 2 + m];
        }
    }
}

/// The portable kernel: decode a block (interleaved order) to 16 floats on the stack, then one
/// pass per token with eight partial sums.
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
        let codes = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
        for m in 0..NVFP4_BLOCK / 2 {
            w[2 * m] = E2M1_VALUES[(codes >> (4 * m) & 0xF) as usize] * factor;
            w[2 * m + 1] = E2M1_VALUES[(codes >> (32 + 4 * m) & 0xF) as usize] * factor;
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

/// [`fake_quantize_row`](crate::formats::nvfp4::fake_quantize_row), bit for bit, written
/// branch-free so that it vectorizes: the E2M1 rounding counts the midpoints below the magnitude
/// (plus one at the three midpoints that round up to the even code) instead of searching a
/// table. Every activation the grouped GEMM multiplies passes through here, twice.
pub fn fake_quantize_row_fast(isa: Isa, row: &[f32], input_scale: f32, out: &mut [f32]) {
    assert_eq!(row.len(), out.len());
    assert!(row.len().is_multiple_of(NVFP4_BLOCK));
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports the features (checked above); the function only touches the
        // slices it is given.
        Isa::Avx512 => unsafe { x86::fake_quantize_avx512(row, input_scale, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2Fma => unsafe { x86::fake_quantize_avx2(row, input_scale, out) },
        _ => fake_quantize_body(row, input_scale, out),
    }
}

/// E2M1 rounding midpoints; see [`crate::formats::e2m1::f32_to_e2m1`].
const MIDPOINTS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];

#[inline(always)]
fn fake_quantize_body(row: &[f32], input_scale: f32, out: &mut [f32]) {
    for (block, out) in row
        .chunks_exact(NVFP4_BLOCK)
        .zip(out.chunks_exact_mut(NVFP4_BLOCK))
    {
        // torch's max propagates NaN; f32::max would drop it.
        let block_amax = if block.iter().any(|v| v.is_nan()) {
            f32::NAN
        } else {
            block.iter().fold(0.0f32, |m, v| m.max(v.abs()))
        };
        let factor = block_dequant_factor(block_scale_code(block_amax, input_scale), input_scale);
        for (o, &x) in out.iter_mut().zip(block) {
            let q = x / factor;
            let m = q.abs();
            let mut ordinal = 0u32;
            for bound in MIDPOINTS {
                ordinal += u32::from(bound < m);
            }
            ordinal += u32::from((m == 0.75) | (m == 1.75) | (m == 3.5));
            // searchsorted places NaN after every bound.
            let ordinal = if m.is_nan() { 7 } else { ordinal };
            // Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 from the ordinal, exactly.
            let o_f = ordinal as f32;
            let magnitude =
                o_f * 0.5 + (o_f - 4.0).max(0.0) * 0.5 + if ordinal == 7 { 1.0 } else { 0.0 };
            let v = magnitude * factor;
            // Code 8 ("−0") decodes to +0.0; other negative codes to −magnitude.
            *o = if q < 0.0 && ordinal != 0 { -v } else { v };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use std::mem::MaybeUninit;
    use std::ops::Range;

    use super::{Nvfp4Row, row_of};
    use crate::formats::e4m3::e4m3_to_f32;
    use crate::formats::nvfp4::{NVFP4_BLOCK, Nvfp4View};

    /// Generates the tile loop for one ISA: dispatch on the token count once per tile, so that
    /// each accumulator array has a constant length and lives in registers.
    macro_rules! rows_fn {
        ($name:ident, $features:literal, $kernel:ident, [$($n:literal),*]) => {
            /// # Safety
            /// The CPU must support the enabled features; `rows` must lie within `w`, `x` hold
            /// `g` rows of `w.cols` and `out` hold `(g − 1) · stride + rows.len()` floats, with `g`
            /// at most the ISA's group.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(
                w: &Nvfp4View<'_>,
                rows: Range<usize>,
                x: &[f32],
                g: usize,
                out: &mut [f32],
                stride: usize,
            ) {
                match g {
                    $($n => {
                        for (j, r) in rows.enumerate() {
                            // SAFETY: forwarded from this function's contract.
                            let v = unsafe { $kernel::<$n>(row_of(w, r), x, w.cols) };
                            for (t, &v) in v.iter().enumerate() {
                                out[t * stride + j] = v;
                            }
                        }
                    })*
                    _ => unreachable!("group of {g}"),
                }
            }
        };
    }

    /// The AVX-512 tile loop (groups of up to 4 tokens): weight rows four at a time
    /// ([`avx512_rows4`]), the last `rows.len() mod 4` one at a time ([`avx512_n`]).
    ///
    /// # Safety
    /// As for the `rows_fn!` functions.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn rows_avx512(
        w: &Nvfp4View<'_>,
        rows: Range<usize>,
        x: &[f32],
        g: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        // SAFETY (every arm): forwarded from this function's contract.
        unsafe {
            match g {
                1 => tile4::<1>(w, rows, x, out, stride),
                2 => tile4::<2>(w, rows, x, out, stride),
                3 => tile4::<3>(w, rows, x, out, stride),
                4 => tile4::<4>(w, rows, x, out, stride),
                _ => unreachable!("AVX-512 group of {g} > 4"),
            }
        }
    }

    /// # Safety
    /// As for [`rows_avx512`], with `N` tokens.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn tile4<const N: usize>(
        w: &Nvfp4View<'_>,
        rows: Range<usize>,
        x: &[f32],
        out: &mut [f32],
        stride: usize,
    ) {
        let mut r = rows.start;
        while r + 4 <= rows.end {
            let four = [
                row_of(w, r),
                row_of(w, r + 1),
                row_of(w, r + 2),
                row_of(w, r + 3),
            ];
            // SAFETY: forwarded from this function's contract.
            let v = unsafe { avx512_rows4::<N>(four, x, w.cols) };
            let j = r - rows.start;
            for (t, v) in v.iter().enumerate() {
                out[t * stride + j..t * stride + j + 4].copy_from_slice(v);
            }
            r += 4;
        }
        for r in r..rows.end {
            // SAFETY: forwarded from this function's contract.
            let v = unsafe { avx512_n::<N>(row_of(w, r), x, w.cols) };
            for (t, &v) in v.iter().enumerate() {
                out[t * stride + r - rows.start] = v;
            }
        }
    }
    rows_fn!(rows_avx2, "avx2,fma", avx2_n, [1, 2, 3, 4]);

    /// The portable body compiled for AVX-512, which LLVM vectorizes 16 wide.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) fn fake_quantize_avx512(row: &[f32], input_scale: f32, out: &mut [f32]) {
        super::fake_quantize_body(row, input_scale, out);
    }

    /// The portable body compiled for AVX2.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn fake_quantize_avx2(row: &[f32], input_scale: f32, out: &mut [f32]) {
        super::fake_quantize_body(row, input_scale, out);
    }

    /// Blocks whose factors are computed ahead of their products: 256 blocks (4096 elements,
    /// 1 KiB of factors) cover a Kimi row of 7168 in two chunks and stay in L1.
    const FACTOR_CHUNK: usize = 256;

    /// 2¹²⁰: an E4M3 code's bits shifted into an f32's exponent and mantissa fields give the
    /// value times 2⁻¹²⁰, exactly, subnormal codes included (they land on f32 subnormals).
    const TWO_POW_120: f32 = f32::from_bits((127 + 120) << 23);

    /// Decodes 16 E4M3 codes and multiplies them by the global scale: `e4m3_to_f32(c) · global`
    /// bit for bit, NaN codes (`S.1111.111`) included.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn factors16(codes: __m128i, global: __m512) -> __m512 {
        let c = _mm512_cvtepu8_epi32(codes);
        let magnitude = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
        let sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
        let bits = _mm512_or_si512(_mm512_slli_epi32(magnitude, 20), sign);
        let v = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(TWO_POW_120));
        let nan = _mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(0x7F));
        _mm512_mul_ps(
            _mm512_mask_blend_ps(nan, v, _mm512_set1_ps(f32::NAN)),
            global,
        )
    }

    /// Block factors of up to [`FACTOR_CHUNK`] blocks. Left uninitialized: zeroing 1 KiB per
    /// row would cost more than a 256-column row's products.
    type Factors = [MaybeUninit<f32>; FACTOR_CHUNK];

    /// `factors[b] = e4m3_to_f32(scales[b]) · global` for every `b < scales.len()`
    /// (at most [`FACTOR_CHUNK`]), 16 at a time; these are the elements initialized.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn fill_factors(scales: &[u8], global: f32, factors: &mut Factors) {
        let nb = scales.len().min(FACTOR_CHUNK);
        let global_v = _mm512_set1_ps(global);
        let mut b = 0;
        while b + 16 <= nb {
            // SAFETY: b + 16 ≤ nb ≤ scales.len() and ≤ FACTOR_CHUNK: both accesses in bounds.
            unsafe {
                let codes = _mm_loadu_si128(scales.as_ptr().add(b).cast());
                _mm512_storeu_ps(
                    factors.as_mut_ptr().add(b).cast(),
                    factors16(codes, global_v),
                );
            }
            b += 16;
        }
        for (f, &code) in factors[b..nb].iter_mut().zip(&scales[b..nb]) {
            f.write(e4m3_to_f32(code) * global);
        }
    }

    /// Rows ahead that the kernels prefetch: the rows the next call of a four-row kernel reads.
    const PREFETCH_ROWS: usize = 4;

    /// Prefetches block `blk`'s cache line of the row [`PREFETCH_ROWS`] after `row` (and its
    /// scales' line), once per line. Consecutive rows are contiguous, but each group of rows is
    /// a new set of streams to the hardware prefetcher; asking early doubled the DRAM throughput
    /// of the four-row kernel. Prefetches never fault, so running past the matrix is harmless.
    #[inline]
    #[target_feature(enable = "sse")]
    fn prefetch_ahead(row: &Nvfp4Row<'_>, blk: usize, cols: usize) {
        if blk.is_multiple_of(8) {
            let ahead = blk * 8 + PREFETCH_ROWS * cols / 2;
            _mm_prefetch::<_MM_HINT_T0>(row.packed.as_ptr().wrapping_add(ahead).cast());
            if blk.is_multiple_of(64) {
                let ahead = blk + PREFETCH_ROWS * cols / NVFP4_BLOCK;
                _mm_prefetch::<_MM_HINT_T0>(row.scales.as_ptr().wrapping_add(ahead).cast());
            }
        }
    }

    /// `[Σ v0, Σ v1, Σ v2, Σ v3]`: four horizontal sums sharing their shuffles.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn reduce4(v: [__m512; 4]) -> [f32; 4] {
        let y = v.map(|v| {
            _mm256_add_ps(
                _mm512_castps512_ps256(v),
                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
            )
        });
        let h = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
        let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        let mut out = [0.0f32; 4];
        // SAFETY: `out` holds 4 floats.
        unsafe { _mm_storeu_ps(out.as_mut_ptr(), s) };
        out
    }

    /// Four weight rows against `N ≤ 4` tokens: `out[t][i] = x[t] · rows[i]`. Sharing each
    /// activation load between four rows and the horizontal sums between four accumulators
    /// matters for short rows, such as down_proj's 256 columns at TP8.
    ///
    /// # Safety
    /// AVX-512F/BW; each row holds `cols` elements and `x` at least `N · cols` floats, each
    /// row in interleaved block order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    #[allow(
        clippy::needless_range_loop,
        reason = "the block index addresses four factor arrays and four packed rows"
    )]
    unsafe fn avx512_rows4<const N: usize>(
        rows: [Nvfp4Row<'_>; 4],
        x: &[f32],
        cols: usize,
    ) -> [[f32; 4]; N] {
        let table = _mm512_setr_ps(
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        );
        let shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        let blocks = cols / NVFP4_BLOCK;
        let xp = x.as_ptr();
        let mut factors: [Factors; 4] = [[MaybeUninit::uninit(); FACTOR_CHUNK]; 4];
        // One accumulator per (token, row): the four rows already give independent chains.
        let mut acc = [[_mm512_setzero_ps(); 4]; N];
        let mut c0 = 0;
        while c0 < blocks {
            let nb = FACTOR_CHUNK.min(blocks - c0);
            for (f, row) in factors.iter_mut().zip(&rows) {
                fill_factors(&row.scales[c0..c0 + nb], row.global, f);
            }
            // Prefetches once per 8 blocks (a cache line of packed bytes), outside the inner
            // loop: a branch inside it made LLVM spill accumulators at four tokens.
            for b8 in (0..nb).step_by(8) {
                for row in &rows {
                    prefetch_ahead(row, c0 + b8, cols);
                }
                for b in b8..(b8 + 8).min(nb) {
                    let blk = c0 + b;
                    let mut w = [_mm512_setzero_ps(); 4];
                    for (i, (w, row)) in w.iter_mut().zip(&rows).enumerate() {
                        // SAFETY: blk < blocks: bytes [8·blk, 8·blk + 8) lie within the row.
                        let q = unsafe {
                            row.packed
                                .as_ptr()
                                .add(blk * 8)
                                .cast::<i64>()
                                .read_unaligned()
                        };
                        *w = _mm512_mul_ps(
                            _mm512_permutexvar_ps(
                                _mm512_srlv_epi32(_mm512_set1_epi64(q), shifts),
                                table,
                            ),
                            // SAFETY: fill_factors initialized factors[i][..nb], and b < nb.
                            _mm512_set1_ps(unsafe { factors[i][b].assume_init() }),
                        );
                    }
                    for (t, acc) in acc.iter_mut().enumerate() {
                        // SAFETY: x[t·cols + 16·blk .. + 16) lies within token t's row (t < N).
                        let xv = unsafe { _mm512_loadu_ps(xp.add(t * cols + blk * NVFP4_BLOCK)) };
                        for (a, &w) in acc.iter_mut().zip(&w) {
                            *a = _mm512_fmadd_ps(xv, w, *a);
                        }
                    }
                }
            }
            c0 += nb;
        }
        // A loop, not `array::map`: map is not inlined into a target-feature function and its
        // call (with a vzeroupper and spilled accumulators) cost as much as a short row.
        let mut sums = [[0.0f32; 4]; N];
        for (s, a) in sums.iter_mut().zip(&acc) {
            *s = reduce4(*a);
        }
        sums
    }

    /// # Safety
    /// AVX-512F/BW; `row` holds `cols` elements and `x` at least `N · cols` floats, each row
    /// in interleaved block order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn avx512_n<const N: usize>(row: Nvfp4Row<'_>, x: &[f32], cols: usize) -> [f32; N] {
        let table = _mm512_setr_ps(
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        );
        let shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        let blocks = cols / NVFP4_BLOCK;
        let packed = row.packed.as_ptr();
        let xp = x.as_ptr();
        let mut factors: Factors = [MaybeUninit::uninit(); FACTOR_CHUNK];
        // Two accumulators per token (even and odd blocks) so that the FMA latency chain of a
        // single token is split in two.
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        let mut c0 = 0;
        while c0 < blocks {
            let nb = FACTOR_CHUNK.min(blocks - c0);
            fill_factors(&row.scales[c0..c0 + nb], row.global, &mut factors);
            let mut b = 0;
            while b + 2 <= nb {
                let blk = c0 + b;
                prefetch_ahead(&row, blk, cols);
                // SAFETY: blk + 2 ≤ blocks, so bytes [8·blk, 8·blk + 16) lie within the row's
                // cols/2 packed bytes, and x[t·cols + 16·blk .. + 32) within token t's row;
                // fill_factors initialized factors[..nb], and b + 1 < nb.
                unsafe {
                    let q0 = _mm512_set1_epi64(packed.add(blk * 8).cast::<i64>().read_unaligned());
                    let q1 =
                        _mm512_set1_epi64(packed.add(blk * 8 + 8).cast::<i64>().read_unaligned());
                    let w0 = _mm512_mul_ps(
                        _mm512_permutexvar_ps(_mm512_srlv_epi32(q0, shifts), table),
                        _mm512_set1_ps(factors[b].assume_init()),
                    );
                    let w1 = _mm512_mul_ps(
                        _mm512_permutexvar_ps(_mm512_srlv_epi32(q1, shifts), table),
                        _mm512_set1_ps(factors[b + 1].assume_init()),
                    );
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let xt = xp.add(t * cols + blk * NVFP4_BLOCK);
                        acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xt), w0, acc[0]);
                        acc[1] = _mm512_fmadd_ps(_mm512_loadu_ps(xt.add(16)), w1, acc[1]);
                    }
                }
                b += 2;
            }
            if b < nb {
                let blk = c0 + b;
                // SAFETY: blk < blocks: bytes [8·blk, 8·blk + 8) and x[t·cols + 16·blk .. + 16)
                // are in bounds; factors[b] is initialized (b < nb).
                unsafe {
                    let q = _mm512_set1_epi64(packed.add(blk * 8).cast::<i64>().read_unaligned());
                    let w = _mm512_mul_ps(
                        _mm512_permutexvar_ps(_mm512_srlv_epi32(q, shifts), table),
                        _mm512_set1_ps(factors[b].assume_init()),
                    );
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let xt = xp.add(t * cols + blk * NVFP4_BLOCK);
                        acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xt), w, acc[0]);
                    }
                }
            }
            c0 += nb;
        }
        let mut sums = [0.0f32; N];
        for (s, a) in sums.iter_mut().zip(&acc) {
            *s = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
        }
        sums
    }

    /// [`factors16`] for AVX2, 8 codes (the low 8 bytes of `codes`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn factors8(codes: __m128i, global: __m256) -> __m256 {
        let c = _mm256_cvtepu8_epi32(codes);
        let magnitude = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
        let sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
        let bits = _mm256_or_si256(_mm256_slli_epi32(magnitude, 20), sign);
        let v = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(TWO_POW_120));
        let nan = _mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7F));
        let v = _mm256_blendv_ps(v, _mm256_set1_ps(f32::NAN), _mm256_castsi256_ps(nan));
        _mm256_mul_ps(v, global)
    }

    /// Decodes 8 E2M1 codes (the low nibble of each 32-bit lane) with two 8-entry tables:
    /// `vpermps` reads the 3 magnitude bits, and shifting the sign bit (bit 3) to bit 31 lets
    /// `vblendvps` pick the negative table. Code 8 ("−0") decodes to +0.0 as in ModelOpt.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn decode8(idx: __m256i, pos: __m256, neg: __m256, factor: __m256) -> __m256 {
        let sign = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
        let v = _mm256_blendv_ps(
            _mm256_permutevar8x32_ps(pos, idx),
            _mm256_permutevar8x32_ps(neg, idx),
            sign,
        );
        _mm256_mul_ps(v, factor)
    }

    /// # Safety
    /// AVX2 and FMA; `row` holds `cols` elements and `x` at least `N · cols` floats, each row
    /// in interleaved block order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_n<const N: usize>(row: Nvfp4Row<'_>, x: &[f32], cols: usize) -> [f32; N] {
        let pos = _mm256_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
        let neg = _mm256_setr_ps(0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0);
        // The 64-bit broadcast alternates the low and high halves of the block over the 32-bit
        // lanes, as in the AVX-512 kernel: lanes 0–7 hold elements 0, 8, 1, 9, 2, 10, 3, 11.
        let shifts0 = _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12);
        let shifts1 = _mm256_setr_epi32(16, 16, 20, 20, 24, 24, 28, 28);
        let global = _mm256_set1_ps(row.global);
        let blocks = cols / NVFP4_BLOCK;
        let packed = row.packed.as_ptr();
        let xp = x.as_ptr();
        let mut factors = [0.0f32; FACTOR_CHUNK];
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        let mut c0 = 0;
        while c0 < blocks {
            let nb = FACTOR_CHUNK.min(blocks - c0);
            let mut b = 0;
            while b + 8 <= nb {
                // SAFETY: scales [c0 + b, c0 + b + 8) lie within the row; factors [b, b + 8)
                // within the array.
                unsafe {
                    let codes = _mm_loadl_epi64(row.scales.as_ptr().add(c0 + b).cast());
                    _mm256_storeu_ps(factors.as_mut_ptr().add(b), factors8(codes, global));
                }
                b += 8;
            }
            for (f, &code) in factors[b..nb].iter_mut().zip(&row.scales[c0 + b..c0 + nb]) {
                *f = e4m3_to_f32(code) * row.global;
            }
            for (b, &factor) in factors[..nb].iter().enumerate() {
                let blk = c0 + b;
                prefetch_ahead(&row, blk, cols);
                // SAFETY: blk < blocks: bytes [8·blk, 8·blk + 8) and x[t·cols + 16·blk .. + 16)
                // are in bounds.
                unsafe {
                    let q = _mm256_set1_epi64x(packed.add(blk * 8).cast::<i64>().read_unaligned());
                    let factor = _mm256_set1_ps(factor);
                    let w0 = decode8(_mm256_srlv_epi32(q, shifts0), pos, neg, factor);
                    let w1 = decode8(_mm256_srlv_epi32(q, shifts1), pos, neg, factor);
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let xt = xp.add(t * cols + blk * NVFP4_BLOCK);
                        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xt), w0, acc[0]);
                        acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(xt.add(8)), w1, acc[1]);
                    }
                }
            }
            c0 += nb;
        }
        let mut sums = [0.0f32; N];
        for (o, a) in sums.iter_mut().zip(&acc) {
            let s = _mm256_add_ps(a[0], a[1]);
            let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            *o = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
        }
        sums
    }

    /// All 256 E4M3 codes through the vector factor decoders, for the tests.
    #[cfg(test)]
    pub(super) fn all_factors(isa: super::Isa, global: f32) -> Vec<f32> {
        let codes: Vec<u8> = (0..=255).collect();
        let mut out = vec![0.0f32; 256];
        for (c, o) in codes.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            // SAFETY: 16 readable bytes and 16 writable floats; the features are checked by
            // the caller (the test only asks for supported ISAs).
            unsafe {
                let v = _mm_loadu_si128(c.as_ptr().cast());
                match isa {
                    super::Isa::Avx512 => {
                        _mm512_storeu_ps(o.as_mut_ptr(), factors16(v, _mm512_set1_ps(global)))
                    }
                    _ => {
                        let g = _mm256_set1_ps(global);
                        _mm256_storeu_ps(o.as_mut_ptr(), factors8(v, g));
                        let hi = _mm_srli_si128(v, 8);
                        _mm256_storeu_ps(o.as_mut_ptr().add(8), factors8(hi, g));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::nvfp4::Nvfp4Matrix;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_block_factors_match_the_e4m3_table() {
        for isa in Isa::all_supported() {
            if isa == Isa::Scalar {
                continue;
            }
            for global in [1.0, 1.0 / 2688.0, 3.7e-5, 1e30] {
                let got = x86::all_factors(isa, global);
                for (code, &g) in got.iter().enumerate() {
                    let want = e4m3_to_f32(code as u8) * global;
                    assert!(
                        g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                        "{isa:?} code {code:#04x} global {global}: {g:e} vs {want:e}"
                    );
                }
            }
        }
    }

    #[test]
    fn fast_fake_quantization_is_bit_exact() {
        use crate::formats::nvfp4::fake_quantize_row;
        let mut values: Vec<f32> = (0..4096)
            .map(|i| {
                let u = ((i * 7919 + 13) % 4001) as f32 / 2000.0 - 1.0;
                u * [1.0, 1e-3, 40.0, 1e-7][i / 16 % 4]
            })
            .collect();
        // Exact E2M1 midpoints (block amax 6 makes the factor a power of two below), signed
        // zeros, tiny negatives, infinities and NaN.
        let ties = [
            6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75,
        ];
        for (k, v) in values[..64].iter_mut().enumerate() {
            *v = ties[k % ties.len()] * 2f32.powi(k as i32 / 16 - 2);
        }
        values[64..80].copy_from_slice(&[
            -0.0, 0.0, -1e-9, 1e-9, -0.0, 3.0, -3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
        ]);
        values[80] = f32::INFINITY;
        values[100] = f32::NAN;
        values[120] = -f32::INFINITY;
        for scale in [1.0 / 2688.0, 1.0 / 16.0, 1e-6, 0.37] {
            let mut want = vec![0.0; values.len()];
            fake_quantize_row(&values, scale, &mut want);
            for isa in Isa::all_supported() {
                let mut got = vec![0.0; values.len()];
                fake_quantize_row_fast(isa, &values, scale, &mut got);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                        "{isa:?} scale {scale} element {i} ({}): {a:e} vs {b:e}",
                        values[i]
                    );
                }
            }
        }
    }

    #[test]
    fn every_supported_isa_matches_dequantize_then_dot() {
        // 8320 = 520 blocks: two whole factor chunks and a partial one.
        for cols in [16, 32, 48, 256, 7168, 8320] {
            let rows = 9;
            let w: Vec<f32> = (0..rows * cols)
                .map(|i| (((i * 7919) % 2003) as f32 / 1001.0 - 1.0) * (1 + i % 5) as f32)
                .collect();
            let q = Nvfp4Matrix::quantize_weight(&w, rows, cols).unwrap();
            let deq = q.dequantize();
            let n_max = 2 * MAX_GROUP + 3;
            let x: Vec<f32> = (0..n_max * cols)
                .map(|i| ((i * 104729) % 1999) as f32 / 999.0 - 1.0)
                .collect();
            let mut xi = x.clone();
            xi.chunks_exact_mut(cols).for_each(interleave_blocks);
            for isa in Isa::all_supported() {
                for n in 0..=n_max {
                    // Rows 1..8 (four at a time, then three one by one), into a wider stride:
                    // the rest of `out` must stay untouched.
                    let stride = 8;
                    let mut out = vec![f32::NAN; n * stride];
                    nvfp4_rows_dots(isa, &q.view(), 1..8, &xi, n, &mut out, stride);
                    for t in 0..n {
                        assert!(out[t * stride + 7].is_nan());
                        for r in 1..8 {
                            let o = out[t * stride + r - 1];
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

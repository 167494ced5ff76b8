//! Register-blocked BF16 products: a tile of weight rows × tokens per kernel call, so that each
//! widened weight vector serves every token of the tile and each activation load serves every
//! row of it.
//!
//! A dot product per (row, token) pair computed one at a time (the previous kernel) widens
//! the weight row again for every token and ends every pair with a horizontal sum: at four
//! tokens it did four times the work of one token for the same weight bytes, so batch 4
//! decoded no faster than batch 1, and prefill ran at a fraction of the FMA peak.
//!
//! ## One summation order for every ISA and every tile
//! Element `i < ⌊cols/16⌋·16` of a dot product goes into lane `i mod 16` by a fused
//! multiply-add, in increasing `i`; the 16 lanes are summed by the tree
//! `s8[l] = a[l] + a[l+8]`, `s4[l] = s8[l] + s8[l+4]`, `s2[l] = s4[l] + s4[l+2]`,
//! `s = s2[0] + s2[1]`; the last `cols mod 16` elements are fused into `s` in order. AVX-512
//! holds the 16 lanes in one `zmm`, AVX2 in two `ymm` (lanes 0–7, 8–15), the portable code in
//! an array with `f32::mul_add`. A result therefore depends on neither the ISA nor the tile,
//! so every tiling, thread split and dispatch gives the same bits.
//!
//! ## Tiles
//! - AVX-512 (32 registers): 4 rows × up to 4 tokens, 16 accumulators.
//! - AVX2 (16 registers, a 16-lane accumulator is two of them): 4 rows × 1 token (decode at
//!   batch 1, where the weights are the traffic), else 2 rows × 2 tokens (8 accumulators, 4
//!   widened weight halves, 2 activation halves).
//! - Portable: 4 × 4, left to the compiler.

use half::bf16;

use crate::moe_gemm::cpu_simd::Isa;

/// Lanes of the summation order (one `zmm` of f32).
pub const LANES: usize = 16;
/// Most weight rows one kernel call takes.
pub const MAX_TILE_ROWS: usize = 4;
/// Most tokens one kernel call takes.
pub const MAX_TILE_TOKENS: usize = 4;

/// The tile (weight rows, tokens) `isa` uses when `tokens` tokens are left.
pub fn tile(isa: Isa, tokens: usize) -> (usize, usize) {
    match isa {
        Isa::Avx512 | Isa::Scalar => (MAX_TILE_ROWS, tokens.min(MAX_TILE_TOKENS)),
        Isa::Avx2Fma if tokens == 1 => (4, 1),
        Isa::Avx2Fma => (2, 2),
    }
}

/// Operands of one tile: `rows` weight rows of `cols` BF16 at `w` (row stride `cols`), `tokens`
/// activation rows of `cols` f32 at `x` (row stride `cols`); the result of (row r, token t)
/// goes to `out[r * out_row_stride + t]`.
#[derive(Clone, Copy)]
pub struct Tile<'a> {
    pub x: &'a [f32],
    pub w: &'a [bf16],
    pub cols: usize,
    pub rows: usize,
    pub tokens: usize,
}

/// Computes one tile with `isa`, which must be supported by this CPU and whose [`tile`] must
/// allow `rows × tokens`.
///
/// # Panics
/// If the tile is larger than `isa` takes, the slices are too short, or `isa` is unsupported.
pub fn compute_tile(isa: Isa, t: Tile<'_>, out: &mut [f32], out_row_stride: usize) {
    let (max_rows, max_tokens) = tile(isa, t.tokens);
    assert!(
        (1..=max_rows).contains(&t.rows) && (1..=max_tokens).contains(&t.tokens),
        "bf16 tile {}x{} exceeds {isa:?}'s {max_rows}x{max_tokens}",
        t.rows,
        t.tokens
    );
    assert!(t.x.len() >= t.tokens * t.cols && t.w.len() >= t.rows * t.cols);
    assert!(out.len() > (t.rows - 1) * out_row_stride + t.tokens - 1);
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    macro_rules! dispatch {
        ($kernel:ident) => {
            match (t.rows, t.tokens) {
                (1, 1) => $kernel::<1, 1>(t, out, out_row_stride),
                (1, 2) => $kernel::<1, 2>(t, out, out_row_stride),
                (1, 3) => $kernel::<1, 3>(t, out, out_row_stride),
                (1, 4) => $kernel::<1, 4>(t, out, out_row_stride),
                (2, 1) => $kernel::<2, 1>(t, out, out_row_stride),
                (2, 2) => $kernel::<2, 2>(t, out, out_row_stride),
                (2, 3) => $kernel::<2, 3>(t, out, out_row_stride),
                (2, 4) => $kernel::<2, 4>(t, out, out_row_stride),
                (3, 1) => $kernel::<3, 1>(t, out, out_row_stride),
                (3, 2) => $kernel::<3, 2>(t, out, out_row_stride),
                (3, 3) => $kernel::<3, 3>(t, out, out_row_stride),
                (3, 4) => $kernel::<3, 4>(t, out, out_row_stride),
                (4, 1) => $kernel::<4, 1>(t, out, out_row_stride),
                (4, 2) => $kernel::<4, 2>(t, out, out_row_stride),
                (4, 3) => $kernel::<4, 3>(t, out, out_row_stride),
                (4, 4) => $kernel::<4, 4>(t, out, out_row_stride),
                _ => unreachable!("checked above"),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports the ISA (asserted above) and the slices cover the tile.
        Isa::Avx512 => unsafe { dispatch!(tile_avx512) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2Fma => unsafe { dispatch!(tile_avx2) },
        _ => dispatch!(tile_portable),
    }
}

/// The 16-lane tree sum of the module documentation.
#[inline(always)]
fn reduce_lanes(a: &[f32; LANES]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    let s4: [f32; 4] = std::array::from_fn(|l| s8[l] + s8[l + 4]);
    let s2: [f32; 2] = std::array::from_fn(|l| s4[l] + s4[l + 2]);
    s2[0] + s2[1]
}

#[inline(always)]
fn widen(w: bf16) -> f32 {
    f32::from_bits(u32::from(w.to_bits()) << 16)
}

/// The tail elements past the last whole 16 (`cols mod 16` of them), fused in order.
#[inline(always)]
fn add_tail(mut s: f32, x: &[f32], w: &[bf16], from: usize) -> f32 {
    for (a, &b) in x[from..].iter().zip(&w[from..]) {
        s = a.mul_add(widen(b), s);
    }
    s
}

fn tile_portable<const R: usize, const T: usize>(
    t: Tile<'_>,
    out: &mut [f32],
    out_row_stride: usize,
) {
    let cols = t.cols;
    let full = cols / LANES * LANES;
    let mut acc = [[[0.0f32; LANES]; T]; R];
    for i in (0..full).step_by(LANES) {
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let w: [f32; LANES] = std::array::from_fn(|l| widen(t.w[r * cols + i + l]));
            for (k, acc_rt) in acc_r.iter_mut().enumerate() {
                let x = &t.x[k * cols + i..k * cols + i + LANES];
                for l in 0..LANES {
                    acc_rt[l] = x[l].mul_add(w[l], acc_rt[l]);
                }
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (k, acc_rt) in acc_r.iter().enumerate() {
            let s = reduce_lanes(acc_rt);
            out[r * out_row_stride + k] = add_tail(
                s,
                &t.x[k * cols..(k + 1) * cols],
                &t.w[r * cols..(r + 1) * cols],
                full,
            );
        }
    }
}

// The register tile reads best as acc[row][token] indexed by both loop counters.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const R: usize, const T: usize>(
    t: Tile<'_>,
    out: &mut [f32],
    out_row_stride: usize,
) {
    use std::arch::x86_64::*;
    let cols = t.cols;
    let full = cols / LANES * LANES;
    let (x, w) = (t.x.as_ptr(), t.w.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut i = 0;
    while i < full {
        prefetch_next_tile::<R>(w, cols, i);
        let mut widened = [_mm512_setzero_ps(); R];
        for (r, v) in widened.iter_mut().enumerate() {
            // SAFETY: row r's elements i..i+16 are inside `w` (checked by the caller); BF16
            // widens to f32 by a 16-bit shift.
            *v = unsafe {
                let halves = _mm256_loadu_si256(w.add(r * cols + i) as *const __m256i);
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
            };
        }
        for k in 0..T {
            // SAFETY: token k's elements i..i+16 are inside `x`.
            let xs = unsafe { _mm512_loadu_ps(x.add(k * cols + i)) };
            for r in 0..R {
                acc[r][k] = _mm512_fmadd_ps(xs, widened[r], acc[r][k]);
            }
        }
        i += LANES;
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (k, &a) in acc_r.iter().enumerate() {
            let lo = _mm512_castps512_ps256(a);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
            let s = reduce8_avx(_mm256_add_ps(lo, hi));
            out[r * out_row_stride + k] = add_tail(
                s,
                &t.x[k * cols..(k + 1) * cols],
                &t.w[r * cols..(r + 1) * cols],
                full,
            );
        }
    }
}

/// Asks for the lines the next tile of `R` rows reads at element `i`, once per 64-byte line:
/// to the hardware prefetcher each tile is `R` new streams, and a tile of short rows ends
/// before it has ramped up on them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_next_tile<const R: usize>(w: *const bf16, cols: usize, i: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    if i.is_multiple_of(32) {
        for r in 0..R {
            // A prefetch never faults; `wrapping_add` keeps the address arithmetic defined
            // past the end of the weights.
            let ahead = w.wrapping_add((R + r) * cols + i);
            // SAFETY: prefetching any address is allowed.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8) };
        }
    }
}

/// `s8` → the tree's `s`: lanes l + l+4, then l + l+2, then 0 + 1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn reduce8_avx(s8: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
}

// As in tile_avx512.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize, const T: usize>(
    t: Tile<'_>,
    out: &mut [f32],
    out_row_stride: usize,
) {
    use std::arch::x86_64::*;
    let cols = t.cols;
    let full = cols / LANES * LANES;
    let (x, w) = (t.x.as_ptr(), t.w.as_ptr());
    // [r][k][half]: half 0 holds lanes 0–7, half 1 lanes 8–15.
    let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
    let mut i = 0;
    while i < full {
        prefetch_next_tile::<R>(w, cols, i);
        let mut widened = [[_mm256_setzero_ps(); 2]; R];
        for (r, v) in widened.iter_mut().enumerate() {
            for (half, vh) in v.iter_mut().enumerate() {
                // SAFETY: row r's elements i+8·half .. +8 are inside `w`.
                *vh = unsafe {
                    let halves = _mm_loadu_si128(w.add(r * cols + i + 8 * half) as *const __m128i);
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
                };
            }
        }
        for k in 0..T {
            for half in 0..2 {
                // SAFETY: token k's elements i+8·half .. +8 are inside `x`.
                let xs = unsafe { _mm256_loadu_ps(x.add(k * cols + i + 8 * half)) };
                for r in 0..R {
                    acc[r][k][half] = _mm256_fmadd_ps(xs, widened[r][half], acc[r][k][half]);
                }
            }
        }
        i += LANES;
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (k, a) in acc_r.iter().enumerate() {
            let s = reduce8_avx(_mm256_add_ps(a[0], a[1]));
            out[r * out_row_stride + k] = add_tail(
                s,
                &t.x[k * cols..(k + 1) * cols],
                &t.w[r * cols..(r + 1) * cols],
                full,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn operands(rows: usize, tokens: usize, cols: usize, seed: usize) -> (Vec<f32>, Vec<bf16>) {
        let x = (0..tokens * cols)
            .map(|i| (((i + seed) * 37 % 101) as f32 - 50.0) / 25.0 + 1e-3 * (i % 7) as f32)
            .collect();
        let w = (0..rows * cols)
            .map(|i| bf16::from_f32((((i + seed) * 53 % 97) as f32 - 48.0) / 40.0))
            .collect();
        (x, w)
    }

    /// The summation order of the module documentation, written out element by element.
    fn canonical_dot(x: &[f32], w: &[bf16]) -> f32 {
        let full = x.len() / LANES * LANES;
        let mut lanes = [0.0f32; LANES];
        for i in 0..full {
            lanes[i % LANES] = x[i].mul_add(w[i].to_f32(), lanes[i % LANES]);
        }
        let mut s = reduce_lanes(&lanes);
        for i in full..x.len() {
            s = x[i].mul_add(w[i].to_f32(), s);
        }
        s
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Every ISA and every tile shape it takes gives the canonical order's bits, which are
        /// within f32 rounding of an f64 sum.
        #[test]
        fn every_isa_and_tile_gives_the_canonical_bits(
            seed in 0usize..1000,
            cols in 1usize..200,
            tokens in 1usize..=4,
        ) {
            for isa in Isa::all_supported() {
                let (max_rows, max_tokens) = tile(isa, tokens);
                let tokens = tokens.min(max_tokens);
                for rows in 1..=max_rows {
                    let (x, w) = operands(rows, tokens, cols, seed);
                    let stride = tokens + 3;
                    let mut out = vec![f32::NAN; rows * stride];
                    compute_tile(isa, Tile { x: &x, w: &w, cols, rows, tokens }, &mut out, stride);
                    for r in 0..rows {
                        for k in 0..tokens {
                            let (xs, ws) = (&x[k * cols..(k + 1) * cols], &w[r * cols..(r + 1) * cols]);
                            let want = canonical_dot(xs, ws);
                            let got = out[r * stride + k];
                            proptest::prop_assert_eq!(got.to_bits(), want.to_bits(), "{:?} {}x{} r{} t{}", isa, rows, tokens, r, k);
                            let exact: f64 = xs.iter().zip(ws).map(|(a, b)| f64::from(*a) * f64::from(b.to_f32())).sum();
                            let magnitude: f64 = xs.iter().zip(ws).map(|(a, b)| (f64::from(*a) * f64::from(b.to_f32())).abs()).sum();
                            proptest::prop_assert!((f64::from(got) - exact).abs() <= 1e-6 * magnitude + 1e-30);
                        }
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "exceeds")]
    fn a_tile_larger_than_the_isa_takes_is_refused() {
        let (x, w) = operands(5, 1, 16, 0);
        let mut out = vec![0.0; 5];
        compute_tile(
            Isa::Scalar,
            Tile {
                x: &x,
                w: &w,
                cols: 16,
                rows: 5,
                tokens: 1,
            },
            &mut out,
            1,
        );
    }
}

//! W4A4 with integer block dot products: the checkpoint's own semantics, computed the way the
//! format invites.
//!
//! Twice an E2M1 value is an integer in −12..=12, and the activations are quantized to NVFP4
//! anyway. So the dot product of a 16-element block, `Σ (2·e2m1(w)) · (2·e2m1(a))`, is an
//! exact integer (|·| ≤ 16 · 144 = 2304), and a row's dot product is
//!
//! `out = (input_scale · weight_scale_2 / 4) · Σ_b dot_b · (e4m3(sw_b) · e4m3(sa_b))`.
//!
//! Every term of the sum is exact in f32: an E4M3 value has at most 4 significant bits, so the
//! product of two block scales has at most 8, and times an integer of at most 12 bits it has at
//! most 20 (< 24), with no overflow or subnormal (2⁻¹⁸ ≤ |sw·sa| ≤ 448²). The only roundings
//! are the cross-block f32 additions, the global factor and the final multiply. (The reference
//! dequantizes first: it rounds `e4m3 · global` once per operand; the real numbers it then
//! multiplies differ from ours by at most 2⁻²⁴ relative per operand.)
//!
//! ## Layout of the quantized activations
//! A row is quantized once per (token, expert input) ([`quantize_row_int`]) into:
//! - `codes`: `2·e2m1` as `i8`, padded with zeros to whole groups of [`GROUP_BLOCKS`] blocks
//!   ([`padded_cols`]) and stored in the weight decoder's order: inside group `g`, element
//!   `e` of block `16g + j` is at `256g + 64k + 4j + m` with `k = (e & 1) | (e >> 3) << 1` and
//!   `m = (e >> 1) & 3`. Plane `k` is then what one 64-byte weight vector multiplies: lane `j`
//!   (32 bits) holds four elements of block `j`.
//! - `corr`: `−12 · Σ_block codes` per block (`i32`): the weights are decoded as
//!   `2·e2m1 + 12 ∈ 0..=24`, unsigned as `vpdpbusd` and `vpmaddubsw` need, and the
//!   accumulator starts at the correction instead of zero, which costs nothing.
//! - `scales`: `e4m3(sa_b)` per block as f32 (the global `input_scale` is applied per row).
//!
//! ## Kernels (selected at run time from [`Isa`])
//! - AVX-512 VNNI: per group of 16 blocks, two 64-byte loads of packed weights, two
//!   `vpermt2d` put the first and second four bytes of each block in 32-bit lane `j`, and
//!   four `vpshufb` decode the nibbles to `2·e2m1 + 12`. Per token: four `vpdpbusd` (each
//!   lane sums 4 products; after four, lane `j` holds block `j`'s whole dot), one convert,
//!   one multiply by the block scales, one FMA. Four weight rows at a time, up to four tokens.
//! - AVX2: the same on 8-block halves with `vpmaddubsw` (pairs, no saturation: |·| ≤ 576),
//!   three 16-bit adds (≤ 2304) and one `vpmaddwd` by ones.
//! - Portable Rust.
//!
//! All three accumulate block `b` into lane `b mod 16` and reduce the 16 lanes in the same
//! tree ([`reduce16`]), and every product is exact, so they agree **bit for bit**.
//!
//! Cost, per 256 weights (16 blocks) and token: 4 integer dot instructions, 3 float ops and
//! 6 loads, against 16 FMAs and 16 loads for the f32 kernels of [`cpu_simd`](super::cpu_simd);
//! the weight decode per 256 weights is about 16 instructions instead of about 64.

use std::ops::Range;

use crate::formats::e4m3::e4m3_to_f32;
use crate::formats::nvfp4::{NVFP4_BLOCK, Nvfp4View, block_dequant_factor, block_scale_code};
use crate::isa::Isa;

/// Blocks per group: one per 32-bit lane of an AVX-512 register.
pub const GROUP_BLOCKS: usize = 16;
/// Elements per group.
pub const GROUP_ELEMENTS: usize = GROUP_BLOCKS * NVFP4_BLOCK;
/// Packed weight bytes per group.
const GROUP_BYTES: usize = GROUP_ELEMENTS / 2;
/// Added to a weight's `2·e2m1` so that it is unsigned for the u8 × i8 dot instructions.
pub const WEIGHT_OFFSET: i32 = 12;
/// `2·e2m1` of each code. Code 8 ("−0") is 0, as in ModelOpt's table.
pub const E2M1_TWICE: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
/// `2·e2m1 + WEIGHT_OFFSET` of each code: the weight decoders' byte-shuffle table.
const WEIGHT_TABLE: [i8; 16] = {
    let mut t = [0i8; 16];
    let mut c = 0;
    while c < 16 {
        t[c] = E2M1_TWICE[c] + WEIGHT_OFFSET as i8;
        c += 1;
    }
    t
};
/// `2·e2m1` of the magnitude ordinals 0..=7 (the rounding of [`quantize_row_int`]).
#[cfg(test)]
const MAGNITUDE_TWICE: [i8; 8] = [0, 1, 2, 3, 4, 6, 8, 12];

/// The most tokens one kernel call accumulates.
pub const INT_GROUP: usize = 4;

/// A row of `cols` elements padded to whole groups.
pub fn padded_cols(cols: usize) -> usize {
    cols.next_multiple_of(GROUP_ELEMENTS)
}

/// Blocks of a padded row.
pub fn padded_blocks(cols: usize) -> usize {
    padded_cols(cols) / NVFP4_BLOCK
}

/// Where element `e` of block `b` lives in a quantized row (see the module docs).
#[inline]
pub fn code_position(b: usize, e: usize) -> usize {
    let (g, j) = (b / GROUP_BLOCKS, b % GROUP_BLOCKS);
    let k = (e & 1) | (e >> 3) << 1;
    let m = (e >> 1) & 3;
    g * GROUP_ELEMENTS + 64 * k + 4 * j + m
}

/// E2M1 rounding midpoints; see [`crate::formats::e2m1::f32_to_e2m1`].
const MIDPOINTS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];

/// Quantizes one activation row with `input_scale` to the integer layout: `codes`
/// (`padded_cols(row.len())`), `corr` and `scales` (`padded_blocks(row.len())` each); the
/// padding is zeroed. The values are those of
/// [`fake_quantize_row`](crate::formats::nvfp4::fake_quantize_row), bit for bit:
/// `codes / 2 · (scales · input_scale)` is its output (NaN blocks give NaN scales).
///
/// # Panics
/// If `row.len()` is not a multiple of 16 or the outputs have the wrong lengths.
pub fn quantize_row_int(
    row: &[f32],
    input_scale: f32,
    codes: &mut [i8],
    corr: &mut [i32],
    scales: &mut [f32],
) {
    quantize_row_int_with(Isa::detect(), row, input_scale, codes, corr, scales);
}

/// [`quantize_row_int`] compiled for `isa` (every ISA gives the same bits).
///
/// # Panics
/// As [`quantize_row_int`], and if this CPU does not support `isa`.
pub fn quantize_row_int_with(
    isa: Isa,
    row: &[f32],
    input_scale: f32,
    codes: &mut [i8],
    corr: &mut [i32],
    scales: &mut [f32],
) {
    let cols = row.len();
    assert!(
        cols.is_multiple_of(NVFP4_BLOCK),
        "cols {cols} not block-aligned"
    );
    assert_eq!(codes.len(), padded_cols(cols));
    assert_eq!(corr.len(), padded_blocks(cols));
    assert_eq!(scales.len(), padded_blocks(cols));
    let blocks = cols / NVFP4_BLOCK;
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    // The block body is plain Rust: compiled for the ISA, its 16 divisions, compares and
    // selects become one vector each (the scalar loop was a tenth of a 512-token prefill).
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports the ISA (asserted above).
        Isa::Avx512 => unsafe { quantize_blocks_avx512(row, input_scale, codes, corr, scales) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2Fma => unsafe { quantize_blocks_avx2(row, input_scale, codes, corr, scales) },
        _ => quantize_blocks(0, row, input_scale, codes, corr, scales),
    }
    // Padding: zero codes, correction and scale contribute exactly 0 to every lane.
    for b in blocks..padded_blocks(cols) {
        for e in 0..NVFP4_BLOCK {
            codes[code_position(b, e)] = 0;
        }
        corr[b] = 0;
        scales[b] = 0.0;
    }
}

/// `2·e2m1` of the magnitude ordinal 0..=7 (0, 1, 2, 3, 4, 6, 8, 12) as arithmetic, which
/// vectorizes where a table lookup would not.
#[inline(always)]
fn magnitude_twice(ordinal: u8) -> i8 {
    (ordinal + ordinal.saturating_sub(4) + 2 * u8::from(ordinal == 7)) as i8
}

/// The blocks of [`quantize_row_int_with`] from block `first` on (not the padding).
#[inline(always)]
fn quantize_blocks(
    first: usize,
    row: &[f32],
    input_scale: f32,
    codes: &mut [i8],
    corr: &mut [i32],
    scales: &mut [f32],
) {
    for (b, block) in row.chunks_exact(NVFP4_BLOCK).enumerate().skip(first) {
        let block: &[f32; NVFP4_BLOCK] = block.try_into().expect("chunks of 16");
        let (code, values, sum) = quantize_block_int(block, input_scale);
        for (e, &v) in values.iter().enumerate() {
            codes[code_position(b, e)] = v;
        }
        corr[b] = -WEIGHT_OFFSET * sum;
        scales[b] = e4m3_to_f32(code);
    }
}

/// One whole group's quantization by a vector kernel: `(row from the group on, input_scale,
/// group, codes, corr, scales)`.
type GroupKernel = unsafe fn(&[f32], f32, usize, &mut [i8], &mut [i32], &mut [f32]);

/// The row's whole groups by `group`, the blocks past them by [`quantize_blocks`].
///
/// # Safety
/// The CPU supports what `group` needs; the outputs hold `padded_cols` / `padded_blocks` of
/// the row (the caller's asserts).
#[inline(always)]
unsafe fn quantize_by_groups(
    group: GroupKernel,
    row: &[f32],
    input_scale: f32,
    codes: &mut [i8],
    corr: &mut [i32],
    scales: &mut [f32],
) {
    let groups = row.len() / GROUP_ELEMENTS;
    for g in 0..groups {
        // SAFETY: the caller's contract; group g is whole in `row`.
        unsafe {
            group(
                &row[g * GROUP_ELEMENTS..],
                input_scale,
                g,
                codes,
                corr,
                scales,
            )
        };
    }
    quantize_blocks(groups * GROUP_BLOCKS, row, input_scale, codes, corr, scales)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn quantize_blocks_avx512(
    row: &[f32],
    input_scale: f32,
    codes: &mut [i8],
    corr: &mut [i32],
    scales: &mut [f32],
) {
    // SAFETY: AVX-512F/BW (this function's features); the caller asserted the outputs.
    unsafe {
        quantize_by_groups(
            x86::quantize_group_avx512,
            row,
            input_scale,
            codes,
            corr,
            scales,
        )
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn quantize_blocks_avx2(
    row: &[f32],
    input_scale: f32,
    codes: &mut [i8],
    corr: &mut [i32],
    scales: &mut [f32],
) {
    // SAFETY: AVX2 and FMA (this function's features); the caller asserted the outputs.
    unsafe {
        quantize_by_groups(
            x86::quantize_group_avx2,
            row,
            input_scale,
            codes,
            corr,
            scales,
        )
    }
}

/// One block of [`quantize_row_int`]: its E4M3 scale code, the 16 values `2·e2m1` in
/// element order, and their sum. Branch-free over the elements, so that it vectorizes.
#[inline(always)]
fn quantize_block_int(
    block: &[f32; NVFP4_BLOCK],
    input_scale: f32,
) -> (u8, [i8; NVFP4_BLOCK], i32) {
    // torch's max propagates NaN; f32::max would drop it.
    let mut block_amax = 0.0f32;
    let mut any_nan = false;
    for &v in block {
        block_amax = block_amax.max(v.abs());
        any_nan |= v.is_nan();
    }
    let block_amax = if any_nan { f32::NAN } else { block_amax };
    let code = block_scale_code(block_amax, input_scale);
    let factor = block_dequant_factor(code, input_scale);
    let mut values = [0i8; NVFP4_BLOCK];
    let mut sum = 0i32;
    for (v_out, &x) in values.iter_mut().zip(block) {
        // The same arithmetic as fake_quantize_row_fast: the quotient, then the ordinal of its
        // magnitude among the midpoints (ties to the even code).
        let q = x / factor;
        let m = q.abs();
        let mut ordinal = 0u8;
        for bound in MIDPOINTS {
            ordinal += u8::from(bound < m);
        }
        ordinal += u8::from((m == 0.75) | (m == 1.75) | (m == 3.5));
        // searchsorted places NaN after every bound.
        let ordinal = if m.is_nan() { 7 } else { ordinal };
        let v = magnitude_twice(ordinal);
        let v = if q < 0.0 { -v } else { v };
        sum += i32::from(v);
        *v_out = v;
    }
    (code, values, sum)
}

/// `n` activation rows of `cols` elements quantized by [`quantize_row_int`], row after row
/// (strides [`padded_cols`] and [`padded_blocks`]), with their global `input_scale`.
#[derive(Clone, Copy, Debug)]
pub struct IntActs<'a> {
    pub cols: usize,
    pub codes: &'a [i8],
    pub corr: &'a [i32],
    pub scales: &'a [f32],
    pub input_scale: f32,
}

impl IntActs<'_> {
    /// Token `t`'s value of element `c` (for tests): `codes / 2 · scale · input_scale`.
    pub fn value(&self, t: usize, c: usize) -> f32 {
        let (b, e) = (c / NVFP4_BLOCK, c % NVFP4_BLOCK);
        let code = self.codes[t * padded_cols(self.cols) + code_position(b, e)];
        let factor = self.scales[t * padded_blocks(self.cols) + b] * self.input_scale;
        (f32::from(code) * 0.5) * factor
    }

    /// Rows `t0..` of these activations.
    fn rows_from(&self, t0: usize) -> Self {
        let (pc, pb) = (padded_cols(self.cols), padded_blocks(self.cols));
        Self {
            codes: &self.codes[t0 * pc..],
            corr: &self.corr[t0 * pb..],
            scales: &self.scales[t0 * pb..],
            ..*self
        }
    }
}

/// The kernel an [`Isa`] runs for integer dots: AVX-512 needs VNNI (`vpdpbusd`) as well; a
/// CPU with AVX-512 but no VNNI has AVX2 and runs that kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntKernel {
    Avx512Vnni,
    Avx2,
    Scalar,
}

impl IntKernel {
    /// The kernel for `isa` on this CPU.
    ///
    /// # Panics
    /// If this CPU does not support `isa`.
    pub fn for_isa(isa: Isa) -> Self {
        assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512
                if is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512vl") =>
            {
                Self::Avx512Vnni
            }
            Isa::Avx512 | Isa::Avx2Fma => Self::Avx2,
            Isa::Scalar => Self::Scalar,
        }
    }
}

/// `out[t · stride + (r − rows.start)] = x[t] · w[r]` for every token `t < n` and weight row
/// `r` in `rows`, with integer block dots; `x` holds at least `n` rows. Tokens are taken
/// [`INT_GROUP`] at a time, so each weight row is decoded once per four tokens.
///
/// # Panics
/// If this CPU does not support `isa`, or if the shapes disagree or the slices are too short.
pub fn nvfp4_rows_dots_int(
    isa: Isa,
    w: &Nvfp4View<'_>,
    rows: Range<usize>,
    x: &IntActs<'_>,
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
    assert_eq!(
        x.cols, cols,
        "activations of {} columns for weights of {cols}",
        x.cols
    );
    assert!(
        rows.start <= rows.end && rows.end <= w.rows,
        "rows {rows:?} of {}",
        w.rows
    );
    assert!(w.packed.len() >= w.rows * cols / 2);
    assert!(w.block_scales.len() >= w.rows * cols / NVFP4_BLOCK);
    assert!(
        x.codes.len() >= n * padded_cols(cols),
        "x holds fewer than {n} rows"
    );
    assert!(x.corr.len() >= n * padded_blocks(cols) && x.scales.len() >= n * padded_blocks(cols));
    if n == 0 || rows.is_empty() {
        return;
    }
    assert!(stride >= rows.len() && out.len() >= (n - 1) * stride + rows.len());
    let kernel = IntKernel::for_isa(isa);
    let row_scale = x.input_scale * w.global_scale * 0.25;
    #[cfg(target_arch = "x86_64")]
    if kernel == IntKernel::Avx2 && n > INT_GROUP {
        // SAFETY: the CPU supports AVX2 and FMA (IntKernel::for_isa checked it); the asserts
        // above cover every load.
        unsafe { x86::rows_avx2_decoded(w, rows, x, n, row_scale, out, stride) };
        return;
    }
    for t0 in (0..n).step_by(INT_GROUP) {
        let g = INT_GROUP.min(n - t0);
        let (xg, out) = (x.rows_from(t0), &mut out[t0 * stride..]);
        match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU supports AVX-512F/BW/VL/VNNI (IntKernel::for_isa checked it); the
            // asserts above cover every load: rows < w.rows, g ≤ 4 padded rows of x, g rows
            // of out.
            IntKernel::Avx512Vnni => unsafe {
                x86::rows_vnni(w, rows.clone(), &xg, g, row_scale, out, stride)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for AVX2 and FMA.
            IntKernel::Avx2 => unsafe {
                x86::rows_avx2(w, rows.clone(), &xg, g, row_scale, out, stride)
            },
            _ => {
                for (j, r) in rows.clone().enumerate() {
                    for t in 0..g {
                        out[t * stride + j] = row_scalar(w, r, &xg, t) * row_scale;
                    }
                }
            }
        }
    }
}

/// The 16 lanes summed in the tree every kernel uses: `v_i = l_i + l_{i+8}`, then
/// `((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))` (what the AVX-512 and AVX2 horizontal
/// adds compute).
#[inline]
pub fn reduce16(l: &[f32; 16]) -> f32 {
    let v: [f32; 8] = std::array::from_fn(|i| l[i] + l[i + 8]);
    ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))
}

/// The exact block dot `Σ (2·e2m1(w)) · (2·e2m1(a))` of block `b` of weight row `r` and token
/// `t`, from the packed nibbles and the activation codes (any order).
#[inline]
pub fn block_dot(w: &Nvfp4View<'_>, r: usize, x: &IntActs<'_>, t: usize, b: usize) -> i32 {
    let packed = &w.packed[r * w.cols / 2 + b * NVFP4_BLOCK / 2..][..NVFP4_BLOCK / 2];
    let codes = &x.codes[t * padded_cols(x.cols)..];
    let mut dot = 0i32;
    for (i, &byte) in packed.iter().enumerate() {
        for (e, nibble) in [(2 * i, byte & 0xF), (2 * i + 1, byte >> 4)] {
            let a = codes[code_position(b, e)];
            dot += i32::from(E2M1_TWICE[nibble as usize]) * i32::from(a);
        }
    }
    dot
}

/// The portable kernel: `Σ_b dot_b · (sw_b · sa_b)` into lane `b mod 16`, then [`reduce16`]
/// (before the row scale).
fn row_scalar(w: &Nvfp4View<'_>, r: usize, x: &IntActs<'_>, t: usize) -> f32 {
    let blocks = w.cols / NVFP4_BLOCK;
    let scales = &w.block_scales[r * blocks..(r + 1) * blocks];
    let sa = &x.scales[t * padded_blocks(x.cols)..];
    let mut lanes = [0.0f32; GROUP_BLOCKS];
    for (b, &sw) in scales.iter().enumerate() {
        // Exact: see the module docs. (A fused multiply-add rounds the same.)
        let term = block_dot(w, r, x, t, b) as f32 * (e4m3_to_f32(sw) * sa[b]);
        lanes[b % GROUP_BLOCKS] += term;
    }
    reduce16(&lanes)
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::transpose8;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{GROUP_BLOCKS, GROUP_BYTES, GROUP_ELEMENTS, IntActs, WEIGHT_TABLE};
    use super::{padded_blocks, padded_cols};
    use crate::formats::nvfp4::{NVFP4_BLOCK, Nvfp4View};
    use crate::isa::Isa;
    use crate::prefetch::{PrefetchHint, PrefetchReach};

    /// 2¹²⁰: an E4M3 code's bits shifted into an f32's exponent and mantissa fields give the
    /// value times 2⁻¹²⁰, exactly, subnormal codes included (as in `cpu_simd`).
    const TWO_POW_120: f32 = f32::from_bits((127 + 120) << 23);

    /// Packed bytes ahead that the VNNI kernel prefetches, whatever the row length (the
    /// scales: an eighth of it ahead). Counted in rows (sixteen, four calls of the four-row
    /// kernel), it was 8 KB ahead in a 1024-column gate or up projection but only 3 KB in a
    /// 384-column down projection, less than memory latency covers. 8 KB for every shape:
    /// routed experts at decode 1.10–1.13× faster (`examples/moe_decode_speed`, 12
    /// interleaved rounds, medians of per-round ratios; 2–6 KB and 10–16 KB were no better).
    const PREFETCH_BYTES: usize = 8192;
    /// The shortest rows [`rows_vnni`] reads one at a time for one token.
    const ONE_ROW_MIN_COLS: usize = 1024;
    /// Rows ahead that the one-row AVX2 kernels prefetch (measured on Zen 3; sixteen was no
    /// faster there with AVX2 forced on an AVX-512 machine).
    const AVX2_PREFETCH_ROWS: usize = 4;
    /// Packed bytes ahead that the one-row AVX2 kernels prefetch at least under
    /// [`PrefetchReach::Far`](crate::prefetch::PrefetchReach) and `Off` (AMD's
    /// defaults; `Off` leaves only the dense BF16 rows to the hardware), as far as the VNNI
    /// kernel reaches.
    const AVX2_FAR_PREFETCH_BYTES: usize = PREFETCH_BYTES;

    /// Packed bytes ahead of the current group that the one-row AVX2 kernels prefetch.
    fn avx2_prefetch_bytes(cols: usize) -> usize {
        let rows = AVX2_PREFETCH_ROWS * cols / 2;
        match PrefetchReach::current().for_isa(Isa::Avx2Fma) {
            PrefetchReach::Far | PrefetchReach::Off | PrefetchReach::FarL2 => {
                rows.max(AVX2_FAR_PREFETCH_BYTES)
            }
            PrefetchReach::Near => rows,
        }
    }

    /// The last, partial group of row `r` of a ragged `w` (whole groups: `full`), copied
    /// zero-padded so that the kernels read `GROUP_BYTES` packed bytes and `GROUP_BLOCKS`
    /// scales for it as for any other group.
    #[cold]
    fn tail_group(
        w: &Nvfp4View<'_>,
        r: usize,
        full: usize,
    ) -> ([u8; GROUP_BYTES], [u8; GROUP_BLOCKS]) {
        let blocks = w.cols / NVFP4_BLOCK;
        let packed = &w.packed[r * w.cols / 2..(r + 1) * w.cols / 2];
        let scales = &w.block_scales[r * blocks..(r + 1) * blocks];
        let rest = blocks - full * GROUP_BLOCKS;
        let mut tail = ([0; GROUP_BYTES], [0; GROUP_BLOCKS]);
        tail.0[..rest * 8].copy_from_slice(&packed[full * GROUP_BYTES..]);
        tail.1[..rest].copy_from_slice(&scales[full * GROUP_BLOCKS..]);
        tail
    }

    /// Decodes 16 E4M3 codes to f32, exactly, NaN codes (`S.1111.111`) included.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn e4m3x16(codes: __m128i) -> __m512 {
        let c = _mm512_cvtepu8_epi32(codes);
        let magnitude = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
        let sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
        let bits = _mm512_or_si512(_mm512_slli_epi32(magnitude, 20), sign);
        let v = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(TWO_POW_120));
        let nan = _mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(0x7F));
        _mm512_mask_blend_ps(nan, v, _mm512_set1_ps(f32::NAN))
    }

    /// What [`e4m3x16_scaled`]'s values are short of the codes' by: 2⁸.
    const E4M3_AS_F16_SHORTFALL: f32 = 256.0;

    /// 16 E4M3 codes as f32 times 2⁻⁸ ([`E4M3_AS_F16_SHORTFALL`]), exactly, NaN codes
    /// included, in 7 instructions (most of them 128- or 256-bit) where [`e4m3x16`] takes 9 at
    /// 512 bits: the weight scales of the VNNI kernels, one decode per 128 packed bytes.
    ///
    /// A code sign-extended to 16 bits and shifted left by 7 holds its sign in bits 15 and 14
    /// above its exponent and mantissa (bits 13–7); with bit 14 cleared it is the f16 whose
    /// exponent and mantissa fields are the code's, which is the code's value times
    /// 2^(7 − 15), subnormals included (both formats scale their subnormal mantissas by their
    /// smallest exponent). f16 has no NaN there, so NaN codes (`S.1111.111`) are blended in.
    /// Scaled by 2⁻⁸ every product and sum of the kernels is the canonical one scaled by 2⁻⁸
    /// (a power of two, no subnormal: the smallest `|sw · sa|` becomes 2⁻²⁶), so they multiply
    /// by 2⁸ with the row scale and give the same bits.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn e4m3x16_scaled(codes: __m128i) -> __m512 {
        let shifted = _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(codes));
        let half = _mm256_and_si256(shifted, _mm256_set1_epi16(0xBFFF_u16 as i16));
        let v = _mm512_cvtph_ps(half);
        let magnitude = _mm_and_si128(codes, _mm_set1_epi8(0x7F));
        let nan = _mm_cmpeq_epi8_mask(magnitude, _mm_set1_epi8(0x7F));
        _mm512_mask_blend_ps(nan, v, _mm512_set1_ps(f32::NAN))
    }

    /// [`e4m3x16`] for AVX2, 8 codes (the low 8 bytes of `codes`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn e4m3x8(codes: __m128i) -> __m256 {
        e4m3x8_lanes(_mm256_cvtepu8_epi32(codes))
    }

    /// [`e4m3x8`] of codes already in the 32-bit lanes of `c`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn e4m3x8_lanes(c: __m256i) -> __m256 {
        let magnitude = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
        let sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
        let bits = _mm256_or_si256(_mm256_slli_epi32(magnitude, 20), sign);
        let v = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(TWO_POW_120));
        let nan = _mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7F));
        _mm256_blendv_ps(v, _mm256_set1_ps(f32::NAN), _mm256_castsi256_ps(nan))
    }

    /// `[Σ v0, Σ v1, Σ v2, Σ v3]` in the tree of [`super::reduce16`].
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

    /// `Σ v` in the tree of [`super::reduce16`], as [`reduce4`] sums each of its four.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn reduce1(v: __m512) -> f32 {
        let y = _mm256_add_ps(
            _mm512_castps512_ps256(v),
            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)),
        );
        let h = _mm256_hadd_ps(y, y);
        let h = _mm256_hadd_ps(h, h);
        _mm_cvtss_f32(_mm_add_ss(
            _mm256_castps256_ps128(h),
            _mm256_extractf128_ps(h, 1),
        ))
    }

    /// What the vector quantizers' unchecked loads and stores of group `g` rely on: 256
    /// elements of `row`, and the group's codes, corrections and scales inside the outputs.
    fn check_group_bounds(row: &[f32], g: usize, codes: &[i8], corr: &[i32], scales: &[f32]) {
        assert!(row.len() >= GROUP_ELEMENTS);
        assert!(codes.len() >= (g + 1) * GROUP_ELEMENTS);
        assert!(corr.len() >= (g + 1) * GROUP_BLOCKS && scales.len() >= (g + 1) * GROUP_BLOCKS);
    }

    /// The element of a block that byte `m` of its lane in code plane `k` holds (the layout of
    /// [`super::code_position`]).
    const fn plane_element(k: usize, m: usize) -> usize {
        (k & 1) | (m << 1) | ((k >> 1) << 3)
    }

    /// The vector in which the transposes' stages leave element `e`: its two low bits swapped.
    const fn low_bits_swapped(e: usize) -> usize {
        (e & !3) | ((e & 1) << 1) | ((e >> 1) & 1)
    }

    /// Quantizes the 16 blocks of group `g` (`row[..256]`) as [`super::quantize_block_int`]
    /// does each, with lane `j` holding block `j`: the elements are transposed into 16
    /// vectors (vector `e` = element `e` of every block), so that the amax, the E4M3 scale
    /// code, the factor and each element's quotient and rounding are one vector operation for
    /// 16 blocks; the per-block chain (amax, scalar scale code, division) had run at ~8 cycles
    /// per element. Every step is the scalar one's IEEE operation, so the bits are the same;
    /// the four elements of a code plane are then the four bytes of lane `j`, as
    /// [`super::code_position`] lays them out.
    ///
    /// # Safety
    /// AVX-512F/BW; `row` holds 256 elements; `codes` holds group g's 256 bytes, `corr` and
    /// `scales` its 16 entries.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn quantize_group_avx512(
        row: &[f32],
        input_scale: f32,
        g: usize,
        codes: &mut [i8],
        corr: &mut [i32],
        scales: &mut [f32],
    ) {
        use crate::formats::e2m1::E2M1_MAX;
        use crate::formats::e4m3::{E4M3_MAX, E4M3_MIN_SUBNORMAL};
        check_group_bounds(row, g, codes, corr, scales);
        // SAFETY: 16 loads of 16 floats inside `row[..256]`.
        let blocks: [__m512; 16] =
            std::array::from_fn(|j| unsafe { _mm512_loadu_ps(row.as_ptr().add(16 * j)) });
        let t = transpose16(blocks);
        // Block amax (f32::max drops NaN; a NaN element makes the block NaN, as torch's max).
        let sign_mask = _mm512_set1_epi32(0x7FFF_FFFF);
        let abs =
            |v: __m512| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), sign_mask));
        let mut amax = _mm512_setzero_ps();
        let mut any_nan: __mmask16 = 0;
        for &v in &t {
            amax = _mm512_max_ps(abs(v), amax);
            any_nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        }
        let nan = _mm512_set1_ps(f32::NAN);
        let amax = _mm512_mask_blend_ps(any_nan, amax, nan);
        // block_scale_code: amax / (6 · input_scale), 0 → 1, clamped (NaN kept), to E4M3.
        let mut scale = _mm512_div_ps(amax, _mm512_set1_ps(E2M1_MAX * input_scale));
        let zero = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(scale, _mm512_setzero_ps());
        scale = _mm512_mask_blend_ps(zero, scale, _mm512_set1_ps(1.0));
        let low = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(scale, _mm512_set1_ps(E4M3_MIN_SUBNORMAL));
        scale = _mm512_mask_blend_ps(low, scale, _mm512_set1_ps(E4M3_MIN_SUBNORMAL));
        let high = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(scale, _mm512_set1_ps(E4M3_MAX));
        scale = _mm512_mask_blend_ps(high, scale, _mm512_set1_ps(E4M3_MAX));
        let code = e4m3_codes(scale);
        // The block scale as f32 (exact) and the factor e4m3 · input_scale.
        let sw = e4m3x16(_mm512_cvtepi32_epi8(code));
        let factor = _mm512_mul_ps(sw, _mm512_set1_ps(input_scale));
        // Each element: its quotient's magnitude ordinal among the midpoints, ties to even.
        let mut values = [_mm512_setzero_si512(); 16];
        let mut sum = _mm512_setzero_si512();
        let one = _mm512_set1_epi32(1);
        for (e, v) in values.iter_mut().enumerate() {
            let q = _mm512_div_ps(t[e], factor);
            let m = abs(q);
            let mut ordinal = _mm512_setzero_si512();
            for bound in super::MIDPOINTS {
                let above = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_set1_ps(bound), m);
                ordinal = _mm512_mask_add_epi32(ordinal, above, ordinal, one);
            }
            let tie = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(m, _mm512_set1_ps(0.75))
                | _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(m, _mm512_set1_ps(1.75))
                | _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(m, _mm512_set1_ps(3.5));
            ordinal = _mm512_mask_add_epi32(ordinal, tie, ordinal, one);
            let m_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(m, m);
            ordinal = _mm512_mask_blend_epi32(m_nan, ordinal, _mm512_set1_epi32(7));
            // magnitude_twice: o + max(o − 4, 0) + 2·(o == 7).
            let mut twice = _mm512_add_epi32(
                ordinal,
                _mm512_max_epi32(
                    _mm512_sub_epi32(ordinal, _mm512_set1_epi32(4)),
                    _mm512_setzero_si512(),
                ),
            );
            let seven = _mm512_cmpeq_epi32_mask(ordinal, _mm512_set1_epi32(7));
            twice = _mm512_mask_add_epi32(twice, seven, twice, _mm512_set1_epi32(2));
            let negative = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(q, _mm512_setzero_ps());
            *v = _mm512_mask_sub_epi32(twice, negative, _mm512_setzero_si512(), twice);
            sum = _mm512_add_epi32(sum, *v);
        }
        // Plane k, byte m of lane j: element plane_element(k, m) of block j.
        let byte = _mm512_set1_epi32(0xFF);
        for k in 0..4 {
            let mut plane = _mm512_setzero_si512();
            for m in 0..4 {
                let b = _mm512_and_si512(values[plane_element(k, m)], byte);
                plane =
                    _mm512_or_si512(plane, _mm512_sllv_epi32(b, _mm512_set1_epi32(8 * m as i32)));
            }
            // SAFETY: plane k of group g: 64 bytes inside `codes` (asserted above).
            unsafe {
                _mm512_storeu_si512(
                    codes.as_mut_ptr().add(g * GROUP_ELEMENTS + 64 * k).cast(),
                    plane,
                )
            };
        }
        let corr_v = _mm512_mullo_epi32(sum, _mm512_set1_epi32(-super::WEIGHT_OFFSET));
        // SAFETY: group g's 16 entries of `corr` and `scales` (asserted above).
        unsafe {
            _mm512_storeu_si512(corr.as_mut_ptr().add(g * GROUP_BLOCKS).cast(), corr_v);
            _mm512_storeu_ps(scales.as_mut_ptr().add(g * GROUP_BLOCKS), sw);
        }
    }

    /// [`quantize_group_avx512`] for AVX2, the 16 blocks of group `g` as two halves of eight
    /// (lane `j` of half `h`: block `8h + j`); the same IEEE operations in the same order, so
    /// the same bits. The per-block code it replaces ran at about 4 ns per element.
    ///
    /// # Safety
    /// AVX2 and FMA; as for [`quantize_group_avx512`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_group_avx2(
        row: &[f32],
        input_scale: f32,
        g: usize,
        codes: &mut [i8],
        corr: &mut [i32],
        scales: &mut [f32],
    ) {
        use crate::formats::e2m1::E2M1_MAX;
        use crate::formats::e4m3::{E4M3_MAX, E4M3_MIN_SUBNORMAL};
        check_group_bounds(row, g, codes, corr, scales);
        let sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let abs = |v: __m256| _mm256_and_ps(v, sign_mask);
        let blend = |mask: __m256, no: __m256, yes: __m256| _mm256_blendv_ps(no, yes, mask);
        for half in 0..2 {
            let first = 8 * half * NVFP4_BLOCK;
            // Vector e: element e of the half's 8 blocks (two 8 × 8 transposes).
            // SAFETY: 16 loads of 8 floats inside `row[..256]`.
            let load = |j: usize, e0: usize| unsafe {
                _mm256_loadu_ps(row.as_ptr().add(first + NVFP4_BLOCK * j + e0))
            };
            let lo = transpose8(std::array::from_fn(|j| load(j, 0)));
            let hi = transpose8(std::array::from_fn(|j| load(j, 8)));
            let t: [__m256; 16] = std::array::from_fn(|e| if e < 8 { lo[e] } else { hi[e - 8] });
            let mut amax = _mm256_setzero_ps();
            let mut any_nan = _mm256_setzero_ps();
            for &v in &t {
                amax = _mm256_max_ps(abs(v), amax);
                any_nan = _mm256_or_ps(any_nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            }
            let amax = blend(any_nan, amax, _mm256_set1_ps(f32::NAN));
            let mut scale = _mm256_div_ps(amax, _mm256_set1_ps(E2M1_MAX * input_scale));
            let zero = _mm256_cmp_ps::<_CMP_EQ_OQ>(scale, _mm256_setzero_ps());
            scale = blend(zero, scale, _mm256_set1_ps(1.0));
            let min = _mm256_set1_ps(E4M3_MIN_SUBNORMAL);
            scale = blend(_mm256_cmp_ps::<_CMP_LT_OQ>(scale, min), scale, min);
            let max = _mm256_set1_ps(E4M3_MAX);
            scale = blend(_mm256_cmp_ps::<_CMP_GT_OQ>(scale, max), scale, max);
            let sw = e4m3x8_lanes(e4m3_codes_avx2(scale));
            let factor = _mm256_mul_ps(sw, _mm256_set1_ps(input_scale));
            let mut values = [_mm256_setzero_si256(); 16];
            let mut sum = _mm256_setzero_si256();
            for (e, v) in values.iter_mut().enumerate() {
                let q = _mm256_div_ps(t[e], factor);
                let m = abs(q);
                // A true compare is −1 in every bit: subtracting it counts it.
                let count = |ordinal: __m256i, mask: __m256| {
                    _mm256_sub_epi32(ordinal, _mm256_castps_si256(mask))
                };
                let mut ordinal = _mm256_setzero_si256();
                for bound in super::MIDPOINTS {
                    ordinal = count(
                        ordinal,
                        _mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_set1_ps(bound), m),
                    );
                }
                let tie = _mm256_or_ps(
                    _mm256_or_ps(
                        _mm256_cmp_ps::<_CMP_EQ_OQ>(m, _mm256_set1_ps(0.75)),
                        _mm256_cmp_ps::<_CMP_EQ_OQ>(m, _mm256_set1_ps(1.75)),
                    ),
                    _mm256_cmp_ps::<_CMP_EQ_OQ>(m, _mm256_set1_ps(3.5)),
                );
                ordinal = count(ordinal, tie);
                let m_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(m, m));
                ordinal = _mm256_blendv_epi8(ordinal, _mm256_set1_epi32(7), m_nan);
                // magnitude_twice: o + max(o − 4, 0) + 2·(o == 7).
                let mut twice = _mm256_add_epi32(
                    ordinal,
                    _mm256_max_epi32(
                        _mm256_sub_epi32(ordinal, _mm256_set1_epi32(4)),
                        _mm256_setzero_si256(),
                    ),
                );
                let seven = _mm256_cmpeq_epi32(ordinal, _mm256_set1_epi32(7));
                twice = _mm256_add_epi32(twice, _mm256_and_si256(seven, _mm256_set1_epi32(2)));
                let negative =
                    _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(q, _mm256_setzero_ps()));
                let negated = _mm256_sub_epi32(_mm256_setzero_si256(), twice);
                *v = _mm256_blendv_epi8(twice, negated, negative);
                sum = _mm256_add_epi32(sum, *v);
            }
            // Plane k, byte m of lane j: element plane_element(k, m) of block j;
            // this half's 8 blocks are bytes 32h..32h+32 of each 64-byte plane.
            let byte = _mm256_set1_epi32(0xFF);
            for k in 0..4 {
                let mut plane = _mm256_setzero_si256();
                for m in 0..4 {
                    let b = _mm256_and_si256(values[plane_element(k, m)], byte);
                    plane = _mm256_or_si256(
                        plane,
                        _mm256_sllv_epi32(b, _mm256_set1_epi32(8 * m as i32)),
                    );
                }
                // SAFETY: 32 bytes of plane k of group g, inside `codes` (asserted above).
                unsafe {
                    _mm256_storeu_si256(
                        codes
                            .as_mut_ptr()
                            .add(g * GROUP_ELEMENTS + 64 * k + 32 * half)
                            .cast(),
                        plane,
                    )
                };
            }
            let corr_v = _mm256_mullo_epi32(sum, _mm256_set1_epi32(-super::WEIGHT_OFFSET));
            let at = g * GROUP_BLOCKS + 8 * half;
            // SAFETY: 8 entries of group g's `corr` and `scales` (asserted above).
            unsafe {
                _mm256_storeu_si256(corr.as_mut_ptr().add(at).cast(), corr_v);
                _mm256_storeu_ps(scales.as_mut_ptr().add(at), sw);
            }
        }
    }

    /// [`e4m3_codes`] for AVX2.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn e4m3_codes_avx2(x: __m256) -> __m256i {
        let bits = _mm256_castps_si256(x);
        let abs_bits = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFF_FFFF));
        let rebased = _mm256_sub_epi32(abs_bits, _mm256_set1_epi32((127 - 7) << 23));
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<20>(rebased), _mm256_set1_epi32(1));
        let rounded = _mm256_add_epi32(_mm256_add_epi32(rebased, _mm256_set1_epi32(0x7FFFF)), lsb);
        let normal = _mm256_min_epi32(_mm256_srli_epi32::<20>(rounded), _mm256_set1_epi32(0x7E));
        let sub = _mm256_cvtps_epi32(_mm256_round_ps::<
            { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
        >(_mm256_mul_ps(x, _mm256_set1_ps(512.0))));
        let below_normal = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), abs_bits);
        let code = _mm256_blendv_epi8(normal, sub, below_normal);
        let sign = _mm256_and_si256(_mm256_srli_epi32::<24>(bits), _mm256_set1_epi32(0x80));
        let is_nan = _mm256_cmpgt_epi32(abs_bits, _mm256_set1_epi32(0x7F80_0000));
        let code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), is_nan);
        _mm256_or_si256(code, sign)
    }

    /// The 8 × 8 transpose: vector `e` of the result holds element `e` of every input vector.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        let t: [__m256; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_ps(a, b)
            } else {
                _mm256_unpackhi_ps(a, b)
            }
        });
        // t[2p] = a0 b0 a1 b1 | a4 b4 a5 b5, t[2p+1] = a2 b2 a3 b3 | a6 b6 a7 b7.
        let u: [__m256; 8] = std::array::from_fn(|i| {
            let base = 4 * (i / 4) + (i % 2);
            let (a, b) = (t[base], t[base + 2]);
            if (i / 2) % 2 == 0 {
                _mm256_shuffle_ps::<0b01_00_01_00>(a, b)
            } else {
                _mm256_shuffle_ps::<0b11_10_11_10>(a, b)
            }
        });
        // u[4q + c]: per 128-bit half l, element 4l + c' of rows 4q..4q+4.
        let w: [__m256; 8] = std::array::from_fn(|i| {
            let (a, b) = (u[i % 4], u[i % 4 + 4]);
            if i < 4 {
                _mm256_permute2f128_ps::<0x20>(a, b)
            } else {
                _mm256_permute2f128_ps::<0x31>(a, b)
            }
        });
        std::array::from_fn(|e| w[low_bits_swapped(e)])
    }

    #[cfg(test)]
    #[test]
    fn the_scaled_e4m3_decode_is_every_code_over_256() {
        if !is_x86_feature_detected!("avx512bw") || !is_x86_feature_detected!("avx512vl") {
            println!("skipped: no AVX-512 BW/VL on this CPU");
            return;
        }
        for first in (0..=255u8).step_by(16) {
            let codes: [u8; 16] = std::array::from_fn(|i| first + i as u8);
            let mut got = [0.0f32; 16];
            // SAFETY: AVX-512 F/BW/VL checked above; 16 bytes in, 16 floats out.
            unsafe {
                let v = e4m3x16_scaled(_mm_loadu_si128(codes.as_ptr().cast()));
                _mm512_storeu_ps(got.as_mut_ptr(), v);
            }
            for (&code, &g) in codes.iter().zip(&got) {
                let want = super::e4m3_to_f32(code);
                if want.is_nan() {
                    assert!(g.is_nan(), "code {code:#04x}: {g}");
                } else {
                    let g = g * E4M3_AS_F16_SHORTFALL;
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "code {code:#04x}: {g} vs {want}"
                    );
                }
            }
        }
    }

    #[cfg(test)]
    #[test]
    fn transpose8_transposes() {
        if !is_x86_feature_detected!("avx2") || !is_x86_feature_detected!("fma") {
            println!("skipped: no AVX2 on this CPU");
            return;
        }
        let m: Vec<f32> = (0..64).map(|i| i as f32).collect();
        // SAFETY: AVX2 checked above; 8 loads of 8 floats inside `m`.
        let out = unsafe {
            let rows: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(m.as_ptr().add(8 * j)));
            transpose8(rows)
        };
        let mut got = [[0.0f32; 8]; 8];
        for (e, v) in out.iter().enumerate() {
            // SAFETY: 8 floats.
            unsafe { _mm256_storeu_ps(got[e].as_mut_ptr(), *v) };
        }
        let want: [[f32; 8]; 8] = std::array::from_fn(|e| std::array::from_fn(|j| m[8 * j + e]));
        assert_eq!(got, want);
    }

    #[cfg(test)]
    #[test]
    fn transpose16_transposes() {
        if !is_x86_feature_detected!("avx512f") {
            println!("skipped: no AVX-512 on this CPU");
            return;
        }
        let m: Vec<f32> = (0..256).map(|i| i as f32).collect();
        // SAFETY: AVX-512F checked above; 16 loads of 16 floats inside `m`.
        let out = unsafe {
            let rows: [__m512; 16] =
                std::array::from_fn(|j| _mm512_loadu_ps(m.as_ptr().add(16 * j)));
            transpose16(rows)
        };
        let mut got = [[0.0f32; 16]; 16];
        for (e, v) in out.iter().enumerate() {
            // SAFETY: 16 floats.
            unsafe { _mm512_storeu_ps(got[e].as_mut_ptr(), *v) };
        }
        let want: [[f32; 16]; 16] = std::array::from_fn(|e| std::array::from_fn(|j| m[16 * j + e]));
        assert_eq!(got, want);
    }

    /// `f32_to_e4m3(x, Saturate)` of each lane of `x`, which holds non-negative values at or
    /// above E4M3's smallest subnormal, or NaN (block scales after the clamp), as i32 codes:
    /// normal values by the rebiased exponent and the mantissa rounded to 3 bits (ties to
    /// even, a carry into the exponent being the right result), values below 2⁻⁶ by rounding
    /// `x · 2⁹` to an integer (ties to even), NaN as 0x7F with its sign.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn e4m3_codes(x: __m512) -> __m512i {
        let bits = _mm512_castps_si512(x);
        let abs_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFF_FFFF));
        let rebased = _mm512_sub_epi32(abs_bits, _mm512_set1_epi32((127 - 7) << 23));
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<20>(rebased), _mm512_set1_epi32(1));
        let rounded = _mm512_add_epi32(_mm512_add_epi32(rebased, _mm512_set1_epi32(0x7FFFF)), lsb);
        let normal = _mm512_min_epi32(_mm512_srli_epi32::<20>(rounded), _mm512_set1_epi32(0x7E));
        let sub = _mm512_cvtps_epi32(_mm512_roundscale_ps::<
            { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
        >(_mm512_mul_ps(x, _mm512_set1_ps(512.0))));
        let below_normal = _mm512_cmplt_epi32_mask(abs_bits, _mm512_set1_epi32(121 << 23));
        let code = _mm512_mask_blend_epi32(below_normal, normal, sub);
        let sign = _mm512_and_si512(_mm512_srli_epi32::<24>(bits), _mm512_set1_epi32(0x80));
        let is_nan = _mm512_cmpgt_epi32_mask(abs_bits, _mm512_set1_epi32(0x7F80_0000));
        let code = _mm512_mask_blend_epi32(is_nan, code, _mm512_set1_epi32(0x7F));
        _mm512_or_si512(code, sign)
    }

    /// The 16 × 16 transpose: `out[e]` lane `j` = `rows[j]` lane `e`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose16(rows: [__m512; 16]) -> [__m512; 16] {
        let r = rows;
        let t: [__m512; 16] = std::array::from_fn(|i| {
            let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_ps(a, b)
            } else {
                _mm512_unpackhi_ps(a, b)
            }
        });
        // t[2p] = a0 b0 a1 b1 | a4 b4 a5 b5 | ..., t[2p+1] = a2 b2 a3 b3 | ...
        let u: [__m512; 16] = std::array::from_fn(|i| {
            let base = 4 * (i / 4) + (i % 2);
            let (a, b) = (t[base], t[base + 2]);
            let ad = _mm512_castps_pd(a);
            let bd = _mm512_castps_pd(b);
            if (i / 2) % 2 == 0 {
                _mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd))
            } else {
                _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd))
            }
        });
        // u[4q + c] holds, per 128-bit lane l, element 4l + c' of rows 4q..4q+4 (c' below).
        let v: [__m512; 16] = std::array::from_fn(|i| {
            let base = 8 * (i / 8) + (i % 4);
            let (a, b) = (u[base], u[base + 4]);
            if (i / 4) % 2 == 0 {
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b)
            } else {
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b)
            }
        });
        let w: [__m512; 16] = std::array::from_fn(|i| {
            let base = i % 8;
            let (a, b) = (v[base], v[base + 8]);
            if i / 8 == 0 {
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b)
            } else {
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b)
            }
        });
        std::array::from_fn(|e| w[low_bits_swapped(e)])
    }

    /// The AVX-512 VNNI tile loop. One token (decode) against rows of at least
    /// [`ONE_ROW_MIN_COLS`] takes them one at a time ([`vnni_row`]); otherwise four at a time
    /// ([`vnni_rows4`]; a last partial four repeats its final row and drops the copies).
    ///
    /// Why one row at a time at decode: the four-row kernel reads four rows side by side,
    /// jumping between them every 128 bytes, and the CPU's own prefetchers follow that poorly
    /// (without the software prefetch it ran at 0.45× on Zen 5). Row by row, the reads are one
    /// ascending stream and more of the arithmetic hides under it, although the arithmetic
    /// alone costs more (the activations are loaded once per row instead of once per four).
    /// Rows of a few hundred columns keep the four-row kernel: four of them span less than a
    /// KB, and their arithmetic, half of it on a partial group, is what limits them. Routed
    /// experts at decode on Zen 5 (`examples/moe_decode_speed`, 24 rounds alternating
    /// in one process, cold, median share of the read bandwidth): four rows 0.66, one row
    /// everywhere 0.75, one row from 1024 columns (this) 0.79. Every row's sums are the same
    /// operations in the same order either way (the same bits).
    ///
    /// # Safety
    /// AVX-512F/BW/VL/VNNI; `rows` within `w`, `x` holds `g ≤ 4` quantized rows of `w.cols`,
    /// `out` holds `(g − 1) · stride + rows.len()` floats.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn rows_vnni(
        w: &Nvfp4View<'_>,
        rows: Range<usize>,
        x: &IntActs<'_>,
        g: usize,
        row_scale: f32,
        out: &mut [f32],
        stride: usize,
    ) {
        let hint = PrefetchReach::current().hint();
        // The kernels' sums are short of the canonical ones by exactly this factor.
        let row_scale = row_scale * E4M3_AS_F16_SHORTFALL;
        if g == 1 && w.cols >= ONE_ROW_MIN_COLS {
            let (decoder, acts) = (VnniDecoder::new(), ActRows::new(x));
            for (out, r) in out.iter_mut().zip(rows) {
                // SAFETY: forwarded from this function's contract.
                *out = unsafe { vnni_row(w, r, decoder, acts, hint) } * row_scale;
            }
            return;
        }
        let mut r = rows.start;
        while r < rows.end {
            let four = std::array::from_fn(|i| (r + i).min(rows.end - 1));
            // SAFETY: forwarded from this function's contract.
            let v = unsafe {
                match g {
                    1 => vnni_rows4::<1>(w, four, x, hint),
                    2 => vnni_rows4::<2>(w, four, x, hint),
                    3 => vnni_rows4::<3>(w, four, x, hint),
                    4 => vnni_rows4::<4>(w, four, x, hint),
                    _ => unreachable!("group of {g}"),
                }
            };
            let j = r - rows.start;
            let take = 4.min(rows.end - r);
            for (t, v) in v.iter().enumerate().take(g) {
                for (i, &s) in v.iter().enumerate().take(take) {
                    out[t * stride + j + i] = s * row_scale;
                }
            }
            r += 4;
        }
    }

    /// What the VNNI kernels decode weights with: the `2·e2m1` table, the nibble mask, and the
    /// permutations that put bytes 0–3 (`even`) and 4–7 (`odd`) of block `j` of a 128-byte
    /// group into 32-bit lane `j`.
    #[derive(Clone, Copy)]
    struct VnniDecoder {
        table: __m512i,
        nibble: __m512i,
        even: __m512i,
        odd: __m512i,
    }

    impl VnniDecoder {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
        fn new() -> Self {
            Self {
                // SAFETY: WEIGHT_TABLE holds 16 bytes.
                table: _mm512_broadcast_i32x4(unsafe {
                    _mm_loadu_si128(WEIGHT_TABLE.as_ptr().cast())
                }),
                nibble: _mm512_set1_epi8(0x0F),
                even: _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                odd: _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31),
            }
        }

        /// A row's group of 128 packed bytes (`p0`, `p1`: its two halves) as `2·e2m1` bytes
        /// in four vectors, lane `j` of each holding four elements of block `j` in the order
        /// of the activations' codes ([`code_position`](super::code_position)).
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
        fn weights(self, p0: __m512i, p1: __m512i) -> [__m512i; 4] {
            let q0 = _mm512_permutex2var_epi32(p0, self.even, p1);
            let q1 = _mm512_permutex2var_epi32(p0, self.odd, p1);
            let q0h = _mm512_srli_epi16::<4>(q0);
            let q1h = _mm512_srli_epi16::<4>(q1);
            let code = |q| _mm512_shuffle_epi8(self.table, _mm512_and_si512(q, self.nibble));
            [code(q0), code(q0h), code(q1), code(q1h)]
        }
    }

    /// Where the VNNI kernels read a group's activations: `x`'s codes, corrections and scales,
    /// and the padded length of one token's row of each.
    #[derive(Clone, Copy)]
    struct ActRows {
        codes: *const i8,
        corr: *const i32,
        scales: *const f32,
        padded_cols: usize,
        padded_blocks: usize,
    }

    impl ActRows {
        fn new(x: &IntActs<'_>) -> Self {
            Self {
                codes: x.codes.as_ptr(),
                corr: x.corr.as_ptr(),
                scales: x.scales.as_ptr(),
                padded_cols: padded_cols(x.cols),
                padded_blocks: padded_blocks(x.cols),
            }
        }
    }

    /// `acc` plus group `g`'s block products: lane `j` gets block `j`'s exact integer dot of
    /// the weights `wv` against token `t` (with its correction), converted to f32, times the
    /// weight block scale `sw` and the activation block scale.
    ///
    /// # Safety
    /// As for [`rows_vnni`]: `x` holds token `t`'s padded row, and `g` is one of its groups.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn accumulate_group(
        acc: __m512,
        wv: &[__m512i; 4],
        sw: __m512,
        x: ActRows,
        t: usize,
        g: usize,
    ) -> __m512 {
        let lane = t * x.padded_blocks + g * GROUP_BLOCKS;
        // SAFETY: token t's padded row holds group g's 256 codes, 16 corrections and 16 scales.
        unsafe {
            let xt = x.codes.add(t * x.padded_cols + g * GROUP_ELEMENTS);
            let mut d = _mm512_loadu_si512(x.corr.add(lane).cast());
            d = _mm512_dpbusd_epi32(d, wv[0], _mm512_loadu_si512(xt.cast()));
            d = _mm512_dpbusd_epi32(d, wv[1], _mm512_loadu_si512(xt.add(64).cast()));
            d = _mm512_dpbusd_epi32(d, wv[2], _mm512_loadu_si512(xt.add(128).cast()));
            d = _mm512_dpbusd_epi32(d, wv[3], _mm512_loadu_si512(xt.add(192).cast()));
            let s = _mm512_mul_ps(sw, _mm512_loadu_ps(x.scales.add(lane)));
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc)
        }
    }

    /// Prefetches into `hint`'s cache the lines [`PREFETCH_BYTES`] past a row's group `g` at
    /// `p` (its packed bytes; `lines` of them: two for a whole group) and, every fourth group,
    /// the line an eighth of that past its scales at `s` (never faults, even past the matrix).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    fn prefetch_group(p: *const u8, s: *const u8, g: usize, lines: usize, hint: PrefetchHint) {
        let ahead = p.wrapping_add(PREFETCH_BYTES);
        hint.line(ahead);
        if lines > 1 {
            hint.line(ahead.wrapping_add(64));
        }
        if g.is_multiple_of(4) {
            hint.line(s.wrapping_add(PREFETCH_BYTES / (NVFP4_BLOCK / 2)));
        }
    }

    /// The masks that read a row's last, partial group in place: its packed bytes (`m0`,
    /// `m1`: the two 64-byte halves) and its scales (`ms`), for a row of `blocks` blocks of
    /// which `full` whole groups come first; and how many packed bytes that group holds.
    /// Masked-out bytes load as zero and are never touched, so nothing past the row is read;
    /// zero codes and zero scales add nothing, as the zero-padded activations' correction is
    /// zero.
    fn tail_masks(blocks: usize, full: usize) -> (u64, u64, u16, usize) {
        let bytes = (blocks - full * GROUP_BLOCKS) * NVFP4_BLOCK / 2;
        let low = |n: usize| if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
        let ms = ((1u32 << (bytes / 8)) - 1) as u16;
        (low(bytes), low(bytes.saturating_sub(64)), ms, bytes)
    }

    /// One weight row against one token: `Σ_b dot · sw · sa` of row `r` (before the row
    /// scale), in the operations and order of [`vnni_rows4`]'s sums (the same bits).
    ///
    /// # Safety
    /// As for [`rows_vnni`], with one token (`acts`) and `r < w.rows`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn vnni_row(
        w: &Nvfp4View<'_>,
        r: usize,
        decoder: VnniDecoder,
        acts: ActRows,
        hint: PrefetchHint,
    ) -> f32 {
        let cols = w.cols;
        let blocks = cols / NVFP4_BLOCK;
        let full = blocks / GROUP_BLOCKS;
        // SAFETY: r lies within w (the caller's contract), so these are in bounds.
        let (packed, scales) = unsafe {
            (
                w.packed.as_ptr().add(r * cols / 2),
                w.block_scales.as_ptr().add(r * blocks),
            )
        };
        let mut acc = _mm512_setzero_ps();
        for g in 0..full {
            let (p, s) = (
                packed.wrapping_add(g * GROUP_BYTES),
                scales.wrapping_add(g * GROUP_BLOCKS),
            );
            prefetch_group(p, s, g, 2, hint);
            // SAFETY: group g < full of row r: 128 packed bytes and 16 scales in `w`; token 0
            // of x holds group g.
            unsafe {
                let wv = decoder.weights(
                    _mm512_loadu_si512(p.cast()),
                    _mm512_loadu_si512(p.add(64).cast()),
                );
                acc = accumulate_group(
                    acc,
                    &wv,
                    e4m3x16_scaled(_mm_loadu_si128(s.cast())),
                    acts,
                    0,
                    g,
                );
            }
        }
        if full * GROUP_BLOCKS < blocks {
            let (m0, m1, ms, bytes) = tail_masks(blocks, full);
            let (p, s) = (
                packed.wrapping_add(full * GROUP_BYTES),
                scales.wrapping_add(full * GROUP_BLOCKS),
            );
            // The tail's packed lines only: its scales are the ones the last whole group's
            // prefetch (or the row before's) covered.
            prefetch_group(p, s, 1, bytes.div_ceil(64), hint);
            // SAFETY: the masks cover the row's last `bytes` packed bytes and `bytes / 8`
            // scales, which lie within `w`; masked-out elements are not accessed.
            unsafe {
                let wv = decoder.weights(
                    _mm512_maskz_loadu_epi8(m0, p.cast()),
                    _mm512_maskz_loadu_epi8(m1, p.wrapping_add(64).cast()),
                );
                let sw = e4m3x16_scaled(_mm_maskz_loadu_epi8(ms, s.cast()));
                acc = accumulate_group(acc, &wv, sw, acts, 0, full);
            }
        }
        reduce1(acc)
    }

    /// Four weight rows against `N ≤ 4` tokens: `out[t][i] = Σ_b dot · sw · sa` of row
    /// `rows[i]` (before the row scale).
    ///
    /// # Safety
    /// As for [`rows_vnni`], with `N` tokens.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn vnni_rows4<const N: usize>(
        w: &Nvfp4View<'_>,
        rows: [usize; 4],
        x: &IntActs<'_>,
        hint: PrefetchHint,
    ) -> [[f32; 4]; 4] {
        let cols = w.cols;
        let (decoder, acts) = (VnniDecoder::new(), ActRows::new(x));
        let blocks = cols / NVFP4_BLOCK;
        let full = blocks / GROUP_BLOCKS;
        // SAFETY: every row lies within w (the caller's contract), so these are in bounds.
        let row_packed = rows.map(|r| unsafe { w.packed.as_ptr().add(r * cols / 2) });
        let row_scales = rows.map(|r| unsafe { w.block_scales.as_ptr().add(r * blocks) });
        let mut acc = [[_mm512_setzero_ps(); 4]; N];
        // One row's group: decode, then every token. A macro rather than a loop over the rows,
        // so that the accumulator index is a constant and all 16 stay in registers.
        macro_rules! row_group {
            ($i:literal, $p0:expr, $p1:expr, $scales:expr, $g:expr) => {{
                let wv = decoder.weights($p0, $p1);
                let sw = e4m3x16_scaled($scales);
                for (t, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: x holds N padded rows, and $g is one of their groups.
                    acc[$i] = unsafe { accumulate_group(acc[$i], &wv, sw, acts, t, $g) };
                }
            }};
        }
        for g in 0..full {
            let p = row_packed.map(|p| p.wrapping_add(g * GROUP_BYTES));
            let s = row_scales.map(|s| s.wrapping_add(g * GROUP_BLOCKS));
            for (&p, &s) in p.iter().zip(&s) {
                prefetch_group(p, s, g, 2, hint);
            }
            // SAFETY: group g < full of every row: 128 packed bytes and 16 scales in `w`.
            let (p0, p1, sc) = unsafe {
                (
                    p.map(|p| _mm512_loadu_si512(p.cast())),
                    p.map(|p| _mm512_loadu_si512(p.add(64).cast())),
                    s.map(|s| _mm_loadu_si128(s.cast())),
                )
            };
            row_group!(0, p0[0], p1[0], sc[0], g);
            row_group!(1, p0[1], p1[1], sc[1], g);
            row_group!(2, p0[2], p1[2], sc[2], g);
            row_group!(3, p0[3], p1[3], sc[3], g);
        }
        if full * GROUP_BLOCKS < blocks {
            let (m0, m1, ms, bytes) = tail_masks(blocks, full);
            let p = row_packed.map(|p| p.wrapping_add(full * GROUP_BYTES));
            let s = row_scales.map(|s| s.wrapping_add(full * GROUP_BLOCKS));
            // The tail's lines too: the whole groups' prefetches cover two lines of each row
            // per group, which misses every third line of a 384-column row.
            for (&p, &s) in p.iter().zip(&s) {
                prefetch_group(p, s, 1, bytes.div_ceil(64), hint);
            }
            // SAFETY: the masks cover the row's last `bytes` packed bytes and `bytes / 8`
            // scales, which lie within `w`; masked-out elements are not accessed.
            let (p0, p1, sc) = unsafe {
                (
                    p.map(|p| _mm512_maskz_loadu_epi8(m0, p.cast())),
                    p.map(|p| _mm512_maskz_loadu_epi8(m1, p.wrapping_add(64).cast())),
                    s.map(|s| _mm_maskz_loadu_epi8(ms, s.cast())),
                )
            };
            row_group!(0, p0[0], p1[0], sc[0], full);
            row_group!(1, p0[1], p1[1], sc[1], full);
            row_group!(2, p0[2], p1[2], sc[2], full);
            row_group!(3, p0[3], p1[3], sc[3], full);
        }
        let mut sums = [[0.0f32; 4]; 4];
        for (s, a) in sums.iter_mut().zip(&acc) {
            *s = reduce4(*a);
        }
        sums
    }

    /// The AVX2 tile loop: one weight row at a time, `g ≤ 4` tokens.
    ///
    /// # Safety
    /// AVX2 and FMA; otherwise as for [`rows_vnni`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_avx2(
        w: &Nvfp4View<'_>,
        rows: Range<usize>,
        x: &IntActs<'_>,
        g: usize,
        row_scale: f32,
        out: &mut [f32],
        stride: usize,
    ) {
        let ahead = avx2_prefetch_bytes(w.cols);
        let hint = PrefetchReach::current().for_isa(Isa::Avx2Fma).hint();
        for (j, r) in rows.enumerate() {
            // SAFETY: forwarded from this function's contract.
            let v = unsafe {
                match g {
                    1 => avx2_row::<1>(w, r, x, ahead, hint),
                    2 => avx2_row::<2>(w, r, x, ahead, hint),
                    3 => avx2_row::<3>(w, r, x, ahead, hint),
                    4 => avx2_row::<4>(w, r, x, ahead, hint),
                    _ => unreachable!("group of {g}"),
                }
            };
            for (t, &v) in v.iter().enumerate().take(g) {
                out[t * stride + j] = v * row_scale;
            }
        }
    }

    /// Registers of one decoded half-group: the four byte planes of `2·e2m1 + 12` weights and
    /// the eight block scales.
    const HALF: usize = 5;

    /// The four byte planes of `2·e2m1 + 12` weights (through `table`) of the half-group whose
    /// 64 packed bytes start at `packed`: 64-bit chunks (b0,b1), (b4,b5) | (b2,b3), (b6,b7),
    /// then in block order, low and high nibbles of each.
    ///
    /// # Safety
    /// AVX2 (inlined into the callers' AVX2 bodies); 64 bytes readable at `packed`.
    #[inline(always)]
    unsafe fn decode_half(packed: *const u8, table: __m256i, nibble: __m256i) -> [__m256i; 4] {
        // SAFETY: the caller's contract.
        unsafe {
            let p0 = _mm256_loadu_si256(packed.cast());
            let p1 = _mm256_loadu_si256(packed.add(32).cast());
            let q = |even: bool| {
                let s = if even {
                    _mm256_shuffle_ps::<0b10_00_10_00>(
                        _mm256_castsi256_ps(p0),
                        _mm256_castsi256_ps(p1),
                    )
                } else {
                    _mm256_shuffle_ps::<0b11_01_11_01>(
                        _mm256_castsi256_ps(p0),
                        _mm256_castsi256_ps(p1),
                    )
                };
                _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_castps_si256(s))
            };
            let (q0, q1) = (q(true), q(false));
            let lo = |q| _mm256_shuffle_epi8(table, _mm256_and_si256(q, nibble));
            let hi =
                |q| _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(q), nibble));
            [lo(q0), hi(q0), lo(q1), hi(q1)]
        }
    }

    /// Weight row `r` decoded for [`avx2_row_decoded`]: per group and half, the four byte
    /// planes and the block scales ([`HALF`] registers), as [`avx2_row`] decodes them in
    /// registers; a half tail is one half, any other tail the zero-padded copy's two.
    ///
    /// # Safety
    /// AVX2 and FMA; `r < w.rows`; `dst` holds [`HALF`] registers per half of the row's groups.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_decode_row(w: &Nvfp4View<'_>, r: usize, dst: &mut [__m256]) -> usize {
        let cols = w.cols;
        let groups = padded_blocks(cols) / GROUP_BLOCKS;
        let blocks = cols / NVFP4_BLOCK;
        let full = blocks / GROUP_BLOCKS;
        // SAFETY: WEIGHT_TABLE holds 16 bytes.
        let table =
            _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(WEIGHT_TABLE.as_ptr().cast()) });
        let nibble = _mm256_set1_epi8(0x0F);
        let half_tail = blocks % GROUP_BLOCKS == GROUP_BLOCKS / 2;
        let tail = if full < groups && !half_tail {
            tail_group(w, r, full)
        } else {
            ([0; GROUP_BYTES], [0; GROUP_BLOCKS])
        };
        // SAFETY: row r lies within w (the caller's contract).
        let (row_packed, row_scales) = unsafe {
            (
                w.packed.as_ptr().add(r * cols / 2),
                w.block_scales.as_ptr().add(r * blocks),
            )
        };
        let mut n = 0;
        for g in 0..groups {
            // SAFETY: as in avx2_row.
            unsafe {
                let (packed, scales) = if g < full || half_tail {
                    (
                        row_packed.add(g * GROUP_BYTES),
                        row_scales.add(g * GROUP_BLOCKS),
                    )
                } else {
                    (tail.0.as_ptr(), tail.1.as_ptr())
                };
                let halves = if g < full || !half_tail { 2 } else { 1 };
                for h in 0..halves {
                    let d = &mut dst[HALF * n..HALF * (n + 1)];
                    let planes = decode_half(packed.add(64 * h), table, nibble);
                    for (d, p) in d.iter_mut().zip(planes) {
                        *d = _mm256_castsi256_ps(p);
                    }
                    d[4] = e4m3x8(_mm_loadl_epi64(scales.add(8 * h).cast()));
                    n += 1;
                }
            }
        }
        n
    }

    /// The AVX2 loop for more than [`INT_GROUP`](super::INT_GROUP) tokens: each weight row is
    /// decoded once ([`avx2_decode_row`]) and then serves every group of four tokens
    /// ([`avx2_row_decoded`]), where [`rows_avx2`] decodes it again for every group. Same
    /// bits: the same operations on the same decoded values.
    ///
    /// # Safety
    /// As for [`rows_avx2`], with `n` tokens in `x`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_avx2_decoded(
        w: &Nvfp4View<'_>,
        rows: Range<usize>,
        x: &IntActs<'_>,
        n: usize,
        row_scale: f32,
        out: &mut [f32],
        stride: usize,
    ) {
        let halves = 2 * padded_blocks(w.cols) / GROUP_BLOCKS;
        let mut decoded = vec![_mm256_setzero_ps(); HALF * halves];
        for (j, r) in rows.enumerate() {
            // SAFETY: forwarded from this function's contract.
            let used = unsafe { avx2_decode_row(w, r, &mut decoded) };
            let decoded = &decoded[..HALF * used];
            for t0 in (0..n).step_by(super::INT_GROUP) {
                let g = super::INT_GROUP.min(n - t0);
                let xg = x.rows_from(t0);
                // SAFETY: forwarded from this function's contract.
                let v = unsafe {
                    match g {
                        1 => avx2_row_decoded::<1>(decoded, w.cols, &xg),
                        2 => avx2_row_decoded::<2>(decoded, w.cols, &xg),
                        3 => avx2_row_decoded::<3>(decoded, w.cols, &xg),
                        4 => avx2_row_decoded::<4>(decoded, w.cols, &xg),
                        _ => unreachable!("group of {g}"),
                    }
                };
                for (t, &v) in v.iter().enumerate().take(g) {
                    out[(t0 + t) * stride + j] = v * row_scale;
                }
            }
        }
    }

    /// [`avx2_row`]'s token loop over a decoded row.
    ///
    /// # Safety
    /// AVX2 and FMA; `decoded` is a row of `cols` columns from [`avx2_decode_row`], `x` holds
    /// `N` rows.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_row_decoded<const N: usize>(
        decoded: &[__m256],
        cols: usize,
        x: &IntActs<'_>,
    ) -> [f32; 4] {
        let (pc, pb) = (padded_cols(cols), padded_blocks(cols));
        let ones = _mm256_set1_epi16(1);
        let (codes, corr, sa) = (x.codes.as_ptr(), x.corr.as_ptr(), x.scales.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for (i, half) in decoded.chunks_exact(HALF).enumerate() {
            let (g, h) = (i / 2, i % 2);
            let wv = [
                _mm256_castps_si256(half[0]),
                _mm256_castps_si256(half[1]),
                _mm256_castps_si256(half[2]),
                _mm256_castps_si256(half[3]),
            ];
            let sw = half[4];
            for (t, acc) in acc.iter_mut().enumerate() {
                // SAFETY: token t's codes, corrections and scales of half h of group g lie
                // inside x's padded rows.
                unsafe {
                    let xt = codes.add(t * pc + g * GROUP_ELEMENTS + 32 * h);
                    let mut s16 = _mm256_setzero_si256();
                    for (k, &wk) in wv.iter().enumerate() {
                        let a = _mm256_loadu_si256(xt.add(64 * k).cast());
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wk, a));
                    }
                    let lane = t * pb + g * GROUP_BLOCKS + 8 * h;
                    let d = _mm256_add_epi32(
                        _mm256_madd_epi16(s16, ones),
                        _mm256_loadu_si256(corr.add(lane).cast()),
                    );
                    let s = _mm256_mul_ps(sw, _mm256_loadu_ps(sa.add(lane)));
                    acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[h]);
                }
            }
        }
        reduce_halves(&acc)
    }

    /// Each token's two halves summed as [`avx2_row`] sums them.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn reduce_halves<const N: usize>(acc: &[[__m256; 2]; N]) -> [f32; 4] {
        let mut sums = [0.0f32; 4];
        for (o, a) in sums.iter_mut().zip(acc) {
            let v = _mm256_add_ps(a[0], a[1]);
            let h = _mm256_hadd_ps(v, v);
            let h = _mm256_hadd_ps(h, h);
            *o = _mm_cvtss_f32(_mm_add_ss(
                _mm256_castps256_ps128(h),
                _mm256_extractf128_ps(h, 1),
            ));
        }
        sums
    }

    /// One weight row against `N ≤ 4` tokens, a group as two halves of 8 blocks; lane `j` of
    /// half `h` is lane `8h + j` of the AVX-512 kernel, so the sums are the same. Each group
    /// prefetches `ahead_bytes` ahead ([`avx2_prefetch_bytes`], looked up once per call) into
    /// `hint`'s cache.
    ///
    /// # Safety
    /// As for [`rows_avx2`], with `N` tokens.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_row<const N: usize>(
        w: &Nvfp4View<'_>,
        r: usize,
        x: &IntActs<'_>,
        ahead_bytes: usize,
        hint: PrefetchHint,
    ) -> [f32; 4] {
        let cols = w.cols;
        let groups = padded_blocks(cols) / GROUP_BLOCKS;
        let (pc, pb) = (padded_cols(cols), padded_blocks(cols));
        // SAFETY: WEIGHT_TABLE holds 16 bytes.
        let table =
            _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(WEIGHT_TABLE.as_ptr().cast()) });
        let nibble = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let (codes, corr, sa) = (x.codes.as_ptr(), x.corr.as_ptr(), x.scales.as_ptr());
        let blocks = cols / NVFP4_BLOCK;
        let full = blocks / GROUP_BLOCKS;
        // Only a ragged row has a tail group. A tail of exactly one half (8 blocks: rows of
        // 384 or 2048 + 128 columns) is read in place, its empty second half skipped; any
        // other is read from a zero-padded copy.
        let half_tail = blocks % GROUP_BLOCKS == GROUP_BLOCKS / 2;
        let tail = if full < groups && !half_tail {
            tail_group(w, r, full)
        } else {
            ([0; GROUP_BYTES], [0; GROUP_BLOCKS])
        };
        // SAFETY: row r lies within w (the caller's contract).
        let (row_packed, row_scales) = unsafe {
            (
                w.packed.as_ptr().add(r * cols / 2),
                w.block_scales.as_ptr().add(r * blocks),
            )
        };
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for g in 0..groups {
            // SAFETY: as in vnni_rows4; a half tail is read in place for its first half only,
            // whose 64 packed bytes and 8 scales end the row.
            unsafe {
                let (packed, scales) = if g < full || half_tail {
                    (
                        row_packed.add(g * GROUP_BYTES),
                        row_scales.add(g * GROUP_BLOCKS),
                    )
                } else {
                    (tail.0.as_ptr(), tail.1.as_ptr())
                };
                let ahead = packed.wrapping_add(ahead_bytes);
                hint.line(ahead);
                hint.line(ahead.wrapping_add(64));
                let halves = if g < full || !half_tail { 2 } else { 1 };
                for h in 0..halves {
                    let wv = decode_half(packed.add(64 * h), table, nibble);
                    let sw = e4m3x8(_mm_loadl_epi64(scales.add(8 * h).cast()));
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let xt = codes.add(t * pc + g * GROUP_ELEMENTS + 32 * h);
                        let mut s16 = _mm256_setzero_si256();
                        for (k, &wk) in wv.iter().enumerate() {
                            let a = _mm256_loadu_si256(xt.add(64 * k).cast());
                            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wk, a));
                        }
                        let lane = t * pb + g * GROUP_BLOCKS + 8 * h;
                        let d = _mm256_add_epi32(
                            _mm256_madd_epi16(s16, ones),
                            _mm256_loadu_si256(corr.add(lane).cast()),
                        );
                        let s = _mm256_mul_ps(sw, _mm256_loadu_ps(sa.add(lane)));
                        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[h]);
                    }
                }
            }
        }
        reduce_halves(&acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::nvfp4::{Nvfp4Matrix, fake_quantize_row};
    use crate::rng::Rng;

    /// Quantized activation rows, owned.
    struct Quantized {
        cols: usize,
        codes: Vec<i8>,
        corr: Vec<i32>,
        scales: Vec<f32>,
        input_scale: f32,
    }

    impl Quantized {
        fn new(x: &[f32], cols: usize, input_scale: f32) -> Self {
            Self::with_isa(Isa::detect(), x, cols, input_scale)
        }

        fn with_isa(isa: Isa, x: &[f32], cols: usize, input_scale: f32) -> Self {
            let n = x.len() / cols;
            let (pc, pb) = (padded_cols(cols), padded_blocks(cols));
            // Garbage first: the quantizer must write every element, padding included.
            let mut q = Self {
                cols,
                codes: vec![0x55; n * pc],
                corr: vec![-7; n * pb],
                scales: vec![f32::NAN; n * pb],
                input_scale,
            };
            for (t, row) in x.chunks_exact(cols).enumerate() {
                quantize_row_int_with(
                    isa,
                    row,
                    input_scale,
                    &mut q.codes[t * pc..(t + 1) * pc],
                    &mut q.corr[t * pb..(t + 1) * pb],
                    &mut q.scales[t * pb..(t + 1) * pb],
                );
            }
            q
        }

        fn acts(&self) -> IntActs<'_> {
            IntActs {
                cols: self.cols,
                codes: &self.codes,
                corr: &self.corr,
                scales: &self.scales,
                input_scale: self.input_scale,
            }
        }
    }

    #[test]
    fn code_positions_are_a_permutation_of_each_group() {
        let mut seen = vec![false; 2 * GROUP_ELEMENTS];
        for b in 0..2 * GROUP_BLOCKS {
            for e in 0..NVFP4_BLOCK {
                let p = code_position(b, e);
                assert!(!seen[p], "block {b} element {e} collides at {p}");
                assert_eq!(p / GROUP_ELEMENTS, b / GROUP_BLOCKS);
                seen[p] = true;
            }
        }
    }

    #[test]
    fn the_magnitude_arithmetic_is_the_table() {
        for ordinal in 0u8..8 {
            assert_eq!(
                magnitude_twice(ordinal),
                MAGNITUDE_TWICE[usize::from(ordinal)],
                "ordinal {ordinal}"
            );
        }
    }

    #[test]
    fn integer_activations_are_the_fake_quantized_values_bit_for_bit() {
        let mut rng = Rng(5);
        // Ordinary values at several magnitudes, exact E2M1 midpoints, signed zeros, tiny
        // negatives (the "−0" code), infinities and NaN.
        let cols = 4096 + 48;
        let mut values: Vec<f32> = (0..cols)
            .map(|i| rng.sym() * [1.0, 1e-3, 40.0, 1e-7][i / 16 % 4])
            .collect();
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
        for (scale, isa) in [1.0 / 2688.0, 1.0 / 16.0, 1e-6, 0.37]
            .into_iter()
            .flat_map(|s| Isa::all_supported().into_iter().map(move |isa| (s, isa)))
        {
            let mut want = vec![0.0; cols];
            fake_quantize_row(&values, scale, &mut want);
            let q = Quantized::with_isa(isa, &values, cols, scale);
            let acts = q.acts();
            for (c, &want) in want.iter().enumerate() {
                let got = acts.value(0, c);
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{isa:?} scale {scale} element {c} ({}): {got:e} vs {want:e}",
                    values[c]
                );
            }
            // The corrections are −12 × each block's code sum; the padding is zero.
            for b in 0..padded_blocks(cols) {
                let sum: i32 = (0..NVFP4_BLOCK)
                    .map(|e| i32::from(q.codes[code_position(b, e)]))
                    .sum();
                assert_eq!(q.corr[b], -WEIGHT_OFFSET * sum, "block {b}");
                if b >= cols / NVFP4_BLOCK {
                    assert_eq!((sum, q.scales[b]), (0, 0.0), "padding block {b}");
                }
            }
        }
    }

    /// The scalar integer reference of a whole row: exact block dots from the unpacked codes,
    /// their exact products with the block scales in lane `b mod 16`, the [`reduce16`] tree.
    fn integer_reference(w: &Nvfp4View<'_>, r: usize, x: &IntActs<'_>, t: usize) -> f32 {
        let blocks = w.cols / NVFP4_BLOCK;
        let mut lanes = [0.0f32; GROUP_BLOCKS];
        for b in 0..blocks {
            let dot = block_dot(w, r, x, t, b);
            let s = e4m3_to_f32(w.block_scales[r * blocks + b]) as f64
                * x.scales[t * padded_blocks(x.cols) + b] as f64;
            // The product computed in f64 is the f32 product: it is exact in both.
            let term = dot as f64 * s;
            assert_eq!(
                term as f32 as f64, term,
                "block {b}: the product is not exact"
            );
            lanes[b % GROUP_BLOCKS] += term as f32;
        }
        reduce16(&lanes) * (x.input_scale * w.global_scale * 0.25)
    }

    /// Weights with ragged block counts, random codes and a spread of block scales.
    fn weights(rng: &mut Rng, rows: usize, cols: usize) -> Nvfp4Matrix {
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| rng.sym() * [1.0, 0.01, 30.0][i / 16 % 3])
            .collect();
        Nvfp4Matrix::quantize_weight(&values, rows, cols).unwrap()
    }

    fn check_shape(rng: &mut Rng, rows: usize, cols: usize, n: usize, scale: f32) {
        let wm = weights(rng, rows, cols);
        let w = wm.view();
        let deq = wm.dequantize();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.sym() * 3.0).collect();
        let q = Quantized::new(&x, cols, scale);
        let acts = q.acts();
        // Rows 1.. into a wider stride: the rest of `out` must stay untouched.
        let sub = if rows > 1 { 1..rows } else { 0..rows };
        let stride = sub.len() + 1;
        let blocks = cols / NVFP4_BLOCK;
        // Roundings after the exact products: (blocks/16 − 1) sequential adds per lane, 4 in
        // the tree, the row scale (1) and its product (1), and the reference's two rounded
        // dequantization factors (2), each at most 2⁻²⁴ of the absolute mass.
        let bound_ulps = (blocks.div_ceil(GROUP_BLOCKS) + 8) as f64;
        for isa in Isa::all_supported() {
            let mut out = vec![f32::NAN; n * stride];
            nvfp4_rows_dots_int(isa, &w, sub.clone(), &acts, n, &mut out, stride);
            for t in 0..n {
                assert!(
                    out[t * stride + sub.len()].is_nan(),
                    "{isa:?}: wrote past the tile"
                );
                for r in sub.clone() {
                    let got = out[t * stride + r - sub.start];
                    let want = integer_reference(&w, r, &acts, t);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{isa:?} rows {rows} cols {cols} n {n} row {r} token {t}: {got} vs {want}"
                    );
                    // Against dequantize-then-multiply in f64.
                    let (mut exact, mut mass) = (0.0f64, 0.0f64);
                    for c in 0..cols {
                        let p = acts.value(t, c) as f64 * deq[r * cols + c] as f64;
                        exact += p;
                        mass += p.abs();
                    }
                    let err = (got as f64 - exact).abs();
                    assert!(
                        err <= bound_ulps * f64::from(f32::EPSILON) / 2.0 * mass,
                        "{isa:?} cols {cols} row {r} token {t}: {got} vs {exact} (mass {mass})"
                    );
                }
            }
        }
    }

    #[test]
    fn every_isa_equals_the_integer_reference_and_the_w4a4_dot() {
        let mut rng = Rng(9);
        // Whole groups, partial groups (half a group: read in place by AVX2), Kimi's rows and
        // a TP8 down row; token counts around the group of four.
        for (rows, cols) in [
            (9, 16),
            (7, 48),
            (3, 128),
            (5, 256),
            (6, 272),
            (5, 384),
            (9, 7168),
            (4, 2048),
        ] {
            for n in [1, 3, 4, 5, 9] {
                check_shape(&mut rng, rows, cols, n, 1.0 / 2688.0);
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
        #[test]
        fn ragged_shapes_agree_everywhere(
            rows in 1usize..11,
            blocks in 1usize..70,
            n in 1usize..10,
            seed in 0u64..1_000_000,
            scale_exp in -20i32..4,
        ) {
            let mut rng = Rng(seed);
            check_shape(&mut rng, rows, blocks * NVFP4_BLOCK, n, 2f32.powi(scale_exp) * 0.7);
        }
    }
}

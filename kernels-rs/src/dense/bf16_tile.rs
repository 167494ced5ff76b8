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
//! The order of the previous AVX-512 kernel, so that the model's numerics (checked against
//! HF's goldens, where one flipped NVFP4 code or expert choice shows) stay what they were:
//! element `i < ⌊cols/64⌋·64` goes into lane `i mod 16` of accumulator set `(i / 16) mod 4`
//! by a fused multiply-add, in increasing `i`; the sets are added lane-wise as
//! `(a0 + a1) + (a2 + a3)`; the 16 lanes are summed by the tree `s8[l] = a[l] + a[l+8]`,
//! `s4[l] = s8[l] + s8[l+4]`, `s2[l] = s4[l] + s4[l+2]`, `s = s2[0] + s2[1]`; the last
//! `cols mod 64` elements are added to `s` in order (multiply, then add). AVX-512 holds a set
//! in one `zmm`, AVX2 in two `ymm` (lanes 0–7, 8–15), the portable code in an array with
//! `f32::mul_add`. A result depends on neither the ISA nor the tile, so every tiling, thread
//! split and dispatch gives the same bits (the previous AVX2 kernel had an order of its own).
//!
//! ## Tiles
//! - AVX-512 (32 registers): 1 row × 1 token (decode at batch 1, where the weights are the
//!   traffic) with the four sets in one pass: one sequential stream per task, which the
//!   hardware prefetcher follows best (measured on weights on 2 MiB pages: `lm_head`'s
//!   32768 × 1024 at 30–33 GB/s against 24–25 with 4-row tiles, decode 1.03×); 1 row × 2–4
//!   tokens (decode batches) also in one pass (16 accumulators at four tokens): each row
//!   streams once and is widened once (measured on Zen 5: batch-4 decode 1.18×, `lm_head` at
//!   four tokens 24 → 37.5 GB/s, against 4 × 4 tiles with one pass per set); 4 rows × 4
//!   tokens (prefill, and a prefill's last tokens) with one pass per set (16 accumulators;
//!   the tile's rows stay in L1 between passes).
//! - AVX2 (16 registers, a set is two `ymm`): 1 × 1 in one pass (8 accumulators); 2 × 2 with
//!   one pass per set (8 accumulators) for two tokens; 1 × 3 and 1 × 4 with one pass per set
//!   (6 and 8 accumulators) for more: each row is widened once for four tokens, where two 2 × 2
//!   token tiles widened and read it twice (measured: batch-4 decode 1.28×, lm_head at 4
//!   tokens 2.07× GFLOP/s).
//! - Portable: 4 rows × up to 4 tokens.

use half::bf16;

use crate::isa::Isa;
use crate::prefetch::{PrefetchHint, PrefetchReach};

/// Lanes of a set (one `zmm` of f32).
pub const LANES: usize = 16;
/// Accumulator sets: consecutive 16-element slices go to sets 0, 1, 2, 3, 0, …
pub const SETS: usize = 4;
/// Elements one step of every set covers.
const STEP: usize = LANES * SETS;
/// Most weight rows one kernel call takes.
pub const MAX_TILE_ROWS: usize = 4;
/// Most tokens one kernel call takes.
pub const MAX_TILE_TOKENS: usize = 4;
/// Most (row, token) pairs an AVX-512 tile keeps all four sets of in registers, streaming its
/// rows once: 16 accumulators, plus the tokens' activations and a widened row.
const ONE_PASS_PAIRS: usize = 4;

/// The tile (weight rows, tokens) `isa` uses when `tokens` tokens are left.
pub fn tile(isa: Isa, tokens: usize) -> (usize, usize) {
    match isa {
        Isa::Avx2Fma if tokens == 1 => (1, 1),
        Isa::Avx2Fma if tokens == 2 => (2, 2),
        Isa::Avx2Fma => (1, tokens.min(MAX_TILE_TOKENS)),
        Isa::Avx512 if tokens <= ONE_PASS_PAIRS => (1, tokens),
        Isa::Scalar if tokens == 1 => (MAX_TILE_ROWS, 1),
        Isa::Avx512 | Isa::Scalar => (MAX_TILE_ROWS, tokens.min(MAX_TILE_TOKENS)),
    }
}

/// Whether `isa`'s kernels take a tile of `rows × tokens` ([`tile`] is the shape they are
/// best at for a number of tokens; a caller may still pass a full-height tile of fewer
/// tokens, e.g. the last tokens of a prefill).
pub fn takes(isa: Isa, rows: usize, tokens: usize) -> bool {
    let fits = (1..=MAX_TILE_ROWS).contains(&rows) && (1..=MAX_TILE_TOKENS).contains(&tokens);
    fits && (isa != Isa::Avx2Fma || rows == 1 || (rows == 2 && tokens <= 2))
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

/// Computes one tile with `isa`, which must be supported by this CPU and [`takes`] the tile.
///
/// # Panics
/// If the tile is larger than `isa` takes, the slices are too short, or `isa` is unsupported.
pub fn compute_tile(isa: Isa, t: Tile<'_>, out: &mut [f32], out_row_stride: usize) {
    assert!(
        takes(isa, t.rows, t.tokens),
        "{isa:?} takes no bf16 tile of {}x{}",
        t.rows,
        t.tokens
    );
    assert!(t.x.len() >= t.tokens * t.cols && t.w.len() >= t.rows * t.cols);
    assert!(out.len() > (t.rows - 1) * out_row_stride + t.tokens - 1);
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    macro_rules! dispatch {
        ($kernel:ident $(, $extra:expr)*) => {
            match (t.rows, t.tokens) {
                (1, 1) => $kernel::<1, 1>(t, out, out_row_stride $(, $extra)*),
                (1, 2) => $kernel::<1, 2>(t, out, out_row_stride $(, $extra)*),
                (1, 3) => $kernel::<1, 3>(t, out, out_row_stride $(, $extra)*),
                (1, 4) => $kernel::<1, 4>(t, out, out_row_stride $(, $extra)*),
                (2, 1) => $kernel::<2, 1>(t, out, out_row_stride $(, $extra)*),
                (2, 2) => $kernel::<2, 2>(t, out, out_row_stride $(, $extra)*),
                (2, 3) => $kernel::<2, 3>(t, out, out_row_stride $(, $extra)*),
                (2, 4) => $kernel::<2, 4>(t, out, out_row_stride $(, $extra)*),
                (3, 1) => $kernel::<3, 1>(t, out, out_row_stride $(, $extra)*),
                (3, 2) => $kernel::<3, 2>(t, out, out_row_stride $(, $extra)*),
                (3, 3) => $kernel::<3, 3>(t, out, out_row_stride $(, $extra)*),
                (3, 4) => $kernel::<3, 4>(t, out, out_row_stride $(, $extra)*),
                (4, 1) => $kernel::<4, 1>(t, out, out_row_stride $(, $extra)*),
                (4, 2) => $kernel::<4, 2>(t, out, out_row_stride $(, $extra)*),
                (4, 3) => $kernel::<4, 3>(t, out, out_row_stride $(, $extra)*),
                (4, 4) => $kernel::<4, 4>(t, out, out_row_stride $(, $extra)*),
                _ => unreachable!("checked above"),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports the ISA (asserted above) and the slices cover the tile.
        Isa::Avx512 => unsafe { dispatch!(tile_avx512, one_row_prefetch(isa, t.cols, t.tokens)) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; AVX2 takes 1 × 1–4 and 2 × 1–2 only (asserted above).
        Isa::Avx2Fma => unsafe {
            let a = one_row_prefetch(isa, t.cols, t.tokens);
            match (t.rows, t.tokens) {
                (1, 1) => tile_avx2_one(t, out, a),
                (1, 2) => tile_avx2_sets::<1, 2>(t, out, out_row_stride, a),
                (1, 3) => tile_avx2_sets::<1, 3>(t, out, out_row_stride, a),
                (1, 4) => tile_avx2_sets::<1, 4>(t, out, out_row_stride, a),
                (2, 1) => tile_avx2_sets::<2, 1>(t, out, out_row_stride, a),
                (2, 2) => tile_avx2_sets::<2, 2>(t, out, out_row_stride, a),
                _ => unreachable!("checked above"),
            }
        },
        _ => dispatch!(tile_portable),
    }
}

/// Every row of `t` (any number of them) against its `t.tokens` tokens by one-row tiles
/// ([`tile`]'s shape for decode), the row loop inside the ISA's code: a 2 KB row streams in
/// well under a microsecond, and a dispatch with its checks per row was a few percent of a
/// decode step (batch 1, and 4–5 % of batch 4's samples in perf). The result of (row r,
/// token k) goes to `out[r * out_row_stride + k]`.
///
/// # Panics
/// If `isa` takes no one-row tile of `t.tokens`, the slices are too short, or `isa` is
/// unsupported.
pub fn compute_one_row_tiles(isa: Isa, t: Tile<'_>, out: &mut [f32], out_row_stride: usize) {
    assert!(
        takes(isa, 1, t.tokens),
        "{isa:?} takes no bf16 tile of 1x{}",
        t.tokens
    );
    assert!(t.x.len() >= t.tokens * t.cols && t.w.len() >= t.rows * t.cols);
    assert!(t.rows == 0 || out.len() >= (t.rows - 1) * out_row_stride + t.tokens);
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2 and FMA (asserted above); every row lies within `w`
        // and every output within `out`.
        Isa::Avx2Fma => unsafe { rows_avx2(t, out, out_row_stride) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX-512F (asserted above); as above.
        Isa::Avx512 => unsafe { rows_avx512(t, out, out_row_stride) },
        _ => each_row(t, out, out_row_stride, |row, o| {
            compute_tile(isa, row, o, out_row_stride)
        }),
    }
}

/// `one_row(tile, out)` for each row of `t` and its outputs: the body of the per-ISA row
/// loops, inlined into each so that the kernel call inlines with the ISA's features.
#[inline(always)]
fn each_row(
    t: Tile<'_>,
    out: &mut [f32],
    out_row_stride: usize,
    mut one_row: impl FnMut(Tile<'_>, &mut [f32]),
) {
    for r in 0..t.rows {
        let row = Tile {
            w: &t.w[r * t.cols..(r + 1) * t.cols],
            rows: 1,
            ..t
        };
        one_row(
            row,
            &mut out[r * out_row_stride..r * out_row_stride + t.tokens],
        );
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2(t: Tile<'_>, out: &mut [f32], out_row_stride: usize) {
    let (s, a) = (
        out_row_stride,
        one_row_prefetch(Isa::Avx2Fma, t.cols, t.tokens),
    );
    // SAFETY: as this function's: every row and output lies within the slices.
    unsafe {
        match t.tokens {
            1 => each_row(t, out, s, |row, o| tile_avx2_one(row, o, a)),
            2 => each_row(t, out, s, |row, o| tile_avx2_sets::<1, 2>(row, o, s, a)),
            3 => each_row(t, out, s, |row, o| tile_avx2_sets::<1, 3>(row, o, s, a)),
            4 => each_row(t, out, s, |row, o| tile_avx2_sets::<1, 4>(row, o, s, a)),
            n => unreachable!("{n} tokens (checked by the caller)"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_avx512(t: Tile<'_>, out: &mut [f32], out_row_stride: usize) {
    let (s, a) = (
        out_row_stride,
        one_row_prefetch(Isa::Avx512, t.cols, t.tokens),
    );
    // SAFETY: as this function's: every row and output lies within the slices.
    unsafe {
        match t.tokens {
            1 => each_row(t, out, s, |row, o| tile_avx512::<1, 1>(row, o, s, a)),
            2 => each_row(t, out, s, |row, o| tile_avx512::<1, 2>(row, o, s, a)),
            3 => each_row(t, out, s, |row, o| tile_avx512::<1, 3>(row, o, s, a)),
            4 => each_row(t, out, s, |row, o| tile_avx512::<1, 4>(row, o, s, a)),
            n => unreachable!("{n} tokens (checked by the caller)"),
        }
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

use crate::formats::widen_bf16 as widen;

/// The tail elements past the last whole step (`cols mod 64` of them), in order.
#[inline(always)]
fn add_tail(mut s: f32, x: &[f32], w: &[bf16], from: usize) -> f32 {
    for (a, &b) in x[from..].iter().zip(&w[from..]) {
        s += a * widen(b);
    }
    s
}

fn tile_portable<const R: usize, const T: usize>(
    t: Tile<'_>,
    out: &mut [f32],
    out_row_stride: usize,
) {
    let cols = t.cols;
    let full = cols / STEP * STEP;
    let mut acc = [[[[0.0f32; LANES]; SETS]; T]; R];
    for i in (0..full).step_by(STEP) {
        for set in 0..SETS {
            let e0 = i + set * LANES;
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let w: [f32; LANES] = std::array::from_fn(|l| widen(t.w[r * cols + e0 + l]));
                for (k, acc_rt) in acc_r.iter_mut().enumerate() {
                    let x = &t.x[k * cols + e0..k * cols + e0 + LANES];
                    for l in 0..LANES {
                        acc_rt[set][l] = x[l].mul_add(w[l], acc_rt[set][l]);
                    }
                }
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (k, a) in acc_r.iter().enumerate() {
            let sum: [f32; LANES] =
                std::array::from_fn(|l| (a[0][l] + a[1][l]) + (a[2][l] + a[3][l]));
            out[r * out_row_stride + k] = add_tail(
                reduce_lanes(&sum),
                &t.x[k * cols..(k + 1) * cols],
                &t.w[r * cols..(r + 1) * cols],
                full,
            );
        }
    }
}

// The register tile reads best as acc[row][token][set] indexed by the loop counters.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const R: usize, const T: usize>(
    t: Tile<'_>,
    out: &mut [f32],
    out_row_stride: usize,
    ahead: RowPrefetch,
) {
    use std::arch::x86_64::*;
    let cols = t.cols;
    let full = cols / STEP * STEP;
    let (x, w) = (t.x.as_ptr(), t.w.as_ptr());
    // [set][r][k]. A tile of at most ONE_PASS_PAIRS (row, token) pairs keeps all four sets
    // in registers (4 × R × T) and its rows stream once; a larger one makes each set its own
    // pass over the tile's rows (R × T registers; the rows stay in L1 between passes), each
    // set's sums the same as in one pass.
    // Written before it is read (in a larger tile, by each set's pass) rather than zeroed
    // first: at 4 × 4 the array is 4 KB, and its memset was 3 % of a prefill (perf).
    let one_pass = R * T <= ONE_PASS_PAIRS;
    let mut sets = std::mem::MaybeUninit::<[[[__m512; T]; R]; SETS]>::uninit();
    if one_pass {
        sets.write([[[_mm512_setzero_ps(); T]; R]; SETS]);
    }
    macro_rules! widen_at {
        ($r:expr, $e0:expr) => {
            // SAFETY: row r's elements e0..e0+16 are inside `w` (checked by the caller);
            // AVX-512F is this function's.
            unsafe { crate::formats::widen16_bf16(w.add($r * cols + $e0)) }
        };
    }
    if one_pass {
        let mut i = 0;
        while i < full {
            prefetch_next_tile::<R>(w, cols, ahead, i);
            for set in 0..SETS {
                let e0 = i + set * LANES;
                // SAFETY: every token's elements e0..e0+16 are inside `x`.
                let xs: [__m512; T] =
                    std::array::from_fn(|k| unsafe { _mm512_loadu_ps(x.add(k * cols + e0)) });
                // SAFETY: initialized above (one pass).
                let sets = unsafe { sets.assume_init_mut() };
                for r in 0..R {
                    let wv = widen_at!(r, e0);
                    for k in 0..T {
                        sets[set][r][k] = _mm512_fmadd_ps(xs[k], wv, sets[set][r][k]);
                    }
                }
            }
            i += STEP;
        }
    } else {
        for set in 0..SETS {
            let mut acc = [[_mm512_setzero_ps(); T]; R];
            let mut i = 0;
            while i < full {
                if set == 0 {
                    prefetch_next_tile::<R>(w, cols, ahead, i);
                }
                let e0 = i + set * LANES;
                let mut widened = [_mm512_setzero_ps(); R];
                for (r, v) in widened.iter_mut().enumerate() {
                    *v = widen_at!(r, e0);
                }
                for k in 0..T {
                    // SAFETY: token k's elements e0..e0+16 are inside `x`.
                    let xs = unsafe { _mm512_loadu_ps(x.add(k * cols + e0)) };
                    for r in 0..R {
                        acc[r][k] = _mm512_fmadd_ps(xs, widened[r], acc[r][k]);
                    }
                }
                i += STEP;
            }
            // SAFETY: `set < SETS`: inside the array.
            unsafe {
                sets.as_mut_ptr()
                    .cast::<[[__m512; T]; R]>()
                    .add(set)
                    .write(acc)
            };
        }
    }
    // SAFETY: in one pass the sets were zeroed and accumulated above; otherwise every set
    // was written by its pass.
    let sets = unsafe { sets.assume_init() };
    for r in 0..R {
        for k in 0..T {
            let sum = _mm512_add_ps(
                _mm512_add_ps(sets[0][r][k], sets[1][r][k]),
                _mm512_add_ps(sets[2][r][k], sets[3][r][k]),
            );
            let lo = _mm512_castps512_ps256(sum);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sum)));
            out[r * out_row_stride + k] = add_tail(
                reduce8_avx(_mm256_add_ps(lo, hi)),
                &t.x[k * cols..(k + 1) * cols],
                &t.w[r * cols..(r + 1) * cols],
                full,
            );
        }
    }
}

/// How far ahead (in elements, 4 KB of BF16) a one-row tile of rows shorter than
/// [`PREFETCH_OWN_ROW_COLS`] prefetches at least, under [`PrefetchReach::Near`]: the
/// next row's position was 256 bytes ahead for the 128-column rows of W_UKᵀ, less than the
/// memory latency covers. Measured with `model run --profile-ops` (`mini`, 2 vCPUs, weights on
/// huge pages, Xeon): 2 KB took the per-head W_UK product 55 → 46 µs, the 1536 × 384 q_b
/// 52 → 49 µs, the shared expert's 1024 × 384 down 38.5 → 36 µs, and 4 KB was no better there.
const PREFETCH_MIN_ELEMENTS: usize = 2048;

/// Rows this long prefetch the next row's position, one row ahead, under
/// [`PrefetchReach::Near`]: 4–8 KB ahead in 1024-column rows lost 10–35 % in `lm_head` on the
/// Xeon.
const PREFETCH_OWN_ROW_COLS: usize = 1024;

/// How far ahead (in elements, 8 KB of BF16) a one-row tile prefetches at least under
/// [`PrefetchReach::Far`] (AMD's default): one 1024-column row (2 KB) ahead kept `lm_head`
/// below the read bandwidth once the machine gave more than ~60 GB/s. Measured on a Zen 5 EPYC (2 vCPUs,
/// 32768 × 1024 on 2 MiB pages, interleaved with a summing loop in the same rounds): in the
/// rounds of 64–70 GB/s, 8 KB ahead read 1.07–1.17× faster than 2 KB with AVX-512 and
/// 1.11–1.27× with the AVX2 kernel (whose twice as many instructions per byte leave the loads
/// further behind); in rounds of 36–50 GB/s all distances read at the bandwidth.
const FAR_PREFETCH_ELEMENTS: usize = 4096;

/// What a one-row tile prefetches as it streams its row: how far ahead, and into which cache.
#[derive(Clone, Copy, Debug)]
struct RowPrefetch {
    /// Elements ahead of the one being read; 0 asks for nothing.
    elements: usize,
    hint: PrefetchHint,
}

/// What a one-row tile of `isa`, `cols`-element rows and `tokens` tokens prefetches (under
/// the current reach as `isa` follows it, [`PrefetchReach::for_isa`]): at least the
/// next row's position (the next rows follow, one stream), and further where the rows are
/// short or the reach is far ([`PrefetchReach`]), into the reach's cache
/// ([`PrefetchReach::hint`]). Under [`PrefetchReach::Off`], nothing for one token and Far's
/// distance for more. On Zen 4 Far's prefetches into L1 themselves held a one-token stream
/// back: summing 32768 × 1024 BF16 rows on 2 threads read 1.12–1.44× faster without them,
/// in each of six rounds alternating with 8 KB ahead; the same distance into L2 only reads
/// faster still (`FarL2`). Two to four tokens' arithmetic leaves the loads behind, and there
/// they still pay: batch-4 decode steps took 1.10× as long without them (AVX2: 1.05×).
fn one_row_prefetch(isa: Isa, cols: usize, tokens: usize) -> RowPrefetch {
    let reach = PrefetchReach::current().for_isa(isa);
    let elements = match reach {
        PrefetchReach::Off if tokens == 1 => 0,
        PrefetchReach::Far | PrefetchReach::Off | PrefetchReach::FarL2 => {
            cols.max(FAR_PREFETCH_ELEMENTS)
        }
        PrefetchReach::Near if cols >= PREFETCH_OWN_ROW_COLS => cols,
        PrefetchReach::Near => cols.max(PREFETCH_MIN_ELEMENTS),
    };
    RowPrefetch {
        elements,
        hint: reach.hint(),
    }
}

/// Asks for the lines the next tile of `R` rows reads at element `i` (one 64-element step is
/// two 64-byte lines of a BF16 row): to the hardware prefetcher each tile is `R` new
/// streams, and a tile of short rows ends before it has ramped up on them; those lines are
/// read as soon as the tile is, so they go to L1. A one-row tile (one stream: the next rows
/// follow) asks as [`one_row_prefetch`] says, or nothing when that is 0 elements ahead.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_next_tile<const R: usize>(w: *const bf16, cols: usize, one_row: RowPrefetch, i: usize) {
    if R == 1 && one_row.elements == 0 {
        return;
    }
    let hint = if R == 1 {
        one_row.hint
    } else {
        PrefetchHint::L1
    };
    for r in 0..R {
        // A prefetch never faults; `wrapping_add` keeps the address arithmetic defined past
        // the end of the weights.
        let distance = if R == 1 {
            one_row.elements
        } else {
            (R + r) * cols
        };
        let ahead = w.wrapping_add(distance + i);
        hint.line(ahead);
        hint.line(ahead.wrapping_add(32));
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

/// One (row, token) in one pass: four sets of two `ymm` (lanes 0–7 and 8–15 of each set).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2_one(t: Tile<'_>, out: &mut [f32], ahead: RowPrefetch) {
    use std::arch::x86_64::*;
    let cols = t.cols;
    let full = cols / STEP * STEP;
    let (x, w) = (t.x.as_ptr(), t.w.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 2]; SETS];
    let mut i = 0;
    while i < full {
        prefetch_next_tile::<1>(w, cols, ahead, i);
        for (set, a) in acc.iter_mut().enumerate() {
            for (half, ah) in a.iter_mut().enumerate() {
                let e = i + set * LANES + 8 * half;
                // SAFETY: elements e..e+8 of the row and the token are inside `w` and `x`.
                unsafe {
                    let halves = _mm_loadu_si128(w.add(e) as *const __m128i);
                    let ws =
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)));
                    *ah = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(e)), ws, *ah);
                }
            }
        }
        i += STEP;
    }
    let half_sum = |h: usize| {
        _mm256_add_ps(
            _mm256_add_ps(acc[0][h], acc[1][h]),
            _mm256_add_ps(acc[2][h], acc[3][h]),
        )
    };
    let s8 = _mm256_add_ps(half_sum(0), half_sum(1));
    out[0] = add_tail(reduce8_avx(s8), &t.x[..cols], &t.w[..cols], full);
}

/// Up to 2 rows × 2 tokens: one pass per set (8 accumulators), the tile's rows in L1 between
/// passes.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2_sets<const R: usize, const T: usize>(
    t: Tile<'_>,
    out: &mut [f32],
    out_row_stride: usize,
    ahead: RowPrefetch,
) {
    use std::arch::x86_64::*;
    let cols = t.cols;
    let full = cols / STEP * STEP;
    let (x, w) = (t.x.as_ptr(), t.w.as_ptr());
    // [set][r][k][half]
    let mut sets = [[[[_mm256_setzero_ps(); 2]; T]; R]; SETS];
    for set in 0..SETS {
        let mut acc = [[[_mm256_setzero_ps(); 2]; T]; R];
        let mut i = 0;
        while i < full {
            if set == 0 {
                prefetch_next_tile::<R>(w, cols, ahead, i);
            }
            for half in 0..2 {
                let e = i + set * LANES + 8 * half;
                let mut widened = [_mm256_setzero_ps(); R];
                for (r, v) in widened.iter_mut().enumerate() {
                    // SAFETY: row r's elements e..e+8 are inside `w`.
                    *v = unsafe {
                        let halves = _mm_loadu_si128(w.add(r * cols + e) as *const __m128i);
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
                    };
                }
                for k in 0..T {
                    // SAFETY: token k's elements e..e+8 are inside `x`.
                    let xs = unsafe { _mm256_loadu_ps(x.add(k * cols + e)) };
                    for r in 0..R {
                        acc[r][k][half] = _mm256_fmadd_ps(xs, widened[r], acc[r][k][half]);
                    }
                }
            }
            i += STEP;
        }
        sets[set] = acc;
    }
    for r in 0..R {
        for k in 0..T {
            let half_sum = |h: usize| {
                _mm256_add_ps(
                    _mm256_add_ps(sets[0][r][k][h], sets[1][r][k][h]),
                    _mm256_add_ps(sets[2][r][k][h], sets[3][r][k][h]),
                )
            };
            let s8 = _mm256_add_ps(half_sum(0), half_sum(1));
            out[r * out_row_stride + k] = add_tail(
                reduce8_avx(s8),
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
        let full = x.len() / STEP * STEP;
        let mut sets = [[0.0f32; LANES]; SETS];
        for i in 0..full {
            let (set, lane) = ((i / LANES) % SETS, i % LANES);
            sets[set][lane] = x[i].mul_add(w[i].to_f32(), sets[set][lane]);
        }
        let lanes: [f32; LANES] =
            std::array::from_fn(|l| (sets[0][l] + sets[1][l]) + (sets[2][l] + sets[3][l]));
        let mut s = reduce_lanes(&lanes);
        for i in full..x.len() {
            s += x[i] * w[i].to_f32();
        }
        s
    }

    /// Runs `kernel` on a `rows × tokens` tile of `cols` (operands from `seed`) into rows of
    /// `stride` outputs, and checks them ([`check_outputs`]).
    fn run_and_check(
        isa: Isa,
        (rows, tokens, cols, seed): (usize, usize, usize, usize),
        stride: usize,
        kernel: impl Fn(Isa, Tile<'_>, &mut [f32], usize),
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        let (x, w) = operands(rows, tokens, cols, seed);
        let t = Tile {
            x: &x,
            w: &w,
            cols,
            rows,
            tokens,
        };
        let mut out = vec![f32::NAN; rows * stride];
        kernel(isa, t, &mut out, stride);
        check_outputs(isa, t, &out, stride)
    }

    /// Checks `out` (rows at `stride`) against `t`: every (row, token) the canonical order's
    /// bits, within f32 rounding of an f64 sum, and the rest of each row untouched (NaN).
    fn check_outputs(
        isa: Isa,
        t: Tile<'_>,
        out: &[f32],
        stride: usize,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        let cols = t.cols;
        for r in 0..t.rows {
            for k in 0..stride {
                let got = out[r * stride + k];
                if k >= t.tokens {
                    proptest::prop_assert!(got.is_nan(), "{:?} wrote past row {}", isa, r);
                    continue;
                }
                let (xs, ws) = (
                    &t.x[k * cols..(k + 1) * cols],
                    &t.w[r * cols..(r + 1) * cols],
                );
                let want = canonical_dot(xs, ws);
                proptest::prop_assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{:?} {}x{} row {} token {}",
                    isa,
                    t.rows,
                    t.tokens,
                    r,
                    k
                );
                let products = xs
                    .iter()
                    .zip(ws)
                    .map(|(a, b)| f64::from(*a) * f64::from(b.to_f32()));
                let exact: f64 = products.clone().sum();
                let magnitude: f64 = products.map(f64::abs).sum();
                proptest::prop_assert!((f64::from(got) - exact).abs() <= 1e-6 * magnitude + 1e-30);
            }
        }
        Ok(())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Every ISA and every tile shape it takes gives the canonical order's bits.
        #[test]
        fn every_isa_and_tile_gives_the_canonical_bits(
            seed in 0usize..1000,
            cols in 1usize..400,
            tokens in 1usize..=4,
        ) {
            for isa in Isa::all_supported() {
                for rows in (1..=MAX_TILE_ROWS).filter(|&rows| takes(isa, rows, tokens)) {
                    run_and_check(isa, (rows, tokens, cols, seed), tokens + 3, compute_tile)?;
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]
        /// The one-row tiles' row loop gives the canonical bits for every row and token,
        /// whatever the prefetch reach (a process-wide setting: the bits are the same for
        /// every reach, so tests running beside this one are unaffected).
        #[test]
        fn one_row_tiles_give_the_canonical_bits(
            seed in 0usize..1000,
            cols in 1usize..300,
            rows in 1usize..11,
            tokens in 1usize..=4,
        ) {
            let before = PrefetchReach::current();
            for reach in PrefetchReach::ALL {
                reach.set();
                for isa in Isa::all_supported() {
                    let shape = (rows, tokens, cols, seed);
                    run_and_check(isa, shape, tokens + 2, compute_one_row_tiles)?;
                }
            }
            before.set();
        }
    }

    #[test]
    #[should_panic(expected = "takes no bf16 tile of 5x1")]
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

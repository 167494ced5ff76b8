//! BF16 products over many tokens (prefill) from an f32 panel: a task's weight rows are widened
//! once into f32, reordered so that every pass of the summation order reads contiguous memory,
//! and then serve every token of the call.
//!
//! The register tiles of [`bf16_tile`](super::bf16_tile) widen each weight vector again in
//! every pass over a tile (one pass per accumulator set when the tile has several tokens): two
//! ALU operations per eight weights per pass, for at most four tokens. At a prefill's hundreds
//! of tokens that widening, not the multiply-adds, bounded the product. Widened once per task,
//! the weights cost one load per vector, and a tile can hold more tokens because no register
//! holds a widened row it must keep.
//!
//! ## The same bits as the register tiles
//! The summation order is [`bf16_tile`](super::bf16_tile)'s: element `i < ⌊cols/64⌋·64` goes
//! into lane `i mod 16` of set `(i / 16) mod 4` in increasing `i`, the sets are added
//! `(a0 + a1) + (a2 + a3)`, the 16 lanes reduced by the fixed tree, the tail added in order.
//! Only the order in which the accumulators advance differs, and each accumulator still sees its
//! elements in increasing `i`, so the results are bit-identical to [`bf16_tile`](super::bf16_tile)
//! (tested against its canonical order, per ISA).
//!
//! ## Pass-major layout
//! A pass is the part of every 64-element step that one vector register accumulates: `LP`
//! consecutive offsets within the step (`LP` = 8 for AVX2, 16 for AVX-512 and the portable
//! code). Within a row, pass `p`'s values of all steps are stored together:
//! `panel[p · full + j · LP + l] = w[j · 64 + p · LP + l]` for step `j` and lane `l`, where
//! `full = ⌊cols/64⌋·64`. The activations are reordered the same way once per call.
//!
//! ## Tiles
//! AVX2 (16 registers): 4 rows × 3 tokens, 12 accumulators, the 3 tokens' vectors in
//! registers and one weight vector at a time: 7 loads per 12 multiply-adds. Portable: 4 rows ×
//! 4 tokens of 16 lanes (what the tests hold the AVX2 kernel to).
//!
//! AVX-512 keeps the register tiles ([`has_panel_kernel`]): its 4 × 4 tiles hold a whole set
//! per register. An AVX-512 panel kernel (a set per pass, the same bits) was tried on 2 vCPUs
//! of an Ice Lake Xeon (`examples/dense_prefill_speed`, best of 15, interleaved with the
//! register tiles): 4 rows × 4 tokens ran at 0.67–0.95× of the register tiles' speed at 128
//! and 512 tokens, 4 × 6 at 0.76–1.16× (1024 × 1024 and 1024 × 2816 faster, 576 and 2816
//! rows slower), and at 16 tokens or fewer 0.28–0.75×, so it was not kept
//! (`bench/results/xeon-prefill-panel.txt`).

use half::bf16;

use super::bf16_tile::{LANES, SETS};
use crate::isa::Isa;

/// Elements one step of every set covers.
const STEP: usize = LANES * SETS;
/// Rows of one tile.
pub const TILE_ROWS: usize = 4;
/// Bytes of f32 panel a task widens at once: rows beyond it are widened in further rounds, so
/// the panel stays in the L2 of the smallest cores the project runs on (512 KiB on Zen 3),
/// next to the token tile's activations.
const PANEL_BYTES: usize = 192 << 10;

/// Whether products under `isa` take the panel at many tokens (else the register tiles).
pub fn has_panel_kernel(isa: Isa) -> bool {
    isa == Isa::Avx2Fma
}

/// Lanes one pass accumulates (one vector register of f32).
pub fn lanes_per_pass(isa: Isa) -> usize {
    match isa {
        Isa::Avx2Fma => 8,
        Isa::Avx512 | Isa::Scalar => LANES,
    }
}

/// Tokens of one tile under `isa`.
pub fn tile_tokens(isa: Isa) -> usize {
    match isa {
        Isa::Avx2Fma => 3,
        Isa::Avx512 | Isa::Scalar => MAX_TILE_TOKENS,
    }
}

/// Elements of a row that the passes cover (whole 64-element steps).
pub fn panel_cols(cols: usize) -> usize {
    cols / STEP * STEP
}

/// Weight rows a task widens at once for rows of `cols` elements: a multiple of
/// [`TILE_ROWS`], at least one tile.
pub fn panel_rows(cols: usize) -> usize {
    let per_row = panel_cols(cols).max(1) * 4;
    (PANEL_BYTES / per_row / TILE_ROWS).max(1) * TILE_ROWS
}

/// `dst[p · full + j · lp + l] = src[j · 64 + p · lp + l]` over the first `full` elements of
/// `src` (see the module documentation), widening with `value`.
#[inline(always)]
fn reorder<T: Copy>(src: &[T], lp: usize, dst: &mut [f32], value: impl Fn(T) -> f32) {
    let block = dst.len() / STEP * lp;
    for (p, out) in dst.chunks_exact_mut(block.max(1)).enumerate() {
        for (j, chunk) in out.chunks_exact_mut(lp).enumerate() {
            let from = &src[j * STEP + p * lp..][..lp];
            for (d, &s) in chunk.iter_mut().zip(from) {
                *d = value(s);
            }
        }
    }
}

/// Activation rows `x: [tokens, cols]` in pass-major layout: `[tokens, panel_cols(cols)]`.
pub fn reorder_activations(isa: Isa, x: &[f32], tokens: usize, cols: usize) -> Vec<f32> {
    let (full, lp) = (panel_cols(cols), lanes_per_pass(isa));
    let mut out = vec![0.0f32; tokens * full];
    if full > 0 {
        for (src, dst) in x.chunks_exact(cols).zip(out.chunks_exact_mut(full)) {
            reorder(src, lp, dst, |v| v);
        }
    }
    out
}

/// Widens BF16 weight rows `w: [rows, cols]` into `panel: [rows, panel_cols(cols)]`,
/// pass-major.
pub fn widen_rows(isa: Isa, w: &[bf16], cols: usize, panel: &mut [f32]) {
    let (full, lp) = (panel_cols(cols), lanes_per_pass(isa));
    if full == 0 {
        return;
    }
    for (src, dst) in w.chunks_exact(cols).zip(panel.chunks_exact_mut(full)) {
        reorder(src, lp, dst, widen);
    }
}

use crate::formats::widen_bf16 as widen;

/// One tile's operands: `rows` panel rows and `tokens` reordered activation rows (both of
/// `full` elements, pass-major), and the original rows for the tail elements.
#[derive(Clone, Copy)]
pub struct PanelTile<'a> {
    pub panel: &'a [f32],
    pub xp: &'a [f32],
    pub w: &'a [bf16],
    pub x: &'a [f32],
    pub cols: usize,
    pub rows: usize,
    pub tokens: usize,
}

/// The results of one tile: `[row][token]`.
pub type TileSums = [[f32; MAX_TILE_TOKENS]; TILE_ROWS];

/// Most tokens of a tile under any ISA.
pub const MAX_TILE_TOKENS: usize = 4;

/// Computes one tile: the result of (row r, token t) is `sums[r][t]`.
///
/// # Panics
/// If the tile is larger than `isa` takes, the slices are too short, or `isa` is unsupported.
pub fn compute_panel_tile(isa: Isa, t: PanelTile<'_>) -> TileSums {
    let full = panel_cols(t.cols);
    assert!(
        (1..=TILE_ROWS).contains(&t.rows) && (1..=tile_tokens(isa)).contains(&t.tokens),
        "panel tile {}x{} exceeds {isa:?}'s {TILE_ROWS}x{}",
        t.rows,
        t.tokens,
        tile_tokens(isa)
    );
    assert!(t.panel.len() >= t.rows * full && t.xp.len() >= t.tokens * full);
    assert!(t.w.len() >= t.rows * t.cols && t.x.len() >= t.tokens * t.cols);
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    let mut sums = [[0.0f32; MAX_TILE_TOKENS]; TILE_ROWS];
    macro_rules! dispatch {
        ($kernel:ident, $($t:literal)*) => {
            match (t.rows, t.tokens) {
                $(
                    (1, $t) => $kernel::<1, $t>(t, &mut sums),
                    (2, $t) => $kernel::<2, $t>(t, &mut sums),
                    (3, $t) => $kernel::<3, $t>(t, &mut sums),
                    (4, $t) => $kernel::<4, $t>(t, &mut sums),
                )*
                _ => unreachable!("checked above"),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2 and FMA (asserted above); the panel and activation
        // slices hold the tile's rows (asserted above).
        Isa::Avx2Fma => unsafe { dispatch!(tile_avx2, 1 2 3) },
        _ => dispatch!(tile_portable, 1 2 3 4),
    }
    sums
}

/// `s` plus the tail elements of (row `r`, token `k`) past the last whole step, in order.
#[inline(always)]
fn add_tail(mut s: f32, t: &PanelTile<'_>, r: usize, k: usize) -> f32 {
    let full = panel_cols(t.cols);
    let (x, w) = (
        &t.x[k * t.cols + full..(k + 1) * t.cols],
        &t.w[r * t.cols + full..(r + 1) * t.cols],
    );
    for (a, &b) in x.iter().zip(w) {
        s += a * widen(b);
    }
    s
}

/// The 16-lane tree of [`bf16_tile`](super::bf16_tile).
#[inline(always)]
fn reduce_lanes(a: &[f32; LANES]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    let s4: [f32; 4] = std::array::from_fn(|l| s8[l] + s8[l + 4]);
    let s2: [f32; 2] = std::array::from_fn(|l| s4[l] + s4[l + 2]);
    s2[0] + s2[1]
}

/// An `R × T` tile in portable Rust, `LANES` lanes per pass.
fn tile_portable<const R: usize, const T: usize>(t: PanelTile<'_>, sums: &mut TileSums) {
    let full = panel_cols(t.cols);
    let steps = full / STEP;
    let rows: [&[f32]; R] = std::array::from_fn(|r| &t.panel[r * full..(r + 1) * full]);
    let xs: [&[f32]; T] = std::array::from_fn(|k| &t.xp[k * full..(k + 1) * full]);
    // [row][token][set]: each pass is one set's 16 lanes.
    let mut sets = [[[[0.0f32; LANES]; SETS]; T]; R];
    for set in 0..SETS {
        let base = set * steps * LANES;
        let mut acc = [[[0.0f32; LANES]; T]; R];
        for j in 0..steps {
            let at = base + j * LANES;
            let xv: [&[f32; LANES]; T] =
                std::array::from_fn(|k| xs[k][at..at + LANES].try_into().unwrap());
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let wv: &[f32; LANES] = rows[r][at..at + LANES].try_into().unwrap();
                for (acc_rk, x) in acc_r.iter_mut().zip(&xv) {
                    for l in 0..LANES {
                        acc_rk[l] = x[l].mul_add(wv[l], acc_rk[l]);
                    }
                }
            }
        }
        for (sets_r, acc_r) in sets.iter_mut().zip(&acc) {
            for (sets_rk, acc_rk) in sets_r.iter_mut().zip(acc_r) {
                sets_rk[set] = *acc_rk;
            }
        }
    }
    for (r, sets_r) in sets.iter().enumerate() {
        for (k, a) in sets_r.iter().enumerate() {
            let lanes: [f32; LANES] =
                std::array::from_fn(|l| (a[0][l] + a[1][l]) + (a[2][l] + a[3][l]));
            sums[r][k] = add_tail(reduce_lanes(&lanes), &t, r, k);
        }
    }
}

/// An `R × T` tile (`T ≤ 3`) with AVX2: 8 lanes per pass (pass `2s + h` is half `h` of set
/// `s`), `R × T` accumulators, the tokens' vectors in registers and one weight vector loaded at
/// a time; the sets and halves are then combined as [`bf16_tile`](super::bf16_tile)'s one-row
/// AVX2 kernel combines them.
///
/// # Safety
/// AVX2 and FMA; the tile's slices hold `R` rows and `T` tokens (checked by the caller).
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize, const T: usize>(t: PanelTile<'_>, sums: &mut TileSums) {
    use std::arch::x86_64::*;
    const LP: usize = 8;
    let full = panel_cols(t.cols);
    let steps = full / STEP;
    let (w, x) = (t.panel.as_ptr(), t.xp.as_ptr());
    // [pass][row][token], written pass by pass (no zeroing, no move of the whole array).
    let mut passes = std::mem::MaybeUninit::<[[[__m256; T]; R]; STEP / LP]>::uninit();
    let pass_ptr = passes.as_mut_ptr().cast::<[[__m256; T]; R]>();
    for p in 0..STEP / LP {
        let base = p * steps * LP;
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for j in 0..steps {
            let at = base + j * LP;
            // SAFETY: `at + 8 ≤ full` for every pass and step; rows r < R and tokens k < T lie
            // within the slices (the caller's contract).
            unsafe {
                let xv: [__m256; T] =
                    std::array::from_fn(|k| _mm256_loadu_ps(x.add(k * full + at)));
                for r in 0..R {
                    let wv = _mm256_loadu_ps(w.add(r * full + at));
                    for k in 0..T {
                        acc[r][k] = _mm256_fmadd_ps(xv[k], wv, acc[r][k]);
                    }
                }
            }
        }
        // SAFETY: pass p < STEP / LP of the array.
        unsafe { pass_ptr.add(p).write(acc) };
    }
    // SAFETY: every pass was written above.
    let passes = unsafe { passes.assume_init_ref() };
    for r in 0..R {
        for k in 0..T {
            let half_sum = |h: usize| {
                _mm256_add_ps(
                    _mm256_add_ps(passes[h][r][k], passes[2 + h][r][k]),
                    _mm256_add_ps(passes[4 + h][r][k], passes[6 + h][r][k]),
                )
            };
            let s8 = _mm256_add_ps(half_sum(0), half_sum(1));
            let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)));
            sums[r][k] = add_tail(s, &t, r, k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dense::bf16_tile::{self, Tile};

    fn operands(rows: usize, tokens: usize, cols: usize, seed: usize) -> (Vec<f32>, Vec<bf16>) {
        let x = (0..tokens * cols)
            .map(|i| (((i + seed) * 37 % 101) as f32 - 50.0) / 25.0 + 1e-3 * (i % 7) as f32)
            .collect();
        let w = (0..rows * cols)
            .map(|i| bf16::from_f32((((i + seed) * 53 % 97) as f32 - 48.0) / 40.0))
            .collect();
        (x, w)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Every ISA and tile shape gives, from the panel, the bits of the register tiles
        /// (whose own test holds them to the canonical order element by element).
        #[test]
        fn panel_tiles_give_the_register_tiles_bits(
            seed in 0usize..1000,
            cols in 1usize..400,
        ) {
            for isa in Isa::all_supported() {
                let (rows, tokens) = (TILE_ROWS, tile_tokens(isa));
                let (x, w) = operands(rows, tokens, cols, seed);
                let full = panel_cols(cols);
                let xp = reorder_activations(isa, &x, tokens, cols);
                let mut panel = vec![0.0f32; rows * full];
                widen_rows(isa, &w, cols, &mut panel);
                for (tile_rows, tile_tokens) in [(rows, tokens), (1, 1), (rows - 1, tokens), (2, 1)] {
                    let got = compute_panel_tile(
                        isa,
                        PanelTile {
                            panel: &panel,
                            xp: &xp,
                            w: &w,
                            x: &x,
                            cols,
                            rows: tile_rows,
                            tokens: tile_tokens,
                        },
                    );
                    for r in 0..tile_rows {
                        for k in 0..tile_tokens {
                            let mut want = [f32::NAN];
                            bf16_tile::compute_tile(
                                Isa::Scalar,
                                Tile { x: &x[k * cols..], w: &w[r * cols..], cols, rows: 1, tokens: 1 },
                                &mut want,
                                1,
                            );
                            proptest::prop_assert_eq!(
                                got[r][k].to_bits(), want[0].to_bits(),
                                "{:?} {}x{} r{} t{}", isa, tile_rows, tile_tokens, r, k
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn panel_rows_keep_the_panel_in_budget_and_hold_a_tile() {
        assert_eq!(panel_rows(1024), 48);
        assert_eq!(panel_rows(7168), 4);
        assert_eq!(panel_rows(64 * 1024), TILE_ROWS);
        assert_eq!(panel_rows(10), (PANEL_BYTES / 4 / TILE_ROWS) * TILE_ROWS);
    }
}

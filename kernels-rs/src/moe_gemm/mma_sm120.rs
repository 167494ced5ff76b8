//! Register-level CPU model of the SM120 block-scaled FP4 warp MMA
//!
//! ```text
//! mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X
//!     .f32.e2m1.e2m1.f32.ue4m3 d, a, b, c, sfa, {bidA, tidA}, sfb, {bidB, tidB};
//! ```
//!
//! (SASS `OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X`). The model works on what each of the 32 lanes
//! holds, so a kernel's fragment loaders can be checked on the CPU against a plain matmul, and
//! the sm_90a emulation in `moe_gemm.cu` can be checked against the same semantics.
//!
//! Layouts, with `g = lane / 4` (groupID) and `t = lane % 4` (threadID_in_group); nibble `i` of
//! a register is bits `4i..4i+4` and holds the lower K first:
//!
//! | operand | register | element |
//! |---|---|---|
//! | A (16×64, row) | `a[r]`, nibble `i` | row `g + 8·(r % 2)`, k `8t + i + 32·(r / 2)` |
//! | B (64×8, col)  | `b[r]`, nibble `i` | k `8t + i + 32·r`, column `g` |
//! | C/D (16×8)     | `c[r]`            | row `g + 8·(r / 2)`, column `2t + r % 2` |
//!
//! Sources: PTX ISA "Matrix Fragments for mma.m16n8k64" (.e2m1 A/B formulas) and CUTLASS
//! `cute/atom/mma_traits_sm120.hpp` (`SM120_16x8x64_TN_VS`: `ALayout`, `BLayout`,
//! `SFALayout`, `SFBLayout`, `CLayout = SM80_16x8_Row`), which agree.
//!
//! Scale factors (scale_vec::4X: one UE4M3 per 16 K, four per row of A / column of B, byte `j`
//! of the u32 is K block `j`):
//! - `bidA` and `bidB` must be 0: with 4X every byte of the register is used.
//! - A: `tidA ∈ {0, 1}` picks a lane pair in each quad. Row `r` reads the register of lane
//!   `4·(r % 8) + 2·tidA + r / 8`. (CUTLASS's `SFALayout` `((2,2,8),64):((8,0,1),16)` is this
//!   with `tidA = 0`: lane bit 0 selects the row half, lane bit 1 is a don't-care mode.)
//! - B: `tidB ∈ {0..4}` picks one lane in each quad. Column `n` reads lane `4n + tidB`
//!   (CUTLASS `SFBLayout` `((4,8),64):((0,1),8)` with `tidB = 0`).
//!
//! The `tid != 0` lane choice is inferred from the PTX text ("thread-id selects the threads
//! within a quad") plus the CUTLASS layout, not from hardware; kernels in this crate always pass
//! `{0, 0}`, where both sources agree exactly.
//!
//! Arithmetic: the model sums the 64 scaled products exactly (every product and partial sum is
//! representable in f64: ≤ 12 significant bits each, exponents spanning < 50 bits), adds C and
//! rounds once to f32. The hardware's internal accumulation width is undocumented, so results
//! from a GPU may differ from this model in the last bits of large, cancelling sums.

use crate::formats::{e2m1_to_f32, ue4m3_to_f32};
use std::fmt;

pub const WARP: usize = 32;
pub const MMA_M: usize = 16;
pub const MMA_N: usize = 8;
pub const MMA_K: usize = 64;
/// K elements per UE4M3 scale (scale_vec::4X over K = 64).
pub const SF_VEC: usize = 16;
pub const SF_PER_K: usize = MMA_K / SF_VEC;

/// What one lane passes to the instruction.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LaneOperands {
    pub a: [u32; 4],
    pub b: [u32; 2],
    pub c: [f32; 4],
    pub sfa: u32,
    pub sfb: u32,
}

/// `{byte-id, thread-id}` selector of one scale operand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScaleSelector {
    pub byte_id: u16,
    pub thread_id: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SelectorError {
    /// scale_vec::4X uses all four bytes, so the byte selector must be 0.
    ByteId(u16),
    /// A's thread selector picks one of two lane pairs per quad; B's one of four lanes.
    ThreadId { operand: char, value: u16 },
}

impl fmt::Display for SelectorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ByteId(v) => write!(f, "byte-id {v} is invalid for scale_vec::4X (must be 0)"),
            Self::ThreadId { operand, value } => {
                write!(f, "thread-id-{operand} {value} is out of range")
            }
        }
    }
}

impl std::error::Error for SelectorError {}

/// Lane and nibble of A element `(row, k)`: `(lane, register, nibble)`.
#[inline]
pub const fn a_position(row: usize, k: usize) -> (usize, usize, usize) {
    let lane = (row % 8) * 4 + (k % 32) / 8;
    let reg = (row / 8) + 2 * (k / 32);
    (lane, reg, k % 8)
}

/// Inverse of [`a_position`].
#[inline]
pub const fn a_element(lane: usize, reg: usize, nibble: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    (g + 8 * (reg % 2), 8 * t + nibble + 32 * (reg / 2))
}

/// Lane and nibble of B element `(k, col)`: `(lane, register, nibble)`.
#[inline]
pub const fn b_position(k: usize, col: usize) -> (usize, usize, usize) {
    (col * 4 + (k % 32) / 8, k / 32, k % 8)
}

/// Inverse of [`b_position`]: `(k, col)`.
#[inline]
pub const fn b_element(lane: usize, reg: usize, nibble: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    (8 * t + nibble + 32 * reg, g)
}

/// Lane and register of C/D element `(row, col)`.
#[inline]
pub const fn c_position(row: usize, col: usize) -> (usize, usize) {
    ((row % 8) * 4 + col / 2, 2 * (row / 8) + col % 2)
}

/// Inverse of [`c_position`]: `(row, col)`.
#[inline]
pub const fn c_element(lane: usize, reg: usize) -> (usize, usize) {
    (lane / 4 + 8 * (reg / 2), 2 * (lane % 4) + reg % 2)
}

/// The lane whose `sfa` register supplies row `row`'s scales.
pub fn sfa_lane(row: usize, sel: ScaleSelector) -> Result<usize, SelectorError> {
    check_byte(sel)?;
    if sel.thread_id > 1 {
        return Err(SelectorError::ThreadId {
            operand: 'a',
            value: sel.thread_id,
        });
    }
    Ok(4 * (row % 8) + 2 * sel.thread_id as usize + row / 8)
}

/// The lane whose `sfb` register supplies column `col`'s scales.
pub fn sfb_lane(col: usize, sel: ScaleSelector) -> Result<usize, SelectorError> {
    check_byte(sel)?;
    if sel.thread_id > 3 {
        return Err(SelectorError::ThreadId {
            operand: 'b',
            value: sel.thread_id,
        });
    }
    Ok(4 * col + sel.thread_id as usize)
}

fn check_byte(sel: ScaleSelector) -> Result<(), SelectorError> {
    if sel.byte_id == 0 {
        Ok(())
    } else {
        Err(SelectorError::ByteId(sel.byte_id))
    }
}

#[inline]
fn nibble(reg: u32, i: usize) -> u8 {
    ((reg >> (4 * i)) & 0xF) as u8
}

/// Executes the MMA for one warp: returns each lane's `d` registers.
pub fn mma_m16n8k64_nvf4(
    lanes: &[LaneOperands; WARP],
    sel_a: ScaleSelector,
    sel_b: ScaleSelector,
) -> Result<[[f32; 4]; WARP], SelectorError> {
    let mut a = [[0f64; MMA_K]; MMA_M];
    let mut b = [[0f64; MMA_K]; MMA_N];
    for (lane, ops) in lanes.iter().enumerate() {
        for (reg, &word) in ops.a.iter().enumerate() {
            for i in 0..8 {
                let (row, k) = a_element(lane, reg, i);
                a[row][k] = f64::from(e2m1_to_f32(nibble(word, i)));
            }
        }
        for (reg, &word) in ops.b.iter().enumerate() {
            for i in 0..8 {
                let (k, col) = b_element(lane, reg, i);
                b[col][k] = f64::from(e2m1_to_f32(nibble(word, i)));
            }
        }
    }
    let scale = |word: u32, block: usize| f64::from(ue4m3_to_f32((word >> (8 * block)) as u8));
    let mut sa = [[0f64; SF_PER_K]; MMA_M];
    for (row, row_scales) in sa.iter_mut().enumerate() {
        let word = lanes[sfa_lane(row, sel_a)?].sfa;
        for (j, s) in row_scales.iter_mut().enumerate() {
            *s = scale(word, j);
        }
    }
    let mut sb = [[0f64; SF_PER_K]; MMA_N];
    for (col, col_scales) in sb.iter_mut().enumerate() {
        let word = lanes[sfb_lane(col, sel_b)?].sfb;
        for (j, s) in col_scales.iter_mut().enumerate() {
            *s = scale(word, j);
        }
    }
    let mut d = [[0f32; 4]; WARP];
    for (lane, out) in d.iter_mut().enumerate() {
        for (reg, value) in out.iter_mut().enumerate() {
            let (row, col) = c_element(lane, reg);
            let dot: f64 = (0..MMA_K)
                .map(|k| a[row][k] * sa[row][k / SF_VEC] * b[col][k] * sb[col][k / SF_VEC])
                .sum();
            *value = (dot + f64::from(lanes[lane].c[reg])) as f32;
        }
    }
    Ok(d)
}

/// Tile-level operands of one MMA: E2M1 codes and UE4M3 scale codes, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct MmaTile {
    /// `[16][64]` codes of A (rows = M).
    pub a: [[u8; MMA_K]; MMA_M],
    /// `[8][64]` codes of B stored as Bᵀ (rows = N), like a weight matrix `[out, in]`.
    pub b_t: [[u8; MMA_K]; MMA_N],
    pub sfa: [[u8; SF_PER_K]; MMA_M],
    pub sfb: [[u8; SF_PER_K]; MMA_N],
    pub c: [[f32; MMA_N]; MMA_M],
}

/// Distributes a tile over the 32 lanes as a kernel must (the inverse of the model's reads).
/// Scale registers are written only in the lanes the selectors read; `filler` goes into the
/// others so tests can prove they are ignored.
pub fn tile_to_lanes(
    tile: &MmaTile,
    sel_a: ScaleSelector,
    sel_b: ScaleSelector,
    filler: u32,
) -> Result<[LaneOperands; WARP], SelectorError> {
    let mut lanes = [LaneOperands {
        sfa: filler,
        sfb: filler,
        ..Default::default()
    }; WARP];
    for (row, codes) in tile.a.iter().enumerate() {
        for (k, &code) in codes.iter().enumerate() {
            let (lane, reg, i) = a_position(row, k);
            lanes[lane].a[reg] |= u32::from(code & 0xF) << (4 * i);
        }
    }
    for (col, codes) in tile.b_t.iter().enumerate() {
        for (k, &code) in codes.iter().enumerate() {
            let (lane, reg, i) = b_position(k, col);
            lanes[lane].b[reg] |= u32::from(code & 0xF) << (4 * i);
        }
    }
    for (row, s) in tile.sfa.iter().enumerate() {
        lanes[sfa_lane(row, sel_a)?].sfa = u32::from_le_bytes(*s);
    }
    for (col, s) in tile.sfb.iter().enumerate() {
        lanes[sfb_lane(col, sel_b)?].sfb = u32::from_le_bytes(*s);
    }
    for (row, values) in tile.c.iter().enumerate() {
        for (col, &v) in values.iter().enumerate() {
            let (lane, reg) = c_position(row, col);
            lanes[lane].c[reg] = v;
        }
    }
    Ok(lanes)
}

/// Gathers the lanes' `d` registers back into a `[16][8]` tile.
pub fn lanes_to_d(d: &[[f32; 4]; WARP]) -> [[f32; MMA_N]; MMA_M] {
    let mut out = [[0f32; MMA_N]; MMA_M];
    for (lane, regs) in d.iter().enumerate() {
        for (reg, &v) in regs.iter().enumerate() {
            let (row, col) = c_element(lane, reg);
            out[row][col] = v;
        }
    }
    out
}

#[cfg(test)]
// Index loops mirror the matrix formulas being checked.
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::formats::Nvfp4Matrix;

    struct SplitMix(u64);
    impl SplitMix {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn normal_ish(&mut self) -> f32 {
            // Sum of uniforms: enough spread to exercise every E2M1 code and many scales.
            (0..4)
                .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                .sum()
        }
    }

    /// A random tile whose scales differ per 16-element block, so a wrong byte order or a
    /// wrong scale lane changes the result.
    fn random_tile(rng: &mut SplitMix) -> MmaTile {
        let mut tile = MmaTile {
            a: [[0; MMA_K]; MMA_M],
            b_t: [[0; MMA_K]; MMA_N],
            sfa: [[0; SF_PER_K]; MMA_M],
            sfb: [[0; SF_PER_K]; MMA_N],
            c: [[0.0; MMA_N]; MMA_M],
        };
        tile.a
            .iter_mut()
            .flatten()
            .for_each(|x| *x = (rng.next() & 0xF) as u8);
        tile.b_t
            .iter_mut()
            .flatten()
            .for_each(|x| *x = (rng.next() & 0xF) as u8);
        // Normal UE4M3 codes in [2^-4, 2^4): exponent field 3..=10.
        let mut scale = || (((rng.next() % 8 + 3) << 3) | (rng.next() & 7)) as u8;
        tile.sfa.iter_mut().flatten().for_each(|x| *x = scale());
        tile.sfb.iter_mut().flatten().for_each(|x| *x = scale());
        tile
    }

    /// Reference: dequantize element-wise, multiply in f64, round once.
    fn reference(tile: &MmaTile) -> [[f32; MMA_N]; MMA_M] {
        let mut out = [[0f32; MMA_N]; MMA_M];
        for m in 0..MMA_M {
            for n in 0..MMA_N {
                let mut acc = 0f64;
                for k in 0..MMA_K {
                    let a = e2m1_to_f32(tile.a[m][k]) * ue4m3_to_f32(tile.sfa[m][k / 16]);
                    let b = e2m1_to_f32(tile.b_t[n][k]) * ue4m3_to_f32(tile.sfb[n][k / 16]);
                    acc += f64::from(a) * f64::from(b);
                }
                out[m][n] = (acc + f64::from(tile.c[m][n])) as f32;
            }
        }
        out
    }

    fn run(tile: &MmaTile, sa: ScaleSelector, sb: ScaleSelector) -> [[f32; MMA_N]; MMA_M] {
        let lanes = tile_to_lanes(tile, sa, sb, 0x7F7F_7F7F).unwrap();
        lanes_to_d(&mma_m16n8k64_nvf4(&lanes, sa, sb).unwrap())
    }

    #[test]
    fn fragment_maps_are_bijections_and_match_the_ptx_formulas() {
        let mut seen_a = [[false; MMA_K]; MMA_M];
        for lane in 0..WARP {
            for reg in 0..4 {
                for i in 0..8 {
                    let (row, k) = a_element(lane, reg, i);
                    // PTX ISA: row = groupID for a_i with i < 8 or 16 <= i < 24, else +8;
                    // col = tig*8 + (i & 7) (+32 for i >= 16), where i = 8*reg + nibble.
                    let idx = 8 * reg + i;
                    let ptx_row = lane / 4
                        + if idx < 8 || (16..24).contains(&idx) {
                            0
                        } else {
                            8
                        };
                    let ptx_col = (lane % 4) * 8 + (idx & 7) + if idx >= 16 { 32 } else { 0 };
                    assert_eq!((row, k), (ptx_row, ptx_col));
                    assert_eq!(a_position(row, k), (lane, reg, i));
                    assert!(!seen_a[row][k]);
                    seen_a[row][k] = true;
                }
            }
        }
        let mut seen_b = [[false; MMA_N]; MMA_K];
        for lane in 0..WARP {
            for reg in 0..2 {
                for i in 0..8 {
                    let (k, col) = b_element(lane, reg, i);
                    assert_eq!(b_position(k, col), (lane, reg, i));
                    assert!(!seen_b[k][col]);
                    seen_b[k][col] = true;
                }
            }
            for reg in 0..4 {
                let (row, col) = c_element(lane, reg);
                assert_eq!(c_position(row, col), (lane, reg));
            }
        }
    }

    #[test]
    fn cutlass_scale_layouts_with_zero_selectors() {
        // SFALayout ((2,2,8),64):((8,0,1),16): lane = t0 + 2*t1 + 4*t2 holds row 8*t0 + t2.
        for lane in 0..WARP {
            let row = 8 * (lane % 2) + lane / 4;
            if (lane / 2) % 2 == 0 {
                assert_eq!(sfa_lane(row, ScaleSelector::default()).unwrap(), lane);
            }
        }
        // SFBLayout ((4,8),64):((0,1),8): lane = t0 + 4*t1 holds column t1.
        for col in 0..MMA_N {
            assert_eq!(sfb_lane(col, ScaleSelector::default()).unwrap(), 4 * col);
        }
    }

    #[test]
    fn fragments_reproduce_the_dequantized_matmul_exactly() {
        let mut rng = SplitMix(7);
        for trial in 0..200 {
            let mut tile = random_tile(&mut rng);
            if trial % 2 == 1 {
                tile.c
                    .iter_mut()
                    .flatten()
                    .for_each(|x| *x = rng.normal_ish() * 100.0);
            }
            let sa = ScaleSelector {
                byte_id: 0,
                thread_id: (trial % 2) as u16,
            };
            let sb = ScaleSelector {
                byte_id: 0,
                thread_id: (trial % 4) as u16,
            };
            assert_eq!(run(&tile, sa, sb), reference(&tile), "trial {trial}");
        }
    }

    #[test]
    fn each_16_element_block_uses_its_own_scale() {
        let mut rng = SplitMix(11);
        let tile = random_tile(&mut rng);
        let base = run(&tile, ScaleSelector::default(), ScaleSelector::default());
        for j in 0..SF_PER_K {
            let mut t = tile.clone();
            // Doubling one block's A scale must change exactly the rows that use it, by the
            // block's own contribution.
            t.sfa[3][j] += 8; // exponent + 1 = ×2
            let out = run(&t, ScaleSelector::default(), ScaleSelector::default());
            for n in 0..MMA_N {
                let block: f64 = (16 * j..16 * j + 16)
                    .map(|k| {
                        f64::from(e2m1_to_f32(tile.a[3][k]) * ue4m3_to_f32(tile.sfa[3][j]))
                            * f64::from(e2m1_to_f32(tile.b_t[n][k]) * ue4m3_to_f32(tile.sfb[n][j]))
                    })
                    .sum();
                let want = (f64::from(base[3][n]) + block) as f32;
                assert!(
                    (out[3][n] - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "block {j}"
                );
            }
            for m in (0..MMA_M).filter(|&m| m != 3) {
                assert_eq!(out[m], base[m]);
            }
        }
        // Reversing the byte order of the scale words is detected.
        let mut t = tile.clone();
        t.sfb.iter_mut().for_each(|s| s.reverse());
        assert_ne!(
            run(&t, ScaleSelector::default(), ScaleSelector::default()),
            base
        );
    }

    #[test]
    fn unselected_lanes_scale_registers_are_ignored() {
        let mut rng = SplitMix(3);
        let tile = random_tile(&mut rng);
        let sel = ScaleSelector::default();
        let a = tile_to_lanes(&tile, sel, sel, 0).unwrap();
        let b = tile_to_lanes(&tile, sel, sel, 0x3C3C_3C3C).unwrap();
        assert_ne!(a, b);
        assert_eq!(
            mma_m16n8k64_nvf4(&a, sel, sel).unwrap(),
            mma_m16n8k64_nvf4(&b, sel, sel).unwrap()
        );
    }

    #[test]
    fn invalid_selectors_are_rejected() {
        let bad_byte = ScaleSelector {
            byte_id: 1,
            thread_id: 0,
        };
        let ok = ScaleSelector::default();
        let lanes = [LaneOperands::default(); WARP];
        assert_eq!(
            mma_m16n8k64_nvf4(&lanes, bad_byte, ok),
            Err(SelectorError::ByteId(1))
        );
        let bad_a = ScaleSelector {
            byte_id: 0,
            thread_id: 2,
        };
        assert!(mma_m16n8k64_nvf4(&lanes, bad_a, ok).is_err());
        let b3 = ScaleSelector {
            byte_id: 0,
            thread_id: 3,
        };
        assert!(mma_m16n8k64_nvf4(&lanes, ok, b3).is_ok());
    }

    /// End to end from real NVFP4 matrices in checkpoint layout: packed bytes, row-major
    /// block scales, global scales applied after the MMA (as the kernel's epilogue does).
    #[test]
    fn nvfp4_matrices_through_fragments_match_dequantized_f32_matmul() {
        let mut rng = SplitMix(42);
        let x: Vec<f32> = (0..MMA_M * MMA_K).map(|_| rng.normal_ish()).collect();
        let w: Vec<f32> = (0..MMA_N * MMA_K)
            .map(|_| rng.normal_ish() * 0.02)
            .collect();
        let xq = Nvfp4Matrix::quantize_weight(&x, MMA_M, MMA_K).unwrap();
        let wq = Nvfp4Matrix::quantize_weight(&w, MMA_N, MMA_K).unwrap();
        let mut tile = random_tile(&mut rng);
        for m in 0..MMA_M {
            for k in 0..MMA_K {
                tile.a[m][k] = xq.code(m, k);
            }
            for j in 0..SF_PER_K {
                tile.sfa[m][j] = xq.block_scales[m * SF_PER_K + j];
            }
        }
        for n in 0..MMA_N {
            for k in 0..MMA_K {
                tile.b_t[n][k] = wq.code(n, k);
            }
            for j in 0..SF_PER_K {
                tile.sfb[n][j] = wq.block_scales[n * SF_PER_K + j];
            }
        }
        tile.c = [[0.0; MMA_N]; MMA_M];
        let d = run(&tile, ScaleSelector::default(), ScaleSelector::default());
        let (xd, wd) = (xq.dequantize(), wq.dequantize());
        let global = xq.global_scale * wq.global_scale;
        for m in 0..MMA_M {
            for n in 0..MMA_N {
                // f32 matmul in K order: each product is exact in f32 but the running sum
                // rounds, so allow K·ε relative to the sum of magnitudes.
                let (mut acc, mut mag) = (0f32, 0f32);
                for k in 0..MMA_K {
                    let p = xd[m * MMA_K + k] * wd[n * MMA_K + k];
                    acc += p;
                    mag += p.abs();
                }
                let got = d[m][n] * global;
                let tol = MMA_K as f32 * f32::EPSILON * mag + 1e-30;
                assert!((got - acc).abs() <= tol, "({m},{n}): {got} vs {acc}");
            }
        }
    }
}

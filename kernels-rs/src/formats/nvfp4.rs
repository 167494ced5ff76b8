//! NVFP4 two-level quantization, arithmetic for arithmetic as ModelOpt's `NVFP4QTensor` does it.
//!
//! A matrix `[rows, cols]` becomes:
//! - packed E2M1 codes `[rows, cols/2]` (low nibble = even element);
//! - one E4M3 block scale per 16 consecutive elements of a row, `[rows, cols/16]`;
//! - one FP32 global scale (`weight_scale_2` for weights, `input_scale` for activations).
//!
//! Every step keeps ModelOpt's order of FP32 operations, because a different order changes the
//! rounding and therefore the bytes:
//! 1. `global = amax / 2688` (2688 = 6 · 448), weights only.
//! 2. `s = block_amax / (6 · global)`: the product is rounded first, then the quotient.
//! 3. A zero `s` becomes 1.0; then `s` is clamped to [2⁻⁹, 448] and cast to E4M3.
//! 4. `code = e2m1(x / (f32(s_e4m3) · global))`: again product first, then quotient.
//! 5. Dequantization is `e2m1 · (f32(s_e4m3) · global)`.

use rayon::prelude::*;
use thiserror::Error;

use super::e2m1::{E2M1_MAX, e2m1_to_f32, f32_to_e2m1};
use super::e4m3::{E4M3_MAX, E4M3_MIN_SUBNORMAL, Overflow, e4m3_to_f32, f32_to_e4m3};

/// Elements per block scale (`group_size` in `hf_quant_config.json`).
pub const NVFP4_BLOCK: usize = 16;
/// `E2M1_MAX · E4M3_MAX`: the global scale maps a tensor's amax to this value.
pub const NVFP4_GLOBAL_DENOMINATOR: f32 = E2M1_MAX * E4M3_MAX;
/// ModelOpt clamps block scales to at least this (the smallest E4M3 subnormal).
pub const NVFP4_MIN_BLOCK_SCALE: f32 = E4M3_MIN_SUBNORMAL;

/// Rows at or above this count are quantized in parallel; below it threads cost more than
/// they save.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;

#[derive(Debug, Error, PartialEq)]
pub enum Nvfp4Error {
    #[error("NVFP4 needs the row length to be a multiple of {NVFP4_BLOCK}, got {cols}")]
    RowNotBlockAligned { cols: usize },
    #[error("{what}: expected {expected} elements, got {actual}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error(
        "element {index} (row {row}, column {col}) is {value}; NVFP4 quantization needs finite input"
    )]
    NonFinite {
        index: usize,
        row: usize,
        col: usize,
        value: f32,
    },
    #[error(
        "the tensor is all zeros: its global scale would be 0 and ModelOpt would write NaN block scales"
    )]
    AllZero,
    #[error("global scale {0} is not a positive finite number")]
    InvalidGlobalScale(f32),
}

/// An NVFP4-quantized row-major matrix in the checkpoint's layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Matrix {
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols/2]`, two E2M1 codes per byte, low nibble first.
    pub packed: Vec<u8>,
    /// `[rows, cols/16]` E4M3 codes.
    pub block_scales: Vec<u8>,
    /// `weight_scale_2` (weights) or `input_scale` (activations).
    pub global_scale: f32,
}

/// The global scale ModelOpt derives from a tensor's absolute maximum.
#[inline]
pub fn global_scale_for_amax(amax: f32) -> f32 {
    amax / NVFP4_GLOBAL_DENOMINATOR
}

/// Absolute maximum of a slice; NaN if it holds a NaN (as torch's max does).
pub fn amax(values: &[f32]) -> f32 {
    values.iter().fold(0.0f32, |acc, &v| {
        if acc.is_nan() || v.is_nan() {
            f32::NAN
        } else {
            acc.max(v.abs())
        }
    })
}

/// The E4M3 block-scale code for a block with absolute maximum `block_amax`.
#[inline]
pub fn block_scale_code(block_amax: f32, global_scale: f32) -> u8 {
    let mut scale = block_amax / (E2M1_MAX * global_scale);
    if scale == 0.0 {
        scale = 1.0;
    }
    // `f32::clamp` keeps NaN, like torch.clamp.
    f32_to_e4m3(
        scale.clamp(NVFP4_MIN_BLOCK_SCALE, E4M3_MAX),
        Overflow::Saturate,
    )
}

/// The factor that multiplies an element's E2M1 value: `f32(block_scale) · global_scale`.
#[inline]
pub fn block_dequant_factor(block_scale_code: u8, global_scale: f32) -> f32 {
    e4m3_to_f32(block_scale_code) * global_scale
}

/// Quantizes one block of 16 values into 8 packed bytes, returning its scale code.
#[inline]
fn quantize_block(block: &[f32], global_scale: f32, packed: &mut [u8]) -> u8 {
    let block_amax = amax(block);
    let scale_code = block_scale_code(block_amax, global_scale);
    let factor = block_dequant_factor(scale_code, global_scale);
    for (byte, pair) in packed.iter_mut().zip(block.chunks_exact(2)) {
        *byte = f32_to_e2m1(pair[0] / factor) | (f32_to_e2m1(pair[1] / factor) << 4);
    }
    scale_code
}

fn quantize_row(row: &[f32], global_scale: f32, packed: &mut [u8], scales: &mut [u8]) {
    for ((block, block_packed), scale) in row
        .chunks_exact(NVFP4_BLOCK)
        .zip(packed.chunks_exact_mut(NVFP4_BLOCK / 2))
        .zip(scales.iter_mut())
    {
        *scale = quantize_block(block, global_scale, block_packed);
    }
}

impl Nvfp4Matrix {
    /// Quantizes a weight matrix: the global scale comes from the matrix's own amax.
    pub fn quantize_weight(values: &[f32], rows: usize, cols: usize) -> Result<Self, Nvfp4Error> {
        check_shape(values.len(), rows, cols)?;
        if let Some(index) = values.iter().position(|v| !v.is_finite()) {
            return Err(Nvfp4Error::NonFinite {
                index,
                row: index / cols,
                col: index % cols,
                value: values[index],
            });
        }
        let amax = amax(values);
        if amax == 0.0 {
            return Err(Nvfp4Error::AllZero);
        }
        Ok(Self::quantize_unchecked(
            values,
            rows,
            cols,
            global_scale_for_amax(amax),
        ))
    }

    /// Quantizes with a given global scale, as activations are quantized at run time with the
    /// checkpoint's `input_scale` (block scales are still computed per 16 elements).
    pub fn quantize_with_global_scale(
        values: &[f32],
        rows: usize,
        cols: usize,
        global_scale: f32,
    ) -> Result<Self, Nvfp4Error> {
        check_shape(values.len(), rows, cols)?;
        if !(global_scale.is_finite() && global_scale > 0.0) {
            return Err(Nvfp4Error::InvalidGlobalScale(global_scale));
        }
        Ok(Self::quantize_unchecked(values, rows, cols, global_scale))
    }

    fn quantize_unchecked(values: &[f32], rows: usize, cols: usize, global_scale: f32) -> Self {
        let mut packed = vec![0u8; rows * cols / 2];
        let mut block_scales = vec![0u8; rows * cols / NVFP4_BLOCK];
        if cols > 0 {
            let row_jobs = values
                .chunks_exact(cols)
                .zip(packed.chunks_exact_mut(cols / 2))
                .zip(block_scales.chunks_exact_mut(cols / NVFP4_BLOCK));
            if values.len() >= PARALLEL_MIN_ELEMENTS {
                row_jobs
                    .par_bridge()
                    .for_each(|((row, p), s)| quantize_row(row, global_scale, p, s));
            } else {
                row_jobs.for_each(|((row, p), s)| quantize_row(row, global_scale, p, s));
            }
        }
        Self {
            rows,
            cols,
            packed,
            block_scales,
            global_scale,
        }
    }

    /// Wraps bytes read from a checkpoint, checking that the sizes agree with the shape.
    pub fn from_parts(
        rows: usize,
        cols: usize,
        packed: Vec<u8>,
        block_scales: Vec<u8>,
        global_scale: f32,
    ) -> Result<Self, Nvfp4Error> {
        if !cols.is_multiple_of(NVFP4_BLOCK) {
            return Err(Nvfp4Error::RowNotBlockAligned { cols });
        }
        if packed.len() != rows * cols / 2 {
            return Err(Nvfp4Error::LengthMismatch {
                what: "packed E2M1 bytes",
                expected: rows * cols / 2,
                actual: packed.len(),
            });
        }
        let expected_scales = rows * cols / NVFP4_BLOCK;
        if block_scales.len() != expected_scales {
            return Err(Nvfp4Error::LengthMismatch {
                what: "E4M3 block scales",
                expected: expected_scales,
                actual: block_scales.len(),
            });
        }
        Ok(Self {
            rows,
            cols,
            packed,
            block_scales,
            global_scale,
        })
    }

    /// A borrowed view of the matrix.
    pub fn view(&self) -> Nvfp4View<'_> {
        Nvfp4View {
            rows: self.rows,
            cols: self.cols,
            packed: &self.packed,
            block_scales: &self.block_scales,
            global_scale: self.global_scale,
        }
    }

    /// Dequantizes one row into `out` (`cols` elements).
    pub fn dequantize_row_into(&self, row: usize, out: &mut [f32]) {
        self.view().dequantize_row_into(row, out);
    }

    /// Dequantizes the whole matrix, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        if self.cols > 0 {
            for (row, out_row) in out.chunks_exact_mut(self.cols).enumerate() {
                self.dequantize_row_into(row, out_row);
            }
        }
        out
    }

    /// Unpacked E2M1 code of element `(row, col)`.
    #[inline]
    pub fn code(&self, row: usize, col: usize) -> u8 {
        let byte = self.packed[(row * self.cols + col) / 2];
        if col.is_multiple_of(2) {
            byte & 0x0F
        } else {
            byte >> 4
        }
    }
}

/// An NVFP4 matrix borrowed from elsewhere, typically a memory-mapped checkpoint.
#[derive(Clone, Copy, Debug)]
pub struct Nvfp4View<'a> {
    pub rows: usize,
    pub cols: usize,
    pub packed: &'a [u8],
    pub block_scales: &'a [u8],
    pub global_scale: f32,
}

impl Nvfp4View<'_> {
    /// Dequantizes one row into `out` (`cols` elements).
    #[inline]
    pub fn dequantize_row_into(&self, row: usize, out: &mut [f32]) {
        let cols = self.cols;
        let packed = &self.packed[row * cols / 2..(row + 1) * cols / 2];
        let scales = &self.block_scales[row * cols / NVFP4_BLOCK..(row + 1) * cols / NVFP4_BLOCK];
        for ((out_block, packed_block), &scale) in out
            .chunks_exact_mut(NVFP4_BLOCK)
            .zip(packed.chunks_exact(NVFP4_BLOCK / 2))
            .zip(scales)
        {
            let factor = block_dequant_factor(scale, self.global_scale);
            for (pair, &byte) in out_block.chunks_exact_mut(2).zip(packed_block) {
                pair[0] = e2m1_to_f32(byte) * factor;
                pair[1] = e2m1_to_f32(byte >> 4) * factor;
            }
        }
    }
}

/// Quantizes one row of activations and dequantizes it again, in place of `out`.
pub fn fake_quantize_row(row: &[f32], input_scale: f32, out: &mut [f32]) {
    let mut packed = [0u8; NVFP4_BLOCK / 2];
    for (block, out_block) in row
        .chunks_exact(NVFP4_BLOCK)
        .zip(out.chunks_exact_mut(NVFP4_BLOCK))
    {
        let scale = quantize_block(block, input_scale, &mut packed);
        let factor = block_dequant_factor(scale, input_scale);
        for (pair, &byte) in out_block.chunks_exact_mut(2).zip(&packed) {
            pair[0] = e2m1_to_f32(byte) * factor;
            pair[1] = e2m1_to_f32(byte >> 4) * factor;
        }
    }
}

/// Quantizes activations to NVFP4 with `input_scale` and dequantizes them again: the values a
/// W4A4 layer actually multiplies.
pub fn fake_quantize_activations(
    values: &[f32],
    cols: usize,
    input_scale: f32,
) -> Result<Vec<f32>, Nvfp4Error> {
    let rows = values.len().checked_div(cols).unwrap_or(0);
    Ok(Nvfp4Matrix::quantize_with_global_scale(values, rows, cols, input_scale)?.dequantize())
}

fn check_shape(len: usize, rows: usize, cols: usize) -> Result<(), Nvfp4Error> {
    if !cols.is_multiple_of(NVFP4_BLOCK) {
        return Err(Nvfp4Error::RowNotBlockAligned { cols });
    }
    if len != rows * cols {
        return Err(Nvfp4Error::LengthMismatch {
            what: "input values",
            expected: rows * cols,
            actual: len,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::e2m1::E2M1_VALUES;
    use proptest::prelude::*;

    #[test]
    fn zero_block_gets_unit_scale_and_zero_codes() {
        let mut values = vec![0.0f32; 32];
        values[16] = 3.0;
        let q = Nvfp4Matrix::quantize_weight(&values, 1, 32).unwrap();
        assert_eq!(e4m3_to_f32(q.block_scales[0]), 1.0);
        assert!(q.packed[..8].iter().all(|&b| b == 0));
        // The block holding the amax gets scale 448 and the element code 6.0.
        assert_eq!(e4m3_to_f32(q.block_scales[1]), 448.0);
        assert_eq!(q.code(0, 16), 7);
        assert_eq!(q.dequantize()[16], 3.0);
    }

    #[test]
    fn tiny_blocks_clamp_their_scale_to_two_to_the_minus_nine() {
        let mut values = vec![0.0f32; 32];
        values[0] = 1.0;
        values[16] = 1e-9;
        let q = Nvfp4Matrix::quantize_weight(&values, 1, 32).unwrap();
        assert_eq!(e4m3_to_f32(q.block_scales[1]), NVFP4_MIN_BLOCK_SCALE);
        assert_eq!(q.code(0, 16), 0);
    }

    #[test]
    fn bad_inputs_are_errors_not_panics() {
        assert_eq!(
            Nvfp4Matrix::quantize_weight(&[0.0; 10], 1, 10),
            Err(Nvfp4Error::RowNotBlockAligned { cols: 10 })
        );
        assert_eq!(
            Nvfp4Matrix::quantize_weight(&[0.0; 16], 1, 16),
            Err(Nvfp4Error::AllZero)
        );
        let mut v = vec![1.0f32; 32];
        v[20] = f32::NAN;
        assert!(matches!(
            Nvfp4Matrix::quantize_weight(&v, 2, 16),
            Err(Nvfp4Error::NonFinite {
                index: 20,
                row: 1,
                col: 4,
                ..
            })
        ));
        assert!(Nvfp4Matrix::quantize_with_global_scale(&v, 2, 16, 0.0).is_err());
        assert!(Nvfp4Matrix::from_parts(1, 16, vec![0; 7], vec![0; 1], 1.0).is_err());
    }

    fn matrix_strategy() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
        (1usize..6, 1usize..5).prop_flat_map(|(rows, blocks)| {
            let cols = blocks * NVFP4_BLOCK;
            let magnitude = prop_oneof![-1e3f32..1e3, -1e-3f32..1e-3, Just(0.0f32), -7.0f32..7.0];
            (
                Just(rows),
                Just(cols),
                prop::collection::vec(magnitude, rows * cols),
            )
        })
    }

    proptest! {
        #[test]
        fn pack_unpack_and_requantize_are_stable((rows, cols, values) in matrix_strategy()) {
            prop_assume!(amax(&values) > 0.0);
            let q = Nvfp4Matrix::quantize_weight(&values, rows, cols).unwrap();
            let mut codes = vec![0u8; rows * cols];
            crate::formats::e2m1::unpack_e2m1(&q.packed, &mut codes);
            let mut repacked = vec![0u8; q.packed.len()];
            crate::formats::e2m1::pack_e2m1(&codes, &mut repacked);
            prop_assert_eq!(&repacked, &q.packed);
            for (i, &c) in codes.iter().enumerate() {
                prop_assert_eq!(c, q.code(i / cols, i % cols));
            }
            // Dequantized values lie on the grid, so quantizing them again with the same scales
            // gives the same codes (up to the sign of zero).
            let deq = q.dequantize();
            let again = Nvfp4Matrix::quantize_with_global_scale(&deq, rows, cols, q.global_scale).unwrap();
            for i in 0..rows * cols {
                let (a, b) = (q.code(i / cols, i % cols), again.code(i / cols, i % cols));
                prop_assert!(a == b || (a & 7 == 0 && b & 7 == 0), "element {}: {} vs {}", i, a, b);
            }
        }

        #[test]
        fn per_block_error_is_bounded((rows, cols, values) in matrix_strategy()) {
            prop_assume!(amax(&values) > 0.0);
            let q = Nvfp4Matrix::quantize_weight(&values, rows, cols).unwrap();
            let deq = q.dequantize();
            for (b, (block, deq_block)) in values.chunks(NVFP4_BLOCK).zip(deq.chunks(NVFP4_BLOCK)).enumerate() {
                let factor = block_dequant_factor(q.block_scales[b], q.global_scale);
                let block_amax = amax(block);
                for (&x, &y) in block.iter().zip(deq_block) {
                    // Inside the grid the error is at most half a step (1.0 · factor at the top
                    // of the range); beyond 6·factor the value saturates to ±6·factor.
                    let bound = if x.abs() <= E2M1_MAX * factor {
                        factor * 1.0 * 1.0001
                    } else {
                        x.abs() - E2M1_MAX * factor + factor * 1e-4
                    };
                    prop_assert!((x - y).abs() <= bound, "x={} y={} factor={} amax={}", x, y, factor, block_amax);
                    prop_assert!(E2M1_VALUES.iter().any(|&v| v * factor == y));
                }
            }
        }
    }
}

//! Borrowed weight matrices in the formats the checkpoint stores: BF16 or NVFP4.

use half::bf16;

use crate::formats::nvfp4::Nvfp4View;

/// A row-major `[rows, cols]` weight matrix borrowed from a checkpoint or a test.
#[derive(Clone, Copy, Debug)]
pub enum MatrixView<'a> {
    Bf16 {
        rows: usize,
        cols: usize,
        data: &'a [bf16],
    },
    Nvfp4(Nvfp4View<'a>),
}

impl MatrixView<'_> {
    pub fn rows(&self) -> usize {
        match self {
            Self::Bf16 { rows, .. } => *rows,
            Self::Nvfp4(v) => v.rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Self::Bf16 { cols, .. } => *cols,
            Self::Nvfp4(v) => v.cols,
        }
    }

    /// Bytes of weight data (and scales) the matrix occupies: what a product must read.
    pub fn bytes(&self) -> usize {
        match self {
            Self::Bf16 { data, .. } => data.len() * 2,
            Self::Nvfp4(v) => v.packed.len() + v.block_scales.len(),
        }
    }

    /// Row `row` widened (or dequantized) to `f32`.
    #[inline]
    pub fn row_into(&self, row: usize, out: &mut [f32]) {
        match self {
            Self::Bf16 { cols, data, .. } => {
                for (o, w) in out.iter_mut().zip(&data[row * cols..(row + 1) * cols]) {
                    *o = w.to_f32();
                }
            }
            Self::Nvfp4(v) => v.dequantize_row_into(row, out),
        }
    }
}

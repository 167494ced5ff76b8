//! The 128×4 scale-factor layout of block-scaled MMA kernels (CUTLASS's `SfAtom`).
//!
//! Row-major scales `[rows, k_blocks]` (one per 16 elements) are padded to a multiple of 128
//! rows and 4 columns, viewed as `[rows/128, 4, 32, k_blocks/4, 4]` and permuted to
//! `[rows/128, k_blocks/4, 32, 4, 4]`. A 512-byte atom then holds the scales of 128 rows × 64
//! elements, and the 4 scales one thread needs for a `k = 64` MMA step are one `u32`.

/// Rows per swizzle atom.
pub const SWIZZLE_ROWS: usize = 128;
/// Scale columns (16-element blocks) per swizzle atom.
pub const SWIZZLE_SCALE_COLS: usize = 4;
/// Bytes per swizzle atom.
pub const SWIZZLE_ATOM_BYTES: usize = SWIZZLE_ROWS * SWIZZLE_SCALE_COLS;

/// Scales in the swizzled layout, remembering the logical (unpadded) shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwizzledScales {
    pub rows: usize,
    pub scale_cols: usize,
    pub data: Vec<u8>,
}

/// `n` rounded up to a multiple of `m`.
#[inline]
pub const fn round_up(n: usize, m: usize) -> usize {
    n.div_ceil(m) * m
}

/// Offset of logical scale `(row, scale_col)` in the swizzled buffer of a matrix whose padded
/// scale-column count is `padded_scale_cols`.
#[inline]
pub fn swizzled_offset(row: usize, scale_col: usize, padded_scale_cols: usize) -> usize {
    let col_tiles = padded_scale_cols / SWIZZLE_SCALE_COLS;
    let (row_tile, row_in_tile) = (row / SWIZZLE_ROWS, row % SWIZZLE_ROWS);
    let (quarter, lane) = (row_in_tile / 32, row_in_tile % 32);
    let (col_tile, col_in_tile) = (
        scale_col / SWIZZLE_SCALE_COLS,
        scale_col % SWIZZLE_SCALE_COLS,
    );
    (((row_tile * col_tiles + col_tile) * 32 + lane) * 4 + quarter) * SWIZZLE_SCALE_COLS
        + col_in_tile
}

impl SwizzledScales {
    /// Swizzles row-major scales `[rows, scale_cols]`; padding entries are zero.
    pub fn from_row_major(scales: &[u8], rows: usize, scale_cols: usize) -> Self {
        assert_eq!(
            scales.len(),
            rows * scale_cols,
            "scales: expected {rows}×{scale_cols}"
        );
        let padded_rows = round_up(rows, SWIZZLE_ROWS);
        let padded_cols = round_up(scale_cols, SWIZZLE_SCALE_COLS);
        let mut data = vec![0u8; padded_rows * padded_cols];
        for (row, row_scales) in scales
            .chunks_exact(scale_cols.max(1))
            .enumerate()
            .take(rows)
        {
            for (col, &scale) in row_scales.iter().enumerate() {
                data[swizzled_offset(row, col, padded_cols)] = scale;
            }
        }
        Self {
            rows,
            scale_cols,
            data,
        }
    }

    /// Padded scale-column count of the buffer.
    pub fn padded_scale_cols(&self) -> usize {
        round_up(self.scale_cols, SWIZZLE_SCALE_COLS)
    }

    /// Scale of logical `(row, scale_col)`.
    #[inline]
    pub fn get(&self, row: usize, scale_col: usize) -> u8 {
        self.data[swizzled_offset(row, scale_col, self.padded_scale_cols())]
    }

    /// Back to row-major `[rows, scale_cols]`, dropping the padding.
    pub fn to_row_major(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.rows * self.scale_cols);
        for row in 0..self.rows {
            out.extend((0..self.scale_cols).map(|col| self.get(row, col)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn offsets_follow_the_documented_permutation() {
        // Row 33 = quarter 1, lane 1; scale column 5 = tile 1, column 1; 8 padded columns.
        let (col_tile, lane, quarter, col_in_tile) = (1, 1, 1, 1);
        assert_eq!(
            swizzled_offset(33, 5, 8),
            ((col_tile * 32 + lane) * 4 + quarter) * 4 + col_in_tile
        );
        // Second row tile starts after all column tiles of the first.
        assert_eq!(swizzled_offset(128, 0, 8), 2 * SWIZZLE_ATOM_BYTES);
        // The four scales of one row inside an atom are contiguous (one u32 for the MMA).
        let base = swizzled_offset(7, 0, 4);
        assert_eq!(
            (0..4)
                .map(|c| swizzled_offset(7, c, 4) - base)
                .collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
    }

    proptest! {
        #[test]
        fn swizzle_round_trips_and_is_a_permutation(rows in 1usize..300, scale_cols in 1usize..20, seed in any::<u64>()) {
            let scales: Vec<u8> = (0..rows * scale_cols).map(|i| (seed.wrapping_mul(i as u64 + 1) >> 7) as u8).collect();
            let sw = SwizzledScales::from_row_major(&scales, rows, scale_cols);
            prop_assert_eq!(sw.data.len(), round_up(rows, 128) * round_up(scale_cols, 4));
            prop_assert_eq!(sw.to_row_major(), scales);
            let padded_cols = sw.padded_scale_cols();
            let mut seen = vec![false; sw.data.len()];
            for r in 0..round_up(rows, 128) {
                for c in 0..padded_cols {
                    let o = swizzled_offset(r, c, padded_cols);
                    prop_assert!(!seen[o]);
                    seen[o] = true;
                }
            }
        }
    }
}

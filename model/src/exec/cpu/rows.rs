//! Row-wise work of a CPU step: norms, residual adds, rotations, the rows of a prefill in
//! parallel and a decode step's few rows in order (each row the same computation either way).

use crate::exec::error::ExecError;

pub fn round_to_bf16(values: &mut [f32]) {
    for v in values {
        *v = half::bf16::from_f32(*v).to_f32();
    }
}

/// RMSNorm in FP32: `x / sqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f64) -> Vec<f32> {
    let mut out = vec![0.0; x.len().min(weight.len())];
    rms_norm_into(x, weight, eps, &mut out);
    out
}

/// [`rms_norm`] written into `out`.
pub fn rms_norm_into(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) {
    let mean_square = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean_square + eps as f32).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// [`rms_norm`] of every `dim`-wide row of `x` into `out`, the rows of a prefill in parallel
/// (each row's sum in the same order as alone).
pub fn rms_norm_rows_into(x: &[f32], dim: usize, weight: &[f32], eps: f64, out: &mut [f32]) {
    use rayon::prelude::*;
    if dim == 0 {
        return;
    }
    if x.len() / dim >= NORM_PARALLEL_ROWS {
        x.par_chunks_exact(dim)
            .zip(out.par_chunks_exact_mut(dim))
            .with_min_len(NORM_PARALLEL_ROWS / 2)
            .for_each(|(row, o)| rms_norm_into(row, weight, eps, o));
    } else {
        for (row, o) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            rms_norm_into(row, weight, eps, o);
        }
    }
}

/// Rows from which [`rms_norm_rows_into`] runs in parallel: a row of a few thousand elements is a
/// microsecond, less than waking a thread for it.
pub const NORM_PARALLEL_ROWS: usize = 32;

pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    let width = 1 << 12;
    for_rows(x, width, |i, block| {
        for (a, b) in block.iter_mut().zip(&y[i * width..]) {
            *a += b;
        }
    });
}

/// `f(i, row)` for every `width`-wide row `i` of `values` (the last one may be shorter), in
/// parallel from [`NORM_PARALLEL_ROWS`] rows (a prefill's), in order below (a decode step's
/// few rows are less work than waking a thread). Each row is the same computation either way.
pub fn for_rows(values: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    use rayon::prelude::*;
    let width = width.max(1);
    if values.len() / width >= NORM_PARALLEL_ROWS {
        values
            .par_chunks_mut(width)
            .enumerate()
            .with_min_len(NORM_PARALLEL_ROWS / 4)
            .for_each(|(i, row)| f(i, row));
    } else {
        for (i, row) in values.chunks_mut(width).enumerate() {
            f(i, row);
        }
    }
}

/// Fails with [`ExecError::NonFinite`] at the first NaN or Inf of `values` (rows of `width`).
/// One pass over the residual stream per sublayer: noise next to the sublayer itself.
pub fn check_finite(
    values: &[f32],
    width: usize,
    place: impl FnOnce() -> String,
) -> Result<(), ExecError> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(ExecError::NonFinite {
            place: place(),
            row: i / width.max(1),
            element: i % width.max(1),
            value: values[i],
        }),
    }
}

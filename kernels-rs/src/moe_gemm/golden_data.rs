//! The closed-form test data `golden/gen_moe.py` generates for the Kimi-shaped MoE goldens,
//! which are too large to commit: both sides compute the same exact values from an integer
//! hash, and the file stores only checksums of what ModelOpt made of them.

use crate::formats::nvfp4::{Nvfp4Matrix, amax, global_scale_for_amax};

/// gen_moe.py's `hash_u32`: murmur3's 32-bit finalizer on `index · φ + stream · c + 1`.
pub fn hash_u32(index: u32, stream: u32) -> u32 {
    let mut h = index
        .wrapping_mul(0x9E37_79B1)
        .wrapping_add(stream.wrapping_mul(0x85EB_CA77))
        .wrapping_add(1);
    h ^= h >> 16;
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 13;
    h = h.wrapping_mul(0xC2B2_AE35);
    h ^ (h >> 16)
}

/// gen_moe.py's `hashed_values`: `(h mod 255 − 127) · 2^−(exponent + (h >> 8) mod 4)`, exact.
pub fn hashed_values(n: usize, stream: u32, exponent: i32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = hash_u32(i as u32, stream);
            let k = (h % 255) as i32 - 127;
            let e = exponent + ((h >> 8) % 4) as i32;
            // 2^−e built from its bit pattern: exact, no libm.
            k as f32 * f32::from_bits(((127 - e) as u32) << 23)
        })
        .collect()
}

/// gen_moe.py's `checksum`: Σ byte[i] · (i mod 65521 + 1).
pub fn checksum(bytes: &[u8]) -> i64 {
    bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| b as i64 * ((i % 65521) as i64 + 1))
        .sum()
}

/// gen_moe.py's hash stream of each case whose weights are not stored (named after its case:
/// `tiles_…` 200000, `…_i2048` 100000, the others 0).
pub fn case_stream(case: &str) -> u32 {
    if case.starts_with("tiles_") {
        200_000
    } else if case.ends_with("_i2048") {
        100_000
    } else {
        0
    }
}

/// Expert `e` of a hashed case, quantized as ModelOpt's fused export does: gate and up share
/// `weight_scale_2` (from their joint amax), down has its own. `[gate, up, down]`, for the
/// caller to check against the file's `weight_scale_2` values and checksums.
pub fn hashed_expert(
    stream: u32,
    e: usize,
    hidden: usize,
    inter: usize,
) -> Result<[Nvfp4Matrix; 3], String> {
    let base = stream + 1000 * (e as u32 + 1);
    let gate = hashed_values(inter * hidden, base + 1, 12);
    let up = hashed_values(inter * hidden, base + 2, 12);
    let down = hashed_values(hidden * inter, base + 3, 10);
    let shared = global_scale_for_amax(amax(&gate).max(amax(&up)));
    let q = |v: &[f32], r, c, g| {
        Nvfp4Matrix::quantize_with_global_scale(v, r, c, g).map_err(|e| e.to_string())
    };
    Ok([
        q(&gate, inter, hidden, shared)?,
        q(&up, inter, hidden, shared)?,
        q(&down, hidden, inter, global_scale_for_amax(amax(&down)))?,
    ])
}

//! The closed-form test data `golden/gen_moe.py` generates for the Kimi-shaped MoE goldens,
//! which are too large to commit: both sides compute the same exact values from an integer
//! hash, and the file stores only checksums of what ModelOpt made of them.

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

//! The closed-form cache contents of the MLA goldens (`golden/gen_mla.py`), shared by the golden
//! tests and the GPU check: the goldens store only queries and outputs, and both sides
//! recompute the cache from this hash, exactly (every value is exact in f32).
//!
//! `idx = seed << 40 | t << 10 | j`, `u = (splitmix64(idx) >> 11) mod 2001 − 1000`;
//! latent `u / 256 · (1 + t mod 5) / 4` (j < 512), RoPE `u / 512` (j = 512 + i).

pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn hash_u(seed: u64, t: usize, j: usize) -> f32 {
    let idx = seed << 40 | (t as u64) << 10 | j as u64;
    ((splitmix64(idx) >> 11) % 2001) as f32 - 1000.0
}

/// Token `t` of the request with `seed`: `latent` (512 values) and `rope` (64 values).
pub fn token_values(seed: u64, t: usize, latent: &mut [f32], rope: &mut [f32]) {
    let tok = (1 + t % 5) as f32 / 4.0;
    let l = latent.len();
    for (j, v) in latent.iter_mut().enumerate() {
        *v = hash_u(seed, t, j) / 256.0 * tok;
    }
    for (j, v) in rope.iter_mut().enumerate() {
        *v = hash_u(seed, t, l + j) / 512.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_its_reference_values() {
        // First outputs of the reference splitmix64 generator seeded with 0 (state += φ first).
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(0x9E37_79B9_7F4A_7C15), 0x6E78_9E6A_A1B9_65F4);
    }
}

//! The closed-form cache contents of the MLA goldens (`golden/gen_mla.py`), shared by the golden
//! tests and the GPU check: the goldens store only queries and outputs, and both sides
//! recompute the cache from this hash, exactly (every value is exact in f32).
//!
//! `idx = seed << 40 | t << 10 | j`, `u = (splitmix64(idx) >> 11) mod 2001 − 1000`;
//! latent `u / 256 · (1 + t mod 5) / 4` (j < 512), RoPE `u / 512` (j = 512 + i).

use crate::rng::splitmix64;

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

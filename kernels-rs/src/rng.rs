//! SplitMix64, the one pseudo-random generator behind the crate's test data, correctness
//! checks and closed-form goldens.
//!
//! It is dependency-free and gives the same sequence for a seed in every process and on every
//! machine: a parent process recomputes what its ranks generated, the GPU checks rebuild the
//! host tests' problems, and goldens are regenerated from their seeds. Changing a constant or
//! the order of operations here changes every generated problem and golden cache.

/// The increment of the state per output: 2⁶⁴ / φ, odd.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output for state `state`, before any increment.
fn mix(state: u64) -> u64 {
    let mut z = state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The first output of the generator seeded with `seed` (`Rng(seed).next_u64()`): a stateless
/// hash of `seed`, for values addressed by index rather than drawn in sequence.
pub fn splitmix64(seed: u64) -> u64 {
    mix(seed.wrapping_add(GAMMA))
}

/// The generator; the field is its state, and the seed is the initial state.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        mix(self.0)
    }

    /// Uniform in [-1, 1), on a grid of 2⁻²³.
    pub fn sym(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `n` values uniform in [-`scale`, `scale`).
    pub fn sym_values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.sym() * scale).collect()
    }

    /// Uniform below `n` (with the slight bias of a modulo).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Little-endian bytes of successive outputs.
    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
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
        let mut rng = Rng(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }
}

//! Deterministic inputs and digests shared by the rank binary, the tests and the benchmark, so a
//! parent process can compute the expected result of ranks running elsewhere.

use super::element::Element;
use crate::rng::Rng;

/// Rank `rank`'s input for `seed`: signed values spread over several binades, so that the
/// reduction order changes the rounded result and an order bug shows up as different bits.
pub fn rank_input<T: Element>(seed: u64, rank: usize, len: usize) -> Vec<T> {
    let mut rng = Rng(seed ^ (rank as u64).wrapping_mul(0xa076_1d64_78bd_642f));
    (0..len)
        .map(|_| {
            let bits = rng.next_u64();
            let mantissa = (bits & 0xffff) as f32 / 65536.0 + 0.5;
            let exponent = ((bits >> 16) % 12) as i32 - 4;
            let sign = if bits >> 63 == 1 { -1.0 } else { 1.0 };
            T::from_acc(sign * mantissa * 2f32.powi(exponent))
        })
        .collect()
}

/// The residual every rank adds (identical on all ranks, as tensor parallelism requires).
pub fn residual_input<T: Element>(seed: u64, len: usize) -> Vec<T> {
    rank_input(seed ^ 0x5eed, usize::MAX, len)
}

/// FNV-1a over the elements' bytes: a compact fingerprint of exact bits.
pub fn digest<T: Element>(values: &[T]) -> u64 {
    bytemuck::cast_slice::<T, u8>(values)
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
}

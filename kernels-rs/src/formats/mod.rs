//! Number formats of the NVFP4 checkpoint, bit-exact with NVIDIA ModelOpt.
//!
//! - [`e2m1`]: the 4-bit element format and its nibble packing.
//! - [`e4m3`]: `float8_e4m3fn` and the unsigned UE4M3 used for block scales.
//! - [`nvfp4`]: two-level quantization (per-tensor FP32 scale, per-16 block E4M3 scale).
//! - [`swizzle`]: the 128×4 scale-factor layout block-scaled MMA kernels read.

pub mod e2m1;
pub mod e4m3;
pub mod nvfp4;
pub mod swizzle;

pub use e2m1::{E2M1_MAX, e2m1_to_f32, f32_to_e2m1, pack_e2m1, unpack_e2m1};
pub use e4m3::{E4M3_MAX, Overflow, e4m3_to_f32, f32_to_e4m3, f32_to_ue4m3, ue4m3_to_f32};
pub use nvfp4::{NVFP4_BLOCK, Nvfp4Error, Nvfp4Matrix};
pub use swizzle::SwizzledScales;

/// BF16 to f32 by the 16-bit shift that defines the format: exact for every value, a NaN
/// stays a NaN. `half`'s `to_f32` also sets the quiet bit of signalling NaNs, a compare and a
/// blend that kept its loops from widening at the speed of a shift.
#[inline(always)]
pub fn widen_bf16(w: half::bf16) -> f32 {
    f32::from_bits(u32::from(w.to_bits()) << 16)
}

/// [`widen_bf16`] of the 16 values at `p`, in one zmm.
///
/// # Safety
/// The CPU supports AVX-512F; `p` points at 16 readable BF16 values.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn widen16_bf16(p: *const half::bf16) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    let halves = unsafe { _mm256_loadu_si256(p.cast()) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
}

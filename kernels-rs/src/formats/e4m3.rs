//! `float8_e4m3fn`: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinities,
//! NaN at `0x7F`/`0xFF`, largest finite magnitude 448, smallest subnormal 2⁻⁹.
//!
//! Two conversions from `f32` exist in the field and both matter here:
//! - [`Overflow::Saturate`] is what CUDA's `__NV_SATFINITE` conversion and our kernels do:
//!   magnitudes past 448 clamp to ±448.
//! - [`Overflow::Nan`] is what `torch.Tensor.to(torch.float8_e4m3fn)` does, and therefore what
//!   ModelOpt wrote into checkpoints: a magnitude that rounds past 448 becomes NaN.
//!
//! Both round to nearest, ties to even, and agree on every input whose magnitude rounds to at
//! most 448.

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// Smallest positive (subnormal) E4M3 value, 2⁻⁹; also ModelOpt's clamp for NVFP4 block scales.
pub const E4M3_MIN_SUBNORMAL: f32 = 1.0 / 512.0;
/// The canonical NaN code (`0xFF` is the negative-signed NaN).
pub const E4M3_NAN: u8 = 0x7F;

/// What an encoder does with magnitudes that round past [`E4M3_MAX`] and with infinities.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Overflow {
    /// Clamp to ±448 (CUDA `satfinite`). NaN stays NaN.
    Saturate,
    /// Produce NaN, as PyTorch does.
    Nan,
}

/// Decodes all 256 codes once; decoding is a table look-up on every hot path.
static DECODE_TABLE: [f32; 256] = build_decode_table();

const fn decode_slow(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((code >> 3) & 0x0F) as i32;
    let mant = (code & 0x07) as i32;
    if exp == 0x0F && mant == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        mant as f32 * E4M3_MIN_SUBNORMAL
    } else {
        // (8 + m) · 2^(e − 10), built from exact powers of two so the table is exact.
        let mut scale = 1.0f32;
        let mut e = exp - 10;
        while e > 0 {
            scale *= 2.0;
            e -= 1;
        }
        while e < 0 {
            scale *= 0.5;
            e += 1;
        }
        (8 + mant) as f32 * scale
    };
    sign * magnitude
}

const fn build_decode_table() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut code = 0;
    while code < 256 {
        table[code] = decode_slow(code as u8);
        code += 1;
    }
    table
}

/// Decodes one E4M3 code to `f32` (exact).
#[inline]
pub fn e4m3_to_f32(code: u8) -> f32 {
    DECODE_TABLE[code as usize]
}

/// 2¹²⁰: what [`e4m3_to_f32_arith`]'s bit pattern is scaled by.
const TWO_POW_120: f32 = f32::from_bits((127 + 120) << 23);

/// [`e4m3_to_f32`] by arithmetic instead of the table: the same value for every code (NaN for
/// the NaN codes), written so that a loop over codes vectorizes, which the table's look-ups
/// do not (an FP8 cache's decode attention spent most of its time in them).
#[inline(always)]
pub fn e4m3_to_f32_arith(code: u8) -> f32 {
    let c = u32::from(code);
    let magnitude = c & 0x7F;
    // The exponent and mantissa bits land in f32's low exponent and high mantissa bits: the
    // value times 2⁻¹²⁰, a subnormal f32 where E4M3 is subnormal. Scaling back is exact.
    let bits = (magnitude << 20) | ((c & 0x80) << 24);
    let value = f32::from_bits(bits) * TWO_POW_120;
    if magnitude == u32::from(E4M3_NAN) {
        f32::NAN
    } else {
        value
    }
}

/// Encodes `x` with round-to-nearest-even and the given overflow policy.
///
/// Works on the `f32` bit pattern so that ties are decided exactly, never through a second
/// rounding in floating point.
pub fn f32_to_e4m3(x: f32, overflow: Overflow) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs_bits = bits & 0x7FFF_FFFF;
    if abs_bits > 0x7F80_0000 {
        return sign | E4M3_NAN;
    }
    let magnitude = encode_magnitude_rne(abs_bits);
    // Magnitude codes above 0x7E are 480 and beyond: not finite in E4M3 (0x7F is NaN).
    if magnitude > 0x7E {
        return match overflow {
            Overflow::Saturate => sign | 0x7E,
            Overflow::Nan => sign | E4M3_NAN,
        };
    }
    sign | magnitude as u8
}

/// Rounds a non-negative, non-NaN `f32` (given as bits) to the E4M3 grid, returning the code
/// of the rounded magnitude, which may exceed 0x7E when it overflows (infinity included).
fn encode_magnitude_rne(abs_bits: u32) -> u32 {
    const F32_MANT_BITS: u32 = 23;
    const E4M3_MANT_BITS: u32 = 3;
    const DROPPED: u32 = F32_MANT_BITS - E4M3_MANT_BITS;
    // Smallest normal E4M3 is 2⁻⁶: biased f32 exponent 121.
    const MIN_NORMAL_F32_EXP: u32 = 121;
    if abs_bits >= 0x7F80_0000 {
        return 0x80; // infinity: overflows under any policy
    }
    let f32_exp = abs_bits >> F32_MANT_BITS;
    if f32_exp < MIN_NORMAL_F32_EXP {
        // Subnormal region: the value in units of 2⁻⁹, rounded to an integer 0..=8
        // (8 is the smallest normal, 0x08, so the carry is naturally correct).
        let (mant, shift) = if f32_exp == 0 {
            (abs_bits & 0x7F_FFFF, 0u32) // f32 subnormals are far below 2⁻¹⁰: rounds to 0
        } else {
            (abs_bits & 0x7F_FFFF | 0x80_0000, 1u32)
        };
        if shift == 0 {
            return 0;
        }
        // value = mant · 2^(f32_exp − 150); in units of 2⁻⁹: mant · 2^(f32_exp − 141).
        let right = 141 - f32_exp; // ≥ 21 because f32_exp ≤ 120
        if right >= 32 {
            return 0;
        }
        return round_shift_rne(mant, right);
    }
    // Normal: rebias exponent (127 → 7) and round the mantissa; a carry into the exponent
    // field is exactly the right result.
    let rebased = abs_bits - ((127 - 7) << F32_MANT_BITS);
    round_shift_rne(rebased, DROPPED)
}

/// `value >> shift` rounded to nearest, ties to even.
#[inline]
fn round_shift_rne(value: u32, shift: u32) -> u32 {
    let truncated = value >> shift;
    let remainder = value & ((1u32 << shift) - 1);
    let half = 1u32 << (shift - 1);
    if remainder > half || (remainder == half && truncated & 1 == 1) {
        truncated + 1
    } else {
        truncated
    }
}

/// Encodes a non-negative scale factor as UE4M3 (the unsigned E4M3 that block-scaled MMA
/// consumes). Scales are never negative; a negative input is clamped to zero rather than
/// silently flipping the sign of a whole block.
pub fn f32_to_ue4m3(scale: f32) -> u8 {
    if scale.is_nan() {
        return E4M3_NAN;
    }
    f32_to_e4m3(scale.max(0.0), Overflow::Saturate)
}

/// Decodes a UE4M3 scale. Only the low 7 bits carry information.
#[inline]
pub fn ue4m3_to_f32(code: u8) -> f32 {
    e4m3_to_f32(code & 0x7F)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_arithmetic_decode_is_the_table() {
        for code in 0..=255u8 {
            let (table, arith) = (e4m3_to_f32(code), e4m3_to_f32_arith(code));
            if table.is_nan() {
                assert!(arith.is_nan(), "code {code:#04x}: {arith} is not NaN");
            } else {
                assert_eq!(arith.to_bits(), table.to_bits(), "code {code:#04x}");
            }
        }
    }

    #[test]
    fn every_code_round_trips_through_f32() {
        for code in 0u16..=255 {
            let code = code as u8;
            let value = e4m3_to_f32(code);
            if code & 0x7F == E4M3_NAN {
                assert!(value.is_nan(), "code {code:#04x}");
                assert_eq!(f32_to_e4m3(value, Overflow::Nan) & 0x7F, E4M3_NAN);
                continue;
            }
            for policy in [Overflow::Saturate, Overflow::Nan] {
                assert_eq!(
                    f32_to_e4m3(value, policy),
                    code,
                    "code {code:#04x} = {value}"
                );
            }
        }
    }

    #[test]
    fn decoded_grid_is_monotonic_with_expected_extremes() {
        let positives: Vec<f32> = (0u8..0x7F).map(e4m3_to_f32).collect();
        assert!(positives.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(positives[1], E4M3_MIN_SUBNORMAL);
        assert_eq!(positives[0x7E], E4M3_MAX);
        assert_eq!(e4m3_to_f32(0x08), 1.0 / 64.0);
    }

    #[test]
    fn midpoints_round_to_even_codes() {
        for code in 0u8..0x7E {
            let lo = e4m3_to_f32(code);
            let hi = e4m3_to_f32(code + 1);
            let mid = (lo + hi) / 2.0; // exact: both are short binary fractions
            let even = if code % 2 == 0 { code } else { code + 1 };
            assert_eq!(
                f32_to_e4m3(mid, Overflow::Saturate),
                even,
                "between {lo} and {hi}"
            );
            assert_eq!(f32_to_e4m3(-mid, Overflow::Saturate), even | 0x80);
            let just_above = f32::from_bits(mid.to_bits() + 1);
            assert_eq!(f32_to_e4m3(just_above, Overflow::Saturate), code + 1);
            let just_below = f32::from_bits(mid.to_bits() - 1);
            assert_eq!(f32_to_e4m3(just_below, Overflow::Saturate), code);
        }
    }

    #[test]
    fn overflow_policies_differ_only_past_the_largest_finite_value() {
        assert_eq!(f32_to_e4m3(463.9, Overflow::Nan), 0x7E);
        assert_eq!(f32_to_e4m3(464.0, Overflow::Nan), 0x7E); // tie to even (448)
        assert_eq!(f32_to_e4m3(464.1, Overflow::Nan), E4M3_NAN);
        assert_eq!(f32_to_e4m3(464.1, Overflow::Saturate), 0x7E);
        assert_eq!(f32_to_e4m3(f32::INFINITY, Overflow::Saturate), 0x7E);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY, Overflow::Saturate), 0xFE);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY, Overflow::Nan), 0xFF);
        assert_eq!(f32_to_e4m3(1e30, Overflow::Nan), E4M3_NAN);
    }

    #[test]
    fn tiny_values_flush_with_correct_rounding() {
        assert_eq!(f32_to_e4m3(0.0, Overflow::Saturate), 0x00);
        assert_eq!(f32_to_e4m3(-0.0, Overflow::Saturate), 0x80);
        assert_eq!(
            f32_to_e4m3(E4M3_MIN_SUBNORMAL / 2.0, Overflow::Saturate),
            0x00
        );
        let above_half = f32::from_bits((E4M3_MIN_SUBNORMAL / 2.0).to_bits() + 1);
        assert_eq!(f32_to_e4m3(above_half, Overflow::Saturate), 0x01);
        assert_eq!(f32_to_e4m3(f32::from_bits(1), Overflow::Saturate), 0x00);
        assert_eq!(f32_to_e4m3(1e-30, Overflow::Saturate), 0x00);
    }

    #[test]
    fn unsigned_scales_never_carry_a_sign() {
        assert_eq!(f32_to_ue4m3(-3.0), 0x00);
        assert_eq!(f32_to_ue4m3(1000.0), 0x7E);
        assert_eq!(ue4m3_to_f32(0x80 | 0x38), 1.0);
    }
}

//! E2M1 (FP4): 1 sign bit, 2 exponent bits, 1 mantissa bit. Magnitudes
//! {0, 0.5, 1, 1.5, 2, 3, 4, 6}; bit 3 is the sign, so code 8 is negative zero.
//!
//! Packing follows the checkpoint: two codes per byte, the **low nibble holds the even (first)
//! element**.

/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// Value of each of the 16 codes. Code 8 is "−0" in the format but decodes to +0.0, as in
/// ModelOpt's table, so that dequantized tensors match its output bit for bit.
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Midpoints between neighbouring magnitudes. A magnitude equal to a midpoint goes to the
/// neighbour with the even mantissa: down at 0.25, 1.25, 2.5 and 5; up at 0.75, 1.75 and 3.5.
const MIDPOINTS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
const MIDPOINTS_ROUNDING_UP: [f32; 3] = [0.75, 1.75, 3.5];

/// Decodes one 4-bit code (the high nibble of `code` is ignored).
#[inline]
pub fn e2m1_to_f32(code: u8) -> f32 {
    E2M1_VALUES[(code & 0x0F) as usize]
}

/// Encodes `x` exactly as ModelOpt's `NVFP4QTensor._cast_fp4` does: round to nearest with ties
/// to the even code, saturation at ±6, the sign bit set for every negative input (so small
/// negatives become code 8, "−0"), `-0.0` mapped to code 0, and NaN mapped to code 7.
#[inline]
pub fn f32_to_e2m1(x: f32) -> u8 {
    let sign_bit = u8::from(x < 0.0) << 3;
    let magnitude = x.abs();
    let ordinal = if magnitude.is_nan() {
        // torch.searchsorted places NaN after every bound.
        MIDPOINTS.len() as u8
    } else {
        MIDPOINTS.iter().filter(|&&bound| bound < magnitude).count() as u8
    };
    let rounds_up = u8::from(MIDPOINTS_ROUNDING_UP.contains(&magnitude));
    sign_bit + ordinal + rounds_up
}

/// Packs codes two per byte, low nibble first. `codes.len()` must be even.
pub fn pack_e2m1(codes: &[u8], packed: &mut [u8]) {
    assert_eq!(
        codes.len(),
        packed.len() * 2,
        "pack_e2m1: {} codes into {} bytes",
        codes.len(),
        packed.len()
    );
    for (byte, pair) in packed.iter_mut().zip(codes.chunks_exact(2)) {
        *byte = (pair[0] & 0x0F) | ((pair[1] & 0x0F) << 4);
    }
}

/// Unpacks bytes into codes, low nibble first.
pub fn unpack_e2m1(packed: &[u8], codes: &mut [u8]) {
    assert_eq!(
        codes.len(),
        packed.len() * 2,
        "unpack_e2m1: {} bytes into {} codes",
        packed.len(),
        codes.len()
    );
    for (byte, pair) in packed.iter().zip(codes.chunks_exact_mut(2)) {
        pair[0] = byte & 0x0F;
        pair[1] = byte >> 4;
    }
}

/// Decodes the two elements of one packed byte: `(even, odd)`.
#[inline]
pub fn decode_e2m1_pair(byte: u8) -> (f32, f32) {
    (e2m1_to_f32(byte), e2m1_to_f32(byte >> 4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_except_negative_zero() {
        for code in 0u8..16 {
            let value = e2m1_to_f32(code);
            let expected = if code == 8 { 0 } else { code };
            assert_eq!(f32_to_e2m1(value), expected, "code {code} = {value}");
        }
    }

    #[test]
    fn ties_go_to_the_even_code_and_large_values_saturate() {
        let cases = [
            (0.25, 0),
            (0.2500001, 1),
            (0.75, 2),
            (0.7499999, 1),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (5.0000005, 7),
            (1e30, 7),
            (f32::INFINITY, 7),
        ];
        for (x, code) in cases {
            assert_eq!(f32_to_e2m1(x), code, "{x}");
            assert_eq!(f32_to_e2m1(-x), code | 8, "-{x}");
        }
    }

    #[test]
    fn signs_follow_modelopt() {
        assert_eq!(f32_to_e2m1(-0.0), 0);
        assert_eq!(f32_to_e2m1(-0.1), 8);
        assert_eq!(f32_to_e2m1(f32::NAN), 7);
    }

    #[test]
    fn low_nibble_is_the_even_element() {
        let mut packed = [0u8; 2];
        pack_e2m1(&[0x1, 0x2, 0xF, 0x8], &mut packed);
        assert_eq!(packed, [0x21, 0x8F]);
        let mut codes = [0u8; 4];
        unpack_e2m1(&packed, &mut codes);
        assert_eq!(codes, [0x1, 0x2, 0xF, 0x8]);
        assert_eq!(decode_e2m1_pair(0x21), (0.5, 1.0));
    }
}

// Rounding of exact values to the narrow floating-point formats CUDA's headers convert to:
// BF16, and the OCP FP8 formats E4M3 and E5M2. One routine does all three (round to nearest,
// ties to even, gradual underflow), so each format is defined by its parameters alone.
#pragma once

#include <math.h>

#include <cstdint>

namespace cuhost::numerics {

struct Format {
  int mantissa_bits;  // stored fraction bits
  int exponent_bits;
  int bias;
  bool has_infinity;  // E4M3 has none: its all-ones exponent still holds finite values
};

constexpr Format kBf16{7, 8, 127, true};
constexpr Format kE4m3{3, 4, 7, false};
constexpr Format kE5m2{2, 5, 15, true};

// Largest finite magnitude of the format.
inline double max_finite(const Format& f) {
  const int top_exp = (1 << f.exponent_bits) - 1 - (f.has_infinity ? 1 : 0) - f.bias;
  // E4M3 reserves only the all-ones code (S.1111.111) for NaN, so its largest mantissa is 110.
  const int top_mantissa = (1 << f.mantissa_bits) - 1 - (f.has_infinity ? 0 : 1);
  return ldexp(1.0 + double(top_mantissa) / double(1 << f.mantissa_bits), top_exp);
}

// `x` (finite, any magnitude) rounded to the format's precision with unbounded exponent range
// above and gradual underflow below: the value the format holds if it does not overflow.
inline double round_to(const Format& f, double x) {
  if (x == 0.0 || !isfinite(x)) return x;
  int e;
  frexp(fabs(x), &e);  // |x| = m · 2^e, m ∈ [0.5, 1)
  const int emin = 1 - f.bias;
  // Exponent of the last kept bit: the format's ulp at this magnitude, clamped at the
  // subnormal ulp.
  int ulp_exp = (e - 1) - f.mantissa_bits;
  if (ulp_exp < emin - f.mantissa_bits) ulp_exp = emin - f.mantissa_bits;
  const double scaled = ldexp(x, -ulp_exp);  // exact: a power-of-two scaling
  return ldexp(nearbyint(scaled), ulp_exp);  // the default rounding mode is ties-to-even
}

// Bits of the format for a value that round_to() produced and that does not overflow.
inline uint32_t encode_exact(const Format& f, double v) {
  const uint32_t sign = signbit(v) ? 1u << (f.mantissa_bits + f.exponent_bits) : 0u;
  const double a = fabs(v);
  if (a == 0.0) return sign;
  int e;
  const double m = frexp(a, &e);  // a = m · 2^e
  const int unbiased = e - 1;
  const int emin = 1 - f.bias;
  if (unbiased < emin) {  // subnormal: a = k · 2^(emin - mantissa_bits)
    const uint32_t k = uint32_t(ldexp(a, f.mantissa_bits - emin));
    return sign | k;
  }
  const uint32_t frac = uint32_t(ldexp(m * 2.0 - 1.0, f.mantissa_bits));
  return sign | (uint32_t(unbiased + f.bias) << f.mantissa_bits) | frac;
}

inline double decode(const Format& f, uint32_t bits) {
  const int total = 1 + f.exponent_bits + f.mantissa_bits;
  const bool neg = (bits >> (total - 1)) & 1;
  const uint32_t exp_field = (bits >> f.mantissa_bits) & ((1u << f.exponent_bits) - 1);
  const uint32_t frac = bits & ((1u << f.mantissa_bits) - 1);
  const uint32_t all_ones = (1u << f.exponent_bits) - 1;
  double v;
  if (f.has_infinity && exp_field == all_ones) {
    v = frac == 0 ? INFINITY : NAN;
  } else if (!f.has_infinity && exp_field == all_ones && frac == (1u << f.mantissa_bits) - 1) {
    v = NAN;
  } else if (exp_field == 0) {
    v = ldexp(double(frac), 1 - f.bias - f.mantissa_bits);
  } else {
    v = ldexp(1.0 + ldexp(double(frac), -f.mantissa_bits), int(exp_field) - f.bias);
  }
  return neg ? -v : v;
}

}  // namespace cuhost::numerics

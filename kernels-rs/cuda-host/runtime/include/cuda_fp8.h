// Host stand-in for <cuda_fp8.h>: FP8 storage types and the float → FP8 conversions with the
// device semantics: round to nearest even; __NV_SATFINITE clamps to the largest finite value
// (±448 for E4M3, ±57344 for E5M2, infinities included), __NV_NOSAT overflows to NaN (E4M3)
// or infinity (E5M2); NaN stays NaN (0x7F / 0xFF).
#pragma once

#include "cuda_bf16.h"
#include "cuda_host.h"
#include "cuda_host_numerics.h"

typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
typedef unsigned int __nv_fp8x4_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };

namespace cuhost::detail {
inline __nv_fp8_storage_t fp8_from_double(double x, __nv_saturation_t sat,
                                          __nv_fp8_interpretation_t interp) {
  const ::cuhost::numerics::Format& f =
      interp == __NV_E4M3 ? ::cuhost::numerics::kE4m3 : ::cuhost::numerics::kE5m2;
  const uint32_t sign = signbit(x) ? 0x80u : 0u;
  if (x != x) return 0x7f;
  const double maxf = ::cuhost::numerics::max_finite(f);
  const double r = ::cuhost::numerics::round_to(f, x);
  if (isinf(r) || fabs(r) > maxf) {
    if (sat == __NV_SATFINITE) return __nv_fp8_storage_t(sign | ::cuhost::numerics::encode_exact(f, maxf));
    // No saturation: E4M3 has no infinity, so overflow is NaN; E5M2 overflows to infinity.
    return __nv_fp8_storage_t(interp == __NV_E4M3 ? (sign | 0x7f) : (sign | 0x7c));
  }
  return __nv_fp8_storage_t(::cuhost::numerics::encode_exact(f, r));
}
}  // namespace cuhost::detail

namespace cuhost::detail {
// E4M3 from f32 with integer rounding (the kernels' hot conversion): the same results as
// fp8_from_double, which stays the definition (and E5M2's path).
inline __nv_fp8_storage_t e4m3_from_float(float x, __nv_saturation_t sat) {
  const unsigned u = __float_as_uint(x);
  const unsigned sign = (u >> 24) & 0x80u;
  const unsigned a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;  // NaN
  const float mag = __uint_as_float(a);
  unsigned code;
  if (mag < 0.015625f) {  // below 2^-6: subnormal codes, multiples of 2^-9
    code = unsigned(nearbyintf(mag * 512.0f));  // exact scaling, ties to even; 8 is 2^-6
  } else {
    // Round the 23-bit mantissa to 3 bits, ties to even; a carry moves to the next binade.
    const unsigned exp = (a >> 23) - 127 + 7;
    const unsigned m = a & 0x7fffffu;
    const unsigned rounded = (m + 0x7ffffu + ((m >> 20) & 1u)) >> 20;
    code = exp > 15 ? 0x7f : (exp << 3) + rounded;  // exp > 15: far beyond 448 (or inf)
  }
  if (code > 0x7e) return __nv_fp8_storage_t(sign | (sat == __NV_SATFINITE ? 0x7e : 0x7f));
  return __nv_fp8_storage_t(sign | code);
}
}  // namespace cuhost::detail

inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat,
                                                __nv_fp8_interpretation_t interp) {
  if (interp == __NV_E4M3) return ::cuhost::detail::e4m3_from_float(x, sat);
  return ::cuhost::detail::fp8_from_double(x, sat, interp);
}
inline __nv_fp8_storage_t __nv_cvt_double_to_fp8(double x, __nv_saturation_t sat,
                                                 __nv_fp8_interpretation_t interp) {
  // The device converts double through a single rounding as well.
  return ::cuhost::detail::fp8_from_double(x, sat, interp);
}
inline __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 x, __nv_saturation_t sat,
                                                     __nv_fp8_interpretation_t interp) {
  return __nv_fp8x2_storage_t(__nv_cvt_float_to_fp8(x.x, sat, interp) |
                              (unsigned(__nv_cvt_float_to_fp8(x.y, sat, interp)) << 8));
}
inline __nv_fp8_storage_t __nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16 x, __nv_saturation_t sat,
                                                      __nv_fp8_interpretation_t interp) {
  return __nv_cvt_float_to_fp8(__bfloat162float(x), sat, interp);
}

inline float cuhost_fp8_to_float(__nv_fp8_storage_t v, __nv_fp8_interpretation_t interp) {
  return float(::cuhost::numerics::decode(
      interp == __NV_E4M3 ? ::cuhost::numerics::kE4m3 : ::cuhost::numerics::kE5m2, v));
}

struct __nv_fp8_e4m3 {
  __nv_fp8_storage_t __x;
  __nv_fp8_e4m3() = default;
  explicit __nv_fp8_e4m3(float f) : __x(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3)) {}
  explicit operator float() const { return cuhost_fp8_to_float(__x, __NV_E4M3); }
};
struct __nv_fp8_e5m2 {
  __nv_fp8_storage_t __x;
  __nv_fp8_e5m2() = default;
  explicit __nv_fp8_e5m2(float f) : __x(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E5M2)) {}
  explicit operator float() const { return cuhost_fp8_to_float(__x, __NV_E5M2); }
};

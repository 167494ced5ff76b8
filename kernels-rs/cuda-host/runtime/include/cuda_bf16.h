// Host stand-in for <cuda_bf16.h>: the BF16 storage types and the conversions and arithmetic
// the kernels use, with the device semantics (round to nearest even, NaN to the canonical
// 0x7FFF, subnormals kept).
#pragma once

#include "cuda_host.h"
#include "cuda_host_numerics.h"

struct __nv_bfloat16 {
  unsigned short __x;
};
struct __attribute__((aligned(4))) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

namespace cuhost::detail {
inline __nv_bfloat16 bf16_from_double(double v) {
  if (v != v) return __nv_bfloat16{0x7fff};
  const double r = ::cuhost::numerics::round_to(::cuhost::numerics::kBf16, v);
  if (!isfinite(r) || fabs(r) > ::cuhost::numerics::max_finite(::cuhost::numerics::kBf16))
    return __nv_bfloat16{static_cast<unsigned short>(signbit(r) ? 0xff80 : 0x7f80)};
  return __nv_bfloat16{
      static_cast<unsigned short>(::cuhost::numerics::encode_exact(::cuhost::numerics::kBf16, r))};
}
}  // namespace cuhost::detail

inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(unsigned(h.__x) << 16); }
// BF16 is the upper half of an f32, so rounding the f32's bits to nearest even at bit 16 is
// the correctly rounded conversion for every finite value (subnormals included; a carry
// into the exponent is the right next binade, up to infinity).
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fff};
  return __nv_bfloat16{static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
  return float2{__bfloat162float(v.x), __bfloat162float(v.y)};
}
inline float __low2float(__nv_bfloat162 v) { return __bfloat162float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return __bfloat162float(v.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 v) { return v.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 v) { return v.y; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return __nv_bfloat162{lo, hi};
}
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 v) { return __nv_bfloat162{v, v}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 v) { return v.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short v) { return __nv_bfloat16{v}; }

// Arithmetic: the exact result (products of two BF16 values are exact in double) rounded once.
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) {
  return ::cuhost::detail::bf16_from_double(double(__bfloat162float(a)) * __bfloat162float(b));
}
inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) {
  return ::cuhost::detail::bf16_from_double(double(__bfloat162float(a)) + __bfloat162float(b));
}
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) {
  return ::cuhost::detail::bf16_from_double(double(__bfloat162float(a)) - __bfloat162float(b));
}
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return ::cuhost::detail::bf16_from_double(double(__bfloat162float(a)) * __bfloat162float(b) +
                                            __bfloat162float(c));
}
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return __nv_bfloat162{__hmul(a.x, b.x), __hmul(a.y, b.y)};
}
inline __nv_bfloat162 __hadd2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return __nv_bfloat162{__hadd(a.x, b.x), __hadd(a.y, b.y)};
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return __nv_bfloat162{__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)};
}

// The GPU's numerics, approximately, for the kernel modules of the `gpu-numerics` build
// (cuda-host feature `gpu-numerics`, macro CUDA_HOST_GPU_NUMERICS):
// - multiply-adds contracted into FMAs, as nvcc does by default (-fmad=true): build.rs
//   compiles the modules with -mfma -ffp-contract=fast, so g++ fuses where it can;
// - expf and __expf 1 or 2 ulp away from the correctly rounded value, up or down by a hash of
//   the argument, as the GPU's ex2.approx-based exponential is.
// The exact build stays the reference; a test that passes there and fails here compares
// bits a GPU would not reproduce, and needs a tolerance (with the reason beside it).
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

namespace cuhost_gpu_numerics {
inline float exp_off(float x) {
  float r = ::expf(x);
  if (!isfinite(r) || r == 0.0f) return r;
  uint32_t h;
  memcpy(&h, &x, sizeof h);
  h ^= h >> 15;
  h *= 0x2c1b3c6du;
  h ^= h >> 12;
  const int pick = int(h & 3);  // -2, -1, +1, +2 ulp
  int k = pick < 2 ? pick - 2 : pick - 1;
  for (; k > 0; --k) r = nextafterf(r, INFINITY);
  for (; k < 0; ++k) r = nextafterf(r, 0.0f);
  return r;
}
}  // namespace cuhost_gpu_numerics

#define expf(x) ::cuhost_gpu_numerics::exp_off(x)
#define __expf(x) ::cuhost_gpu_numerics::exp_off(x)

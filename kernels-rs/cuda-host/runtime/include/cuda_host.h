// The CUDA C++ surface for host execution: what a kernel source needs from nvcc and the CUDA
// headers, implemented for g++ so the unmodified `.cu` files compile as C++ for the CPU.
//
// Every generated translation unit force-includes this header (build.rs), then one kernel
// source with its tactic's -D macros. The kernels then run on the runtime of runtime.cpp:
// blocks on a worker pool, the threads of a block as fibers that switch at barriers and warp
// collectives, `__shared__` storage per worker thread (a worker runs one block at a time).
//
// Semantics follow the CUDA C++ Programming Guide and the PTX ISA; where the hardware
// leaves something undefined (a barrier some threads never reach, a shuffle from a lane
// outside the mask, a misaligned vector access) the runtime reports an error for the launch
// instead of guessing.
#pragma once

#define CUDA_HOST_EXECUTION 1

#include <math.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

// ------------------------------------------------------------------ keywords

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
#define __constant__ const
// One instance per worker thread: a worker runs one block at a time and every thread of that
// block runs on it (as a fiber), so thread-local storage is exactly per-block storage.
#define __shared__ thread_local

#include "cuda_host_runtime.h"

namespace cuhost {
[[noreturn]] void kernel_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
}  // namespace cuhost

#define threadIdx (::cuhost::thread_idx())
#define blockIdx (::cuhost::block_idx())
#define blockDim (::cuhost::block_dim())
#define gridDim (::cuhost::grid_dim())
constexpr int warpSize = 32;

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

// ------------------------------------------------------------------ vector types
// Sizes and alignments of CUDA's vector_types.h: 8-byte types align to 8, 16-byte to 16, so
// reinterpret_casts in kernels keep their alignment requirements.

#define CUHOST_VEC2(T, name, align)          \
  struct __attribute__((aligned(align))) name { \
    T x, y;                                  \
  };
#define CUHOST_VEC4(T, name, align)          \
  struct __attribute__((aligned(align))) name { \
    T x, y, z, w;                            \
  };
CUHOST_VEC2(unsigned, uint2, 8)
CUHOST_VEC4(unsigned, uint4, 16)
CUHOST_VEC2(int, int2, 8)
CUHOST_VEC4(int, int4, 16)
CUHOST_VEC2(float, float2, 8)
CUHOST_VEC4(float, float4, 16)
CUHOST_VEC2(unsigned short, ushort2, 4)
CUHOST_VEC4(unsigned short, ushort4, 8)
CUHOST_VEC2(unsigned long long, ulonglong2, 16)
#undef CUHOST_VEC2
#undef CUHOST_VEC4
struct uint3 {
  unsigned x, y, z;
};

inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline ushort2 make_ushort2(unsigned short x, unsigned short y) { return ushort2{x, y}; }

// ------------------------------------------------------------------ bit casts and integer intrinsics

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
inline double __longlong_as_double(long long v) {
  double d;
  std::memcpy(&d, &v, 8);
  return d;
}
inline long long __double_as_longlong(double d) {
  long long v;
  std::memcpy(&v, &d, 8);
  return v;
}

// prmt in its default mode: result byte n is byte (s >> 4n) & 7 of the 8-byte value {y, x}.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= unsigned((v >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
  return r;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
  const uint64_t v = (uint64_t(hi) << 32) | lo;
  return unsigned((v << (shift & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  const uint64_t v = (uint64_t(hi) << 32) | lo;
  return unsigned(v >> (shift & 31));
}

// Device min/max are global overloads in CUDA.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

// ------------------------------------------------------------------ math intrinsics
// The fast-math intrinsics (ex2.approx and friends) are approximations on the GPU; here they
// are the correctly rounded libm functions, so host results differ from a GPU's by the
// intrinsics' documented error (2 ulp for __expf at moderate arguments).

inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }

#ifdef CUDA_HOST_GPU_NUMERICS
#include "cuda_host_gpu_numerics.h"
#endif

// ------------------------------------------------------------------ synchronization

namespace cuhost {
void syncthreads();
int syncthreads_reduce(int predicate, int op);  // 0 count, 1 and, 2 or
void bar_sync(unsigned id, unsigned count);
void syncwarp(unsigned mask);
unsigned activemask();
void fence();
void nanosleep(unsigned ns);
long long clock64();
}  // namespace cuhost

inline void __syncthreads() { ::cuhost::syncthreads(); }
inline int __syncthreads_count(int p) { return ::cuhost::syncthreads_reduce(p, 0); }
inline int __syncthreads_and(int p) { return ::cuhost::syncthreads_reduce(p, 1); }
inline int __syncthreads_or(int p) { return ::cuhost::syncthreads_reduce(p, 2); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::cuhost::syncwarp(mask); }
inline unsigned __activemask() { return ::cuhost::activemask(); }
inline void __threadfence() { ::cuhost::fence(); }
inline void __threadfence_block() { ::cuhost::fence(); }
inline void __threadfence_system() { ::cuhost::fence(); }
inline void __nanosleep(unsigned ns) { ::cuhost::nanosleep(ns); }
inline long long clock64() { return ::cuhost::clock64(); }
[[noreturn]] inline void __trap() { ::cuhost::kernel_error("__trap() executed"); }

// ------------------------------------------------------------------ warp shuffles and votes

namespace cuhost {
// One warp-collective shuffle of an up-to-8-byte value. `mode`: 0 idx, 1 up, 2 down, 3 xor.
uint64_t shfl(unsigned mask, uint64_t value, int lane_arg, int width, int mode, const char* what);
unsigned vote(unsigned mask, int predicate, int mode, const char* what);  // 0 all, 1 any, 2 ballot
}  // namespace cuhost

namespace cuhost::detail {
template <class T>
inline T shfl_as(unsigned mask, T var, int lane_arg, int width, int mode, const char* what) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = ::cuhost::shfl(mask, bits, lane_arg, width, mode, what);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
}  // namespace cuhost::detail

template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return ::cuhost::detail::shfl_as(mask, var, src_lane, width, 0, "__shfl_sync");
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::cuhost::detail::shfl_as(mask, var, int(delta), width, 1, "__shfl_up_sync");
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::cuhost::detail::shfl_as(mask, var, int(delta), width, 2, "__shfl_down_sync");
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return ::cuhost::detail::shfl_as(mask, var, lane_mask, width, 3, "__shfl_xor_sync");
}
inline int __all_sync(unsigned mask, int p) { return int(::cuhost::vote(mask, p, 0, "__all_sync")); }
inline int __any_sync(unsigned mask, int p) { return int(::cuhost::vote(mask, p, 1, "__any_sync")); }
inline unsigned __ballot_sync(unsigned mask, int p) {
  return ::cuhost::vote(mask, p, 2, "__ballot_sync");
}

// ------------------------------------------------------------------ atomics
// Device-scope atomics are sequentially consistent here (at least as strong as the GPU's
// relaxed device atomics). Fibers of one block share an OS thread; blocks on other workers
// and other ranks are other OS threads, so these are real atomic instructions.

namespace cuhost::detail {
template <class T, class F>
inline T atomic_update(T* p, F f) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(p, &old, f(old), true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <class T>
inline T atomic_float_add(T* p, T v) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  U* up = reinterpret_cast<U*>(p);
  U old = __atomic_load_n(up, __ATOMIC_RELAXED);
  for (;;) {
    T f;
    std::memcpy(&f, &old, sizeof(T));
    f += v;
    U next;
    std::memcpy(&next, &f, sizeof(T));
    if (__atomic_compare_exchange_n(up, &old, next, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
      std::memcpy(&f, &old, sizeof(T));
      return f;
    }
  }
}
}  // namespace cuhost::detail

#define CUHOST_INT_ATOMICS(T)                                                                 \
  inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }        \
  inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }        \
  inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }      \
  inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }        \
  inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }          \
  inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST); }        \
  inline T atomicMax(T* p, T v) {                                                             \
    return ::cuhost::detail::atomic_update(p, [v](T o) { return o > v ? o : v; });            \
  }                                                                                           \
  inline T atomicMin(T* p, T v) {                                                             \
    return ::cuhost::detail::atomic_update(p, [v](T o) { return o < v ? o : v; });            \
  }                                                                                           \
  inline T atomicCAS(T* p, T cmp, T v) {                                                      \
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);      \
    return cmp;                                                                               \
  }
CUHOST_INT_ATOMICS(int)
CUHOST_INT_ATOMICS(unsigned)
CUHOST_INT_ATOMICS(unsigned long long)
#undef CUHOST_INT_ATOMICS
inline float atomicAdd(float* p, float v) { return ::cuhost::detail::atomic_float_add(p, v); }
inline double atomicAdd(double* p, double v) { return ::cuhost::detail::atomic_float_add(p, v); }
// atomicInc/atomicDec with CUDA's wrap-around semantics.
inline unsigned atomicInc(unsigned* p, unsigned limit) {
  return ::cuhost::detail::atomic_update(p, [limit](unsigned o) { return o >= limit ? 0u : o + 1; });
}
inline unsigned atomicDec(unsigned* p, unsigned limit) {
  return ::cuhost::detail::atomic_update(
      p, [limit](unsigned o) { return (o == 0 || o > limit) ? limit : o - 1; });
}

// ------------------------------------------------------------------ address spaces

namespace cuhost {
// Offset of `p` in the calling block's dynamic shared memory (the 32-bit shared window
// address PTX uses); other addresses (static `__shared__` variables live in thread-local
// storage here) map to their low 32 bits, which only the host branches of the PTX helpers
// could misuse, and they take pointers instead.
size_t shared_offset(const void* p);
}  // namespace cuhost

inline size_t __cvta_generic_to_shared(const void* p) {
  return ::cuhost::shared_offset(p);
}

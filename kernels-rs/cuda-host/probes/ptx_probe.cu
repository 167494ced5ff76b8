// Probe kernels for the PTX helpers (kernels-rs/include/ptx_helpers.cuh): each runs one
// instruction on operands read from global memory and writes what every lane got back, so the
// host execution layer's semantics can be checked against independent references
// (tests/ptx_semantics.rs) and, on a GPU, against the hardware (the `ptx-probe-check` binary:
// the same inputs on the device and on the host layer, compared). Also kernels that break the
// programming model on purpose, to check that the host layer reports them instead of hanging
// or passing: those are never launched on a GPU.

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ptx_helpers.cuh"

namespace probe {

struct MmaOperands {
  const uint32_t* a;  // [32][4]: each lane's A registers
  const uint32_t* b;  // [32][2]
  const float* c;     // [32][4]
  const uint32_t* sfa;  // [32]
  const uint32_t* sfb;  // [32]
  float* d;             // [32][4]
};

__device__ __forceinline__ void load_lane(const MmaOperands& o, uint32_t (&a)[4], uint32_t (&b)[2],
                                          float (&acc)[4]) {
  const int l = threadIdx.x & 31;
  for (int i = 0; i < 4; ++i) a[i] = o.a[4 * l + i];
  for (int i = 0; i < 2; ++i) b[i] = o.b[2 * l + i];
  for (int i = 0; i < 4; ++i) acc[i] = o.c[4 * l + i];
}

__device__ __forceinline__ void store_lane(const MmaOperands& o, const float (&acc)[4]) {
  const int l = threadIdx.x & 31;
  for (int i = 0; i < 4; ++i) o.d[4 * l + i] = acc[i];
}

}  // namespace probe

using namespace probe;

extern "C" __global__ void probe_mma_bf16(const MmaOperands o) {
  uint32_t a[4], b[2];
  float acc[4];
  load_lane(o, a, b, acc);
  mma_bf16(acc, a, b[0], b[1]);
  store_lane(o, acc);
}

extern "C" __global__ void probe_mma_e4m3(const MmaOperands o) {
  uint32_t a[4], b[2];
  float acc[4];
  load_lane(o, a, b, acc);
  mma_e4m3(acc, a, b[0], b[1]);
  store_lane(o, acc);
}

// The block-scaled FP4 MMA exists only on sm_120a; elsewhere this probe traps.
extern "C" __global__ void probe_mma_nvf4(const MmaOperands o) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM120_ALL)
  __trap();
#else
  uint32_t a[4], b[2];
  float acc[4];
  load_lane(o, a, b, acc);
  const int l = threadIdx.x & 31;
  mma_nvf4_4x(acc, a, b, o.sfa[l], o.sfb[l]);
  store_lane(o, acc);
#endif
}

// ldmatrix: `tile` holds four 8×8 matrices of b16 values, row-major; they are staged in shared
// memory with a padded row stride and every lane points at the row the ISA assigns it.
// out[lane][0..4] receives the registers.
extern "C" __global__ void probe_ldmatrix(const uint16_t* tile, uint32_t* out, int num, int trans) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int kStride = 24;  // elements per staged row (48 bytes: rows stay 16-byte aligned)
  uint16_t* s = reinterpret_cast<uint16_t*>(smem);
  for (int i = threadIdx.x; i < 4 * 8 * 8; i += blockDim.x) s[(i / 8) * kStride + i % 8] = tile[i];
  __syncthreads();
  const int l = threadIdx.x & 31;
  const void* row = s + l * kStride;  // lane l: matrix l/8, row l%8
  uint32_t r[4] = {0, 0, 0, 0};
  if (num == 1) {
    uint32_t x[1];
    trans ? ldsm_x1_t(x, row) : ldsm_x1(x, row);
    r[0] = x[0];
  } else if (num == 2) {
    uint32_t x[2];
    trans ? ldsm_x2_t(x, row) : ldsm_x2(x, row);
    r[0] = x[0];
    r[1] = x[1];
  } else {
    trans ? ldsm_x4_t(r, row) : ldsm_x4(r, row);
  }
  for (int i = 0; i < 4; ++i) out[4 * l + i] = r[i];
}

// cp.async: each thread copies 16 bytes (bytes [16t, 16t + 16) of src; `zero_fill` threads
// pass an invalid source). `early` records what shared memory held before the wait, `late`
// after it. Groups: the first half of the threads' copies go into one group, then a second
// group; wait_group 1 must complete exactly the first.
extern "C" __global__ void probe_cp_async(const uint8_t* src, uint8_t* early, uint8_t* middle,
                                          uint8_t* late, int zero_fill_from) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int t = threadIdx.x, n = blockDim.x;
  cp_async16(smem + 16 * t, src + 16 * t, t < zero_fill_from);
  cp_async_commit();
  cp_async16(smem + 16 * (n + t), src + 16 * (n + t), t < zero_fill_from);
  cp_async_commit();
  for (int i = 0; i < 16; ++i) early[16 * t + i] = smem[16 * t + i];
  cp_async_wait<1>();
  for (int i = 0; i < 16; ++i) {
    middle[16 * t + i] = smem[16 * t + i];
    middle[16 * (n + t) + i] = smem[16 * (n + t) + i];
  }
  cp_async_wait<0>();
  for (int i = 0; i < 16; ++i) {
    late[16 * t + i] = smem[16 * t + i];
    late[16 * (n + t) + i] = smem[16 * (n + t) + i];
  }
}

// Shuffles and votes: out[lane][k] for k = idx, up 3, down 5, xor 9, idx within width 8,
// xor 1 within width 4, ballot, any, all.
extern "C" __global__ void probe_warp(const int* in, int* out) {
  const int l = threadIdx.x & 31;
  const int v = in[l];
  int* o = out + 9 * l;
  o[0] = __shfl_sync(0xffffffffu, v, (l * 7 + 3) & 31);
  o[1] = __shfl_up_sync(0xffffffffu, v, 3);
  o[2] = __shfl_down_sync(0xffffffffu, v, 5);
  o[3] = __shfl_xor_sync(0xffffffffu, v, 9);
  o[4] = __shfl_sync(0xffffffffu, v, 2, 8);
  o[5] = __shfl_xor_sync(0xffffffffu, v, 1, 4);
  o[6] = int(__ballot_sync(0xffffffffu, v & 1));
  o[7] = __any_sync(0xffffffffu, v > 1000);
  o[8] = __all_sync(0xffffffffu, v >= 0);
}

// Block 0 publishes a value and raises a flag with st.release; block 1 polls with ld.acquire
// (bounded by %globaltimer) and reads the value. Needs both blocks resident at once.
extern "C" __global__ void probe_flags(uint64_t* flag, uint64_t* data, uint64_t* seen,
                                       uint64_t timeout_ns) {
  if (threadIdx.x != 0) return;
  if (blockIdx.x == 0) {
    data[0] = 0x1234567890abcdefull;
    st_release_sys(flag, 1);
  } else {
    const uint64_t start = globaltimer();
    while (ld_acquire_sys(flag) == 0) {
      if (globaltimer() - start > timeout_ns) {
        seen[0] = ~0ull;
        return;
      }
    }
    seen[0] = data[0];
  }
}

// The number conversions of cuda_bf16.h / cuda_fp8.h on every input: f32 → BF16 (round to
// nearest even), f32 → E4M3 saturating and not, f32 → E5M2 saturating, BF16 product.
extern "C" __global__ void probe_convert(const float* in, uint16_t* bf16, uint8_t* e4m3_sat,
                                         uint8_t* e4m3_nosat, uint8_t* e5m2_sat,
                                         uint16_t* bf16_square, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float x = in[i];
    const __nv_bfloat16 b = __float2bfloat16_rn(x);
    bf16[i] = *reinterpret_cast<const uint16_t*>(&b);
    e4m3_sat[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    e4m3_nosat[i] = __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E4M3);
    e5m2_sat[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
    const __nv_bfloat16 sq = __hmul(b, b);
    bf16_square[i] = *reinterpret_cast<const uint16_t*>(&sq);
  }
}

// Misuse, each of which hangs or corrupts on a GPU; the host layer must name it.
extern "C" __global__ void probe_barrier_divergence(int* out) {
  if (threadIdx.x < 32) return;  // warp 0 leaves, the others wait for it forever
  __syncthreads();
  out[threadIdx.x] = 1;
}

extern "C" __global__ void probe_shuffle_divergence(int* out) {
  if ((threadIdx.x & 31) == 5) return;  // lane 5 is in the mask but never arrives
  out[threadIdx.x] = __shfl_sync(0xffffffffu, int(threadIdx.x), 0);
}

extern "C" __global__ void probe_out_of_bounds(const float* x, float* y, int n) {
  // Reads one element past the end of x: a guard page on the host.
  if (threadIdx.x == 0) y[0] = x[n];
}

extern "C" __global__ void probe_shared_overflow(int n) {
  extern __shared__ __align__(16) uint8_t smem[];
  // Writes one byte past the dynamic shared memory the launch asked for.
  if (threadIdx.x == 0) smem[n] = 1;
}

extern "C" __global__ void probe_misaligned_cp_async(const uint8_t* src) {
  extern __shared__ __align__(16) uint8_t smem[];
  cp_async16(smem + 4, src, true);  // the destination must be 16-byte aligned
  cp_async_commit();
  cp_async_wait<0>();
}

extern "C" __global__ void probe_spin_forever(int* flag) {
  // Nothing ever sets the flag: only the launch's time limit ends this.
  while (*reinterpret_cast<volatile int*>(flag) == 0) {
    __nanosleep(100);
  }
}

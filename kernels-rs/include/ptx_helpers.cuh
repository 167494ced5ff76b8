// Every inline-PTX site of the kernels, each in one small device function with two branches:
// the inline PTX that nvcc compiles (byte for byte what the compile gates check), and, when
// the source is compiled for the CPU by the host execution layer (kernels-rs/cuda-host), a
// call into that layer's implementation of the instruction's PTX ISA semantics.
//
// Shared by moe_gemm.cu, mla_decode.cu and allreduce.cu.
#pragma once

#include <cstdint>

#ifdef CUDA_HOST_EXECUTION
#include "cuda_host_ptx.h"
#endif

// Shared-window address of a generic pointer to shared memory (the operand PTX wants).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ------------------------------------------------------------------ cp.async

// 16-byte async copy global → shared, L2 only; an invalid source zero-fills the destination
// (src-size 0) and is not read.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#ifdef CUDA_HOST_EXECUTION
  cuhost::cp_async(dst, src, 16, valid ? 16 : 0, "cp.async.cg.shared.global 16");
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
#endif
}

// 4-byte async copy, cached in L1 as well (.ca: .cg only takes 16-byte copies).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
#ifdef CUDA_HOST_EXECUTION
  cuhost::cp_async(dst, src, 4, valid ? 4 : 0, "cp.async.ca.shared.global 4");
#else
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef CUDA_HOST_EXECUTION
  cuhost::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n");
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef CUDA_HOST_EXECUTION
  cuhost::cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ------------------------------------------------------------------ ldmatrix

__device__ __forceinline__ void ldsm_x1(uint32_t (&r)[1], const void* p) {
#ifdef CUDA_HOST_EXECUTION
  cuhost::ldmatrix_m8n8_b16(r, 1, false, p);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0])
               : "r"(smem_addr(p)));
#endif
}

__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const void* p) {
#ifdef CUDA_HOST_EXECUTION
  cuhost::ldmatrix_m8n8_b16(r, 2, false, p);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p)));
#endif
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
#ifdef CUDA_HOST_EXECUTION
  cuhost::ldmatrix_m8n8_b16(r, 4, false, p);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
#endif
}

__device__ __forceinline__ void ldsm_x1_t(uint32_t (&r)[1], const void* p) {
#ifdef CUDA_HOST_EXECUTION
  cuhost::ldmatrix_m8n8_b16(r, 1, true, p);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0])
               : "r"(smem_addr(p)));
#endif
}

__device__ __forceinline__ void ldsm_x2_t(uint32_t (&r)[2], const void* p) {
#ifdef CUDA_HOST_EXECUTION
  cuhost::ldmatrix_m8n8_b16(r, 2, true, p);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p)));
#endif
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
#ifdef CUDA_HOST_EXECUTION
  cuhost::ldmatrix_m8n8_b16(r, 4, true, p);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
#endif
}

// ------------------------------------------------------------------ warp MMAs (D = A·B + D)

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#ifdef CUDA_HOST_EXECUTION
  const uint32_t b[2] = {b0, b1};
  const float c[4] = {d[0], d[1], d[2], d[3]};
  cuhost::mma_m16n8k16_bf16_f32(d, a, b, c);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7},"
      " {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#ifdef CUDA_HOST_EXECUTION
  const uint32_t b[2] = {b0, b1};
  const float c[4] = {d[0], d[1], d[2], d[3]};
  cuhost::mma_m16n8k32_e4m3_f32(d, a, b, c);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7},"
      " {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// SM120 block-scaled FP4 MMA (sm_120a only): one m16n8k64 with UE4M3 scales per 16 K, the
// scale selectors {byte-id, thread-id} fixed at {0, 0}.
__device__ __forceinline__ void mma_nvf4_4x(float (&d)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2], uint32_t sfa, uint32_t sfb) {
#ifdef CUDA_HOST_EXECUTION
  const float c[4] = {d[0], d[1], d[2], d[3]};
  cuhost::mma_m16n8k64_e2m1_ue4m3_4x(d, a, b, c, sfa, 0, 0, sfb, 0, 0);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X"
      ".f32.e2m1.e2m1.f32.ue4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3},"
      " {%10}, {0, 0}, {%11}, {0, 0};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(sfa), "r"(sfb));
#endif
}

// ------------------------------------------------------------------ system-scope flags

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
#ifdef CUDA_HOST_EXECUTION
  cuhost::st_release_sys_u64(p, v);
#else
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
#ifdef CUDA_HOST_EXECUTION
  return cuhost::ld_acquire_sys_u64(p);
#else
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

__device__ __forceinline__ uint64_t globaltimer() {
#ifdef CUDA_HOST_EXECUTION
  return cuhost::globaltimer_ns();
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

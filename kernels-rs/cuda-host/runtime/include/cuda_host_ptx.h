// Host semantics of the PTX instructions the kernels issue through inline assembly. The
// kernels' PTX helper header (kernels-rs/include/ptx_helpers.cuh) calls these from the host
// branch of each helper; the device branch is the inline PTX itself.
//
// Each follows the PTX ISA's description of the instruction:
// - cp.async: per-thread groups; a copy lands in shared memory only when a wait_group that
//   covers its group executes (the latest point the ISA allows), and the destination reads as
//   0xFF bytes until then, so a read before the wait is visible in the results.
// - ldmatrix and mma.sync are warp collectives (`.sync.aligned`: all 32 lanes), computed from
//   every lane's registers with the fragment layouts of the ISA's "Matrix Fragments" tables.
//   MMA arithmetic: exact products, summed exactly (in double; every partial sum of these
//   formats is representable), plus C, rounded once to f32. The hardware's accumulation order
//   and internal width are not documented, so a GPU may differ in the last bits.
// - ld.acquire / st.release at system scope: C++ acquire/release atomics; a polling load also
//   lets other fibers run.
// - %globaltimer: CLOCK_MONOTONIC in nanoseconds.
#pragma once

#include <cstdint>

namespace cuhost {

void cp_async(void* dst, const void* src, unsigned cp_size, unsigned src_size, const char* what);
void cp_async_commit();
void cp_async_wait(unsigned pending_groups);
void cp_async_wait_all();

// ldmatrix.sync.aligned.m8n8.x{num}{.trans}.shared.b16: `row` is this lane's row address (the
// ISA reads lanes 0-7 for matrix 0, 8-15 for matrix 1, ...); `regs[0..num]` receive the
// fragments.
void ldmatrix_m8n8_b16(uint32_t* regs, unsigned num, bool trans, const void* row);

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
void mma_m16n8k16_bf16_f32(float* d, const uint32_t* a, const uint32_t* b, const float* c);
// mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32
void mma_m16n8k32_e4m3_f32(float* d, const uint32_t* a, const uint32_t* b, const float* c);
// mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X
//     .f32.e2m1.e2m1.f32.ue4m3
void mma_m16n8k64_e2m1_ue4m3_4x(float* d, const uint32_t* a, const uint32_t* b, const float* c,
                                uint32_t sfa, uint16_t byte_id_a, uint16_t thread_id_a,
                                uint32_t sfb, uint16_t byte_id_b, uint16_t thread_id_b);

void st_release_sys_u64(uint64_t* p, uint64_t v);
uint64_t ld_acquire_sys_u64(const uint64_t* p);
uint64_t globaltimer_ns();

}  // namespace cuhost

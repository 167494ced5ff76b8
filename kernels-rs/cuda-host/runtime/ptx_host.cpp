// Host semantics of ldmatrix, the warp MMAs and the system-scope memory operations (see
// cuda_host_ptx.h). Fragment layouts are written from the PTX ISA's element formulas
// ("Matrix Fragments for mma.m16n8k16 / m16n8k32 / m16n8k64": element i of a lane's fragment,
// groupID = lane >> 2, threadID_in_group = lane % 4), scanning lanes and element indices; the
// Rust register model (kernels::moe_gemm::mma_sm120) is written the other way round (matrix
// position → lane), and a test holds the two to the same bits.

#include <time.h>

#include <atomic>
#include <cstring>

#include "cuda_host.h"
#include "cuda_host_numerics.h"
#include "cuda_host_ptx.h"

namespace cuhost {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

float bf16_value(uint32_t reg, unsigned half) { return __uint_as_float((reg >> (16 * half)) << 16); }

// Every E4M3 code's value, decoded once.
struct E4m3Table {
  double v[256];
  E4m3Table() {
    for (unsigned c = 0; c < 256; ++c) v[c] = numerics::decode(numerics::kE4m3, c);
  }
};
const E4m3Table kE4m3Values;

double e4m3_value(uint32_t reg, unsigned byte) { return kE4m3Values.v[(reg >> (8 * byte)) & 0xff]; }

double e2m1_value(uint32_t reg, unsigned nibble) {
  static const double magnitude[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  const uint32_t code = (reg >> (4 * nibble)) & 0xf;
  return (code & 8) ? -magnitude[code & 7] : magnitude[code & 7];
}

// UE4M3: E4M3 without a sign; the top bit of the byte is not part of the value.
double ue4m3_value(uint32_t reg, unsigned byte) { return kE4m3Values.v[(reg >> (8 * byte)) & 0x7f]; }

template <class T>
T lane_in(const LaneIo* l) {
  T v;
  memcpy(&v, l->in, sizeof v);
  return v;
}

void require_full_warp(unsigned mask, const char* what) {
  if (mask != kFullMask) kernel_error("%s is .aligned: all 32 lanes must execute it", what);
}

// C/D of every m16n8 MMA: c_i at row groupID (+8 for i ≥ 2), column 2·threadID_in_group + (i & 1).
void write_d(LaneIo* const* lanes, const double (&acc)[16][8]) {
  for (unsigned lane = 0; lane < 32; ++lane) {
    const unsigned g = lane >> 2, t = lane & 3;
    float d[4];
    float c[4];
    memcpy(c, lanes[lane]->in + 48, sizeof c);
    for (unsigned i = 0; i < 4; ++i) {
      const unsigned row = i < 2 ? g : g + 8, col = 2 * t + (i & 1);
      d[i] = float(acc[row][col] + double(c[i]));
    }
    memcpy(lanes[lane]->out, d, sizeof d);
  }
}

// Every MMA input: a[4] at 0, b[2] at 16, (unused) at 24, c[4] at 48, then the scales.
struct MmaIn {
  uint32_t a[4];
  uint32_t b[2];
  uint32_t unused[6];
  float c[4];
  uint32_t sfa, sfb;
  uint16_t byte_id_a, thread_id_a, byte_id_b, thread_id_b;
};
static_assert(offsetof(MmaIn, c) == 48, "write_d reads c at byte 48");

// ---- m16n8k16 .bf16
void mma_bf16_compute(LaneIo* const* lanes, unsigned mask, const void*) {
  const char* what = "mma.sync.m16n8k16.bf16";
  require_full_warp(mask, what);
  double a[16][16], b[16][8];
  for (unsigned lane = 0; lane < 32; ++lane) {
    const MmaIn in = lane_in<MmaIn>(lanes[lane]);
    const unsigned g = lane >> 2, t = lane & 3;
    for (unsigned i = 0; i < 8; ++i) {  // a0..a7, two per register
      const unsigned row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
      const unsigned col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
      a[row][col] = bf16_value(in.a[i / 2], i % 2);
    }
    for (unsigned i = 0; i < 4; ++i) {  // b0..b3
      const unsigned row = 2 * t + (i & 1) + (i >= 2 ? 8 : 0);
      b[row][g] = bf16_value(in.b[i / 2], i % 2);
    }
  }
  double acc[16][8];
  for (unsigned r = 0; r < 16; ++r)
    for (unsigned n = 0; n < 8; ++n) {
      double s = 0.0;
      for (unsigned k = 0; k < 16; ++k) s += a[r][k] * b[k][n];
      acc[r][n] = s;
    }
  write_d(lanes, acc);
}

// ---- m16n8k32 .e4m3
void mma_e4m3_compute(LaneIo* const* lanes, unsigned mask, const void*) {
  const char* what = "mma.sync.m16n8k32.e4m3";
  require_full_warp(mask, what);
  double a[16][32], b[32][8];
  for (unsigned lane = 0; lane < 32; ++lane) {
    const MmaIn in = lane_in<MmaIn>(lanes[lane]);
    const unsigned g = lane >> 2, t = lane & 3;
    for (unsigned i = 0; i < 16; ++i) {  // a0..a15, four per register
      const unsigned row = (i < 4 || (i >= 8 && i < 12)) ? g : g + 8;
      const unsigned col = 4 * t + (i & 3) + (i >= 8 ? 16 : 0);
      a[row][col] = e4m3_value(in.a[i / 4], i % 4);
    }
    for (unsigned i = 0; i < 8; ++i) {  // b0..b7
      const unsigned row = 4 * t + (i & 3) + (i >= 4 ? 16 : 0);
      b[row][g] = e4m3_value(in.b[i / 4], i % 4);
    }
  }
  double acc[16][8];
  for (unsigned r = 0; r < 16; ++r)
    for (unsigned n = 0; n < 8; ++n) {
      double s = 0.0;
      for (unsigned k = 0; k < 32; ++k) s += a[r][k] * b[k][n];
      acc[r][n] = s;
    }
  write_d(lanes, acc);
}

// ---- m16n8k64 .kind::mxf4nvf4 .block_scale .scale_vec::4X, e2m1 × e2m1 with ue4m3 scales
void mma_nvf4_compute(LaneIo* const* lanes, unsigned mask, const void*) {
  const char* what = "mma.sync.m16n8k64.kind::mxf4nvf4.block_scale.scale_vec::4X";
  require_full_warp(mask, what);
  double a[16][64], b[64][8];
  double sa[16][4], sb[8][4];
  bool have_sa[16] = {}, have_sb[8] = {};
  const MmaIn first = lane_in<MmaIn>(lanes[0]);
  // With scale_vec::4X a row's four scale factors fill all four bytes of the register, so the
  // byte selectors must be 0; thread-id-a picks one of the two lane pairs of each quad (the
  // pair holds rows groupID and groupID + 8), thread-id-b one lane of each quad (column
  // groupID).
  if (first.byte_id_a != 0 || first.byte_id_b != 0)
    kernel_error("%s: byte-id must be 0 with scale_vec::4X (got %u, %u)", what, first.byte_id_a,
                 first.byte_id_b);
  if (first.thread_id_a > 1 || first.thread_id_b > 3)
    kernel_error("%s: thread-id-a %u (0..1) / thread-id-b %u (0..3) out of range", what,
                 first.thread_id_a, first.thread_id_b);
  for (unsigned lane = 0; lane < 32; ++lane) {
    const MmaIn in = lane_in<MmaIn>(lanes[lane]);
    if (in.byte_id_a != first.byte_id_a || in.thread_id_a != first.thread_id_a ||
        in.byte_id_b != first.byte_id_b || in.thread_id_b != first.thread_id_b)
      kernel_error("%s: lanes pass different scale selectors (they are immediates)", what);
    const unsigned g = lane >> 2, t = lane & 3;
    for (unsigned i = 0; i < 32; ++i) {  // a0..a31, eight per register
      const unsigned row = (i < 8 || (i >= 16 && i < 24)) ? g : g + 8;
      const unsigned col = 8 * t + (i & 7) + (i >= 16 ? 32 : 0);
      a[row][col] = e2m1_value(in.a[i / 8], i % 8);
    }
    for (unsigned i = 0; i < 16; ++i) {  // b0..b15
      const unsigned row = 8 * t + (i & 7) + (i >= 8 ? 32 : 0);
      b[row][g] = e2m1_value(in.b[i / 8], i % 8);
    }
    if ((t >> 1) == first.thread_id_a) {
      const unsigned row = g + 8 * (t & 1);
      for (unsigned j = 0; j < 4; ++j) sa[row][j] = ue4m3_value(in.sfa, j);
      have_sa[row] = true;
    }
    if (t == first.thread_id_b) {
      for (unsigned j = 0; j < 4; ++j) sb[g][j] = ue4m3_value(in.sfb, j);
      have_sb[g] = true;
    }
  }
  for (unsigned r = 0; r < 16; ++r)
    if (!have_sa[r]) kernel_error("%s: no lane supplies the scales of row %u", what, r);
  for (unsigned n = 0; n < 8; ++n)
    if (!have_sb[n]) kernel_error("%s: no lane supplies the scales of column %u", what, n);
  // Every product of two scaled E2M1 values is a multiple of 2^-20 below 2^23, so the sum of
  // 64 of them is exact in double: the result does not depend on the order.
  double as[16][64], bs[8][64];
  for (unsigned r = 0; r < 16; ++r)
    for (unsigned k = 0; k < 64; ++k) as[r][k] = a[r][k] * sa[r][k / 16];
  for (unsigned n = 0; n < 8; ++n)
    for (unsigned k = 0; k < 64; ++k) bs[n][k] = b[k][n] * sb[n][k / 16];
  double acc[16][8];
  for (unsigned r = 0; r < 16; ++r)
    for (unsigned n = 0; n < 8; ++n) {
      double s = 0.0;
      for (unsigned k = 0; k < 64; ++k) s += as[r][k] * bs[n][k];
      acc[r][n] = s;
    }
  write_d(lanes, acc);
}

// ---- ldmatrix
struct LdIn {
  const unsigned char* row;
  uint32_t num, trans;
};

void ldmatrix_compute(LaneIo* const* lanes, unsigned mask, const void*) {
  const char* what = "ldmatrix.sync.aligned.m8n8.b16";
  require_full_warp(mask, what);
  LdIn in[32];
  for (unsigned l = 0; l < 32; ++l) in[l] = lane_in<LdIn>(lanes[l]);
  const unsigned num = in[0].num;
  const bool trans = in[0].trans != 0;
  for (unsigned l = 0; l < 32; ++l)
    if (in[l].num != num || (in[l].trans != 0) != trans)
      kernel_error("%s: lanes disagree on .x%u / .trans", what, num);
  unsigned char* base = dynamic_shared_base();
  const size_t size = dynamic_shared_size();
  // Lanes 8m..8m+7 give the rows of matrix m; only the first 8·num lanes' addresses are read.
  for (unsigned l = 0; l < 8 * num; ++l) {
    const uintptr_t a = uintptr_t(in[l].row);
    if (a % 16) kernel_error("%s: lane %u's row address %p is not 16-byte aligned", what, l, in[l].row);
    if (a >= uintptr_t(base) && a < uintptr_t(base) + 232448 && a + 16 > uintptr_t(base) + size)
      kernel_error("%s: lane %u's row (shared offset %zu) is past the %zu bytes of dynamic shared "
                   "memory",
                   what, l, size_t(a - uintptr_t(base)), size);
  }
  for (unsigned l = 0; l < 8 * num; ++l) collective_read(in[l].row, 16);
  auto element = [&](unsigned matrix, unsigned row, unsigned col) -> uint32_t {
    uint16_t v;
    memcpy(&v, in[8 * matrix + row].row + 2 * col, 2);
    return v;
  };
  for (unsigned l = 0; l < 32; ++l) {
    uint32_t regs[4] = {0, 0, 0, 0};
    for (unsigned m = 0; m < num; ++m) {
      // Lane l holds row l/4, columns 2(l%4) and 2(l%4)+1 of each 8×8 matrix (transposed: the
      // same positions of the transpose).
      const unsigned r = l / 4, c = 2 * (l % 4);
      regs[m] = trans ? element(m, c, r) | (element(m, c + 1, r) << 16)
                      : element(m, r, c) | (element(m, r, c + 1) << 16);
    }
    memcpy(lanes[l]->out, regs, sizeof regs);
  }
}

void run_mma(CollectiveFn fn, const char* kind, float* d, const uint32_t* a, size_t na,
             const uint32_t* b, size_t nb, const float* c, const MmaIn* extra) {
  MmaIn in{};
  if (extra) in = *extra;
  memcpy(in.a, a, na * 4);
  memcpy(in.b, b, nb * 4);
  memcpy(in.c, c, 16);
  warp_collective(kFullMask, kind, fn, nullptr, &in, sizeof in, d, 16, true);
}

}  // namespace

void ldmatrix_m8n8_b16(uint32_t* regs, unsigned num, bool trans, const void* row) {
  if (num != 1 && num != 2 && num != 4) kernel_error("ldmatrix: .x%u (1, 2 or 4)", num);
  LdIn in{static_cast<const unsigned char*>(row), num, trans ? 1u : 0u};
  uint32_t out[4];
  warp_collective(kFullMask, trans ? "ldmatrix.trans" : "ldmatrix", &ldmatrix_compute, nullptr, &in,
                  sizeof in, out, sizeof out);
  memcpy(regs, out, 4 * num);
}

void mma_m16n8k16_bf16_f32(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
  run_mma(&mma_bf16_compute, "mma.m16n8k16.bf16", d, a, 4, b, 2, c, nullptr);
}

void mma_m16n8k32_e4m3_f32(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
  run_mma(&mma_e4m3_compute, "mma.m16n8k32.e4m3", d, a, 4, b, 2, c, nullptr);
}

void mma_m16n8k64_e2m1_ue4m3_4x(float* d, const uint32_t* a, const uint32_t* b, const float* c,
                                uint32_t sfa, uint16_t byte_id_a, uint16_t thread_id_a,
                                uint32_t sfb, uint16_t byte_id_b, uint16_t thread_id_b) {
  MmaIn extra{};
  extra.sfa = sfa;
  extra.sfb = sfb;
  extra.byte_id_a = byte_id_a;
  extra.thread_id_a = thread_id_a;
  extra.byte_id_b = byte_id_b;
  extra.thread_id_b = thread_id_b;
  run_mma(&mma_nvf4_compute, "mma.m16n8k64.mxf4nvf4.4X", d, a, 4, b, 2, c, &extra);
}

void st_release_sys_u64(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  // Acquire loads poll flags other blocks (and other ranks) set: let them run first.
  yield_polling();
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

uint64_t globaltimer_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

}  // namespace cuhost

// NVFP4 grouped GEMM for the routed MoE experts (Kimi-K2.5 / DeepSeek-V3 shapes).
//
// One translation unit per tactic: the gate (kernels-rs/src/bin/ptx-gate.rs) passes the
// tactic's parameters as -D macros generated from `MoeGemmTactic::nvcc_defines`, and the
// shared-memory sizes Rust computed, which are static_asserted against the layout below.
//
// Two kernels, both over tokens grouped by expert (`expert_offsets` into `sorted_token_ids`),
// with grid.y over the list of active experts (`active_experts`: the count, then the ids) and
// grid.z over token tiles: a CTA loops over its expert's tiles z, z + gridDim.z, ... so a grid
// sized from bounds the host knows before the routing exists (a CUDA graph's) drops no token.
//   moe_gate_up: h = SiLU(x·W_gateᵀ) ⊙ (x·W_upᵀ) on this rank's intermediate shard, then h is
//                quantized to NVFP4 with the down projection's input_scale.
//   moe_down:    out[token] += routing_weight · (h·W_downᵀ); out is this rank's partial sum
//                (the intermediate dimension is TP-sharded), reduced across ranks elsewhere.
//
// Variants (MOE_VARIANT):
//   0 native  sm_120a: block-scaled FP4 mma.sync (OMMA.SF.16864), activations quantized to
//             NVFP4 per stage inside the kernel.
//   1 portable sm_80+: e2m1 × ue4m3 dequantized exactly into BF16 (2 + 4 significant bits
//             fit BF16's 8), BF16 mma.sync (HMMA), global scales in the epilogue.
//   2 emu90   sm_90a: the native kernel with only the MMA replaced by an emulation that has the
//             same register-level semantics (kernels-rs/src/moe_gemm/mma_sm120.rs).
// All variants quantize activations identically, so they multiply the same numbers.

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ptx_helpers.cuh"

#ifndef MOE_VARIANT
// Defaults only so editors and a bare `nvcc -c` can parse the file; the gate always sets all.
#define MOE_VARIANT 0
#define MOE_TILE_N 128
#define MOE_TILE_M 16
#define MOE_TILE_K 256
#define MOE_WARPS 4
#define MOE_STAGES 3
#define MOE_SPLIT_K 1
#define MOE_SWAP_AB 1
#define MOE_SCALE_LOAD 0
#endif

namespace moe {

constexpr int kVariant = MOE_VARIANT;
constexpr int TN = MOE_TILE_N;
constexpr int TM = MOE_TILE_M;
constexpr int TK = MOE_TILE_K;
constexpr int WARPS = MOE_WARPS;
constexpr int STAGES = MOE_STAGES;
constexpr int SPLIT_K = MOE_SPLIT_K;
constexpr bool SWAP_AB = MOE_SWAP_AB != 0;
constexpr bool SCALES_SWIZZLED = MOE_SCALE_LOAD == 0;
constexpr int THREADS = WARPS * 32;
constexpr int SF_VEC = 16;

enum : int { kNative = 0, kPortable = 1, kEmulated = 2 };

// Weight rows / tokens covered by one MMA instruction.
constexpr int MMA_W = SWAP_AB ? 16 : 8;
constexpr int MMA_T = SWAP_AB ? 8 : 16;
// Each warp owns WR rows of the gate half and the same WR rows of the up half (or 2·WR
// consecutive rows of W_down), so SiLU(gate)·up pairs sit in the same lane's registers.
constexpr int WR = TN / 2 / WARPS;
constexpr int MW = 2 * WR / MMA_W;
constexpr int MT = TM / MMA_T;

static_assert(TK % 64 == 0, "tile_k must be a multiple of the MMA's K");
static_assert(WR % MMA_W == 0 && WR > 0, "each warp needs whole MMAs in each half");
static_assert((TN / 2) % SF_VEC == 0, "the epilogue quantizes whole 16-blocks of h");
static_assert(TM % MMA_T == 0, "tile_m must be whole MMAs");
static_assert(STAGES >= 2, "pipeline needs two stages");

__host__ __device__ constexpr int align16(int n) { return (n + 15) / 16 * 16; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

__host__ __device__ constexpr int fp4_bytes(int rows) { return align16(rows * TK / 2); }
__host__ __device__ constexpr int sf_bytes(int rows) { return align16(rows * TK / SF_VEC); }
__host__ __device__ constexpr int fp4_tile(int rows) { return fp4_bytes(rows) + sf_bytes(rows); }

// Shared memory: mirrors MoeGemmTactic::smem() in tactic.rs.
struct SmemLayout {
  static constexpr int weights = fp4_tile(TN);
  static constexpr int act_bf16 = align16(TM * TK * 2);
  static constexpr int gate_up_main = STAGES * (weights + act_bf16) + fp4_tile(TM);
  static constexpr int gate_up_epilogue = align16(TM * (TN / 2) * 4);
  static constexpr int gate_up = cmax(gate_up_main, gate_up_epilogue);
  static constexpr int down = STAGES * (weights + fp4_tile(TM));
};

#ifdef MOE_EXPECT_SMEM_GATE_UP
static_assert(SmemLayout::gate_up == MOE_EXPECT_SMEM_GATE_UP, "Rust and CUDA smem disagree");
static_assert(SmemLayout::down == MOE_EXPECT_SMEM_DOWN, "Rust and CUDA smem disagree");
#endif

struct MoeArgs {
  const int* expert_offsets;     // [E + 1] prefix sums of assignments per expert
  const int* active_experts;     // [1 + E]: how many experts have a token, then their ids
  const int* sorted_token_ids;   // [A] token of each assignment, grouped by expert
  const float* sorted_weights;   // [A] routing weight of each assignment
  int hidden;                    // H (7168)
  int inter;                     // this rank's intermediate shard I (2048 / TP)
  const __nv_bfloat16* x;        // [T, H]
  const uint8_t* w13;            // [E, 2I, H/2]: gate rows then up rows
  const uint8_t* w13_sf;         // per expert: swizzled [pad128(2I), pad4(H/16)] or [2I, H/16]
  const float* w13_gs;           // [E] weight_scale_2
  const float* a13_gs;           // [E] input_scale of gate/up
  uint8_t* h_q;                  // [A, I/2] NVFP4 intermediate
  uint8_t* h_sf;                 // [A, I/16] its block scales, row-major
  const uint8_t* w2;             // [E, H, I/2]
  const uint8_t* w2_sf;          // per expert, layout as w13_sf
  const float* w2_gs;            // [E]
  const float* a2_gs;            // [E] input_scale of down: the scale h is quantized with
  float* out;                    // [T, H] f32 partial sums, accumulated atomically
};

// ---------------------------------------------------------------- numerics

__device__ __forceinline__ float e2m1_to_f32(uint32_t c) {
  const uint32_t e = (c >> 1) & 3, m = c & 1;
  const float mag = e == 0 ? 0.5f * float(m) : __uint_as_float(((e + 126u) << 23) | (m << 22));
  return (c & 8) ? -mag : mag;
}

__device__ __forceinline__ float ue4m3_to_f32(uint32_t c) {
  const uint32_t e = (c >> 3) & 15, m = c & 7;
  return e == 0 ? float(m) * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
}

// Same rounding as formats::e2m1::f32_to_e2m1 (ModelOpt's _cast_fp4): nearest, ties to the
// even code, saturate at 6, sign bit for every negative input, NaN → 7.
__device__ __forceinline__ uint32_t f32_to_e2m1(float x) {
  const float a = fabsf(x);
  uint32_t q;
  if (!(a == a)) {
    q = 7;
  } else {
    q = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
        (a > 5.0f);
  }
  return q | (x < 0.0f ? 8u : 0u);
}

// ModelOpt's NVFP4 block quantization: scale = amax / (6·global), clamped to [2^-9, 448]
// (a zero block gets scale 1), encoded E4M3 round-to-nearest with saturation.
__device__ __forceinline__ uint32_t block_scale_code(float amax, float global) {
  float s = amax / (6.0f * global);
  if (s == 0.0f) s = 1.0f;
  s = fminf(fmaxf(s, 0.001953125f), 448.0f);
  return __nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3);
}

// Quantizes 16 values; returns the scale code, writes 8 packed bytes (low nibble first).
__device__ __forceinline__ uint32_t quantize16(const float (&v)[16], float global, uint2& packed) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
  const uint32_t sc = block_scale_code(amax, global);
  const float factor = ue4m3_to_f32(sc) * global;
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 16; ++i) w[i / 8] |= f32_to_e2m1(v[i] / factor) << (4 * (i % 8));
  packed = make_uint2(w[0], w[1]);
  return sc;
}

// ---------------------------------------------------------------- shared-memory tiles

// FP4 tile rows are TK/2 bytes; 16-byte chunks are XOR-swizzled by row so the fragment reads
// of 8 rows at the same K (one per lane group) hit distinct banks.
constexpr int CHUNKS = TK / 32;
constexpr int ROWS_PER_128B = CHUNKS >= 8 ? 1 : 8 / CHUNKS;
constexpr int SWZ_MASK = (CHUNKS >= 8 ? 8 : CHUNKS) - 1;

__device__ __forceinline__ int fp4_offset(int row, int byte) {
  const int chunk = (byte >> 4) ^ ((row / ROWS_PER_128B) & SWZ_MASK);
  return row * (TK / 2) + chunk * 16 + (byte & 15);
}

// Offset of the u32 holding scales [col4*4, col4*4+4) of `row` in a weight's scale tensor.
__device__ __forceinline__ size_t weight_sf_offset(int row, int col4, int k_blocks) {
  if (SCALES_SWIZZLED) {
    // formats::swizzle: [rows/128, cols/4, 32, 4, 4]; the 4 scales are one u32.
    const int padded_cols4 = (k_blocks + 3) / 4;
    const int rt = row / 128, r = row % 128;
    return ((size_t(rt) * padded_cols4 + col4) * 32 + (r % 32)) * 16 + (r / 32) * 4;
  }
  return size_t(row) * k_blocks + col4 * 4;
}

// A stage of weights: TN rows of packed FP4 plus their scales.
struct WeightTile {
  uint8_t* q;
  uint8_t* sf;  // [TN][TK/16]
};

struct Fp4Tile {
  uint8_t* q;
  uint8_t* sf;  // [rows][TK/16]
};

// Copies TN weight rows, K range [k0, k0 + TK), of one expert into a stage.
// `global_row(r)` maps a tile row to the expert's weight row.
template <class RowMap>
__device__ __forceinline__ void load_weights(WeightTile t, const uint8_t* wq, const uint8_t* wsf,
                                             int k_elems, int k0, RowMap global_row) {
  const int row_bytes = k_elems / 2;
  for (int i = threadIdx.x; i < TN * CHUNKS; i += THREADS) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    const uint8_t* src = wq + size_t(global_row(r)) * row_bytes + k0 / 2 + c * 16;
    cp_async16(t.q + fp4_offset(r, c * 16), src, true);
  }
  const int k_blocks = k_elems / SF_VEC;
  for (int i = threadIdx.x; i < TN * (TK / 64); i += THREADS) {
    const int r = i / (TK / 64), j = i % (TK / 64);
    const size_t off = weight_sf_offset(global_row(r), k0 / 64 + j, k_blocks);
    cp_async4(t.sf + r * (TK / SF_VEC) + j * 4, wsf + off, true);
  }
}

// ---------------------------------------------------------------- the MMA

// D = A·B + C for one m16n8k64 block-scaled FP4 MMA; scale selectors are always {0, 0}.
__device__ __forceinline__ void mma_nvf4(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2], uint32_t sfa, uint32_t sfb) {
#if MOE_VARIANT == 0
  mma_nvf4_4x(d, a, b, sfa, sfb);
#elif MOE_VARIANT == 2
  // Emulation of the instruction above with the semantics of mma_sm120.rs: gather each output
  // element's row of A and column of B from the lanes that hold them, sum the 64 scaled
  // products exactly (f64 holds every partial sum exactly), add C, round once.
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint32_t sa_lo = __shfl_sync(0xffffffffu, sfa, 4 * g);      // row g
  const uint32_t sa_hi = __shfl_sync(0xffffffffu, sfa, 4 * g + 1);  // row g + 8
  const uint32_t sb0 = __shfl_sync(0xffffffffu, sfb, 4 * (2 * t));
  const uint32_t sb1 = __shfl_sync(0xffffffffu, sfb, 4 * (2 * t + 1));
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  // Not unrolled: the emulation is for correctness tests, and unrolled it needs > 255 registers.
#pragma unroll 1
  for (int src = 0; src < 4; ++src) {
    uint32_t ra[4], rb0[2], rb1[2];
#pragma unroll
    for (int r = 0; r < 4; ++r) ra[r] = __shfl_sync(0xffffffffu, a[r], 4 * g + src);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rb0[r] = __shfl_sync(0xffffffffu, b[r], 4 * (2 * t) + src);
      rb1[r] = __shfl_sync(0xffffffffu, b[r], 4 * (2 * t + 1) + src);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // k = 8·src + i + 32·half
      const int blk = (8 * src + 32 * half) / 16;
      const double s_lo = ue4m3_to_f32((sa_lo >> (8 * blk)) & 0xff);
      const double s_hi = ue4m3_to_f32((sa_hi >> (8 * blk)) & 0xff);
      const double s0 = ue4m3_to_f32((sb0 >> (8 * blk)) & 0xff);
      const double s1 = ue4m3_to_f32((sb1 >> (8 * blk)) & 0xff);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const double lo = e2m1_to_f32((ra[2 * half] >> (4 * i)) & 15) * s_lo;
        const double hi = e2m1_to_f32((ra[2 * half + 1] >> (4 * i)) & 15) * s_hi;
        const double c0 = e2m1_to_f32((rb0[half] >> (4 * i)) & 15) * s0;
        const double c1 = e2m1_to_f32((rb1[half] >> (4 * i)) & 15) * s1;
        acc[0] += lo * c0;
        acc[1] += lo * c1;
        acc[2] += hi * c0;
        acc[3] += hi * c1;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) d[r] = float(acc[r] + double(d[r]));
#endif
}

// Two e2m1 codes (one packed byte) times a scale, as exact BF16.
__device__ __forceinline__ uint32_t dq_pair(uint32_t byte, float scale) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(e2m1_to_f32(byte & 15) * scale,
                                                 e2m1_to_f32((byte >> 4) & 15) * scale);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// One k64 step of one MMA tile: A has 16 rows starting at tile rows `a_row(0..16)`, B has 8.
// Both operands are FP4 tiles in shared memory in the swizzled layout above.
template <class ARow, class BRow>
__device__ __forceinline__ void mma_k64(float (&d)[4], const uint8_t* aq, const uint8_t* asf,
                                        ARow a_row, const uint8_t* bq, const uint8_t* bsf,
                                        BRow b_row, int kk) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (kVariant == kPortable) {
    // Four m16n8k16 steps, each within one 16-element scale block. Rolled: the dequantization
    // already gives the scheduler enough independent work.
#pragma unroll 1
    for (int s = 0; s < 4; ++s) {
      const int byte = kk * 32 + s * 8 + t;  // k = 64kk + 16s + 2t (and +8 → byte + 4)
      const int blk = kk * 4 + s;
      const int ra0 = a_row(g), ra1 = a_row(g + 8), rb = b_row(g);
      const float sa0 = ue4m3_to_f32(asf[ra0 * (TK / SF_VEC) + blk]);
      const float sa1 = ue4m3_to_f32(asf[ra1 * (TK / SF_VEC) + blk]);
      const float sb = ue4m3_to_f32(bsf[rb * (TK / SF_VEC) + blk]);
      const uint32_t a[4] = {dq_pair(aq[fp4_offset(ra0, byte)], sa0),
                             dq_pair(aq[fp4_offset(ra1, byte)], sa1),
                             dq_pair(aq[fp4_offset(ra0, byte + 4)], sa0),
                             dq_pair(aq[fp4_offset(ra1, byte + 4)], sa1)};
      const uint32_t b[2] = {dq_pair(bq[fp4_offset(rb, byte)], sb),
                             dq_pair(bq[fp4_offset(rb, byte + 4)], sb)};
      mma_bf16(d, a, b[0], b[1]);
    }
  } else {
    // mma_sm120.rs: a[r] = row g + 8(r%2), bytes 4t + 16(r/2); b[r] = row g, bytes 4t + 16r.
    const int ra0 = a_row(g), ra1 = a_row(g + 8), rb = b_row(g);
    const int base = kk * 32 + 4 * t;
    const uint32_t a[4] = {*reinterpret_cast<const uint32_t*>(aq + fp4_offset(ra0, base)),
                           *reinterpret_cast<const uint32_t*>(aq + fp4_offset(ra1, base)),
                           *reinterpret_cast<const uint32_t*>(aq + fp4_offset(ra0, base + 16)),
                           *reinterpret_cast<const uint32_t*>(aq + fp4_offset(ra1, base + 16))};
    const uint32_t b[2] = {*reinterpret_cast<const uint32_t*>(bq + fp4_offset(rb, base)),
                           *reinterpret_cast<const uint32_t*>(bq + fp4_offset(rb, base + 16))};
    // Scale lanes for selectors {0,0}: lane 4g → row g, lane 4g+1 → row g+8 (A); lane 4g →
    // column g (B). Every lane loads its pattern; the others are ignored by the MMA.
    const int sa_row = (t & 1) ? ra1 : ra0;
    const uint32_t sfa = *reinterpret_cast<const uint32_t*>(asf + sa_row * (TK / SF_VEC) + kk * 4);
    const uint32_t sfb = *reinterpret_cast<const uint32_t*>(bsf + rb * (TK / SF_VEC) + kk * 4);
    mma_nvf4(d, a, b, sfa, sfb);
  }
}

// The warp's share of one stage: MW weight-row MMA tiles × MT token MMA tiles over TK.
template <class WRow>
__device__ __forceinline__ void warp_stage(float (&acc)[MW][MT][4], const WeightTile w,
                                           const Fp4Tile act, WRow wrow) {
  // The native MMA is one instruction, so unrolling everything lets ptxas pipeline the
  // fragment loads. The portable and emulated MMAs expand to dozens of instructions each;
  // unrolled over K they exhaust the register file and spill.
#pragma unroll(kVariant == kNative ? TK / 64 : 1)
  for (int kk = 0; kk < TK / 64; ++kk) {
#pragma unroll
    for (int mw = 0; mw < MW; ++mw) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        auto w_row = [&](int r) { return wrow(mw * MMA_W + r); };
        auto t_row = [&](int r) { return mt * MMA_T + r; };
        if constexpr (SWAP_AB) {
          mma_k64(acc[mw][mt], w.q, w.sf, w_row, act.q, act.sf, t_row, kk);
        } else {
          mma_k64(acc[mw][mt], act.q, act.sf, t_row, w.q, w.sf, w_row, kk);
        }
      }
    }
  }
}

// Accumulator element r of tile (mw, mt) → (warp-local weight row j, token m).
__device__ __forceinline__ void acc_coord(int mw, int mt, int r, int& j, int& m) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int row = g + 8 * (r / 2), col = 2 * t + (r % 2);  // C layout of both MMAs
  if constexpr (SWAP_AB) {
    j = mw * MMA_W + row;
    m = mt * MMA_T + col;
  } else {
    j = mw * MMA_W + col;
    m = mt * MMA_T + row;
  }
}

// Quantizes a stage of BF16 activations [TM][TK] into the NVFP4 activation tile.
__device__ __forceinline__ void quantize_act_stage(const __nv_bfloat16* xs, Fp4Tile act,
                                                   float global) {
  for (int i = threadIdx.x; i < TM * (TK / SF_VEC); i += THREADS) {
    const int m = i / (TK / SF_VEC), blk = i % (TK / SF_VEC);
    float v[16];
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(xs + m * TK + blk * 16);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float2 f = __bfloat1622float2(p[e]);
      v[2 * e] = f.x;
      v[2 * e + 1] = f.y;
    }
    uint2 packed;
    act.sf[m * (TK / SF_VEC) + blk] = uint8_t(quantize16(v, global, packed));
    *reinterpret_cast<uint2*>(act.q + fp4_offset(m, blk * 8)) = packed;
  }
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

}  // namespace moe

using namespace moe;

// Token tile [m0, m0 + TM) of expert e's `count` assignments (from `begin`), gate/up rows i0..
__device__ __forceinline__ void gate_up_tile(const MoeArgs& args, uint8_t* smem, int e, int begin,
                                             int count, int m0, int i0) {
  const int H = args.hidden, I = args.inter;
  const int warp = threadIdx.x >> 5;

  // Stage buffers are addressed arithmetically: an array of per-stage pointers indexed by
  // kt % STAGES would live in local memory (stack frame) rather than registers.
  constexpr int stage_bytes = SmemLayout::weights + SmemLayout::act_bf16;
  auto wt = [&](int s) {
    uint8_t* b = smem + s * stage_bytes;
    return WeightTile{b, b + fp4_bytes(TN)};
  };
  auto xs = [&](int s) {
    return reinterpret_cast<__nv_bfloat16*>(smem + s * stage_bytes + SmemLayout::weights);
  };
  uint8_t* p = smem + STAGES * stage_bytes;
  const Fp4Tile act{p, p + fp4_bytes(TM)};

  const uint8_t* wq = args.w13 + size_t(e) * 2 * I * (H / 2);
  const size_t sf_rows = SCALES_SWIZZLED ? size_t(2 * I + 127) / 128 * 128 : size_t(2 * I);
  const size_t sf_cols = SCALES_SWIZZLED ? size_t(H / 16 + 3) / 4 * 4 : size_t(H / 16);
  const uint8_t* wsf = args.w13_sf + size_t(e) * sf_rows * sf_cols;
  // Tile rows [0, TN/2) are gate rows i0.., rows [TN/2, TN) the matching up rows.
  auto global_row = [&](int r) { return r < TN / 2 ? i0 + r : I + i0 + (r - TN / 2); };
  auto load_stage = [&](int s, int k0) {
    load_weights(wt(s), wq, wsf, H, k0, global_row);
    for (int i = threadIdx.x; i < TM * (TK / 8); i += THREADS) {
      const int m = i / (TK / 8), c = i % (TK / 8);
      const bool valid = m0 + m < count;
      const int tok = valid ? args.sorted_token_ids[begin + m0 + m] : 0;
      cp_async16(xs(s) + m * TK + c * 8, args.x + size_t(tok) * H + k0 + c * 8, valid);
    }
  };

  const int k_tiles = H / TK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) load_stage(s, s * TK);
    cp_async_commit();
  }

  float acc[MW][MT][4] = {};
  const float a_gs = args.a13_gs[e];
  // Warp-local row j: [0, WR) in the gate half, [WR, 2WR) the same rows in the up half.
  auto wrow = [&](int j) { return j < WR ? warp * WR + j : TN / 2 + warp * WR + (j - WR); };
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int next = kt + STAGES - 1;
    if (next < k_tiles) load_stage(next % STAGES, next * TK);
    cp_async_commit();
    quantize_act_stage(xs(kt % STAGES), act, a_gs);
    __syncthreads();
    warp_stage(acc, wt(kt % STAGES), act, wrow);
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue: SiLU(gate)·up in registers (gate tile mw and up tile mw + MW/2 hold the same
  // rows in the same lanes), staged in f32 so whole 16-blocks of h can be quantized.
  float* hs = reinterpret_cast<float*>(smem);  // [TM][TN/2]
  const float deq = a_gs * args.w13_gs[e];
#pragma unroll
  for (int mw = 0; mw < MW / 2; ++mw) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        int j, m;
        acc_coord(mw, mt, r, j, m);
        const float gate = acc[mw][mt][r] * deq, up = acc[mw + MW / 2][mt][r] * deq;
        hs[m * (TN / 2) + warp * WR + j] = silu(gate) * up;
      }
    }
  }
  __syncthreads();
  const float h_gs = args.a2_gs[e];
  for (int i = threadIdx.x; i < TM * (TN / 2 / SF_VEC); i += THREADS) {
    const int m = i / (TN / 2 / SF_VEC), blk = i % (TN / 2 / SF_VEC);
    if (m0 + m >= count) continue;
    float v[16];
#pragma unroll
    for (int q = 0; q < 16; ++q) v[q] = hs[m * (TN / 2) + blk * 16 + q];
    uint2 packed;
    const uint32_t sc = quantize16(v, h_gs, packed);
    const size_t row = size_t(begin + m0 + m);
    *reinterpret_cast<uint2*>(args.h_q + row * (I / 2) + (i0 + blk * 16) / 2) = packed;
    args.h_sf[row * (I / 16) + (i0 / 16 + blk)] = uint8_t(sc);
  }
}

// grid: (inter / (TN/2), most active experts, token tiles per pass); block: THREADS.
extern "C" __global__ void __launch_bounds__(THREADS, 1) moe_gate_up(const MoeArgs args) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (int(blockIdx.y) >= args.active_experts[0]) return;
  const int e = args.active_experts[1 + blockIdx.y];
  const int begin = args.expert_offsets[e], count = args.expert_offsets[e + 1] - begin;
  const int i0 = blockIdx.x * (TN / 2);
  for (int m0 = blockIdx.z * TM; m0 < count; m0 += int(gridDim.z) * TM) {
    gate_up_tile(args, smem, e, begin, count, m0, i0);
    // The next tile's first loads overwrite the epilogue's staging of this one.
    __syncthreads();
  }
}

// Token tile [m0, m0 + TM) of expert e, output rows h0.., K split `split`.
__device__ __forceinline__ void down_tile(const MoeArgs& args, uint8_t* smem, int e, int begin,
                                          int count, int m0, int h0, int split) {
  const int H = args.hidden, I = args.inter;
  const int warp = threadIdx.x >> 5;

  constexpr int stage_bytes = SmemLayout::weights + fp4_tile(TM);
  auto wt = [&](int s) {
    uint8_t* b = smem + s * stage_bytes;
    return WeightTile{b, b + fp4_bytes(TN)};
  };
  auto at = [&](int s) {
    uint8_t* b = smem + s * stage_bytes + SmemLayout::weights;
    return Fp4Tile{b, b + fp4_bytes(TM)};
  };

  const uint8_t* wq = args.w2 + size_t(e) * H * (I / 2);
  const size_t sf_rows = SCALES_SWIZZLED ? size_t(H + 127) / 128 * 128 : size_t(H);
  const size_t sf_cols = SCALES_SWIZZLED ? size_t(I / 16 + 3) / 4 * 4 : size_t(I / 16);
  const uint8_t* wsf = args.w2_sf + size_t(e) * sf_rows * sf_cols;
  auto global_row = [&](int r) { return h0 + r; };
  const int k_per_split = I / SPLIT_K, k_begin = split * k_per_split;
  auto load_stage = [&](int s, int k0) {
    load_weights(wt(s), wq, wsf, I, k0, global_row);
    for (int i = threadIdx.x; i < TM * CHUNKS; i += THREADS) {
      const int m = i / CHUNKS, c = i % CHUNKS;
      const bool valid = m0 + m < count;
      const size_t row = size_t(begin + m0 + (valid ? m : 0));
      cp_async16(at(s).q + fp4_offset(m, c * 16), args.h_q + row * (I / 2) + k0 / 2 + c * 16,
                 valid);
    }
    for (int i = threadIdx.x; i < TM * (TK / 64); i += THREADS) {
      const int m = i / (TK / 64), j = i % (TK / 64);
      const bool valid = m0 + m < count;
      const size_t row = size_t(begin + m0 + (valid ? m : 0));
      cp_async4(at(s).sf + m * (TK / SF_VEC) + j * 4, args.h_sf + row * (I / 16) + k0 / 16 + j * 4,
                valid);
    }
  };

  const int k_tiles = k_per_split / TK;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) load_stage(s, k_begin + s * TK);
    cp_async_commit();
  }
  float acc[MW][MT][4] = {};
  auto wrow = [&](int j) { return warp * 2 * WR + j; };
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int next = kt + STAGES - 1;
    if (next < k_tiles) load_stage(next % STAGES, k_begin + next * TK);
    cp_async_commit();
    warp_stage(acc, wt(kt % STAGES), at(kt % STAGES), wrow);
  }
  cp_async_wait<0>();

  // Tokens of different experts (and K splits) meet in `out`, so the sum is atomic.
  const float deq = args.a2_gs[e] * args.w2_gs[e];
#pragma unroll
  for (int mw = 0; mw < MW; ++mw) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        int j, m;
        acc_coord(mw, mt, r, j, m);
        if (m0 + m >= count) continue;
        const int a = begin + m0 + m;
        const int tok = args.sorted_token_ids[a];
        atomicAdd(args.out + size_t(tok) * H + h0 + wrow(j),
                  acc[mw][mt][r] * deq * args.sorted_weights[a]);
      }
    }
  }
}

// grid: (hidden / TN, most active experts, token tiles per pass · SPLIT_K); block: THREADS.
extern "C" __global__ void __launch_bounds__(THREADS, 1) moe_down(const MoeArgs args) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (int(blockIdx.y) >= args.active_experts[0]) return;
  const int e = args.active_experts[1 + blockIdx.y];
  const int begin = args.expert_offsets[e], count = args.expert_offsets[e + 1] - begin;
  const int h0 = blockIdx.x * TN, split = blockIdx.z % SPLIT_K;
  const int tiles_per_pass = int(gridDim.z) / SPLIT_K;
  for (int m0 = (blockIdx.z / SPLIT_K) * TM; m0 < count; m0 += tiles_per_pass * TM) {
    down_tile(args, smem, e, begin, count, m0, h0, split);
    // The next tile's first loads overwrite the stages this one may still be reading.
    __syncthreads();
  }
}

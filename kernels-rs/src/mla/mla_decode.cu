// MLA decode attention (absorbed form) over the paged latent cache: L latent + R RoPE values
// per cached token, shared by all heads (Kimi-K2.5 / DeepSeek-V3: 512 + 64; the small golden
// checkpoints: 64 + 16).
//
// One translation unit per tactic: the gate (kernels-rs/src/bin/ptx-gate.rs) passes the
// parameters of `MlaTactic` (kernels-rs/src/mla/tactic.rs) as -D macros — the cache row's
// widths among them, as FlashInfer makes its head dims template parameters — with the
// shared-memory size Rust computed, which is static_asserted against the layout below. Every
// place that depends on the widths folds to compile-time constants, so an instance for other
// widths compiles the same code as Kimi-K2.5's, not a generic loop over run-time sizes.
//
// Kernels:
//   mla_decode   grid (head groups, splits, batch). Each CTA attends HEADS query heads of one
//                request over one split of its tokens (flash-decoding): a cp.async pipeline of
//                TILE-token tiles gathered through the block table, S = q·Kᵀ on tensor cores,
//                online softmax in shared memory, O += P·C on tensor cores. With one split it
//                writes the output directly; otherwise a normalized partial and its LSE.
//   mla_combine  merges the splits exactly through their log-sum-exps.
//   mla_append   writes new tokens: RMSNorm of the latent (fused: the FP8 scale needs the
//                normalized row's amax anyway), the already RoPE'd key part, and for FP8 the
//                per-token scale and E4M3 codes, with the scheme of cache.rs.
//
// Cache layout per layer (identical to PagedLatentCache's storage, so it uploads as is):
//   BF16: kv[slot][L + R] (latent then RoPE), slot = page·64 + token-in-page.
//   FP8:  codes[slot][L] E4M3, scale[slot] f32 (dequantized value = code · scale),
//         rope[slot][R] BF16.
//
// Kinds (MLA_KIND): 0 BF16 cache; 1 FP8 cache, codes widened exactly to BF16 on the way from
// shared memory to the MMA, token scale applied to the score and folded into P; 2 as 1 but q·c
// runs as E4M3 mma.sync with q_abs quantized per head in the kernel. See MlaKind for why P·C
// never runs in E4M3.
//
// Precision: q_abs / q_pe arrive in BF16, P is rounded to BF16 before P·C, accumulation and
// softmax statistics are FP32.

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ptx_helpers.cuh"

#ifndef MLA_KIND
// Defaults only so editors and a bare `nvcc -c` can parse the file; the gate always sets all.
#define MLA_KIND 0
#define MLA_LATENT 512
#define MLA_ROPE 64
#define MLA_HEADS 16
#define MLA_TILE 32
#define MLA_WARPS 4
#define MLA_STAGES 2
#endif

namespace mla {

constexpr int KIND = MLA_KIND;
constexpr int HEADS = MLA_HEADS;
constexpr int TILE = MLA_TILE;
constexpr int WARPS = MLA_WARPS;
constexpr int STAGES = MLA_STAGES;
constexpr int THREADS = WARPS * 32;
constexpr bool FP8 = KIND != 0;
constexpr bool QK8 = KIND == 2;

constexpr int L = MLA_LATENT;  // kv_lora_rank
constexpr int R = MLA_ROPE;    // qk_rope_head_dim
constexpr int D = L + R;
constexpr int PAGE = 64;
constexpr int PAD = 16;  // bytes per smem row: breaks the 128 B row-stride bank conflicts
constexpr int MT = HEADS / 16;            // M tiles of heads
constexpr int COLS_PER_WARP = L / WARPS;  // latent columns of O owned by each warp
constexpr int NT = COLS_PER_WARP / 8;     // their n8 tiles
constexpr int ROW_LANES = THREADS / HEADS;  // softmax lanes per head

static_assert(HEADS % 16 == 0 && MT <= 4, "heads per block: 16..64");
static_assert(L % 64 == 0 && L <= 1024, "latent: whole 64-byte FP8 code blocks, at most 1024");
static_assert(R % 16 == 0 && R >= 16 && R <= 128, "RoPE: whole k16 steps; mla_append's 128 threads");
static_assert(!QK8 || (L % 128 == 0 && R <= 64),
              "fp8qk quantizes q with one warp per head: L/32 values per lane in packs of 4, "
              "q_pe two values per lane");
static_assert(TILE % 16 == 0, "token tiles are whole k16 steps of P·C");
static_assert(L % WARPS == 0 && NT % 4 == 0,
              "each warp owns whole 32-column groups of O (the FP8 P·C loader's four n-tiles)");
static_assert(MT * NT * 4 <= 64, "P·C accumulators per thread");
static_assert(ROW_LANES >= 1 && ROW_LANES <= 32 && (ROW_LANES & (ROW_LANES - 1)) == 0,
              "softmax lane groups");
static_assert(TILE % ROW_LANES == 0, "softmax columns per lane");

__host__ __device__ constexpr int align16(int n) { return (n + 15) / 16 * 16; }

// Shared memory, in bytes: mirrors MlaTactic::smem() in tactic.rs.
struct SmemLayout {
  // Q: BF16 [HEADS][L + R] (+pad), or for QK8 E4M3 [HEADS][L] + BF16 [HEADS][R] + scales.
  static constexpr int q_row = 2 * D + PAD;
  static constexpr int qc_row = L + PAD;
  static constexpr int qpe_row = 2 * R + PAD;
  static constexpr int q = QK8 ? HEADS * qc_row + HEADS * qpe_row + align16(4 * HEADS)
                               : HEADS * q_row;
  // One stage of cache rows.
  static constexpr int kv_row = 2 * D + PAD;  // BF16
  static constexpr int c_row = L + PAD;       // FP8 codes
  static constexpr int pe_row = 2 * R + PAD;  // FP8 kinds' BF16 RoPE
  static constexpr int stage =
      FP8 ? TILE * c_row + TILE * pe_row + align16(4 * TILE) : TILE * kv_row;
  static constexpr int s_row = 4 * TILE + PAD;  // f32 scores
  static constexpr int p_row = 2 * TILE + PAD;  // bf16 probabilities
  static constexpr int scores = HEADS * s_row;
  static constexpr int probs = HEADS * p_row;
  static constexpr int stats = align16(3 * 4 * HEADS);
  static constexpr int off_stage = q;
  static constexpr int off_scores = off_stage + STAGES * stage;
  static constexpr int off_probs = off_scores + scores;
  static constexpr int off_stats = off_probs + probs;
  static constexpr int total = off_stats + stats;
};
#ifdef MLA_EXPECT_SMEM
static_assert(SmemLayout::total == MLA_EXPECT_SMEM, "Rust and CUDA smem disagree");
#endif

struct DecodeArgs {
  const __nv_bfloat16* q_abs;  // [B][H][L]
  const __nv_bfloat16* q_pe;   // [B][H][R]
  const void* kv;              // BF16 kv[slot][L + R], or FP8 codes[slot][L]
  const float* kv_scale;       // FP8: [slot]
  const __nv_bfloat16* kv_rope;  // FP8: [slot][R]
  const int* block_table;      // [B][max_pages]
  const int* seq_lens;         // [B]: tokens each request attends to
  float* out;                  // [B][H][L]
  float* lse;                  // [B][H]
  float* part_out;             // [B][H][splits][L], used when splits > 1
  float* part_lse;             // [B][H][splits]
  int heads;
  int max_pages;
  float softmax_scale;
};

// ------------------------------------------------------------------ conversions

// Two E4M3 codes, in bytes 0 and 2 of `x` (bytes 1 and 3 zero), as an exact BF16 pair: the
// sign moves to bit 15, exponent and mantissa shift into BF16's fields (bias 7 read as 127),
// and one multiply by 2^120 rebiases. E4M3 subnormals land on BF16 subnormals, which the
// multiply scales exactly too. NaN codes (never written: the cache encoder saturates) would
// come out finite.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t x) {
  const uint32_t bits = ((x & 0x00800080u) << 8) | ((x & 0x007f007fu) << 4);
  __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&bits);
  const uint32_t k = 0x7B807B80u;  // BF16 2^120, twice
  v = __hmul2(v, *reinterpret_cast<const __nv_bfloat162*>(&k));
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ------------------------------------------------------------------ the decode kernel

// Copies tokens [t0, t0 + TILE) ∩ [.., end) of one request into a stage; rows past `end` are
// zero-filled (their scores are masked anyway, zeros keep NaN patterns out of the MMAs).
__device__ __forceinline__ void load_tile(uint8_t* stage, const DecodeArgs& a, const int* table,
                                          int t0, int end) {
  constexpr int row_chunks = FP8 ? (L + 2 * R) / 16 : 2 * D / 16;
  for (int i = threadIdx.x; i < TILE * row_chunks; i += THREADS) {
    const int tok = i / row_chunks, c = i % row_chunks;
    const int pos = t0 + tok;
    const bool valid = pos < end;
    const int slot = valid ? table[pos / PAGE] * PAGE + pos % PAGE : 0;
    if constexpr (!FP8) {
      const uint8_t* src = static_cast<const uint8_t*>(a.kv) + size_t(slot) * 2 * D + c * 16;
      cp_async16(stage + tok * SmemLayout::kv_row + c * 16, src, valid);
    } else if (c < L / 16) {
      const uint8_t* src = static_cast<const uint8_t*>(a.kv) + size_t(slot) * L + c * 16;
      cp_async16(stage + tok * SmemLayout::c_row + c * 16, src, valid);
    } else {
      const int rc = c - L / 16;
      const uint8_t* src = reinterpret_cast<const uint8_t*>(a.kv_rope) + size_t(slot) * 2 * R +
                           rc * 16;
      cp_async16(stage + TILE * SmemLayout::c_row + tok * SmemLayout::pe_row + rc * 16, src,
                 valid);
    }
  }
  if constexpr (FP8) {
    float* scales = reinterpret_cast<float*>(stage + TILE * (SmemLayout::c_row + SmemLayout::pe_row));
    for (int tok = threadIdx.x; tok < TILE; tok += THREADS) {
      const int pos = t0 + tok;
      const bool valid = pos < end;
      const int slot = valid ? table[pos / PAGE] * PAGE + pos % PAGE : 0;
      cp_async4(scales + tok, a.kv_scale + slot, valid);
    }
  }
}

// One k16 step `KS` of a score tile on its own (the odd last step of a row whose width is an
// odd number of k16 steps): A from the query rows at column `q_col0 + 16·KS`, B (x2: this
// step's two 8×8 matrices) from the cache rows at column 16·KS.
template <int KS>
__device__ __forceinline__ void score_k16_tail(float (&acc)[4], const uint8_t* q, int q_row,
                                               int q_col0, const uint8_t* kv, int kv_row,
                                               int a_row, int a_col, int b_row, int b_col) {
  uint32_t a[4], b[2];
  ldsm_x4(a, q + a_row * q_row + 2 * (q_col0 + KS * 16 + a_col));
  ldsm_x2(b, kv + b_row * kv_row + 2 * (KS * 16 + (b_col & 8)));
  mma_bf16(acc, a, b[0], b[1]);
}

// Scores of one (M tile, 8-token) tile: q·c over the latent part (per kind) plus q_pe·k_pe.
__device__ __forceinline__ void score_tile(float (&acc)[4], const uint8_t* qs, const uint8_t* st,
                                           int mt, int nt) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  // ldmatrix lane → row / column of the 4 matrices (A: rows 0-7/8-15 × k 0-7/8-15; B: rows
  // 0-7 × four consecutive 8-wide column blocks).
  const int a_row = mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);
  const int b_row = nt * 8 + (lane & 7), b_col = 8 * (lane >> 3);
  float lat[4] = {0.f, 0.f, 0.f, 0.f};
  float pe[4] = {0.f, 0.f, 0.f, 0.f};
  if constexpr (!FP8) {
    // Latent and RoPE parts are one contiguous (L + R)-wide row: D/16 k16 steps, two per
    // load (Kimi-K2.5: 36), and an odd last one alone.
    constexpr int KS = D / 16;
#pragma unroll 2
    for (int ks = 0; ks < KS - KS % 2; ks += 2) {
      uint32_t a0[4], a1[4], b[4];
      ldsm_x4(a0, qs + a_row * SmemLayout::q_row + 2 * (ks * 16 + a_col));
      ldsm_x4(a1, qs + a_row * SmemLayout::q_row + 2 * ((ks + 1) * 16 + a_col));
      ldsm_x4(b, st + b_row * SmemLayout::kv_row + 2 * (ks * 16 + b_col));
      mma_bf16(lat, a0, b[0], b[1]);
      mma_bf16(lat, a1, b[2], b[3]);
    }
    if constexpr (KS % 2 != 0) score_k16_tail<KS - 1>(lat, qs, SmemLayout::q_row, 0, st,
                                                       SmemLayout::kv_row, a_row, a_col, b_row, b_col);
  } else {
    const uint8_t* codes = st;
    const uint8_t* rope = st + TILE * SmemLayout::c_row;
    const float* kscale = reinterpret_cast<const float*>(rope + TILE * SmemLayout::pe_row);
    if constexpr (!QK8) {
      // One ldmatrix (b16 view of the codes) gives lane (g, c) bytes 4c..4c+3 of token g in
      // each of four 16-byte column blocks. Used as k16 B fragments, that is a permutation of
      // k (logical 2c,2c+1 ↔ bytes 4c,4c+1; 2c+8,2c+9 ↔ 4c+2,4c+3), so the A fragments read
      // q at the same permuted positions: one 8-byte load per row gives a0/a2 (a1/a3).
#pragma unroll 2
      for (int kb = 0; kb < L; kb += 64) {
        uint32_t b[4];
        ldsm_x4(b, codes + b_row * SmemLayout::c_row + kb + 16 * (lane >> 3));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int k = kb + 16 * j + 4 * c;
          const uint2 lo = *reinterpret_cast<const uint2*>(qs + (mt * 16 + g) * SmemLayout::q_row + 2 * k);
          const uint2 hi = *reinterpret_cast<const uint2*>(qs + (mt * 16 + g + 8) * SmemLayout::q_row + 2 * k);
          const uint32_t a[4] = {lo.x, hi.x, lo.y, hi.y};
          mma_bf16(lat, a, e4m3x2_to_bf16x2(__byte_perm(b[j], 0, 0x4140)),
                   e4m3x2_to_bf16x2(__byte_perm(b[j], 0, 0x4342)));
        }
      }
#pragma unroll
      for (int ks = 0; ks < R / 16 - (R / 16) % 2; ks += 2) {
        uint32_t a0[4], a1[4], b[4];
        ldsm_x4(a0, qs + a_row * SmemLayout::q_row + 2 * (L + ks * 16 + a_col));
        ldsm_x4(a1, qs + a_row * SmemLayout::q_row + 2 * (L + (ks + 1) * 16 + a_col));
        ldsm_x4(b, rope + b_row * SmemLayout::pe_row + 2 * (ks * 16 + b_col));
        mma_bf16(pe, a0, b[0], b[1]);
        mma_bf16(pe, a1, b[2], b[3]);
      }
      if constexpr ((R / 16) % 2 != 0)
        score_k16_tail<R / 16 - 1>(pe, qs, SmemLayout::q_row, L, rope, SmemLayout::pe_row, a_row,
                                   a_col, b_row, b_col);
    } else {
      // E4M3 m16n8k32: the same ldmatrix gives B fragments directly (bytes 4c..4c+3 of token
      // g), and A fragments are 4-byte loads of the quantized q codes.
      const uint8_t* qc = qs;
      const uint8_t* qpe = qs + HEADS * SmemLayout::qc_row;
#pragma unroll 2
      for (int kb = 0; kb < L; kb += 64) {
        uint32_t b[4];
        ldsm_x4(b, codes + b_row * SmemLayout::c_row + kb + 16 * (lane >> 3));
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int k = kb + 32 * j + 4 * c;
          const uint8_t* r0 = qc + (mt * 16 + g) * SmemLayout::qc_row;
          const uint8_t* r1 = qc + (mt * 16 + g + 8) * SmemLayout::qc_row;
          const uint32_t a[4] = {*reinterpret_cast<const uint32_t*>(r0 + k),
                                 *reinterpret_cast<const uint32_t*>(r1 + k),
                                 *reinterpret_cast<const uint32_t*>(r0 + k + 16),
                                 *reinterpret_cast<const uint32_t*>(r1 + k + 16)};
          mma_e4m3(lat, a, b[2 * j], b[2 * j + 1]);
        }
      }
      const float* qscale = reinterpret_cast<const float*>(qpe + HEADS * SmemLayout::qpe_row);
      const float s0 = qscale[mt * 16 + g], s1 = qscale[mt * 16 + g + 8];
      lat[0] *= s0;
      lat[1] *= s0;
      lat[2] *= s1;
      lat[3] *= s1;
#pragma unroll
      for (int ks = 0; ks < R / 16 - (R / 16) % 2; ks += 2) {
        uint32_t a0[4], a1[4], b[4];
        ldsm_x4(a0, qpe + a_row * SmemLayout::qpe_row + 2 * (ks * 16 + a_col));
        ldsm_x4(a1, qpe + a_row * SmemLayout::qpe_row + 2 * ((ks + 1) * 16 + a_col));
        ldsm_x4(b, rope + b_row * SmemLayout::pe_row + 2 * (ks * 16 + b_col));
        mma_bf16(pe, a0, b[0], b[1]);
        mma_bf16(pe, a1, b[2], b[3]);
      }
      if constexpr ((R / 16) % 2 != 0)
        score_k16_tail<R / 16 - 1>(pe, qpe, SmemLayout::qpe_row, 0, rope, SmemLayout::pe_row,
                                   a_row, a_col, b_row, b_col);
    }
    // The token scale multiplies the latent part of its score column.
    const float k0 = kscale[nt * 8 + 2 * c], k1 = kscale[nt * 8 + 2 * c + 1];
    lat[0] *= k0;
    lat[1] *= k1;
    lat[2] *= k0;
    lat[3] *= k1;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = lat[i] + pe[i];
}

// Latent column of accumulator column `j` (0..7) of n-tile `n` of this warp. The FP8 P·C
// loader yields four n-tiles per 32 columns: even bytes of the low 16, odd bytes of the low
// 16, then the same for the high 16.
__device__ __forceinline__ int out_col(int warp, int n, int j) {
  const int base = warp * COLS_PER_WARP;
  if constexpr (!FP8) return base + n * 8 + j;
  const int grp = n / 4, e = n % 4;
  return base + grp * 32 + (e >= 2 ? 16 : 0) + 2 * j + (e & 1);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mla_decode(const DecodeArgs args) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* qs = smem;
  float* sc = reinterpret_cast<float*>(smem + SmemLayout::off_scores);
  __nv_bfloat16* pr = reinterpret_cast<__nv_bfloat16*>(smem + SmemLayout::off_probs);
  float* m_run = reinterpret_cast<float*>(smem + SmemLayout::off_stats);
  float* l_run = m_run + HEADS;
  float* alpha = l_run + HEADS;
  constexpr int S_STRIDE = SmemLayout::s_row / 4;
  constexpr int P_STRIDE = SmemLayout::p_row / 2;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int h0 = blockIdx.x * HEADS, split = blockIdx.y, splits = gridDim.y, b = blockIdx.z;
  const int H = args.heads;
  const int len = args.seq_lens[b];
  // Every split covers whole tiles; the last ones may be empty for short requests.
  const int per_split = (len + splits - 1) / splits;
  const int chunk = (per_split + TILE - 1) / TILE * TILE;
  const int start = split * chunk;
  const int end = min(len, start + chunk);
  const int* table = args.block_table + size_t(b) * args.max_pages;

  if (start >= end) {
    // Empty split: contributes nothing to the combine (LSE −∞). With one split (len == 0)
    // the output is defined as zeros with LSE −∞.
    for (int i = tid; i < HEADS * L; i += THREADS) {
      const int h = h0 + i / L;
      if (h >= H) continue;
      float* dst = splits == 1 ? args.out + (size_t(b) * H + h) * L
                               : args.part_out + ((size_t(b) * H + h) * splits + split) * L;
      dst[i % L] = 0.f;
    }
    for (int i = tid; i < HEADS; i += THREADS) {
      if (h0 + i >= H) continue;
      const size_t bh = size_t(b) * H + h0 + i;
      (splits == 1 ? args.lse[bh] : args.part_lse[bh * splits + split]) = -INFINITY;
    }
    return;
  }

  // ---- queries
  if constexpr (!QK8) {
    for (int i = tid; i < HEADS * (2 * D / 16); i += THREADS) {
      const int r = i / (2 * D / 16), ch = i % (2 * D / 16);
      const int h = h0 + r;
      const bool valid = h < H;
      const size_t bh = size_t(b) * H + (valid ? h : 0);
      const uint8_t* src =
          ch < 2 * L / 16
              ? reinterpret_cast<const uint8_t*>(args.q_abs + bh * L) + ch * 16
              : reinterpret_cast<const uint8_t*>(args.q_pe + bh * R) + (ch - 2 * L / 16) * 16;
      cp_async16(qs + r * SmemLayout::q_row + ch * 16, src, valid);
    }
  } else {
    // Per-head E4M3 quantization of q_abs: scale = amax / 448, one warp per head, L/32
    // values per lane (this branch is compiled, not run, for the other kinds: any
    // whole-pack width keeps it well-formed there).
    constexpr int QV = QK8 ? L / 32 : 16;
    uint8_t* qc = qs;
    uint8_t* qpe = qs + HEADS * SmemLayout::qc_row;
    float* qscale = reinterpret_cast<float*>(qpe + HEADS * SmemLayout::qpe_row);
    for (int r = warp; r < HEADS; r += WARPS) {
      const int h = h0 + r;
      float v[QV];
      float amax = 0.f;
      const size_t bh = size_t(b) * H + (h < H ? h : 0);
#pragma unroll
      for (int i = 0; i < QV; i += 2) {
        const __nv_bfloat162 x =
            h < H ? *reinterpret_cast<const __nv_bfloat162*>(args.q_abs + bh * L + lane * QV + i)
                  : __floats2bfloat162_rn(0.f, 0.f);
        v[i] = __low2float(x);
        v[i + 1] = __high2float(x);
        amax = fmaxf(amax, fmaxf(fabsf(v[i]), fabsf(v[i + 1])));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const float scale = amax > 0.f ? amax / 448.f : 1.f;
      uint32_t packed[QV / 4];
#pragma unroll
      for (int i = 0; i < QV; i += 4) {
        const __nv_fp8x2_storage_t lo =
            __nv_cvt_float2_to_fp8x2(make_float2(v[i] / scale, v[i + 1] / scale), __NV_SATFINITE, __NV_E4M3);
        const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
            make_float2(v[i + 2] / scale, v[i + 3] / scale), __NV_SATFINITE, __NV_E4M3);
        packed[i / 4] = uint32_t(lo) | (uint32_t(hi) << 16);
      }
      uint8_t* codes = qc + r * SmemLayout::qc_row + lane * QV;
      if constexpr (QV % 16 == 0) {
#pragma unroll
        for (int w = 0; w < QV / 4; w += 4)
          *reinterpret_cast<uint4*>(codes + 4 * w) =
              make_uint4(packed[w], packed[w + 1], packed[w + 2], packed[w + 3]);
      } else {
#pragma unroll
        for (int w = 0; w < QV / 4; ++w) *reinterpret_cast<uint32_t*>(codes + 4 * w) = packed[w];
      }
      // Two q_pe values per lane: every lane for R = 64, the first R/2 for narrower RoPE.
      if (R == 64 || 2 * lane < R) {
        const uint32_t pe =
            h < H ? *reinterpret_cast<const uint32_t*>(args.q_pe + bh * R + 2 * lane) : 0u;
        *reinterpret_cast<uint32_t*>(qpe + r * SmemLayout::qpe_row + 4 * lane) = pe;
      }
      if (lane == 0) qscale[r] = scale;
    }
  }
  for (int i = tid; i < HEADS; i += THREADS) {
    m_run[i] = -INFINITY;
    l_run[i] = 0.f;
  }

  float o[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][n][i] = 0.f;

  const int tiles = (end - start + TILE - 1) / TILE;
  // Pipeline prologue: STAGES-1 tiles in flight (the queries ride in the first group).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < tiles)
      load_tile(smem + SmemLayout::off_stage + s * SmemLayout::stage, args, table,
                start + s * TILE, end);
    cp_async_commit();
  }

  for (int it = 0; it < tiles; ++it) {
    {
      const int next = it + STAGES - 1;
      if (next < tiles)
        load_tile(smem + SmemLayout::off_stage + (next % STAGES) * SmemLayout::stage, args,
                  table, start + next * TILE, end);
      cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    const uint8_t* st = smem + SmemLayout::off_stage + (it % STAGES) * SmemLayout::stage;
    const int t0 = start + it * TILE;

    // ---- S = q·Kᵀ · softmax_scale, masked past `end`
    for (int tile = warp; tile < MT * (TILE / 8); tile += WARPS) {
      const int mt = tile / (TILE / 8), nt = tile % (TILE / 8);
      float acc[4];
      score_tile(acc, qs, st, mt, nt);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = mt * 16 + g + 8 * (i >> 1), col = nt * 8 + 2 * c + (i & 1);
        sc[row * S_STRIDE + col] =
            t0 + col < end ? acc[i] * args.softmax_scale : -INFINITY;
      }
    }
    __syncthreads();

    // ---- online softmax: ROW_LANES lanes per head
    {
      const int row = tid / ROW_LANES, sub = tid % ROW_LANES;
      const float* srow = sc + row * S_STRIDE;
      float mx = -INFINITY;
      for (int j = sub; j < TILE; j += ROW_LANES) mx = fmaxf(mx, srow[j]);
#pragma unroll
      for (int o2 = ROW_LANES / 2; o2 > 0; o2 >>= 1)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o2));
      const float m_old = m_run[row];
      const float m_new = fmaxf(m_old, mx);  // finite: every tile has a valid token
      float sum = 0.f;
      const float* kscale = reinterpret_cast<const float*>(
          st + TILE * (SmemLayout::c_row + SmemLayout::pe_row));
      for (int j = sub; j < TILE; j += ROW_LANES) {
        // The normalizer sums the BF16-rounded weights P·C will use.
        const float p = __bfloat162float(__float2bfloat16_rn(__expf(srow[j] - m_new)));
        sum += p;
        const float folded = FP8 ? p * kscale[j] : p;
        pr[row * P_STRIDE + j] = __float2bfloat16_rn(folded);
      }
#pragma unroll
      for (int o2 = ROW_LANES / 2; o2 > 0; o2 >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o2);
      __syncwarp();
      if (sub == 0) {
        const float a = __expf(m_old - m_new);  // 0 on the first tile (m_old = −∞)
        alpha[row] = a;
        l_run[row] = l_run[row] * a + sum;
        m_run[row] = m_new;
      }
    }
    __syncthreads();

    // ---- O = O·alpha + P·C over this warp's latent columns
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float a0 = alpha[mt * 16 + g], a1 = alpha[mt * 16 + g + 8];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        o[mt][n][0] *= a0;
        o[mt][n][1] *= a0;
        o[mt][n][2] *= a1;
        o[mt][n][3] *= a1;
      }
    }
#pragma unroll
    for (int kk = 0; kk < TILE / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldsm_x4(pa[mt], pr + (mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * P_STRIDE +
                            kk * 16 + 8 * (lane >> 4));
      // Transposed ldmatrix: matrices (tokens 0-7 | 8-15) × (two column blocks).
      const int tok = kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
      for (int n = 0; n < NT; n += FP8 ? 4 : 2) {
        uint32_t bt[4];
        if constexpr (!FP8) {
          const int col = warp * COLS_PER_WARP + n * 8 + 8 * (lane >> 4);
          ldsm_x4_t(bt, st + tok * SmemLayout::kv_row + 2 * col);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(o[mt][n], pa[mt], bt[0], bt[1]);
            mma_bf16(o[mt][n + 1], pa[mt], bt[2], bt[3]);
          }
        } else {
          // b16 view of the codes: lane (g, c) gets, per matrix, tokens 2c and 2c+1 of byte
          // pair g, i.e. bytes {t2c: 2g, 2g+1; t2c+1: 2g, 2g+1}. Even bytes form one n-tile's
          // k16 B fragment, odd bytes another (see out_col).
          const int col = warp * COLS_PER_WARP + (n / 4) * 32 + 16 * (lane >> 4);
          ldsm_x4_t(bt, st + tok * SmemLayout::c_row + col);
          const uint32_t ev_lo0 = e4m3x2_to_bf16x2(__byte_perm(bt[0], 0, 0x4240));
          const uint32_t ev_lo1 = e4m3x2_to_bf16x2(__byte_perm(bt[1], 0, 0x4240));
          const uint32_t od_lo0 = e4m3x2_to_bf16x2(__byte_perm(bt[0], 0, 0x4341));
          const uint32_t od_lo1 = e4m3x2_to_bf16x2(__byte_perm(bt[1], 0, 0x4341));
          const uint32_t ev_hi0 = e4m3x2_to_bf16x2(__byte_perm(bt[2], 0, 0x4240));
          const uint32_t ev_hi1 = e4m3x2_to_bf16x2(__byte_perm(bt[3], 0, 0x4240));
          const uint32_t od_hi0 = e4m3x2_to_bf16x2(__byte_perm(bt[2], 0, 0x4341));
          const uint32_t od_hi1 = e4m3x2_to_bf16x2(__byte_perm(bt[3], 0, 0x4341));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(o[mt][n], pa[mt], ev_lo0, ev_lo1);
            mma_bf16(o[mt][n + 1], pa[mt], od_lo0, od_lo1);
            mma_bf16(o[mt][n + 2], pa[mt], ev_hi0, ev_hi1);
            mma_bf16(o[mt][n + 3], pa[mt], od_hi0, od_hi1);
          }
        }
      }
    }
    __syncthreads();  // the stage, scores and P are overwritten next iteration
  }
  cp_async_wait<0>();

  // ---- epilogue: normalized output (or partial) and LSE
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = mt * 16 + g + 8 * half, h = h0 + row;
      if (h >= H) continue;
      const float inv = 1.f / l_run[row];
      const size_t bh = size_t(b) * H + h;
      float* dst = splits == 1 ? args.out + bh * L : args.part_out + (bh * splits + split) * L;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        dst[out_col(warp, n, 2 * c)] = o[mt][n][2 * half] * inv;
        dst[out_col(warp, n, 2 * c + 1)] = o[mt][n][2 * half + 1] * inv;
      }
    }
  }
  for (int i = tid; i < HEADS; i += THREADS) {
    if (h0 + i >= H) continue;
    const size_t bh = size_t(b) * H + h0 + i;
    const float v = m_run[i] + __logf(l_run[i]);
    (splits == 1 ? args.lse[bh] : args.part_lse[bh * splits + split]) = v;
  }
}

// ------------------------------------------------------------------ split combine

// One CTA per (request, head): lse = M + ln Σ e^{lse_s − M}, out = Σ e^{lse_s − lse} · out_s.
extern "C" __global__ void __launch_bounds__(128) mla_combine(const float* part_out,
                                                              const float* part_lse, float* out,
                                                              float* lse, int splits) {
  const size_t bh = blockIdx.x;
  const float* pl = part_lse + bh * splits;
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, pl[s]);
  float total = 0.f;
  for (int s = 0; s < splits; ++s) total += pl[s] == -INFINITY ? 0.f : __expf(pl[s] - m);
  const float l = m + __logf(total);
  for (int d = threadIdx.x; d < L; d += blockDim.x) {
    float acc = 0.f;
    for (int s = 0; s < splits; ++s)
      if (pl[s] != -INFINITY) acc += __expf(pl[s] - l) * part_out[(bh * splits + s) * L + d];
    out[bh * L + d] = m == -INFINITY ? 0.f : acc;
  }
  if (threadIdx.x == 0) lse[bh] = m == -INFINITY ? -INFINITY : l;
}

// ------------------------------------------------------------------ cache append

// One CTA (128 threads) per new token, each thread ceil(L/128) latent values (a narrower
// latent leaves the last threads idle): y = RMSNorm(latent) (FP32, weight BF16), then
//   BF16: kv[slot] = bf16(y ‖ rope)
//   FP8:  scale = static_scale > 0 ? static_scale : (amax(y) > 0 ? amax(y)/448 : 1),
//         codes = e4m3_satfinite(y / scale), rope in BF16 — exactly cache.rs's encoder.
// A per-tensor checkpoint k_scale is the static_scale case: every token gets the same scale,
// so the decode kernel needs no second code path.
extern "C" __global__ void __launch_bounds__(128) mla_append(
    const float* latent, const float* rope, const __nv_bfloat16* norm_weight, float eps,
    const int* slot_mapping, void* kv, float* kv_scale, __nv_bfloat16* kv_rope,
    float static_scale) {
  constexpr int PER_THREAD = (L + 127) / 128;
  // Whether thread `tid`'s value `i` is a latent value (always, when L is a multiple of 128).
  const auto in_row = [](int tid, int i) { return L % 128 == 0 || tid * PER_THREAD + i < L; };
  __shared__ float red[4];
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slot = slot_mapping[t];
  if (slot < 0) return;  // padding token
  float v[PER_THREAD];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    v[i] = in_row(tid, i) ? latent[size_t(t) * L + tid * PER_THREAD + i] : 0.f;
    ss += v[i] * v[i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) red[warp] = ss;
  __syncthreads();
  const float inv = 1.f / sqrtf((red[0] + red[1] + red[2] + red[3]) / float(L) + eps);
  __syncthreads();
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    v[i] = in_row(tid, i) ? __bfloat162float(norm_weight[tid * PER_THREAD + i]) * (v[i] * inv)
                          : 0.f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
  const float* rp = rope + size_t(t) * R;
  if constexpr (!FP8) {
    __nv_bfloat16* row = static_cast<__nv_bfloat16*>(kv) + size_t(slot) * D;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i)
      if (in_row(tid, i)) row[tid * PER_THREAD + i] = __float2bfloat16_rn(v[i]);
    if (tid < R) row[L + tid] = __float2bfloat16_rn(rp[tid]);
  } else {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) red[warp] = amax;
    __syncthreads();
    amax = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    const float scale =
        static_scale > 0.f ? static_scale : (amax > 0.f && isfinite(amax) ? amax / 448.f : 1.f);
    uint8_t* row = static_cast<uint8_t*>(kv) + size_t(slot) * L;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i)
      if (in_row(tid, i))
        row[tid * PER_THREAD + i] = __nv_cvt_float_to_fp8(v[i] / scale, __NV_SATFINITE, __NV_E4M3);
    if (tid == 0) kv_scale[slot] = scale;
    if (tid < R) kv_rope[size_t(slot) * R + tid] = __float2bfloat16_rn(rp[tid]);
  }
}

}  // namespace mla

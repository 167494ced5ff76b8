// The decode step's small kernels, around the MoE, MLA and all-reduce families: what the CPU
// forward pass (model/src/forward.rs) does on the host between products, as device work, so a
// whole step can stay on the device and be captured as a CUDA graph.
//
//   embed_gather     token ids → FP32 rows of the BF16 embedding table (or of a rank's rows)
//   add_rms_norm     residual += x (optional), out = RMSNorm(residual) · w   (one row per CTA)
//   rope_interleaved rotate pairs (2i, 2i+1) of strided slices by position (YaRN frequencies)
//   route_noaux_tc   DeepSeek-V3 / Kimi routing: sigmoid scores, correction bias for choosing
//                    only, group-limited top-k, normalized weights × scaling factor
//   group_by_expert  routing → expert_offsets / sorted_token_ids / sorted_weights, the MoE
//                    kernels' layout (tokens in increasing order within an expert), and the
//                    list of active experts the MoE grid's y dimension walks
//   dense_bf16       y[t] = x[t] · Wᵀ, W BF16 [N, K] row-major (the decode-shaped products)
//   dense_heads_bf16 per head h: y[t, h] = x[t, h] · W_hᵀ over strided rows (the absorbed
//                    attention's W_UK and W_UV products, every head in one launch)
//   silu_mul         h = SiLU(gate) · up over [rows, 2·I] = gate ‖ up
//   argmax_rows      greedy sampling, the first index on ties
//   argmax_shard     the same over a rank's vocabulary columns, as a (value, id) pair slot
//   argmax_ranks     the best of the ranks' gathered pairs (vocabulary-parallel greedy)
//   sample_rows      temperature / top-k / top-p sampling from a counter-based RNG (Philox)
//   to_bf16_strided  strided FP32 slices → contiguous BF16 (the MoE input, q_pe)
//   gather_rows      out[i] = in[rows[i]] (the rows that get logits)
//
// Every kernel takes its sizes as arguments (no tactic macros): one image per SM.
// Numerics follow the CPU forward pass: FP32 accumulation; RMSNorm as x · rsqrt(mean(x²) +
// eps) · w; RoPE angles in FP32 as HF computes them; ties in routing to the lower index.

#include <cstdint>
#include <cuda_bf16.h>

namespace layers {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the CTA (kThreads threads); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  __syncthreads();  // scratch is reused by the next reduction
  return total;
}

// Largest of (value, index) pairs, the lower index on ties; -inf never wins over a finite.
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    better(v, i, ov, oi);
  }
}

// CTA-wide argmax of every thread's (v, i); the result is valid in thread 0 only. Ends with
// a barrier, so the scratch arrays may be reused at once.
__device__ __forceinline__ void block_argmax(float& v, int& i, float* best_v, int* best_i) {
  warp_argmax(v, i);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    best_v[warp] = v;
    best_i[warp] = i;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < kWarps; ++w) better(v, i, best_v[w], best_i[w]);
  __syncthreads();
}

}  // namespace layers

using namespace layers;

// grid: tokens; block: kThreads. `table` holds the rows of ids [first_id, first_id + rows)
// (a tensor-parallel rank's share of the vocabulary; all of it on one device): an id of the
// vocabulary outside them writes zeros, which the ranks' all-reduce adds to the one rank's
// row. An id outside [0, vocab) records itself in *bad_id (the first one wins) and writes
// zeros, so the host learns of it at its next synchronization.
extern "C" __global__ void __launch_bounds__(kThreads) embed_gather(
    const int* ids, const __nv_bfloat16* table, int vocab, int first_id, int rows, int hidden,
    float* out, int* bad_id) {
  const int t = blockIdx.x;
  const int id = ids[t];
  const bool ok = id >= 0 && id < vocab;
  if (!ok && threadIdx.x == 0) atomicCAS(bad_id, -1, id);
  const bool held = ok && id >= first_id && id - first_id < rows;
  const __nv_bfloat16* row = table + size_t(held ? id - first_id : 0) * hidden;
  for (int i = threadIdx.x; i < hidden; i += kThreads)
    out[size_t(t) * hidden + i] = held ? __bfloat162float(row[i]) : 0.f;
}

// grid: rows; block: kThreads. `x` may be null (plain RMSNorm of `residual`).
extern "C" __global__ void __launch_bounds__(kThreads) add_rms_norm(
    float* residual, const float* x, const __nv_bfloat16* weight, float eps, int dim, float* out) {
  __shared__ float scratch[kWarps];
  float* r = residual + size_t(blockIdx.x) * dim;
  const float* xr = x ? x + size_t(blockIdx.x) * dim : nullptr;
  float ss = 0.f;
  for (int i = threadIdx.x; i < dim; i += kThreads) {
    float v = r[i];
    if (xr) {
      v += xr[i];
      r[i] = v;
    }
    ss += v * v;
  }
  const float total = block_sum(ss, scratch);
  const float inv = 1.f / sqrtf(total / float(dim) + eps);
  float* o = out + size_t(blockIdx.x) * dim;
  for (int i = threadIdx.x; i < dim; i += kThreads)
    o[i] = __bfloat162float(weight[i]) * (r[i] * inv);
}

// Rotates `count` slices of `dim` values (pairs 2i, 2i+1) of every row in place: slice s of
// row r starts at x + r·row_stride + offset + s·slice_stride (q: one slice per head after its
// no-RoPE part; the compressed KV: one slice after the latent). grid: rows; block: kThreads.
extern "C" __global__ void __launch_bounds__(kThreads) rope_interleaved(
    float* x, int row_stride, int offset, int slice_stride, int count, int dim,
    const int* positions, const float* inv_freq, float attention_factor) {
  const int r = blockIdx.x;
  const float pos = float(positions[r]);
  const int half = dim / 2;
  for (int i = threadIdx.x; i < count * half; i += kThreads) {
    const int s = i / half, p = i % half;
    float* pair = x + size_t(r) * row_stride + offset + size_t(s) * slice_stride + 2 * p;
    const float angle = pos * inv_freq[p];
    const float c = cosf(angle) * attention_factor, sn = sinf(angle) * attention_factor;
    const float a = pair[0], b = pair[1];
    pair[0] = a * c - b * sn;
    pair[1] = b * c + a * sn;
  }
}

// One CTA per token: `noaux_tc` as the CPU forward pass routes (experts ≤ 1024, Kimi 384;
// n_group ≤ 64, experts divisible by n_group; the launcher checks). Dynamic shared memory:
// 2·experts + n_group floats.
extern "C" __global__ void __launch_bounds__(kThreads) route_noaux_tc(
    const float* logits, const float* bias, int experts, int n_group, int topk_group, int top_k,
    int norm_topk_prob, float routed_scaling_factor, int* ids, float* weights) {
  extern __shared__ __align__(16) uint8_t smem[];
  float* scores = reinterpret_cast<float*>(smem);
  float* choice = scores + experts;
  float* group_score = choice + experts;
  __shared__ float best_v[kWarps];
  __shared__ int best_i[kWarps];
  __shared__ float weight_sum;
  __shared__ uint64_t kept_groups;
  const int t = blockIdx.x;
  for (int e = threadIdx.x; e < experts; e += kThreads) {
    const float s = 1.f / (1.f + expf(-logits[size_t(t) * experts + e]));
    scores[e] = s;
    choice[e] = s + bias[e];
  }
  __syncthreads();
  const int per_group = experts / n_group;
  if (n_group > 1) {
    // A group's score is the sum of its two best biased scores.
    for (int g = threadIdx.x; g < n_group; g += kThreads) {
      float a = -INFINITY, b = -INFINITY;
      for (int j = 0; j < per_group; ++j) {
        const float v = choice[g * per_group + j];
        if (v > a) {
          b = a;
          a = v;
        } else if (v > b) {
          b = v;
        }
      }
      group_score[g] = per_group > 1 ? a + b : a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      // Keep the topk_group best groups, ties to the lower index (n_group <= 64).
      uint64_t kept = 0;
      for (int round = 0; round < topk_group && round < n_group; ++round) {
        int bi = -1;
        for (int g = 0; g < n_group; ++g)
          if (!(kept >> g & 1) && (bi < 0 || group_score[g] > group_score[bi])) bi = g;
        kept |= uint64_t(1) << bi;
      }
      kept_groups = kept;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += kThreads)
      if (!(kept_groups >> (e / per_group) & 1)) choice[e] = -INFINITY;
    __syncthreads();
  }
  // top_k rounds of a CTA-wide argmax, each removing its winner.
  for (int k = 0; k < top_k; ++k) {
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int e = threadIdx.x; e < experts; e += kThreads) better(v, i, choice[e], e);
    block_argmax(v, i, best_v, best_i);
    if (threadIdx.x == 0) {
      ids[size_t(t) * top_k + k] = i;
      weights[size_t(t) * top_k + k] = scores[i];
      choice[i] = -INFINITY;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int k = 0; k < top_k; ++k) s += weights[size_t(t) * top_k + k];
    weight_sum = s + 1e-20f;
  }
  __syncthreads();
  for (int k = threadIdx.x; k < top_k; k += kThreads) {
    float w = weights[size_t(t) * top_k + k];
    if (norm_topk_prob) w /= weight_sum;
    weights[size_t(t) * top_k + k] = w * routed_scaling_factor;
  }
}

// One CTA: a stable counting sort of `assignments` (= tokens · top_k) routing entries by
// expert. Writes expert_offsets [experts + 1], sorted_token_ids and sorted_weights
// [assignments]; within an expert, tokens keep their order (t, then slot k), as
// moe_gemm::launch::GroupedRouting does on the host. active_experts [1 + experts]: the number
// of experts with a token, their ids in increasing order, then -1.
extern "C" __global__ void __launch_bounds__(kThreads) group_by_expert(
    const int* ids, const float* weights, int assignments, int top_k, int experts,
    int* expert_offsets, int* sorted_token_ids, float* sorted_weights, int* active_experts) {
  // Counts, then an exclusive scan by thread 0 (experts ≤ a few thousand).
  for (int e = threadIdx.x; e <= experts; e += kThreads) expert_offsets[e] = 0;
  __syncthreads();
  for (int a = threadIdx.x; a < assignments; a += kThreads) atomicAdd(&expert_offsets[ids[a] + 1], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int active = 0;
    for (int e = 1; e <= experts; ++e) {
      if (expert_offsets[e] > 0) active_experts[1 + active++] = e - 1;
      expert_offsets[e] += expert_offsets[e - 1];
    }
    active_experts[0] = active;
    for (int e = active; e < experts; ++e) active_experts[1 + e] = -1;
  }
  __syncthreads();
  // Stable placement: each expert's entries in assignment order, one thread per expert.
  for (int e = threadIdx.x; e < experts; e += kThreads) {
    int at = expert_offsets[e];
    for (int a = 0; a < assignments; ++a) {
      if (ids[a] == e) {
        sorted_token_ids[at] = a / top_k;
        sorted_weights[at] = weights[a];
        ++at;
      }
    }
  }
}

// y [T, N] = x [T, K] · Wᵀ with W BF16 [N, K]; one warp per (token, output row), K strided
// over the lanes in FP32, then a warp sum. Row t of y starts at y + t·ldy (ldy >= N: a
// vocabulary-parallel lm_head writes its columns of full-vocabulary rows). grid:
// (ceil(N / kWarps), T); block: kThreads. `accumulate` adds into y instead of overwriting it.
extern "C" __global__ void __launch_bounds__(kThreads) dense_bf16(
    const float* x, const __nv_bfloat16* w, int k, int n, float* y, int ldy, int accumulate) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row = blockIdx.x * kWarps + warp, t = blockIdx.y;
  if (row >= n) return;
  const float* xr = x + size_t(t) * k;
  const __nv_bfloat16* wr = w + size_t(row) * k;
  float acc = 0.f;
  for (int i = lane; i < k; i += 32) acc += xr[i] * __bfloat162float(wr[i]);
  acc = warp_sum(acc);
  if (lane == 0) {
    float* dst = y + size_t(t) * ldy + row;
    *dst = accumulate ? *dst + acc : acc;
  }
}

// h [rows, I] = SiLU(g) · u for gate_up [rows, 2·I] = gate ‖ up. grid: rows; block: kThreads.
extern "C" __global__ void __launch_bounds__(kThreads) silu_mul(const float* gate_up, int inter,
                                                                float* h) {
  const size_t r = blockIdx.x;
  for (int i = threadIdx.x; i < inter; i += kThreads) {
    const float g = gate_up[r * 2 * inter + i], u = gate_up[r * 2 * inter + inter + i];
    h[r * inter + i] = g / (1.f + expf(-g)) * u;
  }
}

// ids[r] = the index of row r's largest logit, the first on ties. grid: rows; block: kThreads.
extern "C" __global__ void __launch_bounds__(kThreads) argmax_rows(const float* logits, int vocab,
                                                                   int* ids) {
  __shared__ float best_v[kWarps];
  __shared__ int best_i[kWarps];
  const float* row = logits + size_t(blockIdx.x) * vocab;
  float v = -INFINITY;
  int i = 0x7fffffff;
  for (int j = threadIdx.x; j < vocab; j += kThreads) better(v, i, row[j], j);
  block_argmax(v, i, best_v, best_i);
  if (threadIdx.x == 0) ids[blockIdx.x] = i == 0x7fffffff ? 0 : i;
}

// The vocabulary-parallel greedy pick, per rank: row r's best (value, id) among this rank's
// `count` columns (ids first_id ..), the first id on ties as argmax_rows, written as two
// floats into slot `rank` of pairs [rows][ranks][2]; every other slot of the row is zeroed,
// so the ranks' all-reduce (a sum) gathers every slot exactly (a value plus zeros). A row
// with no candidate (all NaN) writes (-inf, kNoCandidate). Ids stay below 2^24, exact as
// floats (the launcher checks). grid: rows; block: kThreads.
constexpr int kNoCandidate = 1 << 24;

extern "C" __global__ void __launch_bounds__(kThreads) argmax_shard(const float* logits,
                                                                    int row_stride, int count,
                                                                    int first_id, int ranks,
                                                                    int rank, float* pairs) {
  __shared__ float best_v[kWarps];
  __shared__ int best_i[kWarps];
  const float* row = logits + size_t(blockIdx.x) * row_stride;
  float* slots = pairs + size_t(blockIdx.x) * ranks * 2;
  float v = -INFINITY;
  int i = 0x7fffffff;
  for (int j = threadIdx.x; j < count; j += kThreads) better(v, i, row[j], first_id + j);
  block_argmax(v, i, best_v, best_i);
  for (int s = threadIdx.x; s < 2 * ranks; s += kThreads)
    if (s / 2 != rank) slots[s] = 0.f;
  if (threadIdx.x == 0) {
    slots[2 * rank] = v;
    slots[2 * rank + 1] = float(i == 0x7fffffff ? kNoCandidate : i);
  }
}

// ids[r] = the best of row r's gathered (value, id) pairs [ranks][2], the lower id on ties:
// what argmax_rows gives on the whole row, since each rank's pair is its columns' best.
// grid: rows; block: kThreads (thread 0 works: at most a few ranks).
extern "C" __global__ void __launch_bounds__(kThreads) argmax_ranks(const float* pairs,
                                                                    int ranks, int* ids) {
  if (threadIdx.x != 0) return;
  const float* slots = pairs + size_t(blockIdx.x) * ranks * 2;
  float v = -INFINITY;
  int i = 0x7fffffff;
  for (int s = 0; s < ranks; ++s) better(v, i, slots[2 * s], int(slots[2 * s + 1]));
  ids[blockIdx.x] = i >= kNoCandidate ? 0 : i;
}

// Per head h (grid.z) and token t (grid.y): y[t, h, :] = x[t, h, :] · W_hᵀ, W_h BF16 [n, k] at
// w + h·w_head_stride. x's row t, head h starts at x + t·x_row_stride + h·x_head_stride, y's at
// y + t·y_row_stride + h·y_head_stride; y is BF16 when y_bf16 (the MLA kernels read BF16
// queries), else FP32. One warp per output value, as dense_bf16. grid: (ceil(n / kWarps), T,
// heads); block: kThreads.
extern "C" __global__ void __launch_bounds__(kThreads) dense_heads_bf16(
    const float* x, int x_row_stride, int x_head_stride, const __nv_bfloat16* w,
    long long w_head_stride, int k, int n, void* y, int y_row_stride, int y_head_stride,
    int y_bf16) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row = blockIdx.x * kWarps + warp, t = blockIdx.y, h = blockIdx.z;
  if (row >= n) return;
  const float* xr = x + size_t(t) * x_row_stride + size_t(h) * x_head_stride;
  const __nv_bfloat16* wr = w + size_t(h) * w_head_stride + size_t(row) * k;
  float acc = 0.f;
  for (int i = lane; i < k; i += 32) acc += xr[i] * __bfloat162float(wr[i]);
  acc = warp_sum(acc);
  if (lane == 0) {
    const size_t at = size_t(t) * y_row_stride + size_t(h) * y_head_stride + row;
    if (y_bf16)
      static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(acc);
    else
      static_cast<float*>(y)[at] = acc;
  }
}

// out[r][s][j] = bf16(in[r·row_stride + offset + s·slice_stride + j]) for s < count, j < width:
// contiguous BF16 [rows][count][width] from strided FP32 slices. grid: rows; block: kThreads.
extern "C" __global__ void __launch_bounds__(kThreads) to_bf16_strided(
    const float* in, int row_stride, int offset, int slice_stride, int count, int width,
    __nv_bfloat16* out) {
  const size_t r = blockIdx.x;
  for (int i = threadIdx.x; i < count * width; i += kThreads) {
    const int s = i / width, j = i % width;
    out[r * count * width + i] =
        __float2bfloat16_rn(in[r * row_stride + offset + size_t(s) * slice_stride + j]);
  }
}

// out[i][:] = in[rows[i]][:] for FP32 rows of `width`. grid: selected rows; block: kThreads.
extern "C" __global__ void __launch_bounds__(kThreads) gather_rows(const float* in,
                                                                   const int* rows, int width,
                                                                   float* out) {
  const size_t i = blockIdx.x, r = rows[i];
  for (int j = threadIdx.x; j < width; j += kThreads) out[i * width + j] = in[r * width + j];
}

// One row's sampling parameters (`kernels::layers::sampling::SampleRow`, 32 bytes).
struct SampleRow {
  float temperature;  // <= 0: greedy
  int top_k;          // <= 0 or >= vocab: no top-k cut
  float top_p;        // >= 1: no nucleus cut
  unsigned reserved;
  unsigned long long seed;
  unsigned long long counter;  // the draw's index in its sequence's stream
};
static_assert(sizeof(SampleRow) == 32, "SampleRow layout");

namespace layers {

// Philox4x32-10 (Salmon et al., Random123), counter {counter, 0, 0}, key = seed: the first
// output word's high 24 bits as a uniform in [0, 1). Counter-based, so a draw depends only on
// (seed, counter): a captured graph and the host reproduce it without carried state.
__device__ __forceinline__ float philox_uniform(unsigned long long seed,
                                                unsigned long long counter) {
  unsigned c0 = unsigned(counter), c1 = unsigned(counter >> 32), c2 = 0, c3 = 0;
  unsigned k0 = unsigned(seed), k1 = unsigned(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned long long p0 = 0xD2511F53ull * c0, p1 = 0xCD9E8D57ull * c2;
    const unsigned n0 = unsigned(p1 >> 32) ^ c1 ^ k0, n2 = unsigned(p0 >> 32) ^ c3 ^ k1;
    c1 = unsigned(p1);
    c3 = unsigned(p0);
    c0 = n0;
    c2 = n2;
  }
  return float(c0 >> 8) * (1.f / 16777216.f);
}

// A total order on (probability, index): larger first, the lower index first on ties — the
// order of a stable sort by probability — as distinct unsigned keys, so every cut is a
// threshold. Probabilities are >= 0, so their bits order as unsigned integers.
__device__ __forceinline__ unsigned long long sample_key(float prob, int i, int vocab,
                                                         int index_bits) {
  return (static_cast<unsigned long long>(__float_as_uint(prob)) << index_bits) |
         unsigned(vocab - 1 - i);
}

// Sum over the CTA in a fixed order (each thread's value, then a halving tree over
// `scratch[kThreads]`), so the host reference reproduces it bit for bit.
__device__ __forceinline__ float block_sum_ordered(float v, float* scratch) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s) scratch[threadIdx.x] += scratch[threadIdx.x + s];
    __syncthreads();
  }
  const float total = scratch[0];
  __syncthreads();
  return total;
}

__device__ __forceinline__ int block_sum_int(int v, int* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  int total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

}  // namespace layers

// ids[r] = a draw from row r of `logits [rows][vocab]` under params[r]: p = softmax(logits /
// T), cut to the top_k most probable, then to the smallest prefix (in the key order) holding
// top_p of the kept mass; u = Philox(seed, counter) picks the kept token whose cumulative
// mass, in index order over each thread's contiguous slice, first exceeds u · kept mass.
// T <= 0 is argmax (the first index on ties) and leaves the row as it is; otherwise the row is
// overwritten with its unnormalized probabilities (a sampled step returns no logits). Each
// cut is a bitwise search for a key threshold, one pass over the row per key bit: exact, with
// no sort. One CTA per row on an SM is the expected residency, so it may use the registers
// a fuller occupancy would deny (ptxas otherwise spills the search state on sm_90a).
// grid: rows; block: kThreads.
extern "C" __global__ void __launch_bounds__(kThreads, 1) sample_rows(float* logits, int vocab,
                                                                   const SampleRow* params,
                                                                   int* ids) {
  __shared__ float sum_scratch[kThreads];
  __shared__ float best_v[kWarps];
  __shared__ int best_i[kWarps];
  __shared__ int int_scratch[kWarps];
  __shared__ int winner;
  __shared__ float winner_target;
  const SampleRow& p = params[blockIdx.x];
  float* row = logits + size_t(blockIdx.x) * vocab;
  const int t = threadIdx.x;
  if (!(p.temperature > 0.f)) {
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int j = t; j < vocab; j += kThreads) better(v, i, row[j], j);
    block_argmax(v, i, best_v, best_i);
    if (t == 0) ids[blockIdx.x] = i == 0x7fffffff ? 0 : i;
    return;
  }
  const int chunk = (vocab + kThreads - 1) / kThreads;
  const int lo = min(t * chunk, vocab), hi = min(lo + chunk, vocab);
  float m = -INFINITY;
  for (int i = lo; i < hi; ++i) m = fmaxf(m, row[i]);
  {
    const int lane = t & 31, warp = t >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) best_v[warp] = m;
    __syncthreads();
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, best_v[w]);
    __syncthreads();
  }
  float* prob = row;  // each thread rewrites only its own slice, after the max is known
  for (int i = lo; i < hi; ++i) prob[i] = expf((row[i] - m) / p.temperature);
  const int index_bits = vocab > 1 ? 32 - __clz(vocab - 1) : 0;
  const int key_bits = 32 + index_bits;
  unsigned long long lower = 0;
  if (p.top_k > 0 && p.top_k < vocab) {
    unsigned long long threshold = 0;
    for (int b = key_bits - 1; b >= 0; --b) {
      const unsigned long long candidate = threshold | (1ull << b);
      int count = 0;
      for (int i = lo; i < hi; ++i) count += sample_key(prob[i], i, vocab, index_bits) >= candidate;
      if (block_sum_int(count, int_scratch) >= p.top_k) threshold = candidate;
    }
    lower = threshold;
  }
  if (p.top_p < 1.f) {
    float kept = 0.f;
    for (int i = lo; i < hi; ++i)
      if (sample_key(prob[i], i, vocab, index_bits) >= lower) kept += prob[i];
    const float target = p.top_p * block_sum_ordered(kept, sum_scratch);
    unsigned long long threshold = 0;
    for (int b = key_bits - 1; b >= 0; --b) {
      const unsigned long long candidate = threshold | (1ull << b);
      const unsigned long long cut = candidate > lower ? candidate : lower;
      float mass = 0.f;
      for (int i = lo; i < hi; ++i)
        if (sample_key(prob[i], i, vocab, index_bits) >= cut) mass += prob[i];
      if (block_sum_ordered(mass, sum_scratch) >= target) threshold = candidate;
    }
    if (threshold > lower) lower = threshold;
  }
  float slice = 0.f;
  int last_kept = -1;
  for (int i = lo; i < hi; ++i)
    if (sample_key(prob[i], i, vocab, index_bits) >= lower) {
      slice += prob[i];
      last_kept = i;
    }
  sum_scratch[t] = slice;
  if (t == 0) int_scratch[0] = -1;
  __syncthreads();
  if (t == 0) {
    float total = 0.f;
    for (int s = 0; s < kThreads; ++s) total += sum_scratch[s];
    const float target = philox_uniform(p.seed, p.counter) * total;
    float before = 0.f;
    winner = -1;
    for (int s = 0; s < kThreads; ++s) {
      if (sum_scratch[s] > target - before) {
        winner = s;
        winner_target = target - before;
        break;
      }
      before += sum_scratch[s];
    }
  }
  __syncthreads();
  if (winner < 0) {
    // u · mass rounded up to the whole mass: the last kept token in index order.
    int v = last_kept;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((t & 31) == 0) atomicMax(&int_scratch[0], v);
    __syncthreads();
    if (t == 0) ids[blockIdx.x] = max(int_scratch[0], 0);
    return;
  }
  if (t == winner) {
    float cumulative = 0.f;
    int chosen = last_kept;
    for (int i = lo; i < hi; ++i)
      if (sample_key(prob[i], i, vocab, index_bits) >= lower) {
        cumulative += prob[i];
        if (cumulative > winner_target) {
          chosen = i;
          break;
        }
      }
    ids[blockIdx.x] = chosen;
  }
}

// PCIe all-reduce kernels over CUDA IPC peer-mapped buffers: the GPU side of the protocol the
// CPU backend (cpu.rs) runs over shared memory. One cubin per (algorithm, transfer, dtype,
// threads), selected with -D macros by `AllReduceTactic::nvcc_defines`; the block count is a
// launch parameter (1..=8).
//
// Contract with the host (kernels-rs/src/allreduce/cuda.rs, `ArParams`):
// - `peer[r]` is rank r's region as mapped in this process (own region included, peers through
//   cuIpcOpenMemHandle). Offsets inside a region are those of layout.rs relative to
//   `SegmentLayout::region`, passed in as `pull_flag0`, `push_flag0`, `outbox0`, `inbox0` and
//   the slot stride `capacity`; the formulas below mirror `DeviceOffsets` in cuda.rs, which is
//   unit-tested against layout.rs.
// - Flags are u64 words `(generation << 8) | tag` written with st.release.sys and polled with
//   ld.acquire.sys. A flag "line" of layout.rs (64 B) holds one word per block ("lane"), so each
//   block signals independently and no grid-wide barrier is needed. The tag is a non-zero 8-bit
//   digest of (algorithm, dtype, length): a peer that launched a different collective is seen
//   as a mismatch instead of silently mixing data, at no extra PCIe read.
// - No read-modify-write ever touches peer memory (PCIe has no peer atomics); the only atomic
//   is on this rank's own control block.
// - The generation comes from the device control block (`ctl->gen`, last completed call), not
//   from the host, so a captured CUDA graph replays correctly: the last block to finish
//   advances it. Nothing here synchronizes with the host.
// - Every wait is bounded: after `timeout_ns` of globaltimer the kernel records an error code
//   in `ctl->status` and exits; any later launch sees the status and exits at once, so a dead
//   peer turns into an error the host reads, never a hang.
//
// Reduction order (must equal `reference_reduce` bit for bit): f32 accumulation starting from
// the first term (not from 0, which would turn -0 into +0), terms in rank order (one-shot,
// two-shot) or island order (hierarchical, whose island partials are rounded to the element
// type once, as they cross the slow link as elements), residual added last in f32, one
// rounding per stored value. Additions only: nothing for the compiler to contract into FMA.

#include <cstdint>

#include "ptx_helpers.cuh"

#ifndef AR_ALGO
#define AR_ALGO 0  // 0 one-shot, 1 two-shot, 2 island-hierarchical
#endif
#ifndef AR_PUSH
#define AR_PUSH 0  // 0 pull (consumers read producers' outboxes), 1 push (write peers' inboxes)
#endif
#ifndef AR_F32
#define AR_F32 0  // 0 bf16, 1 f32
#endif
#ifndef AR_THREADS
#define AR_THREADS 512
#endif

#define AR_MAX_RANKS 16
#define AR_MAX_LANES 8
#define AR_MAX_PHASES 3
#define AR_LINE 64

static_assert(AR_THREADS % 32 == 0 && AR_THREADS >= AR_MAX_RANKS * AR_MAX_LANES,
              "one polling thread per (producer, lane)");

// Error codes in ctl->status: (code << 56) | (peer << 48) | (phase << 40) | generation.
#define AR_ERR_TIMEOUT 1ull
#define AR_ERR_MISMATCH 2ull

struct ArParams {
  uint64_t peer[AR_MAX_RANKS];
  uint64_t data;      // in/out, n elements, 16-byte aligned
  uint64_t residual;  // 0: none; else n elements, 16-byte aligned, same on every rank
  uint64_t ctl;       // this rank's ArControl
  uint64_t timeout_ns;
  uint64_t pull_flag0;  // pull_flag(r, 0) - region(r)
  uint64_t push_flag0;  // push_flag(r, 0, 0) - region(r)
  uint64_t outbox0;     // outbox(r, 0, 0) - region(r)
  uint64_t inbox0;      // inbox(r, 0, 0, 0) - region(r), 0 when push is disabled
  uint64_t capacity;    // bytes per slot
  uint32_t n;
  uint32_t world;
  uint32_t rank;
  uint32_t tag;
  uint8_t island_of[AR_MAX_RANKS];
  uint8_t position_of[AR_MAX_RANKS];
  uint8_t members[AR_MAX_RANKS];           // ranks, island by island, in island order
  uint8_t island_start[AR_MAX_RANKS + 1];  // island k is members[island_start[k]..[k+1]]
  uint8_t islands;
  uint8_t pad[6];
};
static_assert(sizeof(ArParams) == 288, "mirrors ArParams in cuda.rs");

struct ArControl {
  uint64_t gen;     // last generation this rank completed
  uint32_t done;    // blocks finished in the current call
  uint32_t pad;
  uint64_t status;  // 0, or the first error
  uint64_t pad2[5];
};
static_assert(sizeof(ArControl) == 64, "one line");

#if AR_F32
typedef float T;
#else
typedef uint16_t T;  // bf16 bits: converted by hand to match half::bf16 exactly (NaN included)
#endif
constexpr int P = 16 / sizeof(T);  // elements per 16-byte vector

__device__ __forceinline__ float to_acc(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }
__device__ __forceinline__ float to_acc(float v) { return v; }

// half::bf16::from_f32: round to nearest even; NaN keeps its payload's top bits and is quieted.
__device__ __forceinline__ void from_acc(float f, uint16_t& out) {
  uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    out = uint16_t((x >> 16) | 0x0040u);
    return;
  }
  const uint32_t round_bit = 0x8000u;
  out = uint16_t((x >> 16) + (((x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0) ? 1 : 0));
}
__device__ __forceinline__ void from_acc(float f, float& out) { out = f; }

struct Range {
  uint64_t start, end;
  __device__ uint64_t len() const { return end - start; }
};

// chunk_range of algorithm.rs: `parts` nearly equal parts, the first len % parts one longer.
__device__ __forceinline__ Range chunk(uint64_t start, uint64_t len, uint32_t parts, uint32_t part) {
  uint64_t base = len / parts, extra = len % parts;
  uint64_t s = start + part * base + (part < extra ? part : extra);
  return Range{s, s + base + (part < extra ? 1 : 0)};
}
__device__ __forceinline__ Range intersect(Range a, Range b) {
  uint64_t s = a.start > b.start ? a.start : b.start;
  uint64_t e = a.end < b.end ? a.end : b.end;
  return Range{s, e > s ? e : s};
}
// This block's share of a range: every phase splits every range the same way, so a block only
// ever overwrites `data` elements that it published itself (no cross-block hazard on `data`).
__device__ __forceinline__ Range block_part(Range r) {
  return chunk(r.start, r.len(), gridDim.x, blockIdx.x);
}

struct Ctx {
  const ArParams& p;
  uint64_t gen, parity;
  __device__ char* region(uint32_t r) const { return reinterpret_cast<char*>(p.peer[r]); }
  __device__ T* outbox(uint32_t owner, uint32_t phase) const {
    return reinterpret_cast<T*>(region(owner) + p.outbox0 +
                                (parity * AR_MAX_PHASES + phase) * p.capacity);
  }
  __device__ T* inbox(uint32_t consumer, uint32_t phase, uint32_t producer) const {
    return reinterpret_cast<T*>(region(consumer) + p.inbox0 +
                                ((parity * AR_MAX_PHASES + phase) * p.world + producer) * p.capacity);
  }
  __device__ uint64_t* pull_flag(uint32_t owner, uint32_t phase, uint32_t lane) const {
    return reinterpret_cast<uint64_t*>(region(owner) + p.pull_flag0 + phase * AR_LINE + lane * 8);
  }
  __device__ uint64_t* push_flag(uint32_t consumer, uint32_t phase, uint32_t producer,
                                 uint32_t lane) const {
    return reinterpret_cast<uint64_t*>(region(consumer) + p.push_flag0 +
                                       (phase * p.world + producer) * AR_LINE + lane * 8);
  }
  // Where `producer`'s phase data for this rank lives.
  __device__ const T* source(uint32_t producer, uint32_t phase) const {
    return AR_PUSH ? inbox(p.rank, phase, producer) : outbox(producer, phase);
  }
  __device__ T* data() const { return reinterpret_cast<T*>(p.data); }
  __device__ const T* residual() const { return reinterpret_cast<const T*>(p.residual); }
};

// Elements [r.start, r.end) over the block's threads: a scalar head up to 16-byte alignment, a
// 16-byte vector body (every buffer's element 0 is 16-byte aligned, so index alignment is
// address alignment), and a scalar tail.
template <class S, class V>
__device__ __forceinline__ void for_range(Range r, S scalar, V vector) {
  uint64_t head_end = (r.start + P - 1) / P * P;
  if (head_end > r.end) head_end = r.end;
  uint64_t body_end = head_end + (r.end - head_end) / P * P;
  for (uint64_t i = r.start + threadIdx.x; i < head_end; i += AR_THREADS) scalar(i);
  for (uint64_t i = head_end + uint64_t(threadIdx.x) * P; i < body_end; i += uint64_t(AR_THREADS) * P)
    vector(i);
  for (uint64_t i = body_end + threadIdx.x; i < r.end; i += AR_THREADS) scalar(i);
}

__device__ __forceinline__ void copy_range(T* dst, const T* src, Range r) {
  for_range(
      r, [&](uint64_t i) { dst[i] = src[i]; },
      [&](uint64_t i) {
        *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
      });
}

union Vec {
  uint4 u;
  T e[P];
};

// out[i] = round(((t0 + t1) + ...) [+ residual]) for i in r, terms in the given order.
__device__ __forceinline__ void reduce_range(T* out, const T* const* terms, uint32_t nterms,
                                             const T* residual, Range r) {
  for_range(
      r,
      [&](uint64_t i) {
        float acc = to_acc(terms[0][i]);
        for (uint32_t k = 1; k < nterms; ++k) acc += to_acc(terms[k][i]);
        if (residual) acc += to_acc(residual[i]);
        from_acc(acc, out[i]);
      },
      [&](uint64_t i) {
        float acc[P];
        Vec v;
        v.u = *reinterpret_cast<const uint4*>(terms[0] + i);
#pragma unroll
        for (int j = 0; j < P; ++j) acc[j] = to_acc(v.e[j]);
        for (uint32_t k = 1; k < nterms; ++k) {
          v.u = *reinterpret_cast<const uint4*>(terms[k] + i);
#pragma unroll
          for (int j = 0; j < P; ++j) acc[j] += to_acc(v.e[j]);
        }
        if (residual) {
          v.u = *reinterpret_cast<const uint4*>(residual + i);
#pragma unroll
          for (int j = 0; j < P; ++j) acc[j] += to_acc(v.e[j]);
        }
#pragma unroll
        for (int j = 0; j < P; ++j) from_acc(acc[j], v.e[j]);
        *reinterpret_cast<uint4*>(out + i) = v.u;
      });
}

// The term pointers of a reduction, in shared memory: thread 0 computes them, every thread
// reads them (broadcast) in the inner loop. A per-thread array indexed at run time would live
// in local memory.
template <class F>
__device__ __forceinline__ const T** set_terms(const Ctx& c, uint32_t nterms, F term) {
  __shared__ const T* s_terms[AR_MAX_RANKS];
  __syncthreads();  // the previous reduction's readers are done with s_terms
  if (threadIdx.x == 0)
    for (uint32_t k = 0; k < nterms; ++k) s_terms[k] = term(k);
  __syncthreads();
  return s_terms;
}

__device__ __forceinline__ uint64_t flag_value(const Ctx& c) { return (c.gen << 8) | c.p.tag; }

// Makes this block's published data visible to `consumers`: the barrier orders every thread's
// writes before the release store (release is cumulative over what the storing thread has
// synchronized with), and the release at .sys scope carries them to the peer.
__device__ __forceinline__ void signal(const Ctx& c, uint32_t phase, const uint8_t* consumers,
                                      uint32_t nconsumers) {
  __syncthreads();
  if (AR_PUSH) {
    if (threadIdx.x < nconsumers)
      st_release_sys(c.push_flag(consumers[threadIdx.x], phase, c.p.rank, blockIdx.x),
                     flag_value(c));
  } else if (threadIdx.x == 0) {
    st_release_sys(c.pull_flag(c.p.rank, phase, blockIdx.x), flag_value(c));
  }
}

// Waits until every lane (block) of every producer has signalled `phase` of this generation.
// All lanes, not only this block's: the hierarchical exchange reads ranges that other blocks
// of the producer wrote, and a uniform rule keeps the double-buffering argument of mod.rs at
// rank granularity. One thread per (producer, lane) polls, in parallel, so the cost is one
// round trip. Returns false (after recording the error) on timeout or tag mismatch.
__device__ bool wait(const Ctx& c, uint32_t phase, const uint8_t* producers, uint32_t nproducers) {
  __shared__ uint64_t s_err;
  if (threadIdx.x == 0) s_err = 0;
  __syncthreads();
  const uint32_t lanes = gridDim.x;
  if (threadIdx.x < nproducers * lanes) {
    uint32_t producer = producers[threadIdx.x / lanes], lane = threadIdx.x % lanes;
    const uint64_t* flag = AR_PUSH ? c.push_flag(c.p.rank, phase, producer, lane)
                                   : c.pull_flag(producer, phase, lane);
    uint64_t start = globaltimer();
    for (uint32_t polls = 0;; ++polls) {
      uint64_t v = ld_acquire_sys(flag);
      // Flags only grow and a producer is at most one generation ahead, so ">=" is exact.
      if ((v >> 8) >= c.gen) {
        if ((v >> 8) == c.gen && (v & 0xff) != c.p.tag) {
          atomicCAS(reinterpret_cast<unsigned long long*>(&s_err), 0ull,
                    (AR_ERR_MISMATCH << 56) | (uint64_t(producer) << 48) |
                        (uint64_t(phase) << 40) | (c.gen & 0xffffffffffull));
        }
        break;
      }
      if ((polls & 63) == 63 && globaltimer() - start > c.p.timeout_ns) {
        atomicCAS(reinterpret_cast<unsigned long long*>(&s_err), 0ull,
                  (AR_ERR_TIMEOUT << 56) | (uint64_t(producer) << 48) | (uint64_t(phase) << 40) |
                      (c.gen & 0xffffffffffull));
        break;
      }
    }
  }
  __syncthreads();
  uint64_t err = s_err;
  if (err != 0) {
    if (threadIdx.x == 0) {
      volatile uint64_t* status = &reinterpret_cast<ArControl*>(c.p.ctl)->status;
      if (*status == 0) *status = err;
      __threadfence_system();
    }
    return false;
  }
  return true;
}

// ------------------------------------------------------------------------------------------
// One-shot: publish the whole message, wait for everyone, reduce everything in rank order.
__device__ void one_shot(const Ctx& c, const uint8_t* others, uint32_t nothers) {
  const ArParams& p = c.p;
  Range mine = block_part(Range{0, p.n});
  if (AR_PUSH) {
    for (uint32_t k = 0; k < nothers; ++k) copy_range(c.inbox(others[k], 0, p.rank), c.data(), mine);
  } else {
    copy_range(c.outbox(p.rank, 0), c.data(), mine);
  }
  signal(c, 0, others, nothers);
  if (!wait(c, 0, others, nothers)) return;
  const T** terms = set_terms(c, p.world, [&](uint32_t r) {
    return r == p.rank ? static_cast<const T*>(c.data()) : c.source(r, 0);
  });
  reduce_range(c.data(), terms, p.world, c.residual(), mine);
}

// Two-shot: reduce-scatter (rank r reduces chunk r) then all-gather.
__device__ void two_shot(const Ctx& c, const uint8_t* others, uint32_t nothers) {
  const ArParams& p = c.p;
  auto chunk_of = [&](uint32_t r) { return block_part(chunk(0, p.n, p.world, r)); };
  if (AR_PUSH) {
    for (uint32_t k = 0; k < nothers; ++k)
      copy_range(c.inbox(others[k], 0, p.rank), c.data(), chunk_of(others[k]));
  } else {
    for (uint32_t r = 0; r < p.world; ++r) copy_range(c.outbox(p.rank, 0), c.data(), chunk_of(r));
  }
  signal(c, 0, others, nothers);
  if (!wait(c, 0, others, nothers)) return;
  Range mine = chunk_of(p.rank);
  const T** terms = set_terms(c, p.world, [&](uint32_t r) {
    return r == p.rank ? static_cast<const T*>(c.data()) : c.source(r, 0);
  });
  reduce_range(c.data(), terms, p.world, c.residual(), mine);

  if (AR_PUSH) {
    for (uint32_t k = 0; k < nothers; ++k) copy_range(c.inbox(others[k], 1, p.rank), c.data(), mine);
  } else {
    copy_range(c.outbox(p.rank, 1), c.data(), mine);
  }
  signal(c, 1, others, nothers);
  if (!wait(c, 1, others, nothers)) return;
  for (uint32_t k = 0; k < nothers; ++k)
    copy_range(c.data(), c.source(others[k], 1), chunk_of(others[k]));
}

// Island-hierarchical: reduce-scatter in the island, exchange partials across islands, gather
// in the island (the CPU backend's `hierarchical`, phase for phase).
__device__ void hierarchical(const Ctx& c) {
  const ArParams& p = c.p;
  const uint32_t me = p.rank, my_island = p.island_of[me];
  auto island_size = [&](uint32_t k) { return uint32_t(p.island_start[k + 1] - p.island_start[k]); };
  // The whole range rank r owns in its island (not split by block): needed for intersections.
  auto owned = [&](uint32_t r) {
    return chunk(0, p.n, island_size(p.island_of[r]), p.position_of[r]);
  };
  const uint8_t* island = p.members + p.island_start[my_island];
  const uint32_t isize = island_size(my_island);
  uint8_t peers[AR_MAX_RANKS], remote[AR_MAX_RANKS];
  uint32_t npeers = 0, nremote = 0;
  for (uint32_t k = 0; k < isize; ++k)
    if (island[k] != me) peers[npeers++] = island[k];
  for (uint32_t r = 0; r < p.world; ++r)
    if (p.island_of[r] != my_island) remote[nremote++] = uint8_t(r);
  const Range mine = block_part(owned(me));

  // Phase 0: reduce-scatter inside the island; the partial, rounded to T, replaces data[mine].
  if (AR_PUSH) {
    for (uint32_t k = 0; k < npeers; ++k)
      copy_range(c.inbox(peers[k], 0, me), c.data(), block_part(owned(peers[k])));
  } else {
    for (uint32_t k = 0; k < isize; ++k)
      copy_range(c.outbox(me, 0), c.data(), block_part(owned(island[k])));
  }
  signal(c, 0, peers, npeers);
  if (!wait(c, 0, peers, npeers)) return;
  {
    const T** terms = set_terms(c, isize, [&](uint32_t k) {
      return island[k] == me ? static_cast<const T*>(c.data()) : c.source(island[k], 0);
    });
    reduce_range(c.data(), terms, isize, nullptr, mine);
  }

  // Phase 1: exchange partials with every remote rank (signalled even when the overlap is
  // empty, so every call still waits on every rank).
  if (AR_PUSH) {
    for (uint32_t k = 0; k < nremote; ++k)
      copy_range(c.inbox(remote[k], 1, me), c.data(), intersect(owned(remote[k]), mine));
  } else {
    copy_range(c.outbox(me, 1), c.data(), mine);
  }
  signal(c, 1, remote, nremote);
  if (!wait(c, 1, remote, nremote)) return;
  // Between ownership boundaries each island's partial comes from one rank: reduce segment by
  // segment, islands in order.
  uint64_t cuts[2 * AR_MAX_RANKS + 2];
  uint32_t ncuts = 0;
  cuts[ncuts++] = mine.start;
  for (uint32_t k = 0; k < nremote; ++k) {
    Range o = owned(remote[k]);
    if (o.start > mine.start && o.start < mine.end) cuts[ncuts++] = o.start;
    if (o.end > mine.start && o.end < mine.end) cuts[ncuts++] = o.end;
  }
  cuts[ncuts++] = mine.end;
  for (uint32_t a = 1; a < ncuts; ++a)  // insertion sort: at most 2 * world cuts
    for (uint32_t b = a; b > 0 && cuts[b - 1] > cuts[b]; --b) {
      uint64_t t = cuts[b];
      cuts[b] = cuts[b - 1];
      cuts[b - 1] = t;
    }
  for (uint32_t s = 0; s + 1 < ncuts; ++s) {
    Range seg{cuts[s], cuts[s + 1]};
    if (seg.len() == 0) continue;
    const T** terms = set_terms(c, p.islands, [&](uint32_t k) {
      if (k == my_island) return static_cast<const T*>(c.data());
      const T* src = nullptr;
      for (uint32_t j = p.island_start[k]; j < p.island_start[k + 1]; ++j) {
        Range o = owned(p.members[j]);
        if (seg.start >= o.start && seg.start < o.end) src = c.source(p.members[j], 1);
      }
      return src;
    });
    reduce_range(c.data(), terms, p.islands, c.residual(), seg);
  }
  __syncthreads();  // every thread's segments are written before phase 2 publishes them

  // Phase 2: all-gather inside the island.
  if (AR_PUSH) {
    for (uint32_t k = 0; k < npeers; ++k) copy_range(c.inbox(peers[k], 2, me), c.data(), mine);
  } else {
    copy_range(c.outbox(me, 2), c.data(), mine);
  }
  signal(c, 2, peers, npeers);
  if (!wait(c, 2, peers, npeers)) return;
  for (uint32_t k = 0; k < npeers; ++k)
    copy_range(c.data(), c.source(peers[k], 2), block_part(owned(peers[k])));
}

extern "C" __global__ void __launch_bounds__(AR_THREADS, 1) allreduce(const __grid_constant__ ArParams p) {
  ArControl* ctl = reinterpret_cast<ArControl*>(p.ctl);
  // A failed call poisons the communicator: later launches (e.g. graph replays) exit at once.
  if (*reinterpret_cast<volatile uint64_t*>(&ctl->status) != 0) return;
  Ctx c{p, 0, 0};
  c.gen = *reinterpret_cast<volatile uint64_t*>(&ctl->gen) + 1;
  c.parity = c.gen & 1;
#if AR_ALGO == 2
  hierarchical(c);
#else
  uint8_t others[AR_MAX_RANKS];
  uint32_t nothers = 0;
  for (uint32_t r = 0; r < p.world; ++r)
    if (r != p.rank) others[nothers++] = uint8_t(r);
#if AR_ALGO == 0
  one_shot(c, others, nothers);
#else
  two_shot(c, others, nothers);
#endif
#endif
  __syncthreads();
  if (*reinterpret_cast<volatile uint64_t*>(&ctl->status) != 0) return;
  if (threadIdx.x == 0) {
    // Local atomics only. The last block advances the generation for the next launch; stream
    // order makes it visible there.
    __threadfence();
    if (atomicAdd(&ctl->done, 1u) == gridDim.x - 1) {
      ctl->done = 0;
      ctl->gen = c.gen;
      __threadfence();
    }
  }
}

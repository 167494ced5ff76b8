// The host execution layer's runtime interface: the C ABI the Rust side launches through,
// the per-fiber state kernels read (threadIdx and friends), and the warp-collective
// primitive the PTX helpers' host branches are built on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>


extern "C" {

struct cuhost_dim3 {
  uint32_t x, y, z;
};

// One kernel of a compiled module. `invoke` runs the kernel body for the calling fiber with
// CUDA's kernelParams convention: params[i] points to the value of parameter i.
struct cuhost_kernel {
  const char* name;
  void (*invoke)(void** params);
  uint32_t num_params;
  const uint32_t* param_sizes;  // sizeof each parameter's type, checked against the caller's
};

// One kernel source compiled with one tactic's macros.
struct cuhost_module {
  const char* family;
  const char* tactic;
  const char* defines;  // the -D flags it was compiled with, space separated
  const cuhost_kernel* kernels;
  uint32_t num_kernels;
};

enum cuhost_schedule : uint32_t {
  // Threads start in index order and wake from barriers in index order; blocks run in
  // index order.
  CUHOST_SCHEDULE_FORWARD = 0,
  // Everything in reverse index order.
  CUHOST_SCHEDULE_REVERSE = 1,
  // A seeded permutation, fresh at every barrier release and for the block order.
  CUHOST_SCHEDULE_SHUFFLED = 2,
};

struct cuhost_launch_options {
  uint32_t workers;      // worker threads (0: one per available CPU); at most one per block
  uint32_t co_resident;  // 1: every block on its own thread, all running at once
  uint32_t schedule;     // cuhost_schedule
  uint32_t poison_shared;  // 1: fill dynamic shared memory with 0xFF before each block
  uint64_t seed;           // for CUHOST_SCHEDULE_SHUFFLED
  uint64_t timeout_ms;     // 0: none; otherwise the launch fails after this long
  uint32_t max_dynamic_shared;  // the emulated device's per-block limit (opt-in)
  uint32_t reserved;
};

struct cuhost_launch_stats {
  uint64_t blocks;
  uint64_t threads;
  uint64_t context_switches;
  uint64_t barriers;          // completed block barriers
  uint64_t warp_collectives;  // completed warp collectives (shuffles, votes, MMAs, ldmatrix)
  uint64_t mma;               // completed mma.sync collectives
  uint64_t cp_async_bytes;
};

// Runs `kernel` over `grid` × `block`. Returns 0, or non-zero with a message in `err`
// (kernel fault, deadlock, invalid launch, timeout).
int cuhost_launch(const cuhost_kernel* kernel, cuhost_dim3 grid, cuhost_dim3 block,
                  uint32_t dynamic_shared_bytes, void** params,
                  const cuhost_launch_options* options, cuhost_launch_stats* stats, char* err,
                  size_t err_len);

// The largest dynamic shared memory any launch can have (SM90's opt-in limit).
uint32_t cuhost_max_dynamic_shared(void);
}

namespace cuhost {

struct uint3_ {
  unsigned x, y, z;
};

// Per-fiber data the kernel-facing macros read without a call: `__thread` (C TLS, no
// dynamic initialization) compiles to one load from the thread pointer.
struct FiberView {
  uint3_ thread_idx;
};
struct BlockView {
  uint3_ block_idx;
  uint3_ block_dim;
  uint3_ grid_dim;
};
extern __thread const FiberView* tl_fiber_view;
extern __thread const BlockView* tl_block_view;

inline const uint3_& thread_idx() { return tl_fiber_view->thread_idx; }
inline const uint3_& block_idx() { return tl_block_view->block_idx; }
inline const uint3_& block_dim() { return tl_block_view->block_dim; }
inline const uint3_& grid_dim() { return tl_block_view->grid_dim; }

// Bytes each lane can pass into and get back from one warp collective.
constexpr size_t kLaneInBytes = 96;
constexpr size_t kLaneOutBytes = 32;

struct LaneIo {
  alignas(16) unsigned char in[kLaneInBytes];
  alignas(16) unsigned char out[kLaneOutBytes];
};

// Computes the outputs of a completed collective. `lanes[l]` is null for lanes outside `mask`.
using CollectiveFn = void (*)(LaneIo* const* lanes, unsigned mask, const void* ctx);

// The warp-collective primitive: the calling lane posts `in`, waits until every lane of `mask`
// has reached a collective with the same `kind` and mask, the last one to arrive runs `fn`
// over all lanes' inputs (as the hardware sees all registers of the warp at once), and each
// lane gets its `out`. `kind` is a static string naming the operation (used for mismatch
// errors; two lanes in one collective must pass the same pointer).
void warp_collective(unsigned mask, const char* kind, CollectiveFn fn, const void* ctx,
                     const void* in, size_t in_bytes, void* out, size_t out_bytes,
                     bool counts_as_mma = false);

// The calling thread's lane.
unsigned lane_id();

// Gives other fibers (and, when every fiber of the block only polls, other OS threads) a
// chance to run: called by spin-wait primitives (ld.acquire polling).
void yield_polling();

// Dynamic shared memory of the calling block: base and size.
unsigned char* dynamic_shared_base();
size_t dynamic_shared_size();

// In the ThreadSanitizer build, memory a collective reads on the kernel's behalf (ldmatrix's
// rows), reported as the calling thread's read; nothing otherwise.
#ifdef CUDA_HOST_TSAN
void collective_read(const void* p, size_t bytes);
#else
inline void collective_read(const void*, size_t) {}
#endif

namespace detail {
template <class T>
using param_t = std::remove_cv_t<std::remove_reference_t<T>>;

template <class... A, size_t... I>
inline void invoke_with(void (*k)(A...), void** params, std::index_sequence<I...>) {
  k(*static_cast<param_t<A>*>(params[I])...);
}

template <auto Kernel>
struct KernelEntry;

template <class... A, void (*Kernel)(A...)>
struct KernelEntry<Kernel> {
  static void invoke(void** params) {
    invoke_with(Kernel, params, std::index_sequence_for<A...>{});
  }
  static constexpr uint32_t sizes[sizeof...(A) + 1] = {uint32_t(sizeof(param_t<A>))..., 0};
  static constexpr uint32_t count = sizeof...(A);
};
}  // namespace detail

// The table entry of one kernel (used by the generated module files).
template <auto Kernel>
constexpr cuhost_kernel kernel_entry(const char* name) {
  using E = detail::KernelEntry<Kernel>;
  return cuhost_kernel{name, &E::invoke, E::count, E::sizes};
}

}  // namespace cuhost

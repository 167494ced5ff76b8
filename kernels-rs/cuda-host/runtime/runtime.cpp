// The host execution layer's runtime: runs a CUDA kernel compiled as C++ (see cuda_host.h) on
// the CPU.
//
// - A launch spreads its blocks over worker threads (the calling thread is one of them); a
//   worker runs one block at a time to completion, so `__shared__` variables, which are
//   thread-local here, are per block. A co-resident launch gives every block its own thread
//   (kernels whose blocks wait for each other, like the all-reduce, need all of them running).
// - The threads of a block are fibers on the worker: each runs until it reaches a barrier, a
//   warp collective, or a polling load, then the next ready fiber runs. Switching is a
//   hand-written register save/restore (x86-64) or ucontext elsewhere.
// - Warp collectives (shuffles, votes, ldmatrix, mma.sync) are rendezvous: every lane of the
//   mask posts its registers, the last to arrive computes every lane's result.
// - Undefined behaviour the hardware would turn into a hang or garbage is an error of the
//   launch, with the block, thread and operation: a barrier or collective some threads can no
//   longer reach (they exited), lanes of one collective disagreeing on the operation,
//   misaligned or out-of-bounds cp.async and ldmatrix, a fault (SIGSEGV/SIGBUS/SIGFPE/SIGILL)
//   inside the kernel, a kernel running past the launch's time limit.

#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include "cuda_host.h"
#include "cuda_host_ptx.h"

namespace {
// SM90's opt-in limit per block, the largest of the SMs this project targets.
constexpr size_t kMaxDynamicShared = 232448;
// Bytes after the launch's dynamic shared memory that are filled with a canary and checked
// when the block ends: a kernel writing past its allocation is caught.
constexpr size_t kSharedCanary = 4096;
constexpr unsigned char kCanaryByte = 0xA5;
constexpr unsigned kMaxThreads = 1024;
constexpr size_t kFiberStack = 256 * 1024;
constexpr size_t kAltStack = 64 * 1024;
constexpr unsigned kMaxBarriers = 16;
constexpr unsigned kMaxGroupsPerWarp = 4;
}  // namespace

extern "C" {
// Dynamic shared memory of the block running on this thread. Every kernel's
// `extern __shared__ T name[]` is bound to this symbol by the generated module files. The
// kernels ask for 16-byte alignment; 64 is the most a library loaded at run time (the stand-in
// driver, kernels-rs/cuda-stub) may give its initial-exec TLS under glibc.
alignas(64) __thread unsigned char cuhost_dynamic_shared[kMaxDynamicShared + kSharedCanary];
}

namespace cuhost {
__thread const FiberView* tl_fiber_view;
__thread const BlockView* tl_block_view;
}  // namespace cuhost

// ------------------------------------------------------------------ context switching

#if defined(__x86_64__)
extern "C" void cuhost_switch_context(void** save_sp, void* load_sp);
extern "C" void cuhost_fiber_start();
// Saves the callee-saved registers and the SSE/x87 control words on the current stack, stores
// the stack pointer, loads the other one and restores its registers. A new fiber's stack is
// prepared by `prepare_stack` so that this "returns" into cuhost_fiber_start with r12 = arg,
// r13 = entry.
asm(R"(
  .text
  .p2align 4
  .globl cuhost_switch_context
  .hidden cuhost_switch_context
  .type cuhost_switch_context,@function
cuhost_switch_context:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuhost_switch_context, .-cuhost_switch_context

  .p2align 4
  .globl cuhost_fiber_start
  .hidden cuhost_fiber_start
  .type cuhost_fiber_start,@function
cuhost_fiber_start:
  andq $-16, %rsp
  movq %r12, %rdi
  callq *%r13
  ud2
  .size cuhost_fiber_start, .-cuhost_fiber_start
)");
#endif

namespace cuhost {
// ThreadSanitizer build (cuda-host feature `tsan`, macro CUDA_HOST_TSAN): every CUDA thread is
// a TSan fiber, and switching fibers establishes no order (no_sync), so two threads of a block
// are ordered only by what orders them on a GPU: a barrier or a warp collective, each a
// release by every arriving thread and an acquire by every leaving one (per phase, so that a
// thread running ahead into the barrier's next use releases into another sync object). The
// block's start is a release by the worker that every fiber acquires first; its end a release
// by every fiber that the worker acquires. A removed barrier then shows as a data race on the
// block's shared memory, whatever order the fibers happened to run in.
#ifdef CUDA_HOST_TSAN
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void __tsan_ignore_thread_begin(void);
void __tsan_ignore_thread_end(void);
void __tsan_read_range(void* addr, unsigned long size);
void __tsan_write_range(void* addr, unsigned long size);
}
namespace {
constexpr unsigned kTsanNoSync = 1;  // __tsan_switch_to_fiber_no_sync
inline void tsan_switch(void* to) { __tsan_switch_to_fiber(to, kTsanNoSync); }
inline void tsan_acquire(void* a) { __tsan_acquire(a); }
inline void tsan_release(void* a) { __tsan_release(a); }
// The runtime is not instrumented, but the libc and allocator calls it makes for a fiber are
// (TSan intercepts them): inside an entry point a kernel calls, they are the runtime's own
// bookkeeping, shared by the block's fibers by design, and ignored. What the entry point
// reads or writes for the kernel (ldmatrix's rows, a cp.async's bytes) it reports itself.
struct RuntimeOnly {
  RuntimeOnly() { __tsan_ignore_thread_begin(); }
  ~RuntimeOnly() { __tsan_ignore_thread_end(); }
  RuntimeOnly(const RuntimeOnly&) = delete;
  RuntimeOnly& operator=(const RuntimeOnly&) = delete;
};
inline void kernel_read(const void* p, size_t n) {
  __tsan_ignore_thread_end();
  __tsan_read_range(const_cast<void*>(p), n);
  __tsan_ignore_thread_begin();
}
inline void kernel_write(void* p, size_t n) {
  __tsan_ignore_thread_end();
  __tsan_write_range(p, n);
  __tsan_ignore_thread_begin();
}
}  // namespace
#else
namespace {
inline void tsan_switch(void*) {}
inline void tsan_acquire(void*) {}
inline void tsan_release(void*) {}
struct RuntimeOnly {};
inline void kernel_read(const void*, size_t) {}
inline void kernel_write(void*, size_t) {}
}  // namespace
#endif

namespace {

struct Context {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

void switch_context(Context& from, Context& to) {
#if defined(__x86_64__)
  cuhost_switch_context(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

void prepare_stack(Context& ctx, unsigned char* base, size_t size, void (*entry)(void*),
                   void* arg) {
#if defined(__x86_64__)
  uintptr_t top = (uintptr_t(base) + size) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                           // alignment slot
  *--sp = uint64_t(uintptr_t(&cuhost_fiber_start));   // "return address" of the first switch
  *--sp = 0;                                           // rbp
  *--sp = 0;                                           // rbx
  *--sp = uint64_t(uintptr_t(arg));                    // r12
  *--sp = uint64_t(uintptr_t(entry));                  // r13
  *--sp = 0;                                           // r14
  *--sp = 0;                                           // r15
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  uint64_t control = uint64_t(mxcsr) | (uint64_t(fpucw) << 32);
  *--sp = control;
  ctx.sp = sp;
#else
  getcontext(&ctx.uc);
  ctx.uc.uc_stack.ss_sp = base;
  ctx.uc.uc_stack.ss_size = size;
  ctx.uc.uc_link = nullptr;
  // makecontext passes int arguments: split the pointer.
  const uintptr_t a = uintptr_t(arg);
  makecontext(&ctx.uc, reinterpret_cast<void (*)()>(+[](unsigned lo, unsigned hi, unsigned elo,
                                                        unsigned ehi) {
                reinterpret_cast<void (*)(void*)>((uintptr_t(ehi) << 32) | elo)(
                    reinterpret_cast<void*>((uintptr_t(hi) << 32) | lo));
              }),
              4, unsigned(a), unsigned(a >> 32), unsigned(uintptr_t(entry)),
              unsigned(uintptr_t(entry) >> 32));
#endif
}

// ------------------------------------------------------------------ launch-wide state

struct Launch {
  const cuhost_kernel* kernel;
  cuhost_dim3 grid, block;
  uint32_t dynamic_shared;
  void** params;
  cuhost_launch_options opt;
  uint64_t deadline_ns;  // 0: none
  std::vector<uint32_t> block_order;
  std::atomic<uint32_t> next_block{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::string error;
  std::atomic<uint64_t> switches{0}, barriers{0}, collectives{0}, mma{0}, cp_async_bytes{0};

  void fail(const std::string& msg) {
    std::lock_guard<std::mutex> g(mu);
    if (error.empty()) error = msg;
    failed.store(true, std::memory_order_release);
  }
};

uint64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// ------------------------------------------------------------------ fibers and blocks

struct PendingCopy {
  unsigned char* dst;
  const unsigned char* src;
  uint32_t cp_size, src_size;
  uint64_t group;
};

enum class State : uint8_t { Ready, Running, WaitBarrier, WaitWarp, Done };

struct Fiber {
  Context ctx;
  FiberView view;
  unsigned linear = 0, lane = 0, warp = 0;
  State state = State::Ready;
  unsigned wait_barrier = 0;
  const char* wait_kind = nullptr;  // the collective it waits in
  LaneIo io;
  std::vector<PendingCopy> copies;
  uint64_t next_group = 0;  // cp.async groups committed so far
  void* tsan = nullptr;     // its TSan fiber (tsan build)
};

struct Barrier {
  unsigned arrived = 0, expected = 0;
  unsigned phase = 0;  // completed uses (the TSan sync object alternates with it)
  int acc_count = 0, acc_and = 1, acc_or = 0;
  int result[3] = {0, 0, 0};
  std::vector<unsigned> waiters;
};

struct Group {
  bool active = false;
  unsigned mask = 0, arrived = 0;
  const char* kind = nullptr;
  unsigned phase = 0;  // completed collectives in this slot (as Barrier::phase)
};

struct Warp {
  Group groups[kMaxGroupsPerWarp];
};

// A ring of ready fibers.
struct RunQueue {
  std::vector<unsigned> ring;
  size_t head = 0, count = 0;
  void reset(size_t capacity) {
    ring.assign(capacity, 0);
    head = count = 0;
  }
  bool empty() const { return count == 0; }
  void push(unsigned f) {
    ring[(head + count) % ring.size()] = f;
    ++count;
  }
  unsigned pop() {
    unsigned f = ring[head];
    head = (head + 1) % ring.size();
    --count;
    return f;
  }
};

struct Worker;

struct Block {
  BlockView view;
  unsigned nthreads = 0, alive = 0;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Barrier barriers[kMaxBarriers];
  RunQueue queue;
  uint64_t rng = 0;
  unsigned polls_since_progress = 0;
  unsigned idle_rounds = 0;
  // TSan sync objects: per barrier and per warp collective slot, one per phase parity; the
  // block's start and end.
  char tsan_barrier[kMaxBarriers][2];
  std::vector<char> tsan_groups;  // warps × kMaxGroupsPerWarp × 2
  char tsan_start, tsan_end;
};

// Thread-local: one per worker thread.
struct Worker {
  Launch* launch = nullptr;
  Block block;
  Fiber* current = nullptr;
  Context scheduler;
  void* tsan_scheduler = nullptr;
  sigjmp_buf abort_jump;
  volatile sig_atomic_t in_kernel = 0;
  // Fiber stacks, kept across launches on this thread and handed to the shared pool when
  // the thread ends (launches start worker threads; mapping fresh stacks every time would
  // cost two system calls and the page faults per fiber).
  std::vector<unsigned char*> stacks;
  uint64_t switches = 0;
  ~Worker();
};

// Stacks of finished worker threads, for the next ones.
// Never destroyed: a worker thread may end while the process exits (the stand-in driver's
// stream threads end when their context goes, possibly as main returns), and its Worker's
// destructor must still find the pool; a static vector would be freed under it.
std::mutex& g_stack_pool_mu = *new std::mutex;
std::vector<unsigned char*>& g_stack_pool = *new std::vector<unsigned char*>;
constexpr size_t kStackPoolMax = 8192;

Worker::~Worker() {
#ifdef CUDA_HOST_TSAN
  // TSan holds each fiber as one of its at most 8128 threads; launches start worker threads.
  for (Fiber& f : block.fibers)
    if (f.tsan) __tsan_destroy_fiber(f.tsan);
#endif
  std::lock_guard<std::mutex> g(g_stack_pool_mu);
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  for (unsigned char* s : stacks) {
    if (g_stack_pool.size() < kStackPoolMax)
      g_stack_pool.push_back(s);
    else
      munmap(s - page, kFiberStack + page);
  }
}

__thread Worker* tl_worker;

std::string vformat(const char* fmt, va_list ap) {
  char buf[1024];
  vsnprintf(buf, sizeof buf, fmt, ap);
  return buf;
}

std::string where(const Worker* w) {
  char buf[256];
  const Block& b = w->block;
  if (w->current) {
    const auto& t = w->current->view.thread_idx;
    snprintf(buf, sizeof buf, "kernel %s, block (%u,%u,%u), thread (%u,%u,%u)",
             w->launch->kernel->name, b.view.block_idx.x, b.view.block_idx.y, b.view.block_idx.z,
             t.x, t.y, t.z);
  } else {
    snprintf(buf, sizeof buf, "kernel %s, block (%u,%u,%u)", w->launch->kernel->name,
             b.view.block_idx.x, b.view.block_idx.y, b.view.block_idx.z);
  }
  return buf;
}

[[noreturn]] void abort_block(Worker* w, const std::string& msg) {
  w->launch->fail(msg);
  w->in_kernel = 0;
  siglongjmp(w->abort_jump, 1);
}

Worker* worker() {
  Worker* w = tl_worker;
  if (!w || !w->launch) {
    fprintf(stderr, "cuda-host: a device function was called outside a kernel launch\n");
    abort();
  }
  return w;
}

uint64_t next_random(uint64_t& s) {
  s += 0x9E3779B97F4A7C15ull;
  uint64_t z = s;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Orders fibers that become ready together (launch start, barrier release, collective end)
// by the launch's schedule.
void order(Block& b, const Launch& l, unsigned* ids, size_t n) {
  switch (l.opt.schedule) {
    case CUHOST_SCHEDULE_REVERSE:
      if (!std::is_sorted(ids, ids + n, std::greater<unsigned>()))
        std::sort(ids, ids + n, std::greater<unsigned>());
      break;
    case CUHOST_SCHEDULE_SHUFFLED:
      for (size_t i = n; i > 1; --i) std::swap(ids[i - 1], ids[next_random(b.rng) % i]);
      break;
    default:
      if (!std::is_sorted(ids, ids + n)) std::sort(ids, ids + n);
  }
}

void order(Block& b, const Launch& l, std::vector<unsigned>& ids) {
  order(b, l, ids.data(), ids.size());
}

void check_deadline(Worker* w) {
  // Also on a finished thread's way out, after its last release: its clock_gettime writes
  // stack the next user of the stack must not be ordered after.
  RuntimeOnly runtime_only;
  const Launch& l = *w->launch;
  if (l.failed.load(std::memory_order_relaxed))
    abort_block(w, std::string());  // another worker failed: stop this block too
  if (l.deadline_ns && monotonic_ns() > l.deadline_ns) {
    char buf[128];
    snprintf(buf, sizeof buf, "launch exceeded its time limit of %llu ms",
             (unsigned long long)l.opt.timeout_ms);
    abort_block(w, std::string(buf) + " in " + where(w));
  }
}

// Switches from the running fiber to the next ready one, or back to the scheduler when none
// is ready. Returns when someone makes the fiber ready again and it is picked.
void run_next(Worker* w) {
  Fiber* cur = w->current;
  Block& b = w->block;
  if ((++w->switches & 1023) == 0) check_deadline(w);
  if (b.queue.empty()) {
    w->current = nullptr;
    tsan_switch(w->tsan_scheduler);
    switch_context(cur->ctx, w->scheduler);
  } else {
    Fiber* next = &b.fibers[b.queue.pop()];
    next->state = State::Running;
    w->current = next;
    tl_fiber_view = &next->view;
    tsan_switch(next->tsan);
    switch_context(cur->ctx, next->ctx);
  }
  // Resumed: whoever switched here set current and the view.
}

void make_ready(Block& b, Fiber& f) {
  f.state = State::Ready;
  b.queue.push(f.linear);
}

void progress(Block& b) {
  b.polls_since_progress = 0;
  b.idle_rounds = 0;
}

std::string lanes_text(unsigned mask) {
  char buf[16];
  snprintf(buf, sizeof buf, "%#010x", mask);
  return buf;
}

// A fiber ending while others wait for it at a barrier or collective would hang the GPU.
void check_exit(Worker* w, Fiber& f) {
  Block& b = w->block;
  for (unsigned id = 0; id < kMaxBarriers; ++id) {
    const Barrier& bar = b.barriers[id];
    if (bar.arrived > 0 && bar.expected == b.nthreads) {
      char buf[256];
      snprintf(buf, sizeof buf,
               "barrier divergence: the thread exited while %u of %u threads wait at barrier %u "
               "(__syncthreads / bar.sync)",
               bar.arrived, b.nthreads, id);
      abort_block(w, std::string(buf) + " in " + where(w));
    }
  }
  Warp& wp = b.warps[f.warp];
  for (const Group& g : wp.groups) {
    if (g.active && ((g.mask >> f.lane) & 1) && !((g.arrived >> f.lane) & 1)) {
      abort_block(w, "warp divergence: lane " + std::to_string(f.lane) + " exited while lanes " +
                         lanes_text(g.arrived) + " wait in " + g.kind + " with mask " +
                         lanes_text(g.mask) + " in " + where(w));
    }
  }
}

void fiber_entry(void* arg) {
  Worker* w = tl_worker;
  Fiber& f = *static_cast<Fiber*>(arg);
  Launch& l = *w->launch;
  tsan_acquire(&w->block.tsan_start);
  l.kernel->invoke(l.params);
  tsan_release(&w->block.tsan_end);
  // Copies still in flight when a thread ends only ever wrote shared memory of a finished
  // block: drop them, as a retired CTA's shared memory is gone.
  f.copies.clear();
  check_exit(w, f);
  f.state = State::Done;
  Block& b = w->block;
  --b.alive;
  progress(b);
  run_next(w);
  __builtin_trap();  // a finished fiber is never resumed
}

unsigned char* stack_for(Worker* w, size_t i) {
  if (w->stacks.size() <= i) {
    std::lock_guard<std::mutex> g(g_stack_pool_mu);
    while (w->stacks.size() <= i && !g_stack_pool.empty()) {
      w->stacks.push_back(g_stack_pool.back());
      g_stack_pool.pop_back();
    }
  }
  while (w->stacks.size() <= i) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    void* m = mmap(nullptr, kFiberStack + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return nullptr;
    // Guard page at the bottom: an overflowing fiber faults instead of corrupting a neighbour.
    mprotect(m, page, PROT_NONE);
    w->stacks.push_back(static_cast<unsigned char*>(m) + page);
  }
  return w->stacks[i];
}

// Nobody is ready and not everyone finished: say who waits where, and whether threads that
// exited are the ones they wait for (divergence: a hang on a GPU).
std::string describe_deadlock(Worker* w) {
  Block& b = w->block;
  unsigned at_barrier = 0, in_warp = 0, done = 0;
  int first_done = -1, last_done = -1;
  const Fiber* warp_waiter = nullptr;
  unsigned barrier_id = 0;
  for (const Fiber& f : b.fibers) {
    if (f.state == State::WaitBarrier) {
      ++at_barrier;
      barrier_id = f.wait_barrier;
    } else if (f.state == State::WaitWarp) {
      ++in_warp;
      if (!warp_waiter) warp_waiter = &f;
    } else if (f.state == State::Done) {
      ++done;
      if (first_done < 0) first_done = int(f.linear);
      last_done = int(f.linear);
    }
  }
  char buf[512];
  if (at_barrier > 0 && done > 0) {
    snprintf(buf, sizeof buf,
             "barrier divergence: %u threads wait at barrier %u (__syncthreads / bar.sync) that "
             "%u exited threads (among %d..%d) never reach",
             at_barrier, barrier_id, done, first_done, last_done);
  } else if (warp_waiter && done > 0) {
    const Warp& wp = b.warps[warp_waiter->warp];
    unsigned arrived = 0, mask = 0;
    for (const Group& g : wp.groups)
      if (g.active) {
        arrived = g.arrived;
        mask = g.mask;
      }
    unsigned missing = mask & ~arrived;
    snprintf(buf, sizeof buf,
             "warp divergence: lanes %#010x of warp %u wait in %s with mask %#010x; lane %d "
             "exited without arriving",
             arrived, warp_waiter->warp, warp_waiter->wait_kind, mask,
             missing ? __builtin_ctz(missing) : -1);
  } else {
    snprintf(buf, sizeof buf,
             "deadlock: %u threads wait at a barrier, %u in warp collectives, %u exited", at_barrier,
             in_warp, done);
  }
  return std::string(buf) + " in " + where(w);
}

std::string run_block(Worker* w, uint32_t linear_block) {
  Launch& l = *w->launch;
  Block& b = w->block;
  const uint32_t gx = l.grid.x, gy = l.grid.y;
  b.view.block_idx = {linear_block % gx, (linear_block / gx) % gy, linear_block / (gx * gy)};
  b.view.block_dim = {l.block.x, l.block.y, l.block.z};
  b.view.grid_dim = {l.grid.x, l.grid.y, l.grid.z};
  b.nthreads = l.block.x * l.block.y * l.block.z;
  b.alive = b.nthreads;
  b.fibers.resize(b.nthreads);
  b.warps.assign((b.nthreads + 31) / 32, Warp{});
  for (auto& bar : b.barriers) bar = Barrier{};
  b.queue.reset(b.nthreads + 1);
  b.rng = l.opt.seed * 0x2545F4914F6CDD1Dull + linear_block;
  b.polls_since_progress = 0;
  b.idle_rounds = 0;
  tl_block_view = &b.view;

  if (l.opt.poison_shared) memset(cuhost_dynamic_shared, 0xFF, l.dynamic_shared);
  memset(cuhost_dynamic_shared + l.dynamic_shared, kCanaryByte, kSharedCanary);

#ifdef CUDA_HOST_TSAN
  w->tsan_scheduler = __tsan_get_current_fiber();
  b.tsan_groups.assign(b.warps.size() * kMaxGroupsPerWarp * 2, 0);
#endif
  tsan_release(&b.tsan_start);
  std::vector<unsigned> start(b.nthreads);
  for (unsigned i = 0; i < b.nthreads; ++i) {
    Fiber& f = b.fibers[i];
    f.linear = i;
    f.view.thread_idx = {i % l.block.x, (i / l.block.x) % l.block.y, i / (l.block.x * l.block.y)};
    f.lane = i % 32;
    f.warp = i / 32;
    f.state = State::Ready;
    f.wait_kind = nullptr;
    f.copies.clear();
    f.next_group = 0;
    unsigned char* stack = stack_for(w, i);
    if (!stack) return "cannot allocate fiber stacks";
    prepare_stack(f.ctx, stack, kFiberStack, &fiber_entry, &f);
#ifdef CUDA_HOST_TSAN
    if (!f.tsan) f.tsan = __tsan_create_fiber(0);
#endif
    start[i] = i;
  }
  order(b, l, start);
  for (unsigned i : start) b.queue.push(i);

  w->current = nullptr;
  if (sigsetjmp(w->abort_jump, 1) != 0) {
    // Back on the worker's stack from a fiber that failed.
    tsan_switch(w->tsan_scheduler);
    w->current = nullptr;
    std::lock_guard<std::mutex> g(l.mu);
    return l.error.empty() ? "launch aborted" : l.error;
  }
  w->in_kernel = 1;
  while (!b.queue.empty()) {
    Fiber* f = &b.fibers[b.queue.pop()];
    f->state = State::Running;
    w->current = f;
    tl_fiber_view = &f->view;
    tsan_switch(f->tsan);
    switch_context(w->scheduler, f->ctx);
  }
  w->in_kernel = 0;
  tsan_acquire(&b.tsan_end);
  l.switches.fetch_add(w->switches, std::memory_order_relaxed);
  w->switches = 0;

  if (b.alive > 0) return describe_deadlock(w);
  // A write past the dynamic shared memory the launch asked for.
  for (size_t i = 0; i < kSharedCanary; ++i) {
    if (cuhost_dynamic_shared[l.dynamic_shared + i] != kCanaryByte) {
      char buf[160];
      snprintf(buf, sizeof buf,
               "shared memory overflow: byte %zu past the %u bytes of dynamic shared memory was "
               "written",
               i, l.dynamic_shared);
      return std::string(buf) + " in " + where(w);
    }
  }
  return std::string();
}

// ------------------------------------------------------------------ faults inside kernels

struct sigaction g_previous[65];
std::once_flag g_handlers_once;

void fault_handler(int sig, siginfo_t* info, void* uctx) {
  Worker* w = tl_worker;
  if (w && w->in_kernel && w->launch) {
    char buf[256];
    const char* what = sig == SIGSEGV   ? "illegal memory access (SIGSEGV)"
                       : sig == SIGBUS  ? "misaligned or illegal address (SIGBUS)"
                       : sig == SIGFPE  ? "arithmetic fault (SIGFPE, e.g. integer division by zero)"
                                        : "illegal instruction (SIGILL)";
    snprintf(buf, sizeof buf, "%s at address %p", what, info ? info->si_addr : nullptr);
    w->launch->fail(std::string(buf) + " in " + where(w));
    w->in_kernel = 0;
    siglongjmp(w->abort_jump, 1);
  }
  // Not ours: hand it to whoever was installed before (e.g. Rust's stack-overflow handler).
  const struct sigaction& prev = g_previous[sig];
  if (prev.sa_flags & SA_SIGINFO) {
    if (prev.sa_sigaction) {
      prev.sa_sigaction(sig, info, uctx);
      return;
    }
  } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
    prev.sa_handler(sig);
    return;
  }
  signal(sig, SIG_DFL);  // returning re-executes the faulting instruction: default action
}

void install_fault_handlers() {
  std::call_once(g_handlers_once, [] {
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) {
      struct sigaction sa;
      memset(&sa, 0, sizeof sa);
      sa.sa_sigaction = &fault_handler;
      sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
      sigemptyset(&sa.sa_mask);
      sigaction(sig, &sa, &g_previous[sig]);
    }
  });
}

// A worker thread's signal stack: a fiber that overflows its stack faults on the guard page
// and the handler must run somewhere else.
struct AltStack {
  stack_t previous{};
  void* mem = nullptr;
  AltStack() {
    mem = mmap(nullptr, kAltStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    stack_t st{};
    st.ss_sp = mem;
    st.ss_size = kAltStack;
    sigaltstack(&st, &previous);
  }
  ~AltStack() {
    sigaltstack(&previous, nullptr);
    munmap(mem, kAltStack);
  }
};

void work(Launch& l) {
  thread_local Worker self;
  AltStack alt;
  Worker* outer = tl_worker;
  tl_worker = &self;
  self.launch = &l;
  const FiberView* saved_fiber = tl_fiber_view;
  const BlockView* saved_block = tl_block_view;
  const uint32_t total = uint32_t(l.block_order.size());
  for (;;) {
    if (l.failed.load(std::memory_order_acquire)) break;
    const uint32_t i = l.next_block.fetch_add(1, std::memory_order_relaxed);
    if (i >= total) break;
    std::string err = run_block(&self, l.block_order[i]);
    if (!err.empty()) {
      l.fail(err);
      break;
    }
  }
  self.launch = nullptr;
  tl_worker = outer;
  tl_fiber_view = saved_fiber;
  tl_block_view = saved_block;
}

}  // namespace

// ------------------------------------------------------------------ kernel-facing functions

[[noreturn]] void kernel_error(const char* fmt, ...) {
  Worker* w = worker();
  va_list ap;
  va_start(ap, fmt);
  std::string msg = vformat(fmt, ap);
  va_end(ap);
  abort_block(w, msg + " in " + where(w));
}

namespace {
int barrier(unsigned id, unsigned expected, int predicate, int op) {
  RuntimeOnly runtime_only;
  Worker* w = worker();
  Block& b = w->block;
  Fiber& f = *w->current;
  if (id >= kMaxBarriers) kernel_error("bar.sync: barrier id %u out of range (0..15)", id);
  Barrier& bar = b.barriers[id];
  if (expected == 0) expected = b.nthreads;
  if (expected > b.nthreads || (expected % 32 != 0 && expected != b.nthreads))
    kernel_error("bar.sync %u: thread count %u is not a multiple of 32 within the block of %u",
                 id, expected, b.nthreads);
  if (bar.arrived == 0) {
    bar.expected = expected;
    bar.acc_count = 0;
    bar.acc_and = 1;
    bar.acc_or = 0;
  } else if (bar.expected != expected) {
    kernel_error("bar.sync %u: this thread expects %u threads, others arrived expecting %u", id,
                 expected, bar.expected);
  }
  char* sync = &b.tsan_barrier[id][bar.phase & 1];
  tsan_release(sync);
  ++bar.arrived;
  bar.acc_count += predicate != 0;
  bar.acc_and &= predicate != 0;
  bar.acc_or |= predicate != 0;
  progress(b);
  if (bar.arrived == bar.expected) {
    bar.result[0] = bar.acc_count;
    bar.result[1] = bar.acc_and;
    bar.result[2] = bar.acc_or;
    bar.arrived = 0;
    ++bar.phase;
    order(b, *w->launch, bar.waiters);
    for (unsigned id2 : bar.waiters) make_ready(b, b.fibers[id2]);
    bar.waiters.clear();
    w->launch->barriers.fetch_add(1, std::memory_order_relaxed);
    tsan_acquire(sync);
    return bar.result[op];
  }
  bar.waiters.push_back(f.linear);
  f.state = State::WaitBarrier;
  f.wait_barrier = id;
  run_next(w);
  tsan_acquire(sync);
  return b.barriers[id].result[op];
}
}  // namespace

void syncthreads() { barrier(0, 0, 0, 0); }
int syncthreads_reduce(int predicate, int op) { return barrier(0, 0, predicate, op); }
void bar_sync(unsigned id, unsigned count) { barrier(id, count, 0, 0); }

unsigned lane_id() { return worker()->current->lane; }

void warp_collective(unsigned mask, const char* kind, CollectiveFn fn, const void* ctx,
                     const void* in, size_t in_bytes, void* out, size_t out_bytes,
                     bool counts_as_mma) {
  RuntimeOnly runtime_only;
  Worker* w = worker();
  Block& b = w->block;
  Fiber& f = *w->current;
  const unsigned lane = f.lane;
  const unsigned warp_threads = std::min(32u, b.nthreads - f.warp * 32);
  const unsigned existing = warp_threads == 32 ? 0xffffffffu : ((1u << warp_threads) - 1);
  if (!((mask >> lane) & 1))
    kernel_error("%s: the calling lane %u is not in the mask %#010x", kind, lane, mask);
  if (mask & ~existing)
    kernel_error("%s: mask %#010x names lanes that do not exist in this warp (%u threads)", kind,
                 mask, warp_threads);
  if (in_bytes > kLaneInBytes || out_bytes > kLaneOutBytes)
    kernel_error("%s: %zu/%zu bytes per lane exceed the collective buffers", kind, in_bytes,
                 out_bytes);
  memcpy(f.io.in, in, in_bytes);
  Warp& wp = b.warps[f.warp];
  Group* g = nullptr;
  for (Group& c : wp.groups) {
    if (!c.active) continue;
    if (c.mask == mask) {
      if (c.kind != kind)
        kernel_error("warp divergence: lane %u calls %s while lanes %#010x wait in %s (mask %#010x)",
                     lane, kind, c.arrived, c.kind, mask);
      g = &c;
    } else if (c.mask & mask) {
      kernel_error(
          "%s with mask %#010x overlaps a pending %s with mask %#010x: lanes disagree on the "
          "participants",
          kind, mask, c.kind, c.mask);
    }
  }
  if (!g) {
    for (Group& c : wp.groups)
      if (!c.active) {
        g = &c;
        break;
      }
    if (!g) kernel_error("%s: too many concurrent collectives in one warp", kind);
    g->active = true;
    g->mask = mask;
    g->arrived = 0;
    g->kind = kind;
  }
#ifdef CUDA_HOST_TSAN
  char* sync = &b.tsan_groups[((f.warp * kMaxGroupsPerWarp) + size_t(g - wp.groups)) * 2 +
                              (g->phase & 1)];
#else
  char* sync = nullptr;
#endif
  tsan_release(sync);
  g->arrived |= 1u << lane;
  progress(b);
  if (g->arrived == mask) {
    // The last lane computes for all: what the others did before arriving is ordered first.
    tsan_acquire(sync);
    LaneIo* lanes[32];
    for (unsigned l = 0; l < 32; ++l)
      lanes[l] = ((mask >> l) & 1) ? &b.fibers[f.warp * 32 + l].io : nullptr;
    fn(lanes, mask, ctx);
    g->active = false;
    ++g->phase;
    unsigned waiters[32];
    size_t n = 0;
    for (unsigned l = 0; l < 32; ++l)
      if (((mask >> l) & 1) && l != lane) waiters[n++] = f.warp * 32 + l;
    order(b, *w->launch, waiters, n);
    for (size_t i = 0; i < n; ++i) make_ready(b, b.fibers[waiters[i]]);
    w->launch->collectives.fetch_add(1, std::memory_order_relaxed);
    if (counts_as_mma) w->launch->mma.fetch_add(1, std::memory_order_relaxed);
  } else {
    f.state = State::WaitWarp;
    f.wait_kind = kind;
    run_next(w);
  }
  tsan_acquire(sync);
  memcpy(out, f.io.out, out_bytes);
}

namespace {
struct ShflIn {
  uint64_t value;
  int32_t arg, width, mode;
};

void shfl_compute(LaneIo* const* lanes, unsigned mask, const void*) {
  ShflIn first;
  for (unsigned l = 0; l < 32; ++l)
    if (lanes[l]) {
      memcpy(&first, lanes[l]->in, sizeof first);
      break;
    }
  for (unsigned l = 0; l < 32; ++l) {
    if (!lanes[l]) continue;
    ShflIn s;
    memcpy(&s, lanes[l]->in, sizeof s);
    if (s.width != first.width || s.mode != first.mode)
      kernel_error("shuffle: lanes of one shuffle pass different widths or modes");
    const int width = s.width;
    if (width <= 0 || width > 32 || (width & (width - 1)))
      kernel_error("shuffle: width %d is not a power of two in 1..32", width);
    const int base = int(l) & ~(width - 1);
    int src;
    switch (s.mode) {
      case 0:  // idx
        src = base + (s.arg & (width - 1));
        break;
      case 1:  // up: lanes below the segment start keep their value
        src = int(l) - s.arg;
        if (src < base) src = int(l);
        break;
      case 2:  // down
        src = int(l) + s.arg;
        if (src >= base + width) src = int(l);
        break;
      default:  // xor: outside the segment keeps its own value
        src = int(l) ^ s.arg;
        if (src < base || src >= base + width) src = int(l);
        break;
    }
    if (!lanes[src])
      kernel_error("shuffle: lane %u reads lane %d, which is not in the mask %#010x", l, src,
                   mask);
    ShflIn from;
    memcpy(&from, lanes[src]->in, sizeof from);
    memcpy(lanes[l]->out, &from.value, 8);
  }
}

void vote_compute(LaneIo* const* lanes, unsigned mask, const void*) {
  unsigned ballot = 0;
  for (unsigned l = 0; l < 32; ++l) {
    if (!lanes[l]) continue;
    int p;
    memcpy(&p, lanes[l]->in, sizeof p);
    if (p) ballot |= 1u << l;
  }
  for (unsigned l = 0; l < 32; ++l) {
    if (!lanes[l]) continue;
    int mode;
    memcpy(&mode, lanes[l]->in + 4, sizeof mode);
    unsigned r = mode == 0 ? unsigned(ballot == mask) : mode == 1 ? unsigned(ballot != 0) : ballot;
    memcpy(lanes[l]->out, &r, 4);
  }
}

void nothing(LaneIo* const*, unsigned, const void*) {}
}  // namespace

uint64_t shfl(unsigned mask, uint64_t value, int lane_arg, int width, int mode, const char* what) {
  ShflIn in{value, lane_arg, width, mode};
  uint64_t out;
  warp_collective(mask, what, &shfl_compute, nullptr, &in, sizeof in, &out, sizeof out);
  return out;
}

unsigned vote(unsigned mask, int predicate, int mode, const char* what) {
  int in[2] = {predicate, mode};
  unsigned out;
  warp_collective(mask, what, &vote_compute, nullptr, in, sizeof in, &out, sizeof out);
  return out;
}

void syncwarp(unsigned mask) {
  warp_collective(mask, "__syncwarp", &nothing, nullptr, nullptr, 0, nullptr, 0);
}

unsigned activemask() {
  // Fibers of a warp are never "converged" the way SIMT lanes are: the only lanes known to be
  // active together are the caller's own.
  return 1u << worker()->current->lane;
}

void fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

void nanosleep(unsigned ns) {
  (void)ns;
  yield_polling();
}

long long clock64() { return (long long)monotonic_ns(); }

void yield_polling() {
  RuntimeOnly runtime_only;
  Worker* w = worker();
  Block& b = w->block;
  Fiber& f = *w->current;
  ++b.polls_since_progress;
  if (b.polls_since_progress > b.queue.count + 1) {
    // A whole round of this block's ready fibers only polled: let other threads (other
    // blocks, other ranks) run, sleeping a little once that keeps happening.
    b.polls_since_progress = 0;
    if (++b.idle_rounds > 64) {
      timespec ts{0, 20000};
      ::nanosleep(&ts, nullptr);
    } else {
      sched_yield();
    }
    check_deadline(w);
  }
  if (b.queue.empty()) return;
  make_ready(b, f);
  run_next(w);
}

#ifdef CUDA_HOST_TSAN
void collective_read(const void* p, size_t bytes) { kernel_read(p, bytes); }
#endif

unsigned char* dynamic_shared_base() { return cuhost_dynamic_shared; }
size_t dynamic_shared_size() { return worker()->launch->dynamic_shared; }

size_t shared_offset(const void* p) {
  const uintptr_t a = uintptr_t(p), base = uintptr_t(cuhost_dynamic_shared);
  if (a >= base && a < base + kMaxDynamicShared + kSharedCanary) return size_t(a - base);
  return size_t(a & 0xffffffffu);
}

// ------------------------------------------------------------------ cp.async

namespace {
void check_shared_range(const void* p, size_t bytes, const char* what) {
  const uintptr_t a = uintptr_t(p), base = uintptr_t(cuhost_dynamic_shared);
  const size_t dyn = dynamic_shared_size();
  if (a >= base && a < base + kMaxDynamicShared + kSharedCanary) {
    if (a + bytes > base + dyn)
      kernel_error("%s: shared address %#zx (+%zu bytes) is past the %zu bytes of dynamic shared "
                   "memory",
                   what, size_t(a - base), bytes, dyn);
  }
}

void complete(Fiber& f, uint64_t before_group) {
  Launch& l = *tl_worker->launch;
  size_t kept = 0;
  for (size_t i = 0; i < f.copies.size(); ++i) {
    PendingCopy& c = f.copies[i];
    if (c.group < before_group) {
      // The copy lands now, as the waiting thread's: a read of the global source and a write
      // of the shared destination.
      if (c.src_size) memcpy(c.dst, c.src, c.src_size);
      if (c.cp_size > c.src_size) memset(c.dst + c.src_size, 0, c.cp_size - c.src_size);
      if (c.src_size) kernel_read(c.src, c.src_size);
      kernel_write(c.dst, c.cp_size);
      l.cp_async_bytes.fetch_add(c.cp_size, std::memory_order_relaxed);
    } else {
      f.copies[kept++] = c;
    }
  }
  f.copies.resize(kept);
}
}  // namespace

void cp_async(void* dst, const void* src, unsigned cp_size, unsigned src_size, const char* what) {
  RuntimeOnly runtime_only;
  Worker* w = worker();
  Fiber& f = *w->current;
  if (cp_size != 4 && cp_size != 8 && cp_size != 16)
    kernel_error("%s: cp-size %u (4, 8 or 16)", what, cp_size);
  if (src_size > cp_size) kernel_error("%s: src-size %u > cp-size %u", what, src_size, cp_size);
  if (uintptr_t(dst) % cp_size)
    kernel_error("%s: shared destination %p is not %u-byte aligned", what, dst, cp_size);
  if (uintptr_t(src) % cp_size)
    kernel_error("%s: global source %p is not %u-byte aligned", what, src, cp_size);
  check_shared_range(dst, cp_size, what);
  // Until the group is waited for, the destination holds nothing a kernel may rely on: fill
  // it with 0xFF (NaN in f32, bf16 and e4m3) so a read before the wait shows.
  if (w->launch->opt.poison_shared) memset(dst, 0xFF, cp_size);
  // A GPU may land the bytes any time from here to the wait (below, where this layer lands
  // them): to TSan, the destination is written at both ends of that window.
  kernel_write(dst, cp_size);
  f.copies.push_back(PendingCopy{static_cast<unsigned char*>(dst),
                                 static_cast<const unsigned char*>(src), cp_size, src_size,
                                 f.next_group});
}

void cp_async_commit() { ++worker()->current->next_group; }

void cp_async_wait(unsigned pending_groups) {
  RuntimeOnly runtime_only;
  Fiber& f = *worker()->current;
  const uint64_t committed = f.next_group;
  complete(f, committed > pending_groups ? committed - pending_groups : 0);
}

void cp_async_wait_all() {
  RuntimeOnly runtime_only;
  Fiber& f = *worker()->current;
  ++f.next_group;
  complete(f, f.next_group);
}

// ------------------------------------------------------------------ the launch

namespace {
std::string validate(const cuhost_kernel* k, cuhost_dim3 grid, cuhost_dim3 blk, uint32_t smem,
                     const cuhost_launch_options& opt) {
  char buf[256];
  if (!k) return "no kernel";
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || blk.x == 0 || blk.y == 0 || blk.z == 0) {
    snprintf(buf, sizeof buf, "invalid configuration: grid (%u,%u,%u), block (%u,%u,%u)", grid.x,
             grid.y, grid.z, blk.x, blk.y, blk.z);
    return buf;
  }
  if (grid.y > 65535 || grid.z > 65535 || grid.x > 0x7fffffffu) {
    snprintf(buf, sizeof buf, "grid (%u,%u,%u) exceeds the limits (2^31-1, 65535, 65535)", grid.x,
             grid.y, grid.z);
    return buf;
  }
  const uint64_t threads = uint64_t(blk.x) * blk.y * blk.z;
  if (threads > kMaxThreads || blk.z > 64) {
    snprintf(buf, sizeof buf, "block (%u,%u,%u) exceeds 1024 threads", blk.x, blk.y, blk.z);
    return buf;
  }
  const uint32_t limit = opt.max_dynamic_shared ? opt.max_dynamic_shared : kMaxDynamicShared;
  if (smem > limit || smem > kMaxDynamicShared) {
    snprintf(buf, sizeof buf,
             "%u bytes of dynamic shared memory exceed the device's %u bytes per block", smem,
             limit);
    return buf;
  }
  return std::string();
}
}  // namespace

}  // namespace cuhost

extern "C" uint32_t cuhost_max_dynamic_shared(void) { return uint32_t(kMaxDynamicShared); }

extern "C" int cuhost_launch(const cuhost_kernel* kernel, cuhost_dim3 grid, cuhost_dim3 block,
                             uint32_t dynamic_shared_bytes, void** params,
                             const cuhost_launch_options* options, cuhost_launch_stats* stats,
                             char* err, size_t err_len) {
  using namespace cuhost;
  cuhost_launch_options opt{};
  if (options) opt = *options;
  auto report = [&](const std::string& msg) {
    if (err && err_len) snprintf(err, err_len, "%s", msg.c_str());
    return 1;
  };
  std::string bad = validate(kernel, grid, block, dynamic_shared_bytes, opt);
  if (!bad.empty()) return report(std::string(kernel ? kernel->name : "?") + ": " + bad);
  install_fault_handlers();

  Launch l;
  l.kernel = kernel;
  l.grid = grid;
  l.block = block;
  l.dynamic_shared = dynamic_shared_bytes;
  l.params = params;
  l.opt = opt;
  l.deadline_ns = opt.timeout_ms ? monotonic_ns() + opt.timeout_ms * 1000000ull : 0;
  const uint64_t blocks = uint64_t(grid.x) * grid.y * grid.z;
  if (blocks > 0xffffffffull) return report("grid has more than 2^32 blocks");
  l.block_order.resize(blocks);
  for (uint32_t i = 0; i < blocks; ++i) l.block_order[i] = i;
  if (opt.schedule == CUHOST_SCHEDULE_REVERSE) {
    std::reverse(l.block_order.begin(), l.block_order.end());
  } else if (opt.schedule == CUHOST_SCHEDULE_SHUFFLED) {
    uint64_t s = opt.seed ^ 0xD1B54A32D192ED03ull;
    for (size_t i = blocks; i > 1; --i) std::swap(l.block_order[i - 1], l.block_order[next_random(s) % i]);
  }

  size_t workers;
  if (opt.co_resident) {
    if (blocks > 256) return report("a co-resident launch is limited to 256 blocks");
    workers = blocks;
  } else {
    workers = opt.workers ? opt.workers : std::max(1u, std::thread::hardware_concurrency());
    workers = std::min<size_t>(workers, blocks);
  }
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  for (size_t i = 1; i < workers; ++i) threads.emplace_back([&l] { work(l); });
  work(l);
  for (auto& t : threads) t.join();

  if (stats) {
    stats->blocks = blocks;
    stats->threads = blocks * uint64_t(block.x) * block.y * block.z;
    stats->context_switches = l.switches.load();
    stats->barriers = l.barriers.load();
    stats->warp_collectives = l.collectives.load();
    stats->mma = l.mma.load();
    stats->cp_async_bytes = l.cp_async_bytes.load();
  }
  if (l.failed.load()) return report(l.error.empty() ? "launch failed" : l.error);
  return 0;
}

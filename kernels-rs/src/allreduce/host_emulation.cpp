// Runs allreduce.cu's kernel on the CPU: each (rank, block) is a forked process (so the
// kernel's __shared__ variables, per-process statics here, are per block), each of the block's
// AR_THREADS threads a std::thread with a std::barrier for __syncthreads; the ranks' regions,
// data buffers and control blocks live in one MAP_SHARED mapping. The PTX acquire/release
// become C++ acquire/release atomics; a barrier across a rank's block processes stands for
// the boundary between two kernel launches.
//
// It checks the CUDA source's logic (indexing, phases, flags, generations, parity, tags,
// timeouts) without a GPU; not the GPU memory model or the compiled SASS.
//
// Build (done by the Rust test `allreduce::kernel_model::cuda_source_on_the_host`):
//   g++ -std=c++20 -O1 -pthread -DAR_ALGO=.. -DAR_PUSH=.. -DAR_F32=.. -DAR_THREADS=256 \
//       host_emulation.cpp -o harness
// Run: harness DIR WORLD N REGION_BYTES CALLS BLOCKS [DEAD_RANK]
//   DIR/params{r}.bin  288-byte ArParams packed by Rust (pointers are replaced here)
//   DIR/input{r}.bin   rank r's n elements; DIR/residual.bin when params.residual != 0
//   writes DIR/output{r}.bin (the last call's result) and DIR/status{r}.txt (status word).
// DEAD_RANK (optional) never calls: the others must time out with its index in the status.

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
thread_local Dim3 threadIdx;
Dim3 blockIdx;
Dim3 gridDim{1, 1, 1};
static std::barrier<>* g_barrier;

struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};

inline void __syncthreads() { g_barrier->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long cmp,
                                    unsigned long long v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline uint64_t ar_host_nanos() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}
// Pollers give the CPU away: there are far more emulated threads than cores.
inline void ar_host_poll_hint() { std::this_thread::yield(); }

#define AR_HOST_EMULATION 1
#include "allreduce.cu"

static std::vector<char> read_file(const std::string& path) {
  std::vector<char> out;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return out;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.insert(out.end(), buf, buf + n);
  std::fclose(f);
  return out;
}

static bool write_file(const std::string& path, const void* data, size_t len) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  bool ok = std::fwrite(data, 1, len, f) == len;
  return std::fclose(f) == 0 && ok;
}

// Shared by a rank's block processes: the rank's buffers and a launch-boundary barrier.
struct RankShared {
  alignas(64) unsigned count;
  unsigned sense;
  ArControl ctl;
  int failed;
};

static void block_barrier(RankShared* rs, unsigned blocks, unsigned& local_sense) {
  local_sense ^= 1;
  if (__atomic_add_fetch(&rs->count, 1, __ATOMIC_ACQ_REL) == blocks) {
    __atomic_store_n(&rs->count, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&rs->sense, local_sense, __ATOMIC_RELEASE);
  } else {
    while (__atomic_load_n(&rs->sense, __ATOMIC_ACQUIRE) != local_sense) std::this_thread::yield();
  }
}

// One block of one rank: `calls` launches; block 0 resets the data before each and checks
// that every call gave the same result. Returns the process exit code.
static int run_block(const std::string& dir, int rank, unsigned block, unsigned blocks, uint64_t n,
                     char* regions, uint64_t region_bytes, int world, int calls, RankShared* rs,
                     T* data, T* residual) {
  blockIdx.x = block;
  gridDim.x = blocks;
  std::vector<char> pbytes = read_file(dir + "/params" + std::to_string(rank) + ".bin");
  if (pbytes.size() != sizeof(ArParams)) return 3;
  ArParams p;
  std::memcpy(&p, pbytes.data(), sizeof p);
  for (int r = 0; r < world; ++r) p.peer[r] = uint64_t(regions + r * region_bytes);
  std::vector<char> input = read_file(dir + "/input" + std::to_string(rank) + ".bin");
  if (input.size() != n * sizeof(T)) return 3;
  if (p.residual != 0) {
    std::vector<char> res = read_file(dir + "/residual.bin");
    if (res.size() != n * sizeof(T)) return 3;
    if (block == 0) std::memcpy(residual, res.data(), res.size());
    p.residual = uint64_t(residual);
  }
  p.data = uint64_t(data);
  p.ctl = uint64_t(&rs->ctl);
  unsigned sense = 0;
  std::vector<char> first;
  for (int call = 0; call < calls; ++call) {
    if (block == 0) std::memcpy(data, input.data(), input.size());
    block_barrier(rs, blocks, sense);  // launch boundary: data reset before any block runs
    std::barrier<> bar(AR_THREADS);
    g_barrier = &bar;
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < AR_THREADS; ++t)
      threads.emplace_back([t, &p] {
        threadIdx.x = t;
        allreduce(p);
      });
    for (auto& th : threads) th.join();
    block_barrier(rs, blocks, sense);  // launch boundary: every block done
    if (block == 0 && rs->ctl.status == 0) {
      if (call == 0)
        first.assign(reinterpret_cast<char*>(data), reinterpret_cast<char*>(data) + input.size());
      else if (std::memcmp(first.data(), data, input.size()) != 0)
        rs->failed = 4;  // calls must agree
    }
    if (__atomic_load_n(&rs->ctl.status, __ATOMIC_ACQUIRE) != 0) break;
  }
  if (block != 0) return 0;
  std::string status = std::to_string(rs->ctl.status) + " " + std::to_string(rs->ctl.gen) + "\n";
  write_file(dir + "/status" + std::to_string(rank) + ".txt", status.data(), status.size());
  if (!write_file(dir + "/output" + std::to_string(rank) + ".bin", data, input.size())) return 3;
  return rs->failed;
}

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s DIR WORLD N REGION_BYTES CALLS BLOCKS [DEAD_RANK]\n", argv[0]);
    return 2;
  }
  std::string dir = argv[1];
  int world = std::atoi(argv[2]);
  uint64_t n = std::strtoull(argv[3], nullptr, 10);
  uint64_t region_bytes = std::strtoull(argv[4], nullptr, 10);
  int calls = std::atoi(argv[5]);
  unsigned blocks = unsigned(std::atoi(argv[6]));
  int dead = argc > 7 ? std::atoi(argv[7]) : -1;
  if (world < 1 || world > AR_MAX_RANKS || blocks < 1 || blocks > AR_MAX_LANES) return 2;
  // Per rank: RankShared, then data and residual, each rounded up to 64 bytes.
  const uint64_t buf = (n * sizeof(T) + 63) / 64 * 64;
  const uint64_t per_rank = (sizeof(RankShared) + 63) / 64 * 64 + 2 * buf;
  const uint64_t total = region_bytes * world + per_rank * world;
  char* base = static_cast<char*>(
      mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) return 3;
  char* regions = base;
  std::vector<pid_t> kids;
  for (int r = 0; r < world; ++r) {
    if (r == dead) continue;
    char* mine = base + region_bytes * world + per_rank * r;
    RankShared* rs = reinterpret_cast<RankShared*>(mine);
    T* data = reinterpret_cast<T*>(mine + (sizeof(RankShared) + 63) / 64 * 64);
    T* residual = reinterpret_cast<T*>(reinterpret_cast<char*>(data) + buf);
    for (unsigned b = 0; b < blocks; ++b) {
      pid_t pid = fork();
      if (pid == 0)
        _exit(run_block(dir, r, b, blocks, n, regions, region_bytes, world, calls, rs, data,
                        residual));
      kids.push_back(pid);
    }
  }
  int worst = 0;
  for (pid_t k : kids) {
    int st = 0;
    waitpid(k, &st, 0);
    int code = WIFEXITED(st) ? WEXITSTATUS(st) : 5;
    if (code > worst) worst = code;
  }
  return worst;
}

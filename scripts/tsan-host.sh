#!/usr/bin/env bash
# ThreadSanitizer over the host execution layer: the runtime and every kernel module built with
# -fsanitize=thread (cuda-host feature `tsan`), each CUDA thread a TSan fiber whose switches
# order nothing, so two threads of a block are ordered only by a barrier or a warp collective
# (runtime.cpp). A data race on shared or global memory is reported whatever order the fibers
# ran in; the host tests' goldens see a race only when the schedule turns it into a wrong value.
#
#   scripts/tsan-host.sh                           # host_layers (a minute once built)
#   scripts/tsan-host.sh --test host_moe           # any project-tests test, cargo test args
#   HOST_TACTICS=n128_m16_k256_w4_s2 scripts/tsan-host.sh --test host_moe
#
# Builds into target/tsan (the whole workspace's dependencies once, ~10 minutes on 2 cores:
# every executable links the TSan runtime) and stops at the first report (halt_on_error).
# CI runs it on host_layers (~7 minutes with the build); scripts/race-mutations.py runs it on
# the hand-made races recorded in kernels-rs/cuda-host/MUTATIONS.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export CARGO_TARGET_DIR="${TSAN_TARGET_DIR:-$ROOT/target/tsan}"
# The TSan runtime linked statically and whole into every test executable (rustc links with
# -nodefaultlibs, so -fsanitize=thread alone adds nothing); its interceptors then come before
# libc's. An explicit --target keeps these flags off build scripts and proc macros.
# libtsan_preinit.o starts the runtime before any library's constructor (as gcc's
# -static-libtsan links it).
tsan_lib="$(${CC:-gcc} -print-file-name=libtsan.a)"
tsan_preinit="$(${CC:-gcc} -print-file-name=libtsan_preinit.o)"
[[ -f "$tsan_lib" && -f "$tsan_preinit" ]] || {
  echo "tsan-host.sh: no libtsan.a / libtsan_preinit.o (install the compiler's TSan runtime)" >&2
  exit 2
}
target="$(rustc -vV | sed -n 's/^host: //p')"
export RUSTFLAGS="-C link-arg=$tsan_preinit -C link-arg=-Wl,--whole-archive -C link-arg=$tsan_lib -C link-arg=-Wl,--no-whole-archive ${RUSTFLAGS:-}"
# Reports stop the test; the fault handler's siglongjmp out of a kernel is expected. Only the
# kernel modules are instrumented: the Rust code (the tests, rayon, std) is not, so its
# synchronization is invisible to TSan, and the accesses its libc calls make (memcpy, malloc)
# would be reported as races; the interceptors' accesses are ignored. The runtime reports what
# it reads and writes for a kernel (cp.async, ldmatrix) itself.
export TSAN_OPTIONS="halt_on_error=1 report_signal_unsafe=0 ignore_interceptors_accesses=1 ${TSAN_OPTIONS:-}"
args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=(--test host_layers)
exec cargo test --locked --target "$target" -p project-tests --features cuda-host/tsan "${args[@]}" \
  -- --test-threads 1

#!/usr/bin/env bash
# Runs a command against the stand-in CUDA driver (kernels-rs/cuda-stub): the driver API with
# the real driver's rules, kernels run by the host execution layer. No GPU, no CUDA toolkit.
#
#   scripts/stub-driver.sh model run --backend cuda \
#     --checkpoint golden/data/models/kimi-chat-tiny --prompt 1010,289,1017 --max-new-tokens 24
#   CUDA_STUB_DEVICE_COUNT=2 scripts/stub-driver.sh model run --backend cuda --tp 2 ...
#   scripts/stub-driver.sh cargo test -p project-tests --features cuda --test gpu_layers -- --ignored
#
# It builds the stand-in (and the command, when it names a workspace binary: model, autotune,
# gpu-check, mla-gpu-check, allreduce-gpu-check, allreduce-rank, gpu-preflight,
# ptx-probe-check), links
# `libcuda.so.1` to it in a folder of its own, writes its kernel images (one per entry of
# ptx/manifest.json, plus the layers and probe images), and runs the command with:
#   LD_LIBRARY_PATH   that folder first: the stand-in is never on the default library path,
#                     so without this script a process finds the real driver or none;
#   GLIBC_TUNABLES    room for the host layer's initial-exec TLS in a library loaded at run
#                     time (glibc.rtld.optional_static_tls);
#   KIMI_PTX_DIR      the stand-in's kernel images (`model --ptx-dir` and the checks default
#                     to it);
#   PATH              the build's binaries first.
# Settings (environment):
#   CUDA_STUB_DEVICE        rtx-pro-6000 (default, SM120), h100 or h200 (SM90)
#   CUDA_STUB_DEVICE_COUNT  devices (default 1)
#   CUDA_STUB_P2P=0         devices without peer access
#   CUDA_STUB_MEMORY_MIB    each device's memory (default the kind's; device memory is host
#                           memory here: `serve` fills --gpu-memory-utilization of it)
#   CUDA_STUB_COMPUTE_MODE  default, exclusive-process or prohibited
#   CUDA_STUB_SCHEDULE      forward (default), reverse or shuffled:SEED (blocks and threads)
#   CUDA_STUB_QUIET=1       no explanation of refused calls on stderr
#   STUB_PROFILE            release (default) or debug: which build of the stand-in and the
#                           named binaries
#   STUB_NO_BUILD=1         use the stand-in already built (CI, after `cargo test --workspace`)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ $# -gt 0 ]] || { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

profile="${STUB_PROFILE:-release}"
case "$profile" in
  release) build=(--release) ;;
  debug) build=() ;;
  *) echo "stub-driver.sh: STUB_PROFILE=$profile: release or debug" >&2; exit 2 ;;
esac
target="${CARGO_TARGET_DIR:-$ROOT/target}"
out="$target/$profile"
dir="$target/stub-driver"

# One cargo invocation with the stand-in, so that both resolve the same features (and share one
# build of the host execution layer).
cargo_build() { (cd "$ROOT" && cargo build --locked --quiet "${build[@]}" -p cuda-stub "$@"); }
if [[ "${STUB_NO_BUILD:-0}" != 1 ]]; then
  case "$1" in
    model | autotune) cargo_build -p "$1" ;;
    gpu-check | mla-gpu-check | allreduce-gpu-check | allreduce-rank | gpu-preflight)
      cargo_build -p kernels --features kernels/cuda ;;
    ptx-probe-check) cargo_build -p cuda-host --features cuda-host/cuda ;;
    *) cargo_build ;;
  esac
fi

# `cargo build` leaves the library in the build folder, a test build (cuda-stub's tests) in
# deps/: the newer one.
lib="$out/libcuda_stub.so"
[[ "$out/deps/libcuda_stub.so" -nt "$lib" ]] && lib="$out/deps/libcuda_stub.so"
[[ -f "$lib" ]] || { echo "stub-driver.sh: $lib is missing (build: cargo build -p cuda-stub)" >&2; exit 1; }
mkdir -p "$dir/lib"
ln -sfn "$lib" "$dir/lib/libcuda.so.1"
ln -sfn libcuda.so.1 "$dir/lib/libcuda.so"
"$out/cuda-stub-images" --manifest "$ROOT/ptx/manifest.json" --out "$dir/ptx" >/dev/null

export LD_LIBRARY_PATH="$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export GLIBC_TUNABLES="glibc.rtld.optional_static_tls=0x100000${GLIBC_TUNABLES:+:$GLIBC_TUNABLES}"
export KIMI_PTX_DIR="$dir/ptx"
export PATH="$out:$PATH"
exec "$@"

#!/usr/bin/env bash
# GPU check of the NVFP4 MoE kernels, for a machine with an NVIDIA GPU and driver but no Rust.
#
# Build (on a machine with Rust; no CUDA toolkit or GPU needed, the driver is opened at run time):
#   scripts/compile-gates.sh                                   # cubins into ptx/moe_gemm/<sm>/
#   cargo build --release --features cuda -p kernels --bin gpu-check
# or do both and stage everything with:
#   scripts/build-gpu-bundle.sh [BUNDLE_DIR]                   # default .gpu-bundle/
#
# Carry to the GPU machine (the bundle holds exactly this):
#   gpu-check                 the binary (x86-64 Linux, glibc; links no CUDA library)
#   ptx/moe_gemm/<sm>/*.cubin the gate's kernel images (.ptx fallbacks only with WITH_PTX=1:
#                             they need a driver that knows PTX ISA 9.5, i.e. CUDA >= 13.5)
#   golden/data/moe/          optional MoE goldens; absent → that part is skipped and says so
#   scripts/gpu-check.sh      this script
#   allreduce-gpu-check       optional: the all-reduce check (feature `cuda`), with
#                             ptx/allreduce/<sm>/*.cubin; run after the MoE check
#
# Run there, from the bundle root (or a checkout with target/release/gpu-check):
#   scripts/gpu-check.sh [gpu-check flags...]     e.g. --tactics portable --iters 50
# Results: $OUT/gpu-check.{txt,json} when OUT is set, else bench/results/gpu/. The last line
# of the output is "N passed, M failed". Exit status: 0 all passed, 1 a tactic failed,
# 2 nothing could run (no driver/device, unsupported GPU), 124 the time limit below.
#
# On the device tool of this workplace (the bundle folder is git-ignored, so carry it):
#   run(command="cd .gpu-bundle && scripts/gpu-check.sh", carry=[".gpu-bundle"], timeout_s=540)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

BIN="${GPU_CHECK_BIN:-}"
if [[ -z "$BIN" ]]; then
  for c in ./gpu-check ./target/release/gpu-check; do
    if [[ -x "$c" ]]; then BIN="$c"; break; fi
  done
fi
[[ -n "$BIN" ]] || {
  echo "gpu-check.sh: no gpu-check binary (set GPU_CHECK_BIN, or build it: see the top of $0)" >&2
  exit 2
}

# The driver library may live outside the loader's default path (e.g. /usr/local/nvidia).
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
  [[ -e "$d/libcuda.so.1" ]] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done

export KIMI_PTX_DIR="${KIMI_PTX_DIR:-$ROOT/ptx}"
OUT_DIR="${OUT:-$ROOT/bench/results/gpu}"
mkdir -p "$OUT_DIR"

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv \
    | tee "$OUT_DIR/nvidia-smi.txt" || true
fi
n_cubins=$(find "$KIMI_PTX_DIR" -name '*.cubin' 2>/dev/null | wc -l)
echo "gpu-check.sh: $BIN, $n_cubins cubins under $KIMI_PTX_DIR, results to $OUT_DIR"

# The whole check is sized for well under 8 minutes on one H200; the limit turns a hang
# (a kernel that never finishes) into a reported failure instead of a lost session.
set +e
timeout --signal=INT --kill-after=20 "${GPU_CHECK_TIMEOUT:-480}" \
  "$BIN" --ptx-dir "$KIMI_PTX_DIR" --golden-dir "${GOLDEN_DIR:-$ROOT/golden/data/moe}" \
  --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu-check.log"
rc=${PIPESTATUS[0]}
set -e
[[ $rc == 124 ]] && echo "gpu-check.sh: timed out after ${GPU_CHECK_TIMEOUT:-480} s" >&2

# The CUDA all-reduce (allreduce-gpu-check): in-process bit-exact check of every algorithm on
# 2/4/8 ranks as concurrent streams, timing, then 2- and 4-process CUDA IPC checks. Skipped
# with SKIP_ALLREDUCE=1 or when the binary is absent. Sized for about a minute on one H200.
AR_BIN="${ALLREDUCE_GPU_CHECK_BIN:-}"
if [[ -z "$AR_BIN" ]]; then
  for c in ./allreduce-gpu-check ./target/release/allreduce-gpu-check; do
    if [[ -x "$c" ]]; then AR_BIN="$c"; break; fi
  done
fi
if [[ "${SKIP_ALLREDUCE:-0}" != 1 && -n "$AR_BIN" ]]; then
  set +e
  timeout --signal=INT --kill-after=20 "${ALLREDUCE_CHECK_TIMEOUT:-240}" \
    "$AR_BIN" --ptx-dir "$KIMI_PTX_DIR" --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/allreduce-gpu-check.log"
  ar_rc=${PIPESTATUS[0]}
  set -e
  [[ $ar_rc == 124 ]] && echo "gpu-check.sh: allreduce-gpu-check timed out" >&2
  # The worse of the two: a failure (1) or timeout beats "could not run" (2) beats success.
  if [[ $rc == 0 || ( $rc == 2 && $ar_rc != 0 ) ]]; then rc=$ar_rc; fi
fi
exit "$rc"

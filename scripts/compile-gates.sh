#!/usr/bin/env bash
# Compile gates: install the pinned CUDA toolchain (no GPU needed), then build every
# (tactic, SM) of each kernel family and check registers, spills, shared memory and the
# required SASS instructions. `--check` also fails when ptx/manifest.json is stale.
# Then the host execution layer's probe kernels (kernels-rs/cuda-host/probes/ptx_probe.cu),
# which `ptx-probe-check` runs on a GPU against the host layer: they must build for both SMs
# and lower each instruction to the SASS the host layer models.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/cuda-toolchain.sh
cargo run --release --quiet -p kernels --bin ptx-gate -- --check "$@"

# shellcheck source=/dev/null
source .cuda-toolchain/env.sh
for sm in sm_90a sm_120a; do
  dir="ptx/ptx_probe/$sm"
  mkdir -p "$dir"
  "$NVCC" -arch="$sm" -cubin -std=c++17 -O3 -lineinfo -I kernels-rs/include \
    -o "$dir/default.cubin" kernels-rs/cuda-host/probes/ptx_probe.cu
  sass="$("$CUOBJDUMP" -sass "$dir/default.cubin")"
  want=(HMMA.16816.F32.BF16 LDSM.16.M88.4 LDSM.16.MT88.4 LDSM.16.M88.2 LDSM.16.MT88 LDGSTS)
  if [[ "$sm" == sm_120a ]]; then
    want+=(OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X QMMA.16832.F32.E4M3.E4M3)
  fi
  for w in "${want[@]}"; do
    grep -q "$w" <<<"$sass" || { echo "probe gate: $sm lacks $w" >&2; exit 1; }
  done
  echo "probe gate: $sm ok (${#want[@]} instructions present)"
done

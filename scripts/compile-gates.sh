#!/usr/bin/env bash
# Compile gates: install the pinned CUDA toolchain (no GPU needed), then build every
# (tactic, SM) of each kernel family and check registers, spills, shared memory and the
# required SASS instructions. `--check` also fails when ptx/manifest.json is stale.
# Then the host execution layer's probe kernels (kernels-rs/cuda-host/probes/ptx_probe.cu),
# which `ptx-probe-check` runs on a GPU against the host layer: they must build for both SMs
# and lower each instruction to the SASS the host layer models. Then the layers family.
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

# The decode step's small kernels (kernels-rs/src/layers/layers.cu): one image per SM, every
# entry present, no spills and no stack frame (they are memory-bound; a spill is a regression).
layer_kernels=(embed_gather add_rms_norm rope_interleaved route_noaux_tc group_by_expert
  dense_bf16 silu_mul argmax_rows dense_heads_bf16 to_bf16_strided gather_rows sample_rows
  argmax_shard argmax_ranks)
for sm in sm_90a sm_120a; do
  dir="ptx/layers/$sm"
  mkdir -p "$dir"
  report="$("$NVCC" -arch="$sm" -cubin -std=c++17 -O3 -lineinfo -Xptxas -v -I kernels-rs/include \
    -o "$dir/default.cubin" kernels-rs/src/layers/layers.cu 2>&1)"
  for k in "${layer_kernels[@]}"; do
    grep -q "entry function '$k'" <<<"$report" || { echo "layers gate: $sm lacks $k" >&2; exit 1; }
  done
  if grep -E "[1-9][0-9]* bytes (stack frame|spill)" <<<"$report" >&2; then
    echo "layers gate: $sm spills or uses a stack frame (above)" >&2
    exit 1
  fi
  echo "layers gate: $sm ok (${#layer_kernels[@]} kernels, no spills)"
done

#!/usr/bin/env bash
# Builds the GPU check here (no GPU, no system CUDA) and stages what a GPU machine without
# Rust needs into one folder:
#   BUNDLE/gpu-check                 release binary, feature `cuda` (driver opened at run time)
#   BUNDLE/mla-gpu-check             the MLA decode check (same feature)
#   BUNDLE/allreduce-gpu-check       the CUDA all-reduce check (same feature)
#   BUNDLE/gpu-preflight             what the machine can run (driver, compute mode, memory,
#                                    vendor libraries), asked first by gpu-check.sh
#   BUNDLE/ptx-probe-check           the host execution layer's probe kernels on the GPU
#                                    against the host layer (crate cuda-host, feature cuda)
#   BUNDLE/ptx/moe_gemm/<sm>/*.cubin the compile gate's kernels (+ manifest; .ptx on request)
#   BUNDLE/golden/data/moe/          MoE goldens, if the repository has them
#   BUNDLE/gpu-dense                 the dense products, ours against cuBLASLt (test binary)
#   BUNDLE/model                     the model binary (feature cuda) and
#   BUNDLE/golden/data/models/{kimi-kernel-dims,kimi-tiny,dsv3-noqlora-grouped,
#     dsv3-mini-unsharded,kimi-chat-tiny}/       the end-to-end stage's checkpoints
#   BUNDLE/autotune                  the tuning lab (feature cuda): its timed stage on the GPU,
#                                    the cost-model refit and the predicted-vs-measured gaps
#   BUNDLE/gpu-sweeps                the criterion sweeps of the CUDA tactics (the gpu_tactics
#                                    bench of crate bench, feature cuda)
#   BUNDLE/COMMIT                    the commit the bundle was built from (cache provenance)
#   BUNDLE/scripts/gpu-check.sh      the runner (see its header for how to run)
#
# The bundle must travel to the device machine in one carry (64 MiB in all): it fails above
# BUNDLE_MAX_MIB (default 48), leaving room for what a session carries beside it.
#
# Usage: scripts/build-gpu-bundle.sh [BUNDLE_DIR]   (default .gpu-bundle, git-ignored)
# Env:   SKIP_GATES=1  reuse the cubins already under ptx/ instead of running the gate
#        WITH_PTX=1    add the .ptx fallbacks (+22 MB). Off by default: they are PTX ISA 9.5,
#                      which only a CUDA >= 13.5 driver can JIT, and the device machines seen
#                      run driver 580 (CUDA 13.0), which loads the cubins but not that PTX.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUNDLE="${1:-$ROOT/.gpu-bundle}"

if [[ "${SKIP_GATES:-0}" != 1 ]]; then
  # Installs the pinned nvcc wheels if needed, builds every (tactic, SM) into ptx/moe_gemm/.
  # Without --check: a stale manifest is rewritten (and shows in git status) rather than
  # stopping the bundle.
  scripts/cuda-toolchain.sh
  cargo run --release --quiet -p kernels --bin ptx-gate
fi
n=$(find ptx/moe_gemm -name '*.cubin' 2>/dev/null | wc -l)
[[ "$n" -gt 0 ]] || { echo "build-gpu-bundle: no cubins under ptx/moe_gemm (run the gate)" >&2; exit 1; }

cargo build --release --features cuda -p kernels --bin gpu-check --bin mla-gpu-check \
  --bin allreduce-gpu-check --bin gpu-preflight
cargo build --release --features cuda -p cuda-host --bin ptx-probe-check
cargo build --release --features cuda -p model --bin model
cargo build --release --features cuda -p autotune --bin autotune
# The criterion sweeps are a bench target: find the executable from cargo's messages.
sweeps_bin="$(cargo bench --no-run --features cuda -p bench --bench gpu_tactics \
  --message-format=json 2>/dev/null | grep -o '"executable":"[^"]*gpu_tactics[^"]*"' | tail -1 \
  | cut -d'"' -f4)"
[[ -x "$sweeps_bin" ]] || { echo "build-gpu-bundle: gpu_tactics bench not built" >&2; exit 1; }
# The layers kernels' GPU test is a cargo test binary: find its path from cargo's messages.
layers_test="$(cargo test --release --no-run --features cuda -p project-tests --test gpu_layers \
  --message-format=json 2>/dev/null | grep -o '"executable":"[^"]*gpu_layers[^"]*"' | tail -1 \
  | cut -d'"' -f4)"
[[ -x "$layers_test" ]] || { echo "build-gpu-bundle: gpu_layers test binary not built" >&2; exit 1; }
# The dense products' two tactics (ours, cuBLASLt): a test binary too.
dense_test="$(cargo test --release --no-run --features cuda -p project-tests --test gpu_dense \
  --message-format=json 2>/dev/null | grep -o '"executable":"[^"]*gpu_dense[^"]*"' | tail -1 \
  | cut -d'"' -f4)"
[[ -x "$dense_test" ]] || { echo "build-gpu-bundle: gpu_dense test binary not built" >&2; exit 1; }
BIN="$ROOT/target/release/gpu-check"

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/scripts" "$BUNDLE/ptx"
# Debug info (profile.release debug = 1) is most of the binary's size; the bundle must stay
# well under the device tool's 64 MiB.
for name in gpu-check mla-gpu-check allreduce-gpu-check gpu-preflight ptx-probe-check gpu-layers \
  gpu-dense model autotune gpu-sweeps; do
  src="$ROOT/target/release/$name"
  [[ $name == gpu-layers ]] && src="$layers_test"
  [[ $name == gpu-dense ]] && src="$dense_test"
  [[ $name == gpu-sweeps ]] && src="$sweeps_bin"
  if command -v strip >/dev/null; then
    strip -o "$BUNDLE/$name" "$src"
  else
    cp "$src" "$BUNDLE/$name"
  fi
done
(cd ptx && find mla -name '*.cubin' -exec cp --parents {} "$BUNDLE/ptx/" \;) 2>/dev/null || true
(cd ptx && find allreduce -name '*.cubin' -exec cp --parents {} "$BUNDLE/ptx/" \;) 2>/dev/null || true
(cd ptx && find ptx_probe -name '*.cubin' -exec cp --parents {} "$BUNDLE/ptx/" \;) 2>/dev/null || true
(cd ptx && find layers -name '*.cubin' -exec cp --parents {} "$BUNDLE/ptx/" \;) 2>/dev/null || true
cp scripts/gpu-check.sh "$BUNDLE/scripts/"
# Outside a checkout the lab's cache provenance reads the commit from here (KIMI_COMMIT).
commit="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
[[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] && commit="$commit-dirty"
echo "$commit" > "$BUNDLE/COMMIT"
cp ptx/manifest.json "$BUNDLE/ptx/"
if [[ "${WITH_PTX:-0}" == 1 ]]; then
  cp -r ptx/moe_gemm "$BUNDLE/ptx/"
else
  (cd ptx && find moe_gemm -name '*.cubin' -exec cp --parents {} "$BUNDLE/ptx/" \;)
fi
mkdir -p "$BUNDLE/golden/data/models"
for model in kimi-kernel-dims kimi-tiny dsv3-noqlora-grouped dsv3-mini-unsharded kimi-chat-tiny; do
  cp -r "golden/data/models/$model" "$BUNDLE/golden/data/models/"
done
for family in moe mla; do
  if [[ -d golden/data/$family ]]; then
    mkdir -p "$BUNDLE/golden/data"
    cp -r "golden/data/$family" "$BUNDLE/golden/data/"
  fi
done
(cd "$BUNDLE" && find . -type f | sort | sed 's/^/  /')
du -sh "$BUNDLE"
max_mib="${BUNDLE_MAX_MIB:-48}"
bytes=$(du -sb "$BUNDLE" | cut -f1)
if (( bytes > max_mib * 1024 * 1024 )); then
  echo "build-gpu-bundle: the bundle is $(( bytes >> 20 )) MiB, over the ${max_mib} MiB it may take \
of the device tool's 64 MiB carry; the largest files:" >&2
  (cd "$BUNDLE" && find . -type f -printf '%s %p\n' | sort -rn | head -5 \
    | awk '{printf "  %6.1f MiB %s\n", $1 / 1048576, $2}') >&2
  exit 1
fi
echo "build-gpu-bundle: run on the GPU machine: cd $(basename "$BUNDLE") && scripts/gpu-check.sh"

#!/usr/bin/env bash
# Compile gates: install the pinned CUDA toolchain (no GPU needed), then build every
# (tactic, SM) of each kernel family and check registers, spills, shared memory and the
# required SASS instructions. `--check` also fails when ptx/manifest.json is stale.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/cuda-toolchain.sh
cargo run --release --quiet -p kernels --bin ptx-gate -- --check "$@"

#!/usr/bin/env bash
# Does `autotune --cpu` speed up `model run` on this machine? Reproduces
# bench/results/cpu-tuning.txt and the caches bench/results/cpu-tactics-*.json:
#   1. builds `model`, `autotune` and the `cpu-tuning` A/B binary (release);
#   2. tunes the CPU kernels, measured, on the embedded kimi-chat-tiny and on the generated
#      `mini` model (`model run`'s default, generated once into ~/.cache/kimi-sm120), one cache
#      each, recording its model;
#   3. runs `model run --ignore-eos` with the default tactic (A) and with `--tactics FILE` (B)
#      in interleaved rounds A B A B …, and writes the medians and spreads.
# Usage: scripts/cpu-tuning.sh [ROUNDS]   (default 5 per side). Takes ~10 minutes on 2 cores.
# CPU_TUNING_CACHES_ONLY=1: steps 1 and 2 only (the caches, without the A/B rounds).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo="$PWD"
rounds="${1:-5}"
target="${CARGO_TARGET_DIR:-target}"
[[ $target == /* ]] || target="$repo/$target"
cargo build --release --locked -p model -p autotune -p bench --bin model --bin autotune --bin cpu-tuning
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The caches record the command that wrote them: run from $work with relative names, so that
# no machine's paths go into the committed files (and the commit, which git cannot see there).
KIMI_COMMIT="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
if [[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
  KIMI_COMMIT+="-dirty"
fi
export KIMI_COMMIT
ln -s "$("$target/release/cpu-tuning" --print-checkpoint tiny)" "$work/kimi-chat-tiny"
"$target/release/cpu-tuning" --print-checkpoint mini >/dev/null
(
  cd "$work"
  "$target/release/autotune" --cpu --checkpoint kimi-chat-tiny --out tiny.json
  # No --checkpoint: the model `model run` runs by default (mini).
  "$target/release/autotune" --cpu --out mini.json \
    --cpu-prompt-len 4 --cpu-decode-tokens 4 --cpu-decode-secs 8
)
if [[ ${CPU_TUNING_CACHES_ONLY:-0} != 1 ]]; then
  "$target/release/cpu-tuning" --only tiny --tactics "$work/tiny.json" --rounds "$rounds" \
    --max-new-tokens 64 --out "$work/tiny.txt"
  "$target/release/cpu-tuning" --only mini --tactics "$work/mini.json" --rounds "$rounds" \
    --max-new-tokens 32 --out "$work/mini.txt"
  cat "$work/tiny.txt" > bench/results/cpu-tuning.txt
  sed '/^# /d' "$work/mini.txt" >> bench/results/cpu-tuning.txt
fi
cp "$work/tiny.json" bench/results/cpu-tactics-kimi-chat-tiny.json
cp "$work/mini.json" bench/results/cpu-tactics-mini.json
[[ ${CPU_TUNING_CACHES_ONLY:-0} == 1 ]] || cat bench/results/cpu-tuning.txt

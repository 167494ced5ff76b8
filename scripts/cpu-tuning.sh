#!/usr/bin/env bash
# Does `autotune --cpu` speed up `model run` on this machine? Reproduces
# bench/results/cpu-tuning.txt:
#   1. builds `model`, `autotune` and the `cpu-tuning` A/B binary (release);
#   2. tunes the CPU kernels, measured, on the embedded kimi-chat-tiny and on the generated
#      `mini` model (generated once into ~/.cache/kimi-sm120 by `model run`), one cache each;
#   3. runs `model run --ignore-eos` with the default tactic (A) and with `--tactics FILE` (B)
#      in interleaved rounds A B A B …, and writes the medians and spreads.
# Usage: scripts/cpu-tuning.sh [ROUNDS]   (default 5 per side). Takes ~10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds="${1:-5}"
target="${CARGO_TARGET_DIR:-target}"
cargo build --release --locked -p model -p autotune -p bench --bin model --bin autotune --bin cpu-tuning
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mini="$("$target/release/cpu-tuning" --print-checkpoint mini)"
"$target/release/autotune" --cpu --out "$work/tiny.json"
"$target/release/autotune" --cpu --checkpoint "$mini" --out "$work/mini.json" \
  --cpu-prompt-len 4 --cpu-decode-tokens 4 --cpu-decode-secs 8
"$target/release/cpu-tuning" --only tiny --tactics "$work/tiny.json" --rounds "$rounds" \
  --max-new-tokens 64 --out "$work/tiny.txt"
"$target/release/cpu-tuning" --only mini --tactics "$work/mini.json" --rounds "$rounds" \
  --max-new-tokens 32 --out "$work/mini.txt"
cat "$work/tiny.txt" > bench/results/cpu-tuning.txt
sed '/^# /d' "$work/mini.txt" >> bench/results/cpu-tuning.txt
cp "$work/tiny.json" bench/results/cpu-tactics-kimi-chat-tiny.json
cp "$work/mini.json" bench/results/cpu-tactics-mini.json
cat bench/results/cpu-tuning.txt

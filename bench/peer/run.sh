#!/usr/bin/env bash
# The peer benchmark against llama.cpp and HF transformers on CPU (not part of CI: building
# llama.cpp takes minutes). Makes bench/peer/work (git-ignored) with a Python environment of
# the pinned versions below, then runs peer_bench.py, which builds llama.cpp from the
# llama-cpp-python sdist, makes, quantizes and converts the model, measures, and writes
# bench/results/peer-llamacpp.{txt,json,svg}.
#
#   bench/peer/run.sh [--rounds N] [--threads N] [--decode-tokens N] [--busy-rounds N] [--no-hf]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$here/work"
venv="$work/venv"
mkdir -p "$work"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# cmake and ninja build llama.cpp; torch, transformers, safetensors and numpy as
# golden/requirements.txt pins them; sentencepiece, pyyaml, tqdm, requests for llama.cpp's
# converter and the gguf-py it vendors (used from the sdist, so it knows NVFP4).
requirements=(
  cmake==4.1.2 ninja==1.13.0
  torch==2.15.0 transformers==5.23.0 safetensors==0.8.0 numpy==2.4.6
  sentencepiece==0.2.3 pyyaml==6.0.4 tqdm==4.70.1 requests==2.34.2
)
stamp="$venv/.requirements"
if [ "$(cat "$stamp" 2>/dev/null)" != "${requirements[*]}" ]; then
  "$venv/bin/pip" install --quiet "${requirements[@]}"
  echo "${requirements[*]}" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
exec "$venv/bin/python" "$here/peer_bench.py" "$@"

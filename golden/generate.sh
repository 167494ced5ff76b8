#!/usr/bin/env bash
# Regenerates every golden file under golden/data from the independent implementations
# (PyTorch, NVIDIA ModelOpt, HF transformers) pinned in requirements.txt.
# Creates golden/.venv on first use. Re-running reproduces the committed bytes exactly;
# `golden/generate.sh --check` regenerates into a temporary folder and compares.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
stamp="$venv/.requirements.sha256"
want="$(cat "$here/requirements.txt" "$here/requirements-data.txt" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/pip" install --quiet -r "$here/requirements.txt"
  "$venv/bin/pip" install --quiet --no-deps -r "$here/requirements-data.txt"
  echo "$want" > "$stamp"
fi
export CUDA_VISIBLE_DEVICES=""   # CPU only: the goldens must not depend on a GPU being present
export PYTHONHASHSEED=0
out="$here/data"
if [ "${1:-}" = "--check" ]; then
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
fi
cd "$here"
for script in gen_*.py; do
  echo "== $script"
  "$venv/bin/python" -W ignore "$script" --out "$out"
done
if [ "${1:-}" = "--check" ]; then
  ( cd "$out" && find . -name '*.safetensors' -o -name '*.json' -o -name '*.model' -o -name '*.jinja' | sort | xargs sha256sum ) > "$out/.sums"
  ( cd "$here/data" && find . -name '*.safetensors' -o -name '*.json' -o -name '*.model' -o -name '*.jinja' | sort | xargs sha256sum ) | diff - "$out/.sums" \
    && echo "golden/data is reproduced byte for byte"
  exit
fi
( cd "$out" && find . -name '*.safetensors' -o -name '*.json' -o -name '*.model' -o -name '*.jinja' | sort | xargs sha256sum > SHA256SUMS )
echo "goldens written to $out"

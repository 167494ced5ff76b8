#!/usr/bin/env bash
# The OpenAI Python client (pinned, from PyPI) against `model serve` on the embedded chat
# model: the seeds' question at temperature 0, plain and streaming, on the CPU server and on
# `--backend cuda-emulated --tp 2`; both must answer "Paris" with a reasoning, and the same
# content. Then a rank of a `--tp 2` server is killed mid-stream: the client must raise (the
# server's error frame), not return a truncated answer. Not in CI (it installs a package).
#
# Usage: scripts/openai-client-check.sh [MODEL_BINARY]   (default target/release/model)
# Env:   OPENAI_VENV  where the client's virtual environment goes (default .openai-venv)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODEL="${1:-target/release/model}"
VENV="${OPENAI_VENV:-$ROOT/.openai-venv}"
[[ -x "$MODEL" ]] || { echo "openai-client-check: no $MODEL (cargo build --release -p model)" >&2; exit 2; }
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "openai==3.63.0"
fi

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# Starts `model serve ARGS…` on a free port in the background; its log goes to $LOG.
start() {
  LOG="$(mktemp)"
  "$MODEL" serve --host 127.0.0.1 --port 0 --served-model-name nvidia/Kimi-K2.5-NVFP4 \
    --max-model-len 512 --max-num-seqs 4 "$@" >"$LOG" 2>&1 &
  PIDS+=("$!")
}

# The base URL of the server logging to $1, once its /health answers 200.
ready() {
  local base=""
  for _ in $(seq 600); do
    base="$(grep -o 'http://[0-9.:]*' "$1" | head -1 || true)"
    if [[ -n "$base" ]] && curl -sf "$base/health" >/dev/null; then
      echo "$base"
      return
    fi
    sleep 0.5
  done
  cat "$1" >&2
  echo "openai-client-check: the server did not become ready" >&2
  exit 1
}

start
CPU_LOG="$LOG"
start --backend cuda-emulated --tensor-parallel-size 2
EMULATED_LOG="$LOG"
start --tp 2 --tp-timeout-secs 30
CPU_TP2_LOG="$LOG"
CPU_TP2_PID="${PIDS[-1]}"
CPU="$(ready "$CPU_LOG")"
EMULATED="$(ready "$EMULATED_LOG")"
CPU_TP2="$(ready "$CPU_TP2_LOG")"

"$VENV/bin/python" - "$CPU" "$EMULATED" "$CPU_TP2" "$CPU_TP2_PID" <<'EOF'
import os, signal, subprocess, sys
import openai

cpu, emulated, cpu_tp2, tp2_pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
model = "nvidia/Kimi-K2.5-NVFP4"

def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none")

def plain(base):
    reply = client(base).chat.completions.create(model=model, messages=question,
                                                 max_tokens=256, temperature=0)
    message = reply.choices[0].message
    return getattr(message, "reasoning", None) or "", message.content or "", reply.choices[0].finish_reason

def streamed(base):
    reasoning, content, finish = "", "", None
    for chunk in client(base).chat.completions.create(model=model, messages=question,
                                                      max_tokens=256, temperature=0, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, finish

results = {}
for name, base in [("cpu", cpu), ("cuda-emulated --tp 2", emulated)]:
    for mode, call in [("plain", plain), ("streaming", streamed)]:
        reasoning, content, finish = call(base)
        print(f"{name:22} {mode:9} finish={finish} content={content!r} reasoning={reasoning[:60]!r}…")
        assert "Paris" in content and reasoning, (name, mode, content, reasoning)
        results[(name, mode)] = (reasoning, content)
assert len(set(results.values())) == 1, "every server and mode gives the CPU server's answer"

# A rank killed mid-stream: the client raises on the server's error frame.
followers = subprocess.run(["pgrep", "-P", str(tp2_pid)], capture_output=True, text=True).stdout.split()
assert len(followers) == 1, followers
stream = client(cpu_tp2).chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Tell me a story."}],
    max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True})
killed = False
try:
    for chunk in stream:
        if not killed and chunk.choices and (chunk.choices[0].delta.content or getattr(chunk.choices[0].delta, "reasoning", None)):
            os.kill(int(followers[0]), signal.SIGKILL)
            killed = True
    raise AssertionError("the stream ended without an error")
except openai.APIError as e:
    assert killed and "rank 1 of 2" in str(e), e
    print(f"killed rank 1 mid-stream: the client raised {type(e).__name__}: {e}")
try:
    client(cpu_tp2).chat.completions.create(model=model, messages=question, max_tokens=8)
    raise AssertionError("a request after the failure was served")
except openai.APIStatusError as e:
    assert e.status_code == 503, e
    print(f"a new request after it: {e.status_code}")
print(f"openai {openai.__version__}: all checks passed")
EOF

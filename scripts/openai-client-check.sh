#!/usr/bin/env bash
# The OpenAI Python client (pinned, from PyPI) against `model serve` on the embedded chat
# model: the seeds' question at temperature 0, plain and streaming, on the CPU server and on
# `--backend cuda-emulated --tp 2`; both must answer "Paris" with a reasoning, and the same
# content. The sampling features through the client's own types, on the CPU server and on the
# emulated device: logprobs and top_logprobs (chat, plain and streamed, and completions),
# frequency and presence penalties, `n`, stop strings, `reasoning_content`, a 400 naming an
# unsupported field. Then a rank of a `--tp 2` server is killed mid-stream: the client must
# raise (the server's error frame), not return a truncated answer. Not in CI (it installs a
# package).
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

def sampling_features(name, base):
    c = client(base)
    # Chat logprobs: one entry per token, each with its top tokens, sorted; greedy draws the top.
    reply = c.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0,
                                      logprobs=True, top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens, (len(entries), reply.usage)
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert e.logprob <= 0 and len(tops) == 3 and tops == sorted(tops, reverse=True), e
        assert abs(tops[0] - e.logprob) < 1e-6 and bytes(e.bytes).decode("utf-8", "replace") == e.token, e
    message = reply.choices[0].message
    assert getattr(message, "reasoning_content", None) == getattr(message, "reasoning", None), message
    # Streamed: every token's logprobs exactly once over the chunks.
    streamed, usage = [], None
    for chunk in c.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0,
                                           logprobs=True, top_logprobs=1, stream=True,
                                           stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in entries], (streamed, entries)
    assert len(streamed) == usage.completion_tokens
    # Completions logprobs: parallel lists, the drawn token in its top dict, running offsets.
    done = c.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == done.usage.completion_tokens
    offset = 0
    for token, logprob, top, at in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert logprob <= 0 and top[token] == logprob and len(top) <= 3 and at == offset, (token, logprob, top, at)
        offset += len(token)
    # Penalties at temperature 0 change a repetitive greedy answer.
    loop = [{"role": "user", "content": "Repeat the word hello forever: hello hello hello hello"}]
    def answer(**kw):
        r = c.chat.completions.create(model=model, messages=loop, max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True}, **kw)
        return (getattr(r.choices[0].message, "reasoning", None) or "") + (r.choices[0].message.content or "")
    greedy, penalized = answer(), answer(frequency_penalty=2.0, presence_penalty=2.0)
    assert greedy != penalized, greedy
    # n choices; a stop string cuts the text before it.
    many = c.chat.completions.create(model=model, messages=question, max_tokens=8, n=3, temperature=0.8, seed=3)
    assert [ch.index for ch in many.choices] == [0, 1, 2], many
    full = c.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = c.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0,
                               stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop", (full, stop, cut)
    # A field the server does not honour is a 400 naming it.
    try:
        c.chat.completions.create(model=model, messages=question, max_tokens=4,
                                  response_format={"type": "json_object"})
        raise AssertionError("response_format json_object was served")
    except openai.BadRequestError as e:
        assert e.body.get("param") == "response_format", e.body
    print(f"{name:22} sampling: logprobs, penalties, n, stop, reasoning_content, 400s: ok")

for name, base in [("cpu", cpu), ("cuda-emulated --tp 2", emulated)]:
    sampling_features(name, base)

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

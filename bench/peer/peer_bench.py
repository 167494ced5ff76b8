"""Peer benchmark: our CPU engine against llama.cpp and HF transformers on the same model.

Run by bench/peer/run.sh (which makes the Python environment); every step works inside the
git-ignored folder bench/peer/work and is skipped when its output is already there.

1. builds llama.cpp's llama-bench and llama-batched-bench from the llama.cpp that the pinned
   llama-cpp-python sdist vendors (CPU only, GGML_NATIVE);
2. makes a random BF16 DeepSeek-V3 model with the `mini` preset's dimensions (peer_model.py);
3. quantizes its routed experts to NVFP4 with our `model quantize`;
4. converts that checkpoint to GGUF with llama.cpp's converter, which repacks the ModelOpt
   NVFP4 expert bytes as they are (convert_gguf.py: synthetic vocabulary);
5. measures in interleaved rounds, the order of the three engines rotating every round:
   prefill of a 128- and a 512-token prompt (batch 1), decode at batch 1 and 4 after a
   128-token prompt; ours via `model run --ignore-eos`, llama.cpp via `llama-bench` (batch 1)
   and `llama-batched-bench` (batch 4), HF transformers float32 via `peer_model.py hf`;
6. measures the machine's read bandwidth (bench's `peer-llamacpp bandwidth`: the best of
   passes summing a 512 MiB buffer on every thread, on 4 KiB and on 2 MiB pages, the better
   of the two; and the mean over a second of such passes, the bandwidth sustained), before
   and after every batch-1 decode, and decode at batch 1 with one competing busy process;
7. writes bench/results/peer-llamacpp.{txt,json} and the chart peer-llamacpp.svg (plotters,
   `peer-llamacpp chart`).

Figures are medians of the rounds, all measured in this run.
"""

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the first sdist checked whose llama.cpp converts ModelOpt NVFP4
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORK = HERE / "work"
RESULTS = REPO / "bench" / "results"
PY = sys.executable

PREFILL_LENS = (128, 512)
DECODE_PROMPT = 128
DECODE_BATCHES = (1, 4)
ENGINES = ("ours", "llama.cpp", "hf")


def log(msg):
    print(f"[peer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd, env=None, cwd=None, capture=True, nice=False, merge_stderr=False):
    cmd = [str(c) for c in cmd]
    if nice:
        cmd = ["nice", "-n", "10"] + cmd
    stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
    p = subprocess.run(cmd, env=env, cwd=cwd, text=True,
                       stdout=subprocess.PIPE if capture else None,
                       stderr=stderr if capture else None)
    if p.returncode != 0:
        tail = (p.stderr or "")[-4000:] + (p.stdout or "")[-2000:]
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{tail}")
    return p.stdout or ""


def load_average():
    return Path("/proc/loadavg").read_text().split()[:3]


# ------------------------------------------------------------------ setup
def llama_cpp_dir():
    return WORK / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


# llama.cpp built for one instruction set instead of the native one: GGML_NATIVE off, the
# x86 feature options named (ggml's CPU backend takes them at build time only).
LLAMA_ISA_FLAGS = {
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF",
             "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
             "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
             "-DGGML_AMX_BF16=OFF"],
}


def build_llama_cpp(threads, isa=None):
    src = llama_cpp_dir()
    if not src.is_dir():
        WORK.mkdir(parents=True, exist_ok=True)
        log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist")
        run([PY, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
             "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", WORK])
        with tarfile.open(WORK / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as t:
            t.extractall(WORK, filter="data")
    build = WORK / ("build-llama" if isa is None else f"build-llama-{isa}")
    bins = [build / "bin" / "llama-bench", build / "bin" / "llama-batched-bench"]
    if all(b.exists() for b in bins):
        return bins
    isa_flags = ["-DGGML_NATIVE=ON"] if isa is None else LLAMA_ISA_FLAGS[isa]
    log(f"building llama-bench and llama-batched-bench (CPU only, {isa or 'GGML_NATIVE'}; minutes)")
    run(["cmake", "-S", src, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
         *isa_flags, "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",
         "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
         "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_HTML=OFF",
         "-DBUILD_SHARED_LIBS=OFF"], nice=True)
    run(["ninja", "-C", build, f"-j{threads}", "llama-bench", "llama-batched-bench"], nice=True)
    return bins


def build_ours():
    log("building our `model` binary and the bench's `peer-llamacpp` (release)")
    run(["cargo", "build", "--release", "--locked", "-p", "model", "--bin", "model",
         "-p", "bench", "--bin", "peer-llamacpp"], cwd=REPO, nice=True, capture=False)
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release"
    return target / "model", target / "peer-llamacpp"


def make_models(model_bin):
    bf16, nvfp4, gguf = WORK / "mini-bf16", WORK / "mini-nvfp4", WORK / "mini-nvfp4.gguf"
    if not (bf16 / "config.json").exists():
        log("making the random BF16 model (mini dimensions)")
        run([PY, HERE / "peer_model.py", "make", "--out", bf16])
    if not (nvfp4 / "hf_quant_config.json").exists():
        log("quantizing its routed experts to NVFP4 with `model quantize`")
        run([model_bin, "quantize", "--input", bf16, "--output", nvfp4, "--force"])
    if not gguf.exists():
        log("converting our NVFP4 checkpoint to GGUF with llama.cpp's converter")
        tmp = gguf.with_suffix(".tmp")
        run([PY, HERE / "convert_gguf.py", llama_cpp_dir(), nvfp4, tmp])
        tmp.rename(gguf)
    return bf16, nvfp4, gguf


# ------------------------------------------------------------------ one measurement each
def ours(model_bin, nvfp4, threads, prompt, batch, new_tokens, isa=None):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    if isa:
        # The CPU kernels' dispatch, forced (kimi's `KIMI_CPU_ISA`); unset, the best one.
        env["KIMI_CPU_ISA"] = isa
    out = run([model_bin, "run", "--checkpoint", nvfp4, "--prompt-len", prompt,
               "--batch", batch, "--max-new-tokens", new_tokens, "--ignore-eos",
               # A 16-bit latent cache, like llama.cpp's default F16 KV cache.
               "--kv-dtype", "bf16",
               # One untimed run first, as llama-bench warms up before it measures.
               "--warmup"], env=env)
    pre = re.search(r"^prefill: .* = ([0-9.]+) tok/s", out, re.M)
    dec = re.search(r"^decode: .* = ([0-9.]+) tok/s", out, re.M)
    if not pre or not dec:
        raise SystemExit(f"`model run` printed no prefill/decode rate:\n{out[-2000:]}")
    return float(pre.group(1)), float(dec.group(1))


def llama_bench(bench_bin, gguf, threads, prompt=0, gen=0, depth=0):
    out = run([bench_bin, "-m", gguf, "-t", threads, "-p", prompt, "-n", gen, "-d", depth,
               "-r", 1, "-o", "json"])
    rows = json.loads(out)
    if len(rows) != 1:
        raise SystemExit(f"llama-bench gave {len(rows)} rows, expected 1")
    return float(rows[0]["avg_ts"]), rows[0]


def llama_batched(batched_bin, gguf, threads, prompt, gen, batch):
    ctx = batch * (prompt + gen) + 16
    out = run([batched_bin, "-m", gguf, "-t", threads, "-tb", threads, "-c", ctx,
               "-b", 2048, "-ub", 512, "-npp", prompt, "-ntg", gen, "-npl", batch,
               "--output-format", "jsonl"], merge_stderr=True)
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    if len(rows) != 1:
        raise SystemExit(f"llama-batched-bench gave {len(rows)} rows:\n{out[-2000:]}")
    return float(rows[0]["speed_tg"])


def hf(bf16, threads, prompt, batch, decode):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="")
    out = run([PY, "-W", "ignore", HERE / "peer_model.py", "hf", "--model", bf16,
               "--prompt", prompt, "--batch", batch, "--decode", decode,
               "--threads", threads], env=env)
    return json.loads(out.strip().splitlines()[-1])


class Busy:
    """One competing process spinning on a core for the length of a `with` block."""

    def __enter__(self):
        self.p = subprocess.Popen([PY, "-c", "while True: pass"])
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.p.kill()
        self.p.wait()


# ------------------------------------------------------------------ the run
def main():
    ap = argparse.ArgumentParser(description="ours vs llama.cpp vs HF transformers, CPU")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--busy-rounds", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers column")
    ap.add_argument("--also-isa", action="append", default=[], choices=["avx2"],
                    help="two more columns: ours with the CPU kernels' dispatch forced to this "
                         "ISA, and llama.cpp built for it (GGML_NATIVE off)")
    ap.add_argument("--build-only", action="store_true",
                    help="build llama.cpp (and its --also-isa builds) and ours, then stop")
    ap.add_argument("--out", type=Path, default=RESULTS / "peer-llamacpp")
    a = ap.parse_args()
    t = a.threads
    n = a.decode_tokens

    bench_bin, batched_bin = build_llama_cpp(t)
    llama_isa_bins = {isa: build_llama_cpp(t, isa) for isa in a.also_isa}
    model_bin, peer_bin = build_ours()
    if a.build_only:
        return
    bf16, nvfp4, gguf = make_models(model_bin)

    rows = [f"prefill-{p}" for p in PREFILL_LENS] + [f"decode-b{b}" for b in DECODE_BATCHES]
    samples = {r: {e: [] for e in ENGINES} for r in rows}
    loads = [load_average()]
    llama_info = None
    forced = [f"{e}-{i}" for i in a.also_isa for e in ("ours", "llama.cpp")]
    engines = [e for e in ENGINES if not (a.no_hf and e == "hf")] + forced
    for d in samples.values():
        d.update({e: [] for e in forced})
    bandwidths = []

    def measure(engine, row):
        nonlocal llama_info
        kind, arg = row.split("-")
        isa = engine.split("-", 1)[1] if "-" in engine else None
        bench_b, batched_b = llama_isa_bins[isa] if isa else (bench_bin, batched_bin)
        if kind == "prefill":
            p = int(arg)
            if engine.startswith("ours"):
                return ours(model_bin, nvfp4, t, p, 1, 1, isa)[0]
            if engine.startswith("llama.cpp"):
                ts, info = llama_bench(bench_b, gguf, t, prompt=p)
                llama_info = llama_info or info
                return ts
            return hf(bf16, t, p, 1, 0)["prefill_tok_s"]
        b = int(arg[1:])
        if engine.startswith("ours"):
            return ours(model_bin, nvfp4, t, DECODE_PROMPT, b, n + 1, isa)[1]
        if engine.startswith("llama.cpp"):
            if b == 1:
                return llama_bench(bench_b, gguf, t, gen=n, depth=DECODE_PROMPT)[0]
            return llama_batched(batched_b, gguf, t, DECODE_PROMPT, n, b)
        return hf(bf16, t, DECODE_PROMPT, b, n)["decode_tok_s"]

    # Each batch-1 decode beside the read bandwidth measured just before and just after it
    # (their mean): on a VM whose bandwidth drifts (38-83 GB/s within minutes on a shared
    # host), the best round's figure and a decode measured at another moment can be far apart.
    paired = {}

    def read_bandwidth():
        return json.loads(run([peer_bin, "bandwidth"]).strip().splitlines()[-1])

    for r in range(a.rounds):
        # Rotating the order spreads drift in the machine's load over all three engines.
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        for row in rows:
            for e in order:
                before = read_bandwidth() if row == "decode-b1" and e != "hf" else None
                v = measure(e, row)
                samples[row][e].append(v)
                if before:
                    after = read_bandwidth()
                    best = (before["read_gb_s"], after["read_gb_s"])
                    sustained = (before["read_sustained_gb_s"], after["read_sustained_gb_s"])
                    paired.setdefault(e, []).append({
                        "tok_s": v, "read_gb_s": sum(best) / 2,
                        "read_gb_s_before": best[0], "read_gb_s_after": best[1],
                        "read_sustained_gb_s": sum(sustained) / 2,
                        "read_sustained_gb_s_before": sustained[0],
                        "read_sustained_gb_s_after": sustained[1]})
                log(f"round {r + 1}/{a.rounds} {row:<12} {e:<9} {v:8.1f} tok/s")
        # The bandwidth in every round, beside the engines: the best is the machine's.
        bandwidths.append(json.loads(run([peer_bin, "bandwidth"]).strip().splitlines()[-1]))
        log(f"round {r + 1}/{a.rounds} read bandwidth {bandwidths[-1]['read_gb_s']:.1f} GB/s")
        loads.append(load_average())

    bw = max(bandwidths, key=lambda b: b["read_gb_s"])
    step = json.loads(run([PY, HERE / "peer_model.py", "step-bytes", "--model", nvfp4]))

    busy = {"ours": [], "llama.cpp": []}
    quiet = {"ours": [], "llama.cpp": []}
    for r in range(a.busy_rounds):
        for e in busy:
            quiet[e].append(measure(e, "decode-b1"))
            with Busy():
                busy[e].append(measure(e, "decode-b1"))
            log(f"busy round {r + 1}: {e} quiet {quiet[e][-1]:.1f} busy {busy[e][-1]:.1f}")
    loads.append(load_average())

    med = {row: {e: statistics.median(v) for e, v in d.items() if v} for row, d in samples.items()}
    data = {
        "cpu": cpu_model(),
        "isa": isa(),
        "threads": t,
        "rounds": a.rounds,
        "decode_tokens": n,
        "decode_prompt": DECODE_PROMPT,
        "versions": versions(model_bin, llama_info),
        "load_average": loads,
        "samples": samples,
        "median": med,
        "read_bandwidth_gb_s": bw["read_gb_s"],
        "read_bandwidth_samples": [b["read_gb_s"] for b in bandwidths],
        "read_bandwidth_4k_pages_samples": [b.get("read_4k_pages_gb_s") for b in bandwidths],
        "read_bandwidth_2m_pages_samples": [b.get("read_2m_pages_gb_s") for b in bandwidths],
        "copy_bandwidth_gb_s": bw["copy_gb_s"],
        "decode_step_bytes": step["step_bytes"],
        "decode_b1_beside_bandwidth": paired,
        "sustained_window_ms": bandwidths[-1].get("sustained_window_ms"),
        "checkpoint_bytes": {k: step[k] for k in ("dense_bytes", "routed_expert_bytes",
                                                  "embedding_bytes")},
        "gguf_bytes": gguf.stat().st_size,
        "busy": {e: {"quiet": statistics.median(quiet[e]), "busy": statistics.median(busy[e]),
                     "quiet_samples": quiet[e], "busy_samples": busy[e]} for e in busy},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    json_path = a.out.with_suffix(".json")
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    txt = table(data)
    a.out.with_suffix(".txt").write_text(txt)
    print(txt)
    run([peer_bin, "chart", "--json", json_path, "--out", a.out.with_suffix(".svg")],
        capture=False)


def cpu_model():
    """The model name with the CPUID family and model: a hypervisor may show only "AMD EPYC",
    and Zen 3, 4 and 5 differ in what pays (family 19h is Zen 3 and 4, 1Ah Zen 5)."""
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line.strip():
            break
    name = fields.get("model name") or platform.processor()
    family, model = fields.get("cpu family"), fields.get("model")
    if family and model and family.isdigit() and model.isdigit():
        name += f" (family {int(family):x}h, model {int(model):x}h)"
    return name


def isa():
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    named = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16"]
    return " ".join(f for f in named if f in flags)


def versions(model_bin, llama_info):
    import torch
    import transformers
    rust = run(["rustc", "--version"]).strip()
    commit = run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO).strip()
    info = llama_info or {}
    return {
        "ours": f"kimi-sm120 {commit} ({rust})",
        "llama.cpp": f"vendored by llama-cpp-python {LLAMA_CPP_PYTHON} sdist "
                     f"(build {info.get('build_number', '?')}, {info.get('build_commit', '?')}), "
                     f"backend {info.get('backends', '?')}",
        "hf": f"transformers {transformers.__version__}, torch {torch.__version__}, float32",
    }


def table(d):
    med, busy = d["median"], d["busy"]
    out = []
    w = out.append
    w("Peer benchmark: ours vs llama.cpp vs HF transformers, CPU, the same random model")
    w("(DeepSeek-V3 architecture, `mini` dimensions: 6 layers, hidden 1024, 64 routed experts")
    w(" top-8 in NVFP4, the rest BF16; llama.cpp runs the GGUF its converter made from our")
    w(" NVFP4 checkpoint, NVFP4 expert bytes repacked as they are; HF runs the BF16 weights in")
    w(" float32). `bench/peer/run.sh` wrote this file: every figure is MEASURED in this run.")
    w("")
    w(f"date: {d['date']}")
    w(f"cpu: {d['cpu']}; threads: {d['threads']} (every engine)")
    w(f"isa: {d['isa']}")
    for e, v in d["versions"].items():
        w(f"{e}: {v}")
    la = ", ".join("/".join(l) for l in d["load_average"])
    w(f"load average (1/5/15 min) at the start, after each round, at the end: {la}")
    if max(float(l[0]) for l in d["load_average"]) > d["threads"] + 0.5:
        w("SHARED MACHINE: other work ran on these cores during the run (1-minute load above")
        w("the thread count at some point): absolute figures are noisy, the ratios are the point.")
    w("")
    w(f"median of {d['rounds']} interleaved rounds, tok/s (engine order rotated each round);")
    w(f"prefill: one prompt of that many random tokens, batch 1; decode: {d['decode_tokens']} new")
    w(f"tokens per sequence after a {d['decode_prompt']}-token prompt, batch 1 or 4 (tok/s over")
    w("all sequences); llama.cpp: llama-bench -p N (prefill), -n N -d 128 (decode b1),")
    w("llama-batched-bench -npp 128 -ntg N -npl 4, S_TG (decode b4).")
    w("")
    isas = sorted({e.split("-", 1)[1] for m in med.values() for e in m if "-" in e})
    forced = [f"ours-{i}" for i in isas]
    head = f"{'row':<12} {'ours':>9} {'llama.cpp':>10} {'HF fp32':>9} {'ours/llama':>11} {'ours/HF':>8}"
    for i in isas:
        head += f" {'ours-' + i:>10} {'llama.cpp-' + i:>15} {'ratio':>6}"
    w(head)
    for row, m in med.items():
        o, l, h = m.get("ours"), m.get("llama.cpp"), m.get("hf")
        line = f"{row:<12} {fmt(o):>9} {fmt(l):>10} {fmt(h):>9} {ratio(o, l):>11} {ratio(o, h):>8}"
        for i in isas:
            oi, li = m.get(f"ours-{i}"), m.get(f"llama.cpp-{i}")
            line += f" {fmt(oi):>10} {fmt(li):>15} {ratio(oi, li):>6}"
        w(line)
    for i in isas:
        w(f"ours-{i}: our binary with the CPU kernels' dispatch forced (KIMI_CPU_ISA={i});")
        w(f"llama.cpp-{i}: llama.cpp built for {i} only (GGML_NATIVE off); ratio: ours-{i} / llama.cpp-{i}.")
    w("")
    w("every round, tok/s:")
    for row, s in d["samples"].items():
        w(f"  {row:<12} " + "; ".join(f"{e} " + " ".join(f"{v:.1f}" for v in vs)
                                       for e, vs in s.items() if vs))
    w("")
    bw = d["read_bandwidth_gb_s"]
    step = d["decode_step_bytes"]
    samples = ", ".join(f"{v:.1f}" for v in d.get("read_bandwidth_samples", [bw]))
    w(f"read bandwidth: {bw:.1f} GB/s (copy {d['copy_bandwidth_gb_s']:.1f} GB/s): the best of the")
    w(f"rounds ({samples}), each the best of passes summing a 512 MiB buffer on every thread,")
    small = ", ".join(f"{v:.1f}" for v in d.get("read_bandwidth_4k_pages_samples", []) if v)
    huge = ", ".join(f"{v:.1f}" for v in d.get("read_bandwidth_2m_pages_samples", []) if v)
    w(f"the better of 4 KiB pages ({small}) and 2 MiB pages ({huge}). Our `model run` reads its")
    w("weights from a copy on 2 MiB pages (`--weights auto`); llama.cpp from its mmap (4 KiB).")
    w(f"bytes one batch-1 decode step reads: {step / 1e6:.1f} MB (computed from our checkpoint's")
    w("tensor sizes: every weight but the embedding, one embedding row, 8 of the 64 routed")
    w("experts per MoE layer; the latent cache is a few hundred KB and is left out).")
    for e in ["ours", "llama.cpp"] + [f"{e}-{i}" for i in isas for e in ("ours", "llama.cpp")]:
        tok = med["decode-b1"].get(e)
        if tok:
            gbs = tok * step / 1e9
            w(f"  {e:<9} decode b1 {tok:.1f} tok/s x {step / 1e6:.1f} MB = {gbs:.1f} GB/s = "
              f"{gbs / bw:.2f} of the read bandwidth (goal >= 0.8)")
    paired = d.get("decode_b1_beside_bandwidth", {})
    if paired:
        w("each decode b1 run against the mean of the read bandwidth measured just before and just")
        w("after it (the machine's bandwidth drifts; the figures above divide the median run by the")
        w("best round):")
        for e, runs in paired.items():
            shares = [p["tok_s"] * step / 1e9 / p["read_gb_s"] for p in runs]
            each = ", ".join(f"{p['tok_s'] * step / 1e9:.1f}/{p['read_gb_s']:.1f}" for p in runs)
            w(f"  {e:<9} median {statistics.median(shares):.2f} (GB/s read/bandwidth: {each})")
        sustained = {e: runs for e, runs in paired.items()
                     if all("read_sustained_gb_s" in p for p in runs)}
        if sustained:
            window = d.get("sustained_window_ms", 1000)
            w("the same runs against the read bandwidth sustained just before and just after each")
            w(f"(their mean; each {window} ms of back-to-back passes summing a 512 MiB buffer on 2 MiB")
            w("pages on every thread, all bytes over all time: the best pass above catches the host's")
            w("short fast stretches, which a fifth-of-a-second decode mostly misses):")
            for e, runs in sustained.items():
                shares = [p["tok_s"] * step / 1e9 / p["read_sustained_gb_s"] for p in runs]
                each = ", ".join(f"{p['tok_s'] * step / 1e9:.1f}/{p['read_sustained_gb_s']:.1f}"
                                 for p in runs)
                w(f"  {e:<9} median {statistics.median(shares):.2f} (GB/s read/sustained: {each})")
    w("")
    w("decode b1 with one competing busy process (a Python loop on one core), medians:")
    for e, v in busy.items():
        w(f"  {e:<9} quiet {v['quiet']:.1f} tok/s, busy {v['busy']:.1f} tok/s, "
          f"busy/quiet {v['busy'] / v['quiet']:.2f}")
    return "\n".join(out) + "\n"


def fmt(v):
    return "-" if v is None else f"{v:.1f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}"


if __name__ == "__main__":
    main()

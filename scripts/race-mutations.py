#!/usr/bin/env python3
"""Hand-made races: removes one barrier of a CUDA source at a time and asks each tool whether
it notices, for the table in kernels-rs/cuda-host/MUTATIONS.md.

Tools:
  host        the host-executed golden test as CI runs it (threads in index order)
  shuffled    the same test with the threads and blocks of every launch in a seeded random
              order at every barrier and collective (CUDA_HOST_SCHEDULE=shuffled:SEED)
  tsan        the same test in the ThreadSanitizer build (scripts/tsan-host.sh): CUDA threads
              ordered only by barriers and collectives, any order of execution

Usage: scripts/race-mutations.py [--only SUBSTRING] [--tools host,shuffled,tsan] [--out FILE]
Restores every source afterwards, whatever happens. The first TSan build takes ~10 minutes
(target/tsan); each mutation then recompiles one family and relinks the test (~1 minute).
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = "kernels-rs/src/layers/layers.cu"
MOE = "kernels-rs/src/moe_gemm/moe_gemm.cu"
MLA = "kernels-rs/src/mla/mla_decode.cu"

# (file, original text, mutated text, what the barrier ordered, test, tactic filter)
MUTATIONS = [
    (LAYERS, "  v = warp_sum(v);\n  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n"
     "  if (lane == 0) scratch[warp] = v;\n  __syncthreads();",
     "  v = warp_sum(v);\n  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n"
     "  if (lane == 0) scratch[warp] = v;",
     "block_sum: the barrier between the warps' partial sums and their reading "
     "(read after write)", "host_layers", ""),
    (LAYERS, "  __syncthreads();  // scratch is reused by the next reduction",
     "",
     "(equivalent while add_rms_norm, which reduces once, is its only caller) block_sum: the "
     "barrier before the scratch is reused by the next reduction (write after read)",
     "host_layers", ""),
    (MOE, "    quantize_act_stage(xs(kt % STAGES), act, a_gs);\n    __syncthreads();",
     "    quantize_act_stage(xs(kt % STAGES), act, a_gs);",
     "moe_gate_up: the barrier between quantizing the activation stage and the MMAs reading it",
     "host_moe", "n128_m16_k256_w4_s2"),
    (MLA, "    __syncthreads();  // the stage, scores and P are overwritten next iteration",
     "",
     "mla_decode: the barrier before the next tile overwrites the stage, scores and P "
     "(write after read)", "host_mla", "bf16_h16_t32_w4_s2"),
]

SEED = "7"


def run(tool: str, test: str, tactic: str) -> tuple[bool, str, float]:
    """(failed?, the failure's first line, seconds)."""
    start = time.time()
    env = dict(os.environ, HOST_TACTICS=tactic)
    filt = ["every_mla_tactic_matches_the_goldens_on_the_host"] if test == "host_mla" else []
    if tool == "tsan":
        cmd = ["scripts/tsan-host.sh", "--test", test] + filt
    else:
        cmd = ["cargo", "test", "--locked", "-p", "project-tests", "--test", test, "--",
               "--test-threads", "1"] + filt
        if tool == "shuffled":
            env["CUDA_HOST_SCHEDULE"] = "shuffled:" + SEED
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    lines = (p.stdout + p.stderr).splitlines()
    evidence = next((l.strip() for l in lines if "WARNING: ThreadSanitizer" in l), "")
    if evidence:
        # The first frame in a kernel source says where.
        frame = next((l.strip() for l in lines if ".cu:" in l), "")
        evidence = f"{evidence} {frame}"
    if not evidence:
        evidence = next((l.strip() for l in lines if l.startswith("FAIL ")), "")
    if not evidence:
        evidence = next((l.strip() for l in lines if "panicked" in l or "error" in l), "")
    return p.returncode != 0, evidence[:220], time.time() - start


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--tools", default="host,shuffled,tsan")
    ap.add_argument("--out")
    args = ap.parse_args()
    tools = args.tools.split(",")
    rows = ["| source | removed barrier | test | " + " | ".join(tools) + " | first report |",
            "|---|---|---|" + "---|" * len(tools) + "---|"]
    for path, old, new, what, test, tactic in MUTATIONS:
        if args.only not in what:
            continue
        f = ROOT / path
        original = f.read_text()
        if original.count(old) != 1:
            print(f"{path}: the text to remove for '{what}' occurs {original.count(old)} times",
                  file=sys.stderr)
            return 2
        results = []
        try:
            f.write_text(original.replace(old, new))
            for tool in tools:
                results.append(run(tool, test, tactic))
        finally:
            f.write_text(original)
        first = next((e for failed, e, _ in results if failed and e), "")
        cells = " | ".join(
            f"{'yes' if failed else '**no**'} ({secs:.0f} s)" for failed, _, secs in results)
        rows.append(f"| `{Path(path).name}` | {what} | `{test}` {tactic} | {cells} | "
                    f"{first.replace('|', '/')} |")
        print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

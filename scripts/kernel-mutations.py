#!/usr/bin/env python3
"""Mutation check of the CUDA sources: applies one-character-class mutations (an index off by
one, a mask, a loop bound, a comparison) to moe_gemm.cu and mla_decode.cu, one at a time, and
runs the host-executed golden tests (`tests/tests/host_moe.rs`, `host_mla.rs`) on a few
tactics that execute the mutated line. A mutation is caught when the test fails (or the
kernels no longer build). Restores every source afterwards, whatever happens.

Usage: scripts/kernel-mutations.py [--only SUBSTRING] [--out FILE]
Writes a Markdown table (default: stdout); exits 1 when a mutation that is not marked
equivalent survives. Takes 10-40 s per mutation on two cores (the mutated family is
recompiled for the CPU; objects of the others are cached). The last run's table is
kernels-rs/cuda-host/MUTATIONS.md.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOE = "kernels-rs/src/moe_gemm/moe_gemm.cu"
MLA = "kernels-rs/src/mla/mla_decode.cu"

# A mutation that cannot change the result on any input the tests can build: listed to show
# where the tests cannot tell, not expected to be caught.
EQUIVALENT = "(equivalent) "

# (file, original text, mutated text, what it breaks, test, tactic filter)
MUTATIONS = [
    (MOE, "const int row = g + 8 * (r / 2), col = 2 * t + (r % 2);",
     "const int row = g + 1 + 8 * (r / 2), col = 2 * t + (r % 2);",
     "accumulator fragment row + 1 (acc_coord)", "host_moe", "n128_m16_k256_w4_s2"),
    (MOE, "const int sa_row = (t & 1) ? ra1 : ra0;",
     "const int sa_row = (t & 2) ? ra1 : ra0;",
     "scale-lane mask of the FP4 MMA (t & 1 → t & 2)", "host_moe", "native_n128_m16_k256_w4_s2"),
    (MOE, "    if (m0 + m >= count) continue;\n    float v[16];",
     "    if (m0 + m > count) continue;\n    float v[16];",
     "gate_up epilogue token bound (>= → >)", "host_moe", "n128_m8_k256_w4_s2"),
    (MOE, "      const bool valid = m0 + m < count;\n      const int tok",
     "      const bool valid = m0 + m <= count;\n      const int tok",
     "gate_up activation load bound (< → <=)", "host_moe", "n128_m8_k256_w4_s2"),
    (MOE, "return ((size_t(rt) * padded_cols4 + col4) * 32 + (r % 32)) * 16 + (r / 32) * 4;",
     "return ((size_t(rt) * padded_cols4 + col4) * 32 + (r % 32)) * 16 + (r / 32) * 8;",
     "128x4 scale swizzle stride (4 → 8)", "host_moe", "n128_m16_k256_w4_s2"),
    (MOE, "      const int byte = kk * 32 + s * 8 + t;",
     "      const int byte = kk * 32 + s * 8 + t + 1;",
     "portable fragment byte + 1", "host_moe", "portable_n128_m16_k256_w4_s2"),
    (MOE, "  for (int kt = 0; kt < k_tiles; ++kt) {\n    cp_async_wait<STAGES - 2>();\n    __syncthreads();\n    const int next = kt + STAGES - 1;\n    if (next < k_tiles) load_stage(next % STAGES, k_begin",
     "  for (int kt = 0; kt < k_tiles - 1; ++kt) {\n    cp_async_wait<STAGES - 2>();\n    __syncthreads();\n    const int next = kt + STAGES - 1;\n    if (next < k_tiles) load_stage(next % STAGES, k_begin",
     "moe_down K loop bound (one tile short)", "host_moe", "n128_m16_k256_w4_s2"),
    (MOE, "  for (int kt = 0; kt < k_tiles; ++kt) {\n    cp_async_wait<STAGES - 2>();\n    __syncthreads();\n    const int next = kt + STAGES - 1;\n    if (next < k_tiles) load_stage(next % STAGES, next * TK);",
     "  for (int kt = 0; kt < k_tiles; ++kt) {\n    cp_async_wait<STAGES - 1>();\n    __syncthreads();\n    const int next = kt + STAGES - 1;\n    if (next < k_tiles) load_stage(next % STAGES, next * TK);",
     "gate_up waits for one cp.async group too few (a race that often passes on a GPU)",
     "host_moe", "n128_m16_k256_w4_s2"),
    (MLA, "    cp_async_wait<STAGES - 1>();", "    cp_async_wait<STAGES>();",
     "decode waits for one cp.async group too few", "host_mla", "h16_t32_w4_s2"),
    (MLA, "const int b_row = nt * 8 + (lane & 7), b_col = 8 * (lane >> 3);",
     "const int b_row = nt * 8 + (lane & 3), b_col = 8 * (lane >> 3);",
     "ldmatrix B row mask (lane & 7 → lane & 3)", "host_mla", "h16_t32_w4_s2"),
    (MLA, "t0 + col < end ? acc[i] * args.softmax_scale : -INFINITY;",
     "t0 + col <= end ? acc[i] * args.softmax_scale : -INFINITY;",
     "score mask past the sequence end (< → <=)", "host_mla", "bf16_h16_t32_w4_s2"),
    (MLA, "  if constexpr (!FP8) return base + n * 8 + j;",
     "  if constexpr (!FP8) return base + n * 8 + j + 1;",
     "output column + 1 (out_col, BF16)", "host_mla", "bf16_h16_t32_w4_s2"),
    (MLA, "const int slot = valid ? table[pos / PAGE] * PAGE + pos % PAGE : 0;\n    if constexpr (!FP8) {",
     "const int slot = valid ? table[pos / PAGE] * PAGE + (pos + 1) % PAGE : 0;\n    if constexpr (!FP8) {",
     "cache slot of a token (pos → pos + 1 in the page)", "host_mla", "fp8_h16_t32_w4_s2"),
    (MLA, "  for (int s = 0; s < splits; ++s) m = fmaxf(m, pl[s]);",
     "  for (int s = 0; s < splits - 1; ++s) m = fmaxf(m, pl[s]);",
     EQUIVALENT + "combine: max over all but the last split (the max only shifts the "
     "log-sum-exp: it matters only when exp would overflow)", "host_mla", "bf16_h16_t32_w4_s2"),
    (MLA, "  for (int s = 0; s < splits; ++s) total += pl[s] == -INFINITY ? 0.f : __expf(pl[s] - m);",
     "  for (int s = 0; s < splits - 1; ++s) total += pl[s] == -INFINITY ? 0.f : __expf(pl[s] - m);",
     "combine: normalizer over all but the last split", "host_mla", "bf16_h16_t32_w4_s2"),
    (MLA, "    const float k0 = kscale[nt * 8 + 2 * c], k1 = kscale[nt * 8 + 2 * c + 1];",
     "    const float k0 = kscale[nt * 8 + 2 * c], k1 = kscale[nt * 8 + 2 * c];",
     "FP8 token scale of the odd score column", "host_mla", "fp8_h16_t32_w4_s2"),
    (MLA, "  const int chunk = (per_split + TILE - 1) / TILE * TILE;",
     "  const int chunk = (per_split + TILE - 2) / TILE * TILE;",
     "split chunk rounding (ceil → one short)", "host_mla", "bf16_h16_t32_w4_s2"),
]


def run_test(test: str, tactic: str) -> tuple[bool, str, float]:
    """(failed?, the failure's first lines, seconds)."""
    start = time.time()
    cmd = ["cargo", "test", "--locked", "-p", "project-tests", "--test", test, "--",
           "--test-threads", "1"]
    if test == "host_mla":
        cmd += ["every_mla_tactic_matches_the_goldens_on_the_host"]
    env = dict(**__import__("os").environ, HOST_TACTICS=tactic)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    out = p.stdout + p.stderr
    lines = out.splitlines()
    # The first golden comparison that failed, else the first failure the test listed (a
    # launch error: a fault, a bad launch), else the build error.
    evidence = next((l.strip() for l in lines if l.startswith("FAIL ")), "")
    if not evidence:
        after = [l for i, l in enumerate(lines) if i > 0 and "failures:" in lines[i - 1]]
        evidence = next((l.strip() for l in after if l.strip()), "")
    if not evidence:
        evidence = next((l.strip() for l in lines if l.startswith("error")), "")
    return p.returncode != 0, evidence[:200], time.time() - start


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = ["| source | mutation | test (tactics) | caught | first failure | s |",
            "|---|---|---|---|---|---|"]
    caught_all = True
    for path, old, new, what, test, tactic in MUTATIONS:
        if args.only not in what:
            continue
        f = ROOT / path
        original = f.read_text()
        if original.count(old) != 1:
            print(f"{path}: the text to mutate for '{what}' occurs {original.count(old)} times",
                  file=sys.stderr)
            return 2
        try:
            f.write_text(original.replace(old, new))
            failed, evidence, secs = run_test(test, tactic)
        finally:
            f.write_text(original)
        if not what.startswith(EQUIVALENT):
            caught_all &= failed
        rows.append(f"| `{Path(path).name}` | {what} | `{test}` ({tactic}) | "
                    f"{'yes' if failed else '**no**'} | {evidence.replace('|', '/')} | {secs:.0f} |")
        print(rows[-1], flush=True)
    text = "\n".join(rows) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0 if caught_all else 1


if __name__ == "__main__":
    sys.exit(main())

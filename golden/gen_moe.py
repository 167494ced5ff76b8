"""Golden data for the routed-expert block (the NVFP4 grouped GEMM of the MoE), W4A4:

for every token t and slot k with expert e = routing[t, k] and weight w = weights[t, k]:
    xq  = fake_quant(x[t], e.gate_up_input_scale)          # NVFP4, per-16 dynamic block scales
    h   = silu(xq @ gate_e.T) * (xq @ up_e.T)                # dequantized NVFP4 weights
    hq  = fake_quant(h, e.down_input_scale)
    out[t] += w * (hq @ down_e.T)                            # summed over k in slot order

Weights are quantized by ModelOpt's NVFP4QTensor with gate and up sharing one
weight_scale_2 (max of their amaxes / 2688), as ModelOpt's fused export writes them;
activations are fake-quantized by NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=
input_scale) followed by dequantize. Nothing here imports project code.

Two kinds of cases (one file each, golden/data/moe/):
- small.safetensors: small shapes written in full (weights, scales, inputs, routing, output),
  including empty experts, an expert with many tokens, and a TP=2 split of one set of experts
  (each rank's output is its partial sum).
- kernel_tiles.safetensors: a shape every CUDA tactic accepts (hidden 512, intermediate 256)
  with an expert that gets more tokens than the largest token tile (40 > 32: several tiles and
  a ragged last one), an empty expert and one whose scales saturate; hashed like the next.
- kimi.safetensors: Kimi-K2.5's per-GPU shapes (hidden 7168; intermediate 2048/8 = 256, and the
  unsharded 2048) at decode sizes. Their weights would take megabytes, so they are not stored:
  weights and inputs are a closed-form integer hash of the element index (see `hashed_values`),
  exact in bf16, that the Rust test recomputes bit for bit. The file stores the routing, the
  input scales, the weight_scale_2 values, a checksum of every packed weight and block-scale
  tensor (so a test that quantizes differently from ModelOpt fails loudly) and the output.

Seeded, CPU-only and deterministic: re-running writes identical bytes.
"""

import argparse
import json
import warnings
from pathlib import Path

import modelopt
import numpy as np
import torch
import torch.nn.functional as F
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
from safetensors.torch import save_file

BLOCK = 16
E2M1_E4M3_MAX = 6.0 * 448.0
warnings.filterwarnings("ignore")


def provenance(extra: dict) -> dict:
    meta = {
        "generator": "golden/gen_moe.py",
        "torch": torch.__version__,
        "modelopt": modelopt.__version__,
    }
    meta.update({k: str(v) for k, v in extra.items()})
    # One key only: safetensors keeps metadata in a hash map, so several keys would be
    # written in a different order on every run.
    return {"provenance": json.dumps(meta, sort_keys=True)}


# ---------------------------------------------------------------- NVFP4 (ModelOpt)
def quantize(w: torch.Tensor, scale_2: torch.Tensor):
    """NVFP4 weight with a given weight_scale_2: (packed u8, e4m3 scales, scale_2, dequant)."""
    q, s, s2 = NVFP4QTensor.quantize(w.clone(), BLOCK, weights_scaling_factor_2=scale_2)
    deq = q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: BLOCK})
    return q._quantized_data.contiguous(), s.contiguous(), s2.float().reshape([]), deq


def fake_quant(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    q, s, _ = NVFP4QTensor.quantize(x.clone(), BLOCK, weights_scaling_factor_2=input_scale)
    return q.dequantize(dtype=torch.float32, scale=s, double_scale=input_scale,
                        block_sizes={-1: BLOCK})


def quantize_expert(gate, up, down):
    """gate/up share weight_scale_2 = max(amax_gate, amax_up) / 2688 (ModelOpt's fused
    export); down has its own."""
    shared = torch.maximum(NVFP4QTensor.get_weights_scaling_factor_2(gate),
                           NVFP4QTensor.get_weights_scaling_factor_2(up))
    return {
        "gate_proj": quantize(gate, shared),
        "up_proj": quantize(up, shared),
        "down_proj": quantize(down, NVFP4QTensor.get_weights_scaling_factor_2(down)),
    }


def expert_hidden(x_rows, q, in_scale):
    xq = fake_quant(x_rows, in_scale)
    gate = xq @ q["gate_proj"][3].T
    up = xq @ q["up_proj"][3].T
    return F.silu(gate) * up


def moe_forward(x, routing, weights, experts, in_scales, down_scales):
    """The W4A4 routed-expert block in float32; sums over slots in slot order."""
    tokens, top_k = routing.shape
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32)
    for t in range(tokens):
        for k in range(top_k):
            e = int(routing[t, k])
            h = expert_hidden(x[t:t + 1], experts[e], in_scales[e])
            hq = fake_quant(h, down_scales[e])
            out[t] += weights[t, k] * (hq @ experts[e]["down_proj"][3].T)[0]
    return out


def calibrate(x, routing, experts, num_experts, tighten):
    """ModelOpt-style max calibration of each expert's two input_scales on the routed tokens;
    `tighten[e]` divides expert e's scales so that some block scales saturate at 448.
    Experts no token reaches get 1/2688 (as if their calibration amax were 1)."""
    in_scales, down_scales = [], []
    for e in range(num_experts):
        rows = [t for t in range(routing.shape[0]) if e in routing[t].tolist()]
        if not rows:
            in_scales.append(torch.tensor(1.0 / E2M1_E4M3_MAX))
            down_scales.append(torch.tensor(1.0 / E2M1_E4M3_MAX))
            continue
        xr = x[rows]
        s_in = (xr.abs().max() / E2M1_E4M3_MAX / tighten[e]).float()
        h = expert_hidden(xr, experts[e], s_in)
        s_down = (h.abs().max() / E2M1_E4M3_MAX / tighten[e]).float()
        in_scales.append(s_in)
        down_scales.append(s_down)
    return in_scales, down_scales


def routing_tensor(rows):
    return torch.tensor(rows, dtype=torch.int64)


def add_case(tensors, name, x, routing, weights, experts, in_scales, down_scales,
             store_weights=True):
    out = moe_forward(x, routing, weights, experts, in_scales, down_scales)
    # Clones: safetensors refuses tensors that share memory (cases share inputs and scales).
    tensors[f"{name}.x"] = x.float().clone()
    tensors[f"{name}.routing"] = routing.clone()
    tensors[f"{name}.weights"] = weights.float().clone()
    tensors[f"{name}.out"] = out.clone()
    for e, q in enumerate(experts):
        for proj, (packed, scale, scale_2, _) in q.items():
            prefix = f"{name}.experts.{e}.{proj}"
            tensors[f"{prefix}.weight_scale_2"] = scale_2.clone()
            if store_weights:
                tensors[f"{prefix}.weight"] = packed.clone()
                tensors[f"{prefix}.weight_scale"] = scale.clone()
            else:
                tensors[f"{prefix}.weight_checksum"] = torch.tensor(
                    [checksum(packed), checksum(scale.view(torch.uint8))], dtype=torch.int64)
        tensors[f"{name}.experts.{e}.gate_up_proj.input_scale"] = in_scales[e].reshape([]).clone()
        tensors[f"{name}.experts.{e}.down_proj.input_scale"] = down_scales[e].reshape([]).clone()
    return out


# ---------------------------------------------------------------- small cases, stored in full
def random_experts(gen, num_experts, hidden, inter):
    def randn(r, c):
        # Rows of different magnitudes so that block scales vary within a tensor.
        mag = torch.exp2(torch.randint(-3, 2, (r, 1), generator=gen).float())
        return (torch.randn(r, c, generator=gen) * 0.05 * mag).to(torch.bfloat16)
    return [quantize_expert(randn(inter, hidden), randn(inter, hidden), randn(hidden, inter))
            for _ in range(num_experts)]


def shard_expert(q, rank, shards):
    """Rank `rank` of a TP split of the intermediate dimension: rows of gate/up, columns of
    down; packed bytes and block scales travel with their elements (the split is
    block-aligned), weight_scale_2 stays."""
    out = {}
    for proj, (packed, scale, scale_2, deq) in q.items():
        if proj == "down_proj":
            n = deq.shape[1] // shards
            sl = slice(rank * n, (rank + 1) * n)
            out[proj] = (packed[:, rank * n // 2:(rank + 1) * n // 2].contiguous(),
                         scale[:, rank * n // BLOCK:(rank + 1) * n // BLOCK].contiguous(),
                         scale_2, deq[:, sl].contiguous())
        else:
            n = deq.shape[0] // shards
            sl = slice(rank * n, (rank + 1) * n)
            out[proj] = (packed[sl].contiguous(), scale[sl].contiguous(), scale_2,
                         deq[sl].contiguous())
    return out


def write_small(out: Path, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}

    def x_rows(tokens, hidden):
        return (torch.randn(tokens, hidden, generator=gen)).to(torch.bfloat16).float()

    def route_weights(tokens, top_k):
        return torch.rand(tokens, top_k, generator=gen) * 0.5 + 0.05

    # Decode: 3 tokens, top-2 of 6 experts; expert 5 gets nothing, expert 2's scales are
    # 8× too small (block scales saturate).
    hidden, inter, n_exp = 64, 32, 6
    experts = random_experts(gen, n_exp, hidden, inter)
    routing = routing_tensor([[0, 2], [3, 2], [1, 4]])
    x = x_rows(3, hidden)
    tighten = [1, 1, 8, 1, 1, 1]
    ins, downs = calibrate(x, routing, experts, n_exp, tighten)
    add_case(tensors, "decode_h64_i32", x, routing, route_weights(3, 2), experts, ins, downs)

    # Prefill-like: 24 tokens, top-2 of 8; expert 0 is every token's first choice (24 tokens:
    # several kernel token groups), expert 7 gets nothing.
    hidden, inter, n_exp, tokens = 128, 64, 8, 24
    experts = random_experts(gen, n_exp, hidden, inter)
    second = torch.randint(1, n_exp - 1, (tokens, 1), generator=gen)
    routing = torch.cat([torch.zeros(tokens, 1, dtype=torch.int64), second], dim=1)
    x = x_rows(tokens, hidden)
    ins, downs = calibrate(x, routing, experts, n_exp, [1] * n_exp)
    add_case(tensors, "heavy_h128_i64", x, routing, route_weights(tokens, 2), experts, ins, downs)

    # Tensor parallel: the same experts whole and split in two along the intermediate
    # dimension; each rank's output is a partial sum, and the ranks sum to the whole.
    hidden, inter, n_exp, tokens = 96, 64, 3, 4
    experts = random_experts(gen, n_exp, hidden, inter)
    routing = routing_tensor([[0, 1], [2, 0], [1, 2], [0, 2]])
    weights = route_weights(tokens, 2)
    x = x_rows(tokens, hidden)
    ins, downs = calibrate(x, routing, experts, n_exp, [1] * n_exp)
    add_case(tensors, "tp1_h96_i64", x, routing, weights, experts, ins, downs)
    for rank in range(2):
        shards = [shard_expert(q, rank, 2) for q in experts]
        add_case(tensors, f"tp2_rank{rank}_h96_i32", x, routing, weights, shards, ins, downs)

    save_file(tensors, str(out / "small.safetensors"),
              metadata=provenance({"seed": seed, "semantics": __doc__.split("\n\n")[0]}))


# ---------------------------------------------------------------- Kimi shapes, hashed inputs
MASK32 = np.uint64(0xFFFFFFFF)


def hash_u32(index: np.ndarray, stream: int) -> np.ndarray:
    """A 32-bit integer hash (murmur3's finalizer on index·φ + stream), in uint64 arithmetic
    that wraps mod 2⁶⁴ and is masked to 32 bits after every product."""
    h = (index.astype(np.uint64) * np.uint64(0x9E3779B1)
         + np.uint64(stream) * np.uint64(0x85EBCA77) + np.uint64(1)) & MASK32
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & MASK32
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & MASK32
    h ^= h >> np.uint64(16)
    return h


def hashed_values(rows: int, cols: int, stream: int, exponent: int) -> torch.Tensor:
    """value[i] = (h mod 255 − 127) · 2^−(exponent + (h >> 8) mod 4) with h = hash_u32(i,
    stream): integers of at most 7 bits times powers of two, so exact in bf16 and f32 and
    identical on both sides; the varying exponent gives blocks of different magnitudes."""
    h = hash_u32(np.arange(rows * cols, dtype=np.uint64), stream)
    k = (h % np.uint64(255)).astype(np.int64) - 127
    e = exponent + ((h >> np.uint64(8)) % np.uint64(4)).astype(np.int64)
    v = np.ldexp(k.astype(np.float32), -e.astype(np.int32)).astype(np.float32)
    return torch.from_numpy(v.reshape(rows, cols)).to(torch.bfloat16)


def checksum(t: torch.Tensor) -> int:
    """Σ byte[i] · (i mod 65521 + 1) over the tensor's bytes, in int64 (no overflow for the
    sizes here). The Rust test computes the same over its own quantization."""
    b = t.contiguous().view(torch.uint8).flatten().numpy().astype(np.int64)
    weights = np.arange(b.size, dtype=np.int64) % 65521 + 1
    return int((b * weights).sum())


# Stream numbers of the hashed tensors: expert e's gate/up/down use 1000·(e+1) + {1, 2, 3}
# (+ 100000 for the unsharded cases), the tokens use 7.
def hashed_expert(case_stream: int, e: int, hidden: int, inter: int):
    base = case_stream + 1000 * (e + 1)
    return quantize_expert(hashed_values(inter, hidden, base + 1, 12),
                           hashed_values(inter, hidden, base + 2, 12),
                           hashed_values(hidden, inter, base + 3, 10))


def write_kimi(out: Path) -> None:
    tensors = {}
    hidden = 7168
    cases = [
        # TP8 shard of Kimi's experts at decode: 4 tokens, top-2 of 4 experts; expert 3 gets
        # nothing, expert 0 three tokens.
        ("kimi_tp8_h7168_i256", 0, 256, 4, [[0, 1], [2, 0], [1, 2], [0, 2]]),
        # The unsharded intermediate, one expert for two tokens.
        ("kimi_tp1_h7168_i2048", 100000, 2048, 1, [[0], [0]]),
    ]
    for name, stream, inter, n_exp, rows in cases:
        experts = [hashed_expert(stream, e, hidden, inter) for e in range(n_exp)]
        routing = routing_tensor(rows)
        tokens, top_k = routing.shape
        x = hashed_values(tokens, hidden, stream + 7, 6).float()
        weights = torch.tensor([[0.75, 0.25][:top_k]] * tokens, dtype=torch.float32)
        ins, downs = calibrate(x, routing, experts, n_exp, [1] * n_exp)
        add_case(tensors, name, x, routing, weights, experts, ins, downs, store_weights=False)
    save_file(tensors, str(out / "kimi.safetensors"), metadata=provenance({
        "semantics": __doc__.split("\n\n")[0],
        "hashed_values": "value[i] = (h % 255 - 127) * 2^-(exponent + (h >> 8) % 4), "
                         "h = murmur3_fmix32((i * 0x9E3779B1 + stream * 0x85EBCA77 + 1) mod 2^32); "
                         "gate/up exponent 12, down 10, tokens (x) 6 and stream case+7; expert e "
                         "streams case + 1000*(e+1) + {1: gate, 2: up, 3: down}; case 0 (i256), "
                         "100000 (i2048); weights [0.75, 0.25][:top_k] per token",
        "checksum": "per projection [packed, scales]: sum(byte[i] * (i % 65521 + 1)) as int64",
    }))


def write_kernel_tiles(out: Path) -> None:
    tensors = {}
    hidden, inter, n_exp, tokens, stream = 512, 256, 6, 40, 200000
    experts = [hashed_expert(stream, e, hidden, inter) for e in range(n_exp)]
    # Expert 0 is every token's first choice (40 tokens); the second choice cycles through
    # experts 1..4; expert 5 gets nothing.
    routing = routing_tensor([[0, 1 + t % 4] for t in range(tokens)])
    x = hashed_values(tokens, hidden, stream + 7, 6).float()
    # Routing weights from the hash too: exact in f32 and different per slot.
    w = hashed_values(tokens, 2, stream + 8, 8).float().abs() + 0.125
    # Expert 2's input scales are 8× too small: its block scales saturate at 448.
    ins, downs = calibrate(x, routing, experts, n_exp, [1, 1, 8, 1, 1, 1])
    add_case(tensors, "tiles_h512_i256", x, routing, w, experts, ins, downs,
             store_weights=False)
    save_file(tensors, str(out / "kernel_tiles.safetensors"), metadata=provenance({
        "semantics": __doc__.split("\n\n")[0],
        "hashed_values": "as kimi.safetensors, with case stream 200000; routing weights "
                         "|hashed_values(stream + 8, exponent 8)| + 0.125",
    }))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=20261129)
    args = parser.parse_args()
    out = args.out / "moe"
    out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # one summation order for the float32 products
    write_small(out, args.seed + 10)
    write_kimi(out)
    write_kernel_tiles(out)


if __name__ == "__main__":
    main()

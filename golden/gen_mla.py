"""Goldens for absorbed MLA decode attention over the latent cache (kernels::mla).

Independent implementation: PyTorch (float64) attention over the cache contents, with the
cache's BF16 / FP8 storage emulated by torch's own bfloat16 and float8_e4m3fn casts. Nothing
here imports project code.

Cache contents are not stored: they come from a closed-form integer hash (splitmix64) that the
Rust tests evaluate too, so a 64K-token context costs only its queries and outputs on disk:

    idx(seed, t, j) = seed << 40 | t << 10 | j                (uint64; t < 2^30, j < 1024)
    u(seed, t, j)   = ((splitmix64(idx) >> 11) % 2001) - 1000  (integer in [-1000, 1000])
    latent[t][j]    = u(seed, t, j) / 256 * (1 + t % 5) / 4    (j < L; exact in f32)
    rope[t][j]      = u(seed, t, L + j) / 512                  (j < R)

with L = 512 latent and R = 64 RoPE values per token (Kimi-K2.5), or L = 64, R = 16 for the
cases named l64r16_* (the small golden checkpoints' widths, with 2–8 heads: fewer than one
kernel block's 16).

FP8 E4M3 storage (cache.rs): per token scale = amax(latent[t]) / 448 (f32; 1 if amax is 0),
codes = e4m3(latent / scale) rounded to nearest even, saturating; RoPE part BF16. With a
per-tensor checkpoint k_scale ("fp8_static") every token uses that scale instead.

Per case, golden/data/mla/<case>.safetensors holds:
    q_abs [B, H, L], q_pe [B, H, R]      BF16-representable f32 (what a GPU kernel reads)
    lens [B] (int64), seeds [B] (int64), softmax_scale [1]
    out, lse           attention over the cache as stored (dequantized), float64 → f32
    out_exact, lse_exact   attention over the unquantized f32 values
hf_absorbed.safetensors: a small DeepseekV3Attention (HF transformers, expanded K/V) whose
output the absorbed formulation reproduces; inputs and latent outputs for the Rust tests.

Deterministic: fixed seeds, CPU, float64; re-running writes identical bytes.
"""

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

L, R = 512, 64
E4M3_MAX = 448.0
MASK64 = (1 << 64) - 1

# Kimi-K2.5: qk_head_dim 192, YaRN factor 64 with mscale_all_dim 1 → scale · mscale².
KIMI_SOFTMAX_SCALE = 192 ** -0.5 * (0.1 * math.log(64.0) + 1.0) ** 2

CASES = [
    # name, storage, heads, lens, seed[, (L, R)]
    ("bf16_single", "bf16", 8, [1], 1),
    ("bf16_pages", "bf16", 16, [63, 64, 65, 128], 2),
    ("fp8_pages", "fp8", 16, [63, 64, 65, 128], 3),
    ("bf16_ragged", "bf16", 8, [1, 7, 300, 1000, 2049, 4096], 4),
    ("fp8_ragged", "fp8", 8, [1, 7, 300, 1000, 2049, 4096], 5),
    ("fp8_static_scale", "fp8_static", 8, [100, 700], 6),
    ("bf16_long", "bf16", 8, [65536], 7),
    ("fp8_long", "fp8", 8, [65536], 8),
    # The small golden checkpoints' widths (kimi-tiny, kimi-chat-tiny, the DeepSeek-V3 ones):
    # 2, 4 and 8 heads, page boundaries, ragged batches, a per-tensor k_scale.
    ("l64r16_bf16_pages", "bf16", 4, [1, 63, 64, 65, 130], 9, (64, 16)),
    ("l64r16_fp8_pages", "fp8", 4, [1, 63, 64, 65, 130], 10, (64, 16)),
    ("l64r16_bf16_ragged", "bf16", 2, [7, 300, 1000, 2049], 11, (64, 16)),
    ("l64r16_fp8_ragged", "fp8", 8, [7, 300, 1000, 2049], 12, (64, 16)),
    ("l64r16_fp8_static_scale", "fp8_static", 4, [100, 700], 13, (64, 16)),
]
# Per-tensor k_scale of the fp8_static case: covers the hash's largest latent (3.90625 · 1.25).
STATIC_SCALE = np.float32(5.0) / np.float32(448.0)


def splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hash_u(seed: int, tokens: int, j0: int, width: int) -> np.ndarray:
    t = np.arange(tokens, dtype=np.uint64)[:, None]
    j = np.arange(j0, j0 + width, dtype=np.uint64)[None, :]
    idx = (np.uint64(seed) << np.uint64(40)) | (t << np.uint64(10)) | j
    return (splitmix64(idx) >> np.uint64(11)) % np.uint64(2001)


def cache_values(seed: int, tokens: int, widths=(L, R)):
    """The f32 latent [T, L] and rope [T, R] a request's cache is written with."""
    lat_w, pe_w = widths
    u_lat = hash_u(seed, tokens, 0, lat_w).astype(np.int64) - 1000
    u_pe = hash_u(seed, tokens, lat_w, pe_w).astype(np.int64) - 1000
    tok = (1 + np.arange(tokens, dtype=np.int64) % 5)[:, None]
    latent = (u_lat.astype(np.float32) / np.float32(256)) * (tok.astype(np.float32) / np.float32(4))
    rope = u_pe.astype(np.float32) / np.float32(512)
    return torch.from_numpy(latent), torch.from_numpy(rope)


def stored(latent: torch.Tensor, rope: torch.Tensor, storage: str):
    """Dequantized values of the cache as stored (f32)."""
    if storage == "exact":
        return latent, rope
    rope_q = rope.to(torch.bfloat16).float()
    if storage == "bf16":
        return latent.to(torch.bfloat16).float(), rope_q
    if storage == "fp8":
        amax = latent.abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    else:  # fp8_static
        scale = torch.full((latent.shape[0],), float(STATIC_SCALE), dtype=torch.float32)
    codes = (latent / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.float() * scale[:, None], rope_q


def attend(q_abs, q_pe, latent, rope, scale):
    """float64 absorbed attention of one request: q_abs [H, L], q_pe [H, R] → out [H, L], lse [H]."""
    c, k = latent.double(), rope.double()
    s = (q_abs.double() @ c.T + q_pe.double() @ k.T) * scale
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[:, None])
    return (p @ c).float(), lse.float()


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max over (request, head) rows of ‖a − b‖∞ / ‖b‖∞."""
    num = (a - b).abs().amax(dim=-1)
    den = b.abs().amax(dim=-1).clamp_min(1e-30)
    return float((num / den).max())


def provenance(**extra) -> dict:
    # ONE metadata key: safetensors reorders multiple keys, which would break byte equality.
    info = {
        "generator": "golden/gen_mla.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cache_hash": "splitmix64; see the gen_mla.py docstring",
    }
    info.update(extra)
    return {"provenance": json.dumps(info, sort_keys=True)}


def gen_case(out_dir: Path, name, storage, heads, lens, seed, widths=(L, R)):
    g = torch.Generator().manual_seed(1000 + seed)
    b = len(lens)
    lat_w, pe_w = widths
    q_abs = bf16_round(0.5 * torch.randn(b, heads, lat_w, generator=g))
    q_pe = bf16_round(0.5 * torch.randn(b, heads, pe_w, generator=g))
    scale = float(np.float32(KIMI_SOFTMAX_SCALE))
    seeds = [seed * 16 + i for i in range(b)]
    out, lse, out_x, lse_x = [], [], [], []
    for i, n in enumerate(lens):
        latent, rope = cache_values(seeds[i], n, widths)
        o, s = attend(q_abs[i], q_pe[i], *stored(latent, rope, storage), scale)
        ox, sx = attend(q_abs[i], q_pe[i], latent, rope, scale)
        out.append(o), lse.append(s), out_x.append(ox), lse_x.append(sx)
    out, lse = torch.stack(out), torch.stack(lse)
    out_x, lse_x = torch.stack(out_x), torch.stack(lse_x)
    tensors = {
        "q_abs": q_abs.contiguous(),
        "q_pe": q_pe.contiguous(),
        "lens": torch.tensor(lens, dtype=torch.int64),
        "seeds": torch.tensor(seeds, dtype=torch.int64),
        "softmax_scale": torch.tensor([scale], dtype=torch.float32),
        "out": out.contiguous(),
        "lse": lse.contiguous(),
        "out_exact": out_x.contiguous(),
        "lse_exact": lse_x.contiguous(),
    }
    # Kimi-K2.5's widths are implied (their files predate the others).
    extra = {} if widths == (L, R) else {"latent": lat_w, "rope": pe_w}
    meta = provenance(
        case=name,
        storage=storage,
        heads=heads,
        **extra,
        static_scale_bits=int(STATIC_SCALE.view(np.uint32)) if storage == "fp8_static" else None,
        # How far the storage format alone moves the output (informational).
        storage_rel_err=f"{rel_err(out, out_x):.3e}",
    )
    save_file(tensors, str(out_dir / f"{name}.safetensors"), metadata=meta)
    print(f"  {name}: B={b} H={heads} L={lat_w} R={pe_w} lens={lens} storage={storage} "
          f"storage rel err {rel_err(out, out_x):.2e}")


def gen_hf_absorbed(out_dir: Path):
    """HF's DeepseekV3Attention (expanded K/V, eager) vs the absorbed formulation."""
    torch.manual_seed(7)
    cfg = DeepseekV3Config(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        rope_scaling={"type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 64},
        max_position_embeddings=512, attention_bias=False, rope_interleave=True,
    )
    cfg._attn_implementation = "eager"
    attn = hf.DeepseekV3Attention(cfg, layer_idx=0).double().eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.08)
    with torch.no_grad():
        attn.q_a_layernorm.weight.fill_(1.0).add_(0.1 * torch.randn(cfg.q_lora_rank))
        attn.kv_a_layernorm.weight.fill_(1.0).add_(0.1 * torch.randn(cfg.kv_lora_rank))
    rotary = hf.DeepseekV3RotaryEmbedding(cfg)
    s_len, h = 37, cfg.num_attention_heads
    x = torch.randn(1, s_len, cfg.hidden_size, dtype=torch.float64)
    pos = torch.arange(s_len)[None]
    cos, sin = rotary(x, pos)
    mask = torch.full((s_len, s_len), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        ref, _ = attn(x, (cos, sin), mask)

        # The absorbed formulation with the module's own weights and HF's RoPE function.
        nope, rope_d, v, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, s_len, h, nope + rope_d).transpose(1, 2)
        q_nope, q_rot = q.split([nope, rope_d], dim=-1)
        ckv = attn.kv_a_proj_with_mqa(x)
        c, k_rot = ckv.split([lat, rope_d], dim=-1)
        c = attn.kv_a_layernorm(c)
        q_rot, k_rot = hf.apply_rotary_pos_emb_interleave(q_rot, k_rot[:, None], cos, sin)
        w = attn.kv_b_proj.weight.view(h, nope + v, lat)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        q_abs = torch.einsum("bhsp,hpl->bhsl", q_nope, w_uk)
        scores = (q_abs @ c[:, None].transpose(-1, -2) + q_rot @ k_rot.transpose(-1, -2)) * attn.scaling
        scores = scores + mask
        lse = torch.logsumexp(scores, dim=-1)
        o_lat = torch.exp(scores - lse[..., None]) @ c[:, None]
        o = torch.einsum("bhsl,hvl->bshv", o_lat, w_uv).reshape(1, s_len, h * v)
        absorbed = attn.o_proj(o)
    diff = float((absorbed - ref).abs().max() / ref.abs().max())
    # HF runs its eager softmax (and RMSNorm) in float32 even for float64 modules: ~1e-7.
    assert diff < 1e-6, f"absorbed MLA disagrees with HF DeepseekV3Attention: {diff}"
    tensors = {
        # Rows are query positions t (attending to tokens 0..=t); cache rows are tokens.
        "latent": c[0].float().contiguous(),
        "rope": k_rot[0, 0].float().contiguous(),
        "q_abs": q_abs[0].transpose(0, 1).float().contiguous(),  # [S, H, L]
        "q_pe": q_rot[0].transpose(0, 1).float().contiguous(),   # [S, H, R]
        "softmax_scale": torch.tensor([attn.scaling], dtype=torch.float32),
        "out": o_lat[0].transpose(0, 1).float().contiguous(),    # [S, H, L]
        "lse": lse[0].transpose(0, 1).float().contiguous(),      # [S, H]
    }
    meta = provenance(case="hf_absorbed", hf_rel_diff=f"{diff:.3e}",
                      hf_module="transformers DeepseekV3Attention (eager, float64)")
    save_file(tensors, str(out_dir / "hf_absorbed.safetensors"), metadata=meta)
    print(f"  hf_absorbed: absorbed vs HF expanded, max rel diff {diff:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out_dir = Path(args.out) / "mla"
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for case in CASES:
        gen_case(out_dir, *case)
    gen_hf_absorbed(out_dir)


if __name__ == "__main__":
    main()

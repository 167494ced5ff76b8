"""Tiny random DeepSeek-V3 / Kimi-K2.5 models in the NVIDIA ModelOpt NVFP4 checkpoint layout,
with end-to-end goldens (logits, routing, greedy continuation).

Independent implementation: the forward pass is Hugging Face transformers' DeepseekV3 modeling
code (float32, eager attention), the routed experts are quantized and fake-quantized with
NVIDIA ModelOpt's NVFP4QTensor. Nothing here imports project code.

For every model in MODELS this writes golden/data/models/<name>/:
  config.json, hf_quant_config.json, generation_config.json,
  model-0000k-of-0000n.safetensors + model.safetensors.index.json (or one model.safetensors),
  golden.safetensors.
See golden/MODEL_LAYOUT.md (checkpoint layout) and golden/README.md (what the goldens mean).

Seeded, CPU-only, single-threaded: re-running writes identical bytes.
"""

import argparse
import copy
import json
import math
import shutil
import warnings
from pathlib import Path

import modelopt
import torch
import torch.nn.functional as F
import transformers
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
from safetensors.torch import save_file
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

warnings.filterwarnings("ignore")
BLOCK = 16
E2M1_MAX, E4M3_MAX = 6.0, 448.0

KIMI_ROPE = {  # Kimi-K2.5 text_config.rope_scaling, verbatim shape
    "beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096, "type": "yarn",
}

MODELS = {
    # Kimi-K2.5 layout: kimi_k25 wrapper config, `language_model.` prefix, q-LoRA, n_group 1,
    # one shared expert, vision tower / projector tensors present, two shards + index.
    "kimi-tiny": dict(
        layout="kimi_k25", seed=101, shards=2,
        vocab_size=576, hidden_size=256, intermediate_size=192, moe_intermediate_size=64,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=1, topk_group=1,
        text_model_type="kimi_k2", scale_shape=[],
    ),
    # Plain DeepSeek-V3 layout: no prefix, q_proj (q_lora_rank null), grouped routing
    # (n_group 4, topk_group 2), two shared experts, three shards + index.
    "dsv3-noqlora-grouped": dict(
        layout="deepseek_v3", seed=202, shards=3,
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4,
        q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=2, n_group=4, topk_group=2,
        text_model_type="deepseek_v3", scale_shape=[],
    ),
    # Shape variant: 8 experts top-2, 8 heads, odd-sized vocab, one unsharded model.safetensors
    # without an index, and the per-tensor scalars stored with shape [1] instead of [] (both
    # spellings occur in NVFP4 exports; a loader must accept either).
    "dsv3-mini-unsharded": dict(
        layout="deepseek_v3", seed=303, shards=1,
        vocab_size=520, hidden_size=128, intermediate_size=192, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=8,
        q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        text_model_type="deepseek_v3", scale_shape=[1], bf16_source=True,
    ),
    # The kernels' dimensions: Kimi-K2.5's MLA latent 512 and RoPE 64, 16 heads (one MLA decode
    # block of heads), hidden and expert widths that the MoE tiles divide (256). Small in every
    # other way, so the device executor (kernels on the GPU or the host execution layer) can be
    # checked end to end against HF; the other models' latent 64 / RoPE 16 cannot run there.
    "kimi-kernel-dims": dict(
        layout="kimi_k25", seed=404, shards=2,
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=16,
        q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        text_model_type="kimi_k2", scale_shape=[],
    ),
}

COMMON_TEXT = dict(
    hidden_act="silu", rms_norm_eps=1e-5, rope_theta=50000.0, rope_scaling=KIMI_ROPE,
    max_position_embeddings=262144, routed_scaling_factor=2.827, scoring_func="sigmoid",
    topk_method="noaux_tc", norm_topk_prob=True, moe_layer_freq=1, num_nextn_predict_layers=0,
    attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False,
)

T_PROMPT = 20      # golden prompt length
PREFIX_LEN = 12    # suggested prefill/decode split for cache tests
N_GREEDY = 12      # greedy continuation length
N_CANDIDATES = 12  # candidate prompts; the least fragile one is kept
CALIB_SHAPE = (2, 8)  # calibration batch: few tokens, so some experts stay uncalibrated


def provenance(extra: dict) -> dict:
    meta = {
        "generator": "golden/gen_model.py",
        "torch": torch.__version__,
        "modelopt": modelopt.__version__,
        "transformers": transformers.__version__,
    }
    meta.update({k: (v if isinstance(v, (int, float, bool, list, dict)) else str(v))
                 for k, v in extra.items()})
    return {"provenance": json.dumps(meta, sort_keys=True)}


# ---------------------------------------------------------------- configs
def text_config(spec: dict) -> dict:
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": spec["text_model_type"],
        "vocab_size": spec["vocab_size"],
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "moe_intermediate_size": spec["moe_intermediate_size"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "first_k_dense_replace": spec["first_k_dense_replace"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_key_value_heads": spec["num_attention_heads"],
        "q_lora_rank": spec["q_lora_rank"],
        "kv_lora_rank": spec["kv_lora_rank"],
        "qk_nope_head_dim": spec["qk_nope_head_dim"],
        "qk_rope_head_dim": spec["qk_rope_head_dim"],
        "v_head_dim": spec["v_head_dim"],
        "n_routed_experts": spec["n_routed_experts"],
        "num_experts_per_tok": spec["num_experts_per_tok"],
        "n_shared_experts": spec["n_shared_experts"],
        "n_group": spec["n_group"],
        "topk_group": spec["topk_group"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }
    cfg.update(COMMON_TEXT)
    return dict(sorted(cfg.items()))


def hf_config(tcfg: dict) -> DeepseekV3Config:
    kw = {k: v for k, v in tcfg.items()
          if k not in ("architectures", "model_type", "dtype", "scoring_func", "topk_method",
                       "moe_layer_freq", "rope_scaling", "rope_theta")}
    kw["rope_parameters"] = dict(tcfg["rope_scaling"], rope_type="yarn",
                                 rope_theta=tcfg["rope_theta"])
    cfg = DeepseekV3Config(**kw)
    cfg._attn_implementation = "eager"
    assert cfg.rope_interleave is True  # HF default; the real checkpoints carry no such key
    return cfg


def exclude_modules(spec: dict, prefix: str) -> list:
    """Modules ModelOpt leaves unquantized (glob patterns), in the style of the Kimi export."""
    out = [f"{prefix}lm_head"]
    for layer in range(spec["num_hidden_layers"]):
        p = f"{prefix}model.layers.{layer}"
        out.append(f"{p}.self_attn*")
        if layer < spec["first_k_dense_replace"]:
            out.append(f"{p}.mlp*")
        else:
            out.append(f"{p}.mlp.gate")
            out.append(f"{p}.mlp.shared_experts*")
    if spec["layout"] == "kimi_k25":
        out += ["mm_projector*", "vision_tower*"]
    return out


def hf_quant_config(spec: dict, prefix: str) -> dict:
    return {
        "producer": {"name": "modelopt", "version": modelopt.__version__},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": "FP8",
            "group_size": BLOCK,
            "exclude_modules": exclude_modules(spec, prefix),
        },
    }


def config_quantization_config(spec: dict, prefix: str) -> dict:
    """config.json `quantization_config`, as modelopt's convert_hf_quant_config_format writes it."""
    return {
        "config_groups": {"group_0": {
            "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK},
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK},
            "targets": ["Linear"],
        }},
        "ignore": exclude_modules(spec, prefix),
        "quant_algo": "NVFP4",
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
        "producer": {"name": "modelopt", "version": modelopt.__version__},
        "quant_method": "modelopt",
    }


VISION_CONFIG = {  # illustrative only: the loader must ignore it
    "model_type": "moonvit3d", "patch_size": 2, "init_pos_emb_height": 4, "init_pos_emb_width": 4,
    "merge_kernel_size": [2, 2], "vt_hidden_size": 8, "vt_num_hidden_layers": 1,
    "vt_num_attention_heads": 2, "vt_intermediate_size": 16, "mm_hidden_size": 32,
    "text_hidden_size": None,
}


def top_config(spec: dict, tcfg: dict) -> dict:
    if spec["layout"] == "kimi_k25":
        vision = dict(VISION_CONFIG, text_hidden_size=spec["hidden_size"])
        return {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "auto_map": {
                "AutoConfig": "configuration_kimi_k25.KimiK25Config",
                "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            },
            "bos_token_id": 1,
            "dtype": "bfloat16",
            "eos_token_id": 2,
            "ignore_index": -100,
            "media_placeholder_token_id": spec["vocab_size"] - 3,
            "model_type": "kimi_k25",
            "pad_token_id": spec["vocab_size"] - 1,
            "quantization_config": config_quantization_config(spec, "language_model."),
            "text_config": tcfg,
            "tie_word_embeddings": False,
            "use_unified_vision_chunk": True,
            "video_placeholder": "<|kimi_k25_video_placeholder|>",
            "vision_config": vision,
        }
    cfg = dict(tcfg)
    cfg["quantization_config"] = config_quantization_config(spec, "")
    return cfg


# ---------------------------------------------------------------- weights
def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def make_weights(spec: dict, gen: torch.Generator) -> dict:
    """BF16 master weights, named as in the checkpoint (text model, without any prefix).

    Routed experts are per expert: model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight.
    """
    H, V = spec["hidden_size"], spec["vocab_size"]
    nh = spec["num_attention_heads"]
    qk = spec["qk_nope_head_dim"] + spec["qk_rope_head_dim"]
    w = {}

    def lin(name, out_f, in_f, gain=1.0):
        w[name] = bf16(torch.randn(out_f, in_f, generator=gen) * (gain / math.sqrt(in_f)))

    def norm(name, n):
        w[name] = bf16(1.0 + 0.1 * torch.randn(n, generator=gen))

    w["model.embed_tokens.weight"] = bf16(torch.randn(V, H, generator=gen))
    for layer in range(spec["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        norm(f"{p}.input_layernorm.weight", H)
        norm(f"{p}.post_attention_layernorm.weight", H)
        a = f"{p}.self_attn"
        if spec["q_lora_rank"] is None:
            lin(f"{a}.q_proj.weight", nh * qk, H)
        else:
            lin(f"{a}.q_a_proj.weight", spec["q_lora_rank"], H)
            norm(f"{a}.q_a_layernorm.weight", spec["q_lora_rank"])
            lin(f"{a}.q_b_proj.weight", nh * qk, spec["q_lora_rank"], gain=2.0)
        lin(f"{a}.kv_a_proj_with_mqa.weight", spec["kv_lora_rank"] + spec["qk_rope_head_dim"], H)
        norm(f"{a}.kv_a_layernorm.weight", spec["kv_lora_rank"])
        lin(f"{a}.kv_b_proj.weight", nh * (spec["qk_nope_head_dim"] + spec["v_head_dim"]),
            spec["kv_lora_rank"], gain=2.0)
        lin(f"{a}.o_proj.weight", H, nh * spec["v_head_dim"])
        m = f"{p}.mlp"
        if layer < spec["first_k_dense_replace"]:
            lin(f"{m}.gate_proj.weight", spec["intermediate_size"], H)
            lin(f"{m}.up_proj.weight", spec["intermediate_size"], H)
            lin(f"{m}.down_proj.weight", H, spec["intermediate_size"])
        else:
            E, I = spec["n_routed_experts"], spec["moe_intermediate_size"]
            w[f"{m}.gate.weight"] = bf16(torch.randn(E, H, generator=gen) * (1.5 / math.sqrt(H)))
            # Stored in float32 like the real checkpoints; nonzero so that it changes selection.
            w[f"{m}.gate.e_score_correction_bias"] = (
                0.15 * torch.randn(E, generator=gen)).to(torch.bfloat16).float()
            for e in range(E):
                # Per-expert gain spread so that per-tensor scales differ between experts.
                g = float(torch.empty(1).uniform_(0.5, 2.0, generator=gen))
                lin(f"{m}.experts.{e}.gate_proj.weight", I, H, gain=g)
                lin(f"{m}.experts.{e}.up_proj.weight", I, H, gain=g * 1.3)
                lin(f"{m}.experts.{e}.down_proj.weight", H, I, gain=1.0)
            Is = I * spec["n_shared_experts"]
            lin(f"{m}.shared_experts.gate_proj.weight", Is, H)
            lin(f"{m}.shared_experts.up_proj.weight", Is, H)
            lin(f"{m}.shared_experts.down_proj.weight", H, Is)
    norm("model.norm.weight", H)
    lin("lm_head.weight", V, H, gain=4.0)
    return w


def hf_state_dict(spec: dict, w: dict) -> dict:
    """Checkpoint names -> HF transformers 5.x module names (fused 3-D expert tensors)."""
    sd = {}
    E = spec["n_routed_experts"]
    for k, v in w.items():
        if ".mlp.experts." not in k:
            sd[k] = v.float()
    for layer in range(spec["first_k_dense_replace"], spec["num_hidden_layers"]):
        m = f"model.layers.{layer}.mlp.experts"
        sd[f"{m}.gate_up_proj"] = torch.stack([
            torch.cat([w[f"{m}.{e}.gate_proj.weight"], w[f"{m}.{e}.up_proj.weight"]], 0).float()
            for e in range(E)])
        sd[f"{m}.down_proj"] = torch.stack([w[f"{m}.{e}.down_proj.weight"].float() for e in range(E)])
    return sd


def build_model(spec: dict, tcfg: dict, w: dict) -> DeepseekV3ForCausalLM:
    cfg = hf_config(tcfg)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(spec, w), strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    return model


# ---------------------------------------------------------------- expert wrappers
def fake_quant(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 activation fake quantization with a static per-tensor (global) scale."""
    q, scale, _ = NVFP4QTensor.quantize(x, BLOCK, weights_scaling_factor_2=input_scale)
    return q.dequantize(dtype=torch.float32, scale=scale, double_scale=input_scale,
                        block_sizes={-1: BLOCK})


class PatchedExperts(nn.Module):
    """Drop-in for DeepseekV3Experts (same loop, same accumulation order).

    mode "calib": unquantized, records per-expert input amax of gate/up and of down_proj.
    mode "w4a4": dequantized NVFP4 weights; inputs of gate/up and of down fake-quantized with
                 the expert's own input_scale.
    """

    def __init__(self, orig: nn.Module, mode: str, qexp: dict | None = None):
        super().__init__()
        self.num_experts = orig.num_experts
        self.act_fn = orig.act_fn
        self.mode = mode
        self.gate_up_proj = orig.gate_up_proj
        self.down_proj = orig.down_proj
        self.amax_gu = torch.zeros(self.num_experts)
        self.amax_dn = torch.zeros(self.num_experts)
        self.hits = torch.zeros(self.num_experts, dtype=torch.long)
        self.qexp = qexp

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = int(e[0])
            if e == self.num_experts:
                continue
            pos, tok = torch.where(mask[e])
            x = hidden_states[tok]
            if self.mode == "calib":
                self.hits[e] += len(tok)
                self.amax_gu[e] = max(self.amax_gu[e], x.abs().max().float())
                gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                h = self.act_fn(gate) * up
                self.amax_dn[e] = max(self.amax_dn[e], h.abs().max().float())
                y = F.linear(h, self.down_proj[e])
            else:
                q = self.qexp[e]
                xq = fake_quant(x.float(), q["gu_input_scale"])
                gate = F.linear(xq, q["gate"])
                up = F.linear(xq, q["up"])
                h = self.act_fn(gate) * up
                y = F.linear(fake_quant(h, q["down_input_scale"]), q["down"])
            y = y * top_k_weights[tok, pos, None]
            final.index_add_(0, tok, y.to(final.dtype))
        return final


def moe_layers(spec):
    return range(spec["first_k_dense_replace"], spec["num_hidden_layers"])


def swap_experts(model, spec, make):
    originals = {}
    for layer in moe_layers(spec):
        mlp = model.model.layers[layer].mlp
        originals[layer] = mlp.experts
        mlp.experts = make(layer, mlp.experts)
    return originals


def restore_experts(model, originals):
    for layer, orig in originals.items():
        model.model.layers[layer].mlp.experts = orig


# ---------------------------------------------------------------- calibration + quantization
def calibrate(model, spec, gen) -> dict:
    """ModelOpt-style max calibration on the BF16 model: per-expert input amax."""
    calib_ids = torch.randint(0, spec["vocab_size"], CALIB_SHAPE, generator=gen)
    # Calibrate a BF16 copy: casting the model itself to BF16 and back would also round the
    # rotary embedding's inv_freq buffer, and every later (golden) forward would use it.
    model = copy.deepcopy(model)
    bias = {l: model.model.layers[l].mlp.gate.e_score_correction_bias.clone() for l in moe_layers(spec)}
    model.to(torch.bfloat16)
    for l in moe_layers(spec):  # HF keeps this buffer in fp32 (_keep_in_fp32_modules_strict)
        model.model.layers[l].mlp.gate.e_score_correction_bias = bias[l]
    patched = {}

    def make(layer, orig):
        patched[layer] = PatchedExperts(orig, "calib")
        return patched[layer]

    originals = swap_experts(model, spec, make)
    with torch.no_grad():
        model(calib_ids, use_cache=False)
    restore_experts(model, originals)
    return {l: (p.amax_gu.clone(), p.amax_dn.clone(), p.hits.clone()) for l, p in patched.items()}


def quantize_experts(spec, w, calib) -> tuple[dict, dict, dict]:
    """NVFP4 export of every routed expert, as ModelOpt's unified HF export does it.

    Returns (checkpoint tensors, dequantized experts for the W4A4 forward, stats).
    gate_proj/up_proj of one expert share weight_scale_2 (max of the two weight amaxes) and
    input_scale (same input), as preprocess_linear_fusion does for linears with a shared input.
    Experts that calibration never reached get the layer-wide max input amax of that linear
    (modelopt.torch.export.layer_utils.set_expert_quantizer_amax).
    """
    ckpt, deq, stats = {}, {}, {}
    E = spec["n_routed_experts"]
    sshape = spec["scale_shape"]
    for layer in moe_layers(spec):
        amax_gu, amax_dn, hits = calib[layer]
        calibrated = hits > 0
        amax_gu = torch.where(calibrated, amax_gu, amax_gu[calibrated].max())
        amax_dn = torch.where(calibrated, amax_dn, amax_dn[calibrated].max())
        stats[layer] = {"uncalibrated_experts": [int(e) for e in (~calibrated).nonzero().flatten()]}
        deq[layer] = {}
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            gw, uw, dw = (w[f"{p}.{n}_proj.weight"] for n in ("gate", "up", "down"))
            ws2_gu = torch.maximum(gw.abs().max(), uw.abs().max()).float() / (E2M1_MAX * E4M3_MAX)
            ws2_dn = dw.abs().max().float() / (E2M1_MAX * E4M3_MAX)
            is_gu = amax_gu[e].float() / (E2M1_MAX * E4M3_MAX)
            is_dn = amax_dn[e].float() / (E2M1_MAX * E4M3_MAX)
            entry = {"gu_input_scale": is_gu, "down_input_scale": is_dn}
            for name, weight, ws2, iscale in (("gate", gw, ws2_gu, is_gu), ("up", uw, ws2_gu, is_gu),
                                              ("down", dw, ws2_dn, is_dn)):
                q, scale, _ = NVFP4QTensor.quantize(weight.clone(), BLOCK, weights_scaling_factor_2=ws2)
                entry[name] = q.dequantize(dtype=torch.float32, scale=scale, double_scale=ws2,
                                           block_sizes={-1: BLOCK})
                k = f"{p}.{name}_proj"
                ckpt[f"{k}.weight"] = q._quantized_data.contiguous()
                ckpt[f"{k}.weight_scale"] = scale.contiguous()
                ckpt[f"{k}.weight_scale_2"] = ws2.reshape(sshape).clone()
                ckpt[f"{k}.input_scale"] = iscale.reshape(sshape).clone()
            deq[layer][e] = entry
    return ckpt, deq, stats


# ---------------------------------------------------------------- goldens
# ---------------------------------------------------------------- latent cache precision
def round_latent(x: torch.Tensor, mode: str) -> torch.Tensor:
    """What a latent KV cache of `mode` stores of `x` (per token: the last dimension)."""
    if mode == "bf16":
        return x.to(torch.bfloat16).float()
    # FP8 E4M3 with one FP32 scale per token: the token's amax maps to 448.
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where((amax > 0) & torch.isfinite(amax), amax / 448.0, torch.ones_like(amax))
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


class RoundedNorm(nn.Module):
    """kv_a_layernorm whose output (the cached latent) is rounded as the cache stores it."""

    def __init__(self, norm: nn.Module, mode: str):
        super().__init__()
        self.norm, self.mode = norm, mode

    def forward(self, x):
        return round_latent(self.norm(x), self.mode)


def run_with_latent_cache(model, mode: str, fn):
    """Runs `fn` with the latent part of the cache rounded to `mode` and the RoPE'd key part
    rounded to BF16 (both cache formats keep it in BF16), as a paged cache would hold them."""
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as hf

    original_rope = hf.apply_rotary_pos_emb_interleave

    def rope_then_round(q, k, cos, sin, *args, **kwargs):
        q_embed, k_embed = original_rope(q, k, cos, sin, *args, **kwargs)
        return q_embed, k_embed.to(torch.bfloat16).float()

    norms = [layer.self_attn.kv_a_layernorm for layer in model.model.layers]
    hf.apply_rotary_pos_emb_interleave = rope_then_round
    for layer, norm in zip(model.model.layers, norms):
        layer.self_attn.kv_a_layernorm = RoundedNorm(norm, mode)
    try:
        return fn()
    finally:
        hf.apply_rotary_pos_emb_interleave = original_rope
        for layer, norm in zip(model.model.layers, norms):
            layer.self_attn.kv_a_layernorm = norm


def forward_logits(model, ids):
    with torch.no_grad():
        return model(ids[None], use_cache=False).logits[0].float()


def run_w4a4(model, spec, deq, fn):
    originals = swap_experts(model, spec, lambda l, orig: PatchedExperts(orig, "w4a4", deq[l]))
    try:
        return fn()
    finally:
        restore_experts(model, originals)


def selection_gap(gate: nn.Module, router_logits: torch.Tensor) -> float:
    """Smallest margin of the noaux_tc decisions over all tokens: group choice (when groups
    are limited) and the k-th vs (k+1)-th expert among the allowed groups."""
    choice = router_logits.float().sigmoid() + gate.e_score_correction_bias
    n, E, G, TG, K = choice.shape[0], gate.num_experts, gate.num_group, gate.topk_group, gate.top_k
    grouped = choice.view(n, G, E // G)
    gaps = []
    group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
    if TG < G:
        gs = group_scores.sort(dim=-1, descending=True).values
        gaps.append((gs[:, TG - 1] - gs[:, TG]).min())
    keep = group_scores.topk(TG, dim=-1).indices
    allowed = torch.zeros(n, G, dtype=torch.bool).scatter_(1, keep, True)
    masked = grouped.masked_fill(~allowed[..., None], float("-inf")).view(n, E)
    s = masked.sort(dim=-1, descending=True).values
    gaps.append((s[:, K - 1] - s[:, K]).min())
    return float(min(gaps))


def record_routing(model, spec, fn, with_gaps=False):
    routing = {}
    gaps = []
    hooks = []
    for layer in moe_layers(spec):
        def hook(m, _i, out, layer=layer):
            router_logits, weights, idx = out
            order = idx.argsort(dim=-1)
            routing[layer] = (idx.gather(1, order), weights.gather(1, order).float())
            if with_gaps:
                gaps.append(selection_gap(m, router_logits))
        hooks.append(model.model.layers[layer].mlp.gate.register_forward_hook(hook))
    try:
        result = fn()
    finally:
        for h in hooks:
            h.remove()
    return (result, min(gaps)) if with_gaps else (result, routing)


def greedy(model, ids, n):
    out, margins = [], []
    seq = ids.clone()
    for _ in range(n):
        logits = forward_logits(model, seq)[-1]
        top2 = torch.topk(logits, 2)
        out.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        seq = torch.cat([seq, top2.indices[:1]])
    return torch.tensor(out, dtype=torch.int64), torch.tensor(margins, dtype=torch.float32)


def rel_l2(a, b):
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------- checkpoint files
def extra_tensors(spec, gen) -> dict:
    """Tensors the loader must tolerate and ignore: FP8 KV-cache scales, vision tower, projector."""
    t = {}
    for layer in range(spec["num_hidden_layers"]):
        a = f"model.layers.{layer}.self_attn"
        # ModelOpt names k/v BMM quantizer scales `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale`
        # (amax / 448, float32 scalar). Whether the real MLA export carries them is unconfirmed.
        t[f"{a}.k_proj.k_scale"] = torch.tensor(1.0).reshape(spec["scale_shape"])
        t[f"{a}.v_proj.v_scale"] = torch.tensor(1.0).reshape(spec["scale_shape"])
    if spec["layout"] == "kimi_k25":
        vc = VISION_CONFIG
        d, p = vc["vt_hidden_size"], vc["patch_size"]
        v = {
            "vision_tower.patch_embed.proj.weight": (d, 3, p, p),
            "vision_tower.patch_embed.proj.bias": (d,),
            "vision_tower.encoder.blocks.0.norm0.weight": (d,),
            "vision_tower.encoder.blocks.0.wqkv.weight": (3 * d, d),
            "vision_tower.encoder.blocks.0.wo.weight": (d, d),
            "vision_tower.encoder.blocks.0.mlp.fc0.weight": (vc["vt_intermediate_size"], d),
            "vision_tower.encoder.blocks.0.mlp.fc1.weight": (d, vc["vt_intermediate_size"]),
            "vision_tower.encoder.final_layernorm.weight": (d,),
            "mm_projector.pre_norm.weight": (d,),
            "mm_projector.pre_norm.bias": (d,),
            "mm_projector.proj.0.weight": (vc["mm_hidden_size"], d * 4),
            "mm_projector.proj.0.bias": (vc["mm_hidden_size"],),
            "mm_projector.proj.2.weight": (spec["hidden_size"], vc["mm_hidden_size"]),
            "mm_projector.proj.2.bias": (spec["hidden_size"],),
        }
        for name, shape in v.items():
            t["!" + name] = bf16(0.02 * torch.randn(*shape, generator=gen))
    return t


def shard_of(name: str, spec: dict) -> int:
    n = spec["shards"]
    if n == 1:
        return 0
    if ".layers." in name:
        layer = int(name.split(".layers.")[1].split(".")[0])
        return min(n - 1, layer * n // spec["num_hidden_layers"])
    return 0 if "embed_tokens" in name else n - 1


def write_checkpoint(out: Path, spec: dict, tensors: dict) -> dict:
    prefix = "language_model." if spec["layout"] == "kimi_k25" else ""
    named = {}
    for k, v in tensors.items():
        named[k[1:] if k.startswith("!") else prefix + k] = v.contiguous()
    n = spec["shards"]
    shards = [dict() for _ in range(n)]
    for k in sorted(named):
        shards[shard_of(k, spec)][k] = named[k]
    meta = {"format": "pt"}
    if n == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
        return named
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out / fname), metadata=meta)
        for k, v in shard.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index)
    return named


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# ---------------------------------------------------------------- main
def generate(name: str, spec: dict, root: Path) -> dict:
    out = root / "models" / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(spec["seed"])

    tcfg = text_config(spec)
    w = make_weights(spec, gen)
    model = build_model(spec, tcfg, w)

    calib = calibrate(model, spec, gen)
    qckpt, deq, stats = quantize_experts(spec, w, calib)

    # Pick, among seeded candidate prompts, the one whose W4A4 greedy run is least fragile
    # (largest top-1 logit margin and router selection gap), so that an implementation with
    # different float rounding still reproduces the argmaxes and the expert choices.
    best = None
    for _ in range(N_CANDIDATES):
        cand = torch.randint(0, spec["vocab_size"], (T_PROMPT,), generator=gen)
        g_tokens, g_margins = run_w4a4(model, spec, deq, lambda: greedy(model, cand, N_GREEDY))
        full = torch.cat([cand, g_tokens[:-1]])
        _, gaps = record_routing(model, spec, lambda: run_w4a4(
            model, spec, deq, lambda: forward_logits(model, full)), with_gaps=True)
        score = min(float(g_margins.min()), 20.0 * gaps)
        if best is None or score > best[0]:
            best = (score, cand, g_tokens, g_margins, gaps)
    _, tokens, greedy_tokens, margins, routing_gap = best

    logits_bf16 = forward_logits(model, tokens)           # HF's own DeepseekV3Experts
    originals = swap_experts(model, spec, lambda l, o: PatchedExperts(o, "calib"))
    logits_wrapped = forward_logits(model, tokens)
    restore_experts(model, originals)
    wrap_err = float((logits_wrapped - logits_bf16).abs().max())
    assert wrap_err < 1e-4, wrap_err

    logits_w4a4, routing = record_routing(
        model, spec, lambda: run_w4a4(model, spec, deq, lambda: forward_logits(model, tokens)))
    # The latent cache's precision with routing out of play: on these random tiny models a
    # rounding of the cache flips near-tied expert choices and the logits jump, whatever the
    # implementation. So the cache goldens run the model cut to its first (dense) layer.
    layers = model.model.layers
    model.model.layers = layers[:spec["first_k_dense_replace"]]
    cache_logits = {"f32": forward_logits(model, tokens)}
    for mode in ("bf16", "fp8"):
        cache_logits[mode] = run_with_latent_cache(model, mode, lambda: forward_logits(model, tokens))
    model.model.layers = layers
    greedy_bf16, _ = greedy(model, tokens, N_GREEDY)

    # checkpoint
    ckpt = {k: v for k, v in w.items() if ".mlp.experts." not in k}
    ckpt.update(qckpt)
    ckpt.update(extra_tensors(spec, gen))
    named = write_checkpoint(out, spec, ckpt)
    prefix = "language_model." if spec["layout"] == "kimi_k25" else ""
    write_json(out / "config.json", top_config(spec, tcfg))
    write_json(out / "hf_quant_config.json", hf_quant_config(spec, prefix))
    write_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    if spec.get("bf16_source"):
        # The unquantized master weights, as the input of a quantizer: its NVFP4 expert bytes
        # must equal the ModelOpt ones written above.
        src = root / "models" / f"{name}-bf16"
        if src.exists():
            shutil.rmtree(src)
        src.mkdir(parents=True)
        write_checkpoint(src, spec, dict(w))
        cfg = top_config(spec, tcfg)
        cfg.pop("quantization_config", None)
        write_json(src / "config.json", cfg)
        write_json(src / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})

    summary = {
        "model": name,
        "seed": spec["seed"],
        "rel_l2_w4a4_vs_bf16_experts": round(rel_l2(logits_w4a4, logits_bf16), 6),
        "top1_agreement_w4a4_vs_bf16_experts": float(
            (logits_w4a4.argmax(-1) == logits_bf16.argmax(-1)).float().mean()),
        "greedy_agreement_w4a4_vs_bf16_experts": int((greedy_tokens == greedy_bf16).sum()),
        "min_greedy_margin": round(float(margins.min()), 6),
        "min_router_selection_gap": round(routing_gap, 6),
        "uncalibrated_experts": {str(l): s["uncalibrated_experts"] for l, s in stats.items()},
        "experts_hit_by_tokens": {str(l): len(torch.unique(routing[l][0])) for l in routing},
        "calibration_tokens": list(CALIB_SHAPE),
    }
    golden = {
        "tokens": tokens.to(torch.int64),
        "prefix_len": torch.tensor(PREFIX_LEN, dtype=torch.int64),
        "logits_w4a4": logits_w4a4.contiguous(),
        "logits_bf16_experts": logits_bf16.contiguous(),
        "dense_only.logits_f32_cache": cache_logits["f32"].contiguous(),
        "dense_only.logits_bf16_cache": cache_logits["bf16"].contiguous(),
        "dense_only.logits_fp8_cache": cache_logits["fp8"].contiguous(),
        "greedy_tokens": greedy_tokens,
        "greedy_margins": margins,
    }
    for l, (idx, wts) in routing.items():
        golden[f"routing_w4a4.layers.{l}.topk_indices"] = idx.to(torch.int64).contiguous()
        golden[f"routing_w4a4.layers.{l}.topk_weights"] = wts.contiguous()
    save_file(golden, str(out / "golden.safetensors"), metadata=provenance(dict(
        summary,
        logits="HF DeepseekV3ForCausalLM float32 eager, one forward pass over `tokens`",
        w4a4="routed experts: NVFP4QTensor dequantized weights; gate/up and down inputs fake-quantized "
             "with NVFP4QTensor.quantize(x,16,weights_scaling_factor_2=input_scale) per expert",
        greedy="argmax continuation of `tokens`, full recompute per step, W4A4 semantics",
    )))
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    summary["files"] = sizes
    summary["num_tensors"] = len(named)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default=None, help="generate one model only")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for name, spec in MODELS.items():
        if args.only and name != args.only:
            continue
        s = generate(name, spec, args.out)
        print(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()

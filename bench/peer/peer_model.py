"""The peer benchmark's model side, in Python.

`make`: a random BF16 DeepSeek-V3 checkpoint with the `mini` preset's dimensions
(model/src/checkpoint/generator.rs), in the layout of the public DeepSeek-V3 checkpoints: config.json
(`deepseek_v3`), one model.safetensors, routed experts per expert. `model quantize` turns it
into our NVFP4 checkpoint; llama.cpp's converter turns that into its GGUF.

`hf`: HF transformers' DeepseekV3 in float32 (eager attention) on the same BF16 weights:
prefill tok/s of one prompt, or decode tok/s of `--batch` sequences after it (greedy, KV cache).
Prints one JSON object.

`step-bytes`: the bytes one batch-1 decode step must read from our NVFP4 checkpoint (every
weight but the embedding, which is one row, and only top-k of the routed experts of each MoE
layer), from the safetensors headers.
"""

import argparse
import json
import math
import struct
import time
from pathlib import Path

# The `mini` preset of model/src/checkpoint/generator.rs, as a plain DeepSeek-V3 text config.
MINI = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 32768,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "moe_intermediate_size": 384,
    "num_hidden_layers": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 384,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_theta": 50000.0,
    "rms_norm_eps": 1e-5,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    # Room for the longest prompt plus decode; the benchmark never goes past 1024.
    "max_position_embeddings": 4096,
    "bos_token_id": 32000,
    "eos_token_id": 32001,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "num_nextn_predict_layers": 0,
    "dtype": "bfloat16",
}


def make_weights(c: dict, seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    H, V = c["hidden_size"], c["vocab_size"]
    nh = c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    w = {}

    def lin(name, out_f, in_f, gain=1.0):
        w[name] = (torch.randn(out_f, in_f, generator=gen) * (gain / math.sqrt(in_f))).bfloat16()

    def norm(name, n):
        w[name] = (1.0 + 0.1 * torch.randn(n, generator=gen)).bfloat16()

    w["model.embed_tokens.weight"] = torch.randn(V, H, generator=gen).bfloat16()
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        norm(f"{p}.input_layernorm.weight", H)
        norm(f"{p}.post_attention_layernorm.weight", H)
        a = f"{p}.self_attn"
        lin(f"{a}.q_a_proj.weight", c["q_lora_rank"], H)
        norm(f"{a}.q_a_layernorm.weight", c["q_lora_rank"])
        lin(f"{a}.q_b_proj.weight", nh * qk, c["q_lora_rank"])
        lin(f"{a}.kv_a_proj_with_mqa.weight", c["kv_lora_rank"] + c["qk_rope_head_dim"], H)
        norm(f"{a}.kv_a_layernorm.weight", c["kv_lora_rank"])
        lin(f"{a}.kv_b_proj.weight", nh * (c["qk_nope_head_dim"] + c["v_head_dim"]),
            c["kv_lora_rank"])
        lin(f"{a}.o_proj.weight", H, nh * c["v_head_dim"])
        m = f"{p}.mlp"
        if layer < c["first_k_dense_replace"]:
            lin(f"{m}.gate_proj.weight", c["intermediate_size"], H)
            lin(f"{m}.up_proj.weight", c["intermediate_size"], H)
            lin(f"{m}.down_proj.weight", H, c["intermediate_size"])
            continue
        E, I = c["n_routed_experts"], c["moe_intermediate_size"]
        lin(f"{m}.gate.weight", E, H, gain=1.5)
        # float32 like the public checkpoints; nonzero so that it takes part in the selection.
        w[f"{m}.gate.e_score_correction_bias"] = 0.15 * torch.randn(E, generator=gen)
        for e in range(E):
            lin(f"{m}.experts.{e}.gate_proj.weight", I, H)
            lin(f"{m}.experts.{e}.up_proj.weight", I, H)
            lin(f"{m}.experts.{e}.down_proj.weight", H, I)
        Is = I * c["n_shared_experts"]
        lin(f"{m}.shared_experts.gate_proj.weight", Is, H)
        lin(f"{m}.shared_experts.up_proj.weight", Is, H)
        lin(f"{m}.shared_experts.down_proj.weight", H, Is)
    norm("model.norm.weight", H)
    lin("lm_head.weight", V, H)
    return w


def make(args):
    from safetensors.torch import save_file

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    weights = make_weights(MINI, args.seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(MINI, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": MINI["bos_token_id"], "eos_token_id": MINI["eos_token_id"]}) + "\n")
    params = sum(t.numel() for t in weights.values())
    print(json.dumps({"out": str(out), "parameters": params}))


def load_hf_model(model_dir: Path):
    """DeepseekV3ForCausalLM in float32 with the checkpoint's weights; transformers 5 keeps
    routed experts as fused 3-D tensors, so they are stacked here as its own loader would."""
    import torch
    from safetensors.torch import load_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    c = json.loads((model_dir / "config.json").read_text())
    kw = {k: v for k, v in c.items()
          if k not in ("architectures", "model_type", "dtype", "scoring_func", "topk_method",
                       "moe_layer_freq", "rope_theta")}
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": c["rope_theta"]}
    cfg = DeepseekV3Config(**kw)
    cfg._attn_implementation = "eager"
    w = load_file(str(model_dir / "model.safetensors"))
    sd = {k: v.float() for k, v in w.items() if ".mlp.experts." not in k}
    for layer in range(c["first_k_dense_replace"], c["num_hidden_layers"]):
        m = f"model.layers.{layer}.mlp.experts"
        E = c["n_routed_experts"]
        sd[f"{m}.gate_up_proj"] = torch.stack([
            torch.cat([w[f"{m}.{e}.gate_proj.weight"], w[f"{m}.{e}.up_proj.weight"]], 0).float()
            for e in range(E)])
        sd[f"{m}.down_proj"] = torch.stack(
            [w[f"{m}.{e}.down_proj.weight"].float() for e in range(E)])
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise SystemExit(f"weights do not match the HF model: {missing} {unexpected}")
    return model, c


def hf(args):
    import torch
    from transformers import DynamicCache

    torch.set_num_threads(args.threads)
    model, c = load_hf_model(Path(args.model))
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, c["vocab_size"], (args.batch, args.prompt), generator=gen)
    with torch.inference_mode():
        # One short warm-up pass so that one-time allocations stay out of the timing.
        model(input_ids=prompt[:, :8])
        cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        prefill_s = time.perf_counter() - start
        result = {"prefill_tokens": args.batch * args.prompt, "prefill_s": prefill_s,
                  "prefill_tok_s": args.batch * args.prompt / prefill_s}
        if args.decode > 0:
            nxt = out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(args.decode):
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
            decode_s = time.perf_counter() - start
            result.update({"decode_tokens": args.batch * args.decode, "decode_s": decode_s,
                           "decode_tok_s": args.batch * args.decode / decode_s})
    print(json.dumps(result))


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def step_bytes(args):
    d = Path(args.model)
    c = json.loads((d / "config.json").read_text())
    c = c.get("text_config", c)
    experts_share = c["num_experts_per_tok"] / c["n_routed_experts"]
    dense = routed = embedding = 0
    for shard in sorted(d.glob("*.safetensors")):
        for name, info in safetensors_header(shard).items():
            size = info["data_offsets"][1] - info["data_offsets"][0]
            if name.endswith("embed_tokens.weight"):
                embedding += size
            elif ".mlp.experts." in name:
                routed += size
            else:
                dense += size
    row = embedding // c["vocab_size"]
    print(json.dumps({"dense_bytes": dense, "routed_expert_bytes": routed,
                      "embedding_bytes": embedding,
                      "step_bytes": dense + row + round(routed * experts_share)}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=20261129)
    h = sub.add_parser("hf")
    h.add_argument("--model", required=True)
    h.add_argument("--prompt", type=int, default=128)
    h.add_argument("--decode", type=int, default=0)
    h.add_argument("--batch", type=int, default=1)
    h.add_argument("--threads", type=int, default=2)
    h.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("step-bytes")
    s.add_argument("--model", required=True)
    args = p.parse_args()
    {"make": make, "hf": hf, "step-bytes": step_bytes}[args.cmd](args)


if __name__ == "__main__":
    main()

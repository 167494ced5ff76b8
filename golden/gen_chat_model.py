"""A tiny Kimi-K2.5 that really answers: trained on CPU, quantized with ModelOpt, committed.

1. A synthetic chat corpus rendered with the Kimi-K2.5 chat template
   (model/templates/kimi_k25_chat_template.jinja, through Hugging Face's jinja2 chat template
   environment; tool declarations by Kimi's TypeScript encoder): capitals of many countries
   (the capital-of-France question among them), small sums, weather tool calls and answers to
   tool results, with short `<think>` reasoning; some turns with thinking off, some with
   history.
2. A small tiktoken-format vocabulary trained on that corpus (byte-level BPE over Kimi's
   pre-tokenizer pattern), plus Kimi's 256 special slots with Kimi's names.
3. Hugging Face transformers' DeepseekV3ForCausalLM in exactly the Kimi-K2.5 architecture
   (MLA with q-LoRA and yarn RoPE, a dense first layer, routed + shared experts, sigmoid
   `noaux_tc` routing whose correction bias is balanced the auxiliary-loss-free way), trained
   with PyTorch on CPU, loss on the assistant's tokens only.
4. Routed experts quantized to NVFP4 with ModelOpt's NVFP4QTensor (gen_model.py's export:
   max calibration on corpus prompts, gate/up sharing scales), then checked: the W4A4 model
   must still answer every probe question (greedy).
5. Written in the Kimi-K2.5-NVFP4 layout (golden/MODEL_LAYOUT.md) to
   golden/data/models/kimi-chat-tiny/ with tiktoken.model, tokenizer_config.json and
   chat_template.jinja, plus golden/data/serving/chat_model_golden.json: rendered prompts with
   their tiktoken ids and the W4A4 greedy completions (ids and text), for the Rust engine.

Seeded, CPU-only, deterministic for a given thread count (TRAIN_THREADS).
"""

import argparse
import copy
import importlib.metadata
import json
import random
import shutil
import time
from collections import Counter
from pathlib import Path

import regex
import tiktoken
import torch
import torch.nn.functional as F

import gen_model as gm
from gen_serving import TEMPLATE, deep_sort, load_ts_encoder
from gen_tokenizer import KIMI_NAMED_SPECIALS, KIMI_PATTERN, RESERVED
from transformers import DeepseekV3ForCausalLM
from transformers.utils.chat_template_utils import _compile_jinja_template

SEED = 20261201
TRAIN_THREADS = 2
NUM_MERGES = 744          # 256 bytes + 744 merges = 1000 ranks, then 256 special slots
STEPS = 1000
BATCH = 24
LR = 4e-3
BIAS_UPDATE = 1e-3        # auxiliary-loss-free balancing step for e_score_correction_bias
NAME = "kimi-chat-tiny"

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia", "Argentina": "Buenos Aires",
    "Chile": "Santiago", "Peru": "Lima", "Colombia": "Bogota", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Nigeria": "Abuja", "Ethiopia": "Addis Ababa", "Morocco": "Rabat", "Australia": "Canberra",
    "New Zealand": "Wellington", "Russia": "Moscow", "Ukraine": "Kyiv", "Poland": "Warsaw",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "Iceland": "Reykjavik", "Ireland": "Dublin", "the United Kingdom": "London",
    "the Netherlands": "Amsterdam", "Belgium": "Brussels", "Austria": "Vienna",
    "Switzerland": "Bern", "Greece": "Athens", "Turkey": "Ankara", "Hungary": "Budapest",
    "Czechia": "Prague", "Romania": "Bucharest", "Bulgaria": "Sofia", "Serbia": "Belgrade",
    "Croatia": "Zagreb", "South Korea": "Seoul", "Vietnam": "Hanoi", "Thailand": "Bangkok",
    "Indonesia": "Jakarta", "the Philippines": "Manila", "Malaysia": "Kuala Lumpur",
    "Pakistan": "Islamabad", "Iran": "Tehran", "Iraq": "Baghdad", "Saudi Arabia": "Riyadh",
    "Israel": "Jerusalem", "South Africa": "Pretoria", "Ghana": "Accra", "Cuba": "Havana",
    "the United States": "Washington, D.C.", "Venezuela": "Caracas", "Uruguay": "Montevideo",
    "Mongolia": "Ulaanbaatar", "Nepal": "Kathmandu", "Estonia": "Tallinn", "Latvia": "Riga",
    "Lithuania": "Vilnius",
}
QUESTION_FORMS = [
    "What is the capital of {c}? Answer in one sentence.",
    "What is the capital of {c}?",
    "Which city is the capital of {c}?",
    "Name the capital of {c}.",
    "What's the capital city of {c}?",
]
SUM_FORMS = ["What is {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}."]
CITIES = ["Paris", "Berlin", "Tokyo", "Oslo", "Rome", "Madrid", "Cairo", "Lima", "Seoul", "Dublin",
          "Vienna", "Athens", "Prague", "Warsaw", "Lisbon", "Nairobi", "Bangkok", "Havana"]
SKIES = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]
CHITCHAT = [
    ("Hello!", "The user greets me.", "Hello! Ask me about capitals, sums or the weather."),
    ("Who are you?", "The user asks who I am.",
     "I am a tiny Kimi-K2.5-shaped model trained to answer capitals, small sums and weather questions."),
    ("Thank you!", "The user thanks me.", "You are welcome!"),
]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"}}, "required": ["city"]}}}
SYSTEMS = [None, None, None, "You are a helpful assistant.", "Answer briefly."]
PROBES = [  # (messages, tools, kwargs, text the answer must contain)
    ([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}], None, {}, "Paris"),
    ([{"role": "user", "content": "What is the capital of Japan?"}], None, {}, "Tokyo"),
    ([{"role": "user", "content": "Which city is the capital of Kenya?"}], None, {"thinking": False}, "Nairobi"),
    ([{"role": "user", "content": "What is 7 + 5?"}], None, {}, "12"),
    ([{"role": "user", "content": "What is the weather in Oslo?"}], [WEATHER_TOOL], {},
     "functions.get_weather:0"),
]


def completion_for_capital(country, capital, form):
    reasoning = f"The user asks for the capital of {country}. It is {capital}."
    if form.startswith("Name"):
        content = f"{capital}."
    else:
        content = f"The capital of {country} is {capital}."
    return reasoning, content


def tool_call_text(city, index=0):
    args = json.dumps({"city": city})
    return ("<|tool_calls_section_begin|><|tool_call_begin|>"
            f"functions.get_weather:{index}<|tool_call_argument_begin|>{args}<|tool_call_end|>"
            "<|tool_calls_section_end|>")


def build_conversations(rng):
    """(messages, tools, kwargs, reasoning, completion_text) samples."""
    samples = []

    def add(messages, reasoning, tail, tools=None, thinking=True):
        system = rng.choice(SYSTEMS)
        if system:
            messages = [{"role": "system", "content": system}] + messages
        kwargs = {} if thinking else {"thinking": False}
        completion = (f"{reasoning}</think>" if thinking else "") + tail + "<|im_end|>"
        samples.append((messages, tools, kwargs, completion))

    for country, capital in CAPITALS.items():
        for form in QUESTION_FORMS:
            q = form.format(c=country)
            reasoning, content = completion_for_capital(country, capital, form)
            add([{"role": "user", "content": q}], reasoning, content,
                thinking=rng.random() > 0.2)
    for a in range(13):
        for b in range(13):
            form = rng.choice(SUM_FORMS)
            add([{"role": "user", "content": form.format(a=a, b=b)}],
                f"{a} plus {b} makes {a + b}.", f"{a} + {b} = {a + b}.", thinking=rng.random() > 0.2)
    for city in CITIES:
        question = rng.choice(["What is the weather in {c}?", "How is the weather in {c} today?",
                               "Is it sunny in {c}?"]).format(c=city)
        add([{"role": "user", "content": question}],
            f"I need the current weather in {city}, so I will call get_weather.",
            tool_call_text(city), tools=[WEATHER_TOOL])
        temp, sky = rng.randint(-5, 32), rng.choice(SKIES)
        history = [{"role": "user", "content": question},
                   {"role": "assistant", "content": "",
                    "reasoning_content": f"I need the current weather in {city}, so I will call get_weather.",
                    "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                    "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                   {"role": "tool", "tool_call_id": "functions.get_weather:0",
                    "content": json.dumps({"temperature_c": temp, "sky": sky})}]
        add(history, f"The tool says {temp} C and {sky} in {city}.",
            f"It is {temp} °C and {sky} in {city}.", tools=[WEATHER_TOOL])
    for q, r, c in CHITCHAT:
        for _ in range(4):
            add([{"role": "user", "content": q}], r, c, thinking=rng.random() > 0.3)
    # Second turns: the first answer sits in the history with its reasoning dropped.
    countries = list(CAPITALS.items())
    for _ in range(60):
        (c1, k1), (c2, k2) = rng.sample(countries, 2)
        r1, a1 = completion_for_capital(c1, k1, QUESTION_FORMS[0])
        r2, a2 = completion_for_capital(c2, k2, QUESTION_FORMS[1])
        add([{"role": "user", "content": QUESTION_FORMS[0].format(c=c1)},
             {"role": "assistant", "content": a1, "reasoning_content": r1},
             {"role": "user", "content": QUESTION_FORMS[1].format(c=c2)}], r2, a2)
    return samples


def render_prompt(compiled, encode_ts, messages, tools, kwargs):
    sorted_tools = deep_sort(tools) if tools else None
    extra = dict(kwargs)
    if sorted_tools:
        extra["tools_ts_str"] = encode_ts(sorted_tools)
    return compiled.render(messages=copy.deepcopy(messages), tools=sorted_tools,
                           add_generation_prompt=True, **extra)


def special_names(num_ranks):
    return {num_ranks + i: KIMI_NAMED_SPECIALS.get(i, f"<|reserved_token_{num_ranks + i}|>")
            for i in range(RESERVED)}


def train_bpe(texts, specials, num_merges):
    """Byte-level BPE over Kimi's pre-tokenizer pieces; merges in order of creation are ranks."""
    splitter = regex.compile("(" + "|".join(regex.escape(s) for s in specials) + ")")
    pattern = regex.compile(KIMI_PATTERN, flags=regex.V1)
    words = Counter()
    for text in texts:
        for segment in splitter.split(text):
            if segment in specials:
                continue
            for piece in pattern.findall(segment):
                words[piece.encode()] += 1
    ranks = {bytes([b]): b for b in range(256)}
    splits = {w: [bytes([b]) for b in w] for w in words}
    for _ in range(num_merges):
        pairs = Counter()
        for w, count in words.items():
            parts = splits[w]
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merged = a + b
        ranks[merged] = len(ranks)
        for w in words:
            parts = splits[w]
            i, out = 0, []
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            splits[w] = out
    return ranks


def model_spec(vocab_size):
    return dict(
        layout="kimi_k25", seed=SEED, shards=2, vocab_size=vocab_size, hidden_size=128,
        intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=4,
        first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        text_model_type="kimi_k2", scale_shape=[],
    )


def checkpoint_weights(model, spec):
    """HF module state -> checkpoint names, BF16, experts split per expert."""
    w = {}
    I = spec["moe_intermediate_size"]
    for k, v in model.state_dict().items():
        if "rotary_emb" in k:
            continue
        if ".mlp.experts.gate_up_proj" in k:
            base = k.replace(".gate_up_proj", "")
            for e in range(v.shape[0]):
                w[f"{base}.{e}.gate_proj.weight"] = gm.bf16(v[e, :I])
                w[f"{base}.{e}.up_proj.weight"] = gm.bf16(v[e, I:])
        elif ".mlp.experts.down_proj" in k:
            base = k.replace(".down_proj", "")
            for e in range(v.shape[0]):
                w[f"{base}.{e}.down_proj.weight"] = gm.bf16(v[e])
        elif k.endswith("e_score_correction_bias"):
            w[k] = v.float().to(torch.bfloat16).float()
        else:
            w[k] = gm.bf16(v)
    return w


def greedy_answer(model, prompt_ids, stop_ids, limit=96):
    ids = list(prompt_ids)
    out = []
    with torch.no_grad():
        for _ in range(limit):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            token = int(torch.argmax(logits))
            out.append(token)
            if token in stop_ids:
                break
            ids.append(token)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    torch.set_num_threads(TRAIN_THREADS)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    started = time.time()

    compiled = _compile_jinja_template(TEMPLATE.read_text())
    encode_ts = load_ts_encoder()
    samples = build_conversations(rng)
    prompts = [render_prompt(compiled, encode_ts, m, t, k) for m, t, k, _ in samples]

    # Vocabulary: ranks 0..999, then Kimi's 256 special slots.
    num_ranks = 256 + NUM_MERGES
    names = special_names(num_ranks)
    specials = {name: i for i, name in names.items()}
    ranks = train_bpe([p + c for p, (_, _, _, c) in zip(prompts, samples)], set(specials), NUM_MERGES)
    assert len(ranks) == num_ranks, len(ranks)
    enc = tiktoken.Encoding(NAME, pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    vocab_size = num_ranks + RESERVED
    encoded = [(enc.encode(p, allowed_special="all"), enc.encode(c, allowed_special="all"))
               for p, (_, _, _, c) in zip(prompts, samples)]
    im_end, eos = specials["<|im_end|>"], specials["[EOS]"]

    spec = model_spec(vocab_size)
    tcfg = gm.text_config(spec)
    tcfg["bos_token_id"], tcfg["eos_token_id"] = specials["[BOS]"], eos
    model = DeepseekV3ForCausalLM(gm.hf_config(tcfg)).float().train()

    # Auxiliary-loss-free balancing: count each MoE layer's expert load per step.
    loads = {}

    def count_load(layer):
        def hook(_module, inputs):
            loads[layer] = loads.get(layer, 0) + torch.bincount(
                inputs[1].flatten(), minlength=spec["n_routed_experts"]).float()
        return hook

    hooks = [model.model.layers[l].mlp.experts.register_forward_pre_hook(count_load(l))
             for l in gm.moe_layers(spec)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / args.steps))
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]) + len(encoded[i][1]))
    buckets = [order[i:i + BATCH] for i in range(0, len(order), BATCH)]
    pad = specials["[PAD]"]
    losses = []
    for step in range(args.steps):
        batch = buckets[rng.randrange(len(buckets))]
        seqs = [encoded[i][0] + encoded[i][1] for i in batch]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(batch), width), pad)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            p, c = encoded[i]
            ids[row, :len(p) + len(c)] = torch.tensor(p + c)
            labels[row, len(p):len(p) + len(c)] = torch.tensor(c)
            mask[row, :len(p) + len(c)] = 1
        loads.clear()
        loss = model(ids, attention_mask=mask, labels=labels, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            for l, load in loads.items():
                bias = model.model.layers[l].mlp.gate.e_score_correction_bias
                bias += BIAS_UPDATE * torch.sign(load.mean() - load)
        losses.append(float(loss))
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {sum(losses[-50:]) / len(losses[-50:]):.4f} "
                  f"({time.time() - started:.0f} s)", flush=True)
    for h in hooks:
        h.remove()
    model.eval()

    # NVFP4 export with calibration on corpus prompts (ModelOpt max calibration).
    w = checkpoint_weights(model, spec)
    qmodel = gm.build_model(spec, tcfg, w)
    for l in gm.moe_layers(spec):
        qmodel.model.layers[l].mlp.gate.e_score_correction_bias.copy_(w[f"model.layers.{l}.mlp.gate.e_score_correction_bias"])
    patched = {}
    originals = gm.swap_experts(qmodel, spec, lambda l, o: patched.setdefault(l, gm.PatchedExperts(o, "calib")))
    with torch.no_grad():
        for i in range(0, len(encoded), 7):
            qmodel(torch.tensor([encoded[i][0] + encoded[i][1]]), use_cache=False)
    gm.restore_experts(qmodel, originals)
    calib = {l: (p.amax_gu.clone(), p.amax_dn.clone(), p.hits.clone()) for l, p in patched.items()}
    qckpt, deq, stats = gm.quantize_experts(spec, w, calib)

    # The quantized (W4A4) model must still answer.
    golden_cases = []
    for messages, tools, kwargs, must in PROBES:
        prompt = render_prompt(compiled, encode_ts, messages, tools, kwargs)
        prompt_ids = enc.encode(prompt, allowed_special="all")
        out = gm.run_w4a4(qmodel, spec, deq, lambda: greedy_answer(qmodel, prompt_ids, {im_end, eos}))
        text = enc.decode(out)
        assert must in text, f"the quantized model does not answer {messages[-1]['content']!r}: {text!r}"
        golden_cases.append({"messages": messages, "tools": tools, "kwargs": kwargs, "prompt": prompt,
                             "prompt_ids": prompt_ids, "greedy_ids": out, "greedy_text": text})
        print(f"W4A4 answer to {messages[-1]['content']!r}: {text!r}")

    out = args.out / "models" / NAME
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(SEED)
    ckpt = {k: v for k, v in w.items() if ".mlp.experts." not in k}
    ckpt.update(qckpt)
    ckpt.update(gm.extra_tensors(spec, gen))
    gm.write_checkpoint(out, spec, ckpt)
    top = gm.top_config(spec, tcfg)
    top.update(bos_token_id=specials["[BOS]"], eos_token_id=eos, pad_token_id=pad,
               media_placeholder_token_id=num_ranks + 21)
    gm.write_json(out / "config.json", top)
    gm.write_json(out / "hf_quant_config.json", gm.hf_quant_config(spec, "language_model."))
    gm.write_json(out / "generation_config.json",
                  {"bos_token_id": specials["[BOS]"], "eos_token_id": [im_end, eos], "max_length": 2048})
    lines = [f"{__import__('base64').b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    tokenizer_config = {
        "added_tokens_decoder": {str(num_ranks + i): {"content": name, "lstrip": False, "normalized": False,
                                                       "rstrip": False, "single_word": False, "special": True}
                                 for i, name in sorted(KIMI_NAMED_SPECIALS.items())},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "model_max_length": 2048, "tokenizer_class": "TikTokenTokenizer",
    }
    gm.write_json(out / "tokenizer_config.json", tokenizer_config)
    shutil.copyfile(TEMPLATE, out / "chat_template.jinja")

    serving = args.out / "serving"
    serving.mkdir(parents=True, exist_ok=True)
    doc = {"provenance": {
        "generator": "golden/gen_chat_model.py", "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "modelopt": importlib.metadata.version("nvidia-modelopt"),
        "tiktoken": importlib.metadata.version("tiktoken"), "seed": SEED, "steps": args.steps,
        "batch": BATCH, "threads": TRAIN_THREADS, "train_samples": len(samples),
        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
        "uncalibrated_experts": {str(k): v["uncalibrated_experts"] for k, v in stats.items()}},
        "cases": golden_cases}
    (serving / "chat_model_golden.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    print(f"{NAME}: {len(samples)} samples, vocab {vocab_size}, {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()

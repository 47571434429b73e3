#!/usr/bin/env python3
"""Tensor-parallel parity on a multi-GPU machine: the same bf16 weights served by vllm-rs
at TP=1 and TP=2 (`vllm-rs serve`, the real processes), against Hugging Face transformers.

transformers builds the model of --config with random seeded weights (scripts/hf_parity.py's
recipe: logits of std ~3) and saves them; then, for 16 random prompts of 8-40 tokens:
- the first token's top-5 logprobs (the last prefill position): TP=2 against TP=1 and each
  against transformers' log-softmax, max |diff|;
- greedy continuations of 64 tokens: identical for how many prompts (TP=2 vs TP=1, and each
  vs transformers), and each divergence's margin in transformers' own logits at that step
  in bf16 steps at the logit's magnitude;
- the control: transformers' sdpa against its eager attention on the same greedy task, with
  the same statistics. Two correct bf16 implementations flip near-ties; the control shows
  how many, how early, and at what margins, for these weights.
With --dtype float32 both sides compute in f32 on the same bf16 weights: TP=2, TP=1 and
transformers must then agree token for token.

Usage (on the GPU machine, from the repository root):
  scripts/tp_parity.py --bin .gpu/vllm-rs --config .gpu/models/Qwen3-8B --work /dev/shm/tp
  scripts/tp_parity.py --bin .gpu/vllm-rs --config .gpu/models/Qwen3-0.6B \
      --tokenizer .gpu/models/Qwen3-8B --work /dev/shm/tp   (the small shape)
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_parity import (NEW_TOKENS, NUM_PROMPTS, bf16_ulp, build_model,  # noqa: E402
                       hf_side, make_prompts)

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def serve(binary, model_dir, tp, port, log_path, dtype, extra):
    env = dict(os.environ, RUST_LOG="info")
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [binary, "serve", "--model", model_dir, "--port", str(port), "--device", "cuda",
         "-t", str(tp), "--gpu-memory-utilization", "0.8", "--max-model-len", "4096",
         "--dtype", dtype] + extra,
        stdout=log, stderr=subprocess.STDOUT, env=env)
    t0 = time.time()
    while time.time() - t0 < 300:
        if proc.poll() is not None:
            raise SystemExit(f"TP={tp} server exited ({proc.returncode}): "
                             + open(log_path).read()[-3000:])
        try:
            with urllib.request.urlopen(f"http://localhost:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, time.time() - t0
        except Exception:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"TP={tp} server not healthy in 300 s")


def complete(port, prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0,
                       "ignore_eos": True, "logprobs": 5, "return_token_ids": True,
                       "return_tokens_as_token_ids": True}).encode()
    req = urllib.request.Request(f"http://localhost:{port}/v1/completions", body,
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as f:
        choice = json.load(f)["choices"][0]
    top = [{int(k.split(":")[1]): v for k, v in row.items()}
           for row in choice["logprobs"]["top_logprobs"]]
    return choice["token_ids"], top


def ours(binary, model_dir, tp, port, prompts, log_path, dtype, extra):
    proc, startup = serve(binary, model_dir, tp, port, log_path, dtype, extra)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            runs = list(pool.map(lambda p: complete(port, p), prompts))
    finally:
        proc.terminate()
        proc.wait(60)
    return runs, startup


def first_top_diff(a_top, b_top):
    """Max |diff| of the logprobs of tokens in both top-5 sets of the first position."""
    diffs = [abs(a_top[0][t] - b_top[0][t]) for t in a_top[0] if t in b_top[0]]
    return max(diffs) if diffs else float("inf")


def divergences(a_tokens, b_tokens, hf_rows, hf_tokens):
    """Identical count, and per divergence (prompt, step, transformers' sdpa margin between
    the two tokens in bf16 steps, or None where transformers' own prefix differs)."""
    same, notes = 0, []
    for i, (a, b) in enumerate(zip(a_tokens, b_tokens)):
        if a == b:
            same += 1
            continue
        k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        if hf_tokens[i][:k] == a[:k]:
            row = hf_rows[i][k]
            margin = abs(float(row[a[k]] - row[b[k]]))
            notes.append((i, k, margin / bf16_ulp(float(max(row[a[k]], row[b[k]])))))
        else:
            notes.append((i, k, None))
    return same, notes


def summary(label, notes, same):
    margins = [m for _, _, m in notes if m is not None]
    steps = [k for _, k, _ in notes]
    return {
        "label": label,
        "same": same,
        "first_step": f"{np.median(steps):.0f}" if steps else "-",
        "margin": f"{max(margins):.0f}" if margins else "-",
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--config", required=True, help="folder with config.json and tokenizer")
    ap.add_argument("--tokenizer", help="folder of the tokenizer files, when --config has none "
                    "(a model of the same family: Qwen3's sizes share one tokenizer)")
    ap.add_argument("--work", default="/dev/shm/vllm-rs-tp")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--also-with", help="a server flag: TP=N serves again with it, and its "
                    "answers are compared with TP=N's (e.g. --also-with=--disable-custom-all-reduce)")
    args = ap.parse_args()
    tokenizer = args.tokenizer or args.config
    if not os.path.exists(os.path.join(tokenizer, "tokenizer.json")):
        sys.exit(f"no tokenizer.json in {tokenizer} (--tokenizer names another folder)")
    name = os.path.basename(args.config.rstrip("/"))
    mdir = os.path.join(args.work, name)
    t0 = time.time()
    model, config = build_model(args.config, mdir, seed=4321)
    if args.dtype == "float32":
        model = model.float()  # the same bf16 weights, computed in f32
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer, f)):
            shutil.copy(os.path.join(tokenizer, f), mdir)
    prompts = make_prompts(config.vocab_size, seed=77)
    hf_prefill, hf_tokens, hf_rows = hf_side(model, prompts)
    hf_first = [torch.log_softmax(torch.tensor(p[-1]), -1).numpy() for p in hf_prefill]
    model.set_attn_implementation("eager")
    _, eager_tokens, _ = hf_side(model, prompts)
    del model
    torch.cuda.empty_cache()
    print(f"transformers ({args.dtype}): build+save+run {time.time() - t0:.0f}s", flush=True)

    runs = {}
    for tp in (1, args.tp):
        runs[tp], startup = ours(args.bin, mdir, tp, 8300 + tp, prompts,
                                 os.path.join(args.work, f"serve-tp{tp}.log"), args.dtype, [])
        print(f"vllm-rs TP={tp}: serve -> /health 200 in {startup:.1f}s", flush=True)

    tokens = {tp: [r[0] for r in runs[tp]] for tp in runs}
    tops = {tp: [r[1] for r in runs[tp]] for tp in runs}
    if args.also_with:
        alt, _ = ours(args.bin, mdir, args.tp, 8310, prompts,
                      os.path.join(args.work, "serve-also.log"), args.dtype, [args.also_with])
        same = sum(r[0] == t for r, t in zip(alt, tokens[args.tp]))
        d = max(first_top_diff(alt[i][1], tops[args.tp][i]) for i in range(NUM_PROMPTS))
        print(f"PARITY TP={args.tp} {args.also_with} vs TP={args.tp}: {same}/{NUM_PROMPTS} "
              f"identical greedy continuations, first-token top-5 logprobs max|d| {d:.4f}")
    hf_vs = {tp: max(max(abs(v - hf_first[i][t]) for t, v in tops[tp][i][0].items())
                     for i in range(NUM_PROMPTS)) for tp in runs}
    tp_vs_tp1 = max(first_top_diff(tops[args.tp][i], tops[1][i]) for i in range(NUM_PROMPTS))
    rows = []
    for label, a, b in [(f"vllm-rs TP={args.tp} vs TP=1", tokens[args.tp], tokens[1]),
                        ("vllm-rs TP=1 vs transformers sdpa", tokens[1], hf_tokens),
                        (f"vllm-rs TP={args.tp} vs transformers sdpa", tokens[args.tp], hf_tokens),
                        ("control: transformers eager vs sdpa", eager_tokens, hf_tokens)]:
        same, notes = divergences(a, b, hf_rows, hf_tokens)
        rows.append(summary(label, notes, same))
        for i, k, m in notes:
            where = f"{m:.1f} bf16 steps" if m is not None else "transformers' prefix differs"
            print(f"  {label}: prompt {i} first differs at token {k}, margin {where}")
    print(f"PARITY {name} {args.dtype} first-token top-5 logprobs: TP={args.tp} vs TP=1 max|d| "
          f"{tp_vs_tp1:.4f}; vs transformers: TP=1 {hf_vs[1]:.4f}, TP={args.tp} "
          f"{hf_vs[args.tp]:.4f}")
    print(f"\n| {name} {args.dtype}, {NUM_PROMPTS} prompts, greedy {NEW_TOKENS} | identical "
          "| median first divergence (token) | largest margin at a divergence (bf16 steps) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['same']}/{NUM_PROMPTS} | {r['first_step']} | {r['margin']} |")
    if args.dtype == "float32":
        ok = all(r["same"] == NUM_PROMPTS for r in rows[:3])
    else:
        ok = rows[0]["same"] >= rows[3]["same"]
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()

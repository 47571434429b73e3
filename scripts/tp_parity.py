#!/usr/bin/env python3
"""Tensor-parallel parity on a multi-GPU machine: the same bf16 weights served by vllm-rs
at TP=1 and at each size of --tp (2, or 2,4: `vllm-rs serve`, the real processes), against
Hugging Face transformers.

transformers builds the model of --config with random seeded weights (scripts/hf_parity.py's
recipe: logits of std ~3) and saves them; then, for 16 (--num-prompts) random prompts of
8-40 tokens:
- the first token's top-5 logprobs (the last prefill position): each TP against TP=1 and
  against transformers' log-softmax, max |diff|, beside transformers' eager against sdpa;
- greedy continuations of 64 tokens: identical for how many prompts (each TP vs TP=1, and
  each vs transformers), and each divergence's margin in transformers' own logits at that
  step in bf16 steps at the logit's magnitude;
- the control: transformers' sdpa against its eager attention on the same greedy task, with
  the same statistics. Two correct bf16 implementations flip near-ties; the control shows
  how many, how early, and at what margins, for these weights.
With --dtype float32 both sides compute in f32 on the same bf16 weights: every TP and
transformers must then agree token for token.

Usage (on the GPU machine, from the repository root):
  scripts/tp_parity.py --bin .gpu/vllm-rs --config .gpu/models/Qwen3-8B --tp 2,4 --work /dev/shm/tp
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
    ap.add_argument("--tp", default="2", help="the TP sizes served beside TP=1, e.g. 2,4")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS,
                    help="more prompts steady the bf16 divergence counts (16 move by 2-3 a run)")
    ap.add_argument("--also-with", help="a server flag: the largest TP serves again with it, and "
                    "its answers are compared with that TP's (e.g. --also-with=--disable-custom-all-reduce)")
    args = ap.parse_args()
    sizes = sorted({int(t) for t in args.tp.split(",")} - {1})
    if not sizes:
        sys.exit("--tp names no size above 1")
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
    num = args.num_prompts
    prompts = make_prompts(config.vocab_size, seed=77, count=num)
    hf_prefill, hf_tokens, hf_rows = hf_side(model, prompts)
    hf_first = [log_softmax_last(p) for p in hf_prefill]
    model.set_attn_implementation("eager")
    eager_prefill, eager_tokens, _ = hf_side(model, prompts)
    eager_first = [log_softmax_last(p) for p in eager_prefill]
    del model
    torch.cuda.empty_cache()
    print(f"transformers ({args.dtype}): build+save+run {time.time() - t0:.0f}s", flush=True)

    runs = {}
    for tp in [1] + sizes:
        runs[tp], startup = ours(args.bin, mdir, tp, 8300 + tp, prompts,
                                 os.path.join(args.work, f"serve-tp{tp}.log"), args.dtype, [])
        print(f"vllm-rs TP={tp}: serve -> /health 200 in {startup:.1f}s", flush=True)

    tokens = {tp: [r[0] for r in runs[tp]] for tp in runs}
    tops = {tp: [r[1] for r in runs[tp]] for tp in runs}
    top = sizes[-1]
    if args.also_with:
        alt, _ = ours(args.bin, mdir, top, 8310, prompts,
                      os.path.join(args.work, "serve-also.log"), args.dtype, [args.also_with])
        same = sum(r[0] == t for r, t in zip(alt, tokens[top]))
        d = max(first_top_diff(alt[i][1], tops[top][i]) for i in range(num))
        print(f"PARITY TP={top} {args.also_with} vs TP={top}: {same}/{num} "
              f"identical greedy continuations, first-token top-5 logprobs max|d| {d:.4f}")
    first_token_report(name, args.dtype, tops, hf_first, eager_first)
    pairs = [(f"vllm-rs TP={tp} vs TP=1", tokens[tp], tokens[1]) for tp in sizes]
    pairs += [(f"vllm-rs TP={tp} vs transformers sdpa", tokens[tp], hf_tokens) for tp in [1] + sizes]
    pairs.append(("control: transformers eager vs sdpa", eager_tokens, hf_tokens))
    rows = []
    for label, a, b in pairs:
        same, notes = divergences(a, b, hf_rows, hf_tokens)
        rows.append(summary(label, notes, same))
        for i, k, m in notes:
            where = f"{m:.1f} bf16 steps" if m is not None else "transformers' prefix differs"
            print(f"  {label}: prompt {i} first differs at token {k}, margin {where}")
    print(f"\n| {name} {args.dtype}, {num} prompts, greedy {NEW_TOKENS} | identical "
          "| median first divergence (token) | largest margin at a divergence (bf16 steps) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['same']}/{num} | {r['first_step']} | {r['margin']} |")
    # The bar: every TP>1 diverges from TP=1 no more often than transformers from itself
    # (in f32: never).
    if args.dtype == "float32":
        ok = all(r["same"] == num for r in rows[:-1])
    else:
        ok = all(r["same"] >= rows[-1]["same"] for r in rows[:len(sizes)])
    raise SystemExit(0 if ok else 1)


def log_softmax_last(prefill_logits):
    return torch.log_softmax(torch.tensor(prefill_logits[-1]), -1).numpy()


def first_token_report(name, dtype, tops, hf_first, eager_first):
    """The first token's top-5 logprobs (the last prefill position), max |diff|: each TP
    against TP=1 and against transformers sdpa, beside the control (transformers eager
    against sdpa at sdpa's top-5 tokens), the spread two correct implementations show."""
    prompts = range(len(hf_first))

    def vs_hf(tp):
        return max(max(abs(v - hf_first[i][t]) for t, v in tops[tp][i][0].items())
                   for i in prompts)

    def vs_tp1(tp):
        return max(first_top_diff(tops[tp][i], tops[1][i]) for i in prompts)

    control = max(max(abs(eager_first[i][t] - hf_first[i][t])
                      for t in np.argsort(hf_first[i])[-5:]) for i in prompts)
    parts = [f"TP={tp} vs TP=1 {vs_tp1(tp):.4f}" for tp in tops if tp > 1]
    parts += [f"TP={tp} vs transformers {vs_hf(tp):.4f}" for tp in tops]
    print(f"PARITY {name} {dtype} first-token top-5 logprobs max|d|: {'; '.join(parts)}; "
          f"control (transformers eager vs sdpa) {control:.4f}")


if __name__ == "__main__":
    main()

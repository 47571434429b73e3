#!/usr/bin/env python3
"""Parity of vllm-rs's CUDA backend with Hugging Face transformers, on a GPU machine.

For each model shape (Qwen3 0.6B, Qwen2.5 0.5B, Llama 3.2 1B, configs taken from the real
config.json files): transformers builds the model with random seeded weights (the embedding
scaled so logits have a std of about 3, as in our tiny models: at transformers' default
init of std 0.02 the logits are nearly flat and greedy decoding is a string of near-ties)
and saves it as safetensors in bf16. Then:

- prefill logits of 16 prompts at every position: transformers vs vllm-rs, max and mean
  absolute difference;
- greedy continuations of 64 tokens: identical for how many of the 16 prompts, and for
  each divergence, transformers' logit margin between its token and ours at that step
  (a small margin means a near-tie, which bf16 rounding may legitimately flip);
- a control: transformers against itself, its default attention (sdpa) against its eager
  attention, on the same greedy task. Two bf16 implementations of one model that differ
  only in the attention's rounding show how often these weights' near-ties flip anyway.

vllm-rs's side runs through the worker's test binary (`backend::cuda::tests::parity::hf_parity_dump`,
which drives the model through the CUDA backend with paged KV, chunked prefill and batched
decode). Usage:

  scripts/hf_parity.py --configs .gpu/models --test-bin .gpu/worker_tests \
      --work /tmp/parity [--out docs-table.md]

Needs torch, transformers and safetensors (the GPU machine's python3 has them).
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

MODELS = ["Qwen3-0.6B", "Qwen2.5-0.5B-Instruct", "Llama-3.2-1B-Instruct"]
NUM_PROMPTS = 16
NEW_TOKENS = 64


def build_model(config_dir, out_dir, seed):
    """Random seeded bf16 model of config_dir's shape, saved by transformers."""
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(seed)
    # Initialised on the GPU: seconds instead of minutes for a billion parameters.
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.mul_((3.0 / config.hidden_size**0.5) / emb.float().std().item())
        if not config.tie_word_embeddings:
            head = model.get_output_embeddings().weight
            head.mul_((3.0 / config.hidden_size**0.5) / head.float().std().item())
    model.save_pretrained(out_dir, safe_serialization=True)
    return model.eval(), config


def make_prompts(vocab, seed, count=NUM_PROMPTS):
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, vocab, size=int(rng.integers(8, 41))).tolist()
        for _ in range(count)
    ]


@torch.no_grad()
def hf_side(model, prompts):
    """Prefill logits (f32, every position) and greedy continuations with, per step, the
    logits row the token was chosen from (to judge near-ties)."""
    prefill, tokens, rows = [], [], []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = model(ids, use_cache=True)
        logits = out.logits[0].float()
        prefill.append(logits.cpu().numpy())
        past = out.past_key_values
        last = logits[-1]
        seq, steps = [], []
        for _ in range(NEW_TOKENS):
            tok = int(torch.argmax(last))
            seq.append(tok)
            steps.append(last.cpu().numpy())
            out = model(torch.tensor([[tok]], device="cuda"), past_key_values=past, use_cache=True)
            past = out.past_key_values
            last = out.logits[0, -1].float()
        tokens.append(seq)
        rows.append(steps)
    return prefill, tokens, rows


def ours(test_bin, model_dir, prompts, work, dtype, attention):
    os.makedirs(work, exist_ok=True)
    pfile = os.path.join(work, "prompts.json")
    with open(pfile, "w") as f:
        json.dump(prompts, f)
    out = os.path.join(work, "ours")
    env = dict(
        os.environ,
        VLLM_PARITY_MODEL=model_dir,
        VLLM_PARITY_PROMPTS=pfile,
        VLLM_PARITY_OUT=out,
        VLLM_PARITY_NEW_TOKENS=str(NEW_TOKENS),
        VLLM_PARITY_DTYPE=dtype,
        VLLM_PARITY_ATTENTION=attention,
        VLLM_REQUIRE_GPU="1",
    )
    cmd = [test_bin, "--ignored", "--exact", "backend::cuda::tests::parity::hf_parity_dump", "--nocapture"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        raise SystemExit(f"vllm-rs parity dump failed for {model_dir}")
    flat = np.fromfile(os.path.join(out, "prefill_logits.f32"), dtype="<f4")
    with open(os.path.join(out, "tokens.json")) as f:
        tokens = json.load(f)
    return flat, tokens


# A divergence counts as a near-tie when transformers' own margin between its token and
# ours is within this many bf16 steps at the logit's magnitude.
NEAR_TIE_ULPS = 4


def bf16_ulp(x):
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (np.floor(np.log2(max(abs(x), 1e-30))) - 7)


@torch.no_grad()
def hf_eager_control(model, prompts, sdpa_tokens):
    """Greedy continuations with transformers' eager attention: how many equal those of
    its default (sdpa) attention."""
    try:
        model.set_attn_implementation("eager")
    except AttributeError:
        model.config._attn_implementation = "eager"
    _, eager_tokens, _ = hf_side(model, prompts)
    return sum(1 for a, b in zip(sdpa_tokens, eager_tokens) if a == b)


def compare(name, config, prompts, hf_prefill, hf_tokens, hf_rows, our_flat, our_tokens):
    vocab = config.vocab_size
    ours_rows = our_flat.reshape(-1, vocab)
    hf_all = np.concatenate(hf_prefill, axis=0)
    assert ours_rows.shape == hf_all.shape, (ours_rows.shape, hf_all.shape)
    d = np.abs(ours_rows - hf_all)
    top_agree = float(np.mean(np.argmax(ours_rows, 1) == np.argmax(hf_all, 1)))
    identical, notes, all_ties = 0, [], True
    for i, (a, b) in enumerate(zip(hf_tokens, our_tokens)):
        if a == b:
            identical += 1
            continue
        k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        row = hf_rows[i][k]
        margin = float(row[a[k]] - row[b[k]])
        tie = margin <= NEAR_TIE_ULPS * bf16_ulp(float(row[a[k]]))
        all_ties = all_ties and tie
        notes.append(f"prompt {i}: first differs at token {k}, HF margin {margin:.4f}"
                     f" ({margin / bf16_ulp(float(row[a[k]])):.1f} bf16 steps)")
    return {
        "model": name,
        "positions": int(hf_all.shape[0]),
        "max_abs": float(d.max()),
        "mean_abs": float(d.mean()),
        "logit_std": float(hf_all.std()),
        "argmax_agree": top_agree,
        "identical": identical,
        "near_ties": "yes" if all_ties else "no",
        "notes": notes,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True, help="folder with <model>/config.json")
    ap.add_argument("--test-bin", required=True, help="the vllm-worker unit-test binary")
    ap.add_argument("--work", default="/tmp/vllm-rs-parity")
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="compute dtype of both sides (weights are bf16 either way); "
                         "float32 checks the semantics without bf16 rounding noise")
    ap.add_argument("--attention", default="flash", choices=["cuda-core", "flash"],
                    help="vllm-rs's attention kernels (--attention-backend)")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    results = []
    for i, name in enumerate(args.models):
        t0 = time.time()
        mdir = os.path.join(args.work, name)
        model, config = build_model(os.path.join(args.configs, name), mdir, seed=1234 + i)
        if args.dtype == "float32":
            model = model.float()  # the same bf16 weights, computed in f32 (no TF32)
        t1 = time.time()
        prompts = make_prompts(config.vocab_size, seed=99 + i)
        hf_prefill, hf_tokens, hf_rows = hf_side(model, prompts)
        control = hf_eager_control(model, prompts, hf_tokens)
        del model
        torch.cuda.empty_cache()
        t2 = time.time()
        our_flat, our_tokens = ours(args.test_bin, mdir, prompts,
                                    os.path.join(args.work, name + "-run"), args.dtype,
                                    args.attention)
        print(f"  {name}: build+save {t1 - t0:.0f}s, transformers {t2 - t1:.0f}s, "
              f"vllm-rs {time.time() - t2:.0f}s", flush=True)
        r = compare(name, config, prompts, hf_prefill, hf_tokens, hf_rows, our_flat, our_tokens)
        r["hf_control"] = control
        results.append(r)
        print(f"PARITY {name} {args.dtype}: prefill logits over {r['positions']} positions: max|d| "
              f"{r['max_abs']:.4f} mean|d| {r['mean_abs']:.5f} (logit std {r['logit_std']:.2f}), "
              f"argmax agree {r['argmax_agree']:.4f}; greedy {NEW_TOKENS} tokens identical "
              f"{r['identical']}/{NUM_PROMPTS}, all divergences at near-ties: {r['near_ties']}; "
              f"control: transformers sdpa vs eager identical {control}/{NUM_PROMPTS} "
              f"({time.time() - t0:.0f}s)", flush=True)
        for n in r["notes"]:
            print(f"  {n}", flush=True)
    lines = [
        f"| model (random weights, {args.dtype}) | prefill positions | max abs diff | mean abs diff "
        "| logit std | argmax agree | greedy 64 identical | divergences at near-ties "
        "| control: transformers sdpa vs eager, greedy 64 identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['positions']} | {r['max_abs']:.4f} | {r['mean_abs']:.5f} "
            f"| {r['logit_std']:.2f} | {r['argmax_agree']:.4f} | {r['identical']}/{NUM_PROMPTS} "
            f"| {r['near_ties']} | {r['hf_control']}/{NUM_PROMPTS} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
            for r in results:
                for n in r["notes"]:
                    f.write(f"- {r['model']}: {n}\n")
    ok = all(r["identical"] >= NUM_PROMPTS - 1 for r in results)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()

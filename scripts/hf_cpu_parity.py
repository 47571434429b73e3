#!/usr/bin/env python3
"""Models saved by Hugging Face transformers load and generate in vllm-rs (CPU backend).

For Qwen3, Qwen2 and Llama (llama3 rope scaling), transformers builds a small model with
random seeded float32 weights and `save_pretrained`s it (its own config.json form and
tensor names); vllm-rs serves that folder on the CPU; greedy completions of a few prompts
are compared token by token with transformers' argmax, teacher-forced on the same
sequence, and each generated token's logprob with transformers' log-softmax.

Usage: scripts/hf_cpu_parity.py PATH/TO/vllm-rs   (needs torch + transformers: GPU machine)
"""
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch
import transformers

PROMPTS = [[72, 101, 108, 108, 111], [84, 104, 101, 32, 113, 117, 105, 99, 107], list(range(40, 90)), [7, 7, 7, 300, 301]]
NEW_TOKENS = 16


def configs():
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False,
                  eos_token_id=261, bos_token_id=None)
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    return [
        ("qwen3", transformers.Qwen3Config(head_dim=16, rope_theta=1e6, **common), transformers.Qwen3ForCausalLM),
        ("qwen2", transformers.Qwen2Config(rope_theta=1e6, **dict(common, tie_word_embeddings=True)), transformers.Qwen2ForCausalLM),
        ("llama", transformers.LlamaConfig(head_dim=16, rope_parameters=llama3, **common), transformers.LlamaForCausalLM),
    ]


def serve(exe, model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "serve", "--model", model_dir, "--port", str(port), "--device", "cpu"], stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode()[-2000:])
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            return proc, base
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("server did not start")


def complete(base, prompt):
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": 1,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    choice = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def main():
    exe = sys.argv[1]
    rows, ok = [], True
    for name, config, cls in configs():
        torch.manual_seed(0)
        model = cls(config).float().eval()
        with tempfile.TemporaryDirectory() as d:
            # The tokenizer files come from vllm-rs's own tiny model (same 512-token vocab).
            subprocess.run([exe, "make-tiny-model", "--out", d, "--preset", f"tiny-{name}"], check=True, stdout=subprocess.DEVNULL)
            model.save_pretrained(d)  # overwrites config.json and model.safetensors with transformers' own
            proc, base = serve(exe, d)
            try:
                for i, prompt in enumerate(PROMPTS):
                    ours, our_lp = complete(base, prompt)
                    with torch.no_grad():
                        logits = model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].double()
                    ref = logits.argmax(-1).tolist()
                    ref_lp = torch.log_softmax(logits, -1)[torch.arange(len(ours)), torch.tensor(ours)].tolist()
                    same = sum(a == b for a, b in zip(ours, ref))
                    lp_diff = max(abs(a - b) for a, b in zip(our_lp, ref_lp))
                    good = same == len(ours) and lp_diff < 1e-3
                    ok &= good
                    rows.append(f"{name:6} prompt {i} ({len(prompt):2} tok): greedy {same}/{len(ours)} equal, max |logprob diff| {lp_diff:.2e} {'ok' if good else 'MISMATCH'}")
            finally:
                proc.terminate()
                proc.wait(timeout=15)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print("\n".join(rows))
    print("PARITY OK" if ok else "PARITY FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

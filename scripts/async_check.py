#!/usr/bin/env python3
"""`--async-scheduling` against serial scheduling on a GPU, through `serve`: the token ids
and logprobs of the same requests must be identical.

Two workloads on two servers (serial, async) of the same model:
- one request at a time in the model's dtype: every step has the same batch on both
  servers, so the bits must match (greedy with logprobs, and seeded sampling with n = 2);
- all requests at once in float32: the two servers may batch differently (a batch of one
  takes another GEMM than a batch of two), so only near-ties may differ; each difference
  is reported.

    python3 scripts/async_check.py --bin .gpu/vllm-rs --model DIR [--device cuda]
"""
import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request


def start(args, port, extra):
    cmd = [args.bin, "serve", "--model", args.model, "--device", args.device,
           "--port", str(port)] + extra
    log = open(f"/tmp/async-check-{port}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://localhost:{port}/health", timeout=1)
            return proc
        except Exception:
            if proc.poll() is not None:
                sys.exit(f"server {extra} exited: see /tmp/async-check-{port}.log")
            time.sleep(0.1)
    sys.exit(f"server {extra} not healthy in 120 s")


def bodies():
    out = []
    for i in range(24):
        prompt = [100 + (i * 37 + j * 11) % 400 for j in range(5 + i * 13)]
        max_tokens = [1, 2, 9, 33, 64][i % 5]
        if i % 3 == 2:
            out.append({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
                        "seed": i, "n": 2, "ignore_eos": True, "return_token_ids": True})
        else:
            out.append({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                        "logprobs": 2, "ignore_eos": True, "return_token_ids": True})
    return out


def post(port, body):
    req = urllib.request.Request(f"http://localhost:{port}/v1/completions",
                                 json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as f:
        choices = json.load(f)["choices"]
    return [(c.get("token_ids"), (c.get("logprobs") or {}).get("token_logprobs")) for c in choices]


def run(port, all_at_once):
    work = bodies()
    res = [None] * len(work)

    def one(i):
        res[i] = post(port, work[i])

    if all_at_once:
        ts = [threading.Thread(target=one, args=(i,)) for i in range(len(work))]
        [t.start() for t in ts]
        [t.join() for t in ts]
    else:
        for i in range(len(work)):
            one(i)
    return res


def compare(name, a, b):
    """Prints how many requests agree in token ids, and in ids and logprobs; True when
    every request agrees in both."""
    def ids(res):
        return [[c[0] for c in choices] for choices in res]

    same_ids = sum(1 for x, y in zip(ids(a), ids(b)) if x == y)
    same = sum(1 for x, y in zip(a, b) if x == y)
    verdict = "MATCH" if same == len(a) else "DIFFER"
    print(f"{verdict} async-check {name}: token ids identical in {same_ids}/{len(a)} "
          f"requests, ids and logprobs in {same}/{len(a)}", flush=True)
    for i, (x, y) in enumerate(zip(a, b)):
        for c, (cx, cy) in enumerate(zip(x, y)):
            ids_x, ids_y = cx[0] or [], cy[0] or []
            if ids_x != ids_y:
                k = next((j for j, (p, q) in enumerate(zip(ids_x, ids_y)) if p != q),
                         min(len(ids_x), len(ids_y)))
                print(f"  request {i} choice {c}: ids differ from token {k} of "
                      f"{len(ids_x)}", flush=True)
    return same == len(a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--port", type=int, default=8150)
    args = ap.parse_args()
    ok = True
    for name, dtype_flags, at_once in [("one at a time, model dtype", [], False),
                                       ("all at once, float32", ["--dtype", "float32"], True)]:
        results = []
        for k, extra in enumerate([[], ["--async-scheduling"]]):
            port = args.port + k
            proc = start(args, port, dtype_flags + extra)
            try:
                results.append(run(port, at_once))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        # Only the one-at-a-time run must match bit for bit.
        ok &= compare(name, *results) or at_once
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

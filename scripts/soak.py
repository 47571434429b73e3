#!/usr/bin/env python3
"""Soak a running vllm-rs server on localhost: saturating load with random parameters,
streaming and not, with random cancellations, for a bounded time; then check that

- every request got a complete response or an error (none hung past its timeout),
- no response was a 5xx,
- once idle, /metrics shows 0 running, 0 waiting and 0% KV-cache usage,
- each process of the server (frontend, engine-core, workers) kept its RSS within
  +-10% of its size after warm-up: the median RSS of the last quarter of the samples
  taken after warm-up is within +-10% of the median of the first quarter.

Why medians of quarters and not every sample against the first one: the allocator does
not hand freed memory back at once. A burst of concurrent large requests raises the
frontend's glibc heap by a few MiB for some seconds, then it shrinks again (measured with
a counting allocator: the live heap stays at 2.6-3.0 MiB over 137M allocations while the
arenas swing between 4 and 9 MiB). One such sample against a 20 MiB process is over
10%, and so the old max-vs-first check failed on noise and would fail as often on a
good build as on a bad one. A leak raises the floor for good, so the median of every
later window moves with it: between the first and the last quarter of a 10-minute run
(~6 minutes apart) a 10% rise of a 20 MiB frontend is 2 MiB, i.e. a few tens of bytes
per request at ~75 requests/s, and a deliberate 256-byte-per-request leak fails it
(docs/RELIABILITY.md). The range (min-max) and the anonymous/file-backed split are
printed so a reader can still see the spikes.

Standard library only. scripts/soak.sh starts the server and calls this.

  scripts/soak.py --port 8000 --seconds 600 --clients 32 --pids 123,124,125
"""

import argparse
import http.client
import json
import random
import re
import socket
import sys
import threading
import time

PROMPT_WORDS = ("the cat sat on a mat while rain fell over quiet hills and "
                "old ships sailed to distant ports under grey skies").split()


def random_body(rng, vocab_hint):
    """A random but valid completions or chat request."""
    body = {
        "max_tokens": rng.choice([1, 2, 8, 16, 64, 200]),
        "temperature": rng.choice([0.0, 0.7, 1.0, 1.5]),
        "top_p": rng.choice([1.0, 0.9, 0.5]),
        "top_k": rng.choice([-1, 0, 1, 20]),
        "stream": rng.random() < 0.6,
    }
    if rng.random() < 0.3:
        body["n"] = rng.choice([2, 3])
    if rng.random() < 0.3:
        body["logprobs"] = rng.choice([0, 1, 5])
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(PROMPT_WORDS)]
    if rng.random() < 0.2:
        body["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.2:
        body["presence_penalty"] = rng.choice([0.5, -0.5])
        body["frequency_penalty"] = rng.choice([0.2, 1.0])
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    words = " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.choice([1, 5, 40, 300])))
    if rng.random() < 0.3:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": words}]
        if body.pop("logprobs", None) is not None:
            body["logprobs"] = True
            body["top_logprobs"] = 2
    else:
        path = "/v1/completions"
        body["prompt"] = words if rng.random() < 0.7 else [
            rng.randrange(vocab_hint) for _ in range(rng.choice([1, 20, 200]))]
    return path, body


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.bad = []

    def add(self, kind, detail=None):
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if detail is not None and len(self.bad) < 20:
                self.bad.append(detail)


def one_request(port, rng, tally, vocab_hint, timeout):
    path, body = random_body(rng, vocab_hint)
    cancel_after = rng.choice([None, None, None, 0, 1, 3])  # chunks read before hanging up
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        if cancel_after == 0 and rng.random() < 0.5:
            tally.add("cancelled before the response")
            return
        resp = conn.getresponse()
        if resp.status >= 500:
            tally.add("5xx", f"{resp.status} {resp.read()[:300]!r} for {body}")
            return
        if resp.status != 200:
            tally.add(f"{resp.status}", f"{resp.status} {resp.read()[:300]!r} for {body}")
            return
        if not body["stream"]:
            json.loads(resp.read())
            tally.add("complete")
            return
        chunks, done = 0, False
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                tally.add("error event", f"{event} for {body}")
                return
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                tally.add("cancelled mid-stream")
                return
        tally.add("complete" if done else "stream cut", None if done else f"no [DONE] for {body}")
    except socket.timeout:
        tally.add("timed out", f"no answer in {timeout}s for {body}")
    except (ConnectionError, http.client.HTTPException, json.JSONDecodeError) as e:
        tally.add("connection error", f"{e!r} for {body}")
    finally:
        conn.close()


def metrics(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    values = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        m = re.search(r"^" + re.escape(name) + r"(\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M)
        values[name] = float(m.group(2)) if m else None
    return values


def rss_kib(pid):
    """(VmRSS, RssAnon, RssFile) in KiB, or None once the process is gone. RssAnon is the
    heap and stacks, where a leak shows; RssFile is mostly this binary's code, paged in as
    code paths first run and bounded by the file's size."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    fields[key] = int(value.split()[0])
    except OSError:
        return None
    if "VmRSS" not in fields:
        return None
    return fields["VmRSS"], fields.get("RssAnon", 0), fields.get("RssFile", 0)


def median(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def rss_check(samples):
    """(ok, detail) for one process's (VmRSS, RssAnon, RssFile) samples after warm-up."""
    if len(samples) < 4:
        return False, f"{len(samples)} samples after warm-up: too few for a trend"
    quarter = len(samples) // 4
    rss = [s[0] for s in samples]
    # The trend, one median per quarter, tells a leak (steady growth) from spikes.
    quarters = [median(rss[q * quarter:(q + 1) * quarter]) for q in range(4)]
    base, end = quarters[0], median(rss[-quarter:])
    ok = base * 0.9 <= end <= base * 1.1
    mib = lambda kib: f"{kib / 1024:.1f}"
    trend = " ".join(mib(m) for m in quarters)
    return ok, (f"median {mib(base)} MiB in the first quarter after warm-up, {mib(end)} MiB "
                f"in the last ({(end / base - 1) * 100:+.1f}%); per quarter: {trend} MiB; "
                f"range {mib(min(rss))}-{mib(max(rss))} MiB; anon/file at the end "
                f"{mib(samples[-1][1])}/{mib(samples[-1][2])} MiB")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--warmup", type=float, default=None, help="default: 10%% of --seconds")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--pids", default="", help="comma-separated pids whose RSS is watched")
    ap.add_argument("--vocab-hint", type=int, default=500, help="token ids below this")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    warmup = args.warmup if args.warmup is not None else args.seconds * 0.1
    pids = [int(p) for p in args.pids.split(",") if p]
    tally = Tally()
    end = time.time() + args.seconds
    rss = {pid: [] for pid in pids}

    def client(i):
        rng = random.Random(args.seed * 1000 + i)
        while time.time() < end:
            one_request(args.port, rng, tally, args.vocab_hint, args.timeout)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    start = time.time()
    for t in threads:
        t.start()
    while time.time() < end:
        time.sleep(5)
        if time.time() - start >= warmup:
            for pid in pids:
                rss[pid].append(rss_kib(pid))
        with tally.lock:
            done = sum(tally.counts.values())
        print(f"  {time.time() - start:6.0f}s  {done} requests  {dict(tally.counts)}", flush=True)
    for t in threads:
        t.join(args.timeout + 10)
    hung = sum(t.is_alive() for t in threads)

    idle = time.time()
    m = metrics(args.port)
    while time.time() - idle < 5 and (m["vllm:num_requests_running"] or m["vllm:num_requests_waiting"]
                                      or m["vllm:kv_cache_usage_perc"]):
        time.sleep(0.2)
        m = metrics(args.port)
    idle_after = time.time() - idle

    checks = []
    counts = tally.counts
    total = sum(counts.values())
    checks.append(("requests answered or errored (none hung)",
                   hung == 0 and counts.get("timed out", 0) == 0 and counts.get("stream cut", 0) == 0,
                   f"{total} requests, {hung} client threads hung, {dict(counts)}"))
    checks.append(("no 5xx", counts.get("5xx", 0) == 0, f"{counts.get('5xx', 0)} 5xx"))
    checks.append(("no errors on valid requests",
                   counts.get("error event", 0) == 0 and counts.get("connection error", 0) == 0
                   and not any(k.isdigit() for k in counts),
                   f"{counts.get('error event', 0)} error events, "
                   f"{counts.get('connection error', 0)} connection errors"))
    checks.append(("idle: 0 running, 0 waiting, 0% KV",
                   m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                   and m["vllm:kv_cache_usage_perc"] == 0,
                   f"{m} after {idle_after:.1f}s idle"))
    for pid, samples in rss.items():
        ok, detail = rss_check([s for s in samples if s])
        checks.append((f"RSS of pid {pid} within +-10% after warm-up", ok, detail))
    for detail in tally.bad[:10]:
        print("  ", detail)
    print(f"\n| soak check ({args.seconds:.0f}s, {args.clients} clients) | result | detail |")
    print("|---|---|---|")
    for name, ok, detail in checks:
        print(f"| {name} | {'PASS' if ok else 'FAIL'} | {detail} |")
    sys.exit(0 if all(ok for _, ok, _ in checks) else 1)


if __name__ == "__main__":
    main()

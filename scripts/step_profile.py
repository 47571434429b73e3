#!/usr/bin/env python3
"""Where the time of a run goes, step by step.

Reads logs written with RUST_LOG=vllm_engine_core::step=debug,vllm_worker::step=debug
(the "engine step" and "worker step" lines) and prints, for decode-only steps and for
steps with prefill tokens, how many there were and the mean of each phase:

  engine: schedule_us (Scheduler::schedule), execute_us (SchedulerOutput sent → rank 0's
          output back: IPC plus the worker, plus the wait behind the step before it with
          --async-scheduling), update_us (update_from_output + outputs)
  overlap: ahead_us (the engine planning and sending the next step while this one ran:
          off the critical path with --async-scheduling, 0 without), wait_us (the time
          the engine then still waited for this step's output)
  worker: enqueue_us (inputs built and the forward pass enqueued), sample_us (the wait
          for the GPU plus sampling and the token read-back); CUDA only
  worker (every backend, "step executed"): idle_us (waiting for the step to arrive: near
          0 when the engine queued it ahead), execute_us (the step in the runner)

and then the decode steps by batch size: the time from one engine step's line to the
next (with the GPU the bottleneck, each step's share of the run) summed by batch.

usage: scripts/step_profile.py LOG...
"""
import re
import sys
from collections import defaultdict

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r"(\w+)=(\d+)")


def steps(paths, message):
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                line = ANSI.sub("", line)
                if message in line:
                    yield {k: int(v) for k, v in FIELD.findall(line)}


def kind(s):
    return "decode" if s.get("tokens") == s.get("seqs") else "prefill/mixed"


def table(rows, message, phases):
    groups = defaultdict(list)
    for s in rows:
        groups[kind(s)].append(s)
    if not groups:
        print(f"no '{message}' lines (RUST_LOG must enable the step targets at debug)")
        return
    print(f"{message}:")
    print(f"  {'kind':<14} {'steps':>6} {'tokens/step':>12} " +
          " ".join(f"{p:>12}" for p in phases) + f" {'total s':>9}")
    for k, rows in sorted(groups.items()):
        n = len(rows)
        tok = sum(r.get("tokens", 0) for r in rows) / n
        means = [sum(r.get(p, 0) for r in rows) / n for p in phases]
        total = sum(sum(r.get(p, 0) for p in phases) for r in rows) / 1e6
        print(f"  {k:<14} {n:>6} {tok:>12.1f} " +
              " ".join(f"{m:>12.0f}" for m in means) + f" {total:>9.2f}")


STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:(\d\d):(\d\d(?:\.\d+)?))Z")
BATCHES = [(1, 32), (33, 64), (65, 128), (129, 192), (193, 256), (257, 1 << 30)]


def periods_by_batch(paths):
    """Seconds between consecutive "engine step" lines, summed by the batch of the first."""
    last = None
    sums = defaultdict(lambda: [0, 0.0])
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                line = ANSI.sub("", line)
                m = STAMP.match(line)
                if not m or "engine step" not in line:
                    continue
                t = int(m.group(2)) * 60 + float(m.group(3))
                s = {k: int(v) for k, v in FIELD.findall(line)}
                if last is not None and t >= last[0]:
                    sums[last[1]][0] += 1
                    sums[last[1]][1] += t - last[0]
                last = (t, s.get("seqs", 0) if kind(s) == "decode" else -1)
    if not sums:
        return
    print("step period by batch (decode; -1: steps with prefill tokens):")
    print(f"  {'batch':<12} {'steps':>6} {'total s':>9} {'mean ms':>9}")
    for lo, hi in [(-1, -1)] + BATCHES:
        n, total = 0, 0.0
        for b, (k, t) in sums.items():
            if lo <= b <= hi:
                n, total = n + k, total + t
        if n:
            name = "prefill" if lo < 0 else f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+"
            print(f"  {name:<12} {n:>6} {total:>9.3f} {total / n * 1e3:>9.3f}")


def main():
    paths = sys.argv[1:]
    if not paths:
        sys.exit(__doc__)
    # Each log is read once per message; the engine's lines feed two tables.
    engine = list(steps(paths, "engine step"))
    table(engine, "engine step", ["schedule_us", "execute_us", "update_us"])
    table(engine, "engine step", ["ahead_us", "wait_us"])
    table(steps(paths, "worker step"), "worker step", ["enqueue_us", "sample_us"])
    table(steps(paths, "step executed"), "step executed", ["idle_us", "execute_us"])
    periods_by_batch(paths)


if __name__ == "__main__":
    main()

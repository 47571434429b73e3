#!/usr/bin/env python3
"""Sums an Nsight Compute CSV (`ncu --metrics gpu__time_duration.sum --csv`) by kernel:
total µs, launches and µs a launch, largest first, then the total. Used by the
`batch-bench` and `prefill-bench` stages of scripts/gpu_round.sh.

usage: scripts/ncu_sum.py NCU.csv
"""
import collections
import csv
import sys


def micros(value, unit):
    v = float(value.replace(",", ""))
    if unit in ("nsecond", "ns"):
        return v / 1000
    if unit in ("usecond", "us"):
        return v
    return v * 1000  # msecond


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    header = None
    totals = collections.defaultdict(lambda: [0, 0.0])
    for row in csv.reader(open(sys.argv[1], errors="replace")):
        if row and row[0] == "ID":
            header = row
            continue
        if not header or len(row) != len(header):
            continue
        d = dict(zip(header, row))
        if d.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = d.get("Kernel Name", "?")[:70]
        totals[name][0] += 1
        totals[name][1] += micros(d["Metric Value"], d.get("Metric Unit", "ns"))
    for name, (n, us) in sorted(totals.items(), key=lambda x: -x[1][1]):
        print(f"NCU {us:10.1f} us  {n:5d}x  {us / n:8.2f} us/each  {name}")
    launches = sum(v[0] for v in totals.values())
    print(f"NCU total {sum(v[1] for v in totals.values()):.1f} us over {launches} launches")


if __name__ == "__main__":
    main()

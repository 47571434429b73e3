#!/usr/bin/env python3
"""Where a kernel's warps wait, by SASS instruction: reads the source page of an Nsight
Compute report (`ncu --set full --import-source no --kernel-name K --launch-count 1
--page source --print-source sass --csv ... > K.csv`) and prints
- the share of stall samples and of executed warp instructions in windows of WINDOW
  instructions (default 100), with the barriers each window executes and how often, so
  that a loop shows as a run of windows and a block-wide section by its barriers' counts;
- the TOP (default 15) instructions by stall samples with their three largest reasons.

usage: scripts/ncu_sass.py K.csv [WINDOW [TOP]]
"""
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def number(row, col):
    try:
        return float(row[col].replace(",", ""))
    except (ValueError, IndexError):
        return 0.0


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    window = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    rows = list(csv.reader(open(sys.argv[1], errors="replace")))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if start is None:
        sys.exit(f"{sys.argv[1]}: no source page (was it written with --page source --csv?)")
    header = rows[start]
    col = {name: i for i, name in enumerate(header)}
    code = [r for r in rows[start + 1:] if len(r) == len(header)]
    samples = [number(r, col[SAMPLES]) for r in code]
    executed = [number(r, col[EXECUTED]) for r in code]
    total_s, total_e = sum(samples) or 1.0, sum(executed) or 1.0
    print(f"{len(code)} instructions, {sum(samples):.0f} stall samples, "
          f"{sum(executed) / 1e6:.2f} M warp instructions executed")
    for lo in range(0, len(code), window):
        hi = min(lo + window, len(code))
        s, e = sum(samples[lo:hi]), sum(executed[lo:hi])
        if s / total_s < 0.005 and e / total_e < 0.005:
            continue
        bars = [(i, int(executed[i])) for i in range(lo, hi)
                if "BAR.SYNC" in code[i][col["Source"]] and executed[i] > 0]
        print(f"{lo:6d}-{hi:<6d} samples {100 * s / total_s:5.1f} %  "
              f"executed {100 * e / total_e:5.1f} %  barriers {bars[:6]}")
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    print(f"top {top} instructions by stall samples:")
    for i in sorted(range(len(code)), key=lambda i: -samples[i])[:top]:
        why = sorted(((number(code[i], col[n]), n[6:]) for n in reasons), reverse=True)[:3]
        print(f"{i:6d} {100 * samples[i] / total_s:5.1f} %  executed {executed[i]:9.0f}  "
              f"{code[i][col['Source']].strip()[:56]:56s} "
              f"{', '.join(f'{n} {v:.0f}' for v, n in why if v > 0)}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Sums the kernel durations of an `ncu --csv --metrics gpu__time_duration.sum`
log by kernel name, over the launches of the last N decode steps.

usage: ncu_summary.py LOG.csv [--last N]

Prints one row per kernel name: launches, total microseconds, share, mean,
and the total of everything, so the time of one decode step can be read
kernel by kernel (ncu runs the kernels one at a time, so launch gaps are
not in these figures; the step time less their sum is the gap)."""
import csv
import io
import sys
from collections import defaultdict


def main():
    path = sys.argv[1]
    rows = []
    with open(path, errors="replace") as f:
        text = f.read()
    start = text.find('"ID"')
    if start < 0:
        print("no ncu csv in", path)
        return 1
    for r in csv.DictReader(io.StringIO(text[start:])):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        us = v / 1000.0 if unit.startswith("n") else v if unit.startswith("u") else v * 1000.0
        rows.append((int(r["ID"]), r["Kernel Name"].split("(")[0][:60], us))
    rows.sort()
    print(f"{len(rows)} kernel launches profiled")
    agg = defaultdict(lambda: [0, 0.0])
    for _, name, us in rows:
        agg[name][0] += 1
        agg[name][1] += us
    tot = sum(a[1] for a in agg.values())
    print(f"| kernel | launches | total us | share | mean us |\n|---|---|---|---|---|")
    for name, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {n} | {us:.1f} | {100 * us / tot:.1f} % | {us / n:.2f} |")
    print(f"| all | {len(rows)} | {tot:.1f} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

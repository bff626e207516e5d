#!/usr/bin/env python3
"""Summarises the decode attention's per-block timestamps.

The file comes from a build with PD_CUDA_PROBE=1 (tests/gpu/build.sh) run
with PD_MLA_PROBE=file (kernels/cuda/mla.cu, top of the file): a header,
then one line per block: kernel (0 the split kernel k_mla_decode_tc, 1 the
merge k_mla_combine8), block, and its points t0..t13 in ns (0: not
reached).

Prints, for each kernel, each point's median over the blocks that reached
it, its p10, p90 and last, in microseconds from the first split block's
start; then the points of the split block that ended last, and the gaps
between consecutive points in median (where a block's time goes).
Usage: mla_probe_summary.py probe.csv
"""
import statistics
import sys

POINTS = {
    0: ("start", "past its wait", "first tile in", "first tile done", "second tile in", "tiles done", "end",
        "first tile's scores", "first tile's softmax", "second tile's scores", "second tile's softmax",
        "first tile's PV issued (thread 0)", "last tile's PV issued (thread 0)", "last tile's PV issued (warp 7)"),
    1: ("start", "past its wait", "merged", "", "", "", "end", "", "", "", "", "", "", ""),
}
NAMES = {0: "split (k_mla_decode_tc)", 1: "merge (k_mla_combine8)"}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    rows = []
    with open(sys.argv[1]) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("kernel"):
                v = [int(x) for x in line.split(",")]
                rows.append((v[0], v[1], v[2:]))
    if not rows:
        raise SystemExit("%s: no blocks recorded" % sys.argv[1])
    starts = [t[0] for k, _, t in rows if k == 0] or [t[0] for _, _, t in rows]
    t0 = min(starts)
    for k in (0, 1):
        blocks = [t for kk, _, t in rows if kk == k]
        if not blocks:
            continue
        print("## %s: %d blocks\n" % (NAMES[k], len(blocks)))
        print("| point | blocks | median us | p10 | p90 | last |")
        print("|---|---|---|---|---|---|")
        med = {}
        for j, name in enumerate(POINTS[k]):
            xs = [(t[j] - t0) / 1000.0 for t in blocks if t[j]]
            if not name or not xs:
                continue
            med[j] = statistics.median(xs)
            print("| %d %s | %d | %.2f | %.2f | %.2f | %.2f |" % (j, name, len(xs), med[j], pct(xs, 0.1),
                                                                 pct(xs, 0.9), max(xs)))
        last = max(blocks, key=lambda t: t[6])
        print("\nthe block that ended last: " + ", ".join(
            "%s %.2f" % (POINTS[k][j], (last[j] - t0) / 1000.0) for j in range(len(POINTS[k])) if POINTS[k][j] and last[j]))
        js = sorted(med, key=med.get)  # in time order
        print("median gaps: " + ", ".join("%s -> %s %.2f us" % (POINTS[k][a], POINTS[k][b], med[b] - med[a])
                                           for a, b in zip(js, js[1:])) + "\n")


if __name__ == "__main__":
    main()

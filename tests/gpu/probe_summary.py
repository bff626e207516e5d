#!/usr/bin/env python3
"""Summarises the one-row MoE kernels' per-block timestamps.

The file comes from a build with PD_CUDA_PROBE=1 (tests/gpu/build.sh) run
with PD_MOE_PROBE=file (kernels/cuda/moe.cu, top of the file): a comment
line with the grid layout, a header, then one line per block: kernel
(0 k_oproj_route, 1 k_moe_gate_up1, 2 k_moe_down1 or k_moe_down1c, 3 the combine), block,
and its points t0..t4 in ns (0: not reached).

Prints, for each kernel's group of blocks (k_oproj_route's router and
projection blocks, the gate_up's and the down's shared and routed
blocks), each point's median over the group's blocks, and its spread
(p10 and p90), in microseconds from the first k_oproj_route block's start.
Usage: probe_summary.py probe.csv [--router-blocks 8]
"""
import argparse
import statistics

POINTS = {
    0: ("start", "past its wait", "end"),
    1: ("start", "past its wait", "normed", "GEMV starts", "end"),
    2: ("start", "past its wait", "end", "warp 0's GEMV ends (k_moe_down1c's routed blocks)"),
    3: ("start", "past its wait", "end"),
}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe")
    ap.add_argument("--router-blocks", type=int, default=8,
                    help="k_oproj_route's first blocks that compute the router's logits (ceil(E / 8))")
    args = ap.parse_args()
    layout, rows = {}, []
    with open(args.probe) as f:
        for line in f:
            line = line.strip()
            if line.startswith("#"):
                for kv in line[1:].split():
                    k, v = kv.split("=")
                    layout[k] = int(v)
            elif line and not line.startswith("kernel"):
                v = [int(x) for x in line.split(",")]
                rows.append((v[0], v[1], v[2:]))
    if not rows:
        raise SystemExit("%s: no blocks recorded" % args.probe)
    starts = [t[0] for k, _, t in rows if k == 0]
    t0 = min(starts) if starts else min(t[0] for _, _, t in rows)
    gu_sh, dn_sh = layout.get("gate_up_shared_blocks", 0), layout.get("down_shared_blocks", 0)
    groups = [
        ("k_oproj_route, router blocks", 0, lambda b: b < args.router_blocks),
        ("k_oproj_route, projection blocks", 0, lambda b: b >= args.router_blocks),
        ("k_moe_gate_up1, shared blocks", 1, lambda b: b < gu_sh),
        ("k_moe_gate_up1, routed blocks", 1, lambda b: b >= gu_sh),
        ("k_moe_down1, shared blocks", 2, lambda b: b < dn_sh),
        ("k_moe_down1, routed blocks", 2, lambda b: b >= dn_sh),
        ("combine", 3, lambda b: True),
    ]
    print("| blocks | n | point | median us | p10 - p90 |")
    print("|---|---|---|---|---|")
    for name, kern, sel in groups:
        blocks = [t for k, b, t in rows if k == kern and sel(b)]
        if not blocks:
            continue
        for i, point in enumerate(POINTS[kern]):
            xs = [(t[i] - t0) / 1000.0 for t in blocks if t[i]]
            if xs:
                print("| %s | %d | %s | %.2f | %.2f - %.2f |" % (name, len(blocks), point, statistics.median(xs),
                                                               pct(xs, 0.1), pct(xs, 0.9)))


if __name__ == "__main__":
    main()

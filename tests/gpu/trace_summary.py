#!/usr/bin/env python3
"""Summarises a tests/gpu/cupti_trace.c timeline (PD_TRACE_OUT csv).

For each window between a cudaProfilerStart and the next cudaProfilerStop
(the whole trace when there are none), or only the last --windows N:
  - the window's span, the time some kernel or copy ran on the GPU (the
    union of their intervals), and the rest: the GPU idle;
  - kernels summed by name (count, total, mean);
  - the GPU's idle gaps longer than --gap-us, summed by the kernel before
    them, with the host's runtime calls that overlapped the gaps;
  - the host's runtime calls summed by name.
  - with --sequence N, the window's last N kernels in order: start (us from
    the first of them), duration, and the gap since the previous one ended
    (negative: it started before, e.g. by programmatic dependent launch), to
    read one layer's chain of kernels;
  - with --chain NAME, from the window's last kernel named like NAME on
    (k_embed: the last decode step), each kernel's median end after the
    previous kernel's end and median duration, by name (a layer's chain
    over all its layers);
Usage: trace_summary.py trace.csv [--windows N] [--gap-us 5] [--top 25] [--by-grid] [--labels a,b] [--sequence N]
       [--chain NAME]
"""
import argparse
import collections
import statistics


def short(name, n=70):
    name = name.split("(")[0]
    for pre in ("void ", "static "):
        if name.startswith(pre):
            name = name[len(pre):]
    return name if len(name) <= n else name[: n - 3] + "..."


def load(path, by_grid):
    gpu, api = [], []
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split(",", 6)
            if len(parts) < 7:
                continue
            kind, a, b = parts[0], int(parts[1]), int(parts[2])
            if kind == "K":
                gpu.append((a, b, short(parts[6]) + (" <<<%s>>>" % parts[5] if by_grid else "")))
            elif kind == "M":
                gpu.append((a, b, "[copy %s B kind %s]" % (parts[4], parts[5])))
            elif kind == "C":
                gpu.append((a, b, "[memset]"))
            elif kind == "R":
                api.append((a, b, parts[6].split("_v")[0]))
    gpu.sort()
    api.sort()
    return gpu, api


def windows(api):
    out, start = [], None
    for a, b, n in api:
        if n.startswith("cudaProfilerStart"):
            start = b
        elif n.startswith("cudaProfilerStop") and start is not None:
            out.append((start, a))
            start = None
    return out


def sequence(ev, n):
    """The last n kernels of ev in start order, with durations and gaps."""
    ks = [g for g in ev if not g[2].startswith("[")][-n:]
    if not ks:
        return
    t0, prev_end = ks[0][0], None
    print("\n| # | kernel | start us | duration us | gap us |\n|---|---|---|---|---|")
    for i, (a, b, name) in enumerate(ks):
        gap = "" if prev_end is None else "%.1f" % ((a - prev_end) / 1e3)
        print("| %d | %s | %.1f | %.1f | %s |" % (i, name, (a - t0) / 1e3, (b - a) / 1e3, gap))
        prev_end = b
    print("\nsum of durations %.1f us over a span of %.1f us" % (sum(b - a for a, b, _ in ks) / 1e3,
                                                                (ks[-1][1] - t0) / 1e3))


def chain(ev, first):
    """From the window's last kernel whose name contains first (e.g. k_embed:
    a decode step's first kernel) to its end: per kernel name, how many ran
    and the medians of its end after the previous kernel's end (what it adds
    to a chain of dependent kernels, PDL overlap included) and of its
    duration."""
    ks = [g for g in ev if not g[2].startswith("[")]
    starts = [i for i, g in enumerate(ks) if first in g[2]]
    if not starts:
        print("\nno kernel named like %r in this window" % first)
        return
    ks = ks[starts[-1]:]
    by, order, prev_end = collections.defaultdict(list), [], None
    for a, b, name in ks:
        if name not in by:
            order.append(name)
        by[name].append(((b - (prev_end if prev_end is not None else a)) / 1e3, (b - a) / 1e3))
        prev_end = b
    med = lambda v: statistics.median(v)
    print("\n| kernel (from the last %s on) | count | end after the previous end, median us | duration, median us |"
          "\n|---|---|---|---|" % first)
    for name in order:
        v = by[name]
        print("| %s | %d | %.2f | %.2f |" % (name, len(v), med([x[0] for x in v]), med([x[1] for x in v])))
    print("\nfrom the first start to the last end: %.1f us" % ((ks[-1][1] - ks[0][0]) / 1e3))


def summarise(gpu, api, lo, hi, gap_ns, top, seq=0, first=""):
    ev = [g for g in gpu if g[0] >= lo and g[1] <= hi]
    calls = [c for c in api if c[0] >= lo and c[1] <= hi]
    if not ev:
        print("no GPU work in this window\n")
        return
    span = hi - lo
    busy, cur_a, cur_b = 0, None, lo
    gaps = []  # (length, name before, name after, start, end)
    prev_name = "(window start)"
    for a, b, n in ev:
        if cur_a is not None and a <= cur_b:  # overlaps the current busy interval
            if b > cur_b:
                cur_b, prev_name = b, n
            continue
        if cur_a is not None:
            busy += cur_b - cur_a
        if a - cur_b >= gap_ns:
            gaps.append((a - cur_b, prev_name, n, cur_b, a))
        cur_a, cur_b, prev_name = a, b, n
    busy += cur_b - cur_a
    if hi - cur_b >= gap_ns:
        gaps.append((hi - cur_b, prev_name, "(window end)", cur_b, hi))
    idle = span - busy
    print("span %.3f ms, GPU busy %.3f ms (%.1f %%), idle %.3f ms; %d kernels/copies; gaps >= %.0f us: %d, %.3f ms"
          % (span / 1e6, busy / 1e6, 100.0 * busy / span, idle / 1e6, len(ev), gap_ns / 1e3, len(gaps),
             sum(g[0] for g in gaps) / 1e6))
    by = collections.defaultdict(lambda: [0, 0])
    for a, b, n in ev:
        by[n][0] += 1
        by[n][1] += b - a
    print("\n| kernel | count | total ms | mean us | of busy |\n|---|---|---|---|---|")
    for n, (k, t) in sorted(by.items(), key=lambda x: -x[1][1])[:top]:
        print("| %s | %d | %.3f | %.1f | %.1f %% |" % (n, k, t / 1e6, t / k / 1e3, 100.0 * t / busy))
    if gaps:
        gb = collections.defaultdict(lambda: [0, 0])
        host = collections.defaultdict(int)
        for g in gaps:
            gb[g[1]][0] += 1
            gb[g[1]][1] += g[0]
        for glen, _, _, ga, gz in gaps:
            for a, b, n in calls:
                if b <= ga or a >= gz:
                    continue
                host[n] += min(b, gz) - max(a, ga)
        print("\n| idle gaps after kernel | count | total ms |\n|---|---|---|")
        for n, (k, t) in sorted(gb.items(), key=lambda x: -x[1][1])[:top]:
            print("| %s | %d | %.3f |" % (n, k, t / 1e6))
        print("\n| host call during the gaps | ms |\n|---|---|")
        for n, t in sorted(host.items(), key=lambda x: -x[1])[:12]:
            print("| %s | %.3f |" % (n, t / 1e6))
        print("\nlongest gaps (us: before -> after):")
        for g in sorted(gaps, reverse=True)[:8]:
            print("  %.1f: %s -> %s" % (g[0] / 1e3, g[1], g[2]))
    hc = collections.defaultdict(lambda: [0, 0])
    for a, b, n in calls:
        hc[n][0] += 1
        hc[n][1] += b - a
    print("\n| host runtime call | count | total ms |\n|---|---|---|")
    for n, (k, t) in sorted(hc.items(), key=lambda x: -x[1][1])[:12]:
        print("| %s | %d | %.3f |" % (n, k, t / 1e6))
    if seq:
        sequence(ev, seq)
    if first:
        chain(ev, first)
    print()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--windows", type=int, default=0, help="only the last N windows")
    ap.add_argument("--gap-us", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--by-grid", action="store_true", help="kernels apart by grid size too")
    ap.add_argument("--labels", default="", help="comma-separated names for the windows, in order")
    ap.add_argument("--sequence", type=int, default=0, help="list the last N kernels of each window in order")
    ap.add_argument("--chain", default="", metavar="NAME",
                    help="from the last kernel named like NAME on (e.g. k_embed: one decode step), each kernel's "
                         "median end after the previous one's end")
    a = ap.parse_args()
    gpu, api = load(a.csv, a.by_grid)
    ws = windows(api)
    if not ws:
        lo = min([g[0] for g in gpu] + [c[0] for c in api])
        hi = max([g[1] for g in gpu] + [c[1] for c in api])
        ws = [(lo, hi)]
    labels = a.labels.split(",") if a.labels else []
    if a.windows:
        ws = ws[-a.windows:]
    for i, (lo, hi) in enumerate(ws):
        print("### window %d%s" % (i, (": " + labels[i]) if i < len(labels) else ""))
        summarise(gpu, api, lo, hi, a.gap_us * 1e3, a.top, a.sequence, a.chain)


if __name__ == "__main__":
    main()

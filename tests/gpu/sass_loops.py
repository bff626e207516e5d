#!/usr/bin/env python3
"""Shows, for each loop of a kernel's SASS, in which order its global loads
and its FMAs are issued.

A one-row GEMV streams at the rate its warps keep loads in flight; ptxas
decides that by where it places each load against the FMAs that use the
loads before it. This reads `cuobjdump -sass -fun <mangled name> <binary>`
output (run on a GPU host: the development VM has no cuobjdump), finds the
backward branches, and prints each loop body that has both loads and FMAs
as a string: L a global load (LDG), g a global-to-shared copy (LDGSTS,
cp.async), T a bulk copy (UBLKCP, cp.async.bulk), s a shared-memory load
(LDS), fN a run of N FFMA/FMUL. Loads count L, g and T. `LLLf8Lf8...`
means three loads go out before the first FMAs, then one a time: about
three loads in flight a warp.

Usage: sass_loops.py kernel.sass [--min-loads 4]
(docs/benchmarks.md, session 16, call F.)
"""
import argparse
import re


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sass")
    ap.add_argument("--min-loads", type=int, default=4, help="print only loops with at least this many LDGs")
    args = ap.parse_args()
    ins = []
    for line in open(args.sass):
        m = re.search(r"/\*([0-9a-f]{4,6})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    at = {a: i for i, (a, _) in enumerate(ins)}
    found = 0
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in at:
            continue
        body = ins[at[int(m.group(1), 16)]:i + 1]
        seq = ""
        for _, t in body:
            op = [o for o in t.split() if not o.startswith("@")][0]
            seq += "g" if op.startswith("LDGSTS") else "L" if op.startswith("LDG") else "T" if op.startswith("UBLKCP") \
                else "s" if op.startswith("LDS") else "f" if op.startswith(("FFMA", "FMUL")) else ""
        loads = sum(seq.count(k) for k in "LgT")
        if loads < args.min_loads or "f" not in seq:
            continue
        found += 1
        print("loop %#x-%#x, %d instructions, %d LDG, %d LDGSTS, %d UBLKCP, %d FFMA/FMUL:" %
              (body[0][0], a, len(body), seq.count("L"), seq.count("g"), seq.count("T"), seq.count("f")))
        print("  " + re.sub(r"f+", lambda r: "f%d" % len(r.group(0)), seq))
    if not found:
        raise SystemExit("%s: no loop with %d or more loads and FMAs" % (args.sass, args.min_loads))


if __name__ == "__main__":
    main()

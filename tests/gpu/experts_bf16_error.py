#!/usr/bin/env python3
"""The error the CUDA backend's bf16 experts are expected to show against fp32.

kernels/tests/test_backend_ops.c compares moe_experts / moe_experts_ids on
the CUDA backend with bf16 weights against the fp32 CPU backend, by the
normalised error max|got - want| / max|want|. With bf16 weights the CUDA
backend's grouped path (moe_experts, and moe_experts_ids past 1024 pairs or
on dimensions its GEMVs do not take) rounds to bf16, besides the weights,
the gathered rows x, the gate_up output, SwiGLU's output and the down
output (kernels/cuda/moe.cu, moe_run), each in round-to-nearest-even after
fp32 accumulation; the GEMV path rounds only the weights. This
emulates those roundings in double on the test's shapes and distributions
(x ~ N(0, 1), out0 ~ N(0, 0.1), gate_up ~ N(0, 1/H), down ~ N(0, 1/I),
route weights ~ U(0, 1)) and prints the error's spread over DRAWS draws,
the ground for the test's bf16 tolerance (experts_tol).

Usage: experts_bf16_error.py [DRAWS]   (numpy)

       experts_bf16_error.py --dump FILE...

The second form reads what test_backend_ops writes with
PD_TEST_DUMP_EXPERTS=dir (its dump_experts: the inputs of one shape of
test_moe_experts_ids, the CUDA bf16 output and the CPU backend's) and
emulates the same roundings on those very inputs: per shape, the test's
error (CUDA against CPU), the emulation's against the CPU, and the CUDA
output's distance from the emulation, all over the CPU output's largest
value; then the element where CUDA is farthest from the CPU, with the three
values there. On the H200 (session 21) the grouped path's shapes gave the emulation
within 2.5e-4 of the largest value, the GEMV path's stayed below it.
"""
import statistics
import sys

import numpy as np


def bf16(a):
    """Rounds float32 values to bf16 (nearest, ties to even), kept as float32."""
    b = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def draw(rng, rows, H, I, k, E):
    x = rng.normal(0, 1, (rows, H)).astype(np.float32)
    out0 = rng.normal(0, 0.1, (rows, H)).astype(np.float32)
    gu = [(rng.normal(0, 1, (2 * I, H)) / np.sqrt(H)).astype(np.float32) for _ in range(E)]
    dn = [(rng.normal(0, 1, (H, I)) / np.sqrt(I)).astype(np.float32) for _ in range(E)]
    want = out0.astype(np.float64)
    got = out0.astype(np.float64)
    for r in range(rows):
        for e in rng.choice(E, k, replace=False):
            w = rng.uniform(0, 1)
            h = gu[e].astype(np.float64) @ x[r]
            g, u = h[:I], h[I:]
            want[r] += w * (dn[e].astype(np.float64) @ (g / (1 + np.exp(-g)) * u))
            h = bf16(bf16(gu[e]).astype(np.float64) @ bf16(x[r])).astype(np.float64)
            g, u = h[:I], h[I:]
            act = bf16(g / (1 + np.exp(-g)) * u).astype(np.float64)
            got[r] += w * bf16(bf16(dn[e]).astype(np.float64) @ act)
    return np.abs(got - want).max() / np.abs(want).max()


def emulate(x, out0, ids, w, gu, dn):
    """The CUDA bf16 experts' output on these inputs: fp32 sums in double, bf16 roundings as moe_run's."""
    I = dn.shape[2]
    got = out0.astype(np.float64)
    gub = [bf16(g).astype(np.float64) for g in gu]
    dnb = [bf16(d).astype(np.float64) for d in dn]
    xb = bf16(x).astype(np.float64)
    for r in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[r, j]
            h = bf16(gub[e] @ xb[r]).astype(np.float64)
            g, u = h[:I], h[I:]
            act = bf16(g / (1 + np.exp(-g)) * u).astype(np.float64)
            got[r] += float(w[r, j]) * bf16(dnb[e] @ act).astype(np.float64)
    return got


def read_dump(path):
    with open(path, "rb") as f:
        hdr = np.fromfile(f, np.int32, 5)
        if hdr.size != 5:
            raise SystemExit("%s: short file" % path)
        rows, H, I, k, E = (int(v) for v in hdr)
        def take(dt, *shape):
            n = int(np.prod(shape))
            a = np.fromfile(f, dt, n)
            if a.size != n:
                raise SystemExit("%s: short file" % path)
            return a.reshape(shape)
        x, out0 = take(np.float32, rows, H), take(np.float32, rows, H)
        ids, w = take(np.int32, rows, k), take(np.float32, rows, k)
        gu, dn = take(np.float32, E, 2 * I, H), take(np.float32, E, H, I)
        cuda, cpu = take(np.float32, rows, H), take(np.float32, rows, H)
    return (rows, H, I, k, E), x, out0, ids, w, gu, dn, cuda, cpu


def compare(paths):
    for path in paths:
        shape, x, out0, ids, w, gu, dn, cuda, cpu = read_dump(path)
        emu = emulate(x, out0, ids, w, gu, dn)
        ref = cpu.astype(np.float64)
        mx = np.abs(ref).max()
        d_cuda = np.abs(cuda - ref)
        at = np.unravel_index(np.argmax(d_cuda), d_cuda.shape)
        print("%s: rows %d hidden %d inter %d top %d of %d: cuda-cpu %.4f, emulation-cpu %.4f, cuda-emulation %.5f;"
              " worst at row %d col %d: cuda %.6f cpu %.6f emulation %.6f (largest |cpu| %.4f)" %
              (path, *shape, d_cuda.max() / mx, np.abs(emu - ref).max() / mx, np.abs(cuda - emu).max() / mx,
               at[0], at[1], cuda[at], cpu[at], emu[at], mx))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--dump":
        compare(sys.argv[2:])
        return
    draws = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    rng = np.random.default_rng(1)
    # rows, hidden, inter, top_k, experts: test_moe_experts_ids's shapes
    for shape in ((1, 64, 32, 2, 8), (33, 128, 64, 6, 16), (200, 64, 32, 6, 8), (700, 64, 32, 6, 16),
                  (300, 30, 18, 4, 8)):
        v = [draw(rng, *shape) for _ in range(draws)]
        print("rows %d hidden %d inter %d top %d of %d: median %.4f, min %.4f, max %.4f over %d draws" %
              (*shape, statistics.median(v), min(v), max(v), draws))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The error the CUDA backend's bf16 experts are expected to show against fp32.

kernels/tests/test_backend_ops.c compares moe_experts / moe_experts_ids on
the CUDA backend with bf16 weights against the fp32 CPU backend, by the
normalised error max|got - want| / max|want|. With bf16 weights the CUDA
backend rounds to bf16, besides the weights, the gathered rows x, the
gate_up output, SwiGLU's output and the down output (kernels/cuda/moe.cu,
moe_run), each in round-to-nearest-even after fp32 accumulation. This
emulates those roundings in double on the test's shapes and distributions
(x ~ N(0, 1), out0 ~ N(0, 0.1), gate_up ~ N(0, 1/H), down ~ N(0, 1/I),
route weights ~ U(0, 1)) and prints the error's spread over DRAWS draws,
the ground for the test's bf16 tolerance (experts_tol).

Usage: experts_bf16_error.py [DRAWS]   (numpy)
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


def main():
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

"""Compares two `pdserve generate --dump-logits` files (fp32 rows of
vocab_size values, one per generated token): per row, the normalised error
max|a - b| / max|b| and whether the argmax agrees.

usage: python3 tests/gpu/cmp_logits.py A.bin B.bin MODEL_DIR [TOLERANCE]
(vocab_size from MODEL_DIR/config.json)
Exit status 1 when a row is over TOLERANCE (default 1e-2, bf16) or an
argmax differs."""
import json
import os
import sys

import numpy as np


def main():
    a = np.fromfile(sys.argv[1], dtype=np.float32)
    b = np.fromfile(sys.argv[2], dtype=np.float32)
    with open(os.path.join(sys.argv[3], "config.json")) as f:
        v = int(json.load(f)["vocab_size"])
    tol = float(sys.argv[4]) if len(sys.argv) > 4 else 1e-2
    if a.size != b.size or a.size % v or a.size == 0:
        print(f"sizes differ or are not rows of {v}: {a.size} and {b.size}")
        return 1
    a, b = a.reshape(-1, v), b.reshape(-1, v)
    err = np.abs(a.astype(np.float64) - b).max(axis=1) / np.abs(b).max(axis=1)
    same = (a.argmax(axis=1) == b.argmax(axis=1))
    print(f"{a.shape[0]} rows: worst normalised error {err.max():.3g} (mean {err.mean():.3g}), "
          f"argmax equal in {int(same.sum())}/{a.shape[0]} rows; tolerance {tol:g}")
    return 0 if np.all(np.isfinite(err)) and err.max() <= tol and same.all() else 1


if __name__ == "__main__":
    sys.exit(main())

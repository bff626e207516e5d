#!/usr/bin/env python3
"""The first layers of v2-lite on the CUDA backend against transformers on
the same weights (issue 6: "whole model logits against transformers ... for
the first layers of v2-lite"), run on a GPU host by tests/gpu/run.sh v2ref:

    python3 tests/gpu/v2lite_ref.py MODEL_DIR [--prompt-len 700] [--chunk 256] [-n 8] [--tol 5e-2]

MODEL_DIR: `pdserve mkmodel --preset v2-lite --num-layers N` (real shapes:
16 heads, latent 512, q 192 / v 128, 64 routed experts top-6, 2 shared).
One random prompt of --prompt-len ids (seed 0) is prefilled by `pdserve
generate --device cuda` in chunks of --chunk tokens (so later chunks attend
to earlier ones through the paged cache and cross the 64-query tiles of the
fused kernel), then -n tokens are decoded greedily; --dump-logits keeps the
logits of every decoded position. Once for each prefill attention
(PD_MLA_PREFILL=kernel, gemm, flash). transformers (bf16, its default
attention) then runs prompt + the generated ids[:-1] in one forward, and the
rows at the same positions are compared: normalised error max|a - b| /
max|b| per row, and whether the argmax agrees. Exit status 1 when a row of
any variant is over --tol or not finite. Needs PD_BIN (run.sh sets it)."""
import argparse, os, subprocess, sys, tempfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def pdserve_run(model, ids, chunk, n, variant, work):
    dump = os.path.join(work, f"logits-{variant}.bin")
    env = dict(os.environ, PD_MLA_PREFILL=variant)
    r = subprocess.run([os.environ["PD_BIN"], "generate", "--model", model, "--device", "cuda", "--prompt-ids",
                        ",".join(map(str, ids)), "-n", str(n), "--ignore-eos", "--ids", "--chunked-prefill-size",
                        str(chunk), "--dump-logits", dump], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"pdserve generate ({variant}) failed: {r.stderr.strip()[-400:]}")
    lines = r.stdout.strip().splitlines()
    gen = [int(x) for x in lines[1].split()]
    return gen, np.fromfile(dump, dtype=np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-len", type=int, default=700)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--tol", type=float, default=5e-2)
    a = ap.parse_args()
    hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, device_map="cuda")
    hf.eval()
    V = hf.config.vocab_size
    print(f"model {a.model}: {hf.config.num_hidden_layers} layers, vocab {V}; attention "
          f"{hf.config._attn_implementation}; prompt {a.prompt_len} ids in chunks of {a.chunk}, {a.n} decoded")
    ids = np.random.default_rng(0).integers(3, V, a.prompt_len).tolist()
    fails = 0
    with tempfile.TemporaryDirectory() as work:
        for variant in ("kernel", "gemm", "flash"):
            gen, got = pdserve_run(a.model, ids, a.chunk, a.n, variant, work)
            got = got.reshape(-1, V)
            seq = torch.tensor([ids + gen[:-1]], device="cuda")
            with torch.no_grad():
                ref = hf(seq).logits[0, a.prompt_len - 1:].float().cpu().numpy()
            if ref.shape != got.shape:
                print(f"{variant}: {got.shape[0]} rows from pdserve, {ref.shape[0]} from transformers")
                fails += 1
                continue
            err = np.abs(got.astype(np.float64) - ref).max(axis=1) / np.abs(ref).max(axis=1)
            same = int((got.argmax(axis=1) == ref.argmax(axis=1)).sum())
            ok = bool(np.all(np.isfinite(err)) and err.max() <= a.tol)
            fails += not ok
            print(f"PD_MLA_PREFILL={variant}: worst normalised error {err.max():.3g} (mean {err.mean():.3g}) over "
                  f"{len(err)} rows, argmax equal in {same}/{len(err)}; tolerance {a.tol:g}: {'ok' if ok else 'FAIL'}")
    print(f"failures: {fails}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The peer figure for tests/gpu/bench_step.c: Hugging Face transformers on
the same checkpoint, the same GPU, the same run.

    python3 tests/gpu/peer_hf.py MODEL_DIR [--batches 1,8,32] [--contexts 1024,8192] [--steps 5]

For each context L and batch B: one random prompt of L tokens is prefilled
(transformers' default attention), its cache repeated B times
(DynamicCache.batch_repeat_interleave), then decode steps of one random
token per sequence are timed with torch.cuda.synchronize around
model(input_ids[B, 1], past_key_values=cache); the cache is cropped back
to L after each step, so every step sees context L. Median of --steps after
two warm-up steps. Prints a markdown table; a configuration that fails
(out of memory, say) prints its error instead.

    python3 tests/gpu/peer_hf.py MODEL_DIR --prompts 1024,8192,32768 [--chunk 8192]

Prefill instead (the peer of tests/gpu/bench_prefill.c): one random prompt
of L tokens fed in chunks of --chunk tokens with the cache carried between
them (as pdserve's chunked prefill does), timed with torch.cuda.synchronize
around the whole prompt, after one untimed run of the first chunk.
"""
import argparse, statistics, sys, time, traceback

import torch
import transformers
from transformers import AutoModelForCausalLM


def repeat(cache, B):
    """Every sequence of the batch starts from the same prefilled cache."""
    if hasattr(cache, "batch_repeat_interleave"):
        cache.batch_repeat_interleave(B)
        return
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(B, dim=0)
        layer.values = layer.values.repeat_interleave(B, dim=0)


def crop(cache, L):
    if hasattr(cache, "crop"):
        cache.crop(L)
        return
    for layer in cache.layers:
        layer.keys = layer.keys[..., :L, :]
        layer.values = layer.values[..., :L, :]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", default="", help="prefill these prompt lengths instead of decode steps")
    ap.add_argument("--chunk", type=int, default=8192)
    a = ap.parse_args()
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, device_map="cuda")
    model.eval()
    print(f"# transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}; "
          f"attention {model.config._attn_implementation}; loaded in {time.time() - t0:.1f} s\n")
    V = model.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(0)
    if a.prompts:
        prefill(model, a, V, g)
        return
    print("| context | batch | step ms (median) | tok/s |\n|---|---|---|---|", flush=True)
    for L in [int(x) for x in a.contexts.split(",")]:
        for B in [int(x) for x in a.batches.split(",")]:
            try:
                with torch.no_grad():
                    prompt = torch.randint(3, V, (1, L), device="cuda", generator=g)
                    out = model(prompt, use_cache=True)
                    cache = out.past_key_values
                    del out
                    if B > 1:
                        repeat(cache, B)
                    times = []
                    for it in range(a.steps + 2):
                        ids = torch.randint(3, V, (B, 1), device="cuda", generator=g)
                        pos = torch.full((B, 1), L, device="cuda", dtype=torch.long)
                        torch.cuda.synchronize()
                        s = time.perf_counter()
                        model(ids, past_key_values=cache, position_ids=pos, use_cache=True)
                        torch.cuda.synchronize()
                        e = time.perf_counter()
                        crop(cache, L)
                        if it >= 2:
                            times.append(e - s)
                    med = statistics.median(times)
                    print(f"| {L} | {B} | {med * 1e3:.2f} | {B / med:.0f} |", flush=True)
                    del cache
            except Exception as ex:  # out of memory at the largest sizes, say
                print(f"| {L} | {B} | failed: {type(ex).__name__}: {str(ex)[:160]} | - |", flush=True)
                traceback.print_exc(file=sys.stderr)
            torch.cuda.empty_cache()


def prefill(model, a, V, g):
    print(f"| prompt tokens | chunk | seconds | tok/s |\n|---|---|---|---|", flush=True)
    first = True
    for L in [int(x) for x in a.prompts.split(",")]:
        try:
            with torch.no_grad():
                prompt = torch.randint(3, V, (1, L), device="cuda", generator=g)
                if first:  # warm-up: kernels chosen, allocator grown
                    model(prompt[:, : min(L, a.chunk)], use_cache=True)
                    first = False
                torch.cuda.synchronize()
                s = time.perf_counter()
                cache = None
                for p in range(0, L, a.chunk):
                    ids = prompt[:, p : p + a.chunk]
                    out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    cache = out.past_key_values
                    del out
                torch.cuda.synchronize()
                e = time.perf_counter()
                del cache
                print(f"| {L} | {a.chunk} | {e - s:.3f} | {L / (e - s):.0f} |", flush=True)
        except Exception as ex:  # out of memory at the largest sizes, say
            print(f"| {L} | {a.chunk} | failed: {type(ex).__name__}: {str(ex)[:160]} | - |", flush=True)
            traceback.print_exc(file=sys.stderr)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Golden logits and greedy ids from Hugging Face transformers for a pdserve
preset checkpoint (written by `pdserve mkmodel`).

Runs where torch + transformers (with deepseek_v2/v3) are installed — the
H200 host. The reference runs on the CPU in float32 with eager attention, so
no TF32 or fused kernels change the numbers.

  python3 tests/reference/make_fixtures.py --model DIR --preset tiny --seed 1 \
      --out tests/reference/fixtures/model_tiny.json

For each prompt (random token ids of lengths 1, 7, 33, 64 from a fixed
generator) it runs a prefill, then 8 greedy decode steps with the KV cache,
and records for each of the 9 logits rows: the top-16 ids and values, the
values at 256 fixed probe ids, and the row's mean and L2 norm. For the
64-token prompt it also records every prefill position (top-4 + 64 probes).
Weights are identified by the SHA-256 of each safetensors file so the C test
can prove it is comparing the same weights.
"""
import argparse, glob, hashlib, json, os, re, sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def load_model(d):
    cfg = AutoConfig.from_pretrained(d)
    model, info = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        print("from_pretrained reported", {k: list(v)[:5] for k, v in bad.items()}, "- loading by hand",
              file=sys.stderr)
        model = load_by_hand(d, cfg)
    return model.eval()


def load_by_hand(d, cfg):
    """Fill the model's state dict from the checkpoint, fusing per-expert
    gate/up/down weights when this transformers version stores experts as
    3-D tensors."""
    from safetensors.torch import load_file
    ours = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        ours.update(load_file(f))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    sd = model.state_dict()
    new = {}
    for k, v in sd.items():
        if k in ours:
            new[k] = ours[k].to(torch.float32)
            continue
        m = re.match(r"(.*)\.experts\.(gate_up_proj|down_proj)$", k)
        if not m:
            raise SystemExit(f"no checkpoint tensor for model parameter {k}")
        p, kind = m.groups()
        E = v.shape[0]
        mats = []
        for e in range(E):
            if kind == "gate_up_proj":
                g = ours[f"{p}.experts.{e}.gate_proj.weight"]
                u = ours[f"{p}.experts.{e}.up_proj.weight"]
                mats.append(torch.cat([g, u], 0))
            else:
                mats.append(ours[f"{p}.experts.{e}.down_proj.weight"])
        t = torch.stack(mats).to(torch.float32)
        if t.shape != v.shape:
            t = t.transpose(1, 2)
        assert t.shape == v.shape, (k, t.shape, v.shape)
        new[k] = t.contiguous()
    model.load_state_dict(new, strict=True)
    return model


def row_summary(logits, probes, k):
    logits = logits.double()
    top = torch.topk(logits, k)
    return {
        "top_ids": top.indices.tolist(),
        "top_vals": [float(x) for x in top.values],
        "probe_vals": [float(logits[i]) for i in probes],
        "mean": float(logits.mean()),
        "l2": float(logits.norm()),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() // 2))
    model = load_model(a.model)
    cfg = model.config
    V = cfg.vocab_size
    g = torch.Generator().manual_seed(1234)
    probes = sorted(set(torch.randint(0, V, (256,), generator=g).tolist()))
    rot = model.model.rotary_emb
    out = {
        "preset": a.preset,
        "seed": a.seed,
        "command": " ".join(sys.argv),
        "mkmodel": f"pdserve mkmodel --preset {a.preset} --seed {a.seed} --out DIR",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model_class": type(model).__name__,
        "sha256": {os.path.basename(f): sha256(f) for f in sorted(glob.glob(os.path.join(a.model, "*.safetensors")))},
        "inv_freq": [float(x) for x in rot.inv_freq.double()],
        "attention_scaling": float(getattr(rot, "attention_scaling", 1.0)),
        "softmax_scaling": float(model.model.layers[0].self_attn.scaling),
        "probe_ids": probes,
        "cases": [],
    }
    gp = torch.Generator().manual_seed(99)
    for n in (1, 7, 33, 64):
        prompt = torch.randint(3, 128000, (n,), generator=gp).tolist()
        case = {"prompt_ids": prompt, "greedy_ids": [], "rows": [], "positions": []}
        with torch.no_grad():
            res = model(torch.tensor([prompt]), use_cache=True)
            cache = res.past_key_values
            lg = res.logits[0]
            if n == 64:
                for i in range(n):
                    s = row_summary(lg[i], probes[:64], 4)
                    case["positions"].append(s)
            last = lg[-1]
            for step in range(args_steps(a) + 1):
                case["rows"].append(row_summary(last, probes, 16))
                nxt = int(torch.argmax(last))
                case["greedy_ids"].append(nxt)
                if step == args_steps(a):
                    break
                res = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
                cache = res.past_key_values
                last = res.logits[0, -1]
        out["cases"].append(case)
        print(f"prompt {n}: greedy {case['greedy_ids']}", file=sys.stderr)
    with open(a.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print("wrote", a.out, file=sys.stderr)


def args_steps(a):
    return a.steps


if __name__ == "__main__":
    main()

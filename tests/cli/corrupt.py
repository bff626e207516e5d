#!/usr/bin/env python3
"""Corrupts a tiny pdserve checkpoint in one named way and prints the words
the error message must contain (file name, tensor or field)."""
import json, os, struct, sys

d, case = sys.argv[1], sys.argv[2]
st = os.path.join(d, "model.safetensors")
cfgp = os.path.join(d, "config.json")
raw = open(st, "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
hdr = json.loads(raw[8:8 + n])
data = raw[8 + n:]
names = [k for k in hdr if k != "__metadata__"]
victim = "model.layers.1.self_attn.kv_b_proj.weight"


def write(h, payload=None, extra=b""):
    hb = json.dumps(h).encode()
    hb += b" " * (-len(hb) % 8)
    with open(st, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + (data if payload is None else payload) + extra)


if case == "truncated":
    open(st, "wb").write(raw[: 8 + n + len(data) // 2])
    print("model.safetensors")
elif case == "header_past_end":
    open(st, "wb").write(struct.pack("<Q", len(raw) * 4) + raw[8:])
    print("model.safetensors")
elif case == "header_short":
    open(st, "wb").write(raw[:5])
    print("model.safetensors")
elif case == "empty_file":
    open(st, "wb").write(b"")
    print("model.safetensors")
elif case == "malformed_json":
    hb = raw[8:8 + n].replace(b'"dtype"', b'"dtype', 1)
    open(st, "wb").write(raw[:8] + hb + data)
    print("model.safetensors")
elif case == "not_object":
    hb = b"[1,2,3]" + b" " * (n - 7)
    open(st, "wb").write(raw[:8] + hb + data)
    print("model.safetensors")
elif case == "overlap":
    # the victim's bytes start inside another tensor's span
    a = hdr["model.embed_tokens.weight"]["data_offsets"]
    t = hdr[victim]
    ln = t["data_offsets"][1] - t["data_offsets"][0]
    t["data_offsets"] = [a[0] + 2, a[0] + 2 + ln]
    write(hdr)
    print("model.safetensors overlap")
elif case == "out_of_range":
    t = hdr[victim]
    ln = t["data_offsets"][1] - t["data_offsets"][0]
    t["data_offsets"] = [len(data) - ln // 2, len(data) - ln // 2 + ln]
    write(hdr)
    print("model.safetensors", victim)
elif case == "span_mismatch":
    hdr[victim]["shape"] = [hdr[victim]["shape"][0], hdr[victim]["shape"][1] + 1]
    write(hdr)
    print("model.safetensors", victim)
elif case == "unknown_dtype":
    hdr[victim]["dtype"] = "Q4_K"
    write(hdr)
    print("model.safetensors", victim, "Q4_K")
elif case == "missing_tensor":
    del hdr[victim]
    write(hdr)
    print(victim)
elif case == "shape_mismatch":
    # a consistent header whose shape disagrees with config.json
    t = hdr[victim]
    r, c = t["shape"]
    t["shape"] = [c, r]
    write(hdr)
    print("model.safetensors", victim)
elif case == "duplicate_name":
    hb = raw[8:8 + n].decode()
    key = json.dumps(victim)
    i = hb.index(key)
    j = hb.index("}", i) + 1
    entry = hb[i:j]
    hb2 = hb[:j] + "," + entry + hb[j:]
    hb2 = hb2.encode()
    hb2 += b" " * (-len(hb2) % 8)
    open(st, "wb").write(struct.pack("<Q", len(hb2)) + hb2 + data)
    print("model.safetensors")
elif case == "config_missing_field":
    c = json.load(open(cfgp))
    del c["kv_lora_rank"]
    json.dump(c, open(cfgp, "w"))
    print("config.json kv_lora_rank")
elif case == "config_bad_type":
    c = json.load(open(cfgp))
    c["hidden_size"] = "sixty-four"
    json.dump(c, open(cfgp, "w"))
    print("config.json hidden_size")
elif case == "config_bad_model_type":
    c = json.load(open(cfgp))
    c["model_type"] = "llama"
    json.dump(c, open(cfgp, "w"))
    print("config.json model_type llama")
elif case == "config_malformed":
    open(cfgp, "w").write('{"model_type": "deepseek_v3",')
    print("config.json")
elif case == "missing_scale":
    # claim FP8 in the config: every linear weight needs weight_scale_inv
    c = json.load(open(cfgp))
    c["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    json.dump(c, open(cfgp, "w"))
    hdr["model.layers.0.self_attn.q_a_proj.weight"]["dtype"] = "F8_E4M3"
    t = hdr["model.layers.0.self_attn.q_a_proj.weight"]
    # F8 is 1 byte/elem: halve the span by shrinking the end offset is not allowed (overlap-free but gap is fine)
    t["data_offsets"] = [t["data_offsets"][0], t["data_offsets"][0] + (t["data_offsets"][1] - t["data_offsets"][0]) // 2]
    write(hdr)
    print("weight_scale_inv")
else:
    sys.exit("unknown case " + case)

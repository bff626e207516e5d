#!/usr/bin/env python3
"""top_logprobs end to end on 127.0.0.1 with the tiny model: `pdserve up`
(gateway, one prefill and one decode replica), both routes (a prompt at or
under --long-prompt-threshold is prefilled on the decode replica, a longer
one on the prefill replica, whose first token comes with KvComplete).

Checks, per route and endpoint:
- greedy with top_logprobs 5: 5 alternatives per token, logprobs <= 0 and
  sorted descending, the sampled token first with the very same logprob
  (chat: token, logprob and bytes; completions: the first key of the dict);
- asking for logprobs does not change the greedy text;
- sampled (temperature 1, seed) with top_logprobs 3: the sampled token's
  logprob is at most the top-1's, equal to its entry when listed;
- streamed == non-streamed: the chunks' logprobs concatenated equal the
  whole response's;
- the long route moved KV (so the first token's alternatives came through
  the prefill replica);
- ids the tokenizer lacks (the model's padding rows) are never drawn, even
  with logit_bias +100 on one: every token has text, on both routes;
- logit_bias on both routes (the long route's first token is the prefill
  replica's): +100 on one token makes every generated token that token,
  greedy and at temperature 1, on both endpoints; -100 on the greedy first
  token makes greedy pick another; the logprobs stay the raw model's (the
  biased token's is far below 0); an id outside the vocabulary is a 400
  naming logit_bias;
- /tokenize and /detokenize (vLLM's) on the stack's gateway:
  detokenize(tokenize(x)) == x for plain text, count == len(tokens), the
  ids are the tokenizer.json vocabulary's and what a completion of the same
  prompt counts as prompt_tokens (text and chat); 4xx error bodies; /version;
- prompt logprobs (completions, echo + logprobs, as lm-evaluation-harness's
  loglikelihood requests): a prompt longer than the threshold still takes
  the short route (no KV moves); the first prompt token has null
  token_logprobs and top_logprobs; every other equals log_softmax of the
  logits `pdserve generate --dump-logits` gives after the tokens before it
  (an independent prefill, no scheduler) within 1e-4; top_logprobs sorted,
  their best the reference's best, holding the token's own logprob;
  text_offset of a text prompt points at each token in the echoed text;
  streamed == non-streamed, n = 2 choices agree; max_tokens 0 with echo
  answers the prompt alone (with and without logprobs, streamed too);
  max_tokens 0 without echo and logprobs outside 0..20 are 400s.
Run by ctest (tests/integration/*.py) with PD_BIN set.
"""
import json, math, os, random, struct, subprocess, tempfile, time

from pdtest import (BIN, check, finish, free_port_pair, metric, metrics, pd_stack_flags, request, start_up, stop_up,
                    stream, tiny_model, wait_ready)

CHUNK = 8
THRESHOLD = 12
K = 5


def post(port, path, body):
    st, _, data = request(port, "POST", path, body, 60)
    check(st == 200, f"{path}: status {st} {data[:200]!r}", quiet_ok=True)
    return json.loads(data) if st == 200 else None


def stream_logprobs(port, path, body):
    """The streamed response's choices[0].logprobs, concatenated over its chunks."""
    acc = None
    for ev in stream(port, path, body).events:
        for ch in ev.get("choices", []):
            lp = ch.get("logprobs")
            if not lp:
                continue
            if acc is None:
                acc = {k: [] for k in lp}
            for k, v in lp.items():
                acc[k].extend(v)
    return acc


def check_sorted(values, what):
    check(all(v <= 0 for v in values), f"{what}: logprobs <= 0 ({values})", quiet_ok=True)
    check(all(a >= b for a, b in zip(values, values[1:])), f"{what}: sorted descending ({values})", quiet_ok=True)


def check_chat_greedy(lp, what):
    content = lp["content"]
    check(len(content) > 0, f"{what}: logprobs for every token")
    for j, e in enumerate(content):
        top = e["top_logprobs"]
        w = f"{what} token {j}"
        check(len(top) == K, f"{w}: {len(top)} alternatives, want {K}", quiet_ok=True)
        check_sorted([t["logprob"] for t in top], w)
        check(top and top[0]["token"] == e["token"] and top[0]["bytes"] == e["bytes"],
              f"{w}: the sampled token {e['token']!r} is top-1 ({top[:1]})", quiet_ok=True)
        check(top and top[0]["logprob"] == e["logprob"],
              f"{w}: its logprob {e['logprob']} equals top_logprobs[0] {top[:1]}", quiet_ok=True)
    print(f"ok: {what}: {len(content)} tokens, each with {K} sorted alternatives, the sampled one first")


def check_completion_greedy(lp, what):
    n = len(lp["tokens"])
    check(n > 0 and len(lp["token_logprobs"]) == n and len(lp["top_logprobs"]) == n and len(lp["text_offset"]) == n,
          f"{what}: tokens, token_logprobs, top_logprobs, text_offset of one length")
    for j in range(n):
        d = lp["top_logprobs"][j]
        w = f"{what} token {j}"
        # distinct ids may share a text (a key kept once): at most K
        check(1 <= len(d) <= K, f"{w}: {len(d)} alternatives, want <= {K}", quiet_ok=True)
        check_sorted(list(d.values()), w)
        first = next(iter(d.items()))
        check(first == (lp["tokens"][j], lp["token_logprobs"][j]),
              f"{w}: the sampled token is top-1 ({first} vs {lp['tokens'][j]!r}, {lp['token_logprobs'][j]})",
              quiet_ok=True)
    print(f"ok: {what}: {n} tokens, sorted alternatives, the sampled one first")


def byte_level_vocab(model):
    """{token text: id} of the model's byte-level BPE tokenizer.json (GPT-2's
    bytes_to_unicode), for the tokens whose bytes are whole UTF-8."""
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    u2b = {chr(c): b for b, c in zip(bs, cs)}
    tok = json.load(open(os.path.join(model, "tokenizer.json"), encoding="utf-8"))
    out = {}
    for piece, i in tok["model"]["vocab"].items():
        try:
            out.setdefault(bytes(u2b[c] for c in piece).decode("utf-8"), i)
        except (KeyError, UnicodeDecodeError):
            pass
    return out


def check_logit_bias(port, model, routes):
    vocab = byte_level_vocab(model)
    word = next(w for w in (" the", " and", "ing", "the") if w in vocab)
    target = vocab[word]
    for route, (ids, text) in routes.items():
        for temp in (0, 1.0):
            w = f"{route} logit_bias +100 on {target} ({word!r}), temperature {temp}"
            body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": temp, "seed": 5,
                    "ignore_eos": True, "logprobs": 0, "logit_bias": {str(target): 100}}
            resp = post(port, "/v1/completions", body)
            if resp:
                lp = resp["choices"][0]["logprobs"]
                check(lp["tokens"] == [word] * 6 and resp["choices"][0]["text"] == word * 6,
                      f"{w}: completions: every token is it ({lp['tokens']})")
                check(all(x < -1.0 for x in lp["token_logprobs"]),
                      f"{w}: logprobs are the raw model's, not the biased distribution's ({lp['token_logprobs']})")
            cbody = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 6,
                     "temperature": temp, "ignore_eos": True, "logit_bias": {str(target): 100.0}}
            resp = post(port, "/v1/chat/completions", cbody)
            if resp:
                check(resp["choices"][0]["message"]["content"] == word * 6,
                      f"{w}: chat: every token is it ({resp['choices'][0]['message']['content']!r})")
        # +100 on an id the tokenizer lacks (past its size, inside the model's
        # padded vocabulary): never drawn, so every token still has text
        tok = json.load(open(os.path.join(model, "tokenizer.json"), encoding="utf-8"))
        n_text = 1 + max(max(tok["model"]["vocab"].values()), max(t["id"] for t in tok["added_tokens"]))
        n_model = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
        if check(n_model > n_text, f"the model pads its vocabulary ({n_model} > {n_text} ids with text)"):
            for temp in (0, 1.0):
                w = f"{route} logit_bias +100 on {n_model - 1} (no text), temperature {temp}"
                body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": temp, "seed": 5,
                        "ignore_eos": True, "logprobs": 0, "logit_bias": {str(n_model - 1): 100}}
                resp = post(port, "/v1/completions", body)
                if resp:
                    ch = resp["choices"][0]
                    check(ch["text"] and all(ch["logprobs"]["tokens"]) and resp["usage"]["completion_tokens"] == 6,
                          f"{w}: 6 tokens, each with text ({ch['logprobs']['tokens']})")
        # -100 on the greedy first token: greedy picks another
        base = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        plain = post(port, "/v1/completions", base)
        first = vocab.get(plain["choices"][0]["logprobs"]["tokens"][0]) if plain else None
        if first is not None:
            resp = post(port, "/v1/completions", dict(base, logit_bias={str(first): -100}))
            if resp:
                got = resp["choices"][0]["logprobs"]["tokens"][0]
                check(vocab.get(got) != first, f"{route} logit_bias -100 on the greedy token {first}: another ({got!r})")
    st, _, data = request(port, "POST", "/v1/completions",
                          {"model": "tiny", "prompt": "hi", "max_tokens": 1, "logit_bias": {"99999999": 1}}, 60)
    err = json.loads(data).get("error", {}) if st == 400 else {}
    check(st == 400 and err.get("param") == "logit_bias" and "99999999" in err.get("message", ""),
          f"logit_bias outside the vocabulary: 400 naming logit_bias and the id ({st} {data[:200]!r})")


def check_tokenize(port, model):
    vocab = byte_level_vocab(model)
    for text in ("Hello world", "The quick brown fox jumps over the lazy dog.", "Grüße, 世界! naïve — ok", " a  b "):
        a = post(port, "/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": False,
                                     "return_token_strs": True})
        if not a:
            continue
        w = f"tokenize {text!r}"
        check(a["count"] == len(a["tokens"]) and a["max_model_len"] > 0, f"{w}: count == len(tokens) ({a})", quiet_ok=True)
        check(len(a["token_strs"]) == a["count"], f"{w}: one token_str per token", quiet_ok=True)
        # a token whose bytes are whole UTF-8 has the vocabulary's id
        for i in a["tokens"]:
            piece = post(port, "/detokenize", {"tokens": [i]})
            if piece and piece["prompt"] in vocab and "\ufffd" not in piece["prompt"]:
                check(vocab[piece["prompt"]] == i, f"{w}: id {i} is tokenizer.json's for {piece['prompt']!r}",
                      quiet_ok=True)
        d = post(port, "/detokenize", {"model": "tiny", "tokens": a["tokens"]})
        check(d and d["prompt"] == text, f"{w}: detokenize(tokenize(x)) == x ({d})")
        # the generation path counts the same prompt the same (BOS added by default)
        b = post(port, "/tokenize", {"prompt": text})
        c = post(port, "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 1})
        if b and c:
            check(b["count"] == a["count"] + 1 == c["usage"]["prompt_tokens"],
                  f"{w}: with BOS {b['count']} tokens, a completion's prompt_tokens {c['usage']['prompt_tokens']}")
    msgs = [{"role": "user", "content": "Tell me a story"}]
    a = post(port, "/tokenize", {"model": "tiny", "messages": msgs, "add_generation_prompt": True})
    c = post(port, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 1})
    if a and c:
        check(a["count"] == c["usage"]["prompt_tokens"],
              f"tokenize chat: {a['count']} tokens, the chat completion's prompt_tokens {c['usage']['prompt_tokens']}")
    for path, body, status, param in (("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
                                      ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
                                      ("/detokenize", {"tokens": "12"}, 400, "tokens")):
        st, _, data = request(port, "POST", path, body, 60)
        err = json.loads(data).get("error", {}) if st == status else {}
        check(st == status and err.get("param") == param, f"{path} {body}: {status} naming {param} ({st} {data[:160]!r})")
    st, _, data = request(port, "POST", "/tokenize", b"{not json", 60)
    check(st == 400 and json.loads(data)["error"]["param"] is None, f"/tokenize, bad JSON: 400 ({st} {data[:160]!r})")
    st, _, data = request(port, "GET", "/version", None, 60)
    check(st == 200 and isinstance(json.loads(data).get("version"), str), f"GET /version: {st} {data!r}")


def ref_logprobs(model, ids):
    """log_softmax (in double) of the logits `pdserve generate --dump-logits`
    gives after the prompt ids: the CLI's own prefill of the model."""
    with tempfile.NamedTemporaryFile(suffix=".f32") as f:
        subprocess.run([BIN, "generate", "--model", model, "--prompt-ids", ",".join(map(str, ids)), "-n", "1",
                        "--ids", "--ignore-eos", "--threads", "1", "--dump-logits", f.name],
                       check=True, capture_output=True)
        data = open(f.name, "rb").read()
    row = struct.unpack(f"{len(data) // 4}f", data)
    m = max(row)
    lse = m + math.log(math.fsum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def stream_text(port, path, body):
    return "".join(ch.get("text", "") for ev in stream(port, path, body).events for ch in ev.get("choices", []))


def check_prompt_logprobs(port, model, rng):
    m0 = metrics(port)
    # longer than the threshold; the last 8 tokens greedy (the reference's
    # best), so that tokens ranked in the top K are met too
    ids = [rng.randrange(3, 120000) for _ in range(THRESHOLD)]
    refs = [None]
    for i in range(1, THRESHOLD + 8):
        refs.append(ref_logprobs(model, ids[:i]))
        if i == len(ids):
            ids.append(max(range(len(refs[i])), key=lambda t: (refs[i][t], -t)))
    n = len(ids)
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": K}
    resp = post(port, "/v1/completions", body)
    if not resp:
        return
    c = resp["choices"][0]
    lp = c["logprobs"]
    check(len(lp["tokens"]) == n + 1 and len(lp["token_logprobs"]) == n + 1 and len(lp["top_logprobs"]) == n + 1
          and len(lp["text_offset"]) == n + 1, f"prompt logprobs: {n} prompt + 1 generated entries")
    check(lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None,
          "prompt logprobs: the first prompt token's are null")
    worst, own_ranked = 0.0, 0
    for i in range(1, n):
        ref = refs[i]
        got = lp["token_logprobs"][i]
        worst = max(worst, abs(got - ref[ids[i]]))
        d = lp["top_logprobs"][i]
        w = f"prompt token {i}"
        vals = list(d.values())
        check_sorted(vals, w)
        best = sorted(range(len(ref)), key=lambda t: (-ref[t], t))[:K]
        check(abs(vals[0] - ref[best[0]]) < 1e-4, f"{w}: the best alternative {vals[0]} is the reference's "
              f"{ref[best[0]]}", quiet_ok=True)
        check(len(d) <= K + 1 and all(v >= ref[best[-1]] - 1e-4 or v == got for v in vals),
              f"{w}: the alternatives are the reference's top {K} (+ the token itself): {d}", quiet_ok=True)
        check(d.get(lp["tokens"][i]) == got, f"{w}: top_logprobs holds the token's own logprob {got}: {d}",
              quiet_ok=True)
        own_ranked += ids[i] in best
    check(worst < 1e-4, f"prompt logprobs == log_softmax of the reference logits (worst {worst:.2e})")
    check(own_ranked >= 8, f"prompt logprobs: {own_ranked} prompt tokens ranked in the top {K}, the greedy ones at least")
    check(c["text"].startswith(resp["choices"][0]["text"][:0]) and lp["text_offset"][0] == 0,
          "prompt logprobs: text_offset starts at 0")
    check(stream_logprobs(port, "/v1/completions", body) == lp, "prompt logprobs: streamed == non-streamed")
    check(stream_text(port, "/v1/completions", body) == c["text"], "prompt logprobs: streamed text == non-streamed")
    two = post(port, "/v1/completions", dict(body, n=2, max_tokens=3))
    if two:
        # the two are prefilled in one batch: the same to float noise
        a, b = (x["logprobs"] for x in two["choices"])
        close = all(x is None and y is None and z is None or abs(x - y) < 1e-4 and abs(x - z) < 1e-4
                    for x, y, z in zip(a["token_logprobs"][:n], b["token_logprobs"][:n], lp["token_logprobs"][:n]))
        check(close and a["tokens"][:n] == b["tokens"][:n] == lp["tokens"][:n],
              f"prompt logprobs: n = 2 choices agree ({a['token_logprobs'][:n]} {b['token_logprobs'][:n]})")
    # ---- max_tokens 0 with echo: the prompt alone (vLLM) ----
    z = post(port, "/v1/completions", dict(body, max_tokens=0))
    if z:
        zc = z["choices"][0]
        check(zc["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]
              and zc["logprobs"]["tokens"] == lp["tokens"][:n] and zc["logprobs"]["top_logprobs"] == lp["top_logprobs"][:n]
              and zc["logprobs"]["text_offset"] == lp["text_offset"][:n],
              "max_tokens 0 + echo + logprobs: the prompt's entries alone")
        check(zc["finish_reason"] == "length" and z["usage"]["completion_tokens"] == 0
              and z["usage"]["prompt_tokens"] == n, f"max_tokens 0: finish length, no completion tokens ({z['usage']})")
        check(stream_logprobs(port, "/v1/completions", dict(body, max_tokens=0)) == zc["logprobs"]
              and stream_text(port, "/v1/completions", dict(body, max_tokens=0)) == zc["text"],
              "max_tokens 0: streamed == non-streamed")
    text = "Hello world, this is a test of prompt logprobs."
    plain = {"model": "tiny", "prompt": text, "max_tokens": 0, "echo": True}
    # ---- text_offset: where each prompt token stands in the echoed text ----
    t = post(port, "/v1/completions", dict(plain, max_tokens=2, logprobs=0, temperature=0, ignore_eos=True))
    if t:
        tl = t["choices"][0]["logprobs"]
        out = t["choices"][0]["text"]
        toks, offs = tl["tokens"], tl["text_offset"]
        np_ = len(toks) - 2
        check(out.startswith(text) and offs[0] == 0 and offs[1] == 0, "text prompt: BOS and the first token at 0")
        ok = all(offs[i] == offs[i - 1] + len(toks[i - 1].encode()) for i in range(2, np_ + 1))
        ok = ok and all(out.encode()[offs[i]:].startswith(toks[i].encode()) for i in range(1, np_ + 1))
        check(ok and offs[np_] == len(text.encode()),
              f"text prompt: text_offset points at each token in the text ({list(zip(toks, offs))})")
        check(tl["token_logprobs"][0] is None and all(isinstance(v, float) for v in tl["token_logprobs"][1:]),
              "text prompt, logprobs 0: every prompt token but BOS has a logprob")
        check(all(d is not None and len(d) == 1 for d in tl["top_logprobs"][1:]),
              "logprobs 0: top_logprobs the token alone", quiet_ok=True)
    # ---- validation ----
    for bad, param in ((dict(body, echo=False, max_tokens=0), "max_tokens"), (dict(body, logprobs=21), "logprobs"),
                       (dict(body, logprobs=-1), "logprobs")):
        st, _, data = request(port, "POST", "/v1/completions", bad, 60)
        err = json.loads(data).get("error", {}) if data.startswith(b"{") else {}
        check(st == 400 and err.get("param") == param, f"400 naming {param} ({st} {data[:160]!r})")
    time.sleep(0.35)  # heartbeats carry the counters
    moved = metric(metrics(port), "pdserve:kv_transfer_bytes_total") - metric(m0, "pdserve:kv_transfer_bytes_total")
    check(moved == 0, f"prompt logprobs: prompts of {n} tokens (over the threshold {THRESHOLD}) took the short route")
    m1 = metrics(port)
    post(port, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1, "echo": True})
    time.sleep(0.35)
    moved = metric(metrics(port), "pdserve:kv_transfer_bytes_total") - metric(m1, "pdserve:kv_transfer_bytes_total")
    check(moved > 0, "echo without logprobs: the long route as before")
    z = post(port, "/v1/completions", plain)
    if z:
        check(z["choices"][0]["text"] == text and z["choices"][0]["logprobs"] is None,
              "max_tokens 0 + echo, no logprobs: the prompt text alone")



def main():
    _, model = tiny_model()
    port = free_port_pair()
    up = start_up(model, port, *pd_stack_flags(THRESHOLD, CHUNK))
    try:
        if not check(wait_ready(port), "stack became ready"):
            finish()  # stop_up runs on the way out
        rng = random.Random(11)
        routes = {"short": ([rng.randrange(3, 120000) for _ in range(5)], "Hi"),
                  "long": ([rng.randrange(3, 120000) for _ in range(THRESHOLD + 9)],
                           "Tell me a long story about " + "many things " * 6)}
        for route, (ids, text) in routes.items():
            m0 = metrics(port)
            # ---- completions ----
            base = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            plain = post(port, "/v1/completions", base)
            body = dict(base, logprobs=K)
            resp = post(port, "/v1/completions", body)
            if plain and resp:
                check(resp["choices"][0]["text"] == plain["choices"][0]["text"],
                      f"{route} completions: logprobs do not change the greedy text")
                lp = resp["choices"][0]["logprobs"]
                check_completion_greedy(lp, f"{route} completions")
                check(stream_logprobs(port, "/v1/completions", body) == lp,
                      f"{route} completions: streamed logprobs == non-streamed")
            # ---- chat ----
            cbase = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 6,
                     "temperature": 0, "ignore_eos": True}
            cbody = dict(cbase, logprobs=True, top_logprobs=K)
            plain = post(port, "/v1/chat/completions", cbase)
            resp = post(port, "/v1/chat/completions", cbody)
            if plain and resp:
                check(resp["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"],
                      f"{route} chat: logprobs do not change the greedy text")
                lp = resp["choices"][0]["logprobs"]
                check_chat_greedy(lp, f"{route} chat")
                check(stream_logprobs(port, "/v1/chat/completions", cbody) == lp,
                      f"{route} chat: streamed logprobs == non-streamed")
            # ---- sampled: the alternatives are the raw distribution's best ----
            sbody = dict(cbase, temperature=1.0, seed=3, logprobs=True, top_logprobs=3, max_tokens=8)
            resp = post(port, "/v1/chat/completions", sbody)
            if resp:
                for j, e in enumerate(resp["choices"][0]["logprobs"]["content"]):
                    top = e["top_logprobs"]
                    w = f"{route} chat sampled token {j}"
                    check(len(top) == 3, f"{w}: 3 alternatives", quiet_ok=True)
                    check_sorted([t["logprob"] for t in top], w)
                    check(e["logprob"] <= top[0]["logprob"], f"{w}: logprob {e['logprob']} <= top-1 {top[0]}",
                          quiet_ok=True)
                    for t in top:
                        if t["bytes"] == e["bytes"]:
                            check(t["logprob"] == e["logprob"], f"{w}: listed with the same logprob", quiet_ok=True)
                print(f"ok: {route} chat sampled: alternatives sorted, the sampled token at most top-1")
                check(stream_logprobs(port, "/v1/chat/completions", sbody) == resp["choices"][0]["logprobs"],
                      f"{route} chat sampled (seeded): streamed logprobs == non-streamed")
            time.sleep(0.35)  # heartbeats carry the counters
            moved = metric(metrics(port), "pdserve:kv_transfer_bytes_total") - metric(m0, "pdserve:kv_transfer_bytes_total")
            if route == "long":
                check(moved > 0, "long route: KV moved from the prefill replica")
            else:
                check(moved == 0, "short route: no KV moved")
        check_logit_bias(port, model, routes)
        check_tokenize(port, model)
        check_prompt_logprobs(port, model, rng)
        # ---- the two replicas agree: the decode replica's alternatives for
        # the 2nd token of a 12-token prompt (short route) are the prefill
        # replica's for the 1st token of that prompt + its 1st token (13
        # tokens, long route), to the float noise of two attention paths ----
        vocab = byte_level_vocab(model)
        agreed = False
        for attempt in range(5):
            ids = [rng.randrange(3, 120000) for _ in range(THRESHOLD)]
            a = post(port, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0,
                                               "ignore_eos": True, "logprobs": K})
            t1 = vocab.get(a["choices"][0]["logprobs"]["tokens"][0]) if a else None
            if t1 is None:
                continue  # a text that does not name one token (U+FFFD, ...): another prompt
            b = post(port, "/v1/completions", {"model": "tiny", "prompt": ids + [t1], "max_tokens": 1,
                                               "temperature": 0, "ignore_eos": True, "logprobs": K})
            if not b:
                break
            dec = list(a["choices"][0]["logprobs"]["top_logprobs"][1].items())
            pre = list(b["choices"][0]["logprobs"]["top_logprobs"][0].items())
            check(len(dec) == len(pre), f"replicas agree: as many alternatives ({len(dec)}, {len(pre)})")
            close = all(abs(x[1] - y[1]) < 2e-3 for x, y in zip(dec, pre))
            check(close, f"replicas agree: logprobs within 2e-3 (decode {dec}, prefill {pre})")
            # the same tokens, where no near-tie could swap two of them
            gaps = [j for j in range(len(dec)) if all(abs(dec[j][1] - dec[i][1]) > 2e-3 for i in range(len(dec)) if i != j)]
            check(all(dec[j][0] == pre[j][0] for j in gaps), f"replicas agree: the same tokens ({dec}, {pre})")
            agreed = True
            break
        check(agreed, "replicas agree: a prompt whose 1st token maps back to its id")
    finally:
        stop_up(up, sanitizer=True)
    finish()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A hostile user of the long route with a KV staging pool (model/kv_staging.c)
and a short --queue-timeout, real processes on 127.0.0.1, the tiny model: a
gateway (--queue-timeout 1), one prefill replica slowed to 100 ms a chunk
step, one decode replica whose staging pool holds 10 blocks (40 tokens), so
long prompts of 9 blocks go one at a time and a burst cannot drain within
the timeout. Checks:
- a burst of 12 such prompts, streamed and not, n 1 and 2: every answer
  comes within the timeout and a margin (no hang), and is either 200 with
  the text the prompt gets alone (greedy) or the queue timeout: 503 with an
  OpenAI error body naming --queue-timeout and Retry-After when not
  streamed; when streamed (the response began at submission) an in-band
  error event with code 503, then [DONE]; some are each;
- afterwards nothing is held: all staging slots and cache blocks free (the
  gateway's gauges), no request running or waiting;
- n = 2 choices of a long prompt, streamed and not: every choice is the
  prompt's greedy text;
- a prompt of more blocks than the pool holds: 400 naming
  --kv-staging-blocks, streamed or not, n 1 or 2.
"""
import http.client, json, os, random, subprocess, threading, time

from pdtest import BIN, check, failures, finish, free_port_pair, metric, metrics, parse_sse, stop_procs, tiny_model

HB = 100  # heartbeat interval, ms
BLOCK = 4
SLOTS = 10
THRESHOLD = 12
QUEUE_TIMEOUT = 1


def main():
    tmp, model = tiny_model()
    port = free_port_pair()
    ctrl = f"tcp://127.0.0.1:{port + 1}"
    procs, logs = [], {}

    def start(role, args):
        logs[role] = os.path.join(tmp, f"{role}.log")
        procs.append(subprocess.Popen([BIN] + args, stdout=open(logs[role], "w"), stderr=subprocess.STDOUT))

    start("gateway", ["gateway", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--control", ctrl,
                      "--served-model-name", "tiny", "--long-prompt-threshold", str(THRESHOLD),
                      "--heartbeat-interval-ms", str(HB), "--queue-timeout", str(QUEUE_TIMEOUT)])
    for role, slots, delay in (("prefill", 2, 100), ("decode", SLOTS, 0)):
        start(role, [role, "--model", model, "--gateway", ctrl, "--replica-id", role, "--block-size", str(BLOCK),
                     "--num-kv-blocks", "256", "--chunked-prefill-size", "8", "--threads", "1",
                     "--heartbeat-interval-ms", str(HB), "--debug-step-delay-ms", str(delay),
                     "--debug-force-kv-staging", "--kv-staging-blocks", str(slots)])

    def post(ids, stream=False, n=1, timeout=60):
        """(status, headers with lower-case names, body bytes) of an 8-token greedy completion."""
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 8,
                                                          "ignore_eos": True, "temperature": 0, "n": n,
                                                          "stream": stream}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        out = (r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        c.close()
        return out

    def texts(body, stream, n):
        """The n choices' texts of a 200 answer, by index."""
        out = [""] * n
        if stream:
            for ev in parse_sse(body).events:
                for ch in ev.get("choices", []):
                    out[ch["index"]] += ch.get("text") or ""
        else:
            for ch in json.loads(body)["choices"]:
                out[ch["index"]] = ch["text"]
        return out

    try:
        deadline, ready = time.time() + 60, False
        while time.time() < deadline and not ready:
            try:
                m = metrics(port)
                ready = all(metric(m, "pdserve:replicas_alive", role=r) >= 1 for r in ("prefill", "decode"))
            except OSError:
                pass
            time.sleep(0.1)
        if not check(ready, "stack ready"):
            return
        time.sleep(3 * HB / 1000)
        base_blocks = metric(metrics(port), "pdserve:kv_cache_free_blocks")
        rng = random.Random(17)
        prompts = [[rng.randrange(3, 120000) for _ in range(36)] for _ in range(12)]
        refs = []
        for p in prompts:  # alone: each well within the queue timeout
            st, _, body = post(p)
            check(st == 200, f"alone: status {st} {body[:200]!r}", quiet_ok=True)
            refs.append(texts(body, False, 1)[0] if st == 200 else None)
        # ---- the burst ----
        results = [None] * len(prompts)

        def run(i):
            stream, n = i % 2 == 1, 1 + (i % 3 == 0)
            t0 = time.time()
            try:
                results[i] = (stream, n) + post(prompts[i], stream, n) + (time.time() - t0,)
            except Exception as e:  # noqa: BLE001 - recorded as a failure below
                results[i] = (stream, n, 0, {}, repr(e).encode(), time.time() - t0)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        served = timed_out = 0
        for i, (stream, n, st, hdr, body, took) in enumerate(results):
            what = f"burst {i} ({'stream' if stream else 'json'}, n {n})"
            check(took < QUEUE_TIMEOUT + 10, f"{what}: answered in {took:.1f} s", quiet_ok=True)
            if st == 503 and not stream:
                err = json.loads(body).get("error", {})
                ra = hdr.get("retry-after", "")
                check("--queue-timeout" in err.get("message", "") and err.get("code") == 503 and ra.isdigit()
                      and int(ra) >= 1, f"{what}: 503 {err} Retry-After {ra!r}")
                timed_out += 1
            elif st == 200 and stream and b'"error"' in body:
                sse = parse_sse(body, what)
                err = [e["error"] for e in sse.events if "error" in e]
                check(len(err) == 1 and err[0].get("code") == 503 and "--queue-timeout" in err[0].get("message", "")
                      and sse.done, f"{what}: in-band queue timeout {err}")
                timed_out += 1
            elif check(st == 200, f"{what}: status {st} {body[:300]!r}"):
                got = texts(body, stream, n)
                check(got == [refs[i]] * n, f"{what}: {got!r} == alone {refs[i]!r}")
                served += 1
        print(f"burst: {served} served, {timed_out} timed out in the queue")
        check(served >= 1 and timed_out >= 1, "the burst had answers of both kinds")
        # ---- nothing held afterwards ----
        time.sleep(1 + 3 * HB / 1000)
        m = metrics(port)
        check(metric(m, "pdserve:kv_staging_free_slots") == SLOTS,
              f"all {SLOTS} staging slots free ({metric(m, 'pdserve:kv_staging_free_slots')})")
        check(metric(m, "pdserve:kv_cache_free_blocks") == base_blocks,
              f"all cache blocks free ({metric(m, 'pdserve:kv_cache_free_blocks')} of {base_blocks})")
        check(metric(m, "pdserve:num_requests_waiting_class") == 0 and
              metric(m, "pdserve:num_requests_running_class") == 0, "no request waiting or running")
        # ---- n = 2 on the long route ----
        for stream in (False, True):
            st, _, body = post(prompts[0], stream, 2, timeout=30)
            got = texts(body, stream, 2) if st == 200 else body[:200]
            check(st == 200 and got == [refs[0]] * 2, f"n 2 {'stream' if stream else 'json'}: {st} {got!r}")
        # ---- never fits: 400 naming the limit ----
        big = [rng.randrange(3, 120000) for _ in range(SLOTS * BLOCK + 1)]
        for stream in (False, True):
            for n in (1, 2):
                st, _, body = post(big, stream, n, timeout=30)
                msg = json.loads(body).get("error", {}).get("message", "") if st == 400 else body[:200]
                check(st == 400 and "--kv-staging-blocks" in msg and f"staging pool holds {SLOTS}" in msg,
                      f"{SLOTS + 1} blocks, {'stream' if stream else 'json'}, n {n}: {st} {msg!r}")
    finally:
        stop_procs(procs)
        text = "".join(open(p, errors="replace").read() for p in logs.values())
        check("Sanitizer" not in text and "runtime error" not in text and "assertion failed" not in text,
              "no sanitizer report or failed assertion in the logs")
        if failures:
            for role, p in logs.items():
                print(f"---- {role} ----\n" + open(p, errors="replace").read()[-3000:])


if __name__ == "__main__":
    main()
    finish()

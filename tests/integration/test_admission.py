#!/usr/bin/env python3
"""Admission control and fairness at the gateway (issue 4), real processes
on 127.0.0.1 with the tiny model:
- no replica of the needed role -> 503 with Retry-After and an OpenAI error body;
- a full class queue -> 429 with Retry-After, naming the limit;
- --request-timeout: a queued request past its deadline fails with a clear error;
- fairness: 16 long + 16 short prompts arriving together; the short
  requests are not queued behind the long ones: their TTFT p95 stays under
  half the long requests' median TTFT in the same burst (a server that
  made short prompts wait for long prefills would give them the long
  ones' TTFT). Compared within one burst, so a slow or busy machine slows
  both sides alike; the ratio to the short burst alone is printed for
  docs/benchmarks.md, not asserted (speed belongs in benchmarks)."""
import http.client, json, os, subprocess, sys, threading, time

from pdtest import BIN, check, failures, finish, free_port_pair, request, tiny_model


def post(port, body, timeout=60):
    return request(port, "POST", "/v1/completions", body, timeout)


def ttft_stream(port, prompt, max_tokens, out, i):
    t0 = time.time()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                     "ignore_eos": True, "stream": True, "temperature": 0}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    first = None
    while True:
        line = r.fp.readline()
        if not line:
            break
        if line.startswith(b"data: ") and first is None and b'"text":""' not in line and b"[DONE]" not in line:
            first = time.time() - t0
        if line.startswith(b"data: [DONE]"):
            break
    c.close()
    out[i] = first


def p95(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))] if xs else float("inf")


class Stack:
    def __init__(self, tmp, model, gw_args, replicas):
        self.port = free_port_pair()
        self.ctrl = f"tcp://127.0.0.1:{self.port + 1}"
        self.procs = []
        log = open(os.path.join(tmp, f"stack-{self.port}.log"), "w")
        self.procs.append(subprocess.Popen([BIN, "gateway", "--model", model, "--host", "127.0.0.1", "--port",
                                            str(self.port), "--control", self.ctrl, "--served-model-name", "tiny",
                                            "--heartbeat-interval-ms", "200"] + gw_args, stdout=log, stderr=log))
        for role, i, extra in replicas:
            self.procs.append(subprocess.Popen([BIN, role, "--model", model, "--gateway", self.ctrl, "--replica-id",
                                                f"{role}-{i}", "--threads", "1", "--block-size", "16"] + extra,
                                               stdout=log, stderr=log))

    def wait(self, decode, prefill):
        t0 = time.time()
        while time.time() - t0 < 30:
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/metrics")
                m = c.getresponse().read().decode()
                if (f'replicas_alive{{role="decode"}} {decode}' in m and
                        f'replicas_alive{{role="prefill"}} {prefill}' in m):
                    return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def main():
    tmp, model = tiny_model()
    # ---- no replica -> 503 ----
    st = Stack(tmp, model, [], [])
    try:
        t0 = time.time()  # the gateway alone answers /health 503 (not ready) once it listens
        while time.time() - t0 < 60:
            try:
                request(st.port, "GET", "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        code, hdr, data = post(st.port, {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        body = json.loads(data)
        check(code == 503 and "Retry-After" in hdr and body["error"]["code"] == 503,
              f"no replica: {code} {hdr.get('Retry-After')} {body}")
    finally:
        st.stop()
    # ---- queue full -> 429; queued deadline ----
    st = Stack(tmp, model, ["--max-concurrent-requests-short", "1", "--max-queued-requests-short", "1",
                            "--request-timeout", "1.5"],
               [("decode", 0, ["--debug-step-delay-ms", "50"])])
    try:
        check(st.wait(1, 0), "stack up")
        res = [None] * 3
        def go(i):
            res[i] = post(st.port, {"model": "tiny", "prompt": "hello", "max_tokens": 40, "ignore_eos": True})
        th = [threading.Thread(target=go, args=(i,)) for i in range(3)]
        for t in th:
            t.start()
            time.sleep(0.1)
        for t in th: t.join(60)
        codes = sorted(r[0] for r in res)
        check(429 in codes, f"queue full gives 429 ({codes})")
        r429 = [r for r in res if r[0] == 429]
        if r429:
            b = json.loads(r429[0][2])
            check("Retry-After" in r429[0][1] and "max-queued-requests-short" in b["error"]["message"],
                  f"429 names the limit and has Retry-After: {r429[0][1].get('Retry-After')} {b}")
        # 40 tokens at >= 50 ms per step: the first runs ~2 s, so the queued one passes its 1.5 s deadline
        check(any(r[0] in (503, 504) and b"request-timeout" in r[2] for r in res),
              f"deadline: a request failed naming --request-timeout ({[(r[0], r[2][:120]) for r in res]})")
    finally:
        st.stop()
    # ---- fairness ----
    st = Stack(tmp, model, ["--long-prompt-threshold", "64"],
               [("decode", 0, []), ("prefill", 0, ["--chunked-prefill-size", "64"])])
    try:
        check(st.wait(1, 1), "stack up (fairness)")
        short = [[5 + i] * 16 for i in range(16)]
        long = [[7 + i] * 700 for i in range(16)]
        # warm-up
        ttft_stream(st.port, short[0], 4, [None], 0)
        # up to 3 trials, each measuring the short burst alone (twice, mean
        # p95, for the printed ratio) and then with the long burst; the
        # property must hold in one of them. A server that starves short
        # requests fails all three.
        ratios, rel = [], []
        for trial in range(3):
            base95 = []
            for rep in range(2):
                base = [None] * 16
                th = [threading.Thread(target=ttft_stream, args=(st.port, short[i], 16, base, i)) for i in range(16)]
                for t in th: t.start()
                for t in th: t.join(120)
                base95.append(p95(base))
            loaded = [None] * 32
            th = [threading.Thread(target=ttft_stream, args=(st.port, long[i], 16, loaded, 16 + i)) for i in range(16)]
            th += [threading.Thread(target=ttft_stream, args=(st.port, short[i], 16, loaded, i)) for i in range(16)]
            for t in th: t.start()
            for t in th: t.join(180)
            check(all(x is not None for x in loaded), "every request of the burst got a first token")
            if not all(x is not None for x in loaded):
                break
            b95, l95, long95 = sum(base95) / 2, p95(loaded[:16]), p95(loaded[16:])
            long50 = sorted(loaded[16:])[8]
            ratios.append(l95 / b95)
            rel.append(l95 / long50)
            print(f"fairness trial {trial}: short TTFT p95 alone {b95 * 1000:.1f} ms, with 16 long {l95 * 1000:.1f} ms "
                  f"(ratio {l95 / b95:.2f}); long TTFT p50 {long50 * 1000:.1f} ms, p95 {long95 * 1000:.1f} ms "
                  f"(short p95 / long p50 {l95 / long50:.2f})", flush=True)
            if l95 < 0.5 * long50:
                break
        if os.environ.get("PD_SANITIZED") == "1" and rel:
            # sanitizer builds run 2-10x slower and unevenly: report, do not judge timing there
            print(f"(sanitized build: short p95 / long p50 {[round(r, 2) for r in rel]} reported, not asserted)")
        else:
            check(bool(rel) and min(rel) < 0.5,
                  f"short TTFT p95 under half the long requests' median TTFT in the same burst "
                  f"(short p95 / long p50 per trial: {[round(r, 2) for r in rel]})")
    finally:
        st.stop()
    finish()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A failure a replica reports reaches the client with the status it asked
for (Tokens.error_status): a transient one, here a KV transfer that fails
(the prefill replica's --debug-fail-kv-transfer), is a 503 with Retry-After
and an OpenAI error body naming the replica (streamed: an in-band error
event with code 503, then [DONE]), and leaves the stack serving (the
decode replica's reservation is handed back: more long requests than its
cache could hold at once still get their 503, and short requests their
text). A prefill replica stopped (SIGTERM) with KV transfers in flight
exits 0 and every request gets an answer. Real processes on 127.0.0.1 with the tiny model."""
import json, os, subprocess, threading, time

from pdtest import BIN, check, finish, free_port_pair, metric, metrics, request, stop_procs, tiny_model, wait_ready


def main():
    tmp, model = tiny_model()
    port = free_port_pair()
    ctrl = f"tcp://127.0.0.1:{port + 1}"
    log = open(os.path.join(tmp, "stack.log"), "w")
    procs = [subprocess.Popen([BIN, "gateway", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                               "--control", ctrl, "--served-model-name", "tiny", "--long-prompt-threshold", "16",
                               "--heartbeat-interval-ms", "100"], stdout=log, stderr=log)]
    # --shutdown-timeout 0: SIGTERM stops at once (the abrupt stop this test is
    # about; test_shutdown.py covers the drain)
    common = ["--model", model, "--gateway", ctrl, "--threads", "1", "--block-size", "4", "--heartbeat-interval-ms",
              "100", "--shutdown-timeout", "0"]
    procs.append(subprocess.Popen([BIN, "decode", *common, "--replica-id", "decode-0", "--num-kv-blocks", "64"],
                                  stdout=log, stderr=log))
    procs.append(subprocess.Popen([BIN, "prefill", *common, "--replica-id", "prefill-0", "--num-kv-blocks", "256",
                                   "--debug-fail-kv-transfer"], stdout=log, stderr=log))
    try:
        if not check(wait_ready(port, roles=("prefill", "decode")), "stack up"):
            return
        long_prompt = list(range(100, 140))  # 40 tokens > threshold 16: the long route; 10 of the decode's 64 blocks
        # more long requests than the decode replica's cache holds at once: each reservation must come back
        for i in range(8):
            st, h, body = request(port, "POST", "/v1/completions",
                                  {"model": "tiny", "prompt": long_prompt, "max_tokens": 4}, timeout=30)
            err = json.loads(body).get("error", {}) if body.startswith(b"{") else {}
            ok = check(st == 503, f"long request {i}: 503 (got {st} {body[:160]!r})", quiet_ok=i > 0)
            if i == 0 and ok:
                check(h.get("Retry-After") == "1", f"503 says Retry-After: 1 ({h.get('Retry-After')})")
                check(err.get("code") == 503 and err.get("type") and "prefill-0" in err.get("message", "") and
                      "KV transfer" in err.get("message", ""), f"OpenAI error body naming the replica: {err}")
        # streamed: the 200 and its headers have gone out, so the failure is an
        # in-band error event with the same code, then [DONE]
        st, h, body = request(port, "POST", "/v1/completions",
                              {"model": "tiny", "prompt": long_prompt, "max_tokens": 4, "stream": True}, timeout=30)
        events = [l[6:] for l in body.decode(errors="replace").splitlines() if l.startswith("data: ")]
        errs = [json.loads(e)["error"] for e in events if e.startswith("{") and "error" in json.loads(e)]
        check(st == 200 and events[-1:] == ["[DONE]"] and len(errs) == 1 and errs[0].get("code") == 503 and
              "KV transfer" in errs[0].get("message", ""), f"streamed long request: an error event with code 503, "
              f"then [DONE] ({st}, {events[-3:]})")
        # the stack still serves short prompts with text
        st, _, body = request(port, "POST", "/v1/completions",
                              {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True},
                              timeout=30)
        text = json.loads(body)["choices"][0]["text"] if st == 200 else ""
        usage = json.loads(body).get("usage", {}) if st == 200 else {}
        check(st == 200 and usage.get("completion_tokens") == 4, f"short request after the failures: 200, 4 tokens "
              f"({st}, {usage}, {text!r})")
        # and the decode replica holds no reservation: its whole cache is free again
        deadline, free_blocks = time.time() + 10, -1
        while time.time() < deadline and free_blocks != 64:
            free_blocks = metric(metrics(port), "pdserve:kv_cache_free_blocks", replica="decode-0")
            time.sleep(0.2)
        check(free_blocks == 64, f"the decode replica's 64 KV blocks are free again ({free_blocks})")
        # a prefill replica stopped (SIGTERM) while its KV transfers are in
        # flight exits cleanly: its outstanding puts and flushes get their
        # callbacks before its jobs go (it crashed in on_flushed before), and
        # every request still gets an answer
        procs[2].terminate()
        procs[2].wait(15)
        procs[1].terminate()  # a decode replica with room for many long prompts
        procs[1].wait(15)
        procs.append(subprocess.Popen([BIN, "decode", *common, "--replica-id", "decode-1", "--num-kv-blocks", "20000"],
                                      stdout=log, stderr=log))

        def alive(role, n, timeout=15):
            """True once the gateway counts n live replicas of role (the stopped ones out of rotation)."""
            deadline = time.time() + timeout
            while time.time() < deadline:
                if metric(metrics(port), "pdserve:replicas_alive", role=role) == n:
                    return True
                time.sleep(0.1)
            return False

        check(alive("prefill", 0) and alive("decode", 1), "the stopped replicas out of rotation, decode-1 in")
        for rep in range(3):
            pf = subprocess.Popen([BIN, "prefill", *common, "--replica-id", "prefill-0", "--num-kv-blocks", "8000"],
                                  stdout=log, stderr=log)
            procs.append(pf)
            if not check(alive("prefill", 1), f"healthy prefill replica up ({rep})"):
                break
            out = [None] * 16

            def one(i):
                prompt = [(x * 7 + i) % 5000 + 10 for x in range(1000)]
                try:
                    out[i] = request(port, "POST", "/v1/completions",
                                     {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True},
                                     timeout=60)[0]
                except OSError as e:
                    out[i] = repr(e)

            th = [threading.Thread(target=one, args=(i,)) for i in range(16)]
            for t in th:
                t.start()
            time.sleep(0.4 + 0.2 * rep)
            pf.terminate()
            try:
                rc = pf.wait(20)
            except subprocess.TimeoutExpired:
                rc = "hung"
            for t in th:
                t.join(60)
            check(rc == 0, f"prefill replica stopped mid-transfer exits 0 ({rc}), round {rep}")
            check(all(x in (200, 503) for x in out), f"every request answered 200 or 503: {out}")
            check(alive("prefill", 0), f"the stopped prefill replica out of rotation ({rep})")
    finally:
        stop_procs(procs)
        log.close()
    finish()


if __name__ == "__main__":
    main()

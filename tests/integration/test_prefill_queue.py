#!/usr/bin/env python3
"""Long prompts queued behind a slow prefill wait, they do not fail (the
long route's dispatch rule, docs/architecture.md), real processes on
127.0.0.1 with the tiny model:
- the decode replica's --kv-reservation-ttl is 3 s, so a prefill's lease is
  2.25 s from when the prefill replica receives the job;
- the prefill replica sleeps 150 ms a step of 16 tokens: a 64-token prompt
  takes ~0.6 s, and eight of them sent at once take ~4.8 s, twice a lease;
- every one must succeed, with the text the same prompt gets alone
  (greedy, so the reference is the unloaded run), and while the burst runs
  the gateway shows the ones beyond --max-prefill-jobs-per-replica (2) as
  waiting in its long queue.
Before the rule, the gateway sent all eight Prefills at once and the later
ones failed with "the KV reservation's lease ran out before the prefill
finished"."""
import json, os, subprocess, threading, time

from pdtest import BIN, check, finish, free_port_pair, metric, metrics, request, tiny_model

N = 8
PROMPT_LEN = 64
STEP_DELAY_MS = 150


def complete(port, prompt, out, i):
    try:
        out[i] = request(port, "POST", "/v1/completions",
                         {"model": "tiny", "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
                          "temperature": 0}, timeout=60)
    except OSError as e:
        out[i] = (0, {}, str(e).encode())


def text_of(res):
    code, _, data = res
    if code != 200:
        return None
    return json.loads(data)["choices"][0]["text"]


def main():
    tmp, model = tiny_model()
    # the flag is validated
    port = free_port_pair()
    rc = subprocess.run([BIN, "gateway", "--model", model, "--port", str(port), "--control",
                         f"tcp://127.0.0.1:{port + 1}", "--max-prefill-jobs-per-replica", "0"],
                        capture_output=True, timeout=30)
    check(rc.returncode == 2 and b"max-prefill-jobs-per-replica) must be >= 1" in rc.stderr,
          f"--max-prefill-jobs-per-replica 0 refused ({rc.returncode}, {rc.stderr[-200:]!r})")

    port = free_port_pair()
    ctrl = f"tcp://127.0.0.1:{port + 1}"
    log = open(os.path.join(tmp, "stack.log"), "w")
    common = ["--model", model, "--gateway", ctrl, "--threads", "1", "--block-size", "16",
              "--heartbeat-interval-ms", "200"]
    procs = [subprocess.Popen([BIN, "gateway", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                               "--control", ctrl, "--served-model-name", "tiny", "--long-prompt-threshold", "16",
                               "--heartbeat-interval-ms", "200"], stdout=log, stderr=log),
             subprocess.Popen([BIN, "decode", "--replica-id", "decode-0", "--kv-reservation-ttl", "3"] + common,
                              stdout=log, stderr=log),
             subprocess.Popen([BIN, "prefill", "--replica-id", "prefill-0", "--chunked-prefill-size", "16",
                               "--debug-step-delay-ms", str(STEP_DELAY_MS)] + common, stdout=log, stderr=log)]
    try:
        up = False
        t0 = time.time()
        while time.time() - t0 < 30 and not up:
            try:
                m = metrics(port)
                up = (m.get('pdserve:replicas_alive{role="decode"}') == 1 and
                      m.get('pdserve:replicas_alive{role="prefill"}') == 1)
            except OSError:
                pass
            time.sleep(0.1)
        check(up, "stack up")
        prompts = [[11 + i] * PROMPT_LEN for i in range(N)]
        res = [None] * N
        th = [threading.Thread(target=complete, args=(port, prompts[i], res, i)) for i in range(N)]
        t0 = time.time()
        for t in th:
            t.start()
        waiting = 0
        while any(t.is_alive() for t in th) and time.time() - t0 < 1.5:
            time.sleep(0.1)
            try:
                waiting = max(waiting, metrics(port).get(
                    'pdserve:num_requests_waiting_class{model_name="tiny",class="long"}', 0))
            except OSError:
                pass
        for t in th:
            t.join(90)
        burst_s = time.time() - t0
        codes = [r[0] for r in res]
        print(f"{N} long prompts of {PROMPT_LEN} tokens at once: {burst_s:.2f} s, codes {codes}", flush=True)
        for i, r in enumerate(res):
            check(r[0] == 200, f"burst request {i}: {r[0]}" + ("" if r[0] == 200 else f" {r[2][:200]!r}"))
        check(waiting >= N - 2 - 1,
              f"the long queue showed the requests beyond the prefill replica's 2 jobs as waiting (max {waiting})")
        # the reference: each prompt alone (greedy, deterministic)
        for i in range(N):
            ref = [None]
            complete(port, prompts[i], ref, 0)
            a, b = text_of(res[i]), text_of(ref[0])
            check(b is not None and a == b and len(b) > 0,
                  f"prompt {i}: the burst's text equals the text alone ({a!r} vs {b!r})")
        m = metrics(port)
        check(metric(m, "pdserve:request_failure_total") == 0, "no request failed after admission")
        check(m.get('pdserve:num_requests_waiting_class{model_name="tiny",class="long"}', -1) == 0 and
              m.get('pdserve:num_requests_running_class{model_name="tiny",class="long"}', -1) == 0,
              "the long class is empty afterwards")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    finish()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Graceful shutdown of `pdserve up` (the gateway's --shutdown-timeout),
real processes on 127.0.0.1 with the tiny model, every replica step slowed
to 20 ms so that requests are still running when the signal comes:
- SIGINT to up (Ctrl-C): a streamed short request and a non-streamed long
  one (through the prefill replica) that were running finish whole (every
  token, finish_reason "length", [DONE]); meanwhile /health and a new
  completion on a connection opened before the signal get 503 "the server
  is shutting down", and a new connection is refused; then up stops the
  replicas and exits 0, every child having exited 0.
- With --shutdown-timeout 1, a request that needs longer ends after about
  a second, its stream with an in-band 503 "the server shut down before
  the request finished" and [DONE], and up exits soon after.
- A second SIGINT stops the drain at once.
Before, Ctrl-C stopped the replicas first: every running request was cut
(a walkthrough saw a 500-token stream end with no error and no [DONE]).

A replica drains too (each service started on its own, as docker compose
runs them, whose `down` stops the replicas before the gateway):
- SIGTERM to the decode and the prefill replica while a streamed short
  request and a long one run, and another long one is in its prefill: all
  three finish whole (the last one's first token comes after the signal);
  within a second /health is 503 and a new request gets a 503 at once (no
  replica takes new work); each replica then logs "drained" and exits 0.
- A second SIGTERM stops a draining replica at once.
- --shutdown-timeout must be in [0, 1e6] (exit 2)."""
import http.client, json, os, signal, subprocess, threading, time

from pdtest import (BIN, check, failures, finish, free_port_pair, metric, metrics, pd_stack_flags, request, start_up,
                    temp_dir, tiny_model, wait_ready)

STEP_MS = 20


def stack(model, timeout):
    port = free_port_pair()
    up = start_up(model, port, *pd_stack_flags(8, 64), "--debug-step-delay-ms", STEP_MS,
                  "--shutdown-timeout", timeout, log_name=f"up-{port}.log")
    check(wait_ready(port, roles=("prefill", "decode")), f"stack on {port} ready")
    return port, up


def stream_until_end(port, body, out):
    """POSTs a streamed completion; out gets 'started' (set after the first
    event), then the events, whether [DONE] came, and how it ended."""
    out.update(events=[], done=False, error=None)
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request("POST", "/v1/completions",
                  json.dumps(dict(body, stream=True, stream_options={"include_usage": True})),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        out["status"] = r.status
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                out["done"] = True
                continue
            out["events"].append(json.loads(line[6:]))
            out.setdefault("t_first", time.time())
            out["started"].set()
        c.close()
    except (OSError, http.client.HTTPException) as e:
        out["error"] = repr(e)
    out["started"].set()


def post_whole(port, body, out):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        out["status"], out["body"] = r.status, r.read()
        c.close()
    except (OSError, http.client.HTTPException) as e:
        out["status"], out["body"] = 0, repr(e).encode()


def streamed_tokens(out):
    """completion_tokens of the stream's usage chunk (sent last), else the
    events that carry text (a cut stream has no usage)."""
    for ev in out["events"]:
        if ev.get("usage"):
            return ev["usage"]["completion_tokens"]
    return sum(1 for ev in out["events"] if ev.get("choices") and ev["choices"][0].get("text"))


def wait_exit(up, limit):
    t0 = time.time()
    try:
        rc = up.wait(limit)
    except Exception:  # noqa: BLE001 (subprocess.TimeoutExpired)
        os.killpg(up.pid, signal.SIGKILL)
        rc = up.wait()
        rc = ("killed", rc)
    up.log.close()
    return rc, time.time() - t0, open(up.log_path, errors="replace").read()


LONG_PROMPT = " ".join(["one two three four five six seven eight nine ten"] * 4)  # over either threshold


def start_pair(port, n_short, n_long):
    """Starts a streamed short request of n_short tokens and a whole long
    one (through the prefill replica) of n_long; returns once the stream's
    first event came."""
    short = {"model": "tiny", "prompt": "Hi", "max_tokens": n_short, "ignore_eos": True, "temperature": 0}
    long_ = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": n_long, "ignore_eos": True, "temperature": 0}
    pair = {"s": {"started": threading.Event()}, "l": {}, "n_short": n_short, "n_long": n_long}
    pair["ts"] = threading.Thread(target=stream_until_end, args=(port, short, pair["s"]))
    pair["tl"] = threading.Thread(target=post_whole, args=(port, long_, pair["l"]))
    pair["ts"].start()
    pair["tl"].start()
    check(pair["s"]["started"].wait(30), "the streamed request started")
    return pair


def check_pair_whole(pair):
    """Both requests of start_pair ended whole: every token, "length", [DONE]."""
    pair["ts"].join(60)
    pair["tl"].join(60)
    s_out, l_out, n_short, n_long = pair["s"], pair["l"], pair["n_short"], pair["n_long"]
    fin = [ev["choices"][0].get("finish_reason") for ev in s_out["events"] if ev.get("choices")]
    check(s_out.get("status") == 200 and s_out["done"] and "length" in fin and streamed_tokens(s_out) == n_short,
          f"the running stream finished whole: {streamed_tokens(s_out)} of {n_short} tokens, [DONE] "
          f"{s_out['done']}, finish {fin[-1:]} (error {s_out['error']})")
    lj = json.loads(l_out["body"]) if l_out.get("status") == 200 else {}
    check(lj.get("usage", {}).get("completion_tokens") == n_long and lj["choices"][0]["finish_reason"] == "length",
          f"the running long-route request finished whole ({l_out.get('status')} {l_out.get('body', b'')[:160]!r})")


def drain_case(model):
    port, up = stack(model, 20)
    pair = start_pair(port, 120, 60)
    ts = pair["ts"]
    keep = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # opened before the signal
    keep.request("GET", "/health")
    r = keep.getresponse()
    r.read()
    check(r.status == 200, f"/health 200 before the signal ({r.status})")
    os.kill(up.pid, signal.SIGINT)
    time.sleep(0.5)
    check(ts.is_alive(), "the stream still runs 0.5 s after the signal (the case tests a drain)")
    keep.request("GET", "/health")
    r = keep.getresponse()
    body = r.read()
    check(r.status == 503 and b"shutting down" in body, f"/health while draining: 503 ({r.status} {body[:120]!r})")
    keep.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2}),
                 {"Content-Type": "application/json"})
    r = keep.getresponse()
    body = r.read()
    check(r.status == 503 and b"shutting down" in body and b'"error"' in body,
          f"a new completion while draining: 503 with an OpenAI error ({r.status} {body[:160]!r})")
    keep.close()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/health")
        st = c.getresponse().status
        check(False, f"a new connection while draining is refused (got {st})")
    except OSError:
        check(True, "a new connection while draining is refused")
    check_pair_whole(pair)
    rc, took, log = wait_exit(up, 40)
    check(rc == 0, f"up exits 0 after the drain ({rc}, {took:.1f} s)")
    check("every request finished" in log, "the gateway says every request finished")
    for name in ("gateway", "prefill-0", "decode-0"):
        check(any(f"pdserve up: {name} (pid" in ln and "exited with status 0" in ln for ln in log.splitlines()),
              f"{name} exited with status 0")
    if failures:
        print(log[-4000:])


def long_stream(port, what):
    """Starts a 900-token stream (~18 s at 20 ms a step) in a thread; returns
    (thread, out) once its first event came."""
    out = {"started": threading.Event()}
    t = threading.Thread(target=stream_until_end,
                         args=(port, {"model": "tiny", "prompt": "Hi", "max_tokens": 900, "ignore_eos": True}, out))
    t.start()
    check(out["started"].wait(30) and out.get("status") == 200 and out["events"],
          f"{what}: the stream started ({out.get('status')}, {out.get('error')})")
    return t, out


def timeout_case(model):
    port, up = stack(model, 1)
    t, out = long_stream(port, "timeout case")
    t0 = time.time()
    os.kill(up.pid, signal.SIGINT)
    t.join(30)
    cut = time.time() - t0
    errs = [ev["error"] for ev in out["events"] if ev.get("error")]
    check(streamed_tokens(out) < 900 and 0.5 < cut < 10 and out["done"] and len(errs) == 1 and
          errs[0].get("code") == 503 and "shut down" in errs[0].get("message", ""),
          f"--shutdown-timeout 1: after ~1 s the long stream ends with an in-band 503 and [DONE] ({cut:.1f} s, "
          f"{streamed_tokens(out)} tokens, errors {errs}, [DONE] {out['done']})")
    rc, took, log = wait_exit(up, 30)
    check(rc == 0 and took < 15, f"up exits 0 soon after ({rc}, {took:.1f} s after the cut)")
    check("still running after the drain timeout" in log, "the gateway says it aborted what still ran")


def second_signal_case(model):
    port, up = stack(model, 60)
    t, out = long_stream(port, "second-signal case")
    os.kill(up.pid, signal.SIGINT)
    time.sleep(0.5)
    t0 = time.time()
    os.kill(up.pid, signal.SIGINT)
    t.join(30)
    rc, took, _ = wait_exit(up, 30)
    check(not out["done"] and time.time() - t0 < 15 and rc == 0,
          f"a second SIGINT stops the drain at once (rc {rc}, {time.time() - t0:.1f} s, [DONE] {out['done']})")


class Services:
    """gateway, prefill-0 and decode-0 as separate processes (heartbeats
    every 100 ms, every replica step 20 ms)."""

    def __init__(self, model):
        self.tmp = temp_dir()
        self.port = free_port_pair()
        ctrl = f"tcp://127.0.0.1:{self.port + 1}"
        self.procs, self.logs = {}, {}
        self.start("gateway", ["gateway", "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
                               "--control", ctrl, "--served-model-name", "tiny", "--long-prompt-threshold", "16",
                               "--heartbeat-interval-ms", "100"])
        for role in ("prefill", "decode"):
            self.start(f"{role}-0", [role, "--model", model, "--gateway", ctrl, "--replica-id", f"{role}-0",
                                     "--threads", "1", "--block-size", "4", "--num-kv-blocks", "1024",
                                     "--heartbeat-interval-ms", "100", "--debug-step-delay-ms", str(STEP_MS),
                                     *(["--chunked-prefill-size", "4"] if role == "prefill" else [])])

    def start(self, name, args):
        self.logs[name] = os.path.join(self.tmp, name + ".log")
        self.procs[name] = subprocess.Popen([BIN] + args, stdout=open(self.logs[name], "w"), stderr=subprocess.STDOUT)

    def wait(self, name, limit):
        try:
            return self.procs[name].wait(limit)
        except subprocess.TimeoutExpired:
            return "still running"

    def log(self, name):
        return open(self.logs[name], errors="replace").read()

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def replica_drain_case(model):
    sv = Services(model)
    try:
        port = sv.port
        check(wait_ready(port, roles=("prefill", "decode")), "services ready")
        pair = start_pair(port, 100, 50)
        ts = pair["ts"]
        # a long stream whose prefill (80 tokens in chunks of 4, 20 ms each)
        # is still running when the signals come
        lo = {"started": threading.Event()}
        tlo = threading.Thread(target=stream_until_end, args=(port, {
            "model": "tiny", "prompt": LONG_PROMPT + " " + LONG_PROMPT, "max_tokens": 20, "ignore_eos": True}, lo))
        tlo.start()
        time.sleep(0.15)
        t_sig = time.time()
        sv.procs["decode-0"].send_signal(signal.SIGTERM)
        sv.procs["prefill-0"].send_signal(signal.SIGTERM)
        time.sleep(0.8)  # a heartbeat saying "draining" has reached the gateway
        check(ts.is_alive(), "the stream still runs 0.8 s after SIGTERM (the case tests a drain)")
        st, _, body = request(port, "GET", "/health")
        check(st == 503, f"/health while the only decode replica drains: 503 ({st} {body[:120]!r})")
        t0 = time.time()
        st, _, body = request(port, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2},
                           timeout=10)
        check(st == 503 and b'"error"' in body and time.time() - t0 < 3,
              f"a new request while the replicas drain: 503 at once ({st} {body[:160]!r}, {time.time() - t0:.1f} s)")
        check_pair_whole(pair)
        tlo.join(60)
        check(lo.get("t_first", 0) > t_sig and lo["done"] and streamed_tokens(lo) == 20,
              f"a long request in its prefill at the signal finished whole: first token "
              f"{lo.get('t_first', 0) - t_sig:+.2f} s after it, {streamed_tokens(lo)} of 20 tokens, [DONE] {lo['done']}")
        routed = metric(metrics(port), "pdserve:requests_routed_total", **{"class": "long"})
        check(routed == 2, f"both long requests went through the prefill replica (routed long: {routed})")
        for name in ("decode-0", "prefill-0"):
            rc = sv.wait(name, 15)
            log = sv.log(name)
            check(rc == 0 and "draining" in log and "drained after" in log,
                  f"{name} drained and exited 0 ({rc}): {[ln for ln in log.splitlines() if 'drain' in ln][-2:]}")
        # a second SIGTERM stops at once: a new decode replica, a long stream
        sv.start("decode-1", ["decode", "--model", model, "--gateway", f"tcp://127.0.0.1:{port + 1}",
                              "--replica-id", "decode-1", "--threads", "1", "--block-size", "4",
                              "--heartbeat-interval-ms", "100", "--debug-step-delay-ms", str(STEP_MS)])
        check(wait_ready(port, roles=("decode",)), "decode-1 ready")
        t, out = long_stream(port, "replica second signal")
        sv.procs["decode-1"].send_signal(signal.SIGTERM)
        time.sleep(0.5)
        t0 = time.time()
        sv.procs["decode-1"].send_signal(signal.SIGTERM)
        rc = sv.wait("decode-1", 10)
        check(rc == 0 and time.time() - t0 < 5,
              f"a second SIGTERM stops a draining replica at once ({rc}, {time.time() - t0:.1f} s)")
        t.join(30)
        check(not t.is_alive() and streamed_tokens(out) < 900, "the cut stream ended (its replica is gone)")
    finally:
        sv.stop()
        if failures:
            for name in sv.logs:
                print(f"--- {name}\n" + sv.log(name)[-2000:])
    r = subprocess.run([BIN, "decode", "--model", model, "--shutdown-timeout", "-1"], capture_output=True, text=True,
                       timeout=30)
    check(r.returncode == 2 and "--shutdown-timeout" in r.stderr,
          f"decode --shutdown-timeout -1: exit 2 naming the flag ({r.returncode} {r.stderr.strip()[-120:]!r})")


def main():
    _, model = tiny_model()
    drain_case(model)
    timeout_case(model)
    second_signal_case(model)
    replica_drain_case(model)
    finish()


if __name__ == "__main__":
    main()

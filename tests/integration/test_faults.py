#!/usr/bin/env python3
"""Faults on the serving path (issue 3 acceptance), real processes on
127.0.0.1, the tiny model, each service started on its own:
- two prefill and two decode replicas: requests spread over all four;
- a decode replica killed (SIGKILL) mid-stream: its clients get an in-band
  error event and a closed stream within 5 s (no finish_reason), the other
  streams finish normally, new requests avoid the dead replica;
- a prefill replica killed mid-prefill: its request, which had produced
  nothing, is routed again (here no prefill replica is left: the decode
  replica prefills it) and served; it failed with a clear error before;
- killed replicas restarted with the same id rejoin and serve;
- a restarted gateway gets every replica back (they register again);
- a burst of short and long requests right after a decode replica was
  killed all succeed on the other one: what was sent to the dead one (a
  Generate, or a long request's reservation) had produced nothing, so it is
  routed again (before, those got 503 once its heartbeats were missed);
- long requests right after the only prefill replica was killed all succeed:
  the decode replica prefills them;
- a second process started under a live replica's id: the first one is told
  (RegisterReply.displaced, answering its heartbeat) and exits 1.
"""
import http.client, json, os, signal, subprocess, sys, threading, time

from pdtest import BIN, check, failures, finish, free_port_pair, metrics, tiny_model

HB = 100  # heartbeat interval, ms


class Stack:
    def __init__(self, tmp, model):
        self.tmp, self.model = tmp, model
        self.port = free_port_pair()
        self.ctrl = f"tcp://127.0.0.1:{self.port + 1}"
        self.procs = {}

    def start(self, name, args):
        log = open(os.path.join(self.tmp, name + ".log"), "a")
        self.procs[name] = subprocess.Popen([BIN] + args, stdout=log, stderr=subprocess.STDOUT)

    def gateway(self):
        self.start("gateway", ["gateway", "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                               "--control", self.ctrl, "--served-model-name", "tiny", "--long-prompt-threshold", "16",
                               "--heartbeat-interval-ms", str(HB)])

    def replica(self, role, i, delay=0):
        name = f"{role}-{i}"
        self.start(name, [role, "--model", self.model, "--gateway", self.ctrl, "--replica-id", name,
                          "--block-size", "4", "--num-kv-blocks", "1024", "--chunked-prefill-size", "4",
                          "--threads", "1", "--heartbeat-interval-ms", str(HB), "--debug-step-delay-ms", str(delay)])

    def kill(self, name, sig=signal.SIGKILL):
        p = self.procs.pop(name)
        p.send_signal(sig)
        p.wait(10)

    def stop(self):
        for n, p in list(self.procs.items()):
            p.terminate()
        for n, p in list(self.procs.items()):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    def metrics(self):
        return metrics(self.port)

    def alive(self, role):
        try:
            return int(self.metrics().get(f'pdserve:replicas_alive{{role="{role}"}}', 0))
        except OSError:
            return -1

    def wait_alive(self, d, p, timeout=30):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.alive("decode") == d and self.alive("prefill") == p:
                return True
            time.sleep(0.1)
        return False


def run_stream(port, prompt, max_tokens, result):
    """Streams a completion; result gets events, errors, finish reasons, timings."""
    result.update(events=0, error=None, finish=None, done=False, t_end=None, text="")
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                         "ignore_eos": True, "stream": True, "temperature": 0}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        result["status"] = r.status
        if r.status != 200:
            result["error"] = r.read().decode()
            result["t_end"] = time.time()
            return
        buf = b""
        while True:
            line = r.fp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                result["done"] = True
                break  # the response ends right after [DONE]
            ev = json.loads(payload)
            result["events"] += 1
            if "error" in ev:
                result["error"] = ev["error"]["message"]
            for ch in ev.get("choices", []):
                result["text"] += ch.get("text") or ""
                if ch.get("finish_reason"):
                    result["finish"] = ch["finish_reason"]
        c.close()
    except Exception as e:  # a hang shows up as the timeout
        result["error"] = f"exception {e!r}"
    result["t_end"] = time.time()


def post(port, prompt, max_tokens=4):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.read()


def main():
    tmp, model = tiny_model()
    st = Stack(tmp, model)
    try:
        st.gateway()
        for i in range(2):
            st.replica("decode", i, delay=20)
            st.replica("prefill", i, delay=20)
        if not check(st.wait_alive(2, 2), "2 decode + 2 prefill replicas registered"):
            return
        # ---- spread: 4 short + 4 long requests at once ----
        res = [dict() for _ in range(8)]
        th = [threading.Thread(target=run_stream, args=(st.port, [5 + i] * (4 if i < 4 else 40), 20, res[i]))
              for i in range(8)]
        for t in th: t.start()
        time.sleep(0.5)
        m = st.metrics()
        for t in th: t.join(60)
        check(all(r.get("finish") == "length" and r.get("done") for r in res),
              "8 concurrent requests finished " + repr([(r.get("status"), r.get("finish"), r.get("done"), r.get("error")) for r in res]))
        # per-replica work: generation tokens on each decode, prefill tokens on each prefill
        m = st.metrics()
        gen = [m.get(f'pdserve:generation_tokens_total{{replica="decode-{i}"}}', 0) for i in range(2)]
        pre = [m.get(f'pdserve:replica_prefill_tokens_total{{replica="prefill-{i}",role="prefill"}}', 0) for i in range(2)]
        check(all(g > 0 for g in gen), f"both decode replicas generated ({gen})")
        check(all(p > 0 for p in pre), f"both prefill replicas prefilled ({pre})")

        # ---- kill a decode replica mid-stream ----
        res = [dict() for _ in range(4)]
        th = [threading.Thread(target=run_stream, args=(st.port, [9 + i] * 4, 300, res[i])) for i in range(4)]
        for t in th: t.start()
        time.sleep(1.0)
        t_kill = time.time()
        st.kill("decode-1")
        for t in th: t.join(60)
        errored = [r for r in res if r.get("error")]
        ok = [r for r in res if not r.get("error")]
        check(len(errored) >= 1 and len(ok) >= 1, f"decode kill: {len(errored)} streams failed, {len(ok)} finished")
        check(all(r["finish"] is None and r["done"] and r["t_end"] - t_kill < 5.0 for r in errored),
              "failed streams: in-band error, no finish_reason, [DONE], within 5 s " +
              repr([(r["finish"], r["done"], r["t_end"] - t_kill, r["error"]) for r in errored]))
        check(all(r["finish"] == "length" for r in ok), "the other streams finished normally")
        check(st.alive("decode") == 1, "dead decode replica out of rotation")
        codes = [post(st.port, [3, 4, 5])[0] for _ in range(6)]
        check(all(c == 200 for c in codes), f"new requests avoid the dead replica ({codes})")

        # ---- kill a prefill replica mid-prefill ----
        st.kill("prefill-1")
        st.replica("prefill", 1, delay=200)  # a slow one, to kill mid-prefill
        st.wait_alive(1, 2)
        st.kill("prefill-0")  # leave only the slow one
        st.wait_alive(1, 1)
        r = {}
        t = threading.Thread(target=run_stream, args=(st.port, [11] * 200, 5, r))
        t.start()
        time.sleep(1.0)
        t_kill = time.time()
        st.kill("prefill-1")
        t.join(30)
        # it had produced nothing: routed again, and with no prefill replica
        # left the decode replica prefills it (it failed with a 503 before)
        check(r.get("t_end") is not None and r["t_end"] - t_kill < 15.0 and not r.get("error") and
              r.get("finish") == "length" and r.get("done"),
              f"prefill kill mid-prefill: the request is served anyway, by the decode replica "
              f"({r.get('error')!r}, finish {r.get('finish')}, {r.get('t_end', 0) - t_kill:.1f} s)")
        # ---- restarted replicas rejoin and serve ----
        st.replica("prefill", 0)
        st.replica("decode", 1)
        check(st.wait_alive(2, 1), "restarted replicas rejoined")
        s1, d1 = post(st.port, [13] * 40)
        check(s1 == 200, f"long request after restart: {s1} {d1[:200]!r}")
        # ---- gateway restart: replicas register again ----
        st.kill("gateway", signal.SIGTERM)
        time.sleep(0.3)
        st.gateway()
        check(st.wait_alive(2, 1, timeout=20), "replicas registered with the restarted gateway")
        s2, d2 = post(st.port, [14] * 40)
        check(s2 == 200, f"request after gateway restart: {s2} {d2[:200]!r}")
        # ---- a decode replica killed just before a burst: none of it is lost ----
        # (the gateway still counts it alive until its heartbeats are missed;
        # what was sent to it produced nothing, so it goes to the other one)
        check(st.wait_alive(2, 1), "both decode replicas alive before the burst")
        st.kill("decode-0")
        codes = [None] * 8

        def one(i):  # 4 short and 4 long (through the prefill replica: the reservation was on the dead one)
            codes[i] = post(st.port, [20 + i] * (4 if i % 2 else 40))[0]

        th = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in th: t.start()
        for t in th: t.join(30)
        check(all(c == 200 for c in codes), f"a burst right after a decode replica died: all 200 on the other ({codes})")
        log = open(os.path.join(tmp, "gateway.log"), errors="replace").read()
        check("routed again" in log, "the gateway routed some of the burst again (its log says so)")
        # ---- a second process under a live replica's id: the first one stops ----
        # (it ran on, unused, its heartbeats counted as the new one's; once the
        # new one died, nothing served: helper-50)
        old = st.procs["decode-1"]
        st.replica("decode", 1)  # the same id, another process
        try:
            rc_old = old.wait(15)
        except subprocess.TimeoutExpired:
            rc_old = "still running"
            old.kill()
        log = open(os.path.join(tmp, "decode-1.log"), errors="replace").read()
        check(rc_old == 1 and "registered this replica id with the gateway since: this one stops" in log,
              f"the displaced process stops (exit {rc_old}) and says why")
        check(st.wait_alive(1, 1) and post(st.port, [21] * 4)[0] == 200, "the new decode-1 serves")
        # ---- the prefill replica killed just before long requests: the decode replica prefills them ----
        st.kill("prefill-0")
        codes = [None] * 4

        def long_one(i):
            codes[i] = post(st.port, [40 + i] * 40)[0]

        th = [threading.Thread(target=long_one, args=(i,)) for i in range(4)]
        for t in th: t.start()
        for t in th: t.join(30)
        check(all(c == 200 for c in codes), f"long requests right after the only prefill replica died: all 200, "
              f"prefilled on the decode replica ({codes})")
    finally:
        st.stop()
        if failures:
            for f in sorted(os.listdir(tmp)):
                if f.endswith(".log"):
                    print(f"---- {f}\n" + open(os.path.join(tmp, f)).read()[-3000:])
    finish()


if __name__ == "__main__":
    main()
    finish()  # reached only when main returned early (replicas never registered): counts as a failure

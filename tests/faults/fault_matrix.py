#!/usr/bin/env python3
"""The fault matrix (issue 8): a gateway, two prefill and two decode replicas
of the tiny model on 127.0.0.1, each its own process, under a mixed load of
short and long, streamed and non-streamed completions, while faults are
injected at random moments (seeded, so a run can be repeated):

  kill-decode    SIGKILL a decode replica right after a burst of long prompts
                 (prefill replicas hold queued jobs for it), restart it
  kill-prefill   SIGKILL a prefill replica, restart it
  stop-decode    SIGSTOP a decode replica past the heartbeat expiry, SIGCONT
  stop-prefill   SIGSTOP a prefill replica past the expiry, SIGCONT
  kill-gateway   SIGKILL the gateway, restart it (replicas register again)
  clients        throughout: clients that disconnect mid-stream, and clients
                 that disconnect mid-prefill (a long prompt, gone before its
                 first token)

Checked:
  - every request ends within its deadline (--request-timeout + slack) with
    a success or an explicit error (an HTTP error with an OpenAI body, an
    in-band SSE error event then [DONE], or a refused/reset connection while
    the gateway is down); a connection that ends early while the gateway is
    up is a lost request;
  - no process exits except the ones killed (and all exit 0 on SIGTERM at the
    end; under the sanitizer build, that includes LeakSanitizer);
  - after recovery every replica is in rotation again and its
    pdserve:kv_cache_free_blocks is back at its baseline, with nothing
    running;
  - a short and a long request succeed after recovery.

Run alone: python3 tests/faults/fault_matrix.py [--seed N] [--min-requests N]
[--table docs-table.md]. tests/integration/test_fault_matrix.py runs it
bounded in `make test`.
"""
import argparse, http.client, json, os, random, re, shutil, signal, socket, struct, subprocess, sys, threading, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from pdtest import BIN, free_port_pair, metric, metrics, tiny_model  # noqa: E402

HB_MS = 100             # heartbeat interval: a replica is expired after 3 missed (0.3 s)
REQUEST_TIMEOUT = 20.0  # gateway --request-timeout (s)
DEADLINE = REQUEST_TIMEOUT + 10.0  # the client's deadline: gateway deadline + slack
THRESHOLD = 16          # --long-prompt-threshold (tokens)
KV_TTL = 8.0            # decode --kv-reservation-ttl (s): an orphaned reservation (its grant
                        # lost with the gateway) is handed back 1.25 x this after it was made


class Stack:
    """The processes, by name; every start and deliberate kill is logged."""

    def __init__(self, tmp, model, step_delay_ms):
        self.tmp, self.model, self.delay = tmp, model, step_delay_ms
        self.port = free_port_pair()
        self.ctrl = f"tcp://127.0.0.1:{self.port + 1}"
        self.procs = {}
        self.expected_exit = set()  # names killed on purpose (until restarted)
        self.unexpected = []        # (name, returncode)
        self.events = []            # (t, what)
        self.gateway_down = []      # [t_kill, t_up] windows
        self.lock = threading.Lock()
        self.no_long = threading.Event()  # set: clients send no prompt that needs a prefill replica
        self.long_in_flight = 0
        self.burst_results = []     # requests the fault schedule sends itself

    def log(self, what):
        with self.lock:
            self.events.append((time.time(), what))
        print(f"  [{time.strftime('%H:%M:%S')}] {what}", flush=True)

    def start(self, name):
        log = open(os.path.join(self.tmp, name + ".log"), "a")
        if name == "gateway":
            args = ["gateway", "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                    "--control", self.ctrl, "--served-model-name", "tiny",
                    "--long-prompt-threshold", str(THRESHOLD), "--heartbeat-interval-ms", str(HB_MS),
                    "--request-timeout", str(REQUEST_TIMEOUT)]
        else:
            role = name.split("-")[0]
            args = [role, "--model", self.model, "--gateway", self.ctrl, "--replica-id", name,
                    "--block-size", "4", "--num-kv-blocks", "512", "--chunked-prefill-size", "16",
                    "--threads", "1", "--heartbeat-interval-ms", str(HB_MS),
                    "--debug-step-delay-ms", str(self.delay)]
            if role == "decode":
                args += ["--kv-reservation-ttl", str(KV_TTL)]
        env = dict(os.environ)
        supp = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lsan.supp")
        env["LSAN_OPTIONS"] = ":".join(x for x in (os.environ.get("LSAN_OPTIONS"), f"suppressions={supp}") if x)
        if os.environ.get("PD_FAULT_LOG_LEVEL"):  # e.g. debug, for a run being investigated
            env["PDSERVE_LOG_LEVEL"] = os.environ["PD_FAULT_LOG_LEVEL"]
        with self.lock:
            self.procs[name] = subprocess.Popen([BIN] + args, stdout=log, stderr=subprocess.STDOUT, env=env)
            self.expected_exit.discard(name)

    def signal(self, name, sig):
        with self.lock:
            p = self.procs[name]
            if sig == signal.SIGKILL:
                self.expected_exit.add(name)
        p.send_signal(sig)
        if sig == signal.SIGKILL:
            p.wait(10)

    def check_exits(self):
        """Records processes that exited without being killed on purpose."""
        with self.lock:
            for name, p in self.procs.items():
                rc = p.poll()
                if rc is not None and name not in self.expected_exit and (name, rc) not in self.unexpected:
                    self.unexpected.append((name, rc))
                    print(f"  !! {name} exited unexpectedly (rc {rc})", flush=True)

    def stop(self):
        """SIGTERM everything still running; returns {name: rc}."""
        rcs = {}
        with self.lock:
            procs = dict(self.procs)
        for name, p in procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for name, p in procs.items():
            try:
                rcs[name] = p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                rcs[name] = "hung on SIGTERM"
        return rcs

    def alive(self):
        """{role: count} from the gateway's /metrics, or None while it is down."""
        try:
            m = metrics(self.port)
        except OSError:
            return None
        return {r: int(metric(m, "pdserve:replicas_alive", role=r)) for r in ("decode", "prefill")}

    def wait_alive(self, decode, prefill, timeout):
        t0 = time.time()
        while time.time() - t0 < timeout:
            a = self.alive()
            if a and a["decode"] == decode and a["prefill"] == prefill:
                return True
            time.sleep(0.1)
        return False

    def kv(self):
        """{replica: (free_blocks, running)} from /metrics."""
        m = metrics(self.port)
        out = {}
        for k, v in m.items():
            if k.startswith("pdserve:kv_cache_free_blocks{"):
                rid = k.split('replica="')[1].split('"')[0]
                run = m.get(k.replace("kv_cache_free_blocks", "num_requests_running"), 0)
                out[rid] = (int(v), int(run))
        return out


# ---- clients -------------------------------------------------------------


def rst_close(sock):
    """Closes with a reset (SO_LINGER 0): the abrupt disconnect of a client."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


def run_request(port, spec, out):
    """One request per spec; out gets the outcome. Outcomes: ok, http_error
    (status >= 400 with an OpenAI error body), inband_error, refused (no
    gateway listening), conn_error (reset / closed early), client_abort (on
    purpose), hang (the
    client's deadline passed), bad (a response that is none of these)."""
    t0 = time.time()
    out.update(kind=spec["kind"], t_start=t0, outcome=None, detail="")
    body = {"model": "tiny", "prompt": spec["prompt"], "max_tokens": spec["max_tokens"],
            "ignore_eos": True, "temperature": 0, "stream": spec["stream"]}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
    try:
        try:
            c.connect()
        except ConnectionRefusedError:
            out.update(outcome="refused", detail="connection refused (no gateway listening)")
            return
        abort_after = spec.get("abort_after")  # seconds (mid-prefill) or events (mid-stream)
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        if spec["kind"] == "abort-prefill":
            time.sleep(abort_after)
            rst_close(c.sock)
            out.update(outcome="client_abort")
            return
        r = c.getresponse()
        if r.status != 200:
            data = r.read()
            try:
                err = json.loads(data)["error"]
                out.update(outcome="http_error", detail=f"{r.status} {err['message'][:80]}")
            except Exception:
                out.update(outcome="bad", detail=f"{r.status} without an OpenAI error body: {data[:80]!r}")
            return
        if not spec["stream"]:
            data = json.loads(r.read())
            fin = data["choices"][0].get("finish_reason")
            out.update(outcome="ok" if fin in ("length", "stop") else "bad", detail=f"finish {fin}")
            return
        events, finish, error, done = 0, None, None, False
        while True:
            line = r.fp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line[6:] == b"[DONE]":
                done = True
                break
            ev = json.loads(line[6:])
            events += 1
            if "error" in ev:
                error = ev["error"]["message"]
            for ch in ev.get("choices", []):
                finish = ch.get("finish_reason") or finish
            if spec["kind"] == "abort-stream" and events >= abort_after:
                rst_close(c.sock)
                out.update(outcome="client_abort")
                return
        if done and error:
            out.update(outcome="inband_error", detail=error[:80])
        elif done and finish:
            out.update(outcome="ok", detail=f"finish {finish}")
        else:
            out.update(outcome="conn_error", detail=f"stream ended after {events} events without [DONE]")
    except socket.timeout:
        out.update(outcome="hang", detail="no answer within the client deadline")
    except (OSError, http.client.HTTPException, ValueError) as e:
        out.update(outcome="conn_error", detail=repr(e)[:80])
    finally:
        out["t_end"] = time.time()
        try:
            c.close()
        except Exception:
            pass


def make_spec(rng, i):
    """The load mix: short and long prompts (token ids), streamed or not, and
    clients that leave early."""
    x = rng.random()
    short = [rng.randrange(3, 1000) for _ in range(rng.randrange(2, THRESHOLD))]
    long_ = [rng.randrange(3, 1000) for _ in range(rng.randrange(THRESHOLD + 8, 100))]
    if x < 0.30:
        return dict(kind="short", prompt=short, max_tokens=rng.randrange(2, 12), stream=False)
    if x < 0.50:
        return dict(kind="short-stream", prompt=short, max_tokens=rng.randrange(4, 32), stream=True)
    if x < 0.65:
        return dict(kind="long", prompt=long_, max_tokens=rng.randrange(2, 8), stream=False)
    if x < 0.85:
        return dict(kind="long-stream", prompt=long_, max_tokens=rng.randrange(4, 24), stream=True)
    if x < 0.93:
        return dict(kind="abort-stream", prompt=short, max_tokens=200, stream=True,
                    abort_after=rng.randrange(1, 4))
    return dict(kind="abort-prefill", prompt=[rng.randrange(3, 1000) for _ in range(400)], max_tokens=8,
                stream=True, abort_after=rng.uniform(0.02, 0.15))


# ---- faults --------------------------------------------------------------


def burst_request(st, prompt):
    out = {}
    run_request(st.port, dict(kind="long-burst", prompt=prompt, max_tokens=2, stream=False), out)
    with st.lock:
        st.burst_results.append(out)


def fault_schedule(rng, st, stop_event, long_during_gateway_kill):
    """Faults at jittered moments, one at a time, each recovered before the
    next."""
    def at(t, t0):
        while time.time() - t0 < t and not stop_event.is_set():
            time.sleep(0.02)

    t0 = time.time()
    j = lambda: rng.uniform(-0.4, 0.4)
    d, p = f"decode-{rng.randrange(2)}", f"prefill-{rng.randrange(2)}"
    at(2.0 + j(), t0)
    # a burst of long prompts first, so that the prefill replicas hold queued
    # jobs for the replica that dies (a prefill replica crashed on the second
    # job after a failed reconnect)
    burst = [threading.Thread(target=burst_request, args=(st, [rng.randrange(3, 1000) for _ in range(200)]))
             for _ in range(8)]
    for b in burst:
        b.start()
    time.sleep(0.1)
    st.log(f"kill-decode: SIGKILL {d}, 8 long prompts just sent")
    st.signal(d, signal.SIGKILL)
    at(3.5 + j(), t0)
    st.start(d)
    st.log(f"kill-decode: {d} restarted")
    st.wait_alive(2, 2, 15)

    at(5.5 + j(), t0)
    st.log(f"kill-prefill: SIGKILL {p}")
    st.signal(p, signal.SIGKILL)
    at(7.0 + j(), t0)
    st.start(p)
    st.log(f"kill-prefill: {p} restarted")
    st.wait_alive(2, 2, 15)

    d = f"decode-{rng.randrange(2)}"
    at(9.0 + j(), t0)
    st.log(f"stop-decode: SIGSTOP {d} for 1.2 s (expiry {3 * HB_MS} ms)")
    st.signal(d, signal.SIGSTOP)
    time.sleep(1.2)
    st.signal(d, signal.SIGCONT)
    st.log(f"stop-decode: SIGCONT {d}")
    st.wait_alive(2, 2, 15)

    p = f"prefill-{rng.randrange(2)}"
    at(12.0 + j(), t0)
    st.log(f"stop-prefill: SIGSTOP {p} for 1.2 s")
    st.signal(p, signal.SIGSTOP)
    time.sleep(1.2)
    st.signal(p, signal.SIGCONT)
    st.log(f"stop-prefill: SIGCONT {p}")
    st.wait_alive(2, 2, 15)

    at(15.0 + j(), t0)
    if not long_during_gateway_kill:
        # Only for comparison runs: keep prompts that need a prefill replica
        # out of this fault.
        st.no_long.set()
        t_w = time.time()
        while st.long_in_flight > 0 and time.time() - t_w < 15:
            time.sleep(0.02)
        st.log(f"kill-gateway: no long prompt in flight (waited {time.time() - t_w:.1f} s)")
        kill_note = ""
    else:
        # Long prompts in flight at the kill: reservations made, grants on
        # their way to a prefill replica or KV being written. A grant that
        # dies with the gateway leaves a reservation nobody will ever claim
        # or fence; the decode replica hands it back once its writer's lease
        # has ended (KV_TTL + a quarter), before the recovery check gives up.
        burst = [threading.Thread(target=burst_request, args=(st, [rng.randrange(3, 1000) for _ in range(100)]))
                 for _ in range(6)]
        for b in burst:
            b.start()
        time.sleep(rng.uniform(0.03, 0.15))
        kill_note = f", {st.long_in_flight} long prompts in flight + 6 just sent"
    st.log("kill-gateway: SIGKILL gateway" + kill_note)
    window = [time.time(), None]
    st.gateway_down.append(window)
    st.signal("gateway", signal.SIGKILL)
    time.sleep(rng.uniform(0.3, 0.8))
    st.start("gateway")
    ok = st.wait_alive(2, 2, 20)
    window[1] = time.time()
    st.no_long.clear()
    st.log(f"kill-gateway: gateway restarted, replicas {'back' if ok else 'NOT back'}")


# ---- the run -------------------------------------------------------------


def run(seed=1, min_requests=300, concurrency=10, step_delay_ms=2, max_load_s=75.0, verbose=True,
        long_during_gateway_kill=True):
    """Runs the matrix; returns (checks, results): checks is a list of
    (ok, what), results the per-request outcomes and the fault log.
    long_during_gateway_kill=False keeps prompts that need a prefill replica
    out of the gateway kill (for comparison; by default a burst of long
    prompts is sent just before it)."""
    rng = random.Random(seed)
    tmp, model = tiny_model()
    st = Stack(tmp, model, step_delay_ms)
    checks = []

    def check(ok, what):
        checks.append((bool(ok), what))
        print(("ok: " if ok else "FAIL: ") + what, flush=True)
        return ok

    results = []
    load_s = rec_s = 0.0
    baseline = {}
    try:
        st.start("gateway")
        for i in range(2):
            st.start(f"decode-{i}")
            st.start(f"prefill-{i}")
        if not check(st.wait_alive(2, 2, 60), "stack up: 2 decode + 2 prefill replicas"):
            return checks, dict(requests=results, events=st.events, seed=seed, tmp=tmp)
        time.sleep(3 * HB_MS / 1000.0)
        baseline = st.kv()
        print(f"baseline KV free blocks: {baseline}", flush=True)

        stop_faults = threading.Event()
        fault_thread = threading.Thread(target=fault_schedule,
                                        args=(rng, st, stop_faults, long_during_gateway_kill))
        specs_lock = threading.Lock()
        issued = [0]
        load_t0 = time.time()

        def worker(wrng):
            while True:
                with specs_lock:
                    faults_done = not fault_thread.is_alive()
                    elapsed = time.time() - load_t0
                    if (issued[0] >= min_requests and faults_done) or elapsed > max_load_s:
                        return
                    i = issued[0]
                    issued[0] += 1
                    spec = make_spec(wrng, i)
                    while st.no_long.is_set() and len(spec["prompt"]) > THRESHOLD:
                        spec = make_spec(wrng, i)
                    is_long = len(spec["prompt"]) > THRESHOLD
                    st.long_in_flight += is_long
                out = {}
                run_request(st.port, spec, out)
                with specs_lock:
                    st.long_in_flight -= is_long
                    results.append(out)
                    if out["outcome"] == "refused":
                        issued[0] -= 1  # not a request the gateway saw: does not count
                if out["outcome"] == "refused":
                    time.sleep(0.1)  # the gateway is down: do not spin
                st.check_exits()

        workers = [threading.Thread(target=worker, args=(random.Random(seed * 1000 + k),))
                   for k in range(concurrency)]
        fault_thread.start()
        for w in workers:
            w.start()
        for w in workers:
            w.join(max_load_s + DEADLINE + 30)
        stop_faults.set()
        fault_thread.join(60)
        time.sleep(0.5)
        with st.lock:
            results.extend(st.burst_results)
        load_s = time.time() - load_t0
        st.check_exits()

        # ---- recovery ----
        check(st.wait_alive(2, 2, 30), "restarted components rejoined: 2 decode + 2 prefill in rotation")
        t_rec = time.time()
        kv_now, back = {}, False
        while time.time() - t_rec < 40:
            try:
                kv_now = st.kv()
            except OSError:
                kv_now = {}
            if kv_now and all(kv_now.get(r, (None, None))[0] == baseline[r][0] and kv_now[r][1] == 0
                              for r in baseline):
                back = True
                break
            time.sleep(0.2)
        rec_s = time.time() - t_rec
        check(back, f"KV free blocks back at baseline on every replica ({rec_s:.1f} s): "
                    f"baseline {baseline}, now {kv_now}")
        # reservations nobody fenced (grant or claim lost with the gateway),
        # handed back by their decode replica once the writer's lease ended
        reclaimed = 0
        for f in os.listdir(tmp):
            if f.startswith("decode-") and f.endswith(".log"):
                for line in open(os.path.join(tmp, f), errors="replace"):
                    m = re.search(r"(\d+) reservations handed back: their writer's lease has ended", line)
                    reclaimed += int(m.group(1)) if m else 0
        print(f"reservations handed back after their lease: {reclaimed}", flush=True)
        final = {}
        for kind, prompt in (("short", [5, 6, 7]), ("long", list(range(10, 60)))):
            o = {}
            run_request(st.port, dict(kind=kind, prompt=prompt, max_tokens=4, stream=False), o)
            final[kind] = o["outcome"]
        check(all(v == "ok" for v in final.values()), f"requests after recovery: {final}")
        st.check_exits()

        # ---- per-request verdicts ----
        def in_gateway_window(o):
            for t_kill, t_up in st.gateway_down:
                if t_kill - 0.5 <= o["t_end"] <= (t_up or time.time()) + 0.5 or \
                        t_kill - 0.5 <= o["t_start"] <= (t_up or time.time()) + 0.5:
                    return True
            return False

        late = [o for o in results if o["t_end"] - o["t_start"] > DEADLINE]
        hangs = [o for o in results if o["outcome"] == "hang"]
        bad = [o for o in results if o["outcome"] == "bad"]
        lost = [o for o in results if o["outcome"] in ("conn_error", "refused") and not in_gateway_window(o)]
        n_seen = sum(1 for o in results if o["outcome"] != "refused")
        # the load stops at max_load_s: on a slow machine (sanitizers, other
        # work) fewer requests are a weaker run, not a fault
        check(n_seen >= min(min_requests, 100), f"{n_seen} requests in {load_s:.0f} s of load "
                                                f"(and {len(results) - n_seen} refused while the gateway was down)")
        check(not hangs and not late, f"every request ended within its deadline ({DEADLINE:.0f} s): "
                                      f"{len(hangs)} hung, {len(late)} late")
        check(not bad, f"every answer is a success or an explicit error ({len(bad)} malformed: "
                       f"{[o['detail'] for o in bad[:3]]})")
        check(not lost, f"no request lost while the gateway was up ({len(lost)}: "
                        f"{[(o['kind'], o['detail']) for o in lost[:3]]})")
        check(not st.unexpected, f"no process died except those killed ({st.unexpected})")
    finally:
        rcs = st.stop()
        # SIGTERM: every process still running exits cleanly (0), sanitizers included
        check(all(rc == 0 for rc in rcs.values()), f"clean exit on SIGTERM: {rcs}")
    if any(not ok for ok, _ in checks):
        if verbose:
            for f in sorted(os.listdir(tmp)):
                if f.endswith(".log"):
                    print(f"---- {f} (tail)")
                    with open(os.path.join(tmp, f), errors="replace") as fh:
                        print("".join(fh.readlines()[-25:]))
        print(f"logs kept in {tmp}", flush=True)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return checks, dict(requests=results, events=st.events, seed=seed, tmp=tmp, load_s=load_s,
                        recovery_s=rec_s, baseline=baseline)


def outcome_table(res):
    """Markdown: outcomes by request kind, and the fault log."""
    kinds = ["short", "short-stream", "long", "long-stream", "abort-stream", "abort-prefill", "long-burst"]
    outs = ["ok", "http_error", "inband_error", "conn_error", "refused", "client_abort", "hang", "bad"]
    rows = ["| request kind | " + " | ".join(outs) + " | slowest (s) |",
            "| --- |" + " --- |" * (len(outs) + 1)]
    for k in kinds:
        rs = [o for o in res["requests"] if o["kind"] == k]
        if not rs:
            continue
        cnt = [sum(1 for o in rs if o["outcome"] == x) for x in outs]
        slow = max(o["t_end"] - o["t_start"] for o in rs)
        rows.append(f"| {k} | " + " | ".join(str(c) for c in cnt) + f" | {slow:.1f} |")
    t0 = res["events"][0][0] if res["events"] else 0
    log = [f"- t={t - t0:5.1f} s  {what}" for t, what in res["events"]]
    errs = {}
    for o in res["requests"]:
        if o["outcome"] in ("http_error", "inband_error", "conn_error"):
            key = o["detail"][:90]
            errs[key] = errs.get(key, 0) + 1
    top = [f"- {n} x `{k}`" for k, n in sorted(errs.items(), key=lambda kv: -kv[1])[:8]]
    return "\n".join(rows) + "\n\nFaults (seed %d):\n\n" % res["seed"] + "\n".join(log) + \
        "\n\nExplicit errors seen:\n\n" + "\n".join(top) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=int(os.environ.get("PD_FAULT_SEED", "1")))
    ap.add_argument("--min-requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--table", help="write the outcome table (markdown) here")
    ap.add_argument("--no-long-during-gateway-kill", action="store_true",
                    help="as make test runs it: no long prompt in flight when the gateway is killed")
    a = ap.parse_args()
    checks, res = run(a.seed, a.min_requests, a.concurrency,
                      long_during_gateway_kill=not a.no_long_during_gateway_kill)
    if res.get("requests"):
        t = outcome_table(res)
        print(t)
        if a.table:
            with open(a.table, "w") as f:
                f.write(t)
    failed = [w for ok, w in checks if not ok]
    print("failures:", len(failed))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

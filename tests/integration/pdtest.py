"""Shared helpers of the integration tests (real pdserve processes on
127.0.0.1): checks that collect failures, free ports, HTTP calls, /metrics
parsing, a tiny model made once per test, a `pdserve up` stack started,
awaited and stopped, and streamed (SSE) responses read and checked."""
import atexit, collections, http.client, json, os, random, selectors, shutil, signal, socket, subprocess, sys
import tempfile, time

BIN = os.environ.get("PD_BIN", "build/pdserve")
SRC = os.environ.get("PD_SOURCE_DIR", ".")
failures = []


def check(cond, what, quiet_ok=False):
    """Records a failure (and prints it); returns cond."""
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)
    elif not quiet_ok:
        print("ok:", what, flush=True)
    return cond


def finish():
    print("failures:", len(failures))
    sys.exit(1 if failures else 0)


def _ephemeral_floor():
    """The lowest port of the kernel's ephemeral range (32768 if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_pair():
    """A TCP port P on 127.0.0.1, free when asked, whose neighbour P+1 (the
    control endpoint) is free too, drawn at random from [10000, the ephemeral
    range): every port bound to 0 (UCX and ZeroMQ listeners of the stacks
    other tests run at the same time, outgoing connections' source ports)
    comes from the ephemeral range, so a port found there by binding to 0
    could be taken before pdserve binds it (seen in CI: "cannot listen on
    127.0.0.1:55243: Address already in use"). Another test may still draw
    the same port: unlikely among ~20000."""
    rng = random.SystemRandom()
    hi = max(_ephemeral_floor() - 2, 10002)
    while True:
        p = rng.randrange(10000, hi)
        try:
            for q in (p, p + 1):
                t = socket.socket()
                try:
                    t.bind(("127.0.0.1", q))
                finally:
                    t.close()
            return p
        except OSError:
            pass


def request(port, method, path, body=None, timeout=60, headers=None):
    """Returns (status, headers dict, body bytes)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/json"} if body is not None else {}
    h.update(headers or {})
    c.request(method, path, json.dumps(body) if isinstance(body, (dict, list)) else body, h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict(r.getheaders()), data


def metrics(port):
    """/metrics as {series-with-labels: value}."""
    _, _, data = request(port, "GET", "/metrics", timeout=10)
    out = {}
    for line in data.decode().splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def metric(m, name, **labels):
    """Sum of the series of name whose labels include the given ones."""
    tot = 0.0
    for k, v in m.items():
        if (k == name or k.startswith(name + "{")) and all(f'{a}="{b}"' in k for a, b in labels.items()):
            tot += v
    return tot


def temp_dir():
    """A new temporary folder, removed with everything in it when the test
    exits (atexit), so that a CI run leaves no models behind (each tiny
    model is ~40 MB; a CI host once ran out of disk). PD_KEEP_TMP=1 keeps
    it, to read a failed run's logs after the fact; a failure prints the
    stack's log either way (stop_up)."""
    tmp = tempfile.mkdtemp(prefix="pdtest-")
    if not os.environ.get("PD_KEEP_TMP"):
        atexit.register(shutil.rmtree, tmp, True)
    return tmp


def tiny_model(preset="tiny"):
    """A model made by `pdserve mkmodel --preset PRESET --seed 1` in a new
    temp_dir(). Returns (that folder, the model's path)."""
    tmp = temp_dir()
    model = os.path.join(tmp, preset)
    subprocess.run([BIN, "mkmodel", "--preset", preset, "--seed", "1", "--out", model], check=True, capture_output=True)
    return tmp, model


def start_up(model, port, *flags, log_name="up.log"):
    """`pdserve up --model MODEL --port PORT FLAGS...` in a session of its own
    (stop_up ends the whole group), stdout and stderr in LOG_NAME beside the
    model (tiny_model's temporary folder). Returns the Popen with .log (the
    open file) and .log_path."""
    log_path = os.path.join(os.path.dirname(model), log_name)
    log = open(log_path, "w")
    up = subprocess.Popen([BIN, "up", "--model", model, "--port", str(port), *map(str, flags)],
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    up.log, up.log_path = log, log_path
    return up


def pd_stack_flags(threshold, chunk):
    """`pdserve up` flags of the tests that compare both routes: the model
    served as "tiny", one prefill and one decode replica, prompts longer than
    THRESHOLD tokens through the prefill replica in chunks of CHUNK, small KV
    blocks, fast heartbeats (the counters), one thread each."""
    return ["--host", "127.0.0.1", "--served-model-name", "tiny", "--prefill-replicas", "1", "--decode-replicas", "1",
            "--long-prompt-threshold", str(threshold), "--chunked-prefill-size", str(chunk), "--block-size", "4",
            "--num-kv-blocks", "512", "--heartbeat-interval-ms", "100", "--threads", "1"]


def wait_ready(port, roles=("prefill",), timeout=60):
    """True once /health answers 200 and /metrics counts a live replica of
    each of ROLES (the gateway is healthy with a decode replica alone)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            st, _, _ = request(port, "GET", "/health", timeout=10)
            m = metrics(port) if st == 200 else {}
            if st == 200 and all(metric(m, "pdserve:replicas_alive", role=r) >= 1 for r in roles):
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def stop_up(up, sanitizer=False, tail=6000):
    """Stops a start_up stack: SIGTERM to its process group, SIGKILL after
    10 s. With SANITIZER, checks that its log holds no sanitizer report.
    Prints the log's last TAIL characters when any check failed."""
    os.killpg(up.pid, signal.SIGTERM)
    try:
        up.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGKILL)
        up.wait()
    up.log.close()
    text = open(up.log_path, errors="replace").read()
    if sanitizer:
        check("Sanitizer" not in text and "runtime error" not in text, "no sanitizer report in the stack's log")
    if failures:
        print(text[-tail:])


SSE = collections.namedtuple("SSE", "events text usage finish_reason done")


def stop_procs(procs, grace=15):
    """SIGTERM every process still running, wait up to `grace` s each, then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()


def parse_sse(raw, what="stream"):
    """A streamed completion's body (bytes) read as the OpenAI API sends it:
    blocks of one `data: ` line (`:` comments skipped), each strict UTF-8
    JSON, then `data: [DONE]` last. Checks that shape (quietly) and returns
    SSE(events, text, usage, finish_reason, done): text concatenates choice
    0's delta.content (chat) or text (completions); usage is the last one
    sent; finish_reason the last one set."""
    events, text, usage, fin, done = [], "", None, None, False
    for block in raw.split(b"\n\n"):
        block = block.strip()
        if not block or block.startswith(b":"):
            continue
        if not check(block.startswith(b"data: ") and not done, f"{what}: SSE block {block[:60]!r}", True):
            continue
        payload = block[6:]
        if payload == b"[DONE]":
            done = True
            continue
        ev = json.loads(payload.decode("utf-8", errors="strict"))
        events.append(ev)
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            if ch.get("index", 0) == 0:
                text += (ch.get("delta") or {}).get("content") or ch.get("text") or ""
                fin = ch.get("finish_reason") or fin
    check(done, f"{what}: stream ends with data: [DONE]", True)
    return SSE(events, text, usage, fin, done)


def stream(port, path, body, timeout=60):
    """POSTs BODY with "stream": true to PATH; parse_sse of the answer (its
    status checked to be 200)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
    r = c.getresponse()
    check(r.status == 200, f"{path} stream: status {r.status}", quiet_ok=True)
    raw = r.read()
    c.close()
    return parse_sse(raw, f"{path} stream")


def rss_kib(pid):
    """VmRSS of process PID, KiB (/proc/PID/status)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def open_idle(port, n, send_request, timeout=120):
    """N non-blocking connections to PORT; with SEND_REQUEST each sends
    GET /v1/models and reads (the start of) its answer, then all stay open.
    Returns (sockets, how many did not connect or were not answered within
    TIMEOUT seconds)."""
    socks = []
    for i in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        socks.append(s)
        if i % 500 == 499:
            time.sleep(0.05)  # let the gateway accept (listen backlog)
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_WRITE)
    pending, deadline = set(socks), time.time() + timeout
    while pending and time.time() < deadline:
        for key, ev in sel.select(1):
            s = key.fileobj
            if ev & selectors.EVENT_WRITE and send_request:
                s.send(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
                sel.modify(s, selectors.EVENT_READ)
            elif ev & selectors.EVENT_WRITE or s.recv(65536):
                sel.unregister(s)
                pending.discard(s)
    sel.close()
    return socks, len(pending)

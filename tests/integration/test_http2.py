#!/usr/bin/env python3
"""HTTP/2 at the gateway of a real stack (`pdserve up`, tiny model), with real
clients on one port: curl over HTTP/1.1, curl --http2-prior-knowledge, curl
--http2 (Upgrade: h2c), Python httpx with h2 (prior knowledge) and the
official `openai` npm package (HTTP/1.1) all get the same text, usage and
finish_reason, streamed and not, on both routes (short prompts straight to
decode, long ones through prefill); a 1 MiB request body gives the same answer
over HTTP/1.1 and HTTP/2; h2load runs many concurrent streams on two
connections; RST_STREAM of one stream (python-h2 on a raw socket) ends that
request only while the others on the connection finish. When the gateway has
--ssl-certfile, TLS with ALPN too (a certificate made here with
`openssl req -x509`): curl and httpx over h2, curl over HTTP/1.1."""
import os, sys

try:  # Debian's python3-httpx / python3-h2; re-run under the system Python if this one lacks them
    import httpx, h2.config, h2.connection, h2.events
except ImportError:
    if os.path.exists("/usr/bin/python3") and not os.environ.get("PD_HTTP2_REEXEC"):
        os.environ["PD_HTTP2_REEXEC"] = "1"
        os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
    print("python3-httpx and python3-h2 are required (deploy/install-deps.sh installs them)")
    sys.exit(1)

import json, shutil, signal, socket, subprocess, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pdtest import (BIN, SRC, check, finish, free_port_pair, parse_sse, request, start_up, stop_up,
                    tiny_model, wait_ready)


def full(body, kind):
    r = json.loads(body)
    ch = r["choices"][0]
    return (ch["message"]["content"] if kind == "chat" else ch["text"]), r["usage"], ch["finish_reason"]


def path_of(kind):
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def curl(url, body, mode, extra=()):
    """(body bytes, http_version) with curl in mode (--http1.1, --http2, ...)."""
    out = subprocess.run(["curl", "-sS", "-N", "--max-time", "60", mode, *extra, "-w", "\n%{http_version}", url,
                          "-H", "Content-Type: application/json", "--data-binary", "@-"],
                         input=json.dumps(body).encode(), capture_output=True, timeout=90)
    check(out.returncode == 0, f"curl {mode} exit {out.returncode}: {out.stderr[-300:]!r}", True)
    data, _, ver = out.stdout.rpartition(b"\n")
    return data, ver.decode()


def one(client_name, fetch, kind, body, stream):
    data = fetch(dict(body, stream=True, stream_options={"include_usage": True}) if stream else dict(body, stream=False))
    if stream:
        r = parse_sse(data, client_name)
        return r.text, r.usage, r.finish_reason
    return full(data, kind)


def rst_stream_test(port):
    """Three streams on one raw h2 connection; RST_STREAM the middle one after
    its first data: the other two finish with [DONE]."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    s.sendall(conn.data_to_send())
    body = json.dumps({"model": "tiny", "prompt": "Tell me a story", "max_tokens": 40, "ignore_eos": True,
                       "stream": True, "temperature": 0}).encode()
    ids = []
    for _ in range(3):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "127.0.0.1"),
                                (":path", "/v1/completions"), ("content-type", "application/json"),
                                ("content-length", str(len(body)))])
        conn.send_data(sid, body, end_stream=True)
        ids.append(sid)
    s.sendall(conn.data_to_send())
    data = {i: b"" for i in ids}
    ended, reset, status = set(), set(), {}
    victim = ids[1]
    t0 = time.time()
    while len(ended | reset) < 3 and time.time() - t0 < 60:
        chunk = s.recv(65536)
        if not chunk:
            break
        for ev in conn.receive_data(chunk):
            if isinstance(ev, h2.events.ResponseReceived):
                status[ev.stream_id] = dict(ev.headers).get(b":status")
            elif isinstance(ev, h2.events.DataReceived):
                data[ev.stream_id] += ev.data
                conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                if ev.stream_id == victim and victim not in reset and b"data: {" in data[victim]:
                    conn.reset_stream(victim, error_code=8)  # CANCEL
                    reset.add(victim)
            elif isinstance(ev, h2.events.StreamEnded):
                ended.add(ev.stream_id)
            elif isinstance(ev, h2.events.StreamReset):
                reset.add(ev.stream_id)
        s.sendall(conn.data_to_send())
    conn.close_connection()
    s.sendall(conn.data_to_send())
    s.close()
    check(victim in reset and victim not in ended, "RST_STREAM: the reset stream did not finish")
    for i in (ids[0], ids[2]):
        check(status.get(i) == b"200" and i in ended and data[i].rstrip().endswith(b"data: [DONE]"),
              f"RST_STREAM: stream {i} on the same connection finished ({status.get(i)}, {data[i][-40:]!r})")


def tls_test(tmp, model):
    """A TLS gateway (no replicas needed for these calls): ALPN h2 and
    http/1.1, the same /v1/models and the same error body for a completion."""
    key, crt = os.path.join(tmp, "k.pem"), os.path.join(tmp, "c.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", crt, "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    port = free_port_pair()
    log = open(os.path.join(tmp, "tls-gateway.log"), "w")
    gw = subprocess.Popen([BIN, "gateway", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                           "--control", f"tcp://127.0.0.1:{port + 1}", "--served-model-name", "tiny",
                           "--ssl-certfile", crt, "--ssl-keyfile", key], stdout=log, stderr=log)
    try:
        url = f"https://127.0.0.1:{port}"
        ok = False
        for _ in range(100):
            r = subprocess.run(["curl", "-s", "--cacert", crt, "-o", "/dev/null", url + "/v1/models"])
            if r.returncode == 0:
                ok = True
                break
            time.sleep(0.1)
        if not check(ok, "TLS gateway answers"):
            return
        m2 = subprocess.run(["curl", "-sS", "--http2", "--cacert", crt, "-w", "\n%{http_version}", url + "/v1/models"],
                            capture_output=True).stdout
        m1 = subprocess.run(["curl", "-sS", "--http1.1", "--cacert", crt, "-w", "\n%{http_version}",
                             url + "/v1/models"], capture_output=True).stdout
        b2, _, v2 = m2.rpartition(b"\n")
        b1, _, v1 = m1.rpartition(b"\n")
        check(v2 == b"2" and v1 == b"1.1", f"TLS: ALPN h2 and http/1.1 ({v2!r}, {v1!r})")
        check(json.loads(b2)["data"][0]["id"] == "tiny" and json.loads(b1) == json.loads(b2),
              "TLS: /v1/models the same over h2 and HTTP/1.1")
        with httpx.Client(http2=True, verify=crt, timeout=30) as c:
            r = c.get(url + "/v1/models")
            check(r.http_version == "HTTP/2" and r.json() == json.loads(b2), f"TLS: httpx over {r.http_version}")
            r = c.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            check(r.status_code == 503 and r.json()["error"]["code"] == 503 and "retry-after" in r.headers,
                  f"TLS: no replica is 503 with Retry-After over h2 ({r.status_code})")
    finally:
        gw.send_signal(signal.SIGTERM)
        try:
            gw.wait(10)
        except subprocess.TimeoutExpired:
            gw.kill()


def main():
    for prog in ("curl", "node", "openssl"):
        if not shutil.which(prog):
            print(f"{prog} is required (deploy/install-deps.sh installs it)")
            sys.exit(1)
    clients = os.path.join(SRC, "tests", "clients")
    if not os.path.isdir(os.path.join(clients, "node_modules", "openai")):
        r = subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", clients],
                           capture_output=True, text=True, timeout=300)
        if not check(r.returncode == 0, f"npm install of the openai client: {r.stderr[-500:]}"):
            finish()
    tmp, model = tiny_model()
    port = free_port_pair()
    up = start_up(model, port, "--served-model-name", "tiny", "--long-prompt-threshold", "24",
                  "--chunked-prefill-size", "16", "--threads", "1", "--heartbeat-interval-ms", "200")
    base = f"http://127.0.0.1:{port}"
    try:
        run_all(tmp, model, port, base, clients, up.log)
    except Exception:
        import traceback
        check(False, "exception: " + traceback.format_exc()[-1500:])
    finally:
        stop_up(up, tail=6000)
    finish()


def run_all(tmp, model, port, base, clients, log):
    if not check(wait_ready(port, roles=("prefill", "decode")), "stack became ready"):
        return
    long_text = "Tell me everything about 東京 and Zürich, émoji 🙂, numbers 1234567 " * 4
    cases = [
        {"kind": "completions", "body": {"model": "tiny", "prompt": "Hello, world", "max_tokens": 12,
                                         "temperature": 0}},
        {"kind": "chat", "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}],
                                  "max_tokens": 12, "temperature": 0}},
        {"kind": "chat", "body": {"model": "tiny", "messages": [{"role": "user", "content": long_text}],
                                  "max_tokens": 12, "temperature": 0}},
    ]
    node = subprocess.run(["node", os.path.join(clients, "openai_client.mjs"), json.dumps(cases), base + "/v1"],
                          capture_output=True, text=True, timeout=120)
    check(node.returncode == 0, f"openai npm client: {node.stderr[-800:]}")
    js = [json.loads(l) for l in node.stdout.splitlines() if l.strip()]
    hx = httpx.Client(http1=False, http2=True, timeout=60)  # h2c with prior knowledge
    for i, c in enumerate(cases):
        kind, body = c["kind"], c["body"]
        url = base + path_of(kind)

        def via_curl(mode):
            def f(b):
                data, ver = curl(url, b, mode)
                want = "1.1" if mode == "--http1.1" else "2"
                check(ver == want, f"case {i}: curl {mode} spoke HTTP/{ver}", True)
                return data
            return f

        def via_httpx(b):
            r = hx.post(url, json=b)
            check(r.http_version == "HTTP/2" and r.status_code == 200,
                  f"case {i}: httpx {r.http_version} {r.status_code}", True)
            return r.content

        fetchers = {"curl-h1": via_curl("--http1.1"), "curl-h2-prior": via_curl("--http2-prior-knowledge"),
                    "curl-h2-upgrade": via_curl("--http2"), "httpx-h2": via_httpx}
        ref = one("curl-h1", fetchers["curl-h1"], kind, body, False)
        check(len(ref[0]) > 0 and ref[1]["completion_tokens"] == 12 and ref[2] == "length",
              f"case {i}: HTTP/1.1 answer {ref}")
        for name, f in fetchers.items():
            for stream in (False, True):
                got = one(name, f, kind, body, stream)
                check(got == ref, f"case {i}: {name}{' stream' if stream else ''} {got} == {ref}")
        if i < len(js):
            j = js[i]
            check((j["text"], j["usage"], j["finish"]) == ref and j["stream_text"] == ref[0]
                  and j["stream_usage"] == ref[1], f"case {i}: openai npm {j} == {ref}")

    # 1 MiB request body (an unknown field is accepted): the same answer
    kind, body = cases[1]["kind"], dict(cases[1]["body"], padding="x" * (1 << 20))
    ref = one("curl-h1", lambda b: curl(base + path_of(kind), b, "--http1.1")[0], kind, cases[1]["body"], False)
    r = hx.post(base + path_of(kind), json=dict(body, stream=False))
    check(r.http_version == "HTTP/2" and full(r.content, kind) == ref, "1 MiB body over httpx h2: same answer")
    big = one("curl-h2", lambda b: curl(base + path_of(kind), b, "--http2-prior-knowledge")[0], kind, body, True)
    check(big == ref, "1 MiB body over curl h2c, streamed: same answer")
    big = one("curl-h1", lambda b: curl(base + path_of(kind), b, "--http1.1")[0], kind, body, False)
    check(big == ref, "1 MiB body over HTTP/1.1: same answer")
    r = hx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": 3})
    check(r.status_code == 400 and r.json()["error"]["param"] == "temperature", "validation error over h2")
    hx.close()

    # h2load: many concurrent streams on two connections
    if shutil.which("h2load"):
        bodyf = os.path.join(tmp, "h2load.json")
        with open(bodyf, "w") as f:
            json.dump({"model": "tiny", "prompt": "Hi", "max_tokens": 4, "temperature": 0}, f)
        r = subprocess.run(["h2load", "-n", "60", "-c", "2", "-m", "12", "-d", bodyf, "-H",
                            "content-type: application/json", base + "/v1/completions"],
                           capture_output=True, text=True, timeout=120)
        good = r.returncode == 0 and "60 succeeded, 0 failed, 0 errored" in r.stdout \
            and "status codes: 60 2xx" in r.stdout
        check(good, "h2load: 60 requests, 12 concurrent streams per connection, all 200"
              + ("" if good else f": {r.stdout[-600:]}"))
    else:
        check(False, "h2load (nghttp2-client) is required (deploy/install-deps.sh installs it)")

    rst_stream_test(port)
    time.sleep(0.5)
    log.flush()
    check("client went away" in open(os.path.join(tmp, "up.log")).read(),
          "RST_STREAM: the gateway logged the aborted request")
    check(request(port, "GET", "/health")[0] == 200, "healthy after the resets")

    h = subprocess.run([BIN, "gateway", "--help"], capture_output=True, text=True)
    if "ssl-certfile" in h.stdout + h.stderr:
        tls_test(tmp, model)
    else:
        print("skip: `pdserve gateway` has no --ssl-certfile yet (TLS is covered by test_gw_h2)")


if __name__ == "__main__":
    main()

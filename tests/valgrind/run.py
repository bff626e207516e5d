#!/usr/bin/env python3
"""Valgrind memcheck of the serving path (issue 8): `pdserve gateway`,
`pdserve prefill` and `pdserve decode` each under

    valgrind --leak-check=full --errors-for-leak-kinds=definite
             --error-exitcode=99 --suppressions=tests/valgrind/pdserve.supp

with the tiny model on 127.0.0.1; a few requests go through: short
completions (straight to decode), chat, a long prompt through the prefill
replica and the KV transfer (UCX), streamed and not, a client that
disconnects mid-stream and one that disconnects while its long prompt is in
prefill, a refused request; then every
process is stopped with SIGTERM. Fails on any invalid access, use of
uninitialised memory, or definite leak that the suppressions (each
explained in pdserve.supp) do not cover, i.e. anything in our code: each
process must exit 0, and its log must show "ERROR SUMMARY: 0 errors".

    python3 tests/valgrind/run.py            # PD_BIN=build/pdserve PD_CACHE_DIR=...
    PD_VALGRIND_KEEP=1 ...                   # keep the logs (printed path)

ctest runs it as integration_test_valgrind (tests/integration/test_valgrind.py;
about 2 minutes; skipped without valgrind and in the sanitizer build).
The replicas' heartbeats are 10 s apart: under valgrind a step takes long
enough that 1 s heartbeats expired them."""
import http.client, json, os, re, shutil, signal, socket, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
from pdtest import BIN, check, failures, finish, free_port_pair, tiny_model  # noqa: E402

THRESHOLD = 16


def vg(tmp, name, args):
    log = os.path.join(tmp, f"{name}.vg.log")
    cmd = ["valgrind", "--tool=memcheck", "--leak-check=full", "--errors-for-leak-kinds=definite",
           "--show-leak-kinds=definite", "--error-exitcode=99", "--track-origins=no", "--num-callers=30",
           "--vgdb=no", f"--suppressions={os.path.join(HERE, 'pdserve.supp')}", "--gen-suppressions=all",
           f"--log-file={log}", BIN] + args
    out = open(os.path.join(tmp, f"{name}.log"), "w")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), log


def post(port, body, timeout=300):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/completions" if "prompt" in body else "/v1/chat/completions", json.dumps(body),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def disconnect_after(port, body, wait_s=None, events=None):
    """Sends a streamed request and resets the connection after `events` SSE
    events or `wait_s` seconds."""
    s = socket.create_connection(("127.0.0.1", port), timeout=300)
    raw = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
    if wait_s is not None:
        time.sleep(wait_s)
    else:
        got = b""
        while got.count(b"data: ") < events:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
    s.close()


def metric_free_blocks(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    m = c.getresponse().read().decode()
    c.close()
    return [float(l.rsplit(" ", 1)[1]) for l in m.splitlines() if l.startswith("pdserve:kv_cache_free_blocks{")]


def main():
    if not shutil.which("valgrind"):
        print("skipped: valgrind is not installed")
        return finish()
    t_start = time.time()
    tmp, model = tiny_model()
    port = free_port_pair()
    ctrl = f"tcp://127.0.0.1:{port + 1}"
    common = ["--model", model, "--gateway", ctrl, "--threads", "1", "--block-size", "4", "--num-kv-blocks", "256",
              "--heartbeat-interval-ms", "10000"]
    procs = {}
    procs["gateway"] = vg(tmp, "gateway", ["gateway", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                                          "--control", ctrl, "--served-model-name", "tiny",
                                          "--long-prompt-threshold", str(THRESHOLD), "--heartbeat-interval-ms",
                                          "10000", "--tokenizer-pool-size", "1"])
    procs["decode"] = vg(tmp, "decode", ["decode", "--replica-id", "decode-0"] + common)
    procs["prefill"] = vg(tmp, "prefill", ["prefill", "--replica-id", "prefill-0"] + common)
    try:
        up, t0 = False, time.time()
        while time.time() - t0 < 240 and not up:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                c.request("GET", "/metrics")
                m = c.getresponse().read().decode()
                up = 'replicas_alive{role="decode"} 1' in m and 'replicas_alive{role="prefill"} 1' in m
            except OSError:
                pass
            if not up:
                time.sleep(1)
        check(up, f"gateway, prefill and decode up under valgrind ({time.time() - t0:.0f} s)")
        if up:
            base = [256.0, 256.0]  # --num-kv-blocks on both replicas: everything free when idle
            st, data = post(port, {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
            check(st == 200 and b'"completion_tokens":4' in data.replace(b" ", b""), f"short completion ({st})")
            st, data = post(port, {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                   "stream": True, "stream_options": {"include_usage": True}})
            check(st == 200 and b"[DONE]" in data, f"streamed chat ({st})")
            long_ids = list(range(100, 100 + 3 * THRESHOLD))
            st, data = post(port, {"model": "tiny", "prompt": long_ids, "max_tokens": 3, "temperature": 0,
                                   "logprobs": 2})
            check(st == 200 and b'"prompt_tokens":48' in data.replace(b" ", b""),
                  f"long prompt through prefill + KV transfer ({st} {data[:160]!r})")
            st, data = post(port, {"model": "tiny", "prompt": long_ids[::-1], "max_tokens": 3, "stream": True})
            check(st == 200 and b"[DONE]" in data, f"long prompt, streamed ({st})")
            disconnect_after(port, {"model": "tiny", "prompt": "Tell me", "max_tokens": 40, "ignore_eos": True,
                                    "stream": True}, events=2)
            disconnect_after(port, {"model": "tiny", "prompt": list(range(5, 5 + 200)), "max_tokens": 8,
                                    "stream": True}, wait_s=0.3)
            st, data = post(port, {"model": "tiny", "prompt": "x" * 10, "max_tokens": 0})
            check(st == 400, f"a refused request ({st})")
            # wait until both disconnected requests released their blocks
            time.sleep(11)  # the metric comes with the 10 s heartbeats: read a fresh one
            t0, now = time.time(), None
            while time.time() - t0 < 90:
                now = metric_free_blocks(port)
                if now == base:
                    break
                time.sleep(1)
            check(now == base, f"KV blocks back at baseline after the disconnects ({base} -> {now})")
    finally:
        for name in ("prefill", "decode", "gateway"):  # replicas first, as pdserve up does
            p, _ = procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    for name, (p, log) in procs.items():
        text = open(log, errors="replace").read() if os.path.exists(log) else ""
        m = re.search(r"ERROR SUMMARY: (\d+) errors", text)
        leak = re.search(r"definitely lost: ([\d,]+) bytes", text)
        check(p.returncode == 0 and m and m.group(1) == "0",
              f"{name}: exit {p.returncode}, {m.group(0) if m else 'no summary'}, "
              f"definitely lost {leak.group(1) if leak else '0'} bytes")
        if p.returncode != 0 or not m or m.group(1) != "0":
            print(text[-6000:])
    print(f"valgrind run: {time.time() - t_start:.0f} s")
    if os.environ.get("PD_VALGRIND_KEEP") or failures:
        print("logs in", tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()

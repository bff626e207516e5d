#!/usr/bin/env python3
"""The gateway's HTTP limits, set through their flags (issue 8), real
processes on 127.0.0.1 with the tiny model. The unit tests
(gateway/tests/test_gw_http.c, test_gw_h2.c) check the behaviour through the
config fields; this checks that each flag reaches it, by `pdserve gateway`
and by `pdserve up` (which must pass the flags on to its gateway):

gateway A (`pdserve gateway`, no replica needed for these answers):
  --max-header-bytes 1024 -> 431; --max-header-count 10 -> 431;
  --max-request-body-bytes 1000 -> 413 (Content-Length 1001; 1000 is read);
  --timeout-request-headers 0.5 -> 408 for a slowloris, at ~0.5 s (HTTP/1.1, and HTTP/2
    HEADERS whose CONTINUATION never comes);
  --timeout-request-body 1 -> 408 for a body trickled a byte per 0.1 s, at ~1 s;
  --timeout-keep-alive 0.4 -> an idle connection closed at ~0.4 s;
  --max-model-len 32 -> a longer prompt is 400 naming the maximum context length.
gateway B (`pdserve up`, one decode replica):
  --max-connections 4 -> the fifth connection gets 503 naming the limit;
  --max-concurrent-streams 3 -> SETTINGS_MAX_CONCURRENT_STREAMS = 3, and a
  fourth stream opened at once is refused with RST_STREAM(REFUSED_STREAM);
  completions still work on the held connections.
Refused at start (exit 2): --max-model-len past the model's
max_position_embeddings, a negative --long-prompt-threshold."""
import json, os, shutil, socket, struct, subprocess, time

from pdtest import BIN, check, finish, free_port_pair, request, tiny_model


def wait_up(port, path="/v1/models", timeout=30):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            st, _, _ = request(port, "GET", path, timeout=2)
            if st == 200:
                return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def raw(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_response(s, timeout=5):
    """(status, body text, seconds) of one HTTP/1.1 response; the connection
    is read to its end when it says Connection: close."""
    s.settimeout(timeout)
    t0 = time.time()
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return None, data.decode(errors="replace"), time.time() - t0
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    hdr = {l.split(":", 1)[0].lower(): l.split(":", 1)[1].strip() for l in lines[1:]}
    n = int(hdr.get("content-length", "0"))
    while len(body) < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, body.decode(errors="replace"), time.time() - t0


def closed_within(s, timeout):
    """Seconds until the peer closes (reading and dropping), or None."""
    s.settimeout(timeout)
    t0 = time.time()
    try:
        while s.recv(4096):
            pass
        return time.time() - t0
    except (socket.timeout, TimeoutError):
        return None
    except ConnectionResetError:
        return time.time() - t0


def gateway_a(tmp, model):
    port = free_port_pair()
    log = open(os.path.join(tmp, "gateway-a.log"), "w")
    p = subprocess.Popen([BIN, "gateway", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                          "--control", f"tcp://127.0.0.1:{port + 1}", "--served-model-name", "tiny",
                          "--max-header-bytes", "1024", "--max-header-count", "10",
                          "--max-request-body-bytes", "1000", "--timeout-request-headers", "0.5",
                          "--timeout-request-body", "1", "--timeout-keep-alive", "0.4",
                          "--max-model-len", "32"], stdout=log, stderr=log)
    try:
        check(wait_up(port), "gateway A answers /v1/models")
        # header bytes
        s = raw(port)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Big: " + b"x" * 1100 + b"\r\n\r\n")
        st, body, _ = read_response(s)
        check(st == 431 and "--max-header-bytes (1024 bytes)" in body, f"--max-header-bytes: 431 naming it ({st} {body[:120]})")
        s.close()
        s = raw(port)  # under the limit: served
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Big: " + b"x" * 800 + b"\r\n\r\n")
        st, _, _ = read_response(s)
        check(st == 200, f"900 bytes of headers are served ({st})")
        s.close()
        # header count
        s = raw(port)
        s.sendall(b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(11)) + b"\r\n")
        st, body, _ = read_response(s)
        check(st == 431 and "--max-header-count (10)" in body, f"--max-header-count: 431 naming it ({st})")
        s.close()
        # body bytes: 1001 refused from Content-Length, 1000 read (then validated)
        s = raw(port)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1001\r\n\r\n")
        st, body, _ = read_response(s)
        check(st == 413 and "--max-request-body-bytes (1000 bytes)" in body, f"--max-request-body-bytes: 413 naming it ({st})")
        s.close()
        pad = b'{"prompt":"hi","max_tokens":1,"x":"' + b"y" * 1000
        pad = pad[:998] + b'"}'
        st, _, body = request(port, "POST", "/v1/completions", pad, timeout=10)
        check(st != 413, f"a body of exactly 1000 bytes is read ({st})")
        # prompt tokens: --max-model-len
        st, _, body = request(port, "POST", "/v1/completions", {"model": "tiny", "prompt": "hello " * 64}, timeout=10)
        check(st == 400 and b"maximum context length is 32 tokens" in body, f"--max-model-len: 400 naming the limit ({st})")
        # slowloris: a header line every 0.1 s, never the end of the headers
        s = raw(port)
        t0 = time.time()
        s.sendall(b"GET /v1/models HTTP/1.1\r\n")
        try:
            for i in range(40):
                time.sleep(0.1)
                s.sendall(b"X-%d: v\r\n" % i)
        except OSError:
            pass
        st, body, _ = read_response(s)
        dt = time.time() - t0
        check(st == 408 and "--timeout-request-headers (0.5 s)" in body and 0.45 <= dt < 2.0,
              f"slowloris: 408 after {dt:.2f} s (--timeout-request-headers 0.5)")
        # the same over HTTP/2: HEADERS without END_HEADERS, the CONTINUATION never sent
        s2 = raw(port)
        block = bytes([0x82, 0x86]) + bytes([0x04, 10]) + b"/v1/models"
        t0 = time.time()
        s2.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + h2_frame(4, 0, 0) + h2_frame(1, 0x1, 1, block))
        frames = h2_read_frames(s2, lambda fr: any(f[0] in (0, 3) and f[2] == 1 for f in fr), timeout=5)
        dt = time.time() - t0
        hdr = [f for f in frames if f[0] == 1 and f[2] == 1]
        data = b"".join(f[3] for f in frames if f[0] == 0 and f[2] == 1)
        # :status 408 as HPACK literal with the indexed name :status (0x48 = 0x40 | 8)
        check(hdr and b"\x48\x03408" in hdr[0][3] and b"--timeout-request-headers (0.5 s)" in data and 0.45 <= dt < 2.0,
              f"HTTP/2 headers that never end: 408 on the stream after {dt:.2f} s ({data[:80]!r})")
        s2.close()
        check(closed_within(s, 2) is not None, "... and the connection is closed")
        s.close()
        # a body trickled a byte per 0.1 s
        s = raw(port)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 500\r\n\r\n")
        t0 = time.time()
        try:
            for i in range(40):
                time.sleep(0.1)
                s.sendall(b" ")
        except OSError:
            pass
        st, body, _ = read_response(s)
        dt = time.time() - t0
        check(st == 408 and "--timeout-request-body (1 s)" in body and 0.95 <= dt < 2.5,
              f"trickled body: 408 after {dt:.2f} s (--timeout-request-body 1)")
        s.close()
        # idle keep-alive
        s = raw(port)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
        st, _, _ = read_response(s)
        dt = closed_within(s, 3)
        check(st == 200 and dt is not None and 0.3 <= dt < 1.5, f"idle keep-alive closed after {dt} s (--timeout-keep-alive 0.4)")
        s.close()
        # a connection that never sends a byte
        s = raw(port)
        dt = closed_within(s, 3)
        check(dt is not None and dt < 1.5, f"a silent connection closed after {dt} s")
        s.close()
        check(p.poll() is None, "gateway A is still running")
    finally:
        p.terminate()
        check(p.wait(10) == 0, "gateway A exits 0 on SIGTERM")


# ---- HTTP/2 by hand (RFC 9113 framing, RFC 7541 static-table HPACK) --------

def h2_frame(ftype, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", stream) + payload


def h2_get(stream, path, authority):
    """HEADERS(END_STREAM|END_HEADERS) for GET path: :method GET (index 2),
    :scheme http (6), :path and :authority as literals with indexed names."""
    block = bytes([0x82, 0x86]) + bytes([0x04, len(path)]) + path + bytes([0x01, len(authority)]) + authority
    return h2_frame(1, 0x5, stream, block)


def h2_read_frames(s, until, timeout=5):
    """Reads frames until until(frames) is true; frames: [(type, flags, stream, payload)]."""
    s.settimeout(timeout)
    buf, frames = b"", []
    t0 = time.time()
    while not until(frames) and time.time() - t0 < timeout:
        try:
            chunk = s.recv(65536)
        except (socket.timeout, TimeoutError):
            break
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 9:
            n = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + n:
                break
            frames.append((buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, buf[9:9 + n]))
            buf = buf[9 + n:]
    return frames


def gateway_b(tmp, model):
    port = free_port_pair()
    log = open(os.path.join(tmp, "up-b.log"), "w")
    p = subprocess.Popen([BIN, "up", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                          "--served-model-name", "tiny", "--prefill-replicas", "0", "--decode-replicas", "1",
                          "--max-connections", "4", "--max-concurrent-streams", "3", "--threads", "1"],
                         stdout=log, stderr=log)
    held = []
    try:
        check(wait_up(port, "/health", 60), "pdserve up: gateway B healthy")
        # SETTINGS_MAX_CONCURRENT_STREAMS, and a fourth stream opened at once
        s = raw(port)
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + h2_frame(4, 0, 0) +
                  b"".join(h2_get(sid, b"/v1/models", b"127.0.0.1") for sid in (1, 3, 5, 7)))

        def done(fr):
            ends = {f[2] for f in fr if (f[0] == 0 and f[1] & 1) or f[0] == 3 or (f[0] == 1 and f[1] & 1)}
            return {1, 3, 5, 7} <= ends
        frames = h2_read_frames(s, done)
        settings = {}
        for t, fl, sid, pl in frames:
            if t == 4 and not fl & 1:
                for i in range(0, len(pl), 6):
                    settings[int.from_bytes(pl[i:i + 2], "big")] = int.from_bytes(pl[i + 2:i + 6], "big")
        check(settings.get(3) == 3, f"--max-concurrent-streams 3 reaches SETTINGS ({settings})")
        refused = [sid for t, fl, sid, pl in frames if t == 3 and int.from_bytes(pl, "big") == 7]
        answered = {sid for t, fl, sid, pl in frames if t == 1}
        check(len(refused) == 1 and len(answered) == 3,
              f"4 streams at once: 3 answered {sorted(answered)}, 1 refused (REFUSED_STREAM) {refused}")
        s.close()
        time.sleep(0.2)
        # hold 4 connections (keep-alive 5 s by default), the fifth gets 503
        for i in range(4):
            c = raw(port)
            c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
            st, _, _ = read_response(c)
            check(st == 200, f"held connection {i} served", quiet_ok=True)
            held.append(c)
        c = raw(port)
        c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
        st, body, _ = read_response(c)
        check(st == 503 and "--max-connections (4)" in body, f"--max-connections 4: the fifth gets 503 naming it ({st} {body[:100]})")
        c.close()
        # the held connections still serve a completion
        req = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}).encode()
        held[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(req) + req)
        st, body, _ = read_response(held[0], 30)
        check(st == 200 and '"completion_tokens":4' in body.replace(" ", ""), f"a held connection serves a completion ({st})")
    finally:
        for c in held:
            c.close()
        p.terminate()
        check(p.wait(15) == 0, "pdserve up exits 0 on SIGTERM")


def refused_flags(model):
    """Settings the gateway refuses at start (exit 2, naming the flag): a
    --max-model-len past the model's positions (a prompt would fail on a
    replica with a 500 after prefill work) and a negative threshold."""
    for args, needle in ((["--max-model-len", "5000"], "--max-model-len 5000 is more than the model's 1024"),
                         (["--long-prompt-threshold", "-1"], "--long-prompt-threshold -1 must be >= 0")):
        r = subprocess.run([BIN, "gateway", "--model", model, "--port", str(free_port_pair()), *args],
                           capture_output=True, text=True, timeout=30)
        check(r.returncode == 2 and needle in r.stderr, f"gateway {' '.join(args)}: exit 2 naming it "
              f"({r.returncode} {r.stderr.strip()[-160:]!r})")


def main():
    tmp, model = tiny_model()
    try:
        refused_flags(model)
        gateway_a(tmp, model)
        gateway_b(tmp, model)
    finally:
        if not os.environ.get("PD_KEEP_TMP"):
            shutil.rmtree(tmp, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()

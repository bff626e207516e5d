#!/usr/bin/env python3
"""Memory per idle connection (issue 8; the full 10,000-connection run is
tests/load/gw_load.py, figures in docs/benchmarks.md): `pdserve gateway`
with the tiny model's tokenizer holds 1000 keep-alive connections that each
sent one GET /v1/models; its RSS growth divided by 1000 must stay at or
below 16 KiB per connection (a property of the code: per-connection state
allocated lazily and small, not a timing). Also: 1000 connections that
never sent a byte are held too (the keep-alive timer is 600 s here), every
held connection is still served afterwards (a sample), and the gateway
exits 0 on SIGTERM with them open."""
import os, resource, shutil, subprocess, time

from pdtest import BIN, check, finish, free_port_pair, open_idle, request, rss_kib, tiny_model

N = 1000
LIMIT = 16 * 1024


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2 * N + 256:
        print(f"skipped: open-file hard limit {hard} < {2 * N + 256}")
        return finish()
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tmp, model = tiny_model()
    port = free_port_pair()
    log = open(os.path.join(tmp, "gateway.log"), "w")
    g = subprocess.Popen([BIN, "gateway", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                          "--control", f"tcp://127.0.0.1:{port + 1}", "--served-model-name", "tiny",
                          "--timeout-keep-alive", "600", "--max-connections", str(2 * N + 10)],
                         stdout=log, stderr=log)
    try:
        t0 = time.time()
        while time.time() - t0 < 30:
            try:
                if request(port, "GET", "/v1/models", timeout=2)[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        time.sleep(0.5)
        fd0, rss0 = fds(g.pid), rss_kib(g.pid)
        t1 = time.time()
        active, left = open_idle(port, N, send_request=True, timeout=30)
        time.sleep(0.5)
        fd1, rss1 = fds(g.pid), rss_kib(g.pid)
        per = (rss1 - rss0) * 1024 / N
        check(left == 0 and fd1 - fd0 == N, f"{N} connections served once and held ({fd1 - fd0} new descriptors, "
                                            f"{time.time() - t1:.1f} s)")
        check(per <= LIMIT, f"memory per idle keep-alive connection: {per:.0f} bytes "
                            f"(RSS {rss0} -> {rss1} KiB) <= {LIMIT}")
        silent, left = open_idle(port, N, send_request=False, timeout=30)
        time.sleep(0.5)
        fd2, rss2 = fds(g.pid), rss_kib(g.pid)
        per2 = (rss2 - rss1) * 1024 / N
        check(fd2 - fd1 == N, f"{N} connections that sent nothing held ({fd2 - fd1} new descriptors)")
        check(per2 <= LIMIT, f"memory per silent connection: {per2:.0f} bytes (RSS {rss1} -> {rss2} KiB) <= {LIMIT}")
        ok = 0
        for s in active[::50] + silent[::50]:
            s.setblocking(True)
            s.settimeout(5)
            s.send(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
            ok += s.recv(65536).startswith(b"HTTP/1.1 200")
        check(ok == len(active[::50]) + len(silent[::50]), f"held connections still served: {ok}")
        st, _, _ = request(port, "GET", "/v1/models", timeout=5)
        check(st == 200, "a new connection is served with them open")
        g.terminate()
        check(g.wait(10) == 0, "the gateway exits 0 on SIGTERM with 2000 connections open")
        for s in active + silent:
            s.close()
    finally:
        if g.poll() is None:
            g.kill()
            g.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Gateway load figures for docs/benchmarks.md (issue 8). Not a ctest test
(minutes of full load on the machine); run by hand:

    python3 tests/load/gw_load.py [--bin build/pdserve] [--model DIR] [--idle 10000]
                                  [--duration 10] [--out results.json]

Phases, each against real processes on 127.0.0.1 with the tiny model
(`pdserve mkmodel --preset tiny --seed 1` unless --model):

1. `pdserve up` (one decode replica, no prefill; keep-alive 600 s so idle
   connections stay): GET /v1/models with wrk (HTTP/1.1) and h2load (h2c);
   streaming completions (max_tokens 32, ignore_eos) with h2load (many
   streams per connection) and wrk (one per connection). Requests/s; for the
   streams also streamed tokens/s and tokens per second of gateway CPU time
   (utime + stime of the gateway process from /proc/PID/stat, i.e. per
   gateway core-second).
2. N idle connections (--idle): the gateway's RSS (/proc/PID/status VmRSS)
   before, after N bare connects, and after each of them sent one
   GET /v1/models and stayed open (keep-alive); the difference / N is the
   memory per idle connection. With them held, the latency of sequential
   streaming requests is measured again and compared with before.
3. The latency the gateway adds: a gateway (PDSERVE_LOG_LEVEL=debug, so the
   router logs each request's `dispatch->first tokens` and
   `dispatch->last` intervals, timed around its ZMQ send of the Generate and
   the receipt of the Tokens) and a decode replica started separately;
   sequential and 8-concurrent streaming requests; per request, the
   client's TTFT minus the router's dispatch->first tokens, and the
   client's end-to-end time minus dispatch->last: p50 / p99.
Needs `wrk` and `h2load` (Debian packages wrk and nghttp2-client).
"""
import argparse, http.client, json, os, re, resource, subprocess
import sys, tempfile, threading, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
import pdtest  # noqa: E402
from pdtest import free_port_pair, rss_kib  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")


def cpu_s(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / HZ  # utime, stime (fields 14, 15)


def gateway_pid(up_pid):
    for _ in range(100):
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    st = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
                    cmd = open(f"/proc/{d}/cmdline").read().split("\0")
                except OSError:
                    continue
                if int(st[1]) == up_pid and len(cmd) > 1 and cmd[1] == "gateway":
                    return int(d)
        time.sleep(0.1)
    raise RuntimeError("no gateway child")


def wait_health(port, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def body(max_tokens, stream=True):
    return json.dumps({"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog",
                       "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream})


def stream_once(port, max_tokens=32):
    """(request id, TTFT s, end-to-end s, tokens) of one streamed completion."""
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/completions", body(max_tokens), {"Content-Type": "application/json"})
    r = c.getresponse()
    rid, ttft, n = None, None, 0
    while True:
        line = r.fp.readline()
        if not line:
            break
        if line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: "):
            ev = json.loads(line[6:])
            rid = rid or ev.get("id")
            if ev.get("choices") and ev["choices"][0].get("text"):
                n += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    c.close()
    return rid, ttft, e2e, n


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def run_tool(cmd, pid, tokens_per_req=0):
    """Runs wrk / h2load; returns its figures and the gateway's CPU seconds."""
    c0, t0 = cpu_s(pid), time.time()
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    c1, t1 = cpu_s(pid), time.time()
    res = {"cmd": " ".join(cmd), "gateway_cpu_s": round(c1 - c0, 3), "wall_s": round(t1 - t0, 2)}
    if cmd[0] == "wrk":
        m = re.search(r"Requests/sec:\s+([\d.]+)", out)
        res["req_s"] = float(m.group(1)) if m else None
        m = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
        res["requests"] = int(m.group(1)) if m else None
        res["non2xx"] = int(re.search(r"Non-2xx or 3xx responses: (\d+)", out).group(1)) if "Non-2xx" in out else 0
        lat = re.search(r"Latency\s+([\d.]+\w+)", out)
        res["latency_avg"] = lat.group(1) if lat else None
    else:
        m = re.search(r"finished in ([\d.]+)s, ([\d.]+) req/s", out)
        res["req_s"] = float(m.group(2)) if m else None
        if m and "-n" in cmd:
            res["wall_s"] = float(m.group(1))
        m = re.search(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed", out)
        res["requests"] = int(m.group(3)) if m else None
        res["failed"] = int(m.group(4)) if m else None
        m = re.search(r"status codes: (\d+) 2xx", out)
        res["2xx"] = int(m.group(1)) if m else None
    if tokens_per_req and res.get("requests"):
        toks = res["requests"] * tokens_per_req
        res["tokens_s"] = round(toks / res["wall_s"], 1)
        res["tokens_per_gateway_cpu_s"] = round(toks / max(res["gateway_cpu_s"], 1e-9), 0)
    if res.get("req_s") is None:
        res["output_tail"] = out[-800:]
    return res


def open_idle(port, n, send_request):
    """pdtest.open_idle, raising when a connection did not complete."""
    socks, pending = pdtest.open_idle(port, n, send_request)
    if pending:
        raise RuntimeError(f"{pending} of {n} connections did not complete")
    return socks


def phase_up(args, model, tmp, results):
    port = free_port_pair()
    log = open(os.path.join(tmp, "up.log"), "w")
    up = subprocess.Popen([args.bin, "up", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                           "--served-model-name", "tiny", "--prefill-replicas", "0", "--decode-replicas", "1",
                           "--timeout-keep-alive", "600", "--max-connections", str(args.idle + 1000),
                           "--max-concurrent-streams", "256"], stdout=log, stderr=log)
    try:
        assert wait_health(port), "stack did not come up"
        gw = gateway_pid(up.pid)
        # idle connections and the latency of active requests with them
        idle = results.setdefault("idle", {"n": args.idle})
        lat0 = [stream_once(port) for _ in range(args.latency_n)]
        rss0 = rss_kib(gw)
        socks = open_idle(port, args.idle, send_request=False)
        time.sleep(1)
        rss1 = rss_kib(gw)
        for s in socks:
            s.close()
        time.sleep(2)
        rss_mid = rss_kib(gw)
        # the first fifth fills what the heap already had free (the
        # tokenizer's load leaves megabytes of it); the rest shows the cost
        warm = args.idle // 5
        socks = open_idle(port, warm, send_request=True)
        time.sleep(1)
        rss_w = rss_kib(gw)
        socks += open_idle(port, args.idle - warm, send_request=True)
        time.sleep(1)
        rss2 = rss_kib(gw)
        lat1 = [stream_once(port) for _ in range(args.latency_n)]
        rss3 = rss_kib(gw)
        alive = sum(1 for s in socks if s.fileno() >= 0)
        idle.update({"rss_before_kib": rss0, "rss_bare_kib": rss1, "rss_after_bare_closed_kib": rss_mid,
                     "rss_after_request_kib": rss2, "rss_after_latency_kib": rss3,
                     "per_conn_bare_bytes": round((rss1 - rss0) * 1024 / args.idle),
                     "rss_after_first_fifth_kib": rss_w,
                     "per_conn_after_request_bytes": round((rss2 - rss0) * 1024 / args.idle),
                     "per_conn_after_request_marginal_bytes": round((rss2 - rss_w) * 1024 / (args.idle - warm)),
                     "held": alive})
        for name, lat in (("without_idle", lat0), ("with_idle", lat1)):
            idle[name] = {"ttft_p50_ms": round(1e3 * pct([x[1] for x in lat], 0.5), 1),
                          "ttft_p99_ms": round(1e3 * pct([x[1] for x in lat], 0.99), 1),
                          "e2e_p50_ms": round(1e3 * pct([x[2] for x in lat], 0.5), 1),
                          "e2e_p99_ms": round(1e3 * pct([x[2] for x in lat], 0.99), 1)}
        # one more request on a few of the idle connections: still served
        ok = 0
        for s in socks[:: max(1, args.idle // 20)]:
            s.setblocking(True)
            s.settimeout(5)
            s.send(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
            ok += s.recv(65536).startswith(b"HTTP/1.1 200")
        idle["sampled_still_served"] = ok
        for s in socks:
            s.close()
        print("idle", json.dumps(idle), flush=True)
        base = f"http://127.0.0.1:{port}"
        d = str(args.duration)
        r = results.setdefault("throughput", {})
        r["models_h1_wrk"] = run_tool(["wrk", "-t1", "-c32", "-d" + d + "s", base + "/v1/models"], gw)
        r["models_h2_h2load"] = run_tool(["h2load", "-D", d, "-c32", "-m10", "-t1", base + "/v1/models"], gw)
        bfile = os.path.join(tmp, "stream.json")
        open(bfile, "w").write(body(32))
        lua = os.path.join(tmp, "post.lua")
        open(lua, "w").write('wrk.method = "POST"\nwrk.body = [[' + body(32) + ']]\n'
                             'wrk.headers["Content-Type"] = "application/json"\n')
        for conc in (16, 64):
            r[f"stream_h2_{conc}"] = run_tool(["h2load", "-n", str(conc * args.stream_rounds), "-c4", "-m",
                                               str(conc // 4), "-t1", "-d", bfile,
                                               "-H", "content-type: application/json", base + "/v1/completions"],
                                              gw, tokens_per_req=32)
        r["stream_h1_wrk_32"] = run_tool(["wrk", "-t1", "-c32", "-d" + d + "s", "--timeout", "60s", "-s", lua,
                                          base + "/v1/completions"], gw, tokens_per_req=32)
        for k, v in r.items():
            print(k, json.dumps({x: y for x, y in v.items() if x != "cmd"}), flush=True)

    finally:
        up.terminate()
        up.wait(15)


def phase_latency(args, model, tmp, results):
    port = free_port_pair()
    ctrl = f"tcp://127.0.0.1:{port + 1}"
    gwlog = os.path.join(tmp, "gateway-debug.log")
    env = dict(os.environ, PDSERVE_LOG_LEVEL="debug")
    g = subprocess.Popen([args.bin, "gateway", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                          "--control", ctrl, "--served-model-name", "tiny"], stdout=open(gwlog, "w"),
                         stderr=subprocess.STDOUT, env=env)
    d = subprocess.Popen([args.bin, "decode", "--model", model, "--gateway", ctrl, "--replica-id", "decode-0"],
                         stdout=open(os.path.join(tmp, "decode.log"), "w"), stderr=subprocess.STDOUT)
    try:
        assert wait_health(port), "gateway + decode did not come up"
        stream_once(port)  # warm-up
        runs = {"sequential": [stream_once(port) for _ in range(args.latency_n)]}
        out = [None] * (args.latency_n)

        def worker(i0):
            for i in range(i0, args.latency_n, 8):
                out[i] = stream_once(port)
        th = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        runs["concurrent_8"] = out
        time.sleep(0.5)
        timing = {}
        for line in open(gwlog, errors="replace"):
            m = re.search(r"timing (\S+): queued ([\d.]+) s, dispatch->first tokens ([\d.]+) s, "
                          r"dispatch->last ([\d.]+) s", line)
            if m:
                timing[m.group(1)] = (float(m.group(2)), float(m.group(3)), float(m.group(4)))
        lat = results.setdefault("gateway_added", {})
        for name, rs in runs.items():
            ttft_add = [1e3 * (ttft - timing[rid][1]) for rid, ttft, e2e, n in rs if rid in timing]
            e2e_add = [1e3 * (e2e - timing[rid][2]) for rid, ttft, e2e, n in rs if rid in timing]
            lat[name] = {"n": len(ttft_add), "ttft_added_p50_ms": round(pct(ttft_add, 0.5), 2),
                         "ttft_added_p99_ms": round(pct(ttft_add, 0.99), 2),
                         "e2e_added_p50_ms": round(pct(e2e_add, 0.5), 2),
                         "e2e_added_p99_ms": round(pct(e2e_add, 0.99), 2),
                         "client_ttft_p50_ms": round(1e3 * pct([x[1] for x in rs], 0.5), 2),
                         "replica_first_p50_ms": round(1e3 * pct([timing[x[0]][1] for x in rs if x[0] in timing], 0.5), 2)}
        print("gateway_added", json.dumps(lat), flush=True)
    finally:
        d.terminate()
        g.terminate()
        d.wait(10)
        g.wait(10)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("PD_BIN", "build/pdserve"))
    ap.add_argument("--model")
    ap.add_argument("--idle", type=int, default=10000)
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--latency-n", type=int, default=100)
    ap.add_argument("--stream-rounds", type=int, default=8, help="h2load streams: concurrency x this many requests")
    ap.add_argument("--phases", default="up,latency")
    ap.add_argument("--out")
    args = ap.parse_args()
    # the tokenizer cache (make run fills <repo>/.cache; a worktree may point elsewhere)
    os.environ.setdefault("PD_CACHE_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".cache"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < args.idle + 256:
        sys.exit(f"the open-file hard limit {hard} is below --idle {args.idle} + 256")
    tmp = tempfile.mkdtemp()
    model = args.model
    if not model:
        model = os.path.join(tmp, "tiny")
        subprocess.run([args.bin, "mkmodel", "--preset", "tiny", "--seed", "1", "--out", model], check=True,
                       capture_output=True)
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "nproc": os.cpu_count(),
               "loadavg_start": open("/proc/loadavg").read().split()[:3]}
    try:
        if "up" in args.phases:
            phase_up(args, model, tmp, results)
        if "latency" in args.phases:
            phase_latency(args, model, tmp, results)
    finally:
        results["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
        if args.out:
            json.dump(results, open(args.out, "w"), indent=1)
        print("logs in", tmp)


if __name__ == "__main__":
    main()

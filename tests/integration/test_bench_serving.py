#!/usr/bin/env python3
"""`pdserve bench` against pdserve itself on the tiny model (`pdserve up`:
gateway, prefill and decode replicas on 127.0.0.1), kept short:

- a matrix (shapes 32/8 and 64/8 x concurrency 1 and 4 x 2 rounds, the
  64-token prompts crossing the long-prompt threshold, so both routes) has
  only successes and sane measures: TTFT, TPOT, E2E, throughput > 0, every
  completion exactly max_tokens, prompt tokens counted here equal to the
  server's usage;
- the chat endpoint (prompt length counted with the chat template);
- a rate scan at two low rates: SLO ratios computed per round;
- retrieval at 256 and 512 tokens: the document has exactly that many
  prompt tokens by the server's count, the random model scores 0/3 and
  nothing crashes.
Run by ctest (tests/integration/*.py) with PD_BIN set.
"""
import csv, json, os, socket, subprocess, sys, time, urllib.request

from pdtest import free_port_pair, temp_dir  # ports below the ephemeral range

BIN = os.environ.get("PD_BIN", "build/pdserve")
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)
    return cond


def children_of(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def stop(up):
    """Stops `pdserve up` and its replicas. The replicas run in sessions of
    their own, and `up` may sit in waitpid through a SIGTERM, so they are
    signalled directly; `up` exits once its gateway is gone."""
    kids = children_of(up.pid)
    for sig in (15, 9):
        for pid in [up.pid] + kids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            up.wait(timeout=8)
            break
        except subprocess.TimeoutExpired:
            pass
    for pid in kids:  # reap-independent: make sure none lingers
        try:
            os.kill(pid, 0)
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def speaks_h2c(port):
    """True when the server answers an HTTP/2 client preface (h2c prior
    knowledge) with a SETTINGS frame."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sk:
            sk.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            head = sk.recv(9)
            return len(head) == 9 and head[3] == 4
    except OSError:
        return False


def bench(port, model, out, *args):
    # a request the stack never finishes becomes a `timeout` failure, not a hung test
    cmd = [BIN, "bench", *args, "--base-url", f"http://127.0.0.1:{port}", "--model", model, "--out", out,
           "--quiet", "--timeout", "60"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    check("Sanitizer" not in p.stderr and "runtime error" not in p.stderr,
          f"sanitizer report from {' '.join(args[:1])}: {p.stderr[-1500:]}")
    s = None
    if os.path.exists(os.path.join(out, "summary.json")):
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
    check(s is not None, f"{args[0]}: no summary.json (rc {p.returncode}): {p.stderr[-800:]}")
    if s and p.returncode != 0 and os.path.exists(os.path.join(out, "requests.csv")):
        for r in rows(out):
            if r["outcome"] != "success":
                print(f"  {args[0]}: {r['group']} round {r['round']} #{r['index']}: {r['outcome']}: {r['detail']}")
    return p, s


def rows(out):
    with open(os.path.join(out, "requests.csv"), newline="") as f:
        return list(csv.DictReader(f))


def all_ok(s, what):
    for g in s["groups"]:
        for rd in g["rounds"]:
            check(rd["status"] == "run", f"{what} {g['name']} round {rd['round']} not run")
            check(rd["successes"] == rd["requests"],
                  f"{what} {g['name']} round {rd['round']}: {rd['successes']}/{rd['requests']} {rd['failures']}")


def main():
    tmp = temp_dir()
    model = os.path.join(tmp, "tiny")
    subprocess.run([BIN, "mkmodel", "--preset", "tiny", "--seed", "1", "--out", model], check=True,
                   capture_output=True)
    port = free_port_pair()
    log = open(os.path.join(tmp, "up.log"), "w")
    up = subprocess.Popen([BIN, "up", "--model", model, "--port", str(port), "--host", "127.0.0.1",
                           "--prefill-replicas", "1", "--decode-replicas", "1",
                           "--long-prompt-threshold", "48", "--chunked-prefill-size", "32",
                           "--heartbeat-interval-ms", "100", "--threads", "1"],
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, ready = time.time() + 60, False
        while time.time() < deadline and not ready:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    m = r.read().decode()
                ready = any(l.startswith("pdserve:replicas_alive") and 'role="prefill"' in l and
                            not l.endswith(" 0") for l in m.splitlines()) and \
                    any(l.startswith("pdserve:replicas_alive") and 'role="decode"' in l and
                        not l.endswith(" 0") for l in m.splitlines())
            except OSError:
                pass
            if not ready:
                time.sleep(0.2)
        if not check(ready, "stack became ready"):
            return

        # ---- matrix: the served name comes from /v1/models (the model path) ----
        out = os.path.join(tmp, "matrix")
        p, s = bench(port, model, out, "matrix", "--shapes", "32/8,64/8", "--concurrency", "1,4",
                     "--requests", "4", "--rounds", "2", "--warmup", "1")
        if s:
            check(p.returncode == 0, f"matrix rc {p.returncode}: {p.stderr[-500:]}")
            check(s["model"] == model, f"served name from /v1/models: {s['model']}")
            check(s["prompts"] == "text", f"prompts sent as {s['prompts']}")
            check(s["http_versions"]["1.1"] == 2 * 2 * 2 * 4, f"HTTP/1.1 by default: {s['http_versions']}")
            check(len(s["groups"]) == 4 and s["not_run"] == [], "4 groups, all run")
            all_ok(s, "matrix")
            for g in s["groups"]:
                for rd in g["rounds"]:
                    check(rd["ttft_s"]["p50"] > 0 and rd["ttft_s"]["p95"] >= rd["ttft_s"]["p50"],
                          f"{g['name']} TTFT {rd['ttft_s']}")
                    check(rd["tpot_s"]["p50"] > 0 and rd["e2e_s"]["p50"] > rd["ttft_s"]["p50"] * 0.99,
                          f"{g['name']} TPOT/E2E {rd['tpot_s']} {rd['e2e_s']}")
                    check(rd["throughput_tok_s"] > 0 and rd["output_tokens"] == 4 * 8,
                          f"{g['name']} throughput {rd['throughput_tok_s']} tokens {rd['output_tokens']}")
                    check(rd["prompt_tokens_local"] == g["input_tokens"] == rd["prompt_tokens_server"]
                          and rd["prompt_tokens_mismatch"] == 0,
                          f"{g['name']} prompt tokens {rd['prompt_tokens_local']} / {rd['prompt_tokens_server']}")
                med = g["median_over_rounds"]
                check(g["min_over_rounds"]["throughput_tok_s"] <= med["throughput_tok_s"] <=
                      g["max_over_rounds"]["throughput_tok_s"], f"{g['name']} min <= median <= max")
            for r in rows(out):
                check(r["completion_tokens"] == "8" and r["outcome"] == "success",
                      f"request {r['group']} {r['round']}/{r['index']}: {r['outcome']} {r['completion_tokens']}")
            with open(os.path.join(out, "report.html")) as f:
                html = f.read()
            check(html.count("<svg") == 6, "3 charts per shape")
            with open(os.path.join(out, "rounds.csv")) as f:
                check(len(f.read().strip().splitlines()) == 1 + 8, "rounds.csv: 8 rounds")

        # ---- chat endpoint ----
        out = os.path.join(tmp, "chat")
        p, s = bench(port, model, out, "matrix", "--endpoint", "chat", "--shapes", "40/6",
                     "--concurrency", "2", "--requests", "2", "--rounds", "1", "--warmup", "0")
        if s:
            check(p.returncode == 0, f"chat rc {p.returncode}")
            all_ok(s, "chat")
            rd = s["groups"][0]["rounds"][0]
            check(rd["prompt_tokens_server"] == 40 and rd["prompt_tokens_mismatch"] == 0,
                  f"chat prompt tokens {rd['prompt_tokens_server']}")

        # ---- HTTP/2 (h2c prior knowledge), when the gateway speaks it ----
        if speaks_h2c(port):
            out = os.path.join(tmp, "h2")
            p, s = bench(port, model, out, "matrix", "--http2", "--shapes", "32/6", "--concurrency", "4",
                         "--requests", "8", "--rounds", "1", "--warmup", "0")
            if s:
                check(p.returncode == 0 and s["http"] == "2", f"http2 rc {p.returncode}")
                check(s["http_versions"]["2"] == 8 and s["http_versions"]["1.1"] == 0,
                      f"answered over {s['http_versions']}")
                all_ok(s, "http2")
        else:
            print("gateway does not speak h2c: --http2 not exercised", flush=True)

        # ---- rate scan ----
        out = os.path.join(tmp, "rate")
        p, s = bench(port, model, out, "rate", "--shapes", "32/4", "--rates", "4,8", "--requests", "4",
                     "--rounds", "2", "--slo-ttft", "10", "--slo-tpot", "5")
        if s:
            check(p.returncode == 0, f"rate rc {p.returncode}")
            all_ok(s, "rate")
            check([g["rate"] for g in s["groups"]] == [4, 8], "rates")
            for g in s["groups"]:
                for rd in g["rounds"]:
                    slo = rd.get("slo") or {}
                    check(slo.get("ratio") == slo.get("compliant", -1) / 4 and slo.get("ratio") == 1.0,
                          f"{g['name']} SLO {slo}")
                check(g["median_over_rounds"]["slo_ratio"] == 1.0, f"{g['name']} median SLO")
            with open(os.path.join(out, "report.html")) as f:
                check("SLO compliance" in f.read(), "rate report has the SLO chart")

        # ---- retrieval ----
        out = os.path.join(tmp, "retrieval")
        p, s = bench(port, model, out, "retrieval", "--tokens", "256,512", "--max-tokens", "8")
        if s:
            check(p.returncode in (0, 1), f"retrieval rc {p.returncode}: {p.stderr[-300:]}")
            for g, n in zip(s["groups"], (256, 512)):
                rd = g["rounds"][0]
                check(rd["requests"] == 1, f"retrieval {n}: requests")
                check(rd["prompt_tokens_local"] == n, f"retrieval {n}: document {rd['prompt_tokens_local']} tokens")
                if rd["successes"] == 1:
                    check(rd["prompt_tokens_server"] == n and rd["prompt_tokens_mismatch"] == 0,
                          f"retrieval {n}: server counted {rd['prompt_tokens_server']}")
                check(rd.get("retrieval") == {"score": 0, "max": 3}, f"retrieval {n}: {rd.get('retrieval')}")
    finally:
        stop(up)
    if failures:
        print(f"{len(failures)} failure(s)")
        with open(os.path.join(tmp, "up.log")) as f:
            print(f.read()[-2000:])
        sys.exit(1)
    print("test_bench_serving: OK")


if __name__ == "__main__":
    main()
    if failures:  # main returned early (the stack never became ready): that is a failure too
        print(f"{len(failures)} failure(s)")
        sys.exit(1)

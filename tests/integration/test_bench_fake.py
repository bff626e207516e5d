#!/usr/bin/env python3
"""`pdserve bench` against a server that misbehaves on purpose
(tests/bench/fake_server.py): every strictness rule catches its case, and
summary.json counts it under the right reason.

- one matrix round at concurrency 1 meets, in order: a good answer, HTTP 200
  with empty text, no [DONE], one token short, bad usage, no usage, an error
  object in the stream, an `event: error`, a malformed event, a dropped
  connection, invalid UTF-8, a slow first token (timeout), HTTP 500 and 429;
  each request's class is checked in requests.csv, the counts in
  summary.json, the raw answers under failed/;
- the same over /v1/chat/completions;
- a phase stops after --stop-after-failed-rounds consecutive failed rounds
  (matrix and rate), and summary.json lists the rounds not run;
- functional checks pass against correct answers and fail against wrong
  ones, with the exit status saying so;
- retrieval scores 3/3 against a server that reads the codes out of the
  document and 0/3 against one that does not.
Run by ctest (tests/integration/*.py) with PD_BIN set.
"""
import csv, json, os, socket, subprocess, sys, time

from pdtest import free_port_pair, temp_dir

BIN = os.environ.get("PD_BIN", "build/pdserve")
SRC = os.environ.get("PD_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
CACHE = os.environ.get("PD_CACHE_DIR", os.path.join(SRC, ".cache"))
TOKENIZER = os.path.join(CACHE, "tokenizer-deepseek_v3", "tokenizer.json")
REASONS = ["http_status", "empty_text", "no_done", "wrong_length", "bad_usage", "sse_error",
           "invalid_utf8", "disconnect", "timeout"]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)
    return cond


def free_port():
    return free_port_pair()  # pdtest's: a port below the ephemeral range (its neighbour free too, unused here)


def bench(port, out, *args):
    cmd = [BIN, "bench", *args, "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", TOKENIZER,
           "--out", out, "--quiet"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    check("Sanitizer" not in p.stderr and "runtime error" not in p.stderr,
          f"sanitizer report from {' '.join(args[:1])}: {p.stderr[-1500:]}")
    summary = None
    if os.path.exists(os.path.join(out, "summary.json")):
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
    return p, summary


def rows(out):
    with open(os.path.join(out, "requests.csv"), newline="") as f:
        return list(csv.DictReader(f))


# mode of the fake server -> the reason pdserve bench must report
MIX = [("ok", "success"), ("empty", "empty_text"), ("no_done", "no_done"),
       ("wrong_length", "wrong_length"), ("bad_usage", "bad_usage"), ("no_usage", "bad_usage"),
       ("sse_error", "sse_error"), ("event_error", "sse_error"), ("malformed", "sse_error"),
       ("disconnect", "disconnect"), ("invalid_utf8", "invalid_utf8"), ("timeout", "timeout"),
       ("http_500", "http_status"), ("http_429", "http_status"), ("not_sse", "sse_error")]


def check_mix(port, tmp, endpoint):
    out = os.path.join(tmp, "mix-" + endpoint)
    model = "mix:" + ",".join(m for m, _ in MIX)  # the server counts per model string
    p, s = bench(port, out, "matrix", "--served-model-name", model, "--endpoint", endpoint,
                 "--shapes", "40/4", "--concurrency", "1", "--requests", str(len(MIX)),
                 "--rounds", "1", "--warmup", "0", "--timeout", "1")
    if not check(s is not None, f"{endpoint}: no summary.json: {p.stderr[-800:]}"):
        return
    check(p.returncode == 1, f"{endpoint}: exit status {p.returncode} with failures, expected 1")
    rd = s["groups"][0]["rounds"][0]
    want = {r: 0 for r in REASONS}
    for _, reason in MIX:
        if reason != "success":
            want[reason] += 1
    check(rd["requests"] == len(MIX), f"{endpoint}: requests {rd['requests']}")
    check(rd["successes"] == 1, f"{endpoint}: successes {rd['successes']}")
    check(rd["failures"] == want, f"{endpoint}: failures {rd['failures']} != {want}")
    check(s["totals"]["failures"] == want, f"{endpoint}: totals {s['totals']}")
    check(rd["output_tokens"] == 4, f"{endpoint}: only the good answer's tokens count: {rd['output_tokens']}")
    got = rows(out)
    check(len(got) == len(MIX), f"{endpoint}: {len(got)} rows in requests.csv")
    for (mode, reason), row in zip(MIX, got):
        check(row["outcome"] == reason, f"{endpoint}: mode {mode}: outcome {row['outcome']} "
                                        f"({row['detail']}), expected {reason}")
        if reason != "success":
            path = os.path.join(out, "failed", "g000-r1-%05d.sse" % int(row["index"]))
            if check(os.path.exists(path), f"{endpoint}: {path} missing"):
                with open(path, "rb") as f:
                    raw = f.read()
                check(raw.startswith(b": pdserve bench failed request") and reason.encode() in raw,
                      f"{endpoint}: {path} header")
                if mode == "invalid_utf8":
                    check(b"\xff\xfe" in raw, f"{endpoint}: the raw invalid bytes are kept")
                if mode == "sse_error":
                    check(b"engine crashed" in raw, f"{endpoint}: the raw error event is kept")
    good = got[0]
    check(float(good["ttft_s"]) > 0 and float(good["tpot_s"]) > 0,
          f"{endpoint}: TTFT/TPOT of the good answer {good['ttft_s']} {good['tpot_s']}")
    check(int(good["completion_tokens"]) == 4, f"{endpoint}: completion tokens {good['completion_tokens']}")
    with open(os.path.join(out, "report.html")) as f:
        html = f.read()
    check("<svg" in html and "failed/" in html, f"{endpoint}: report.html has charts and failures")


def main():
    tmp = temp_dir()
    port = free_port()
    srv = subprocess.Popen([sys.executable, os.path.join(SRC, "tests", "bench", "fake_server.py"), str(port)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        check(srv.stdout.readline().strip() == "ready", "fake server started")
        check_mix(port, tmp, "completions")
        # chat: another model string, so the server's counter starts again
        out = os.path.join(tmp, "chat")
        chat_mix = [("ok", "success"), ("empty", "empty_text"), ("no_done", "no_done"),
                    ("invalid_utf8", "invalid_utf8"), ("sse_error", "sse_error"),
                    ("wrong_length", "wrong_length"), ("disconnect", "disconnect")]
        p, s = bench(port, out, "matrix", "--served-model-name", "mix:" + ",".join(m for m, _ in chat_mix),
                     "--endpoint", "chat", "--shapes", "40/4", "--concurrency", "1", "--requests",
                     str(len(chat_mix)), "--rounds", "1", "--warmup", "0", "--timeout", "5")
        if check(s is not None, f"chat: no summary: {p.stderr[-500:]}"):
            got = [r["outcome"] for r in rows(out)]
            check(got == [r for _, r in chat_mix], f"chat outcomes {got}")
            check(rows(out)[0]["prompt_tokens_local"] == "40", "chat prompt counted with the template")

        # all good: exit 0, every measure sane
        out = os.path.join(tmp, "ok")
        p, s = bench(port, out, "matrix", "--served-model-name", "ok", "--shapes", "64/8,16/2",
                     "--concurrency", "1,3", "--requests", "3", "--rounds", "2")
        if check(s is not None and p.returncode == 0, f"ok run: rc {p.returncode} {p.stderr[-500:]}"):
            check(len(s["groups"]) == 4, "2 shapes x 2 concurrencies")
            for g in s["groups"]:
                for rd in g["rounds"]:
                    check(rd["successes"] == 3 and rd["ttft_s"]["p50"] > 0 and rd["throughput_tok_s"] > 0,
                          f"ok run {g['name']}: {rd}")
                    check(rd["output_tokens"] == 3 * g["output_tokens"], f"ok run tokens {g['name']}")
            warm = [r for r in rows(out) if r["round"] == "0"]
            check(len(warm) == 1 + 3 + 1 + 3, f"warm-up rows (concurrency each): {len(warm)}")
            check(s["prompts"] == "text", f"prompts {s['prompts']}")

        # a phase stops after N consecutive failed rounds; the rest is "not run"
        out = os.path.join(tmp, "stop")
        p, s = bench(port, out, "matrix", "--served-model-name", "no_done", "--shapes", "16/2,24/2",
                     "--concurrency", "1,2", "--requests", "1", "--rounds", "2", "--warmup", "0",
                     "--stop-after-failed-rounds", "3")
        if check(s is not None, "stop: summary"):
            nr = [(x["group"], x["round"]) for x in s["not_run"]]
            check(nr == [("16/2 c=2", 2), ("24/2 c=2", 2)], f"matrix not run: {nr}")
            check(s["totals"]["failures"]["no_done"] == 6, f"stop totals {s['totals']}")
        out = os.path.join(tmp, "rate-stop")
        p, s = bench(port, out, "rate", "--served-model-name", "mix:ok,empty", "--shapes", "16/2",
                     "--rates", "20,40", "--requests", "2", "--rounds", "2", "--warmup", "0",
                     "--stop-after-failed-rounds", "2", "--slo-ttft", "5", "--slo-tpot", "1")
        if check(s is not None, "rate stop: summary"):
            nr = [(x["group"], x["round"]) for x in s["not_run"]]
            check(nr == [("16/2 rate=40", 1), ("16/2 rate=40", 2)], f"rate not run: {nr}")
            rd = s["groups"][0]["rounds"][0]
            check(rd["slo"]["ratio"] == 0.5 and rd["slo"]["compliant"] == 1,
                  f"a failure is non-compliant: {rd.get('slo')}")

        # functional: right answers pass, wrong answers fail
        out = os.path.join(tmp, "fn-smart")
        p, s = bench(port, out, "functional", "--served-model-name", "smart", "--repeat", "2")
        if check(s is not None, f"functional: {p.stderr[-500:]}"):
            check(p.returncode == 0, f"functional smart rc {p.returncode}: {s['checks']}")
            check(len(s["checks"]) == 5 and all(c["passes"] == 2 for c in s["checks"]),
                  f"functional smart: {s['checks']}")
            check(s["totals"]["requests"] == 2 * 8 and s["totals"]["successes"] == 16, f"{s['totals']}")
        out = os.path.join(tmp, "fn-ok")
        p, s = bench(port, out, "functional", "--served-model-name", "ok", "--repeat", "1")
        if check(s is not None, "functional ok: summary"):
            check(p.returncode == 1, f"functional wrong answers rc {p.returncode}")
            passed = {c["name"]: c["passes"] for c in s["checks"]}
            check(passed == {"integer_answer": 0, "json_extraction": 0, "multi_turn_memory": 0,
                             "stream_equals_nonstream": 1, "tool_call_round_trip": 0}, f"{passed}")

        # retrieval: a server that reads the document scores 3/3, one that does not 0/3
        for model, score in (("smart", 3), ("ok", 0)):
            out = os.path.join(tmp, "retrieval-" + model)
            p, s = bench(port, out, "retrieval", "--served-model-name", model, "--tokens", "300,5000",
                         "--rounds", "2")
            if check(s is not None and p.returncode == 0, f"retrieval {model}: rc {p.returncode} {p.stderr[-300:]}"):
                for g, n in zip(s["groups"], (300, 5000)):
                    for rd in g["rounds"]:
                        check(rd["retrieval"] == {"score": score, "max": 3} and rd["prompt_tokens_local"] == n,
                              f"retrieval {model} {n}: {rd.get('retrieval')} {rd['prompt_tokens_local']}")
                    check(g["median_over_rounds"]["score"] == score, f"retrieval {model} median score")

        # no server: setup error, exit 2
        p, s = bench(free_port(), os.path.join(tmp, "down"), "matrix", "--shapes", "16/2")
        check(p.returncode == 2 and "is the server up" in p.stderr, f"no server: {p.returncode} {p.stderr}")
    finally:
        srv.kill()
        srv.wait()
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("test_bench_fake: OK")


if __name__ == "__main__":
    main()

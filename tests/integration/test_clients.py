#!/usr/bin/env python3
"""Real clients against `pdserve up` (tiny model) get identical content:
curl (JSON and SSE), Python's http.client, and the official `openai` npm
package (chat and completions, streaming and not), over both routes (short
prompts straight to decode, long ones through prefill + UCX). Every SSE
event must be strict UTF-8 JSON, the concatenated stream must equal the
non-streamed text, and usage must agree."""
import http.client, json, os, shutil, subprocess, sys

from pdtest import SRC, check, finish, free_port_pair, parse_sse, start_up, stop_up, tiny_model, wait_ready


def curl(port, kind, body, stream):
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    b = dict(body, stream=stream)
    if stream:
        b["stream_options"] = {"include_usage": True}
    out = subprocess.run(["curl", "-sS", "-N", "--max-time", "60", f"http://127.0.0.1:{port}{path}",
                          "-H", "Content-Type: application/json", "-d", json.dumps(b)], capture_output=True, timeout=90)
    check(out.returncode == 0, f"curl exit {out.returncode}: {out.stderr!r}")
    if stream:
        r = parse_sse(out.stdout, f"curl {kind}")
        return r.text, r.usage
    r = json.loads(out.stdout)
    ch = r["choices"][0]
    return (ch["message"]["content"] if kind == "chat" else ch["text"]), r["usage"]


def main():
    if not shutil.which("curl") or not shutil.which("node"):
        print("curl and node are required (deploy/install-deps.sh installs them)")
        sys.exit(1)
    clients = os.path.join(SRC, "tests", "clients")
    if not os.path.isdir(os.path.join(clients, "node_modules", "openai")):
        r = subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", clients],
                           capture_output=True, text=True, timeout=300)
        if not check(r.returncode == 0, f"npm install of the openai client: {r.stderr[-500:]}"):
            sys.exit(1)
    _, model = tiny_model()
    port = free_port_pair()
    up = start_up(model, port, "--served-model-name", "tiny", "--long-prompt-threshold", "24",
                  "--chunked-prefill-size", "16", "--threads", "1", "--heartbeat-interval-ms", "200")
    try:
        if not check(wait_ready(port, roles=("prefill", "decode")), "stack became ready"):
            finish()  # stop_up runs on the way out
        long_text = "Tell me everything about 東京 and Zürich, émoji 🙂, numbers 1234567 " * 4
        cases = [
            {"kind": "completions", "body": {"model": "tiny", "prompt": "Hello, world", "max_tokens": 12, "temperature": 0}},
            {"kind": "completions", "body": {"model": "tiny", "prompt": long_text, "max_tokens": 12, "temperature": 0}},
            {"kind": "chat", "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}],
                                      "max_tokens": 12, "temperature": 0}},
            {"kind": "chat", "body": {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": long_text}],
                                      "max_tokens": 12, "temperature": 0}},
        ]
        node = subprocess.run(["node", os.path.join(clients, "openai_client.mjs"), json.dumps(cases),
                               f"http://127.0.0.1:{port}/v1"], capture_output=True, text=True, timeout=120)
        check(node.returncode == 0, f"openai npm client failed: {node.stderr[-1000:]}")
        js = [json.loads(l) for l in node.stdout.splitlines() if l.strip()]
        check(len(js) == len(cases), f"openai client answered {len(js)} of {len(cases)} cases")
        for i, c in enumerate(cases):
            text, usage = curl(port, c["kind"], c["body"], False)
            stext, susage = curl(port, c["kind"], c["body"], True)
            check(len(text) > 0 and usage["completion_tokens"] == 12, f"case {i}: curl text {text!r} usage {usage}")
            check(stext == text, f"case {i}: curl stream {stext!r} != {text!r}")
            check(susage == usage, f"case {i}: curl stream usage {susage} != {usage}")
            if i < len(js):
                j = js[i]
                check(j["text"] == text, f"case {i}: openai {j['text']!r} != curl {text!r}")
                check(j["stream_text"] == text, f"case {i}: openai stream {j['stream_text']!r} != {text!r}")
                check(j["usage"] == usage and j.get("stream_usage") == usage,
                      f"case {i}: openai usage {j['usage']} / {j.get('stream_usage')} != {usage}")
                check(j["finish"] == "length", f"case {i}: finish {j['finish']}")
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/metrics")
        m = c.getresponse().read().decode()
        check('pdserve:requests_routed_total{class="long"} 0' not in m, "some requests took the long route")
    finally:
        stop_up(up, tail=4000)
    finish()


if __name__ == "__main__":
    main()

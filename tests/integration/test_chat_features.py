#!/usr/bin/env python3
"""Chat features end to end (issue 9): reasoning separation and tool calls,
through the gateway, the router and real replicas on the tiny model, whose
output is scripted: the replicas run with --debug-replay-tokens (a request
with seed s generates script s mod n, then EOS), so the DeepSeek formats go
through detokenization, the parsers and the response shapes without a
trained model. Scripts are texts tokenized by `pdserve tokenize`.

Checks:
- thinking on (chat_template_kwargs.thinking): reasoning_content and
  reasoning hold the text before </think>, content the rest; streamed
  reasoning / content deltas concatenate to the same; thinking cut by
  max_tokens: content null; reasoning_effort "low" (thinking off): the
  same script is all content;
- tools with the V3 tool-call format: tool_calls (call_ ids, type function,
  names, arguments as JSON strings), content null, finish_reason
  tool_calls; streamed: per-index deltas whose concatenated arguments equal
  the non-streamed ones, finish_reason tool_calls; both routes (the tool
  prompt is long: prefill replica; the first token comes from its replay);
- malformed call (bad JSON arguments) and tool_choice none: the text as
  generated, finish_reason stop;
- tool_choice named / required: decoding is constrained by the grammar to
  the arguments object / an array of {name, parameters}, and that JSON
  answer becomes the call(s) (named streamed too);
- a tool-result round trip: prompt_tokens is the token count of the
  documented rendering (docs/api.md) of the conversation;
- validation: 400 with `param` for bad tools / tool_choice / reasoning_effort;
- the official `openai` npm client (when installed, as test_clients.py
  uses it) reads the same calls and reasoning, streamed and not;
- --tool-call-parser deepseek_dsml (a second stack): DSML calls parsed.
Run by ctest (tests/integration/*.py) with PD_BIN set.
"""
import http.client, json, os, shutil, signal, subprocess, time

from pdtest import BIN, SRC, check, finish, free_port_pair, metric, metrics, request, tiny_model

THRESHOLD = 48
CALLS, CALLE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

REASONING, ANSWER = "Let me think: 2 + 2 is 4.", "The answer is 4."
V3_CALLS = (CALLS + CB + "function" + SEP + "get_weather\n```json\n{\"city\": \"Paris\", \"days\": 3}\n```" + CE +
            "\n" + CB + "function" + SEP + "get_time\n```json\n{\"tz\": \"Europe/Paris\"}\n```" + CE + CALLE)
BAD_CALL = CALLS + CB + "function" + SEP + "get_weather\n```json\n{bad json\n```" + CE + CALLE
NAMED_JSON = "{\"city\": \"Oslo\"}"
DSML = ("<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
        "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜function_calls>")
REQUIRED_JSON = "[{\"name\": \"get_time\", \"parameters\": {\"tz\": \"UTC\"}}]"
SCRIPTS = [REASONING + "</think>" + ANSWER, V3_CALLS, BAD_CALL, NAMED_JSON, DSML, REQUIRED_JSON]
SEED = {"reasoning": 0, "v3": 1, "bad": 2, "named": 3, "dsml": 4, "required": 5}

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                           "parameters": {"type": "object",
                                                          "properties": {"tz": {"type": "string"}}}}}]


def tokenize(model, text):
    out = subprocess.run([BIN, "tokenize", "--tokenizer", os.path.join(model, "tokenizer.json"), "--text", text],
                         check=True, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def start(tmp, model, replay, extra, name):
    port = free_port_pair()
    log = open(os.path.join(tmp, name + ".log"), "w")
    up = subprocess.Popen([BIN, "up", "--model", model, "--port", str(port), "--host", "127.0.0.1",
                           "--served-model-name", "tiny", "--prefill-replicas", "1", "--decode-replicas", "1",
                           "--long-prompt-threshold", str(THRESHOLD), "--chunked-prefill-size", "64",
                           "--block-size", "16", "--num-kv-blocks", "256", "--heartbeat-interval-ms", "500",
                           "--threads", "1", "--debug-replay-tokens", replay] + extra,
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            st, _, _ = request(port, "GET", "/health", timeout=10)
            if st == 200 and metric(metrics(port), "pdserve:replicas_alive", role="prefill") >= 1:
                return up, port
        except OSError:
            pass
        time.sleep(0.2)
    check(False, f"{name}: stack became ready")
    return up, None


def stop(up):
    try:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(timeout=20)
    except Exception:
        os.killpg(up.pid, signal.SIGKILL)


def chat(port, body, want=200):
    st, _, data = request(port, "POST", "/v1/chat/completions", dict(body, model="tiny"), 60)
    if not check(st == want, f"status {st} (want {want}): {data[:300]!r}", quiet_ok=True):
        return None
    return json.loads(data)


def chat_stream(port, body):
    """The streamed choice 0 assembled: content, reasoning_content, reasoning,
    tool_calls by index (arguments concatenated), finish_reason, and the
    number of chunks that carried argument pieces."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/chat/completions", json.dumps(dict(body, model="tiny", stream=True)),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    check(r.status == 200, f"stream: status {r.status}", quiet_ok=True)
    raw = r.read()
    c.close()
    out = {"content": "", "reasoning_content": "", "reasoning": "", "tool_calls": {}, "finish_reason": None}
    for block in raw.split(b"\n\n"):
        if not block.startswith(b"data: ") or block == b"data: [DONE]":
            continue
        for ch in json.loads(block[6:].decode()).get("choices", []):
            d = ch.get("delta", {})
            for k in ("content", "reasoning_content", "reasoning"):
                if d.get(k):
                    out[k] += d[k]
            for tc in d.get("tool_calls") or []:
                acc = out["tool_calls"].setdefault(tc["index"], {"id": None, "type": None, "name": "",
                                                                  "arguments": ""})
                acc["id"] = tc.get("id") or acc["id"]
                acc["type"] = tc.get("type") or acc["type"]
                fn = tc.get("function") or {}
                acc["name"] += fn.get("name") or ""
                acc["arguments"] += fn.get("arguments") or ""
            if ch.get("finish_reason"):
                out["finish_reason"] = ch["finish_reason"]
    return out


def user(text):
    return [{"role": "user", "content": text}]


def test_reasoning(port):
    body = {"messages": user("What is 2 + 2?"), "seed": SEED["reasoning"], "max_tokens": 64,
            "chat_template_kwargs": {"thinking": True}}
    r = chat(port, body)
    if r:
        m = r["choices"][0]["message"]
        check(m.get("reasoning_content") == REASONING, f"reasoning_content {m.get('reasoning_content')!r}")
        check(m.get("reasoning") == REASONING, "reasoning (newer name) == reasoning_content")
        check(m.get("content") == ANSWER, f"content after </think>: {m.get('content')!r}")
        check(r["choices"][0]["finish_reason"] == "stop", "reasoning: finish_reason stop")
    s = chat_stream(port, body)
    check(s["reasoning_content"] == REASONING and s["reasoning"] == REASONING,
          f"streamed reasoning deltas concatenate to the reasoning ({s['reasoning_content']!r})")
    check(s["content"] == ANSWER, f"streamed content deltas: {s['content']!r}")
    # thinking cut by max_tokens: all reasoning, no answer text: content null (vLLM's reasoning parsers)
    r = chat(port, dict(body, max_tokens=4))
    if r:
        m = r["choices"][0]["message"]
        check(m.get("content", "absent") is None and m.get("reasoning_content") and
              REASONING.startswith(m["reasoning_content"]) and r["choices"][0]["finish_reason"] == "length",
              f"thinking only (max_tokens 4): content null, the reasoning so far, finish_reason length: {m!r}")
    r = chat(port, dict(body, chat_template_kwargs=None, reasoning_effort="low"))
    if r:
        m = r["choices"][0]["message"]
        check(m.get("content") == SCRIPTS[0] and m.get("reasoning_content") is None,
              "reasoning_effort low (thinking off): all of the output is content")
    r = chat(port, dict(body, chat_template_kwargs=None, reasoning_effort="high"))
    if r:
        check(r["choices"][0]["message"].get("reasoning_content") == REASONING,
              "reasoning_effort high: thinking on")


def test_tool_calls(port):
    body = {"messages": user("Weather and time in Paris?"), "seed": SEED["v3"], "max_tokens": 128,
            "tools": TOOLS}
    r = chat(port, body)
    want = [("get_weather", "{\"city\": \"Paris\", \"days\": 3}"), ("get_time", "{\"tz\": \"Europe/Paris\"}")]
    if r:
        c = r["choices"][0]
        calls = c["message"].get("tool_calls") or []
        check([(t["function"]["name"], t["function"]["arguments"]) for t in calls] == want,
              f"tool_calls names and arguments ({calls})")
        check(all(t["type"] == "function" and t["id"].startswith("call_") for t in calls),
              "tool_calls: type function, id call_…")
        check(len({t["id"] for t in calls}) == len(calls), "tool call ids are distinct")
        check(all(json.loads(t["function"]["arguments"]) for t in calls), "arguments parse as JSON")
        check(c["message"]["content"] is None, "content null with tool calls")
        check(c["finish_reason"] == "tool_calls", f"finish_reason tool_calls ({c['finish_reason']})")
        check(r["usage"]["prompt_tokens"] > THRESHOLD, "the tool prompt took the long route (prefill replica)")
        s = chat_stream(port, body)
        got = [(s["tool_calls"][i]["name"], s["tool_calls"][i]["arguments"]) for i in sorted(s["tool_calls"])]
        check(got == [(t["function"]["name"], t["function"]["arguments"]) for t in calls],
              f"streamed tool_calls deltas concatenate to the non-streamed calls ({got})")
        check(all(v["id"] and v["id"].startswith("call_") and v["type"] == "function"
                  for v in s["tool_calls"].values()), "streamed calls carry id and type")
        check(s["finish_reason"] == "tool_calls", "streamed finish_reason tool_calls")
        check(s["content"] == "", f"no streamed content ({s['content']!r})")
        return calls
    return None


def test_text_cases(port):
    r = chat(port, {"messages": user("x"), "seed": SEED["bad"], "max_tokens": 64, "tools": TOOLS})
    if r:
        c = r["choices"][0]
        check(c["message"]["content"] == BAD_CALL and not c["message"].get("tool_calls"),
              "malformed call (bad JSON arguments): the text as generated")
        check(c["finish_reason"] == "stop", "malformed call: finish_reason stop")
    s = chat_stream(port, {"messages": user("x"), "seed": SEED["bad"], "max_tokens": 64, "tools": TOOLS})
    check(s["content"] == BAD_CALL and not s["tool_calls"], "malformed call streamed: the text")
    r = chat(port, {"messages": user("x"), "seed": SEED["v3"], "max_tokens": 128, "tools": TOOLS,
                    "tool_choice": "none"})
    if r:
        check(r["choices"][0]["message"]["content"] == V3_CALLS and r["choices"][0]["finish_reason"] == "stop",
              "tool_choice none: calls are not parsed")
    named = {"messages": user("Weather in Oslo?"), "seed": SEED["named"], "max_tokens": 64, "tools": TOOLS,
             "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = chat(port, named)
    if r:
        calls = r["choices"][0]["message"].get("tool_calls") or []
        check(len(calls) == 1 and calls[0]["function"]["name"] == "get_weather" and
              json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"},
              f"tool_choice named: the JSON answer is the named call ({calls})")
        r = chat(port, dict(named, seed=SEED["required"], tool_choice="required"))
        if r:
            c = r["choices"][0]
            calls_r = c["message"].get("tool_calls") or []
            check([(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls_r] ==
                  [("get_time", {"tz": "UTC"})] and c["finish_reason"] == "tool_calls",
                  f"tool_choice required: the JSON array answer becomes the calls ({calls_r})")
        s = chat_stream(port, named)
        check([(v["name"], v["arguments"]) for v in s["tool_calls"].values()] ==
              [(calls[0]["function"]["name"], calls[0]["function"]["arguments"])] if calls else False,
              "tool_choice named streamed == non-streamed")


def tools_section():
    """The tool section of docs/api.md for TOOLS (parameters as json.dumps)."""
    s = "\n\n## Tools\nYou have access to the following tools:\n"
    for t in TOOLS:
        f = t["function"]
        s += f"\n### {f['name']}\nDescription: {f['description']}\n\nParameters: {json.dumps(f['parameters'])}\n"
    s += ("\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n" + CALLS + CB + "tool_call_name" + SEP +
          "tool_call_arguments" + CE + "{{additional_tool_calls}}" + CALLE + "\n\nWhere:\n\n"
          "- `tool_call_name` must be an exact match to one of the available tools\n"
          "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
          "- For multiple tool calls, chain them directly without separators or spaces\n")
    return s


def test_round_trip(port, model, calls):
    msgs = [{"role": "system", "content": "Be brief."}] + user("Weather and time in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "{\"temp_c\": 21}"},
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": "14:05"}]
    r = chat(port, {"messages": msgs, "seed": SEED["reasoning"], "max_tokens": 64, "tools": TOOLS})
    # the V3 template (tokenizer/chat.c): one assistant turn with two calls
    call = lambda t: (CB + "function" + SEP + t["function"]["name"] + "\n```json\n" + t["function"]["arguments"] +
                      "\n```" + CE)
    want = (BOS + "Be brief." + tools_section() + "<｜User｜>Weather and time in Paris?" +
            "<｜Assistant｜>" + CALLS + call(calls[0]) + "\n" + call(calls[1]) + CALLE + EOS +
            "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{\"temp_c\": 21}<｜tool▁output▁end｜>" +
            "\n<｜tool▁output▁begin｜>14:05<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")
    if r:
        n = len(tokenize(model, want))
        check(r["usage"]["prompt_tokens"] == n,
              f"tool results rendered back: prompt_tokens {r['usage']['prompt_tokens']} == {n} of the documented text")


def test_validation(port):
    cases = [({"tools": 5}, "tools"),
             ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
              "tools[0].function.parameters"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"reasoning_effort": "max"}, "reasoning_effort"),
             ({"chat_template_kwargs": {"thinking": 1}}, "chat_template_kwargs.thinking")]
    for extra, param in cases:
        r = chat(port, dict({"messages": user("x"), "max_tokens": 4}, **extra), want=400)
        check(r and r.get("error", {}).get("param") == param, f"400 names param {param} ({r})")


def test_openai_client(port):
    clients = os.path.join(SRC, "tests", "clients")
    if not shutil.which("node") or not os.path.isdir(os.path.join(clients, "node_modules", "openai")):
        print("skip: the openai npm client is not installed (tests/clients: npm ci)")
        return
    req = {"tools_body": {"model": "tiny", "messages": user("Weather and time in Paris?"), "seed": SEED["v3"],
                          "max_tokens": 128, "tools": TOOLS},
           "reasoning_body": {"model": "tiny", "messages": user("What is 2 + 2?"), "seed": SEED["reasoning"],
                              "max_tokens": 64, "chat_template_kwargs": {"thinking": True}}}
    p = subprocess.run(["node", os.path.join(clients, "openai_chat_features.mjs"), json.dumps(req),
                        f"http://127.0.0.1:{port}/v1"], capture_output=True, text=True, timeout=120)
    if not check(p.returncode == 0, f"openai npm client: {p.stderr[-800:]}"):
        return
    o = json.loads(p.stdout.strip().splitlines()[-1])
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in o["calls"] or []]
    check(calls == [("get_weather", "{\"city\": \"Paris\", \"days\": 3}"),
                    ("get_time", "{\"tz\": \"Europe/Paris\"}")] and o["finish"] == "tool_calls",
          f"openai client: tool_calls ({calls})")
    check([(c["function"]["name"], c["function"]["arguments"]) for c in o["stream_calls"]] == calls and
          all(c["id"].startswith("call_") and c["type"] == "function" for c in o["stream_calls"]) and
          o["stream_finish"] == "tool_calls",
          "openai client: streamed tool_calls assemble to the same calls")
    check(o["reasoning"] == REASONING and o["content"] == ANSWER and o["stream_reasoning"] == REASONING and
          o["stream_content"] == ANSWER, "openai client: reasoning_content and content, streamed and not")


def main():
    tmp, model = tiny_model()
    replay = os.path.join(tmp, "replay.json")
    with open(replay, "w") as f:
        json.dump([tokenize(model, s) for s in SCRIPTS], f)
    up, port = start(tmp, model, replay, [], "v3")
    try:
        if port:
            test_reasoning(port)
            calls = test_tool_calls(port)
            test_text_cases(port)
            if calls:
                test_round_trip(port, model, calls)
            test_validation(port)
            test_openai_client(port)
    finally:
        stop(up)
    up, port = start(tmp, model, replay, ["--tool-call-parser", "deepseek_dsml"], "dsml")
    try:
        if port:
            body = {"messages": user("Weather in Paris?"), "seed": SEED["dsml"], "max_tokens": 128,
                    "tools": TOOLS}
            r = chat(port, body)
            if r:
                calls = r["choices"][0]["message"].get("tool_calls") or []
                check([(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] ==
                      [("get_weather", {"city": "Paris", "days": 3})], f"DSML call parsed ({calls})")
                check(r["choices"][0]["finish_reason"] == "tool_calls", "DSML: finish_reason tool_calls")
                s = chat_stream(port, body)
                check([(v["name"], v["arguments"]) for v in s["tool_calls"].values()] ==
                      [(t["function"]["name"], t["function"]["arguments"]) for t in calls],
                      "DSML streamed == non-streamed")
    finally:
        stop(up)
    finish()


if __name__ == "__main__":
    main()

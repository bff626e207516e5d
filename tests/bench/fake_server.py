#!/usr/bin/env python3
"""A small OpenAI-compatible server that misbehaves on purpose, for testing
`pdserve bench` (tests/integration/test_bench_fake.py).

    python3 fake_server.py PORT

The behaviour of a request is chosen by its "model" field:

- a mode name (below): every request behaves that way;
- "mix:MODE1,MODE2,...": the Nth request for that model name behaves as
  MODE(N mod count), so a run at concurrency 1 meets each mode in order.

Modes: ok, empty (200, no text), no_done (no data: [DONE]), wrong_length
(one token short), bad_usage (total_tokens wrong), no_usage, sse_error (an
error object inside the 200 stream), event_error (an `event: error` SSE
event), malformed (an event that is not JSON), disconnect (the connection
drops mid-stream), invalid_utf8 (raw 0xff bytes in the text), timeout (no
answer for 3 s), http_500, http_429, not_sse (a JSON body where a stream
was asked for), smart (chat answers that pass `pdserve bench functional` and
score 3/3 in `pdserve bench retrieval`).

GET /v1/models lists one model, "fake". Everything is HTTP/1.1 with chunked
streaming written by hand, so that a dropped connection is a truncated body.
"""
import http.server, json, re, socket, sys, threading, time

counters = {}
lock = threading.Lock()


def pick_mode(model):
    if not model.startswith("mix:"):
        return model
    modes = model[4:].split(",")
    with lock:
        n = counters.get(model, 0)
        counters[model] = n + 1
    return modes[n % len(modes)]


def smart_answer(body):
    """Correct answers to the functional checks of `pdserve bench`."""
    msgs = body.get("messages", [])
    last = msgs[-1] if msgs else {}
    text = last.get("content") or ""
    if last.get("role") == "tool":
        return "The weather in Paris is clear, 18 degrees Celsius.", None
    if "access codes of three projects" in text:
        codes = re.findall(r"The access code for project (\w+) is ([A-Z0-9]{4}-[A-Z0-9]{4})\.", text)
        return "```json\n" + json.dumps(dict(codes)) + "\n```", None
    if "17 + 25" in text:
        return "42", None
    if "Alice Martin" in text:
        return '{"name": "Alice Martin", "age": 34}', None
    if "favourite colour is teal" in text:
        return "OK", None
    if "What is my favourite colour" in text:
        return "Teal", None
    if "get_weather" in text and body.get("tools"):
        return "", [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    return "Rivers carry water from the mountains to the sea.", None


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def setup(self):
        super().setup()
        # each event leaves at once (no Nagle wait for the client's delayed ACK)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send_json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        else:
            self.send_json(404, {"error": {"message": "not found"}})

    def chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def event(self, obj):
        self.chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(n))
        chat = self.path.endswith("/chat/completions")
        mode = pick_mode(body.get("model", "ok"))
        max_tokens = int(body.get("max_tokens", 16))
        prompt = body.get("prompt") or body.get("messages")
        prompt_tokens = len(prompt) if isinstance(prompt, list) and not chat else 16
        try:
            self.answer(mode, body, chat, max_tokens, prompt_tokens)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def answer(self, mode, body, chat, max_tokens, prompt_tokens):
        if mode == "http_500":
            return self.send_json(500, {"error": {"message": "internal error", "type": "server_error"}})
        if mode == "http_429":
            return self.send_json(429, {"error": {"message": "too many requests"}})
        if mode == "timeout":
            time.sleep(3)
        tool_calls = None
        if mode == "smart":
            text, tool_calls = smart_answer(body)
            pieces = [text[i:i + 4] for i in range(0, len(text), 4)] if text else []
        else:
            count = max_tokens - 1 if mode == "wrong_length" else max_tokens
            pieces = ["" if mode == "empty" else "tok%d " % i for i in range(count)]
        completion = max_tokens if mode == "empty" else max(len(pieces), 1 if tool_calls else 0)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion}
        if mode == "bad_usage":
            usage["total_tokens"] += 7
        finish = "tool_calls" if tool_calls else ("stop" if mode == "smart" else "length")
        if not body.get("stream") or mode == "not_sse":
            if chat:
                msg = {"role": "assistant", "content": None if tool_calls else "".join(pieces)}
                if tool_calls:
                    msg["tool_calls"] = tool_calls
                choice = {"index": 0, "message": msg, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": "".join(pieces), "finish_reason": finish}
            out = {"id": "x", "object": "chat.completion" if chat else "text_completion",
                   "model": body.get("model"), "choices": [choice]}
            if mode != "no_usage":
                out["usage"] = usage
            return self.send_json(200, out)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk_of(piece, fin=None):
            if chat:
                ch = {"index": 0, "delta": {"content": piece}, "finish_reason": fin}
            else:
                ch = {"index": 0, "text": piece, "finish_reason": fin}
            return {"id": "x", "object": obj, "model": body.get("model"), "choices": [ch]}

        if chat:
            self.event({"id": "x", "object": obj, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        if tool_calls:
            self.event({"id": "x", "object": obj, "choices": [
                {"index": 0, "delta": {"tool_calls": [dict(tool_calls[0], index=0)]}, "finish_reason": None}]})
        for i, p in enumerate(pieces):
            if mode == "disconnect" and i == 2:
                # a truncated chunked body: no terminating chunk, the socket just closes
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            if mode == "sse_error" and i == 2:
                self.event({"error": {"message": "engine crashed", "type": "server_error", "code": 500}})
            if mode == "event_error" and i == 2:
                self.chunk(b"event: error\ndata: {\"message\": \"overloaded\"}\n\n")
            if mode == "malformed" and i == 2:
                self.event(b'{"choices": [{"text": "half')
            if mode == "invalid_utf8" and i == 2:
                self.event(b'{"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "bad \xff\xfe", '
                           b'"finish_reason": null}]}')
                continue
            self.event(chunk_of(p))
            time.sleep(0.001)
        self.event(chunk_of("", finish))
        if mode != "no_usage":
            self.event({"id": "x", "object": obj, "choices": [], "usage": usage})
        if mode != "no_done":
            self.event(b"[DONE]")
        self.chunk(b"")  # the terminating chunk: a clean end


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # many clients connect at once


def main():
    port = int(sys.argv[1])
    srv = Server(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()

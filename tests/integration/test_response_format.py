#!/usr/bin/env python3
"""response_format end to end on 127.0.0.1 with the tiny model (random
weights: unconstrained it emits text that is not JSON): `pdserve up` with
one prefill and one decode replica, both routes (a prompt at or under
--long-prompt-threshold is prefilled on the decode replica; a longer one on
the prefill replica, whose first token is then masked there).

Checks, per schema (json_object and four json_schema ones) and route:
- greedy and sampled (temperature 1, seeded) outputs json.loads and
  validate against the schema (python3-jsonschema), finish_reason "stop"
  within a small max_tokens (the mask's token budget closes the value);
- streamed (seeded) == non-streamed, and the stream's text parses too;
- the unconstrained greedy text for the same prompt is not JSON (so the
  mask is what makes it valid);
- /v1/completions takes response_format too;
- bad response_format values are 400 with `param` naming the field.
Run by ctest (tests/integration/*.py) with PD_BIN set.
"""
import json, time

import jsonschema

from pdtest import (check, finish, free_port_pair, metric, metrics, pd_stack_flags, request, start_up, stop_up,
                    stream, tiny_model, wait_ready)

CHUNK = 8
THRESHOLD = 12
MAX_TOKENS = 24

SCHEMAS = {
    "person": {"type": "object",
               "properties": {"name": {"type": "string", "maxLength": 12},
                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                              "role": {"enum": ["admin", "user", None]},
                              "ok": {"type": "boolean"}},
               "required": ["name", "ok"], "additionalProperties": False},
    "points": {"type": "array", "minItems": 1, "maxItems": 2,
               "items": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": ["integer", "null"]}},
                         "required": ["x", "y"]}},
    "either": {"anyOf": [{"type": "string", "minLength": 2, "maxLength": 6}, {"type": "null"},
                         {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}]},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "items": {"const": "x"}, "minItems": 2}},
             "required": ["tags"]},
    # as pydantic writes class Owner(BaseModel): name: str; pets: list[Pet] (Pet a model, kind an Enum)
    "pydantic": {"$defs": {"Kind": {"enum": ["cat", "dog"], "title": "Kind", "type": "string"},
                           "Pet": {"properties": {"kind": {"$ref": "#/$defs/Kind"},
                                                  "age": {"anyOf": [{"type": "integer"}, {"type": "null"}],
                                                          "default": None, "title": "Age"}},
                                   "required": ["kind"], "title": "Pet", "type": "object",
                                   "additionalProperties": False}},
                 "properties": {"name": {"title": "Name", "type": "string", "maxLength": 8},
                                "pets": {"items": {"$ref": "#/$defs/Pet"}, "title": "Pets", "type": "array",
                                         "maxItems": 2}},
                 "required": ["name", "pets"], "title": "Owner", "type": "object", "additionalProperties": False},
}


def post(port, path, body):
    st, _, data = request(port, "POST", path, body, 60)
    check(st == 200, f"{path}: status {st} {data[:300]!r}", quiet_ok=True)
    return json.loads(data) if st == 200 else None


def valid(text, schema, what):
    try:
        v = json.loads(text)
    except ValueError as e:
        return check(False, f"{what}: not JSON ({e}): {text!r}")
    try:
        jsonschema.validate(v, schema)
    except jsonschema.ValidationError as e:
        return check(False, f"{what}: does not validate ({e.message}): {text!r}")
    return True


def check_bad(port, rf, param, words):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "response_format": rf}
    st, _, data = request(port, "POST", "/v1/chat/completions", body, 30)
    err = json.loads(data).get("error", {}) if data.startswith(b"{") else {}
    check(st == 400 and err.get("param") == param and words in err.get("message", ""),
          f"400 for response_format {json.dumps(rf)[:70]}: param {err.get('param')!r}, {err.get('message')!r}")


def main():
    _, model = tiny_model()
    port = free_port_pair()
    up = start_up(model, port, *pd_stack_flags(THRESHOLD, CHUNK))
    try:
        if not check(wait_ready(port), "stack became ready"):
            finish()  # stop_up runs on the way out
        t0 = time.time()
        prompts = {"short": "Reply in JSON.", "long": "Reply in JSON about " + "many things " * 6}
        formats = {"json_object": ({"type": "json_object"}, {"type": "object"})}
        for name, schema in SCHEMAS.items():
            formats[name] = ({"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
                             schema)
        for route, text in prompts.items():
            m0 = metrics(port)
            base = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS}
            plain = post(port, "/v1/chat/completions", dict(base, temperature=0))
            if plain:
                try:
                    json.loads(plain["choices"][0]["message"]["content"])
                    check(False, f"{route}: the unconstrained greedy text is not JSON")
                except ValueError:
                    print(f"ok: {route}: unconstrained greedy text is not JSON")
            for fname, (rf, schema) in formats.items():
                what = f"{route} {fname}"
                greedy = post(port, "/v1/chat/completions", dict(base, temperature=0, response_format=rf))
                if greedy:
                    ch = greedy["choices"][0]
                    if valid(ch["message"]["content"], schema, f"{what} greedy"):
                        check(ch["finish_reason"] == "stop", f"{what} greedy: finish_reason {ch['finish_reason']}")
                        print(f"ok: {what} greedy: {ch['message']['content'][:80]!r}")
                sbody = dict(base, temperature=1.0, seed=7, response_format=rf)
                sampled = post(port, "/v1/chat/completions", sbody)
                if sampled:
                    ch = sampled["choices"][0]
                    if valid(ch["message"]["content"], schema, f"{what} sampled"):
                        check(ch["finish_reason"] == "stop", f"{what} sampled: finish_reason {ch['finish_reason']}")
                    ss = stream(port, "/v1/chat/completions", sbody)
                    stext, sfin = ss.text, ss.finish_reason
                    check(stext == ch["message"]["content"] and sfin == ch["finish_reason"],
                          f"{what} sampled: streamed == non-streamed ({stext!r} vs {ch['message']['content']!r})")
            time.sleep(0.35)  # heartbeats carry the counters
            moved = metric(metrics(port), "pdserve:kv_transfer_bytes_total") - metric(m0, "pdserve:kv_transfer_bytes_total")
            check(moved > 0 if route == "long" else moved == 0, f"{route} route taken (KV moved: {moved})")

        # /v1/completions, n = 2
        resp = post(port, "/v1/completions", {"model": "tiny", "prompt": "JSON:", "max_tokens": MAX_TOKENS, "n": 2,
                                              "temperature": 1.0, "seed": 3,
                                              "response_format": formats["person"][0]})
        if resp:
            for i, ch in enumerate(resp["choices"]):
                if valid(ch["text"], SCHEMAS["person"], f"completions choice {i}"):
                    print(f"ok: completions choice {i}: {ch['text'][:60]!r}")
        # text: no constraint, accepted
        post(port, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                            "max_tokens": 2, "response_format": {"type": "text"}})
        print(f"ok: constrained requests took {time.time() - t0:.1f} s")

        check_bad(port, {"type": "xml"}, "response_format.type", "must be one of text, json_object, json_schema")
        check_bad(port, "json", "response_format", "must be an object")
        check_bad(port, {"type": "json_schema"}, "response_format.json_schema", "is required")
        check_bad(port, {"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name",
                  "is required")
        check_bad(port, {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
                  "response_format.json_schema.schema", "must be a JSON Schema object")
        check_bad(port, {"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]+$"}}}}},
                  "response_format.json_schema.schema", "unsupported schema keyword: pattern at properties.id")
        deep = {}
        for _ in range(20):
            deep = {"type": "array", "items": deep}
        check_bad(port, {"type": "json_schema", "json_schema": {"name": "a", "schema": deep}},
                  "response_format.json_schema.schema", "nested more than 16 deep")
        check_bad(port, {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "date"}}},
                  "response_format.json_schema.schema", "'type' must be one of")
        # unsatisfiable: "b" is required, and additionalProperties forbids every undescribed name
        check_bad(port, {"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
            "additionalProperties": False}}},
                  "response_format.json_schema.schema", "required property \"b\" is not in 'properties'")
        st, _, _ = request(port, "GET", "/health", timeout=10)
        check(st == 200, "the stack is healthy after bad requests")
    finally:
        stop_up(up, sanitizer=True)
    finish()


if __name__ == "__main__":
    main()

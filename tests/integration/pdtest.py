"""Shared helpers of the integration tests (real pdserve processes on
127.0.0.1): checks that collect failures, free ports, HTTP calls, /metrics
parsing, and a tiny model made once per test."""
import http.client, json, os, socket, subprocess, sys, tempfile

BIN = os.environ.get("PD_BIN", "build/pdserve")
SRC = os.environ.get("PD_SOURCE_DIR", ".")
failures = []


def check(cond, what, quiet_ok=False):
    """Records a failure (and prints it); returns cond."""
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)
    elif not quiet_ok:
        print("ok:", what, flush=True)
    return cond


def finish():
    print("failures:", len(failures))
    sys.exit(1 if failures else 0)


def free_port_pair():
    """A free TCP port P whose neighbour P+1 (the control endpoint) is free too."""
    while True:
        s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
        try:
            t = socket.socket(); t.bind(("127.0.0.1", p + 1)); t.close()
            return p
        except OSError:
            pass


def request(port, method, path, body=None, timeout=60, headers=None):
    """Returns (status, headers dict, body bytes)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Content-Type": "application/json"} if body is not None else {}
    h.update(headers or {})
    c.request(method, path, json.dumps(body) if isinstance(body, (dict, list)) else body, h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict(r.getheaders()), data


def metrics(port):
    """/metrics as {series-with-labels: value}."""
    _, _, data = request(port, "GET", "/metrics", timeout=10)
    out = {}
    for line in data.decode().splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def metric(m, name, **labels):
    """Sum of the series of name whose labels include the given ones."""
    tot = 0.0
    for k, v in m.items():
        if (k == name or k.startswith(name + "{")) and all(f'{a}="{b}"' in k for a, b in labels.items()):
            tot += v
    return tot


def tiny_model(preset="tiny"):
    tmp = tempfile.mkdtemp()
    model = os.path.join(tmp, preset)
    subprocess.run([BIN, "mkmodel", "--preset", preset, "--seed", "1", "--out", model], check=True, capture_output=True)
    return tmp, model

#!/usr/bin/env python3
"""A replica's start-up operations (issue 11), real processes on 127.0.0.1,
the tiny model, CPU backend at tensor-parallel size 2 (the CPU TP path: its
all-reduce is the threads' barrier):
- an injected wrong all-reduce result (--debug-inject-selfcheck-failure)
  keeps the replica from registering: it exits 1 with the self-check's
  message, and the gateway never counts it;
- a replica of another checkpoint of the same architecture (tiny, seed 2)
  is refused by the gateway (weights fingerprint) and stops;
- a healthy prefill and decode pass the self-check, register, and report it
  on their own /metrics (self_check_ok{check="allreduce"} 1, the KV
  capacity in tokens), with their NUMA placement: --numa 0 binds node 0
  (log line with its CPUs, pdserve:numa_node 0), auto on a CPU replica
  binds nothing (numa_node -1) and says why;
- the healthy replicas run with --enable-expert-parallel (each rank logs
  the routed experts it holds) and serve a request;
- an invalid --numa value or a node this machine lacks: exit 2 and a message
  naming it, no crash.
"""
import os, re, subprocess, time

from pdtest import BIN, check, finish, free_port_pair, metric, metrics, tiny_model

HB = 100


def wait_for(pred, timeout=30):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    return None


def alive(port, role):
    try:
        return int(metrics(port).get(f'pdserve:replicas_alive{{role="{role}"}}', 0))
    except OSError:
        return -1


def main():
    tmp, model = tiny_model()
    port = free_port_pair()
    ctrl = f"tcp://127.0.0.1:{port + 1}"
    logs = {}
    procs = []

    def start(name, args):
        logs[name] = os.path.join(tmp, name + ".log")
        p = subprocess.Popen([BIN] + args, stdout=open(logs[name], "w"), stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    def replica(role, name, *extra):
        return start(name, [role, "--model", model, "--gateway", ctrl, "--replica-id", name, "--block-size", "4",
                            "--num-kv-blocks", "256", "--threads", "1", "--tensor-parallel-size", "2",
                            "--heartbeat-interval-ms", str(HB)] + list(extra))

    def log(name):
        return open(logs[name]).read()

    try:
        start("gateway", ["gateway", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--control", ctrl,
                          "--served-model-name", "tiny", "--heartbeat-interval-ms", str(HB)])
        check(wait_for(lambda: alive(port, "decode") == 0, 20), "gateway up")

        # 1. injected self-check failure: no registration, exit 1, a clear message
        bad = replica("decode", "decode-bad", "--debug-inject-selfcheck-failure")
        try:
            rc = bad.wait(60)
        except subprocess.TimeoutExpired:
            rc = None
            bad.kill()
        text = log("decode-bad")
        check(rc == 1, f"a failed self-check exits 1 (got {rc})")
        check("self-check allreduce FAILED over 2 ranks" in text and "expected 3" in text,
              "the failure is logged with the rank, element and expected value")
        check("refusing to start: self-check" in text, "and the exit says why")
        check("registered with the gateway" not in text, "the replica never registered")

        # 1b. the same architecture with other weights (tiny, seed 2): the
        # gateway refuses it (it served both, and one greedy request got two
        # texts by replica: helper-50), and the replica stops
        other = os.path.join(tmp, "tiny-seed2")
        subprocess.run([BIN, "mkmodel", "--preset", "tiny", "--seed", "2", "--out", other], check=True,
                       capture_output=True)
        odd = start("decode-other", ["decode", "--model", other, "--gateway", ctrl, "--replica-id", "decode-other",
                                     "--block-size", "4", "--num-kv-blocks", "256", "--threads", "1",
                                     "--heartbeat-interval-ms", str(HB)])
        try:
            odd.wait(60)
        except subprocess.TimeoutExpired:
            odd.kill()
        text = log("decode-other")
        check("gateway refused registration: weights fingerprint" in text and "another checkpoint" in text,
              f"a replica of another checkpoint is refused, naming the weights "
              f"({[ln for ln in text.splitlines() if 'refused' in ln][-1:]})")
        check(alive(port, "decode") == 0, "and never counted")
        check(alive(port, "decode") == 0, "the gateway counts no decode replica")

        # 2. healthy replicas: self-check ok, NUMA reported, registered
        mp = free_port_pair()
        replica("decode", "decode-1", "--metrics-port", str(mp), "--numa", "0", "--enable-expert-parallel")
        replica("prefill", "prefill-1", "--metrics-port", str(mp + 1), "--enable-expert-parallel")
        check(wait_for(lambda: alive(port, "decode") == 1 and alive(port, "prefill") == 1, 60),
              "both replicas registered after their self-checks")
        d, p = log("decode-1"), log("prefill-1")
        for name, text in (("decode", d), ("prefill", p)):
            check("self-check allreduce ok: 2 ranks" in text and "every element 3" in text,
                  f"{name}: self-check logged")
            check("self-check KV pool: 256 blocks × 4 tokens = 1024 tokens" in text, f"{name}: KV capacity logged")
            check(re.search(r"start-up: self-checks \d+\.\d+ s", text) is not None, f"{name}: self-checks phase timed")
            check(text.find("self-check allreduce ok") < text.find("registered with the gateway"),
                  f"{name}: the check comes before registration")
            check("GPU telemetry off: CPU backend, no GPU" in text, f"{name}: telemetry absence explained")
            check("expert parallel rank 1/2: routed experts [4, 8) of 8" in text,
                  f"{name}: --enable-expert-parallel: rank 1 holds experts 4..7")
        node0 = open("/sys/devices/system/node/node0/cpulist").read().strip()
        m = re.search(r"decode-1: NUMA: bound to node 0, CPUs (\S+), memory preferred there \(--numa 0\)", d)
        check(m is not None, "decode --numa 0: bound to node 0, logged")
        # the node's CPUs as sysfs lists them (this process' cpuset may be smaller)
        check(m is not None and set(expand(m.group(1))) <= set(expand(node0)), "with the node's CPUs")
        check("prefill-1: NUMA: not bound: auto: no GPU to be near (CPU backend" in p, "prefill auto on CPU: not bound, says why")
        md, mpm = metrics(mp), metrics(mp + 1)
        for name, mm in (("decode", md), ("prefill", mpm)):
            check(metric(mm, "pdserve:self_check_ok", check="allreduce") == 1, f"{name}: self_check_ok 1 in /metrics")
            check(metric(mm, "pdserve:kv_cache_capacity_tokens") == 1024, f"{name}: KV capacity 1024 tokens")
            check(not any(k.startswith("pdserve:gpu_") for k in mm), f"{name}: no GPU families on a CPU replica")
        check(metric(md, "pdserve:numa_node", replica="decode-1") == 0, "decode numa_node 0")
        check(metric(mpm, "pdserve:numa_node", replica="prefill-1") == -1, "prefill numa_node -1 (not bound)")
        # the replica still serves
        import json
        from pdtest import request
        st, _, body = request(port, "POST", "/v1/completions",
                              {"model": "tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True})
        check(st == 200 and json.loads(body)["usage"]["completion_tokens"] == 3, "a request is served")

        # 3. bad --numa values: exit 2, the flag and the nodes named
        for val, want in (("7", "--numa 7: no such NUMA node here (nodes: 0"),
                          ("near", "--numa 'near': expected auto, off or a NUMA node number")):
            if val == "7" and os.path.exists("/sys/devices/system/node/node7"):
                continue
            for role in ("decode", "prefill"):
                q = replica(role, f"{role}-numa-{val}", "--numa", val)
                try:
                    rc = q.wait(30)
                except subprocess.TimeoutExpired:
                    rc = None
                    q.kill()
                text = log(f"{role}-numa-{val}")
                check(rc == 2 and want in text, f"{role} --numa {val}: exit 2 and '{want}' (got {rc})")
    finally:
        for q in procs:
            if q.poll() is None:
                q.terminate()
        for q in procs:
            try:
                q.wait(10)
            except subprocess.TimeoutExpired:
                q.kill()
    finish()


def expand(cpulist):
    out = []
    for part in cpulist.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""GPU host check of a replica's start-up operations (issue 11), run by
tests/gpu/run.sh selfcheck: a gateway and a decode replica on CUDA (TP 2
when two GPUs are visible, else 1) with --numa auto and --metrics-port:
- NVML families present for every GPU, values plausible (utilisation 0-1,
  0 < used <= total, total > 16 GB, SM clock 0.1-3.5 GHz, power 10-1500 W,
  temperature 5-110 C), a second scrape a fresh reading;
- self_check_ok{check="allreduce"} 1, logged before registration, with each
  GPU's compute capability and memory;
- NUMA: the log line and numa_node equal to the GPUs' sysfs node when they
  share one (else -1 and the reason);
- a replica with --debug-inject-selfcheck-failure exits 1, never registers.
Environment as run.sh sets it (PD_BIN, PD_BUILD_DIR)."""
import os, re, subprocess, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from pdtest import BIN, check, finish, free_port_pair, metric, metrics, stop_procs  # noqa: E402


def n_gpus():
    try:
        return len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip().splitlines())
    except OSError:
        return 0


def main():
    work = os.environ.get("PD_BUILD_DIR", "/tmp") + "/selfcheck"
    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, "tiny")
    if not os.path.exists(os.path.join(model, "config.json")):
        subprocess.run([BIN, "mkmodel", "--preset", "tiny", "--seed", "1", "--out", model], check=True,
                       capture_output=True)
    tp = 2 if n_gpus() >= 2 else 1
    port = free_port_pair()
    mp = free_port_pair()
    ctrl = f"tcp://127.0.0.1:{port + 1}"
    procs, logs = [], {}

    def start(name, args):
        logs[name] = os.path.join(work, name + ".log")
        p = subprocess.Popen([BIN] + args, stdout=open(logs[name], "w"), stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    def decode(name, *extra):
        return start(name, ["decode", "--model", model, "--gateway", ctrl, "--replica-id", name, "--device", "cuda",
                            "--tensor-parallel-size", str(tp), "--num-kv-blocks", "512", "--heartbeat-interval-ms",
                            "100"] + list(extra))

    def alive():
        try:
            return int(metrics(port).get('pdserve:replicas_alive{role="decode"}', 0))
        except OSError:
            return -1

    def wait(pred, timeout):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if pred():
                return True
            time.sleep(0.2)
        return False

    try:
        start("gateway", ["gateway", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--control", ctrl,
                          "--heartbeat-interval-ms", "100"])
        check(wait(lambda: alive() == 0, 30), "gateway up")
        bad = decode("decode-bad", "--debug-inject-selfcheck-failure")
        try:
            rc = bad.wait(120)
        except subprocess.TimeoutExpired:
            rc = None
            bad.kill()
        text = open(logs["decode-bad"]).read()
        check(rc == 1 and f"self-check allreduce FAILED over {tp} rank" in text, f"injected failure: exit 1 (got {rc})")
        check("registered with the gateway" not in text and alive() == 0, "injected failure: never registered")

        decode("decode-1", "--numa", "auto", "--metrics-port", str(mp))
        check(wait(lambda: alive() == 1, 180), f"decode at TP {tp} registered")
        log = open(logs["decode-1"]).read()
        print("\n".join(l for l in log.splitlines() if re.search("NUMA|self-check|telemetry|start-up", l)))
        check(log.find("self-check allreduce ok") >= 0 and
              log.find("self-check allreduce ok") < log.find("registered with the gateway"),
              "self-check ok before registration")
        for g in range(tp):
            check(re.search(rf"self-check GPU {g}: .* compute capability 9\.0, \d+ SMs, [\d.]+ GiB, [\d.]+ GiB free", log)
                  is not None, f"GPU {g}: compute capability and memory logged")
        m = metrics(mp)
        check(metric(m, "pdserve:self_check_ok", check="allreduce") == 1, "self_check_ok 1")
        check(re.search(r"GPU telemetry: NVML, driver \S+", log) is not None, "NVML loaded")
        for g in range(tp):
            lab = {"replica": "decode-1", "gpu": str(g)}
            u = metric(m, "pdserve:gpu_utilization_perc", **lab)
            used = metric(m, "pdserve:gpu_memory_used_bytes", **lab)
            tot = metric(m, "pdserve:gpu_memory_total_bytes", **lab)
            clk = metric(m, "pdserve:gpu_sm_clock_hertz", **lab)
            pw = metric(m, "pdserve:gpu_power_watts", **lab)
            tc = metric(m, "pdserve:gpu_temperature_celsius", **lab)
            print(f"gpu {g}: util {u}, used {used / 1e9:.1f} GB of {tot / 1e9:.1f}, SM {clk / 1e9:.3f} GHz, "
                  f"{pw:.1f} W, {tc:.0f} C")
            check(0 <= u <= 1, f"gpu {g}: utilisation in 0..1")
            check(0 < used <= tot and tot > 16e9, f"gpu {g}: memory used <= total, total plausible")
            check(0.1e9 <= clk <= 3.5e9, f"gpu {g}: SM clock plausible")
            check(10 <= pw <= 1500, f"gpu {g}: power plausible")
            check(5 <= tc <= 110, f"gpu {g}: temperature plausible")
            check(metric(m, "pdserve:gpu_info", **lab) == 1, f"gpu {g}: gpu_info")
        # NUMA: the GPUs' node from sysfs against the report
        bus = re.findall(r"self-check GPU \d+: .* at (\S+),", log)
        nodes = []
        for b in bus:
            d, rest = b.split(":", 1)
            path = f"/sys/bus/pci/devices/{int(d, 16):04x}:{rest.lower()}/numa_node"
            nodes.append(int(open(path).read()) if os.path.exists(path) else -1)
        want = nodes[0] if nodes and all(n == nodes[0] for n in nodes) and nodes[0] >= 0 else -1
        got = metric(m, "pdserve:numa_node", replica="decode-1")
        print(f"GPU nodes from sysfs: {nodes}; numa_node metric {got}")
        check(got == want, f"numa_node {got} == the GPUs' node {want}")
        check(("NUMA: bound to node" in log) == (want >= 0), "NUMA log line agrees")
        time.sleep(1.2)
        m2 = metrics(mp)
        check(metric(m2, "pdserve:gpu_memory_total_bytes", replica="decode-1", gpu="0") > 16e9,
              "a second scrape reads the GPUs again")
    finally:
        stop_procs(procs)
    finish()


if __name__ == "__main__":
    main()

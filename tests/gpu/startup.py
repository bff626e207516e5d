#!/usr/bin/env python3
"""Start-up to ready of a decode replica on CUDA against the disk's read
bandwidth (issue 11), run by tests/gpu/run.sh startup on a GPU host:

    python3 tests/gpu/startup.py MODEL_DIR [--num-kv-blocks N] [--device cuda|cpu]

1. The disk: the largest shard read with O_DIRECT (dd iflag=direct, 64 MiB
   blocks: the page cache is bypassed, no root needed) -> bytes/s.
2. A cold start: every file of the checkpoint dropped from the page cache
   (fsync, then posix_fadvise DONTNEED: works for files this user owns, no
   root needed; fincore, when present, shows what stayed), then a gateway
   and one decode replica (--device cuda) until it registers; its
   "start-up:" phase lines are collected.
3. A warm start the same way right after (the checkpoint now in the page
   cache, as far as memory allows).
Prints one markdown table: per phase, cold and warm seconds, and for the
weights the checkpoint's bytes ÷ the disk's bandwidth (the floor a cold
load can reach). Environment as run.sh sets it (PD_BIN, PD_BUILD_DIR)."""
import argparse, glob, os, re, subprocess, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
from pdtest import BIN, check, finish, free_port_pair, metrics, stop_procs  # noqa: E402


def shards(model):
    return sorted(glob.glob(os.path.join(model, "*.safetensors")))


def evict(model):
    for f in glob.glob(os.path.join(model, "*")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings"] + shards(model), capture_output=True, text=True)
        resident = sum(int(l.split()[0]) for l in out.stdout.splitlines() if l.split() and l.split()[0].isdigit())
        print(f"page cache after eviction: {resident / 1e9:.2f} GB of the checkpoint resident (fincore)")
    except (OSError, ValueError):
        print("page cache after eviction: fincore not available")


def disk_bandwidth(model):
    big = max(shards(model), key=os.path.getsize)
    size = os.path.getsize(big)
    t0 = time.time()
    r = subprocess.run(["dd", f"if={big}", "of=/dev/null", "bs=64M", "iflag=direct"], capture_output=True, text=True)
    sec = time.time() - t0
    if r.returncode != 0:
        print(f"dd iflag=direct failed: {r.stderr.strip()[:200]}")
        return None
    print(f"disk: {os.path.basename(big)}, {size / 1e9:.2f} GB read with O_DIRECT in {sec:.2f} s: "
          f"{size / sec / 1e9:.2f} GB/s ({r.stderr.strip().splitlines()[-1]})")
    return size / sec


def start_once(model, work, name, kv_blocks, device):
    """A gateway and one decode replica until it registers; returns {phase: seconds}, total seconds."""
    port = free_port_pair()
    ctrl = f"tcp://127.0.0.1:{port + 1}"
    procs, logs = [], {}

    def start(who, args):
        logs[who] = os.path.join(work, f"{name}-{who}.log")
        p = subprocess.Popen([BIN] + args, stdout=open(logs[who], "w"), stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    def alive():
        try:
            return int(metrics(port).get('pdserve:replicas_alive{role="decode"}', 0))
        except OSError:
            return -1

    phases, total = {}, None
    try:
        start("gateway", ["gateway", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--control", ctrl])
        t0 = time.time()
        while alive() != 0 and time.time() - t0 < 30:
            time.sleep(0.1)
        t0 = time.time()
        start("decode", ["decode", "--model", model, "--gateway", ctrl, "--replica-id", name, "--device", device,
                         "--num-kv-blocks", str(kv_blocks)])
        while alive() != 1 and time.time() - t0 < 400 and procs[-1].poll() is None:
            time.sleep(0.1)
        if alive() == 1:
            total = time.time() - t0
        log = open(logs["decode"]).read()
        for m in re.finditer(r"start-up: (.+?) ([\d.]+) s$", log, re.M):
            phases[m.group(1)] = float(m.group(2))
        print("\n".join(l for l in log.splitlines() if "start-up:" in l))
    finally:
        stop_procs(procs)
    return phases, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument("--device", default="cuda", help="cpu: try the script on a machine without a GPU")
    a = ap.parse_args()
    work = os.environ.get("PD_BUILD_DIR", "/tmp") + "/startup"
    os.makedirs(work, exist_ok=True)
    ckpt = sum(os.path.getsize(f) for f in shards(a.model))
    print(f"checkpoint {a.model}: {ckpt / 1e9:.2f} GB in {len(shards(a.model))} shards")
    evict(a.model)
    bw = disk_bandwidth(a.model)
    evict(a.model)
    cold, cold_total = start_once(a.model, work, "cold", a.num_kv_blocks, a.device)
    warm, warm_total = start_once(a.model, work, "warm", a.num_kv_blocks, a.device)
    check(cold_total is not None and warm_total is not None, "both starts registered")
    check("load weights" in cold and "load weights" in warm, "load weights phase logged")
    print("\n| phase | cold (s) | warm (s) | floor from the disk (s) |\n|---|---|---|---|")
    for ph in dict.fromkeys(list(cold) + list(warm)):
        floor = f"{ckpt / bw:.2f}" if ph == "load weights" and bw else ""
        print(f"| {ph} | {cold.get(ph, float('nan')):.3f} | {warm.get(ph, float('nan')):.3f} | {floor} |")
    print(f"| to registration (gateway's view) | {cold_total or float('nan'):.2f} | {warm_total or float('nan'):.2f} | |")
    if bw and "load weights" in cold:
        print(f"\ncold weight load: {ckpt / cold['load weights'] / 1e9:.2f} GB/s = "
              f"{100 * ckpt / cold['load weights'] / bw:.0f} % of the disk's O_DIRECT read bandwidth")
    finish()


if __name__ == "__main__":
    main()

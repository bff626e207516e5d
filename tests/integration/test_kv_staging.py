#!/usr/bin/env python3
"""The KV staging pool (model/kv_staging.c) on the long route, real
processes on 127.0.0.1, the tiny model. On a GPU KV moves between replicas
through page-locked staging slots sized apart from the cache
(--kv-staging-blocks); --debug-force-kv-staging takes that path on the
CPU's host cache too. Two stacks of the same model: one unstaged (prefill
replicas put straight into the decode replica's cache blocks), one staged
with pools smaller than the demand: the decode replica's holds 10 blocks
(40 tokens), the prefill replica's 2 (every job's blocks go out two at a
time through reused slots, waiting for puts in flight to give slots back).
Checks:
- the staged path is the one taken (each replica logs its pool's size);
- greedy and seeded sampled completions of long prompts (1..10 blocks)
  are the unstaged stack's, token for token (as text);
- a prompt needing more slots than the decode pool holds can never be
  served: 400 naming the limit (--kv-staging-blocks), at once;
- concurrent long prompts that together need far more slots than the
  decode pool holds (8 of 9 blocks each, 10 slots: one at a time): the
  gateway queues them until slots free (a refused reservation is not an
  error) and every one is answered 200 with the unstaged text, none 503;
- clients that disconnect while their long prompt is being prefilled or
  while it waits in the gateway's queue for slots (the Abort path: the
  reservation released, its slots quarantined until the prefill replica's
  aborted KvComplete, its cache blocks freed at once);
- no slot leaks: afterwards, prompts needing 9 of the 10 slots succeed one
  after another;
- PD_KV_HOST_POOL=ucx (the decode replica's staging pool allocated by UCX
  in shared memory) still works: a third staged stack with it gives the
  unstaged text too.
"""
import json, os, random, socket, subprocess, threading, time

from pdtest import BIN, check, failures, finish, free_port_pair, metric, metrics, request, stop_procs, tiny_model

HB = 100  # heartbeat interval, ms
BLOCK = 4
DECODE_SLOTS = 10
PREFILL_SLOTS = 2
THRESHOLD = 12


class Stack:
    """A gateway, one prefill and one decode replica, each its own process."""

    def __init__(self, tmp, model, name, staged, env=None):
        self.tmp, self.model, self.name, self.env = tmp, model, name, env
        self.port = free_port_pair()
        self.ctrl = f"tcp://127.0.0.1:{self.port + 1}"
        self.procs = []
        self.logs = []
        self.start("gateway", ["gateway", "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
                               "--control", self.ctrl, "--served-model-name", "tiny", "--long-prompt-threshold",
                               str(THRESHOLD), "--heartbeat-interval-ms", str(HB),
                               "--max-prefill-jobs-per-replica", "4"])
        for role, slots, delay in (("prefill", PREFILL_SLOTS, 30), ("decode", DECODE_SLOTS, 0)):
            args = [role, "--model", model, "--gateway", self.ctrl, "--replica-id", f"{name}-{role}", "--block-size",
                    str(BLOCK), "--num-kv-blocks", "256", "--chunked-prefill-size", "8", "--threads", "1",
                    "--heartbeat-interval-ms", str(HB), "--debug-step-delay-ms", str(delay)]
            if staged:
                args += ["--debug-force-kv-staging", "--kv-staging-blocks", str(slots)]
            self.start(role, args)

    def start(self, role, args):
        path = os.path.join(self.tmp, f"{self.name}-{role}.log")
        log = open(path, "w")
        env = dict(os.environ, **self.env) if self.env else None
        self.procs.append(subprocess.Popen([BIN] + args, stdout=log, stderr=subprocess.STDOUT, env=env))
        self.logs.append(path)

    def log(self, role):
        return open(os.path.join(self.tmp, f"{self.name}-{role}.log"), errors="replace").read()

    def wait_ready(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                m = metrics(self.port)
                if all(metric(m, "pdserve:replicas_alive", role=r) >= 1 for r in ("prefill", "decode")):
                    return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    def complete(self, ids, seed=None, timeout=60):
        """(status, text or the error message) of an 8-token completion."""
        body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "ignore_eos": True,
                "temperature": 0 if seed is None else 0.8}
        if seed is not None:
            body["seed"] = seed
        st, _, data = request(self.port, "POST", "/v1/completions", body, timeout)
        doc = json.loads(data)
        return st, doc["choices"][0]["text"] if st == 200 else doc.get("error", {}).get("message", "")

    def stop(self):
        stop_procs(self.procs)


def main():
    tmp, model = tiny_model()
    plain = Stack(tmp, model, "plain", staged=False)
    staged = Stack(tmp, model, "staged", staged=True)
    ucx = Stack(tmp, model, "ucx", staged=True, env={"PD_KV_HOST_POOL": "ucx"})
    try:
        if not (check(plain.wait_ready(), "unstaged stack ready") and check(staged.wait_ready(), "staged stack ready")
                and check(ucx.wait_ready(), "staged stack with PD_KV_HOST_POOL=ucx ready")):
            return
        check(f"KV staging pool: {DECODE_SLOTS} slots" in staged.log("decode"), "the decode replica stages KV")
        check(f"KV staging pool: {PREFILL_SLOTS} slots" in staged.log("prefill"), "the prefill replica stages KV")
        check("KV staging pool" not in plain.log("decode") + plain.log("prefill"), "the unstaged stack does not")
        check("allocated by UCX" in ucx.log("decode"), "PD_KV_HOST_POOL=ucx: the decode replica's pool is UCX's")
        rng = random.Random(11)
        # ---- sequential: every length from just over the threshold to the whole decode pool ----
        for n in (THRESHOLD + 1, 17, 24, 25, 33, DECODE_SLOTS * BLOCK):
            ids = [rng.randrange(3, 120000) for _ in range(n)]
            for seed in (None, 7):
                st0, ref = plain.complete(ids, seed)
                st1, text = staged.complete(ids, seed)
                what = f"len {n} {'greedy' if seed is None else 'seed ' + str(seed)}"
                if check(st0 == 200 and st1 == 200, f"{what}: status {st0} / {st1} ({text!r})"):
                    check(text == ref, f"{what}: staged {text!r} == unstaged {ref!r}")
                st2, text = ucx.complete(ids, seed)
                check(st2 == 200 and text == ref, f"{what}: PD_KV_HOST_POOL=ucx {st2} {text!r} == unstaged")
        # ---- more blocks than the decode pool has slots: never fits, 400 at once ----
        ids = [rng.randrange(3, 120000) for _ in range(DECODE_SLOTS * BLOCK + 1)]
        t0 = time.time()
        st, msg = staged.complete(ids, timeout=30)
        check(st == 400 and f"staging pool holds {DECODE_SLOTS}" in msg and "--kv-staging-blocks" in msg
              and f"needs {DECODE_SLOTS + 1} KV staging slots" in msg,
              f"a prompt of {DECODE_SLOTS + 1} blocks: 400 naming the limit: {st} {msg!r}")
        check(time.time() - t0 < 10, "answered without waiting")
        # ---- concurrent: 8 prompts of 9 blocks each, 10 slots: they wait their turn ----
        prompts = [[rng.randrange(3, 120000) for _ in range(33)] for _ in range(8)]
        refs = [plain.complete(p)[1] for p in prompts]
        results = [None] * len(prompts)
        waiting = []

        def run(i):
            try:
                results[i] = staged.complete(prompts[i], timeout=120)
            except Exception as e:  # noqa: BLE001 - recorded as a failure below
                results[i] = (0, repr(e))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            waiting.append(metric(metrics(staged.port), "pdserve:num_requests_waiting_class", **{"class": "long"}))
            time.sleep(0.05)
        for t in threads:
            t.join(150)
        for i, (st, text) in enumerate(results):
            check(st == 200 and text == refs[i], f"concurrent {i}: {st}, staged {text!r} == unstaged {refs[i]!r}")
        time.sleep(3 * HB / 1000)  # a heartbeat after the last KvComplete
        m = metrics(staged.port)
        print(f"concurrent burst: most waiting in the long queue {max(waiting)}, reservations refused "
              f"{metric(m, 'pdserve:kv_reservations_refused_total')}")
        check(max(waiting) >= 3, f"the burst waited in the gateway's long queue (at most {max(waiting)} at once)")
        check(metric(m, "pdserve:kv_staging_free_slots") == DECODE_SLOTS,
              f"all {DECODE_SLOTS} staging slots free afterwards (gateway's view)")
        # ---- clients gone mid-prefill or while queued: the Abort path frees the slots ----
        socks = []
        for k in range(4):
            s = socket.create_connection(("127.0.0.1", staged.port))
            body = json.dumps({"model": "tiny", "prompt": prompts[k], "max_tokens": 8, "stream": True}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            socks.append(s)
        time.sleep(0.1)
        check(metric(metrics(staged.port), "pdserve:num_requests_waiting_class", **{"class": "long"}) >= 1,
              "some of the 4 wait in the long queue when their clients go")
        for k, s in enumerate(socks):
            time.sleep(0.05 * k)
            s.close()
        time.sleep(1.5)
        check(metric(metrics(staged.port), "pdserve:num_requests_waiting_class", **{"class": "long"}) == 0,
              "the long queue is empty after its clients went")
        # ---- no slot leaked: 9 of 10 slots, again and again ----
        for k in range(6):
            st, text = staged.complete(prompts[k % 4])
            check(st == 200 and text == refs[k % 4], f"after the burst, request {k}: {st} {text!r}")
    finally:
        plain.stop()
        staged.stop()
        ucx.stop()
        logs = staged.log("decode") + staged.log("prefill") + staged.log("gateway")
        check("Sanitizer" not in logs and "runtime error" not in logs and "assertion failed" not in logs,
              "no sanitizer report or failed assertion in the staged stack's logs")
        if failures:
            for role in ("gateway", "prefill", "decode"):
                print(f"---- staged {role} ----\n" + staged.log(role)[-3000:])


if __name__ == "__main__":
    main()
    finish()

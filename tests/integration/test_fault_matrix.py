#!/usr/bin/env python3
"""The fault matrix (tests/faults/fault_matrix.py), bounded for `make test`:
2 prefill + 2 decode replicas and a gateway on the tiny model, a few hundred
mixed requests, SIGKILL / SIGSTOP of each kind of process and client
disconnects at seeded random moments, long prompts in flight at each kill
(the gateway's included: reservations orphaned with it are handed back once
their writer's lease has ended).
PD_FAULT_SEED picks another seed."""
import os, sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "faults"))
import fault_matrix  # noqa: E402


def main():
    seed = int(os.environ.get("PD_FAULT_SEED", "1"))
    checks, res = fault_matrix.run(seed=seed, min_requests=300, concurrency=10, max_load_s=60.0,
                                   long_during_gateway_kill=True)
    if res.get("requests"):
        print(fault_matrix.outcome_table(res))
    failed = [w for ok, w in checks if not ok]
    print("failures:", len(failed))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

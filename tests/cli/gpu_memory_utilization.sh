#!/bin/sh
# --gpu-memory-utilization on the replicas, on a machine without a GPU:
# a value outside (0, 1], or any value for a CPU replica, is a usage error
# (exit 2, the flag named) found before any weight is read; a negative
# --num-kv-blocks too. The planning itself is tested by model/tests/test_kv_plan.c;
# on a GPU, tests/gpu/run.sh's replicas log their plan.
set -u
BIN=${PD_BIN:-build/pdserve}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
"$BIN" mkmodel --preset tiny --seed 1 --out "$T/m" >/dev/null 2>&1 || { echo "mkmodel failed"; exit 1; }
fail=0
expect() { # role, want-substring, args...
    role=$1 want=$2
    shift 2
    timeout 30 "$BIN" "$role" --model "$T/m" --gateway tcp://127.0.0.1:1 "$@" >"$T/out" 2>"$T/err"
    rc=$?
    if [ $rc -ne 2 ] || ! grep -q -- "$want" "$T/err"; then
        echo "FAIL: $role $*: exit $rc, $(grep -v INFO "$T/err" | tail -2)"; fail=1
    elif grep -q "load weights" "$T/err"; then
        echo "FAIL: $role $*: refused only after loading the weights"; fail=1
    fi
}
for role in decode prefill; do
    expect $role "runs on the CPU" --gpu-memory-utilization 0.5
    expect $role "must be in (0, 1]" --gpu-memory-utilization 1.5
    expect $role "must be in (0, 1]" --gpu-memory-utilization -0.2
    expect $role "must be in (0, 1]" --gpu-memory-utilization 0
    expect $role "must be in (0, 1]" --gpu-memory-utilization=0.0
    expect $role "needs a number" --gpu-memory-utilization half
    expect $role "--num-kv-blocks -3 must be positive" --num-kv-blocks -3
done
[ $fail -eq 0 ] && echo "gpu-memory-utilization flag checks: ok"
exit $fail

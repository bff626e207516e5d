#!/bin/sh
# pdserve up --device cuda: each replica gets its own --tensor-parallel-size
# GPUs when there are enough (CUDA_VISIBLE_DEVICES set per child), else they
# share and up says so; --gpu-placement shared keeps them together. Run on a
# machine without GPUs: PD_UP_FAKE_GPUS=N makes up see N GPUs, and each
# replica logs the CUDA_VISIBLE_DEVICES it was started with before its CUDA
# backend fails to start (no GPU here), which is what is checked.
set -u
. "$(dirname "$0")/lib.sh"
BIN=${PD_BIN:-build/pdserve}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
"$BIN" mkmodel --preset tiny --seed 1 --out "$T/m" >/dev/null 2>&1 || { echo "mkmodel failed"; exit 1; }
fail=0
run_up_once() { # log, env and up's command line; waits until both replicas have exited (a CUDA
    # replica cannot start here) or, for CPU replicas, 2 s; at most 15 s
    log=$1; shift
    port=$(free_port_pair)
    : >"$log" # exists before the wait below greps it (the job's redirection may come later)
    env "$@" --port "$port" >"$log" 2>&1 &
    pid=$!
    n=0
    while [ $n -lt 150 ] && [ "$(grep -c 'not restarted' "$log")" -lt 2 ]; do
        case "$*" in *"--device cuda"*) ;; *) [ $n -ge 20 ] && break ;; esac
        sleep 0.1; n=$((n + 1))
    done
    kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null
}
run_up() { # run_up_once, again (at most 3 runs) when up stopped the stack because one CUDA
    # replica failed before the other had logged its CUDA_VISIBLE_DEVICES (a race on a loaded machine)
    for attempt in 1 2 3; do
        run_up_once "$@"
        grep -q "before the stack was ready; stopping" "$1" || return 0
        [ "$(grep -c ': CUDA_VISIBLE_DEVICES=' "$1")" -ge 2 ] && return 0
    done
}
want() { grep -q -- "$2" "$1" || { echo "FAIL: $3: no '$2' in:"; grep -E "pdserve up:|CUDA_VISIBLE" "$1" | head -8; fail=1; }; }
nowant() { ! grep -q -- "$2" "$1" || { echo "FAIL: $3: '$2' present"; fail=1; }; }

# 4 GPUs, one prefill and one decode replica at TP 2: GPUs 0,1 and 2,3
run_up "$T/a" PD_UP_FAKE_GPUS=4 "$BIN" up --model "$T/m" --device cuda --tensor-parallel-size 2
want "$T/a" "prefill-0 on GPUs 0,1" "own GPUs, prefill"
want "$T/a" "decode-0 on GPUs 2,3" "own GPUs, decode"
want "$T/a" "prefill-0: CUDA_VISIBLE_DEVICES=0,1" "prefill's environment"
want "$T/a" "decode-0: CUDA_VISIBLE_DEVICES=2,3" "decode's environment"
# up's own CUDA_VISIBLE_DEVICES is the pool (names kept as given, UUIDs too)
run_up "$T/b" CUDA_VISIBLE_DEVICES=5,GPU-1b2c3d4e-0000-1111-2222-333344445555 "$BIN" up --model "$T/m" --device cuda
want "$T/b" "decode-0: CUDA_VISIBLE_DEVICES=GPU-1b2c3d4e-0000-1111-2222-333344445555" "from up's own list"
want "$T/b" "prefill-0: CUDA_VISIBLE_DEVICES=5" "from up's own list, prefill"
# too few: they share, and up says so
run_up "$T/c" PD_UP_FAKE_GPUS=2 "$BIN" up --model "$T/m" --device cuda --tensor-parallel-size 2
want "$T/c" "the replicas share GPUs 0..1" "too few GPUs"
nowant "$T/c" "decode-0 on GPU" "too few GPUs"
# shared on request; CPU replicas: no placement at all
run_up "$T/d" PD_UP_FAKE_GPUS=4 "$BIN" up --model "$T/m" --device cuda --gpu-placement shared
nowant "$T/d" " on GPU" "--gpu-placement shared"
run_up "$T/e" PD_UP_FAKE_GPUS=4 "$BIN" up --model "$T/m"
nowant "$T/e" "CUDA_VISIBLE_DEVICES" "CPU replicas"
# a bad value: exit 2, naming the accepted ones (on a free port: the default may be taken)
"$BIN" up --model "$T/m" --gpu-placement sometimes --port "$(free_port_pair)" >"$T/f" 2>&1
rc=$?
[ $rc -eq 2 ] && grep -q "auto or shared" "$T/f" || { echo "FAIL: --gpu-placement sometimes: exit $rc"; fail=1; }
[ $fail -eq 0 ] && echo "up GPU placement: ok"
exit $fail

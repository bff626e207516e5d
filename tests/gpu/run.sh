#!/bin/sh
# Runs the CUDA backend's checks and benchmarks on a GPU host, from what
# tests/gpu/build.sh gathered into .carry-cuda/ (carry that folder there).
# Logs go to $OUT (or ./gpu-out): ops.log, model.log, bench.md.
#
# usage (repository root): tests/gpu/run.sh [ops] [model] [bench]   (default: all three)
set -u
cd "$(dirname "$0")/../.."
C=$PWD/.carry-cuda
O=${OUT:-$PWD/gpu-out}
mkdir -p "$O"
# cuBLAS is too large to carry: find the GPU host's own.
CUBLAS_DIR=
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/libcublasLt.so.13" ] && CUBLAS_DIR=$d && break
done
[ -z "$CUBLAS_DIR" ] && CUBLAS_DIR=$(dirname "$(find / -name 'libcublasLt.so.13*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$C/lib:$CUBLAS_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PD_SOURCE_DIR=$PWD PD_BUILD_DIR=${TMPDIR:-/tmp}/pdserve-gpu
mkdir -p "$PD_BUILD_DIR"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
echo "cuBLAS from $CUBLAS_DIR"
[ $# -eq 0 ] && set -- ops model bench
rc=0
for what in "$@"; do
    t0=$(date +%s)
    case $what in
    ops) "$C/bin/test_backend_ops" >"$O/ops.log" 2>&1 || rc=1; f=ops.log ;;
    model) "$C/bin/test_model_cuda" >"$O/model.log" 2>&1 || rc=1; f=model.log ;;
    bench) "$C/bin/bench_cuda" >"$O/bench.md" 2>&1 || rc=1; f=bench.md ;;
    *) echo "unknown step $what"; exit 2 ;;
    esac
    echo "== $what: $(($(date +%s) - t0)) s"
    grep -E '^\[  (FAILED|PASSED|SKIPPED) |worst normalised|^\[ cuda|^\[ tiny|over tolerance|backend error|error|FAIL' "$O/$f" | head -60
done
echo "== bench"
cat "$O/bench.md" 2>/dev/null
exit $rc

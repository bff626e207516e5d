#!/bin/sh
# Builds the libFuzzer harnesses (tests/fuzz/fuzz_*.c) with clang
# (-fsanitize=fuzzer,address,undefined) and runs each for FUZZ_SECONDS.
# `make fuzz FUZZ_SECONDS=N` calls this. Environment:
#   FUZZ_SECONDS  seconds per harness (default 60)
#   FUZZ_ONLY     run only these harnesses (space-separated names, e.g. "fuzz_stop")
#   BUILD_FUZZ    build directory (default build-fuzz)
#   PD_CACHE_DIR  where tokenizer-deepseek_v3/tokenizer.json is (default .cache)
#   JOBS          build parallelism (default nproc)
# Each harness starts from its committed seeds (tests/fuzz/corpus/<name>/)
# plus what earlier runs found (BUILD_FUZZ/corpus/<name>/, not committed).
# A crash, sanitizer report, leak or timeout leaves its input in
# BUILD_FUZZ/artifacts/ and makes this script fail; reproduce it with
#   BUILD_FUZZ/<name> BUILD_FUZZ/artifacts/<name>-crash-...
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
secs=${FUZZ_SECONDS:-60}
build=${BUILD_FUZZ:-$root/build-fuzz}
case "$build" in /*) ;; *) build="$root/$build" ;; esac
cache=${PD_CACHE_DIR:-$root/.cache}
jobs=${JOBS:-$(nproc)}

if ! command -v clang >/dev/null 2>&1; then
    echo "fuzz: clang is not installed (deploy/install-deps.sh installs clang and libclang-rt-14-dev)" >&2
    exit 1
fi
CC=clang cmake -S "$root/tests/fuzz" -B "$build" -DPD_CACHE_DIR="$cache" >/dev/null
cmake --build "$build" -j "$jobs"

mkdir -p "$build/artifacts" "$build/logs"
names=${FUZZ_ONLY:-$(cd "$root/tests/fuzz" && ls fuzz_*.c | sed 's/\.c$//')}
summary="$build/logs/summary.txt"
: >"$summary"
failed=""
t0=$(date +%s)
for name in $names; do
    seeds="$root/tests/fuzz/corpus/$name"
    work="$build/corpus/$name"
    mkdir -p "$work" "$seeds"
    dict=""
    [ -f "$root/tests/fuzz/$name.dict" ] && dict="-dict=$root/tests/fuzz/$name.dict"
    log="$build/logs/$name.log"
    echo "fuzz: $name for ${secs}s"
    rc=0
    # -timeout: one input running 10 s is a hang; -rss_limit_mb: growth is a leak
    PD_CACHE_DIR="$cache" "$build/$name" -max_total_time="$secs" -timeout=10 -rss_limit_mb=3072 \
        -print_final_stats=1 -artifact_prefix="$build/artifacts/$name-" $dict "$work" "$seeds" \
        >"$log" 2>&1 || rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    cov=$(grep -E '(DONE|pulse|INITED) +cov:' "$log" | tail -1 | sed -n 's/.*cov: \([0-9]*\) ft: \([0-9]*\) corp: \([0-9]*\).*/cov \1, features \2, corpus \3/p')
    if [ "$rc" -eq 0 ]; then
        result="ok"
    else
        result="FAILED (rc $rc, see $log)"
        failed="$failed $name"
        grep -E 'ERROR:|runtime error|fuzz check failed|SUMMARY' "$log" | head -5 >&2 || true
    fi
    printf '%-18s %4ss  %10s execs  %s  %s\n' "$name" "$secs" "${execs:-?}" "${cov:-?}" "$result" | tee -a "$summary"
done
echo "fuzz: $(($(date +%s) - t0)) s in all; summary in $summary"
if [ -n "$failed" ]; then
    echo "fuzz: failed:$failed (inputs in $build/artifacts/)" >&2
    exit 1
fi

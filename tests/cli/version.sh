#!/bin/sh
# pdserve version [--deps] on this machine, and the first log lines of every
# service: the version line first, then the libraries loaded at run time.
set -u
BIN=${PD_BIN:-build/pdserve}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0

want() { # want NAME FILE WORD...
    name=$1 file=$2
    shift 2
    for w in "$@"; do
        grep -qF -- "$w" "$file" || { echo "FAIL $name: lacks '$w':"; sed 's/^/    /' "$file"; fail=1; return; }
    done
    echo "ok   $name"
}

"$BIN" version >"$T/v" 2>&1 || { echo "FAIL version: exit $?"; fail=1; }
want version "$T/v" "pdserve 0.1.0 (commit " "CUDA " "sanitizers "
"$BIN" --version >"$T/v2" 2>&1 && cmp -s "$T/v" "$T/v2" || { echo "FAIL --version differs from version"; fail=1; }

"$BIN" version --deps >"$T/d" 2>&1 || { echo "FAIL version --deps: exit $?"; fail=1; }
want version_deps "$T/d" "built against" "loaded at run time" ZeroMQ protobuf-c nghttp2 jansson OpenSSL UCX \
    libevent PCRE2 OpenBLAS libcurl " mismatch"
if grep -q "CUDA on" "$T/v"; then
    want version_deps_cuda "$T/d" "CUDA runtime" "CUDA driver" "cuBLASLt"
fi
# every library row has a loaded version (a number, or "no device" for CUDA)
awk 'NR > 3 && NF >= 3 && $1 != "^" && !/libraries,/ && $NF == "unknown" { print; bad = 1 } END { exit bad }' "$T/d" ||
    { echo "FAIL version_deps: a library reported 'unknown'"; fail=1; }
"$BIN" version --bogus >/dev/null 2>&1
[ $? -eq 2 ] || { echo "FAIL version --bogus: want exit 2"; fail=1; }

# services log the version first, then the libraries, even when they then fail
for svc in gateway prefill decode; do
    "$BIN" $svc --model "$T/no-such-model" >"$T/$svc.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && [ $rc -lt 128 ] || { echo "FAIL $svc on a missing model: exit $rc"; fail=1; }
    head -1 "$T/$svc.log" | grep -qF "$svc: pdserve 0.1.0 (commit " ||
        { echo "FAIL $svc: first log line is not the version:"; head -3 "$T/$svc.log"; fail=1; continue; }
    sed -n 2p "$T/$svc.log" | grep -qF "libraries loaded: ZeroMQ " ||
        { echo "FAIL $svc: second log line is not the libraries:"; head -3 "$T/$svc.log"; fail=1; continue; }
    echo "ok   $svc logs its version first"
done
exit $fail

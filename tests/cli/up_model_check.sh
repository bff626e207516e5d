#!/bin/sh
# pdserve up checks the model directory before it prints its banner or starts
# a child (as vLLM and SGLang do): a missing or unreadable config.json, an
# unparsable one, a missing tokenizer or missing weights each end up at once
# with exit 2 and a message naming the file. Each case is a copy of a tiny
# checkpoint ('pdserve mkmodel --preset tiny') with one thing broken.
set -u
. "$(dirname "$0")/lib.sh"
BIN=${PD_BIN:-build/pdserve}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0
"$BIN" mkmodel --preset tiny --seed 1 --out "$T/m" >/dev/null 2>&1 || { echo "FAIL: mkmodel"; exit 1; }
port=$(free_port_pair)
# broken NAME HOW: $T/NAME, a copy of $T/m (hard links) changed by the shell command HOW
broken() {
    cp -rl "$T/m" "$T/$1"
    (cd "$T/$1" && eval "$2")
}
# check NAME WANT [up flags]: up on $T/NAME exits 2 at once, saying WANT, having started nothing
check() {
    name=$1 want=$2
    shift 2
    timeout 20 "$BIN" up --model "$T/$name" --port "$port" "$@" >"$T/out" 2>&1
    rc=$?
    if [ $rc -ne 2 ] || ! grep -qF "pdserve up: $want" "$T/out" ||
        grep -q "gateway on http\|try:\|pdserve gateway\|pdserve prefill\|pdserve decode\|INFO" "$T/out"; then
        echo "FAIL $name: exit $rc, want 2 and 'pdserve up: $want' before any child:"
        sed 's/^/    /' "$T/out"
        fail=1
    else
        echo "ok   $name: $want"
    fi
}
check no-such-dir "$T/no-such-dir/config.json: cannot open: No such file or directory"
broken no-config 'rm config.json'
check no-config "$T/no-config/config.json: cannot open: No such file or directory"
broken bad-config 'rm config.json && echo "{\"model_type\": " >config.json'
check bad-config "$T/bad-config/config.json"
broken no-tokenizer 'rm tokenizer.json'
check no-tokenizer "$T/no-tokenizer/tokenizer.json: cannot open: No such file or directory"
check m "$T/no-such-tokenizer.json: cannot open: No such file or directory" --tokenizer "$T/no-such-tokenizer.json"
check m "$T/no-such-tokenizer.json: cannot open: No such file or directory" "--tokenizer=$T/no-such-tokenizer.json"
broken no-weights 'rm model.safetensors'
check no-weights "$T/no-weights: neither model.safetensors.index.json nor model.safetensors found"
exit $fail

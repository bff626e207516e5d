#!/bin/sh
# pdserve generate --tensor-parallel-size 2 --enable-expert-parallel on the
# CPU (two rank threads): the same greedy ids as TP 1 on tiny and tiny-v2,
# each rank logs the experts it holds; a size that does not divide
# n_routed_experts exits 1 with a message naming it. (The logits bounds,
# TP 4 and the ranks' weights are test_tp's.)
set -u
BIN=${PD_BIN:-build/pdserve}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0
for preset in tiny tiny-v2; do
    "$BIN" mkmodel --preset $preset --seed 5 --out "$T/$preset" >/dev/null 2>&1 || { echo "FAIL: mkmodel $preset"; exit 1; }
    gen() { "$BIN" generate --model "$T/$preset" --prompt-ids 3,141,59,26,535,89 -n 12 --ids --ignore-eos --threads 1 "$@"; }
    ref=$(gen 2>"$T/err1") || { echo "FAIL: $preset TP 1: $(cat "$T/err1")"; fail=1; continue; }
    got=$(gen --tensor-parallel-size 2 --enable-expert-parallel 2>"$T/err2") ||
        { echo "FAIL: $preset TP 2 EP: $(cat "$T/err2")"; fail=1; continue; }
    [ -n "$ref" ] && [ "$got" = "$ref" ] || { echo "FAIL: $preset TP 2 EP ids '$got', TP 1 '$ref'"; fail=1; }
    for r in "0/2: routed experts \[0, 4) of 8" "1/2: routed experts \[4, 8) of 8"; do
        grep -q "expert parallel rank $r" "$T/err2" || { echo "FAIL: $preset: no log line 'rank $r'"; fail=1; }
    done
done
# 6 routed experts at size 4 (heads, intermediate sizes and groups divide 4)
python3 - "$T/tiny-v2/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["n_routed_experts"] = 6
json.dump(c, open(sys.argv[1], "w"))
PY
"$BIN" generate --model "$T/tiny-v2" --prompt-ids 1,2 -n 1 --ids --tensor-parallel-size 4 --enable-expert-parallel \
    >/dev/null 2>"$T/err"
rc=$?
if [ $rc -ne 1 ] || ! grep -q "tensor parallel size 4 does not divide n_routed_experts (6)" "$T/err"; then
    echo "FAIL: 6 experts at EP 4: exit $rc, $(cat "$T/err")"; fail=1
fi
[ $fail -eq 0 ] && echo "generate --enable-expert-parallel: ok"
exit $fail

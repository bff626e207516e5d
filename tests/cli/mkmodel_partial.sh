#!/bin/sh
# pdserve mkmodel never leaves a checkpoint that looks whole but is not:
# config.json (make's target for the model) is written last, and a missing
# tokenizer fails before anything is written. `make model` takes the
# tokenizer from the cache it fetched into ($PD_CACHE_DIR when set).
set -u
BIN=${PD_BIN:-build/pdserve}
SRC=${PD_SOURCE_DIR:-.}
TOKDIR=${PD_CACHE_DIR:-$SRC/.cache}/tokenizer-deepseek_v3
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0
# 1. no tokenizer: exit 1 naming the file, nothing written
"$BIN" mkmodel --preset tiny --seed 1 --out "$T/m1" --tokenizer-dir "$T/none" >/dev/null 2>"$T/err"
rc=$?
if [ $rc -ne 1 ] || ! grep -q "$T/none/tokenizer.json" "$T/err"; then
    echo "FAIL: missing tokenizer: exit $rc, $(cat "$T/err")"; fail=1
fi
[ -e "$T/m1" ] && { echo "FAIL: missing tokenizer: $T/m1 was created: $(ls "$T/m1")"; fail=1; }
# 2. a failure after the weights (tokenizer.json cannot be created: a
#    directory is in the way): no config.json
mkdir -p "$T/m2/tokenizer.json"
"$BIN" mkmodel --preset tiny --seed 1 --out "$T/m2" --tokenizer-dir "$TOKDIR" >/dev/null 2>"$T/err"
rc=$?
[ $rc -eq 1 ] || { echo "FAIL: blocked tokenizer.json: exit $rc, want 1"; fail=1; }
[ -e "$T/m2/config.json" ] && { echo "FAIL: a failed mkmodel left config.json"; fail=1; }
# 3. success writes all four files
"$BIN" mkmodel --preset tiny --seed 1 --out "$T/m3" --tokenizer-dir "$TOKDIR" >/dev/null 2>"$T/err" ||
    { echo "FAIL: mkmodel: $(cat "$T/err")"; fail=1; }
for f in config.json model.safetensors tokenizer.json tokenizer_config.json; do
    [ -s "$T/m3/$f" ] || { echo "FAIL: mkmodel did not write $f"; fail=1; }
done
# 4. make model passes the cache it fetched into to mkmodel
if command -v make >/dev/null 2>&1 && [ -f "$SRC/Makefile" ]; then
    out=$(make -n -C "$SRC" "$T/m4/config.json" MODEL="$T/m4" PD_CACHE_DIR="$T/cache" 2>&1)
    echo "$out" | grep -q -- "--tokenizer-dir $T/cache/tokenizer-deepseek_v3" ||
        { echo "FAIL: make does not give mkmodel \$PD_CACHE_DIR's tokenizer:"; echo "$out"; fail=1; }
fi
[ $fail -eq 0 ] && echo "mkmodel partial checkpoints: ok"
exit $fail

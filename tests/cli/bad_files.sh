#!/bin/sh
# Malformed checkpoints: each must give a clear message naming the file
# (and the tensor or field) and a non-zero exit — never a crash (exit >= 128)
# and never success. Cases are made from a valid tiny checkpoint by
# tests/cli/corrupt.py.
set -u
BIN=${PD_BIN:-build/pdserve}
SRC=${PD_SOURCE_DIR:-.}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
"$BIN" mkmodel --preset tiny --seed 3 --out "$T/base" >/dev/null 2>&1 || { echo "mkmodel failed"; exit 1; }
# the base model must work, or every case below would pass trivially
"$BIN" generate --model "$T/base" --prompt-ids 1,2,3 -n 2 --ids >/dev/null 2>"$T/base.err" || {
    echo "FAIL: the unmodified model does not run:"; cat "$T/base.err"; exit 1; }
fail=0
for case in truncated header_past_end header_short malformed_json not_object overlap out_of_range \
            span_mismatch unknown_dtype missing_tensor shape_mismatch duplicate_name \
            config_missing_field config_bad_type config_bad_model_type config_malformed empty_file \
            missing_scale; do
    rm -rf "$T/m"
    cp -r "$T/base" "$T/m"
    expect=$(python3 "$SRC/tests/cli/corrupt.py" "$T/m" "$case") || { echo "corrupt.py $case failed"; fail=1; continue; }
    "$BIN" generate --model "$T/m" --prompt-ids 1,2,3 -n 2 >"$T/out" 2>"$T/err"
    rc=$?
    msg=$(cat "$T/err")
    if [ $rc -eq 0 ]; then
        echo "FAIL $case: exit 0"; fail=1
    elif [ $rc -ge 128 ]; then
        echo "FAIL $case: crashed (exit $rc): $msg"; fail=1
    else
        for want in $expect; do
            case "$msg" in
                *"$want"*) ;;
                *) echo "FAIL $case: message lacks '$want': $msg"; fail=1 ;;
            esac
        done
        echo "ok   $case (exit $rc): $(echo "$msg" | head -1)"
    fi
done
exit $fail

#!/bin/sh
# pdserve up routes every gateway flag to the gateway in both forms,
# "--flag value" and "--flag=value" (getopt_long accepts both in the services).
# Each run gives the flag a value that is not a number, and the gateway an
# unknown --reasoning-parser, so the gateway exits at once (and up stops the
# replicas): a numeric gateway flag must draw the gateway's own complaint
# about that flag, and no flag may reach a replica (which would call it
# unknown).
set -u
. "$(dirname "$0")/lib.sh"
BIN=${PD_BIN:-build/pdserve}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0
# up checks the model before it starts anything: a real one (tiny)
"$BIN" mkmodel --preset tiny --seed 1 --out "$T/m" >/dev/null 2>&1 || { echo "FAIL: mkmodel"; exit 1; }
# a free port P with P + 1 free too (up refuses a busy HTTP or control port)
port=$(free_port_pair)
# the gateway's flags, from its own --help; --control is up's to set (PORT + 1)
flags=$("$BIN" gateway --help | awk '$1 ~ /^--/ && $1 != "--control" { print substr($1, 3) }')
[ -n "$flags" ] || { echo "FAIL: no flags in 'pdserve gateway --help'"; exit 1; }
strings=" model served-model-name tokenizer host ssl-certfile ssl-keyfile reasoning-parser tool-call-parser "
n=0
for f in $flags; do
    for form in space equals; do
        model="--model $T/m"
        [ "$f" = model ] && model=""
        if [ $form = space ]; then set -- --$f abc; else set -- --$f=abc; fi
        # shellcheck disable=SC2086
        timeout 30 "$BIN" up $model --port "$port" --reasoning-parser no-such-parser "$@" >"$T/out" 2>&1
        rc=$?
        [ $rc -lt 124 ] || { echo "FAIL --$f ($form): exit $rc"; fail=1; continue; }
        if grep -q "unknown or incomplete flag '--$f" "$T/out"; then
            echo "FAIL --$f ($form) reached a replica:"; sed 's/^/    /' "$T/out"; fail=1; continue
        fi
        case "$strings" in
        *" $f "*) # a string: taken as given; --model=abc must still count as --model
            if grep -q "model is required" "$T/out"; then
                echo "FAIL --$f ($form): up did not take it"; sed 's/^/    /' "$T/out"; fail=1; continue
            fi ;;
        *)
            grep -qE "^pdserve (up|gateway): --$f needs (an integer|a number), got 'abc'" "$T/out" ||
                { echo "FAIL --$f ($form): the gateway did not get it:"; sed 's/^/    /' "$T/out"; fail=1; continue; } ;;
        esac
        n=$((n + 1))
    done
done
[ "$n" -ge 50 ] || { echo "FAIL: only $n flag checks passed (expected every gateway flag in 2 forms)"; fail=1; }
# --tokenizer is the gateway's and the replicas' too (constrained decoding reads it there): both forms
cp "$T/m/tokenizer.json" "$T/tok.json"
for form in space equals; do
    if [ $form = space ]; then set -- --tokenizer "$T/tok.json"; else set -- "--tokenizer=$T/tok.json"; fi
    "$BIN" up --model "$T/m" --port "$port" "$@" >"$T/up.log" 2>&1 &
    up=$!
    got=0 k=0
    while [ $k -lt 100 ] && [ $got -lt 3 ]; do
        got=0
        for c in $(pgrep -P $up); do
            tr '\0' ' ' <"/proc/$c/cmdline" 2>/dev/null | grep -q -- "--tokenizer[= ]$T/tok.json" && got=$((got + 1))
        done
        sleep 0.1; k=$((k + 1))
    done
    kill -INT $up; wait $up 2>/dev/null
    [ $got -eq 3 ] || { echo "FAIL: --tokenizer ($form) reached $got of gateway, prefill, decode"; fail=1; }
done
[ $fail -eq 0 ] && echo "ok   $n gateway flag forms reach the gateway"
exit $fail

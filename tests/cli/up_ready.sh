#!/bin/sh
# pdserve up prints "pdserve up: ready: ..." once every replica it started has
# registered with the gateway (it polls the gateway's /metrics), and only
# then its "try: curl ..." line. Ready means serving: right after that line
# /health answers 200 and the printed curl command completes (200, text),
# on the short route and, with a low --long-prompt-threshold, the long one
# (through the prefill replica). A walkthrough found the old banner printed
# ~3.5 s before the decode replica registered: its command got a 503.
set -u
. "$(dirname "$0")/lib.sh"
BIN=${PD_BIN:-build/pdserve}
T=$(mktemp -d)
up=
trap '[ -n "$up" ] && kill -INT $up 2>/dev/null; wait 2>/dev/null; rm -rf "$T"' EXIT
fail=0
await_ready() { # await_ready OUT: until OUT has up's ready line, up ($up) exits, or 60 s
    for _ in $(seq 600); do
        grep -q "^pdserve up: ready" "$1" && return
        kill -0 "$up" 2>/dev/null || return
        sleep 0.1
    done
}
"$BIN" mkmodel --preset tiny --seed 1 --out "$T/m" >/dev/null 2>&1 || { echo "FAIL: mkmodel"; exit 1; }
port=$(free_port_pair)
"$BIN" up --model "$T/m" --port "$port" --served-model-name tiny --long-prompt-threshold 8 --threads 1 \
    >"$T/out" 2>"$T/err" &
up=$!
await_ready "$T/out"
if ! grep -q "^pdserve up: ready: 1 prefill + 1 decode replicas registered, [0-9.]* s after start$" "$T/out"; then
    echo "FAIL: no ready line within 60 s"; sed 's/^/    /' "$T/out" "$T/err"; exit 1
fi
echo "ok   ready line: $(grep '^pdserve up: ready' "$T/out")"
# "try:" comes after "ready", never before
if [ "$(grep -n '^try:' "$T/out" | cut -d: -f1)" -le "$(grep -n '^pdserve up: ready' "$T/out" | cut -d: -f1)" ]; then
    echo "FAIL: try: before ready"; sed 's/^/    /' "$T/out"; fail=1
fi
st=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")
[ "$st" = 200 ] && echo "ok   /health 200 right after ready" || { echo "FAIL: /health $st after ready"; fail=1; }
# the printed command, as printed (a short prompt); then a short and a long
# completion
cmd=$(sed -n '/^try:/{n;N;p}' "$T/out" | sed 's/\\$//' | tr -d '\n')
body=$(sh -c "$cmd -s -w ' %{http_code}'" 2>&1)
case "$body" in
*'"content":'*' 200') echo "ok   the printed curl command: 200" ;;
*) echo "FAIL: the printed curl command: $body"; fail=1 ;;
esac
for prompt in "Hi" "one two three four five six seven eight nine ten eleven twelve"; do
    r=$(curl -s -w ' %{http_code}' "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"tiny\", \"prompt\": \"$prompt\", \"max_tokens\": 4, \"ignore_eos\": true}")
    case "$r" in
    *'"completion_tokens":4'*' 200') echo "ok   completion ($prompt): 200" ;;
    *) echo "FAIL: completion ($prompt): $r"; fail=1 ;;
    esac
done
m=$(curl -s "http://127.0.0.1:$port/metrics")
for cls in short long; do
    n=$(printf '%s\n' "$m" | sed -n "s/^pdserve:requests_routed_total{class=\"$cls\"} //p")
    [ "${n:-0}" -ge 1 ] && echo "ok   $cls route taken ($n)" || { echo "FAIL: $cls route not taken ($n)"; fail=1; }
done
kill -INT $up
wait $up
rc=$?
up=
[ $rc -eq 0 ] && echo "ok   Ctrl-C: exit 0" || { echo "FAIL: up exited $rc after SIGINT"; fail=1; }
# the printed command works whatever the served name holds: JSON-escaped,
# then quoted for the shell (a walkthrough's name with ' and " broke it)
port=$(free_port_pair)
"$BIN" up --model "$T/m" --port "$port" --served-model-name "it's \"q\" \\x" --prefill-replicas 0 --threads 1 \
    --long-prompt-threshold 16 \
    >"$T/out3" 2>&1 &
up=$!
await_ready "$T/out3"
cmd=$(sed -n '/^try:/{n;N;p}' "$T/out3" | sed 's/\\$//' | tr -d '\n')
body=$(sh -c "$cmd -s -w ' %{http_code}'" 2>&1)
case "$body" in
*'"content":'*' 200') echo "ok   the printed curl command with a served name holding ' \" \\: 200" ;;
*) echo "FAIL: the printed curl command with a quoted name: $body"; sed 's/^/    /' "$T/out3"; fail=1 ;;
esac
grep -q "^pdserve up: no prefill replica: the decode replicas prefill every prompt, those over 16 tokens too" \
    "$T/out3" && echo "ok   --prefill-replicas 0 is called out" || { echo "FAIL: no note for --prefill-replicas 0"; fail=1; }
# and a prompt over the threshold is served by the decode replica (it got a
# 503 "needs a prefill replica" before)
r=$(curl -s -w ' %{http_code}' "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "it'"'"'s \"q\" \\x", "prompt": [5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30], "max_tokens": 3, "ignore_eos": true}')
case "$r" in
*'"completion_tokens":3'*' 200') echo "ok   a prompt over the threshold with no prefill replica: 200 from the decode replica" ;;
*) echo "FAIL: a long prompt with no prefill replica: $r"; fail=1 ;;
esac
kill -INT $up
wait $up
up=
# a replica that cannot start (here a flag value it refuses) never makes the
# stack whole: up stops the rest and exits 1 instead of serving 503s for
# ever (a walkthrough found it waiting)
port=$(free_port_pair)
timeout 60 "$BIN" up --model "$T/m" --port "$port" --max-num-seqs 0 >"$T/out2" 2>&1
rc=$?
if [ $rc -eq 1 ] && grep -q "decode-0 (pid [0-9]*) exited with status [0-9]* before the stack was ready; stopping" "$T/out2" &&
    ! grep -q "^pdserve up: ready" "$T/out2"; then
    echo "ok   a replica that cannot start: up exits 1"
else
    echo "FAIL: a replica that cannot start: exit $rc"; sed 's/^/    /' "$T/out2"; fail=1
fi
exit $fail

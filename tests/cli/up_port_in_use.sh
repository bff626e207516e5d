#!/bin/sh
# pdserve up on a busy port refuses before any child starts (exit 2, naming
# the port): its replicas would otherwise register, under the same ids, with
# the gateway already there and take over its replicas. And when its gateway
# exits by itself (here: an unknown --reasoning-parser), up stops the rest,
# reports how each child ended, and exits 1.
set -u
BIN=${PD_BIN:-build/pdserve}
T=$(mktemp -d)
fail=0
# two free ports next to each other, held by a listener for the busy cases
port=$(python3 -c 'import socket
for p in range(18700, 18900, 2):
    try:
        a = socket.socket(); a.bind(("127.0.0.1", p)); b = socket.socket(); b.bind(("127.0.0.1", p + 1))
        print(p); break
    except OSError: pass')
[ -n "$port" ] || { echo "FAIL: no free pair of ports"; exit 1; }
hold() { # hold PORT: listen on 127.0.0.1:PORT until killed
    # a fresh file: the previous holder's "up" must not be read as this one's
    # (the background shell truncates it only when it gets to run)
    rm -f "$T/hold"
    python3 -c 'import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(); print("up", flush=True); time.sleep(60)' "$1" >"$T/hold" &
    holder=$!
    for _ in $(seq 50); do grep -q up "$T/hold" 2>/dev/null && return; sleep 0.2; done
    echo "FAIL: could not hold port $1"; exit 1
}
holder=
trap 'kill $holder 2>/dev/null; rm -rf "$T"' EXIT
"$BIN" mkmodel --preset tiny --seed 1 --out "$T/m" >/dev/null 2>&1 || { echo "FAIL: mkmodel"; exit 1; }
for busy in "$port" "$((port + 1))"; do
    hold "$busy"
    timeout 20 "$BIN" up --model "$T/m" --port "$port" >"$T/out" 2>&1
    rc=$?
    if [ "$busy" = "$port" ]; then want="port $port (HTTP on 127.0.0.1) is in use"
    else want="port $busy (control, --port + 1, on 127.0.0.1) is in use"; fi
    if [ $rc -ne 2 ] || ! grep -qF "$want" "$T/out" ||
        grep -q "registered\|gateway on http" "$T/out"; then
        echo "FAIL busy $busy: exit $rc"; sed 's/^/    /' "$T/out"; fail=1
    else
        echo "ok   port $busy busy: refused before any child started"
    fi
    kill $holder; wait $holder 2>/dev/null
done
# free ports, but the gateway cannot start: up exits 1, not 0, and says how
# each of its three children ended (the replicas, stopped by up, too)
timeout 60 "$BIN" up --model "$T/m" --port "$port" --reasoning-parser no-such-parser >"$T/out" 2>&1
rc=$?
if [ $rc -ne 1 ] || ! grep -q "gateway (pid [0-9]*) exited with status 2" "$T/out"; then
    echo "FAIL gateway that cannot start: exit $rc (want 1)"; sed 's/^/    /' "$T/out"; fail=1
else
    echo "ok   gateway that cannot start: up exits 1"
fi
for c in prefill-0 decode-0; do
    if ! grep -qE "pdserve up: $c \(pid [0-9]+\) (exited with status|killed by signal) [0-9]+" "$T/out"; then
        echo "FAIL: $c's end not reported"; sed 's/^/    /' "$T/out"; fail=1
    fi
done
exit $fail

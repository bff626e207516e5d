#!/bin/bash
# docker compose on one host, end to end (issue 5):
#   1. a Docker engine: the running one, else docker.io + docker-compose from
#      Debian and dockerd started here (stopped again at the end); none can
#      be had: SKIP with the reason, exit 0
#   2. images: deploy/base-image.sh (debootstrap; no registry needed), then
#      deploy/Dockerfile on it, context = the checkout's files (git ls-files)
#   3. model-init + gateway + 2 prefill + 2 decode (--scale)
#   4. a mix of long (> --long-prompt-threshold tokens: prefill replica, KV
#      over UCX/TCP between containers) and short requests with curl; /metrics
#      shows that every replica served some
#  4b. Prometheus (--profile monitoring; its image made from Debian's package)
#      scrapes the gateway and holds every replica's series
#   5. decode scaled to 1 while streams run: the removed replica drains
#      (SIGTERM), so every stream finishes whole and none hangs;
#      new requests succeed
#   6. docker compose down -v: no container, network or volume left
#
# Environment: COMPOSE_TEST_PRESET (tiny), COMPOSE_TEST_BASE_IMAGE (build one
# with deploy/base-image.sh: pdserve/debian:bookworm), COMPOSE_TEST_KEEP=1
# (leave the stack up on failure), COMPOSE_TEST_INSTALL=0 (never apt-get).
# Prints one line per check and 'compose_test: N passed, N failed' at the end.
set -u
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
T0=$(date +%s)
WORK=$(mktemp -d /tmp/compose_test.XXXXXX)
PROJECT="pdserve-ct$$"
IMAGE="pdserve/pdserve:compose-test"
PRESET="${COMPOSE_TEST_PRESET:-tiny}"
BASE_IMAGE="${COMPOSE_TEST_BASE_IMAGE:-pdserve/debian:bookworm}"
THRESHOLD=64
PASS=0
FAIL=0
DOCKERD_PID=""
STACK_UP=0

log() { echo "compose_test [$(($(date +%s) - T0))s]: $*"; }
check() { # check "what" cond...
    local what="$1"
    shift
    if "$@"; then
        PASS=$((PASS + 1))
        echo "ok   - $what"
    else
        FAIL=$((FAIL + 1))
        echo "FAIL - $what"
    fi
}
skip() {
    # no "N passed" line here: the CI's other tests ran, this one did not
    echo "compose_test: SKIP (docker compose end-to-end test not run): $*"
    cleanup_engine
    rm -rf "$WORK"
    exit 0
}
cleanup_engine() {
    if [ -n "$DOCKERD_PID" ]; then
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 1 40); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.25; done
        log "stopped the dockerd this test started (pid $DOCKERD_PID)"
        DOCKERD_PID=""
    fi
}
finish() {
    local rc=$?
    if [ "$STACK_UP" = 1 ]; then
        if [ "$FAIL" -gt 0 ] || [ "$rc" != 0 ]; then
            echo "---- logs (last 30 lines per service) ----"
            $COMPOSE logs --no-color --tail=30 2>&1 | tail -n 200
        fi
        if [ "${COMPOSE_TEST_KEEP:-0}" = 1 ]; then
            log "COMPOSE_TEST_KEEP=1: left project $PROJECT up"
        else
            $COMPOSE --profile monitoring down -v --remove-orphans >/dev/null 2>&1
        fi
    fi
    cleanup_engine
    rm -rf "$WORK"
}
trap finish EXIT
trap 'exit 130' INT TERM

can_install() { [ "${COMPOSE_TEST_INSTALL:-1}" != 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >"$WORK/apt.log" 2>&1 ||
        { apt-get update -q >>"$WORK/apt.log" 2>&1 &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >>"$WORK/apt.log" 2>&1; }
}

# ---- 1. the engine -------------------------------------------------------------
if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
    can_install || skip "no Docker engine (dockerd) and cannot apt-get install docker.io here"
    log "installing docker.io, docker-compose, debootstrap from Debian"
    apt_install docker.io docker-compose debootstrap iptables ||
        skip "apt-get install docker.io docker-compose failed: $(tail -n 3 "$WORK/apt.log" | tr '\n' ' ')"
fi
if ! timeout 20 docker info >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || skip "no running Docker engine and not root to start dockerd"
    log "starting dockerd"
    mkdir -p "$WORK/dockerd"
    dockerd --pidfile "$WORK/dockerd/dockerd.pid" >"$WORK/dockerd/log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 1 60); do
        timeout 5 docker info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 0.5
    done
    if ! timeout 10 docker info >/dev/null 2>&1; then
        reason=$(grep -iE "level=(fatal|error)" "$WORK/dockerd/log" | tail -n 3 | tr '\n' ' ')
        skip "dockerd does not start on this machine: ${reason:-$(tail -n 3 "$WORK/dockerd/log" | tr '\n' ' ')}"
    fi
fi
log "engine: $(docker version -f 'server {{.Server.Version}}, client {{.Client.Version}}' 2>/dev/null)"
if docker compose version >/dev/null 2>&1; then
    COMPOSE_BIN="docker compose"
elif command -v docker-compose >/dev/null 2>&1; then
    COMPOSE_BIN="docker-compose"
else
    can_install && apt_install docker-compose
    command -v docker-compose >/dev/null 2>&1 || skip "no docker compose (plugin or docker-compose) and cannot install it"
    COMPOSE_BIN="docker-compose"
fi
COMPOSE="$COMPOSE_BIN -p $PROJECT -f $ROOT/deploy/docker-compose.yml"
log "compose: $($COMPOSE_BIN version 2>/dev/null | head -n 1)"

# ---- 2. images -----------------------------------------------------------------
t=$(date +%s)
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    if [ "$BASE_IMAGE" = pdserve/debian:bookworm ]; then
        command -v debootstrap >/dev/null 2>&1 || { can_install && apt_install debootstrap; }
        deploy/base-image.sh "$BASE_IMAGE" || { echo "FAIL - deploy/base-image.sh"; exit 1; }
    else
        docker pull "$BASE_IMAGE" || { echo "FAIL - base image $BASE_IMAGE: neither here nor pullable"; exit 1; }
    fi
fi
T_BASE=$(($(date +%s) - t))
log "base image $BASE_IMAGE ready (${T_BASE}s)"

# The image, from the checkout's own files (deploy/build-image.sh: what git
# lists, plus the tokenizer when make already fetched it), never build/ or models/.
t=$(date +%s)
stamp() { local line; while IFS= read -r line; do printf '%(%s)T %s\n' -1 "$line"; done; }
PDSERVE_BASE_IMAGE="$BASE_IMAGE" PDSERVE_BUILD_IMAGE="$BASE_IMAGE" deploy/build-image.sh -t "$IMAGE" 2>&1 |
    stamp >"$WORK/build.log"
if [ "${PIPESTATUS[0]}" = 0 ]; then
    T_BUILD=$(($(date +%s) - t))
    cached=$(grep -c "Using cache" "$WORK/build.log")
    log "built $IMAGE in ${T_BUILD}s ($cached steps from cache), $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
    # the slow steps (seconds from one Dockerfile step to the next)
    awk -v end="$(date +%s)" '$2 == "Step" {if (s != "") d[s] = $1 - t; s = $3 " " substr($0, index($0, $4), 70); t = $1}
        END {if (s != "") d[s] = end - t; for (k in d) if (d[k] >= 5) printf "    %4ds  step %s\n", d[k], k}' \
        "$WORK/build.log" | sort -k3,3n
    check "image builds (deploy/Dockerfile on $BASE_IMAGE)" true
else
    tail -n 40 "$WORK/build.log"
    check "image builds (deploy/Dockerfile on $BASE_IMAGE)" false
    exit 1
fi
check "runtime image has pdserve and its libraries" docker run --rm --entrypoint sh "$IMAGE" -c \
    '! ldd /usr/local/bin/pdserve | grep -q "not found" && pdserve --help >/dev/null && test -s /usr/share/pdserve/tokenizer/tokenizer.json'
check "runtime image has no compiler" docker run --rm --entrypoint sh "$IMAGE" -c '! command -v cc && ! command -v cmake'

# ---- 3. the stack ----------------------------------------------------------------
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export PDSERVE_IMAGE="$IMAGE" PDSERVE_PRESET="$PRESET" PDSERVE_PORT="$PORT" PDSERVE_HOST=127.0.0.1
export PDSERVE_LONG_PROMPT_THRESHOLD="$THRESHOLD"
# one thread per replica (2 cores, 5 processes); decode steps slowed so that
# streams are still running when decode is scaled down
export PDSERVE_PREFILL_ARGS="--threads 1"
export PDSERVE_DECODE_ARGS="--threads 1 --debug-step-delay-ms 20"
URL="http://127.0.0.1:$PORT"
MODEL_NAME="$PRESET"

metrics() { curl -s -m 5 "$URL/metrics"; }
metric() { # metric NAME{labels} -> value (0 when absent)
    metrics | awk -v k="$1" '$1 == k {v = $2} END {print v == "" ? 0 : v}'
}
alive() { metric "pdserve:replicas_alive{role=\"$1\"}"; }
wait_alive() { # wait_alive DECODE PREFILL SECONDS
    local end=$(($(date +%s) + $3))
    while [ "$(date +%s)" -lt "$end" ]; do
        [ "$(alive decode)" = "$1" ] && [ "$(alive prefill)" = "$2" ] && return 0
        sleep 0.5
    done
    return 1
}
hostnames() { # hostnames SERVICE: the replica ids of its running containers
    local ids
    ids=$($COMPOSE ps -q "$1" 2>/dev/null)
    [ -n "$ids" ] && docker inspect -f '{{if .State.Running}}{{.Config.Hostname}}{{end}}' $ids | grep . | sort
}

t=$(date +%s)
STACK_UP=1
if ! $COMPOSE up -d --no-build --scale prefill=2 --scale decode=2 >"$WORK/up.log" 2>&1; then
    cat "$WORK/up.log"
    check "docker compose up (model-init, gateway, 2 prefill, 2 decode)" false
    exit 1
fi
check "model-init created the model in the volume and exited 0" \
    test "$(docker inspect -f '{{.State.ExitCode}}' "$($COMPOSE ps -a -q model-init)")" = 0
check "2 decode + 2 prefill replicas registered with the gateway" wait_alive 2 2 120
T_UP=$(($(date +%s) - t))
log "stack up in ${T_UP}s on http://127.0.0.1:$PORT"
DECODES=$(hostnames decode)
PREFILLS=$(hostnames prefill)
check "replica ids are the containers' hostnames, all distinct ($(echo $DECODES $PREFILLS))" \
    test "$(printf '%s\n' $DECODES $PREFILLS | sort -u | wc -l)" = 4
health=""
for _ in $(seq 1 30); do
    health=$(docker inspect -f '{{.State.Health.Status}}' "$($COMPOSE ps -q gateway)" 2>/dev/null)
    [ "$health" = healthy ] && break
    sleep 1
done
check "gateway healthcheck: $health" test "$health" = healthy

# ---- 4. long and short requests ---------------------------------------------------
LONG_TEXT=$(python3 -c 'print(" ".join("the quick brown fox %d jumps over the lazy dog." % i for i in range(40)))')
short_req() { # short_req I OUT
    curl -s -m 120 -o "$2" -w '%{http_code}' "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"$MODEL_NAME\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello number $1, who are you?\"}], \"max_tokens\": 12}" >"$2.code"
}
long_req() { # long_req I OUT
    curl -s -m 120 -o "$2" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"$MODEL_NAME\", \"prompt\": \"Request $1. $LONG_TEXT\", \"max_tokens\": 12}" >"$2.code"
}
served_all() { # every replica has work in /metrics
    local m d p
    m=$(metrics)
    for d in $DECODES; do
        echo "$m" | awk -v k="pdserve:generation_tokens_total{replica=\"$d\"}" '$1 == k && $2 > 0 {f=1} END {exit !f}' || return 1
    done
    for p in $PREFILLS; do
        echo "$m" | awk -v k="pdserve:replica_prefill_tokens_total{replica=\"$p\",role=\"prefill\"}" '$1 == k && $2 > 0 {f=1} END {exit !f}' || return 1
    done
}
t=$(date +%s)
ok=0
total=0
mkdir -p "$WORK/r"
for round in 1 2 3; do
    pids=""
    for i in 1 2 3 4 5 6; do
        short_req "$round$i" "$WORK/r/s$round$i" &
        pids="$pids $!"
        long_req "$round$i" "$WORK/r/l$round$i" &
        pids="$pids $!"
    done
    wait $pids
    for f in "$WORK"/r/[sl]"$round"?; do
        total=$((total + 1))
        [ "$(cat "$f.code")" = 200 ] && grep -q '"finish_reason":"length"' "$f" && ok=$((ok + 1))
    done
    sleep 1.2 # counters reach /metrics with the next heartbeats
    served_all && break
done
T_MIX=$(($(date +%s) - t))
long_tokens=$(grep -ho '"prompt_tokens":[0-9]*' "$WORK"/r/l* | head -n 1 | cut -d: -f2)
check "$ok/$total requests (half long: ${long_tokens:-?} prompt tokens > $THRESHOLD) answered 200 with finish_reason length" \
    test "$ok" = "$total"
check "gateway routed both classes (short $(metric 'pdserve:requests_routed_total{class="short"}'), long $(metric 'pdserve:requests_routed_total{class="long"}'))" \
    test "$(metric 'pdserve:requests_routed_total{class="long"}')" -gt 0 -a "$(metric 'pdserve:requests_routed_total{class="short"}')" -gt 0
check "KV moved over UCX between containers ($(metric pdserve:kv_transfer_bytes_total) bytes)" \
    test "$(metric pdserve:kv_transfer_bytes_total)" -gt 0
metrics | grep -E '^pdserve:(generation_tokens_total|replica_prefill_tokens_total)' | sed 's/^/    /'
check "every replica served some: generation_tokens_total > 0 on each decode, replica_prefill_tokens_total > 0 on each prefill" served_all
log "request mix: $total requests in ${T_MIX}s"

# ---- 4b. Prometheus scraping the stack --------------------------------------------
# prom/prometheus cannot be pulled on a host without a registry: the image is
# made from Debian's prometheus package (deploy/prometheus/Dockerfile).
t=$(date +%s)
PROM_IMAGE="pdserve/prometheus:compose-test"
PROM_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
prom_count() { # prom_count QUERY -> number of series
    curl -s -m 5 "http://127.0.0.1:$PROM_PORT/api/v1/query" --data-urlencode "query=$1" |
        python3 -c 'import json, sys
try: print(len(json.load(sys.stdin)["data"]["result"]))
except Exception: print(0)'
}
prom_sees_all() {
    [ "$(prom_count 'pdserve:generation_tokens_total > 0')" = 2 ] &&
        [ "$(prom_count 'pdserve:replica_prefill_tokens_total{role="prefill"} > 0')" = 2 ]
}
prom_ok=0
if docker build -q -t "$PROM_IMAGE" --build-arg BASE_IMAGE="$BASE_IMAGE" deploy/prometheus >"$WORK/prom-build.log" 2>&1 &&
    PROMETHEUS_IMAGE="$PROM_IMAGE" PROMETHEUS_PORT="$PROM_PORT" \
        $COMPOSE --profile monitoring up -d --no-build --no-deps prometheus >"$WORK/prom-up.log" 2>&1; then
    for _ in $(seq 1 60); do prom_sees_all && { prom_ok=1; break; }; sleep 0.5; done
else
    tail -n 20 "$WORK/prom-build.log" "$WORK/prom-up.log"
fi
check "Prometheus (--profile monitoring) scrapes the gateway and has every replica's series ($(($(date +%s) - t))s)" test "$prom_ok" = 1

# ---- 5. scale decode to 1 while streams run ---------------------------------------
stream_req() { # stream_req I OUT KIND
    local body
    if [ "$3" = long ]; then
        body="{\"model\": \"$MODEL_NAME\", \"prompt\": \"Stream $1. $LONG_TEXT\", \"max_tokens\": 400, \"ignore_eos\": true, \"stream\": true}"
        curl -s -N -m 90 -o "$2" -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' -d "$body" >"$2.code"
    else
        body="{\"model\": \"$MODEL_NAME\", \"messages\": [{\"role\": \"user\", \"content\": \"Stream $1\"}], \"max_tokens\": 400, \"ignore_eos\": true, \"stream\": true}"
        curl -s -N -m 90 -o "$2" -w '%{http_code}' "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d "$body" >"$2.code"
    fi
    echo $? >"$2.rc"
}
running_on_all_decodes() {
    local m d
    m=$(metrics)
    for d in $DECODES; do
        echo "$m" | awk -v k="pdserve:num_requests_running{replica=\"$d\",role=\"decode\"}" '$1 == k && $2 > 0 {f=1} END {exit !f}' || return 1
    done
}
mkdir -p "$WORK/s"
pids=""
for i in 1 2 3 4 5 6 7 8; do
    kind=short
    [ $((i % 4)) = 0 ] && kind=long
    stream_req "$i" "$WORK/s/$i" "$kind" &
    pids="$pids $!"
done
spread=1
for _ in $(seq 1 40); do running_on_all_decodes && break; sleep 0.25; done
running_on_all_decodes || spread=0
check "streams running on both decode replicas before the scale-down" test "$spread" = 1
t=$(date +%s)
$COMPOSE up -d --no-build --no-deps --no-recreate --scale decode=1 decode >"$WORK/scale.log" 2>&1
scale_rc=$?
T_SCALE=$(($(date +%s) - t))
check "docker compose up --scale decode=1 (${T_SCALE}s)" test "$scale_rc" = 0
REMAINING=$(hostnames decode)
REMOVED=$(comm -23 <(printf '%s\n' $DECODES) <(printf '%s\n' $REMAINING))
log "removed decode replica: ${REMOVED:-?}; remaining: ${REMAINING:-none}"
wait $pids
errored=0
finished=0
bad=""
for i in 1 2 3 4 5 6 7 8; do
    f="$WORK/s/$i"
    rc=$(cat "$f.rc")
    if [ "$rc" = 28 ]; then
        bad="$bad $i:hung"
    elif [ "$(cat "$f.code")" != 200 ] || ! grep -q '^data: \[DONE\]' "$f"; then
        bad="$bad $i:code=$(cat "$f.code"),rc=$rc,no-[DONE]"
    elif grep -q '"error":{' "$f"; then
        if grep -q '"finish_reason":"[a-z]' "$f"; then bad="$bad $i:error-and-finish"; else errored=$((errored + 1)); fi
    elif grep -q '"finish_reason":"length"' "$f"; then
        finished=$((finished + 1))
    else
        bad="$bad $i:no-finish"
    fi
done
check "no stream hung; every stream ended with [DONE] (${bad:-all 8 well-formed})" test -z "$bad"
# the removed replica drained (SIGTERM: it finishes what it runs, then exits)
check "every stream finished whole, those on the removed replica too ($finished of 8 finish_reason length, $errored errored)" test "$finished" = 8
[ "$errored" -ge 1 ] && echo "    error event: $(grep -h '"error":{' "$WORK"/s/? | head -n 1 | cut -c1-200)"
check "gateway took the removed replica out of rotation" wait_alive 1 2 10
ok=0
pids=""
for i in 1 2 3; do
    short_req "after$i" "$WORK/r/as$i" &
    pids="$pids $!"
    long_req "after$i" "$WORK/r/al$i" &
    pids="$pids $!"
done
wait $pids
for f in "$WORK"/r/a[sl]?; do [ "$(cat "$f.code")" = 200 ] && grep -q '"finish_reason":"length"' "$f" && ok=$((ok + 1)); done
check "new requests after the scale-down succeed ($ok/6, short and long)" test "$ok" = 6

# ---- 6. tear down ----------------------------------------------------------------
t=$(date +%s)
$COMPOSE --profile monitoring down -v --remove-orphans >"$WORK/down.log" 2>&1
down_rc=$?
STACK_UP=0
T_DOWN=$(($(date +%s) - t))
left=$(docker ps -a -q --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
vols=$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
nets=$(docker network ls -q --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
check "docker compose down -v: $left containers, $vols volumes, $nets networks left (${T_DOWN}s)" \
    test "$down_rc" = 0 -a "$left" = 0 -a "$vols" = 0 -a "$nets" = 0

log "timings: base image ${T_BASE}s, image build ${T_BUILD}s, up ${T_UP}s, request mix ${T_MIX}s, scale-down ${T_SCALE}s, down ${T_DOWN}s; total $(($(date +%s) - T0))s"
echo "compose_test: $PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]

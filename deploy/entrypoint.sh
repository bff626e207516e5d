#!/bin/sh
# Entrypoint of the pdserve image. The first argument is a pdserve command
# (gateway, prefill, decode, ...) or init-model; flags given on the command
# line win over the environment, which fills in what is missing:
#
#   PDSERVE_PRESET          mkmodel preset of the default model (small)
#   PDSERVE_MODEL           model folder (/models/$PDSERVE_PRESET)
#   PDSERVE_SEED            init-model: mkmodel seed (1)
#   PDSERVE_SERVED_MODEL_NAME  gateway: the name clients use (the model folder's name)
#   PDSERVE_GATEWAY         prefill/decode: the gateway's control endpoint (tcp://gateway:8001)
#   PDSERVE_REPLICA_ID      prefill/decode: replica id (the container's hostname, unique per container)
#   PDSERVE_DEVICE          prefill/decode: cpu or cuda (the binary's default)
#   PDSERVE_TENSOR_PARALLEL_SIZE  prefill/decode: GPUs per replica, where the binary has the flag
#   PDSERVE_METRICS_PORT    prefill/decode: serve the replica's own /metrics (GPU telemetry) on
#                           0.0.0.0:PORT, where the binary has the flag
#
# init-model creates $PDSERVE_MODEL with `pdserve mkmodel` when it has no
# config.json yet (a real checkpoint mounted there is left alone).
set -eu

PRESET="${PDSERVE_PRESET:-small}"
MODEL="${PDSERVE_MODEL:-/models/$PRESET}"

has_flag() { # has_flag --name "$@": is --name (or --name=...) among the arguments?
    f="$1"
    shift
    for a in "$@"; do
        case "$a" in "$f" | "$f"=*) return 0 ;; esac
    done
    return 1
}

# does `pdserve CMD --help` know this flag? (forward-compatible options)
knows_flag() { pdserve "$1" --help 2>&1 | grep -q -- "$2\b"; }

cmd="${1:---help}"
case "$cmd" in
init-model)
    if [ -s "$MODEL/config.json" ]; then
        echo "init-model: $MODEL already has a model ($(grep -o '"model_type"[^,]*' "$MODEL/config.json" || echo config.json)); keeping it"
        exit 0
    fi
    echo "init-model: creating $MODEL (preset $PRESET, seed ${PDSERVE_SEED:-1})"
    parent=$(dirname "$MODEL")
    mkdir -p "$parent"
    tmp="$parent/.$(basename "$MODEL").tmp.$$"
    rm -rf "$tmp"
    pdserve mkmodel --preset "$PRESET" --seed "${PDSERVE_SEED:-1}" --out "$tmp" \
        --tokenizer-dir /usr/share/pdserve/tokenizer
    rm -rf "$MODEL"
    mv "$tmp" "$MODEL"
    echo "init-model: $MODEL ready ($(du -sh "$MODEL" | cut -f1))"
    exit 0
    ;;
gateway | prefill | decode)
    shift
    has_flag --model "$@" || set -- "$@" --model "$MODEL"
    if [ "$cmd" = gateway ]; then
        has_flag --served-model-name "$@" ||
            set -- "$@" --served-model-name "${PDSERVE_SERVED_MODEL_NAME:-$(basename "$MODEL")}"
    else
        has_flag --gateway "$@" || set -- "$@" --gateway "${PDSERVE_GATEWAY:-tcp://gateway:8001}"
        # the binary's default, <role>-<pid>, repeats across containers (pid 1)
        has_flag --replica-id "$@" || set -- "$@" --replica-id "${PDSERVE_REPLICA_ID:-$(hostname)}"
        if [ -n "${PDSERVE_DEVICE:-}" ] && ! has_flag --device "$@"; then
            set -- "$@" --device "$PDSERVE_DEVICE"
        fi
        tp="${PDSERVE_TENSOR_PARALLEL_SIZE:-}"
        if [ -n "$tp" ] && ! has_flag --tensor-parallel-size "$@"; then
            if knows_flag "$cmd" --tensor-parallel-size; then
                set -- "$@" --tensor-parallel-size "$tp"
            elif [ "$tp" != 1 ]; then
                echo "pdserve-entrypoint: this pdserve $cmd has no --tensor-parallel-size; ignoring PDSERVE_TENSOR_PARALLEL_SIZE=$tp" >&2
            fi
        fi
        mp="${PDSERVE_METRICS_PORT:-}"
        if [ -n "$mp" ] && ! has_flag --metrics-port "$@" && knows_flag "$cmd" --metrics-port; then
            set -- "$@" --metrics-port "$mp"
            has_flag --metrics-host "$@" || set -- "$@" --metrics-host 0.0.0.0
        fi
    fi
    echo "pdserve-entrypoint: pdserve $cmd $*" >&2
    exec pdserve "$cmd" "$@"
    ;;
-* | generate | mkmodel | tokenize | up | bench)
    exec pdserve "$@"
    ;;
*)
    exec "$@"
    ;;
esac

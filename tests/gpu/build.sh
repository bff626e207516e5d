#!/bin/sh
# Builds, on a machine with nvcc but no GPU, what tests/gpu/run.sh runs on a
# GPU host, and packs it into .carry-cuda/pack.tar.xz (git-ignored; carry
# .carry-cuda and .cache there):
#   bin/test_backend_ops  every op, CUDA against CPU   (kernels/tests/)
#   bin/test_all_reduce   all_reduce_sum over every GPU through NCCL, plain and in a graph (kernels/tests/)
#   bin/test_model_cuda   tiny / tiny-v2 against the transformers fixtures (kernels/cuda/tests/)
#   bin/pdserve           the whole server, for generate and the serving test on the GPU
#   bin/bench_cuda        GEMM and MLA against the copy and GEMM ceilings (tests/gpu/bench_cuda.c)
#   bin/bench_step        decode steps of a whole model (tests/gpu/bench_step.c)
#   bin/bench_prefill     prefill of whole prompts against the GEMM ceiling (tests/gpu/bench_prefill.c)
#   bin/bench_sample      sampling on the GPU against download + host sampler (tests/gpu/bench_sample.c)
#   bin/bench_moe_stream  the batch-1 MoE GEMVs' weights streamed alone, by kernel shape (tests/gpu/bench_moe_stream.cu)
#   lib/libpdtrace.so     the CUPTI timeline preloaded by run.sh's trace steps (tests/gpu/cupti_trace.c),
#                         with the libcupti it needs
#   lib/                  the shared libraries those binaries need that a bare CUDA image lacks
#                         (jansson, OpenBLAS, ZeroMQ, UCX, cmocka, ...; not libcuda, cuBLAS or glibc)
#
# usage: [PD_CUDA_PROBE=1] tests/gpu/build.sh [--tree]
# PD_CUDA_PROBE=1: the diagnostic build with the one-row MoE kernels' per-block timestamps (kernels/cuda/moe.cu;
# PD_MOE_PROBE=file at run time, tests/gpu/probe_summary.py reads the file) and the decode attention's
# (kernels/cuda/mla.cu; PD_MLA_PROBE=file, tests/gpu/mla_probe_summary.py); not for benchmark figures.
# By default it builds HEAD with this checkout's CUDA-path files copied over
# it (kernels/, the model's forward pass and loader, the replicas' KV
# staging, tests/gpu), in a scratch directory, so that someone else's
# half-done edit elsewhere in the working tree cannot break the GPU run;
# --tree builds the working tree as it is, in build-cuda/.
set -eu
cd "$(git rev-parse --show-toplevel)"
ROOT=$PWD
OUTD=$ROOT/.carry-cuda
EXCLUDE=$(git rev-parse --git-common-dir)/info/exclude # .git is a file in a worktree
grep -qx '/.carry-cuda/' "$EXCLUDE" 2>/dev/null || echo '/.carry-cuda/' >>"$EXCLUDE"

if [ "${1:-}" = "--tree" ]; then
    SRC=$ROOT
    B=$ROOT/build-cuda
else
    SRC=${TMPDIR:-/tmp}/pdserve-cuda-src
    rm -rf "$SRC"
    mkdir -p "$SRC"
    git archive HEAD | tar -x -C "$SRC"
    mkdir -p "$SRC/kernels" "$SRC/tests/gpu"
    cp -r kernels/. "$SRC/kernels/"
    cp -r tests/gpu/. "$SRC/tests/gpu/"
    for f in model/forward.c model/model.c model/tp.c model/model_impl.h model/pd_model.h cli/generate.c \
        decode/service.c prefill/service.c; do
        cp "$f" "$SRC/$f"
    done
    B=$SRC/build
fi
# CMAKE_CUDA_ARCHITECTURES=OFF: pdcore is declared before CUDA is enabled and
# CMake (3.25) otherwise refuses its empty CUDA_ARCHITECTURES.
cmake -S "$SRC" -B "$B" -DPD_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=OFF -DPD_CACHE_DIR="$ROOT/.cache" \
    -DPD_CUDA_PROBE="$([ "${PD_CUDA_PROBE:-0}" = 1 ] && echo ON || echo OFF)" >/dev/null
cmake --build "$B" -j"$(nproc)" --target test_backend_ops test_all_reduce test_model_cuda pdcuda pdserve
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
"$NVCC" -O2 -o "$B/bench_cuda" "$SRC/tests/gpu/bench_cuda.c" -I"$SRC/common" -I"$SRC/kernels" \
    "$B/libpdcuda.a" -lcublasLt -lcublas -lcudart
# bench_step links what test_model_cuda links (pdcore, pdcuda and their libraries), less cmocka
cc -O2 -std=gnu11 -c -o "$B/bench_step.o" "$SRC/tests/gpu/bench_step.c" -I"$SRC/common" -I"$SRC/kernels" \
    -I"$SRC/model" -I/usr/local/cuda/include
LINK=$(sed -e 's|^.*-o test_model_cuda||' -e 's|[^ ]*libcmocka[^ ]*||' \
    "$B/CMakeFiles/test_model_cuda.dir/link.txt")
(cd "$B" && eval "c++ -o bench_step bench_step.o $LINK")
cc -O2 -std=gnu11 -c -o "$B/bench_prefill.o" "$SRC/tests/gpu/bench_prefill.c" -I"$SRC/common" -I"$SRC/kernels" \
    -I"$SRC/model" -I/usr/local/cuda/include
(cd "$B" && eval "c++ -o bench_prefill bench_prefill.o $LINK")
cc -O2 -std=gnu11 -c -o "$B/bench_sample.o" "$SRC/tests/gpu/bench_sample.c" -I"$SRC/common" -I"$SRC/kernels" \
    -I"$SRC/model" -I/usr/local/cuda/include
(cd "$B" && eval "c++ -o bench_sample bench_sample.o $LINK")
"$NVCC" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o "$B/bench_moe_stream" \
    "$SRC/tests/gpu/bench_moe_stream.cu" -I"$SRC/common" -I"$SRC/kernels" -I"$SRC/kernels/cuda"
# the CUPTI timeline, preloaded into a bench by run.sh's trace steps (tests/gpu/cupti_trace.c)
cc -O2 -std=gnu11 -shared -fPIC -o "$B/libpdtrace.so" "$SRC/tests/gpu/cupti_trace.c" -I/usr/local/cuda/include \
    -L/usr/local/cuda/lib64 -lcupti

STAGE=$B/carry
rm -rf "$STAGE"
mkdir -p "$STAGE/bin" "$STAGE/lib"
cp "$B/test_backend_ops" "$B/test_all_reduce" "$B/test_model_cuda" "$B/pdserve" "$B/bench_cuda" "$B/bench_step" \
    "$B/bench_prefill" "$B/bench_sample" "$B/bench_moe_stream" "$STAGE/bin/"
cp "$B/libpdtrace.so" "$(readlink -f /usr/local/cuda/lib64/libcupti.so)" "$STAGE/lib/"
strip --strip-debug "$STAGE"/bin/*
for bin in "$STAGE"/bin/*; do
    ldd "$bin" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
    libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | libresolv.so* | ld-linux* | libgcc_s.so* | libstdc++.so* | \
        libcuda.so* | libcublas* | libnvidia*) ;;
    *) cp -L "$lib" "$STAGE/lib/" ;;
    esac
done
rm -rf "$OUTD"
mkdir -p "$OUTD"
tar -C "$STAGE" -cJf "$OUTD/pack.tar.xz" bin lib
du -sh "$STAGE" "$OUTD/pack.tar.xz"
ls "$STAGE/bin" "$STAGE/lib"

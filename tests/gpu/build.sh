#!/bin/sh
# Builds, on a machine with nvcc but no GPU, what tests/gpu/run.sh runs on a
# GPU host, and gathers it into .carry-cuda/ (git-ignored):
#   bin/test_backend_ops  every op, CUDA against CPU   (kernels/tests/)
#   bin/test_model_cuda   tiny / tiny-v2 against the transformers fixtures (kernels/cuda/tests/)
#   bin/bench_cuda        GEMM and MLA against the copy and GEMM ceilings (tests/gpu/bench_cuda.c)
#   lib/                  the shared libraries those binaries need that a bare CUDA image lacks
#                         (jansson, OpenBLAS, cmocka, ...; not libcuda, cuBLAS or glibc)
#
# usage: tests/gpu/build.sh [--tree]
# By default it builds HEAD with this checkout's kernels/cuda, kernels/tests
# and tests/gpu copied over it, in a scratch directory, so that someone
# else's half-done edit elsewhere in the working tree cannot break the GPU
# run; --tree builds the working tree as it is, in build-cuda/.
set -eu
cd "$(git rev-parse --show-toplevel)"
ROOT=$PWD
OUTD=$ROOT/.carry-cuda
grep -qx '/.carry-cuda/' .git/info/exclude 2>/dev/null || echo '/.carry-cuda/' >>.git/info/exclude

if [ "${1:-}" = "--tree" ]; then
    SRC=$ROOT
    B=$ROOT/build-cuda
else
    SRC=${TMPDIR:-/tmp}/pdserve-cuda-src
    rm -rf "$SRC"
    mkdir -p "$SRC"
    git archive HEAD | tar -x -C "$SRC"
    mkdir -p "$SRC/kernels/cuda" "$SRC/kernels/tests" "$SRC/tests/gpu"
    cp -r kernels/cuda/. "$SRC/kernels/cuda/"
    cp -r kernels/tests/. "$SRC/kernels/tests/"
    cp -r tests/gpu/. "$SRC/tests/gpu/"
    B=$SRC/build
fi
# CMAKE_CUDA_ARCHITECTURES=OFF: pdcore is declared before CUDA is enabled and
# CMake (3.25) otherwise refuses its empty CUDA_ARCHITECTURES.
cmake -S "$SRC" -B "$B" -DPD_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=OFF -DPD_CACHE_DIR="$ROOT/.cache" >/dev/null
cmake --build "$B" -j"$(nproc)" --target test_backend_ops test_model_cuda pdcuda
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
"$NVCC" -O2 -o "$B/bench_cuda" "$SRC/tests/gpu/bench_cuda.c" -I"$SRC/common" -I"$SRC/kernels" \
    "$B/libpdcuda.a" -lcublasLt -lcublas -lcudart

rm -rf "$OUTD"
mkdir -p "$OUTD/bin" "$OUTD/lib"
cp "$B/test_backend_ops" "$B/test_model_cuda" "$B/bench_cuda" "$OUTD/bin/"
for bin in "$OUTD"/bin/*; do
    ldd "$bin" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
    libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | ld-linux* | libgcc_s.so* | libstdc++.so* | \
        libcuda.so* | libcublas* | libnvidia*) ;;
    *) cp -L "$lib" "$OUTD/lib/" ;;
    esac
done
du -sh "$OUTD"
ls "$OUTD/bin" "$OUTD/lib"

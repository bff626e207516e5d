#!/bin/sh
# Runs the CUDA backend's checks and benchmarks on a GPU host, from what
# tests/gpu/build.sh packed into .carry-cuda/ (carry .carry-cuda and .cache).
# Logs go to $OUT (or ./gpu-out), one file per step.
#
# usage (repository root): tests/gpu/run.sh STEP...
#   ops       test_backend_ops: every op, CUDA against CPU          -> ops.log
#   model     test_model_cuda: tiny, tiny-v2 against transformers    -> model.log
#   serving   tests/integration/test_serving.py with PD_DEVICE=cuda, fp32 then bf16 weights -> serving-*.log
#   generate  pdserve generate on tiny and small, cpu and cuda        -> generate.log
#   bench     bench_cuda: GEMM and MLA against the ceilings          -> bench.md
#   v2lite    mkmodel v2-lite into /tmp (started first, in the background), then
#             bench_step (decode steps), the transformers peer, and generate -> step.md, peer.md, v2lite.log
#   prof      v2-lite cut to 2 and 4 layers (mkmodel --num-layers): bench_step at batch 1 / 1K on
#             both (the difference is two MoE layers' time), then ncu's kernel durations of the
#             4-layer model's decode steps summed by kernel (ncu_summary.py)  -> prof.md, prof.csv
#   service   (after v2lite) pdserve up on v2-lite with --device cuda (one prefill and one decode replica on
#             the one GPU), then pdserve bench matrix: SVC_SHAPES (default 1024/128,8192/128) x
#             SVC_CONCURRENCY (default 1,8), one round                        -> service.md, up.log
#   tp        tensor parallelism over 2 GPUs: test_all_reduce; generate on tiny at TP 1 and 2 (greedy
#             ids must match, bf16 and fp32); then (mkmodel v2-lite started first, in the background)
#             logits of generate at TP 2 against TP 1 (cmp_logits.py) and bench_step --tp 1, 2 -> tp.log, tp-step.md
#   ep        expert parallelism over 2 GPUs (after tp's v2-lite): generate on tiny and tiny-v2 at TP 2
#             --enable-expert-parallel against TP 1 (greedy ids must match, bf16 and fp32); v2-lite
#             logits at TP 2 EP against TP 1 (cmp_logits.py); bench_step --tp 2 --ep (run ops too:
#             test_backend_ops checks moe_ids_local and dropped pairs on CUDA) -> ep.log, ep-step.md
#   prefill   (needs v2-lite: mkmodel starts first) bench_prefill on v2-lite: prompts of PREFILL_PROMPTS
#             (default 1024,8192,32768,131072) in chunks of PREFILL_CHUNK (8192), the attention variants
#             PREFILL_VARIANTS (default gemm,flash,kernel; the fp32 kernel to 8K), against the bf16 GEMM
#             ceiling; each setting of PREFILL_AB (e.g. "PD_CUDA_GEMM_PLANS=exact PD_MOE_ROWS=f32") at
#             1K and 8K with the variants PREFILL_AB_VARIANTS (default gemm); then the transformers peer (peer_hf.py --prompts PREFILL_PEER_PROMPTS, default
#             1024,8192,32768; none: skipped)                                   -> prefill.md, prefill-peer.md
#   pprof     v2-lite cut to 2 and 4 layers: 1K and 8K prefills of each, then ncu's kernel durations of
#             the 4-layer model's 8K prefill (attention variant PPROF_VARIANT, default flash) summed by
#             kernel (ncu_summary.py --last 0)  -> pprof.md
#   trace     (needs v2-lite) the CUPTI timeline (cupti_trace.c, preloaded) of the whole v2-lite's 8K prefill
#             (attention TRACE_VARIANT, default flash; settings TRACE_ENV) and of decode steps at batch
#             1 and 32 / 1K, summarised by trace_summary.py: GPU busy against idle, kernels by time,
#             the idle gaps and what the host did in them                        -> trace.md
#   sample    bench_sample: sample_rows on the GPU against download + host sampler, vocab 102400 -> sample.md
#   plan      pdserve up on tiny with --gpu-memory-utilization 0.3 (the KV cache planned on the GPU), a short and a
#             long completion                                                    -> plan.log
#   v2ref     v2-lite cut to 4 layers: logits of pdserve generate --device cuda (each prefill attention:
#             PD_MLA_PREFILL=kernel, gemm, flash) against transformers on the same weights (v2lite_ref.py) -> v2ref.log
#   startup   (needs v2-lite) the disk's O_DIRECT read bandwidth, then a decode replica's start-up
#             phases from a cold page cache (posix_fadvise DONTNEED) and warm (startup.py) -> startup.log
#   selfcheck a gateway and a decode replica on CUDA (TP 2 with two GPUs): NVML metrics plausible,
#             self_check_ok, NUMA report against sysfs, an injected all-reduce failure refused -> selfcheck.log
# Environment: MODEL_AB (settings test_model_cuda runs again with), SVC_SHAPES, SVC_CONCURRENCY,
# SVC_REQUESTS, SVC_ARGS (the service matrix, and more pdserve bench flags), SERVING_WEIGHTS (default "f32 bf16"), STEP_ARGS (bench_step's flags), PEER_ARGS (peer_hf.py's), TP_STEP_ARGS (bench_step's
# flags in the tp step). NCCL_NVLS_ENABLE=0 is kept (NVLink multicast must stay off on shared hosts);
# NCCL is found by ldconfig, else PD_NCCL_LIB is set to the first libnccl.so.2 on the disk.
set -u
cd "$(dirname "$0")/../.."
R=$PWD
C=${TMPDIR:-/tmp}/pdcarry
O=${OUT:-$PWD/gpu-out}
mkdir -p "$O" "$C"
tar -C "$C" -xJf .carry-cuda/pack.tar.xz
# cuBLAS is too large to carry: find the GPU host's own.
CUBLAS_DIR=
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/libcublasLt.so.13" ] && CUBLAS_DIR=$d && break
done
[ -z "$CUBLAS_DIR" ] && CUBLAS_DIR=$(dirname "$(find / -name 'libcublasLt.so.13*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$C/lib:$CUBLAS_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PD_SOURCE_DIR=$R PD_BUILD_DIR=${TMPDIR:-/tmp}/pdserve-gpu PD_CACHE_DIR=$R/.cache PD_BIN=$C/bin/pdserve
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ -z "${PD_NCCL_LIB:-}" ] && ! ldconfig -p | grep -q 'libnccl.so.2 '; then
    PD_NCCL_LIB=$(find /usr/lib /usr/local /opt -name 'libnccl.so.2*' 2>/dev/null | head -1)
    [ -n "$PD_NCCL_LIB" ] && export PD_NCCL_LIB && echo "NCCL: $PD_NCCL_LIB"
fi
mkdir -p "$PD_BUILD_DIR"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
echo "cuBLAS from $CUBLAS_DIR; $(nproc) cores; $(free -g | awk '/Mem/ {print $2}') GiB"
V2=${TMPDIR:-/tmp}/v2lite
MKPID=
# A warm machine keeps /tmp: a later call reuses the checkpoint an earlier one wrote.
[ -e "$V2/config.json" ] && echo "v2-lite already in $V2" >"$O/mkmodel.log" ||
case " $* " in *" v2lite "* | *" trace "* | *" tp "* | *" ep "* | *" service "* | *" prefill "* | *" startup "*)
    ( t0=$(date +%s); "$C/bin/pdserve" mkmodel --preset v2-lite --seed 1 --out "$V2" >"$O/mkmodel.log" 2>&1
      echo "mkmodel: $? after $(($(date +%s) - t0)) s" >>"$O/mkmodel.log" ) &
    MKPID=$!
esac
rc=0
for what in "$@"; do
    t0=$(date +%s)
    case $what in
    ops) timeout 300 "$C/bin/test_backend_ops" >"$O/ops.log" 2>&1 || rc=1; f=ops.log ;;
    model)
        timeout 300 "$C/bin/test_model_cuda" >"$O/model.log" 2>&1 || rc=1
        # the same with the first version's prefill attention, then with cuBLASLt for every GEMM: whether
        # the bf16 batched-decode check's failures follow the arithmetic (near-tie routing) or a path
        for ab in ${MODEL_AB:-}; do
            echo "## $ab" >>"$O/model.log"
            env "$ab" timeout 120 "$C/bin/test_model_cuda" 2>&1 | grep -E 'batched decode|FAILED|PASSED' >>"$O/model.log"
        done
        f=model.log ;;
    serving)
        for w in ${SERVING_WEIGHTS:-f32 bf16}; do
            PD_DEVICE=cuda PD_CUDA_WEIGHTS=$w timeout 240 python3 tests/integration/test_serving.py >"$O/serving-$w.log" 2>&1 || rc=1
            echo "-- weights $w"; tail -3 "$O/serving-$w.log"
        done
        f=serving-bf16.log ;;
    generate)
        : >"$O/generate.log"
        for p in tiny small; do
            "$C/bin/pdserve" mkmodel --preset $p --seed 1 --out "$PD_BUILD_DIR/gen-$p" >/dev/null 2>&1
            for dev in cpu cuda-f32 cuda; do
                d=${dev%-f32}; w=bf16; [ "$dev" = cuda-f32 ] && w=f32
                echo "== $p $dev" >>"$O/generate.log"
                PD_CUDA_WEIGHTS=$w timeout 120 "$C/bin/pdserve" generate --model "$PD_BUILD_DIR/gen-$p" \
                    --prompt "The capital of France is" -n 24 --ignore-eos --device "$d" >>"$O/generate.log" 2>&1 || rc=1
            done
        done
        f=generate.log ;;
    bench) timeout 300 "$C/bin/bench_cuda" >"$O/bench.md" 2>&1 || rc=1; f=bench.md ;;
    trace)
        wait "$MKPID" 2>/dev/null
        P=$O/trace.md
        : >"$P"
        echo "## 8K prefill, whole v2-lite (${TRACE_ENV:-defaults})" >>"$P"
        env ${TRACE_ENV:-PD_TRACE_X=} PD_TRACE_OUT="$PD_BUILD_DIR/tp.csv" LD_PRELOAD="$C/lib/libpdtrace.so" timeout 200 \
            "$C/bin/bench_prefill" "$V2" --prompts 8192 --variants "${TRACE_VARIANT:-flash}" >>"$P" 2>>"$O/trace.err" || rc=1
        python3 tests/gpu/trace_summary.py "$PD_BUILD_DIR/tp.csv" --windows 1 --gap-us 5 >>"$P" 2>&1 || rc=1
        echo "## decode steps, whole v2-lite, 1K: batch 1 then 32" >>"$P"
        env ${TRACE_ENV:-PD_TRACE_X=} PD_TRACE_OUT="$PD_BUILD_DIR/ts.csv" LD_PRELOAD="$C/lib/libpdtrace.so" timeout 200 \
            "$C/bin/bench_step" "$V2" --batches 1,32 --contexts 1024 --variants fast >>"$P" 2>>"$O/trace.err" || rc=1
        python3 tests/gpu/trace_summary.py "$PD_BUILD_DIR/ts.csv" --gap-us 2 --top 40 --by-grid --labels "batch 1,batch 32" >>"$P" 2>&1 || rc=1
        rm -f "$PD_BUILD_DIR/tp.csv" "$PD_BUILD_DIR/ts.csv"
        cat "$P"; tail -5 "$O/trace.err"; f=trace.md ;;
    sample) timeout 300 "$C/bin/bench_sample" ${SAMPLE_ARGS:-} >"$O/sample.md" 2>&1 || rc=1; cat "$O/sample.md"; f=sample.md ;;
    v2lite)
        wait "$MKPID"
        cat "$O/mkmodel.log"; du -sh "$V2"
        timeout 400 "$C/bin/bench_step" "$V2" ${STEP_ARGS:-} >"$O/step.md" 2>"$O/step.err" || { rc=1; tail -5 "$O/step.err"; }
        timeout 400 python3 tests/gpu/peer_hf.py "$V2" ${PEER_ARGS:-} >"$O/peer.md" 2>"$O/peer.err" || { rc=1; tail -5 "$O/peer.err"; }
        timeout 150 "$C/bin/pdserve" generate --model "$V2" --prompt "The capital of France is" -n 32 --ignore-eos \
            --device cuda >"$O/v2lite.log" 2>&1 || rc=1
        cat "$O/step.md" "$O/peer.md"; tail -4 "$O/v2lite.log"; f=v2lite.log ;;
    prefill)
        wait "$MKPID" 2>/dev/null
        cat "$O/mkmodel.log"
        timeout 500 "$C/bin/bench_prefill" "$V2" --prompts "${PREFILL_PROMPTS:-1024,8192,32768,131072}" \
            --chunk "${PREFILL_CHUNK:-8192}" --variants "${PREFILL_VARIANTS:-gemm,flash,kernel}" >"$O/prefill.md" 2>"$O/prefill.err" ||
            { rc=1; tail -5 "$O/prefill.err"; }
        # A/B in the same run: each setting switched back to the way before it
        for ab in ${PREFILL_AB:-}; do
            echo "## $ab" >>"$O/prefill.md"
            env "$ab" timeout 200 "$C/bin/bench_prefill" "$V2" --prompts 1024,8192 --variants "${PREFILL_AB_VARIANTS:-gemm}" 2>>"$O/prefill.err" |
                grep '^| [0-9]' >>"$O/prefill.md" || rc=1
        done
        [ "${PREFILL_PEER_PROMPTS:-1024,8192,32768}" = none ] ||
        timeout 300 python3 tests/gpu/peer_hf.py "$V2" --prompts "${PREFILL_PEER_PROMPTS:-1024,8192,32768}" \
            --chunk "${PREFILL_CHUNK:-8192}" >"$O/prefill-peer.md" 2>"$O/prefill-peer.err" ||
            { rc=1; tail -5 "$O/prefill-peer.err"; }
        cat "$O/prefill.md" "$O/prefill-peer.md" 2>/dev/null; f=prefill.md ;;
    pprof)
        # v2-lite cut to 2 and 4 layers: an 8K prefill of each (the difference is two MoE layers), then
        # ncu's kernel durations of the 4-layer model's 8K prefill summed by kernel
        P=$O/pprof.md
        : >"$P"
        for nl in 2 4; do
            [ -e "$PD_BUILD_DIR/v2l$nl/config.json" ] || "$C/bin/pdserve" mkmodel --preset v2-lite --seed 1 --num-layers $nl \
                --out "$PD_BUILD_DIR/v2l$nl" >/dev/null 2>&1 || rc=1
            echo "## v2-lite, $nl layers" >>"$P"
            timeout 120 "$C/bin/bench_prefill" "$PD_BUILD_DIR/v2l$nl" --prompts 1024,8192 --variants gemm,flash \
                >>"$P" 2>>"$O/pprof.err" || rc=1
        done
        NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        if [ -n "$NCU" ]; then
            timeout 300 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
                "$C/bin/bench_prefill" "$PD_BUILD_DIR/v2l4" --prompts 8192 --variants "${PPROF_VARIANT:-flash}" --profile \
                >"$O/pprof.csv" 2>>"$O/pprof.err" || rc=1
            python3 tests/gpu/ncu_summary.py "$O/pprof.csv" >>"$P" 2>&1 || rc=1
            rm -f "$O/pprof.csv"
        else
            echo "no ncu" >>"$P"
        fi
        cat "$P"; tail -5 "$O/pprof.err"; f=pprof.md ;;
    prof)
        P=$O/prof.md
        : >"$P"
        for nl in 2 4; do
            "$C/bin/pdserve" mkmodel --preset v2-lite --seed 1 --num-layers $nl --out "$PD_BUILD_DIR/v2l$nl" \
                >/dev/null 2>&1 || rc=1
            echo "## v2-lite, $nl layers" >>"$P"
            timeout 120 "$C/bin/bench_step" "$PD_BUILD_DIR/v2l$nl" --batches ${PROF_BATCHES:-1,8} --contexts 1024,8192 \
                --variants fast >>"$P" 2>>"$O/prof.err" || rc=1
        done
        # A/B in the same run: the decode attention's least tokens a split, the first MLA kernels
        for ab in ${PROF_AB:-PD_CUDA_PDL=0 PD_MLA_FIRST_KERNELS=1 PD_MLA_MIN_CHUNK=64}; do
            echo "## v2-lite, 4 layers, $ab" >>"$P"
            env "$ab" timeout 120 "$C/bin/bench_step" "$PD_BUILD_DIR/v2l4" --batches ${PROF_BATCHES:-1,8} \
                --contexts 1024,8192 --variants fast 2>>"$O/prof.err" | grep '^| [0-9]' >>"$P" || rc=1
        done
        NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        if [ -n "$NCU" ]; then
            timeout 300 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
                "$C/bin/bench_step" "$PD_BUILD_DIR/v2l4" --batches 1 --contexts 1024 --steps 1 --variants fast \
                >"$O/prof.csv" 2>>"$O/prof.err" || rc=1
            python3 tests/gpu/ncu_summary.py "$O/prof.csv" >>"$P" 2>&1 || rc=1
        else
            echo "no ncu" >>"$P"
        fi
        cat "$P"; tail -5 "$O/prof.err"; f=prof.md ;;
    service)
        wait "$MKPID" 2>/dev/null
        "$C/bin/pdserve" up --model "$V2" --port 18000 --device cuda --num-kv-blocks 16384 >"$O/up.log" 2>&1 &
        UPPID=$!
        n=0
        # /health answers 200 once a decode replica has registered (503 before)
        until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:18000/health', timeout=2)" >/dev/null 2>&1 || [ $n -ge 180 ]; do sleep 1; n=$((n + 1)); done
        sleep 3 # the prefill replica registers at about the same time
        echo "service ready after $n s" >"$O/service.md"
        timeout 420 "$C/bin/pdserve" bench matrix --base-url http://127.0.0.1:18000 --model "$V2" --quiet \
            --shapes ${SVC_SHAPES:-1024/128,8192/128} --concurrency ${SVC_CONCURRENCY:-1,8} --requests ${SVC_REQUESTS:-4,16} --rounds 1 ${SVC_ARGS:-} \
            --out "$PD_BUILD_DIR/svc" >>"$O/service.md" 2>&1 || rc=1
        cat "$PD_BUILD_DIR/svc/rounds.csv" >>"$O/service.md" 2>/dev/null || echo "no rounds.csv" >>"$O/service.md"
        kill -INT $UPPID 2>/dev/null; sleep 3; kill -9 $UPPID 2>/dev/null
        cat "$O/service.md"; f=service.md ;;
    tp)
        L=$O/tp.log
        : >"$L"
        timeout 120 "$C/bin/test_all_reduce" >>"$L" 2>&1 || rc=1
        "$C/bin/pdserve" mkmodel --preset tiny --seed 1 --out "$PD_BUILD_DIR/gen-tiny" >/dev/null 2>&1
        for w in bf16 f32; do
            for n in 1 2; do
                PD_CUDA_WEIGHTS=$w timeout 60 "$C/bin/pdserve" generate --model "$PD_BUILD_DIR/gen-tiny" --ids \
                    --prompt "The capital of France is" -n 24 --ignore-eos --device cuda --tensor-parallel-size $n \
                    >"$PD_BUILD_DIR/tiny-$w-$n.ids" 2>>"$L" || rc=1
            done
            if cmp -s "$PD_BUILD_DIR/tiny-$w-1.ids" "$PD_BUILD_DIR/tiny-$w-2.ids"; then
                echo "tiny $w: greedy ids at TP 2 identical to TP 1: $(tail -1 "$PD_BUILD_DIR/tiny-$w-2.ids")" >>"$L"
            else
                echo "tiny $w: greedy ids DIFFER" >>"$L"; cat "$PD_BUILD_DIR"/tiny-$w-*.ids >>"$L"; rc=1
            fi
        done
        wait "$MKPID"
        cat "$O/mkmodel.log" >>"$L"
        if [ -e "$V2/config.json" ]; then
            for n in 1 2; do
                timeout 90 "$C/bin/pdserve" generate --model "$V2" --prompt "The capital of France is" -n 16 \
                    --ignore-eos --ids --device cuda --tensor-parallel-size $n --dump-logits "$PD_BUILD_DIR/v2-$n.bin" \
                    >>"$L" 2>&1 || rc=1
            done
            echo "v2-lite logits, TP 2 against TP 1:" >>"$L"
            python3 tests/gpu/cmp_logits.py "$PD_BUILD_DIR/v2-2.bin" "$PD_BUILD_DIR/v2-1.bin" "$V2" >>"$L" 2>&1 || rc=1
            : >"$O/tp-step.md"
            for n in 1 2; do
                timeout 150 "$C/bin/bench_step" "$V2" --tp $n --variants fast ${TP_STEP_ARGS:---contexts 1024} \
                    >>"$O/tp-step.md" 2>>"$L" || rc=1
            done
            cat "$O/tp-step.md"
        fi
        cat "$L"; f=tp.log ;;
    ep)
        L=$O/ep.log
        : >"$L"
        for preset in tiny tiny-v2; do
            "$C/bin/pdserve" mkmodel --preset $preset --seed 1 --out "$PD_BUILD_DIR/ep-$preset" >/dev/null 2>&1
            for w in bf16 f32; do
                for how in "1" "2 --enable-expert-parallel"; do
                    # shellcheck disable=SC2086
                    PD_CUDA_WEIGHTS=$w timeout 60 "$C/bin/pdserve" generate --model "$PD_BUILD_DIR/ep-$preset" --ids \
                        --prompt "The capital of France is" -n 24 --ignore-eos --device cuda --tensor-parallel-size $how \
                        >"$PD_BUILD_DIR/ep-$preset-$w-${how%% *}.ids" 2>>"$L" || rc=1
                done
                if cmp -s "$PD_BUILD_DIR/ep-$preset-$w-1.ids" "$PD_BUILD_DIR/ep-$preset-$w-2.ids"; then
                    echo "$preset $w: greedy ids at TP 2 EP identical to TP 1: $(tail -1 "$PD_BUILD_DIR/ep-$preset-$w-2.ids")" >>"$L"
                else
                    echo "$preset $w: greedy ids DIFFER (FAIL)" >>"$L"; cat "$PD_BUILD_DIR"/ep-$preset-$w-*.ids >>"$L"; rc=1
                fi
            done
        done
        wait "$MKPID" 2>/dev/null
        if [ -e "$V2/config.json" ]; then
            for how in "1" "2 --enable-expert-parallel"; do
                # shellcheck disable=SC2086
                timeout 90 "$C/bin/pdserve" generate --model "$V2" --prompt "The capital of France is" -n 16 \
                    --ignore-eos --ids --device cuda --tensor-parallel-size $how \
                    --dump-logits "$PD_BUILD_DIR/v2ep-${how%% *}.bin" >>"$L" 2>&1 || rc=1
            done
            echo "v2-lite logits, TP 2 EP against TP 1:" >>"$L"
            python3 tests/gpu/cmp_logits.py "$PD_BUILD_DIR/v2ep-2.bin" "$PD_BUILD_DIR/v2ep-1.bin" "$V2" >>"$L" 2>&1 || rc=1
            : >"$O/ep-step.md"
            for how in "--tp 2" "--tp 2 --ep"; do
                # shellcheck disable=SC2086
                timeout 150 "$C/bin/bench_step" "$V2" $how --variants fast ${TP_STEP_ARGS:---contexts 1024} \
                    >>"$O/ep-step.md" 2>>"$L" || rc=1
            done
            cat "$O/ep-step.md"
        fi
        cat "$L"; f=ep.log ;;
    plan)
        # the KV cache sized by --gpu-memory-utilization on a GPU (issue 6): pdserve up on tiny, both replicas
        # planning their share of the one GPU, then one completion through the long route and one short
        L=$O/plan.log
        "$C/bin/pdserve" mkmodel --preset tiny --seed 1 --out "$PD_BUILD_DIR/plan-tiny" >/dev/null 2>&1 || rc=1
        "$C/bin/pdserve" up --model "$PD_BUILD_DIR/plan-tiny" --port 18100 --device cuda --gpu-memory-utilization 0.3 \
            --long-prompt-threshold 16 >"$PD_BUILD_DIR/plan-up.log" 2>&1 &
        UPPID=$!
        n=0
        until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:18100/health', timeout=2)" >/dev/null 2>&1 || [ $n -ge 60 ]; do sleep 1; n=$((n + 1)); done
        sleep 2
        for p in "Hello" "The capital of France is a city that many people visit every year because"; do
            python3 -c "import json, sys, urllib.request as u; r = u.urlopen(u.Request('http://127.0.0.1:18100/v1/completions', json.dumps({'model': sys.argv[2], 'prompt': sys.argv[1], 'max_tokens': 8}).encode(), {'Content-Type': 'application/json'}), timeout=60); print('completion:', r.status, json.load(r)['usage'])" "$p" "$PD_BUILD_DIR/plan-tiny" >>"$L" 2>&1 || rc=1
        done
        kill -INT $UPPID 2>/dev/null; sleep 3; kill -9 $UPPID 2>/dev/null
        grep -E "memory plan|KV pool|kv_cache|rror|long prompts" "$PD_BUILD_DIR/plan-up.log" >>"$L"
        cat "$L"; f=plan.log ;;
    v2ref)
        [ -e "$PD_BUILD_DIR/v2l4/config.json" ] || "$C/bin/pdserve" mkmodel --preset v2-lite --seed 1 --num-layers 4 \
            --out "$PD_BUILD_DIR/v2l4" >/dev/null 2>&1 || rc=1
        timeout 300 python3 tests/gpu/v2lite_ref.py "$PD_BUILD_DIR/v2l4" >"$O/v2ref.log" 2>&1 || rc=1
        cat "$O/v2ref.log"; f=v2ref.log ;;
    startup)
        wait "$MKPID" 2>/dev/null
        timeout 540 python3 tests/gpu/startup.py "$V2" >"$O/startup.log" 2>&1 || rc=1
        cat "$O/startup.log"; f=startup.log ;;
    selfcheck)
        timeout 400 python3 tests/gpu/selfcheck.py >"$O/selfcheck.log" 2>&1 || rc=1
        cat "$O/selfcheck.log"; f=selfcheck.log ;;
    *) echo "unknown step $what"; exit 2 ;;
    esac
    echo "== $what: $(($(date +%s) - t0)) s"
    grep -E '^\[  (FAILED|PASSED|SKIPPED) |worst normalised|^\[ cuda|^\[ tiny|over tolerance|backend error|rror|FAIL|failures:' "$O/$f" | head -60
done
exit $rc

/* A timeline of a GPU program's kernels, copies and CUDA runtime calls,
 * for tests/gpu/trace_summary.py: how much of a step or a prefill the GPU
 * spends running kernels, where it waits, and what the host was doing
 * then. Nsight Systems cannot make a report on the lent GPU hosts
 * (/work/.library/device/KINDS.md), so this reads the same CUPTI activity
 * records directly.
 *
 * Built as a shared library and preloaded:
 *   PD_TRACE_OUT=trace.csv LD_PRELOAD=libpdtrace.so bench_prefill ...
 * On load it enables CUPTI's activity records for kernels (CONCURRENT_KERNEL:
 * those in graphs too), memory copies, memsets and runtime API calls; at
 * exit it flushes them and writes one line per record to PD_TRACE_OUT:
 *   K,start_ns,end_ns,stream,graph_id,GXxGYxGZ,name   a kernel and its grid
 *   M,start_ns,end_ns,stream,bytes,copy_kind,-        a copy (C: a memset)
 *   R,start_ns,end_ns,thread,0,-,api_name             a runtime API call on the host
 * Timestamps are CUPTI's (ns, one clock for host and device records). The
 * programs mark what to look at with cudaProfilerStart/Stop, which appear as
 * R records. CUPTI hands over its 8 MB buffers as they fill; they are
 * written then and at exit. */
#include <cupti.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRACE_BUF (8u << 20)

static FILE *trace_out;

static void CUPTIAPI buf_requested(uint8_t **buf, size_t *size, size_t *max_records) {
    *buf = (uint8_t *)aligned_alloc(8, TRACE_BUF);
    *size = *buf ? TRACE_BUF : 0;
    *max_records = 0;
}

static void CUPTIAPI buf_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *r = NULL;
    while (trace_out && cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        switch (r->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
            fprintf(trace_out, "K,%llu,%llu,%u,%u,%dx%dx%d,%s\n", (unsigned long long)k->start,
                    (unsigned long long)k->end, k->streamId, k->graphId, k->gridX, k->gridY, k->gridZ,
                    k->name ? k->name : "?");
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
            fprintf(trace_out, "M,%llu,%llu,%u,%llu,%u,-\n", (unsigned long long)m->start, (unsigned long long)m->end,
                    m->streamId, (unsigned long long)m->bytes, (unsigned)m->copyKind);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)r;
            fprintf(trace_out, "C,%llu,%llu,%u,%llu,0,-\n", (unsigned long long)m->start, (unsigned long long)m->end,
                    m->streamId, (unsigned long long)m->bytes);
            break;
        }
        case CUPTI_ACTIVITY_KIND_RUNTIME: {
            const CUpti_ActivityAPI *a = (const CUpti_ActivityAPI *)r;
            const char *name = NULL;
            if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name) != CUPTI_SUCCESS || !name)
                name = "?";
            fprintf(trace_out, "R,%llu,%llu,%u,0,-,%s\n", (unsigned long long)a->start, (unsigned long long)a->end,
                    a->threadId, name);
            break;
        }
        default:
            break;
        }
    }
    free(buf);
}

static void trace_stop(void) {
    cuptiActivityFlushAll(1);
    if (trace_out) {
        fclose(trace_out);
        trace_out = NULL;
    }
}

__attribute__((constructor)) static void trace_start(void) {
    const char *path = getenv("PD_TRACE_OUT");
    if (!path || !*path)
        return;
    trace_out = fopen(path, "w");
    if (!trace_out) {
        fprintf(stderr, "pdtrace: cannot write %s\n", path);
        return;
    }
    setvbuf(trace_out, NULL, _IOFBF, 1 << 20);
    if (cuptiActivityRegisterCallbacks(buf_requested, buf_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME) != CUPTI_SUCCESS) {
        fprintf(stderr, "pdtrace: CUPTI refused the activity records\n");
        fclose(trace_out);
        trace_out = NULL;
        return;
    }
    atexit(trace_stop);
}

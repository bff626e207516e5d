/* The CUDA backend (sm_90a): the operation table, the handles it owns
 * (one stream, cuBLAS, cuBLASLt with its workspace) and the sticky error
 * every operation reports into (pd_cuda.h says why it is sticky). */
#include "cuda_common.cuh"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define CU_LT_WORKSPACE (32u << 20)

pd_status cu_err_set(pd_err *err, pd_status st, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return st;
}

void cu_log(pd_log_level lvl, const char *fmt, ...) {
    static int level = -1;
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    if (level < 0) {
        const char *e = getenv("PDSERVE_LOG_LEVEL");
        level = !e                          ? PD_LOG_INFO
                : !strcasecmp(e, "debug") ? PD_LOG_DEBUG
                : !strcasecmp(e, "warn")  ? PD_LOG_WARN
                : !strcasecmp(e, "error") ? PD_LOG_ERROR
                                          : PD_LOG_INFO;
    }
    if ((int)lvl < level)
        return;
    static const char *names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char tbuf[32], msg[2048];
    strftime(tbuf, sizeof tbuf, "%Y-%m-%dT%H:%M:%S", &tm);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&mu);
    fprintf(stderr, "%s.%03ldZ %-5s cuda: %s\n", tbuf, ts.tv_nsec / 1000000, names[lvl], msg);
    pthread_mutex_unlock(&mu);
}

pd_status cu_fail(cu_ctx *c, pd_status st, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (c->status == PD_OK) {
        c->status = st;
        snprintf(c->msg, sizeof c->msg, "%s", buf);
        CU_LOGE("%s (later operations on this backend are skipped)", buf);
    } else {
        CU_LOGD("after an earlier error: %s", buf);
    }
    return st;
}

bool cu_check(cu_ctx *c, cudaError_t e, const char *what, const char *file, int line) {
    if (e == cudaSuccess)
        return true;
    (void)cudaGetLastError(); /* clear a non-sticky error so that it is not reported twice */
    cu_fail(c, e == cudaErrorMemoryAllocation ? PD_ERR_NOMEM : PD_ERR_IO, "%s (%s:%d): %s", what, file, line,
            cudaGetErrorString(e));
    return false;
}

bool cu_blas_check(cu_ctx *c, cublasStatus_t s, const char *what, const char *file, int line) {
    if (s == CUBLAS_STATUS_SUCCESS)
        return true;
    cu_fail(c, s == CUBLAS_STATUS_ALLOC_FAILED ? PD_ERR_NOMEM : PD_ERR_IO, "%s (%s:%d): %s", what, file, line,
            cublasGetStatusString(s));
    return false;
}

void *cu_scratch(cu_ctx *c, int slot, size_t bytes) {
    if (bytes == 0)
        bytes = 256;
    if (c->scr[slot].bytes >= bytes)
        return c->scr[slot].p;
    if (c->capturing) { /* growing would wait on the stream, which a recording cannot */
        cu_fail(c, PD_ERR_UNSUPPORTED, "scratch %d: %zu bytes needed while recording a graph", slot, bytes);
        return NULL;
    }
    /* queued work may still read the old buffer */
    if (!CU_OK(c, cudaStreamSynchronize(c->stream)))
        return NULL;
    c->scr_gen++;
    if (c->scr[slot].p) {
        cudaFree(c->scr[slot].p);
        cu_count_free(c, c->scr[slot].bytes);
    }
    c->scr[slot].p = NULL;
    c->scr[slot].bytes = 0;
    size_t want = (bytes + bytes / 4 + 255) & ~(size_t)255;
    void *p = NULL;
    if (!CU_OK(c, cudaMalloc(&p, want)))
        return NULL;
    c->scr[slot].p = p;
    c->scr[slot].bytes = want;
    cu_count_alloc(c, want);
    return p;
}

void *cu_scratch_upload(cu_ctx *c, int slot, const void *host, size_t bytes) {
    void *d = cu_scratch(c, slot, bytes);
    if (!d)
        return NULL;
    /* host arrays here are pageable: the copy has left the caller's buffer
     * when cudaMemcpyAsync returns, and runs in stream order */
    if (bytes && !CU_OK(c, cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, c->stream)))
        return NULL;
    return d;
}

void *cu_host_scratch(cu_ctx *c, int slot, size_t bytes) {
    if (c->hscr[slot].pending) {
        if (!CU_OK(c, cudaEventSynchronize(c->hscr[slot].done)))
            return NULL;
        c->hscr[slot].pending = false;
    }
    if (c->hscr[slot].bytes >= bytes && c->hscr[slot].p)
        return c->hscr[slot].p;
    if (c->hscr[slot].p)
        cudaFreeHost(c->hscr[slot].p);
    c->hscr[slot].p = NULL;
    c->hscr[slot].bytes = 0;
    size_t want = (bytes + bytes / 4 + 4095) & ~(size_t)4095;
    void *p = NULL;
    if (!c->hscr[slot].done && !CU_OK(c, cudaEventCreateWithFlags(&c->hscr[slot].done, cudaEventDisableTiming)))
        return NULL;
    if (!CU_OK(c, cudaHostAlloc(&p, want, cudaHostAllocDefault)))
        return NULL;
    c->hscr[slot].p = p;
    c->hscr[slot].bytes = want;
    return p;
}

void cu_host_scratch_queued(cu_ctx *c, int slot) {
    if (c->hscr[slot].done && CU_OK(c, cudaEventRecord(c->hscr[slot].done, c->stream)))
        c->hscr[slot].pending = true;
}

const void *const *cu_wtable_get(cu_ctx *c, const pd_weight *w, int n) {
    cu_wtable *t = NULL;
    for (int i = 0; i < c->n_wtabs; i++)
        if (c->wtabs[i].key == w && c->wtabs[i].n == n) {
            t = &c->wtabs[i];
            break;
        }
    if (t) {
        bool same = true;
        for (int e = 0; e < n && same; e++)
            same = t->host[e] == w[e].data;
        if (same)
            return t->dev;
    } else {
        if (c->n_wtabs == c->cap_wtabs) {
            int cap = c->cap_wtabs ? 2 * c->cap_wtabs : 64;
            cu_wtable *nt = (cu_wtable *)realloc(c->wtabs, (size_t)cap * sizeof *nt);
            if (!nt) {
                cu_fail(c, PD_ERR_NOMEM, "out of host memory for weight tables");
                return NULL;
            }
            c->wtabs = nt;
            c->cap_wtabs = cap;
        }
        t = &c->wtabs[c->n_wtabs++];
        memset(t, 0, sizeof *t);
        t->key = w;
        t->n = n;
    }
    /* (re)build: the weights behind this array changed */
    if (c->capturing) {
        cu_fail(c, PD_ERR_UNSUPPORTED, "weight table made while recording a graph");
        return NULL;
    }
    if (!t->host && !(t->host = (const void **)calloc((size_t)n, sizeof(void *)))) {
        cu_fail(c, PD_ERR_NOMEM, "out of host memory for weight tables");
        return NULL;
    }
    if (!t->dev) {
        if (!CU_OK(c, cudaMalloc((void **)&t->dev, (size_t)n * sizeof(void *))))
            return NULL;
        cu_count_alloc(c, (size_t)n * sizeof(void *));
    }
    for (int e = 0; e < n; e++)
        t->host[e] = w[e].data;
    if (!CU_OK(c, cudaMemcpyAsync((void *)t->dev, t->host, (size_t)n * sizeof(void *), cudaMemcpyHostToDevice,
                                  c->stream)) ||
        !CU_OK(c, cudaStreamSynchronize(c->stream)))
        return NULL;
    return t->dev;
}

/* ---- graphs ---- */

typedef struct {
    cudaGraphExec_t exec;
    uint64_t gen;
} cu_graph;

static pd_status cu_graph_begin(pd_backend *be) {
    cu_ctx *c = cu_of(be);
    cu_x16_forget(c);
    if (c->graphs_off)
        return PD_ERR_UNSUPPORTED;
    if (c->status != PD_OK || c->capturing)
        return c->status != PD_OK ? c->status : PD_ERR_INVALID;
    if (!CU_OK(c, cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal)))
        return c->status;
    c->capturing = true;
    return PD_OK;
}

static pd_status cu_graph_end(pd_backend *be, void **graph_p) {
    cu_ctx *c = cu_of(be);
    cu_x16_forget(c);
    if (!c->capturing)
        return PD_ERR_INVALID;
    c->capturing = false;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    cudaGraphExec_t exec = NULL;
    if (e == cudaSuccess && c->status == PD_OK)
        e = cudaGraphInstantiate(&exec, g, 0);
    if (g)
        cudaGraphDestroy(g);
    if (e != cudaSuccess || c->status != PD_OK) {
        /* something in the recording could not be recorded: say so once and
         * carry on without graphs (the operations themselves work) */
        (void)cudaGetLastError();
        CU_LOGW("recording a graph failed (%s; %s): steps run without graphs",
                e != cudaSuccess ? cudaGetErrorString(e) : "an operation failed",
                c->status != PD_OK ? c->msg : "-");
        c->status = PD_OK;
        c->msg[0] = 0;
        c->graphs_off = true;
        if (exec)
            cudaGraphExecDestroy(exec);
        return PD_ERR_UNSUPPORTED;
    }
    cu_graph *cg = (cu_graph *)calloc(1, sizeof *cg);
    if (!cg) {
        cudaGraphExecDestroy(exec);
        return PD_ERR_NOMEM;
    }
    cg->exec = exec;
    cg->gen = c->scr_gen;
    *graph_p = cg;
    return PD_OK;
}

static pd_status cu_graph_launch(pd_backend *be, void *graph) {
    cu_ctx *c = cu_of(be);
    cu_graph *cg = (cu_graph *)graph;
    cu_x16_forget(c); /* the replay rewrites what it wrote when recorded */
    if (c->status != PD_OK)
        return c->status;
    if (c->graphs_off)
        return PD_ERR_UNSUPPORTED;
    if (cg->gen != c->scr_gen)
        return PD_ERR_LIMIT;
    if (!CU_OK(c, cudaGraphLaunch(cg->exec, c->stream)))
        return c->status;
    return PD_OK;
}

static void cu_graph_free(pd_backend *be, void *graph) {
    cu_ctx *c = cu_of(be);
    cu_graph *cg = (cu_graph *)graph;
    if (!cg)
        return;
    cudaStreamSynchronize(c->stream);
    cudaGraphExecDestroy(cg->exec);
    free(cg);
}

static void cu_destroy(pd_backend *be) {
    cu_ctx *c = cu_of(be);
    int prev = 0; /* any thread may destroy any rank's backend */
    cudaGetDevice(&prev);
    cudaSetDevice(c->device);
    cudaStreamSynchronize(c->stream);
    cu_comm_free(c);
    for (int i = 0; i < c->n_wtabs; i++) {
        cudaFree((void *)c->wtabs[i].dev);
        free(c->wtabs[i].host);
    }
    free(c->wtabs);
    cu_moe_sets_free(c);
#ifdef PD_CUDA_PROBE
    cu_mla_probe_dump();
#endif
    for (int i = 0; i < CU_SCR_COUNT; i++)
        if (c->scr[i].p)
            cudaFree(c->scr[i].p);
    for (int i = 0; i < CU_HSCR_COUNT; i++) {
        if (c->hscr[i].p)
            cudaFreeHost(c->hscr[i].p);
        if (c->hscr[i].done)
            cudaEventDestroy(c->hscr[i].done);
    }
    cu_gemm_plans_free(c);
    cudaFree(c->lt_ws);
    free(c->allocs);
    cublasLtMatmulDescDestroy(c->mm_desc);
    cublasLtDestroy(c->lt);
    cublasDestroy(c->blas);
    if (c->upload_ev)
        cudaEventDestroy(c->upload_ev);
    cudaStreamDestroy(c->stream);
    free(c);
    free(be);
    cudaSetDevice(prev);
}

/* ---- the table's entries ----
 *
 * Every operation but gemm and gemm_swiglu enters through a wrapper that
 * first forgets the bf16 copy of the last GEMM input (cu_ctx.x16; gemm.cu
 * states the rule): whatever an operation writes, no later GEMM can read a
 * copy made before it. One place, so that an operation added to the table
 * cannot forget to. */
#define CU_OP(ret, name, params, args)                                                                             \
    static ret op_##name params {                                                                                  \
        cu_x16_forget(cu_of(be));                                                                                  \
        return cu_##name args;                                                                                     \
    }
CU_OP(void *, alloc, (pd_backend * be, size_t bytes), (be, bytes))
CU_OP(void, free, (pd_backend * be, void *p), (be, p))
CU_OP(void, upload, (pd_backend * be, void *dst, const void *src, size_t bytes), (be, dst, src, bytes))
CU_OP(void, download, (pd_backend * be, void *dst, const void *src, size_t bytes), (be, dst, src, bytes))
CU_OP(void, upload_async, (pd_backend * be, void *dst, const void *src, size_t bytes), (be, dst, src, bytes))
CU_OP(void, upload_wait, (pd_backend * be), (be))
CU_OP(void, copy, (pd_backend * be, void *dst, const void *src, size_t bytes), (be, dst, src, bytes))
CU_OP(pd_status, weight_from_f32, (pd_backend * be, const float *host, int rows, int cols, pd_weight *w_p),
      (be, host, rows, cols, w_p))
CU_OP(void, weight_free, (pd_backend * be, pd_weight *w), (be, w))
CU_OP(void, rmsnorm,
      (pd_backend * be, int rows, int dim, const float *x, int x_stride, const float *w, float eps, float *y,
       int y_stride),
      (be, rows, dim, x, x_stride, w, eps, y, y_stride))
CU_OP(void, rope,
      (pd_backend * be, int rows, int n_heads, float *x, int row_stride, int head_stride, int rope_dim,
       const int *pos, const float *inv_freq, float mscale),
      (be, rows, n_heads, x, row_stride, head_stride, rope_dim, pos, inv_freq, mscale))
CU_OP(void, silu_mul, (pd_backend * be, int rows, int inter, const float *gu, float *out), (be, rows, inter, gu, out))
CU_OP(void, add, (pd_backend * be, size_t n, float *x, const float *y), (be, n, x, y))
CU_OP(void, embed, (pd_backend * be, int rows, int dim, const int32_t *ids, const pd_weight *table, float *out),
      (be, rows, dim, ids, table, out))
CU_OP(void, mla_attention, (pd_backend * be, const pd_mla_args *a), (be, a))
CU_OP(void, moe_route,
      (pd_backend * be, int rows, const float *logits, const pd_moe_route_params *p, int32_t *ids, float *weights),
      (be, rows, logits, p, ids, weights))
CU_OP(void, moe_experts,
      (pd_backend * be, int rows, int hidden, int inter, const float *x, const int32_t *ids, const float *weights,
       int top_k, const pd_weight *gate_up, const pd_weight *down, float *out),
      (be, rows, hidden, inter, x, ids, weights, top_k, gate_up, down, out))
CU_OP(void, embed_ids, (pd_backend * be, int rows, int dim, const int32_t *ids, const pd_weight *table, float *out),
      (be, rows, dim, ids, table, out))
CU_OP(void, rope_pos,
      (pd_backend * be, int rows, int n_heads, float *x, int row_stride, int head_stride, int rope_dim,
       const int32_t *pos, const float *inv_freq, float mscale),
      (be, rows, n_heads, x, row_stride, head_stride, rope_dim, pos, inv_freq, mscale))
CU_OP(void, kv_store,
      (pd_backend * be, int rows, int dim, const float *src, int src_stride, float *cache, const int32_t *slots,
       size_t slot_offset),
      (be, rows, dim, src, src_stride, cache, slots, slot_offset))
CU_OP(void, mla_decode, (pd_backend * be, const pd_mla_decode_args *a), (be, a))
CU_OP(void, moe_route_ids,
      (pd_backend * be, int rows, const float *logits, const pd_moe_route_params *p, int32_t *ids, float *weights),
      (be, rows, logits, p, ids, weights))
CU_OP(void, moe_experts_ids,
      (pd_backend * be, int rows, int hidden, int inter, const float *x, const int32_t *ids, const float *weights,
       int top_k, int n_experts, const pd_weight *gate_up, const pd_weight *down, float *out),
      (be, rows, hidden, inter, x, ids, weights, top_k, n_experts, gate_up, down, out))
CU_OP(void, moe_ids_local, (pd_backend * be, size_t n, int32_t *ids, int first, int count), (be, n, ids, first, count))
CU_OP(void, mla_prep, (pd_backend * be, const pd_mla_prep_args *a), (be, a))
CU_OP(void, add_rmsnorm,
      (pd_backend * be, int rows, int dim, float *x, const float *y, const float *w, float eps, float *h),
      (be, rows, dim, x, y, w, eps, h))
CU_OP(bool, moe_block, (pd_backend * be, const pd_moe_block_args *a), (be, a))
CU_OP(void, rmsnorm_gemm_pair,
      (pd_backend * be, int rows, int dim, const float *x, const float *norm, float eps, float *h,
       const pd_weight *w1, float *y1, const pd_weight *w2, float *y2),
      (be, rows, dim, x, norm, eps, h, w1, y1, w2, y2))
CU_OP(void, all_reduce_sum, (pd_backend * be, float *x, size_t n), (be, x, n))
CU_OP(void *, host_alloc, (pd_backend * be, size_t bytes), (be, bytes))
CU_OP(void, host_free, (pd_backend * be, void *p), (be, p))
CU_OP(pd_status, host_register, (pd_backend * be, void *p, size_t bytes), (be, p, bytes))
CU_OP(void, host_unregister, (pd_backend * be, void *p), (be, p))
CU_OP(pd_status, weight_alloc, (pd_backend * be, int rows, int cols, pd_weight *w_p), (be, rows, cols, w_p))
CU_OP(pd_status, weight_set_bf16, (pd_backend * be, pd_weight *w, int row0, int n_rows, const uint16_t *src),
      (be, w, row0, n_rows, src))
CU_OP(void, graph_free, (pd_backend * be, void *graph), (be, graph))
CU_OP(void, thread_bind, (pd_backend * be), (be))
CU_OP(size_t, device_bytes, (pd_backend * be), (be))
CU_OP(void, sample_rows,
      (pd_backend * be, int n, int vocab, float *logits, const pd_sample_row *rows, const pd_sample_tok *toks,
       int n_toks, pd_sample_out *out),
      (be, n, vocab, logits, rows, toks, n_toks, out))
#undef CU_OP

static const pd_backend_i cu_ops = {
    .name = "cuda",
    .alloc = op_alloc,
    .free = op_free,
    .upload = op_upload,
    .download = op_download,
    .copy = op_copy,
    .weight_from_f32 = op_weight_from_f32,
    .weight_free = op_weight_free,
    .gemm = cu_gemm,
    .rmsnorm = op_rmsnorm,
    .rope = op_rope,
    .silu_mul = op_silu_mul,
    .add = op_add,
    .embed = op_embed,
    .mla_attention = op_mla_attention,
    .moe_route = op_moe_route,
    .moe_experts = op_moe_experts,
    .destroy = cu_destroy,
    .embed_ids = op_embed_ids,
    .rope_pos = op_rope_pos,
    .kv_store = op_kv_store,
    .mla_decode = op_mla_decode,
    .moe_route_ids = op_moe_route_ids,
    .moe_experts_ids = op_moe_experts_ids,
    .moe_ids_local = op_moe_ids_local,
    .mla_prep = op_mla_prep,
    .gemm_swiglu = cu_gemm_swiglu,
    .add_rmsnorm = op_add_rmsnorm,
    .moe_block = op_moe_block,
    .rmsnorm_gemm_pair = op_rmsnorm_gemm_pair,
    .all_reduce_sum = op_all_reduce_sum,
    .host_alloc = op_host_alloc,
    .host_free = op_host_free,
    .upload_async = op_upload_async,
    .upload_wait = op_upload_wait,
    .host_register = op_host_register,
    .host_unregister = op_host_unregister,
    .weight_alloc = op_weight_alloc,
    .weight_set_bf16 = op_weight_set_bf16,
    .graph_begin = cu_graph_begin,
    .graph_end = cu_graph_end,
    .graph_launch = cu_graph_launch,
    .graph_free = op_graph_free,
    .thread_bind = op_thread_bind,
    .device_bytes = op_device_bytes,
    .sample_rows = op_sample_rows,
};

extern "C" {

pd_status pd_backend_cuda_init_ex(int device, pd_cuda_weights weights, pd_backend **be_p, pd_err *err) {
    cudaDeviceProp prop;
    pd_status pst = cu_device_props(device, &prop, err);
    if (pst != PD_OK)
        return pst;
    if (weights != PD_CUDA_WEIGHTS_BF16 && weights != PD_CUDA_WEIGHTS_F32)
        return cu_err_set(err, PD_ERR_INVALID, "unknown CUDA weight format %d", (int)weights);
    cudaError_t e;
    if (prop.major != 9 || prop.minor != 0)
        return cu_err_set(err, PD_ERR_UNSUPPORTED, "CUDA device %d (%s) is sm_%d%d; this build holds sm_90a code only",
                          device, prop.name, prop.major, prop.minor);
    if ((e = cudaSetDevice(device)) != cudaSuccess)
        return cu_err_set(err, PD_ERR_IO, "cudaSetDevice(%d): %s", device, cudaGetErrorString(e));

    pd_status st = PD_ERR_NOMEM;
    cublasStatus_t bs;
    pd_backend *be = (pd_backend *)calloc(1, sizeof *be);
    cu_ctx *c = (cu_ctx *)calloc(1, sizeof *c);
    if (!be || !c) {
        cu_err_set(err, PD_ERR_NOMEM, "out of memory for the CUDA backend");
        goto err_free_structs;
    }
    c->device = device;
    c->n_sm = prop.multiProcessorCount;
    c->smem_optin = prop.sharedMemPerBlockOptin;
    c->smem_per_sm = prop.sharedMemPerMultiprocessor;
    c->smem_reserved = prop.reservedSharedMemPerBlock;
    c->uva = prop.unifiedAddressing != 0;
    c->wfmt = weights;
    {
        const char *g = getenv("PD_CUDA_GRAPHS");
        c->graphs_off = g && !strcmp(g, "0");
        /* tuning knobs for A/B runs (tests/gpu/run.sh prof): the decode
         * attention's least tokens a split, and the first version's MLA
         * q_lat / merge kernels */
        const char *mc = getenv("PD_MLA_MIN_CHUNK");
        c->mla_min_chunk = mc && atoi(mc) > 0 ? atoi(mc) : CU_MLA_MIN_CHUNK;
        const char *fk = getenv("PD_MLA_FIRST_KERNELS");
        c->mla_first_kernels = !fk ? 0 : !strcmp(fk, "1") ? 3 : !strcmp(fk, "qlat") ? 1 : !strcmp(fk, "merge") ? 2 : 0;
        const char *pl = getenv("PD_CUDA_PDL");
        c->pdl = !(pl && !strcmp(pl, "0"));
        const char *mp = getenv("PD_MLA_PREFILL");
        c->mla_prefill_gemm = !(mp && !strcmp(mp, "kernel"));
        c->mla_prefill_flash = !(mp && (!strcmp(mp, "kernel") || !strcmp(mp, "gemm")));
        const char *sk = getenv("PD_CUDA_SKINNY"); /* 0: cuBLASLt for every GEMM (A/B runs, numerics checks) */
        c->no_gemv = sk && !strcmp(sk, "0");
        const char *gp = getenv("PD_CUDA_GEMM_PLANS");
        c->gemm_exact_plans = gp && !strcmp(gp, "exact");
        const char *mr = getenv("PD_MOE_ROWS");
        c->moe_f32_rows = mr && !strcmp(mr, "f32");
        const char *mf = getenv("PD_MLA_FLASH"), *vs = getenv("PD_MLA_FLASH_VSWAP");
        c->mla_flash_wgmma = c->mla_flash_wgmma_start = prop.major >= 9 && !(mf && !strcmp(mf, "mma"));
        c->mla_flash_vswap = vs && !strcmp(vs, "1");
        const char *w2 = getenv("PD_MLA_FLASH_WG");
        c->mla_flash_wg2 = !(w2 && !strcmp(w2, "1"));
        const char *my = getenv("PD_MOE_Y");
        c->moe_y_f32 = my && !strcmp(my, "f32");
        const char *mh = getenv("PD_MOE_PLAN");
        c->moe_host_plan = mh && !strcmp(mh, "host");
        const char *mb = getenv("PD_MOE_BLOCK");
        c->moe_block_composed = mb && !strcmp(mb, "0");
        const char *mr1 = getenv("PD_MOE_ROUTE");
        c->moe_route_in_gate = mr1 && !strcmp(mr1, "gate");
        const char *mpp = getenv("PD_MLA_PREP");
        c->mla_prep_apart = mpp && !strcmp(mpp, "apart");
        const char *md = getenv("PD_MLA_DECODE");
        c->mla_decode_scalar = md && !strcmp(md, "scalar");
        const char *sf = getenv("PD_MOE_SHARED_FIRST");
        c->moe_shared_last = sf && !strcmp(sf, "0");
        const char *gp1 = getenv("PD_MOE_GU1_PDL");
        c->moe_gu1_plain = gp1 && !strcmp(gp1, "0");
        const char *dn1 = getenv("PD_MOE_DOWN1");
        c->moe_down1_off = dn1 && !strcmp(dn1, "0");
        const char *gpre = getenv("PD_GEMV_PRE");
        c->gemv_pre_off = gpre && !strcmp(gpre, "0");
        const char *mpd = getenv("PD_MLA_PDL");
        c->mla_pdl_off = mpd && !strcmp(mpd, "0");
        const char *cp1 = getenv("PD_MOE_COMBINE1_PDL");
        c->moe_cmb1_plain = cp1 && !strcmp(cp1, "0");
        const char *dc = getenv("PD_MOE_DOWN1_COMBINE");
        c->moe_dn1_cmb_off = dc && !strcmp(dc, "0");
        const char *mmf = getenv("PD_MLA_MERGE_FAST");
        c->mla_merge_slow = mmf && !strcmp(mmf, "0");
        const char *sgf = getenv("PD_SAMPLE_GREEDY_FAST");
        c->sample_generic = sgf && !strcmp(sgf, "0");
        const char *swc = getenv("PD_SAMPLE_WCACHE");
        c->sample_wc_off = swc && !strcmp(swc, "0");
        const char *scl = getenv("PD_SAMPLE_CLUSTER");
        const int scl_n = scl ? atoi(scl) : 0;
        c->sample_cl_force = scl_n == 1 || scl_n == 2 || scl_n == 4 || scl_n == 8 || scl_n == 16 ? scl_n : 0;
        const char *mtp = getenv("PD_MLA_TILE_PRE");
        c->mla_tile_pre1 = mtp && !strcmp(mtp, "1");
        const char *mtb = getenv("PD_MLA_TILE_BULK"); /* cp.async.bulk and its mbarrier: sm_90 */
        c->mla_tile_bulk = prop.major >= 9 && !(mtb && !strcmp(mtb, "0"));
        const char *mmc = getenv("PD_MLA_MERGE_CLUSTER"); /* thread block clusters: sm_90 */
        c->mla_merge_cl = prop.major >= 9 && !(mmc && !strcmp(mmc, "0"));
        const char *qpr = getenv("PD_QLAT_PRE");
        c->mla_qlat_pre1 = qpr && !strcmp(qpr, "1");
        const char *nv = getenv("PD_NORM_V");
        c->norm_v_off = nv && !strcmp(nv, "0");
        const char *orr = getenv("PD_MOE_OROUTE");
        c->moe_oroute_off = orr && !strcmp(orr, "0");
        const char *gps = getenv("PD_MOE_GU1_PASS");
        c->moe_gu1_pass_off = gps && !strcmp(gps, "0");
        const char *m1r = getenv("PD_MOE1_ROWS");
        c->moe1_rows_gu = m1r && m1r[0] == '2' ? 2 : 4;
        c->moe1_rows_dn = m1r && m1r[0] && m1r[1] == ',' && m1r[2] == '2' ? 2 : 4;
        const char *qc = getenv("PD_QLAT_COLS");
        c->qlat_cols = qc && !strcmp(qc, "256") ? 256 : 0;
        const char *ms = getenv("PD_MLA_SPLITS");
        c->mla_max_splits = ms && atoi(ms) > 0 && atoi(ms) <= 256 ? atoi(ms) : 0;
    }
    if ((e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        st = cu_err_set(err, PD_ERR_IO, "cudaStreamCreate: %s", cudaGetErrorString(e));
        goto err_free_structs;
    }
    if ((bs = cublasCreate(&c->blas)) != CUBLAS_STATUS_SUCCESS) {
        st = cu_err_set(err, PD_ERR_IO, "cublasCreate: %s", cublasGetStatusString(bs));
        goto err_destroy_stream;
    }
    /* CUBLAS_DEFAULT_MATH: fp32 GEMMs stay fp32 (no TF32) */
    if ((bs = cublasSetStream(c->blas, c->stream)) != CUBLAS_STATUS_SUCCESS ||
        (bs = cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS) {
        st = cu_err_set(err, PD_ERR_IO, "cublasSetStream/SetMathMode: %s", cublasGetStatusString(bs));
        goto err_destroy_blas;
    }
    if ((bs = cublasLtCreate(&c->lt)) != CUBLAS_STATUS_SUCCESS) {
        st = cu_err_set(err, PD_ERR_IO, "cublasLtCreate: %s", cublasGetStatusString(bs));
        goto err_destroy_blas;
    }
    {
        cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        if ((bs = cublasLtMatmulDescCreate(&c->mm_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)) != CUBLAS_STATUS_SUCCESS) {
            st = cu_err_set(err, PD_ERR_IO, "cublasLtMatmulDescCreate: %s", cublasGetStatusString(bs));
            goto err_destroy_lt;
        }
        if ((bs = cublasLtMatmulDescSetAttribute(c->mm_desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta)) !=
                CUBLAS_STATUS_SUCCESS ||
            (bs = cublasLtMatmulDescSetAttribute(c->mm_desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb)) !=
                CUBLAS_STATUS_SUCCESS) {
            st = cu_err_set(err, PD_ERR_IO, "cublasLtMatmulDescSetAttribute: %s", cublasGetStatusString(bs));
            goto err_destroy_desc;
        }
    }
    c->lt_ws_bytes = CU_LT_WORKSPACE;
    if ((e = cudaMalloc(&c->lt_ws, c->lt_ws_bytes)) != cudaSuccess) {
        st = cu_err_set(err, PD_ERR_NOMEM, "cudaMalloc(cuBLASLt workspace): %s", cudaGetErrorString(e));
        goto err_destroy_desc;
    }
    cu_count_alloc(c, c->lt_ws_bytes);
    be->ops = &cu_ops;
    be->ctx = c;
    be->n_threads = 0;
    be->n_ranks = 1;
    CU_LOGI("device %d: %s, %d SMs, %.1f GiB, weights %s", device, prop.name, c->n_sm,
            prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0), weights == PD_CUDA_WEIGHTS_BF16 ? "bf16" : "fp32");
    *be_p = be;
    return PD_OK;

err_destroy_desc:
    cublasLtMatmulDescDestroy(c->mm_desc);
err_destroy_lt:
    cublasLtDestroy(c->lt);
err_destroy_blas:
    cublasDestroy(c->blas);
err_destroy_stream:
    cudaStreamDestroy(c->stream);
err_free_structs:
    free(c);
    free(be);
    return st;
}

pd_status pd_backend_cuda_init(int device, pd_backend **be_p, pd_err *err) {
    const char *fmt = getenv("PD_CUDA_WEIGHTS");
    pd_cuda_weights w = PD_CUDA_WEIGHTS_BF16;
    if (fmt && (!strcmp(fmt, "f32") || !strcmp(fmt, "fp32")))
        w = PD_CUDA_WEIGHTS_F32;
    else if (fmt && *fmt && strcmp(fmt, "bf16") != 0)
        return cu_err_set(err, PD_ERR_INVALID, "PD_CUDA_WEIGHTS='%s': expected bf16 or f32", fmt);
    return pd_backend_cuda_init_ex(device, w, be_p, err);
}

pd_status pd_backend_cuda_status(pd_backend *be, pd_err *err) {
    if (!be || be->ops != &cu_ops)
        return cu_err_set(err, PD_ERR_INVALID, "not a CUDA backend");
    cu_ctx *c = cu_of(be);
    if (c->status == PD_OK)
        CU_OK(c, cudaStreamSynchronize(c->stream));
    if (c->status != PD_OK)
        return cu_err_set(err, c->status, "%s", c->msg);
    return PD_OK;
}

void *pd_backend_cuda_stream(pd_backend *be) {
    return (void *)cu_of(be)->stream;
}

void pd_backend_cuda_set_features(pd_backend *be, const pd_cuda_features *f) {
    cu_ctx *c = cu_of(be);
    c->graphs_off = !f->graphs;
    c->no_gemv = !f->gemv;
    c->no_moe_device = !f->moe_device;
    c->mla_prefill_gemm = f->mla_prefill_gemm;
    c->mla_prefill_flash = f->mla_prefill_flash;
    c->mla_prefill_chunk = f->mla_prefill_chunk > 0 ? f->mla_prefill_chunk : 0;
    c->mla_flash_wgmma = c->mla_flash_wgmma_start && !f->mla_flash_mma;
}

} /* extern "C" */

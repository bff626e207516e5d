/* The CUDA backend's GEMM and MLA attention against this GPU's ceilings,
 * measured in the same run (METHOD: a large device-to-device copy, counting
 * bytes read plus written; a large cuBLASLt product of the same dtype).
 *
 *   gemm: y[M×N] = x[M×K]·Wᵀ at the DeepSeek-V3 dense-MLP shapes
 *   (v3-layers: hidden 7168, intermediate 18432), M = 1, 64, 4096, through
 *   the backend (bf16 weights: fp32 x rounded to bf16, cuBLASLt, fp32 out;
 *   f32 weights: cublasSgemm) and through cuBLASLt directly on bf16 inputs.
 *   mla decode: one query over L cached tokens (absorbed form), DeepSeek-V3
 *   attention dims (latent 512, rope 64, nope 128, v 128) with 16 heads (V2-Lite,
 *   or V3 over 8-way tensor parallelism) and 128 heads (V3 on one GPU).
 *
 * Every time is the median of repeated runs after warm-up, timed with CUDA
 * events on the backend's stream; inputs are random (never zeros).
 * Built by tests/gpu/build.sh, run by tests/gpu/run.sh on a GPU host. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pd_kernels.h"
#include "bench_util.h"
#include "cuda/pd_cuda.h"

#define CB(x)                                                                                                    \
    do {                                                                                                         \
        cublasStatus_t s_ = (x);                                                                                 \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                       \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cublasGetStatusString(s_));                \
            exit(1);                                                                                             \
        }                                                                                                        \
    } while (0)

static uint64_t g_rs = 0x9e3779b97f4a7c15ull;
static float frand(void) { /* uniform in [-1, 1) */
    g_rs ^= g_rs << 13;
    g_rs ^= g_rs >> 7;
    g_rs ^= g_rs << 17;
    return (float)((g_rs >> 40) * (1.0 / (1 << 23)) - 1.0);
}
static float *host_rand(size_t n, float scale) {
    float *p = malloc(n * sizeof(float));
    if (!p) {
        fprintf(stderr, "out of host memory\n");
        exit(1);
    }
    for (size_t i = 0; i < n; i++)
        p[i] = frand() * scale;
    return p;
}

typedef void (*op_fn)(void *arg);

/* Median seconds of `reps` runs of fn on stream s after `warm` warm-ups. */
static double time_median(cudaStream_t s, op_fn fn, void *arg, int warm, int reps) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < warm; i++)
        fn(arg);
    CK(cudaStreamSynchronize(s));
    double t[64];
    if (reps > 64) reps = 64;
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a, s));
        fn(arg);
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t[i] = ms * 1e-3;
    }
    qsort(t, reps, sizeof t[0], cmp_d);
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return t[reps / 2];
}

static void check_be(pd_backend *be, const char *what) {
    pd_err err = {{0}};
    if (pd_backend_cuda_status(be, &err) != PD_OK) {
        fprintf(stderr, "%s: backend error: %s\n", what, err.msg);
        exit(1);
    }
}

/* ---- ceilings ---- */

typedef struct {
    void *dst, *src;
    size_t bytes;
    cudaStream_t s;
} copy_arg;
static void do_copy(void *p) {
    copy_arg *a = p;
    CK(cudaMemcpyAsync(a->dst, a->src, a->bytes, cudaMemcpyDeviceToDevice, a->s));
}

/* D[N×M] = op(A)ᵀ-layout product, the backend's "TN" layout: A bf16 [N×K] row-major,
 * B bf16 [M×K] row-major, D fp32 [M×N] row-major, fp32 accumulation. */
typedef struct {
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
    const void *A, *B;
    void *D;
    void *ws;
    size_t ws_bytes;
    cudaStream_t s;
} lt_arg;

static void lt_setup(lt_arg *g, int M, int N, int K, cudaDataType_t ab, cudaDataType_t dt, cublasComputeType_t ct) {
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CB(cublasLtMatmulDescCreate(&g->desc, ct, CUDA_R_32F));
    CB(cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CB(cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CB(cublasLtMatrixLayoutCreate(&g->la, ab, K, N, K));
    CB(cublasLtMatrixLayoutCreate(&g->lb, ab, K, M, K));
    CB(cublasLtMatrixLayoutCreate(&g->ld, dt, N, M, N));
    cublasLtMatmulPreference_t pref;
    CB(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = g->ws_bytes;
    CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    cublasLtMatmulHeuristicResult_t r;
    int n = 0;
    CB(cublasLtMatmulAlgoGetHeuristic(g->lt, g->desc, g->la, g->lb, g->ld, g->ld, pref, 1, &r, &n));
    if (n < 1) {
        fprintf(stderr, "no cuBLASLt algorithm for %dx%dx%d\n", M, N, K);
        exit(1);
    }
    g->algo = r.algo;
    cublasLtMatmulPreferenceDestroy(pref);
}
static void lt_free(lt_arg *g) {
    cublasLtMatrixLayoutDestroy(g->la);
    cublasLtMatrixLayoutDestroy(g->lb);
    cublasLtMatrixLayoutDestroy(g->ld);
    cublasLtMatmulDescDestroy(g->desc);
}
static void do_lt(void *p) {
    lt_arg *g = p;
    const float alpha = 1.0f, beta = 0.0f;
    CB(cublasLtMatmul(g->lt, g->desc, &alpha, g->A, g->la, g->B, g->lb, &beta, g->D, g->ld, g->D, g->ld, &g->algo,
                      g->ws, g->ws_bytes, g->s));
}

typedef struct {
    cublasHandle_t h;
    int M, N, K;
    const float *A, *B;
    float *C;
} sgemm_arg;
static void do_sgemm(void *p) {
    sgemm_arg *g = p;
    const float alpha = 1.0f, beta = 0.0f;
    CB(cublasSgemm(g->h, CUBLAS_OP_T, CUBLAS_OP_N, g->N, g->M, g->K, &alpha, g->A, g->K, g->B, g->K, &beta, g->C,
                   g->N));
}

/* ---- backend ops ---- */

typedef struct {
    pd_backend *be;
    int M;
    const float *x;
    const pd_weight *w;
    float *y;
} gemm_arg;
static void do_gemm(void *p) {
    gemm_arg *g = p;
    g->be->ops->gemm(g->be, g->M, g->x, g->w, g->y, false);
}

typedef struct {
    pd_backend *be;
    pd_mla_args a;
} mla_arg;
static void do_mla(void *p) {
    mla_arg *g = p;
    g->be->ops->mla_attention(g->be, &g->a);
}

int main(void) {
    pd_err err = {{0}};
    pd_backend *be16, *be32;
    if (pd_backend_cuda_init_ex(0, PD_CUDA_WEIGHTS_BF16, &be16, &err) != PD_OK ||
        pd_backend_cuda_init_ex(0, PD_CUDA_WEIGHTS_F32, &be32, &err) != PD_OK) {
        fprintf(stderr, "bench_cuda: %s\n", err.msg);
        return 1;
    }
    cudaStream_t s16 = (cudaStream_t)pd_backend_cuda_stream(be16), s32 = (cudaStream_t)pd_backend_cuda_stream(be32);
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int drv = 0, rt = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    time_t now = time(NULL);
    char date[32];
    strftime(date, sizeof date, "%Y-%m-%d", gmtime(&now));
    printf("# bench_cuda %s: %s, %d SMs, %.0f GiB, driver %d, runtime %d\n\n", date, prop.name,
           prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0, drv, rt);

    /* ---- ceilings ---- */
    size_t cb = (size_t)1 << 30;
    void *src, *dst;
    CK(cudaMalloc(&src, cb));
    CK(cudaMalloc(&dst, cb));
    CK(cudaMemset(src, 0x5a, cb));
    CK(cudaDeviceSynchronize());
    copy_arg ca = {dst, src, cb, s16};
    double t_copy = time_median(s16, do_copy, &ca, 3, 20);
    double bw_copy = 2.0 * cb / t_copy;
    CK(cudaFree(src));
    CK(cudaFree(dst));
    printf("ceiling: device-to-device copy of 1 GiB: %.3f ms, %.0f GB/s (read + written)\n", t_copy * 1e3,
           bw_copy / 1e9);

    cublasLtHandle_t lt;
    CB(cublasLtCreate(&lt));
    void *ws;
    size_t ws_bytes = 32u << 20;
    CK(cudaMalloc(&ws, ws_bytes));
    int P = 8192;
    float *hp = host_rand((size_t)P * P, 1.0f);
    pd_weight pa, pb;
    if (be16->ops->weight_from_f32(be16, hp, P, P, &pa) != PD_OK ||
        be16->ops->weight_from_f32(be16, hp, P, P, &pb) != PD_OK) {
        fprintf(stderr, "bf16 peak operands: out of memory\n");
        return 1;
    }
    float *pd32;
    CK(cudaMalloc((void **)&pd32, (size_t)P * P * 4));
    lt_arg pk = {.lt = lt, .A = pa.data, .B = pb.data, .D = pd32, .ws = ws, .ws_bytes = ws_bytes, .s = s16};
    lt_setup(&pk, P, P, P, CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    double t_peak = time_median(s16, do_lt, &pk, 3, 10);
    double peak_bf16 = 2.0 * P * P * (double)P / t_peak;
    lt_free(&pk);
    printf("ceiling: cuBLASLt bf16 x bf16 -> fp32 (fp32 accumulate) %dx%dx%d: %.3f ms, %.0f TFLOP/s\n", P, P, P,
           t_peak * 1e3, peak_bf16 / 1e12);
    be16->ops->weight_free(be16, &pa);
    be16->ops->weight_free(be16, &pb);
    /* fp32 ceiling: cublasSgemm without TF32 */
    cublasHandle_t blas;
    CB(cublasCreate(&blas));
    CB(cublasSetStream(blas, s32));
    float *fa, *fb;
    CK(cudaMalloc((void **)&fa, (size_t)P * P * 4));
    CK(cudaMalloc((void **)&fb, (size_t)P * P * 4));
    CK(cudaMemcpy(fa, hp, (size_t)P * P * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(fb, hp, (size_t)P * P * 4, cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());
    sgemm_arg sg = {blas, P, P, P, fa, fb, pd32};
    double t_sg = time_median(s32, do_sgemm, &sg, 2, 5);
    double peak_f32 = 2.0 * P * P * (double)P / t_sg;
    printf("ceiling: cublasSgemm fp32 (no TF32) %dx%dx%d: %.3f ms, %.1f TFLOP/s\n\n", P, P, P, t_sg * 1e3,
           peak_f32 / 1e12);
    CK(cudaFree(fa));
    CK(cudaFree(fb));
    CK(cudaFree(pd32));
    free(hp);

    /* ---- backend gemm at v3-layers MLP shapes ---- */
    static const int shapes[2][2] = {{18432, 7168}, {7168, 18432}}; /* N (out), K (in) */
    static const int Ms[3] = {1, 64, 4096};
    float *hw = host_rand((size_t)18432 * 7168, 0.02f);
    float *hx = host_rand((size_t)4096 * 18432, 1.0f);
    printf("| op | weights | M | N | K | backend ms | backend TFLOP/s | cuBLASLt bf16 same shape ms | backend / same-shape | "
           "backend / %s peak | weight GB/s (M=1) / copy ceiling |\n",
           "dtype");
    printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int si = 0; si < 2; si++) {
        int N = shapes[si][0], K = shapes[si][1];
        pd_weight w16, w32, xb;
        if (be16->ops->weight_from_f32(be16, hw, N, K, &w16) != PD_OK ||
            be32->ops->weight_from_f32(be32, hw, N, K, &w32) != PD_OK ||
            be16->ops->weight_from_f32(be16, hx, 4096, K, &xb) != PD_OK) {
            fprintf(stderr, "gemm weights: out of memory\n");
            return 1;
        }
        float *dx16 = be16->ops->alloc(be16, (size_t)4096 * K * 4), *dy16 = be16->ops->alloc(be16, (size_t)4096 * N * 4);
        float *dx32 = be32->ops->alloc(be32, (size_t)4096 * K * 4), *dy32 = be32->ops->alloc(be32, (size_t)4096 * N * 4);
        be16->ops->upload(be16, dx16, hx, (size_t)4096 * K * 4);
        be32->ops->upload(be32, dx32, hx, (size_t)4096 * K * 4);
        for (int mi = 0; mi < 3; mi++) {
            int M = Ms[mi];
            double fl = 2.0 * M * (double)N * K;
            int reps = M >= 4096 ? 10 : 30;
            gemm_arg g16 = {be16, M, dx16, &w16, dy16}, g32 = {be32, M, dx32, &w32, dy32};
            double t16 = time_median(s16, do_gemm, &g16, 3, reps);
            check_be(be16, "gemm bf16");
            lt_arg la = {.lt = lt, .A = w16.data, .B = xb.data, .D = dy16, .ws = ws, .ws_bytes = ws_bytes, .s = s16};
            lt_setup(&la, M, N, K, CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F);
            double tl = time_median(s16, do_lt, &la, 3, reps);
            lt_free(&la);
            double t32 = time_median(s32, do_gemm, &g32, 2, M >= 4096 ? 5 : reps);
            check_be(be32, "gemm f32");
            const char *name = si == 0 ? "MLP up" : "MLP down";
            printf("| %s | bf16 | %d | %d | %d | %.4f | %.1f | %.4f | %.2f | %.1f%% | ", name, M, N, K, t16 * 1e3,
                   fl / t16 / 1e12, tl * 1e3, tl / t16, 100.0 * fl / t16 / peak_bf16);
            if (M == 1)
                printf("%.0f GB/s, %.1f%% |\n", 2.0 * N * K / t16 / 1e9, 100.0 * (2.0 * N * K / t16) / bw_copy);
            else
                printf("- |\n");
            printf("| %s | f32 | %d | %d | %d | %.4f | %.1f | - | - | %.1f%% | ", name, M, N, K, t32 * 1e3,
                   fl / t32 / 1e12, 100.0 * fl / t32 / peak_f32);
            if (M == 1)
                printf("%.0f GB/s, %.1f%% |\n", 4.0 * N * K / t32 / 1e9, 100.0 * (4.0 * N * K / t32) / bw_copy);
            else
                printf("- |\n");
            fflush(stdout);
        }
        be16->ops->free(be16, dx16);
        be16->ops->free(be16, dy16);
        be32->ops->free(be32, dx32);
        be32->ops->free(be32, dy32);
        be16->ops->weight_free(be16, &w16);
        be16->ops->weight_free(be16, &xb);
        be32->ops->weight_free(be32, &w32);
    }
    free(hw);
    free(hx);

    /* ---- MLA decode (absorbed) over the paged cache ---- */
    printf("\n| op | heads | context L | block | ms | GB/s read | / copy ceiling | TFLOP/s (fp32 CUDA cores) | / "
           "sgemm ceiling |\n|---|---|---|---|---|---|---|---|---|\n");
    const int dn = 128, dr = 64, dv = 128, kvr = 512, D = kvr + dr, bs = 64;
    static const int heads[2] = {16, 128};
    static const int ctxs[2] = {4096, 32768};
    for (int hi = 0; hi < 2; hi++)
        for (int ci = 0; ci < 2; ci++) {
            int nh = heads[hi], L = ctxs[ci], nblk = (L + bs - 1) / bs;
            size_t ncache = (size_t)nblk * bs * D;
            float *hc = host_rand(ncache, 1.0f), *hq = host_rand((size_t)nh * (dn + dr), 1.0f);
            float *hkvb = host_rand((size_t)nh * (dn + dv) * kvr, 0.044f);
            int *btab = malloc(nblk * sizeof(int));
            for (int i = 0; i < nblk; i++)
                btab[i] = i;
            for (int i = nblk - 1; i > 0; i--) {
                int j = (int)(g_rs % (uint64_t)(i + 1)), t;
                frand();
                t = btab[i], btab[i] = btab[j], btab[j] = t;
            }
            float *dc = be16->ops->alloc(be16, ncache * 4), *dq = be16->ops->alloc(be16, (size_t)nh * (dn + dr) * 4);
            float *dout = be16->ops->alloc(be16, (size_t)nh * dv * 4);
            be16->ops->upload(be16, dc, hc, ncache * 4);
            be16->ops->upload(be16, dq, hq, (size_t)nh * (dn + dr) * 4);
            pd_weight kvb;
            if (be16->ops->weight_from_f32(be16, hkvb, nh * (dn + dv), kvr, &kvb) != PD_OK) {
                fprintf(stderr, "kv_b: out of memory\n");
                return 1;
            }
            mla_arg m = {be16,
                         {.n_heads = nh, .qk_nope_dim = dn, .qk_rope_dim = dr, .v_dim = dv, .kv_lora_rank = kvr,
                          .softmax_scale = 0.0722f, .n_q = 1, .start_pos = L - 1, .q = dq, .cache = dc,
                          .n_layers = 1, .layer = 0, .block_size = bs, .block_table = btab, .kv_b = &kvb,
                          .absorbed = true, .out = dout}};
            double t = time_median(s16, do_mla, &m, 3, 20);
            check_be(be16, "mla decode");
            double bytes = (double)L * D * 4 + (double)nh * (dn + dv) * kvr * 2 + nh * (dn + dr + dv) * 4.0;
            double fl = (double)nh * L * (2.0 * D + 2.0 * kvr) + nh * (2.0 * dn * kvr + 2.0 * dv * kvr);
            printf("| mla decode (absorbed) | %d | %d | %d | %.4f | %.0f | %.1f%% | %.2f | %.1f%% |\n", nh, L, bs,
                   t * 1e3, bytes / t / 1e9, 100.0 * bytes / t / bw_copy, fl / t / 1e12, 100.0 * fl / t / peak_f32);
            fflush(stdout);
            be16->ops->free(be16, dc);
            be16->ops->free(be16, dq);
            be16->ops->free(be16, dout);
            be16->ops->weight_free(be16, &kvb);
            free(hc);
            free(hq);
            free(hkvb);
            free(btab);
        }

    /* ---- MLA prefill (expanded), one 4096-token chunk, V2-Lite heads ---- */
    {
        int nh = 16, L = 4096, nblk = L / bs;
        size_t ncache = (size_t)nblk * bs * D;
        float *hc = host_rand(ncache, 1.0f), *hq = host_rand((size_t)L * nh * (dn + dr), 1.0f);
        float *hkvb = host_rand((size_t)nh * (dn + dv) * kvr, 0.044f);
        int *btab = malloc(nblk * sizeof(int));
        for (int i = 0; i < nblk; i++)
            btab[i] = i;
        float *dc = be16->ops->alloc(be16, ncache * 4), *dq = be16->ops->alloc(be16, (size_t)L * nh * (dn + dr) * 4);
        float *dout = be16->ops->alloc(be16, (size_t)L * nh * dv * 4);
        be16->ops->upload(be16, dc, hc, ncache * 4);
        be16->ops->upload(be16, dq, hq, (size_t)L * nh * (dn + dr) * 4);
        pd_weight kvb;
        if (be16->ops->weight_from_f32(be16, hkvb, nh * (dn + dv), kvr, &kvb) != PD_OK)
            return 1;
        mla_arg m = {be16,
                     {.n_heads = nh, .qk_nope_dim = dn, .qk_rope_dim = dr, .v_dim = dv, .kv_lora_rank = kvr,
                      .softmax_scale = 0.0722f, .n_q = L, .start_pos = 0, .q = dq, .cache = dc, .n_layers = 1,
                      .layer = 0, .block_size = bs, .block_table = btab, .kv_b = &kvb, .absorbed = false,
                      .out = dout}};
        double t = time_median(s16, do_mla, &m, 1, 5);
        check_be(be16, "mla prefill");
        double fl = 2.0 * L * nh * (dn + dv) * (double)kvr + (double)nh * L * (L + 1) / 2.0 * (2.0 * (dn + dr) + 2.0 * dv);
        printf("\nmla prefill (expanded), 16 heads, 4096 tokens from 0: %.3f ms, %.1f TFLOP/s (%.1f%% of the fp32 "
               "sgemm ceiling)\n",
               t * 1e3, fl / t / 1e12, 100.0 * fl / t / peak_f32);
        be16->ops->free(be16, dc);
        be16->ops->free(be16, dq);
        be16->ops->free(be16, dout);
        be16->ops->weight_free(be16, &kvb);
        free(hc);
        free(hq);
        free(hkvb);
        free(btab);
    }
    cudaFree(ws);
    cublasLtDestroy(lt);
    cublasDestroy(blas);
    be16->ops->destroy(be16);
    be32->ops->destroy(be32);
    return 0;
}

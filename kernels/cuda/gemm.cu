/* Dense GEMM y[M×N] (+)= x[M×K] · W[N×K]^T, fp32 activations in and out.
 *
 * In column-major terms (cuBLAS's) this is yᵀ[N×M] = W(op T of a K×N
 * column-major matrix, lda K) · xᵀ (K×M, ldb K), ldc N: the "TN" layout
 * cuBLASLt is fastest at.
 *   bf16 weights: x is rounded to bf16 into scratch, then cuBLASLt bf16 ×
 *   bf16 → fp32 with fp32 accumulation (CUBLAS_COMPUTE_32F); the heuristic's
 *   choice is cached per (M, N, K, pointer alignments). When the heuristic
 *   offers nothing, cublasGemmEx with the same types.
 *   fp32 weights: cublasSgemm, CUBLAS_DEFAULT_MATH (no TF32).
 */
#include "cuda_common.cuh"

#include <stdlib.h>
#include <string.h>

#define CU_MAX_PLANS 256

struct cu_gemm_plan {
    int M, N, K;
    unsigned al_a, al_b, al_c;
    cublasLtMatrixLayout_t a, b, cd;
    cublasLtMatmulAlgo_t algo;
    bool lt_ok; /* false: cublasGemmEx */
    bool used;
};

static unsigned ptr_align(const void *p) {
    uintptr_t u = (uintptr_t)p;
    unsigned a = 256;
    while (a > 1 && (u & (a - 1)))
        a >>= 1;
    return a;
}

static void plan_release(cu_gemm_plan *p) {
    if (!p->used)
        return;
    cublasLtMatrixLayoutDestroy(p->a);
    cublasLtMatrixLayoutDestroy(p->b);
    cublasLtMatrixLayoutDestroy(p->cd);
    p->used = false;
}

void cu_gemm_plans_free(cu_ctx *c) {
    if (!c->plans)
        return;
    for (int i = 0; i < CU_MAX_PLANS; i++)
        plan_release(&c->plans[i]);
    free(c->plans);
    c->plans = NULL;
}

/* The cached plan for this shape and these alignments, made on first use. */
static cu_gemm_plan *plan_get(cu_ctx *c, int M, int N, int K, const void *w, const void *xb, const void *y) {
    unsigned aa = ptr_align(w), ab = ptr_align(xb), ac = ptr_align(y);
    if (!c->plans && !(c->plans = (cu_gemm_plan *)calloc(CU_MAX_PLANS, sizeof(cu_gemm_plan)))) {
        cu_fail(c, PD_ERR_NOMEM, "gemm: out of memory for plans");
        return NULL;
    }
    for (int i = 0; i < c->n_plans; i++) {
        cu_gemm_plan *p = &c->plans[i];
        if (p->used && p->M == M && p->N == N && p->K == K && p->al_a == aa && p->al_b == ab && p->al_c == ac)
            return p;
    }
    cu_gemm_plan *p;
    if (c->n_plans < CU_MAX_PLANS) {
        p = &c->plans[c->n_plans++];
    } else {
        p = &c->plans[c->next_plan];
        c->next_plan = (c->next_plan + 1) % CU_MAX_PLANS;
        plan_release(p);
    }
    memset(p, 0, sizeof *p);
    p->M = M, p->N = N, p->K = K, p->al_a = aa, p->al_b = ab, p->al_c = ac;
    if (!CU_BLAS_OK(c, cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, K, N, K)))
        return NULL;
    if (!CU_BLAS_OK(c, cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, K, M, K))) {
        cublasLtMatrixLayoutDestroy(p->a);
        return NULL;
    }
    if (!CU_BLAS_OK(c, cublasLtMatrixLayoutCreate(&p->cd, CUDA_R_32F, N, M, N))) {
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->a);
        return NULL;
    }
    p->used = true;
    cublasLtMatmulPreference_t pref;
    if (cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS) {
        uint64_t ws = c->lt_ws_bytes;
        uint32_t a32 = aa, b32 = ab, c32 = ac;
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a32, sizeof a32);
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &b32, sizeof b32);
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &c32, sizeof c32);
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &c32, sizeof c32);
        cublasLtMatmulHeuristicResult_t res;
        int nres = 0;
        if (cublasLtMatmulAlgoGetHeuristic(c->lt, c->mm_desc, p->a, p->b, p->cd, p->cd, pref, 1, &res, &nres) ==
                CUBLAS_STATUS_SUCCESS &&
            nres > 0 && res.state == CUBLAS_STATUS_SUCCESS) {
            p->algo = res.algo;
            p->lt_ok = true;
        }
        cublasLtMatmulPreferenceDestroy(pref);
    }
    if (!p->lt_ok)
        CU_LOGD("gemm %dx%dx%d: no cuBLASLt heuristic, using cublasGemmEx", M, N, K);
    return p;
}

static bool gemm_bf16(cu_ctx *c, int M, int N, int K, const float *x, const __nv_bfloat16 *w, float *y,
                      bool accumulate) {
    __nv_bfloat16 *xb = (__nv_bfloat16 *)cu_scratch(c, CU_SCR_GEMM_X, (size_t)M * K * sizeof(__nv_bfloat16));
    if (!xb)
        return false;
    if (!CU_LAUNCHED(c, cu_f32_to_bf16_launch(x, xb, (size_t)M * K, c->stream), "gemm: f32_to_bf16"))
        return false;
    cu_gemm_plan *p = plan_get(c, M, N, K, w, xb, y);
    if (!p)
        return false;
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    if (p->lt_ok)
        return CU_BLAS_OK(c, cublasLtMatmul(c->lt, c->mm_desc, &alpha, w, p->a, xb, p->b, &beta, y, p->cd, y, p->cd,
                                            &p->algo, c->lt_ws, c->lt_ws_bytes, c->stream));
    return CU_BLAS_OK(c, cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, w, CUDA_R_16BF, K, xb,
                                      CUDA_R_16BF, K, &beta, y, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
}

bool cu_gemm_run(cu_ctx *c, int M, const float *x, const pd_weight *w, float *y, bool accumulate) {
    int N = w->rows, K = w->cols;
    if (M == 0 || N == 0)
        return true;
    if (K == 0) {
        if (!accumulate)
            return CU_OK(c, cudaMemsetAsync(y, 0, (size_t)M * N * sizeof(float), c->stream));
        return true;
    }
    if (c->wfmt == PD_CUDA_WEIGHTS_BF16)
        return gemm_bf16(c, M, N, K, x, (const __nv_bfloat16 *)w->data, y, accumulate);
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    return CU_BLAS_OK(c, cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, (const float *)w->data, K, x,
                                     K, &beta, y, N));
}

void cu_gemm(pd_backend *be, int M, const float *x, const pd_weight *w, float *y, bool accumulate) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK)
        return;
    if (M < 0 || !w || w->rows < 0 || w->cols < 0 || (M > 0 && w->rows > 0 && (!x || !y || !w->data))) {
        cu_fail(c, PD_ERR_INVALID, "gemm: M %d, weight %p [%d, %d], x %p, y %p", M, (const void *)w, w ? w->rows : -1,
                w ? w->cols : -1, (const void *)x, (const void *)y);
        return;
    }
    cu_gemm_run(c, M, x, w, y, accumulate);
}

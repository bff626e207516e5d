/* Dense GEMM y[M×N] (+)= x[M×K] · W[N×K]^T, fp32 activations in and out
 * (the experts' cuBLASLt GEMMs of moe.cu may also write bf16).
 *
 * In column-major terms (cuBLAS's) this is yᵀ[N×M] = W(op T of a K×N
 * column-major matrix, lda K) · xᵀ (K×M, ldb K), ldc N: the "TN" layout
 * cuBLASLt is fastest at.
 *   bf16 weights: x is rounded to bf16 into scratch, then cuBLASLt bf16 ×
 *   bf16 → fp32 with fp32 accumulation (CUBLAS_COMPUTE_32F); the heuristic's
 *   choice is cached per (M bucket, N, K, pointer alignments): M is rounded
 *   up to a bucket (plan_bucket) for the heuristic and the layouts take the
 *   call's own M, so the prefill's per-expert GEMMs, whose row counts differ
 *   at every layer, reuse a few plans instead of asking the heuristic
 *   (tens of µs of host time each) for every call and evicting the dense
 *   GEMMs' plans. An algorithm the heuristic chose for more rows runs fewer
 *   (its tiles and split need no more workspace); should cuBLASLt refuse it
 *   all the same, that call and the plan's later ones take cublasGemmEx.
 *   When the heuristic offers nothing, cublasGemmEx with the same types.
 *   fp32 weights: cublasSgemm, CUBLAS_DEFAULT_MATH (no TF32).
 *
 * The bf16 copy of x is kept for the next GEMM (cu_ctx.x16, scratch
 * CU_SCR_GEMM_X): a table gemm / gemm_swiglu whose x is the same pointer
 * and element count as the last copy's source reads the copy instead of
 * rounding x again (the model's q and kv_a projections of one normed h),
 * and gemm_swiglu leaves the bf16 act it computes there for the down
 * projection; rmsnorm_gemm_pair, when it takes the separate ops, makes the
 * copy of the h it wrote for its first GEMM and reads it in the second
 * (it enters through backend_cuda.cu's wrapper, so it starts with none held).
 * The copy stays valid only while nothing can have written its
 * source, so it is forgotten
 *   - at the entry of every other operation of the table (backend_cuda.cu
 *     wraps each of them: the one choke point, whatever an op writes),
 *     and at graph_begin, graph_end and graph_launch;
 *   - when a GEMM's output (y; gu and act of gemm_swiglu) overlaps the
 *     source range, whichever path (skinny kernel, cuBLASLt, cublasSgemm);
 *   - when the scratch is taken for another copy (x16_claim), including
 *     the GEMMs other files run inside their ops (cu_gemm_run), which
 *     never record or reuse a copy.
 * Memory written behind the table's back (kernels of one's own on
 * pd_backend_cuda_stream, cudaMemcpy) between two GEMMs on it is not seen:
 * call any table operation in between.
 */
#include "gemv.cuh"
#include <type_traits>

#include <cuda_pipeline.h>
#include <stdlib.h>
#include <string.h>

#define CU_MAX_PLANS 256

struct cu_gemm_plan {
    int M, N, K;
    cudaDataType_t yt; /* the output's type: CUDA_R_32F or CUDA_R_16BF */
    unsigned al_a, al_b, al_c;
    cublasLtMatrixLayout_t a, b, cd;
    cublasLtMatmulAlgo_t algo;
    int cur_m;  /* the rows the layouts b and cd hold now (the last call's M) */
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

static cu_gemm_plan *plan_find(cu_ctx *c, int M, int N, int K, cudaDataType_t yt, unsigned aa, unsigned ab,
                               unsigned ac);

/* The rows a plan is made for: M itself up to 64 (cuBLASLt's small-M
 * kernels depend on it), then multiples of 64 to 1024, of 256 to 8192, of
 * 2048 beyond; exact with PD_CUDA_GEMM_PLANS=exact (A/B runs). */
static int plan_bucket(const cu_ctx *c, int M) {
    if (c->gemm_exact_plans || M <= 64)
        return M;
    int q = M <= 1024 ? 64 : M <= 8192 ? 256 : 2048;
    long b = ((long)M + q - 1) / q * q;
    return b > 0x7fffffffL ? M : (int)b;
}

/* The cached plan for this shape's bucket, output type and alignments,
 * made on first use, its layouts set to M rows. */
static cu_gemm_plan *plan_get(cu_ctx *c, int M, int N, int K, cudaDataType_t yt, const void *w, const void *xb,
                              const void *y) {
    unsigned aa = ptr_align(w), ab = ptr_align(xb), ac = ptr_align(y);
    cu_gemm_plan *p = plan_find(c, plan_bucket(c, M), N, K, yt, aa, ab, ac);
    if (p && p->cur_m != M) {
        uint64_t m64 = (uint64_t)M;
        if (!CU_BLAS_OK(c, cublasLtMatrixLayoutSetAttribute(p->b, CUBLASLT_MATRIX_LAYOUT_COLS, &m64, sizeof m64)) ||
            !CU_BLAS_OK(c, cublasLtMatrixLayoutSetAttribute(p->cd, CUBLASLT_MATRIX_LAYOUT_COLS, &m64, sizeof m64)))
            return NULL;
        p->cur_m = M;
    }
    return p;
}

/* The plan for exactly (M, N, K, output type, alignments), the heuristic
 * asked on first use. One matmul desc (c->mm_desc: fp32 compute and scale)
 * serves both output types; the C/D layout carries the type. */
static cu_gemm_plan *plan_find(cu_ctx *c, int M, int N, int K, cudaDataType_t yt, unsigned aa, unsigned ab,
                               unsigned ac) {
    if (!c->plans && !(c->plans = (cu_gemm_plan *)calloc(CU_MAX_PLANS, sizeof(cu_gemm_plan)))) {
        cu_fail(c, PD_ERR_NOMEM, "gemm: out of memory for plans");
        return NULL;
    }
    for (int i = 0; i < c->n_plans; i++) {
        cu_gemm_plan *p = &c->plans[i];
        if (p->used && p->M == M && p->N == N && p->K == K && p->yt == yt && p->al_a == aa && p->al_b == ab &&
            p->al_c == ac)
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
    p->M = M, p->N = N, p->K = K, p->yt = yt, p->al_a = aa, p->al_b = ab, p->al_c = ac, p->cur_m = M;
    if (!CU_BLAS_OK(c, cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, K, N, K)))
        return NULL;
    if (!CU_BLAS_OK(c, cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, K, M, K))) {
        cublasLtMatrixLayoutDestroy(p->a);
        return NULL;
    }
    if (!CU_BLAS_OK(c, cublasLtMatrixLayoutCreate(&p->cd, yt, N, M, N))) {
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
        CU_LOGD("gemm %dx%dx%d (%s out): no cuBLASLt heuristic, using cublasGemmEx", M, N, K,
                yt == CUDA_R_16BF ? "bf16" : "fp32");
    return p;
}

/* y (+)= xb · W^T, y of type yt (CUDA_R_32F or CUDA_R_16BF), fp32 accumulation. */
static bool gemm_lt(cu_ctx *c, int M, int N, int K, const __nv_bfloat16 *xb, const __nv_bfloat16 *w, void *y,
                    cudaDataType_t yt, bool accumulate) {
    if (M == 0 || N == 0)
        return true;
    cu_gemm_plan *p = plan_get(c, M, N, K, yt, w, xb, y);
    if (!p)
        return false;
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    if (p->lt_ok) {
        cublasStatus_t st = cublasLtMatmul(c->lt, c->mm_desc, &alpha, w, p->a, xb, p->b, &beta, y, p->cd, y, p->cd,
                                           &p->algo, c->lt_ws, c->lt_ws_bytes, c->stream);
        if (st == CUBLAS_STATUS_SUCCESS)
            return true;
        if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)
            return CU_BLAS_OK(c, st);
        CU_LOGD("gemm %dx%dx%d: cuBLASLt refused the plan of %d rows (%s), using cublasGemmEx", M, N, K, p->M,
                cublasGetStatusString(st));
        p->lt_ok = false;
    }
    return CU_BLAS_OK(c, cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, w, CUDA_R_16BF, K, xb,
                                      CUDA_R_16BF, K, &beta, y, yt, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

bool cu_gemm_bf16_run(cu_ctx *c, int M, int N, int K, const __nv_bfloat16 *xb, const __nv_bfloat16 *w, float *y,
                      bool accumulate) {
    return gemm_lt(c, M, N, K, xb, w, y, CUDA_R_32F, accumulate);
}

bool cu_gemm_bf16_run_y16(cu_ctx *c, int M, int N, int K, const __nv_bfloat16 *xb, const __nv_bfloat16 *w,
                          __nv_bfloat16 *y) {
    return gemm_lt(c, M, N, K, xb, w, y, CUDA_R_16BF, false);
}

/* ---- the bf16 copy of the last GEMM input (the rule: top of the file) ---- */

void cu_x16_forget(cu_ctx *c) {
    c->x16.src = NULL;
    c->x16.n = 0;
}

/* Forgets the copy when [p, p + bytes) overlaps its source. */
static void x16_clobbered(cu_ctx *c, const void *p, size_t bytes) {
    if (!c->x16.src || !p || !bytes)
        return;
    const uintptr_t a0 = (uintptr_t)p, a1 = a0 + bytes;
    const uintptr_t s0 = (uintptr_t)c->x16.src, s1 = s0 + c->x16.n * sizeof(float);
    if (a0 < s1 && s0 < a1)
        cu_x16_forget(c);
}

/* The copy's scratch for n new values (the old copy forgotten); NULL (error recorded) on failure. */
static __nv_bfloat16 *x16_claim(cu_ctx *c, size_t n) {
    cu_x16_forget(c);
    return (__nv_bfloat16 *)cu_scratch(c, CU_SCR_GEMM_X, n * sizeof(__nv_bfloat16));
}

/* The copy of x [n], when it is the one held. */
static const __nv_bfloat16 *x16_find(const cu_ctx *c, const float *x, size_t n) {
    return c->x16.src == x && c->x16.n == n ? (const __nv_bfloat16 *)c->scr[CU_SCR_GEMM_X].p : NULL;
}

/* bf16 weights: x rounded to bf16 (or the copy held, when reuse), then
 * cuBLASLt; with reuse the rounding made is recorded as the copy. */
static bool gemm_bf16(cu_ctx *c, int M, int N, int K, const float *x, const __nv_bfloat16 *w, float *y,
                      bool accumulate, bool reuse) {
    const size_t n = (size_t)M * K;
    const __nv_bfloat16 *xb = reuse ? x16_find(c, x, n) : NULL;
    if (!xb) {
        __nv_bfloat16 *xw = x16_claim(c, n);
        if (!xw || !CU_LAUNCHED(c, cu_f32_to_bf16_launch(x, xw, n, c->stream), "gemm: f32_to_bf16"))
            return false;
        if (reuse) {
            c->x16.src = x;
            c->x16.n = n;
        }
        xb = xw;
    }
    return gemm_lt(c, M, N, K, xb, w, y, CUDA_R_32F, accumulate);
}

/* ---- skinny GEMM: decode-sized batches ----------------------------------
 *
 * Grouped: for every group g (blockIdx.y; an expert, or the one weight of a
 * dense GEMM) and each of its pairs p in [off[g], off[g+1]) (off NULL: one
 * group of M pairs):
 *   plain:  y[yrow[p], n] (+)= Σ_k W_g[n, k] · x[xrow[p], k]                 n < N
 *   swiglu: y[yrow[p], n]   = silu(Σ_k W_g[n, k] x) · Σ_k W_g[N + n, k] x    n < N
 *           (W_g holds 2N rows: gate rows, then up rows)
 * W_g = w[g] (w NULL: w0), bf16 or fp32, row n at W_g + n · ldw[g] and the
 * SwiGLU's up row n at W_g + (upo[g] + n) · ldw[g] (ldw NULL: K; upo NULL:
 * N), so that a group may be a slice of a larger matrix (the shared
 * experts as experts of inter units: moe.cu); xrow/yrow NULL: p itself.
 * x fp32 (row stride ldx), y fp32 (row stride ldy), fp32 accumulation.
 *
 * At M = 1 a GEMM reads each weight once and does 2 FLOP per 2 bytes: the
 * weight stream is everything. A warp owns GV_ROWS output rows; each lane
 * reads 16 bytes (8 weights) of each row per step, so a warp reads 512
 * contiguous bytes of a row per step, and its several rows' loads are in
 * flight together; x (a few KB, shared by every block) comes through L1.
 * Pairs go MT (GV_MT, or 1 where no group has more than one pair: batch 1,
 * fewer registers) at a time, so a weight row is read once per MT tokens
 * (from L2 after the first). Needs K % 8 == 0 and 16-byte aligned rows of
 * W and x (cu_gemv_ok). */
template <bool SWIGLU, typename WT, int GV_ROWS, int MT>
static __global__ void __launch_bounds__(GV_WARPS * 32)
    k_gemv(int N, int K, const WT *__restrict__ w0, const void *const *__restrict__ w, const int *__restrict__ off,
           const int *__restrict__ glist, const int *__restrict__ gldw, const int *__restrict__ gupo, int M,
           const int *__restrict__ xrow, const int *__restrict__ yrow, const float *__restrict__ x, int ldx,
           float *__restrict__ y, int ldy, int accumulate) {
    /* glist: the groups that have rows, in order, then -1s (grid.y is its
     * length); without it blockIdx.y is the group */
    cu_pdl_launch_dependents();
    {
        /* one weight matrix (no table): its rows can stream into L2 before
         * the activations exist */
        const int n_0 = (blockIdx.x * GV_WARPS + (threadIdx.x >> 5)) * GV_ROWS;
        if (!w && (threadIdx.x & 31) == 0 && n_0 < N) {
            const unsigned bytes = (unsigned)(min(GV_ROWS, N - n_0) * (size_t)K * sizeof(WT));
            cu_prefetch_l2(w0 + (size_t)n_0 * K, bytes);
            if (SWIGLU)
                cu_prefetch_l2(w0 + ((size_t)N + n_0) * K, bytes);
        }
    }
    cu_pdl_wait();
    const int g = glist ? glist[blockIdx.y] : (int)blockIdx.y;
    if (g < 0)
        return;
    const int p0 = off ? off[g] : 0, p1 = off ? off[g + 1] : M;
    if (p0 >= p1)
        return;
    const WT *W = w ? (const WT *)w[g] : w0;
    const size_t ldw = gldw ? (size_t)gldw[g] : (size_t)K, upo = gupo ? (size_t)gupo[g] : (size_t)N;
    gemv_block<SWIGLU, WT, GV_ROWS, MT>((int)blockIdx.x, W, ldw, upo, N, K, p0, p1, xrow, yrow, x, ldx, y, ldy,
                                        accumulate);
}

/* k_gemv for M <= MT rows of one weight, bf16, the block's rows held in
 * registers (gemv_pre: loaded before cu_pdl_wait, so that under PDL they
 * arrive while the kernel before runs, instead of being prefetched into L2
 * and read again after it). x [M, K], y [M, N]. Same sums as k_gemv. */
template <int GV_ROWS, int KC, int MT>
static __global__ void __launch_bounds__(GV_WARPS * 32)
    k_gemv_pre(int N, int K, int M, const __nv_bfloat16 *__restrict__ w0, const float *__restrict__ x,
               float *__restrict__ y, int accumulate) {
    gemv_pre<__nv_bfloat16, GV_ROWS, KC> p;
    p.load((int)blockIdx.x, w0, (size_t)K, N, K);
    cu_pdl_wait();
    cu_pdl_launch_dependents(); /* after the wait: the next kernel's early blocks do not wait beside ours */
    p.template run<false, MT>(N, K, M, x, K, y, N, accumulate);
}

/* Batch-1 GEMV of one large weight (the LM head, a dense MLP's gate_up and
 * down): y[n] (+)= W[n] · x, or with SWIGLU y[n] = silu(W[n] · x) · (W[N +
 * n] · x). A warp owns one output row (and its up row) over a 1/SPLIT
 * slice of K; each lane issues GV1_U 16-byte loads of each row before it
 * uses any, so that a warp has GV1_U · 512 bytes of a row in flight
 * (gemv_block's loop of 2 rows a warp kept ~1.1 TB/s of a dense down
 * projection's K = 10944 in flight on 128 blocks, and the LM head's 6400
 * blocks ran at ~2.8 TB/s: session 13's timeline). The SPLIT warps of a
 * row add their sums in shared memory in slice order. x fp32 [K], y fp32
 * [N]; W bf16 or fp32 [N or 2N, K]; needs cu_gemv_ok. */
#define GV1_U 8
template <typename WT, bool SWIGLU, int SPLIT>
static __global__ void __launch_bounds__(GV_WARPS * 32)
    k_gemv1(int N, int K, const WT *__restrict__ W, const float *__restrict__ x, float *__restrict__ y, int accumulate) {
    constexpr int RPB = GV_WARPS / SPLIT; /* output rows a block */
    __shared__ float part[GV_WARPS][2];
    cu_pdl_launch_dependents();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = (int)blockIdx.x * RPB + warp / SPLIT, s = warp % SPLIT;
    const int K8 = K / 8, per = (K8 + SPLIT - 1) / SPLIT, k0 = s * per, k1 = min(K8, k0 + per);
    const bool live = n < N && k0 < k1;
    const WT *wg = W + (size_t)(n < N ? n : 0) * K, *wu = W + (size_t)(n < N ? N + n : 0) * K;
    if (live && lane == 0) { /* the weights depend on nothing earlier: into L2 while the kernel before runs */
        cu_prefetch_l2(wg + (size_t)k0 * 8, (unsigned)((size_t)(k1 - k0) * 8 * sizeof(WT)));
        if (SWIGLU)
            cu_prefetch_l2(wu + (size_t)k0 * 8, (unsigned)((size_t)(k1 - k0) * 8 * sizeof(WT)));
    }
    cu_pdl_wait();
    float ag = 0.0f, au = 0.0f;
    if (live)
        for (int kb = k0 + lane; kb < k1; kb += 32 * GV1_U) {
            gv_w8<WT> g[GV1_U], u[SWIGLU ? GV1_U : 1];
#pragma unroll
            for (int i = 0; i < GV1_U; i++)
                if (kb + 32 * i < k1) {
                    g[i].load(wg, kb + 32 * i);
                    if constexpr (SWIGLU)
                        u[i].load(wu, kb + 32 * i);
                }
#pragma unroll
            for (int i = 0; i < GV1_U; i++) {
                const int k8 = kb + 32 * i;
                if (k8 < k1) {
                    const float4 a = __ldg((const float4 *)x + 2 * k8), b = __ldg((const float4 *)x + 2 * k8 + 1);
                    ag += g[i].dot(a, b);
                    if constexpr (SWIGLU)
                        au += u[SWIGLU ? i : 0].dot(a, b);
                }
            }
        }
    ag = cu_warp_sum(ag);
    if (SWIGLU)
        au = cu_warp_sum(au);
    if (SPLIT > 1) {
        if (lane == 0) {
            part[warp][0] = ag;
            part[warp][1] = au;
        }
        __syncthreads();
        if (s == 0 && lane == 0) {
            ag = au = 0.0f;
#pragma unroll
            for (int i = 0; i < SPLIT; i++) {
                ag += part[warp + i][0];
                au += part[warp + i][1];
            }
        }
    }
    if (n < N && s == 0 && lane == 0) {
        if (SWIGLU)
            y[n] = ag / (1.0f + expf(-ag)) * au;
        else
            y[n] = accumulate ? y[n] + ag : ag;
    }
}

/* k_gemv1 applies (PD_GEMV1=0: off, A/B runs): one row, one weight of at
 * least GV1_MIN weights. */
#define GV1_MIN ((size_t)16 << 20)
static bool gemv1_on(void) {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("PD_GEMV1");
        on = !(e && !strcmp(e, "0"));
    }
    return on;
}

template <typename WT, bool SWIGLU, int SPLIT>
static cudaError_t gemv1_launch_t(bool pdl, cudaStream_t s, int N, int K, const void *w, const float *x, float *y,
                                  int acc) {
    constexpr int RPB = GV_WARPS / SPLIT;
    cudaLaunchAttribute at;
    cudaLaunchConfig_t cfg =
        cu_launch_config(dim3((unsigned)((N + RPB - 1) / RPB)), dim3(GV_WARPS * 32), 0, s, pdl, &at);
    return cudaLaunchKernelEx(&cfg, k_gemv1<WT, SWIGLU, SPLIT>, N, K, (const WT *)w, x, y, acc);
}

/* SPLIT: doubled while the warps (N · SPLIT) are fewer than two full
 * blocks a SM and each slice keeps at least 256 16-byte pieces of a row
 * (V2-Lite's dense down, N 2048 × K 10944: split 2, 20.9 µs; 4, 22.9-24.8;
 * 1, 28.4: session 13's timelines). */
template <typename WT, bool SWIGLU>
static cudaError_t gemv1_launch_w(const cu_ctx *c, int N, int K, const void *w, const float *x, float *y, int acc) {
    int split = 1;
    while (split < 8 && (size_t)N * split < (size_t)2 * GV_WARPS * c->n_sm && K / 8 / (2 * split) >= 256)
        split *= 2;
    static int forced = -1; /* PD_GEMV1_SPLIT=1|2|4|8: this split for every k_gemv1 (A/B runs) */
    if (forced < 0) {
        const char *e = getenv("PD_GEMV1_SPLIT");
        forced = e ? atoi(e) : 0;
    }
    if (forced == 1 || forced == 2 || forced == 4 || forced == 8)
        split = forced;
    switch (split) {
    case 1:
        return gemv1_launch_t<WT, SWIGLU, 1>(c->pdl, c->stream, N, K, w, x, y, acc);
    case 2:
        return gemv1_launch_t<WT, SWIGLU, 2>(c->pdl, c->stream, N, K, w, x, y, acc);
    case 4:
        return gemv1_launch_t<WT, SWIGLU, 4>(c->pdl, c->stream, N, K, w, x, y, acc);
    default:
        return gemv1_launch_t<WT, SWIGLU, 8>(c->pdl, c->stream, N, K, w, x, y, acc);
    }
}

/* Launches k_gemv1 where it applies (true; the launch's error recorded in c). */
static bool gemv1_try(cu_ctx *c, bool swiglu, int M, int N, int K, const void *w, const float *x, float *y, bool acc) {
    if (M != 1 || c->no_gemv || !gemv1_on() || !cu_gemv_ok(K, w, x, K) ||
        (size_t)N * K * (swiglu ? 2 : 1) < GV1_MIN)
        return false;
    cudaError_t e;
    if (c->wfmt == PD_CUDA_WEIGHTS_BF16)
        e = swiglu ? gemv1_launch_w<__nv_bfloat16, true>(c, N, K, w, x, y, 0)
                   : gemv1_launch_w<__nv_bfloat16, false>(c, N, K, w, x, y, acc ? 1 : 0);
    else
        e = swiglu ? gemv1_launch_w<float, true>(c, N, K, w, x, y, 0)
                   : gemv1_launch_w<float, false>(c, N, K, w, x, y, acc ? 1 : 0);
    CU_LAUNCHED(c, e, swiglu ? "gemm_swiglu (one row)" : "gemv (one row)");
    return true;
}

/* The weights-in-registers path applies: bf16, K <= 2048, every block resident
 * at once (two a SM); PD_GEMV_PRE=0 turns it off (A/B runs). */
#define GV_PRE_KC 8
static bool gemv_pre_fits(const cu_ctx *c, int M, int N, int K, int blocks) {
    return c->wfmt == PD_CUDA_WEIGHTS_BF16 && M >= 1 && M <= GV_MT && K % 8 == 0 && K <= 256 * GV_PRE_KC && N > 0 &&
           blocks <= 2 * c->n_sm && !c->gemv_pre_off;
}

bool cu_gemv_ok(int K, const void *w, const float *x, int ldx) {
    return K > 0 && K % 8 == 0 && ldx % 4 == 0 && ((uintptr_t)w & 15) == 0 && ((uintptr_t)x & 15) == 0;
}

template <bool SWIGLU, typename WT, int GV_ROWS, int MT>
static cudaError_t gemv_launch_t(bool pdl, cudaStream_t s, int n_groups, int N, int K, const WT *w0,
                                 const void *const *w, const int *off, const int *glist, const int *gldw,
                                 const int *gupo, int M, const int *xrow, const int *yrow, const float *x, int ldx,
                                 float *y, int ldy, int acc) {
    dim3 grid((unsigned)((N + GV_WARPS * GV_ROWS - 1) / (GV_WARPS * GV_ROWS)), (unsigned)n_groups);
    cudaLaunchAttribute at;
    cudaLaunchConfig_t cfg = cu_launch_config(grid, dim3(GV_WARPS * 32), 0, s, pdl, &at);
    return cudaLaunchKernelEx(&cfg, k_gemv<SWIGLU, WT, GV_ROWS, MT>, N, K, w0, w, off, glist, gldw, gupo, M, xrow,
                              yrow, x, ldx, y, ldy, acc);
}

/* Output rows a warp owns (PD_GEMV_ROWS = 1, 2 or 4; default 2): fewer
 * give more blocks over the SMs, more give each lane more loads in flight. */
static int gemv_rows(void) {
    static int rows;
    if (!rows) {
        const char *e = getenv("PD_GEMV_ROWS");
        int r = e ? atoi(e) : 2;
        rows = r == 1 || r == 4 ? r : 2;
    }
    return rows;
}

template <bool SWIGLU, typename WT, int MT>
static cudaError_t gemv_launch_m(bool pdl, cudaStream_t s, int n_groups, int N, int K, const WT *w0,
                                 const void *const *w, const int *off, const int *glist, const int *gldw,
                                 const int *gupo, int M, const int *xrow, const int *yrow, const float *x, int ldx,
                                 float *y, int ldy, int acc) {
    switch (gemv_rows()) {
    case 1:
        return gemv_launch_t<SWIGLU, WT, 1, MT>(pdl, s, n_groups, N, K, w0, w, off, glist, gldw, gupo, M, xrow, yrow,
                                                x, ldx, y, ldy, acc);
    case 4:
        return gemv_launch_t<SWIGLU, WT, 4, MT>(pdl, s, n_groups, N, K, w0, w, off, glist, gldw, gupo, M, xrow, yrow,
                                                x, ldx, y, ldy, acc);
    default:
        return gemv_launch_t<SWIGLU, WT, 2, MT>(pdl, s, n_groups, N, K, w0, w, off, glist, gldw, gupo, M, xrow, yrow,
                                                x, ldx, y, ldy, acc);
    }
}

/* PD_GEMV_MT1=0: batch-1 GEMVs through the kernel sized for GV_MT pairs (A/B runs). */
static bool gemv_mt1(void) {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("PD_GEMV_MT1");
        on = !(e && !strcmp(e, "0"));
    }
    return on;
}

/* max_pairs: the most pairs a group can have (M without off; with off the caller's bound) */
template <bool SWIGLU, typename WT>
static cudaError_t gemv_launch_r(bool pdl, cudaStream_t s, int n_groups, int N, int K, const WT *w0,
                                 const void *const *w, const int *off, const int *glist, const int *gldw,
                                 const int *gupo, int M, int max_pairs, const int *xrow, const int *yrow,
                                 const float *x, int ldx, float *y, int ldy, int acc) {
    if (max_pairs == 1 && gemv_mt1())
        return gemv_launch_m<SWIGLU, WT, 1>(pdl, s, n_groups, N, K, w0, w, off, glist, gldw, gupo, M, xrow, yrow, x,
                                            ldx, y, ldy, acc);
    return gemv_launch_m<SWIGLU, WT, GV_MT>(pdl, s, n_groups, N, K, w0, w, off, glist, gldw, gupo, M, xrow, yrow, x,
                                            ldx, y, ldy, acc);
}

cudaError_t cu_gemv_grouped_launch(pd_cuda_weights fmt, bool swiglu, int n_groups, int N, int K, const void *w0,
                                   const void *const *w, const int *off, const int *glist, const int *gldw,
                                   const int *gupo, int M, int max_pairs, const int *xrow, const int *yrow,
                                   const float *x, int ldx, float *y, int ldy, bool accumulate, bool pdl,
                                   cudaStream_t s) {
    const int acc = accumulate && !swiglu ? 1 : 0;
    if (!off)
        max_pairs = M;
    if (fmt == PD_CUDA_WEIGHTS_BF16)
        return swiglu ? gemv_launch_r<true>(pdl, s, n_groups, N, K, (const __nv_bfloat16 *)w0, w, off, glist, gldw,
                                            gupo, M, max_pairs, xrow, yrow, x, ldx, y, ldy, 0)
                      : gemv_launch_r<false>(pdl, s, n_groups, N, K, (const __nv_bfloat16 *)w0, w, off, glist, gldw,
                                             gupo, M, max_pairs, xrow, yrow, x, ldx, y, ldy, acc);
    return swiglu ? gemv_launch_r<true>(pdl, s, n_groups, N, K, (const float *)w0, w, off, glist, gldw, gupo, M,
                                        max_pairs, xrow, yrow, x, ldx, y, ldy, 0)
                  : gemv_launch_r<false>(pdl, s, n_groups, N, K, (const float *)w0, w, off, glist, gldw, gupo, M,
                                         max_pairs, xrow, yrow, x, ldx, y, ldy, acc);
}

cudaError_t cu_gemv_launch(pd_cuda_weights fmt, bool swiglu, int n_groups, int N, int K, const void *w0,
                           const void *const *w, const int *off, const int *glist, int M, const int *xrow,
                           const int *yrow, const float *x, int ldx, float *y, int ldy, bool accumulate, bool pdl,
                           cudaStream_t s) {
    return cu_gemv_grouped_launch(fmt, swiglu, n_groups, N, K, w0, w, off, glist, NULL, NULL, M, 0, xrow, yrow, x,
                                  ldx, y, ldy, accumulate, pdl, s);
}

/* GEMMs of at most this many rows go through k_gemv. */
#define GV_MAX_M 4

/* y (+)= x · W^T on c's stream; reuse: a table GEMM, which may read and
 * record the bf16 copy of x (the rule: top of the file). */
static bool gemm_run(cu_ctx *c, int M, const float *x, const pd_weight *w, float *y, bool accumulate, bool reuse) {
    int N = w->rows, K = w->cols;
    if (M == 0 || N == 0)
        return true;
    x16_clobbered(c, y, (size_t)M * N * sizeof(float));
    if (K == 0) {
        if (!accumulate)
            return CU_OK(c, cudaMemsetAsync(y, 0, (size_t)M * N * sizeof(float), c->stream));
        return true;
    }
    const int pre_blocks = (N + GV_WARPS * 2 - 1) / (GV_WARPS * 2);
    if (!c->no_gemv && cu_gemv_ok(K, w->data, x, K) && gemv_pre_fits(c, M, N, K, pre_blocks)) {
        cudaLaunchAttribute at;
        cudaLaunchConfig_t cfg =
            cu_launch_config(dim3((unsigned)pre_blocks), dim3(GV_WARPS * 32), 0, c->stream, c->pdl, &at);
        const __nv_bfloat16 *wb = (const __nv_bfloat16 *)w->data;
        const int acc = accumulate ? 1 : 0;
        return CU_LAUNCHED(c,
                           M == 1 ? cudaLaunchKernelEx(&cfg, k_gemv_pre<2, GV_PRE_KC, 1>, N, K, M, wb, x, y, acc)
                                  : cudaLaunchKernelEx(&cfg, k_gemv_pre<2, GV_PRE_KC, GV_MT>, N, K, M, wb, x, y, acc),
                           "gemv (weights in registers)");
    }
    if (gemv1_try(c, false, M, N, K, w->data, x, y, accumulate))
        return c->status == PD_OK;
    if (M <= GV_MAX_M && !c->no_gemv && cu_gemv_ok(K, w->data, x, K))
        return CU_LAUNCHED(c,
                           cu_gemv_launch(c->wfmt, false, 1, N, K, w->data, NULL, NULL, NULL, M, NULL, NULL, x, K, y, N,
                                          accumulate, c->pdl, c->stream),
                           "gemv");
    if (c->wfmt == PD_CUDA_WEIGHTS_BF16)
        return gemm_bf16(c, M, N, K, x, (const __nv_bfloat16 *)w->data, y, accumulate, reuse);
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    return CU_BLAS_OK(c, cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, (const float *)w->data, K, x,
                                     K, &beta, y, N));
}

bool cu_gemm_run(cu_ctx *c, int M, const float *x, const pd_weight *w, float *y, bool accumulate) {
    return gemm_run(c, M, x, w, y, accumulate, false);
}

void cu_gemm_swiglu(pd_backend *be, int M, const float *x, const pd_weight *w, float *gu, float *act) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || M == 0)
        return;
    if (M < 0 || !w || w->rows <= 0 || w->rows % 2 || w->cols <= 0 || !x || !gu || !act || !w->data) {
        cu_fail(c, PD_ERR_INVALID, "gemm_swiglu: M %d, weight [%d, %d]", M, w ? w->rows : -1, w ? w->cols : -1);
        return;
    }
    const int I = w->rows / 2, K = w->cols;
    x16_clobbered(c, gu, (size_t)M * 2 * I * sizeof(float));
    x16_clobbered(c, act, (size_t)M * I * sizeof(float));
    if (gemv1_try(c, true, M, I, K, w->data, x, act, false))
        return;
    if (M <= GV_MAX_M && !c->no_gemv && cu_gemv_ok(K, w->data, x, K)) { /* the skinny GEMM's SwiGLU epilogue */
        CU_LAUNCHED(c,
                    cu_gemv_launch(c->wfmt, true, 1, I, K, w->data, NULL, NULL, NULL, M, NULL, NULL, x, K, act, I,
                                   false, c->pdl, c->stream),
                    "gemm_swiglu");
        return;
    }
    if (!gemm_run(c, M, x, w, gu, false, true))
        return;
    if (c->wfmt != PD_CUDA_WEIGHTS_BF16) {
        CU_LAUNCHED(c, cu_silu_mul_launch(M, I, gu, act, c->stream), "gemm_swiglu: silu_mul");
        return;
    }
    /* bf16 weights: SwiGLU also leaves act rounded to bf16 as the copy the
     * down projection (x == act) reads instead of rounding act itself */
    const size_t n = (size_t)M * I;
    __nv_bfloat16 *a16 = x16_claim(c, n);
    if (a16 && CU_LAUNCHED(c, cu_silu_mul_x16_launch(M, I, gu, act, a16, c->stream), "gemm_swiglu: silu_mul")) {
        c->x16.src = act;
        c->x16.n = n;
    }
}

/* ---- rmsnorm_gemm_pair: a layer's input norm and its two projections ----
 *
 * Decode-sized batches (M <= GV_MAX_M) in one launch: blocks [0, nb1)
 * compute y1 = h · W1^T and blocks [nb1, nb1 + nb2) y2 = h · W2^T, each
 * block as k_gemv's (a warp owns GV_ROWS output rows, 16-byte weight loads,
 * all M <= MT rows of h at once; MT 1 at batch 1, as k_gemv's). Every block
 * first normalises the M rows of x itself in shared memory (x is a few KB
 * that every block reads from L2, far less than the block's share of the
 * weights) with rmsnorm's arithmetic (cu_block_inv_rms: the sum of squares
 * in double; x · inv · norm in fp32), and its dot products read h from
 * there; block 0 also writes h. The same numbers as rmsnorm then two k_gemv
 * launches: the same h, the same order of additions. The weights are
 * prefetched into L2 (KC 0) or, at up to GV_MT rows of bf16 weights, loaded into
 * registers (KC > 0: gemv_pre, the next kernel launching only after the
 * wait), and the norm's weights loaded, all before cu_pdl_wait (weights: no
 * earlier kernel writes them); x is read after it. */
template <typename WT, int GV_ROWS, int MT, int KC>
static __global__ void __launch_bounds__(GV_WARPS * 32)
    k_norm_gemv2(int M, int K, const float *__restrict__ x, const float *__restrict__ norm, float eps,
                 float *__restrict__ h, const WT *__restrict__ w1, int N1, float *__restrict__ y1, int nb1,
                 const WT *__restrict__ w2, int N2, float *__restrict__ y2) {
    constexpr int THREADS = GV_WARPS * 32;
    extern __shared__ float4 hs4[]; /* the normed rows [M × K], then the norm's weights [K] */
    __shared__ double part[MT][GV_WARPS];
    if (!KC)
        cu_pdl_launch_dependents();
    const bool second = (int)blockIdx.x >= nb1;
    const WT *W = second ? w2 : w1;
    const int N = second ? N2 : N1;
    float *y = second ? y2 : y1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bx = (int)blockIdx.x - (second ? nb1 : 0), n0 = (bx * GV_WARPS + warp) * GV_ROWS;
    /* the weights depend on nothing earlier: into registers (KC) or L2
     * while the kernel before runs */
    gemv_pre<WT, GV_ROWS, KC ? KC : 1> pre;
    if constexpr (KC > 0)
        pre.load(bx, W, (size_t)K, N, K);
    else if (lane == 0 && n0 < N)
        cu_prefetch_l2(W + (size_t)n0 * K, (unsigned)(min(GV_ROWS, N - n0) * (size_t)K * sizeof(WT)));
    /* the norm's weights, then (once x exists) the rows of x, into shared
     * memory with every load in flight at once (a thread's global loads one
     * after another cost ~0.5 µs each: moe.cu's k_moe_gate) */
    const int K4 = K / 4;
    float4 *g4 = hs4 + (size_t)M * K4;
    for (int i = threadIdx.x; i < K4; i += THREADS)
        __pipeline_memcpy_async(g4 + i, (const float4 *)norm + i, sizeof(float4));
    cu_pdl_wait();
    if (KC)
        cu_pdl_launch_dependents(); /* after the wait (k_gemv_pre) */
    for (int i = threadIdx.x; i < M * K4; i += THREADS)
        __pipeline_memcpy_async(hs4 + i, (const float4 *)x + i, sizeof(float4));
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
    const float *hs = (const float *)hs4;
    /* M is the same in every thread: every thread reaches the barriers inside */
    float inv[MT];
#pragma unroll
    for (int j = 0; j < MT; j++)
        inv[j] = j < M ? cu_block_inv_rms<THREADS>(hs + (size_t)j * K, K, eps, part[j]) : 0.0f;
    /* the last cu_block_inv_rms ended after a barrier that follows every
     * read of hs: the rows can be rewritten in place */
    float4 *h4 = (float4 *)h;
    for (int i = threadIdx.x; i < M * K4; i += THREADS) {
        const int j = i / K4;
        float r = inv[0];
#pragma unroll
        for (int jj = 1; jj < MT; jj++)
            r = jj == j ? inv[jj] : r;
        const float4 g = g4[i - j * K4];
        float4 v = hs4[i];
        v.x = v.x * r * g.x; /* norm.cu's arithmetic */
        v.y = v.y * r * g.y;
        v.z = v.z * r * g.z;
        v.w = v.w * r * g.w;
        hs4[i] = v;
        if (blockIdx.x == 0)
            h4[i] = v;
    }
    __syncthreads();
    /* y = h · W^T over the M rows, h from shared memory: k_gemv's GEMV */
    if constexpr (KC > 0)
        pre.template run<true, MT>(N, K, M, hs, K, y, N, 0);
    else
        gemv_block<false, WT, GV_ROWS, MT, true>(bx, W, (size_t)K, 0, N, K, 0, M, NULL, NULL, hs, K, y, N, 0);
}

/* Dynamic shared memory of k_norm_gemv2 for M rows of K: the normed rows and the norm's weights. */
static size_t norm_gemv2_smem(int M, int K) {
    return ((size_t)M + 1) * K * sizeof(float);
}

template <typename WT, int GV_ROWS, int MT, int KC = 0>
static cudaError_t norm_gemv2_launch_t(bool pdl, cudaStream_t s, int M, int K, const float *x, const float *norm,
                                       float eps, float *h, const void *w1, int N1, float *y1, const void *w2, int N2,
                                       float *y2) {
    const int per_block = GV_WARPS * GV_ROWS;
    const int nb1 = (N1 + per_block - 1) / per_block, nb2 = (N2 + per_block - 1) / per_block;
    const size_t smem = norm_gemv2_smem(M, K);
    cudaError_t e = CU_SMEM_OPTIN((k_norm_gemv2<WT, GV_ROWS, MT, KC>), smem);
    if (e != cudaSuccess)
        return e;
    cudaLaunchAttribute at;
    cudaLaunchConfig_t cfg = cu_launch_config(dim3((unsigned)(nb1 + nb2)), dim3(GV_WARPS * 32), smem, s, pdl, &at);
    return cudaLaunchKernelEx(&cfg, k_norm_gemv2<WT, GV_ROWS, MT, KC>, M, K, x, norm, eps, h, (const WT *)w1, N1, y1, nb1,
                              (const WT *)w2, N2, y2);
}

template <typename WT, int MT>
static cudaError_t norm_gemv2_launch_m(bool pdl, cudaStream_t s, int M, int K, const float *x, const float *norm,
                                       float eps, float *h, const void *w1, int N1, float *y1, const void *w2, int N2,
                                       float *y2) {
    switch (gemv_rows()) {
    case 1:
        return norm_gemv2_launch_t<WT, 1, MT>(pdl, s, M, K, x, norm, eps, h, w1, N1, y1, w2, N2, y2);
    case 4:
        return norm_gemv2_launch_t<WT, 4, MT>(pdl, s, M, K, x, norm, eps, h, w1, N1, y1, w2, N2, y2);
    default:
        return norm_gemv2_launch_t<WT, 2, MT>(pdl, s, M, K, x, norm, eps, h, w1, N1, y1, w2, N2, y2);
    }
}

/* MT: 1 for one row (fewer registers, as k_gemv at batch 1; PD_GEMV_MT1=0: GV_MT), else GV_MT */
template <typename WT>
static cudaError_t norm_gemv2_launch_r(bool pdl, bool pre, cudaStream_t s, int M, int K, const float *x,
                                       const float *norm, float eps, float *h, const void *w1, int N1, float *y1,
                                       const void *w2, int N2, float *y2) {
    if constexpr (std::is_same<WT, __nv_bfloat16>::value)
        if (pre) /* the weights in registers (gemv_pre_fits) */
            return M == 1 ? norm_gemv2_launch_t<WT, 2, 1, GV_PRE_KC>(pdl, s, M, K, x, norm, eps, h, w1, N1, y1, w2, N2, y2)
                          : norm_gemv2_launch_t<WT, 2, GV_MT, GV_PRE_KC>(pdl, s, M, K, x, norm, eps, h, w1, N1, y1, w2,
                                                                        N2, y2);
    if (M == 1 && gemv_mt1())
        return norm_gemv2_launch_m<WT, 1>(pdl, s, M, K, x, norm, eps, h, w1, N1, y1, w2, N2, y2);
    return norm_gemv2_launch_m<WT, GV_MT>(pdl, s, M, K, x, norm, eps, h, w1, N1, y1, w2, N2, y2);
}

static_assert(GV_MAX_M <= GV_MT, "k_norm_gemv2 takes all its rows in one pass of MT");

/* true when [a, a + an) and [b, b + bn) floats share an address */
static bool ranges_overlap(const float *a, size_t an, const float *b, size_t bn) {
    const uintptr_t a0 = (uintptr_t)a, a1 = a0 + an * sizeof(float);
    const uintptr_t b0 = (uintptr_t)b, b1 = b0 + bn * sizeof(float);
    return a0 < b1 && b0 < a1;
}

/* Entered through backend_cuda.cu's CU_OP wrapper, which forgets the bf16
 * copy of the last GEMM input: the separate path below may then record the
 * copy of h it makes for W1 and read it for W2. */
void cu_rmsnorm_gemm_pair(pd_backend *be, int rows, int dim, const float *x, const float *norm, float eps, float *h,
                          const pd_weight *w1, float *y1, const pd_weight *w2, float *y2) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || rows == 0)
        return;
    if (rows < 0 || dim <= 0 || !x || !norm || !h || !w1 || !w2 || !y1 || !y2 || !w1->data || !w2->data ||
        w1->rows <= 0 || w2->rows <= 0 || w1->cols != dim || w2->cols != dim) {
        cu_fail(c, PD_ERR_INVALID, "rmsnorm_gemm_pair: rows %d, dim %d, weights [%d, %d] and [%d, %d]", rows, dim,
                w1 ? w1->rows : -1, w1 ? w1->cols : -1, w2 ? w2->rows : -1, w2 ? w2->cols : -1);
        return;
    }
    const int N1 = w1->rows, N2 = w2->rows;
    const size_t nx = (size_t)rows * dim, n1 = (size_t)rows * N1, n2 = (size_t)rows * N2;
    if (ranges_overlap(h, nx, x, nx) || ranges_overlap(h, nx, y1, n1) || ranges_overlap(h, nx, y2, n2) ||
        ranges_overlap(y1, n1, x, nx) || ranges_overlap(y2, n2, x, nx) || ranges_overlap(y1, n1, y2, n2)) {
        cu_fail(c, PD_ERR_INVALID, "rmsnorm_gemm_pair: rows %d, dim %d, N1 %d, N2 %d: x, h, y1 and y2 overlap", rows,
                dim, N1, N2);
        return;
    }
    if (rows <= GV_MAX_M && !c->no_gemv && cu_gemv_ok(dim, w1->data, x, dim) && cu_gemv_ok(dim, w2->data, x, dim) &&
        ((uintptr_t)norm & 15) == 0 && ((uintptr_t)h & 15) == 0 &&
        norm_gemv2_smem(rows, dim) + sizeof(double) * GV_MT * GV_WARPS <= c->smem_optin) {
        const int per_block = GV_WARPS * 2;
        const bool pre = gemv_pre_fits(c, rows, N1 + N2, dim,
                                       (N1 + per_block - 1) / per_block + (N2 + per_block - 1) / per_block);
        cudaError_t e = c->wfmt == PD_CUDA_WEIGHTS_BF16
                            ? norm_gemv2_launch_r<__nv_bfloat16>(c->pdl, pre, c->stream, rows, dim, x, norm, eps, h,
                                                                 w1->data, N1, y1, w2->data, N2, y2)
                            : norm_gemv2_launch_r<float>(c->pdl, false, c->stream, rows, dim, x, norm, eps, h,
                                                         w1->data, N1, y1, w2->data, N2, y2);
        CU_LAUNCHED(c, e, "rmsnorm_gemm_pair");
        return;
    }
    /* the separate ops: h's bf16 copy (bf16 weights, cuBLASLt) made once for both */
    cu_rmsnorm(be, rows, dim, x, dim, norm, eps, h, dim);
    if (c->status == PD_OK && gemm_run(c, rows, h, w1, y1, false, true))
        gemm_run(c, rows, h, w2, y2, false, true);
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
    gemm_run(c, M, x, w, y, accumulate, true);
}

/* DeepSeekMoE on the GPU: routing (DeepSeek-V2 §2.2, V3 §2.1.2) and the
 * routed experts.
 *
 * moe_route: one warp per token. V3 noaux_tc: s = sigmoid(logit), choice =
 * s + bias, group score = sum of the group's top-2 choices, keep topk_group
 * groups, top_k experts by choice, weights = unbiased s (normalised when
 * norm_topk_prob) × routed_scaling_factor. V2: s = softmax(logit), greedy or
 * group-limited (group score = max s). Ties go to the lower index, exactly as
 * the CPU backend's topk_idx. ids/weights are returned in host memory.
 *
 * moe_experts: the routed (token, expert) pairs are sorted by expert on the
 * host (ids and weights are host memory), the tokens' rows gathered into one
 * buffer in that order, then per expert two GEMMs over its contiguous slice
 * (gate_up, then down after one silu_mul over all rows), and one combine
 * kernel adds each token's weighted expert outputs to out in expert order,
 * the CPU backend's order, without atomics. */
#include "gemv.cuh"

#include <cuda_pipeline.h>
#include <type_traits>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a diagnostic: per-block timestamps of the one-row MoE kernels ------
 *
 * Built only with -DPD_CUDA_PROBE (cmake -DPD_CUDA_PROBE=ON;
 * PD_CUDA_PROBE=1 sh tests/gpu/build.sh); without it the macros are empty
 * and the kernels are main's. With it and PD_MOE_PROBE=path in the
 * environment, thread 0 of every block of k_oproj_route (kernel 0),
 * k_moe_gate_up1 (1), k_moe_down1 or k_moe_down1c (2) and the combine (3)
 * writes %globaltimer (ns) at its points: 0 start, 1 past its wait, then
 * gate_up 2 normed, 3 GEMV starts, 4 end; the others 2 end (k_moe_down1c's
 * routed blocks also 3, warp 0's GEMV end). Each launch
 * overwrites the last, so the file (written when the backend is freed)
 * holds the last MoE layer of the last step; tests/gpu/probe_summary.py
 * reads it. The points cost registers: as they are, the gate_up and the
 * down keep main's (80 and 78), k_moe_down1c goes from 78 to 80 (four of
 * its blocks a SM either way) and k_oproj_route from 86 to 100 (two
 * blocks a SM either way); a longer set in session 15 took the gate_up to
 * 91, two blocks a SM instead of three, and the whole MoE block into two
 * waves. Check nvcc --resource-usage after adding any. The timings are for
 * reading phases, not for comparing with main's step. */
#ifdef PD_CUDA_PROBE
#define MOE_PROBE_BLOCKS 2048
#define MOE_PROBE_SLOTS 5
__device__ unsigned long long moe_probe_t[4][MOE_PROBE_BLOCKS][MOE_PROBE_SLOTS];
__device__ int moe_probe_on;
__device__ __forceinline__ void moe_probe(int k, int b, int slot) {
    if (moe_probe_on && threadIdx.x == 0 && b < MOE_PROBE_BLOCKS) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        moe_probe_t[k][b][slot] = t;
    }
}
#define MOE_PROBE(k, b, slot) moe_probe(k, b, slot)
#define MOE_PROBE_SYNC(k, b, slot) (__syncthreads(), moe_probe(k, b, slot))
#else
#define MOE_PROBE(k, b, slot) ((void)0)
#define MOE_PROBE_SYNC(k, b, slot) ((void)0)
#endif

#define ROUTE_MAX_EXPERTS 4096
#define ROUTE_MAX_GROUPS 1024
#define MOE_MAX_EXPERT_ID 65535

/* Indices of the k largest of v[0..n) into out, largest first, ties to the
 * lower index (the CPU backend's topk_idx). Serial: for short lists. */
__device__ static void topk_serial(const float *v, int n, int k, int *out) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            bool taken = false;
            for (int m = 0; m < j; m++)
                if (out[m] == e) {
                    taken = true;
                    break;
                }
            if (taken)
                continue;
            if (best < 0 || v[e] > v[best])
                best = e;
        }
        out[j] = best;
    }
}

/* Warp-wide argmax over v[0..n) skipping taken[]: the largest value, the
 * lowest index among equals (what the CPU's first-strictly-greater scan keeps). */
__device__ static int warp_argmax(const float *v, const int *taken, int n, int lane) {
    int bi = -1;
    float bv = 0.0f;
    for (int e = lane; e < n; e += 32)
        if (!taken[e] && (bi < 0 || v[e] > bv)) {
            bi = e;
            bv = v[e];
        }
    for (int o = 16; o > 0; o >>= 1) {
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
            bi = oi;
            bv = ov;
        }
    }
    return bi;
}

/* Routes one token row with one warp (lane = its lane). Shared: s[E] |
 * choice[E] | taken[E] | gscore[G] | gsel[G] | sel[top_k], route_smem
 * bytes from smem. Writes ids_out[0..top_k) and w_out[0..top_k); sel holds
 * the ids afterwards. */
__device__ static void route_row(int E, int G, int topk_group, int top_k, int scoring, int method, int norm,
                                 float scaling, const float *__restrict__ bias, const float *lg, float *smem,
                                 int32_t *ids_out, float *w_out, int lane) {
    float *s = smem, *ch = s + E;
    int *taken = (int *)(ch + E);
    float *gs = (float *)(taken + E);
    int *gsel = (int *)(gs + G), *sel = gsel + G;

    if (scoring == 1) {
        for (int e = lane; e < E; e += 32)
            s[e] = 1.0f / (1.0f + expf(-lg[e]));
    } else {
        float mx = -INFINITY;
        for (int e = lane; e < E; e += 32)
            mx = fmaxf(mx, lg[e]);
        mx = cu_warp_max(mx);
        for (int e = lane; e < E; e += 32)
            s[e] = expf(lg[e] - mx);
        float sum = 0.0f; /* a lane's share, then the warp's tree (not the CPU's order: the weights differ in the last bits) */
        for (int e = lane; e < E; e += 32)
            sum += s[e];
        sum = cu_warp_sum(sum);
        for (int e = lane; e < E; e += 32)
            s[e] /= sum;
    }
    __syncwarp();
    for (int e = lane; e < E; e += 32) {
        ch[e] = s[e] + ((method == 2 && bias) ? bias[e] : 0.0f);
        taken[e] = 0;
    }
    __syncwarp();
    if (method != 0 && G > 1) {
        const int per = E / G;
        for (int g = lane; g < G; g += 32) {
            const float *cg = ch + g * per;
            if (method == 2) {
                int t2[2];
                topk_serial(cg, per, per >= 2 ? 2 : 1, t2);
                gs[g] = cg[t2[0]] + (per >= 2 ? cg[t2[1]] : 0.0f);
            } else {
                float m = -INFINITY;
                for (int e = 0; e < per; e++)
                    m = fmaxf(m, cg[e]);
                gs[g] = m;
            }
        }
        __syncwarp();
        if (lane == 0)
            topk_serial(gs, G, topk_group, gsel);
        __syncwarp();
        for (int e = lane; e < E; e += 32) {
            const int g = e / per;
            bool keep = false;
            for (int j = 0; j < topk_group; j++)
                if (gsel[j] == g)
                    keep = true;
            if (!keep)
                ch[e] = -INFINITY;
        }
        __syncwarp();
    }
    for (int j = 0; j < top_k; j++) {
        const int b = warp_argmax(ch, taken, E, lane);
        if (lane == 0) {
            sel[j] = b;
            taken[b] = 1;
        }
        __syncwarp();
    }
    if (lane == 0) {
        float sum = 0.0f;
        for (int j = 0; j < top_k; j++)
            sum += s[sel[j]];
        for (int j = 0; j < top_k; j++) {
            float w = s[sel[j]];
            if (norm)
                w /= (sum + 1e-20f);
            ids_out[j] = sel[j];
            w_out[j] = w * scaling;
        }
    }
    __syncwarp();
}

/* One warp (block of 32) per token row (route_row). */
static __global__ void __launch_bounds__(32)
    k_moe_route(int E, int G, int topk_group, int top_k, int scoring, int method, int norm, float scaling,
                const float *__restrict__ bias, const float *__restrict__ logits, int32_t *__restrict__ ids_out,
                float *__restrict__ w_out) {
    cu_pdl_launch_dependents();
    extern __shared__ float4 smem4[];
    const int r = blockIdx.x;
    route_row(E, G, topk_group, top_k, scoring, method, norm, scaling, bias, logits + (size_t)r * E, (float *)smem4,
              ids_out + (size_t)r * top_k, w_out + (size_t)r * top_k, threadIdx.x);
}

static size_t route_smem(int E, int G, int top_k) {
    return (size_t)(3 * E + 2 * G + top_k) * 4;
}

static cudaError_t route_launch(int rows, const float *logits, const pd_moe_route_params *p, int G, int32_t *ids,
                                float *w, cudaStream_t s) {
    size_t smem = route_smem(p->n_experts, G, p->top_k);
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(k_moe_route, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess)
            return e;
    }
    k_moe_route<<<rows, 32, smem, s>>>(p->n_experts, G, p->topk_group, p->top_k, p->scoring, p->topk_method,
                                       p->norm_topk_prob ? 1 : 0, p->routed_scaling_factor,
                                       p->e_score_correction_bias, logits, ids, w);
    return cudaGetLastError();
}

void cu_moe_route(pd_backend *be, int rows, const float *logits, const pd_moe_route_params *p, int32_t *ids,
                  float *weights) {
    cu_ctx *c = cu_of(be);
    if (!p) {
        cu_fail(c, PD_ERR_INVALID, "moe_route: no parameters");
        return;
    }
    if (rows <= 0)
        return;
    int E = p->n_experts, G = p->n_group > 0 ? p->n_group : 1;
    bool grouped = p->topk_method != 0 && G > 1;
    if (c->status == PD_OK &&
        (E <= 0 || E > ROUTE_MAX_EXPERTS || p->top_k <= 0 || p->top_k > E || G > ROUTE_MAX_GROUPS ||
         (grouped && (E % G != 0 || p->topk_group <= 0 || p->topk_group > G)) || p->scoring < 0 || p->scoring > 1 ||
         p->topk_method < 0 || p->topk_method > 2 || !logits || !ids || !weights)) {
        /* invalid arguments: nothing written (the outputs may be missing) */
        cu_fail(c, PD_ERR_INVALID, "moe_route: %d experts, top_k %d, %d groups (keep %d), scoring %d, method %d", E,
                p->top_k, G, p->topk_group, p->scoring, p->topk_method);
        return;
    }
    size_t n = (size_t)rows * (p->top_k > 0 ? p->top_k : 0);
    if (c->status == PD_OK) {
        int32_t *dids = (int32_t *)cu_scratch(c, CU_SCR_ARG0, n * sizeof(int32_t));
        float *dw = (float *)cu_scratch(c, CU_SCR_ARG1, n * sizeof(float));
        if (dids && dw && CU_LAUNCHED(c, route_launch(rows, logits, p, G, dids, dw, c->stream), "moe_route") &&
            CU_OK(c, cudaMemcpyAsync(ids, dids, n * sizeof(int32_t), cudaMemcpyDeviceToHost, c->stream)) &&
            CU_OK(c, cudaMemcpyAsync(weights, dw, n * sizeof(float), cudaMemcpyDeviceToHost, c->stream)) &&
            CU_OK(c, cudaStreamSynchronize(c->stream)))
            return;
    }
    /* an earlier or a device failure: expert 0 with NaN weights, so that
     * nothing downstream passes for real */
    for (size_t k = 0; k < n && ids && weights; k++) {
        ids[k] = 0;
        weights[k] = NAN;
    }
}

/* xin[j] = x[src_row[j]] */
static __global__ void k_moe_gather(int hidden, const int *__restrict__ src_row, const float *__restrict__ x,
                                    float *__restrict__ xin) {
    cu_pdl_launch_dependents();
    const float *s = x + (size_t)src_row[blockIdx.x] * hidden;
    float *d = xin + (size_t)blockIdx.x * hidden;
    for (int k = threadIdx.x; k < hidden; k += blockDim.x)
        d[k] = s[k];
}

/* xin[j] = bf16(x[src_row[j]]): the rows of bf16 experts rounded once,
 * as cu_gemm_run would round them before each expert's GEMM. Eight values
 * a thread a step (two 16-byte loads, one 16-byte store) when hidden % 8 ==
 * 0 (rows then 16-byte aligned); one value a thread otherwise. */
static __global__ void k_moe_gather_bf16(int hidden, const int *__restrict__ src_row, const float *__restrict__ x,
                                         __nv_bfloat16 *__restrict__ xin) {
    if (hidden % 8) { /* rows not 16-byte aligned: one value a thread */
        const float *s1 = x + (size_t)src_row[blockIdx.x] * hidden;
        for (int k = threadIdx.x; k < hidden; k += blockDim.x)
            xin[(size_t)blockIdx.x * hidden + k] = __float2bfloat16_rn(s1[k]);
        return;
    }
    const float4 *s = (const float4 *)(x + (size_t)src_row[blockIdx.x] * hidden);
    uint4 *d = (uint4 *)(xin + (size_t)blockIdx.x * hidden);
    for (int k = threadIdx.x; k < hidden / 8; k += blockDim.x) {
        const float4 a = __ldg(s + 2 * k), b = __ldg(s + 2 * k + 1);
        __nv_bfloat162 p0 = __floats2bfloat162_rn(a.x, a.y), p1 = __floats2bfloat162_rn(a.z, a.w);
        __nv_bfloat162 p2 = __floats2bfloat162_rn(b.x, b.y), p3 = __floats2bfloat162_rn(b.z, b.w);
        d[k] = make_uint4(*(unsigned *)&p0, *(unsigned *)&p1, *(unsigned *)&p2, *(unsigned *)&p3);
    }
}

/* act[r, i] = bf16(silu(gu[r, i]) · gu[r, I + i]): SwiGLU (elementwise.cu's
 * k_silu_mul) with its result rounded for the down GEMM; gu fp32 or bf16
 * (the gate_up GEMMs' output, PD_MOE_Y); four values a thread when inter %
 * 4 == 0 and rows · inter / 4 < 2^32 (indexed in 32 bits), else one. */
template <typename GU>
static __global__ void k_moe_silu_mul_bf16(int rows, int inter, const GU *__restrict__ gu,
                                           __nv_bfloat16 *__restrict__ act) {
    if (inter % 4 || (size_t)rows * (inter / 4) >= 0xffffffffu) { /* one value a thread */
        const size_t n1 = (size_t)rows * inter;
        for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < n1; k += (size_t)gridDim.x * blockDim.x) {
            const size_t r = k / inter, i = k - r * inter;
            const float g = cu_ldw(gu, r * 2 * inter + i), u = cu_ldw(gu, r * 2 * inter + inter + i);
            act[k] = __float2bfloat16_rn(g / (1.0f + expf(-g)) * u);
        }
        return;
    }
    const unsigned q4 = (unsigned)inter / 4, n = (unsigned)rows * q4;
    for (unsigned k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) {
        const unsigned r = k / q4, i4 = k - r * q4;
        const float4 g = cu_ld4(gu + (size_t)r * 2 * inter + 4 * (size_t)i4);
        const float4 u = cu_ld4(gu + (size_t)r * 2 * inter + inter + 4 * (size_t)i4);
        __nv_bfloat162 lo = __floats2bfloat162_rn(g.x / (1.0f + expf(-g.x)) * u.x, g.y / (1.0f + expf(-g.y)) * u.y);
        __nv_bfloat162 hi = __floats2bfloat162_rn(g.z / (1.0f + expf(-g.z)) * u.z, g.w / (1.0f + expf(-g.w)) * u.w);
        *(uint2 *)(act + (size_t)r * inter + 4 * (size_t)i4) = make_uint2(*(unsigned *)&lo, *(unsigned *)&hi);
    }
}

/* out[r] += Σ_j tok_w[r, j] · y[tok_pos[r, j]] over the token's top_k
 * routed pairs, in expert order, in fp32 (y fp32 or bf16: the down GEMMs'
 * output, PD_MOE_Y); four columns a thread when hidden % 4 == 0 (rows of
 * out 16-byte, of y 16- or 8-byte aligned), the top_k rows' loads in
 * flight together. */
template <typename Y>
static __global__ void k_moe_combine(int hidden, int top_k, const int *__restrict__ tok_pos,
                                     const float *__restrict__ tok_w, const Y *__restrict__ y,
                                     float *__restrict__ out) {
    cu_pdl_launch_dependents();
    const int r = blockIdx.x;
    const int *pos = tok_pos + (size_t)r * top_k;
    const float *w = tok_w + (size_t)r * top_k;
    if (hidden % 4) { /* one column a thread */
        float *o1 = out + (size_t)r * hidden;
        for (int d = threadIdx.x; d < hidden; d += blockDim.x) {
            float acc = o1[d];
            for (int j = 0; j < top_k; j++)
                acc += w[j] * cu_ldw(y, (size_t)pos[j] * hidden + d);
            o1[d] = acc;
        }
        return;
    }
    float4 *o = (float4 *)(out + (size_t)r * hidden);
    for (int d = threadIdx.x; d < hidden / 4; d += blockDim.x) {
        float4 acc = o[d];
        for (int j = 0; j < top_k; j++) {
            const float4 v = cu_ld4(y + (size_t)pos[j] * hidden + 4 * (size_t)d);
            const float wj = w[j];
            acc.x += wj * v.x;
            acc.y += wj * v.y;
            acc.z += wj * v.z;
            acc.w += wj * v.w;
        }
        o[d] = acc;
    }
}

static cudaError_t gather_launch(int n, int hidden, const int *src_row, const float *x, float *xin, cudaStream_t s) {
    k_moe_gather<<<n, 256, 0, s>>>(hidden, src_row, x, xin);
    return cudaGetLastError();
}

template <typename Y>
static cudaError_t combine_launch(int rows, int hidden, int top_k, const int *tok_pos, const float *tok_w,
                                  const Y *y, float *out, cudaStream_t s) {
    k_moe_combine<<<rows, 256, 0, s>>>(hidden, top_k, tok_pos, tok_w, y, out);
    return cudaGetLastError();
}

/* Host tables for one call: src_row [n] (token of each pair, sorted by
 * expert), tok_pos [rows × top_k] (each token's pair positions in that
 * order), tok_w alongside; off[e]..off[e+1] is expert e's slice. */
typedef struct {
    int *src_row, *tok_pos;
    float *tok_w;
    int *off;
} moe_plan;

/* The experts' work over a plan already in device memory: d_src [n_kept]
 * (token of each pair, in expert order), d_pos / d_w [rows × top_k] (each
 * token's pair positions in that order and their weights; 0 / 0 past its
 * kept pairs); off (host, [n_groups + 1]): off[e]..off[e+1] is expert e's
 * slice. Gather, gate_up GEMM per expert, SwiGLU, down GEMM per expert,
 * weighted combine into out. */
static void moe_run(cu_ctx *c, int rows, int hidden, int inter, const float *x, int top_k, int n_groups,
                    const int *off, const int *d_src, const int *d_pos, const float *d_w, const pd_weight *gate_up,
                    const pd_weight *down, float *out) {
    const int n = rows * top_k, n_kept = off[n_groups];
    bool ok = true;
    for (int e = 0; e < n_groups && ok; e++)
        if (off[e + 1] > off[e] &&
            (gate_up[e].rows != 2 * inter || gate_up[e].cols != hidden || down[e].rows != hidden ||
             down[e].cols != inter || !gate_up[e].data || !down[e].data)) {
            cu_fail(c, PD_ERR_INVALID, "moe_experts: expert %d has gate_up [%d, %d], down [%d, %d]; want [%d, %d], [%d, %d]",
                    e, gate_up[e].rows, gate_up[e].cols, down[e].rows, down[e].cols, 2 * inter, hidden, hidden, inter);
            ok = false;
        }
    /* bf16 weights: the rows are rounded to bf16 once, by the gather and by
     * SwiGLU, and every expert's GEMM reads them as they are (the same
     * numbers as rounding before each GEMM, two launches instead of one per
     * GEMM); PD_MOE_ROWS=f32 keeps the fp32 rows, for A/B runs. With them
     * the GEMMs write bf16 too (y16: fp32 accumulation, each output rounded
     * once, as transformers' bf16 projections round theirs), which SwiGLU
     * and the combine read back into fp32 arithmetic: half the bytes of the
     * [n, 2I] and [n, H] round trips; PD_MOE_Y=f32 keeps fp32 outputs. */
    const bool rows16 = c->wfmt == PD_CUDA_WEIGHTS_BF16 && !c->moe_f32_rows;
    const bool y16 = rows16 && !c->moe_y_f32;
    const size_t esz = rows16 ? sizeof(__nv_bfloat16) : sizeof(float);
    const size_t ysz = y16 ? sizeof(__nv_bfloat16) : sizeof(float);
    void *xin = ok ? cu_scratch(c, CU_SCR_MOE_X, (size_t)n * hidden * esz) : NULL;
    void *gu = ok ? cu_scratch(c, CU_SCR_MOE_GU, (size_t)n * 2 * inter * ysz) : NULL;
    void *act = ok ? cu_scratch(c, CU_SCR_MOE_ACT, (size_t)n * inter * esz) : NULL;
    void *y = ok ? cu_scratch(c, CU_SCR_MOE_Y, (size_t)n * hidden * ysz) : NULL;
    ok = ok && xin && gu && act && y;
    __nv_bfloat16 *gu16 = (__nv_bfloat16 *)gu, *y16p = (__nv_bfloat16 *)y;
    float *gu32 = (float *)gu, *y32 = (float *)y;
    if (ok && rows16) {
        k_moe_gather_bf16<<<n_kept, 256, 0, c->stream>>>(hidden, d_src, x, (__nv_bfloat16 *)xin);
        ok = CU_LAUNCHED(c, cudaGetLastError(), "moe gather");
    } else if (ok) {
        ok = CU_LAUNCHED(c, gather_launch(n_kept, hidden, d_src, x, (float *)xin, c->stream), "moe gather");
    }
    for (int e = 0; e < n_groups && ok; e++) {
        const int o = off[e], m = off[e + 1] - o;
        const __nv_bfloat16 *xe = (const __nv_bfloat16 *)xin + (size_t)o * hidden;
        const __nv_bfloat16 *we = (const __nv_bfloat16 *)gate_up[e].data;
        if (m && y16)
            ok = cu_gemm_bf16_run_y16(c, m, 2 * inter, hidden, xe, we, gu16 + (size_t)o * 2 * inter);
        else if (m && rows16)
            ok = cu_gemm_bf16_run(c, m, 2 * inter, hidden, xe, we, gu32 + (size_t)o * 2 * inter, false);
        else if (m)
            ok = cu_gemm_run(c, m, (const float *)xin + (size_t)o * hidden, &gate_up[e], gu32 + (size_t)o * 2 * inter,
                             false);
    }
    if (ok && rows16) {
        const unsigned blocks = cu_blocks((size_t)n_kept * inter, 256, 16384);
        if (y16)
            k_moe_silu_mul_bf16<<<blocks, 256, 0, c->stream>>>(n_kept, inter, gu16, (__nv_bfloat16 *)act);
        else
            k_moe_silu_mul_bf16<<<blocks, 256, 0, c->stream>>>(n_kept, inter, gu32, (__nv_bfloat16 *)act);
        ok = CU_LAUNCHED(c, cudaGetLastError(), "moe silu_mul");
    } else if (ok) {
        ok = CU_LAUNCHED(c, cu_silu_mul_launch(n_kept, inter, gu32, (float *)act, c->stream), "moe silu_mul");
    }
    for (int e = 0; e < n_groups && ok; e++) {
        const int o = off[e], m = off[e + 1] - o;
        const __nv_bfloat16 *ae = (const __nv_bfloat16 *)act + (size_t)o * inter;
        const __nv_bfloat16 *we = (const __nv_bfloat16 *)down[e].data;
        if (m && y16)
            ok = cu_gemm_bf16_run_y16(c, m, hidden, inter, ae, we, y16p + (size_t)o * hidden);
        else if (m && rows16)
            ok = cu_gemm_bf16_run(c, m, hidden, inter, ae, we, y32 + (size_t)o * hidden, false);
        else if (m)
            ok = cu_gemm_run(c, m, (const float *)act + (size_t)o * inter, &down[e], y32 + (size_t)o * hidden, false);
    }
    if (ok && y16)
        CU_LAUNCHED(c, combine_launch(rows, hidden, top_k, d_pos, d_w, y16p, out, c->stream), "moe combine");
    else if (ok)
        CU_LAUNCHED(c, combine_launch(rows, hidden, top_k, d_pos, d_w, y32, out, c->stream), "moe combine");
}

void cu_moe_experts(pd_backend *be, int rows, int hidden, int inter, const float *x, const int32_t *ids,
                    const float *weights, int top_k, const pd_weight *gate_up, const pd_weight *down, float *out) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || rows == 0)
        return;
    if (rows < 0 || hidden <= 0 || inter <= 0 || top_k <= 0 || !x || !ids || !weights || !gate_up || !down || !out) {
        cu_fail(c, PD_ERR_INVALID, "moe_experts: rows %d, hidden %d, inter %d, top_k %d", rows, hidden, inter, top_k);
        return;
    }
    const int n = rows * top_k;
    int max_e = 0, n_kept = 0;
    for (int k = 0; k < n; k++) {
        if (ids[k] < -1 || ids[k] > MOE_MAX_EXPERT_ID) {
            cu_fail(c, PD_ERR_INVALID, "moe_experts: expert id %d at %d", ids[k], k);
            return;
        }
        if (ids[k] > max_e)
            max_e = ids[k];
        n_kept += ids[k] >= 0;
    }
    if (n_kept == 0)
        return; /* every pair dropped (expert parallelism: other ranks' experts) */
    /* one host block: src_row[n] | tok_pos[n] | tok_w[n] (uploaded together),
     * then off[max_e + 2] | next[max_e + 1] | pair[n] | cnt[rows] */
    size_t hb_bytes = (size_t)n * 12 + ((size_t)2 * max_e + 3 + n + rows) * sizeof(int);
    char *hb = (char *)cu_host_scratch(c, CU_HSCR_MOE_PLAN, hb_bytes); /* page-locked, kept between calls */
    if (!hb)
        return;
    moe_plan pl = {(int *)hb, (int *)hb + n, (float *)((int *)hb + 2 * n), (int *)(hb + (size_t)n * 12)};
    int *next = pl.off + max_e + 2, *pair = next + max_e + 1, *cnt = pair + n;
    for (int e = 0; e <= max_e + 1; e++)
        pl.off[e] = 0;
    for (int k = 0; k < n; k++)
        if (ids[k] >= 0)
            pl.off[ids[k] + 1]++;
    for (int e = 0; e <= max_e; e++) {
        pl.off[e + 1] += pl.off[e];
        next[e] = pl.off[e];
    }
    /* pairs in expert order, index order within an expert (the CPU's order) */
    for (int k = 0; k < n; k++) {
        if (ids[k] < 0)
            continue;
        int j = next[ids[k]]++;
        pl.src_row[j] = k / top_k;
        pair[j] = k;
    }
    for (int r = 0; r < rows; r++)
        cnt[r] = 0;
    for (int j = 0; j < n_kept; j++) {
        int k = pair[j], r = k / top_k, slot = r * top_k + cnt[r]++;
        pl.tok_pos[slot] = j;
        pl.tok_w[slot] = weights[k];
    }
    /* a token's slots past its kept pairs: weight 0 on kept pair 0 (finite),
     * so the combine adds exactly 0 for a dropped pair */
    for (int r = 0; r < rows; r++)
        for (int j = cnt[r]; j < top_k; j++) {
            pl.tok_pos[r * top_k + j] = 0;
            pl.tok_w[r * top_k + j] = 0.0f;
        }
    int *didx = (int *)cu_scratch_upload(c, CU_SCR_MOE_IDX, hb, (size_t)n * 12);
    if (!didx)
        return;
    cu_host_scratch_queued(c, CU_HSCR_MOE_PLAN); /* the upload reads hb: the next call waits for it */
    moe_run(c, rows, hidden, inter, x, top_k, max_e + 1, pl.off, didx, didx + n, (const float *)(didx + 2 * n),
            gate_up, down, out);
}

/* ---- the prefill MoE's plan on the GPU ---------------------------------
 *
 * The same tables as cu_moe_experts' host plan (src_row in expert order,
 * index order within an expert; each token's slots in that order), made
 * by four small kernels over the route's ids where they are, so that the
 * host waits only for the E + 2 counts it needs to launch one GEMM per
 * expert (downloading the ids and planning on the host left the GPU idle
 * ~1.3 ms a MoE layer of an 8K prefill, measured with cupti_trace.c).
 * Pairs go MP_PAIRS a block; a block's warps take MP_PAIRS / MP_WARPS
 * consecutive pairs each, 32 at a time. */
#define MP_WARPS 8
#define MP_PAIRS 2048
#define MP_MAX_TOPK 8

/* bcnt[b][e] = pairs of block b routed to expert e (e < E); bcnt[b][E] = ids
 * outside [-1, E) (an error the host reports). */
static __global__ void __launch_bounds__(MP_WARPS * 32)
    k_mp_count(int n, int E, const int32_t *__restrict__ ids, int *__restrict__ bcnt) {
    extern __shared__ int mp_sm[]; /* [E + 1] */
    for (int e = threadIdx.x; e <= E; e += blockDim.x)
        mp_sm[e] = 0;
    __syncthreads();
    const int k0 = blockIdx.x * MP_PAIRS, k1 = min(n, k0 + MP_PAIRS);
    for (int k = k0 + threadIdx.x; k < k1; k += blockDim.x) {
        const int e = ids[k];
        if (e >= 0 && e < E)
            atomicAdd(&mp_sm[e], 1);
        else if (e != -1)
            atomicAdd(&mp_sm[E], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += blockDim.x)
        bcnt[(size_t)blockIdx.x * (E + 1) + e] = mp_sm[e];
}

/* One block: off[e] = Σ_{e' < e} pairs of e' (off[E] = kept pairs), off[E +
 * 1] = invalid ids; bbase[b][e] = off[e] + Σ_{b' < b} bcnt[b'][e]. */
static __global__ void k_mp_scan(int nb, int E, const int *__restrict__ bcnt, int *__restrict__ bbase,
                                 int *__restrict__ off) {
    extern __shared__ int mp_sm[]; /* [E + 1] totals */
    for (int e = threadIdx.x; e <= E; e += blockDim.x) {
        int run = 0;
        for (int b = 0; b < nb; b++) {
            bbase[(size_t)b * (E + 1) + e] = run;
            run += bcnt[(size_t)b * (E + 1) + e];
        }
        mp_sm[e] = run;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int e = 0; e < E; e++) {
            const int t = mp_sm[e];
            mp_sm[e] = run;
            run += t;
        }
        off[E + 1] = mp_sm[E];
        mp_sm[E] = run;
        for (int e = 0; e <= E; e++)
            off[e] = mp_sm[e];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        for (int b = 0; b < nb; b++)
            bbase[(size_t)b * (E + 1) + e] += mp_sm[e];
}

/* src_row[j] = the token of pair k and jpos[k] = j, j its place in expert
 * order (jpos -1: dropped or invalid). Stable: a warp's pairs of one expert
 * get consecutive places in index order (__match_any_sync ranks the lanes
 * of a step), after the earlier warps' and blocks'. */
static __global__ void __launch_bounds__(MP_WARPS * 32)
    k_mp_assign(int n, int E, int top_k, const int32_t *__restrict__ ids, const int *__restrict__ bbase,
                int *__restrict__ src_row, int *__restrict__ jpos) {
    extern __shared__ int mp_sm[]; /* wcnt [MP_WARPS][E], then run [MP_WARPS][E] */
    int *wcnt = mp_sm, *run = mp_sm + MP_WARPS * E;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < MP_WARPS * E; i += blockDim.x)
        wcnt[i] = 0;
    __syncthreads();
    constexpr int WP = MP_PAIRS / MP_WARPS;
    const int k0 = blockIdx.x * MP_PAIRS + warp * WP, k1 = min(n, k0 + WP);
    for (int k = k0 + lane; k < k1; k += 32) {
        const int e = ids[k];
        if (e >= 0 && e < E)
            atomicAdd(&wcnt[warp * E + e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int base = bbase[(size_t)blockIdx.x * (E + 1) + e];
        for (int w = 0; w < MP_WARPS; w++) {
            run[w * E + e] = base;
            base += wcnt[w * E + e];
        }
    }
    __syncthreads();
    for (int kb = k0; kb < k1; kb += 32) {
        const int k = kb + lane;
        const int e = k < k1 ? ids[k] : -1;
        const bool kept = e >= 0 && e < E;
        const unsigned act = __ballot_sync(0xffffffffu, kept);
        if (kept) {
            const unsigned m = __match_any_sync(act, e);
            const int j = run[warp * E + e] + __popc(m & ((1u << lane) - 1u));
            src_row[j] = k / top_k;
            jpos[k] = j;
            __syncwarp(act);
            if (lane == __ffs(m) - 1)
                run[warp * E + e] += __popc(m);
        } else if (k < k1) {
            jpos[k] = -1;
        }
        __syncwarp();
    }
}

/* A token's kept pairs in expert order (ascending j) into its top_k slots:
 * tok_pos = j, tok_w = its weight; 0 / 0 after them. */
static __global__ void k_mp_tokens(int rows, int top_k, const int *__restrict__ jpos, const float *__restrict__ weights,
                                   int *__restrict__ tok_pos, float *__restrict__ tok_w) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows)
        return;
    int js[MP_MAX_TOPK];
    float ws[MP_MAX_TOPK];
    int c = 0;
    for (int i = 0; i < top_k; i++) {
        const int j = jpos[(size_t)r * top_k + i];
        if (j < 0)
            continue;
        const float w = weights[(size_t)r * top_k + i];
        int s = c++;
        for (; s > 0 && js[s - 1] > j; s--) {
            js[s] = js[s - 1];
            ws[s] = ws[s - 1];
        }
        js[s] = j;
        ws[s] = w;
    }
    for (int s = 0; s < top_k; s++) {
        tok_pos[(size_t)r * top_k + s] = s < c ? js[s] : 0;
        tok_w[(size_t)r * top_k + s] = s < c ? ws[s] : 0.0f;
    }
}

/* The plan of n = rows × top_k pairs on the GPU, then the experts (moe_run).
 * Returns false, with nothing queued, when this path cannot take the call
 * (the caller plans on the host); errors are recorded in c. */
static bool moe_experts_device_plan(cu_ctx *c, int rows, int hidden, int inter, const float *x, const int32_t *ids,
                                    const float *weights, int top_k, int E, const pd_weight *gate_up,
                                    const pd_weight *down, float *out) {
    const size_t n = (size_t)rows * top_k;
    const int nb = (int)((n + MP_PAIRS - 1) / MP_PAIRS);
    const size_t smem = (size_t)2 * MP_WARPS * E * sizeof(int);
    if (top_k > MP_MAX_TOPK || n > (size_t)INT32_MAX / 4 || smem > c->smem_optin || c->moe_host_plan)
        return false;
    /* CU_SCR_MOE_IDX: src_row [n] | tok_pos [n] | tok_w [n] | jpos [n] | bcnt, bbase [nb][E + 1] | off [E + 2] */
    int *t = (int *)cu_scratch(c, CU_SCR_MOE_IDX, (4 * n + 2 * (size_t)nb * (E + 1) + E + 2) * sizeof(int));
    int *hoff = (int *)cu_host_scratch(c, CU_HSCR_MOE_IDS, (size_t)(E + 2) * sizeof(int));
    if (!t || !hoff)
        return true;
    int *src_row = t, *tok_pos = t + n, *jpos = t + 3 * n, *bcnt = t + 4 * n, *bbase = bcnt + (size_t)nb * (E + 1);
    float *tok_w = (float *)(t + 2 * n);
    int *off = bbase + (size_t)nb * (E + 1);
    cudaError_t e = CU_SMEM_OPTIN(k_mp_assign, smem);
    if (e == cudaSuccess) {
        k_mp_count<<<nb, MP_WARPS * 32, (E + 1) * sizeof(int), c->stream>>>((int)n, E, ids, bcnt);
        k_mp_scan<<<1, 256, (E + 1) * sizeof(int), c->stream>>>(nb, E, bcnt, bbase, off);
        k_mp_assign<<<nb, MP_WARPS * 32, smem, c->stream>>>((int)n, E, top_k, ids, bbase, src_row, jpos);
        k_mp_tokens<<<(rows + 127) / 128, 128, 0, c->stream>>>(rows, top_k, jpos, weights, tok_pos, tok_w);
        e = cudaGetLastError();
    }
    if (!CU_LAUNCHED(c, e, "moe plan (prefill)") ||
        !CU_OK(c, cudaMemcpyAsync(hoff, off, (size_t)(E + 2) * sizeof(int), cudaMemcpyDeviceToHost, c->stream)) ||
        !CU_OK(c, cudaStreamSynchronize(c->stream)))
        return true;
    if (hoff[E + 1] > 0) {
        cu_fail(c, PD_ERR_INVALID, "moe_experts_ids: %d expert ids outside [-1, %d)", hoff[E + 1], E);
        return true;
    }
    if (hoff[E] > 0)
        moe_run(c, rows, hidden, inter, x, top_k, E, hoff, src_row, tok_pos, tok_w, gate_up, down, out);
    return true;
}

/* ---- step operations: routing results stay in device memory ----------- */

void cu_moe_route_ids(pd_backend *be, int rows, const float *logits, const pd_moe_route_params *p, int32_t *ids,
                      float *weights) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || rows == 0)
        return;
    int E = p ? p->n_experts : 0, G = p && p->n_group > 0 ? p->n_group : 1;
    bool grouped = p && p->topk_method != 0 && G > 1;
    if (!p || rows < 0 || E <= 0 || E > ROUTE_MAX_EXPERTS || p->top_k <= 0 || p->top_k > E ||
        G > ROUTE_MAX_GROUPS || (grouped && (E % G != 0 || p->topk_group <= 0 || p->topk_group > G)) ||
        p->scoring < 0 || p->scoring > 1 || p->topk_method < 0 || p->topk_method > 2 || !logits || !ids ||
        !weights) {
        cu_fail(c, PD_ERR_INVALID, "moe_route_ids: rows %d, %d experts, top_k %d, %d groups", rows, E,
                p ? p->top_k : -1, G);
        return;
    }
    size_t smem = route_smem(E, G, p->top_k);
    cudaError_t e = CU_SMEM_OPTIN(k_moe_route, smem);
    if (e == cudaSuccess) {
        k_moe_route<<<rows, 32, smem, c->stream>>>(E, G, p->topk_group, p->top_k, p->scoring, p->topk_method,
                                                   p->norm_topk_prob ? 1 : 0, p->routed_scaling_factor,
                                                   p->e_score_correction_bias, logits, ids, weights);
        e = cudaGetLastError();
    }
    CU_LAUNCHED(c, e, "moe_route_ids");
}

/* Groups the n = rows × top_k (token, expert) pairs by expert, in pair
 * order within an expert: off[e] .. off[e+1] index expert e's pairs in
 * tok (their token rows) and pair (their pair index); list[0 .. G-1], G =
 * min(E, n), holds the experts that have pairs in increasing order, then
 * -1s, so the grouped GEMMs launch G groups, not E (at batch 1 and top-6 of
 * 64 experts, 6 instead of 64). With S shared groups (moe_block: the shared
 * experts as S experts of the routed experts' size) group E + s takes every
 * token t at position n + s·rows + t (tok = t, pair = that position), and
 * list[G + s] = E + s. One block of nthreads; thread e scans the n ids for
 * its experts (n is small in a decode step). Ids outside [0, E) are
 * dropped. cnt: E ints of shared memory. */
__device__ static void plan_block(int n, int top_k, int E, int S, int rows, const int32_t *ids, int *off, int *tok,
                                  int *pair, int *list, int *cnt, int nthreads) {
    for (int e = threadIdx.x; e < E; e += nthreads) {
        int k = 0;
        for (int i = 0; i < n; i++)
            k += ids[i] == e;
        cnt[e] = k;
    }
    __syncthreads();
    const int G = min(E, n);
    if (threadIdx.x == 0) {
        int sum = 0, na = 0;
        for (int e = 0; e < E; e++) {
            const int k = cnt[e];
            off[e] = sum;
            cnt[e] = sum;
            sum += k;
            if (k > 0 && na < G)
                list[na++] = e;
        }
        for (; na < G; na++)
            list[na] = -1;
        for (int g = 0; g <= S; g++) /* the shared groups' pairs follow the routed ones' */
            off[E + g] = sum + g * rows;
        for (int g = 0; g < S; g++)
            list[G + g] = E + g;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += nthreads) {
        int j = cnt[e];
        for (int i = 0; i < n; i++)
            if (ids[i] == e) {
                tok[j] = i / top_k;
                pair[j] = i;
                j++;
            }
    }
    const int base = off[E]; /* written by thread 0 before the barrier */
    for (int q = threadIdx.x; q < S * rows; q += nthreads) {
        tok[base + q] = q % rows;
        pair[base + q] = n + q; /* its rows of act and y follow the routed pairs' */
    }
}

#define PLAN_THREADS 256
static __global__ void __launch_bounds__(PLAN_THREADS)
    k_moe_plan(int n, int top_k, int E, const int32_t *__restrict__ ids, int *__restrict__ off,
               int *__restrict__ tok, int *__restrict__ pair, int *__restrict__ list) {
    cu_pdl_launch_dependents();
    extern __shared__ int cnt[]; /* [E] */
    plan_block(n, top_k, E, 0, 0, ids, off, tok, pair, list, cnt, PLAN_THREADS);
}

/* out[r] = src[r] + Σ_j w[r, j] · y[r*top_k + j] over the pairs whose id is in
 * [0, E) (pairs in token order; the plan dropped the others), plus
 * Σ_s y[n + s·rows + r] over S shared groups (n = rows · top_k; plan_block's
 * rows of the shared experts, weight 1). Block (row, 256 columns), one
 * column a thread: the top_k loads of a column are independent, so a row of
 * 2048 takes 8 blocks instead of one block's 8 × top_k dependent loads a
 * thread. src: xin, or out itself when xin is NULL (out += ...). early:
 * launched by PDL after k_moe_down1 (moe_block at one row), each thread
 * reads its out before the wait (xin only after it); 0 in a plain launch. */
#define CMB_PAIRS_THREADS 256
static __global__ void __launch_bounds__(CMB_PAIRS_THREADS)
    k_moe_combine_pairs(int hidden, int top_k, int E, int S, const int32_t *__restrict__ ids,
                        const float *__restrict__ w, const float *__restrict__ y, const float *xin, float *out,
                        unsigned *__restrict__ reset, int early) {
    cu_pdl_launch_dependents();
    const int r = blockIdx.x, d = blockIdx.y * CMB_PAIRS_THREADS + threadIdx.x;
    /* out = src + the MoE's output, src = xin (og: x after the output
     * projection, in mo) or out itself. out is final before the MoE block's
     * first kernel: launched by PDL (one row), the block reads it before the
     * wait, which returns once the down GEMV has ended (a no-op in a plain
     * launch). Not xin: k_oproj_route writes it after its own wait, and a
     * chain of early launches (gate_up, down, this kernel, each of which
     * lets the next launch before its wait) can reach this kernel before
     * that; it is read after the wait, beside y. */
    const float *src = xin ? xin : out;
    const float o = d < hidden && early && !xin ? out[(size_t)r * hidden + d] : 0.0f;
    MOE_PROBE(3, blockIdx.y, 0);
    cu_pdl_wait();
    MOE_PROBE(3, blockIdx.y, 1);
    if (reset && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
        *reset = 0; /* k_moe_down1's counter, for the next launch (its kernels have ended) */
    if (d >= hidden)
        return;
    const int32_t *idr = ids + (size_t)r * top_k;
    const float *wr = w + (size_t)r * top_k;
    const float *yr = y + (size_t)r * top_k * hidden + d;
    float acc = 0.0f;
#pragma unroll 8
    for (int j = 0; j < top_k; j++)
        if ((unsigned)idr[j] < (unsigned)E) /* a dropped pair's y was never written */
            acc = fmaf(wr[j], yr[(size_t)j * hidden], acc);
    const size_t n = (size_t)gridDim.x * top_k;
    for (int g = 0; g < S; g++)
        acc += y[(n + (size_t)g * gridDim.x + r) * hidden + d];
    if (early && !xin)
        out[(size_t)r * hidden + d] = o + acc;
    else
        out[(size_t)r * hidden + d] = src[(size_t)r * hidden + d] + acc;
    MOE_PROBE(3, blockIdx.y, 2); /* thread 0's end */
}

/* Decode-sized batches (at most this many pairs) run as four launches that
 * never wait on the host: plan, grouped gate_up with SwiGLU, grouped down,
 * combine. Larger ones copy ids and weights back and take moe_experts. */
#define MOE_DEV_MAX_PAIRS 1024

void cu_moe_experts_ids(pd_backend *be, int rows, int hidden, int inter, const float *x, const int32_t *ids,
                        const float *weights, int top_k, int n_experts, const pd_weight *gate_up,
                        const pd_weight *down, float *out) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || rows == 0)
        return;
    if (rows < 0 || hidden <= 0 || inter <= 0 || top_k <= 0 || n_experts <= 0 || n_experts > MOE_MAX_EXPERT_ID ||
        !x || !ids || !weights || !gate_up || !down || !out) {
        cu_fail(c, PD_ERR_INVALID, "moe_experts_ids: rows %d, hidden %d, inter %d, top_k %d, %d experts", rows, hidden,
                inter, top_k, n_experts);
        return;
    }
    const long n = (long)rows * top_k;
    bool dev = n <= MOE_DEV_MAX_PAIRS && !c->no_moe_device && cu_gemv_ok(hidden, gate_up[0].data, x, hidden) &&
               cu_gemv_ok(inter, down[0].data, x, inter);
    for (int e = 0; e < n_experts && dev; e++)
        if (gate_up[e].rows != 2 * inter || gate_up[e].cols != hidden || down[e].rows != hidden ||
            down[e].cols != inter || !gate_up[e].data || !down[e].data || ((uintptr_t)gate_up[e].data & 15) ||
            ((uintptr_t)down[e].data & 15)) {
            cu_fail(c, PD_ERR_INVALID,
                    "moe_experts_ids: expert %d has gate_up [%d, %d], down [%d, %d]; want [%d, %d], [%d, %d]", e,
                    gate_up[e].rows, gate_up[e].cols, down[e].rows, down[e].cols, 2 * inter, hidden, hidden, inter);
            return;
        }
    if (!dev && moe_experts_device_plan(c, rows, hidden, inter, x, ids, weights, top_k, n_experts, gate_up, down, out))
        return;
    if (!dev) {
        /* host path: ids and weights back to the host (page-locked scratch:
         * DMA, no page faults), then moe_experts */
        int32_t *hids = (int32_t *)cu_host_scratch(c, CU_HSCR_MOE_IDS, (size_t)n * (sizeof(int32_t) + sizeof(float)));
        if (!hids)
            return;
        float *hw = (float *)(hids + n);
        if (CU_OK(c, cudaMemcpyAsync(hids, ids, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost, c->stream)) &&
            CU_OK(c, cudaMemcpyAsync(hw, weights, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost, c->stream)) &&
            CU_OK(c, cudaStreamSynchronize(c->stream))) {
            bool ok = true;
            for (long k = 0; k < n && ok; k++)
                if (hids[k] < -1 || hids[k] >= n_experts) { /* -1: dropped (moe_ids_local) */
                    cu_fail(c, PD_ERR_INVALID, "moe_experts_ids: expert id %d at %ld", hids[k], k);
                    ok = false;
                }
            if (ok)
                cu_moe_experts(be, rows, hidden, inter, x, hids, hw, top_k, gate_up, down, out);
        }
        return;
    }
    const void *const *tgu = cu_wtable_get(c, gate_up, n_experts);
    const void *const *tdn = tgu ? cu_wtable_get(c, down, n_experts) : NULL;
    const int G = (int)(n < n_experts ? n : n_experts); /* groups that can have pairs */
    int *plan = (int *)cu_scratch(c, CU_SCR_MOE_IDX, ((size_t)n_experts + 1 + 2 * (size_t)n + G) * sizeof(int));
    float *act = (float *)cu_scratch(c, CU_SCR_MOE_ACT, (size_t)n * inter * sizeof(float));
    float *y = (float *)cu_scratch(c, CU_SCR_MOE_Y, (size_t)n * hidden * sizeof(float));
    if (!tgu || !tdn || !plan || !act || !y)
        return;
    int *off = plan, *tok = plan + n_experts + 1, *pair = tok + n, *list = pair + n;
    size_t smem = (size_t)n_experts * sizeof(int);
    cudaError_t e = CU_SMEM_OPTIN(k_moe_plan, smem);
    if (e == cudaSuccess) {
        k_moe_plan<<<1, PLAN_THREADS, smem, c->stream>>>((int)n, top_k, n_experts, ids, off, tok, pair, list);
        e = cudaGetLastError();
    }
    if (!CU_LAUNCHED(c, e, "moe plan"))
        return;
    /* act[pair] = silu(gate_e · x[tok]) ⊙ (up_e · x[tok]) */
    if (!CU_LAUNCHED(c,
                     cu_gemv_launch(c->wfmt, true, G, inter, hidden, NULL, tgu, off, list, 0, tok, pair, x, hidden, act,
                                    inter, false, false, c->stream),
                     "moe gate_up"))
        return;
    /* y[pair] = down_e · act[pair] */
    if (!CU_LAUNCHED(c,
                     cu_gemv_launch(c->wfmt, false, G, hidden, inter, NULL, tdn, off, list, 0, pair, pair, act, inter, y,
                                    hidden, false, false, c->stream),
                     "moe down"))
        return;
    k_moe_combine_pairs<<<dim3((unsigned)rows, (unsigned)((hidden + CMB_PAIRS_THREADS - 1) / CMB_PAIRS_THREADS)),
                          CMB_PAIRS_THREADS, 0, c->stream>>>(hidden, top_k, n_experts, 0, ids, weights, y, NULL, out,
                                                             NULL, 0);
    CU_LAUNCHED(c, cudaGetLastError(), "moe combine");
}

/* ---- moe_block: the MoE block of a decode step in four kernels ---------
 *
 * At decode sizes (rows <= GATE_MAX_ROWS) the block is latency-bound: the
 * separate ops take nine launches (rmsnorm, router GEMM, shared gate_up and
 * down, route, plan, routed gate_up and down, combine), most on a few SMs.
 * Here:
 *   1. k_moe_gate: every block norms the rows of x into shared memory
 *      (block 0 also writes h) and computes router logits for its experts,
 *      one expert a warp; the last block to finish (a ticket) routes each
 *      row (route_row) and plans the pairs (plan_small, or plan_block past
 *      32 pairs), the shared experts
 *      as S more groups of the routed experts' size (inter_shared = S ·
 *      inter; a group's rows are a slice of the shared weights: row stride
 *      and up-row offset per group, k_gemv). At one row (and E <= GU1_MAX_E,
 *      G <= GU1_MAX_G, top_k <= 32; not with PD_MOE_ROUTE=gate) it only
 *      writes the logits (logits_only) and step 2 routes and plans.
 *   2. grouped gate_up with SwiGLU over the routed experts that have pairs
 *      and the S shared groups (at one row k_moe_gate_up1, which also
 *      routes the row and writes ids, weights and the plan);
 *   3. grouped down over the same groups (at one row k_moe_down1);
 *   4. x[r] += Σ_j w_j y[r, j] + Σ_s y_shared[s, r] (k_moe_combine_pairs).
 * The shared experts' sum over inter_shared units is thus two sums over
 * inter units added in the combine: the same value up to fp32 order.
 * At one row with S > 0 and PDL on, steps 1-3 overlap: k_moe_gate_up1
 * starts by programmatic dependent launch once every gate block has passed
 * its own wait (x is final), its shared blocks norming x themselves and
 * streaming while the router runs (its routed blocks wait for the gate);
 * k_moe_down1 starts the same way during k_moe_gate_up1, its shared blocks
 * as soon as the gate_up's shared blocks are done, and the combine by PDL
 * after it, reading x before its wait (session 11). Plain PDL for the down
 * and combine launches, where the early blocks only wait, was slower
 * (docs/benchmarks.md, session 9).
 * With the attention's output projection (pd_moe_block_args.o_proj) at one
 * row and PDL on, k_oproj_route replaces step 1 and the projection's GEMV:
 * the router's unnormed logits come from x and o beside the projection
 * (see there), x + W_o · o goes to mo, the gate_up's blocks norm mo
 * themselves, and the combine writes mo + the experts' output into x
 * (session 14: 3 us a layer less). There, with 2 <= top_k <= 8, the down
 * GEMV and the combine are one kernel, k_moe_down1c: a routed block adds
 * its rows of every pair (session 16: 1.8 us a layer less). */
#define GATE_THREADS 128 /* a block: four experts' logits */
#define GATE_MAX_ROWS 4  /* the routing block routes one row a warp */
#define GATE_PRE_KC 8    /* one row: a lane's 16-byte pieces of its router row held in registers (H <= 2048) */
static_assert(GATE_MAX_ROWS <= GATE_THREADS / 32, "k_moe_gate's routing block: a warp a row");

/* k_moe_gate's arguments (cu_moe_block): T rows of H, E experts in G
 * groups, pd_moe_route_params' routing, S shared groups; x, norm, router,
 * h, logits, ids and weights as pd_moe_block_args; off, tok, pair and list
 * the plan (plan_block's layout, in CU_SCR_MOE_IDX). */
typedef struct {
    int T, H, E, G, topk_group, top_k, scoring, method, norm_topk, S;
    float scaling, eps;
    const float *bias, *x, *norm;
    const void *router;
    float *h, *logits, *weights;
    int32_t *ids;
    int *off, *tok, *pair, *list;
    unsigned *ticket; /* the set's counter of finished blocks (0 between launches); unused with logits_only */
    int logits_only; /* the routing is done by k_moe_gate_up1 (one row): write the logits and stop */
    int pre;         /* one row: the router's rows loaded into registers before the PDL wait (PD_GEMV_PRE) */
} moe_gate_args;

/* 32-bit words of the gate kernel's shared memory: the normed rows [T, H]
 * and the norm's weights [H]; then, in the routing block, over them,
 * logits [T, E], route_row's [T, 3E + 2G + top_k], ids and weights [n],
 * plan counts [E]. */
static size_t gate_smem_words(int T, int H, int E, int G, int top_k) {
    const size_t norm = (size_t)T * H + H;
    const size_t route = (size_t)T * E + (size_t)T * (3 * E + 2 * G + top_k) + 2 * (size_t)T * top_k + E;
    return norm > route ? norm : route;
}

/* hn [T, H] = RMSNorm(x) · norm in shared memory (nw: H more words), block
 * 0 of the grid also writing h. x and the norm's weights come in by
 * cp.async, every load in flight at once: a thread's loads one after
 * another from global memory cost ~0.5 us each (norm.cu's one-block
 * kernel: 5-7 us for a row of 2048). The weights are read before the PDL
 * wait, x after it. */
template <int THREADS>
__device__ static void gate_norm(const moe_gate_args &a, float *hn, double *part) {
    const int H4 = a.H / 4;
    float *nw = hn + (size_t)a.T * a.H;
    for (int k = threadIdx.x; k < H4; k += THREADS)
        __pipeline_memcpy_async((float4 *)nw + k, (const float4 *)a.norm + k, sizeof(float4));
    cu_pdl_wait();
    /* only now may the next kernel start: k_moe_gate_up1's shared-expert
     * blocks read x without waiting for this kernel (x is final once this
     * kernel's wait has returned) */
    cu_pdl_launch_dependents();
    for (int k = threadIdx.x; k < a.T * H4; k += THREADS)
        __pipeline_memcpy_async((float4 *)hn + k, (const float4 *)a.x + k, sizeof(float4));
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
    for (int t = 0; t < a.T; t++) {
        float *xr = hn + (size_t)t * a.H;
        const float inv = cu_block_inv_rms<THREADS>(xr, a.H, a.eps, part); /* ends after a barrier */
        for (int k = threadIdx.x; k < H4; k += THREADS) {
            float4 v = ((float4 *)xr)[k];
            const float4 w = ((const float4 *)nw)[k];
            v.x = v.x * inv * w.x; /* norm.cu's arithmetic */
            v.y = v.y * inv * w.y;
            v.z = v.z * inv * w.z;
            v.w = v.w * inv * w.w;
            ((float4 *)xr)[k] = v;
            if (blockIdx.x == 0)
                ((float4 *)(a.h + (size_t)t * a.H))[k] = v;
        }
        __syncthreads(); /* part is reused by the next row; hn complete */
    }
}

/* out[t · ld] = hn[t] · router[e] for the T rows, k_gemv's order of sums; one warp. */
template <typename WT>
__device__ static void gate_logit(const moe_gate_args &a, const float *hn, int e, int lane, float *out, int ld) {
    const WT *wr = (const WT *)a.router + (size_t)e * a.H;
    float acc[GATE_MAX_ROWS];
#pragma unroll
    for (int t = 0; t < GATE_MAX_ROWS; t++)
        acc[t] = 0.0f;
    const int K8 = a.H / 8;
#pragma unroll 8
    for (int k8 = lane; k8 < K8; k8 += 32) {
        gv_w8<WT> wv;
        wv.load(wr, k8);
#pragma unroll
        for (int t = 0; t < GATE_MAX_ROWS; t++)
            if (t < a.T) {
                const float4 *hr = (const float4 *)(hn + (size_t)t * a.H);
                acc[t] += wv.dot(hr[2 * k8], hr[2 * k8 + 1]);
            }
    }
#pragma unroll
    for (int t = 0; t < GATE_MAX_ROWS; t++) {
        const float v = cu_warp_sum(acc[t]);
        if (lane == 0 && t < a.T)
            out[(size_t)t * ld] = v;
    }
}

/* The n <= 32 pairs' plan (plan_block's output) by one warp and the
 * block's threads, without plan_block's serial pass over the experts: the
 * ids sit one a lane and each lane learns by shuffles how many pairs sort
 * before its own (by expert, then pair index) and, for the first pair of
 * each expert, how many experts with pairs come before it. */
__device__ static void plan_small(int n, int top_k, int E, int S, int rows, const int32_t *ids, int *off, int *tok,
                                  int *pair, int *list, int nthreads) {
    const int G = min(E, n);
    int n_valid = 0;
    for (int i = 0; i < n; i++)
        n_valid += (unsigned)ids[i] < (unsigned)E;
    for (int e = threadIdx.x; e <= E + S; e += nthreads) {
        if (e <= E) {
            int k = 0;
            for (int i = 0; i < n; i++)
                k += (unsigned)ids[i] < (unsigned)e; /* valid ids below e */
            off[e] = k;
        } else {
            off[e] = n_valid + (e - E) * rows;
        }
    }
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int id = lane < n ? ids[lane] : -1;
        const bool valid = (unsigned)id < (unsigned)E;
        int less = 0, same_before = 0;
        for (int j = 0; j < n; j++) {
            const int o = __shfl_sync(0xffffffffu, id, j);
            less += (unsigned)o < (unsigned)id && valid; /* o valid and below id */
            same_before += o == id && j < lane;
        }
        const bool first = valid && same_before == 0;
        int rank = 0;
        for (int j = 0; j < n; j++) {
            const int o = __shfl_sync(0xffffffffu, id, j);
            const bool fo = __shfl_sync(0xffffffffu, first, j);
            rank += fo && o < id;
        }
        const int n_experts_used = __popc(__ballot_sync(0xffffffffu, first));
        if (valid) {
            tok[less + same_before] = lane / top_k;
            pair[less + same_before] = lane;
        }
        if (first)
            list[rank] = id;
        for (int r = n_experts_used + lane; r < G; r += 32)
            list[r] = -1;
        for (int g = lane; g < S; g += 32)
            list[G + g] = E + g;
        for (int q = lane; q < S * rows; q += 32) {
            tok[n_valid + q] = q % rows;
            pair[n_valid + q] = n + q; /* its rows of act and y follow the routed pairs' */
        }
    }
}

/* The routing block's work: rows routed one a warp (route_row) from the
 * logits lg [T, E] in shared memory, ids and weights to global memory, then
 * the plan. rs: shared words after lg (gate_smem_words). */
template <int THREADS>
__device__ static void gate_route_plan(const moe_gate_args &a, const float *lg, float *rs) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = a.T * a.top_k, rw = 3 * a.E + 2 * a.G + a.top_k;
    int32_t *sid = (int32_t *)(rs + (size_t)a.T * rw);
    float *sw = (float *)(sid + n);
    int *cnt = (int *)(sw + n);
    if (warp < a.T)
        route_row(a.E, a.G, a.topk_group, a.top_k, a.scoring, a.method, a.norm_topk, a.scaling, a.bias,
                  lg + (size_t)warp * a.E, rs + (size_t)warp * rw, sid + warp * a.top_k, sw + warp * a.top_k, lane);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += THREADS) {
        a.ids[i] = sid[i];
        a.weights[i] = sw[i];
    }
    if (n <= 32)
        plan_small(n, a.top_k, a.E, a.S, a.T, sid, a.off, a.tok, a.pair, a.list, THREADS);
    else
        plan_block(n, a.top_k, a.E, a.S, a.T, sid, a.off, a.tok, a.pair, a.list, cnt, THREADS);
}

/* Block b computes the logits of experts 4b .. 4b + 3 (a warp each) into
 * global memory, and (unless logits_only) the last block to finish (a
 * ticket) routes and plans;
 * every block's logits are visible to it, each having fenced its writes
 * before taking its ticket. (One block doing all of it for V2-Lite's 256 KB
 * router was slower: 31.6 us against 26, an SM alone reads the router
 * slowly.) */
template <typename WT>
static __global__ void __launch_bounds__(GATE_THREADS) k_moe_gate(moe_gate_args a) {
    extern __shared__ float4 smem4[];
    float *hn = (float *)smem4; /* [T, H] normed rows */
    __shared__ double part[GATE_THREADS / 32];
    __shared__ int last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = blockIdx.x * (GATE_THREADS / 32) + warp;
    /* the router's rows depend on nothing before: at one row of bf16 with
     * H <= 2048 (PD_GEMV_PRE) the warp's row into registers while the
     * kernel before runs (the same sums as gate_logit), else into L2 */
    constexpr bool BF = std::is_same<WT, __nv_bfloat16>::value;
    const bool pre = BF && a.pre && a.T == 1 && a.H % 8 == 0 && a.H <= 256 * GATE_PRE_KC;
    gv_w8<__nv_bfloat16> wp[GATE_PRE_KC];
    if constexpr (BF) {
        if (pre && e < a.E)
#pragma unroll
            for (int c = 0; c < GATE_PRE_KC; c++)
                if (lane + 32 * c < a.H / 8)
                    wp[c].load((const __nv_bfloat16 *)a.router + (size_t)e * a.H, lane + 32 * c);
    }
    if (!pre && lane == 0 && e < a.E)
        cu_prefetch_l2((const WT *)a.router + (size_t)e * a.H, (unsigned)(a.H * sizeof(WT)));
    gate_norm<GATE_THREADS>(a, hn, part);
    if (pre && e < a.E) {
        float acc = 0.0f;
#pragma unroll
        for (int c = 0; c < GATE_PRE_KC; c++) {
            const int k8 = lane + 32 * c;
            if (k8 < a.H / 8)
                acc += wp[c].dot(((const float4 *)hn)[2 * k8], ((const float4 *)hn)[2 * k8 + 1]);
        }
        acc = cu_warp_sum(acc);
        if (lane == 0)
            a.logits[e] = acc;
    } else if (e < a.E)
        gate_logit<WT>(a, hn, e, lane, a.logits + e, a.E);
    if (a.logits_only)
        return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        last = atomicAdd(a.ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    float *lg = hn; /* hn is no longer read */
    for (int i = threadIdx.x; i < a.T * a.E; i += GATE_THREADS)
        lg[i] = __ldcg(a.logits + i); /* from L2: other blocks wrote them */
    __syncthreads();
    gate_route_plan<GATE_THREADS>(a, lg, lg + (size_t)a.T * a.E);
    if (threadIdx.x == 0)
        *a.ticket = 0; /* for the next launch (graph replays included) */
}

/* One row (a batch-1 decode step): the grouped gate_up GEMV routes for
 * itself instead of waiting for k_moe_gate's last block to route and plan
 * (a fence, a ticket and a serial tail on one SM: most of that kernel's
 * ~20 us). Every block's first warp routes the row from the logits
 * k_moe_gate wrote (route_row, the same arithmetic in every block). The
 * grid is one-dimensional: block b computes output rows 8 R x .. 8 R x +
 * 8 R - 1 (x = b % nx, nx = ceil(N / 8 R); R rows a warp) of group
 * gy = b / nx, which is, for gy < top_k, the gy-th smallest chosen expert
 * (the plan's order) and its pair, and for gy >= top_k shared group
 * gy - top_k. With shared_first the grid's first S nx blocks are the
 * shared groups instead (gy = b / nx - S for the routed ones): they need no
 * route, so their weights stream during the other blocks' routing, and
 * they are in the first wave of blocks (31.1 us for V2-Lite's layer
 * against 37.8). R = 4 (PD_MOE1_ROWS) makes V2-Lite's 8 groups 352 blocks,
 * all resident at once, against 704 in 1.3 waves at R = 2 (docs/
 * benchmarks.md, session 11). The
 * first routed block also writes ids, weights and the plan (plan_small)
 * that the down GEMV and the combine read. Needs E <= GU1_MAX_E, G <=
 * GU1_MAX_G, top_k <= 32. */
#define GU1_MAX_E 256
#define GU1_MAX_G 64
typedef struct {
    const float *logits; /* [E] */
    int E, G, topk_group, top_k, scoring, method, norm_topk, S, N, K;
    float scaling;
    const float *bias;
    int32_t *ids;
    float *weights;
    int *off, *tok, *pair, *list;
    const void *const *w; /* the set's gate_up table [E + S] */
    const int *gldw, *gupo;
    const float *h;
    float *act;
    int shared_first; /* blockIdx.y < S: the shared groups, which stream without waiting for the route */
    /* launched by PDL during k_moe_gate: the shared groups' blocks norm x
     * themselves (x, norm, eps; dynamic shared memory of 2 H floats) instead
     * of reading the h that k_moe_gate writes, and the routed blocks wait */
    int self_norm;
    const float *x, *norm;
    float eps;
    unsigned *sdone; /* NULL, or counts the shared groups' finished blocks (k_moe_down1 waits on it) */
    /* og (launched by PDL during k_oproj_route, no gate kernel): the
     * router's unnormed logits W_r · (norm ⊙ x) [E] that k_oproj_route
     * wrote; x is then its x + W_o · o (moe_block's mo). Every block waits
     * for that kernel and norms x itself; the routed ones scale raw by the
     * norm's 1 / rms. The first routed block writes logits and h. */
    const float *og_raw;
    float *logits_out, *h_out;
} moe_gu1_args;

/* ---- one row: the output projection and the router's logits (og) -----
 *
 * The router's logits are linear in x up to the norm's scale:
 *   logits = W_r · (g ⊙ x' · inv) = inv · (W_rg · x + W_ro · o),
 * x' = x + W_o · o (the attention's output projection and its residual
 * add), inv = 1 / rms(x'), W_rg = W_r · diag(g) [E, H] and
 * W_ro = W_rg · W_o [E, P] (transformers DeepseekV2MoEGate: the gate's
 * linear layer on post_attention_layernorm's output). So the unnormed
 * logits need only x and o, both final when the output projection starts:
 * k_oproj_route computes them in its own blocks beside the projection's,
 * and no gate kernel (3.2 us a layer after o_proj, docs/benchmarks.md
 * session 14) stands between the projection and the experts; the experts'
 * blocks scale by inv, which their norm of x' computes anyway. W_rg and
 * W_ro are kept in fp32 ([E, H + P] a layer, router_fold) so that the
 * route is the gate kernel's up to the order of fp32 sums. */
#define OR_KC 8  /* W_o's rows in registers: P <= 256 · OR_KC (gemm.cu's GV_PRE_KC) */
#define OR_P4 16 /* W_ro's row in registers: P <= 128 · OR_P4 */
typedef struct {
    int N, P, E, nrb;             /* N = hidden, P = o_proj's cols; nrb router blocks first in the grid */
    const __nv_bfloat16 *wo;      /* W_o [N, P] */
    const float *in;              /* o [P] */
    const float *x;               /* [N], the layer's x (not written) */
    float *x2;                    /* [N] = x + W_o · o */
    const float *fold;            /* [E, N + P]: W_rg | W_ro */
    float *raw;                   /* [E] */
} oproj_route_args;

static __global__ void __launch_bounds__(GV_WARPS * 32) k_oproj_route(oproj_route_args a) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    MOE_PROBE(0, blockIdx.x, 0);
    if ((int)blockIdx.x >= a.nrb) { /* the output projection: k_gemv_pre's GEMV, into x2 */
        gemv_pre<__nv_bfloat16, 2, OR_KC> p;
        p.load((int)blockIdx.x - a.nrb, a.wo, (size_t)a.P, a.N, a.P);
        cu_pdl_wait();
        MOE_PROBE(0, blockIdx.x, 1);
        cu_pdl_launch_dependents(); /* after the wait (k_gemv_pre) */
        p.template run<false, 1>(a.N, a.P, 1, a.in, a.P, a.x2, a.N, 0);
        __syncwarp();
        if (lane < 2 && p.n0 + lane < a.N) /* x2 = x + W_o · o for the warp's two rows (written by lane 0) */
            a.x2[p.n0 + lane] += a.x[p.n0 + lane];
        MOE_PROBE_SYNC(0, blockIdx.x, 2);
        return;
    }
    /* a router row a warp: W_rg · x before the wait (x is the layer's, final
     * once this kernel runs), W_ro's row in registers, W_ro · o after it */
    const int e = (int)blockIdx.x * GV_WARPS + warp;
    float sa = 0.0f;
    float4 wr[OR_P4];
    if (e < a.E) {
        const float *row = a.fold + (size_t)e * (a.N + a.P);
        const float4 *r4 = (const float4 *)row, *x4 = (const float4 *)a.x;
        for (int k = lane; k < a.N / 4; k += 32) {
            const float4 w = __ldg(r4 + k), v = __ldg(x4 + k);
            sa = fmaf(w.x, v.x, sa);
            sa = fmaf(w.y, v.y, sa);
            sa = fmaf(w.z, v.z, sa);
            sa = fmaf(w.w, v.w, sa);
        }
        const float4 *o4 = (const float4 *)(row + a.N);
#pragma unroll
        for (int c = 0; c < OR_P4; c++) {
            const int k = lane + 32 * c;
            wr[c] = k < a.P / 4 ? __ldg(o4 + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    cu_pdl_wait();
    MOE_PROBE(0, blockIdx.x, 1);
    cu_pdl_launch_dependents();
    if (e >= a.E)
        return;
    float sb = 0.0f;
    const float4 *v4 = (const float4 *)a.in;
#pragma unroll
    for (int c = 0; c < OR_P4; c++) {
        const int k = lane + 32 * c;
        if (k < a.P / 4) {
            const float4 v = __ldg(v4 + k);
            sb = fmaf(wr[c].x, v.x, sb);
            sb = fmaf(wr[c].y, v.y, sb);
            sb = fmaf(wr[c].z, v.z, sb);
            sb = fmaf(wr[c].w, v.w, sb);
        }
    }
    sa = cu_warp_sum(sa);
    sb = cu_warp_sum(sb);
    if (lane == 0)
        a.raw[e] = sa + sb;
    MOE_PROBE(0, blockIdx.x, 2); /* warp 0's end (the other warps may have left) */
}

/* fold [E, H + P]: W_rg[e][j] = router[e][j] · norm[j], W_ro[e][p] =
 * Σ_j W_rg[e][j] · W_o[j][p] (double sums). Grid (columns / 256, E). */
template <typename WT>
static __global__ void k_router_fold(int E, int H, int P, const WT *__restrict__ router, const float *__restrict__ norm,
                                     const __nv_bfloat16 *__restrict__ wo, float *__restrict__ fold) {
    extern __shared__ float rg[]; /* [H] */
    const int e = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    for (int j = threadIdx.x; j < H; j += blockDim.x)
        rg[j] = cu_ldw(router, (size_t)e * H + j) * norm[j];
    __syncthreads();
    float *out = fold + (size_t)e * (H + P);
    if (c < H) {
        out[c] = rg[c];
    } else if (c < H + P) {
        const int p = c - H;
        double s = 0.0;
        for (int j = 0; j < H; j++)
            s += (double)rg[j] * (double)__bfloat162float(wo[(size_t)j * P + p]);
        out[c] = (float)s;
    }
}

/* h = RMSNorm(x) · norm into hs (shared, K floats; nw K more), x and the
 * norm's weights through L1 (__ldg: the blocks on an SM share one read of
 * the same 16 KB from L2), gate_norm's arithmetic. Ends after a barrier;
 * returns inv. */
__device__ static float gu1_norm(const moe_gu1_args &a, float *hs, float *nw, double *part) {
    for (int k = threadIdx.x; k < a.K / 4; k += GV_WARPS * 32) {
        ((float4 *)nw)[k] = __ldg((const float4 *)a.norm + k);
        ((float4 *)hs)[k] = __ldg((const float4 *)a.x + k);
    }
    __syncthreads();
    const float inv = cu_block_inv_rms<GV_WARPS * 32>(hs, a.K, a.eps, part); /* ends after a barrier */
    for (int k = threadIdx.x; k < a.K / 4; k += GV_WARPS * 32) {
        float4 v = ((float4 *)hs)[k];
        const float4 g = ((const float4 *)nw)[k];
        v.x = v.x * inv * g.x;
        v.y = v.y * inv * g.y;
        v.z = v.z * inv * g.z;
        v.w = v.w * inv * g.w;
        ((float4 *)hs)[k] = v;
    }
    __syncthreads();
    return inv;
}

/* The gate_up GEMV of block bx's GV_WARPS · R rows. With PR < R it runs
 * as R / PR passes of PR rows a warp: pass t is gemv_block's block
 * (R / PR) bx + t, so warp w takes rows w PR + t GV_WARPS PR .. of the
 * block's. A pass of one row (a gate row and its up row) needs 64
 * registers where R = 4 in one pass needed 80 and kept ~3 of its 8 rows'
 * loads in flight: six experts' gate_up alone took 18.4 µs against 23.3
 * (bench_moe_stream, docs/benchmarks.md session 17). Each row's sum is
 * gemv_block's, so the numbers do not change. */
template <typename WT, int R, int PR, bool XS>
__device__ __forceinline__ void gu1_gemv(int bx, const WT *__restrict__ W, size_t ldw, size_t upo, int N, int K,
                                         const int *xrow, const int *yrow, const float *x, float *act) {
    static_assert(R % PR == 0, "whole passes");
#pragma unroll 1
    for (int t = 0; t < R / PR; t++)
        gemv_block<true, WT, PR, 1, XS>(bx * (R / PR) + t, W, ldw, upo, N, K, 0, 1, xrow, yrow, x, K, act, N, 0);
}

template <typename WT, int R, int PR>
static __global__ void __launch_bounds__(GV_WARPS * 32) k_moe_gate_up1(moe_gu1_args a) {
    __shared__ float rs[3 * GU1_MAX_E + 2 * GU1_MAX_G + 32];
    __shared__ float lgs[GU1_MAX_E], bss[GU1_MAX_E];
    __shared__ int32_t sid[32];
    __shared__ float sw[32];
    __shared__ int order[32], prow[1], xrow0[1];
    cu_pdl_launch_dependents();
    MOE_PROBE(1, blockIdx.x, 0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    /* block b: group b / nx (the shared groups first with shared_first), its rows' block b % nx */
    const int nx = (a.N + GV_WARPS * R - 1) / (GV_WARPS * R), by = (int)blockIdx.x / nx, bx = (int)blockIdx.x % nx;
    if (a.shared_first && by < a.S) {
        /* a shared group needs no route: its weights start streaming at once
         * (the grid's first blocks, so they are in the first wave too) */
        const int sg = by;
        if (threadIdx.x == 0) {
            prow[0] = a.top_k + sg; /* act rows of the shared groups follow the routed pairs' */
            xrow0[0] = 0;
        }
        const WT *W = (const WT *)a.w[a.E + sg];
        const size_t ldw = (size_t)a.gldw[a.E + sg], upo = (size_t)a.gupo[a.E + sg];
        /* with self_norm k_moe_gate may still run: h = RMSNorm(x) · norm here (gate_norm's arithmetic) */
        if (a.self_norm) {
            extern __shared__ float4 gu1_smem4[];
            float *hs = (float *)gu1_smem4, *nw = hs + a.K;
            __shared__ double part[GV_WARPS];
            if (a.og_raw) /* og: x is final once k_oproj_route has ended */
                cu_pdl_wait();
            MOE_PROBE(1, blockIdx.x, 1);
            gu1_norm(a, hs, nw, part);
            MOE_PROBE(1, blockIdx.x, 2);
            MOE_PROBE(1, blockIdx.x, 3);
            gu1_gemv<WT, R, PR, true>(bx, W, ldw, upo, a.N, a.K, NULL, prow, hs, a.act);
            MOE_PROBE_SYNC(1, blockIdx.x, 4);
        } else {
            __syncthreads();
            gu1_gemv<WT, R, PR, false>(bx, W, ldw, upo, a.N, a.K, xrow0, prow, a.h, a.act);
        }
        if (a.sdone) { /* publish the act rows: every writer fences, then one count */
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0)
                atomicAdd(a.sdone, 1u);
        }
        return;
    }
    cu_pdl_wait(); /* the logits (launched by PDL: k_moe_gate may still run), or og's raw logits */
    MOE_PROBE(1, blockIdx.x, 1);
    const int gy = a.shared_first ? by - a.S : by;
    extern __shared__ float4 gu1_smem4[];
    float *hs = (float *)gu1_smem4; /* og: the normed row */
    if (a.og_raw) {
        __shared__ double opart[GV_WARPS];
        for (int e = threadIdx.x; e < a.E; e += GV_WARPS * 32) {
            lgs[e] = a.og_raw[e];
            bss[e] = a.bias ? a.bias[e] : 0.0f;
        }
        const float inv = gu1_norm(a, hs, hs + a.K, opart); /* ends after a barrier */
        MOE_PROBE(1, blockIdx.x, 2);
        for (int e = threadIdx.x; e < a.E; e += GV_WARPS * 32)
            lgs[e] *= inv;
        if (bx == 0 && gy == 0) { /* moe_block's h and logits */
            for (int k = threadIdx.x; k < a.K / 4; k += GV_WARPS * 32)
                ((float4 *)a.h_out)[k] = ((const float4 *)hs)[k];
            for (int e = threadIdx.x; e < a.E; e += GV_WARPS * 32)
                a.logits_out[e] = lgs[e];
        }
    } else {
        /* the logits and the bias into shared memory first, every load at once:
         * route_row reads them several times, ~0.5 us a pass from L2 */
        for (int e = threadIdx.x; e < a.E; e += GV_WARPS * 32) {
            lgs[e] = a.logits[e];
            bss[e] = a.bias ? a.bias[e] : 0.0f;
        }
    }
    __syncthreads();
    if (warp == 0)
        route_row(a.E, a.G, a.topk_group, a.top_k, a.scoring, a.method, a.norm_topk, a.scaling, a.bias ? bss : NULL,
                  lgs, rs, sid, sw, lane);
    __syncthreads();
    if (threadIdx.x < a.top_k) { /* the plan's order: by expert id */
        int rank = 0;
        for (int i = 0; i < a.top_k; i++)
            rank += sid[i] < sid[threadIdx.x];
        order[rank] = threadIdx.x;
    }
    if (threadIdx.x == 0)
        xrow0[0] = 0;
    __syncthreads();
    const int p = gy < a.top_k ? order[gy] : gy; /* a shared group s = gy - top_k: act row top_k + s */
    const int g = gy < a.top_k ? sid[p] : a.E + (gy - a.top_k);
    if (threadIdx.x == 0)
        prow[0] = p;
    if (bx == 0 && gy == 0) { /* the first routed block */
        for (int i = threadIdx.x; i < a.top_k; i += GV_WARPS * 32) {
            a.ids[i] = sid[i];
            a.weights[i] = sw[i];
        }
        plan_small(a.top_k, a.top_k, a.E, a.S, 1, sid, a.off, a.tok, a.pair, a.list, GV_WARPS * 32);
    }
    __syncthreads();
    MOE_PROBE(1, blockIdx.x, 3);
    if (a.og_raw)
        gu1_gemv<WT, R, PR, true>(bx, (const WT *)a.w[g], (size_t)a.gldw[g], (size_t)a.gupo[g], a.N, a.K, NULL, prow,
                                  hs, a.act);
    else
        gu1_gemv<WT, R, PR, false>(bx, (const WT *)a.w[g], (size_t)a.gldw[g], (size_t)a.gupo[g], a.N, a.K, xrow0,
                                   prow, a.h, a.act);
    MOE_PROBE_SYNC(1, blockIdx.x, 4);
}

/* One row's grouped down GEMV, launched by PDL while k_moe_gate_up1 runs:
 * block (x, gy) computes output rows 8 R x .. 8 R x + 8 R - 1 of y row p with
 * down_g, for gy < S the shared group g = E + gy (p = top_k + gy), else
 * pair p = gy - S and its expert ids[p]. A shared group's blocks start as
 * soon as k_moe_gate_up1's shared blocks have all counted themselves in
 * sdone (need = their number; spinning: those blocks are the first of that
 * grid, which had started entirely before this one could launch), reading
 * their act row through L2 into shared memory; they stream while the routed
 * experts' gate_up still runs. The routed blocks wait for the whole of
 * k_moe_gate_up1 (cu_pdl_wait). The same GEMV (gemv_block) as the grouped
 * down launch: the same numbers. Dynamic shared memory: I floats. */
typedef struct {
    int E, S, top_k, H, I;
    unsigned need;
    const unsigned *sdone;
    const int32_t *ids;
    const void *const *w; /* the set's down table [E + S] */
    const int *ldw;
    const float *act;
    float *y;
} moe_dn1_args;

template <typename WT, int R> static __global__ void __launch_bounds__(GV_WARPS * 32) k_moe_down1(moe_dn1_args a) {
    extern __shared__ float4 dn1_smem4[];
    cu_pdl_launch_dependents();
    const int gy = blockIdx.y;
    MOE_PROBE(2, blockIdx.y * gridDim.x + blockIdx.x, 0);
    if (gy < a.S) {
        const int g = a.E + gy, p = a.top_k + gy;
        if (threadIdx.x == 0) {
            while (*(volatile const unsigned *)a.sdone < a.need)
                __nanosleep(64);
            __threadfence();
        }
        __syncthreads();
        MOE_PROBE(2, blockIdx.y * gridDim.x + blockIdx.x, 1);
        float *as = (float *)dn1_smem4;
        const float4 *src = (const float4 *)(a.act + (size_t)p * a.I);
        for (int k = threadIdx.x; k < a.I / 4; k += GV_WARPS * 32)
            ((float4 *)as)[k] = __ldcg(src + k);
        __syncthreads();
        gemv_block<false, WT, R, 1, true>((int)blockIdx.x, (const WT *)a.w[g], (size_t)a.ldw[g], 0, a.H, a.I, 0, 1,
                                          NULL, NULL, as, a.I, a.y + (size_t)p * a.H, a.H, 0);
        MOE_PROBE_SYNC(2, blockIdx.y * gridDim.x + blockIdx.x, 2);
        return;
    }
    cu_pdl_wait();
    MOE_PROBE(2, blockIdx.y * gridDim.x + blockIdx.x, 1);
    const int p = gy - a.S, g = a.ids[p];
    gemv_block<false, WT, R, 1>((int)blockIdx.x, (const WT *)a.w[g], (size_t)a.ldw[g], 0, a.H, a.I, 0, 1, NULL, NULL,
                                a.act + (size_t)p * a.I, a.I, a.y + (size_t)p * a.H, a.H, 0);
    MOE_PROBE_SYNC(2, blockIdx.y * gridDim.x + blockIdx.x, 2);
}

/* k_moe_down1 with the combine in it (og, one row): x = mo + the MoE's
 * output without a combine launch. A block of NW = top_k warps (blockDim,
 * 2 .. 8) is either
 * - a shared group's block (the first S · nxs blocks, nxs = ceil(H / (NW R))
 *   a group): as k_moe_down1's, it waits on sdone for k_moe_gate_up1's
 *   shared blocks (need of them), writes its rows of the group's y row
 *   (ysh [S, H]), fences and counts itself in sdone too; or
 * - a routed block: R output rows r0 .. r0 + R - 1 for every pair at once,
 *   warp j the rows of pair j (expert ids[j], act row j). It waits for the
 *   whole of k_moe_gate_up1 (cu_pdl_wait) and, past its GEMV, for every
 *   shared block (sdone = need + S · nxs), then adds its rows as
 *   k_moe_combine_pairs does, in the same order: acc = Σ_j fmaf(w_j, y_j,
 *   acc), then + each shared group's y, x = mo + acc. The same numbers as
 *   k_moe_down1 then the combine.
 * The shared blocks come first in the grid, so they are placed before any
 * routed block that waits on them. Each routed block counts itself in
 * sdone once it has seen the shared blocks' count; the last one sets it
 * back to 0 for the next launch (no block reads it after that). Dynamic
 * shared memory: I floats (a shared block's act row). */
#define DN1C_MAX_NW 8
typedef struct {
    int E, S, top_k, H, I, nxs;
    unsigned need;
    unsigned *sdone;
    const int32_t *ids;
    const float *weights;
    const void *const *w; /* the set's down table [E + S] */
    const int *ldw;
    const float *act;
    float *ysh;       /* [S, H] */
    const float *xin; /* mo: x + W_o · o */
    float *out;       /* x */
} moe_dn1c_args;

template <typename WT, int R>
static __global__ void __launch_bounds__(DN1C_MAX_NW * 32) k_moe_down1c(moe_dn1c_args a) {
    extern __shared__ float4 dn1c_smem4[];
    __shared__ float red[DN1C_MAX_NW][R];
    cu_pdl_launch_dependents();
    const int NW = (int)(blockDim.x >> 5), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = (int)blockIdx.x, nsh = a.S * a.nxs;
    MOE_PROBE(2, b, 0);
    if (b < nsh) {
        const int gs = b / a.nxs, bx = b - gs * a.nxs, g = a.E + gs, p = a.top_k + gs;
        const int n0 = (bx * NW + warp) * R;
        if (threadIdx.x == 0)
            while (cu_ld_acquire(a.sdone) < a.need)
                __nanosleep(64);
        __syncthreads();
        MOE_PROBE(2, b, 1);
        float *as = (float *)dn1c_smem4;
        const float4 *src = (const float4 *)(a.act + (size_t)p * a.I);
        for (int k = threadIdx.x; k < a.I / 4; k += blockDim.x)
            ((float4 *)as)[k] = __ldcg(src + k);
        __syncthreads();
        if (n0 < a.H) {
            float acc[R];
            gemv_warp_rows<WT, R, true>((const WT *)a.w[g], (size_t)a.ldw[g], n0, a.H, a.I, as, acc);
            if (lane == 0)
#pragma unroll
                for (int r = 0; r < R; r++)
                    if (n0 + r < a.H)
                        a.ysh[(size_t)gs * a.H + n0 + r] = acc[r];
        }
        __threadfence(); /* publish the rows: every writer fences, then one count */
        __syncthreads();
        if (threadIdx.x == 0)
            atomicAdd(a.sdone, 1u);
        MOE_PROBE(2, b, 2);
        return;
    }
    const int r0 = (b - nsh) * R, t = threadIdx.x, d = r0 + t;
    cu_pdl_wait(); /* ids, weights and the routed act rows: k_moe_gate_up1 has ended */
    MOE_PROBE(2, b, 1);
    /* the sum's other inputs, loaded now: in flight during the GEMV */
    float wt[DN1C_MAX_NW], xo = 0.0f;
    const bool adder = t < R && d < a.H;
    if (adder) {
        xo = a.xin[d];
#pragma unroll
        for (int j = 0; j < DN1C_MAX_NW; j++)
            wt[j] = j < a.top_k ? a.weights[j] : 0.0f;
    }
    {
        const int g = a.ids[warp];
        float acc[R];
        gemv_warp_rows<WT, R, false>((const WT *)a.w[g], (size_t)a.ldw[g], r0, a.H, a.I, a.act + (size_t)warp * a.I,
                                     acc);
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < R; r++)
                red[warp][r] = acc[r];
    }
    MOE_PROBE(2, b, 3); /* warp 0's GEMV ends */
    const unsigned want = a.need + (unsigned)nsh;
    if (threadIdx.x == 0) /* the shared blocks started first: long done */
        while (cu_ld_acquire(a.sdone) < want)
            __nanosleep(32);
    __syncthreads();
    if (threadIdx.x == 32) { /* seen: count this block; the last resets */
        const unsigned last = want + (gridDim.x - (unsigned)nsh) - 1;
        if (atomicAdd(a.sdone, 1u) == last)
            atomicExch(a.sdone, 0u);
    }
    if (adder) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < DN1C_MAX_NW; j++)
            if (j < a.top_k)
                acc = fmaf(wt[j], red[j][t], acc);
        for (int gs = 0; gs < a.S; gs++)
            acc += __ldcg(a.ysh + (size_t)gs * a.H + d);
        a.out[d] = xo + acc;
    }
    MOE_PROBE(2, b, 2);
}

/* Launches of the one-row kernels, one function a variant so that
 * CU_SMEM_OPTIN's per-call-site memory belongs to one kernel. optin: the
 * launch asks for dynamic shared memory (cfg's). */
template <typename WT, int R, int PR = R>
static cudaError_t gu1_launch(const cudaLaunchConfig_t *cfg, const moe_gu1_args &a, bool optin) {
    const cudaError_t e = optin ? CU_SMEM_OPTIN((k_moe_gate_up1<WT, R, PR>), cfg->dynamicSmemBytes) : cudaSuccess;
    return e == cudaSuccess ? cudaLaunchKernelEx(cfg, k_moe_gate_up1<WT, R, PR>, a) : e;
}

/* Dynamic shared memory (at least min bytes) for a grid of blocks that
 * lets no more of them share a SM than filling every SM once needs (cap =
 * ceil(blocks / SMs)): cap + 1 blocks of this much each, with the SM's
 * reserve a block, exceed the SM's shared memory. So the grid spreads over
 * all SMs instead of filling some with more blocks. cap blocks still fit
 * while the kernel's static shared memory is below a third of the rest
 * (k_moe_gate_up1: 6 KB against ~19 KB at cap 3 on an H200). min where
 * that is no more than min or past what a block may ask for. */
static size_t smem_spread(const cu_ctx *c, unsigned blocks, size_t min) {
    const size_t cap = (blocks + (unsigned)c->n_sm - 1) / (unsigned)c->n_sm;
    if (!c->smem_per_sm || c->smem_per_sm / (cap + 1) <= c->smem_reserved)
        return min;
    const size_t s = (c->smem_per_sm / (cap + 1) - c->smem_reserved + 127) & ~(size_t)127;
    return s > min && s <= c->smem_optin ? s : min;
}
template <typename WT, int R> static cudaError_t dn1_launch(const cudaLaunchConfig_t *cfg, const moe_dn1_args &a) {
    const cudaError_t e = CU_SMEM_OPTIN((k_moe_down1<WT, R>), cfg->dynamicSmemBytes);
    return e == cudaSuccess ? cudaLaunchKernelEx(cfg, k_moe_down1<WT, R>, a) : e;
}
template <typename WT, int R> static cudaError_t dn1c_launch(const cudaLaunchConfig_t *cfg, const moe_dn1c_args &a) {
    const cudaError_t e = CU_SMEM_OPTIN((k_moe_down1c<WT, R>), cfg->dynamicSmemBytes);
    return e == cudaSuccess ? cudaLaunchKernelEx(cfg, k_moe_down1c<WT, R>, a) : e;
}

/* A layer's device tables for the grouped GEMMs over its routed experts
 * and S shared groups: pointers of gate_up and down [E + S], the rows'
 * stride and the up rows' offset of gate_up [E + S] and the row stride of
 * down [E + S] (ints), and the gate kernel's ticket. Made on first use,
 * outside graph recording, and checked against the weights on every use. */
struct cu_moe_set {
    const pd_weight *gu_key, *sgu_key;
    int E, S;
    /* og: the router folded with the norm and W_o (router_fold), [E, H + P]
     * then the raw logits [E]; made for these weights */
    float *fold;
    size_t fold_bytes;
    const void *fold_router, *fold_o;
    const float *fold_norm;
    const void **host; /* [2 (E + S)]: the pointers the device table holds */
    void *dev;
    size_t dev_bytes;
};

#ifdef PD_CUDA_PROBE
/* The probe (top of the file): on when PD_MOE_PROBE names a file, the grid layout of the last launch for its reader. */
static int probe_host = -1, probe_gu_shared, probe_dn_shared;
static void moe_probe_enable(int gu_shared, int dn_shared) {
    if (probe_host < 0) {
        probe_host = getenv("PD_MOE_PROBE") != NULL;
        int on = probe_host;
        if (on)
            cudaMemcpyToSymbol(moe_probe_on, &on, sizeof on);
    }
    probe_gu_shared = gu_shared, probe_dn_shared = dn_shared;
}
static void moe_probe_dump(void) {
    if (probe_host != 1)
        return;
    probe_host = 0;
    static unsigned long long h[4][MOE_PROBE_BLOCKS][MOE_PROBE_SLOTS];
    char note[96];
    snprintf(note, sizeof note, "# gate_up_shared_blocks=%d down_shared_blocks=%d\n", probe_gu_shared,
             probe_dn_shared);
    if (cudaMemcpyFromSymbol(h, moe_probe_t, sizeof h) != cudaSuccess)
        fprintf(stderr, "moe probe: cannot read the timestamps\n");
    else
        cu_probe_write("PD_MOE_PROBE", note, &h[0][0][0], 4, MOE_PROBE_BLOCKS, MOE_PROBE_SLOTS);
}

/* cuda_common.cuh's cu_probe_write (here: moe.cu has the first probe). */
void cu_probe_write(const char *env, const char *note, const unsigned long long *t, int n_k, int n_b, int n_slots) {
    FILE *f = fopen(getenv(env), "w");
    if (!f) {
        fprintf(stderr, "probe: cannot write %s (%s)\n", getenv(env), env);
        return;
    }
    fputs(note ? note : "", f);
    fputs("kernel,block", f);
    for (int j = 0; j < n_slots; j++)
        fprintf(f, ",t%d", j);
    fputc('\n', f);
    for (int k = 0; k < n_k; k++)
        for (int b = 0; b < n_b; b++) {
            const unsigned long long *r = t + ((size_t)k * n_b + b) * n_slots;
            if (!r[0])
                continue;
            fprintf(f, "%d,%d", k, b);
            for (int j = 0; j < n_slots; j++)
                fprintf(f, ",%llu", r[j]);
            fputc('\n', f);
        }
    fclose(f);
}
#endif

void cu_moe_sets_free(cu_ctx *c) {
#ifdef PD_CUDA_PROBE
    moe_probe_dump();
#endif
    for (int i = 0; i < c->n_moe_sets; i++) {
        cudaFree(c->moe_sets[i].dev);
        cudaFree(c->moe_sets[i].fold);
        free(c->moe_sets[i].host);
    }
    free(c->moe_sets);
    c->moe_sets = NULL;
    c->n_moe_sets = c->cap_moe_sets = 0;
}

/* The tables' layout in dev: gu ptrs | dn ptrs | gu ldw | gu upo | dn ldw | ticket. */
static const void *const *set_gu(const cu_moe_set *t) {
    return (const void *const *)t->dev;
}
static const void *const *set_dn(const cu_moe_set *t) {
    return (const void *const *)t->dev + (t->E + t->S);
}
static const int *set_ints(const cu_moe_set *t, int k) {
    return (const int *)((const void *const *)t->dev + 2 * (t->E + t->S)) + (size_t)k * (t->E + t->S);
}
static unsigned *set_ticket(const cu_moe_set *t) {
    return (unsigned *)set_ints(t, 3);
}

static cu_moe_set *moe_set_get(cu_ctx *c, const pd_moe_block_args *a, int S) {
    const int E = a->route.n_experts, n = E + S, I = a->inter, H = a->hidden;
    const int Ish = S * I;
    cu_moe_set *t = NULL;
    for (int i = 0; i < c->n_moe_sets; i++)
        if (c->moe_sets[i].gu_key == a->gate_up && c->moe_sets[i].sgu_key == a->shared_gate_up &&
            c->moe_sets[i].E == E && c->moe_sets[i].S == S) {
            t = &c->moe_sets[i];
            break;
        }
    const void *want[2 * (4096 + 64)]; /* moe_block_fits: E <= 4096, S <= 64 */
    if (n > 4096 + 64) {
        cu_fail(c, PD_ERR_INVALID, "moe_block: %d experts and %d shared groups", E, S);
        return NULL;
    }
    for (int e = 0; e < E; e++) {
        want[e] = a->gate_up[e].data;
        want[n + e] = a->down[e].data;
    }
    const size_t esz = c->wfmt == PD_CUDA_WEIGHTS_BF16 ? 2 : 4;
    for (int g = 0; g < S; g++) { /* group g: gate rows g·I.., up rows Ish + g·I.., down columns g·I.. */
        want[E + g] = (const char *)a->shared_gate_up->data + (size_t)g * I * H * esz;
        want[n + E + g] = (const char *)a->shared_down->data + (size_t)g * I * esz;
    }
    if (t) {
        bool same = true;
        for (int i = 0; i < 2 * n && same; i++)
            same = t->host[i] == want[i];
        if (same)
            return t;
    } else {
        if (c->n_moe_sets == c->cap_moe_sets) {
            int cap = c->cap_moe_sets ? 2 * c->cap_moe_sets : 64;
            cu_moe_set *nt = (cu_moe_set *)realloc(c->moe_sets, (size_t)cap * sizeof *nt);
            if (!nt) {
                cu_fail(c, PD_ERR_NOMEM, "moe_block: out of host memory for expert tables");
                return NULL;
            }
            c->moe_sets = nt;
            c->cap_moe_sets = cap;
        }
        t = &c->moe_sets[c->n_moe_sets++];
        memset(t, 0, sizeof *t);
        t->gu_key = a->gate_up;
        t->sgu_key = a->shared_gate_up;
        t->E = E;
        t->S = S;
    }
    if (c->capturing) {
        cu_fail(c, PD_ERR_UNSUPPORTED, "moe_block: expert tables made while recording a graph");
        return NULL;
    }
    const size_t bytes = 2 * (size_t)n * sizeof(void *) + (3 * (size_t)n + 1) * sizeof(int);
    if (!t->host && !(t->host = (const void **)calloc(2 * (size_t)n, sizeof(void *)))) {
        cu_fail(c, PD_ERR_NOMEM, "moe_block: out of host memory for expert tables");
        return NULL;
    }
    if (!t->dev) {
        if (!CU_OK(c, cudaMalloc(&t->dev, bytes)))
            return NULL;
        t->dev_bytes = bytes;
        cu_count_alloc(c, bytes);
    }
    char *stage = (char *)malloc(bytes);
    if (!stage) {
        cu_fail(c, PD_ERR_NOMEM, "moe_block: out of host memory for expert tables");
        return NULL;
    }
    memcpy(stage, want, 2 * (size_t)n * sizeof(void *));
    int *ints = (int *)(stage + 2 * (size_t)n * sizeof(void *));
    for (int g = 0; g < n; g++) {
        const bool sh = g >= E;
        ints[g] = H;                           /* gate_up: rows of H */
        ints[n + g] = sh ? Ish : I;            /* up rows after all the gate rows */
        ints[2 * n + g] = sh ? Ish : I;        /* down: rows of inter (routed) or inter_shared */
    }
    ints[3 * n] = 0; /* the ticket */
    /* the stream is non-blocking: kernels still reading this table (or
     * spinning on its counter) must end before it is rewritten */
    const bool ok = CU_OK(c, cudaStreamSynchronize(c->stream)) &&
                    CU_OK(c, cudaMemcpy(t->dev, stage, bytes, cudaMemcpyHostToDevice));
    free(stage);
    if (!ok)
        return NULL;
    memcpy(t->host, want, 2 * (size_t)n * sizeof(void *));
    return t;
}

/* og: the set's fold of the router with the norm and W_o (k_oproj_route's
 * [E, H + P] fp32, then E floats for the raw logits), made on first use
 * outside graph recording and again when the weights differ; NULL with the
 * error recorded. */
static float *router_fold(cu_ctx *c, cu_moe_set *t, const pd_moe_block_args *a) {
    const int E = a->route.n_experts, H = a->hidden, P = a->o_proj->cols;
    if (t->fold && t->fold_router == a->router->data && t->fold_o == a->o_proj->data && t->fold_norm == a->norm)
        return t->fold;
    if (c->capturing) {
        cu_fail(c, PD_ERR_UNSUPPORTED, "moe_block: the router's fold made while recording a graph");
        return NULL;
    }
    const size_t bytes = ((size_t)E * (H + P) + E) * sizeof(float);
    if (t->fold && t->fold_bytes != bytes) {
        cudaFree(t->fold);
        t->fold = NULL;
    }
    if (!t->fold) {
        if (!CU_OK(c, cudaMalloc(&t->fold, bytes)))
            return NULL;
        t->fold_bytes = bytes;
        cu_count_alloc(c, bytes);
    }
    const dim3 grid((unsigned)((H + P + 255) / 256), (unsigned)E);
    if (c->wfmt == PD_CUDA_WEIGHTS_BF16)
        k_router_fold<<<grid, 256, (size_t)H * sizeof(float), c->stream>>>(
            E, H, P, (const __nv_bfloat16 *)a->router->data, a->norm, (const __nv_bfloat16 *)a->o_proj->data, t->fold);
    else
        k_router_fold<<<grid, 256, (size_t)H * sizeof(float), c->stream>>>(
            E, H, P, (const float *)a->router->data, a->norm, (const __nv_bfloat16 *)a->o_proj->data, t->fold);
    if (!CU_OK(c, cudaGetLastError()) || !CU_OK(c, cudaStreamSynchronize(c->stream)))
        return NULL;
    t->fold_router = a->router->data;
    t->fold_o = a->o_proj->data;
    t->fold_norm = a->norm;
    return t->fold;
}

/* Whether the weights' shapes agree with hidden, inter and n_experts (a
 * router [E, H], experts' gate_up [2I, H] and down [H, I], shared gate_up
 * [2 Ish, H] and down [H, Ish] with Ish > 0) and every weight has data;
 * false with the error recorded otherwise. The arguments' other fields
 * were checked before. */
static bool moe_block_shapes_ok(cu_ctx *c, const pd_moe_block_args *a) {
    const int E = a->route.n_experts, I = a->inter, H = a->hidden;
    if (!a->router->data || a->router->rows != E || a->router->cols != H) {
        cu_fail(c, PD_ERR_INVALID, "moe_block: router [%d, %d]%s; want [%d, %d]", a->router->rows, a->router->cols,
                a->router->data ? "" : " without data", E, H);
        return false;
    }
    if (a->shared_gate_up) {
        const pd_weight *sg = a->shared_gate_up, *sd = a->shared_down;
        const int Ish = sg->rows / 2;
        if (!sg->data || !sd->data || sg->rows <= 0 || sg->rows % 2 || sg->cols != H || sd->rows != H ||
            sd->cols != Ish) {
            cu_fail(c, PD_ERR_INVALID,
                    "moe_block: shared experts' gate_up [%d, %d], down [%d, %d]%s; want [2 Ish, %d], [%d, Ish], Ish > 0",
                    sg->rows, sg->cols, sd->rows, sd->cols, sg->data && sd->data ? "" : " without data", H, H);
            return false;
        }
    }
    for (int e = 0; e < E; e++)
        if (a->gate_up[e].rows != 2 * I || a->gate_up[e].cols != H || a->down[e].rows != H || a->down[e].cols != I ||
            !a->gate_up[e].data || !a->down[e].data) {
            cu_fail(c, PD_ERR_INVALID,
                    "moe_block: expert %d has gate_up [%d, %d], down [%d, %d]%s; want [%d, %d], [%d, %d]", e,
                    a->gate_up[e].rows, a->gate_up[e].cols, a->down[e].rows, a->down[e].cols,
                    a->gate_up[e].data && a->down[e].data ? "" : " without data", 2 * I, H, H, I);
            return false;
        }
    return true;
}

/* Whether the fused path takes this block (valid arguments:
 * moe_block_shapes_ok); S: the shared groups. */
static bool moe_block_fits(const cu_ctx *c, const pd_moe_block_args *a, int *S_p) {
    const pd_moe_route_params *p = &a->route;
    const int E = p->n_experts, I = a->inter, H = a->hidden, T = a->rows;
    const int G = p->n_group > 0 ? p->n_group : 1;
    const size_t esz = c->wfmt == PD_CUDA_WEIGHTS_BF16 ? 2 : 4;
    if (c->moe_block_composed || c->no_moe_device || c->no_gemv || T > GATE_MAX_ROWS || E > 4096 || I <= 0 ||
        H % 8 || I % 8 || (H * esz) % 16 || (I * esz) % 16 || !cu_gemv_ok(H, a->router->data, a->x, H) ||
        ((uintptr_t)a->h & 15) || ((uintptr_t)a->logits & 15))
        return false;
    int S = 0;
    if (a->shared_gate_up) {
        const int Ish = a->shared_gate_up->rows / 2;
        if (Ish % I || Ish / I > 64 || ((uintptr_t)a->shared_gate_up->data & 15) ||
            ((uintptr_t)a->shared_down->data & 15))
            return false;
        S = Ish / I;
    }
    for (int e = 0; e < E; e++)
        if (((uintptr_t)a->gate_up[e].data & 15) || ((uintptr_t)a->down[e].data & 15))
            return false;
    if (gate_smem_words(T, H, E, G, p->top_k) * 4 > c->smem_optin || ((uintptr_t)a->x & 15) ||
        ((uintptr_t)a->norm & 15) || ((uintptr_t)a->router->data & 15))
        return false;
    *S_p = S;
    return true;
}

bool cu_moe_block(pd_backend *be, const pd_moe_block_args *a) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK)
        return true;
    if (!a) {
        cu_fail(c, PD_ERR_INVALID, "moe_block: no arguments");
        return true;
    }
    if (a->rows == 0)
        return true;
    const pd_moe_route_params *p = &a->route;
    const int E = p->n_experts, G = p->n_group > 0 ? p->n_group : 1;
    const bool grouped = p->topk_method != 0 && G > 1;
    if (a->rows < 0 || a->hidden <= 0 || a->inter <= 0 || !a->x || !a->norm || !a->router || !a->gate_up ||
        !a->down || !a->h || !a->logits || !a->ids || !a->weights || !a->gu || !a->act || !a->mo ||
        (a->shared_gate_up && !a->shared_down) || E <= 0 || E > ROUTE_MAX_EXPERTS || p->top_k <= 0 ||
        p->top_k > E || G > ROUTE_MAX_GROUPS || (grouped && (E % G != 0 || p->topk_group <= 0 || p->topk_group > G)) ||
        p->scoring < 0 || p->scoring > 1 || p->topk_method < 0 || p->topk_method > 2) {
        cu_fail(c, PD_ERR_INVALID, "moe_block: rows %d, hidden %d, inter %d, %d experts, top_k %d, %d groups",
                a->rows, a->hidden, a->inter, E, p->top_k, G);
        return true;
    }
    if (!moe_block_shapes_ok(c, a))
        return true;
    if (a->o_proj && (!a->o_in || !a->o_proj->data || a->o_proj->rows != a->hidden || a->o_proj->cols <= 0)) {
        cu_fail(c, PD_ERR_INVALID, "moe_block: o_proj [%d, %d]%s%s; want [%d, P], P > 0", a->o_proj->rows,
                a->o_proj->cols, a->o_proj->data ? "" : " without data", a->o_in ? "" : " with no o_in", a->hidden);
        return true;
    }
    int S = 0;
    if (!moe_block_fits(c, a, &S))
        return false; /* the caller runs the separate ops (o_proj's too) */
    const int T = a->rows, H = a->hidden, I = a->inter, K = p->top_k, n = T * K;
    const int Gr = n < E ? n : E; /* routed groups that can have pairs */
    cu_moe_set *set = moe_set_get(c, a, S);
    int *plan = (int *)cu_scratch(c, CU_SCR_MOE_IDX, ((size_t)E + S + 1 + 2 * ((size_t)n + S * T) + Gr + S) * sizeof(int));
    float *act = (float *)cu_scratch(c, CU_SCR_MOE_ACT, ((size_t)n + S * T) * I * sizeof(float));
    float *y = (float *)cu_scratch(c, CU_SCR_MOE_Y, ((size_t)n + S * T) * H * sizeof(float));
    if (!set || !plan || !act || !y)
        return true;
    int *off = plan, *tok = off + E + S + 1, *pair = tok + n + S * T, *list = pair + n + S * T;
    moe_gate_args ga = {};
    ga.T = T, ga.H = H, ga.E = E, ga.G = G, ga.topk_group = p->topk_group, ga.top_k = K, ga.scoring = p->scoring;
    ga.method = p->topk_method, ga.norm_topk = p->norm_topk_prob ? 1 : 0, ga.S = S;
    ga.scaling = p->routed_scaling_factor, ga.eps = a->eps;
    ga.bias = p->e_score_correction_bias, ga.x = a->x, ga.norm = a->norm, ga.router = a->router->data;
    ga.h = a->h, ga.logits = a->logits, ga.weights = a->weights, ga.ids = a->ids;
    ga.off = off, ga.tok = tok, ga.pair = pair, ga.list = list, ga.ticket = set_ticket(set);
    /* one row: the gate_up GEMV routes for itself (k_moe_gate_up1) */
    const bool route_in_gu = T == 1 && E <= GU1_MAX_E && G <= GU1_MAX_G && K <= 32 && !c->moe_route_in_gate;
    ga.logits_only = route_in_gu;
    ga.pre = !c->gemv_pre_off;
    /* at one row the gate_up GEMV by PDL (the shared groups' blocks stream
     * during the kernel before, norming x themselves) when their normed row
     * fits in shared memory */
    const size_t usmem = 2 * (size_t)H * sizeof(float);
    const bool gu_pdl = route_in_gu && c->pdl && !c->moe_gu1_plain && !c->moe_shared_last && S > 0 && H % 4 == 0 &&
                        usmem + 8192 <= c->smem_optin;
    /* with o_proj, at one row: k_oproj_route instead of o_proj's GEMV and
     * the gate kernel (og); x + W_o · o then lives in mo until the combine
     * writes x. Else o_proj's GEMV first. */
    const int P = a->o_proj ? a->o_proj->cols : 0, or_nob = (H + GV_WARPS * 2 - 1) / (GV_WARPS * 2);
    const bool og = a->o_proj && gu_pdl && !c->moe_oroute_off && c->wfmt == PD_CUDA_WEIGHTS_BF16 && P % 8 == 0 &&
                    P <= 256 * OR_KC && P <= 128 * OR_P4 && cu_gemv_ok(P, a->o_proj->data, a->o_in, P);
    float *og_raw = NULL;
    cudaError_t e;
    if (og) {
        float *fold = router_fold(c, set, a);
        if (!fold)
            return true;
        og_raw = fold + (size_t)E * (H + P);
        const int nrb = (E + GV_WARPS - 1) / GV_WARPS;
        oproj_route_args oa = {H, P, E, nrb, (const __nv_bfloat16 *)a->o_proj->data, a->o_in, a->x, a->mo, fold, og_raw};
        cudaLaunchAttribute oat;
        cudaLaunchConfig_t ocfg =
            cu_launch_config(dim3((unsigned)(nrb + or_nob)), dim3(GV_WARPS * 32), 0, c->stream, c->pdl, &oat);
        if (!CU_LAUNCHED(c, cudaLaunchKernelEx(&ocfg, k_oproj_route, oa), "moe_block: o_proj with the router"))
            return true;
    } else if (a->o_proj && !cu_gemm_run(c, T, a->o_in, a->o_proj, a->x, true)) {
        return true;
    }
    if (!og) { /* with og no gate kernel: k_oproj_route made the logits */
        const size_t smem = gate_smem_words(T, H, E, G, K) * sizeof(float);
        cudaLaunchAttribute at;
        cudaLaunchConfig_t cfg =
            cu_launch_config(dim3((unsigned)((E + GATE_THREADS / 32 - 1) / (GATE_THREADS / 32))), dim3(GATE_THREADS),
                             smem, c->stream, c->pdl, &at);
        if (c->wfmt == PD_CUDA_WEIGHTS_BF16) {
            e = CU_SMEM_OPTIN(k_moe_gate<__nv_bfloat16>, smem);
            if (e == cudaSuccess)
                e = cudaLaunchKernelEx(&cfg, k_moe_gate<__nv_bfloat16>, ga);
        } else {
            e = CU_SMEM_OPTIN(k_moe_gate<float>, smem);
            if (e == cudaSuccess)
                e = cudaLaunchKernelEx(&cfg, k_moe_gate<float>, ga);
        }
        if (!CU_LAUNCHED(c, e, "moe_block: gate"))
            return true;
    }
    /* act[pair] = silu(gate_g · h[tok]) ⊙ (up_g · h[tok]) over the routed and shared groups */
    bool dn1 = false;
    if (route_in_gu) {
        moe_gu1_args ua = {};
        ua.logits = a->logits, ua.E = E, ua.G = G, ua.topk_group = p->topk_group, ua.top_k = K;
        ua.scoring = p->scoring, ua.method = p->topk_method, ua.norm_topk = p->norm_topk_prob ? 1 : 0, ua.S = S;
        ua.N = I, ua.K = H, ua.scaling = p->routed_scaling_factor, ua.bias = p->e_score_correction_bias;
        ua.ids = a->ids, ua.weights = a->weights, ua.off = off, ua.tok = tok, ua.pair = pair, ua.list = list;
        ua.w = set_gu(set), ua.gldw = set_ints(set, 0), ua.gupo = set_ints(set, 1), ua.h = a->h, ua.act = act;
        ua.shared_first = !c->moe_shared_last;
        ua.self_norm = gu_pdl, ua.x = og ? a->mo : a->x, ua.norm = a->norm, ua.eps = a->eps;
        ua.og_raw = og_raw, ua.logits_out = a->logits, ua.h_out = a->h;
        /* and the down GEMV by PDL during it (k_moe_down1), counting the
         * shared blocks in the set's ticket (unused at one row) */
        dn1 = gu_pdl && !c->moe_down1_off && I % 4 == 0 && (size_t)I * sizeof(float) + 8192 <= c->smem_optin;
        ua.sdone = dn1 ? set_ticket(set) : NULL;
        const int R = c->moe1_rows_gu;
        const dim3 grid((unsigned)(((I + GV_WARPS * R - 1) / (GV_WARPS * R)) * (K + S)));
        cudaLaunchAttribute uat;
        cudaLaunchConfig_t ucfg =
            cu_launch_config(grid, dim3(GV_WARPS * 32), gu_pdl ? usmem : 0, c->stream, gu_pdl, &uat);
        /* bf16 at 4 rows a warp: as 4 passes of one (gu1_gemv) */
        if (c->wfmt == PD_CUDA_WEIGHTS_BF16 && R == 4 && !c->moe_gu1_pass_off) {
            /* spread over every SM: at 64 registers 4 blocks fit a SM where 3 did at 80, and with 4 a SM the
             * step was slower than with one pass (2.20-2.22 ms against 2.11-2.13), with 3 faster (2.07-2.11;
             * docs/benchmarks.md session 17) */
            if (gu_pdl)
                ucfg.dynamicSmemBytes = smem_spread(c, grid.x, usmem);
            e = gu1_launch<__nv_bfloat16, 4, 1>(&ucfg, ua, gu_pdl);
        } else if (c->wfmt == PD_CUDA_WEIGHTS_BF16 && R == 4)
            e = gu1_launch<__nv_bfloat16, 4>(&ucfg, ua, gu_pdl);
        else if (c->wfmt == PD_CUDA_WEIGHTS_BF16)
            e = gu1_launch<__nv_bfloat16, 2>(&ucfg, ua, gu_pdl);
        else
            e = R == 4 ? gu1_launch<float, 4>(&ucfg, ua, gu_pdl) : gu1_launch<float, 2>(&ucfg, ua, gu_pdl);
        if (!CU_LAUNCHED(c, e, "moe_block: gate_up (routing)"))
            return true;
    } else if (!CU_LAUNCHED(c,
                     cu_gemv_grouped_launch(c->wfmt, true, Gr + S, I, H, NULL, set_gu(set), off, list, set_ints(set, 0),
                                            set_ints(set, 1), 0, T, tok, pair, a->h, H, act, I, false, false,
                                            c->stream),
                     "moe_block: gate_up"))
        return true;
    /* y[pair] = down_g · act[pair] (the grouped down GEMV and the combine
     * by plain PDL were slower: 2.68 ms a batch-1 step against 2.62,
     * docs/benchmarks.md) */
    /* og at one row: the combine inside the down GEMV (k_moe_down1c), a block a warp a pair */
    if (dn1 && og && K >= 2 && K <= DN1C_MAX_NW && !c->moe_dn1_cmb_off) {
        /* 4 rows a warp: at 8 the routed blocks' GEMV took twice as long (2.26-2.30 ms a step against 2.12,
         * docs/benchmarks.md session 16) */
        const int Rg = c->moe1_rows_gu, R = 4;
        moe_dn1c_args da = {};
        da.E = E, da.S = S, da.top_k = K, da.H = H, da.I = I, da.nxs = (H + K * R - 1) / (K * R);
        da.need = (unsigned)(S * ((I + GV_WARPS * Rg - 1) / (GV_WARPS * Rg))), da.sdone = set_ticket(set);
        da.ids = a->ids, da.weights = a->weights, da.w = set_dn(set), da.ldw = set_ints(set, 2), da.act = act;
        da.ysh = y + (size_t)n * H, da.xin = a->mo, da.out = a->x;
#ifdef PD_CUDA_PROBE
        moe_probe_enable(S * ((I + GV_WARPS * Rg - 1) / (GV_WARPS * Rg)), S * da.nxs);
#endif
        cudaLaunchAttribute dat;
        cudaLaunchConfig_t dcfg = cu_launch_config(dim3((unsigned)(S * da.nxs + (H + R - 1) / R)), dim3(K * 32),
                                                   (size_t)I * sizeof(float), c->stream, true, &dat);
        if (c->wfmt == PD_CUDA_WEIGHTS_BF16)
            e = dn1c_launch<__nv_bfloat16, 4>(&dcfg, da);
        else
            e = dn1c_launch<float, 4>(&dcfg, da);
        CU_LAUNCHED(c, e, "moe_block: down with the combine (PDL)");
        return true;
    }
    if (dn1) {
        moe_dn1_args da = {};
        da.E = E, da.S = S, da.top_k = K, da.H = H, da.I = I;
        const int Rg = c->moe1_rows_gu, R = c->moe1_rows_dn;
        da.need = (unsigned)(S * ((I + GV_WARPS * Rg - 1) / (GV_WARPS * Rg))), da.sdone = set_ticket(set);
        da.ids = a->ids, da.w = set_dn(set), da.ldw = set_ints(set, 2), da.act = act, da.y = y;
        const size_t dsmem = (size_t)I * sizeof(float);
        cudaLaunchAttribute dat;
        cudaLaunchConfig_t dcfg =
            cu_launch_config(dim3((unsigned)((H + GV_WARPS * R - 1) / (GV_WARPS * R)), (unsigned)(S + K)),
                             dim3(GV_WARPS * 32), dsmem, c->stream, true, &dat);
        if (c->wfmt == PD_CUDA_WEIGHTS_BF16)
            e = R == 4 ? dn1_launch<__nv_bfloat16, 4>(&dcfg, da) : dn1_launch<__nv_bfloat16, 2>(&dcfg, da);
        else
            e = R == 4 ? dn1_launch<float, 4>(&dcfg, da) : dn1_launch<float, 2>(&dcfg, da);
        if (!CU_LAUNCHED(c, e, "moe_block: down (PDL)"))
            return true;
    } else if (!CU_LAUNCHED(c,
                            cu_gemv_grouped_launch(c->wfmt, false, Gr + S, H, I, NULL, set_dn(set), off, list,
                                                   set_ints(set, 2), NULL, 0, T, pair, pair, act, I, y, H, false, false,
                                                   c->stream),
                            "moe_block: down"))
        return true;
    /* after k_moe_down1, by PDL: x read before the wait */
    const int early = dn1 && !c->moe_cmb1_plain;
#ifdef PD_CUDA_PROBE
    moe_probe_enable(route_in_gu && !c->moe_shared_last ? S * ((I + GV_WARPS * c->moe1_rows_gu - 1) / (GV_WARPS * c->moe1_rows_gu)) : 0,
                     dn1 ? S * ((H + GV_WARPS * c->moe1_rows_dn - 1) / (GV_WARPS * c->moe1_rows_dn)) : 0);
#endif
    cudaLaunchAttribute cat;
    cudaLaunchConfig_t ccfg =
        cu_launch_config(dim3((unsigned)T, (unsigned)((H + CMB_PAIRS_THREADS - 1) / CMB_PAIRS_THREADS)),
                         dim3(CMB_PAIRS_THREADS), 0, c->stream, early, &cat);
    CU_LAUNCHED(c,
                cudaLaunchKernelEx(&ccfg, k_moe_combine_pairs, H, K, E, S, (const int32_t *)a->ids,
                                   (const float *)a->weights, (const float *)y, (const float *)(og ? a->mo : NULL),
                                   a->x, dn1 ? set_ticket(set) : NULL, early),
                "moe_block: combine");
    return true;
}

/* ids[i] in [first, first + count) → ids[i] - first, else -1. */
static __global__ void k_moe_ids_local(size_t n, int32_t *__restrict__ ids, int first, int count) {
    cu_pdl_launch_dependents();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const int32_t e = ids[i];
        ids[i] = e >= first && e - first < count ? e - first : -1;
    }
}

void cu_moe_ids_local(pd_backend *be, size_t n, int32_t *ids, int first, int count) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || n == 0)
        return;
    if (!ids || first < 0 || count <= 0) {
        cu_fail(c, PD_ERR_INVALID, "moe_ids_local: first %d, count %d", first, count);
        return;
    }
    k_moe_ids_local<<<(unsigned)((n + 255) / 256), 256, 0, c->stream>>>(n, ids, first, count);
    CU_LAUNCHED(c, cudaGetLastError(), "moe_ids_local");
}

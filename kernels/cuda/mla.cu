/* MLA attention over the paged latent cache, DeepSeek-V2 paper §2.1.2–2.1.3
 * (transformers modeling_deepseek_v3.py DeepseekV3Attention). Cache layout
 * [block][layer][slot][kvr + dr] fp32; the block table arrives in host
 * memory and is copied for the call.
 *
 * Expanded form (prefill): gather c_KV and k_pe of tokens 0..L-1, one GEMM
 * [k_nope | v] = c_KV · W_kv_bᵀ  ([L, nh, dn + dv]), then k_mla_prefill:
 * one block per (query, head), keys in tiles of 128 with an online softmax;
 * or, for bf16 weights with mla_prefill_gemm, bf16 tensor-core GEMMs
 * through cuBLAS around an fp32 softmax (expanded_gemm_run), or with
 * mla_prefill_flash one fused kernel on the same bf16 operands
 * (mla_flash.cu).
 *
 * Absorbed form (decode): q_lat = W_UKᵀ q_nope per head (k_mla_qlat), then
 * k_mla_decode reads the paged cache directly: a block takes 16 heads of one
 * query and one split of the context, scores every cached row against the
 * 16 latent queries (score = q_lat·c_KV + q_pe·k_pe), keeps a running max and
 * sum per head and accumulates o_lat = Σ p c_KV; k_mla_combine merges the
 * splits by log-sum-exp and applies W_UV. Heads share the cache rows, so a
 * tile is read once per 16 heads (from L2 for the other head groups). With
 * bf16 weights, latent 512 and rope 64 the split kernel is
 * k_mla_decode_tc: the same partials, both products on tensor cores (TF32). */
#include "cuda_common.cuh"

#include <cooperative_groups.h>
#include <cuda_pipeline.h>
#include <type_traits>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* ---- a diagnostic: per-block timestamps of the decode attention --------
 *
 * As moe.cu's probe (its top; same build switch, -DPD_CUDA_PROBE): with
 * PD_MLA_PROBE=path in the environment, thread 0 of every block of the
 * split kernel k_mla_decode_tc (kernel 0) and the merge k_mla_combine8
 * (kernel 1) writes %globaltimer (ns) at its points. Split: 0 start, 1
 * past its wait, 2 its first tile in shared memory, 3 that tile's
 * arithmetic done, 4 the second tile in, 5 every tile done, 6 end, and
 * within the first two tiles the scores' exchange done (7, 9) and the
 * softmax done (8, 10); thread 0's own PV issued, before the barrier that
 * ends the tile, in the first tile (11) and the last (12), and thread
 * 224's (warp 7) in the last (13). Merge:
 * 0 start, 1 past its wait, 2 the latent output merged, 6 end. Each launch
 * overwrites the last; the file (written when the backend is freed) holds
 * the last layer's. tests/gpu/mla_probe_summary.py reads it. Not for
 * benchmark figures. */
#ifdef PD_CUDA_PROBE
#define MLA_PROBE_BLOCKS 1024
#define MLA_PROBE_SLOTS 14
__device__ unsigned long long mla_probe_t[2][MLA_PROBE_BLOCKS][MLA_PROBE_SLOTS];
__constant__ int mla_probe_on; /* constant memory: the check costs no global load in the measured path */
__device__ __forceinline__ void mla_probe(int k, int slot, int who = 0) {
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (mla_probe_on && threadIdx.x == who && b < MLA_PROBE_BLOCKS) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        mla_probe_t[k][b][slot] = t;
    }
}
#define MLA_PROBE(k, slot) mla_probe(k, slot)
#define MLA_PROBE_BY(k, slot, who) mla_probe(k, slot, who)
static int mla_probe_host = -1;
static void mla_probe_enable(void) {
    if (mla_probe_host < 0) {
        int on = mla_probe_host = getenv("PD_MLA_PROBE") != NULL;
        if (on)
            cudaMemcpyToSymbol(mla_probe_on, &on, sizeof on);
    }
}
void cu_mla_probe_dump(void) {
    if (mla_probe_host != 1)
        return;
    mla_probe_host = 0;
    static unsigned long long h[2][MLA_PROBE_BLOCKS][MLA_PROBE_SLOTS];
    if (cudaMemcpyFromSymbol(h, mla_probe_t, sizeof h) != cudaSuccess)
        fprintf(stderr, "mla probe: cannot read the timestamps\n");
    else
        cu_probe_write("PD_MLA_PROBE", NULL, &h[0][0][0], 2, MLA_PROBE_BLOCKS, MLA_PROBE_SLOTS);
}
#else
#define MLA_PROBE(k, slot) ((void)0)
#define MLA_PROBE_BY(k, slot, who) ((void)0)
#endif

/* ---- expanded form ---------------------------------------------------- */

#define PF_THREADS 128 /* = keys per tile */
#define PF_DV_MAX (4 * PF_THREADS)

static __global__ void k_mla_gather(int kvr, int dr, const float *__restrict__ cache, int n_layers, int layer, int bs,
                                    const int *__restrict__ btab, float *__restrict__ lat, float *__restrict__ kpe) {
    cu_pdl_launch_dependents();
    const int t = blockIdx.x, D = kvr + dr;
    const float *row = cache + (((size_t)btab[t / bs] * n_layers + layer) * bs + t % bs) * D;
    for (int k = threadIdx.x; k < D; k += blockDim.x) {
        float v = row[k];
        if (k < kvr)
            lat[(size_t)t * kvr + k] = v;
        else
            kpe[(size_t)t * dr + (k - kvr)] = v;
    }
}

/* q [n_q, nh, dn + dr], kv [L, nh, dn + dv], kpe [L, dr] → out [n_q, nh, dv];
 * block (query i, head h); query i sees tokens 0 .. start_pos + i. */
static __global__ void __launch_bounds__(PF_THREADS)
    k_mla_prefill(int nh, int dn, int dr, int dv, float scale, int start_pos, const float *__restrict__ q,
                  const float *__restrict__ kv, const float *__restrict__ kpe, float *__restrict__ out) {
    cu_pdl_launch_dependents();
    extern __shared__ float4 smem4[];
    float *sm = (float *)smem4;
    const int i = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int qd = dn + dr, kvd = dn + dv;
    float *qs = sm, *ps = sm + qd, *red = ps + PF_THREADS; /* red: [0..3] max, [4..7] sum */
    const float *qr = q + ((size_t)i * nh + h) * qd;
    for (int d = tid; d < qd; d += PF_THREADS)
        qs[d] = qr[d];
    __syncthreads();
    const int n_vis = start_pos + i + 1;
    float m = -INFINITY, l = 0.0f;
    float acc[PF_DV_MAX / PF_THREADS] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int t0 = 0; t0 < n_vis; t0 += PF_THREADS) {
        const int t = t0 + tid;
        float s = -INFINITY;
        if (t < n_vis) {
            const float *k = kv + ((size_t)t * nh + h) * kvd;
            const float *kp = kpe + (size_t)t * dr;
            float a = 0.0f;
            for (int d = 0; d < dn; d++)
                a += qs[d] * k[d];
            for (int d = 0; d < dr; d++)
                a += qs[dn + d] * kp[d];
            s = a * scale;
        }
        float mt = cu_warp_max(s);
        if ((tid & 31) == 0)
            red[tid >> 5] = mt;
        __syncthreads();
        mt = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
        const float m_new = fmaxf(m, mt); /* finite: the tile holds token t0 < n_vis */
        const float p = t < n_vis ? expf(s - m_new) : 0.0f;
        ps[tid] = p;
        float lt = cu_warp_sum(p);
        if ((tid & 31) == 0)
            red[4 + (tid >> 5)] = lt;
        __syncthreads();
        lt = red[4] + red[5] + red[6] + red[7];
        const float alpha = expf(m - m_new); /* 0 on the first tile */
        l = l * alpha + lt;
        m = m_new;
        const int nt = min(PF_THREADS, n_vis - t0);
#pragma unroll
        for (int j = 0; j < PF_DV_MAX / PF_THREADS; j++) {
            const int d = tid + PF_THREADS * j;
            if (d < dv) {
                const float *v = kv + ((size_t)t0 * nh + h) * kvd + dn + d;
                float o = acc[j] * alpha;
                for (int tt = 0; tt < nt; tt++)
                    o += ps[tt] * v[(size_t)tt * nh * kvd];
                acc[j] = o;
            }
        }
        __syncthreads(); /* ps and red are rewritten by the next tile */
    }
    const float inv = 1.0f / l;
    float *o = out + ((size_t)i * nh + h) * dv;
#pragma unroll
    for (int j = 0; j < PF_DV_MAX / PF_THREADS; j++) {
        const int d = tid + PF_THREADS * j;
        if (d < dv)
            o[d] = acc[j] * inv;
    }
}

/* ---- expanded form on tensor cores ------------------------------------ *
 * For bf16 weights (mla_prefill_gemm): q, k = [k_nope | k_pe] and v rounded
 * to bf16 (k_mla_pack), then per chunk of qc queries and per head (cuBLAS
 * strided-batched GEMMs, fp32 accumulation):
 *   S = scale · Q Kᵀ  fp32 [qc, Lc], Lc = tokens the chunk's last query sees;
 *   P = softmax(S) by row over the causal prefix, bf16, zero past it
 *       (k_mla_softmax, fp32 arithmetic);
 *   O = P V           fp32 straight into out [n_q, nh, dv].
 * The same arithmetic as the kernel above in a different order and with
 * bf16 operands, as transformers runs DeepseekV3Attention in bf16 (eager
 * attention: matmul, softmax in fp32, matmul). */

/* q [n_q, nh, qd] fp32 → qb bf16, same layout. */
static __global__ void k_mla_pack_q(size_t n, const float *__restrict__ q, __nv_bfloat16 *__restrict__ qb) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        qb[i] = __float2bfloat16_rn(q[i]);
}

/* Block t: kb[t, h] = [kv[t, h, 0:dn] | kpe[t]] and vb[t, h] = kv[t, h, dn:dn+dv], bf16. */
static __global__ void k_mla_pack_kv(int nh, int dn, int dr, int dv, const float *__restrict__ kv,
                                     const float *__restrict__ kpe, __nv_bfloat16 *__restrict__ kb,
                                     __nv_bfloat16 *__restrict__ vb) {
    const int t = blockIdx.x, qd = dn + dr, kvd = dn + dv;
    const float *src = kv + (size_t)t * nh * kvd;
    __nv_bfloat16 *k = kb + (size_t)t * nh * qd, *v = vb + (size_t)t * nh * dv;
    for (int j = threadIdx.x; j < nh * qd; j += blockDim.x) {
        const int h = j / qd, d = j % qd;
        k[j] = __float2bfloat16_rn(d < dn ? src[(size_t)h * kvd + d] : kpe[(size_t)t * dr + d - dn]);
    }
    for (int j = threadIdx.x; j < nh * dv; j += blockDim.x) {
        const int h = j / dv, d = j % dv;
        v[j] = __float2bfloat16_rn(src[(size_t)h * kvd + dn + d]);
    }
}

#define SMX_THREADS 256

/* Block (query i of the chunk, head h): row s = S[h, i, 0:ld] (already
 * scaled); query i sees n_vis = vis0 + i + 1 tokens. p[h, i, t] =
 * exp(s_t - max) / Σ for t < n_vis, 0 for n_vis <= t < Lc. */
static __global__ void __launch_bounds__(SMX_THREADS)
    k_mla_softmax(int vis0, int Lc, size_t ld, size_t h_stride, const float *__restrict__ S,
                  __nv_bfloat16 *__restrict__ P) {
    __shared__ float red[2 * SMX_THREADS / 32];
    const int i = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    const float *s = S + h * h_stride + i * ld;
    __nv_bfloat16 *p = P + h * h_stride + i * ld;
    const int n_vis = min(vis0 + i + 1, Lc);
    /* one pass: running max and the sum rescaled to it, per thread */
    float m = -INFINITY, l = 0.0f;
    for (int t = tid; t < n_vis; t += SMX_THREADS) {
        const float x = s[t];
        if (x > m) {
            l = l * expf(m - x) + 1.0f;
            m = x;
        } else {
            l += expf(x - m);
        }
    }
    float mw = cu_warp_max(m);
    if (lane == 0)
        red[wid] = mw;
    __syncthreads();
    float mx = red[0];
    for (int w = 1; w < SMX_THREADS / 32; w++)
        mx = fmaxf(mx, red[w]);
    /* n_vis >= 1, so mx is finite */
    float lw = cu_warp_sum(m == -INFINITY ? 0.0f : l * expf(m - mx));
    if (lane == 0)
        red[SMX_THREADS / 32 + wid] = lw;
    __syncthreads();
    float sum = 0.0f;
    for (int w = 0; w < SMX_THREADS / 32; w++)
        sum += red[SMX_THREADS / 32 + w];
    const float inv = 1.0f / sum;
    for (int t = tid; t < Lc; t += SMX_THREADS)
        p[t] = __float2bfloat16_rn(t < n_vis ? expf(s[t] - mx) * inv : 0.0f);
}

/* ---- absorbed form ---------------------------------------------------- */

#define DEC_HG 16      /* heads per block */
#define DEC_TT 32      /* cache rows per tile (one per lane in the score phase) */
#define DEC_THREADS 256 /* 8 warps: warp w scores heads w and w + 8 */
#define DEC_MAX_SPLITS 256

/* ql[i, h] = [W_UK[h]ᵀ q_nope[i, h] (kvr) | q_pe[i, h] (dr)]; W_UK[h] is rows
 * h*(dn+dv) .. h*(dn+dv)+dn-1 of kv_b. Block (query i, head h, 128 latent
 * columns), one column per thread (coalesced rows of W_UK). */
#define QLAT_THREADS 128
template <typename W>
static __global__ void __launch_bounds__(QLAT_THREADS)
    k_mla_qlat(int nh, int dn, int dr, int dv, int kvr, const float *__restrict__ q, const W *__restrict__ kvb,
               float *__restrict__ ql) {
    cu_pdl_launch_dependents();
    extern __shared__ float4 smem4[];
    float *qn = (float *)smem4; /* [dn] */
    const int i = blockIdx.x, h = blockIdx.y, c = blockIdx.z * QLAT_THREADS + threadIdx.x;
    const float *qr = q + ((size_t)i * nh + h) * (dn + dr);
    for (int d = threadIdx.x; d < dn; d += QLAT_THREADS)
        qn[d] = qr[d];
    __syncthreads();
    const W *wuk = kvb + (size_t)h * (dn + dv) * kvr;
    float *o = ql + ((size_t)i * nh + h) * (kvr + dr);
    if (c < kvr) {
        float s = 0.0f;
#pragma unroll 8
        for (int d = 0; d < dn; d++)
            s += qn[d] * cu_ldw(wuk, (size_t)d * kvr + c);
        o[c] = s;
    }
    if (blockIdx.z == 0)
        for (int d = threadIdx.x; d < dr; d += QLAT_THREADS)
            o[kvr + d] = qr[dn + d];
}

/* Eight consecutive weights as fp32: one 16-byte load of bf16, two of fp32. */
__device__ __forceinline__ void mla_cvt8(const uint4 v, float *o) {
    o[0] = __uint_as_float(v.x << 16), o[1] = __uint_as_float(v.x & 0xffff0000u);
    o[2] = __uint_as_float(v.y << 16), o[3] = __uint_as_float(v.y & 0xffff0000u);
    o[4] = __uint_as_float(v.z << 16), o[5] = __uint_as_float(v.z & 0xffff0000u);
    o[6] = __uint_as_float(v.w << 16), o[7] = __uint_as_float(v.w & 0xffff0000u);
}
__device__ __forceinline__ void mla_ld8(const __nv_bfloat16 *p, float *o) {
    mla_cvt8(__ldg((const uint4 *)p), o);
}
__device__ __forceinline__ void mla_ld8(const float *p, float *o) {
    const float4 a = __ldg((const float4 *)p), b = __ldg((const float4 *)p + 1);
    o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w, o[4] = b.x, o[5] = b.y, o[6] = b.z, o[7] = b.w;
}

/* The same q_lat, for every query at once: block (head h, 256 latent
 * columns, QL_QB queries); thread (slice, column group) sums rows
 * slice, slice + 8, ... of W_UK[h] for 8 columns with 16-byte loads, all
 * of a thread's rows in flight together, and the 8 slices are added in
 * shared memory. W_UK[h] (dn × kvr, 128 KB in bf16 for V2/V3) is read once
 * per QL_QB queries instead of by one 2-byte load a column and row; the
 * first version (k_mla_qlat, kept for shapes this one does not take) spent
 * ~16 µs a layer on it at batch 1. Needs kvr % 8 == 0, dn <= QL_DN_MAX and
 * 16-byte aligned rows. */
#define QL_THREADS 256
#define QL_COLS 64 /* a block's latent columns: 8 groups of 8, 32 slices of dn (PD_QLAT_COLS=256: 32 groups, 8 slices) */
#define QL_QB 4
#define QL_DN_MAX 256
/* k_mla_qlat8 with the attention prologue folded in (prep.on, decode steps:
 * mla_prep's work for these rows): blocks (nh, 0, z) normalise the rows'
 * c_KV, rope their k_pe and store both into the cache (k_mla_prep's
 * arithmetic), and block (h, 0, z) ropes head h's q_pe as it copies it into
 * ql (and back into q). Nothing else reads q_pe, c_KV or k_pe before the
 * split attention, the next kernel. */
typedef struct {
    int on;
    const int32_t *pos, *slots;
    const float *inv_freq, *kv_norm;
    float mscale, eps;
    float *ckv, *cache;
    size_t slot_offset;
} qlat_prep;

/* Rows i0 .. i0 + nq - 1: c_KV = RMSNorm(c_KV) · kv_norm, rope on k_pe, both
 * in place and to the row's cache slot. */
__device__ static void qlat_kv_prep(const qlat_prep &p, int kvr, int dr, int i0, int nq) {
    __shared__ double part[QL_THREADS / 32];
    const int D = kvr + dr, half = dr / 2;
    for (int j = 0; j < nq; j++) {
        const int r = i0 + j;
        float *c = p.ckv + (size_t)r * D;
        const float inv = cu_block_inv_rms<QL_THREADS>(c, kvr, p.eps, part); /* ends after a barrier */
        float *dst = p.cache + ((size_t)p.slots[r] + p.slot_offset) * D;
        for (int i = threadIdx.x; i < kvr; i += QL_THREADS) {
            const float v = c[i] * inv * p.kv_norm[i];
            c[i] = v;
            dst[i] = v;
        }
        for (int i = threadIdx.x; i < half; i += QL_THREADS) {
            const float ang = (float)p.pos[r] * p.inv_freq[i];
            const float cs = cosf(ang) * p.mscale, sn = sinf(ang) * p.mscale;
            const float x0 = c[kvr + 2 * i], x1 = c[kvr + 2 * i + 1];
            const float y0 = x0 * cs - x1 * sn, y1 = x1 * cs + x0 * sn;
            c[kvr + 2 * i] = y0;
            c[kvr + 2 * i + 1] = y1;
            dst[kvr + 2 * i] = y0;
            dst[kvr + 2 * i + 1] = y1;
        }
        __syncthreads(); /* part is reused by the next row */
    }
}

/* What qlat_kv_prep2 needs that no kernel of the step writes (weights, the
 * rows' slots and positions: the host's, before the graph), read before
 * the PDL wait: kv_norm at columns tid + QL_THREADS k, each row's cache
 * slot, and thread i < dr / 2's rope factors for each row. */
#define QLP_K 4 /* kvr <= QLP_K · QL_THREADS (absorbed_shape_ok: kvr <= 1024) */
struct qlat_prep_pre {
    float kvn[QLP_K];
    size_t dst[QL_QB];
    float cs[QL_QB], sn[QL_QB];
};

__device__ __forceinline__ void qlat_kv_prep_load(const qlat_prep &p, int kvr, int dr, int i0, int nq,
                                                  qlat_prep_pre &pp) {
    const int tid = threadIdx.x, D = kvr + dr;
#pragma unroll
    for (int k = 0; k < QLP_K; k++)
        pp.kvn[k] = tid + k * QL_THREADS < kvr ? p.kv_norm[tid + k * QL_THREADS] : 0.0f;
#pragma unroll
    for (int j = 0; j < QL_QB; j++) {
        pp.dst[j] = j < nq ? ((size_t)p.slots[i0 + j] + p.slot_offset) * D : 0;
        pp.cs[j] = pp.sn[j] = 0.0f;
        if (j < nq && tid < dr / 2) {
            const float ang = (float)p.pos[i0 + j] * p.inv_freq[tid];
            pp.cs[j] = cosf(ang) * p.mscale;
            pp.sn[j] = sinf(ang) * p.mscale;
        }
    }
}

/* qlat_kv_prep's arithmetic (the same sum of squares, norm and rope) with
 * pp read before the wait: after it, one round trip for each row's c_KV
 * and k_pe, then the block's sum and the stores. */
__device__ static void qlat_kv_prep2(const qlat_prep &p, int kvr, int dr, int i0, int nq, const qlat_prep_pre &pp) {
    __shared__ double part[QL_THREADS / 32];
    const int tid = threadIdx.x, D = kvr + dr;
#pragma unroll
    for (int j = 0; j < QL_QB; j++) {
        if (j >= nq)
            break;
        float *c = p.ckv + (size_t)(i0 + j) * D;
        float v[QLP_K];
        double ss = 0.0;
#pragma unroll
        for (int k = 0; k < QLP_K; k++) {
            v[k] = tid + k * QL_THREADS < kvr ? c[tid + k * QL_THREADS] : 0.0f;
            ss += (double)v[k] * v[k];
        }
        const bool pe = tid < dr / 2;
        const float x0 = pe ? c[kvr + 2 * tid] : 0.0f, x1 = pe ? c[kvr + 2 * tid + 1] : 0.0f;
        const float inv = cu_block_inv_rms_of<QL_THREADS>(ss, kvr, p.eps, part);
        float *dst = p.cache + pp.dst[j];
#pragma unroll
        for (int k = 0; k < QLP_K; k++)
            if (tid + k * QL_THREADS < kvr) {
                const float y = v[k] * inv * pp.kvn[k];
                c[tid + k * QL_THREADS] = y;
                dst[tid + k * QL_THREADS] = y;
            }
        if (pe) {
            const float y0 = x0 * pp.cs[j] - x1 * pp.sn[j], y1 = x1 * pp.cs[j] + x0 * pp.sn[j];
            c[kvr + 2 * tid] = y0;
            c[kvr + 2 * tid + 1] = y1;
            dst[kvr + 2 * tid] = y0;
            dst[kvr + 2 * tid + 1] = y1;
        }
        __syncthreads(); /* part is rewritten by the next row */
    }
}

/* One pair of q_pe ropes in place (k_mla_prep's arithmetic) and goes into
 * its place in ql too: v[0..1], o[0..1]; cs, sn with mscale in them. */
__device__ __forceinline__ void qlat_rope_pair(float *v, float *o, float cs, float sn) {
    const float x0 = v[0], x1 = v[1];
    const float y0 = x0 * cs - x1 * sn, y1 = x1 * cs + x0 * sn;
    v[0] = y0;
    v[1] = y1;
    o[0] = y0;
    o[1] = y1;
}

/* acc[j][0..7] += q[j][d] · W_UK[d][the thread's 8 columns], for the QL_QB queries (k_mla_qlat8). */
__device__ __forceinline__ void qlat_acc(float (&acc)[QL_QB][8], const float (&qs)[QL_QB][QL_DN_MAX], int d,
                                         const float *w) {
#pragma unroll
    for (int j = 0; j < QL_QB; j++) {
        const float x = qs[j][d];
#pragma unroll
        for (int u = 0; u < 8; u++)
            acc[j][u] = fmaf(x, w[u], acc[j][u]);
    }
}

/* PRE (launched by PDL, bf16): 1, W_UK before the wait; 2, also what the
 * prologue needs that the step does not write (qlat_kv_prep_load) and the
 * q_pe rope's factors, so that after the wait each block has one round trip
 * to L2 before its sums (needs dr <= 2 QL_THREADS and, for the q_pe rope
 * before the sums, QL_QB · dr / 2 <= QL_THREADS) */
template <typename W, int COLS, int PRE = 0>
static __global__ void __launch_bounds__(QL_THREADS)
    k_mla_qlat8(int n_q, int nh, int dn, int dr, int dv, int kvr, float *__restrict__ q,
                const W *__restrict__ kvb, float *__restrict__ ql, qlat_prep prep) {
    constexpr int CG = COLS / 8, SLICES = QL_THREADS / CG; /* column groups of 8; slices of dn */
    constexpr int NPRE = 4;                                /* PRE: rows of W_UK a thread (dn <= NPRE · SLICES) */
    static_assert(!PRE || std::is_same<W, __nv_bfloat16>::value, "PRE loads bf16 weights");
    if (!PRE)
        cu_pdl_launch_dependents();
    __shared__ float qs[QL_QB][QL_DN_MAX];
    __shared__ float red[SLICES][QL_QB][COLS + 4];
    const int h = blockIdx.x, c0 = blockIdx.y * COLS, i0 = blockIdx.z * QL_QB;
    const int tid = threadIdx.x, slice = tid / CG, cg = tid % CG;
    const int nq = min(QL_QB, n_q - i0);
    /* PRE (launched by PDL, bf16): this thread's rows of W_UK loaded before
     * the wait (weights: nothing earlier writes them), and the next kernel
     * let launch only after it, so that at most one kernel waits early */
    uint4 wpre[NPRE];
    qlat_prep_pre pp;
    /* PRE 2: block (h < nh, 0, z)'s thread k < nq dr / 2 ropes pair k % (dr / 2) of query k / (dr / 2) */
    const bool rope_pre = PRE == 2 && prep.on && blockIdx.y == 0 && h < nh && nq * (dr / 2) <= QL_THREADS;
    float rcs = 0.0f, rsn = 0.0f;
    if constexpr (PRE) {
        const int c = c0 + cg * 8;
        if (h < nh && c < kvr) {
            const W *wuk = kvb + (size_t)h * (dn + dv) * kvr + c;
#pragma unroll
            for (int k = 0; k < NPRE; k++)
                if (slice + k * SLICES < dn)
                    wpre[k] = __ldg((const uint4 *)(wuk + (size_t)(slice + k * SLICES) * kvr));
        }
        if (PRE == 2 && h == nh && blockIdx.y == 0)
            qlat_kv_prep_load(prep, kvr, dr, i0, nq, pp);
        if (rope_pre && tid < nq * (dr / 2)) {
            const int j = tid / (dr / 2), i = tid - j * (dr / 2);
            const float ang = (float)prep.pos[i0 + j] * prep.inv_freq[i];
            rcs = cosf(ang) * prep.mscale;
            rsn = sinf(ang) * prep.mscale;
        }
        cu_pdl_wait();
        cu_pdl_launch_dependents();
    }
    if (h == nh) { /* the prologue's block (grid.x is nh + 1 only with prep.on) */
        if (blockIdx.y == 0) {
            if (PRE == 2)
                qlat_kv_prep2(prep, kvr, dr, i0, nq, pp);
            else
                qlat_kv_prep(prep, kvr, dr, i0, nq);
        }
        return;
    }
    if (rope_pre && tid < nq * (dr / 2)) {
        const int j = tid / (dr / 2), i = tid - j * (dr / 2), r = i0 + j;
        qlat_rope_pair(q + ((size_t)r * nh + h) * (dn + dr) + dn + 2 * i, ql + ((size_t)r * nh + h) * (kvr + dr) + kvr + 2 * i,
                       rcs, rsn);
    }
    for (int k = tid; k < QL_QB * dn; k += QL_THREADS) {
        const int j = k / dn, d = k - j * dn;
        qs[j][d] = j < nq ? q[((size_t)(i0 + j) * nh + h) * (dn + dr) + d] : 0.0f;
    }
    __syncthreads();
    const int c = c0 + cg * 8;
    float acc[QL_QB][8];
#pragma unroll
    for (int j = 0; j < QL_QB; j++)
#pragma unroll
        for (int u = 0; u < 8; u++)
            acc[j][u] = 0.0f;
    if (PRE && c < kvr) { /* the same sums, in the same order, from wpre */
#pragma unroll
        for (int k = 0; k < NPRE; k++) {
            const int d = slice + k * SLICES;
            if (d >= dn)
                break;
            float w[8];
            mla_cvt8(wpre[k], w);
            qlat_acc(acc, qs, d, w);
        }
    } else if (c < kvr) {
        const W *wuk = kvb + (size_t)h * (dn + dv) * kvr + c;
#pragma unroll 4
        for (int d = slice; d < dn; d += SLICES) {
            float w[8];
            mla_ld8(wuk + (size_t)d * kvr, w);
            qlat_acc(acc, qs, d, w);
        }
    }
#pragma unroll
    for (int j = 0; j < QL_QB; j++)
#pragma unroll
        for (int u = 0; u < 8; u++)
            red[slice][j][cg * 8 + u] = acc[j][u];
    __syncthreads();
    for (int k = tid; k < QL_QB * COLS; k += QL_THREADS) {
        const int j = k / COLS, cc = k - j * COLS;
        if (j >= nq || c0 + cc >= kvr)
            continue;
        float v = 0.0f;
#pragma unroll
        for (int sl = 0; sl < SLICES; sl++)
            v += red[sl][j][cc];
        ql[((size_t)(i0 + j) * nh + h) * (kvr + dr) + c0 + cc] = v;
    }
    if (blockIdx.y == 0 && !prep.on)
        for (int k = tid; k < nq * dr; k += QL_THREADS) {
            const int j = k / dr, d = k - j * dr;
            ql[((size_t)(i0 + j) * nh + h) * (kvr + dr) + kvr + d] = q[((size_t)(i0 + j) * nh + h) * (dn + dr) + dn + d];
        }
    if (blockIdx.y == 0 && prep.on && !rope_pre) /* rope on q_pe, k_mla_prep's arithmetic */
        for (int k = tid; k < nq * (dr / 2); k += QL_THREADS) {
            const int j = k / (dr / 2), i = k - j * (dr / 2), r = i0 + j;
            const float ang = (float)prep.pos[r] * prep.inv_freq[i];
            qlat_rope_pair(q + ((size_t)r * nh + h) * (dn + dr) + dn + 2 * i,
                           ql + ((size_t)r * nh + h) * (kvr + dr) + kvr + 2 * i, cosf(ang) * prep.mscale,
                           sinf(ang) * prep.mscale);
        }
}

/* One step of the online softmax for head hh over this tile's scores (one
 * per lane): running max and sum, the factor that rescales what was
 * accumulated so far, and the tile's probabilities ps[t][hh]. */
__device__ __forceinline__ void dec_softmax_step(float s, int hh, int lane, int nt, float *mrow, float *lrow,
                                                 float *arow, float *ps) {
    const float m_old = mrow[hh];
    const float m_new = fmaxf(m_old, cu_warp_max(s)); /* finite: lane 0 holds a real row */
    const float p = lane < nt ? expf(s - m_new) : 0.0f;
    const float lt = cu_warp_sum(p);
    const float a = expf(m_old - m_new); /* 0 on the first tile */
    ps[lane * DEC_HG + hh] = p;
    __syncwarp();
    if (lane == 0) {
        lrow[hh] = lrow[hh] * a + lt;
        mrow[hh] = m_new;
        arow[hh] = a;
    }
}

/* Queues the cp.async loads of cache rows t0 .. t0 + nt - 1 (through the
 * block table) into tile [nt][DP]; the caller commits. */
__device__ __forceinline__ void dec_tile_load(float *tile, const float *__restrict__ cache, const int *btab, int t0,
                                              int nt, int D4, int DP, int n_layers, int layer, int bs, int tid) {
    const int D = 4 * D4;
    for (int k = tid; k < nt * D4; k += DEC_THREADS) {
        const int row = k / D4, c4 = k - row * D4, t = t0 + row;
        const float4 *src = (const float4 *)(cache + (((size_t)btab[t / bs] * n_layers + layer) * bs + t % bs) * D);
        __pipeline_memcpy_async((float4 *)(tile + row * DP) + c4, src + c4, sizeof(float4));
    }
}

/* The same rows by Hopper bulk copies (cu_bulk_g2s), for warp 0 of the
 * block: lane r copies row r of the tile (r0 <= r < r1), the whole cache
 * row of D floats (contiguous; D * 4 a multiple of 16) in one instruction,
 * counted on mb; the caller has announced the bytes (cu_bulk_expect).
 * One block-table lookup a row instead of one a 16-byte piece, and the
 * copy engine, not 256 threads' LDGSTS, keeps the tile in flight. Needs
 * the cache and the tile 16-byte aligned and DP * 4 a multiple of 16. */
__device__ __forceinline__ void dec_tile_bulk(float *tile, unsigned long long *mb, const float *__restrict__ cache,
                                              const int *btab, int t0, int r0, int r1, int D, int DP, int n_layers,
                                              int layer, int bs, int lane) {
    if (lane >= r0 && lane < r1) {
        const int t = t0 + lane;
        cu_bulk_g2s(tile + lane * DP, cache + (((size_t)btab[t / bs] * n_layers + layer) * bs + t % bs) * D,
                    (unsigned)D * 4u, mb);
    }
}

/* Block (query i, split, head group): tokens [split*chunk, min(n_vis, (split+1)*chunk))
 * of query i against heads h0 .. h0+15, chunk = max(n_vis / n_splits,
 * min_chunk) rounded up to whole tiles (splits past the end stay empty: a
 * split's fixed cost — its share of q_lat read, its partial written and
 * merged — is worth a few tiles of work). Query i sees n_vis = q_len[i] tokens (q_len NULL: one
 * sequence's queries, start_pos + i + 1) through the block table
 * btab + q_boff[i] (q_boff NULL: btab). Writes unnormalised partials:
 * part_m/part_l [n_q, nh, S], part_o [n_q, nh, S, kvr]; a split past the
 * end writes l = 0. Needs kvr % 4 == 0, dr % 4 == 0, kvr <= 512 * KMAX, a
 * 16-byte aligned cache. */
template <int KMAX>
static __global__ void __launch_bounds__(DEC_THREADS)
    k_mla_decode(int nh, int kvr, int dr, float scale, int start_pos, const int *__restrict__ q_len,
                 const int *__restrict__ q_boff, int n_splits, int min_chunk, const float *__restrict__ ql,
                 const float *__restrict__ cache, int n_layers, int layer, int bs, const int *__restrict__ btab_all,
                 float *__restrict__ part_m, float *__restrict__ part_l, float *__restrict__ part_o) {
    cu_pdl_launch_dependents();
    extern __shared__ float4 smem4[];
    float *sm = (float *)smem4;
    const int D = kvr + dr, D4 = D / 4, DP = D + 4, kvr4 = kvr / 4;
    float *qs = sm;                    /* [HG][DP] */
    float *tile = qs + DEC_HG * DP;    /* [TT][DP] */
    float *ps = tile + DEC_TT * DP;    /* [TT][HG] */
    float *mrow = ps + DEC_TT * DEC_HG, *lrow = mrow + DEC_HG, *arow = lrow + DEC_HG;
    const int i = blockIdx.x / n_splits, split = blockIdx.x - i * n_splits, h0 = blockIdx.y * DEC_HG;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n_vis = q_len ? q_len[i] : start_pos + i + 1;
    const int chunk = (max((n_vis + n_splits - 1) / n_splits, min_chunk) + DEC_TT - 1) / DEC_TT * DEC_TT;
    const int t_begin = split * chunk, t_end = min(n_vis, t_begin + chunk);
    const int *btab = btab_all + (q_boff ? q_boff[i] : 0);

    /* global → shared copies go through cp.async, so that every load of a
     * tile is in flight at once instead of one per thread at a time; the
     * first tile's loads go out with q's (one wait for both), and a split
     * past the end loads nothing */
    const bool empty = t_begin >= t_end;
    for (int k = tid; k < DEC_HG * D4 && !empty; k += DEC_THREADS) {
        const int hh = k / D4, c4 = k - hh * D4;
        float4 *dst = (float4 *)(qs + hh * DP) + c4;
        if (h0 + hh < nh)
            __pipeline_memcpy_async(dst, (const float4 *)(ql + ((size_t)i * nh + h0 + hh) * D) + c4, sizeof(float4));
        else
            *dst = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    if (!empty)
        dec_tile_load(tile, cache, btab, t_begin, min(DEC_TT, t_end - t_begin), D4, DP, n_layers, layer, bs, tid);
    __pipeline_commit();
    if (tid < DEC_HG) {
        mrow[tid] = -INFINITY;
        lrow[tid] = 0.0f;
    }
    const int hb = (tid >> 7) * 8; /* PV phase: heads hb .. hb+7, chunks (tid & 127) + 128k */
    float4 acc[KMAX][8];
#pragma unroll
    for (int k = 0; k < KMAX; k++)
#pragma unroll
        for (int j = 0; j < 8; j++)
            acc[k][j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    __syncthreads();

    for (int t0 = t_begin; t0 < t_end; t0 += DEC_TT) {
        const int nt = min(DEC_TT, t_end - t0);
        if (t0 != t_begin) { /* the first tile's loads went out with q's */
            dec_tile_load(tile, cache, btab, t0, nt, D4, DP, n_layers, layer, bs, tid);
            __pipeline_commit();
        }
        __pipeline_wait_prior(0);
        __syncthreads();
        {
            const int ha = warp, hc = warp + 8;
            float sa = -INFINITY, sc = -INFINITY;
            if (lane < nt) {
                /* four partial sums a head (the components of a float4):
                 * a chain of D / 4 dependent additions, not D */
                const float4 *kr = (const float4 *)(tile + lane * DP);
                const float4 *qa = (const float4 *)(qs + ha * DP), *qc = (const float4 *)(qs + hc * DP);
                float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
#pragma unroll 4
                for (int c4 = 0; c4 < D4; c4++) {
                    const float4 k = kr[c4], x = qa[c4], y = qc[c4];
                    a.x = fmaf(x.x, k.x, a.x);
                    a.y = fmaf(x.y, k.y, a.y);
                    a.z = fmaf(x.z, k.z, a.z);
                    a.w = fmaf(x.w, k.w, a.w);
                    b.x = fmaf(y.x, k.x, b.x);
                    b.y = fmaf(y.y, k.y, b.y);
                    b.z = fmaf(y.z, k.z, b.z);
                    b.w = fmaf(y.w, k.w, b.w);
                }
                sa = ((a.x + a.y) + (a.z + a.w)) * scale;
                sc = ((b.x + b.y) + (b.z + b.w)) * scale;
            }
            dec_softmax_step(sa, ha, lane, nt, mrow, lrow, arow, ps);
            dec_softmax_step(sc, hc, lane, nt, mrow, lrow, arow, ps);
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < KMAX; k++) {
            const int ch = (tid & 127) + 128 * k;
            if (ch < kvr4) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const float al = arow[hb + j];
                    acc[k][j].x *= al;
                    acc[k][j].y *= al;
                    acc[k][j].z *= al;
                    acc[k][j].w *= al;
                }
                for (int tt = 0; tt < nt; tt++) {
                    const float4 v = ((const float4 *)(tile + tt * DP))[ch];
                    const float4 p0 = *(const float4 *)(ps + tt * DEC_HG + hb);
                    const float4 p1 = *(const float4 *)(ps + tt * DEC_HG + hb + 4);
                    const float p[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        acc[k][j].x += p[j] * v.x;
                        acc[k][j].y += p[j] * v.y;
                        acc[k][j].z += p[j] * v.z;
                        acc[k][j].w += p[j] * v.w;
                    }
                }
            }
        }
        __syncthreads(); /* tile, ps and arow are rewritten by the next tile */
    }

#pragma unroll
    for (int k = 0; k < KMAX; k++) {
        const int ch = (tid & 127) + 128 * k;
        if (ch < kvr4) {
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int h = h0 + hb + j;
                if (h < nh)
                    ((float4 *)(part_o + (((size_t)i * nh + h) * n_splits + split) * kvr))[ch] = acc[k][j];
            }
        }
    }
    if (tid < DEC_HG && h0 + tid < nh) {
        const size_t pi = ((size_t)i * nh + h0 + tid) * n_splits + split;
        part_m[pi] = mrow[tid];
        part_l[pi] = lrow[tid];
    }
}

/* ---- the split attention on tensor cores (TF32 mma.sync) ---------------
 *
 * k_mla_decode scores a tile with every thread reading its cache row from
 * shared memory once per pair of heads: ~430 16-byte shared loads a thread
 * a tile, ~3.5 us of the shared-memory pipe for 32 rows, and the PV phase
 * half as much again. A block's 16 heads are exactly the M = 16 of
 * mma.sync, so here both products run on tensor cores in TF32
 * (m16n8k8, fp32 accumulators; inputs keep 10 mantissa bits, the same
 * class of rounding as the bf16 weights this path is used with):
 *   S [16 heads × 32 rows] = q_lat [16 × D] · tileᵀ: warp w takes columns
 *     w·D/8 .. of D for all four 8-row n-tiles, its q fragments in
 *     registers for the whole split; the eight partial S meet in shared
 *     memory;
 *   online softmax per head (a warp, two heads, a lane a row: the scalar
 *     kernel's arithmetic);
 *   O [16 × kvr] += P [16 × 32] · tile[:, :kvr]: warp w takes kvr/8
 *     columns. The mma's k index κ stands for row 2(κ mod 4) + κ/4 of each
 *     8-row step, which makes a lane's two P values adjacent and the V
 *     loads free of bank conflicts with the row pitch D + 4.
 * Tiles are double-buffered: the next tile's cp.async loads go out before
 * the current one is used. Same partials as k_mla_decode (an empty split
 * writes l = 0, and part_o only with zero_empty: k_mla_combine8 reads only
 * splits that saw tokens). Shapes: KQ = D / 64 (q columns per warp / 8),
 * NT = kvr / 64 (8-column tiles per warp); instantiated for DeepSeek's
 * kvr 512, dr 64. Fragment layouts: PTX ISA, "Matrix Fragments for
 * mma.m16n8k8" (.tf32): lane = 4g + t holds A (g, t), (g+8, t), (g, t+4),
 * (g+8, t+4), B (k t, n g), (k t+4, n g), C (g, 2t), (g, 2t+1), (g+8, 2t),
 * (g+8, 2t+1). */
#define DTC_SRP 40 /* partial-score row pitch: float2 stores without bank conflicts */
#define DTC_PSP 40 /* P row pitch */

__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

/* d (16×8 fp32) += a (16×8 tf32, row) · b (8×8 tf32, col) */
__device__ __forceinline__ void mma1688(float *d, const unsigned *a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static size_t decode_tc_smem(int D) {
    return ((size_t)2 * DEC_TT * (D + 4) + 8 * DEC_HG * DTC_SRP + DEC_HG * DTC_PSP + 3 * DEC_HG) * sizeof(float);
}

/* k_mla_decode's arguments and partials (see there), D = 64 KQ, kvr = 64 NT.
 * PRE (launched by PDL): 1, the first tile loaded before the wait when
 * none of its rows is this step's; 2, the rows of the first two tiles that
 * are not this step's loaded before the wait, wherever they are, and the
 * rest after it.
 * BULK: the tiles come in by Hopper bulk copies, a cache row each
 * (dec_tile_bulk, issued by warp 0), instead of every thread's 16-byte
 * cp.async: each tile buffer has an mbarrier that counts its bytes, and
 * every thread waits on it (the phase's parity flips each time the buffer
 * is used) where the cp.async form waits for its own groups. The rows past
 * the split's end are still zeroed by ordinary stores; the shared memory
 * the arithmetic reads is the same, and so are the partials. */
template <int KQ, int NT, int PRE = 0, bool BULK = false>
static __global__ void __launch_bounds__(DEC_THREADS, 1)
    k_mla_decode_tc(int nh, float scale, int start_pos, const int *__restrict__ q_len, const int *__restrict__ q_boff,
                    int n_splits, int min_chunk, int zero_empty, const float *__restrict__ ql,
                    const float *__restrict__ cache, int n_layers, int layer, int bs, const int *__restrict__ btab_all,
                    float *__restrict__ part_m, float *__restrict__ part_l, float *__restrict__ part_o) {
    MLA_PROBE(0, 0);
    if (!PRE)
        cu_pdl_launch_dependents();
    constexpr int D = 64 * KQ, KVR = 64 * NT, D4 = D / 4, DP = D + 4;
    extern __shared__ float4 smem4[];
    float *tiles = (float *)smem4;                /* [2][TT][DP] */
    float *sred = tiles + 2 * DEC_TT * DP;        /* [8 warps][HG][SRP] partial scores */
    float *ps = sred + 8 * DEC_HG * DTC_SRP;      /* [HG][PSP] */
    float *mrow = ps + DEC_HG * DTC_PSP, *lrow = mrow + DEC_HG, *arow = lrow + DEC_HG;
    const int i = blockIdx.x / n_splits, split = blockIdx.x - i * n_splits, h0 = blockIdx.y * DEC_HG;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int n_vis = q_len ? q_len[i] : start_pos + i + 1;
    const int chunk = (max((n_vis + n_splits - 1) / n_splits, min_chunk) + DEC_TT - 1) / DEC_TT * DEC_TT;
    const int t_begin = split * chunk, t_end = min(n_vis, t_begin + chunk);
    const int *btab = btab_all + (q_boff ? q_boff[i] : 0);
    const size_t pi = ((size_t)i * nh + h0) * n_splits + split; /* head h0's partial; head h0 + j at + j n_splits */

    /* past the end: l = 0 (and o = 0 for the merge that reads every split),
     * before the wait where there is one (PRE). The length was written by
     * the host before the graph, and the partials' last reader, the
     * previous call's merge, has ended: q_lat, the kernel before this one,
     * lets this one start only once everything before q_lat has ended
     * (after its own wait, or by stream order where it has none). The
     * block's SM is then free at once for the merge's blocks, which load
     * their W_UV rows before their wait; with one split a SM, empty blocks
     * that sat out the wait held SMs the merge could not use (1K at batch
     * 1: 99 of 132 splits empty; a step 8-24 us slower, session 21). */
    if (t_begin >= t_end) {
        if (tid < DEC_HG && h0 + tid < nh) {
            part_m[pi + (size_t)tid * n_splits] = -INFINITY;
            part_l[pi + (size_t)tid * n_splits] = 0.0f;
        }
        if (zero_empty)
            for (int k = tid; k < DEC_HG * (KVR / 4); k += DEC_THREADS) {
                const int hh = k / (KVR / 4), c4 = k - hh * (KVR / 4);
                if (h0 + hh < nh)
                    ((float4 *)(part_o + (pi + (size_t)hh * n_splits) * KVR))[c4] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        return;
    }

    /* BULK: buffer b's mbarrier (static shared memory: the dynamic part is
     * decode_tc_smem's, 16-byte aligned like every row of both buffers,
     * DP * 4 = 2320 bytes a row). Thread 0 makes them; warp 0 issues every
     * copy, so its __syncwarp publishes them to the copies, and the other
     * warps see them after a __syncthreads before their first wait (below,
     * before the tile loop). A barrier's one arrival a phase is warp 0 lane
     * 0's cu_bulk_expect with the whole tile's bytes. */
    __shared__ alignas(8) unsigned long long mbar[2];
    static_assert(!BULK || (D * 4) % 16 == 0 && (DP * 4) % 16 == 0, "bulk copies move 16-byte multiples");
    static_assert(!BULK || DEC_TT <= 32, "a lane copies a row of the tile");
    if constexpr (BULK) {
        if (tid == 0) {
            cu_mbar_init(mbar);
            cu_mbar_init(mbar + 1);
            cu_mbar_init_fence();
        }
        __syncwarp();
    }

    /* tile loads into buffer b: rows past the split's end are zeroed (P is
     * 0 there, and 0 times whatever shared memory held could be NaN) */
    auto load_tile = [&](int b, int t0) {
        float *tile = tiles + b * DEC_TT * DP;
        const int nt = min(DEC_TT, t_end - t0);
        if constexpr (BULK) {
            if (warp == 0) {
                /* the buffer's last tile was read by generic loads (or it
                 * is fresh): order those, which the __syncthreads at the end
                 * of the loop's step put before this point, before the
                 * copies' async-proxy writes */
                cu_fence_proxy_async();
                if (lane == 0)
                    cu_bulk_expect(mbar + b, (unsigned)(nt * D * 4));
                __syncwarp();
                dec_tile_bulk(tile, mbar + b, cache, btab, t0, 0, nt, D, DP, n_layers, layer, bs, lane);
            }
        } else {
            dec_tile_load(tile, cache, btab, t0, nt, D4, DP, n_layers, layer, bs, tid);
        }
        for (int k = nt * D4 + tid; k < DEC_TT * D4; k += DEC_THREADS) {
            const int row = k / D4, c4 = k - row * D4;
            ((float4 *)(tile + row * DP))[c4] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
        if constexpr (!BULK)
            __pipeline_commit();
    };
    /* PRE (launched by PDL): the first tile is loaded before the wait when
     * none of its rows is this step's (decode: the last row, stored by the
     * q_lat kernel; q_len NULL: rows from start_pos on): the rest of the
     * cache was written by earlier steps, and the lengths and block table
     * by the host before the graph. The next kernel launches after the wait. */
    bool first_loaded = false, second_loaded = false;
    if constexpr (PRE == 1) {
        const int old_rows = q_len ? n_vis - 1 : start_pos;
        if (t_begin < t_end && min(t_end, t_begin + DEC_TT) <= old_rows) {
            load_tile(0, t_begin);
            first_loaded = true;
        }
        cu_pdl_wait();
        cu_pdl_launch_dependents();
    } else if constexpr (PRE == 2) {
        /* the split that holds this step's row (the critical one: every
         * other split's rows are old) no longer loads its whole first tile
         * after the wait, only that row; a split of two tiles or more has
         * its second tile in flight too (the double buffer's other half) */
        const int old_rows = q_len ? n_vis - 1 : start_pos;
        const int n0 = max(0, min(DEC_TT, t_end - t_begin));
        const int n1 = n0 == DEC_TT ? max(0, min(DEC_TT, t_end - t_begin - DEC_TT)) : 0;
        const int o0 = min(n0, max(0, old_rows - t_begin)), o1 = min(n1, max(0, old_rows - t_begin - DEC_TT));
        float *tile1 = tiles + DEC_TT * DP;
        if (n0) {
            if constexpr (BULK) {
                /* each buffer's one arrival announces all its rows, those
                 * copied after the wait included: its phase cannot complete
                 * before they have landed */
                if (warp == 0) {
                    if (lane == 0) {
                        cu_bulk_expect(mbar, (unsigned)(n0 * D * 4));
                        if (n1)
                            cu_bulk_expect(mbar + 1, (unsigned)(n1 * D * 4));
                    }
                    __syncwarp();
                    dec_tile_bulk(tiles, mbar, cache, btab, t_begin, 0, o0, D, DP, n_layers, layer, bs, lane);
                    dec_tile_bulk(tile1, mbar + 1, cache, btab, t_begin + DEC_TT, 0, o1, D, DP, n_layers, layer, bs,
                                  lane);
                }
            } else {
                dec_tile_load(tiles, cache, btab, t_begin, o0, D4, DP, n_layers, layer, bs, tid);
                dec_tile_load(tile1, cache, btab, t_begin + DEC_TT, o1, D4, DP, n_layers, layer, bs, tid);
                __pipeline_commit();
            }
            /* rows past the split's end are zero (see load_tile) */
            for (int k = n0 * D4 + tid; k < DEC_TT * D4; k += DEC_THREADS)
                ((float4 *)(tiles + (k / D4) * DP))[k % D4] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (n1)
                for (int k = n1 * D4 + tid; k < DEC_TT * D4; k += DEC_THREADS)
                    ((float4 *)(tile1 + (k / D4) * DP))[k % D4] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
        cu_pdl_wait();
        cu_pdl_launch_dependents();
        MLA_PROBE(0, 1);
        if (n0) {
            if constexpr (BULK) {
                if (warp == 0) {
                    dec_tile_bulk(tiles, mbar, cache, btab, t_begin, o0, n0, D, DP, n_layers, layer, bs, lane);
                    dec_tile_bulk(tile1, mbar + 1, cache, btab, t_begin + DEC_TT, o1, n1, D, DP, n_layers, layer, bs,
                                  lane);
                }
            } else {
                dec_tile_load(tiles + o0 * DP, cache, btab, t_begin + o0, n0 - o0, D4, DP, n_layers, layer, bs, tid);
                dec_tile_load(tile1 + o1 * DP, cache, btab, t_begin + DEC_TT + o1, n1 - o1, D4, DP, n_layers, layer,
                              bs, tid);
                __pipeline_commit();
            }
            first_loaded = true;
            second_loaded = n1 > 0;
        }
    }

    if (!first_loaded)
        load_tile(0, t_begin);

    /* warp w's q fragments (columns c0 .. c0 + 8 KQ), heads g and g + 8 */
    const int c0 = warp * 8 * KQ;
    unsigned qa[KQ][4];
    {
        const bool va = h0 + g < nh, vb = h0 + g + 8 < nh;
        const float *qg = ql + ((size_t)i * nh + h0 + g) * D, *qg8 = qg + 8 * (size_t)D;
#pragma unroll
        for (int ks = 0; ks < KQ; ks++) {
            const int c = c0 + 8 * ks + t;
            qa[ks][0] = to_tf32(va ? qg[c] : 0.0f);
            qa[ks][1] = to_tf32(vb ? qg8[c] : 0.0f);
            qa[ks][2] = to_tf32(va ? qg[c + 4] : 0.0f);
            qa[ks][3] = to_tf32(vb ? qg8[c + 4] : 0.0f);
        }
    }
    if (tid < DEC_HG) {
        mrow[tid] = -INFINITY;
        lrow[tid] = 0.0f;
    }
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++)
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

    if constexpr (BULK)
        __syncthreads(); /* the mbarriers' init, for the warps other than 0 */
    int buf = 0;
    unsigned parity = 0; /* BULK: bit b, the phase of buffer b's next wait */
    for (int t0 = t_begin; t0 < t_end; t0 += DEC_TT, buf ^= 1) {
        const int nt = min(DEC_TT, t_end - t0);
        if (t0 + DEC_TT < t_end && !(second_loaded && t0 == t_begin)) {
            load_tile(buf ^ 1, t0 + DEC_TT);
            if constexpr (!BULK)
                __pipeline_wait_prior(1);
        } else if constexpr (!BULK) {
            __pipeline_wait_prior(0);
        }
        if constexpr (BULK) {
            cu_mbar_wait(mbar + buf, (parity >> buf) & 1u);
            parity ^= 1u << buf;
        }
        __syncthreads(); /* (BULK too: the zeroed rows are other threads' stores) */
        MLA_PROBE(0, t0 == t_begin ? 2 : t0 == t_begin + DEC_TT ? 4 : 5);
        const float *tile = tiles + buf * DEC_TT * DP;

        /* S partial over this warp's columns, rows 8j + g of the tile */
        float s[4][4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KQ; ks++) {
            const int c = c0 + 8 * ks + t;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float *kr = tile + (8 * j + g) * DP + c;
                mma1688(s[j], qa[ks], to_tf32(kr[0]), to_tf32(kr[4]));
            }
        }
        float *sw = sred + warp * DEC_HG * DTC_SRP;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            *(float2 *)(sw + g * DTC_SRP + 8 * j + 2 * t) = make_float2(s[j][0], s[j][1]);
            *(float2 *)(sw + (g + 8) * DTC_SRP + 8 * j + 2 * t) = make_float2(s[j][2], s[j][3]);
        }
        __syncthreads();
        if (t0 - t_begin < 2 * DEC_TT)
            MLA_PROBE(0, t0 == t_begin ? 7 : 9);

        /* online softmax: warp w, heads w and w + 8, lane = row */
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int hh = warp + 8 * k;
            float sc = 0.0f;
#pragma unroll
            for (int w = 0; w < 8; w++)
                sc += sred[(w * DEC_HG + hh) * DTC_SRP + lane];
            sc = lane < nt ? sc * scale : -INFINITY;
            const float m_old = mrow[hh];
            const float m_new = fmaxf(m_old, cu_warp_max(sc)); /* finite: row 0 of the tile is real */
            const float p = lane < nt ? expf(sc - m_new) : 0.0f;
            const float lt = cu_warp_sum(p);
            ps[hh * DTC_PSP + lane] = p;
            if (lane == 0) {
                const float a = expf(m_old - m_new); /* 0 on the first tile */
                lrow[hh] = lrow[hh] * a + lt;
                mrow[hh] = m_new;
                arow[hh] = a;
            }
        }
        __syncthreads();
        if (t0 - t_begin < 2 * DEC_TT)
            MLA_PROBE(0, t0 == t_begin ? 8 : 10);

        /* O += P · V over this warp's kvr / 8 columns */
        const float al0 = arow[g], al1 = arow[g + 8];
#pragma unroll
        for (int n = 0; n < NT; n++) {
            o[n][0] *= al0;
            o[n][1] *= al0;
            o[n][2] *= al1;
            o[n][3] *= al1;
        }
#pragma unroll
        for (int kt = 0; kt < DEC_TT / 8; kt++) {
            /* κ = t: row 8 kt + 2t; κ = t + 4: row 8 kt + 2t + 1 */
            const float2 pa = *(const float2 *)(ps + g * DTC_PSP + 8 * kt + 2 * t);
            const float2 pb = *(const float2 *)(ps + (g + 8) * DTC_PSP + 8 * kt + 2 * t);
            const unsigned a[4] = {to_tf32(pa.x), to_tf32(pb.x), to_tf32(pa.y), to_tf32(pb.y)};
            const float *v0 = tile + (8 * kt + 2 * t) * DP + warp * 8 * NT + g, *v1 = v0 + DP;
#pragma unroll
            for (int n = 0; n < NT; n++)
                mma1688(o[n], a, to_tf32(v0[8 * n]), to_tf32(v1[8 * n]));
        }
        if (t0 == t_begin)
            MLA_PROBE(0, 11);
        if (t0 + DEC_TT >= t_end) {
            MLA_PROBE(0, 12);
            MLA_PROBE_BY(0, 13, 224);
        }
        __syncthreads(); /* the tile buffer, sred, ps and arow are rewritten next */
        if (t0 == t_begin)
            MLA_PROBE(0, 3);
    }
    MLA_PROBE(0, 5);

    /* o[n]: heads g (0, 1) and g + 8 (2, 3), columns warp·8NT + 8n + 2t, +1 */
    const bool va = h0 + g < nh, vb = h0 + g + 8 < nh;
    float *oa = part_o + (pi + (size_t)g * n_splits) * KVR + warp * 8 * NT + 2 * t;
    float *ob = part_o + (pi + (size_t)(g + 8) * n_splits) * KVR + warp * 8 * NT + 2 * t;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        if (va)
            *(float2 *)(oa + 8 * n) = make_float2(o[n][0], o[n][1]);
        if (vb)
            *(float2 *)(ob + 8 * n) = make_float2(o[n][2], o[n][3]);
    }
    if (tid < DEC_HG && h0 + tid < nh) {
        part_m[pi + (size_t)tid * n_splits] = mrow[tid];
        part_l[pi + (size_t)tid * n_splits] = lrow[tid];
    }
    MLA_PROBE(0, 6);
}

/* Block (query i, head h): o_lat = Σ_s e^{m_s - M} o_s / Σ_s e^{m_s - M} l_s,
 * then out[i, h] = W_UV[h] · o_lat (W_UV[h]: rows h*(dn+dv)+dn .. +dv-1 of
 * kv_b), one warp per output row. Splits that saw no token have l = 0 and
 * o = 0. */
#define CMB_THREADS 256
#define CMB_Z 4 /* k_mla_combine8: blocks a (query, head), each merging the splits and applying a quarter of W_UV */
#define CMB_FK 16 /* k_mla_combine8 with PRE: the live splits' pieces a thread loads at once (of 2 CMB_FK splits a
                     column group) */
#define CMB_FK_CL 17 /* the same with CL (of CMB_THREADS / (kvr / 16) CMB_FK_CL splits: 136 for kvr 512, so
                        decode's one split a SM fits on the H100 and H200, 132 SMs) */
template <typename W>
static __global__ void __launch_bounds__(CMB_THREADS)
    k_mla_combine(int nh, int dn, int dv, int kvr, int n_splits, const float *__restrict__ part_m,
                  const float *__restrict__ part_l, const float *__restrict__ part_o, const W *__restrict__ kvb,
                  float *__restrict__ out) {
    cu_pdl_launch_dependents();
    extern __shared__ float4 smem4[];
    float *olat = (float *)smem4, *wsp = olat + kvr; /* [kvr], [n_splits] */
    __shared__ float red[CMB_THREADS / 32];
    __shared__ float bcast;
    const int i = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const size_t base = ((size_t)i * nh + h) * n_splits;
    float m = -INFINITY;
    for (int s = tid; s < n_splits; s += CMB_THREADS)
        if (part_l[base + s] > 0.0f)
            m = fmaxf(m, part_m[base + s]);
    m = cu_warp_max(m);
    if (lane == 0)
        red[warp] = m;
    __syncthreads();
    if (tid == 0) {
        float M = red[0];
        for (int w = 1; w < CMB_THREADS / 32; w++)
            M = fmaxf(M, red[w]);
        bcast = M;
    }
    __syncthreads();
    const float M = bcast; /* finite: split 0 holds token 0 */
    float lsum = 0.0f;
    for (int s = tid; s < n_splits; s += CMB_THREADS) {
        const float l = part_l[base + s];
        const float w = l > 0.0f ? expf(part_m[base + s] - M) : 0.0f;
        wsp[s] = w;
        lsum += w * l;
    }
    lsum = cu_warp_sum(lsum);
    __syncthreads(); /* bcast and red were read */
    if (lane == 0)
        red[warp] = lsum;
    __syncthreads();
    if (tid == 0) {
        float L = 0.0f;
        for (int w = 0; w < CMB_THREADS / 32; w++)
            L += red[w];
        bcast = 1.0f / L;
    }
    __syncthreads();
    const float inv_l = bcast;
    for (int c = tid; c < kvr; c += CMB_THREADS) {
        const float *po = part_o + base * kvr + c;
        float o = 0.0f;
#pragma unroll 8
        for (int s = 0; s < n_splits; s++)
            o += wsp[s] * po[(size_t)s * kvr];
        olat[c] = o * inv_l;
    }
    __syncthreads();
    const W *wuv = kvb + ((size_t)h * (dn + dv) + dn) * kvr;
    for (int d = warp; d < dv; d += CMB_THREADS / 32) {
        float s = 0.0f;
        for (int c = lane; c < kvr; c += 32)
            s += cu_ldw(wuv, (size_t)d * kvr + c) * olat[c];
        s = cu_warp_sum(s);
        if (lane == 0)
            out[((size_t)i * nh + h) * dv + d] = s;
    }
}

/* The same merge and W_UV, with the work spread for one query: the splits
 * that saw tokens are listed first (an empty split costs nothing more),
 * each thread merges its columns over them with independent loads, and
 * W_UV[h] (dv × kvr) is read with 16-byte loads, warp w taking rows w,
 * w + 8, ..., a lane 8 columns at a time. The first version (k_mla_combine,
 * kept for shapes this one does not take) read W_UV one element a load and
 * every split's partial, ~34 µs a layer at batch 1. Needs kvr % 8 == 0.
 *
 * CL (with PRE; launched as clusters of the CMB_Z blocks of a (query, head),
 * cluster rank = blockIdx.z; sm_90): each block merges only a quarter
 * of the latent columns, its rank's, over every live split (thread (s, c):
 * column group c of the quarter, splits s, s + CMB_THREADS / Q4, ...; all
 * of a thread's pieces loaded at once right after the wait where the
 * live splits fit, CMB_FK_CL a thread), the quarters meet in shared memory
 * and every block gathers the whole o_lat from the four blocks' quarters
 * through distributed shared memory, then applies its rows of W_UV as
 * without CL. The partials are read once a (query, head), not once a
 * block: at 8K (129 of 132 splits live) 64.5 KiB a block in one round
 * trip instead of 258 KiB in eight. Same sums, in another order (fp32). */
template <typename W, bool PRE = false, bool CL = false>
static __global__ void __launch_bounds__(CMB_THREADS)
    k_mla_combine8(int nh, int dn, int dv, int kvr, int n_splits, const float *__restrict__ part_m,
                   const float *__restrict__ part_l, const float *__restrict__ part_o, const W *__restrict__ kvb,
                   float *__restrict__ out, const int *__restrict__ q_len, int min_chunk) {
    static_assert(!PRE || std::is_same<W, __nv_bfloat16>::value, "PRE loads bf16 weights");
    static_assert(!CL || PRE, "the cluster merge is the PDL one's");
    MLA_PROBE(1, 0);
    if (!PRE)
        cu_pdl_launch_dependents();
    extern __shared__ float4 smem4[];
    float *olat = (float *)smem4, *wsp = olat + kvr; /* [kvr], [n_splits] */
    int *act = (int *)(wsp + n_splits);               /* [n_splits], then oh: the partial sums (below) */
    __shared__ int n_act;
    __shared__ float inv_l;
    const int i = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const size_t base = ((size_t)i * nh + h) * n_splits;
    const W *wuv = kvb + ((size_t)h * (dn + dv) + dn) * kvr;
    const int G8 = kvr / 8, per = (dv + gridDim.z - 1) / gridDim.z;
    const int d0 = blockIdx.z * per, d1 = min(dv, d0 + per);
    /* PRE (launched by PDL, bf16): where the block's W_UV rows take one pass
     * (at most 4 rows a warp, 64 column groups: V2 and V3), each lane's
     * 16-byte pieces of them are loaded before the wait; the next kernel
     * launches after it */
    constexpr int NG = 2; /* column groups a lane in PRE */
    const bool pre = PRE && per <= 4 * (CMB_THREADS / 32) && G8 <= 32 * NG;
    uint4 wpre[4][NG];
    int na_pred = 0;
    if constexpr (PRE) {
        if (pre)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int d = d0 + warp + r * (CMB_THREADS / 32);
#pragma unroll
                for (int gi = 0; gi < NG; gi++) {
                    const int g = lane + 32 * gi;
                    wpre[r][gi] = d < d1 && g < G8 ? __ldg((const uint4 *)(wuv + (size_t)d * kvr + g * 8))
                                                   : make_uint4(0u, 0u, 0u, 0u);
                }
            }
        /* the splits that saw tokens, from the query's length (written by
         * the host before the graph; k_mla_decode_tc's chunks): 0 .. na_pred - 1 */
        if (q_len) {
            const int n_vis = q_len[i];
            const int chunk = (max((n_vis + n_splits - 1) / n_splits, min_chunk) + DEC_TT - 1) / DEC_TT * DEC_TT;
            na_pred = min(n_splits, (n_vis + chunk - 1) / chunk);
        }
        cu_pdl_wait();
        cu_pdl_launch_dependents();
        MLA_PROBE(1, 1);
    }
    /* PRE with at most s_step · FK live splits (FK: CMB_FK, CMB_FK_CL with CL): each thread's column
     * group of every live split it sums is loaded now, beside warp 0's loads
     * of m and l, instead of after the weights are known (one round trip to
     * L2 after the wait instead of three). Thread (s0, c4): column group c4,
     * splits s0, s0 + s_step, ...; without CL s0 is the half of the block
     * and c4 any of the kvr / 4, with CL s0 is one of CMB_THREADS / Q4 and
     * c4 one of this block's quarter (a rank's Q4 groups). */
    const int K4 = kvr / 4, Q4 = K4 / CMB_Z;
    const int s_step = CL ? CMB_THREADS / Q4 : 2, s0 = CL ? tid / Q4 : tid / (CMB_THREADS / 2);
    const int c4 = CL ? (int)blockIdx.z * Q4 + tid % Q4 : tid % (CMB_THREADS / 2);
    const bool mine = c4 < K4; /* without CL, threads past kvr / 4 merge nothing */
    constexpr int FK = CL ? CMB_FK_CL : CMB_FK;
    const bool fast = PRE && na_pred > 0 && na_pred <= s_step * FK && (CL || K4 <= CMB_THREADS / 2);
    float4 fv[FK];
    if (fast)
#pragma unroll
        for (int kk = 0; kk < FK; kk++) {
            const int k = s0 + s_step * kk;
            fv[kk] = k < na_pred && mine ? ((const float4 *)(part_o + (base + k) * kvr))[c4]
                                         : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    if (warp == 0) {
        /* lane j holds splits j, j + 32, ... (n_splits <= DEC_MAX_SPLITS) */
        float lv[DEC_MAX_SPLITS / 32], mv[DEC_MAX_SPLITS / 32];
        float M = -INFINITY;
#pragma unroll
        for (int k = 0; k < DEC_MAX_SPLITS / 32; k++) {
            const int s = lane + 32 * k;
            lv[k] = s < n_splits ? part_l[base + s] : 0.0f;
            mv[k] = s < n_splits ? part_m[base + s] : -INFINITY;
            if (lv[k] > 0.0f)
                M = fmaxf(M, mv[k]);
        }
        M = cu_warp_max(M); /* finite: split 0 holds token 0 */
        float L = 0.0f;
        int na = 0;
#pragma unroll
        for (int k = 0; k < DEC_MAX_SPLITS / 32; k++) {
            const bool on = lv[k] > 0.0f;
            const unsigned bal = __ballot_sync(0xffffffffu, on);
            if (on) {
                const int at = na + __popc(bal & ((1u << lane) - 1u));
                const float w = expf(mv[k] - M);
                wsp[at] = w;
                act[at] = lane + 32 * k;
                L += w * lv[k];
            }
            na += __popc(bal);
        }
        L = cu_warp_sum(L);
        if (lane == 0) {
            n_act = na;
            inv_l = 1.0f / L;
        }
    }
    __syncthreads();
    /* merge: thread (s0, column group c4) sums every s_step-th live split
     * with 16-byte loads; the s_step sums of a column group meet in shared
     * memory (oh: [s_step][K4, or Q4 with CL]) */
    const int na = n_act;
    float4 *oh = (float4 *)(act + n_splits + 2 * (n_splits & 1)); /* 16-byte aligned */
    const int oh_w = CL ? Q4 : K4, c_oh = CL ? tid % Q4 : c4;      /* a row of oh; this thread's place in it */
    if (fast && na == na_pred && act[na - 1] == na - 1) { /* the live splits are 0 .. na - 1: the loop below's sums */
        if (mine) {
            float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int kk = 0; kk < FK; kk++) {
                const int k = s0 + s_step * kk;
                if (k < na) {
                    const float w = wsp[k];
                    o.x = fmaf(w, fv[kk].x, o.x);
                    o.y = fmaf(w, fv[kk].y, o.y);
                    o.z = fmaf(w, fv[kk].z, o.z);
                    o.w = fmaf(w, fv[kk].w, o.w);
                }
            }
            oh[s0 * oh_w + c_oh] = o;
        }
    } else
    for (int c = c4, ch = c_oh; c < (CL ? c4 + 1 : K4); c += CMB_THREADS / 2, ch += CMB_THREADS / 2) {
        const float4 *po = (const float4 *)(part_o + base * kvr) + c;
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
        for (int k = s0; k < na; k += s_step) {
            const float w = wsp[k];
            const float4 v = po[(size_t)act[k] * K4];
            o.x = fmaf(w, v.x, o.x);
            o.y = fmaf(w, v.y, o.y);
            o.z = fmaf(w, v.z, o.z);
            o.w = fmaf(w, v.w, o.w);
        }
        oh[s0 * oh_w + ch] = o;
    }
    __syncthreads();
    if constexpr (CL) {
        /* this block's quarter of o_lat (qtr, after oh), then the whole
         * o_lat from the cluster's four quarters; every block arrives once
         * more after its reads and waits for the others' before it ends */
        float4 *qtr = oh + CMB_THREADS;
        if (tid < Q4) {
            float4 q = oh[tid];
            for (int r = 1; r < s_step; r++) {
                const float4 v = oh[r * Q4 + tid];
                q.x += v.x;
                q.y += v.y;
                q.z += v.z;
                q.w += v.w;
            }
            qtr[tid] = make_float4(q.x * inv_l, q.y * inv_l, q.z * inv_l, q.w * inv_l);
        }
        cu_cluster_arrive();
        cu_cluster_wait();
        for (int c = tid; c < K4; c += CMB_THREADS)
            ((float4 *)olat)[c] = *cooperative_groups::this_cluster().map_shared_rank(qtr + c % Q4, c / Q4);
        cu_cluster_arrive();
    } else {
        for (int c = tid; c < K4; c += CMB_THREADS) {
            const float4 a = oh[c], b = oh[K4 + c];
            ((float4 *)olat)[c] = make_float4((a.x + b.x) * inv_l, (a.y + b.y) * inv_l, (a.z + b.z) * inv_l,
                                              (a.w + b.w) * inv_l);
        }
    }
    __syncthreads();
    MLA_PROBE(1, 2);
    /* W_UV rows of this block (blockIdx.z of gridDim.z): warp w takes rows
     * w, w + 8, w + 16, w + 24 of a pass, so a lane has four 16-byte loads
     * in flight per column group */
    if (pre) { /* the loop below's sums, in its order, from wpre (zeros: rows past d1 add nothing) */
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int gi = 0; gi < NG; gi++) {
            const int g = lane + 32 * gi;
            if (g >= G8)
                break;
            const float4 a = ((const float4 *)olat)[2 * g], b = ((const float4 *)olat)[2 * g + 1];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                float w[8];
                mla_cvt8(wpre[r][gi], w);
                float t = acc[r];
                t = fmaf(w[0], a.x, t);
                t = fmaf(w[1], a.y, t);
                t = fmaf(w[2], a.z, t);
                t = fmaf(w[3], a.w, t);
                t = fmaf(w[4], b.x, t);
                t = fmaf(w[5], b.y, t);
                t = fmaf(w[6], b.z, t);
                t = fmaf(w[7], b.w, t);
                acc[r] = t;
            }
        }
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const float t = cu_warp_sum(acc[r]);
            const int d = d0 + warp + r * (CMB_THREADS / 32);
            if (lane == 0 && d < d1)
                out[((size_t)i * nh + h) * dv + d] = t;
        }
        MLA_PROBE(1, 6);
        if constexpr (CL)
            cu_cluster_wait(); /* the other blocks have read this one's quarter */
        return;
    }
    for (int dd = d0 + warp; dd < d1; dd += 4 * (CMB_THREADS / 32)) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int g = lane; g < G8; g += 32) {
            float w[4][8];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int d = dd + r * (CMB_THREADS / 32);
                if (d < d1)
                    mla_ld8(wuv + (size_t)d * kvr + g * 8, w[r]);
                else
#pragma unroll
                    for (int u = 0; u < 8; u++)
                        w[r][u] = 0.0f;
            }
            const float4 a = ((const float4 *)olat)[2 * g], b = ((const float4 *)olat)[2 * g + 1];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                float t = acc[r];
                t = fmaf(w[r][0], a.x, t);
                t = fmaf(w[r][1], a.y, t);
                t = fmaf(w[r][2], a.z, t);
                t = fmaf(w[r][3], a.w, t);
                t = fmaf(w[r][4], b.x, t);
                t = fmaf(w[r][5], b.y, t);
                t = fmaf(w[r][6], b.z, t);
                t = fmaf(w[r][7], b.w, t);
                acc[r] = t;
            }
        }
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const float t = cu_warp_sum(acc[r]);
            const int d = dd + r * (CMB_THREADS / 32);
            if (lane == 0 && d < d1)
                out[((size_t)i * nh + h) * dv + d] = t;
        }
    }
    MLA_PROBE(1, 6);
    if constexpr (CL)
        cu_cluster_wait();
}

/* ---- launchers -------------------------------------------------------- */

static cudaError_t expanded_launch(const pd_mla_args *a, const int *btab, float *lat, float *kpe, const float *kv,
                                   int stage, cudaStream_t s) {
    int L = a->start_pos + a->n_q;
    if (stage == 0) {
        k_mla_gather<<<L, 128, 0, s>>>(a->kv_lora_rank, a->qk_rope_dim, a->cache, a->n_layers, a->layer,
                                       a->block_size, btab, lat, kpe);
    } else {
        size_t smem = (size_t)(a->qk_nope_dim + a->qk_rope_dim + PF_THREADS + 8) * sizeof(float);
        k_mla_prefill<<<dim3(a->n_q, a->n_heads), PF_THREADS, smem, s>>>(
            a->n_heads, a->qk_nope_dim, a->qk_rope_dim, a->v_dim, a->softmax_scale, a->start_pos, a->q, kv, kpe,
            a->out);
    }
    return cudaGetLastError();
}

static size_t decode_smem(int D) {
    return ((size_t)(DEC_HG + DEC_TT) * (D + 4) + DEC_TT * DEC_HG + 3 * DEC_HG) * sizeof(float);
}

/* The absorbed form's three launches (q_lat, split attention, merge with
 * W_UV) for n_q queries; q_len/q_boff as k_mla_decode takes them. */
typedef struct {
    int nh, dn, dr, dv, kvr, n_q, start_pos, n_layers, layer, bs, n_splits, min_chunk;
    int first_kernels; /* the first version's q_lat (bit 0) and merge (bit 1) kernels, for A/B runs */
    int tc;            /* the split attention on tensor cores (k_mla_decode_tc) */
    int qlat_cols;     /* k_mla_qlat8's latent columns a block (PD_QLAT_COLS=256, A/B runs; else QL_COLS) */
    int pdl;           /* bf16: the q_lat, split and merge kernels by PDL, loading weights / a tile before the wait */
    int cmb_slow;      /* PD_MLA_MERGE_FAST=0: k_mla_combine8 without its one-round-trip path (A/B runs) */
    int tile_pre1;     /* PD_MLA_TILE_PRE=1: k_mla_decode_tc loads before its wait only a first tile of old rows */
    int tile_bulk;     /* k_mla_decode_tc<PRE 2>'s tiles by bulk copies (BULK; PD_MLA_TILE_BULK=0: by cp.async) */
    int qlat_pre1;     /* PD_QLAT_PRE=1: k_mla_qlat8's prologue reads and ropes all after its wait */
    int merge_cl;      /* k_mla_combine8 by PDL as clusters (CL; sm_90, unless PD_MLA_MERGE_CLUSTER=0) */
    float scale;
    const float *q, *cache;
    const int *q_len, *q_boff, *btab;
    float *ql, *part, *out;
    qlat_prep prep; /* prep.on: the attention prologue folded into k_mla_qlat8 (absorbed_prep_folds) */
} absorbed_call;

/* Whether absorbed_launch takes k_mla_qlat8, which can fold the prologue in. */
static bool absorbed_qlat8(const absorbed_call *a, const void *kvb) {
    return a->kvr % 8 == 0 && ((uintptr_t)kvb & 15) == 0 && !(a->first_kernels & 1) && a->dn <= QL_DN_MAX;
}

template <typename W>
static cudaError_t absorbed_launch(const absorbed_call *a, const W *kvb, cudaStream_t s) {
    const int nh = a->nh, kvr = a->kvr, n_splits = a->n_splits;
    const bool v8 = kvr % 8 == 0 && ((uintptr_t)kvb & 15) == 0 && !(a->first_kernels & 2);
    constexpr bool BF = std::is_same<W, __nv_bfloat16>::value; /* the PDL variants load bf16 weights */
    cudaLaunchAttribute at;
    cudaError_t e;
    if (absorbed_qlat8(a, kvb)) {
        /* W_UK is 2 MB for V2-Lite: 64 columns a block spread it over ~130
         * SMs (256: 34 blocks, A/B runs); by PDL with each thread's W_UK rows
         * in registers before the wait where they fit (dn <= 4 slices) */
        const int cols = a->qlat_cols == 256 ? 256 : QL_COLS;
        const dim3 grid(nh + (a->prep.on ? 1 : 0), (kvr + cols - 1) / cols, (a->n_q + QL_QB - 1) / QL_QB);
        void (*kern)(int, int, int, int, int, int, float *, const W *, float *, qlat_prep) =
            cols == 256 ? k_mla_qlat8<W, 256> : k_mla_qlat8<W, QL_COLS>;
        bool pdl = false;
        if constexpr (BF)
            if (a->pdl && cols == QL_COLS && a->dn <= 4 * (QL_THREADS / (QL_COLS / 8))) {
                kern = !a->qlat_pre1 && a->dr <= 2 * QL_THREADS && a->kvr <= QLP_K * QL_THREADS
                           ? k_mla_qlat8<W, QL_COLS, 2>
                           : k_mla_qlat8<W, QL_COLS, 1>;
                pdl = true;
            }
        cudaLaunchConfig_t cfg = cu_launch_config(grid, dim3(QL_THREADS), 0, s, pdl, &at);
        e = cudaLaunchKernelEx(&cfg, kern, a->n_q, nh, a->dn, a->dr, a->dv, kvr, (float *)a->q, kvb, a->ql, a->prep);
    } else {
        k_mla_qlat<W><<<dim3(a->n_q, nh, (kvr + QLAT_THREADS - 1) / QLAT_THREADS), QLAT_THREADS,
                        a->dn * sizeof(float), s>>>(nh, a->dn, a->dr, a->dv, kvr, a->q, kvb, a->ql);
        e = cudaGetLastError();
    }
    if (e != cudaSuccess)
        return e;
    size_t n_part = (size_t)a->n_q * nh * n_splits;
    float *part_o = a->part, *part_m = a->part + n_part * kvr, *part_l = part_m + n_part;
    size_t smem = decode_smem(kvr + a->dr);
    dim3 grid((unsigned)(a->n_q * n_splits), (unsigned)((nh + DEC_HG - 1) / DEC_HG));
#ifdef PD_CUDA_PROBE
    mla_probe_enable();
#endif
    if (a->tc) { /* absorbed_tc: kvr 512, dr 64; by PDL with its first tile loaded before the wait */
        smem = decode_tc_smem(kvr + a->dr);
        auto kern = !a->pdl         ? k_mla_decode_tc<9, 8, 0>
                    : a->tile_pre1 ? k_mla_decode_tc<9, 8, 1>
                    : a->tile_bulk ? k_mla_decode_tc<9, 8, 2, true>
                                   : k_mla_decode_tc<9, 8, 2>;
        /* CU_SMEM_OPTIN remembers per call site: one for each kernel */
        if ((e = !a->pdl         ? CU_SMEM_OPTIN((k_mla_decode_tc<9, 8, 0>), smem)
                 : a->tile_pre1 ? CU_SMEM_OPTIN((k_mla_decode_tc<9, 8, 1>), smem)
                 : a->tile_bulk ? CU_SMEM_OPTIN((k_mla_decode_tc<9, 8, 2, true>), smem)
                                : CU_SMEM_OPTIN((k_mla_decode_tc<9, 8, 2>), smem)) != cudaSuccess)
            return e;
        cudaLaunchConfig_t cfg = cu_launch_config(grid, dim3(DEC_THREADS), smem, s, a->pdl, &at);
        e = cudaLaunchKernelEx(&cfg, kern, nh, a->scale, a->start_pos, a->q_len, a->q_boff, n_splits, a->min_chunk,
                               (int)!v8, (const float *)a->ql, a->cache, a->n_layers, a->layer, a->bs, a->btab, part_m,
                               part_l, part_o);
        if (e != cudaSuccess)
            return e;
    } else if (kvr <= 512) {
        if ((e = CU_SMEM_OPTIN(k_mla_decode<1>, smem)) != cudaSuccess)
            return e;
        k_mla_decode<1><<<grid, DEC_THREADS, smem, s>>>(nh, kvr, a->dr, a->scale, a->start_pos, a->q_len, a->q_boff,
                                                        n_splits, a->min_chunk, a->ql, a->cache, a->n_layers, a->layer, a->bs,
                                                        a->btab, part_m, part_l, part_o);
    } else {
        if ((e = CU_SMEM_OPTIN(k_mla_decode<2>, smem)) != cudaSuccess)
            return e;
        k_mla_decode<2><<<grid, DEC_THREADS, smem, s>>>(nh, kvr, a->dr, a->scale, a->start_pos, a->q_len, a->q_boff,
                                                        n_splits, a->min_chunk, a->ql, a->cache, a->n_layers, a->layer, a->bs,
                                                        a->btab, part_m, part_l, part_o);
    }
    if ((e = cudaGetLastError()) != cudaSuccess)
        return e;
    if (v8) { /* by PDL with the W_UV pieces loaded before the wait */
        void (*kern)(int, int, int, int, int, const float *, const float *, const float *, const W *, float *,
                     const int *, int) = k_mla_combine8<W>;
        bool pdl = false, cl = false;
        const int q4 = kvr / 4 / CMB_Z;
        if constexpr (BF)
            if (a->pdl) {
                /* by clusters of the CMB_Z blocks a (query, head) where a
                 * quarter of the latent's column groups divides the block */
                cl = a->merge_cl && (kvr / 4) % CMB_Z == 0 && CMB_THREADS % q4 == 0;
                kern = cl ? k_mla_combine8<W, true, true> : k_mla_combine8<W, true>;
                pdl = true;
            }
        const size_t cmb_smem = cl ? (kvr + 2 * n_splits + 8) * sizeof(float) + (CMB_THREADS + q4) * sizeof(float4)
                                   : (3 * kvr + 2 * n_splits + 8) * sizeof(float);
        cudaLaunchAttribute ats[2];
        cudaLaunchConfig_t cfg = cu_launch_config(dim3(a->n_q, nh, CMB_Z), dim3(CMB_THREADS), cmb_smem, s, pdl, ats);
        if (cl) { /* after PDL's attribute, if any */
            cudaLaunchAttribute *ca = &ats[cfg.numAttrs];
            ca->id = cudaLaunchAttributeClusterDimension;
            ca->val.clusterDim.x = 1;
            ca->val.clusterDim.y = 1;
            ca->val.clusterDim.z = CMB_Z;
            cfg.attrs = ats;
            cfg.numAttrs++;
        }
        return cudaLaunchKernelEx(&cfg, kern, nh, a->dn, a->dv, kvr, n_splits, (const float *)part_m,
                                  (const float *)part_l, (const float *)part_o, kvb, a->out,
                                  a->q_len && !a->cmb_slow ? a->q_len : (const int *)NULL, a->min_chunk);
    }
    k_mla_combine<W><<<dim3(a->n_q, nh), CMB_THREADS, (kvr + n_splits) * sizeof(float), s>>>(
        nh, a->dn, a->dv, kvr, n_splits, part_m, part_l, part_o, kvb, a->out);
    return cudaGetLastError();
}

static bool absorbed_shape_ok(cu_ctx *c, int kvr, int dr, const float *cache, const char *what) {
    if (kvr % 4 || dr % 4 || kvr > 1024 || ((uintptr_t)cache & 15) || decode_smem(kvr + dr) > c->smem_optin) {
        cu_fail(c, PD_ERR_UNSUPPORTED,
                "%s: latent %d and rope %d must be multiples of 4, latent <= 1024, the cache 16-byte aligned, %zu "
                "bytes of shared memory available (%zu)",
                what, kvr, dr, decode_smem(kvr + dr), c->smem_optin);
        return false;
    }
    return true;
}

static void absorbed_run(cu_ctx *c, absorbed_call *ac, const pd_weight *kv_b) {
    ac->ql = (float *)cu_scratch(c, CU_SCR_MLA_QL, (size_t)ac->n_q * ac->nh * (ac->kvr + ac->dr) * sizeof(float));
    ac->part = (float *)cu_scratch(c, CU_SCR_MLA_PART,
                                   (size_t)ac->n_q * ac->nh * ac->n_splits * (ac->kvr + 2) * sizeof(float));
    if (!ac->ql || !ac->part)
        return;
    /* tensor cores where the weights are bf16 anyway (the f32 format keeps
     * the fp32 kernel: its tests compare with the CPU at 1e-5) */
    ac->qlat_cols = c->qlat_cols;
    ac->tc = c->wfmt == PD_CUDA_WEIGHTS_BF16 && !c->mla_decode_scalar && ac->kvr == 512 && ac->dr == 64 &&
             decode_tc_smem(ac->kvr + ac->dr) <= c->smem_optin;
    ac->pdl = c->pdl && !c->mla_pdl_off && c->wfmt == PD_CUDA_WEIGHTS_BF16;
    ac->cmb_slow = c->mla_merge_slow;
    ac->tile_pre1 = c->mla_tile_pre1;
    ac->tile_bulk = c->mla_tile_bulk; /* false before sm_90 (backend_cuda.cu) */
    ac->qlat_pre1 = c->mla_qlat_pre1;
    /* the merge by clusters where the merge weighs more splits than the
     * one-round-trip merge loads (2 CMB_FK) and has at most one block a SM.
     * Decode's split count follows the batch, not the lengths (they are on
     * the device in a graph): the SM count at batch 1 and 2 (132 on the
     * H200), so with V2-Lite's 16 heads every batch-1 and batch-2 step
     * takes it, at any length (8K: -32 to -67 us a step, 1K: the same
     * within the spread); at batch 8 and 32 it made every step slower
     * (docs/benchmarks.md, session 20) */
    ac->merge_cl = c->mla_merge_cl && ac->n_splits > 2 * CMB_FK && (long)ac->n_q * ac->nh * CMB_Z <= c->n_sm;
    cudaError_t e = c->wfmt == PD_CUDA_WEIGHTS_BF16
                        ? absorbed_launch<__nv_bfloat16>(ac, (const __nv_bfloat16 *)kv_b->data, c->stream)
                        : absorbed_launch<float>(ac, (const float *)kv_b->data, c->stream);
    CU_LAUNCHED(c, e, "mla absorbed");
}

/* The expanded form on tensor cores (see above) once kv [L, nh, dn + dv]
 * and kpe [L, dr] are on the device; false (error recorded) on failure. */
static bool expanded_gemm_run(cu_ctx *c, const pd_mla_args *a, const float *kv, const float *kpe) {
    const int nh = a->n_heads, dn = a->qk_nope_dim, dr = a->qk_rope_dim, dv = a->v_dim, qd = dn + dr;
    const int n_q = a->n_q, L = a->start_pos + n_q;
    const size_t ld = ((size_t)L + 31) & ~(size_t)31; /* score row stride, elements */
    /* queries per chunk: scores (4 bytes) and probabilities (2) of every head within the budget */
    long qc = c->mla_prefill_chunk > 0 ? c->mla_prefill_chunk
                                      : (long)(CU_MLA_PREFILL_SCRATCH / ((size_t)nh * ld * 6));
    if (qc > 16)
        qc &= ~15L;
    if (qc < 1)
        qc = 1;
    if (qc > n_q)
        qc = n_q;
    const size_t nqb = (size_t)n_q * nh * qd, nkb = (size_t)L * nh * qd, nvb = (size_t)L * nh * dv;
    const size_t off_k = (nqb + 127) & ~(size_t)127, off_v = off_k + ((nkb + 127) & ~(size_t)127);
    __nv_bfloat16 *qkv = (__nv_bfloat16 *)cu_scratch(c, CU_SCR_MLA_QKV16, (off_v + nvb) * sizeof(__nv_bfloat16));
    if (!qkv)
        return false;
    __nv_bfloat16 *qb = qkv, *kb = qkv + off_k, *vb = qkv + off_v;
    k_mla_pack_q<<<cu_blocks(nqb, 256, 8192), 256, 0, c->stream>>>(nqb, a->q, qb);
    if (!CU_LAUNCHED(c, cudaGetLastError(), "mla prefill: pack q"))
        return false;
    k_mla_pack_kv<<<L, 256, 0, c->stream>>>(nh, dn, dr, dv, kv, kpe, kb, vb);
    if (!CU_LAUNCHED(c, cudaGetLastError(), "mla prefill: pack k, v"))
        return false;
    if (c->mla_prefill_flash && cu_mla_flash_ok(qd, dv)) /* fused: no scores in memory (mla_flash.cu) */
        return cu_mla_flash_run(c, nh, qd, dv, n_q, a->start_pos, a->softmax_scale, qb, kb, vb, a->out);
    const size_t h_stride = (size_t)qc * ld;
    float *S = (float *)cu_scratch(c, CU_SCR_MLA_S, (size_t)nh * h_stride * sizeof(float));
    __nv_bfloat16 *P = (__nv_bfloat16 *)cu_scratch(c, CU_SCR_MLA_P, (size_t)nh * h_stride * sizeof(__nv_bfloat16));
    if (!S || !P)
        return false;
    const float one = 1.0f, zero = 0.0f;
    for (int i0 = 0; i0 < n_q; i0 += (int)qc) {
        const int nq = (int)(n_q - i0 < qc ? n_q - i0 : qc);
        const int Lc = a->start_pos + i0 + nq; /* the chunk's last query sees tokens 0 .. Lc-1 */
        /* column-major: Sᵀ[Lc × nq] = (K_h, qd × Lc)ᵀ · Q_h (qd × nq), per head */
        if (!CU_BLAS_OK(c, cublasGemmStridedBatchedEx(
                               c->blas, CUBLAS_OP_T, CUBLAS_OP_N, Lc, nq, qd, &a->softmax_scale, kb, CUDA_R_16BF,
                               nh * qd, (long long)qd, qb + (size_t)i0 * nh * qd, CUDA_R_16BF, nh * qd, (long long)qd,
                               &zero, S, CUDA_R_32F, (int)ld, (long long)h_stride, nh, CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT)))
            return false;
        k_mla_softmax<<<dim3(nq, nh), SMX_THREADS, 0, c->stream>>>(a->start_pos + i0, Lc, ld, h_stride, S, P);
        if (!CU_LAUNCHED(c, cudaGetLastError(), "mla prefill: softmax"))
            return false;
        /* column-major: Oᵀ[dv × nq] = V_h (dv × Lc) · Pᵀ (Lc × nq), per head */
        if (!CU_BLAS_OK(c, cublasGemmStridedBatchedEx(
                               c->blas, CUBLAS_OP_N, CUBLAS_OP_N, dv, nq, Lc, &one, vb, CUDA_R_16BF, nh * dv,
                               (long long)dv, P, CUDA_R_16BF, (int)ld, (long long)h_stride, &zero,
                               a->out + (size_t)i0 * nh * dv, CUDA_R_32F, nh * dv, (long long)dv, nh,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)))
            return false;
    }
    return true;
}

/* ---- table entry ------------------------------------------------------ */

void cu_mla_attention(pd_backend *be, const pd_mla_args *a) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK)
        return;
    const int nh = a->n_heads, dn = a->qk_nope_dim, dr = a->qk_rope_dim, dv = a->v_dim, kvr = a->kv_lora_rank;
    if (nh <= 0 || nh > 65535 || dn <= 0 || dr <= 0 || dv <= 0 || kvr <= 0 || a->n_q <= 0 || a->start_pos < 0 ||
        a->block_size <= 0 || a->layer < 0 || a->layer >= a->n_layers || !a->q || !a->cache || !a->block_table ||
        !a->kv_b || !a->kv_b->data || !a->out || a->kv_b->rows != nh * (dn + dv) || a->kv_b->cols != kvr) {
        cu_fail(c, PD_ERR_INVALID,
                "mla_attention: heads %d, dims nope %d rope %d v %d latent %d, n_q %d, start %d, block %d, layer "
                "%d/%d, kv_b [%d, %d]",
                nh, dn, dr, dv, kvr, a->n_q, a->start_pos, a->block_size, a->layer, a->n_layers,
                a->kv_b ? a->kv_b->rows : -1, a->kv_b ? a->kv_b->cols : -1);
        return;
    }
    const int L = a->start_pos + a->n_q;
    const int nblk = (L + a->block_size - 1) / a->block_size;
    for (int b = 0; b < nblk; b++)
        if (a->block_table[b] < 0) {
            cu_fail(c, PD_ERR_INVALID, "mla_attention: block_table[%d] = %d", b, a->block_table[b]);
            return;
        }
    const int *btab = (const int *)cu_scratch_upload(c, CU_SCR_ARG0, a->block_table, (size_t)nblk * sizeof(int));
    if (!btab)
        return;

    if (!a->absorbed) {
        if (dv > PF_DV_MAX) {
            cu_fail(c, PD_ERR_UNSUPPORTED, "mla_attention (expanded): v_dim %d > %d", dv, PF_DV_MAX);
            return;
        }
        float *lat = (float *)cu_scratch(c, CU_SCR_MLA_LAT, (size_t)L * kvr * sizeof(float));
        float *kpe = (float *)cu_scratch(c, CU_SCR_MLA_KPE, (size_t)L * dr * sizeof(float));
        float *kv = (float *)cu_scratch(c, CU_SCR_MLA_KV, (size_t)L * nh * (dn + dv) * sizeof(float));
        if (!lat || !kpe || !kv)
            return;
        if (!CU_LAUNCHED(c, expanded_launch(a, btab, lat, kpe, kv, 0, c->stream), "mla gather"))
            return;
        if (!cu_gemm_run(c, L, lat, a->kv_b, kv, false))
            return;
        if ((c->mla_prefill_gemm || c->mla_prefill_flash) && c->wfmt == PD_CUDA_WEIGHTS_BF16) {
            expanded_gemm_run(c, a, kv, kpe);
            return;
        }
        CU_LAUNCHED(c, expanded_launch(a, btab, lat, kpe, kv, 1, c->stream), "mla prefill");
        return;
    }

    if (!absorbed_shape_ok(c, kvr, dr, a->cache, "mla_attention (absorbed)"))
        return;
    /* Splits of the context: enough blocks for two per SM, at least a tile each. */
    const int hg = (nh + DEC_HG - 1) / DEC_HG;
    const long per = (long)hg * a->n_q;
    long want = (2L * c->n_sm + per - 1) / per;
    int max_splits = (L + DEC_TT - 1) / DEC_TT;
    if (max_splits > DEC_MAX_SPLITS)
        max_splits = DEC_MAX_SPLITS;
    int n_splits = (int)(want < 1 ? 1 : want > max_splits ? max_splits : want);
    if ((long)a->n_q * n_splits > 0x7fffffffL) {
        cu_fail(c, PD_ERR_LIMIT, "mla_attention (absorbed): %d queries too many", a->n_q);
        return;
    }
    absorbed_call ac = {
        .nh = nh, .dn = dn, .dr = dr, .dv = dv, .kvr = kvr, .n_q = a->n_q, .start_pos = a->start_pos,
        .n_layers = a->n_layers, .layer = a->layer, .bs = a->block_size, .n_splits = n_splits,
        .min_chunk = 0, .first_kernels = c->mla_first_kernels, .tc = 0, .qlat_cols = 0, .pdl = 0, .cmb_slow = 0,
        .tile_pre1 = 0, .tile_bulk = 0, .qlat_pre1 = 0, .merge_cl = 0, .scale = a->softmax_scale, .q = a->q, .cache = a->cache, .q_len = NULL, .q_boff = NULL, .btab = btab,
        .ql = NULL, .part = NULL, .out = a->out, .prep = {},
    };
    absorbed_run(c, &ac, a->kv_b);
}

/* Batched decode: every argument already in device memory, so the split
 * count cannot follow the lengths; it follows the batch (two blocks per SM
 * over the whole batch, at most one split a SM and DEC_GRAPH_SPLITS), and
 * a split past a short sequence's end is an empty block that leaves at
 * once. The tensor-core split kernel runs one block a SM (its two tiles'
 * shared memory), so at batch 1 the cap is one wave: a split holds
 * ceil(length / (32 · splits)) tiles of 32 rows, and a tile is ~1.9 us of
 * arithmetic on the H200 at batch 1 (scores, softmax, PV: the probe,
 * docs/benchmarks.md, session 21). 128 splits (the cap before session 21)
 * gave 8193 tokens three tiles in each of 86 splits; 132 give them two in
 * each of 129. */
#define DEC_GRAPH_SPLITS (8 * CMB_FK_CL) /* the cluster merge's one-round loads at kvr 512 (136) */

void cu_mla_decode(pd_backend *be, const pd_mla_decode_args *a) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || a->n_seqs == 0)
        return;
    const int nh = a->n_heads, dn = a->qk_nope_dim, dr = a->qk_rope_dim, dv = a->v_dim, kvr = a->kv_lora_rank;
    if (nh <= 0 || nh > 65535 || dn <= 0 || dr <= 0 || dv <= 0 || kvr <= 0 || a->n_seqs < 0 || a->n_seqs > 65535 ||
        a->block_size <= 0 || a->layer < 0 || a->layer >= a->n_layers || !a->q || !a->cache || !a->seq_lens ||
        !a->block_off || !a->blocks || !a->kv_b || !a->kv_b->data || !a->out || a->kv_b->rows != nh * (dn + dv) ||
        a->kv_b->cols != kvr) {
        cu_fail(c, PD_ERR_INVALID, "mla_decode: heads %d, dims nope %d rope %d v %d latent %d, %d sequences, layer %d/%d",
                nh, dn, dr, dv, kvr, a->n_seqs, a->layer, a->n_layers);
        return;
    }
    if (!absorbed_shape_ok(c, kvr, dr, a->cache, "mla_decode"))
        return;
    const int hg = (nh + DEC_HG - 1) / DEC_HG;
    const long per = (long)hg * a->n_seqs;
    long want = (2L * c->n_sm + per - 1) / per;
    const int max_splits = c->mla_max_splits ? c->mla_max_splits : c->n_sm < DEC_GRAPH_SPLITS ? c->n_sm : DEC_GRAPH_SPLITS;
    int n_splits = (int)(want < 1 ? 1 : want > max_splits ? max_splits : want);
    absorbed_call ac = {
        .nh = nh, .dn = dn, .dr = dr, .dv = dv, .kvr = kvr, .n_q = a->n_seqs, .start_pos = 0,
        .n_layers = a->n_layers, .layer = a->layer, .bs = a->block_size, .n_splits = n_splits,
        .min_chunk = c->mla_min_chunk, .first_kernels = c->mla_first_kernels, .tc = 0, .qlat_cols = 0, .pdl = 0,
        .cmb_slow = 0, .tile_pre1 = 0, .tile_bulk = 0, .qlat_pre1 = 0, .merge_cl = 0, .scale = a->softmax_scale, .q = a->q, .cache = a->cache,
        .q_len = a->seq_lens,
        .q_boff = a->block_off, .btab = a->blocks, .ql = NULL, .part = NULL, .out = a->out, .prep = {},
    };
    const pd_mla_prep_args *p = a->prep;
    if (p) { /* the prologue: folded into the q_lat kernel where it takes these rows, else mla_prep first */
        if (p->rows != a->n_seqs || p->q != a->q || p->n_heads != nh || p->qk_nope_dim != dn ||
            p->qk_rope_dim != dr || p->kv_lora_rank != kvr) {
            cu_fail(c, PD_ERR_INVALID, "mla_decode: its prologue's rows %d / heads %d / dims differ from the call's",
                    p->rows, p->n_heads);
            return;
        }
        if (absorbed_qlat8(&ac, a->kv_b->data) && !c->mla_prep_apart && dr % 2 == 0 && p->ckv && p->kv_norm &&
            p->pos && p->inv_freq && p->cache && p->slots)
            ac.prep = (qlat_prep){.on = 1, .pos = p->pos, .slots = p->slots, .inv_freq = p->inv_freq,
                                  .kv_norm = p->kv_norm, .mscale = p->mscale, .eps = p->eps, .ckv = p->ckv,
                                  .cache = p->cache, .slot_offset = p->slot_offset};
        else
            cu_mla_prep(be, p);
    }
    absorbed_run(c, &ac, a->kv_b);
}

/* Fused causal attention for the expanded MLA form of prefill (bf16 tensor
 * cores, FlashAttention-2's order of work: Dao 2023, "FlashAttention-2",
 * §3.1 algorithm 1, forward pass), over the bf16 q, k = [k_nope | k_pe]
 * and v that mla.cu's k_mla_pack_q / k_mla_pack_kv write:
 *
 *   qb [n_q, nh, QD], kb [L, nh, QD], vb [L, nh, DV] bf16 → out [n_q, nh, DV] fp32,
 *   out[i, h] = Σ_{t ≤ start_pos + i} softmax_t(scale · q[i,h]·k[t,h]) v[t,h]
 *
 * the same arithmetic as transformers' DeepseekV3Attention (modeling_
 * deepseek_v3.py, eager: scores, softmax in fp32, probabilities times v),
 * with scores accumulated in fp32 and the probabilities rounded to bf16 for
 * the second product, as mla.cu's cuBLAS path does; the scores are never
 * written to memory. A block takes FL_BQ queries of one head; each of its
 * four warps 16 of them, with their q fragments in registers. Key tiles of
 * FL_BK rows of k and v are copied into shared memory by cp.async, the next
 * tile while the current one is used. Per tile: S = q kᵀ by mma.sync
 * m16n8k16 (fp32 accumulation), the causal mask on the tiles that cross the
 * diagonal, the running max and sum per row (exp2 of scale·log2e·s), the
 * accumulator rescaled, P = bf16(p) taken straight from S's registers as
 * the A operand of O += P v (v through ldmatrix.trans). Blocks are ordered
 * longest first (the last queries see the most keys). */
#include "cuda_common.cuh"

#include <math.h>

#define FL_BQ 64  /* queries a block */
#define FL_BK 64  /* keys a tile */
#define FL_WARPS 4
#define FL_PAD 8  /* bf16 elements of padding a shared row: rows start 16 bytes apart mod 128 */

__device__ __forceinline__ unsigned smem_u32(const void *p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

/* 16 bytes global → shared, zero-filled when !ok (rows past the end). */
__device__ __forceinline__ void cp16(void *dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N> __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(unsigned &r0, unsigned &r1, unsigned &r2, unsigned &r3, const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned &r0, unsigned &r1, unsigned &r2, unsigned &r3, const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}

/* d (16×8 fp32) += a (16×16 bf16, row) · b (16×8 bf16, col) */
__device__ __forceinline__ void mma16816(float *d, const unsigned *a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(unsigned *)&v;
}

template <int QD, int DV> struct fl_smem {
    static constexpr int QS = QD + FL_PAD, VS = DV + FL_PAD; /* row strides, elements */
    static constexpr size_t q = (size_t)FL_BQ * QS, k = (size_t)FL_BK * QS, v = (size_t)FL_BK * VS;
    static constexpr size_t bytes = (q + 2 * (k + v)) * sizeof(__nv_bfloat16);
};

template <int QD, int DV>
static __global__ void __launch_bounds__(FL_WARPS * 32)
    k_mla_flash(int nh, int n_q, int start_pos, float scale_log2, const __nv_bfloat16 *__restrict__ qb,
                const __nv_bfloat16 *__restrict__ kb, const __nv_bfloat16 *__restrict__ vb, float *__restrict__ out) {
    using SM = fl_smem<QD, DV>;
    constexpr int QS = SM::QS, VS = SM::VS, NT = FL_BK / 8, OT = DV / 8, QK = QD / 16;
    extern __shared__ uint4 fl_sm4[];
    __nv_bfloat16 *sq = (__nv_bfloat16 *)fl_sm4, *sk0 = sq + SM::q, *sv0 = sk0 + SM::k;
    __nv_bfloat16 *sk1 = sv0 + SM::v, *sv1 = sk1 + SM::k;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n_qt = (n_q + FL_BQ - 1) / FL_BQ;
    const int qt = n_qt - 1 - (int)blockIdx.x, h = blockIdx.y; /* longest first */
    const int q0 = qt * FL_BQ;
    const int L = start_pos + n_q;
    const int last_key = min(start_pos + q0 + FL_BQ, L) - 1; /* the block's last query sees keys 0 .. last_key */
    const int n_kt = last_key / FL_BK + 1;
    const size_t qrow = (size_t)nh * QD, vrow = (size_t)nh * DV;

    /* q tile and the first k, v tile */
    constexpr int QC = QD / 8, VC = DV / 8; /* 16-byte chunks a row */
    for (int c = tid; c < FL_BQ * QC; c += FL_WARPS * 32) {
        const int r = c / QC, cc = c % QC, i = q0 + r;
        cp16(sq + r * QS + cc * 8, qb + (size_t)min(i, n_q - 1) * qrow + (size_t)h * QD + cc * 8, i < n_q);
    }
    auto load_kv = [&](int kt, __nv_bfloat16 *sk, __nv_bfloat16 *sv) {
        const int t0 = kt * FL_BK;
        for (int c = tid; c < FL_BK * QC; c += FL_WARPS * 32) {
            const int r = c / QC, cc = c % QC, t = t0 + r;
            cp16(sk + r * QS + cc * 8, kb + (size_t)min(t, L - 1) * qrow + (size_t)h * QD + cc * 8, t < L);
        }
        for (int c = tid; c < FL_BK * VC; c += FL_WARPS * 32) {
            const int r = c / VC, cc = c % VC, t = t0 + r;
            cp16(sv + r * VS + cc * 8, vb + (size_t)min(t, L - 1) * vrow + (size_t)h * DV + cc * 8, t < L);
        }
    };
    load_kv(0, sk0, sv0);
    cp_commit();

    /* rows of this thread: g and g + 8 of the warp's 16 */
    const int g = lane >> 2, cq = (lane & 3) * 2;
    const int qa0 = start_pos + q0 + warp * 16 + g, qa1 = qa0 + 8; /* absolute positions */
    float o[OT][4];
#pragma unroll
    for (int j = 0; j < OT; j++)
        o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    unsigned qf[QK][4];

    for (int kt = 0; kt < n_kt; kt++) {
        __nv_bfloat16 *sk = (kt & 1) ? sk1 : sk0, *sv = (kt & 1) ? sv1 : sv0;
        if (kt + 1 < n_kt) {
            load_kv(kt + 1, (kt & 1) ? sk0 : sk1, (kt & 1) ? sv0 : sv1);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        if (kt == 0) {
            /* the warp's 16 q rows as A fragments: matrices (rows 0-7 | 8-15) × (k 0-7 | 8-15) */
            const __nv_bfloat16 *base = sq + (warp * 16 + (lane & 15)) * QS + (lane >> 4) * 8;
#pragma unroll
            for (int ks = 0; ks < QK; ks++)
                ldsm_x4(qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], base + ks * 16);
        }
        /* S = q kᵀ: 16 rows × FL_BK keys a warp */
        float s[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++)
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < QK; ks++) {
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                /* keys 8j .. 8j+15: matrices (keys 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) */
                unsigned b0, b1, b2, b3;
                const int key = j * 8 + (lane & 7) + ((lane >> 4) << 3), kk = ks * 16 + ((lane >> 3) & 1) * 8;
                ldsm_x4(b0, b1, b2, b3, sk + key * QS + kk);
                mma16816(s[j], qf[ks], b0, b1);
                mma16816(s[j + 1], qf[ks], b2, b3);
            }
        }
        /* causal mask where the tile crosses the diagonal (keys past L are past every query) */
        const int t0 = kt * FL_BK;
        if (t0 + FL_BK - 1 > start_pos + q0 + warp * 16) {
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int t = t0 + j * 8 + cq;
                if (t > qa0) s[j][0] = -INFINITY;
                if (t + 1 > qa0) s[j][1] = -INFINITY;
                if (t > qa1) s[j][2] = -INFINITY;
                if (t + 1 > qa1) s[j][3] = -INFINITY;
            }
        }
        /* running max and sum of each row (a quad of lanes holds a row) */
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int j = 0; j < NT; j++) {
            mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
            mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
        }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        /* a row whose keys so far are all masked keeps max -inf: no
         * contribution yet (cannot persist: key 0 is in every row's tile 0) */
        const float b0s = mx0 == -INFINITY ? 0.0f : mx0 * scale_log2;
        const float b1s = mx1 == -INFINITY ? 0.0f : mx1 * scale_log2;
        const float al0 = exp2f(m0 * scale_log2 - b0s), al1 = exp2f(m1 * scale_log2 - b1s); /* 0 when m was -inf */
        m0 = mx0;
        m1 = mx1;
        float ls0 = 0.0f, ls1 = 0.0f;
        unsigned pf[NT / 2][4];
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const float p0 = exp2f(s[j][0] * scale_log2 - b0s), p1 = exp2f(s[j][1] * scale_log2 - b0s);
            const float p2 = exp2f(s[j][2] * scale_log2 - b1s), p3 = exp2f(s[j][3] * scale_log2 - b1s);
            ls0 += p0 + p1;
            ls1 += p2 + p3;
            /* C fragment of n-tile j → A fragment of k-step j/2 */
            pf[j >> 1][(j & 1) * 2 + 0] = pack_bf16(p0, p1);
            pf[j >> 1][(j & 1) * 2 + 1] = pack_bf16(p2, p3);
        }
        l0 = l0 * al0 + ls0;
        l1 = l1 * al1 + ls1;
#pragma unroll
        for (int j = 0; j < OT; j++) {
            o[j][0] *= al0;
            o[j][1] *= al0;
            o[j][2] *= al1;
            o[j][3] *= al1;
        }
        /* O += P v: k-steps of 16 keys, v columns 16 at a time */
#pragma unroll
        for (int ks = 0; ks < FL_BK / 16; ks++) {
#pragma unroll
            for (int j = 0; j < OT; j += 2) {
                /* matrices (keys 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15), transposed */
                unsigned b0, b1, b2, b3;
                const int key = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, col = j * 8 + (lane >> 4) * 8;
                ldsm_x4_t(b0, b1, b2, b3, sv + key * VS + col);
                mma16816(o[j], pf[ks], b0, b1);
                mma16816(o[j + 1], pf[ks], b2, b3);
            }
        }
        __syncthreads(); /* this buffer is refilled by the next iteration's prefetch */
    }
    /* the rows' sums over the quad, then out = o / l */
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    const float i0 = 1.0f / l0, i1 = 1.0f / l1;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
#pragma unroll
    for (int j = 0; j < OT; j++) {
        const int col = j * 8 + cq;
        if (r0 < n_q)
            *(float2 *)(out + ((size_t)r0 * nh + h) * DV + col) = make_float2(o[j][0] * i0, o[j][1] * i0);
        if (r1 < n_q)
            *(float2 *)(out + ((size_t)r1 * nh + h) * DV + col) = make_float2(o[j][2] * i1, o[j][3] * i1);
    }
}

bool cu_mla_flash_ok(int qd, int dv) {
    return qd == 192 && dv == 128;
}

bool cu_mla_flash_run(cu_ctx *c, int nh, int qd, int dv, int n_q, int start_pos, float scale,
                      const __nv_bfloat16 *qb, const __nv_bfloat16 *kb, const __nv_bfloat16 *vb, float *out) {
    if (!cu_mla_flash_ok(qd, dv)) {
        cu_fail(c, PD_ERR_UNSUPPORTED, "mla flash: q dim %d, v dim %d (192 and 128 only)", qd, dv);
        return false;
    }
    const size_t smem = fl_smem<192, 128>::bytes;
    cudaError_t e = CU_SMEM_OPTIN((k_mla_flash<192, 128>), smem);
    if (e == cudaSuccess) {
        dim3 grid((unsigned)((n_q + FL_BQ - 1) / FL_BQ), (unsigned)nh);
        k_mla_flash<192, 128><<<grid, FL_WARPS * 32, smem, c->stream>>>(nh, n_q, start_pos,
                                                                         scale * 1.4426950408889634f, qb, kb, vb, out);
        e = cudaGetLastError();
    }
    return CU_LAUNCHED(c, e, "mla prefill: flash attention");
}

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

/* The per-tile work both kernels share, on a warp's 16 rows (rows g and
 * g + 8 of the thread, a quad of lanes holding a row) and a tile of NT · 8
 * keys from t0:
 *   fl_mask: the causal mask where the tile crosses the warp's first row
 *            (row0 = its absolute position); keys past L are past every query;
 *   fl_online_softmax: the running max m and sum l of each row (exp2 of
 *            scale · log2e · s), the accumulator o rescaled, and P = bf16(p)
 *            as A fragments of the second product (C fragment of n-tile j →
 *            A fragment of k-step j / 2);
 *   fl_store: out = o / l over the quad's sums. */
template <int NT>
__device__ __forceinline__ void fl_mask(float (&s)[NT][4], int t0, int row0, int qa0, int qa1, int cq) {
    if (t0 + NT * 8 - 1 <= row0)
        return;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int t = t0 + j * 8 + cq;
        if (t > qa0) s[j][0] = -INFINITY;
        if (t + 1 > qa0) s[j][1] = -INFINITY;
        if (t > qa1) s[j][2] = -INFINITY;
        if (t + 1 > qa1) s[j][3] = -INFINITY;
    }
}

template <int NT, int OT>
__device__ __forceinline__ void fl_online_softmax(float (&s)[NT][4], float (&o)[OT][4], unsigned (&pf)[NT / 2][4],
                                                  float &m0, float &m1, float &l0, float &l1, float scale_log2) {
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
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const float p0 = exp2f(s[j][0] * scale_log2 - b0s), p1 = exp2f(s[j][1] * scale_log2 - b0s);
        const float p2 = exp2f(s[j][2] * scale_log2 - b1s), p3 = exp2f(s[j][3] * scale_log2 - b1s);
        ls0 += p0 + p1;
        ls1 += p2 + p3;
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
}

template <int OT>
__device__ __forceinline__ void fl_store(const float (&o)[OT][4], float l0, float l1, int r0, int n_q, int nh, int h,
                                         int cq, float *__restrict__ out) {
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, off);
        l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
    const float i0 = 1.0f / l0, i1 = 1.0f / l1;
    const int r1 = r0 + 8;
#pragma unroll
    for (int j = 0; j < OT; j++) {
        const int col = j * 8 + cq;
        if (r0 < n_q)
            *(float2 *)(out + ((size_t)r0 * nh + h) * (OT * 8) + col) = make_float2(o[j][0] * i0, o[j][1] * i0);
        if (r1 < n_q)
            *(float2 *)(out + ((size_t)r1 * nh + h) * (OT * 8) + col) = make_float2(o[j][2] * i1, o[j][3] * i1);
    }
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
        unsigned pf[NT / 2][4];
        fl_mask<NT>(s, kt * FL_BK, start_pos + q0 + warp * 16, qa0, qa1, cq);
        fl_online_softmax<NT, OT>(s, o, pf, m0, m1, l0, l1, scale_log2);
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
    fl_store<OT>(o, l0, l1, q0 + warp * 16 + g, n_q, nh, h, cq, out);
}

/* ---- the same attention on Hopper's warpgroup MMA (wgmma) ---------------
 *
 * mma.sync above gives each warp 16 query rows, so every warp reads the
 * whole k and v tile from shared memory through ldmatrix for 16 rows: at
 * QD 192 a warp moves 41 KB of shared memory per 64-key tile for 655 KFLOP,
 * about twice the time the tensor cores need (232 TFLOP/s measured; v2-lite
 * 8K prefill 0.143 s, 32K 1.065 s; with this kernel 0.134 s and 0.885 s,
 * H200, 2026-11-30). Here a
 * warpgroup (four warps) issues wgmma.mma_async m64nNk16 for 64 query rows
 * with k and v read by the tensor cores straight from shared memory (the
 * 128-byte swizzled layout of the PTX ISA's "shared memory matrix layout"
 * for warpgroup MMA), so a tile is read once per 64 rows, not once per 16.
 * NWG warpgroups a block share the k, v tiles: 64 · NWG queries a block.
 * Each warpgroup waits for its own MMAs (no producer warps, no ping-pong
 * between groups as FlashAttention-3 schedules them): what is left.
 *   S = q kᵀ:  m64n64k16 × 12 (QD / 16), A = q from registers (the warp's
 *              16 rows as mma.sync A fragments), B = k tile, K-major;
 *   O += P v:  m64n128k16 × 4 (64 keys / 16), A = bf16(P) from registers
 *              (S's accumulator layout is the A fragment layout, as above),
 *              B = v tile, MN-major (transposed).
 * The accumulators of m64nNk16 sit in the registers the way N / 8 m16n8
 * C fragments would (warp w of the group: rows 16w..16w+15), so the
 * softmax, masking and output code are the mma.sync kernel's.
 * Tiles: k [64 keys][192] as three 64-column panels and v [64 keys][128] as
 * two, each panel 64 rows of 128 bytes with the 16-byte chunk c of row r
 * stored at chunk c ^ (r % 8) (1024-byte aligned panels), by cp.async, the
 * next tile while the current one is used. */
#define FW_BK 64  /* keys a tile */
#define FW_PANEL 8192 /* bytes: 64 rows × 128 */

template <int NWG> struct fw_smem {
    static constexpr int QS = 192 + FL_PAD;                      /* q rows (ldmatrix, unswizzled), elements */
    static constexpr size_t q = (size_t)64 * NWG * QS * 2;       /* bytes */
    static constexpr size_t k = 3 * FW_PANEL, v = 2 * FW_PANEL; /* one stage */
    static constexpr size_t bytes = 1024 + 2 * (k + v) + q;      /* 1024: the panels' alignment */
};

/* Shared-memory matrix descriptor, 128-byte swizzle (PTX ISA, "matrix
 * descriptor format"): start address, leading and stride byte offsets, all
 * >> 4; bits 62-63 = 1. */
__device__ __forceinline__ uint64_t fw_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (uint64_t)((addr & 0x3ffffu) >> 4) | ((uint64_t)((lbo & 0x3ffffu) >> 4) << 16) |
           ((uint64_t)((sbo & 0x3ffffu) >> 4) << 32) | ((uint64_t)1 << 62);
}

__device__ __forceinline__ void fw_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void fw_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void fw_wait0() {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
/* keeps the compiler from moving accesses of an accumulator's registers across the wait */
template <int N> __device__ __forceinline__ void fw_pin(float (&d)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; j++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            asm volatile("" : "+f"(d[j][i])::"memory");
}

/* d[64 × 64] (+)= a (registers) · B (k tile, K-major) */
__device__ __forceinline__ void fw_mma_s(float *d, const unsigned *a, uint64_t desc, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
}
/* d[64 × 128] += a (registers) · B (v tile, MN-major) */
__device__ __forceinline__ void fw_mma_o(float *d, const unsigned *a, uint64_t desc, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
}

template <int NWG>
static __global__ void __launch_bounds__(128 * NWG, 2 / NWG)
    k_mla_flash_wg(int nh, int n_q, int start_pos, float scale_log2, int vswap, const __nv_bfloat16 *__restrict__ qb,
                   const __nv_bfloat16 *__restrict__ kb, const __nv_bfloat16 *__restrict__ vb, float *__restrict__ out) {
    using SM = fw_smem<NWG>;
    constexpr int QD = 192, DV = 128, QS = SM::QS, NT = FW_BK / 8, OT = DV / 8, QK = QD / 16;
    constexpr int FW_BQ = 64 * NWG, NTH = 128 * NWG;
    extern __shared__ uint4 fw_sm4[];
    const unsigned base = (smem_u32(fw_sm4) + 1023u) & ~1023u; /* shared address of the first panel */
    char *gbase = (char *)fw_sm4 + (base - smem_u32(fw_sm4));
    /* stage st: k panels at gbase + st · (k + v), then its v panels */
    __nv_bfloat16 *sq = (__nv_bfloat16 *)(gbase + 2 * (SM::k + SM::v));
    const int tid = threadIdx.x, wg = tid >> 7, warp = tid >> 5, lane = tid & 31;
    const int n_qt = (n_q + FW_BQ - 1) / FW_BQ;
    const int qt = n_qt - 1 - (int)blockIdx.x, h = blockIdx.y; /* longest first */
    const int q0 = qt * FW_BQ;
    const int L = start_pos + n_q;
    const int n_kt = (min(start_pos + q0 + FW_BQ, L) + FW_BK - 1) / FW_BK; /* tiles up to the block's last key */
    const int last_wg = min(start_pos + q0 + wg * 64 + 63, L - 1); /* this warpgroup's rows see keys 0 .. last_wg */
    const int n_kt_wg = last_wg / FW_BK + 1;
    const size_t qrow = (size_t)nh * QD, vrow = (size_t)nh * DV;

    constexpr int QC = QD / 8, VC = DV / 8; /* 16-byte chunks a row */
    for (int c = tid; c < FW_BQ * QC; c += NTH) {
        const int r = c / QC, cc = c % QC, i = q0 + r;
        cp16(sq + r * QS + cc * 8, qb + (size_t)min(i, n_q - 1) * qrow + (size_t)h * QD + cc * 8, i < n_q);
    }
    auto load_kv = [&](int kt, int st) {
        const int t0 = kt * FW_BK;
        for (int c = tid; c < FW_BK * QC; c += NTH) {
            const int r = c / QC, cc = c % QC, t = t0 + r;
            char *dst = gbase + st * (SM::k + SM::v) + (cc >> 3) * FW_PANEL + r * 128 + (((cc & 7) ^ (r & 7)) << 4);
            cp16(dst, kb + (size_t)min(t, L - 1) * qrow + (size_t)h * QD + cc * 8, t < L);
        }
        for (int c = tid; c < FW_BK * VC; c += NTH) {
            const int r = c / VC, cc = c % VC, t = t0 + r;
            char *dst = gbase + st * (SM::k + SM::v) + SM::k + (cc >> 3) * FW_PANEL + r * 128 + (((cc & 7) ^ (r & 7)) << 4);
            cp16(dst, vb + (size_t)min(t, L - 1) * vrow + (size_t)h * DV + cc * 8, t < L);
        }
    };
    load_kv(0, 0);
    cp_commit();

    /* rows of this thread: g and g + 8 of its warp's 16 */
    const int g = lane >> 2, cq = (lane & 3) * 2;
    const int qa0 = start_pos + q0 + warp * 16 + g, qa1 = qa0 + 8; /* absolute positions */
    float o[OT][4];
#pragma unroll
    for (int j = 0; j < OT; j++)
        o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    unsigned qf[QK][4];
    /* v's leading / stride byte offsets (PD_MLA_FLASH_VSWAP swaps them: a check of the layout on new hardware) */
    const unsigned v_lbo = vswap ? 1024u : (unsigned)FW_PANEL, v_sbo = vswap ? (unsigned)FW_PANEL : 1024u;

    for (int kt = 0; kt < n_kt; kt++) {
        const int st = kt & 1;
        if (kt + 1 < n_kt) {
            load_kv(kt + 1, st ^ 1);
            cp_commit();
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* cp.async's writes, seen by wgmma */
        __syncthreads();
        if (kt == 0) {
            const __nv_bfloat16 *qbase = sq + (warp * 16 + (lane & 15)) * QS + (lane >> 4) * 8;
#pragma unroll
            for (int ks = 0; ks < QK; ks++)
                ldsm_x4(qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], qbase + ks * 16);
        }
        if (kt < n_kt_wg) {
            const unsigned kaddr = base + (unsigned)(st * (SM::k + SM::v)), vaddr = kaddr + (unsigned)SM::k;
            float s[NT][4];
            fw_fence();
#pragma unroll
            for (int ks = 0; ks < QK; ks++)
                fw_mma_s(&s[0][0], qf[ks], fw_desc(kaddr + (ks >> 2) * FW_PANEL + (ks & 3) * 32, 16, 1024), ks > 0);
            fw_commit();
            fw_wait0();
            fw_pin(s);
            unsigned pf[NT / 2][4];
            fl_mask<NT>(s, kt * FW_BK, start_pos + q0 + warp * 16, qa0, qa1, cq);
            fl_online_softmax<NT, OT>(s, o, pf, m0, m1, l0, l1, scale_log2);
            fw_fence();
#pragma unroll
            for (int ks = 0; ks < FW_BK / 16; ks++)
                fw_mma_o(&o[0][0], pf[ks], fw_desc(vaddr + ks * 2048, v_lbo, v_sbo), 1);
            fw_commit();
            fw_wait0();
            fw_pin(o);
        }
        __syncthreads(); /* this stage is refilled by the next iteration's prefetch */
    }
    fl_store<OT>(o, l0, l1, q0 + warp * 16 + g, n_q, nh, h, cq, out);
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
    cudaError_t e;
    if (c->mla_flash_wgmma) {
        /* two warpgroups a block sharing each k, v tile (8K prefill 0.134 s
         * against 0.136 with one a block, 32K 0.885 against 0.933);
         * PD_MLA_FLASH_WG=1: one (A/B runs) */
        const int two = c->mla_flash_wg2;
        const size_t smem = two ? fw_smem<2>::bytes : fw_smem<1>::bytes;
        e = two ? CU_SMEM_OPTIN(k_mla_flash_wg<2>, smem) : CU_SMEM_OPTIN(k_mla_flash_wg<1>, smem);
        if (e == cudaSuccess) {
            const int bq = two ? 128 : 64;
            dim3 grid((unsigned)((n_q + bq - 1) / bq), (unsigned)nh);
            if (two)
                k_mla_flash_wg<2><<<grid, 256, smem, c->stream>>>(nh, n_q, start_pos, scale * 1.4426950408889634f,
                                                                  c->mla_flash_vswap, qb, kb, vb, out);
            else
                k_mla_flash_wg<1><<<grid, 128, smem, c->stream>>>(nh, n_q, start_pos, scale * 1.4426950408889634f,
                                                                  c->mla_flash_vswap, qb, kb, vb, out);
            e = cudaGetLastError();
        }
        return CU_LAUNCHED(c, e, "mla prefill: flash attention (wgmma)");
    }
    const size_t smem = fl_smem<192, 128>::bytes;
    e = CU_SMEM_OPTIN((k_mla_flash<192, 128>), smem);
    if (e == cudaSuccess) {
        dim3 grid((unsigned)((n_q + FL_BQ - 1) / FL_BQ), (unsigned)nh);
        k_mla_flash<192, 128><<<grid, FL_WARPS * 32, smem, c->stream>>>(nh, n_q, start_pos,
                                                                         scale * 1.4426950408889634f, qb, kb, vb, out);
        e = cudaGetLastError();
    }
    return CU_LAUNCHED(c, e, "mla prefill: flash attention");
}

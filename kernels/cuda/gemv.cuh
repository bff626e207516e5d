/* The skinny GEMM's (k_gemv, gemm.cu) work for one block: group rows
 * (block bx's GV_WARPS · GV_ROWS output rows: blockIdx.x, or its index among
 * the blocks of one weight) of one weight W (row
 * stride ldw, SwiGLU up rows from upo) over pairs [p0, p1), as gemm.cu
 * describes; shared with moe.cu's kernels that find their group
 * themselves. XS: x is in shared memory, read by plain loads; otherwise
 * read-only global memory, read through __ldg. */
#ifndef PD_CUDA_GEMV_CUH
#define PD_CUDA_GEMV_CUH

#include "cuda_common.cuh"

#define GV_WARPS 8
#define GV_MT 4

/* wv[r] = the lane's 16-byte piece k8 of row wr[r] (gemv_block and gemv_warp_rows: the loads before the sums). */
template <typename WT, int NR>
__device__ __forceinline__ void gv_load_rows(gv_w8<WT> (&wv)[NR], const WT *const (&wr)[NR], int k8) {
#pragma unroll
    for (int r = 0; r < NR; r++)
        wv[r].load(wr[r], k8);
}

template <bool SWIGLU, typename WT, int GV_ROWS, int MT, bool XS = false>
__device__ __forceinline__ void gemv_block(int bx, const WT *__restrict__ W, size_t ldw, size_t upo, int N, int K,
                                           int p0, int p1, const int *__restrict__ xrow, const int *__restrict__ yrow,
                                           const float *__restrict__ x, int ldx, float *__restrict__ y, int ldy,
                                           int accumulate) {
    constexpr int NR = SWIGLU ? 2 * GV_ROWS : GV_ROWS; /* weight rows per warp */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (bx * GV_WARPS + warp) * GV_ROWS;
    if (n0 >= N)
        return;
    const WT *wr[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) {
        int n = n0 + (r % GV_ROWS);
        if (n >= N)
            n = n0; /* computed, not stored */
        wr[r] = W + ((r < GV_ROWS ? 0 : upo) + n) * ldw;
    }
    const int K8 = K / 8;
    for (int pc = p0; pc < p1; pc += MT) {
        const int m = min(MT, p1 - pc);
        const float4 *xr[MT];
#pragma unroll
        for (int j = 0; j < MT; j++) {
            const int p = pc + (j < m ? j : 0);
            xr[j] = (const float4 *)(x + (size_t)(xrow ? xrow[p] : p) * ldx);
        }
        float acc[NR][MT];
#pragma unroll
        for (int r = 0; r < NR; r++)
#pragma unroll
            for (int j = 0; j < MT; j++)
                acc[r][j] = 0.0f;
#pragma unroll 4
        for (int k8 = lane; k8 < K8; k8 += 32) {
            gv_w8<WT> wv[NR];
            gv_load_rows<WT, NR>(wv, wr, k8);
#pragma unroll
            for (int j = 0; j < MT; j++) {
                if (j < m) {
                    const float4 a = XS ? xr[j][2 * k8] : __ldg(xr[j] + 2 * k8);
                    const float4 b = XS ? xr[j][2 * k8 + 1] : __ldg(xr[j] + 2 * k8 + 1);
#pragma unroll
                    for (int r = 0; r < NR; r++)
                        acc[r][j] += wv[r].dot(a, b);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < NR; r++)
#pragma unroll
            for (int j = 0; j < MT; j++)
                acc[r][j] = cu_warp_sum(acc[r][j]);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < GV_ROWS; r++) {
                const int n = n0 + r;
                if (n >= N)
                    continue;
#pragma unroll
                for (int j = 0; j < MT; j++) {
                    if (j >= m)
                        continue;
                    const int p = pc + j;
                    float *dst = y + (size_t)(yrow ? yrow[p] : p) * ldy + n;
                    if (SWIGLU) {
                        const float gt = acc[r][j], up = acc[GV_ROWS + r][j];
                        *dst = gt / (1.0f + expf(-gt)) * up;
                    } else {
                        *dst = accumulate ? *dst + acc[r][j] : acc[r][j];
                    }
                }
            }
        }
    }
}

/* One warp's GV_ROWS rows n0 .. n0 + GV_ROWS - 1 of W (row stride ldw; rows
 * at or past N computed from row n0, not to be stored) against one row x of
 * K floats (shared memory with XS, else read through __ldg), for kernels
 * that place a warp's rows themselves: acc[r] = W[n0 + r] · x in every
 * lane. gemv_block's arithmetic at MT = 1 (the same 16-byte pieces a lane,
 * the same order of additions, the same warp sum): the same numbers. */
template <typename WT, int GV_ROWS, bool XS>
__device__ __forceinline__ void gemv_warp_rows(const WT *__restrict__ W, size_t ldw, int n0, int N, int K,
                                               const float *__restrict__ x, float (&acc)[GV_ROWS]) {
    const int lane = threadIdx.x & 31, K8 = K / 8;
    const WT *wr[GV_ROWS];
#pragma unroll
    for (int r = 0; r < GV_ROWS; r++) {
        wr[r] = W + (size_t)(n0 + r < N ? n0 + r : n0) * ldw;
        acc[r] = 0.0f;
    }
    const float4 *x4 = (const float4 *)x;
#pragma unroll 4
    for (int k8 = lane; k8 < K8; k8 += 32) {
        gv_w8<WT> wv[GV_ROWS];
        gv_load_rows<WT, GV_ROWS>(wv, wr, k8);
        const float4 a = XS ? x4[2 * k8] : __ldg(x4 + 2 * k8);
        const float4 b = XS ? x4[2 * k8 + 1] : __ldg(x4 + 2 * k8 + 1);
#pragma unroll
        for (int r = 0; r < GV_ROWS; r++)
            acc[r] += wv[r].dot(a, b);
    }
#pragma unroll
    for (int r = 0; r < GV_ROWS; r++)
        acc[r] = cu_warp_sum(acc[r]);
}

/* A few rows of x without SwiGLU (one weight, no row maps), the weights
 * held in registers: a warp's GV_ROWS rows of W, KC 16-byte chunks a lane a
 * row (K <= 256 · KC for bf16). load()
 * issues every load at once and returns before any arrives, so a kernel
 * launched by PDL calls it before cu_pdl_wait (nothing earlier writes the
 * weights) and the weights stream while the kernel before it runs; run()
 * then only reads x. The same chunks in the same order per lane as
 * gemv_block, so the same sums to the bit. */
template <typename WT, int GV_ROWS, int KC> struct gemv_pre {
    gv_w8<WT> w[GV_ROWS][KC];
    int n0;

    __device__ __forceinline__ void load(int bx, const WT *__restrict__ W, size_t ldw, int N, int K) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, K8 = K / 8;
        n0 = (bx * GV_WARPS + warp) * GV_ROWS;
        if (n0 >= N)
            return;
#pragma unroll
        for (int r = 0; r < GV_ROWS; r++) {
            const WT *row = W + (size_t)min(n0 + r, N - 1) * ldw;
#pragma unroll
            for (int c = 0; c < KC; c++)
                if (lane + 32 * c < K8)
                    w[r][c].load(row, lane + 32 * c);
        }
    }

    /* y[j, n] (+)= W[n] · x[j] for the warp's rows and the M <= MT rows of x
     * (row strides ldx, ldy); x fp32, in shared memory (XS) or global. Each
     * weight piece is used for every row: the same order of additions as
     * gemv_block's (pieces outer, rows inner). */
    template <bool XS, int MT = 1>
    __device__ __forceinline__ void run(int N, int K, int M, const float *__restrict__ x, int ldx,
                                        float *__restrict__ y, int ldy, int accumulate) const {
        if (n0 >= N)
            return;
        const int lane = threadIdx.x & 31, K8 = K / 8;
        float acc[GV_ROWS][MT];
#pragma unroll
        for (int r = 0; r < GV_ROWS; r++)
#pragma unroll
            for (int j = 0; j < MT; j++)
                acc[r][j] = 0.0f;
#pragma unroll
        for (int c = 0; c < KC; c++) {
            const int k8 = lane + 32 * c;
            if (k8 < K8) {
#pragma unroll
                for (int j = 0; j < MT; j++) {
                    if (j < M) {
                        const float4 *x4 = (const float4 *)(x + (size_t)j * ldx);
                        const float4 a = XS ? x4[2 * k8] : __ldg(x4 + 2 * k8);
                        const float4 b = XS ? x4[2 * k8 + 1] : __ldg(x4 + 2 * k8 + 1);
#pragma unroll
                        for (int r = 0; r < GV_ROWS; r++)
                            acc[r][j] += w[r][c].dot(a, b);
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < GV_ROWS; r++)
#pragma unroll
            for (int j = 0; j < MT; j++)
                acc[r][j] = cu_warp_sum(acc[r][j]);
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < GV_ROWS; r++)
#pragma unroll
                for (int j = 0; j < MT; j++)
                    if (n0 + r < N && j < M) {
                        float *dst = y + (size_t)j * ldy + n0 + r;
                        *dst = accumulate ? *dst + acc[r][j] : acc[r][j];
                    }
    }
};

#endif

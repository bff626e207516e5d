/* How fast the batch-1 MoE GEMVs' weights stream, alone: six of 64 V2-Lite-sized
 * experts (gate_up [2816, 2048], down [2048, 1408], bf16), through
 * gemv_block (kernels/cuda/gemv.cuh) at 1, 2 and 4 rows a warp, with an L2
 * prefetch first, as persistent grids, with the whole K in registers, and
 * as a fused gate_up + down-column-slice kernel, and fused with the down
 * weight transposed ([I][H]: a block's 32 act values times 32 contiguous
 * rows, partial sums reduced by a second kernel); with x in shared memory as
 * k_moe_gate_up1 holds it at 3 blocks a SM: in one pass of 4 rows a warp or
 * in passes of fewer (k_pass_xs, its gu1_gemv), each lane's pieces of a row
 * back to back (k_seq), or the rows brought in by Hopper bulk copies
 * (k_bulk: rings of chunks a warp, session 17); against a plain read of the
 * same bytes and a device-to-device copy in the same run. Each figure: 40
 * launches of one CUDA graph (a different six experts each launch, so the
 * 50 MB L2 holds none of them), the best of six replays ÷ 40. Each variant's
 * output is checked against the first's (MISMATCH lines).
 *
 * build (tests/gpu/build.sh does): nvcc -std=c++17 -O3
 *   -gencode=arch=compute_90a,code=sm_90a -I common -I kernels -I kernels/cuda
 *   -o bench_moe_stream tests/gpu/bench_moe_stream.cu
 * run on the GPU host: bench_moe_stream (no arguments; ~1.1 GB of device memory) */
#include "gemv.cuh"
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cstring>

typedef __nv_bfloat16 bf;
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

struct P {
    const bf *base; size_t estride; const int *ids; int N, K, ldw, upo;
    const float *x; float *y;
};

template <bool SW, int R>
__global__ void __launch_bounds__(GV_WARPS * 32) k_cur(P p) {
    const int e = p.ids[blockIdx.y];
    const bf *W = p.base + (size_t)e * p.estride;
    gemv_block<SW, bf, R, 1>((int)blockIdx.x, W, p.ldw, p.upo, p.N, p.K, 0, 1, NULL, NULL, p.x, p.K,
                             p.y + (size_t)blockIdx.y * p.N, p.N, 0);
}

/* prefetch own rows to L2 first */
template <bool SW, int R>
__global__ void __launch_bounds__(GV_WARPS * 32) k_pf(P p) {
    const int e = p.ids[blockIdx.y];
    const bf *W = p.base + (size_t)e * p.estride;
    const int n0 = blockIdx.x * GV_WARPS * R;
    const int nr = min(GV_WARPS * R, p.N - n0);
    if (threadIdx.x == 0) {
        cu_prefetch_l2(W + (size_t)n0 * p.ldw, (unsigned)(nr * p.ldw * 2));
        if (SW) cu_prefetch_l2(W + (size_t)(p.upo + n0) * p.ldw, (unsigned)(nr * p.ldw * 2));
    }
    gemv_block<SW, bf, R, 1>((int)blockIdx.x, W, p.ldw, p.upo, p.N, p.K, 0, 1, NULL, NULL, p.x, p.K,
                             p.y + (size_t)blockIdx.y * p.N, p.N, 0);
}

/* persistent: grid of G blocks, tasks (x, y) of 8R rows spread; each block takes tasks b, b+G, ... in
 * y-major order so an SM's share is spread */
template <bool SW, int R>
__global__ void __launch_bounds__(GV_WARPS * 32) k_pers(P p, int nx, int ny) {
    for (int t = blockIdx.x; t < nx * ny; t += gridDim.x) {
        const int y = t / nx, x = t % nx;
        const int e = p.ids[y];
        const bf *W = p.base + (size_t)e * p.estride;
        gemv_block<SW, bf, R, 1>(x, W, p.ldw, p.upo, p.N, p.K, 0, 1, NULL, NULL, p.x, p.K, p.y + (size_t)y * p.N,
                                 p.N, 0);
    }
}

/* ---- bulk copies (session 17's gemv_bulk, measured here and in the whole step: slower there) ---- */
/* The bulk-copy and mbarrier wrappers (cu_smem_u32, cu_mbar_init,
 * cu_mbar_init_fence, cu_bulk_expect, cu_bulk_g2s, cu_mbar_wait) are
 * kernels/cuda/cuda_common.cuh's, included through gemv.cuh. */

/* gemv_block's SwiGLU work at one row with x in shared memory (SWIGLU, bf16
 * W, MT = 1, XS), a warp's 2 GV_ROWS weight rows brought into shared memory
 * by Hopper bulk copies (cu_bulk_g2s) instead of each lane's loads: the
 * warp's lane 0 copies KC elements of each row at a time (a chunk, 2 KC
 * bytes a row) into a ring of NS slots, each counted on its own mbarrier,
 * so NS chunks (NS · 2 KB at GV_ROWS 4) are in flight a warp for a few
 * instructions, where the loads of gemv_block's loop keep ~1.5 KB in
 * flight at 80 registers (docs/benchmarks.md, session 16). Lane l takes
 * the same 16-byte pieces (k8 = l, l + 32, ...) in the same order and the
 * same warp sum as gemv_block: the same numbers.
 *
 * smem: gvb_smem_bytes(GV_ROWS, NS, KC) bytes of shared memory, 128-aligned,
 * this block's for the whole GEMV. begin() issues the first NS chunks and
 * may run before cu_pdl_wait (nothing earlier writes the weights); run()
 * then reads x (K floats, shared memory) and writes y[n] =
 * silu(gate_n · x) · (up_n · x) for the warp's rows n < N (gate row n of W
 * at n · ldw, its up row at (upo + n) · ldw). Needs W and ldw · 2 bytes
 * 16-aligned and K % 8 == 0. Warps whose rows start at or past N do
 * nothing. */
__host__ __device__ constexpr size_t gvb_smem_bytes(int gv_rows, int ns, int kc) {
    return (size_t)GV_WARPS * ns * (2 * gv_rows * kc * 2 + 8);
}

template <int GV_ROWS, int NS, int KC = 128> struct gemv_bulk {
    static_assert(KC == 64 || KC == 128 || KC == 256, "a chunk is 64, 128 or 256 elements");
    static constexpr int NR = 2 * GV_ROWS; /* weight rows a warp: gate then up */
    static constexpr int CPS = 256 / KC;   /* chunks a step (a warp's 32 pieces of 8) */
    static constexpr int LPC = KC / 8;     /* lanes a chunk */
    static_assert(NS >= CPS, "the ring holds a step");
    __nv_bfloat16 *buf; /* this warp's ring: [NS][NR][KC] */
    unsigned long long *mb; /* [NS] */
    const __nv_bfloat16 *W;
    size_t ldw, upo;
    int n0, N, K, J;

    /* lane 0: chunk j of every row into slot j % NS */
    __device__ __forceinline__ void issue(int j) const {
        const int s = j % NS, k0 = j * KC;
        const unsigned bytes = (unsigned)min(KC, K - k0) * 2u;
        cu_bulk_expect(mb + s, NR * bytes);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            int n = n0 + r % GV_ROWS;
            if (n >= N)
                n = n0; /* computed, not stored */
            const __nv_bfloat16 *row = W + ((r < GV_ROWS ? 0 : upo) + (size_t)n) * ldw;
            cu_bulk_g2s(buf + ((size_t)s * NR + r) * KC, row + k0, bytes, mb + s);
        }
    }

    __device__ __forceinline__ void begin(void *smem, int bx, const __nv_bfloat16 *W_, size_t ldw_, size_t upo_,
                                          int N_, int K_) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        W = W_, ldw = ldw_, upo = upo_, N = N_, K = K_;
        J = (K + KC - 1) / KC;
        n0 = (bx * GV_WARPS + warp) * GV_ROWS;
        buf = (__nv_bfloat16 *)smem + (size_t)warp * NS * NR * KC;
        mb = (unsigned long long *)((char *)smem + (size_t)GV_WARPS * NS * NR * KC * 2) + warp * NS;
        if (n0 >= N)
            return;
        if (lane == 0) {
#pragma unroll
            for (int s = 0; s < NS; s++)
                cu_mbar_init(mb + s);
            cu_mbar_init_fence();
            for (int j = 0; j < NS && j < J; j++)
                issue(j);
        }
        __syncwarp();
    }

    /* y: the output row (N floats); x: K floats in shared memory */
    __device__ __forceinline__ void run(const float *x, float *__restrict__ y) const {
        if (n0 >= N)
            return;
        const int lane = threadIdx.x & 31, K8 = K / 8;
        const float4 *x4 = (const float4 *)x;
        float acc[NR];
#pragma unroll
        for (int r = 0; r < NR; r++)
            acc[r] = 0.0f;
        /* a step: chunks c .. c + CPS - 1, lane l's piece k8 = LPC c + l
         * (chunk c + l / LPC): gemv_block's k8 = l + 32 i */
        for (int c = 0; c < J; c += CPS) {
#pragma unroll
            for (int q = 0; q < CPS; q++)
                if (c + q < J)
                    cu_mbar_wait(mb + (c + q) % NS, (unsigned)((c + q) / NS) & 1u);
            const int k8 = LPC * c + lane;
            if (k8 < K8) {
                const __nv_bfloat16 *slot = buf + (size_t)((c + lane / LPC) % NS) * NR * KC + (lane % LPC) * 8;
                const float4 a = x4[2 * k8], b = x4[2 * k8 + 1];
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    gv_w8<__nv_bfloat16> w;
                    w.v = *(const uint4 *)(slot + r * KC);
                    acc[r] += w.dot(a, b);
                }
            }
            __syncwarp(); /* every lane has read the step's slots: refill them */
            if (lane == 0) {
#pragma unroll
                for (int q = 0; q < CPS; q++)
                    if (c + q + NS < J)
                        issue(c + q + NS);
            }
        }
#pragma unroll
        for (int r = 0; r < NR; r++)
            acc[r] = cu_warp_sum(acc[r]);
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < GV_ROWS; r++) {
                if (n0 + r >= N)
                    continue;
                const float gt = acc[r], up = acc[GV_ROWS + r];
                y[n0 + r] = gt / (1.0f + expf(-gt)) * up;
            }
        }
    }
};

/* x through shared memory, a warp's R rows as R / PR passes of PR rows
 * (k_moe_gate_up1's GEMV with its passes) at 3 blocks a SM */
template <int R, int PR>
__global__ void __launch_bounds__(GV_WARPS * 32, 3) k_pass_xs(P p) {
    extern __shared__ float4 xs4[];
    const int e = p.ids[blockIdx.y];
    for (int k = threadIdx.x; k < p.K / 4; k += blockDim.x)
        xs4[k] = __ldg((const float4 *)p.x + k);
    __syncthreads();
    for (int t = 0; t < R / PR; t++)
        gemv_block<true, bf, PR, 1, true>((int)blockIdx.x * (R / PR) + t, p.base + (size_t)e * p.estride, p.ldw,
                                          p.upo, p.N, p.K, 0, 1, NULL, NULL, (const float *)xs4, p.K,
                                          p.y + (size_t)blockIdx.y * p.N, p.N, 0);
}

/* gate_up by bulk copies (gemv_bulk): a ring of NS chunks of KC elements a row a warp, x in shared memory */
template <int R, int NS, int KC>
__global__ void __launch_bounds__(GV_WARPS * 32) k_bulk(P p) {
    extern __shared__ float4 xs4[];
    const int e = p.ids[blockIdx.y];
    gemv_bulk<R, NS, KC> gb;
    gb.begin((char *)xs4 + ((p.K * 4 + 127) & ~127), (int)blockIdx.x, p.base + (size_t)e * p.estride, p.ldw, p.upo,
             p.N, p.K);
    for (int k = threadIdx.x; k < p.K / 4; k += blockDim.x)
        xs4[k] = __ldg((const float4 *)p.x + k);
    __syncthreads();
    gb.run((const float *)xs4, p.y + (size_t)blockIdx.y * p.N);
}

/* gate_up with each lane's pieces of one row loaded back to back: NP pieces
 * (k8 = lane + 32 i, i0 <= i < i0 + NP) of row 0, then of row 1, ..., x's NP
 * pieces from shared memory once a pass; the same per-row order of sums as
 * gemv_block */
template <int R, int NP, int MINB>
__global__ void __launch_bounds__(GV_WARPS * 32, MINB) k_seq(P p) {
    extern __shared__ float4 xs4[];
    constexpr int NR = 2 * R;
    const int e = p.ids[blockIdx.y];
    const bf *W = p.base + (size_t)e * p.estride;
    for (int k = threadIdx.x; k < p.K / 4; k += blockDim.x)
        xs4[k] = __ldg((const float4 *)p.x + k);
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, K8 = p.K / 8;
    const int n0 = (blockIdx.x * GV_WARPS + warp) * R;
    if (n0 >= p.N)
        return;
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; r++)
        acc[r] = 0.0f;
    for (int i0 = 0; 32 * i0 < K8; i0 += NP) {
        float4 xa[NP], xb[NP];
#pragma unroll
        for (int q = 0; q < NP; q++) {
            const int k8 = lane + 32 * (i0 + q);
            xa[q] = k8 < K8 ? xs4[2 * k8] : make_float4(0, 0, 0, 0);
            xb[q] = k8 < K8 ? xs4[2 * k8 + 1] : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const int n = min(n0 + r % R, p.N - 1);
            const bf *row = W + ((r < R ? 0 : (size_t)p.upo) + n) * (size_t)p.ldw;
            gv_w8<bf> w[NP];
#pragma unroll
            for (int q = 0; q < NP; q++) {
                const int k8 = lane + 32 * (i0 + q);
                if (k8 < K8)
                    w[q].load(row, k8);
            }
#pragma unroll
            for (int q = 0; q < NP; q++)
                if (lane + 32 * (i0 + q) < K8)
                    acc[r] += w[q].dot(xa[q], xb[q]);
        }
    }
#pragma unroll
    for (int r = 0; r < NR; r++)
        acc[r] = cu_warp_sum(acc[r]);
    if (lane == 0)
#pragma unroll
        for (int r = 0; r < R; r++)
            if (n0 + r < p.N) {
                const float gt = acc[r], up = acc[R + r];
                p.y[(size_t)blockIdx.y * p.N + n0 + r] = gt / (1.0f + expf(-gt)) * up;
            }
}

/* the whole K in registers (gemv_pre, the one-row GEMVs' path in gemv.cuh): a warp's R rows, KC pieces a lane */
template <int R, int KC>
__global__ void __launch_bounds__(GV_WARPS * 32) k_reg(P p) {
    const int e = p.ids[blockIdx.y];
    gemv_pre<bf, R, KC> w;
    w.load((int)blockIdx.x, p.base + (size_t)e * p.estride, (size_t)p.ldw, p.N, p.K);
    w.template run<false>(p.N, p.K, 1, p.x, p.K, p.y + (size_t)blockIdx.y * p.N, p.N, 0);
}


/* down partial over a column slice: block (bx, y) multiplies D_e[:, 32bx .. 32bx+32) by act[32] -> part[y][bx][H] */
template <int UN>
__device__ __forceinline__ void down_slice(const bf *D, int H, int I, int c0, const float *act_s, float *part) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = lane & 3, rr = lane >> 2;
    float4 a0 = ((const float4 *)act_s)[2 * q], a1 = ((const float4 *)act_s)[2 * q + 1];
#pragma unroll UN
    for (int r0 = warp * 8; r0 < H; r0 += GV_WARPS * 8) {
        const int row = r0 + rr;
        gv_w8<bf> w;
        w.v = __ldg((const uint4 *)(D + (size_t)row * I + c0 + q * 8));
        float s = w.dot(a0, a1);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (q == 0) part[row] = s;
    }
}
__global__ void __launch_bounds__(GV_WARPS * 32) k_dcol(P p, float *part) {
    const int e = p.ids[blockIdx.y];
    __shared__ float act_s[32];
    if (threadIdx.x < 32) act_s[threadIdx.x] = p.x[blockIdx.x * 32 + threadIdx.x];
    __syncthreads();
    down_slice<8>(p.base + (size_t)e * p.estride, p.N, p.K, blockIdx.x * 32, act_s,
                  part + ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * p.N);
}
/* the fused kernels' first half: block (bx, y)'s 32 act values of expert e (gate_up rows4, SwiGLU) into act_s */
__device__ __forceinline__ void gate_up_act32(const P &p, int e, float *act, float *act_s) {
    gemv_block<true, bf, 4, 1>((int)blockIdx.x, p.base + (size_t)e * p.estride, p.ldw, p.upo, p.N, p.K, 0, 1, NULL, NULL,
                               p.x, p.K, act + (size_t)blockIdx.y * p.N, p.N, 0);
    __syncthreads();
    if (threadIdx.x < 32) act_s[threadIdx.x] = act[(size_t)blockIdx.y * p.N + blockIdx.x * 32 + threadIdx.x];
    __syncthreads();
}
/* fused: gate_up rows4 (32 act) then the down slice partial */
__global__ void __launch_bounds__(GV_WARPS * 32) k_fused(P p, const bf *dn, size_t dstride, int H, float *act, float *part) {
    const int e = p.ids[blockIdx.y];
    __shared__ float act_s[32];
    gate_up_act32(p, e, act, act_s);
    down_slice<8>(dn + (size_t)e * dstride, H, p.N, blockIdx.x * 32, act_s,
                  part + ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * H);
}
/* down^T (DT[e] is [I][H], the down weight transposed): act_s[32] times DT rows r0 .. r0+32 -> part[H], 8 columns a thread */
template <int UN>
__device__ __forceinline__ void downT_rows(const bf *DT, int H, int r0, const float *act_s, float *part) {
    for (int c = threadIdx.x * 8; c < H; c += GV_WARPS * 32 * 8) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll UN
        for (int r = 0; r < 32; r++) {
            const uint4 v = __ldg((const uint4 *)(DT + (size_t)(r0 + r) * H + c));
            const float a = act_s[r];
            acc[0] = fmaf(__uint_as_float(v.x << 16), a, acc[0]);
            acc[1] = fmaf(__uint_as_float(v.x & 0xffff0000u), a, acc[1]);
            acc[2] = fmaf(__uint_as_float(v.y << 16), a, acc[2]);
            acc[3] = fmaf(__uint_as_float(v.y & 0xffff0000u), a, acc[3]);
            acc[4] = fmaf(__uint_as_float(v.z << 16), a, acc[4]);
            acc[5] = fmaf(__uint_as_float(v.z & 0xffff0000u), a, acc[5]);
            acc[6] = fmaf(__uint_as_float(v.w << 16), a, acc[6]);
            acc[7] = fmaf(__uint_as_float(v.w & 0xffff0000u), a, acc[7]);
        }
        ((float4 *)(part + c))[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        ((float4 *)(part + c))[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
}
/* fused with the down transposed: gate_up rows4 (32 act) then those 32 rows of down^T -> part[y][bx][H] */
template <int UN>
__global__ void __launch_bounds__(GV_WARPS * 32) k_fusedT(P p, const bf *dnT, size_t dstride, int H, float *act, float *part) {
    const int e = p.ids[blockIdx.y];
    __shared__ float act_s[32];
    gate_up_act32(p, e, act, act_s);
    downT_rows<UN>(dnT + (size_t)e * dstride, H, blockIdx.x * 32, act_s,
                   part + ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * H);
}
/* out[c] = sum over np partials part[j][c], j in order: block 32 columns, 8 threads a column each summing every 8th partial */
__global__ void __launch_bounds__(256) k_part_reduce(int np, int H, const float *part, float *out) {
    __shared__ float red[8][33];
    const int c = blockIdx.x * 32 + (threadIdx.x & 31), j0 = threadIdx.x >> 5;
    float s = 0.f;
#pragma unroll 8
    for (int j = j0; j < np; j += 8) s += part[(size_t)j * H + c];
    red[j0][threadIdx.x & 31] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = 0.f;
        for (int k = 0; k < 8; k++) t += red[k][threadIdx.x];
        out[c] = t;
    }
}
__global__ void k_transpose(const bf *in, bf *out, int R, int C, size_t estride) { /* in[e][R][C] -> out[e][C][R] */
    const size_t e = blockIdx.z;
    for (int r = blockIdx.y; r < R; r += gridDim.y)
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x)
            out[e * estride + (size_t)c * R + r] = in[e * estride + (size_t)r * C + c];
}
/* pure read of the experts' rows used (6 ranges), U uint4 a thread in flight */
template <int U>
__global__ void __launch_bounds__(256) k_read(P p, size_t bytes_per_e, int ne, float *sink) {
    const size_t n16 = bytes_per_e / 16;
    const size_t total = n16 * ne;
    const size_t stride = (size_t)gridDim.x * blockDim.x * U;
    uint32_t s = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x * U + threadIdx.x; i < total; i += stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const size_t j = i + (size_t)u * blockDim.x;
            if (j < total) {
                const int e = p.ids[j / n16];
                v[u] = __ldg((const uint4 *)(p.base + (size_t)e * p.estride) + j % n16);
            } else v[u] = make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) s ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (s == 0x12345678u) sink[0] = 1.f;
}

int main() {
    int nsm; CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    const int E = 64, H = 2048, I = 1408, TOPK = 6, REPS = 40;
    const size_t gu_e = (size_t)2 * I * H, dn_e = (size_t)H * I;
    bf *gu, *dn; float *x, *y, *yref, *sink;
    CK(cudaMalloc(&gu, gu_e * E * 2)); CK(cudaMalloc(&dn, dn_e * E * 2));
    CK(cudaMalloc(&x, H * 4 * 4)); CK(cudaMalloc(&y, (size_t)TOPK * H * 4)); CK(cudaMalloc(&yref, (size_t)TOPK * H * 4));
    CK(cudaMalloc(&sink, 4));
    {   // random-ish init on host in chunks
        std::vector<uint16_t> h(1 << 24);
        unsigned s = 1;
        for (auto &v : h) { s = s * 1664525u + 1013904223u; v = (uint16_t)(0x3c00 | ((s >> 9) & 0x3ff)) ^ ((s >> 31) << 15); }
        for (size_t o = 0; o < gu_e * E; o += h.size()) CK(cudaMemcpy(gu + o, h.data(), std::min(h.size(), gu_e * E - o) * 2, cudaMemcpyHostToDevice));
        for (size_t o = 0; o < dn_e * E; o += h.size()) CK(cudaMemcpy(dn + o, h.data(), std::min(h.size(), dn_e * E - o) * 2, cudaMemcpyHostToDevice));
        std::vector<float> hx(H * 4);
        for (auto &v : hx) { s = s * 1664525u + 1013904223u; v = ((s >> 8) & 0xffff) / 65536.f - 0.5f; }
        CK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    }
    std::vector<int> hid(REPS * TOPK);
    for (int r = 0; r < REPS; r++) for (int j = 0; j < TOPK; j++) hid[r * TOPK + j] = (r * 7 + j * 11) % E;
    int *ids; CK(cudaMalloc(&ids, hid.size() * 4)); CK(cudaMemcpy(ids, hid.data(), hid.size() * 4, cudaMemcpyHostToDevice));
    cudaStream_t st; CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));

    // copy ceiling
    {
        const size_t B = (size_t)256 << 20;
        void *a = gu, *b = dn; // scratch use: overwrite is fine for timing (data stays bf16 noise)
        float best = 1e9;
        for (int i = 0; i < 6; i++) {
            CK(cudaEventRecord(e0, st)); CK(cudaMemcpyAsync(b, a, B, cudaMemcpyDeviceToDevice, st)); CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); best = std::min(best, ms);
        }
        printf("copy 256 MiB D2D: %.1f us, read+write %.0f GB/s (one-way %.0f)\n", best * 1e3, 2.0 * B / best / 1e6, B / best / 1e6);
    }

    auto timeit = [&](const char *name, double mb, auto launch) {
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int r = 0; r < REPS; r++) launch(r);
        CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
        float best = 1e9;
        for (int i = 0; i < 6; i++) {
            CK(cudaEventRecord(e0, st)); CK(cudaGraphLaunch(ge, st)); CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); best = std::min(best, ms);
        }
        const double us = best * 1e3 / REPS;
        printf("%-34s %7.2f us  %6.0f GB/s\n", name, us, mb / us * 1e3);
        CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(g));
    };
    auto check = [&](const char *name, int n) {
        std::vector<float> a(n), b(n);
        CK(cudaMemcpy(a.data(), y, n * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), yref, n * 4, cudaMemcpyDeviceToHost));
        double md = 0, mr = 0;
        for (int i = 0; i < n; i++) { md = std::max(md, (double)fabsf(a[i] - b[i])); mr = std::max(mr, (double)fabsf(b[i])); }
        if (md > 1e-3 * mr) printf("  MISMATCH %s: %g of %g\n", name, md, mr);
    };
    for (int shape = 0; shape < 2; shape++) {
        const bool gate = shape == 0;
        P p;
        p.base = gate ? gu : dn; p.estride = gate ? gu_e : dn_e;
        p.N = gate ? I : H; p.K = gate ? H : I; p.ldw = p.K; p.upo = gate ? I : 0; p.x = x; p.y = y;
        const double mb = (double)TOPK * p.estride * 2 / 1e6;
        printf("== %s: %d experts, %.1f MB\n", gate ? "gate_up" : "down", TOPK, mb);
        auto P_r = [&](int r) { P q = p; q.ids = ids + r * TOPK; return q; };
        // reference
        { P q = P_r(0); q.y = yref;
          if (gate) k_cur<true, 2><<<dim3((I + 15) / 16, TOPK), 256, 0, st>>>(q); else k_cur<false, 2><<<dim3((H + 15) / 16, TOPK), 256, 0, st>>>(q);
          CK(cudaStreamSynchronize(st)); }
        const int n = TOPK * p.N;
#define RUN(NAME, LAUNCH) do { { int r = 0; (void)r; LAUNCH; } CK(cudaStreamSynchronize(st)); check(NAME, n); timeit(NAME, mb, [&](int r) { LAUNCH; }); } while (0)
        if (gate) {
            RUN("cur rows2 (88x6)", (k_cur<true, 2><<<dim3((I + 15) / 16, TOPK), 256, 0, st>>>(P_r(r))));
            RUN("cur rows1", (k_cur<true, 1><<<dim3((I + 7) / 8, TOPK), 256, 0, st>>>(P_r(r))));
            RUN("cur rows4", (k_cur<true, 4><<<dim3((I + 31) / 32, TOPK), 256, 0, st>>>(P_r(r))));
            /* x in shared memory, then the bulk copies; pad: more shared memory a block, as k_moe_gate_up1
             * holds (the norm's weights and its static arrays), so that as many blocks fit a SM */
            const size_t xsb = ((size_t)H * 4 + 127) & ~(size_t)127, pad = (size_t)H * 4 + 6400;
            auto occ = [&](const void *f, size_t smem) {
                int nb = 0;
                CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, f, 256, smem));
                return nb;
            };
#define BULK(R_, NS_, KC_, PAD_)                                                                                       \
    do {                                                                                                               \
        const size_t sm_ = xsb + gvb_smem_bytes(R_, NS_, KC_) + (PAD_);                                                \
        char nm_[64];                                                                                                  \
        snprintf(nm_, sizeof nm_, "bulk rows%d ring %dx%d%s (%d/SM)", R_, NS_, KC_, (PAD_) ? " pad" : "",             \
                 occ((const void *)k_bulk<R_, NS_, KC_>, sm_));                                                        \
        RUN(nm_, (k_bulk<R_, NS_, KC_><<<dim3((I + 8 * R_ - 1) / (8 * R_), TOPK), 256, sm_, st>>>(P_r(r))));        \
    } while (0)
            {
                const size_t sm0 = (size_t)H * 4;
                char nm[64];
                snprintf(nm, sizeof nm, "cur rows4 x smem (%d/SM)", occ((const void *)k_pass_xs<4, 4>, sm0 + pad));
                RUN(nm, (k_pass_xs<4, 4><<<dim3((I + 31) / 32, TOPK), 256, sm0 + pad, st>>>(P_r(r))));
            }
            RUN("pass rows4 as 4x1 x smem (3/SM)", (k_pass_xs<4, 1><<<dim3((I + 31) / 32, TOPK), 256, H * 4 + pad, st>>>(P_r(r))));
            RUN("pass rows4 as 2x2 x smem (3/SM)", (k_pass_xs<4, 2><<<dim3((I + 31) / 32, TOPK), 256, H * 4 + pad, st>>>(P_r(r))));
#define SEQ(R_, NP_, MB_)                                                                                                 \
    do {                                                                                                               \
        char nm_[64];                                                                                                  \
        snprintf(nm_, sizeof nm_, "seq rows%d pieces %d (%d/SM)", R_, NP_,                                             \
                 occ((const void *)k_seq<R_, NP_, MB_>, (size_t)H * 4 + pad));                                         \
        RUN(nm_, (k_seq<R_, NP_, MB_><<<dim3((I + 8 * R_ - 1) / (8 * R_), TOPK), 256, (size_t)H * 4 + pad, st>>>(P_r(r)))); \
    } while (0)
            SEQ(4, 2, 3);
            SEQ(4, 4, 3);
            SEQ(4, 8, 3);
            SEQ(4, 8, 1);
            SEQ(2, 4, 3);
            SEQ(2, 8, 3);
            SEQ(2, 8, 1);
            SEQ(1, 8, 3);
            SEQ(1, 8, 1);
            BULK(4, 3, 128, pad);
            BULK(4, 3, 128, 0);
            BULK(4, 4, 128, 0);
            BULK(4, 2, 256, 0);
            BULK(4, 3, 256, 0);
            BULK(4, 4, 256, 0);
            BULK(4, 6, 64, 0);
            BULK(4, 8, 64, 0);
            BULK(2, 4, 256, 0);
            BULK(2, 6, 128, 0);
            BULK(2, 3, 256, pad);
            BULK(1, 4, 256, 0);
            BULK(1, 8, 256, 0);
            RUN("l2 prefetch rows2", (k_pf<true, 2><<<dim3((I + 15) / 16, TOPK), 256, 0, st>>>(P_r(r))));
            RUN("l2 prefetch rows4", (k_pf<true, 4><<<dim3((I + 31) / 32, TOPK), 256, 0, st>>>(P_r(r))));
            RUN("persistent rows2 4/SM", (k_pers<true, 2><<<nsm * 4, 256, 0, st>>>(P_r(r), (I + 15) / 16, TOPK)));
            RUN("persistent rows2 2/SM", (k_pers<true, 2><<<nsm * 2, 256, 0, st>>>(P_r(r), (I + 15) / 16, TOPK)));
            RUN("persistent rows1 4/SM", (k_pers<true, 1><<<nsm * 4, 256, 0, st>>>(P_r(r), (I + 7) / 8, TOPK)));
            {
                float *part; CK(cudaMalloc(&part, (size_t)TOPK * 44 * H * 4));
                const double mbf = mb + (double)TOPK * dn_e * 2 / 1e6;
                timeit("seq gate_up rows2 + down rows2", mbf, [&](int r) {
                    k_cur<true, 2><<<dim3((I + 15) / 16, TOPK), 256, 0, st>>>(P_r(r));
                    P q = P_r(r); q.base = dn; q.estride = dn_e; q.N = H; q.K = I; q.ldw = I; q.upo = 0; q.x = yref;
                    k_cur<false, 2><<<dim3((H + 15) / 16, TOPK), 256, 0, st>>>(q); });
                timeit("fused gate_up rows4 + down slice", mbf, [&](int r) {
                    k_fused<<<dim3(I / 32, TOPK), 256, 0, st>>>(P_r(r), dn, dn_e, H, yref, part); });
                timeit("down slice only (part)", mbf - mb, [&](int r) {
                    P q = P_r(r); q.base = dn; q.estride = dn_e; q.N = H; q.K = I; q.x = x;
                    k_dcol<<<dim3(I / 32, TOPK), 256, 0, st>>>(q, part); });
                timeit("seq gate_up rows4 + down rows4", mbf, [&](int r) {
                    k_cur<true, 4><<<dim3((I + 31) / 32, TOPK), 256, 0, st>>>(P_r(r));
                    P q = P_r(r); q.base = dn; q.estride = dn_e; q.N = H; q.K = I; q.ldw = I; q.upo = 0; q.x = yref;
                    k_cur<false, 4><<<dim3((H + 31) / 32, TOPK), 256, 0, st>>>(q); });
                bf *dnT; CK(cudaMalloc(&dnT, dn_e * E * 2));
                k_transpose<<<dim3(4, 256, E), 256, 0, st>>>(dn, dnT, H, I, dn_e);
                float *act2, *outT; CK(cudaMalloc(&act2, (size_t)TOPK * I * 4)); CK(cudaMalloc(&outT, H * 4));
                { // check: the fused transposed path against the down rows on the host, from the act the fused kernel wrote
                    P q0 = P_r(0);
                    k_fusedT<16><<<dim3(I / 32, TOPK), 256, 0, st>>>(q0, dnT, dn_e, H, act2, part);
                    k_part_reduce<<<H / 32, 256, 0, st>>>(TOPK * (I / 32), H, part, outT);
                    CK(cudaStreamSynchronize(st));
                    std::vector<float> a((size_t)TOPK * I), b(H);
                    std::vector<uint16_t> w(dn_e);
                    CK(cudaMemcpy(a.data(), act2, a.size() * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(b.data(), outT, H * 4, cudaMemcpyDeviceToHost));
                    std::vector<double> r0(H, 0.0);
                    for (int j = 0; j < TOPK; j++) {
                        CK(cudaMemcpy(w.data(), dn + (size_t)hid[j] * dn_e, dn_e * 2, cudaMemcpyDeviceToHost));
                        for (int c = 0; c < H; c++) for (int k = 0; k < I; k++) {
                            uint32_t u = (uint32_t)w[(size_t)c * I + k] << 16; float f; memcpy(&f, &u, 4);
                            r0[c] += (double)f * a[(size_t)j * I + k]; }
                    }
                    double md = 0, mr = 0;
                    for (int c = 0; c < H; c++) { md = std::max(md, fabs(r0[c] - b[c])); mr = std::max(mr, fabs(r0[c])); }
                    printf("fusedT check: max diff %g of %g%s\n", md, mr, md > 1e-4 * mr ? "  MISMATCH" : "");
                }
                timeit("fusedT UN8 (no reduce)", mbf, [&](int r) { k_fusedT<8><<<dim3(I / 32, TOPK), 256, 0, st>>>(P_r(r), dnT, dn_e, H, act2, part); });
                timeit("fusedT UN16 (no reduce)", mbf, [&](int r) { k_fusedT<16><<<dim3(I / 32, TOPK), 256, 0, st>>>(P_r(r), dnT, dn_e, H, act2, part); });
                timeit("fusedT UN32 (no reduce)", mbf, [&](int r) { k_fusedT<32><<<dim3(I / 32, TOPK), 256, 0, st>>>(P_r(r), dnT, dn_e, H, act2, part); });
                timeit("fusedT UN16 + reduce", mbf, [&](int r) {
                    k_fusedT<16><<<dim3(I / 32, TOPK), 256, 0, st>>>(P_r(r), dnT, dn_e, H, act2, part);
                    k_part_reduce<<<H / 32, 256, 0, st>>>(TOPK * (I / 32), H, part, outT); });
                timeit("reduce alone (264 partials)", 0.0, [&](int r) { k_part_reduce<<<H / 32, 256, 0, st>>>(TOPK * (I / 32), H, part, outT); });
                CK(cudaFree(dnT)); CK(cudaFree(act2)); CK(cudaFree(outT));
                CK(cudaFree(part));
            }
        } else {
            RUN("cur rows2 (128x6)", (k_cur<false, 2><<<dim3((H + 15) / 16, TOPK), 256, 0, st>>>(P_r(r))));
            RUN("cur rows1", (k_cur<false, 1><<<dim3((H + 7) / 8, TOPK), 256, 0, st>>>(P_r(r))));
            RUN("cur rows4", (k_cur<false, 4><<<dim3((H + 31) / 32, TOPK), 256, 0, st>>>(P_r(r))));
            RUN("l2 prefetch rows2", (k_pf<false, 2><<<dim3((H + 15) / 16, TOPK), 256, 0, st>>>(P_r(r))));
            RUN("persistent rows2 5/SM", (k_pers<false, 2><<<nsm * 5, 256, 0, st>>>(P_r(r), (H + 15) / 16, TOPK)));
            RUN("reg rows2 KC6", (k_reg<2, 6><<<dim3((H + 15) / 16, TOPK), 256, 0, st>>>(P_r(r))));
            RUN("reg rows4 KC6", (k_reg<4, 6><<<dim3((H + 31) / 32, TOPK), 256, 0, st>>>(P_r(r))));
        }
        const size_t be = p.estride * 2;
        timeit("read U4 4/SM", mb, [&](int r) { k_read<4><<<nsm * 4, 256, 0, st>>>(P_r(r), be, TOPK, sink); });
        timeit("read U8 4/SM", mb, [&](int r) { k_read<8><<<nsm * 4, 256, 0, st>>>(P_r(r), be, TOPK, sink); });
        timeit("read U8 8/SM", mb, [&](int r) { k_read<8><<<nsm * 8, 256, 0, st>>>(P_r(r), be, TOPK, sink); });
        timeit("read U4 many", mb, [&](int r) { k_read<4><<<(unsigned)(TOPK * be / 16 / 1024), 256, 0, st>>>(P_r(r), be, TOPK, sink); });
        timeit("empty-ish (read 0 experts)", 0.0, [&](int r) { k_read<4><<<nsm * 4, 256, 0, st>>>(P_r(r), be, 0, sink); });
    }
    printf("done\n");
    return 0;
}

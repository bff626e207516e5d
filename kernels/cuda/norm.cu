/* RMSNorm (Zhang & Sennrich 2019): y[r] = x[r] / sqrt(mean(x[r]²) + eps) * w,
 * the sum of squares in fp64 as the CPU backend keeps it; one block per row.
 * x and y may be the same buffer (each thread rewrites only what it read). */
#include "cuda_common.cuh"

#define NORM_THREADS 256

static __global__ void __launch_bounds__(NORM_THREADS)
    k_rmsnorm(int dim, const float *x, int xs, const float *__restrict__ w, float eps, float *y, int ys) {
    cu_pdl_launch_dependents();
    __shared__ double part[NORM_THREADS / 32];
    const float *xr = x + (size_t)blockIdx.x * xs;
    float *yr = y + (size_t)blockIdx.x * ys;
    const float inv = cu_block_inv_rms<NORM_THREADS>(xr, dim, eps, part);
    for (int i = threadIdx.x; i < dim; i += NORM_THREADS)
        yr[i] = xr[i] * inv * w[i];
}

/* The same norm with each thread's V float4 pieces of w loaded before the
 * PDL wait and of x right after it, all at once: k_rmsnorm's threads read
 * x twice, one load after another (~7 us a row of 2048 at batch 1, session
 * 14's timeline: the dense layer's post-attention norm and the final norm).
 * dim % 4 == 0, dim <= 4 V NORM_THREADS; x and y 16-byte aligned rows. */
#define NORM_V 4
template <int V>
static __global__ void __launch_bounds__(NORM_THREADS)
    k_rmsnorm_v(int dim, const float *x, int xs, const float *__restrict__ w, float eps, float *y, int ys) {
    __shared__ double part[NORM_THREADS / 32];
    const int d4 = dim / 4;
    float4 wv[V], xv[V];
#pragma unroll
    for (int v = 0; v < V; v++) {
        const int k = threadIdx.x + v * NORM_THREADS;
        wv[v] = k < d4 ? __ldg((const float4 *)w + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    cu_pdl_wait();
    cu_pdl_launch_dependents();
    const float4 *xr = (const float4 *)(x + (size_t)blockIdx.x * xs);
#pragma unroll
    for (int v = 0; v < V; v++) {
        const int k = threadIdx.x + v * NORM_THREADS;
        xv[v] = k < d4 ? xr[k] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    double ss = 0.0;
#pragma unroll
    for (int v = 0; v < V; v++)
        ss += (double)xv[v].x * xv[v].x + (double)xv[v].y * xv[v].y + (double)xv[v].z * xv[v].z +
              (double)xv[v].w * xv[v].w;
    const float inv = cu_block_inv_rms_of<NORM_THREADS>(ss, dim, eps, part);
    float4 *yr = (float4 *)(y + (size_t)blockIdx.x * ys);
#pragma unroll
    for (int v = 0; v < V; v++) {
        const int k = threadIdx.x + v * NORM_THREADS;
        if (k < d4)
            yr[k] = make_float4(xv[v].x * inv * wv[v].x, xv[v].y * inv * wv[v].y, xv[v].z * inv * wv[v].z,
                                xv[v].w * inv * wv[v].w);
    }
}

static cudaError_t rmsnorm_launch(cu_ctx *c, int rows, int dim, const float *x, int xs, const float *w, float eps,
                                  float *y, int ys) {
    if (!c->norm_v_off && dim % 4 == 0 && xs % 4 == 0 && ys % 4 == 0 && dim <= 4 * NORM_V * NORM_THREADS &&
        ((uintptr_t)x & 15) == 0 && ((uintptr_t)y & 15) == 0 && ((uintptr_t)w & 15) == 0) {
        cudaLaunchAttribute at;
        cudaLaunchConfig_t cfg = cu_launch_config(dim3((unsigned)rows), dim3(NORM_THREADS), 0, c->stream, c->pdl, &at);
        return cudaLaunchKernelEx(&cfg, k_rmsnorm_v<NORM_V>, dim, x, xs, w, eps, y, ys);
    }
    k_rmsnorm<<<rows, NORM_THREADS, 0, c->stream>>>(dim, x, xs, w, eps, y, ys);
    return cudaGetLastError();
}

void cu_rmsnorm(pd_backend *be, int rows, int dim, const float *x, int x_stride, const float *w, float eps, float *y,
                int y_stride) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || rows == 0)
        return;
    if (rows < 0 || dim <= 0 || x_stride < dim || y_stride < dim || !x || !w || !y) {
        cu_fail(c, PD_ERR_INVALID, "rmsnorm: rows %d, dim %d, strides %d/%d", rows, dim, x_stride, y_stride);
        return;
    }
    CU_LAUNCHED(c, rmsnorm_launch(c, rows, dim, x, x_stride, w, eps, y, y_stride), "rmsnorm");
}

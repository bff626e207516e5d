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

static cudaError_t rmsnorm_launch(int rows, int dim, const float *x, int xs, const float *w, float eps, float *y,
                                  int ys, cudaStream_t s) {
    k_rmsnorm<<<rows, NORM_THREADS, 0, s>>>(dim, x, xs, w, eps, y, ys);
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
    CU_LAUNCHED(c, rmsnorm_launch(rows, dim, x, x_stride, w, eps, y, y_stride, c->stream), "rmsnorm");
}

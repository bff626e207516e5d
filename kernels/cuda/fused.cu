/* Fused step ops (pd_kernels.h mla_prep, add_rmsnorm): the arithmetic of
 * norm.cu, rope.cu and elementwise.cu's kv_store / add, in fewer launches.
 * A decode step of v2-lite runs ~20 kernels a layer and at batch 1 most of
 * them are a few µs of launch and ramp for a few KB of work
 * (docs/benchmarks.md, third version), so each launch saved is time saved.
 * One block per row, as the kernels they replace. */
#include "cuda_common.cuh"

#define FU_THREADS 256

static __global__ void __launch_bounds__(FU_THREADS) k_mla_prep(pd_mla_prep_args a) {
    __shared__ double part[FU_THREADS / 32];
    extern __shared__ float tab[]; /* cos[half] | sin[half] */
    const int r = blockIdx.x, kvr = a.kv_lora_rank, half = a.qk_rope_dim / 2, D = kvr + a.qk_rope_dim;
    const int qd = a.qk_nope_dim + a.qk_rope_dim;
    float *cs = tab, *sn = tab + half;
    for (int i = threadIdx.x; i < half; i += FU_THREADS) {
        float ang = (float)a.pos[r] * a.inv_freq[i];
        cs[i] = cosf(ang) * a.mscale;
        sn[i] = sinf(ang) * a.mscale;
    }
    float *c = a.ckv + (size_t)r * D;
    const float inv = cu_block_inv_rms<FU_THREADS>(c, kvr, a.eps, part); /* its __syncthreads also covers the table */
    float *dst = a.cache + ((size_t)a.slots[r] + a.slot_offset) * D;
    for (int i = threadIdx.x; i < kvr; i += FU_THREADS) {
        const float v = c[i] * inv * a.kv_norm[i];
        c[i] = v;
        dst[i] = v;
    }
    for (int i = threadIdx.x; i < half; i += FU_THREADS) {
        const float x0 = c[kvr + 2 * i], x1 = c[kvr + 2 * i + 1];
        const float y0 = x0 * cs[i] - x1 * sn[i], y1 = x1 * cs[i] + x0 * sn[i];
        c[kvr + 2 * i] = y0;
        c[kvr + 2 * i + 1] = y1;
        dst[kvr + 2 * i] = y0;
        dst[kvr + 2 * i + 1] = y1;
    }
    float *qr = a.q + (size_t)r * a.n_heads * qd + a.qk_nope_dim;
    for (int k = threadIdx.x; k < a.n_heads * half; k += FU_THREADS) {
        const int h = k / half, i = k - h * half;
        float *v = qr + (size_t)h * qd + 2 * i;
        const float x0 = v[0], x1 = v[1];
        v[0] = x0 * cs[i] - x1 * sn[i];
        v[1] = x1 * cs[i] + x0 * sn[i];
    }
}

void cu_mla_prep(pd_backend *be, const pd_mla_prep_args *a) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || a->rows == 0)
        return;
    if (a->rows < 0 || a->n_heads < 0 || a->kv_lora_rank <= 0 || a->qk_rope_dim < 2 || a->qk_rope_dim % 2 ||
        a->qk_rope_dim > 8192 || !a->q || !a->ckv || !a->kv_norm || !a->pos || !a->inv_freq || !a->cache ||
        !a->slots) {
        cu_fail(c, PD_ERR_INVALID, "mla_prep: rows %d, heads %d, kv_lora_rank %d, qk_rope_dim %d", a->rows,
                a->n_heads, a->kv_lora_rank, a->qk_rope_dim);
        return;
    }
    k_mla_prep<<<a->rows, FU_THREADS, (size_t)a->qk_rope_dim * sizeof(float), c->stream>>>(*a);
    CU_LAUNCHED(c, cudaGetLastError(), "mla_prep");
}

static __global__ void __launch_bounds__(FU_THREADS)
    k_add_rmsnorm(int dim, float *x, const float *__restrict__ y, const float *__restrict__ w, float eps, float *h) {
    __shared__ double part[FU_THREADS / 32];
    float *xr = x + (size_t)blockIdx.x * dim;
    const float *yr = y + (size_t)blockIdx.x * dim;
    float *hr = h + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += FU_THREADS)
        xr[i] += yr[i];
    /* each thread reads back only what it wrote: no barrier needed first */
    const float inv = cu_block_inv_rms<FU_THREADS>(xr, dim, eps, part);
    for (int i = threadIdx.x; i < dim; i += FU_THREADS)
        hr[i] = xr[i] * inv * w[i];
}

void cu_add_rmsnorm(pd_backend *be, int rows, int dim, float *x, const float *y, const float *w, float eps, float *h) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || rows == 0)
        return;
    if (rows < 0 || dim <= 0 || !x || !y || !w || !h) {
        cu_fail(c, PD_ERR_INVALID, "add_rmsnorm: rows %d, dim %d", rows, dim);
        return;
    }
    k_add_rmsnorm<<<rows, FU_THREADS, 0, c->stream>>>(dim, x, y, w, eps, h);
    CU_LAUNCHED(c, cudaGetLastError(), "add_rmsnorm");
}

/* RoPE (Su et al. 2021) on interleaved pairs (x[2i], x[2i+1]) of a
 * rope_dim slice of every head, angle pos[r] * inv_freq[i] (fp32 product, as
 * the reference), cos/sin scaled by mscale (YaRN attention factor); the
 * layout of transformers' apply_rotary_pos_emb_interleave. pos and inv_freq
 * arrive in host memory and are copied for the launch. One block per row:
 * the row's cos/sin table in shared memory, then every head's pairs. */
#include "cuda_common.cuh"

#define ROPE_THREADS 128

static __global__ void __launch_bounds__(ROPE_THREADS)
    k_rope(int n_heads, float *x, int row_stride, int head_stride, int half, const int *__restrict__ pos,
           const float *__restrict__ inv_freq, float mscale) {
    cu_pdl_launch_dependents();
    extern __shared__ float tab[]; /* cos[half] | sin[half] */
    float *cs = tab, *sn = tab + half;
    const int r = blockIdx.x;
    for (int i = threadIdx.x; i < half; i += ROPE_THREADS) {
        float ang = (float)pos[r] * inv_freq[i];
        cs[i] = cosf(ang) * mscale;
        sn[i] = sinf(ang) * mscale;
    }
    __syncthreads();
    float *xr = x + (size_t)r * row_stride;
    for (int k = threadIdx.x; k < n_heads * half; k += ROPE_THREADS) {
        int h = k / half, i = k - h * half;
        float *v = xr + (size_t)h * head_stride + 2 * i;
        float a = v[0], b = v[1];
        v[0] = a * cs[i] - b * sn[i];
        v[1] = b * cs[i] + a * sn[i];
    }
}

static cudaError_t rope_launch(int rows, int n_heads, float *x, int row_stride, int head_stride, int half,
                               const int *pos, const float *inv_freq, float mscale, cudaStream_t s) {
    k_rope<<<rows, ROPE_THREADS, 2 * half * sizeof(float), s>>>(n_heads, x, row_stride, head_stride, half, pos,
                                                               inv_freq, mscale);
    return cudaGetLastError();
}

void cu_rope(pd_backend *be, int rows, int n_heads, float *x, int row_stride, int head_stride, int rope_dim,
             const int *pos, const float *inv_freq, float mscale) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || rows == 0 || n_heads == 0 || rope_dim < 2)
        return;
    int half = rope_dim / 2;
    if (rows < 0 || n_heads < 0 || !x || !pos || !inv_freq || half > 4096) {
        cu_fail(c, PD_ERR_INVALID, "rope: rows %d, heads %d, rope_dim %d", rows, n_heads, rope_dim);
        return;
    }
    const int *dpos = (const int *)cu_scratch_upload(c, CU_SCR_ARG0, pos, (size_t)rows * sizeof(int));
    const float *dfreq = (const float *)cu_scratch_upload(c, CU_SCR_ARG1, inv_freq, (size_t)half * sizeof(float));
    if (!dpos || !dfreq)
        return;
    CU_LAUNCHED(c, rope_launch(rows, n_heads, x, row_stride, head_stride, half, dpos, dfreq, mscale, c->stream),
                "rope");
}

/* pos and inv_freq already in device memory (the step's arguments). */
void cu_rope_pos(pd_backend *be, int rows, int n_heads, float *x, int row_stride, int head_stride, int rope_dim,
                 const int32_t *pos, const float *inv_freq, float mscale) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || rows == 0 || n_heads == 0 || rope_dim < 2)
        return;
    int half = rope_dim / 2;
    if (rows < 0 || n_heads < 0 || !x || !pos || !inv_freq || half > 4096) {
        cu_fail(c, PD_ERR_INVALID, "rope_pos: rows %d, heads %d, rope_dim %d", rows, n_heads, rope_dim);
        return;
    }
    CU_LAUNCHED(c, rope_launch(rows, n_heads, x, row_stride, head_stride, half, pos, inv_freq, mscale, c->stream),
                "rope_pos");
}

/* Element-wise operations and the embedding gather:
 *   silu_mul: out[r, i] = silu(gu[r, i]) * gu[r, I + i]   (SwiGLU, gate rows then up rows; gemm_swiglu's
 *             also leaves out in bf16 for the down projection)
 *   add:      x += y
 *   embed:    out[r] = table[ids[r]]   (ids in host memory, checked against the table, then copied)
 */
#include "cuda_common.cuh"

static __device__ __forceinline__ float silu_mul1(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
}

/* out[r, i] = silu(gu[r, i]) · gu[r, I + i], also rounded to bf16 into
 * out16 when B16 (gemm_swiglu: the down projection's input). vec: four
 * values a thread (inter % 4 == 0, gu and out 16-byte aligned, out16 8,
 * rows · inter / 4 < 2^32: indexed in 32 bits); else one. */
template <bool B16>
static __global__ void k_silu_mul(int rows, int inter, int vec, const float *__restrict__ gu, float *__restrict__ out,
                                  __nv_bfloat16 *__restrict__ out16) {
    cu_pdl_launch_dependents();
    if (!vec) {
        const size_t n = (size_t)rows * inter;
        for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < n; k += (size_t)gridDim.x * blockDim.x) {
            const size_t r = k / inter, i = k - r * inter;
            const float a = silu_mul1(gu[r * 2 * inter + i], gu[r * 2 * inter + inter + i]);
            out[k] = a;
            if (B16)
                out16[k] = __float2bfloat16_rn(a);
        }
        return;
    }
    const unsigned q4 = (unsigned)inter / 4, n = (unsigned)rows * q4;
    for (unsigned k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) {
        const unsigned r = k / q4, i4 = k - r * q4;
        const float4 g = __ldg((const float4 *)(gu + (size_t)r * 2 * inter) + i4);
        const float4 u = __ldg((const float4 *)(gu + (size_t)r * 2 * inter + inter) + i4);
        const float4 a = make_float4(silu_mul1(g.x, u.x), silu_mul1(g.y, u.y), silu_mul1(g.z, u.z), silu_mul1(g.w, u.w));
        ((float4 *)out)[k] = a;
        if (B16) {
            __nv_bfloat162 lo = __floats2bfloat162_rn(a.x, a.y), hi = __floats2bfloat162_rn(a.z, a.w);
            ((uint2 *)out16)[k] = make_uint2(*(unsigned *)&lo, *(unsigned *)&hi);
        }
    }
}

static cudaError_t silu_mul_launch(int rows, int inter, const float *gu, float *out, __nv_bfloat16 *out16,
                                   cudaStream_t s) {
    const int vec = inter % 4 == 0 && ((uintptr_t)gu & 15) == 0 && ((uintptr_t)out & 15) == 0 &&
                    ((uintptr_t)out16 & 7) == 0 && (size_t)rows * (inter / 4) < 0xffffffffu;
    const unsigned blocks = cu_blocks((size_t)rows * inter / (vec ? 4 : 1), 256, 16384);
    if (out16)
        k_silu_mul<true><<<blocks, 256, 0, s>>>(rows, inter, vec, gu, out, out16);
    else
        k_silu_mul<false><<<blocks, 256, 0, s>>>(rows, inter, vec, gu, out, NULL);
    return cudaGetLastError();
}

/* Also used by moe.cu. */
cudaError_t cu_silu_mul_launch(int rows, int inter, const float *gu, float *out, cudaStream_t s) {
    return silu_mul_launch(rows, inter, gu, out, NULL, s);
}

cudaError_t cu_silu_mul_x16_launch(int rows, int inter, const float *gu, float *out, __nv_bfloat16 *out16,
                                   cudaStream_t s) {
    return silu_mul_launch(rows, inter, gu, out, out16, s);
}

void cu_silu_mul(pd_backend *be, int rows, int inter, const float *gu, float *out) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || rows == 0 || inter == 0)
        return;
    if (rows < 0 || inter < 0 || !gu || !out) {
        cu_fail(c, PD_ERR_INVALID, "silu_mul: rows %d, inter %d", rows, inter);
        return;
    }
    CU_LAUNCHED(c, cu_silu_mul_launch(rows, inter, gu, out, c->stream), "silu_mul");
}

static __global__ void k_add(size_t n, float *x, const float *y) {
    cu_pdl_launch_dependents();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

static cudaError_t add_launch(size_t n, float *x, const float *y, cudaStream_t s) {
    k_add<<<cu_blocks(n, 256, 16384), 256, 0, s>>>(n, x, y);
    return cudaGetLastError();
}

void cu_add(pd_backend *be, size_t n, float *x, const float *y) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || n == 0)
        return;
    if (!x || !y) {
        cu_fail(c, PD_ERR_INVALID, "add: NULL buffer");
        return;
    }
    CU_LAUNCHED(c, add_launch(n, x, y, c->stream), "add");
}

template <typename W>
static __global__ void k_embed(int dim, const int32_t *__restrict__ ids, const W *__restrict__ table,
                               float *__restrict__ out) {
    cu_pdl_launch_dependents();
    const W *src = table + (size_t)ids[blockIdx.x] * dim;
    float *dst = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        dst[i] = cu_ldw(src, i);
}

static cudaError_t embed_launch(pd_cuda_weights fmt, int rows, int dim, const int32_t *ids, const void *table,
                                float *out, cudaStream_t s) {
    if (fmt == PD_CUDA_WEIGHTS_BF16)
        k_embed<<<rows, 256, 0, s>>>(dim, ids, (const __nv_bfloat16 *)table, out);
    else
        k_embed<<<rows, 256, 0, s>>>(dim, ids, (const float *)table, out);
    return cudaGetLastError();
}

void cu_embed(pd_backend *be, int rows, int dim, const int32_t *ids, const pd_weight *table, float *out) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || rows == 0)
        return;
    if (rows < 0 || !ids || !table || !table->data || !out || dim != table->cols) {
        cu_fail(c, PD_ERR_INVALID, "embed: rows %d, dim %d, table [%d, %d]", rows, dim, table ? table->rows : -1,
                table ? table->cols : -1);
        return;
    }
    for (int r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= table->rows) {
            cu_fail(c, PD_ERR_INVALID, "embed: id %d at row %d outside the table (%d rows)", ids[r], r, table->rows);
            return;
        }
    const int32_t *dids = (const int32_t *)cu_scratch_upload(c, CU_SCR_ARG0, ids, (size_t)rows * sizeof(int32_t));
    if (!dids)
        return;
    CU_LAUNCHED(c, embed_launch(c->wfmt, rows, dim, dids, table->data, out, c->stream), "embed");
}

/* ---- step operations (ids and slots in device memory) ---- */

void cu_embed_ids(pd_backend *be, int rows, int dim, const int32_t *ids, const pd_weight *table, float *out) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || rows == 0)
        return;
    if (rows < 0 || !ids || !table || !table->data || !out || dim != table->cols) {
        cu_fail(c, PD_ERR_INVALID, "embed_ids: rows %d, dim %d, table [%d, %d]", rows, dim, table ? table->rows : -1,
                table ? table->cols : -1);
        return;
    }
    CU_LAUNCHED(c, embed_launch(c->wfmt, rows, dim, ids, table->data, out, c->stream), "embed_ids");
}

/* cache + (slots[r] + off) * dim ← src row r */
static __global__ void k_kv_store(int dim, const float *__restrict__ src, int src_stride, float *__restrict__ cache,
                                  const int32_t *__restrict__ slots, size_t off) {
    cu_pdl_launch_dependents();
    const float *s = src + (size_t)blockIdx.x * src_stride;
    float *d = cache + ((size_t)slots[blockIdx.x] + off) * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        d[i] = s[i];
}

void cu_kv_store(pd_backend *be, int rows, int dim, const float *src, int src_stride, float *cache,
                 const int32_t *slots, size_t slot_offset) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || rows == 0)
        return;
    if (rows < 0 || dim <= 0 || src_stride < dim || !src || !cache || !slots) {
        cu_fail(c, PD_ERR_INVALID, "kv_store: rows %d, dim %d, stride %d", rows, dim, src_stride);
        return;
    }
    k_kv_store<<<rows, 128, 0, c->stream>>>(dim, src, src_stride, cache, slots, slot_offset);
    CU_LAUNCHED(c, cudaGetLastError(), "kv_store");
}

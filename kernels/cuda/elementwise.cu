/* Element-wise operations and the embedding gather:
 *   silu_mul: out[r, i] = silu(gu[r, i]) * gu[r, I + i]   (SwiGLU, gate rows then up rows)
 *   add:      x += y
 *   embed:    out[r] = table[ids[r]]   (ids in host memory, checked against the table, then copied)
 */
#include "cuda_common.cuh"

static __global__ void k_silu_mul(int rows, int inter, const float *__restrict__ gu, float *__restrict__ out) {
    cu_pdl_launch_dependents();
    size_t n = (size_t)rows * inter;
    for (size_t k = blockIdx.x * (size_t)blockDim.x + threadIdx.x; k < n; k += (size_t)gridDim.x * blockDim.x) {
        size_t r = k / inter, i = k - r * inter;
        float g = gu[r * 2 * inter + i], u = gu[r * 2 * inter + inter + i];
        out[k] = g / (1.0f + expf(-g)) * u;
    }
}

/* Also used by moe.cu. */
cudaError_t cu_silu_mul_launch(int rows, int inter, const float *gu, float *out, cudaStream_t s) {
    k_silu_mul<<<cu_blocks((size_t)rows * inter, 256, 16384), 256, 0, s>>>(rows, inter, gu, out);
    return cudaGetLastError();
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

/* Device memory and weights. Buffers are cudaMalloc'd and zero-filled;
 * copies run on the backend's stream (upload and download wait for their
 * bytes, so the caller may reuse its host buffer at once, as on the CPU).
 * Weights are [rows × cols] row-major, fp32 or bf16 (round to nearest
 * even) by the backend's format. */
#include "cuda_common.cuh"

#include <string.h>

/* Weights larger than this are converted in pieces, bounding the staging buffer. */
#define CU_WCONV_CHUNK ((size_t)32 << 20) /* elements */

/* The device memory the backend holds, counted at every cudaMalloc and
 * cudaFree of its own (not the CUDA context's, cuBLAS's or NCCL's
 * internals): what --gpu-memory-utilization charges to this replica
 * (pd_kv_plan_blocks), so that other processes' memory does not. */
void cu_count_alloc(cu_ctx *c, size_t bytes) {
    c->dev_bytes += bytes;
}

void cu_count_free(cu_ctx *c, size_t bytes) {
    c->dev_bytes = c->dev_bytes > bytes ? c->dev_bytes - bytes : 0;
}

size_t cu_device_bytes(pd_backend *be) {
    return cu_of(be)->dev_bytes;
}

void *cu_alloc(pd_backend *be, size_t bytes) {
    cu_ctx *c = cu_of(be);
    void *p = NULL;
    const size_t n = bytes ? bytes : 256;
    cudaError_t e = cudaMalloc(&p, n);
    if (e != cudaSuccess) {
        /* the caller learns of it by NULL, as from the CPU backend; nothing sticky */
        (void)cudaGetLastError();
        CU_LOGW("cudaMalloc(%zu bytes): %s", bytes, cudaGetErrorString(e));
        return NULL;
    }
    if (!CU_OK(c, cudaMemsetAsync(p, 0, n, c->stream))) {
        cudaFree(p);
        return NULL;
    }
    /* remember the size for cu_free (a few dozen live buffers: a list will do) */
    if (c->n_allocs == c->cap_allocs) {
        int cap = c->cap_allocs ? 2 * c->cap_allocs : 64;
        cu_alloc_rec *a = (cu_alloc_rec *)realloc(c->allocs, (size_t)cap * sizeof *a);
        if (!a) {
            cudaFree(p);
            CU_LOGW("cudaMalloc(%zu bytes): out of host memory for the allocation list", bytes);
            return NULL;
        }
        c->allocs = a;
        c->cap_allocs = cap;
    }
    c->allocs[c->n_allocs].p = p;
    c->allocs[c->n_allocs++].bytes = n;
    cu_count_alloc(c, n);
    return p;
}

void cu_free(pd_backend *be, void *p) {
    cu_ctx *c = cu_of(be);
    if (!p)
        return;
    CU_OK(c, cudaStreamSynchronize(c->stream)); /* queued work may still use p */
    CU_OK(c, cudaFree(p));
    for (int i = c->n_allocs - 1; i >= 0; i--)
        if (c->allocs[i].p == p) {
            cu_count_free(c, c->allocs[i].bytes);
            c->allocs[i] = c->allocs[--c->n_allocs];
            break;
        }
}

void cu_upload(pd_backend *be, void *dst, const void *src_host, size_t bytes) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || !bytes)
        return;
    if (CU_OK(c, cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, c->stream)))
        CU_OK(c, cudaStreamSynchronize(c->stream)); /* pinned sources too may be reused on return */
}

void cu_upload_async(pd_backend *be, void *dst, const void *src_host, size_t bytes) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || !bytes)
        return;
    if (c->capturing) {
        cu_fail(c, PD_ERR_UNSUPPORTED, "upload_async: not while recording a graph");
        return;
    }
    if (!c->upload_ev && !CU_OK(c, cudaEventCreateWithFlags(&c->upload_ev, cudaEventDisableTiming)))
        return;
    if (!CU_OK(c, cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, c->stream)))
        return;
    if (CU_OK(c, cudaEventRecord(c->upload_ev, c->stream)))
        c->upload_pending = true;
    else
        cudaStreamSynchronize(c->stream); /* no event to wait on: the copy must not outlive the call */
}

void cu_upload_wait(pd_backend *be) {
    cu_ctx *c = cu_of(be);
    if (!c->upload_pending)
        return;
    if (c->capturing) {
        cu_fail(c, PD_ERR_UNSUPPORTED, "upload_wait: not while recording a graph");
        return;
    }
    c->upload_pending = false;
    if (cudaEventSynchronize(c->upload_ev) != cudaSuccess) /* a failed copy: the stream's error says why */
        CU_OK(c, cudaStreamSynchronize(c->stream));
}

void cu_download(pd_backend *be, void *dst_host, const void *src, size_t bytes) {
    cu_ctx *c = cu_of(be);
    if (!bytes)
        return;
    if (c->status == PD_OK && CU_OK(c, cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, c->stream)) &&
        CU_OK(c, cudaStreamSynchronize(c->stream)))
        return;
    memset(dst_host, 0xff, bytes); /* NaN: a failed step must not pass for numbers */
}

void cu_copy(pd_backend *be, void *dst, const void *src, size_t bytes) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK || !bytes)
        return;
    CU_OK(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream));
}

static __global__ void k_f32_to_bf16(const float *__restrict__ x, __nv_bfloat16 *__restrict__ y, size_t n) {
    cu_pdl_launch_dependents();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16_rn(x[i]);
}

static __global__ void k_f32_to_bf16_x4(const float4 *__restrict__ x, __nv_bfloat162 *__restrict__ y, size_t n4) {
    cu_pdl_launch_dependents();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
        float4 v = x[i];
        y[2 * i] = __floats2bfloat162_rn(v.x, v.y);
        y[2 * i + 1] = __floats2bfloat162_rn(v.z, v.w);
    }
}

/* Also used by gemm.cu for activations. */
cudaError_t cu_f32_to_bf16_launch(const float *x, __nv_bfloat16 *y, size_t n, cudaStream_t s) {
    if (n % 4 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)y & 7) == 0) {
        size_t n4 = n / 4;
        k_f32_to_bf16_x4<<<cu_blocks(n4, 256, 8192), 256, 0, s>>>((const float4 *)x, (__nv_bfloat162 *)y, n4);
    } else {
        k_f32_to_bf16<<<cu_blocks(n, 256, 8192), 256, 0, s>>>(x, y, n);
    }
    return cudaGetLastError();
}

pd_status cu_weight_from_f32(pd_backend *be, const float *host, int rows, int cols, pd_weight *w_p) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK)
        return c->status;
    if (rows < 0 || cols < 0)
        return cu_fail(c, PD_ERR_INVALID, "weight_from_f32: shape [%d, %d]", rows, cols);
    size_t n = (size_t)rows * (size_t)cols;
    size_t esz = c->wfmt == PD_CUDA_WEIGHTS_BF16 ? 2 : 4;
    void *d = NULL;
    cudaError_t e = cudaMalloc(&d, n ? n * esz : 256);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        /* out of memory loading a model is the caller's to report, not sticky */
        CU_LOGW("weight [%d, %d]: cudaMalloc(%zu bytes): %s", rows, cols, n * esz, cudaGetErrorString(e));
        return PD_ERR_NOMEM;
    }
    if (c->wfmt == PD_CUDA_WEIGHTS_F32) {
        if (n && !CU_OK(c, cudaMemcpyAsync(d, host, n * 4, cudaMemcpyHostToDevice, c->stream)))
            goto err_free;
    } else {
        for (size_t off = 0; off < n; off += CU_WCONV_CHUNK) {
            size_t k = n - off < CU_WCONV_CHUNK ? n - off : CU_WCONV_CHUNK;
            float *stage = (float *)cu_scratch_upload(c, CU_SCR_WCONV, host + off, k * sizeof(float));
            if (!stage)
                goto err_free;
            if (!CU_LAUNCHED(c, cu_f32_to_bf16_launch(stage, (__nv_bfloat16 *)d + off, k, c->stream), "f32_to_bf16"))
                goto err_free;
        }
    }
    if (!CU_OK(c, cudaStreamSynchronize(c->stream)))
        goto err_free;
    w_p->rows = rows;
    w_p->cols = cols;
    w_p->data = d;
    cu_count_alloc(c, n ? n * esz : 256);
    return PD_OK;

err_free:
    cudaFree(d);
    return c->status;
}

/* The bytes cu_weight_from_f32 / cu_weight_alloc took for w. */
static size_t weight_bytes(const cu_ctx *c, const pd_weight *w) {
    size_t n = (size_t)w->rows * (size_t)w->cols;
    return n ? n * (c->wfmt == PD_CUDA_WEIGHTS_BF16 ? 2 : 4) : 256;
}

void cu_weight_free(pd_backend *be, pd_weight *w) {
    cu_ctx *c = cu_of(be);
    if (w->data) {
        cudaStreamSynchronize(c->stream);
        CU_OK(c, cudaFree(w->data));
        cu_count_free(c, weight_bytes(c, w));
    }
    w->data = NULL;
}

/* ---- page-locked host memory and bf16 loading ---- */

/* Portable: page-locked for every device, so that each rank of a
 * tensor-parallel group copies from a KV host pool at full speed. */
void *cu_host_alloc(pd_backend *be, size_t bytes) {
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 256, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        CU_LOGW("cudaHostAlloc(%zu bytes): %s", bytes, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

pd_status cu_host_register(pd_backend *be, void *p, size_t bytes) {
    (void)be;
    cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        CU_LOGW("cudaHostRegister(%zu bytes): %s", bytes, cudaGetErrorString(e));
        return PD_ERR_IO;
    }
    return PD_OK;
}

/* Gives host memory back to the driver once no queued copy reads it:
 * unregistered (the caller's memory) or freed (host_alloc's). */
static void host_release(pd_backend *be, void *p, bool registered) {
    cu_ctx *c = cu_of(be);
    if (!p)
        return;
    CU_OK(c, cudaStreamSynchronize(c->stream)); /* a queued copy may still read it */
    CU_OK(c, registered ? cudaHostUnregister(p) : cudaFreeHost(p));
}

void cu_host_unregister(pd_backend *be, void *p) {
    host_release(be, p, true);
}

void cu_host_free(pd_backend *be, void *p) {
    host_release(be, p, false);
}

pd_status cu_weight_alloc(pd_backend *be, int rows, int cols, pd_weight *w_p) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK)
        return c->status;
    if (rows < 0 || cols < 0)
        return cu_fail(c, PD_ERR_INVALID, "weight_alloc: shape [%d, %d]", rows, cols);
    size_t n = (size_t)rows * (size_t)cols, esz = c->wfmt == PD_CUDA_WEIGHTS_BF16 ? 2 : 4;
    void *d = NULL;
    cudaError_t e = cudaMalloc(&d, n ? n * esz : 256);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        CU_LOGW("weight [%d, %d]: cudaMalloc(%zu bytes): %s", rows, cols, n * esz, cudaGetErrorString(e));
        return PD_ERR_NOMEM;
    }
    w_p->rows = rows;
    w_p->cols = cols;
    w_p->data = d;
    cu_count_alloc(c, n ? n * esz : 256);
    return PD_OK;
}

static __global__ void k_bf16_to_f32(const __nv_bfloat16 *__restrict__ x, float *__restrict__ y, size_t n) {
    cu_pdl_launch_dependents();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = __bfloat162float(x[i]);
}

/* bf16 weights: the bits as they are (pageable copy in pieces); fp32
 * weights: the bits staged in scratch and widened on the GPU. */
pd_status cu_weight_set_bf16(pd_backend *be, pd_weight *w, int row0, int n_rows, const uint16_t *src) {
    cu_ctx *c = cu_of(be);
    if (c->status != PD_OK)
        return c->status;
    if (!w || !w->data || row0 < 0 || n_rows < 0 || row0 + n_rows > w->rows || (!src && n_rows > 0))
        return cu_fail(c, PD_ERR_INVALID, "weight_set_bf16: rows %d + %d of [%d, %d]", row0, n_rows, w ? w->rows : -1,
                       w ? w->cols : -1);
    size_t n = (size_t)n_rows * w->cols, first = (size_t)row0 * w->cols;
    if (n == 0)
        return PD_OK;
    if (c->wfmt == PD_CUDA_WEIGHTS_BF16) {
        if (!CU_OK(c, cudaMemcpyAsync((uint16_t *)w->data + first, src, n * 2, cudaMemcpyHostToDevice, c->stream)))
            return c->status;
    } else {
        for (size_t off = 0; off < n; off += CU_WCONV_CHUNK) {
            size_t k = n - off < CU_WCONV_CHUNK ? n - off : CU_WCONV_CHUNK;
            const __nv_bfloat16 *stage =
                (const __nv_bfloat16 *)cu_scratch_upload(c, CU_SCR_WCONV, src + off, k * sizeof(uint16_t));
            if (!stage)
                return c->status;
            k_bf16_to_f32<<<cu_blocks(k, 256, 8192), 256, 0, c->stream>>>(stage, (float *)w->data + first + off, k);
            if (!CU_LAUNCHED(c, cudaGetLastError(), "bf16_to_f32"))
                return c->status;
        }
    }
    if (!CU_OK(c, cudaStreamSynchronize(c->stream)))
        return c->status;
    return PD_OK;
}

/* kernels/cuda/ — the CUDA backend (sm_90a). Read this header first.
 *
 * pd_backend_cuda_init (pd_kernels.h) gives the table of pd_backend_i on
 * one GPU. Everything runs in order on one CUDA stream owned by the backend;
 * upload and download return when the bytes have arrived. Weights are kept
 * as bf16 (the default) or fp32; activations are fp32 everywhere, GEMMs
 * accumulate in fp32 (bf16: cuBLASLt, activations rounded to bf16 on the way
 * in; fp32: cublasSgemm without TF32). With bf16 weights the rounded copy
 * of a GEMM's input is kept for a following gemm on the same x (gemm_swiglu
 * leaves act's for the down projection) and forgotten at every other
 * operation (gemm.cu states the rule); the prefill MoE's expert GEMMs
 * write bf16 outputs, read back in fp32 arithmetic (PD_MOE_Y=f32: fp32).
 *
 * Errors: the table's operations return void, so the backend keeps the
 * first failure (a bad argument, a failed launch, an out-of-memory scratch
 * buffer, a fault found at the next synchronisation) as a sticky status,
 * logs it once, turns every later operation into a no-op and makes download
 * fill its destination with NaN, so no caller mistakes a failed step for
 * numbers. pd_backend_cuda_status returns it.
 *
 * Decode steps: the step operations of pd_kernels.h (embed_ids, rope_pos,
 * kv_store, mla_decode, moe_route_ids, moe_experts_ids) read every index
 * array from device memory and never wait on the host, and GEMMs of at
 * most 4 rows go through a skinny-GEMM kernel (fp32 activations, 16-byte
 * weight loads) instead of cuBLASLt, so that the model can record a whole
 * decode step with graph_begin / graph_end (stream capture) and replay it.
 * A scratch buffer that has to grow bumps a generation number; graphs
 * recorded before it are stale (graph_launch says so) and are recorded
 * again. Growing while recording is refused; a recording that fails turns
 * graphs off for the backend, which keeps working without them.
 *
 * Tensor parallelism (pd_backend_cuda_init_tp): one backend per GPU, rank
 * r on device r, one NCCL communicator per rank from ncclCommInitAll (NCCL
 * loaded at run time); all_reduce_sum is ncclAllReduce on the rank's
 * stream, so it is recorded in a step's graph like any operation. Each
 * rank's operations come from that rank's thread (thread_bind sets its
 * device). A rank whose backend has failed still queues its all-reduces, so
 * that the others do not wait for ever; its numbers are garbage, and only
 * rank 0's failure shows in the logits (NaN).
 *
 * One file per op family, each in three layers (static __global__ kernel →
 * static launcher taking a cudaStream_t → table entry that checks its
 * arguments): memory.cu (memory, weights, page-locked host memory), gemm.cu
 * (cuBLASLt and the grouped skinny GEMM), norm.cu, rope.cu, elementwise.cu
 * (silu_mul, add, embed, kv_store), mla.cu, moe.cu, comm.cu (NCCL);
 * backend_cuda.cu holds the table, the handles and the graphs.
 */
#ifndef PD_CUDA_H
#define PD_CUDA_H

#include "pd_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/** How the CUDA backend stores weights. */
typedef enum {
    PD_CUDA_WEIGHTS_BF16 = 0, /* bf16, cuBLASLt bf16 × bf16 → fp32 GEMMs (default) */
    PD_CUDA_WEIGHTS_F32 = 1,  /* fp32, cublasSgemm without TF32: matches the CPU to ~1e-6 */
} pd_cuda_weights;

/** Creates the CUDA backend on `device` storing weights as `weights`.
 * pd_backend_cuda_init(device, ...) is this with the format named by the
 * environment variable PD_CUDA_WEIGHTS ("bf16", the default, or "f32").
 * Errors: PD_ERR_UNSUPPORTED (no such device, not sm_90), PD_ERR_NOMEM,
 * PD_ERR_IO (a CUDA or cuBLAS call failed; err says which). */
pd_status pd_backend_cuda_init_ex(int device, pd_cuda_weights weights, pd_backend **be_p, pd_err *err);

/** Waits for the work queued so far, then returns the backend's first
 * error since it was created (PD_OK when none; err gets its message).
 * be must be a CUDA backend. */
pd_status pd_backend_cuda_status(pd_backend *be, pd_err *err);

/** The cudaStream_t every operation runs on, for timing with events. */
void *pd_backend_cuda_stream(pd_backend *be);

/** The backend's optional fast paths, each switchable so that its effect
 * can be measured (PD_CUDA_GRAPHS=0 starts with graphs off): graphs
 * (graph_begin refuses, recorded graphs are not replayed), gemv (the
 * skinny-GEMM kernel for M <= 4; else cuBLASLt / cublasSgemm), moe_device
 * (moe_experts_ids on the GPU; else ids back to the host and moe_experts)
 * are on by default. mla_prefill_gemm (the expanded MLA attention of
 * prefill as bf16 tensor-core GEMMs through cuBLAS, scores and softmax in
 * fp32, for bf16 weights; else the fp32 one-block-per-query kernel) and
 * mla_prefill_flash (the same attention by one fused kernel that keeps the
 * scores on chip, mla_flash.cu; q dim 192 and v dim 128, DeepSeek-V2/V3;
 * other dims take the GEMMs) are on by default, the fused kernel on
 * warpgroup MMA (wgmma, sm_90) unless mla_flash_mma (mma.sync; also
 * PD_MLA_FLASH=mma at start, for A/B runs); PD_MLA_PREFILL=gemm starts
 * with the GEMMs, =kernel with the fp32 kernel. mla_prefill_chunk: the
 * GEMM path's queries per chunk (0: as many as CU_MLA_PREFILL_SCRATCH
 * bytes of scores allow; tests set it small to cover the chunk loop). */
typedef struct {
    bool graphs, gemv, moe_device, mla_prefill_gemm;
    int mla_prefill_chunk;
    bool mla_prefill_flash;
    bool mla_flash_mma;
} pd_cuda_features;
void pd_backend_cuda_set_features(pd_backend *be, const pd_cuda_features *f);

/** The NCCL this process loads (libnccl.so.2 or $PD_NCCL_LIB, dlopen'd
 * once): writes "major.minor.patch" into buf (n bytes) and returns the
 * version code (major*10000 + minor*100 + patch), or writes "not loaded:
 * <why>" and returns 0. Thread-safe; loads NCCL on the first call. */
int pd_cuda_nccl_version(char *buf, size_t n);

#ifdef __cplusplus
}
#endif

#endif

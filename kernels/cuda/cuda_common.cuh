/* Private to kernels/cuda/: the backend's state, the sticky-error helpers,
 * grow-only scratch buffers, weight loads by format, warp reductions, and
 * the table entries / shared launchers each family file defines. */
#ifndef PD_CUDA_COMMON_CUH
#define PD_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

extern "C" {
#include "pd_kernels.h"
}
#include "pd_cuda.h"

/* Scratch buffers, one per use, so that no operation's scratch is another's
 * live data. All work is on one stream, so a buffer is free for reuse as
 * soon as the next operation is queued after the last one that read it. */
enum {
    CU_SCR_ARG0,      /* host arrays copied for one call: pos, ids, block table, route ids */
    CU_SCR_ARG1,      /* inv_freq, route weights */
    CU_SCR_GEMM_X,    /* bf16 copy of a GEMM's activations, kept for the next GEMM (cu_ctx.x16) */
    CU_SCR_WCONV,     /* fp32 staging of weight_from_f32 (bf16) */
    CU_SCR_MLA_LAT,   /* expanded: gathered latents [L, kvr] */
    CU_SCR_MLA_KPE,   /* expanded: gathered k_pe [L, dr] */
    CU_SCR_MLA_KV,    /* expanded: k_nope | v [L, nh, dn + dv] */
    CU_SCR_MLA_QKV16, /* expanded on tensor cores: bf16 q [n_q, nh, qd], k [L, nh, qd], v [L, nh, dv] */
    CU_SCR_MLA_S,     /* expanded on tensor cores: scores of one query chunk, fp32 [nh, qc, ld] */
    CU_SCR_MLA_P,     /* expanded on tensor cores: probabilities of one query chunk, bf16 [nh, qc, ld] */
    CU_SCR_MLA_QL,    /* absorbed: [n_q, nh, kvr + dr] query in latent space */
    CU_SCR_MLA_PART,  /* absorbed: split partials (m, l, o_lat) */
    CU_SCR_MOE_IDX,   /* expert permutation tables */
    CU_SCR_MOE_X,     /* gathered expert inputs [n, H] */
    CU_SCR_MOE_GU,    /* [n, 2I] */
    CU_SCR_MOE_ACT,   /* [n, I] */
    CU_SCR_MOE_Y,     /* [n, H] */
    CU_SCR_SAMPLE,    /* sample_rows: its rows, listed tokens, their raw logits, results */
    CU_SCR_COUNT
};

/* Page-locked host scratch, one per use: copies to and from it are DMA in
 * stream order, and a buffer stays allocated from one call to the next (a
 * fresh malloc of hundreds of KB costs its page faults every call: 0.6 ms
 * a MoE layer of an 8K prefill, measured). cu_host_scratch waits for the
 * copies queued from the buffer since its last cu_host_scratch_queued. */
enum {
    CU_HSCR_MOE_IDS,  /* prefill MoE: route ids and weights downloaded [n] + [n], or the plan's counts [E + 2] */
    CU_HSCR_MOE_PLAN, /* prefill MoE: the host plan, uploaded (moe.cu moe_plan) */
    CU_HSCR_SAMPLE,   /* sample_rows: rows and listed tokens uploaded from it, results stored into it by the kernels
                         (sample.cu) */
    CU_HSCR_COUNT
};

/* Device tables of expert weight pointers, one per array of pd_weight the
 * model passes (one per layer and kind), made on first use and checked
 * against the host pointers on every use. */
typedef struct {
    const pd_weight *key;
    int n;
    const void **host; /* the data pointers the device table holds */
    const void **dev;
} cu_wtable;

struct cu_gemm_plan; /* gemm.cu */

typedef struct {
    void *p;
    size_t bytes;
} cu_alloc_rec;

typedef struct {
    int device, n_sm;
    size_t smem_optin; /* largest dynamic shared memory a block may ask for */
    size_t smem_per_sm, smem_reserved; /* a SM's shared memory, and what the system reserves of it a block */
    pd_cuda_weights wfmt;
    cudaStream_t stream;
    cudaEvent_t upload_ev; /* recorded after the last upload_async's copy (memory.cu); 0 until the first */
    bool upload_pending;   /* upload_ev recorded and not waited for */
    cublasHandle_t blas;
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t mm_desc; /* W^T · x, bf16 in, fp32 out, fp32 compute */
    void *lt_ws;
    size_t lt_ws_bytes;
    struct cu_gemm_plan *plans;
    int n_plans, next_plan;
    /* The bf16 copy in scratch CU_SCR_GEMM_X of the fp32 activations src
     * [n] (NULL: none), which a table GEMM on the same x and n reads
     * instead of rounding x again. Forgotten at the entry of every other
     * table operation and wherever src may change: gemm.cu, top, states
     * the rule; cu_x16_forget. */
    struct {
        const float *src;
        size_t n;
    } x16;
    struct {
        void *p;
        size_t bytes;
    } scr[CU_SCR_COUNT];
    struct {
        void *p;
        size_t bytes;
        cudaEvent_t done; /* recorded after the last copy queued that reads p */
        bool pending;
    } hscr[CU_HSCR_COUNT];
    uint64_t scr_gen;   /* bumped whenever a scratch buffer moves (graphs recorded before are stale) */
    bool capturing;     /* between graph_begin and graph_end */
    bool graphs_off;    /* PD_CUDA_GRAPHS=0, or a recording failed */
    bool no_gemv, no_moe_device; /* pd_cuda_features switched off */
    int mla_min_chunk;           /* batched decode attention: least tokens a split (PD_MLA_MIN_CHUNK) */
    int mla_first_kernels;       /* PD_MLA_FIRST_KERNELS=qlat|merge|1 (both): the first q_lat / merge kernels */
    bool pdl;                    /* skinny GEMMs by programmatic dependent launch (PD_CUDA_PDL=0: off) */
    bool mla_prefill_gemm;       /* expanded MLA through cuBLAS batched GEMMs (PD_MLA_PREFILL=gemm) */
    int mla_prefill_chunk;       /* its queries per chunk; 0: sized by CU_MLA_PREFILL_SCRATCH */
    bool mla_prefill_flash;      /* expanded MLA by the fused kernel (mla_flash.cu; PD_MLA_PREFILL=flash) */
    bool mla_flash_wgmma;        /* ... on warpgroup MMA (sm_90 and later; PD_MLA_FLASH=mma: mma.sync, A/B runs) */
    bool mla_flash_wgmma_start;  /* that choice at start (pd_backend_cuda_set_features' mla_flash_mma overrides it) */
    bool mla_flash_wg2;          /* two warpgroups a block share each k, v tile (PD_MLA_FLASH_WG=1: one, A/B runs) */
    int mla_flash_vswap;         /* PD_MLA_FLASH_VSWAP=1: the wgmma kernel's v descriptor offsets swapped (layout check) */
    bool gemm_exact_plans;       /* PD_CUDA_GEMM_PLANS=exact: a cuBLASLt plan per exact M (gemm.cu plan_bucket) */
    bool moe_host_plan;          /* PD_MOE_PLAN=host: the prefill MoE's plan made on the host (A/B runs) */
    bool moe_f32_rows;           /* PD_MOE_ROWS=f32: the prefill MoE's rows in fp32, rounded per GEMM (A/B runs) */
    bool moe_y_f32;              /* PD_MOE_Y=f32: the prefill MoE's GEMM outputs (gate_up, down) in fp32 (A/B runs) */
    bool moe_block_composed;     /* PD_MOE_BLOCK=0: moe_block as the separate ops (A/B runs) */
    bool moe_route_in_gate;      /* PD_MOE_ROUTE=gate: at one row too, k_moe_gate's last block routes (A/B runs) */
    bool mla_prep_apart;         /* PD_MLA_PREP=apart: mla_decode's prologue as mla_prep, not in q_lat (A/B runs) */
    bool mla_decode_scalar;      /* PD_MLA_DECODE=scalar: the split attention on CUDA cores, not TF32 mma (A/B runs) */
    bool
        moe_gu1_plain; /* PD_MOE_GU1_PDL=0: the batch-1 gate_up launched after the gate kernel, not by PDL (A/B runs) */
    bool moe_down1_off; /* PD_MOE_DOWN1=0: the batch-1 down GEMV after the gate_up, not by PDL during it (k_moe_down1;
                           A/B runs) */
    bool moe_shared_last;        /* PD_MOE_SHARED_FIRST=0: batch-1 gate_up blocks of the shared experts after the routed (A/B runs) */
    bool gemv_pre_off; /* PD_GEMV_PRE=0: one-row GEMVs prefetch their weights into L2 before the PDL wait instead of
                          loading them into registers (A/B runs) */
    bool mla_pdl_off; /* PD_MLA_PDL=0: the decode attention's q_lat, split and merge kernels launched plainly, not by
                         PDL with their weights / first tile loaded before the wait (A/B runs) */
    bool moe_oroute_off; /* PD_MOE_OROUTE=0: moe_block's o_proj as its own GEMV and the gate kernel after it, not
                            k_oproj_route with the router's logits beside it (A/B runs) */
    bool mla_merge_slow; /* PD_MLA_MERGE_FAST=0: the decode merge without its one-round-trip path (A/B runs) */
    bool uva; /* unified addressing: kernels may store to cudaHostAlloc's memory through its pointer */
    bool sample_generic; /* PD_SAMPLE_GREEDY_FAST=0: greedy rows with nothing else asked through k_sample too, not
                            the many-block argmax (sample.cu; A/B runs) */
    bool sample_wc_off; /* PD_SAMPLE_WCACHE=0: k_sample recomputes every pass's weights (l / t, expf) instead of
                           keeping them from the pass after the max (sample.cu; A/B runs) */
    int sample_cl_force; /* PD_SAMPLE_CLUSTER=N (1, 2, 4, 8 or 16): k_sample's blocks a row, whatever the batch and
                            vocabulary (1: one block a row, the first version; A/B runs and tests); 0: chosen */
    int sample_cl_max;   /* the largest cluster k_sample may launch with on this device (0: not asked yet) */
    int sample_cl_fit[5]; /* [k], k >= 1: clusters of 2^k blocks of k_sample the device holds at once (0: refused) */
    bool mla_tile_pre1;  /* PD_MLA_TILE_PRE=1: the split attention loads before its wait only a first tile with no
                            row of this step's, not the old rows of its first two tiles (A/B runs) */
    bool mla_tile_bulk;  /* sm_90 and later, unless PD_MLA_TILE_BULK=0: the split attention's tiles (k_mla_decode_tc
                            by PDL, PRE 2) come in by Hopper bulk copies, a cache row each, not every thread's
                            16-byte cp.async (A/B runs) */
    bool mla_merge_cl;   /* sm_90 and later, unless PD_MLA_MERGE_CLUSTER=0: the decode merge (k_mla_combine8 by PDL)
                            as clusters of its CMB_Z blocks a (query, head), each merging a quarter of the latent
                            and gathering the rest from the others' shared memory, not each merging all of it
                            (A/B runs) */
    bool mla_qlat_pre1;  /* PD_QLAT_PRE=1: q_lat's prologue (c_KV's norm and store, the ropes) reads all it needs
                            after its wait, not the weights, slots and rope factors before it (A/B runs) */
    bool norm_v_off;     /* PD_NORM_V=0: rmsnorm as the first kernel (k_rmsnorm), not k_rmsnorm_v (A/B runs) */
    bool moe_cmb1_plain; /* PD_MOE_COMBINE1_PDL=0: the batch-1 combine after k_moe_down1 as a plain launch, not by PDL
                            with x read before the wait (A/B runs) */
    bool moe_dn1_cmb_off; /* PD_MOE_DOWN1_COMBINE=0: at one row with og, k_moe_down1 then the combine kernel, not
                             k_moe_down1c with the combine inside (A/B runs) */
    bool moe_gu1_pass_off; /* PD_MOE_GU1_PASS=0: the batch-1 gate_up GEMV (bf16, 4 rows a warp) in one pass of 4
                              rows, not 4 passes of one spread over every SM (gu1_gemv, moe.cu; A/B runs) */
    int moe1_rows_gu, moe1_rows_dn; /* PD_MOE1_ROWS=G,D (2 or 4 each): output rows a warp of the batch-1 gate_up
                                       and down GEMVs (k_moe_gate_up1, k_moe_down1); 4 halves their blocks (A/B runs) */
    int qlat_cols;               /* PD_QLAT_COLS=256: the decode q_lat kernel's 256 latent columns a block (A/B runs) */
    int mla_max_splits;          /* PD_MLA_SPLITS: the batched decode attention's most splits a query (default min(SMs, DEC_GRAPH_SPLITS), mla.cu) */
    cu_wtable *wtabs;
    int n_wtabs, cap_wtabs;
    struct cu_moe_set *moe_sets; /* moe_block's tables of routed and shared experts (moe.cu) */
    int n_moe_sets, cap_moe_sets;
    size_t dev_bytes; /* device memory this backend holds: cu_alloc buffers, weights, scratch, tables, workspace */
    cu_alloc_rec *allocs; /* cu_alloc's live buffers, for cu_free to subtract */
    int n_allocs, cap_allocs;
    void *nccl_comm; /* this rank's ncclComm_t in a tensor-parallel group (comm.cu), else NULL */
    pd_status status; /* first error, sticky */
    char msg[512];
} cu_ctx;

static inline cu_ctx *cu_of(pd_backend *be) {
    return (cu_ctx *)be->ctx;
}

/* pdcuda links after pdcore and must not call back into it (a static
 * library cycle the build does not declare), so it has its own copies of
 * pd_err_set and pd_log: same behaviour, same line format, same
 * PDSERVE_LOG_LEVEL. */
pd_status cu_err_set(pd_err *err, pd_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The properties of CUDA device `device` (device_info.cu), after checking
 * that it exists. Errors: PD_ERR_UNSUPPORTED (no CUDA device or driver, or
 * no device of that index), PD_ERR_IO (cudaGetDeviceProperties failed). */
pd_status cu_device_props(int device, cudaDeviceProp *prop_p, pd_err *err);
void cu_log(pd_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define CU_LOGD(...) cu_log(PD_LOG_DEBUG, __VA_ARGS__)
#define CU_LOGI(...) cu_log(PD_LOG_INFO, __VA_ARGS__)
#define CU_LOGW(...) cu_log(PD_LOG_WARN, __VA_ARGS__)
#define CU_LOGE(...) cu_log(PD_LOG_ERROR, __VA_ARGS__)

/* Records the first error (later ones are only logged at debug level) and
 * logs it; returns st. */
pd_status cu_fail(cu_ctx *c, pd_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* true when e is cudaSuccess; else records "<what>: <cuda error>" and returns false. */
bool cu_check(cu_ctx *c, cudaError_t e, const char *what, const char *file, int line);
bool cu_blas_check(cu_ctx *c, cublasStatus_t s, const char *what, const char *file, int line);
#define CU_OK(c, call) cu_check((c), (call), #call, __FILE__, __LINE__)
#define CU_LAUNCHED(c, err, name) cu_check((c), (err), name, __FILE__, __LINE__)
#define CU_BLAS_OK(c, call) cu_blas_check((c), (call), #call, __FILE__, __LINE__)

/* Scratch slot `slot` with at least `bytes`; NULL (error recorded) on failure. */
void *cu_scratch(cu_ctx *c, int slot, size_t bytes);
/* Copies host bytes into scratch slot `slot`; returns the device copy or NULL. */
void *cu_scratch_upload(cu_ctx *c, int slot, const void *host, size_t bytes);
/* Page-locked host scratch slot `slot` (CU_HSCR_*) of at least `bytes`,
 * once every copy queued from it before (cu_host_scratch_queued) is done;
 * grows by cudaHostAlloc, never shrinks; freed with the backend. NULL
 * (error recorded) when the allocation fails. */
void *cu_host_scratch(cu_ctx *c, int slot, size_t bytes);
/* Marks that copies reading host scratch `slot` are queued on the stream:
 * the next cu_host_scratch of the slot waits for them. */
void cu_host_scratch_queued(cu_ctx *c, int slot);

/* Weight element loads: fp32 or bf16 storage, fp32 arithmetic. */
__device__ __forceinline__ float cu_ldw(const float *p, size_t i) {
    return p[i];
}
__device__ __forceinline__ float cu_ldw(const __nv_bfloat16 *p, size_t i) {
    return __bfloat162float(p[i]);
}

/* Four consecutive values as fp32: one 16-byte load of fp32, one 8-byte
 * load of bf16 (p 16- or 8-byte aligned). */
__device__ __forceinline__ float4 cu_ld4(const float *p) {
    return __ldg((const float4 *)p);
}
__device__ __forceinline__ float4 cu_ld4(const __nv_bfloat16 *p) {
    const uint2 v = __ldg((const uint2 *)p);
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xffff0000u));
}

/* Programmatic dependent launch (sm_90; CUDA programming guide, "Programmatic
 * Dependent Launch and Synchronization"): every kernel of a step lets the
 * next grid start as soon as all its own blocks are running
 * (cu_pdl_launch_dependents, a no-op when the next launch did not ask for
 * it); a kernel launched with the attribute (cu_launch_pdl) may do work that
 * depends on nothing earlier — prefetch its weights into L2 — and must call
 * cu_pdl_wait before it reads anything an earlier kernel wrote or writes
 * anything (it returns once the earlier grids have finished and their
 * writes are visible; immediately when launched without the attribute).
 * One exception, argued where it is made: k_mla_decode_tc's empty splits
 * (mla.cu) write their partials and leave before the wait, because the
 * partials' last reader ended before the kernel ahead of them let them
 * start. That argument needs every kernel launched with the attribute to
 * wait in at least one block before it ends, and to let the next grid
 * start only after its own wait. */
__device__ __forceinline__ void cu_pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void cu_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
/* Prefetch [p, p + bytes) into L2 (TMA bulk prefetch; p and bytes multiples of 16). */
__device__ __forceinline__ void cu_prefetch_l2(const void *p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

/* Hopper bulk copies (TMA without a tensor map; PTX ISA 8.0, "Data
 * Movement and Conversion Instructions: cp.async.bulk" and "Parallel
 * Synchronization and Communication Instructions: mbarrier"): one thread's
 * instruction moves a whole run of bytes from global into shared memory,
 * and an mbarrier in shared memory (8 bytes, 8-aligned) counts the bytes
 * that have landed (its tx-count).
 *   cu_smem_u32: the shared-window address the instructions take;
 *   cu_mbar_init: a barrier that expects one arrival a phase;
 *   cu_mbar_init_fence: makes the init visible to the async proxy and, once
 *     the threads that use the barrier have synchronised with the one that
 *     ran it (__syncwarp / __syncthreads), to them;
 *   cu_bulk_expect: the phase's one arrival, announcing its bytes (it may
 *     come before or after copies counted on the same phase: the phase
 *     completes once it has come and every announced byte has landed);
 *   cu_bulk_g2s: bytes (a multiple of 16; src and dst 16-aligned) from src
 *     into dst, counted on m;
 *   cu_mbar_wait: returns once the phase of the given parity (0 for a
 *     barrier's first phase, 1 for its second, ...) has completed; the
 *     copied bytes are then visible to the waiting thread;
 *   cu_fence_proxy_async: orders this thread's (and, through the barriers
 *     before it, other threads') generic accesses to shared memory before
 *     its later async-proxy ones ("Memory Consistency Model: Proxies"): a
 *     bulk copy into a buffer that ordinary loads or stores used. */
__device__ __forceinline__ unsigned cu_smem_u32(const void *p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cu_mbar_init(unsigned long long *m) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(cu_smem_u32(m)) : "memory");
#endif
}
__device__ __forceinline__ void cu_mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void cu_bulk_expect(unsigned long long *m, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(cu_smem_u32(m)), "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void cu_bulk_g2s(void *dst, const void *src, unsigned bytes, unsigned long long *m) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     cu_smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(cu_smem_u32(m))
                 : "memory");
#endif
}
__device__ __forceinline__ void cu_mbar_wait(unsigned long long *m, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned done;
    do {
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(cu_smem_u32(m)), "r"(parity)
                     : "memory");
    } while (!done);
#endif
}
__device__ __forceinline__ void cu_fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

/* A thread block cluster's barrier in two halves (PTX ISA, "barrier.cluster";
 * sm_90): every thread of every block of the cluster calls both, in order.
 * cu_cluster_arrive releases this thread's earlier writes (its block's
 * shared memory included) at cluster scope; cu_cluster_wait returns once
 * every thread of the cluster has arrived, and acquires what they released.
 * A block whose shared memory others read through the cluster (DSMEM) must
 * not exit before they are done: each reader arrives after its last read
 * and every block waits before it ends. Both together: cg's cluster.sync(). */
__device__ __forceinline__ void cu_cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cu_cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

/* 1 / sqrt(mean(x[0, n)²) + eps) in every thread of a block of THREADS:
 * the sum of squares in double, as the CPU backend keeps it (norm.cu,
 * fused.cu). part: THREADS / 32 doubles of shared memory. Ends after a
 * barrier, so x may be rewritten afterwards. cu_block_inv_rms_of: the same
 * from each thread's own sum of squares. */
template <int THREADS> __device__ __forceinline__ float cu_block_inv_rms_of(double ss, int n, float eps, double *part) {
    /* ss: this thread's sum of squares (its share of the n values) */
    for (int o = 16; o > 0; o >>= 1)
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = ss;
    __syncthreads();
    double t = 0.0;
    for (int i = 0; i < THREADS / 32; i++)
        t += part[i];
    return (float)(1.0 / sqrt(t / n + (double)eps));
}
template <int THREADS> __device__ __forceinline__ float cu_block_inv_rms(const float *x, int n, float eps, double *part) {
    double ss = 0.0;
    for (int i = threadIdx.x; i < n; i += THREADS) {
        double v = x[i];
        ss += v * v;
    }
    return cu_block_inv_rms_of<THREADS>(ss, n, eps, part);
}

/* *p read with acquire semantics at GPU scope: what its writer wrote
 * before a release (or a fence and then its write) is visible to this
 * thread's later reads. For counters that blocks of one grid wait on. */
__device__ __forceinline__ unsigned cu_ld_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ float cu_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float cu_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Eight consecutive weights of a row: one 16-byte load of bf16, two of fp32
 * (the skinny GEMMs of gemm.cu and moe.cu's router); dot: their products
 * with a | b, summed in order. */
template <typename W> struct gv_w8;
template <> struct gv_w8<__nv_bfloat16> {
    uint4 v;
    __device__ __forceinline__ void load(const __nv_bfloat16 *row, int k8) {
        v = __ldg((const uint4 *)row + k8);
    }
    __device__ __forceinline__ float dot(float4 a, float4 b) const {
        float s = __uint_as_float(v.x << 16) * a.x;
        s = fmaf(__uint_as_float(v.x & 0xffff0000u), a.y, s);
        s = fmaf(__uint_as_float(v.y << 16), a.z, s);
        s = fmaf(__uint_as_float(v.y & 0xffff0000u), a.w, s);
        s = fmaf(__uint_as_float(v.z << 16), b.x, s);
        s = fmaf(__uint_as_float(v.z & 0xffff0000u), b.y, s);
        s = fmaf(__uint_as_float(v.w << 16), b.z, s);
        s = fmaf(__uint_as_float(v.w & 0xffff0000u), b.w, s);
        return s;
    }
};
template <> struct gv_w8<float> {
    float4 lo, hi;
    __device__ __forceinline__ void load(const float *row, int k8) {
        lo = __ldg((const float4 *)row + 2 * k8);
        hi = __ldg((const float4 *)row + 2 * k8 + 1);
    }
    __device__ __forceinline__ float dot(float4 a, float4 b) const {
        float s = lo.x * a.x;
        s = fmaf(lo.y, a.y, s);
        s = fmaf(lo.z, a.z, s);
        s = fmaf(lo.w, a.w, s);
        s = fmaf(hi.x, b.x, s);
        s = fmaf(hi.y, b.y, s);
        s = fmaf(hi.z, b.z, s);
        s = fmaf(hi.w, b.w, s);
        return s;
    }
};

static inline unsigned cu_blocks(size_t n, unsigned threads, unsigned cap) {
    size_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    return (unsigned)(b < cap ? b : cap);
}

/* moe_block (moe.cu) and the release of its tables at destroy. */
bool cu_moe_block(pd_backend *be, const pd_moe_block_args *a);
void cu_moe_sets_free(cu_ctx *c);
#ifdef PD_CUDA_PROBE
/* The diagnostic probes' file (moe.cu, mla.cu; PD_CUDA_PROBE builds only):
 * the timestamps t[k][b][0 .. n_slots) of n_k kernels by n_b blocks,
 * written to the file the environment variable env names, one line
 * "kernel,block,t0,..." per block that recorded a start, after the comment
 * line note (or none). Prints the failure to stderr. */
void cu_probe_write(const char *env, const char *note, const unsigned long long *t, int n_k, int n_b, int n_slots);
void cu_mla_probe_dump(void); /* mla.cu's (PD_MLA_PROBE) */
#endif
#ifdef PD_CUDA_PROBE
void cu_mla_probe_dump(void); /* mla.cu's diagnostic (PD_MLA_PROBE) */
#endif

/* A launch configuration of grid × block threads with smem bytes of dynamic
 * shared memory on stream s, with programmatic dependent launch when pdl
 * (the kernel then calls cu_pdl_wait before reading what earlier kernels
 * wrote); at: storage for the one attribute, alive until the launch. */
static inline cudaLaunchConfig_t cu_launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t s, bool pdl,
                                                  cudaLaunchAttribute *at) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    if (pdl) {
        at->id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at->val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
    }
    return cfg;
}

/* The device table of data pointers of w[0..n), NULL (error recorded) on failure. */
const void *const *cu_wtable_get(cu_ctx *c, const pd_weight *w, int n);

/* Sets a kernel's dynamic shared memory limit once per device: a function's
 * attributes belong to a device's context, and tensor parallelism runs one
 * thread a device in one process (model/tp.c), so one flag for all devices
 * left every device but the first without the limit. cudaFuncSetAttribute
 * is not queued on the stream, so it is done before any recording. A
 * device past CU_SMEM_MAX_DEVICES sets it on every call. */
#define CU_SMEM_MAX_DEVICES 64
#define CU_SMEM_OPTIN(func, bytes)                                                                                \
    ([&]() -> cudaError_t {                                                                                     \
        static int done_[CU_SMEM_MAX_DEVICES]; /* each slot written by its device's thread only */              \
        if ((bytes) <= 48 * 1024)                                                                               \
            return cudaSuccess;                                                                                 \
        int dev_ = -1;                                                                                          \
        const bool slot_ = cudaGetDevice(&dev_) == cudaSuccess && dev_ >= 0 && dev_ < CU_SMEM_MAX_DEVICES;      \
        if (slot_ && done_[dev_] >= (int)(bytes))                                                               \
            return cudaSuccess;                                                                                 \
        cudaError_t e_ = cudaFuncSetAttribute((func), cudaFuncAttributeMaxDynamicSharedMemorySize, (int)(bytes)); \
        if (e_ == cudaSuccess && slot_)                                                                         \
            done_[dev_] = (int)(bytes);                                                                         \
        return e_;                                                                                              \
    }())

/* Batched decode attention: a split takes at least this many tokens (mla.cu). */
#define CU_MLA_MIN_CHUNK 32
/* Expanded MLA on tensor cores: bytes of scores + probabilities one query
 * chunk may take (mla.cu); the chunk's query count follows from it. */
#define CU_MLA_PREFILL_SCRATCH ((size_t)1 << 30)

/* ---- shared launchers and internal entry points ---- */
/* Grouped skinny GEMM (gemm.cu; see there); weights of the backend's format.
 * n_groups is grid.y: with glist, glist[0 .. n_groups-1] names the group each
 * y-block works on (-1: none), so a launch sized for the groups that can
 * have rows skips the rest; without it, block y is group y. */
cudaError_t cu_gemv_launch(pd_cuda_weights fmt, bool swiglu, int n_groups, int N, int K, const void *w0,
                           const void *const *w, const int *off, const int *glist, int M, const int *xrow, const int *yrow,
                           const float *x, int ldx, float *y, int ldy, bool accumulate, bool pdl, cudaStream_t s);
/* The same with a row stride gldw[g] and an up-row offset gupo[g] (SwiGLU)
 * per group (NULL: K and N): a group may be a slice of a larger matrix.
 * max_pairs: the most pairs any group can have when off is given (1 takes
 * the kernel made for one pair; 0: unknown); without off, M. */
cudaError_t cu_gemv_grouped_launch(pd_cuda_weights fmt, bool swiglu, int n_groups, int N, int K, const void *w0,
                                   const void *const *w, const int *off, const int *glist, const int *gldw,
                                   const int *gupo, int M, int max_pairs, const int *xrow, const int *yrow,
                                   const float *x, int ldx, float *y, int ldy, bool accumulate, bool pdl,
                                   cudaStream_t s);
bool cu_gemv_ok(int K, const void *w, const float *x, int ldx);
/* y[M×N] (+)= x[M×K] · W^T on c's stream; false (error recorded) on failure. */
bool cu_gemm_run(cu_ctx *c, int M, const float *x, const pd_weight *w, float *y, bool accumulate);
/* y[M×N] (+)= xb[M×K] · W^T with xb already bf16 (row stride K) and W
 * bf16 [N×K]: the cuBLASLt path of cu_gemm_run without the rounding of x. */
bool cu_gemm_bf16_run(cu_ctx *c, int M, int N, int K, const __nv_bfloat16 *xb, const __nv_bfloat16 *w, float *y,
                      bool accumulate);
/* cu_gemm_bf16_run writing y [M×N] in bf16 (each value rounded once from
 * the fp32 accumulation); false (error recorded) on failure. */
bool cu_gemm_bf16_run_y16(cu_ctx *c, int M, int N, int K, const __nv_bfloat16 *xb, const __nv_bfloat16 *w,
                          __nv_bfloat16 *y);
/* Forgets the bf16 copy of the last GEMM input (cu_ctx.x16): called at the
 * entry of every table operation other than gemm and gemm_swiglu
 * (backend_cuda.cu) and by graph_begin / graph_end / graph_launch. */
void cu_x16_forget(cu_ctx *c);
cudaError_t cu_f32_to_bf16_launch(const float *x, __nv_bfloat16 *y, size_t n, cudaStream_t s);
/* Fused causal attention of prefill (mla_flash.cu): qb [n_q, nh, qd], kb
 * [start_pos + n_q, nh, qd], vb [.., nh, dv] bf16 → out [n_q, nh, dv] fp32
 * on c's stream; cu_mla_flash_ok says which dims it has (false: use the
 * cuBLAS path); false (error recorded) on failure. */
bool cu_mla_flash_ok(int qd, int dv);
bool cu_mla_flash_run(cu_ctx *c, int nh, int qd, int dv, int n_q, int start_pos, float scale,
                      const __nv_bfloat16 *qb, const __nv_bfloat16 *kb, const __nv_bfloat16 *vb, float *out);
cudaError_t cu_silu_mul_launch(int rows, int inter, const float *gu, float *out, cudaStream_t s);
/* SwiGLU (elementwise.cu) writing out [rows × inter] in fp32 and also
 * rounded to bf16 into out16 (the down projection's input). */
cudaError_t cu_silu_mul_x16_launch(int rows, int inter, const float *gu, float *out, __nv_bfloat16 *out16,
                                   cudaStream_t s);
void cu_gemm_plans_free(cu_ctx *c);

/* ---- the table's entries, one family per file ---- */
/* c->dev_bytes bookkeeping (memory.cu): every cudaMalloc/cudaFree of the backend goes through these. */
void cu_count_alloc(cu_ctx *c, size_t bytes);
void cu_count_free(cu_ctx *c, size_t bytes);
size_t cu_device_bytes(pd_backend *be);
void *cu_alloc(pd_backend *be, size_t bytes);
void cu_free(pd_backend *be, void *p);
void cu_upload(pd_backend *be, void *dst, const void *src_host, size_t bytes);
void cu_download(pd_backend *be, void *dst_host, const void *src, size_t bytes);
/* upload_async / upload_wait (pd_kernels.h): the copy, then c->upload_ev recorded after it */
void cu_upload_async(pd_backend *be, void *dst, const void *src_host, size_t bytes);
void cu_upload_wait(pd_backend *be);
void cu_copy(pd_backend *be, void *dst, const void *src, size_t bytes);
pd_status cu_weight_from_f32(pd_backend *be, const float *host, int rows, int cols, pd_weight *w_p);
void cu_weight_free(pd_backend *be, pd_weight *w);
void cu_gemm(pd_backend *be, int M, const float *x, const pd_weight *w, float *y, bool accumulate);
void cu_rmsnorm(pd_backend *be, int rows, int dim, const float *x, int x_stride, const float *w, float eps, float *y,
                int y_stride);
void cu_rope(pd_backend *be, int rows, int n_heads, float *x, int row_stride, int head_stride, int rope_dim,
             const int *pos, const float *inv_freq, float mscale);
void cu_silu_mul(pd_backend *be, int rows, int inter, const float *gu, float *out);
void cu_add(pd_backend *be, size_t n, float *x, const float *y);
void cu_embed(pd_backend *be, int rows, int dim, const int32_t *ids, const pd_weight *table, float *out);
void cu_mla_attention(pd_backend *be, const pd_mla_args *a);
void cu_moe_route(pd_backend *be, int rows, const float *logits, const pd_moe_route_params *p, int32_t *ids,
                  float *weights);
void cu_moe_experts(pd_backend *be, int rows, int hidden, int inter, const float *x, const int32_t *ids,
                    const float *weights, int top_k, const pd_weight *gate_up, const pd_weight *down, float *out);
void cu_embed_ids(pd_backend *be, int rows, int dim, const int32_t *ids, const pd_weight *table, float *out);
void cu_rope_pos(pd_backend *be, int rows, int n_heads, float *x, int row_stride, int head_stride, int rope_dim,
                 const int32_t *pos, const float *inv_freq, float mscale);
void cu_kv_store(pd_backend *be, int rows, int dim, const float *src, int src_stride, float *cache,
                 const int32_t *slots, size_t slot_offset);
void cu_mla_decode(pd_backend *be, const pd_mla_decode_args *a);
void cu_moe_route_ids(pd_backend *be, int rows, const float *logits, const pd_moe_route_params *p, int32_t *ids,
                      float *weights);
void cu_moe_experts_ids(pd_backend *be, int rows, int hidden, int inter, const float *x, const int32_t *ids,
                        const float *weights, int top_k, int n_experts, const pd_weight *gate_up,
                        const pd_weight *down, float *out);
void cu_moe_ids_local(pd_backend *be, size_t n, int32_t *ids, int first, int count);
void *cu_host_alloc(pd_backend *be, size_t bytes);
void cu_host_free(pd_backend *be, void *p);
pd_status cu_host_register(pd_backend *be, void *p, size_t bytes);
void cu_host_unregister(pd_backend *be, void *p);
pd_status cu_weight_alloc(pd_backend *be, int rows, int cols, pd_weight *w_p);
pd_status cu_weight_set_bf16(pd_backend *be, pd_weight *w, int row0, int n_rows, const uint16_t *src);
void cu_all_reduce_sum(pd_backend *be, float *x, size_t n);
void cu_gemm_swiglu(pd_backend *be, int M, const float *x, const pd_weight *w, float *gu, float *act);
void cu_mla_prep(pd_backend *be, const pd_mla_prep_args *a);
void cu_add_rmsnorm(pd_backend *be, int rows, int dim, float *x, const float *y, const float *w, float eps, float *h);
void cu_rmsnorm_gemm_pair(pd_backend *be, int rows, int dim, const float *x, const float *norm, float eps, float *h,
                          const pd_weight *w1, float *y1, const pd_weight *w2, float *y2);
void cu_sample_rows(pd_backend *be, int n, int vocab, float *logits, const pd_sample_row *rows,
                    const pd_sample_tok *toks, int n_toks, pd_sample_out *out);
void cu_thread_bind(pd_backend *be);
/* Destroys c's NCCL communicator, if any (comm.cu). */
void cu_comm_free(cu_ctx *c);

#endif

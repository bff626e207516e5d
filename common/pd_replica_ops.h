/* What every replica (prefill and decode) does about operations around its
 * start, in one place rather than in both services: it finds the GPUs it
 * will use, places the process on their NUMA node (pd_numa.h), opens GPU
 * telemetry (NVML) for them, and renders the operations families into its
 * /metrics at scrape time.
 *
 * Order in a replica's start (the replica session, common/replica.c):
 *   pd_replica_ops_init      before the backend (nothing allocated yet)
 *   ... backend, weights, KV cache ...
 *   pd_replica_ops_attach    once the metrics server runs
 *   pd_replica_ops_free      at exit, after the metrics server stopped */
#ifndef PD_REPLICA_OPS_H
#define PD_REPLICA_OPS_H

#include <stdbool.h>

#include "pd_common.h"
#include "pd_kernels.h"
#include "pd_metrics_server.h"
#include "pd_model.h"

typedef struct pd_replica_ops pd_replica_ops;

typedef struct {
    const char *role;       /* "prefill" or "decode": log module and metric label */
    const char *replica_id; /* borrowed; outlives the object */
    const char *device;     /* "cpu" or "cuda" (--device) */
    int tp;                 /* --tensor-parallel-size: the replica uses CUDA devices 0 .. tp-1 */
    const char *numa;       /* --numa: "auto" (NULL too), "off" or a node number */
} pd_replica_ops_config;

/** Finds the replica's GPUs (device "cuda": CUDA devices 0 .. tp-1, their
 * PCI bus ids), places the process (pd_numa_place: before any thread or
 * host buffer of the backend exists) and opens NVML for the GPUs
 * (pd_nvml.h). Logs one line on the placement (node, CPUs, why) and one on
 * telemetry. Telemetry that cannot be had is not an error: the log line
 * says why (CPU backend, no NVML, ...) and the pdserve:gpu_* families are
 * absent. Errors (nothing allocated): PD_ERR_INVALID (a --numa value that
 * does not parse, or a node this machine does not have: a usage error),
 * PD_ERR_UNSUPPORTED, PD_ERR_IO (from pd_numa_place). */
pd_status pd_replica_ops_init(const pd_replica_ops_config *cfg, pd_replica_ops **o_p, pd_err *err);

/** Where `pdserve up` runs its replicas on a GPU host. Given the GPUs it
 * may use (visible: CUDA device ordinals, or the entries of
 * CUDA_VISIBLE_DEVICES, n_visible of them) and n_replicas replicas of tp
 * GPUs each (prefill replicas first, then decode, as up starts them):
 * when n_visible >= n_replicas × tp, replica r gets its own GPUs
 * visible[r·tp .. r·tp + tp − 1] (returns true; first[r] = r·tp); else
 * every replica shares visible[0 .. tp − 1] (returns false; first[r] = 0)
 * and each must then be given its share of memory
 * (--gpu-memory-utilization). tp > n_visible: false as well (the replicas'
 * own start says there are too few GPUs). first has n_replicas entries. */
bool pd_gpu_placement_plan(int n_visible, int n_replicas, int tp, int *first);

/** Bytes kept out of the KV cache for the decode/prefill step's workspace
 * (scratch buffers, CUDA graphs, cuBLAS) when --gpu-memory-utilization
 * sizes the cache. */
#define PD_KV_PLAN_RESERVE_BYTES ((size_t)2 << 30)

/** --gpu-memory-utilization: sizes the KV cache of a CUDA replica after its
 * weights are loaded. On every GPU g of the replica (0 .. tp-1) it reads the
 * free memory (cudaMemGetInfo) and what rank g's backend holds (bes[g],
 * n_bes of them: device_bytes), and plans with pd_kv_plan_blocks (reserve
 * PD_KV_PLAN_RESERVE_BYTES, block_bytes a block, at most max_blocks), so
 * that memory other processes hold (another replica on the same GPU) does
 * not count against this replica's fraction; every rank holds the whole
 * latent cache, so the smallest plan wins. Logs the plan: device memory,
 * this replica's and the others' memory, the free memory, the budget, the
 * workspace reserve, the cache in bytes, blocks and tokens (× block_size). Writes
 * *num_blocks. Errors: PD_ERR_UNSUPPORTED (not a CUDA replica: the flag
 * sizes device memory only — a usage error), PD_ERR_NOMEM (no room for one
 * block on some GPU; err says how the memory is taken), PD_ERR_INVALID,
 * PD_ERR_IO (a CUDA query failed). */
pd_status pd_replica_ops_plan_kv(pd_replica_ops *o, pd_backend *const *bes, int n_bes, double utilization,
                                 size_t block_bytes, int block_size, int max_blocks, int *num_blocks, pd_err *err);

/** KV blocks used when neither --num-kv-blocks nor --gpu-memory-utilization is given. */
#define PD_KV_BLOCKS_DEFAULT 4096

/** Checks --gpu-memory-utilization (0: not given) and --num-kv-blocks
 * (0: not given) as soon as the flags are parsed, before any weight is
 * read: utilization in (0, 1], a count >= 0, and utilization only with
 * device "cuda". Errors: PD_ERR_INVALID, PD_ERR_UNSUPPORTED (utilization on
 * a CPU replica); both usage errors (exit 2). */
pd_status pd_replica_kv_flags_check(const char *device, double utilization, int num_blocks, pd_err *err);

/** A replica's KV cache size from its flags, after the weights are loaded:
 * *num_blocks in: --num-kv-blocks (0: not given); out: the blocks to
 * allocate. utilization 0 (--gpu-memory-utilization not given): the given
 * count, else PD_KV_BLOCKS_DEFAULT. Otherwise pd_replica_ops_plan_kv sizes
 * it, and a --num-kv-blocks given too overrides the plan (as vLLM's
 * --num-gpu-blocks-override; logged). Errors: PD_ERR_INVALID (utilization
 * outside (0, 1], a negative count), those of pd_replica_ops_plan_kv. */
pd_status pd_replica_kv_blocks(pd_replica_ops *o, pd_backend *const *bes, int n_bes, const pd_model_config *cfg,
                               double utilization, int block_size, int *num_blocks, pd_err *err);

/** Start-up self-checks, after the weights and the KV cache are in place
 * and before the replica registers: the all-reduce check on every rank of
 * the group (pd_backend_check_all_reduce: rank r contributes r + 1, every
 * element must come back N(N+1)/2), each GPU's compute capability and
 * device memory (total, free after weights and KV), and the KV pool's
 * capacity (kv_blocks × block_size tokens). Logged, and rendered as
 * pdserve:self_check_ok{check="allreduce"} (1 passed, 0 failed),
 * pdserve:self_check_seconds and pdserve:kv_cache_capacity_tokens.
 * inject_failure: testing (--debug-inject-selfcheck-failure), a wrong
 * all-reduce result. Errors: PD_ERR_IO (a check failed; err says which and
 * how: the replica must not register), PD_ERR_NOMEM. */
pd_status pd_replica_ops_self_check(pd_replica_ops *o, pd_backend *const *bes, int n_ranks, int kv_blocks,
                                    int block_size, bool inject_failure, pd_err *err);

/** Renders the operations families into every scrape of s (its thread
 * calls back into o). NULL s: nothing (no --metrics-port). o must outlive
 * s. */
void pd_replica_ops_attach(pd_replica_ops *o, pd_metrics_server *s);

/** Appends the operations families to b now (what a scrape appends). */
void pd_replica_ops_render(pd_replica_ops *o, pd_strbuf *b);

/** Closes NVML and frees; *o_p = NULL. Call after the metrics server stopped. */
void pd_replica_ops_free(pd_replica_ops **o_p);

#endif

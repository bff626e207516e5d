/* A replica's operations around its start (pd_replica_ops.h). */
#include "pd_replica_ops.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pd_kernels.h"
#include "pd_model.h"
#include "pd_numa.h"
#include "pd_nvml.h"

struct pd_replica_ops {
    char module[16];
    const char *replica_id;
    char labels[256]; /* replica="..",role=".." */
    int n_gpus;
    pd_cuda_device_info gpu[PD_TP_MAX_RANKS];
    pd_nvml *nvml; /* NULL: no telemetry */
    pd_numa_placement numa;
    bool checked;             /* pd_replica_ops_self_check ran */
    bool all_reduce_ok;
    double all_reduce_seconds;
    long long kv_capacity_tokens;
};

pd_status pd_replica_ops_init(const pd_replica_ops_config *cfg, pd_replica_ops **o_p, pd_err *err) {
    pd_numa_mode numa_mode;
    int numa_node;
    pd_status st = pd_numa_parse(cfg->numa ? cfg->numa : "auto", &numa_mode, &numa_node, err);
    if (st != PD_OK)
        return st;
    pd_replica_ops *o = pd_xcalloc(1, sizeof *o);
    snprintf(o->module, sizeof o->module, "%s", cfg->role);
    o->replica_id = cfg->replica_id;
    snprintf(o->labels, sizeof o->labels, "replica=\"%s\",role=\"%s\"", cfg->replica_id, cfg->role);
    const char *id = cfg->replica_id;
    pd_err e = {{0}};
    /* a tp outside 1 .. PD_TP_MAX_RANKS: the backend's start refuses it */
    if (cfg->device && !strcmp(cfg->device, "cuda")) {
        const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
        PD_LOGI(o->module, "%s: CUDA_VISIBLE_DEVICES=%s", id, cvd ? cvd : "(unset: every GPU)");
    }
    if (cfg->device && !strcmp(cfg->device, "cuda") && cfg->tp >= 1 && cfg->tp <= PD_TP_MAX_RANKS) {
        for (int r = 0; r < cfg->tp; r++) {
            if (pd_backend_cuda_device_info(r, false, &o->gpu[r], &e) != PD_OK) {
                /* the backend's own start says so and fails: nothing to watch */
                PD_LOGW(o->module, "%s: GPU %d: %s", id, r, e.msg);
                o->n_gpus = 0;
                break;
            }
            o->n_gpus = r + 1;
        }
    }
    /* NUMA first: the backend's threads and host buffers come after */
    int gpu_nodes[PD_TP_MAX_RANKS];
    for (int r = 0; r < o->n_gpus; r++)
        if (pd_numa_node_of_pci(NULL, o->gpu[r].pci_bus_id, &gpu_nodes[r], &e) != PD_OK) {
            PD_LOGW(o->module, "%s: GPU %d's NUMA node: %s", id, r, e.msg);
            gpu_nodes[r] = -1;
        }
    if ((st = pd_numa_place(numa_mode, numa_node, gpu_nodes, o->n_gpus, &o->numa, err)) != PD_OK) {
        free(o);
        return st;
    }
    if (o->numa.node >= 0)
        PD_LOGI(o->module, "%s: NUMA: bound to node %d, CPUs %s, memory preferred there (%s)", id, o->numa.node,
                o->numa.cpus, o->numa.why);
    else
        PD_LOGI(o->module, "%s: NUMA: not bound: %s", id, o->numa.why);
    if (o->n_gpus == 0) {
        PD_LOGI(o->module, "%s: GPU telemetry off: %s", id,
                cfg->device && !strcmp(cfg->device, "cuda") ? "no CUDA device found" : "CPU backend, no GPU");
    } else {
        const char *bus[PD_TP_MAX_RANKS];
        for (int r = 0; r < o->n_gpus; r++)
            bus[r] = o->gpu[r].pci_bus_id;
        if (pd_nvml_open(bus, o->n_gpus, &o->nvml, &e) != PD_OK)
            PD_LOGW(o->module, "%s: GPU telemetry off (no pdserve:gpu_* metrics): %s", id, e.msg);
        else
            PD_LOGI(o->module, "%s: GPU telemetry: NVML, driver %s, %d GPUs (%s at %s%s)", id,
                    pd_nvml_driver_version(o->nvml), o->n_gpus, pd_nvml_name(o->nvml, 0), bus[0],
                    o->n_gpus > 1 ? ", ..." : "");
    }
    *o_p = o;
    return PD_OK;
}

void pd_replica_ops_render(pd_replica_ops *o, pd_strbuf *b) {
    if (!o)
        return;
    pd_strbuf_printf(b,
                     "# HELP pdserve:numa_node The NUMA node the replica is bound to (--numa); -1: not bound.\n"
                     "# TYPE pdserve:numa_node gauge\npdserve:numa_node{%s} %d\n",
                     o->labels, o->numa.node);
    if (o->checked)
        pd_strbuf_printf(b,
                         "# HELP pdserve:self_check_ok Start-up self-check passed (1) or failed (0).\n"
                         "# TYPE pdserve:self_check_ok gauge\npdserve:self_check_ok{%s,check=\"allreduce\"} %d\n"
                         "# HELP pdserve:self_check_seconds Time the start-up self-check took.\n"
                         "# TYPE pdserve:self_check_seconds gauge\npdserve:self_check_seconds{%s,check=\"allreduce\"} %.6f\n"
                         "# HELP pdserve:kv_cache_capacity_tokens Tokens the KV cache holds (blocks x block size).\n"
                         "# TYPE pdserve:kv_cache_capacity_tokens gauge\npdserve:kv_cache_capacity_tokens{%s} %lld\n",
                         o->labels, o->all_reduce_ok ? 1 : 0, o->labels, o->all_reduce_seconds, o->labels,
                         o->kv_capacity_tokens);
    pd_nvml_render(o->nvml, o->labels, b);
}

pd_status pd_replica_ops_plan_kv(pd_replica_ops *o, pd_backend *const *bes, int n_bes, double utilization,
                                 size_t block_bytes, int block_size, int max_blocks, int *num_blocks, pd_err *err) {
    if (o->n_gpus == 0)
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "--gpu-memory-utilization sizes the KV cache in GPU memory: this replica has no GPU "
                          "(--device cpu); size its cache with --num-kv-blocks");
    pd_kv_plan best = {0};
    int best_gpu = -1;
    for (int g = 0; g < o->n_gpus; g++) {
        pd_cuda_device_info info;
        pd_status st = pd_backend_cuda_device_info(g, true, &info, err);
        if (st != PD_OK)
            return st;
        /* what this replica holds on GPU g: rank g's backend's count (the
         * driver's context and libraries' internals are not in it; the
         * workspace reserve covers them), at most what is in use */
        size_t own = g < n_bes && bes && bes[g] && bes[g]->ops->device_bytes ? bes[g]->ops->device_bytes(bes[g]) : 0;
        if (own > info.mem_total - info.mem_free)
            own = info.mem_total - info.mem_free;
        pd_kv_plan p;
        if ((st = pd_kv_plan_blocks(info.mem_total, info.mem_free, own, utilization, PD_KV_PLAN_RESERVE_BYTES,
                                    block_bytes, max_blocks, &p, err)) != PD_OK) {
            char why[sizeof err->msg];
            snprintf(why, sizeof why, "%s", err->msg);
            return pd_err_set(err, st, "GPU %d: %s", g, why);
        }
        if (best_gpu < 0 || p.num_blocks < best.num_blocks) {
            best = p;
            best_gpu = g;
        }
    }
    const double gib = 1073741824.0;
    PD_LOGI(o->module,
            "%s: memory plan (--gpu-memory-utilization %.2f, GPU %d of %d the tightest): %.2f GiB device, %.2f GiB held "
            "by this replica before the KV cache (weights, buffers), %.2f GiB by others (CUDA contexts, other "
            "processes), %.2f GiB free; budget %.2f GiB, workspace reserve %.2f GiB, KV cache %.2f GiB = %d blocks × "
            "%d tokens = %lld tokens%s",
            o->replica_id, utilization, best_gpu, o->n_gpus, best.mem_total / gib, best.mem_in_use / gib,
            best.mem_others / gib, best.mem_free / gib, best.budget / gib, best.reserve / gib, best.kv_bytes / gib,
            best.num_blocks, block_size, (long long)best.num_blocks * block_size,
            best.by_free ? " (limited by the free memory, not the budget)" : "");
    *num_blocks = best.num_blocks;
    return PD_OK;
}

bool pd_gpu_placement_plan(int n_visible, int n_replicas, int tp, int *first) {
    const bool own = tp >= 1 && n_replicas >= 1 && (long long)n_replicas * tp <= n_visible;
    for (int r = 0; r < n_replicas; r++)
        first[r] = own ? r * tp : 0;
    return own;
}

pd_status pd_replica_kv_flags_check(const char *device, double utilization, int num_blocks, pd_err *err) {
    if (num_blocks < 0)
        return pd_err_set(err, PD_ERR_INVALID, "--num-kv-blocks %d must be positive", num_blocks);
    if (utilization == 0.0)
        return PD_OK;
    if (!(utilization > 0.0 && utilization <= 1.0))
        return pd_err_set(err, PD_ERR_INVALID, "--gpu-memory-utilization %g must be in (0, 1]", utilization);
    if (!device || strcmp(device, "cuda") != 0)
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "--gpu-memory-utilization sizes the KV cache in GPU memory: this replica runs on the CPU "
                          "(--device %s); size its cache with --num-kv-blocks",
                          device ? device : "cpu");
    return PD_OK;
}

pd_status pd_replica_kv_blocks(pd_replica_ops *o, pd_backend *const *bes, int n_bes, const pd_model_config *cfg,
                               double utilization, int block_size, int *num_blocks, pd_err *err) {
    if (*num_blocks < 0)
        return pd_err_set(err, PD_ERR_INVALID, "--num-kv-blocks %d must be positive", *num_blocks);
    if (utilization == 0.0) {
        if (*num_blocks == 0)
            *num_blocks = PD_KV_BLOCKS_DEFAULT;
        return PD_OK;
    }
    if (!(utilization > 0.0 && utilization <= 1.0))
        return pd_err_set(err, PD_ERR_INVALID, "--gpu-memory-utilization %g must be in (0, 1]", utilization);
    if (block_size <= 0 || cfg->num_hidden_layers <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "KV plan: block size %d, %d layers", block_size, cfg->num_hidden_layers);
    /* the cache's own limit: token rows are int32 (pd_kv_cache_init) */
    const long long max_blocks = INT32_MAX / ((long long)cfg->num_hidden_layers * block_size);
    int planned = 0;
    pd_status st = pd_replica_ops_plan_kv(o, bes, n_bes, utilization, pd_kv_cache_bytes_per_block(cfg, block_size),
                                          block_size, (int)(max_blocks > INT32_MAX ? INT32_MAX : max_blocks), &planned,
                                          err);
    if (st != PD_OK)
        return st;
    if (*num_blocks > 0) {
        PD_LOGI(o->module, "%s: --num-kv-blocks %d overrides the plan's %d blocks", o->replica_id, *num_blocks, planned);
        return PD_OK;
    }
    *num_blocks = planned;
    return PD_OK;
}

pd_status pd_replica_ops_self_check(pd_replica_ops *o, pd_backend *const *bes, int n_ranks, int kv_blocks,
                                    int block_size, bool inject_failure, pd_err *err) {
    const char *id = o->replica_id;
    pd_all_reduce_check r;
    /* 1 Mi floats (4 MiB) per rank: large enough that NCCL takes its
     * bandwidth path (ring / NVLS) rather than only the small-message one */
    pd_status st = pd_backend_check_all_reduce(bes, n_ranks, (size_t)1 << 20, inject_failure, &r, err);
    if (st == PD_ERR_NOMEM)
        return st;
    o->checked = true;
    o->all_reduce_ok = st == PD_OK;
    o->all_reduce_seconds = r.seconds;
    if (st != PD_OK) {
        PD_LOGE(o->module, "%s: self-check allreduce FAILED over %d rank%s: %s%s", id, n_ranks, n_ranks > 1 ? "s" : "",
                err->msg, inject_failure ? " (injected: --debug-inject-selfcheck-failure)" : "");
        return st;
    }
    PD_LOGI(o->module, "%s: self-check allreduce ok: %d rank%s × %zu floats, every element %g, %.3f s", id, n_ranks,
            n_ranks > 1 ? "s" : "", r.n, (double)r.expected, r.seconds);
    for (int g = 0; g < o->n_gpus; g++) {
        pd_cuda_device_info info;
        pd_err e = {{0}};
        if (pd_backend_cuda_device_info(g, true, &info, &e) != PD_OK) {
            PD_LOGW(o->module, "%s: self-check GPU %d: %s", id, g, e.msg);
            continue;
        }
        PD_LOGI(o->module,
                "%s: self-check GPU %d: %s at %s, compute capability %d.%d, %d SMs, %.1f GiB, %.1f GiB free after "
                "weights and KV",
                id, g, info.name, info.pci_bus_id, info.cc_major, info.cc_minor, info.n_sm,
                info.mem_total / 1073741824.0, info.mem_free / 1073741824.0);
    }
    o->kv_capacity_tokens = (long long)kv_blocks * block_size;
    PD_LOGI(o->module, "%s: self-check KV pool: %d blocks × %d tokens = %lld tokens", id, kv_blocks, block_size,
            o->kv_capacity_tokens);
    return PD_OK;
}

static void on_scrape(void *user, pd_strbuf *b) { pd_replica_ops_render(user, b); }

void pd_replica_ops_attach(pd_replica_ops *o, pd_metrics_server *s) {
    if (o && s)
        pd_metrics_server_set_scrape(s, on_scrape, o);
}

void pd_replica_ops_free(pd_replica_ops **o_p) {
    if (!o_p || !*o_p)
        return;
    pd_nvml_close(&(*o_p)->nvml);
    free(*o_p);
    *o_p = NULL;
}

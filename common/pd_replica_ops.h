/* What every replica (prefill and decode) does about operations around its
 * start, in one place rather than in both services: it finds the GPUs it
 * will use, opens GPU telemetry (NVML) for them, and renders the
 * operations families into its /metrics at scrape time.
 *
 * Order in a replica's start (prefill/service.c, decode/service.c):
 *   pd_replica_ops_init      before the backend (nothing allocated yet)
 *   ... backend, weights, KV cache ...
 *   pd_replica_ops_attach    once the metrics server runs
 *   pd_replica_ops_free      at exit, after the metrics server stopped */
#ifndef PD_REPLICA_OPS_H
#define PD_REPLICA_OPS_H

#include "pd_common.h"
#include "pd_metrics_server.h"

typedef struct pd_replica_ops pd_replica_ops;

typedef struct {
    const char *role;       /* "prefill" or "decode": log module and metric label */
    const char *replica_id; /* borrowed; outlives the object */
    const char *device;     /* "cpu" or "cuda" (--device) */
    int tp;                 /* --tensor-parallel-size: the replica uses CUDA devices 0 .. tp-1 */
} pd_replica_ops_config;

/** Finds the replica's GPUs (device "cuda": CUDA devices 0 .. tp-1, their
 * PCI bus ids) and opens NVML for them (pd_nvml.h). Telemetry that cannot
 * be had is not an error: one log line says why (CPU backend, no NVML,
 * ...) and the pdserve:gpu_* families are absent. Logs the GPUs found.
 * Errors: none yet (PD_OK; *o_p always set). */
pd_status pd_replica_ops_init(const pd_replica_ops_config *cfg, pd_replica_ops **o_p, pd_err *err);

/** Renders the operations families into every scrape of s (its thread
 * calls back into o). NULL s: nothing (no --metrics-port). o must outlive
 * s. */
void pd_replica_ops_attach(pd_replica_ops *o, pd_metrics_server *s);

/** Appends the operations families to b now (what a scrape appends). */
void pd_replica_ops_render(pd_replica_ops *o, pd_strbuf *b);

/** Closes NVML and frees; *o_p = NULL. Call after the metrics server stopped. */
void pd_replica_ops_free(pd_replica_ops **o_p);

#endif

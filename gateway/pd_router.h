/* The gateway's router: the engine behind pd_gateway.h. It owns the control
 * endpoint (ZeroMQ ROUTER) that replicas register with, tracks their load
 * from heartbeats, takes them out of rotation when heartbeats stop, and
 * routes each request by prompt length (DESIGN.md §1): at or under
 * long_prompt_threshold tokens straight to a decode replica; longer ones to
 * a prefill replica after a decode replica reserved the KV blocks. */
#ifndef PD_ROUTER_H
#define PD_ROUTER_H

#include <stdint.h>

#include "pd_gateway.h"

struct event_base;

typedef struct {
    const char *control_endpoint;  /* e.g. tcp://127.0.0.1:8001 (bound) */
    int long_prompt_threshold;     /* tokens */
    int heartbeat_interval_ms;     /* told to replicas; dead after 3 missed */
    uint64_t model_fingerprint;    /* replicas must match */
    uint64_t weights_fingerprint;  /* pd_checkpoint_fingerprint of --model; 0: none read (the first replica's
                                      is then the reference) */
    int block_size;                /* required KV block size (0: any, but prefill and decode must agree) */
    const char *model_name;        /* the served model name (metrics label) */
    /* admission per length class (index 0 short, 1 long) */
    int max_running[2];            /* --max-concurrent-requests-short/-long */
    int max_queued[2];             /* --max-queued-requests-short/-long; full -> 429 */
    double request_timeout_s;      /* --request-timeout: deadline from arrival; 0 = none */
    double queue_timeout_s;        /* --queue-timeout: longest wait in a class queue from arrival (for a
                                      dispatch slot, a prefill job slot or a decode replica's KV room),
                                      then 503 with Retry-After; 0 = none */
    int max_prefill_jobs_per_replica; /* --max-prefill-jobs-per-replica: long-route jobs one prefill
                                         replica holds (reserving, queued, computing); more wait in
                                         the gateway's long queue; <= 0: 2 */
} pd_router_config;

typedef struct pd_router pd_router;

/** Binds the control endpoint on base's loop. Errors: PD_ERR_IO (bind). */
pd_status pd_router_init(struct event_base *base, const pd_router_config *cfg, pd_router **r_p, pd_err *err);
/** Connects the router to the HTTP server (for readiness and metrics). */
void pd_router_attach(pd_router *r, pd_gw_server *gw);
/** The engine table to give pd_gw_server_init, with the router as context. */
const pd_gw_engine_i *pd_router_engine(void);
/** Aborts everything on every replica, closes the socket, frees. */
void pd_router_free(pd_router **r_p);

/** Counters (monotonic) for tests and /metrics. */
typedef struct {
    uint64_t requests_short, requests_long;
    uint64_t kv_bytes_transferred;
    double kv_transfer_seconds;
    int decode_alive, prefill_alive;
} pd_router_stats;
void pd_router_get_stats(const pd_router *r, pd_router_stats *st);

/** pdserve gateway: the service entry. */
int pd_gateway_main(int argc, char **argv);

#endif

/* A replica session: what a prefill and a decode replica (prefill/service.c,
 * decode/service.c) do alike from their flags to their exit, so that the
 * two services hold only what their role does differently (the decode
 * scheduler, the prefill jobs and their KV puts).
 *
 * The session owns the replica's backends (one per tensor-parallel rank),
 * its model, its operations (pd_replica_ops.h: NUMA placement, GPU
 * telemetry, KV sizing, self-checks), the UCX agent and the registered KV
 * pool, the control connection to the gateway (ZeroMQ DEALER, routing id =
 * replica id), the heartbeat thread (pd_heartbeat.h), the replica's
 * /metrics server and the grammar vocabulary. It borrows the role's KV
 * cache. One session per process (SIGINT/SIGTERM stop it).
 *
 * A replica's life, in call order:
 *   pd_replica_flags_parse   the shared flags and the role's own
 *   pd_replica_init          signals, replica id, tokenizer path
 *   pd_replica_load          verify checkpoint, ops, backends, weights, KV size
 *   ... the role allocates its KV cache (scheduler or cache) ...
 *   pd_replica_kv_pool       the KV staging pool (or a host cache) registered with UCX
 *   pd_replica_connect       control connection, then the self-checks
 *   pd_replica_serve         heartbeat thread, /metrics, then registers
 *   loop: poll (pd_replica_poll), pd_replica_recv_all, the role's step,
 *         pd_replica_tick; pd_replica_heartbeat when tick says so
 *   pd_replica_disconnect    transport down (before the cache is freed)
 *   pd_replica_free          model and backends (after the cache is freed)
 *
 * The start-up calls return 0 or the exit status the service ends with
 * (1: a fault, 2: a usage error); they print the reason to stderr as
 * "pdserve <role>: ..." themselves, and leave what they built in the
 * session for pd_replica_disconnect and pd_replica_free. */
#ifndef PD_REPLICA_H
#define PD_REPLICA_H

#include <stdbool.h>

#include "pd_common.h"
#include "pd_flags.h"
#include "pd_grammar.h"
#include "pd_heartbeat.h"
#include "pd_kernels.h"
#include "pd_kvtransfer.h"
#include "pd_metrics_server.h"
#include "pd_model.h"
#include "pd_msg.h"
#include "pd_replica_ops.h"

/* Flags every replica takes (the role adds its own). Strings are borrowed
 * from argv or are literals. */
typedef struct {
    const char *model;          /* --model: checkpoint directory; required */
    const char *gateway;        /* --gateway: control endpoint */
    const char *replica_id;     /* --replica-id; NULL: pd_replica_init names it <role>-<pid> */
    const char *tokenizer;      /* --tokenizer; NULL: <model>/tokenizer.json */
    const char *device;         /* --device: "cpu" or "cuda" */
    const char *metrics_host;   /* --metrics-host */
    const char *numa;           /* --numa: "auto", "off" or a node */
    const char *ckpt_manifest;  /* --checkpoint-manifest */
    const char *replay_path;    /* --debug-replay-tokens */
    int block_size;             /* --block-size, tokens */
    int num_blocks;             /* --num-kv-blocks; 0: not given */
    int kv_staging_blocks;      /* --kv-staging-blocks; 0: pd_kv_staging_default_slots */
    int threads;                /* --threads; 0: all */
    int tp;                     /* --tensor-parallel-size */
    int heartbeat_ms;           /* --heartbeat-interval-ms */
    int metrics_port;           /* --metrics-port; 0: no /metrics */
    int step_delay_ms;          /* --debug-step-delay-ms */
    double gpu_mem_util;        /* --gpu-memory-utilization; 0: not given */
    double shutdown_timeout;    /* --shutdown-timeout, seconds: the longest drain; 0: a signal stops at once */
    bool verify_ckpt;           /* --verify-checkpoint */
    bool expert_parallel;       /* --enable-expert-parallel */
    bool inject_selfcheck_failure; /* --debug-inject-selfcheck-failure */
    bool force_kv_staging;      /* --debug-force-kv-staging: stage a host cache too (tests) */
} pd_replica_args;

/* Most role flags a service may add to the shared ones. */
#define PD_REPLICA_MAX_ROLE_FLAGS 8

/** Sets args to the defaults (gateway tcp://127.0.0.1:8001, device cpu,
 * metrics host 127.0.0.1, numa auto, block size 16, heartbeat 500 ms, tp 1)
 * and parses argv over the shared replica flags followed by the role's
 * own (own: n_own <= PD_REPLICA_MAX_ROLE_FLAGS entries, their destinations
 * set to the role's defaults by the caller; listed in --help after the
 * shared ones). role: "prefill" or "decode" (the command name in
 * messages, the default replica id's prefix). Then logs the version
 * (pd_version_log) and checks the KV sizing flags (pd_replica_kv_flags_check).
 * Returns -1 to go on, else the exit status: 0 (--help printed), 2 (a bad
 * flag or value; printed to stderr). --model is the caller's to check. */
int pd_replica_flags_parse(const char *role, pd_replica_args *args, const pd_flag *own, int n_own, int argc,
                           char **argv);

typedef struct pd_replica {
    const char *role;       /* "prefill" or "decode": log module, messages, Register.role */
    const char *replica_id; /* args' or rid */
    const pd_replica_args *args; /* borrowed; outlives the session */
    const char *tokenizer_path;
    pd_replica_ops *ops;
    pd_backend *bes[PD_TP_MAX_RANKS]; /* tensor-parallel ranks; bes[1..] NULL with one */
    pd_model *m;
    int num_blocks;   /* KV blocks to allocate (pd_replica_load) */
    pd_kv_cache *kv;  /* borrowed from the role (pd_replica_kv_pool) */
    pd_kv_staging *staging; /* KV moves through it (a device cache, or forced); NULL: the cache is the pool */
    bool staging_in_ucx_pool; /* staging's memory is pool's, allocated by UCX (PD_KV_HOST_POOL=ucx) */
    void *kv_host;    /* what pool registers: staging's memory, or the host cache itself */
    pd_kvx_agent *agent;
    pd_kvx_pool *pool;
    bool advertise_rkey; /* Register carries the pool's rkey (decode: prefill replicas write into it) */
    void *zctx, *sock;   /* DEALER to the gateway */
    pd_hb *hb;
    pd_metrics_server *metrics; /* NULL: no --metrics-port */
    bool registered;
    uint64_t n_registrations; /* accepted RegisterReplies that registered it */
    int heartbeat_ms; /* --heartbeat-interval-ms until the gateway names its own */
    double last_heartbeat, last_register;
    double drain_t0; /* when the drain began (pd_replica_drained); 0: not draining */
    uint64_t weights_fp; /* pd_checkpoint_fingerprint of --model (Register.weights_fingerprint); 0: unknown */
    bool displaced; /* another process registered this replica id since (pd_replica_tick), or the gateway refused
                       it for good (another model or KV geometry): the role exits 1 */
    double t0, t; /* start-up: its start, the last phase's end (pd_startup_phase_log) */
    pd_grammar_vocab *vocab; /* response_format: loaded at the first constrained request */
    bool vocab_tried;
    char rid[64];
    char tokpath[4096];
} pd_replica;

/** Starts a session of role over args (borrowed; outlives r): a first
 * SIGINT or SIGTERM starts the drain (pd_replica_draining; with
 * --shutdown-timeout 0, and a second one, set the stop flag,
 * pd_replica_stopping), SIGPIPE is ignored, an
 * unnamed replica becomes "<role>-<pid>", the tokenizer defaults to
 * <model>/tokenizer.json, and start-up timing begins. Allocates nothing. */
void pd_replica_init(pd_replica *r, const char *role, const pd_replica_args *args);

/** True once a signal or pd_replica_request_stop asked the replica to stop. */
bool pd_replica_stopping(void);

/** True once a first SIGINT/SIGTERM asked the replica to drain (with
 * --shutdown-timeout > 0): it takes no new reservation, its heartbeats say
 * draining (the gateway routes nothing new to it), and it finishes the
 * work it has. A second signal sets the stop flag. */
bool pd_replica_draining(void);

/** While draining: true when the role's loop should end now, that is once
 * `idle` (the role holds no request, reservation or job) and two heartbeat
 * intervals have passed since the drain began (the gateway has heard that
 * it drains, and whatever it sent before has arrived), or once
 * --shutdown-timeout has passed (logged with what is cut). False when not
 * draining. The first call logs the drain and makes the next tick send a
 * heartbeat at once. */
bool pd_replica_drained(pd_replica *r, bool idle);

/** Asks the replica's loop to end (async-signal-safe). */
void pd_replica_request_stop(void);

/** Logs a start-up phase that ran since the last one ("<id>: start-up:
 * <phase> <s> s") and starts the next one. */
void pd_replica_phase(pd_replica *r, const char *phase);

/** Up to a loaded model of a known KV size: --verify-checkpoint /
 * --checkpoint-manifest (refuses to start on a finding), the replica's
 * operations (pd_replica_ops_init: before any backend thread exists), the
 * backends of --tensor-parallel-size ranks, the weights
 * (--enable-expert-parallel), and the KV blocks (pd_replica_kv_blocks
 * from --num-kv-blocks and --gpu-memory-utilization) into r->num_blocks. Logs the phases "verify
 * checkpoint", "init backend", "load weights". Returns 0 or the exit status
 * (2: a bad --numa or KV sizing flag, 1: otherwise). */
int pd_replica_load(pd_replica *r);

/** Makes the memory KV moves between replicas through and registers it
 * with a new UCX agent named after the replica (r->pool, r->kv_host):
 * a host cache (CPU) itself, where writers put into cache blocks; a device
 * cache's staging pool (r->staging, pd_kv_staging_init) of
 * --kv-staging-blocks slots (default pd_kv_staging_default_slots, at most
 * the cache's blocks), also for a host cache with --debug-force-kv-staging.
 * Logs the staging pool's size in slots and bytes. kv is borrowed and must
 * outlive pd_replica_disconnect. advertise_rkey: Register carries the
 * pool's remote key (a decode replica's, which prefill replicas write
 * into). With PD_KV_HOST_POOL=ucx a decode replica's staging pool is
 * allocated by UCX in shared memory instead and page-locked: same-host
 * writers put into it directly (off by default: measured slower). Logs the
 * phase "register KV pool (UCX)". Returns 0 or 1 ("KV transfer: ..."
 * printed). */
int pd_replica_kv_pool(pd_replica *r, pd_kv_cache *kv, bool advertise_rkey);

/** Connects the control socket to --gateway, then runs the start-up
 * self-checks (pd_replica_ops_self_check over every rank and the KV pool
 * of r->num_blocks blocks) and logs the phase "self-checks". Returns 0 or 1
 * (a failed check: the replica must not register). */
int pd_replica_connect(pd_replica *r);

/** Starts serving: the heartbeat thread (logs the phase "total to
 * registration"), the /metrics server (--metrics-port) with the
 * operations families attached, hands free heap back (malloc_trim: the
 * start-up's leftovers), and sends the first Register. The role then sends
 * its first heartbeat. Returns 0 or 1. */
int pd_replica_serve(pd_replica *r);

/** How long the loop may wait for a message (ms): 0 when busy, else until
 * the next heartbeat is due (never negative). */
long pd_replica_wait_ms(const pd_replica *r, bool busy);

/** Polls the control socket and the UCX agent's event fd for up to wait_ms. */
void pd_replica_poll(pd_replica *r, long wait_ms);

/** Called for every message from the gateway but RegisterReply (which the
 * session handles: registered, the gateway's heartbeat interval, a refusal
 * for a wrong fingerprint or geometry stops the replica). The message is
 * cleared after the call: take msg->msg (set it NULL) to keep it. */
typedef void (*pd_replica_handler)(void *user, pd_msg *msg);

/** Receives every message waiting on the control socket and hands each to
 * handle (user passed through). A message that does not decode is logged
 * and dropped. */
void pd_replica_recv_all(pd_replica *r, pd_replica_handler handle, void *user);

/** After a step: registers again when the gateway asked for it (or
 * unregistered, once a second), and returns true when the role's
 * heartbeat is due (a quarter of the interval passed). */
bool pd_replica_tick(pd_replica *r);

/** Appends the role's own families to a /metrics page (from h's load). */
typedef void (*pd_replica_render)(void *user, const Pdserve__Heartbeat *h, pd_strbuf *b);

/** Publishes the replica's load: h (its replica_id set here) to the
 * heartbeat thread, and to /metrics what render appends (only with
 * --metrics-port). Restarts the heartbeat period. */
void pd_replica_heartbeat(pd_replica *r, Pdserve__Heartbeat *h, pd_replica_render render, void *user);

/** Sends a finished Tokens with error msg for request id to the gateway,
 * asking it to answer with http_status (Tokens.error_status: 503 for a
 * transient failure the client may retry, 400 for the request itself, 500
 * or 0 for an internal error). */
void pd_replica_send_error(pd_replica *r, const char *id, int http_status, const char *msg);
/** The HTTP status a replica asks for when a request's admission failed
 * with st: PD_ERR_INVALID and PD_ERR_LIMIT 400 (the request itself, e.g.
 * more tokens than the KV cache can ever hold, as vLLM answers a prompt
 * past the context), PD_ERR_NOMEM 503 (out of memory for now: retrying may
 * succeed), anything else 500. */
int pd_replica_error_status(pd_status st);

/** The grammar vocabulary for response_format, loaded from the tokenizer
 * the first time it is asked for (a fraction of a second, once; logged);
 * NULL when it could not be loaded (logged once: constrained requests are
 * then refused). */
pd_grammar_vocab *pd_replica_vocab(pd_replica *r);

/** A request's sampling parameters (NULL s: the defaults). The logit_bias
 * arrays are borrowed from s (valid while s is); ids and values of unequal
 * lengths give n_logit_bias -1, which pd_sampler_init refuses. */
pd_sampling_params pd_replica_sampling(const Pdserve__SamplingParams *s);

/** Ends the transport: the KV pool and the UCX agent (the outstanding
 * puts' callbacks run), then the staging pool, the heartbeat
 * thread, /metrics, the operations, the control socket. Safe on a session
 * that started only partly, and twice. */
void pd_replica_disconnect(pd_replica *r);

/** Frees the grammar vocabulary, the model and the backends; after the
 * role freed its KV cache (pd_replica_disconnect first). */
void pd_replica_free(pd_replica *r);

#endif

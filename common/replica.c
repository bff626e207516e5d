/* A replica session: start-up, control connection, heartbeat and shutdown
 * shared by the prefill and decode services (pd_replica.h). */
#include "pd_replica.h"

#include <errno.h>
#include <malloc.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "pd_version.h"

/* one replica per process: the signal handler's flags (the first signal
 * drains unless --shutdown-timeout is 0; the next one stops) */
static volatile sig_atomic_t g_stop, g_drain, g_no_drain;

static void on_signal(int sig) {
    (void)sig;
    if (g_drain || g_no_drain)
        g_stop = 1;
    else
        g_drain = 1;
}

bool pd_replica_stopping(void) { return g_stop != 0; }

bool pd_replica_draining(void) { return g_drain != 0; }

bool pd_replica_drained(pd_replica *r, bool idle) {
    if (!g_drain) return false;
    double now = pd_now_s();
    if (r->drain_t0 == 0) {
        r->drain_t0 = now;
        r->last_heartbeat = 0; /* the next tick tells the gateway */
        PD_LOGI(r->role, "%s: draining: no new work; finishing what it has (at most --shutdown-timeout %g s; a "
                "second signal stops at once)", r->replica_id, r->args->shutdown_timeout);
    }
    if (idle && (now - r->drain_t0) * 1000.0 >= 2.0 * r->heartbeat_ms) {
        PD_LOGI(r->role, "%s: drained after %.1f s", r->replica_id, now - r->drain_t0);
        return true;
    }
    if (now - r->drain_t0 >= r->args->shutdown_timeout) {
        PD_LOGW(r->role, "%s: --shutdown-timeout %g s reached while draining: stopping with work left", r->replica_id,
                r->args->shutdown_timeout);
        return true;
    }
    return false;
}

void pd_replica_request_stop(void) { g_stop = 1; }

/* Prints "pdserve <role>: <message>" to stderr and returns rc (the exit status). */
static int fail(const pd_replica *r, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(const pd_replica *r, int rc, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "pdserve %s: %s\n", r->role, msg);
    return rc;
}

int pd_replica_flags_parse(const char *role, pd_replica_args *a, const pd_flag *own, int n_own, int argc,
                           char **argv) {
    *a = (pd_replica_args){
        .gateway = "tcp://127.0.0.1:8001",
        .device = "cpu",
        .metrics_host = "127.0.0.1",
        .numa = "auto",
        .block_size = 16,
        .tp = 1,
        .heartbeat_ms = 500,
        .shutdown_timeout = 30,
    };
    char id_help[96];
    snprintf(id_help, sizeof id_help, "unique name of this replica (default %s-<pid>)", role);
    const pd_flag shared[] = {
        {"model", PD_FLAG_STR, &a->model, "checkpoint directory (config.json, safetensors)"},
        {"gateway", PD_FLAG_STR, &a->gateway, "gateway control endpoint (default tcp://127.0.0.1:8001)"},
        {"replica-id", PD_FLAG_STR, &a->replica_id, id_help},
        {"tokenizer", PD_FLAG_STR, &a->tokenizer,
         "tokenizer.json for response_format's token mask (default <model>/tokenizer.json; read at the first such request)"},
        {"block-size", PD_FLAG_INT, &a->block_size, "KV cache block, tokens (default 16; prefill and decode must agree)"},
        {"num-kv-blocks", PD_FLAG_INT, &a->num_blocks,
         "KV cache blocks (default 4096; with --gpu-memory-utilization: overrides its plan)"},
        {"gpu-memory-utilization", PD_FLAG_FLOAT, &a->gpu_mem_util,
         "CUDA: size the KV cache so this replica takes this fraction (0, 1] of each GPU's memory in all (vLLM's "
         "meaning; replicas sharing a GPU each take their own fraction)"},
        {"kv-staging-blocks", PD_FLAG_INT, &a->kv_staging_blocks,
         "KV blocks of page-locked host memory that KV transfers pass through when the cache is device memory "
         "(default: 4 prompts of the model's context, at most 4 GiB unless one needs more, at most the cache); a "
         "decode replica refuses a reservation when its prompt's blocks find no free slots"},
        {"device", PD_FLAG_STR, &a->device, "cpu (default) or cuda"},
        {"threads", PD_FLAG_INT, &a->threads, "CPU threads (0: all)"},
        {"tensor-parallel-size", PD_FLAG_INT, &a->tp,
         "shard the model over GPUs 0..N-1 (CUDA_VISIBLE_DEVICES picks them) or N CPU threads (default 1)"},
        {"enable-expert-parallel", PD_FLAG_BOOL, &a->expert_parallel,
         "with --tensor-parallel-size N: routed experts divided whole over the N ranks (rank r: experts "
         "[r*E/N, (r+1)*E/N); N must divide them) instead of each split; attention and shared experts stay "
         "tensor parallel"},
        {"heartbeat-interval-ms", PD_FLAG_INT, &a->heartbeat_ms, "load report period (default 500)"},
        {"shutdown-timeout", PD_FLAG_FLOAT, &a->shutdown_timeout,
         "on a first SIGTERM/SIGINT take no new work and finish what runs, for at most this many seconds, then "
         "exit (default 30; 0: stop at once; a second signal stops at once)"},
        {"metrics-port", PD_FLAG_INT, &a->metrics_port, "serve this replica's /metrics on this port (0: off)"},
        {"metrics-host", PD_FLAG_STR, &a->metrics_host, "address of --metrics-port (default 127.0.0.1)"},
        {"debug-step-delay-ms", PD_FLAG_INT, &a->step_delay_ms, "testing: sleep this long after every step"},
        {"debug-replay-tokens", PD_FLAG_STR, &a->replay_path,
         "testing: JSON array of token ids every request generates (then EOS) instead of samples (a prefill "
         "replica: the first one)"},
        {"verify-checkpoint", PD_FLAG_BOOL, &a->verify_ckpt, "check files, headers and config first; refuse to start otherwise"},
        {"checkpoint-manifest", PD_FLAG_STR, &a->ckpt_manifest, "with --verify-checkpoint: SHA-256 of every file against it"},
        {"numa", PD_FLAG_STR, &a->numa, "auto (the NUMA node of the GPUs; none for a CPU replica), off, or a node number: bind threads and host memory"},
        {"debug-force-kv-staging", PD_FLAG_BOOL, &a->force_kv_staging,
         "testing: KV transfers pass through the staging pool (--kv-staging-blocks) even when the cache is host memory"},
        {"debug-inject-selfcheck-failure", PD_FLAG_BOOL, &a->inject_selfcheck_failure,
         "testing: the start-up all-reduce check sees a wrong value (the replica must refuse to register)"},
    };
    enum { N_SHARED = sizeof shared / sizeof shared[0] };
    PD_ASSERT(n_own >= 0 && n_own <= PD_REPLICA_MAX_ROLE_FLAGS);
    pd_flag flags[N_SHARED + PD_REPLICA_MAX_ROLE_FLAGS];
    memcpy(flags, shared, sizeof shared);
    if (n_own > 0)
        memcpy(flags + N_SHARED, own, (size_t)n_own * sizeof *own);
    int rc = pd_flags_parse(role, flags, N_SHARED + n_own, argc, argv);
    if (rc)
        return rc == 1 ? 0 : 2;
    pd_version_log(role);
    pd_err err = {{0}};
    /* 0 stands for "not given" below: a given 0 is out of range like any other */
    for (int i = 1; i < argc && a->gpu_mem_util == 0.0; i++)
        if (!strcmp(argv[i], "--gpu-memory-utilization") || !strncmp(argv[i], "--gpu-memory-utilization=", 25)) {
            fprintf(stderr, "pdserve %s: --gpu-memory-utilization 0 must be in (0, 1]\n", role);
            return 2;
        }
    if (!(a->shutdown_timeout >= 0 && a->shutdown_timeout <= 1e6)) {
        fprintf(stderr, "pdserve %s: --shutdown-timeout %g must be in [0, 1000000] seconds\n", role, a->shutdown_timeout);
        return 2;
    }
    if (a->kv_staging_blocks < 0) {
        fprintf(stderr, "pdserve %s: --kv-staging-blocks %d must be positive (0: the default)\n", role,
                a->kv_staging_blocks);
        return 2;
    }
    if (pd_replica_kv_flags_check(a->device, a->gpu_mem_util, a->num_blocks, &err) != PD_OK) {
        fprintf(stderr, "pdserve %s: %s\n", role, err.msg);
        return 2;
    }
    return -1;
}

void pd_replica_init(pd_replica *r, const char *role, const pd_replica_args *args) {
    memset(r, 0, sizeof *r);
    r->role = role;
    r->args = args;
    r->replica_id = args->replica_id;
    if (!r->replica_id) {
        snprintf(r->rid, sizeof r->rid, "%s-%d", role, (int)getpid());
        r->replica_id = r->rid;
    }
    snprintf(r->tokpath, sizeof r->tokpath, "%s/tokenizer.json", args->model ? args->model : ".");
    r->tokenizer_path = args->tokenizer ? args->tokenizer : r->tokpath;
    r->heartbeat_ms = args->heartbeat_ms;
    g_no_drain = args->shutdown_timeout <= 0;
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    signal(SIGPIPE, SIG_IGN);
    r->t0 = r->t = pd_now_s();
}

void pd_replica_phase(pd_replica *r, const char *phase) {
    r->t = pd_startup_phase_log(r->role, r->replica_id, phase, r->t);
}

int pd_replica_load(pd_replica *r) {
    const pd_replica_args *a = r->args;
    pd_err err = {{0}};
    if (a->verify_ckpt || a->ckpt_manifest) {
        if (pd_verify_at_start(a->model, a->ckpt_manifest, r->role, &err) != PD_OK)
            return fail(r, 1, "refusing to start: %s", err.msg);
        pd_replica_phase(r, "verify checkpoint");
    }
    /* GPUs, NUMA placement, telemetry: before any backend thread exists */
    pd_replica_ops_config oc = {
        .role = r->role, .replica_id = r->replica_id, .device = a->device, .tp = a->tp, .numa = a->numa};
    pd_status st = pd_replica_ops_init(&oc, &r->ops, &err);
    if (st != PD_OK)
        return fail(r, st == PD_ERR_INVALID ? 2 : 1, "%s", err.msg);
    if (pd_backend_init_tp(a->device, a->tp, a->threads, r->bes, &err) != PD_OK)
        return fail(r, 1, "%s", err.msg);
    pd_replica_phase(r, "init backend");
    if (pd_model_load_parallel(a->model, r->bes, a->tp, a->expert_parallel, &r->m, &err) != PD_OK)
        return fail(r, 1, "%s", err.msg);
    pd_replica_phase(r, "load weights");
    /* the gateway compares it with its own, so that replicas of one
     * architecture but other weights are not mixed */
    if (pd_checkpoint_fingerprint(a->model, &r->weights_fp, &err) != PD_OK)
        r->weights_fp = 0;
    r->num_blocks = a->num_blocks;
    st = pd_replica_kv_blocks(r->ops, r->bes, a->tp, pd_model_config_of(r->m), a->gpu_mem_util, a->block_size,
                              &r->num_blocks, &err);
    if (st != PD_OK)
        return fail(r, st == PD_ERR_UNSUPPORTED || st == PD_ERR_INVALID ? 2 : 1, "%s", err.msg);
    return 0;
}

int pd_replica_kv_pool(pd_replica *r, pd_kv_cache *kv, bool advertise_rkey) {
    const pd_replica_args *a = r->args;
    pd_err err = {{0}};
    r->kv = kv;
    r->advertise_rkey = advertise_rkey;
    /* One host (no UCX_TLS given): keep shared memory (UCX peer-failure
     * detection would force TCP); same-host peers are watched by pidfd. */
    pd_kvx_config kc = {.name = r->replica_id, .no_ucx_peer_failure = getenv("UCX_TLS") == NULL};
    const size_t bb = pd_kv_cache_block_bytes(kv);
    const int num_blocks = pd_kv_cache_num_blocks(kv);
    const bool device_cache = r->bes[0]->ops->host_alloc != NULL;
    if (pd_kvx_agent_init(&kc, &r->agent, &err) != PD_OK)
        return fail(r, 1, "KV transfer: %s", err.msg);
    if (!device_cache && !a->force_kv_staging) {
        /* a host cache is its own pool: writers put into its blocks */
        r->kv_host = pd_kv_cache_block_ptr(kv, 0);
        if (pd_kvx_register_pool(r->agent, r->kv_host, bb * (size_t)num_blocks, &r->pool, &err) != PD_OK)
            return fail(r, 1, "KV transfer: %s", err.msg);
        PD_LOGI(r->role, "%s: KV transfer from and into the cache itself (host memory, %zu bytes)", r->replica_id,
                bb * (size_t)num_blocks);
        pd_replica_phase(r, "register KV pool (UCX)");
        return 0;
    }
    int slots = a->kv_staging_blocks > 0 ? a->kv_staging_blocks
                                         : pd_kv_staging_default_slots(pd_model_config_of(r->m),
                                                                       pd_kv_cache_block_size(kv), num_blocks);
    if (slots > num_blocks) { /* more could never be used at once: a reservation takes cache blocks too */
        PD_LOGW(r->role, "%s: --kv-staging-blocks %d is more than the cache's %d blocks: %d", r->replica_id, slots,
                num_blocks, num_blocks);
        slots = num_blocks;
    }
    const size_t bytes = bb * (size_t)slots;
    /* PD_KV_HOST_POOL=ucx (a decode replica; off by default: measured
     * slower on the H200, docs/benchmarks.md): the staging pool prefill
     * replicas write into is allocated by UCX in shared memory, so a writer
     * on this host puts into it with one copy through a mapping instead of
     * active messages this replica's thread must serve between decode
     * steps, and page-locked for the copies into the cache */
    const char *hp = getenv("PD_KV_HOST_POOL");
    r->staging_in_ucx_pool = advertise_rkey && hp && !strcmp(hp, "ucx");
    if (r->staging_in_ucx_pool) {
        if (pd_kvx_alloc_pool(r->agent, bytes, &r->pool, &err) != PD_OK ||
            pd_kv_staging_init(kv, slots, pd_kvx_pool_base(r->pool), &r->staging, &err) != PD_OK)
            return fail(r, 1, "KV transfer (PD_KV_HOST_POOL=ucx): %s", err.msg);
    } else if (pd_kv_staging_init(kv, slots, NULL, &r->staging, &err) != PD_OK ||
               pd_kvx_register_pool(r->agent, pd_kv_staging_base(r->staging), bytes, &r->pool, &err) != PD_OK) {
        return fail(r, 1, "KV transfer: %s", err.msg);
    }
    r->kv_host = pd_kv_staging_base(r->staging);
    PD_LOGI(r->role, "%s: KV staging pool: %d slots of %zu bytes = %zu bytes (%.2f GiB) of %s host memory%s, for a "
            "cache of %d blocks (%.2f GiB)%s",
            r->replica_id, slots, bb, bytes, bytes / 1073741824.0, device_cache ? "page-locked" : "ordinary",
            r->staging_in_ucx_pool ? " allocated by UCX (shared memory)" : "", num_blocks,
            bb * (double)num_blocks / 1073741824.0,
            device_cache ? "" : " (--debug-force-kv-staging: the cache is host memory)");
    pd_replica_phase(r, "register KV pool (UCX)");
    return 0;
}

int pd_replica_connect(pd_replica *r) {
    const pd_replica_args *a = r->args;
    r->zctx = zmq_ctx_new();
    r->sock = zmq_socket(r->zctx, ZMQ_DEALER);
    int linger = 0, hwm = 100000;
    zmq_setsockopt(r->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(r->sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(r->sock, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(r->sock, ZMQ_ROUTING_ID, r->replica_id, strlen(r->replica_id));
    if (zmq_connect(r->sock, a->gateway) != 0)
        return fail(r, 1, "cannot connect to %s: %s", a->gateway, zmq_strerror(errno));
    pd_err err = {{0}};
    double tc = pd_now_s();
    if (pd_replica_ops_self_check(r->ops, r->bes, a->tp, r->num_blocks, a->block_size, a->inject_selfcheck_failure,
                                  &err) != PD_OK)
        return fail(r, 1, "refusing to start: self-check: %s", err.msg);
    pd_startup_phase_log(r->role, r->replica_id, "self-checks", tc);
    return 0;
}

static void send_register(pd_replica *r) {
    const pd_model_config *c = pd_model_config_of(r->m);
    Pdserve__KvGeometry geo = PDSERVE__KV_GEOMETRY__INIT;
    geo.block_size = (uint32_t)pd_kv_cache_block_size(r->kv);
    geo.num_layers = (uint32_t)c->num_hidden_layers;
    geo.kv_lora_rank = (uint32_t)c->kv_lora_rank;
    geo.qk_rope_head_dim = (uint32_t)c->qk_rope_head_dim;
    geo.dtype_bytes = 4;
    geo.num_blocks = (uint32_t)pd_kv_cache_num_blocks(r->kv);
    Pdserve__Register m = PDSERVE__REGISTER__INIT;
    const void *addr;
    size_t addr_len;
    pd_kvx_agent_worker_address(r->agent, &addr, &addr_len);
    m.ucx_worker_address.data = (uint8_t *)addr;
    m.ucx_worker_address.len = addr_len;
    if (r->advertise_rkey) {
        const void *rkey;
        size_t rkey_len;
        pd_kvx_pool_rkey(r->pool, &rkey, &rkey_len);
        m.kv_rkey.data = (uint8_t *)rkey;
        m.kv_rkey.len = rkey_len;
    }
    m.role = (char *)r->role;
    m.replica_id = (char *)r->replica_id;
    m.geometry = &geo;
    m.model_fingerprint = pd_config_fingerprint(c);
    m.weights_fingerprint = r->weights_fp;
    m.pid = (uint32_t)getpid();
    m.kv_staging_slots = r->staging ? (uint32_t)pd_kv_staging_num_slots(r->staging) : 0;
    pd_msg_send(r->sock, NULL, 0, PD_MSG_REGISTER, &m.base);
    r->last_register = pd_now_s();
}

int pd_replica_serve(pd_replica *r) {
    const pd_replica_args *a = r->args;
    pd_err err = {{0}};
    if (pd_hb_start(r->zctx, a->gateway, r->replica_id, r->heartbeat_ms, &r->hb, &err) != PD_OK)
        return fail(r, 1, "%s", err.msg);
    pd_startup_phase_log(r->role, r->replica_id, "total to registration", r->t0);
    if (pd_metrics_server_start(a->metrics_host, a->metrics_port, &r->metrics, &err) != PD_OK)
        return fail(r, 1, "%s", err.msg);
    pd_replica_ops_attach(r->ops, r->metrics);
    /* Start-up (checkpoint JSON, verification, self-checks) leaves ~5 MB
     * free inside the heap; hand it back so that RSS shows what serving uses */
    malloc_trim(0);
    send_register(r);
    return 0;
}

long pd_replica_wait_ms(const pd_replica *r, bool busy) {
    long wait_ms = busy ? 0 : (long)(r->heartbeat_ms - (pd_now_s() - r->last_heartbeat) * 1000.0);
    return wait_ms < 0 ? 0 : wait_ms;
}

void pd_replica_poll(pd_replica *r, long wait_ms) {
    zmq_pollitem_t it[2] = {{r->sock, 0, ZMQ_POLLIN, 0}, {NULL, pd_kvx_agent_event_fd(r->agent), ZMQ_POLLIN, 0}};
    zmq_poll(it, 2, wait_ms);
}

static void on_register_reply(pd_replica *r, const Pdserve__RegisterReply *m) {
    if (m->accepted) {
        if (m->heartbeat_interval_ms) {
            r->heartbeat_ms = (int)m->heartbeat_interval_ms;
            pd_hb_set_interval(r->hb, r->heartbeat_ms);
        }
        if (r->registered) {
            /* the answer to a Register resent while the first was unanswered */
            PD_LOGD(r->role, "%s: registered with the gateway (again: a resent Register)", r->replica_id);
            return;
        }
        r->registered = true;
        pd_hb_set_registration(r->hb, ++r->n_registrations);
        PD_LOGI(r->role, "%s: registered with the gateway", r->replica_id);
    } else {
        r->registered = false;
        pd_hb_set_registration(r->hb, 0);
        PD_LOGW(r->role, "%s: gateway refused registration: %s", r->replica_id, m->reason);
        /* registering again cannot help: the gateway serves another model
         * (the role then exits 1, as a displaced replica does) */
        if (strstr(m->reason, "fingerprint") || strstr(m->reason, "geometry")) {
            r->displaced = true;
            pd_replica_request_stop();
        }
    }
}

void pd_replica_recv_all(pd_replica *r, pd_replica_handler handle, void *user) {
    pd_err err = {{0}};
    for (;;) {
        pd_msg msg;
        pd_status s = pd_msg_recv(r->sock, false, &msg, &err);
        if (s == PD_ERR_LIMIT)
            break;
        if (s != PD_OK) {
            PD_LOGW(r->role, "dropped a message from the gateway: %s", err.msg);
            if (s == PD_ERR_IO)
                break;
            continue;
        }
        if (msg.type == PD_MSG_REGISTER_REPLY)
            on_register_reply(r, (const Pdserve__RegisterReply *)msg.msg);
        else
            handle(user, &msg);
        pd_msg_clear(&msg);
    }
}

bool pd_replica_tick(pd_replica *r) {
    double now = pd_now_s();
    if (!r->displaced && pd_hb_displaced(r->hb)) {
        r->displaced = true;
        PD_LOGE(r->role, "%s: another process (another pid) has registered this replica id with the gateway since: "
                "this one stops (give every replica its own --replica-id)", r->replica_id);
        pd_replica_request_stop();
    }
    if (pd_hb_take_reregister(r->hb)) {
        PD_LOGI(r->role, "%s: the gateway does not know this replica (it restarted, or declared it dead): "
                "registering again", r->replica_id);
        r->registered = false;
        pd_hb_set_registration(r->hb, 0);
        r->last_register = 0;
    }
    if (!r->registered && now - r->last_register > 1.0)
        send_register(r);
    return (now - r->last_heartbeat) * 1000.0 >= r->heartbeat_ms / 4.0;
}

void pd_replica_heartbeat(pd_replica *r, Pdserve__Heartbeat *h, pd_replica_render render, void *user) {
    h->replica_id = (char *)r->replica_id;
    h->draining = g_drain != 0;
    pd_hb_update(r->hb, h); /* the heartbeat thread sends it */
    if (r->metrics) {       /* the replica's own /metrics (--metrics-port) */
        pd_strbuf b = {0};
        render(user, h, &b);
        pd_metrics_server_publish(r->metrics, b.data, b.len);
        pd_strbuf_free(&b);
    }
    r->last_heartbeat = pd_now_s();
}

int pd_replica_error_status(pd_status st) {
    return st == PD_ERR_INVALID || st == PD_ERR_LIMIT ? 400 : st == PD_ERR_NOMEM ? 503 : 500;
}

void pd_replica_send_error(pd_replica *r, const char *id, int http_status, const char *msg) {
    Pdserve__Tokens t = PDSERVE__TOKENS__INIT;
    t.request_id = (char *)id;
    t.finished = true;
    t.error = (char *)msg;
    t.error_status = http_status > 0 ? (uint32_t)http_status : 0;
    pd_msg_send(r->sock, NULL, 0, PD_MSG_TOKENS, &t.base);
}

pd_grammar_vocab *pd_replica_vocab(pd_replica *r) {
    if (r->vocab_tried)
        return r->vocab;
    r->vocab_tried = true;
    const pd_model_config *c = pd_model_config_of(r->m);
    pd_err err = {{0}};
    double t0 = pd_now_s();
    if (pd_grammar_vocab_load(r->tokenizer_path, c->vocab_size, c->eos_token_id, &r->vocab, &err) != PD_OK) {
        PD_LOGE(r->role, "%s: response_format is unavailable: %s", r->replica_id, err.msg);
        return NULL;
    }
    malloc_trim(0); /* parsing tokenizer.json left ~30 MB free in the heap; ~3 ms, once */
    PD_LOGI(r->role, "%s: grammar vocabulary from %s in %.2f s", r->replica_id, r->tokenizer_path, pd_now_s() - t0);
    return r->vocab;
}

pd_sampling_params pd_replica_sampling(const Pdserve__SamplingParams *s) {
    pd_sampling_params p = pd_sampling_defaults();
    if (!s)
        return p;
    p.temperature = s->temperature;
    p.top_k = s->top_k;
    p.top_p = s->top_p;
    p.min_p = s->min_p;
    p.presence_penalty = s->presence_penalty;
    p.frequency_penalty = s->frequency_penalty;
    p.repetition_penalty = s->repetition_penalty;
    p.seed = s->seed;
    p.has_seed = s->has_seed;
    p.logit_bias_ids = s->logit_bias_ids; /* borrowed from s: pd_sampler_init copies them */
    p.logit_bias = s->logit_bias_values;
    /* lengths that differ: -1, which pd_sampler_init refuses (the request fails) */
    p.n_logit_bias = s->n_logit_bias_ids == s->n_logit_bias_values ? (int)s->n_logit_bias_ids : -1;
    p.text_vocab_size = s->text_vocab_size <= INT32_MAX ? (int)s->text_vocab_size : 0;
    return p;
}

void pd_replica_disconnect(pd_replica *r) {
    /* PD_KV_HOST_POOL=ucx (a decode replica: no put of its own reads the
     * pool): unlocked before UCX unmaps it */
    if (r->staging_in_ucx_pool)
        pd_kv_staging_free(&r->staging);
    pd_kvx_pool_free(&r->pool);
    pd_kvx_agent_free(&r->agent); /* outstanding puts' callbacks give their slots back */
    pd_kv_staging_free(&r->staging); /* unregistered, and no put reads it any more */
    pd_hb_stop(&r->hb);
    pd_metrics_server_stop(&r->metrics);
    pd_replica_ops_free(&r->ops); /* after /metrics: its scrapes call into it */
    if (r->sock)
        zmq_close(r->sock);
    if (r->zctx)
        zmq_ctx_term(r->zctx);
    r->sock = r->zctx = NULL;
}

void pd_replica_free(pd_replica *r) {
    pd_grammar_vocab_free(&r->vocab);
    pd_model_free(&r->m);
    for (int i = 0; i < PD_TP_MAX_RANKS; i++)
        pd_backend_free(&r->bes[i]);
}

/* pdserve decode: one decode replica. A single thread alternates between
 * the control connection to the gateway (ZeroMQ DEALER) and scheduler steps;
 * generated tokens go back in one Tokens message per request per step. */
#include "pd_decode.h"

#include <errno.h>
#include <malloc.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "pd_flags.h"
#include "pd_heartbeat.h"
#include "pd_metrics.h"
#include "pd_metrics_server.h"
#include "pd_kvtransfer.h"
#include "pd_msg.h"
#include "pd_replica_ops.h"
#include "pd_version.h"

#define LOGM "decode"

typedef struct pending_tokens {
    char id[128];
    int32_t *ids;
    float *logprobs;
    int32_t *top_ids; /* [cap][PD_MAX_TOP_LOGPROBS], n_top[i] used per token */
    float *top_lps;
    int *n_top;
    bool any_top; /* some token has alternatives: Tokens carries top_logprobs */
    int n, cap;
    const char *finish;
    char error[256];
    struct pending_tokens *next;
} pending_tokens;

/* A long-route request waiting for its KV: the Generate that reserved it
 * and the reservation (its blocks belong to the reservation table until a
 * KvComplete is accepted). */
typedef struct parked {
    Pdserve__Generate *gen; /* owned (unpacked message) */
    uint64_t resv;
    int32_t *blocks;
    int n_blocks;
    struct parked *next;
} parked;

typedef struct {
    void *zctx, *sock;
    const char *replica_id;
    pd_model *m;
    pd_sched *sched;
    /* response_format: the vocabulary trie, built from the tokenizer at the
     * first constrained request (a fraction of a second, once) */
    const char *tokenizer_path;
    pd_grammar_vocab *vocab;
    bool vocab_tried;
    pending_tokens *pend;
    parked *parked;
    bool registered;
    pd_hb *hb;
    pd_metrics_server *metrics;
    pd_hist step_seconds;
    double last_heartbeat, last_register;
    int heartbeat_ms;
    pd_kvx_agent *agent;
    pd_kvx_pool *pool;
    pd_kvx_reservations *resv;
    double reservation_ttl_s;
} decode_svc;

/* The writer id of a prefill replica in the reservation table. */
static uint64_t writer_id(const char *replica_id) {
    uint64_t h = 1469598103934665603ull;
    for (const char *c = replica_id ? replica_id : ""; *c; c++) {
        h ^= (unsigned char)*c;
        h *= 1099511628211ull;
    }
    return h;
}

static void parked_free(parked *p) {
    protobuf_c_message_free_unpacked(&p->gen->base, NULL);
    free(p->blocks);
    free(p);
}

/* The reservation table hands back blocks once no writer can touch them. */
static void on_blocks_free(void *user, const char *request_id, uint64_t resv_id, const int32_t *blocks,
                           size_t n_blocks) {
    decode_svc *d = user;
    pd_sched_free_blocks(d->sched, blocks, (int)n_blocks);
    PD_LOGD(LOGM, "request %s: %zu quarantined blocks of reservation %llx reusable", request_id, n_blocks,
            (unsigned long long)resv_id);
}

static volatile sig_atomic_t g_stop;
static int g_step_delay_ms; /* --debug-step-delay-ms: fault tests slow a replica down */
static void on_signal(int sig) { g_stop = 1; }

static pending_tokens *pend_get(decode_svc *d, const char *id) {
    for (pending_tokens *p = d->pend; p; p = p->next)
        if (!strcmp(p->id, id)) return p;
    pending_tokens *p = pd_xcalloc(1, sizeof *p);
    snprintf(p->id, sizeof p->id, "%s", id);
    p->next = d->pend;
    d->pend = p;
    return p;
}

/* realloc that does not return on failure, as pd_xmalloc */
static void *xrealloc(void *ptr, size_t n) {
    void *q = realloc(ptr, n);
    if (!q) {
        PD_LOGE(LOGM, "out of memory (%zu bytes)", n);
        abort();
    }
    return q;
}

static void cb_token(void *u, const char *id, int32_t t, float lp, const int32_t *top_ids, const float *top_lps,
                     int n_top) {
    pending_tokens *p = pend_get(u, id);
    if (p->n == p->cap) {
        p->cap = p->cap ? 2 * p->cap : 16;
        p->ids = xrealloc(p->ids, (size_t)p->cap * sizeof *p->ids);
        p->logprobs = xrealloc(p->logprobs, (size_t)p->cap * sizeof *p->logprobs);
        p->n_top = xrealloc(p->n_top, (size_t)p->cap * sizeof *p->n_top);
        if (p->top_ids) {
            p->top_ids = xrealloc(p->top_ids, (size_t)p->cap * PD_MAX_TOP_LOGPROBS * sizeof *p->top_ids);
            p->top_lps = xrealloc(p->top_lps, (size_t)p->cap * PD_MAX_TOP_LOGPROBS * sizeof *p->top_lps);
        }
    }
    if (n_top > PD_MAX_TOP_LOGPROBS) n_top = PD_MAX_TOP_LOGPROBS;
    if (n_top > 0 && !p->top_ids) {
        p->top_ids = pd_xmalloc((size_t)p->cap * PD_MAX_TOP_LOGPROBS * sizeof *p->top_ids);
        p->top_lps = pd_xmalloc((size_t)p->cap * PD_MAX_TOP_LOGPROBS * sizeof *p->top_lps);
    }
    if (n_top > 0) {
        memcpy(p->top_ids + (size_t)p->n * PD_MAX_TOP_LOGPROBS, top_ids, (size_t)n_top * sizeof *top_ids);
        memcpy(p->top_lps + (size_t)p->n * PD_MAX_TOP_LOGPROBS, top_lps, (size_t)n_top * sizeof *top_lps);
        p->any_top = true;
    }
    p->ids[p->n] = t;
    p->logprobs[p->n] = lp;
    p->n_top[p->n] = n_top > 0 ? n_top : 0;
    p->n++;
}
static void cb_finished(void *u, const char *id, const char *reason) {
    pend_get(u, id)->finish = reason;
}
static void cb_error(void *u, const char *id, const char *msg) {
    snprintf(pend_get(u, id)->error, 256, "%s", msg);
}

static void send_error(decode_svc *d, const char *id, const char *msg) {
    Pdserve__Tokens t = PDSERVE__TOKENS__INIT;
    t.request_id = (char *)id;
    t.finished = true;
    t.error = (char *)msg;
    pd_msg_send(d->sock, NULL, 0, PD_MSG_TOKENS, &t.base);
}

static void flush_tokens(decode_svc *d) {
    while (d->pend) {
        pending_tokens *p = d->pend;
        d->pend = p->next;
        Pdserve__Tokens t = PDSERVE__TOKENS__INIT;
        t.request_id = p->id;
        t.n_ids = (size_t)p->n;
        t.ids = p->ids;
        t.n_logprobs = (size_t)p->n;
        t.logprobs = p->logprobs;
        t.finished = p->finish != NULL || p->error[0];
        t.finish_reason = (char *)(p->finish ? p->finish : "");
        t.error = p->error;
        /* one TopLogprobs per id (borrowing the pending arrays) */
        Pdserve__TopLogprobs *top = NULL, **topp = NULL;
        if (p->any_top) {
            top = pd_xmalloc((size_t)p->n * sizeof *top);
            topp = pd_xmalloc((size_t)p->n * sizeof *topp);
            for (int i = 0; i < p->n; i++) {
                pdserve__top_logprobs__init(&top[i]);
                top[i].n_ids = top[i].n_logprobs = (size_t)p->n_top[i];
                top[i].ids = p->top_ids + (size_t)i * PD_MAX_TOP_LOGPROBS;
                top[i].logprobs = p->top_lps + (size_t)i * PD_MAX_TOP_LOGPROBS;
                topp[i] = &top[i];
            }
            t.n_top_logprobs = (size_t)p->n;
            t.top_logprobs = topp;
        }
        if (pd_msg_send(d->sock, NULL, 0, PD_MSG_TOKENS, &t.base) != PD_OK)
            PD_LOGW(LOGM, "request %s: could not send %d tokens to the gateway", p->id, p->n);
        free(topp);
        free(top);
        free(p->ids);
        free(p->logprobs);
        free(p->n_top);
        free(p->top_ids);
        free(p->top_lps);
        free(p);
    }
}

static pd_sampling_params sampling_from(const Pdserve__SamplingParams *s) {
    pd_sampling_params p = pd_sampling_defaults();
    if (!s) return p;
    p.temperature = s->temperature;
    p.top_k = s->top_k;
    p.top_p = s->top_p;
    p.min_p = s->min_p;
    p.presence_penalty = s->presence_penalty;
    p.frequency_penalty = s->frequency_penalty;
    p.repetition_penalty = s->repetition_penalty;
    p.seed = s->seed;
    p.has_seed = s->has_seed;
    return p;
}

static pd_sched_request request_from(const Pdserve__Generate *g) {
    pd_sched_request r = {
        .request_id = g->request_id, .prompt_ids = g->prompt_ids, .n_prompt = (int)g->n_prompt_ids,
        .sampling = sampling_from(g->sampling), .max_tokens = (int)g->max_tokens, .min_tokens = (int)g->min_tokens,
        .ignore_eos = g->ignore_eos, .stop_token_ids = g->stop_token_ids, .n_stop_token_ids = (int)g->n_stop_token_ids,
        .want_logprobs = g->logprobs >= 0,
        /* the gateway allows at most PD_MAX_TOP_LOGPROBS; a larger ask gets that many */
        .top_logprobs = g->logprobs < 0 ? 0 : g->logprobs > PD_MAX_TOP_LOGPROBS ? PD_MAX_TOP_LOGPROBS : g->logprobs,
        .json_schema = g->json_schema,
    };
    return r;
}

/* Loads the grammar vocabulary the first time a request needs it; on
 * failure the scheduler refuses constrained requests (the reason is
 * logged once). */
static void ensure_vocab(decode_svc *d, const Pdserve__Generate *g) {
    if (!g->json_schema || !*g->json_schema || d->vocab_tried) return;
    d->vocab_tried = true;
    const pd_model_config *c = pd_model_config_of(d->m);
    pd_err err = {{0}};
    double t0 = pd_now_s();
    if (pd_grammar_vocab_load(d->tokenizer_path, c->vocab_size, c->eos_token_id, &d->vocab, &err) != PD_OK) {
        PD_LOGE(LOGM, "%s: response_format is unavailable: %s", d->replica_id, err.msg);
        return;
    }
    pd_sched_set_grammar_vocab(d->sched, d->vocab);
    malloc_trim(0); /* parsing tokenizer.json left ~30 MB free in the heap; ~3 ms, once */
    PD_LOGI(LOGM, "%s: grammar vocabulary from %s in %.2f s", d->replica_id, d->tokenizer_path, pd_now_s() - t0);
}

static void send_register(decode_svc *d) {
    const pd_model_config *c = pd_model_config_of(d->m);
    pd_sched_stats st;
    pd_sched_get_stats(d->sched, &st);
    Pdserve__KvGeometry geo = PDSERVE__KV_GEOMETRY__INIT;
    geo.block_size = (uint32_t)pd_kv_cache_block_size(pd_sched_kv(d->sched));
    geo.num_layers = (uint32_t)c->num_hidden_layers;
    geo.kv_lora_rank = (uint32_t)c->kv_lora_rank;
    geo.qk_rope_head_dim = (uint32_t)c->qk_rope_head_dim;
    geo.dtype_bytes = 4;
    geo.num_blocks = (uint32_t)st.total_blocks;
    Pdserve__Register r = PDSERVE__REGISTER__INIT;
    const void *addr, *rkey;
    size_t addr_len, rkey_len;
    pd_kvx_agent_worker_address(d->agent, &addr, &addr_len);
    pd_kvx_pool_rkey(d->pool, &rkey, &rkey_len);
    r.ucx_worker_address.data = (uint8_t *)addr;
    r.ucx_worker_address.len = addr_len;
    r.kv_rkey.data = (uint8_t *)rkey;
    r.kv_rkey.len = rkey_len;
    r.role = "decode";
    r.replica_id = (char *)d->replica_id;
    r.geometry = &geo;
    r.model_fingerprint = pd_config_fingerprint(c);
    r.pid = (uint32_t)getpid();
    pd_msg_send(d->sock, NULL, 0, PD_MSG_REGISTER, &r.base);
    d->last_register = pd_now_s();
}

static void send_heartbeat(decode_svc *d) {
    pd_sched_stats st;
    pd_sched_get_stats(d->sched, &st);
    Pdserve__Heartbeat h = PDSERVE__HEARTBEAT__INIT;
    h.replica_id = (char *)d->replica_id;
    h.num_running = (uint32_t)st.num_running;
    h.num_waiting = (uint32_t)st.num_waiting;
    h.free_blocks = (uint32_t)st.free_blocks;
    h.total_blocks = (uint32_t)st.total_blocks;
    h.tokens_in_flight = st.tokens_in_flight;
    h.prefill_tokens_total = st.prefill_tokens_total;
    h.generation_tokens_total = st.generation_tokens_total;
    pd_hb_update(d->hb, &h); /* the heartbeat thread sends it */
    if (d->metrics) { /* the replica's own /metrics (--metrics-port) */
        pd_strbuf b = {0};
        const char *id = d->replica_id;
        pd_strbuf_printf(&b,
                         "# TYPE pdserve:num_requests_running gauge\npdserve:num_requests_running{replica=\"%s\",role=\"decode\"} %d\n"
                         "# TYPE pdserve:num_requests_waiting gauge\npdserve:num_requests_waiting{replica=\"%s\",role=\"decode\"} %d\n"
                         "# TYPE pdserve:kv_cache_usage_perc gauge\npdserve:kv_cache_usage_perc{replica=\"%s\",role=\"decode\"} %.6f\n"
                         "# TYPE pdserve:kv_cache_free_blocks gauge\npdserve:kv_cache_free_blocks{replica=\"%s\",role=\"decode\"} %d\n"
                         "# TYPE pdserve:replica_prefill_tokens_total counter\npdserve:replica_prefill_tokens_total{replica=\"%s\",role=\"decode\"} %llu\n"
                         "# TYPE pdserve:generation_tokens_total counter\npdserve:generation_tokens_total{replica=\"%s\"} %llu\n"
                         "# TYPE pdserve:decode_step_seconds histogram\n",
                         id, st.num_running, id, st.num_waiting, id,
                         st.total_blocks ? 1.0 - (double)st.free_blocks / st.total_blocks : 0.0, id, st.free_blocks, id,
                         (unsigned long long)st.prefill_tokens_total, id, (unsigned long long)st.generation_tokens_total);
        char labels[200];
        snprintf(labels, sizeof labels, "replica=\"%s\"", id);
        pd_hist_render(&d->step_seconds, "pdserve:decode_step_seconds", labels, &b);
        pd_metrics_server_publish(d->metrics, b.data, b.len);
        pd_strbuf_free(&b);
    }
    d->last_heartbeat = pd_now_s();
}

/* Reservations past their deadline: the request fails (its blocks stay
 * quarantined until the writer is known to be quiet). */
static void expire_reservations(decode_svc *d) {
    double now = pd_now_s();
    size_t q0 = pd_kvx_resv_stats_get(d->resv).quarantined;
    size_t n_expired = pd_kvx_resv_expire(d->resv, now);
    size_t handed = q0 + n_expired - pd_kvx_resv_stats_get(d->resv).quarantined;
    if (handed > 0) /* nobody fenced them (a grant or claim lost with the gateway) */
        PD_LOGI(LOGM, "%s: %zu reservations handed back: their writer's lease has ended", d->replica_id, handed);
    if (n_expired == 0) return;
    for (parked **pp = &d->parked; *pp;) {
        parked *p = *pp;
        pd_kvx_resv_state state;
        if (pd_kvx_resv_get(d->resv, p->gen->request_id, p->resv, &state, NULL, NULL) == PD_OK &&
            state == PD_KVX_RESV_EXPIRED) {
            *pp = p->next;
            send_error(d, p->gen->request_id, "the prompt's KV cache did not arrive in time");
            parked_free(p); /* the table keeps its own copy of the block ids */
        } else {
            pp = &p->next;
        }
    }
}

static void handle(decode_svc *d, pd_msg *msg) {
    pd_err err = {{0}};
    switch (msg->type) {
    case PD_MSG_REGISTER_REPLY: {
        Pdserve__RegisterReply *r = (Pdserve__RegisterReply *)msg->msg;
        if (r->accepted) {
            d->registered = true;
            if (r->heartbeat_interval_ms) {
                d->heartbeat_ms = (int)r->heartbeat_interval_ms;
                pd_hb_set_interval(d->hb, d->heartbeat_ms);
            }
            PD_LOGI(LOGM, "%s: registered with the gateway", d->replica_id);
        } else {
            d->registered = false;
            PD_LOGW(LOGM, "%s: gateway refused registration: %s", d->replica_id, r->reason);
            if (strstr(r->reason, "fingerprint") || strstr(r->reason, "geometry")) g_stop = 1;
        }
        break;
    }
    case PD_MSG_GENERATE: {
        Pdserve__Generate *g = (Pdserve__Generate *)msg->msg;
        ensure_vocab(d, g);
        if (!g->kv_reserved) {
            pd_sched_request r = request_from(g);
            if (pd_sched_add(d->sched, &r, &err) != PD_OK) send_error(d, g->request_id, err.msg);
            break;
        }
        /* long route: reserve blocks now, run when KvComplete arrives */
        Pdserve__ReserveReply rr = PDSERVE__RESERVE_REPLY__INIT;
        rr.request_id = g->request_id;
        int32_t *blocks = NULL;
        int nb = 0;
        uint64_t resv = 0;
        pd_status st = pd_sched_alloc_blocks(d->sched, (int)g->n_prompt_ids, &blocks, &nb, &err);
        if (st == PD_OK) {
            st = pd_kvx_resv_create(d->resv, g->request_id, writer_id(g->prefill_replica_id), blocks, (size_t)nb,
                                    d->reservation_ttl_s, pd_now_s(), 0, &resv, &err);
            if (st != PD_OK) {
                pd_sched_free_blocks(d->sched, blocks, nb);
                free(blocks);
                blocks = NULL;
            }
        }
        uint32_t *ublocks = NULL;
        if (st == PD_OK) {
            ublocks = pd_xmalloc((size_t)nb * sizeof *ublocks);
            for (int i = 0; i < nb; i++) ublocks[i] = (uint32_t)blocks[i];
            rr.ok = true;
            rr.reservation_id = resv;
            rr.block_ids = ublocks;
            rr.n_block_ids = (size_t)nb;
            rr.lease_ms = (uint32_t)(pd_kvx_lease_s(d->reservation_ttl_s) * 1000.0);
            parked *p = pd_xcalloc(1, sizeof *p);
            p->gen = g;
            p->resv = resv;
            p->blocks = blocks;
            p->n_blocks = nb;
            msg->msg = NULL; /* keep it */
            p->next = d->parked;
            d->parked = p;
        } else {
            rr.ok = false;
            rr.reason = err.msg;
        }
        pd_msg_send(d->sock, NULL, 0, PD_MSG_RESERVE_REPLY, &rr.base);
        free(ublocks);
        break;
    }
    case PD_MSG_KV_COMPLETE: {
        Pdserve__KvComplete *k = (Pdserve__KvComplete *)msg->msg;
        pd_kvx_verdict v = pd_kvx_resv_complete(d->resv, k->request_id, k->reservation_id,
                                                writer_id(k->prefill_replica_id), 0, pd_now_s(), &err);
        parked **pp = &d->parked;
        while (*pp && ((*pp)->resv != k->reservation_id || strcmp((*pp)->gen->request_id, k->request_id)))
            pp = &(*pp)->next;
        parked *p = *pp;
        if (p) *pp = p->next;
        if (v != PD_KVX_ACCEPTED) {
            if (!k->aborted)
                PD_LOGW(LOGM, "KvComplete for %s refused (%s): %s", k->request_id, pd_kvx_verdict_str(v), err.msg);
            if (p) {
                pd_kvx_resv_release(d->resv, k->request_id, k->reservation_id, NULL);
                send_error(d, k->request_id, "the prompt's KV cache transfer was refused");
                parked_free(p); /* the table hands the blocks back (it copied their ids) */
            }
            break;
        }
        if (!p || k->aborted) { /* accepted but nobody to run it: give the blocks back */
            const int32_t *bl;
            size_t nbl;
            if (pd_kvx_resv_get(d->resv, k->request_id, k->reservation_id, NULL, &bl, &nbl) == PD_OK)
                pd_sched_free_blocks(d->sched, bl, (int)nbl);
            pd_kvx_resv_release(d->resv, k->request_id, k->reservation_id, NULL);
            if (p) parked_free(p);
            break;
        }
        /* the blocks now belong to the decode sequence: from the host pool
         * into the cache (a no-op when the cache is host memory) */
        pd_kvx_resv_release(d->resv, k->request_id, k->reservation_id, NULL);
        if (pd_kv_cache_upload_blocks(pd_sched_kv(d->sched), p->blocks, p->n_blocks, &err) != PD_OK) {
            PD_LOGW(LOGM, "request %s: %s", k->request_id, err.msg);
            send_error(d, k->request_id, err.msg);
            pd_sched_free_blocks(d->sched, p->blocks, p->n_blocks);
            parked_free(p);
            break;
        }
        pd_sched_request r = request_from(p->gen);
        if (pd_sched_add_prefilled(d->sched, &r, p->blocks, p->n_blocks, k->first_token, k->first_logprob, &err) !=
            PD_OK) {
            PD_LOGW(LOGM, "%s", err.msg);
            send_error(d, k->request_id, err.msg);
        }
        parked_free(p);
        break;
    }
    case PD_MSG_ABORT: {
        Pdserve__Abort *a = (Pdserve__Abort *)msg->msg;
        if (a->writer_gone && a->writer_gone[0]) {
            size_t n = pd_kvx_resv_writer_gone(d->resv, writer_id(a->writer_gone));
            PD_LOGI(LOGM, "prefill replica %s is gone: %zu reservations released", a->writer_gone, n);
        }
        if (!a->request_id || !a->request_id[0]) break;
        pd_sched_abort(d->sched, a->request_id);
        for (parked **pp = &d->parked; *pp; pp = &(*pp)->next)
            if (!strcmp((*pp)->gen->request_id, a->request_id)) {
                parked *p = *pp;
                *pp = p->next;
                /* quarantined until the writer is quiet; the table frees them */
                pd_kvx_resv_release(d->resv, a->request_id, p->resv, NULL);
                if (a->never_granted)
                    pd_kvx_resv_fenced(d->resv, a->request_id, p->resv, writer_id(p->gen->prefill_replica_id), NULL);
                parked_free(p); /* the ids array only: the table copied it (LeakSanitizer, fault matrix) */
                break;
            }
        /* drop tokens not yet sent */
        for (pending_tokens **pp = &d->pend; *pp; pp = &(*pp)->next)
            if (!strcmp((*pp)->id, a->request_id)) {
                pending_tokens *p = *pp;
                *pp = p->next;
                free(p->ids);
                free(p->logprobs);
                free(p);
                break;
            }
        break;
    }
    default:
        PD_LOGW(LOGM, "unexpected %s message from the gateway", pd_msg_type_name(msg->type));
    }
}

static void backends_free(pd_backend **bes) {
    for (int r = 0; r < PD_TP_MAX_RANKS; r++)
        pd_backend_free(&bes[r]);
}

int pd_decode_main(int argc, char **argv) {
    const char *model = NULL, *gateway = "tcp://127.0.0.1:8001", *replica_id = NULL, *device = "cpu";
    const char *tokenizer = NULL;
    int max_num_seqs = 64, max_batched = 2048, chunk = 512, block_size = 16, num_blocks = 0, threads = 0;
    double gpu_mem_util = 0.0; /* 0: not given */
    int heartbeat_ms = 500, metrics_port = 0, tp = 1;
    const char *metrics_host = "127.0.0.1";
    bool verify_ckpt = false;
    const char *ckpt_manifest = NULL, *replay_path = NULL;
    const char *numa = "auto";
    bool inject_selfcheck_failure = false;
    bool expert_parallel = false;
    double reservation_ttl = 120.0;
    pd_flag flags[] = {
        {"model", PD_FLAG_STR, &model, "checkpoint directory (config.json, safetensors)"},
        {"gateway", PD_FLAG_STR, &gateway, "gateway control endpoint (default tcp://127.0.0.1:8001)"},
        {"replica-id", PD_FLAG_STR, &replica_id, "unique name of this replica (default decode-<pid>)"},
        {"tokenizer", PD_FLAG_STR, &tokenizer,
         "tokenizer.json for response_format's token mask (default <model>/tokenizer.json; read at the first such request)"},
        {"max-num-seqs", PD_FLAG_INT, &max_num_seqs, "sequences per step (default 64)"},
        {"max-num-batched-tokens", PD_FLAG_INT, &max_batched, "tokens per step (default 2048)"},
        {"chunked-prefill-size", PD_FLAG_INT, &chunk, "prefill chunk per sequence (default 512)"},
        {"block-size", PD_FLAG_INT, &block_size, "KV cache block, tokens (default 16)"},
        {"num-kv-blocks", PD_FLAG_INT, &num_blocks,
         "KV cache blocks (default 4096; with --gpu-memory-utilization: overrides its plan)"},
        {"gpu-memory-utilization", PD_FLAG_FLOAT, &gpu_mem_util,
         "CUDA: size the KV cache so this replica takes this fraction (0, 1] of each GPU's memory in all (vLLM's "
         "meaning; replicas sharing a GPU each take their own fraction)"},
        {"device", PD_FLAG_STR, &device, "cpu (default) or cuda"},
        {"threads", PD_FLAG_INT, &threads, "CPU threads (0: all)"},
        {"tensor-parallel-size", PD_FLAG_INT, &tp,
         "shard the model over GPUs 0..N-1 (CUDA_VISIBLE_DEVICES picks them) or N CPU threads (default 1)"},
        {"enable-expert-parallel", PD_FLAG_BOOL, &expert_parallel,
         "with --tensor-parallel-size N: routed experts divided whole over the N ranks (rank r: experts "
         "[r*E/N, (r+1)*E/N); N must divide them) instead of each split; attention and shared experts stay "
         "tensor parallel"},
        {"heartbeat-interval-ms", PD_FLAG_INT, &heartbeat_ms, "load report period (default 500)"},
        {"metrics-port", PD_FLAG_INT, &metrics_port, "serve this replica's /metrics on this port (0: off)"},
        {"metrics-host", PD_FLAG_STR, &metrics_host, "address of --metrics-port (default 127.0.0.1)"},
        {"kv-reservation-ttl", PD_FLAG_FLOAT, &reservation_ttl,
         "seconds a long prompt's KV reservation waits for its prefill (default 120; the prefill's lease is 3/4 of it)"},
        {"debug-step-delay-ms", PD_FLAG_INT, &g_step_delay_ms, "testing: sleep this long after every step"},
        {"debug-replay-tokens", PD_FLAG_STR, &replay_path,
         "testing: JSON array of token ids every request generates (then EOS) instead of samples"},
        {"verify-checkpoint", PD_FLAG_BOOL, &verify_ckpt, "check files, headers and config first; refuse to start otherwise"},
        {"checkpoint-manifest", PD_FLAG_STR, &ckpt_manifest, "with --verify-checkpoint: SHA-256 of every file against it"},
        {"numa", PD_FLAG_STR, &numa,
         "auto (the NUMA node of the GPUs; none for a CPU replica), off, or a node number: bind threads and host memory"},
        {"debug-inject-selfcheck-failure", PD_FLAG_BOOL, &inject_selfcheck_failure,
         "testing: the start-up all-reduce check sees a wrong value (the replica must refuse to register)"},
    };
    int rc = pd_flags_parse("decode", flags, (int)(sizeof flags / sizeof flags[0]), argc, argv);
    if (rc) return rc == 1 ? 0 : 2;
    pd_version_log(LOGM);
    if (!model) {
        fprintf(stderr, "pdserve decode: --model is required\n");
        return 2;
    }
    {
        pd_err ferr = {{0}};
        if (pd_replica_kv_flags_check(device, gpu_mem_util, num_blocks, &ferr) != PD_OK) {
            fprintf(stderr, "pdserve decode: %s\n", ferr.msg);
            return 2;
        }
    }
    if (!(reservation_ttl >= 1.0 && reservation_ttl <= 86400.0)) {
        fprintf(stderr, "pdserve decode: --kv-reservation-ttl must be 1..86400 s\n");
        return 2;
    }
    char rid[64];
    if (!replica_id) {
        snprintf(rid, sizeof rid, "decode-%d", (int)getpid());
        replica_id = rid;
    }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    signal(SIGPIPE, SIG_IGN);
    decode_svc d = {.replica_id = replica_id, .heartbeat_ms = heartbeat_ms};
    char tokpath[4096];
    snprintf(tokpath, sizeof tokpath, "%s/tokenizer.json", model);
    d.tokenizer_path = tokenizer ? tokenizer : tokpath;
    pd_err err = {{0}};
    double t0 = pd_now_s(), t = t0;
    if (verify_ckpt || ckpt_manifest) {
        if (pd_verify_at_start(model, ckpt_manifest, LOGM, &err) != PD_OK) {
            fprintf(stderr, "pdserve decode: refusing to start: %s\n", err.msg);
            return 1;
        }
        t = pd_startup_phase_log(LOGM, replica_id, "verify checkpoint", t);
    }
    pd_replica_ops *ops = NULL; /* GPUs, telemetry (common/pd_replica_ops.h) */
    pd_replica_ops_config oc = {.role = "decode", .replica_id = replica_id, .device = device, .tp = tp, .numa = numa};
    pd_status ost = pd_replica_ops_init(&oc, &ops, &err);
    if (ost != PD_OK) {
        fprintf(stderr, "pdserve decode: %s\n", err.msg);
        return ost == PD_ERR_INVALID ? 2 : 1;
    }
    pd_backend *bes[PD_TP_MAX_RANKS] = {0}; /* tensor-parallel ranks; bes[1..] NULL with one */
    if (pd_backend_init_tp(device, tp, threads, bes, &err) != PD_OK) {
        fprintf(stderr, "pdserve decode: %s\n", err.msg);
        pd_replica_ops_free(&ops);
        return 1;
    }
    t = pd_startup_phase_log(LOGM, replica_id, "init backend", t);
    if (pd_model_load_parallel(model, bes, tp, expert_parallel, &d.m, &err) != PD_OK) {
        fprintf(stderr, "pdserve decode: %s\n", err.msg);
        backends_free(bes);
        pd_replica_ops_free(&ops);
        return 1;
    }
    t = pd_startup_phase_log(LOGM, replica_id, "load weights", t);
    pd_status kst = pd_replica_kv_blocks(ops, pd_model_config_of(d.m), gpu_mem_util, block_size, &num_blocks, &err);
    if (kst != PD_OK) {
        fprintf(stderr, "pdserve decode: %s\n", err.msg);
        pd_model_free(&d.m);
        backends_free(bes);
        pd_replica_ops_free(&ops);
        return kst == PD_ERR_UNSUPPORTED || kst == PD_ERR_INVALID ? 2 : 1;
    }
    pd_sched_config sc = {max_num_seqs, max_batched, chunk, block_size, num_blocks, NULL};
    pd_replay *replay = NULL;
    if (replay_path) {
        if (pd_replay_load(replay_path, pd_model_config_of(d.m)->vocab_size, &replay, &err) != PD_OK) {
            fprintf(stderr, "pdserve decode: --debug-replay-tokens: %s\n", err.msg);
            pd_model_free(&d.m);
            backends_free(bes);
            return 2;
        }
        sc.replay = replay;
        PD_LOGW(LOGM, "replaying %d scripted outputs from %s instead of sampling (testing)", replay->n_scripts,
                replay_path);
    }
    pd_sched_callbacks cb = {cb_token, cb_finished, cb_error};
    if (pd_sched_init(d.m, &sc, &cb, &d, &d.sched, &err) != PD_OK) {
        pd_replay_free(&replay);
        fprintf(stderr, "pdserve decode: %s\n", err.msg);
        pd_model_free(&d.m);
        backends_free(bes);
        pd_replica_ops_free(&ops);
        return 1;
    }
    t = pd_startup_phase_log(LOGM, replica_id, "allocate KV", t);
    d.reservation_ttl_s = reservation_ttl;
    {
        pd_kv_cache *kv = pd_sched_kv(d.sched);
        /* One host (no UCX_TLS given): keep shared memory (UCX peer-failure
         * detection would force TCP); same-host peers are watched by pidfd. */
        pd_kvx_config kc = {.name = replica_id, .no_ucx_peer_failure = getenv("UCX_TLS") == NULL};
        /* a reservation nobody fenced (its grant or claim died with the
         * gateway, or its writer's flush failed) is handed back once its
         * writer's lease has ended for certain */
        pd_kvx_resv_config rcfg = {.blocks_free = on_blocks_free, .user = &d, .block_bytes = pd_kv_cache_block_bytes(kv),
                                   .reclaim_after_s = pd_kvx_lease_margin_s(reservation_ttl)};
        /* prefill replicas write into host memory (pd_kv_cache_host_pool);
         * KvComplete copies the blocks into the cache */
        void *kv_host = pd_kv_cache_host_pool(kv, &err);
        if (!kv_host || pd_kvx_agent_init(&kc, &d.agent, &err) != PD_OK ||
            pd_kvx_register_pool(d.agent, kv_host,
                                 pd_kv_cache_block_bytes(kv) * (size_t)pd_kv_cache_num_blocks(kv), &d.pool, &err) != PD_OK ||
            pd_kvx_resv_init(&rcfg, &d.resv, &err) != PD_OK) {
            fprintf(stderr, "pdserve decode: KV transfer: %s\n", err.msg);
            pd_kvx_resv_free(&d.resv);
            pd_kvx_pool_free(&d.pool);
            pd_kvx_agent_free(&d.agent);
            pd_sched_free(&d.sched);
            pd_model_free(&d.m);
            backends_free(bes);
            pd_replica_ops_free(&ops);
            return 1;
        }
    }
    pd_startup_phase_log(LOGM, replica_id, "register KV pool (UCX)", t);
    d.zctx = zmq_ctx_new();
    d.sock = zmq_socket(d.zctx, ZMQ_DEALER);
    int linger = 0, hwm = 100000;
    zmq_setsockopt(d.sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(d.sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(d.sock, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(d.sock, ZMQ_ROUTING_ID, replica_id, strlen(replica_id));
    if (zmq_connect(d.sock, gateway) != 0) {
        fprintf(stderr, "pdserve decode: cannot connect to %s: %s\n", gateway, zmq_strerror(errno));
        rc = 1;
        goto out;
    }
    {
        double tc = pd_now_s();
        if (pd_replica_ops_self_check(ops, bes, tp, num_blocks, block_size, inject_selfcheck_failure, &err) != PD_OK) {
            fprintf(stderr, "pdserve decode: refusing to start: self-check: %s\n", err.msg);
            rc = 1;
            goto out;
        }
        pd_startup_phase_log(LOGM, replica_id, "self-checks", tc);
    }
    PD_LOGI(LOGM, "%s: model %s, %d KV blocks of %d tokens, gateway %s", replica_id, model, num_blocks, block_size,
            gateway);
    if (pd_hb_start(d.zctx, gateway, replica_id, d.heartbeat_ms, &d.hb, &err) != PD_OK) {
        fprintf(stderr, "pdserve decode: %s\n", err.msg);
        rc = 1;
        goto out;
    }
    pd_startup_phase_log(LOGM, replica_id, "total to registration", t0);
    pd_hist_init(&d.step_seconds, pd_buckets_itl_s, pd_buckets_itl_n);
    if (pd_metrics_server_start(metrics_host, metrics_port, &d.metrics, &err) != PD_OK) {
        fprintf(stderr, "pdserve decode: %s\n", err.msg);
        rc = 1;
        goto out;
    }
    pd_replica_ops_attach(ops, d.metrics);
    /* Start-up (checkpoint JSON, verification, self-checks) leaves ~5 MB
     * free inside the heap; hand it back so that RSS shows what serving uses */
    malloc_trim(0);
    send_register(&d);
    send_heartbeat(&d);
    while (!g_stop) {
        pd_sched_stats st;
        pd_sched_get_stats(d.sched, &st);
        bool busy = st.num_running + st.num_waiting > 0;
        double now = pd_now_s();
        long wait_ms = busy ? 0 : (long)(d.heartbeat_ms - (now - d.last_heartbeat) * 1000.0);
        if (wait_ms < 0) wait_ms = 0;
        if (pd_kvx_agent_progress(d.agent)) wait_ms = 0;
        zmq_pollitem_t it[2] = {{d.sock, 0, ZMQ_POLLIN, 0}, {NULL, pd_kvx_agent_event_fd(d.agent), ZMQ_POLLIN, 0}};
        zmq_poll(it, 2, wait_ms);
        pd_kvx_agent_progress(d.agent);
        for (;;) {
            pd_msg msg;
            pd_status s = pd_msg_recv(d.sock, false, &msg, &err);
            if (s == PD_ERR_LIMIT) break;
            if (s != PD_OK) {
                PD_LOGW(LOGM, "dropped a message from the gateway: %s", err.msg);
                if (s == PD_ERR_IO) break;
                continue;
            }
            handle(&d, &msg);
            pd_msg_clear(&msg);
        }
        /* a request that ended on its prefilled first token (KvComplete
         * with max_tokens 1, or EOS) has no step to flush its finish */
        flush_tokens(&d);
        double t_step = pd_now_s();
        if (pd_sched_step(d.sched) > 0) {
            pd_hist_observe(&d.step_seconds, pd_now_s() - t_step);
            flush_tokens(&d);
            if (g_step_delay_ms > 0) usleep((useconds_t)g_step_delay_ms * 1000);
        }
        now = pd_now_s();
        if (pd_hb_take_reregister(d.hb)) {
            d.registered = false;
            d.last_register = 0;
        }
        if (!d.registered && now - d.last_register > 1.0)
            send_register(&d);
        if ((now - d.last_heartbeat) * 1000.0 >= d.heartbeat_ms / 4.0) {
            send_heartbeat(&d);
            expire_reservations(&d);
        }
    }
    PD_LOGI(LOGM, "%s: stopping", replica_id);
out:
    while (d.parked) {
        parked *p = d.parked;
        d.parked = p->next;
        parked_free(p);
    }
    pd_kvx_resv_free(&d.resv);
    pd_kvx_pool_free(&d.pool);
    pd_kvx_agent_free(&d.agent);
    flush_tokens(&d);
    pd_hb_stop(&d.hb);
    pd_metrics_server_stop(&d.metrics);
    pd_replica_ops_free(&ops);
    zmq_close(d.sock);
    zmq_ctx_term(d.zctx);
    pd_sched_free(&d.sched);
    pd_replay_free(&replay);
    pd_grammar_vocab_free(&d.vocab);
    pd_model_free(&d.m);
    backends_free(bes);
    return rc;
}

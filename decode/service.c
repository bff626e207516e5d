/* pdserve decode: one decode replica. A single thread alternates between
 * the control connection to the gateway (ZeroMQ DEALER) and scheduler steps;
 * generated tokens go back in one Tokens message per request per step. */
#include "pd_decode.h"

#include <string.h>
#include <unistd.h>

#include "pd_metrics.h"
#include "pd_replica.h"

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
    /* prompt logprobs of positions [plp_start, plp_start + n_plp), in order */
    int plp_start, n_plp, plp_k;
    float *plp;
    int32_t *plp_top_ids; /* [n_plp][plp_k] */
    float *plp_top_lps;
    const char *finish;
    char error[256];
    struct pending_tokens *next;
} pending_tokens;

/* A long-route request waiting for its KV: the Generate that reserved it
 * and the reservation. What the prefill replica writes into (the pool ids
 * of the reservation) belongs to the reservation table until a KvComplete
 * is accepted: the cache blocks themselves when the cache is the pool,
 * else staging slots, and then the cache blocks are the parked request's
 * (no writer can touch them). */
typedef struct parked {
    Pdserve__Generate *gen; /* owned (unpacked message) */
    uint64_t resv;
    int32_t *blocks; /* cache blocks, in token order: the prompt's and room for the first token */
    int32_t *slots;  /* with a staging pool: the slots the prompt's blocks[i] arrive in; else NULL */
    int n_blocks;
    int n_slots;     /* the prompt's blocks (<= n_blocks): what the writer writes */
    struct parked *next;
} parked;

typedef struct {
    pd_replica r; /* model, control connection, heartbeat, UCX agent and pool (common/pd_replica.h) */
    pd_sched *sched;
    pending_tokens *pend;
    parked *parked;
    pd_hist step_seconds;
    pd_kvx_reservations *resv;
    pd_kv_staging *staging; /* r.staging: prefill replicas write into its slots; NULL: into cache blocks */
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
    free(p->slots);
    free(p);
}

/* A parked request that will not run: its cache blocks go back at once
 * when it has slots (the table quarantines the slots, which writers
 * touch), else the table hands the blocks back (it copied their ids). */
static void parked_drop(decode_svc *d, parked *p) {
    if (p->slots) pd_sched_free_blocks(d->sched, p->blocks, p->n_blocks);
    parked_free(p);
}

/* Gives back the pool ids of a reservation: staging slots, or cache blocks. */
static void pool_ids_free(decode_svc *d, const int32_t *ids, int n) {
    if (d->staging) pd_kv_staging_release(d->staging, ids, n);
    else pd_sched_free_blocks(d->sched, ids, n);
}

/* The reservation table hands back a reservation's pool ids (cache blocks
 * or staging slots) once no writer can touch them. */
static void on_blocks_free(void *user, const char *request_id, uint64_t resv_id, const int32_t *blocks,
                           size_t n_blocks) {
    decode_svc *d = user;
    pool_ids_free(d, blocks, (int)n_blocks);
    PD_LOGD(LOGM, "request %s: %zu quarantined %s of reservation %llx reusable", request_id, n_blocks,
            d->staging ? "staging slots" : "blocks", (unsigned long long)resv_id);
}

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
static void cb_prompt_logprobs(void *u, const char *id, int first, int n, const float *lps, const int32_t *top_ids,
                               const float *top_lps, int k) {
    pending_tokens *p = pend_get(u, id);
    if (p->n_plp == 0) {
        p->plp_start = first;
        p->plp_k = k;
    } else if (first != p->plp_start + p->n_plp || k != p->plp_k) {
        PD_LOGE(LOGM, "request %s: prompt logprobs out of order (%d after %d)", id, first, p->plp_start + p->n_plp);
        return;
    }
    size_t m = (size_t)p->n_plp + (size_t)n;
    p->plp = xrealloc(p->plp, m * sizeof *p->plp);
    memcpy(p->plp + p->n_plp, lps, (size_t)n * sizeof *lps);
    if (k > 0) {
        p->plp_top_ids = xrealloc(p->plp_top_ids, m * (size_t)k * sizeof *p->plp_top_ids);
        p->plp_top_lps = xrealloc(p->plp_top_lps, m * (size_t)k * sizeof *p->plp_top_lps);
        memcpy(p->plp_top_ids + (size_t)p->n_plp * k, top_ids, (size_t)n * k * sizeof *top_ids);
        memcpy(p->plp_top_lps + (size_t)p->n_plp * k, top_lps, (size_t)n * k * sizeof *top_lps);
    }
    p->n_plp = (int)m;
}
static void pend_free(pending_tokens *p) {
    free(p->ids);
    free(p->logprobs);
    free(p->n_top);
    free(p->top_ids);
    free(p->top_lps);
    free(p->plp);
    free(p->plp_top_ids);
    free(p->plp_top_lps);
    free(p);
}
static void cb_finished(void *u, const char *id, const char *reason) {
    pend_get(u, id)->finish = reason;
}
static void cb_error(void *u, const char *id, const char *msg) {
    snprintf(pend_get(u, id)->error, 256, "%s", msg);
}

/* status: 503 when the prompt's KV cache did not arrive or was refused
 * (transient: the gateway answers 503 with Retry-After), else by the
 * failure (pd_replica_error_status). */
static void send_error(decode_svc *d, const char *id, int status, const char *msg) {
    pd_replica_send_error(&d->r, id, status, msg);
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
        Pdserve__TopLogprobs *ptop = NULL, **ptopp = NULL;
        if (p->n_plp > 0) {
            t.prompt_logprobs_start = (uint32_t)p->plp_start;
            t.n_prompt_logprobs = (size_t)p->n_plp;
            t.prompt_logprobs = p->plp;
            if (p->plp_k > 0) {
                ptop = pd_xmalloc((size_t)p->n_plp * sizeof *ptop);
                ptopp = pd_xmalloc((size_t)p->n_plp * sizeof *ptopp);
                for (int i = 0; i < p->n_plp; i++) {
                    pdserve__top_logprobs__init(&ptop[i]);
                    ptop[i].n_ids = ptop[i].n_logprobs = (size_t)p->plp_k;
                    ptop[i].ids = p->plp_top_ids + (size_t)i * p->plp_k;
                    ptop[i].logprobs = p->plp_top_lps + (size_t)i * p->plp_k;
                    ptopp[i] = &ptop[i];
                }
                t.n_prompt_top_logprobs = (size_t)p->n_plp;
                t.prompt_top_logprobs = ptopp;
            }
        }
        if (pd_msg_send(d->r.sock, NULL, 0, PD_MSG_TOKENS, &t.base) != PD_OK)
            PD_LOGW(LOGM, "request %s: could not send %d tokens to the gateway", p->id, p->n);
        free(topp);
        free(top);
        free(ptopp);
        free(ptop);
        pend_free(p);
    }
}

static pd_sched_request request_from(const Pdserve__Generate *g) {
    pd_sched_request r = {
        .request_id = g->request_id, .prompt_ids = g->prompt_ids, .n_prompt = (int)g->n_prompt_ids,
        .sampling = pd_replica_sampling(g->sampling), .max_tokens = (int)g->max_tokens, .min_tokens = (int)g->min_tokens,
        .ignore_eos = g->ignore_eos, .stop_token_ids = g->stop_token_ids, .n_stop_token_ids = (int)g->n_stop_token_ids,
        .want_logprobs = g->logprobs >= 0,
        /* the gateway allows at most PD_MAX_TOP_LOGPROBS; a larger ask gets that many */
        .top_logprobs = g->logprobs < 0 ? 0 : g->logprobs > PD_MAX_TOP_LOGPROBS ? PD_MAX_TOP_LOGPROBS : g->logprobs,
        .json_schema = g->json_schema,
        .want_prompt_logprobs = g->prompt_logprobs,
        .prompt_top_logprobs = g->prompt_top_logprobs > PD_MAX_TOP_LOGPROBS ? PD_MAX_TOP_LOGPROBS
                                                                             : (int)g->prompt_top_logprobs,
    };
    return r;
}

/* response_format: the vocabulary trie, built from the tokenizer at the
 * first constrained request; without it the scheduler refuses constrained
 * requests (pd_replica_vocab logs why, once). */
static void ensure_vocab(decode_svc *d, const Pdserve__Generate *g) {
    if (!g->json_schema || !*g->json_schema) return;
    const pd_grammar_vocab *v = pd_replica_vocab(&d->r);
    if (v) pd_sched_set_grammar_vocab(d->sched, v);
}

/* The decode families of the replica's /metrics, from the heartbeat's load. */
static void render_metrics(void *user, const Pdserve__Heartbeat *h, pd_strbuf *b) {
    decode_svc *d = user;
    const char *id = d->r.replica_id;
    pd_strbuf_printf(b,
                     "# TYPE pdserve:num_requests_running gauge\npdserve:num_requests_running{replica=\"%s\",role=\"decode\"} %u\n"
                     "# TYPE pdserve:num_requests_waiting gauge\npdserve:num_requests_waiting{replica=\"%s\",role=\"decode\"} %u\n"
                     "# TYPE pdserve:kv_cache_usage_perc gauge\npdserve:kv_cache_usage_perc{replica=\"%s\",role=\"decode\"} %.6f\n"
                     "# TYPE pdserve:kv_cache_free_blocks gauge\npdserve:kv_cache_free_blocks{replica=\"%s\",role=\"decode\"} %u\n"
                     "# TYPE pdserve:replica_prefill_tokens_total counter\npdserve:replica_prefill_tokens_total{replica=\"%s\",role=\"decode\"} %llu\n"
                     "# TYPE pdserve:generation_tokens_total counter\npdserve:generation_tokens_total{replica=\"%s\"} %llu\n"
                     "# TYPE pdserve:decode_step_seconds histogram\n",
                     id, h->num_running, id, h->num_waiting, id,
                     h->total_blocks ? 1.0 - (double)h->free_blocks / h->total_blocks : 0.0, id, h->free_blocks, id,
                     (unsigned long long)h->prefill_tokens_total, id, (unsigned long long)h->generation_tokens_total);
    char labels[200];
    snprintf(labels, sizeof labels, "replica=\"%s\"", id);
    pd_hist_render(&d->step_seconds, "pdserve:decode_step_seconds", labels, b);
}

static void send_heartbeat(decode_svc *d) {
    pd_sched_stats st;
    pd_sched_get_stats(d->sched, &st);
    Pdserve__Heartbeat h = PDSERVE__HEARTBEAT__INIT;
    h.num_running = (uint32_t)st.num_running;
    h.num_waiting = (uint32_t)st.num_waiting;
    h.free_blocks = (uint32_t)st.free_blocks;
    h.total_blocks = (uint32_t)st.total_blocks;
    if (d->staging) {
        h.free_staging_slots = (uint32_t)pd_kv_staging_num_free(d->staging);
        h.total_staging_slots = (uint32_t)pd_kv_staging_num_slots(d->staging);
    }
    h.tokens_in_flight = st.tokens_in_flight;
    h.prefill_tokens_total = st.prefill_tokens_total;
    h.generation_tokens_total = st.generation_tokens_total;
    pd_replica_heartbeat(&d->r, &h, render_metrics, d);
}

/* Reservations past their deadline: the request fails (its blocks stay
 * quarantined until the writer is known to be quiet). */
static void expire_reservations(decode_svc *d) {
    double now = pd_now_s();
    size_t q0 = pd_kvx_resv_stats_get(d->resv).quarantined;
    size_t n_expired = pd_kvx_resv_expire(d->resv, now);
    size_t handed = q0 + n_expired - pd_kvx_resv_stats_get(d->resv).quarantined;
    if (handed > 0) /* nobody fenced them (a grant or claim lost with the gateway) */
        PD_LOGI(LOGM, "%s: %zu reservations handed back: their writer's lease has ended", d->r.replica_id, handed);
    if (n_expired == 0) return;
    for (parked **pp = &d->parked; *pp;) {
        parked *p = *pp;
        pd_kvx_resv_state state;
        if (pd_kvx_resv_get(d->resv, p->gen->request_id, p->resv, &state, NULL, NULL) == PD_OK &&
            state == PD_KVX_RESV_EXPIRED) {
            *pp = p->next;
            send_error(d, p->gen->request_id, 503, "the prompt's KV cache did not arrive in time");
            parked_drop(d, p); /* the table keeps its own copy of the pool ids */
        } else {
            pp = &p->next;
        }
    }
}

/* A message from the gateway (pd_replica_handler; RegisterReply is the session's). */
static void handle(void *user, pd_msg *msg) {
    decode_svc *d = user;
    pd_err err = {{0}};
    switch (msg->type) {
    case PD_MSG_GENERATE: {
        Pdserve__Generate *g = (Pdserve__Generate *)msg->msg;
        ensure_vocab(d, g);
        if (!g->kv_reserved) {
            pd_sched_request r = request_from(g);
            pd_status st = pd_sched_add(d->sched, &r, &err);
            if (st != PD_OK) send_error(d, g->request_id, pd_replica_error_status(st), err.msg);
            break;
        }
        /* long route: reserve blocks (and staging slots, which the prefill
         * replica writes into) now, run when KvComplete arrives */
        Pdserve__ReserveReply rr = PDSERVE__RESERVE_REPLY__INIT;
        rr.request_id = g->request_id;
        int32_t *blocks = NULL, *slots = NULL;
        int nb = 0, ns = 0;
        uint64_t resv = 0;
        pd_status st = PD_OK;
        /* a prompt that needs more than the whole cache or the whole
         * staging pool can never be reserved here: the gateway answers 400
         * (REFUSAL_NEVER_FITS); too few free now: it queues the request
         * again (REFUSAL_NO_ROOM) */
        const pd_kv_cache *kv = pd_sched_kv(d->sched);
        const int bs = pd_kv_cache_block_size(kv);
        const int64_t need_b = ((int64_t)g->n_prompt_ids + 1 + bs - 1) / bs; /* the first token's room too */
        const int64_t need_s = d->staging ? ((int64_t)g->n_prompt_ids + bs - 1) / bs : 0; /* the prompt's */
        rr.refusal = PDSERVE__RESERVE_REFUSAL__REFUSAL_NO_ROOM;
        if (g->n_prompt_ids > 0 && need_b > pd_kv_cache_num_blocks(kv)) {
            st = pd_err_set(&err, PD_ERR_LIMIT, "prompt of %zu tokens needs %lld KV blocks of %d tokens (its first "
                            "token included); the decode replica's KV cache holds %d", g->n_prompt_ids,
                            (long long)need_b, bs, pd_kv_cache_num_blocks(kv));
            rr.refusal = PDSERVE__RESERVE_REFUSAL__REFUSAL_NEVER_FITS;
        } else if (d->staging && need_s > pd_kv_staging_num_slots(d->staging)) {
            st = pd_err_set(&err, PD_ERR_LIMIT, "prompt of %zu tokens needs %lld KV staging slots of %d tokens; the "
                            "decode replica's staging pool holds %d (--kv-staging-blocks)", g->n_prompt_ids,
                            (long long)need_s, bs, pd_kv_staging_num_slots(d->staging));
            rr.refusal = PDSERVE__RESERVE_REFUSAL__REFUSAL_NEVER_FITS;
        } else if (pd_replica_draining()) {
            /* refused as a full cache is: the gateway goes elsewhere, or waits */
            st = pd_err_set(&err, PD_ERR_LIMIT, "the decode replica is draining (shutting down): no new reservation");
            rr.refusal = PDSERVE__RESERVE_REFUSAL__REFUSAL_NO_ROOM;
        }
        if (st == PD_OK) {
            st = pd_sched_alloc_blocks(d->sched, (int)g->n_prompt_ids, &blocks, &nb, &err);
            if (st != PD_OK && st != PD_ERR_LIMIT) rr.refusal = PDSERVE__RESERVE_REFUSAL__REFUSAL_OTHER;
        }
        if (st == PD_OK && d->staging) {
            /* slots for the blocks the prefill replica writes: the prompt's
             * (the cache's reservation also holds the first token's room) */
            ns = (int)need_s;
            PD_ASSERT(ns <= nb);
            slots = pd_xmalloc((size_t)ns * sizeof *slots);
            if (pd_kv_staging_alloc(d->staging, ns, slots) != PD_OK) {
                /* refused as a full cache is: the gateway retries later */
                st = pd_err_set(&err, PD_ERR_LIMIT, "%d KV staging slots needed, %d of %d free", ns,
                                pd_kv_staging_num_free(d->staging), pd_kv_staging_num_slots(d->staging));
                pd_sched_free_blocks(d->sched, blocks, nb);
                free(blocks);
                free(slots);
                blocks = slots = NULL;
            }
        }
        /* the table guards what the writer touches: the slots, or the blocks */
        const int32_t *ids = slots ? slots : blocks;
        const int n_ids = slots ? ns : nb;
        if (st == PD_OK) {
            st = pd_kvx_resv_create(d->resv, g->request_id, writer_id(g->prefill_replica_id), ids, (size_t)n_ids,
                                    d->reservation_ttl_s, pd_now_s(), 0, &resv, &err);
            if (st != PD_OK) {
                rr.refusal = PDSERVE__RESERVE_REFUSAL__REFUSAL_OTHER;
                if (slots) pd_kv_staging_release(d->staging, slots, ns);
                pd_sched_free_blocks(d->sched, blocks, nb);
                free(blocks);
                free(slots);
                blocks = slots = NULL;
            }
        }
        uint32_t *ublocks = NULL;
        if (st == PD_OK) {
            ublocks = pd_xmalloc((size_t)n_ids * sizeof *ublocks);
            for (int i = 0; i < n_ids; i++) ublocks[i] = (uint32_t)ids[i];
            rr.ok = true;
            rr.reservation_id = resv;
            rr.block_ids = ublocks;
            rr.n_block_ids = (size_t)n_ids;
            rr.lease_ms = (uint32_t)(pd_kvx_lease_s(d->reservation_ttl_s) * 1000.0);
            parked *p = pd_xcalloc(1, sizeof *p);
            p->gen = g;
            p->resv = resv;
            p->blocks = blocks;
            p->slots = slots;
            p->n_blocks = nb;
            p->n_slots = ns;
            msg->msg = NULL; /* keep it */
            p->next = d->parked;
            d->parked = p;
            rr.refusal = PDSERVE__RESERVE_REFUSAL__REFUSAL_OTHER; /* 0: none */
        } else {
            rr.ok = false;
            rr.reason = err.msg;
        }
        rr.free_blocks = (uint32_t)pd_kv_cache_num_free(kv);
        rr.free_staging_slots = d->staging ? (uint32_t)pd_kv_staging_num_free(d->staging) : 0;
        pd_msg_send(d->r.sock, NULL, 0, PD_MSG_RESERVE_REPLY, &rr.base);
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
                send_error(d, k->request_id, 503, "the prompt's KV cache transfer was refused");
                parked_drop(d, p); /* the table hands the pool ids back (it copied them) */
            }
            break;
        }
        if (!p || k->aborted) { /* accepted but nobody to run it: give the pool ids back */
            const int32_t *bl;
            size_t nbl;
            if (pd_kvx_resv_get(d->resv, k->request_id, k->reservation_id, NULL, &bl, &nbl) == PD_OK)
                pool_ids_free(d, bl, (int)nbl);
            pd_kvx_resv_release(d->resv, k->request_id, k->reservation_id, NULL);
            if (p) parked_drop(d, p);
            break;
        }
        /* the blocks now belong to the decode sequence: from the staging
         * slots into the cache, the slots free again (without staging, to
         * the other tensor-parallel ranks' copies; a no-op with one) */
        pd_kvx_resv_release(d->resv, k->request_id, k->reservation_id, NULL);
        double tu = pd_now_s();
        pd_status su = pd_kv_cache_stage_in(pd_sched_kv(d->sched), d->staging, p->slots, p->blocks,
                                            p->slots ? p->n_slots : p->n_blocks, &err);
        if (p->slots) pd_kv_staging_release(d->staging, p->slots, p->n_slots);
        if (su != PD_OK) {
            PD_LOGW(LOGM, "request %s: %s", k->request_id, err.msg);
            send_error(d, k->request_id, 500, err.msg);
            pd_sched_free_blocks(d->sched, p->blocks, p->n_blocks);
            parked_free(p);
            break;
        }
        PD_LOGD(LOGM, "request %s: %d KV blocks from the %s into the cache in %.4f s (the prefill replica "
                "reported %.4f s from its start to the flush)", k->request_id, p->n_blocks,
                d->staging ? "staging pool" : "host cache", pd_now_s() - tu, k->transfer_seconds);
        pd_sched_request r = request_from(p->gen);
        pd_status st = pd_sched_add_prefilled(d->sched, &r, p->blocks, p->n_blocks, k->first_token, k->first_logprob,
                                              &err);
        if (st != PD_OK) {
            PD_LOGW(LOGM, "%s", err.msg);
            send_error(d, k->request_id, pd_replica_error_status(st), err.msg);
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
                parked_drop(d, p); /* the table copied the pool ids (LeakSanitizer, fault matrix) */
                break;
            }
        /* drop tokens not yet sent */
        for (pending_tokens **pp = &d->pend; *pp; pp = &(*pp)->next)
            if (!strcmp((*pp)->id, a->request_id)) {
                pending_tokens *p = *pp;
                *pp = p->next;
                pend_free(p);
                break;
            }
        break;
    }
    default:
        PD_LOGW(LOGM, "unexpected %s message from the gateway", pd_msg_type_name(msg->type));
    }
}

int pd_decode_main(int argc, char **argv) {
    int max_num_seqs = 64, max_batched = 2048, chunk = 512;
    double reservation_ttl = 120.0;
    const pd_flag own[] = {
        {"max-num-seqs", PD_FLAG_INT, &max_num_seqs, "sequences per step (default 64)"},
        {"max-num-batched-tokens", PD_FLAG_INT, &max_batched, "tokens per step (default 2048)"},
        {"chunked-prefill-size", PD_FLAG_INT, &chunk, "prefill chunk per sequence (default 512)"},
        {"kv-reservation-ttl", PD_FLAG_FLOAT, &reservation_ttl,
         "seconds a long prompt's KV reservation waits for its prefill (default 120; the prefill's lease is 3/4 of it)"},
    };
    pd_replica_args a;
    int rc = pd_replica_flags_parse("decode", &a, own, (int)(sizeof own / sizeof own[0]), argc, argv);
    if (rc >= 0) return rc;
    if (!a.model) {
        fprintf(stderr, "pdserve decode: --model is required\n");
        return 2;
    }
    if (!(reservation_ttl >= 1.0 && reservation_ttl <= 86400.0)) {
        fprintf(stderr, "pdserve decode: --kv-reservation-ttl must be 1..86400 s\n");
        return 2;
    }
    decode_svc d = {.reservation_ttl_s = reservation_ttl};
    pd_replica_init(&d.r, "decode", &a);
    const char *replica_id = d.r.replica_id;
    pd_err err = {{0}};
    pd_replay *replay = NULL;
    if ((rc = pd_replica_load(&d.r)) != 0) goto out;
    pd_sched_config sc = {max_num_seqs, max_batched, chunk, a.block_size, d.r.num_blocks, NULL};
    if (a.replay_path) {
        if (pd_replay_load(a.replay_path, pd_model_config_of(d.r.m)->vocab_size, &replay, &err) != PD_OK) {
            fprintf(stderr, "pdserve decode: --debug-replay-tokens: %s\n", err.msg);
            rc = 2;
            goto out;
        }
        sc.replay = replay;
        PD_LOGW(LOGM, "replaying %d scripted outputs from %s instead of sampling (testing)", replay->n_scripts,
                a.replay_path);
    }
    pd_sched_callbacks cb = {cb_token, cb_finished, cb_error, cb_prompt_logprobs};
    rc = 1;
    if (pd_sched_init(d.r.m, &sc, &cb, &d, &d.sched, &err) != PD_OK) {
        fprintf(stderr, "pdserve decode: %s\n", err.msg);
        goto out;
    }
    pd_replica_phase(&d.r, "allocate KV");
    /* prefill replicas write into the staging pool, or a host cache (its
     * rkey goes out with Register); KvComplete copies the blocks into the cache */
    pd_kv_cache *kv = pd_sched_kv(d.sched);
    if (pd_replica_kv_pool(&d.r, kv, true) != 0) goto out;
    d.staging = d.r.staging;
    /* a reservation nobody fenced (its grant or claim died with the
     * gateway, or its writer's flush failed) is handed back once its
     * writer's lease has ended for certain */
    pd_kvx_resv_config rcfg = {.blocks_free = on_blocks_free, .user = &d, .block_bytes = pd_kv_cache_block_bytes(kv),
                               .reclaim_after_s = pd_kvx_lease_margin_s(reservation_ttl)};
    if (pd_kvx_resv_init(&rcfg, &d.resv, &err) != PD_OK) {
        fprintf(stderr, "pdserve decode: KV transfer: %s\n", err.msg);
        goto out;
    }
    if (pd_replica_connect(&d.r) != 0) goto out;
    PD_LOGI(LOGM, "%s: model %s, %d KV blocks of %d tokens, gateway %s", replica_id, a.model, d.r.num_blocks,
            a.block_size, a.gateway);
    pd_hist_init(&d.step_seconds, pd_buckets_itl_s, pd_buckets_itl_n);
    if (pd_replica_serve(&d.r) != 0) goto out;
    send_heartbeat(&d);
    rc = 0;
    while (!pd_replica_stopping()) {
        pd_sched_stats st;
        pd_sched_get_stats(d.sched, &st);
        long wait_ms = pd_replica_wait_ms(&d.r, st.num_running + st.num_waiting > 0);
        if (pd_kvx_agent_progress(d.r.agent)) wait_ms = 0;
        pd_replica_poll(&d.r, wait_ms);
        pd_kvx_agent_progress(d.r.agent);
        pd_replica_recv_all(&d.r, handle, &d);
        /* a request that ended on its prefilled first token (KvComplete
         * with max_tokens 1, or EOS) has no step to flush its finish */
        flush_tokens(&d);
        double t_step = pd_now_s();
        if (pd_sched_step(d.sched) > 0) {
            pd_hist_observe(&d.step_seconds, pd_now_s() - t_step);
            flush_tokens(&d);
            /* --debug-step-delay-ms: fault tests slow a replica down */
            if (a.step_delay_ms > 0) usleep((useconds_t)a.step_delay_ms * 1000);
        }
        if (pd_replica_tick(&d.r)) {
            send_heartbeat(&d);
            expire_reservations(&d);
        }
        /* draining: done once nothing runs, waits, is parked or awaits its KV
         * (the counts read only then: not every step's work) */
        if (pd_replica_draining()) {
            pd_sched_get_stats(d.sched, &st);
            if (pd_replica_drained(&d.r, st.num_running + st.num_waiting == 0 && !d.parked &&
                                             pd_kvx_resv_stats_get(d.resv).live == 0))
                break;
        }
    }
    PD_LOGI(LOGM, "%s: stopping", replica_id);
    if (d.r.displaced) rc = 1;
out:
    while (d.parked) {
        parked *p = d.parked;
        d.parked = p->next;
        parked_free(p);
    }
    pd_kvx_resv_free(&d.resv);
    if (d.r.sock) flush_tokens(&d);
    pd_replica_disconnect(&d.r);
    pd_sched_free(&d.sched);
    pd_replay_free(&replay);
    pd_replica_free(&d.r);
    return rc;
}

/* The router: control plane (registration, heartbeats, expiry) and the data
 * path of each request over replicas. Runs entirely on the gateway's loop
 * thread; the ZeroMQ socket's fd is watched by libevent (ZMQ_FD is
 * edge-triggered, so every wake-up drains while ZMQ_EVENTS says POLLIN, and
 * a 20 ms timer re-checks as a safety net after sends). */
#include "pd_router.h"

#include <errno.h>
#include <event2/event.h>
#include <string.h>
#include <zmq.h>

#include "pd_metrics.h"
#include "pd_msg.h"
#include "pd_version.h"

#define LOGM "router"

enum { ROLE_PREFILL = 0, ROLE_DECODE = 1 };
/* A sub-request's state: SUB_WAITING not on any replica yet (queued, or
 * queued again after a decode replica refused its reservation for want of
 * room), SUB_RESERVING its Generate(kv_reserved) sent, SUB_PREFILLING its
 * Prefill sent, SUB_DECODING on its decode replica, SUB_DONE ended. */
enum { SUB_DECODING = 0, SUB_RESERVING, SUB_PREFILLING, SUB_DONE, SUB_WAITING };

/* After a decode replica refused a reservation for want of room, it is not
 * asked again for this long, unless a heartbeat shows more free, or a
 * request on it ends or its KV arrives, first. */
#define RESERVE_BACKOFF_S 0.25

typedef struct gw_replica {
    char id[128];
    int role;
    unsigned char env[256];
    size_t env_len;
    uint32_t block_size, num_layers, kv_lora_rank, rope_dim, dtype_bytes, num_blocks;
    unsigned char *ucx_addr, *rkey;
    size_t ucx_len, rkey_len;
    uint64_t kv_base;
    uint32_t pid; /* of the process that registered */
    Pdserve__Heartbeat hb; /* last load report (strings not kept) */
    double last_seen;
    bool alive;
    int n_assigned;
    uint64_t assigned_tokens;
    /* decode, the long route: its KV staging pool's slots (0: none; from
     * Register and heartbeats), and what the gateway believes is free for
     * reservations: the last report (heartbeat or ReserveReply) plus what
     * requests that ended or whose KV arrived since gave back; resv_* is
     * what reservations in flight (SUB_RESERVING) ask on top */
    uint32_t staging_slots;
    uint32_t free_b, free_s;
    uint64_t resv_b, resv_s;
    bool refused; /* refused a reservation for want of room: not asked until refused_until */
    double refused_until;
    uint32_t refused_free_b, refused_free_s; /* what it had free then */
    uint64_t refusals;                        /* reservations it refused for want of room */
    bool unreachable; /* a send to it failed for want of a connection (the process is gone): out at the next
                         dispatch (replica_gone), without waiting for its heartbeats to stop */
    struct gw_replica *next;
} gw_replica;

struct gw_req;
typedef struct gw_sub {
    char rid[160]; /* request id on the replicas: <request_id>-<choice>, then .<n> after its n-th re-routing */
    struct gw_req *parent;
    int choice, state;
    gw_replica *decode, *prefill;
    uint64_t reservation;
    uint64_t tokens; /* prompt + max_tokens, for load accounting */
    uint32_t need_b, need_s; /* long route: cache blocks and staging slots its reservation takes */
    bool routed;             /* counted in requests_short/long */
    bool out;                /* something of it reached the client (a token, a prompt logprob) */
    int n_rerouted;          /* times its replica was lost before it produced anything (replica_gone) */
    struct gw_sub *next_all;
} gw_sub;

enum { CLASS_SHORT = 0, CLASS_LONG = 1, N_CLASSES = 2 };
static const char *class_name[N_CLASSES] = {"short", "long"};

typedef struct gw_req {
    pd_gw_request *gw;
    const pd_gw_gen_params *p;
    gw_sub *subs;
    int n_open;
    int cls;
    bool queued;                 /* in its class queue: some subs are SUB_WAITING */
    bool counted_running;        /* counted in its class's running (some sub was sent) */
    bool counted_tokens;         /* its prompt tokens counted (first dispatch) */
    bool queue_time_noted;       /* its queue time observed (dispatch accepted) */
    int n_refused;               /* reservations refused for want of room */
    double t_arrival, t_dispatch, t_first, t_last;
    uint64_t n_generated;
    struct gw_req *qnext;
} gw_req;

/* Admission per length class: a concurrency limit, a bounded FIFO queue,
 * and the recent completion times from which Retry-After is estimated. */
#define DRAIN_WINDOW 64
typedef struct {
    int running, max_running, max_queued, queued;
    gw_req *qhead, *qtail;
    double done_at[DRAIN_WINDOW];
    int done_n, done_i;
    pd_hist ttft, itl, e2e, queue_time, prefill_time, decode_time;
    uint64_t prompt_tokens, generation_tokens;
    uint64_t finished_stop, finished_length, finished_error, finished_abort;
    uint64_t rejected_queue_full, rejected_no_replica, rejected_timeout, rejected_kv_limit;
} class_state;

struct pd_router {
    struct event_base *base;
    pd_router_config cfg;
    char endpoint[256];
    void *zctx, *sock;
    struct event *ev_fd, *ev_timer;
    gw_replica *replicas;
    gw_sub *subs; /* every live sub-request */
    pd_gw_server *gw;
    pd_router_stats stats;
    class_state cls[N_CLASSES];
    struct event *ev_dispatch;
    char model_name[256];
    uint64_t weights_ref; /* the weights every replica must have: cfg.weights_fingerprint, or the first replica's */
};

static pd_router *g_router; /* the engine context is the router itself; kept for the table */

/* ---- replicas ---- */

static gw_replica *replica_by_env(pd_router *r, const unsigned char *env, size_t n) {
    for (gw_replica *x = r->replicas; x; x = x->next)
        if (x->env_len == n && !memcmp(x->env, env, n)) return x;
    return NULL;
}

static double hb_timeout_s(const pd_router *r) {
    return 3.0 * r->cfg.heartbeat_interval_ms / 1000.0;
}

static void replica_gone(pd_router *r, gw_replica *x, const char *what, bool returns);

static void send_to(pd_router *r, gw_replica *x, pd_msg_type t, const ProtobufCMessage *m) {
    pd_status st = pd_msg_send(r->sock, x->env, x->env_len, t, m);
    if (st != PD_OK)
        PD_LOGW(LOGM, "send %s to %s failed (%s)", pd_msg_type_name(t), x->id, pd_status_str(st));
    if (st == PD_ERR_IO && x->alive && !x->unreachable) {
        /* ZMQ_ROUTER_MANDATORY: no connection to it (its process exited);
         * not PD_ERR_LIMIT, a full queue to a slow but live replica. Taken
         * out by the next dispatch, outside whatever loop sends now. */
        x->unreachable = true;
        event_active(r->ev_dispatch, 0, 0);
    }
}

static void send_abort_ex(pd_router *r, gw_replica *x, const char *rid, const char *reason, bool never_granted) {
    if (!x || !x->alive) return;
    Pdserve__Abort a = PDSERVE__ABORT__INIT;
    a.request_id = (char *)rid;
    a.reason = (char *)reason;
    a.never_granted = never_granted;
    send_to(r, x, PD_MSG_ABORT, &a.base);
}

static void send_abort(pd_router *r, gw_replica *x, const char *rid, const char *reason) {
    send_abort_ex(r, x, rid, reason, false);
}

/* Whether new work may go to x: alive, and not draining (its heartbeats
 * say it finishes what it has before it exits: Heartbeat.draining). */
static bool routable(const gw_replica *x) {
    return x->alive && !x->hb.draining && !x->unreachable;
}

static gw_replica *pick(pd_router *r, int role) {
    gw_replica *best = NULL;
    for (gw_replica *x = r->replicas; x; x = x->next) {
        if (!routable(x) || x->role != role) continue;
        if (!best || x->assigned_tokens < best->assigned_tokens ||
            (x->assigned_tokens == best->assigned_tokens && x->hb.free_blocks > best->hb.free_blocks))
            best = x;
    }
    return best;
}

/* The long route's dispatch rule (docs/architecture.md): a prefill replica
 * holds at most cfg.max_prefill_jobs_per_replica jobs (reserving, queued or
 * computing; n_assigned counts them until the KV is complete), so a job
 * waits there behind at most that many less one, and the decode
 * reservation's lease, which starts when the prefill replica receives the
 * job, never runs out in its queue. Requests beyond that wait in the
 * gateway's long queue, where only their own --request-timeout applies. */
static gw_replica *pick_prefill_with_room(pd_router *r) {
    gw_replica *best = NULL;
    for (gw_replica *x = r->replicas; x; x = x->next) {
        if (!routable(x) || x->role != ROLE_PREFILL || x->n_assigned >= r->cfg.max_prefill_jobs_per_replica) continue;
        if (!best || x->n_assigned < best->n_assigned ||
            (x->n_assigned == best->n_assigned && x->assigned_tokens < best->assigned_tokens))
            best = x;
    }
    return best;
}

/* Whether a long request of n choices may be dispatched now: free prefill
 * job slots for all of them, or (n above the slots of every alive prefill
 * replica together) every slot free. True when no prefill replica is alive
 * at all, so that dispatch fails the request at once rather than leaving it
 * queued. */
static bool prefill_has_room(pd_router *r, int n) {
    int room = 0, total = 0;
    for (gw_replica *x = r->replicas; x; x = x->next) {
        if (!routable(x) || x->role != ROLE_PREFILL) continue;
        total += r->cfg.max_prefill_jobs_per_replica;
        if (x->n_assigned < r->cfg.max_prefill_jobs_per_replica)
            room += r->cfg.max_prefill_jobs_per_replica - x->n_assigned;
    }
    if (total == 0) return true;
    return room >= (n < total ? n : total);
}

/* ---- decode capacity for the long route ---- */

static uint32_t blocks_for(const gw_replica *x, uint64_t tokens) {
    uint64_t bs = x->block_size ? x->block_size : 1;
    uint64_t n = (tokens + bs - 1) / bs;
    return n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
}

/* Cache blocks a reservation of an n-token prompt takes on decode replica
 * x: the prompt's and its first token's (decode/service.c). */
static uint32_t need_blocks(const gw_replica *x, int n_prompt) {
    return blocks_for(x, (uint64_t)n_prompt + 1);
}

/* Staging slots it takes: the prompt's blocks, or 0 without a pool. */
static uint32_t need_slots(const gw_replica *x, int n_prompt) {
    return x->staging_slots ? blocks_for(x, (uint64_t)n_prompt) : 0;
}

static uint32_t cache_blocks(const gw_replica *x) {
    return x->hb.total_blocks ? x->hb.total_blocks : x->num_blocks;
}

/* Whether an n-token prompt can ever be reserved on x (its whole cache and
 * staging pool free). */
static bool fits_ever(const gw_replica *x, int n_prompt) {
    return need_blocks(x, n_prompt) <= cache_blocks(x) &&
           (!x->staging_slots || need_slots(x, n_prompt) <= x->staging_slots);
}

/* Whether x is believed to have room for the reservation of an n-token
 * prompt now (free blocks and free slots alike, less what reservations in
 * flight ask), and did not refuse one lately. */
static bool has_room(const gw_replica *x, int n_prompt) {
    if (!routable(x) || x->role != ROLE_DECODE || x->refused || !fits_ever(x, n_prompt)) return false;
    if ((uint64_t)x->free_b < x->resv_b + need_blocks(x, n_prompt)) return false;
    return !x->staging_slots || (uint64_t)x->free_s >= x->resv_s + need_slots(x, n_prompt);
}

/* The long route's decode replica for an n-token prompt: among those with
 * room (has_room), the least loaded (tokens assigned), then the one with
 * the most free slots and blocks. NULL: none has room now. A replica with
 * free blocks but no free staging slots is never chosen. */
static gw_replica *pick_decode_with_room(pd_router *r, int n_prompt) {
    gw_replica *best = NULL;
    for (gw_replica *x = r->replicas; x; x = x->next) {
        if (!has_room(x, n_prompt)) continue;
        uint64_t xs = x->free_s - x->resv_s, bs = best ? best->free_s - best->resv_s : 0;
        uint64_t xb = x->free_b - x->resv_b, bb = best ? best->free_b - best->resv_b : 0;
        if (!best || x->assigned_tokens < best->assigned_tokens ||
            (x->assigned_tokens == best->assigned_tokens && (xs > bs || (xs == bs && xb > bb))))
            best = x;
    }
    return best;
}

/* True when decode replicas are alive and none could ever hold the
 * reservation of an n-token prompt; msg (when not NULL) then names the
 * limit, of the replica that comes closest. */
static bool never_fits(pd_router *r, int n_prompt, char *msg, size_t len) {
    gw_replica *best = NULL;
    for (gw_replica *x = r->replicas; x; x = x->next) {
        if (!routable(x) || x->role != ROLE_DECODE) continue;
        if (fits_ever(x, n_prompt)) return false;
        /* the closest: its cache holds the prompt (the staging pool is the
         * limit), then the largest cache */
        bool xc = need_blocks(x, n_prompt) <= cache_blocks(x);
        bool bc = best && need_blocks(best, n_prompt) <= cache_blocks(best);
        if (!best || (xc && !bc) || (xc == bc && cache_blocks(x) > cache_blocks(best))) best = x;
    }
    if (!best) return false;
    if (msg && need_blocks(best, n_prompt) > cache_blocks(best))
        snprintf(msg, len, "prompt of %d tokens needs %u KV blocks of %u tokens (its first token included); "
                 "the decode replica's KV cache holds %u (decode replica %s: --num-kv-blocks, "
                 "--gpu-memory-utilization)", n_prompt, need_blocks(best, n_prompt), best->block_size,
                 cache_blocks(best), best->id);
    else if (msg)
        snprintf(msg, len, "prompt of %d tokens needs %u KV staging slots (blocks of %u tokens); the decode "
                 "replica's staging pool holds %u (decode replica %s: --kv-staging-blocks)", n_prompt, need_slots(best, n_prompt),
                 best->block_size, best->staging_slots, best->id);
    return true;
}

/* Whether a long request's decode side lets it go now: a decode replica
 * has room for its prompt, or it cannot go anywhere at all (no decode
 * replica, or it never fits: dispatch then fails it at once). */
static bool decode_has_room(pd_router *r, int n_prompt) {
    return !pick(r, ROLE_DECODE) || never_fits(r, n_prompt, NULL, 0) || pick_decode_with_room(r, n_prompt);
}

/* Whether a new request of class cls, n choices and an n_prompt-token
 * prompt may be dispatched at once. */
static bool class_has_room(pd_router *r, int cls, int n, int n_prompt) {
    const class_state *c = &r->cls[cls];
    return c->running < c->max_running &&
           (cls != CLASS_LONG || (prefill_has_room(r, n) && decode_has_room(r, n_prompt)));
}

/* Choices of q not on any replica yet. */
static int n_waiting(const gw_req *q) {
    int n = 0;
    for (int i = 0; i < q->p->n; i++) n += q->subs[i].state == SUB_WAITING;
    return n;
}

/* Whether q, the head of its class queue, may be dispatched now. */
static bool head_ready(pd_router *r, const gw_req *q) {
    const class_state *c = &r->cls[q->cls];
    int n = n_waiting(q);
    if (n == 0) return true; /* its waiting choices were aborted: it only leaves the queue */
    if (!q->counted_running && c->running >= c->max_running) return false;
    return q->cls != CLASS_LONG || (prefill_has_room(r, n) && decode_has_room(r, q->p->n_prompt));
}

static void count_alive(pd_router *r) {
    int d = 0, p = 0, d_routable = 0;
    for (gw_replica *x = r->replicas; x; x = x->next) {
        if (x->alive) *(x->role == ROLE_DECODE ? &d : &p) += 1;
        if (routable(x) && x->role == ROLE_DECODE) d_routable++;
    }
    r->stats.decode_alive = d;
    r->stats.prefill_alive = p;
    /* /health: ready while a decode replica takes new work */
    if (r->gw) pd_gw_server_set_ready(r->gw, d_routable > 0);
}

/* ---- sub-requests ---- */

static gw_sub *sub_find(pd_router *r, const char *rid) {
    for (gw_sub *s = r->subs; s; s = s->next_all)
        if (!strcmp(s->rid, rid)) return s;
    return NULL;
}

/* s leaves its replicas. On the decode replica what it held frees up: its
 * reservation in flight no longer counts; the blocks of a running sequence
 * (an estimate: the prompt's and what the request generated) come back,
 * and a replica that refused a reservation may be asked again. */
static void sub_unassign(gw_sub *s) {
    gw_replica *d = s->decode;
    if (d) {
        d->n_assigned--;
        d->assigned_tokens -= s->tokens;
        if (s->state == SUB_RESERVING) {
            d->resv_b -= d->resv_b < s->need_b ? d->resv_b : s->need_b;
            d->resv_s -= d->resv_s < s->need_s ? d->resv_s : s->need_s;
        } else if (s->state == SUB_DECODING || s->state == SUB_PREFILLING) {
            const gw_req *q = s->parent;
            uint64_t gen = q->p->n > 0 ? q->n_generated / (uint64_t)q->p->n : 0;
            uint64_t fb = (uint64_t)d->free_b + blocks_for(d, (uint64_t)q->p->n_prompt + gen + 1);
            d->free_b = (uint32_t)(fb < cache_blocks(d) ? fb : cache_blocks(d));
        }
        d->refused = false;
    }
    if (s->prefill) {
        s->prefill->n_assigned--;
        s->prefill->assigned_tokens -= s->tokens;
    }
    s->decode = s->prefill = NULL;
}

static void sub_unlink(pd_router *r, gw_sub *s) {
    for (gw_sub **pp = &r->subs; *pp; pp = &(*pp)->next_all)
        if (*pp == s) {
            *pp = s->next_all;
            return;
        }
}

static void class_unqueue(class_state *c, gw_req *q) {
    gw_req **pp = &c->qhead, *prev = NULL;
    while (*pp && *pp != q) {
        prev = *pp;
        pp = &(*pp)->qnext;
    }
    if (!*pp) return;
    *pp = q->qnext;
    if (c->qtail == q) c->qtail = prev;
    c->queued--;
    q->queued = false;
}

/* Puts q in its class queue at its place by arrival (FIFO: a request
 * queued again after a refused reservation goes before later arrivals).
 * No longer counted running when none of its choices is on a replica. */
static void class_enqueue(class_state *c, gw_req *q) {
    bool active = false;
    for (int i = 0; i < q->p->n; i++)
        active |= q->subs[i].state != SUB_WAITING && q->subs[i].state != SUB_DONE;
    if (q->counted_running && !active) {
        c->running--;
        q->counted_running = false;
    }
    if (q->queued) return;
    gw_req **pp = &c->qhead;
    if (c->qtail && c->qtail->t_arrival <= q->t_arrival)
        pp = &c->qtail->qnext;
    else
        while (*pp && (*pp)->t_arrival <= q->t_arrival) pp = &(*pp)->qnext;
    q->qnext = *pp;
    *pp = q;
    if (!q->qnext) c->qtail = q;
    c->queued++;
    q->queued = true;
}

/* The request leaves its class (finished, failed or aborted): accounting,
 * metrics, and a deferred dispatch of whatever waits in the queue. */
static void req_finished(pd_router *r, gw_req *q, const char *outcome) {
    class_state *c = &r->cls[q->cls];
    double now = pd_now_s();
    if (q->queued) class_unqueue(c, q);
    if (q->counted_running) {
        q->counted_running = false;
        c->running--;
        c->done_at[c->done_i] = now;
        c->done_i = (c->done_i + 1) % DRAIN_WINDOW;
        if (c->done_n < DRAIN_WINDOW) c->done_n++;
    }
    if (!strcmp(outcome, "stop")) c->finished_stop++;
    else if (!strcmp(outcome, "length")) c->finished_length++;
    else if (!strcmp(outcome, "abort")) c->finished_abort++;
    else c->finished_error++;
    if (!strcmp(outcome, "stop") || !strcmp(outcome, "length")) {
        pd_hist_observe(&c->e2e, now - q->t_arrival);
        if (q->t_first > 0) pd_hist_observe(&c->decode_time, now - q->t_first);
        /* The replicas' share of a request, timed here around the ZMQ send of
         * its Generate / Prefill and the receipt of its Tokens; a client's
         * TTFT minus `first` is what the gateway adds (tests/load/gw_load.py). */
        if (q->t_first > 0)
            PD_LOGD(LOGM, "timing %s: queued %.6f s, dispatch->first tokens %.6f s, "
                    "dispatch->last %.6f s, %llu tokens",
                    q->p->request_id, q->t_dispatch - q->t_arrival, q->t_first - q->t_dispatch,
                    q->t_last - q->t_dispatch, (unsigned long long)q->n_generated);
    }
    event_active(r->ev_dispatch, 0, 0);
}

/* Seconds until the class queue is likely to have room, from the recent
 * completion rate (1..600). */
static int retry_after_s(const class_state *c) {
    if (c->done_n < 2) return 1;
    double oldest = 1e300, newest = 0;
    for (int i = 0; i < c->done_n; i++) {
        if (c->done_at[i] < oldest) oldest = c->done_at[i];
        if (c->done_at[i] > newest) newest = c->done_at[i];
    }
    double span = pd_now_s() - oldest;
    double rate = span > 0 ? (c->done_n - 1) / span : 0; /* completions per second */
    double wait = rate > 0 ? (c->queued + 1) / rate : 60;
    if (wait < 1) wait = 1;
    if (wait > 600) wait = 600;
    return (int)(wait + 0.999);
}

/* Frees the router's state of a request (all subs), telling replicas to
 * drop whatever they still hold. Does not touch q->gw. */
static void req_release(pd_router *r, gw_req *q, const char *reason) {
    for (int c = 0; c < q->p->n; c++) {
        gw_sub *s = &q->subs[c];
        if (s->state != SUB_DONE) {
            send_abort_ex(r, s->decode, s->rid, reason, s->state == SUB_RESERVING);
            if (s->state == SUB_PREFILLING) send_abort(r, s->prefill, s->rid, reason);
            sub_unassign(s);
            sub_unlink(r, s);
            s->state = SUB_DONE;
        }
    }
    free(q->subs);
    free(q);
}

static void fail_request(pd_router *r, gw_req *q, int status, const char *msg) {
    pd_gw_request *gw = q->gw;
    req_finished(r, q, "error");
    req_release(r, q, "failed");
    pd_gw_on_error(gw, status, msg);
}

/* One choice ended normally. */
static void finish_sub(pd_router *r, gw_sub *s, const char *reason) {
    gw_req *q = s->parent;
    sub_unassign(s);
    sub_unlink(r, s);
    s->state = SUB_DONE;
    int choice = s->choice;
    pd_gw_request *gw = q->gw;
    /* a stop string the gateway matched in this last piece ended the choice
     * first: its reason ("stop") is the request's, not the replica's */
    const char *gw_reason = pd_gw_request_choice_reason(gw, choice);
    if (--q->n_open == 0) {
        req_finished(r, q, gw_reason ? gw_reason : reason);
        free(q->subs);
        free(q);
    }
    pd_gw_on_finish(gw, choice, reason);
}

static void fill_sampling(Pdserve__SamplingParams *sp, const pd_sampling_params *p, int choice) {
    sp->temperature = p->temperature;
    sp->top_k = p->top_k;
    sp->top_p = p->top_p;
    sp->min_p = p->min_p;
    sp->presence_penalty = p->presence_penalty;
    sp->frequency_penalty = p->frequency_penalty;
    sp->repetition_penalty = p->repetition_penalty;
    sp->seed = p->seed + (uint64_t)choice; /* n > 1: independent samples, still reproducible */
    sp->has_seed = p->has_seed;
    sp->logit_bias_ids = (int32_t *)p->logit_bias_ids; /* borrowed: packed at once */
    sp->n_logit_bias_ids = (size_t)p->n_logit_bias;
    sp->logit_bias_values = (float *)p->logit_bias;
    sp->n_logit_bias_values = (size_t)p->n_logit_bias;
    sp->text_vocab_size = p->text_vocab_size > 0 ? (uint32_t)p->text_vocab_size : 0;
}

static void send_generate(pd_router *r, gw_sub *s, bool reserved) {
    const pd_gw_gen_params *p = s->parent->p;
    Pdserve__SamplingParams sp = PDSERVE__SAMPLING_PARAMS__INIT;
    fill_sampling(&sp, &p->sampling, s->choice);
    Pdserve__Generate g = PDSERVE__GENERATE__INIT;
    g.request_id = s->rid;
    g.prompt_ids = (int32_t *)p->prompt_ids;
    g.n_prompt_ids = (size_t)p->n_prompt;
    g.sampling = &sp;
    g.max_tokens = (uint32_t)p->max_tokens;
    g.min_tokens = (uint32_t)p->min_tokens;
    g.ignore_eos = p->ignore_eos;
    g.stop_token_ids = (int32_t *)p->stop_token_ids;
    g.n_stop_token_ids = (size_t)p->n_stop_token_ids;
    g.logprobs = p->logprobs;
    g.prompt_logprobs = p->prompt_logprobs && !reserved;
    g.prompt_top_logprobs = (uint32_t)(p->prompt_top_logprobs > 0 ? p->prompt_top_logprobs : 0);
    g.json_schema = p->json_schema ? (char *)p->json_schema : "";
    g.kv_reserved = reserved;
    g.prefill_replica_id = reserved && s->prefill ? s->prefill->id : "";
    send_to(r, s->decode, PD_MSG_GENERATE, &g.base);
}

/* ---- engine interface ---- */

/* Sends the waiting choices of q (SUB_WAITING) to replicas: short ones to
 * the least loaded decode replica; long ones each to a decode replica with
 * room for its reservation (pick_decode_with_room) and a prefill replica
 * with a free job slot. Returns 1 when every waiting choice was sent, 0
 * when some still wait for room (q then goes back to its place in the
 * queue), -1 (nothing sent) when the replicas it needs are gone, -2
 * (nothing sent) when no decode replica could ever hold its prompt's
 * reservation (why names the limit). */
static int dispatch(pd_router *r, gw_req *q, char *why, size_t why_len) {
    const pd_gw_gen_params *p = q->p;
    class_state *c = &r->cls[q->cls];
    /* a long request whose prefill replicas are gone or draining since it
     * was queued is prefilled on a decode replica (engine_submit's rule) */
    bool is_long = q->cls == CLASS_LONG && pick(r, ROLE_PREFILL);
    if (!pick(r, ROLE_DECODE)) return -1;
    if (is_long && never_fits(r, p->n_prompt, why, why_len)) return -2;
    q->t_dispatch = pd_now_s();
    if (!q->counted_running) {
        q->counted_running = true;
        c->running++;
    }
    if (!q->counted_tokens) {
        q->counted_tokens = true;
        c->prompt_tokens += (uint64_t)p->n_prompt * (uint64_t)p->n;
    }
    if (!is_long && !q->queue_time_noted) { /* long: when a reservation is granted */
        q->queue_time_noted = true;
        pd_hist_observe(&c->queue_time, q->t_dispatch - q->t_arrival);
    }
    int left = 0;
    for (int i = 0; i < p->n; i++) {
        gw_sub *s = &q->subs[i];
        if (s->state != SUB_WAITING) continue;
        gw_replica *d = is_long ? pick_decode_with_room(r, p->n_prompt) : pick(r, ROLE_DECODE);
        if (!d) {
            left++;
            continue;
        }
        s->decode = d;
        d->n_assigned++;
        d->assigned_tokens += s->tokens;
        s->next_all = r->subs;
        r->subs = s;
        if (!s->routed) {
            s->routed = true;
            *(is_long ? &r->stats.requests_long : &r->stats.requests_short) += 1;
        }
        if (!is_long) {
            s->state = SUB_DECODING;
            send_generate(r, s, false);
            continue;
        }
        s->state = SUB_RESERVING;
        s->need_b = need_blocks(d, p->n_prompt);
        s->need_s = need_slots(d, p->n_prompt);
        d->resv_b += s->need_b;
        d->resv_s += s->need_s;
        s->prefill = pick_prefill_with_room(r);
        if (!s->prefill) s->prefill = pick(r, ROLE_PREFILL); /* n above every slot: the rule admitted it alone */
        s->prefill->n_assigned++;
        s->prefill->assigned_tokens += s->tokens;
        send_generate(r, s, true);
    }
    return left ? 0 : 1;
}

static int engine_submit(void *engine, pd_gw_request *gwr, const pd_gw_gen_params *p) {
    pd_router *r = engine;
    /* prompt logprobs are computed by the decode replica while it prefills
     * (docs/architecture.md): such requests take the short route, whatever
     * their length */
    int cls = p->n_prompt > r->cfg.long_prompt_threshold && !p->prompt_logprobs ? CLASS_LONG : CLASS_SHORT;
    class_state *c = &r->cls[cls];
    if (!pick(r, ROLE_DECODE)) {
        c->rejected_no_replica++;
        pd_gw_submit_error(gwr, 503, 1, "no decode replica is available");
        return -1;
    }
    if (cls == CLASS_LONG && !pick(r, ROLE_PREFILL)) {
        /* no prefill replica takes work (none started, all gone or
         * draining): the decode replicas prefill it themselves, as a
         * replica without disaggregation would, rather than a 503 */
        static double warned;
        if (pd_now_s() - warned > 60.0) {
            warned = pd_now_s();
            PD_LOGW(LOGM, "no prefill replica is available: prompts over %d tokens are prefilled on the decode "
                    "replicas (said at most once a minute)", r->cfg.long_prompt_threshold);
        }
        cls = CLASS_SHORT;
        c = &r->cls[cls];
    }
    char why[512];
    if (cls == CLASS_LONG && never_fits(r, p->n_prompt, why, sizeof why)) {
        c->rejected_kv_limit++;
        pd_gw_submit_error(gwr, 400, 0, why);
        return -1;
    }
    bool room = class_has_room(r, cls, p->n, p->n_prompt);
    if (!room && c->queued >= c->max_queued) {
        char msg[256];
        snprintf(msg, sizeof msg, "too many %s requests: %d running and %d queued (--max-queued-requests-%s %d)",
                 class_name[cls], c->running, c->queued, class_name[cls], c->max_queued);
        c->rejected_queue_full++;
        pd_gw_submit_error(gwr, 429, retry_after_s(c), msg);
        return -1;
    }
    gw_req *q = pd_xcalloc(1, sizeof *q);
    q->gw = gwr;
    q->p = p;
    q->cls = cls;
    q->n_open = p->n;
    q->t_arrival = pd_now_s();
    q->subs = pd_xcalloc((size_t)p->n, sizeof *q->subs);
    for (int i = 0; i < p->n; i++) {
        gw_sub *s = &q->subs[i];
        snprintf(s->rid, sizeof s->rid, "%s-%d", p->request_id, i);
        s->parent = q;
        s->choice = i;
        s->state = SUB_WAITING; /* not on any replica yet */
        s->tokens = (uint64_t)p->n_prompt + (uint64_t)p->max_tokens;
    }
    pd_gw_request_set_engine_data(gwr, q);
    /* replicas and the prompt's size were checked above: dispatch returns
     * 0 or 1 (0: some choices wait for a decode replica's room) */
    if (!(room && !c->qhead) || dispatch(r, q, why, sizeof why) == 0) class_enqueue(c, q);
    return 0;
}

/* Deferred: start queued requests where their class has room; fail those
 * whose replicas vanished, whose prompt no decode replica can hold, or
 * whose deadline passed (--request-timeout from arrival, --queue-timeout
 * waiting in the queue: 503 with Retry-After). */
static void on_dispatch(evutil_socket_t fd, short what, void *arg) {
    pd_router *r = arg;
    for (gw_replica *x = r->replicas; x; x = x->next)
        if (x->alive && x->unreachable) {
            PD_LOGW(LOGM, "replica %s cannot be reached (its connection is gone): out of rotation", x->id);
            replica_gone(r, x, "cannot be reached", false);
        }
    double now = pd_now_s();
    for (int k = 0; k < N_CLASSES; k++) {
        class_state *c = &r->cls[k];
        /* deadlines of queued requests */
        for (gw_req *q = c->qhead; q;) {
            gw_req *next = q->qnext;
            double waited = now - q->t_arrival;
            bool rt = r->cfg.request_timeout_s > 0 && waited > r->cfg.request_timeout_s;
            bool qt = r->cfg.queue_timeout_s > 0 && waited > r->cfg.queue_timeout_s;
            if (rt || qt) {
                char msg[300];
                if (rt)
                    snprintf(msg, sizeof msg, "request waited %.1f s in the %s queue (--request-timeout %g s)",
                             waited, class_name[k], r->cfg.request_timeout_s);
                else
                    snprintf(msg, sizeof msg, "request waited %.1f s in the %s queue%s (--queue-timeout %g s)",
                             waited, class_name[k],
                             q->n_refused ? " for KV capacity on the decode replicas" : "",
                             r->cfg.queue_timeout_s);
                c->rejected_timeout++;
                pd_gw_request *gw = q->gw;
                req_finished(r, q, "timeout");
                int ra = retry_after_s(c);
                req_release(r, q, "timed out");
                pd_gw_on_error_retry(gw, 503, ra, msg);
            }
            q = next;
        }
        while (c->qhead && head_ready(r, c->qhead)) {
            gw_req *q = c->qhead;
            class_unqueue(c, q);
            char why[512];
            int rc = dispatch(r, q, why, sizeof why);
            if (rc < 0) {
                pd_gw_request *gw = q->gw;
                if (rc == -2) c->rejected_kv_limit++;
                req_finished(r, q, "error");
                req_release(r, q, "failed");
                pd_gw_on_error(gw, rc == -2 ? 400 : 503,
                               rc == -2 ? why : "no replica is available for this request any more");
            } else if (rc == 0) {
                class_enqueue(c, q); /* back at the head: later long requests wait behind it */
                break;
            }
        }
    }
}

static void engine_abort(void *engine, pd_gw_request *gwr) {
    pd_router *r = engine;
    gw_req *q = pd_gw_request_engine_data(gwr);
    if (q) {
        /* stop strings ended it: a success ("stop"), timed like one */
        bool stopped = pd_gw_request_stopped(gwr);
        req_finished(r, q, stopped ? "stop" : "abort");
        req_release(r, q, stopped ? "stop string" : "client went away");
    }
}

/* n > 1: one choice ended on a stop string; stop its sequence on the
 * replicas. When it was the last open choice the gateway calls abort
 * instead, so q stays alive here. */
static void engine_abort_choice(void *engine, pd_gw_request *gwr, int choice) {
    pd_router *r = engine;
    gw_req *q = pd_gw_request_engine_data(gwr);
    if (!q || choice < 0 || choice >= q->p->n) return;
    gw_sub *s = &q->subs[choice];
    if (s->state == SUB_DONE) return;
    send_abort_ex(r, s->decode, s->rid, "stop string", s->state == SUB_RESERVING);
    if (s->state == SUB_PREFILLING) send_abort(r, s->prefill, s->rid, "stop string");
    sub_unassign(s);
    sub_unlink(r, s);
    s->state = SUB_DONE;
    q->n_open--;
    event_active(r->ev_dispatch, 0, 0); /* a prefill job slot may have freed */
}

static const pd_gw_engine_i router_engine = {engine_submit, engine_abort};
const pd_gw_engine_i *pd_router_engine(void) {
    return &router_engine;
}

/* ---- control messages ---- */

static void on_register(pd_router *r, pd_msg *m) {
    Pdserve__Register *g = (Pdserve__Register *)m->msg;
    Pdserve__RegisterReply rep = PDSERVE__REGISTER_REPLY__INIT;
    rep.heartbeat_interval_ms = (uint32_t)r->cfg.heartbeat_interval_ms;
    char reason[256] = "";
    int role = !strcmp(g->role, "decode") ? ROLE_DECODE : !strcmp(g->role, "prefill") ? ROLE_PREFILL : -1;
    if (role < 0)
        snprintf(reason, sizeof reason, "unknown role '%s'", g->role);
    else if (g->model_fingerprint != r->cfg.model_fingerprint)
        snprintf(reason, sizeof reason, "model fingerprint %016llx differs from the gateway's %016llx",
                 (unsigned long long)g->model_fingerprint, (unsigned long long)r->cfg.model_fingerprint);
    else if (g->weights_fingerprint && r->weights_ref && g->weights_fingerprint != r->weights_ref)
        snprintf(reason, sizeof reason, "weights fingerprint %016llx differs from %s's %016llx: another checkpoint of "
                 "the same architecture (serve one checkpoint per gateway)", (unsigned long long)g->weights_fingerprint,
                 r->cfg.weights_fingerprint ? "the gateway's --model" : "the first replica",
                 (unsigned long long)r->weights_ref);
    else if (!g->geometry)
        snprintf(reason, sizeof reason, "no KV geometry");
    else if (r->cfg.block_size && g->geometry->block_size != (uint32_t)r->cfg.block_size)
        snprintf(reason, sizeof reason, "KV geometry: block size %u, the deployment uses %d", g->geometry->block_size,
                 r->cfg.block_size);
    /* every replica of the deployment must agree on the block layout */
    if (!reason[0])
        for (gw_replica *x = r->replicas; x; x = x->next)
            if (x->alive && !(x->env_len == m->envelope_len && !memcmp(x->env, m->envelope, x->env_len)) &&
                (x->block_size != g->geometry->block_size || x->num_layers != g->geometry->num_layers ||
                             x->kv_lora_rank != g->geometry->kv_lora_rank))
                snprintf(reason, sizeof reason, "KV geometry differs from replica %s", x->id);
    gw_replica *x = replica_by_env(r, m->envelope, m->envelope_len);
    if (reason[0]) {
        rep.accepted = false;
        rep.reason = reason;
        PD_LOGW(LOGM, "refused %s replica %s: %s", g->role, g->replica_id, reason);
        pd_msg_send(r->sock, m->envelope, m->envelope_len, PD_MSG_REGISTER_REPLY, &rep.base);
        return;
    }
    /* the same process registering while registered: it resent a Register
     * that was slow to be answered (the gateway was starting); another
     * process under a registered id (another pid or UCX worker address: in
     * a container the pid can repeat) restarted before its heartbeats were
     * missed, and what the old one held is gone with it */
    bool same = x && x->pid == g->pid && x->ucx_len == g->ucx_worker_address.len &&
                (!x->ucx_len || !memcmp(x->ucx_addr, g->ucx_worker_address.data, x->ucx_len));
    if (x && x->alive && !same) {
        PD_LOGW(LOGM, "%s replica %s restarted (pid %u, was %u): its requests fail", g->role, x->id, g->pid, x->pid);
        replica_gone(r, x, "restarted", true); /* the new process takes its place */
    }
    bool again = x && x->alive && g->pid && same;
    if (!x) {
        x = pd_xcalloc(1, sizeof *x);
        memcpy(x->env, m->envelope, m->envelope_len);
        x->env_len = m->envelope_len;
        x->next = r->replicas;
        r->replicas = x;
    }
    snprintf(x->id, sizeof x->id, "%s", g->replica_id);
    x->role = role;
    x->block_size = g->geometry->block_size;
    x->num_layers = g->geometry->num_layers;
    x->kv_lora_rank = g->geometry->kv_lora_rank;
    x->rope_dim = g->geometry->qk_rope_head_dim;
    x->dtype_bytes = g->geometry->dtype_bytes;
    x->num_blocks = g->geometry->num_blocks;
    free(x->ucx_addr);
    free(x->rkey);
    x->ucx_addr = g->ucx_worker_address.len ? pd_xmalloc(g->ucx_worker_address.len) : NULL;
    if (x->ucx_addr) memcpy(x->ucx_addr, g->ucx_worker_address.data, g->ucx_worker_address.len);
    x->ucx_len = g->ucx_worker_address.len;
    x->rkey = g->kv_rkey.len ? pd_xmalloc(g->kv_rkey.len) : NULL;
    if (x->rkey) memcpy(x->rkey, g->kv_rkey.data, g->kv_rkey.len);
    x->rkey_len = g->kv_rkey.len;
    x->kv_base = g->kv_base;
    x->pid = g->pid;
    x->hb.free_blocks = g->geometry->num_blocks;
    x->staging_slots = g->kv_staging_slots;
    if (!again) { /* a new process: nothing reserved on it, everything free */
        x->free_b = g->geometry->num_blocks;
        x->free_s = g->kv_staging_slots;
        x->resv_b = x->resv_s = 0;
        x->refused = false;
    }
    x->last_seen = pd_now_s();
    x->alive = true;
    x->unreachable = false;
    if (!r->weights_ref) r->weights_ref = g->weights_fingerprint; /* no checkpoint read here: the first one's */
    rep.accepted = true;
    event_active(r->ev_dispatch, 0, 0); /* new room for queued requests */
    pd_msg_send(r->sock, m->envelope, m->envelope_len, PD_MSG_REGISTER_REPLY, &rep.base);
    if (again)
        PD_LOGD(LOGM, "%s replica %s registered again (a resent Register, pid %u)", g->role, x->id, g->pid);
    else
        PD_LOGI(LOGM, "%s replica %s registered (pid %u, %u KV blocks of %u tokens, %u KV staging slots)", g->role,
                x->id, g->pid, x->num_blocks, x->block_size, x->staging_slots);
    count_alive(r);
}

/* Heartbeats come from each replica's heartbeat thread (its own socket),
 * named by replica_id. */
static void on_heartbeat(pd_router *r, pd_msg *m) {
    Pdserve__Heartbeat *h = (Pdserve__Heartbeat *)m->msg;
    gw_replica *x = NULL;
    for (gw_replica *y = r->replicas; y; y = y->next)
        if (h->replica_id && !strcmp(y->id, h->replica_id)) x = y;
    if (!x || !x->alive) {
        /* unknown (the gateway restarted, or it was declared dead): ask it to register again */
        Pdserve__RegisterReply rep = PDSERVE__REGISTER_REPLY__INIT;
        rep.accepted = false;
        rep.reason = "unknown replica: register again";
        rep.heartbeat_registration = h->registration;
        pd_msg_send(r->sock, m->envelope, m->envelope_len, PD_MSG_REGISTER_REPLY, &rep.base);
        return;
    }
    if (h->pid && x->pid && h->pid != x->pid) {
        /* another process's: one not registered yet (registration 0: its
         * Register is on the way, and takes the id over) is only not
         * counted; one registered before whose id another process has
         * registered since would count as that one: it stops instead of
         * running on unused */
        if (!h->registration) return;
        Pdserve__RegisterReply rep = PDSERVE__REGISTER_REPLY__INIT;
        char reason[256];
        snprintf(reason, sizeof reason, "replica id %s is registered by another process (pid %u) since", x->id,
                 x->pid);
        rep.accepted = false;
        rep.displaced = true;
        rep.reason = reason;
        rep.heartbeat_registration = h->registration;
        PD_LOGW(LOGM, "a heartbeat for %s from pid %u, which pid %u has replaced: told to stop", x->id, h->pid, x->pid);
        pd_msg_send(r->sock, m->envelope, m->envelope_len, PD_MSG_REGISTER_REPLY, &rep.base);
        return;
    }
    const bool was_draining = x->hb.draining;
    x->hb = *h;
    x->hb.replica_id = NULL;
    x->hb.base.unknown_fields = NULL;
    x->hb.base.n_unknown_fields = 0;
    x->last_seen = pd_now_s();
    if (h->draining != was_draining) {
        if (h->draining)
            PD_LOGI(LOGM, "replica %s is draining: nothing new is routed to it; it finishes what it has", x->id);
        count_alive(r);
    }
    if (x->role == ROLE_DECODE) {
        x->free_b = h->free_blocks;
        x->free_s = h->free_staging_slots;
        x->staging_slots = h->total_staging_slots;
        if (x->refused && (h->free_blocks > x->refused_free_b || h->free_staging_slots > x->refused_free_s))
            x->refused = false;
        if (r->cls[CLASS_LONG].qhead) event_active(r->ev_dispatch, 0, 0); /* room may have freed */
    }
}

/* TTFT (arrival to first token), prefill time (dispatch to first token),
 * inter-token latency (per token, from the batch it arrived in). */
static void note_tokens(pd_router *r, gw_req *q, int n) {
    if (n <= 0) return;
    class_state *c = &r->cls[q->cls];
    double now = pd_now_s();
    if (q->t_first == 0) {
        q->t_first = now;
        pd_hist_observe(&c->ttft, now - q->t_arrival);
        pd_hist_observe(&c->prefill_time, now - q->t_dispatch);
        for (int i = 1; i < n; i++) pd_hist_observe(&c->itl, 0.0);
    } else {
        double per = (now - q->t_last) / n;
        for (int i = 0; i < n; i++) pd_hist_observe(&c->itl, per);
    }
    q->t_last = now;
    q->n_generated += (uint64_t)n;
    c->generation_tokens += (uint64_t)n;
}

/* The alternatives of n tokens from a replica (validated, not trusted) as
 * the row-major arrays of pd_gw_on_tokens_top: returns k, the fewest that
 * any token has, at most want (the request's logprobs); 0 when they are
 * absent or malformed (one entry per token, ids and logprobs alike).
 * *ids_p and *lps_p are heap arrays of n * k (caller frees) when k > 0. */
static int top_flatten(Pdserve__TopLogprobs *const *top, size_t n_top, size_t n, int want, int32_t **ids_p,
                       float **lps_p) {
    if (want <= 0 || n == 0 || n_top != n) return 0;
    size_t k = (size_t)(want < PD_MAX_TOP_LOGPROBS ? want : PD_MAX_TOP_LOGPROBS);
    for (size_t i = 0; i < n; i++) {
        if (!top[i] || top[i]->n_ids != top[i]->n_logprobs) return 0;
        if (top[i]->n_ids < k) k = top[i]->n_ids;
    }
    if (k == 0) return 0;
    int32_t *ids = pd_xmalloc(n * k * sizeof *ids);
    float *lps = pd_xmalloc(n * k * sizeof *lps);
    for (size_t i = 0; i < n; i++) {
        memcpy(ids + i * k, top[i]->ids, k * sizeof *ids);
        memcpy(lps + i * k, top[i]->logprobs, k * sizeof *lps);
    }
    *ids_p = ids;
    *lps_p = lps;
    return (int)k;
}

static void on_tokens(pd_router *r, pd_msg *m) {
    Pdserve__Tokens *t = (Pdserve__Tokens *)m->msg;
    gw_sub *s = sub_find(r, t->request_id);
    if (!s) return; /* aborted meanwhile */
    gw_req *q = s->parent;
    if (t->error && t->error[0]) {
        /* named after the replica that sent it: a prefill replica reports
         * its own failures (e.g. the KV transfer) of a long request */
        gw_replica *from = replica_by_env(r, m->envelope, m->envelope_len);
        char msg[512];
        snprintf(msg, sizeof msg, "replica %s: %s", from ? from->id : s->decode ? s->decode->id : "?", t->error);
        /* the status the replica asked for (Tokens.error_status): 503 for a
         * transient failure, answered with Retry-After; 400 for the request */
        const uint32_t es = t->error_status;
        fail_request(r, q, es == 400 || es == 503 ? (int)es : 500, msg);
        return;
    }
    if (t->n_ids > 0 || t->n_prompt_logprobs > 0) s->out = true;
    if (t->n_prompt_logprobs > 0 && q->p->prompt_logprobs) {
        int32_t *top_ids = NULL;
        float *top_lps = NULL;
        int k = top_flatten(t->prompt_top_logprobs, t->n_prompt_top_logprobs, t->n_prompt_logprobs,
                            q->p->prompt_top_logprobs, &top_ids, &top_lps);
        if (t->prompt_logprobs_start >= 1 && t->n_prompt_logprobs <= (size_t)q->p->n_prompt &&
            t->prompt_logprobs_start <= (size_t)q->p->n_prompt - t->n_prompt_logprobs)
            pd_gw_on_prompt_logprobs(q->gw, s->choice, (int)t->prompt_logprobs_start, (int)t->n_prompt_logprobs,
                                     t->prompt_logprobs, top_ids, top_lps, k);
        else
            PD_LOGW(LOGM, "%s: prompt logprobs of positions %u + %zu outside the prompt (%d); dropped", s->rid,
                    t->prompt_logprobs_start, t->n_prompt_logprobs, q->p->n_prompt);
        free(top_ids);
        free(top_lps);
    }
    if (t->n_ids > 0) {
        note_tokens(r, q, (int)t->n_ids);
        int32_t *top_ids = NULL;
        float *top_lps = NULL;
        int k = top_flatten(t->top_logprobs, t->n_top_logprobs, t->n_ids, q->p->logprobs, &top_ids, &top_lps);
        pd_gw_on_tokens_top(q->gw, s->choice, t->ids, t->n_logprobs == t->n_ids ? t->logprobs : NULL, top_ids,
                            top_lps, k, (int)t->n_ids);
        free(top_ids);
        free(top_lps);
    }
    /* pd_gw_on_finish keeps the reason's pointer until the response is
     * written, after this message is freed: pass static strings only (a
     * replica's own string was a use-after-free; found by fuzz_msg) */
    if (t->finished)
        finish_sub(r, s, t->finish_reason && !strcmp(t->finish_reason, "length") ? "length" : "stop");
}

static void on_reserve_reply(pd_router *r, pd_msg *m) {
    Pdserve__ReserveReply *rr = (Pdserve__ReserveReply *)m->msg;
    gw_sub *s = sub_find(r, rr->request_id);
    if (!s || s->state != SUB_RESERVING) {
        if (rr->ok) { /* nobody wants it any more: give the blocks back */
            /* also to a replica out of rotation or not registered (yet):
             * one that stalled past its heartbeats, or that answers a
             * gateway that restarted, still holds the reservation */
            Pdserve__Abort a = PDSERVE__ABORT__INIT;
            a.request_id = rr->request_id;
            a.reason = "no longer wanted";
            a.never_granted = true;
            pd_msg_send(r->sock, m->envelope, m->envelope_len, PD_MSG_ABORT, &a.base); /* to the sender */
        }
        return;
    }
    gw_replica *d = s->decode;
    gw_req *q = s->parent;
    if (d) { /* its freshest count of free blocks and slots */
        d->free_b = rr->free_blocks;
        d->free_s = rr->free_staging_slots;
    }
    if (!rr->ok && rr->refusal == PDSERVE__RESERVE_REFUSAL__REFUSAL_NO_ROOM && d) {
        /* not an error: the choice waits in the long queue again, at its
         * place, for a decode replica with room; this one is not asked
         * again until something on it frees up or RESERVE_BACKOFF_S
         * (flagged after sub_unassign, which clears the flag: the
         * request's own reservation leaving is not room freeing up) */
        PD_LOGD(LOGM, "%s: decode replica %s has no room (%s): queued again", s->rid, d->id, rr->reason);
        sub_unassign(s);
        d->refusals++;
        d->refused = true;
        d->refused_until = pd_now_s() + RESERVE_BACKOFF_S;
        d->refused_free_b = rr->free_blocks;
        d->refused_free_s = rr->free_staging_slots;
        sub_unlink(r, s);
        s->state = SUB_WAITING;
        q->n_refused++;
        class_enqueue(&r->cls[q->cls], q);
        event_active(r->ev_dispatch, 0, 0);
        return;
    }
    if (!rr->ok) {
        /* a prompt that can never be reserved there is the request's
         * fault (400); anything else fails it as before */
        bool never = rr->refusal == PDSERVE__RESERVE_REFUSAL__REFUSAL_NEVER_FITS;
        char msg[512];
        snprintf(msg, sizeof msg, "%s decode replica %s: %s", never ? "KV capacity of" : "no KV capacity on",
                 d ? d->id : "?", rr->reason);
        if (never) r->cls[q->cls].rejected_kv_limit++;
        fail_request(r, q, never ? 400 : 503, msg);
        return;
    }
    if (d) {
        d->resv_b -= d->resv_b < s->need_b ? d->resv_b : s->need_b;
        d->resv_s -= d->resv_s < s->need_s ? d->resv_s : s->need_s;
    }
    if (!q->queue_time_noted) {
        q->queue_time_noted = true;
        pd_hist_observe(&r->cls[q->cls].queue_time, pd_now_s() - q->t_arrival);
    }
    gw_replica *pf = s->prefill;
    if (!pf || !pf->alive) {
        fail_request(r, s->parent, 503, "the prefill replica went away");
        return;
    }
    s->reservation = rr->reservation_id;
    s->state = SUB_PREFILLING;
    const pd_gw_gen_params *p = s->parent->p;
    Pdserve__SamplingParams sp = PDSERVE__SAMPLING_PARAMS__INIT;
    fill_sampling(&sp, &p->sampling, s->choice);
    Pdserve__Prefill pm = PDSERVE__PREFILL__INIT;
    pm.request_id = s->rid;
    pm.prompt_ids = (int32_t *)p->prompt_ids;
    pm.n_prompt_ids = (size_t)p->n_prompt;
    pm.sampling = &sp;
    pm.decode_replica_id = s->decode->id;
    pm.reservation_id = rr->reservation_id;
    pm.block_ids = rr->block_ids;
    pm.n_block_ids = rr->n_block_ids;
    pm.lease_ms = rr->lease_ms; /* sent at once: no time to take off */
    pm.decode_ucx_address.data = s->decode->ucx_addr;
    pm.decode_ucx_address.len = s->decode->ucx_len;
    pm.decode_kv_rkey.data = s->decode->rkey;
    pm.decode_kv_rkey.len = s->decode->rkey_len;
    pm.decode_kv_base = s->decode->kv_base;
    pm.logprobs = p->logprobs;
    pm.min_tokens = (uint32_t)p->min_tokens;
    pm.ignore_eos = p->ignore_eos;
    pm.stop_token_ids = (int32_t *)p->stop_token_ids;
    pm.n_stop_token_ids = (size_t)p->n_stop_token_ids;
    pm.json_schema = p->json_schema ? (char *)p->json_schema : "";
    send_to(r, pf, PD_MSG_PREFILL, &pm.base);
}

static void on_kv_complete(pd_router *r, pd_msg *m) {
    Pdserve__KvComplete *k = (Pdserve__KvComplete *)m->msg;
    gw_sub *s = sub_find(r, k->request_id);
    if (!s || s->state != SUB_PREFILLING || s->reservation != k->reservation_id || k->aborted) {
        /* nobody waits for it, but the decode replica must hear it: the
         * writes are flushed, so its quarantined blocks may be reused. Also
         * when it is out of rotation: a replica that stalled past its
         * heartbeats and resumes still holds the reservation, and nothing
         * else ever releases it (fault matrix: stop-decode mid-prefill) */
        gw_replica *d = NULL;
        for (gw_replica *x = r->replicas; x && k->decode_replica_id; x = x->next)
            if (!strcmp(x->id, k->decode_replica_id) && (!d || x->alive)) d = x;
        k->aborted = true;
        if (d) {
            send_to(r, d, PD_MSG_KV_COMPLETE, &k->base);
        } else if (k->decode_replica_id && k->decode_replica_id[0]) {
            /* not registered (yet): a restarted gateway first hears what
             * replicas queued while it was down. A replica's control
             * socket is named by its replica id (ZMQ_ROUTING_ID). */
            pd_status st = pd_msg_send(r->sock, k->decode_replica_id, strlen(k->decode_replica_id),
                                       PD_MSG_KV_COMPLETE, &k->base);
            if (st != PD_OK)
                PD_LOGW(LOGM, "KvComplete of %s for unregistered decode replica %s lost (%s)", k->request_id,
                        k->decode_replica_id, pd_status_str(st));
        }
        return;
    }
    if (s->prefill) {
        s->prefill->n_assigned--;
        s->prefill->assigned_tokens -= s->tokens;
        s->prefill = NULL;
        event_active(r->ev_dispatch, 0, 0); /* its job slot is free: queued long requests may go */
    }
    s->state = SUB_DECODING;
    s->out = true; /* the first token goes to the client below */
    if (s->decode) { /* it copies the KV out of its staging slots and frees them */
        gw_replica *d = s->decode;
        uint64_t fs = (uint64_t)d->free_s + s->need_s;
        d->free_s = (uint32_t)(fs < d->staging_slots ? fs : d->staging_slots);
        d->refused = false;
    }
    r->stats.kv_bytes_transferred += k->kv_bytes;
    r->stats.kv_transfer_seconds += k->transfer_seconds;
    send_to(r, s->decode, PD_MSG_KV_COMPLETE, &k->base);
    float lp = k->first_logprob;
    note_tokens(r, s->parent, 1);
    int32_t *top_ids = NULL;
    float *top_lps = NULL;
    Pdserve__TopLogprobs *const top[1] = {k->first_top_logprobs};
    int n_top = top_flatten(top, top[0] ? 1 : 0, 1, s->parent->p->logprobs, &top_ids, &top_lps);
    pd_gw_on_tokens_top(s->parent->gw, s->choice, &k->first_token, &lp, top_ids, top_lps, n_top, 1);
    free(top_ids);
    free(top_lps);
}

static void on_prefill_error(pd_router *r, pd_msg *m) {
    /* Tokens with an error from a prefill replica share on_tokens */
    on_tokens(r, m);
}

static void drain(pd_router *r) {
    for (;;) {
        int events = 0;
        size_t len = sizeof events;
        if (zmq_getsockopt(r->sock, ZMQ_EVENTS, &events, &len) != 0 || !(events & ZMQ_POLLIN)) return;
        pd_msg m;
        pd_err err = {{0}};
        pd_status st = pd_msg_recv(r->sock, true, &m, &err);
        if (st == PD_ERR_LIMIT) return;
        if (st != PD_OK) {
            PD_LOGW(LOGM, "dropped a malformed control message: %s", err.msg);
            continue;
        }
        gw_replica *x = replica_by_env(r, m.envelope, m.envelope_len);
        if (x) x->last_seen = pd_now_s();
        switch (m.type) {
        case PD_MSG_REGISTER: on_register(r, &m); break;
        case PD_MSG_HEARTBEAT: on_heartbeat(r, &m); break;
        case PD_MSG_TOKENS:
            if (x && x->role == ROLE_PREFILL) on_prefill_error(r, &m);
            else on_tokens(r, &m);
            break;
        case PD_MSG_RESERVE_REPLY: on_reserve_reply(r, &m); break;
        case PD_MSG_KV_COMPLETE: on_kv_complete(r, &m); break;
        default: PD_LOGW(LOGM, "unexpected %s on the control socket", pd_msg_type_name(m.type));
        }
        pd_msg_clear(&m);
    }
}

/* Takes replica x out of rotation. A choice it held that produced nothing
 * a client saw is routed again when some decode replica takes work, or x
 * returns (returns: another process takes its place at once, a restart);
 * every other request it holds fails with 503 "<role> replica <id> <what>"
 * (streams get an in-band error event). When it was a prefill replica the
 * decode replicas hear that its writes will never come (their reservations
 * for it can be reused). */
static void replica_gone(pd_router *r, gw_replica *x, const char *what, bool returns) {
    x->alive = false;
    for (gw_sub *s = r->subs; s;) {
        gw_sub *next = s->next_all;
        if ((s->decode == x || s->prefill == x) && !s->out && s->n_rerouted < 3 &&
            (returns || pick(r, ROLE_DECODE)) && /* x is no longer alive: another one */
            (s->state == SUB_DECODING || s->state == SUB_RESERVING || s->state == SUB_PREFILLING)) {
            /* a choice that produced nothing a client saw (the short route;
             * or the long one before its KV landed: KvComplete delivers the
             * first token) loses nothing by starting again: the other
             * replica it was on drops it (as req_release tells it), and it
             * waits again, at its place, for replicas that take work */
            gw_req *q = s->parent;
            PD_LOGI(LOGM, "%s: %s replica %s %s before it produced anything: routed again", s->rid,
                    x->role == ROLE_DECODE ? "decode" : "prefill", x->id, what);
            if (s->decode == x) s->decode = NULL; /* nothing to abort on x, whose counts are reset below */
            if (s->prefill == x) s->prefill = NULL;
            send_abort_ex(r, s->decode, s->rid, "routed again", s->state == SUB_RESERVING);
            if (s->state == SUB_PREFILLING) send_abort(r, s->prefill, s->rid, "routed again");
            sub_unassign(s);
            s->n_rerouted++;
            /* a new id on the replicas: a late message about the old attempt
             * (a ReserveReply, an Abort the replica answers) must not reach
             * the new one (a stale Abort cut it: found by the ASan CI run) */
            snprintf(s->rid, sizeof s->rid, "%s-%d.%d", q->p->request_id, s->choice, s->n_rerouted);
            sub_unlink(r, s);
            s->state = SUB_WAITING;
            class_enqueue(&r->cls[q->cls], q);
            event_active(r->ev_dispatch, 0, 0);
            s = next;
            continue;
        }
        if (s->decode == x || s->prefill == x) {
            char msg[256];
            snprintf(msg, sizeof msg, "%s replica %s %s", x->role == ROLE_DECODE ? "decode" : "prefill", x->id,
                     what);
            if (s->decode == x) s->decode = NULL; /* do not send it aborts */
            if (s->prefill == x) s->prefill = NULL;
            gw_req *q = s->parent;
            /* failing q removes all of its subs from the list: restart the scan */
            fail_request(r, q, 503, msg);
            next = r->subs;
        }
        s = next;
    }
    x->n_assigned = 0;
    x->assigned_tokens = 0;
    x->resv_b = x->resv_s = 0;
    if (x->role == ROLE_PREFILL) /* decode replicas may reuse blocks it was granted */
        for (gw_replica *d = r->replicas; d; d = d->next)
            if (d->alive && d->role == ROLE_DECODE) {
                Pdserve__Abort a = PDSERVE__ABORT__INIT;
                a.request_id = "";
                a.reason = "prefill replica gone";
                a.writer_gone = x->id;
                send_to(r, d, PD_MSG_ABORT, &a.base);
            }
    count_alive(r);
}

/* A replica whose heartbeats stopped: out of rotation, its requests fail. */
static void expire(pd_router *r) {
    double now = pd_now_s();
    for (gw_replica *x = r->replicas; x; x = x->next) {
        if (!x->alive || now - x->last_seen <= hb_timeout_s(r)) continue;
        if (x->hb.draining) /* the end of a drain: it exits once it holds nothing */
            PD_LOGI(LOGM, "replica %s drained and stopped: out of rotation", x->id);
        else
            PD_LOGW(LOGM, "replica %s missed heartbeats for %.1f s: out of rotation", x->id, now - x->last_seen);
        replica_gone(r, x, "stopped responding", false);
    }
}

static void on_fd(evutil_socket_t fd, short what, void *arg) {
    drain(arg);
}

/* Running requests past --request-timeout fail (in-band once streaming). */
static void enforce_deadlines(pd_router *r) {
    if (r->cfg.request_timeout_s <= 0) return;
    double now = pd_now_s();
    for (gw_sub *s = r->subs; s;) {
        gw_req *q = s->parent;
        if (now - q->t_arrival > r->cfg.request_timeout_s) {
            char msg[200];
            snprintf(msg, sizeof msg, "request exceeded --request-timeout %g s", r->cfg.request_timeout_s);
            r->cls[q->cls].rejected_timeout++;
            fail_request(r, q, 504, msg);
            s = r->subs; /* the request's subs are gone: rescan */
            continue;
        }
        s = s->next_all;
    }
    event_active(r->ev_dispatch, 0, 0); /* queued deadlines */
}

/* Decode replicas whose refusal backoff ended may be asked again; queued
 * requests are looked at (room, --queue-timeout) while any wait. */
static void wake_queues(pd_router *r) {
    double now = pd_now_s();
    for (gw_replica *x = r->replicas; x; x = x->next)
        if (x->refused && now >= x->refused_until) x->refused = false;
    for (int k = 0; k < N_CLASSES; k++)
        if (r->cls[k].qhead) event_active(r->ev_dispatch, 0, 0);
}

static void on_timer(evutil_socket_t fd, short what, void *arg) {
    pd_router *r = arg;
    drain(r);
    expire(r);
    enforce_deadlines(r);
    wake_queues(r);
}

pd_status pd_router_init(struct event_base *base, const pd_router_config *cfg, pd_router **r_p, pd_err *err) {
    pd_router *r = pd_xcalloc(1, sizeof *r);
    r->base = base;
    r->cfg = *cfg;
    r->weights_ref = cfg->weights_fingerprint;
    snprintf(r->endpoint, sizeof r->endpoint, "%s", cfg->control_endpoint);
    r->cfg.control_endpoint = r->endpoint;
    if (r->cfg.heartbeat_interval_ms <= 0) r->cfg.heartbeat_interval_ms = 500;
    if (r->cfg.max_prefill_jobs_per_replica <= 0) r->cfg.max_prefill_jobs_per_replica = 2;
    r->zctx = zmq_ctx_new();
    r->sock = zmq_socket(r->zctx, ZMQ_ROUTER);
    int one = 1, zero = 0, hwm = 100000;
    zmq_setsockopt(r->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    zmq_setsockopt(r->sock, ZMQ_ROUTER_HANDOVER, &one, sizeof one); /* a restarted replica takes over its id */
    zmq_setsockopt(r->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(r->sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(r->sock, ZMQ_RCVHWM, &hwm, sizeof hwm);
    if (zmq_bind(r->sock, r->endpoint) != 0) {
        pd_status st = pd_err_set(err, PD_ERR_IO, "control endpoint %s: %s", r->endpoint, zmq_strerror(errno));
        zmq_close(r->sock);
        zmq_ctx_term(r->zctx);
        free(r);
        return st;
    }
    int fd;
    size_t fl = sizeof fd;
    zmq_getsockopt(r->sock, ZMQ_FD, &fd, &fl);
    r->ev_fd = event_new(base, fd, EV_READ | EV_PERSIST, on_fd, r);
    event_add(r->ev_fd, NULL);
    r->ev_timer = event_new(base, -1, EV_PERSIST, on_timer, r);
    r->ev_dispatch = event_new(base, -1, 0, on_dispatch, r);
    snprintf(r->model_name, sizeof r->model_name, "%s", cfg->model_name ? cfg->model_name : "");
    r->cfg.model_name = r->model_name;
    static const int def_running[N_CLASSES] = {256, 16}, def_queued[N_CLASSES] = {1024, 256};
    for (int k = 0; k < N_CLASSES; k++) {
        class_state *c = &r->cls[k];
        c->max_running = cfg->max_running[k] > 0 ? cfg->max_running[k] : def_running[k];
        c->max_queued = cfg->max_running[k] > 0 ? cfg->max_queued[k] : def_queued[k];
        pd_hist_init(&c->ttft, pd_buckets_ttft_s, pd_buckets_ttft_n);
        pd_hist_init(&c->e2e, pd_buckets_ttft_s, pd_buckets_ttft_n);
        pd_hist_init(&c->queue_time, pd_buckets_ttft_s, pd_buckets_ttft_n);
        pd_hist_init(&c->prefill_time, pd_buckets_ttft_s, pd_buckets_ttft_n);
        pd_hist_init(&c->decode_time, pd_buckets_ttft_s, pd_buckets_ttft_n);
        pd_hist_init(&c->itl, pd_buckets_itl_s, pd_buckets_itl_n);
    }
    struct timeval tv = {0, 20 * 1000};
    event_add(r->ev_timer, &tv);
    g_router = r;
    *r_p = r;
    return PD_OK;
}

static int metrics_get(void *ctx, const char *path, const char *query, struct evbuffer *body, const char **ct);

void pd_router_attach(pd_router *r, pd_gw_server *gw) {
    r->gw = gw;
    pd_gw_server_set_abort_choice(gw, engine_abort_choice);
    count_alive(r);
    pd_err err = {{0}};
    if (pd_gw_server_add_get(gw, "/metrics", metrics_get, r, &err) != PD_OK)
        PD_LOGW(LOGM, "cannot serve /metrics: %s", err.msg);
}

void pd_router_get_stats(const pd_router *r, pd_router_stats *st) {
    *st = r->stats;
}

void pd_router_free(pd_router **r_p) {
    if (!r_p || !*r_p) return;
    pd_router *r = *r_p;
    while (r->subs) {
        gw_sub *s = r->subs;
        r->subs = s->next_all;
        send_abort(r, s->decode, s->rid, "gateway stopping");
        send_abort(r, s->prefill, s->rid, "gateway stopping");
    }
    event_free(r->ev_fd);
    event_free(r->ev_timer);
    event_free(r->ev_dispatch);
    zmq_close(r->sock);
    zmq_ctx_term(r->zctx);
    while (r->replicas) {
        gw_replica *x = r->replicas;
        r->replicas = x->next;
        free(x->ucx_addr);
        free(x->rkey);
        free(x);
    }
    if (g_router == r) g_router = NULL;
    free(r);
    *r_p = NULL;
}

/* ---- /metrics (Prometheus text exposition; vLLM's names, pdserve: prefix) ---- */

#include <event2/buffer.h>

static int metrics_get(void *ctx, const char *path, const char *query, struct evbuffer *body, const char **ct) {
    pd_router *r = ctx;
    *ct = "text/plain; version=0.0.4; charset=utf-8";
    evbuffer_add_printf(body, PD_BUILD_INFO_HELP "pdserve:build_info{%s} 1\n", pd_version_build_info_labels());
    evbuffer_add_printf(body, "# HELP pdserve:num_requests_running Requests running on a replica.\n"
                              "# TYPE pdserve:num_requests_running gauge\n");
    for (gw_replica *x = r->replicas; x; x = x->next)
        if (x->alive)
            evbuffer_add_printf(body, "pdserve:num_requests_running{replica=\"%s\",role=\"%s\"} %u\n", x->id,
                                x->role == ROLE_DECODE ? "decode" : "prefill", x->hb.num_running);
    evbuffer_add_printf(body, "# HELP pdserve:num_requests_waiting Requests waiting on a replica.\n"
                              "# TYPE pdserve:num_requests_waiting gauge\n");
    for (gw_replica *x = r->replicas; x; x = x->next)
        if (x->alive)
            evbuffer_add_printf(body, "pdserve:num_requests_waiting{replica=\"%s\",role=\"%s\"} %u\n", x->id,
                                x->role == ROLE_DECODE ? "decode" : "prefill", x->hb.num_waiting);
    evbuffer_add_printf(body, "# HELP pdserve:kv_cache_usage_perc KV cache blocks in use (0-1).\n"
                              "# TYPE pdserve:kv_cache_usage_perc gauge\n");
    for (gw_replica *x = r->replicas; x; x = x->next)
        if (x->alive && x->hb.total_blocks)
            evbuffer_add_printf(body, "pdserve:kv_cache_usage_perc{replica=\"%s\",role=\"%s\"} %.6f\n", x->id,
                                x->role == ROLE_DECODE ? "decode" : "prefill",
                                1.0 - (double)x->hb.free_blocks / x->hb.total_blocks);
    evbuffer_add_printf(body, "# HELP pdserve:kv_cache_free_blocks Free KV blocks per replica.\n"
                              "# TYPE pdserve:kv_cache_free_blocks gauge\n");
    for (gw_replica *x = r->replicas; x; x = x->next)
        if (x->alive)
            evbuffer_add_printf(body, "pdserve:kv_cache_free_blocks{replica=\"%s\",role=\"%s\"} %u\n", x->id,
                                x->role == ROLE_DECODE ? "decode" : "prefill", x->hb.free_blocks);
    evbuffer_add_printf(body, "# HELP pdserve:kv_staging_free_slots Free KV staging slots of a decode replica "
                              "(--kv-staging-blocks; a long prompt's reservation takes one per block).\n"
                              "# TYPE pdserve:kv_staging_free_slots gauge\n");
    for (gw_replica *x = r->replicas; x; x = x->next)
        if (x->alive && x->role == ROLE_DECODE && x->staging_slots)
            evbuffer_add_printf(body, "pdserve:kv_staging_free_slots{replica=\"%s\",role=\"decode\"} %u\n", x->id,
                                x->hb.free_staging_slots);
    evbuffer_add_printf(body, "# HELP pdserve:kv_reservations_refused_total Long-route KV reservations a decode "
                              "replica refused for want of free blocks or staging slots (the request waits again).\n"
                              "# TYPE pdserve:kv_reservations_refused_total counter\n");
    for (gw_replica *x = r->replicas; x; x = x->next)
        if (x->alive && x->role == ROLE_DECODE)
            evbuffer_add_printf(body, "pdserve:kv_reservations_refused_total{replica=\"%s\"} %llu\n", x->id,
                                (unsigned long long)x->refusals);
    evbuffer_add_printf(body, "# HELP pdserve:replica_prefill_tokens_total Prompt tokens a replica computed itself.\n"
                              "# TYPE pdserve:replica_prefill_tokens_total counter\n");
    for (gw_replica *x = r->replicas; x; x = x->next)
        if (x->alive)
            evbuffer_add_printf(body, "pdserve:replica_prefill_tokens_total{replica=\"%s\",role=\"%s\"} %llu\n", x->id,
                                x->role == ROLE_DECODE ? "decode" : "prefill",
                                (unsigned long long)x->hb.prefill_tokens_total);
    evbuffer_add_printf(body, "# HELP pdserve:generation_tokens_total Tokens sampled on a decode replica.\n"
                              "# TYPE pdserve:generation_tokens_total counter\n");
    for (gw_replica *x = r->replicas; x; x = x->next)
        if (x->alive && x->role == ROLE_DECODE)
            evbuffer_add_printf(body, "pdserve:generation_tokens_total{replica=\"%s\"} %llu\n", x->id,
                                (unsigned long long)x->hb.generation_tokens_total);
    evbuffer_add_printf(body,
                        "# HELP pdserve:kv_transfer_bytes_total KV cache bytes moved from prefill to decode.\n"
                        "# TYPE pdserve:kv_transfer_bytes_total counter\n"
                        "pdserve:kv_transfer_bytes_total %llu\n"
                        "# HELP pdserve:kv_transfer_seconds_total Seconds from prefill start to flushed KV.\n"
                        "# TYPE pdserve:kv_transfer_seconds_total counter\n"
                        "pdserve:kv_transfer_seconds_total %.6f\n"
                        "# HELP pdserve:requests_routed_total Sequences routed (each of a request's n choices), by route.\n"
                        "# TYPE pdserve:requests_routed_total counter\n"
                        "pdserve:requests_routed_total{class=\"short\"} %llu\n"
                        "pdserve:requests_routed_total{class=\"long\"} %llu\n"
                        "# HELP pdserve:replicas_alive Replicas in rotation.\n"
                        "# TYPE pdserve:replicas_alive gauge\n"
                        "pdserve:replicas_alive{role=\"decode\"} %d\n"
                        "pdserve:replicas_alive{role=\"prefill\"} %d\n",
                        (unsigned long long)r->stats.kv_bytes_transferred, r->stats.kv_transfer_seconds,
                        (unsigned long long)r->stats.requests_short, (unsigned long long)r->stats.requests_long,
                        r->stats.decode_alive, r->stats.prefill_alive);
    pd_strbuf sb = {0};
    static const char *hists[6][2] = {
        {"pdserve:time_to_first_token_seconds", "Arrival to first token."},
        {"pdserve:inter_token_latency_seconds", "Time between tokens of a request."},
        {"pdserve:e2e_request_latency_seconds", "Arrival to the last token of finished requests."},
        {"pdserve:request_queue_time_seconds", "Time in the gateway's class queue."},
        {"pdserve:request_prefill_time_seconds", "Dispatch to first token (prefill, plus KV transfer on the long route)."},
        {"pdserve:request_decode_time_seconds", "First token to the last."}};
    for (int h = 0; h < 6; h++) {
        pd_strbuf_printf(&sb, "# HELP %s %s\n# TYPE %s histogram\n", hists[h][0], hists[h][1], hists[h][0]);
        for (int k = 0; k < N_CLASSES; k++) {
            class_state *c = &r->cls[k];
            const pd_hist *hs[6] = {&c->ttft, &c->itl, &c->e2e, &c->queue_time, &c->prefill_time, &c->decode_time};
            char labels[384];
            snprintf(labels, sizeof labels, "model_name=\"%s\",class=\"%s\"", r->model_name, class_name[k]);
            pd_hist_render(hs[h], hists[h][0], labels, &sb);
        }
    }
    pd_strbuf_printf(&sb, "# HELP pdserve:num_requests_running_class Requests dispatched to replicas, by class.\n"
                          "# TYPE pdserve:num_requests_running_class gauge\n");
    for (int k = 0; k < N_CLASSES; k++)
        pd_strbuf_printf(&sb, "pdserve:num_requests_running_class{model_name=\"%s\",class=\"%s\"} %d\n", r->model_name,
                         class_name[k], r->cls[k].running);
    pd_strbuf_printf(&sb, "# HELP pdserve:num_requests_waiting_class Requests in the gateway's class queue "
                          "(long: also those waiting for a decode replica's KV room).\n"
                          "# TYPE pdserve:num_requests_waiting_class gauge\n");
    for (int k = 0; k < N_CLASSES; k++)
        pd_strbuf_printf(&sb, "pdserve:num_requests_waiting_class{model_name=\"%s\",class=\"%s\"} %d\n", r->model_name,
                         class_name[k], r->cls[k].queued);
    pd_strbuf_printf(&sb, "# HELP pdserve:prompt_tokens_total Prompt tokens of dispatched requests.\n"
                          "# TYPE pdserve:prompt_tokens_total counter\n");
    for (int k = 0; k < N_CLASSES; k++)
        pd_strbuf_printf(&sb, "pdserve:prompt_tokens_total{model_name=\"%s\",class=\"%s\"} %llu\n", r->model_name,
                         class_name[k], (unsigned long long)r->cls[k].prompt_tokens);
    pd_strbuf_printf(&sb, "# HELP pdserve:generation_tokens_class_total Tokens delivered to clients.\n"
                          "# TYPE pdserve:generation_tokens_class_total counter\n");
    for (int k = 0; k < N_CLASSES; k++)
        pd_strbuf_printf(&sb, "pdserve:generation_tokens_class_total{model_name=\"%s\",class=\"%s\"} %llu\n",
                         r->model_name, class_name[k], (unsigned long long)r->cls[k].generation_tokens);
    pd_strbuf_printf(&sb, "# HELP pdserve:request_success_total Finished requests by finish reason.\n"
                          "# TYPE pdserve:request_success_total counter\n");
    for (int k = 0; k < N_CLASSES; k++) {
        pd_strbuf_printf(&sb, "pdserve:request_success_total{model_name=\"%s\",class=\"%s\",finished_reason=\"stop\"} %llu\n",
                         r->model_name, class_name[k], (unsigned long long)r->cls[k].finished_stop);
        pd_strbuf_printf(&sb, "pdserve:request_success_total{model_name=\"%s\",class=\"%s\",finished_reason=\"length\"} %llu\n",
                         r->model_name, class_name[k], (unsigned long long)r->cls[k].finished_length);
        pd_strbuf_printf(&sb, "pdserve:request_success_total{model_name=\"%s\",class=\"%s\",finished_reason=\"abort\"} %llu\n",
                         r->model_name, class_name[k], (unsigned long long)r->cls[k].finished_abort);
    }
    pd_strbuf_printf(&sb, "# HELP pdserve:request_failure_total Requests that failed after admission.\n"
                          "# TYPE pdserve:request_failure_total counter\n");
    for (int k = 0; k < N_CLASSES; k++)
        pd_strbuf_printf(&sb, "pdserve:request_failure_total{model_name=\"%s\",class=\"%s\"} %llu\n", r->model_name,
                         class_name[k], (unsigned long long)r->cls[k].finished_error);
    pd_strbuf_printf(&sb, "# HELP pdserve:requests_rejected_total Requests refused or timed out, by reason.\n"
                          "# TYPE pdserve:requests_rejected_total counter\n");
    for (int k = 0; k < N_CLASSES; k++) {
        pd_strbuf_printf(&sb, "pdserve:requests_rejected_total{model_name=\"%s\",class=\"%s\",reason=\"queue_full\"} %llu\n",
                         r->model_name, class_name[k], (unsigned long long)r->cls[k].rejected_queue_full);
        pd_strbuf_printf(&sb, "pdserve:requests_rejected_total{model_name=\"%s\",class=\"%s\",reason=\"no_replica\"} %llu\n",
                         r->model_name, class_name[k], (unsigned long long)r->cls[k].rejected_no_replica);
        pd_strbuf_printf(&sb, "pdserve:requests_rejected_total{model_name=\"%s\",class=\"%s\",reason=\"timeout\"} %llu\n",
                         r->model_name, class_name[k], (unsigned long long)r->cls[k].rejected_timeout);
        pd_strbuf_printf(&sb, "pdserve:requests_rejected_total{model_name=\"%s\",class=\"%s\",reason=\"kv_limit\"} %llu\n",
                         r->model_name, class_name[k], (unsigned long long)r->cls[k].rejected_kv_limit);
    }
    if (sb.len) evbuffer_add(body, sb.data, sb.len);
    pd_strbuf_free(&sb);
    return 200;
}

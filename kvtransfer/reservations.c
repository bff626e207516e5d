/* The decode replica's reservation table: (request id, reservation id) →
 * blocks, state, deadline, writer. Pure bookkeeping, no UCX: the protocol it
 * implements is in pd_kvtransfer.h ("THE RESERVATION PROTOCOL").
 *
 * Entries live in a chained hash keyed by reservation id. A reservation is
 * "finished" once its blocks are handed back (blocks_free) or were given to
 * the caller by an accepted claim and it has been released; finished entries
 * are kept, oldest first, in a FIFO of at most cfg.remembered so that a late
 * claim is refused with the precise reason, then forgotten. */
#include "kvx_impl.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

struct kvx_resv {
    uint64_t id;
    char request_id[PD_KVX_REQUEST_ID_MAX + 1];
    uint64_t writer;
    pd_kvx_resv_state state;
    unsigned flags;
    bool was_complete; /* a claim was accepted: the caller owns the blocks */
    bool quiescent;    /* one-sided: the writer has stopped writing */
    bool finished;     /* blocks handed back (or owned by the caller); only remembered */
    double deadline;
    int32_t *blocks;
    size_t n_blocks;
    /* AM path */
    uint32_t inflight;      /* validated writes still landing */
    uint64_t landed_bytes;  /* bytes of validated writes that landed */
    uint64_t claimed_bytes; /* a claim waiting for in-flight writes; 0: none */
    kvx_resv *hnext;        /* hash chain */
    kvx_resv *fnext;        /* FIFO of finished entries */
};

struct pd_kvx_reservations {
    pd_kvx_resv_config cfg;
    kvx_resv **buckets;
    size_t n_buckets; /* power of two */
    size_t n_entries;
    kvx_resv *fifo_head, *fifo_tail; /* finished, oldest first */
    size_t n_finished;
    uint64_t next_id;
    bool in_cb; /* a callback is running: the table must not be changed */
    pd_kvx_resv_stats stats;
};

const char *pd_kvx_verdict_str(pd_kvx_verdict v) {
    switch (v) {
    case PD_KVX_ACCEPTED:
        return "accepted";
    case PD_KVX_REFUSED_UNKNOWN:
        return "unknown reservation";
    case PD_KVX_REFUSED_EXPIRED:
        return "reservation expired";
    case PD_KVX_REFUSED_RELEASED:
        return "reservation released";
    case PD_KVX_REFUSED_COMPLETED:
        return "reservation already complete";
    case PD_KVX_REFUSED_WRITER:
        return "not the granted writer";
    case PD_KVX_REFUSED_RANGE:
        return "outside the reservation";
    case PD_KVX_REFUSED_INCOMPLETE:
        return "claimed bytes have not landed";
    }
    return "unknown verdict";
}

const char *pd_kvx_resv_state_str(pd_kvx_resv_state s) {
    switch (s) {
    case PD_KVX_RESV_LIVE:
        return "live";
    case PD_KVX_RESV_COMPLETE:
        return "complete";
    case PD_KVX_RESV_RELEASED:
        return "released";
    case PD_KVX_RESV_EXPIRED:
        return "expired";
    }
    return "unknown state";
}

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t random_u64(void) {
    uint64_t v = 0;
    if (getrandom(&v, sizeof v, GRND_NONBLOCK) != (ssize_t)sizeof v) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        v = mix64((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ (uint64_t)getpid());
    }
    return v;
}

pd_status pd_kvx_resv_init(const pd_kvx_resv_config *cfg, pd_kvx_reservations **t_p, pd_err *err) {
    if (!cfg || !cfg->blocks_free || cfg->block_bytes == 0)
        return pd_err_set(err, PD_ERR_INVALID,
                          "kvx reservations: config needs blocks_free and block_bytes > 0");
    if (!(cfg->reclaim_after_s >= 0) || !isfinite(cfg->reclaim_after_s))
        return pd_err_set(err, PD_ERR_INVALID,
                          "kvx reservations: reclaim_after_s %g must be a finite value >= 0",
                          cfg->reclaim_after_s);
    pd_kvx_reservations *t = pd_xcalloc(1, sizeof *t);
    t->cfg = *cfg;
    if (t->cfg.remembered == 0)
        t->cfg.remembered = 4096;
    t->n_buckets = 256;
    t->buckets = pd_xcalloc(t->n_buckets, sizeof *t->buckets);
    /* 32 random high bits: ids of a restarted decode replica never repeat
     * ids that a stale writer may still hold. */
    t->next_id = (random_u64() & 0xffffffff00000000ull) | 1;
    *t_p = t;
    return PD_OK;
}

static void resv_free_entry(kvx_resv *r) {
    free(r->blocks);
    free(r);
}

void pd_kvx_resv_free(pd_kvx_reservations **t_p) {
    if (!t_p || !*t_p)
        return;
    pd_kvx_reservations *t = *t_p;
    for (size_t i = 0; i < t->n_buckets; i++) {
        kvx_resv *r = t->buckets[i];
        while (r) {
            kvx_resv *n = r->hnext;
            resv_free_entry(r);
            r = n;
        }
    }
    free(t->buckets);
    free(t);
    *t_p = NULL;
}

static size_t bucket_of(const pd_kvx_reservations *t, uint64_t id) {
    return (size_t)(mix64(id) & (t->n_buckets - 1));
}

static void hash_grow(pd_kvx_reservations *t) {
    size_t nb = t->n_buckets * 2;
    kvx_resv **b = pd_xcalloc(nb, sizeof *b);
    for (size_t i = 0; i < t->n_buckets; i++) {
        kvx_resv *r = t->buckets[i];
        while (r) {
            kvx_resv *n = r->hnext;
            size_t k = (size_t)(mix64(r->id) & (nb - 1));
            r->hnext = b[k];
            b[k] = r;
            r = n;
        }
    }
    free(t->buckets);
    t->buckets = b;
    t->n_buckets = nb;
}

static kvx_resv *find_id(const pd_kvx_reservations *t, uint64_t id) {
    for (kvx_resv *r = t->buckets[bucket_of(t, id)]; r; r = r->hnext)
        if (r->id == id)
            return r;
    return NULL;
}

/* By (request id, reservation id): an id that belongs to another request
 * is as unknown as one that never existed. */
kvx_resv *kvx_resv_find(pd_kvx_reservations *t, const char *request_id, uint64_t resv_id) {
    kvx_resv *r = find_id(t, resv_id);
    if (!r || !request_id || strcmp(r->request_id, request_id) != 0)
        return NULL;
    return r;
}

static void hash_remove(pd_kvx_reservations *t, kvx_resv *r) {
    kvx_resv **pp = &t->buckets[bucket_of(t, r->id)];
    while (*pp != r)
        pp = &(*pp)->hnext;
    *pp = r->hnext;
    t->n_entries--;
}

/* Forgets the oldest finished entries beyond cfg.remembered. Called at the
 * end of public calls only, so that no loop holds a pointer to a freed one. */
static void forget_excess(pd_kvx_reservations *t) {
    while (t->n_finished > t->cfg.remembered) {
        kvx_resv *r = t->fifo_head;
        t->fifo_head = r->fnext;
        if (!t->fifo_head)
            t->fifo_tail = NULL;
        t->n_finished--;
        hash_remove(t, r);
        resv_free_entry(r);
    }
}

static void stats_leave(pd_kvx_reservations *t, const kvx_resv *r) {
    if (r->finished)
        return;
    if (r->state == PD_KVX_RESV_LIVE)
        t->stats.live--;
    else if (r->state == PD_KVX_RESV_COMPLETE)
        t->stats.complete--;
    else
        t->stats.quarantined--;
}

static void stats_enter(pd_kvx_reservations *t, const kvx_resv *r) {
    if (r->finished)
        return;
    if (r->state == PD_KVX_RESV_LIVE)
        t->stats.live++;
    else if (r->state == PD_KVX_RESV_COMPLETE)
        t->stats.complete++;
    else
        t->stats.quarantined++;
}

static void report_dropped_claim(pd_kvx_reservations *t, kvx_resv *r);

static void set_state(pd_kvx_reservations *t, kvx_resv *r, pd_kvx_resv_state s) {
    stats_leave(t, r);
    r->state = s;
    stats_enter(t, r);
    if (s != PD_KVX_RESV_LIVE && s != PD_KVX_RESV_COMPLETE && r->claimed_bytes)
        report_dropped_claim(t, r);
}

/* Hands the blocks of a released/expired reservation back once nothing can
 * still write into them: no validated write in flight and, for one-sided
 * puts, a quiescent writer. */
static void maybe_finish(pd_kvx_reservations *t, kvx_resv *r) {
    if (r->finished || r->inflight > 0)
        return;
    if (r->state != PD_KVX_RESV_RELEASED && r->state != PD_KVX_RESV_EXPIRED)
        return;
    if (!r->was_complete && !(r->flags & PD_KVX_RESV_AM) && !r->quiescent)
        return;
    stats_leave(t, r);
    r->finished = true;
    if (!r->was_complete) {
        t->in_cb = true;
        t->cfg.blocks_free(t->cfg.user, r->request_id, r->id, r->blocks, r->n_blocks);
        t->in_cb = false;
    }
    r->fnext = NULL;
    if (t->fifo_tail)
        t->fifo_tail->fnext = r;
    else
        t->fifo_head = r;
    t->fifo_tail = r;
    t->n_finished++;
}

pd_status pd_kvx_resv_create(pd_kvx_reservations *t, const char *request_id, uint64_t writer,
                             const int32_t *blocks, size_t n_blocks, double ttl_s, double now_s,
                             unsigned flags, uint64_t *resv_id_p, pd_err *err) {
    PD_ASSERT(!t->in_cb);
    size_t idlen = request_id ? strnlen(request_id, PD_KVX_REQUEST_ID_MAX + 1) : 0;
    if (idlen == 0 || idlen > PD_KVX_REQUEST_ID_MAX)
        return pd_err_set(err, PD_ERR_INVALID, "kvx reservation: request id must be 1..%d bytes",
                          PD_KVX_REQUEST_ID_MAX);
    if (!blocks || n_blocks == 0)
        return pd_err_set(err, PD_ERR_INVALID, "kvx reservation %s: no blocks", request_id);
    if (!(ttl_s > 0) || !isfinite(ttl_s))
        return pd_err_set(err, PD_ERR_INVALID, "kvx reservation %s: ttl %g s is not positive",
                          request_id, ttl_s);
    if (flags & ~(unsigned)PD_KVX_RESV_AM)
        return pd_err_set(err, PD_ERR_INVALID, "kvx reservation %s: unknown flags 0x%x", request_id,
                          flags);
    for (size_t i = 0; i < n_blocks; i++)
        if (blocks[i] < 0)
            return pd_err_set(err, PD_ERR_INVALID, "kvx reservation %s: block id %d is negative",
                              request_id, (int)blocks[i]);
    kvx_resv *r = pd_xcalloc(1, sizeof *r);
    r->id = t->next_id++;
    memcpy(r->request_id, request_id, idlen);
    r->writer = writer;
    r->flags = flags;
    r->deadline = now_s + ttl_s;
    r->blocks = pd_xmalloc(n_blocks * sizeof *r->blocks);
    memcpy(r->blocks, blocks, n_blocks * sizeof *r->blocks);
    r->n_blocks = n_blocks;
    r->state = PD_KVX_RESV_LIVE;
    stats_enter(t, r);
    if (t->n_entries + 1 > t->n_buckets)
        hash_grow(t);
    size_t k = bucket_of(t, r->id);
    r->hnext = t->buckets[k];
    t->buckets[k] = r;
    t->n_entries++;
    *resv_id_p = r->id;
    return PD_OK;
}

/* The common judgement of a write or a claim: state, deadline, writer.
 * A LIVE reservation past its deadline becomes EXPIRED here. */
static pd_kvx_verdict judge(pd_kvx_reservations *t, kvx_resv *r, const char *request_id,
                            uint64_t resv_id, uint64_t writer, double now_s, pd_err *err) {
    if (!r) {
        pd_err_set(err, PD_ERR_NOTFOUND,
                   "kvx: request %s reservation %016llx: no such reservation (never made, or "
                   "forgotten)",
                   request_id ? request_id : "(null)", (unsigned long long)resv_id);
        return PD_KVX_REFUSED_UNKNOWN;
    }
    if (r->state == PD_KVX_RESV_LIVE && now_s > r->deadline)
        set_state(t, r, PD_KVX_RESV_EXPIRED);
    pd_kvx_verdict v = PD_KVX_ACCEPTED;
    switch (r->state) {
    case PD_KVX_RESV_LIVE:
        break;
    case PD_KVX_RESV_COMPLETE:
        v = PD_KVX_REFUSED_COMPLETED;
        break;
    case PD_KVX_RESV_RELEASED:
        v = PD_KVX_REFUSED_RELEASED;
        break;
    case PD_KVX_RESV_EXPIRED:
        v = PD_KVX_REFUSED_EXPIRED;
        break;
    }
    if (v == PD_KVX_ACCEPTED && writer != r->writer)
        v = PD_KVX_REFUSED_WRITER;
    if (v != PD_KVX_ACCEPTED) {
        pd_err_set(err, PD_ERR_INVALID,
                   "kvx: request %s reservation %016llx from writer %llu: %s (state %s, "
                   "granted to writer %llu, deadline %+.3f s from now)",
                   r->request_id, (unsigned long long)r->id, (unsigned long long)writer,
                   pd_kvx_verdict_str(v), pd_kvx_resv_state_str(r->state),
                   (unsigned long long)r->writer, r->deadline - now_s);
    }
    return v;
}

static pd_kvx_verdict refused(pd_kvx_reservations *t, pd_kvx_verdict v) {
    if (v != PD_KVX_ACCEPTED)
        t->stats.refused++;
    return v;
}

pd_kvx_verdict pd_kvx_resv_complete(pd_kvx_reservations *t, const char *request_id,
                                    uint64_t resv_id, uint64_t writer, uint64_t bytes_written,
                                    double now_s, pd_err *err) {
    PD_ASSERT(!t->in_cb);
    kvx_resv *r = kvx_resv_find(t, request_id, resv_id);
    pd_kvx_verdict v = judge(t, r, request_id, resv_id, writer, now_s, err);
    if (v == PD_KVX_ACCEPTED && (r->flags & PD_KVX_RESV_AM) && bytes_written != r->landed_bytes) {
        v = PD_KVX_REFUSED_INCOMPLETE;
        pd_err_set(err, PD_ERR_INVALID,
                   "kvx: request %s reservation %016llx: claim of %llu bytes, %llu landed",
                   r->request_id, (unsigned long long)r->id, (unsigned long long)bytes_written,
                   (unsigned long long)r->landed_bytes);
    }
    if (v == PD_KVX_ACCEPTED) {
        set_state(t, r, PD_KVX_RESV_COMPLETE);
        r->was_complete = true;
        r->quiescent = true;
    } else if (r && writer == r->writer && v != PD_KVX_REFUSED_INCOMPLETE) {
        /* The granted writer claims only after its flush completed: it has
         * stopped writing, so quarantined blocks may go back. */
        r->quiescent = true;
        maybe_finish(t, r);
    }
    forget_excess(t);
    return refused(t, v);
}

pd_kvx_verdict pd_kvx_resv_check_write(pd_kvx_reservations *t, const char *request_id,
                                       uint64_t resv_id, uint64_t writer, uint32_t block_index,
                                       uint64_t offset, uint64_t bytes, double now_s,
                                       uint64_t *pool_offset_p, pd_err *err) {
    PD_ASSERT(!t->in_cb);
    kvx_resv *r = kvx_resv_find(t, request_id, resv_id);
    pd_kvx_verdict v = judge(t, r, request_id, resv_id, writer, now_s, err);
    if (v != PD_KVX_ACCEPTED)
        return refused(t, v);
    size_t bb = t->cfg.block_bytes;
    if (block_index >= r->n_blocks || bytes == 0 || offset > bb || bytes > bb - offset) {
        pd_err_set(err, PD_ERR_INVALID,
                   "kvx: request %s reservation %016llx: write of %llu bytes at %llu into block "
                   "index %u is outside the reservation (%zu blocks of %zu bytes)",
                   r->request_id, (unsigned long long)r->id, (unsigned long long)bytes,
                   (unsigned long long)offset, block_index, r->n_blocks, bb);
        return refused(t, PD_KVX_REFUSED_RANGE);
    }
    *pool_offset_p = (uint64_t)r->blocks[block_index] * bb + offset;
    return PD_KVX_ACCEPTED;
}

pd_status pd_kvx_resv_release(pd_kvx_reservations *t, const char *request_id, uint64_t resv_id,
                              pd_err *err) {
    PD_ASSERT(!t->in_cb);
    kvx_resv *r = kvx_resv_find(t, request_id, resv_id);
    if (!r || r->state == PD_KVX_RESV_RELEASED)
        return pd_err_set(err, PD_ERR_NOTFOUND,
                          "kvx: release of request %s reservation %016llx: %s",
                          request_id ? request_id : "(null)", (unsigned long long)resv_id,
                          r ? "already released" : "no such reservation");
    if (r->state != PD_KVX_RESV_EXPIRED)
        set_state(t, r, PD_KVX_RESV_RELEASED);
    maybe_finish(t, r);
    forget_excess(t);
    return PD_OK;
}

pd_status pd_kvx_resv_fenced(pd_kvx_reservations *t, const char *request_id, uint64_t resv_id,
                             uint64_t writer, pd_err *err) {
    PD_ASSERT(!t->in_cb);
    kvx_resv *r = kvx_resv_find(t, request_id, resv_id);
    if (!r)
        return pd_err_set(err, PD_ERR_NOTFOUND,
                          "kvx: fence for request %s reservation %016llx: no such reservation",
                          request_id ? request_id : "(null)", (unsigned long long)resv_id);
    if (writer != r->writer)
        return pd_err_set(err, PD_ERR_INVALID,
                          "kvx: fence for request %s reservation %016llx from writer %llu: "
                          "granted to writer %llu",
                          r->request_id, (unsigned long long)r->id, (unsigned long long)writer,
                          (unsigned long long)r->writer);
    r->quiescent = true;
    maybe_finish(t, r);
    forget_excess(t);
    return PD_OK;
}

size_t pd_kvx_resv_writer_gone(pd_kvx_reservations *t, uint64_t writer) {
    PD_ASSERT(!t->in_cb);
    size_t handed = 0;
    for (size_t i = 0; i < t->n_buckets; i++) {
        for (kvx_resv *r = t->buckets[i]; r; r = r->hnext) {
            if (r->writer != writer || r->finished)
                continue;
            if (r->state == PD_KVX_RESV_LIVE)
                set_state(t, r, PD_KVX_RESV_EXPIRED);
            r->quiescent = true;
            bool before = r->finished;
            maybe_finish(t, r);
            if (!before && r->finished && !r->was_complete)
                handed++;
        }
    }
    forget_excess(t);
    return handed;
}

double pd_kvx_lease_margin_s(double ttl_s) {
    return ttl_s / 4;
}

double pd_kvx_lease_s(double ttl_s) {
    return ttl_s - pd_kvx_lease_margin_s(ttl_s);
}

size_t pd_kvx_resv_expire(pd_kvx_reservations *t, double now_s) {
    PD_ASSERT(!t->in_cb);
    size_t n = 0;
    double grace = t->cfg.reclaim_after_s;
    for (size_t i = 0; i < t->n_buckets; i++) {
        for (kvx_resv *r = t->buckets[i]; r; r = r->hnext) {
            if (r->finished)
                continue;
            if (r->state == PD_KVX_RESV_LIVE && now_s > r->deadline) {
                set_state(t, r, PD_KVX_RESV_EXPIRED);
                n++;
            }
            /* the writer's lease ended a margin before the deadline; one
             * more margin covers its grant's delivery (the protocol, step 5) */
            if (grace > 0 && now_s > r->deadline + grace &&
                (r->state == PD_KVX_RESV_RELEASED || r->state == PD_KVX_RESV_EXPIRED))
                r->quiescent = true;
            maybe_finish(t, r);
        }
    }
    forget_excess(t);
    return n;
}

pd_status pd_kvx_resv_get(const pd_kvx_reservations *t, const char *request_id, uint64_t resv_id,
                          pd_kvx_resv_state *state_p, const int32_t **blocks_p,
                          size_t *n_blocks_p) {
    kvx_resv *r = kvx_resv_find((pd_kvx_reservations *)t, request_id, resv_id);
    if (!r)
        return PD_ERR_NOTFOUND;
    if (state_p)
        *state_p = r->state;
    if (blocks_p)
        *blocks_p = r->blocks;
    if (n_blocks_p)
        *n_blocks_p = r->n_blocks;
    return PD_OK;
}

pd_kvx_resv_stats pd_kvx_resv_stats_get(const pd_kvx_reservations *t) {
    return t->stats;
}

/* ---- hooks for the AM receive path (am.c) ------------------------------- */

void kvx_resv_report(pd_kvx_reservations *t, const char *request_id, uint64_t resv_id,
                     pd_kvx_verdict v, const char *detail) {
    if (!t->cfg.on_am_event)
        return;
    t->in_cb = true;
    t->cfg.on_am_event(t->cfg.user, request_id, resv_id, v, detail);
    t->in_cb = false;
}

void kvx_resv_write_begin(kvx_resv *r) {
    r->inflight++;
}

/* Judges a claim whose bytes have all landed (or can no longer land). */
static void am_claim_judge(pd_kvx_reservations *t, kvx_resv *r, uint64_t writer, uint64_t bytes,
                           double now_s) {
    pd_err e = {{0}};
    char id[PD_KVX_REQUEST_ID_MAX + 1];
    memcpy(id, r->request_id, sizeof id);
    uint64_t rid = r->id;
    pd_kvx_verdict v = pd_kvx_resv_complete(t, id, rid, writer, bytes, now_s, &e);
    if (v != PD_KVX_ACCEPTED)
        PD_LOGW(KVX_LOG, "refused AM claim: %s", e.msg);
    kvx_resv_report(t, id, rid, v, v == PD_KVX_ACCEPTED ? "complete" : e.msg);
}

/* An AM claim was waiting for its bytes when the reservation stopped being
 * LIVE: it is refused now, or nobody would ever answer it. */
static void report_dropped_claim(pd_kvx_reservations *t, kvx_resv *r) {
    char detail[200];
    snprintf(detail, sizeof detail,
             "claim of %llu bytes pending (%llu landed) when the "
             "reservation became %s",
             (unsigned long long)r->claimed_bytes, (unsigned long long)r->landed_bytes,
             pd_kvx_resv_state_str(r->state));
    r->claimed_bytes = 0;
    t->stats.refused++;
    PD_LOGW(KVX_LOG, "refused AM claim: request %s reservation %016llx: %s", r->request_id,
            (unsigned long long)r->id, detail);
    kvx_resv_report(t, r->request_id, r->id,
                    r->state == PD_KVX_RESV_RELEASED ? PD_KVX_REFUSED_RELEASED
                                                     : PD_KVX_REFUSED_EXPIRED,
                    detail);
}

void kvx_resv_write_end(pd_kvx_reservations *t, kvx_resv *r, uint64_t bytes) {
    PD_ASSERT(r->inflight > 0);
    r->inflight--;
    r->landed_bytes += bytes;
    if (r->claimed_bytes && r->landed_bytes >= r->claimed_bytes) {
        uint64_t claimed = r->claimed_bytes;
        r->claimed_bytes = 0;
        am_claim_judge(t, r, r->writer, claimed, pd_now_s());
    } else {
        maybe_finish(t, r);
        forget_excess(t);
    }
}

/* A claim for more bytes than have landed waits for them (writes and the
 * claim may be delivered out of order across lanes); it is judged when they
 * land, or refused when the reservation stops being LIVE. */
void kvx_resv_am_claim(pd_kvx_reservations *t, const char *request_id, uint64_t resv_id,
                       uint64_t writer, uint64_t bytes, double now_s) {
    kvx_resv *r = kvx_resv_find(t, request_id, resv_id);
    if (r) {
        if (r->state == PD_KVX_RESV_LIVE && !(now_s > r->deadline) && writer == r->writer &&
            bytes > r->landed_bytes) {
            r->claimed_bytes = bytes;
            return;
        }
        am_claim_judge(t, r, writer, bytes, now_s);
        return;
    }
    pd_err e = {{0}};
    pd_kvx_verdict v = pd_kvx_resv_complete(t, request_id, resv_id, writer, bytes, now_s, &e);
    PD_LOGW(KVX_LOG, "refused AM claim: %s", e.msg);
    kvx_resv_report(t, request_id, resv_id, v, e.msg);
}

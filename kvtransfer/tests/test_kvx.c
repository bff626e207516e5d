/* kvtransfer tests: agents over UCX shared memory and TCP on loopback.
 *
 * In-process tests put a "prefill" and a "decode" agent in this process.
 * Cross-process tests re-execute this binary as the other side
 * (`test_kvx --kvx-child ROLE TLS DEV ARG`, fd 3 a socketpair to us): a
 * fresh process, because UCX must not be used in a child forked after UCX
 * was initialised. Every wait has a deadline and fails with a message.
 *
 * Transports: shm (posix/sysv + cma) and tcp on lo, as `ucx_info -d`
 * lists them here; an agent that cannot start on one fails the test with
 * the UCX reason. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvx_sock.h"
#include "pd_kvtransfer.h"

typedef struct {
    const char *tls, *dev;
} tport;
static tport T_SHM = {"shm", NULL};
static tport T_TCP = {"tcp", "lo"};

enum { MSG_ADDR = 1, MSG_RKEY, MSG_VERIFY, MSG_RESULT, MSG_EXIT, MSG_PROGRESS };

#define BB ((size_t)256 * 1024) /* block bytes in these tests */
#define NB 64                   /* blocks in a pool */

/* ---- helpers ---------------------------------------------------------------- */

static void fill_pattern(uint8_t *buf, size_t bytes, uint64_t seed) {
    pd_rng r;
    pd_rng_seed(&r, seed);
    for (size_t i = 0; i < bytes; i += 8) {
        uint64_t v = pd_rng_next(&r);
        memcpy(buf + i, &v, bytes - i < 8 ? bytes - i : 8);
    }
}

static uint8_t *pool_alloc(size_t bytes) {
    uint8_t *p = aligned_alloc(4096, bytes);
    assert_non_null(p);
    memset(p, 0, bytes);
    return p;
}

static pd_kvx_agent *agent_new(const tport *t, const char *name, pd_kvx_peer_failed_cb cb,
                               void *user) {
    pd_kvx_config c = {.name = name,
                       .transports = t->tls,
                       .net_devices = t->dev,
                       .on_peer_failed = cb,
                       .user = user};
    pd_err e = {{0}};
    pd_kvx_agent *a = NULL;
    if (pd_kvx_agent_init(&c, &a, &e) != PD_OK)
        fail_msg("UCX transport \"%s\" is not usable here: %s (`ucx_info -d` lists this host's "
                 "transports)",
                 t->tls, e.msg);
    return a;
}

static pd_kvx_pool *pool_register(pd_kvx_agent *a, void *base, size_t bytes) {
    pd_err e = {{0}};
    pd_kvx_pool *p = NULL;
    if (pd_kvx_register_pool(a, base, bytes, &p, &e) != PD_OK)
        fail_msg("%s", e.msg);
    return p;
}

/* Connects from `from` to `to` and, when pool is given, attaches its key. */
static pd_kvx_peer *connect_to(pd_kvx_agent *from, const pd_kvx_agent *to, const pd_kvx_pool *pool,
                               void *user) {
    const void *addr, *rk;
    size_t alen, rkl;
    pd_err e = {{0}};
    pd_kvx_peer *p = NULL;
    pd_kvx_agent_worker_address(to, &addr, &alen);
    if (pd_kvx_peer_connect(from, addr, alen, user, &p, &e) != PD_OK)
        fail_msg("%s", e.msg);
    if (pool) {
        pd_kvx_pool_rkey(pool, &rk, &rkl);
        if (pd_kvx_peer_add_rkey(p, rk, rkl, &e) != PD_OK)
            fail_msg("%s", e.msg);
    }
    return p;
}

typedef bool (*cond_fn)(void *);

/* Drives the agents from their event fds until done(arg) or the deadline. */
static void pump(pd_kvx_agent **as, int n, cond_fn done, void *arg, double timeout_s,
                 const char *what) {
    double until = pd_now_s() + timeout_s;
    for (;;) {
        bool more = false;
        for (int i = 0; i < n; i++)
            more |= pd_kvx_agent_progress(as[i]);
        if (done && done(arg))
            return;
        if (pd_now_s() > until) {
            if (!done)
                return;
            fail_msg("timed out after %.1f s waiting for %s", timeout_s, what);
        }
        if (!more) {
            struct pollfd pfd[4];
            for (int i = 0; i < n; i++)
                pfd[i] = (struct pollfd){pd_kvx_agent_event_fd(as[i]), POLLIN, 0};
            poll(pfd, (nfds_t)n, 20);
        }
    }
}

/* Completion bookkeeping shared by the tests. */
typedef struct {
    int calls[NB + 8]; /* per tag */
    int errors;
    int total;
    bool in_call; /* set around API calls: a callback must never run inside one */
    int flushes;
    int puts_seen_by_flush;
    pd_status flush_st;
} comp;

static void on_done(void *user, uint64_t tag, pd_status st) {
    comp *c = user;
    assert_false(c->in_call);
    assert_true(tag < NB + 8);
    c->calls[tag]++;
    c->total++;
    if (st != PD_OK)
        c->errors++;
}

static void on_flush(void *user, uint64_t tag, pd_status st) {
    (void)tag;
    comp *c = user;
    assert_false(c->in_call);
    c->flushes++;
    c->puts_seen_by_flush = c->total;
    c->flush_st = st;
}

static bool flushed(void *arg) {
    return ((comp *)arg)->flushes > 0;
}

static void put_ok(pd_kvx_peer *p, comp *c, const void *local, size_t bytes, uint64_t off,
                   uint64_t tag) {
    pd_err e = {{0}};
    c->in_call = true;
    pd_status st = pd_kvx_put(p, local, bytes, off, tag, on_done, c, &e);
    c->in_call = false;
    if (st != PD_OK)
        fail_msg("put: %s", e.msg);
}

static void flush_ok(pd_kvx_peer *p, comp *c) {
    pd_err e = {{0}};
    c->in_call = true;
    pd_status st = pd_kvx_flush(p, NB + 1, on_flush, c, &e);
    c->in_call = false;
    if (st != PD_OK)
        fail_msg("flush: %s", e.msg);
}

/* ---- in-process: puts ------------------------------------------------------- */

static void test_put_blocks(void **state) {
    const tport *t = *state;
    pd_kvx_agent *D = agent_new(t, "decode", NULL, NULL), *P = agent_new(t, "prefill", NULL, NULL);
    uint8_t *dst = pool_alloc(NB * BB), *src = pool_alloc(NB * BB);
    fill_pattern(src, NB * BB, 42);
    pd_kvx_pool *dpool = pool_register(D, dst, NB * BB);
    pd_kvx_pool *spool = pool_register(P, src, NB * BB);
    pd_kvx_peer *peer = connect_to(P, D, dpool, NULL);

    /* Source block i goes to destination block (i * 7) % NB: a permutation. */
    comp c = {0};
    for (int i = 0; i < NB; i++)
        put_ok(peer, &c, src + i * BB, BB, (uint64_t)((i * 7) % NB) * BB, i);
    flush_ok(peer, &c);
    /* The event fd is readable at once: the agent asked to be progressed. */
    struct pollfd pfd = {pd_kvx_agent_event_fd(P), POLLIN, 0};
    assert_int_equal(poll(&pfd, 1, 1000), 1);

    pd_kvx_agent *both[] = {P, D};
    pump(both, 2, flushed, &c, 10, "the flush");
    assert_int_equal(c.flush_st, PD_OK);
    assert_int_equal(c.puts_seen_by_flush, NB); /* every put completed before the flush */
    pump(both, 2, NULL, NULL, 0.05, "");        /* nothing fires twice */
    for (int i = 0; i < NB; i++)
        assert_int_equal(c.calls[i], 1);
    assert_int_equal(c.flushes, 1);
    assert_int_equal(c.errors, 0);
    for (int i = 0; i < NB; i++)
        assert_memory_equal(dst + (size_t)((i * 7) % NB) * BB, src + i * BB, BB);

    pd_kvx_peer_close(&peer);
    assert_null(peer);
    pd_kvx_pool_free(&spool);
    pd_kvx_pool_free(&dpool);
    pd_kvx_agent_free(&P);
    pd_kvx_agent_free(&D);
    assert_null(P);
    free(dst);
    free(src);
}

static void test_put_batch(void **state) {
    const tport *t = *state;
    pd_kvx_agent *D = agent_new(t, "decode", NULL, NULL), *P = agent_new(t, "prefill", NULL, NULL);
    uint8_t *dst = pool_alloc(NB * BB), *src = pool_alloc(NB * BB);
    fill_pattern(src, NB * BB, 7);
    pd_kvx_pool *dpool = pool_register(D, dst, NB * BB);
    /* The source is deliberately not registered: UCX must still cope. */
    pd_kvx_peer *peer = connect_to(P, D, dpool, NULL);
    pd_kvx_iov iov[NB];
    for (int i = 0; i < NB; i++)
        iov[i] = (pd_kvx_iov){src + i * BB, (uint64_t)(NB - 1 - i) * BB, BB};
    comp c = {0};
    pd_err e = {{0}};
    c.in_call = true;
    pd_status st = pd_kvx_put_batch(peer, iov, NB, 3, on_done, &c, &e);
    c.in_call = false;
    if (st != PD_OK)
        fail_msg("%s", e.msg);
    flush_ok(peer, &c);
    pd_kvx_agent *both[] = {P, D};
    pump(both, 2, flushed, &c, 10, "the flush after a batch");
    pump(both, 2, NULL, NULL, 0.05, "");
    assert_int_equal(c.calls[3], 1); /* one callback for the whole batch */
    assert_int_equal(c.total, 1);
    assert_int_equal(c.puts_seen_by_flush, 1);
    assert_int_equal(c.errors, 0);
    for (int i = 0; i < NB; i++)
        assert_memory_equal(dst + (size_t)(NB - 1 - i) * BB, src + i * BB, BB);

    /* Arguments are checked before anything is issued; no callback fires. */
    iov[5].remote_offset = NB * BB - 100; /* runs off the end */
    assert_int_equal(pd_kvx_put_batch(peer, iov, NB, 4, on_done, &c, &e), PD_ERR_INVALID);
    assert_non_null(strstr(e.msg, "outside"));
    assert_int_equal(pd_kvx_put(peer, src, 0, 0, 4, on_done, &c, &e), PD_ERR_INVALID);
    assert_int_equal(pd_kvx_put(peer, src, 16, UINT64_MAX - 8, 4, on_done, &c, &e), PD_ERR_INVALID);
    pd_kvx_peer *nokey = connect_to(P, D, NULL, NULL);
    assert_int_equal(pd_kvx_put(nokey, src, 16, 0, 4, on_done, &c, &e), PD_ERR_INVALID);
    pump(both, 2, NULL, NULL, 0.05, "");
    assert_int_equal(c.calls[4], 0);

    pd_kvx_peer_close(&nokey);
    pd_kvx_peer_close(&peer);
    pd_kvx_pool_free(&dpool);
    pd_kvx_agent_free(&P);
    pd_kvx_agent_free(&D);
    free(dst);
    free(src);
}

typedef struct {
    int failed;
    pd_status st;
    char reason[160];
    pd_kvx_peer *peer;
} fail_log;

static void on_peer_failed(void *user, pd_kvx_peer *peer, pd_status st, const char *reason) {
    fail_log *f = user;
    f->failed++;
    f->st = st;
    f->peer = peer;
    snprintf(f->reason, sizeof f->reason, "%s", reason);
}

static bool peer_failed(void *arg) {
    return ((fail_log *)arg)->failed > 0;
}

/* A pool allocated by UCX (shared memory on one host): puts land in it. */
static void test_alloc_pool(void **state) {
    const tport *t = *state;
    pd_kvx_agent *D = agent_new(t, "decode", NULL, NULL), *P = agent_new(t, "prefill", NULL, NULL);
    pd_kvx_pool *dpool = NULL;
    pd_err e = {{0}};
    assert_int_equal(pd_kvx_alloc_pool(D, 0, &dpool, &e), PD_ERR_INVALID);
    if (pd_kvx_alloc_pool(D, 16 * BB, &dpool, &e) != PD_OK)
        fail_msg("%s", e.msg);
    uint8_t *dst = pd_kvx_pool_base(dpool), *src = pool_alloc(16 * BB);
    assert_non_null(dst);
    memset(dst, 0, 16 * BB);
    fill_pattern(src, 16 * BB, 11);
    pd_kvx_peer *peer = connect_to(P, D, dpool, NULL);
    comp c = {0};
    for (int i = 0; i < 16; i++)
        put_ok(peer, &c, src + i * BB, BB, (uint64_t)(15 - i) * BB, i);
    flush_ok(peer, &c);
    pd_kvx_agent *both[] = {P, D};
    pump(both, 2, flushed, &c, 10, "the flush into an allocated pool");
    assert_int_equal(c.flush_st, PD_OK);
    assert_int_equal(c.puts_seen_by_flush, 16);
    for (int i = 0; i < 16; i++)
        assert_memory_equal(dst + (size_t)(15 - i) * BB, src + i * BB, BB);
    pd_kvx_peer_close(&peer);
    pd_kvx_pool_free(&dpool);
    pd_kvx_agent_free(&P);
    pd_kvx_agent_free(&D);
    free(src);
}

/* The service declares a peer dead (heartbeats): outstanding work is
 * answered once, on_peer_failed runs once, later writes are refused. */
static void test_peer_fail_declared(void **state) {
    const tport *t = *state;
    fail_log f = {0};
    pd_kvx_agent *D = agent_new(t, "decode", NULL, NULL);
    pd_kvx_agent *P = agent_new(t, "prefill", on_peer_failed, &f);
    uint8_t *dst = pool_alloc(NB * BB), *src = pool_alloc(NB * BB);
    pd_kvx_pool *dpool = pool_register(D, dst, NB * BB);
    pd_kvx_peer *peer = connect_to(P, D, dpool, (void *)&f);
    assert_ptr_equal(pd_kvx_peer_user(peer), &f);
    pd_kvx_iov iov[NB];
    for (int i = 0; i < NB; i++)
        iov[i] = (pd_kvx_iov){src + i * BB, (uint64_t)i * BB, BB};
    comp c = {0};
    pd_err e = {{0}};
    if (pd_kvx_put_batch(peer, iov, NB, 2, on_done, &c, &e) != PD_OK)
        fail_msg("%s", e.msg);
    pd_kvx_peer_fail(peer, "heartbeats stopped");
    pd_kvx_peer_fail(peer, "again"); /* idempotent: the first reason stands */
    assert_true(pd_kvx_peer_failed(peer));
    assert_int_equal(pd_kvx_put(peer, src, BB, 0, 3, on_done, &c, &e), PD_ERR_IO);
    /* the refusal says the peer failed and why ("peer heartbeats stopped",
     * "peer peer process 12 exited" were the reason pasted after "peer") */
    if (!strstr(e.msg, "kvx prefill: peer failed: heartbeats stopped"))
        fail_msg("refusal '%s' should say 'kvx prefill: peer failed: heartbeats stopped'", e.msg);
    pd_kvx_agent *both[] = {P, D};
    pump(both, 2, peer_failed, &f, 5, "on_peer_failed");
    pump(both, 2, NULL, NULL, 0.1, "");
    assert_int_equal(f.failed, 1);
    assert_string_equal(f.reason, "heartbeats stopped");
    assert_int_equal(c.calls[2], 1); /* the batch: answered exactly once */
    assert_int_equal(c.calls[3], 0);
    pd_kvx_peer_close(&peer);
    pump(both, 2, NULL, NULL, 0.05, "");
    assert_int_equal(f.failed, 1);
    pd_kvx_pool_free(&dpool);
    pd_kvx_agent_free(&P);
    pd_kvx_agent_free(&D);
    free(dst);
    free(src);
}

/* A callback that fails its peer: the failure is reported by the same
 * progress call, or that call says "call again" and the next one does. */
typedef struct {
    pd_kvx_peer *peer;
    int fired;
} fail_in_cb;

static void fail_peer_cb(void *user, uint64_t tag, pd_status st) {
    (void)tag, (void)st;
    fail_in_cb *f = user;
    f->fired++;
    pd_kvx_peer_fail(f->peer, "failed from a callback");
}

static void test_fail_from_callback(void **state) {
    const tport *t = *state;
    fail_log f = {0};
    pd_kvx_agent *D = agent_new(t, "decode", NULL, NULL);
    pd_kvx_agent *P = agent_new(t, "prefill", on_peer_failed, &f);
    uint8_t *dst = pool_alloc(BB), *src = pool_alloc(BB);
    pd_kvx_pool *dpool = pool_register(D, dst, BB);
    fail_in_cb fc = {.peer = connect_to(P, D, dpool, NULL)};
    pd_err e = {{0}};
    if (pd_kvx_put(fc.peer, src, BB, 0, 0, fail_peer_cb, &fc, &e) != PD_OK)
        fail_msg("%s", e.msg);
    double until = pd_now_s() + 10;
    bool again = false;
    while (!fc.fired) {
        if (pd_now_s() > until)
            fail_msg("the put never completed");
        again = pd_kvx_agent_progress(P);
        pd_kvx_agent_progress(D);
    }
    if (f.failed == 0) { /* not handled in the same call: it must ask for another */
        assert_true(again);
        pd_kvx_agent_progress(P);
    }
    assert_int_equal(f.failed, 1);
    assert_string_equal(f.reason, "failed from a callback");
    pd_kvx_peer_close(&fc.peer);
    pd_kvx_pool_free(&dpool);
    pd_kvx_agent_free(&P);
    pd_kvx_agent_free(&D);
    free(dst);
    free(src);
}

/* ---- reservations: the table alone ------------------------------------------ */

typedef struct {
    int freed_calls;
    int32_t freed[64];
    size_t n_freed;
    uint64_t last_resv;
    int events;
    pd_kvx_verdict verdicts[64];
    uint64_t event_resv[64];
} resv_log;

static void on_blocks_free(void *user, const char *request_id, uint64_t resv_id,
                           const int32_t *blocks, size_t n) {
    (void)request_id;
    resv_log *l = user;
    l->freed_calls++;
    l->last_resv = resv_id;
    for (size_t i = 0; i < n && l->n_freed < 64; i++)
        l->freed[l->n_freed++] = blocks[i];
}

static void on_am_event(void *user, const char *request_id, uint64_t resv_id, pd_kvx_verdict v,
                        const char *detail) {
    (void)request_id, (void)detail;
    resv_log *l = user;
    if (l->events < 64) {
        l->verdicts[l->events] = v;
        l->event_resv[l->events] = resv_id;
    }
    l->events++;
}

static pd_kvx_reservations *table_new(resv_log *l, size_t remembered) {
    pd_kvx_resv_config cfg = {.blocks_free = on_blocks_free,
                              .on_am_event = on_am_event,
                              .user = l,
                              .block_bytes = BB,
                              .remembered = remembered};
    pd_kvx_reservations *t = NULL;
    pd_err e = {{0}};
    if (pd_kvx_resv_init(&cfg, &t, &e) != PD_OK)
        fail_msg("%s", e.msg);
    return t;
}

static uint64_t resv_new(pd_kvx_reservations *t, const char *req, uint64_t writer,
                         const int32_t *blocks, size_t n, double ttl, double now, unsigned flags) {
    uint64_t id = 0;
    pd_err e = {{0}};
    if (pd_kvx_resv_create(t, req, writer, blocks, n, ttl, now, flags, &id, &e) != PD_OK)
        fail_msg("%s", e.msg);
    return id;
}

/* The lease and the hand-back after it (the reservation protocol, steps 2
 * and 5): a reservation whose grant never reached its writer (the gateway
 * died between ReserveReply and Prefill), or whose writer never answered,
 * is handed back once deadline + margin has passed, and not before; the
 * writer's lease ends a margin before the deadline, so the hand-back comes
 * two margins after the last moment the writer may issue a write. */
static void test_resv_lease_reclaim(void **state) {
    (void)state;
    for (double ttl = 0.5; ttl <= 1000; ttl *= 3) {
        double lease = pd_kvx_lease_s(ttl), margin = pd_kvx_lease_margin_s(ttl);
        assert_true(lease > 0 && lease < ttl);
        assert_true(margin > 0);
        assert_true(fabs(lease + margin - ttl) < 1e-9 * ttl);
    }
    resv_log l = {0};
    double ttl = 120, margin = pd_kvx_lease_margin_s(ttl);
    pd_kvx_resv_config cfg = {
        .blocks_free = on_blocks_free, .user = &l, .block_bytes = BB, .reclaim_after_s = margin};
    pd_kvx_reservations *t = NULL;
    pd_err e = {{0}};
    cfg.reclaim_after_s = -1;
    assert_int_equal(pd_kvx_resv_init(&cfg, &t, &e), PD_ERR_INVALID);
    cfg.reclaim_after_s = NAN;
    assert_int_equal(pd_kvx_resv_init(&cfg, &t, &e), PD_ERR_INVALID);
    cfg.reclaim_after_s = margin;
    assert_int_equal(pd_kvx_resv_init(&cfg, &t, &e), PD_OK);
    double now = 500.0;
    int32_t b1[] = {3, 7, 8}, b2[] = {11}, b3[] = {20, 21}, b4[] = {30};
    /* orphan: granted, never written, never claimed, never released */
    uint64_t orphan = resv_new(t, "orphan", 1, b1, 3, ttl, now, 0);
    /* released by D (the request was aborted) but its writer never fenced */
    uint64_t rel = resv_new(t, "released", 2, b2, 1, ttl, now + 10, 0);
    assert_int_equal(pd_kvx_resv_release(t, "released", rel, &e), PD_OK);
    /* completed normally: never handed back */
    uint64_t done = resv_new(t, "done", 1, b3, 2, ttl, now, 0);
    assert_int_equal(pd_kvx_resv_complete(t, "done", done, 1, 0, now + 1, &e), PD_KVX_ACCEPTED);
    /* live, created later: untouched throughout */
    uint64_t live = resv_new(t, "live", 1, b4, 1, ttl, now + 100, 0);

    /* within the ttl: nothing happens */
    assert_int_equal(pd_kvx_resv_expire(t, now + ttl - 1), 0);
    assert_int_equal(l.freed_calls, 0);
    /* past the deadline: expired (a claim now is refused), still quarantined,
     * since its writer's lease may have started late */
    assert_int_equal(pd_kvx_resv_expire(t, now + ttl + 1), 1);
    assert_int_equal(pd_kvx_resv_complete(t, "orphan", orphan, 1, 0, now + ttl + 1, &e),
                     PD_KVX_REFUSED_EXPIRED);
    /* (a refused claim from the granted writer proves it stopped: make a new
     * orphan for the rest) */
    assert_int_equal(l.freed_calls, 1);
    l.freed_calls = 0;
    l.n_freed = 0;
    orphan = resv_new(t, "orphan", 1, b1, 3, ttl, now, 0);
    assert_int_equal(pd_kvx_resv_expire(t, now + ttl + margin - 0.5), 1);
    assert_int_equal(l.freed_calls, 0);
    pd_kvx_resv_stats st = pd_kvx_resv_stats_get(t);
    assert_int_equal(st.quarantined, 2); /* the orphan and the released one */
    assert_int_equal(st.live, 1);
    /* deadline + margin passed: the orphan goes back, exactly once */
    assert_int_equal(pd_kvx_resv_expire(t, now + ttl + margin + 0.5), 0);
    assert_int_equal(l.freed_calls, 1);
    assert_int_equal(l.last_resv, orphan);
    assert_int_equal(l.n_freed, 3);
    assert_int_equal(l.freed[0], 3);
    assert_int_equal(l.freed[2], 8);
    /* the released one was reserved 10 s later: its turn comes 10 s later */
    assert_int_equal(pd_kvx_resv_expire(t, now + 10 + ttl + margin - 0.5), 0);
    assert_int_equal(l.freed_calls, 1);
    assert_int_equal(pd_kvx_resv_expire(t, now + 10 + ttl + margin + 0.5), 0);
    assert_int_equal(l.freed_calls, 2);
    assert_int_equal(l.last_resv, rel);
    assert_int_equal(l.freed[3], 11);
    /* much later: nothing more (the completed one belongs to its sequence) */
    assert_int_equal(pd_kvx_resv_expire(t, now + 99 + ttl), 0);
    assert_int_equal(l.freed_calls, 2);
    st = pd_kvx_resv_stats_get(t);
    assert_int_equal(st.quarantined, 0);
    assert_int_equal(st.live, 1);
    assert_int_equal(st.complete, 1);
    /* a late fence for a handed-back reservation is harmless */
    assert_int_equal(pd_kvx_resv_fenced(t, "orphan", orphan, 1, &e), PD_OK);
    assert_int_equal(l.freed_calls, 2);
    (void)live;
    pd_kvx_resv_free(&t);

    /* reclaim_after_s 0 (the old behaviour): quarantined until fenced */
    memset(&l, 0, sizeof l);
    cfg.reclaim_after_s = 0;
    assert_int_equal(pd_kvx_resv_init(&cfg, &t, &e), PD_OK);
    orphan = resv_new(t, "orphan", 1, b1, 3, ttl, now, 0);
    assert_int_equal(pd_kvx_resv_expire(t, now + 10 * ttl), 1);
    assert_int_equal(l.freed_calls, 0);
    assert_int_equal(pd_kvx_resv_stats_get(t).quarantined, 1);
    pd_kvx_resv_free(&t);
}

static void test_resv_table(void **state) {
    (void)state;
    resv_log l = {0};
    pd_kvx_reservations *t = table_new(&l, 2);
    pd_err e = {{0}};
    uint64_t id;
    double now = 1000.0;
    int32_t b[] = {4, 9};

    /* Invalid input is answered, not asserted. */
    assert_int_equal(pd_kvx_resv_create(t, "", 1, b, 2, 1, now, 0, &id, &e), PD_ERR_INVALID);
    char longid[PD_KVX_REQUEST_ID_MAX + 2];
    memset(longid, 'x', sizeof longid - 1);
    longid[sizeof longid - 1] = 0;
    assert_int_equal(pd_kvx_resv_create(t, longid, 1, b, 2, 1, now, 0, &id, &e), PD_ERR_INVALID);
    assert_int_equal(pd_kvx_resv_create(t, "r", 1, b, 0, 1, now, 0, &id, &e), PD_ERR_INVALID);
    assert_int_equal(pd_kvx_resv_create(t, "r", 1, b, 2, 0, now, 0, &id, &e), PD_ERR_INVALID);
    int32_t neg[] = {-1};
    assert_int_equal(pd_kvx_resv_create(t, "r", 1, neg, 1, 1, now, 0, &id, &e), PD_ERR_INVALID);

    /* Accept, then every later claim is refused with its reason. */
    uint64_t a = resv_new(t, "req-a", 1, b, 2, 5, now, 0);
    uint64_t a2 = resv_new(t, "req-a", 1, b, 2, 5, now, 0);
    assert_true(a != a2);
    assert_int_equal(pd_kvx_resv_complete(t, "req-a", a, 2, 0, now, &e), PD_KVX_REFUSED_WRITER);
    assert_non_null(strstr(e.msg, "not the granted writer"));
    assert_int_equal(pd_kvx_resv_complete(t, "req-b", a, 1, 0, now, &e), PD_KVX_REFUSED_UNKNOWN);
    assert_int_equal(pd_kvx_resv_complete(t, "req-a", a, 1, 0, now + 1, &e), PD_KVX_ACCEPTED);
    assert_int_equal(pd_kvx_resv_complete(t, "req-a", a, 1, 0, now + 1, &e),
                     PD_KVX_REFUSED_COMPLETED);
    pd_kvx_resv_state s;
    const int32_t *blocks;
    size_t nb;
    assert_int_equal(pd_kvx_resv_get(t, "req-a", a, &s, &blocks, &nb), PD_OK);
    assert_int_equal(s, PD_KVX_RESV_COMPLETE);
    assert_int_equal(nb, 2);
    assert_int_equal(blocks[1], 9);
    assert_int_equal(pd_kvx_resv_release(t, "req-a", a, &e), PD_OK);
    assert_int_equal(l.freed_calls, 0); /* completed blocks belong to the caller */
    assert_int_equal(pd_kvx_resv_release(t, "req-a", a, &e), PD_ERR_NOTFOUND);
    assert_int_equal(pd_kvx_resv_complete(t, "req-a", a, 1, 0, now + 1, &e),
                     PD_KVX_REFUSED_RELEASED);

    /* Expiry: refused, quarantined until the writer is quiet. */
    assert_int_equal(pd_kvx_resv_expire(t, now + 4), 0);
    assert_int_equal(pd_kvx_resv_expire(t, now + 6), 1); /* a2 */
    assert_int_equal(pd_kvx_resv_stats_get(t).quarantined, 1);
    assert_int_equal(l.freed_calls, 0);
    assert_int_equal(pd_kvx_resv_fenced(t, "req-a", a2, 3, &e), PD_ERR_INVALID);
    assert_int_equal(l.freed_calls, 0);
    assert_int_equal(pd_kvx_resv_fenced(t, "req-a", a2, 1, &e), PD_OK);
    assert_int_equal(l.freed_calls, 1);
    assert_int_equal(l.n_freed, 2);
    assert_int_equal(l.freed[0], 4);
    assert_int_equal(pd_kvx_resv_complete(t, "req-a", a2, 1, 0, now + 7, &e),
                     PD_KVX_REFUSED_EXPIRED);
    assert_non_null(strstr(e.msg, "expired"));
    assert_int_equal(l.freed_calls, 1); /* exactly once */

    /* A claim found past its deadline expires it on the spot. */
    uint64_t c = resv_new(t, "req-c", 1, b, 1, 1, now, 0);
    assert_int_equal(pd_kvx_resv_complete(t, "req-c", c, 1, 0, now + 2, &e),
                     PD_KVX_REFUSED_EXPIRED);
    assert_int_equal(l.freed_calls, 2); /* the granted writer's claim proves it stopped */

    /* Writer gone: live reservations expire, quarantined ones are freed. */
    uint64_t d1 = resv_new(t, "req-d", 5, b, 1, 10, now, 0);
    uint64_t d2 = resv_new(t, "req-d2", 5, b, 2, 10, now, 0);
    assert_int_equal(pd_kvx_resv_release(t, "req-d2", d2, &e), PD_OK);
    assert_int_equal(pd_kvx_resv_writer_gone(t, 5), 2);
    assert_int_equal(l.freed_calls, 4);
    assert_int_equal(pd_kvx_resv_get(t, "req-d", d1, &s, NULL, NULL), PD_OK);
    assert_int_equal(s, PD_KVX_RESV_EXPIRED);

    /* Only `remembered` (2) finished reservations are kept: older ones are
     * forgotten and then unknown. */
    assert_int_equal(pd_kvx_resv_complete(t, "req-a", a, 1, 0, now, &e), PD_KVX_REFUSED_UNKNOWN);
    assert_int_equal(pd_kvx_resv_complete(t, "req-d2", d2, 5, 0, now, &e), PD_KVX_REFUSED_RELEASED);

    /* Write checks: index and byte range inside the reservation. */
    uint64_t w = resv_new(t, "req-w", 1, b, 2, 10, now, PD_KVX_RESV_AM);
    uint64_t off = 0;
    assert_int_equal(pd_kvx_resv_check_write(t, "req-w", w, 1, 1, 100, 50, now, &off, &e),
                     PD_KVX_ACCEPTED);
    assert_int_equal(off, 9 * BB + 100);
    assert_int_equal(pd_kvx_resv_check_write(t, "req-w", w, 1, 2, 0, 1, now, &off, &e),
                     PD_KVX_REFUSED_RANGE);
    assert_int_equal(pd_kvx_resv_check_write(t, "req-w", w, 1, 0, BB - 10, 11, now, &off, &e),
                     PD_KVX_REFUSED_RANGE);
    assert_int_equal(pd_kvx_resv_check_write(t, "req-w", w, 1, 0, 0, 0, now, &off, &e),
                     PD_KVX_REFUSED_RANGE);
    /* AM reservations need no writer fence: released → handed back at once. */
    int before = l.freed_calls;
    assert_int_equal(pd_kvx_resv_release(t, "req-w", w, &e), PD_OK);
    assert_int_equal(l.freed_calls, before + 1);
    assert_true(pd_kvx_resv_stats_get(t).refused >= 9);
    assert_string_equal(pd_kvx_verdict_str(PD_KVX_REFUSED_RELEASED), "reservation released");
    pd_kvx_resv_free(&t);
    assert_null(t);
}

/* ---- in-process: the one-sided protocol with real puts ---------------------- */

typedef struct {
    comp c;
    pd_kvx_peer *peer;
} writer;

static void write_blocks(pd_kvx_agent **both, writer *w, const uint8_t *src, const int32_t *blocks,
                         size_t n) {
    memset(&w->c, 0, sizeof w->c);
    for (size_t i = 0; i < n; i++)
        put_ok(w->peer, &w->c, src + i * BB, BB, (uint64_t)blocks[i] * BB, i);
    flush_ok(w->peer, &w->c);
    pump(both, 2, flushed, &w->c, 10, "the writer's flush");
    assert_int_equal(w->c.flush_st, PD_OK);
}

static void test_one_sided_protocol(void **state) {
    const tport *t = *state;
    pd_kvx_agent *D = agent_new(t, "decode", NULL, NULL), *P = agent_new(t, "prefill", NULL, NULL);
    pd_kvx_agent *both[] = {P, D};
    uint8_t *dst = pool_alloc(NB * BB), *src = pool_alloc(4 * BB);
    fill_pattern(src, 4 * BB, 99);
    pd_kvx_pool *dpool = pool_register(D, dst, NB * BB);
    writer w = {.peer = connect_to(P, D, dpool, NULL)};
    resv_log l = {0};
    pd_kvx_reservations *tab = table_new(&l, 0);
    pd_err e = {{0}};
    double now = pd_now_s();
    const uint64_t WR = 1;

    /* Happy path: reserve, write, flush, claim → COMPLETE; data exact. */
    int32_t b1[] = {2, 5};
    uint64_t r1 = resv_new(tab, "req-1", WR, b1, 2, 30, now, 0);
    write_blocks(both, &w, src, b1, 2);
    assert_int_equal(pd_kvx_resv_complete(tab, "req-1", r1, WR, 0, pd_now_s(), &e),
                     PD_KVX_ACCEPTED);
    assert_memory_equal(dst + 2 * BB, src, BB);
    assert_memory_equal(dst + 5 * BB, src + BB, BB);

    /* Aborted before the (late) writer wrote: its claim is refused, and the
     * blocks stay quarantined until that refused claim shows the writer
     * stopped. */
    int32_t b2[] = {7, 8};
    uint64_t r2 = resv_new(tab, "req-2", WR, b2, 2, 30, now, 0);
    assert_int_equal(pd_kvx_resv_release(tab, "req-2", r2, &e), PD_OK);
    assert_int_equal(l.freed_calls, 0);
    assert_int_equal(pd_kvx_resv_stats_get(tab).quarantined, 1);
    write_blocks(both, &w, src, b2, 2);
    assert_int_equal(pd_kvx_resv_complete(tab, "req-2", r2, WR, 0, pd_now_s(), &e),
                     PD_KVX_REFUSED_RELEASED);
    assert_non_null(strstr(e.msg, "released"));
    assert_int_equal(l.freed_calls, 1);
    assert_int_equal(l.last_resv, r2);
    assert_int_equal(l.freed[0], 7);
    assert_int_equal(l.freed[1], 8);

    /* Expired: refused; unknown: refused; the wrong writer: refused and not
     * taken as a fence. */
    int32_t b3[] = {9};
    uint64_t r3 = resv_new(tab, "req-3", WR, b3, 1, 1, now - 10, 0);
    assert_int_equal(pd_kvx_resv_expire(tab, pd_now_s()), 1);
    write_blocks(both, &w, src, b3, 1);
    assert_int_equal(pd_kvx_resv_complete(tab, "req-3", r3, WR, 0, pd_now_s(), &e),
                     PD_KVX_REFUSED_EXPIRED);
    assert_int_equal(l.freed_calls, 2);
    assert_int_equal(pd_kvx_resv_complete(tab, "req-x", 0x1234, WR, 0, pd_now_s(), &e),
                     PD_KVX_REFUSED_UNKNOWN);
    int32_t b4[] = {11};
    uint64_t r4 = resv_new(tab, "req-4", WR, b4, 1, 30, now, 0);
    assert_int_equal(pd_kvx_resv_release(tab, "req-4", r4, &e), PD_OK);
    assert_int_equal(pd_kvx_resv_complete(tab, "req-4", r4, WR + 1, 0, pd_now_s(), &e),
                     PD_KVX_REFUSED_RELEASED);
    assert_int_equal(l.freed_calls, 2);
    assert_int_equal(pd_kvx_resv_fenced(tab, "req-4", r4, WR, &e), PD_OK);
    assert_int_equal(l.freed_calls, 3);

    /* Blocks no write was granted for are untouched. */
    uint8_t *zero = pool_alloc(BB);
    int32_t untouched[] = {0, 1, 3, 4, 6, 10, 12, NB - 1};
    for (size_t i = 0; i < sizeof untouched / sizeof *untouched; i++)
        assert_memory_equal(dst + (size_t)untouched[i] * BB, zero, BB);
    assert_int_equal(pd_kvx_resv_stats_get(tab).refused, 4);

    pd_kvx_resv_free(&tab);
    pd_kvx_peer_close(&w.peer);
    pd_kvx_pool_free(&dpool);
    pd_kvx_agent_free(&P);
    pd_kvx_agent_free(&D);
    free(zero);
    free(dst);
    free(src);
}

/* ---- in-process: receiver-validated (AM) writes ----------------------------- */

typedef struct {
    resv_log *l;
    int want;
} ev_wait;

static bool have_events(void *arg) {
    ev_wait *w = arg;
    return w->l->events >= w->want;
}

static void am_send_ok(pd_kvx_peer *p, comp *c, const char *req, uint64_t resv, uint64_t writer,
                       const pd_kvx_block_write *bw, size_t n, uint64_t tag) {
    pd_err e = {{0}};
    c->in_call = true;
    pd_status st = pd_kvx_am_write(p, req, resv, writer, bw, n, tag, on_done, c, &e);
    c->in_call = false;
    if (st != PD_OK)
        fail_msg("am write: %s", e.msg);
}

static void am_claim_ok(pd_kvx_peer *p, comp *c, const char *req, uint64_t resv, uint64_t writer,
                        uint64_t bytes) {
    pd_err e = {{0}};
    if (pd_kvx_am_complete(p, req, resv, writer, bytes, NB + 2, on_done, c, &e) != PD_OK)
        fail_msg("am claim: %s", e.msg);
}

static void test_am_writes(void **state) {
    const tport *t = *state;
    pd_kvx_agent *D = agent_new(t, "decode", NULL, NULL), *P = agent_new(t, "prefill", NULL, NULL);
    pd_kvx_agent *both[] = {P, D};
    uint8_t *dst = pool_alloc(NB * BB), *src = pool_alloc(3 * BB);
    uint8_t *snapshot = pool_alloc(NB * BB);
    fill_pattern(src, 3 * BB, 5);
    fill_pattern(dst, NB * BB, 6); /* stale KV from an earlier request */
    memcpy(snapshot, dst, NB * BB);
    pd_kvx_pool *dpool = pool_register(D, dst, NB * BB);
    resv_log l = {0};
    pd_kvx_reservations *tab = table_new(&l, 0);
    pd_err e = {{0}};
    if (pd_kvx_agent_accept_writes(D, tab, dpool, &e) != PD_OK)
        fail_msg("%s", e.msg);
    assert_int_equal(pd_kvx_agent_accept_writes(D, tab, dpool, &e), PD_ERR_INVALID);
    pd_kvx_peer *peer = connect_to(P, D, NULL, NULL);
    comp c = {0};
    double now = pd_now_s();
    const uint64_t WR = 3;
    /* Two whole blocks (rendezvous) and 1 KiB of a third (eager). */
    pd_kvx_block_write bw[3] = {{src, 0, 0, BB}, {src + BB, 1, 0, BB}, {src + 2 * BB, 2, 0, 1024}};
    const uint64_t total = 2 * BB + 1024;

    int32_t ok_blocks[] = {10, 3, 33};
    uint64_t rok = resv_new(tab, "req-ok", WR, ok_blocks, 3, 30, now, PD_KVX_RESV_AM);
    am_send_ok(peer, &c, "req-ok", rok, WR, bw, 3, 0);
    am_claim_ok(peer, &c, "req-ok", rok, WR, total);
    ev_wait wt = {&l, 1};
    pump(both, 2, have_events, &wt, 10, "the accepted AM claim");
    assert_int_equal(l.verdicts[0], PD_KVX_ACCEPTED);
    pd_kvx_resv_state s;
    assert_int_equal(pd_kvx_resv_get(tab, "req-ok", rok, &s, NULL, NULL), PD_OK);
    assert_int_equal(s, PD_KVX_RESV_COMPLETE);
    assert_memory_equal(dst + 10 * BB, src, BB);
    assert_memory_equal(dst + 3 * BB, src + BB, BB);
    assert_memory_equal(dst + 33 * BB, src + 2 * BB, 1024);
    assert_memory_equal(dst + 33 * BB + 1024, snapshot + 33 * BB + 1024, BB - 1024);
    memcpy(snapshot + 10 * BB, dst + 10 * BB, BB);
    memcpy(snapshot + 3 * BB, dst + 3 * BB, BB);
    memcpy(snapshot + 33 * BB, dst + 33 * BB, BB);

    /* Writes for unknown, released, expired reservations, from the wrong
     * writer and outside the reservation: each refused and reported, never
     * applied. */
    int32_t rel_blocks[] = {20, 21, 22}, exp_blocks[] = {23, 24, 25}, wr_blocks[] = {26, 27, 28};
    int32_t rg_blocks[] = {29};
    uint64_t rrel = resv_new(tab, "req-rel", WR, rel_blocks, 3, 30, now, PD_KVX_RESV_AM);
    assert_int_equal(pd_kvx_resv_release(tab, "req-rel", rrel, &e), PD_OK);
    assert_int_equal(l.freed_calls, 1); /* AM: nothing in flight, handed back at once */
    uint64_t rexp = resv_new(tab, "req-exp", WR, exp_blocks, 3, 1, now - 10, PD_KVX_RESV_AM);
    uint64_t rwr = resv_new(tab, "req-wr", WR, wr_blocks, 3, 30, now, PD_KVX_RESV_AM);
    uint64_t rrg = resv_new(tab, "req-rg", WR, rg_blocks, 1, 30, now, PD_KVX_RESV_AM);
    int base = l.events;
    am_send_ok(peer, &c, "req-unknown", 0xdead, WR, bw, 3, 1);
    am_claim_ok(peer, &c, "req-unknown", 0xdead, WR, total);
    am_send_ok(peer, &c, "req-rel", rrel, WR, bw, 3, 2);
    am_claim_ok(peer, &c, "req-rel", rrel, WR, total);
    am_send_ok(peer, &c, "req-exp", rexp, WR, bw, 3, 3);
    am_claim_ok(peer, &c, "req-exp", rexp, WR, total);
    am_send_ok(peer, &c, "req-wr", rwr, WR + 1, bw, 3, 4);
    am_claim_ok(peer, &c, "req-wr", rwr, WR + 1, total);
    pd_kvx_block_write out[2] = {{src, 1, 0, 16}, {src, 0, BB - 8, 16}};
    am_send_ok(peer, &c, "req-rg", rrg, WR, out, 2, 5);
    wt.want = base + 4 * 4 + 2;
    pump(both, 2, have_events, &wt, 10, "the refusals");
    pump(both, 2, NULL, NULL, 0.05, "");
    assert_int_equal(l.events, base + 4 * 4 + 2);
    int n_unknown = 0, n_rel = 0, n_exp = 0, n_wr = 0, n_rg = 0;
    for (int i = base; i < l.events; i++) {
        switch (l.verdicts[i]) {
        case PD_KVX_REFUSED_UNKNOWN:
            n_unknown++;
            break;
        case PD_KVX_REFUSED_RELEASED:
            n_rel++;
            break;
        case PD_KVX_REFUSED_EXPIRED:
            n_exp++;
            break;
        case PD_KVX_REFUSED_WRITER:
            n_wr++;
            break;
        case PD_KVX_REFUSED_RANGE:
            n_rg++;
            break;
        default:
            fail_msg("unexpected verdict %s", pd_kvx_verdict_str(l.verdicts[i]));
        }
    }
    assert_int_equal(n_unknown, 4);
    assert_int_equal(n_rel, 4);
    assert_int_equal(n_exp, 4);
    assert_int_equal(n_wr, 4);
    assert_int_equal(n_rg, 2);
    assert_memory_equal(dst, snapshot, NB * BB); /* not one byte applied */
    assert_int_equal(c.errors, 0);               /* the sends themselves completed */

    pd_kvx_peer_close(&peer);
    pd_kvx_agent_free(&P);
    pd_kvx_pool_free(&dpool);
    pd_kvx_agent_free(&D);
    pd_kvx_resv_free(&tab);
    free(snapshot);
    free(dst);
    free(src);
}

/* ---- malformed blobs ---------------------------------------------------------- */

static void test_bad_blobs(void **state) {
    (void)state;
    pd_kvx_agent *P = agent_new(&T_TCP, "prefill", NULL, NULL);
    pd_kvx_agent *D = agent_new(&T_TCP, "decode", NULL, NULL);
    pd_err e = {{0}};
    pd_kvx_peer *p = NULL;
    uint8_t junk[64];
    memset(junk, 0xab, sizeof junk);
    assert_int_equal(pd_kvx_peer_connect(P, junk, sizeof junk, NULL, &p, &e), PD_ERR_FORMAT);
    assert_int_equal(pd_kvx_peer_connect(P, junk, 3, NULL, &p, &e), PD_ERR_FORMAT);
    assert_null(p);
    const void *addr;
    size_t alen;
    pd_kvx_agent_worker_address(D, &addr, &alen);
    assert_int_equal(pd_kvx_peer_connect(P, addr, alen - 1, NULL, &p, &e), PD_ERR_FORMAT);
    p = connect_to(P, D, NULL, NULL);
    assert_int_equal(pd_kvx_peer_add_rkey(p, junk, sizeof junk, &e), PD_ERR_FORMAT);
    uint8_t *mem = pool_alloc(BB);
    pd_kvx_pool *pool = pool_register(D, mem, BB);
    pd_kvx_pool *dup = NULL;
    assert_int_equal(pd_kvx_register_pool(D, mem + 4096, 4096, &dup, &e), PD_ERR_INVALID);
    const void *rk;
    size_t rkl;
    pd_kvx_pool_rkey(pool, &rk, &rkl);
    uint8_t *bad = malloc(rkl);
    memcpy(bad, rk, rkl);
    bad[rkl / 2] ^= 0; /* intact key, but a length that lies: */
    assert_int_equal(pd_kvx_peer_add_rkey(p, bad, rkl - 1, &e), PD_ERR_FORMAT);
    assert_int_equal(pd_kvx_peer_add_rkey(p, rk, rkl, &e), PD_OK);
    assert_int_equal(pd_kvx_peer_add_rkey(p, rk, rkl, &e), PD_ERR_INVALID);
    free(bad);
    pd_kvx_peer_close(&p);
    pd_kvx_pool_free(&pool);
    pd_kvx_agent_free(&P);
    pd_kvx_agent_free(&D);
    free(mem);
}

/* ---- cross-process ------------------------------------------------------------- */

typedef struct {
    pid_t pid;
    int fd;
} child;

static child child_start(const char *role, const tport *t, const char *arg) {
    child c = {0};
    c.pid = kvx_spawn_child(role, t->tls, t->dev, arg, &c.fd);
    assert_true(c.pid > 0);
    return c;
}

static void *child_expect(child *c, uint32_t type, uint32_t *len_p, const char *what) {
    uint32_t ty = 0, len = 0;
    void *buf = NULL;
    int r = kvx_sock_recv(c->fd, &ty, &buf, &len, 10000);
    if (r)
        fail_msg("child %s: %s (its stderr above says why)", what,
                 r == -2 ? "no answer within 10 s" : "connection closed");
    if (ty != type)
        fail_msg("child %s: message %u, expected %u", what, ty, type);
    if (len_p)
        *len_p = len;
    return buf;
}

/* Waits for the child to exit (SIGKILL after the deadline); its status. */
static int child_wait(child *c, double timeout_s) {
    int status = -1;
    double until = pd_now_s() + timeout_s;
    while (waitpid(c->pid, &status, WNOHANG) == 0) {
        if (pd_now_s() > until) {
            kill(c->pid, SIGKILL);
            waitpid(c->pid, &status, 0);
            break;
        }
        usleep(5000);
    }
    close(c->fd);
    c->pid = 0;
    return status;
}

/* A peer to the child's agent, with its pool key. */
static pd_kvx_peer *child_connect(pd_kvx_agent *a, child *c, bool want_rkey, void *user) {
    uint32_t len;
    void *addr = child_expect(c, MSG_ADDR, &len, "worker address");
    pd_err e = {{0}};
    pd_kvx_peer *p = NULL;
    if (pd_kvx_peer_connect(a, addr, len, user, &p, &e) != PD_OK)
        fail_msg("%s", e.msg);
    free(addr);
    if (want_rkey) {
        void *rk = child_expect(c, MSG_RKEY, &len, "remote key");
        if (pd_kvx_peer_add_rkey(p, rk, len, &e) != PD_OK)
            fail_msg("%s", e.msg);
        free(rk);
    }
    return p;
}

#define FORK_POOL ((size_t)64 << 20)

static void test_fork_put(void **state) {
    const tport *t = *state;
    char arg[32];
    snprintf(arg, sizeof arg, "%zu", FORK_POOL);
    child ch = child_start("target", t, arg);
    pd_kvx_agent *P = agent_new(t, "prefill", NULL, NULL);
    uint8_t *src = pool_alloc(FORK_POOL);
    const uint64_t seed = 1234;
    fill_pattern(src, FORK_POOL, seed);
    pd_kvx_pool *spool = pool_register(P, src, FORK_POOL);
    pd_kvx_peer *peer = child_connect(P, &ch, true, NULL);
    size_t n = FORK_POOL / BB;
    pd_kvx_iov *iov = calloc(n, sizeof *iov);
    for (size_t i = 0; i < n; i++)
        iov[i] = (pd_kvx_iov){src + i * BB, i * BB, BB};
    comp c = {0};
    pd_err e = {{0}};
    if (pd_kvx_put_batch(peer, iov, n, 0, on_done, &c, &e) != PD_OK)
        fail_msg("%s", e.msg);
    flush_ok(peer, &c);
    pump(&P, 1, flushed, &c, 20, "the flush to the child");
    assert_int_equal(c.flush_st, PD_OK);
    assert_int_equal(c.calls[0], 1);
    assert_int_equal(c.puts_seen_by_flush, 1);
    kvx_sock_send(ch.fd, MSG_VERIFY, &seed, sizeof seed);
    uint64_t *res = child_expect(&ch, MSG_RESULT, NULL, "verify");
    if (*res)
        fail_msg("child's pool differs from the source at byte %llu",
                 (unsigned long long)(*res - 1));
    free(res);
    kvx_sock_send(ch.fd, MSG_EXIT, NULL, 0);
    pd_kvx_peer_close(&peer);
    pump(&P, 1, NULL, NULL, 0.05, "");
    int status = child_wait(&ch, 10);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    pd_kvx_pool_free(&spool);
    pd_kvx_agent_free(&P);
    free(iov);
    free(src);
}

/* The target dies (SIGKILL) while puts to it are in flight: the writer
 * notices, every operation's callback fires once, nothing hangs. */
static void test_fork_target_killed(void **state) {
    const tport *t = *state;
    char arg[32];
    snprintf(arg, sizeof arg, "%zu", FORK_POOL);
    child ch = child_start("target", t, arg);
    fail_log f = {0};
    pd_kvx_agent *P = agent_new(t, "prefill", on_peer_failed, &f);
    uint8_t *src = pool_alloc(FORK_POOL);
    pd_kvx_pool *spool = pool_register(P, src, FORK_POOL);
    pd_kvx_peer *peer = child_connect(P, &ch, true, NULL);
    size_t n = FORK_POOL / BB;
    pd_kvx_iov *iov = calloc(n, sizeof *iov);
    for (size_t i = 0; i < n; i++)
        iov[i] = (pd_kvx_iov){src + i * BB, i * BB, BB};
    comp c = {0};
    pd_err e = {{0}};
    int issued = 0;
    bool killed = false;
    double until = pd_now_s() + 10;
    while (!f.failed) {
        if (pd_now_s() > until)
            fail_msg("the writer did not notice its target die within 10 s");
        if (issued - c.total < 2 && !pd_kvx_peer_failed(peer)) {
            pd_status st = pd_kvx_put_batch(peer, iov, n, 0, on_done, &c, &e);
            if (st == PD_OK)
                issued++;
            else
                assert_int_equal(st, PD_ERR_IO);
        }
        if (!killed && c.total >= 1) { /* one batch landed: kill mid-transfer */
            kill(ch.pid, SIGKILL);
            killed = true;
        }
        pump(&P, 1, NULL, NULL, 0.01, "");
    }
    assert_true(killed);
    assert_int_equal(c.total, issued); /* every callback came before on_peer_failed */
    assert_int_equal(f.failed, 1);
    assert_int_equal(f.st, PD_ERR_IO);
    assert_ptr_equal(f.peer, peer);
    pump(&P, 1, NULL, NULL, 0.1, "");
    assert_int_equal(c.total, issued); /* every batch answered exactly once */
    assert_int_equal(c.calls[0], issued);
    assert_int_equal(pd_kvx_put(peer, src, BB, 0, 1, on_done, &c, &e), PD_ERR_IO);
    assert_int_equal(pd_kvx_flush(peer, 1, on_done, &c, &e), PD_ERR_IO);
    print_message("    [%s] target killed after %d batch(es) issued, %d failed; reason: %s\n",
                  t->tls, issued, c.errors, f.reason);
    child_wait(&ch, 5);
    double t0 = pd_now_s();
    pd_kvx_peer_close(&peer);
    pd_kvx_pool_free(&spool);
    pd_kvx_agent_free(&P);
    assert_true(pd_now_s() - t0 < 5);
    assert_int_equal(f.failed, 1);
    free(iov);
    free(src);
}

/* The writer dies mid-transfer: the decode side notices through its own
 * endpoint to the writer, and the writer's reservations go back. */
static void test_fork_writer_killed(void **state) {
    const tport *t = *state;
    child ch = child_start("writer", t, "-");
    fail_log f = {0};
    pd_kvx_agent *D = agent_new(t, "decode", on_peer_failed, &f);
    uint8_t *dst = pool_alloc(NB * BB);
    pd_kvx_pool *dpool = pool_register(D, dst, NB * BB);
    resv_log l = {0};
    pd_kvx_reservations *tab = table_new(&l, 0);
    const uint64_t WR = 9;
    int32_t blocks[] = {1, 2, 3, 4};
    uint64_t r = resv_new(tab, "req-w", WR, blocks, 4, 60, pd_now_s(), 0);
    pd_kvx_peer *to_writer = child_connect(D, &ch, false, (void *)(uintptr_t)WR);
    /* A flush establishes the connection that carries liveness. */
    comp c = {0};
    flush_ok(to_writer, &c);
    pump(&D, 1, flushed, &c, 10, "the connection to the writer");
    const void *addr, *rk;
    size_t alen, rkl;
    pd_kvx_agent_worker_address(D, &addr, &alen);
    pd_kvx_pool_rkey(dpool, &rk, &rkl);
    kvx_sock_send(ch.fd, MSG_ADDR, addr, (uint32_t)alen);
    kvx_sock_send(ch.fd, MSG_RKEY, rk, (uint32_t)rkl);
    /* Progress while waiting: over TCP the target's worker moves the data. */
    double until = pd_now_s() + 10;
    struct pollfd pfd = {ch.fd, POLLIN, 0};
    while (poll(&pfd, 1, 0) == 0) {
        if (pd_now_s() > until)
            fail_msg("the writer child made no progress in 10 s");
        pump(&D, 1, NULL, NULL, 0.01, "");
    }
    free(child_expect(&ch, MSG_PROGRESS, NULL, "progress"));
    kill(ch.pid, SIGKILL);
    pump(&D, 1, peer_failed, &f, 10, "the decode side to notice the writer died");
    assert_int_equal(f.failed, 1);
    assert_ptr_equal(f.peer, to_writer);
    /* The service maps the failed peer to its writer id and tells the table. */
    assert_int_equal(pd_kvx_resv_writer_gone(tab, (uint64_t)(uintptr_t)pd_kvx_peer_user(f.peer)),
                     1);
    assert_int_equal(l.freed_calls, 1);
    assert_int_equal(l.last_resv, r);
    assert_int_equal(l.n_freed, 4);
    pd_err e = {{0}};
    assert_int_equal(pd_kvx_resv_complete(tab, "req-w", r, WR, 0, pd_now_s(), &e),
                     PD_KVX_REFUSED_EXPIRED);
    print_message("    [%s] writer death seen as: %s\n", t->tls, f.reason);
    child_wait(&ch, 5);
    pd_kvx_peer_close(&to_writer);
    pd_kvx_resv_free(&tab);
    pd_kvx_pool_free(&dpool);
    pd_kvx_agent_free(&D);
    free(dst);
}

/* ---- the child side ------------------------------------------------------------ */

/* target: a decode-like process with a zeroed pool. Sends its address and
 * key, then serves: VERIFY(seed) compares the pool with the pattern. */
static int child_target(const tport *t, size_t bytes) {
    int fd = 3;
    pd_kvx_config cfg = {.name = "child-target", .transports = t->tls, .net_devices = t->dev};
    pd_kvx_agent *a = NULL;
    pd_err e = {{0}};
    if (pd_kvx_agent_init(&cfg, &a, &e) != PD_OK) {
        fprintf(stderr, "child target: %s\n", e.msg);
        return 2;
    }
    uint8_t *pool = aligned_alloc(4096, bytes);
    memset(pool, 0, bytes);
    pd_kvx_pool *p = NULL;
    if (pd_kvx_register_pool(a, pool, bytes, &p, &e) != PD_OK) {
        fprintf(stderr, "child target: %s\n", e.msg);
        return 2;
    }
    const void *addr, *rk;
    size_t alen, rkl;
    pd_kvx_agent_worker_address(a, &addr, &alen);
    pd_kvx_pool_rkey(p, &rk, &rkl);
    kvx_sock_send(fd, MSG_ADDR, addr, (uint32_t)alen);
    kvx_sock_send(fd, MSG_RKEY, rk, (uint32_t)rkl);
    for (;;) {
        while (pd_kvx_agent_progress(a)) {
        }
        struct pollfd pfd[2] = {{pd_kvx_agent_event_fd(a), POLLIN, 0}, {fd, POLLIN, 0}};
        poll(pfd, 2, 1000);
        if (!(pfd[1].revents & (POLLIN | POLLHUP)))
            continue;
        uint32_t ty, len;
        void *buf;
        if (kvx_sock_recv(fd, &ty, &buf, &len, 5000) != 0)
            break;
        if (ty == MSG_VERIFY) {
            uint64_t seed;
            memcpy(&seed, buf, sizeof seed);
            uint8_t *want = malloc(bytes);
            fill_pattern(want, bytes, seed);
            uint64_t res = 0;
            for (size_t i = 0; i < bytes; i++)
                if (want[i] != pool[i]) {
                    res = i + 1;
                    break;
                }
            free(want);
            kvx_sock_send(fd, MSG_RESULT, &res, sizeof res);
        }
        free(buf);
        if (ty == MSG_EXIT)
            break;
    }
    pd_kvx_pool_free(&p);
    pd_kvx_agent_free(&a);
    free(pool);
    return 0;
}

static void child_on_done(void *user, uint64_t tag, pd_status st) {
    (void)tag, (void)st;
    int *n = user;
    (*n)++;
}

/* writer: a prefill-like process that writes into the parent's pool in a
 * loop until it is killed; PROGRESS after its first flush completes. */
static int child_writer(const tport *t) {
    int fd = 3;
    alarm(30);
    pd_kvx_config cfg = {.name = "child-writer", .transports = t->tls, .net_devices = t->dev};
    pd_kvx_agent *a = NULL;
    pd_err e = {{0}};
    if (pd_kvx_agent_init(&cfg, &a, &e) != PD_OK) {
        fprintf(stderr, "child writer: %s\n", e.msg);
        return 2;
    }
    const void *addr;
    size_t alen;
    pd_kvx_agent_worker_address(a, &addr, &alen);
    kvx_sock_send(fd, MSG_ADDR, addr, (uint32_t)alen);
    uint32_t ty[2] = {0, 0}, len[2] = {0, 0};
    void *buf[2] = {NULL, NULL};
    /* Progress while waiting for the parent: it connects to us first. */
    for (int got = 0; got < 2;) {
        while (pd_kvx_agent_progress(a)) {
        }
        struct pollfd pfd[2] = {{pd_kvx_agent_event_fd(a), POLLIN, 0}, {fd, POLLIN, 0}};
        poll(pfd, 2, 100);
        if ((pfd[1].revents & POLLIN) &&
            kvx_sock_recv(fd, &ty[got], &buf[got], &len[got], 5000) == 0)
            got++;
    }
    pd_kvx_peer *p = NULL;
    if (ty[0] != MSG_ADDR || ty[1] != MSG_RKEY ||
        pd_kvx_peer_connect(a, buf[0], len[0], NULL, &p, &e) != PD_OK ||
        pd_kvx_peer_add_rkey(p, buf[1], len[1], &e) != PD_OK) {
        fprintf(stderr, "child writer: %s\n", e.msg);
        return 2;
    }
    uint8_t *src = aligned_alloc(4096, 4 * BB);
    fill_pattern(src, 4 * BB, 77);
    pd_kvx_iov iov[4];
    for (int i = 0; i < 4; i++)
        iov[i] = (pd_kvx_iov){src + i * BB, (uint64_t)(1 + i) * BB, BB};
    int done = 0, issued = 0;
    bool told = false;
    for (;;) {
        if (issued - done < 2) {
            if (pd_kvx_put_batch(p, iov, 4, 0, child_on_done, &done, &e) == PD_OK)
                issued++;
            if (pd_kvx_flush(p, 0, child_on_done, &done, &e) == PD_OK)
                issued++;
        }
        while (pd_kvx_agent_progress(a)) {
        }
        if (!told && done >= 2) {
            kvx_sock_send(fd, MSG_PROGRESS, NULL, 0);
            told = true;
        }
        struct pollfd pfd = {pd_kvx_agent_event_fd(a), POLLIN, 0};
        poll(&pfd, 1, 10);
    }
}

static int child_main(int argc, char **argv) {
    if (argc < 6)
        return 2;
    tport t = {argv[3], strcmp(argv[4], "-") ? argv[4] : NULL};
    if (!strcmp(argv[2], "target"))
        return child_target(&t, strtoull(argv[5], NULL, 10));
    if (!strcmp(argv[2], "writer"))
        return child_writer(&t);
    return 2;
}

/* Each transport-dependent test runs once per transport, named test/tls. */
#define BOTH(f)                                                                                    \
    {#f "/shm", f, NULL, NULL, &T_SHM}, {                                                          \
#f "/tcp", f, NULL, NULL, &T_TCP                                                           \
    }

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--kvx-child"))
        _exit(child_main(argc, argv));
    signal(SIGPIPE, SIG_IGN);
    /* Refusals are logged as warnings by design; keep the test output to
     * errors unless PDSERVE_LOG_LEVEL asks for more. */
    if (!getenv("PDSERVE_LOG_LEVEL"))
        pd_log_set_level(PD_LOG_ERROR);
    /* KVX_TEST_FILTER="test_put*" runs a subset (cmocka glob). */
    if (getenv("KVX_TEST_FILTER"))
        cmocka_set_test_filter(getenv("KVX_TEST_FILTER"));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_resv_table),
        cmocka_unit_test(test_resv_lease_reclaim),
        cmocka_unit_test(test_bad_blobs),
        BOTH(test_put_blocks),
        BOTH(test_put_batch),
        BOTH(test_alloc_pool),
        BOTH(test_peer_fail_declared),
        BOTH(test_fail_from_callback),
        BOTH(test_one_sided_protocol),
        BOTH(test_am_writes),
        BOTH(test_fork_put),
        BOTH(test_fork_target_killed),
        BOTH(test_fork_writer_killed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

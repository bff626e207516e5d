/* The router's handling of replica messages, with a real router and
 * gateway on one loop and fake replicas (ZeroMQ DEALERs that send what a
 * replica would). Regression tests for what tests/fuzz/fuzz_msg and the
 * fault matrix (tests/faults/) found. */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>
#include <event2/event.h>
#include <jansson.h>

#include "pd_gateway.h"
#include "pd_msg.h"
#include "pd_router.h"

typedef struct {
    struct event_base *base;
    pd_tokenizer *tok;
    pd_router *router;
    pd_gw_server *gw;
    void *zctx, *decode, *prefill, *decode_new;   /* decode_new: never registers */
    void *decode2;                                /* a second decode replica, "t-decode2" */
    bool beat_decode, beat_prefill, beat_decode2; /* the fakes send heartbeats while pumping */
    /* what the fake decode replicas report: free cache blocks (of 100), free
     * and total KV staging slots (total 0: no staging pool) */
    uint32_t dec_free_b, dec_free_s, dec_total_s;
    uint32_t dec2_free_b, dec2_free_s, dec2_total_s;
    double last_beat;
    char endpoint[128];
} fixture;

#define HB_MS           200 /* a replica is out of rotation after 3 missed heartbeats */
#define QUEUE_TIMEOUT_S 3.0 /* --queue-timeout */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void beat(void *sock, const char *id, uint32_t free_b, uint32_t free_s, uint32_t total_s) {
    Pdserve__Heartbeat h = PDSERVE__HEARTBEAT__INIT;
    h.replica_id = (char *)id;
    h.total_blocks = 100;
    h.free_blocks = free_b;
    h.free_staging_slots = free_s;
    h.total_staging_slots = total_s;
    pd_msg_send(sock, NULL, 0, PD_MSG_HEARTBEAT, &h.base);
}

static void pump(fixture *f, int ms) {
    for (int i = 0; i < ms; i++) {
        if (now_s() - f->last_beat > HB_MS / 4000.0) {
            if (f->beat_decode)
                beat(f->decode, "t-decode", f->dec_free_b, f->dec_free_s, f->dec_total_s);
            if (f->beat_decode2)
                beat(f->decode2, "t-decode2", f->dec2_free_b, f->dec2_free_s, f->dec2_total_s);
            if (f->beat_prefill)
                beat(f->prefill, "t-prefill", 100, 0, 0);
            f->last_beat = now_s();
        }
        event_base_loop(f->base, EVLOOP_NONBLOCK);
        usleep(1000);
    }
}

/* Waits for a message of type t at a fake replica (others are dropped). */
static bool wait_msg(fixture *f, void *sock, pd_msg_type t, pd_msg *out) {
    for (int i = 0; i < 5000; i++) {
        pd_err err;
        pd_status st = pd_msg_recv(sock, false, out, &err);
        if (st == PD_OK && out->type == t)
            return true;
        if (st == PD_OK)
            pd_msg_clear(out);
        pump(f, 1);
    }
    return false;
}

static void *fake_replica(fixture *f, const char *id) {
    void *s = zmq_socket(f->zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, ZMQ_ROUTING_ID, id, strlen(id));
    zmq_connect(s, f->endpoint);
    return s;
}

/* (Re)registers a fake replica as process `pid` with a KV staging pool of
 * `slots` slots (0: none); true when accepted. */
static bool register_replica_slots(fixture *f, void *sock, const char *role, const char *id,
                                   uint32_t pid, uint32_t slots) {
    Pdserve__KvGeometry geo = PDSERVE__KV_GEOMETRY__INIT;
    geo.block_size = 16;
    geo.num_layers = 2;
    geo.kv_lora_rank = 16;
    geo.num_blocks = 100;
    Pdserve__Register r = PDSERVE__REGISTER__INIT;
    r.role = (char *)role;
    r.replica_id = (char *)id;
    r.geometry = &geo;
    r.pid = pid;
    r.kv_staging_slots = slots;
    pd_msg_send(sock, NULL, 0, PD_MSG_REGISTER, &r.base);
    for (;;) { /* skip "unknown replica" answers to heartbeats sent before */
        pd_msg m;
        if (!wait_msg(f, sock, PD_MSG_REGISTER_REPLY, &m))
            return false;
        Pdserve__RegisterReply *rep = (Pdserve__RegisterReply *)m.msg;
        bool ok = rep->accepted, stale = !ok && strstr(rep->reason, "unknown replica");
        pd_msg_clear(&m);
        if (!stale)
            return ok;
    }
}

static bool register_replica_pid(fixture *f, void *sock, const char *role, const char *id,
                                 uint32_t pid) {
    return register_replica_slots(f, sock, role, id, pid, 0);
}

static bool register_replica(fixture *f, void *sock, const char *role, const char *id) {
    return register_replica_pid(f, sock, role, id, 0);
}

/* Both fakes registered and beating, nothing queued at either. */
static void fakes_fresh(fixture *f) {
    f->beat_decode = f->beat_prefill = false;
    f->dec_free_b = 100;
    f->dec_free_s = f->dec_total_s;
    assert_true(register_replica_slots(f, f->decode, "decode", "t-decode", 0, f->dec_total_s));
    assert_true(register_replica(f, f->prefill, "prefill", "t-prefill"));
    f->beat_decode = f->beat_prefill = true;
    pump(f, 50);
    pd_msg m;
    pd_err err;
    while (pd_msg_recv(f->decode, false, &m, &err) == PD_OK)
        pd_msg_clear(&m);
    while (pd_msg_recv(f->prefill, false, &m, &err) == PD_OK)
        pd_msg_clear(&m);
}

static int setup(void **state) {
    signal(SIGPIPE, SIG_IGN);
    fixture *f = calloc(1, sizeof *f);
    char path[1024];
    const char *cache = getenv("PD_CACHE_DIR");
    snprintf(path, sizeof path, "%s/tokenizer-deepseek_v3/tokenizer.json",
             cache && *cache ? cache : PD_SOURCE_DIR "/.cache");
    pd_err err = {{0}};
    if (pd_tok_load(path, &f->tok, &err) != PD_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    f->base = event_base_new();
    snprintf(f->endpoint, sizeof f->endpoint, "ipc:///tmp/pdserve-test-router-%d.sock",
             (int)getpid());
    pd_router_config rc = {.control_endpoint = f->endpoint,
                           .long_prompt_threshold = 8,
                           .heartbeat_interval_ms = HB_MS,
                           .block_size = 16,
                           .queue_timeout_s = QUEUE_TIMEOUT_S,
                           .model_name = "test-model"};
    if (pd_router_init(f->base, &rc, &f->router, &err) != PD_OK)
        return -1;
    pd_gw_config cfg;
    pd_gw_config_defaults(&cfg);
    cfg.host = "127.0.0.1";
    cfg.port = 0;
    cfg.served_model_name = "test-model";
    cfg.max_model_len = 4096;
    cfg.tokenizer_handle = f->tok;
    if (pd_gw_server_init(f->base, &cfg, pd_router_engine(), f->router, &f->gw, &err) != PD_OK)
        return -1;
    pd_router_attach(f->router, f->gw);

    f->zctx = zmq_ctx_new();
    f->decode = fake_replica(f, "t-decode");
    f->prefill = fake_replica(f, "t-prefill");
    f->decode_new = fake_replica(f, "t-decode-new");
    f->decode2 = fake_replica(f, "t-decode2");
    f->dec_free_b = 100;
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    pd_gw_server_free(&f->gw);
    pd_router_free(&f->router);
    zmq_close(f->decode);
    zmq_close(f->prefill);
    zmq_close(f->decode_new);
    zmq_close(f->decode2);
    zmq_ctx_term(f->zctx);
    event_base_loop(f->base, EVLOOP_NONBLOCK); /* what pd_gw_server_free left to the loop */
    event_base_free(f->base);
    pd_tok_free(&f->tok);
    /* the socket file ZeroMQ's ipc listener leaves behind */
    unlink(f->endpoint + strlen("ipc://"));
    free(f);
    return 0;
}

/* A POST on a fresh connection (Connection: close); returns the socket. */
static int post(fixture *f, const char *body) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)pd_gw_server_port(f->gw)),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    char req[16384];
    int n = snprintf(req, sizeof req,
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    assert_int_equal(send(fd, req, (size_t)n, 0), n);
    return fd;
}

/* Reads the whole response (the server closes). */
static char *read_all(fixture *f, int fd) {
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    for (int i = 0; i < 5000; i++) {
        pump(f, 1);
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 0) <= 0)
            continue;
        if (len + 1024 > cap)
            buf = realloc(buf, cap *= 2);
        ssize_t r = recv(fd, buf + len, cap - len - 1, 0);
        if (r <= 0)
            break;
        len += (size_t)r;
    }
    buf[len] = 0;
    close(fd);
    return buf;
}

/* A heartbeat from a replica the router does not know is answered "register
 * again" naming the heartbeat's registration, which the replica compares
 * with its current one (a refusal of a heartbeat read before its Register
 * must not make it register twice: common/heartbeat.c). */
static void test_heartbeat_refusal_names_its_registration(void **state) {
    fixture *f = *state;
    const uint64_t regs[] = {0, 1, 7, UINT64_C(1) << 40};
    for (size_t i = 0; i < sizeof regs / sizeof *regs; i++) {
        Pdserve__Heartbeat h = PDSERVE__HEARTBEAT__INIT;
        h.replica_id = "t-decode-new";
        h.registration = regs[i];
        pd_msg_send(f->decode_new, NULL, 0, PD_MSG_HEARTBEAT, &h.base);
        pd_msg m;
        assert_true(wait_msg(f, f->decode_new, PD_MSG_REGISTER_REPLY, &m));
        const Pdserve__RegisterReply *rep = (const Pdserve__RegisterReply *)m.msg;
        assert_false(rep->accepted);
        assert_non_null(strstr(rep->reason, "unknown replica"));
        assert_true(rep->heartbeat_registration == regs[i]);
        pd_msg_clear(&m);
    }
}

/* A replica killed and started again before its heartbeats are missed
 * registers under its id from another process. A request the old process
 * held that had produced output fails at once with 503 "... restarted" (it
 * used to wait for its deadline); one that had produced nothing is routed
 * again (session 13), here to the new process, which serves it; the same
 * process resending its Register changes nothing. */
static void test_restarted_replica_fails_its_requests(void **state) {
    fixture *f = *state;
    fakes_fresh(f);
    assert_true(register_replica_pid(f, f->decode, "decode", "t-decode", 4242));
    pd_msg m;
    char rid_a[160], rid_b[160];
    int fd_a = post(f, "{\"prompt\":\"hi\",\"max_tokens\":4}");
    assert_true(wait_msg(f, f->decode, PD_MSG_GENERATE, &m));
    snprintf(rid_a, sizeof rid_a, "%s", ((Pdserve__Generate *)m.msg)->request_id);
    pd_msg_clear(&m);
    int32_t ids[1] = {5};
    Pdserve__Tokens t = PDSERVE__TOKENS__INIT;
    t.request_id = rid_a;
    t.ids = ids;
    t.n_ids = 1;
    assert_int_equal(pd_msg_send(f->decode, NULL, 0, PD_MSG_TOKENS, &t.base), PD_OK); /* a's first token */
    int fd_b = post(f, "{\"prompt\":\"ho\",\"max_tokens\":4}");
    assert_true(wait_msg(f, f->decode, PD_MSG_GENERATE, &m));
    snprintf(rid_b, sizeof rid_b, "%s", ((Pdserve__Generate *)m.msg)->request_id);
    pd_msg_clear(&m);
    assert_true(
        register_replica_pid(f, f->decode, "decode", "t-decode", 4242)); /* resent: nothing fails */
    struct pollfd p[2] = {{fd_a, POLLIN, 0}, {fd_b, POLLIN, 0}};
    pump(f, 100);
    assert_int_equal(poll(p, 2, 0), 0);
    assert_true(register_replica_pid(f, f->decode, "decode", "t-decode", 4343)); /* a new process */
    char *resp = read_all(f, fd_a);
    assert_non_null(strstr(resp, "HTTP/1.1 503"));
    assert_non_null(strstr(resp, "decode replica t-decode restarted"));
    free(resp);
    /* b had produced nothing: sent again, to the new process, which serves
     * it, under a new id (<id>.1: a late message about its first attempt
     * must not reach this one) */
    assert_true(wait_msg(f, f->decode, PD_MSG_GENERATE, &m));
    char rid_b1[170];
    snprintf(rid_b1, sizeof rid_b1, "%s.1", rid_b);
    assert_string_equal(((Pdserve__Generate *)m.msg)->request_id, rid_b1);
    pd_msg_clear(&m);
    t.request_id = rid_b1;
    t.finished = true;
    t.finish_reason = "length";
    assert_int_equal(pd_msg_send(f->decode, NULL, 0, PD_MSG_TOKENS, &t.base), PD_OK);
    resp = read_all(f, fd_b);
    assert_non_null(strstr(resp, "HTTP/1.1 200"));
    assert_non_null(strstr(resp, "\"finish_reason\":\"length\""));
    free(resp);
}

/* A replica's finish_reason other than "stop"/"length" reached
 * pd_gw_on_finish as a pointer into the unpacked Tokens message, which was
 * freed before the response was written: heap-use-after-free. Now such a
 * reason is answered as "stop". */
static void test_tokens_unknown_finish_reason(void **state) {
    fixture *f = *state;
    fakes_fresh(f);
    int fd = post(f, "{\"prompt\":\"hi\",\"max_tokens\":4}");
    pd_msg m;
    assert_true(wait_msg(f, f->decode, PD_MSG_GENERATE, &m));
    char rid[160];
    snprintf(rid, sizeof rid, "%s", ((Pdserve__Generate *)m.msg)->request_id);
    pd_msg_clear(&m);
    char *reason = strdup("replica-specific-reason");
    int32_t ids[1] = {5};
    Pdserve__Tokens t = PDSERVE__TOKENS__INIT;
    t.request_id = rid;
    t.ids = ids;
    t.n_ids = 1;
    t.finished = true;
    t.finish_reason = reason;
    assert_int_equal(pd_msg_send(f->decode, NULL, 0, PD_MSG_TOKENS, &t.base), PD_OK);
    free(reason);
    char *resp = read_all(f, fd);
    assert_non_null(strstr(resp, "HTTP/1.1 200"));
    assert_non_null(strstr(resp, "\"finish_reason\":\"stop\""));
    free(resp);
}

/* A long request: the fake decode replica reserves, the fake prefill
 * replica is told to write. Returns the HTTP socket; rid gets the id. */
static int long_request_prefilling(fixture *f, char *rid, size_t n) {
    int fd = post(f, "{\"prompt\":\"one two three four five six seven eight nine ten\","
                     "\"max_tokens\":4}");
    pd_msg m;
    assert_true(wait_msg(f, f->decode, PD_MSG_GENERATE, &m));
    Pdserve__Generate *g = (Pdserve__Generate *)m.msg;
    assert_true(g->kv_reserved);
    snprintf(rid, n, "%s", g->request_id);
    pd_msg_clear(&m);
    uint32_t blocks[2] = {1, 2};
    Pdserve__ReserveReply rr = PDSERVE__RESERVE_REPLY__INIT;
    rr.request_id = rid;
    rr.ok = true;
    rr.reservation_id = 7;
    rr.block_ids = blocks;
    rr.n_block_ids = 2;
    pd_msg_send(f->decode, NULL, 0, PD_MSG_RESERVE_REPLY, &rr.base);
    assert_true(wait_msg(f, f->prefill, PD_MSG_PREFILL, &m));
    pd_msg_clear(&m);
    return fd;
}

/* A prefill replica that fails a long request (its KV transfer to a decode
 * replica that died) sends Tokens{error}; the answer named the request's
 * decode replica, which had reported nothing, so an operator looked in the
 * wrong replica's log. It names the sender. */
static void test_prefill_error_names_prefill(void **state) {
    fixture *f = *state;
    fakes_fresh(f);
    char rid[160];
    int fd = long_request_prefilling(f, rid, sizeof rid);
    Pdserve__Tokens t = PDSERVE__TOKENS__INIT;
    t.request_id = rid;
    t.finished = true;
    t.error = "KV transfer to the decode replica failed";
    assert_int_equal(pd_msg_send(f->prefill, NULL, 0, PD_MSG_TOKENS, &t.base), PD_OK);
    char *resp = read_all(f, fd);
    assert_non_null(strstr(resp, "HTTP/1.1 500"));
    assert_non_null(strstr(resp, "replica t-prefill: KV transfer to the decode replica failed"));
    assert_null(strstr(resp, "t-decode"));
    free(resp);
    /* the same error from the decode replica names the decode replica */
    fd = post(f, "{\"prompt\":\"hi\",\"max_tokens\":4}");
    pd_msg m;
    assert_true(wait_msg(f, f->decode, PD_MSG_GENERATE, &m));
    snprintf(rid, sizeof rid, "%s", ((Pdserve__Generate *)m.msg)->request_id);
    pd_msg_clear(&m);
    t.request_id = rid;
    t.error = "out of KV blocks";
    assert_int_equal(pd_msg_send(f->decode, NULL, 0, PD_MSG_TOKENS, &t.base), PD_OK);
    resp = read_all(f, fd);
    assert_non_null(strstr(resp, "replica t-decode: out of KV blocks"));
    free(resp);
}

/* The decode replica stalls (SIGSTOP) past its heartbeats while a prefill
 * replica writes into its reservation: the request fails, the prefill
 * replica is told to stop and answers KvComplete(aborted). That KvComplete
 * was dropped because the decode replica was out of rotation, so its
 * reservation stayed quarantined for good after it resumed (its KV free
 * blocks never came back). It must be forwarded. */
static void test_kv_complete_reaches_stalled_decode(void **state) {
    fixture *f = *state;
    fakes_fresh(f);
    char rid[160];
    int fd = long_request_prefilling(f, rid, sizeof rid);
    f->beat_decode = false; /* stalls */
    char *resp = read_all(f, fd);
    assert_non_null(strstr(resp, "stopped responding"));
    free(resp);
    pd_msg m;
    assert_true(wait_msg(f, f->prefill, PD_MSG_ABORT, &m));
    pd_msg_clear(&m);
    Pdserve__KvComplete k = PDSERVE__KV_COMPLETE__INIT;
    k.request_id = rid;
    k.reservation_id = 7;
    k.aborted = true;
    k.decode_replica_id = "t-decode";
    k.prefill_replica_id = "t-prefill";
    pd_msg_send(f->prefill, NULL, 0, PD_MSG_KV_COMPLETE, &k.base);
    assert_true(wait_msg(f, f->decode, PD_MSG_KV_COMPLETE, &m));
    Pdserve__KvComplete *got = (Pdserve__KvComplete *)m.msg;
    assert_string_equal(got->request_id, rid);
    assert_true(got->aborted);
    pd_msg_clear(&m);
}

/* The decode replica stalls before answering Reserve; the request fails.
 * When it resumes, its ReserveReply is for nobody: the router must tell it
 * to give the blocks back (never granted) even though it is out of
 * rotation, or the reservation leaks the same way. */
static void test_reserve_reply_from_stalled_decode(void **state) {
    fixture *f = *state;
    fakes_fresh(f);
    int fd = post(f, "{\"prompt\":\"one two three four five six seven eight nine ten\","
                     "\"max_tokens\":4}");
    pd_msg m;
    assert_true(wait_msg(f, f->decode, PD_MSG_GENERATE, &m));
    char rid[160];
    snprintf(rid, sizeof rid, "%s", ((Pdserve__Generate *)m.msg)->request_id);
    pd_msg_clear(&m);
    f->beat_decode = false;
    char *resp = read_all(f, fd);
    assert_non_null(strstr(resp, "stopped responding"));
    free(resp);
    uint32_t blocks[1] = {3};
    Pdserve__ReserveReply rr = PDSERVE__RESERVE_REPLY__INIT;
    rr.request_id = rid;
    rr.ok = true;
    rr.reservation_id = 9;
    rr.block_ids = blocks;
    rr.n_block_ids = 1;
    pd_msg_send(f->decode, NULL, 0, PD_MSG_RESERVE_REPLY, &rr.base);
    assert_true(wait_msg(f, f->decode, PD_MSG_ABORT, &m));
    Pdserve__Abort *a = (Pdserve__Abort *)m.msg;
    assert_string_equal(a->request_id, rid);
    assert_true(a->never_granted);
    pd_msg_clear(&m);
}

/* A restarted gateway hears what replicas queued while it was down before
 * they register again: a prefill replica's KvComplete for a request of the
 * old gateway, a decode replica's ReserveReply. Dropped, they left the
 * decode replica's reservation quarantined for good (fault matrix:
 * kill-gateway while a prefill runs). They go to the replica by its
 * routing id (its replica id) / to the sender. */
static void test_unregistered_decode_hears_leftovers(void **state) {
    fixture *f = *state;
    fakes_fresh(f);
    void *d2 = f->decode_new; /* connected, never registered */
    Pdserve__KvComplete k = PDSERVE__KV_COMPLETE__INIT;
    k.request_id = "cmpl-of-the-old-gateway-0";
    k.reservation_id = 11;
    k.decode_replica_id = "t-decode-new";
    k.prefill_replica_id = "t-prefill";
    pd_msg_send(f->prefill, NULL, 0, PD_MSG_KV_COMPLETE, &k.base);
    pd_msg m;
    assert_true(wait_msg(f, d2, PD_MSG_KV_COMPLETE, &m));
    assert_true(((Pdserve__KvComplete *)m.msg)->aborted);
    pd_msg_clear(&m);
    Pdserve__ReserveReply rr = PDSERVE__RESERVE_REPLY__INIT;
    rr.request_id = "cmpl-of-the-old-gateway-1";
    rr.ok = true;
    rr.reservation_id = 12;
    pd_msg_send(d2, NULL, 0, PD_MSG_RESERVE_REPLY, &rr.base);
    assert_true(wait_msg(f, d2, PD_MSG_ABORT, &m));
    Pdserve__Abort *a = (Pdserve__Abort *)m.msg;
    assert_string_equal(a->request_id, "cmpl-of-the-old-gateway-1");
    assert_true(a->never_granted);
    pd_msg_clear(&m);
}

/* Top logprobs from a replica (Tokens.top_logprobs) reach the response:
 * cut to what the request asked for; malformed ones (not one entry per id,
 * ids and logprobs of different lengths) are dropped, the sampled token's
 * logprob still shown. */
static json_t *response_logprobs(fixture *f, int fd) {
    char *resp = read_all(f, fd);
    assert_non_null(strstr(resp, "HTTP/1.1 200"));
    const char *body = strstr(resp, "\r\n\r\n");
    assert_non_null(body);
    json_error_t e;
    json_t *j = json_loads(body + 4, 0, &e);
    free(resp);
    assert_non_null(j);
    json_t *lp =
        json_incref(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"));
    json_decref(j);
    return lp;
}

/* A token's bytes as a C string (the ids used here are ASCII). */
static const char *tok_text(const pd_tokenizer *tok, int32_t id) {
    static char buf[4][64];
    static int slot;
    size_t n = 0;
    const char *b = pd_tok_token_bytes(tok, id, &n);
    char *out = buf[slot++ % 4];
    snprintf(out, 64, "%.*s", (int)n, b ? b : "");
    return out;
}

static void test_tokens_top_logprobs(void **state) {
    fixture *f = *state;
    for (int malformed = 0; malformed < 3; malformed++) {
        int fd = post(f, "{\"prompt\":\"hi\",\"max_tokens\":2,\"logprobs\":2}");
        pd_msg m;
        assert_true(wait_msg(f, f->decode, PD_MSG_GENERATE, &m));
        Pdserve__Generate *g = (Pdserve__Generate *)m.msg;
        assert_int_equal(g->logprobs, 2);
        char rid[160];
        snprintf(rid, sizeof rid, "%s", g->request_id);
        pd_msg_clear(&m);
        int32_t ids[2] = {300, 301};
        float lps[2] = {-0.5f, -1.0f};
        int32_t a_ids[3] = {300, 302, 303}, b_ids[2] = {304, 301};
        float a_lps[3] = {-0.5f, -0.75f, -0.875f}, b_lps[2] = {-0.625f, -1.0f};
        Pdserve__TopLogprobs a = PDSERVE__TOP_LOGPROBS__INIT, b = PDSERVE__TOP_LOGPROBS__INIT;
        a.ids = a_ids;
        a.n_ids = 3;
        a.logprobs = a_lps;
        a.n_logprobs = malformed == 2 ? 2 : 3;
        b.ids = b_ids;
        b.n_ids = 2;
        b.logprobs = b_lps;
        b.n_logprobs = 2;
        Pdserve__TopLogprobs *top[2] = {&a, &b};
        Pdserve__Tokens t = PDSERVE__TOKENS__INIT;
        t.request_id = rid;
        t.ids = ids;
        t.n_ids = 2;
        t.logprobs = lps;
        t.n_logprobs = 2;
        t.top_logprobs = top;
        t.n_top_logprobs = malformed == 1 ? 1 : 2;
        t.finished = true;
        t.finish_reason = "length";
        assert_int_equal(pd_msg_send(f->decode, NULL, 0, PD_MSG_TOKENS, &t.base), PD_OK);
        json_t *lp = response_logprobs(f, fd);
        json_t *tops = json_object_get(lp, "top_logprobs");
        assert_int_equal(json_array_size(tops), 2);
        assert_true(json_real_value(json_array_get(json_object_get(lp, "token_logprobs"), 1)) ==
                    -1.0);
        const pd_tokenizer *tok = f->tok;
        json_t *d0 = json_array_get(tops, 0), *d1 = json_array_get(tops, 1);
        if (malformed) { /* the sampled token alone */
            assert_int_equal(json_object_size(d0), 1);
            assert_int_equal(json_object_size(d1), 1);
        } else { /* 2 asked: {300, 302} and {304, 301} */
            assert_int_equal(json_object_size(d0), 2);
            assert_int_equal(json_object_size(d1), 2);
            assert_true(json_real_value(json_object_get(d0, tok_text(tok, 302))) == -0.75);
            assert_true(json_real_value(json_object_get(d1, tok_text(tok, 304))) == -0.625);
            assert_true(json_real_value(json_object_get(d1, tok_text(tok, 301))) == -1.0);
        }
        json_decref(lp);
    }
}

/* Generate messages reaching the fake decode replica within ms (others
 * dropped); their request ids go to rid. */
static int collect_generates(fixture *f, int ms, char rid[][160], int max) {
    int n = 0;
    double t_end = now_s() + ms / 1000.0;
    while (now_s() < t_end) {
        pd_msg m;
        pd_err err;
        if (pd_msg_recv(f->decode, false, &m, &err) == PD_OK) {
            if (m.type == PD_MSG_GENERATE && n < max)
                snprintf(rid[n++], 160, "%s", ((Pdserve__Generate *)m.msg)->request_id);
            pd_msg_clear(&m);
            continue;
        }
        pump(f, 1);
    }
    return n;
}

/* The long route's dispatch rule: a prefill replica holds at most
 * max_prefill_jobs_per_replica jobs (default 2), counted from the Reserve
 * until the KV is complete. A third long request waits in the gateway's
 * queue with nothing reserved for it (else its lease would run while it
 * waits in the prefill replica's queue) and is dispatched when the first
 * job's KvComplete frees a slot. */
static void test_long_waits_for_prefill_slot(void **state) {
    fixture *f = *state;
    fakes_fresh(f);
    int fd[3];
    for (int i = 0; i < 3; i++)
        fd[i] = post(f, "{\"prompt\":\"one two three four five six seven eight nine ten\","
                        "\"max_tokens\":4}");
    char rid[4][160];
    assert_int_equal(collect_generates(f, 600, rid, 4), 2);
    uint32_t blocks[2] = {1, 2};
    Pdserve__ReserveReply rr = PDSERVE__RESERVE_REPLY__INIT;
    rr.request_id = rid[0];
    rr.ok = true;
    rr.reservation_id = 11;
    rr.block_ids = blocks;
    rr.n_block_ids = 2;
    pd_msg_send(f->decode, NULL, 0, PD_MSG_RESERVE_REPLY, &rr.base);
    pd_msg m;
    assert_true(wait_msg(f, f->prefill, PD_MSG_PREFILL, &m));
    assert_string_equal(((Pdserve__Prefill *)m.msg)->request_id, rid[0]);
    pd_msg_clear(&m);
    assert_int_equal(collect_generates(f, 300, rid + 2, 2), 0); /* still full */
    Pdserve__KvComplete k = PDSERVE__KV_COMPLETE__INIT;
    k.request_id = rid[0];
    k.reservation_id = 11;
    k.first_token = 5;
    k.decode_replica_id = "t-decode";
    k.prefill_replica_id = "t-prefill";
    pd_msg_send(f->prefill, NULL, 0, PD_MSG_KV_COMPLETE, &k.base);
    assert_int_equal(collect_generates(f, 600, rid + 2, 2), 1);
    assert_string_not_equal(rid[2], rid[0]);
    assert_string_not_equal(rid[2], rid[1]);
    for (int i = 0; i < 3; i++) /* the clients go: the gateway aborts all three */
        close(fd[i]);
    pump(f, 100);
}

/* ---- the long route when a decode replica has no room for a reservation ---- */

#define LONG_BODY                                                                                  \
    "{\"prompt\":\"one two three four five six seven eight nine ten\",\"max_tokens\":4}"

/* The next Generate at sock: its request id into rid; whether kv_reserved. */
static bool next_generate(fixture *f, void *sock, char *rid, size_t n) {
    pd_msg m;
    assert_true(wait_msg(f, sock, PD_MSG_GENERATE, &m));
    Pdserve__Generate *g = (Pdserve__Generate *)m.msg;
    snprintf(rid, n, "%s", g->request_id);
    bool reserved = g->kv_reserved;
    pd_msg_clear(&m);
    return reserved;
}

/* A ReserveReply from the fake decode replica at sock. */
static void reserve_reply(void *sock, const char *rid, bool ok, Pdserve__ReserveRefusal why,
                          const char *reason, uint32_t free_b, uint32_t free_s) {
    uint32_t blocks[1] = {1};
    Pdserve__ReserveReply rr = PDSERVE__RESERVE_REPLY__INIT;
    rr.request_id = (char *)rid;
    rr.ok = ok;
    rr.refusal = why;
    rr.reason = (char *)reason;
    rr.free_blocks = free_b;
    rr.free_staging_slots = free_s;
    if (ok) {
        rr.reservation_id = 21;
        rr.block_ids = blocks;
        rr.n_block_ids = 1;
    }
    assert_int_equal(pd_msg_send(sock, NULL, 0, PD_MSG_RESERVE_REPLY, &rr.base), PD_OK);
}

static void tokens_finished(void *sock, const char *rid) {
    int32_t ids[1] = {300};
    Pdserve__Tokens t = PDSERVE__TOKENS__INIT;
    t.request_id = (char *)rid;
    t.ids = ids;
    t.n_ids = 1;
    t.finished = true;
    t.finish_reason = "length";
    assert_int_equal(pd_msg_send(sock, NULL, 0, PD_MSG_TOKENS, &t.base), PD_OK);
}

/* The gateway's /metrics text (caller frees). */
static char *get_metrics(fixture *f) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)pd_gw_server_port(f->gw)),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    const char *req = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    assert_int_equal(send(fd, req, strlen(req), 0), (ssize_t)strlen(req));
    return read_all(f, fd);
}

/* The value of one series (its full name with labels) in m; -1 if absent. */
static double series(const char *m, const char *name) {
    for (const char *p = strstr(m, name); p; p = strstr(p + 1, name))
        if ((p == m || p[-1] == '\n') && p[strlen(name)] == ' ')
            return atof(p + strlen(name) + 1);
    return -1;
}

/* A request that a stop string ends (the gateway matches it in the text;
 * the replica is told to stop) is a success: counted in
 * request_success_total with finished_reason "stop" and observed in the
 * end-to-end latency, not counted as "abort" (what a client that went away
 * is). Found by a walkthrough: each stop-string finish showed as "abort". */
#define SUCCESS_SHORT(reason)                                                                      \
    "pdserve:request_success_total{model_name=\"test-model\",class=\"short\",finished_reason="     \
    "\"" reason "\"}"
#define E2E_SHORT_COUNT                                                                            \
    "pdserve:e2e_request_latency_seconds_count{model_name=\"test-model\",class=\"short\"}"
static void test_stop_string_is_a_success(void **state) {
    fixture *f = *state;
    fakes_fresh(f);
    char *m0 = get_metrics(f);
    double stop0 = series(m0, SUCCESS_SHORT("stop")), abort0 = series(m0, SUCCESS_SHORT("abort"));
    double e2e0 = series(m0, E2E_SHORT_COUNT);
    free(m0);
    assert_true(stop0 >= 0 && abort0 >= 0 && e2e0 >= 0);

    int fd = post(f, "{\"prompt\":\"hi\",\"max_tokens\":8,\"stop\":[\"world\"]}");
    pd_msg m;
    assert_true(wait_msg(f, f->decode, PD_MSG_GENERATE, &m));
    char rid[160];
    snprintf(rid, sizeof rid, "%s", ((Pdserve__Generate *)m.msg)->request_id);
    pd_msg_clear(&m);
    int32_t *ids = NULL;
    size_t n = 0;
    pd_err err = {{0}};
    assert_int_equal(pd_tok_encode(f->tok, "hello world again", 17, true, &ids, &n, &err), PD_OK);
    Pdserve__Tokens t = PDSERVE__TOKENS__INIT;
    t.request_id = rid;
    t.ids = ids;
    t.n_ids = n; /* not finished: the stop string ends it at the gateway */
    assert_int_equal(pd_msg_send(f->decode, NULL, 0, PD_MSG_TOKENS, &t.base), PD_OK);
    free(ids);
    char *resp = read_all(f, fd);
    assert_non_null(strstr(resp, "HTTP/1.1 200"));
    assert_non_null(strstr(resp, "\"finish_reason\":\"stop\""));
    assert_non_null(strstr(resp, "\"text\":\"hello \""));
    free(resp);
    assert_true(wait_msg(f, f->decode, PD_MSG_ABORT, &m)); /* the replica stops generating it */
    pd_msg_clear(&m);

    char *m1 = get_metrics(f);
    assert_true(series(m1, SUCCESS_SHORT("stop")) == stop0 + 1);
    assert_true(series(m1, SUCCESS_SHORT("abort")) == abort0);
    assert_true(series(m1, E2E_SHORT_COUNT) == e2e0 + 1);
    double length0 = series(m1, SUCCESS_SHORT("length"));
    free(m1);

    /* the stop string in the piece that also reached max_tokens (the
     * replica says "length"): "stop" too, as the answer says (a walkthrough
     * found it counted as "length") */
    fd = post(f, "{\"prompt\":\"hi\",\"max_tokens\":3,\"stop\":[\"world\"]}");
    assert_true(wait_msg(f, f->decode, PD_MSG_GENERATE, &m));
    snprintf(rid, sizeof rid, "%s", ((Pdserve__Generate *)m.msg)->request_id);
    pd_msg_clear(&m);
    assert_int_equal(pd_tok_encode(f->tok, "hello world again", 17, true, &ids, &n, &err), PD_OK);
    t.request_id = rid;
    t.ids = ids;
    t.n_ids = n < 3 ? n : 3;
    t.finished = true;
    t.finish_reason = "length";
    assert_int_equal(pd_msg_send(f->decode, NULL, 0, PD_MSG_TOKENS, &t.base), PD_OK);
    free(ids);
    resp = read_all(f, fd);
    assert_non_null(strstr(resp, "\"finish_reason\":\"stop\""));
    free(resp);
    char *m2 = get_metrics(f);
    assert_true(series(m2, SUCCESS_SHORT("stop")) == stop0 + 2);
    assert_true(series(m2, SUCCESS_SHORT("length")) == length0);
    free(m2);
}

#define WAITING_LONG "pdserve:num_requests_waiting_class{model_name=\"test-model\",class=\"long\"}"

/* A decode replica that refuses a long prompt's reservation for want of
 * free staging slots (REFUSAL_NO_ROOM) does not fail the request (it was a
 * 503 "no KV capacity"): the request waits in the long queue (counted in
 * num_requests_waiting_class), is not asked for again while the replica
 * reports no free slot, short requests pass meanwhile, and it is reserved
 * again, under the same id, once a heartbeat shows room; then it completes
 * with 200. */
static void test_refused_reservation_waits_and_retries(void **state) {
    fixture *f = *state;
    f->dec_total_s = 4;
    fakes_fresh(f);
    int fd = post(f, LONG_BODY);
    char rid[160], again[160], srid[160];
    assert_true(next_generate(f, f->decode, rid, sizeof rid));
    f->dec_free_s = 0; /* its heartbeats from now on: no free slot */
    reserve_reply(f->decode, rid, false, PDSERVE__RESERVE_REFUSAL__REFUSAL_NO_ROOM,
                  "1 KV staging slots needed, 0 of 4 free", 100, 0);
    int fs = post(f, "{\"prompt\":\"hi\",\"max_tokens\":4}");
    assert_false(next_generate(f, f->decode, srid, sizeof srid));
    tokens_finished(f->decode, srid);
    char *resp = read_all(f, fs);
    assert_non_null(strstr(resp, "HTTP/1.1 200"));
    free(resp);
    char *m = get_metrics(f);
    assert_true(series(m, WAITING_LONG) == 1);
    assert_true(series(m, "pdserve:kv_reservations_refused_total{replica=\"t-decode\"}") >= 1);
    free(m);
    char ids[4][160];
    assert_int_equal(collect_generates(f, 600, ids, 4), 0); /* past the backoff: still no room */
    f->dec_free_s = 4;
    assert_true(next_generate(f, f->decode, again, sizeof again));
    assert_string_equal(again, rid);
    reserve_reply(f->decode, rid, true, PDSERVE__RESERVE_REFUSAL__REFUSAL_OTHER, "", 99, 3);
    pd_msg pm;
    assert_true(wait_msg(f, f->prefill, PD_MSG_PREFILL, &pm));
    assert_string_equal(((Pdserve__Prefill *)pm.msg)->request_id, rid);
    pd_msg_clear(&pm);
    Pdserve__KvComplete k = PDSERVE__KV_COMPLETE__INIT;
    k.request_id = rid;
    k.reservation_id = 21;
    k.first_token = 5;
    k.decode_replica_id = "t-decode";
    k.prefill_replica_id = "t-prefill";
    pd_msg_send(f->prefill, NULL, 0, PD_MSG_KV_COMPLETE, &k.base);
    assert_true(wait_msg(f, f->decode, PD_MSG_KV_COMPLETE, &pm));
    pd_msg_clear(&pm);
    tokens_finished(f->decode, rid);
    resp = read_all(f, fd);
    assert_non_null(strstr(resp, "HTTP/1.1 200"));
    assert_non_null(strstr(resp, "\"finish_reason\":\"length\""));
    free(resp);
    m = get_metrics(f);
    assert_true(series(m, WAITING_LONG) == 0);
    free(m);
    f->dec_total_s = 0;
}

/* The refusal backoff: a decode replica that refused a reservation for
 * want of room (REFUSAL_NO_ROOM) is not asked again for RESERVE_BACKOFF_S
 * (0.25 s) unless something on it frees up, even when the free counts it
 * reported look like room (a count that raced the refusal, room held for
 * something the gateway does not see). Found by hand: the request's own
 * sub_unassign cleared the flag the refusal had just set, so the gateway
 * asked again at once, a round trip after each refusal. */
static void test_refusal_backs_off(void **state) {
    fixture *f = *state;
    f->dec_total_s = 4;
    fakes_fresh(f);
    int fd = post(f, LONG_BODY);
    char rid[160], again[160], ids[4][160];
    assert_true(next_generate(f, f->decode, rid, sizeof rid));
    double t_refused = now_s();
    /* refused, though the counts (and its heartbeats: 100 blocks, 4 slots,
     * no more than it reported) say there is room */
    reserve_reply(f->decode, rid, false, PDSERVE__RESERVE_REFUSAL__REFUSAL_NO_ROOM, "no room", 100,
                  4);
    assert_int_equal(collect_generates(f, 150, ids, 4), 0);        /* within the backoff */
    assert_true(next_generate(f, f->decode, again, sizeof again)); /* after it */
    assert_string_equal(again, rid);
    assert_true(now_s() - t_refused >= 0.2);
    close(fd);
    pump(f, 100);
    f->dec_total_s = 0;
}

/* A refused request keeps its place: a long request that arrived after it
 * waits behind it, and when room for one frees, the refused one goes.
 * A queued client that goes away leaves the queue, and nothing is sent
 * for it afterwards. */
static void test_refused_keeps_its_place(void **state) {
    fixture *f = *state;
    f->dec_total_s = 4;
    fakes_fresh(f);
    int fa = post(f, LONG_BODY);
    char ra[160], rb[160], ids[4][160];
    assert_true(next_generate(f, f->decode, ra, sizeof ra));
    f->dec_free_s = 0;
    reserve_reply(f->decode, ra, false, PDSERVE__RESERVE_REFUSAL__REFUSAL_NO_ROOM, "no slots", 100,
                  0);
    pump(f, 50);
    int fb = post(
        f, "{\"prompt\":\"ten nine eight seven six five four three two one\",\"max_tokens\":4}");
    assert_int_equal(collect_generates(f, 400, ids, 4), 0);
    f->dec_free_s = 1; /* room for one reservation */
    assert_true(next_generate(f, f->decode, rb, sizeof rb));
    assert_string_equal(rb, ra);
    assert_int_equal(collect_generates(f, 400, ids, 4), 0); /* the slot is asked for: none left */
    char *m = get_metrics(f);
    assert_true(series(m, WAITING_LONG) == 1);
    free(m);
    close(fb); /* the queued client goes */
    pump(f, 100);
    m = get_metrics(f);
    assert_true(series(m, WAITING_LONG) == 0);
    free(m);
    f->dec_free_s = 4;
    assert_int_equal(collect_generates(f, 400, ids, 4), 0);
    close(fa);
    pump(f, 100);
    f->dec_total_s = 0;
}

/* A request that waits for room longer than --queue-timeout is answered
 * 503 with Retry-After, naming the flag and what it waited for. */
static void test_queue_timeout(void **state) {
    fixture *f = *state;
    f->dec_total_s = 4;
    fakes_fresh(f);
    double t0 = now_s();
    int fd = post(f, LONG_BODY);
    char rid[160];
    assert_true(next_generate(f, f->decode, rid, sizeof rid));
    f->dec_free_s = 0;
    reserve_reply(f->decode, rid, false, PDSERVE__RESERVE_REFUSAL__REFUSAL_NO_ROOM, "no slots", 100,
                  0);
    char *resp = read_all(f, fd);
    double waited = now_s() - t0;
    assert_non_null(strstr(resp, "HTTP/1.1 503"));
    assert_non_null(strstr(resp, "Retry-After: "));
    assert_non_null(strstr(resp, "--queue-timeout 3 s"));
    assert_non_null(strstr(resp, "for KV capacity on the decode replicas"));
    assert_true(waited >= QUEUE_TIMEOUT_S && waited < QUEUE_TIMEOUT_S + 2);
    free(resp);
    f->dec_total_s = 0;
}

/* A prompt that needs more staging slots than the decode replica's whole
 * pool (or more blocks than its whole cache) can never be served: 400
 * naming the limit, at once, nothing sent to a replica. When the gateway
 * could not know (a replica that registered no pool), the decode replica's
 * REFUSAL_NEVER_FITS is answered 400 with its reason. */
static void test_never_fits_is_400(void **state) {
    fixture *f = *state;
    f->dec_total_s = 2; /* 2 slots of 16 tokens */
    fakes_fresh(f);
    char body[8192], words[6000] = "";
    for (int i = 0; i < 40; i++)
        strcat(words, " hello");
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":4}", words);
    char *resp = read_all(f, post(f, body));
    assert_non_null(strstr(resp, "HTTP/1.1 400"));
    assert_non_null(strstr(resp, "KV staging slots"));
    assert_non_null(
        strstr(resp, "staging pool holds 2 (decode replica t-decode: --kv-staging-blocks)"));
    assert_null(strstr(resp, "Retry-After"));
    free(resp);
    char ids[4][160];
    assert_int_equal(collect_generates(f, 100, ids, 4), 0);
    /* more blocks than the whole cache (100 of 16 tokens), no staging pool */
    f->dec_total_s = 0;
    fakes_fresh(f);
    words[0] = 0;
    for (int i = 0; i < 1700; i++)
        strcat(words, " a");
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":4}", words);
    resp = read_all(f, post(f, body));
    assert_non_null(strstr(resp, "HTTP/1.1 400"));
    assert_non_null(strstr(resp, "KV cache holds 100"));
    free(resp);
    assert_int_equal(collect_generates(f, 100, ids, 4), 0);
    /* the decode replica says so itself */
    int fd = post(f, LONG_BODY);
    char rid[160];
    assert_true(next_generate(f, f->decode, rid, sizeof rid));
    reserve_reply(f->decode, rid, false, PDSERVE__RESERVE_REFUSAL__REFUSAL_NEVER_FITS,
                  "the decode replica's staging pool holds 0 (--kv-staging-blocks)", 100, 0);
    resp = read_all(f, fd);
    assert_non_null(strstr(resp, "HTTP/1.1 400"));
    assert_non_null(
        strstr(resp, "decode replica t-decode: the decode replica's staging pool holds 0"));
    free(resp);
}

/* The long route's choice of decode replica: one with free blocks but no
 * free staging slot is not chosen while another has both, though it has
 * more free blocks (which the choice went by before). */
static void test_long_route_needs_free_slots(void **state) {
    fixture *f = *state;
    f->dec_total_s = 4;
    fakes_fresh(f);
    f->dec2_total_s = 4;
    f->dec2_free_b = 50;
    f->dec2_free_s = 4;
    assert_true(register_replica_slots(f, f->decode2, "decode", "t-decode2", 0, 4));
    f->beat_decode2 = true;
    f->dec_free_s = 0;
    pump(f, 150); /* heartbeats: t-decode 100 blocks and no slot, t-decode2 50 blocks and 4 slots */
    pd_msg m;
    pd_err err;
    while (pd_msg_recv(f->decode2, false, &m, &err) == PD_OK)
        pd_msg_clear(&m);
    int fd = post(f, LONG_BODY);
    char rid[160], ids[4][160];
    assert_true(next_generate(f, f->decode2, rid, sizeof rid));
    assert_int_equal(collect_generates(f, 100, ids, 4), 0); /* nothing at t-decode */
    close(fd);
    f->beat_decode2 = false; /* out of rotation after 3 missed heartbeats */
    pump(f, 4 * HB_MS);
    f->dec_total_s = 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_heartbeat_refusal_names_its_registration),
        cmocka_unit_test(test_tokens_unknown_finish_reason),
        cmocka_unit_test(test_restarted_replica_fails_its_requests),
        cmocka_unit_test(test_kv_complete_reaches_stalled_decode),
        cmocka_unit_test(test_reserve_reply_from_stalled_decode),
        cmocka_unit_test(test_unregistered_decode_hears_leftovers),
        cmocka_unit_test(test_tokens_top_logprobs),
        cmocka_unit_test(test_long_waits_for_prefill_slot),
        cmocka_unit_test(test_prefill_error_names_prefill),
        cmocka_unit_test(test_refused_reservation_waits_and_retries),
        cmocka_unit_test(test_refused_keeps_its_place),
        cmocka_unit_test(test_refusal_backs_off),
        cmocka_unit_test(test_queue_timeout),
        cmocka_unit_test(test_never_fits_is_400),
        cmocka_unit_test(test_long_route_needs_free_slots),
        cmocka_unit_test(test_stop_string_is_a_success),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

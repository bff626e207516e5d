/* The router's handling of replica messages, with a real router and
 * gateway on one loop and a fake decode replica (a ZeroMQ DEALER).
 * Regression tests for inputs found by tests/fuzz/fuzz_msg. */
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
#include <unistd.h>
#include <zmq.h>

#include <cmocka.h>
#include <event2/event.h>

#include "pd_gateway.h"
#include "pd_msg.h"
#include "pd_router.h"

typedef struct {
    struct event_base *base;
    pd_tokenizer *tok;
    pd_router *router;
    pd_gw_server *gw;
    void *zctx, *decode;
    char endpoint[128];
} fixture;

static void pump(fixture *f, int ms) {
    for (int i = 0; i < ms; i++) {
        event_base_loop(f->base, EVLOOP_NONBLOCK);
        usleep(1000);
    }
}

/* Waits for a message of type t at the fake decode replica. */
static bool wait_msg(fixture *f, pd_msg_type t, pd_msg *out) {
    for (int i = 0; i < 5000; i++) {
        pd_err err;
        pd_status st = pd_msg_recv(f->decode, false, out, &err);
        if (st == PD_OK && out->type == t)
            return true;
        if (st == PD_OK)
            pd_msg_clear(out);
        pump(f, 1);
    }
    return false;
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
                           .long_prompt_threshold = 1024,
                           .heartbeat_interval_ms = 60000,
                           .block_size = 16,
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
    f->decode = zmq_socket(f->zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(f->decode, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(f->decode, ZMQ_ROUTING_ID, "t-decode", 8);
    zmq_connect(f->decode, f->endpoint);
    Pdserve__KvGeometry geo = PDSERVE__KV_GEOMETRY__INIT;
    geo.block_size = 16;
    geo.num_layers = 2;
    geo.kv_lora_rank = 16;
    geo.num_blocks = 100;
    Pdserve__Register r = PDSERVE__REGISTER__INIT;
    r.role = "decode";
    r.replica_id = "t-decode";
    r.geometry = &geo;
    pd_msg_send(f->decode, NULL, 0, PD_MSG_REGISTER, &r.base);
    pd_msg m;
    if (!wait_msg(f, PD_MSG_REGISTER_REPLY, &m))
        return -1;
    bool ok = ((Pdserve__RegisterReply *)m.msg)->accepted;
    pd_msg_clear(&m);
    *state = f;
    return ok ? 0 : -1;
}

static int teardown(void **state) {
    fixture *f = *state;
    pd_gw_server_free(&f->gw);
    pd_router_free(&f->router);
    zmq_close(f->decode);
    zmq_ctx_term(f->zctx);
    event_base_free(f->base);
    pd_tok_free(&f->tok);
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
    char req[1024];
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

/* A replica's finish_reason other than "stop"/"length" reached
 * pd_gw_on_finish as a pointer into the unpacked Tokens message, which was
 * freed before the response was written: heap-use-after-free. Now such a
 * reason is answered as "stop". */
static void test_tokens_unknown_finish_reason(void **state) {
    fixture *f = *state;
    int fd = post(f, "{\"prompt\":\"hi\",\"max_tokens\":4}");
    pd_msg m;
    assert_true(wait_msg(f, PD_MSG_GENERATE, &m));
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tokens_unknown_finish_reason),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

/* Protobuf messages between services → pd_msg_recv (every message type,
 * every framing) and the gateway's router, which takes them from replicas.
 *
 * Each input is [flags][type byte][payload]:
 *   1. framing: the frames [envelope]? [type] [payload] [extra]? go through
 *      a ZeroMQ inproc PAIR into pd_msg_recv (with_envelope per flag), which
 *      must refuse what is malformed and unpack the rest (protobuf-c);
 *   2. handling: a message that unpacked is sent, from a fake replica's
 *      DEALER, to a live pd_router (its real control endpoint, ipc://) that
 *      is the engine of a live pd_gw_server. Before it, the fake replicas
 *      register and one completion request is in flight (a short prompt
 *      straight to the fake decode replica, or a long one through the fake
 *      prefill replica once the fake decode replica has reserved blocks), so
 *      Tokens / ReserveReply / KvComplete can be aimed at that request (its
 *      id, reservation and replica substituted). Then the request is finished
 *      with a last Tokens (or left to the client's disconnect) and its HTTP
 *      response read to the end.
 * Flags: bit 0 envelope frame, bit 1 aim at the live request, bit 2 send
 * from the prefill replica, bit 3 long prompt, bit 4 stream, bit 5 n = 2,
 * bit 6 leave the request unfinished (the client resets it), bit 7 an extra
 * frame.
 *
 * The Generate / Reserve / Prefill / Abort / RegisterReply messages that go
 * from the gateway to replicas stop at stage 1 here: their handlers live in
 * pd_decode_main / pd_prefill_main (model and UCX behind them).
 *
 * Property: no crash, leak or UB in the router or the gateway; the request
 * always ends (its response completes or the client gives up). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include <event2/event.h>
#include <event2/thread.h>

#include "fuzz_util.h"
#include "pd_gateway.h"
#include "pd_msg.h"
#include "pd_router.h"

#define FZ_RESV 7 /* the reservation the fake decode replica grants */

static struct event_base *g_base;
static pd_gw_server *g_gw;
static pd_router *g_router;
static void *g_zctx, *g_pair_in, *g_pair_out;
static void *g_decode, *g_prefill; /* fake replicas (DEALER) */
static int g_port;

/* what the fake replicas saw */
static char g_rids[2][160];
static int g_n_rids;
static bool g_long_granted, g_prefill_seen;
static int g_replies; /* RegisterReply messages received */

static void tick(evutil_socket_t fd, short what, void *arg) {
    *(int *)arg = 1;
}

static void loop_once(int ms) {
    int fired = 0;
    struct event *t = evtimer_new(g_base, tick, &fired);
    struct timeval tv = {0, ms * 1000};
    evtimer_add(t, &tv);
    event_base_loop(g_base, EVLOOP_ONCE);
    event_free(t);
}

static void send_msg(void *sock, pd_msg_type t, const ProtobufCMessage *m) {
    FZ_CHECK(pd_msg_send(sock, NULL, 0, t, m) == PD_OK, "send %s", pd_msg_type_name(t));
}

/* The fake decode replica grants every reservation at once. */
static void on_replica_msg(void *sock, pd_msg *m) {
    if (m->type == PD_MSG_REGISTER_REPLY) {
        g_replies++;
    } else if (m->type == PD_MSG_GENERATE && sock == g_decode) {
        Pdserve__Generate *g = (Pdserve__Generate *)m->msg;
        if (g_n_rids < 2)
            snprintf(g_rids[g_n_rids++], sizeof g_rids[0], "%s", g->request_id);
        if (g->kv_reserved) {
            uint32_t blocks[2] = {1, 2};
            Pdserve__ReserveReply rr = PDSERVE__RESERVE_REPLY__INIT;
            rr.request_id = g->request_id;
            rr.ok = true;
            rr.reservation_id = FZ_RESV;
            rr.block_ids = blocks;
            rr.n_block_ids = 2;
            send_msg(g_decode, PD_MSG_RESERVE_REPLY, &rr.base);
            g_long_granted = true;
        }
    } else if (m->type == PD_MSG_PREFILL && sock == g_prefill) {
        g_prefill_seen = true;
    }
}

static void drain_replicas(void) {
    void *socks[2] = {g_decode, g_prefill};
    for (int i = 0; i < 2; i++)
        for (;;) {
            pd_msg m;
            pd_err err = {{0}};
            pd_status st = pd_msg_recv(socks[i], false, &m, &err);
            if (st == PD_ERR_LIMIT)
                break;
            FZ_CHECK(st == PD_OK, "the router sent a malformed message: %s", err.msg);
            on_replica_msg(socks[i], &m);
            pd_msg_clear(&m);
        }
}

/* Runs the loop and the fake replicas until cond() or the budget ends. */
static bool pump_until(bool (*cond)(void), int budget_ms) {
    for (int i = 0; i < budget_ms; i++) {
        if (cond && cond())
            return true;
        loop_once(1);
        drain_replicas();
    }
    return cond ? cond() : true;
}

static int g_want_replies;
static bool replies_in(void) {
    return g_replies >= g_want_replies;
}

static void register_replica(void *sock, const char *role, const char *id) {
    Pdserve__KvGeometry geo = PDSERVE__KV_GEOMETRY__INIT;
    geo.block_size = 16;
    geo.num_layers = 2;
    geo.kv_lora_rank = 16;
    geo.qk_rope_head_dim = 8;
    geo.dtype_bytes = 4;
    geo.num_blocks = 1000;
    Pdserve__Register r = PDSERVE__REGISTER__INIT;
    r.role = (char *)role;
    r.replica_id = (char *)id;
    r.geometry = &geo;
    r.pid = 1;
    send_msg(sock, PD_MSG_REGISTER, &r.base);
}

/* Everything the router has to answer before this one has been handled:
 * a heartbeat from a name it does not know gets a RegisterReply. */
static void sync_router(void *sock) {
    Pdserve__Heartbeat h = PDSERVE__HEARTBEAT__INIT;
    h.replica_id = "fz-probe-unknown";
    g_want_replies = g_replies + 1;
    send_msg(sock, PD_MSG_HEARTBEAT, &h.base);
    FZ_CHECK(pump_until(replies_in, 2000), "the router stopped answering");
}

static void *dealer(const char *id, const char *endpoint) {
    void *s = zmq_socket(g_zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, ZMQ_ROUTING_ID, id, strlen(id));
    FZ_CHECK(zmq_connect(s, endpoint) == 0, "connect %s", endpoint);
    return s;
}

static char g_sock_path[96];

/* libFuzzer ends with exit(): the router's ipc socket file goes with it */
static void unlink_sock(void) {
    unlink(g_sock_path);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fz_quiet_logs();
    signal(SIGPIPE, SIG_IGN);
    evthread_use_pthreads();
    g_base = event_base_new();
    char endpoint[128];
    snprintf(g_sock_path, sizeof g_sock_path, "/tmp/pdserve-fuzz-msg-%d.sock", (int)getpid());
    snprintf(endpoint, sizeof endpoint, "ipc://%s", g_sock_path);
    atexit(unlink_sock);
    pd_router_config rc = {0};
    rc.control_endpoint = endpoint;
    rc.long_prompt_threshold = 8;
    rc.heartbeat_interval_ms = 60000; /* no expiry while fuzzing */
    rc.model_fingerprint = 0;         /* what a Register carries by default */
    rc.block_size = 16;
    rc.model_name = "test-model";
    rc.request_timeout_s = 30;
    rc.queue_timeout_s = 1; /* a request left waiting for KV room ends within a second, not 300 */
    pd_err err = {{0}};
    if (pd_router_init(g_base, &rc, &g_router, &err) != PD_OK) {
        fprintf(stderr, "fuzz_msg: %s\n", err.msg);
        exit(1);
    }
    pd_gw_config cfg;
    pd_gw_config_defaults(&cfg);
    cfg.host = "127.0.0.1";
    cfg.port = 0;
    cfg.served_model_name = "test-model";
    cfg.max_model_len = 4096;
    cfg.vocab_size = 129280;
    cfg.tokenizer_handle = fz_tokenizer();
    cfg.tokenizer_pool_size = 1;
    if (pd_gw_server_init(g_base, &cfg, pd_router_engine(), g_router, &g_gw, &err) != PD_OK) {
        fprintf(stderr, "fuzz_msg: %s\n", err.msg);
        exit(1);
    }
    pd_router_attach(g_router, g_gw);
    g_port = pd_gw_server_port(g_gw);

    g_zctx = zmq_ctx_new();
    g_pair_in = zmq_socket(g_zctx, ZMQ_PAIR);
    g_pair_out = zmq_socket(g_zctx, ZMQ_PAIR);
    zmq_bind(g_pair_in, "inproc://fuzz-msg");
    zmq_connect(g_pair_out, "inproc://fuzz-msg");
    g_decode = dealer("fz-decode", endpoint);
    g_prefill = dealer("fz-prefill", endpoint);
    return 0;
}

/* ---- stage 1: framing -------------------------------------------------- */

/* zmq_send, again while a signal interrupts it (libFuzzer's timer), so
 * that no frame of an input is lost (common/msg.c does the same). */
static void fz_send(void *sock, const void *p, size_t n, int flags) {
    while (zmq_send(sock, p, n, flags) < 0 && errno == EINTR)
        ;
}

static pd_status frames_recv(uint8_t flags, uint8_t type, const uint8_t *payload, size_t n,
                             pd_msg *out) {
    bool env = flags & 1, extra = flags & 0x80;
    if (env)
        fz_send(g_pair_out, "fz", 2, ZMQ_SNDMORE);
    fz_send(g_pair_out, &type, 1, ZMQ_SNDMORE);
    fz_send(g_pair_out, payload, n, extra ? ZMQ_SNDMORE : 0);
    if (extra)
        fz_send(g_pair_out, "x", 1, 0);
    pd_err err = {{0}};
    pd_status st;
    do /* inproc delivery is immediate, but be robust to EAGAIN */
        st = pd_msg_recv(g_pair_in, env, out, &err);
    while (st == PD_ERR_LIMIT);
    if (st == PD_OK) {
        FZ_CHECK(out->type > PD_MSG_NONE && out->type < PD_MSG_COUNT && out->msg, "type %d",
                 out->type);
        FZ_CHECK(!env || (out->envelope_len == 2 && !memcmp(out->envelope, "fz", 2)), "envelope");
        FZ_CHECK(!extra, "a message with an extra frame was accepted");
    } else {
        FZ_CHECK(st == PD_ERR_FORMAT && err.msg[0], "status %s", pd_status_str(st));
        FZ_CHECK(out->msg == NULL, "a refused message is still owned");
    }
    /* the next input starts on a clean socket */
    zmq_msg_t m;
    zmq_msg_init(&m);
    int rc;
    while ((rc = zmq_msg_recv(&m, g_pair_in, ZMQ_DONTWAIT)) < 0 && errno == EINTR)
        ;
    FZ_CHECK(rc < 0 && errno == EAGAIN, "frames left behind");
    zmq_msg_close(&m);
    return st;
}

/* ---- stage 2: the router with a request in flight ---------------------- */

static int http_open(bool is_long, bool stream, int n) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    FZ_CHECK(fz_connect_loopback(fd, g_port) == 0, "connect: %s", strerror(errno));
    struct linger lg = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    char body[512], req[1024];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":4,\"stream\":%s,\"n\":%d}",
             is_long ? "one two three four five six seven eight nine ten eleven twelve" : "hi",
             stream ? "true" : "false", n);
    int len = snprintf(req, sizeof req,
                       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                       "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                       strlen(body), body);
    FZ_CHECK(send(fd, req, (size_t)len, MSG_NOSIGNAL) == len, "send");
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

static int g_http_fd;
static bool g_http_eof;
static bool http_done(void) {
    char buf[65536];
    for (;;) {
        ssize_t r = recv(g_http_fd, buf, sizeof buf, 0);
        if (r > 0) {
            if (getenv("FZ_DUMP"))
                fwrite(buf, 1, (size_t)r, stderr);
            continue;
        }
        if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            g_http_eof = true;
        return g_http_eof;
    }
}

static int g_want_rids;
static bool rids_in(void) {
    return g_n_rids >= g_want_rids || http_done();
}
static bool prefill_in(void) {
    return g_prefill_seen || http_done();
}

/* Points a message at the live request (its ids), so that the router's
 * handlers get past their lookups. The replaced string fields are saved:
 * free_unpacked must see the originals. */
typedef struct {
    char **field[3];
    char *old[3];
    int n;
} fz_aim;

static void aim_set(fz_aim *a, char **field, char *value) {
    a->field[a->n] = field;
    a->old[a->n++] = *field;
    *field = value;
}

static void aim(pd_msg *m, char *rid, fz_aim *a) {
    switch (m->type) {
    case PD_MSG_TOKENS:
        aim_set(a, &((Pdserve__Tokens *)m->msg)->request_id, rid);
        break;
    case PD_MSG_RESERVE_REPLY:
        aim_set(a, &((Pdserve__ReserveReply *)m->msg)->request_id, rid);
        break;
    case PD_MSG_KV_COMPLETE: {
        Pdserve__KvComplete *k = (Pdserve__KvComplete *)m->msg;
        aim_set(a, &k->request_id, rid);
        aim_set(a, &k->decode_replica_id, "fz-decode");
        k->reservation_id = FZ_RESV;
        break;
    }
    case PD_MSG_HEARTBEAT:
        aim_set(a, &((Pdserve__Heartbeat *)m->msg)->replica_id, "fz-decode");
        break;
    default:
        break;
    }
}

static void aim_undo(fz_aim *a) {
    while (a->n > 0) {
        a->n--;
        *a->field[a->n] = a->old[a->n];
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2 || size > 65536)
        return 0;
    uint8_t flags = data[0], type = data[1];
    pd_msg m;
    if (frames_recv(flags, type, data + 2, size - 2, &m) != PD_OK)
        return 0;

    /* both fake replicas (re)register: a fuzzed Register may have changed them */
    g_want_replies = g_replies + 2;
    register_replica(g_decode, "decode", "fz-decode");
    register_replica(g_prefill, "prefill", "fz-prefill");
    FZ_CHECK(pump_until(replies_in, 2000), "registration unanswered");
    /* and report an empty cache: a fuzzed Heartbeat or ReserveReply may have
     * left the router believing the decode replica full, and a resent
     * Register of the same process keeps the counts (long prompts would
     * then wait in the long queue, each input up to --queue-timeout) */
    Pdserve__Heartbeat hb = PDSERVE__HEARTBEAT__INIT;
    hb.replica_id = "fz-decode";
    hb.free_blocks = hb.total_blocks = 1000;
    hb.registration = 1;
    send_msg(g_decode, PD_MSG_HEARTBEAT, &hb.base);
    sync_router(g_decode);

    bool is_long = flags & 8;
    int n = flags & 0x20 ? 2 : 1;
    g_n_rids = 0;
    g_long_granted = g_prefill_seen = false;
    g_http_eof = false;
    g_http_fd = http_open(is_long, flags & 0x10, n);
    g_want_rids = n;
    pump_until(rids_in, 3000);
    if (is_long && g_n_rids > 0)
        pump_until(prefill_in, 2000);

    /* the fuzzed message, from one of the replicas */
    void *from = flags & 4 ? g_prefill : g_decode;
    char rid[160] = "";
    if (g_n_rids > 0)
        snprintf(rid, sizeof rid, "%s", g_rids[0]);
    fz_aim a = {0};
    if ((flags & 2) && rid[0])
        aim(&m, rid, &a);
    send_msg(from, m.type, m.msg);
    aim_undo(&a);
    pd_msg_clear(&m);
    sync_router(from);

    /* finish the request as a replica would, or leave it to the client */
    if (!(flags & 0x40))
        for (int i = 0; i < g_n_rids; i++) {
            int32_t ids[2] = {5, 6};
            Pdserve__Tokens t = PDSERVE__TOKENS__INIT;
            t.request_id = g_rids[i];
            t.ids = ids;
            t.n_ids = 2;
            t.finished = true;
            t.finish_reason = "length";
            send_msg(g_decode, PD_MSG_TOKENS, &t.base);
        }
    sync_router(g_decode);
    pump_until(http_done, flags & 0x40 ? 5 : 2000);
    close(g_http_fd); /* RST: aborts whatever is still running */
    for (int i = 0; i < 5; i++) {
        loop_once(1);
        drain_replicas();
    }
    sync_router(g_decode);
    return 0;
}

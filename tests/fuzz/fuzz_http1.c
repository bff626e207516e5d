/* Raw bytes from a client → the gateway's HTTP/1.1 handler, end to end: a
 * real pd_gw_server (listener on 127.0.0.1, libhttp-parser, the tokenizer
 * pool, the OpenAI endpoints) with a scripted engine behind it.
 *
 * There is no entry point below the socket (connections are made by the
 * listener's accept callback), so each input is one TCP connection over
 * loopback: the bytes are written, the loop runs until the server has been
 * quiet for a moment (every parsed request answered), then the client
 * half-closes (the EOF path) and finally resets the connection.
 *
 * The engine answers every accepted request on the next loop turn, per
 * choice: the prompt's first ids, then ids a replica could send but the
 * tokenizer does not know (-1, 128815 just past the vocabulary, INT32_MAX),
 * then on_finish "length" / "stop". A prompt length that is a multiple of 5
 * is refused at submit (429 + Retry-After), of 7 fails with on_error after
 * the tokens. So request bodies reach detokenization, stop strings, logprobs,
 * SSE and JSON output.
 *
 * Property: no crash, leak or UB in the server (the sanitizers), and it
 * never stops answering (the next input connects to the same server). */
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

#include <event2/event.h>
#include <event2/thread.h>

#include "fuzz_util.h"
#include "pd_gateway.h"

/* ---- the scripted engine ----------------------------------------------- */

#define FZ_MAX_LIVE 64

typedef struct {
    pd_gw_request *req;
    uint64_t gen;
} fz_live;

static struct event_base *g_base;
static pd_gw_server *g_srv;
static int g_port;
static fz_live g_live[FZ_MAX_LIVE];
static uint64_t g_gen;
static int g_pending; /* answers scheduled and not yet run */

static void engine_answer(evutil_socket_t fd, short what, void *arg) {
    int slot = (int)((uintptr_t)arg & 0xff);
    uint64_t gen = (uintptr_t)arg >> 8;
    g_pending--;
    fz_live *l = &g_live[slot];
    if (!l->req || (l->gen & 0xffffffffffffffull) != gen)
        return; /* aborted meanwhile */
    pd_gw_request *req = l->req;
    const pd_gw_gen_params *p = pd_gw_request_params(req);
    int32_t ids[32];
    float lps[32];
    int n = 0;
    for (int i = 0; i < p->n_prompt && n < 16; i++)
        ids[n++] = p->prompt_ids[i];
    ids[n++] = -1;
    ids[n++] = 128815;
    ids[n++] = INT32_MAX;
    for (int i = 0; i < n; i++)
        lps[i] = -0.25f * (float)(i + 1);
    if (n > p->max_tokens)
        n = p->max_tokens;
    for (int c = 0; c < p->n; c++)
        pd_gw_on_tokens(req, c, ids, c % 2 ? NULL : lps, n);
    if (p->n_prompt % 7 == 0) {
        l->req = NULL;
        pd_gw_on_error(req, 500, "fuzz engine: replica failed");
        return;
    }
    for (int c = 0; c < p->n; c++) {
        if (c == p->n - 1)
            l->req = NULL; /* the last on_finish releases req */
        pd_gw_on_finish(req, c, c % 2 ? "stop" : "length");
    }
}

static int engine_submit(void *engine, pd_gw_request *req, const pd_gw_gen_params *p) {
    FZ_CHECK(p->n >= 1 && p->max_tokens >= 1 && p->n_prompt >= 1, "bad params");
    if (p->n_prompt % 5 == 0) {
        pd_gw_submit_error(req, 429, 3, "fuzz engine: busy");
        return -1;
    }
    int slot = -1;
    for (int i = 0; i < FZ_MAX_LIVE; i++)
        if (!g_live[i].req) {
            slot = i;
            break;
        }
    if (slot < 0)
        return -1; /* the default 503 */
    g_live[slot].req = req;
    g_live[slot].gen = ++g_gen & 0xffffffffffffffull;
    g_pending++;
    struct timeval tv = {0, 0};
    event_base_once(g_base, -1, EV_TIMEOUT, engine_answer,
                    (void *)(uintptr_t)((g_live[slot].gen << 8) | (uint64_t)slot), &tv);
    return 0;
}

static void engine_abort(void *engine, pd_gw_request *req) {
    for (int i = 0; i < FZ_MAX_LIVE; i++)
        if (g_live[i].req == req)
            g_live[i].req = NULL;
}

static const pd_gw_engine_i g_engine = {engine_submit, engine_abort};

/* ---- one connection per input ------------------------------------------- */

static void tick(evutil_socket_t fd, short what, void *arg) {
    *(int *)arg = 1;
}

/* Runs the loop once, waking after at most ms; returns true when only the
 * timer fired (nothing else happened). */
static bool loop_once(int ms) {
    int fired = 0;
    struct event *t = evtimer_new(g_base, tick, &fired);
    struct timeval tv = {0, ms * 1000};
    evtimer_add(t, &tv);
    event_base_loop(g_base, EVLOOP_ONCE);
    bool idle = fired;
    event_free(t);
    return idle;
}

/* Reads whatever the server sent; returns false at EOF or error. */
static bool drain(int fd) {
    char buf[65536];
    for (;;) {
        ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (r > 0 && getenv("FZ_DUMP")) /* FZ_DUMP=1: print what the server answered */
            fwrite(buf, 1, (size_t)r, stderr);
        if (r > 0)
            continue;
        if (r == 0)
            return false;
        return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fz_quiet_logs();
    signal(SIGPIPE, SIG_IGN);
    evthread_use_pthreads();
    g_base = event_base_new();
    pd_gw_config cfg;
    pd_gw_config_defaults(&cfg);
    cfg.host = "127.0.0.1";
    cfg.port = 0;
    cfg.served_model_name = "test-model";
    cfg.max_model_len = 4096;
    cfg.vocab_size = 129280;
    cfg.tokenizer_handle = fz_tokenizer();
    cfg.tokenizer_pool_size = 1;
    cfg.max_request_body_bytes = 1 << 20;
    cfg.max_header_bytes = 8 << 10;
    cfg.max_header_count = 32;
    pd_err err = {{0}};
    if (pd_gw_server_init(g_base, &cfg, &g_engine, NULL, &g_srv, &err) != PD_OK) {
        fprintf(stderr, "fuzz_http1: %s\n", err.msg);
        exit(1);
    }
    g_port = pd_gw_server_port(g_srv);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
#ifdef FZ_PREFIX
    /* a harness that includes this file puts its protocol's first bytes first */
    static const char prefix[] = FZ_PREFIX;
    size_t plen = sizeof prefix - 1;
#else
    static const char prefix[] = "";
    size_t plen = 0;
    /* The HTTP/2 preface goes to the h2 handler: fuzz_http2's input. */
    if (size >= 3 && !memcmp(data, "PRI", 3))
        return 0;
#endif
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    FZ_CHECK(fd >= 0, "socket: %s", strerror(errno));
    FZ_CHECK(fz_connect_loopback(fd, g_port) == 0, "connect: %s", strerror(errno));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct linger lg = {1, 0}; /* close() resets: no TIME_WAIT pile-up */
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);

    /* write everything (the server reads as we go) */
    size_t total = plen + size, off = 0;
    bool open = true;
    int guard = 0;
    while (off < total && open && guard++ < 10000) {
        const uint8_t *src = off < plen ? (const uint8_t *)prefix + off : data + (off - plen);
        size_t n = off < plen ? plen - off : total - off;
        ssize_t w = send(fd, src, n, MSG_NOSIGNAL);
        if (w > 0)
            off += (size_t)w;
        else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
            break;
        loop_once(1);
        open = drain(fd);
    }
    /* until every request the server parsed has been answered */
    int idle = 0;
    for (int i = 0; i < 2000 && open && idle < 3; i++) {
        bool quiet = loop_once(1);
        open = drain(fd);
        idle = quiet && g_pending == 0 ? idle + 1 : 0;
    }
    /* the client stops sending: what the server makes of the EOF */
    if (open) {
        shutdown(fd, SHUT_WR);
        idle = 0;
        for (int i = 0; i < 2000 && open && idle < 3; i++) {
            bool quiet = loop_once(1);
            open = drain(fd);
            idle = quiet && g_pending == 0 ? idle + 1 : 0;
        }
    }
    close(fd); /* RST */
    for (int i = 0; i < 3; i++)
        loop_once(0);
    return 0;
}

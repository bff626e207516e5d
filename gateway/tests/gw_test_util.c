/* Test helpers for the gateway: see gw_test_util.h. Included (as a .c) by
 * each gateway test, so that every test builds from its one source file. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memmem, vasprintf */
#endif
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <event2/event.h>
#include <event2/thread.h>

#include "gw_test_util.h"

#include <math.h>

/* ---- tokenizer ---------------------------------------------------------- */

static pd_tokenizer *g_tok;
static pthread_once_t g_tok_once = PTHREAD_ONCE_INIT;

static void tok_load_once(void) {
    char path[1024];
    const char *cache = getenv("PD_CACHE_DIR");
    const char *src = getenv("PD_SOURCE_DIR");
    if (cache && *cache)
        snprintf(path, sizeof path, "%s/tokenizer-deepseek_v3/tokenizer.json", cache);
    else
        snprintf(path, sizeof path, "%s/.cache/tokenizer-deepseek_v3/tokenizer.json",
                 src && *src ? src : PD_SOURCE_DIR);
    pd_err err;
    if (pd_tok_load(path, &g_tok, &err) != PD_OK)
        fprintf(stderr, "gw_test_util: cannot load %s: %s\n", path, err.msg);
}

const pd_tokenizer *gwt_tokenizer(void) {
    pthread_once(&g_tok_once, tok_load_once);
    return g_tok;
}

/* GPT-2 byte-level mapping: byte b → the code point its base token spells. */
static unsigned byte_to_cp(unsigned b) {
    if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff))
        return b;
    unsigned n = 0;
    for (unsigned x = 0; x < b; x++)
        if (!((x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || (x >= 0xae && x <= 0xff)))
            n++;
    return 256 + n;
}

int32_t *gwt_ids_bytewise(const char *text, int *n_p) {
    const pd_tokenizer *t = gwt_tokenizer();
    size_t n = strlen(text);
    int32_t *ids = calloc(n ? n : 1, sizeof *ids);
    for (size_t i = 0; i < n; i++) {
        unsigned cp = byte_to_cp((unsigned char)text[i]);
        char u[4] = {0};
        if (cp < 0x80) {
            u[0] = (char)cp;
        } else {
            u[0] = (char)(0xc0 | (cp >> 6));
            u[1] = (char)(0x80 | (cp & 0x3f));
        }
        ids[i] = pd_tok_find(t, u);
    }
    *n_p = (int)n;
    return ids;
}

int32_t *gwt_ids_encode(const char *text, int *n_p) {
    int32_t *ids = NULL;
    size_t n = 0;
    pd_err err;
    if (pd_tok_encode(gwt_tokenizer(), text, strlen(text), true, &ids, &n, &err) != PD_OK)
        return NULL;
    *n_p = (int)n;
    return ids;
}

/* ---- fake engine ---------------------------------------------------------- */

typedef struct {
    gwt_engine *e;
    pd_gw_request *req;
    struct event *timer;
    gwt_script s;
    int n_choices, max_tokens;
    int pos[128];
    bool done[128];
    bool aborted[128]; /* abort_choice ran: no more calls for it */
    int emitted0;
} fake_req;

static void fake_free(fake_req *f) {
    event_free(f->timer);
    atomic_fetch_sub(&f->e->n_active, 1);
    free(f);
}

static void fake_tick(evutil_socket_t fd, short what, void *arg) {
    fake_req *f = arg;
    for (int c = 0; c < f->n_choices; c++) {
        if (f->aborted[c] && !f->done[c]) {
            f->done[c] = true; /* the engine drops it: no call at all */
            continue;
        }
        if (f->done[c])
            continue;
        int k = f->s.batch;
        int start = f->s.choice_skip * c < f->s.n_ids ? f->s.choice_skip * c : f->s.n_ids;
        int avail_script = f->s.n_ids - f->pos[c];
        int avail_len = f->max_tokens - (f->pos[c] - start);
        if (k > avail_script)
            k = avail_script;
        if (k > avail_len)
            k = avail_len;
        if (c == 0 && f->s.error_after >= 0 && f->emitted0 + k > f->s.error_after)
            k = f->s.error_after - f->emitted0;
        if (k > 0) {
            float lps[4096];
            for (int i = 0; i < k; i++)
                lps[i] = -0.5f * (float)(f->pos[c] + i + 1);
            int nt = f->s.n_top;
            if (nt > 0) {
                int32_t *tid = malloc((size_t)k * nt * sizeof *tid);
                float *tlp = malloc((size_t)k * nt * sizeof *tlp);
                for (int i = 0; i < k; i++)
                    for (int j = 0; j < nt; j++) {
                        bool self = !f->s.top_without_sampled && j == 0;
                        int alt = f->s.top_without_sampled ? j : j - 1;
                        tid[i * nt + j] = self ? f->s.ids[f->pos[c] + i] : f->s.top_alt[alt];
                        tlp[i * nt + j] = f->s.top_without_sampled ? -0.01f * (float)(j + 1)
                                                                   : lps[i] - 0.25f * (float)j;
                        if (f->s.top_last_inf && j == nt - 1)
                            tlp[i * nt + j] = -INFINITY;
                    }
                pd_gw_on_tokens_top(f->req, c, f->s.ids + f->pos[c],
                                    f->s.with_logprobs ? lps : NULL, tid, tlp, nt, k);
                free(tid);
                free(tlp);
            } else {
                pd_gw_on_tokens(f->req, c, f->s.ids + f->pos[c], f->s.with_logprobs ? lps : NULL,
                                k);
            }
            f->pos[c] += k;
            if (c == 0)
                f->emitted0 += k;
        }
        if (c == 0 && f->s.error_after >= 0 && f->emitted0 >= f->s.error_after) {
            atomic_fetch_add(&f->e->n_errors, 1);
            pd_gw_on_error(f->req, f->s.error_status ? f->s.error_status : 500,
                           "fake engine failure");
            fake_free(f);
            return;
        }
        const char *reason = NULL;
        if (f->pos[c] - start >= f->max_tokens)
            reason = "length";
        else if (f->pos[c] >= f->s.n_ids)
            reason = f->s.finish ? f->s.finish : "stop";
        if (reason) {
            f->done[c] = true;
            bool last = true;
            for (int d = 0; d < f->n_choices; d++)
                if (!f->done[d] && !f->aborted[d])
                    last = false;
            atomic_fetch_add(&f->e->n_finished, 1);
            pd_gw_on_finish(f->req, c, reason); /* req is gone after the last one */
            if (last) {
                fake_free(f);
                return;
            }
        }
    }
    struct timeval tv = {0, (suseconds_t)(f->s.interval_s * 1e6)};
    evtimer_add(f->timer, &tv);
}

static int fake_submit(void *engine, pd_gw_request *req, const pd_gw_gen_params *p) {
    gwt_engine *e = engine;
    fake_req *f = calloc(1, sizeof *f);
    pthread_mutex_lock(&e->mu);
    f->s = e->script;
    e->last = *p;
    e->last.prompt_ids = NULL;
    e->last.stop_token_ids = NULL;
    e->last.request_id = NULL;
    e->last_n_prompt = p->n_prompt;
    memcpy(e->last_prompt, p->prompt_ids,
           (size_t)(p->n_prompt < 8192 ? p->n_prompt : 8192) * sizeof(int32_t));
    pthread_mutex_unlock(&e->mu);
    if (f->s.reject_status) {
        pd_gw_submit_error(req, f->s.reject_status, f->s.reject_retry_after, "fake engine is full");
        free(f);
        return -1;
    }
    atomic_fetch_add(&e->n_submitted, 1);
    atomic_fetch_add(&e->n_active, 1);
    f->e = e;
    f->req = req;
    f->n_choices = p->n;
    f->max_tokens = p->max_tokens;
    if (f->s.batch < 1)
        f->s.batch = 1;
    for (int c = 0; c < f->n_choices && c < 128; c++) {
        /* choice c reads ids[c*skip ..): emits n_ids - c*skip ids at most */
        int skip = f->s.choice_skip * c;
        f->pos[c] = skip < f->s.n_ids ? skip : f->s.n_ids;
    }
    int active = atomic_load(&e->n_active);
    int seen = atomic_load(&e->max_active);
    while (active > seen && !atomic_compare_exchange_weak(&e->max_active, &seen, active)) {
    }
    pd_gw_request_set_engine_data(req, f);
    f->timer = evtimer_new(e->base, fake_tick, f);
    double d = f->s.first_delay_s > 0 ? f->s.first_delay_s : f->s.interval_s;
    struct timeval tv = {(time_t)d, (suseconds_t)((d - (double)(time_t)d) * 1e6)};
    evtimer_add(f->timer, &tv);
    return 0;
}

static void fake_abort(void *engine, pd_gw_request *req) {
    gwt_engine *e = engine;
    fake_req *f = pd_gw_request_engine_data(req);
    atomic_fetch_add(&e->n_aborted, 1);
    if (f)
        fake_free(f);
}

static void fake_abort_choice(void *engine, pd_gw_request *req, int choice) {
    gwt_engine *e = engine;
    fake_req *f = pd_gw_request_engine_data(req);
    atomic_fetch_add(&e->n_choice_aborts, 1);
    if (f && choice >= 0 && choice < 128) {
        if (f->done[choice])
            atomic_fetch_add(&e->n_after_choice_abort, 1); /* already finished: not allowed */
        f->aborted[choice] = true;
    }
}

const pd_gw_engine_i gwt_engine_i = {.submit = fake_submit, .abort = fake_abort};
const pd_gw_abort_choice_fn gwt_engine_abort_choice = fake_abort_choice;

void gwt_engine_set(gwt_engine *e, const gwt_script *s) {
    pthread_mutex_lock(&e->mu);
    e->script = *s;
    pthread_mutex_unlock(&e->mu);
}

gwt_script gwt_script_ids(const int32_t *ids, int n) {
    gwt_script s;
    memset(&s, 0, sizeof s);
    if (n > 4096)
        n = 4096;
    memcpy(s.ids, ids, (size_t)n * sizeof *ids);
    s.n_ids = n;
    s.batch = 1;
    s.interval_s = 0.001;
    s.finish = "stop";
    s.error_after = -1;
    return s;
}

/* ---- server on a thread --------------------------------------------------- */

static void *loop_main(void *arg) {
    gwt_server *h = arg;
    event_base_loop(h->base, EVLOOP_NO_EXIT_ON_EMPTY);
    return NULL;
}

void gwt_config(pd_gw_config *cfg) {
    pd_gw_config_defaults(cfg);
    cfg->host = "127.0.0.1";
    cfg->port = 0;
    cfg->served_model_name = "test-model";
    cfg->max_model_len = 4096;
    cfg->tokenizer_handle = gwt_tokenizer();
}

int gwt_server_start(gwt_server *h, const pd_gw_config *cfg) {
    return gwt_server_start_setup(h, cfg, NULL, NULL);
}

int gwt_server_start_setup(gwt_server *h, const pd_gw_config *cfg,
                           void (*setup)(pd_gw_server *srv, void *ud), void *ud) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, (void (*)(void))evthread_use_pthreads);
    memset(h, 0, sizeof *h);
    pthread_mutex_init(&h->engine.mu, NULL);
    int32_t ids[1] = {0};
    h->engine.script = gwt_script_ids(ids, 0);
    pd_gw_config c;
    if (cfg)
        c = *cfg;
    else
        gwt_config(&c);
    if (!c.tokenizer_handle && !c.tokenizer)
        c.tokenizer_handle = gwt_tokenizer();
    h->base = event_base_new();
    h->engine.base = h->base;
    pd_err err;
    if (pd_gw_server_init(h->base, &c, &gwt_engine_i, &h->engine, &h->srv, &err) != PD_OK) {
        fprintf(stderr, "gwt_server_start: %s\n", err.msg);
        event_base_free(h->base);
        return -1;
    }
    h->port = pd_gw_server_port(h->srv);
    pd_gw_server_set_abort_choice(h->srv, gwt_engine_abort_choice);
    if (setup)
        setup(h->srv, ud);
    pthread_create(&h->thread, NULL, loop_main, h);
    return 0;
}

void gwt_server_stop(gwt_server *h) {
    event_base_loopbreak(h->base);
    pthread_join(h->thread, NULL);
    pd_gw_server_free(&h->srv); /* the fake engine's abort may run here */
    /* connections still open finish freeing from the loop: a TLS one that
     * had just written holds its SSL and socket until its deferred write
     * callback runs (pd_gw_server_free) */
    event_base_loop(h->base, EVLOOP_NONBLOCK);
    event_base_free(h->base);
    pthread_mutex_destroy(&h->engine.mu);
}

/* ---- raw HTTP client ------------------------------------------------------ */

gwt_conn *gwt_open(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(0x7f000001);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        if (fd >= 0)
            close(fd);
        return NULL;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    gwt_conn *c = calloc(1, sizeof *c);
    c->fd = fd;
    return c;
}

void gwt_close(gwt_conn *c) {
    if (!c)
        return;
    close(c->fd);
    free(c->buf);
    free(c);
}

int gwt_send(gwt_conn *c, const void *data, size_t len) {
    const char *p = data;
    while (len) {
        ssize_t w = send(c->fd, p, len, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

int gwt_sendf(gwt_conn *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    int n = vasprintf(&s, fmt, ap);
    va_end(ap);
    if (n < 0)
        return -1;
    int rc = gwt_send(c, s, (size_t)n);
    free(s);
    return rc;
}

/* Reads more bytes (10 s timeout). 0 ok, -1 EOF / timeout. */
static int fill(gwt_conn *c) {
    if (c->eof)
        return -1;
    struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
    int pr = poll(&pfd, 1, 10000);
    if (pr <= 0)
        return -1;
    if (c->len + 65536 + 1 > c->cap) {
        c->cap = (c->len + 65536 + 1) * 2;
        c->buf = realloc(c->buf, c->cap);
    }
    ssize_t r = recv(c->fd, c->buf + c->len, 65536, 0);
    if (r <= 0) {
        c->eof = true;
        return -1;
    }
    c->len += (size_t)r;
    c->buf[c->len] = 0;
    return 0;
}

static void consume(gwt_conn *c, size_t n) {
    memmove(c->buf, c->buf + n, c->len - n);
    c->len -= n;
    if (c->buf)
        c->buf[c->len] = 0;
}

/* A line ending in CRLF (returned without it, heap). */
static char *read_line(gwt_conn *c) {
    for (;;) {
        char *e = c->buf ? memmem(c->buf, c->len, "\r\n", 2) : NULL;
        if (e) {
            size_t n = (size_t)(e - c->buf);
            char *line = strndup(c->buf, n);
            consume(c, n + 2);
            return line;
        }
        if (fill(c))
            return NULL;
    }
}

static int read_exact(gwt_conn *c, size_t n, char *out) {
    while (c->len < n)
        if (fill(c))
            return -1;
    memcpy(out, c->buf, n);
    consume(c, n);
    return 0;
}

const char *gwt_header(const gwt_resp *r, const char *name, char *buf, size_t n) {
    const char *p = r->head ? strstr(r->head, "\r\n") : NULL;
    size_t nl = strlen(name);
    while (p && p[2]) {
        p += 2;
        const char *e = strstr(p, "\r\n");
        if (!e)
            e = p + strlen(p);
        if ((size_t)(e - p) > nl && strncasecmp(p, name, nl) == 0 && p[nl] == ':') {
            const char *v = p + nl + 1;
            while (*v == ' ')
                v++;
            snprintf(buf, n, "%.*s", (int)(e - v), v);
            return buf;
        }
        p = e;
    }
    return NULL;
}

int gwt_read_head(gwt_conn *c, gwt_resp *r) {
    memset(r, 0, sizeof *r);
    for (;;) {
        char *e;
        while (!(e = c->buf ? memmem(c->buf, c->len, "\r\n\r\n", 4) : NULL))
            if (fill(c))
                return -1;
        size_t n = (size_t)(e - c->buf) + 4;
        char *head = strndup(c->buf, n);
        consume(c, n);
        int status = 0;
        if (sscanf(head, "HTTP/1.%*d %d", &status) != 1) {
            free(head);
            return -1;
        }
        if (status >= 100 && status < 200) {
            r->saw_100 = true;
            free(head);
            continue;
        }
        r->status = status;
        r->head = head;
        char v[64];
        r->chunked =
            gwt_header(r, "Transfer-Encoding", v, sizeof v) && strcasecmp(v, "chunked") == 0;
        return 0;
    }
}

int gwt_read_chunk(gwt_conn *c, char **out, size_t *len_p) {
    char *line = read_line(c);
    if (!line)
        return -1;
    size_t n = strtoul(line, NULL, 16);
    free(line);
    if (n == 0) {
        for (;;) { /* trailers until the empty line */
            char *t = read_line(c);
            if (!t)
                return -1;
            bool empty = !*t;
            free(t);
            if (empty)
                break;
        }
        *out = NULL;
        *len_p = 0;
        return 1;
    }
    char *d = malloc(n + 1);
    if (read_exact(c, n, d)) {
        free(d);
        return -1;
    }
    d[n] = 0;
    char crlf[2];
    if (read_exact(c, 2, crlf) || memcmp(crlf, "\r\n", 2) != 0) {
        free(d);
        return -1;
    }
    *out = d;
    *len_p = n;
    return 0;
}

int gwt_read(gwt_conn *c, gwt_resp *r) {
    if (gwt_read_head(c, r))
        return -1;
    char v[64];
    size_t cap = 1024, len = 0;
    char *body = malloc(cap);
    if (r->chunked) {
        for (;;) {
            char *d;
            size_t n;
            int rc = gwt_read_chunk(c, &d, &n);
            if (rc < 0) {
                free(body);
                return -1;
            }
            if (rc == 1)
                break;
            r->n_chunks++;
            if (len + n + 1 > cap)
                body = realloc(body, cap = 2 * (len + n + 1));
            memcpy(body + len, d, n);
            len += n;
            free(d);
        }
    } else if (gwt_header(r, "Content-Length", v, sizeof v)) {
        len = strtoul(v, NULL, 10);
        if (len + 1 > cap)
            body = realloc(body, cap = len + 1);
        if (read_exact(c, len, body)) {
            free(body);
            return -1;
        }
    } else {
        while (fill(c) == 0) {
        }
        len = c->len;
        if (len + 1 > cap)
            body = realloc(body, cap = len + 1);
        memcpy(body, c->buf ? c->buf : "", len);
        consume(c, len);
    }
    body[len] = 0;
    r->body = body;
    r->body_len = len;
    return 0;
}

bool gwt_wait_closed(gwt_conn *c, double timeout_s) {
    struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
    double waited = 0;
    while (waited < timeout_s) {
        if (poll(&pfd, 1, 50) > 0) {
            char b[4096];
            ssize_t r = recv(c->fd, b, sizeof b, 0);
            if (r <= 0)
                return true;
        }
        waited += 0.05;
    }
    return false;
}

void gwt_resp_free(gwt_resp *r) {
    free(r->head);
    free(r->body);
    memset(r, 0, sizeof *r);
}

int gwt_post(int port, const char *path, const char *body, gwt_resp *r) {
    gwt_conn *c = gwt_open(port);
    if (!c)
        return -1;
    int rc;
    if (body)
        rc = gwt_sendf(c,
                       "POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                       "Content-Length: %zu\r\n\r\n%s",
                       path, strlen(body), body);
    else
        rc = gwt_sendf(c, "GET %s HTTP/1.1\r\nHost: t\r\n\r\n", path);
    if (rc == 0)
        rc = gwt_read(c, r);
    gwt_close(c);
    return rc;
}

int gwt_get(int port, const char *path, gwt_resp *r) {
    return gwt_post(port, path, NULL, r);
}

/* ---- SSE ------------------------------------------------------------------- */

void gwt_sse_parse(const char *body, size_t len, gwt_sse *s) {
    memset(s, 0, sizeof *s);
    const char *p = body, *end = body + len;
    while (p < end) {
        const char *e = memchr(p, '\n', (size_t)(end - p));
        if (!e)
            e = end;
        size_t n = (size_t)(e - p);
        if (n == 0) {
            /* event separator */
        } else if (n >= 6 && memcmp(p, "data: ", 6) == 0) {
            s->data = realloc(s->data, (size_t)(s->n + 1) * sizeof *s->data);
            s->data[s->n++] = strndup(p + 6, n - 6);
        } else if (p[0] == ':') {
            s->n_comments++;
        } else {
            s->bad++;
        }
        p = e + 1;
    }
}

void gwt_sse_free(gwt_sse *s) {
    for (int i = 0; i < s->n; i++)
        free(s->data[i]);
    free(s->data);
    memset(s, 0, sizeof *s);
}

int gwt_wait_atomic(atomic_int *v, int want, double timeout_s) {
    for (double t = 0; t < timeout_s; t += 0.01) {
        if (atomic_load(v) >= want)
            break;
        usleep(10000);
    }
    return atomic_load(v);
}

/* The HTTP/2 protocol handler (RFC 9113) over nghttp2: many gw_streams per
 * connection, the same application above (gw_stream.c) as HTTP/1.1.
 *
 * A connection arrives here three ways: a cleartext connection whose first
 * 24 bytes are the client preface (prior knowledge; the preface stays in the
 * input and nghttp2 checks it as the client magic), an HTTP/1.1 request with
 * `Upgrade: h2c` (gw_h2_upgrade: 101, then the request is stream 1), or TLS
 * with ALPN "h2". The structure follows nghttp2's examples/libevent-server.c:
 * the connection (h2_conn) is every callback's user_data, each stream's
 * state (h2_stream) is nghttp2's stream user data and the gw_stream's
 * proto_data.
 *
 * Requests: headers and pseudo-headers fill the gw_stream (limits as in
 * HTTP/1.1: 431 over max_header_bytes counted as RFC 9113 §6.5.2 field sizes
 * or max_header_count fields; 413 over max_request_body_bytes, decided from
 * content-length when given; 408 when its HEADERS do not end within
 * timeout_request_headers_s of their start, or its body within
 * timeout_request_body_s of the HEADERS' end); DATA is appended to the body and, once END_STREAM
 * arrived, the stream is dispatched. Flow control: nghttp2 sends
 * WINDOW_UPDATE for what was consumed (its automatic mode; every DATA byte is
 * consumed when appended), the stream window is the 64 KiB default and the
 * connection window GW_H2_CONN_WINDOW, so a 1 MiB body arrives in many
 * windows and concurrent uploads do not starve each other. A refusal before
 * the request ended is answered, then the stream is reset with NO_ERROR
 * (RFC 9113 §8.1) once the response went out.
 *
 * Responses: HEADERS carry :status, content-type, content-length when known,
 * date, server and the application's headers lower-cased; connection-
 * specific fields (Connection, Keep-Alive, Proxy-Connection,
 * Transfer-Encoding, Upgrade) are never sent (RFC 9113 §8.2.2), and nghttp2
 * refuses them in requests. Bodies flow through a data provider that reads
 * the stream's pending buffer and returns NGHTTP2_ERR_DEFERRED when it is
 * empty; the next write resumes it (nghttp2_session_resume_data).
 *
 * Back-pressure: nghttp2 writes into the bufferevent's output through
 * h2_send_cb, which answers NGHTTP2_ERR_WOULDBLOCK above
 * output_high_water_bytes; the connection's write callback (on_write)
 * resumes sending below half of it. A client that does not read therefore
 * holds at most the high-water mark in the connection's output; what its
 * streams' windows do not let through waits in the streams' pending
 * buffers, which the engine fills at generation speed. Two bounds keep a
 * stalled reader cheap: all pending buffers of a connection together stay
 * under GW_H2_MAX_PENDING times the high-water mark (beyond it the stream
 * holding the most is reset with CANCEL and its request aborted), and a
 * stream whose pending data makes no progress for timeout_write_s is reset
 * the same way (the socket-level write timeout cannot see a stall that flow
 * control hides).
 *
 * RST_STREAM from the client closes that stream only: its close callback
 * aborts its request (engine->abort) and the other streams go on. A client
 * that resets streams faster than GW_H2_MAX_RESETS(limit) per second (the
 * "rapid reset" attack, CVE-2023-44487, which nghttp2 1.52 does not bound
 * itself), whether their requests were whole or still sending a body, gets
 * GOAWAY(ENHANCE_YOUR_CALM).
 *
 * Re-entrancy: nghttp2 is driven only from this connection's event
 * callbacks (read, write, deferred, timers). The application's response
 * calls (respond/start/write/end) only queue and schedule a send through
 * gw_conn_defer, so stream close callbacks, which free requests, never run
 * inside an application or engine call.
 */
#include <ctype.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include <nghttp2/nghttp2.h>

#include "gw_internal.h"

/* Connection receive window: 1 MiB, so that a few streams can upload at
 * their full 64 KiB stream window at once. */
#define GW_H2_CONN_WINDOW (1 << 20)
/* The unsent responses of a connection's streams may reach this many times
 * output_high_water_bytes before the largest is reset as a stalled reader. */
#define GW_H2_MAX_PENDING 16
/* Streams the client may reset per second on one connection before
 * GOAWAY(ENHANCE_YOUR_CALM). */
#define GW_H2_MAX_RESETS(max_streams) (2 * (max_streams) + 100)
/* Response headers the application may add. */
#define GW_H2_MAX_APP_HDRS 24

typedef struct h2_conn h2_conn;
typedef struct h2_stream h2_stream;

struct h2_stream {
    h2_conn *h;
    gw_stream *st;
    int32_t id;
    struct evbuffer *out; /* response body not yet taken by nghttp2 (h2_out_*) */
    struct event *timer;  /* receiving: the headers, then the body, must arrive within
                             timeout_request_headers_s / _body_s; responding: out must
                             make progress within timeout_write_s */
    bool eof;             /* the application ended the response */
    bool deferred;        /* the data provider returned NGHTTP2_ERR_DEFERRED */
    bool remote_closed;   /* END_STREAM received */
    bool rst_after_end;   /* answered before the request ended: RST(NO_ERROR) after */
    bool reset;           /* reset by us: further writes are dropped */
    bool no_body;         /* HEAD: the response ended with its HEADERS */
    bool in_body;         /* the HEADERS ended: the timer is the body's */
    int err_status;       /* refusal decided while headers arrive (431, 500) */
    const char *err_msg;  /* err_buf, or a static string */
    char err_buf[160];
    h2_stream *prev, *next;
};

struct h2_conn {
    gw_conn *c;
    nghttp2_session *ng;
    h2_stream *streams; /* every stream nghttp2 has not closed yet */
    int n_streams;
    size_t pending;         /* bytes in all streams' out buffers */
    double reset_window_t0; /* rapid-reset guard: the current one-second window */
    int n_resets;           /* streams the client reset in it */
    bool freeing;           /* on_close: streams are being freed */
};

/* ---- streams ---------------------------------------------------------- */

static void h2_stream_timer_cb(evutil_socket_t fd, short what, void *arg);

/* A stream state around st (NULL: a new gw_stream). */
static h2_stream *h2_stream_new(h2_conn *h, int32_t id, gw_stream *st) {
    h2_stream *hs = calloc(1, sizeof *hs);
    if (!hs)
        return NULL;
    hs->h = h;
    hs->id = id;
    hs->st = st ? st : gw_stream_new(h->c);
    hs->out = evbuffer_new();
    hs->timer = evtimer_new(h->c->srv->base, h2_stream_timer_cb, hs);
    if (!hs->st || !hs->out || !hs->timer) {
        if (hs->timer)
            event_free(hs->timer);
        if (hs->out)
            evbuffer_free(hs->out);
        if (!st)
            gw_stream_free(hs->st);
        free(hs);
        return NULL;
    }
    hs->st->proto_data = hs;
    hs->st->http_major = 2;
    hs->st->http_minor = 0;
    hs->next = h->streams;
    if (h->streams)
        h->streams->prev = hs;
    h->streams = hs;
    h->n_streams++;
    gw_conn_set_timer(h->c, 0); /* not idle */
    return hs;
}

/* Unlinks and frees hs; the gw_stream's close callback runs when the
 * application had it and its response had not ended. */
static void h2_stream_free(h2_stream *hs) {
    h2_conn *h = hs->h;
    if (hs->prev)
        hs->prev->next = hs->next;
    else
        h->streams = hs->next;
    if (hs->next)
        hs->next->prev = hs->prev;
    h->n_streams--;
    h->pending -= evbuffer_get_length(hs->out);
    gw_stream_free(hs->st); /* its close callback may still look at the stream */
    event_free(hs->timer);
    evbuffer_free(hs->out);
    free(hs);
    if (h->n_streams == 0 && !h->freeing && !h->c->closing)
        gw_conn_set_timer(h->c, h->c->srv->cfg.timeout_keep_alive_s);
}

/* Sends what nghttp2 has queued. Returns false when c was freed. Only from
 * this connection's event callbacks. */
static bool h2_flush(h2_conn *h) {
    gw_conn *c = h->c;
    int rv = nghttp2_session_send(h->ng);
    if (rv != 0) {
        PD_LOGD(GW_MOD, "conn %llu (%s): h2 send: %s", (unsigned long long)c->id, c->peer,
                nghttp2_strerror(rv));
        gw_conn_free(c);
        return false;
    }
    gw_conn_flushed(c);
    if (!nghttp2_session_want_read(h->ng) && !nghttp2_session_want_write(h->ng))
        gw_conn_close(c); /* GOAWAY exchanged and no stream left */
    return true;
}

/* From the application's side: send soon, from the event loop. */
static void h2_schedule(h2_conn *h) {
    if (!h->c->closing)
        gw_conn_defer(h->c);
}

static void h2_arm_timer(h2_stream *hs, double seconds) {
    if (seconds <= 0)
        return;
    struct timeval tv = gw_timeval(seconds);
    evtimer_add(hs->timer, &tv);
}

/* Response bytes for nghttp2 to take: counted in h->pending, and the stall
 * timer runs while some wait. */
static int h2_out_add(h2_stream *hs, const void *data, size_t len) {
    if (evbuffer_add(hs->out, data, len) != 0)
        return -1;
    hs->h->pending += len;
    if (!evtimer_pending(hs->timer, NULL))
        h2_arm_timer(hs, hs->h->c->srv->cfg.timeout_write_s);
    return 0;
}

static size_t h2_out_remove(h2_stream *hs, void *buf, size_t len) {
    int n = evbuffer_remove(hs->out, buf, len);
    if (n <= 0)
        return 0;
    hs->h->pending -= (size_t)n;
    if (evbuffer_get_length(hs->out) == 0)
        evtimer_del(hs->timer);
    else
        h2_arm_timer(hs, hs->h->c->srv->cfg.timeout_write_s); /* progress */
    return (size_t)n;
}

/* Gives up on a response the client does not take: RST_STREAM(CANCEL); the
 * close callback then aborts the request, from the event loop. */
static void h2_reset_stalled(h2_stream *hs, const char *why) {
    h2_conn *h = hs->h;
    PD_LOGW(GW_MOD, "conn %llu stream %d: %s (%zu bytes pending); resetting the stream",
            (unsigned long long)h->c->id, hs->id, why, evbuffer_get_length(hs->out));
    hs->reset = true;
    h->pending -= evbuffer_get_length(hs->out);
    evbuffer_drain(hs->out, evbuffer_get_length(hs->out));
    evtimer_del(hs->timer);
    nghttp2_submit_rst_stream(h->ng, NGHTTP2_FLAG_NONE, hs->id, NGHTTP2_CANCEL);
    h2_schedule(h);
}

static void h2_date(char *buf, size_t n) {
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(buf, n, "%a, %d %b %Y %H:%M:%S GMT", &tm);
}

/* Fields that only mean something to one HTTP/1.1 hop (RFC 9113 §8.2.2). */
static bool is_connection_specific(const char *name) {
    static const char *const names[] = {"connection", "keep-alive", "proxy-connection",
                                        "transfer-encoding", "upgrade"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (strcasecmp(name, names[i]) == 0)
            return true;
    return false;
}

static ssize_t h2_data_read_cb(nghttp2_session *ng, int32_t id, uint8_t *buf, size_t length,
                               uint32_t *data_flags, nghttp2_data_source *source, void *ud) {
    h2_stream *hs = source->ptr;
    size_t n = h2_out_remove(hs, buf, length);
    if (evbuffer_get_length(hs->out) == 0) {
        if (hs->eof) {
            *data_flags |= NGHTTP2_DATA_FLAG_EOF;
        } else if (n == 0) {
            hs->deferred = true;
            return NGHTTP2_ERR_DEFERRED;
        }
    }
    return (ssize_t)n;
}

/* Submits the response HEADERS of hs; the body then comes from hs->out when
 * with_body. content_length < 0: unknown (streamed). Returns 0 or -1. */
static int h2_submit(h2_stream *hs, int status, const char *ctype, const gw_hdr *hdrs, int n_hdrs,
                     long long content_length, bool with_body) {
    h2_conn *h = hs->h;
    nghttp2_nv nv[5 + GW_H2_MAX_APP_HDRS];
    char names[GW_H2_MAX_APP_HDRS][64];
    int n = 0;
    char status_s[8], clen[24], date[64];
    snprintf(status_s, sizeof status_s, "%d", status);
#define NV(nm, val)                                                                                \
    nv[n++] = (nghttp2_nv){(uint8_t *)(nm), (uint8_t *)(val), strlen(nm), strlen(val),             \
                           NGHTTP2_NV_FLAG_NONE}
    NV(":status", status_s);
    if (ctype)
        NV("content-type", ctype);
    if (content_length >= 0) {
        snprintf(clen, sizeof clen, "%lld", content_length);
        NV("content-length", clen);
    }
    h2_date(date, sizeof date);
    NV("date", date);
    NV("server", "pdserve");
    int k = 0;
    for (int i = 0; i < n_hdrs && k < GW_H2_MAX_APP_HDRS; i++) {
        size_t len = strlen(hdrs[i].name);
        if (len == 0 || len >= sizeof names[k] || is_connection_specific(hdrs[i].name))
            continue;
        for (size_t j = 0; j <= len; j++) /* HTTP/2 field names are lower case */
            names[k][j] = (char)tolower((unsigned char)hdrs[i].name[j]);
        NV(names[k], hdrs[i].value);
        k++;
    }
#undef NV
    nghttp2_data_provider prd = {.source.ptr = hs, .read_callback = h2_data_read_cb};
    int rv = nghttp2_submit_response(h->ng, hs->id, nv, (size_t)n, with_body ? &prd : NULL);
    if (rv != 0) {
        PD_LOGW(GW_MOD, "conn %llu stream %d: cannot submit the response: %s",
                (unsigned long long)h->c->id, hs->id, nghttp2_strerror(rv));
        nghttp2_submit_rst_stream(h->ng, NGHTTP2_FLAG_NONE, hs->id, NGHTTP2_INTERNAL_ERROR);
        return -1;
    }
    return 0;
}

/* Answers a request the application never saw (limits, timeout). */
static void h2_refuse(h2_stream *hs, int status, const char *msg) {
    gw_stream *st = hs->st;
    if (st->state != GW_STREAM_RECEIVING)
        return;
    evtimer_del(hs->timer);
    PD_LOGD(GW_MOD, "conn %llu stream %d: %d %s", (unsigned long long)hs->h->c->id, hs->id, status,
            msg);
    st->state = GW_STREAM_ENDED;
    char *body = gw_error_json(status, msg, NULL);
    size_t len = strlen(body);
    h2_out_add(hs, body, len);
    free(body);
    hs->eof = true;
    h2_submit(hs, status, "application/json", NULL, 0, (long long)len, true);
    if (!hs->remote_closed)
        hs->rst_after_end = true;
}

static void h2_refuse_body(h2_stream *hs) {
    char msg[160];
    snprintf(msg, sizeof msg, "request body exceeds --max-request-body-bytes (%zu bytes)",
             hs->h->c->srv->cfg.max_request_body_bytes);
    h2_refuse(hs, 413, msg);
}

static void h2_stream_timer_cb(evutil_socket_t fd, short what, void *arg) {
    h2_stream *hs = arg;
    h2_conn *h = hs->h;
    if (hs->st->state == GW_STREAM_RECEIVING) {
        const pd_gw_config *cfg = &h->c->srv->cfg;
        char msg[160];
        if (hs->in_body)
            snprintf(msg, sizeof msg,
                     "the request body did not arrive within --timeout-request-body (%g s)",
                     cfg->timeout_request_body_s);
        else
            snprintf(msg, sizeof msg,
                     "the request headers did not arrive within --timeout-request-headers (%g s)",
                     cfg->timeout_request_headers_s);
        h2_refuse(hs, 408, msg);
    }
    else if (evbuffer_get_length(hs->out) > 0 && !hs->reset)
        h2_reset_stalled(hs, "no write progress for timeout_write_s");
    h2_flush(h);
}

/* ---- nghttp2 callbacks ------------------------------------------------- */

static ssize_t h2_send_cb(nghttp2_session *ng, const uint8_t *data, size_t length, int flags,
                          void *ud) {
    h2_conn *h = ud;
    struct evbuffer *out = gw_conn_output(h->c);
    if (evbuffer_get_length(out) >= h->c->srv->cfg.output_high_water_bytes)
        return NGHTTP2_ERR_WOULDBLOCK; /* on_write resumes below half of it */
    if (evbuffer_add(out, data, length) != 0)
        return NGHTTP2_ERR_CALLBACK_FAILURE;
    return (ssize_t)length;
}

static int h2_on_begin_headers_cb(nghttp2_session *ng, const nghttp2_frame *f, void *ud) {
    h2_conn *h = ud;
    if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST)
        return 0;
    h2_stream *hs = h2_stream_new(h, f->hd.stream_id, NULL);
    if (!hs)
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE; /* resets the stream */
    nghttp2_session_set_stream_user_data(ng, f->hd.stream_id, hs);
    h2_arm_timer(hs, h->c->srv->cfg.timeout_request_headers_s);
    return 0;
}

static bool name_is(const uint8_t *name, size_t len, const char *want) {
    return len == strlen(want) && memcmp(name, want, len) == 0;
}

static void h2_set_path(gw_stream *st, const char *v, size_t len) {
    const char *q = memchr(v, '?', len);
    size_t plen = q ? (size_t)(q - v) : len;
    free(st->path);
    free(st->query);
    st->path = strndup(v, plen);
    st->query = q ? strndup(q + 1, len - plen - 1) : NULL;
}

static int h2_on_header_cb(nghttp2_session *ng, const nghttp2_frame *f, const uint8_t *name,
                           size_t namelen, const uint8_t *value, size_t valuelen, uint8_t flags,
                           void *ud) {
    h2_conn *h = ud;
    if (f->hd.type != NGHTTP2_HEADERS || f->headers.cat != NGHTTP2_HCAT_REQUEST)
        return 0; /* trailers are accepted and ignored */
    h2_stream *hs = nghttp2_session_get_stream_user_data(ng, f->hd.stream_id);
    if (!hs || hs->err_status)
        return 0;
    gw_stream *st = hs->st;
    const pd_gw_config *cfg = &h->c->srv->cfg;
    st->hdr_bytes += namelen + valuelen + 32;
    if (st->hdr_bytes > cfg->max_header_bytes) {
        hs->err_status = 431;
        snprintf(hs->err_buf, sizeof hs->err_buf,
                 "request headers exceed --max-header-bytes (%zu bytes)", cfg->max_header_bytes);
        hs->err_msg = hs->err_buf;
        return 0;
    }
    const char *v = (const char *)value;
    if (namelen && name[0] == ':') {
        if (name_is(name, namelen, ":method")) {
            free(st->method);
            st->method = strndup(v, valuelen);
        } else if (name_is(name, namelen, ":path")) {
            h2_set_path(st, v, valuelen);
        } else if (name_is(name, namelen, ":authority")) {
            if (gw_stream_add_header(st, "host", 4, v, valuelen) != PD_OK)
                hs->err_status = 500, hs->err_msg = "out of memory";
        }
        return 0; /* :scheme, :protocol: not needed */
    }
    if (st->n_hdrs >= cfg->max_header_count) {
        hs->err_status = 431;
        snprintf(hs->err_buf, sizeof hs->err_buf,
                 "more than --max-header-count (%d) request header fields",
                 cfg->max_header_count);
        hs->err_msg = hs->err_buf;
        return 0;
    }
    if (gw_stream_add_header(st, (const char *)name, namelen, v, valuelen) != PD_OK) {
        hs->err_status = 500;
        hs->err_msg = "out of memory";
    }
    return 0;
}

/* The request's HEADERS ended: check what can be checked before a body. */
static void h2_headers_done(h2_stream *hs) {
    gw_stream *st = hs->st;
    if (st->state != GW_STREAM_RECEIVING)
        return;
    if (hs->err_status) {
        h2_refuse(hs, hs->err_status, hs->err_msg);
        return;
    }
    if (!st->method || !st->path) {
        /* nghttp2 checks pseudo-headers; this is CONNECT or out of memory */
        h2_refuse(hs, st->method && strcmp(st->method, "CONNECT") == 0 ? 405 : 400,
                  "the request lacks :method or :path");
        return;
    }
    st->head = strcmp(st->method, "HEAD") == 0;
    const char *cl = gw_stream_header(st, "content-length");
    if (cl) {
        char *end;
        unsigned long long n = strtoull(cl, &end, 10);
        if (*end == 0 && n > hs->h->c->srv->cfg.max_request_body_bytes)
            h2_refuse_body(hs);
    }
    if (st->state == GW_STREAM_RECEIVING) {
        hs->in_body = true; /* without a body, END_STREAM dispatches it right away */
        evtimer_del(hs->timer);
        h2_arm_timer(hs, hs->h->c->srv->cfg.timeout_request_body_s);
    }
}

static void h2_request_done(h2_stream *hs) {
    gw_stream *st = hs->st;
    if (st->state != GW_STREAM_RECEIVING)
        return; /* refused already */
    evtimer_del(hs->timer);
    st->state = GW_STREAM_DISPATCHED;
    gw_server_dispatch(st);
}

/* The rapid-reset guard: one more stream the client reset (RST_STREAM on a
 * stream it opened, whatever the stream's state: a request still sending
 * its body costs its stream and headers too, helper-53). */
static void h2_count_reset(nghttp2_session *ng, h2_conn *h) {
    double now = pd_now_s();
    if (now - h->reset_window_t0 > 1.0) {
        h->reset_window_t0 = now;
        h->n_resets = 0;
    }
    if (++h->n_resets == GW_H2_MAX_RESETS(h->c->srv->cfg.max_concurrent_streams)) {
        PD_LOGW(GW_MOD, "conn %llu (%s): %d streams reset within a second; GOAWAY", (unsigned long long)h->c->id,
                h->c->peer, h->n_resets);
        nghttp2_session_terminate_session(ng, NGHTTP2_ENHANCE_YOUR_CALM);
    }
}

static int h2_on_frame_recv_cb(nghttp2_session *ng, const nghttp2_frame *f, void *ud) {
    if (f->hd.type == NGHTTP2_RST_STREAM) {
        h2_count_reset(ng, ud);
        return 0;
    }
    if (f->hd.type != NGHTTP2_HEADERS && f->hd.type != NGHTTP2_DATA)
        return 0;
    h2_stream *hs = nghttp2_session_get_stream_user_data(ng, f->hd.stream_id);
    if (!hs)
        return 0;
    if (f->hd.type == NGHTTP2_HEADERS && f->headers.cat == NGHTTP2_HCAT_REQUEST)
        h2_headers_done(hs);
    if (f->hd.flags & NGHTTP2_FLAG_END_STREAM) {
        hs->remote_closed = true;
        h2_request_done(hs);
    }
    return 0;
}

static int h2_on_data_chunk_recv_cb(nghttp2_session *ng, uint8_t flags, int32_t id,
                                    const uint8_t *data, size_t len, void *ud) {
    h2_conn *h = ud;
    h2_stream *hs = nghttp2_session_get_stream_user_data(ng, id);
    if (!hs || hs->st->state != GW_STREAM_RECEIVING)
        return 0; /* consumed and dropped (the window still opens) */
    struct evbuffer *body = hs->st->body;
    if (evbuffer_get_length(body) + len > h->c->srv->cfg.max_request_body_bytes) {
        h2_refuse_body(hs);
        return 0;
    }
    if (evbuffer_add(body, data, len) != 0)
        h2_refuse(hs, 500, "out of memory");
    return 0;
}

static int h2_on_frame_send_cb(nghttp2_session *ng, const nghttp2_frame *f, void *ud) {
    if ((f->hd.type != NGHTTP2_HEADERS && f->hd.type != NGHTTP2_DATA) ||
        !(f->hd.flags & NGHTTP2_FLAG_END_STREAM))
        return 0;
    h2_stream *hs = nghttp2_session_get_stream_user_data(ng, f->hd.stream_id);
    if (hs && hs->rst_after_end && !hs->remote_closed)
        nghttp2_submit_rst_stream(ng, NGHTTP2_FLAG_NONE, hs->id, NGHTTP2_NO_ERROR);
    return 0;
}

static int h2_on_stream_close_cb(nghttp2_session *ng, int32_t id, uint32_t error_code, void *ud) {
    h2_conn *h = ud;
    h2_stream *hs = nghttp2_session_get_stream_user_data(ng, id);
    if (!hs)
        return 0;
    nghttp2_session_set_stream_user_data(ng, id, NULL);
    gw_stream_state state = hs->st->state;
    if (state == GW_STREAM_DISPATCHED || state == GW_STREAM_STARTED)
        PD_LOGD(GW_MOD, "conn %llu stream %d: closed before the response ended (%s)",
                (unsigned long long)h->c->id, id, nghttp2_http2_strerror(error_code));
    h2_stream_free(hs); /* the application's close callback aborts its request */
    return 0;
}

static int h2_error_cb(nghttp2_session *ng, int code, const char *msg, size_t len, void *ud) {
    h2_conn *h = ud;
    PD_LOGD(GW_MOD, "conn %llu (%s): h2: %.*s", (unsigned long long)h->c->id, h->c->peer, (int)len,
            msg);
    return 0;
}

/* ---- the connection ------------------------------------------------------ */

static h2_conn *h2_conn_new(gw_conn *c) {
    h2_conn *h = calloc(1, sizeof *h);
    if (!h)
        return NULL;
    h->c = c;
    nghttp2_session_callbacks *cbs;
    if (nghttp2_session_callbacks_new(&cbs) != 0) {
        free(h);
        return NULL;
    }
    nghttp2_session_callbacks_set_send_callback(cbs, h2_send_cb);
    nghttp2_session_callbacks_set_on_begin_headers_callback(cbs, h2_on_begin_headers_cb);
    nghttp2_session_callbacks_set_on_header_callback(cbs, h2_on_header_cb);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, h2_on_frame_recv_cb);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, h2_on_data_chunk_recv_cb);
    nghttp2_session_callbacks_set_on_frame_send_callback(cbs, h2_on_frame_send_cb);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs, h2_on_stream_close_cb);
    nghttp2_session_callbacks_set_error_callback2(cbs, h2_error_cb);
    int rv = nghttp2_session_server_new(&h->ng, cbs, h);
    nghttp2_session_callbacks_del(cbs);
    if (rv != 0) {
        free(h);
        return NULL;
    }
    return h;
}

/* Queues the server preface: SETTINGS and the connection window. */
static int h2_conn_start(h2_conn *h) {
    const pd_gw_config *cfg = &h->c->srv->cfg;
    nghttp2_settings_entry iv[] = {
        {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, (uint32_t)cfg->max_concurrent_streams},
        {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, (uint32_t)cfg->max_header_bytes},
    };
    int rv = nghttp2_submit_settings(h->ng, NGHTTP2_FLAG_NONE, iv, sizeof iv / sizeof *iv);
    if (rv == 0)
        rv = nghttp2_session_set_local_window_size(h->ng, NGHTTP2_FLAG_NONE, 0, GW_H2_CONN_WINDOW);
    return rv;
}

static pd_status h2_init(gw_conn *c) {
    h2_conn *h = h2_conn_new(c);
    if (!h)
        return PD_ERR_NOMEM;
    if (h2_conn_start(h) != 0) {
        nghttp2_session_del(h->ng);
        free(h);
        return PD_ERR_NOMEM;
    }
    c->proto_data = h;
    gw_conn_set_timer(c, c->srv->cfg.timeout_keep_alive_s);
    gw_conn_defer(c); /* our preface goes out even before the client's arrives */
    return PD_OK;
}

pd_status gw_h2_upgrade(gw_conn *c, gw_stream *st, const uint8_t *settings, size_t len) {
    h2_conn *h = h2_conn_new(c);
    if (!h)
        return PD_ERR_NOMEM;
    h2_stream *hs = h2_stream_new(h, 1, st);
    if (!hs) {
        nghttp2_session_del(h->ng);
        free(h);
        return PD_ERR_NOMEM;
    }
    int major = st->http_major, minor = st->http_minor;
    int rv = nghttp2_session_upgrade2(h->ng, settings, len, st->head, hs);
    if (rv == 0)
        rv = h2_conn_start(h);
    if (rv != 0) {
        PD_LOGD(GW_MOD, "conn %llu: h2c upgrade refused: %s", (unsigned long long)c->id,
                nghttp2_strerror(rv));
        /* undo without freeing st, which stays with HTTP/1.1 */
        st->proto_data = NULL;
        st->http_major = major;
        st->http_minor = minor;
        h->streams = NULL;
        event_free(hs->timer);
        evbuffer_free(hs->out);
        free(hs);
        nghttp2_session_del(h->ng);
        free(h);
        return PD_ERR_FORMAT;
    }
    hs->remote_closed = true; /* stream 1 is half-closed (remote) */
    evbuffer_add_printf(gw_conn_output(c),
                        "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                        "Upgrade: h2c\r\n\r\n");
    c->proto = &gw_proto_h2;
    c->proto_data = h;
    PD_LOGD(GW_MOD, "conn %llu (%s): upgraded to h2c", (unsigned long long)c->id, c->peer);
    st->state = GW_STREAM_DISPATCHED;
    gw_server_dispatch(st);
    gw_conn_defer(c); /* the client preface may already wait in the input */
    return PD_OK;
}

/* Feeds the input to nghttp2. Returns false when c was freed. */
static bool h2_recv(h2_conn *h) {
    gw_conn *c = h->c;
    struct evbuffer *in = bufferevent_get_input(c->bev);
    while (!c->closing && evbuffer_get_length(in) > 0) {
        struct evbuffer_iovec v;
        if (evbuffer_peek(in, -1, NULL, &v, 1) < 1)
            break;
        ssize_t n = nghttp2_session_mem_recv(h->ng, v.iov_base, v.iov_len);
        if (n < 0) {
            PD_LOGD(GW_MOD, "conn %llu (%s): h2: %s", (unsigned long long)c->id, c->peer,
                    nghttp2_strerror((int)n));
            gw_conn_free(c);
            return false;
        }
        evbuffer_drain(in, (size_t)n);
    }
    return true;
}

static void h2_on_read(gw_conn *c) {
    h2_conn *h = c->proto_data;
    if (h2_recv(h))
        h2_flush(h);
}

static void h2_on_write(gw_conn *c) {
    h2_conn *h = c->proto_data;
    if (nghttp2_session_want_write(h->ng))
        h2_flush(h);
}

static void h2_on_timeout(gw_conn *c) {
    h2_conn *h = c->proto_data;
    if (h->n_streams > 0)
        return;
    /* idle: GOAWAY, then close once it is out */
    nghttp2_session_terminate_session(h->ng, NGHTTP2_NO_ERROR);
    if (h2_flush(h))
        gw_conn_close(c);
}

static void h2_on_eof(gw_conn *c) {
    h2_conn *h = c->proto_data;
    for (h2_stream *hs = h->streams; hs; hs = hs->next) {
        if (hs->st->state == GW_STREAM_DISPATCHED || hs->st->state == GW_STREAM_STARTED) {
            gw_conn_free(c); /* the client is gone: abort what is in flight */
            return;
        }
    }
    if (h2_flush(h))
        gw_conn_close(c);
}

static void h2_on_close(gw_conn *c) {
    h2_conn *h = c->proto_data;
    if (!h)
        return;
    h->freeing = true;
    while (h->streams) {
        h2_stream *hs = h->streams;
        nghttp2_session_set_stream_user_data(h->ng, hs->id, NULL);
        h2_stream_free(hs);
    }
    nghttp2_session_del(h->ng);
    free(h);
}

/* ---- responses (gw_proto_i) ----------------------------------------------- */

static int h2_respond(gw_stream *st, int status, const char *ctype, const gw_hdr *hdrs, int n_hdrs,
                      const void *body, size_t len) {
    h2_stream *hs = st->proto_data;
    bool with_body = !st->head && len > 0;
    if (with_body)
        h2_out_add(hs, body, len);
    hs->eof = true;
    st->state = GW_STREAM_ENDED;
    h2_submit(hs, status, ctype, hdrs, n_hdrs, (long long)len, with_body);
    h2_schedule(hs->h);
    return 0;
}

static int h2_start(gw_stream *st, int status, const char *ctype, const gw_hdr *hdrs, int n_hdrs) {
    h2_stream *hs = st->proto_data;
    hs->no_body = st->head;
    st->state = GW_STREAM_STARTED;
    int rc = h2_submit(hs, status, ctype, hdrs, n_hdrs, -1, !hs->no_body);
    if (rc)
        hs->reset = true;
    h2_schedule(hs->h);
    return rc;
}

static int h2_write(gw_stream *st, const void *data, size_t len) {
    h2_stream *hs = st->proto_data;
    if (hs->reset)
        return -1;
    if (hs->no_body)
        return 0;
    h2_conn *h = hs->h;
    size_t cap = GW_H2_MAX_PENDING * h->c->srv->cfg.output_high_water_bytes;
    while (h->pending + len > cap) {
        /* the connection holds too much that its client does not take: the
         * stream holding the most goes (this one, or a staller) */
        h2_stream *big = hs;
        for (h2_stream *o = h->streams; o; o = o->next)
            if (!o->reset && evbuffer_get_length(o->out) > evbuffer_get_length(big->out))
                big = o;
        h2_reset_stalled(big, "the client reads too slowly");
        if (big == hs)
            return -1;
    }
    if (h2_out_add(hs, data, len) != 0)
        return -1;
    if (hs->deferred) {
        hs->deferred = false;
        nghttp2_session_resume_data(h->ng, hs->id);
    }
    h2_schedule(h);
    return 0;
}

static int h2_end(gw_stream *st) {
    h2_stream *hs = st->proto_data;
    hs->eof = true;
    st->state = GW_STREAM_ENDED;
    if (hs->deferred && !hs->reset && !hs->no_body) {
        hs->deferred = false;
        nghttp2_session_resume_data(hs->h->ng, hs->id);
    }
    h2_schedule(hs->h);
    return 0;
}

const gw_proto_i gw_proto_h2 = {
    .name = "h2",
    .init = h2_init,
    .on_read = h2_on_read,
    .on_deferred = h2_on_read,
    .on_write = h2_on_write,
    .on_timeout = h2_on_timeout,
    .on_eof = h2_on_eof,
    .on_close = h2_on_close,
    .respond = h2_respond,
    .start = h2_start,
    .write = h2_write,
    .end = h2_end,
};

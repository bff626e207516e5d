/* A small HTTP/2 client for the gateway's tests, over nghttp2's client
 * session and a blocking socket (optionally TLS with ALPN), so that tests can
 * do what real clients do and a little more: many streams on one
 * connection, request bodies larger than the windows, RST_STREAM of one
 * stream, a stalled reader (manual flow control), prior knowledge, the
 * HTTP/1.1 `Upgrade: h2c` exchange. Included (as a .c) by the h2 test after
 * gw_test_util.c.
 *
 *   h2c_connect / h2c_upgrade → h2c_request per stream → h2c_run until a
 *   predicate holds → read the h2c_stream fields → h2c_free.
 */
#include <nghttp2/nghttp2.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

typedef struct {
    int32_t id;
    int status;
    char *hdrs; /* "name: value\n" lines, as received */
    size_t hdrs_len;
    char *body; /* NUL-terminated */
    size_t len, cap;
    bool closed; /* nghttp2 closed the stream */
    uint32_t error_code;
    bool got_end;    /* END_STREAM received */
    const char *req; /* request body (borrowed) */
    size_t req_len, req_off;
    bool stall;        /* manual window: leave this stream's window closed */
    size_t unconsumed; /* bytes received and not given back to the stream window */
    double t_data;     /* pd_now_s() when the last DATA chunk arrived; 0 before */
    double t_closed;   /* pd_now_s() when the stream closed; 0 before */
} h2c_stream;

typedef struct {
    int fd;
    SSL_CTX *ctx;
    SSL *ssl;
    nghttp2_session *ng;
    h2c_stream *streams[1024];
    int n_streams;
    bool got_settings;
    uint32_t server_max_streams;
    bool goaway;
    uint32_t goaway_code;
    bool eof;
    bool manual; /* no automatic WINDOW_UPDATE: the test decides */
    char alpn[32];
} h2c;

typedef struct {
    const char *name, *value;
} h2c_hdr;

static ssize_t h2c_send_cb(nghttp2_session *ng, const uint8_t *data, size_t len, int flags,
                           void *ud) {
    h2c *c = ud;
    if (c->ssl) {
        int w = SSL_write(c->ssl, data, (int)len);
        return w > 0 ? w : NGHTTP2_ERR_CALLBACK_FAILURE;
    }
    ssize_t w = send(c->fd, data, len, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
        return NGHTTP2_ERR_WOULDBLOCK;
    return w > 0 ? w : NGHTTP2_ERR_CALLBACK_FAILURE;
}

static int h2c_frame_recv_cb(nghttp2_session *ng, const nghttp2_frame *f, void *ud) {
    h2c *c = ud;
    if (f->hd.type == NGHTTP2_SETTINGS && !(f->hd.flags & NGHTTP2_FLAG_ACK)) {
        c->got_settings = true;
        c->server_max_streams =
            nghttp2_session_get_remote_settings(ng, NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS);
    } else if (f->hd.type == NGHTTP2_GOAWAY) {
        c->goaway = true;
        c->goaway_code = f->goaway.error_code;
    } else if ((f->hd.type == NGHTTP2_HEADERS || f->hd.type == NGHTTP2_DATA) &&
               (f->hd.flags & NGHTTP2_FLAG_END_STREAM)) {
        h2c_stream *s = nghttp2_session_get_stream_user_data(ng, f->hd.stream_id);
        if (s)
            s->got_end = true;
    }
    return 0;
}

static int h2c_header_cb(nghttp2_session *ng, const nghttp2_frame *f, const uint8_t *name,
                         size_t nlen, const uint8_t *value, size_t vlen, uint8_t flags, void *ud) {
    h2c_stream *s = nghttp2_session_get_stream_user_data(ng, f->hd.stream_id);
    if (!s)
        return 0;
    if (nlen == 7 && memcmp(name, ":status", 7) == 0) {
        s->status = atoi((const char *)value);
        return 0;
    }
    s->hdrs = realloc(s->hdrs, s->hdrs_len + nlen + vlen + 4);
    memcpy(s->hdrs + s->hdrs_len, name, nlen);
    s->hdrs_len += nlen;
    memcpy(s->hdrs + s->hdrs_len, ": ", 2);
    s->hdrs_len += 2;
    memcpy(s->hdrs + s->hdrs_len, value, vlen);
    s->hdrs_len += vlen;
    s->hdrs[s->hdrs_len++] = '\n';
    s->hdrs[s->hdrs_len] = 0;
    return 0;
}

static int h2c_data_cb(nghttp2_session *ng, uint8_t flags, int32_t id, const uint8_t *data,
                       size_t len, void *ud) {
    h2c *c = ud;
    h2c_stream *s = nghttp2_session_get_stream_user_data(ng, id);
    if (s) {
        if (s->len + len + 1 > s->cap) {
            s->cap = 2 * (s->len + len + 1);
            s->body = realloc(s->body, s->cap);
        }
        memcpy(s->body + s->len, data, len);
        s->len += len;
        s->body[s->len] = 0;
        s->t_data = pd_now_s();
    }
    if (c->manual) {
        if (s && s->stall) {
            nghttp2_session_consume_connection(ng, len); /* the others go on */
            s->unconsumed += len;
        } else {
            nghttp2_session_consume(ng, id, len);
        }
    }
    return 0;
}

static int h2c_close_cb(nghttp2_session *ng, int32_t id, uint32_t code, void *ud) {
    h2c_stream *s = nghttp2_session_get_stream_user_data(ng, id);
    if (s) {
        s->closed = true;
        s->error_code = code;
        s->t_closed = pd_now_s();
    }
    return 0;
}

static ssize_t h2c_body_read_cb(nghttp2_session *ng, int32_t id, uint8_t *buf, size_t length,
                                uint32_t *flags, nghttp2_data_source *src, void *ud) {
    h2c_stream *s = src->ptr;
    size_t n = s->req_len - s->req_off;
    if (n > length)
        n = length;
    memcpy(buf, s->req + s->req_off, n);
    s->req_off += n;
    if (s->req_off == s->req_len)
        *flags |= NGHTTP2_DATA_FLAG_EOF;
    return (ssize_t)n;
}

static h2c *h2c_new_session(int fd, bool manual) {
    h2c *c = calloc(1, sizeof *c);
    c->fd = fd;
    c->manual = manual;
    nghttp2_session_callbacks *cbs;
    nghttp2_session_callbacks_new(&cbs);
    nghttp2_session_callbacks_set_send_callback(cbs, h2c_send_cb);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, h2c_frame_recv_cb);
    nghttp2_session_callbacks_set_on_header_callback(cbs, h2c_header_cb);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, h2c_data_cb);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs, h2c_close_cb);
    nghttp2_option *opt;
    nghttp2_option_new(&opt);
    if (manual)
        nghttp2_option_set_no_auto_window_update(opt, 1);
    nghttp2_session_client_new2(&c->ng, cbs, c, opt);
    nghttp2_option_del(opt);
    nghttp2_session_callbacks_del(cbs);
    return c;
}

static int h2c_tcp(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(0x7f000001);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

static void h2c_settings(h2c *c) {
    nghttp2_settings_entry iv[] = {{NGHTTP2_SETTINGS_ENABLE_PUSH, 0}};
    nghttp2_submit_settings(c->ng, NGHTTP2_FLAG_NONE, iv, 1);
}

/** Cleartext (prior knowledge), or TLS offering alpn (wire format, e.g.
 * "\x02h2"; NULL: no ALPN) when tls. NULL when the connection or the
 * handshake failed. The negotiated protocol is in c->alpn. */
static h2c *h2c_connect(int port, bool tls, const char *alpn, bool manual_window) {
    int fd = h2c_tcp(port);
    if (fd < 0)
        return NULL;
    h2c *c = h2c_new_session(fd, manual_window);
    if (tls) {
        c->ctx = SSL_CTX_new(TLS_client_method());
        SSL_CTX_set_verify(c->ctx, SSL_VERIFY_NONE, NULL);
        c->ssl = SSL_new(c->ctx);
        if (alpn)
            SSL_set_alpn_protos(c->ssl, (const unsigned char *)alpn, (unsigned)strlen(alpn));
        SSL_set_fd(c->ssl, fd);
        if (SSL_connect(c->ssl) != 1) {
            ERR_print_errors_fp(stderr);
            SSL_free(c->ssl);
            SSL_CTX_free(c->ctx);
            nghttp2_session_del(c->ng);
            close(fd);
            free(c);
            return NULL;
        }
        const unsigned char *p = NULL;
        unsigned n = 0;
        SSL_get0_alpn_selected(c->ssl, &p, &n);
        snprintf(c->alpn, sizeof c->alpn, "%.*s", (int)n, p ? (const char *)p : "");
    }
    h2c_settings(c);
    return c;
}

static h2c_stream *h2c_stream_new(h2c *c, const char *body, size_t len) {
    h2c_stream *s = calloc(1, sizeof *s);
    s->req = body;
    s->req_len = len;
    s->body = calloc(1, 1);
    s->cap = 1;
    c->streams[c->n_streams++] = s;
    return s;
}

/** Opens a stream: method path with headers (content-type application/json
 * added for bodies) and body (borrowed until sent; NULL: none). */
static h2c_stream *h2c_request(h2c *c, const char *method, const char *path, const h2c_hdr *hdrs,
                               int n_hdrs, const char *body, size_t len) {
    h2c_stream *s = h2c_stream_new(c, body, len);
    nghttp2_nv nv[40];
    int n = 0;
#define NV(a, b) nv[n++] = (nghttp2_nv){(uint8_t *)(a), (uint8_t *)(b), strlen(a), strlen(b), 0}
    NV(":method", method);
    NV(":scheme", c->ssl ? "https" : "http");
    NV(":authority", "127.0.0.1");
    NV(":path", path);
    bool ctype = false;
    for (int i = 0; i < n_hdrs && n < 39; i++) {
        NV(hdrs[i].name, hdrs[i].value);
        if (strcasecmp(hdrs[i].name, "content-type") == 0)
            ctype = true;
    }
    if (body && !ctype)
        NV("content-type", "application/json");
#undef NV
    nghttp2_data_provider prd = {.source.ptr = s, .read_callback = h2c_body_read_cb};
    s->id = nghttp2_submit_request(c->ng, NULL, nv, (size_t)n, body ? &prd : NULL, s);
    assert_true(s->id > 0);
    return s;
}

static ssize_t h2c_never_read_cb(nghttp2_session *ng, int32_t id, uint8_t *buf, size_t length,
                                 uint32_t *flags, nghttp2_data_source *src, void *ud) {
    return NGHTTP2_ERR_DEFERRED; /* the body never comes */
}

/** Opens a stream whose HEADERS go out without END_STREAM and whose body
 * never comes (a stalled upload). */
static h2c_stream *h2c_request_hanging(h2c *c, const char *method, const char *path) {
    h2c_stream *s = h2c_stream_new(c, NULL, 0);
    nghttp2_nv nv[] = {
        {(uint8_t *)":method", (uint8_t *)method, 7, strlen(method), 0},
        {(uint8_t *)":scheme", (uint8_t *)"http", 7, 4, 0},
        {(uint8_t *)":authority", (uint8_t *)"127.0.0.1", 10, 9, 0},
        {(uint8_t *)":path", (uint8_t *)path, 5, strlen(path), 0},
        {(uint8_t *)"content-type", (uint8_t *)"application/json", 12, 16, 0},
    };
    nghttp2_data_provider prd = {.source.ptr = s, .read_callback = h2c_never_read_cb};
    s->id = nghttp2_submit_request(c->ng, NULL, nv, sizeof nv / sizeof *nv, &prd, s);
    assert_true(s->id > 0);
    return s;
}

/** HTTP/1.1 `method path` with Upgrade: h2c (body: a POST body or NULL).
 * On a 101 the connection continues as h2 and *s1_p is stream 1; on any
 * other answer returns NULL (the status in *status_p). */
static h2c *h2c_upgrade(int port, const char *method, const char *path, const char *body,
                        h2c_stream **s1_p, int *status_p) {
    int fd = h2c_tcp(port);
    if (fd < 0)
        return NULL;
    h2c *c = h2c_new_session(fd, false);
    nghttp2_settings_entry iv[] = {{NGHTTP2_SETTINGS_ENABLE_PUSH, 0},
                                   {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20}};
    uint8_t payload[64];
    ssize_t plen = nghttp2_pack_settings_payload(payload, sizeof payload, iv, 2);
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    char enc[128];
    size_t e = 0;
    for (ssize_t i = 0; i < plen; i += 3) {
        uint32_t v = (uint32_t)payload[i] << 16;
        if (i + 1 < plen)
            v |= (uint32_t)payload[i + 1] << 8;
        if (i + 2 < plen)
            v |= payload[i + 2];
        int nchar = i + 2 < plen ? 4 : i + 1 < plen ? 3 : 2;
        for (int k = 0; k < nchar; k++)
            enc[e++] = b64[(v >> (18 - 6 * k)) & 63];
    }
    enc[e] = 0;
    char clen[96] = "";
    if (body)
        snprintf(clen, sizeof clen, "Content-Type: application/json\r\nContent-Length: %zu\r\n",
                 strlen(body));
    char *req = NULL;
    if (asprintf(&req,
                 "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                 "Upgrade: h2c\r\nHTTP2-Settings: %s\r\n%s\r\n%s",
                 method, path, enc, clen, body ? body : "") < 0)
        abort();
    send(fd, req, strlen(req), MSG_NOSIGNAL);
    free(req);
    /* the response head, byte by byte up to the blank line */
    char head[4096];
    size_t hl = 0;
    while (hl + 1 < sizeof head) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (poll(&pfd, 1, 5000) <= 0 || recv(fd, head + hl, 1, 0) != 1)
            break;
        hl++;
        if (hl >= 4 && memcmp(head + hl - 4, "\r\n\r\n", 4) == 0)
            break;
    }
    head[hl] = 0;
    int status = 0;
    sscanf(head, "HTTP/1.1 %d", &status);
    if (status_p)
        *status_p = status;
    if (status != 101) {
        nghttp2_session_del(c->ng);
        close(fd);
        free(c);
        return NULL;
    }
    h2c_stream *s1 = h2c_stream_new(c, NULL, 0);
    s1->id = 1;
    int rv =
        nghttp2_session_upgrade2(c->ng, payload, (size_t)plen, strcmp(method, "HEAD") == 0, s1);
    assert_int_equal(rv, 0);
    h2c_settings(c);
    *s1_p = s1;
    return c;
}

static bool h2c_all_closed(h2c *c, void *ud) {
    for (int i = 0; i < c->n_streams; i++)
        if (!c->streams[i]->closed)
            return false;
    return true;
}

/** Drives the session until done(c, ud) holds (0), or timeout, EOF or a
 * session error (-1). done NULL: until every stream closed. */
static int h2c_run(h2c *c, bool (*done)(h2c *, void *), void *ud, double timeout_s) {
    if (!done)
        done = h2c_all_closed;
    double t_end = pd_now_s() + timeout_s;
    for (;;) {
        if (nghttp2_session_send(c->ng) != 0)
            return -1;
        if (done(c, ud))
            return 0;
        if (c->eof || pd_now_s() > t_end)
            return -1;
        if (!nghttp2_session_want_read(c->ng) && !nghttp2_session_want_write(c->ng))
            return done(c, ud) ? 0 : -1;
        if (!(c->ssl && SSL_pending(c->ssl) > 0)) {
            struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
            if (poll(&pfd, 1, 20) <= 0)
                continue;
        }
        uint8_t buf[65536];
        ssize_t r = c->ssl ? SSL_read(c->ssl, buf, sizeof buf) : recv(c->fd, buf, sizeof buf, 0);
        if (r <= 0) {
            if (r < 0 && !c->ssl && errno == EINTR)
                continue;
            c->eof = true;
            continue;
        }
        if (nghttp2_session_mem_recv(c->ng, buf, (size_t)r) < 0)
            return -1;
    }
}

/** Resets stream s (RST_STREAM with code) and sends it at once. */
static void h2c_rst(h2c *c, h2c_stream *s, uint32_t code) {
    nghttp2_submit_rst_stream(c->ng, NGHTTP2_FLAG_NONE, s->id, code);
    nghttp2_session_send(c->ng);
}

/** The value of the first response header name (lower case), or NULL. */
static const char *h2c_header(const h2c_stream *s, const char *name, char *buf, size_t n) {
    size_t nl = strlen(name);
    for (const char *p = s->hdrs; p && *p;) {
        const char *e = strchr(p, '\n');
        if (!e)
            break;
        if ((size_t)(e - p) > nl + 1 && strncmp(p, name, nl) == 0 && p[nl] == ':') {
            snprintf(buf, n, "%.*s", (int)(e - p - nl - 2), p + nl + 2);
            return buf;
        }
        p = e + 1;
    }
    return NULL;
}

static void h2c_free(h2c *c) {
    if (!c)
        return;
    for (int i = 0; i < c->n_streams; i++) {
        free(c->streams[i]->hdrs);
        free(c->streams[i]->body);
        free(c->streams[i]);
    }
    nghttp2_session_del(c->ng);
    if (c->ssl) {
        SSL_shutdown(c->ssl);
        SSL_free(c->ssl);
    }
    if (c->ctx)
        SSL_CTX_free(c->ctx);
    close(c->fd);
    free(c);
}

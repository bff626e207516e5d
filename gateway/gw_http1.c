/* The HTTP/1.1 protocol handler (RFC 9112) over libhttp-parser.
 *
 * One exchange at a time per connection: the parser runs until a request is
 * complete, then pauses (http_parser_pause) and the stream is dispatched;
 * bytes of pipelined requests stay in the connection's input buffer (reading
 * stops once it holds GW_INPUT_HIGH_WATER) and are parsed after the response
 * ended, so responses leave in request order. Reading continues while a
 * request is served so that a client that goes away is noticed (EOF) and its
 * request aborted.
 *
 * Request bodies: Content-Length or chunked (de-chunked by the parser; the
 * CRLF that closes each chunk's data is checked here: 400 otherwise, see
 * h1_conn.chunk_crlf), at most cfg.max_request_body_bytes (413, decided
 * from Content-Length before the body is read, from a chunk's declared size
 * before its data, else when the limit is crossed). A Transfer-Encoding
 * other than chunked alone gets 501 (RFC 9112 §6.1). "Expect: 100-continue"
 * is answered with 100, or, when the request will be refused whatever its
 * body (404, 405, 413 from Content-Length, 415: gw_server_check_route), with
 * the refusal, and the connection closes. The request line and headers together are limited to
 * cfg.max_header_bytes and cfg.max_header_count (431). Timers (one per
 * connection, gw_conn_set_timer): keep-alive idle (closed silently), the
 * request line and headers not whole cfg.timeout_request_headers_s after the
 * request's first byte (408), the body not whole cfg.timeout_request_body_s
 * after the headers (408): a client that trickles bytes (slowloris) holds a
 * connection for at most their sum. Error messages name the flag and the
 * limit. An error answered before the request was read whole closes the
 * connection in stages (gw_conn_close_linger; not after a 408). An
 * HTTP/1.1 request without a Host header field, or any with more than one, is
 * refused with 400 (RFC 9112 §3.2; HTTP/1.0 may omit it).
 *
 * Responses: Content-Length, or chunked transfer encoding for streamed
 * bodies (an HTTP/1.0 client gets the body unframed and the connection
 * closes at the end). A streamed response whose client stops reading is
 * held up to GW_H1_MAX_OUTPUT times output_high_water_bytes; beyond it the
 * connection is dropped and the request aborted (as HTTP/2 resets the
 * stream), so a stalled reader costs bounded memory.
 *
 * `Upgrade: h2c` (RFC 7540 §3.2, as curl --http2 sends it) on a cleartext
 * HTTP/1.1 request with exactly one valid HTTP2-Settings header: once the
 * request (body included) has arrived, the connection goes to the h2
 * handler (gw_h2_upgrade: 101 Switching Protocols, the request becomes
 * stream 1). Any other Upgrade (websocket, h2c under TLS, bad settings) is
 * ignored and the request served here, as RFC 9110 §7.8 allows.
 */
#include <http_parser.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "gw_internal.h"

/* Unsent output a streamed response may reach, in output_high_water_bytes. */
#define GW_H1_MAX_OUTPUT 16

typedef struct {
    char *p;
    size_t len, cap;
} h1_buf;

typedef struct {
    gw_conn *c;
    http_parser parser;
    gw_stream *cur;    /* being received, or dispatched and not yet ended */
    bool cur_complete; /* cur was received whole and dispatched */
    bool processing;   /* inside h1_process (no re-entry) */
    bool keep_alive;   /* of cur */
    bool chunked;      /* cur's streamed response is chunked */
    bool overflow;     /* the client stopped reading a streamed response: drop it */
    h1_buf url, hname, hval;
    bool in_value;
    bool in_body; /* cur's headers arrived: its timer is the body's */
    bool headers_done; /* cur's headers were parsed whole (refused or not) */
    int err_status; /* set by a parser callback that refuses the request */
    const char *err_msg;
    const char *err_allow; /* a 405 refusal's Allow value (static), else NULL */
    char err_buf[256];     /* err_msg when it carries a number */
    /* http-parser as Debian builds it (without HTTP_PARSER_STRICT) takes any
     * two bytes after a chunk's data for its CRLF: a chunk longer than its
     * size would be read as the next chunk's size (request smuggling behind
     * a proxy that frames it right). on_body checks them where the segment
     * given to the parser holds them; the rest are checked at the start of
     * the next segment. */
    const char *seg_end;   /* the end of the segment being parsed */
    int chunk_crlf;        /* 2: CR and LF still to check there, 1: LF */
} h1_conn;

static int buf_add(h1_buf *b, const char *at, size_t len) {
    if (b->len + len + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->len + len + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p)
            return -1;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, at, len);
    b->len += len;
    b->p[b->len] = 0;
    return 0;
}

static h1_conn *h1_of(const http_parser *p) {
    return p->data;
}

static int h1_refuse(h1_conn *h, int status, const char *msg) {
    h->err_status = status;
    h->err_msg = msg;
    return -1;
}

/* h1_refuse with a message formatted into h->err_buf. */
static int h1_refusef(h1_conn *h, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int h1_refusef(h1_conn *h, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(h->err_buf, sizeof h->err_buf, fmt, ap);
    va_end(ap);
    return h1_refuse(h, status, h->err_buf);
}

/* Counts request-line and header bytes against the limit. */
static int h1_count_header_bytes(h1_conn *h, size_t len) {
    gw_stream *s = h->cur;
    s->hdr_bytes += len;
    if (s->hdr_bytes > h->c->srv->cfg.max_header_bytes)
        return h1_refusef(h, 431, "request line and headers exceed --max-header-bytes (%zu bytes)",
                          h->c->srv->cfg.max_header_bytes);
    return 0;
}

static int h1_commit_header(h1_conn *h) {
    if (!h->in_value)
        return 0;
    h->in_value = false;
    if (h->cur->n_hdrs >= h->c->srv->cfg.max_header_count)
        return h1_refusef(h, 431, "more than --max-header-count (%d) request header fields",
                          h->c->srv->cfg.max_header_count);
    /* Trailing whitespace of a field value is not part of it (RFC 9110 §5.5). */
    while (h->hval.len && (h->hval.p[h->hval.len - 1] == ' ' || h->hval.p[h->hval.len - 1] == '\t'))
        h->hval.len--;
    if (gw_stream_add_header(h->cur, h->hname.p ? h->hname.p : "", h->hname.len,
                             h->hval.p ? h->hval.p : "", h->hval.len) != PD_OK)
        return h1_refuse(h, 500, "out of memory");
    h->hname.len = h->hval.len = 0;
    return 0;
}

static int on_message_begin(http_parser *p) {
    h1_conn *h = h1_of(p);
    h->cur = gw_stream_new(h->c);
    if (!h->cur)
        return h1_refuse(h, 500, "out of memory");
    h->url.len = h->hname.len = h->hval.len = 0;
    h->in_value = false;
    h->in_body = false;
    h->headers_done = false;
    h->chunk_crlf = 0;
    gw_conn_set_timer(h->c, h->c->srv->cfg.timeout_request_headers_s);
    return 0;
}

static int on_url(http_parser *p, const char *at, size_t len) {
    h1_conn *h = h1_of(p);
    if (h1_count_header_bytes(h, len))
        return -1;
    return buf_add(&h->url, at, len) ? h1_refuse(h, 500, "out of memory") : 0;
}

static int on_header_field(http_parser *p, const char *at, size_t len) {
    h1_conn *h = h1_of(p);
    if (h1_count_header_bytes(h, len))
        return -1;
    if (h1_commit_header(h))
        return -1;
    return buf_add(&h->hname, at, len) ? h1_refuse(h, 500, "out of memory") : 0;
}

static int on_header_value(http_parser *p, const char *at, size_t len) {
    h1_conn *h = h1_of(p);
    if (h1_count_header_bytes(h, len))
        return -1;
    if (!h->in_value) {
        h->in_value = true;
        h->hval.len = 0;
        while (len && (*at == ' ' || *at == '\t'))
            at++, len--;
    }
    return buf_add(&h->hval, at, len) ? h1_refuse(h, 500, "out of memory") : 0;
}

/* Splits the request target into path and query. */
static int h1_set_target(gw_stream *s, const char *t, size_t len) {
    const char *path = t;
    size_t plen = len;
    const char *query = NULL;
    size_t qlen = 0;
    if (len == 0 || t[0] != '/') {
        /* absolute-form (RFC 9112 §3.2.2) or "*" */
        struct http_parser_url u;
        http_parser_url_init(&u);
        if (len == 1 && t[0] == '*') {
            /* OPTIONS *: keep as is */
        } else if (http_parser_parse_url(t, len, 0, &u) == 0 && (u.field_set & (1 << UF_PATH))) {
            path = t + u.field_data[UF_PATH].off;
            plen = u.field_data[UF_PATH].len;
        } else {
            return -1;
        }
        if (u.field_set & (1 << UF_QUERY)) {
            query = t + u.field_data[UF_QUERY].off;
            qlen = u.field_data[UF_QUERY].len;
        }
    } else {
        const char *q = memchr(t, '?', len);
        if (q) {
            plen = (size_t)(q - t);
            query = q + 1;
            qlen = len - plen - 1;
        }
        const char *hash = memchr(path, '#', plen);
        if (hash)
            plen = (size_t)(hash - path);
    }
    s->path = strndup(path, plen);
    s->query = query ? strndup(query, qlen) : NULL;
    return s->path ? 0 : -1;
}

static int on_headers_complete(http_parser *p) {
    h1_conn *h = h1_of(p);
    gw_stream *s = h->cur;
    const pd_gw_config *cfg = &h->c->srv->cfg;
    if (h1_commit_header(h))
        return -1;
    s->method = strdup(http_method_str((enum http_method)p->method));
    if (!s->method)
        return h1_refuse(h, 500, "out of memory");
    if (h1_set_target(s, h->url.p ? h->url.p : "", h->url.len))
        return h1_refuse(h, 400, "malformed request target");
    s->http_major = p->http_major;
    s->http_minor = p->http_minor;
    s->head = p->method == HTTP_HEAD;
    h->keep_alive = http_should_keep_alive(p);
    h->headers_done = true;
    if (p->http_major != 1)
        return h1_refuse(h, 505, "only HTTP/1.0 and HTTP/1.1 are served here");
    /* RFC 9112 §3.2: 400 for an HTTP/1.1 request without Host and for any
     * request with more than one (an empty value is valid: a target
     * without an authority). */
    const int n_host = gw_stream_header_count(s, "Host");
    if (n_host > 1)
        return h1_refuse(h, 400, "more than one Host header field (RFC 9112 section 3.2)");
    if (n_host == 0 && p->http_minor >= 1)
        return h1_refuse(
            h, 400, "an HTTP/1.1 request must carry a Host header field (RFC 9112 section 3.2)");
    if (p->method == HTTP_CONNECT)
        return h1_refuse(h, 405, "CONNECT is not supported");
    if (p->content_length != ULLONG_MAX && p->content_length > cfg->max_request_body_bytes)
        return h1_refusef(h, 413, "request body exceeds --max-request-body-bytes (%zu bytes)",
                          h->c->srv->cfg.max_request_body_bytes);
    /* RFC 9112 §6.1: a transfer coding other than chunked alone is not
     * implemented (http-parser would de-chunk "gzip, chunked" and hand on
     * the gzip bytes as the body) */
    const char *te = gw_stream_header(s, "Transfer-Encoding");
    if (gw_stream_header_count(s, "Transfer-Encoding") > 1 || (te && strcasecmp(te, "chunked") != 0))
        return h1_refuse(h, 501, "Transfer-Encoding other than chunked is not implemented");
    const char *expect = gw_stream_header(s, "Expect");
    if (expect) {
        if (strcasecmp(expect, "100-continue") != 0)
            return h1_refuse(h, 417, "unsupported Expect header");
        if (p->http_minor >= 1) {
            /* A request that will be refused whatever its body gets the
             * refusal now, not 100 (RFC 9110 §10.1.1): the client need not
             * send a body only to have it thrown away. The connection then
             * closes after discarding what the client sends anyway. */
            gw_route_check rc;
            gw_server_check_route(s, &rc);
            if (rc.status) {
                h->err_allow = rc.allow;
                return h1_refusef(h, rc.status, "%s", rc.message);
            }
            evbuffer_add_printf(gw_conn_output(h->c), "HTTP/1.1 100 Continue\r\n\r\n");
        }
    }
    /* The body's own deadline (a request without one completes right after
     * this callback and disarms the timer at dispatch). */
    h->in_body = true;
    gw_conn_set_timer(h->c, cfg->timeout_request_body_s);
    return 0;
}

#define H1_BAD_CHUNK "malformed chunked body: a chunk's data is not followed by CRLF (RFC 9112 section 7.1)"

/* Checks the bytes [q, end) against the CRLF still expected after a chunk's
 * data (*need: 2 CR and LF, 1 LF); -1 on a mismatch. */
static int h1_check_crlf(int *need, const char *q, const char *end) {
    for (; *need > 0 && q < end; q++, (*need)--)
        if (*q != (*need == 2 ? '\r' : '\n'))
            return -1;
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t len) {
    h1_conn *h = h1_of(p);
    if (evbuffer_get_length(h->cur->body) + len > h->c->srv->cfg.max_request_body_bytes)
        return h1_refusef(h, 413, "request body exceeds --max-request-body-bytes (%zu bytes)",
                          h->c->srv->cfg.max_request_body_bytes);
    if (evbuffer_add(h->cur->body, at, len))
        return h1_refuse(h, 500, "out of memory");
    if ((p->flags & F_CHUNKED) && p->content_length == 0) { /* the end of a chunk's data */
        h->chunk_crlf = 2;
        if (h1_check_crlf(&h->chunk_crlf, at + len, h->seg_end))
            return h1_refuse(h, 400, H1_BAD_CHUNK);
    }
    return 0;
}

/* A chunk's declared size already over the body limit: 413 before its data. */
static int on_chunk_header(http_parser *p) {
    h1_conn *h = h1_of(p);
    const size_t max = h->c->srv->cfg.max_request_body_bytes, have = evbuffer_get_length(h->cur->body);
    if (p->content_length > max - have)
        return h1_refusef(h, 413, "request body exceeds --max-request-body-bytes (%zu bytes)", max);
    return 0;
}

static int on_message_complete(http_parser *p) {
    h1_conn *h = h1_of(p);
    h->cur_complete = true;
    http_parser_pause(p, 1);
    return 0;
}

static const http_parser_settings h1_settings = {
    .on_message_begin = on_message_begin,
    .on_url = on_url,
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_headers_complete = on_headers_complete,
    .on_body = on_body,
    .on_chunk_header = on_chunk_header,
    .on_message_complete = on_message_complete,
};

/* ---- response framing ------------------------------------------------ */

static void h1_date(char *buf, size_t n) {
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(buf, n, "%a, %d %b %Y %H:%M:%S GMT", &tm);
}

/* Writes the status line and headers. content_length < 0: streamed body. */
static void h1_write_head(h1_conn *h, gw_stream *s, int status, const char *ctype,
                          const gw_hdr *hdrs, int n_hdrs, long long content_length) {
    struct evbuffer *out = gw_conn_output(h->c);
    char date[64];
    h1_date(date, sizeof date);
    evbuffer_add_printf(out, "HTTP/1.1 %d %s\r\nDate: %s\r\nServer: pdserve\r\n", status,
                        gw_status_reason(status), date);
    if (ctype)
        evbuffer_add_printf(out, "Content-Type: %s\r\n", ctype);
    for (int i = 0; i < n_hdrs; i++)
        evbuffer_add_printf(out, "%s: %s\r\n", hdrs[i].name, hdrs[i].value);
    h->chunked = false;
    if (content_length >= 0) {
        evbuffer_add_printf(out, "Content-Length: %lld\r\n", content_length);
    } else if (s && s->http_minor >= 1) {
        evbuffer_add_printf(out, "Transfer-Encoding: chunked\r\n");
        h->chunked = true;
    } else {
        h->keep_alive = false; /* HTTP/1.0: the end of the body is the end of the connection */
    }
    if (!h->keep_alive)
        evbuffer_add_printf(out, "Connection: close\r\n");
    else if (s && s->http_minor == 0)
        evbuffer_add_printf(out, "Connection: keep-alive\r\n");
    evbuffer_add(out, "\r\n", 2);
}

/* The current exchange is over: free it, then close or wait for the next. */
static void h1_stream_done(h1_conn *h) {
    gw_conn *c = h->c;
    gw_stream *s = h->cur;
    s->state = GW_STREAM_ENDED;
    h->cur = NULL;
    h->cur_complete = false;
    gw_stream_free(s);
    gw_conn_flushed(c);
    if (!h->keep_alive) {
        gw_conn_close(c);
        return;
    }
    gw_conn_set_timer(c, c->srv->cfg.timeout_keep_alive_s);
    if (!h->processing)
        gw_conn_defer(c); /* pipelined input may be waiting */
}

static int h1_respond(gw_stream *s, int status, const char *ctype, const gw_hdr *hdrs, int n_hdrs,
                      const void *body, size_t len) {
    h1_conn *h = s->conn->proto_data;
    if (h->cur != s)
        return -1;
    h1_write_head(h, s, status, ctype, hdrs, n_hdrs, (long long)len);
    if (!s->head && len)
        evbuffer_add(gw_conn_output(s->conn), body, len);
    h1_stream_done(h);
    return 0;
}

static int h1_start(gw_stream *s, int status, const char *ctype, const gw_hdr *hdrs, int n_hdrs) {
    h1_conn *h = s->conn->proto_data;
    if (h->cur != s)
        return -1;
    h1_write_head(h, s, status, ctype, hdrs, n_hdrs, -1);
    s->state = GW_STREAM_STARTED;
    gw_conn_flushed(s->conn);
    return 0;
}

static int h1_write(gw_stream *s, const void *data, size_t len) {
    h1_conn *h = s->conn->proto_data;
    if (h->cur != s)
        return -1;
    if (s->head)
        return 0;
    if (h->overflow)
        return -1;
    struct evbuffer *out = gw_conn_output(s->conn);
    if (evbuffer_get_length(out) + len >
        GW_H1_MAX_OUTPUT * s->conn->srv->cfg.output_high_water_bytes) {
        PD_LOGW(GW_MOD, "conn %llu (%s): the client reads too slowly (%zu bytes unsent); closing",
                (unsigned long long)s->conn->id, s->conn->peer, evbuffer_get_length(out));
        h->overflow = true;
        gw_conn_defer(s->conn); /* freed from the loop: the caller still holds s */
        return -1;
    }
    if (h->chunked)
        evbuffer_add_printf(out, "%zx\r\n", len);
    evbuffer_add(out, data, len);
    if (h->chunked)
        evbuffer_add(out, "\r\n", 2);
    gw_conn_flushed(s->conn);
    return 0;
}

static int h1_end(gw_stream *s) {
    h1_conn *h = s->conn->proto_data;
    if (h->cur != s)
        return -1;
    if (h->chunked && !s->head)
        evbuffer_add(gw_conn_output(s->conn), "0\r\n\r\n", 5);
    h1_stream_done(h);
    return 0;
}

/* A request that cannot be parsed or is refused before dispatch: answer
 * and close (the rest of the input cannot be trusted to frame requests). */
static void h1_fail(h1_conn *h, int status, const char *msg) {
    gw_conn *c = h->c;
    gw_stream *s = h->cur;
    h->cur = NULL;
    h->cur_complete = false;
    gw_stream_free(s); /* never dispatched: no close callback */
    h->keep_alive = false;
    char *body = gw_error_json(status, msg, NULL);
    gw_hdr allow = {"Allow", h->err_allow};
    h1_write_head(h, NULL, status, "application/json", &allow, h->err_allow ? 1 : 0,
                  (long long)strlen(body));
    evbuffer_add(gw_conn_output(c), body, strlen(body));
    free(body);
    /* The client may still be sending (a body refused from its
     * Content-Length, headers cut at the limit): read the rest away before
     * closing. Not after a 408: that client is slow, not in mid-upload, and
     * lingering would only lengthen a slowloris' hold (nginx closes at once
     * too). http_parser counts content_length down as the body arrives,
     * so after the headers it is what remains of a declared body. */
    if (status == 408) {
        gw_conn_close(c);
        return;
    }
    uint64_t rest = UINT64_MAX;
    if (h->headers_done && !(h->parser.flags & F_CHUNKED) && h->parser.content_length != ULLONG_MAX)
        rest = h->parser.content_length;
    gw_conn_close_linger(c, rest);
}

/* True when the comma-separated list holds token (case-insensitive). */
static bool has_token(const char *list, const char *token) {
    size_t tl = strlen(token);
    const char *p = list;
    while (*p) {
        while (*p == ' ' || *p == '\t' || *p == ',')
            p++;
        const char *b = p;
        while (*p && *p != ',')
            p++;
        const char *e = p;
        while (e > b && (e[-1] == ' ' || e[-1] == '\t'))
            e--;
        if ((size_t)(e - b) == tl && strncasecmp(b, token, tl) == 0)
            return true;
    }
    return false;
}

/* base64url without padding (RFC 4648 §5; '=' tolerated), as the
 * HTTP2-Settings header carries the SETTINGS payload. Heap result. */
static int base64url_decode(const char *in, uint8_t **out_p, size_t *len_p) {
    size_t n = strlen(in);
    while (n && in[n - 1] == '=')
        n--;
    uint8_t *out = malloc(n * 3 / 4 + 3);
    if (!out)
        return -1;
    uint32_t acc = 0;
    int bits = 0;
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)in[i];
        int v = ch >= 'A' && ch <= 'Z'   ? ch - 'A'
                : ch >= 'a' && ch <= 'z' ? ch - 'a' + 26
                : ch >= '0' && ch <= '9' ? ch - '0' + 52
                : ch == '-'              ? 62
                : ch == '_'              ? 63
                                         : -1;
        if (v < 0) {
            free(out);
            return -1;
        }
        acc = (acc << 6) | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[len++] = (uint8_t)(acc >> bits);
        }
    }
    if (n % 4 == 1) { /* 6 bits cannot end a byte string */
        free(out);
        return -1;
    }
    *out_p = out;
    *len_p = len;
    return 0;
}

static void h1_state_free(h1_conn *h) {
    free(h->url.p);
    free(h->hname.p);
    free(h->hval.p);
    free(h);
}

/* The complete request h->cur asked for an upgrade: switch to h2c when it
 * is one we take. Returns true when the connection now belongs to the h2
 * handler (h was freed). */
static bool h1_try_h2c(h1_conn *h) {
    gw_conn *c = h->c;
    gw_stream *s = h->cur;
    const char *up = gw_stream_header(s, "Upgrade");
    if (c->tls || s->http_major != 1 || s->http_minor != 1 || !up || !has_token(up, "h2c"))
        return false;
    const char *settings = NULL;
    int n_settings = 0;
    for (int i = 0; i < s->n_hdrs; i++)
        if (strcasecmp(s->hdrs[i].name, "HTTP2-Settings") == 0) {
            settings = s->hdrs[i].value;
            n_settings++;
        }
    uint8_t *payload = NULL;
    size_t len = 0;
    if (n_settings != 1 || base64url_decode(settings, &payload, &len) != 0)
        return false;
    pd_status rc = gw_h2_upgrade(c, s, payload, len);
    free(payload);
    if (rc != PD_OK)
        return false;
    h1_state_free(h); /* c->proto_data is the h2 handler's now */
    return true;
}

/* Hands the complete request to the application. Returns true when the
 * connection switched to h2 (h was freed). */
static bool h1_dispatch(h1_conn *h) {
    gw_stream *s = h->cur;
    gw_conn_set_timer(h->c, 0); /* no read deadline while the application works */
    if (h->parser.upgrade) {
        h->parser.upgrade = 0;
        if (h1_try_h2c(h))
            return true;
    }
    s->state = GW_STREAM_DISPATCHED;
    gw_server_dispatch(s);
    return false;
}

/* Parses buffered input until a request is complete and dispatched (and
 * not yet answered), the input runs dry, or the connection closes. */
static void h1_process(gw_conn *c) {
    h1_conn *h = c->proto_data;
    if (h->overflow) {
        gw_conn_free(c); /* aborts the request through the stream's close callback */
        return;
    }
    if (h->processing)
        return;
    h->processing = true;
    struct evbuffer *in = bufferevent_get_input(c->bev);
    while (!c->closing && !h->cur_complete && evbuffer_get_length(in) > 0) {
        struct evbuffer_iovec v;
        if (evbuffer_peek(in, -1, NULL, &v, 1) < 1)
            break;
        if (h->chunk_crlf && h1_check_crlf(&h->chunk_crlf, v.iov_base, (const char *)v.iov_base + v.iov_len)) {
            h1_fail(h, 400, H1_BAD_CHUNK);
            break;
        }
        h->seg_end = (const char *)v.iov_base + v.iov_len;
        size_t n = http_parser_execute(&h->parser, &h1_settings, v.iov_base, v.iov_len);
        enum http_errno e = HTTP_PARSER_ERRNO(&h->parser);
        evbuffer_drain(in, n);
        if (e == HPE_PAUSED) {
            http_parser_pause(&h->parser, 0);
            if (h1_dispatch(h))
                return; /* now h2: h is gone */
            continue;
        }
        if (e != HPE_OK) {
            int status = h->err_status ? h->err_status : 400;
            const char *msg = h->err_msg;
            char buf[160];
            if (!h->err_status) {
                if (e == HPE_HEADER_OVERFLOW)
                    status = 431;
                snprintf(buf, sizeof buf, "malformed HTTP request: %s", http_errno_description(e));
                msg = buf;
            }
            h1_fail(h, status, msg);
            break;
        }
    }
    h->processing = false;
}

static pd_status h1_init(gw_conn *c) {
    h1_conn *h = calloc(1, sizeof *h);
    if (!h)
        return PD_ERR_NOMEM;
    h->c = c;
    http_parser_init(&h->parser, HTTP_REQUEST);
    h->parser.data = h;
    c->proto_data = h;
    return PD_OK;
}

static void h1_on_timeout(gw_conn *c) {
    h1_conn *h = c->proto_data;
    if (h->cur && !h->cur_complete) {
        char msg[160];
        const pd_gw_config *cfg = &c->srv->cfg;
        if (h->in_body)
            snprintf(msg, sizeof msg,
                     "the request body did not arrive within --timeout-request-body (%g s)",
                     cfg->timeout_request_body_s);
        else
            snprintf(msg, sizeof msg,
                     "the request line and headers did not arrive within "
                     "--timeout-request-headers (%g s)",
                     cfg->timeout_request_headers_s);
        h1_fail(h, 408, msg);
        return;
    }
    if (!h->cur)
        gw_conn_close(c); /* idle keep-alive connection */
}

static void h1_on_eof(gw_conn *c) {
    h1_conn *h = c->proto_data;
    if (h->cur && h->cur_complete) {
        gw_conn_free(c); /* a request in flight: the client is gone, abort it */
        return;
    }
    gw_conn_close(c); /* flush responses already written, drop a partial request */
}

static void h1_on_close(gw_conn *c) {
    h1_conn *h = c->proto_data;
    if (!h)
        return;
    gw_stream *s = h->cur;
    h->cur = NULL;
    if (s)
        gw_stream_free(s); /* runs the application's close callback if dispatched */
    h1_state_free(h);
}

const gw_proto_i gw_proto_http1 = {
    .name = "http/1.1",
    .init = h1_init,
    .on_read = h1_process,
    .on_deferred = h1_process,
    .on_timeout = h1_on_timeout,
    .on_eof = h1_on_eof,
    .on_close = h1_on_close,
    .respond = h1_respond,
    .start = h1_start,
    .write = h1_write,
    .end = h1_end,
};

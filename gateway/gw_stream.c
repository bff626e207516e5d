/* The protocol-neutral stream: one request/response exchange. The request
 * fields are filled by a protocol handler; the response calls forward to the
 * connection's handler (HTTP/1.1 framing or HTTP/2 frames). */
#include <string.h>
#include <strings.h>

#include "gw_internal.h"

gw_stream *gw_stream_new(gw_conn *c) {
    gw_stream *s = pd_xcalloc(1, sizeof *s);
    s->conn = c;
    s->body = evbuffer_new();
    if (!s->body) {
        free(s);
        return NULL;
    }
    s->t_start = pd_now_s();
    return s;
}

void gw_stream_free(gw_stream *s) {
    if (!s)
        return;
    if (s->state != GW_STREAM_ENDED && s->on_close) {
        gw_stream_close_fn fn = s->on_close;
        s->on_close = NULL;
        fn(s, s->close_ud);
    }
    for (int i = 0; i < s->n_hdrs; i++) {
        free(s->hdrs[i].name);
        free(s->hdrs[i].value);
    }
    free(s->hdrs);
    free(s->method);
    free(s->path);
    free(s->query);
    if (s->body)
        evbuffer_free(s->body);
    free(s);
}

pd_status gw_stream_add_header(gw_stream *s, const char *name, size_t nlen, const char *value,
                               size_t vlen) {
    if (s->n_hdrs == s->cap_hdrs) {
        int cap = s->cap_hdrs ? 2 * s->cap_hdrs : 16;
        gw_header *h = realloc(s->hdrs, (size_t)cap * sizeof *h);
        if (!h)
            return PD_ERR_NOMEM;
        s->hdrs = h;
        s->cap_hdrs = cap;
    }
    char *n = strndup(name, nlen), *v = strndup(value, vlen);
    if (!n || !v) {
        free(n);
        free(v);
        return PD_ERR_NOMEM;
    }
    s->hdrs[s->n_hdrs].name = n;
    s->hdrs[s->n_hdrs].value = v;
    s->n_hdrs++;
    return PD_OK;
}

const char *gw_stream_header(const gw_stream *s, const char *name) {
    for (int i = 0; i < s->n_hdrs; i++)
        if (strcasecmp(s->hdrs[i].name, name) == 0)
            return s->hdrs[i].value;
    return NULL;
}

int gw_stream_header_count(const gw_stream *s, const char *name) {
    int n = 0;
    for (int i = 0; i < s->n_hdrs; i++)
        n += strcasecmp(s->hdrs[i].name, name) == 0;
    return n;
}

void gw_stream_set_close_cb(gw_stream *s, gw_stream_close_fn fn, void *ud) {
    s->on_close = fn;
    s->close_ud = ud;
}

int gw_stream_respond(gw_stream *s, int status, const char *content_type, const gw_hdr *hdrs,
                      int n_hdrs, const void *body, size_t len) {
    if (!s || s->state != GW_STREAM_DISPATCHED || !s->conn->proto)
        return -1;
    return s->conn->proto->respond(s, status, content_type, hdrs, n_hdrs, body, len);
}

int gw_stream_respond_error(gw_stream *s, int status, const char *message, const char *param,
                            const gw_hdr *hdrs, int n_hdrs) {
    char *body = gw_error_json(status, message, param);
    int rc = gw_stream_respond(s, status, "application/json", hdrs, n_hdrs, body, strlen(body));
    free(body);
    return rc;
}

int gw_stream_start(gw_stream *s, int status, const char *content_type, const gw_hdr *hdrs,
                    int n_hdrs) {
    if (!s || s->state != GW_STREAM_DISPATCHED || !s->conn->proto)
        return -1;
    return s->conn->proto->start(s, status, content_type, hdrs, n_hdrs);
}

int gw_stream_write(gw_stream *s, const void *data, size_t len) {
    if (!s || s->state != GW_STREAM_STARTED)
        return -1;
    if (len == 0)
        return 0;
    return s->conn->proto->write(s, data, len);
}

int gw_stream_end(gw_stream *s) {
    if (!s || s->state != GW_STREAM_STARTED)
        return -1;
    return s->conn->proto->end(s);
}

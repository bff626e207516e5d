/* Connections: the listener, one gw_conn per accepted socket, timers,
 * back-pressure and deferred close, and the choice of protocol handler.
 *
 * A new cleartext connection starts without a protocol. Its first bytes are
 * compared, as they arrive, with the 24-octet HTTP/2 client preface (h2c
 * with prior knowledge, RFC 9113 §3.4): a full match goes to the h2 handler
 * with the preface still in the input (nghttp2 reads it as the client
 * magic); on the first mismatch the connection goes to the HTTP/1.1 handler
 * with the bytes still in its input buffer (which may later switch to h2
 * with `Upgrade: h2c`). nghttpx and h2o do the same. Under TLS the choice
 * comes from ALPN once the handshake finished (BEV_EVENT_CONNECTED, or the
 * first read, whichever the bufferevent reports first); a client without
 * ALPN is sniffed as in cleartext. Everything above the bufferevent is the
 * same for both.
 *
 * Connection limit: at most cfg.max_connections are open; one more is
 * answered at once, without a gw_conn, by a fixed HTTP/1.1 503 with an
 * OpenAI error body and closed (uvicorn's --limit-concurrency answers 503
 * the same way). What the client already sent is read and dropped first, so
 * that the close is a FIN and not a reset that could discard the answer.
 * When accept() itself fails for want of descriptors (EMFILE, ENFILE), the
 * listener pauses for GW_ACCEPT_RETRY_S instead of spinning on the pending
 * connection (libevent re-reports it at once).
 *
 * Lingering close (gw_conn_close_linger): an error answered before the
 * request was read whole (413, 431, ...) is followed by reading and
 * discarding for at most GW_LINGER_S or GW_LINGER_MAX_BYTES, as nginx
 * does, so that a client still uploading reads the answer instead of a
 * reset.
 *
 * Lifetime: a connection is freed only from one of its own event callbacks
 * (EOF, error, timeout, output drained after gw_conn_close, the deferred
 * event) or at server shutdown, so nothing up the stack still holds it.
 */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <event2/bufferevent_ssl.h>
#include <openssl/err.h>

#include "gw_internal.h"

/* Unread input kept per connection before reading pauses (pipelined
 * requests wait in it while the current one is served). */
#define GW_INPUT_HIGH_WATER (256 * 1024)

/* Pause of the listener after accept() ran out of descriptors, seconds. */
#define GW_ACCEPT_RETRY_S 0.1

/* Lingering close: the longest it reads and discards, seconds (nginx's
 * lingering_timeout is 5 s between reads, lingering_time 30 s in all; an
 * error answer needs only the upload in flight to drain), and the most
 * bytes (twice the default --max-request-body-bytes). */
#define GW_LINGER_S         2.0
#define GW_LINGER_MAX_BYTES (64u << 20)

static void conn_update_read(gw_conn *c) {
    if (c->lingering)
        bufferevent_enable(c->bev, EV_READ);
    else if (c->closing || c->bp_paused || c->read_paused)
        bufferevent_disable(c->bev, EV_READ);
    else
        bufferevent_enable(c->bev, EV_READ);
}

struct evbuffer *gw_conn_output(gw_conn *c) {
    return bufferevent_get_output(c->bev);
}

void gw_conn_flushed(gw_conn *c) {
    size_t out = evbuffer_get_length(bufferevent_get_output(c->bev));
    if (!c->bp_paused && out > c->srv->cfg.output_high_water_bytes) {
        c->bp_paused = true;
        conn_update_read(c);
    }
}

void gw_conn_pause_read(gw_conn *c, bool paused) {
    c->read_paused = paused;
    conn_update_read(c);
}

/* The output of a closing connection drained: free it, or, lingering, shut
 * the write side (cleartext; under TLS the answer ends by its framing) and
 * wait for the client's close, the byte budget or the timer. */
static void conn_output_done(gw_conn *c) {
    if (!c->lingering) {
        gw_conn_free(c);
        return;
    }
    if (!c->wr_shut && !c->tls)
        shutdown(bufferevent_getfd(c->bev), SHUT_WR);
    c->wr_shut = true;
}

/* Lingering: drops the input read so far. Returns false when the budget
 * ran out: the connection then closes as soon as its output drained (c may
 * have been freed through the deferred event, never here). */
static bool conn_linger_discard(gw_conn *c) {
    struct evbuffer *in = bufferevent_get_input(c->bev);
    size_t n = evbuffer_get_length(in);
    evbuffer_drain(in, n);
    if (!c->lingering)
        return true;
    c->linger_left = n < c->linger_left ? c->linger_left - n : 0;
    if (c->linger_left > 0)
        return true;
    c->lingering = false;
    conn_update_read(c);
    if (c->wr_shut || evbuffer_get_length(bufferevent_get_output(c->bev)) == 0)
        event_active(c->deferred, 0, 0);
    return false;
}

void gw_conn_close(gw_conn *c) {
    if (c->closing)
        return;
    c->closing = true;
    gw_conn_set_timer(c, 0);
    conn_update_read(c);
    /* The write callback frees it once the output is empty; if it already
     * is, no write will happen, so go through the deferred event. */
    if (evbuffer_get_length(bufferevent_get_output(c->bev)) == 0)
        event_active(c->deferred, 0, 0);
}

void gw_conn_close_linger(gw_conn *c, uint64_t expect_bytes) {
    if (c->closing)
        return;
    c->lingering = true;
    c->linger_left = expect_bytes < GW_LINGER_MAX_BYTES ? expect_bytes : GW_LINGER_MAX_BYTES;
    gw_conn_close(c);
    gw_conn_set_timer(c, GW_LINGER_S); /* conn_timer_cb frees a closing connection */
    conn_linger_discard(c);            /* what arrived with the refused request */
}

void gw_conn_set_timer(gw_conn *c, double seconds) {
    if (seconds <= 0) {
        evtimer_del(c->timer);
        return;
    }
    struct timeval tv = gw_timeval(seconds);
    evtimer_add(c->timer, &tv);
}

void gw_conn_defer(gw_conn *c) {
    c->defer_proto = true;
    event_active(c->deferred, 0, 0);
}

void gw_conn_free(gw_conn *c) {
    gw_server *s = c->srv;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    s->n_conns--;
    if (c->proto && c->proto->on_close)
        c->proto->on_close(c);
    c->proto_data = NULL;
    event_free(c->timer);
    event_free(c->deferred);
    bufferevent_free(c->bev);
    PD_LOGD(GW_MOD, "conn %llu (%s) closed", (unsigned long long)c->id, c->peer);
    free(c);
}

/* Decides the protocol from the first bytes. Returns false while undecided. */
static bool conn_sniff(gw_conn *c) {
    struct evbuffer *in = bufferevent_get_input(c->bev);
    size_t n = evbuffer_get_length(in);
    size_t m = n < GW_H2_PREFACE_LEN ? n : GW_H2_PREFACE_LEN;
    if (m == 0)
        return false;
    unsigned char *p = evbuffer_pullup(in, (ev_ssize_t)m);
    if (memcmp(p, GW_H2_PREFACE, m) != 0) {
        c->proto = &gw_proto_http1;
        return true;
    }
    if (m < GW_H2_PREFACE_LEN)
        return false;
    c->proto = &gw_proto_h2; /* the preface stays: nghttp2 checks it as the client magic */
    return true;
}

/* Starts c->proto. Returns false when it failed and c was freed. */
static bool conn_start_proto(gw_conn *c) {
    PD_LOGD(GW_MOD, "conn %llu (%s): %s%s", (unsigned long long)c->id, c->peer, c->proto->name,
            c->tls ? " over TLS" : "");
    if (c->proto->init(c) != PD_OK) {
        PD_LOGE(GW_MOD, "conn %llu: cannot start %s", (unsigned long long)c->id, c->proto->name);
        c->proto = NULL;
        gw_conn_free(c);
        return false;
    }
    return true;
}

/* TLS: the handshake is done; ALPN may name the protocol. Returns false
 * when c was freed. */
static bool conn_tls_ready(gw_conn *c) {
    c->tls_ready = true;
    c->proto = gw_tls_alpn_proto(c->bev);
    return !c->proto || conn_start_proto(c);
}

static void conn_read_cb(struct bufferevent *bev, void *arg) {
    gw_conn *c = arg;
    if (c->closing) {
        conn_linger_discard(c);
        return;
    }
    if (c->tls && !c->tls_ready && !conn_tls_ready(c))
        return;
    if (!c->proto) {
        if (!conn_sniff(c))
            return;
        if (!conn_start_proto(c))
            return;
    }
    c->proto->on_read(c);
}

static void conn_write_cb(struct bufferevent *bev, void *arg) {
    gw_conn *c = arg;
    size_t out = evbuffer_get_length(bufferevent_get_output(bev));
    if (c->closing) {
        if (out == 0)
            conn_output_done(c);
        return;
    }
    if (c->bp_paused && out <= c->srv->cfg.output_high_water_bytes / 2) {
        c->bp_paused = false;
        conn_update_read(c);
        /* Input read before the pause may be waiting for the protocol. */
        if (c->proto && evbuffer_get_length(bufferevent_get_input(bev)) > 0)
            gw_conn_defer(c);
    }
    if (c->proto && c->proto->on_write)
        c->proto->on_write(c); /* may free c */
}

static void conn_event_cb(struct bufferevent *bev, short what, void *arg) {
    gw_conn *c = arg;
    if (what & BEV_EVENT_CONNECTED) { /* TLS handshake done */
        if (c->tls && !c->tls_ready && !c->closing)
            conn_tls_ready(c);
        return;
    }
    if (c->tls && (what & BEV_EVENT_ERROR)) {
        unsigned long e;
        while ((e = bufferevent_get_openssl_error(bev)) != 0) {
            char buf[256];
            ERR_error_string_n(e, buf, sizeof buf);
            PD_LOGD(GW_MOD, "conn %llu (%s): TLS: %s", (unsigned long long)c->id, c->peer, buf);
        }
    }
    if (what & BEV_EVENT_TIMEOUT)
        PD_LOGD(GW_MOD, "conn %llu (%s): write timed out", (unsigned long long)c->id, c->peer);
    else if (what & BEV_EVENT_ERROR)
        PD_LOGD(GW_MOD, "conn %llu (%s): %s", (unsigned long long)c->id, c->peer,
                evutil_socket_error_to_string(EVUTIL_SOCKET_ERROR()));
    if ((what & BEV_EVENT_EOF) && !(what & (BEV_EVENT_ERROR | BEV_EVENT_TIMEOUT)) && c->lingering &&
        evbuffer_get_length(bufferevent_get_output(bev)) > 0) {
        c->lingering = false; /* the client finished sending; let the answer drain, then free */
        conn_update_read(c);
        return;
    }
    if ((what & BEV_EVENT_EOF) && !(what & (BEV_EVENT_ERROR | BEV_EVENT_TIMEOUT)) && c->proto &&
        !c->closing) {
        c->proto->on_eof(c);
        return;
    }
    if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR | BEV_EVENT_TIMEOUT))
        gw_conn_free(c);
}

static void conn_timer_cb(evutil_socket_t fd, short what, void *arg) {
    gw_conn *c = arg;
    if (c->lingering && evbuffer_get_length(bufferevent_get_output(c->bev)) > 0) {
        c->lingering = false; /* linger over; the answer still drains (--timeout-write) */
        conn_update_read(c);
        return;
    }
    if (c->closing || !c->proto) {
        gw_conn_free(c); /* idle before the first request, a linger over, or a close that never drained */
        return;
    }
    c->proto->on_timeout(c);
}

static void conn_deferred_cb(evutil_socket_t fd, short what, void *arg) {
    gw_conn *c = arg;
    if (c->closing) {
        if (evbuffer_get_length(bufferevent_get_output(c->bev)) == 0)
            conn_output_done(c);
        return;
    }
    if (c->defer_proto && c->proto) {
        c->defer_proto = false;
        c->proto->on_deferred(c);
    }
}

/* Over max_connections: answer 503 and close fd, with no per-connection
 * state. The socket is non-blocking (libevent's listener makes it so). */
static void conn_refuse(gw_server *s, evutil_socket_t fd) {
    char sink[4096];
    for (int i = 0; i < 16 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; i++) {
    }
    char msg[128];
    snprintf(msg, sizeof msg, "the gateway serves at most --max-connections (%d) connections",
             s->cfg.max_connections);
    char *body = gw_error_json(503, msg, NULL);
    char head[256];
    int hl = snprintf(head, sizeof head,
                      "HTTP/1.1 503 Service Unavailable\r\nServer: pdserve\r\n"
                      "Content-Type: application/json\r\nContent-Length: %zu\r\n"
                      "Retry-After: 1\r\nConnection: close\r\n\r\n",
                      strlen(body));
    struct iovec iov[2] = {{head, (size_t)hl}, {body, strlen(body)}};
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
    (void)sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL); /* fits an empty socket buffer */
    free(body);
    shutdown(fd, SHUT_WR);
    evutil_closesocket(fd);
    s->n_refused_conns++;
    double now = pd_now_s();
    if (now - s->refused_logged_at >= 10) {
        s->refused_logged_at = now;
        PD_LOGW(GW_MOD, "%d connections open (--max-connections): refused %llu so far with 503",
                s->n_conns, (unsigned long long)s->n_refused_conns);
    }
}

static void accept_cb(struct evconnlistener *lis, evutil_socket_t fd, struct sockaddr *sa,
                      int salen, void *arg) {
    gw_server *s = arg;
    if (s->n_conns >= s->cfg.max_connections) {
        conn_refuse(s, fd);
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* SSE latency */
    gw_conn *c = calloc(1, sizeof *c);
    struct bufferevent *bev = !c ? NULL
                              : s->ssl_ctx
                                  ? gw_tls_bev_new(s, fd)
                                  : bufferevent_socket_new(s->base, fd, BEV_OPT_CLOSE_ON_FREE);
    struct event *timer = c ? evtimer_new(s->base, conn_timer_cb, c) : NULL;
    struct event *deferred = c ? event_new(s->base, -1, 0, conn_deferred_cb, c) : NULL;
    if (!c || !bev || !timer || !deferred) {
        PD_LOGE(GW_MOD, "out of memory accepting a connection");
        if (deferred)
            event_free(deferred);
        if (timer)
            event_free(timer);
        if (bev)
            bufferevent_free(bev);
        else
            evutil_closesocket(fd);
        free(c);
        return;
    }
    c->srv = s;
    c->bev = bev;
    c->tls = s->ssl_ctx != NULL;
    c->timer = timer;
    c->deferred = deferred;
    c->id = ++s->next_conn_id;
    char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
    getnameinfo(sa, (socklen_t)salen, host, sizeof host, serv, sizeof serv,
                NI_NUMERICHOST | NI_NUMERICSERV);
    snprintf(c->peer, sizeof c->peer, "%s:%s", host, serv);
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    s->n_conns++;

    bufferevent_setcb(bev, conn_read_cb, conn_write_cb, conn_event_cb, c);
    bufferevent_setwatermark(bev, EV_READ, 0, GW_INPUT_HIGH_WATER);
    bufferevent_setwatermark(bev, EV_WRITE, s->cfg.output_high_water_bytes / 2, 0);
    double w = s->cfg.timeout_write_s;
    struct timeval wtv = gw_timeval(w);
    bufferevent_set_timeouts(bev, NULL, w > 0 ? &wtv : NULL);
    bufferevent_enable(bev, EV_READ | EV_WRITE);
    gw_conn_set_timer(c, s->cfg.timeout_keep_alive_s);
    PD_LOGD(GW_MOD, "conn %llu from %s", (unsigned long long)c->id, c->peer);
}

static void accept_retry_cb(evutil_socket_t fd, short what, void *arg) {
    gw_server *s = arg;
    if (s->listener)
        evconnlistener_enable(s->listener);
}

static void accept_error_cb(struct evconnlistener *lis, void *arg) {
    gw_server *s = arg;
    int e = EVUTIL_SOCKET_ERROR();
    PD_LOGW(GW_MOD, "accept: %s", evutil_socket_error_to_string(e));
    if ((e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) && s->accept_retry) {
        /* the pending connection stays in the backlog; try again shortly */
        evconnlistener_disable(lis);
        struct timeval tv = {0, (suseconds_t)(GW_ACCEPT_RETRY_S * 1e6)};
        evtimer_add(s->accept_retry, &tv);
    }
}

pd_status gw_listener_init(gw_server *s, pd_err *err) {
    struct evutil_addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_protocol = IPPROTO_TCP;
    hints.ai_flags = EVUTIL_AI_PASSIVE | EVUTIL_AI_ADDRCONFIG;
    char port[16];
    snprintf(port, sizeof port, "%d", s->cfg.port);
    int rc = evutil_getaddrinfo(s->cfg.host, port, &hints, &res);
    if (rc != 0)
        return pd_err_set(err, PD_ERR_IO, "gateway: cannot resolve --host %s: %s", s->cfg.host,
                          evutil_gai_strerror(rc));
    int last_errno = 0;
    for (struct evutil_addrinfo *ai = res; ai; ai = ai->ai_next) {
        s->listener = evconnlistener_new_bind(s->base, accept_cb, s,
                                              LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE |
                                                  LEV_OPT_CLOSE_ON_EXEC,
                                              s->cfg.backlog, ai->ai_addr, (int)ai->ai_addrlen);
        if (s->listener)
            break;
        last_errno = errno;
    }
    evutil_freeaddrinfo(res);
    if (!s->listener)
        return pd_err_set(err, PD_ERR_IO, "gateway: cannot listen on %s:%d: %s", s->cfg.host,
                          s->cfg.port, strerror(last_errno));
    evconnlistener_set_error_cb(s->listener, accept_error_cb);
    s->accept_retry = evtimer_new(s->base, accept_retry_cb, s);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    s->port = s->cfg.port;
    if (getsockname(evconnlistener_get_fd(s->listener), (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET)
            s->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        else if (ss.ss_family == AF_INET6)
            s->port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
    return PD_OK;
}

void gw_listener_free(gw_server *s) {
    if (s->listener)
        evconnlistener_free(s->listener);
    s->listener = NULL;
    if (s->accept_retry)
        event_free(s->accept_retry);
    s->accept_retry = NULL;
}

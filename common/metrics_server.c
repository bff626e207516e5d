#include "pd_metrics_server.h"

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/thread.h>
#include <pthread.h>
#include <string.h>

struct pd_metrics_server {
    struct event_base *base;
    struct evhttp *http;
    pthread_t thread;
    pthread_mutex_t mu;
    char *text;
    size_t len;
    pd_metrics_scrape_fn scrape; /* under mu */
    void *scrape_user;
};

static void on_request(struct evhttp_request *req, void *arg) {
    pd_metrics_server *s = arg;
    const char *uri = evhttp_request_get_uri(req);
    struct evbuffer *out = evbuffer_new();
    if (evhttp_request_get_command(req) != EVHTTP_REQ_GET) {
        evhttp_send_reply(req, 405, "Method Not Allowed", NULL);
    } else if (!strncmp(uri, "/metrics", 8) && (uri[8] == 0 || uri[8] == '?')) {
        pthread_mutex_lock(&s->mu);
        if (s->text) evbuffer_add(out, s->text, s->len);
        pd_metrics_scrape_fn scrape = s->scrape;
        void *user = s->scrape_user;
        pthread_mutex_unlock(&s->mu);
        if (scrape) { /* NVML and friends: read now, on this thread, the lock released (publish never waits) */
            pd_strbuf b = {0};
            scrape(user, &b);
            if (b.len) evbuffer_add(out, b.data, b.len);
            pd_strbuf_free(&b);
        }
        evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                          "text/plain; version=0.0.4; charset=utf-8");
        evhttp_send_reply(req, 200, "OK", out);
    } else if (!strcmp(uri, "/health")) {
        evbuffer_add(out, "ok", 2);
        evhttp_send_reply(req, 200, "OK", out);
    } else {
        evhttp_send_reply(req, 404, "Not Found", NULL);
    }
    evbuffer_free(out);
}

static void *serve(void *arg) {
    pd_metrics_server *s = arg;
    event_base_dispatch(s->base);
    return NULL;
}

pd_status pd_metrics_server_start(const char *host, int port, pd_metrics_server **s_p, pd_err *err) {
    *s_p = NULL;
    if (port <= 0) return PD_OK;
    evthread_use_pthreads();
    pd_metrics_server *s = pd_xcalloc(1, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    s->base = event_base_new();
    s->http = s->base ? evhttp_new(s->base) : NULL;
    if (!s->http || evhttp_bind_socket(s->http, host, (ev_uint16_t)port) != 0) {
        if (s->http) evhttp_free(s->http);
        if (s->base) event_base_free(s->base);
        free(s);
        return pd_err_set(err, PD_ERR_IO, "metrics endpoint %s:%d: cannot bind", host, port);
    }
    evhttp_set_gencb(s->http, on_request, s);
    if (pthread_create(&s->thread, NULL, serve, s) != 0) {
        evhttp_free(s->http);
        event_base_free(s->base);
        free(s);
        return pd_err_set(err, PD_ERR_IO, "metrics endpoint: cannot start its thread");
    }
    *s_p = s;
    return PD_OK;
}

void pd_metrics_server_publish(pd_metrics_server *s, const char *text, size_t len) {
    if (!s) return;
    char *copy = pd_xmalloc(len + 1);
    memcpy(copy, text, len);
    copy[len] = 0;
    pthread_mutex_lock(&s->mu);
    free(s->text);
    s->text = copy;
    s->len = len;
    pthread_mutex_unlock(&s->mu);
}

void pd_metrics_server_set_scrape(pd_metrics_server *s, pd_metrics_scrape_fn fn, void *user) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->scrape = fn;
    s->scrape_user = user;
    pthread_mutex_unlock(&s->mu);
}

void pd_metrics_server_stop(pd_metrics_server **s_p) {
    if (!s_p || !*s_p) return;
    pd_metrics_server *s = *s_p;
    event_base_loopbreak(s->base);
    pthread_join(s->thread, NULL);
    evhttp_free(s->http);
    /* libevent finishes freeing a connection's bufferevent from the loop. A
     * bufferevent with deferred callbacks (TLS, or any from
     * evhttp_set_bevcb) holds itself while one is queued, and event_base_free
     * drops queued callbacks without running them: it would leak with its
     * socket (gateway/pd_gateway.h, pd_gw_server_free). evhttp's own
     * bufferevents (libevent 2.1) defer nothing and are released by
     * event_base_free either way. As the gateway's owner does, one more turn
     * without blocking first; only what evhttp_free left is on this base. */
    event_base_loop(s->base, EVLOOP_NONBLOCK);
    event_base_free(s->base);
    pthread_mutex_destroy(&s->mu);
    free(s->text);
    free(s);
    *s_p = NULL;
}

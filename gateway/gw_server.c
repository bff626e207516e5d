/* The server object, routing and the built-in GET endpoints (/health,
 * /v1/models, /version). */
#include <ctype.h>
#include <http_parser.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gw_internal.h"
#include "pd_version.h"

void pd_gw_config_defaults(pd_gw_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->host = "0.0.0.0";
    cfg->port = 8000;
    cfg->backlog = 1024;
    cfg->max_stop_strings = 16;
    cfg->max_logprobs = 20;
    cfg->max_request_body_bytes = 32u << 20;
    cfg->max_header_bytes = 64u << 10;
    cfg->max_header_count = 100;
    cfg->timeout_keep_alive_s = 5;
    cfg->timeout_request_headers_s = 30;
    cfg->timeout_request_body_s = 60;
    cfg->timeout_write_s = 60;
    cfg->output_high_water_bytes = 1u << 20;
    cfg->tokenizer_pool_size = 2;
    cfg->sse_ping_interval_s = 5;
    cfg->max_concurrent_streams = 100;
    cfg->max_connections = 16384;
    cfg->reasoning_parser = PD_CHAT_REASONING_DEEPSEEK_V3;
    cfg->tool_call_parser = PD_CHAT_TOOLS_DEEPSEEK_V3;
}

static const char *const builtin_paths[] = {
    "/health",   "/v1/models",  "/v1/completions", "/v1/chat/completions",
    "/tokenize", "/detokenize", "/version"};

static pd_status check_config(const pd_gw_config *c, pd_err *err) {
    if (!c->host || !*c->host)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: --host is empty");
    if (c->port < 0 || c->port > 65535)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: --port %d out of range", c->port);
    if (!c->served_model_name || !*c->served_model_name)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: --served-model-name is required");
    if (!c->tokenizer_handle && (!c->tokenizer || !*c->tokenizer))
        return pd_err_set(err, PD_ERR_INVALID, "gateway: --tokenizer is required");
    if (c->max_model_len <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: --max-model-len must be > 0 (got %d)",
                          c->max_model_len);
    if (c->vocab_size < 0 || c->max_stop_strings < 0 || c->max_logprobs < 0 ||
        c->default_max_tokens < 0)
        return pd_err_set(err, PD_ERR_INVALID,
                          "gateway: vocab_size, max_stop_strings, max_logprobs and "
                          "default_max_tokens must be >= 0");
    if (c->max_logprobs > PD_MAX_TOP_LOGPROBS)
        return pd_err_set(err, PD_ERR_INVALID,
                          "gateway: --max-logprobs %d: replicas report at most %d alternatives",
                          c->max_logprobs, PD_MAX_TOP_LOGPROBS);
    if (c->max_request_body_bytes == 0)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: --max-request-body-bytes must be > 0");
    if (c->max_header_bytes < 256 || c->max_header_bytes > (1u << 30))
        return pd_err_set(err, PD_ERR_INVALID,
                          "gateway: --max-header-bytes must be 256..1073741824 (got %zu)",
                          c->max_header_bytes);
    if (c->max_header_count < 1)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: --max-header-count must be >= 1 (got %d)",
                          c->max_header_count);
    if (!(c->timeout_keep_alive_s > 0) || !(c->timeout_request_headers_s > 0) ||
        !(c->timeout_request_body_s > 0) || !(c->timeout_write_s >= 0))
        return pd_err_set(err, PD_ERR_INVALID,
                          "gateway: --timeout-keep-alive, --timeout-request-headers and "
                          "--timeout-request-body must be > 0, --timeout-write >= 0");
    if (c->max_connections < 1)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: --max-connections must be >= 1 (got %d)",
                          c->max_connections);
    if (c->output_high_water_bytes < 1024)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: output_high_water_bytes must be >= 1024");
    if (c->tokenizer_pool_size < 1 || c->tokenizer_pool_size > 256)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: --tokenizer-pool-size must be 1..256");
    if ((c->ssl_certfile && *c->ssl_certfile) != (c->ssl_keyfile && *c->ssl_keyfile))
        return pd_err_set(err, PD_ERR_INVALID,
                          "gateway: --ssl-certfile and --ssl-keyfile go together (got only %s)",
                          c->ssl_certfile && *c->ssl_certfile ? "--ssl-certfile" : "--ssl-keyfile");
    if (c->max_concurrent_streams < 1)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: --max-concurrent-streams must be >= 1");
    return PD_OK;
}

static pd_status load_tokenizer(gw_server *s, pd_err *err) {
    if (s->cfg.tokenizer_handle) {
        s->tok = s->cfg.tokenizer_handle;
        return PD_OK;
    }
    const char *path = s->tokenizer_path;
    char *joined = NULL;
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        size_t n = strlen(path) + sizeof "/tokenizer.json";
        joined = pd_xmalloc(n);
        snprintf(joined, n, "%s/tokenizer.json", path);
        path = joined;
    }
    pd_status rc = pd_tok_load(path, &s->tok_owned, err);
    free(joined);
    if (rc != PD_OK)
        return rc;
    s->tok = s->tok_owned;
    return PD_OK;
}

pd_status pd_gw_server_init(struct event_base *base, const pd_gw_config *cfg,
                            const pd_gw_engine_i *engine, void *engine_ctx, pd_gw_server **s_p,
                            pd_err *err) {
    if (!base || !cfg || !engine || !s_p)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: NULL argument");
    if (!engine->submit || !engine->abort)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: engine needs submit and abort");
    pd_status rc = check_config(cfg, err);
    if (rc != PD_OK)
        return rc;

    gw_server *s = pd_xcalloc(1, sizeof *s);
    s->base = base;
    s->cfg = *cfg;
    s->host = pd_xstrdup(cfg->host);
    s->model_name = pd_xstrdup(cfg->served_model_name);
    s->tokenizer_path = cfg->tokenizer ? pd_xstrdup(cfg->tokenizer) : NULL;
    bool tls = cfg->ssl_certfile && *cfg->ssl_certfile;
    s->certfile = tls ? pd_xstrdup(cfg->ssl_certfile) : NULL;
    s->keyfile = tls ? pd_xstrdup(cfg->ssl_keyfile) : NULL;
    s->cfg.host = s->host;
    s->cfg.served_model_name = s->model_name;
    s->cfg.tokenizer = s->tokenizer_path;
    s->cfg.ssl_certfile = s->certfile;
    s->cfg.ssl_keyfile = s->keyfile;
    s->engine = *engine;
    s->engine_ctx = engine_ctx;
    s->ready = true;
    s->created = (int64_t)time(NULL);
    pd_rng_seed(&s->rng, (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32) ^
                             (uint64_t)(uintptr_t)s ^ (uint64_t)(pd_now_s() * 1e9));

    if (tls) {
        rc = gw_tls_init(s, err);
        if (rc != PD_OK)
            goto undo_strings;
    }
    rc = load_tokenizer(s, err);
    if (rc != PD_OK)
        goto undo_tls;
    if (s->cfg.vocab_size == 0)
        s->cfg.vocab_size = pd_tok_vocab_size(s->tok);
    /* libhttp-parser's own limit (a process-wide setting) must not bite
     * before ours, which answers 431 with a clearer message. */
    http_parser_set_max_header_size((uint32_t)(s->cfg.max_header_bytes + 4096));

    rc = gw_pool_init(s, s->cfg.tokenizer_pool_size, &s->pool, err);
    if (rc != PD_OK)
        goto undo_tokenizer;
    rc = gw_listener_init(s, err);
    if (rc != PD_OK)
        goto undo_pool;
    PD_LOGI(GW_MOD, "listening on %s:%d (%s), model %s, max_model_len %d", s->cfg.host, s->port,
            tls ? "TLS: h2, http/1.1" : "cleartext: http/1.1, h2c", s->model_name,
            s->cfg.max_model_len);
    *s_p = s;
    return PD_OK;

undo_pool:
    gw_pool_free(&s->pool);
undo_tokenizer:
    pd_tok_free(&s->tok_owned);
undo_tls:
    gw_tls_free(s);
undo_strings:
    free(s->certfile);
    free(s->keyfile);
    free(s->host);
    free(s->model_name);
    free(s->tokenizer_path);
    free(s);
    return rc;
}

void pd_gw_server_free(pd_gw_server **s_p) {
    if (!s_p || !*s_p)
        return;
    gw_server *s = *s_p;
    s->shutting_down = true;
    s->drained = NULL;
    gw_listener_free(s);
    while (s->conns)
        gw_conn_free(s->conns); /* aborts in-flight requests */
    gw_pool_free(&s->pool);
    if (s->drain_timer)
        event_free(s->drain_timer);
    for (int i = 0; i < s->n_routes; i++)
        free(s->routes[i].path);
    free(s->routes);
    pd_tok_free(&s->tok_owned);
    gw_tls_free(s);
    free(s->certfile);
    free(s->keyfile);
    free(s->host);
    free(s->model_name);
    free(s->tokenizer_path);
    free(s);
    *s_p = NULL;
}

static void drain_timer_in(gw_server *s, double seconds) {
    if (seconds < 0)
        seconds = 0;
    struct timeval tv = gw_timeval(seconds);
    event_add(s->drain_timer, &tv);
}

/* Whether every connection has written out what it was given (the last
 * requests' final chunks and [DONE]). */
static bool outputs_flushed(const gw_server *s) {
    for (const gw_conn *c = s->conns; c; c = c->next)
        if (evbuffer_get_length(bufferevent_get_output(c->bev)) > 0)
            return false;
    return true;
}

/* The drain's timer, also made active when the last request is freed: once
 * no request is left and the connections' output is written (at most 2 s
 * more), or when the drain's time ran out, drained is called, once. */
static void drain_done_cb(evutil_socket_t fd, short what, void *arg) {
    (void)fd;
    (void)what;
    gw_server *s = arg;
    if (!s->drained)
        return;
    double now = pd_now_s();
    if (s->n_requests > 0 && now < s->drain_deadline) {
        drain_timer_in(s, s->drain_deadline - now);
        return;
    }
    if (s->n_requests > 0 && !s->drain_forced) {
        /* time is up: tell each client (503, in-band once streaming), and
         * give those answers 2 s to be written */
        PD_LOGW(GW_MOD, "shutdown: %d requests still running after the drain timeout; ending them",
                s->n_requests);
        s->drain_forced = true;
        gw_requests_shut_down(s);
        s->drain_deadline = now + 2.0;
        drain_timer_in(s, 0.02);
        return;
    }
    if (s->n_requests == 0 && !outputs_flushed(s)) {
        if (s->flush_deadline == 0)
            s->flush_deadline = now + 2.0;
        if (now < s->flush_deadline) {
            drain_timer_in(s, 0.02);
            return;
        }
    }
    void (*done)(void *) = s->drained;
    s->drained = NULL;
    if (s->drain_forced)
        PD_LOGI(GW_MOD, "shutdown: the drain timed out; %d requests left", s->n_requests);
    else
        PD_LOGI(GW_MOD, "shutdown: every request finished");
    done(s->drained_ud);
}

void gw_server_request_gone(gw_server *s) {
    if (--s->n_requests == 0 && s->draining && s->drain_timer)
        event_active(s->drain_timer, 0, 0); /* from the loop, not inside the request's free */
}

pd_status pd_gw_server_drain(pd_gw_server *s, double timeout_s, void (*drained)(void *ud), void *ud,
                             pd_err *err) {
    if (!s || !drained || !(timeout_s >= 0))
        return pd_err_set(err, PD_ERR_INVALID, "gateway: drain needs a server, a callback and a timeout >= 0");
    if (s->draining)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: already draining");
    s->drain_timer = event_new(s->base, -1, 0, drain_done_cb, s);
    if (!s->drain_timer)
        return pd_err_set(err, PD_ERR_NOMEM, "gateway: out of memory");
    s->draining = true;
    s->ready = false; /* /health 503: load balancers stop sending */
    s->drained = drained;
    s->drained_ud = ud;
    gw_listener_free(s); /* no new connection */
    PD_LOGI(GW_MOD, "shutdown: not accepting; waiting up to %g s for %d running requests", timeout_s,
            s->n_requests);
    s->drain_deadline = pd_now_s() + timeout_s;
    if (s->n_requests == 0)
        event_active(s->drain_timer, 0, 0);
    else
        drain_timer_in(s, timeout_s);
    return PD_OK;
}

void pd_gw_server_set_abort_choice(pd_gw_server *s, pd_gw_abort_choice_fn fn) {
    if (s)
        s->abort_choice = fn;
}

int pd_gw_server_port(const pd_gw_server *s) {
    return s ? s->port : -1;
}

const pd_tokenizer *pd_gw_server_tokenizer(const pd_gw_server *s) {
    return s ? s->tok : NULL;
}

void pd_gw_server_set_ready(pd_gw_server *s, bool ready) {
    if (s)
        s->ready = ready;
}

pd_status pd_gw_server_add_get(pd_gw_server *s, const char *path, pd_gw_get_fn fn, void *ctx,
                               pd_err *err) {
    if (!s || !path || !fn)
        return pd_err_set(err, PD_ERR_INVALID, "gateway: NULL argument");
    if (path[0] != '/')
        return pd_err_set(err, PD_ERR_INVALID, "gateway: GET path '%s' must start with '/'", path);
    for (size_t i = 0; i < sizeof builtin_paths / sizeof *builtin_paths; i++)
        if (strcmp(path, builtin_paths[i]) == 0)
            return pd_err_set(err, PD_ERR_INVALID, "gateway: %s is a built-in path", path);
    for (int i = 0; i < s->n_routes; i++) {
        if (strcmp(s->routes[i].path, path) == 0) {
            s->routes[i].fn = fn;
            s->routes[i].ctx = ctx;
            return PD_OK;
        }
    }
    gw_route *r = realloc(s->routes, (size_t)(s->n_routes + 1) * sizeof *r);
    if (!r)
        return pd_err_set(err, PD_ERR_NOMEM, "gateway: out of memory");
    s->routes = r;
    r[s->n_routes].path = pd_xstrdup(path);
    r[s->n_routes].fn = fn;
    r[s->n_routes].ctx = ctx;
    s->n_routes++;
    return PD_OK;
}

/* ---- built-in endpoints ----------------------------------------------- */

static json_t *model_card(const gw_server *s) {
    return json_pack("{s:s, s:s, s:I, s:s, s:s, s:i}", "id", s->model_name, "object", "model",
                     "created", (json_int_t)s->created, "owned_by", "pdserve", "root",
                     s->model_name, "max_model_len", s->cfg.max_model_len);
}

static void respond_json(gw_stream *st, int status, json_t *j) {
    char *body = gw_json_dump(j);
    json_decref(j);
    gw_stream_respond(st, status, "application/json", NULL, 0, body, strlen(body));
    free(body);
}

/* Percent-decodes a path segment (RFC 3986 §2.1) into out (cap bytes, NUL
 * included): "models%2Fsmall" is "models/small", as SDKs that escape path
 * parameters send a model id with a slash. False for a malformed escape, %00
 * or an id that does not fit. */
static bool pct_decode(const char *in, char *out, size_t cap) {
    size_t o = 0;
    for (const char *p = in; *p; p++) {
        int c = (unsigned char)*p;
        if (c == '%') {
            int hi = isxdigit((unsigned char)p[1]) ? p[1] : -1;
            int lo = hi >= 0 && isxdigit((unsigned char)p[2]) ? p[2] : -1;
            if (lo < 0)
                return false;
            c = (isdigit(hi) ? hi - '0' : (tolower(hi) - 'a' + 10)) * 16 +
                (isdigit(lo) ? lo - '0' : (tolower(lo) - 'a' + 10));
            if (c == 0)
                return false;
            p += 2;
        }
        if (o + 1 >= cap)
            return false;
        out[o++] = (char)c;
    }
    out[o] = 0;
    return true;
}

static bool is_get(const gw_stream *st) {
    return strcmp(st->method, "GET") == 0 || strcmp(st->method, "HEAD") == 0;
}

void gw_server_check_route(const gw_stream *st, gw_route_check *out) {
    const gw_server *s = st->conn->srv;
    const char *path = st->path;
    memset(out, 0, sizeof *out);
    out->route = -1;
    if (strcmp(path, "/v1/completions") == 0)
        out->ep = GW_EP_COMPLETIONS;
    else if (strcmp(path, "/v1/chat/completions") == 0)
        out->ep = GW_EP_CHAT;
    else if (strcmp(path, "/tokenize") == 0)
        out->ep = GW_EP_TOKENIZE;
    else if (strcmp(path, "/detokenize") == 0)
        out->ep = GW_EP_DETOKENIZE;
    else if (strcmp(path, "/version") == 0)
        out->ep = GW_EP_VERSION;
    else if (strcmp(path, "/health") == 0)
        out->ep = GW_EP_HEALTH;
    else if (strcmp(path, "/v1/models") == 0)
        out->ep = GW_EP_MODELS;
    else if (strncmp(path, "/v1/models/", 11) == 0)
        out->ep = GW_EP_MODEL;
    for (int i = 0; i < s->n_routes && out->ep == GW_EP_NONE; i++)
        if (strcmp(s->routes[i].path, path) == 0) {
            out->ep = GW_EP_ROUTE;
            out->route = i;
        }
    if (out->ep == GW_EP_NONE) {
        out->status = 404;
        snprintf(out->message, sizeof out->message, "no such endpoint: %.80s", path);
        return;
    }
    bool post = out->ep == GW_EP_COMPLETIONS || out->ep == GW_EP_CHAT ||
                out->ep == GW_EP_TOKENIZE || out->ep == GW_EP_DETOKENIZE;
    if (post ? strcmp(st->method, "POST") != 0 : !is_get(st)) {
        out->status = 405;
        out->allow = post ? "POST" : "GET, HEAD";
        snprintf(out->message, sizeof out->message,
                 "method %.20s is not allowed on %.80s (allowed: %s)", st->method, path,
                 out->allow);
        return;
    }
    const char *ct = gw_stream_header(st, "Content-Type");
    if (post && !gw_is_json_content_type(ct)) {
        out->status = 415;
        snprintf(out->message, sizeof out->message,
                 "Content-Type must be application/json (optionally with charset=utf-8), "
                 "got '%.80s'",
                 ct ? ct : "(none)");
    }
}

void gw_server_dispatch(gw_stream *st) {
    gw_server *s = st->conn->srv;
    const char *path = st->path;
    PD_LOGD(GW_MOD, "conn %llu: %s %s", (unsigned long long)st->conn->id, st->method, path);

    gw_route_check rc;
    gw_server_check_route(st, &rc);
    if (s->draining && rc.status == 0 &&
        (rc.ep == GW_EP_COMPLETIONS || rc.ep == GW_EP_CHAT || rc.ep == GW_EP_TOKENIZE ||
         rc.ep == GW_EP_DETOKENIZE)) {
        gw_stream_respond_error(st, 503, "the server is shutting down", NULL, NULL, 0);
        return;
    }
    if (rc.ep == GW_EP_COMPLETIONS || rc.ep == GW_EP_CHAT) {
        if (rc.status == 0 || rc.status == 415) {
            gw_request_begin(st, rc.ep == GW_EP_CHAT ? GW_KIND_CHAT : GW_KIND_COMPLETION,
                             rc.status ? &rc : NULL);
            return;
        }
    }
    if ((rc.ep == GW_EP_TOKENIZE || rc.ep == GW_EP_DETOKENIZE) && rc.status == 0) {
        gw_tokenize_begin(st, rc.ep == GW_EP_TOKENIZE ? GW_KIND_TOKENIZE : GW_KIND_DETOKENIZE);
        return;
    }
    if (rc.status) {
        gw_hdr h = {"Allow", rc.allow};
        gw_stream_respond_error(st, rc.status, rc.message, NULL, &h, rc.allow ? 1 : 0);
        return;
    }
    if (rc.ep == GW_EP_HEALTH) {
        if (s->ready)
            gw_stream_respond(st, 200, "text/plain; charset=utf-8", NULL, 0, "ok", 2);
        else
            gw_stream_respond_error(st, 503, s->draining ? "the server is shutting down"
                                                         : "not ready: no decode replica takes work (none "
                                                           "registered, or every one draining)",
                                    NULL, NULL, 0);
        return;
    }
    if (rc.ep == GW_EP_VERSION) { /* vLLM's GET /version */
        respond_json(st, 200, json_pack("{s:s}", "version", PD_VERSION));
        return;
    }
    if (rc.ep == GW_EP_MODELS) {
        json_t *list = json_array();
        json_array_append_new(list, model_card(s));
        respond_json(st, 200, json_pack("{s:s, s:o}", "object", "list", "data", list));
        return;
    }
    if (rc.ep == GW_EP_MODEL) {
        char id[512];
        if (!pct_decode(path + 11, id, sizeof id))
            snprintf(id, sizeof id, "%s", path + 11);
        if (strcmp(id, s->model_name) == 0) {
            respond_json(st, 200, model_card(s));
        } else {
            char msg[160];
            snprintf(msg, sizeof msg, "The model `%.80s` does not exist.", id);
            gw_stream_respond_error(st, 404, msg, "model", NULL, 0);
        }
        return;
    }
    int route = rc.route;
    struct evbuffer *body = evbuffer_new();
    if (!body) {
        gw_stream_respond_error(st, 500, "out of memory", NULL, NULL, 0);
        return;
    }
    const char *ctype = "text/plain; charset=utf-8";
    int status = s->routes[route].fn(s->routes[route].ctx, path, st->query, body, &ctype);
    if (status < 200 || status > 599)
        status = 500;
    size_t len = evbuffer_get_length(body);
    const char *p = len ? (const char *)evbuffer_pullup(body, -1) : "";
    gw_stream_respond(st, status, ctype, NULL, 0, p, len);
    evbuffer_free(body);
}

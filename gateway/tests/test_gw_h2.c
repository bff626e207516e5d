/* HTTP/2 on the gateway's port, end to end over real sockets with the fake
 * engine (gw_test_util.c): h2c with prior knowledge, `Upgrade: h2c`, TLS with
 * ALPN (h2, http/1.1, none), the same content as HTTP/1.1 (1 MiB request
 * body included), many concurrent streams against SETTINGS_MAX_CONCURRENT_
 * STREAMS, RST_STREAM aborting one request only, a stalled reader that the
 * gateway cuts off instead of buffering without bound, per-stream limits and
 * timeouts, no connection-specific headers, a TLS connection released when
 * the server stops right after it wrote; and real clients (curl with
 * --http2-prior-knowledge, --http2 upgrade and TLS; h2load for many
 * concurrent streams). The protocol-level client is gw_h2_client.c (nghttp2's
 * client session). Test certificates are made at run time with
 * `openssl req -x509 -newkey ec ...`. */
/* Single-source test: the helpers are compiled in here, first, because they
 * define _GNU_SOURCE. */
#include "gw_test_util.c"

#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "gw_internal.h" /* the connection list, for test_tls_stop_after_write */

#include "gw_h2_client.c" /* uses cmocka's asserts */

static gwt_server g_srv;
static char g_tmp[256]; /* scratch directory: certificates, request bodies */

#define UTF8_TEXT       "Grüße, 世界! Ça va? 🎉 naïve — ok"
#define COMPLETION_BODY "{\"model\":\"test-model\",\"prompt\":\"Hello there\",\"max_tokens\":40}"
#define CHAT_STREAM_BODY                                                                           \
    "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stream\":true,"                      \
    "\"stream_options\":{\"include_usage\":true},\"n\":2}"

/* ---- helpers ---------------------------------------------------------------- */

static json_t *jparse(const char *s) {
    json_error_t e;
    json_t *j = json_loads(s, 0, &e);
    if (!j)
        fprintf(stderr, "bad JSON (%s): %.300s\n", e.text, s);
    assert_non_null(j);
    return j;
}

static void script_text(gwt_server *h, const char *text, int batch, double interval) {
    int n = 0;
    int32_t *ids = gwt_ids_bytewise(text, &n);
    gwt_script s = gwt_script_ids(ids, n);
    s.batch = batch;
    s.interval_s = interval;
    gwt_engine_set(&h->engine, &s);
    free(ids);
}

/* A long script: n copies of "word " (one token each), tick every interval. */
static void script_long(gwt_server *h, int n, double interval) {
    int32_t id = pd_tok_find(gwt_tokenizer(), "word");
    int32_t *ids = calloc((size_t)n, sizeof *ids);
    for (int i = 0; i < n; i++)
        ids[i] = id;
    gwt_script s = gwt_script_ids(ids, n);
    s.interval_s = interval;
    gwt_engine_set(&h->engine, &s);
    free(ids);
}

/* The response JSON without what differs between two identical requests
 * (id, created), as sorted compact text. */
static char *normalized(const char *body) {
    json_t *j = jparse(body);
    json_object_del(j, "id");
    json_object_del(j, "created");
    char *s = json_dumps(j, JSON_SORT_KEYS | JSON_COMPACT);
    json_decref(j);
    return s;
}

/* An SSE body reduced to what must not depend on the protocol: the text of
 * each choice, its finish_reason, the usage chunk; with the shape checked
 * (data lines only, [DONE] last, one usage chunk when include_usage). */
static char *sse_summary(const char *body, size_t len) {
    gwt_sse sse;
    gwt_sse_parse(body, len, &sse);
    assert_int_equal(sse.bad, 0);
    assert_true(sse.n >= 2);
    assert_string_equal(sse.data[sse.n - 1], "[DONE]");
    char *text[4] = {strdup(""), strdup(""), strdup(""), strdup("")};
    char finish[4][32] = {"", "", "", ""};
    char *usage = strdup("none");
    for (int i = 0; i < sse.n - 1; i++) {
        json_t *ev = jparse(sse.data[i]);
        json_t *u = json_object_get(ev, "usage");
        if (json_is_object(u)) {
            free(usage);
            usage = json_dumps(u, JSON_SORT_KEYS | JSON_COMPACT);
            assert_int_equal(i, sse.n - 2); /* the usage chunk is the last before [DONE] */
        }
        size_t k;
        json_t *c;
        json_array_foreach(json_object_get(ev, "choices"), k, c) {
            int idx = (int)json_integer_value(json_object_get(c, "index"));
            assert_true(idx >= 0 && idx < 4);
            json_t *d = json_object_get(c, "delta");
            json_t *t = d ? json_object_get(d, "content") : json_object_get(c, "text");
            if (json_is_string(t)) {
                char *n = NULL;
                assert_true(asprintf(&n, "%s%s", text[idx], json_string_value(t)) >= 0);
                free(text[idx]);
                text[idx] = n;
            }
            json_t *f = json_object_get(c, "finish_reason");
            if (json_is_string(f))
                snprintf(finish[idx], sizeof finish[idx], "%s", json_string_value(f));
        }
        json_decref(ev);
    }
    char *out = NULL;
    assert_true(asprintf(&out, "0:%s/%s 1:%s/%s usage:%s", text[0], finish[0], text[1], finish[1],
                         usage) > 0);
    for (int i = 0; i < 4; i++)
        free(text[i]);
    free(usage);
    gwt_sse_free(&sse);
    return out;
}

/* One request on a new HTTP/1.1 connection; the body (heap) and status. */
static char *h1_post(int port, const char *path, const char *body, int *status) {
    gwt_resp r;
    assert_int_equal(gwt_post(port, path, body, &r), 0);
    *status = r.status;
    char *b = r.body;
    r.body = NULL;
    gwt_resp_free(&r);
    return b;
}

static bool stream_closed(h2c *c, void *ud) {
    return ((h2c_stream *)ud)->closed;
}

static bool got_goaway(h2c *c, void *ud) {
    return c->goaway;
}

static bool got_settings(h2c *c, void *ud) {
    return c->got_settings;
}

static bool stream_has_data(h2c *c, void *ud) {
    h2c_stream **ss = ud;
    for (; *ss; ss++)
        if ((*ss)->len == 0)
            return false;
    return true;
}

/* One request on an existing h2 connection, run until it closed. */
static h2c_stream *h2_do(h2c *c, const char *method, const char *path, const char *body) {
    h2c_stream *s = h2c_request(c, method, path, NULL, 0, body, body ? strlen(body) : 0);
    assert_int_equal(h2c_run(c, stream_closed, s, 20), 0);
    return s;
}

static void check_no_connection_headers(const h2c_stream *s) {
    static const char *const bad[] = {
        "connection:", "keep-alive:", "proxy-connection:", "transfer-encoding:", "upgrade:"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        bool at_line_start = false;
        for (const char *p = s->hdrs; p && (p = strstr(p, bad[i])); p++)
            if (p == s->hdrs || p[-1] == '\n')
                at_line_start = true;
        assert_false(at_line_start);
    }
}

/* Runs a shell command; its stdout (heap) and exit status. */
static char *run_cmd(const char *cmd, int *status) {
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    size_t cap = 4096, len = 0;
    char *out = malloc(cap);
    size_t n;
    while ((n = fread(out + len, 1, cap - len - 1, f)) > 0) {
        len += n;
        if (cap - len < 2048)
            out = realloc(out, cap *= 2);
    }
    out[len] = 0;
    int st = pclose(f);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return out;
}

static bool have_program(const char *name) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", name);
    return system(cmd) == 0;
}

static void write_file(const char *path, const char *data, size_t len) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, len, f), len);
    fclose(f);
}

/* A chat request of about `bytes` bytes: a short prompt and an unknown
 * field of padding (unknown fields are accepted and ignored). */
static char *big_chat_body(size_t bytes) {
    char *pad = malloc(bytes + 1);
    for (size_t i = 0; i < bytes; i++)
        pad[i] = (char)('a' + i % 26);
    pad[bytes] = 0;
    char *b = NULL;
    assert_true(asprintf(&b,
                         "{\"messages\":[{\"role\":\"user\",\"content\":\"big body\"}],"
                         "\"max_tokens\":30,\"padding\":\"%s\"}",
                         pad) > 0);
    free(pad);
    return b;
}

/* ---- prior knowledge, shapes, same content as HTTP/1.1 ------------------------- */

static void test_prior_knowledge(void **state) {
    h2c *c = h2c_connect(g_srv.port, false, NULL, false);
    assert_non_null(c);
    h2c_stream *s = h2_do(c, "GET", "/health", NULL);
    assert_int_equal(s->status, 200);
    assert_string_equal(s->body, "ok");
    char v[256];
    assert_string_equal(h2c_header(s, "content-length", v, sizeof v), "2");
    check_no_connection_headers(s);
    /* our SETTINGS: --max-concurrent-streams */
    assert_true(c->got_settings);
    assert_int_equal(c->server_max_streams, 16);

    s = h2_do(c, "GET", "/v1/models", NULL);
    assert_int_equal(s->status, 200);
    assert_non_null(strstr(s->body, "\"test-model\""));
    s = h2_do(c, "HEAD", "/health", NULL);
    assert_int_equal(s->status, 200);
    assert_int_equal(s->len, 0);
    s = h2_do(c, "GET", "/nope", NULL);
    assert_int_equal(s->status, 404);
    s = h2_do(c, "DELETE", "/v1/completions", NULL);
    assert_int_equal(s->status, 405);
    assert_string_equal(h2c_header(s, "allow", v, sizeof v), "POST");

    /* a completion: the same JSON as over HTTP/1.1, X-Request-Id both ways */
    script_text(&g_srv, UTF8_TEXT, 3, 0.001);
    int st1 = 0;
    char *b1 = h1_post(g_srv.port, "/v1/completions", COMPLETION_BODY, &st1);
    assert_int_equal(st1, 200);
    h2c_hdr xr = {"x-request-id", "client-id-42"};
    s = h2c_request(c, "POST", "/v1/completions", &xr, 1, COMPLETION_BODY, strlen(COMPLETION_BODY));
    assert_int_equal(h2c_run(c, stream_closed, s, 10), 0);
    assert_int_equal(s->status, 200);
    assert_int_equal(s->error_code, 0);
    check_no_connection_headers(s);
    assert_string_equal(h2c_header(s, "x-request-id", v, sizeof v), "client-id-42");
    assert_non_null(strstr(h2c_header(s, "content-type", v, sizeof v), "application/json"));
    char *n1 = normalized(b1), *n2 = normalized(s->body);
    assert_string_equal(n1, n2);
    free(n1);
    free(n2);
    free(b1);

    /* streamed, n = 2, include_usage: the same events as over HTTP/1.1 */
    b1 = h1_post(g_srv.port, "/v1/chat/completions", CHAT_STREAM_BODY, &st1);
    assert_int_equal(st1, 200);
    s = h2_do(c, "POST", "/v1/chat/completions", CHAT_STREAM_BODY);
    assert_int_equal(s->status, 200);
    assert_non_null(strstr(h2c_header(s, "content-type", v, sizeof v), "text/event-stream"));
    assert_null(h2c_header(s, "content-length", v, sizeof v));
    check_no_connection_headers(s);
    n1 = sse_summary(b1, strlen(b1));
    n2 = sse_summary(s->body, s->len);
    assert_string_equal(n1, n2);
    assert_non_null(strstr(n2, UTF8_TEXT "/stop"));
    free(n1);
    free(n2);
    free(b1);

    /* validation errors are the same bodies too */
    static const char *const bad[] = {
        "{", "{\"prompt\":\"x\",\"temperature\":3}", "{\"prompt\":\"x\",\"model\":\"other\"}",
        "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        b1 = h1_post(g_srv.port, "/v1/completions", bad[i], &st1);
        s = h2_do(c, "POST", "/v1/completions", bad[i]);
        assert_int_equal(s->status, st1);
        assert_true(st1 == 400 || st1 == 404);
        assert_string_equal(b1, s->body);
        free(b1);
    }
    /* connection-specific fields are refused in HTTP/2 requests (that
     * stream only: PROTOCOL_ERROR) */
    h2c_hdr conn_hdr = {"connection", "keep-alive"};
    s = h2c_request(c, "GET", "/health", &conn_hdr, 1, NULL, 0);
    assert_int_equal(h2c_run(c, stream_closed, s, 10), 0);
    assert_int_equal(s->status, 0);
    assert_int_equal(s->error_code, NGHTTP2_PROTOCOL_ERROR);
    s = h2_do(c, "GET", "/health", NULL);
    assert_int_equal(s->status, 200);
    /* 415 without a JSON content type */
    h2c_hdr ct = {"content-type", "text/plain"};
    s = h2c_request(c, "POST", "/v1/completions", &ct, 1, COMPLETION_BODY, strlen(COMPLETION_BODY));
    assert_int_equal(h2c_run(c, stream_closed, s, 10), 0);
    assert_int_equal(s->status, 415);
    assert_non_null(h2c_header(s, "x-request-id", v, sizeof v));
    assert_false(c->goaway);
    h2c_free(c);
}

/* 1 MiB body: many stream windows (64 KiB each); same content as HTTP/1.1;
 * bodies over --max-request-body-bytes are refused on that stream only. */
static void test_large_bodies(void **state) {
    script_text(&g_srv, "big answer ok", 2, 0.001);
    char *body = big_chat_body(1u << 20);
    int st1 = 0;
    char *b1 = h1_post(g_srv.port, "/v1/chat/completions", body, &st1);
    assert_int_equal(st1, 200);
    int32_t prompt1[64];
    int np1 = g_srv.engine.last_n_prompt;
    memcpy(prompt1, g_srv.engine.last_prompt, sizeof prompt1);

    h2c *c = h2c_connect(g_srv.port, false, NULL, false);
    h2c_stream *s = h2c_request(c, "POST", "/v1/chat/completions", NULL, 0, body, strlen(body));
    h2c_stream *s2 = h2c_request(c, "POST", "/v1/chat/completions", NULL, 0, body, strlen(body));
    assert_int_equal(h2c_run(c, NULL, NULL, 20), 0);
    assert_int_equal(s->status, 200);
    assert_int_equal(s2->status, 200);
    assert_int_equal(s->req_off, strlen(body));
    char *n1 = normalized(b1), *n2 = normalized(s->body);
    assert_string_equal(n1, n2);
    free(n2);
    n2 = normalized(s2->body);
    assert_string_equal(n1, n2);
    assert_int_equal(g_srv.engine.last_n_prompt, np1);
    assert_memory_equal(g_srv.engine.last_prompt, prompt1, sizeof prompt1);
    free(n1);
    free(n2);
    free(b1);
    free(body);

    /* 3 MiB > 2 MiB limit: 413 on that stream (reset after the answer), the
     * connection goes on */
    body = big_chat_body(3u << 20);
    s = h2c_request(c, "POST", "/v1/chat/completions", NULL, 0, body, strlen(body));
    assert_int_equal(h2c_run(c, stream_closed, s, 20), 0);
    assert_int_equal(s->status, 413);
    assert_non_null(strstr(s->body, "max-request-body-bytes"));
    assert_true(s->req_off < s->req_len); /* the client did not have to send it all */
    /* declared too big in content-length: refused before the body */
    char clen[32];
    snprintf(clen, sizeof clen, "%zu", strlen(body));
    h2c_hdr h = {"content-length", clen};
    s = h2c_request(c, "POST", "/v1/chat/completions", &h, 1, body, strlen(body));
    assert_int_equal(h2c_run(c, stream_closed, s, 20), 0);
    assert_int_equal(s->status, 413);
    s = h2_do(c, "GET", "/health", NULL);
    assert_int_equal(s->status, 200);
    assert_false(c->goaway);
    h2c_free(c);
    free(body);
}

/* More streams than SETTINGS_MAX_CONCURRENT_STREAMS (16) at once. A client
 * that knows the setting queues the rest: the engine never sees more than
 * 16 and all finish with the whole text. A client that opens them before
 * our SETTINGS arrived gets REFUSED_STREAM (safe to retry) beyond 16. */
static void test_many_streams(void **state) {
    script_text(&g_srv, "twenty tokens of text, more or less, for every stream", 2, 0.002);
    static const char body[] =
        "{\"prompt\":\"p\",\"stream\":true,\"stream_options\":{\"include_usage\":true},"
        "\"max_tokens\":4000}";
    enum { N = 48 };
    h2c_stream *s[N];
    for (int round = 0; round < 2; round++) {
        atomic_store(&g_srv.engine.max_active, 0);
        h2c *c = h2c_connect(g_srv.port, false, NULL, false);
        if (round == 0)
            assert_int_equal(h2c_run(c, got_settings, NULL, 5), 0);
        for (int i = 0; i < N; i++)
            s[i] = h2c_request(c, "POST", "/v1/completions", NULL, 0, body, strlen(body));
        assert_int_equal(h2c_run(c, NULL, NULL, 30), 0);
        int ok = 0, refused = 0;
        for (int i = 0; i < N; i++) {
            if (s[i]->error_code == NGHTTP2_REFUSED_STREAM && s[i]->status == 0) {
                refused++;
                continue;
            }
            assert_int_equal(s[i]->status, 200);
            assert_int_equal(s[i]->error_code, 0);
            char *sum = sse_summary(s[i]->body, s[i]->len);
            assert_non_null(
                strstr(sum, "0:twenty tokens of text, more or less, for every stream/stop"));
            free(sum);
            ok++;
        }
        if (round == 0) {
            assert_int_equal(ok, N);
        } else {
            assert_true(ok >= 16);
            assert_true(refused > 0);
            assert_int_equal(ok + refused, N);
        }
        int max_active = atomic_load(&g_srv.engine.max_active);
        assert_true(max_active <= 16);
        assert_true(max_active >= 2);
        h2c_free(c);
    }
}

/* RST_STREAM of one stream aborts its request only (engine->abort once);
 * the others on the connection finish whole. */
static void test_rst_stream(void **state) {
    script_long(&g_srv, 300, 0.005);
    int aborted0 = atomic_load(&g_srv.engine.n_aborted);
    h2c *c = h2c_connect(g_srv.port, false, NULL, false);
    static const char body[] = "{\"prompt\":\"p\",\"stream\":true,\"max_tokens\":60}";
    h2c_stream *s[4];
    for (int i = 0; i < 3; i++)
        s[i] = h2c_request(c, "POST", "/v1/completions", NULL, 0, body, strlen(body));
    s[3] = NULL;
    assert_int_equal(h2c_run(c, stream_has_data, s, 10), 0); /* all three streaming */
    h2c_rst(c, s[1], NGHTTP2_CANCEL);
    assert_int_equal(h2c_run(c, NULL, NULL, 20), 0);
    assert_int_equal(gwt_wait_atomic(&g_srv.engine.n_aborted, aborted0 + 1, 5), aborted0 + 1);
    assert_int_equal(s[1]->error_code, NGHTTP2_CANCEL);
    for (int i = 0; i < 3; i += 2) {
        assert_int_equal(s[i]->error_code, 0);
        char *sum = sse_summary(s[i]->body, s[i]->len);
        assert_non_null(strstr(sum, "/length"));
        free(sum);
    }
    usleep(50000);
    assert_int_equal(atomic_load(&g_srv.engine.n_aborted), aborted0 + 1);

    /* reset while the request waits for its first token (in the engine) */
    gwt_script sc = g_srv.engine.script;
    sc.first_delay_s = 0.3;
    gwt_engine_set(&g_srv.engine, &sc);
    int submitted0 = atomic_load(&g_srv.engine.n_submitted);
    h2c_stream *w = h2c_request(c, "POST", "/v1/completions", NULL, 0, body, strlen(body));
    h2c_stream *other = h2c_request(c, "POST", "/v1/completions", NULL, 0, body, strlen(body));
    for (int i = 0; i < 200 && atomic_load(&g_srv.engine.n_submitted) < submitted0 + 2; i++)
        h2c_run(c, stream_closed, w, 0.01);
    assert_int_equal(atomic_load(&g_srv.engine.n_submitted), submitted0 + 2);
    h2c_rst(c, w, NGHTTP2_CANCEL);
    assert_int_equal(h2c_run(c, NULL, NULL, 20), 0);
    assert_int_equal(gwt_wait_atomic(&g_srv.engine.n_aborted, aborted0 + 2, 5), aborted0 + 2);
    assert_int_equal(other->status, 200);
    assert_int_equal(other->error_code, 0);
    h2c_free(c);
    sc.first_delay_s = 0;
    gwt_engine_set(&g_srv.engine, &sc);
}

/* Rapid reset (CVE-2023-44487): a client that sends requests and resets
 * them at once, hundreds per second, gets GOAWAY(ENHANCE_YOUR_CALM); every
 * request it started is aborted or never reached the engine. */
/* Sends requests in rounds of 8, each reset at once (whole requests, or
 * HEADERS without END_STREAM: hanging), until the server's GOAWAY; asserts
 * ENHANCE_YOUR_CALM after at least GW_H2_MAX_RESETS(16) of them. */
static void reset_until_goaway(h2c *c, bool hanging) {
    static const char body[] = "{\"prompt\":\"p\",\"stream\":true,\"max_tokens\":4000}";
    assert_int_equal(h2c_run(c, got_settings, NULL, 5), 0);
    int sent = 0;
    for (int round = 0; round < 60 && !c->goaway && !c->eof; round++) {
        h2c_stream *s[8];
        for (int i = 0; i < 8; i++)
            s[i] = hanging ? h2c_request_hanging(c, "POST", "/v1/completions")
                           : h2c_request(c, "POST", "/v1/completions", NULL, 0, body, strlen(body));
        nghttp2_session_send(c->ng);
        for (int i = 0; i < 8; i++)
            nghttp2_submit_rst_stream(c->ng, NGHTTP2_FLAG_NONE, s[i]->id, NGHTTP2_CANCEL);
        sent += 8;
        h2c_run(c, got_goaway, NULL, 0.001);
    }
    assert_int_equal(h2c_run(c, got_goaway, NULL, 5), 0);
    assert_int_equal(c->goaway_code, NGHTTP2_ENHANCE_YOUR_CALM);
    assert_true(sent >= 2 * 16 + 100); /* gw_http2.c GW_H2_MAX_RESETS(16) */
}

static void test_rapid_reset(void **state) {
    script_long(&g_srv, 300, 0.005);
    h2c *c = h2c_connect(g_srv.port, false, NULL, false);
    reset_until_goaway(c, false);
    h2c_free(c);
    /* nothing left running in the engine, and the server is fine */
    for (int i = 0; i < 500 && atomic_load(&g_srv.engine.n_active) > 0; i++)
        usleep(10000);
    assert_int_equal(atomic_load(&g_srv.engine.n_active), 0);
    c = h2c_connect(g_srv.port, false, NULL, false);
    h2c_stream *ok = h2_do(c, "GET", "/health", NULL);
    assert_int_equal(ok->status, 200);
    h2c_free(c);
    /* the same with requests reset while still sending their body (HEADERS
     * without END_STREAM): they count too (helper-53) */
    c = h2c_connect(g_srv.port, false, NULL, false);
    reset_until_goaway(c, true);
    h2c_free(c);
    c = h2c_connect(g_srv.port, false, NULL, false);
    ok = h2_do(c, "GET", "/health", NULL);
    assert_int_equal(ok->status, 200);
    h2c_free(c);
}

/* Upgrade: h2c from HTTP/1.1 (GET and POST with a body); a bad
 * HTTP2-Settings or another protocol is served on HTTP/1.1. */
static void test_upgrade(void **state) {
    h2c_stream *s1 = NULL;
    int status = 0;
    h2c *c = h2c_upgrade(g_srv.port, "GET", "/health", NULL, &s1, &status);
    assert_int_equal(status, 101);
    assert_non_null(c);
    assert_int_equal(h2c_run(c, stream_closed, s1, 10), 0);
    assert_int_equal(s1->status, 200);
    assert_string_equal(s1->body, "ok");
    assert_true(c->got_settings);
    /* the connection is h2 now: more streams */
    script_text(&g_srv, UTF8_TEXT, 2, 0.001);
    h2c_stream *s = h2_do(c, "POST", "/v1/completions", COMPLETION_BODY);
    assert_int_equal(s->status, 200);
    int st1;
    char *b1 = h1_post(g_srv.port, "/v1/completions", COMPLETION_BODY, &st1);
    char *n1 = normalized(b1), *n2 = normalized(s->body);
    assert_string_equal(n1, n2);
    free(n2);
    h2c_free(c);

    /* POST with a body: the request itself becomes stream 1 */
    c = h2c_upgrade(g_srv.port, "POST", "/v1/completions", COMPLETION_BODY, &s1, &status);
    assert_non_null(c);
    assert_int_equal(h2c_run(c, stream_closed, s1, 10), 0);
    assert_int_equal(s1->status, 200);
    n2 = normalized(s1->body);
    assert_string_equal(n1, n2);
    free(n1);
    free(n2);
    free(b1);
    h2c_free(c);

    /* bad settings, websocket: plain HTTP/1.1 answers */
    static const char *const reqs[] = {
        "GET /health HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        "Upgrade: h2c\r\nHTTP2-Settings: !!notbase64!!\r\n\r\n",
        "GET /health HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        "Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQ\r\n\r\n", /* 7 bytes: not 6k */
        "GET /health HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"};
    for (size_t i = 0; i < sizeof reqs / sizeof *reqs; i++) {
        gwt_conn *h = gwt_open(g_srv.port);
        gwt_send(h, reqs[i], strlen(reqs[i]));
        gwt_resp r;
        assert_int_equal(gwt_read(h, &r), 0);
        assert_int_equal(r.status, 200);
        assert_string_equal(r.body, "ok");
        gwt_resp_free(&r);
        /* and the connection still speaks HTTP/1.1 */
        gwt_sendf(h, "GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
        assert_int_equal(gwt_read(h, &r), 0);
        assert_int_equal(r.status, 200);
        gwt_resp_free(&r);
        gwt_close(h);
    }
}

/* ---- back-pressure: a stalled reader --------------------------------------- */

/* Deadlines of waits for what must happen, in a sanitizer build
 * (PD_SANITIZE: ASan with UBSan), which makes the gateway and the fake
 * engine several times slower, more on a loaded machine. The waits poll,
 * so a longer deadline costs nothing when the gateway does what it should;
 * what a test bounds is timed apart. */
#if defined(__SANITIZE_ADDRESS__)
#define GWT_SLOW 4
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GWT_SLOW 4
#endif
#endif
#ifndef GWT_SLOW
#define GWT_SLOW 1
#endif

/* A gateway for test_stalled_reader: a 1 KiB output high-water mark, the
 * write timeout given (0: none), the fake engine 2000 "word" tokens long,
 * 8 a tick. */
static void stall_server(gwt_server *h, double timeout_write_s) {
    pd_gw_config cfg;
    gwt_config(&cfg);
    cfg.output_high_water_bytes = 1024;
    cfg.timeout_write_s = timeout_write_s;
    assert_int_equal(gwt_server_start(h, &cfg), 0);
    script_long(h, 2000, 0.0005);
    gwt_script sc = h->engine.script;
    sc.batch = 8;
    gwt_engine_set(&h->engine, &sc);
}

/* The client stops reading one stream (its window stays closed) while the
 * engine keeps generating: the gateway holds a bounded amount (16 × the
 * 1 KiB high-water mark here) and then resets that stream (CANCEL) and
 * aborts its request; another stream on the same connection is unaffected.
 * HTTP/1.1 has the same bound (the connection is dropped). Both on a
 * gateway without a write timeout, which would otherwise cut the stalled
 * reader off too and hide a bound that does not hold. A finished response
 * that stops moving is reset after timeout_write_s. The deadlines are
 * GWT_SLOW times longer in a sanitizer build; how soon the stalled response
 * is reset is timed from its last DATA (the gateway's last progress), not
 * from the request, whose generation takes what the machine gives it. */
static void test_stalled_reader(void **state) {
    gwt_server h;
    stall_server(&h, 0);
    h2c *c = h2c_connect(h.port, false, NULL, true);
    static const char body[] = "{\"prompt\":\"p\",\"stream\":true,\"logprobs\":1,\"max_tokens\":4000}";
    h2c_stream *stalled = h2c_request(c, "POST", "/v1/completions", NULL, 0, body, strlen(body));
    stalled->stall = true;
    static const char small[] = "{\"prompt\":\"p\",\"stream\":true,\"max_tokens\":50}";
    h2c_stream *fine = h2c_request(c, "POST", "/v1/completions", NULL, 0, small, strlen(small));
    assert_int_equal(h2c_run(c, stream_closed, stalled, 20 * GWT_SLOW), 0);
    assert_int_equal(stalled->error_code, NGHTTP2_CANCEL);
    /* it got what its window allowed: 64 KiB, not the whole response */
    assert_true(stalled->len <= 65535);
    assert_int_equal(gwt_wait_atomic(&h.engine.n_aborted, 1, 5 * GWT_SLOW), 1);
    assert_int_equal(h2c_run(c, stream_closed, fine, 20 * GWT_SLOW), 0);
    assert_int_equal(fine->error_code, 0);
    char *sum = sse_summary(fine->body, fine->len);
    assert_non_null(strstr(sum, "/length"));
    free(sum);
    h2c_free(c);

    /* HTTP/1.1: a streamed response nobody reads (a small receive buffer,
     * never read) is dropped with its connection once the unsent output
     * passes the bound; the request is aborted */
    int ab0 = atomic_load(&h.engine.n_aborted);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int small_buf = 4096;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small_buf, sizeof small_buf);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)h.port)};
    sa.sin_addr.s_addr = htonl(0x7f000001);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    static const char big_stream[] = "{\"prompt\":\"p\",\"stream\":true,\"logprobs\":1,\"n\":16,\"max_tokens\":4000}";
    char req[512];
    int rl =
        snprintf(req, sizeof req,
                 "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 "Content-Length: %zu\r\n\r\n%s",
                 strlen(big_stream), big_stream);
    assert_int_equal(send(fd, req, (size_t)rl, MSG_NOSIGNAL), rl);
    assert_int_equal(gwt_wait_atomic(&h.engine.n_aborted, ab0 + 1, 20 * GWT_SLOW), ab0 + 1);
    close(fd);
    gwt_server_stop(&h);

    /* a whole (non-streamed) response that the client stops taking: after
     * timeout_write_s without progress the stream is reset; the connection
     * goes on. The response arrives whole (h2_respond), is sent up to the
     * stream's window, and then makes no progress: the reset follows the
     * last DATA by timeout_write_s, give or take the event loop's delay. */
    const double timeout_write_s = 0.5;
    stall_server(&h, timeout_write_s);
    c = h2c_connect(h.port, false, NULL, true);
    static const char whole[] = "{\"prompt\":\"p\",\"logprobs\":1,\"n\":4,\"max_tokens\":4000}"; /* ~300 KB */
    stalled = h2c_request(c, "POST", "/v1/completions", NULL, 0, whole, strlen(whole));
    stalled->stall = true;
    assert_int_equal(h2c_run(c, stream_closed, stalled, 20 * GWT_SLOW), 0);
    assert_int_equal(stalled->status, 200);
    assert_int_equal(stalled->error_code, NGHTTP2_CANCEL);
    assert_true(stalled->len > 0 && stalled->len <= 65535);
    double reset_after = stalled->t_closed - stalled->t_data;
    if (!(reset_after < timeout_write_s + 2))
        fail_msg("the stalled response was reset %.3f s after its last DATA (timeout_write_s %g)",
                 reset_after, timeout_write_s);
    h2c_stream *after = h2c_request(c, "GET", "/health", NULL, 0, NULL, 0);
    assert_int_equal(h2c_run(c, stream_closed, after, 5 * GWT_SLOW), 0);
    assert_int_equal(after->status, 200);
    h2c_free(c);
    gwt_server_stop(&h);
}

/* ---- limits and timeouts ------------------------------------------------------- */

static void test_limits_and_timeouts(void **state) {
    gwt_server h;
    pd_gw_config cfg;
    gwt_config(&cfg);
    cfg.timeout_keep_alive_s = 0.4;
    cfg.timeout_request_headers_s = 0.4;
    cfg.timeout_request_body_s = 0.4;
    cfg.max_header_count = 20;
    assert_int_equal(gwt_server_start(&h, &cfg), 0);
    h2c *c = h2c_connect(h.port, false, NULL, false);

    /* too many headers: 431 on that stream, the connection goes on */
    h2c_hdr hs[30];
    char names[30][16];
    for (int i = 0; i < 30; i++) {
        snprintf(names[i], sizeof names[i], "x-h-%d", i);
        hs[i] = (h2c_hdr){names[i], "v"};
    }
    h2c_stream *s = h2c_request(c, "GET", "/health", hs, 30, NULL, 0);
    assert_int_equal(h2c_run(c, stream_closed, s, 5), 0);
    assert_int_equal(s->status, 431);
    s = h2_do(c, "GET", "/health", NULL);
    assert_int_equal(s->status, 200);

    /* a body that never ends: 408 after timeout_request_body_s, then reset */
    s = h2c_request_hanging(c, "POST", "/v1/completions");
    assert_int_equal(h2c_run(c, stream_closed, s, 5), 0);
    assert_int_equal(s->status, 408);

    /* idle: GOAWAY(NO_ERROR), then the connection closes */
    double t0 = pd_now_s();
    assert_int_equal(h2c_run(c, got_goaway, NULL, 3), 0);
    assert_int_equal(c->goaway_code, NGHTTP2_NO_ERROR);
    for (int i = 0; i < 100 && !c->eof; i++)
        h2c_run(c, NULL, NULL, 0.02);
    assert_true(c->eof || !nghttp2_session_want_read(c->ng));
    assert_true(pd_now_s() - t0 < 2.5);
    h2c_free(c);
    gwt_server_stop(&h);
}

/* ---- TLS ---------------------------------------------------------------------- */

static void make_cert(const char *dir, const char *name) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
             "-keyout %s/%s.key -out %s/%s.crt -days 2 -subj /CN=localhost "
             "-addext subjectAltName=IP:127.0.0.1 >/dev/null 2>&1",
             dir, name, dir, name);
    assert_int_equal(system(cmd), 0);
}

/* HTTP/1.1 over the TLS connection of c (ALPN http/1.1 or none). */
static char *tls_h1_get(h2c *c, const char *path) {
    char req[256];
    snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", path);
    assert_true(SSL_write(c->ssl, req, (int)strlen(req)) > 0);
    size_t cap = 8192, len = 0;
    char *out = malloc(cap);
    int r;
    while ((r = SSL_read(c->ssl, out + len, (int)(cap - len - 1))) > 0)
        len += (size_t)r;
    out[len] = 0;
    return out;
}

static void test_tls(void **state) {
    make_cert(g_tmp, "srv");
    make_cert(g_tmp, "other");
    char crt[512], key[512], okey[512];
    snprintf(crt, sizeof crt, "%s/srv.crt", g_tmp);
    snprintf(key, sizeof key, "%s/srv.key", g_tmp);
    snprintf(okey, sizeof okey, "%s/other.key", g_tmp);

    /* configuration errors */
    pd_gw_config cfg;
    gwt_config(&cfg);
    pd_gw_server *srv = NULL;
    pd_err err;
    struct event_base *base = event_base_new();
    cfg.ssl_certfile = crt;
    assert_int_equal(pd_gw_server_init(base, &cfg, &gwt_engine_i, NULL, &srv, &err),
                     PD_ERR_INVALID);
    cfg.ssl_keyfile = "/nonexistent/key.pem";
    assert_int_equal(pd_gw_server_init(base, &cfg, &gwt_engine_i, NULL, &srv, &err), PD_ERR_IO);
    assert_non_null(strstr(err.msg, "--ssl-keyfile"));
    cfg.ssl_keyfile = okey;
    assert_int_equal(pd_gw_server_init(base, &cfg, &gwt_engine_i, NULL, &srv, &err), PD_ERR_IO);
    assert_non_null(strstr(err.msg, "mismatch") ? err.msg : strstr(err.msg, "does not match"));
    assert_null(srv);
    event_base_free(base);

    gwt_server h;
    cfg.ssl_keyfile = key;
    assert_int_equal(gwt_server_start(&h, &cfg), 0);
    script_text(&h, UTF8_TEXT, 2, 0.001);

    /* ALPN h2 */
    h2c *c = h2c_connect(h.port, true, "\x02h2\x08http/1.1", false);
    assert_non_null(c);
    assert_string_equal(c->alpn, "h2");
    h2c_stream *s = h2_do(c, "GET", "/health", NULL);
    assert_int_equal(s->status, 200);
    assert_string_equal(s->body, "ok");
    s = h2_do(c, "POST", "/v1/completions", COMPLETION_BODY);
    assert_int_equal(s->status, 200);
    char *tls_h2 = normalized(s->body);
    s = h2_do(c, "POST", "/v1/chat/completions", CHAT_STREAM_BODY);
    assert_int_equal(s->status, 200);
    char *sum = sse_summary(s->body, s->len);
    assert_non_null(strstr(sum, UTF8_TEXT "/stop"));
    free(sum);
    h2c_free(c);

    /* ALPN http/1.1, and no ALPN at all (the first bytes decide) */
    c = h2c_connect(h.port, true, "\x08http/1.1", false);
    assert_string_equal(c->alpn, "http/1.1");
    char *resp = tls_h1_get(c, "/health");
    assert_true(strncmp(resp, "HTTP/1.1 200", 12) == 0);
    assert_non_null(strstr(resp, "\r\n\r\nok"));
    free(resp);
    h2c_free(c);
    c = h2c_connect(h.port, true, NULL, false);
    assert_string_equal(c->alpn, "");
    resp = tls_h1_get(c, "/health");
    assert_true(strncmp(resp, "HTTP/1.1 200", 12) == 0);
    free(resp);
    h2c_free(c);
    c = h2c_connect(h.port, true, NULL, false); /* h2 preface without ALPN */
    s = h2_do(c, "GET", "/health", NULL);
    assert_int_equal(s->status, 200);
    h2c_free(c);
    /* Upgrade: h2c is not honoured under TLS */
    c = h2c_connect(h.port, true, "\x08http/1.1", false);
    static const char up[] = "GET /health HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, "
                             "HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABk\r\n\r\n";
    assert_true(SSL_write(c->ssl, up, (int)strlen(up)) > 0);
    char buf[512];
    int r = SSL_read(c->ssl, buf, sizeof buf - 1);
    assert_true(r > 12);
    assert_true(strncmp(buf, "HTTP/1.1 200", 12) == 0);
    h2c_free(c);
    /* cleartext on the TLS port: no answer, closed */
    gwt_conn *plain = gwt_open(h.port);
    gwt_sendf(plain, "GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
    gwt_resp rr;
    assert_int_equal(gwt_read(plain, &rr), -1);
    gwt_close(plain);

    /* curl over TLS: h2 (ALPN) and HTTP/1.1, the same content as our client */
    if (have_program("curl")) {
        char cmd[2048];
        int st;
        snprintf(cmd, sizeof cmd,
                 "curl -sS --http2 --cacert %s -w '\\n%%{http_version}' "
                 "https://127.0.0.1:%d/v1/completions -H 'Content-Type: application/json' "
                 "-d '%s'",
                 crt, h.port, COMPLETION_BODY);
        char *out = run_cmd(cmd, &st);
        assert_int_equal(st, 0);
        char *nl = strrchr(out, '\n');
        assert_non_null(nl);
        assert_string_equal(nl + 1, "2");
        *nl = 0;
        char *n = normalized(out);
        assert_string_equal(n, tls_h2);
        free(n);
        free(out);
        snprintf(cmd, sizeof cmd,
                 "curl -sS --http1.1 -k -w '\\n%%{http_version}' "
                 "https://127.0.0.1:%d/v1/completions -H 'Content-Type: application/json' "
                 "-d '%s'",
                 h.port, COMPLETION_BODY);
        out = run_cmd(cmd, &st);
        assert_int_equal(st, 0);
        nl = strrchr(out, '\n');
        assert_string_equal(nl + 1, "1.1");
        *nl = 0;
        n = normalized(out);
        assert_string_equal(n, tls_h2);
        free(n);
        free(out);
    }
    free(tls_h2);
    gwt_server_stop(&h);
}

/* The server stops right after a TLS connection wrote. libevent's OpenSSL
 * bufferevent queues its write callback as a deferred callback after each
 * write, and that callback holds a reference to the bufferevent until it
 * runs. Here the loop breaks inside the write itself (a callback on the
 * connection's output buffer, which the write drains), so that callback is
 * still queued when pd_gw_server_free frees the open connection and
 * event_base_free drops the queue. The socket and the SSL must still be
 * released: the client sees the connection closed, and the LeakSanitizer
 * run finds nothing. */
static void stop_on_drain_cb(struct evbuffer *buf, const struct evbuffer_cb_info *info,
                             void *arg) {
    if (info->n_deleted > 0)
        event_base_loopbreak(arg);
}

/* GET /stop: "bye", and the loop breaks once the answer is being written. */
static int stop_route(void *ctx, const char *path, const char *query, struct evbuffer *body,
                      const char **ctype) {
    gwt_server *h = ctx;
    gw_conn *c = h->srv->conns; /* the newest connection: the only one */
    evbuffer_add_cb(bufferevent_get_output(c->bev), stop_on_drain_cb, h->base);
    evbuffer_add(body, "bye", 3);
    return 200;
}

static void stop_setup(pd_gw_server *srv, void *ud) {
    pd_err err;
    assert_int_equal(pd_gw_server_add_get(srv, "/stop", stop_route, ud, &err), PD_OK);
}

/* True when the peer closed c within timeout_s (EOF, with or without
 * close_notify). */
static bool tls_peer_closed(h2c *c, double timeout_s) {
    double t_end = pd_now_s() + timeout_s;
    char buf[4096];
    for (;;) {
        if (SSL_pending(c->ssl) == 0) {
            int ms = (int)((t_end - pd_now_s()) * 1000);
            struct pollfd p = {.fd = c->fd, .events = POLLIN};
            if (ms <= 0 || poll(&p, 1, ms) <= 0)
                return false;
        }
        if (SSL_read(c->ssl, buf, sizeof buf) <= 0)
            return true;
    }
}

static void test_tls_stop_after_write(void **state) {
    make_cert(g_tmp, "stop");
    char crt[512], key[512];
    snprintf(crt, sizeof crt, "%s/stop.crt", g_tmp);
    snprintf(key, sizeof key, "%s/stop.key", g_tmp);
    static const char *const alpns[] = {"\x08http/1.1", "\x02h2"};
    for (int i = 0; i < 2; i++) {
        pd_gw_config cfg;
        gwt_config(&cfg);
        cfg.ssl_certfile = crt;
        cfg.ssl_keyfile = key;
        gwt_server h;
        assert_int_equal(gwt_server_start_setup(&h, &cfg, stop_setup, &h), 0);
        h2c *c = h2c_connect(h.port, true, alpns[i], false);
        assert_non_null(c);
        if (i == 0) {
            /* keep-alive: the server keeps the connection open after answering */
            static const char req[] = "GET /stop HTTP/1.1\r\nHost: t\r\n\r\n";
            assert_true(SSL_write(c->ssl, req, (int)strlen(req)) > 0);
            char resp[4096];
            size_t len = 0;
            while (!memmem(resp, len, "\r\n\r\nbye", 7)) {
                int r = SSL_read(c->ssl, resp + len, (int)(sizeof resp - len));
                assert_true(r > 0);
                len += (size_t)r;
            }
            assert_true(strncmp(resp, "HTTP/1.1 200", 12) == 0);
        } else {
            assert_string_equal(c->alpn, "h2");
            h2c_stream *s = h2_do(c, "GET", "/stop", NULL);
            assert_int_equal(s->status, 200);
            assert_string_equal(s->body, "bye");
        }
        gwt_server_stop(&h); /* the loop already stopped in the write */
        assert_true(tls_peer_closed(c, 5));
        h2c_free(c);
    }
}

/* ---- real clients ---------------------------------------------------------------- */

static void test_real_clients(void **state) {
    if (!have_program("curl")) {
        fprintf(stderr, "curl is required (deploy/install-deps.sh installs it)\n");
        fail();
    }
    script_text(&g_srv, UTF8_TEXT, 2, 0.001);
    int st;
    char *h1 = h1_post(g_srv.port, "/v1/completions", COMPLETION_BODY, &st);
    char *want = normalized(h1);
    free(h1);
    static const char *const modes[] = {"--http2-prior-knowledge", "--http2", "--http1.1"};
    static const char *const versions[] = {"2", "2", "1.1"};
    for (int m = 0; m < 3; m++) {
        char cmd[2048];
        snprintf(cmd, sizeof cmd,
                 "curl -sS %s -w '\\n%%{http_version}' http://127.0.0.1:%d/v1/completions "
                 "-H 'Content-Type: application/json' -d '%s'",
                 modes[m], g_srv.port, COMPLETION_BODY);
        char *out = run_cmd(cmd, &st);
        assert_int_equal(st, 0);
        char *nl = strrchr(out, '\n');
        assert_non_null(nl);
        if (strcmp(nl + 1, versions[m]) != 0)
            fprintf(stderr, "curl %s: HTTP version %s\n", modes[m], nl + 1);
        assert_string_equal(nl + 1, versions[m]);
        *nl = 0;
        char *got = normalized(out);
        assert_string_equal(got, want);
        free(got);
        free(out);
        /* streamed */
        snprintf(cmd, sizeof cmd,
                 "curl -sS -N %s http://127.0.0.1:%d/v1/chat/completions "
                 "-H 'Content-Type: application/json' -d '%s'",
                 modes[m], g_srv.port, CHAT_STREAM_BODY);
        out = run_cmd(cmd, &st);
        assert_int_equal(st, 0);
        char *sum = sse_summary(out, strlen(out));
        assert_non_null(strstr(sum, "0:" UTF8_TEXT "/stop 1:" UTF8_TEXT "/stop"));
        free(sum);
        free(out);
    }
    free(want);

    /* a 1 MiB body with curl over h2c (upgrade and prior knowledge) */
    char *big = big_chat_body(1u << 20);
    char path[512];
    snprintf(path, sizeof path, "%s/big.json", g_tmp);
    write_file(path, big, strlen(big));
    free(big);
    for (int m = 0; m < 2; m++) {
        char cmd[2048];
        snprintf(cmd, sizeof cmd,
                 "curl -sS %s -o /dev/null -w '%%{http_code} %%{http_version}' "
                 "http://127.0.0.1:%d/v1/chat/completions -H 'Content-Type: application/json' "
                 "--data-binary @%s",
                 modes[m], g_srv.port, path);
        char *out = run_cmd(cmd, &st);
        assert_int_equal(st, 0);
        assert_string_equal(out, "200 2");
        free(out);
    }

    /* h2load: many concurrent streams on few connections */
    if (!have_program("h2load")) {
        fprintf(stderr, "h2load not found (nghttp2-client): skipping its part\n");
        return;
    }
    script_text(&g_srv, "short answer", 2, 0.001);
    snprintf(path, sizeof path, "%s/h2load.json", g_tmp);
    write_file(path, COMPLETION_BODY, strlen(COMPLETION_BODY));
    atomic_store(&g_srv.engine.max_active, 0);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "h2load -n 200 -c 2 -m 16 -d %s -H 'content-type: application/json' "
             "http://127.0.0.1:%d/v1/completions 2>&1",
             path, g_srv.port);
    char *out = run_cmd(cmd, &st);
    if (st != 0 || !strstr(out, "200 succeeded, 0 failed, 0 errored"))
        fprintf(stderr, "%s\n", out);
    assert_int_equal(st, 0);
    assert_non_null(strstr(out, "200 succeeded, 0 failed, 0 errored"));
    assert_non_null(strstr(out, "status codes: 200 2xx"));
    free(out);
    assert_true(atomic_load(&g_srv.engine.max_active) > 2); /* streams ran concurrently */
}

/* ---- runner ------------------------------------------------------------------------ */

static int setup(void **state) {
    signal(SIGPIPE, SIG_IGN);
    if (!gwt_tokenizer())
        return -1;
    snprintf(g_tmp, sizeof g_tmp, "/tmp/pd_gw_h2_XXXXXX");
    if (!mkdtemp(g_tmp))
        return -1;
    pd_gw_config cfg;
    gwt_config(&cfg);
    cfg.max_concurrent_streams = 16;
    cfg.max_request_body_bytes = 2u << 20;
    return gwt_server_start(&g_srv, &cfg);
}

static int teardown(void **state) {
    gwt_server_stop(&g_srv);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_tmp);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prior_knowledge),
        cmocka_unit_test(test_large_bodies),
        cmocka_unit_test(test_many_streams),
        cmocka_unit_test(test_rst_stream),
        cmocka_unit_test(test_rapid_reset),
        cmocka_unit_test(test_upgrade),
        cmocka_unit_test(test_stalled_reader),
        cmocka_unit_test(test_limits_and_timeouts),
        cmocka_unit_test(test_tls),
        cmocka_unit_test(test_tls_stop_after_write),
        cmocka_unit_test(test_real_clients),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

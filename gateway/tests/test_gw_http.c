/* End-to-end tests of the gateway over a real listening socket: a fake engine
 * (gw_test_util.c) emits scripted token ids from a libevent timer; a raw
 * HTTP/1.1 client writes requests byte for byte. Covers the connection layer
 * (keep-alive, pipelining, chunked bodies, Expect, limits, timeouts,
 * back-pressure), the endpoints and errors, the OpenAI response shapes
 * (streamed and not), stop strings, UTF-8 integrity, usage, engine errors and
 * aborts on disconnect, and tokenization off the event loop. */
/* Single-source test (one executable per tests/test_*.c): the helpers are
 * compiled in here, first, because they define _GNU_SOURCE. */
#include "gw_test_util.c"

#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>
#include <event2/buffer.h>
#include <jansson.h>

#include "pd_version.h"

static gwt_server g_srv;

/* A text whose multi-byte characters (2, 3 and 4 bytes) are split across
 * tokens when spelled byte by byte. */
#define UTF8_TEXT "Grüße, 世界! Ça va? 🎉🎊 naïve — ok"

/* ---- helpers ---------------------------------------------------------------- */

static json_t *jparse(const char *s) {
    json_error_t e;
    json_t *j = json_loads(s, 0, &e); /* strict: invalid UTF-8 is an error */
    if (!j)
        fprintf(stderr, "bad JSON (%s): %.300s\n", e.text, s);
    assert_non_null(j);
    return j;
}

static void script_bytes(const char *text, int batch, double interval) {
    int n = 0;
    int32_t *ids = gwt_ids_bytewise(text, &n);
    gwt_script s = gwt_script_ids(ids, n);
    s.batch = batch;
    s.interval_s = interval;
    gwt_engine_set(&g_srv.engine, &s);
    free(ids);
}

/* POST body to path and parse the JSON response (status checked). */
static json_t *post_json(const char *path, const char *body, int want_status) {
    gwt_resp r;
    assert_int_equal(gwt_post(g_srv.port, path, body, &r), 0);
    if (r.status != want_status)
        fprintf(stderr, "status %d: %s\n", r.status, r.body);
    assert_int_equal(r.status, want_status);
    json_t *j = jparse(r.body);
    gwt_resp_free(&r);
    return j;
}

/* An OpenAI error body with this status and param (NULL: null). */
static void check_error(const char *path, const char *body, int status, const char *param) {
    json_t *j = post_json(path, body, status);
    json_t *e = json_object_get(j, "error");
    assert_non_null(e);
    assert_true(json_is_string(json_object_get(e, "message")));
    assert_true(json_is_string(json_object_get(e, "type")));
    assert_int_equal(json_integer_value(json_object_get(e, "code")), status);
    json_t *p = json_object_get(e, "param");
    if (param) {
        assert_true(json_is_string(p));
        assert_string_equal(json_string_value(p), param);
    } else {
        assert_true(json_is_null(p));
    }
    json_decref(j);
}

typedef struct {
    gwt_sse sse;
    json_t **ev; /* parsed events (all but [DONE]) */
    int n_ev;
    bool done_last;
    int n_http_chunks;
    char *text[4]; /* concatenated text per choice index */
} stream_result;

static void stream_post(const char *path, const char *body, stream_result *sr) {
    memset(sr, 0, sizeof *sr);
    gwt_resp r;
    assert_int_equal(gwt_post(g_srv.port, path, body, &r), 0);
    assert_int_equal(r.status, 200);
    char ct[128];
    assert_non_null(gwt_header(&r, "Content-Type", ct, sizeof ct));
    assert_non_null(strstr(ct, "text/event-stream"));
    assert_true(r.chunked);
    sr->n_http_chunks = r.n_chunks;
    assert_true(pd_tok_utf8_valid(r.body, r.body_len));
    gwt_sse_parse(r.body, r.body_len, &sr->sse);
    assert_int_equal(sr->sse.bad, 0); /* no "event:" or other lines */
    assert_true(sr->sse.n >= 1);
    sr->done_last = strcmp(sr->sse.data[sr->sse.n - 1], "[DONE]") == 0;
    sr->ev = calloc((size_t)sr->sse.n, sizeof *sr->ev);
    for (int i = 0; i < sr->sse.n; i++) {
        if (strcmp(sr->sse.data[i], "[DONE]") == 0) {
            assert_int_equal(i, sr->sse.n - 1); /* nothing after [DONE] */
            continue;
        }
        assert_true(pd_tok_utf8_valid(sr->sse.data[i], strlen(sr->sse.data[i])));
        sr->ev[sr->n_ev++] = jparse(sr->sse.data[i]);
    }
    for (int k = 0; k < 4; k++)
        sr->text[k] = calloc(1, 1);
    for (int i = 0; i < sr->n_ev; i++) {
        json_t *choices = json_object_get(sr->ev[i], "choices");
        size_t k;
        json_t *c;
        json_array_foreach(choices, k, c) {
            int idx = (int)json_integer_value(json_object_get(c, "index"));
            assert_true(idx >= 0 && idx < 4);
            json_t *t = json_object_get(c, "text");
            json_t *d = json_object_get(c, "delta");
            if (d)
                t = json_object_get(d, "content");
            if (json_is_string(t)) {
                size_t a = strlen(sr->text[idx]), b = json_string_length(t);
                sr->text[idx] = realloc(sr->text[idx], a + b + 1);
                memcpy(sr->text[idx] + a, json_string_value(t), b + 1);
            }
        }
    }
    gwt_resp_free(&r);
}

static void stream_free(stream_result *sr) {
    for (int i = 0; i < sr->n_ev; i++)
        json_decref(sr->ev[i]);
    free(sr->ev);
    for (int k = 0; k < 4; k++)
        free(sr->text[k]);
    gwt_sse_free(&sr->sse);
}

static json_t *choice0(json_t *ev) {
    return json_array_get(json_object_get(ev, "choices"), 0);
}

static int n_prompt_tokens(const char *prompt) {
    int n = 0;
    int32_t *ids = gwt_ids_encode(prompt, &n);
    free(ids);
    return n + 1; /* BOS */
}

/* ---- endpoints ---------------------------------------------------------------- */

static void test_health_and_models(void **state) {
    gwt_resp r;
    assert_int_equal(gwt_get(g_srv.port, "/health", &r), 0);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.body, "ok");
    gwt_resp_free(&r);

    assert_int_equal(gwt_get(g_srv.port, "/v1/models", &r), 0);
    assert_int_equal(r.status, 200);
    json_t *j = jparse(r.body);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "list");
    json_t *m = json_array_get(json_object_get(j, "data"), 0);
    assert_string_equal(json_string_value(json_object_get(m, "id")), "test-model");
    assert_string_equal(json_string_value(json_object_get(m, "object")), "model");
    json_decref(j);
    gwt_resp_free(&r);

    assert_int_equal(gwt_get(g_srv.port, "/v1/models/test-model", &r), 0);
    assert_int_equal(r.status, 200);
    gwt_resp_free(&r);
    /* the id percent-encoded, as SDKs escape path parameters ("-" is %2D) */
    assert_int_equal(gwt_get(g_srv.port, "/v1/models/test%2dmodel", &r), 0);
    assert_int_equal(r.status, 200);
    gwt_resp_free(&r);
    assert_int_equal(gwt_get(g_srv.port, "/v1/models/nope", &r), 0);
    assert_int_equal(r.status, 404);
    gwt_resp_free(&r);
    const char *bad[] = {"/v1/models/test%2", "/v1/models/test%zzmodel", "/v1/models/test-model%00"};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(gwt_get(g_srv.port, bad[i], &r), 0);
        assert_int_equal(r.status, 404);
        gwt_resp_free(&r);
    }

    /* HEAD: headers only, then the connection serves the next request */
    gwt_conn *c = gwt_open(g_srv.port);
    gwt_sendf(c, "HEAD /health HTTP/1.1\r\nHost: t\r\n\r\nGET /health HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_int_equal(gwt_read_head(c, &r), 0);
    assert_int_equal(r.status, 200);
    char v[32];
    assert_string_equal(gwt_header(&r, "Content-Length", v, sizeof v), "2");
    gwt_resp_free(&r);
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.body, "ok");
    gwt_resp_free(&r);
    gwt_close(c);
}

/* /tokenize, /detokenize and /version over HTTP: the shapes, a round trip,
 * errors as OpenAI bodies, 405 for GET on the POST ones, 415 for another
 * Content-Type. (The rules themselves: test_gw_openai.) */
static void test_tokenize_endpoints(void **state) {
    json_t *a = post_json("/tokenize",
                          "{\"model\":\"test-model\",\"prompt\":\"" UTF8_TEXT "\","
                          "\"add_special_tokens\":false}",
                          200);
    json_t *toks = json_object_get(a, "tokens");
    assert_int_equal(json_integer_value(json_object_get(a, "count")),
                     (json_int_t)json_array_size(toks));
    assert_int_equal(json_array_size(toks) + 1, (size_t)n_prompt_tokens(UTF8_TEXT)); /* no BOS */
    assert_true(json_is_integer(json_object_get(a, "max_model_len")));
    json_t *db = json_pack("{s:O}", "tokens", toks);
    char *body = json_dumps(db, 0);
    json_decref(db);
    json_t *d = post_json("/detokenize", body, 200);
    free(body);
    assert_string_equal(json_string_value(json_object_get(d, "prompt")), UTF8_TEXT);
    json_decref(d);
    json_decref(a);

    check_error("/tokenize", "{\"prompt\":", 400, NULL);
    check_error("/tokenize", "{\"prompt\":\"x\",\"model\":\"nope\"}", 404, "model");
    check_error("/detokenize", "{\"tokens\":[999999999]}", 400, "tokens");

    gwt_resp r;
    assert_int_equal(gwt_get(g_srv.port, "/tokenize", &r), 0);
    assert_int_equal(r.status, 405);
    char allow[32];
    assert_string_equal(gwt_header(&r, "Allow", allow, sizeof allow), "POST");
    gwt_resp_free(&r);
    gwt_conn *c = gwt_open(g_srv.port);
    gwt_sendf(c, "POST /detokenize HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\n"
                 "Content-Length: 13\r\n\r\n{\"tokens\":[]}");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 415);
    gwt_resp_free(&r);
    gwt_close(c);

    assert_int_equal(gwt_get(g_srv.port, "/version", &r), 0);
    assert_int_equal(r.status, 200);
    json_t *v = jparse(r.body);
    assert_string_equal(json_string_value(json_object_get(v, "version")), pd_version());
    json_decref(v);
    gwt_resp_free(&r);
}

static void test_not_found_and_method(void **state) {
    gwt_resp r;
    assert_int_equal(gwt_get(g_srv.port, "/nope", &r), 0);
    assert_int_equal(r.status, 404);
    json_t *j = jparse(r.body);
    json_t *e = json_object_get(j, "error");
    assert_true(json_is_string(json_object_get(e, "message")));
    assert_true(json_is_null(json_object_get(e, "param")));
    assert_int_equal(json_integer_value(json_object_get(e, "code")), 404);
    json_decref(j);
    gwt_resp_free(&r);

    char allow[64];
    gwt_conn *c = gwt_open(g_srv.port);
    gwt_sendf(c, "POST /health HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 405);
    assert_string_equal(gwt_header(&r, "Allow", allow, sizeof allow), "GET, HEAD");
    gwt_resp_free(&r);
    gwt_sendf(c, "GET /v1/chat/completions HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 405);
    assert_string_equal(gwt_header(&r, "Allow", allow, sizeof allow), "POST");
    gwt_resp_free(&r);
    gwt_sendf(c, "DELETE /v1/completions HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 405);
    gwt_resp_free(&r);
    gwt_close(c);
}

/* One request written raw on a fresh connection; its status, and the error
 * message of a 400 (an OpenAI error body: message, type, param null, code). */
static int raw_status(const char *request, char *msg, size_t cap) {
    gwt_conn *c = gwt_open(g_srv.port);
    gwt_sendf(c, "%s", request);
    gwt_resp r;
    assert_int_equal(gwt_read(c, &r), 0);
    int status = r.status;
    if (status == 400) {
        json_t *j = jparse(r.body);
        json_t *e = json_object_get(j, "error");
        snprintf(msg, cap, "%s", json_string_value(json_object_get(e, "message")));
        assert_string_equal(json_string_value(json_object_get(e, "type")), "invalid_request_error");
        assert_true(json_is_null(json_object_get(e, "param")));
        assert_int_equal(json_integer_value(json_object_get(e, "code")), 400);
        json_decref(j);
        assert_true(gwt_wait_closed(c, 2)); /* the connection does not stay */
    }
    gwt_resp_free(&r);
    gwt_close(c);
    return status;
}

/* RFC 9112 §3.2: an HTTP/1.1 request without a Host header field, and any
 * request with more than one, is answered 400; HTTP/1.0 may omit it, an
 * empty value is valid (a target without an authority), the name is
 * case-insensitive. */
static void test_host_header(void **state) {
    char msg[512] = "";
    assert_int_equal(raw_status("GET /health HTTP/1.1\r\n\r\n", msg, sizeof msg), 400);
    assert_non_null(strstr(msg, "Host"));
    msg[0] = 0;
    assert_int_equal(
        raw_status("POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                   "Content-Length: 2\r\n\r\n{}",
                   msg, sizeof msg),
        400);
    assert_non_null(strstr(msg, "Host"));
    msg[0] = 0;
    assert_int_equal(
        raw_status("GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", msg, sizeof msg), 400);
    assert_non_null(strstr(msg, "Host"));
    msg[0] = 0;
    assert_int_equal(
        raw_status("GET /health HTTP/1.0\r\nHost: a\r\nhost: b\r\n\r\n", msg, sizeof msg), 400);
    assert_non_null(strstr(msg, "Host"));
    assert_int_equal(raw_status("GET /health HTTP/1.0\r\n\r\n", msg, sizeof msg), 200);
    assert_int_equal(raw_status("GET /health HTTP/1.1\r\nhOST: t\r\n\r\n", msg, sizeof msg), 200);
    assert_int_equal(raw_status("GET /health HTTP/1.1\r\nHost:\r\n\r\n", msg, sizeof msg), 200);
}

static int metrics_fn(void *ctx, const char *path, const char *query, struct evbuffer *body,
                      const char **ctype) {
    evbuffer_add_printf(body, "pdserve:test 1\nquery %s\n", query ? query : "-");
    *ctype = "text/plain; version=0.0.4";
    return 200;
}

static void add_metrics(pd_gw_server *srv, void *ud) {
    pd_err err;
    assert_int_equal(pd_gw_server_add_get(srv, "/metrics", metrics_fn, NULL, &err), PD_OK);
    assert_int_not_equal(pd_gw_server_add_get(srv, "/health", metrics_fn, NULL, &err), PD_OK);
    assert_int_not_equal(pd_gw_server_add_get(srv, "metrics", metrics_fn, NULL, &err), PD_OK);
    pd_gw_server_set_ready(srv, false);
}

static void test_extra_get_handler_and_ready(void **state) {
    gwt_server h;
    assert_int_equal(gwt_server_start_setup(&h, NULL, add_metrics, NULL), 0);
    gwt_resp r;
    assert_int_equal(gwt_get(h.port, "/metrics?x=1", &r), 0);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.body, "pdserve:test 1\nquery x=1\n");
    char ct[64];
    assert_string_equal(gwt_header(&r, "Content-Type", ct, sizeof ct), "text/plain; version=0.0.4");
    gwt_resp_free(&r);
    assert_int_equal(gwt_post(h.port, "/metrics", "{}", &r), 0);
    assert_int_equal(r.status, 405);
    gwt_resp_free(&r);
    assert_int_equal(gwt_get(h.port, "/health", &r), 0);
    assert_int_equal(r.status, 503); /* not ready */
    gwt_resp_free(&r);
    gwt_server_stop(&h);
}

/* ---- validation over HTTP ------------------------------------------------------ */

static void test_content_type(void **state) {
    script_bytes("ok", 1, 0.001);
    const char *body = "{\"prompt\":\"hi\",\"max_tokens\":2}";
    const char *cts[] = {"text/plain",
                         NULL,
                         "application/json; charset=latin-1",
                         "application/jsonx",
                         "application/json; charset=utf-8",
                         "Application/JSON;charset=\"UTF-8\"",
                         "application/json"};
    const int want[] = {415, 415, 415, 415, 200, 200, 200};
    for (int i = 0; i < 7; i++) {
        gwt_conn *c = gwt_open(g_srv.port);
        char hdr[128] = "";
        if (cts[i])
            snprintf(hdr, sizeof hdr, "Content-Type: %s\r\n", cts[i]);
        gwt_sendf(c, "POST /v1/completions HTTP/1.1\r\nHost: t\r\n%sContent-Length: %zu\r\n\r\n%s",
                  hdr, strlen(body), body);
        gwt_resp r;
        assert_int_equal(gwt_read(c, &r), 0);
        if (r.status != want[i])
            fprintf(stderr, "content-type %s: %d\n", cts[i], r.status);
        assert_int_equal(r.status, want[i]);
        gwt_resp_free(&r);
        gwt_close(c);
    }
}

static void test_validation_errors_http(void **state) {
    script_bytes("ok", 1, 0.001);
    const char *chat = "/v1/chat/completions", *cmpl = "/v1/completions";
    check_error(chat, "{not json", 400, NULL);
    check_error(chat, "{}", 400, "messages");
    check_error(chat, "{\"model\":\"gpt-4\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}",
                404, "model");
    check_error(chat, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":0}", 400, "n");
    check_error(chat, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":3}",
                400, "temperature");
    check_error(chat, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stop\":[\"\"]}", 400,
                "stop");
    check_error(chat,
                "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream_options\":"
                "{\"include_usage\":true}}",
                400, "stream_options");
    check_error(chat, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":1}",
                400, "top_logprobs");
    check_error(chat,
                "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"seed\":"
                "99999999999999999999}",
                400, "seed");
    check_error(cmpl, "{\"prompt\":\"x\",\"max_tokens\":0}", 400, "max_tokens");
    check_error(cmpl, "{\"prompt\":[1,2],\"max_tokens\":4095}", 400, "max_tokens");
    check_error(cmpl, "{\"prompt\":\"x\",\"top_p\":0}", 400, "top_p");
    check_error(cmpl, "{\"prompt\":\"x\",\"top_k\":-5}", 400, "top_k");
    check_error(cmpl, "{\"prompt\":\"x\",\"min_p\":2}", 400, "min_p");
    check_error(cmpl, "{\"prompt\":\"x\",\"presence_penalty\":-3}", 400, "presence_penalty");
    check_error(cmpl, "{\"prompt\":\"x\",\"min_tokens\":9,\"max_tokens\":3}", 400, "min_tokens");
    /* the length message names the limit, the prompt length and max_tokens */
    gwt_resp r;
    assert_int_equal(gwt_post(g_srv.port, cmpl, "{\"prompt\":[1,2,3],\"max_tokens\":4094}", &r), 0);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(r.body, "4096"));
    assert_non_null(strstr(r.body, "3 in the prompt"));
    assert_non_null(strstr(r.body, "4094"));
    gwt_resp_free(&r);
    assert_int_equal(atomic_load(&g_srv.engine.n_active), 0);
}

/* ---- responses ----------------------------------------------------------------- */

static void test_completion_full(void **state) {
    script_bytes(UTF8_TEXT, 3, 0.001);
    int before = atomic_load(&g_srv.engine.n_aborted);
    json_t *j = post_json("/v1/completions",
                          "{\"model\":\"test-model\",\"prompt\":\"Say hi\",\"temperature\":0.5,"
                          "\"top_k\":7,\"seed\":11,\"max_tokens\":1000}",
                          200);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "text_completion");
    assert_string_equal(json_string_value(json_object_get(j, "model")), "test-model");
    assert_true(strncmp(json_string_value(json_object_get(j, "id")), "cmpl-", 5) == 0);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), UTF8_TEXT);
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "stop");
    assert_true(json_is_null(json_object_get(c, "stop_reason")));
    json_t *u = json_object_get(j, "usage");
    int np = n_prompt_tokens("Say hi");
    assert_int_equal(json_integer_value(json_object_get(u, "prompt_tokens")), np);
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")),
                     (int)strlen(UTF8_TEXT));
    assert_int_equal(json_integer_value(json_object_get(u, "total_tokens")),
                     np + (int)strlen(UTF8_TEXT));
    json_decref(j);
    /* what the engine was asked */
    pthread_mutex_lock(&g_srv.engine.mu);
    assert_int_equal(g_srv.engine.last.n_prompt, np);
    assert_int_equal(g_srv.engine.last.max_tokens, 1000);
    assert_int_equal(g_srv.engine.last.sampling.top_k, 7);
    assert_true(g_srv.engine.last.sampling.temperature == 0.5f);
    assert_true(g_srv.engine.last.sampling.has_seed);
    assert_int_equal(g_srv.engine.last.n, 1);
    assert_int_equal(g_srv.engine.last.logprobs, -1);
    pthread_mutex_unlock(&g_srv.engine.mu);
    /* the engine finished on its own: no abort */
    assert_int_equal(atomic_load(&g_srv.engine.n_aborted), before);

    /* max_tokens reached: "length", and the count is what was produced */
    j = post_json("/v1/completions", "{\"prompt\":\"Say hi\",\"max_tokens\":5}", 200);
    c = json_array_get(json_object_get(j, "choices"), 0);
    /* 5 bytes: "Grü" and the first byte of "ß", which can never complete: U+FFFD */
    assert_string_equal(json_string_value(json_object_get(c, "text")), "Grü\xef\xbf\xbd");
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "length");
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 5);
    json_decref(j);
    j = post_json("/v1/completions", "{\"prompt\":\"Say hi\",\"max_tokens\":4}", 200);
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), "Grü");
    json_decref(j);
}

static void test_chat_full_and_stream_equal(void **state) {
    script_bytes(UTF8_TEXT, 1, 0.001);
    const char *req =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"max_tokens\":500";
    char body[512];
    snprintf(body, sizeof body, "%s}", req);
    json_t *j = post_json("/v1/chat/completions", body, 200);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion");
    assert_true(strncmp(json_string_value(json_object_get(j, "id")), "chatcmpl-", 9) == 0);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *msg = json_object_get(c, "message");
    assert_string_equal(json_string_value(json_object_get(msg, "role")), "assistant");
    assert_string_equal(json_string_value(json_object_get(msg, "content")), UTF8_TEXT);
    json_t *usage = json_deep_copy(json_object_get(j, "usage"));
    json_decref(j);

    /* streamed, no usage option: role chunk, deltas, a final chunk, [DONE]; no usage key */
    stream_result sr;
    snprintf(body, sizeof body, "%s,\"stream\":true}", req);
    stream_post("/v1/chat/completions", body, &sr);
    assert_true(sr.done_last);
    assert_int_equal(sr.n_http_chunks, sr.sse.n); /* one HTTP chunk per event */
    assert_true(sr.n_ev >= 3);
    json_t *first = choice0(sr.ev[0]);
    assert_string_equal(json_string_value(json_object_get(json_object_get(first, "delta"), "role")),
                        "assistant");
    const char *id = json_string_value(json_object_get(sr.ev[0], "id"));
    for (int i = 0; i < sr.n_ev; i++) {
        assert_string_equal(json_string_value(json_object_get(sr.ev[i], "object")),
                            "chat.completion.chunk");
        assert_string_equal(json_string_value(json_object_get(sr.ev[i], "id")), id);
        assert_null(json_object_get(sr.ev[i], "usage"));
        json_t *fr = json_object_get(choice0(sr.ev[i]), "finish_reason");
        if (i < sr.n_ev - 1)
            assert_true(json_is_null(fr));
        else
            assert_string_equal(json_string_value(fr), "stop");
        if (i > 0)
            assert_null(json_object_get(json_object_get(choice0(sr.ev[i]), "delta"), "role"));
    }
    assert_string_equal(sr.text[0], UTF8_TEXT); /* concatenated stream == non-streamed */
    stream_free(&sr);

    /* include_usage: usage null everywhere but one usage chunk just before [DONE] */
    snprintf(body, sizeof body, "%s,\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
             req);
    stream_post("/v1/chat/completions", body, &sr);
    assert_true(sr.done_last);
    for (int i = 0; i < sr.n_ev - 1; i++) {
        json_t *u = json_object_get(sr.ev[i], "usage");
        assert_non_null(u);
        assert_true(json_is_null(u));
    }
    json_t *last = sr.ev[sr.n_ev - 1];
    assert_int_equal(json_array_size(json_object_get(last, "choices")), 0);
    assert_true(json_equal(json_object_get(last, "usage"), usage));
    assert_string_equal(sr.text[0], UTF8_TEXT);
    stream_free(&sr);
    json_decref(usage);
}

static void test_completion_stream_and_echo(void **state) {
    script_bytes(UTF8_TEXT, 2, 0.001);
    stream_result sr;
    stream_post("/v1/completions", "{\"prompt\":\"P\",\"stream\":true,\"max_tokens\":100}", &sr);
    assert_true(sr.done_last);
    for (int i = 0; i < sr.n_ev; i++)
        assert_string_equal(json_string_value(json_object_get(sr.ev[i], "object")),
                            "text_completion");
    assert_string_equal(sr.text[0], UTF8_TEXT);
    assert_string_equal(
        json_string_value(json_object_get(choice0(sr.ev[sr.n_ev - 1]), "finish_reason")), "stop");
    stream_free(&sr);

    json_t *j = post_json("/v1/completions", "{\"prompt\":\"Echo me: \",\"echo\":true,\"max_tokens\":1000}", 200);
    assert_string_equal(json_string_value(json_object_get(
                            json_array_get(json_object_get(j, "choices"), 0), "text")),
                        "Echo me: " UTF8_TEXT);
    json_decref(j);
    stream_post("/v1/completions", "{\"prompt\":\"Echo me: \",\"echo\":true,\"stream\":true,\"max_tokens\":1000}", &sr);
    assert_string_equal(sr.text[0], "Echo me: " UTF8_TEXT);
    stream_free(&sr);
}

static void test_utf8_never_split(void **state) {
    const char *text = "日本語のテキスト 🎉🎊🎈 ÄÖÜ ß € 𝄞 end";
    for (int batch = 1; batch <= 3; batch++) {
        script_bytes(text, batch, 0.0005);
        stream_result sr;
        stream_post("/v1/chat/completions",
                    "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream\":true}", &sr);
        /* stream_post already checked every event is strict UTF-8 JSON */
        assert_string_equal(sr.text[0], text);
        for (int i = 1; i < sr.n_ev - 1; i++) { /* no empty content deltas */
            json_t *d = json_object_get(choice0(sr.ev[i]), "delta");
            json_t *t = json_object_get(d, "content");
            assert_true(json_is_string(t) && json_string_length(t) > 0);
        }
        stream_free(&sr);
    }
}

static void test_stop_strings(void **state) {
    const char *text = "The answer is 42.\nSTOP and more text";
    const char *want = "The answer is 42.\n";
    for (int batch = 1; batch <= 4; batch++) {
        script_bytes(text, batch, 0.001);
        int ab = atomic_load(&g_srv.engine.n_aborted);
        json_t *j =
            post_json("/v1/completions", "{\"prompt\":\"q\",\"stop\":[\"nope\",\"STOP\"],\"max_tokens\":1000}", 200);
        json_t *c = json_array_get(json_object_get(j, "choices"), 0);
        assert_string_equal(json_string_value(json_object_get(c, "text")), want);
        assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "stop");
        assert_string_equal(json_string_value(json_object_get(c, "stop_reason")), "STOP");
        /* usage counts the tokens up to the one that completed the stop string */
        assert_int_equal(
            json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")),
            (int)strlen("The answer is 42.\nSTOP"));
        json_decref(j);
        /* the gateway ended it: the engine was told */
        assert_int_equal(gwt_wait_atomic(&g_srv.engine.n_aborted, ab + 1, 2), ab + 1);

        stream_result sr;
        stream_post("/v1/chat/completions",
                    "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"}],\"stream\":true,"
                    "\"stop\":\"STOP\"}",
                    &sr);
        assert_string_equal(sr.text[0], want);
        for (int i = 0; i < sr.n_ev; i++) { /* no piece of the stop string ever went out */
            json_t *t = json_object_get(json_object_get(choice0(sr.ev[i]), "delta"), "content");
            if (json_is_string(t))
                assert_null(strchr(json_string_value(t), 'S'));
        }
        json_t *fin = choice0(sr.ev[sr.n_ev - 1]);
        assert_string_equal(json_string_value(json_object_get(fin, "finish_reason")), "stop");
        stream_free(&sr);
    }
    /* a near miss is released; include_stop_str_in_output keeps the match */
    script_bytes("a STOx b STOP c", 1, 0.001);
    json_t *j =
        post_json("/v1/completions",
                  "{\"prompt\":\"q\",\"stop\":\"STOP\",\"include_stop_str_in_output\":true}", 200);
    assert_string_equal(json_string_value(json_object_get(
                            json_array_get(json_object_get(j, "choices"), 0), "text")),
                        "a STOx b STOP");
    json_decref(j);
    /* a stop string split inside a multi-byte character sequence */
    script_bytes("x日本語y", 1, 0.001);
    j = post_json("/v1/completions", "{\"prompt\":\"q\",\"stop\":\"本\"}", 200);
    assert_string_equal(json_string_value(json_object_get(
                            json_array_get(json_object_get(j, "choices"), 0), "text")),
                        "x日");
    json_decref(j);
    /* min_tokens: stop strings do not apply before it */
    script_bytes("STOP here STOP", 1, 0.001);
    j = post_json("/v1/completions", "{\"prompt\":\"q\",\"stop\":\"STOP\",\"min_tokens\":6}", 200);
    assert_string_equal(json_string_value(json_object_get(
                            json_array_get(json_object_get(j, "choices"), 0), "text")),
                        "STOP here ");
    json_decref(j);
}

/* Sets a script of explicit ids. */
static void script_ids(const int32_t *ids, int n, int batch) {
    gwt_script s = gwt_script_ids(ids, n);
    s.batch = batch;
    gwt_engine_set(&g_srv.engine, &s);
}

/* ids of text spelled byte by byte, then extra ids, into out (returns n). */
static int ids_text_plus(const char *text, const int32_t *extra, int n_extra, int32_t *out) {
    int n = 0;
    int32_t *ids = gwt_ids_bytewise(text, &n);
    memcpy(out, ids, (size_t)n * sizeof *ids);
    free(ids);
    memcpy(out + n, extra, (size_t)n_extra * sizeof *extra);
    return n + n_extra;
}

/* The contract: a choice whose text is empty while it generated tokens says
 * why (stop_reason, or skipped_special_tokens). */
static void check_text_explained(json_t *c, const char *text, json_int_t n_tokens) {
    if (text[0] || n_tokens == 0)
        return;
    bool why = !json_is_null(json_object_get(c, "stop_reason")) ||
               json_integer_value(json_object_get(c, "skipped_special_tokens")) > 0;
    assert_true(why);
}

/* skip_special_tokens: special tokens show no text and are counted in
 * skipped_special_tokens; usage counts them; never a silent empty 200. */
static void test_special_tokens_accounted(void **state) {
    const pd_tokenizer *t = gwt_tokenizer();
    int32_t bos = pd_tok_find(t, PD_TOK_DSV3_BOS), eos = pd_tok_find(t, PD_TOK_DSV3_EOS);
    assert_true(bos >= 0 && eos >= 0);
    int32_t ids[64];
    /* all special: empty text, 2 tokens, explained */
    int32_t sp[2] = {bos, eos};
    script_ids(sp, 2, 1);
    json_t *j = post_json("/v1/completions", "{\"prompt\":\"q\"}", 200);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), "");
    assert_int_equal(json_integer_value(json_object_get(c, "skipped_special_tokens")), 2);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 2);
    check_text_explained(c, "", 2);
    json_decref(j);
    /* the same streamed (chat): the final chunk says it, usage agrees */
    stream_result sr;
    stream_post("/v1/chat/completions",
                "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"}],\"stream\":true,"
                "\"stream_options\":{\"include_usage\":true}}",
                &sr);
    assert_string_equal(sr.text[0], "");
    json_t *fin = NULL;
    for (int i = 0; i < sr.n_ev; i++) {
        json_t *ch = choice0(sr.ev[i]);
        if (ch && json_is_string(json_object_get(ch, "finish_reason")))
            fin = ch;
    }
    assert_non_null(fin);
    assert_int_equal(json_integer_value(json_object_get(fin, "skipped_special_tokens")), 2);
    json_t *u = json_object_get(sr.ev[sr.n_ev - 1], "usage");
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), 2);
    check_text_explained(fin, sr.text[0], 2);
    stream_free(&sr);
    /* skip_special_tokens: false shows them; nothing skipped */
    j = post_json("/v1/completions", "{\"prompt\":\"q\",\"skip_special_tokens\":false}", 200);
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")),
                        PD_TOK_DSV3_BOS PD_TOK_DSV3_EOS);
    assert_null(json_object_get(c, "skipped_special_tokens"));
    json_decref(j);
    /* text then EOS: the text, one skipped */
    int n = ids_text_plus("hi!", &eos, 1, ids);
    script_ids(ids, n, 2);
    j = post_json("/v1/completions", "{\"prompt\":\"q\"}", 200);
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), "hi!");
    assert_int_equal(json_integer_value(json_object_get(c, "skipped_special_tokens")), 1);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 4);
    json_decref(j);
    /* echo with token ids: skip_special_tokens applies to the echoed prompt too */
    char body[200];
    snprintf(body, sizeof body,
             "{\"prompt\":[%d,%d,%d],\"echo\":true,\"skip_special_tokens\":false,\"max_tokens\":4}",
             bos, ids[0], ids[1]);
    j = post_json("/v1/completions", body, 200);
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")),
                        PD_TOK_DSV3_BOS "hihi!" PD_TOK_DSV3_EOS);
    json_decref(j);
}

/* stop_token_ids: the token that ended a choice is its stop_reason (an
 * integer, as vLLM) and shows no text unless include_stop_str_in_output; a
 * stop token that did not end the choice is ordinary text. */
static void test_stop_token_ids(void **state) {
    int n1 = 0;
    int32_t *hash = gwt_ids_bytewise("#", &n1);
    int32_t x = hash[0]; /* the byte token for '#' */
    free(hash);
    int32_t ids[64];
    char body[256];
    int n = ids_text_plus("ab", &x, 1, ids);
    script_ids(ids, n, 1);
    snprintf(body, sizeof body, "{\"prompt\":\"q\",\"stop_token_ids\":[%d]}", x);
    json_t *j = post_json("/v1/completions", body, 200);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), "ab");
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "stop");
    assert_int_equal(json_integer_value(json_object_get(c, "stop_reason")), x);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 3);
    json_decref(j);
    /* streamed: the same */
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"}],\"stream\":true,"
             "\"stop_token_ids\":[%d]}",
             x);
    stream_result sr;
    stream_post("/v1/chat/completions", body, &sr);
    assert_string_equal(sr.text[0], "ab");
    json_t *fin = choice0(sr.ev[sr.n_ev - 1]);
    assert_int_equal(json_integer_value(json_object_get(fin, "stop_reason")), x);
    stream_free(&sr);
    /* include_stop_str_in_output shows it */
    snprintf(body, sizeof body,
             "{\"prompt\":\"q\",\"stop_token_ids\":[%d],\"include_stop_str_in_output\":true}", x);
    j = post_json("/v1/completions", body, 200);
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), "ab#");
    assert_int_equal(json_integer_value(json_object_get(c, "stop_reason")), x);
    json_decref(j);
    /* only the stop token: empty text, explained */
    script_ids(&x, 1, 1);
    snprintf(body, sizeof body, "{\"prompt\":\"q\",\"stop_token_ids\":[%d]}", x);
    j = post_json("/v1/completions", body, 200);
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), "");
    check_text_explained(c, "", 1);
    json_decref(j);
    /* in the middle (the engine went on, e.g. before min_tokens): text */
    int32_t mid[3];
    mid[0] = ids[0];
    mid[1] = x;
    mid[2] = ids[1];
    script_ids(mid, 3, 1);
    j = post_json("/v1/completions", body, 200);
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), "a#b");
    assert_true(json_is_null(json_object_get(c, "stop_reason")));
    json_decref(j);
    /* the last token but the choice ended on length: text, no stop_reason */
    script_ids(ids, n, 1);
    snprintf(body, sizeof body, "{\"prompt\":\"q\",\"stop_token_ids\":[%d],\"max_tokens\":3}", x);
    j = post_json("/v1/completions", body, 200);
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "length");
    assert_string_equal(json_string_value(json_object_get(c, "text")), "ab#");
    assert_true(json_is_null(json_object_get(c, "stop_reason")));
    json_decref(j);
    /* the stop token is checked before stop strings (vLLM's StopChecker):
     * a stop string it would complete does not match */
    script_ids(ids, n, 1);
    snprintf(body, sizeof body, "{\"prompt\":\"q\",\"stop_token_ids\":[%d],\"stop\":\"b#\"}", x);
    j = post_json("/v1/completions", body, 200);
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), "ab");
    assert_int_equal(json_integer_value(json_object_get(c, "stop_reason")), x);
    json_decref(j);
    /* a stop string that ends before it: the stop string */
    snprintf(body, sizeof body, "{\"prompt\":\"q\",\"stop_token_ids\":[%d],\"stop\":\"b\"}", x);
    j = post_json("/v1/completions", body, 200);
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), "a");
    assert_string_equal(json_string_value(json_object_get(c, "stop_reason")), "b");
    json_decref(j);
}

/* n > 1: a choice that ends on a stop string is aborted alone
 * (abort_choice); the others run to their end; the request is not aborted. */
static void test_choice_abort(void **state) {
    int n = 0;
    int32_t *ids = gwt_ids_bytewise("xx STOP yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy", &n);
    gwt_script s = gwt_script_ids(ids, n);
    s.choice_skip = 8; /* choice 1 starts after "xx STOP ": no stop string in it */
    s.interval_s = 0.002;
    gwt_engine_set(&g_srv.engine, &s);
    free(ids);
    int ab0 = atomic_load(&g_srv.engine.n_aborted);
    int ca0 = atomic_load(&g_srv.engine.n_choice_aborts);
    json_t *j = post_json("/v1/completions", "{\"prompt\":\"q\",\"n\":2,\"stop\":\"STOP\",\"max_tokens\":1000}", 200);
    json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
    json_t *c1 = json_array_get(json_object_get(j, "choices"), 1);
    assert_string_equal(json_string_value(json_object_get(c0, "text")), "xx ");
    assert_string_equal(json_string_value(json_object_get(c0, "stop_reason")), "STOP");
    assert_string_equal(json_string_value(json_object_get(c1, "text")),
                        "yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy");
    assert_true(json_is_null(json_object_get(c1, "stop_reason")));
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")),
        7 + 40);
    json_decref(j);
    assert_int_equal(atomic_load(&g_srv.engine.n_choice_aborts), ca0 + 1);
    assert_int_equal(atomic_load(&g_srv.engine.n_after_choice_abort), 0);
    assert_int_equal(atomic_load(&g_srv.engine.n_aborted), ab0); /* the engine finished it */
    /* both choices stop: the whole request is aborted once, no choice abort
     * for the last one */
    s.choice_skip = 0;
    gwt_engine_set(&g_srv.engine, &s);
    j = post_json("/v1/completions", "{\"prompt\":\"q\",\"n\":2,\"stop\":\"STOP\",\"max_tokens\":1000}", 200);
    json_decref(j);
    assert_int_equal(gwt_wait_atomic(&g_srv.engine.n_aborted, ab0 + 1, 2), ab0 + 1);
    assert_int_equal(atomic_load(&g_srv.engine.n_after_choice_abort), 0);
}

/* X-Request-Id: the client's is returned (JSON, SSE, errors); without one,
 * or with one that is not a printable token, the response id is. */
static void test_x_request_id(void **state) {
    script_bytes("ok", 1, 0.001);
    static const struct {
        const char *hdr, *body, *ctype;
        int status;
        const char *want; /* NULL: the response id */
    } cases[] = {
        {"X-Request-Id: abc-123\r\n", "{\"prompt\":\"q\"}", "application/json", 200, "abc-123"},
        {"x-request-id: s1\r\n", "{\"prompt\":\"q\",\"stream\":true}", "application/json", 200,
         "s1"},
        {"X-Request-Id: e-1\r\n", "{\"prompt\":\"q\",\"n\":0}", "application/json", 400, "e-1"},
        {"X-Request-Id: t-1\r\n", "{\"prompt\":\"q\"}", "text/plain", 415, "t-1"},
        {"", "{\"prompt\":\"q\"}", "application/json", 200, NULL},
        {"X-Request-Id: has space\r\n", "{\"prompt\":\"q\"}", "application/json", 200, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        gwt_conn *c = gwt_open(g_srv.port);
        gwt_sendf(c,
                  "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: %s\r\n%s"
                  "Content-Length: %zu\r\n\r\n%s",
                  cases[i].ctype, cases[i].hdr, strlen(cases[i].body), cases[i].body);
        gwt_resp r;
        assert_int_equal(gwt_read(c, &r), 0);
        assert_int_equal(r.status, cases[i].status);
        char v[160];
        assert_non_null(gwt_header(&r, "X-Request-Id", v, sizeof v));
        if (cases[i].want) {
            assert_string_equal(v, cases[i].want);
        } else {
            json_t *j = jparse(r.body);
            assert_string_equal(v, json_string_value(json_object_get(j, "id")));
            json_decref(j);
        }
        gwt_resp_free(&r);
        gwt_close(c);
    }
}

static void test_n_choices(void **state) {
    script_bytes("abc日", 2, 0.001);
    json_t *j = post_json("/v1/chat/completions",
                          "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":3}", 200);
    json_t *choices = json_object_get(j, "choices");
    assert_int_equal(json_array_size(choices), 3);
    for (int i = 0; i < 3; i++) {
        json_t *c = json_array_get(choices, (size_t)i);
        assert_int_equal(json_integer_value(json_object_get(c, "index")), i);
        assert_string_equal(
            json_string_value(json_object_get(json_object_get(c, "message"), "content")), "abc日");
    }
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")),
        3 * 6);
    json_decref(j);

    stream_result sr;
    stream_post("/v1/chat/completions",
                "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":2,\"stream\":true,"
                "\"stream_options\":{\"include_usage\":true}}",
                &sr);
    int roles[2] = {0}, finals[2] = {0};
    for (int i = 0; i < sr.n_ev; i++) {
        json_t *c = choice0(sr.ev[i]);
        if (!c)
            continue;
        int idx = (int)json_integer_value(json_object_get(c, "index"));
        if (json_object_get(json_object_get(c, "delta"), "role"))
            roles[idx]++;
        if (json_is_string(json_object_get(c, "finish_reason")))
            finals[idx]++;
    }
    assert_int_equal(roles[0], 1);
    assert_int_equal(roles[1], 1);
    assert_int_equal(finals[0], 1);
    assert_int_equal(finals[1], 1);
    assert_string_equal(sr.text[0], "abc日");
    assert_string_equal(sr.text[1], "abc日");
    json_t *u = json_object_get(sr.ev[sr.n_ev - 1], "usage");
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), 12);
    stream_free(&sr);
}

static void test_logprobs(void **state) {
    int n = 0;
    int32_t *ids = gwt_ids_bytewise("abcd", &n);
    gwt_script s = gwt_script_ids(ids, n);
    s.with_logprobs = true;
    gwt_engine_set(&g_srv.engine, &s);
    free(ids);
    json_t *j = post_json("/v1/chat/completions",
                          "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,"
                          "\"top_logprobs\":2}",
                          200);
    json_t *content = json_object_get(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"), "content");
    assert_int_equal(json_array_size(content), 4);
    json_t *e0 = json_array_get(content, 0);
    assert_string_equal(json_string_value(json_object_get(e0, "token")), "a");
    assert_true(json_real_value(json_object_get(e0, "logprob")) == -0.5);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(e0, "bytes"), 0)), 'a');
    json_decref(j);
    j = post_json("/v1/completions", "{\"prompt\":\"x\",\"logprobs\":1}", 200);
    json_t *lp = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs");
    assert_int_equal(json_array_size(json_object_get(lp, "tokens")), 4);
    assert_int_equal(json_array_size(json_object_get(lp, "token_logprobs")), 4);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 3)), 3);
    json_decref(j);
    j = post_json("/v1/completions", "{\"prompt\":\"x\"}", 200);
    assert_true(json_is_null(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs")));
    json_decref(j);

    /* text_offset counts the bytes of the text returned: a lone continuation
     * byte shows as U+FFFD (3 bytes), and the first byte of a split "é"
     * adds nothing until its second byte completes it */
    ids = gwt_ids_bytewise("a\xbf" "b\xc3\xa9" "c", &n);
    s = gwt_script_ids(ids, n);
    s.with_logprobs = true;
    gwt_engine_set(&g_srv.engine, &s);
    free(ids);
    j = post_json("/v1/completions", "{\"prompt\":\"x\",\"logprobs\":0}", 200);
    json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
    const char *text = json_string_value(json_object_get(c0, "text"));
    assert_string_equal(text, "a\xef\xbf\xbd" "b\xc3\xa9" "c");
    json_t *offs = json_object_get(json_object_get(c0, "logprobs"), "text_offset");
    static const int want_off[] = {0, 1, 4, 5, 5, 7};
    assert_int_equal(json_array_size(offs), 6);
    for (size_t i = 0; i < 6; i++)
        assert_int_equal(json_integer_value(json_array_get(offs, i)), want_off[i]);
    json_decref(j);
}

/* Top logprobs from an engine that reports alternatives
 * (pd_gw_on_tokens_top): at most what the request asked for, best first,
 * the completions dict with the sampled token too, -inf ones left out, and a
 * stream's logprobs equal to the non-streamed ones. */
static void script_top(int n_top, bool without_sampled, bool last_inf, int batch) {
    int n = 0, na = 0;
    int32_t *ids = gwt_ids_bytewise("abcd", &n);
    int32_t *alt = gwt_ids_bytewise("xyzw", &na);
    gwt_script s = gwt_script_ids(ids, n);
    s.with_logprobs = true;
    s.batch = batch;
    s.n_top = n_top;
    memcpy(s.top_alt, alt, (size_t)na * sizeof *alt);
    s.top_without_sampled = without_sampled;
    s.top_last_inf = last_inf;
    gwt_engine_set(&g_srv.engine, &s);
    free(ids);
    free(alt);
}

/* choices[0].logprobs of every streamed chunk: chat content entries
 * appended, completions arrays appended per key. */
static json_t *stream_logprobs(const stream_result *sr, bool chat) {
    json_t *acc = chat ? json_pack("{s:[]}", "content")
                       : json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs",
                                   "top_logprobs", "text_offset");
    for (int i = 0; i < sr->n_ev; i++) {
        json_t *lp = json_object_get(choice0(sr->ev[i]), "logprobs");
        if (!json_is_object(lp))
            continue;
        const char *key;
        json_t *v;
        json_object_foreach(lp, key, v) {
            assert_non_null(json_object_get(acc, key));
            json_array_extend(json_object_get(acc, key), v);
        }
    }
    return acc;
}

static void test_top_logprobs(void **state) {
    static const char chat3[] = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                "\"logprobs\":true,\"top_logprobs\":3";
    char body[256];
    /* chat: the engine knows 5, the request wants 3 */
    script_top(5, false, false, 1);
    snprintf(body, sizeof body, "%s}", chat3);
    json_t *j = post_json("/v1/chat/completions", body, 200);
    json_t *content = json_object_get(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"), "content");
    assert_int_equal(json_array_size(content), 4);
    for (size_t i = 0; i < 4; i++) {
        json_t *e = json_array_get(content, i);
        char tok[2] = {"abcd"[i], 0};
        double lp = -0.5 * (double)(i + 1);
        assert_string_equal(json_string_value(json_object_get(e, "token")), tok);
        assert_true(json_real_value(json_object_get(e, "logprob")) == lp);
        json_t *top = json_object_get(e, "top_logprobs");
        assert_int_equal(json_array_size(top), 3);
        json_t *want0 =
            json_pack("{s:s, s:f, s:[i]}", "token", tok, "logprob", lp, "bytes", tok[0]);
        assert_true(json_equal(json_array_get(top, 0), want0)); /* the sampled token, top-1 */
        json_decref(want0);
        static const char alt[] = "xy";
        for (size_t k = 1; k < 3; k++) {
            json_t *t = json_array_get(top, k);
            char a[2] = {alt[k - 1], 0};
            assert_string_equal(json_string_value(json_object_get(t, "token")), a);
            assert_true(json_real_value(json_object_get(t, "logprob")) == lp - 0.25 * (double)k);
            assert_int_equal(json_integer_value(json_array_get(json_object_get(t, "bytes"), 0)),
                             a[0]);
        }
    }
    json_t *full =
        json_incref(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"));
    json_decref(j);

    /* streamed (one token a chunk, then two): the same logprobs */
    for (int batch = 1; batch <= 2; batch++) {
        script_top(5, false, false, batch);
        stream_result sr;
        snprintf(body, sizeof body, "%s,\"stream\":true}", chat3);
        stream_post("/v1/chat/completions", body, &sr);
        json_t *acc = stream_logprobs(&sr, true);
        assert_true(json_equal(acc, full));
        json_decref(acc);
        stream_free(&sr);
    }
    json_decref(full);

    /* chat top_logprobs 0: none listed */
    script_top(5, false, false, 1);
    j = post_json("/v1/chat/completions",
                  "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,"
                  "\"top_logprobs\":0}",
                  200);
    content = json_object_get(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"), "content");
    assert_int_equal(json_array_size(content), 4);
    for (size_t i = 0; i < 4; i++)
        assert_int_equal(
            json_array_size(json_object_get(json_array_get(content, i), "top_logprobs")), 0);
    json_decref(j);

    /* an alternative at -inf (a token a grammar or mask forbids): not listed,
     * so fewer than top_logprobs entries (docs/api.md) */
    script_top(5, false, true, 1);
    j = post_json("/v1/chat/completions",
                  "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,"
                  "\"top_logprobs\":5}",
                  200);
    content = json_object_get(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"), "content");
    json_t *top0 = json_object_get(json_array_get(content, 0), "top_logprobs");
    assert_int_equal(json_array_size(top0), 4);
    for (size_t k = 0; k < 4; k++)
        assert_true(json_real_value(json_object_get(json_array_get(top0, k), "logprob")) > -9999.0);
    json_decref(j);
    /* the same in a completion's alternatives */
    script_top(5, false, true, 1);
    j = post_json("/v1/completions", "{\"prompt\":\"x\",\"logprobs\":5}", 200);
    json_t *ctop0 = json_array_get(
        json_object_get(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"),
                        "top_logprobs"),
        0);
    assert_int_equal(json_object_size(ctop0), 4);
    json_decref(j);

    /* completions logprobs 2: {sampled, x} per position; 0: the sampled token alone */
    script_top(5, false, false, 1);
    j = post_json("/v1/completions", "{\"prompt\":\"x\",\"logprobs\":2}", 200);
    json_t *lp = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs");
    json_t *tops = json_object_get(lp, "top_logprobs");
    assert_int_equal(json_array_size(tops), 4);
    for (size_t i = 0; i < 4; i++) {
        json_t *d = json_array_get(tops, i);
        char tok[2] = {"abcd"[i], 0};
        double want = -0.5 * (double)(i + 1);
        assert_int_equal(json_object_size(d), 2);
        assert_true(json_real_value(json_object_get(d, tok)) == want);
        assert_true(json_real_value(json_object_get(d, "x")) == want - 0.25);
        assert_true(json_real_value(json_array_get(json_object_get(lp, "token_logprobs"), i)) ==
                    want);
    }
    full = json_incref(lp);
    json_decref(j);
    stream_result sr;
    stream_post("/v1/completions", "{\"prompt\":\"x\",\"logprobs\":2,\"stream\":true}", &sr);
    json_t *acc = stream_logprobs(&sr, false);
    assert_true(json_equal(acc, full));
    json_decref(acc);
    json_decref(full);
    stream_free(&sr);
    j = post_json("/v1/completions", "{\"prompt\":\"x\",\"logprobs\":0}", 200);
    tops = json_object_get(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"),
        "top_logprobs");
    for (size_t i = 0; i < 4; i++) {
        json_t *d = json_array_get(tops, i);
        char tok[2] = {"abcd"[i], 0};
        assert_int_equal(json_object_size(d), 1);
        assert_true(json_real_value(json_object_get(d, tok)) == -0.5 * (double)(i + 1));
    }
    json_decref(j);

    /* the sampled token not among the top 3: the dict has it too, 4 entries */
    script_top(3, true, false, 1);
    j = post_json("/v1/completions", "{\"prompt\":\"x\",\"logprobs\":3}", 200);
    tops = json_object_get(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"),
        "top_logprobs");
    for (size_t i = 0; i < 4; i++) {
        json_t *d = json_array_get(tops, i);
        char tok[2] = {"abcd"[i], 0};
        assert_int_equal(json_object_size(d), 4);
        const char *keys[4];
        size_t nk = 0;
        const char *key;
        json_t *v;
        json_object_foreach(d, key, v) keys[nk++] = key;
        /* best first: x y z, then the sampled token */
        assert_string_equal(keys[0], "x");
        assert_string_equal(keys[1], "y");
        assert_string_equal(keys[2], "z");
        assert_string_equal(keys[3], tok);
        assert_true(json_real_value(json_object_get(d, "x")) == (double)-0.01f);
    }
    json_decref(j);

    /* an engine without alternatives: top_logprobs lists the sampled token */
    script_top(0, false, false, 1);
    snprintf(body, sizeof body, "%s}", chat3);
    j = post_json("/v1/chat/completions", body, 200);
    content = json_object_get(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs"), "content");
    json_t *t0 = json_object_get(json_array_get(content, 1), "top_logprobs");
    assert_int_equal(json_array_size(t0), 1);
    assert_string_equal(json_string_value(json_object_get(json_array_get(t0, 0), "token")), "b");
    json_decref(j);
}

/* ---- engine errors and aborts ----------------------------------------------------- */

static void test_engine_errors(void **state) {
    int n = 0;
    int32_t *ids = gwt_ids_bytewise("0123456789", &n);
    gwt_script s = gwt_script_ids(ids, n);
    free(ids);

    /* before any byte: the status the engine chose; a 503 (a replica's
     * transient failure) says when to retry, a 500 does not */
    s.error_after = 0;
    s.error_status = 503;
    gwt_engine_set(&g_srv.engine, &s);
    check_error("/v1/completions", "{\"prompt\":\"x\"}", 503, NULL);
    {
        gwt_resp r5;
        char ra5[16];
        assert_int_equal(gwt_post(g_srv.port, "/v1/completions", "{\"prompt\":\"x\"}", &r5), 0);
        assert_int_equal(r5.status, 503);
        assert_string_equal(gwt_header(&r5, "Retry-After", ra5, sizeof ra5), "1");
        gwt_resp_free(&r5);
        s.error_status = 500;
        gwt_engine_set(&g_srv.engine, &s);
        assert_int_equal(gwt_post(g_srv.port, "/v1/completions", "{\"prompt\":\"x\"}", &r5), 0);
        assert_int_equal(r5.status, 500);
        assert_null(gwt_header(&r5, "Retry-After", ra5, sizeof ra5));
        gwt_resp_free(&r5);
        s.error_status = 503;
    }

    /* after the 200: an error event, then [DONE] */
    s.error_after = 4;
    gwt_engine_set(&g_srv.engine, &s);
    stream_result sr;
    stream_post("/v1/completions", "{\"prompt\":\"x\",\"stream\":true}", &sr);
    assert_true(sr.done_last);
    json_t *last = sr.ev[sr.n_ev - 1];
    json_t *e = json_object_get(last, "error");
    assert_non_null(e);
    assert_true(json_is_string(json_object_get(e, "message")));
    assert_string_equal(sr.text[0], "0123");
    for (int i = 0; i < sr.n_ev - 1; i++) /* no fake finish_reason */
        assert_true(json_is_null(json_object_get(choice0(sr.ev[i]), "finish_reason")));
    stream_free(&sr);

    /* refused at submit: 429 with Retry-After */
    s.error_after = -1;
    s.reject_status = 429;
    s.reject_retry_after = 7;
    gwt_engine_set(&g_srv.engine, &s);
    gwt_resp r;
    assert_int_equal(gwt_post(g_srv.port, "/v1/completions", "{\"prompt\":\"x\"}", &r), 0);
    assert_int_equal(r.status, 429);
    char ra[16];
    assert_string_equal(gwt_header(&r, "Retry-After", ra, sizeof ra), "7");
    gwt_resp_free(&r);
    s.reject_status = 1; /* anything else: 503 */
    s.reject_retry_after = 0;
    gwt_engine_set(&g_srv.engine, &s);
    check_error("/v1/completions", "{\"prompt\":\"x\"}", 503, NULL);
    assert_int_equal(gwt_wait_atomic(&g_srv.engine.n_active, 0, 0), 0);
}

static void long_script(double interval) {
    int32_t ids[4000];
    int n = 0;
    int32_t *one = gwt_ids_bytewise("ab", &n);
    for (int i = 0; i < 4000; i++)
        ids[i] = one[i % 2];
    free(one);
    gwt_script s = gwt_script_ids(ids, 4000);
    s.interval_s = interval;
    gwt_engine_set(&g_srv.engine, &s);
}

static void test_disconnect_aborts(void **state) {
    long_script(0.005);
    gwt_engine *e = &g_srv.engine;
    /* mid-stream */
    int ab = atomic_load(&e->n_aborted), sub = atomic_load(&e->n_submitted);
    gwt_conn *c = gwt_open(g_srv.port);
    const char *body = "{\"prompt\":\"x\",\"stream\":true}";
    gwt_sendf(c,
              "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              "Content-Length: %zu\r\n\r\n%s",
              strlen(body), body);
    gwt_resp r;
    assert_int_equal(gwt_read_head(c, &r), 0);
    assert_int_equal(r.status, 200);
    gwt_resp_free(&r);
    char *chunk;
    size_t len;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(gwt_read_chunk(c, &chunk, &len), 0);
        free(chunk);
    }
    gwt_close(c);
    assert_int_equal(gwt_wait_atomic(&e->n_aborted, ab + 1, 2), ab + 1);
    assert_int_equal(atomic_load(&e->n_submitted), sub + 1);

    /* waiting for a non-streamed response */
    c = gwt_open(g_srv.port);
    body = "{\"prompt\":\"x\"}";
    gwt_sendf(c,
              "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              "Content-Length: %zu\r\n\r\n%s",
              strlen(body), body);
    assert_int_equal(gwt_wait_atomic(&e->n_submitted, sub + 2, 2), sub + 2);
    gwt_close(c);
    assert_int_equal(gwt_wait_atomic(&e->n_aborted, ab + 2, 2), ab + 2);
    assert_int_equal(gwt_wait_atomic(&e->n_active, 0, 0), 0);
}

/* A client that half-closes after its request still gets finished responses;
 * one whose request is still in flight is taken as gone (aborted). */
static void test_half_close(void **state) {
    gwt_conn *c = gwt_open(g_srv.port);
    gwt_sendf(c, "GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
    shutdown(c->fd, SHUT_WR);
    gwt_resp r;
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.body, "ok");
    gwt_resp_free(&r);
    assert_true(gwt_wait_closed(c, 2));
    gwt_close(c);

    long_script(0.005);
    gwt_engine *e = &g_srv.engine;
    int ab = atomic_load(&e->n_aborted), sub = atomic_load(&e->n_submitted);
    c = gwt_open(g_srv.port);
    const char *body = "{\"prompt\":\"x\"}";
    gwt_sendf(c,
              "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              "Content-Length: %zu\r\n\r\n%s",
              strlen(body), body);
    assert_int_equal(gwt_wait_atomic(&e->n_submitted, sub + 1, 2), sub + 1);
    shutdown(c->fd, SHUT_WR);
    assert_int_equal(gwt_wait_atomic(&e->n_aborted, ab + 1, 2), ab + 1);
    assert_true(gwt_wait_closed(c, 2));
    gwt_close(c);
}

/* ---- the connection layer ---------------------------------------------------------- */

static void test_keepalive_pipelining(void **state) {
    script_bytes("pipelined", 2, 0.001);
    const char *body = "{\"prompt\":\"x\"}";
    gwt_conn *c = gwt_open(g_srv.port);
    /* three requests in one write; answers come back in order */
    gwt_sendf(c,
              "GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
              "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              "Content-Length: %zu\r\n\r\n%s"
              "GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n",
              strlen(body), body);
    gwt_resp r;
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.body, "ok");
    gwt_resp_free(&r);
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"text\":\"pipelined\""));
    gwt_resp_free(&r);
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"object\":\"list\""));
    gwt_resp_free(&r);
    /* still open */
    gwt_sendf(c, "GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 200);
    gwt_resp_free(&r);
    /* Connection: close is honoured */
    gwt_sendf(c, "GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    char v[32];
    assert_string_equal(gwt_header(&r, "Connection", v, sizeof v), "close");
    gwt_resp_free(&r);
    assert_true(gwt_wait_closed(c, 2));
    gwt_close(c);

    /* HTTP/1.0: closes unless keep-alive is asked for; a streamed body is unframed */
    c = gwt_open(g_srv.port);
    gwt_sendf(c,
              "GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /health HTTP/1.0\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_string_equal(gwt_header(&r, "Connection", v, sizeof v), "keep-alive");
    gwt_resp_free(&r);
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 200);
    gwt_resp_free(&r);
    assert_true(gwt_wait_closed(c, 2));
    gwt_close(c);
    c = gwt_open(g_srv.port);
    body = "{\"prompt\":\"x\",\"stream\":true}";
    gwt_sendf(c,
              "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
              "Content-Length: %zu\r\n\r\n%s",
              strlen(body), body);
    assert_int_equal(gwt_read(c, &r), 0); /* read to EOF */
    assert_false(r.chunked);
    assert_non_null(strstr(r.body, "data: [DONE]\n\n"));
    gwt_resp_free(&r);
    gwt_close(c);
}

static void test_chunked_request_body(void **state) {
    script_bytes("chunky", 1, 0.001);
    gwt_conn *c = gwt_open(g_srv.port);
    gwt_sendf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                 "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n");
    const char *parts[] = {"{\"messages\":[{\"ro", "le\":\"user\",\"content\":\"hé",
                           "llo\"}],\"max_tokens\":10}"};
    for (int i = 0; i < 3; i++) {
        gwt_sendf(c, "%zx;ext=1\r\n%s\r\n", strlen(parts[i]), parts[i]);
        usleep(20000);
    }
    gwt_sendf(c, "0\r\nX-Trailer: y\r\n\r\n");
    gwt_resp r;
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"content\":\"chunky\""));
    gwt_resp_free(&r);
    /* a chunk's CRLF split over reads: the part the parser has not seen yet
     * is checked when it arrives (the same request, answered the same) */
    gwt_sendf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                 "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n");
    for (int i = 0; i < 3; i++) {
        gwt_sendf(c, "%zx\r\n%s", strlen(parts[i]), parts[i]);
        usleep(20000);
        gwt_sendf(c, "\r");
        usleep(20000);
        gwt_sendf(c, "\n");
    }
    gwt_sendf(c, "0\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"content\":\"chunky\""));
    gwt_resp_free(&r);
    /* the rendered prompt is the one from the de-chunked body */
    pd_chat_message m = {.role = "user", .content = "héllo"};
    char *text;
    pd_err err;
    assert_int_equal(pd_chat_render(&m, 1, true, PD_TOK_DSV3_BOS, &text, &err), PD_OK);
    int n = 0;
    int32_t *ids = gwt_ids_encode(text, &n);
    pthread_mutex_lock(&g_srv.engine.mu);
    assert_int_equal(g_srv.engine.last_n_prompt, n);
    assert_memory_equal(g_srv.engine.last_prompt, ids, (size_t)n * sizeof *ids);
    pthread_mutex_unlock(&g_srv.engine.mu);
    free(ids);
    free(text);
    gwt_close(c);
}

/* Expect: 100-continue, done properly: the 100 must come before the body is sent. */
static void test_expect_continue(void **state) {
    script_bytes("yes", 1, 0.001);
    gwt_conn *c = gwt_open(g_srv.port);
    const char *body = "{\"prompt\":\"x\",\"max_tokens\":3}";
    gwt_sendf(c,
              "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              "Expect: 100-continue\r\nContent-Length: %zu\r\n\r\n",
              strlen(body));
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    assert_int_equal(poll(&p, 1, 2000), 1);
    char buf[64];
    ssize_t k = recv(c->fd, buf, sizeof buf - 1, MSG_PEEK);
    assert_true(k > 0);
    buf[k] = 0;
    assert_true(strncmp(buf, "HTTP/1.1 100 Continue\r\n\r\n", 25) == 0);
    gwt_send(c, body, strlen(body));
    gwt_resp r;
    assert_int_equal(gwt_read(c, &r), 0);
    assert_true(r.saw_100);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"text\":\"yes\""));
    gwt_resp_free(&r);
    gwt_close(c);
}

/* Reads the first response on c after only the headers were sent: it must
 * come within 2 s, and it must be the final answer, not 100 Continue. */
static void read_refusal_without_100(gwt_conn *c, gwt_resp *r) {
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    assert_int_equal(poll(&p, 1, 2000), 1);
    char buf[16];
    ssize_t k = recv(c->fd, buf, sizeof buf - 1, MSG_PEEK);
    assert_true(k >= 12);
    buf[k] = 0;
    assert_true(strncmp(buf, "HTTP/1.1 ", 9) == 0);
    assert_true(strncmp(buf + 9, "100", 3) != 0);
    assert_int_equal(gwt_read(c, r), 0);
    assert_false(r->saw_100);
}

/* Expect: 100-continue on a request that is refused whatever its body: the
 * refusal comes instead of 100 (RFC 9110 §10.1.1), with the status and
 * message a request sent whole gets, then the connection closes (after
 * discarding a body the client sends anyway). */
static void test_expect_refused_without_100(void **state) {
    script_bytes("yes", 1, 0.001);
    const char *body = "{\"prompt\":\"x\",\"max_tokens\":3}";
    static const struct {
        const char *method, *path, *ctype;
        int status;
        const char *allow;
    } cases[] = {
        {"POST", "/v1/completions", "text/plain", 415, NULL},
        {"POST", "/v1/chat/completions", NULL, 415, NULL},
        {"POST", "/v1/completions", "application/json; charset=latin-1", 415, NULL},
        {"POST", "/v1/nope", "application/json", 404, NULL},
        {"PUT", "/v1/completions", "application/json", 405, "POST"},
        {"POST", "/health", "application/json", 405, "GET, HEAD"},
        {"POST", "/tokenize", "text/plain", 415, NULL},
        {"GET", "/detokenize", "application/json", 405, "POST"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char ct[96] = "";
        if (cases[i].ctype)
            snprintf(ct, sizeof ct, "Content-Type: %s\r\n", cases[i].ctype);
        char head[512];
        snprintf(head, sizeof head, "%s %s HTTP/1.1\r\nHost: t\r\n%sContent-Length: %zu\r\n",
                 cases[i].method, cases[i].path, ct, strlen(body));

        /* the reference: the same request sent whole, without Expect */
        gwt_conn *c = gwt_open(g_srv.port);
        gwt_sendf(c, "%s\r\n%s", head, body);
        gwt_resp ref;
        assert_int_equal(gwt_read(c, &ref), 0);
        gwt_close(c);
        assert_int_equal(ref.status, cases[i].status);

        /* with Expect: the refusal comes before any body byte is sent */
        c = gwt_open(g_srv.port);
        gwt_sendf(c, "%sExpect: 100-continue\r\n\r\n", head);
        gwt_resp r;
        read_refusal_without_100(c, &r);
        if (r.status != cases[i].status)
            fprintf(stderr, "%s %s (%s): %d\n", cases[i].method, cases[i].path,
                    cases[i].ctype ? cases[i].ctype : "-", r.status);
        assert_int_equal(r.status, cases[i].status);
        json_t *j = jparse(r.body), *rj = jparse(ref.body);
        assert_string_equal(
            json_string_value(json_object_get(json_object_get(j, "error"), "message")),
            json_string_value(json_object_get(json_object_get(rj, "error"), "message")));
        json_decref(j);
        json_decref(rj);
        char v[64];
        if (cases[i].allow)
            assert_string_equal(gwt_header(&r, "Allow", v, sizeof v), cases[i].allow);
        else
            assert_null(gwt_header(&r, "Allow", v, sizeof v));
        assert_non_null(gwt_header(&r, "Connection", v, sizeof v));
        assert_string_equal(v, "close");
        /* odd cases send the body anyway: it is discarded, nothing else comes */
        if (i % 2)
            gwt_send(c, body, strlen(body));
        assert_true(gwt_wait_closed(c, 3));
        gwt_resp_free(&r);
        gwt_resp_free(&ref);
        gwt_close(c);
    }

    /* HTTP/1.0 has no 100 (the expectation is ignored, RFC 9110 §10.1.1): the
     * request is read whole and refused as usual */
    gwt_conn *c = gwt_open(g_srv.port);
    gwt_sendf(c,
              "POST /v1/completions HTTP/1.0\r\nContent-Type: text/plain\r\n"
              "Expect: 100-continue\r\nContent-Length: %zu\r\n\r\n%s",
              strlen(body), body);
    gwt_resp r;
    assert_int_equal(gwt_read(c, &r), 0);
    assert_false(r.saw_100);
    assert_int_equal(r.status, 415);
    gwt_resp_free(&r);
    gwt_close(c);

    /* without Expect the body is awaited, then refused on a connection that
     * stays open */
    c = gwt_open(g_srv.port);
    gwt_sendf(c,
              "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\n"
              "Content-Length: %zu\r\n\r\n",
              strlen(body));
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    assert_int_equal(poll(&p, 1, 200), 0);
    gwt_send(c, body, strlen(body));
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 415);
    gwt_resp_free(&r);
    gwt_sendf(c, "GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 200);
    gwt_resp_free(&r);
    gwt_close(c);

    /* an acceptable request still gets 100, then its answer, on both endpoints */
    const char *chat = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":3}";
    const char *paths[] = {"/v1/completions", "/v1/chat/completions"};
    const char *bodies[] = {body, chat};
    for (int i = 0; i < 2; i++) {
        script_bytes("yes", 1, 0.001);
        c = gwt_open(g_srv.port);
        gwt_sendf(c,
                  "POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json; charset=utf-8\r\n"
                  "Expect: 100-continue\r\nContent-Length: %zu\r\n\r\n",
                  paths[i], strlen(bodies[i]));
        assert_int_equal(poll(&p, 1, 2000), 1);
        char buf[32];
        ssize_t k = recv(c->fd, buf, 25, MSG_PEEK);
        assert_int_equal(k, 25);
        assert_true(memcmp(buf, "HTTP/1.1 100 Continue\r\n\r\n", 25) == 0);
        gwt_send(c, bodies[i], strlen(bodies[i]));
        assert_int_equal(gwt_read(c, &r), 0);
        assert_true(r.saw_100);
        assert_int_equal(r.status, 200);
        assert_non_null(strstr(r.body, "yes"));
        gwt_resp_free(&r);
        gwt_close(c);
    }
}

/* Reads the answer on c: its status, needle in its body (NULL: not
 * checked), the connection closed by the server (closes); then closes c. */
static void expect_answer(gwt_conn *c, int status, const char *needle, bool closes) {
    gwt_resp r;
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, status);
    if (needle)
        assert_non_null(strstr(r.body, needle));
    gwt_resp_free(&r);
    if (closes)
        assert_true(gwt_wait_closed(c, 2));
    gwt_close(c);
}

static void test_limits_and_timeouts(void **state) {
    pd_gw_config cfg;
    gwt_config(&cfg);
    cfg.max_request_body_bytes = 1024;
    cfg.max_header_bytes = 1024;
    cfg.max_header_count = 10;
    cfg.timeout_keep_alive_s = 0.3;
    cfg.timeout_request_headers_s = 0.3;
    cfg.timeout_request_body_s = 0.3;
    gwt_server h;
    assert_int_equal(gwt_server_start(&h, &cfg), 0);
    gwt_resp r;

    /* Content-Length over the limit: 413 before the body is read, then close */
    gwt_conn *c = gwt_open(h.port);
    gwt_sendf(c, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 "Content-Length: 2000\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 413);
    assert_non_null(strstr(r.body, "\"error\""));
    gwt_resp_free(&r);
    assert_true(gwt_wait_closed(c, 2));
    gwt_close(c);
    /* ... and with Expect, the client gets 413 instead of 100 */
    c = gwt_open(h.port);
    gwt_sendf(c, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 "Expect: 100-continue\r\nContent-Length: 2000\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_false(r.saw_100);
    assert_int_equal(r.status, 413);
    gwt_resp_free(&r);
    gwt_close(c);

    /* a chunked body that grows over the limit */
    c = gwt_open(h.port);
    gwt_sendf(c, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n");
    char big[600];
    memset(big, 'a', sizeof big);
    for (int i = 0; i < 2; i++) {
        gwt_sendf(c, "%zx\r\n", sizeof big);
        gwt_send(c, big, sizeof big);
        gwt_sendf(c, "\r\n");
    }
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 413);
    gwt_resp_free(&r);
    gwt_close(c);

    /* headers too large, too many headers */
    c = gwt_open(h.port);
    char hdr[1200];
    memset(hdr, 'x', sizeof hdr - 1);
    hdr[sizeof hdr - 1] = 0;
    gwt_sendf(c, "GET /health HTTP/1.1\r\nHost: t\r\nX-Big: %s\r\n\r\n", hdr);
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 431);
    gwt_resp_free(&r);
    gwt_close(c);
    c = gwt_open(h.port);
    gwt_sendf(c, "GET /health HTTP/1.1\r\n");
    for (int i = 0; i < 12; i++)
        gwt_sendf(c, "X-H%d: v\r\n", i);
    gwt_sendf(c, "\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 431);
    gwt_resp_free(&r);
    gwt_close(c);

    /* garbage */
    c = gwt_open(h.port);
    gwt_sendf(c, "HELLO THERE\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 400);
    gwt_resp_free(&r);
    assert_true(gwt_wait_closed(c, 2));
    gwt_close(c);
    /* a chunk whose data is not followed by CRLF: longer than its size, or
     * other bytes in the CRLF's place, at once or in a later read
     * (http-parser alone accepts any two bytes there: request smuggling) */
    static const char *bad_chunks[] = {"2\r\nabcdef\r\n0\r\n\r\n", "2\r\n{}XX0\r\n\r\n", "2\r\n{}\rX0\r\n\r\n"};
    for (int i = 0; i < 4; i++) {
        c = gwt_open(h.port);
        gwt_sendf(c, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n");
        if (i < 3) {
            gwt_sendf(c, "%s", bad_chunks[i]);
        } else { /* the bad byte in the next read */
            gwt_sendf(c, "2\r\n{}");
            usleep(50000);
            gwt_sendf(c, "X\n0\r\n\r\n");
        }
        expect_answer(c, 400, "not followed by CRLF", true);
    }
    /* a chunk declared over the body limit: 413 before its data */
    c = gwt_open(h.port);
    gwt_sendf(c, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n7fffffffffffffff\r\nabc");
    expect_answer(c, 413, "--max-request-body-bytes", false);
    /* a transfer coding other than chunked: 501 (RFC 9112 section 6.1) */
    static const char *codings[] = {"gzip, chunked", "deflate, chunked", "chunked, chunked"};
    for (int i = 0; i < 3; i++) {
        c = gwt_open(h.port);
        gwt_sendf(c, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: %s\r\n\r\n0\r\n\r\n", codings[i]);
        expect_answer(c, 501, "Transfer-Encoding", false);
    }
    /* Content-Length and Transfer-Encoding together (request smuggling) */
    c = gwt_open(h.port);
    gwt_sendf(c, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 400);
    gwt_resp_free(&r);
    gwt_close(c);

    /* an idle keep-alive connection is closed */
    c = gwt_open(h.port);
    gwt_sendf(c, "GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    gwt_resp_free(&r);
    double t0 = pd_now_s();
    assert_true(gwt_wait_closed(c, 3));
    assert_true(pd_now_s() - t0 < 2.0);
    gwt_close(c);
    /* a connection that never sends anything too */
    c = gwt_open(h.port);
    assert_true(gwt_wait_closed(c, 3));
    gwt_close(c);
    /* a request that stalls half-way: 408 */
    c = gwt_open(h.port);
    gwt_sendf(c, "GET /health HTTP/1.1\r\nHost: t\r\n");
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 408);
    gwt_resp_free(&r);
    gwt_close(c);
    /* HTTP/2 prior knowledge, then nothing: our SETTINGS, GOAWAY when idle, closed */
    c = gwt_open(h.port);
    gwt_send(c, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 24);
    assert_true(gwt_wait_closed(c, 2));
    gwt_close(c);
    gwt_server_stop(&h);
}

/* A 413 decided from Content-Length while the client is still uploading:
 * the gateway answers, then keeps reading and discarding (lingering close)
 * so that its close is a FIN, not a reset that would destroy the answer in
 * the client's receive queue. The client here does what most do: send the
 * whole body, then read. */
static void test_lingering_close(void **state) {
    pd_gw_config cfg;
    gwt_config(&cfg);
    cfg.max_request_body_bytes = 1024;
    gwt_server h;
    assert_int_equal(gwt_server_start(&h, &cfg), 0);
    size_t big_len = 8u << 20; /* far more than the socket buffers hold */
    char *big = malloc(big_len);
    assert_non_null(big);
    memset(big, 'a', big_len);
    for (int round = 0; round < 3; round++) {
        gwt_conn *c = gwt_open(h.port);
        gwt_sendf(c, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n",
                  big_len);
        assert_int_equal(gwt_send(c, big, big_len), 0); /* a reset would fail it */
        gwt_resp r;
        assert_int_equal(gwt_read(c, &r), 0);
        assert_int_equal(r.status, 413);
        json_t *j = jparse(r.body);
        const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
        assert_non_null(msg);
        assert_non_null(strstr(msg, "--max-request-body-bytes (1024 bytes)"));
        json_decref(j);
        gwt_resp_free(&r);
        /* the declared body has arrived: the gateway closes without waiting out the linger */
        double t0 = pd_now_s();
        assert_true(gwt_wait_closed(c, 5));
        assert_true(pd_now_s() - t0 < 1.0);
        gwt_close(c);
    }
    /* the linger is bounded: a client that declares much and sends on slowly
     * is closed about 2 s (GW_LINGER_S) after the answer */
    gwt_conn *c = gwt_open(h.port);
    gwt_sendf(c, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 "Content-Length: 100000000\r\n\r\n");
    gwt_resp r;
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 413);
    gwt_resp_free(&r);
    /* the write side is shut at once (EOF after the answer), the socket
     * closed when the linger ends: then a send draws a reset */
    assert_true(gwt_wait_closed(c, 1));
    double t0 = pd_now_s();
    while (pd_now_s() - t0 < 6 && gwt_send(c, big, 1000) == 0)
        usleep(50000);
    double waited = pd_now_s() - t0;
    assert_true(waited > 1.5 && waited < 4.0);
    gwt_close(c);
    free(big);
    gwt_server_stop(&h);
}

/* Slow clients, each limit on its own (the header and body deadlines differ,
 * so which one fired is visible in the time and the message). */
static void test_read_timeouts(void **state) {
    pd_gw_config cfg;
    gwt_config(&cfg);
    cfg.timeout_keep_alive_s = 0.4;
    cfg.timeout_request_headers_s = 0.5;
    cfg.timeout_request_body_s = 1.0;
    gwt_server h;
    assert_int_equal(gwt_server_start(&h, &cfg), 0);
    gwt_resp r;

    /* slowloris: a header line every 0.1 s, never the blank line: 408 at the
     * headers' deadline (from the first byte), though each byte is recent */
    gwt_conn *c = gwt_open(h.port);
    double t0 = pd_now_s();
    gwt_sendf(c, "GET /health HTTP/1.1\r\n");
    for (int i = 0; i < 30 && pd_now_s() - t0 < 2.5; i++) {
        usleep(100000);
        if (gwt_sendf(c, "X-%d: v\r\n", i))
            break; /* answered and closed */
    }
    assert_int_equal(gwt_read(c, &r), 0);
    double dt = pd_now_s() - t0;
    assert_int_equal(r.status, 408);
    assert_non_null(strstr(r.body, "--timeout-request-headers (0.5 s)"));
    assert_true(dt >= 0.45 && dt < 1.5);
    gwt_resp_free(&r);
    assert_true(gwt_wait_closed(c, 2));
    gwt_close(c);

    /* a body trickled one byte per 0.1 s: 408 at the body's deadline, counted
     * from the end of the headers */
    c = gwt_open(h.port);
    gwt_sendf(c, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 "Content-Length: 100\r\n\r\n");
    t0 = pd_now_s();
    for (int i = 0; i < 30 && pd_now_s() - t0 < 3; i++) {
        usleep(100000);
        if (gwt_send(c, "{", 1))
            break;
    }
    assert_int_equal(gwt_read(c, &r), 0);
    dt = pd_now_s() - t0;
    assert_int_equal(r.status, 408);
    assert_non_null(strstr(r.body, "--timeout-request-body (1 s)"));
    assert_true(dt >= 0.95 && dt < 2.0);
    gwt_resp_free(&r);
    gwt_close(c);

    /* a body that arrives in time, slowly but within the body deadline, is
     * served although headers + body took longer than the headers' deadline */
    c = gwt_open(h.port);
    const char *body = "{\"prompt\":\"hi\",\"max_tokens\":1}";
    gwt_sendf(c, "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 "Content-Length: %zu\r\n\r\n",
              strlen(body));
    for (size_t i = 0; i < strlen(body); i += 8) {
        usleep(40000);
        gwt_send(c, body + i, strlen(body) - i < 8 ? strlen(body) - i : 8);
    }
    assert_int_equal(gwt_read(c, &r), 0);
    assert_int_equal(r.status, 200);
    gwt_resp_free(&r);

    /* then idle on that keep-alive connection: closed after timeout_keep_alive_s */
    t0 = pd_now_s();
    assert_true(gwt_wait_closed(c, 3));
    dt = pd_now_s() - t0;
    assert_true(dt >= 0.35 && dt < 1.5);
    gwt_close(c);
    gwt_server_stop(&h);
}

/* --max-connections: one more than the limit gets 503 (naming the limit)
 * and is closed; a slot freed by a client is reused. */
static void test_max_connections(void **state) {
    pd_gw_config cfg;
    gwt_config(&cfg);
    cfg.max_connections = 3;
    gwt_server h;
    assert_int_equal(gwt_server_start(&h, &cfg), 0);
    gwt_resp r;
    gwt_conn *held[3];
    for (int i = 0; i < 3; i++) { /* a request on each: the server has accepted it */
        held[i] = gwt_open(h.port);
        gwt_sendf(held[i], "GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
        assert_int_equal(gwt_read(held[i], &r), 0);
        assert_int_equal(r.status, 200);
        gwt_resp_free(&r);
    }
    for (int k = 0; k < 2; k++) {
        gwt_conn *c = gwt_open(h.port);
        if (k == 1) /* with the request already sent: still a clean 503 */
            gwt_sendf(c, "GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
        assert_int_equal(gwt_read(c, &r), 0);
        assert_int_equal(r.status, 503);
        assert_non_null(strstr(r.body, "--max-connections (3)"));
        char v[16];
        assert_non_null(gwt_header(&r, "Retry-After", v, sizeof v));
        gwt_resp_free(&r);
        assert_true(gwt_wait_closed(c, 2));
        gwt_close(c);
    }
    /* the held connections still work */
    gwt_sendf(held[0], "GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_int_equal(gwt_read(held[0], &r), 0);
    assert_int_equal(r.status, 200);
    gwt_resp_free(&r);
    gwt_close(held[1]);
    int status = 0;
    for (int i = 0; i < 50 && status != 200; i++) { /* the server notices the close */
        usleep(20000);
        gwt_conn *c = gwt_open(h.port);
        gwt_sendf(c, "GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
        if (gwt_read(c, &r) == 0) {
            status = r.status;
            gwt_resp_free(&r);
        }
        gwt_close(c);
    }
    assert_int_equal(status, 200);
    gwt_close(held[0]);
    gwt_close(held[2]);
    gwt_server_stop(&h);
}

typedef struct {
    int port;
    gwt_conn *c;
    int n;
} writer_arg;

static void *pipeline_writer(void *arg) {
    writer_arg *w = arg;
    for (int i = 0; i < w->n; i++)
        if (gwt_sendf(w->c, "GET /v1/models/test-model HTTP/1.1\r\nHost: t\r\nX-I: %d\r\n\r\n", i))
            break;
    return NULL;
}

static void test_backpressure_pipelining(void **state) {
    pd_gw_config cfg;
    gwt_config(&cfg);
    cfg.output_high_water_bytes = 4096;
    gwt_server h;
    assert_int_equal(gwt_server_start(&h, &cfg), 0);
    gwt_conn *c = gwt_open(h.port);
    writer_arg w = {h.port, c, 3000};
    pthread_t th;
    pthread_create(&th, NULL, pipeline_writer, &w);
    usleep(200000); /* let the server run into its high-water mark */
    int ok = 0;
    for (int i = 0; i < w.n; i++) {
        gwt_resp r;
        if (gwt_read(c, &r) != 0)
            break;
        if (r.status == 200 && strstr(r.body, "\"id\":\"test-model\""))
            ok++;
        gwt_resp_free(&r);
    }
    pthread_join(th, NULL);
    assert_int_equal(ok, w.n);
    gwt_close(c);
    gwt_server_stop(&h);
}

/* A huge prompt is tokenized on a worker: other connections are served
 * meanwhile. */
static void test_tokenize_off_loop(void **state) {
    size_t n = 6u << 20;
    char *body = malloc(n + 64);
    size_t off = (size_t)sprintf(body, "{\"prompt\":\"");
    srand(7);
    while (off < n) {
        int w = 2 + rand() % 9;
        for (int i = 0; i < w; i++)
            body[off++] = "abcdefghijklmnopqrstuvwxyz"[rand() % 26];
        body[off++] = ' ';
    }
    off += (size_t)sprintf(body + off, "\"}");
    gwt_conn *a = gwt_open(g_srv.port);
    gwt_sendf(a,
              "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              "Content-Length: %zu\r\n\r\n",
              off);
    gwt_send(a, body, off);
    double t0 = pd_now_s();
    gwt_resp r;
    int before_a = 0;
    for (int i = 0; i < 5; i++) {
        assert_int_equal(gwt_get(g_srv.port, "/health", &r), 0);
        assert_int_equal(r.status, 200);
        gwt_resp_free(&r);
        struct pollfd p = {.fd = a->fd, .events = POLLIN};
        if (poll(&p, 1, 0) == 0)
            before_a++;
    }
    double t_health = pd_now_s() - t0;
    assert_int_equal(gwt_read(a, &r), 0);
    double t_a = pd_now_s() - t0;
    /* ~3M tokens > max_model_len: refused, naming the prompt length */
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(r.body, "maximum context length is 4096"));
    gwt_resp_free(&r);
    fprintf(stderr, "  5 x /health in %.3f s while the big prompt took %.3f s\n", t_health, t_a);
    assert_true(before_a >= 1); /* /health answered while A was still being tokenized */
    gwt_close(a);
    free(body);
}

static void test_sse_pings(void **state) {
    pd_gw_config cfg;
    gwt_config(&cfg);
    cfg.sse_ping_interval_s = 0.05;
    gwt_server h;
    assert_int_equal(gwt_server_start(&h, &cfg), 0);
    int n = 0;
    int32_t *ids = gwt_ids_bytewise("late", &n);
    gwt_script s = gwt_script_ids(ids, n);
    s.first_delay_s = 0.4;
    gwt_engine_set(&h.engine, &s);
    free(ids);
    gwt_resp r;
    assert_int_equal(gwt_post(h.port, "/v1/completions", "{\"prompt\":\"x\",\"stream\":true}", &r),
                     0);
    gwt_sse sse;
    gwt_sse_parse(r.body, r.body_len, &sse);
    assert_true(sse.n_comments >= 3);
    assert_int_equal(sse.bad, 0);
    assert_string_equal(sse.data[sse.n - 1], "[DONE]");
    /* no ping after the first token */
    const char *first_data = strstr(r.body, "data: ");
    assert_null(strstr(first_data, ": ping"));
    gwt_sse_free(&sse);
    gwt_resp_free(&r);
    gwt_server_stop(&h);
}

static int setup(void **state) {
    if (!gwt_tokenizer())
        return -1;
    return gwt_server_start(&g_srv, NULL);
}

static int teardown(void **state) {
    gwt_server_stop(&g_srv);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_health_and_models),
        cmocka_unit_test(test_tokenize_endpoints),
        cmocka_unit_test(test_not_found_and_method),
        cmocka_unit_test(test_host_header),
        cmocka_unit_test(test_extra_get_handler_and_ready),
        cmocka_unit_test(test_content_type),
        cmocka_unit_test(test_validation_errors_http),
        cmocka_unit_test(test_completion_full),
        cmocka_unit_test(test_chat_full_and_stream_equal),
        cmocka_unit_test(test_completion_stream_and_echo),
        cmocka_unit_test(test_utf8_never_split),
        cmocka_unit_test(test_stop_strings),
        cmocka_unit_test(test_special_tokens_accounted),
        cmocka_unit_test(test_stop_token_ids),
        cmocka_unit_test(test_choice_abort),
        cmocka_unit_test(test_x_request_id),
        cmocka_unit_test(test_n_choices),
        cmocka_unit_test(test_logprobs),
        cmocka_unit_test(test_top_logprobs),
        cmocka_unit_test(test_engine_errors),
        cmocka_unit_test(test_disconnect_aborts),
        cmocka_unit_test(test_half_close),
        cmocka_unit_test(test_keepalive_pipelining),
        cmocka_unit_test(test_chunked_request_body),
        cmocka_unit_test(test_expect_continue),
        cmocka_unit_test(test_expect_refused_without_100),
        cmocka_unit_test(test_limits_and_timeouts),
        cmocka_unit_test(test_lingering_close),
        cmocka_unit_test(test_read_timeouts),
        cmocka_unit_test(test_max_connections),
        cmocka_unit_test(test_backpressure_pipelining),
        cmocka_unit_test(test_tokenize_off_loop),
        cmocka_unit_test(test_sse_pings),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

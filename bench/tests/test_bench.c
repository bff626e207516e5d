/* Unit tests of `pdserve bench` without a network: the SSE parser fed at
 * every split point, each strictness rule and their precedence, non-streamed
 * bodies, streamed tool calls, percentiles and round measures, and prompts of
 * an exact token length with the DeepSeek-V3 tokenizer
 * (PD_CACHE_DIR/tokenizer-deepseek_v3/tokenizer.json, fetched by
 * deploy/fetch-tokenizer.sh). The same rules against a live misbehaving
 * server: tests/integration/test_bench_fake.py. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "pd_bench.h"

/* cmocka 1.1 has no assert_double_equal */
#define assert_near(a, b, eps)                                                                     \
    do {                                                                                           \
        double a_ = (a), b_ = (b);                                                                 \
        if (!(fabs(a_ - b_) <= (eps)))                                                             \
            fail_msg("%s = %.12g, expected %.12g", #a, a_, b_);                                    \
    } while (0)

/* ---- helpers --------------------------------------------------------------------- */

static const char good_stream[] =
    ": keep-alive comment\r\n"
    "data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"Hel\","
    "\"finish_reason\":null}]}\r\n\r\n"
    "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\"lo \\u00e9t\\u00e9\","
    "\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\" \xe2\x82\xac\","
    "\"finish_reason\":\"length\"}]}\n\n"
    "id: 7\nretry: 100\n"
    "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3,"
    "\"total_tokens\":8}}\n\n"
    "data: [DONE]\n\n";

static void start(pd_bench_req *r, pd_bench_endpoint ep, bool stream, int max_tokens, bool exact) {
    pd_bench_req_init(r);
    r->endpoint = ep;
    r->stream = stream;
    r->max_tokens = max_tokens;
    r->exact_length = exact;
    r->t_start = 100.0;
    r->http_status = 200;
}

/* Feeds body in pieces of `step` bytes (0: one piece), time advancing 1 ms
 * per piece, and finishes with transport. */
static void feed_all(pd_bench_req *r, const char *body, size_t len, size_t step, int transport) {
    double t = 100.0;
    if (step == 0)
        step = len ? len : 1;
    for (size_t i = 0; i < len; i += step) {
        t += 0.001;
        pd_bench_req_feed(r, body + i, len - i < step ? len - i : step, t);
    }
    pd_bench_req_finish(r, transport, transport == 1 ? "curl 28: Timeout" : "curl 18: partial",
                        t + 0.001);
}

static pd_bench_outcome classify(const char *body, int max_tokens, bool exact, int transport,
                                 long status) {
    pd_bench_req r;
    start(&r, PD_BENCH_EP_COMPLETIONS, true, max_tokens, exact);
    r.http_status = status;
    feed_all(&r, body, strlen(body), 0, transport);
    pd_bench_outcome o = r.outcome;
    pd_bench_req_clear(&r);
    return o;
}

/* ---- SSE ------------------------------------------------------------------------------ */

static void test_sse_every_split(void **state) {
    (void)state;
    size_t len = sizeof good_stream - 1;
    for (size_t step = 0; step <= len; step = step ? step + 1 : 1) {
        pd_bench_req r;
        start(&r, PD_BENCH_EP_COMPLETIONS, true, 3, true);
        feed_all(&r, good_stream, len, step, 0);
        if (r.outcome != PD_BENCH_SUCCESS)
            fail_msg("step %zu: %s: %s", step, pd_bench_outcome_str(r.outcome), r.detail);
        assert_string_equal(r.text.data, "Hello \xc3\xa9t\xc3\xa9 \xe2\x82\xac");
        assert_int_equal(r.n_fragments, 3); /* the empty fragment does not count */
        assert_true(r.done);
        assert_int_equal(r.prompt_tokens, 5);
        assert_int_equal(r.completion_tokens, 3);
        assert_string_equal(r.finish_reason, "length");
        assert_int_equal(r.raw.len, len);
        assert_true(pd_bench_req_ttft(&r) > 0);
        assert_true(pd_bench_req_tpot(&r) >= 0);
        assert_true(pd_bench_req_e2e(&r) >= pd_bench_req_ttft(&r));
        pd_bench_req_clear(&r);
        if (step > 64 && step < len - 8)
            step = len - 8; /* every small split, then the last few */
    }
}

static void test_timing(void **state) {
    (void)state;
    /* three fragments at 10, 20 and 40 ms with 5 completion tokens: TTFT 10 ms,
     * TPOT (40 - 10) / 4 ms */
    pd_bench_req r;
    start(&r, PD_BENCH_EP_COMPLETIONS, true, 5, true);
    const char *ev[] = {"data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
                        "data: {\"choices\":[{\"text\":\"bc\"}]}\n\n",
                        "data: {\"choices\":[{\"text\":\"de\"}],\"usage\":{\"prompt_tokens\":2,"
                        "\"completion_tokens\":5}}\n\ndata: [DONE]\n\n"};
    double ts[] = {100.010, 100.020, 100.040};
    for (int i = 0; i < 3; i++)
        pd_bench_req_feed(&r, ev[i], strlen(ev[i]), ts[i]);
    pd_bench_req_finish(&r, 0, NULL, 100.050);
    assert_int_equal(r.outcome, PD_BENCH_SUCCESS);
    assert_near(pd_bench_req_ttft(&r), 0.010, 1e-9);
    assert_near(pd_bench_req_tpot(&r), 0.030 / 4, 1e-9);
    assert_near(pd_bench_req_e2e(&r), 0.050, 1e-9);
    pd_bench_req_clear(&r);
}

/* ---- each rule ------------------------------------------------------------------------ */

#define EV(text) "data: {\"choices\":[{\"index\":0,\"text\":\"" text "\"}]}\n\n"
#define USAGE(p, c)                                                                                \
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":" #p ",\"completion_tokens\":" #c          \
    ",\"total_tokens\":" #p "+" #c "}}\n\n"
#define USAGE_OK(c)                                                                                \
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":" #c "}}\n\n"
#define DONE "data: [DONE]\n\n"

static void test_rules(void **state) {
    (void)state;
    assert_int_equal(classify(EV("a") EV("b") USAGE_OK(2) DONE, 2, true, 0, 200), PD_BENCH_SUCCESS);
    /* empty text: 200, [DONE], usage says 2 tokens, but nothing to read */
    assert_int_equal(classify(EV("") EV("") USAGE_OK(2) DONE, 2, true, 0, 200),
                     PD_BENCH_EMPTY_TEXT);
    assert_int_equal(classify(USAGE_OK(2) DONE, 2, true, 0, 200), PD_BENCH_EMPTY_TEXT);
    /* no [DONE] on a cleanly ended stream */
    assert_int_equal(classify(EV("a") EV("b") USAGE_OK(2), 2, true, 0, 200), PD_BENCH_NO_DONE);
    /* wrong length under ignore_eos; shorter is fine without it, longer never */
    assert_int_equal(classify(EV("a") USAGE_OK(1) DONE, 2, true, 0, 200), PD_BENCH_WRONG_LENGTH);
    assert_int_equal(classify(EV("a") USAGE_OK(1) DONE, 2, false, 0, 200), PD_BENCH_SUCCESS);
    assert_int_equal(classify(EV("a") USAGE_OK(3) DONE, 2, false, 0, 200), PD_BENCH_WRONG_LENGTH);
    /* usage: absent, inconsistent, not integers, zero with text */
    assert_int_equal(classify(EV("a") EV("b") DONE, 2, true, 0, 200), PD_BENCH_BAD_USAGE);
    assert_int_equal(classify(EV("a") "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,"
                                      "\"completion_tokens\":2,\"total_tokens\":7}}\n\n" DONE,
                              2, true, 0, 200),
                     PD_BENCH_BAD_USAGE);
    assert_int_equal(classify(EV("a") "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,"
                                      "\"completion_tokens\":\"2\"}}\n\n" DONE,
                              2, true, 0, 200),
                     PD_BENCH_BAD_USAGE);
    assert_int_equal(classify(EV("a") USAGE_OK(0) DONE, 2, false, 0, 200), PD_BENCH_BAD_USAGE);
    /* SSE errors: error object, event: error, malformed JSON, data after [DONE] */
    assert_int_equal(classify(EV("a") "data: {\"error\":{\"message\":\"boom\"}}\n\n" USAGE_OK(1)
                                  DONE,
                              1, true, 0, 200),
                     PD_BENCH_SSE_ERROR);
    assert_int_equal(classify(EV("a") "event: error\ndata: {\"message\":\"x\"}\n\n" USAGE_OK(1)
                                  DONE,
                              1, true, 0, 200),
                     PD_BENCH_SSE_ERROR);
    assert_int_equal(
        classify(EV("a") "data: {\"choices\": [\n\n" USAGE_OK(1) DONE, 1, true, 0, 200),
        PD_BENCH_SSE_ERROR);
    assert_int_equal(classify(EV("a") USAGE_OK(1) DONE EV("b"), 1, true, 0, 200),
                     PD_BENCH_SSE_ERROR);
    assert_int_equal(classify(EV("a") "data: [1,2]\n\n" USAGE_OK(1) DONE, 1, true, 0, 200),
                     PD_BENCH_SSE_ERROR);
    /* a JSON body where a stream was asked for is not SSE */
    assert_int_equal(classify("{\"choices\":[{\"text\":\"a\"}],\"usage\":{\"prompt_tokens\":1,"
                              "\"completion_tokens\":1}}",
                              1, true, 0, 200),
                     PD_BENCH_SSE_ERROR);
    /* invalid UTF-8: raw bytes, and a lone surrogate escape */
    assert_int_equal(classify(EV("a\xff") USAGE_OK(1) DONE, 1, true, 0, 200),
                     PD_BENCH_INVALID_UTF8);
    assert_int_equal(classify(EV("a\xc0\xaf") USAGE_OK(1) DONE, 1, true, 0, 200),
                     PD_BENCH_INVALID_UTF8);
    assert_int_equal(classify(EV("a\\udc80") USAGE_OK(1) DONE, 1, true, 0, 200),
                     PD_BENCH_INVALID_UTF8);
    /* transport */
    assert_int_equal(classify(EV("a"), 2, true, 2, 200), PD_BENCH_DISCONNECT);
    assert_int_equal(classify("", 2, true, 2, 0), PD_BENCH_DISCONNECT);
    assert_int_equal(classify("", 2, true, 1, 0), PD_BENCH_TIMEOUT);
    assert_int_equal(classify(EV("a"), 2, true, 1, 200), PD_BENCH_TIMEOUT);
    assert_int_equal(classify("", 2, true, 0, 0), PD_BENCH_DISCONNECT);
    /* status */
    assert_int_equal(classify("{\"error\":{\"message\":\"no\"}}", 2, true, 0, 500),
                     PD_BENCH_HTTP_STATUS);
    assert_int_equal(classify(EV("a") USAGE_OK(1) DONE, 1, true, 0, 404), PD_BENCH_HTTP_STATUS);
}

static void test_precedence(void **state) {
    (void)state;
    /* what the server said wrong comes before what it left out */
    assert_int_equal(classify(EV("\xff") DONE, 1, true, 0, 200), PD_BENCH_INVALID_UTF8);
    assert_int_equal(classify(EV("\xff") "data: {bad\n\n", 1, true, 0, 200), PD_BENCH_INVALID_UTF8);
    assert_int_equal(classify("data: {bad\n\n" EV("\xff"), 1, true, 0, 200), PD_BENCH_INVALID_UTF8);
    assert_int_equal(classify("data: {bad\n\n", 1, true, 1, 200), PD_BENCH_SSE_ERROR);
    assert_int_equal(classify("data: {bad\n\n", 1, true, 0, 503), PD_BENCH_HTTP_STATUS);
    assert_int_equal(classify(EV(""), 1, true, 0, 200), PD_BENCH_NO_DONE);
    assert_int_equal(classify(EV("") DONE, 1, true, 0, 200), PD_BENCH_EMPTY_TEXT);
    assert_int_equal(classify(EV("a") DONE, 1, true, 0, 200), PD_BENCH_BAD_USAGE);
    /* the last event without its blank line is still read */
    assert_int_equal(classify(EV("a") USAGE_OK(1) "data: [DONE]", 1, true, 0, 200),
                     PD_BENCH_SUCCESS);
}

static void test_nonstream_and_chat(void **state) {
    (void)state;
    pd_bench_req r;
    const char *body = "{\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":"
                       "\"42\"},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":9,"
                       "\"completion_tokens\":2,\"total_tokens\":11}}";
    for (size_t step = 1; step <= strlen(body); step += 7) {
        start(&r, PD_BENCH_EP_CHAT, false, 16, false);
        feed_all(&r, body, strlen(body), step, 0);
        assert_int_equal(r.outcome, PD_BENCH_SUCCESS);
        assert_string_equal(r.text.data, "42");
        assert_true(isnan(pd_bench_req_ttft(&r)));
        pd_bench_req_clear(&r);
    }
    /* a 200 body that is an error object */
    start(&r, PD_BENCH_EP_CHAT, false, 16, false);
    const char *err = "{\"error\":{\"message\":\"bad\"}}";
    feed_all(&r, err, strlen(err), 0, 0);
    assert_int_equal(r.outcome, PD_BENCH_SSE_ERROR);
    pd_bench_req_clear(&r);
    /* streamed chat with a tool call split over deltas: no text, not empty */
    const char *tc =
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n"
        "data: "
        "{\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\","
        "\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"ci\"}}]}"
        "}]}\n\n"
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":"
        "{\"arguments\":\"ty\\\": "
        "\\\"Paris\\\"}\"}}]},\"finish_reason\":\"tool_calls\"}]}\n\n" USAGE_OK(7) DONE;
    start(&r, PD_BENCH_EP_CHAT, true, 16, false);
    feed_all(&r, tc, strlen(tc), 5, 0);
    assert_int_equal(r.outcome, PD_BENCH_SUCCESS);
    assert_int_equal(json_array_size(r.tool_calls), 1);
    json_t *c0 = json_array_get(r.tool_calls, 0);
    assert_string_equal(json_string_value(json_object_get(c0, "name")), "get_weather");
    assert_string_equal(json_string_value(json_object_get(c0, "arguments")),
                        "{\"city\": \"Paris\"}");
    assert_string_equal(json_string_value(json_object_get(c0, "id")), "call_1");
    assert_string_equal(r.finish_reason, "tool_calls");
    pd_bench_req_clear(&r);
    /* chat content null and reasoning text: TTFT from the reasoning */
    const char *rs =
        "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"hm\",\"content\":null}}]}\n\n"
        "data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}]}\n\n" USAGE_OK(2) DONE;
    start(&r, PD_BENCH_EP_CHAT, true, 2, true);
    feed_all(&r, rs, strlen(rs), 0, 0);
    assert_int_equal(r.outcome, PD_BENCH_SUCCESS);
    assert_string_equal(r.text.data, "ok");
    pd_bench_req_clear(&r);
}

/* ---- statistics -------------------------------------------------------------------------- */

static void test_percentiles(void **state) {
    (void)state;
    double v[] = {4, 1, 3, 2};
    /* numpy.percentile([1,2,3,4], [50, 95]) = 2.5, 3.85 */
    assert_near(pd_bench_percentile(v, 4, 50), 2.5, 1e-12);
    assert_near(pd_bench_percentile(v, 4, 95), 3.85, 1e-12);
    assert_near(pd_bench_percentile(v, 4, 0), 1, 1e-12);
    assert_near(pd_bench_percentile(v, 4, 100), 4, 1e-12);
    double one[] = {7};
    assert_near(pd_bench_percentile(one, 1, 95), 7, 0);
    assert_true(isnan(pd_bench_percentile(v, 0, 50)));
    double m[] = {NAN, 5, 1, NAN, 3};
    assert_near(pd_bench_median(m, 5), 3, 0);
    double d[] = {1, NAN, 2, 3};
    pd_bench_dist dd = pd_bench_dist_of(d, 4);
    assert_int_equal(dd.n, 3);
    assert_near(dd.mean, 2, 1e-12);
    assert_near(dd.max, 3, 0);
}

static void test_round(void **state) {
    (void)state;
    pd_bench_req r[4];
    for (int i = 0; i < 4; i++) {
        pd_bench_req_init(&r[i]);
        r[i].stream = true;
        r[i].t_start = 10;
        r[i].t_first = 10 + 0.5 * (i + 1); /* TTFT 0.5, 1.0, 1.5, 2.0 */
        r[i].t_last = r[i].t_first + 0.3;  /* TPOT 0.1 with 4 tokens */
        r[i].t_end = r[i].t_last + 0.01;
        r[i].completion_tokens = 4;
        r[i].prompt_tokens = 100;
        r[i].prompt_tokens_local = i == 3 ? 99 : 100;
    }
    r[2].outcome = PD_BENCH_NO_DONE; /* failures stay in the denominator */
    pd_bench_round rd = {.round = 2};
    pd_bench_round_compute(r, 4, 10, 14, 1.2, 0.2, &rd);
    assert_int_equal(rd.round, 2);
    assert_true(rd.run);
    assert_int_equal(rd.requests, 4);
    assert_int_equal(rd.successes, 3);
    assert_int_equal(rd.failures[PD_BENCH_NO_DONE], 1);
    assert_int_equal(rd.output_tokens, 12);
    assert_near(rd.throughput_tok_s, 3.0, 1e-12);
    assert_near(rd.ttft.p50, 1.0, 1e-12);
    assert_near(rd.tpot.p50, 0.1, 1e-12);
    assert_int_equal(rd.slo_compliant, 2); /* TTFT 0.5 and 1.0 pass, 2.0 does not */
    assert_near(rd.slo_ratio, 0.5, 1e-12);
    assert_int_equal(rd.prompt_mismatches, 1);
}

/* ---- prompts ------------------------------------------------------------------------------ */

static pd_bench_tok bt;

static int load_tok(void **state) {
    (void)state;
    char path[4096];
    const char *c = getenv("PD_CACHE_DIR");
    if (c && *c)
        snprintf(path, sizeof path, "%s/tokenizer-deepseek_v3/tokenizer.json", c);
    else
        snprintf(path, sizeof path, "%s/.cache/tokenizer-deepseek_v3/tokenizer.json",
                 PD_SOURCE_DIR);
    pd_err err = {{0}};
    if (pd_bench_tok_load(path, &bt, &err) != PD_OK) {
        fprintf(stderr, "cannot load %s: %s (deploy/fetch-tokenizer.sh)\n", path, err.msg);
        return -1;
    }
    return 0;
}

static int free_tok(void **state) {
    (void)state;
    pd_bench_tok_free(&bt);
    return 0;
}

static void test_prompt_exact(void **state) {
    (void)state;
    assert_true(bt.add_bos); /* DeepSeek-V3's tokenizer_config.json */
    assert_true(bt.bos_id >= 0);
    assert_int_equal(bt.chat_overhead, 3); /* BOS, <｜User｜>, <｜Assistant｜> */
    pd_rng rng;
    pd_rng_seed(&rng, 7);
    int ns[] = {1, 2, 3, 7, 31, 64, 100, 257, 1000};
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
        char *text = NULL;
        pd_err err = {{0}};
        assert_int_equal(pd_bench_prompt_text(bt.tok, &rng, ns[i], &text, &err), PD_OK);
        int32_t *ids = NULL;
        size_t n = 0;
        assert_int_equal(pd_tok_encode(bt.tok, text, strlen(text), true, &ids, &n, &err), PD_OK);
        assert_int_equal(n, ns[i]);
        assert_int_equal(pd_bench_chat_tokens(&bt, text), ns[i] + bt.chat_overhead);
        free(ids);
        free(text);
    }
    int32_t *ids = NULL;
    pd_err err = {{0}};
    assert_int_equal(pd_bench_prompt_ids(bt.tok, &rng, 50, &ids, &err), PD_OK);
    free(ids);
    char *text = NULL;
    assert_int_equal(pd_bench_prompt_text(bt.tok, &rng, 0, &text, &err), PD_ERR_INVALID);
}

static void test_retrieval(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, 3);
    int ns[] = {256, 512, 3000};
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
        pd_bench_retrieval rt;
        pd_err err = {{0}};
        assert_int_equal(pd_bench_retrieval_build(&bt, &rng, ns[i], &rt, &err), PD_OK);
        assert_int_equal(rt.tokens, ns[i]);
        assert_int_equal(pd_bench_chat_tokens(&bt, rt.content), ns[i]);
        /* the codes sit in order at about 10%, 50%, 90% of the document (the
         * text before the question) */
        const char *q = strstr(rt.content, "\n\nThe document above hides");
        assert_non_null(q);
        size_t len = (size_t)(q - rt.content);
        double pos[3];
        for (int k = 0; k < 3; k++) {
            const char *at = strstr(rt.content, rt.codes[k]);
            assert_non_null(at);
            assert_non_null(strstr(rt.content, rt.names[k]));
            pos[k] = (double)(at - rt.content) / (double)len;
        }
        assert_true(pos[0] > 0.03 && pos[0] < 0.2);
        assert_true(pos[1] > 0.4 && pos[1] < 0.6);
        assert_true(pos[2] > 0.8 && pos[2] < 0.97);
        char ans[256];
        snprintf(ans, sizeof ans,
                 "Sure:\n```json\n{\"%s\": \"%s\", \"%s\": \"%s\", \"%s\": \"%s\"}\n```",
                 rt.names[0], rt.codes[0], rt.names[1], rt.codes[1], rt.names[2], rt.codes[2]);
        assert_int_equal(pd_bench_retrieval_score(&rt, ans), 3);
        snprintf(ans, sizeof ans, "{\"%s\": \"%s\", \"%s\": \"WRONG\"}", rt.names[1], rt.codes[1],
                 rt.names[0]);
        assert_int_equal(pd_bench_retrieval_score(&rt, ans), 1);
        assert_int_equal(pd_bench_retrieval_score(&rt, "no idea"), 0);
        assert_int_equal(pd_bench_retrieval_score(&rt, "{broken"), 0);
        assert_int_equal(pd_bench_retrieval_score(&rt, NULL), 0);
        pd_bench_retrieval_free(&rt);
    }
    pd_bench_retrieval rt;
    pd_err err = {{0}};
    assert_int_equal(pd_bench_retrieval_build(&bt, &rng, 100, &rt, &err), PD_ERR_INVALID);
}

int main(void) {
    const struct CMUnitTest plain[] = {
        cmocka_unit_test(test_sse_every_split),
        cmocka_unit_test(test_timing),
        cmocka_unit_test(test_rules),
        cmocka_unit_test(test_precedence),
        cmocka_unit_test(test_nonstream_and_chat),
        cmocka_unit_test(test_percentiles),
        cmocka_unit_test(test_round),
    };
    const struct CMUnitTest tok[] = {
        cmocka_unit_test(test_prompt_exact),
        cmocka_unit_test(test_retrieval),
    };
    int rc = cmocka_run_group_tests_name("bench", plain, NULL, NULL);
    rc += cmocka_run_group_tests_name("bench_prompts", tok, load_tok, free_tok);
    return rc;
}

/* Tests of the chat output parsers (chat/pd_chat.h).
 *
 * Expected values are the formats of pd_chat.h applied by hand (reasoning
 * up to "</think>", the V3 / V3.1 / DSML tool-call forms). Properties on
 * top: for every input, feeding it split into 2 pieces at every byte
 * position, and into 3 pieces at every pair of positions, gives the same
 * content, reasoning and tool calls as feeding it whole; output whose calls
 * are all malformed comes back as content byte for byte.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "pd_chat.h"

#define CALLS "<｜tool▁calls▁begin｜>"
#define CALLE "<｜tool▁calls▁end｜>"
#define CB    "<｜tool▁call▁begin｜>"
#define CE    "<｜tool▁call▁end｜>"
#define SEP   "<｜tool▁sep｜>"
#define FC    "<｜DSML｜function_calls>"
#define FCE   "</｜DSML｜function_calls>"
#define INV   "<｜DSML｜invoke"
#define INVE  "</｜DSML｜invoke>"
#define PAR   "<｜DSML｜parameter"
#define PARE  "</｜DSML｜parameter>"

typedef struct {
    char content[4096], reasoning[4096];
    size_t nc, nr;
    char calls[8][2][512]; /* name, arguments */
    int n_calls;
    int order_err; /* a reasoning event after content or a call */
    bool seen_answer;
} result;

static void on_event(void *ud, const pd_chat_event *ev) {
    result *r = ud;
    switch (ev->kind) {
    case PD_CHAT_EV_CONTENT:
        assert_true(ev->len > 0);
        assert_true(r->nc + ev->len < sizeof r->content);
        memcpy(r->content + r->nc, ev->text, ev->len);
        r->nc += ev->len;
        r->seen_answer = true;
        break;
    case PD_CHAT_EV_REASONING:
        assert_true(ev->len > 0);
        assert_true(r->nr + ev->len < sizeof r->reasoning);
        memcpy(r->reasoning + r->nr, ev->text, ev->len);
        r->nr += ev->len;
        if (r->seen_answer)
            r->order_err++;
        break;
    case PD_CHAT_EV_TOOL_CALL:
        assert_int_equal(ev->tool_index, r->n_calls);
        assert_true(r->n_calls < 8);
        snprintf(r->calls[r->n_calls][0], 512, "%s", ev->name);
        snprintf(r->calls[r->n_calls][1], 512, "%s", ev->arguments);
        r->n_calls++;
        r->seen_answer = true;
        break;
    }
}

/* Feeds s cut at the cut positions (ascending, n_cuts of them). */
static void run(const pd_chat_parser_opts *o, const char *s, const size_t *cuts, int n_cuts,
                result *r) {
    memset(r, 0, sizeof *r);
    pd_chat_parser *p = pd_chat_parser_new(o, on_event, r);
    assert_non_null(p);
    size_t at = 0, n = strlen(s);
    for (int i = 0; i <= n_cuts; i++) {
        size_t end = i < n_cuts ? cuts[i] : n;
        assert_int_equal(pd_chat_parser_feed(p, s + at, end - at), PD_OK);
        at = end;
    }
    assert_int_equal(pd_chat_parser_finish(p), PD_OK);
    assert_int_equal(pd_chat_parser_finish(p), PD_OK);
    assert_int_equal(pd_chat_parser_feed(p, "x", 1), PD_ERR_INVALID);
    assert_int_equal(pd_chat_parser_n_tool_calls(p), r->n_calls);
    pd_chat_parser_free(&p);
    assert_null(p);
    r->content[r->nc] = 0;
    r->reasoning[r->nr] = 0;
    assert_int_equal(r->order_err, 0);
}

static void same(const result *a, const result *b, const char *s, const size_t *cuts, int n_cuts) {
    bool ok = a->nc == b->nc && a->nr == b->nr && !memcmp(a->content, b->content, a->nc) &&
              !memcmp(a->reasoning, b->reasoning, a->nr) && a->n_calls == b->n_calls;
    for (int i = 0; ok && i < a->n_calls; i++)
        ok = !strcmp(a->calls[i][0], b->calls[i][0]) && !strcmp(a->calls[i][1], b->calls[i][1]);
    if (!ok) {
        fprintf(stderr, "split of [%s] at", s);
        for (int i = 0; i < n_cuts; i++)
            fprintf(stderr, " %zu", cuts[i]);
        fprintf(stderr, " differs: content [%s] vs [%s], reasoning [%s] vs [%s]\n", a->content,
                b->content, a->reasoning, b->reasoning);
        fail();
    }
}

/* Whole, then every 2- and 3-piece split, all equal; the whole result in *r. */
static void parse_all_splits(const pd_chat_parser_opts *o, const char *s, result *r) {
    run(o, s, NULL, 0, r);
    size_t n = strlen(s);
    result *x = malloc(sizeof *x);
    for (size_t i = 0; i <= n; i++) {
        size_t c1[1] = {i};
        run(o, s, c1, 1, x);
        same(r, x, s, c1, 1);
        for (size_t j = i; j <= n; j++) {
            size_t c2[2] = {i, j};
            run(o, s, c2, 2, x);
            same(r, x, s, c2, 2);
        }
    }
    free(x);
}

static const pd_chat_parser_opts THINK_ON = {.think = PD_CHAT_THINK_ON};
static const pd_chat_parser_opts THINK_AUTO = {.think = PD_CHAT_THINK_AUTO};
static const pd_chat_parser_opts THINK_OFF = {.think = PD_CHAT_THINK_OFF};

static void expect(const pd_chat_parser_opts *o, const char *in, const char *reasoning,
                   const char *content) {
    result *r = malloc(sizeof *r);
    parse_all_splits(o, in, r);
    assert_string_equal(r->reasoning, reasoning);
    assert_string_equal(r->content, content);
    assert_int_equal(r->n_calls, 0);
    free(r);
}

static void test_reasoning(void **state) {
    expect(&THINK_ON, "Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4.");
    expect(&THINK_ON, "<think>abc</think>def", "abc", "def");
    expect(&THINK_ON, "still thinking <thi", "still thinking <thi", "");
    expect(&THINK_ON, "<thin", "<thin", "");
    expect(&THINK_ON, "</think>", "", "");
    expect(&THINK_ON, "a</think>b</think>c", "a", "b</think>c");
    expect(&THINK_ON, "naïve — 思考</think>答え", "naïve — 思考", "答え");
    expect(&THINK_AUTO, "<think>x</think>y", "x", "y");
    expect(&THINK_AUTO, "hello <think>x</think>", "", "hello <think>x</think>");
    expect(&THINK_AUTO, "<thi", "", "<thi");
    expect(&THINK_AUTO, "<think>never closed", "never closed", "");
    expect(&THINK_OFF, "<think>x</think>y", "", "<think>x</think>y");
    expect(&THINK_OFF, "", "", "");
    expect(&THINK_ON, "", "", "");
}

static pd_chat_parser_opts tools_opts(pd_chat_tool_parser f, pd_chat_think_start t) {
    static const char *const names[] = {"get_weather", "get_time"};
    return (pd_chat_parser_opts){
        .think = t, .parse_tools = true, .tool_parser = f, .tool_names = names, .n_tool_names = 2};
}

static void test_tool_calls_v3(void **state) {
    pd_chat_parser_opts o = tools_opts(PD_CHAT_TOOLS_DEEPSEEK_V3, PD_CHAT_THINK_OFF);
    result *r = malloc(sizeof *r);
    /* V3 form: type, separator, name, fenced JSON; two calls */
    parse_all_splits(&o,
                     "Sure." CALLS CB "function" SEP
                     "get_weather\n```json\n{\"city\": \"Paris\"}\n```" CE "\n" CB "function" SEP
                     "get_time\n```json\n{}\n```" CE CALLE,
                     r);
    assert_string_equal(r->content, "Sure.");
    assert_int_equal(r->n_calls, 2);
    assert_string_equal(r->calls[0][0], "get_weather");
    assert_string_equal(r->calls[0][1], "{\"city\": \"Paris\"}");
    assert_string_equal(r->calls[1][0], "get_time");
    assert_string_equal(r->calls[1][1], "{}");
    /* V3.1 form, text after the block */
    parse_all_splits(&o, CALLS CB "get_time" SEP "{\"tz\":\"UTC\"}" CE CALLE " done", r);
    assert_string_equal(r->content, " done");
    assert_int_equal(r->n_calls, 1);
    assert_string_equal(r->calls[0][0], "get_time");
    assert_string_equal(r->calls[0][1], "{\"tz\":\"UTC\"}");
    /* reasoning first (thinking on), then a call */
    o.think = PD_CHAT_THINK_ON;
    parse_all_splits(
        &o, "need weather</think>\n\n" CALLS CB "get_weather" SEP "{\"city\":\"Oslo\"}" CE CALLE,
        r);
    assert_string_equal(r->reasoning, "need weather");
    assert_string_equal(r->content, "\n\n");
    assert_int_equal(r->n_calls, 1);
    assert_string_equal(r->calls[0][1], "{\"city\":\"Oslo\"}");
    /* a call marker inside the reasoning is reasoning */
    parse_all_splits(&o, "maybe " CALLS "</think>ok", r);
    assert_string_equal(r->reasoning, "maybe " CALLS);
    assert_string_equal(r->content, "ok");
    assert_int_equal(r->n_calls, 0);
    /* one good call, one bad: the bad one is text, without the block marker */
    o.think = PD_CHAT_THINK_OFF;
    parse_all_splits(&o, CALLS CB "get_time" SEP "{}" CE CB "get_time" SEP "{nope" CE CALLE, r);
    assert_int_equal(r->n_calls, 1);
    assert_string_equal(r->content, CB "get_time" SEP "{nope" CE);
    free(r);
}

/* Output whose calls are all malformed is content, exactly as generated. */
static void test_malformed_is_text(void **state) {
    static const char *const bad[] = {
        CALLS CB "function" SEP "get_weather\n```json\n{bad\n```" CE CALLE, /* bad JSON */
        CALLS CB "function" SEP "get_weather\n```json\n{\"city\": \"Par",   /* cut off */
        CALLS CB "get_weather" SEP "[1, 2]" CE CALLE,                       /* not an object */
        CALLS CB "unknown_tool" SEP "{}" CE CALLE,                          /* unknown name */
        CALLS CB "get_weather"
                 "{}" CE CALLE,                                        /* no separator */
        CALLS CB SEP "{}" CE CALLE,                                    /* no name */
        CALLS CB "function" SEP "get_weather\n```json\n{}\n" CE CALLE, /* open fence */
        CALLS,                                                         /* bare marker */
        CALLS "  text in a block  " CALLE,                             /* no call */
        "text <｜tool▁calls",                                          /* marker prefix */
        "a" CALLS CB "get_time" SEP,                                   /* cut after sep */
    };
    pd_chat_parser_opts o = tools_opts(PD_CHAT_TOOLS_DEEPSEEK_V3, PD_CHAT_THINK_OFF);
    result *r = malloc(sizeof *r);
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        parse_all_splits(&o, bad[i], r);
        assert_int_equal(r->n_calls, 0);
        assert_string_equal(r->content, bad[i]);
    }
    /* DSML */
    static const char *const bad_dsml[] = {
        FC "\n" INV " name=\"get_weather\">\n" PAR " name=\"days\" string=\"false\">three" PARE
           "\n" INVE "\n" FCE,
        FC "\n" INV " name=\"get_weather\">\n" PAR " name=\"days\" string=\"maybe\">3" PARE
           "\n" INVE "\n" FCE,
        FC "\n" INV " name=\"get_weather\">\n" PAR " string=\"true\">x" PARE "\n" INVE "\n" FCE,
        FC "\n" INV " name=\"get_weather\">\n" PAR " name=\"city\" string=\"true\">x" INVE "\n" FCE,
        FC "\n" INV " name=\"nope\">\n" INVE "\n" FCE,
        FC "\n" INV ">\n" INVE "\n" FCE,
        FC "\n" INV " name=\"get_weather\">\n" PAR " name=\"city\" string=\"true\">Par",
    };
    o = tools_opts(PD_CHAT_TOOLS_DEEPSEEK_DSML, PD_CHAT_THINK_OFF);
    for (size_t i = 0; i < sizeof bad_dsml / sizeof *bad_dsml; i++) {
        parse_all_splits(&o, bad_dsml[i], r);
        assert_int_equal(r->n_calls, 0);
        assert_string_equal(r->content, bad_dsml[i]);
    }
    /* tools not parsed: markers are text */
    o.parse_tools = false;
    const char *good = CALLS CB "get_time" SEP "{}" CE CALLE;
    o.tool_parser = PD_CHAT_TOOLS_DEEPSEEK_V3;
    parse_all_splits(&o, good, r);
    assert_int_equal(r->n_calls, 0);
    assert_string_equal(r->content, good);
    free(r);
}

static void test_tool_calls_dsml(void **state) {
    pd_chat_parser_opts o = tools_opts(PD_CHAT_TOOLS_DEEPSEEK_DSML, PD_CHAT_THINK_AUTO);
    result *r = malloc(sizeof *r);
    parse_all_splits(&o,
                     "<think>hm</think>Checking." FC "\n" INV " name=\"get_weather\">\n" PAR
                     " name=\"city\" string=\"true\">Paris, \"FR\"" PARE "\n" PAR
                     " name=\"days\" string=\"false\">3" PARE "\n" PAR
                     " name=\"opts\" string=\"false\">{\"units\": [\"C\"]}" PARE "\n" INVE "\n" INV
                     " name=\"get_time\">\n" INVE "\n" FCE,
                     r);
    assert_string_equal(r->reasoning, "hm");
    assert_string_equal(r->content, "Checking.");
    assert_int_equal(r->n_calls, 2);
    assert_string_equal(r->calls[0][0], "get_weather");
    assert_string_equal(r->calls[0][1],
                        "{\"city\":\"Paris, \\\"FR\\\"\",\"days\":3,\"opts\":{\"units\":[\"C\"]}}");
    assert_string_equal(r->calls[1][0], "get_time");
    assert_string_equal(r->calls[1][1], "{}");
    free(r);
}

/* Stray text after a call in a block that never closes, then whitespace
 * (fuzz_chat, minimized): the whitespace is content with the text whether
 * or not it arrives in a later piece. Cut right after the "~", the stream
 * used to drop the " \n" ("~" vs the whole text's "~ \n"). */
static void test_block_trailing_ws(void **state) {
    static const char *const names[] = {"get_weather", "get_time", "f"};
    pd_chat_parser_opts o = tools_opts(PD_CHAT_TOOLS_DEEPSEEK_DSML, PD_CHAT_THINK_AUTO);
    o.tool_names = names;
    o.n_tool_names = 3;
    const char *in = FC INV " name=\"get_weather\"ar>\n" INVE "~ \n";
    result *whole = malloc(sizeof *whole), *cut = malloc(sizeof *cut);
    run(&o, in, NULL, 0, whole);
    size_t n = strlen(in), cuts[2] = {n - 2, n}; /* the fuzzer's cuts */
    run(&o, in, cuts, 2, cut);
    same(whole, cut, in, cuts, 2);
    parse_all_splits(&o, in, whole);
    assert_int_equal(whole->n_calls, 1);
    assert_string_equal(whole->calls[0][0], "get_weather");
    assert_string_equal(whole->calls[0][1], "{}");
    assert_string_equal(whole->content, "~ \n");
    free(whole);
    free(cut);
}

static void test_tools_prompt(void **state) {
    pd_chat_tool t[2] = {
        {"get_weather", "Weather of a city",
         "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}"},
        {"get_time", NULL, NULL}};
    char *s = NULL;
    pd_err err;
    assert_int_equal(pd_chat_tools_prompt(t, 2, PD_CHAT_TOOLS_DEEPSEEK_V3, &s, &err), PD_OK);
    assert_string_equal(
        s,
        "\n\n## Tools\nYou have access to the following tools:\n"
        "\n### get_weather\nDescription: Weather of a city\n\nParameters: {\"type\": \"object\", "
        "\"properties\": {\"city\": {\"type\": \"string\"}}}\n"
        "\n### get_time\nDescription: \n\nParameters: {}\n\n"
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n" CALLS CB
        "tool_call_name" SEP "tool_call_arguments" CE "{{additional_tool_calls}}" CALLE "\n\n"
        "Where:\n\n"
        "- `tool_call_name` must be an exact match to one of the available tools\n"
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's "
        "Parameters Schema\n"
        "- For multiple tool calls, chain them directly without separators or spaces\n");
    free(s);
    assert_int_equal(pd_chat_tools_prompt(t, 1, PD_CHAT_TOOLS_DEEPSEEK_DSML, &s, &err), PD_OK);
    assert_non_null(strstr(s, FC "\n" INV " name=\"tool_call_name\">"));
    free(s);
    pd_chat_tool bad = {NULL, NULL, NULL};
    assert_int_equal(pd_chat_tools_prompt(&bad, 1, PD_CHAT_TOOLS_DEEPSEEK_V3, &s, &err),
                     PD_ERR_INVALID);
}

static void test_names(void **state) {
    pd_chat_reasoning_parser rp;
    pd_chat_tool_parser tp;
    pd_err err;
    assert_int_equal(pd_chat_reasoning_parser_from_str("deepseek_v3", &rp, &err), PD_OK);
    assert_int_equal(rp, PD_CHAT_REASONING_DEEPSEEK_V3);
    assert_int_equal(pd_chat_reasoning_parser_from_str("none", &rp, &err), PD_OK);
    assert_int_equal(rp, PD_CHAT_REASONING_NONE);
    assert_int_equal(pd_chat_reasoning_parser_from_str("qwen3", &rp, &err), PD_ERR_INVALID);
    assert_int_equal(pd_chat_tool_parser_from_str("deepseek_dsml", &tp, &err), PD_OK);
    assert_int_equal(tp, PD_CHAT_TOOLS_DEEPSEEK_DSML);
    assert_int_equal(pd_chat_tool_parser_from_str("hermes", &tp, &err), PD_ERR_INVALID);
    assert_null(pd_chat_parser_new(NULL, on_event, NULL));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reasoning),         cmocka_unit_test(test_tool_calls_v3),
        cmocka_unit_test(test_malformed_is_text), cmocka_unit_test(test_tool_calls_dsml),
        cmocka_unit_test(test_block_trailing_ws), cmocka_unit_test(test_tools_prompt),
        cmocka_unit_test(test_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

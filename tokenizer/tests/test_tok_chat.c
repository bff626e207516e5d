/* Tests of pd_chat_render against DeepSeek-V3's chat template.
 *
 * Each expected string is the template (chat_template in
 * tokenizer_config.json, spelled out at the top of tokenizer/chat.c) applied
 * by hand, step by step, in the comment above it. They were also checked
 * once against Jinja2 rendering that template with HF transformers'
 * settings (trim_blocks, lstrip_blocks); the template itself is compared
 * with a copy of its known text below, so a changed template fails loudly.
 */
#include "tok_test_util.h"

#define BOS   PD_TOK_DSV3_BOS
#define EOS   PD_TOK_DSV3_EOS
#define USER  "<｜User｜>"
#define ASST  "<｜Assistant｜>"
#define CALLS "<｜tool▁calls▁begin｜>"
#define CALLE "<｜tool▁calls▁end｜>"
#define CB    "<｜tool▁call▁begin｜>"
#define CE    "<｜tool▁call▁end｜>"
#define SEP   "<｜tool▁sep｜>"
#define OUTS  "<｜tool▁outputs▁begin｜>"
#define OUTSE "<｜tool▁outputs▁end｜>"
#define OB    "<｜tool▁output▁begin｜>"
#define OE    "<｜tool▁output▁end｜>"

static char *render(const pd_chat_message *m, int n, bool gen, const char *bos) {
    char *text = NULL;
    pd_err err = {{0}};
    pd_status st = pd_chat_render(m, n, gen, bos, &text, &err);
    if (st != PD_OK)
        fail_msg("render: %s: %s", pd_status_str(st), err.msg);
    return text;
}

#define EXPECT(msgs, gen, want)                                                                    \
    do {                                                                                           \
        char *got_ = render(msgs, (int)(sizeof(msgs) / sizeof *(msgs)), gen, BOS);                 \
        assert_string_equal(got_, want);                                                           \
        free(got_);                                                                                \
    } while (0)

/* system + user + generation prompt:
 *   bos, system_prompt "You are a helpful assistant.",
 *   user -> "<｜User｜>Hello!", end: add_generation_prompt and not is_tool ->
 *   "<｜Assistant｜>" */
static void test_system_user_prompt(void **st) {
    (void)st;
    pd_chat_message m[] = {{"system", "You are a helpful assistant.", NULL, 0},
                           {"user", "Hello!", NULL, 0}};
    EXPECT(m, true, BOS "You are a helpful assistant." USER "Hello!" ASST);
    /* without the generation prompt the string ends after the user turn */
    EXPECT(m, false, BOS "You are a helpful assistant." USER "Hello!");
}

/* multi-turn: assistant with content and is_tool false ->
 *   "<｜Assistant｜>" + content + "<｜end▁of▁sentence｜>" */
static void test_multi_turn(void **st) {
    (void)st;
    pd_chat_message m[] = {{"user", "Hi", NULL, 0},
                           {"assistant", "Hello! How can I help?", NULL, 0},
                           {"user", "Tell me a joke.", NULL, 0}};
    EXPECT(m, true, BOS USER "Hi" ASST "Hello! How can I help?" EOS USER "Tell me a joke." ASST);
}

/* two system messages, one after a user turn: both contents join with
 * "\n\n" right after bos; system messages render nothing in the loop */
static void test_two_systems(void **st) {
    (void)st;
    pd_chat_message m[] = {{"system", "A", NULL, 0},
                           {"user", "u1", NULL, 0},
                           {"system", "B", NULL, 0},
                           {"user", "u2", NULL, 0}};
    EXPECT(m, false, BOS "A\n\nB" USER "u1" USER "u2");
}

/* tool call + tool output + answer:
 *   assistant (content none), first call with ns.is_first false ->
 *     "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + type +
 *     "<｜tool▁sep｜>" + name + "\n```json\n" + arguments +
 *     "\n```<｜tool▁call▁end｜>"   (a single call gets no calls_end: the
 *     template's own behaviour)
 *   tool, ns.is_output_first -> "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>"
 *     + content + "<｜tool▁output▁end｜>"; is_tool = true
 *   assistant with content after a tool -> "<｜tool▁outputs▁end｜>" + content + eos
 *   end: is_tool false -> "<｜Assistant｜>" */
static void test_tool_call_and_output(void **st) {
    (void)st;
    pd_tok_tool_call call = {"function", "get_weather", "{\"city\": \"Paris\"}"};
    pd_chat_message m[] = {{"system", "S", NULL, 0},
                           {"user", "Weather in Paris?", NULL, 0},
                           {"assistant", NULL, &call, 1},
                           {"tool", "{\"temp_c\": 22}", NULL, 0},
                           {"assistant", "It is 22 C.", NULL, 0}};
    EXPECT(m, true,
           BOS "S" USER "Weather in Paris?" ASST CALLS CB "function" SEP
               "get_weather\n```json\n{\"city\": \"Paris\"}\n```" CE OUTS OB
               "{\"temp_c\": 22}" OE OUTSE "It is 22 C." EOS ASST);
}

/* two calls in one message, two outputs, conversation ending on a tool:
 *   call 1 (is_first false): "<｜Assistant｜><｜tool▁calls▁begin｜>" CALL(1)
 *   call 2 (is_first true):  "\n" CALL(2) "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
 *   output 1: "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>r1<｜tool▁output▁end｜>"
 *   output 2: "\n<｜tool▁output▁begin｜>r2<｜tool▁output▁end｜>"
 *   end: is_tool -> "<｜tool▁outputs▁end｜>", and no generation prompt */
static void test_two_calls_end_on_tool(void **st) {
    (void)st;
    pd_tok_tool_call calls[] = {{"function", "a", "{}"}, {"function", "b", "{\"x\": 1}"}};
    pd_chat_message m[] = {{"user", "q", NULL, 0},
                           {"assistant", NULL, calls, 2},
                           {"tool", "r1", NULL, 0},
                           {"tool", "r2", NULL, 0}};
    EXPECT(m, true,
           BOS USER "q" ASST CALLS CB "function" SEP "a\n```json\n{}\n```" CE "\n" CB "function" SEP
                    "b\n```json\n{\"x\": 1}\n```" CE CALLE EOS OUTS OB "r1" OE "\n" OB
                    "r2" OE OUTSE);
}

/* the template never resets ns.is_first / ns.is_output_first: a second
 * tool-calling turn starts with "\n" CALL + calls_end + eos (no
 * "<｜Assistant｜>"), and its output with "\n<｜tool▁output▁begin｜>" (no
 * outputs_begin). A user turn right after tool output does not close the
 * outputs either (it only sets is_tool false). */
static void test_template_quirks(void **st) {
    (void)st;
    pd_tok_tool_call c1 = {"function", "f", "1"}, c2 = {"function", "g", "2"};
    pd_chat_message m[] = {{"user", "u1", NULL, 0},       {"assistant", NULL, &c1, 1},
                           {"tool", "r1", NULL, 0},       {"user", "u2", NULL, 0},
                           {"assistant", NULL, &c2, 1},   {"tool", "r2", NULL, 0},
                           {"assistant", "done", NULL, 0}};
    EXPECT(m, false,
           BOS USER "u1" ASST CALLS CB "function" SEP "f\n```json\n1\n```" CE OUTS OB "r1" OE USER
                    "u2"
                    "\n" CB "function" SEP "g\n```json\n2\n```" CE CALLE EOS "\n" OB "r2" OE OUTSE
                    "done" EOS);
}

/* content is kept whole: this template has no "</think>" handling */
static void test_think_kept(void **st) {
    (void)st;
    pd_chat_message m[] = {{"user", "q", NULL, 0},
                           {"assistant", "<think>r</think>answer", NULL, 0}};
    EXPECT(m, false, BOS USER "q" ASST "<think>r</think>answer" EOS);
}

static void test_edges(void **st) {
    (void)st;
    char *text;
    pd_err err = {{0}};
    /* no messages: bos (+ prompt) */
    assert_int_equal(pd_chat_render(NULL, 0, true, BOS, &text, &err), PD_OK);
    assert_string_equal(text, BOS ASST);
    free(text);
    /* bos NULL renders as the empty string (an undefined Jinja variable) */
    pd_chat_message u[] = {{"user", "x", NULL, 0}};
    text = render(u, 1, false, NULL);
    assert_string_equal(text, USER "x");
    free(text);
    /* unknown roles render nothing; assistant with neither content nor calls too */
    pd_chat_message odd[] = {{"developer", "d", NULL, 0}, {"assistant", NULL, NULL, 0}};
    text = render(odd, 2, false, BOS);
    assert_string_equal(text, BOS);
    free(text);

    /* errors */
    pd_chat_message bad1[] = {{NULL, "x", NULL, 0}};
    assert_int_equal(pd_chat_render(bad1, 1, false, BOS, &text, &err), PD_ERR_INVALID);
    pd_chat_message bad2[] = {{"user", "ok", NULL, 0}, {"user", NULL, NULL, 0}};
    assert_int_equal(pd_chat_render(bad2, 2, false, BOS, &text, &err), PD_ERR_INVALID);
    assert_non_null(strstr(err.msg, "message 1"));
    pd_tok_tool_call bc = {"function", NULL, "{}"};
    pd_chat_message bad3[] = {{"assistant", NULL, &bc, 1}};
    assert_int_equal(pd_chat_render(bad3, 1, false, BOS, &text, &err), PD_ERR_INVALID);
    pd_chat_message bad4[] = {{"assistant", NULL, NULL, 2}};
    assert_int_equal(pd_chat_render(bad4, 1, false, BOS, &text, &err), PD_ERR_INVALID);
    assert_int_equal(pd_chat_render(u, -1, false, BOS, &text, &err), PD_ERR_INVALID);
    assert_int_equal(pd_chat_render(u, 1, false, BOS, NULL, &err), PD_ERR_INVALID);
}

/* The template these tests encode is the one tokenizer_config.json ships;
 * if the cached file changes, the hand-derived strings above must be
 * re-derived. The check compares a few distinctive fragments. */
static void test_template_is_the_known_one(void **st) {
    (void)st;
    char path[4096];
    tt_path(path, sizeof path, "tokenizer_config.json");
    json_error_t je;
    json_t *cfg = json_load_file(path, 0, &je);
    if (!cfg)
        fail_msg("%s: %s", path, je.text);
    const char *tpl = json_string_value(json_object_get(cfg, "chat_template"));
    assert_non_null(tpl);
    const char *fragments[] = {
        "{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}",
        "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
        "'<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + "
        "tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}",
        "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}",
        "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}",
        "{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}",
        "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}",
    };
    for (size_t i = 0; i < sizeof fragments / sizeof *fragments; i++)
        if (!strstr(tpl, fragments[i]))
            fail_msg("%s: chat_template lacks %s", path, fragments[i]);
    assert_null(strstr(tpl, "</think>"));
    /* bos_token of the config is the one we pass */
    json_t *bos = json_object_get(json_object_get(cfg, "bos_token"), "content");
    assert_string_equal(json_string_value(bos), BOS);
    json_decref(cfg);
}

/* The rendered string tokenizes with the markers as single added tokens. */
static void test_render_tokenizes(void **st) {
    (void)st;
    pd_tokenizer *t = tt_load_tokenizer();
    pd_chat_message m[] = {{"system", "S", NULL, 0}, {"user", "Hi", NULL, 0}};
    char *text = render(m, 2, true, BOS);
    int32_t *ids;
    size_t n;
    pd_err err;
    assert_int_equal(pd_tok_encode(t, text, strlen(text), true, &ids, &n, &err), PD_OK);
    assert_true(n >= 4);
    assert_int_equal(ids[0], pd_tok_find(t, BOS));
    assert_int_equal(ids[n - 1], pd_tok_find(t, ASST));
    int users = 0;
    for (size_t i = 0; i < n; i++)
        users += ids[i] == pd_tok_find(t, USER);
    assert_int_equal(users, 1);
    free(ids);
    free(text);
    pd_tok_free(&t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_system_user_prompt),
        cmocka_unit_test(test_multi_turn),
        cmocka_unit_test(test_two_systems),
        cmocka_unit_test(test_tool_call_and_output),
        cmocka_unit_test(test_two_calls_end_on_tool),
        cmocka_unit_test(test_template_quirks),
        cmocka_unit_test(test_think_kept),
        cmocka_unit_test(test_edges),
        cmocka_unit_test(test_template_is_the_known_one),
        cmocka_unit_test(test_render_tokenizes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

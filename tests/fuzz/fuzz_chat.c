/* The chat output parsers (chat/pd_chat.h) over model output.
 *
 * Input: byte 0 = options (bits 0-1 think start AUTO/ON/OFF, bit 2 DSML,
 * bit 3 parse tools, bit 4 a tool-name list); bytes 1 and 2 = two cut
 * positions (scaled to the text); the rest is the text.
 *
 * Properties: the text cut into three pieces gives the same content,
 * reasoning and tool calls as the whole text; every tool call has a
 * non-empty name and arguments that parse as a JSON object; with thinking
 * off and no tool call, the content is the text byte for byte (malformed
 * calls come back as text). No crash, leak or hang on any input. */
#include <stdint.h>
#include <string.h>

#include <jansson.h>

#include "fuzz_util.h"
#include "pd_chat.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fz_quiet_logs();
    return 0;
}

typedef struct {
    fz_buf content, reasoning, calls; /* calls: name \0 args \0 … */
    int n_calls;
} fz_out;

static void on_event(void *ud, const pd_chat_event *ev) {
    fz_out *o = ud;
    if (ev->kind == PD_CHAT_EV_CONTENT) {
        FZ_CHECK(ev->len > 0, "empty content event");
        fz_buf_add(&o->content, ev->text, ev->len);
    } else if (ev->kind == PD_CHAT_EV_REASONING) {
        FZ_CHECK(ev->len > 0, "empty reasoning event");
        fz_buf_add(&o->reasoning, ev->text, ev->len);
    } else {
        FZ_CHECK(ev->name && ev->name[0], "tool call without a name");
        json_t *j = json_loads(ev->arguments, JSON_ALLOW_NUL, NULL);
        FZ_CHECK(json_is_object(j), "arguments not a JSON object: %s", ev->arguments);
        json_decref(j);
        FZ_CHECK(ev->tool_index == o->n_calls, "tool_index %d", ev->tool_index);
        fz_buf_add(&o->calls, ev->name, strlen(ev->name) + 1);
        fz_buf_add(&o->calls, ev->arguments, strlen(ev->arguments) + 1);
        o->n_calls++;
    }
}

static void run(const pd_chat_parser_opts *opts, const char *s, size_t n, size_t c1, size_t c2,
                fz_out *o) {
    pd_chat_parser *p = pd_chat_parser_new(opts, on_event, o);
    FZ_CHECK(p, "no parser");
    FZ_CHECK(pd_chat_parser_feed(p, s, c1) == PD_OK, "feed 1");
    FZ_CHECK(pd_chat_parser_feed(p, s + c1, c2 - c1) == PD_OK, "feed 2");
    FZ_CHECK(pd_chat_parser_feed(p, s + c2, n - c2) == PD_OK, "feed 3");
    FZ_CHECK(pd_chat_parser_finish(p) == PD_OK, "finish");
    FZ_CHECK(pd_chat_parser_n_tool_calls(p) == o->n_calls, "count");
    pd_chat_parser_free(&p);
}

static bool buf_eq(const fz_buf *a, const fz_buf *b) {
    return a->len == b->len && (a->len == 0 || memcmp(a->p, b->p, a->len) == 0);
}

static void out_free(fz_out *o) {
    free(o->content.p);
    free(o->reasoning.p);
    free(o->calls.p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 3)
        return 0;
    static const char *const names[] = {"get_weather", "get_time", "f"};
    pd_chat_parser_opts o = {
        .think = (pd_chat_think_start)((data[0] & 3) % 3),
        .tool_parser = data[0] & 4 ? PD_CHAT_TOOLS_DEEPSEEK_DSML : PD_CHAT_TOOLS_DEEPSEEK_V3,
        .parse_tools = data[0] & 8,
        .tool_names = data[0] & 16 ? names : NULL,
        .n_tool_names = data[0] & 16 ? 3 : 0,
    };
    const char *s = (const char *)data + 3;
    size_t n = size - 3;
    size_t c1 = n ? data[1] * n / 255 : 0, c2 = n ? data[2] * n / 255 : 0;
    if (c1 > c2) {
        size_t t = c1;
        c1 = c2;
        c2 = t;
    }
    fz_out whole = {0}, cut = {0};
    run(&o, s, n, n, n, &whole);
    run(&o, s, n, c1, c2, &cut);
    FZ_CHECK(buf_eq(&whole.content, &cut.content), "content differs (cuts %zu %zu)", c1, c2);
    FZ_CHECK(buf_eq(&whole.reasoning, &cut.reasoning), "reasoning differs");
    FZ_CHECK(whole.n_calls == cut.n_calls && buf_eq(&whole.calls, &cut.calls), "calls differ");
    if (o.think == PD_CHAT_THINK_OFF && whole.n_calls == 0)
        FZ_CHECK(whole.content.len == n && (n == 0 || memcmp(whole.content.p, s, n) == 0),
                 "text lost or changed");
    out_free(&whole);
    out_free(&cut);
    return 0;
}

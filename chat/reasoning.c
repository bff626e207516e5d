/* Stage 1: reasoning between "<think>" and "</think>".
 *
 * Follows vLLM's deepseek_r1 reasoning parser (which its deepseek_v3 parser
 * uses when thinking is on): the prompt may already hold "<think>", so the
 * output is reasoning until "</think>"; the end marker itself is dropped and
 * what follows is content. In AUTO mode the block must open at the very
 * first byte of the output to count (an R1-style model opening it itself);
 * a "<think>" later in an answer is content.
 */
#include <string.h>

#include "chat_internal.h"

#define THINK_OPEN  "<think>"
#define THINK_CLOSE "</think>"

enum { R_START = 0, R_REASONING, R_CONTENT };

void chat_reasoning_init(chat_reasoning *r, pd_chat_think_start mode) {
    memset(r, 0, sizeof *r);
    r->mode = mode;
    r->state = mode == PD_CHAT_THINK_OFF ? R_CONTENT : R_START;
}

/* Runs the state machine over r->held; with final, nothing may wait. */
static pd_status step(chat_reasoning *r, chat_sink *k, bool final) {
    pd_status st = PD_OK;
    for (;;) {
        chat_buf *b = &r->held;
        if (r->state == R_START) {
            size_t m = strlen(THINK_OPEN);
            if (b->n >= m && memcmp(b->p, THINK_OPEN, m) == 0) {
                chat_buf_drop(b, m);
                r->state = R_REASONING;
                continue;
            }
            if (!final && chat_is_prefix_of(b->p ? b->p : "", b->n, THINK_OPEN))
                return PD_OK; /* may still become "<think>" */
            r->state = r->mode == PD_CHAT_THINK_ON ? R_REASONING : R_CONTENT;
            continue;
        }
        if (r->state == R_REASONING) {
            static const char *const close[] = {THINK_CLOSE};
            size_t at = 0, hold = 0;
            if (b->n == 0)
                return PD_OK;
            if (chat_find_marker(b->p, b->n, close, 1, &at, &hold) == 0) {
                if (at)
                    st = k->reasoning(k, b->p, at);
                chat_buf_drop(b, at + strlen(THINK_CLOSE));
                r->state = R_CONTENT;
                if (st != PD_OK)
                    return st;
                continue;
            }
            size_t out = final ? b->n : b->n - hold;
            if (out)
                st = k->reasoning(k, b->p, out);
            chat_buf_drop(b, out);
            return st;
        }
        /* R_CONTENT */
        if (b->n)
            st = k->content(k, b->p, b->n);
        chat_buf_drop(b, b->n);
        return st;
    }
}

pd_status chat_reasoning_feed(chat_reasoning *r, const char *s, size_t len, chat_sink *k) {
    if (len == 0)
        return PD_OK;
    if (r->state == R_CONTENT && r->held.n == 0)
        return k->content(k, s, len); /* the common case: no copy */
    if (chat_buf_add(&r->held, s, len) != PD_OK)
        return PD_ERR_NOMEM;
    return step(r, k, false);
}

pd_status chat_reasoning_finish(chat_reasoning *r, chat_sink *k) {
    return step(r, k, true);
}

void chat_reasoning_free(chat_reasoning *r) {
    chat_buf_free(&r->held);
}

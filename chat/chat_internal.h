/* chat/ internals shared by its .c files. Not a public header.
 *
 *   buf.c        a growable byte buffer and the marker search with hold-back.
 *   reasoning.c  stage 1: <think> … </think> → reasoning, the rest onwards.
 *   toolcall.c   stage 2: tool-call blocks → checked calls, the rest content.
 *   parser.c     pd_chat_parser: the two stages chained, events out.
 *   tools.c      the tool section of the prompt.
 */
#ifndef PD_CHAT_INTERNAL_H
#define PD_CHAT_INTERNAL_H

#include "pd_chat.h"

typedef struct {
    char *p;
    size_t n, cap;
} chat_buf;

/** Appends len bytes (keeps a NUL after them). Errors: PD_ERR_NOMEM. */
pd_status chat_buf_add(chat_buf *b, const char *s, size_t len);
/** Drops the first k bytes. */
void chat_buf_drop(chat_buf *b, size_t k);
void chat_buf_free(chat_buf *b);

/** Searches s[0..n) for the earliest complete occurrence of any of the
 * markers. Found: returns its index in markers and sets *at_p. Not found:
 * returns -1 and sets *hold_p to the length of the longest suffix of s that
 * is a proper prefix of some marker (bytes that must wait for more text). */
int chat_find_marker(const char *s, size_t n, const char *const *markers, int n_markers,
                     size_t *at_p, size_t *hold_p);

/** True when s[0..n) is a proper prefix of marker (n < strlen(marker)). */
bool chat_is_prefix_of(const char *s, size_t n, const char *marker);

/* Stage output: where a stage sends what it decided. */
typedef struct chat_sink {
    pd_status (*content)(struct chat_sink *k, const char *s, size_t len);
    pd_status (*reasoning)(struct chat_sink *k, const char *s, size_t len);
    pd_status (*tool_call)(struct chat_sink *k, const char *name, const char *arguments);
} chat_sink;

typedef struct {
    pd_chat_think_start mode;
    int state; /* 0 start, 1 reasoning, 2 content */
    chat_buf held;
} chat_reasoning;

void chat_reasoning_init(chat_reasoning *r, pd_chat_think_start mode);
pd_status chat_reasoning_feed(chat_reasoning *r, const char *s, size_t len, chat_sink *k);
pd_status chat_reasoning_finish(chat_reasoning *r, chat_sink *k);
void chat_reasoning_free(chat_reasoning *r);

typedef struct {
    pd_chat_tool_parser fmt;
    const char *const *names;
    int n_names;
    int state;               /* 0 text, 1 in a block, 2 in a call */
    bool block_has_call;     /* a call of this block came out as an event */
    bool block_marker_shown; /* the block's begin marker went out as content */
    bool text_in_block;      /* text of the block went out as content: its whitespace too */
    chat_buf held;
    chat_buf ws; /* whitespace before the current call, shown if it fails */
} chat_toolcall;

void chat_toolcall_init(chat_toolcall *t, pd_chat_tool_parser fmt, const char *const *names,
                        int n_names);
pd_status chat_toolcall_feed(chat_toolcall *t, const char *s, size_t len, chat_sink *k);
pd_status chat_toolcall_finish(chat_toolcall *t, chat_sink *k);
void chat_toolcall_free(chat_toolcall *t);

#endif

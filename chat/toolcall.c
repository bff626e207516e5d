/* Stage 2: tool-call blocks in the content → checked calls.
 *
 * States: TEXT (content until a block opens), BLOCK (between calls: only
 * whitespace is expected; other text is content), CALL (held whole until
 * the call's end marker, then checked). See pd_chat.h for the formats and
 * why a call is held whole.
 */
#define _GNU_SOURCE /* memmem */
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "chat_internal.h"

enum { T_TEXT = 0, T_BLOCK, T_CALL };

typedef struct {
    const char *block_begin, *block_end, *call_begin, *call_end;
} tc_markers;

static const tc_markers MARKERS[] = {
    [PD_CHAT_TOOLS_DEEPSEEK_V3] = {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                   "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"},
    [PD_CHAT_TOOLS_DEEPSEEK_DSML] = {"<｜DSML｜function_calls>", "</｜DSML｜function_calls>",
                                     "<｜DSML｜invoke", "</｜DSML｜invoke>"},
};

#define V3_SEP       "<｜tool▁sep｜>"
#define V3_FENCE     "```json"
#define DSML_PARAM   "<｜DSML｜parameter"
#define DSML_PARAM_E "</｜DSML｜parameter>"

void chat_toolcall_init(chat_toolcall *t, pd_chat_tool_parser fmt, const char *const *names,
                        int n_names) {
    memset(t, 0, sizeof *t);
    t->fmt = fmt == PD_CHAT_TOOLS_DEEPSEEK_DSML ? fmt : PD_CHAT_TOOLS_DEEPSEEK_V3;
    t->names = names;
    t->n_names = names ? n_names : 0;
}

static bool is_ws(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static bool all_ws(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!is_ws(s[i]))
            return false;
    return true;
}

/* s[0..n) trimmed of whitespace on both sides, as [*b, *e). */
static void trim(const char *s, size_t n, size_t *b, size_t *e) {
    size_t i = 0, j = n;
    while (i < j && is_ws(s[i]))
        i++;
    while (j > i && is_ws(s[j - 1]))
        j--;
    *b = i;
    *e = j;
}

static bool known_name(const chat_toolcall *t, const char *name) {
    if (!name[0] || strlen(name) > 512)
        return false;
    if (t->n_names == 0)
        return true;
    for (int i = 0; i < t->n_names; i++)
        if (t->names[i] && strcmp(t->names[i], name) == 0)
            return true;
    return false;
}

static bool is_json_object(const char *s, size_t n) {
    json_t *j = json_loadb(s, n, JSON_ALLOW_NUL, NULL);
    bool ok = json_is_object(j);
    json_decref(j);
    return ok;
}

static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

/* deepseek_v3 call body (between the call markers):
 *   V3:   TYPE<｜tool▁sep｜>NAME\n```json\nARGS\n```
 *   V3.1: NAME<｜tool▁sep｜>ARGS        (ARGS may also be fenced)
 * Returns 1 with *name_p / *args_p (heap), 0 when malformed, -1 on OOM. */
static int parse_v3(const char *s, size_t n, char **name_p, char **args_p) {
    const char *sep = memmem(s, n, V3_SEP, strlen(V3_SEP));
    if (!sep)
        return 0;
    size_t hlen = (size_t)(sep - s);
    const char *rest = sep + strlen(V3_SEP);
    size_t rlen = n - hlen - strlen(V3_SEP);
    size_t b, e;
    const char *name, *args;
    size_t name_len, args_len;
    const char *fence = memmem(rest, rlen, V3_FENCE, strlen(V3_FENCE));
    trim(s, hlen, &b, &e);
    bool v3 = e - b == 8 && memcmp(s + b, "function", 8) == 0 && fence &&
              !memchr(rest, '\n', (size_t)(fence - rest) > 0 ? (size_t)(fence - rest) - 1 : 0);
    if (v3) {
        name = rest;
        name_len = (size_t)(fence - rest);
    } else {
        name = s;
        name_len = hlen;
        fence = memmem(rest, rlen, V3_FENCE, strlen(V3_FENCE));
        size_t rb, re;
        trim(rest, rlen, &rb, &re);
        if (!(fence && fence == rest + rb))
            fence = NULL; /* a fence only when ARGS starts with it */
    }
    if (fence) {
        args = fence + strlen(V3_FENCE);
        const char *end = rest + rlen;
        /* the closing fence: the last ``` of the body */
        const char *close = NULL;
        for (const char *p = args; p + 3 <= end; p++)
            if (memcmp(p, "```", 3) == 0)
                close = p;
        if (!close)
            return 0;
        args_len = (size_t)(close - args);
    } else {
        args = rest;
        args_len = rlen;
    }
    trim(name, name_len, &b, &e);
    name += b;
    name_len = e - b;
    trim(args, args_len, &b, &e);
    args += b;
    args_len = e - b;
    if (name_len == 0 || memchr(name, '\n', name_len) || memchr(name, 0, name_len) ||
        !is_json_object(args, args_len))
        return 0;
    *name_p = dup_n(name, name_len);
    *args_p = dup_n(args, args_len);
    if (!*name_p || !*args_p) {
        free(*name_p);
        free(*args_p);
        return -1;
    }
    return 1;
}

/* The value of attribute key="…" in s[0..n) (no escapes, as DSML writes
 * them): sets *v / *vlen; false when absent or unterminated. */
static bool dsml_attr(const char *s, size_t n, const char *key, const char **v, size_t *vlen) {
    char pat[32];
    snprintf(pat, sizeof pat, "%s=\"", key);
    size_t pl = strlen(pat);
    for (const char *p = s; p + pl <= s + n; p++) {
        if (memcmp(p, pat, pl) != 0 || (p > s && !is_ws(p[-1])))
            continue;
        const char *q = memchr(p + pl, '"', (size_t)(s + n - (p + pl)));
        if (!q)
            return false;
        *v = p + pl;
        *vlen = (size_t)(q - *v);
        return true;
    }
    return false;
}

/* DSML call body (after "<｜DSML｜invoke", before "</｜DSML｜invoke>"):
 *    name="NAME">\n<｜DSML｜parameter name="P" string="true|false">V</｜DSML｜parameter>…
 * string="true": V is the raw string; "false": V is JSON (absent: JSON if
 * it parses, else the string). Returns as parse_v3. */
static int parse_dsml(const char *s, size_t n, char **name_p, char **args_p) {
    const char *gt = memchr(s, '>', n);
    const char *name;
    size_t name_len;
    if (!gt || n == 0 || !is_ws(s[0]) ||
        !dsml_attr(s, (size_t)(gt - s), "name", &name, &name_len) || name_len == 0 ||
        memchr(name, 0, name_len))
        return 0;
    json_t *args = json_object();
    if (!args)
        return -1;
    const char *p = gt + 1, *end = s + n;
    int rc = 1;
    for (;;) {
        while (p < end && is_ws(*p))
            p++;
        if (p == end)
            break;
        size_t pl = strlen(DSML_PARAM);
        const char *tag_end =
            (size_t)(end - p) > pl ? memchr(p + pl, '>', (size_t)(end - p - pl)) : NULL;
        const char *close = tag_end ? memmem(tag_end + 1, (size_t)(end - tag_end - 1), DSML_PARAM_E,
                                             strlen(DSML_PARAM_E))
                                    : NULL;
        const char *pname, *str;
        size_t pname_len, str_len;
        if ((size_t)(end - p) < pl || memcmp(p, DSML_PARAM, pl) != 0 || !is_ws(p[pl]) || !close ||
            !dsml_attr(p + pl, (size_t)(tag_end - p - pl), "name", &pname, &pname_len) ||
            pname_len == 0 || memchr(pname, 0, pname_len)) {
            rc = 0;
            break;
        }
        bool has_str = dsml_attr(p + pl, (size_t)(tag_end - p - pl), "string", &str, &str_len);
        bool is_str = has_str && str_len == 4 && memcmp(str, "true", 4) == 0;
        bool is_json = has_str && str_len == 5 && memcmp(str, "false", 5) == 0;
        if (has_str && !is_str && !is_json) {
            rc = 0;
            break;
        }
        const char *v = tag_end + 1;
        size_t vlen = (size_t)(close - v);
        json_t *val = NULL;
        if (!is_str) {
            size_t b, e;
            trim(v, vlen, &b, &e);
            val = json_loadb(v + b, e - b, JSON_DECODE_ANY, NULL);
            if (!val && is_json) {
                rc = 0;
                break;
            }
        }
        if (!val)
            val = json_stringn(v, vlen); /* NULL for invalid UTF-8 */
        char *key = val ? dup_n(pname, pname_len) : NULL;
        if (!key) { /* no value: invalid UTF-8 in a string; no key: out of memory */
            rc = val ? -1 : 0;
            json_decref(val);
            break;
        }
        if (json_object_set_new(args, key, val) != 0) { /* a key that is not UTF-8 */
            free(key);
            rc = 0;
            break;
        }
        free(key);
        p = close + strlen(DSML_PARAM_E);
    }
    if (rc == 1) {
        *name_p = dup_n(name, name_len);
        *args_p = json_dumps(args, JSON_COMPACT);
        if (!*name_p || !*args_p) {
            free(*name_p);
            free(*args_p);
            rc = -1;
        }
    }
    json_decref(args);
    return rc;
}

/* Content inside a block: the block's begin marker goes first when no call
 * of the block came out (so malformed output reads as it was generated). */
static pd_status block_content(chat_toolcall *t, chat_sink *k, const char *s, size_t n) {
    const tc_markers *m = &MARKERS[t->fmt];
    pd_status st = PD_OK;
    if (!t->block_has_call && !t->block_marker_shown) {
        t->block_marker_shown = true;
        st = k->content(k, m->block_begin, strlen(m->block_begin));
    }
    if (st == PD_OK && t->ws.n) { /* whitespace held before a call that failed */
        t->text_in_block = true;
        st = k->content(k, t->ws.p, t->ws.n);
        chat_buf_drop(&t->ws, t->ws.n);
    }
    if (st == PD_OK && n) {
        t->text_in_block = true;
        st = k->content(k, s, n);
    }
    return st;
}

/* A whole call body: an event, or its text as content. */
static pd_status end_call(chat_toolcall *t, chat_sink *k, const char *body, size_t n, bool ended) {
    const tc_markers *m = &MARKERS[t->fmt];
    char *name = NULL, *args = NULL;
    int rc = 0;
    if (ended)
        rc = t->fmt == PD_CHAT_TOOLS_DEEPSEEK_DSML ? parse_dsml(body, n, &name, &args)
                                                   : parse_v3(body, n, &name, &args);
    if (rc < 0)
        return PD_ERR_NOMEM;
    pd_status st;
    if (rc == 1 && known_name(t, name)) {
        t->block_has_call = true;
        chat_buf_drop(&t->ws, t->ws.n);
        st = k->tool_call(k, name, args);
    } else {
        st = block_content(t, k, m->call_begin, strlen(m->call_begin));
        if (st == PD_OK && n)
            st = k->content(k, body, n);
        if (st == PD_OK && ended)
            st = k->content(k, m->call_end, strlen(m->call_end));
    }
    free(name);
    free(args);
    return st;
}

static pd_status step(chat_toolcall *t, chat_sink *k, bool final) {
    const tc_markers *m = &MARKERS[t->fmt];
    chat_buf *b = &t->held;
    pd_status st = PD_OK;
    while (st == PD_OK) {
        size_t at = 0, hold = 0;
        if (t->state == T_TEXT) {
            const char *mk[] = {m->block_begin};
            if (b->n == 0)
                return PD_OK;
            if (chat_find_marker(b->p, b->n, mk, 1, &at, &hold) == 0) {
                if (at)
                    st = k->content(k, b->p, at);
                chat_buf_drop(b, at + strlen(m->block_begin));
                t->state = T_BLOCK;
                t->block_has_call = t->block_marker_shown = t->text_in_block = false;
                continue;
            }
            size_t out = final ? b->n : b->n - hold;
            if (out)
                st = k->content(k, b->p, out);
            chat_buf_drop(b, out);
            return st;
        }
        if (t->state == T_BLOCK) {
            const char *mk[] = {m->call_begin, m->block_end};
            int which = b->n ? chat_find_marker(b->p, b->n, mk, 2, &at, &hold) : -1;
            if (which >= 0) {
                if (at && (t->text_in_block || !all_ws(b->p, at)))
                    st = block_content(t, k, b->p, at);
                else if (at && chat_buf_add(&t->ws, b->p, at) != PD_OK)
                    return PD_ERR_NOMEM; /* shown only if the call fails */
                chat_buf_drop(b, at + strlen(mk[which]));
                t->state = which == 0 ? T_CALL : T_TEXT;
                if (which == 1 && !t->block_has_call && st == PD_OK)
                    st = block_content(t, k, m->block_end, strlen(m->block_end));
                if (which == 1)
                    chat_buf_drop(&t->ws, t->ws.n);
                continue;
            }
            if (final) {
                /* no call in the block: all of it as generated; after a
                 * call, whitespace only where text of the block went out
                 * (as when a marker follows it, and as when the text and
                 * the whitespace come in one piece) */
                if (!t->block_has_call || t->text_in_block || !all_ws(b->p, b->n))
                    st = block_content(t, k, b->p, b->n);
                chat_buf_drop(b, b->n);
                return st;
            }
            size_t out = b->n - hold;
            if (!all_ws(b->p, out)) { /* stray text: content; whitespace waits */
                st = block_content(t, k, b->p, out);
                chat_buf_drop(b, out);
            }
            return st;
        }
        /* T_CALL */
        const char *mk[] = {m->call_end};
        if (b->n && chat_find_marker(b->p, b->n, mk, 1, &at, &hold) == 0) {
            st = end_call(t, k, b->p, at, true);
            chat_buf_drop(b, at + strlen(m->call_end));
            t->state = T_BLOCK;
            continue;
        }
        if (final) {
            st = end_call(t, k, b->p ? b->p : "", b->n, false);
            chat_buf_drop(b, b->n);
            t->state = T_BLOCK;
            continue;
        }
        return PD_OK;
    }
    return st;
}

pd_status chat_toolcall_feed(chat_toolcall *t, const char *s, size_t len, chat_sink *k) {
    if (len == 0)
        return PD_OK;
    if (chat_buf_add(&t->held, s, len) != PD_OK)
        return PD_ERR_NOMEM;
    return step(t, k, false);
}

pd_status chat_toolcall_finish(chat_toolcall *t, chat_sink *k) {
    return step(t, k, true);
}

void chat_toolcall_free(chat_toolcall *t) {
    chat_buf_free(&t->held);
    chat_buf_free(&t->ws);
}

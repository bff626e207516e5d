/* Helpers shared by the tokenizer tests (header-only: every test_*.c is its
 * own executable). Paths come from the environment ctest sets:
 *   PD_CACHE_DIR/tokenizer-deepseek_v3/tokenizer.json   (deploy/fetch-tokenizer.sh)
 *   PD_SOURCE_DIR/tests/reference/tokenizer_corpus.jsonl
 *   PD_SOURCE_DIR/tests/reference/fixtures/tok_ids.json (or $PD_TOK_FIXTURE)
 */
#ifndef TOK_TEST_UTIL_H
#define TOK_TEST_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "pd_tokenizer.h"

static inline const char *tt_source_dir(void) {
    const char *s = getenv("PD_SOURCE_DIR");
    return s && *s ? s : PD_SOURCE_DIR;
}

static inline void tt_path(char *buf, size_t n, const char *rel) {
    if (strcmp(rel, "tokenizer.json") == 0 || strcmp(rel, "tokenizer_config.json") == 0) {
        const char *c = getenv("PD_CACHE_DIR");
        if (c && *c)
            snprintf(buf, n, "%s/tokenizer-deepseek_v3/%s", c, rel);
        else
            snprintf(buf, n, "%s/.cache/tokenizer-deepseek_v3/%s", tt_source_dir(), rel);
        return;
    }
    snprintf(buf, n, "%s/%s", tt_source_dir(), rel);
}

/* Loads the DeepSeek-V3 tokenizer; a missing file fails the test with the
 * command that fetches it. */
static inline pd_tokenizer *tt_load_tokenizer(void) {
    char path[4096];
    tt_path(path, sizeof path, "tokenizer.json");
    pd_tokenizer *t = NULL;
    pd_err err = {{0}};
    pd_status st = pd_tok_load(path, &t, &err);
    if (st != PD_OK)
        fail_msg("cannot load %s (%s): %s -- run deploy/fetch-tokenizer.sh", path,
                 pd_status_str(st), err.msg);
    return t;
}

/* FNV-1a 64, as tests/reference/make_tok_fixtures.py computes it. */
static inline uint64_t tt_fnv1a64(const void *p, size_t n) {
    const uint8_t *s = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

/* An independent UTF-8 check (RFC 3629), so properties about the library's
 * output are not judged by the library's own validator. */
static inline int tt_utf8_ok(const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i], cp;
        size_t k; /* continuation bytes */
        if (c < 0x80) {
            i++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF) {
            k = 1;
            cp = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            k = 2;
            cp = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            k = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (n - i <= k)
            return 0;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xC0) != 0x80)
                return 0;
            cp = (cp << 6) | (s[i + j] & 0x3F);
        }
        if ((k == 2 && cp < 0x800) || (k == 3 && cp < 0x10000) || cp > 0x10FFFF ||
            (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += k + 1;
    }
    return 1;
}

/* ---- the corpus ---- */

typedef struct {
    char name[64];
    char *bytes; /* what pd_tok_encode is given (raw, possibly ill-formed, for bytes_hex) */
    size_t len;
    int raw; /* from bytes_hex: the reference text is the repaired string */
} tt_case;

typedef struct {
    tt_case *c;
    size_t n;
} tt_corpus;

static inline int tt_hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

static inline void tt_corpus_load(tt_corpus *corp) {
    char path[4096];
    tt_path(path, sizeof path, "tests/reference/tokenizer_corpus.jsonl");
    char *data;
    size_t len;
    pd_err err;
    if (pd_file_read_all(path, &data, &len, &err) != PD_OK)
        fail_msg("%s", err.msg);
    corp->c = NULL;
    corp->n = 0;
    size_t cap = 0;
    char *line = data;
    int lineno = 0;
    while (line < data + len) {
        char *nl = memchr(line, '\n', (size_t)(data + len - line));
        size_t ll = nl ? (size_t)(nl - line) : (size_t)(data + len - line);
        lineno++;
        if (ll > 0) {
            json_error_t je;
            json_t *j = json_loadb(line, ll, JSON_ALLOW_NUL, &je);
            if (!j)
                fail_msg("%s:%d: %s", path, lineno, je.text);
            if (corp->n == cap) {
                cap = cap ? 2 * cap : 64;
                corp->c = realloc(corp->c, cap * sizeof *corp->c);
            }
            tt_case *c = &corp->c[corp->n++];
            memset(c, 0, sizeof *c);
            snprintf(c->name, sizeof c->name, "%s", json_string_value(json_object_get(j, "name")));
            json_t *text = json_object_get(j, "text");
            json_t *rep = json_object_get(j, "repeat");
            json_t *hex = json_object_get(j, "bytes_hex");
            if (text) {
                c->len = json_string_length(text);
                c->bytes = malloc(c->len + 1);
                memcpy(c->bytes, json_string_value(text), c->len);
            } else if (rep) {
                const char *pre = json_string_value(json_object_get(j, "prefix"));
                const char *suf = json_string_value(json_object_get(j, "suffix"));
                size_t np = pre ? strlen(pre) : 0, ns = suf ? strlen(suf) : 0;
                size_t nr = json_string_length(rep);
                size_t cnt = (size_t)json_integer_value(json_object_get(j, "count"));
                c->len = np + nr * cnt + ns;
                c->bytes = malloc(c->len + 1);
                memcpy(c->bytes, pre ? pre : "", np);
                for (size_t k = 0; k < cnt; k++)
                    memcpy(c->bytes + np + k * nr, json_string_value(rep), nr);
                memcpy(c->bytes + np + cnt * nr, suf ? suf : "", ns);
            } else if (hex) {
                const char *h = json_string_value(hex);
                c->len = strlen(h) / 2;
                c->bytes = malloc(c->len + 1);
                for (size_t k = 0; k < c->len; k++)
                    c->bytes[k] = (char)(tt_hexval(h[2 * k]) * 16 + tt_hexval(h[2 * k + 1]));
                c->raw = 1;
            } else {
                fail_msg("%s:%d: no text, repeat or bytes_hex", path, lineno);
            }
            c->bytes[c->len] = '\0';
            json_decref(j);
        }
        line += ll + 1;
    }
    free(data);
    if (corp->n < 10)
        fail_msg("%s: only %zu cases", path, corp->n);
}

static inline void tt_corpus_free(tt_corpus *corp) {
    for (size_t i = 0; i < corp->n; i++)
        free(corp->c[i].bytes);
    free(corp->c);
    corp->c = NULL;
    corp->n = 0;
}

/* The text the reference tokenized for a case: raw cases are repaired. */
static inline char *tt_case_text(const tt_case *c, size_t *len_p) {
    char *out;
    size_t n;
    pd_err err;
    assert_int_equal(pd_tok_utf8_repair(c->bytes, c->len, &out, &n, &err), PD_OK);
    *len_p = n;
    return out;
}

#endif

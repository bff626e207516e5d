/* Helpers of the grammar tests (header-only: each test_*.c is its own
 * executable): an independent validator of the supported JSON Schema
 * subset over jansson values, written from the JSON Schema 2020-12
 * validation vocabulary and not from grammar/ (so the property "what the
 * automaton accepts validates" is checked by a second implementation), and
 * a seeded random walker over the automaton's bytes. */
#ifndef GRAMMAR_TEST_UTIL_H
#define GRAMMAR_TEST_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "grammar_impl.h"

/* Code points of a UTF-8 string (valid: jansson checked it). */
static inline size_t gt_cps(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ((uint8_t)s[i] & 0xC0) != 0x80;
    return k;
}

static inline bool gt_is_type(const json_t *v, const char *t) {
    if (!strcmp(t, "object"))
        return json_is_object(v);
    if (!strcmp(t, "array"))
        return json_is_array(v);
    if (!strcmp(t, "string"))
        return json_is_string(v);
    if (!strcmp(t, "number"))
        return json_is_number(v);
    if (!strcmp(t, "integer"))
        return json_is_integer(v);
    if (!strcmp(t, "boolean"))
        return json_is_boolean(v);
    if (!strcmp(t, "null"))
        return json_is_null(v);
    return false;
}

/* The document "$ref": "#/$defs/Name" (or "#/definitions/Name") points
 * into; set before gt_valid. */
static const json_t *gt_doc;

/* Does instance v validate against schema s (the subset of pd_grammar.h)? */
static inline bool gt_valid(const json_t *v, const json_t *s) {
    if (json_is_true(s))
        return true;
    json_t *ref = json_object_get(s, "$ref");
    if (ref) {
        const char *p = json_string_value(ref);
        const char *slash = strrchr(p, '/');
        json_t *defs =
            json_object_get(gt_doc, strncmp(p, "#/$defs/", 8) == 0 ? "$defs" : "definitions");
        json_t *t = defs && slash ? json_object_get(defs, slash + 1) : NULL;
        return t && gt_valid(v, t);
    }
    if (json_is_false(s))
        return false;
    json_t *k;
    if ((k = json_object_get(s, "anyOf")) || (k = json_object_get(s, "oneOf"))) {
        bool one = json_object_get(s, "oneOf") != NULL;
        int n = 0;
        size_t i;
        json_t *alt;
        json_array_foreach(k, i, alt) n += gt_valid(v, alt);
        if (one ? n != 1 : n < 1)
            return false;
    }
    if ((k = json_object_get(s, "type"))) {
        bool ok = false;
        if (json_is_string(k))
            ok = gt_is_type(v, json_string_value(k));
        size_t i;
        json_t *t;
        json_array_foreach(k, i, t) ok = ok || gt_is_type(v, json_string_value(t));
        if (!ok)
            return false;
    }
    if ((k = json_object_get(s, "const")) && !json_equal(k, v))
        return false;
    if ((k = json_object_get(s, "enum"))) {
        bool ok = false;
        size_t i;
        json_t *e;
        json_array_foreach(k, i, e) ok = ok || json_equal(e, v);
        if (!ok)
            return false;
    }
    if (json_is_string(v)) {
        size_t n = gt_cps(json_string_value(v), json_string_length(v));
        if ((k = json_object_get(s, "minLength")) && n < (size_t)json_integer_value(k))
            return false;
        if ((k = json_object_get(s, "maxLength")) && n > (size_t)json_integer_value(k))
            return false;
    }
    if (json_is_number(v)) {
        double x = json_number_value(v);
        if ((k = json_object_get(s, "minimum")) && x < json_number_value(k))
            return false;
        if ((k = json_object_get(s, "maximum")) && x > json_number_value(k))
            return false;
        if ((k = json_object_get(s, "exclusiveMinimum")) && x <= json_number_value(k))
            return false;
        if ((k = json_object_get(s, "exclusiveMaximum")) && x >= json_number_value(k))
            return false;
    }
    if (json_is_array(v)) {
        size_t n = json_array_size(v);
        if ((k = json_object_get(s, "minItems")) && n < (size_t)json_integer_value(k))
            return false;
        if ((k = json_object_get(s, "maxItems")) && n > (size_t)json_integer_value(k))
            return false;
        if ((k = json_object_get(s, "items"))) {
            size_t i;
            json_t *e;
            json_array_foreach(v, i, e) if (!gt_valid(e, k)) return false;
        }
    }
    if (json_is_object(v)) {
        json_t *props = json_object_get(s, "properties");
        json_t *addl = json_object_get(s, "additionalProperties");
        const char *key;
        json_t *e;
        json_object_foreach((json_t *)v, key, e) {
            json_t *ps = props ? json_object_get(props, key) : NULL;
            if (ps) {
                if (!gt_valid(e, ps))
                    return false;
            } else if (addl && !gt_valid(e, addl)) {
                return false;
            }
        }
        if ((k = json_object_get(s, "required"))) {
            size_t i;
            json_t *r;
            json_array_foreach(k, i, r) if (!json_object_get(v, json_string_value(r))) return false;
        }
    }
    return true;
}

/* splitmix64 */
static inline uint64_t gt_rand(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A random complete text of g (NUL-terminated, caller frees; *len_p its
 * length), walking the automaton one byte at a time from every byte it
 * allows; after soft_len bytes it prefers bytes that close values and ends
 * as soon as it may. NULL if the walk got stuck (a state that allows
 * nothing: a bug) or passed max_len. */
static inline char *gt_walk(const pd_grammar *g, uint64_t *rng, size_t soft_len, size_t max_len,
                            size_t *len_p) {
    garena ar = {.cap = 4 * (uint32_t)max_len + 64};
    ar.f = calloc(ar.cap, sizeof *ar.f);
    gframe root = {.node = g->root, .kind = GF_ROOT};
    const gframe *top = &root;
    char *out = malloc(max_len + 1);
    size_t n = 0;
    for (;;) {
        int cand[256], nc = 0, closers[256], ncl = 0;
        for (int b = 1; b < 256; b++) {
            uint32_t mark = ar.n;
            if (g_step(g, &ar, top, b)) {
                cand[nc++] = b;
                if (strchr("\"]}", b) || (b >= '0' && b <= '9') || b == 'e' || b == 'l' ||
                    b == 'u' || b == 's' || b == 'r' || b == 'a')
                    closers[ncl++] = b;
            }
            ar.n = mark;
        }
        uint32_t mark = ar.n;
        bool can_end = g_step(g, &ar, top, G_END) != NULL;
        ar.n = mark;
        if (can_end && (nc == 0 || n >= soft_len || gt_rand(rng) % 8 == 0))
            break;
        if (nc == 0 || n >= max_len || ar.n + 16 > ar.cap) {
            free(out);
            free(ar.f);
            return NULL;
        }
        int b;
        if (n >= soft_len && ncl > 0)
            b = closers[gt_rand(rng) % (uint64_t)ncl];
        else if (gt_rand(rng) % 4 == 0)
            b = cand[gt_rand(rng) % (uint64_t)nc];
        else { /* mostly ASCII, so that strings and keys end in reasonable time */
            int ascii[256], na = 0;
            for (int i = 0; i < nc; i++)
                if (cand[i] < 0x80)
                    ascii[na++] = cand[i];
            b = na ? ascii[gt_rand(rng) % (uint64_t)na] : cand[gt_rand(rng) % (uint64_t)nc];
        }
        top = g_step(g, &ar, top, b);
        out[n++] = (char)b;
    }
    out[n] = '\0';
    free(ar.f);
    *len_p = n;
    return out;
}

static inline pd_grammar *gt_compile(const char *schema) {
    pd_grammar *g = NULL;
    pd_err err = {{0}};
    pd_status st = pd_grammar_compile(schema, strlen(schema), &g, &err);
    if (st != PD_OK)
        fail_msg("compile %s: %s: %s", schema, pd_status_str(st), err.msg);
    return g;
}

#endif

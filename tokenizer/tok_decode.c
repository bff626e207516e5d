/* Decoding: whole sequences (pd_tok_decode) and streams (pd_detok).
 *
 * HF's Tokenizer::decode maps each id to its text (unknown ids dropped,
 * special ones dropped on request), ByteLevel-decodes the texts to bytes and
 * makes one String with from_utf8_lossy. Token bytes are precomputed at load
 * (tok_load.c), so decoding is concatenation plus UTF-8 repair.
 *
 * The streaming version keeps back only a trailing sequence that is a valid,
 * still incomplete prefix of a character. The repair (tok_utf8.c) decides at
 * each position from the next at most 4 bytes, and a held-back prefix is
 * exactly the case where it would need bytes not yet seen; so everything it
 * emits is what whole-sequence decoding emits for the same bytes.
 */
#include <string.h>

#include "tok_internal.h"

pd_status pd_tok_decode(const pd_tokenizer *t, const int32_t *ids, size_t n, bool skip_special,
                        char **text_p, size_t *len_p, pd_err *err) {
    if (!t || !text_p || (!ids && n > 0))
        return pd_err_set(err, PD_ERR_INVALID, "pd_tok_decode: NULL argument");
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id >= 0 && id < t->vocab_size && (t->flags[id] & TOK_F_EXISTS))
            total += t->bytes_len[id];
    }
    uint8_t *raw = malloc(total + 1);
    if (!raw)
        return pd_err_set(err, PD_ERR_NOMEM, "pd_tok_decode: out of memory (%zu bytes)", total);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->vocab_size || !(t->flags[id] & TOK_F_EXISTS))
            continue;
        if (skip_special && (t->flags[id] & TOK_F_SPECIAL))
            continue;
        memcpy(raw + o, t->arena + t->bytes_off[id], t->bytes_len[id]);
        o += t->bytes_len[id];
    }
    if (tok_utf8_valid_prefix(raw, o) == o) {
        raw[o] = '\0';
        *text_p = (char *)raw;
        if (len_p)
            *len_p = o;
        return PD_OK;
    }
    char *text;
    size_t len;
    pd_status st = pd_tok_utf8_repair((const char *)raw, o, &text, &len, err);
    free(raw);
    if (st != PD_OK)
        return st;
    *text_p = text;
    if (len_p)
        *len_p = len;
    return PD_OK;
}

/* ------------------------------------------------------------------ */
/* incremental                                                         */
/* ------------------------------------------------------------------ */

struct pd_detok {
    const pd_tokenizer *t;
    bool skip_special;
    uint8_t pending[4]; /* a valid but incomplete character, at most 3 bytes */
    size_t n_pending;
    uint8_t *in; /* pending + the new token's bytes */
    size_t in_cap;
    char *out; /* what the last call returned (NUL-terminated) */
    size_t out_cap;
};

pd_detok *pd_detok_new(const pd_tokenizer *t, bool skip_special) {
    if (!t)
        return NULL;
    pd_detok *d = calloc(1, sizeof *d);
    if (!d)
        return NULL;
    d->t = t;
    d->skip_special = skip_special;
    d->in_cap = 64;
    d->out_cap = 3 * d->in_cap + 1;
    d->in = malloc(d->in_cap);
    d->out = malloc(d->out_cap);
    if (!d->in || !d->out) {
        pd_detok_free(&d);
        return NULL;
    }
    d->out[0] = '\0';
    return d;
}

static bool reserve(pd_detok *d, size_t n_in) {
    if (n_in > d->in_cap) {
        size_t cap = d->in_cap;
        while (cap < n_in)
            cap *= 2;
        uint8_t *in = realloc(d->in, cap);
        if (!in)
            return false;
        d->in = in;
        d->in_cap = cap;
    }
    if (3 * n_in + 1 > d->out_cap) {
        size_t cap = 3 * d->in_cap + 1;
        char *out = realloc(d->out, cap);
        if (!out)
            return false;
        d->out = out;
        d->out_cap = cap;
    }
    return true;
}

/* Runs pending + (b, n) through the repair; keeps back an incomplete tail
 * unless final. */
static void feed(pd_detok *d, const char *b, size_t n, bool final, const char **out_p,
                 size_t *len_p) {
    size_t n_in = d->n_pending + n, o = 0;
    if (!reserve(d, n_in)) {
        /* out of memory: this token's bytes are lost; the stream stays valid UTF-8 */
        d->out[0] = '\0';
        *out_p = d->out;
        *len_p = 0;
        return;
    }
    memcpy(d->in, d->pending, d->n_pending);
    if (n)
        memcpy(d->in + d->n_pending, b, n);
    size_t used = tok_utf8_repair_into(d->in, n_in, final, d->out, &o);
    d->n_pending = n_in - used; /* <= 3 by construction of the repair */
    memcpy(d->pending, d->in + used, d->n_pending);
    d->out[o] = '\0';
    *out_p = d->out;
    *len_p = o;
}

void pd_detok_push(pd_detok *d, int32_t id, const char **out_p, size_t *len_p) {
    size_t n = 0;
    const char *b = pd_tok_token_bytes(d->t, id, &n);
    if (!b || (d->skip_special && pd_tok_is_special(d->t, id)))
        n = 0;
    feed(d, b, n, false, out_p, len_p);
}

void pd_detok_flush(pd_detok *d, const char **out_p, size_t *len_p) {
    feed(d, NULL, 0, true, out_p, len_p);
    d->n_pending = 0;
}

void pd_detok_free(pd_detok **dp) {
    if (!dp || !*dp)
        return;
    pd_detok *d = *dp;
    free(d->in);
    free(d->out);
    free(d);
    *dp = NULL;
}

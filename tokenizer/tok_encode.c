/* Encoding: added tokens, then the Split pre-tokenizer steps, then BPE.
 *
 * Order and semantics follow HF tokenizers (tokenizer/mod.rs
 * encode_single_sequence, added_vocabulary.rs extract_and_normalize,
 * normalizer.rs split with SplitDelimiterBehavior::Isolated):
 *   - added tokens are found leftmost-longest (Aho-Corasick
 *     MatchKind::LeftmostLongest) first among the normalized=false ones on
 *     the raw text, then among the normalized=true ones in each gap (the
 *     normalizer is the identity here); with encode_special_tokens a match
 *     of a special token is left in the text, which the search resumes after;
 *   - each Split step turns every current piece into its regex matches and
 *     the gaps between them, empty pieces dropped; the next step sees each
 *     piece as a whole string (so `(?!\S)` looks no further than its end);
 *   - each final piece is byte-pair encoded (tok_bpe.c).
 */
#include <string.h>

#include "tok_internal.h"

typedef struct {
    const pd_tokenizer *t;
    const uint8_t *text;   /* the (repaired) input */
    const uint8_t *mapped; /* what PCRE2 sees: text after tok_classmap_apply, or text */
    pd_tok_added_mode mode;
    pcre2_match_data *md;
    tok_bpe_scratch bpe;
    tok_ids out;
    pd_err *err;
} enc_ctx;

static pd_status nomem(enc_ctx *c) {
    return pd_err_set(c->err, PD_ERR_NOMEM, "pd_tok_encode: out of memory");
}

static size_t utf8_char_len(uint8_t b) {
    return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

/* Applies Split step k (and the ones after it) to the piece
 * text[off .. off+n). PCRE2 matches the mapped text, whose characters have
 * the same byte lengths as the original's. */
static pd_status split_level(enc_ctx *c, int k, size_t off, size_t n) {
    const pd_tokenizer *t = c->t;
    if (k == t->n_splits)
        return tok_bpe_word(t, c->text + off, n, &c->bpe, &c->out) == PD_OK ? PD_OK : nomem(c);
    const pcre2_code *re = t->split_re[k];
    const uint8_t *s = c->mapped + off;
    size_t last = 0, pos = 0;
    pd_status st;
    while (pos < n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, c->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc < 0) {
            PCRE2_UCHAR msg[120];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return pd_err_set(
                c->err, rc == PCRE2_ERROR_NOMEMORY ? PD_ERR_NOMEM : PD_ERR_LIMIT,
                "pd_tok_encode: pre-tokenizer regex %d failed on a %zu-byte piece: %s", k, n,
                (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { /* an empty match is no piece; step over one character */
            pos = ms + utf8_char_len(s[ms]);
            continue;
        }
        if (ms > last && (st = split_level(c, k + 1, off + last, ms - last)) != PD_OK)
            return st;
        if ((st = split_level(c, k + 1, off + ms, me - ms)) != PD_OK)
            return st;
        last = pos = me;
    }
    if (last < n)
        return split_level(c, k + 1, off + last, n - last);
    return PD_OK;
}

/* Cuts the added tokens of trie `pass` out of text[off .. off+n); the gaps
 * go to the next pass, and after the last pass to the pre-tokenizer. */
static pd_status split_added(enc_ctx *c, int pass, size_t off, size_t n) {
    const pd_tokenizer *t = c->t;
    if (n == 0)
        return PD_OK;
    if (pass == 2 || c->mode == PD_TOK_ADDED_NONE)
        return split_level(c, 0, off, n);
    if (t->trie[pass].n == 0)
        return split_added(c, pass + 1, off, n);
    const uint8_t *s = c->text + off;
    const tok_trie *tr = &t->trie[pass];
    const tok_trie_node *nodes = tr->nodes;
    size_t last = 0, i = 0;
    pd_status st;
    while (i < n) {
        if (!tr->first_byte[s[i]]) {
            i++;
            continue;
        }
        /* longest token starting at i */
        int32_t best = -1, node = 0;
        size_t best_len = 0;
        for (size_t j = i; j < n; j++) {
            int32_t ch = nodes[node].first_child;
            while (ch >= 0 && nodes[ch].byte != s[j])
                ch = nodes[ch].next_sibling;
            if (ch < 0)
                break;
            node = ch;
            if (nodes[node].token_id >= 0) {
                best = nodes[node].token_id;
                best_len = j - i + 1;
            }
        }
        if (best < 0) {
            i++;
            continue;
        }
        if (c->mode == PD_TOK_ADDED_NONSPECIAL && (t->flags[best] & TOK_F_SPECIAL)) {
            i += best_len; /* stays plain text; the search resumes after it */
            continue;
        }
        if (i > last && (st = split_added(c, pass + 1, off + last, i - last)) != PD_OK)
            return st;
        if (tok_ids_push(&c->out, best) != PD_OK)
            return nomem(c);
        i += best_len;
        last = i;
    }
    if (last < n)
        return split_added(c, pass + 1, off + last, n - last);
    return PD_OK;
}

pd_status pd_tok_encode_ex(const pd_tokenizer *t, const char *text, size_t len,
                           pd_tok_added_mode mode, int32_t **ids_p, size_t *n_p, pd_err *err) {
    if (!t || !ids_p || !n_p || (!text && len > 0))
        return pd_err_set(err, PD_ERR_INVALID, "pd_tok_encode: NULL argument");
    if (mode != PD_TOK_ADDED_ALL && mode != PD_TOK_ADDED_NONSPECIAL && mode != PD_TOK_ADDED_NONE)
        return pd_err_set(err, PD_ERR_INVALID, "pd_tok_encode: bad added-token mode %d", (int)mode);

    /* PCRE2 is only ever given well-formed UTF-8 (it runs with NO_UTF_CHECK) */
    const uint8_t *s = (const uint8_t *)text;
    char *repaired = NULL;
    if (len > 0 && tok_utf8_valid_prefix(s, len) < len) {
        size_t rlen;
        pd_status st = pd_tok_utf8_repair(text, len, &repaired, &rlen, err);
        if (st != PD_OK)
            return st;
        s = (const uint8_t *)repaired;
        len = rlen;
    }

    enc_ctx c = {.t = t, .text = s, .mapped = s, .mode = mode, .err = err};
    pd_status st = PD_OK;
    uint8_t *mapped = NULL;
    if (t->n_splits > 0 && !(c.md = pcre2_match_data_create(1, NULL)))
        st = nomem(&c);
    if (st == PD_OK && t->classmap && len > 0) {
        size_t i = 0;
        while (i < len && s[i] < 0x80)
            i++;
        if (i < len) { /* ASCII maps to itself */
            if (!(mapped = malloc(len)))
                st = nomem(&c);
            else
                tok_classmap_apply(t, s, len, mapped);
            c.mapped = mapped;
        }
    }
    if (st == PD_OK)
        st = split_added(&c, 0, 0, len);
    if (st == PD_OK && !c.out.v && !(c.out.v = malloc(sizeof *c.out.v)))
        st = nomem(&c);
    pcre2_match_data_free(c.md);
    tok_bpe_scratch_free(&c.bpe);
    free(mapped);
    free(repaired);
    if (st != PD_OK) {
        free(c.out.v);
        return st;
    }
    *ids_p = c.out.v;
    *n_p = c.out.n;
    return PD_OK;
}

pd_status pd_tok_encode(const pd_tokenizer *t, const char *text, size_t len, bool parse_special,
                        int32_t **ids_p, size_t *n_p, pd_err *err) {
    return pd_tok_encode_ex(
        t, text, len, parse_special ? PD_TOK_ADDED_ALL : PD_TOK_ADDED_NONSPECIAL, ids_p, n_p, err);
}

/* The vocabulary as byte tries, request states, and the token mask.
 *
 * The mask walks a trie of every token's bytes depth first, feeding each
 * edge's byte to the automaton from the state of the parent node; a refused
 * byte prunes the whole subtree, and every token ending at a reached node
 * is allowed. Frames made along a path come from a small arena reset on the
 * way back up, so a walk allocates nothing.
 *
 * Inside a string (the common case, and the expensive one: almost every
 * token is allowed there) the walk is split: "plain" tokens, whose bytes
 * are complete UTF-8 characters other than '"', '\\' and controls, leave a
 * string frame in its normal state with the count of code points grown by
 * their length, so they are allowed exactly when that length fits under
 * maxLength; they come from a precomputed list sorted by length. Only the
 * other tokens go through the automaton, in a trie of their own.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "grammar_impl.h"

typedef struct {
    /* first_child / next_sibling tree; node 0 is the root */
    uint32_t *child, *sibling, *tok_head;
    uint8_t *byte;
    uint32_t n, cap;
} gtrie;

struct pd_grammar_vocab {
    int vocab_size, tok_vocab;
    int32_t eos_id;
    uint32_t *off, *len; /* [tok_vocab] token bytes in arena; len 0: never allowed */
    uint8_t *arena;
    int32_t *tok_next; /* [tok_vocab] next token ending at the same trie node */
    gtrie all, nonplain;
    int32_t *plain;      /* plain tokens sorted by code points, ascending */
    uint32_t *plain_cps; /* their code points */
    int n_plain;
    uint32_t max_len; /* longest token, bytes */
};

#define NIL UINT32_MAX

static uint32_t trie_node(gtrie *t, uint8_t b) {
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 4096;
        t->child = realloc(t->child, t->cap * sizeof *t->child);
        t->sibling = realloc(t->sibling, t->cap * sizeof *t->sibling);
        t->tok_head = realloc(t->tok_head, t->cap * sizeof *t->tok_head);
        t->byte = realloc(t->byte, t->cap);
        PD_ASSERT(t->child && t->sibling && t->tok_head && t->byte);
    }
    uint32_t i = t->n++;
    t->child[i] = t->sibling[i] = t->tok_head[i] = NIL;
    t->byte[i] = b;
    return i;
}

static void trie_insert(gtrie *t, int32_t *tok_next, int32_t id, const uint8_t *s, uint32_t n) {
    uint32_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t c = t->child[at];
        while (c != NIL && t->byte[c] != s[i])
            c = t->sibling[c];
        if (c == NIL) {
            c = trie_node(t, s[i]);
            t->sibling[c] = t->child[at];
            t->child[at] = c;
        }
        at = c;
    }
    tok_next[id] = (int32_t)t->tok_head[at];
    t->tok_head[at] = (uint32_t)id;
}

static void trie_free(gtrie *t) {
    free(t->child);
    free(t->sibling);
    free(t->tok_head);
    free(t->byte);
}

/* Code points of s if it is plain string content (see the file comment),
 * else -1. */
static int64_t plain_cps(const uint8_t *s, uint32_t n) {
    int64_t cps = 0;
    for (uint32_t i = 0; i < n;) {
        uint8_t c = s[i];
        if (c < 0x20 || c == '"' || c == '\\')
            return -1;
        uint32_t need = 0, lo = 0x80, hi = 0xBF;
        if (c < 0x80)
            need = 0;
        else if (c >= 0xC2 && c <= 0xDF)
            need = 1;
        else if (c >= 0xE0 && c <= 0xEF) {
            need = 2;
            lo = c == 0xE0 ? 0xA0 : 0x80;
            hi = c == 0xED ? 0x9F : 0xBF;
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            lo = c == 0xF0 ? 0x90 : 0x80;
            hi = c == 0xF4 ? 0x8F : 0xBF;
        } else
            return -1;
        if (need > n - 1 - i) /* cut short: the rest is in the next token */
            return -1;
        for (uint32_t k = 1; k <= need; k++) {
            uint8_t d = s[i + k];
            if (d < (k == 1 ? lo : 0x80) || d > (k == 1 ? hi : 0xBF))
                return -1;
        }
        i += need + 1;
        cps++;
    }
    return cps;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

pd_status pd_grammar_vocab_init(const pd_tokenizer *tok, int vocab_size, int32_t eos_id,
                                pd_grammar_vocab **v_p, pd_err *err) {
    if (!tok || !v_p)
        return pd_err_set(err, PD_ERR_INVALID, "pd_grammar_vocab_init: NULL argument");
    int tv = pd_tok_vocab_size(tok);
    if (vocab_size < tv)
        return pd_err_set(err, PD_ERR_INVALID, "vocab_size %d is smaller than the tokenizer's %d",
                          vocab_size, tv);
    if (eos_id < 0 || eos_id >= vocab_size)
        return pd_err_set(err, PD_ERR_INVALID, "eos_id %d outside [0, %d)", (int)eos_id,
                          vocab_size);
    pd_grammar_vocab *v = pd_xcalloc(1, sizeof *v);
    v->vocab_size = vocab_size;
    v->tok_vocab = tv;
    v->eos_id = eos_id;
    v->off = pd_xcalloc((size_t)tv, sizeof *v->off);
    v->len = pd_xcalloc((size_t)tv, sizeof *v->len);
    size_t total = 0;
    for (int32_t id = 0; id < tv; id++) {
        size_t n = 0;
        if (!pd_tok_token_bytes(tok, id, &n) || pd_tok_is_added(tok, id))
            n = 0;
        v->len[id] = (uint32_t)n;
        v->off[id] = (uint32_t)total;
        total += n;
        if (n > v->max_len)
            v->max_len = (uint32_t)n;
    }
    v->arena = pd_xmalloc(total + 1);
    /* token lists per trie node: links [0, tv) for `all`, [tv, 2 tv) for `nonplain` */
    v->tok_next = pd_xcalloc(2 * (size_t)tv, sizeof *v->tok_next);
    uint32_t *cps = pd_xcalloc((size_t)tv, sizeof *cps);
    v->plain = pd_xcalloc((size_t)tv, sizeof *v->plain);
    trie_node(&v->all, 0);
    trie_node(&v->nonplain, 0);
    for (int32_t id = 0; id < tv; id++) {
        if (!v->len[id])
            continue;
        const char *b = pd_tok_token_bytes(tok, id, NULL);
        memcpy(v->arena + v->off[id], b, v->len[id]);
        const uint8_t *s = v->arena + v->off[id];
        trie_insert(&v->all, v->tok_next, id, s, v->len[id]);
        int64_t k = plain_cps(s, v->len[id]);
        if (k >= 0) {
            cps[id] = (uint32_t)k;
            v->plain[v->n_plain++] = id;
        } else {
            trie_insert(&v->nonplain, v->tok_next + tv, id, s, v->len[id]);
        }
    }
    /* sort plain tokens by code points (then id): keys cps << 32 | id */
    uint64_t *keys = pd_xcalloc((size_t)v->n_plain + 1, sizeof *keys);
    for (int i = 0; i < v->n_plain; i++)
        keys[i] = (uint64_t)cps[v->plain[i]] << 32 | (uint32_t)v->plain[i];
    qsort(keys, (size_t)v->n_plain, sizeof *keys, cmp_u64);
    v->plain_cps = pd_xcalloc((size_t)v->n_plain + 1, sizeof *v->plain_cps);
    for (int i = 0; i < v->n_plain; i++) {
        v->plain[i] = (int32_t)(keys[i] & 0xffffffffu);
        v->plain_cps[i] = (uint32_t)(keys[i] >> 32);
    }
    free(keys);
    free(cps);
    *v_p = v;
    return PD_OK;
}

pd_status pd_grammar_vocab_load(const char *tokenizer_json, int vocab_size, int32_t eos_id,
                                pd_grammar_vocab **v_p, pd_err *err) {
    pd_tokenizer *tok = NULL;
    pd_status st = pd_tok_load(tokenizer_json, &tok, err);
    if (st != PD_OK)
        return st;
    st = pd_grammar_vocab_init(tok, vocab_size, eos_id, v_p, err);
    pd_tok_free(&tok);
    return st;
}

void pd_grammar_vocab_free(pd_grammar_vocab **v_p) {
    if (!v_p || !*v_p)
        return;
    pd_grammar_vocab *v = *v_p;
    free(v->off);
    free(v->len);
    free(v->arena);
    free(v->tok_next);
    trie_free(&v->all);
    trie_free(&v->nonplain);
    free(v->plain);
    free(v->plain_cps);
    free(v);
    *v_p = NULL;
}

/* ---- states ------------------------------------------------------------ */

#define STACK_FRAMES (PD_GRAMMAR_MAX_DEPTH + 2)

struct pd_grammar_state {
    const pd_grammar *g;
    const pd_grammar_vocab *v;
    gframe stack[2][STACK_FRAMES]; /* the committed chain, double-buffered */
    int cur;
    const gframe *top;
    bool ended; /* EOS accepted */
    garena ar;
    uint32_t *words; /* scratch bitmap for mask_logits */
    int n_allowed;
};

pd_status pd_grammar_state_init(const pd_grammar *g, const pd_grammar_vocab *v,
                                pd_grammar_state **s_p, pd_err *err) {
    if (!g || !s_p)
        return pd_err_set(err, PD_ERR_INVALID, "pd_grammar_state_init: NULL argument");
    pd_grammar_state *s = pd_xcalloc(1, sizeof *s);
    s->g = g;
    s->v = v;
    /* a byte makes at most 3 frames (a copy of the top, a child, a copy of
     * the parent a number hands its terminator to) */
    uint32_t max_len = v ? v->max_len : 1;
    s->ar.cap = 4 * (max_len + 2) + 16;
    s->ar.f = pd_xcalloc(s->ar.cap, sizeof *s->ar.f);
    if (v)
        s->words = pd_xcalloc(((size_t)v->vocab_size + 31) / 32, sizeof *s->words);
    s->stack[0][0] = (gframe){.node = g->root, .kind = GF_ROOT};
    s->top = &s->stack[0][0];
    *s_p = s;
    return PD_OK;
}

void pd_grammar_state_free(pd_grammar_state **s_p) {
    if (!s_p || !*s_p)
        return;
    free((*s_p)->ar.f);
    free((*s_p)->words);
    free(*s_p);
    *s_p = NULL;
}

/* Copies the chain under top (arena or the current stack) into the other
 * stack and makes it current; resets the arena. */
static void state_commit(pd_grammar_state *s, const gframe *top) {
    int n = top->depth + 1;
    PD_ASSERT(n <= STACK_FRAMES);
    gframe *dst = s->stack[!s->cur];
    const gframe *f = top;
    for (int i = n - 1; i >= 0; i--, f = f->parent) {
        dst[i] = *f;
        dst[i].parent = i ? &dst[i - 1] : NULL;
    }
    s->cur = !s->cur;
    s->top = &dst[n - 1];
    s->ar.n = 0;
}

bool pd_grammar_state_accept_bytes(pd_grammar_state *s, const uint8_t *bytes, size_t n) {
    if (s->ended)
        return n == 0;
    gframe saved[STACK_FRAMES];
    int save_cur = s->cur;
    int depth = s->top->depth + 1;
    memcpy(saved, s->stack[s->cur], (size_t)depth * sizeof *saved);
    for (size_t i = 0; i < n; i++) {
        const gframe *t = g_step(s->g, &s->ar, s->top, bytes[i]);
        if (!t) {
            /* restore: the committed stack may have been swapped */
            s->cur = save_cur;
            memcpy(s->stack[s->cur], saved, (size_t)depth * sizeof *saved);
            for (int k = 0; k < depth; k++)
                s->stack[s->cur][k].parent = k ? &s->stack[s->cur][k - 1] : NULL;
            s->top = &s->stack[s->cur][depth - 1];
            s->ar.n = 0;
            return false;
        }
        state_commit(s, t);
    }
    return true;
}

bool pd_grammar_state_is_complete(const pd_grammar_state *s) {
    if (s->ended)
        return true;
    garena *ar = (garena *)&s->ar;
    uint32_t mark = ar->n;
    bool ok = g_step(s->g, ar, s->top, G_END) != NULL;
    ar->n = mark;
    return ok;
}

bool pd_grammar_state_is_terminal(const pd_grammar_state *s) {
    return s->ended || (s->top->kind == GF_ROOT && s->top->st != 0);
}

bool pd_grammar_state_accept_token(pd_grammar_state *s, int32_t token) {
    const pd_grammar_vocab *v = s->v;
    if (!v || s->ended || token < 0 || token >= v->vocab_size)
        return false;
    if (token == v->eos_id) {
        if (!pd_grammar_state_is_complete(s))
            return false;
        s->ended = true;
        return true;
    }
    if (token >= v->tok_vocab || !v->len[token])
        return false;
    const gframe *t = s->top;
    for (uint32_t i = 0; i < v->len[token] && t; i++)
        t = g_step(s->g, &s->ar, t, v->arena[v->off[token] + i]);
    if (!t) {
        s->ar.n = 0;
        return false;
    }
    state_commit(s, t);
    return true;
}

/* ---- the mask ------------------------------------------------------------ */

typedef struct {
    const pd_grammar *g;
    const gtrie *t;
    const int32_t *next;
    garena *ar;
    uint32_t *words;
    int n;
    bool budgeted;   /* allow only tokens after which the value can still be */
    uint64_t budget; /* completed in this many more tokens */
} walk;

static void walk_set(walk *w, uint32_t node, const gframe *after) {
    if (w->budgeted && g_close_bytes(after) > w->budget)
        return;
    for (uint32_t id = w->t->tok_head[node]; id != NIL; id = (uint32_t)w->next[id]) {
        uint32_t m = 1u << (id & 31);
        if (!(w->words[id >> 5] & m)) {
            w->words[id >> 5] |= m;
            w->n++;
        }
    }
}

static void walk_node(walk *w, uint32_t node, const gframe *top) {
    for (uint32_t c = w->t->child[node]; c != NIL; c = w->t->sibling[c]) {
        uint32_t mark = w->ar->n;
        const gframe *nt = g_step(w->g, w->ar, top, w->t->byte[c]);
        if (nt) {
            if (w->t->tok_head[c] != NIL)
                walk_set(w, c, nt);
            if (w->t->child[c] != NIL)
                walk_node(w, c, nt);
        }
        w->ar->n = mark;
    }
}

/* One walk; budgeted: as pd_grammar_state_fill_mask with tokens_left. */
static int fill(pd_grammar_state *s, uint32_t *words, bool budgeted, uint64_t budget) {
    const pd_grammar_vocab *v = s->v;
    memset(words, 0, ((size_t)v->vocab_size + 31) / 32 * sizeof *words);
    walk w = {.g = s->g, .ar = &s->ar, .words = words, .budgeted = budgeted, .budget = budget};
    const gframe *top = s->top;
    if (top->kind == GF_STR && top->st == GS_NORMAL) {
        /* a plain token of k code points leaves the same frame with a + k:
         * it fits under maxLength, and the shortest completion shrinks by
         * what it gives of a missing minLength */
        uint32_t room = top->node->max_len - top->a;
        uint64_t need = budgeted ? g_close_bytes(top) : 0;
        uint64_t deficit = top->a < top->node->min_len ? top->node->min_len - top->a : 0;
        for (int i = 0; i < v->n_plain && v->plain_cps[i] <= room; i++) {
            if (budgeted && need - (v->plain_cps[i] < deficit ? v->plain_cps[i] : deficit) > budget)
                continue;
            int32_t id = v->plain[i];
            words[id >> 5] |= 1u << (id & 31);
            w.n++;
        }
        w.t = &v->nonplain;
        w.next = v->tok_next + v->tok_vocab;
    } else {
        w.t = &v->all;
        w.next = v->tok_next;
    }
    s->ar.n = 0;
    walk_node(&w, 0, top);
    s->ar.n = 0;
    return w.n;
}

int pd_grammar_state_fill_mask(pd_grammar_state *s, uint32_t *words, int64_t tokens_left) {
    const pd_grammar_vocab *v = s->v;
    if (!v)
        return 0;
    if (s->ended) {
        memset(words, 0, ((size_t)v->vocab_size + 31) / 32 * sizeof *words);
        return 0;
    }
    int n = 0;
    if (tokens_left > 0)
        n = fill(s, words, true, (uint64_t)tokens_left - 1);
    if (n == 0) /* no budget, or too small to complete in: as if none */
        n = fill(s, words, false, 0);
    if (pd_grammar_state_is_complete(s)) {
        uint32_t m = 1u << (v->eos_id & 31);
        if (!(words[v->eos_id >> 5] & m)) {
            words[v->eos_id >> 5] |= m;
            n++;
        }
    }
    return n;
}

int pd_grammar_state_mask_logits(pd_grammar_state *s, float *logits, int64_t tokens_left) {
    if (!s->v || !s->words)
        return 0;
    int n = pd_grammar_state_fill_mask(s, s->words, tokens_left);
    const int V = s->v->vocab_size;
    for (int i = 0; i < V; i += 32) {
        uint32_t m = s->words[i >> 5];
        if (m == UINT32_MAX)
            continue;
        int end = i + 32 < V ? i + 32 : V;
        for (int k = i; k < end; k++)
            if (!(m & (1u << (k - i))))
                logits[k] = -INFINITY;
    }
    return n;
}

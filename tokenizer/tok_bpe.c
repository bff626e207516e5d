/* Byte-pair encoding of one pre-tokenized piece.
 *
 * The piece's bytes start as one symbol each (the vocab id of the byte's
 * GPT-2 character). Then, repeatedly, the adjacent pair with the lowest merge
 * rank is merged, the leftmost one on ties, until no adjacent pair has a
 * merge. That is the rule HF tokenizers applies (models/bpe/word.rs,
 * merge_all), and it is what we must reproduce id for id.
 *
 * Cost: symbols are a doubly linked list over arrays; candidate merges sit in
 * a binary min-heap keyed by (rank, position). Each merge removes one symbol
 * and pushes at most two candidates, so a piece of n bytes costs
 * O(n log n) — a 100k-character word included. Candidates made stale by an
 * earlier merge are recognised when popped (their left symbol is gone, or
 * the pair there no longer merges into the same token) and dropped.
 */
#include <string.h>

#include "tok_internal.h"

typedef struct {
    uint32_t rank;
    int32_t pos;    /* index of the left symbol */
    int32_t new_id; /* the token the pair merges into */
} tok_bpe_cand;

static inline bool cand_less(const tok_bpe_cand *a, const tok_bpe_cand *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(tok_bpe_cand *h, size_t *n, tok_bpe_cand c) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &h[p]))
            break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static tok_bpe_cand heap_pop(tok_bpe_cand *h, size_t *n) {
    tok_bpe_cand top = h[0];
    tok_bpe_cand last = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= m)
            break;
        size_t r = l + 1;
        size_t s = (r < m && cand_less(&h[r], &h[l])) ? r : l;
        if (!cand_less(&h[s], &last))
            break;
        h[i] = h[s];
        i = s;
    }
    h[i] = last;
    return top;
}

void tok_bpe_scratch_free(tok_bpe_scratch *s) {
    free(s->sym_id);
    free(s->sym_prev);
    free(s->sym_next);
    free(s->heap);
    memset(s, 0, sizeof *s);
}

static pd_status scratch_reserve(tok_bpe_scratch *s, size_t n) {
    if (n > s->cap) {
        size_t cap = s->cap ? s->cap : 64;
        while (cap < n)
            cap *= 2;
        int32_t *a = realloc(s->sym_id, cap * sizeof *a);
        if (a)
            s->sym_id = a;
        int32_t *b = realloc(s->sym_prev, cap * sizeof *b);
        if (b)
            s->sym_prev = b;
        int32_t *c = realloc(s->sym_next, cap * sizeof *c);
        if (c)
            s->sym_next = c;
        if (!a || !b || !c)
            return PD_ERR_NOMEM;
        s->cap = cap;
    }
    /* at most n - 1 initial candidates plus 2 per merge (n - 1 merges) */
    size_t hn = 3 * n + 1;
    if (hn > s->heap_cap) {
        size_t cap = s->heap_cap ? s->heap_cap : 256;
        while (cap < hn)
            cap *= 2;
        void *h = realloc(s->heap, cap * sizeof(tok_bpe_cand));
        if (!h)
            return PD_ERR_NOMEM;
        s->heap = h;
        s->heap_cap = cap;
    }
    return PD_OK;
}

pd_status tok_ids_push(tok_ids *v, int32_t id) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        int32_t *nv = realloc(v->v, cap * sizeof *nv);
        if (!nv)
            return PD_ERR_NOMEM;
        v->v = nv;
        v->cap = cap;
    }
    v->v[v->n++] = id;
    return PD_OK;
}

/* ignore_merges: the whole piece, spelled in GPT-2 characters, as one vocab
 * entry. Returns its id or -1. */
static int32_t whole_word_id(const pd_tokenizer *t, const uint8_t *bytes, size_t n) {
    char stack_buf[256];
    char *buf = n * 2 <= sizeof stack_buf ? stack_buf : malloc(n * 2);
    if (!buf)
        return -1;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        /* each byte's character is the text of its one-byte token */
        int32_t b = t->byte_id[bytes[i]];
        if (b < 0) {
            o = 0;
            break;
        }
        memcpy(buf + o, t->arena + t->vkey_off[b], t->vkey_len[b]);
        o += t->vkey_len[b];
    }
    int32_t id = o ? tok_vocab_get(t, buf, o) : -1;
    if (buf != stack_buf)
        free(buf);
    return id;
}

/* ------------------------------------------------------------------ */
/* word cache                                                          */
/* ------------------------------------------------------------------ */

tok_cache *tok_cache_new(void) {
    tok_cache *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    for (int i = 0; i < TOK_CACHE_SHARDS; i++)
        pthread_mutex_init(&c->lock[i], NULL);
    return c;
}

void tok_cache_free(tok_cache *c) {
    if (!c)
        return;
    for (int i = 0; i < TOK_CACHE_SHARDS; i++)
        pthread_mutex_destroy(&c->lock[i]);
    free(c);
}

static uint64_t word_hash(const uint8_t *p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
    return h | 1; /* never 0, which marks an empty slot */
}

static bool cache_get(tok_cache *c, uint64_t h, const uint8_t *key, size_t n, tok_ids *out,
                      bool *found) {
    size_t i = (size_t)(h >> 17) & (TOK_CACHE_SLOTS - 1);
    tok_cache_slot *sl = &c->slot[i];
    int32_t ids[TOK_CACHE_IDS];
    uint8_t k = 0;
    pthread_mutex_t *m = &c->lock[i % TOK_CACHE_SHARDS];
    pthread_mutex_lock(m);
    *found = sl->hash == h && sl->len == n && memcmp(sl->key, key, n) == 0;
    if (*found) {
        k = sl->n;
        memcpy(ids, sl->ids, k * sizeof *ids);
    }
    pthread_mutex_unlock(m);
    for (uint8_t j = 0; j < k; j++)
        if (tok_ids_push(out, ids[j]) != PD_OK)
            return false;
    return true;
}

static void cache_put(tok_cache *c, uint64_t h, const uint8_t *key, size_t n, const int32_t *ids,
                      size_t k) {
    size_t i = (size_t)(h >> 17) & (TOK_CACHE_SLOTS - 1);
    tok_cache_slot *sl = &c->slot[i];
    pthread_mutex_t *m = &c->lock[i % TOK_CACHE_SHARDS];
    pthread_mutex_lock(m);
    sl->hash = h;
    sl->len = (uint8_t)n;
    sl->n = (uint8_t)k;
    memcpy(sl->key, key, n);
    memcpy(sl->ids, ids, k * sizeof *ids);
    pthread_mutex_unlock(m);
}

static pd_status bpe_merge(const pd_tokenizer *t, const uint8_t *bytes, size_t n,
                           tok_bpe_scratch *s, tok_ids *out);

pd_status tok_bpe_word(const pd_tokenizer *t, const uint8_t *bytes, size_t n, tok_bpe_scratch *s,
                       tok_ids *out) {
    if (n == 0)
        return PD_OK;
    if (n == 1)
        return t->byte_id[bytes[0]] >= 0 ? tok_ids_push(out, t->byte_id[bytes[0]]) : PD_OK;
    if (t->ignore_merges) {
        int32_t id = whole_word_id(t, bytes, n);
        if (id >= 0)
            return tok_ids_push(out, id);
    }
    if (!t->cache || n > TOK_CACHE_KEY)
        return bpe_merge(t, bytes, n, s, out);
    uint64_t h = word_hash(bytes, n);
    bool found;
    if (!cache_get(t->cache, h, bytes, n, out, &found))
        return PD_ERR_NOMEM;
    if (found)
        return PD_OK;
    size_t start = out->n;
    pd_status st = bpe_merge(t, bytes, n, s, out);
    if (st == PD_OK && out->n - start <= TOK_CACHE_IDS)
        cache_put(t->cache, h, bytes, n, out->v + start, out->n - start);
    return st;
}

/* The merge loop proper (see the top of this file). */
static pd_status bpe_merge(const pd_tokenizer *t, const uint8_t *bytes, size_t n,
                           tok_bpe_scratch *s, tok_ids *out) {
    if (n > INT32_MAX / 4 || scratch_reserve(s, n) != PD_OK)
        return PD_ERR_NOMEM;

    /* initial symbols; bytes without a vocab entry are dropped, as HF's BPE
     * does for unknown characters when there is no unk_token */
    int32_t *id = s->sym_id, *prev = s->sym_prev, *next = s->sym_next;
    int32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t b = t->byte_id[bytes[i]];
        if (b >= 0)
            id[m++] = b;
    }
    for (int32_t i = 0; i < m; i++) {
        prev[i] = i - 1;
        next[i] = i + 1 < m ? i + 1 : -1;
    }

    tok_bpe_cand *heap = s->heap;
    size_t hn = 0;
    for (int32_t i = 0; i + 1 < m; i++) {
        uint32_t rank;
        int32_t nid = tok_merge_get(t, id[i], id[i + 1], &rank);
        if (nid >= 0)
            heap_push(heap, &hn, (tok_bpe_cand){rank, i, nid});
    }
    while (hn > 0) {
        tok_bpe_cand c = heap_pop(heap, &hn);
        int32_t p = c.pos;
        if (id[p] < 0 || next[p] < 0)
            continue; /* symbol merged away, or now last */
        int32_t q = next[p];
        uint32_t rank;
        if (tok_merge_get(t, id[p], id[q], &rank) != c.new_id)
            continue; /* the pair at p changed since this candidate was made */
        /* merge q into p */
        id[p] = c.new_id;
        id[q] = -1;
        next[p] = next[q];
        if (next[q] >= 0)
            prev[next[q]] = p;
        if (prev[p] >= 0) {
            int32_t nid = tok_merge_get(t, id[prev[p]], id[p], &rank);
            if (nid >= 0)
                heap_push(heap, &hn, (tok_bpe_cand){rank, prev[p], nid});
        }
        if (next[p] >= 0) {
            int32_t nid = tok_merge_get(t, id[p], id[next[p]], &rank);
            if (nid >= 0)
                heap_push(heap, &hn, (tok_bpe_cand){rank, p, nid});
        }
    }
    for (int32_t i = 0; i >= 0 && m > 0; i = next[i])
        if (tok_ids_push(out, id[i]) != PD_OK)
            return PD_ERR_NOMEM;
    return PD_OK;
}

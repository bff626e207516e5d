/* tokenizer/ internals shared by the tok_*.c files; not part of the API.
 *
 * Layout of a loaded tokenizer:
 *   - per id (0 <= id < vocab_size): its text as tokenizer.json spells it
 *     (vocab key or added-token content) and its ByteLevel-decoded bytes,
 *     both as (offset, length) into one arena; flags (exists, added,
 *     special);
 *   - two open-addressing hash tables string -> id (vocab keys, added
 *     contents) whose slots hold ids and compare against the id's text;
 *   - the merge table (left id, right id) -> (rank, merged id), open
 *     addressing on a 64-bit key;
 *   - byte_id[b]: the vocab id of the one-character token standing for byte
 *     b under the GPT-2 byte -> unicode mapping (-1 if the vocab lacks it);
 *   - two byte tries of added-token contents (the normalized=false ones,
 *     matched first on the raw text, and the normalized=true ones);
 *   - the compiled Split regexes, applied in order.
 */
#ifndef PD_TOK_INTERNAL_H
#define PD_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <pthread.h>

#include "pd_tokenizer.h"

#define TOK_MAX_SPLITS 8
#define TOK_MAX_ID     (1 << 24) /* ids above this in a tokenizer.json are refused */

enum {
    TOK_F_EXISTS = 1,  /* the id names a token */
    TOK_F_ADDED = 2,   /* it is an added token */
    TOK_F_SPECIAL = 4, /* added token with special=true */
};

/* A growable array of ids. */
typedef struct {
    int32_t *v;
    size_t n, cap;
} tok_ids;

/* One node of a byte trie; children form a singly linked sibling list. */
typedef struct {
    int32_t first_child, next_sibling;
    int32_t token_id; /* -1 unless a token ends here */
    uint8_t byte;
} tok_trie_node;

typedef struct {
    tok_trie_node *nodes; /* nodes[0] is the root */
    size_t n, cap;
    bool first_byte[256]; /* fast reject: can a token start with this byte */
} tok_trie;

typedef struct {
    uint64_t key;   /* (left << 32) | right, both as uint32 */
    uint32_t rank;  /* index in "merges": lower merges first */
    int32_t new_id; /* -1: empty slot */
} tok_merge_slot;

/* Word cache: piece bytes -> ids for short pieces, shared by all threads.
 * Direct-mapped (a new word replaces whatever sat in its slot), so memory is
 * fixed; slots are guarded by striped mutexes. */
#define TOK_CACHE_KEY    23
#define TOK_CACHE_IDS    8
#define TOK_CACHE_SLOTS  (1 << 15)
#define TOK_CACHE_SHARDS 64
typedef struct {
    uint64_t hash; /* 0: empty */
    uint8_t len, n;
    char key[TOK_CACHE_KEY];
    int32_t ids[TOK_CACHE_IDS];
} tok_cache_slot;

typedef struct {
    pthread_mutex_t lock[TOK_CACHE_SHARDS];
    tok_cache_slot slot[TOK_CACHE_SLOTS];
} tok_cache;

struct pd_tokenizer {
    char *path; /* for messages */
    int vocab_size;
    uint32_t *text_off, *text_len;   /* per id, into arena (text is NUL-terminated) */
    uint32_t *vkey_off, *vkey_len;   /* per id, its model.vocab key (usually == text) */
    uint32_t *bytes_off, *bytes_len; /* per id, into arena */
    uint8_t *flags;                  /* per id, TOK_F_* */
    size_t max_token_bytes;          /* max of bytes_len over existing ids */
    char *arena;
    size_t arena_len, arena_cap;

    int32_t *vocab_slots; /* vocab key -> id */
    size_t vocab_mask;
    int32_t *added_slots; /* added content -> id */
    size_t added_mask;

    tok_merge_slot *merges;
    size_t merge_mask, n_merges;

    int32_t byte_id[256];
    bool ignore_merges; /* BPE option: a whole word found in the vocab is one token */

    tok_trie trie[2]; /* [0] normalized=false tokens, [1] normalized=true */

    pcre2_code *split_re[TOK_MAX_SPLITS];
    int n_splits;

    /* class mapping (tok_classmap.c): on unless a pattern uses a construct
     * the mapping cannot preserve; keep[] are code points written literally
     * in the patterns, which are passed through unmapped */
    bool classmap;
    bool classmap_unsafe;

    tok_cache *cache; /* NULL: no cache (allocation failed; everything still works) */
    uint32_t (*keep)[2];
    size_t n_keep, keep_cap;
};

/* ---- tok_load.c ---- */
uint64_t tok_hash_bytes(const void *p, size_t n);
/* Hash-table lookups: a vocab key, an added token's content; -1 if absent. */
int32_t tok_vocab_get(const pd_tokenizer *t, const char *s, size_t n);
int32_t tok_added_get(const pd_tokenizer *t, const char *s, size_t n);
/* Merge lookup: returns the merged id and sets *rank_p, or -1. */
static inline int32_t tok_merge_get(const pd_tokenizer *t, int32_t left, int32_t right,
                                    uint32_t *rank_p) {
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    size_t i = (size_t)(h >> 29) & t->merge_mask;
    for (;;) {
        const tok_merge_slot *s = &t->merges[i];
        if (s->new_id < 0)
            return -1;
        if (s->key == key) {
            *rank_p = s->rank;
            return s->new_id;
        }
        i = (i + 1) & t->merge_mask;
    }
}

/* ---- tok_unicode_data.c (generated) and tok_classmap.c ---- */
enum { TOK_UC_OTHER = 0, TOK_UC_L, TOK_UC_M, TOK_UC_N, TOK_UC_P, TOK_UC_S, TOK_UC_WS };
extern const char tok_uc_version[];
extern const uint16_t tok_uc_stage1[0x1100];
extern const uint8_t tok_uc_stage2[][128];

static inline int tok_uc_class(uint32_t cp) {
    uint8_t b = tok_uc_stage2[tok_uc_stage1[cp >> 8]][(cp & 0xFF) >> 1];
    return (cp & 1) ? b >> 4 : b & 15;
}

/* Records what pattern (len bytes; literal: a String pattern) needs from the
 * mapping: its literal non-ASCII characters, or that it cannot be mapped. */
pd_status tok_classmap_note_pattern(pd_tokenizer *t, const char *pattern, size_t len, bool literal);
/* Decides whether the mapping is used (after every pattern is noted). */
void tok_classmap_finish(pd_tokenizer *t);
/* out[0..n) = s[0..n) with each non-ASCII character outside keep[] replaced
 * by the representative of its class, of the same UTF-8 length. s must be
 * well-formed UTF-8. */
void tok_classmap_apply(const pd_tokenizer *t, const uint8_t *s, size_t n, uint8_t *out);

/* ---- tok_utf8.c ---- */
/* Length of the well-formed UTF-8 prefix of s (== n when all valid). */
size_t tok_utf8_valid_prefix(const uint8_t *s, size_t n);
/* Appends s[0..n) to out with each maximal ill-formed subsequence replaced by
 * U+FFFD. When !final, a trailing sequence that is a valid but incomplete
 * prefix of a character is not consumed; returns the number of bytes
 * consumed. out must have room for 3 * n bytes (worst case: every byte
 * becomes EF BF BD). */
size_t tok_utf8_repair_into(const uint8_t *s, size_t n, bool final, char *out, size_t *out_len);

/* ---- tok_bpe.c ---- */
tok_cache *tok_cache_new(void);
void tok_cache_free(tok_cache *c);
typedef struct {
    int32_t *sym_id, *sym_prev, *sym_next;
    void *heap; /* tok_bpe_cand[] */
    size_t cap, heap_cap;
} tok_bpe_scratch;

void tok_bpe_scratch_free(tok_bpe_scratch *s);
/* BPE over one pre-tokenized piece (raw bytes; ByteLevel mapping applied
 * here through byte_id); appends the ids to out. Uses and fills t->cache. */
pd_status tok_bpe_word(const pd_tokenizer *t, const uint8_t *bytes, size_t n,
                       tok_bpe_scratch *scratch, tok_ids *out);

pd_status tok_ids_push(tok_ids *v, int32_t id);

#endif

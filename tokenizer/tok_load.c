/* Loading a Hugging Face tokenizer.json (byte-level BPE) and the per-id
 * queries (text, bytes, special flag, lookup by text).
 *
 * Format reference: huggingface/tokenizers, tokenizers/src/tokenizer/
 * serialization.rs and the serde forms of models/bpe, pre_tokenizers/split,
 * pre_tokenizers/byte_level, decoders/byte_level. The GPT-2 byte -> unicode
 * table is from openai/gpt-2 encoder.py bytes_to_unicode().
 */
#include <jansson.h>
#include <string.h>

#include "tok_internal.h"

/* The regex ByteLevel splits with when use_regex is true (GPT-2's). */
static const char GPT2_SPLIT_RE[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ------------------------------------------------------------------ */
/* GPT-2 byte <-> unicode                                              */
/* ------------------------------------------------------------------ */

/* bytes_to_unicode(): printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ')
 * stand for themselves; the other 68 bytes map, in byte order, to U+0100.. */
static uint32_t byte_to_cp(uint8_t b) {
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE))
        return b;
    uint32_t k = 0;
    for (uint32_t c = 0; c < b; c++)
        if (!((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE)))
            k++;
    return 0x100 + k;
}

static int cp_to_utf8(uint32_t cp, char *o) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* ------------------------------------------------------------------ */
/* hashing and tables                                                  */
/* ------------------------------------------------------------------ */

uint64_t tok_hash_bytes(const void *p, size_t n) {
    const uint8_t *s = p;
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a 64 */
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 0x100000001b3ull;
    }
    return h ^ (h >> 29);
}

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n)
        c <<= 1;
    return c;
}

/* Open addressing over ids; each slot's key is the string (off[id], len[id]). */
static int32_t map_get(const pd_tokenizer *t, const int32_t *slots, size_t mask,
                       const uint32_t *off, const uint32_t *len, const char *s, size_t n) {
    if (!slots)
        return -1;
    size_t i = (size_t)tok_hash_bytes(s, n) & mask;
    for (;;) {
        int32_t id = slots[i];
        if (id < 0)
            return -1;
        if (len[id] == n && memcmp(t->arena + off[id], s, n) == 0)
            return id;
        i = (i + 1) & mask;
    }
}

int32_t tok_vocab_get(const pd_tokenizer *t, const char *s, size_t n) {
    return map_get(t, t->vocab_slots, t->vocab_mask, t->vkey_off, t->vkey_len, s, n);
}

int32_t tok_added_get(const pd_tokenizer *t, const char *s, size_t n) {
    return map_get(t, t->added_slots, t->added_mask, t->text_off, t->text_len, s, n);
}

/* Inserts id unless its key (off[id], len[id]) is present already. */
static void map_put(pd_tokenizer *t, int32_t *slots, size_t mask, const uint32_t *off,
                    const uint32_t *len, int32_t id) {
    const char *s = t->arena + off[id];
    size_t n = len[id];
    size_t i = (size_t)tok_hash_bytes(s, n) & mask;
    while (slots[i] >= 0) {
        int32_t o = slots[i];
        if (len[o] == n && memcmp(t->arena + off[o], s, n) == 0)
            return;
        i = (i + 1) & mask;
    }
    slots[i] = id;
}

static void merge_put(pd_tokenizer *t, int32_t left, int32_t right, uint32_t rank, int32_t new_id) {
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    size_t i = (size_t)(h >> 29) & t->merge_mask;
    while (t->merges[i].new_id >= 0 && t->merges[i].key != key)
        i = (i + 1) & t->merge_mask;
    /* a repeated pair keeps the later rank, as HF's HashMap collect does */
    t->merges[i].key = key;
    t->merges[i].rank = rank;
    t->merges[i].new_id = new_id;
}

/* Appends n bytes and a NUL to the arena; returns the offset or -1. */
static int64_t arena_add(pd_tokenizer *t, const char *s, size_t n) {
    if (t->arena_len + n + 1 > UINT32_MAX)
        return -1;
    if (t->arena_len + n + 1 > t->arena_cap) {
        size_t cap = t->arena_cap ? t->arena_cap : 1 << 20;
        while (cap < t->arena_len + n + 1)
            cap *= 2;
        char *a = realloc(t->arena, cap);
        if (!a)
            return -1;
        t->arena = a;
        t->arena_cap = cap;
    }
    int64_t off = (int64_t)t->arena_len;
    if (n)
        memcpy(t->arena + off, s, n);
    t->arena[off + (int64_t)n] = '\0';
    t->arena_len += n + 1;
    return off;
}

/* ------------------------------------------------------------------ */
/* tries of added tokens                                               */
/* ------------------------------------------------------------------ */

static int32_t trie_new_node(tok_trie *tr, uint8_t byte) {
    if (tr->n == tr->cap) {
        size_t cap = tr->cap ? tr->cap * 2 : 256;
        tok_trie_node *nn = realloc(tr->nodes, cap * sizeof *nn);
        if (!nn)
            return -1;
        tr->nodes = nn;
        tr->cap = cap;
    }
    tok_trie_node *nd = &tr->nodes[tr->n];
    nd->first_child = nd->next_sibling = nd->token_id = -1;
    nd->byte = byte;
    return (int32_t)tr->n++;
}

static pd_status trie_insert(tok_trie *tr, const uint8_t *s, size_t n, int32_t id) {
    if (tr->n == 0 && trie_new_node(tr, 0) < 0)
        return PD_ERR_NOMEM;
    int32_t cur = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t c = tr->nodes[cur].first_child;
        while (c >= 0 && tr->nodes[c].byte != s[i])
            c = tr->nodes[c].next_sibling;
        if (c < 0) {
            c = trie_new_node(tr, s[i]);
            if (c < 0)
                return PD_ERR_NOMEM;
            tr->nodes[c].next_sibling = tr->nodes[cur].first_child;
            tr->nodes[cur].first_child = c;
        }
        cur = c;
    }
    /* the same content twice: HF keeps one pattern per content, last id wins */
    tr->nodes[cur].token_id = id;
    tr->first_byte[s[0]] = true;
    return PD_OK;
}

/* ------------------------------------------------------------------ */
/* JSON helpers                                                        */
/* ------------------------------------------------------------------ */

typedef struct {
    const char *path;
    pd_err *err;
    const json_t *merges; /* model.merges */
} load_ctx;

static bool json_is_null_or_absent(const json_t *j) {
    return j == NULL || json_is_null(j);
}

static const char *json_type_str(const json_t *obj) {
    const json_t *ty = json_object_get(obj, "type");
    return json_is_string(ty) ? json_string_value(ty) : NULL;
}

/* A boolean field that must be absent/null/false (or the given value). */
static bool json_flag(const json_t *obj, const char *key) {
    const json_t *j = json_object_get(obj, key);
    return json_is_true(j);
}

/* ------------------------------------------------------------------ */
/* the parts of tokenizer.json                                         */
/* ------------------------------------------------------------------ */

static pd_status add_split(pd_tokenizer *t, load_ctx *c, const char *pattern, size_t len,
                           bool literal, const char *where) {
    if (t->n_splits == TOK_MAX_SPLITS)
        return pd_err_set(c->err, PD_ERR_UNSUPPORTED, "%s: %s: more than %d Split steps", c->path,
                          where, TOK_MAX_SPLITS);
    int ec;
    PCRE2_SIZE eo;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, len, opts, &ec, &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return pd_err_set(c->err, PD_ERR_FORMAT, "%s: %s: bad regex at offset %zu: %s", c->path,
                          where, (size_t)eo, (const char *)msg);
    }
    /* JIT is an optimisation only; the interpreter gives the same matches */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    t->split_re[t->n_splits++] = re;
    if (tok_classmap_note_pattern(t, pattern, len, literal) != PD_OK)
        return pd_err_set(c->err, PD_ERR_NOMEM, "%s: out of memory", c->path);
    return PD_OK;
}

static pd_status parse_pretok_one(pd_tokenizer *t, load_ctx *c, const json_t *pt, int idx,
                                  bool *byte_level_seen) {
    char where[64];
    snprintf(where, sizeof where, "pre_tokenizer[%d]", idx);
    const char *type = json_type_str(pt);
    if (!type)
        return pd_err_set(c->err, PD_ERR_FORMAT, "%s: %s: no \"type\"", c->path, where);
    if (*byte_level_seen)
        return pd_err_set(c->err, PD_ERR_UNSUPPORTED, "%s: %s: %s after ByteLevel", c->path, where,
                          type);
    if (strcmp(type, "Split") == 0) {
        const json_t *beh = json_object_get(pt, "behavior");
        if (!json_is_string(beh) || strcmp(json_string_value(beh), "Isolated") != 0)
            return pd_err_set(c->err, PD_ERR_UNSUPPORTED,
                              "%s: %s: Split behavior other than Isolated", c->path, where);
        if (json_flag(pt, "invert"))
            return pd_err_set(c->err, PD_ERR_UNSUPPORTED, "%s: %s: Split with invert", c->path,
                              where);
        const json_t *pat = json_object_get(pt, "pattern");
        const json_t *re = json_object_get(pat, "Regex");
        const json_t *str = json_object_get(pat, "String");
        if (json_is_string(re))
            return add_split(t, c, json_string_value(re), json_string_length(re), false, where);
        if (json_is_string(str))
            return add_split(t, c, json_string_value(str), json_string_length(str), true, where);
        return pd_err_set(c->err, PD_ERR_FORMAT, "%s: %s: pattern is neither Regex nor String",
                          c->path, where);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        if (json_flag(pt, "add_prefix_space"))
            return pd_err_set(c->err, PD_ERR_UNSUPPORTED, "%s: %s: ByteLevel add_prefix_space",
                              c->path, where);
        *byte_level_seen = true;
        const json_t *ur = json_object_get(pt, "use_regex");
        if (json_is_null_or_absent(ur) || json_is_true(ur)) /* HF's default is true */
            return add_split(t, c, GPT2_SPLIT_RE, sizeof GPT2_SPLIT_RE - 1, false, where);
        return PD_OK;
    }
    return pd_err_set(c->err, PD_ERR_UNSUPPORTED, "%s: %s: pre-tokenizer type %s", c->path, where,
                      type);
}

static pd_status parse_pretok(pd_tokenizer *t, load_ctx *c, const json_t *pt) {
    bool bl = false;
    const char *type = json_is_object(pt) ? json_type_str(pt) : NULL;
    if (!type)
        return pd_err_set(c->err, PD_ERR_UNSUPPORTED,
                          "%s: pre_tokenizer: missing (byte-level BPE needs ByteLevel)", c->path);
    pd_status st;
    if (strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(pt, "pretokenizers");
        if (!json_is_array(list))
            return pd_err_set(c->err, PD_ERR_FORMAT,
                              "%s: pre_tokenizer: Sequence without pretokenizers", c->path);
        for (size_t i = 0; i < json_array_size(list); i++)
            if ((st = parse_pretok_one(t, c, json_array_get(list, i), (int)i, &bl)) != PD_OK)
                return st;
    } else if ((st = parse_pretok_one(t, c, pt, 0, &bl)) != PD_OK) {
        return st;
    }
    if (!bl)
        return pd_err_set(c->err, PD_ERR_UNSUPPORTED,
                          "%s: pre_tokenizer: no ByteLevel step (only byte-level BPE is supported)",
                          c->path);
    return PD_OK;
}

static pd_status check_normalizer(load_ctx *c, const json_t *n) {
    if (json_is_null_or_absent(n))
        return PD_OK;
    const char *type = json_type_str(n);
    const json_t *list = json_object_get(n, "normalizers");
    if (type && strcmp(type, "Sequence") == 0 && json_is_array(list) && json_array_size(list) == 0)
        return PD_OK;
    return pd_err_set(c->err, PD_ERR_UNSUPPORTED,
                      "%s: normalizer: only null or an empty Sequence is supported (got %s)",
                      c->path, type ? type : "?");
}

static pd_status check_decoder(load_ctx *c, const json_t *d) {
    const char *type = json_is_object(d) ? json_type_str(d) : NULL;
    if (type && strcmp(type, "ByteLevel") == 0)
        return PD_OK;
    return pd_err_set(c->err, PD_ERR_UNSUPPORTED,
                      "%s: decoder: only ByteLevel is supported (got %s)", c->path,
                      type ? type : "none");
}

static pd_status check_model(pd_tokenizer *t, load_ctx *c, const json_t *m) {
    if (!json_is_object(m))
        return pd_err_set(c->err, PD_ERR_FORMAT, "%s: model: missing", c->path);
    const char *type = json_type_str(m);
    if (type && strcmp(type, "BPE") != 0)
        return pd_err_set(c->err, PD_ERR_UNSUPPORTED, "%s: model: type %s (only BPE)", c->path,
                          type);
    const json_t *dropout = json_object_get(m, "dropout");
    if (!json_is_null_or_absent(dropout))
        return pd_err_set(c->err, PD_ERR_UNSUPPORTED, "%s: model: BPE dropout", c->path);
    if (!json_is_null_or_absent(json_object_get(m, "unk_token")))
        return pd_err_set(c->err, PD_ERR_UNSUPPORTED, "%s: model: unk_token", c->path);
    if (json_flag(m, "byte_fallback"))
        return pd_err_set(c->err, PD_ERR_UNSUPPORTED, "%s: model: byte_fallback", c->path);
    const char *affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const json_t *a = json_object_get(m, affixes[i]);
        if (!json_is_null_or_absent(a) && !(json_is_string(a) && json_string_length(a) == 0))
            return pd_err_set(c->err, PD_ERR_UNSUPPORTED, "%s: model: %s", c->path, affixes[i]);
    }
    t->ignore_merges = json_flag(m, "ignore_merges");
    if (!json_is_object(json_object_get(m, "vocab")))
        return pd_err_set(c->err, PD_ERR_FORMAT, "%s: model.vocab: missing or not an object",
                          c->path);
    if (!json_is_array(json_object_get(m, "merges")))
        return pd_err_set(c->err, PD_ERR_FORMAT, "%s: model.merges: missing or not an array",
                          c->path);
    return PD_OK;
}

/* Validates added_tokens and assigns their ids the way HF does on load
 * (tokenizer/serialization.rs, added_vocabulary.rs add_tokens): the "id" in
 * the file is only checked, never used. A content already added keeps its
 * id; a content in model.vocab takes the vocab id; any other gets
 * len(model.vocab), or max(added ids) + 1 once that is past it. For a
 * consistent file (DeepSeek-V3's) the result equals the file's ids. */
static pd_status assign_added(load_ctx *c, const json_t *vocab, const json_t *added, int32_t *ids,
                              int64_t *max_id) {
    int64_t vocab_len = (int64_t)json_object_size(vocab), added_max = -1;
    size_t n_moved = 0;
    for (size_t i = 0; i < json_array_size(added); i++) {
        const json_t *a = json_array_get(added, i);
        const json_t *id = json_object_get(a, "id");
        const json_t *content = json_object_get(a, "content");
        if (!json_is_object(a) || !json_is_string(content) || json_string_length(content) == 0)
            return pd_err_set(c->err, PD_ERR_FORMAT, "%s: added_tokens[%zu]: bad content", c->path,
                              i);
        if (json_flag(a, "lstrip") || json_flag(a, "rstrip") || json_flag(a, "single_word"))
            return pd_err_set(c->err, PD_ERR_UNSUPPORTED,
                              "%s: added_tokens[%zu]: lstrip/rstrip/single_word", c->path, i);
        const char *s = json_string_value(content);
        size_t len = json_string_length(content);
        int64_t got = -1;
        for (size_t k = 0; k < i && got < 0; k++) { /* earlier added token, same content */
            const json_t *ck = json_object_get(json_array_get(added, k), "content");
            if (json_string_length(ck) == len && memcmp(json_string_value(ck), s, len) == 0)
                got = ids[k];
        }
        if (got < 0 && strlen(s) == len) {
            const json_t *v = json_object_get(vocab, s);
            if (v)
                got = json_integer_value(v);
        }
        if (got < 0)
            got = added_max < 0                                ? vocab_len
                  : (added_max >= vocab_len || vocab_len == 0) ? added_max + 1
                                                               : vocab_len;
        if (got >= TOK_MAX_ID)
            return pd_err_set(c->err, PD_ERR_FORMAT, "%s: added_tokens[%zu]: id too large", c->path,
                              i);
        if ((!json_is_integer(id) || json_integer_value(id) != got) && ++n_moved <= 3)
            PD_LOGW("tokenizer",
                    "%s: added_tokens[%zu] \"%s\": the file says id %lld, HF "
                    "tokenizers assigns %lld; using %lld",
                    c->path, i, s, json_is_integer(id) ? (long long)json_integer_value(id) : -1LL,
                    (long long)got, (long long)got);
        ids[i] = (int32_t)got;
        if (got > added_max)
            added_max = got;
        if (got > *max_id)
            *max_id = got;
    }
    if (n_moved > 3)
        PD_LOGW("tokenizer", "%s: %zu added tokens in all have an id other than the file's",
                c->path, n_moved);
    return PD_OK;
}

/* Sets the text of id (what id_to_token returns). */
static pd_status set_text(pd_tokenizer *t, load_ctx *c, int32_t id, const char *s, size_t n) {
    int64_t off = arena_add(t, s, n);
    if (off < 0)
        return pd_err_set(c->err, PD_ERR_NOMEM, "%s: out of memory (token text)", c->path);
    t->text_off[id] = (uint32_t)off;
    t->text_len[id] = (uint32_t)n;
    t->flags[id] |= TOK_F_EXISTS;
    return PD_OK;
}

/* ByteLevel decoding of one token's text (HF decoders/byte_level.rs): when
 * every character is in the GPT-2 table the token stands for those bytes,
 * otherwise (e.g. "<｜User｜>") for its own UTF-8 bytes. */
static pd_status set_bytes(pd_tokenizer *t, load_ctx *c, int32_t id, const int16_t *cp_byte,
                           char *tmp) {
    const uint8_t *s = (const uint8_t *)t->arena + t->text_off[id];
    size_t n = t->text_len[id], o = 0, i = 0;
    bool mapped = true;
    while (i < n) {
        /* text is well-formed UTF-8 (it came from JSON) */
        uint32_t cp;
        if (s[i] < 0x80) {
            cp = s[i];
            i += 1;
        } else if (s[i] < 0xE0 && i + 1 < n) {
            cp = ((uint32_t)(s[i] & 0x1F) << 6) | (s[i + 1] & 0x3F);
            i += 2;
        } else {
            mapped = false;
            break;
        }
        if (cp >= 0x144 || cp_byte[cp] < 0) {
            mapped = false;
            break;
        }
        tmp[o++] = (char)cp_byte[cp];
    }
    size_t len = mapped ? o : n;
    if (!mapped) /* arena_add may move the arena that s points into */
        memcpy(tmp, s, n);
    int64_t off = arena_add(t, tmp, len);
    if (off < 0)
        return pd_err_set(c->err, PD_ERR_NOMEM, "%s: out of memory (token bytes)", c->path);
    t->bytes_off[id] = (uint32_t)off;
    t->bytes_len[id] = (uint32_t)len;
    return PD_OK;
}

static pd_status load_vocab(pd_tokenizer *t, load_ctx *c, const json_t *vocab) {
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)vocab, key, val) {
        int32_t id = (int32_t)json_integer_value(val);
        if (t->flags[id] & TOK_F_EXISTS)
            return pd_err_set(c->err, PD_ERR_FORMAT, "%s: model.vocab: id %d used twice", c->path,
                              id);
        pd_status st = set_text(t, c, id, key, strlen(key));
        if (st != PD_OK)
            return st;
        t->vkey_off[id] = t->text_off[id];
        t->vkey_len[id] = t->text_len[id];
    }
    t->vocab_mask = pow2_at_least(2 * json_object_size(vocab)) - 1;
    t->vocab_slots = malloc((t->vocab_mask + 1) * sizeof *t->vocab_slots);
    if (!t->vocab_slots)
        return pd_err_set(c->err, PD_ERR_NOMEM, "%s: out of memory (vocab map)", c->path);
    memset(t->vocab_slots, 0xff, (t->vocab_mask + 1) * sizeof *t->vocab_slots);
    for (int32_t id = 0; id < t->vocab_size; id++)
        if (t->flags[id] & TOK_F_EXISTS)
            map_put(t, t->vocab_slots, t->vocab_mask, t->vkey_off, t->vkey_len, id);
    return PD_OK;
}

static pd_status load_added(pd_tokenizer *t, load_ctx *c, const json_t *added, const int32_t *ids) {
    size_t n = json_array_size(added);
    t->added_mask = pow2_at_least(2 * n + 1) - 1;
    t->added_slots = malloc((t->added_mask + 1) * sizeof *t->added_slots);
    if (!t->added_slots)
        return pd_err_set(c->err, PD_ERR_NOMEM, "%s: out of memory (added map)", c->path);
    memset(t->added_slots, 0xff, (t->added_mask + 1) * sizeof *t->added_slots);
    for (size_t i = 0; i < n; i++) {
        const json_t *a = json_array_get(added, i);
        int32_t id = ids[i];
        const json_t *content = json_object_get(a, "content");
        const char *s = json_string_value(content);
        size_t len = json_string_length(content);
        /* HF's id_to_token prefers the added content over a vocab key */
        if (!(t->flags[id] & TOK_F_EXISTS) || t->text_len[id] != len ||
            memcmp(t->arena + t->text_off[id], s, len) != 0) {
            pd_status st = set_text(t, c, id, s, len);
            if (st != PD_OK)
                return st;
        }
        /* a repeated content replaces the earlier entry's flags, as in HF */
        t->flags[id] = (uint8_t)((t->flags[id] & ~TOK_F_SPECIAL) | TOK_F_ADDED |
                                 (json_flag(a, "special") ? TOK_F_SPECIAL : 0));
        map_put(t, t->added_slots, t->added_mask, t->text_off, t->text_len, id);
        /* "normalized" defaults to !special in HF's AddedToken; the file always says */
        const json_t *norm = json_object_get(a, "normalized");
        bool normalized = norm ? json_is_true(norm) : !json_flag(a, "special");
        if (trie_insert(&t->trie[normalized ? 1 : 0], (const uint8_t *)s, len, id) != PD_OK)
            return pd_err_set(c->err, PD_ERR_NOMEM, "%s: out of memory (added trie)", c->path);
    }
    return PD_OK;
}

static pd_status load_merges(pd_tokenizer *t, load_ctx *c, const json_t *merges) {
    size_t n = json_array_size(merges);
    t->n_merges = n;
    t->merge_mask = pow2_at_least(2 * n + 1) - 1;
    t->merges = malloc((t->merge_mask + 1) * sizeof *t->merges);
    if (!t->merges)
        return pd_err_set(c->err, PD_ERR_NOMEM, "%s: out of memory (merges)", c->path);
    for (size_t i = 0; i <= t->merge_mask; i++)
        t->merges[i].new_id = -1;
    char *buf = NULL;
    size_t buf_cap = 0;
    pd_status st = PD_OK;
    for (size_t i = 0; i < n && st == PD_OK; i++) {
        const json_t *m = json_array_get(merges, i);
        const char *a, *b;
        size_t na, nb;
        if (json_is_string(m)) { /* "a b" */
            const char *s = json_string_value(m);
            const char *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                st = pd_err_set(c->err, PD_ERR_FORMAT,
                                "%s: model.merges[%zu]: not two tokens separated by one space",
                                c->path, i);
                break;
            }
            a = s;
            na = (size_t)(sp - s);
            b = sp + 1;
            nb = strlen(b);
        } else if (json_is_array(m) && json_array_size(m) == 2 &&
                   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            na = json_string_length(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            nb = json_string_length(json_array_get(m, 1));
        } else {
            st = pd_err_set(c->err, PD_ERR_FORMAT, "%s: model.merges[%zu]: bad entry", c->path, i);
            break;
        }
        int32_t ia = tok_vocab_get(t, a, na);
        int32_t ib = tok_vocab_get(t, b, nb);
        if (na + nb > buf_cap) {
            buf_cap = 2 * (na + nb) + 64;
            char *nbuf = realloc(buf, buf_cap);
            if (!nbuf) {
                st = pd_err_set(c->err, PD_ERR_NOMEM, "%s: out of memory (merges)", c->path);
                break;
            }
            buf = nbuf;
        }
        memcpy(buf, a, na);
        memcpy(buf + na, b, nb);
        int32_t im = tok_vocab_get(t, buf, na + nb);
        if (ia < 0 || ib < 0 || im < 0) {
            st = pd_err_set(c->err, PD_ERR_FORMAT,
                            "%s: model.merges[%zu]: \"%.*s\" + \"%.*s\": %s not in the vocab",
                            c->path, i, (int)na, a, (int)nb, b,
                            ia < 0   ? "left part"
                            : ib < 0 ? "right part"
                                     : "the merged token");
            break;
        }
        merge_put(t, ia, ib, (uint32_t)i, im);
    }
    free(buf);
    return st;
}

/* Per-id tables, maps, merges, byte tables (ids of added tokens given). */
static pd_status build_ids(pd_tokenizer *t, load_ctx *c, const json_t *vocab, const json_t *added,
                           const int32_t *added_ids, int64_t max_id) {
    pd_status st;
    t->vocab_size = (int)(max_id + 1);
    size_t nv = (size_t)t->vocab_size;
    t->text_off = calloc(nv, sizeof *t->text_off);
    t->text_len = calloc(nv, sizeof *t->text_len);
    t->bytes_off = calloc(nv, sizeof *t->bytes_off);
    t->bytes_len = calloc(nv, sizeof *t->bytes_len);
    t->vkey_off = calloc(nv, sizeof *t->vkey_off);
    t->vkey_len = calloc(nv, sizeof *t->vkey_len);
    t->flags = calloc(nv, sizeof *t->flags);
    if (!t->text_off || !t->text_len || !t->vkey_off || !t->vkey_len || !t->bytes_off ||
        !t->bytes_len || !t->flags)
        return pd_err_set(c->err, PD_ERR_NOMEM, "%s: out of memory (%zu ids)", c->path, nv);

    if ((st = load_vocab(t, c, vocab)) != PD_OK)
        return st;
    if ((st = load_added(t, c, added, added_ids)) != PD_OK)
        return st;
    if ((st = load_merges(t, c, c->merges)) != PD_OK)
        return st;

    /* GPT-2 byte table: initial BPE symbols and the reverse map for decoding */
    int16_t cp_byte[0x144];
    for (int i = 0; i < 0x144; i++)
        cp_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        uint32_t cp = byte_to_cp((uint8_t)b);
        cp_byte[cp] = (int16_t)b;
        char u[4];
        int n = cp_to_utf8(cp, u);
        t->byte_id[b] = tok_vocab_get(t, u, (size_t)n);
    }
    size_t max_text = 0;
    for (int32_t id = 0; id < t->vocab_size; id++)
        if (t->text_len[id] > max_text)
            max_text = t->text_len[id];
    char *tmp = malloc(max_text + 1);
    if (!tmp)
        return pd_err_set(c->err, PD_ERR_NOMEM, "%s: out of memory", c->path);
    for (int32_t id = 0; id < t->vocab_size && st == PD_OK; id++)
        if (t->flags[id] & TOK_F_EXISTS)
            st = set_bytes(t, c, id, cp_byte, tmp);
    free(tmp);
    if (st == PD_OK) {
        tok_classmap_finish(t);
        t->cache = tok_cache_new(); /* optional: NULL only costs speed */
    }
    return st;
}

static pd_status build(pd_tokenizer *t, load_ctx *c, const json_t *root) {
    pd_status st;
    if (!json_is_object(root))
        return pd_err_set(c->err, PD_ERR_FORMAT, "%s: not a JSON object", c->path);
    const json_t *model = json_object_get(root, "model");
    const json_t *added = json_object_get(root, "added_tokens");
    if ((st = check_model(t, c, model)) != PD_OK ||
        (st = check_normalizer(c, json_object_get(root, "normalizer"))) != PD_OK ||
        (st = check_decoder(c, json_object_get(root, "decoder"))) != PD_OK ||
        (st = parse_pretok(t, c, json_object_get(root, "pre_tokenizer"))) != PD_OK)
        return st;

    /* ids: validate and size */
    const json_t *vocab = json_object_get(model, "vocab");
    c->merges = json_object_get(model, "merges");
    int64_t max_id = -1;
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 ||
            json_integer_value(val) >= TOK_MAX_ID)
            return pd_err_set(c->err, PD_ERR_FORMAT, "%s: model.vocab[\"%s\"]: bad id", c->path,
                              key);
        if (json_integer_value(val) > max_id)
            max_id = json_integer_value(val);
    }
    if (!json_is_null_or_absent(added) && !json_is_array(added))
        return pd_err_set(c->err, PD_ERR_FORMAT, "%s: added_tokens: not an array", c->path);
    size_t n_added = json_array_size(added);
    int32_t *added_ids = malloc((n_added + 1) * sizeof *added_ids);
    if (!added_ids)
        return pd_err_set(c->err, PD_ERR_NOMEM, "%s: out of memory", c->path);
    if ((st = assign_added(c, vocab, added, added_ids, &max_id)) == PD_OK && max_id < 0)
        st = pd_err_set(c->err, PD_ERR_FORMAT, "%s: empty vocabulary", c->path);
    if (st == PD_OK)
        st = build_ids(t, c, vocab, added, added_ids, max_id);
    free(added_ids);
    return st;
}

pd_status pd_tok_load(const char *path, pd_tokenizer **tok_p, pd_err *err) {
    if (!path || !tok_p)
        return pd_err_set(err, PD_ERR_INVALID, "pd_tok_load: NULL argument");
    char *data;
    size_t len;
    pd_status st = pd_file_read_all(path, &data, &len, err);
    if (st != PD_OK)
        return st;
    json_error_t jerr;
    json_t *root = json_loadb(data, len, 0, &jerr);
    free(data);
    if (!root)
        return pd_err_set(err, PD_ERR_FORMAT, "%s:%d:%d: bad JSON: %s", path, jerr.line,
                          jerr.column, jerr.text);
    pd_tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        json_decref(root);
        return pd_err_set(err, PD_ERR_NOMEM, "%s: out of memory", path);
    }
    t->path = strdup(path);
    load_ctx c = {path, err, NULL};
    st = t->path ? build(t, &c, root) : pd_err_set(err, PD_ERR_NOMEM, "%s: out of memory", path);
    json_decref(root);
    if (st != PD_OK) {
        pd_tok_free(&t);
        return st;
    }
    for (int id = 0; id < t->vocab_size; id++)
        if ((t->flags[id] & TOK_F_EXISTS) && t->bytes_len[id] > t->max_token_bytes)
            t->max_token_bytes = t->bytes_len[id];
    *tok_p = t;
    return PD_OK;
}

void pd_tok_free(pd_tokenizer **tok_p) {
    if (!tok_p || !*tok_p)
        return;
    pd_tokenizer *t = *tok_p;
    for (int i = 0; i < t->n_splits; i++)
        pcre2_code_free(t->split_re[i]);
    tok_cache_free(t->cache);
    free(t->keep);
    free(t->trie[0].nodes);
    free(t->trie[1].nodes);
    free(t->merges);
    free(t->added_slots);
    free(t->vocab_slots);
    free(t->arena);
    free(t->flags);
    free(t->bytes_len);
    free(t->bytes_off);
    free(t->vkey_len);
    free(t->vkey_off);
    free(t->text_len);
    free(t->text_off);
    free(t->path);
    free(t);
    *tok_p = NULL;
}

/* ------------------------------------------------------------------ */
/* per-id queries                                                      */
/* ------------------------------------------------------------------ */

int pd_tok_vocab_size(const pd_tokenizer *t) {
    return t ? t->vocab_size : 0;
}

size_t pd_tok_max_token_bytes(const pd_tokenizer *t) {
    return t ? t->max_token_bytes : 0;
}

static bool id_ok(const pd_tokenizer *t, int32_t id) {
    return t && id >= 0 && id < t->vocab_size && (t->flags[id] & TOK_F_EXISTS);
}

const char *pd_tok_token_bytes(const pd_tokenizer *t, int32_t id, size_t *len_p) {
    if (!id_ok(t, id)) {
        if (len_p)
            *len_p = 0;
        return NULL;
    }
    if (len_p)
        *len_p = t->bytes_len[id];
    return t->arena + t->bytes_off[id];
}

const char *pd_tok_token_text(const pd_tokenizer *t, int32_t id) {
    return id_ok(t, id) ? t->arena + t->text_off[id] : NULL;
}

bool pd_tok_is_special(const pd_tokenizer *t, int32_t id) {
    return id_ok(t, id) && (t->flags[id] & TOK_F_SPECIAL);
}

bool pd_tok_is_added(const pd_tokenizer *t, int32_t id) {
    return id_ok(t, id) && (t->flags[id] & TOK_F_ADDED);
}

int32_t pd_tok_find(const pd_tokenizer *t, const char *token_text) {
    if (!t || !token_text)
        return -1;
    size_t n = strlen(token_text);
    int32_t id = tok_added_get(t, token_text, n);
    return id >= 0 ? id : tok_vocab_get(t, token_text, n);
}

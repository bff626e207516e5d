/* Inside grammar/: compiled schema nodes (schema.c), automaton frames
 * (automaton.c), shared with the trie walk (mask.c). */
#ifndef GRAMMAR_IMPL_H
#define GRAMMAR_IMPL_H

#include "pd_grammar.h"

typedef enum {
    GN_ANY = 0, /* any JSON value */
    GN_OBJECT,
    GN_ARRAY,
    GN_STRING,
    GN_NUMBER,
    GN_INTEGER,
    GN_LITERALS, /* one of a list of JSON texts (enum, const, boolean, null) */
    GN_UNION,    /* alternatives with disjoint first bytes */
} gn_kind;

typedef struct gnode gnode;
struct gnode {
    gn_kind kind;
    uint8_t first[32];  /* bitset of the bytes a value of this node may start with */
    uint64_t min_bytes; /* the shortest value's length (saturating at G_INF) */
    /* GN_OBJECT. has_props: only the listed keys, in this order; else any
     * key with values of additional (NULL: no key at all). */
    bool has_props;
    int n_props;
    const gnode **prop;
    char **key; /* the key as JSON text, quotes included */
    uint32_t *key_len;
    int *req_after;     /* [n_props + 1]: first required index >= i, n_props if none */
    uint64_t *req_cost; /* [n_props + 1]: bytes of ',"key":<shortest value>' over the
                           required properties at index >= i */
    const gnode *additional;
    /* GN_ARRAY */
    const gnode *items;
    uint32_t min_items, max_items;
    /* GN_INTEGER: minimum / maximum (exclusive ones made inclusive) */
    bool bounded;
    int64_t lo, hi;
    /* GN_STRING, in code points */
    uint32_t min_len, max_len;
    /* GN_LITERALS */
    int n_lits;
    char **lit;
    uint32_t *lit_len;
    /* GN_UNION */
    int n_alts;
    const gnode **alts;
};

struct pd_grammar {
    const gnode *root;
    char *canonical;
    gnode **nodes; /* every node, for freeing */
    int n_nodes, cap_nodes;
    /* building blocks of GN_ANY */
    const gnode *any, *any_obj, *any_arr, *any_str, *any_num, *any_lit;
};

/* ---- automaton frames ---------------------------------------------- */

typedef enum { GF_ROOT = 0, GF_OBJ, GF_ARR, GF_STR, GF_NUM, GF_LIT } gf_kind;

/* A frame never changes once made: a step makes new frames (a copy of the
 * top with another sub-state, a child) from an arena, so a trie walk can
 * branch from any state and drop what it made by resetting the arena. */
typedef struct gframe gframe;
struct gframe {
    const gframe *parent;
    const gnode *node;
    uint8_t kind, st;
    uint16_t depth; /* root 0 */
    uint32_t a, b, c;
    int64_t v; /* bounded integers: the magnitude so far (c: negative) */
};

typedef struct {
    gframe *f;
    uint32_t n, cap;
} garena;

#define G_END (-1)                /* the end of the text, as a byte to g_step */
#define G_INF ((uint64_t)1 << 40) /* saturation of byte counts */

static inline uint64_t g_add(uint64_t a, uint64_t b) {
    return a + b > G_INF ? G_INF : a + b;
}
static inline uint64_t g_mul(uint64_t a, uint64_t b) {
    return b && a > G_INF / b ? G_INF : a * b;
}

/** The fewest bytes that complete the value from top (0 when it is
 * complete): following one particular completion, so that each of its
 * bytes lowers the count by exactly one. */
uint64_t g_close_bytes(const gframe *top);

/** One byte (or G_END) from top: the new top (frames from ar, or top's
 * ancestors), NULL when refused or the arena is full. G_END accepted
 * returns the root frame. */
const gframe *g_step(const pd_grammar *g, garena *ar, const gframe *top, int c);

/* string frame sub-states (mask.c takes a fast path in GS_NORMAL) */
enum { GS_NORMAL = 0, GS_ESC, GS_U, GS_UTF8 };

#endif

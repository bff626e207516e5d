/* The byte-level pushdown automaton over compiled schema nodes.
 *
 * The stack is a chain of immutable frames (grammar_impl.h). Each frame
 * kind is a small state machine over the JSON grammar of RFC 8259 §§2-7:
 *
 *   root    before the value -> after it (complete)
 *   object  '{' [key ':' [' '] value (',' [' '] key ':' [' '] value)*] '}'
 *           keys: with properties, the listed ones in order (skipping
 *           optional ones), matched against their JSON text; else any
 *           string (a string frame)
 *   array   '[' [value (',' [' '] value)*] ']' with min/maxItems
 *   string  '"' chars '"': UTF-8 checked byte by byte (Unicode §3.9 table
 *           3-7), no control characters, escapes \" \\ \/ \b \f \n \r \t
 *           \uXXXX (not D800-DFFF); length counted in code points
 *   number  -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? (integer: no
 *           fraction or exponent), at most PD_GRAMMAR_MAX_NUMBER_LEN bytes,
 *           PD_GRAMMAR_MAX_INT_DIGITS integer digits (an int64 holds it)
 *           and PD_GRAMMAR_MAX_EXP_DIGITS exponent digits (a double holds
 *           it: RFC 8259 §6 on interoperable numbers)
 *   literal one of a node's JSON texts, matched byte by byte
 *
 * A value frame that is complete but may still grow (a number, a literal
 * that prefixes another) ends when a byte it cannot take arrives: it pops
 * and hands the byte to its parent. A frame that can only end pops at once,
 * so the root is "after the value" exactly when nothing can follow.
 */
#include <string.h>

#include "grammar_impl.h"

enum { RS_BEFORE = 0, RS_DONE };
enum { OS_START = 0, OS_KEY, OS_COLON, OS_VAL_WS, OS_VAL, OS_AFTER, OS_KEY_WS, OS_KEY0 };
enum { AS_START = 0, AS_AFTER, AS_ELEM_WS, AS_ELEM };
enum { NS_MINUS = 0, NS_ZERO, NS_INT, NS_DOT, NS_FRAC, NS_E, NS_ESIGN, NS_EXP };

static gframe *fr_new(garena *ar) {
    return ar->n < ar->cap ? &ar->f[ar->n++] : NULL;
}

static gframe *fr_copy(garena *ar, const gframe *f, uint8_t st) {
    gframe *n = fr_new(ar);
    if (n) {
        *n = *f;
        n->st = st;
    }
    return n;
}

static bool bit(const uint8_t *set, int c) {
    return set[c >> 3] & (1u << (c & 7));
}
static bool is_digit(int c) {
    return c >= '0' && c <= '9';
}
static bool is_hex(int c) {
    return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* ---- bounded integers ------------------------------------------------ */

static const int64_t POW10[PD_GRAMMAR_MAX_INT_DIGITS + 1] = {1LL,
                                                             10LL,
                                                             100LL,
                                                             1000LL,
                                                             10000LL,
                                                             100000LL,
                                                             1000000LL,
                                                             10000000LL,
                                                             100000000LL,
                                                             1000000000LL,
                                                             10000000000LL,
                                                             100000000000LL,
                                                             1000000000000LL,
                                                             10000000000000LL,
                                                             100000000000000LL,
                                                             1000000000000000LL,
                                                             10000000000000000LL,
                                                             100000000000000000LL,
                                                             1000000000000000000LL};

/* The fewest digits k >= 0 that, appended to the magnitude m of `digits`
 * digits (negative: neg), give a value in [n->lo, n->hi] within the digit
 * limit; -1 if none. With k digits the magnitudes reachable are
 * [m 10^k, m 10^k + 10^k - 1] (none past "0"). */
static int int_reach(const gnode *n, bool neg, int64_t m, uint32_t digits) {
    for (uint32_t k = 0; digits + k <= PD_GRAMMAR_MAX_INT_DIGITS; k++) {
        if (k > 0 && m == 0)
            break;
        int64_t lo_m = m * POW10[k], hi_m = lo_m + POW10[k] - 1;
        int64_t vlo = neg ? -hi_m : lo_m, vhi = neg ? -lo_m : hi_m;
        if (vlo <= n->hi && vhi >= n->lo)
            return (int)k;
    }
    return -1;
}

/* ---- literals -------------------------------------------------------- */

/* Is there a literal with the first pos bytes of lit[j] and more? */
static bool lit_extends(const gnode *n, int j, uint32_t pos) {
    for (int k = j; k < n->n_lits; k++)
        if (n->lit_len[k] > pos && memcmp(n->lit[k], n->lit[j], pos) == 0)
            return true;
    return false;
}

/* Is there a literal equal to the first pos bytes of lit[j]? */
static bool lit_complete(const gnode *n, int j, uint32_t pos) {
    for (int k = j; k < n->n_lits; k++)
        if (n->lit_len[k] == pos && memcmp(n->lit[k], n->lit[j], pos) == 0)
            return true;
    return false;
}

/* The literal frame at (j, pos) under parent: popped at once when it is
 * complete and cannot grow. */
static const gframe *lit_frame(garena *ar, const gframe *parent, const gnode *n, int j,
                               uint32_t pos) {
    if (n->lit_len[j] == pos && !lit_extends(n, j, pos))
        return parent;
    gframe *f = fr_new(ar);
    if (!f)
        return NULL;
    *f = (gframe){.parent = parent,
                  .node = n,
                  .kind = GF_LIT,
                  .depth = parent->depth + 1,
                  .b = (uint32_t)j,
                  .c = pos};
    return f;
}

/* ---- value starts ---------------------------------------------------- */

/* Byte c starts a value of node n; parent is already in its state after
 * that value. */
static const gframe *value_start(const pd_grammar *g, garena *ar, const gframe *parent,
                                 const gnode *n, int c) {
    if (c < 0)
        return NULL;
    if (!bit(n->first, c))
        return NULL;
    if (parent->depth + 1 > PD_GRAMMAR_MAX_DEPTH)
        return NULL;
    switch (n->kind) {
    case GN_ANY:
        if (c == '{')
            n = g->any_obj;
        else if (c == '[')
            n = g->any_arr;
        else if (c == '"')
            n = g->any_str;
        else if (c == '-' || is_digit(c))
            n = g->any_num;
        else
            n = g->any_lit;
        return value_start(g, ar, parent, n, c);
    case GN_UNION:
        for (int i = 0; i < n->n_alts; i++)
            if (bit(n->alts[i]->first, c))
                return value_start(g, ar, parent, n->alts[i], c);
        return NULL;
    case GN_LITERALS:
        for (int j = 0; j < n->n_lits; j++)
            if ((uint8_t)n->lit[j][0] == c)
                return lit_frame(ar, parent, n, j, 1);
        return NULL;
    default:
        break;
    }
    gframe *f = fr_new(ar);
    if (!f)
        return NULL;
    *f = (gframe){.parent = parent, .node = n, .depth = parent->depth + 1};
    switch (n->kind) {
    case GN_OBJECT:
        f->kind = GF_OBJ;
        f->st = OS_START;
        return f;
    case GN_ARRAY:
        f->kind = GF_ARR;
        f->st = AS_START;
        return f;
    case GN_STRING:
        f->kind = GF_STR;
        f->st = GS_NORMAL;
        return f;
    default: /* GN_NUMBER, GN_INTEGER: the first byte is a digit or '-' */
        f->kind = GF_NUM;
        f->st = c == '-' ? NS_MINUS : c == '0' ? NS_ZERO : NS_INT;
        f->a = 1;
        f->b = f->st == NS_INT;
        f->v = f->st == NS_INT ? c - '0' : 0;
        if (n->bounded) { /* a negative at all ("-0" is not made); 0 or d in reach */
            if (f->st == NS_MINUS ? n->lo > -1 : int_reach(n, false, f->v, f->b) < 0) {
                ar->n--;
                return NULL;
            }
            f->c = f->st == NS_MINUS;
        }
        return f;
    }
}

/* ---- frames ---------------------------------------------------------- */

/* Object, expecting '"' to open a key (next candidate property: f->a). */
static const gframe *obj_key_open(const pd_grammar *g, garena *ar, const gframe *f, int c) {
    const gnode *n = f->node;
    if (c != '"')
        return NULL;
    if (!n->has_props) {
        if (!n->additional)
            return NULL;
        gframe *p = fr_copy(ar, f, OS_COLON);
        return p ? value_start(g, ar, p, g->any_str, c) : NULL;
    }
    if ((int)f->a >= n->n_props)
        return NULL;
    gframe *p = fr_copy(ar, f, OS_KEY);
    if (p) {
        p->b = f->a; /* the first allowed key; every key starts with '"' */
        p->c = 1;
    }
    return p;
}

static const gframe *obj_step(const pd_grammar *g, garena *ar, const gframe *f, int c) {
    const gnode *n = f->node;
    switch (f->st) {
    case OS_START:
        if (c == '}' && (!n->has_props || n->req_after[0] == n->n_props))
            return f->parent;
        return obj_key_open(g, ar, f, c);
    case OS_KEY: {
        /* keys allowed: [next, first required at or after next] */
        int next = (int)f->a, hi = n->req_after[next];
        if (hi >= n->n_props)
            hi = n->n_props - 1;
        uint32_t pos = f->c;
        const char *have = n->key[f->b];
        for (int j = (int)f->b; j <= hi; j++) {
            if (n->key_len[j] > pos && (uint8_t)n->key[j][pos] == c &&
                memcmp(n->key[j], have, pos) == 0) {
                gframe *p = fr_copy(ar, f, OS_KEY);
                if (!p)
                    return NULL;
                p->b = (uint32_t)j;
                p->c = pos + 1;
                if (p->c == n->key_len[j]) { /* the closing quote: keys are distinct */
                    p->st = OS_COLON;
                    p->a = (uint32_t)j + 1;
                }
                return p;
            }
        }
        return NULL;
    }
    case OS_COLON:
        return c == ':' ? fr_copy(ar, f, OS_VAL_WS) : NULL;
    case OS_VAL_WS:
        if (c == ' ')
            return fr_copy(ar, f, OS_VAL);
        /* fall through */
    case OS_VAL: {
        gframe *p = fr_copy(ar, f, OS_AFTER);
        if (!p)
            return NULL;
        return value_start(g, ar, p, n->has_props ? n->prop[f->b] : n->additional, c);
    }
    case OS_AFTER:
        if (c == ',' && (!n->has_props || (int)f->a < n->n_props))
            return fr_copy(ar, f, OS_KEY_WS);
        if (c == '}' && (!n->has_props || n->req_after[f->a] == n->n_props))
            return f->parent;
        return NULL;
    case OS_KEY_WS:
        if (c == ' ')
            return fr_copy(ar, f, OS_KEY0);
        /* fall through */
    default: /* OS_KEY0 */
        return obj_key_open(g, ar, f, c);
    }
}

static const gframe *arr_step(const pd_grammar *g, garena *ar, const gframe *f, int c) {
    const gnode *n = f->node;
    switch (f->st) {
    case AS_START:
        if (c == ']')
            return n->min_items == 0 ? f->parent : NULL;
        if (n->max_items == 0)
            return NULL;
        break;
    case AS_AFTER:
        if (c == ',' && f->a < n->max_items)
            return fr_copy(ar, f, AS_ELEM_WS);
        if (c == ']' && f->a >= n->min_items)
            return f->parent;
        return NULL;
    case AS_ELEM_WS:
        if (c == ' ')
            return fr_copy(ar, f, AS_ELEM);
        break;
    default:
        break;
    }
    gframe *p = fr_copy(ar, f, AS_AFTER);
    if (!p)
        return NULL;
    p->a = f->a + 1;
    return value_start(g, ar, p, n->items, c);
}

/* One more code point in the string; NULL past maxLength. */
static gframe *str_count(garena *ar, const gframe *f, uint8_t st) {
    if (f->a >= f->node->max_len)
        return NULL;
    gframe *p = fr_copy(ar, f, st);
    if (p)
        p->a = f->a + 1;
    return p;
}

static const gframe *str_step(garena *ar, const gframe *f, int c) {
    gframe *p;
    switch (f->st) {
    case GS_NORMAL:
        if (c == '"')
            return f->a >= f->node->min_len ? f->parent : NULL;
        if (c == '\\')
            return str_count(ar, f, GS_ESC);
        if (c < 0x20)
            return NULL;
        if (c < 0x80)
            return str_count(ar, f, GS_NORMAL);
        /* UTF-8 lead byte: b = continuation bytes left, c = range of the next
         * one (lo << 8 | hi), Unicode table 3-7 */
        uint32_t need, lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF)
            need = 1;
        else if (c >= 0xE0 && c <= 0xEF) {
            need = 2;
            if (c == 0xE0)
                lo = 0xA0;
            if (c == 0xED)
                hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            if (c == 0xF0)
                lo = 0x90;
            if (c == 0xF4)
                hi = 0x8F;
        } else
            return NULL;
        p = str_count(ar, f, GS_UTF8);
        if (p) {
            p->b = need;
            p->c = lo << 8 | hi;
        }
        return p;
    case GS_UTF8:
        if (c < (int)(f->c >> 8) || c > (int)(f->c & 0xFF))
            return NULL;
        p = fr_copy(ar, f, f->b == 1 ? GS_NORMAL : GS_UTF8);
        if (p) {
            p->b = f->b - 1;
            p->c = 0x80 << 8 | 0xBF;
        }
        return p;
    case GS_ESC:
        if (c >= 0 && strchr("\"\\/bfnrt", c) && c != 0)
            return fr_copy(ar, f, GS_NORMAL);
        if (c == 'u') {
            p = fr_copy(ar, f, GS_U);
            if (p)
                p->b = p->c = 0;
            return p;
        }
        return NULL;
    default: /* GS_U: b hex digits seen; c: the first was D */
        if (c < 0 || !is_hex(c))
            return NULL;
        if (f->b == 1 && f->c && !(c >= '0' && c <= '7'))
            return NULL; /* D800-DFFF: a lone surrogate is not a code point */
        p = fr_copy(ar, f, f->b == 3 ? GS_NORMAL : GS_U);
        if (p) {
            if (f->b == 0)
                p->c = c == 'd' || c == 'D';
            p->b = f->b + 1;
        }
        return p;
    }
}

static const gframe *num_step(const pd_grammar *g, garena *ar, const gframe *f, int c) {
    bool integer = f->node->kind == GN_INTEGER;
    int st = -1;
    switch (f->st) {
    case NS_MINUS:
        st = c == '0' ? NS_ZERO : (c > '0' && c <= '9') ? NS_INT : -1;
        break;
    case NS_ZERO:
    case NS_INT:
        if (f->st == NS_INT && is_digit(c))
            st = NS_INT;
        else if (c == '.' && !integer)
            st = NS_DOT;
        else if ((c == 'e' || c == 'E') && !integer)
            st = NS_E;
        break;
    case NS_DOT:
    case NS_FRAC:
        if (is_digit(c))
            st = NS_FRAC;
        else if (f->st == NS_FRAC && (c == 'e' || c == 'E'))
            st = NS_E;
        break;
    case NS_E:
        st = (c == '+' || c == '-') ? NS_ESIGN : is_digit(c) ? NS_EXP : -1;
        break;
    default: /* NS_ESIGN, NS_EXP */
        st = is_digit(c) ? NS_EXP : -1;
        break;
    }
    if (st >= 0) {
        /* b: digits of the integer part, then of the exponent */
        uint32_t digits = st == NS_INT   ? f->b + 1
                          : st == NS_EXP ? (f->st == NS_EXP ? f->b + 1 : 1)
                                         : f->b;
        if (f->a >= PD_GRAMMAR_MAX_NUMBER_LEN ||
            (st == NS_INT && digits > PD_GRAMMAR_MAX_INT_DIGITS) ||
            (st == NS_EXP && digits > PD_GRAMMAR_MAX_EXP_DIGITS))
            return NULL;
        int64_t v = f->v;
        if (f->node->bounded) { /* the digit keeps a value in [lo, hi] within reach */
            if (st == NS_ZERO || int_reach(f->node, f->c, v * 10 + (c - '0'), digits) < 0)
                return NULL;
            v = v * 10 + (c - '0');
        }
        gframe *p = fr_copy(ar, f, (uint8_t)st);
        if (p) {
            p->a = f->a + 1;
            p->b = digits;
            p->v = v;
        }
        return p;
    }
    bool complete = f->st == NS_ZERO || f->st == NS_INT || f->st == NS_FRAC || f->st == NS_EXP;
    if (complete && f->node->bounded) {
        int64_t val = f->c ? -f->v : f->v;
        complete = val >= f->node->lo && val <= f->node->hi;
    }
    return complete ? g_step(g, ar, f->parent, c) : NULL;
}

static const gframe *lit_step(const pd_grammar *g, garena *ar, const gframe *f, int c) {
    const gnode *n = f->node;
    int j = (int)f->b;
    uint32_t pos = f->c;
    if (c >= 0)
        for (int k = j; k < n->n_lits; k++)
            if (n->lit_len[k] > pos && (uint8_t)n->lit[k][pos] == c &&
                memcmp(n->lit[k], n->lit[j], pos) == 0)
                return lit_frame(ar, f->parent, n, k, pos + 1);
    return lit_complete(n, j, pos) ? g_step(g, ar, f->parent, c) : NULL;
}

const gframe *g_step(const pd_grammar *g, garena *ar, const gframe *top, int c) {
    switch (top->kind) {
    case GF_ROOT:
        if (top->st == RS_DONE)
            return c == G_END ? top : NULL;
        if (c == G_END)
            return NULL;
        gframe *p = fr_copy(ar, top, RS_DONE);
        return p ? value_start(g, ar, p, top->node, c) : NULL;
    case GF_OBJ:
        return c == G_END ? NULL : obj_step(g, ar, top, c);
    case GF_ARR:
        return c == G_END ? NULL : arr_step(g, ar, top, c);
    case GF_STR:
        return c == G_END ? NULL : str_step(ar, top, c);
    case GF_NUM:
        return num_step(g, ar, top, c);
    default:
        return lit_step(g, ar, top, c);
    }
}

/* ---- the shortest completion ------------------------------------------ */

/* Bytes to finish a property key from (pos bytes of the candidates' common
 * prefix, that of key[from]) and then the object: the rest of the key, ':',
 * the shortest value, the required properties after it, '}'. The minimum
 * over the candidates [from, hi], so that following the best one lowers it
 * by one per byte. */
static uint64_t key_rest(const gnode *n, int from, int hi, uint32_t pos) {
    uint64_t best = G_INF;
    for (int j = from; j <= hi; j++) {
        if (n->key_len[j] < pos || memcmp(n->key[j], n->key[from], pos) != 0)
            continue;
        uint64_t r = g_add(n->key_len[j] - pos + 1,
                           g_add(n->prop[j]->min_bytes, g_add(n->req_cost[j + 1], 1)));
        best = r < best ? r : best;
    }
    return best;
}

static uint64_t obj_rest(const gframe *f) {
    const gnode *n = f->node;
    if (!n->has_props) {
        uint64_t mv = n->additional ? n->additional->min_bytes : G_INF;
        switch (f->st) {
        case OS_START:
        case OS_AFTER:
            return 1;
        case OS_COLON:
            return g_add(mv, 2);
        case OS_VAL_WS:
        case OS_VAL:
            return g_add(mv, 1);
        default: /* OS_KEY_WS, OS_KEY0: '""' ':' value '}' */
            return g_add(mv, 4);
        }
    }
    int a = (int)f->a, hi;
    switch (f->st) {
    case OS_START:
        hi = n->req_after[0] < n->n_props ? n->req_after[0] : n->n_props - 1;
        if (n->req_after[0] == n->n_props)
            return 1;                 /* '}' */
        return key_rest(n, 0, hi, 0); /* the key's text starts with its '"' */
    case OS_KEY:
        hi = n->req_after[a] < n->n_props ? n->req_after[a] : n->n_props - 1;
        return key_rest(n, (int)f->b, hi, f->c);
    case OS_COLON:
        return g_add(1, g_add(n->prop[f->b]->min_bytes, g_add(n->req_cost[a], 1)));
    case OS_VAL_WS:
    case OS_VAL:
        return g_add(n->prop[f->b]->min_bytes, g_add(n->req_cost[a], 1));
    case OS_AFTER:
        return g_add(n->req_cost[a], 1);
    default: /* OS_KEY_WS, OS_KEY0: '"' and a key */
        if (a >= n->n_props)
            return G_INF;
        hi = n->req_after[a] < n->n_props ? n->req_after[a] : n->n_props - 1;
        return key_rest(n, a, hi, 0);
    }
}

static uint64_t frame_rest(const gframe *f) {
    const gnode *n = f->node;
    switch (f->kind) {
    case GF_ROOT:
        return f->st == RS_BEFORE ? n->min_bytes : 0;
    case GF_OBJ:
        return obj_rest(f);
    case GF_ARR: {
        uint64_t mv = g_add(n->items->min_bytes, 1); /* a value and its ',' or ']' */
        uint64_t left = f->a < n->min_items ? n->min_items - f->a : 0;
        if (f->st == AS_START)
            return n->min_items == 0 ? 1 : g_mul(mv, n->min_items);
        if (f->st == AS_AFTER)
            return g_add(g_mul(mv, left), 1);
        return g_add(g_mul(mv, left ? left - 1 : 0), mv); /* after ',': one value at least */
    }
    case GF_STR: {
        uint64_t r = g_add(f->a < n->min_len ? n->min_len - f->a : 0, 1);
        if (f->st == GS_ESC)
            r = g_add(r, 1);
        else if (f->st == GS_U)
            r = g_add(r, 4 - f->b);
        else if (f->st == GS_UTF8)
            r = g_add(r, f->b);
        return r;
    }
    case GF_NUM:
        if (n->bounded) {          /* the digits to the nearest value in range */
            if (f->st == NS_MINUS) /* the negative of least magnitude in range */
                return (uint64_t)snprintf(NULL, 0, "%lld", (long long)(n->hi < -1 ? -n->hi : 1));
            int k = int_reach(n, f->c, f->v, f->b);
            return k < 0 ? G_INF : (uint64_t)k;
        }
        return (f->st == NS_MINUS || f->st == NS_DOT || f->st == NS_E || f->st == NS_ESIGN) ? 1 : 0;
    default: { /* GF_LIT */
        uint64_t best = G_INF;
        for (int k = (int)f->b; k < n->n_lits; k++)
            if (n->lit_len[k] >= f->c && memcmp(n->lit[k], n->lit[f->b], f->c) == 0 &&
                n->lit_len[k] - f->c < best)
                best = n->lit_len[k] - f->c;
        return best;
    }
    }
}

uint64_t g_close_bytes(const gframe *top) {
    uint64_t r = 0;
    for (const gframe *f = top; f; f = f->parent)
        r = g_add(r, frame_rest(f));
    return r;
}

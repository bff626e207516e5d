/* JSON Schema (the subset in pd_grammar.h) -> a tree of gnode.
 *
 * Keywords are checked against two lists: those compiled here and
 * annotations (ignored). Anything else is refused by name, so that a
 * schema never validates less than the client asked for. Keyword meanings:
 * JSON Schema 2020-12 validation vocabulary. Enum and const values become
 * JSON texts (jansson, compact), matched byte for byte; with "type" beside
 * them, values of other types are dropped (the instance must satisfy both).
 */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "grammar_impl.h"

typedef struct {
    pd_grammar *g;
    pd_err *err;
    pd_status st; /* of the first failure */
    char path[256];
    const json_t *doc; /* the whole schema: what "$ref": "#/..." points into */
    /* $ref targets: those being compiled (a cycle is a recursive schema)
     * and those done (compiled once, the node shared) */
    const json_t *open_refs[PD_GRAMMAR_MAX_SCHEMA_DEPTH + 2];
    int n_open;
    const json_t **done_ref;
    const gnode **done_node;
    int n_done;
} cctx;

static const char *const ANNOTATIONS[] = {"title",    "description", "$schema",  "$id",
                                          "$comment", "default",     "examples", "deprecated",
                                          "readOnly", "writeOnly",   "$defs",    "definitions",
                                          NULL}; /* $defs / definitions: only what $ref uses counts
                                                  */
static const char *const KEYWORDS[] = {"type",
                                       "properties",
                                       "required",
                                       "additionalProperties",
                                       "items",
                                       "minItems",
                                       "maxItems",
                                       "enum",
                                       "const",
                                       "anyOf",
                                       "oneOf",
                                       "minLength",
                                       "minimum",
                                       "maximum",
                                       "exclusiveMinimum",
                                       "exclusiveMaximum",
                                       "maxLength",
                                       NULL};

static bool in_list(const char *const *l, const char *k) {
    for (; *l; l++)
        if (strcmp(*l, k) == 0)
            return true;
    return false;
}

static pd_status cfail(cctx *c, pd_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static pd_status cfail(cctx *c, pd_status st, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->st = st;
    return pd_err_set(c->err, st, "%s%s%s", msg, c->path[0] ? " at " : "", c->path);
}

/* Appends ".seg" (or "seg" at the root) to the path; returns the old length. */
static size_t path_push(cctx *c, const char *seg) {
    size_t n = strlen(c->path);
    snprintf(c->path + n, sizeof c->path - n, "%s%s", n ? "." : "", seg);
    return n;
}

static void path_pop(cctx *c, size_t n) {
    c->path[n] = '\0';
}

static gnode *node_new(cctx *c, gn_kind kind) {
    pd_grammar *g = c->g;
    if (g->n_nodes >= PD_GRAMMAR_MAX_NODES)
        return NULL;
    if (g->n_nodes == g->cap_nodes) {
        g->cap_nodes = g->cap_nodes ? 2 * g->cap_nodes : 32;
        g->nodes = realloc(g->nodes, (size_t)g->cap_nodes * sizeof *g->nodes);
        PD_ASSERT(g->nodes);
    }
    gnode *n = pd_xcalloc(1, sizeof *n);
    n->kind = kind;
    g->nodes[g->n_nodes++] = n;
    return n;
}

static void set_bit(uint8_t *set, unsigned b) {
    set[b >> 3] |= (uint8_t)(1u << (b & 7));
}
static void set_bits(uint8_t *set, const char *bytes) {
    for (; *bytes; bytes++)
        set_bit(set, (uint8_t)*bytes);
}

static uint64_t node_min_bytes(gnode *n);

/* The first-byte set and shortest length of a node whose kind and payload
 * are filled in. */
static void node_first(gnode *n) {
    n->min_bytes = node_min_bytes(n);
    memset(n->first, 0, sizeof n->first);
    switch (n->kind) {
    case GN_ANY:
        set_bits(n->first, "{[\"-0123456789tfn");
        break;
    case GN_OBJECT:
        set_bit(n->first, '{');
        break;
    case GN_ARRAY:
        set_bit(n->first, '[');
        break;
    case GN_STRING:
        set_bit(n->first, '"');
        break;
    case GN_NUMBER:
    case GN_INTEGER:
        set_bits(n->first, "-0123456789");
        break;
    case GN_LITERALS:
        for (int i = 0; i < n->n_lits; i++)
            set_bit(n->first, (uint8_t)n->lit[i][0]);
        break;
    case GN_UNION:
        for (int i = 0; i < n->n_alts; i++)
            for (int k = 0; k < 32; k++)
                n->first[k] |= n->alts[i]->first[k];
        break;
    }
}

static uint64_t node_min_bytes(gnode *n) {
    uint64_t m = G_INF;
    switch (n->kind) {
    case GN_INTEGER:
        if (n->bounded && n->lo > 0) /* the shortest integer in range: lo, or -hi */
            return (uint64_t)snprintf(NULL, 0, "%lld", (long long)n->lo);
        if (n->bounded && n->hi < 0)
            return (uint64_t)snprintf(NULL, 0, "%lld", (long long)n->hi);
        return 1;
    case GN_ANY:
    case GN_NUMBER:
        return 1; /* 0 */
    case GN_STRING:
        return g_add(2, n->min_len);
    case GN_ARRAY:
        if (n->min_items == 0)
            return 2;
        return g_add(1, g_mul(g_add(n->items->min_bytes, 1), n->min_items)); /* [v,v,v] */
    case GN_LITERALS:
        for (int i = 0; i < n->n_lits; i++)
            m = n->lit_len[i] < m ? n->lit_len[i] : m;
        return m;
    case GN_UNION:
        for (int i = 0; i < n->n_alts; i++)
            m = n->alts[i]->min_bytes < m ? n->alts[i]->min_bytes : m;
        return m;
    case GN_OBJECT:
        if (!n->has_props)
            return 2;
        /* '{' + the required properties (',' before each but the first) + '}' */
        return n->req_cost[0] ? g_add(1, n->req_cost[0]) : 2;
    }
    return m;
}

static gnode *node_make(cctx *c, gn_kind kind) {
    gnode *n = node_new(c, kind);
    if (!n) {
        cfail(c, PD_ERR_LIMIT, "schema too large: more than %d subschemas", PD_GRAMMAR_MAX_NODES);
        return NULL;
    }
    n->max_items = UINT32_MAX;
    n->max_len = UINT32_MAX;
    return n;
}

/* Adds a JSON text to a literal node (NULL on a limit). */
static int lit_add(cctx *c, gnode *n, const json_t *v) {
    if (n->n_lits >= PD_GRAMMAR_MAX_ENUM) {
        cfail(c, PD_ERR_LIMIT, "enum has more than %d values", PD_GRAMMAR_MAX_ENUM);
        return -1;
    }
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    PD_ASSERT(s);
    size_t len = strlen(s);
    if (len > PD_GRAMMAR_MAX_LITERAL) {
        free(s);
        cfail(c, PD_ERR_LIMIT, "an enum/const value is longer than %d bytes as JSON",
              PD_GRAMMAR_MAX_LITERAL);
        return -1;
    }
    for (int i = 0; i < n->n_lits; i++)
        if (n->lit_len[i] == len && memcmp(n->lit[i], s, len) == 0) {
            free(s); /* duplicate value: once is enough */
            return 0;
        }
    n->lit = realloc(n->lit, (size_t)(n->n_lits + 1) * sizeof *n->lit);
    n->lit_len = realloc(n->lit_len, (size_t)(n->n_lits + 1) * sizeof *n->lit_len);
    PD_ASSERT(n->lit && n->lit_len);
    n->lit[n->n_lits] = s;
    n->lit_len[n->n_lits] = (uint32_t)len;
    n->n_lits++;
    return 0;
}

static const char *const TYPES[] = {"object",  "array",   "string", "number",
                                    "integer", "boolean", "null",   NULL};

/* Does value v have JSON Schema type t? (integer: a number with no
 * fractional part, as 2020-12 says; jansson reals such as 1.0 included.) */
static bool has_type(const json_t *v, const char *t) {
    if (strcmp(t, "object") == 0)
        return json_is_object(v);
    if (strcmp(t, "array") == 0)
        return json_is_array(v);
    if (strcmp(t, "string") == 0)
        return json_is_string(v);
    if (strcmp(t, "number") == 0)
        return json_is_number(v);
    if (strcmp(t, "integer") == 0)
        return json_is_integer(v) ||
               (json_is_real(v) && json_real_value(v) == (double)(long long)json_real_value(v));
    if (strcmp(t, "boolean") == 0)
        return json_is_boolean(v);
    return json_is_null(v);
}

static bool type_allows(const json_t *type, const json_t *v) {
    if (!type)
        return true;
    if (json_is_string(type))
        return has_type(v, json_string_value(type));
    size_t i;
    json_t *t;
    json_array_foreach(type, i, t) if (has_type(v, json_string_value(t))) return true;
    return false;
}

static const gnode *compile(cctx *c, const json_t *s, int depth);

/* A non-negative integer keyword (absent: keeps *out). */
static int get_count(cctx *c, const json_t *s, const char *k, uint32_t *out) {
    json_t *v = json_object_get(s, k);
    if (!v)
        return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0) {
        cfail(c, PD_ERR_INVALID, "'%s' must be a non-negative integer", k);
        return -1;
    }
    json_int_t x = json_integer_value(v);
    *out = x > (json_int_t)(UINT32_MAX - 1) ? UINT32_MAX - 1 : (uint32_t)x;
    return 0;
}

/* Union of alts (flattened); refuses alternatives whose first bytes meet. */
static const gnode *make_union(cctx *c, const gnode **alts, int n) {
    int total = 0;
    for (int i = 0; i < n; i++)
        total += alts[i]->kind == GN_UNION ? alts[i]->n_alts : 1;
    gnode *u = node_make(c, GN_UNION);
    if (!u)
        return NULL;
    u->alts = pd_xcalloc((size_t)total, sizeof *u->alts);
    for (int i = 0; i < n; i++) {
        if (alts[i]->kind == GN_UNION)
            for (int k = 0; k < alts[i]->n_alts; k++)
                u->alts[u->n_alts++] = alts[i]->alts[k];
        else
            u->alts[u->n_alts++] = alts[i];
    }
    uint8_t seen[32] = {0};
    for (int i = 0; i < u->n_alts; i++) {
        for (int k = 0; k < 32; k++) {
            if (seen[k] & u->alts[i]->first[k]) {
                cfail(c, PD_ERR_UNSUPPORTED,
                      "unsupported schema: alternatives (anyOf, oneOf or a list of types) must be "
                      "of different JSON types (integer and number count as one)");
                return NULL;
            }
            seen[k] |= u->alts[i]->first[k];
        }
    }
    node_first(u);
    return u;
}

static const gnode *compile_object(cctx *c, const json_t *s, int depth) {
    gnode *n = node_make(c, GN_OBJECT);
    if (!n)
        return NULL;
    json_t *props = json_object_get(s, "properties");
    json_t *req = json_object_get(s, "required");
    json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props))
        return cfail(c, PD_ERR_INVALID, "'properties' must be an object"), NULL;
    if (req && !json_is_array(req))
        return cfail(c, PD_ERR_INVALID, "'required' must be an array of strings"), NULL;
    size_t n_req = req ? json_array_size(req) : 0;
    for (size_t i = 0; i < n_req; i++)
        if (!json_is_string(json_array_get(req, i)))
            return cfail(c, PD_ERR_INVALID, "'required' must be an array of strings"), NULL;
    size_t n_props = props ? json_object_size(props) : 0;
    if (n_props + n_req > PD_GRAMMAR_MAX_PROPERTIES)
        return cfail(c, PD_ERR_LIMIT, "more than %d properties", PD_GRAMMAR_MAX_PROPERTIES), NULL;

    n->has_props = n_props + n_req > 0;
    const gnode *addl_node = NULL; /* with properties: the additionalProperties schema */
    if (!n->has_props) {
        if (!addl || json_is_true(addl)) {
            n->additional = c->g->any;
        } else if (json_is_false(addl)) {
            n->additional = NULL;
        } else {
            size_t m = path_push(c, "additionalProperties");
            n->additional = compile(c, addl, depth + 1);
            path_pop(c, m);
            if (!n->additional)
                return NULL;
        }
    } else if (addl && !json_is_boolean(addl) && !json_is_object(addl)) {
        return cfail(c, PD_ERR_INVALID, "'additionalProperties' must be a boolean or a schema"),
               NULL;
    } else if (json_is_object(addl)) {
        /* only listed properties are generated, but a 'required' name that
         * 'properties' does not describe takes this schema (and its keywords
         * are checked like any other) */
        size_t m = path_push(c, "additionalProperties");
        addl_node = compile(c, addl, depth + 1);
        path_pop(c, m);
        if (!addl_node)
            return NULL;
    }

    size_t cap = n_props + n_req;
    n->prop = pd_xcalloc(cap + 1, sizeof *n->prop);
    n->key = pd_xcalloc(cap + 1, sizeof *n->key);
    n->key_len = pd_xcalloc(cap + 1, sizeof *n->key_len);
    bool *required = pd_xcalloc(cap + 1, sizeof *required);
    const char *name;
    json_t *sub;
    size_t m = path_push(c, "properties");
    json_object_foreach(props, name, sub) {
        size_t m2 = path_push(c, name);
        const gnode *p = compile(c, sub, depth + 1);
        path_pop(c, m2);
        if (!p) {
            free(required);
            return NULL;
        }
        json_t *js = json_string(name);
        n->key[n->n_props] = json_dumps(js, JSON_COMPACT | JSON_ENCODE_ANY);
        json_decref(js);
        PD_ASSERT(n->key[n->n_props]);
        n->key_len[n->n_props] = (uint32_t)strlen(n->key[n->n_props]);
        n->prop[n->n_props++] = p;
    }
    path_pop(c, m);
    for (size_t i = 0; i < n_req; i++) {
        json_t *js = json_array_get(req, i);
        char *k = json_dumps(js, JSON_COMPACT | JSON_ENCODE_ANY);
        PD_ASSERT(k);
        int at = -1;
        for (int j = 0; j < n->n_props; j++)
            if (strcmp(n->key[j], k) == 0)
                at = j;
        if (at < 0) {
            /* required but not described: after the described ones, a value
             * of 'additionalProperties' (any value when absent or true) */
            if (json_is_false(addl)) {
                cfail(c, PD_ERR_INVALID,
                      "required property %s is not in 'properties' and 'additionalProperties' "
                      "is false: the schema cannot be satisfied",
                      k);
                free(k);
                free(required);
                return NULL;
            }
            at = n->n_props++;
            n->key[at] = k;
            n->key_len[at] = (uint32_t)strlen(k);
            n->prop[at] = addl_node ? addl_node : c->g->any;
        } else {
            free(k);
        }
        required[at] = true;
    }
    n->req_after = pd_xcalloc((size_t)n->n_props + 1, sizeof *n->req_after);
    n->req_after[n->n_props] = n->n_props;
    for (int i = n->n_props - 1; i >= 0; i--)
        n->req_after[i] = required[i] ? i : n->req_after[i + 1];
    n->req_cost = pd_xcalloc((size_t)n->n_props + 1, sizeof *n->req_cost);
    for (int i = n->n_props - 1; i >= 0; i--) {
        uint64_t kv = g_add(n->key_len[i] + 1, n->prop[i]->min_bytes); /* "key":value */
        n->req_cost[i] = required[i] ? g_add(n->req_cost[i + 1], kv + 1) : n->req_cost[i + 1];
    }
    free(required);
    node_first(n);
    return n;
}

/* One node of one named type from schema object s. */
static const gnode *compile_typed(cctx *c, const json_t *s, const char *type, int depth) {
    if (strcmp(type, "object") == 0)
        return compile_object(c, s, depth);
    if (strcmp(type, "boolean") == 0 || strcmp(type, "null") == 0) {
        gnode *n = node_make(c, GN_LITERALS);
        if (!n)
            return NULL;
        if (strcmp(type, "null") == 0) {
            lit_add(c, n, json_null());
        } else {
            lit_add(c, n, json_true());
            lit_add(c, n, json_false());
        }
        node_first(n);
        return n;
    }
    if (strcmp(type, "number") == 0 || strcmp(type, "integer") == 0) {
        static const char *const bounds[] = {"minimum", "exclusiveMinimum", "maximum",
                                             "exclusiveMaximum"};
        bool any = false;
        for (int i = 0; i < 4; i++)
            any = any || json_object_get(s, bounds[i]);
        if (any && type[0] == 'n')
            return cfail(c, PD_ERR_UNSUPPORTED,
                         "unsupported schema: minimum/maximum on 'number' (only on 'integer')"),
                   NULL;
        gnode *n = node_make(c, type[0] == 'n' ? GN_NUMBER : GN_INTEGER);
        if (!n)
            return NULL;
        /* integers of at most PD_GRAMMAR_MAX_INT_DIGITS digits within the bounds */
        const double lim = 999999999999999999.0;
        double lo = -lim, hi = lim;
        for (int i = 0; i < 4; i++) {
            json_t *b = json_object_get(s, bounds[i]);
            if (!b)
                continue;
            if (!json_is_number(b))
                return cfail(c, PD_ERR_INVALID, "'%s' must be a number", bounds[i]), NULL;
            double x = json_number_value(b);
            double v = i == 0 ? ceil(x) : i == 1 ? floor(x) + 1 : i == 2 ? floor(x) : ceil(x) - 1;
            if (i < 2 && v > lo)
                lo = v;
            if (i >= 2 && v < hi)
                hi = v;
        }
        if (lo > hi)
            return cfail(c, PD_ERR_INVALID,
                         "no integer of at most %d digits satisfies minimum/maximum",
                         PD_GRAMMAR_MAX_INT_DIGITS),
                   NULL;
        n->bounded = any;
        n->lo = (int64_t)lo;
        n->hi = (int64_t)hi;
        node_first(n);
        return n;
    }
    if (strcmp(type, "string") == 0) {
        gnode *n = node_make(c, GN_STRING);
        if (!n)
            return NULL;
        n->min_len = 0;
        if (get_count(c, s, "minLength", &n->min_len) || get_count(c, s, "maxLength", &n->max_len))
            return NULL;
        if (n->min_len > n->max_len)
            return cfail(c, PD_ERR_INVALID, "'minLength' exceeds 'maxLength'"), NULL;
        node_first(n);
        return n;
    }
    /* array */
    gnode *n = node_make(c, GN_ARRAY);
    if (!n)
        return NULL;
    if (get_count(c, s, "minItems", &n->min_items) || get_count(c, s, "maxItems", &n->max_items))
        return NULL;
    if (n->min_items > n->max_items)
        return cfail(c, PD_ERR_INVALID, "'minItems' exceeds 'maxItems'"), NULL;
    json_t *items = json_object_get(s, "items");
    if (!items || json_is_true(items)) {
        n->items = c->g->any;
    } else if (json_is_false(items)) {
        n->items = c->g->any;
        n->max_items = 0;
        if (n->min_items > 0)
            return cfail(c, PD_ERR_INVALID,
                         "'items': false with 'minItems' > 0 cannot be satisfied"),
                   NULL;
    } else {
        size_t m = path_push(c, "items");
        n->items = compile(c, items, depth + 1);
        path_pop(c, m);
        if (!n->items)
            return NULL;
    }
    node_first(n);
    return n;
}

static const gnode *compile_enum(cctx *c, const json_t *s, const json_t *type) {
    json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const");
    if (en && cn)
        return cfail(c, PD_ERR_UNSUPPORTED, "unsupported schema: 'enum' together with 'const'"),
               NULL;
    if (en && (!json_is_array(en) || json_array_size(en) == 0))
        return cfail(c, PD_ERR_INVALID, "'enum' must be a non-empty array"), NULL;
    gnode *n = node_make(c, GN_LITERALS);
    if (!n)
        return NULL;
    if (cn) {
        if (type_allows(type, cn) && lit_add(c, n, cn))
            return NULL;
    } else {
        size_t i;
        json_t *v;
        json_array_foreach(en, i, v) {
            if (type_allows(type, v) && lit_add(c, n, v))
                return NULL;
        }
    }
    if (n->n_lits == 0)
        return cfail(c, PD_ERR_INVALID, "no 'enum'/'const' value has the schema's 'type'"), NULL;
    /* a literal never starts with a byte another one makes ambiguous: they
     * are matched together by one frame (automaton.c) */
    node_first(n);
    return n;
}

/* "$ref": a JSON pointer into this document ("#/$defs/Name",
 * "#/definitions/Name", any "#/a/b" with ~0 ~1 escapes, RFC 6901). Each
 * target is compiled once and its node shared; a target reached again
 * while it is being compiled is a recursive schema, which the automaton
 * (bounded, deterministic) does not take. */
static const gnode *compile_ref(cctx *c, const json_t *ref, int depth) {
    if (!json_is_string(ref))
        return cfail(c, PD_ERR_INVALID, "'$ref' must be a string"), NULL;
    const char *p = json_string_value(ref);
    if (p[0] != '#')
        return cfail(c, PD_ERR_UNSUPPORTED,
                     "unsupported '$ref' %.100s: only references into this schema (\"#/...\")", p),
               NULL;
    const json_t *t = c->doc;
    for (p++; *p;) {
        if (*p != '/')
            return cfail(c, PD_ERR_INVALID, "'$ref' %.100s is not a JSON pointer",
                         json_string_value(ref)),
                   NULL;
        p++;
        char seg[256];
        size_t n = 0;
        for (; *p && *p != '/'; p++) {
            char ch = *p;
            if (ch == '~' && (p[1] == '0' || p[1] == '1'))
                ch = *++p == '0' ? '~' : '/';
            if (n + 1 < sizeof seg)
                seg[n++] = ch;
        }
        seg[n] = '\0';
        const json_t *next = NULL;
        if (json_is_object(t))
            next = json_object_get(t, seg);
        else if (json_is_array(t) && n > 0 && strspn(seg, "0123456789") == n)
            next = json_array_get(t, (size_t)strtoul(seg, NULL, 10));
        if (!next)
            return cfail(c, PD_ERR_INVALID, "'$ref' %.100s does not resolve",
                         json_string_value(ref)),
                   NULL;
        t = next;
    }
    for (int i = 0; i < c->n_done; i++)
        if (c->done_ref[i] == t)
            return c->done_node[i];
    for (int i = 0; i < c->n_open; i++)
        if (c->open_refs[i] == t)
            return cfail(c, PD_ERR_UNSUPPORTED, "unsupported schema: recursive '$ref' %.100s",
                         json_string_value(ref)),
                   NULL;
    if (c->n_open >= (int)(sizeof c->open_refs / sizeof *c->open_refs))
        return cfail(c, PD_ERR_LIMIT, "'$ref' chains nested more than %d deep",
                     PD_GRAMMAR_MAX_SCHEMA_DEPTH),
               NULL;
    c->open_refs[c->n_open++] = t;
    size_t m = path_push(c, "$ref");
    const gnode *node = compile(c, t, depth + 1);
    path_pop(c, m);
    c->n_open--;
    if (node) {
        c->done_ref = realloc(c->done_ref, (size_t)(c->n_done + 1) * sizeof *c->done_ref);
        c->done_node = realloc(c->done_node, (size_t)(c->n_done + 1) * sizeof *c->done_node);
        PD_ASSERT(c->done_ref && c->done_node);
        c->done_ref[c->n_done] = t;
        c->done_node[c->n_done++] = node;
    }
    return node;
}

static const gnode *compile(cctx *c, const json_t *s, int depth) {
    if (depth > PD_GRAMMAR_MAX_SCHEMA_DEPTH)
        return cfail(c, PD_ERR_LIMIT, "schema nested more than %d deep",
                     PD_GRAMMAR_MAX_SCHEMA_DEPTH),
               NULL;
    if (json_is_true(s))
        return c->g->any;
    if (json_is_false(s))
        return cfail(c, PD_ERR_INVALID, "schema false cannot be satisfied"), NULL;
    if (!json_is_object(s))
        return cfail(c, PD_ERR_INVALID, "a schema must be an object or a boolean"), NULL;

    const char *k;
    json_t *v;
    int n_constraints = 0;
    json_object_foreach((json_t *)s, k, v) {
        if (in_list(ANNOTATIONS, k))
            continue;
        if (strcmp(k, "$ref") != 0 && !in_list(KEYWORDS, k))
            return cfail(c, PD_ERR_UNSUPPORTED, "unsupported schema keyword: %s", k), NULL;
        n_constraints++;
    }
    json_t *ref = json_object_get(s, "$ref");
    if (ref) {
        if (n_constraints != 1)
            return cfail(c, PD_ERR_UNSUPPORTED,
                         "unsupported schema: '$ref' together with other keywords"),
                   NULL;
        return compile_ref(c, ref, depth);
    }

    json_t *any_of = json_object_get(s, "anyOf");
    json_t *one_of = json_object_get(s, "oneOf");
    if (any_of || one_of) {
        const char *kw = any_of ? "anyOf" : "oneOf";
        json_t *alts = any_of ? any_of : one_of;
        if (n_constraints != 1)
            return cfail(c, PD_ERR_UNSUPPORTED,
                         "unsupported schema: '%s' together with other keywords", kw),
                   NULL;
        if (!json_is_array(alts) || json_array_size(alts) == 0)
            return cfail(c, PD_ERR_INVALID, "'%s' must be a non-empty array", kw), NULL;
        size_t n = json_array_size(alts);
        const gnode **nodes = pd_xcalloc(n, sizeof *nodes);
        for (size_t i = 0; i < n; i++) {
            char seg[32];
            snprintf(seg, sizeof seg, "%s[%zu]", kw, i);
            size_t m = path_push(c, seg);
            nodes[i] = compile(c, json_array_get(alts, i), depth + 1);
            path_pop(c, m);
            if (!nodes[i]) {
                free(nodes);
                return NULL;
            }
        }
        const gnode *u = n == 1 ? nodes[0] : make_union(c, nodes, (int)n);
        free(nodes);
        return u;
    }

    json_t *type = json_object_get(s, "type");
    if (type) {
        bool ok = json_is_string(type) && in_list(TYPES, json_string_value(type));
        if (json_is_array(type)) {
            ok = json_array_size(type) > 0;
            size_t i;
            json_t *t;
            json_array_foreach(type, i, t) ok =
                ok && json_is_string(t) && in_list(TYPES, json_string_value(t));
        }
        if (!ok)
            return cfail(c, PD_ERR_INVALID,
                         "'type' must be one of object, array, string, number, integer, boolean, "
                         "null, or a non-empty array of them"),
                   NULL;
    }
    if (json_object_get(s, "enum") || json_object_get(s, "const")) {
        /* only type may narrow it: other keywords would have to hold too */
        if (n_constraints != 1 + (type != NULL))
            return cfail(c, PD_ERR_UNSUPPORTED,
                         "unsupported schema: 'enum'/'const' together with keywords other than "
                         "'type'"),
                   NULL;
        return compile_enum(c, s, type);
    }
    if (!type) {
        const char *implied = NULL;
        if (json_object_get(s, "properties") || json_object_get(s, "required") ||
            json_object_get(s, "additionalProperties"))
            implied = "object";
        else if (json_object_get(s, "items") || json_object_get(s, "minItems") ||
                 json_object_get(s, "maxItems"))
            implied = "array";
        else if (json_object_get(s, "minLength") || json_object_get(s, "maxLength"))
            implied = "string";
        else if (json_object_get(s, "minimum") || json_object_get(s, "maximum") ||
                 json_object_get(s, "exclusiveMinimum") || json_object_get(s, "exclusiveMaximum"))
            implied = "integer"; /* a subset of what the bounds allow: still valid */
        return implied ? compile_typed(c, s, implied, depth) : c->g->any;
    }
    if (json_is_string(type))
        return compile_typed(c, s, json_string_value(type), depth);
    size_t n = json_array_size(type);
    const gnode **nodes = pd_xcalloc(n, sizeof *nodes);
    for (size_t i = 0; i < n; i++) {
        nodes[i] = compile_typed(c, s, json_string_value(json_array_get(type, i)), depth);
        if (!nodes[i]) {
            free(nodes);
            return NULL;
        }
    }
    const gnode *u = n == 1 ? nodes[0] : make_union(c, nodes, (int)n);
    free(nodes);
    return u;
}

/* GN_ANY and the nodes its values are made of. */
static void make_any(cctx *c) {
    pd_grammar *g = c->g;
    gnode *any = node_new(c, GN_ANY);
    g->any = any;
    node_first(any);
    gnode *obj = node_new(c, GN_OBJECT);
    obj->additional = any;
    node_first(obj);
    g->any_obj = obj;
    gnode *arr = node_new(c, GN_ARRAY);
    arr->items = any;
    arr->max_items = UINT32_MAX;
    node_first(arr);
    g->any_arr = arr;
    gnode *str = node_new(c, GN_STRING);
    str->max_len = UINT32_MAX;
    node_first(str);
    g->any_str = str;
    gnode *num = node_new(c, GN_NUMBER);
    node_first(num);
    g->any_num = num;
    gnode *lit = node_new(c, GN_LITERALS);
    lit_add(c, lit, json_true());
    lit_add(c, lit, json_false());
    lit_add(c, lit, json_null());
    node_first(lit);
    g->any_lit = lit;
}

pd_status pd_grammar_compile(const char *schema, size_t len, pd_grammar **g_p, pd_err *err) {
    if (!schema || !g_p)
        return pd_err_set(err, PD_ERR_INVALID, "pd_grammar_compile: NULL argument");
    if (len > PD_GRAMMAR_MAX_SCHEMA_BYTES)
        return pd_err_set(err, PD_ERR_LIMIT, "schema longer than %d bytes",
                          PD_GRAMMAR_MAX_SCHEMA_BYTES);
    json_error_t je;
    json_t *root = json_loadb(schema, len, JSON_DECODE_ANY, &je);
    if (!root)
        return pd_err_set(err, PD_ERR_INVALID, "schema is not JSON: %s", je.text);
    pd_grammar *g = pd_xcalloc(1, sizeof *g);
    cctx c = {.g = g, .err = err, .doc = root};
    make_any(&c);
    g->root = compile(&c, root, 0);
    free(c.done_ref);
    free(c.done_node);
    if (!g->root) {
        json_decref(root);
        pd_grammar_free(&g);
        return c.st; /* err set by cfail */
    }
    g->canonical = json_dumps(root, JSON_COMPACT | JSON_ENCODE_ANY);
    json_decref(root);
    PD_ASSERT(g->canonical);
    *g_p = g;
    return PD_OK;
}

const char *pd_grammar_canonical(const pd_grammar *g) {
    return g ? g->canonical : NULL;
}

void pd_grammar_free(pd_grammar **g_p) {
    if (!g_p || !*g_p)
        return;
    pd_grammar *g = *g_p;
    for (int i = 0; i < g->n_nodes; i++) {
        gnode *n = g->nodes[i];
        for (int k = 0; k < n->n_props; k++)
            free(n->key[k]);
        free(n->key);
        free(n->key_len);
        free(n->prop);
        free(n->req_after);
        free(n->req_cost);
        for (int k = 0; k < n->n_lits; k++)
            free(n->lit[k]);
        free(n->lit);
        free(n->lit_len);
        free(n->alts);
        free(n);
    }
    free(g->nodes);
    free(g->canonical);
    free(g);
    *g_p = NULL;
}

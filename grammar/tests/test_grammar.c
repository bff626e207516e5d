/* The schema compiler and the byte automaton: documents accepted and
 * refused byte by byte, schema errors, and the property that every text
 * the automaton accepts as complete parses (jansson) and validates (the
 * independent validator of grammar_test_util.h), on seeded random walks
 * and on random byte strings. */
#include "grammar_test_util.h"

/* Feeds the whole text; returns 1 if accepted and complete, 0 if accepted
 * but incomplete, -1 if a byte was refused. */
static int feed(const pd_grammar *g, const char *text) {
    pd_grammar_state *s = NULL;
    assert_int_equal(pd_grammar_state_init(g, NULL, &s, NULL), PD_OK);
    int r = -1;
    if (pd_grammar_state_accept_bytes(s, (const uint8_t *)text, strlen(text)))
        r = pd_grammar_state_is_complete(s) ? 1 : 0;
    pd_grammar_state_free(&s);
    return r;
}

#define ACCEPT(g, t)  assert_int_equal(feed(g, t), 1)
#define PARTIAL(g, t) assert_int_equal(feed(g, t), 0)
#define REFUSE(g, t)  assert_int_equal(feed(g, t), -1)

static void test_json_object(void **st) {
    (void)st;
    pd_grammar *g = gt_compile(PD_GRAMMAR_JSON_OBJECT);
    ACCEPT(g, "{}");
    ACCEPT(g, "{\"a\":1}");
    ACCEPT(g, "{\"a\": [1, 2.5e-3, -0, \"x\\u00e9\\n\", true, false, null, {}], \"b\":{\"c\":[]}}");
    ACCEPT(g, "{\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\":\"\"}"); /* UTF-8 of 2, 3, 4 bytes */
    PARTIAL(g, "{\"a\":1");
    PARTIAL(g, "{\"a\":");
    REFUSE(g, "[]");                           /* an object is required */
    REFUSE(g, " {}");                          /* no leading whitespace */
    REFUSE(g, "{ }");                          /* no whitespace after { */
    REFUSE(g, "{\"a\":  1}");                  /* one space at most */
    REFUSE(g, "{\"a\":\n1}");                  /* no newlines */
    REFUSE(g, "{}x");                          /* nothing after the value */
    REFUSE(g, "{\"a\":01}");                   /* leading zero */
    REFUSE(g, "{\"a\":1.}");                   /* fraction needs a digit */
    REFUSE(g, "{\"a\":\"\x01\"}");             /* control character */
    REFUSE(g, "{\"a\":\"\\x\"}");              /* bad escape */
    REFUSE(g, "{\"a\":\"\\ud800\"}");          /* lone surrogate escape */
    REFUSE(g, "{\"a\":\"\xc0\xaf\"}");         /* overlong UTF-8 */
    REFUSE(g, "{\"a\":\"\xed\xa0\x80\"}");     /* UTF-8 surrogate */
    REFUSE(g, "{\"a\":\"\xf4\x90\x80\x80\"}"); /* above U+10FFFF */
    REFUSE(g, "{\"a\":tru}");
    REFUSE(g, "{,}");
    REFUSE(g, "{\"a\":1,}");
    pd_grammar_free(&g);
}

static void test_properties_in_order(void **st) {
    (void)st;
    pd_grammar *g = gt_compile("{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"}"
                               ",\"age\":{\"type\":\"integer\"},"
                               "\"nick\":{\"type\":\"string\"}},\"required\":[\"name\",\"nick\"]}");
    ACCEPT(g, "{\"name\":\"x\",\"age\":3,\"nick\":\"y\"}");
    ACCEPT(g, "{\"name\": \"x\", \"nick\": \"y\"}");          /* optional age left out */
    REFUSE(g, "{\"age\":3}");                                 /* required name skipped */
    REFUSE(g, "{\"nick\":\"y\",\"name\":\"x\"}");             /* out of schema order */
    REFUSE(g, "{\"name\":\"x\",\"other\":1}");                /* not a listed property */
    REFUSE(g, "{\"name\":\"x\"}");                            /* nick is required */
    REFUSE(g, "{\"name\":\"x\",\"age\":3.5,\"nick\":\"y\"}"); /* integer */
    REFUSE(g, "{\"name\":\"x\",\"age\":1e3,\"nick\":\"y\"}");
    pd_grammar_free(&g);
    /* keys that prefix each other, and keys that need escaping */
    g = gt_compile("{\"properties\":{\"ab\":{},\"abc\":{},\"q\\\"\":{}}}");
    ACCEPT(g, "{\"abc\":1}");
    ACCEPT(g, "{\"ab\":1,\"abc\":2,\"q\\\"\":3}");
    REFUSE(g, "{\"q\"\":3}");
    ACCEPT(g, "{}");
    pd_grammar_free(&g);
}

static void test_arrays_strings_enums(void **st) {
    (void)st;
    pd_grammar *g = gt_compile("{\"type\":\"array\",\"items\":{\"type\":\"string\",\"minLength\":1,"
                               "\"maxLength\":3},\"minItems\":1,\"maxItems\":2}");
    ACCEPT(g, "[\"a\"]");
    ACCEPT(g, "[\"abc\", \"\xe2\x82\xac\xe2\x82\xac\\n\"]"); /* 3 code points each */
    REFUSE(g, "[]");
    REFUSE(g, "[\"\"]");
    REFUSE(g, "[\"abcd\"]");
    REFUSE(g, "[\"a\",\"b\",\"c\"]");
    pd_grammar_free(&g);

    g = gt_compile("{\"enum\":[\"red\",\"green\",1,12,1.5,null,{\"a\":[1]}]}");
    ACCEPT(g, "\"red\"");
    ACCEPT(g, "1");
    ACCEPT(g, "12");
    ACCEPT(g, "1.5");
    ACCEPT(g, "null");
    ACCEPT(g, "{\"a\":[1]}");
    REFUSE(g, "\"blue\"");
    REFUSE(g, "2");
    REFUSE(g, "13");
    pd_grammar_free(&g);

    /* enum values of another type than "type" are dropped */
    g = gt_compile("{\"type\":\"string\",\"enum\":[\"a\",1]}");
    ACCEPT(g, "\"a\"");
    REFUSE(g, "1");
    pd_grammar_free(&g);

    g = gt_compile("{\"anyOf\":[{\"type\":\"string\",\"maxLength\":2},{\"type\":\"null\"},"
                   "{\"type\":\"array\",\"items\":{\"type\":\"boolean\"}}]}");
    ACCEPT(g, "\"ab\"");
    ACCEPT(g, "null");
    ACCEPT(g, "[true, false]");
    REFUSE(g, "\"abc\"");
    REFUSE(g, "[1]");
    pd_grammar_free(&g);

    g = gt_compile("{\"type\":[\"integer\",\"null\"]}");
    ACCEPT(g, "-12");
    ACCEPT(g, "null");
    PARTIAL(g, "-");
    REFUSE(g, "1.0");
    pd_grammar_free(&g);

    /* a number at the top level: complete, yet it may grow to the limit */
    g = gt_compile("{\"type\":\"number\"}");
    pd_grammar_state *s = NULL;
    pd_grammar_state_init(g, NULL, &s, NULL);
    assert_true(pd_grammar_state_accept_bytes(s, (const uint8_t *)"12", 2));
    assert_true(pd_grammar_state_is_complete(s));
    assert_false(pd_grammar_state_is_terminal(s));
    for (int i = 2; i < PD_GRAMMAR_MAX_INT_DIGITS; i++)
        assert_true(pd_grammar_state_accept_bytes(s, (const uint8_t *)"3", 1));
    assert_false(pd_grammar_state_accept_bytes(s, (const uint8_t *)"3", 1));
    assert_true(pd_grammar_state_accept_bytes(s, (const uint8_t *)".25e-99", 7));
    assert_false(pd_grammar_state_accept_bytes(s, (const uint8_t *)"9", 1));
    /* a refused byte leaves the state as it was */
    assert_false(pd_grammar_state_accept_bytes(s, (const uint8_t *)"x", 1));
    assert_true(pd_grammar_state_is_complete(s));
    pd_grammar_state_free(&s);
    pd_grammar_free(&g);
}

static void expect_error(const char *schema, pd_status want, const char *msg_part);

/* minimum / maximum / exclusive* on integers: every digit keeps a value in
 * range within reach. */
static void test_integer_bounds(void **st) {
    (void)st;
    pd_grammar *g = gt_compile("{\"type\":\"integer\",\"minimum\":-5,\"maximum\":120}");
    ACCEPT(g, "-5");
    ACCEPT(g, "0");
    ACCEPT(g, "120");
    ACCEPT(g, "99");
    PARTIAL(g, "-");
    REFUSE(g, "-6");
    REFUSE(g, "-0");
    REFUSE(g, "121");
    REFUSE(g, "1200");
    REFUSE(g, "-10");
    pd_grammar_free(&g);
    g = gt_compile("{\"type\":\"integer\",\"exclusiveMinimum\":99.5,\"exclusiveMaximum\":1000}");
    ACCEPT(g, "100");
    ACCEPT(g, "999");
    PARTIAL(g, "1");  /* 1 -> 100..199 */
    PARTIAL(g, "10"); /* 10 -> 100..109 */
    REFUSE(g, "1000");
    REFUSE(g, "0");
    REFUSE(g, "-1");
    pd_grammar_free(&g);
    g = gt_compile("{\"minimum\":-1000,\"maximum\":-990}"); /* implied integer */
    ACCEPT(g, "-995");
    PARTIAL(g, "-99");
    REFUSE(g, "-98");
    REFUSE(g, "5");
    pd_grammar_free(&g);
    expect_error("{\"type\":\"number\",\"minimum\":0}", PD_ERR_UNSUPPORTED, "only on 'integer'");
    expect_error("{\"type\":\"integer\",\"minimum\":5,\"maximum\":4.5}", PD_ERR_INVALID,
                 "no integer of at most 18 digits");
    expect_error("{\"type\":\"integer\",\"minimum\":\"5\"}", PD_ERR_INVALID,
                 "'minimum' must be a number");
}

/* Output nesting is bounded, so "[[[[..." cannot run away. */
static void test_depth_limit(void **st) {
    (void)st;
    pd_grammar *g = gt_compile("{\"type\":\"array\"}");
    char buf[PD_GRAMMAR_MAX_DEPTH + 2];
    memset(buf, '[', sizeof buf - 1);
    buf[sizeof buf - 1] = '\0';
    buf[PD_GRAMMAR_MAX_DEPTH] = '\0';
    PARTIAL(g, buf);
    buf[PD_GRAMMAR_MAX_DEPTH] = '[';
    REFUSE(g, buf);
    pd_grammar_free(&g);
}

static void expect_error(const char *schema, pd_status want, const char *msg_part) {
    pd_grammar *g = NULL;
    pd_err err = {{0}};
    pd_status got = pd_grammar_compile(schema, strlen(schema), &g, &err);
    if (got != want || !strstr(err.msg, msg_part))
        fail_msg("%s: got %s '%s', want %s '...%s...'", schema, pd_status_str(got), err.msg,
                 pd_status_str(want), msg_part);
    assert_null(g);
}

static void test_schema_errors(void **st) {
    (void)st;
    expect_error(
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"pattern\":\"^a\"}}}",
        PD_ERR_UNSUPPORTED, "unsupported schema keyword: pattern at properties.name");
    expect_error("{\"$ref\":\"#/x\"}", PD_ERR_INVALID, "'$ref' #/x does not resolve");
    expect_error("{\"$ref\":\"other.json#/a\"}", PD_ERR_UNSUPPORTED,
                 "only references into this schema");
    expect_error("{\"$defs\":{\"N\":{\"type\":\"object\",\"properties\":{\"next\":{\"$ref\":\"#/"
                 "$defs/N\"}}}},"
                 "\"$ref\":\"#/$defs/N\"}",
                 PD_ERR_UNSUPPORTED, "recursive '$ref' #/$defs/N at $ref.properties.next");
    expect_error("{\"$ref\":\"#/$defs/A\",\"type\":\"object\",\"$defs\":{\"A\":{}}}",
                 PD_ERR_UNSUPPORTED, "'$ref' together with other keywords");
    expect_error("{\"$defs\":{\"A\":{\"pattern\":\"x\"}},\"items\":{\"$ref\":\"#/$defs/A\"}}",
                 PD_ERR_UNSUPPORTED, "unsupported schema keyword: pattern at items.$ref");
    /* escapes of RFC 6901; a shared target compiles once */
    pd_grammar *gr =
        gt_compile("{\"definitions\":{\"a/b~c\":{\"type\":\"integer\"}},\"type\":\"array\","
                   "\"items\":{\"$ref\":\"#/definitions/a~1b~0c\"}}");
    ACCEPT(gr, "[1,2]");
    REFUSE(gr, "[\"x\"]");
    pd_grammar_free(&gr);
    expect_error("{\"type\":\"strin\"}", PD_ERR_INVALID, "'type' must be one of");
    expect_error("[1]", PD_ERR_INVALID, "a schema must be an object or a boolean");
    expect_error("false", PD_ERR_INVALID, "cannot be satisfied");
    expect_error("{\"x\":", PD_ERR_INVALID, "schema is not JSON");
    expect_error("{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"number\"}]}", PD_ERR_UNSUPPORTED,
                 "different JSON types");
    expect_error("{\"anyOf\":[{\"type\":\"object\"},{\"properties\":{\"a\":{}}}]}",
                 PD_ERR_UNSUPPORTED, "different JSON types");
    expect_error("{\"type\":\"string\",\"minLength\":3,\"maxLength\":2}", PD_ERR_INVALID,
                 "minLength");
    expect_error("{\"type\":\"array\",\"minItems\":-1}", PD_ERR_INVALID, "minItems");
    expect_error("{\"enum\":[]}", PD_ERR_INVALID, "non-empty");
    expect_error("{\"type\":\"integer\",\"enum\":[\"a\"]}", PD_ERR_INVALID,
                 "no 'enum'/'const' value");
    /* a required name that properties does not describe and additionalProperties forbids */
    expect_error("{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"b\"],"
                 "\"additionalProperties\":false}",
                 PD_ERR_INVALID,
                 "required property \"b\" is not in 'properties' and 'additionalProperties' is "
                 "false");
    /* additionalProperties beside properties is checked too, never ignored */
    expect_error("{\"properties\":{\"a\":{}},\"additionalProperties\":{\"pattern\":\"x\"}}",
                 PD_ERR_UNSUPPORTED, "unsupported schema keyword: pattern at additionalProperties");
    /* ... and gives the value of such a required name */
    pd_grammar *ga = gt_compile("{\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":"
                                "[\"b\"],\"additionalProperties\":{\"type\":\"boolean\"}}");
    ACCEPT(ga, "{\"a\":1,\"b\":true}");
    ACCEPT(ga, "{\"b\":false}");
    REFUSE(ga, "{\"a\":1,\"b\":1}");
    REFUSE(ga, "{\"a\":1}");
    pd_grammar_free(&ga);
    /* too deep: 17 nested items */
    char deep[1024] = "";
    for (int i = 0; i <= PD_GRAMMAR_MAX_SCHEMA_DEPTH; i++)
        strcat(deep, "{\"items\":");
    strcat(deep, "{}");
    for (int i = 0; i <= PD_GRAMMAR_MAX_SCHEMA_DEPTH; i++)
        strcat(deep, "}");
    expect_error(deep, PD_ERR_LIMIT, "nested more than");
    /* too many subschemas */
    size_t cap = 64 * 1024;
    char *big = malloc(cap);
    strcpy(big, "{\"properties\":{");
    for (int i = 0; i < 1100; i++)
        sprintf(big + strlen(big), "%s\"p%d\":{}", i ? "," : "", i);
    strcat(big, "}}");
    expect_error(big, PD_ERR_LIMIT, "more than 256 properties");
    free(big);
    /* annotations are fine */
    pd_grammar *g =
        gt_compile("{\"title\":\"t\",\"description\":\"d\",\"$schema\":\"x\",\"type\":\"null\"}");
    assert_string_equal(
        pd_grammar_canonical(g),
        "{\"title\":\"t\",\"description\":\"d\",\"$schema\":\"x\",\"type\":\"null\"}");
    pd_grammar_free(&g);
}

static const char *const SCHEMAS[] = {
    PD_GRAMMAR_JSON_OBJECT,
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":8},"
    "\"age\":{\"type\":\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\","
    "3]},"
    "\"maxItems\":3},\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"ok\"],"
    "\"additionalProperties\":false}",
    "{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"number\"}"
    ","
    "\"y\":{\"type\":[\"number\",\"null\"]}},\"required\":[\"x\",\"y\"]},\"minItems\":1,"
    "\"maxItems\":4}",
    "{\"anyOf\":[{\"type\":\"string\",\"minLength\":2},{\"type\":\"integer\"},{\"type\":\"object\","
    "\"additionalProperties\":{\"type\":\"array\",\"items\":{\"type\":\"null\"}}}]}",
    "{\"type\":\"object\",\"properties\":{\"k\":{\"const\":{\"deep\":[1,\"two\",null]}},"
    "\"e\":{\"oneOf\":[{\"type\":\"boolean\"},{\"type\":\"string\",\"maxLength\":0}]}},"
    "\"required\":[\"k\"]}",
    "{\"type\":\"array\"}",
    "{\"type\":\"number\"}",
    "{\"type\":\"array\",\"items\":{\"type\":\"integer\",\"minimum\":-37,\"exclusiveMaximum\":1205}"
    "}",
    "{\"type\":[\"integer\",\"null\"],\"minimum\":1000000,\"maximum\":1000003}",
    "{\"type\":\"integer\",\"maximum\":-12}",
    /* required names outside properties take additionalProperties' schema */
    "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\","
    "\"b\",\"c\"],\"additionalProperties\":{\"type\":\"array\",\"items\":{\"type\":\"boolean\"}}}",
    /* as pydantic writes a model with a nested model and an Optional field */
    "{\"$defs\":{\"Pet\":{\"properties\":{\"kind\":{\"enum\":[\"cat\",\"dog\"],\"title\":\"Kind\","
    "\"type\":\"string\"},\"age\":{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"null\"}],"
    "\"default\":null}},\"required\":[\"kind\"],\"title\":\"Pet\",\"type\":\"object\","
    "\"additionalProperties\":false}},\"properties\":{\"owner\":{\"title\":\"Owner\",\"type\":"
    "\"string\",\"maxLength\":6},\"pets\":{\"items\":{\"$ref\":\"#/$defs/Pet\"},\"type\":\"array\","
    "\"maxItems\":3},\"best\":{\"$ref\":\"#/$defs/Pet\",\"description\":\"d\"}},\"required\":"
    "[\"owner\",\"pets\"],\"title\":\"Owner\",\"type\":\"object\"}",
};

/* Every random walk ends in a text that parses and validates. */
static void test_random_walks_validate(void **st) {
    (void)st;
    uint64_t rng = 42;
    for (size_t si = 0; si < sizeof SCHEMAS / sizeof *SCHEMAS; si++) {
        pd_grammar *g = gt_compile(SCHEMAS[si]);
        json_t *schema = json_loads(SCHEMAS[si], 0, NULL);
        assert_non_null(schema);
        gt_doc = schema;
        for (int i = 0; i < 300; i++) {
            size_t len = 0;
            char *doc = gt_walk(g, &rng, 20 + (size_t)(i % 5) * 30, 4096, &len);
            if (!doc)
                fail_msg("schema %zu walk %d stuck", si, i);
            json_error_t je;
            json_t *v = json_loadb(doc, len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
            if (!v)
                fail_msg("schema %zu: walk does not parse: %s: %s", si, je.text, doc);
            if (!gt_valid(v, schema))
                fail_msg("schema %zu: walk does not validate: %s", si, doc);
            /* and the public API agrees byte by byte */
            assert_int_equal(feed(g, doc), 1);
            json_decref(v);
            free(doc);
        }
        json_decref(schema);
        pd_grammar_free(&g);
    }
}

/* Random texts made of JSON-ish bytes: whenever the automaton accepts one
 * as complete, it parses and validates. */
static void test_random_bytes_validate(void **st) {
    (void)st;
    static const char alphabet[] = "{}[]\",: 0123456789-.eE+truefalsn\\u\xc3\xa9"
                                   "ab";
    uint64_t rng = 7;
    int accepted = 0;
    for (size_t si = 0; si < sizeof SCHEMAS / sizeof *SCHEMAS; si++) {
        pd_grammar *g = gt_compile(SCHEMAS[si]);
        json_t *schema = json_loads(SCHEMAS[si], 0, NULL);
        gt_doc = schema;
        pd_grammar_state *s = NULL;
        pd_grammar_state_init(g, NULL, &s, NULL);
        for (int i = 0; i < 20000; i++) {
            /* extend a valid prefix by random bytes until refused */
            char buf[256];
            size_t n = 0;
            pd_grammar_state_free(&s);
            pd_grammar_state_init(g, NULL, &s, NULL);
            while (n < sizeof buf - 1) {
                uint8_t b = (uint8_t)alphabet[gt_rand(&rng) % (sizeof alphabet - 1)];
                if (!pd_grammar_state_accept_bytes(s, &b, 1))
                    break;
                buf[n++] = (char)b;
                if (pd_grammar_state_is_complete(s)) {
                    accepted++;
                    json_t *v = json_loadb(buf, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
                    if (!v || !gt_valid(v, schema))
                        fail_msg("schema %zu: accepted %.*s", si, (int)n, buf);
                    json_decref(v);
                }
            }
        }
        pd_grammar_state_free(&s);
        json_decref(schema);
        pd_grammar_free(&g);
    }
    assert_true(accepted > 100);
}

/* g_close_bytes is consistent: from random prefixes, some byte always
 * lowers it by exactly one, and at 0 the value is complete. (The token
 * budget of pd_grammar_state_mask_logits relies on it.) */
static void test_close_bytes_path(void **st) {
    (void)st;
    uint64_t rng = 5;
    garena ar = {.cap = 1u << 16};
    ar.f = calloc(ar.cap, sizeof *ar.f);
    for (size_t si = 0; si < sizeof SCHEMAS / sizeof *SCHEMAS; si++) {
        pd_grammar *g = gt_compile(SCHEMAS[si]);
        for (int i = 0; i < 200; i++) {
            size_t len = 0;
            char *doc = gt_walk(g, &rng, 10 + (size_t)(i % 7) * 10, 4096, &len);
            assert_non_null(doc);
            size_t cut = len ? gt_rand(&rng) % len : 0; /* a prefix of a valid text */
            gframe root = {.node = g->root, .kind = GF_ROOT};
            ar.n = 0;
            const gframe *top = &root;
            for (size_t k = 0; k < cut; k++)
                top = g_step(g, &ar, top, (uint8_t)doc[k]);
            assert_non_null(top);
            uint64_t need = g_close_bytes(top);
            assert_true(need < 100000);
            while (need > 0) {
                const gframe *next = NULL;
                for (int b = 1; b < 256 && !next; b++) {
                    uint32_t mark = ar.n;
                    const gframe *t = g_step(g, &ar, top, b);
                    if (t && g_close_bytes(t) == need - 1)
                        next = t;
                    else
                        ar.n = mark;
                }
                if (!next)
                    fail_msg("schema %zu: no byte completes %.*s in %llu", si, (int)cut, doc,
                             (unsigned long long)need);
                top = next;
                need--;
            }
            if (!g_step(g, &ar, top, G_END))
                fail_msg("schema %zu: %.*s + shortest completion is not complete", si, (int)cut,
                         doc);
            free(doc);
        }
        pd_grammar_free(&g);
    }
    free(ar.f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_object),           cmocka_unit_test(test_properties_in_order),
        cmocka_unit_test(test_arrays_strings_enums),  cmocka_unit_test(test_depth_limit),
        cmocka_unit_test(test_integer_bounds),        cmocka_unit_test(test_schema_errors),
        cmocka_unit_test(test_random_walks_validate), cmocka_unit_test(test_random_bytes_validate),
        cmocka_unit_test(test_close_bytes_path),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

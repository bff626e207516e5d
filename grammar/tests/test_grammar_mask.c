/* The token mask on DeepSeek-V3's real vocabulary (129280 logits):
 *   - the mask equals brute force (every token fed to a fresh state replayed
 *     to the same prefix) at prefixes in every kind of frame;
 *   - EOS only when the value is complete, and alone when it is terminal;
 *   - decoding with random logits under the mask always ends, and the text
 *     parses and validates;
 *   - the time of one mask, printed (docs/benchmarks.md quotes it).
 * Needs PD_CACHE_DIR/tokenizer-deepseek_v3/tokenizer.json. */
#include <math.h>
#include <time.h>

#include "../../tokenizer/tests/tok_test_util.h"
#include "grammar_test_util.h"

#define VOCAB 129280
#define EOS   1 /* DeepSeek-V3 <｜end▁of▁sentence｜> */

static pd_tokenizer *tok;
static pd_grammar_vocab *vocab;

static int setup(void **st) {
    (void)st;
    tok = tt_load_tokenizer();
    pd_err err = {{0}};
    double t0 = pd_now_s();
    if (pd_grammar_vocab_init(tok, VOCAB, EOS, &vocab, &err) != PD_OK)
        fail_msg("vocab: %s", err.msg);
    printf("vocab trie built in %.3f s\n", pd_now_s() - t0);
    assert_int_equal(pd_tok_find(tok, PD_TOK_DSV3_EOS), EOS);
    return 0;
}

static int teardown(void **st) {
    (void)st;
    pd_grammar_vocab_free(&vocab);
    pd_tok_free(&tok);
    return 0;
}

static bool bit_of(const uint32_t *w, int32_t id) {
    return w[id >> 5] & (1u << (id & 31));
}

static pd_grammar_state *state_at(const pd_grammar *g, const char *prefix) {
    pd_grammar_state *s = NULL;
    assert_int_equal(pd_grammar_state_init(g, vocab, &s, NULL), PD_OK);
    if (!pd_grammar_state_accept_bytes(s, (const uint8_t *)prefix, strlen(prefix)))
        fail_msg("prefix refused: %s", prefix);
    return s;
}

/* mask(prefix) == { t : a fresh state at prefix accepts t } */
static void check_against_brute_force(const char *schema, const char *prefix) {
    pd_grammar *g = gt_compile(schema);
    pd_grammar_state *s = state_at(g, prefix);
    uint32_t *w = calloc((VOCAB + 31) / 32, sizeof *w);
    int n = pd_grammar_state_fill_mask(s, w, -1);
    int count = 0;
    pd_grammar_state *f = state_at(g, prefix);
    for (int32_t t = 0; t < VOCAB; t++) {
        bool ok = pd_grammar_state_accept_token(f, t);
        if (ok) { /* accepted: start again from the prefix */
            pd_grammar_state_free(&f);
            f = state_at(g, prefix);
        }
        if (ok != bit_of(w, t)) {
            const char *b = pd_tok_token_bytes(tok, t, NULL);
            fail_msg("schema %s prefix %s token %d '%s': mask %d, automaton %d", schema, prefix,
                     (int)t, b ? b : "", bit_of(w, t), ok);
        }
        count += ok;
    }
    assert_int_equal(n, count);
    /* EOS exactly when complete */
    assert_int_equal(bit_of(w, EOS), pd_grammar_state_is_complete(s));
    if (pd_grammar_state_is_terminal(s))
        assert_int_equal(n, 1);
    pd_grammar_state_free(&f);
    pd_grammar_state_free(&s);
    pd_grammar_free(&g);
    free(w);
}

static const char *const PERSON =
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":5},"
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},\"tags\":{\"type\":\"array\","
    "\"items\":{\"enum\":[\"alpha\","
    "\"beta\"]}},"
    "\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"ok\"]}";

static void test_mask_equals_brute_force(void **st) {
    (void)st;
    static const char *const prefixes[] = {
        "",
        "{",
        "{\"",
        "{\"na",
        "{\"name\"",
        "{\"name\":",
        "{\"name\": ",
        "{\"name\":\"ab",
        "{\"name\":\"\xc3",
        "{\"name\":\"abcde",
        "{\"name\":\"a\\",
        "{\"name\":\"a\\u0",
        "{\"name\":\"a\",",
        "{\"name\":\"a\",\"age\":1",
        "{\"name\":\"a\",\"age\":15",
        "{\"name\":\"a\",\"tags\":[",
        "{\"name\":\"a\",\"tags\":[\"al",
        "{\"name\":\"a\",\"ok\":t",
        "{\"name\":\"a\",\"ok\":true",
        "{\"name\":\"a\",\"ok\":true}",
    };
    for (size_t i = 0; i < sizeof prefixes / sizeof *prefixes; i++)
        check_against_brute_force(PERSON, prefixes[i]);
    static const char *const any_prefixes[] = {"",          "{\"k\":",    "{\"k\":\"x",
                                               "{\"k\":[1", "{\"k\":[1,", "{}"};
    for (size_t i = 0; i < sizeof any_prefixes / sizeof *any_prefixes; i++)
        check_against_brute_force(PD_GRAMMAR_JSON_OBJECT, any_prefixes[i]);
    check_against_brute_force("{\"type\":\"number\"}", "12");
    check_against_brute_force("{\"enum\":[\"yes\",\"no\"]}", "\"y");
}

/* Decoding with random logits: the mask applied, a token drawn from the
 * allowed ones (softmax of random logits), until EOS; the text must parse
 * and validate, every time. */
static void test_random_decoding_validates(void **st) {
    (void)st;
    static const char *const schemas[] = {
        PD_GRAMMAR_JSON_OBJECT,
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":5},"
        "\"age\":{\"type\":\"integer\"},\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\","
        "\"ok\"]}",
        "{\"type\":\"array\",\"items\":{\"enum\":[\"alpha\",\"beta\",7]},\"minItems\":2,"
        "\"maxItems\":3}",
        "{\"anyOf\":[{\"type\":\"string\",\"maxLength\":10},{\"type\":\"null\"}]}",
    };
    float *logits = malloc(VOCAB * sizeof *logits);
    uint64_t rng = 1234;
    int32_t ids[512];
    for (size_t si = 0; si < sizeof schemas / sizeof *schemas; si++) {
        pd_grammar *g = gt_compile(schemas[si]);
        json_t *schema = json_loads(schemas[si], 0, NULL);
        for (int trial = 0; trial < 10; trial++) {
            pd_grammar_state *s = NULL;
            pd_grammar_state_init(g, vocab, &s, NULL);
            int n = 0;
            for (;;) {
                if (n == 500)
                    fail_msg("schema %zu: no EOS after 500 tokens", si);
                /* random logits; after 40 tokens EOS and closing bytes are
                 * favoured as a model would be, so that walks end */
                for (int i = 0; i < VOCAB; i++)
                    logits[i] = (float)(gt_rand(&rng) % 1000) / 100.0f;
                if (n > 40) {
                    logits[EOS] += 20.0f;
                    for (const char *c = "\"]}"; *c; c++) {
                        char t[2] = {*c, 0};
                        int32_t id = pd_tok_find(tok, t);
                        if (id >= 0)
                            logits[id] += 20.0f;
                    }
                }
                int allowed = pd_grammar_state_mask_logits(s, logits, -1);
                assert_true(allowed > 0);
                int32_t best = -1;
                for (int i = 0; i < VOCAB; i++)
                    if (logits[i] != -INFINITY && (best < 0 || logits[i] > logits[best]))
                        best = i;
                assert_true(best >= 0);
                assert_true(pd_grammar_state_accept_token(s, best));
                if (best == EOS)
                    break;
                ids[n++] = best;
            }
            char *text = NULL;
            size_t len = 0;
            assert_int_equal(pd_tok_decode(tok, ids, (size_t)n, false, &text, &len, NULL), PD_OK);
            json_error_t je;
            json_t *v = json_loadb(text, len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
            if (!v || !gt_valid(v, schema))
                fail_msg("schema %zu: %s (%s)", si, text, v ? "invalid" : je.text);
            json_decref(v);
            free(text);
            pd_grammar_state_free(&s);
        }
        json_decref(schema);
        pd_grammar_free(&g);
    }
    free(logits);
}

/* With a token budget, decoding under random logits (no bias to close)
 * ends complete within max_tokens whenever max_tokens can hold the
 * shortest value; and with a budget too small, the mask still allows
 * something (the limit is dropped). */
static void test_budget_forces_completion(void **st) {
    (void)st;
    static const char *const schemas[] = {
        PD_GRAMMAR_JSON_OBJECT,
        PERSON,
        "{\"type\":\"array\",\"items\":{\"type\":\"string\",\"minLength\":3},\"minItems\":2}",
        "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\",\"items\":{\"type\":"
        "\"object\","
        "\"properties\":{\"x\":{\"type\":\"number\"}},\"required\":[\"x\"]}}},\"required\":[\"a\"]"
        "}",
    };
    float *logits = malloc(VOCAB * sizeof *logits);
    uint64_t rng = 99;
    int32_t ids[256];
    for (size_t si = 0; si < sizeof schemas / sizeof *schemas; si++) {
        pd_grammar *g = gt_compile(schemas[si]);
        json_t *schema = json_loads(schemas[si], 0, NULL);
        int shortest = (int)g->root->min_bytes;
        for (int max_tokens = shortest; max_tokens < shortest + 40; max_tokens += 3) {
            pd_grammar_state *s = NULL;
            pd_grammar_state_init(g, vocab, &s, NULL);
            int n = 0;
            bool eos = false;
            while (n < max_tokens) {
                for (int i = 0; i < VOCAB; i++)
                    logits[i] = (float)(gt_rand(&rng) % 1000) / 100.0f;
                assert_true(pd_grammar_state_mask_logits(s, logits, max_tokens - n) > 0);
                int32_t best = 0;
                for (int i = 1; i < VOCAB; i++)
                    if (logits[i] > logits[best])
                        best = i;
                assert_true(pd_grammar_state_accept_token(s, best));
                if (best == EOS) {
                    eos = true;
                    break;
                }
                ids[n++] = best;
                if (pd_grammar_state_is_terminal(s))
                    break;
            }
            if (!eos && !pd_grammar_state_is_complete(s))
                fail_msg("schema %zu max_tokens %d: incomplete after %d tokens", si, max_tokens, n);
            char *text = NULL;
            size_t len = 0;
            pd_tok_decode(tok, ids, (size_t)n, false, &text, &len, NULL);
            json_t *v = json_loadb(text, len, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
            if (!v || !gt_valid(v, schema))
                fail_msg("schema %zu max_tokens %d: %s", si, max_tokens, text);
            json_decref(v);
            free(text);
            pd_grammar_state_free(&s);
        }
        /* a budget of one token for a value of more bytes: no dead end */
        pd_grammar_state *s = NULL;
        pd_grammar_state_init(g, vocab, &s, NULL);
        memset(logits, 0, VOCAB * sizeof *logits);
        assert_true(pd_grammar_state_mask_logits(s, logits, 1) > 0);
        pd_grammar_state_free(&s);
        json_decref(schema);
        pd_grammar_free(&g);
    }
    free(logits);
}

/* Time of one mask on the full vocabulary, by kind of state (median of 50). */
static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void test_mask_time(void **st) {
    (void)st;
    static const struct {
        const char *what, *schema, *prefix;
        int64_t left; /* tokens_left: -1 none */
    } cases[] = {
        {"start of an object", PERSON, "", -1},
        {"in a key", PERSON, "{\"na", -1},
        {"in a string (maxLength 5)", PERSON, "{\"name\":\"ab", -1},
        {"in a string (json_object)", PD_GRAMMAR_JSON_OBJECT, "{\"k\":\"x", -1},
        {"in a string, 100 tokens left", PD_GRAMMAR_JSON_OBJECT, "{\"k\":\"x", 100},
        {"in a string, 3 tokens left", PD_GRAMMAR_JSON_OBJECT, "{\"k\":\"x", 3},
        {"after a value (json_object)", PD_GRAMMAR_JSON_OBJECT, "{\"k\":1", -1},
        {"after a value, 100 tokens left", PD_GRAMMAR_JSON_OBJECT, "{\"k\":1", 100},
        {"in a number", PERSON, "{\"name\":\"a\",\"age\":1", -1},
    };
    float *logits = malloc(VOCAB * sizeof *logits);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        pd_grammar *g = gt_compile(cases[i].schema);
        pd_grammar_state *s = state_at(g, cases[i].prefix);
        double t[50];
        int n = 0;
        for (int r = 0; r < 50; r++) {
            memset(logits, 0, VOCAB * sizeof *logits);
            double t0 = pd_now_s();
            n = pd_grammar_state_mask_logits(s, logits, cases[i].left);
            t[r] = pd_now_s() - t0;
        }
        qsort(t, 50, sizeof *t, cmp_d);
        printf("mask %-30s %7.1f us (median of 50), %6d tokens allowed\n", cases[i].what,
               t[25] * 1e6, n);
        pd_grammar_state_free(&s);
        pd_grammar_free(&g);
    }
    free(logits);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mask_equals_brute_force),
        cmocka_unit_test(test_random_decoding_validates),
        cmocka_unit_test(test_budget_forces_completion),
        cmocka_unit_test(test_mask_time),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

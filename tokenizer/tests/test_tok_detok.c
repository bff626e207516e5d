/* Tests of the incremental detokenizer (pd_detok_*).
 *
 * Properties, for every corpus case and for random id sequences (which
 * split characters and produce ill-formed bytes on purpose):
 *   - every output of push/flush is well-formed UTF-8 (checked by the
 *     test's own validator);
 *   - the concatenation of all outputs equals pd_tok_decode of all ids, with
 *     the same skip_special.
 * Plus hand-checked cases from the UTF-8 definition: a 4-byte emoji fed one
 * byte token at a time appears only with its last byte; a truncated
 * sequence followed by ASCII becomes one U+FFFD (Unicode §3.9 maximal
 * subpart).
 */
#include "tok_test_util.h"

typedef struct {
    pd_tokenizer *t;
    tt_corpus corp;
    int32_t byte_tok[256]; /* the vocab id standing for each single byte */
} state_t;

static int setup(void **st) {
    state_t *s = calloc(1, sizeof *s);
    s->t = tt_load_tokenizer();
    tt_corpus_load(&s->corp);
    for (int b = 0; b < 256; b++)
        s->byte_tok[b] = -1;
    for (int32_t id = 0; id < pd_tok_vocab_size(s->t); id++) {
        size_t n;
        const char *b = pd_tok_token_bytes(s->t, id, &n);
        if (b && n == 1 && strlen(pd_tok_token_text(s->t, id)) <= 2)
            s->byte_tok[(uint8_t)b[0]] = id;
    }
    *st = s;
    return 0;
}

static int teardown(void **st) {
    state_t *s = *st;
    pd_tok_free(&s->t);
    tt_corpus_free(&s->corp);
    free(s);
    return 0;
}

/* Streams ids through a detokenizer and checks both properties. */
static void check_stream(const pd_tokenizer *t, const int32_t *ids, size_t n, bool skip,
                         const char *what) {
    char *want;
    size_t want_len;
    pd_err err;
    assert_int_equal(pd_tok_decode(t, ids, n, skip, &want, &want_len, &err), PD_OK);
    pd_detok *d = pd_detok_new(t, skip);
    assert_non_null(d);
    size_t cap = want_len + 64, len = 0;
    char *got = malloc(cap);
    for (size_t i = 0; i <= n; i++) {
        const char *out;
        size_t olen;
        if (i < n)
            pd_detok_push(d, ids[i], &out, &olen);
        else
            pd_detok_flush(d, &out, &olen);
        if (!tt_utf8_ok(out, olen))
            fail_msg("%s: output %zu is not well-formed UTF-8", what, i);
        assert_int_equal(out[olen], '\0');
        if (len + olen > cap)
            fail_msg("%s: more output than pd_tok_decode gives", what);
        memcpy(got + len, out, olen);
        len += olen;
    }
    if (len != want_len || memcmp(got, want, len) != 0)
        fail_msg("%s: streamed %zu bytes differ from decode's %zu", what, len, want_len);
    free(got);
    free(want);
    pd_detok_free(&d);
    assert_null(d);
}

static void test_corpus_streams(void **st) {
    state_t *s = *st;
    for (size_t i = 0; i < s->corp.n; i++) {
        const tt_case *c = &s->corp.c[i];
        int32_t *ids;
        size_t n;
        pd_err err;
        assert_int_equal(pd_tok_encode(s->t, c->bytes, c->len, true, &ids, &n, &err), PD_OK);
        check_stream(s->t, ids, n, false, c->name);
        check_stream(s->t, ids, n, true, c->name);
        free(ids);
    }
}

/* Random sequences: vocab ids, single-byte tokens (mostly >= 0x80, the
 * fragments of characters), special tokens and unknown ids. */
static void test_random_streams(void **st) {
    state_t *s = *st;
    pd_rng rng;
    pd_rng_seed(&rng, 1234);
    int32_t eos = pd_tok_find(s->t, PD_TOK_DSV3_EOS);
    int32_t vs = pd_tok_vocab_size(s->t);
    int32_t ids[64];
    for (int rep = 0; rep < 3000; rep++) {
        size_t n = 1 + pd_rng_next(&rng) % 64;
        for (size_t i = 0; i < n; i++) {
            uint64_t r = pd_rng_next(&rng) % 10;
            if (r < 4)
                ids[i] = s->byte_tok[0x80 + pd_rng_next(&rng) % 0x80];
            else if (r < 8)
                ids[i] = (int32_t)(pd_rng_next(&rng) % (uint64_t)vs);
            else if (r < 9)
                ids[i] = eos;
            else
                ids[i] = vs + (int32_t)(pd_rng_next(&rng) % 1000);
        }
        check_stream(s->t, ids, n, rep & 1, "random");
    }
}

static void push_bytes(state_t *s, pd_detok *d, const char *bytes, size_t n, size_t *lens) {
    for (size_t i = 0; i < n; i++) {
        const char *out;
        pd_detok_push(d, s->byte_tok[(uint8_t)bytes[i]], &out, &lens[i]);
    }
}

static void test_split_characters(void **st) {
    state_t *s = *st;
    for (int b = 0; b < 256; b++)
        assert_true(s->byte_tok[b] >= 0);
    pd_detok *d = pd_detok_new(s->t, false);
    const char *out;
    size_t len, lens[4];

    /* U+1F44D THUMBS UP = F0 9F 91 8D: nothing until the last byte */
    push_bytes(s, d, "\xF0\x9F\x91", 3, lens);
    assert_int_equal(lens[0] + lens[1] + lens[2], 0);
    pd_detok_push(d, s->byte_tok[0x8D], &out, &len);
    assert_int_equal(len, 4);
    assert_memory_equal(out, "\xF0\x9F\x91\x8D", 4);

    /* F0 9F then 'a': the maximal subpart F0 9F is one U+FFFD */
    push_bytes(s, d, "\xF0\x9F", 2, lens);
    pd_detok_push(d, s->byte_tok['a'], &out, &len);
    assert_string_equal(out, "\xEF\xBF\xBD"
                             "a");

    /* an incomplete character at the end: flush gives U+FFFD and resets */
    push_bytes(s, d, "\xE4\xBD", 2, lens);
    assert_int_equal(lens[0] + lens[1], 0);
    pd_detok_flush(d, &out, &len);
    assert_string_equal(out, "\xEF\xBF\xBD");
    pd_detok_flush(d, &out, &len);
    assert_int_equal(len, 0);

    /* a ZWJ sequence split over its real tokens streams whole characters */
    const char *fam = "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7";
    int32_t *ids;
    size_t n;
    pd_err err;
    assert_int_equal(pd_tok_encode(s->t, fam, strlen(fam), true, &ids, &n, &err), PD_OK);
    assert_true(n > 1);
    for (size_t i = 0; i < n; i++) {
        pd_detok_push(d, ids[i], &out, &len);
        assert_true(tt_utf8_ok(out, len));
    }
    free(ids);

    /* unknown ids and, with skip_special, special ones produce nothing */
    pd_detok_push(d, -1, &out, &len);
    assert_int_equal(len, 0);
    pd_detok_free(&d);
    d = pd_detok_new(s->t, true);
    pd_detok_push(d, pd_tok_find(s->t, PD_TOK_DSV3_EOS), &out, &len);
    assert_int_equal(len, 0);
    pd_detok_push(d, pd_tok_find(s->t, PD_TOK_DSV3_USER), &out, &len); /* not special */
    assert_string_equal(out, PD_TOK_DSV3_USER);
    pd_detok_free(&d);

    assert_null(pd_detok_new(NULL, false));
    pd_detok_free(NULL);
    pd_detok_free(&d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_corpus_streams),
        cmocka_unit_test(test_random_streams),
        cmocka_unit_test(test_split_characters),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

/* The CPU forward pass against Hugging Face transformers (golden fixtures
 * from tests/reference/make_fixtures.py), and its own properties:
 * prefill-then-decode == recomputing the prefix; chunked == one-shot
 * prefill; absorbed == expanded MLA. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "pd_model.h"
#include "model_test_util.h"

typedef struct {
    mt_fixture f; /* the preset's checkpoint on the CPU backend, and its fixture */
} tctx;

static void sha256_file(const char *path, char hex[65]) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    EVP_DigestInit_ex(c, EVP_sha256(), NULL);
    static unsigned char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        EVP_DigestUpdate(c, buf, n);
    unsigned char md[32];
    unsigned int ml;
    EVP_DigestFinal_ex(c, md, &ml);
    EVP_MD_CTX_free(c);
    fclose(f);
    for (int i = 0; i < 32; i++)
        sprintf(hex + 2 * i, "%02x", md[i]);
}

static int setup(void **state, const char *preset) {
    tctx *t = calloc(1, sizeof *t);
    t->f.preset = preset;
    *state = t;
    if (mt_fixture_prepare(&t->f, preset) != 0)
        return -1;
    pd_err err = {{0}};
    assert_int_equal(pd_backend_cpu_init(0, &t->f.be), PD_OK);
    if (pd_model_load(t->f.dir, t->f.be, &t->f.m, &err) != PD_OK)
        fail_msg("load: %s", err.msg);
    return 0;
}

static int setup_tiny(void **s) { return setup(s, "tiny"); }
static int setup_tiny_v2(void **s) { return setup(s, "tiny-v2"); }

static int teardown(void **state) {
    tctx *t = *state;
    mt_fixture_free(&t->f);
    free(t);
    return 0;
}

/* The fixture must describe the very weights we loaded. */
static void test_same_weights(void **state) {
    tctx *t = *state;
    json_t *sh = json_object_get(t->f.fx, "sha256");
    assert_true(json_object_size(sh) >= 1);
    const char *name;
    json_t *v;
    json_object_foreach(sh, name, v) {
        char path[4400], hex[65];
        snprintf(path, sizeof path, "%s/%s", t->f.dir, name);
        sha256_file(path, hex);
        if (strcmp(hex, json_string_value(v)) != 0)
            fail_msg("%s: sha256 %s differs from the fixture's %s (mkmodel output changed?)", path, hex,
                     json_string_value(v));
    }
}

/* Our YaRN frequencies and scales against the reference module's. */
static void test_rope_tables(void **state) {
    tctx *t = *state;
    const pd_model_config *c = pd_model_config_of(t->f.m);
    json_t *inv = json_object_get(t->f.fx, "inv_freq");
    assert_int_equal((int)json_array_size(inv), c->qk_rope_head_dim / 2);
    /* struct pd_model is private; recompute through the public scale */
    double ref_scale = json_number_value(json_object_get(t->f.fx, "softmax_scaling"));
    assert_true(fabs(pd_config_softmax_scale(c) - ref_scale) <= 1e-6 * ref_scale);
}

typedef struct {
    double max_rel;
} cmp_stats;

/* Compares our logits row against a fixture row summary (mt_row_error):
 * at most 1e-4 of the row's largest magnitude. */
static void cmp_row(const float *lg, int V, json_t *row, json_t *probes, cmp_stats *s, const char *what) {
    double worst = mt_row_error(lg, V, row, probes);
    if (worst > s->max_rel)
        s->max_rel = worst;
    if (!(worst <= 1e-4))
        fail_msg("%s: relative error %.3g > 1e-4", what, worst);
}

/* Prefill each fixture prompt, then decode greedily: logits rows and ids
 * must equal the reference's. */
static void test_logits_and_greedy(void **state) {
    tctx *t = *state;
    const pd_model_config *c = pd_model_config_of(t->f.m);
    int V = c->vocab_size;
    json_t *probes = json_object_get(t->f.fx, "probe_ids");
    json_t *cases = json_object_get(t->f.fx, "cases");
    assert_true(json_array_size(cases) >= 4);
    cmp_stats st = {0};
    pd_err err = {{0}};
    size_t ci;
    json_t *cs;
    json_array_foreach(cases, ci, cs) {
        mt_case fc;
        mt_case_begin(&fc, t->f.m, cs);
        int n = fc.n;
        if (pd_model_forward(t->f.m, fc.kv, &fc.prefill, 1, fc.lg, &err) != PD_OK) fail_msg("%s", err.msg);
        if (fc.prefill.all_logits) {
            for (int i = 0; i < n; i++) {
                char what[64];
                snprintf(what, sizeof what, "prompt %d position %d", n, i);
                cmp_row(fc.lg + (size_t)i * V, V, json_array_get(fc.positions, i), probes, &st, what);
            }
            memmove(fc.lg, fc.lg + (size_t)(n - 1) * V, (size_t)V * sizeof(float));
        }
        for (int s = 0; s < fc.steps; s++) {
            char what[64];
            snprintf(what, sizeof what, "prompt %d step %d", n, s);
            cmp_row(fc.lg, V, json_array_get(fc.rows, s), probes, &st, what);
            /* our greedy id is the reference's, and it is fed back */
            assert_int_equal(mt_argmax(fc.lg, V), fc.ids[n + s]);
            if (s + 1 == fc.steps) break;
            pd_batch_seq d = mt_case_step(&fc, s);
            if (pd_model_forward(t->f.m, fc.kv, &d, 1, fc.lg, &err) != PD_OK) fail_msg("%s", err.msg);
        }
        mt_case_end(&fc);
    }
    print_message("[ %s ] max relative error vs transformers: %.3g\n", t->f.preset, st.max_rel);
}

/* logits of the last token after a chunked prefill with chunk size `chunk`
 * (chunk >= n: one shot); decode_tail: feed the last `tail` tokens one by one. */
static void run_prefill(pd_model *m, const int32_t *ids, int n, int chunk, int block, float *out) {
    pd_err err = {{0}};
    pd_kv_cache *kv;
    assert_int_equal(pd_kv_cache_init(m, block, n / block + 2, &kv, &err), PD_OK);
    pd_seq_kv seq = {0};
    int V = pd_model_config_of(m)->vocab_size;
    float *lg = malloc((size_t)V * sizeof(float));
    for (int done = 0; done < n;) {
        int k = n - done < chunk ? n - done : chunk;
        assert_int_equal(pd_seq_kv_reserve(kv, &seq, k), PD_OK);
        pd_batch_seq b = {.kv = &seq, .tokens = ids + done, .n_tokens = k};
        if (pd_model_forward(m, kv, &b, 1, lg, &err) != PD_OK) fail_msg("%s", err.msg);
        done += k;
    }
    memcpy(out, lg, (size_t)V * sizeof(float));
    free(lg);
    pd_seq_kv_release(kv, &seq);
    free(seq.block_table);
    pd_kv_cache_free(&kv);
}

static double max_rel_diff(const float *a, const float *b, int n) {
    double mx = 0, d = 0;
    for (int i = 0; i < n; i++) {
        mx = fmax(mx, fabs(b[i]));
        d = fmax(d, fabs(a[i] - b[i]));
    }
    return d / mx;
}

/* Chunked prefill (chunk sizes 1 = all decode steps through the absorbed
 * path, 3, 16, 40) and several block sizes equal one-shot prefill. */
static void test_chunked_equals_oneshot(void **state) {
    tctx *t = *state;
    int V = pd_model_config_of(t->f.m)->vocab_size;
    int n = 50;
    int32_t ids[50];
    pd_rng r;
    pd_rng_seed(&r, 7);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(pd_rng_next(&r) % 128000);
    float *ref = malloc((size_t)V * sizeof(float)), *got = malloc((size_t)V * sizeof(float));
    run_prefill(t->f.m, ids, n, n, 16, ref);
    int chunks[] = {1, 3, 16, 40};
    int blocks[] = {1, 5, 16, 64};
    for (int i = 0; i < 4; i++) {
        run_prefill(t->f.m, ids, n, chunks[i], blocks[i], got);
        double e = max_rel_diff(got, ref, V);
        if (e > 1e-5) fail_msg("chunk %d block %d: relative difference %.3g", chunks[i], blocks[i], e);
        assert_int_equal(mt_argmax(got, V), mt_argmax(ref, V));
    }
    free(ref);
    free(got);
}

/* Two sequences batched in one step give the same logits as each alone. */
static void test_batch_equals_single(void **state) {
    tctx *t = *state;
    int V = pd_model_config_of(t->f.m)->vocab_size;
    int32_t a[9] = {5, 900, 31, 44, 12000, 7, 8, 99, 1000}, bq[4] = {77, 78, 79, 80};
    float *ra = malloc((size_t)V * sizeof(float)), *rb = malloc((size_t)V * sizeof(float));
    run_prefill(t->f.m, a, 9, 9, 4, ra);
    run_prefill(t->f.m, bq, 4, 4, 4, rb);
    pd_err err = {{0}};
    pd_kv_cache *kv;
    assert_int_equal(pd_kv_cache_init(t->f.m, 4, 8, &kv, &err), PD_OK);
    pd_seq_kv sa = {0}, sb = {0};
    /* a: 8 tokens first, then its last token as a decode step batched with b's prefill */
    float *lg = malloc((size_t)2 * V * sizeof(float));
    assert_int_equal(pd_seq_kv_reserve(kv, &sa, 8), PD_OK);
    pd_batch_seq p = {.kv = &sa, .tokens = a, .n_tokens = 8};
    assert_int_equal(pd_model_forward(t->f.m, kv, &p, 1, lg, &err), PD_OK);
    assert_int_equal(pd_seq_kv_reserve(kv, &sa, 1), PD_OK);
    assert_int_equal(pd_seq_kv_reserve(kv, &sb, 4), PD_OK);
    pd_batch_seq two[2] = {{.kv = &sa, .tokens = a + 8, .n_tokens = 1}, {.kv = &sb, .tokens = bq, .n_tokens = 4}};
    assert_int_equal(pd_model_forward(t->f.m, kv, two, 2, lg, &err), PD_OK);
    assert_true(max_rel_diff(lg, ra, V) < 1e-5);
    assert_true(max_rel_diff(lg + V, rb, V) < 1e-5);
    /* out of blocks: reserve refuses and keeps nothing */
    pd_seq_kv sc = {0};
    int before = pd_kv_cache_num_free(kv);
    assert_int_equal(pd_seq_kv_reserve(kv, &sc, 1000), PD_ERR_LIMIT);
    assert_int_equal(pd_kv_cache_num_free(kv), before);
    pd_seq_kv_release(kv, &sa);
    pd_seq_kv_release(kv, &sb);
    assert_int_equal(pd_kv_cache_num_free(kv), 8);
    free(sa.block_table);
    free(sb.block_table);
    free(sc.block_table);
    pd_kv_cache_free(&kv);
    free(lg);
    free(ra);
    free(rb);
}

/* Bad input to forward is an error, not a crash. */
static void test_forward_rejects(void **state) {
    tctx *t = *state;
    pd_err err = {{0}};
    pd_kv_cache *kv;
    assert_int_equal(pd_kv_cache_init(t->f.m, 4, 2, &kv, &err), PD_OK);
    pd_seq_kv s = {0};
    int V = pd_model_config_of(t->f.m)->vocab_size;
    float *lg = malloc((size_t)V * sizeof(float));
    int32_t bad[1] = {V};
    assert_int_equal(pd_seq_kv_reserve(kv, &s, 1), PD_OK);
    pd_batch_seq b = {.kv = &s, .tokens = bad, .n_tokens = 1};
    assert_int_equal(pd_model_forward(t->f.m, kv, &b, 1, lg, &err), PD_ERR_INVALID);
    assert_non_null(strstr(err.msg, "outside the vocabulary"));
    int32_t ok[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    pd_batch_seq c = {.kv = &s, .tokens = ok, .n_tokens = 8}; /* only 1 block (4 tokens) reserved */
    assert_int_equal(pd_model_forward(t->f.m, kv, &c, 1, lg, &err), PD_ERR_INVALID);
    pd_seq_kv_release(kv, &s);
    free(s.block_table);
    free(lg);
    pd_kv_cache_free(&kv);
}

int main(void) {
    const struct CMUnitTest tiny[] = {
        cmocka_unit_test(test_same_weights),         cmocka_unit_test(test_rope_tables),
        cmocka_unit_test(test_logits_and_greedy),    cmocka_unit_test(test_chunked_equals_oneshot),
        cmocka_unit_test(test_batch_equals_single),  cmocka_unit_test(test_forward_rejects),
    };
    const struct CMUnitTest v2[] = {
        cmocka_unit_test(test_same_weights),
        cmocka_unit_test(test_rope_tables),
        cmocka_unit_test(test_logits_and_greedy),
        cmocka_unit_test(test_chunked_equals_oneshot),
    };
    int rc = cmocka_run_group_tests_name("tiny", tiny, setup_tiny, teardown);
    rc |= cmocka_run_group_tests_name("tiny-v2", v2, setup_tiny_v2, teardown);
    return rc;
}

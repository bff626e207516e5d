/* The whole model on the CUDA backend against Hugging Face transformers:
 * the golden fixtures of tests/reference/fixtures/model_<preset>.json (made
 * by tests/reference/make_fixtures.py) and the comparison of
 * model/tests/model_test_util.h, for tiny and tiny-v2, with fp32 weights
 * (tolerance 1e-4, greedy ids identical) and bf16 weights (tolerance 5e-2;
 * greedy mismatches are counted and printed, decode is fed the reference's
 * ids so that one near-tie does not change every later row). Also chunked
 * prefill (chunk 1 = every token through the absorbed decode kernel) equals
 * one-shot prefill on the GPU. Skipped when no GPU is usable. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "pd_model.h"
#include "../../../model/tests/model_test_util.h"
#ifdef PD_HAVE_CUDA
#include "cuda/pd_cuda.h"
#endif

typedef struct {
    mt_fixture f; /* the preset's checkpoint on the CUDA backend, and its fixture */
    int wfmt;     /* pd_cuda_weights */
    double tol;
    char skip[600];
} tctx;

static int setup(void **state, const char *preset, int wfmt, double tol) {
    tctx *t = calloc(1, sizeof *t);
    t->f.preset = preset;
    t->wfmt = wfmt;
    t->tol = tol;
    *state = t;
#ifndef PD_HAVE_CUDA
    snprintf(t->skip, sizeof t->skip, "this build has no CUDA backend (nvcc not found)");
#else
    pd_err err = {{0}};
    if (pd_backend_cuda_init_ex(0, (pd_cuda_weights)wfmt, &t->f.be, &err) != PD_OK)
        snprintf(t->skip, sizeof t->skip, "no usable GPU: %s", err.msg);
#endif
    if (t->skip[0]) {
        print_message("[ %s %s ] skipped: %s\n", preset, wfmt ? "f32" : "bf16", t->skip);
        return 0;
    }
    if (mt_fixture_prepare(&t->f, preset) != 0)
        return -1;
    pd_err err2 = {{0}};
    if (pd_model_load(t->f.dir, t->f.be, &t->f.m, &err2) != PD_OK) {
        print_error("load %s: %s\n", t->f.dir, err2.msg);
        return -1;
    }
    return 0;
}

static int setup_tiny_f32(void **s) { return setup(s, "tiny", 1, 1e-4); }
static int setup_tiny_bf16(void **s) { return setup(s, "tiny", 0, 5e-2); }
static int setup_v2_f32(void **s) { return setup(s, "tiny-v2", 1, 1e-4); }
static int setup_v2_bf16(void **s) { return setup(s, "tiny-v2", 0, 5e-2); }

static int teardown(void **state) {
    tctx *t = *state;
    mt_fixture_free(&t->f);
    free(t);
    return 0;
}

static void backend_ok(tctx *t) {
#ifdef PD_HAVE_CUDA
    pd_err err = {{0}};
    if (pd_backend_cuda_status(t->f.be, &err) != PD_OK)
        fail_msg("CUDA backend: %s", err.msg);
#endif
}

/* Runs forward over n_seqs sequences; lg (host) gets the logits rows. */
static void forward_n(tctx *t, pd_kv_cache *kv, pd_batch_seq *b, int n_seqs, float *lg) {
    pd_err err = {{0}};
    if (pd_model_forward(t->f.m, kv, b, n_seqs, lg, &err) != PD_OK)
        fail_msg("forward: %s", err.msg);
    backend_ok(t);
}

static void forward(tctx *t, pd_kv_cache *kv, pd_batch_seq *b, int n_rows, float *lg) {
    (void)n_rows;
    forward_n(t, kv, b, 1, lg);
}

static void test_logits_and_greedy(void **state) {
    tctx *t = *state;
    if (t->skip[0])
        skip();
    int V = pd_model_config_of(t->f.m)->vocab_size;
    json_t *probes = json_object_get(t->f.fx, "probe_ids"), *cases = json_object_get(t->f.fx, "cases");
    assert_true(json_array_size(cases) >= 4);
    double max_rel = 0;
    int mismatches = 0, steps_total = 0, over = 0;
    size_t ci;
    json_t *cs;
    json_array_foreach(cases, ci, cs) {
        mt_case c;
        mt_case_begin(&c, t->f.m, cs);
        int n = c.n;
        const int32_t *ids = c.ids;
        forward(t, c.kv, &c.prefill, c.prefill.all_logits ? n : 1, c.lg);
        if (c.prefill.all_logits) {
            for (int i = 0; i < n; i++) {
                double e = mt_row_error(c.lg + (size_t)i * V, V, json_array_get(c.positions, i), probes);
                max_rel = fmax(max_rel, e);
                if (!(e <= t->tol)) {
                    print_error("prompt %d position %d: relative error %.3g > %.3g\n", n, i, e, t->tol);
                    over++;
                }
            }
            memmove(c.lg, c.lg + (size_t)(n - 1) * V, (size_t)V * sizeof(float));
        }
        for (int s = 0; s < c.steps; s++) {
            double e = mt_row_error(c.lg, V, json_array_get(c.rows, s), probes);
            max_rel = fmax(max_rel, e);
            if (!(e <= t->tol)) {
                print_error("prompt %d step %d: relative error %.3g > %.3g\n", n, s, e, t->tol);
                over++;
            }
            steps_total++;
            if (mt_argmax(c.lg, V) != ids[n + s]) {
                mismatches++;
                print_message("prompt %d step %d: greedy id %d, reference %d\n", n, s, mt_argmax(c.lg, V), ids[n + s]);
            }
            if (s + 1 == c.steps) break;
            pd_batch_seq d = mt_case_step(&c, s);
            forward(t, c.kv, &d, 1, c.lg); /* the reference's id, so that a near tie does not change later rows */
        }
        mt_case_end(&c);
    }
    print_message("[ %s %s ] max relative error vs transformers: %.3g (tolerance %.0e); greedy ids differing: %d of %d\n",
                  t->f.preset, t->wfmt ? "f32" : "bf16", max_rel, t->tol, mismatches, steps_total);
    if (over)
        fail_msg("%d rows over tolerance", over);
    if (t->wfmt == 1)
        assert_int_equal(mismatches, 0);
}

/* Last-token logits after prefilling n tokens in chunks of `chunk` with KV blocks of `block`. */
static void run_prefill(tctx *t, const int32_t *ids, int n, int chunk, int block, float *out) {
    pd_err err = {{0}};
    pd_kv_cache *kv;
    assert_int_equal(pd_kv_cache_init(t->f.m, block, n / block + 2, &kv, &err), PD_OK);
    pd_seq_kv seq = {0};
    for (int done = 0; done < n;) {
        int k = n - done < chunk ? n - done : chunk;
        assert_int_equal(pd_seq_kv_reserve(kv, &seq, k), PD_OK);
        pd_batch_seq b = {.kv = &seq, .tokens = ids + done, .n_tokens = k};
        forward(t, kv, &b, 1, out);
        done += k;
    }
    pd_seq_kv_release(kv, &seq);
    free(seq.block_table);
    pd_kv_cache_free(&kv);
}

static void test_chunked_equals_oneshot(void **state) {
    tctx *t = *state;
    if (t->skip[0])
        skip();
    int V = pd_model_config_of(t->f.m)->vocab_size, n = 50;
    int32_t ids[50];
    pd_rng r;
    pd_rng_seed(&r, 7);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(pd_rng_next(&r) % 128000);
    float *ref = malloc((size_t)V * sizeof(float)), *got = malloc((size_t)V * sizeof(float));
    run_prefill(t, ids, n, n, 16, ref);
    int chunks[] = {1, 3, 16, 40}, blocks[] = {1, 5, 16, 64};
    double tol = t->wfmt == 1 ? 1e-5 : 5e-2;
    for (int i = 0; i < 4; i++) {
        run_prefill(t, ids, n, chunks[i], blocks[i], got);
        double mx = 0, d = 0;
        for (int k = 0; k < V; k++) {
            mx = fmax(mx, fabs(ref[k]));
            d = fmax(d, fabs((double)got[k] - ref[k]));
        }
        print_message("[ %s %s ] chunk %d block %d vs one-shot: %.3g\n", t->f.preset, t->wfmt ? "f32" : "bf16",
                      chunks[i], blocks[i], d / mx);
        if (!(d / mx <= tol))
            fail_msg("chunk %d block %d: relative difference %.3g > %.0e", chunks[i], blocks[i], d / mx, tol);
    }
    free(ref);
    free(got);
}

/* Sequences decoded together (one step of every sequence, steps after the
 * first replayed from a recorded graph) give each sequence's logits alone,
 * also when the batch shrinks and grows again and when a prefill chunk
 * joins a step. fp32 weights: every row within 1e-5. bf16 weights: a batch
 * of more than 4 rows rounds its activations to bf16 for cuBLASLt while a
 * sequence alone keeps them fp32 (the skinny GEMM): every row within 5e-2
 * (worst seen 0.00144; with PD_CUDA_SKINNY=0 both take cuBLASLt and the rows
 * are identical). An expert choice flipped by that rounding on a near tie
 * would change a row completely and fail this. (Every row of tiny or
 * tiny-v2 in bf16 failed here from session 1 to 4, which was taken for such
 * ties; it was a decode graph recorded in an earlier test over a cache of
 * another block size, replayed over this test's cache when cudaMalloc gave
 * it the same address: graphs now also check the cache's id.
 * PD_TEST_VERBOSE=1 prints every row's error.) */
static void test_batched_decode(void **state) {
    tctx *t = *state;
    if (t->skip[0])
        skip();
    enum { NS = 4, STEPS = 6 };
    int V = pd_model_config_of(t->f.m)->vocab_size;
    static const int plen[NS] = {5, 23, 1, 40};
    int32_t ids[NS][64];
    pd_rng r;
    pd_rng_seed(&r, 11);
    for (int i = 0; i < NS; i++)
        for (int k = 0; k < 64; k++)
            ids[i][k] = (int32_t)(pd_rng_next(&r) % 128000);
    pd_err err = {{0}};
    /* alone: prefill, then STEPS decode steps, every step's logits kept */
    float *alone = malloc((size_t)NS * STEPS * V * sizeof(float)), *lg = malloc((size_t)NS * V * sizeof(float));
    for (int i = 0; i < NS; i++) {
        pd_kv_cache *kv;
        assert_int_equal(pd_kv_cache_init(t->f.m, 4, 40, &kv, &err), PD_OK);
        pd_seq_kv seq = {0};
        assert_int_equal(pd_seq_kv_reserve(kv, &seq, plen[i]), PD_OK);
        pd_batch_seq b = {.kv = &seq, .tokens = ids[i], .n_tokens = plen[i]};
        forward(t, kv, &b, 1, lg);
        for (int s = 0; s < STEPS; s++) {
            assert_int_equal(pd_seq_kv_reserve(kv, &seq, 1), PD_OK);
            pd_batch_seq d = {.kv = &seq, .tokens = &ids[i][plen[i] + s], .n_tokens = 1};
            forward(t, kv, &d, 1, alone + ((size_t)i * STEPS + s) * V);
        }
        pd_seq_kv_release(kv, &seq);
        free(seq.block_table);
        pd_kv_cache_free(&kv);
    }
    /* together, in one cache: sequence 3's prefill joins step 0; step 3
     * leaves sequence 1 out (it runs alone after it) */
    pd_kv_cache *kv;
    assert_int_equal(pd_kv_cache_init(t->f.m, 4, 160, &kv, &err), PD_OK);
    pd_seq_kv seq[NS] = {{0}};
    for (int i = 0; i < NS - 1; i++) {
        assert_int_equal(pd_seq_kv_reserve(kv, &seq[i], plen[i]), PD_OK);
        pd_batch_seq b = {.kv = &seq[i], .tokens = ids[i], .n_tokens = plen[i]};
        forward(t, kv, &b, 1, lg);
    }
    int done[NS] = {0}, n_rows = 0, n_over = 0;
    double worst = 0, tol = t->wfmt == 1 ? 1e-5 : 5e-2;
    for (int s = 0; s < STEPS + 1; s++) {
        pd_batch_seq b[NS];
        int who[NS], n = 0;
        for (int i = 0; i < NS; i++) {
            if (done[i] >= STEPS || (s == 3 && i == 1))
                continue;
            if (i == NS - 1 && s == 0) { /* prefill chunk in a decode step */
                assert_int_equal(pd_seq_kv_reserve(kv, &seq[i], plen[i]), PD_OK);
                b[n] = (pd_batch_seq){.kv = &seq[i], .tokens = ids[i], .n_tokens = plen[i]};
                who[n++] = -1;
                continue;
            }
            assert_int_equal(pd_seq_kv_reserve(kv, &seq[i], 1), PD_OK);
            b[n] = (pd_batch_seq){.kv = &seq[i], .tokens = &ids[i][plen[i] + done[i]], .n_tokens = 1};
            who[n++] = i;
        }
        if (!n)
            break;
        forward_n(t, kv, b, n, lg);
        for (int k = 0; k < n; k++) {
            int i = who[k];
            if (i < 0)
                continue;
            const float *ref = alone + ((size_t)i * STEPS + done[i]) * V, *got = lg + (size_t)k * V;
            double mx = 0, d = 0;
            for (int v = 0; v < V; v++) {
                mx = fmax(mx, fabs(ref[v]));
                d = fmax(d, isfinite(got[v]) ? fabs((double)got[v] - ref[v]) : INFINITY);
            }
            worst = fmax(worst, d / mx);
            n_rows++;
            n_over += !(d / mx <= tol);
            if (getenv("PD_TEST_VERBOSE"))
                print_message("[ %s ] batched decode step %d (%d rows): sequence %d row %d: %.3g\n", t->f.preset, s, n,
                              i, done[i], d / mx);
            done[i]++;
        }
    }
    for (int i = 0; i < NS; i++) {
        /* sequence 1 missed a step: finish it alone */
        while (done[i] < STEPS) {
            assert_int_equal(pd_seq_kv_reserve(kv, &seq[i], 1), PD_OK);
            pd_batch_seq d = {.kv = &seq[i], .tokens = &ids[i][plen[i] + done[i]], .n_tokens = 1};
            forward(t, kv, &d, 1, lg);
            const float *ref = alone + ((size_t)i * STEPS + done[i]) * V;
            double mx = 0, dd = 0;
            for (int v = 0; v < V; v++) {
                mx = fmax(mx, fabs(ref[v]));
                dd = fmax(dd, fabs((double)lg[v] - ref[v]));
            }
            worst = fmax(worst, dd / mx);
            n_rows++;
            n_over += !(dd / mx <= tol);
            done[i]++;
        }
        pd_seq_kv_release(kv, &seq[i]);
        free(seq[i].block_table);
    }
    pd_kv_cache_free(&kv);
    print_message("[ %s %s ] batched decode vs alone: worst %.3g; %d of %d rows over %.0e\n", t->f.preset,
                  t->wfmt ? "f32" : "bf16", worst, n_over, n_rows, tol);
    free(alone);
    free(lg);
    if (n_over > 0 || !isfinite(worst))
        fail_msg("batched decode differs from decoding alone: %d of %d rows over %.0e (worst %.3g)", n_over, n_rows,
                 tol, worst);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_logits_and_greedy),
        cmocka_unit_test(test_chunked_equals_oneshot),
        cmocka_unit_test(test_batched_decode),
    };
    int rc = cmocka_run_group_tests_name("tiny f32", tests, setup_tiny_f32, teardown);
    rc |= cmocka_run_group_tests_name("tiny bf16", tests, setup_tiny_bf16, teardown);
    rc |= cmocka_run_group_tests_name("tiny-v2 f32", tests, setup_v2_f32, teardown);
    rc |= cmocka_run_group_tests_name("tiny-v2 bf16", tests, setup_v2_bf16, teardown);
    return rc;
}

/* Sampler: greedy, reproducibility, the drawn distribution against
 * softmax(logits / T) (chi-square), each filter's support against a set
 * computed here in double, penalties against their formulas, logprobs
 * against an independent log-softmax. Fixed seeds throughout, so every
 * statistical check is deterministic. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_model.h"

#define VOCAB_V3 129280 /* DeepSeek-V3 vocab_size */

static pd_sampler *sampler_new(const pd_sampling_params *p, int vocab, const int32_t *prompt,
                               int n_prompt) {
    pd_sampler *s = NULL;
    pd_err err;
    pd_status rc = pd_sampler_init(p, vocab, prompt, n_prompt, &s, &err);
    if (rc != PD_OK)
        fail_msg("pd_sampler_init: %s", err.msg);
    return s;
}

static void random_logits(pd_rng *rng, float *l, int n, double scale) {
    for (int i = 0; i < n; i++)
        l[i] = (float)(scale * pd_rng_normal(rng));
}

/* Independent references, in double. */
static int ref_argmax(const float *l, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if ((double)l[i] > (double)l[best])
            best = i;
    return best;
}

static void ref_softmax(const float *l, int n, double temperature, double *p) {
    double max = -INFINITY, sum = 0.0;
    for (int i = 0; i < n; i++)
        max = fmax(max, l[i] / temperature);
    for (int i = 0; i < n; i++)
        sum += p[i] = exp(l[i] / temperature - max);
    for (int i = 0; i < n; i++)
        p[i] /= sum;
}

static double ref_log_softmax(const float *l, int n, int at) {
    double max = -INFINITY, sum = 0.0;
    for (int i = 0; i < n; i++)
        max = fmax(max, l[i]);
    for (int i = 0; i < n; i++)
        sum += exp(l[i] - max);
    return l[at] - max - log(sum);
}

/* Draws n tokens from fixed logits (restored before every call) into counts. */
static void draw_counts(pd_sampler *s, const float *logits, int vocab, int n, long *counts) {
    float *work = malloc((size_t)vocab * sizeof *work);
    memset(counts, 0, (size_t)vocab * sizeof *counts);
    for (int i = 0; i < n; i++) {
        memcpy(work, logits, (size_t)vocab * sizeof *work);
        int32_t t = pd_sampler_sample(s, work, NULL);
        assert_true(t >= 0 && t < vocab);
        counts[t]++;
    }
    free(work);
}

/* Pearson chi-square of counts against probabilities p over the tokens with
 * p > 0; tokens with p == 0 must never be drawn. *df_p = categories - 1. */
static double chi_square(const long *counts, const double *p, int vocab, long n, int *df_p) {
    double chi2 = 0.0;
    int cats = 0;
    for (int i = 0; i < vocab; i++) {
        if (p[i] == 0.0) {
            assert_int_equal(counts[i], 0);
            continue;
        }
        double e = p[i] * (double)n;
        chi2 += (counts[i] - e) * (counts[i] - e) / e;
        cats++;
    }
    *df_p = cats - 1;
    return chi2;
}

/* Upper 0.1% points of the chi-square distribution, df = 1..11. */
static const double chi2_999[] = {0,     10.83, 13.82, 16.27, 18.47, 20.52,
                                  22.46, 24.32, 26.12, 27.88, 29.59, 31.26};

/* ---- parameters -------------------------------------------------------- */

static void test_defaults(void **state) {
    (void)state;
    pd_sampling_params p = pd_sampling_defaults();
    assert_true(p.temperature == 1.0f);
    assert_true(p.top_k <= 0);
    assert_true(p.top_p == 1.0f);
    assert_true(p.min_p == 0.0f);
    assert_true(p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f);
    assert_true(p.repetition_penalty == 1.0f);
    assert_false(p.has_seed);
    pd_sampler *s = sampler_new(&p, 10, NULL, 0);
    pd_sampler_free(&s);
    assert_null(s);
    pd_sampler_free(&s); /* safe on NULL */
}

static void test_invalid_params(void **state) {
    (void)state;
    struct {
        const char *name;
        pd_sampling_params p;
    } cases[32];
    int n = 0;
#define BAD(field, value)                                                                          \
    do {                                                                                           \
        cases[n].name = #field;                                                                    \
        cases[n].p = pd_sampling_defaults();                                                       \
        cases[n].p.field = (value);                                                                \
        n++;                                                                                       \
    } while (0)
    BAD(temperature, -0.5f);
    BAD(temperature, NAN);
    BAD(temperature, INFINITY);
    BAD(top_p, 0.0f);
    BAD(top_p, -0.1f);
    BAD(top_p, 1.01f);
    BAD(top_p, NAN);
    BAD(min_p, -0.01f);
    BAD(min_p, 1.5f);
    BAD(min_p, NAN);
    BAD(top_k, -2);
    BAD(presence_penalty, 2.01f);
    BAD(presence_penalty, -2.5f);
    BAD(presence_penalty, NAN);
    BAD(frequency_penalty, 3.0f);
    BAD(frequency_penalty, -2.01f);
    BAD(repetition_penalty, 0.0f);
    BAD(repetition_penalty, -1.0f);
    BAD(repetition_penalty, NAN);
    BAD(repetition_penalty, INFINITY);
#undef BAD
    for (int i = 0; i < n; i++) {
        pd_sampler *s = NULL;
        pd_err err = {{0}};
        assert_int_equal(pd_sampler_init(&cases[i].p, 100, NULL, 0, &s, &err), PD_ERR_INVALID);
        assert_null(s);
        if (!strstr(err.msg, cases[i].name))
            fail_msg("\"%s\" not in \"%s\"", cases[i].name, err.msg);
    }

    /* the edges of each range are valid */
    pd_sampling_params p = pd_sampling_defaults();
    p.temperature = 0.0f;
    p.top_p = 1.0f;
    p.min_p = 1.0f;
    p.top_k = 0;
    p.presence_penalty = -2.0f;
    p.frequency_penalty = 2.0f;
    p.repetition_penalty = 1e-3f;
    pd_sampler *s = sampler_new(&p, 100, NULL, 0);
    pd_sampler_free(&s);

    pd_err err = {{0}};
    p = pd_sampling_defaults();
    assert_int_equal(pd_sampler_init(&p, 0, NULL, 0, &s, &err), PD_ERR_INVALID);
    assert_non_null(strstr(err.msg, "vocab_size"));
    int32_t prompt[3] = {1, 100, 2};
    assert_int_equal(pd_sampler_init(&p, 100, prompt, 3, &s, &err), PD_ERR_INVALID);
    assert_non_null(strstr(err.msg, "prompt"));
}

/* ---- greedy and reproducibility ------------------------------------------ */

static void test_greedy_is_argmax(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, 10);
    float *l = malloc(VOCAB_V3 * sizeof *l);
    const float temps[] = {0.0f, 1e-6f};
    for (int ti = 0; ti < 2; ti++) {
        pd_sampling_params p = pd_sampling_defaults();
        p.temperature = temps[ti];
        pd_sampler *s = sampler_new(&p, VOCAB_V3, NULL, 0);
        for (int round = 0; round < 10; round++) {
            random_logits(&rng, l, VOCAB_V3, 4.0);
            int want = ref_argmax(l, VOCAB_V3);
            assert_int_equal(pd_sampler_sample(s, l, NULL), want);
        }
        pd_sampler_free(&s);
    }
    /* ties go to the lowest id; -inf and NaN never win */
    pd_sampling_params p = pd_sampling_defaults();
    p.temperature = 0.0f;
    pd_sampler *s = sampler_new(&p, 8, NULL, 0);
    float tie[8] = {NAN, 1.0f, 3.0f, -INFINITY, 2.0f, 3.0f, NAN, 3.0f};
    assert_int_equal(pd_sampler_sample(s, tie, NULL), 2);
    pd_sampler_free(&s);
    free(l);
}

static void sample_sequence(uint64_t seed, bool has_seed, const float *logits, int vocab, int n,
                            int32_t *out) {
    pd_sampling_params p = pd_sampling_defaults();
    p.seed = seed;
    p.has_seed = has_seed;
    pd_sampler *s = sampler_new(&p, vocab, NULL, 0);
    float *work = malloc((size_t)vocab * sizeof *work);
    for (int i = 0; i < n; i++) {
        memcpy(work, logits, (size_t)vocab * sizeof *work);
        out[i] = pd_sampler_sample(s, work, NULL);
    }
    free(work);
    pd_sampler_free(&s);
}

/* A sampler that skipped one draw (pd_sampler_skip_draw: another replica
 * drew the first token with the same seed) continues as the sampler that
 * drew it: tokens 2.. of one seed are the same on either. */
static void test_skip_draw(void **state) {
    (void)state;
    enum { V = 64, N = 200 };
    float l[V], work[V];
    pd_rng rng;
    pd_rng_seed(&rng, 12);
    random_logits(&rng, l, V, 0.5);
    int32_t whole[N];
    sample_sequence(77, true, l, V, N, whole);
    pd_sampling_params p = pd_sampling_defaults();
    p.seed = 77;
    p.has_seed = true;
    pd_sampler *s = sampler_new(&p, V, NULL, 0);
    pd_sampler_accept(s, whole[0]);
    pd_sampler_skip_draw(s);
    int same = 0;
    for (int i = 1; i < N; i++) {
        memcpy(work, l, sizeof work);
        same += pd_sampler_sample(s, work, NULL) == whole[i];
    }
    assert_int_equal(same, N - 1);
    pd_sampler_free(&s);
}

static void test_seed_reproducible(void **state) {
    (void)state;
    enum { V = 64, N = 2000 };
    float l[V];
    pd_rng rng;
    pd_rng_seed(&rng, 11);
    random_logits(&rng, l, V, 0.5);
    double p[V], collide = 0.0; /* chance two independent draws agree */
    ref_softmax(l, V, 1.0, p);
    for (int i = 0; i < V; i++)
        collide += p[i] * p[i];

    int32_t a[N], b[N], c[N];
    sample_sequence(42, true, l, V, N, a);
    sample_sequence(42, true, l, V, N, b);
    sample_sequence(43, true, l, V, N, c);
    assert_memory_equal(a, b, sizeof a);
    int same = 0;
    for (int i = 0; i < N; i++)
        same += a[i] == c[i];
    /* independent streams agree about collide * N times (~0.03 N here) */
    assert_true(same < 2.0 * collide * N + 20);

    /* unseeded samplers differ from each other */
    sample_sequence(0, false, l, V, N, b);
    sample_sequence(0, false, l, V, N, c);
    same = 0;
    for (int i = 0; i < N; i++)
        same += b[i] == c[i];
    assert_true(same < 2.0 * collide * N + 20);

    /* the same seed gives the same tokens at vocab scale with filters on */
    float *big = malloc(VOCAB_V3 * sizeof *big), *w1 = malloc(VOCAB_V3 * sizeof *w1),
          *w2 = malloc(VOCAB_V3 * sizeof *w2);
    random_logits(&rng, big, VOCAB_V3, 3.0);
    pd_sampling_params sp = pd_sampling_defaults();
    sp.top_p = 0.9f;
    sp.top_k = 1000;
    sp.min_p = 0.01f;
    sp.has_seed = true;
    sp.seed = 7;
    pd_sampler *s1 = sampler_new(&sp, VOCAB_V3, NULL, 0), *s2 = sampler_new(&sp, VOCAB_V3, NULL, 0);
    for (int i = 0; i < 50; i++) {
        memcpy(w1, big, VOCAB_V3 * sizeof *w1);
        memcpy(w2, big, VOCAB_V3 * sizeof *w2);
        assert_int_equal(pd_sampler_sample(s1, w1, NULL), pd_sampler_sample(s2, w2, NULL));
    }
    pd_sampler_free(&s1);
    pd_sampler_free(&s2);
    free(big);
    free(w1);
    free(w2);
}

/* ---- the distribution ------------------------------------------------------ */

enum { SMALL_V = 8, DRAWS = 200000 };
static const float small_logits[SMALL_V] = {1.0f, 0.5f, -0.3f, 2.0f, 0.0f, -1.5f, 1.2f, 0.7f};

static void test_frequencies_match_softmax(void **state) {
    (void)state;
    const float temps[] = {1.0f, 0.6f, 2.5f};
    for (int ti = 0; ti < 3; ti++) {
        pd_sampling_params p = pd_sampling_defaults();
        p.temperature = temps[ti];
        p.has_seed = true;
        p.seed = 100 + ti;
        pd_sampler *s = sampler_new(&p, SMALL_V, NULL, 0);
        long counts[SMALL_V];
        draw_counts(s, small_logits, SMALL_V, DRAWS, counts);
        double probs[SMALL_V];
        ref_softmax(small_logits, SMALL_V, temps[ti], probs);
        int df;
        double chi2 = chi_square(counts, probs, SMALL_V, DRAWS, &df);
        print_message("T=%.1f: chi2 = %.2f (df %d, 0.1%% point %.2f)\n", temps[ti], chi2, df,
                      chi2_999[df]);
        assert_true(chi2 < chi2_999[df]);
        pd_sampler_free(&s);
    }
}

/* The tokens top-k / top-p / min-p keep, by their definitions, in double:
 * rank by probability (ties to the lower id); top-k keeps the k first;
 * top-p the shortest prefix of what is left whose renormalised mass reaches
 * top_p; min-p those with probability >= min_p x the largest. Fails the test
 * when a boundary is within margin of the threshold (the case would then
 * test rounding, not the rule). */
static void ref_keep(const float *l, int n, double temperature, int top_k, double top_p,
                     double min_p, bool *keep) {
    double p[64];
    int order[64];
    assert_true(n <= 64);
    ref_softmax(l, n, temperature, p);
    for (int i = 0; i < n; i++)
        order[i] = i;
    for (int i = 1; i < n; i++) /* insertion sort, descending */
        for (int j = i; j > 0 && (p[order[j]] > p[order[j - 1]]); j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    int kept = top_k > 0 && top_k < n ? top_k : n;
    double mass = 0.0;
    for (int i = 0; i < kept; i++)
        mass += p[order[i]];
    if (top_p < 1.0) {
        double cum = 0.0;
        int c = 0;
        while (c < kept && cum / mass < top_p) {
            cum += p[order[c]];
            c++;
        }
        assert_true(fabs(cum / mass - top_p) > 1e-3);
        if (c > 1)
            assert_true(fabs((cum - p[order[c - 1]]) / mass - top_p) > 1e-3);
        kept = c;
    }
    for (int i = 0; i < n; i++)
        keep[i] = false;
    for (int i = 0; i < kept; i++) {
        double ratio = p[order[i]] / p[order[0]];
        assert_true(min_p == 0.0 || fabs(ratio - min_p) > 1e-3);
        keep[order[i]] = ratio >= min_p;
    }
}

typedef struct {
    float temperature;
    int top_k;
    float top_p, min_p;
} filter_case;

static void test_filters_support_and_frequencies(void **state) {
    (void)state;
    static const filter_case cases[] = {
        {1.0f, 3, 1.0f, 0.0f},   {1.0f, 1, 1.0f, 0.0f},  {1.0f, -1, 0.75f, 0.0f},
        {0.7f, -1, 0.5f, 0.0f},  {1.0f, -1, 1.0f, 0.3f}, {2.0f, -1, 1.0f, 0.5f},
        {1.0f, 5, 0.8f, 0.0f},   {1.0f, 6, 0.9f, 0.2f},  {1.3f, 0, 1e-6f, 0.0f},
        {1.0f, 100, 1.0f, 0.0f}, /* k above the vocabulary: off */
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const filter_case *fc = &cases[ci];
        bool keep[SMALL_V];
        ref_keep(small_logits, SMALL_V, fc->temperature, fc->top_k, fc->top_p, fc->min_p, keep);

        pd_sampling_params p = pd_sampling_defaults();
        p.temperature = fc->temperature;
        p.top_k = fc->top_k;
        p.top_p = fc->top_p;
        p.min_p = fc->min_p;
        p.has_seed = true;
        p.seed = 200 + ci;
        pd_sampler *s = sampler_new(&p, SMALL_V, NULL, 0);

        /* after a call the logits are logit / T on the kept tokens, -inf elsewhere */
        float work[SMALL_V];
        memcpy(work, small_logits, sizeof work);
        pd_sampler_sample(s, work, NULL);
        for (int i = 0; i < SMALL_V; i++) {
            if (keep[i])
                assert_true(work[i] == small_logits[i] / fc->temperature);
            else
                assert_true(work[i] == -INFINITY);
        }

        /* the draws: only kept tokens, at softmax over the kept set */
        long counts[SMALL_V];
        draw_counts(s, small_logits, SMALL_V, DRAWS, counts);
        double probs[SMALL_V], mass = 0.0;
        ref_softmax(small_logits, SMALL_V, fc->temperature, probs);
        for (int i = 0; i < SMALL_V; i++)
            mass += keep[i] ? probs[i] : 0.0;
        for (int i = 0; i < SMALL_V; i++)
            probs[i] = keep[i] ? probs[i] / mass : 0.0;
        int df;
        double chi2 = chi_square(counts, probs, SMALL_V, DRAWS, &df);
        print_message("case %zu: %d kept, chi2 = %.2f (df %d)\n", ci, df + 1, chi2, df);
        if (df > 0)
            assert_true(chi2 < chi2_999[df]);
        pd_sampler_free(&s);
    }
}

/* top_k = 1 and a tiny top_p are greedy, at full vocabulary size. */
static void test_degenerate_filters_are_greedy(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, 12);
    float *l = malloc(VOCAB_V3 * sizeof *l);
    for (int mode = 0; mode < 2; mode++) {
        pd_sampling_params p = pd_sampling_defaults();
        p.temperature = 1.5f;
        if (mode == 0)
            p.top_k = 1;
        else
            p.top_p = 1e-6f;
        p.has_seed = true;
        p.seed = 5;
        pd_sampler *s = sampler_new(&p, VOCAB_V3, NULL, 0);
        for (int round = 0; round < 20; round++) {
            random_logits(&rng, l, VOCAB_V3, 2.0);
            int want = ref_argmax(l, VOCAB_V3);
            assert_int_equal(pd_sampler_sample(s, l, NULL), want);
        }
        pd_sampler_free(&s);
    }
    free(l);
}

static int cmp_float_desc(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* At vocabulary scale the filters keep exactly the expected sets: top-k the
 * k largest; min-p those at or above log(min_p) + max in logit space. */
static void test_filters_at_vocab_scale(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, 13);
    float *l = malloc(VOCAB_V3 * sizeof *l), *work = malloc(VOCAB_V3 * sizeof *work),
          *sorted = malloc(VOCAB_V3 * sizeof *sorted);
    random_logits(&rng, l, VOCAB_V3, 3.0);
    memcpy(sorted, l, VOCAB_V3 * sizeof *sorted);
    qsort(sorted, VOCAB_V3, sizeof *sorted, cmp_float_desc);

    const int ks[] = {50, 1000, 40000};
    for (int ki = 0; ki < 3; ki++) {
        int k = ks[ki];
        assert_true(sorted[k - 1] > sorted[k]); /* no tie at the boundary */
        pd_sampling_params p = pd_sampling_defaults();
        p.top_k = k;
        p.temperature = 0.8f;
        pd_sampler *s = sampler_new(&p, VOCAB_V3, NULL, 0);
        memcpy(work, l, VOCAB_V3 * sizeof *work);
        int32_t t = pd_sampler_sample(s, work, NULL);
        int finite = 0;
        for (int i = 0; i < VOCAB_V3; i++) {
            bool in_top = l[i] >= sorted[k - 1];
            if (in_top) {
                assert_true(work[i] == l[i] / 0.8f);
                finite++;
            } else {
                assert_true(work[i] == -INFINITY);
            }
        }
        assert_int_equal(finite, k);
        assert_true(l[t] >= sorted[k - 1]);
        pd_sampler_free(&s);
    }

    /* min-p: probability ratio to the best is exp((l - max) / T) */
    pd_sampling_params p = pd_sampling_defaults();
    p.min_p = 0.05f;
    p.temperature = 1.0f;
    pd_sampler *s = sampler_new(&p, VOCAB_V3, NULL, 0);
    memcpy(work, l, VOCAB_V3 * sizeof *work);
    int32_t t = pd_sampler_sample(s, work, NULL);
    double cut = sorted[0] + log(0.05);
    for (int i = 0; i < VOCAB_V3; i++) {
        if (fabs(l[i] - cut) < 1e-4)
            continue; /* too close to call in float */
        if (l[i] > cut)
            assert_true(work[i] == l[i]);
        else
            assert_true(work[i] == -INFINITY);
    }
    assert_true(l[t] > cut - 1e-4);
    pd_sampler_free(&s);

    free(sorted);
    free(work);
    free(l);
}

/* Top-p at vocabulary scale over peaked, spread and flat distributions: the
 * kept set is a prefix of the ranking whose mass reaches top_p and which
 * without its smallest member does not. */
static void test_top_p_at_vocab_scale(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, 16);
    float *l = malloc(VOCAB_V3 * sizeof *l), *work = malloc(VOCAB_V3 * sizeof *work);
    const double scales[] = {0.01, 1.0, 3.0, 8.0};
    const float top_ps[] = {0.3f, 0.9f, 0.99f};
    for (int si = 0; si < 4; si++) {
        random_logits(&rng, l, VOCAB_V3, scales[si]);
        double max = l[ref_argmax(l, VOCAB_V3)];
        for (int pi = 0; pi < 3; pi++) {
            pd_sampling_params p = pd_sampling_defaults();
            p.top_p = top_ps[pi];
            pd_sampler *s = sampler_new(&p, VOCAB_V3, NULL, 0);
            memcpy(work, l, VOCAB_V3 * sizeof *work);
            int32_t t = pd_sampler_sample(s, work, NULL);
            assert_true(work[t] != -INFINITY);
            double total = 0.0, kept_mass = 0.0, min_kept = INFINITY, max_dropped = -INFINITY;
            int n_kept = 0;
            for (int i = 0; i < VOCAB_V3; i++) {
                double e = exp((double)l[i] - max);
                total += e;
                if (work[i] != -INFINITY) {
                    assert_true(work[i] == l[i]);
                    kept_mass += e;
                    min_kept = fmin(min_kept, l[i]);
                    n_kept++;
                } else {
                    max_dropped = fmax(max_dropped, l[i]);
                }
            }
            assert_true(min_kept >= max_dropped);
            assert_true(kept_mass / total >= top_ps[pi] - 1e-6);
            assert_true((kept_mass - exp(min_kept - max)) / total < top_ps[pi] + 1e-6);
            print_message("scale %4.2f top_p %.2f keeps %6d of %d tokens\n", scales[si], top_ps[pi],
                          n_kept, VOCAB_V3);
            pd_sampler_free(&s);
        }
    }

    /* all equal: the lowest ids, exactly as many as reach the mass */
    for (int i = 0; i < VOCAB_V3; i++)
        work[i] = 0.5f;
    pd_sampling_params p = pd_sampling_defaults();
    p.top_p = 0.5f;
    pd_sampler *s = sampler_new(&p, VOCAB_V3, NULL, 0);
    int32_t t = pd_sampler_sample(s, work, NULL);
    assert_true(t < VOCAB_V3 / 2);
    for (int i = 0; i < VOCAB_V3; i++)
        assert_true(i < VOCAB_V3 / 2 ? work[i] == 0.5f : work[i] == -INFINITY);
    pd_sampler_free(&s);

    free(work);
    free(l);
}

/* ---- penalties -------------------------------------------------------------- */

/* logits after penalties by the formulas, in double:
 *   seen in prompt or output: l > 0 ? l / rep : l * rep
 *   count > 0: l - freq * count - pres */
static void ref_penalise(const float *in, int n, const bool *in_prompt, const int *count,
                         double rep, double freq, double pres, double *out) {
    for (int i = 0; i < n; i++) {
        double l = in[i];
        if (in_prompt[i] || count[i] > 0)
            l = l > 0 ? l / rep : l * rep;
        if (count[i] > 0)
            l -= freq * count[i] + pres;
        out[i] = l;
    }
}

static void test_penalties_exact(void **state) {
    (void)state;
    enum { V = 12 };
    static const float base[V] = {2.0f, -1.0f, 0.5f,  -0.5f, 3.0f, 0.0f,
                                  1.5f, -2.0f, 0.25f, 1.0f,  4.0f, -3.0f};
    static const int32_t prompt[] = {1, 2, 2, 8, 5};
    static const int32_t output[] = {2, 4, 4, 6, 6, 6, 7};
    static const struct {
        float rep, freq, pres;
    } cases[] = {
        {1.5f, 0.3f, 0.2f}, {1.0f, 0.7f, 0.0f},   {1.0f, 0.0f, 1.1f},
        {0.8f, 0.0f, 0.0f}, {1.2f, -0.4f, -1.0f},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        pd_sampling_params p = pd_sampling_defaults();
        p.temperature = 0.0f; /* greedy leaves the penalised logits in place */
        p.repetition_penalty = cases[ci].rep;
        p.frequency_penalty = cases[ci].freq;
        p.presence_penalty = cases[ci].pres;
        pd_sampler *s = sampler_new(&p, V, prompt, 5);

        bool in_prompt[V] = {false};
        int count[V] = {0};
        for (int i = 0; i < 5; i++)
            in_prompt[prompt[i]] = true;
        for (int i = 0; i < 7; i++) {
            pd_sampler_accept(s, output[i]);
            count[output[i]]++;
        }
        pd_sampler_accept(s, -1); /* out of range: ignored */
        pd_sampler_accept(s, V);

        for (int step = 0; step < 3; step++) {
            double want[V];
            ref_penalise(base, V, in_prompt, count, cases[ci].rep, cases[ci].freq, cases[ci].pres,
                         want);
            float work[V];
            memcpy(work, base, sizeof work);
            int32_t t = pd_sampler_sample(s, work, NULL);
            for (int i = 0; i < V; i++) {
                if (!in_prompt[i] && count[i] == 0)
                    assert_true(work[i] == base[i]); /* untouched, bit for bit */
                else if (fabs(work[i] - want[i]) > 1e-5 * (1 + fabs(want[i])))
                    fail_msg("case %zu step %d token %d: %.7g, want %.7g", ci, step, i, work[i],
                             want[i]);
            }
            double best = -INFINITY;
            for (int i = 0; i < V; i++)
                best = fmax(best, want[i]);
            assert_true(fabs(want[t] - best) < 1e-5);
            count[t]++; /* the sampled token counts from now on */
        }
        pd_sampler_free(&s);
    }
}

/* ---- logit_bias ---------------------------------------------------------------- */

/* Greedy with a bias: the argmax of logits + bias, computed here in double.
 * +100 on a token makes greedy pick it whenever no other logit leads it by
 * 100 (random logits of scale 4 span ~40); -100 on the argmax hands the pick
 * to the best of the rest. */
static void test_logit_bias_greedy(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, 31);
    float *l = malloc(VOCAB_V3 * sizeof *l), *work = malloc(VOCAB_V3 * sizeof *work);
    double *biased = malloc(VOCAB_V3 * sizeof *biased);
    for (int round = 0; round < 8; round++) {
        random_logits(&rng, l, VOCAB_V3, 4.0);
        int top = ref_argmax(l, VOCAB_V3);
        int32_t ids[3] = {(int32_t)(pd_rng_next(&rng) % VOCAB_V3), top, 0};
        float bias[3] = {round % 2 ? 100.0f : 0.0f, -100.0f, 0.0f};
        ids[2] = ids[0] == 7 || top == 7 ? 8 : 7; /* a third entry with bias 0 changes nothing */
        if (ids[0] == top || ids[0] == ids[2])
            continue;
        pd_sampling_params p = pd_sampling_defaults();
        p.temperature = 0.0f;
        p.logit_bias_ids = ids;
        p.logit_bias = bias;
        p.n_logit_bias = 3;
        pd_sampler *s = sampler_new(&p, VOCAB_V3, NULL, 0);
        for (int i = 0; i < VOCAB_V3; i++)
            biased[i] = l[i];
        for (int k = 0; k < 3; k++)
            biased[ids[k]] += bias[k];
        int want = 0;
        for (int i = 1; i < VOCAB_V3; i++)
            if (biased[i] > biased[want])
                want = i;
        if (bias[0] == 100.0f) {
            assert_true(l[top] - l[ids[0]] < 100.0f); /* the premise of the property */
            assert_int_equal(want, ids[0]);
        }
        assert_int_not_equal(want, top);
        memcpy(work, l, VOCAB_V3 * sizeof *work);
        float lp = 0.0f;
        int32_t t = pd_sampler_sample(s, work, &lp);
        assert_int_equal(t, want);
        /* logprobs are of the logits before the bias */
        double want_lp = ref_log_softmax(l, VOCAB_V3, t);
        if (fabs(lp - want_lp) > 1e-3)
            fail_msg("round %d: logprob %.7g, want %.7g (unbiased)", round, lp, want_lp);
        pd_sampler_free(&s);
    }
    free(l);
    free(work);
    free(biased);
}

/* Random sampling with a bias draws from softmax((logits + bias) / T)
 * (chi-square), under temperature and a top-k that the bias changes; +100
 * makes every draw the token, -100 makes it never drawn. */
static void test_logit_bias_random(void **state) {
    (void)state;
    const int32_t ids[2] = {5, 3};
    const float bias[2] = {2.5f, -1.0f};
    const float temps[] = {1.0f, 0.7f};
    for (int ti = 0; ti < 2; ti++) {
        pd_sampling_params p = pd_sampling_defaults();
        p.temperature = temps[ti];
        p.has_seed = true;
        p.seed = 200 + ti;
        p.logit_bias_ids = ids;
        p.logit_bias = bias;
        p.n_logit_bias = 2;
        pd_sampler *s = sampler_new(&p, SMALL_V, NULL, 0);
        long counts[SMALL_V];
        draw_counts(s, small_logits, SMALL_V, DRAWS, counts);
        float biased[SMALL_V];
        memcpy(biased, small_logits, sizeof biased);
        for (int k = 0; k < 2; k++)
            biased[ids[k]] += bias[k];
        double probs[SMALL_V];
        ref_softmax(biased, SMALL_V, temps[ti], probs);
        int df;
        double chi2 = chi_square(counts, probs, SMALL_V, DRAWS, &df);
        print_message("logit_bias T=%.1f: chi2 = %.2f (df %d, 0.1%% point %.2f)\n", temps[ti],
                      chi2, df, chi2_999[df]);
        assert_true(chi2 < chi2_999[df]);
        pd_sampler_free(&s);
    }

    pd_rng rng;
    pd_rng_seed(&rng, 32);
    enum { V = 4096 };
    float l[V], work[V];
    random_logits(&rng, l, V, 4.0);
    int top = ref_argmax(l, V);
    for (int sign = 0; sign < 2; sign++) {
        int32_t id = sign == 0 ? (top + 1) % V : top;
        float b = sign == 0 ? 100.0f : -100.0f;
        pd_sampling_params p = pd_sampling_defaults();
        p.has_seed = true;
        p.seed = 33;
        p.top_k = 50;
        p.top_p = 0.95f;
        p.logit_bias_ids = &id;
        p.logit_bias = &b;
        p.n_logit_bias = 1;
        pd_sampler *s = sampler_new(&p, V, NULL, 0);
        id = -1; /* the sampler keeps its own copy */
        for (int i = 0; i < 2000; i++) {
            memcpy(work, l, sizeof work);
            int32_t t = pd_sampler_sample(s, work, NULL);
            if (sign == 0)
                assert_int_equal(t, (top + 1) % V);
            else
                assert_int_not_equal(t, top);
        }
        pd_sampler_free(&s);
    }
}

/* A bias does not unmask a token the caller masked (-inf: min_tokens,
 * response_format), and penalties apply to the biased logit (vLLM's order). */
static void test_logit_bias_masked_and_penalised(void **state) {
    (void)state;
    enum { V = 16 };
    int32_t id = 4;
    float b = 100.0f;
    pd_sampling_params p = pd_sampling_defaults();
    p.temperature = 0.0f;
    p.logit_bias_ids = &id;
    p.logit_bias = &b;
    p.n_logit_bias = 1;
    pd_sampler *s = sampler_new(&p, V, NULL, 0);
    float l[V];
    for (int i = 0; i < V; i++)
        l[i] = (float)i * 0.1f;
    l[4] = -INFINITY;
    assert_int_equal(pd_sampler_sample(s, l, NULL), V - 1);
    assert_true(l[4] == -INFINITY);
    pd_sampler_free(&s);

    /* repetition penalty 2 on a prompt token: (raw + bias) / 2 */
    const int32_t prompt[1] = {4};
    p.repetition_penalty = 2.0f;
    b = 10.0f;
    s = sampler_new(&p, V, prompt, 1);
    for (int i = 0; i < V; i++)
        l[i] = (float)i * 0.1f;
    float want = (l[4] + 10.0f) / 2.0f;
    pd_sampler_sample(s, l, NULL);
    assert_true(fabsf(l[4] - want) < 1e-6f);
    pd_sampler_free(&s);
}

static void test_logit_bias_invalid(void **state) {
    (void)state;
    enum { V = 100 };
    static int32_t many_ids[PD_MAX_LOGIT_BIAS + 1];
    static float many_bias[PD_MAX_LOGIT_BIAS + 1];
    for (int i = 0; i <= PD_MAX_LOGIT_BIAS; i++)
        many_ids[i] = i;
    struct {
        int32_t id[2];
        float bias[2];
        int n;
        const char *want;
    } cases[] = {
        {{V, 0}, {1.0f, 0.0f}, 1, "token id 100 is outside the vocabulary [0, 100)"},
        {{-1, 0}, {1.0f, 0.0f}, 1, "token id -1"},
        {{3, 3}, {1.0f, 2.0f}, 2, "token id 3 is listed twice"},
        {{3, 0}, {100.5f, 0.0f}, 1, "[-100, 100]"},
        {{3, 0}, {-101.0f, 0.0f}, 1, "[-100, 100]"},
        {{3, 0}, {NAN, 0.0f}, 1, "[-100, 100]"},
        {{3, 0}, {INFINITY, 0.0f}, 1, "[-100, 100]"},
        {{3, 0}, {1.0f, 0.0f}, -1, "entries"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pd_sampling_params p = pd_sampling_defaults();
        p.logit_bias_ids = cases[i].id;
        p.logit_bias = cases[i].bias;
        p.n_logit_bias = cases[i].n;
        pd_sampler *s = NULL;
        pd_err err = {{0}};
        assert_int_equal(pd_sampler_init(&p, V, NULL, 0, &s, &err), PD_ERR_INVALID);
        assert_null(s);
        if (!strstr(err.msg, "logit_bias") || !strstr(err.msg, cases[i].want))
            fail_msg("case %zu: \"%s\" lacks \"%s\"", i, err.msg, cases[i].want);
    }
    /* the limit is a limit: PD_MAX_LOGIT_BIAS entries are fine, one more is not */
    pd_sampling_params p = pd_sampling_defaults();
    p.logit_bias_ids = many_ids;
    p.logit_bias = many_bias;
    p.n_logit_bias = PD_MAX_LOGIT_BIAS + 1;
    pd_sampler *s = NULL;
    pd_err err = {{0}};
    assert_int_equal(pd_sampler_init(&p, 2 * PD_MAX_LOGIT_BIAS, NULL, 0, &s, &err), PD_ERR_INVALID);
    p.n_logit_bias = PD_MAX_LOGIT_BIAS;
    assert_int_equal(pd_sampler_init(&p, 2 * PD_MAX_LOGIT_BIAS, NULL, 0, &s, &err), PD_OK);
    pd_sampler_free(&s);
    /* the edges of the range are valid */
    int32_t ids[2] = {1, 2};
    float edge[2] = {-100.0f, 100.0f};
    p.logit_bias_ids = ids;
    p.logit_bias = edge;
    p.n_logit_bias = 2;
    s = sampler_new(&p, V, NULL, 0);
    pd_sampler_free(&s);
}

/* ---- logprobs ---------------------------------------------------------------- */

static void test_logprob(void **state) {
    (void)state;
    enum { V = 1000 };
    pd_rng rng;
    pd_rng_seed(&rng, 14);
    float raw[V], work[V];
    int32_t prompt[20];
    for (int i = 0; i < 20; i++)
        prompt[i] = (int32_t)(pd_rng_next(&rng) % V);
    for (int mode = 0; mode < 3; mode++) {
        pd_sampling_params p = pd_sampling_defaults();
        p.has_seed = true;
        p.seed = 9;
        if (mode == 0)
            p.temperature = 0.0f;
        if (mode >= 1) {
            p.temperature = 0.7f;
            p.top_k = 20;
            p.repetition_penalty = 1.3f;
            p.frequency_penalty = 0.5f;
            p.presence_penalty = 0.5f;
        }
        if (mode == 2)
            p.min_p = 0.1f;
        pd_sampler *s = sampler_new(&p, V, prompt, 20);
        for (int step = 0; step < 30; step++) {
            random_logits(&rng, raw, V, 3.0);
            memcpy(work, raw, sizeof work);
            float lp = 1.0f;
            int32_t t = pd_sampler_sample(s, work, &lp);
            double want = ref_log_softmax(raw, V, t);
            if (fabs(lp - want) > 1e-4)
                fail_msg("mode %d step %d: logprob %.7g, want %.7g", mode, step, lp, want);
        }
        pd_sampler_free(&s);
    }
}

/* text_vocab_size: ids at or past it (no text in the tokenizer) are never
 * drawn, greedy or sampled, whatever their logits or logit_bias, while the
 * sampled token's logprob stays that of the raw logits over every id (an
 * independent log-softmax); the device row carries it as n_vocab; a
 * negative value is refused. A walkthrough found 200s with empty text: the
 * tiny model drew ids 128815-129279, which DeepSeek-V3's tokenizer lacks. */
static void test_text_vocab(void **state) {
    (void)state;
    enum { V = 1000, TV = 900 };
    pd_rng rng;
    pd_rng_seed(&rng, 21);
    float raw[V], work[V];
    int32_t bias_id = V - 1;
    float bias = 100.0f;
    for (int mode = 0; mode < 3; mode++) {
        pd_sampling_params p = pd_sampling_defaults();
        p.has_seed = true;
        p.seed = 5;
        p.text_vocab_size = TV;
        p.temperature = mode == 0 ? 0.0f : 1.0f;
        if (mode == 2) {
            p.logit_bias_ids = &bias_id;
            p.logit_bias = &bias;
            p.n_logit_bias = 1;
        }
        pd_sampler *s = sampler_new(&p, V, NULL, 0);
        for (int step = 0; step < 200; step++) {
            random_logits(&rng, raw, V, 3.0);
            for (int i = TV; i < V; i++)
                raw[i] += 8.0f; /* the no-text ids hold nearly all the mass */
            memcpy(work, raw, sizeof work);
            float lp = 1.0f;
            int32_t t = pd_sampler_sample(s, work, &lp);
            if (t < 0 || t >= TV)
                fail_msg("mode %d step %d: drew id %d, past text_vocab_size %d", mode, step, t, TV);
            double want = ref_log_softmax(raw, V, t);
            if (fabs(lp - want) > 1e-4)
                fail_msg("mode %d step %d: logprob %.7g, want %.7g (over every id)", mode, step, lp,
                         want);
        }
        pd_sample_row row = {.row = 3};
        pd_sample_tok *toks = NULL;
        int n_toks = 0, cap = 0;
        pd_sampler_device_row(s, NULL, 0, false, 0, &row, &toks, &n_toks, &cap);
        assert_int_equal(row.n_vocab, TV);
        free(toks);
        pd_sampler_free(&s);
    }
    pd_sampling_params p = pd_sampling_defaults();
    p.text_vocab_size = -1;
    pd_sampler *s = NULL;
    pd_err err;
    assert_int_equal(pd_sampler_init(&p, V, NULL, 0, &s, &err), PD_ERR_INVALID);
    assert_null(s);
}

/* Top logprobs against a full sort of an independent log-softmax: the k
 * best ids (ties to the lower id, planted here), their logprobs of the raw
 * logits whatever the penalties and temperature, and under greedy the
 * sampled token first with the very same float. */
static const float *g_ref_key;
static int ref_rank_cmp(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (g_ref_key[x] != g_ref_key[y])
        return g_ref_key[x] > g_ref_key[y] ? -1 : 1;
    return x < y ? -1 : 1;
}

static void test_top_logprobs(void **state) {
    (void)state;
    enum { V = 3000 };
    pd_rng rng;
    pd_rng_seed(&rng, 21);
    static float raw[V], work[V];
    static int32_t order[V];
    int32_t prompt[20];
    for (int i = 0; i < 20; i++)
        prompt[i] = (int32_t)(pd_rng_next(&rng) % V);
    for (int mode = 0; mode < 2; mode++) {
        pd_sampling_params p = pd_sampling_defaults();
        p.has_seed = true;
        p.seed = 4;
        p.temperature = mode == 0 ? 0.0f : 1.3f;
        p.repetition_penalty = 1.5f;
        p.frequency_penalty = 1.0f;
        pd_sampler *s = sampler_new(&p, V, prompt, 20);
        for (int step = 0; step < 40; step++) {
            int k = step % (PD_MAX_TOP_LOGPROBS + 3); /* 0 .. 22: above the limit clamps */
            random_logits(&rng, raw, V, 3.0);
            for (int i = 0; i < 6; i++) /* ties at the top: lower id first */
                raw[V - 1 - 7 * i] = raw[(step * 13 + i) % V] = 9.0f + (float)(i % 3);
            memcpy(work, raw, sizeof work);
            int32_t ids[PD_MAX_TOP_LOGPROBS + 3];
            float lps[PD_MAX_TOP_LOGPROBS + 3], lp = 1.0f;
            int n_top = -1;
            int32_t t = pd_sampler_sample_top(s, work, &lp, k, ids, lps, &n_top);
            int want_n = k < PD_MAX_TOP_LOGPROBS ? k : PD_MAX_TOP_LOGPROBS;
            assert_int_equal(n_top, want_n);
            for (int i = 0; i < V; i++)
                order[i] = i;
            g_ref_key = raw;
            qsort(order, V, sizeof *order, ref_rank_cmp);
            for (int i = 0; i < n_top; i++) {
                if (ids[i] != order[i])
                    fail_msg("mode %d step %d: top[%d] = %d, want %d", mode, step, i, ids[i],
                             order[i]);
                double want = ref_log_softmax(raw, V, order[i]);
                if (fabs(lps[i] - want) > 1e-5)
                    fail_msg("mode %d step %d: top[%d] logprob %.7g, want %.7g", mode, step, i,
                             lps[i], want);
                assert_true(lps[i] <= 0.0f);
                if (i > 0)
                    assert_true(lps[i] <= lps[i - 1]);
                if (ids[i] == t)
                    assert_true(lps[i] == lp); /* one normaliser */
            }
        }
        pd_sampler_free(&s);
    }
    /* plain greedy: the sampled token is top-1, same float */
    pd_sampling_params g = pd_sampling_defaults();
    g.temperature = 0.0f;
    pd_sampler *s = sampler_new(&g, V, NULL, 0);
    for (int step = 0; step < 10; step++) {
        random_logits(&rng, raw, V, 2.0);
        int32_t ids[5];
        float lps[5], lp;
        int n_top;
        int32_t t = pd_sampler_sample_top(s, raw, &lp, 5, ids, lps, &n_top);
        assert_int_equal(n_top, 5);
        assert_int_equal(t, ids[0]);
        assert_true(lp == lps[0]);
    }
    pd_sampler_free(&s);
    /* a vocabulary smaller than k, and no arrays */
    float small[3] = {0.0f, 1.0f, 0.0f};
    s = sampler_new(&g, 3, NULL, 0);
    int32_t ids[PD_MAX_TOP_LOGPROBS];
    float lps[PD_MAX_TOP_LOGPROBS];
    int n_top;
    assert_int_equal(pd_sampler_sample_top(s, small, NULL, 20, ids, lps, &n_top), 1);
    assert_int_equal(n_top, 3);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 0);
    assert_int_equal(ids[2], 2);
    assert_true(fabs(lps[0] - log(exp(1.0) / (exp(1.0) + 2.0))) < 1e-6);
    small[1] = 1.0f;
    assert_int_equal(pd_sampler_sample_top(s, small, NULL, 20, NULL, NULL, &n_top), 1);
    assert_int_equal(n_top, 0);
    pd_sampler_free(&s);
}

/* ---- odd inputs and speed ------------------------------------------------------ */

static void test_masked_logits(void **state) {
    (void)state;
    enum { V = 16 };
    pd_sampling_params p = pd_sampling_defaults();
    p.has_seed = true;
    pd_sampler *s = sampler_new(&p, V, NULL, 0);
    float l[V];
    /* all but one masked: always that one */
    for (int round = 0; round < 100; round++) {
        for (int i = 0; i < V; i++)
            l[i] = -INFINITY;
        l[11] = -50.0f;
        assert_int_equal(pd_sampler_sample(s, l, NULL), 11);
    }
    /* everything masked or NaN: some token, no crash */
    for (int i = 0; i < V; i++)
        l[i] = i % 2 ? NAN : -INFINITY;
    int32_t t = pd_sampler_sample(s, l, NULL);
    assert_true(t >= 0 && t < V);
    /* NaN entries are never drawn */
    for (int round = 0; round < 1000; round++) {
        for (int i = 0; i < V; i++)
            l[i] = i % 3 ? NAN : 0.0f;
        t = pd_sampler_sample(s, l, NULL);
        assert_int_equal(t % 3, 0);
    }
    pd_sampler_free(&s);
}

static void test_speed(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, 15);
    float *l = malloc(VOCAB_V3 * sizeof *l), *work = malloc(VOCAB_V3 * sizeof *work);
    random_logits(&rng, l, VOCAB_V3, 3.0);
    static const struct {
        const char *what;
        float temperature;
        int top_k;
        float top_p, min_p;
    } cases[] = {
        {"greedy", 0.0f, -1, 1.0f, 0.0f},        {"T only", 1.0f, -1, 1.0f, 0.0f},
        {"top_k 50", 1.0f, 50, 1.0f, 0.0f},      {"top_p 0.95", 1.0f, -1, 0.95f, 0.0f},
        {"top_p 0.999", 1.0f, -1, 0.999f, 0.0f}, {"k 40 p 0.9 min_p", 0.7f, 40, 0.9f, 0.05f},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        pd_sampling_params p = pd_sampling_defaults();
        p.temperature = cases[ci].temperature;
        p.top_k = cases[ci].top_k;
        p.top_p = cases[ci].top_p;
        p.min_p = cases[ci].min_p;
        p.repetition_penalty = 1.1f;
        pd_sampler *s = sampler_new(&p, VOCAB_V3, NULL, 0);
        enum { N = 100 };
        double t0 = pd_now_s();
        for (int i = 0; i < N; i++) {
            memcpy(work, l, VOCAB_V3 * sizeof *work);
            pd_sampler_sample(s, work, NULL);
        }
        double us = (pd_now_s() - t0) / N * 1e6;
        print_message("%-18s %8.1f us/token (vocab %d, incl. a copy of the logits)\n",
                      cases[ci].what, us, VOCAB_V3);
        pd_sampler_free(&s);
    }
    /* OpenAI logprobs: the sampled token's, and with the top 20 */
    pd_sampling_params g = pd_sampling_defaults();
    g.temperature = 0.0f;
    pd_sampler *s = sampler_new(&g, VOCAB_V3, NULL, 0);
    for (int k = 0; k <= PD_MAX_TOP_LOGPROBS; k += PD_MAX_TOP_LOGPROBS) {
        enum { N = 100 };
        int32_t ids[PD_MAX_TOP_LOGPROBS];
        float lps[PD_MAX_TOP_LOGPROBS], lp;
        double t0 = pd_now_s();
        for (int i = 0; i < N; i++) {
            memcpy(work, l, VOCAB_V3 * sizeof *work);
            pd_sampler_sample_top(s, work, &lp, k, ids, lps, NULL);
        }
        double us = (pd_now_s() - t0) / N * 1e6;
        print_message("greedy, logprob, top %2d %5.1f us/token\n", k, us);
    }
    pd_sampler_free(&s);
    free(work);
    free(l);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_invalid_params),
        cmocka_unit_test(test_greedy_is_argmax),
        cmocka_unit_test(test_seed_reproducible),
        cmocka_unit_test(test_frequencies_match_softmax),
        cmocka_unit_test(test_filters_support_and_frequencies),
        cmocka_unit_test(test_degenerate_filters_are_greedy),
        cmocka_unit_test(test_filters_at_vocab_scale),
        cmocka_unit_test(test_top_p_at_vocab_scale),
        cmocka_unit_test(test_penalties_exact),
        cmocka_unit_test(test_logit_bias_greedy),
        cmocka_unit_test(test_logit_bias_random),
        cmocka_unit_test(test_logit_bias_masked_and_penalised),
        cmocka_unit_test(test_logit_bias_invalid),
        cmocka_unit_test(test_top_logprobs),
        cmocka_unit_test(test_logprob),
        cmocka_unit_test(test_masked_logits),
        cmocka_unit_test(test_text_vocab),
        cmocka_unit_test(test_skip_draw),
        cmocka_unit_test(test_speed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

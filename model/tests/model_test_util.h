/* Test helpers for the whole model against Hugging Face transformers, shared
 * by the CPU test (model/tests/test_model.c) and the CUDA one
 * (kernels/cuda/tests/test_model_cuda.c): the tiny test checkpoint of a
 * preset, its golden fixture (tests/reference/fixtures/model_<preset>.json,
 * made by tests/reference/make_fixtures.py) and the comparison of a logits
 * row with a fixture row summary. Header only; include after <cmocka.h>. */
#ifndef PD_MODEL_TEST_UTIL_H
#define PD_MODEL_TEST_UTIL_H

#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "pd_model.h"

/* A preset's test checkpoint loaded on a backend, and its fixture. */
typedef struct {
    const char *preset;
    char dir[4096]; /* $PD_BUILD_DIR/test-models/<preset> */
    json_t *fx;     /* the golden fixture */
    pd_backend *be; /* the test's */
    pd_model *m;
} mt_fixture;

/** Makes (once: kept across runs) the test checkpoint of preset under
 * $PD_BUILD_DIR/test-models/<preset> (pd_mkmodel_write, seed 1) into
 * f->dir, then reads the preset's fixture from $PD_SOURCE_DIR into f->fx.
 * The caller then loads f->m on its backend f->be. Returns 0, or -1 after
 * printing why (a cmocka setup then fails its group). */
static inline int mt_fixture_prepare(mt_fixture *f, const char *preset) {
    f->preset = preset;
    const char *bd = getenv("PD_BUILD_DIR"), *sd = getenv("PD_SOURCE_DIR");
    if (!bd) bd = ".";
    if (!sd) sd = PD_SOURCE_DIR;
    char models[2048];
    snprintf(models, sizeof models, "%s/test-models", bd);
    mkdir(models, 0755);
    snprintf(f->dir, sizeof f->dir, "%s/%s", models, preset);
    char cfgp[4200];
    snprintf(cfgp, sizeof cfgp, "%s/config.json", f->dir);
    pd_err err = {{0}};
    struct stat sb;
    if (stat(cfgp, &sb) != 0) {
        pd_model_config cfg;
        if (pd_preset_config(preset, &cfg, &err) != PD_OK ||
            pd_mkmodel_write(&cfg, 1, f->dir, 0, NULL, &err) != PD_OK) {
            print_error("mkmodel %s: %s\n", preset, err.msg);
            return -1;
        }
    }
    char fxp[4200];
    snprintf(fxp, sizeof fxp, "%s/tests/reference/fixtures/model_%s.json", sd, preset);
    json_error_t je;
    f->fx = json_load_file(fxp, 0, &je);
    if (!f->fx) {
        print_error("cannot read fixture %s: %s\n", fxp, je.text);
        return -1;
    }
    return 0;
}

/** Frees the model, the backend and the fixture (each may be absent). */
static inline void mt_fixture_free(mt_fixture *f) {
    pd_model_free(&f->m);
    pd_backend_free(&f->be);
    if (f->fx)
        json_decref(f->fx);
    f->fx = NULL;
}

/* One fixture case on its own KV cache: the prompt, the reference's greedy
 * continuation, and the logits rows to compare. */
typedef struct {
    int n, steps;   /* prompt tokens, greedy steps */
    int32_t *ids;   /* [n + steps]: the prompt, then the reference's greedy ids */
    json_t *rows;   /* [steps] row summaries: the logits before each greedy id */
    json_t *positions; /* [n] row summaries of every prompt position, or empty */
    pd_kv_cache *kv;   /* blocks of 16 tokens, room for n + steps */
    pd_seq_kv seq;     /* n tokens reserved */
    float *lg;         /* [n][V] logits */
    pd_batch_seq prefill; /* the whole prompt; every row's logits when positions has them */
} mt_case;

/** Starts fixture case cs (an entry of the fixture's "cases") on model m. */
static inline void mt_case_begin(mt_case *c, pd_model *m, json_t *cs) {
    json_t *pj = json_object_get(cs, "prompt_ids"), *gj = json_object_get(cs, "greedy_ids");
    c->rows = json_object_get(cs, "rows");
    c->positions = json_object_get(cs, "positions");
    c->n = (int)json_array_size(pj);
    c->steps = (int)json_array_size(gj);
    c->ids = calloc((size_t)(c->n + c->steps), sizeof *c->ids);
    for (int i = 0; i < c->n; i++)
        c->ids[i] = (int32_t)json_integer_value(json_array_get(pj, i));
    for (int s = 0; s < c->steps; s++)
        c->ids[c->n + s] = (int32_t)json_integer_value(json_array_get(gj, s));
    pd_err err = {{0}};
    assert_int_equal(pd_kv_cache_init(m, 16, (c->n + c->steps) / 16 + 2, &c->kv, &err), PD_OK);
    c->seq = (pd_seq_kv){0};
    c->lg = malloc((size_t)c->n * pd_model_config_of(m)->vocab_size * sizeof(float));
    assert_int_equal(pd_seq_kv_reserve(c->kv, &c->seq, c->n), PD_OK);
    c->prefill = (pd_batch_seq){
        .kv = &c->seq, .tokens = c->ids, .n_tokens = c->n, .all_logits = json_array_size(c->positions) > 0};
}

/** Reserves the token after greedy step s and returns its one-token batch. */
static inline pd_batch_seq mt_case_step(mt_case *c, int s) {
    assert_int_equal(pd_seq_kv_reserve(c->kv, &c->seq, 1), PD_OK);
    return (pd_batch_seq){.kv = &c->seq, .tokens = &c->ids[c->n + s], .n_tokens = 1};
}

/** Frees what mt_case_begin made. */
static inline void mt_case_end(mt_case *c) {
    pd_seq_kv_release(c->kv, &c->seq);
    free(c->seq.block_table);
    pd_kv_cache_free(&c->kv);
    free(c->lg);
    free(c->ids);
}

/** The error of our logits row lg (V entries) against a fixture row
 * summary (row: top_ids, top_vals, probe_vals at the fixture's probe_ids,
 * l2, mean), normalised by the row's largest magnitude: max |ours - ref| /
 * max |ref| over the top and probe entries, with the l2 norm's relative
 * error and the mean's error in the same scale. INFINITY when a logit is
 * not finite. Asserts that the fixture's ids are in the vocabulary. */
static inline double mt_row_error(const float *lg, int V, json_t *row, json_t *probes) {
    json_t *ti = json_object_get(row, "top_ids"), *tv = json_object_get(row, "top_vals");
    json_t *pv = json_object_get(row, "probe_vals");
    double scale = fabs(json_number_value(json_array_get(tv, 0)));
    for (size_t i = 0; i < json_array_size(tv); i++)
        scale = fmax(scale, fabs(json_number_value(json_array_get(tv, i))));
    for (size_t i = 0; i < json_array_size(pv); i++)
        scale = fmax(scale, fabs(json_number_value(json_array_get(pv, i))));
    double worst = 0;
    for (size_t i = 0; i < json_array_size(ti); i++) {
        int id = (int)json_integer_value(json_array_get(ti, i));
        assert_true(id >= 0 && id < V);
        worst = fmax(worst, fabs(lg[id] - json_number_value(json_array_get(tv, i))) / scale);
    }
    for (size_t i = 0; i < json_array_size(pv); i++) {
        int id = (int)json_integer_value(json_array_get(probes, i));
        assert_true(id >= 0 && id < V);
        worst = fmax(worst, fabs(lg[id] - json_number_value(json_array_get(pv, i))) / scale);
    }
    double mean = 0, l2 = 0;
    for (int i = 0; i < V; i++) {
        if (!isfinite(lg[i]))
            return INFINITY;
        mean += lg[i];
        l2 += (double)lg[i] * lg[i];
    }
    mean /= V;
    l2 = sqrt(l2);
    double ref_l2 = json_number_value(json_object_get(row, "l2"));
    worst = fmax(worst, fabs(l2 - ref_l2) / ref_l2);
    worst = fmax(worst, fabs(mean - json_number_value(json_object_get(row, "mean"))) / scale);
    return worst;
}

/** The index of the largest of v[0 .. n-1] (the first on a tie): the greedy id. */
static inline int mt_argmax(const float *v, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b]) b = i;
    return b;
}

#endif

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
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "pd_model.h"

/** Makes (once: kept across runs) the test checkpoint of preset under
 * $PD_BUILD_DIR/test-models/<preset> (pd_mkmodel_write, seed 1) and writes
 * its path to dir (dir_size bytes); then reads the preset's fixture from
 * $PD_SOURCE_DIR into *fx_p (json_decref it). Returns 0, or -1 after
 * printing why (a cmocka setup then fails its group). */
static inline int mt_fixture_prepare(const char *preset, char *dir, size_t dir_size, json_t **fx_p) {
    const char *bd = getenv("PD_BUILD_DIR"), *sd = getenv("PD_SOURCE_DIR");
    if (!bd) bd = ".";
    if (!sd) sd = PD_SOURCE_DIR;
    char models[2048];
    snprintf(models, sizeof models, "%s/test-models", bd);
    mkdir(models, 0755);
    snprintf(dir, dir_size, "%s/%s", models, preset);
    char cfgp[4200];
    snprintf(cfgp, sizeof cfgp, "%s/config.json", dir);
    pd_err err = {{0}};
    struct stat sb;
    if (stat(cfgp, &sb) != 0) {
        pd_model_config cfg;
        if (pd_preset_config(preset, &cfg, &err) != PD_OK || pd_mkmodel_write(&cfg, 1, dir, 0, NULL, &err) != PD_OK) {
            print_error("mkmodel %s: %s\n", preset, err.msg);
            return -1;
        }
    }
    char fxp[4200];
    snprintf(fxp, sizeof fxp, "%s/tests/reference/fixtures/model_%s.json", sd, preset);
    json_error_t je;
    *fx_p = json_load_file(fxp, 0, &je);
    if (!*fx_p) {
        print_error("cannot read fixture %s: %s\n", fxp, je.text);
        return -1;
    }
    return 0;
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

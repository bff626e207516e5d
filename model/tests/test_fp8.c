/* FP8 checkpoints (DeepSeek-V3's format: e4m3 weights with 128x128
 * weight_scale_inv blocks). Property: a model loaded from an FP8 checkpoint
 * computes exactly what a model loaded from an F32 checkpoint holding the
 * dequantised weights (q × scale_inv per block, computed here
 * independently) computes. Also: mkmodel's FP8 blocks quantise within
 * e4m3's precision. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "pd_model.h"

static void make_dirs(char *fp8, char *f32, size_t n) {
    const char *bd = getenv("PD_BUILD_DIR");
    char base[2048];
    snprintf(base, sizeof base, "%s/test-models-fp8", bd ? bd : ".");
    mkdir(base, 0755);
    snprintf(fp8, n, "%s/tiny-fp8", base);
    snprintf(f32, n, "%s/tiny-f32-dequant", base);
}

static void test_fp8_equals_dequantised_f32(void **state) {
    char fp8[4096], f32[4096], path[4200];
    make_dirs(fp8, f32, sizeof fp8);
    pd_err err = {{0}};
    pd_model_config cfg;
    assert_int_equal(pd_preset_config("tiny", &cfg, &err), PD_OK);
    cfg.fp8 = true;
    cfg.fp8_block[0] = cfg.fp8_block[1] = 128;
    cfg.hidden_size = 192; /* not a multiple of 128: partial edge blocks */
    cfg.intermediate_size = 320;
    if (pd_mkmodel_write(&cfg, 11, fp8, 0, NULL, &err) != PD_OK) fail_msg("%s", err.msg);

    /* the dequantised copy: every F8 tensor × its scale block, as F32 */
    snprintf(path, sizeof path, "%s/model.safetensors", fp8);
    pd_safetensors *st;
    if (pd_st_open_file(path, &st, &err) != PD_OK) fail_msg("%s", err.msg);
    mkdir(f32, 0755);
    pd_model_config c32 = cfg;
    c32.fp8 = false;
    snprintf(c32.torch_dtype, sizeof c32.torch_dtype, "float32");
    snprintf(path, sizeof path, "%s/config.json", f32);
    assert_int_equal(pd_config_save(&c32, path, &err), PD_OK);
    snprintf(path, sizeof path, "%s/model.safetensors", f32);
    pd_st_writer *w;
    assert_int_equal(pd_st_writer_open(path, &w, &err), PD_OK);
    size_t n_t = pd_st_count(st), n_fp8 = 0;
    for (size_t i = 0; i < n_t; i++) {
        const pd_st_tensor *t = pd_st_at(st, i);
        if (strstr(t->name, "_scale_inv")) continue;
        assert_int_equal(pd_st_writer_declare(w, t->name, PD_DT_F32, t->ndim, t->shape, &err), PD_OK);
    }
    for (size_t i = 0; i < n_t; i++) {
        const pd_st_tensor *t = pd_st_at(st, i);
        if (strstr(t->name, "_scale_inv")) continue;
        size_t n = 1;
        for (int d = 0; d < t->ndim; d++) n *= (size_t)t->shape[d];
        float *v = malloc(n * sizeof(float));
        if (t->dtype == PD_DT_F8_E4M3) {
            n_fp8++;
            char sn[256];
            snprintf(sn, sizeof sn, "%s_scale_inv", t->name);
            const pd_st_tensor *s = pd_st_find(st, sn);
            assert_non_null(s);
            int64_t rows = t->shape[0], cols = t->shape[1], sc = (cols + 127) / 128;
            assert_int_equal(s->shape[0], (rows + 127) / 128);
            assert_int_equal(s->shape[1], sc);
            const uint8_t *q = t->data;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c++) {
                    float scale;
                    memcpy(&scale, (const char *)s->data + 4 * ((r / 128) * sc + c / 128), 4);
                    v[r * cols + c] = pd_e4m3_to_f32(q[r * cols + c]) * scale;
                }
        } else {
            pd_st_to_f32(t, v);
        }
        assert_int_equal(pd_st_writer_write(w, t->name, v, n * sizeof(float), &err), PD_OK);
        free(v);
    }
    assert_int_equal(pd_st_writer_close(&w, &err), PD_OK);
    pd_st_close(&st);
    assert_true(n_fp8 > 10);

    pd_backend *be;
    assert_int_equal(pd_backend_cpu_init(1, &be), PD_OK);
    pd_model *m8, *m32;
    if (pd_model_load(fp8, be, &m8, &err) != PD_OK) fail_msg("%s", err.msg);
    if (pd_model_load(f32, be, &m32, &err) != PD_OK) fail_msg("%s", err.msg);
    int V = cfg.vocab_size;
    float *a = malloc((size_t)V * sizeof(float)), *b = malloc((size_t)V * sizeof(float));
    int32_t ids[12] = {0, 5, 77, 1000, 42, 9, 31337, 8, 8, 120000, 3, 4};
    pd_model *ms[2] = {m8, m32};
    float *outs[2] = {a, b};
    for (int k = 0; k < 2; k++) {
        pd_kv_cache *kv;
        assert_int_equal(pd_kv_cache_init(ms[k], 8, 4, &kv, &err), PD_OK);
        pd_seq_kv s = {0};
        assert_int_equal(pd_seq_kv_reserve(kv, &s, 12), PD_OK);
        pd_batch_seq bs = {.kv = &s, .tokens = ids, .n_tokens = 12};
        assert_int_equal(pd_model_forward(ms[k], kv, &bs, 1, outs[k], &err), PD_OK);
        pd_seq_kv_release(kv, &s);
        free(s.block_table);
        pd_kv_cache_free(&kv);
    }
    for (int i = 0; i < V; i++)
        if (a[i] != b[i]) fail_msg("logit %d: fp8 %g vs dequantised f32 %g", i, a[i], b[i]);
    free(a);
    free(b);
    pd_model_free(&m8);
    pd_model_free(&m32);
    pd_backend_free(&be);
}

/* A copy of the FP8 checkpoint in src (its config cfg) at dst with one
 * tensor changed: tensor `name` gets dtype dt (its bytes rewritten: an I32
 * copy of an F32 scale holds the scale's integer part) and then `poke`
 * bytes written at byte offset `at` of its data. */
static void write_variant(const pd_model_config *cfg, const char *src, const char *dst, const char *name, pd_dtype dt,
                          size_t at, const void *poke, size_t n_poke) {
    char path[4300];
    pd_err err = {{0}};
    if (snprintf(path, sizeof path, "%s/model.safetensors", src) >= (int)sizeof path) fail_msg("path too long");
    pd_safetensors *st;
    if (pd_st_open_file(path, &st, &err) != PD_OK) fail_msg("%s", err.msg);
    mkdir(dst, 0755);
    if (snprintf(path, sizeof path, "%s/config.json", dst) >= (int)sizeof path) fail_msg("path too long");
    assert_int_equal(pd_config_save(cfg, path, &err), PD_OK);
    if (snprintf(path, sizeof path, "%s/model.safetensors", dst) >= (int)sizeof path) fail_msg("path too long");
    pd_st_writer *w;
    assert_int_equal(pd_st_writer_open(path, &w, &err), PD_OK);
    bool found = false;
    for (size_t i = 0; i < pd_st_count(st); i++) {
        const pd_st_tensor *t = pd_st_at(st, i);
        bool me = !strcmp(t->name, name);
        found |= me;
        assert_int_equal(pd_st_writer_declare(w, t->name, me ? dt : t->dtype, t->ndim, t->shape, &err), PD_OK);
    }
    assert_true(found);
    for (size_t i = 0; i < pd_st_count(st); i++) {
        const pd_st_tensor *t = pd_st_at(st, i);
        size_t nb = t->nbytes;
        unsigned char *b = malloc(nb * 2 + 16);
        memcpy(b, t->data, nb);
        if (!strcmp(t->name, name)) {
            if (dt == PD_DT_I32 && t->dtype == PD_DT_F32)
                for (size_t k = 0; k < nb / 4; k++) {
                    float f;
                    memcpy(&f, b + 4 * k, 4);
                    int32_t v = (int32_t)f;
                    memcpy(b + 4 * k, &v, 4);
                }
            assert_true(at + n_poke <= nb);
            memcpy(b + at, poke, n_poke);
        }
        assert_int_equal(pd_st_writer_write(w, t->name, b, nb, &err), PD_OK);
        free(b);
    }
    assert_int_equal(pd_st_writer_close(&w, &err), PD_OK);
    pd_st_close(&st);
}

/* A broken FP8 file is refused at load with the file and the tensor named
 * (helper-62, session 21: these loaded, and a NaN code or a non-finite
 * scale then made every logit NaN; an I32 scale was read as a number). */
static void test_fp8_bad_files(void **state) {
    char fp8[4096], f32[4096], dst[4200];
    make_dirs(fp8, f32, sizeof fp8);
    pd_err err = {{0}};
    pd_model_config cfg;
    assert_int_equal(pd_preset_config("tiny", &cfg, &err), PD_OK);
    cfg.fp8 = true;
    cfg.fp8_block[0] = cfg.fp8_block[1] = 128;
    strcat(fp8, "-bad-src");
    if (pd_mkmodel_write(&cfg, 12, fp8, 0, NULL, &err) != PD_OK) fail_msg("%s", err.msg);
    const char *w = "model.layers.0.self_attn.o_proj.weight", *sn = "model.layers.0.self_attn.o_proj.weight_scale_inv";
    const uint8_t nan7f = 0x7f, nanff = 0xff;
    const float inf = INFINITY, nan = NAN;
    static const uint8_t unused = 0; /* the I32 case pokes nothing */
    const struct {
        const char *what, *tensor, *want;
        pd_dtype dt;
        size_t at;
        const void *poke;
        size_t n;
    } cases[] = {
        {"nan-7f", w, "NaN code", PD_DT_F8_E4M3, 100, &nan7f, 1},
        {"nan-ff", w, "NaN code", PD_DT_F8_E4M3, 7, &nanff, 1},
        {"scale-inf", sn, "must be finite", PD_DT_F32, 0, &inf, 4},
        {"scale-nan", sn, "must be finite", PD_DT_F32, 0, &nan, 4},
        {"scale-i32", sn, "is I32", PD_DT_I32, 0, &unused, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(dst, sizeof dst, "%s-%s", fp8, cases[i].what);
        write_variant(&cfg, fp8, dst, cases[i].tensor, cases[i].dt, cases[i].at, cases[i].poke, cases[i].n);
        pd_backend *be;
        assert_int_equal(pd_backend_cpu_init(1, &be), PD_OK);
        pd_model *m = NULL;
        pd_err e2 = {{0}};
        if (pd_model_load(dst, be, &m, &e2) == PD_OK)
            fail_msg("%s: loaded", cases[i].what);
        if (!strstr(e2.msg, cases[i].want) || !strstr(e2.msg, cases[i].tensor) || !strstr(e2.msg, "model.safetensors"))
            fail_msg("%s: the error does not name the fault, the tensor and the file: %s", cases[i].what, e2.msg);
        pd_backend_free(&be);
    }
}

/* e4m3 round trip on the grid and rounding to nearest (property); the
 * loader's table holds the decoder's value of every code, bit for bit. */
static void test_e4m3_codec(void **state) {
    const float *tab = pd_e4m3_table();
    for (int c = 0; c < 256; c++) {
        float d = pd_e4m3_to_f32((uint8_t)c);
        if (isnan(d) ? !isnan(tab[c]) : memcmp(&d, &tab[c], sizeof d) != 0)
            fail_msg("e4m3 code 0x%02x: table %g, decoder %g", c, tab[c], d);
    }
    for (int c = 0; c < 256; c++) {
        float f = pd_e4m3_to_f32((uint8_t)c);
        if (isnan(f)) continue;
        uint8_t back = pd_f32_to_e4m3(f);
        if (f == 0.0f) assert_true(back == 0 || back == 0x80);
        else assert_int_equal(back, c);
    }
    /* every finite value maps to a nearest grid point */
    for (int i = 0; i < 100000; i++) {
        float x = ((float)i / 100000.0f - 0.5f) * 900.0f;
        float q = pd_e4m3_to_f32(pd_f32_to_e4m3(x));
        float best = INFINITY;
        for (int c = 0; c < 256; c++) {
            float g = pd_e4m3_to_f32((uint8_t)c);
            if (!isnan(g)) best = fminf(best, fabsf(g - fminf(fmaxf(x, -448.0f), 448.0f)));
        }
        assert_true(fabsf(q - fminf(fmaxf(x, -448.0f), 448.0f)) <= best + 1e-6f * fabsf(x));
    }
}

int main(void) {
    const struct CMUnitTest t[] = {
        cmocka_unit_test(test_e4m3_codec),
        cmocka_unit_test(test_fp8_equals_dequantised_f32),
        cmocka_unit_test(test_fp8_bad_files),
    };
    return cmocka_run_group_tests(t, NULL, NULL);
}

/* Safetensors reader and writer: round trips through the writer (single file
 * and a hand-made sharded directory), every malformed-header case, and a
 * mutation loop over the header of a valid file. Fixtures are written by the
 * tests themselves into a fresh mkdtemp directory. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pd_model.h"

/* ---- fixtures -------------------------------------------------------- */

static int tmpdir_setup(void **state) {
    const char *base = getenv("TMPDIR");
    char tmpl[512];
    snprintf(tmpl, sizeof tmpl, "%s/pd_st_XXXXXX", base && *base ? base : "/tmp");
    char *dir = mkdtemp(tmpl);
    if (!dir)
        return -1;
    *state = strdup(dir);
    return 0;
}

static int tmpdir_teardown(void **state) {
    /* the tests only create plain files directly inside the directory */
    DIR *d = opendir(*state);
    if (d) {
        struct dirent *e;
        char path[1024];
        while ((e = readdir(d)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
                snprintf(path, sizeof path, "%s/%s", (char *)*state, e->d_name);
                unlink(path);
            }
        closedir(d);
    }
    rmdir(*state);
    free(*state);
    return 0;
}

static char *path_in(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    snprintf(p, n, "%s/%s", dir, name);
    return p;
}

static void write_bytes(const char *path, const void *data, size_t len) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (len)
        assert_int_equal(fwrite(data, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

static uint8_t *read_bytes(const char *path, size_t *len_p) {
    char *data;
    pd_err err;
    assert_int_equal(pd_file_read_all(path, &data, len_p, &err), PD_OK);
    return (uint8_t *)data;
}

/* A safetensors file with the given header text (unpadded) and data_len
 * zero bytes of data. */
static void write_st_raw(const char *path, const char *header, size_t data_len) {
    size_t hlen = strlen(header);
    size_t total = 8 + hlen + data_len;
    uint8_t *buf = calloc(1, total);
    uint64_t n = hlen;
    memcpy(buf, &n, 8);
    memcpy(buf + 8, header, hlen);
    write_bytes(path, buf, total);
    free(buf);
}

/* One tensor for the writer: name, dtype, shape and random contents. */
typedef struct {
    const char *name;
    pd_dtype dt;
    int ndim;
    int64_t shape[PD_ST_MAX_DIMS];
    uint8_t *data;
    size_t nbytes;
} tensor_spec;

#define SPEC(n, d, nd, ...)                                                                        \
    { .name = (n), .dt = (d), .ndim = (nd), .shape = __VA_ARGS__ }

static size_t spec_numel(const tensor_spec *s) {
    size_t n = 1;
    for (int d = 0; d < s->ndim; d++)
        n *= (size_t)s->shape[d];
    return n;
}

/* Fills spec data with values typical of its dtype (normal values encoded;
 * raw random bytes for FP8, NaN encodings included). */
static void spec_fill(tensor_spec *s, pd_rng *rng) {
    size_t n = spec_numel(s), es = pd_dtype_size(s->dt);
    s->nbytes = n * es;
    s->data = malloc(s->nbytes ? s->nbytes : 1);
    for (size_t i = 0; i < n; i++) {
        float f = (float)pd_rng_normal(rng);
        uint8_t *e = s->data + i * es;
        switch (s->dt) {
        case PD_DT_F32:
            memcpy(e, &f, 4);
            break;
        case PD_DT_BF16: {
            uint16_t h = pd_f32_to_bf16(f);
            memcpy(e, &h, 2);
            break;
        }
        case PD_DT_F16: {
            uint16_t h = pd_f32_to_f16(f);
            memcpy(e, &h, 2);
            break;
        }
        case PD_DT_F8_E4M3:
            *e = (uint8_t)pd_rng_next(rng);
            break;
        case PD_DT_I64: {
            int64_t v = (int64_t)(pd_rng_next(rng) % 100000) - 50000;
            memcpy(e, &v, 8);
            break;
        }
        case PD_DT_I32: {
            int32_t v = (int32_t)(pd_rng_next(rng) % 100000) - 50000;
            memcpy(e, &v, 4);
            break;
        }
        default:
            fail();
        }
    }
}

static void specs_free(tensor_spec *specs, int n) {
    for (int i = 0; i < n; i++)
        free(specs[i].data);
}

static void write_specs(const char *path, tensor_spec *specs, int n, size_t *size_p) {
    pd_err err;
    pd_st_writer *w = NULL;
    assert_int_equal(pd_st_writer_open(path, &w, &err), PD_OK);
    for (int i = 0; i < n; i++)
        assert_int_equal(pd_st_writer_declare(w, specs[i].name, specs[i].dt, specs[i].ndim,
                                              specs[i].shape, &err),
                         PD_OK);
    if (size_p)
        *size_p = pd_st_writer_size(w);
    for (int i = 0; i < n; i++)
        assert_int_equal(pd_st_writer_write(w, specs[i].name, specs[i].data, specs[i].nbytes, &err),
                         PD_OK);
    assert_int_equal(pd_st_writer_close(&w, &err), PD_OK);
    assert_null(w);
}

/* The expected fp32 value of element i of a spec, by the common/ conversions. */
static float spec_f32(const tensor_spec *s, size_t i) {
    const uint8_t *e = s->data + i * pd_dtype_size(s->dt);
    uint16_t h;
    switch (s->dt) {
    case PD_DT_F32: {
        float f;
        memcpy(&f, e, 4);
        return f;
    }
    case PD_DT_BF16:
        memcpy(&h, e, 2);
        return pd_bf16_to_f32(h);
    case PD_DT_F16:
        memcpy(&h, e, 2);
        return pd_f16_to_f32(h);
    case PD_DT_F8_E4M3:
        return pd_e4m3_to_f32(*e);
    case PD_DT_I64: {
        int64_t v;
        memcpy(&v, e, 8);
        return (float)v;
    }
    case PD_DT_I32: {
        int32_t v;
        memcpy(&v, e, 4);
        return (float)v;
    }
    default:
        return NAN;
    }
}

/* Checks that t holds exactly spec s. */
static void check_tensor(const pd_st_tensor *t, const tensor_spec *s) {
    assert_non_null(t);
    assert_string_equal(t->name, s->name);
    assert_int_equal(t->dtype, s->dt);
    assert_int_equal(t->ndim, s->ndim);
    for (int d = 0; d < s->ndim; d++)
        assert_int_equal(t->shape[d], s->shape[d]);
    assert_int_equal(t->nbytes, s->nbytes);
    if (s->nbytes)
        assert_memory_equal(t->data, s->data, s->nbytes);
    size_t n = spec_numel(s);
    float *f = malloc((n ? n : 1) * sizeof *f);
    pd_st_to_f32(t, f);
    for (size_t i = 0; i < n; i++) {
        float want = spec_f32(s, i);
        if (isnan(want))
            assert_true(isnan(f[i]));
        else
            assert_true(f[i] == want);
    }
    free(f);
}

/* ---- dtypes ---------------------------------------------------------- */

static void test_dtype_names(void **state) {
    (void)state;
    static const size_t sizes[PD_DT_COUNT] = {4, 2, 2, 1, 8, 4};
    for (int i = 0; i < PD_DT_COUNT; i++) {
        pd_dtype dt;
        assert_int_equal(pd_dtype_size((pd_dtype)i), sizes[i]);
        assert_int_equal(pd_dtype_parse(pd_dtype_name((pd_dtype)i), &dt), PD_OK);
        assert_int_equal(dt, i);
    }
    pd_dtype dt = PD_DT_F32;
    assert_int_equal(pd_dtype_parse("F64", &dt), PD_ERR_UNSUPPORTED);
    assert_int_equal(pd_dtype_parse("bf16", &dt), PD_ERR_UNSUPPORTED);
    assert_int_equal(pd_dtype_size(PD_DT_COUNT), 0);
    assert_string_equal(pd_dtype_name(PD_DT_F8_E4M3), "F8_E4M3");
}

/* ---- round trips ----------------------------------------------------- */

static tensor_spec round_trip_specs[] = {
    SPEC("model.embed_tokens.weight", PD_DT_BF16, 2, {7, 12}),
    SPEC("w.f32", PD_DT_F32, 2, {3, 5}),
    SPEC("h.f16", PD_DT_F16, 1, {7}),
    SPEC("q_proj.weight", PD_DT_F8_E4M3, 3, {4, 4, 2}),
    SPEC("odd.e4m3", PD_DT_F8_E4M3, 1, {3}), /* leaves the next tensor unaligned */
    SPEC("after_odd.f32", PD_DT_F32, 4, {1, 2, 1, 3}),
    SPEC("scalar.i32", PD_DT_I32, 0, {0}),
    SPEC("ids.i64", PD_DT_I64, 1, {3}),
    SPEC("empty", PD_DT_F32, 2, {0, 3}),
    SPEC("t\xc3\xa9nsor.unicode", PD_DT_BF16, 1, {2}),
};
#define N_ROUND_TRIP ((int)(sizeof round_trip_specs / sizeof round_trip_specs[0]))

static void test_round_trip(void **state) {
    const char *dir = *state;
    char *path = path_in(dir, "rt.safetensors");
    pd_rng rng;
    pd_rng_seed(&rng, 1);
    tensor_spec *specs = round_trip_specs;
    for (int i = 0; i < N_ROUND_TRIP; i++)
        spec_fill(&specs[i], &rng);
    size_t predicted;
    write_specs(path, specs, N_ROUND_TRIP, &predicted);

    /* the file: size as predicted, header padded to 8 with spaces, metadata,
     * data offsets contiguous in declaration order */
    size_t len;
    uint8_t *bytes = read_bytes(path, &len);
    assert_int_equal(len, predicted);
    uint64_t hlen;
    memcpy(&hlen, bytes, 8);
    assert_int_equal(hlen % 8, 0);
    json_error_t jerr;
    json_t *hdr = json_loadb((const char *)bytes + 8, hlen, 0, &jerr);
    assert_non_null(hdr);
    assert_string_equal(
        json_string_value(json_object_get(json_object_get(hdr, "__metadata__"), "format")), "pt");
    json_int_t prev_end = 0;
    for (int i = 0; i < N_ROUND_TRIP; i++) {
        json_t *off = json_object_get(json_object_get(hdr, specs[i].name), "data_offsets");
        assert_int_equal(json_integer_value(json_array_get(off, 0)), prev_end);
        prev_end = json_integer_value(json_array_get(off, 1));
    }
    assert_int_equal(8 + hlen + (uint64_t)prev_end, len);
    json_decref(hdr);
    const uint8_t *last = bytes + 8 + hlen - 1;
    assert_true(*last == '}' || *last == ' ');
    free(bytes);

    pd_err err;
    pd_safetensors *st = NULL;
    assert_int_equal(pd_st_open_file(path, &st, &err), PD_OK);
    assert_int_equal(pd_st_count(st), N_ROUND_TRIP);
    for (int i = 0; i < N_ROUND_TRIP; i++) {
        const pd_st_tensor *t = pd_st_at(st, i);
        check_tensor(t, &specs[i]);
        assert_ptr_equal(pd_st_find(st, specs[i].name), t);
        assert_string_equal(t->file, path);
    }
    assert_null(pd_st_at(st, N_ROUND_TRIP));
    assert_null(pd_st_find(st, "w.f3"));
    assert_null(pd_st_find(st, "__metadata__"));
    pd_st_close(&st);
    assert_null(st);
    pd_st_close(&st); /* safe on NULL */

    /* the directory form finds model.safetensors */
    char *single = path_in(dir, "model.safetensors");
    assert_int_equal(rename(path, single), 0);
    assert_int_equal(pd_st_open_dir(dir, &st, &err), PD_OK);
    assert_int_equal(pd_st_count(st), N_ROUND_TRIP);
    check_tensor(pd_st_find(st, "q_proj.weight"), &specs[3]);
    pd_st_close(&st);

    specs_free(specs, N_ROUND_TRIP);
    free(single);
    free(path);
}

/* Many tensors: every one found by name (the hash table), in header order. */
static void test_many_tensors(void **state) {
    const char *dir = *state;
    char *path = path_in(dir, "many.safetensors");
    enum { N = 20000 };
    pd_err err;
    pd_st_writer *w;
    assert_int_equal(pd_st_writer_open(path, &w, &err), PD_OK);
    char name[64];
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.w", i / 256, i % 256);
        int64_t shape[1] = {1};
        assert_int_equal(pd_st_writer_declare(w, name, PD_DT_I32, 1, shape, &err), PD_OK);
    }
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.w", i / 256, i % 256);
        int32_t v = i;
        assert_int_equal(pd_st_writer_write(w, name, &v, 4, &err), PD_OK);
    }
    assert_int_equal(pd_st_writer_close(&w, &err), PD_OK);

    pd_safetensors *st;
    assert_int_equal(pd_st_open_file(path, &st, &err), PD_OK);
    assert_int_equal(pd_st_count(st), N);
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.w", i / 256, i % 256);
        const pd_st_tensor *t = pd_st_find(st, name);
        assert_ptr_equal(t, pd_st_at(st, i));
        int32_t v;
        memcpy(&v, t->data, 4);
        assert_int_equal(v, i);
    }
    pd_st_close(&st);
    free(path);
}

static void test_writer_errors(void **state) {
    const char *dir = *state;
    char *path = path_in(dir, "w.safetensors");
    pd_err err;
    pd_st_writer *w = NULL;
    int64_t shape[5] = {2, 2, 1, 1, 1};
    float data[4] = {1, 2, 3, 4};

    char *bad_dir = path_in(dir, "no/such/dir.safetensors");
    assert_int_equal(pd_st_writer_open(bad_dir, &w, &err), PD_ERR_IO);
    assert_non_null(strstr(err.msg, bad_dir));
    free(bad_dir);

    assert_int_equal(pd_st_writer_open(path, &w, &err), PD_OK);
    assert_int_equal(pd_st_writer_declare(w, "a", PD_DT_F32, 2, shape, &err), PD_OK);
    assert_int_equal(pd_st_writer_declare(w, "a", PD_DT_F32, 2, shape, &err), PD_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'a'"));
    assert_int_equal(pd_st_writer_declare(w, "b", PD_DT_F32, 5, shape, &err), PD_ERR_INVALID);
    assert_int_equal(pd_st_writer_declare(w, "b", PD_DT_F32, -1, shape, &err), PD_ERR_INVALID);
    assert_int_equal(pd_st_writer_declare(w, "b", PD_DT_COUNT, 2, shape, &err), PD_ERR_INVALID);
    assert_int_equal(pd_st_writer_declare(w, "__metadata__", PD_DT_F32, 2, shape, &err),
                     PD_ERR_INVALID);
    assert_int_equal(pd_st_writer_declare(w, "bad\xff", PD_DT_F32, 2, shape, &err), PD_ERR_INVALID);
    int64_t neg[1] = {-3};
    assert_int_equal(pd_st_writer_declare(w, "b", PD_DT_F32, 1, neg, &err), PD_ERR_INVALID);
    assert_int_equal(pd_st_writer_declare(w, "b", PD_DT_BF16, 1, shape, &err), PD_OK);

    /* out of order, wrong size */
    assert_int_equal(pd_st_writer_write(w, "b", data, 4, &err), PD_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'b'"));
    assert_int_equal(pd_st_writer_write(w, "a", data, 12, &err), PD_ERR_INVALID);
    assert_non_null(strstr(err.msg, path));
    assert_int_equal(pd_st_writer_write(w, "a", data, 16, &err), PD_OK);
    /* no declarations once data has begun */
    assert_int_equal(pd_st_writer_declare(w, "c", PD_DT_F32, 1, shape, &err), PD_ERR_INVALID);
    /* closing with "b" unwritten fails and leaves no file */
    assert_int_equal(pd_st_writer_close(&w, &err), PD_ERR_INVALID);
    assert_null(w);
    assert_non_null(strstr(err.msg, "'b'"));
    assert_int_equal(access(path, F_OK), -1);

    /* writing past the last declaration */
    assert_int_equal(pd_st_writer_open(path, &w, &err), PD_OK);
    assert_int_equal(pd_st_writer_declare(w, "a", PD_DT_F32, 1, shape, &err), PD_OK);
    assert_int_equal(pd_st_writer_write(w, "a", data, 8, &err), PD_OK);
    assert_int_equal(pd_st_writer_write(w, "a", data, 8, &err), PD_ERR_INVALID);
    assert_int_equal(pd_st_writer_close(&w, &err), PD_OK);

    /* an empty checkpoint is valid */
    assert_int_equal(pd_st_writer_open(path, &w, &err), PD_OK);
    assert_int_equal(pd_st_writer_close(&w, &err), PD_OK);
    pd_safetensors *st;
    assert_int_equal(pd_st_open_file(path, &st, &err), PD_OK);
    assert_int_equal(pd_st_count(st), 0);
    assert_null(pd_st_find(st, "a"));
    pd_st_close(&st);
    assert_int_equal(pd_st_writer_close(&w, &err), PD_OK); /* NULL: nothing */
    free(path);
}

/* ---- sharded --------------------------------------------------------- */

#define SHARD1 "model-00001-of-00002.safetensors"
#define SHARD2 "model-00002-of-00002.safetensors"

static tensor_spec shard1_specs[] = {
    SPEC("model.layers.0.a", PD_DT_BF16, 2, {4, 8}),
    SPEC("model.layers.0.b", PD_DT_F32, 1, {5}),
};
static tensor_spec shard2_specs[] = {
    SPEC("model.layers.1.c", PD_DT_F8_E4M3, 2, {16, 16}),
    SPEC("model.layers.1.d", PD_DT_F16, 3, {2, 3, 4}),
    SPEC("unmapped", PD_DT_F32, 1, {2}),         /* in the file, absent from the weight_map */
    SPEC("model.layers.0.b", PD_DT_F32, 1, {5}), /* a stale copy: the map says shard 1 */
};
#define N_SHARD2 4

static void write_index(const char *dir, const char *text) {
    char *p = path_in(dir, "model.safetensors.index.json");
    write_bytes(p, text, strlen(text));
    free(p);
}

static void write_shards(const char *dir) {
    pd_rng rng;
    pd_rng_seed(&rng, 2);
    for (int i = 0; i < 2; i++)
        spec_fill(&shard1_specs[i], &rng);
    for (int i = 0; i < N_SHARD2; i++)
        spec_fill(&shard2_specs[i], &rng);
    char *p1 = path_in(dir, SHARD1), *p2 = path_in(dir, SHARD2);
    write_specs(p1, shard1_specs, 2, NULL);
    write_specs(p2, shard2_specs, N_SHARD2, NULL);
    free(p1);
    free(p2);
}

static void test_sharded(void **state) {
    const char *dir = *state;
    write_shards(dir);
    /* weight_map order differs from the files' order on purpose */
    write_index(dir, "{\"metadata\": {\"total_size\": 1234}, \"weight_map\": {"
                     "\"model.layers.1.d\": \"" SHARD2 "\","
                     "\"model.layers.0.a\": \"" SHARD1 "\","
                     "\"model.layers.1.c\": \"" SHARD2 "\","
                     "\"model.layers.0.b\": \"" SHARD1 "\"}}");
    pd_err err;
    pd_safetensors *st = NULL;
    assert_int_equal(pd_st_open_dir(dir, &st, &err), PD_OK);
    assert_int_equal(pd_st_count(st), 4);
    char *p1 = path_in(dir, SHARD1), *p2 = path_in(dir, SHARD2);
    /* files in order of first mention (shard 2 first), header order within */
    const tensor_spec *order[4] = {&shard2_specs[0], &shard2_specs[1], &shard1_specs[0],
                                   &shard1_specs[1]};
    const char *files[4] = {p2, p2, p1, p1};
    for (int i = 0; i < 4; i++) {
        const pd_st_tensor *t = pd_st_at(st, i);
        check_tensor(t, order[i]);
        assert_ptr_equal(pd_st_find(st, order[i]->name), t);
        assert_string_equal(t->file, files[i]);
    }
    assert_null(pd_st_find(st, "unmapped"));
    pd_st_close(&st);

    /* the index wins over a model.safetensors next to it */
    char *single = path_in(dir, "model.safetensors");
    write_st_raw(single, "{}", 0);
    assert_int_equal(pd_st_open_dir(dir, &st, &err), PD_OK);
    assert_int_equal(pd_st_count(st), 4);
    pd_st_close(&st);
    unlink(single);
    free(single);

    for (int i = 0; i < 2; i++)
        free(shard1_specs[i].data);
    for (int i = 0; i < N_SHARD2; i++)
        free(shard2_specs[i].data);
    free(p1);
    free(p2);
}

static void expect_dir_fails(const char *dir, pd_status want, const char *in_msg1,
                             const char *in_msg2) {
    pd_err err = {{0}};
    pd_safetensors *st = NULL;
    assert_int_equal(pd_st_open_dir(dir, &st, &err), want);
    assert_null(st);
    if (in_msg1 && !strstr(err.msg, in_msg1))
        fail_msg("\"%s\" not in \"%s\"", in_msg1, err.msg);
    if (in_msg2 && !strstr(err.msg, in_msg2))
        fail_msg("\"%s\" not in \"%s\"", in_msg2, err.msg);
}

static void test_sharded_errors(void **state) {
    const char *dir = *state;
    char *index = path_in(dir, "model.safetensors.index.json");
    char *p1 = path_in(dir, SHARD1);
    char *p3 = path_in(dir, "model-00003-of-00003.safetensors");

    expect_dir_fails(dir, PD_ERR_IO, dir, "model.safetensors");
    write_shards(dir);

    /* a mapped tensor missing from its file */
    write_index(dir, "{\"weight_map\": {\"model.layers.0.a\": \"" SHARD1 "\","
                     "\"model.layers.1.c\": \"" SHARD1 "\"}}");
    expect_dir_fails(dir, PD_ERR_NOTFOUND, "model.layers.1.c", p1);
    /* a missing shard */
    write_index(dir, "{\"weight_map\": {\"x\": \"model-00003-of-00003.safetensors\"}}");
    expect_dir_fails(dir, PD_ERR_IO, p3, NULL);
    /* shard names leaving the directory */
    write_index(dir, "{\"weight_map\": {\"evil\": \"../" SHARD1 "\"}}");
    expect_dir_fails(dir, PD_ERR_FORMAT, index, "evil");
    write_index(dir, "{\"weight_map\": {\"evil\": \"/etc/passwd\"}}");
    expect_dir_fails(dir, PD_ERR_FORMAT, index, "evil");
    write_index(dir, "{\"weight_map\": {\"evil\": \"sub/x.safetensors\"}}");
    expect_dir_fails(dir, PD_ERR_FORMAT, index, "evil");
    write_index(dir, "{\"weight_map\": {\"evil\": \"..\"}}");
    expect_dir_fails(dir, PD_ERR_FORMAT, index, "evil");
    write_index(dir, "{\"weight_map\": {\"evil\": \"\"}}");
    expect_dir_fails(dir, PD_ERR_FORMAT, index, "evil");
    /* malformed index */
    write_index(dir, "{\"weight_map\": {\"a\": 3}}");
    expect_dir_fails(dir, PD_ERR_FORMAT, index, "'a'");
    write_index(dir, "{\"metadata\": {}}");
    expect_dir_fails(dir, PD_ERR_FORMAT, index, "weight_map");
    write_index(dir, "{\"weight_map\": [\"a\"]}");
    expect_dir_fails(dir, PD_ERR_FORMAT, index, "weight_map");
    write_index(dir, "{\"weight_map\": {\"a\": \"" SHARD1 "\", \"a\": \"" SHARD1 "\"}}");
    expect_dir_fails(dir, PD_ERR_FORMAT, index, "\"a\"");
    write_index(dir, "{\"weight_map\": ");
    expect_dir_fails(dir, PD_ERR_FORMAT, index, NULL);
    write_index(dir, "");
    expect_dir_fails(dir, PD_ERR_FORMAT, index, NULL);
    /* a bad shard is reported with the shard's name */
    write_st_raw(p3, "{\"bad.tensor\": {\"dtype\": \"F32\", \"shape\": [2]}}", 0);
    write_index(dir, "{\"weight_map\": {\"bad.tensor\": \"model-00003-of-00003.safetensors\"}}");
    expect_dir_fails(dir, PD_ERR_FORMAT, p3, "bad.tensor");

    for (int i = 0; i < 2; i++)
        free(shard1_specs[i].data);
    for (int i = 0; i < N_SHARD2; i++)
        free(shard2_specs[i].data);
    free(index);
    free(p1);
    free(p3);
}

/* ---- malformed files ------------------------------------------------- */

static void expect_file_fails(const char *path, pd_status want, const char *tensor) {
    pd_err err = {{0}};
    pd_safetensors *st = NULL;
    pd_status rc = pd_st_open_file(path, &st, &err);
    if (rc != want)
        fail_msg("%s: status %d (%s), want %d; message: %s", path, rc, pd_status_str(rc), want,
                 err.msg);
    assert_null(st);
    if (!strstr(err.msg, path))
        fail_msg("file name not in \"%s\"", err.msg);
    if (tensor && !strstr(err.msg, tensor))
        fail_msg("tensor \"%s\" not in \"%s\"", tensor, err.msg);
}

typedef struct {
    const char *header;
    size_t data_len;
    pd_status want;
    const char *tensor; /* must appear in the message; NULL when none */
} bad_header;

#define E(x) "\"bad.tensor\": " x
static const bad_header bad_headers[] = {
    /* JSON */
    {"{\"bad.tensor\": {", 16, PD_ERR_FORMAT, NULL},
    {"[1, 2]", 16, PD_ERR_FORMAT, NULL},
    {"\"str\"", 16, PD_ERR_FORMAT, NULL},
    {"{} trailing", 16, PD_ERR_FORMAT, NULL},
    {"{\"bad.tensor\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, "
     "\"bad.tensor\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
     16, PD_ERR_FORMAT, "bad.tensor"},
    /* entries */
    {"{" E("5") "}", 16, PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"shape\": [2], \"data_offsets\": [0, 8]}") "}", 16, PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"data_offsets\": [0, 8]}") "}", 16, PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [2]}") "}", 16, PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": 7, \"shape\": [2], \"data_offsets\": [0, 8]}") "}", 16, PD_ERR_FORMAT,
     "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": \"2\", \"data_offsets\": [0, 8]}") "}", 16,
     PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [2.0], \"data_offsets\": [0, 8]}") "}", 16,
     PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [\"2\"], \"data_offsets\": [0, 8]}") "}", 16,
     PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8, 8]}") "}", 16,
     PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [\"0\", \"8\"]}") "}", 16,
     PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": {}}") "}", 16, PD_ERR_FORMAT,
     "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [-8, -8]}") "}", 16,
     PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 0]}") "}", 16, PD_ERR_FORMAT,
     "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [-2], \"data_offsets\": [0, 8]}") "}", 16,
     PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [1, 1, 1, 1, 1], \"data_offsets\": [0, 4]}") "}", 16,
     PD_ERR_FORMAT, "bad.tensor"},
    {"{" E(
         "{\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], \"data_offsets\": [0, 8]}") "}",
     16, PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 99999999999999999999]}") "}",
     16, PD_ERR_FORMAT, NULL},
    /* dtypes */
    {"{" E("{\"dtype\": \"Q4_K\", \"shape\": [2], \"data_offsets\": [0, 8]}") "}", 16,
     PD_ERR_UNSUPPORTED, "bad.tensor"},
    {"{" E("{\"dtype\": \"F64\", \"shape\": [2], \"data_offsets\": [0, 16]}") "}", 16,
     PD_ERR_UNSUPPORTED, "bad.tensor"},
    /* sizes and offsets */
    {"{" E("{\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 8]}") "}", 16, PD_ERR_FORMAT,
     "bad.tensor"},
    {"{" E("{\"dtype\": \"BF16\", \"shape\": [2, 2], \"data_offsets\": [0, 16]}") "}", 16,
     PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [16], \"data_offsets\": [0, 64]}") "}", 32,
     PD_ERR_FORMAT, "bad.tensor"},
    {"{" E("{\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [16, 20]}") "}", 16,
     PD_ERR_FORMAT, "bad.tensor"},
    {"{\"first\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}, "
     "\"bad.tensor\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [8, 24]}}",
     32, PD_ERR_FORMAT, "bad.tensor"},
    {"{\"bad.tensor\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [8, 24]}, "
     "\"first\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [12, 20]}}",
     32, PD_ERR_FORMAT, "bad.tensor"},
    /* metadata */
    {"{\"__metadata__\": [\"pt\"]}", 0, PD_ERR_FORMAT, "__metadata__"},
    {"{\"__metadata__\": {\"format\": 1}}", 0, PD_ERR_FORMAT, "format"},
};
#undef E

static void test_bad_headers(void **state) {
    const char *dir = *state;
    char *path = path_in(dir, "bad.safetensors");
    for (size_t i = 0; i < sizeof bad_headers / sizeof bad_headers[0]; i++) {
        write_st_raw(path, bad_headers[i].header, bad_headers[i].data_len);
        expect_file_fails(path, bad_headers[i].want, bad_headers[i].tensor);
    }

    /* sanity: the same layout is accepted when right, including an empty
     * tensor sitting inside another's span and a gap between spans */
    write_st_raw(path,
                 "{\"__metadata__\": {\"format\": \"pt\"}, "
                 "\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}, "
                 "\"e\": {\"dtype\": \"F32\", \"shape\": [0, 9], \"data_offsets\": [8, 8]}, "
                 "\"b\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [20, 24]}}",
                 24);
    pd_safetensors *st;
    pd_err err;
    assert_int_equal(pd_st_open_file(path, &st, &err), PD_OK);
    assert_int_equal(pd_st_count(st), 3);
    assert_int_equal(pd_st_find(st, "b")->nbytes, 4);
    pd_st_close(&st);
    free(path);
}

static void test_bad_files(void **state) {
    const char *dir = *state;
    char *path = path_in(dir, "broken.safetensors");

    write_bytes(path, "", 0); /* 0-length */
    expect_file_fails(path, PD_ERR_FORMAT, NULL);
    write_bytes(path, "\x10\0\0\0\0\0\0", 7); /* shorter than the length */
    expect_file_fails(path, PD_ERR_FORMAT, NULL);

    uint8_t buf[64] = {0};
    uint64_t n = 1000; /* header length past the end */
    memcpy(buf, &n, 8);
    memcpy(buf + 8, "{}", 2);
    write_bytes(path, buf, sizeof buf);
    expect_file_fails(path, PD_ERR_FORMAT, NULL);
    n = 57; /* one past */
    memcpy(buf, &n, 8);
    write_bytes(path, buf, sizeof buf);
    expect_file_fails(path, PD_ERR_FORMAT, NULL);
    n = UINT64_MAX;
    memcpy(buf, &n, 8);
    write_bytes(path, buf, sizeof buf);
    expect_file_fails(path, PD_ERR_FORMAT, NULL);
    n = 0; /* empty header text */
    memcpy(buf, &n, 8);
    write_bytes(path, buf, sizeof buf);
    expect_file_fails(path, PD_ERR_FORMAT, NULL);

    /* a NUL inside the header */
    const char hdr[] = "{\"a\0b\": {}}";
    n = sizeof hdr - 1;
    memcpy(buf, &n, 8);
    memcpy(buf + 8, hdr, sizeof hdr - 1);
    write_bytes(path, buf, 8 + sizeof hdr - 1);
    expect_file_fails(path, PD_ERR_FORMAT, NULL);

    /* garbage: random bytes, and random bytes behind a plausible length */
    pd_rng rng;
    pd_rng_seed(&rng, 3);
    uint8_t garbage[4096];
    for (int round = 0; round < 50; round++) {
        for (size_t i = 0; i < sizeof garbage; i++)
            garbage[i] = (uint8_t)pd_rng_next(&rng);
        if (round % 2) {
            n = pd_rng_next(&rng) % (sizeof garbage - 8);
            memcpy(garbage, &n, 8);
        }
        write_bytes(path, garbage, sizeof garbage);
        expect_file_fails(path, PD_ERR_FORMAT, NULL);
    }

    /* I/O: missing file, a directory */
    char *missing = path_in(dir, "missing.safetensors");
    expect_file_fails(missing, PD_ERR_IO, NULL);
    expect_file_fails(dir, PD_ERR_IO, NULL);
    free(missing);
    free(path);
}

/* Random bit flips and byte overwrites in the length and header of a valid
 * file: every open either fails cleanly or yields tensors that lie inside
 * the file and are consistent with their shapes. Run under ASan. */
static void test_header_mutations(void **state) {
    const char *dir = *state;
    char *good = path_in(dir, "good.safetensors");
    char *path = path_in(dir, "mutant.safetensors");
    pd_rng rng;
    pd_rng_seed(&rng, 4);
    tensor_spec specs[] = {
        SPEC("a.weight", PD_DT_BF16, 2, {3, 4}), SPEC("b.weight", PD_DT_F32, 1, {5}),
        SPEC("c", PD_DT_F8_E4M3, 3, {2, 2, 2}),  SPEC("d", PD_DT_F16, 0, {0}),
        SPEC("empty", PD_DT_F32, 2, {0, 4}),     SPEC("ids", PD_DT_I64, 1, {2}),
    };
    int n_specs = (int)(sizeof specs / sizeof specs[0]);
    for (int i = 0; i < n_specs; i++)
        spec_fill(&specs[i], &rng);
    write_specs(good, specs, n_specs, NULL);
    size_t len;
    uint8_t *orig = read_bytes(good, &len);
    uint64_t hlen;
    memcpy(&hlen, orig, 8);
    size_t span = 8 + (size_t)hlen;
    uint8_t *buf = malloc(len);
    float *scratch = malloc(len * sizeof(float));

    int accepted = 0;
    for (int iter = 0; iter < 2000; iter++) {
        memcpy(buf, orig, len);
        int flips = 1 + (int)(pd_rng_next(&rng) % 4);
        for (int k = 0; k < flips; k++) {
            size_t pos = pd_rng_next(&rng) % span;
            switch (iter % 3) {
            case 0: /* a bit flip anywhere, the length included */
                buf[pos] ^= (uint8_t)(1u << (pd_rng_next(&rng) % 8));
                break;
            case 1: /* a JSON-ish character: breaks the syntax or the types */
                buf[pos] = (uint8_t) "{}[]\",:0123456789-e. aFBI_"[pd_rng_next(&rng) % 26];
                break;
            default: /* a digit for a digit: valid JSON, wrong shapes and offsets */
                while (pos < span && (buf[pos] < '0' || buf[pos] > '9'))
                    pos++;
                if (pos < span)
                    buf[pos] = (uint8_t)('0' + pd_rng_next(&rng) % 10);
                break;
            }
        }
        size_t out_len = (iter % 17 == 0) ? pd_rng_next(&rng) % len : len; /* truncations */
        write_bytes(path, buf, out_len);

        pd_safetensors *st = NULL;
        pd_err err = {{0}};
        pd_status rc = pd_st_open_file(path, &st, &err);
        if (rc != PD_OK) {
            assert_true(rc == PD_ERR_FORMAT || rc == PD_ERR_UNSUPPORTED);
            assert_null(st);
            assert_non_null(strstr(err.msg, path));
            continue;
        }
        accepted++;
        for (size_t i = 0; i < pd_st_count(st); i++) {
            const pd_st_tensor *t = pd_st_at(st, i);
            assert_true(t->ndim >= 0 && t->ndim <= PD_ST_MAX_DIMS);
            size_t numel = 1;
            for (int d = 0; d < t->ndim; d++)
                numel *= (size_t)t->shape[d];
            assert_int_equal(numel * pd_dtype_size(t->dtype), t->nbytes);
            assert_true(t->nbytes <= out_len);
            assert_ptr_equal(pd_st_find(st, t->name), t);
            pd_st_to_f32(t, scratch); /* touches every byte of the tensor */
        }
        pd_st_close(&st);
    }
    /* some mutations (a flipped bit in a name, say) keep the file valid */
    assert_true(accepted > 0);
    print_message("header mutations: %d of 2000 accepted\n", accepted);

    specs_free(specs, n_specs);
    free(scratch);
    free(buf);
    free(orig);
    free(path);
    free(good);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtype_names),
        cmocka_unit_test_setup_teardown(test_round_trip, tmpdir_setup, tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_many_tensors, tmpdir_setup, tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_writer_errors, tmpdir_setup, tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_sharded, tmpdir_setup, tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_sharded_errors, tmpdir_setup, tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_bad_headers, tmpdir_setup, tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_bad_files, tmpdir_setup, tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_header_mutations, tmpdir_setup, tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Checkpoint verification (model/verify.c) on good and damaged checkpoints
 * written by pd_mkmodel_write (preset "tiny", seed 5; sharded at 10 MB like
 * `pdserve mkmodel --preset tiny --shard-size 0.01`; an FP8 variant as in
 * test_fp8.c). Each damage must fail with the status and a message naming
 * the file (and the tensor); good checkpoints must pass and round-trip a
 * manifest. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pd_model.h"

#define SHARD_BYTES 10000000 /* 0.01 GB */

/* ---- fixtures -------------------------------------------------------- */

typedef struct {
    char root[512];   /* mkdtemp */
    char single[600]; /* tiny, model.safetensors */
    char sharded[600];
    char fp8[600];
} fixture;

static void rm_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        char p[1200];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat sb;
        if (lstat(p, &sb) == 0 && S_ISDIR(sb.st_mode))
            rm_tree(p);
        else
            unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static int setup(void **state) {
    fixture *f = calloc(1, sizeof *f);
    const char *base = getenv("TMPDIR");
    snprintf(f->root, sizeof f->root, "%s/pd_verify_XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(f->root))
        return -1;
    snprintf(f->single, sizeof f->single, "%s/single", f->root);
    snprintf(f->sharded, sizeof f->sharded, "%s/sharded", f->root);
    snprintf(f->fp8, sizeof f->fp8, "%s/fp8", f->root);
    pd_err err = {{0}};
    pd_model_config cfg;
    if (pd_preset_config("tiny", &cfg, &err) != PD_OK ||
        pd_mkmodel_write(&cfg, 5, f->single, 0, NULL, &err) ||
        pd_mkmodel_write(&cfg, 5, f->sharded, SHARD_BYTES, NULL, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    cfg.fp8 = true;
    cfg.fp8_block[0] = cfg.fp8_block[1] = 128;
    cfg.hidden_size = 192; /* partial edge blocks */
    if (pd_mkmodel_write(&cfg, 5, f->fp8, 0, NULL, &err) != PD_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    rm_tree(f->root);
    free(f);
    return 0;
}

/* A fresh copy of src at root/name (cp -r of plain files). */
static void copy_dir(const char *src, const char *dst) {
    char cmd[2600];
    rm_tree(dst);
    snprintf(cmd, sizeof cmd, "cp -r '%s' '%s'", src, dst);
    assert_int_equal(system(cmd), 0);
}

/* Messages collected from a run. */
typedef struct {
    char text[16384];
    int problems, notes;
} sink;

static void collect(void *user, bool problem, const char *msg) {
    sink *s = user;
    size_t n = strlen(s->text);
    snprintf(s->text + n, sizeof s->text - n, "%s%s\n", problem ? "P: " : "N: ", msg);
    if (problem)
        s->problems++;
    else
        s->notes++;
}

static pd_status run(const char *dir, const char *manifest, const char *write_manifest, sink *s,
                     pd_verify_report *rep, pd_err *err) {
    memset(s, 0, sizeof *s);
    pd_verify_options o = {.manifest = manifest,
                           .write_manifest = write_manifest,
                           .hash = true,
                           .jobs = 3,
                           .on_message = collect,
                           .user = s};
    return pd_verify_checkpoint(dir, &o, rep, err);
}

#define assert_has(s, needle)                                                                      \
    do {                                                                                           \
        if (!strstr((s), (needle)))                                                                \
            fail_msg("'%s' not in:\n%s", (needle), (s));                                           \
    } while (0)

static void file_path(char *out, size_t n, const char *dir, const char *name) {
    snprintf(out, n, "%s/%s", dir, name);
}

/* ---- good checkpoints ------------------------------------------------- */

static void test_good_single_and_manifest(void **state) {
    fixture *f = *state;
    char work[700], man[800];
    snprintf(work, sizeof work, "%s/good1", f->root);
    copy_dir(f->single, work);
    snprintf(man, sizeof man, "%s/good1.manifest.json", f->root);
    sink s;
    pd_verify_report r;
    pd_err err = {{0}};
    pd_status st = run(work, NULL, man, &s, &r, &err);
    if (st != PD_OK)
        fail_msg("%s", s.text);
    assert_true(r.manifest_written);
    assert_int_equal(r.n_shards, 1);
    assert_int_equal(r.n_files, 2); /* config.json, model.safetensors */
    assert_true(r.n_tensors == r.n_config_tensors);
    assert_true(r.bytes_hashed > 30000000);

    json_t *m = json_load_file(man, 0, NULL);
    assert_non_null(m);
    assert_int_equal(json_object_size(m), 2);
    json_t *e = json_object_get(m, "model.safetensors");
    assert_non_null(e);
    assert_int_equal(strlen(json_string_value(json_object_get(e, "sha256"))), 64);
    json_decref(m);

    st = run(work, man, NULL, &s, &r, &err);
    if (st != PD_OK)
        fail_msg("%s", s.text);
    assert_int_equal(s.problems, 0);
}

static void test_good_sharded(void **state) {
    fixture *f = *state;
    char man[800];
    snprintf(man, sizeof man, "%s/sharded.manifest.json", f->root);
    sink s;
    pd_verify_report r;
    pd_err err = {{0}};
    if (run(f->sharded, NULL, man, &s, &r, &err) != PD_OK)
        fail_msg("%s", s.text);
    assert_int_equal(r.n_shards, 3);
    assert_int_equal(r.n_files, 5); /* config, index, 3 shards */
    if (run(f->sharded, man, NULL, &s, &r, &err) != PD_OK)
        fail_msg("%s", s.text);
}

static void test_good_fp8(void **state) {
    fixture *f = *state;
    sink s;
    pd_verify_report r;
    pd_err err = {{0}};
    if (run(f->fp8, NULL, NULL, &s, &r, &err) != PD_OK)
        fail_msg("%s", s.text);
    assert_true(r.n_tensors > r.n_config_tensors); /* the scales */
}

/* A manifest inside the directory it describes is not hashed itself. */
static void test_manifest_inside_dir(void **state) {
    fixture *f = *state;
    char work[700], man[800];
    snprintf(work, sizeof work, "%s/inside", f->root);
    copy_dir(f->single, work);
    file_path(man, sizeof man, work, "manifest.json");
    sink s;
    pd_verify_report r;
    pd_err err = {{0}};
    assert_int_equal(run(work, NULL, man, &s, &r, &err), PD_OK);
    assert_int_equal(run(work, man, man, &s, &r, &err), PD_OK); /* compare, then rewrite */
    assert_int_equal(s.notes, 0);
}

/* ---- damage ----------------------------------------------------------- */

static void test_flipped_byte(void **state) {
    fixture *f = *state;
    char work[700], man[800], path[800];
    snprintf(work, sizeof work, "%s/flip", f->root);
    copy_dir(f->single, work);
    snprintf(man, sizeof man, "%s/flip.manifest.json", f->root);
    sink s;
    pd_verify_report r;
    pd_err err = {{0}};
    assert_int_equal(run(work, NULL, man, &s, &r, &err), PD_OK);

    file_path(path, sizeof path, work, "model.safetensors");
    FILE *fp = fopen(path, "r+b");
    assert_non_null(fp);
    fseek(fp, -4096, SEEK_END); /* tensor data, far from the header */
    int c = fgetc(fp);
    fseek(fp, -4096, SEEK_END);
    fputc(c ^ 0x10, fp);
    fclose(fp);

    /* headers and config still hold: only the digest can tell */
    assert_int_equal(run(work, NULL, NULL, &s, &r, &err), PD_OK);
    assert_int_equal(run(work, man, NULL, &s, &r, &err), PD_ERR_FORMAT);
    assert_int_equal(s.problems, 1);
    assert_has(s.text, "model.safetensors: SHA-256");
    assert_has(err.msg, "differs from the manifest");
}

static void test_truncated_shard(void **state) {
    fixture *f = *state;
    char work[700], path[800];
    snprintf(work, sizeof work, "%s/trunc", f->root);
    copy_dir(f->sharded, work);
    file_path(path, sizeof path, work, "model-00003-of-00003.safetensors");
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(truncate(path, sb.st_size - 1000), 0);
    sink s;
    pd_verify_report r;
    pd_err err = {{0}};
    assert_int_equal(run(work, NULL, NULL, &s, &r, &err), PD_ERR_FORMAT);
    assert_has(s.text, "model-00003-of-00003.safetensors: truncated");
    assert_has(s.text, "(1000 bytes missing)");
    assert_has(s.text, "tensor '"); /* the header check names the tensor past the end */
}

static void test_trailing_bytes(void **state) {
    fixture *f = *state;
    char work[700], path[800];
    snprintf(work, sizeof work, "%s/trail", f->root);
    copy_dir(f->single, work);
    file_path(path, sizeof path, work, "model.safetensors");
    FILE *fp = fopen(path, "ab");
    fputs("junk", fp);
    fclose(fp);
    sink s;
    pd_verify_report r;
    pd_err err = {{0}};
    assert_int_equal(run(work, NULL, NULL, &s, &r, &err), PD_ERR_FORMAT);
    assert_has(s.text, "model.safetensors: 4 bytes after the last tensor's data");
}

static void test_missing_shard(void **state) {
    fixture *f = *state;
    char work[700], path[800];
    snprintf(work, sizeof work, "%s/missing", f->root);
    copy_dir(f->sharded, work);
    file_path(path, sizeof path, work, "model-00002-of-00003.safetensors");
    assert_int_equal(unlink(path), 0);
    sink s;
    pd_verify_report r;
    pd_err err = {{0}};
    assert_int_equal(run(work, NULL, NULL, &s, &r, &err), PD_ERR_NOTFOUND);
    assert_has(err.msg, "model-00002-of-00003.safetensors: missing shard");
    assert_has(err.msg, "(e.g. 'model.");
    assert_int_equal(s.problems, 1); /* its tensors are not reported again one by one */
}

static void test_index_lies(void **state) {
    fixture *f = *state;
    char work[700], path[800];
    snprintf(work, sizeof work, "%s/index", f->root);
    copy_dir(f->sharded, work);
    file_path(path, sizeof path, work, "model.safetensors.index.json");
    json_t *idx = json_load_file(path, 0, NULL);
    assert_non_null(idx);
    json_t *wm = json_object_get(idx, "weight_map");
    /* a tensor moved to a shard that lacks it, and a wrong total */
    json_object_set_new(wm, "lm_head.weight", json_string("model-00001-of-00003.safetensors"));
    const char *home = json_string_value(json_object_get(wm, "model.embed_tokens.weight"));
    assert_string_equal(home, "model-00001-of-00003.safetensors");
    json_object_set_new(json_object_get(idx, "metadata"), "total_size", json_integer(12345));
    assert_int_equal(json_dump_file(idx, path, JSON_INDENT(2)), 0);
    json_decref(idx);
    sink s;
    pd_verify_report r;
    pd_err err = {{0}};
    assert_int_not_equal(run(work, NULL, NULL, &s, &r, &err), PD_OK);
    assert_has(
        s.text,
        "tensor 'lm_head.weight' is mapped to model-00001-of-00003.safetensors, which lacks it");
    assert_has(s.text, "metadata.total_size is 12345");
}

static void test_wrong_manifest_entry(void **state) {
    fixture *f = *state;
    char work[700], man[800];
    snprintf(work, sizeof work, "%s/wrongman", f->root);
    copy_dir(f->single, work);
    snprintf(man, sizeof man, "%s/wrongman.manifest.json", f->root);
    sink s;
    pd_verify_report r;
    pd_err err = {{0}};
    assert_int_equal(run(work, NULL, man, &s, &r, &err), PD_OK);

    json_t *m = json_load_file(man, 0, NULL);
    json_object_set_new(json_object_get(m, "config.json"), "size", json_integer(1));
    json_object_set_new(
        json_object_get(m, "model.safetensors"), "sha256",
        json_string("0000000000000000000000000000000000000000000000000000000000000000"));
    json_object_set_new(
        m, "model-00009-of-00009.safetensors",
        json_pack("{s:I,s:s}", "size", (json_int_t)10, "sha256",
                  "1111111111111111111111111111111111111111111111111111111111111111"));
    json_object_set_new(m, "bad-entry", json_pack("{s:s}", "sha256", "xyz"));
    assert_int_equal(json_dump_file(m, man, 0), 0);
    json_decref(m);

    assert_int_not_equal(run(work, man, NULL, &s, &r, &err), PD_OK);
    assert_has(s.text, "config.json: ");
    assert_has(s.text, "bytes, the manifest says 1");
    assert_has(s.text, "model.safetensors: SHA-256");
    assert_has(s.text, "model-00009-of-00009.safetensors: missing (listed in the manifest");
    assert_has(s.text, "entry 'bad-entry' is not {\"size\"");
    assert_int_equal(s.problems, 4);

    /* an unlisted weight file is a problem, an unlisted README a note */
    assert_int_equal(run(work, NULL, man, &s, &r, &err), PD_OK); /* rewrite a true one */
    char p[800];
    file_path(p, sizeof p, work, "README.md");
    FILE *fp = fopen(p, "w");
    fputs("hello\n", fp);
    fclose(fp);
    assert_int_equal(run(work, man, NULL, &s, &r, &err), PD_OK);
    assert_has(s.text, "N: README.md: not listed in the manifest");
    file_path(p, sizeof p, work, "extra.safetensors");
    fp = fopen(p, "w");
    fputs("x", fp);
    fclose(fp);
    assert_int_equal(run(work, man, NULL, &s, &r, &err), PD_ERR_NOTFOUND);
    assert_has(s.text, "P: extra.safetensors: not listed in the manifest");
    assert_has(s.text, "N: extra.safetensors: not part of the checkpoint");
}

static void test_config_mismatch(void **state) {
    fixture *f = *state;
    char work[700], path[800];
    snprintf(work, sizeof work, "%s/cfg", f->root);
    copy_dir(f->single, work);
    file_path(path, sizeof path, work, "config.json");
    json_t *c = json_load_file(path, 0, NULL);
    int layers = (int)json_integer_value(json_object_get(c, "num_hidden_layers"));
    json_object_set_new(c, "num_hidden_layers", json_integer(layers + 1));
    assert_int_equal(json_dump_file(c, path, JSON_INDENT(2)), 0);
    sink s;
    pd_verify_report r;
    pd_err err = {{0}};
    assert_int_equal(run(work, NULL, NULL, &s, &r, &err), PD_ERR_NOTFOUND);
    char want[160];
    snprintf(want, sizeof want,
             "model.safetensors: missing tensor 'model.layers.%d.input_layernorm.weight', which "
             "config.json implies",
             layers);
    assert_has(err.msg, want);

    /* fewer layers than the file has: the extra tensors are a note only */
    json_object_set_new(c, "num_hidden_layers", json_integer(layers - 1));
    assert_int_equal(json_dump_file(c, path, JSON_INDENT(2)), 0);
    assert_int_equal(run(work, NULL, NULL, &s, &r, &err), PD_OK);
    assert_has(s.text, "N: model.safetensors: ");
    assert_has(s.text, "tensors config.json does not imply");

    /* a width that disagrees with every matrix: messages are capped */
    json_object_set_new(c, "num_hidden_layers", json_integer(layers));
    json_object_set_new(c, "hidden_size", json_integer(96));
    assert_int_equal(json_dump_file(c, path, JSON_INDENT(2)), 0);
    json_decref(c);
    memset(&s, 0, sizeof s);
    pd_verify_options o = {.max_reported = 5, .on_message = collect, .user = &s};
    assert_int_equal(pd_verify_checkpoint(work, &o, &r, &err), PD_ERR_SHAPE);
    assert_has(err.msg, "model.safetensors: tensor 'model.embed_tokens.weight' has shape");
    assert_has(err.msg, "config.json implies");
    assert_int_equal(s.problems, 6); /* 5 shown + the "... and N more" line */
    assert_has(s.text, "more problems");
    assert_true(r.n_problems > 5);
}

static void test_fp8_scale(void **state) {
    fixture *f = *state;
    char work[700];
    snprintf(work, sizeof work, "%s/fp8bad", f->root);
    copy_dir(f->fp8, work);
    /* rewrite the file without one scale, through the writer */
    char src[800], dst[800];
    file_path(src, sizeof src, f->fp8, "model.safetensors");
    file_path(dst, sizeof dst, work, "model.safetensors");
    pd_err err = {{0}};
    pd_safetensors *st;
    assert_int_equal(pd_st_open_file(src, &st, &err), PD_OK);
    const char *drop = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv";
    assert_non_null(pd_st_find(st, drop));
    pd_st_writer *w;
    assert_int_equal(pd_st_writer_open(dst, &w, &err), PD_OK);
    for (size_t i = 0; i < pd_st_count(st); i++) {
        const pd_st_tensor *t = pd_st_at(st, i);
        if (strcmp(t->name, drop) != 0)
            assert_int_equal(pd_st_writer_declare(w, t->name, t->dtype, t->ndim, t->shape, &err),
                             PD_OK);
    }
    for (size_t i = 0; i < pd_st_count(st); i++) {
        const pd_st_tensor *t = pd_st_at(st, i);
        if (strcmp(t->name, drop) != 0)
            assert_int_equal(pd_st_writer_write(w, t->name, t->data, t->nbytes, &err), PD_OK);
    }
    assert_int_equal(pd_st_writer_close(&w, &err), PD_OK);
    pd_st_close(&st);
    sink s;
    pd_verify_report r;
    assert_int_equal(run(work, NULL, NULL, &s, &r, &err), PD_ERR_NOTFOUND);
    assert_has(err.msg, "FP8 tensor 'model.layers.0.self_attn.kv_b_proj.weight' has no "
                        "'model.layers.0.self_attn.kv_b_proj.weight_scale_inv'");
}

static void test_no_checkpoint(void **state) {
    fixture *f = *state;
    sink s;
    pd_verify_report r;
    pd_err err = {{0}};
    char empty[700];
    snprintf(empty, sizeof empty, "%s/empty", f->root);
    mkdir(empty, 0755);
    assert_int_not_equal(run(empty, NULL, NULL, &s, &r, &err), PD_OK);
    assert_has(s.text, "config.json");
    assert_has(s.text, "neither model.safetensors.index.json nor model.safetensors found");
    snprintf(empty, sizeof empty, "%s/does-not-exist", f->root);
    assert_int_equal(run(empty, NULL, NULL, &s, &r, &err), PD_ERR_IO);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_good_single_and_manifest),
        cmocka_unit_test(test_good_sharded),
        cmocka_unit_test(test_good_fp8),
        cmocka_unit_test(test_manifest_inside_dir),
        cmocka_unit_test(test_flipped_byte),
        cmocka_unit_test(test_truncated_shard),
        cmocka_unit_test(test_trailing_bytes),
        cmocka_unit_test(test_missing_shard),
        cmocka_unit_test(test_index_lies),
        cmocka_unit_test(test_wrong_manifest_entry),
        cmocka_unit_test(test_config_mismatch),
        cmocka_unit_test(test_fp8_scale),
        cmocka_unit_test(test_no_checkpoint),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

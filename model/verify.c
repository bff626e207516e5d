/* Checkpoint verification without loading: config, index, every shard's
 * size and header, the tensors the config implies (FP8 scales included),
 * and SHA-256 of every file against a manifest (pdserve verify; replicas'
 * --verify-checkpoint).
 *
 * Every problem is reported, not only the first, so that one run tells an
 * operator everything wrong with a copy. Hashing reads each file once with
 * plain read(2), `jobs` files at once (one thread per file: SHA-256 runs at
 * ~1.5-2 GB/s per core with SHA extensions, above one NVMe stream), largest
 * first so the last file does not start late. */
#include "model_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define V_INDEX_NAME     "model.safetensors.index.json"
#define V_SINGLE_NAME    "model.safetensors"
#define V_MAX_HEADER     100000000ull /* as safetensors.c: MAX_HEADER_SIZE of the reference */
#define V_READ_CHUNK     (8u << 20)
#define V_DEFAULT_JOBS   4
#define V_DEFAULT_REPORT 50

/* One regular file at the top level of the checkpoint directory. */
typedef struct {
    char *name;
    uint64_t size;
    bool hashed, read_failed;
    char sha256[65]; /* lowercase hex */
} v_file;

/* One safetensors file the checkpoint consists of. */
typedef struct {
    char *name;
    pd_safetensors *st; /* NULL: missing or invalid (reported) */
    size_t n_mapped;    /* tensors the index assigns to it */
    char *first_mapped;
} v_shard;

typedef struct {
    const char *dir;
    const pd_verify_options *opt;
    pd_verify_report *rep;
    pd_err *err;
    pd_status first; /* status of the first problem */
    int shown, hidden_problems, hidden_notes;

    v_file *files;
    int n_files;
    v_shard *shards;
    int n_shards;
    json_t *shard_ids;  /* file name -> index into shards */
    json_t *index;      /* parsed index; NULL for a single file */
    json_t *weight_map; /* borrowed from index */
    bool layout_ok;     /* the shard list is known */
} v_ctx;

/* ------------------------------------------------------------------ */
/* messages                                                            */
/* ------------------------------------------------------------------ */

static void v_default_message(void *user, bool problem, const char *msg) {
    fprintf(stderr, "verify: %s%s\n", problem ? "" : "note: ", msg);
}

/* Records a problem (st != PD_OK) or a note (st == PD_OK) and passes it on
 * while fewer than max_reported were. */
static void v_report(v_ctx *v, pd_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void v_report(v_ctx *v, pd_status st, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    bool problem = st != PD_OK;
    if (problem) {
        if (v->rep->n_problems++ == 0) {
            v->first = st;
            pd_err_set(v->err, st, "%s", msg);
        }
    } else {
        v->rep->n_notes++;
    }
    int max = v->opt->max_reported > 0 ? v->opt->max_reported : V_DEFAULT_REPORT;
    if (v->shown >= max) {
        if (problem)
            v->hidden_problems++;
        else
            v->hidden_notes++;
        return;
    }
    v->shown++;
    if (v->opt->on_message)
        v->opt->on_message(v->opt->user, problem, msg);
    else
        v_default_message(NULL, problem, msg);
}

static char *v_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = pd_xmalloc(a + b + 2);
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

static void v_shape_str(const pd_st_tensor *t, char *buf, size_t cap) {
    size_t off = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < t->ndim && off < cap; i++)
        off +=
            (size_t)snprintf(buf + off, cap - off, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (off < cap)
        snprintf(buf + off, cap - off, "]");
}

/* ------------------------------------------------------------------ */
/* the directory and the layout                                        */
/* ------------------------------------------------------------------ */

static int v_file_name_cmp(const void *a, const void *b) {
    return strcmp(((const v_file *)a)->name, ((const v_file *)b)->name);
}

/* Same file as path (the manifests are not part of what they describe). */
static bool v_same_file(const struct stat *sb, const char *path) {
    struct stat o;
    return path && stat(path, &o) == 0 && o.st_dev == sb->st_dev && o.st_ino == sb->st_ino;
}

/* Lists the regular, non-hidden files at the top level of dir. */
static pd_status v_list_dir(v_ctx *v) {
    DIR *d = opendir(v->dir);
    if (!d) {
        v_report(v, PD_ERR_IO, "%s: cannot open the directory: %s", v->dir, strerror(errno));
        return PD_ERR_IO;
    }
    int cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char *path = v_join(v->dir, e->d_name);
        struct stat sb;
        bool keep = stat(path, &sb) == 0 && S_ISREG(sb.st_mode) &&
                    !v_same_file(&sb, v->opt->manifest) &&
                    !v_same_file(&sb, v->opt->write_manifest);
        free(path);
        if (!keep)
            continue;
        if (v->n_files == cap) {
            cap = cap ? 2 * cap : 16;
            v->files = realloc(v->files, (size_t)cap * sizeof *v->files);
            PD_ASSERT(v->files);
        }
        v->files[v->n_files++] =
            (v_file){.name = pd_xstrdup(e->d_name), .size = (uint64_t)sb.st_size};
    }
    closedir(d);
    if (v->n_files > 1)
        qsort(v->files, (size_t)v->n_files, sizeof *v->files, v_file_name_cmp);
    v->rep->n_files = v->n_files;
    return PD_OK;
}

static v_file *v_file_find(v_ctx *v, const char *name) {
    for (int i = 0; i < v->n_files; i++)
        if (strcmp(v->files[i].name, name) == 0)
            return &v->files[i];
    return NULL;
}

static v_shard *v_shard_add(v_ctx *v, const char *name) {
    json_t *id = json_object_get(v->shard_ids, name);
    if (id)
        return &v->shards[json_integer_value(id)];
    v->shards = realloc(v->shards, (size_t)(v->n_shards + 1) * sizeof *v->shards);
    PD_ASSERT(v->shards);
    json_object_set_new(v->shard_ids, name, json_integer(v->n_shards));
    v_shard *s = &v->shards[v->n_shards++];
    *s = (v_shard){.name = pd_xstrdup(name)};
    return s;
}

/* The index's weight_map gives the shards; without an index the checkpoint
 * is model.safetensors. */
static void v_layout(v_ctx *v) {
    char *index_path = v_join(v->dir, V_INDEX_NAME);
    struct stat sb;
    if (stat(index_path, &sb) != 0) {
        free(index_path);
        if (!v_file_find(v, V_SINGLE_NAME)) {
            v_report(v, PD_ERR_NOTFOUND, "%s: neither %s nor %s found", v->dir, V_INDEX_NAME,
                     V_SINGLE_NAME);
            return;
        }
        v_shard_add(v, V_SINGLE_NAME);
        v->layout_ok = true;
        return;
    }
    json_error_t jerr;
    v->index = json_load_file(index_path, JSON_REJECT_DUPLICATES, &jerr);
    if (!v->index) {
        v_report(v, PD_ERR_FORMAT, "%s: not valid JSON: %s (line %d, column %d)", index_path,
                 jerr.text, jerr.line, jerr.column);
        free(index_path);
        return;
    }
    v->weight_map = json_is_object(v->index) ? json_object_get(v->index, "weight_map") : NULL;
    if (!json_is_object(v->weight_map)) {
        v_report(v, PD_ERR_FORMAT, "%s: no \"weight_map\" object", index_path);
        v->weight_map = NULL;
        free(index_path);
        return;
    }
    bool ok = true;
    const char *tname;
    json_t *jf;
    json_object_foreach(v->weight_map, tname, jf) {
        const char *fname = json_string_value(jf);
        if (!fname || !fname[0] || strchr(fname, '/') || strstr(fname, "..")) {
            v_report(v, PD_ERR_FORMAT, "%s: tensor '%s': the shard is not a plain file name",
                     index_path, tname);
            ok = false;
            continue;
        }
        v_shard *s = v_shard_add(v, fname);
        if (s->n_mapped++ == 0)
            s->first_mapped = pd_xstrdup(tname);
    }
    free(index_path);
    if (v_file_find(v, V_SINGLE_NAME) && !json_object_get(v->shard_ids, V_SINGLE_NAME))
        v_report(v, PD_OK, "%s: present next to %s, which the loader uses instead", V_SINGLE_NAME,
                 V_INDEX_NAME);
    v->layout_ok = ok;
}

/* ------------------------------------------------------------------ */
/* shards: size against header, header, index consistency              */
/* ------------------------------------------------------------------ */

/* Reads the header itself (independently of pd_st_open_file, which stops at
 * the first tensor past the end) to say how long the file should be:
 * 8 + header + the largest data_offsets end. Returns false when the header
 * cannot say (pd_st_open_file then reports why). */
static bool v_expected_size(const char *path, uint64_t size, uint64_t *header_p,
                            uint64_t *data_end_p) {
    if (size < 8)
        return false;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    uint64_t n;
    bool ok = pread(fd, &n, 8, 0) == 8 && n <= size - 8 && n <= V_MAX_HEADER;
    char *text = ok ? malloc(n ? n : 1) : NULL;
    ok = ok && text && pread(fd, text, n, 8) == (ssize_t)n;
    close(fd);
    json_t *root = ok ? json_loadb(text, n, 0, NULL) : NULL;
    free(text);
    if (!json_is_object(root)) {
        json_decref(root);
        return false;
    }
    uint64_t end = 0;
    const char *key;
    json_t *e;
    json_object_foreach(root, key, e) {
        json_t *off = json_is_object(e) ? json_object_get(e, "data_offsets") : NULL;
        json_t *je = json_array_get(off, 1);
        if (json_is_integer(je) && json_integer_value(je) > 0 &&
            (uint64_t)json_integer_value(je) > end)
            end = (uint64_t)json_integer_value(je);
    }
    json_decref(root);
    *header_p = n;
    *data_end_p = end;
    return true;
}

static void v_open_shard(v_ctx *v, v_shard *s) {
    v_file *f = v_file_find(v, s->name);
    if (!f) {
        if (v->index)
            v_report(v, PD_ERR_NOTFOUND, "%s: missing shard: %s maps %zu tensors to it (e.g. '%s')",
                     s->name, V_INDEX_NAME, s->n_mapped, s->first_mapped ? s->first_mapped : "");
        else
            v_report(v, PD_ERR_NOTFOUND, "%s: missing", s->name);
        return;
    }
    char *path = v_join(v->dir, s->name);
    uint64_t header = 0, data_end = 0;
    bool known = v_expected_size(path, f->size, &header, &data_end);
    uint64_t want = 8 + header + data_end;
    if (known && f->size < want)
        v_report(v, PD_ERR_FORMAT,
                 "%s: truncated: %llu bytes, its header implies %llu (%llu bytes missing)", s->name,
                 (unsigned long long)f->size, (unsigned long long)want,
                 (unsigned long long)(want - f->size));
    else if (known && f->size > want)
        v_report(v, PD_ERR_FORMAT,
                 "%s: %llu bytes after the last tensor's data (the file is %llu bytes, its header "
                 "implies %llu)",
                 s->name, (unsigned long long)(f->size - want), (unsigned long long)f->size,
                 (unsigned long long)want);
    pd_err e = {{0}};
    pd_status st = pd_st_open_file(path, &s->st, &e);
    free(path);
    if (st != PD_OK) {
        v_report(v, st, "%s", e.msg);
        return;
    }
    /* The format has no gaps: sorted spans must tile the data section. */
    uint64_t sum = 0;
    for (size_t i = 0; i < pd_st_count(s->st); i++)
        sum += pd_st_at(s->st, i)->nbytes;
    if (known && sum != data_end)
        v_report(v, PD_ERR_FORMAT,
                 "%s: the tensors hold %llu bytes but their data ends at byte %llu: gaps between "
                 "tensors",
                 s->name, (unsigned long long)sum, (unsigned long long)data_end);
    v->rep->n_tensors += pd_st_count(s->st);
}

/* Index against shards: each mapped tensor is in its shard, each tensor of a
 * shard is mapped there, total_size is the sum of the mapped bytes. */
static void v_check_index(v_ctx *v) {
    bool all_open = v->layout_ok;
    for (int i = 0; i < v->n_shards; i++)
        all_open = all_open && v->shards[i].st;
    uint64_t total = 0;
    const char *tname;
    json_t *jf;
    json_object_foreach(v->weight_map, tname, jf) {
        json_t *id =
            json_is_string(jf) ? json_object_get(v->shard_ids, json_string_value(jf)) : NULL;
        v_shard *s = id ? &v->shards[json_integer_value(id)] : NULL;
        if (!s || !s->st)
            continue; /* reported with the shard */
        const pd_st_tensor *t = pd_st_find(s->st, tname);
        if (!t)
            v_report(v, PD_ERR_NOTFOUND, "%s: tensor '%s' is mapped to %s, which lacks it",
                     V_INDEX_NAME, tname, s->name);
        else
            total += t->nbytes;
    }
    for (int i = 0; i < v->n_shards; i++) {
        v_shard *s = &v->shards[i];
        for (size_t k = 0; s->st && k < pd_st_count(s->st); k++) {
            const char *name = pd_st_at(s->st, k)->name;
            const char *mapped = json_string_value(json_object_get(v->weight_map, name));
            if (!mapped)
                v_report(v, PD_OK, "%s: tensor '%s' is not in %s (the loader ignores it)", s->name,
                         name, V_INDEX_NAME);
            else if (strcmp(mapped, s->name) != 0)
                v_report(v, PD_OK, "%s: tensor '%s' is also here; %s maps it to %s", s->name, name,
                         V_INDEX_NAME, mapped);
        }
    }
    json_t *meta = json_object_get(v->index, "metadata");
    json_t *jtotal = json_is_object(meta) ? json_object_get(meta, "total_size") : NULL;
    if (jtotal && !json_is_integer(jtotal))
        v_report(v, PD_ERR_FORMAT, "%s: metadata.total_size is not an integer", V_INDEX_NAME);
    else if (jtotal && all_open && (uint64_t)json_integer_value(jtotal) != total)
        v_report(v, PD_ERR_FORMAT,
                 "%s: metadata.total_size is %lld but the mapped tensors hold %llu bytes",
                 V_INDEX_NAME, (long long)json_integer_value(jtotal), (unsigned long long)total);
}

/* ------------------------------------------------------------------ */
/* tensors against the config                                          */
/* ------------------------------------------------------------------ */

/* The tensor the loader would read for name; *unknown_p when the shard it
 * is mapped to could not be opened or lacks it (already reported, so not
 * reported again). */
static const pd_st_tensor *v_lookup(v_ctx *v, const char *name, bool *unknown_p) {
    *unknown_p = false;
    v_shard *s = &v->shards[0];
    if (v->weight_map) {
        const char *f = json_string_value(json_object_get(v->weight_map, name));
        if (!f)
            return NULL;
        json_t *id = json_object_get(v->shard_ids, f);
        if (!id) {
            *unknown_p = true;
            return NULL;
        }
        s = &v->shards[json_integer_value(id)];
    }
    if (!s->st) {
        *unknown_p = true;
        return NULL;
    }
    const pd_st_tensor *t = pd_st_find(s->st, name);
    if (!t && v->weight_map)
        *unknown_p = true; /* mapped to a shard that lacks it: v_check_index said so */
    return t;
}

/* Where a missing tensor should have been, for its message. */
static const char *v_expected_home(v_ctx *v) {
    return v->weight_map ? V_INDEX_NAME : v->shards[0].name;
}

/* An F8_E4M3 weight needs <name>_scale_inv of ceil(rows/bm) x ceil(cols/bn)
 * in a float dtype (DeepSeek-V3 inference/kernel.py weight_dequant). */
static void v_check_fp8_scale(v_ctx *v, const pd_model_config *c, const pd_tensor_spec *s,
                              const pd_st_tensor *t, json_t *used) {
    if (s->cols == 0) {
        v_report(v, PD_ERR_UNSUPPORTED,
                 "%s: tensor '%s' is F8_E4M3 but 1-D: only matrices are block-quantised", t->file,
                 s->name);
        return;
    }
    char sn[sizeof s->name + 16];
    snprintf(sn, sizeof sn, "%s_scale_inv", s->name);
    json_object_set_new(used, sn, json_true());
    bool unknown;
    const pd_st_tensor *sc = v_lookup(v, sn, &unknown);
    if (unknown)
        return;
    if (!sc) {
        v_report(v, PD_ERR_NOTFOUND, "%s: FP8 tensor '%s' has no '%s'", t->file, s->name, sn);
        return;
    }
    int bm = c->fp8_block[0] > 0 ? c->fp8_block[0] : 128,
        bn = c->fp8_block[1] > 0 ? c->fp8_block[1] : 128;
    int64_t sr = (s->rows + bm - 1) / bm, scol = (s->cols + bn - 1) / bn;
    bool dt_ok = sc->dtype == PD_DT_F32 || sc->dtype == PD_DT_BF16 || sc->dtype == PD_DT_F16;
    if (sc->ndim != 2 || sc->shape[0] != sr || sc->shape[1] != scol || !dt_ok) {
        char got[96];
        v_shape_str(sc, got, sizeof got);
        v_report(v, PD_ERR_SHAPE,
                 "%s: tensor '%s' is %s %s; %dx%d blocks of [%lld, %lld] imply [%lld, %lld] "
                 "F32/BF16/F16",
                 sc->file, sn, pd_dtype_name(sc->dtype), got, bm, bn, (long long)s->rows,
                 (long long)s->cols, (long long)sr, (long long)scol);
    }
}

static void v_check_spec(v_ctx *v, const pd_model_config *c, const pd_tensor_spec *s,
                         json_t *used) {
    json_object_set_new(used, s->name, json_true());
    bool unknown;
    const pd_st_tensor *t = v_lookup(v, s->name, &unknown);
    if (unknown)
        return;
    if (!t) {
        if (s->cols)
            v_report(v, PD_ERR_NOTFOUND,
                     "%s: missing tensor '%s', which config.json implies ([%lld, %lld])",
                     v_expected_home(v), s->name, (long long)s->rows, (long long)s->cols);
        else
            v_report(v, PD_ERR_NOTFOUND,
                     "%s: missing tensor '%s', which config.json implies ([%lld])",
                     v_expected_home(v), s->name, (long long)s->rows);
        return;
    }
    bool shape_ok = s->cols ? (t->ndim == 2 && t->shape[0] == s->rows && t->shape[1] == s->cols)
                            : (t->ndim == 1 && t->shape[0] == s->rows);
    if (!shape_ok) {
        char got[96];
        v_shape_str(t, got, sizeof got);
        if (s->cols)
            v_report(v, PD_ERR_SHAPE,
                     "%s: tensor '%s' has shape %s, config.json implies [%lld, %lld]", t->file,
                     s->name, got, (long long)s->rows, (long long)s->cols);
        else
            v_report(v, PD_ERR_SHAPE, "%s: tensor '%s' has shape %s, config.json implies [%lld]",
                     t->file, s->name, got, (long long)s->rows);
        return;
    }
    if (t->dtype != PD_DT_F32 && t->dtype != PD_DT_BF16 && t->dtype != PD_DT_F16 &&
        t->dtype != PD_DT_F8_E4M3) {
        v_report(v, PD_ERR_UNSUPPORTED, "%s: tensor '%s' has dtype %s, not a weight dtype", t->file,
                 s->name, pd_dtype_name(t->dtype));
        return;
    }
    if (t->dtype == PD_DT_F8_E4M3)
        v_check_fp8_scale(v, c, s, t, used);
}

/* Every tensor the config implies; then one note for the tensors it does
 * not use (DeepSeek-V3's multi-token-prediction layer 61 is such). */
static void v_check_config_tensors(v_ctx *v, const pd_model_config *c) {
    pd_tensor_spec *specs;
    size_t n;
    pd_model_tensor_specs(c, &specs, &n);
    v->rep->n_config_tensors = n;
    json_t *used = json_object();
    for (size_t i = 0; i < n; i++)
        v_check_spec(v, c, &specs[i], used);
    size_t extra = 0;
    const char *first = NULL, *first_file = NULL;
    for (int i = 0; i < v->n_shards; i++) {
        v_shard *s = &v->shards[i];
        for (size_t k = 0; s->st && k < pd_st_count(s->st); k++) {
            const char *name = pd_st_at(s->st, k)->name;
            const char *mapped =
                v->weight_map ? json_string_value(json_object_get(v->weight_map, name)) : s->name;
            if (!mapped || strcmp(mapped, s->name) != 0 || json_object_get(used, name))
                continue;
            if (extra++ == 0) {
                first = name;
                first_file = s->name;
            }
        }
    }
    if (extra)
        v_report(v, PD_OK,
                 "%s: %zu tensors config.json does not imply (e.g. '%s'); the loader ignores them",
                 first_file, extra, first);
    json_decref(used);
    free(specs);
}

/* ------------------------------------------------------------------ */
/* SHA-256, `jobs` files at once                                       */
/* ------------------------------------------------------------------ */

typedef struct {
    v_ctx *v;
    int *order; /* files by size, largest first */
    atomic_int next, done;
    atomic_uint_fast64_t bytes;
    atomic_uint_fast64_t end_ns; /* monotonic time the last file finished */
    char (*errors)[256];         /* per file; "" when read fine */
} v_hash_pool;

static bool v_sha256_file(const char *path, atomic_uint_fast64_t *bytes, uint8_t *buf, char hex[65],
                          char *errbuf, size_t errcap) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(errbuf, errcap, "cannot open: %s", strerror(errno));
        return false;
    }
    posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    bool ok = md && EVP_DigestInit_ex(md, EVP_sha256(), NULL) == 1;
    while (ok) {
        ssize_t r = read(fd, buf, V_READ_CHUNK);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            snprintf(errbuf, errcap, "read error: %s", strerror(errno));
            ok = false;
            break;
        }
        if (r == 0)
            break;
        ok = EVP_DigestUpdate(md, buf, (size_t)r) == 1;
        atomic_fetch_add(bytes, (uint64_t)r);
    }
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned int dl = 0;
    if (ok && EVP_DigestFinal_ex(md, d, &dl) == 1 && dl == 32) {
        for (int i = 0; i < 32; i++)
            snprintf(hex + 2 * i, 3, "%02x", d[i]);
    } else if (ok) {
        snprintf(errbuf, errcap, "SHA-256 failed (OpenSSL)");
        ok = false;
    }
    EVP_MD_CTX_free(md);
    close(fd);
    return ok;
}

static void *v_hash_worker(void *arg) {
    v_hash_pool *p = arg;
    uint8_t *buf = malloc(V_READ_CHUNK);
    for (;;) {
        int k = atomic_fetch_add(&p->next, 1);
        if (k >= p->v->n_files)
            break;
        int i = p->order[k];
        v_file *f = &p->v->files[i];
        if (!buf) {
            snprintf(p->errors[i], sizeof p->errors[i], "out of memory for the read buffer");
        } else {
            char *path = v_join(p->v->dir, f->name);
            f->hashed =
                v_sha256_file(path, &p->bytes, buf, f->sha256, p->errors[i], sizeof p->errors[i]);
            free(path);
        }
        f->read_failed = !f->hashed;
        uint64_t now_ns = (uint64_t)(pd_now_s() * 1e9), prev = atomic_load(&p->end_ns);
        while (prev < now_ns && !atomic_compare_exchange_weak(&p->end_ns, &prev, now_ns))
            ;
        atomic_fetch_add(&p->done, 1);
    }
    free(buf);
    return NULL;
}

typedef struct {
    uint64_t size;
    int file;
} v_order;

static int v_size_desc(const void *a, const void *b) {
    uint64_t x = ((const v_order *)a)->size, y = ((const v_order *)b)->size;
    return x < y ? 1 : x > y ? -1 : 0;
}

static void v_progress(v_ctx *v, v_hash_pool *p, uint64_t total, double dt, bool tty, bool final) {
    uint64_t b = atomic_load(&p->bytes);
    fprintf(stderr, "%sverify: hashed %d/%d files, %.1f/%.1f MB (%.0f%%), %.0f MB/s%s",
            tty ? "\r" : "", atomic_load(&p->done), v->n_files, b / 1e6, total / 1e6,
            total ? 100.0 * b / total : 100.0, dt > 0 ? b / 1e6 / dt : 0.0,
            tty ? (final ? "\033[K\n" : "\033[K") : "\n");
}

static void v_hash_all(v_ctx *v) {
    if (v->n_files == 0)
        return;
    int jobs = v->opt->jobs > 0 ? v->opt->jobs : V_DEFAULT_JOBS;
    if (jobs > v->n_files)
        jobs = v->n_files;
    if (jobs > 64)
        jobs = 64; /* V_READ_CHUNK each */
    v_hash_pool p = {.v = v};
    p.order = pd_xmalloc((size_t)v->n_files * sizeof *p.order);
    p.errors = pd_xcalloc((size_t)v->n_files, sizeof *p.errors);
    uint64_t total = 0;
    v_order *ord = pd_xmalloc((size_t)v->n_files * sizeof *ord);
    for (int i = 0; i < v->n_files; i++) {
        ord[i] = (v_order){v->files[i].size, i};
        total += v->files[i].size;
    }
    qsort(ord, (size_t)v->n_files, sizeof *ord, v_size_desc);
    for (int i = 0; i < v->n_files; i++)
        p.order[i] = ord[i].file;
    free(ord);
    atomic_init(&p.next, 0);
    atomic_init(&p.done, 0);
    atomic_init(&p.bytes, 0);
    atomic_init(&p.end_ns, 0);
    pthread_t *th = pd_xcalloc((size_t)jobs, sizeof *th);
    double t0 = pd_now_s();
    int started = 0;
    for (; started < jobs; started++)
        if (pthread_create(&th[started], NULL, v_hash_worker, &p) != 0)
            break;
    if (started == 0)
        v_hash_worker(&p); /* no thread to be had: hash here */
    bool tty = isatty(STDERR_FILENO);
    double last = t0;
    while (atomic_load(&p.done) < v->n_files) {
        usleep(20 * 1000);
        double now = pd_now_s();
        if (v->opt->progress && now - last >= (tty ? 0.25 : 5.0)) {
            v_progress(v, &p, total, now - t0, tty, false);
            last = now;
        }
    }
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    v->rep->hash_seconds = atomic_load(&p.end_ns) / 1e9 - t0; /* not the polling's granularity */
    v->rep->bytes_hashed = atomic_load(&p.bytes);
    v->rep->mb_per_s =
        v->rep->hash_seconds > 0 ? v->rep->bytes_hashed / 1e6 / v->rep->hash_seconds : 0;
    if (v->opt->progress)
        v_progress(v, &p, total, v->rep->hash_seconds, tty, true);
    for (int i = 0; i < v->n_files; i++)
        if (v->files[i].read_failed)
            v_report(v, PD_ERR_IO, "%s: %s", v->files[i].name, p.errors[i]);
    free(th);
    free(p.errors);
    free(p.order);
}

/* ------------------------------------------------------------------ */
/* manifests                                                           */
/* ------------------------------------------------------------------ */

static bool v_is_hex64(const char *s) {
    if (!s || strlen(s) != 64)
        return false;
    for (; *s; s++)
        if (!((*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'f') || (*s >= 'A' && *s <= 'F')))
            return false;
    return true;
}

/* Files the loader reads: unlisted, they are problems; anything else a note. */
static bool v_is_model_file(const char *name) {
    size_t n = strlen(name);
    return strcmp(name, "config.json") == 0 || strcmp(name, V_INDEX_NAME) == 0 ||
           (n > 12 && strcmp(name + n - 12, ".safetensors") == 0);
}

static void v_compare_manifest(v_ctx *v) {
    const char *mpath = v->opt->manifest;
    json_error_t jerr;
    json_t *m = json_load_file(mpath, JSON_REJECT_DUPLICATES, &jerr);
    if (!m) {
        v_report(v, jerr.line < 0 ? PD_ERR_IO : PD_ERR_FORMAT, "%s: cannot read the manifest: %s",
                 mpath, jerr.text);
        return;
    }
    if (!json_is_object(m)) {
        v_report(v, PD_ERR_FORMAT,
                 "%s: the manifest is not a JSON object of file -> {size, sha256}", mpath);
        json_decref(m);
        return;
    }
    const char *name;
    json_t *e;
    json_object_foreach(m, name, e) {
        json_t *js = json_is_object(e) ? json_object_get(e, "size") : NULL;
        const char *sha =
            json_is_object(e) ? json_string_value(json_object_get(e, "sha256")) : NULL;
        if (!json_is_integer(js) || json_integer_value(js) < 0 || !v_is_hex64(sha)) {
            v_report(v, PD_ERR_FORMAT,
                     "%s: entry '%s' is not {\"size\": bytes, \"sha256\": 64 hex digits}", mpath,
                     name);
            continue;
        }
        if (!name[0] || strchr(name, '/')) {
            v_report(v, PD_ERR_FORMAT, "%s: entry '%s' is not a plain file name", mpath, name);
            continue;
        }
        uint64_t size = (uint64_t)json_integer_value(js);
        v_file *f = v_file_find(v, name);
        if (!f)
            v_report(v, PD_ERR_NOTFOUND, "%s: missing (listed in the manifest %s)", name, mpath);
        else if (f->size != size)
            v_report(v, PD_ERR_FORMAT, "%s: %llu bytes, the manifest says %llu", name,
                     (unsigned long long)f->size, (unsigned long long)size);
        else if (f->hashed && strcasecmp(f->sha256, sha) != 0)
            v_report(v, PD_ERR_FORMAT, "%s: SHA-256 %s differs from the manifest's %s", name,
                     f->sha256, sha);
    }
    for (int i = 0; i < v->n_files; i++) {
        const char *fn = v->files[i].name;
        if (json_object_get(m, fn))
            continue;
        if (v_is_model_file(fn))
            v_report(v, PD_ERR_NOTFOUND, "%s: not listed in the manifest %s", fn, mpath);
        else
            v_report(v, PD_OK, "%s: not listed in the manifest %s", fn, mpath);
    }
    json_decref(m);
}

static void v_write_manifest(v_ctx *v) {
    const char *path = v->opt->write_manifest;
    if (v->rep->n_problems) {
        v_report(v, PD_OK, "%s: not written: %d problem%s", path, v->rep->n_problems,
                 v->rep->n_problems == 1 ? "" : "s");
        return;
    }
    json_t *m = json_object();
    for (int i = 0; i < v->n_files; i++)
        json_object_set_new(m, v->files[i].name,
                            json_pack("{s:I,s:s}", "size", (json_int_t)v->files[i].size, "sha256",
                                      v->files[i].sha256));
    size_t n = strlen(path);
    char *tmp = pd_xmalloc(n + 16);
    snprintf(tmp, n + 16, "%s.tmp%d", path, (int)getpid());
    if (json_dump_file(m, tmp, JSON_INDENT(2) | JSON_SORT_KEYS) != 0 || rename(tmp, path) != 0) {
        v_report(v, PD_ERR_IO, "%s: cannot write the manifest: %s", path, strerror(errno));
        unlink(tmp);
    } else {
        v->rep->manifest_written = true;
    }
    free(tmp);
    json_decref(m);
}

/* ------------------------------------------------------------------ */
/* entry points                                                        */
/* ------------------------------------------------------------------ */

/* Everything after listing the directory, in the order of the contract. */
static void v_run_checks(v_ctx *v) {
    char *cpath = v_join(v->dir, "config.json");
    pd_model_config cfg;
    pd_err e = {{0}};
    pd_status cst = pd_config_load(cpath, &cfg, &e);
    free(cpath);
    if (cst != PD_OK)
        v_report(v, cst, "%s", e.msg);
    else if (cfg.n_routed_experts > 1024 || cfg.num_experts_per_tok > 256 || cfg.n_group > 256 ||
             cfg.qk_rope_head_dim > 1024) { /* pd_model_load's limits */
        v_report(v, PD_ERR_UNSUPPORTED,
                 "config.json: more than 1024 experts, 256 per token or 256 groups");
        cst = PD_ERR_UNSUPPORTED;
    }

    v_layout(v);
    for (int i = 0; i < v->n_shards; i++)
        v_open_shard(v, &v->shards[i]);
    v->rep->n_shards = v->n_shards;
    if (v->weight_map)
        v_check_index(v);
    for (int i = 0; i < v->n_files; i++) {
        const char *fn = v->files[i].name;
        size_t n = strlen(fn);
        if (n > 12 && strcmp(fn + n - 12, ".safetensors") == 0 &&
            !json_object_get(v->shard_ids, fn))
            v_report(v, PD_OK, "%s: not part of the checkpoint (%s)", fn,
                     v->weight_map ? V_INDEX_NAME " does not name it"
                                   : "no index: the loader reads " V_SINGLE_NAME);
    }
    if (cst == PD_OK && v->layout_ok && v->n_shards > 0)
        v_check_config_tensors(v, &cfg);

    if (v->opt->hash || v->opt->manifest || v->opt->write_manifest)
        v_hash_all(v);
    if (v->opt->manifest)
        v_compare_manifest(v);
    if (v->opt->write_manifest)
        v_write_manifest(v);
}

pd_status pd_verify_checkpoint(const char *dir, const pd_verify_options *opt, pd_verify_report *rep,
                               pd_err *err) {
    pd_verify_options none = {0};
    pd_verify_report local;
    v_ctx v = {.dir = dir,
               .opt = opt ? opt : &none,
               .rep = rep ? rep : &local,
               .err = err,
               .first = PD_OK};
    memset(v.rep, 0, sizeof *v.rep);
    v.shard_ids = json_object();
    if (v_list_dir(&v) == PD_OK)
        v_run_checks(&v);

    if (v.hidden_problems || v.hidden_notes) {
        char msg[160];
        snprintf(msg, sizeof msg, "... and %d more problems, %d more notes not shown",
                 v.hidden_problems, v.hidden_notes);
        if (v.opt->on_message)
            v.opt->on_message(v.opt->user, v.hidden_problems > 0, msg);
        else
            v_default_message(NULL, v.hidden_problems > 0, msg);
    }
    for (int i = 0; i < v.n_shards; i++) {
        pd_st_close(&v.shards[i].st);
        free(v.shards[i].name);
        free(v.shards[i].first_mapped);
    }
    free(v.shards);
    for (int i = 0; i < v.n_files; i++)
        free(v.files[i].name);
    free(v.files);
    json_decref(v.shard_ids);
    json_decref(v.index);
    return v.first;
}

typedef struct {
    const char *module, *dir;
} v_log_target;

static void v_log_message(void *user, bool problem, const char *msg) {
    const v_log_target *t = user;
    if (problem)
        PD_LOGE(t->module, "checkpoint %s: %s", t->dir, msg);
    else
        PD_LOGI(t->module, "checkpoint %s: note: %s", t->dir, msg);
}

pd_status pd_verify_at_start(const char *dir, const char *manifest, const char *module,
                             pd_err *err) {
    v_log_target target = {module, dir};
    pd_verify_options o = {.manifest = manifest,
                           .hash = manifest != NULL,
                           .jobs = V_DEFAULT_JOBS,
                           .on_message = v_log_message,
                           .user = &target};
    pd_verify_report r;
    double t0 = pd_now_s();
    pd_status st = pd_verify_checkpoint(dir, &o, &r, err);
    if (st != PD_OK) {
        PD_LOGE(module, "checkpoint %s: %d problem%s", dir, r.n_problems,
                r.n_problems == 1 ? "" : "s");
        return st;
    }
    if (manifest)
        PD_LOGI(module,
                "checkpoint %s verified: %d shard(s), %zu tensors, %d files match %s (%.1f MB at "
                "%.0f MB/s) "
                "in %.2f s",
                dir, r.n_shards, r.n_tensors, r.n_files, manifest, r.bytes_hashed / 1e6, r.mb_per_s,
                pd_now_s() - t0);
    else
        PD_LOGI(module,
                "checkpoint %s verified: %d shard(s), %zu tensors, sizes and headers (no manifest: "
                "not hashed) "
                "in %.2f s",
                dir, r.n_shards, r.n_tensors, pd_now_s() - t0);
    return PD_OK;
}

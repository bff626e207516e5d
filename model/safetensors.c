/* Safetensors checkpoints: reading (one file, or an index and its shards;
 * every file mmapped read-only and its header validated before use) and
 * streaming writing.
 *
 * Format (huggingface/safetensors README, "Format"): a little-endian u64 N,
 * N bytes of UTF-8 JSON
 *   {"<name>": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]},
 *    ..., "__metadata__": {"<key>": "<string>"}}
 * then the data section, to which the offsets are relative (file byte 8 + N).
 * Sharded checkpoints (transformers' save_pretrained) add
 * model.safetensors.index.json: {"metadata": {..}, "weight_map": {"<name>":
 * "<file>"}}.
 */
#include "pd_model.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define ST_INDEX_NAME  "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"

/* The reference implementation's MAX_HEADER_SIZE: a longer header is refused
 * before it is parsed. */
#define ST_MAX_HEADER_BYTES 100000000ull

/* ------------------------------------------------------------------ */
/* reader                                                              */
/* ------------------------------------------------------------------ */

/* One mapped file. The names of its tensors live in names (NUL-separated),
 * so a pd_st_tensor borrows its name and file from here. */
typedef struct {
    char *path;
    uint8_t *map;
    size_t size;
    char *names;
} st_file;

struct pd_safetensors {
    st_file *files;
    size_t n_files;
    pd_st_tensor *tensors; /* header order; file by file when sharded */
    size_t n_tensors;
    uint32_t *slots;  /* name hash table, open addressing: tensor index + 1, 0 empty */
    size_t slot_mask; /* slots has slot_mask + 1 entries (a power of two) */
};

/* A tensor's byte range within its file's data section, for the overlap check. */
typedef struct {
    uint64_t begin, end;
    size_t tensor;
} st_span;

static char *st_path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = pd_xmalloc(a + b + 2);
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

/* FNV-1a, 64 bit. */
static uint64_t st_hash(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) {
        h ^= (uint8_t)*s;
        h *= 0x100000001b3ull;
    }
    return h;
}

/* Builds the name table over st->tensors (names are unique by then: jansson
 * rejects duplicate keys within a header, and an index maps each name to
 * one file). Load factor at most 1/2. */
static void st_index_build(pd_safetensors *st) {
    size_t n_slots = 16;
    while (n_slots < 2 * st->n_tensors)
        n_slots *= 2;
    st->slots = pd_xcalloc(n_slots, sizeof *st->slots);
    st->slot_mask = n_slots - 1;
    for (size_t i = 0; i < st->n_tensors; i++) {
        size_t s = (size_t)st_hash(st->tensors[i].name) & st->slot_mask;
        while (st->slots[s])
            s = (s + 1) & st->slot_mask;
        st->slots[s] = (uint32_t)(i + 1);
    }
}

const pd_st_tensor *pd_st_find(const pd_safetensors *st, const char *name) {
    if (!st || !st->slots || !name)
        return NULL;
    size_t s = (size_t)st_hash(name) & st->slot_mask;
    for (; st->slots[s]; s = (s + 1) & st->slot_mask) {
        const pd_st_tensor *t = &st->tensors[st->slots[s] - 1];
        if (strcmp(t->name, name) == 0)
            return t;
    }
    return NULL;
}

size_t pd_st_count(const pd_safetensors *st) {
    return st ? st->n_tensors : 0;
}

const pd_st_tensor *pd_st_at(const pd_safetensors *st, size_t i) {
    if (!st || i >= st->n_tensors)
        return NULL;
    return &st->tensors[i];
}

pd_status pd_checkpoint_fingerprint(const char *dir, uint64_t *fp_p, pd_err *err) {
    pd_safetensors *st = NULL;
    pd_status rc = pd_st_open_dir(dir, &st, err);
    if (rc != PD_OK)
        return rc;
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < st->n_tensors; i++) {
        const pd_st_tensor *t = &st->tensors[i];
        const unsigned char *parts[3] = {(const unsigned char *)t->name, (const unsigned char *)&t->nbytes,
                                         (const unsigned char *)t->data};
        const size_t lens[3] = {strlen(t->name) + 1, sizeof t->nbytes,
                                i < PD_CKPT_FP_SAMPLED ? (t->nbytes < 64 ? t->nbytes : 64) : 0};
        for (int k = 0; k < 3; k++)
            for (size_t j = 0; j < lens[k]; j++) {
                h ^= parts[k][j];
                h *= 1099511628211ull;
            }
    }
    pd_st_close(&st);
    *fp_p = h ? h : 1;
    return PD_OK;
}

void pd_st_close(pd_safetensors **st_p) {
    if (!st_p || !*st_p)
        return;
    pd_safetensors *st = *st_p;
    for (size_t i = 0; i < st->n_files; i++) {
        if (st->files[i].map)
            munmap(st->files[i].map, st->files[i].size);
        free(st->files[i].names);
        free(st->files[i].path);
    }
    free(st->files);
    free(st->tensors);
    free(st->slots);
    free(st);
    *st_p = NULL;
}

/* Maps path read-only into a new entry of st->files (owned by st from then
 * on, so a later failure is undone by pd_st_close). */
static pd_status st_file_map(pd_safetensors *st, const char *path, st_file **f_p, pd_err *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return pd_err_set(err, PD_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return pd_err_set(err, PD_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return pd_err_set(err, PD_ERR_IO, "%s: not a regular file", path);
    }
    if (sb.st_size < 8) {
        close(fd);
        return pd_err_set(err, PD_ERR_FORMAT,
                          "%s: truncated: %lld bytes, too short for the 8-byte header length", path,
                          (long long)sb.st_size);
    }
    size_t size = (size_t)sb.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED)
        return pd_err_set(err, PD_ERR_IO, "%s: cannot mmap %zu bytes: %s", path, size, strerror(e));

    st->files = realloc(st->files, (st->n_files + 1) * sizeof *st->files);
    PD_ASSERT(st->files);
    st_file *f = &st->files[st->n_files++];
    *f = (st_file){.path = pd_xstrdup(path), .map = map, .size = size};
    *f_p = f;
    return PD_OK;
}

/* "__metadata__" is optional; when present it maps strings to strings. */
static pd_status st_metadata_check(const char *path, json_t *meta, pd_err *err) {
    if (json_is_null(meta))
        return PD_OK;
    if (!json_is_object(meta))
        return pd_err_set(err, PD_ERR_FORMAT, "%s: __metadata__ is not an object", path);
    const char *key;
    json_t *v;
    json_object_foreach(meta, key, v) {
        if (!json_is_string(v))
            return pd_err_set(err, PD_ERR_FORMAT, "%s: __metadata__ value \"%s\" is not a string",
                              path, key);
    }
    return PD_OK;
}

/* Reads one non-negative JSON integer. */
static bool st_json_u64(json_t *j, uint64_t *v_p) {
    if (!json_is_integer(j) || json_integer_value(j) < 0)
        return false;
    *v_p = (uint64_t)json_integer_value(j);
    return true;
}

/* Validates one header entry {"dtype", "shape", "data_offsets"} and fills t
 * (except name, file and data) and its span. data_bytes is the length of the
 * file's data section. */
static pd_status st_entry_parse(const char *path, const char *name, json_t *v, uint64_t data_bytes,
                                pd_st_tensor *t, st_span *span, pd_err *err) {
    if (!json_is_object(v))
        return pd_err_set(err, PD_ERR_FORMAT, "%s: tensor '%s': entry is not an object", path,
                          name);

    json_t *jdtype = json_object_get(v, "dtype");
    if (!jdtype)
        return pd_err_set(err, PD_ERR_FORMAT, "%s: tensor '%s': missing dtype", path, name);
    if (!json_is_string(jdtype))
        return pd_err_set(err, PD_ERR_FORMAT, "%s: tensor '%s': dtype is not a string", path, name);
    if (pd_dtype_parse(json_string_value(jdtype), &t->dtype) != PD_OK)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "%s: tensor '%s': unsupported dtype \"%s\"",
                          path, name, json_string_value(jdtype));

    json_t *jshape = json_object_get(v, "shape");
    if (!jshape)
        return pd_err_set(err, PD_ERR_FORMAT, "%s: tensor '%s': missing shape", path, name);
    if (!json_is_array(jshape))
        return pd_err_set(err, PD_ERR_FORMAT, "%s: tensor '%s': shape is not an array", path, name);
    size_t ndim = json_array_size(jshape);
    if (ndim > PD_ST_MAX_DIMS)
        return pd_err_set(err, PD_ERR_FORMAT, "%s: tensor '%s': %zu dims, more than %d", path, name,
                          ndim, PD_ST_MAX_DIMS);
    /* numel of a 0-dim (scalar) tensor is 1 */
    uint64_t nbytes = pd_dtype_size(t->dtype);
    for (size_t d = 0; d < ndim; d++) {
        json_t *jd = json_array_get(jshape, d);
        if (!json_is_integer(jd))
            return pd_err_set(err, PD_ERR_FORMAT, "%s: tensor '%s': shape[%zu] is not an integer",
                              path, name, d);
        json_int_t dim = json_integer_value(jd);
        if (dim < 0)
            return pd_err_set(err, PD_ERR_FORMAT, "%s: tensor '%s': negative dim shape[%zu] = %lld",
                              path, name, d, (long long)dim);
        if (__builtin_mul_overflow(nbytes, (uint64_t)dim, &nbytes))
            return pd_err_set(err, PD_ERR_FORMAT, "%s: tensor '%s': shape overflows 64 bits", path,
                              name);
        t->shape[d] = dim;
    }
    t->ndim = (int)ndim;

    json_t *joff = json_object_get(v, "data_offsets");
    if (!joff)
        return pd_err_set(err, PD_ERR_FORMAT, "%s: tensor '%s': missing data_offsets", path, name);
    uint64_t begin, end;
    if (!json_is_array(joff) || json_array_size(joff) != 2 ||
        !st_json_u64(json_array_get(joff, 0), &begin) ||
        !st_json_u64(json_array_get(joff, 1), &end))
        return pd_err_set(err, PD_ERR_FORMAT,
                          "%s: tensor '%s': data_offsets is not [begin, end] of two "
                          "non-negative integers",
                          path, name);
    if (begin > end)
        return pd_err_set(err, PD_ERR_FORMAT,
                          "%s: tensor '%s': data_offsets [%llu, %llu] end before begin", path, name,
                          (unsigned long long)begin, (unsigned long long)end);
    if (end > data_bytes)
        return pd_err_set(err, PD_ERR_FORMAT,
                          "%s: tensor '%s': data_offsets [%llu, %llu] past the end of the data "
                          "section (%llu bytes)",
                          path, name, (unsigned long long)begin, (unsigned long long)end,
                          (unsigned long long)data_bytes);
    if (end - begin != nbytes)
        return pd_err_set(err, PD_ERR_FORMAT,
                          "%s: tensor '%s': data_offsets span %llu bytes but shape x %s size "
                          "is %llu bytes",
                          path, name, (unsigned long long)(end - begin), pd_dtype_name(t->dtype),
                          (unsigned long long)nbytes);
    t->nbytes = (size_t)nbytes;
    span->begin = begin;
    span->end = end;
    return PD_OK;
}

static int st_span_cmp(const void *a, const void *b) {
    const st_span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* Non-empty spans, sorted by begin, must not overlap. Empty tensors hold no
 * bytes and may sit anywhere. */
static pd_status st_overlap_check(const pd_safetensors *st, const char *path, st_span *spans,
                                  size_t n, pd_err *err) {
    qsort(spans, n, sizeof *spans, st_span_cmp);
    const st_span *prev = NULL;
    for (size_t i = 0; i < n; i++) {
        const st_span *s = &spans[i];
        if (s->end == s->begin)
            continue;
        if (prev && s->begin < prev->end)
            return pd_err_set(err, PD_ERR_FORMAT,
                              "%s: tensor '%s' [%llu, %llu) overlaps tensor '%s' [%llu, %llu)",
                              path, st->tensors[s->tensor].name, (unsigned long long)s->begin,
                              (unsigned long long)s->end, st->tensors[prev->tensor].name,
                              (unsigned long long)prev->begin, (unsigned long long)prev->end);
        if (!prev || s->end > prev->end)
            prev = s;
    }
    return PD_OK;
}

/* Validates the header of mapped file f and appends its tensors to st, in
 * header order. */
static pd_status st_header_parse(pd_safetensors *st, st_file *f, pd_err *err) {
    uint64_t header_bytes;
    memcpy(&header_bytes, f->map, 8); /* little-endian, as is the host */
    uint64_t after_len = f->size - 8;
    if (header_bytes > after_len)
        return pd_err_set(err, PD_ERR_FORMAT,
                          "%s: header length %llu past the end of the file (%zu bytes)", f->path,
                          (unsigned long long)header_bytes, f->size);
    if (header_bytes > ST_MAX_HEADER_BYTES)
        return pd_err_set(err, PD_ERR_FORMAT, "%s: header length %llu above the limit of %llu",
                          f->path, (unsigned long long)header_bytes, ST_MAX_HEADER_BYTES);
    uint64_t data_bytes = after_len - header_bytes;
    const uint8_t *data = f->map + 8 + header_bytes;

    json_error_t jerr;
    json_t *root =
        json_loadb((const char *)f->map + 8, (size_t)header_bytes, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return pd_err_set(err, PD_ERR_FORMAT, "%s: header is not valid JSON: %s (byte %d)", f->path,
                          jerr.text, jerr.position);
    pd_status rc = PD_OK;
    st_span *spans = NULL;
    if (!json_is_object(root)) {
        rc = pd_err_set(err, PD_ERR_FORMAT, "%s: header is not a JSON object", f->path);
        goto out_root;
    }

    /* names first, into one block owned by f */
    size_t names_bytes = 0, n_new = 0;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "__metadata__") == 0)
            continue;
        names_bytes += strlen(key) + 1;
        n_new++;
    }
    f->names = pd_xmalloc(names_bytes);
    st->tensors = realloc(st->tensors, (st->n_tensors + n_new + 1) * sizeof *st->tensors);
    PD_ASSERT(st->tensors);
    spans = pd_xmalloc((n_new + 1) * sizeof *spans);

    size_t n_spans = 0;
    char *name = f->names;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "__metadata__") == 0) {
            rc = st_metadata_check(f->path, v, err);
            if (rc != PD_OK)
                goto out_spans;
            continue;
        }
        pd_st_tensor *t = &st->tensors[st->n_tensors];
        *t = (pd_st_tensor){0};
        st_span *span = &spans[n_spans];
        rc = st_entry_parse(f->path, key, v, data_bytes, t, span, err);
        if (rc != PD_OK)
            goto out_spans;
        size_t len = strlen(key) + 1;
        memcpy(name, key, len);
        t->name = name;
        name += len;
        t->file = f->path;
        t->data = data + span->begin;
        span->tensor = st->n_tensors++;
        n_spans++;
    }
    rc = st_overlap_check(st, f->path, spans, n_spans, err);

out_spans:
    free(spans);
out_root:
    json_decref(root);
    return rc;
}

/* Maps and validates one file, appending it to st. */
static pd_status st_add_file(pd_safetensors *st, const char *path, pd_err *err) {
    st_file *f = NULL;
    pd_status rc = st_file_map(st, path, &f, err);
    if (rc != PD_OK)
        return rc;
    return st_header_parse(st, f, err);
}

pd_status pd_st_open_file(const char *path, pd_safetensors **st_p, pd_err *err) {
    pd_safetensors *st = pd_xcalloc(1, sizeof *st);
    pd_status rc = st_add_file(st, path, err);
    if (rc != PD_OK) {
        pd_st_close(&st);
        return rc;
    }
    st_index_build(st);
    *st_p = st;
    return PD_OK;
}

/* A shard must be a plain file name next to the index: no directories, no
 * way out of the checkpoint directory. */
static bool st_shard_name_ok(const char *name) {
    return name[0] != '\0' && !strchr(name, '/') && !strstr(name, "..");
}

/* Opens the shards named by the index's weight_map (each distinct file once,
 * in order of first mention) and keeps exactly the tensors the map assigns
 * to each, in that file's header order. */
static pd_status st_open_index(const char *dir, const char *index_path, pd_safetensors **st_p,
                               pd_err *err) {
    char *text;
    size_t len;
    pd_status rc = pd_file_read_all(index_path, &text, &len, err);
    if (rc != PD_OK)
        return rc;
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    free(text);
    if (!root)
        return pd_err_set(err, PD_ERR_FORMAT, "%s: not valid JSON: %s (line %d, column %d)",
                          index_path, jerr.text, jerr.line, jerr.column);

    pd_safetensors *st = NULL, **shards = NULL;
    json_t *shard_ids = json_object(); /* file name -> index into shards */
    size_t n_shards = 0;
    json_t *weight_map = json_is_object(root) ? json_object_get(root, "weight_map") : NULL;
    if (!json_is_object(weight_map)) {
        rc = pd_err_set(err, PD_ERR_FORMAT, "%s: no \"weight_map\" object", index_path);
        goto out;
    }
    const char *tname;
    json_t *jfile;
    json_object_foreach(weight_map, tname, jfile) {
        if (!json_is_string(jfile)) {
            rc = pd_err_set(err, PD_ERR_FORMAT, "%s: tensor '%s': weight_map value is not a string",
                            index_path, tname);
            goto out;
        }
        const char *fname = json_string_value(jfile);
        if (!st_shard_name_ok(fname)) {
            rc = pd_err_set(err, PD_ERR_FORMAT,
                            "%s: tensor '%s': shard \"%s\" is not a plain file name", index_path,
                            tname, fname);
            goto out;
        }
        if (!json_object_get(shard_ids, fname))
            json_object_set_new(shard_ids, fname, json_integer((json_int_t)n_shards++));
    }

    shards = pd_xcalloc(n_shards, sizeof *shards);
    const char *fname;
    json_t *jid;
    json_object_foreach(shard_ids, fname, jid) {
        char *path = st_path_join(dir, fname);
        rc = pd_st_open_file(path, &shards[json_integer_value(jid)], err);
        free(path);
        if (rc != PD_OK)
            goto out;
    }
    json_object_foreach(weight_map, tname, jfile) {
        pd_safetensors *sh =
            shards[json_integer_value(json_object_get(shard_ids, json_string_value(jfile)))];
        if (!pd_st_find(sh, tname)) {
            rc = pd_err_set(err, PD_ERR_NOTFOUND, "%s: tensor '%s' is mapped to %s, which lacks it",
                            index_path, tname, sh->files[0].path);
            goto out;
        }
    }

    /* Every mapped tensor exists in its shard: take them over, with the maps. */
    st = pd_xcalloc(1, sizeof *st);
    st->files = pd_xcalloc(n_shards, sizeof *st->files);
    st->tensors = pd_xcalloc(json_object_size(weight_map) + 1, sizeof *st->tensors);
    json_object_foreach(shard_ids, fname, jid) {
        pd_safetensors *sh = shards[json_integer_value(jid)];
        for (size_t i = 0; i < sh->n_tensors; i++) {
            json_t *mapped = json_object_get(weight_map, sh->tensors[i].name);
            if (mapped && strcmp(json_string_value(mapped), fname) == 0)
                st->tensors[st->n_tensors++] = sh->tensors[i];
        }
        st->files[st->n_files++] = sh->files[0];
        sh->n_files = 0; /* the map now belongs to st */
    }
    PD_ASSERT(st->n_tensors == json_object_size(weight_map));
    st_index_build(st);
    *st_p = st;

out:
    for (size_t i = 0; shards && i < n_shards; i++)
        pd_st_close(&shards[i]);
    free(shards);
    json_decref(shard_ids);
    json_decref(root);
    return rc;
}

pd_status pd_st_open_dir(const char *dir, pd_safetensors **st_p, pd_err *err) {
    char *index_path = st_path_join(dir, ST_INDEX_NAME);
    char *single_path = st_path_join(dir, ST_SINGLE_NAME);
    pd_status rc;
    struct stat sb;
    if (stat(index_path, &sb) == 0)
        rc = st_open_index(dir, index_path, st_p, err);
    else if (stat(single_path, &sb) == 0)
        rc = pd_st_open_file(single_path, st_p, err);
    else
        rc = pd_err_set(err, PD_ERR_IO, "%s: neither %s nor %s found", dir, ST_INDEX_NAME,
                        ST_SINGLE_NAME);
    free(single_path);
    free(index_path);
    return rc;
}

/* ------------------------------------------------------------------ */
/* writer                                                              */
/* ------------------------------------------------------------------ */

typedef struct {
    char *name;
    size_t nbytes;
} st_decl;

struct pd_st_writer {
    char *path;
    FILE *f;
    json_t *header; /* "__metadata__", then one entry per declaration, in order */
    st_decl *decls;
    size_t n_decls, cap_decls;
    size_t n_written;     /* decls[0 .. n_written) are in the file */
    uint64_t data_bytes;  /* sum of declared sizes */
    size_t header_padded; /* cached JSON length padded to 8; 0 when stale */
    bool header_written;
    bool failed; /* an I/O error: later calls fail and close removes the file */
};

pd_status pd_st_writer_open(const char *path, pd_st_writer **w_p, pd_err *err) {
    FILE *f = fopen(path, "wb");
    if (!f)
        return pd_err_set(err, PD_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    pd_st_writer *w = pd_xcalloc(1, sizeof *w);
    w->path = pd_xstrdup(path);
    w->f = f;
    w->header = json_object();
    json_t *meta = json_object();
    json_object_set_new(meta, "format", json_string("pt"));
    json_object_set_new(w->header, "__metadata__", meta);
    *w_p = w;
    return PD_OK;
}

pd_status pd_st_writer_declare(pd_st_writer *w, const char *name, pd_dtype dt, int ndim,
                               const int64_t *shape, pd_err *err) {
    const char *path = w->path;
    if (!name || !*name || strcmp(name, "__metadata__") == 0)
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor '%s': invalid name", path,
                          name ? name : "(null)");
    if (w->header_written)
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor '%s': declared after data was written",
                          path, name);
    if (pd_dtype_size(dt) == 0)
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor '%s': invalid dtype %d", path, name,
                          (int)dt);
    if (ndim < 0 || ndim > PD_ST_MAX_DIMS || (ndim > 0 && !shape))
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor '%s': invalid ndim %d", path, name,
                          ndim);
    if (json_object_get(w->header, name))
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor '%s': declared twice", path, name);
    uint64_t nbytes = pd_dtype_size(dt), end;
    json_t *jshape = json_array();
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || __builtin_mul_overflow(nbytes, (uint64_t)shape[d], &nbytes)) {
            json_decref(jshape);
            return pd_err_set(err, PD_ERR_INVALID, "%s: tensor '%s': invalid shape[%d] = %lld",
                              path, name, d, (long long)shape[d]);
        }
        json_array_append_new(jshape, json_integer(shape[d]));
    }
    if (__builtin_add_overflow(w->data_bytes, nbytes, &end) || end > (uint64_t)INT64_MAX ||
        end > SIZE_MAX) {
        json_decref(jshape);
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor '%s': file would exceed 2^63 bytes",
                          path, name);
    }
    json_t *entry = json_object();
    json_object_set_new(entry, "dtype", json_string(pd_dtype_name(dt)));
    json_object_set_new(entry, "shape", jshape);
    json_object_set_new(entry, "data_offsets",
                        json_pack("[I,I]", (json_int_t)w->data_bytes, (json_int_t)end));
    if (json_object_set_new(w->header, name, entry) != 0) /* not UTF-8 */
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor '%s': name is not valid UTF-8", path,
                          name);

    if (w->n_decls == w->cap_decls) {
        w->cap_decls = w->cap_decls ? 2 * w->cap_decls : 64;
        w->decls = realloc(w->decls, w->cap_decls * sizeof *w->decls);
        PD_ASSERT(w->decls);
    }
    w->decls[w->n_decls++] = (st_decl){.name = pd_xstrdup(name), .nbytes = (size_t)nbytes};
    w->data_bytes = end;
    w->header_padded = 0;
    return PD_OK;
}

/* The header text, padded with spaces to a multiple of 8 bytes as the
 * reference writer does, so the data section starts 8-aligned. Caller frees. */
static char *st_writer_header_text(const pd_st_writer *w, size_t *len_p) {
    char *json = json_dumps(w->header, JSON_COMPACT);
    PD_ASSERT(json);
    size_t len = strlen(json), padded = (len + 7) & ~(size_t)7;
    char *text = pd_xmalloc(padded);
    memcpy(text, json, len);
    memset(text + len, ' ', padded - len);
    free(json);
    *len_p = padded;
    return text;
}

size_t pd_st_writer_size(const pd_st_writer *w) {
    if (!w->header_padded) {
        pd_st_writer *mut = (pd_st_writer *)w; /* cache only */
        free(st_writer_header_text(w, &mut->header_padded));
    }
    return 8 + w->header_padded + (size_t)w->data_bytes;
}

static pd_status st_writer_put_header(pd_st_writer *w, pd_err *err) {
    size_t len;
    char *text = st_writer_header_text(w, &len);
    uint64_t len64 = len; /* little-endian, as is the host */
    bool ok = fwrite(&len64, 8, 1, w->f) == 1 && fwrite(text, 1, len, w->f) == len;
    free(text);
    w->header_written = true;
    if (!ok) {
        w->failed = true;
        return pd_err_set(err, PD_ERR_IO, "%s: writing the header failed: %s", w->path,
                          strerror(errno));
    }
    return PD_OK;
}

pd_status pd_st_writer_write(pd_st_writer *w, const char *name, const void *data, size_t nbytes,
                             pd_err *err) {
    if (w->failed)
        return pd_err_set(err, PD_ERR_IO, "%s: tensor '%s': an earlier write failed", w->path,
                          name);
    if (w->n_written == w->n_decls)
        return pd_err_set(err, PD_ERR_INVALID,
                          "%s: tensor '%s': every declared tensor is already written", w->path,
                          name);
    const st_decl *d = &w->decls[w->n_written];
    if (strcmp(name, d->name) != 0)
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor '%s' written out of order: next is '%s'",
                          w->path, name, d->name);
    if (nbytes != d->nbytes)
        return pd_err_set(err, PD_ERR_INVALID, "%s: tensor '%s': %zu bytes written, %zu declared",
                          w->path, name, nbytes, d->nbytes);
    if (!w->header_written) {
        pd_status rc = st_writer_put_header(w, err);
        if (rc != PD_OK)
            return rc;
    }
    if (nbytes && fwrite(data, 1, nbytes, w->f) != nbytes) {
        w->failed = true;
        return pd_err_set(err, PD_ERR_IO, "%s: tensor '%s': write failed: %s", w->path, name,
                          strerror(errno));
    }
    w->n_written++;
    return PD_OK;
}

pd_status pd_st_writer_close(pd_st_writer **w_p, pd_err *err) {
    if (!w_p || !*w_p)
        return PD_OK;
    pd_st_writer *w = *w_p;
    *w_p = NULL;
    pd_status rc = PD_OK;
    if (w->failed)
        rc = pd_err_set(err, PD_ERR_IO, "%s: an earlier write failed", w->path);
    else if (w->n_written < w->n_decls)
        rc =
            pd_err_set(err, PD_ERR_INVALID,
                       "%s: %zu of %zu declared tensors never written (next: tensor '%s')", w->path,
                       w->n_decls - w->n_written, w->n_decls, w->decls[w->n_written].name);
    else if (!w->header_written) /* nothing declared: a header-only file */
        rc = st_writer_put_header(w, err);
    if (fclose(w->f) != 0 && rc == PD_OK)
        rc = pd_err_set(err, PD_ERR_IO, "%s: close failed: %s", w->path, strerror(errno));
    if (rc != PD_OK)
        unlink(w->path); /* leave no truncated checkpoint behind */
    for (size_t i = 0; i < w->n_decls; i++)
        free(w->decls[i].name);
    free(w->decls);
    json_decref(w->header);
    free(w->path);
    free(w);
    return rc;
}

/* `pdserve mkmodel`: a random-initialised checkpoint in the exact Hugging
 * Face layout (config.json, model.safetensors or shards + index,
 * tokenizer.json, tokenizer_config.json). Deterministic in the seed: every
 * tensor is generated from its own generator, seeded by (seed, name, row
 * chunk), so the result does not depend on thread count or order. */
#include "model_impl.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MK_ROWS_PER_CHUNK 128 /* == the FP8 block, so a chunk owns whole scale rows */

typedef struct {
    const pd_tensor_spec *spec;
    pd_dtype dt;
    bool fp8;
    int fp8_bc; /* FP8 block columns */
    uint64_t seed;
    float std;
    void *out;      /* rows × cols in dt */
    float *scales;  /* FP8: [ceil(rows/128)] × [ceil(cols/128)] */
    int64_t n_chunks;
    int64_t next;
    pthread_mutex_t mu;
} gen_job;

static uint64_t name_hash(const char *s, uint64_t seed) {
    uint64_t h = 1469598103934665603ull ^ seed;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

static void gen_chunk(gen_job *j, int64_t chunk, float *tmp) {
    const pd_tensor_spec *s = j->spec;
    int64_t cols = s->cols ? s->cols : s->rows;
    int64_t rows = s->cols ? s->rows : 1;
    int64_t r0 = chunk * MK_ROWS_PER_CHUNK;
    int64_t r1 = r0 + MK_ROWS_PER_CHUNK < rows ? r0 + MK_ROWS_PER_CHUNK : rows;
    int64_t n = (r1 - r0) * cols;
    pd_rng rng;
    pd_rng_seed(&rng, name_hash(s->name, j->seed) + (uint64_t)chunk * 0x9e3779b97f4a7c15ull);
    for (int64_t i = 0; i < n; i++) {
        switch (s->kind) {
        case PD_TK_NORM: tmp[i] = 1.0f; break;
        case PD_TK_BIAS: tmp[i] = (float)((pd_rng_uniform(&rng) - 0.5) * 0.1); break;
        default: tmp[i] = (float)pd_rng_normal(&rng) * j->std; break;
        }
    }
    if (j->fp8) {
        /* 128x128 blocks: scale_inv = amax / 448, q = e4m3(w / scale_inv);
         * dequantisation is q * scale_inv (DeepSeek-V3 inference/kernel.py). */
        int64_t bc = j->fp8_bc;
        uint8_t *q = (uint8_t *)j->out + r0 * cols;
        for (int64_t b = 0; b < bc; b++) {
            int64_t c0 = b * 128, c1 = c0 + 128 < cols ? c0 + 128 : cols;
            float amax = 0.0f;
            for (int64_t r = 0; r < r1 - r0; r++)
                for (int64_t c = c0; c < c1; c++)
                    amax = fmaxf(amax, fabsf(tmp[r * cols + c]));
            float sc = amax > 0 ? amax / 448.0f : 1.0f;
            j->scales[chunk * bc + b] = sc;
            for (int64_t r = 0; r < r1 - r0; r++)
                for (int64_t c = c0; c < c1; c++)
                    q[r * cols + c] = pd_f32_to_e4m3(tmp[r * cols + c] / sc);
        }
        return;
    }
    size_t es = pd_dtype_size(j->dt);
    unsigned char *o = (unsigned char *)j->out + (size_t)(r0 * cols) * es;
    for (int64_t i = 0; i < n; i++) {
        if (j->dt == PD_DT_F32)
            memcpy(o + 4 * i, &tmp[i], 4);
        else {
            uint16_t v = j->dt == PD_DT_BF16 ? pd_f32_to_bf16(tmp[i]) : pd_f32_to_f16(tmp[i]);
            memcpy(o + 2 * i, &v, 2);
        }
    }
}

static void *gen_worker(void *arg) {
    gen_job *j = arg;
    int64_t cols = j->spec->cols ? j->spec->cols : j->spec->rows;
    float *tmp = malloc((size_t)(MK_ROWS_PER_CHUNK * cols) * sizeof(float));
    if (!tmp)
        return NULL;
    for (;;) {
        pthread_mutex_lock(&j->mu);
        int64_t c = j->next++;
        pthread_mutex_unlock(&j->mu);
        if (c >= j->n_chunks)
            break;
        gen_chunk(j, c, tmp);
    }
    free(tmp);
    return NULL;
}

static void gen_tensor(gen_job *j) {
    int64_t rows = j->spec->cols ? j->spec->rows : 1;
    j->n_chunks = (rows + MK_ROWS_PER_CHUNK - 1) / MK_ROWS_PER_CHUNK;
    j->next = 0;
    pthread_mutex_init(&j->mu, NULL);
    long nt = sysconf(_SC_NPROCESSORS_ONLN);
    if (nt < 1) nt = 1;
    if (nt > 64) nt = 64;
    if (nt > j->n_chunks) nt = j->n_chunks;
    pthread_t th[64];
    int started = 0;
    for (long i = 1; i < nt; i++)
        if (pthread_create(&th[started], NULL, gen_worker, j) == 0)
            started++;
    gen_worker(j);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    pthread_mutex_destroy(&j->mu);
}

static pd_dtype storage_dtype(const pd_model_config *c) {
    if (!strcmp(c->torch_dtype, "float32")) return PD_DT_F32;
    if (!strcmp(c->torch_dtype, "float16")) return PD_DT_F16;
    return PD_DT_BF16;
}

typedef struct {
    const pd_tensor_spec *spec;
    pd_dtype dt;
    bool fp8;
    size_t bytes; /* including the scale tensor */
    int shard;
} planned;

static pd_status copy_file(const char *src, const char *dst, pd_err *err) {
    char *data;
    size_t len;
    pd_status st = pd_file_read_all(src, &data, &len, err);
    if (st != PD_OK)
        return st;
    FILE *f = fopen(dst, "wb");
    if (!f) {
        free(data);
        return pd_err_set(err, PD_ERR_IO, "%s: cannot create: %s", dst, strerror(errno));
    }
    size_t w = fwrite(data, 1, len, f);
    free(data);
    if (fclose(f) != 0 || w != len)
        return pd_err_set(err, PD_ERR_IO, "%s: short write", dst);
    return PD_OK;
}

static pd_status write_shard(const pd_model_config *cfg, uint64_t seed, planned *plan, size_t np, int shard,
                             const char *path, pd_err *err) {
    pd_st_writer *w = NULL;
    pd_status st = pd_st_writer_open(path, &w, err);
    if (st != PD_OK)
        return st;
    for (size_t i = 0; i < np && st == PD_OK; i++) {
        if (plan[i].shard != shard) continue;
        const pd_tensor_spec *s = plan[i].spec;
        int64_t shape[2] = {s->rows, s->cols};
        pd_dtype dt = plan[i].fp8 ? PD_DT_F8_E4M3 : plan[i].dt;
        st = pd_st_writer_declare(w, s->name, dt, s->cols ? 2 : 1, shape, err);
        if (st == PD_OK && plan[i].fp8) {
            char sn[160];
            snprintf(sn, sizeof sn, "%.*s_scale_inv", (int)strlen(s->name), s->name);
            int64_t ss[2] = {(s->rows + cfg->fp8_block[0] - 1) / cfg->fp8_block[0],
                             (s->cols + cfg->fp8_block[1] - 1) / cfg->fp8_block[1]};
            st = pd_st_writer_declare(w, sn, PD_DT_F32, 2, ss, err);
        }
    }
    for (size_t i = 0; i < np && st == PD_OK; i++) {
        if (plan[i].shard != shard) continue;
        const pd_tensor_spec *s = plan[i].spec;
        int64_t n = s->cols ? s->rows * s->cols : s->rows;
        gen_job j;
        memset(&j, 0, sizeof j);
        j.spec = s;
        j.dt = plan[i].dt;
        j.fp8 = plan[i].fp8;
        j.seed = seed;
        j.std = cfg->initializer_range;
        j.fp8_bc = (int)((s->cols + 127) / 128);
        size_t nbytes = (size_t)n * pd_dtype_size(j.fp8 ? PD_DT_F8_E4M3 : j.dt);
        size_t nscale = j.fp8 ? (size_t)((s->rows + 127) / 128) * (size_t)j.fp8_bc : 0;
        j.out = malloc(nbytes ? nbytes : 1);
        j.scales = nscale ? malloc(nscale * sizeof(float)) : NULL;
        if (!j.out || (nscale && !j.scales)) {
            free(j.out);
            free(j.scales);
            st = pd_err_set(err, PD_ERR_NOMEM, "%s: out of memory generating %s", path, s->name);
            break;
        }
        gen_tensor(&j);
        st = pd_st_writer_write(w, s->name, j.out, nbytes, err);
        if (st == PD_OK && j.fp8) {
            char sn[160];
            snprintf(sn, sizeof sn, "%s_scale_inv", s->name);
            st = pd_st_writer_write(w, sn, j.scales, nscale * sizeof(float), err);
        }
        free(j.out);
        free(j.scales);
    }
    pd_status st2 = pd_st_writer_close(&w, err);
    return st != PD_OK ? st : st2;
}

/* mkdir -p */
static int mkdir_parents(const char *dir) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", dir);
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
            *p = '/';
        }
    return mkdir(buf, 0755) != 0 && errno != EEXIST ? -1 : 0;
}

pd_status pd_mkmodel_write(const pd_model_config *cfg, uint64_t seed, const char *dir, size_t shard_bytes,
                           const char *tokenizer_dir, pd_err *err) {
    static const char *const tok_files[] = {"tokenizer.json", "tokenizer_config.json"};
    char path[4096];
    /* a missing tokenizer fails before anything is written */
    for (int i = 0; tokenizer_dir && i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", tokenizer_dir, tok_files[i]);
        if (access(path, R_OK) != 0)
            return pd_err_set(err, PD_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    if (mkdir_parents(dir) != 0)
        return pd_err_set(err, PD_ERR_IO, "%s: cannot create directory: %s", dir, strerror(errno));
    pd_status st = PD_OK;

    pd_tensor_spec *specs;
    size_t ns;
    pd_model_tensor_specs(cfg, &specs, &ns);
    planned *plan = pd_xcalloc(ns, sizeof *plan);
    size_t total = 0, cur = 0;
    int shard = 0;
    for (size_t i = 0; i < ns; i++) {
        plan[i].spec = &specs[i];
        plan[i].dt = specs[i].kind == PD_TK_BIAS ? PD_DT_F32 : storage_dtype(cfg);
        plan[i].fp8 = cfg->fp8 && specs[i].kind == PD_TK_LINEAR;
        int64_t n = specs[i].cols ? specs[i].rows * specs[i].cols : specs[i].rows;
        plan[i].bytes = (size_t)n * pd_dtype_size(plan[i].fp8 ? PD_DT_F8_E4M3 : plan[i].dt);
        if (plan[i].fp8)
            plan[i].bytes += 4 * (size_t)(((specs[i].rows + 127) / 128) * ((specs[i].cols + 127) / 128));
        if (cur > 0 && shard_bytes > 0 && cur + plan[i].bytes > shard_bytes) {
            shard++;
            cur = 0;
        }
        plan[i].shard = shard;
        cur += plan[i].bytes;
        total += plan[i].bytes;
    }
    int n_shards = shard + 1;
    json_t *wmap = json_object();
    for (int s = 0; s < n_shards && st == PD_OK; s++) {
        char fname[64];
        if (n_shards == 1)
            snprintf(fname, sizeof fname, "model.safetensors");
        else
            snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        snprintf(path, sizeof path, "%s/%s", dir, fname);
        st = write_shard(cfg, seed, plan, ns, s, path, err);
        for (size_t i = 0; i < ns; i++) {
            if (plan[i].shard != s) continue;
            json_object_set_new(wmap, specs[i].name, json_string(fname));
            if (plan[i].fp8) {
                char sn[160];
                snprintf(sn, sizeof sn, "%s_scale_inv", specs[i].name);
                json_object_set_new(wmap, sn, json_string(fname));
            }
        }
    }
    if (st == PD_OK && n_shards > 1) {
        json_t *idx = json_pack("{s:{s:I}, s:O}", "metadata", "total_size", (json_int_t)total, "weight_map", wmap);
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        if (json_dump_file(idx, path, JSON_INDENT(2) | JSON_SORT_KEYS) != 0)
            st = pd_err_set(err, PD_ERR_IO, "%s: cannot write", path);
        json_decref(idx);
    }
    json_decref(wmap);
    free(plan);
    free(specs);
    if (st == PD_OK && tokenizer_dir) {
        for (int i = 0; i < 2 && st == PD_OK; i++) {
            char src[4096];
            snprintf(src, sizeof src, "%s/%s", tokenizer_dir, tok_files[i]);
            snprintf(path, sizeof path, "%s/%s", dir, tok_files[i]);
            st = copy_file(src, path, err);
        }
    }
    /* config.json last: its presence means the checkpoint is whole (make's
     * target for the model; a failed run leaves none, so the next one
     * writes the checkpoint again instead of serving a partial one) */
    if (st == PD_OK) {
        snprintf(path, sizeof path, "%s/config.json", dir);
        st = pd_config_save(cfg, path, err);
    }
    return st;
}

/* Loading a checkpoint onto a backend (one rank's shard per backend with
 * tensor parallelism), and the paged latent KV cache. */
#include "model_impl.h"

#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <string.h>

/* YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension")
 * frequencies, as transformers modeling_rope_utils._compute_yarn_parameters
 * computes them: blend interpolated (θ/factor) and extrapolated (θ)
 * frequencies with a linear ramp between the correction dims of beta_fast
 * and beta_slow rotations; attention factor mscale(factor, mscale) /
 * mscale(factor, mscale_all_dim). */
static double yarn_mscale(double scale, double m) {
    return scale <= 1.0 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

static double yarn_correction_dim(double rotations, int dim, double base, int max_pos) {
    return (dim * log(max_pos / (rotations * 2.0 * M_PI))) / (2.0 * log(base));
}

static void rope_init(pd_model *m) {
    const pd_model_config *c = &m->cfg;
    int dim = c->qk_rope_head_dim, half = dim / 2;
    m->inv_freq = pd_xmalloc((size_t)half * sizeof(float));
    m->rope_mscale = 1.0f;
    for (int i = 0; i < half; i++) {
        /* base ** (2i/dim) in fp32, as the reference builds it */
        float pos_freq = powf((float)c->rope_theta, (float)(2 * i) / (float)dim);
        m->inv_freq[i] = 1.0f / pos_freq;
    }
    if (!c->has_yarn)
        return;
    double factor = c->yarn_factor;
    double low = floor(yarn_correction_dim(c->yarn_beta_fast, dim, c->rope_theta, c->yarn_original_max_position_embeddings));
    double high = ceil(yarn_correction_dim(c->yarn_beta_slow, dim, c->rope_theta, c->yarn_original_max_position_embeddings));
    if (low < 0) low = 0;
    if (high > dim - 1) high = dim - 1;
    if (low == high) high += 0.001;
    for (int i = 0; i < half; i++) {
        float pos_freq = powf((float)c->rope_theta, (float)(2 * i) / (float)dim);
        float extrap = 1.0f / pos_freq;
        float interp = 1.0f / ((float)factor * pos_freq);
        float ramp = (float)(((double)i - low) / (high - low));
        if (ramp < 0) ramp = 0;
        if (ramp > 1) ramp = 1;
        float extrap_factor = 1.0f - ramp;
        m->inv_freq[i] = interp * (1.0f - extrap_factor) + extrap * extrap_factor;
    }
    if (c->yarn_mscale != 0.0 && c->yarn_mscale_all_dim != 0.0)
        m->rope_mscale = (float)(yarn_mscale(factor, c->yarn_mscale) / yarn_mscale(factor, c->yarn_mscale_all_dim));
    else
        m->rope_mscale = (float)yarn_mscale(factor, 1.0);
}

typedef struct {
    pd_model *m;
    pd_model_rank *rk; /* the rank being loaded */
    pd_safetensors *st;
    const char *dir;
    pd_err *err;
} loader;

/* Which part of a weight a rank holds: all of it (replicated), its share of
 * the rows (output features: heads, intermediate units) or of the columns
 * (input features), the shares in rank order. */
typedef enum { PART_ALL, PART_ROWS, PART_COLS } tp_part;

/* Reads tensor `name` of shape [rows, cols] (cols 0: 1-D) as fp32 into a
 * fresh host buffer, dequantising FP8 blocks (value × weight_scale_inv). */
static pd_status load_f32(loader *ld, const char *name, int64_t rows, int64_t cols, float **out_p) {
    const pd_st_tensor *t = pd_st_find(ld->st, name);
    if (!t)
        return pd_err_set(ld->err, PD_ERR_NOTFOUND, "%s: missing tensor '%s'", ld->dir, name);
    bool shape_ok = cols ? (t->ndim == 2 && t->shape[0] == rows && t->shape[1] == cols)
                         : (t->ndim == 1 && t->shape[0] == rows);
    if (!shape_ok) {
        char got[96] = "";
        int off = 0;
        for (int i = 0; i < t->ndim && off < 80; i++)
            off += snprintf(got + off, sizeof got - off, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        if (cols)
            return pd_err_set(ld->err, PD_ERR_SHAPE, "%s: tensor '%s' has shape [%s], config implies [%lld, %lld]",
                              t->file, name, got, (long long)rows, (long long)cols);
        return pd_err_set(ld->err, PD_ERR_SHAPE, "%s: tensor '%s' has shape [%s], config implies [%lld]", t->file,
                          name, got, (long long)rows);
    }
    if (t->dtype != PD_DT_F32 && t->dtype != PD_DT_BF16 && t->dtype != PD_DT_F16 && t->dtype != PD_DT_F8_E4M3)
        return pd_err_set(ld->err, PD_ERR_UNSUPPORTED, "%s: tensor '%s' has dtype %s, not a weight dtype", t->file,
                          name, pd_dtype_name(t->dtype));
    size_t n = (size_t)rows * (size_t)(cols ? cols : 1);
    float *buf = malloc(n * sizeof(float));
    if (!buf)
        return pd_err_set(ld->err, PD_ERR_NOMEM, "%s: out of memory loading '%s'", t->file, name);
    if (t->dtype != PD_DT_F8_E4M3) {
        pd_st_to_f32(t, buf);
    } else if (!cols) {
        free(buf);
        return pd_err_set(ld->err, PD_ERR_UNSUPPORTED,
                          "%s: tensor '%s' is F8_E4M3 but 1-D: only matrices are block-quantised", t->file, name);
    } else {
        char sn[192];
        snprintf(sn, sizeof sn, "%s_scale_inv", name);
        const pd_st_tensor *s = pd_st_find(ld->st, sn);
        int bm = ld->m->cfg.fp8_block[0] > 0 ? ld->m->cfg.fp8_block[0] : 128;
        int bn = ld->m->cfg.fp8_block[1] > 0 ? ld->m->cfg.fp8_block[1] : 128;
        int64_t sr = (rows + bm - 1) / bm, sc = (cols + bn - 1) / bn;
        if (!s) {
            free(buf);
            return pd_err_set(ld->err, PD_ERR_NOTFOUND, "%s: FP8 tensor '%s' has no '%s'", t->file, name, sn);
        }
        if (s->ndim != 2 || s->shape[0] != sr || s->shape[1] != sc ||
            (s->dtype != PD_DT_F32 && s->dtype != PD_DT_BF16 && s->dtype != PD_DT_F16)) {
            char got[96] = "";
            for (int i = 0, off = 0; i < s->ndim && off < 80; i++)
                off += snprintf(got + off, sizeof got - off, "%s%lld", i ? ", " : "", (long long)s->shape[i]);
            free(buf);
            return pd_err_set(ld->err, PD_ERR_SHAPE,
                              "%s: tensor '%s' is %s [%s]; %s [%lld, %lld] in blocks of %d x %d implies [%lld, %lld] "
                              "F32/BF16/F16",
                              s->file, sn, pd_dtype_name(s->dtype), got, name, (long long)rows, (long long)cols, bm, bn,
                              (long long)sr, (long long)sc);
        }
        float *scale = malloc((size_t)(sr * sc) * sizeof(float));
        if (!scale) {
            free(buf);
            return pd_err_set(ld->err, PD_ERR_NOMEM, "out of memory");
        }
        pd_st_to_f32(s, scale);
        for (int64_t k = 0; k < sr * sc; k++)
            if (!isfinite(scale[k])) {
                const float v = scale[k];
                free(scale);
                free(buf);
                return pd_err_set(ld->err, PD_ERR_FORMAT, "%s: tensor '%s' holds %g at [%lld, %lld]: a scale must be finite",
                                  s->file, sn, v, (long long)(k / sc), (long long)(k % sc));
            }
        /* value × its block's scale, a block's run of a row at a time (the
         * same product as decoding first and scaling after), rows over the
         * OpenMP threads (shared between the ranks, which load at once);
         * e4m3's NaN codes (0x7f, 0xff) are a broken file, not a weight:
         * the first row holding one is named */
        const float *tab = pd_e4m3_table();
        const uint8_t *q = t->data;
        const int n_thr = omp_get_max_threads() / ld->rk->n_ranks;
        int64_t nan_row = rows;
#pragma omp parallel for if (rows * cols >= (1 << 20)) num_threads(n_thr > 1 ? n_thr : 1) schedule(static) \
    reduction(min : nan_row)
        for (int64_t r = 0; r < rows; r++) {
            const float *srow = scale + (r / bm) * sc;
            const uint8_t *restrict qr = q + r * cols;
            float *restrict o = buf + r * cols;
            unsigned nan_codes = 0;
            for (int64_t c0 = 0; c0 < cols; c0 += bn) {
                const float f = srow[c0 / bn];
                const int64_t c1 = c0 + bn < cols ? c0 + bn : cols;
                for (int64_t c = c0; c < c1; c++) {
                    o[c] = tab[qr[c]] * f;
                    nan_codes |= (qr[c] & 0x7fu) == 0x7fu;
                }
            }
            if (nan_codes && r < nan_row)
                nan_row = r;
        }
        free(scale);
        if (nan_row < rows) {
            free(buf);
            return pd_err_set(ld->err, PD_ERR_FORMAT, "%s: FP8 tensor '%s' holds a NaN code (0x7f or 0xff) in row %lld",
                              t->file, name, (long long)nan_row);
        }
    }
    *out_p = buf;
    return PD_OK;
}

/* True when tensor `name` can go to the backend as bf16 bits without an
 * fp32 copy: a BF16 tensor of the expected shape, on a backend that loads
 * bf16 (a wrong shape or a missing tensor takes the fp32 path, which says
 * what is wrong). */
static bool bf16_direct(loader *ld, const char *name, int64_t rows, int64_t cols) {
    const pd_backend_i *ops = ld->rk->be->ops;
    const pd_st_tensor *t = pd_st_find(ld->st, name);
    return ops->weight_alloc && ops->weight_set_bf16 && t && t->dtype == PD_DT_BF16 && t->ndim == 2 &&
           t->shape[0] == rows && t->shape[1] == cols;
}

/* Columns [c0, c0 + nc) of a row-major [rows, cols] matrix of esz-byte
 * elements, as a fresh [rows, nc] matrix; NULL when out of memory. */
static void *cols_copy(const void *src, size_t esz, int64_t rows, int64_t cols, int64_t c0, int64_t nc) {
    char *d = malloc((size_t)(rows * nc) * esz);
    if (!d)
        return NULL;
    for (int64_t r = 0; r < rows; r++)
        memcpy(d + (size_t)(r * nc) * esz, (const char *)src + (size_t)(r * cols + c0) * esz, (size_t)nc * esz);
    return d;
}

/* Loads this rank's `part` of the [rows, cols] weight `name`. */
static pd_status load_weight(loader *ld, const char *name, int64_t rows, int64_t cols, tp_part part, pd_weight *w) {
    pd_backend *be = ld->rk->be;
    int64_t r0 = 0, nr = rows, c0 = 0, nc = cols;
    if (part == PART_ROWS) {
        nr = rows / ld->rk->n_ranks;
        r0 = nr * ld->rk->rank;
    } else if (part == PART_COLS) {
        nc = cols / ld->rk->n_ranks;
        c0 = nc * ld->rk->rank;
    }
    pd_status st;
    if (bf16_direct(ld, name, rows, cols)) {
        const uint16_t *src = (const uint16_t *)pd_st_find(ld->st, name)->data + r0 * cols;
        uint16_t *part_cols = nc < cols ? cols_copy(src, sizeof *src, rows, cols, c0, nc) : NULL;
        if (nc < cols && !part_cols)
            return pd_err_set(ld->err, PD_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir, name);
        st = be->ops->weight_alloc(be, (int)nr, (int)nc, w);
        if (st == PD_OK)
            st = be->ops->weight_set_bf16(be, w, 0, (int)nr, part_cols ? part_cols : src);
        free(part_cols);
    } else {
        float *h;
        if ((st = load_f32(ld, name, rows, cols, &h)) != PD_OK)
            return st;
        float *part_cols = nc < cols ? cols_copy(h, sizeof *h, rows, cols, c0, nc) : NULL;
        if (nc < cols && !part_cols) {
            free(h);
            return pd_err_set(ld->err, PD_ERR_NOMEM, "%s: out of memory loading '%s'", ld->dir, name);
        }
        st = be->ops->weight_from_f32(be, part_cols ? part_cols : h + r0 * cols, (int)nr, (int)nc, w);
        free(part_cols);
        free(h);
    }
    if (st != PD_OK)
        return pd_err_set(ld->err, st, "%s: cannot place '%s' on the %s backend", ld->dir, name, be->ops->name);
    return PD_OK;
}

static pd_status load_vec(loader *ld, const char *name, int64_t n, float **out) {
    float *h;
    pd_status st = load_f32(ld, name, n, 0, &h);
    if (st != PD_OK)
        return st;
    pd_backend *be = ld->rk->be;
    *out = be->ops->alloc(be, (size_t)n * sizeof(float));
    if (!*out) {
        free(h);
        return pd_err_set(ld->err, PD_ERR_NOMEM, "out of memory for '%s'", name);
    }
    be->ops->upload(be, *out, h, (size_t)n * sizeof(float));
    free(h);
    return PD_OK;
}

/* gate_proj and up_proj, this rank's rows of each (all of them when not
 * split: an expert-parallel rank's own experts), stacked into one [2I, H]
 * weight; down_proj's matching columns. */
static pd_status load_mlp(loader *ld, const char *prefix, int64_t h, int64_t inter, bool split, pd_mlp_weights *mw) {
    char n1[192], n2[192], n3[192];
    snprintf(n1, sizeof n1, "%s.gate_proj.weight", prefix);
    snprintf(n2, sizeof n2, "%s.up_proj.weight", prefix);
    snprintf(n3, sizeof n3, "%s.down_proj.weight", prefix);
    pd_backend *be = ld->rk->be;
    int64_t il = split ? inter / ld->rk->n_ranks : inter, r0 = split ? il * ld->rk->rank : 0;
    pd_status st;
    if (bf16_direct(ld, n1, inter, h) && bf16_direct(ld, n2, inter, h)) {
        const uint16_t *g = pd_st_find(ld->st, n1)->data, *u = pd_st_find(ld->st, n2)->data;
        st = be->ops->weight_alloc(be, (int)(2 * il), (int)h, &mw->gate_up);
        if (st == PD_OK)
            st = be->ops->weight_set_bf16(be, &mw->gate_up, 0, (int)il, g + r0 * h);
        if (st == PD_OK)
            st = be->ops->weight_set_bf16(be, &mw->gate_up, (int)il, (int)il, u + r0 * h);
    } else {
        float *g, *u;
        if ((st = load_f32(ld, n1, inter, h, &g)) != PD_OK)
            return st;
        if ((st = load_f32(ld, n2, inter, h, &u)) != PD_OK) {
            free(g);
            return st;
        }
        float *gu = malloc((size_t)(2 * il * h) * sizeof(float));
        if (!gu) {
            free(g);
            free(u);
            return pd_err_set(ld->err, PD_ERR_NOMEM, "out of memory");
        }
        memcpy(gu, g + r0 * h, (size_t)(il * h) * sizeof(float));
        memcpy(gu + il * h, u + r0 * h, (size_t)(il * h) * sizeof(float));
        free(g);
        free(u);
        st = be->ops->weight_from_f32(be, gu, (int)(2 * il), (int)h, &mw->gate_up);
        free(gu);
    }
    if (st != PD_OK)
        return pd_err_set(ld->err, st, "cannot place '%s' on the backend", n1);
    mw->inter = (int)il;
    return load_weight(ld, n3, h, inter, split ? PART_COLS : PART_ALL, &mw->down);
}

/* Loads rank ld->rk's shard: every tensor the config implies, in the
 * checkpoint's order of layers. */
static pd_status load_rank(loader *ld) {
    const pd_model_config *c = &ld->m->cfg;
    pd_model_rank *rk = ld->rk;
    pd_backend *be = rk->be;
    int64_t h = c->hidden_size, nh = c->num_attention_heads, qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
    rk->n_heads = (int)(nh / rk->n_ranks);
    rk->layers = pd_xcalloc((size_t)c->num_hidden_layers, sizeof *rk->layers);
    pd_status st = load_weight(ld, "model.embed_tokens.weight", c->vocab_size, h, PART_ALL, &rk->embed);
    for (int i = 0; i < c->num_hidden_layers && st == PD_OK; i++) {
        pd_layer_weights *L = &rk->layers[i];
        char p[160], n[256];
#define NAME(fmt) (snprintf(n, sizeof n, "%s." fmt, p), n)
        snprintf(p, sizeof p, "model.layers.%d", i);
        if (st == PD_OK) st = load_vec(ld, NAME("input_layernorm.weight"), h, &L->input_norm);
        if (st == PD_OK) st = load_vec(ld, NAME("post_attention_layernorm.weight"), h, &L->post_norm);
        if (c->q_lora_rank > 0) {
            if (st == PD_OK)
                st = load_weight(ld, NAME("self_attn.q_a_proj.weight"), c->q_lora_rank, h, PART_ALL, &L->q_a);
            if (st == PD_OK) st = load_vec(ld, NAME("self_attn.q_a_layernorm.weight"), c->q_lora_rank, &L->q_a_norm);
            if (st == PD_OK)
                st = load_weight(ld, NAME("self_attn.q_b_proj.weight"), nh * qk, c->q_lora_rank, PART_ROWS, &L->q_b);
        } else if (st == PD_OK) {
            st = load_weight(ld, NAME("self_attn.q_proj.weight"), nh * qk, h, PART_ROWS, &L->q);
        }
        if (st == PD_OK)
            st = load_weight(ld, NAME("self_attn.kv_a_proj_with_mqa.weight"), c->kv_lora_rank + c->qk_rope_head_dim, h,
                             PART_ALL, &L->kv_a);
        if (st == PD_OK) st = load_vec(ld, NAME("self_attn.kv_a_layernorm.weight"), c->kv_lora_rank, &L->kv_a_norm);
        if (st == PD_OK)
            st = load_weight(ld, NAME("self_attn.kv_b_proj.weight"), nh * (c->qk_nope_head_dim + c->v_head_dim),
                             c->kv_lora_rank, PART_ROWS, &L->kv_b);
        if (st == PD_OK)
            st = load_weight(ld, NAME("self_attn.o_proj.weight"), h, nh * c->v_head_dim, PART_COLS, &L->o);
        L->is_moe = pd_config_layer_is_moe(c, i);
        if (!L->is_moe) {
            snprintf(n, sizeof n, "%s.mlp", p);
            if (st == PD_OK) st = load_mlp(ld, n, h, c->intermediate_size, true, &L->mlp);
            continue;
        }
        if (st == PD_OK) st = load_weight(ld, NAME("mlp.gate.weight"), c->n_routed_experts, h, PART_ALL, &L->router);
        if (st == PD_OK && c->arch == PD_ARCH_DEEPSEEK_V3)
            st = load_vec(ld, NAME("mlp.gate.e_score_correction_bias"), c->n_routed_experts, &L->router_bias);
        /* this rank's experts only: all of them split (tensor parallel) or
         * its own whole (expert parallel) */
        L->experts_gate_up = pd_xcalloc((size_t)rk->n_experts, sizeof(pd_weight));
        L->experts_down = pd_xcalloc((size_t)rk->n_experts, sizeof(pd_weight));
        for (int e = 0; e < rk->n_experts && st == PD_OK; e++) {
            pd_mlp_weights mw;
            char ep[200];
            snprintf(ep, sizeof ep, "%s.mlp.experts.%d", p, rk->expert_first + e);
            st = load_mlp(ld, ep, h, c->moe_intermediate_size, !rk->expert_parallel, &mw);
            L->experts_gate_up[e] = mw.gate_up;
            L->experts_down[e] = mw.down;
        }
        if (st == PD_OK && c->n_shared_experts > 0) {
            snprintf(n, sizeof n, "%s.mlp.shared_experts", p);
            st = load_mlp(ld, n, h, (int64_t)c->moe_intermediate_size * c->n_shared_experts, true, &L->shared);
        }
#undef NAME
    }
    if (st == PD_OK) st = load_vec(ld, "model.norm.weight", h, &rk->final_norm);
    if (st == PD_OK) {
        if (c->tie_word_embeddings)
            rk->lm_head = rk->embed;
        else
            st = load_weight(ld, "lm_head.weight", c->vocab_size, h, PART_ALL, &rk->lm_head);
    }
    if (st != PD_OK)
        return st;
    int half = c->qk_rope_head_dim / 2;
    rk->inv_freq_b = be->ops->alloc(be, (size_t)(half > 0 ? half : 1) * sizeof(float));
    if (!rk->inv_freq_b)
        return pd_err_set(ld->err, PD_ERR_NOMEM, "%s: out of backend memory", ld->dir);
    be->ops->upload(be, rk->inv_freq_b, ld->m->inv_freq, (size_t)half * sizeof(float));
    return PD_OK;
}

/* Tensor parallelism divides heads and intermediate sizes evenly, expert
 * parallelism the routed experts (and the shared experts' intermediate
 * size): a size that does not divide them is refused here, before anything
 * is loaded. */
static pd_status tp_check(const pd_model_config *c, int n, bool ep, const char *path, pd_err *err) {
    bool any_dense = false, any_moe = false;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        if (pd_config_layer_is_moe(c, l))
            any_moe = true;
        else
            any_dense = true;
    }
    const char *what = NULL;
    int size = 0;
    if (c->num_attention_heads % n)
        what = "num_attention_heads", size = c->num_attention_heads;
    else if (any_dense && c->intermediate_size % n)
        what = "intermediate_size", size = c->intermediate_size;
    else if (any_moe && ep && c->n_routed_experts % n)
        return pd_err_set(err, PD_ERR_INVALID,
                          "%s: --enable-expert-parallel: tensor parallel size %d does not divide n_routed_experts (%d); "
                          "use a size that divides the routed experts",
                          path, n, c->n_routed_experts);
    else if (any_moe && ep && c->n_shared_experts > 0 && (c->moe_intermediate_size * c->n_shared_experts) % n)
        what = "the shared experts' intermediate size", size = c->moe_intermediate_size * c->n_shared_experts;
    else if (any_moe && !ep && c->moe_intermediate_size % n)
        what = "moe_intermediate_size", size = c->moe_intermediate_size;
    if (what)
        return pd_err_set(err, PD_ERR_INVALID,
                          "%s: tensor parallel size %d does not divide %s (%d); use a size that divides the heads "
                          "and intermediate sizes",
                          path, n, what, size);
    return PD_OK;
}

typedef struct {
    pd_model *m;
    pd_safetensors *st;
    const char *dir;
    pd_status status[PD_TP_MAX_RANKS];
    pd_err err[PD_TP_MAX_RANKS];
} load_job;

static void load_on_rank(void *arg, int rank) {
    load_job *j = arg;
    loader ld = {j->m, &j->m->ranks[rank], j->st, j->dir, &j->err[rank]};
    j->status[rank] = load_rank(&ld);
}

pd_status pd_model_load(const char *dir, pd_backend *be, pd_model **m_p, pd_err *err) {
    return pd_model_load_parallel(dir, &be, 1, false, m_p, err);
}

pd_status pd_model_load_tp(const char *dir, pd_backend *const *bes, int n_ranks, pd_model **m_p, pd_err *err) {
    return pd_model_load_parallel(dir, bes, n_ranks, false, m_p, err);
}

/* One line per rank at start-up: which experts it holds and their size. */
static void log_experts(const pd_model *m) {
    const pd_model_config *c = &m->cfg;
    int n_moe = 0;
    for (int l = 0; l < c->num_hidden_layers; l++)
        n_moe += pd_config_layer_is_moe(c, l);
    if (n_moe == 0 || c->n_routed_experts == 0)
        return;
    double per_expert = 3.0 * c->moe_intermediate_size * c->hidden_size * n_moe; /* gate, up, down */
    double all = per_expert * c->n_routed_experts;
    for (int r = 0; r < m->n_ranks; r++) {
        const pd_model_rank *rk = &m->ranks[r];
        PD_LOGI("model",
                "expert parallel rank %d/%d: routed experts [%d, %d) of %d, whole: %.2f M parameters (%.2f MiB as "
                "bf16), %.3g of the model's %.2f M; %d other experts' weights not loaded",
                r, m->n_ranks, rk->expert_first, rk->expert_first + rk->n_experts, c->n_routed_experts,
                per_expert * rk->n_experts / 1e6, per_expert * rk->n_experts * 2 / 1048576.0,
                (double)rk->n_experts / c->n_routed_experts, all / 1e6, c->n_routed_experts - rk->n_experts);
    }
}

pd_status pd_model_load_parallel(const char *dir, pd_backend *const *bes, int n_ranks, bool expert_parallel,
                                 pd_model **m_p, pd_err *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (n_ranks < 1 || n_ranks > PD_TP_MAX_RANKS)
        return pd_err_set(err, PD_ERR_INVALID, "tensor parallel size %d: expected 1 to %d", n_ranks,
                          PD_TP_MAX_RANKS);
    for (int r = 0; n_ranks > 1 && r < n_ranks; r++)
        if (bes[r]->n_ranks != n_ranks || bes[r]->rank != r)
            return pd_err_set(err, PD_ERR_INVALID, "backend %d is rank %d of %d, not rank %d of %d", r, bes[r]->rank,
                              bes[r]->n_ranks, r, n_ranks);
    pd_model *m = pd_xcalloc(1, sizeof *m);
    m->be = bes[0];
    pd_status st = pd_config_load(path, &m->cfg, err);
    if (st != PD_OK) {
        free(m);
        return st;
    }
    const pd_model_config *c = &m->cfg;
    if (c->n_routed_experts > 1024 || c->num_experts_per_tok > 256 || c->n_group > 256 || c->qk_rope_head_dim > 1024) {
        free(m);
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "%s: more than 1024 experts, 256 per token or 256 groups", path);
    }
    if ((st = tp_check(c, n_ranks, expert_parallel, path, err)) != PD_OK) {
        free(m);
        return st;
    }
    m->n_ranks = n_ranks;
    m->expert_parallel = expert_parallel;
    m->ranks = pd_xcalloc((size_t)n_ranks, sizeof *m->ranks);
    int e_local = expert_parallel ? c->n_routed_experts / n_ranks : c->n_routed_experts;
    for (int r = 0; r < n_ranks; r++)
        m->ranks[r] = (pd_model_rank){.be = bes[r], .rank = r, .n_ranks = n_ranks,
                                      .expert_first = expert_parallel ? r * e_local : 0, .n_experts = e_local,
                                      .expert_parallel = expert_parallel};
    pd_model_read_switches(m);
    rope_init(m);
    m->softmax_scale = pd_config_softmax_scale(c);
    if (n_ranks > 1 && (st = pd_tp_team_init(bes, n_ranks, &m->team, err)) != PD_OK) {
        pd_model_free(&m);
        return st;
    }
    load_job *j = pd_xcalloc(1, sizeof *j);
    j->m = m;
    j->dir = dir;
    st = pd_st_open_dir(dir, &j->st, err);
    if (st == PD_OK) {
        pd_tp_run(m->team, n_ranks, load_on_rank, j);
        for (int r = 0; r < n_ranks && st == PD_OK; r++)
            if ((st = j->status[r]) != PD_OK)
                pd_err_set(err, st, "%s", j->err[r].msg);
    }
    pd_st_close(&j->st);
    free(j);
    if (st != PD_OK) {
        pd_model_free(&m);
        return st;
    }
    if (expert_parallel)
        log_experts(m);
    *m_p = m;
    return PD_OK;
}

static void wfree(pd_backend *be, pd_weight *w) {
    if (w->data)
        be->ops->weight_free(be, w);
}

static void ffree(pd_backend *be, float *p) {
    if (p)
        be->ops->free(be, p);
}

static void free_on_rank(void *arg, int rank) {
    pd_model *m = arg;
    pd_model_rank *rk = &m->ranks[rank];
    pd_backend *be = rk->be;
    pd_fwd_ws_free(rk);
    ffree(be, rk->inv_freq_b);
    if (rk->layers) {
        for (int i = 0; i < m->cfg.num_hidden_layers; i++) {
            pd_layer_weights *L = &rk->layers[i];
            ffree(be, L->input_norm);
            ffree(be, L->post_norm);
            ffree(be, L->q_a_norm);
            ffree(be, L->kv_a_norm);
            ffree(be, L->router_bias);
            wfree(be, &L->q_a);
            wfree(be, &L->q_b);
            wfree(be, &L->q);
            wfree(be, &L->kv_a);
            wfree(be, &L->kv_b);
            wfree(be, &L->o);
            wfree(be, &L->mlp.gate_up);
            wfree(be, &L->mlp.down);
            wfree(be, &L->router);
            wfree(be, &L->shared.gate_up);
            wfree(be, &L->shared.down);
            if (L->experts_gate_up)
                for (int e = 0; e < rk->n_experts; e++) {
                    wfree(be, &L->experts_gate_up[e]);
                    wfree(be, &L->experts_down[e]);
                }
            free(L->experts_gate_up);
            free(L->experts_down);
        }
        free(rk->layers);
    }
    if (rk->lm_head.data != rk->embed.data)
        wfree(be, &rk->lm_head);
    wfree(be, &rk->embed);
    ffree(be, rk->final_norm);
}

void pd_model_free(pd_model **m_p) {
    if (!m_p || !*m_p)
        return;
    pd_model *m = *m_p;
    if (m->ranks && (m->team || m->n_ranks == 1)) /* else the threads never started: nothing was loaded */
        pd_tp_run(m->team, m->n_ranks, free_on_rank, m);
    pd_tp_team_free(&m->team);
    free(m->ranks);
    free(m->inv_freq);
    free(m);
    *m_p = NULL;
}

const pd_model_config *pd_model_config_of(const pd_model *m) {
    return &m->cfg;
}

int pd_model_tp_size(const pd_model *m) {
    return m->n_ranks;
}

bool pd_model_expert_parallel(const pd_model *m) {
    return m->expert_parallel;
}

void pd_model_rank_experts(const pd_model *m, int rank, int *first, int *count) {
    PD_ASSERT(rank >= 0 && rank < m->n_ranks);
    *first = m->ranks[rank].expert_first;
    *count = m->ranks[rank].n_experts;
}

/* ---- paged latent KV cache ---- */

typedef struct {
    pd_kv_cache *kv;
    size_t bytes;
} kv_job;

static void kv_alloc_on_rank(void *arg, int rank) {
    kv_job *j = arg;
    pd_backend *be = j->kv->m->ranks[rank].be;
    j->kv->rank_data[rank] = be->ops->alloc(be, j->bytes);
}

static void kv_free_on_rank(void *arg, int rank) {
    kv_job *j = arg;
    pd_backend *be = j->kv->m->ranks[rank].be;
    if (j->kv->rank_data[rank])
        be->ops->free(be, j->kv->rank_data[rank]);
    j->kv->rank_data[rank] = NULL;
}

pd_status pd_kv_cache_init(const pd_model *m, int block_size, int num_blocks, pd_kv_cache **kv_p, pd_err *err) {
    if (block_size <= 0 || num_blocks <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "KV cache: block_size %d and num_blocks %d must be positive", block_size,
                          num_blocks);
    /* cache slots are int32 indices of token rows (forward.c) */
    if ((int64_t)num_blocks * m->cfg.num_hidden_layers * block_size > INT32_MAX)
        return pd_err_set(err, PD_ERR_LIMIT, "KV cache: %d blocks of %d tokens × %d layers is more than 2^31 rows",
                          num_blocks, block_size, m->cfg.num_hidden_layers);
    static atomic_uint_fast64_t next_id = 1;
    pd_kv_cache *kv = pd_xcalloc(1, sizeof *kv);
    kv->id = atomic_fetch_add(&next_id, 1);
    kv->m = m;
    kv->be = m->be;
    kv->block_size = block_size;
    kv->num_blocks = num_blocks;
    kv->n_layers = m->cfg.num_hidden_layers;
    kv->dim = m->cfg.kv_lora_rank + m->cfg.qk_rope_head_dim;
    kv_job j = {.kv = kv, .bytes = (size_t)num_blocks * pd_kv_cache_block_bytes(kv)};
    pd_tp_run(m->team, m->n_ranks, kv_alloc_on_rank, &j);
    for (int r = 0; r < m->n_ranks; r++)
        if (!kv->rank_data[r]) {
            pd_tp_run(m->team, m->n_ranks, kv_free_on_rank, &j);
            free(kv);
            return pd_err_set(err, PD_ERR_NOMEM, "KV cache: cannot allocate %zu bytes (%d blocks) on rank %d", j.bytes,
                              num_blocks, r);
        }
    kv->data = kv->rank_data[0];
    kv->free_list = pd_xmalloc((size_t)num_blocks * sizeof(int));
    for (int i = 0; i < num_blocks; i++)
        kv->free_list[i] = num_blocks - 1 - i; /* pop from the end: block 0 first */
    kv->n_free = num_blocks;
    *kv_p = kv;
    return PD_OK;
}

void pd_kv_cache_free(pd_kv_cache **kv_p) {
    if (!kv_p || !*kv_p)
        return;
    pd_kv_cache *kv = *kv_p;
    kv_job j = {.kv = kv};
    pd_tp_run(kv->m->team, kv->m->n_ranks, kv_free_on_rank, &j);
    free(kv->free_list);
    free(kv);
    *kv_p = NULL;
}

int pd_kv_cache_block_size(const pd_kv_cache *kv) { return kv->block_size; }
int pd_kv_cache_num_free(const pd_kv_cache *kv) { return kv->n_free; }
int pd_kv_cache_num_blocks(const pd_kv_cache *kv) { return kv->num_blocks; }

int pd_kv_cache_alloc(pd_kv_cache *kv) {
    return kv->n_free > 0 ? kv->free_list[--kv->n_free] : -1;
}

void pd_kv_cache_release(pd_kv_cache *kv, int block) {
    PD_ASSERT(block >= 0 && block < kv->num_blocks && kv->n_free < kv->num_blocks);
    kv->free_list[kv->n_free++] = block;
}

size_t pd_kv_cache_bytes_per_block(const pd_model_config *cfg, int block_size) {
    return (size_t)cfg->num_hidden_layers * (size_t)block_size * (size_t)(cfg->kv_lora_rank + cfg->qk_rope_head_dim) *
           sizeof(float);
}

pd_status pd_kv_plan_blocks(size_t mem_total, size_t mem_free, size_t own_in_use, double utilization, size_t reserve,
                            size_t block_bytes, int max_blocks, pd_kv_plan *plan, pd_err *err) {
    if (!(utilization > 0.0 && utilization <= 1.0) || mem_free > mem_total || own_in_use > mem_total - mem_free ||
        block_bytes == 0 || max_blocks <= 0)
        return pd_err_set(err, PD_ERR_INVALID,
                          "KV plan: utilization %g must be in (0, 1], free %zu <= total %zu bytes, this replica's %zu <= "
                          "in use, block bytes %zu > 0",
                          utilization, mem_free, mem_total, own_in_use, block_bytes);
    memset(plan, 0, sizeof *plan);
    plan->mem_total = mem_total;
    plan->mem_free = mem_free;
    plan->mem_in_use = own_in_use;
    plan->mem_others = mem_total - mem_free - own_in_use;
    plan->budget = (size_t)(utilization * (double)mem_total);
    plan->reserve = reserve;
    const size_t taken = own_in_use + reserve;
    const size_t by_budget = plan->budget > taken ? plan->budget - taken : 0;
    const size_t by_free = mem_free > reserve ? mem_free - reserve : 0;
    plan->by_free = by_free < by_budget;
    size_t blocks = (plan->by_free ? by_free : by_budget) / block_bytes;
    if (blocks > (size_t)max_blocks)
        blocks = (size_t)max_blocks;
    const double gib = 1073741824.0;
    if (blocks == 0)
        return pd_err_set(err, PD_ERR_NOMEM,
                          "--gpu-memory-utilization %.2f leaves no room for a KV block (%zu bytes): %.2f GiB allowed, "
                          "%.2f GiB already in use by this replica (weights, buffers), %.2f GiB by others (CUDA "
                          "contexts, other processes), %.2f GiB free, %.2f GiB kept for the workspace",
                          utilization, block_bytes, plan->budget / gib, own_in_use / gib, plan->mem_others / gib,
                          mem_free / gib, reserve / gib);
    plan->num_blocks = (int)blocks;
    plan->kv_bytes = blocks * block_bytes;
    return PD_OK;
}

size_t pd_kv_cache_block_bytes(const pd_kv_cache *kv) {
    return (size_t)kv->n_layers * kv->block_size * kv->dim * sizeof(float);
}

void *pd_kv_cache_block_ptr(pd_kv_cache *kv, int block) {
    return (char *)kv->data + (size_t)block * pd_kv_cache_block_bytes(kv);
}

pd_status pd_seq_kv_reserve(pd_kv_cache *kv, pd_seq_kv *s, int n) {
    int need = (s->num_tokens + n + kv->block_size - 1) / kv->block_size;
    if (need <= s->num_blocks)
        return PD_OK;
    if (need - s->num_blocks > kv->n_free)
        return PD_ERR_LIMIT;
    if (need > s->cap_blocks) {
        int cap = s->cap_blocks ? s->cap_blocks : 8;
        while (cap < need) cap *= 2;
        int *nt = realloc(s->block_table, (size_t)cap * sizeof(int));
        if (!nt)
            return PD_ERR_NOMEM;
        s->block_table = nt;
        s->cap_blocks = cap;
    }
    while (s->num_blocks < need)
        s->block_table[s->num_blocks++] = pd_kv_cache_alloc(kv);
    return PD_OK;
}

void pd_seq_kv_release(pd_kv_cache *kv, pd_seq_kv *s) {
    for (int i = 0; i < s->num_blocks; i++)
        pd_kv_cache_release(kv, s->block_table[i]);
    s->num_blocks = 0;
    s->num_tokens = 0;
}

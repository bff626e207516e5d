/* Loading a checkpoint onto a backend, and the paged latent KV cache. */
#include "model_impl.h"

#include <math.h>
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
    pd_safetensors *st;
    const char *dir;
    pd_err *err;
} loader;

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
    pd_st_to_f32(t, buf);
    if (t->dtype == PD_DT_F8_E4M3) {
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
        if (s->ndim != 2 || s->shape[0] != sr || s->shape[1] != sc || s->dtype == PD_DT_F8_E4M3) {
            free(buf);
            return pd_err_set(ld->err, PD_ERR_SHAPE, "%s: tensor '%s' must be [%lld, %lld] F32/BF16", s->file, sn,
                              (long long)sr, (long long)sc);
        }
        float *scale = malloc((size_t)(sr * sc) * sizeof(float));
        if (!scale) {
            free(buf);
            return pd_err_set(ld->err, PD_ERR_NOMEM, "out of memory");
        }
        pd_st_to_f32(s, scale);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++)
                buf[r * cols + c] *= scale[(r / bm) * sc + c / bn];
        free(scale);
    }
    *out_p = buf;
    return PD_OK;
}

/* True when tensor `name` can go to the backend as bf16 bits without an
 * fp32 copy: a BF16 tensor of the expected shape, on a backend that loads
 * bf16 (a wrong shape or a missing tensor takes the fp32 path, which says
 * what is wrong). */
static bool bf16_direct(loader *ld, const char *name, int64_t rows, int64_t cols) {
    const pd_backend_i *ops = ld->m->be->ops;
    const pd_st_tensor *t = pd_st_find(ld->st, name);
    return ops->weight_alloc && ops->weight_set_bf16 && t && t->dtype == PD_DT_BF16 && t->ndim == 2 &&
           t->shape[0] == rows && t->shape[1] == cols;
}

static pd_status load_weight(loader *ld, const char *name, int64_t rows, int64_t cols, pd_weight *w) {
    pd_backend *be = ld->m->be;
    if (bf16_direct(ld, name, rows, cols)) {
        pd_status st = be->ops->weight_alloc(be, (int)rows, (int)cols, w);
        if (st == PD_OK)
            st = be->ops->weight_set_bf16(be, w, 0, (int)rows, pd_st_find(ld->st, name)->data);
        if (st != PD_OK)
            return pd_err_set(ld->err, st, "%s: cannot place '%s' on the %s backend", ld->dir, name, be->ops->name);
        return PD_OK;
    }
    float *h;
    pd_status st = load_f32(ld, name, rows, cols, &h);
    if (st != PD_OK)
        return st;
    st = ld->m->be->ops->weight_from_f32(ld->m->be, h, (int)rows, (int)cols, w);
    free(h);
    if (st != PD_OK)
        return pd_err_set(ld->err, st, "%s: cannot place '%s' on the %s backend", ld->dir, name, ld->m->be->ops->name);
    return PD_OK;
}

static pd_status load_vec(loader *ld, const char *name, int64_t n, float **out) {
    float *h;
    pd_status st = load_f32(ld, name, n, 0, &h);
    if (st != PD_OK)
        return st;
    pd_backend *be = ld->m->be;
    *out = be->ops->alloc(be, (size_t)n * sizeof(float));
    if (!*out) {
        free(h);
        return pd_err_set(ld->err, PD_ERR_NOMEM, "out of memory for '%s'", name);
    }
    be->ops->upload(be, *out, h, (size_t)n * sizeof(float));
    free(h);
    return PD_OK;
}

/* gate_proj and up_proj stacked into one [2I, H] weight. */
static pd_status load_mlp(loader *ld, const char *prefix, int64_t h, int64_t inter, pd_mlp_weights *mw) {
    char n1[192], n2[192], n3[192];
    snprintf(n1, sizeof n1, "%s.gate_proj.weight", prefix);
    snprintf(n2, sizeof n2, "%s.up_proj.weight", prefix);
    snprintf(n3, sizeof n3, "%s.down_proj.weight", prefix);
    pd_backend *be = ld->m->be;
    if (bf16_direct(ld, n1, inter, h) && bf16_direct(ld, n2, inter, h)) {
        pd_status st = be->ops->weight_alloc(be, (int)(2 * inter), (int)h, &mw->gate_up);
        if (st == PD_OK)
            st = be->ops->weight_set_bf16(be, &mw->gate_up, 0, (int)inter, pd_st_find(ld->st, n1)->data);
        if (st == PD_OK)
            st = be->ops->weight_set_bf16(be, &mw->gate_up, (int)inter, (int)inter, pd_st_find(ld->st, n2)->data);
        if (st != PD_OK)
            return pd_err_set(ld->err, st, "cannot place '%s' on the backend", n1);
        mw->inter = (int)inter;
        return load_weight(ld, n3, h, inter, &mw->down);
    }
    float *g, *u;
    pd_status st = load_f32(ld, n1, inter, h, &g);
    if (st != PD_OK)
        return st;
    st = load_f32(ld, n2, inter, h, &u);
    if (st != PD_OK) {
        free(g);
        return st;
    }
    float *gu = malloc((size_t)(2 * inter * h) * sizeof(float));
    if (!gu) {
        free(g);
        free(u);
        return pd_err_set(ld->err, PD_ERR_NOMEM, "out of memory");
    }
    memcpy(gu, g, (size_t)(inter * h) * sizeof(float));
    memcpy(gu + inter * h, u, (size_t)(inter * h) * sizeof(float));
    free(g);
    free(u);
    st = ld->m->be->ops->weight_from_f32(ld->m->be, gu, (int)(2 * inter), (int)h, &mw->gate_up);
    free(gu);
    if (st != PD_OK)
        return pd_err_set(ld->err, st, "cannot place '%s' on the backend", n1);
    mw->inter = (int)inter;
    return load_weight(ld, n3, h, inter, &mw->down);
}

pd_status pd_model_load(const char *dir, pd_backend *be, pd_model **m_p, pd_err *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    pd_model *m = pd_xcalloc(1, sizeof *m);
    m->be = be;
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
    loader ld = {m, NULL, dir, err};
    st = pd_st_open_dir(dir, &ld.st, err);
    if (st != PD_OK) {
        free(m);
        return st;
    }
    int64_t h = c->hidden_size, nh = c->num_attention_heads, qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
    m->layers = pd_xcalloc((size_t)c->num_hidden_layers, sizeof *m->layers);
    st = load_weight(&ld, "model.embed_tokens.weight", c->vocab_size, h, &m->embed);
    for (int i = 0; i < c->num_hidden_layers && st == PD_OK; i++) {
        pd_layer_weights *L = &m->layers[i];
        char p[160], n[256];
#define NAME(fmt) (snprintf(n, sizeof n, "%s." fmt, p), n)
        snprintf(p, sizeof p, "model.layers.%d", i);
        if (st == PD_OK) st = load_vec(&ld, NAME("input_layernorm.weight"), h, &L->input_norm);
        if (st == PD_OK) st = load_vec(&ld, NAME("post_attention_layernorm.weight"), h, &L->post_norm);
        if (c->q_lora_rank > 0) {
            if (st == PD_OK) st = load_weight(&ld, NAME("self_attn.q_a_proj.weight"), c->q_lora_rank, h, &L->q_a);
            if (st == PD_OK) st = load_vec(&ld, NAME("self_attn.q_a_layernorm.weight"), c->q_lora_rank, &L->q_a_norm);
            if (st == PD_OK) st = load_weight(&ld, NAME("self_attn.q_b_proj.weight"), nh * qk, c->q_lora_rank, &L->q_b);
        } else if (st == PD_OK) {
            st = load_weight(&ld, NAME("self_attn.q_proj.weight"), nh * qk, h, &L->q);
        }
        if (st == PD_OK)
            st = load_weight(&ld, NAME("self_attn.kv_a_proj_with_mqa.weight"), c->kv_lora_rank + c->qk_rope_head_dim, h,
                             &L->kv_a);
        if (st == PD_OK) st = load_vec(&ld, NAME("self_attn.kv_a_layernorm.weight"), c->kv_lora_rank, &L->kv_a_norm);
        if (st == PD_OK)
            st = load_weight(&ld, NAME("self_attn.kv_b_proj.weight"), nh * (c->qk_nope_head_dim + c->v_head_dim),
                             c->kv_lora_rank, &L->kv_b);
        if (st == PD_OK) st = load_weight(&ld, NAME("self_attn.o_proj.weight"), h, nh * c->v_head_dim, &L->o);
        L->is_moe = pd_config_layer_is_moe(c, i);
        if (!L->is_moe) {
            snprintf(n, sizeof n, "%s.mlp", p);
            if (st == PD_OK) st = load_mlp(&ld, n, h, c->intermediate_size, &L->mlp);
            continue;
        }
        if (st == PD_OK) st = load_weight(&ld, NAME("mlp.gate.weight"), c->n_routed_experts, h, &L->router);
        if (st == PD_OK && c->arch == PD_ARCH_DEEPSEEK_V3)
            st = load_vec(&ld, NAME("mlp.gate.e_score_correction_bias"), c->n_routed_experts, &L->router_bias);
        L->experts_gate_up = pd_xcalloc((size_t)c->n_routed_experts, sizeof(pd_weight));
        L->experts_down = pd_xcalloc((size_t)c->n_routed_experts, sizeof(pd_weight));
        for (int e = 0; e < c->n_routed_experts && st == PD_OK; e++) {
            pd_mlp_weights mw;
            char ep[200];
            snprintf(ep, sizeof ep, "%s.mlp.experts.%d", p, e);
            st = load_mlp(&ld, ep, h, c->moe_intermediate_size, &mw);
            L->experts_gate_up[e] = mw.gate_up;
            L->experts_down[e] = mw.down;
        }
        if (st == PD_OK && c->n_shared_experts > 0) {
            snprintf(n, sizeof n, "%s.mlp.shared_experts", p);
            st = load_mlp(&ld, n, h, (int64_t)c->moe_intermediate_size * c->n_shared_experts, &L->shared);
        }
#undef NAME
    }
    if (st == PD_OK) st = load_vec(&ld, "model.norm.weight", h, &m->final_norm);
    if (st == PD_OK) {
        if (c->tie_word_embeddings)
            m->lm_head = m->embed;
        else
            st = load_weight(&ld, "lm_head.weight", c->vocab_size, h, &m->lm_head);
    }
    pd_st_close(&ld.st);
    if (st != PD_OK) {
        pd_model_free(&m);
        return st;
    }
    rope_init(m);
    m->softmax_scale = pd_config_softmax_scale(c);
    size_t fb = (size_t)(c->qk_rope_head_dim / 2 > 0 ? c->qk_rope_head_dim / 2 : 1) * sizeof(float);
    m->inv_freq_b = be->ops->alloc(be, fb);
    if (!m->inv_freq_b) {
        pd_model_free(&m);
        return pd_err_set(err, PD_ERR_NOMEM, "%s: out of backend memory", dir);
    }
    be->ops->upload(be, m->inv_freq_b, m->inv_freq, (size_t)(c->qk_rope_head_dim / 2) * sizeof(float));
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

void pd_model_free(pd_model **m_p) {
    if (!m_p || !*m_p)
        return;
    pd_model *m = *m_p;
    pd_backend *be = m->be;
    pd_fwd_ws_free(m);
    if (m->inv_freq_b)
        be->ops->free(be, m->inv_freq_b);
    if (m->layers) {
        for (int i = 0; i < m->cfg.num_hidden_layers; i++) {
            pd_layer_weights *L = &m->layers[i];
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
                for (int e = 0; e < m->cfg.n_routed_experts; e++) {
                    wfree(be, &L->experts_gate_up[e]);
                    wfree(be, &L->experts_down[e]);
                }
            free(L->experts_gate_up);
            free(L->experts_down);
        }
        free(m->layers);
    }
    if (m->lm_head.data != m->embed.data)
        wfree(be, &m->lm_head);
    wfree(be, &m->embed);
    ffree(be, m->final_norm);
    free(m->inv_freq);
    free(m);
    *m_p = NULL;
}

const pd_model_config *pd_model_config_of(const pd_model *m) {
    return &m->cfg;
}

/* ---- paged latent KV cache ---- */

pd_status pd_kv_cache_init(const pd_model *m, int block_size, int num_blocks, pd_kv_cache **kv_p, pd_err *err) {
    if (block_size <= 0 || num_blocks <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "KV cache: block_size %d and num_blocks %d must be positive", block_size,
                          num_blocks);
    /* cache slots are int32 indices of token rows (forward.c) */
    if ((int64_t)num_blocks * m->cfg.num_hidden_layers * block_size > INT32_MAX)
        return pd_err_set(err, PD_ERR_LIMIT, "KV cache: %d blocks of %d tokens × %d layers is more than 2^31 rows",
                          num_blocks, block_size, m->cfg.num_hidden_layers);
    pd_kv_cache *kv = pd_xcalloc(1, sizeof *kv);
    kv->be = m->be;
    kv->block_size = block_size;
    kv->num_blocks = num_blocks;
    kv->n_layers = m->cfg.num_hidden_layers;
    kv->dim = m->cfg.kv_lora_rank + m->cfg.qk_rope_head_dim;
    size_t bytes = (size_t)num_blocks * pd_kv_cache_block_bytes(kv);
    kv->data = m->be->ops->alloc(m->be, bytes);
    if (!kv->data) {
        free(kv);
        return pd_err_set(err, PD_ERR_NOMEM, "KV cache: cannot allocate %zu bytes (%d blocks)", bytes, num_blocks);
    }
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
    kv->be->ops->free(kv->be, kv->data);
    if (kv->host_pool)
        kv->be->ops->host_free(kv->be, kv->host_pool);
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

size_t pd_kv_cache_block_bytes(const pd_kv_cache *kv) {
    return (size_t)kv->n_layers * kv->block_size * kv->dim * sizeof(float);
}

void *pd_kv_cache_block_ptr(pd_kv_cache *kv, int block) {
    return (char *)kv->data + (size_t)block * pd_kv_cache_block_bytes(kv);
}

void *pd_kv_cache_host_pool(pd_kv_cache *kv, pd_err *err) {
    pd_backend *be = kv->be;
    if (!be->ops->host_alloc)
        return kv->data; /* the cache is host memory */
    if (!kv->host_pool) {
        size_t bytes = (size_t)kv->num_blocks * pd_kv_cache_block_bytes(kv);
        kv->host_pool = be->ops->host_alloc(be, bytes);
        if (!kv->host_pool)
            pd_err_set(err, PD_ERR_NOMEM, "KV cache: cannot allocate %zu bytes of page-locked host memory", bytes);
    }
    return kv->host_pool;
}

/* Copies blocks between the cache and its host pool; direction 0: to the
 * pool (download), 1: from it (upload). */
static pd_status kv_stage(pd_kv_cache *kv, const int *blocks, int n, int dir, pd_err *err) {
    pd_backend *be = kv->be;
    if (!be->ops->host_alloc)
        return PD_OK;
    if (!kv->host_pool)
        return pd_err_set(err, PD_ERR_INVALID, "KV cache: no host pool (call pd_kv_cache_host_pool first)");
    size_t bb = pd_kv_cache_block_bytes(kv);
    for (int i = 0; i < n; i++) {
        if (blocks[i] < 0 || blocks[i] >= kv->num_blocks)
            return pd_err_set(err, PD_ERR_INVALID, "KV cache: block %d outside the cache (%d blocks)", blocks[i],
                              kv->num_blocks);
        char *h = (char *)kv->host_pool + (size_t)blocks[i] * bb, *d = (char *)kv->data + (size_t)blocks[i] * bb;
        if (dir == 0)
            be->ops->download(be, h, d, bb);
        else
            be->ops->upload(be, d, h, bb);
    }
    return PD_OK;
}

pd_status pd_kv_cache_download_blocks(pd_kv_cache *kv, const int *blocks, int n, pd_err *err) {
    return kv_stage(kv, blocks, n, 0, err);
}

pd_status pd_kv_cache_upload_blocks(pd_kv_cache *kv, const int *blocks, int n, pd_err *err) {
    return kv_stage(kv, blocks, n, 1, err);
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

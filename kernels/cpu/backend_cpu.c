/* The CPU backend: plain C, the readable reference. Dense GEMM through
 * OpenBLAS (cblas_sgemm); everything else written out as the papers state
 * it, fp32 throughout, parallel over tokens/heads with OpenMP. */
#include "pd_kernels.h"

#include <cblas.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

static void *cpu_alloc(pd_backend *be, size_t bytes) {
    return calloc(1, bytes ? bytes : 1);
}
static void cpu_free(pd_backend *be, void *p) {
    free(p);
}
static void cpu_memcpy(pd_backend *be, void *dst, const void *src, size_t bytes) {
    memcpy(dst, src, bytes);
}

static pd_status cpu_weight_from_f32(pd_backend *be, const float *host, int rows, int cols, pd_weight *w_p) {
    size_t n = (size_t)rows * (size_t)cols;
    float *d = malloc(n * sizeof(float));
    if (!d)
        return PD_ERR_NOMEM;
    memcpy(d, host, n * sizeof(float));
    w_p->rows = rows;
    w_p->cols = cols;
    w_p->data = d;
    return PD_OK;
}

static void cpu_weight_free(pd_backend *be, pd_weight *w) {
    free(w->data);
    w->data = NULL;
}

/* y[M×N] (+)= x[M×K] · W[N×K]^T */
static void cpu_gemm(pd_backend *be, int M, const float *x, const pd_weight *w, float *y, bool accumulate) {
    if (M <= 0)
        return;
    int N = w->rows, K = w->cols;
    if (M == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, N, K, 1.0f, w->data, K, x, 1, accumulate ? 1.0f : 0.0f, y, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, x, K, w->data, K,
                    accumulate ? 1.0f : 0.0f, y, N);
}

/* RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x²) + eps) * w */
static void cpu_rmsnorm(pd_backend *be, int rows, int dim, const float *x, int xs, const float *w, float eps,
                        float *y, int ys) {
#pragma omp parallel for if (rows > 16)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * xs;
        float *yr = y + (size_t)r * ys;
        double ss = 0.0;
        for (int i = 0; i < dim; i++)
            ss += (double)xr[i] * xr[i];
        float inv = (float)(1.0 / sqrt(ss / dim + eps));
        for (int i = 0; i < dim; i++)
            yr[i] = xr[i] * inv * w[i];
    }
}

/* cpu_rope's cos/sin table of a row lives on its stack: it rotates a
 * rope_dim of at most CPU_ROPE_MAX_DIM (CPU_ROPE_MAX_DIM / 2 pairs). */
#define CPU_ROPE_MAX_DIM 1024

/* False, having logged why under op's name, for a rope_dim the CPU rope
 * cannot rotate: negative, odd, or above CPU_ROPE_MAX_DIM. */
static bool cpu_rope_dim_ok(const char *op, int rope_dim) {
    if (rope_dim >= 0 && rope_dim % 2 == 0 && rope_dim <= CPU_ROPE_MAX_DIM)
        return true;
    PD_LOGE("kernels", "%s: rope_dim %d: the CPU backend rotates an even rope_dim of at most %d", op, rope_dim,
            CPU_ROPE_MAX_DIM);
    return false;
}

/* RoPE (Su et al. 2021) on interleaved pairs, as the DeepSeek checkpoints
 * lay them out (transformers apply_rotary_pos_emb_interleave): rope and
 * rope_pos (host memory is backend memory here), op naming which in the
 * log. rows or n_heads 0, or rope_dim 0: nothing, whatever else. Arguments
 * it cannot take (rows or n_heads < 0, a rope_dim cpu_rope_dim_ok refuses,
 * x, pos or inv_freq NULL) are logged and nothing is written: the CPU
 * backend has no status to keep an error in (as moe_route). */
static void cpu_rope_run(const char *op, int rows, int n_heads, float *x, int row_stride, int head_stride,
                         int rope_dim, const int *pos, const float *inv_freq, float mscale) {
    if (rows == 0 || n_heads == 0)
        return;
    if (rows < 0 || n_heads < 0) {
        PD_LOGE("kernels", "%s: rows %d, heads %d", op, rows, n_heads);
        return;
    }
    if (!cpu_rope_dim_ok(op, rope_dim) || rope_dim == 0)
        return;
    if (!x || !pos || !inv_freq) {
        PD_LOGE("kernels", "%s: no %s", op, !x ? "x" : !pos ? "pos" : "inv_freq");
        return;
    }
    int half = rope_dim / 2;
#pragma omp parallel for if (rows > 16)
    for (int r = 0; r < rows; r++) {
        float cs[CPU_ROPE_MAX_DIM / 2], sn[CPU_ROPE_MAX_DIM / 2];
        for (int i = 0; i < half; i++) {
            float ang = (float)pos[r] * inv_freq[i]; /* fp32 product, as the reference */
            cs[i] = cosf(ang) * mscale;
            sn[i] = sinf(ang) * mscale;
        }
        for (int h = 0; h < n_heads; h++) {
            float *v = x + (size_t)r * row_stride + (size_t)h * head_stride;
            for (int i = 0; i < half; i++) {
                float a = v[2 * i], b = v[2 * i + 1];
                v[2 * i] = a * cs[i] - b * sn[i];
                v[2 * i + 1] = b * cs[i] + a * sn[i];
            }
        }
    }
}

static void cpu_rope(pd_backend *be, int rows, int n_heads, float *x, int row_stride, int head_stride,
                     int rope_dim, const int *pos, const float *inv_freq, float mscale) {
    cpu_rope_run("rope", rows, n_heads, x, row_stride, head_stride, rope_dim, pos, inv_freq, mscale);
}

static void cpu_silu_mul(pd_backend *be, int rows, int inter, const float *gu, float *out) {
#pragma omp parallel for if (rows > 16)
    for (int r = 0; r < rows; r++) {
        const float *g = gu + (size_t)r * 2 * inter, *u = g + inter;
        float *o = out + (size_t)r * inter;
        for (int i = 0; i < inter; i++)
            o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static void cpu_add(pd_backend *be, size_t n, float *x, const float *y) {
    for (size_t i = 0; i < n; i++)
        x[i] += y[i];
}

static void cpu_embed(pd_backend *be, int rows, int dim, const int32_t *ids, const pd_weight *table, float *out) {
    for (int r = 0; r < rows; r++)
        memcpy(out + (size_t)r * dim, (const float *)table->data + (size_t)ids[r] * dim, dim * sizeof(float));
}

static const float *cache_row(const pd_mla_args *a, int t) {
    int D = a->kv_lora_rank + a->qk_rope_dim;
    int blk = a->block_table[t / a->block_size];
    return a->cache + (((size_t)blk * a->n_layers + a->layer) * a->block_size + t % a->block_size) * D;
}

/* MLA attention, DeepSeek-V2 paper §2.1.2–2.1.3.
 * Expanded form (prefill): k_nope, v = W_kv_b · c_KV for every cached token,
 * score = q_nope·k_nope + q_pe·k_pe.
 * Absorbed form (decode): q_lat = W_UKᵀ q_nope, score = q_lat·c_KV + q_pe·k_pe,
 * o_lat = Σ p c_KV, o = W_UV o_lat. Both give the same numbers up to rounding. */
static void cpu_mla_attention(pd_backend *be, const pd_mla_args *a) {
    int nh = a->n_heads, dn = a->qk_nope_dim, dr = a->qk_rope_dim, dv = a->v_dim, kvr = a->kv_lora_rank;
    int qd = dn + dr;
    int L = a->start_pos + a->n_q; /* tokens visible to the last query */
    const float *wkvb = a->kv_b->data; /* [nh*(dn+dv), kvr] */
    if (!a->absorbed) {
        /* k_nope and v for every cached token: [L, nh, dn+dv] */
        float *lat = malloc((size_t)L * kvr * sizeof(float));
        float *kv = malloc((size_t)L * nh * (dn + dv) * sizeof(float));
        for (int t = 0; t < L; t++)
            memcpy(lat + (size_t)t * kvr, cache_row(a, t), kvr * sizeof(float));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, L, nh * (dn + dv), kvr, 1.0f, lat, kvr, wkvb, kvr, 0.0f,
                    kv, nh * (dn + dv));
#pragma omp parallel for collapse(2)
        for (int i = 0; i < a->n_q; i++)
            for (int h = 0; h < nh; h++) {
                int n_vis = a->start_pos + i + 1;
                const float *q = a->q + ((size_t)i * nh + h) * qd;
                float *sc = malloc((size_t)n_vis * sizeof(float));
                float mx = -INFINITY;
                for (int t = 0; t < n_vis; t++) {
                    const float *k = kv + ((size_t)t * nh + h) * (dn + dv);
                    const float *kpe = cache_row(a, t) + kvr;
                    float s = 0.0f;
                    for (int d = 0; d < dn; d++) s += q[d] * k[d];
                    for (int d = 0; d < dr; d++) s += q[dn + d] * kpe[d];
                    s *= a->softmax_scale;
                    sc[t] = s;
                    if (s > mx) mx = s;
                }
                float sum = 0.0f;
                for (int t = 0; t < n_vis; t++) {
                    sc[t] = expf(sc[t] - mx);
                    sum += sc[t];
                }
                float *o = a->out + ((size_t)i * nh + h) * dv;
                for (int d = 0; d < dv; d++) o[d] = 0.0f;
                for (int t = 0; t < n_vis; t++) {
                    const float *v = kv + ((size_t)t * nh + h) * (dn + dv) + dn;
                    float p = sc[t] / sum;
                    for (int d = 0; d < dv; d++) o[d] += p * v[d];
                }
                free(sc);
            }
        free(kv);
        free(lat);
        return;
    }
#pragma omp parallel for collapse(2)
    for (int i = 0; i < a->n_q; i++)
        for (int h = 0; h < nh; h++) {
            int n_vis = a->start_pos + i + 1;
            const float *q = a->q + ((size_t)i * nh + h) * qd;
            const float *wuk = wkvb + (size_t)h * (dn + dv) * kvr; /* [dn, kvr] */
            const float *wuv = wuk + (size_t)dn * kvr;              /* [dv, kvr] */
            float *qlat = malloc((size_t)kvr * sizeof(float));
            float *olat = calloc((size_t)kvr, sizeof(float));
            float *sc = malloc((size_t)n_vis * sizeof(float));
            for (int c = 0; c < kvr; c++) qlat[c] = 0.0f;
            for (int d = 0; d < dn; d++)
                for (int c = 0; c < kvr; c++) qlat[c] += q[d] * wuk[(size_t)d * kvr + c];
            float mx = -INFINITY;
            for (int t = 0; t < n_vis; t++) {
                const float *row = cache_row(a, t);
                float s = 0.0f;
                for (int c = 0; c < kvr; c++) s += qlat[c] * row[c];
                for (int d = 0; d < dr; d++) s += q[dn + d] * row[kvr + d];
                s *= a->softmax_scale;
                sc[t] = s;
                if (s > mx) mx = s;
            }
            float sum = 0.0f;
            for (int t = 0; t < n_vis; t++) {
                sc[t] = expf(sc[t] - mx);
                sum += sc[t];
            }
            for (int t = 0; t < n_vis; t++) {
                const float *row = cache_row(a, t);
                float p = sc[t] / sum;
                for (int c = 0; c < kvr; c++) olat[c] += p * row[c];
            }
            float *o = a->out + ((size_t)i * nh + h) * dv;
            for (int d = 0; d < dv; d++) {
                float s = 0.0f;
                for (int c = 0; c < kvr; c++) s += wuv[(size_t)d * kvr + c] * olat[c];
                o[d] = s;
            }
            free(sc);
            free(olat);
            free(qlat);
        }
}

/* Top-k indices of v[n] (largest first; ties to the lower index). */
static void topk_idx(const float *v, int n, int k, int *out) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            bool taken = false;
            for (int m = 0; m < j; m++)
                if (out[m] == i) { taken = true; break; }
            if (taken) continue;
            if (best < 0 || v[i] > v[best]) best = i;
        }
        out[j] = best;
    }
}

/* A row's scores live on cpu_route's stack, which bounds what it routes. */
#define CPU_ROUTE_MAX_EXPERTS 1024
#define CPU_ROUTE_MAX_GROUPS 256
#define CPU_ROUTE_MAX_TOP_K 256
static const pd_moe_route_limits cpu_route_max = {
    .max_experts = CPU_ROUTE_MAX_EXPERTS, .max_groups = CPU_ROUTE_MAX_GROUPS, .max_top_k = CPU_ROUTE_MAX_TOP_K};

/* DeepSeekMoE routing. V3 (noaux_tc, DeepSeek-V3 §2.1.2): s = sigmoid(logit);
 * choice = s + bias; group score = sum of the top-2 choices in each group;
 * keep topk_group groups (others -inf); top_k experts by choice; weights =
 * unbiased s, normalised if norm_topk_prob, × routed_scaling_factor.
 * V2 (DeepSeek-V2 §2.2): s = softmax(logit); greedy top-k, or
 * group-limited: group score = max s in the group; weights = s (× scale,
 * normalised when norm_topk_prob).
 * moe_route and moe_route_ids (host memory is backend memory here), op
 * naming which in the log. Arguments pd_moe_route_check refuses, with
 * cpu_route_max, are logged and nothing is written: the CPU backend has no
 * status to keep an error in (as sample_rows). */
static void cpu_route(const char *op, int rows, const float *logits, const pd_moe_route_params *p, int32_t *ids,
                      float *weights) {
    pd_err err = {{0}};
    if (pd_moe_route_check(op, rows, logits, p, ids, weights, &cpu_route_max, &err) != PD_OK) {
        PD_LOGE("kernels", "%s", err.msg);
        return;
    }
    if (rows == 0) /* nothing to route, whatever else */
        return;
    int E = p->n_experts, G = p->n_group > 0 ? p->n_group : 1, per = E / G;
    for (int r = 0; r < rows; r++) {
        const float *lg = logits + (size_t)r * E;
        float s[CPU_ROUTE_MAX_EXPERTS], choice[CPU_ROUTE_MAX_EXPERTS], gs[CPU_ROUTE_MAX_GROUPS];
        int gsel[CPU_ROUTE_MAX_GROUPS], esel[CPU_ROUTE_MAX_TOP_K];
        if (p->scoring == 1) {
            for (int e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-lg[e]));
        } else {
            float mx = -INFINITY, sum = 0.0f;
            for (int e = 0; e < E; e++) mx = fmaxf(mx, lg[e]);
            for (int e = 0; e < E; e++) sum += (s[e] = expf(lg[e] - mx));
            for (int e = 0; e < E; e++) s[e] /= sum;
        }
        for (int e = 0; e < E; e++)
            choice[e] = s[e] + ((p->topk_method == 2 && p->e_score_correction_bias) ? p->e_score_correction_bias[e] : 0.0f);
        if (p->topk_method != 0 && G > 1) {
            for (int g = 0; g < G; g++) {
                const float *c = choice + g * per;
                if (p->topk_method == 2) {
                    int t2[2];
                    topk_idx(c, per, per >= 2 ? 2 : 1, t2);
                    gs[g] = c[t2[0]] + (per >= 2 ? c[t2[1]] : 0.0f);
                } else {
                    float m = -INFINITY;
                    for (int e = 0; e < per; e++) m = fmaxf(m, c[e]);
                    gs[g] = m;
                }
            }
            topk_idx(gs, G, p->topk_group, gsel);
            for (int g = 0; g < G; g++) {
                bool keep = false;
                for (int j = 0; j < p->topk_group; j++)
                    if (gsel[j] == g) keep = true;
                if (!keep)
                    for (int e = 0; e < per; e++) choice[g * per + e] = -INFINITY;
            }
        }
        topk_idx(choice, E, p->top_k, esel);
        float sum = 0.0f;
        for (int j = 0; j < p->top_k; j++) sum += s[esel[j]];
        for (int j = 0; j < p->top_k; j++) {
            float w = s[esel[j]];
            if (p->norm_topk_prob) w /= (sum + 1e-20f);
            ids[(size_t)r * p->top_k + j] = esel[j];
            weights[(size_t)r * p->top_k + j] = w * p->routed_scaling_factor;
        }
    }
}

static void cpu_moe_route(pd_backend *be, int rows, const float *logits, const pd_moe_route_params *p, int32_t *ids,
                          float *weights) {
    cpu_route("moe_route", rows, logits, p, ids, weights);
}

static void cpu_moe_experts(pd_backend *be, int rows, int hidden, int inter, const float *x, const int32_t *ids,
                            const float *weights, int top_k, const pd_weight *gate_up, const pd_weight *down,
                            float *out) {
    /* Group tokens by expert, then two GEMMs per expert; a negative id (a
     * dropped pair, expert parallelism) matches no expert. */
    int n = rows * top_k;
    int max_e = 0;
    for (int i = 0; i < n; i++)
        if (ids[i] > max_e) max_e = ids[i];
    /* the buffers hold one expert's pairs: as many as the busiest expert has
     * (routing picks distinct experts per token, so at most rows, but a
     * caller's ids are not trusted to) */
    int *cnt = pd_xcalloc((size_t)max_e + 1, sizeof(int));
    int m_max = 0;
    for (int i = 0; i < n; i++)
        if (ids[i] >= 0 && ++cnt[ids[i]] > m_max) m_max = cnt[ids[i]];
    free(cnt);
    int *order = pd_xmalloc((size_t)n * sizeof(int));
    float *xin = pd_xmalloc((size_t)m_max * hidden * sizeof(float) + 1);
    float *gu = pd_xmalloc((size_t)m_max * 2 * inter * sizeof(float) + 1);
    float *act = pd_xmalloc((size_t)m_max * inter * sizeof(float) + 1);
    float *y = pd_xmalloc((size_t)m_max * hidden * sizeof(float) + 1);
    for (int e = 0; e <= max_e; e++) {
        int m = 0;
        for (int i = 0; i < n; i++)
            if (ids[i] == e) order[m++] = i;
        if (!m) continue;
        for (int j = 0; j < m; j++)
            memcpy(xin + (size_t)j * hidden, x + (size_t)(order[j] / top_k) * hidden, hidden * sizeof(float));
        cpu_gemm(be, m, xin, &gate_up[e], gu, false);
        cpu_silu_mul(be, m, inter, gu, act);
        cpu_gemm(be, m, act, &down[e], y, false);
        for (int j = 0; j < m; j++) {
            float w = weights[order[j]];
            float *o = out + (size_t)(order[j] / top_k) * hidden;
            const float *yr = y + (size_t)j * hidden;
            for (int d = 0; d < hidden; d++) o[d] += w * yr[d];
        }
    }
    free(y);
    free(act);
    free(gu);
    free(xin);
    free(order);
}

/* ---- step operations: on the CPU backend memory is host memory, so these
 * are the operations above with their arrays read in place ---- */

static void cpu_embed_ids(pd_backend *be, int rows, int dim, const int32_t *ids, const pd_weight *table, float *out) {
    cpu_embed(be, rows, dim, ids, table, out);
}

static void cpu_rope_pos(pd_backend *be, int rows, int n_heads, float *x, int row_stride, int head_stride,
                         int rope_dim, const int32_t *pos, const float *inv_freq, float mscale) {
    cpu_rope_run("rope_pos", rows, n_heads, x, row_stride, head_stride, rope_dim, pos, inv_freq, mscale);
}

static void cpu_kv_store(pd_backend *be, int rows, int dim, const float *src, int src_stride, float *cache,
                         const int32_t *slots, size_t slot_offset) {
    for (int r = 0; r < rows; r++)
        memcpy(cache + ((size_t)slots[r] + slot_offset) * dim, src + (size_t)r * src_stride, dim * sizeof(float));
}

/* The fused step ops, as the operations they stand for (pd_kernels.h).
 * mla_prep checks qk_rope_dim before its rmsnorm writes c_KV: one that
 * rope_pos would refuse is logged and nothing is written; false then. */
static bool cpu_mla_prep_run(pd_backend *be, const pd_mla_prep_args *a) {
    if (a->rows > 0 && !cpu_rope_dim_ok("mla_prep", a->qk_rope_dim))
        return false;
    const int kvr = a->kv_lora_rank, dr = a->qk_rope_dim, D = kvr + dr, qd = a->qk_nope_dim + dr;
    cpu_rmsnorm(be, a->rows, kvr, a->ckv, D, a->kv_norm, a->eps, a->ckv, D);
    cpu_rope_pos(be, a->rows, 1, a->ckv + kvr, D, D, dr, a->pos, a->inv_freq, a->mscale);
    cpu_rope_pos(be, a->rows, a->n_heads, a->q + a->qk_nope_dim, a->n_heads * qd, qd, dr, a->pos, a->inv_freq,
                 a->mscale);
    cpu_kv_store(be, a->rows, D, a->ckv, D, a->cache, a->slots, a->slot_offset);
    return true;
}

static void cpu_mla_prep(pd_backend *be, const pd_mla_prep_args *a) {
    cpu_mla_prep_run(be, a);
}

static void cpu_gemm_swiglu(pd_backend *be, int M, const float *x, const pd_weight *w, float *gu, float *act) {
    cpu_gemm(be, M, x, w, gu, false);
    cpu_silu_mul(be, M, w->rows / 2, gu, act);
}

static void cpu_add_rmsnorm(pd_backend *be, int rows, int dim, float *x, const float *y, const float *w, float eps,
                            float *h) {
    cpu_add(be, (size_t)rows * dim, x, y);
    cpu_rmsnorm(be, rows, dim, x, dim, w, eps, h, dim);
}

/* The composed block (pd_moe_block_composed). The CPU backend has no status
 * to keep an error in, so arguments it refuses, and routing beyond
 * cpu_route's limits (checked first: the block writes h and logits before
 * it routes), are logged and nothing is written (as sample_rows). */
static bool cpu_moe_block(pd_backend *be, const pd_moe_block_args *a) {
    pd_err err = {{0}};
    pd_status st = PD_OK;
    if (a)
        st = pd_moe_route_check("moe_block", a->rows, a->logits, &a->route, a->ids, a->weights, &cpu_route_max, &err);
    if (st == PD_OK)
        st = pd_moe_block_composed(be, a, &err);
    if (st != PD_OK)
        PD_LOGE("kernels", "%s", err.msg);
    return true;
}

static void cpu_rmsnorm_gemm_pair(pd_backend *be, int rows, int dim, const float *x, const float *norm, float eps,
                                  float *h, const pd_weight *w1, float *y1, const pd_weight *w2, float *y2) {
    cpu_rmsnorm(be, rows, dim, x, dim, norm, eps, h, dim);
    cpu_gemm(be, rows, h, w1, y1, false);
    cpu_gemm(be, rows, h, w2, y2, false);
}

/* One absorbed single-query attention per sequence; nothing written when
 * its prologue (prep) refuses its qk_rope_dim. */
static void cpu_mla_decode(pd_backend *be, const pd_mla_decode_args *d) {
    int qd = d->qk_nope_dim + d->qk_rope_dim;
    if (d->prep && !cpu_mla_prep_run(be, d->prep))
        return;
    for (int i = 0; i < d->n_seqs; i++) {
        pd_mla_args a = {
            .n_heads = d->n_heads, .qk_nope_dim = d->qk_nope_dim, .qk_rope_dim = d->qk_rope_dim,
            .v_dim = d->v_dim, .kv_lora_rank = d->kv_lora_rank, .softmax_scale = d->softmax_scale, .n_q = 1,
            .start_pos = d->seq_lens[i] - 1, .q = d->q + (size_t)i * d->n_heads * qd, .cache = d->cache,
            .n_layers = d->n_layers, .layer = d->layer, .block_size = d->block_size,
            .block_table = d->blocks + d->block_off[i], .kv_b = d->kv_b, .absorbed = true,
            .out = d->out + (size_t)i * d->n_heads * d->v_dim,
        };
        cpu_mla_attention(be, &a);
    }
}

static void cpu_moe_route_ids(pd_backend *be, int rows, const float *logits, const pd_moe_route_params *p,
                              int32_t *ids, float *weights) {
    cpu_route("moe_route_ids", rows, logits, p, ids, weights);
}

static void cpu_moe_experts_ids(pd_backend *be, int rows, int hidden, int inter, const float *x, const int32_t *ids,
                                const float *weights, int top_k, int n_experts, const pd_weight *gate_up,
                                const pd_weight *down, float *out) {
    cpu_moe_experts(be, rows, hidden, inter, x, ids, weights, top_k, gate_up, down, out); /* skips -1 */
}

static void cpu_moe_ids_local(pd_backend *be, size_t n, int32_t *ids, int first, int count) {
    (void)be;
    for (size_t i = 0; i < n; i++)
        ids[i] = ids[i] >= first && ids[i] - first < count ? ids[i] - first : -1;
}

/* ---- sampling (sample_rows) ---- */

/* Highest of v[0, n), ties to the lowest id; NaN never wins; every value
 * -inf: 0. */
static int32_t sample_argmax(const float *v, int n) {
    int32_t best = 0;
    float best_v = -INFINITY;
    for (int i = 0; i < n; i++)
        if (v[i] > best_v) {
            best_v = v[i];
            best = i;
        }
    return best;
}

/* A token and the value it is ranked by (sample_rows steps 6 and 7). */
typedef struct {
    float key;
    int32_t id;
} sample_rank;

/* qsort order: larger key first, then lower id (a strict total order). */
static int sample_rank_cmp(const void *a, const void *b) {
    const sample_rank *x = a, *y = b;
    if (x->key != y->key)
        return x->key > y->key ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* sample_rows' arguments as pd_kernels.h states their ranges. The row index
 * is only checked for sign: the buffer's row count is not passed. */
static bool sample_args_ok(int n, int vocab, const pd_sample_row *rows, const pd_sample_tok *toks,
                           int n_toks, const pd_sample_out *out) {
    if (n < 0 || vocab <= 0 || n_toks < 0 || (n > 0 && (!rows || !out)) || (n_toks > 0 && !toks)) {
        PD_LOGE("kernels", "sample_rows: %d rows, vocab %d, %d tokens", n, vocab, n_toks);
        return false;
    }
    for (int i = 0; i < n; i++) {
        const pd_sample_row *r = &rows[i];
        if (r->row < 0 || r->n_top < 0 || r->n_top > PD_SAMPLE_MAX_TOP || r->tok_off < 0 ||
            r->n_tok < 0 || r->tok_off > n_toks - r->n_tok) {
            PD_LOGE(
                "kernels",
                "sample_rows: row %d: logits row %d, n_top %d (0 .. %d), tokens [%d, +%d) of %d", i,
                r->row, r->n_top, PD_SAMPLE_MAX_TOP, r->tok_off, r->n_tok, n_toks);
            return false;
        }
        for (int j = r->tok_off; j < r->tok_off + r->n_tok; j++)
            if (toks[j].id < 0 || toks[j].id >= vocab) {
                PD_LOGE("kernels", "sample_rows: row %d: token %d outside the vocabulary [0, %d)",
                        i, toks[j].id, vocab);
                return false;
            }
    }
    return true;
}

/* One row of sample_rows, the numbered steps of pd_kernels.h. l [vocab] is
 * the row (modified in place: masks, bias, penalties); scratch: scaled and
 * w [vocab], rank [vocab], keep [vocab], masked [vocab] (when a logprob is
 * wanted). */
static void sample_row(int vocab, float *l, const pd_sample_row *r, const pd_sample_tok *tok,
                       pd_sample_out *out, float *scaled, float *w, sample_rank *rank, bool *keep,
                       float *masked) {
    memset(out, 0, sizeof *out);

    /* 1. masks */
    for (int j = 0; j < r->n_tok; j++)
        if (tok[j].flags & PD_SAMPLE_MASKED)
            l[tok[j].id] = -INFINITY;

    /* 2. log softmax of l as it stands: max, then the log of a double sum
     * (model/sampler.c sampler_log_norm); logprob = l - max - lse */
    float lmax = -INFINITY;
    double lse = 0.0;
    int k_top = r->n_top < vocab ? r->n_top : vocab;
    if (k_top > 0 || r->want_logprob) {
        for (int i = 0; i < vocab; i++)
            if (l[i] > lmax)
                lmax = l[i];
        if (lmax != -INFINITY) {
            double sum = 0.0;
            for (int i = 0; i < vocab; i++)
                sum += exp((double)l[i] - lmax);
            lse = log(sum);
        }
    }
    if (k_top > 0) {
        /* the k_top best by (logit descending, lower id first): an insertion
         * into the list of the best so far, tokens visited in id order */
        int n_list = 0;
        for (int i = 0; i < vocab; i++) {
            if (n_list == k_top && !(l[i] > l[out->top_ids[n_list - 1]]))
                continue;
            int j = n_list < k_top ? n_list++ : k_top - 1;
            for (; j > 0 && l[i] > l[out->top_ids[j - 1]]; j--)
                out->top_ids[j] = out->top_ids[j - 1];
            out->top_ids[j] = i;
        }
        for (int j = 0; j < k_top; j++)
            out->top_logprobs[j] =
                lmax == -INFINITY ? -INFINITY : (float)((double)l[out->top_ids[j]] - lmax - lse);
        out->n_top = k_top;
    }
    if (r->want_logprob)
        memcpy(masked, l, (size_t)vocab * sizeof *l);

    /* 3. logit_bias; 4. penalties (repetition on seen tokens, then frequency
     * and presence on those in the output) */
    for (int j = 0; j < r->n_tok; j++)
        l[tok[j].id] += tok[j].bias;
    for (int j = 0; j < r->n_tok; j++) {
        float v = l[tok[j].id];
        if (tok[j].flags & PD_SAMPLE_SEEN)
            v = v > 0.0f ? v / r->repetition_penalty : v * r->repetition_penalty;
        if (tok[j].count > 0) {
            v -= r->frequency_penalty * (float)tok[j].count;
            v -= r->presence_penalty;
        }
        l[tok[j].id] = v;
    }
    /* 4b. ids past n_vocab (no text) are never drawn */
    for (int i = r->n_vocab > 0 && r->n_vocab < vocab ? r->n_vocab : vocab; i < vocab; i++)
        l[i] = -INFINITY;

    int32_t token;
    if (r->temperature < 1e-5f) {
        /* 5. greedy */
        token = sample_argmax(l, vocab);
    } else {
        /* 5. temperature, into scratch: the row stays biased and penalised */
        float max = -INFINITY;
        for (int i = 0; i < vocab; i++) {
            float v = l[i] / r->temperature;
            scaled[i] = isnan(v) ? -INFINITY : v;
            if (scaled[i] > max)
                max = scaled[i];
        }
        token = sample_argmax(scaled, vocab);
        if (isfinite(max)) {
            /* 6. top-k by (scaled descending, lower id first) */
            int n_cand = vocab;
            for (int i = 0; i < vocab; i++)
                rank[i] = (sample_rank){.key = scaled[i], .id = i};
            if (r->top_k > 0 && r->top_k < vocab) {
                qsort(rank, (size_t)vocab, sizeof *rank, sample_rank_cmp);
                n_cand = r->top_k;
            }
            for (int i = 0; i < vocab; i++) {
                keep[i] = false;
                w[i] = 0.0f;
            }
            for (int c = 0; c < n_cand; c++) {
                keep[rank[c].id] = true;
                w[rank[c].id] = expf(scaled[rank[c].id] - max);
            }
            /* 7. top-p: the fewest by (weight descending, lower id first)
             * whose double sum reaches top_p of the candidates' */
            if (r->top_p < 1.0f) {
                double total = 0.0;
                int m = 0;
                for (int i = 0; i < vocab; i++)
                    if (keep[i]) {
                        total += w[i];
                        rank[m++] = (sample_rank){.key = w[i], .id = i};
                    }
                qsort(rank, (size_t)m, sizeof *rank, sample_rank_cmp);
                double need = (double)r->top_p * total, cum = 0.0;
                int c = 0;
                while (c < m && cum < need)
                    cum += rank[c++].key;
                /* the rest are dropped (none when rounding leaves need out of reach) */
                for (; c < m; c++)
                    keep[rank[c].id] = false;
            }
            /* 8. min-p: w >= min_p (the best token has w = 1) */
            if (r->min_p > 0.0f)
                for (int i = 0; i < vocab; i++)
                    if (keep[i] && !(w[i] >= r->min_p))
                        keep[i] = false;
            /* 9. the draw: inverse CDF over the survivors with w > 0, in id order */
            double total = 0.0;
            for (int i = 0; i < vocab; i++)
                if (keep[i] && w[i] > 0.0f)
                    total += w[i];
            double target = r->u * total, cum = 0.0;
            int32_t last = -1;
            for (int i = 0; i < vocab; i++) {
                if (!keep[i] || !(w[i] > 0.0f))
                    continue;
                last = i;
                cum += w[i];
                if (cum > target)
                    break;
            }
            if (last >= 0) /* the first past the target, else (rounding) the last survivor */
                token = last;
        }
    }
    out->token = token;
    if (r->want_logprob)
        out->logprob = lmax == -INFINITY ? -INFINITY : (float)((double)masked[token] - lmax - lse);
}

/* Sampling where the logits are (pd_kernels.h sample_rows, whose numbered
 * steps the code follows): vLLM's sampler order and meanings
 * (vllm/model_executor/layers/sampler.py: logit_bias, penalties,
 * temperature, top-k, top-p, min-p, one draw), as model/sampler.c, with the
 * final draw over the survivors in id order. The reference for the other
 * backends, so written for reading, not speed: the filters sort the row
 * (qsort, O(vocab log vocab) per row). Every argument is checked before any
 * row is touched; the CPU backend has no status to keep an error in, so a
 * bad argument is logged, the logits are left as they are and every out[i]
 * gets token -1, logprob NaN and no top logprobs. */
static void cpu_sample_rows(pd_backend *be, int n, int vocab, float *logits,
                            const pd_sample_row *rows, const pd_sample_tok *toks, int n_toks,
                            pd_sample_out *out) {
    (void)be;
    if (!sample_args_ok(n, vocab, rows, toks, n_toks, out)) {
        for (int i = 0; out && i < n; i++)
            out[i] = (pd_sample_out){.token = -1, .logprob = NAN, .n_top = 0};
        return;
    }
    if (n == 0)
        return;
    float *scaled = pd_xmalloc((size_t)vocab * sizeof *scaled);
    float *w = pd_xmalloc((size_t)vocab * sizeof *w);
    float *masked = pd_xmalloc((size_t)vocab * sizeof *masked);
    sample_rank *rank = pd_xmalloc((size_t)vocab * sizeof *rank);
    bool *keep = pd_xmalloc((size_t)vocab * sizeof *keep);
    for (int i = 0; i < n; i++)
        sample_row(vocab, logits + (size_t)rows[i].row * vocab, &rows[i], toks + rows[i].tok_off,
                   &out[i], scaled, w, rank, keep, masked);
    free(keep);
    free(rank);
    free(masked);
    free(w);
    free(scaled);
}

/* ---- tensor parallelism: the ranks of a group are threads of this
 * process, so the communicator is a barrier and a table of the buffers the
 * ranks are reducing ---- */

typedef struct {
    int n_ranks, refs; /* refs: backends of the group not yet destroyed */
    pthread_mutex_t mu;
    pthread_barrier_t bar;
    float *bufs[PD_TP_MAX_RANKS];
    size_t n[PD_TP_MAX_RANKS];
} cpu_comm;

/* Every rank posts its buffer; once all have (barrier), rank r sums slice r
 * of the elements over the ranks, in rank order, and writes the sum into
 * every rank's buffer, so all ranks end with the same bits; the second
 * barrier holds each rank until every slice is written. */
static void cpu_all_reduce_sum(pd_backend *be, float *x, size_t n) {
    cpu_comm *g = be->ctx;
    if (!g || g->n_ranks == 1)
        return;
    int r = be->rank, N = g->n_ranks;
    g->bufs[r] = x;
    g->n[r] = n;
    pthread_barrier_wait(&g->bar);
    for (int j = 0; j < N; j++)
        PD_ASSERT(g->n[j] == n); /* every rank runs the same step */
    size_t lo = n * r / N, hi = n * (r + 1) / N;
    for (size_t i = lo; i < hi; i++) {
        float s = g->bufs[0][i];
        for (int j = 1; j < N; j++)
            s += g->bufs[j][i];
        for (int j = 0; j < N; j++)
            g->bufs[j][i] = s;
    }
    pthread_barrier_wait(&g->bar);
}

static void cpu_destroy(pd_backend *be) {
    cpu_comm *g = be->ctx;
    if (g) {
        pthread_mutex_lock(&g->mu);
        bool last = --g->refs == 0;
        pthread_mutex_unlock(&g->mu);
        if (last) {
            pthread_barrier_destroy(&g->bar);
            pthread_mutex_destroy(&g->mu);
            free(g);
        }
    }
    free(be);
}

static const pd_backend_i cpu_ops = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_memcpy,
    .download = cpu_memcpy,
    .copy = cpu_memcpy,
    .weight_from_f32 = cpu_weight_from_f32,
    .weight_free = cpu_weight_free,
    .gemm = cpu_gemm,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .silu_mul = cpu_silu_mul,
    .add = cpu_add,
    .embed = cpu_embed,
    .mla_attention = cpu_mla_attention,
    .moe_route = cpu_moe_route,
    .moe_experts = cpu_moe_experts,
    .destroy = cpu_destroy,
    .embed_ids = cpu_embed_ids,
    .rope_pos = cpu_rope_pos,
    .kv_store = cpu_kv_store,
    .mla_decode = cpu_mla_decode,
    .moe_route_ids = cpu_moe_route_ids,
    .moe_experts_ids = cpu_moe_experts_ids,
    .moe_ids_local = cpu_moe_ids_local,
    .mla_prep = cpu_mla_prep,
    .gemm_swiglu = cpu_gemm_swiglu,
    .add_rmsnorm = cpu_add_rmsnorm,
    .moe_block = cpu_moe_block,
    .rmsnorm_gemm_pair = cpu_rmsnorm_gemm_pair,
    .all_reduce_sum = cpu_all_reduce_sum,
    .sample_rows = cpu_sample_rows,
};

pd_status pd_backend_cpu_init(int n_threads, pd_backend **be_p) {
    pd_backend *be = calloc(1, sizeof *be);
    if (!be)
        return PD_ERR_NOMEM;
    be->ops = &cpu_ops;
    be->n_threads = n_threads;
    be->n_ranks = 1;
    if (n_threads > 0)
        openblas_set_num_threads(n_threads);
    *be_p = be;
    return PD_OK;
}

pd_status pd_backend_cpu_init_tp(int n_ranks, int n_threads, pd_backend **bes_p, pd_err *err) {
    if (n_ranks < 1 || n_ranks > PD_TP_MAX_RANKS)
        return pd_err_set(err, PD_ERR_INVALID, "tensor parallel size %d: expected 1 to %d", n_ranks,
                          PD_TP_MAX_RANKS);
    if (n_ranks == 1)
        return pd_backend_cpu_init(n_threads, &bes_p[0]);
    cpu_comm *g = calloc(1, sizeof *g);
    if (!g)
        return pd_err_set(err, PD_ERR_NOMEM, "out of memory for a CPU group of %d ranks", n_ranks);
    g->n_ranks = n_ranks;
    pthread_mutex_init(&g->mu, NULL);
    pthread_barrier_init(&g->bar, NULL, (unsigned)n_ranks);
    for (int r = 0; r < n_ranks; r++) {
        pd_backend *be = NULL;
        if (pd_backend_cpu_init(n_threads, &be) != PD_OK) {
            for (int q = 0; q < r; q++)
                pd_backend_free(&bes_p[q]); /* the last one frees g */
            if (r == 0) {
                pthread_barrier_destroy(&g->bar);
                pthread_mutex_destroy(&g->mu);
                free(g);
            }
            return pd_err_set(err, PD_ERR_NOMEM, "out of memory for CPU rank %d", r);
        }
        be->ctx = g;
        be->rank = r;
        be->n_ranks = n_ranks;
        g->refs++;
        bes_p[r] = be;
    }
    return PD_OK;
}

/* The DeepSeek-V2/V3 forward pass over a backend.
 *
 * Per layer (transformers DeepseekV3DecoderLayer; DeepSeek-V2 paper §2):
 *   h   = RMSNorm(x)
 *   q   = W_qb · RMSNorm(W_qa · h)   (or W_q · h)      [T, nH, dn + dr]
 *   c   = W_kva · h = [c_KV (kvr) | k_pe (dr)];  c_KV = RMSNorm(c_KV); rope(q_pe, k_pe)
 *   (c_KV, k_pe) -> paged cache;  a = MLA(q, cache)     [T, nH * dv]
 *   x  += W_o · a
 *   h   = RMSNorm(x);  x += MLP(h)  or  SharedExperts(h) + Σ_k w_k Expert_k(h)
 * then logits = lm_head · RMSNorm(x) for the rows asked for.
 */
#include "model_impl.h"

#include <string.h>

typedef struct {
    pd_backend *be;
    void *ptrs[32];
    int n;
} scratch;

static float *salloc(scratch *s, size_t n_floats) {
    PD_ASSERT(s->n < 32);
    float *p = s->be->ops->alloc(s->be, n_floats * sizeof(float));
    if (p)
        s->ptrs[s->n++] = p;
    return p;
}

static void sfree(scratch *s) {
    for (int i = 0; i < s->n; i++)
        s->be->ops->free(s->be, s->ptrs[i]);
    s->n = 0;
}

static void mlp_forward(pd_backend *be, const pd_mlp_weights *w, int T, const float *h, float *gu, float *act,
                        float *out, bool accumulate) {
    be->ops->gemm(be, T, h, &w->gate_up, gu, false);
    be->ops->silu_mul(be, T, w->inter, gu, act);
    be->ops->gemm(be, T, act, &w->down, out, accumulate);
}

pd_status pd_model_forward(pd_model *m, pd_kv_cache *kv, pd_batch_seq *seqs, int n_seqs, float *logits, pd_err *err) {
    const pd_model_config *c = &m->cfg;
    pd_backend *be = m->be;
    int T = 0, n_out = 0;
    for (int s = 0; s < n_seqs; s++) {
        pd_batch_seq *b = &seqs[s];
        if (b->n_tokens <= 0)
            return pd_err_set(err, PD_ERR_INVALID, "sequence %d has no new tokens", s);
        if (b->kv->num_tokens + b->n_tokens > c->max_position_embeddings)
            return pd_err_set(err, PD_ERR_INVALID, "sequence %d: position %d past max_position_embeddings %d", s,
                              b->kv->num_tokens + b->n_tokens - 1, c->max_position_embeddings);
        if ((b->kv->num_tokens + b->n_tokens + kv->block_size - 1) / kv->block_size > b->kv->num_blocks)
            return pd_err_set(err, PD_ERR_INVALID, "sequence %d: KV blocks for %d tokens not reserved", s,
                              b->kv->num_tokens + b->n_tokens);
        for (int i = 0; i < b->n_tokens; i++)
            if (b->tokens[i] < 0 || b->tokens[i] >= c->vocab_size)
                return pd_err_set(err, PD_ERR_INVALID, "sequence %d: token id %d outside the vocabulary (%d)", s,
                                  b->tokens[i], c->vocab_size);
        T += b->n_tokens;
        n_out += b->all_logits ? b->n_tokens : 1;
    }
    int H = c->hidden_size, nh = c->num_attention_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    int dv = c->v_head_dim, kvr = c->kv_lora_rank, qd = dn + dr, D = kvr + dr;
    int inter_max = c->intermediate_size;
    int moe_shared = c->moe_intermediate_size * (c->n_shared_experts > 0 ? c->n_shared_experts : 1);
    if (moe_shared > inter_max) inter_max = moe_shared;

    /* host-side token ids and positions */
    int32_t *ids = pd_xmalloc((size_t)T * sizeof(int32_t));
    int *pos = pd_xmalloc((size_t)T * sizeof(int));
    for (int s = 0, t = 0; s < n_seqs; s++)
        for (int i = 0; i < seqs[s].n_tokens; i++, t++) {
            ids[t] = seqs[s].tokens[i];
            pos[t] = seqs[s].kv->num_tokens + i;
        }

    scratch sc = {be, {0}, 0};
    float *x = salloc(&sc, (size_t)T * H);
    float *h = salloc(&sc, (size_t)T * H);
    float *qa = c->q_lora_rank > 0 ? salloc(&sc, (size_t)T * c->q_lora_rank) : NULL;
    float *q = salloc(&sc, (size_t)T * nh * qd);
    float *ckv = salloc(&sc, (size_t)T * D);
    float *attn = salloc(&sc, (size_t)T * nh * dv);
    float *gu = salloc(&sc, (size_t)T * 2 * inter_max);
    float *act = salloc(&sc, (size_t)T * inter_max);
    float *mo = salloc(&sc, (size_t)T * H);
    float *rlog = c->n_routed_experts > 0 ? salloc(&sc, (size_t)T * c->n_routed_experts) : NULL;
    int topk = c->num_experts_per_tok > 0 ? c->num_experts_per_tok : 1;
    int32_t *eids = pd_xmalloc((size_t)T * topk * sizeof(int32_t));
    float *ew = pd_xmalloc((size_t)T * topk * sizeof(float));
    float *hl = salloc(&sc, (size_t)n_out * H);
    float *dlogits = salloc(&sc, (size_t)n_out * c->vocab_size); /* backend memory; copied to the host at the end */
    if (!x || !h || (c->q_lora_rank > 0 && !qa) || !q || !ckv || !attn || !gu || !act || !mo || !hl || !dlogits ||
        (c->n_routed_experts > 0 && !rlog)) {
        sfree(&sc);
        free(ids);
        free(pos);
        free(eids);
        free(ew);
        return pd_err_set(err, PD_ERR_NOMEM, "forward: out of memory for %d tokens", T);
    }

    be->ops->embed(be, T, H, ids, &m->embed, x);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const pd_layer_weights *L = &m->layers[l];
        /* ---- attention ---- */
        be->ops->rmsnorm(be, T, H, x, H, L->input_norm, c->rms_norm_eps, h, H);
        if (c->q_lora_rank > 0) {
            be->ops->gemm(be, T, h, &L->q_a, qa, false);
            be->ops->rmsnorm(be, T, c->q_lora_rank, qa, c->q_lora_rank, L->q_a_norm, c->rms_norm_eps, qa,
                             c->q_lora_rank);
            be->ops->gemm(be, T, qa, &L->q_b, q, false);
        } else {
            be->ops->gemm(be, T, h, &L->q, q, false);
        }
        be->ops->rope(be, T, nh, q + dn, nh * qd, qd, dr, pos, m->inv_freq, m->rope_mscale);
        be->ops->gemm(be, T, h, &L->kv_a, ckv, false);
        be->ops->rmsnorm(be, T, kvr, ckv, D, L->kv_a_norm, c->rms_norm_eps, ckv, D);
        be->ops->rope(be, T, 1, ckv + kvr, D, D, dr, pos, m->inv_freq, m->rope_mscale);
        /* write the new tokens' (c_KV, k_pe) into their cache slots */
        for (int s = 0, t = 0; s < n_seqs; s++) {
            pd_seq_kv *sk = seqs[s].kv;
            for (int i = 0; i < seqs[s].n_tokens; i++, t++) {
                int p = pos[t];
                int blk = sk->block_table[p / kv->block_size];
                float *dst = kv->data + (((size_t)blk * kv->n_layers + l) * kv->block_size + p % kv->block_size) * D;
                be->ops->copy(be, dst, ckv + (size_t)t * D, (size_t)D * sizeof(float));
            }
        }
        for (int s = 0, t = 0; s < n_seqs; s++) {
            pd_batch_seq *b = &seqs[s];
            pd_mla_args a = {
                .n_heads = nh, .qk_nope_dim = dn, .qk_rope_dim = dr, .v_dim = dv, .kv_lora_rank = kvr,
                .softmax_scale = m->softmax_scale, .n_q = b->n_tokens, .start_pos = b->kv->num_tokens,
                .q = q + (size_t)t * nh * qd, .cache = kv->data, .n_layers = kv->n_layers, .layer = l,
                .block_size = kv->block_size, .block_table = b->kv->block_table, .kv_b = &L->kv_b,
                .absorbed = b->n_tokens == 1, .out = attn + (size_t)t * nh * dv,
            };
            be->ops->mla_attention(be, &a);
            t += b->n_tokens;
        }
        be->ops->gemm(be, T, attn, &L->o, x, true); /* x += W_o · a */
        /* ---- MLP / MoE ---- */
        be->ops->rmsnorm(be, T, H, x, H, L->post_norm, c->rms_norm_eps, h, H);
        if (!L->is_moe) {
            mlp_forward(be, &L->mlp, T, h, gu, act, x, true);
            continue;
        }
        be->ops->gemm(be, T, h, &L->router, rlog, false);
        pd_moe_route_params rp = {
            .n_experts = c->n_routed_experts, .top_k = c->num_experts_per_tok, .n_group = c->n_group,
            .topk_group = c->topk_group, .scoring = c->scoring_func == PD_SCORE_SIGMOID ? 1 : 0,
            .topk_method = (int)c->topk_method, .norm_topk_prob = c->norm_topk_prob,
            .routed_scaling_factor = c->routed_scaling_factor, .e_score_correction_bias = L->router_bias,
        };
        be->ops->moe_route(be, T, rlog, &rp, eids, ew);
        if (c->n_shared_experts > 0)
            mlp_forward(be, &L->shared, T, h, gu, act, mo, false);
        else { /* no shared experts: start from zeros (backend memory, so no memset) */
            float *zeros = pd_xcalloc((size_t)T * H, sizeof(float));
            be->ops->upload(be, mo, zeros, (size_t)T * H * sizeof(float));
            free(zeros);
        }
        be->ops->moe_experts(be, T, H, c->moe_intermediate_size, h, eids, ew, c->num_experts_per_tok,
                             L->experts_gate_up, L->experts_down, mo);
        be->ops->add(be, (size_t)T * H, x, mo);
    }
    /* ---- final norm and lm_head on the rows asked for ---- */
    int r = 0;
    for (int s = 0, t = 0; s < n_seqs; s++) {
        pd_batch_seq *b = &seqs[s];
        int first = b->all_logits ? 0 : b->n_tokens - 1;
        for (int i = first; i < b->n_tokens; i++, r++)
            be->ops->copy(be, hl + (size_t)r * H, x + (size_t)(t + i) * H, (size_t)H * sizeof(float));
        t += b->n_tokens;
    }
    be->ops->rmsnorm(be, n_out, H, hl, H, m->final_norm, c->rms_norm_eps, hl, H);
    be->ops->gemm(be, n_out, hl, &m->lm_head, dlogits, false);
    be->ops->download(be, logits, dlogits, (size_t)n_out * c->vocab_size * sizeof(float));
    for (int s = 0; s < n_seqs; s++)
        seqs[s].kv->num_tokens += seqs[s].n_tokens;
    sfree(&sc);
    free(ids);
    free(pos);
    free(eids);
    free(ew);
    return PD_OK;
}

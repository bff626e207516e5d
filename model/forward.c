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
 *
 * A step first writes its host arguments (token ids, positions, cache
 * slots, the decode sequences' lengths and block tables) into one staging
 * block and uploads it; everything after that is queued on the backend over
 * buffers planned once (pd_fwd_ws), so a step allocates nothing. A step of
 * decode tokens only (one new token per sequence, the steady state of a
 * decode replica) is recorded as a graph the first time its number of
 * sequences is seen, and replayed after that.
 *
 * Tensor parallelism (model_impl.h, pd_model_load_tp): every rank runs this
 * same step on its own thread over its shard — nh / n_ranks heads, I /
 * n_ranks intermediate units — and the two row-parallel products (o_proj;
 * the MLP or MoE's down projections) give partial sums that all_reduce_sum
 * adds up before the residual add, so every rank carries the same x. Only
 * rank 0 computes the logits.
 *
 * Expert parallelism (--enable-expert-parallel) changes only the routed
 * experts: every rank routes every token (the router is replicated and x is
 * the same on every rank), keeps the (token, expert) pairs of the E / n
 * experts it holds whole (moe_ids_local: the others become -1, dropped), and
 * adds their weighted outputs to its partial sum; the all-reduce after the
 * MoE block then adds the ranks' partial sums. The combine Σ_k w_k E_k(h) is
 * a sum over pairs and the pairs are partitioned over the ranks, so the sum
 * is the same up to the order of fp32 additions.
 */
#include "model_impl.h"

#include <stdlib.h>
#include <string.h>

static void mlp_forward(pd_backend *be, bool fused, const pd_mlp_weights *w, int T, const float *h, float *gu,
                        float *act, float *out, bool accumulate) {
    if (fused && be->ops->gemm_swiglu) {
        be->ops->gemm_swiglu(be, T, h, &w->gate_up, gu, act);
    } else {
        be->ops->gemm(be, T, h, &w->gate_up, gu, false);
        be->ops->silu_mul(be, T, w->inter, gu, act);
    }
    be->ops->gemm(be, T, act, &w->down, out, accumulate);
}

/* The router's settings for layer L (transformers DeepseekV3TopkRouter). */
static pd_moe_route_params moe_route_params(const pd_model_config *c, const pd_layer_weights *L) {
    return (pd_moe_route_params){
        .n_experts = c->n_routed_experts, .top_k = c->num_experts_per_tok, .n_group = c->n_group,
        .topk_group = c->topk_group, .scoring = c->scoring_func == PD_SCORE_SIGMOID ? 1 : 0,
        .topk_method = (int)c->topk_method, .norm_topk_prob = c->norm_topk_prob,
        .routed_scaling_factor = c->routed_scaling_factor, .e_score_correction_bias = L->router_bias,
    };
}

/* ---- buffers ---------------------------------------------------------- */

static size_t args_ints(const pd_fwd_ws *w) {
    return 3 * (size_t)w->cap_t + 2 * (size_t)w->cap_seqs + (size_t)w->cap_blocks;
}

static void ws_drop_graphs(pd_model_rank *rk) {
    pd_fwd_ws *w = &rk->ws;
    for (int i = 0; i <= PD_FWD_MAX_GRAPH_SEQS; i++)
        if (w->graphs[i].graph) {
            rk->be->ops->graph_free(rk->be, w->graphs[i].graph);
            w->graphs[i].graph = NULL;
        }
}

static void ws_release(pd_model_rank *rk) {
    pd_fwd_ws *w = &rk->ws;
    pd_backend *be = rk->be;
    ws_drop_graphs(rk);
    float **bufs[] = {&w->x, &w->h,    &w->qa, &w->q,  &w->ckv,    &w->attn, &w->gu,
                      &w->act, &w->mo, &w->rlog, &w->hl, &w->logits, &w->ew,   &w->zeros};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        if (*bufs[i])
            be->ops->free(be, *bufs[i]);
        *bufs[i] = NULL;
    }
    if (w->eids)
        be->ops->free(be, w->eids);
    if (w->args)
        be->ops->free(be, w->args);
    if (w->hargs) {
        if (be->ops->upload_wait) /* an async copy from hargs may be in flight */
            be->ops->upload_wait(be);
        if (be->ops->host_alloc)
            be->ops->host_free(be, w->hargs);
        else
            free(w->hargs);
    }
    w->eids = w->args = w->hargs = NULL;
    w->cap_t = w->cap_out = w->cap_seqs = w->cap_blocks = 0;
}

void pd_fwd_ws_free(pd_model_rank *rk) {
    ws_release(rk);
}

/* Makes the buffers hold a step of T tokens, n_out logits rows, n_seqs
 * sequences and n_blocks decode block-table entries. Growth rounds up, so
 * that a server settles after its first few steps. */
static bool ws_fits(const pd_fwd_ws *w, int T, int n_out, int n_seqs, int n_blocks) {
    return T <= w->cap_t && n_out <= w->cap_out && n_seqs <= w->cap_seqs && n_blocks <= w->cap_blocks;
}

static pd_status ws_reserve(const pd_model *m, pd_model_rank *rk, int T, int n_out, int n_seqs, int n_blocks,
                            pd_err *err) {
    pd_fwd_ws *w = &rk->ws;
    if (ws_fits(w, T, n_out, n_seqs, n_blocks))
        return PD_OK;
    const pd_model_config *c = &m->cfg;
    pd_backend *be = rk->be;
    int cap_t = T > w->cap_t ? T : w->cap_t, cap_out = n_out > w->cap_out ? n_out : w->cap_out;
    int cap_seqs = n_seqs > w->cap_seqs ? n_seqs : w->cap_seqs;
    int cap_blocks = n_blocks > w->cap_blocks ? 2 * n_blocks : w->cap_blocks;
    if (cap_t < 64) cap_t = 64;
    if (cap_out < 16) cap_out = 16;
    if (cap_seqs < 64) cap_seqs = 64;
    if (cap_blocks < 1024) cap_blocks = 1024;
    ws_release(rk);
    w->gen++;
    w->cap_t = cap_t;
    w->cap_out = cap_out;
    w->cap_seqs = cap_seqs;
    w->cap_blocks = cap_blocks;
    size_t Tn = (size_t)cap_t;
    int H = c->hidden_size, nh = rk->n_heads, qd = c->qk_nope_head_dim + c->qk_rope_head_dim;
    int D = c->kv_lora_rank + c->qk_rope_head_dim, topk = c->num_experts_per_tok > 0 ? c->num_experts_per_tok : 1;
    int inter_max = c->intermediate_size;
    int moe_shared = c->moe_intermediate_size * (c->n_shared_experts > 0 ? c->n_shared_experts : 1);
    if (moe_shared > inter_max) inter_max = moe_shared;
    if (c->moe_intermediate_size > inter_max) inter_max = c->moe_intermediate_size;
    inter_max /= rk->n_ranks; /* every intermediate size is divided evenly */
    bool lm = rk->rank == 0; /* only rank 0 computes logits */
    bool zeros = rk->n_ranks > 1 && c->n_shared_experts == 0;
    const size_t f = sizeof(float);
    w->x = be->ops->alloc(be, Tn * H * f);
    w->h = be->ops->alloc(be, Tn * H * f);
    w->qa = c->q_lora_rank > 0 ? be->ops->alloc(be, Tn * c->q_lora_rank * f) : NULL;
    w->q = be->ops->alloc(be, Tn * nh * qd * f);
    w->ckv = be->ops->alloc(be, Tn * D * f);
    w->attn = be->ops->alloc(be, Tn * nh * c->v_head_dim * f);
    w->gu = be->ops->alloc(be, Tn * 2 * inter_max * f);
    w->act = be->ops->alloc(be, Tn * inter_max * f);
    w->mo = be->ops->alloc(be, Tn * H * f);
    w->rlog = c->n_routed_experts > 0 ? be->ops->alloc(be, Tn * c->n_routed_experts * f) : NULL;
    w->eids = be->ops->alloc(be, Tn * topk * sizeof(int32_t));
    w->ew = be->ops->alloc(be, Tn * topk * f);
    w->hl = lm ? be->ops->alloc(be, (size_t)cap_out * H * f) : NULL;
    w->logits = lm ? be->ops->alloc(be, (size_t)cap_out * c->vocab_size * f) : NULL;
    w->zeros = zeros ? be->ops->alloc(be, Tn * H * f) : NULL;
    w->args = be->ops->alloc(be, args_ints(w) * sizeof(int32_t));
    w->hargs = be->ops->host_alloc ? be->ops->host_alloc(be, args_ints(w) * sizeof(int32_t))
                                   : malloc(args_ints(w) * sizeof(int32_t));
    if (!w->x || !w->h || (c->q_lora_rank > 0 && !w->qa) || !w->q || !w->ckv || !w->attn || !w->gu || !w->act ||
        !w->mo || (c->n_routed_experts > 0 && !w->rlog) || !w->eids || !w->ew || (lm && (!w->hl || !w->logits)) ||
        (zeros && !w->zeros) || !w->args || !w->hargs) {
        ws_release(rk);
        return pd_err_set(err, PD_ERR_NOMEM, "forward: out of memory for buffers of %d tokens", T);
    }
    return PD_OK;
}

/* ---- the step --------------------------------------------------------- */

/* Queues the step over the uploaded arguments. Only the prefill chunks'
 * attention reads host memory (their block tables); a step of decode
 * tokens only queues nothing that waits on the host. */
/* x += Σ over ranks of partial[rank] (T rows of H): the ranks' partial sums
 * of a row-parallel product added up in place, then the residual add. */
static void add_reduced(pd_model_rank *rk, int T, int H, float *x, float *partial) {
    pd_backend *be = rk->be;
    be->ops->all_reduce_sum(be, partial, (size_t)T * H);
    be->ops->add(be, (size_t)T * H, x, partial);
}

static void fwd_queue(const pd_model *m, pd_model_rank *rk, pd_kv_cache *kv, const pd_batch_seq *seqs, int n_seqs,
                      int T, int n_out) {
    const pd_model_config *c = &m->cfg;
    pd_backend *be = rk->be;
    pd_fwd_ws *w = &rk->ws;
    bool tp = rk->n_ranks > 1;
    int H = c->hidden_size, nh = rk->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    int dv = c->v_head_dim, kvr = c->kv_lora_rank, qd = dn + dr, D = kvr + dr;
    const int32_t *ids = w->args, *pos = ids + w->cap_t, *slots = pos + w->cap_t, *lens = slots + w->cap_t;
    const int32_t *boff = lens + w->cap_seqs, *blocks = boff + w->cap_seqs;
    float *x = w->x, *h = w->h, *q = w->q, *ckv = w->ckv, *attn = w->attn;
    float *cache = kv->rank_data[rk->rank];

    /* fused ops where the backend has them (PD_FUSED_OPS=0: the separate
     * ones, for A/B runs) */
    const bool fused = m->fused_ops;
    const bool fuse_prep = fused && be->ops->mla_prep, fuse_add_norm = fused && be->ops->add_rmsnorm;
    const bool fuse_moe = fused && be->ops->moe_block;
    const bool fuse_norm_pair = fused && m->norm_pair && be->ops->rmsnorm_gemm_pair;
    const float *pending = NULL; /* the last layer's MoE output, not yet added to x */

    be->ops->embed_ids(be, T, H, ids, &rk->embed, x);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const pd_layer_weights *L = &rk->layers[l];
        /* ---- attention ---- */
        /* the two projections of h: q_a (then its norm and q_b) or q, and
         * kv_a; both column-parallel (a rank holds its heads' share of q
         * and all of kv_a) */
        const pd_weight *wq = c->q_lora_rank > 0 ? &L->q_a : &L->q;
        float *yq = c->q_lora_rank > 0 ? w->qa : q;
        if (!pending && fuse_norm_pair) {
            be->ops->rmsnorm_gemm_pair(be, T, H, x, L->input_norm, c->rms_norm_eps, h, wq, yq, &L->kv_a, ckv);
        } else {
            if (pending)
                be->ops->add_rmsnorm(be, T, H, x, pending, L->input_norm, c->rms_norm_eps, h);
            else
                be->ops->rmsnorm(be, T, H, x, H, L->input_norm, c->rms_norm_eps, h, H);
            be->ops->gemm(be, T, h, wq, yq, false);
            be->ops->gemm(be, T, h, &L->kv_a, ckv, false);
        }
        pending = NULL;
        if (c->q_lora_rank > 0) {
            be->ops->rmsnorm(be, T, c->q_lora_rank, w->qa, c->q_lora_rank, L->q_a_norm, c->rms_norm_eps, w->qa,
                             c->q_lora_rank);
            be->ops->gemm(be, T, w->qa, &L->q_b, q, false);
        }
        /* a step of decode tokens only passes the prologue to its one
         * mla_decode call, which may fold it into its first kernel */
        const bool prep_in_decode = fuse_prep && n_seqs == T;
        pd_mla_prep_args pa = {
            .rows = T, .n_heads = nh, .qk_nope_dim = dn, .qk_rope_dim = dr, .kv_lora_rank = kvr, .q = q,
            .ckv = ckv, .kv_norm = L->kv_a_norm, .eps = c->rms_norm_eps, .pos = pos,
            .inv_freq = rk->inv_freq_b, .mscale = m->rope_mscale, .cache = cache, .slots = slots,
            .slot_offset = (size_t)l * kv->block_size,
        };
        if (fuse_prep && !prep_in_decode) { /* with prep_in_decode: in mla_decode below */
            be->ops->mla_prep(be, &pa);
        } else if (!fuse_prep) {
            be->ops->rope_pos(be, T, nh, q + dn, nh * qd, qd, dr, pos, rk->inv_freq_b, m->rope_mscale);
            be->ops->rmsnorm(be, T, kvr, ckv, D, L->kv_a_norm, c->rms_norm_eps, ckv, D);
            be->ops->rope_pos(be, T, 1, ckv + kvr, D, D, dr, pos, rk->inv_freq_b, m->rope_mscale);
            /* the new tokens' (c_KV, k_pe) into their cache slots */
            be->ops->kv_store(be, T, D, ckv, D, cache, slots, (size_t)l * kv->block_size);
        }
        for (int s = 0, t = 0; s < n_seqs;) {
            if (seqs[s].n_tokens == 1) { /* a run of decode tokens: one batched call */
                int s0 = s;
                while (s < n_seqs && seqs[s].n_tokens == 1)
                    s++;
                pd_mla_decode_args d = {
                    .n_heads = nh, .qk_nope_dim = dn, .qk_rope_dim = dr, .v_dim = dv, .kv_lora_rank = kvr,
                    .softmax_scale = m->softmax_scale, .n_seqs = s - s0, .q = q + (size_t)t * nh * qd,
                    .cache = cache, .n_layers = kv->n_layers, .layer = l, .block_size = kv->block_size,
                    .seq_lens = lens + s0, .block_off = boff + s0, .blocks = blocks, .kv_b = &L->kv_b,
                    .out = attn + (size_t)t * nh * dv, .prep = prep_in_decode ? &pa : NULL,
                };
                be->ops->mla_decode(be, &d);
                t += s - s0;
                continue;
            }
            const pd_batch_seq *b = &seqs[s];
            pd_mla_args a = {
                .n_heads = nh, .qk_nope_dim = dn, .qk_rope_dim = dr, .v_dim = dv, .kv_lora_rank = kvr,
                .softmax_scale = m->softmax_scale, .n_q = b->n_tokens, .start_pos = b->kv->num_tokens,
                .q = q + (size_t)t * nh * qd, .cache = cache, .n_layers = kv->n_layers, .layer = l,
                .block_size = kv->block_size, .block_table = b->kv->block_table, .kv_b = &L->kv_b,
                .absorbed = false, .out = attn + (size_t)t * nh * dv,
            };
            be->ops->mla_attention(be, &a);
            t += b->n_tokens;
            s++;
        }
        /* the MoE block as one op takes the output projection too (x += W_o · a) */
        const bool moe_op = L->is_moe && fuse_moe && !tp && !rk->expert_parallel;
        if (!tp) {
            if (!moe_op)
                be->ops->gemm(be, T, attn, &L->o, x, true); /* x += W_o · a */
        } else {
            be->ops->gemm(be, T, attn, &L->o, w->mo, false); /* this rank's heads' share of W_o · a */
            add_reduced(rk, T, H, x, w->mo);
        }
        /* ---- MLP / MoE ---- */
        if (moe_op) {
            /* the whole block in one op where the backend has a faster
             * path for it (CUDA: decode-sized batches) */
            pd_moe_block_args mb = {
                .rows = T, .hidden = H, .x = x, .norm = L->post_norm, .eps = c->rms_norm_eps, .router = &L->router,
                .route = moe_route_params(c, L), .inter = c->moe_intermediate_size, .gate_up = L->experts_gate_up,
                .down = L->experts_down, .shared_gate_up = c->n_shared_experts > 0 ? &L->shared.gate_up : NULL,
                .shared_down = c->n_shared_experts > 0 ? &L->shared.down : NULL, .h = h, .logits = w->rlog,
                .ids = w->eids, .weights = w->ew, .gu = w->gu, .act = w->act, .mo = w->mo,
                .o_in = attn, .o_proj = &L->o,
            };
            if (be->ops->moe_block(be, &mb))
                continue;
            be->ops->gemm(be, T, attn, &L->o, x, true); /* declined: nothing done, the separate ops follow */
        }
        be->ops->rmsnorm(be, T, H, x, H, L->post_norm, c->rms_norm_eps, h, H);
        if (!L->is_moe) {
            mlp_forward(be, fused, &L->mlp, T, h, w->gu, w->act, tp ? w->mo : x, !tp);
            if (tp)
                add_reduced(rk, T, H, x, w->mo);
            continue;
        }
        /* x += shared(h) + routed(h); with one rank and no shared experts
         * the routed outputs go straight into x, else they add up in mo
         * (the experts accumulate into it: zeros first without shared ones).
         * The router's GEMM and the shared experts' gate_up read the same h
         * one after the other, so a backend may round h to bf16 once for
         * both (the CUDA backend's kept GEMM input, gemm.cu); the routing
         * follows. */
        float *mo = c->n_shared_experts > 0 || tp ? w->mo : x;
        be->ops->gemm(be, T, h, &L->router, w->rlog, false);
        if (c->n_shared_experts > 0)
            mlp_forward(be, fused, &L->shared, T, h, w->gu, w->act, mo, false);
        else if (tp)
            be->ops->copy(be, mo, w->zeros, (size_t)T * H * sizeof(float));
        pd_moe_route_params rp = moe_route_params(c, L);
        be->ops->moe_route_ids(be, T, w->rlog, &rp, w->eids, w->ew);
        int moe_inter = c->moe_intermediate_size / rk->n_ranks;
        if (rk->expert_parallel) {
            /* this rank's whole experts only: the other ranks' pairs drop
             * (id -1) and their experts add their pairs to their own mo */
            be->ops->moe_ids_local(be, (size_t)T * c->num_experts_per_tok, w->eids, rk->expert_first,
                                   rk->n_experts);
            moe_inter = c->moe_intermediate_size;
        }
        be->ops->moe_experts_ids(be, T, H, moe_inter, h, w->eids, w->ew, c->num_experts_per_tok, rk->n_experts,
                                 L->experts_gate_up, L->experts_down, mo);
        if (tp)
            add_reduced(rk, T, H, x, mo);
        else if (c->n_shared_experts > 0 && fuse_add_norm)
            pending = mo; /* added by the next norm of x */
        else if (c->n_shared_experts > 0)
            be->ops->add(be, (size_t)T * H, x, mo);
    }
    if (pending && n_out != T) /* no norm of every row of x follows (pending: one rank only) */
        be->ops->add(be, (size_t)T * H, x, pending);
    if (rk->rank != 0)
        return; /* x is the same on every rank: rank 0 alone computes the logits */
    /* ---- final norm and lm_head on the rows asked for ---- */
    if (n_out == T && pending) { /* every row (decode steps; all_logits) */
        be->ops->add_rmsnorm(be, T, H, x, pending, rk->final_norm, c->rms_norm_eps, w->hl);
    } else if (n_out == T) {
        be->ops->rmsnorm(be, T, H, x, H, rk->final_norm, c->rms_norm_eps, w->hl, H);
    } else {
        int r = 0;
        for (int s = 0, t = 0; s < n_seqs; s++) {
            const pd_batch_seq *b = &seqs[s];
            int first = b->all_logits ? 0 : b->n_tokens - 1;
            for (int i = first; i < b->n_tokens; i++, r++)
                be->ops->copy(be, w->hl + (size_t)r * H, x + (size_t)(t + i) * H, (size_t)H * sizeof(float));
            t += b->n_tokens;
        }
        be->ops->rmsnorm(be, n_out, H, w->hl, H, rk->final_norm, c->rms_norm_eps, w->hl, H);
    }
    be->ops->gemm(be, n_out, w->hl, &rk->lm_head, w->logits, false);
}

/* Replays the step's graph when one was recorded for this many sequences
 * over this cache and these buffers; true when it ran. */
static bool graph_replay(pd_model_rank *rk, const pd_kv_cache *kv, int n_seqs) {
    const float *cache = kv->rank_data[rk->rank];
    pd_fwd_ws *w = &rk->ws;
    pd_backend *be = rk->be;
    if (w->no_graphs || !be->ops->graph_begin || n_seqs > PD_FWD_MAX_GRAPH_SEQS)
        return false;
    if (!w->graphs[n_seqs].graph)
        return false;
    if (w->graphs[n_seqs].cache == cache && w->graphs[n_seqs].kv_id == kv->id && w->graphs[n_seqs].gen == w->gen &&
        be->ops->graph_launch(be, w->graphs[n_seqs].graph) == PD_OK)
        return true;
    be->ops->graph_free(be, w->graphs[n_seqs].graph); /* stale: record it again */
    w->graphs[n_seqs].graph = NULL;
    return false;
}

static void graph_record(const pd_model *m, pd_model_rank *rk, pd_kv_cache *kv, const pd_batch_seq *seqs,
                         int n_seqs) {
    pd_fwd_ws *w = &rk->ws;
    pd_backend *be = rk->be;
    if (w->no_graphs || !be->ops->graph_begin || n_seqs > PD_FWD_MAX_GRAPH_SEQS)
        return;
    void *g = NULL;
    if (be->ops->graph_begin(be) != PD_OK)
        return; /* switched off for now */
    fwd_queue(m, rk, kv, seqs, n_seqs, n_seqs, n_seqs);
    if (be->ops->graph_end(be, &g) != PD_OK) {
        w->no_graphs = true; /* this model's steps cannot be recorded */
        return;
    }
    w->graphs[n_seqs].graph = g;
    w->graphs[n_seqs].cache = kv->rank_data[rk->rank];
    w->graphs[n_seqs].kv_id = kv->id;
    w->graphs[n_seqs].gen = w->gen;
}

/* Rank 0's end of a step: the output rows asked for to the host, in runs of
 * consecutive rows, then the rows sampled where they are. */
static void step_outputs(const pd_model *m, pd_model_rank *rk, int n_out, const pd_fwd_out *o) {
    pd_backend *be = rk->be;
    const size_t V = (size_t)m->cfg.vocab_size;
    for (int r = 0; r < n_out;) {
        if (o->download_row && !o->download_row[r]) {
            r++;
            continue;
        }
        int e = r + 1;
        while (e < n_out && (!o->download_row || o->download_row[e]))
            e++;
        be->ops->download(be, o->logits + (size_t)r * V, rk->ws.logits + (size_t)r * V,
                          (size_t)(e - r) * V * sizeof(float));
        r = e;
    }
    if (o->n_sample > 0)
        be->ops->sample_rows(be, o->n_sample, (int)V, rk->ws.logits, o->sample, o->toks, o->n_toks, o->sampled);
}

/* One step, as every rank runs it (each on its own thread). */
typedef struct {
    const pd_model *m;
    pd_kv_cache *kv;
    const pd_batch_seq *seqs;
    int n_seqs, T, n_out, n_blocks;
    bool decode_only;
    const pd_fwd_out *out; /* rank 0 fills it */
    pd_status status[PD_TP_MAX_RANKS]; /* of reserve_on_rank */
    pd_err err[PD_TP_MAX_RANKS];
} step_job;

static void reserve_on_rank(void *arg, int rank) {
    step_job *j = arg;
    j->status[rank] = ws_reserve(j->m, &j->m->ranks[rank], j->T, j->n_out, j->n_seqs, j->n_blocks, &j->err[rank]);
}

static void step_on_rank(void *arg, int rank) {
    step_job *j = arg;
    const pd_model *m = j->m;
    pd_model_rank *rk = &m->ranks[rank];
    pd_kv_cache *kv = j->kv;
    pd_backend *be = rk->be;
    const pd_batch_seq *seqs = j->seqs;
    int n_seqs = j->n_seqs;
    pd_fwd_ws *w = &rk->ws;

    /* host arguments, in the layout of w->args (rewritten only once the
     * last step's copy of them is done). With args_async nothing else here
     * waits for the last step: a rank above 0, or a step with no output
     * downloaded or sampled, returns with its work queued, and a device
     * error of it shows in the next call that waits (the next step's
     * outputs, or a later upload_wait) */
    if (m->args_async)
        be->ops->upload_wait(be);
    int32_t *ids = w->hargs, *pos = ids + w->cap_t, *slots = pos + w->cap_t, *lens = slots + w->cap_t;
    int32_t *boff = lens + w->cap_seqs, *blocks = boff + w->cap_seqs;
    int nb = 0;
    for (int s = 0, t = 0; s < n_seqs; s++) {
        const pd_seq_kv *sk = seqs[s].kv;
        for (int i = 0; i < seqs[s].n_tokens; i++, t++) {
            int p = sk->num_tokens + i;
            ids[t] = seqs[s].tokens[i];
            pos[t] = p;
            slots[t] = sk->block_table[p / kv->block_size] * kv->n_layers * kv->block_size + p % kv->block_size;
        }
        lens[s] = sk->num_tokens + seqs[s].n_tokens;
        boff[s] = nb;
        if (seqs[s].n_tokens == 1) {
            int nblk = (lens[s] + kv->block_size - 1) / kv->block_size;
            memcpy(blocks + nb, sk->block_table, (size_t)nblk * sizeof(int32_t));
            nb += nblk;
        }
    }
    /* queued without a wait where the backend can (hargs is page-locked) */
    const size_t arg_bytes = (size_t)(blocks + nb - w->hargs) * sizeof(int32_t);
    if (m->args_async)
        be->ops->upload_async(be, w->args, w->hargs, arg_bytes);
    else
        be->ops->upload(be, w->args, w->hargs, arg_bytes);

    bool replayed = j->decode_only && graph_replay(rk, kv, n_seqs);
    if (!replayed)
        fwd_queue(m, rk, kv, seqs, n_seqs, j->T, j->n_out);
    if (rank == 0)
        step_outputs(m, rk, j->n_out, j->out);
    if (j->decode_only && !replayed)
        graph_record(m, rk, kv, seqs, n_seqs);
}

void pd_model_read_switches(pd_model *m) {
    const pd_backend_i *ops = m->be->ops;
    const char *f = getenv("PD_FUSED_OPS"), *d = getenv("PD_SAMPLE_ON_DEVICE"), *np = getenv("PD_NORM_PAIR");
    m->fused_ops = !(f && strcmp(f, "0") == 0);
    m->norm_pair = !(np && strcmp(np, "0") == 0);
    const char *aa = getenv("PD_ARGS_ASYNC");
    m->args_async = !(aa && strcmp(aa, "0") == 0) && ops->upload_async && ops->upload_wait && ops->host_alloc;
    if (d && strcmp(d, "0") == 0)
        m->sample_on_device = false;
    else if (d && strcmp(d, "1") == 0)
        m->sample_on_device = ops->sample_rows != NULL; /* the CPU backend's reference too: tests */
    else
        m->sample_on_device = ops->sample_rows && ops->host_alloc;
}

bool pd_model_samples_on_device(const pd_model *m) {
    return m->sample_on_device;
}

pd_status pd_model_forward(pd_model *m, pd_kv_cache *kv, pd_batch_seq *seqs, int n_seqs, float *logits, pd_err *err) {
    return pd_model_forward_ex(m, kv, seqs, n_seqs, &(pd_fwd_out){.logits = logits}, err);
}

pd_status pd_model_forward_ex(pd_model *m, pd_kv_cache *kv, pd_batch_seq *seqs, int n_seqs, const pd_fwd_out *out,
                              pd_err *err) {
    const pd_model_config *c = &m->cfg;
    int T = 0, n_out = 0, n_blocks = 0;
    bool decode_only = n_seqs > 0;
    if (kv->m != m)
        return pd_err_set(err, PD_ERR_INVALID, "the KV cache belongs to another model");
    for (int s = 0; s < n_seqs; s++) {
        pd_batch_seq *b = &seqs[s];
        if (b->n_tokens <= 0)
            return pd_err_set(err, PD_ERR_INVALID, "sequence %d has no new tokens", s);
        int end = b->kv->num_tokens + b->n_tokens;
        if (end > c->max_position_embeddings)
            return pd_err_set(err, PD_ERR_INVALID, "sequence %d: position %d past max_position_embeddings %d", s,
                              end - 1, c->max_position_embeddings);
        int nblk = (end + kv->block_size - 1) / kv->block_size;
        if (nblk > b->kv->num_blocks)
            return pd_err_set(err, PD_ERR_INVALID, "sequence %d: KV blocks for %d tokens not reserved", s, end);
        for (int i = 0; i < nblk; i++)
            if (b->kv->block_table[i] < 0 || b->kv->block_table[i] >= kv->num_blocks)
                return pd_err_set(err, PD_ERR_INVALID, "sequence %d: block_table[%d] = %d outside the cache", s, i,
                                  b->kv->block_table[i]);
        for (int i = 0; i < b->n_tokens; i++)
            if (b->tokens[i] < 0 || b->tokens[i] >= c->vocab_size)
                return pd_err_set(err, PD_ERR_INVALID, "sequence %d: token id %d outside the vocabulary (%d)", s,
                                  b->tokens[i], c->vocab_size);
        T += b->n_tokens;
        n_out += b->all_logits ? b->n_tokens : 1;
        if (b->n_tokens == 1)
            n_blocks += nblk;
        else
            decode_only = false;
    }
    if (out->n_sample > 0 && !m->ranks[0].be->ops->sample_rows)
        return pd_err_set(err, PD_ERR_INVALID, "the %s backend does not sample", m->ranks[0].be->ops->name);
    for (int i = 0; i < out->n_sample; i++)
        if (out->sample[i].row < 0 || out->sample[i].row >= n_out)
            return pd_err_set(err, PD_ERR_INVALID, "sample row %d: output row %d of %d", i, out->sample[i].row, n_out);
    step_job *j = &(step_job){.m = m, .kv = kv, .seqs = seqs, .n_seqs = n_seqs, .T = T, .n_out = n_out,
                              .n_blocks = n_blocks, .decode_only = decode_only, .out = out};
    /* Buffers first, on every rank, and the step only when every rank has
     * them: a rank that stopped halfway would leave the others waiting in
     * all_reduce_sum. */
    bool fits = true;
    for (int r = 0; r < m->n_ranks; r++)
        fits = fits && ws_fits(&m->ranks[r].ws, T, n_out, n_seqs, n_blocks);
    if (!fits) {
        pd_tp_run(m->team, m->n_ranks, reserve_on_rank, j);
        for (int r = 0; r < m->n_ranks; r++)
            if (j->status[r] != PD_OK)
                return pd_err_set(err, j->status[r], "%s", j->err[r].msg);
    }
    pd_tp_run(m->team, m->n_ranks, step_on_rank, j);
    for (int s = 0; s < n_seqs; s++)
        seqs[s].kv->num_tokens += seqs[s].n_tokens;
    for (int i = 0; i < out->n_sample; i++)
        if (out->sampled[i].token < 0 || out->sampled[i].token >= c->vocab_size)
            return pd_err_set(err, PD_ERR_IO, "sampling on the %s backend failed (row %d; the log says why)",
                              m->ranks[0].be->ops->name, out->sample[i].row);
    return PD_OK;
}

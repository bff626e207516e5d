/* The tensor names and shapes of a DeepSeek-V2/V3 checkpoint, as published
 * (e.g. deepseek-ai/DeepSeek-V3 model.safetensors.index.json). */
#include "model_impl.h"

#include <stdarg.h>
#include <string.h>

typedef struct {
    pd_tensor_spec *v;
    size_t n, cap;
} spec_list;

static void add(spec_list *l, pd_tensor_kind kind, int64_t rows, int64_t cols, const char *fmt, ...) {
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 256;
        pd_tensor_spec *nv = realloc(l->v, l->cap * sizeof *nv);
        if (!nv) abort();
        l->v = nv;
    }
    pd_tensor_spec *s = &l->v[l->n++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->name, sizeof s->name, fmt, ap);
    va_end(ap);
    s->kind = kind;
    s->rows = rows;
    s->cols = cols;
}

static void add_mlp(spec_list *l, const char *prefix, int64_t h, int64_t inter) {
    add(l, PD_TK_LINEAR, inter, h, "%s.gate_proj.weight", prefix);
    add(l, PD_TK_LINEAR, inter, h, "%s.up_proj.weight", prefix);
    add(l, PD_TK_LINEAR, h, inter, "%s.down_proj.weight", prefix);
}

void pd_model_tensor_specs(const pd_model_config *c, pd_tensor_spec **specs_p, size_t *n_p) {
    spec_list l = {0};
    int64_t h = c->hidden_size, nh = c->num_attention_heads;
    int64_t qk = c->qk_nope_head_dim + c->qk_rope_head_dim;
    add(&l, PD_TK_EMBED, c->vocab_size, h, "model.embed_tokens.weight");
    for (int i = 0; i < c->num_hidden_layers; i++) {
        char p[96];
        snprintf(p, sizeof p, "model.layers.%d", i);
        add(&l, PD_TK_NORM, h, 0, "%s.input_layernorm.weight", p);
        if (c->q_lora_rank > 0) {
            add(&l, PD_TK_LINEAR, c->q_lora_rank, h, "%s.self_attn.q_a_proj.weight", p);
            add(&l, PD_TK_NORM, c->q_lora_rank, 0, "%s.self_attn.q_a_layernorm.weight", p);
            add(&l, PD_TK_LINEAR, nh * qk, c->q_lora_rank, "%s.self_attn.q_b_proj.weight", p);
        } else {
            add(&l, PD_TK_LINEAR, nh * qk, h, "%s.self_attn.q_proj.weight", p);
        }
        add(&l, PD_TK_LINEAR, c->kv_lora_rank + c->qk_rope_head_dim, h, "%s.self_attn.kv_a_proj_with_mqa.weight", p);
        add(&l, PD_TK_NORM, c->kv_lora_rank, 0, "%s.self_attn.kv_a_layernorm.weight", p);
        add(&l, PD_TK_LINEAR, nh * (c->qk_nope_head_dim + c->v_head_dim), c->kv_lora_rank,
            "%s.self_attn.kv_b_proj.weight", p);
        add(&l, PD_TK_LINEAR, h, nh * c->v_head_dim, "%s.self_attn.o_proj.weight", p);
        add(&l, PD_TK_NORM, h, 0, "%s.post_attention_layernorm.weight", p);
        char mp[128];
        snprintf(mp, sizeof mp, "%s.mlp", p);
        if (pd_config_layer_is_moe(c, i)) {
            add(&l, PD_TK_ROUTER, c->n_routed_experts, h, "%s.gate.weight", mp);
            if (c->arch == PD_ARCH_DEEPSEEK_V3)
                add(&l, PD_TK_BIAS, c->n_routed_experts, 0, "%s.gate.e_score_correction_bias", mp);
            for (int e = 0; e < c->n_routed_experts; e++) {
                char ep[160];
                snprintf(ep, sizeof ep, "%s.experts.%d", mp, e);
                add_mlp(&l, ep, h, c->moe_intermediate_size);
            }
            if (c->n_shared_experts > 0) {
                char sp[160];
                snprintf(sp, sizeof sp, "%s.shared_experts", mp);
                add_mlp(&l, sp, h, (int64_t)c->moe_intermediate_size * c->n_shared_experts);
            }
        } else {
            add_mlp(&l, mp, h, c->intermediate_size);
        }
    }
    add(&l, PD_TK_NORM, h, 0, "model.norm.weight");
    if (!c->tie_word_embeddings)
        add(&l, PD_TK_EMBED, c->vocab_size, h, "lm_head.weight");
    *specs_p = l.v;
    *n_p = l.n;
}

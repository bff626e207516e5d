/* Architecture presets for `pdserve mkmodel`. Weights are random; the
 * arithmetic is the real one. Shapes of v2-lite and v3-layers follow the
 * published DeepSeek-V2-Lite and DeepSeek-V3 config.json files, except the
 * vocabulary, which is DeepSeek-V3's padded 129280 everywhere so that the
 * one tokenizer we ship (DeepSeek-V3's) fits every preset. */
#include "pd_model.h"

#include <string.h>

static pd_model_config base_v3(void) {
    pd_model_config c;
    memset(&c, 0, sizeof c);
    c.arch = PD_ARCH_DEEPSEEK_V3;
    c.topk_method = PD_TOPK_NOAUX_TC;
    c.scoring_func = PD_SCORE_SIGMOID;
    c.norm_topk_prob = true;
    c.moe_layer_freq = 1;
    c.rms_norm_eps = 1e-6f;
    c.rope_theta = 10000.0;
    c.vocab_size = 129280;
    c.bos_token_id = 0;
    c.eos_token_id = 1;
    c.initializer_range = 0.02f;
    snprintf(c.torch_dtype, sizeof c.torch_dtype, "bfloat16");
    return c;
}

static void set_yarn(pd_model_config *c, double factor, int orig, double mscale, double mscale_all_dim) {
    c->has_yarn = true;
    c->yarn_factor = factor;
    c->yarn_original_max_position_embeddings = orig;
    c->yarn_beta_fast = 32.0;
    c->yarn_beta_slow = 1.0;
    c->yarn_mscale = mscale;
    c->yarn_mscale_all_dim = mscale_all_dim;
    c->max_position_embeddings = (int)(factor * orig);
}

pd_status pd_preset_config(const char *name, pd_model_config *cfg_p, pd_err *err) {
    pd_model_config c = base_v3();
    if (!strcmp(name, "tiny")) {
        /* CI: V3 gating (sigmoid, noaux_tc, 4 groups), q_lora, YaRN. */
        c.hidden_size = 64;
        c.num_hidden_layers = 3;
        c.num_attention_heads = 4;
        c.q_lora_rank = 32;
        c.kv_lora_rank = 32;
        c.qk_nope_head_dim = 16;
        c.qk_rope_head_dim = 8;
        c.v_head_dim = 16;
        c.intermediate_size = 128;
        c.moe_intermediate_size = 32;
        c.n_routed_experts = 8;
        c.n_shared_experts = 1;
        c.num_experts_per_tok = 2;
        c.n_group = 4;
        c.topk_group = 2;
        c.routed_scaling_factor = 2.5f;
        c.first_k_dense_replace = 1;
        set_yarn(&c, 4.0, 256, 1.0, 1.0);
    } else if (!strcmp(name, "tiny-v2")) {
        /* CI: V2 gating (softmax, group-limited greedy), plain q_proj, no
         * rope scaling (transformers' DeepseekV2Attention omits the YaRN
         * mscale² softmax factor, so a YaRN tiny-v2 could not be checked
         * against it). */
        c.arch = PD_ARCH_DEEPSEEK_V2;
        c.topk_method = PD_TOPK_GROUP_LIMITED_GREEDY;
        c.scoring_func = PD_SCORE_SOFTMAX;
        c.norm_topk_prob = false;
        c.hidden_size = 64;
        c.num_hidden_layers = 3;
        c.num_attention_heads = 4;
        c.q_lora_rank = 0;
        c.kv_lora_rank = 32;
        c.qk_nope_head_dim = 16;
        c.qk_rope_head_dim = 8;
        c.v_head_dim = 16;
        c.intermediate_size = 128;
        c.moe_intermediate_size = 32;
        c.n_routed_experts = 8;
        c.n_shared_experts = 2;
        c.num_experts_per_tok = 3;
        c.n_group = 2;
        c.topk_group = 1;
        c.routed_scaling_factor = 1.0f;
        c.first_k_dense_replace = 1;
        c.max_position_embeddings = 2048;
    } else if (!strcmp(name, "small")) {
        /* CPU demo: ~160M parameters (132M of them embeddings + lm_head). */
        c.hidden_size = 512;
        c.num_hidden_layers = 4;
        c.num_attention_heads = 8;
        c.q_lora_rank = 256;
        c.kv_lora_rank = 128;
        c.qk_nope_head_dim = 64;
        c.qk_rope_head_dim = 32;
        c.v_head_dim = 64;
        c.intermediate_size = 1408;
        c.moe_intermediate_size = 256;
        c.n_routed_experts = 16;
        c.n_shared_experts = 1;
        c.num_experts_per_tok = 4;
        c.n_group = 4;
        c.topk_group = 2;
        c.routed_scaling_factor = 2.5f;
        c.first_k_dense_replace = 1;
        set_yarn(&c, 4.0, 4096, 1.0, 1.0);
    } else if (!strcmp(name, "v2-lite")) {
        /* DeepSeek-V2-Lite (about 16B parameters), bf16. */
        c.arch = PD_ARCH_DEEPSEEK_V2;
        c.topk_method = PD_TOPK_GREEDY;
        c.scoring_func = PD_SCORE_SOFTMAX;
        c.norm_topk_prob = false;
        c.hidden_size = 2048;
        c.num_hidden_layers = 27;
        c.num_attention_heads = 16;
        c.q_lora_rank = 0;
        c.kv_lora_rank = 512;
        c.qk_nope_head_dim = 128;
        c.qk_rope_head_dim = 64;
        c.v_head_dim = 128;
        c.intermediate_size = 10944;
        c.moe_intermediate_size = 1408;
        c.n_routed_experts = 64;
        c.n_shared_experts = 2;
        c.num_experts_per_tok = 6;
        c.n_group = 1;
        c.topk_group = 1;
        c.routed_scaling_factor = 1.0f;
        c.first_k_dense_replace = 1;
        set_yarn(&c, 40.0, 4096, 0.707, 0.707);
    } else if (!strcmp(name, "v3-layers")) {
        /* DeepSeek-V3's real widths, 3 dense + 1 MoE layer, FP8 e4m3 with
         * 128x128 weight_scale_inv blocks. */
        c.hidden_size = 7168;
        c.num_hidden_layers = 4;
        c.num_attention_heads = 128;
        c.q_lora_rank = 1536;
        c.kv_lora_rank = 512;
        c.qk_nope_head_dim = 128;
        c.qk_rope_head_dim = 64;
        c.v_head_dim = 128;
        c.intermediate_size = 18432;
        c.moe_intermediate_size = 2048;
        c.n_routed_experts = 256;
        c.n_shared_experts = 1;
        c.num_experts_per_tok = 8;
        c.n_group = 8;
        c.topk_group = 4;
        c.routed_scaling_factor = 2.5f;
        c.first_k_dense_replace = 3;
        set_yarn(&c, 40.0, 4096, 1.0, 1.0);
        c.fp8 = true;
        c.fp8_block[0] = c.fp8_block[1] = 128;
    } else {
        return pd_err_set(err, PD_ERR_NOTFOUND,
                          "unknown preset '%s' (tiny, tiny-v2, small, v2-lite, v3-layers)", name);
    }
    *cfg_p = c;
    return PD_OK;
}

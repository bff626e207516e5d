/* config.json bytes → pd_config_parse, then what pd_model_load derives from
 * an accepted config (fingerprint, softmax scale, the MoE layer map).
 * Property: an accepted config satisfies the consistency rules the forward
 * pass relies on. */
#include <stdint.h>
#include <string.h>

#include "fuzz_util.h"
#include "pd_model.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fz_quiet_logs();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (!text)
        return 0;
    memcpy(text, data, size);
    text[size] = 0;
    pd_model_config c;
    pd_err err = {{0}};
    pd_status st = pd_config_parse(text, "fuzz/config.json", &c, &err);
    free(text);
    if (st != PD_OK) {
        FZ_CHECK(err.msg[0] != 0, "status %s without a message", pd_status_str(st));
        return 0;
    }
    FZ_CHECK(c.hidden_size > 0 && c.num_hidden_layers > 0 && c.num_attention_heads > 0 &&
                 c.vocab_size > 0 && c.kv_lora_rank > 0 && c.v_head_dim > 0 &&
                 c.qk_rope_head_dim > 0 && c.qk_rope_head_dim % 2 == 0,
             "accepted a config with a non-positive dimension");
    FZ_CHECK(c.n_group >= 1 && c.topk_group >= 1 && c.moe_layer_freq >= 1, "group fields");
    FZ_CHECK(c.bos_token_id >= 0 && c.bos_token_id < c.vocab_size && c.eos_token_id >= 0 &&
                 c.eos_token_id < c.vocab_size,
             "bos/eos outside the vocabulary");
    if (c.n_routed_experts > 0)
        FZ_CHECK(c.num_experts_per_tok >= 1 && c.num_experts_per_tok <= c.n_routed_experts &&
                     c.n_routed_experts % c.n_group == 0 && c.topk_group <= c.n_group,
                 "inconsistent MoE fields accepted");
    FZ_CHECK(memchr(c.torch_dtype, 0, sizeof c.torch_dtype) != NULL, "torch_dtype unterminated");
    /* the sums of two dimensions the model loader forms (model/model.c) */
    volatile int qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    volatile int kv_a = c.kv_lora_rank + c.qk_rope_head_dim;
    volatile int kv_b = c.qk_nope_head_dim + c.v_head_dim;
    (void)qk, (void)kv_a, (void)kv_b;
    (void)pd_config_fingerprint(&c);
    (void)pd_config_softmax_scale(&c);
    int layers = c.num_hidden_layers < 256 ? c.num_hidden_layers : 256;
    for (int l = 0; l < layers; l++)
        (void)pd_config_layer_is_moe(&c, l);
    return 0;
}

/* pd_config_parse on hand-written config.json texts: what is refused and
 * why. Regression cases found by tests/fuzz/fuzz_config. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "pd_model.h"

/* The tiny preset's fields (`pdserve mkmodel --preset tiny`), with one
 * field replaced by %s when fmt is given. */
static const char *base_fields =
    "\"model_type\":\"deepseek_v3\",\"hidden_size\":64,\"num_hidden_layers\":2,"
    "\"num_attention_heads\":4,\"q_lora_rank\":32,\"kv_lora_rank\":16,"
    "\"qk_nope_head_dim\":16,\"qk_rope_head_dim\":8,\"v_head_dim\":16,"
    "\"intermediate_size\":128,\"moe_intermediate_size\":32,\"n_routed_experts\":8,"
    "\"n_shared_experts\":1,\"num_experts_per_tok\":2,\"n_group\":2,\"topk_group\":1,"
    "\"topk_method\":\"noaux_tc\",\"norm_topk_prob\":true,\"routed_scaling_factor\":2.5,"
    "\"first_k_dense_replace\":1,\"rms_norm_eps\":1e-6,\"rope_theta\":10000,"
    "\"max_position_embeddings\":4096,\"vocab_size\":1000";

static pd_status parse_with(const char *extra, pd_model_config *c, pd_err *err) {
    char text[4096];
    /* later duplicates are refused by JSON_REJECT_DUPLICATES, so the
     * override replaces the field in a copy of the base */
    snprintf(text, sizeof text, "{%s}", base_fields);
    if (extra) {
        char key[64];
        const char *colon = strchr(extra, ':');
        snprintf(key, sizeof key, "%.*s", (int)(colon - extra), extra);
        char *at = strstr(text, key);
        assert_non_null(at);
        char *end = at + strcspn(at, ",}");
        char rest[4096];
        snprintf(rest, sizeof rest, "%s", end);
        snprintf(at, sizeof text - (size_t)(at - text), "%s%s", extra, rest);
    }
    return pd_config_parse(text, "test/config.json", c, err);
}

static void test_base_accepted(void **state) {
    pd_model_config c;
    pd_err err = {{0}};
    assert_int_equal(parse_with(NULL, &c, &err), PD_OK);
    assert_int_equal(c.qk_nope_head_dim + c.qk_rope_head_dim, 24);
}

/* qk_nope_head_dim 2^31-1 was accepted; qk_nope + qk_rope then overflowed
 * int in pd_config_softmax_scale and in the model loader. */
static void test_huge_dims_refused(void **state) {
    static const char *const cases[] = {
        "\"qk_nope_head_dim\":2147483647", "\"qk_rope_head_dim\":2147483646",
        "\"kv_lora_rank\":2147483647",     "\"v_head_dim\":1048577",
        "\"hidden_size\":2147483647",      "\"num_attention_heads\":2147483647",
        "\"vocab_size\":2147483647",       "\"intermediate_size\":1048577",
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pd_model_config c;
        pd_err err = {{0}};
        assert_int_equal(parse_with(cases[i], &c, &err), PD_ERR_FORMAT);
        assert_non_null(strstr(err.msg, "above"));
    }
    pd_model_config c;
    pd_err err = {{0}};
    assert_int_equal(parse_with("\"vocab_size\":1048576", &c, &err), PD_OK);
}

/* quantization_config.weight_block_size: two integers in [1, 2^20]; a
 * value past int was truncated to another block size, a third element or
 * a float was ignored for 128 (helper-62's cases, session 21). */
static void test_fp8_block_size(void **state) {
    static const struct {
        const char *bs;
        int ok, b0, b1;
    } cases[] = {
        {"[128, 128]", 1, 128, 128},   {"[48, 40]", 1, 48, 40},      {"null", 1, 128, 128},
        {"[4294967424, 128]", 0, 0, 0}, {"[128, 128, 128]", 0, 0, 0}, {"[48.0, 40.0]", 0, 0, 0},
        {"[0, 128]", 0, 0, 0},          {"[128, -1]", 0, 0, 0},       {"[1048577, 1]", 0, 0, 0},
        {"\"128\"", 0, 0, 0},           {"[128]", 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[4096];
        snprintf(text, sizeof text, "{%s,\"quantization_config\":{\"quant_method\":\"fp8\",\"weight_block_size\":%s}}",
                 base_fields, cases[i].bs);
        pd_model_config c;
        pd_err err = {{0}};
        pd_status st = pd_config_parse(text, "test/config.json", &c, &err);
        if (cases[i].ok) {
            if (st != PD_OK)
                fail_msg("weight_block_size %s: refused: %s", cases[i].bs, err.msg);
            assert_true(c.fp8);
            assert_int_equal(c.fp8_block[0], cases[i].b0);
            assert_int_equal(c.fp8_block[1], cases[i].b1);
        } else {
            if (st != PD_ERR_FORMAT)
                fail_msg("weight_block_size %s: status %d, want a format error", cases[i].bs, (int)st);
            assert_non_null(strstr(err.msg, "weight_block_size"));
        }
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_base_accepted),
        cmocka_unit_test(test_huge_dims_refused),
        cmocka_unit_test(test_fp8_block_size),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* config.json of Hugging Face DeepSeek-V2 / V3 checkpoints.
 * Field meanings: transformers configuration_deepseek_v3.py / _v2.py. */
#include "pd_model.h"

#include <jansson.h>
#include <math.h>
#include <string.h>

/* Upper bound of every dimension field, so that a sum of two fits an int
 * and a product of two an int64. */
#define PD_CONFIG_MAX_DIM (1 << 20)

typedef struct {
    json_t *root;
    const char *path;
    pd_err *err;
    pd_status st;
} cfg_reader;

static json_t *field(cfg_reader *r, const char *name, bool required) {
    json_t *v = json_object_get(r->root, name);
    if (!v && required && r->st == PD_OK)
        r->st = pd_err_set(r->err, PD_ERR_NOTFOUND, "%s: missing required field '%s'", r->path, name);
    return v;
}

static int get_int(cfg_reader *r, const char *name, bool required, int dflt) {
    json_t *v = field(r, name, required);
    if (!v || json_is_null(v))
        return dflt;
    if (!json_is_integer(v)) {
        if (r->st == PD_OK)
            r->st = pd_err_set(r->err, PD_ERR_FORMAT, "%s: field '%s' must be an integer", r->path, name);
        return dflt;
    }
    json_int_t x = json_integer_value(v);
    if (x < 0 || x > 0x7fffffff) {
        if (r->st == PD_OK)
            r->st = pd_err_set(r->err, PD_ERR_FORMAT, "%s: field '%s' out of range (%lld)", r->path, name,
                               (long long)x);
        return dflt;
    }
    return (int)x;
}

static double get_num(cfg_reader *r, const char *name, bool required, double dflt) {
    json_t *v = field(r, name, required);
    if (!v || json_is_null(v))
        return dflt;
    if (!json_is_number(v)) {
        if (r->st == PD_OK)
            r->st = pd_err_set(r->err, PD_ERR_FORMAT, "%s: field '%s' must be a number", r->path, name);
        return dflt;
    }
    double x = json_number_value(v);
    if (!isfinite(x) && r->st == PD_OK)
        r->st = pd_err_set(r->err, PD_ERR_FORMAT, "%s: field '%s' is not finite", r->path, name);
    return x;
}

static bool get_bool(cfg_reader *r, const char *name, bool required, bool dflt) {
    json_t *v = field(r, name, required);
    if (!v || json_is_null(v))
        return dflt;
    if (!json_is_boolean(v)) {
        if (r->st == PD_OK)
            r->st = pd_err_set(r->err, PD_ERR_FORMAT, "%s: field '%s' must be a boolean", r->path, name);
        return dflt;
    }
    return json_is_true(v);
}

static const char *get_str(cfg_reader *r, json_t *obj, const char *name, bool required) {
    json_t *v = json_object_get(obj, name);
    if (!v || json_is_null(v)) {
        if (required && r->st == PD_OK)
            r->st = pd_err_set(r->err, PD_ERR_NOTFOUND, "%s: missing required field '%s'", r->path, name);
        return NULL;
    }
    if (!json_is_string(v)) {
        if (r->st == PD_OK)
            r->st = pd_err_set(r->err, PD_ERR_FORMAT, "%s: field '%s' must be a string", r->path, name);
        return NULL;
    }
    return json_string_value(v);
}

/* eos_token_id may be an int or a list of ints (first is used). */
static int get_token_id(cfg_reader *r, const char *name, int dflt) {
    json_t *v = json_object_get(r->root, name);
    if (json_is_array(v) && json_array_size(v) > 0)
        v = json_array_get(v, 0);
    if (!v || json_is_null(v))
        return dflt;
    if (!json_is_integer(v)) {
        if (r->st == PD_OK)
            r->st = pd_err_set(r->err, PD_ERR_FORMAT, "%s: field '%s' must be an integer", r->path, name);
        return dflt;
    }
    return (int)json_integer_value(v);
}

static void parse_rope_scaling(cfg_reader *r, pd_model_config *c) {
    json_t *rs = json_object_get(r->root, "rope_scaling");
    if (!rs || json_is_null(rs)) {
        /* transformers >= 5 writes rope_parameters instead */
        json_t *rp = json_object_get(r->root, "rope_parameters");
        if (rp && json_is_object(rp)) {
            json_t *t = json_object_get(rp, "rope_type");
            if (t && json_is_string(t) && strcmp(json_string_value(t), "default") != 0)
                rs = rp;
        }
    }
    c->has_yarn = false;
    if (!rs || json_is_null(rs))
        return;
    if (!json_is_object(rs)) {
        r->st = pd_err_set(r->err, PD_ERR_FORMAT, "%s: field 'rope_scaling' must be an object or null", r->path);
        return;
    }
    const char *type = get_str(r, rs, "type", false);
    if (!type)
        type = get_str(r, rs, "rope_type", false);
    if (!type) {
        if (r->st == PD_OK)
            r->st = pd_err_set(r->err, PD_ERR_NOTFOUND, "%s: missing required field 'rope_scaling.type'", r->path);
        return;
    }
    if (strcmp(type, "yarn") != 0) {
        r->st = pd_err_set(r->err, PD_ERR_UNSUPPORTED, "%s: rope_scaling type '%s' is not supported (yarn only)",
                           r->path, type);
        return;
    }
    cfg_reader sub = {rs, r->path, r->err, r->st};
    c->has_yarn = true;
    c->yarn_factor = get_num(&sub, "factor", true, 1.0);
    c->yarn_beta_fast = get_num(&sub, "beta_fast", false, 32.0);
    c->yarn_beta_slow = get_num(&sub, "beta_slow", false, 1.0);
    c->yarn_mscale = get_num(&sub, "mscale", false, 1.0);
    c->yarn_mscale_all_dim = get_num(&sub, "mscale_all_dim", false, 0.0);
    c->yarn_original_max_position_embeddings =
        get_int(&sub, "original_max_position_embeddings", true, 4096);
    r->st = sub.st;
}

pd_status pd_config_parse(const char *text, const char *path, pd_model_config *cfg_p, pd_err *err) {
    json_error_t jerr;
    json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return pd_err_set(err, PD_ERR_FORMAT, "%s: malformed JSON at line %d: %s", path, jerr.line, jerr.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return pd_err_set(err, PD_ERR_FORMAT, "%s: top level must be a JSON object", path);
    }
    cfg_reader r = {root, path, err, PD_OK};
    pd_model_config c;
    memset(&c, 0, sizeof c);
    const char *mt = get_str(&r, root, "model_type", true);
    if (mt) {
        if (!strcmp(mt, "deepseek_v3"))
            c.arch = PD_ARCH_DEEPSEEK_V3;
        else if (!strcmp(mt, "deepseek_v2"))
            c.arch = PD_ARCH_DEEPSEEK_V2;
        else
            r.st = pd_err_set(err, PD_ERR_UNSUPPORTED,
                              "%s: model_type '%s' is not supported (deepseek_v2, deepseek_v3)", path, mt);
    }
    bool v3 = c.arch == PD_ARCH_DEEPSEEK_V3;
    c.hidden_size = get_int(&r, "hidden_size", true, 0);
    c.num_hidden_layers = get_int(&r, "num_hidden_layers", true, 0);
    c.num_attention_heads = get_int(&r, "num_attention_heads", true, 0);
    c.q_lora_rank = get_int(&r, "q_lora_rank", true, 0); /* present, may be null */
    c.kv_lora_rank = get_int(&r, "kv_lora_rank", true, 0);
    c.qk_nope_head_dim = get_int(&r, "qk_nope_head_dim", true, 0);
    c.qk_rope_head_dim = get_int(&r, "qk_rope_head_dim", true, 0);
    c.v_head_dim = get_int(&r, "v_head_dim", true, 0);
    c.intermediate_size = get_int(&r, "intermediate_size", true, 0);
    c.moe_intermediate_size = get_int(&r, "moe_intermediate_size", true, 0);
    c.n_routed_experts = get_int(&r, "n_routed_experts", true, 0);
    c.n_shared_experts = get_int(&r, "n_shared_experts", true, 0);
    c.num_experts_per_tok = get_int(&r, "num_experts_per_tok", true, 0);
    c.n_group = get_int(&r, "n_group", v3, 1);
    c.topk_group = get_int(&r, "topk_group", v3, 1);
    if (c.n_group == 0) c.n_group = 1;
    if (c.topk_group == 0) c.topk_group = 1;
    const char *tm = get_str(&r, root, "topk_method", v3);
    if (!tm)
        tm = v3 ? "noaux_tc" : "greedy";
    if (!strcmp(tm, "greedy")) c.topk_method = PD_TOPK_GREEDY;
    else if (!strcmp(tm, "group_limited_greedy")) c.topk_method = PD_TOPK_GROUP_LIMITED_GREEDY;
    else if (!strcmp(tm, "noaux_tc")) c.topk_method = PD_TOPK_NOAUX_TC;
    else if (r.st == PD_OK)
        r.st = pd_err_set(err, PD_ERR_UNSUPPORTED, "%s: topk_method '%s' is not supported", path, tm);
    const char *sf = get_str(&r, root, "scoring_func", false);
    if (!sf)
        sf = v3 ? "sigmoid" : "softmax";
    if (!strcmp(sf, "softmax")) c.scoring_func = PD_SCORE_SOFTMAX;
    else if (!strcmp(sf, "sigmoid")) c.scoring_func = PD_SCORE_SIGMOID;
    else if (r.st == PD_OK)
        r.st = pd_err_set(err, PD_ERR_UNSUPPORTED, "%s: scoring_func '%s' is not supported", path, sf);
    c.norm_topk_prob = get_bool(&r, "norm_topk_prob", true, false);
    c.routed_scaling_factor = (float)get_num(&r, "routed_scaling_factor", true, 1.0);
    c.first_k_dense_replace = get_int(&r, "first_k_dense_replace", true, 0);
    c.moe_layer_freq = get_int(&r, "moe_layer_freq", false, 1);
    if (c.moe_layer_freq == 0) c.moe_layer_freq = 1;
    c.rms_norm_eps = (float)get_num(&r, "rms_norm_eps", true, 1e-6);
    c.rope_theta = get_num(&r, "rope_theta", false, -1.0);
    if (c.rope_theta < 0) {
        json_t *rp = json_object_get(root, "rope_parameters");
        json_t *th = rp ? json_object_get(rp, "rope_theta") : NULL;
        if (th && json_is_number(th))
            c.rope_theta = json_number_value(th);
        else if (r.st == PD_OK)
            r.st = pd_err_set(err, PD_ERR_NOTFOUND, "%s: missing required field 'rope_theta'", path);
    }
    if (r.st == PD_OK)
        parse_rope_scaling(&r, &c);
    c.max_position_embeddings = get_int(&r, "max_position_embeddings", true, 0);
    c.vocab_size = get_int(&r, "vocab_size", true, 0);
    c.bos_token_id = get_token_id(&r, "bos_token_id", 0);
    c.eos_token_id = get_token_id(&r, "eos_token_id", 1);
    c.tie_word_embeddings = get_bool(&r, "tie_word_embeddings", false, false);
    c.initializer_range = (float)get_num(&r, "initializer_range", false, 0.02);
    const char *td = get_str(&r, root, "torch_dtype", false);
    if (!td) td = get_str(&r, root, "dtype", false);
    snprintf(c.torch_dtype, sizeof c.torch_dtype, "%s", td ? td : "bfloat16");
    json_t *q = json_object_get(root, "quantization_config");
    if (q && !json_is_null(q) && r.st == PD_OK) {
        const char *qm = get_str(&r, q, "quant_method", true);
        if (qm && strcmp(qm, "fp8") != 0)
            r.st = pd_err_set(err, PD_ERR_UNSUPPORTED, "%s: quantization_config.quant_method '%s' is not supported (fp8)",
                              path, qm);
        json_t *bs = json_object_get(q, "weight_block_size");
        c.fp8 = true;
        c.fp8_block[0] = c.fp8_block[1] = 128;
        if (bs && !json_is_null(bs)) { /* absent: DeepSeek-V3's 128 x 128 */
            json_t *b0 = json_is_array(bs) && json_array_size(bs) == 2 ? json_array_get(bs, 0) : NULL;
            json_t *b1 = b0 ? json_array_get(bs, 1) : NULL;
            const json_int_t v0 = json_is_integer(b0) ? json_integer_value(b0) : 0;
            const json_int_t v1 = json_is_integer(b1) ? json_integer_value(b1) : 0;
            if (v0 <= 0 || v1 <= 0 || v0 > (1 << 20) || v1 > (1 << 20))
                r.st = pd_err_set(err, PD_ERR_FORMAT,
                                  "%s: quantization_config.weight_block_size must be two integers in [1, %d] "
                                  "(rows, columns of a scale block)",
                                  path, 1 << 20);
            else
                c.fp8_block[0] = (int)v0, c.fp8_block[1] = (int)v1;
        }
    }
    /* consistency */
    if (r.st == PD_OK) {
        if (c.hidden_size <= 0 || c.num_hidden_layers <= 0 || c.num_attention_heads <= 0 || c.vocab_size <= 0 ||
            c.kv_lora_rank <= 0 || c.qk_rope_head_dim <= 0 || (c.qk_rope_head_dim & 1) || c.v_head_dim <= 0)
            r.st = pd_err_set(err, PD_ERR_FORMAT,
                              "%s: hidden_size, num_hidden_layers, num_attention_heads, vocab_size, kv_lora_rank, "
                              "v_head_dim must be positive and qk_rope_head_dim positive and even",
                              path);
        /* found by tests/fuzz/fuzz_config: int sums of two dimensions
         * (qk_nope + qk_rope, kv_lora + qk_rope) overflowed downstream.
         * DeepSeek-V3's largest is vocab_size 129280. */
        else if (c.hidden_size > PD_CONFIG_MAX_DIM || c.num_hidden_layers > PD_CONFIG_MAX_DIM ||
                 c.num_attention_heads > PD_CONFIG_MAX_DIM || c.q_lora_rank > PD_CONFIG_MAX_DIM ||
                 c.kv_lora_rank > PD_CONFIG_MAX_DIM || c.qk_nope_head_dim > PD_CONFIG_MAX_DIM ||
                 c.qk_rope_head_dim > PD_CONFIG_MAX_DIM || c.v_head_dim > PD_CONFIG_MAX_DIM ||
                 c.intermediate_size > PD_CONFIG_MAX_DIM || c.moe_intermediate_size > PD_CONFIG_MAX_DIM ||
                 c.n_routed_experts > PD_CONFIG_MAX_DIM || c.n_shared_experts > PD_CONFIG_MAX_DIM ||
                 c.vocab_size > PD_CONFIG_MAX_DIM)
            r.st = pd_err_set(err, PD_ERR_FORMAT, "%s: a dimension (sizes, ranks, heads, layers, experts, "
                              "vocab_size) is above %d", path, PD_CONFIG_MAX_DIM);
        else if (c.n_routed_experts > 0 &&
                 (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.n_routed_experts ||
                  c.n_routed_experts % c.n_group != 0 || c.topk_group > c.n_group))
            r.st = pd_err_set(err, PD_ERR_FORMAT,
                              "%s: inconsistent MoE fields (n_routed_experts %d, num_experts_per_tok %d, n_group %d, "
                              "topk_group %d)",
                              path, c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group);
        else if (c.bos_token_id < 0 || c.bos_token_id >= c.vocab_size || c.eos_token_id < 0 ||
                 c.eos_token_id >= c.vocab_size)
            r.st = pd_err_set(err, PD_ERR_FORMAT, "%s: bos/eos token id outside vocab_size %d", path, c.vocab_size);
    }
    json_decref(root);
    if (r.st != PD_OK)
        return r.st;
    *cfg_p = c;
    return PD_OK;
}

pd_status pd_config_load(const char *path, pd_model_config *cfg_p, pd_err *err) {
    char *text = NULL;
    pd_status st = pd_file_read_all(path, &text, NULL, err);
    if (st != PD_OK)
        return st;
    st = pd_config_parse(text, path, cfg_p, err);
    free(text);
    return st;
}

bool pd_config_layer_is_moe(const pd_model_config *c, int layer) {
    return c->n_routed_experts > 0 && layer >= c->first_k_dense_replace && layer % c->moe_layer_freq == 0;
}

static double yarn_get_mscale(double scale, double mscale) {
    if (scale <= 1.0)
        return 1.0;
    return 0.1 * mscale * log(scale) + 1.0;
}

float pd_config_softmax_scale(const pd_model_config *c) {
    double s = 1.0 / sqrt((double)(c->qk_nope_head_dim + c->qk_rope_head_dim));
    if (c->has_yarn && c->yarn_mscale_all_dim != 0.0) {
        double m = yarn_get_mscale(c->yarn_factor, c->yarn_mscale_all_dim);
        s *= m * m;
    }
    return (float)s;
}

/* FNV-1a over n bytes, continuing from h. */
static uint64_t fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}

uint64_t pd_config_fingerprint(const pd_model_config *c) {
    int64_t f[] = {c->arch, c->hidden_size, c->num_hidden_layers, c->num_attention_heads, c->q_lora_rank,
                   c->kv_lora_rank, c->qk_nope_head_dim, c->qk_rope_head_dim, c->v_head_dim,
                   c->intermediate_size, c->moe_intermediate_size, c->n_routed_experts, c->n_shared_experts,
                   c->num_experts_per_tok, c->vocab_size, c->first_k_dense_replace};
    uint64_t h = fnv1a(1469598103934665603ull, f, sizeof f);
    /* and what changes the arithmetic without changing a shape (routing,
     * norms, rope, positions): two replicas that differ there would give
     * different text for the same request */
    int64_t g[] = {c->n_group, c->topk_group, c->moe_layer_freq, c->max_position_embeddings,
                   c->yarn_original_max_position_embeddings, c->has_yarn, c->bos_token_id, c->eos_token_id,
                   c->topk_method, c->scoring_func, c->norm_topk_prob, c->tie_word_embeddings};
    double d[] = {c->routed_scaling_factor, c->rms_norm_eps, c->rope_theta, c->yarn_factor, c->yarn_beta_fast,
                  c->yarn_beta_slow, c->yarn_mscale, c->yarn_mscale_all_dim};
    h = fnv1a(h, g, sizeof g);
    return fnv1a(h, d, sizeof d);
}

pd_status pd_config_save(const pd_model_config *c, const char *path, pd_err *err) {
    bool v3 = c->arch == PD_ARCH_DEEPSEEK_V3;
    json_t *o = json_object();
    json_object_set_new(o, "architectures", json_pack("[s]", v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM"));
    json_object_set_new(o, "model_type", json_string(v3 ? "deepseek_v3" : "deepseek_v2"));
    json_object_set_new(o, "hidden_size", json_integer(c->hidden_size));
    json_object_set_new(o, "num_hidden_layers", json_integer(c->num_hidden_layers));
    json_object_set_new(o, "num_attention_heads", json_integer(c->num_attention_heads));
    json_object_set_new(o, "num_key_value_heads", json_integer(c->num_attention_heads));
    json_object_set_new(o, "q_lora_rank", c->q_lora_rank ? json_integer(c->q_lora_rank) : json_null());
    json_object_set_new(o, "kv_lora_rank", json_integer(c->kv_lora_rank));
    json_object_set_new(o, "qk_nope_head_dim", json_integer(c->qk_nope_head_dim));
    json_object_set_new(o, "qk_rope_head_dim", json_integer(c->qk_rope_head_dim));
    json_object_set_new(o, "v_head_dim", json_integer(c->v_head_dim));
    json_object_set_new(o, "head_dim", json_integer(c->qk_rope_head_dim));
    json_object_set_new(o, "intermediate_size", json_integer(c->intermediate_size));
    json_object_set_new(o, "moe_intermediate_size", json_integer(c->moe_intermediate_size));
    json_object_set_new(o, "n_routed_experts", json_integer(c->n_routed_experts));
    json_object_set_new(o, "n_shared_experts", json_integer(c->n_shared_experts));
    json_object_set_new(o, "num_experts_per_tok", json_integer(c->num_experts_per_tok));
    json_object_set_new(o, "n_group", json_integer(c->n_group));
    json_object_set_new(o, "topk_group", json_integer(c->topk_group));
    static const char *tms[] = {"greedy", "group_limited_greedy", "noaux_tc"};
    json_object_set_new(o, "topk_method", json_string(tms[c->topk_method]));
    json_object_set_new(o, "scoring_func", json_string(c->scoring_func == PD_SCORE_SIGMOID ? "sigmoid" : "softmax"));
    json_object_set_new(o, "norm_topk_prob", json_boolean(c->norm_topk_prob));
    json_object_set_new(o, "routed_scaling_factor", json_real(c->routed_scaling_factor));
    json_object_set_new(o, "first_k_dense_replace", json_integer(c->first_k_dense_replace));
    json_object_set_new(o, "moe_layer_freq", json_integer(c->moe_layer_freq));
    json_object_set_new(o, "rms_norm_eps", json_real(c->rms_norm_eps));
    json_object_set_new(o, "rope_theta", json_real(c->rope_theta));
    if (c->has_yarn)
        json_object_set_new(o, "rope_scaling",
                            json_pack("{s:s, s:f, s:f, s:f, s:f, s:f, s:i}", "type", "yarn", "factor", c->yarn_factor,
                                      "beta_fast", c->yarn_beta_fast, "beta_slow", c->yarn_beta_slow, "mscale",
                                      c->yarn_mscale, "mscale_all_dim", c->yarn_mscale_all_dim,
                                      "original_max_position_embeddings", c->yarn_original_max_position_embeddings));
    else
        json_object_set_new(o, "rope_scaling", json_null());
    json_object_set_new(o, "rope_interleave", json_true());
    json_object_set_new(o, "max_position_embeddings", json_integer(c->max_position_embeddings));
    json_object_set_new(o, "vocab_size", json_integer(c->vocab_size));
    json_object_set_new(o, "bos_token_id", json_integer(c->bos_token_id));
    json_object_set_new(o, "eos_token_id", json_integer(c->eos_token_id));
    json_object_set_new(o, "tie_word_embeddings", json_boolean(c->tie_word_embeddings));
    json_object_set_new(o, "initializer_range", json_real(c->initializer_range));
    json_object_set_new(o, "hidden_act", json_string("silu"));
    json_object_set_new(o, "attention_bias", json_false());
    json_object_set_new(o, "attention_dropout", json_real(0.0));
    json_object_set_new(o, "use_cache", json_true());
    json_object_set_new(o, "torch_dtype", json_string(c->torch_dtype));
    if (c->fp8)
        json_object_set_new(o, "quantization_config",
                            json_pack("{s:s, s:s, s:s, s:[i,i]}", "quant_method", "fp8", "fmt", "e4m3",
                                      "activation_scheme", "dynamic", "weight_block_size", c->fp8_block[0],
                                      c->fp8_block[1]));
    int rc = json_dump_file(o, path, JSON_INDENT(2) | JSON_REAL_PRECISION(10));
    json_decref(o);
    if (rc != 0)
        return pd_err_set(err, PD_ERR_IO, "%s: cannot write", path);
    return PD_OK;
}

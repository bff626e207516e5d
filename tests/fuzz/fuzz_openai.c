/* Request body bytes → gw_oai_prepare (gateway/gw_openai.c), as a chat
 * completion and as a completion, with the DeepSeek-V3 tokenizer and a
 * 4096-token model. Properties: a refusal is a 4xx with a message (500 only
 * for a tokenizer failure); an accepted request satisfies everything the
 * engine and the replicas rely on (pd_gateway.h pd_gw_gen_params). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fuzz_util.h"
#include "gw_internal.h"
#include "pd_grammar.h"

static pd_gw_config g_cfg;
static const pd_tokenizer *g_tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fz_quiet_logs();
    g_tok = fz_tokenizer();
    pd_gw_config_defaults(&g_cfg);
    g_cfg.served_model_name = "test-model";
    g_cfg.max_model_len = 4096;
    g_cfg.vocab_size = 129280; /* the model's padded embedding, as `pdserve gateway` sets it */
    g_cfg.tokenizer_handle = g_tok;
    return 0;
}

static void check_ok(const gw_oai_req *r, gw_kind kind) {
    const pd_gw_config *c = &g_cfg;
    FZ_CHECK(r->kind == kind, "kind");
    FZ_CHECK(r->n >= 1 && r->n <= 128, "n = %d", r->n);
    FZ_CHECK(r->n_prompt >= 1 && r->prompt_ids, "n_prompt = %d", r->n_prompt);
    FZ_CHECK(r->max_tokens >= 1 && (int64_t)r->n_prompt + r->max_tokens <= c->max_model_len,
             "prompt %d + max_tokens %d past max_model_len %d", r->n_prompt, r->max_tokens,
             c->max_model_len);
    FZ_CHECK(r->min_tokens >= 0 && r->min_tokens <= r->max_tokens, "min_tokens %d (max %d)",
             r->min_tokens, r->max_tokens);
    for (int i = 0; i < r->n_prompt; i++)
        FZ_CHECK(r->prompt_ids[i] >= 0 && r->prompt_ids[i] < c->vocab_size, "prompt id %d",
                 r->prompt_ids[i]);
    FZ_CHECK(r->n_stop >= 0 && r->n_stop <= c->max_stop_strings, "n_stop %d", r->n_stop);
    for (int i = 0; i < r->n_stop; i++)
        FZ_CHECK(r->stop[i] && r->stop[i][0], "empty stop string %d", i);
    for (int i = 0; i < r->n_stop_token_ids; i++)
        FZ_CHECK(r->stop_token_ids[i] >= 0 && r->stop_token_ids[i] < c->vocab_size,
                 "stop_token_id %d", r->stop_token_ids[i]);
    FZ_CHECK(r->logprobs >= -1 && r->logprobs <= c->max_logprobs, "logprobs %d", r->logprobs);
    const pd_sampling_params *s = &r->sampling;
    FZ_CHECK(isfinite(s->temperature) && s->temperature >= 0 && s->temperature <= 2,
             "temperature %g", s->temperature);
    FZ_CHECK(s->top_p > 0 && s->top_p <= 1, "top_p %g", s->top_p);
    FZ_CHECK(s->top_k >= -1, "top_k %d", s->top_k);
    FZ_CHECK(s->min_p >= 0 && s->min_p <= 1, "min_p %g", s->min_p);
    FZ_CHECK(fabsf(s->presence_penalty) <= 2 && fabsf(s->frequency_penalty) <= 2, "penalties");
    FZ_CHECK(isfinite(s->repetition_penalty) && s->repetition_penalty > 0,
             "repetition_penalty %g", s->repetition_penalty);
    FZ_CHECK(s->n_logit_bias >= 0 && s->n_logit_bias <= PD_MAX_LOGIT_BIAS, "n_logit_bias %d", s->n_logit_bias);
    for (int i = 0; i < s->n_logit_bias; i++) {
        FZ_CHECK(s->logit_bias_ids[i] >= 0 && s->logit_bias_ids[i] < c->vocab_size, "logit_bias id %d",
                 s->logit_bias_ids[i]);
        FZ_CHECK(fabsf(s->logit_bias[i]) <= PD_MAX_LOGIT_BIAS_VALUE, "logit_bias %g", s->logit_bias[i]);
    }
    /* what the decode replica's sampler accepts (it refuses the request otherwise) */
    pd_sampler *smp = NULL;
    pd_err serr = {{0}};
    FZ_CHECK(pd_sampler_init(s, c->vocab_size, r->prompt_ids, r->n_prompt, &smp, &serr) == PD_OK,
             "sampler refuses: %s", serr.msg);
    pd_sampler_free(&smp);
    FZ_CHECK(!r->echo_only || (r->echo && kind == GW_KIND_COMPLETION), "max_tokens 0 without echo");
    FZ_CHECK(!r->include_usage || r->stream, "include_usage without stream");
    FZ_CHECK(!r->echo || kind == GW_KIND_COMPLETION, "echo on chat");
    FZ_CHECK(!r->echo || r->echo_text, "echo without text");
    if (r->json_schema) { /* what the replicas get compiles there too */
        pd_grammar *g = NULL;
        pd_err err = {{0}};
        FZ_CHECK(pd_grammar_compile(r->json_schema, strlen(r->json_schema), &g, &err) == PD_OK,
                 "json_schema %s: %s", r->json_schema, err.msg);
        pd_grammar_free(&g);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const gw_kind kinds[] = {GW_KIND_CHAT, GW_KIND_COMPLETION};
    for (int k = 0; k < 2; k++) {
        gw_oai_req r;
        gw_oai_err e;
        int rc = gw_oai_prepare(&g_cfg, g_tok, kinds[k], (const char *)data, size, &r, &e);
        if (rc == 0) {
            check_ok(&r, kinds[k]);
            gw_oai_req_clear(&r);
            continue;
        }
        FZ_CHECK(rc == -1, "rc %d", rc);
        FZ_CHECK(e.message[0], "refusal without a message");
        FZ_CHECK((e.status >= 400 && e.status < 500) ||
                     (e.status == 500 && !strncmp(e.message, "tokenization failed", 19)),
                 "status %d: %s", e.status, e.message);
        FZ_CHECK(r.prompt_ids == NULL && r.stop == NULL, "a refused request still owns memory");
    }
    return 0;
}

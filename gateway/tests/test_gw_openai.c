/* Unit tests of the OpenAI request validation (gw_oai_prepare: every rule of
 * the contract, status and `param`) and of the stop-string matcher. No
 * sockets; the real DeepSeek-V3 tokenizer. */
/* Single-source test (one executable per tests/test_*.c): the helpers are
 * compiled in here, first, because they define _GNU_SOURCE. */
#include "gw_test_util.c"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "gw_internal.h"
#include "pd_grammar.h"

static pd_gw_config g_cfg;

static void cfg_init(void) {
    pd_gw_config_defaults(&g_cfg);
    g_cfg.served_model_name = "test-model";
    g_cfg.max_model_len = 4096;
    g_cfg.vocab_size = pd_tok_vocab_size(gwt_tokenizer());
}

#define CHAT_MSGS "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]"

typedef struct {
    gw_kind kind;
    const char *body;
    int status;        /* 0: accepted */
    const char *param; /* expected param ("" = null) */
} vcase;

static const vcase cases[] = {
    /* body shape */
    {GW_KIND_CHAT, "{", 400, ""},
    {GW_KIND_CHAT, "[]", 400, ""},
    {GW_KIND_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]} trailing", 400, ""},
    {GW_KIND_CHAT, "{}", 400, "messages"},
    {GW_KIND_CHAT, "{\"messages\":null}", 400, "messages"},
    {GW_KIND_CHAT, "{\"messages\":[]}", 400, "messages"},
    {GW_KIND_CHAT, "{\"messages\":\"hi\"}", 400, "messages"},
    {GW_KIND_CHAT, "{\"messages\":[5]}", 400, "messages[0]"},
    {GW_KIND_CHAT, "{\"messages\":[{\"content\":\"hi\"}]}", 400, "messages[0].role"},
    {GW_KIND_CHAT, "{\"messages\":[{\"role\":\"robot\",\"content\":\"hi\"}]}", 400,
     "messages[0].role"},
    {GW_KIND_CHAT, "{\"messages\":[{\"role\":\"user\"}]}", 400, "messages[0].content"},
    {GW_KIND_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400,
     "messages[0].content"},
    {GW_KIND_CHAT,
     "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]}",
     400, "messages[0].content[0]"},
    {GW_KIND_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}", 400,
     "messages[0].content[0]"},
    {GW_KIND_CHAT,
     "{\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\",\"content\":"
     "[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]}]}",
     0, NULL},
    {GW_KIND_CHAT,
     "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\",\"content\":"
     "null,\"tool_calls\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":"
     "\"{}\"}}]},{\"role\":\"tool\",\"content\":\"r\"}]}",
     0, NULL},
    {GW_KIND_CHAT,
     "{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"function\":5}]}]}",
     400, "messages[0].tool_calls[0]"},
    {GW_KIND_CHAT, "{\"messages\":[{\"role\":\"developer\",\"content\":\"d\"}]}", 0, NULL},
    /* model */
    {GW_KIND_CHAT, "{\"model\":\"other\"," CHAT_MSGS "}", 404, "model"},
    {GW_KIND_CHAT, "{\"model\":5," CHAT_MSGS "}", 400, "model"},
    {GW_KIND_CHAT, "{\"model\":\"test-model\"," CHAT_MSGS "}", 0, NULL},
    {GW_KIND_CHAT, "{\"model\":null," CHAT_MSGS "}", 0, NULL},
    /* max_tokens */
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"max_tokens\":0}", 400, "max_tokens"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"max_tokens\":-1}", 400, "max_tokens"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"max_tokens\":\"5\"}", 400, "max_tokens"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"max_tokens\":1.5}", 400, "max_tokens"},
    /* found by tests/fuzz/fuzz_openai: prompt + max_tokens overflowed int64 */
    {GW_KIND_COMPLETION, "{\"prompt\":\"x\",\"max_tokens\":9223372036854775807}", 400,
     "max_tokens"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"max_completion_tokens\":9223372036854775807}", 400,
     "max_completion_tokens"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"max_tokens\":5.0}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"max_tokens\":null}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"max_completion_tokens\":0}", 400, "max_completion_tokens"},
    /* both given: max_completion_tokens is used, max_tokens still validated */
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"max_completion_tokens\":8,\"max_tokens\":-1}", 400, "max_tokens"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"max_completion_tokens\":8,\"max_tokens\":16}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"max_tokens\":5000}", 400, "max_tokens"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"max_tokens\":0}", 400, "max_tokens"},
    /* max_tokens 0: completions with echo only (the prompt alone) */
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"max_tokens\":0,\"echo\":true}", 0, NULL},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"max_tokens\":0,\"echo\":false}", 400, "max_tokens"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"max_tokens\":-1,\"echo\":true}", 400, "max_tokens"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"max_tokens\":0,\"echo\":true,\"min_tokens\":1}", 400,
     "min_tokens"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"max_tokens\":0,\"echo\":true}", 400, "max_tokens"},
    /* vLLM's prompt_logprobs: refused, not ignored */
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"prompt_logprobs\":1}", 400, "prompt_logprobs"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"prompt_logprobs\":0}", 400, "prompt_logprobs"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"prompt_logprobs\":null}", 0, NULL},
    /* completions' suffix and best_of: refused, not ignored (best_of 1 or n asks nothing more) */
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"suffix\":\"x\"}", 400, "suffix"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"suffix\":\"\"}", 0, NULL},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"suffix\":null}", 0, NULL},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"best_of\":2}", 400, "best_of"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"best_of\":2,\"n\":2}", 0, NULL},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"best_of\":1}", 0, NULL},
    /* vLLM's extensions that change the output and are not implemented:
     * refused; their values that ask for nothing are taken */
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"guided_choice\":[\"yes\",\"no\"]}", 400, "guided_choice"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"guided_json\":{\"type\":\"object\"}}", 400, "guided_json"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"guided_regex\":\"a+\"}", 400, "guided_regex"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"guided_grammar\":\"root ::= x\"}", 400, "guided_grammar"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"structured_outputs\":{\"choice\":[\"a\"]}}", 400, "structured_outputs"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"guided_json\":null}", 0, NULL},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"truncate_prompt_tokens\":2}", 400, "truncate_prompt_tokens"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"allowed_token_ids\":[1,2]}", 400, "allowed_token_ids"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"allowed_token_ids\":[]}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"bad_words\":[\"x\"]}", 400, "bad_words"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"use_beam_search\":true}", 400, "use_beam_search"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"use_beam_search\":false,\"length_penalty\":1.0}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"length_penalty\":0.5}", 400, "length_penalty"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"return_tokens_as_token_ids\":true}", 400,
     "return_tokens_as_token_ids"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"return_token_ids\":true}", 400, "return_token_ids"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"chat_template\":\"{{ messages }}\"}", 400, "chat_template"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stream\":true,\"stream_options\":{\"continuous_usage_stats\":true}}", 400,
     "stream_options.continuous_usage_stats"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stream\":true,\"stream_options\":{\"continuous_usage_stats\":false}}", 0,
     NULL},
    /* sampling */
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"temperature\":-0.1}", 400, "temperature"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"temperature\":2.01}", 400, "temperature"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"temperature\":\"1\"}", 400, "temperature"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"temperature\":1e400}", 400, ""},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"temperature\":0}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"temperature\":2}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"top_p\":0}", 400, "top_p"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"top_p\":1.01}", 400, "top_p"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"top_p\":1}", 0, NULL},
    /* in the open range as doubles, 0 as the replicas' 32-bit floats (a
     * walkthrough: the replica refused them after admission, 500 on the
     * long route); the smallest float subnormal is accepted */
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"top_p\":1e-46}", 400, "top_p"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"top_p\":1.5e-45}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"repetition_penalty\":1e-300}", 400, "repetition_penalty"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"repetition_penalty\":5e-324}", 400,
     "repetition_penalty"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"repetition_penalty\":1e-31}", 400, "repetition_penalty"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"repetition_penalty\":1e-30}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"top_k\":-2}", 400, "top_k"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"top_k\":-1}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"top_k\":0.5}", 400, "top_k"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"min_p\":-0.01}", 400, "min_p"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"min_p\":1.01}", 400, "min_p"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"min_p\":1}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"presence_penalty\":2.5}", 400, "presence_penalty"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"frequency_penalty\":-2.5}", 400, "frequency_penalty"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"frequency_penalty\":-2}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"repetition_penalty\":0}", 400, "repetition_penalty"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"n\":0}", 400, "n"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"n\":129}", 400, "n"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"n\":128}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"seed\":9223372036854775808}", 400, "seed"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"seed\":-9223372036854775809}", 400, "seed"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"seed\":9223372036854775807}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"seed\":1.5}", 400, "seed"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"seed\":\"1\"}", 400, "seed"},
    /* stop */
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stop\":\"\"}", 400, "stop"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stop\":[\"a\",\"\"]}", 400, "stop"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stop\":[1]}", 400, "stop"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stop\":5}", 400, "stop"},
    {GW_KIND_CHAT,
     "{" CHAT_MSGS ",\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\","
     "\"12\",\"13\",\"14\",\"15\",\"16\",\"17\"]}",
     400, "stop"},
    {GW_KIND_CHAT,
     "{" CHAT_MSGS ",\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\","
     "\"12\",\"13\",\"14\",\"15\",\"16\"]}",
     0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stop\":[]}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stop\":null}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stop_token_ids\":[-1]}", 400, "stop_token_ids"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stop_token_ids\":[999999999]}", 400, "stop_token_ids"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stop_token_ids\":1}", 400, "stop_token_ids"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stop_token_ids\":[1,2]}", 0, NULL},
    /* logit_bias */
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"5\":10}}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"5\":-100,\"6\":100,\"7\":0.5}}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{}}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":null}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":[5]}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":\"5\"}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"abc\":1}}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"5.0\":1}}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"\":1}}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"-1\":1}}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"999999999\":1}}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"99999999999999999999999\":1}}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"5\":100.5}}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"5\":-101}}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"5\":\"1\"}}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"5\":true}}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"5\":null}}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"5\":1,\"05\":2}}", 400, "logit_bias"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logit_bias\":{\"5\":1e400}}", 400, ""},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"logit_bias\":{\"5\":99999999999999999999}}", 400,
     "logit_bias"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"logit_bias\":{\"5\":1}}", 0, NULL},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"logit_bias\":{\"x\":1}}", 400, "logit_bias"},
    /* stream */
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stream\":\"yes\"}", 400, "stream"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stream_options\":{\"include_usage\":true}}", 400,
     "stream_options"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stream\":false,\"stream_options\":{}}", 400, "stream_options"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stream\":true,\"stream_options\":5}", 400, "stream_options"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stream\":true,\"stream_options\":{\"include_usage\":1}}", 400,
     "stream_options.include_usage"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stream\":true,\"stream_options\":{\"include_usage\":true}}", 0,
     NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"stream\":false,\"stream_options\":null}", 0, NULL},
    /* logprobs */
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"top_logprobs\":2}", 400, "top_logprobs"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logprobs\":false,\"top_logprobs\":2}", 400, "top_logprobs"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logprobs\":true,\"top_logprobs\":21}", 400, "top_logprobs"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logprobs\":true,\"top_logprobs\":-1}", 400, "top_logprobs"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logprobs\":1}", 400, "logprobs"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"logprobs\":true,\"top_logprobs\":20}", 0, NULL},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"logprobs\":21}", 400, "logprobs"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"logprobs\":true}", 400, "logprobs"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"logprobs\":5}", 0, NULL},
    /* min_tokens, flags */
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"min_tokens\":-1}", 400, "min_tokens"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"min_tokens\":10,\"max_tokens\":5}", 400, "min_tokens"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"min_tokens\":5,\"max_tokens\":5}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"ignore_eos\":\"x\"}", 400, "ignore_eos"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"skip_special_tokens\":0}", 400, "skip_special_tokens"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"continue_final_message\":true}", 400,
     "continue_final_message"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"echo\":\"x\"}", 400, "echo"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"include_stop_str_in_output\":\"yes\"}", 400,
     "include_stop_str_in_output"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"include_stop_str_in_output\":true}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"skip_special_tokens\":false}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"ignore_eos\":true,\"min_tokens\":3}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"add_generation_prompt\":1}", 400, "add_generation_prompt"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"presence_penalty\":-2.01}", 400, "presence_penalty"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"presence_penalty\":2}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"frequency_penalty\":2.01}", 400, "frequency_penalty"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"top_p\":-0.5}", 400, "top_p"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"top_k\":0}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"temperature\":null,\"top_p\":null,\"n\":null}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"n\":2.0}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"n\":\"2\"}", 400, "n"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"repetition_penalty\":-1}", 400, "repetition_penalty"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"min_p\":\"0.1\"}", 400, "min_p"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"stop_token_ids\":[1.5]}", 400, "stop_token_ids"},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"seed\":-1}", 0, NULL},
    /* unknown fields accepted */
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"user\":\"u\",\"foo\":{\"bar\":[1]},\"tools\":[]}", 0, NULL},
    /* completions prompt */
    {GW_KIND_COMPLETION, "{}", 400, "prompt"},
    {GW_KIND_COMPLETION, "{\"prompt\":5}", 400, "prompt"},
    {GW_KIND_COMPLETION, "{\"prompt\":[]}", 400, "prompt"},
    {GW_KIND_COMPLETION, "{\"prompt\":[-1]}", 400, "prompt"},
    {GW_KIND_COMPLETION, "{\"prompt\":[1,\"a\"]}", 400, "prompt"},
    {GW_KIND_COMPLETION, "{\"prompt\":[1,2.5]}", 400, "prompt"},
    {GW_KIND_COMPLETION, "{\"prompt\":[999999999]}", 400, "prompt"},
    {GW_KIND_COMPLETION, "{\"prompt\":[\"a\",\"b\"]}", 400, "prompt"},
    {GW_KIND_COMPLETION, "{\"prompt\":[[1],[2]]}", 400, "prompt"},
    {GW_KIND_COMPLETION, "{\"prompt\":[\"a\"]}", 0, NULL},
    {GW_KIND_COMPLETION, "{\"prompt\":[[1,2]]}", 0, NULL},
    {GW_KIND_COMPLETION, "{\"prompt\":[1,2,3]}", 0, NULL},
    {GW_KIND_COMPLETION, "{\"prompt\":\"\"}", 0, NULL},
    {GW_KIND_COMPLETION, "{\"prompt\":\"hi\",\"messages\":5}", 0, NULL},
    /* tools, tool_choice, reasoning (issue 9) */
#define TOOLS "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\"}}}]"
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"tools\":5}", 400, "tools"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"tools\":[5]}", 400, "tools[0]"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"tools\":[{\"type\":\"code\",\"function\":{\"name\":\"f\"}}]}", 400,
     "tools[0].type"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"tools\":[{\"type\":\"function\"}]}", 400, "tools[0].function"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"tools\":[{\"type\":\"function\",\"function\":{}}]}", 400,
     "tools[0].function.name"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a b\"}}]}",
     400, "tools[0].function.name"},
    {GW_KIND_CHAT,
     "{" CHAT_MSGS ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":"
     "\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"}}]}",
     400, "tools[0].function.name"}, /* 65 characters */
    {GW_KIND_CHAT,
     "{" CHAT_MSGS ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}},"
     "{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}",
     400, "tools[1].function.name"},
    {GW_KIND_CHAT,
     "{" CHAT_MSGS ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"description\":5}}]}",
     400, "tools[0].function.description"},
    {GW_KIND_CHAT,
     "{" CHAT_MSGS ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":[]}}]}",
     400, "tools[0].function.parameters"},
    {GW_KIND_CHAT, "{" CHAT_MSGS "," TOOLS ",\"tool_choice\":\"maybe\"}", 400, "tool_choice"},
    {GW_KIND_CHAT, "{" CHAT_MSGS "," TOOLS ",\"tool_choice\":5}", 400, "tool_choice"},
    {GW_KIND_CHAT,
     "{" CHAT_MSGS "," TOOLS ",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"nope\"}}}",
     400, "tool_choice"},
    {GW_KIND_CHAT, "{" CHAT_MSGS "," TOOLS ",\"tool_choice\":{\"type\":\"function\"}}", 400,
     "tool_choice"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"tool_choice\":\"auto\"}", 400, "tool_choice"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"tool_choice\":\"required\"}", 400, "tool_choice"},
    {GW_KIND_CHAT, "{" CHAT_MSGS "," TOOLS ",\"parallel_tool_calls\":\"yes\"}", 400,
     "parallel_tool_calls"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"reasoning_effort\":\"extreme\"}", 400, "reasoning_effort"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"reasoning_effort\":1}", 400, "reasoning_effort"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"chat_template_kwargs\":5}", 400, "chat_template_kwargs"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"chat_template_kwargs\":{\"thinking\":\"yes\"}}", 400,
     "chat_template_kwargs.thinking"},
    {GW_KIND_CHAT, "{" CHAT_MSGS "," TOOLS "}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS "," TOOLS ",\"tool_choice\":\"none\"}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS "," TOOLS ",\"tool_choice\":\"required\"}", 0, NULL},
    {GW_KIND_CHAT,
     "{" CHAT_MSGS "," TOOLS
     ",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}}",
     0, NULL},
    {GW_KIND_CHAT,
     "{" CHAT_MSGS "," TOOLS ",\"tool_choice\":\"required\",\"response_format\":{\"type\":\"json_object\"}}",
     400, "tool_choice"},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"tools\":null,\"tool_choice\":null}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"tool_choice\":\"none\"}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"reasoning_effort\":\"high\"}", 0, NULL},
    {GW_KIND_CHAT, "{" CHAT_MSGS ",\"chat_template_kwargs\":{\"thinking\":true}}", 0, NULL},
};

static void test_validation_table(void **state) {
    int failures = 0;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const vcase *c = &cases[i];
        gw_oai_req r;
        gw_oai_err e;
        int rc = gw_oai_prepare(&g_cfg, gwt_tokenizer(), c->kind, c->body, strlen(c->body), &r, &e);
        bool ok;
        if (c->status == 0)
            ok = rc == 0;
        else
            ok = rc != 0 && e.status == c->status && strcmp(e.param, c->param) == 0;
        if (!ok) {
            fprintf(stderr, "case %zu %s: want %d param '%s', got rc %d status %d param '%s': %s\n",
                    i, c->body, c->status, c->param ? c->param : "", rc, e.status, e.param,
                    e.message);
            failures++;
        }
        if (rc == 0)
            gw_oai_req_clear(&r);
    }
    assert_int_equal(failures, 0);
}

/* A refused number is reported as sent: the text after "got " reads back
 * as the request's value, however close it is to the bound; a logit_bias
 * key outside the vocabulary is quoted as sent. */
static void test_range_message_value(void **state) {
    static const struct {
        const char *field, *value;
    } vc[] = {{"top_p", "1.0000001"}, {"top_p", "1.000000000000001"}, {"temperature", "2.0000000001"},
              {"temperature", "-1e-300"}, {"min_p", "1.5"}, {"presence_penalty", "-2.0000003"}};
    for (size_t i = 0; i < sizeof vc / sizeof *vc; i++) {
        char body[200];
        snprintf(body, sizeof body, "{\"prompt\":\"hi\",\"max_tokens\":1,\"%s\":%s}", vc[i].field,
                 vc[i].value);
        gw_oai_req r;
        gw_oai_err e;
        assert_int_not_equal(
            gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
        assert_int_equal(e.status, 400);
        assert_string_equal(e.param, vc[i].field);
        const char *got = strstr(e.message, "got ");
        assert_non_null(got);
        assert_true(strtod(got + 4, NULL) == strtod(vc[i].value, NULL));
    }
    /* a logit_bias key past the vocabulary (past int64 too) is named as sent */
    static const char *const keys[] = {"99999999999999999999999999", "18446744073709551617", "999999999"};
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
        char body[200];
        snprintf(body, sizeof body, "{\"prompt\":\"hi\",\"logit_bias\":{\"%s\":1}}", keys[i]);
        gw_oai_req r;
        gw_oai_err e;
        assert_int_not_equal(
            gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
        assert_int_equal(e.status, 400);
        assert_string_equal(e.param, "logit_bias");
        char want[64];
        snprintf(want, sizeof want, "token id %s is outside", keys[i]);
        if (!strstr(e.message, want))
            fail_msg("logit_bias key %s: %s", keys[i], e.message);
    }
}

/* response_format: text (no constraint), json_object and json_schema (the
 * canonical schema for the replicas), and each refusal's param. */
static void test_response_format(void **state) {
    static const struct {
        const char *rf;
        const char *schema; /* NULL: none; "" with param: refused */
        const char *param;
    } rcases[] = {
        {"{\"type\":\"text\"}", NULL, NULL},
        {"null", NULL, NULL},
        {"{\"type\":\"json_object\"}", PD_GRAMMAR_JSON_OBJECT, NULL},
        {"{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p-1\",\"strict\":true,\"schema\":"
         "{\"type\": \"object\", \"properties\": {\"b\": {}, \"a\": {\"type\": \"integer\"}}}}}",
         "{\"type\":\"object\",\"properties\":{\"b\":{},\"a\":{\"type\":\"integer\"}}}", NULL},
        {"\"json_object\"", "", "response_format"},
        {"{}", "", "response_format.type"},
        {"{\"type\":\"yaml\"}", "", "response_format.type"},
        {"{\"type\":\"json_schema\"}", "", "response_format.json_schema"},
        {"{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{}}}", "",
         "response_format.json_schema.name"},
        {"{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"a b\",\"schema\":{}}}", "",
         "response_format.json_schema.name"},
        {"{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"a\",\"strict\":1,\"schema\":{}}}",
         "", "response_format.json_schema.strict"},
        {"{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"a\"}}", "",
         "response_format.json_schema.schema"},
        {"{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"a\",\"schema\":{\"format\":"
         "\"date\"}}}",
         "", "response_format.json_schema.schema"},
        /* thinking on: the constrained output would be the reasoning */
        {"{\"type\":\"json_object\"},\"chat_template_kwargs\":{\"thinking\":true}", "",
         "response_format"},
        {"{\"type\":\"json_object\"},\"chat_template_kwargs\":{\"thinking\":false}",
         PD_GRAMMAR_JSON_OBJECT, NULL},
    };
    for (size_t i = 0; i < sizeof rcases / sizeof *rcases; i++) {
        char body[1024];
        snprintf(body, sizeof body, "{" CHAT_MSGS ",\"response_format\":%s}", rcases[i].rf);
        gw_oai_req r;
        gw_oai_err e;
        int rc = gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_CHAT, body, strlen(body), &r, &e);
        if (rcases[i].param) {
            if (rc == 0 || e.status != 400 || strcmp(e.param, rcases[i].param) != 0)
                fail_msg("%s: want 400 %s, got rc %d %d %s: %s", rcases[i].rf, rcases[i].param, rc,
                         e.status, e.param, e.message);
            continue;
        }
        if (rc != 0)
            fail_msg("%s: refused: %s", rcases[i].rf, e.message);
        if (rcases[i].schema)
            assert_string_equal(r.json_schema, rcases[i].schema);
        else
            assert_null(r.json_schema);
        gw_oai_req_clear(&r);
    }
}

static void test_completion_prompt_ids(void **state) {
    const char *body = "{\"prompt\":\"Hello world\",\"max_tokens\":7,\"temperature\":0,"
                       "\"seed\":42,\"stop\":[\"x\",\"yz\"],\"n\":3,\"min_tokens\":2}";
    gw_oai_req r;
    gw_oai_err e;
    assert_int_equal(
        gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    int n = 0;
    int32_t *ids = gwt_ids_encode("Hello world", &n);
    assert_int_equal(r.n_prompt, n + 1);
    assert_int_equal(r.prompt_ids[0], pd_tok_find(gwt_tokenizer(), PD_TOK_DSV3_BOS));
    assert_memory_equal(r.prompt_ids + 1, ids, (size_t)n * sizeof *ids);
    assert_int_equal(r.max_tokens, 7);
    assert_int_equal(r.min_tokens, 2);
    assert_int_equal(r.n, 3);
    assert_true(r.sampling.temperature == 0.0f);
    assert_true(r.sampling.has_seed);
    assert_int_equal((int)r.sampling.seed, 42);
    assert_int_equal(r.n_stop, 2);
    assert_string_equal(r.stop[1], "yz");
    assert_int_equal(r.logprobs, -1);
    assert_true(r.skip_special);
    free(ids);
    gw_oai_req_clear(&r);
}

/* logit_bias reaches the sampling parameters as given (ids, biases, in the
 * body's order); the refusals name the id, the vocabulary size and the
 * limit. */
static void test_logit_bias(void **state) {
    const int V = g_cfg.vocab_size;
    char body[256];
    snprintf(body, sizeof body,
             "{\"prompt\":\"hi\",\"logit_bias\":{\"5\":10,\"%d\":-100,\"+7\":0.25,\"0\":100}}",
             V - 1);
    gw_oai_req r;
    gw_oai_err e;
    assert_int_equal(
        gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    const int32_t want_ids[4] = {5, V - 1, 7, 0};
    const float want_bias[4] = {10.0f, -100.0f, 0.25f, 100.0f};
    assert_int_equal(r.sampling.n_logit_bias, 4);
    assert_memory_equal(r.sampling.logit_bias_ids, want_ids, sizeof want_ids);
    assert_memory_equal(r.sampling.logit_bias, want_bias, sizeof want_bias);
    /* what the replicas do with it: a sampler accepts these parameters */
    pd_sampler *s = NULL;
    pd_err err;
    assert_int_equal(pd_sampler_init(&r.sampling, V, NULL, 0, &s, &err), PD_OK);
    pd_sampler_free(&s);
    gw_oai_req_clear(&r);

    /* out of the vocabulary: the id and the size in the message */
    snprintf(body, sizeof body, "{\"prompt\":\"hi\",\"logit_bias\":{\"%d\":1}}", V);
    assert_int_equal(
        gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), -1);
    char id[32], size[32];
    snprintf(id, sizeof id, "%d", V);
    snprintf(size, sizeof size, "size %d", V);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "logit_bias");
    if (!strstr(e.message, id) || !strstr(e.message, size))
        fail_msg("'%s' should name id %s and %s", e.message, id, size);

    /* a bias just past the range is reported as given, not rounded into
     * it ("got -100" for -100.0000001 read as a refused -100) */
    static const char *const past[] = {"-100.0000001", "100.00000000001", "1e+300"};
    for (size_t i = 0; i < sizeof past / sizeof *past; i++) {
        snprintf(body, sizeof body, "{\"prompt\":\"hi\",\"logit_bias\":{\"5\":%s}}", past[i]);
        assert_int_equal(
            gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), -1);
        assert_string_equal(e.param, "logit_bias");
        char got[48];
        snprintf(got, sizeof got, "got %s", past[i]);
        if (!strstr(e.message, got))
            fail_msg("'%s' should say '%s'", e.message, got);
    }

    /* the limit: PD_MAX_LOGIT_BIAS entries are accepted, one more is not */
    for (int extra = 0; extra < 2; extra++) {
        json_t *lb = json_object();
        for (int i = 0; i < PD_MAX_LOGIT_BIAS + extra; i++) {
            char k[16];
            snprintf(k, sizeof k, "%d", i);
            json_object_set_new(lb, k, json_real(-1.0));
        }
        json_t *root = json_pack("{s:s, s:o}", "prompt", "hi", "logit_bias", lb);
        char *text = json_dumps(root, JSON_COMPACT);
        json_decref(root);
        int rc = gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, text, strlen(text),
                                &r, &e);
        free(text);
        if (extra == 0) {
            assert_int_equal(rc, 0);
            assert_int_equal(r.sampling.n_logit_bias, PD_MAX_LOGIT_BIAS);
            gw_oai_req_clear(&r);
        } else {
            assert_int_equal(rc, -1);
            assert_string_equal(e.param, "logit_bias");
            char lim[16];
            snprintf(lim, sizeof lim, "%d", PD_MAX_LOGIT_BIAS);
            assert_non_null(strstr(e.message, lim));
        }
    }
}

/* ---- /tokenize, /detokenize ---------------------------------------------- */

/* The answer of gw_oai_tokenize for body, parsed; status 0: must succeed. */
static json_t *tok_call(gw_kind kind, const char *body, int want_status, const char *want_param) {
    char *resp = NULL;
    gw_oai_err e;
    int rc = gw_oai_tokenize(&g_cfg, gwt_tokenizer(), kind, body, strlen(body), &resp, &e);
    if (want_status == 0) {
        if (rc != 0)
            fail_msg("%s: refused %d %s: %s", body, e.status, e.param, e.message);
        json_t *j = json_loads(resp, 0, NULL);
        free(resp);
        assert_non_null(j);
        return j;
    }
    if (rc == 0 || e.status != want_status || strcmp(e.param, want_param) != 0)
        fail_msg("%s: want %d '%s', got rc %d %d '%s': %s", body, want_status, want_param, rc,
                 e.status, e.param, e.message);
    assert_null(resp);
    return NULL;
}

static json_t *tok_body(const char *key, json_t *value, const char *k2, json_t *v2) {
    json_t *o = json_object();
    json_object_set_new(o, key, value);
    if (k2)
        json_object_set_new(o, k2, v2);
    return o;
}

/* Properties, against the same tokenizer: tokenize gives the ids
 * gw_oai_prepare gives the same prompt (BOS first by default, none with
 * add_special_tokens false), count == len(tokens); detokenize(tokenize(x))
 * == x for plain text (and the BOS text + x with the BOS); token_strs are the
 * tokenizer's spellings. */
static void test_tokenize_roundtrip(void **state) {
    static const char *const texts[] = {"Hello world",
                                        "  leading and trailing  ",
                                        "Grüße, 世界! Ça va? 🎉 naïve — ok",
                                        "line\nbreak\ttab",
                                        "a",
                                        "1234567890 + 987654321 = ?"};
    const char *bos_text = PD_TOK_DSV3_BOS;
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
        for (int special = 0; special < 2; special++) {
            json_t *b =
                tok_body("prompt", json_string(texts[i]), special ? NULL : "add_special_tokens",
                         special ? NULL : json_false());
            json_object_set_new(b, "return_token_strs", json_true());
            char *body = json_dumps(b, 0);
            json_decref(b);
            json_t *a = tok_call(GW_KIND_TOKENIZE, body, 0, NULL);
            free(body);
            json_t *toks = json_object_get(a, "tokens");
            size_t n = json_array_size(toks);
            assert_int_equal(json_integer_value(json_object_get(a, "count")), (json_int_t)n);
            assert_int_equal(json_integer_value(json_object_get(a, "max_model_len")),
                             g_cfg.max_model_len);
            /* the generation path's ids for the same prompt */
            if (special) {
                json_t *pb = tok_body("prompt", json_string(texts[i]), NULL, NULL);
                char *pbody = json_dumps(pb, 0);
                json_decref(pb);
                gw_oai_req r;
                gw_oai_err e;
                assert_int_equal(gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, pbody,
                                                strlen(pbody), &r, &e),
                                 0);
                free(pbody);
                assert_int_equal(r.n_prompt, (int)n);
                for (int k = 0; k < r.n_prompt; k++)
                    assert_int_equal(json_integer_value(json_array_get(toks, (size_t)k)),
                                     r.prompt_ids[k]);
                gw_oai_req_clear(&r);
            } else {
                int m = 0;
                int32_t *ids = gwt_ids_encode(texts[i], &m);
                assert_int_equal((int)n, m);
                for (int k = 0; k < m; k++)
                    assert_int_equal(json_integer_value(json_array_get(toks, (size_t)k)), ids[k]);
                free(ids);
            }
            json_t *strs = json_object_get(a, "token_strs");
            assert_int_equal(json_array_size(strs), n);
            for (size_t k = 0; k < n; k++)
                assert_string_equal(
                    json_string_value(json_array_get(strs, k)),
                    pd_tok_token_text(gwt_tokenizer(),
                                      (int32_t)json_integer_value(json_array_get(toks, k))));
            /* back */
            json_t *db = tok_body("tokens", json_incref(toks), "model", json_string("test-model"));
            body = json_dumps(db, 0);
            json_decref(db);
            json_t *d = tok_call(GW_KIND_DETOKENIZE, body, 0, NULL);
            free(body);
            char want[256];
            snprintf(want, sizeof want, "%s%s", special ? bos_text : "", texts[i]);
            assert_string_equal(json_string_value(json_object_get(d, "prompt")), want);
            json_decref(d);
            json_decref(a);
        }
    }
    /* token_strs is null unless asked */
    json_t *a = tok_call(GW_KIND_TOKENIZE, "{\"prompt\":\"hi\"}", 0, NULL);
    assert_true(json_is_null(json_object_get(a, "token_strs")));
    json_decref(a);
    /* detokenize of nothing is "" */
    a = tok_call(GW_KIND_DETOKENIZE, "{\"tokens\":[]}", 0, NULL);
    assert_string_equal(json_string_value(json_object_get(a, "prompt")), "");
    json_decref(a);
}

/* Chat: the ids of the rendered conversation, as the chat endpoint would
 * prefill them (one BOS: the template's). */
static void test_tokenize_chat(void **state) {
    const char *msgs = "\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                       "{\"role\":\"user\",\"content\":\"Hi there\"}]";
    for (int add_gen = 0; add_gen < 2; add_gen++) {
        char body[512];
        snprintf(body, sizeof body, "{%s,\"add_generation_prompt\":%s}", msgs,
                 add_gen ? "true" : "false");
        json_t *a = tok_call(GW_KIND_TOKENIZE, body, 0, NULL);
        gw_oai_req r;
        gw_oai_err e;
        assert_int_equal(
            gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_CHAT, body, strlen(body), &r, &e), 0);
        json_t *toks = json_object_get(a, "tokens");
        assert_int_equal((int)json_array_size(toks), r.n_prompt);
        assert_int_equal(json_integer_value(json_object_get(a, "count")), r.n_prompt);
        for (int k = 0; k < r.n_prompt; k++)
            assert_int_equal(json_integer_value(json_array_get(toks, (size_t)k)), r.prompt_ids[k]);
        assert_int_equal(r.prompt_ids[0], pd_tok_find(gwt_tokenizer(), PD_TOK_DSV3_BOS));
        assert_int_not_equal(r.prompt_ids[1], r.prompt_ids[0]);
        gw_oai_req_clear(&r);
        json_decref(a);
    }
}

static void test_tokenize_errors(void **state) {
    char body[256];
    tok_call(GW_KIND_TOKENIZE, "{", 400, "");
    tok_call(GW_KIND_TOKENIZE, "[1]", 400, "");
    tok_call(GW_KIND_TOKENIZE, "{}", 400, "prompt");
    tok_call(GW_KIND_TOKENIZE, "{\"prompt\":5}", 400, "prompt");
    tok_call(GW_KIND_TOKENIZE, "{\"prompt\":[1,2]}", 400, "prompt");
    tok_call(GW_KIND_TOKENIZE, "{\"prompt\":\"x\",\"model\":\"other\"}", 404, "model");
    tok_call(GW_KIND_TOKENIZE, "{\"prompt\":\"x\",\"model\":7}", 400, "model");
    tok_call(GW_KIND_TOKENIZE, "{\"prompt\":\"x\",\"add_special_tokens\":1}", 400,
             "add_special_tokens");
    tok_call(GW_KIND_TOKENIZE, "{\"messages\":[]}", 400, "messages");
    tok_call(GW_KIND_TOKENIZE, "{\"messages\":[{\"role\":\"robot\",\"content\":\"x\"}]}", 400,
             "messages[0].role");
    tok_call(GW_KIND_DETOKENIZE, "{}", 400, "tokens");
    tok_call(GW_KIND_DETOKENIZE, "{\"tokens\":\"1 2\"}", 400, "tokens");
    tok_call(GW_KIND_DETOKENIZE, "{\"tokens\":[1,\"2\"]}", 400, "tokens");
    tok_call(GW_KIND_DETOKENIZE, "{\"tokens\":[1,-1]}", 400, "tokens");
    tok_call(GW_KIND_DETOKENIZE, "{\"tokens\":[1,99999999999999999999999]}", 400, "tokens");
    tok_call(GW_KIND_DETOKENIZE, "{\"tokens\":[1],\"model\":\"other\"}", 404, "model");
    /* the message names the id and the vocabulary size */
    snprintf(body, sizeof body, "{\"tokens\":[3,%d]}", g_cfg.vocab_size);
    char *resp = NULL;
    gw_oai_err e;
    assert_int_equal(
        gw_oai_tokenize(&g_cfg, gwt_tokenizer(), GW_KIND_DETOKENIZE, body, strlen(body), &resp, &e),
        -1);
    char id[48];
    snprintf(id, sizeof id, "= %d is outside the vocabulary (size %d", g_cfg.vocab_size,
             g_cfg.vocab_size);
    if (!strstr(e.message, id) || !strstr(e.message, "tokens[1]"))
        fail_msg("'%s' lacks '%s' / tokens[1]", e.message, id);
}

static void test_chat_rendered(void **state) {
    const char *body = "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                       "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hi\"},"
                       "{\"type\":\"text\",\"text\":\"there\"}]}],\"logprobs\":true,"
                       "\"top_logprobs\":3}";
    gw_oai_req r;
    gw_oai_err e;
    assert_int_equal(
        gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_CHAT, body, strlen(body), &r, &e), 0);
    pd_chat_message m[2] = {{.role = "system", .content = "Be brief."},
                            {.role = "user", .content = "Hi\nthere"}};
    char *text = NULL;
    pd_err err;
    assert_int_equal(pd_chat_render(m, 2, true, PD_TOK_DSV3_BOS, &text, &err), PD_OK);
    int n = 0;
    int32_t *ids = gwt_ids_encode(text, &n);
    assert_int_equal(r.n_prompt, n);
    assert_memory_equal(r.prompt_ids, ids, (size_t)n * sizeof *ids);
    assert_int_equal(r.prompt_ids[0], pd_tok_find(gwt_tokenizer(), PD_TOK_DSV3_BOS));
    /* default max_tokens: what is left of max_model_len */
    assert_int_equal(r.max_tokens, 4096 - n);
    assert_int_equal(r.logprobs, 3);
    free(ids);
    free(text);
    gw_oai_req_clear(&r);
}

/* Tools and thinking in the prompt: the V3 template with the tool section
 * after the system prompt and "<think>" after the generation prompt (the
 * texts of docs/api.md), and the output parser's start state. */
static void test_chat_tools_thinking_rendered(void **state) {
    const char *body =
        "{\"messages\":[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\",\"content\":\"Q\"}],"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
        "\"description\":\"Weather\",\"parameters\":{\"type\":\"object\",\"properties\":"
        "{\"city\":{\"type\":\"string\"}}}}}],\"chat_template_kwargs\":{\"thinking\":true}}";
    gw_oai_req r;
    gw_oai_err e;
    assert_int_equal(
        gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_CHAT, body, strlen(body), &r, &e), 0);
    char *want = NULL;
    pd_err err;
    pd_chat_tool t = {"get_weather", "Weather",
                      "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}"};
    char *section = NULL;
    assert_int_equal(pd_chat_tools_prompt(&t, 1, PD_CHAT_TOOLS_DEEPSEEK_V3, &section, &err), PD_OK);
    assert_int_equal(asprintf(&want, "%sS%s<｜User｜>Q<｜Assistant｜><think>", PD_TOK_DSV3_BOS,
                              section),
                     (int)(strlen(PD_TOK_DSV3_BOS) + strlen(section) + strlen("S<｜User｜>Q<｜Assistant｜><think>")));
    int n = 0;
    int32_t *ids = gwt_ids_encode(want, &n);
    assert_int_equal(r.n_prompt, n);
    assert_memory_equal(r.prompt_ids, ids, (size_t)n * sizeof *ids);
    assert_int_equal(r.think, PD_CHAT_THINK_ON);
    assert_true(r.parse_reasoning);
    assert_int_equal(r.tool_choice, GW_TOOLS_AUTO);
    assert_int_equal(r.n_tools, 1);
    assert_string_equal(r.tool_names[0], "get_weather");
    free(ids);
    free(want);
    free(section);
    gw_oai_req_clear(&r);

    /* reasoning_effort low: thinking off, "</think>" after the generation prompt */
    const char *low = "{\"messages\":[{\"role\":\"user\",\"content\":\"Q\"}],\"reasoning_effort\":\"low\"}";
    assert_int_equal(
        gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_CHAT, low, strlen(low), &r, &e), 0);
    ids = gwt_ids_encode(PD_TOK_DSV3_BOS "<｜User｜>Q<｜Assistant｜></think>", &n);
    assert_int_equal(r.n_prompt, n);
    assert_memory_equal(r.prompt_ids, ids, (size_t)n * sizeof *ids);
    assert_int_equal(r.think, PD_CHAT_THINK_OFF);
    assert_int_equal(r.tool_choice, GW_TOOLS_NONE);
    assert_null(r.json_schema);
    free(ids);
    gw_oai_req_clear(&r);

    /* named tool choice: decoding constrained by the function's parameters */
    const char *named = "{\"messages\":[{\"role\":\"user\",\"content\":\"Q\"}]," TOOLS
                        ",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":"
                        "\"get_weather\"}}}";
    int rc = gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_CHAT, named, strlen(named), &r, &e);
    if (rc)
        fprintf(stderr, "named: %d %s (%s)\n", e.status, e.message, e.param);
    assert_int_equal(rc, 0);
    assert_int_equal(r.tool_choice, GW_TOOLS_NAMED);
    assert_string_equal(r.tool_choice_name, "get_weather");
    pd_grammar *g = NULL;
    assert_int_equal(pd_grammar_compile("{\"type\":\"object\"}", 17, &g, &err), PD_OK);
    assert_non_null(r.json_schema);
    assert_string_equal(r.json_schema, pd_grammar_canonical(g));
    pd_grammar_free(&g);
    gw_oai_req_clear(&r);
}

static void test_length_limit_message(void **state) {
    pd_gw_config cfg = g_cfg;
    cfg.max_model_len = 10;
    const char *body = "{\"prompt\":[1,2,3,4],\"max_tokens\":7}";
    gw_oai_req r;
    gw_oai_err e;
    assert_int_not_equal(
        gw_oai_prepare(&cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "max_tokens");
    assert_non_null(strstr(e.message, "10 tokens"));            /* the limit */
    assert_non_null(strstr(e.message, "4 in the prompt"));      /* the prompt length */
    assert_non_null(strstr(e.message, "7 for the completion")); /* max_tokens */
    /* exactly at the limit is fine */
    body = "{\"prompt\":[1,2,3,4],\"max_tokens\":6}";
    assert_int_equal(
        gw_oai_prepare(&cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    gw_oai_req_clear(&r);
    /* a prompt that fills the context on its own: no max_tokens can help,
     * with max_tokens given or not, so the prompt is named (with its length
     * and the limit), as vLLM does */
    const char *fill[] = {"{\"prompt\":[1,2,3,4,5,6,7,8,9,10]}",
                          "{\"prompt\":[1,2,3,4,5,6,7,8,9,10],\"max_tokens\":2}",
                          "{\"prompt\":[1,2,3,4,5,6,7,8,9,10,11,12],\"max_tokens\":1}",
                          "{\"prompt\":[1,2,3,4,5,6,7,8,9,10],\"max_tokens\":0,\"echo\":true}"};
    for (size_t i = 0; i < sizeof fill / sizeof fill[0]; i++) {
        assert_int_not_equal(gw_oai_prepare(&cfg, gwt_tokenizer(), GW_KIND_COMPLETION, fill[i],
                                            strlen(fill[i]), &r, &e),
                             0);
        assert_int_equal(e.status, 400);
        assert_string_equal(e.param, "prompt");
        assert_non_null(strstr(e.message, "maximum context length is 10 tokens"));
        char has[64];
        snprintf(has, sizeof has, "your prompt has %d tokens", i == 2 ? 12 : 10);
        assert_non_null(strstr(e.message, has));
    }
    /* the largest max_tokens: the total named exactly (it was capped at
     * INT64_MAX, so the sum was wrong: helper-50) */
    body = "{\"prompt\":[1,2],\"max_tokens\":9223372036854775807}";
    assert_int_not_equal(
        gw_oai_prepare(&cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    assert_int_equal(e.status, 400);
    assert_non_null(strstr(e.message, "requested 9223372036854775809 tokens (2 in the prompt, "
                                      "9223372036854775807 for the completion"));
    /* chat: the rendered messages; max_tokens or max_completion_tokens named
     * only when the messages fit */
    cfg.max_model_len = 4;
    body = "{\"messages\":[{\"role\":\"user\",\"content\":\"hello there, how are you\"}],"
           "\"max_tokens\":2}";
    assert_int_not_equal(
        gw_oai_prepare(&cfg, gwt_tokenizer(), GW_KIND_CHAT, body, strlen(body), &r, &e), 0);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "messages");
    assert_non_null(strstr(e.message, "maximum context length is 4 tokens"));
    assert_non_null(strstr(e.message, "your messages have"));
    cfg.max_model_len = 1000;
    body = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_completion_tokens\":1000}";
    assert_int_not_equal(
        gw_oai_prepare(&cfg, gwt_tokenizer(), GW_KIND_CHAT, body, strlen(body), &r, &e), 0);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "max_completion_tokens");
    assert_non_null(strstr(e.message, "for the completion: max_completion_tokens"));
    cfg.max_model_len = 10;
    /* default max_tokens clamps to what is left */
    cfg.default_max_tokens = 100;
    body = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    assert_int_equal(
        gw_oai_prepare(&cfg, gwt_tokenizer(), GW_KIND_CHAT, body, strlen(body), &r, &e), 0);
    assert_int_equal(r.max_tokens, 10 - r.n_prompt);
    gw_oai_req_clear(&r);
    cfg.default_max_tokens = 3; /* chat: the server's default, below what is left */
    assert_int_equal(
        gw_oai_prepare(&cfg, gwt_tokenizer(), GW_KIND_CHAT, body, strlen(body), &r, &e), 0);
    assert_int_equal(r.max_tokens, 3);
    gw_oai_req_clear(&r);
    /* completions: 16 (OpenAI's and vLLM's default), or what is left when less */
    cfg.default_max_tokens = 0;
    body = "{\"prompt\":[1,2,3,4]}";
    assert_int_equal(
        gw_oai_prepare(&cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    assert_int_equal(r.max_tokens, 6);
    gw_oai_req_clear(&r);
    cfg.max_model_len = 4096;
    assert_int_equal(
        gw_oai_prepare(&cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    assert_int_equal(r.max_tokens, 16);
    gw_oai_req_clear(&r);
}

/* \u0000 in a string is valid JSON that the gateway does not take: a 400
 * that says so and where, not "malformed JSON" (a walkthrough found
 * jansson's own text, naming its flag JSON_ALLOW_NUL). Real syntax errors
 * still say malformed. */
static void test_nul_in_string(void **state) {
    (void)state;
    gw_oai_req r;
    gw_oai_err e;
    const char *body = "{\"prompt\":\"a\\u0000b\"}";
    assert_int_not_equal(
        gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "");
    assert_non_null(strstr(e.message, "U+0000"));
    assert_non_null(strstr(e.message, "line 1, column"));
    assert_null(strstr(e.message, "malformed"));
    body = "{\"prompt\":\"a\",\"x\\u0000\":1}"; /* in a key too */
    assert_int_not_equal(
        gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    assert_int_equal(e.status, 400);
    assert_non_null(strstr(e.message, "U+0000"));
    body = "{\"prompt\":\"a\"";
    assert_int_not_equal(
        gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    assert_int_equal(e.status, 400);
    assert_non_null(strstr(e.message, "malformed JSON"));
}

/* A text longer than --max-model-len × the longest token (in bytes) is
 * refused before it is encoded; the bound is tight, so a text that fits is
 * never refused by it. "." × 128 is one DeepSeek-V3 token, the longest. */
static void test_length_bound_before_encoding(void **state) {
    pd_gw_config cfg = g_cfg;
    cfg.max_model_len = 5;
    size_t m = pd_tok_max_token_bytes(gwt_tokenizer());
    assert_int_equal(m, 128);
    gw_oai_req r;
    gw_oai_err e;
    for (int k = 3; k <= 5; k++) {
        size_t len = (size_t)k * m;
        char *body = malloc(len + 64);
        int off = snprintf(body, 64, "{\"prompt\":\"");
        memset(body + off, '.', len);
        snprintf(body + off + len, 64, "\"}");
        int rc = gw_oai_prepare(&cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e);
        if (k == 3) { /* BOS + 3 tokens: one left for the completion */
            assert_int_equal(rc, 0);
            assert_int_equal(r.n_prompt, 4);
            assert_int_equal(r.max_tokens, 1);
            gw_oai_req_clear(&r);
        } else if (k == 4) { /* BOS + 4 = 5 tokens: encoded, then refused */
            assert_int_not_equal(rc, 0);
            assert_int_equal(e.status, 400);
            assert_string_equal(e.param, "prompt");
            assert_non_null(strstr(e.message, "your prompt has 5 tokens"));
        } else { /* 640 bytes / 128 >= 5: refused unencoded */
            assert_int_not_equal(rc, 0);
            assert_int_equal(e.status, 400);
            assert_string_equal(e.param, "prompt");
            assert_non_null(strstr(e.message, "maximum context length is 5 tokens"));
            assert_non_null(strstr(e.message, "at least 5 tokens"));
        }
        free(body);
    }
    /* chat: the rendered text counts; an 8 MB message at the default limit */
    size_t big = 8u << 20;
    char *body = malloc(big + 128);
    int off = snprintf(body, 128, "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    memset(body + off, 'x', big);
    snprintf(body + off + big, 128, "\"}]}");
    double t0 = pd_now_s();
    assert_int_not_equal(
        gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_CHAT, body, strlen(body), &r, &e), 0);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "messages");
    assert_non_null(strstr(e.message, "at least"));
    print_message("8 MB message refused in %.3f s\n", pd_now_s() - t0);
    free(body);
}

static void test_echo_ids(void **state) {
    int n = 0;
    int32_t *ids = gwt_ids_encode("héllo", &n);
    char body[512];
    int off = snprintf(body, sizeof body, "{\"echo\":true,\"prompt\":[");
    for (int i = 0; i < n; i++)
        off += snprintf(body + off, sizeof body - (size_t)off, "%s%d", i ? "," : "", ids[i]);
    snprintf(body + off, sizeof body - (size_t)off, "]}");
    gw_oai_req r;
    gw_oai_err e;
    assert_int_equal(
        gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    assert_true(r.echo);
    assert_string_equal(r.echo_text, "héllo");
    free(ids);
    gw_oai_req_clear(&r);
}

/* echo with max_tokens 0: the engine is asked for one token (dropped); the
 * text prompt's BOS is flagged for text_offset; ids are flagged. */
static void test_echo_only(void **state) {
    const char *body = "{\"echo\":true,\"prompt\":\"hello\",\"max_tokens\":0,\"logprobs\":2}";
    gw_oai_req r;
    gw_oai_err e;
    assert_int_equal(gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    assert_true(r.echo && r.echo_only);
    assert_int_equal(r.max_tokens, 1);
    assert_int_equal(r.logprobs, 2);
    assert_true(r.prompt_bos_added && !r.prompt_from_ids);
    gw_oai_req_clear(&r);
    body = "{\"echo\":true,\"prompt\":[5,6],\"max_tokens\":3}";
    assert_int_equal(gw_oai_prepare(&g_cfg, gwt_tokenizer(), GW_KIND_COMPLETION, body, strlen(body), &r, &e), 0);
    assert_true(r.echo && !r.echo_only && r.prompt_from_ids && !r.prompt_bos_added);
    assert_int_equal(r.max_tokens, 3);
    gw_oai_req_clear(&r);
}

/* ---- stop strings ------------------------------------------------------- */

typedef struct {
    gw_stopbuf sb;
    char out[256];
    size_t n;
} stop_run;

static int feed(stop_run *s, const char *piece, char *const *stops, int n_stops, bool incl,
                bool final) {
    size_t emit = 0;
    int m = gw_stop_feed(&s->sb, piece, strlen(piece), stops, n_stops, incl, final, &emit);
    memcpy(s->out + s->n, s->sb.buf, emit);
    s->n += emit;
    s->out[s->n] = 0;
    gw_stopbuf_consume(&s->sb, m >= 0 ? s->sb.len : emit);
    return m;
}

static void test_stop_hold_and_release(void **state) {
    char *stops[] = {"lo!"};
    stop_run s = {0};
    assert_int_equal(feed(&s, "Hel", stops, 1, false, false), -1);
    assert_string_equal(s.out, "He"); /* "l" may start "lo!" */
    assert_int_equal(feed(&s, "o", stops, 1, false, false), -1);
    assert_string_equal(s.out, "He"); /* "lo" held */
    assert_int_equal(feed(&s, "x", stops, 1, false, false), -1);
    assert_string_equal(s.out, "Helox");
    assert_int_equal(feed(&s, "l", stops, 1, false, false), -1);
    assert_int_equal(feed(&s, "", stops, 1, false, true), -1); /* final: release */
    assert_string_equal(s.out, "Heloxl");
    gw_stopbuf_free(&s.sb);
}

static void test_stop_across_pieces(void **state) {
    char *stops[] = {"STOP", "never"};
    stop_run s = {0};
    const char *pieces[] = {"ab", "cS", "T", "OPz"};
    int m = -1;
    for (int i = 0; i < 4 && m < 0; i++)
        m = feed(&s, pieces[i], stops, 2, false, false);
    assert_int_equal(m, 0);
    assert_string_equal(s.out, "abc");
    gw_stopbuf_free(&s.sb);
    /* include_stop_str_in_output */
    stop_run t = {0};
    m = -1;
    for (int i = 0; i < 4 && m < 0; i++)
        m = feed(&t, pieces[i], stops, 2, true, false);
    assert_int_equal(m, 0);
    assert_string_equal(t.out, "abcSTOP");
    gw_stopbuf_free(&t.sb);
}

static void test_stop_earliest_wins(void **state) {
    char *stops[] = {"world", "lo w"};
    stop_run s = {0};
    assert_int_equal(feed(&s, "hello world", stops, 2, false, false), 1);
    assert_string_equal(s.out, "hel");
    gw_stopbuf_free(&s.sb);
}

static void test_stop_utf8_boundaries(void **state) {
    char *stops[] = {"é!"};
    stop_run s = {0};
    assert_int_equal(feed(&s, "caf", stops, 1, false, false), -1);
    assert_int_equal(feed(&s, "é", stops, 1, false, false), -1);
    assert_string_equal(s.out, "caf"); /* the whole "é" is held, never half of it */
    assert_int_equal(feed(&s, "?", stops, 1, false, false), -1);
    assert_string_equal(s.out, "café?");
    assert_true(pd_tok_utf8_valid(s.out, s.n));
    assert_int_equal(feed(&s, "é!", stops, 1, false, false), 0);
    assert_string_equal(s.out, "café?");
    gw_stopbuf_free(&s.sb);
}

int main(void) {
    if (!gwt_tokenizer()) {
        fprintf(stderr, "no tokenizer: set PD_CACHE_DIR\n");
        return 1;
    }
    cfg_init();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_validation_table),
        cmocka_unit_test(test_response_format),
        cmocka_unit_test(test_completion_prompt_ids),
        cmocka_unit_test(test_logit_bias),
        cmocka_unit_test(test_tokenize_roundtrip),
        cmocka_unit_test(test_tokenize_chat),
        cmocka_unit_test(test_tokenize_errors),
        cmocka_unit_test(test_chat_rendered),
        cmocka_unit_test(test_chat_tools_thinking_rendered),
        cmocka_unit_test(test_length_limit_message),
        cmocka_unit_test(test_length_bound_before_encoding),
        cmocka_unit_test(test_nul_in_string),
        cmocka_unit_test(test_range_message_value),
        cmocka_unit_test(test_echo_ids),
        cmocka_unit_test(test_echo_only),
        cmocka_unit_test(test_stop_hold_and_release),
        cmocka_unit_test(test_stop_across_pieces),
        cmocka_unit_test(test_stop_earliest_wins),
        cmocka_unit_test(test_stop_utf8_boundaries),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

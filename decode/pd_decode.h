/* decode/ — the decode replica: a continuous-batching scheduler over the
 * model (pd_sched_*), and the service around it (pd_decode_main) that talks
 * to the gateway over ZeroMQ and receives prompt KV over UCX.
 *
 * Scheduling (vLLM-style continuous batching with chunked prefill): every
 * step runs one forward over a batch made of (a) one token for each running
 * sequence, up to max_num_seqs, then (b) prefill chunks of waiting prompts
 * while the step's token budget max_num_batched_tokens lasts. A sequence
 * whose prompt KV comes from a prefill replica holds a reservation of
 * blocks and joins the running set when its KV is complete.
 */
#ifndef PD_DECODE_H
#define PD_DECODE_H

#include <stdbool.h>
#include <stdint.h>

#include "pd_common.h"
#include "pd_grammar.h"
#include "pd_model.h"

typedef struct {
    int max_num_seqs;           /* running sequences per step (vLLM --max-num-seqs) */
    int max_num_batched_tokens; /* tokens per step (vLLM --max-num-batched-tokens) */
    int chunked_prefill_size;   /* longest prefill chunk of one sequence per step */
    int block_size;             /* KV cache block, tokens */
    int num_blocks;             /* KV cache blocks */
    /* testing (--debug-replay-tokens): when not NULL, requests generate
     * a script of it instead of samples (see pd_replay_script) */
    const struct pd_replay *replay;
} pd_sched_config;

/** Scripted output for tests (--debug-replay-tokens FILE on decode and
 * prefill replicas): FILE is a JSON array of token ids, or an array of
 * such arrays (scripts). A request with a seed s generates script
 * s mod n_scripts (without a seed, script 0): its i-th generated token is
 * script[i] instead of a sample, then EOS. Logprobs stay the model's for
 * the position (not meaningful then). */
typedef struct pd_replay {
    int n_scripts;
    int32_t **tokens; /* [n_scripts][n_tokens[i]] */
    int *n_tokens;
} pd_replay;

/** Reads FILE (ids in [0, vocab_size)). *r_p (free with pd_replay_free)
 * set on success. Errors: PD_ERR_IO (unreadable or not JSON),
 * PD_ERR_FORMAT (not the shape above; err names the element),
 * PD_ERR_NOMEM. */
pd_status pd_replay_load(const char *path, int vocab_size, pd_replay **r_p, pd_err *err);
void pd_replay_free(pd_replay **r_p);

/** The script of a request with sampling params sp; *n_p its length. */
const int32_t *pd_replay_script(const pd_replay *r, const pd_sampling_params *sp, int *n_p);

/** What a request asks of the scheduler. Arrays are copied. */
typedef struct {
    const char *request_id;
    const int32_t *prompt_ids;
    int n_prompt;
    pd_sampling_params sampling;
    int max_tokens, min_tokens;
    bool ignore_eos;
    const int32_t *stop_token_ids;
    int n_stop_token_ids;
    bool want_logprobs; /* report the sampled token's logprob */
    int top_logprobs;   /* with want_logprobs: also the this many most likely tokens,
                           0..PD_MAX_TOP_LOGPROBS (OpenAI top_logprobs) */
    const char *json_schema; /* NULL or "": unconstrained; else constrained decoding by this
                                JSON Schema (grammar/pd_grammar.h; needs a vocab, see
                                pd_sched_set_grammar_vocab) */
    bool want_prompt_logprobs; /* report every prompt token's logprob from the second on
                                  (on_prompt_logprobs) while this scheduler prefills the
                                  prompt; ignored by pd_sched_add_prefilled */
    int prompt_top_logprobs;   /* with want_prompt_logprobs: this many alternatives per prompt
                                  token, 0..PD_MAX_TOP_LOGPROBS */
} pd_sched_request;

/** Events the scheduler reports after a step, in order. token events come
 * one per generated token; finished follows the last token of a request
 * (finish_reason "stop" or "length"); error ends a request that cannot run.
 * on_token: logprob is the log softmax of the model's logits at token
 * (before penalties and temperature, after the min_tokens mask of EOS and
 * stop ids; 0 unless want_logprobs); top_ids /
 * top_logprobs hold the n_top most likely tokens under the same log
 * softmax, best first, ties to the lower id (n_top = min(top_logprobs,
 * vocab), 0 when not asked); all borrowed for the call. */
typedef struct {
    void (*on_token)(void *user, const char *request_id, int32_t token, float logprob,
                     const int32_t *top_ids, const float *top_logprobs, int n_top);
    void (*on_finished)(void *user, const char *request_id, const char *finish_reason);
    void (*on_error)(void *user, const char *request_id, const char *message);
    /* Prompt logprobs (want_prompt_logprobs), one call per prefill chunk, in
     * order, each before the request's first on_token: logprobs[i] is the
     * log softmax of the model's raw logits at prompt position first + i - 1
     * taken at the prompt token of position first + i (first >= 1; as
     * on_token's logprob, without any mask or penalty); top_ids[i * n_top + j]
     * / top_logprobs[i * n_top + j] the n_top most likely tokens there, best
     * first, ties to the lower id. Borrowed for the call. A position is
     * reported once, also when a preempted request prefills again. May be
     * NULL (then nothing is computed). */
    void (*on_prompt_logprobs)(void *user, const char *request_id, int first, int n, const float *logprobs,
                               const int32_t *top_ids, const float *top_logprobs, int n_top);
} pd_sched_callbacks;

typedef struct pd_sched pd_sched;

/** Creates a scheduler over m (borrowed) with its own KV cache.
 * Errors: PD_ERR_INVALID (non-positive sizes), PD_ERR_NOMEM. */
pd_status pd_sched_init(pd_model *m, const pd_sched_config *cfg, const pd_sched_callbacks *cb, void *user,
                        pd_sched **s_p, pd_err *err);
void pd_sched_free(pd_sched **s_p);

/** The vocabulary constrained requests are masked with (borrowed: it must
 * outlive the scheduler). Until it is set, a request with a json_schema is
 * refused. */
void pd_sched_set_grammar_vocab(pd_sched *s, const pd_grammar_vocab *v);

/** Queues a request whose prompt this replica prefills itself. With
 * want_prompt_logprobs the prefill chunks of the request return logits for
 * every token, bounded per step: the rows of such chunks in one step are at
 * most chunked_prefill_size (so at most chunked_prefill_size x vocab_size
 * floats for them, whatever the prompt length); each row is reduced to a
 * logprob and its top alternatives, and dropped.
 * Errors: PD_ERR_INVALID (empty prompt, bad sampling params, duplicate id,
 * prompt + max_tokens past max_position_embeddings, top_logprobs outside
 * 0..PD_MAX_TOP_LOGPROBS, a json_schema that does not compile),
 * PD_ERR_IO (a json_schema while the replica could not load the tokenizer:
 * the server's failure, answered 500), PD_ERR_LIMIT (the prompt can never
 * fit in the KV cache). */
pd_status pd_sched_add(pd_sched *s, const pd_sched_request *r, pd_err *err);

/** Allocates KV blocks for n_tokens prompt tokens plus the first generated
 * token, for a prefill replica to write into (the long route). The caller
 * owns them until it hands them to pd_sched_add_prefilled or gives them back
 * with pd_sched_free_blocks (only once no writer can touch them any more).
 * *blocks_p (heap, caller frees the array) lists them in token order.
 * Errors: PD_ERR_INVALID (n_tokens < 1), PD_ERR_LIMIT (not enough free
 * blocks; nothing is allocated). */
pd_status pd_sched_alloc_blocks(pd_sched *s, int n_tokens, int32_t **blocks_p, int *n_blocks_p, pd_err *err);

/** Returns blocks from pd_sched_alloc_blocks to the cache. */
void pd_sched_free_blocks(pd_sched *s, const int32_t *blocks, int n_blocks);

/** The prompt KV of request r (r->n_prompt tokens) is in blocks (written by
 * a prefill replica, flushed and accepted), and the first token was sampled
 * there: the request joins the running set with first_token already
 * generated (not reported again through on_token). The scheduler takes
 * ownership of the blocks, also on error (it frees them).
 * Errors: PD_ERR_INVALID (as pd_sched_add, or too few blocks for the
 * prompt + 1 token). */
pd_status pd_sched_add_prefilled(pd_sched *s, const pd_sched_request *r, const int32_t *blocks, int n_blocks,
                                 int32_t first_token, float first_logprob, pd_err *err);

/** Drops a request (queued or running) and frees its blocks.
 * Returns true if it existed. */
bool pd_sched_abort(pd_sched *s, const char *request_id);

/** Runs one forward step if there is work; reports events through the
 * callbacks. Returns the number of tokens processed (0: idle).
 * Errors: a forward failure fails every request in the batch (on_error). */
int pd_sched_step(pd_sched *s);

/** Load figures for heartbeats. */
typedef struct {
    int num_running, num_waiting;
    int free_blocks, total_blocks;
    uint64_t prefill_tokens_total;    /* prompt tokens this scheduler computed */
    uint64_t generation_tokens_total; /* tokens sampled here */
    uint64_t tokens_in_flight;        /* prompt + max_tokens of live requests */
} pd_sched_stats;
void pd_sched_get_stats(const pd_sched *s, pd_sched_stats *st);

/** The KV cache, for registering with kvtransfer. */
pd_kv_cache *pd_sched_kv(pd_sched *s);

/** pdserve decode: the service entry (argv as given after "decode"). */
int pd_decode_main(int argc, char **argv);

#endif

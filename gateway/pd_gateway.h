/* gateway/ — the HTTP front door of pdserve: HTTP/1.1 and HTTP/2 on one port
 * (h2c by prior knowledge or `Upgrade: h2c`; under TLS, ALPN) with the OpenAI
 * endpoints, validation, chat rendering and tokenization (off the event-loop
 * thread), incremental detokenization, stop strings, and OpenAI response
 * shapes (JSON and SSE). What generates tokens is not here: the gateway hands
 * each validated request to an *engine* (the router that talks to prefill and
 * decode replicas) through a table of two functions, and the engine reports
 * tokens back through three calls. Read this header first.
 *
 *   client ──HTTP──▶ connection (protocol handler: HTTP/1.1 or h2)
 *                      └─ stream (one request/response exchange)
 *                           └─ route: GET /health, /v1/models, handlers added
 *                              with pd_gw_server_add_get; POST /v1/completions
 *                              and /v1/chat/completions ─▶ worker pool (parse
 *                              JSON, validate, render, tokenize) ─▶ engine
 *   engine ─pd_gw_on_tokens(_top)/on_finish/on_error─▶ detokenize, stop strings,
 *                              SSE chunks or the final JSON
 *
 * Threads: everything here runs on the thread that runs the event_base given
 * to pd_gw_server_init ("the loop thread"), except the tokenizer workers,
 * which touch nothing of this API. The engine's submit/abort are called on
 * the loop thread, and the engine calls pd_gw_on_* on the loop thread only.
 * The process should ignore SIGPIPE (a peer that resets a connection while
 * a response is written, plain or TLS, raises it).
 *
 * Errors answered to clients are OpenAI error bodies
 * {"error":{"message","type","param","code"}} (code: the HTTP status).
 */
#ifndef PD_GATEWAY_H
#define PD_GATEWAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd_chat.h" /* reasoning and tool-call parsers */
#include "pd_common.h"
#include "pd_model.h" /* pd_sampling_params */
#include "pd_tokenizer.h"

struct event_base;
struct evbuffer;

/* ------------------------------------------------------------------ */
/* configuration                                                       */
/* ------------------------------------------------------------------ */

/** Gateway settings. Field names follow vLLM's flags (--host, --port,
 * --served-model-name, --max-model-len, --max-logprobs, --tokenizer,
 * --tokenizer-pool-size) and uvicorn's (--timeout-keep-alive). Strings are
 * borrowed only for the duration of pd_gw_server_init (copied). */
typedef struct {
    const char *host; /* --host; default "0.0.0.0" */
    int port;         /* --port; default 8000; 0 = any free port (see pd_gw_server_port) */
    int backlog;      /* listen backlog; default 1024 */
    const char *served_model_name; /* --served-model-name; required: what `model` must be */
    const char *tokenizer;         /* --tokenizer: tokenizer.json, or a directory holding one */
    const pd_tokenizer *tokenizer_handle; /* already loaded (borrowed, must outlive the server);
                                             when set, `tokenizer` is not read */
    int max_model_len;      /* --max-model-len (tokens, prompt + completion); required, > 0 */
    int vocab_size;         /* ids accepted in token prompts / stop_token_ids are < this;
                               0 = the tokenizer's pd_tok_vocab_size */
    int max_stop_strings;   /* --max-stop-strings; default 16 */
    int max_logprobs;       /* --max-logprobs; default 20, at most PD_MAX_TOP_LOGPROBS (20:
                               what replicas report) */
    int default_max_tokens; /* chat: max_tokens when the request gives none; 0 (default) =
                               whatever is left of max_model_len after the prompt
                               (completions: 16, as OpenAI and vLLM) */
    size_t max_request_body_bytes;  /* --max-request-body-bytes; default 32 MiB; larger → 413 */
    size_t max_header_bytes;        /* --max-header-bytes: request line + headers (HTTP/2: HPACK
                                       field sizes, name + value + 32); default 64 KiB; more → 431 */
    int max_header_count;           /* --max-header-count: header fields; default 100; more → 431 */
    double timeout_keep_alive_s;    /* --timeout-keep-alive: a connection with no request in
                                       progress (and no first byte yet) is closed after this;
                                       default 5 */
    double timeout_request_headers_s; /* --timeout-request-headers: the request line and headers
                                         must arrive within this of the request's first byte
                                         (HTTP/2: of its HEADERS); default 30; else 408 */
    double timeout_request_body_s;  /* --timeout-request-body: the whole body must arrive within
                                       this of the end of the headers; default 60; else 408 */
    double timeout_write_s;         /* --timeout-write: no write progress for this long closes the
                                       connection (HTTP/2: resets the stream); default 60 */
    int max_connections;            /* --max-connections: open client connections; one more is
                                       answered 503 and closed at once; default 16384 */
    size_t output_high_water_bytes; /* stop reading a connection whose unsent output is above
                                       this; resume below half of it; default 1 MiB */
    int tokenizer_pool_size;        /* --tokenizer-pool-size: worker threads; default 2 */
    double sse_ping_interval_s;     /* ": ping" while a stream waits for its first token;
                                       default 5; 0 = never */
    const char *ssl_certfile;       /* --ssl-certfile: PEM certificate chain; with ssl_keyfile the
                                       port speaks TLS only, ALPN choosing h2 or http/1.1 */
    const char *ssl_keyfile;        /* --ssl-keyfile: PEM private key of ssl_certfile */
    int max_concurrent_streams;     /* --max-concurrent-streams: HTTP/2 streams a client may open
                                       at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS);
                                       default 100 */
    pd_chat_reasoning_parser reasoning_parser; /* --reasoning-parser: deepseek_v3 (default) | none:
                                                  <think>…</think> → reasoning_content */
    pd_chat_tool_parser tool_call_parser;       /* --tool-call-parser: deepseek_v3 (default) |
                                                  deepseek_dsml: the model's tool-call format */
} pd_gw_config;

/** Fills cfg with the defaults above (served_model_name, tokenizer and
 * max_model_len are left NULL / 0: the caller must set them). */
void pd_gw_config_defaults(pd_gw_config *cfg);

/* ------------------------------------------------------------------ */
/* the engine interface                                                */
/* ------------------------------------------------------------------ */

/** One generation request. Owned by the gateway. For the engine it is valid
 * from submit until (a) the engine's pd_gw_on_finish for the last unfinished
 * choice returns, (b) its pd_gw_on_error returns, or (c) the gateway calls
 * engine->abort for it — whichever comes first; after that the engine must
 * not touch it. */
typedef struct pd_gw_request pd_gw_request;

/** What the engine is asked to generate. Every pointer is owned by the
 * gateway and valid as long as the request is (see pd_gw_request). */
typedef struct {
    const char *request_id;    /* "cmpl-<hex>" or "chatcmpl-<hex>": the response id */
    const int32_t *prompt_ids; /* the rendered and tokenized prompt, BOS included */
    int n_prompt;
    pd_sampling_params sampling; /* model/pd_model.h: temperature 0 = greedy, has_seed */
    int max_tokens;              /* >= 1; n_prompt + max_tokens <= max_model_len */
    int min_tokens;              /* 0..max_tokens: EOS / stop_token_ids not before this */
    bool ignore_eos;
    const int32_t *stop_token_ids; /* finish "stop" after emitting one of these */
    int n_stop_token_ids;
    int n;        /* choices, 1..128; each is an independent sample of the same prompt */
    int logprobs; /* -1: off; else the request wants the sampled token's logprob and this
                     many top alternatives (0..max_logprobs; see pd_gw_on_tokens_top) */
    const char *json_schema; /* response_format: constrained decoding by this JSON Schema
                                (canonical text, grammar/pd_grammar.h); NULL: none */
    bool prompt_logprobs;    /* completions with echo and logprobs: the engine also reports
                                the prompt tokens' logprobs (pd_gw_on_prompt_logprobs) */
    int prompt_top_logprobs; /* with prompt_logprobs: alternatives wanted per prompt token
                                (the request's logprobs) */
} pd_gw_gen_params;

/** The engine, as a table of functions over an opaque context (the style of
 * ggml's backend interface). Both are called on the loop thread, never from
 * inside one of the pd_gw_on_* calls. */
typedef struct {
    /** Accepts req for generation. Returns 0 when accepted: from then on the
     * engine calls pd_gw_on_tokens / pd_gw_on_finish / pd_gw_on_error, on the
     * loop thread, and never from inside submit itself. Returns < 0 when it
     * cannot take the request; it may first call pd_gw_submit_error to say
     * why (else the client gets 503). p is valid as long as req. */
    int (*submit)(void *engine, pd_gw_request *req, const pd_gw_gen_params *p);
    /** The gateway no longer wants req (client went away, every choice ended
     * on a stop string, shutdown): free everything held for it, here and on
     * replicas. Not called after the engine's own final on_finish / on_error.
     * req is invalid once abort returns; make no pd_gw_on_* call from it. */
    void (*abort)(void *engine, pd_gw_request *req);
} pd_gw_engine_i;

/** Optional third engine call, registered with pd_gw_server_set_abort_choice
 * (kept out of pd_gw_engine_i so that existing tables stay as they are).
 * With n > 1, one choice ended early (a stop string matched) while others go
 * on: stop generating it and free what it holds. After this call the engine
 * makes no pd_gw_on_* call for that choice (neither tokens nor on_finish);
 * req stays valid for the other choices. Called on the loop thread, never
 * from inside a pd_gw_on_* call, never for a choice the engine already
 * finished, and never when no other choice is left (abort is called then).
 * Without it, such a choice runs to its end and its tokens are dropped. */
typedef void (*pd_gw_abort_choice_fn)(void *engine, pd_gw_request *req, int choice);

/** Inside submit, before returning < 0: the status the client gets (429
 * queue full, 503 no replica, 400 the request can never be served, e.g. a
 * prompt larger than every replica's KV capacity; anything else is answered
 * 503), a Retry-After in seconds (<= 0: no header) and a message (copied;
 * NULL: a default). */
void pd_gw_submit_error(pd_gw_request *req, int http_status, int retry_after_s,
                        const char *message);

/** Reports n >= 1 new tokens of one choice (0 <= choice < n), in order.
 * logprobs, when non-NULL, holds the sampled token's log-probability for
 * each id. ids and logprobs are borrowed for the call. The gateway counts
 * every id towards usage until the choice finishes; tokens of a choice that
 * already finished (a stop string matched) are ignored. Malformed calls (bad
 * choice index, n < 1) are logged and ignored. */
void pd_gw_on_tokens(pd_gw_request *req, int choice, const int32_t *ids, const float *logprobs,
                     int n);

/** As pd_gw_on_tokens, with the k most likely tokens at each of the n
 * positions (what the request's logprobs asked for): top_ids[i * k + j] and
 * top_logprobs[i * k + j], j < k, for ids[i], best first. The gateway
 * renders at most the request's count of them (chat top_logprobs: that
 * many; completions: those and the sampled token). k = 0 or NULL arrays:
 * none known, as pd_gw_on_tokens (top_logprobs then lists the sampled token
 * alone). Non-finite logprobs are rendered as -9999.0 (as vLLM). Borrowed
 * for the call. */
void pd_gw_on_tokens_top(pd_gw_request *req, int choice, const int32_t *ids, const float *logprobs,
                         const int32_t *top_ids, const float *top_logprobs, int k, int n);

/** Reports the logprobs of n prompt tokens of one choice, positions
 * [first, first + n) of p->prompt_ids (first >= 1: position 0 has none and is
 * rendered null): logprobs[i] is the log softmax of the model's raw logits
 * after position first + i - 1, at the prompt token of position first + i
 * (the definition of the generated tokens' logprobs); top_ids / top_logprobs
 * the k most likely tokens at each position, row-major as in
 * pd_gw_on_tokens_top (k = 0 or NULL: none). Any order of calls, each
 * before the choice's first pd_gw_on_tokens*; what arrives later, or for a
 * request without p->prompt_logprobs, or out of range, is ignored (logged);
 * positions never reported are rendered null. Borrowed for the call. */
void pd_gw_on_prompt_logprobs(pd_gw_request *req, int choice, int first, int n, const float *logprobs,
                              const int32_t *top_ids, const float *top_logprobs, int k);

/** Ends one choice: finish_reason "stop" (EOS or a stop token id) or
 * "length" (max_tokens reached). Other strings are passed through and must
 * be static (the pointer is kept until the response is written). When it
 * ends the last unfinished choice, req is released when this call returns. */
void pd_gw_on_finish(pd_gw_request *req, int choice, const char *finish_reason);

/** Fails the whole request. If no response byte has been sent yet the
 * client gets http_status_if_not_started (4xx/5xx; else 500) and an error
 * body with message; a stream that already started gets an SSE error event
 * then "data: [DONE]". req is released when this call returns. */
void pd_gw_on_error(pd_gw_request *req, int http_status_if_not_started, const char *message);

/** As pd_gw_on_error, with the Retry-After (seconds, >= 1) a 503 answer
 * carries (pd_gw_on_error's 503 carries 1); ignored for other statuses and
 * once the response started. */
void pd_gw_on_error_retry(pd_gw_request *req, int http_status_if_not_started, int retry_after_s,
                          const char *message);

/** The request's generation parameters (same pointer as given to submit). */
const pd_gw_gen_params *pd_gw_request_params(const pd_gw_request *req);

/** One pointer the engine may keep on each request (NULL until set). */
void pd_gw_request_set_engine_data(pd_gw_request *req, void *data);
void *pd_gw_request_engine_data(const pd_gw_request *req);

/** Inside engine->abort: true when the gateway ends req because stop strings
 * ended every choice (the request succeeded, finish_reason "stop"), false
 * when the client went away or the server is shutting down. NULL: false. */
bool pd_gw_request_stopped(const pd_gw_request *req);

/** The finish reason the gateway gave choice CHOICE of req ("stop" for a
 * stop string it matched, even in the piece that also reached max_tokens),
 * or NULL while the choice runs (or req NULL, choice out of range). */
const char *pd_gw_request_choice_reason(const pd_gw_request *req, int choice);

/* ------------------------------------------------------------------ */
/* the server                                                          */
/* ------------------------------------------------------------------ */

typedef struct pd_gw_server pd_gw_server;

/** Starts the gateway on base: loads the tokenizer (unless
 * cfg->tokenizer_handle), starts the tokenizer workers, binds and listens on
 * cfg->host:cfg->port. Requests are served once the caller runs base. The
 * engine table is copied; engine_ctx is borrowed and must outlive the server.
 * On success *s_p owns it all (free with pd_gw_server_free); on failure *s_p
 * is untouched and nothing is left running.
 * Errors (err says which setting or call): PD_ERR_INVALID (NULL argument, no
 * served_model_name, max_model_len <= 0, a limit out of range, engine without
 * submit or abort, only one of ssl_certfile / ssl_keyfile), PD_ERR_IO
 * (tokenizer unreadable, certificate or key unreadable or not matching, host
 * unresolvable, bind or listen failed),
 * PD_ERR_FORMAT (tokenizer.json refused), PD_ERR_NOMEM. */
pd_status pd_gw_server_init(struct event_base *base, const pd_gw_config *cfg,
                            const pd_gw_engine_i *engine, void *engine_ctx, pd_gw_server **s_p,
                            pd_err *err);

/** Stops listening, closes every connection (aborting their requests through
 * engine->abort), joins the tokenizer workers, frees everything and sets
 * *s_p to NULL. Call on the loop thread, with the loop not running a
 * gateway callback. NULL or *s_p NULL is a no-op.
 *
 * libevent finishes freeing a connection (its socket; under TLS its SSL)
 * from the loop: a connection's bufferevent with a deferred callback still
 * queued when the loop stopped (one is queued after every TLS write) is
 * released only when that callback runs, and event_base_free drops queued
 * callbacks without running them. So the owner of the base, once it freed
 * everything it registered on the base (this server included), runs it
 * once more without blocking, event_base_loop(base, EVLOOP_NONBLOCK), and
 * then calls event_base_free. */
void pd_gw_server_free(pd_gw_server **s_p);

/** Registers the engine's per-choice abort (NULL: none, the default). */
void pd_gw_server_set_abort_choice(pd_gw_server *s, pd_gw_abort_choice_fn fn);

/** Graceful shutdown (a first SIGTERM / SIGINT, as uvicorn under vLLM):
 * closes the listening socket (no new connection), answers /health 503 and
 * every new completions, chat, tokenize or detokenize request 503 "the
 * server is shutting down" (connections already open stay open), and lets
 * the requests already admitted run to their end. Once none is left and
 * what they wrote is flushed to the sockets (at most 2 s more), or after
 * timeout_s seconds (then pd_gw_server_free aborts the rest), drained(ud)
 * is called once, from the loop. Errors: PD_ERR_INVALID (s or
 * drained NULL, timeout_s < 0 or NaN, already draining), PD_ERR_NOMEM. */
pd_status pd_gw_server_drain(pd_gw_server *s, double timeout_s, void (*drained)(void *ud), void *ud,
                             pd_err *err);

/** The TCP port actually bound (useful with cfg->port = 0). */
int pd_gw_server_port(const pd_gw_server *s);

/** The tokenizer in use (borrowed from the server). */
const pd_tokenizer *pd_gw_server_tokenizer(const pd_gw_server *s);

/** GET /health answers 200 "ok" while ready, else 503 with an error body.
 * A server is ready from pd_gw_server_init on; an engine that has no
 * replica yet may set it false until one registers. */
void pd_gw_server_set_ready(pd_gw_server *s, bool ready);

/** A handler for GET (and HEAD) on one exact path. It runs on the loop
 * thread and must not block: it appends the response body to body (owned by
 * the gateway), may set *content_type_p to a static string (default
 * "text/plain; charset=utf-8") and returns the HTTP status (200..599).
 * query is the text after '?' or NULL. */
typedef int (*pd_gw_get_fn)(void *ctx, const char *path, const char *query, struct evbuffer *body,
                            const char **content_type_p);

/** Adds (or replaces) the GET handler for path (exact match, e.g.
 * "/metrics"); ctx is borrowed. Built-in paths (/health, /v1/models,
 * /v1/completions, /v1/chat/completions) cannot be replaced.
 * Errors: PD_ERR_INVALID (NULL argument, path not starting with '/', a
 * built-in path). */
pd_status pd_gw_server_add_get(pd_gw_server *s, const char *path, pd_gw_get_fn fn, void *ctx,
                               pd_err *err);

#endif

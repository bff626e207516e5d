/* Test helpers for the gateway: a fake engine driven by a libevent timer, a
 * server running its loop on a thread, and a raw HTTP/1.1 client over
 * blocking sockets (so that pipelining, chunked bodies and half-sent
 * requests can be written byte for byte). */
#ifndef PD_GW_TEST_UTIL_H
#define PD_GW_TEST_UTIL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd_gateway.h"

struct event_base;

/* ---- tokenizer ---------------------------------------------------------- */

/** The DeepSeek-V3 tokenizer ($PD_CACHE_DIR/tokenizer-deepseek_v3/tokenizer.json,
 * else $PD_SOURCE_DIR/.cache/...), loaded once. NULL (and a message) if absent. */
const pd_tokenizer *gwt_tokenizer(void);

/** Token ids that spell text one byte per token (the byte-level base
 * tokens), so that every multi-byte character is split across tokens.
 * Returns a heap array of strlen(text) ids. */
int32_t *gwt_ids_bytewise(const char *text, int *n_p);

/** pd_tok_encode of text (no BOS); heap array. */
int32_t *gwt_ids_encode(const char *text, int *n_p);

/* ---- fake engine ---------------------------------------------------------- */

/** What the fake engine does with each request it accepts. Every choice
 * emits the same ids: `batch` ids per tick of `interval_s` (the first tick
 * after first_delay_s), finishing "length" at max_tokens or `finish` when
 * the script runs out. */
typedef struct {
    int32_t ids[4096];
    int n_ids;
    int batch;
    double interval_s;
    double first_delay_s;
    const char *finish; /* "stop" by default */
    int error_after;    /* >= 0: pd_gw_on_error after this many ids of choice 0 */
    int error_status;
    int reject_status; /* != 0: submit refuses with this status */
    int reject_retry_after;
    bool with_logprobs; /* report logprob = -0.5 * (k+1) for the k-th id */
    int choice_skip;    /* choice c starts at ids[c * choice_skip] (choices differ) */
    /* top logprobs (pd_gw_on_tokens_top) when n_top > 0, for the id of
     * logprob lp: [the id (lp), top_alt[0] (lp - 0.25), top_alt[1] (lp - 0.5), …];
     * with top_without_sampled: [top_alt[0] (-0.01), top_alt[1] (-0.02), …],
     * all above lp. top_last_inf: the last alternative has logprob -inf. */
    int n_top;
    int32_t top_alt[32];
    bool top_without_sampled, top_last_inf;
} gwt_script;

typedef struct {
    pthread_mutex_t mu;
    struct event_base *base; /* the gateway's loop: the engine's timers run there */
    gwt_script script;
    /* observations */
    atomic_int n_submitted, n_aborted, n_finished, n_errors, n_active;
    atomic_int n_choice_aborts;      /* abort_choice calls */
    atomic_int n_after_choice_abort; /* abort_choice for a finished choice: must stay 0 */
    atomic_int max_active;           /* highest n_active seen */
    pd_gw_gen_params last;           /* scalars of the last submit (pointers cleared) */
    int32_t last_prompt[8192];
    int last_n_prompt;
    char last_stop_ids[256];
} gwt_engine;

extern const pd_gw_engine_i gwt_engine_i;
/** The fake engine's abort_choice (registered by gwt_server_start). */
extern const pd_gw_abort_choice_fn gwt_engine_abort_choice;

/** Sets the script (copied under the engine's lock). */
void gwt_engine_set(gwt_engine *e, const gwt_script *s);
/** A default script: the given ids, batch 1, 1 ms ticks, finish "stop". */
gwt_script gwt_script_ids(const int32_t *ids, int n);

/* ---- server on a thread --------------------------------------------------- */

typedef struct {
    struct event_base *base;
    pd_gw_server *srv;
    pthread_t thread;
    gwt_engine engine;
    int port;
} gwt_server;

/** Starts a gateway on 127.0.0.1 (any port) with cfg (NULL: defaults with
 * served model "test-model", max_model_len 4096, the test tokenizer) and
 * the fake engine; its loop runs on a new thread. Returns 0 or -1. */
int gwt_server_start(gwt_server *h, const pd_gw_config *cfg);
/** Same, running setup(srv, ud) after init and before the loop starts
 * (e.g. pd_gw_server_add_get, which belongs to the loop thread). */
int gwt_server_start_setup(gwt_server *h, const pd_gw_config *cfg,
                           void (*setup)(pd_gw_server *srv, void *ud), void *ud);
void gwt_server_stop(gwt_server *h);
/** Defaults used by gwt_server_start(h, NULL), for tests that change some. */
void gwt_config(pd_gw_config *cfg);

/* ---- raw HTTP client ------------------------------------------------------ */

typedef struct {
    int fd;
    char *buf; /* bytes read and not yet consumed */
    size_t len, cap;
    bool eof;
} gwt_conn;

typedef struct {
    int status;
    char *head; /* status line and headers, NUL-terminated */
    char *body; /* de-chunked, NUL-terminated */
    size_t body_len;
    bool chunked;
    int n_chunks; /* chunked: number of data chunks */
    bool saw_100; /* a 100 Continue came first */
} gwt_resp;

gwt_conn *gwt_open(int port);
void gwt_close(gwt_conn *c);
int gwt_send(gwt_conn *c, const void *data, size_t len);
int gwt_sendf(gwt_conn *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/** Reads one response (skipping 1xx). 0 ok, -1 on EOF / timeout / bad framing. */
int gwt_read(gwt_conn *c, gwt_resp *r);
/** Reads only the head of a response (status and headers). */
int gwt_read_head(gwt_conn *c, gwt_resp *r);
/** Reads one chunk of a chunked body into out (NUL-terminated heap string). 0 ok, 1 end. */
int gwt_read_chunk(gwt_conn *c, char **out, size_t *len_p);
/** True when the peer closed within timeout_s (reads and discards). */
bool gwt_wait_closed(gwt_conn *c, double timeout_s);
const char *gwt_header(const gwt_resp *r, const char *name, char *buf, size_t n);
void gwt_resp_free(gwt_resp *r);

/** One request on a fresh connection: POST path with a JSON body (ctype
 * "application/json") or GET when body is NULL. */
int gwt_post(int port, const char *path, const char *body, gwt_resp *r);
int gwt_get(int port, const char *path, gwt_resp *r);

/* ---- SSE ------------------------------------------------------------------- */

typedef struct {
    char **data; /* the payloads of "data: " lines, in order */
    int n;
    int n_comments; /* ": ping" lines */
    int bad;        /* lines that are neither (e.g. "event:") */
} gwt_sse;

void gwt_sse_parse(const char *body, size_t len, gwt_sse *s);
void gwt_sse_free(gwt_sse *s);

/** Waits until *v >= want or timeout; returns the last value seen. */
int gwt_wait_atomic(atomic_int *v, int want, double timeout_s);

#endif

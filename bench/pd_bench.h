/* bench/ — `pdserve bench`: a strict load tester for pdserve or any
 * OpenAI-compatible server (vLLM, SGLang, ...), reproducing the published
 * DeepSeek serving method (DESIGN.md §7, issue 7).
 *
 * Read this header first. The pieces, one file each:
 *   bench_req.c     one request: its SSE stream parsed as bytes arrive, every
 *                   event validated, the outcome classified (the strict rules);
 *   bench_client.c  libcurl multi: closed-loop (a concurrency cap) or
 *                   open-loop (arrival times) runs of many requests from one
 *                   thread over one connection pool, HTTP/1.1 or HTTP/2;
 *   bench_prompt.c  prompts of an exact token length with the model's own
 *                   tokenizer, and the retrieval document;
 *   bench_stats.c   percentiles and per-round measures;
 *   bench_report.c  per-request CSV, per-round CSV, summary.json, report.html
 *                   (SVG drawn here, no scripts);
 *   bench_run.c     the four modes: matrix, rate, retrieval, functional;
 *   bench_main.c    flags and the entry point.
 *
 * Strictness: a request succeeds only with HTTP 200, non-empty text,
 * `data: [DONE]` (streaming), valid usage, exactly max_tokens completion
 * tokens when ignore_eos is set (at most max_tokens otherwise), no error
 * event, and valid UTF-8 and JSON in every event. Everything else is one of
 * the failure classes of pd_bench_outcome and stays in the denominator.
 *
 * Units: times are seconds from pd_now_s() (monotonic); lengths of text in
 * bytes; prompt and completion lengths in tokens.
 */
#ifndef PD_BENCH_H
#define PD_BENCH_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "pd_common.h"
#include "pd_tokenizer.h"

/** `pdserve bench <matrix|rate|retrieval|functional> [flags]`. Returns the
 * process exit status: 0 when every measured request (and every functional
 * check) succeeded, 1 when some failed, 2 on a usage or setup error (bad
 * flag, unreachable server, unreadable tokenizer, unwritable --out), 130 when
 * interrupted (SIGINT/SIGTERM: the report of what ran is still written). */
int pd_bench_main(int argc, char **argv);

/* ------------------------------------------------------------------ */
/* outcomes                                                            */
/* ------------------------------------------------------------------ */

/** How a request ended: success or exactly one failure class. When several
 * rules are broken the first in this order is reported: http_status,
 * invalid_utf8, sse_error, timeout, disconnect, no_done, empty_text,
 * bad_usage, wrong_length (what the server said wrong before what it left
 * out). */
typedef enum {
    PD_BENCH_SUCCESS = 0,
    PD_BENCH_HTTP_STATUS,  /* a status other than 200 */
    PD_BENCH_EMPTY_TEXT,   /* no text (and no tool call) in the whole answer */
    PD_BENCH_NO_DONE,      /* a stream that ended cleanly without data: [DONE] */
    PD_BENCH_WRONG_LENGTH, /* completion_tokens != max_tokens under ignore_eos (> otherwise) */
    PD_BENCH_BAD_USAGE,    /* usage missing, not integers, inconsistent, or 0 with text */
    PD_BENCH_SSE_ERROR,    /* an error event/object in a 200 answer, or malformed SSE/JSON */
    PD_BENCH_INVALID_UTF8, /* an event (or body) that is not well-formed UTF-8 */
    PD_BENCH_DISCONNECT,   /* the transport failed: reset, truncated body, refused */
    PD_BENCH_TIMEOUT,      /* --timeout passed before the answer ended */
    PD_BENCH_N_OUTCOMES
} pd_bench_outcome;

/** The outcome's name as summary.json spells it ("success", "http_status",
 * "empty_text", ...). Never NULL. */
const char *pd_bench_outcome_str(pd_bench_outcome o);

typedef enum { PD_BENCH_EP_COMPLETIONS = 0, PD_BENCH_EP_CHAT } pd_bench_endpoint;

/* ------------------------------------------------------------------ */
/* a growable byte buffer                                              */
/* ------------------------------------------------------------------ */

typedef struct {
    char *data; /* NUL-terminated when non-NULL */
    size_t len, cap;
} pd_bench_buf;

/** Appends n bytes (keeps a NUL after them). Returns 0, or -1 when memory
 * runs out (the buffer is unchanged). */
int pd_bench_buf_append(pd_bench_buf *b, const void *p, size_t n);
/** printf-style append; returns 0 or -1 (out of memory, nothing appended). */
int pd_bench_buf_printf(pd_bench_buf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void pd_bench_buf_free(pd_bench_buf *b);

/* ------------------------------------------------------------------ */
/* one request                                                         */
/* ------------------------------------------------------------------ */

/** Bytes of raw answer kept per request (for the failed/ files); beyond this
 * the raw copy is truncated, the parsing is not. */
#define PD_BENCH_RAW_MAX (8u << 20)

/** A request and everything measured about it. The caller fills the "in"
 * part (pd_bench_req_init zeroes the rest); the client fills the "out" part
 * by calling pd_bench_req_feed as bytes arrive and pd_bench_req_finish once.
 * Owned memory is released by pd_bench_req_clear. */
typedef struct {
    /* in */
    pd_bench_endpoint endpoint;
    char *body;              /* JSON body, owned (freed by pd_bench_req_clear) */
    bool stream;             /* the body asks for SSE with include_usage */
    int max_tokens;          /* what the body asks for */
    bool exact_length;       /* ignore_eos: completion_tokens must equal max_tokens */
    int prompt_tokens_local; /* the prompt length counted here (-1: unknown) */
    bool prompt_is_ids;      /* /v1/completions prompt sent as token ids, not text */
    int group, round, index; /* where it belongs (round 0: warm-up) */
    double arrival_s;        /* open loop: planned start, seconds after the round began */

    /* out: measures */
    pd_bench_outcome outcome;
    char detail[240];                       /* why it failed, human-readable ("" on success) */
    long http_status;                       /* 0 until headers arrived */
    int http_version;                       /* 10, 11, 20, 30 (HTTP/1.0 ... HTTP/3); 0 unknown */
    int transport;                          /* 0 ok, 1 timeout, 2 other transport error */
    double t_start, t_first, t_last, t_end; /* pd_now_s(); t_first = 0 until text came */
    int n_fragments;                        /* non-empty text fragments seen */
    bool done;                              /* data: [DONE] seen */
    bool have_usage;
    int64_t prompt_tokens, completion_tokens, total_tokens; /* from usage (-1: absent) */
    char finish_reason[32];
    pd_bench_buf text;  /* the answer's text (content; completions: text) */
    pd_bench_buf raw;   /* the bytes received, up to PD_BENCH_RAW_MAX */
    json_t *tool_calls; /* array of {id,name,arguments} or NULL */

    /* parser state */
    pd_bench_buf line, data; /* SSE: the current line, the current event's data */
    char event[32];          /* SSE: the current event's "event:" field */
    bool saw_data;           /* SSE: the current event had a data field */
    bool raw_truncated;
    pd_bench_outcome violation; /* first in-stream violation (utf8/sse_error), or SUCCESS */
    char violation_detail[200];
    int bad_usage; /* 1 when some usage object was malformed */
    char usage_detail[120];
    int n_events;
} pd_bench_req;

/** Zeroes r and sets the defaults (prompt_tokens_local -1, usage -1). */
void pd_bench_req_init(pd_bench_req *r);

/** Frees what r owns (body, buffers, tool_calls) and zeroes it. */
void pd_bench_req_clear(pd_bench_req *r);

/** Takes len bytes of the answer body, received at time now (s). For a
 * streamed 200 answer the SSE is parsed as it arrives: each complete event
 * is checked (UTF-8, JSON, error objects), text fragments are timed (the
 * first non-empty one sets t_first, every one sets t_last) and usage kept.
 * Anything else (a non-200 answer, a non-streamed body) is only kept for
 * pd_bench_req_finish. http_status must be set before the first call.
 * Never fails: an allocation failure is recorded as a violation. */
void pd_bench_req_feed(pd_bench_req *r, const char *p, size_t len, double now);

/** Ends the request at time now: transport is 0 (the body ended cleanly),
 * 1 (timed out) or 2 (another transport error, curl_detail names it).
 * Parses a non-streamed body, then classifies (see pd_bench_outcome) into
 * r->outcome and r->detail. */
void pd_bench_req_finish(pd_bench_req *r, int transport, const char *curl_detail, double now);

/** Per-request measures (NAN when they do not apply): TTFT = first
 * non-empty fragment - start; TPOT = (last - first fragment) /
 * (completion_tokens - 1), only with more than one completion token;
 * E2E = end - start. For a non-streamed answer TTFT and TPOT are NAN. */
double pd_bench_req_ttft(const pd_bench_req *r);
double pd_bench_req_tpot(const pd_bench_req *r);
double pd_bench_req_e2e(const pd_bench_req *r);

/* ------------------------------------------------------------------ */
/* the HTTP client                                                     */
/* ------------------------------------------------------------------ */

typedef struct pd_bench_client pd_bench_client;

typedef struct {
    const char *base_url; /* "http://HOST:PORT", no trailing path */
    bool http2;           /* h2c with prior knowledge for http://, ALPN for https:// */
    double timeout_s;     /* per request, whole answer; <= 0: none */
    const char *api_key;  /* Authorization: Bearer ...; NULL: none */
} pd_bench_client_opts;

/** Starts a client (libcurl multi, one connection pool). *c_p is set only on
 * success. Errors: PD_ERR_INVALID (NULL or empty base_url), PD_ERR_NOMEM,
 * PD_ERR_IO (libcurl could not start). */
pd_status pd_bench_client_init(const pd_bench_client_opts *o, pd_bench_client **c_p, pd_err *err);

/** Frees the client and sets *c_p to NULL; NULL is a no-op. */
void pd_bench_client_free(pd_bench_client **c_p);

/** GETs base_url + path and parses the JSON answer (caller json_decref's).
 * Errors: PD_ERR_IO (transport failure or a status other than 200; err says
 * which), PD_ERR_FORMAT (not JSON). */
pd_status pd_bench_client_get_json(pd_bench_client *c, const char *path, json_t **json_p,
                                   pd_err *err);

/** Asks the runs to stop (async-signal-safe, for a SIGINT handler): a
 * running pd_bench_client_run abandons its requests in flight (they end as
 * disconnect, "interrupted") and returns; the modes then stop, leaving the
 * rounds not run, and the report is still written. */
void pd_bench_stop_request(void);
/** True once pd_bench_stop_request was called. */
bool pd_bench_stop_requested(void);

/** Called about 5 times a second while a run goes on. */
typedef void (*pd_bench_progress_fn)(void *arg, int started, int finished, int failed, int n,
                                     double elapsed_s);

/** Runs n requests to completion from this thread. Closed loop when
 * open_loop is false: at most concurrency (>= 1) in flight, the next started
 * as soon as one ends. Open loop: request i starts at (run start +
 * reqs[i].arrival_s), however many are in flight. Each request's out part
 * is filled (see pd_bench_req_finish); a failed request is not an error of
 * the run. *t0_p / *t1_p (may be NULL) get the run's start and end times.
 * Errors: PD_ERR_INVALID (bad arguments), PD_ERR_IO (libcurl refused a
 * handle; requests not started are marked disconnect). */
pd_status pd_bench_client_run(pd_bench_client *c, pd_bench_req *reqs, int n, int concurrency,
                              bool open_loop, pd_bench_progress_fn fn, void *arg, double *t0_p,
                              double *t1_p, pd_err *err);

/* ------------------------------------------------------------------ */
/* prompts                                                             */
/* ------------------------------------------------------------------ */

/** The tokenizer and how the server counts a prompt. */
typedef struct {
    pd_tokenizer *tok; /* owned */
    bool add_bos;      /* tokenizer_config.json add_bos_token: servers prepend BOS to a
                          /v1/completions text prompt */
    int32_t bos_id;    /* -1 when there is none */
    int chat_overhead; /* tokens of the chat template around one user message */
} pd_bench_tok;

/** Loads tokenizer_json (and tokenizer_config.json next to it, when present,
 * for add_bos_token). Errors: those of pd_tok_load; PD_ERR_FORMAT when the
 * chat template cannot be rendered. */
pd_status pd_bench_tok_load(const char *tokenizer_json, pd_bench_tok *bt, pd_err *err);
void pd_bench_tok_free(pd_bench_tok *bt);

/** Random text (words of a fixed English list, sentences, seeded by rng)
 * whose encoding is exactly n tokens and which decodes and re-encodes to the
 * same n tokens. On success *text_p is a heap string (caller frees).
 * Errors: PD_ERR_INVALID (n < 1), PD_ERR_NOTFOUND (exactness not reached in
 * a few trims; the caller falls back to token ids), PD_ERR_NOMEM, tokenizer
 * errors. */
pd_status pd_bench_prompt_text(const pd_tokenizer *t, pd_rng *rng, int n, char **text_p,
                               pd_err *err);

/** Random token ids of length n that survive decode + re-encode unchanged
 * (ids of the words used for text prompts), for token-id prompts. */
pd_status pd_bench_prompt_ids(const pd_tokenizer *t, pd_rng *rng, int n, int32_t **ids_p,
                              pd_err *err);

/** Tokens the server will count for a chat request with this single user
 * message (DeepSeek-V3 template, BOS included). -1 on error. */
int pd_bench_chat_tokens(const pd_bench_tok *bt, const char *content);

/** A retrieval task: a document of filler text with three codes hidden at
 * 10%, 50% and 90% of it, and the question. */
typedef struct {
    char *content;     /* the user message: document + question (heap) */
    char names[3][24]; /* project names */
    char codes[3][16]; /* their codes, "XXXX-XXXX" */
    int tokens;        /* chat tokens of content, counted here */
} pd_bench_retrieval;

/** Builds a retrieval task whose chat prompt is n_tokens long (exact when the
 * tokenizer allows, else within a few tokens: ->tokens says). Errors:
 * PD_ERR_INVALID (n_tokens too small for the question, < 200), PD_ERR_NOMEM,
 * tokenizer errors. */
pd_status pd_bench_retrieval_build(const pd_bench_tok *bt, pd_rng *rng, int n_tokens,
                                   pd_bench_retrieval *rt, pd_err *err);
void pd_bench_retrieval_free(pd_bench_retrieval *rt);

/** Scores an answer: the number (0..3) of projects whose code the first JSON
 * object in answer maps exactly. */
int pd_bench_retrieval_score(const pd_bench_retrieval *rt, const char *answer);

/* ------------------------------------------------------------------ */
/* statistics                                                          */
/* ------------------------------------------------------------------ */

/** Percentile p (0..100) of n values by linear interpolation between order
 * statistics (numpy's default). v is sorted in place. NAN when n == 0. */
double pd_bench_percentile(double *v, int n, double p);

/** Median of n values (NAN values skipped); v is reordered. NAN when none. */
double pd_bench_median(double *v, int n);

typedef struct {
    int n;
    double mean, p50, p95, p99, max; /* NAN when n == 0 */
} pd_bench_dist;

/** Distribution of the n values (NAN values skipped). v is reordered. */
pd_bench_dist pd_bench_dist_of(double *v, int n);

/** One measured round of one group. */
typedef struct {
    int round; /* 1-based */
    bool run;  /* false: not run (its phase was stopped) */
    int requests, successes;
    int failures[PD_BENCH_N_OUTCOMES];                /* by outcome; [PD_BENCH_SUCCESS] unused */
    double duration_s;                                /* first start to last end */
    int64_t output_tokens;                            /* completion tokens of the successes */
    double throughput_tok_s;                          /* output_tokens / duration_s */
    double request_throughput_s;                      /* successes / duration_s */
    pd_bench_dist ttft, tpot, e2e;                    /* over the successes */
    double prompt_tokens_local, prompt_tokens_server; /* medians */
    int prompt_mismatches; /* requests whose usage.prompt_tokens != local count */
    double slo_ratio;      /* rate: compliant / requests; NAN otherwise */
    int slo_compliant;
    int score, score_max; /* retrieval: codes found / hidden */
} pd_bench_round;

/** Fills *rd (round number and score are left to the caller) from the n
 * requests of a round that ran from t0 to t1. slo_ttft_s / slo_tpot_s > 0
 * turn on the SLO ratio: a request complies when it succeeded with
 * TTFT <= slo_ttft_s and TPOT <= slo_tpot_s (a one-token answer has no TPOT
 * and complies on TTFT alone). */
void pd_bench_round_compute(const pd_bench_req *reqs, int n, double t0, double t1,
                            double slo_ttft_s, double slo_tpot_s, pd_bench_round *rd);

/* ------------------------------------------------------------------ */
/* runs and reports                                                    */
/* ------------------------------------------------------------------ */

typedef enum {
    PD_BENCH_MATRIX = 0,
    PD_BENCH_RATE,
    PD_BENCH_RETRIEVAL,
    PD_BENCH_FUNCTIONAL
} pd_bench_mode;

#define PD_BENCH_MAX_LIST 32

/** Everything the flags say. Lists hold up to PD_BENCH_MAX_LIST entries. */
typedef struct {
    pd_bench_mode mode;
    const char *base_url, *served_model_name, *model_dir, *tokenizer_path, *out_dir;
    const char *api_key, *extra_body;
    pd_bench_endpoint endpoint;
    bool http2, ignore_eos, quiet;
    double temperature, timeout_s;
    int seed, rounds, warmup, stop_after_failed_rounds;
    int n_shapes, shape_in[PD_BENCH_MAX_LIST], shape_out[PD_BENCH_MAX_LIST];
    int n_conc, conc[PD_BENCH_MAX_LIST];
    int n_reqs, reqs[PD_BENCH_MAX_LIST];
    int n_rates;
    double rates[PD_BENCH_MAX_LIST];
    double slo_ttft_s, slo_tpot_s;
    int n_tokens, tokens[PD_BENCH_MAX_LIST]; /* retrieval */
    int max_tokens;                          /* retrieval / functional answers */
    int repeat;                              /* functional */
    char command[1024];                      /* the command line, for the report */
} pd_bench_config;

/** One group: a (shape, concurrency) cell of the matrix, one rate of the
 * scan, or one document length of retrieval. */
typedef struct {
    char name[64];
    int in_tokens, out_tokens, concurrency; /* concurrency 0: open loop */
    double rate;                            /* requests/s (rate mode), else 0 */
    int phase;                              /* groups of a phase stop together */
    int n_rounds;
    pd_bench_round *rounds;        /* n_rounds, owned */
    int prompts_text, prompts_ids; /* how the prompts were sent */
} pd_bench_group;

/** A functional check's tally. */
typedef struct {
    const char *name;
    int runs, passes;
    char last_failure[240];
} pd_bench_check;

/** The state of one `pdserve bench` run. */
typedef struct {
    const pd_bench_config *cfg;
    pd_bench_client *client;
    pd_bench_tok tok;
    bool have_tok;
    char model[256]; /* the served model name used in requests */
    pd_rng rng;
    FILE *requests_csv;
    char started_at[32]; /* ISO 8601, UTC */
    int n_groups;
    pd_bench_group *groups; /* owned */
    int n_checks;
    pd_bench_check checks[8];
    int fn_requests, fn_successes; /* functional: every request's outcome */
    int fn_failures[PD_BENCH_N_OUTCOMES];
    int failed_files;    /* raw answers written under failed/ */
    char host_info[320]; /* the client machine, for the report */
    int n_notes;         /* the first failures, for the report */
    char notes[24][320];
    double t_origin;      /* pd_now_s() when the run started */
    bool any_failure;     /* a measured request or a check failed */
    bool interrupted;     /* stopped by a signal: the rest is not run */
    int http_versions[4]; /* measured requests answered over HTTP/1.0, 1.1, 2, 3 */
    json_t *extra;        /* --extra-body, parsed; NULL when absent */
} pd_bench_run;

/** Runs the configured mode: groups and rounds (or checks) are filled and
 * each request is written to requests.csv (raw answers of failures to
 * failed/). Errors: PD_ERR_IO (client or file failure), PD_ERR_NOMEM,
 * prompt/tokenizer errors; measured failures are not errors. */
pd_status pd_bench_run_mode(pd_bench_run *run, pd_err *err);

/** Writes rounds.csv, summary.json and report.html into cfg->out_dir.
 * Errors: PD_ERR_IO (err names the file). */
pd_status pd_bench_report_write(const pd_bench_run *run, pd_err *err);

/** The summary.json document (caller json_decref's); NULL when out of
 * memory. */
json_t *pd_bench_summary_json(const pd_bench_run *run);

/** Writes one request as a requests.csv row (the header when r is NULL). */
void pd_bench_csv_request(FILE *f, const pd_bench_run *run, const pd_bench_req *r);

#endif

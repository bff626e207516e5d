/* gateway internals shared by its .c files. Not a public header.
 *
 * Layers, bottom up:
 *   gw_conn.c     listener, one gw_conn per TCP connection (a bufferevent,
 *                 OpenSSL under TLS), timers, back-pressure, deferred close;
 *                 picks the protocol handler for a new connection (ALPN under
 *                 TLS, else sniffing the HTTP/2 preface).
 *   gw_tls.c      the server's SSL_CTX: certificate, key, ALPN (h2, http/1.1).
 *   gw_http1.c    the HTTP/1.1 protocol handler (libhttp-parser): requests in
 *                 order, keep-alive, chunked bodies, limits; one gw_stream at a
 *                 time per connection (pipelined requests wait parsed-later);
 *                 `Upgrade: h2c` hands the connection to gw_http2.c.
 *   gw_http2.c    the HTTP/2 protocol handler (nghttp2): many streams per
 *                 connection, flow control, back-pressure, RST_STREAM.
 *   gw_stream.c   the protocol-neutral exchange: request fields, response
 *                 start / write / end, close callback.
 *   gw_server.c   server object, routing, built-in GET endpoints.
 *   gw_openai.c   request JSON → validated parameters + prompt ids (worker).
 *   gw_pool.c     tokenizer worker threads; results back through a pipe.
 *   gw_request.c  pd_gw_request: engine callbacks, detok, stop strings, output.
 *   gw_tokenize.c POST /tokenize, /detokenize: a pool job and its response.
 *   gw_stop.c     the stop-string matcher.
 *   gw_json.c     OpenAI error bodies, status reasons.
 */
#ifndef PD_GW_INTERNAL_H
#define PD_GW_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <jansson.h>

#include "pd_gateway.h"

/** SECONDS (>= 0) as the struct timeval libevent's timers take. */
static inline struct timeval gw_timeval(double seconds) {
    return (struct timeval){(time_t)seconds, (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6)};
}

#define GW_MOD "gateway"

typedef struct gw_conn gw_conn;
typedef struct gw_stream gw_stream;
typedef struct pd_gw_server gw_server;
typedef struct gw_pool gw_pool;
typedef struct gw_job gw_job;

/* ------------------------------------------------------------------ */
/* gw_json.c                                                           */
/* ------------------------------------------------------------------ */

/** Reason phrase for an HTTP status ("OK", "Not Found"); "Unknown" if none. */
const char *gw_status_reason(int status);

/** OpenAI error body {"error":{"message","type","param","code"}} for status
 * (param NULL or "" → null). Returns a heap string (caller frees). */
char *gw_error_json(int status, const char *message, const char *param);

/** json_dumps compact, never NULL (aborts on OOM via pd_xmalloc semantics). */
char *gw_json_dump(const json_t *j);

/** A JSON string from len bytes of text that should be UTF-8; invalid
 * sequences are replaced by U+FFFD rather than failing. New reference. */
json_t *gw_json_text(const char *s, size_t len);

/* ------------------------------------------------------------------ */
/* the protocol-neutral stream (gw_stream.c)                           */
/* ------------------------------------------------------------------ */

typedef struct {
    char *name; /* as received (lookups are case-insensitive) */
    char *value;
} gw_header;

/** Response headers given by the application; borrowed for the call. */
typedef struct {
    const char *name;
    const char *value;
} gw_hdr;

/** Called once when a stream dies before the application ended its
 * response (peer closed, reset, timeout, server shutdown). The stream is
 * freed right after; the application must drop its pointer. */
typedef void (*gw_stream_close_fn)(gw_stream *s, void *ud);

typedef enum {
    GW_STREAM_RECEIVING = 0, /* the request is arriving */
    GW_STREAM_DISPATCHED,    /* handed to the application; no response byte yet */
    GW_STREAM_STARTED,       /* response head sent, body streaming */
    GW_STREAM_ENDED,         /* response complete; the protocol frees it */
} gw_stream_state;

/** One request/response exchange. Created and freed by the protocol
 * handler; request fields are valid from dispatch until the stream ends or
 * closes. */
struct gw_stream {
    gw_conn *conn;
    void *proto_data; /* the protocol's per-stream state (h2: its h2_stream) */
    char *method;     /* "GET", "POST", ... */
    char *path;       /* the request target up to '?' (not percent-decoded) */
    char *query;      /* after '?', or NULL */
    gw_header *hdrs;
    int n_hdrs, cap_hdrs;
    size_t hdr_bytes;
    struct evbuffer *body; /* the whole request body (de-chunked) */
    int http_major, http_minor;
    bool head; /* HEAD: the response carries headers only */
    gw_stream_state state;
    gw_stream_close_fn on_close;
    void *close_ud;
    double t_start; /* pd_now_s() at the first byte */
};

gw_stream *gw_stream_new(gw_conn *c);
/** Frees a stream; calls its close callback first if the response has not
 * ended. For protocol handlers only. */
void gw_stream_free(gw_stream *s);
/** Appends a request header (copies). Returns PD_ERR_NOMEM on failure. */
pd_status gw_stream_add_header(gw_stream *s, const char *name, size_t nlen, const char *value,
                               size_t vlen);
/** The first header named name (case-insensitive), or NULL. */
const char *gw_stream_header(const gw_stream *s, const char *name);
/** How many of the request's header fields are named name (case-insensitive); 0 when none. */
int gw_stream_header_count(const gw_stream *s, const char *name);
void gw_stream_set_close_cb(gw_stream *s, gw_stream_close_fn fn, void *ud);

/* Responses. After respond/end the stream belongs to the protocol again and
 * must not be used. Each returns 0, or -1 when the connection is gone or
 * the call is out of order (then nothing is written). */
int gw_stream_respond(gw_stream *s, int status, const char *content_type, const gw_hdr *hdrs,
                      int n_hdrs, const void *body, size_t len);
/** An OpenAI error response; extra headers (Allow, Retry-After) optional. */
int gw_stream_respond_error(gw_stream *s, int status, const char *message, const char *param,
                            const gw_hdr *hdrs, int n_hdrs);
/** Starts a streamed response (HTTP/1.1: chunked transfer encoding; h2: DATA frames). */
int gw_stream_start(gw_stream *s, int status, const char *content_type, const gw_hdr *hdrs,
                    int n_hdrs);
int gw_stream_write(gw_stream *s, const void *data, size_t len);
int gw_stream_end(gw_stream *s);

/* ------------------------------------------------------------------ */
/* protocol handlers and connections (gw_conn.c, gw_http1.c)           */
/* ------------------------------------------------------------------ */

/** A per-connection protocol. A protocol creates gw_streams as requests
 * arrive and calls gw_server_dispatch for each complete one; the stream
 * operations below are how the application's response reaches the wire.
 * An HTTP/2 handler (nghttp2) implements the same table with many streams
 * per connection. */
typedef struct {
    const char *name; /* "http/1.1", "h2" */
    /** Sets up c->proto_data. The connection's input may already hold
     * bytes (read while sniffing); on_read is called right after. */
    pd_status (*init)(gw_conn *c);
    /** New bytes in bufferevent_get_input(c->bev). */
    void (*on_read)(gw_conn *c);
    /** Work scheduled with gw_conn_defer (e.g. the next pipelined request). */
    void (*on_deferred)(gw_conn *c);
    /** Optional: the output buffer drained below half the high-water mark
     * (a protocol that stopped producing output above it resumes here). */
    void (*on_write)(gw_conn *c);
    /** The connection's timer fired (gw_conn_set_timer). */
    void (*on_timeout)(gw_conn *c);
    /** The peer closed its side (read returned 0). The handler decides
     * between gw_conn_free (abort what is in flight: a client that stops
     * sending cannot be told from one that went away) and gw_conn_close
     * (only finished responses are pending: send them, then close). */
    void (*on_eof)(gw_conn *c);
    /** The connection is being freed: free every stream (their close
     * callbacks run) and c->proto_data. */
    void (*on_close)(gw_conn *c);
    int (*respond)(gw_stream *s, int status, const char *content_type, const gw_hdr *hdrs,
                   int n_hdrs, const void *body, size_t len);
    int (*start)(gw_stream *s, int status, const char *content_type, const gw_hdr *hdrs,
                 int n_hdrs);
    int (*write)(gw_stream *s, const void *data, size_t len);
    int (*end)(gw_stream *s);
} gw_proto_i;

extern const gw_proto_i gw_proto_http1;
extern const gw_proto_i gw_proto_h2;

/** HTTP/1.1 `Upgrade: h2c` (RFC 7540 §3.2): st is the complete HTTP/1.1
 * request that asked for it (not yet dispatched) and settings the decoded
 * HTTP2-Settings payload. On success the connection belongs to the h2
 * handler: "101 Switching Protocols" and the server preface are queued, st
 * became stream 1 and was dispatched; the caller must drop st and free its
 * own protocol state without touching c->proto_data. On failure (bad
 * settings, no memory) nothing changed and the caller serves st on
 * HTTP/1.1 as if there had been no Upgrade. */
pd_status gw_h2_upgrade(gw_conn *c, gw_stream *st, const uint8_t *settings, size_t len);

/* The 24-octet HTTP/2 client connection preface (RFC 9113 §3.4). */
#define GW_H2_PREFACE     "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#define GW_H2_PREFACE_LEN 24

struct gw_conn {
    gw_server *srv;
    struct bufferevent *bev;
    const gw_proto_i *proto; /* NULL while sniffing the first bytes */
    void *proto_data;
    struct event *timer;    /* protocol timeouts (gw_conn_set_timer) */
    struct event *deferred; /* gw_conn_defer and deferred close */
    uint64_t id;
    char peer[64];
    bool closing;     /* no more requests; freed once the output drained */
    bool lingering;   /* closing, and reading to discard (gw_conn_close_linger) */
    bool wr_shut;     /* lingering: the output drained and the write side was shut */
    uint64_t linger_left; /* lingering: bytes still to discard before the close */
    bool bp_paused;   /* reading stopped by back-pressure */
    bool read_paused; /* reading stopped by the protocol (gw_conn_pause_read) */
    bool defer_proto; /* the deferred event should run proto->on_deferred */
    bool tls;         /* bev is an OpenSSL bufferevent */
    bool tls_ready;   /* the handshake finished and ALPN was looked at */
    gw_conn *prev, *next;
};

/** Starts listening per s->cfg. Errors: PD_ERR_IO (resolve/bind/listen). */
pd_status gw_listener_init(gw_server *s, pd_err *err);
void gw_listener_free(gw_server *s);

/** The connection's output buffer (append, then call gw_conn_flushed). */
struct evbuffer *gw_conn_output(gw_conn *c);
/** After appending output: applies back-pressure (stops reading above the
 * high-water mark; the write callback resumes it below half). */
void gw_conn_flushed(gw_conn *c);
/** Stops / resumes reading on the protocol's behalf (independent of
 * back-pressure). */
void gw_conn_pause_read(gw_conn *c, bool paused);
/** Closes c once its output has been sent (no further reading). The free
 * happens from the event loop, never inside the caller's stack. */
void gw_conn_close(gw_conn *c);
/** Lingering close (nginx's lingering_close): like gw_conn_close, but after
 * an answer sent before the request was read whole (413 from
 * Content-Length, 431, 400; not 408). Input is read and discarded while the
 * output drains; then the write side is shut (cleartext: the client sees
 * EOF after the answer) and reading goes on until the client closes,
 * expect_bytes more have been discarded (the rest of a declared body;
 * UINT64_MAX: unknown), GW_LINGER_MAX_BYTES were discarded or GW_LINGER_S
 * passed, whichever comes first. Closing with unread input would make the
 * kernel send a reset, and a reset destroys the answer still in the
 * client's receive queue (RFC 9112 §9.6 asks servers to close in stages). */
void gw_conn_close_linger(gw_conn *c, uint64_t expect_bytes);
/** Frees c now (proto->on_close, streams' close callbacks). Only from an
 * event callback of c or server shutdown. */
void gw_conn_free(gw_conn *c);
/** Arms the connection timer (seconds; <= 0 disarms). */
void gw_conn_set_timer(gw_conn *c, double seconds);
/** Runs proto->on_deferred(c) from the event loop soon. */
void gw_conn_defer(gw_conn *c);

/* ------------------------------------------------------------------ */
/* TLS (gw_tls.c)                                                      */
/* ------------------------------------------------------------------ */

/** Loads cfg.ssl_certfile (PEM chain) and cfg.ssl_keyfile into s->ssl_ctx
 * with ALPN h2 then http/1.1. Errors: PD_ERR_IO (unreadable or mismatched
 * files; err holds OpenSSL's reason), PD_ERR_NOMEM. */
pd_status gw_tls_init(gw_server *s, pd_err *err);
void gw_tls_free(gw_server *s);
/** The protocol ALPN chose on a finished handshake: &gw_proto_h2,
 * &gw_proto_http1, or NULL when the client offered neither (then the first
 * bytes decide, as in cleartext). */
const gw_proto_i *gw_tls_alpn_proto(struct bufferevent *bev);
/** A bufferevent that runs the server side of a TLS handshake on fd (owned:
 * closed with it), or NULL. */
struct bufferevent *gw_tls_bev_new(gw_server *s, evutil_socket_t fd);

/* ------------------------------------------------------------------ */
/* OpenAI request preparation (gw_openai.c): runs on worker threads    */
/* ------------------------------------------------------------------ */

/** What a POST body is: a generation request (completion, chat) or a
 * tokenizer request (vLLM's /tokenize, /detokenize). */
typedef enum { GW_KIND_COMPLETION = 0, GW_KIND_CHAT, GW_KIND_TOKENIZE, GW_KIND_DETOKENIZE } gw_kind;

/** tool_choice: "none" (or no tools), "auto", "required", or a named
 * function. */
typedef enum { GW_TOOLS_NONE = 0, GW_TOOLS_AUTO, GW_TOOLS_REQUIRED, GW_TOOLS_NAMED } gw_tool_choice;

/** Limits on tools (OpenAI's): at most this many, names of 1-64 of
 * [a-zA-Z0-9_-]. */
#define GW_MAX_TOOLS         128
#define GW_MAX_TOOL_NAME_LEN 64

/** A validated, tokenized request. Owns every pointer. */
typedef struct {
    gw_kind kind;
    bool stream;
    bool include_usage; /* stream_options.include_usage */
    bool echo;          /* completions: prompt text before the completion */
    bool ignore_eos;
    bool skip_special;     /* skip_special_tokens (default true) */
    bool include_stop_str; /* include_stop_str_in_output */
    int n;
    int max_tokens;
    int min_tokens;
    int logprobs; /* -1 off; else top alternatives wanted (0..max_logprobs) */
    pd_sampling_params sampling;
    char **stop; /* n_stop non-empty UTF-8 strings */
    int n_stop;
    int32_t *stop_token_ids;
    int n_stop_token_ids;
    int32_t *logit_bias_ids; /* logit_bias: n_logit_bias distinct ids; sampling points here */
    float *logit_bias;
    int n_logit_bias;
    int32_t *prompt_ids;
    int n_prompt;
    char *echo_text; /* completions with echo: the prompt as text */
    size_t echo_len;
    bool echo_only;        /* completions: echo with max_tokens 0, the prompt alone (vLLM): the
                              engine is asked for 1 token (max_tokens 1), which is dropped */
    bool prompt_bos_added; /* the gateway put BOS before a text prompt (not in echo_text) */
    bool prompt_from_ids;  /* the prompt came as token ids (echo_text is their decoding) */
    /* chat features (chat/pd_chat.h); all off for completions */
    bool parse_reasoning;       /* --reasoning-parser is not none */
    pd_chat_think_start think;  /* where the output starts, from the rendered prompt */
    gw_tool_choice tool_choice; /* GW_TOOLS_NONE when no tools */
    char **tool_names;          /* n_tools names of the request's tools */
    int n_tools;
    char *tool_choice_name; /* GW_TOOLS_NAMED: the function */
    char *json_schema; /* response_format json_object / json_schema: the canonical schema
                          (pd_grammar_canonical); NULL: unconstrained */
} gw_oai_req;

/** Why a request was refused: HTTP status, message, offending parameter
 * ("" when none). */
typedef struct {
    int status;
    char message[512];
    char param[96];
} gw_oai_err;

/** Parses len bytes of JSON body of kind, validates every field against
 * cfg (limits, served model name), renders chat messages with
 * pd_chat_render, tokenizes (BOS first) with tok, and checks prompt +
 * max_tokens against cfg->max_model_len. Pure and thread-safe (tok and cfg
 * read-only). On success fills *out (free with gw_oai_req_clear) and
 * returns 0; on a client error fills *e and returns -1. */
int gw_oai_prepare(const pd_gw_config *cfg, const pd_tokenizer *tok, gw_kind kind, const char *body,
                   size_t len, gw_oai_req *out, gw_oai_err *e);

/** POST /tokenize (kind GW_KIND_TOKENIZE) or /detokenize
 * (GW_KIND_DETOKENIZE) with vLLM's shapes. tokenize: {"model"?, "prompt",
 * "add_special_tokens" (default true: BOS first)} or {"model"?, "messages",
 * "add_generation_prompt", "add_special_tokens" (default false), "tools",
 * "chat_template_kwargs"}, and "return_token_strs" -> {"count",
 * "max_model_len", "tokens", "token_strs" (null unless asked)}; the ids are
 * those gw_oai_prepare gives the same prompt. detokenize: {"model"?,
 * "tokens": ids in [0, cfg->vocab_size)} -> {"prompt": text, special tokens
 * included}. Pure and thread-safe. On success *resp_p is the JSON body (heap,
 * caller frees) and 0 is returned; on a client error *e is filled (400 with
 * param, 404 for another model) and -1 returned. */
int gw_oai_tokenize(const pd_gw_config *cfg, const pd_tokenizer *tok, gw_kind kind,
                    const char *body, size_t len, char **resp_p, gw_oai_err *e);
void gw_oai_req_clear(gw_oai_req *r);

/* ------------------------------------------------------------------ */
/* tokenizer worker pool (gw_pool.c)                                   */
/* ------------------------------------------------------------------ */

typedef void (*gw_job_done_fn)(gw_job *job, void *ud);

/** A unit of work: prepare (parse, validate, render, tokenize) one body. */
struct gw_job {
    /* input (owned) */
    gw_kind kind;
    struct evbuffer *body; /* moved from the stream; touched by one thread at a time */
    /* output */
    int rc; /* 0 ok (req or resp valid), -1 (err valid) */
    gw_oai_req req;
    char *resp; /* GW_KIND_TOKENIZE / DETOKENIZE: the JSON answer (heap) */
    gw_oai_err err;
    /* delivery, loop thread only */
    gw_job_done_fn done;
    void *ud; /* NULL after gw_pool_cancel: the job is just freed */
    atomic_bool cancelled;
    gw_job *next;
};

/** Starts n worker threads. Errors: PD_ERR_IO (pipe), PD_ERR_NOMEM. */
pd_status gw_pool_init(gw_server *s, int n, gw_pool **p_p, pd_err *err);
/** Stops and joins the workers; pending jobs are freed without delivery. */
void gw_pool_free(gw_pool **p_p);
/** Queues job (consumed). done(job, ud) runs later on the loop thread; the
 * callee then owns job (free with gw_job_free). */
void gw_pool_submit(gw_pool *p, gw_job *job);
/** Loop thread: the job's owner went away; the job is freed when done. */
void gw_pool_cancel(gw_job *job);
void gw_job_free(gw_job *job);

/* ------------------------------------------------------------------ */
/* stop strings (gw_stop.c)                                            */
/* ------------------------------------------------------------------ */

/** Held-back text of one choice while a stop string may be starting. */
typedef struct {
    char *buf;
    size_t len, cap;
} gw_stopbuf;

/** Appends text to sb and decides what may be emitted now. Returns the
 * index of the stop string that matched (earliest match; ties to the
 * lowest index), or -1. *emit_p receives how many bytes at the start of
 * sb->buf are final text: with a match, the text before it (plus the stop
 * string when include_stop); else everything except the longest suffix
 * that is a proper prefix of some stop string (all of it when final). The
 * caller takes those bytes with gw_stopbuf_consume. Stop strings and text
 * are UTF-8, so a held suffix always starts on a character boundary.
 * Returns -2 on allocation failure. */
int gw_stop_feed(gw_stopbuf *sb, const char *text, size_t len, char *const *stops, int n_stops,
                 bool include_stop, bool final, size_t *emit_p);
void gw_stopbuf_consume(gw_stopbuf *sb, size_t n);
void gw_stopbuf_free(gw_stopbuf *sb);

/* ------------------------------------------------------------------ */
/* server (gw_server.c) and requests (gw_request.c)                    */
/* ------------------------------------------------------------------ */

typedef struct {
    char *path;
    pd_gw_get_fn fn;
    void *ctx;
} gw_route;

struct pd_gw_server {
    struct event_base *base;
    pd_gw_config cfg; /* strings point at the copies below */
    char *host, *model_name, *tokenizer_path, *certfile, *keyfile;
    pd_tokenizer *tok_owned;
    const pd_tokenizer *tok;
    pd_gw_engine_i engine;
    pd_gw_abort_choice_fn abort_choice; /* optional */
    void *engine_ctx;
    struct evconnlistener *listener;
    struct ssl_ctx_st *ssl_ctx; /* NULL: cleartext */
    int port;
    gw_conn *conns; /* doubly linked */
    int n_conns;    /* in conns; at most cfg.max_connections */
    uint64_t next_conn_id;
    uint64_t n_refused_conns;   /* answered 503 over max_connections */
    double refused_logged_at;   /* pd_now_s() of the last warning about them */
    struct event *accept_retry; /* re-enables the listener after EMFILE / ENFILE */
    gw_route *routes;
    int n_routes;
    gw_pool *pool;
    bool ready;
    bool shutting_down;
    int n_requests;              /* completions / chat requests alive (gw_request_begin .. req_free) */
    pd_gw_request *reqs;         /* those requests, doubly linked */
    bool drain_forced;           /* the drain's time ran out: the rest were shut down */
    bool draining;               /* pd_gw_server_drain: refuse new requests, wait for these */
    void (*drained)(void *ud);   /* called once when n_requests reaches 0 or the timer fires */
    void *drained_ud;
    struct event *drain_timer;
    double drain_deadline, flush_deadline; /* pd_now_s(): the drain's end; the last writes' (0: not yet) */
    pd_rng rng;      /* request ids */
    int64_t created; /* unix seconds at start: /v1/models "created" */
};

/** Which endpoint a request is for (gw_server_check_route). */
typedef enum {
    GW_EP_NONE = 0,    /* no such path */
    GW_EP_COMPLETIONS, /* POST /v1/completions */
    GW_EP_CHAT,        /* POST /v1/chat/completions */
    GW_EP_TOKENIZE,    /* POST /tokenize */
    GW_EP_DETOKENIZE,  /* POST /detokenize */
    GW_EP_VERSION,     /* GET /version */
    GW_EP_HEALTH,      /* GET /health */
    GW_EP_MODELS,      /* GET /v1/models */
    GW_EP_MODEL,       /* GET /v1/models/{model} */
    GW_EP_ROUTE,       /* a GET path added with pd_gw_server_add_get */
} gw_endpoint;

/** The verdict on a request from its method, path and headers alone. */
typedef struct {
    gw_endpoint ep;
    int route;        /* GW_EP_ROUTE: index into srv->routes; else -1 */
    int status;       /* 0: acceptable so far; else the refusal (404, 405, 415) */
    char message[256]; /* the refusal's message */
    const char *allow; /* 405: the Allow header's value (static); else NULL */
} gw_route_check;

/** Routes st by its method, path and request headers, without looking at
 * its body: an unknown path is 404, a method the path does not take is 405
 * (with the Allow value), a POST endpoint whose Content-Type is not JSON
 * (application/json, charset UTF-8 if any) is 415. gw_server_dispatch
 * answers with this verdict, and the HTTP/1.1 handler asks it when the
 * headers are complete so that `Expect: 100-continue` is answered with the
 * refusal instead of 100 (RFC 9110 §10.1.1). Needs st->method, st->path and
 * the headers; reads st->conn->srv; fills *out, never fails. */
void gw_server_check_route(const gw_stream *st, gw_route_check *out);

/** A complete request arrived on s: route it. Called by protocol handlers
 * from their read path (never re-entered from inside a response call). */
void gw_server_dispatch(gw_stream *s);
/** A completions / chat request is freed: one fewer for the drain. */
void gw_server_request_gone(gw_server *s);
/** The drain's time ran out: every request of s->reqs the engine still runs
 * is released from it and answered 503 "the server shut down before the
 * request finished" (in-band, then [DONE], once streaming), from the loop. */
void gw_requests_shut_down(gw_server *s);

/** POST /v1/completions and /v1/chat/completions (gw_request.c). refusal:
 * NULL, or gw_server_check_route's refusal of st (415), which is answered
 * with the request's X-Request-Id. */
void gw_request_begin(gw_stream *s, gw_kind kind, const gw_route_check *refusal);

/** POST /tokenize and /detokenize (gw_tokenize.c): the body goes through the
 * tokenizer pool (gw_oai_tokenize); the answer or the error is the response.
 * The Content-Type was checked (gw_server_check_route). */
void gw_tokenize_begin(gw_stream *s, gw_kind kind);

/** application/json, any case, optional parameters, no charset but UTF-8
 * (gw_request.c): what POST bodies must be sent as (else 415). */
bool gw_is_json_content_type(const char *ct);

#endif

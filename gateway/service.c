/* pdserve gateway: the HTTP front door plus the router, on one libevent
 * loop. */
#include <event2/event.h>
#include <malloc.h>
#include <signal.h>
#include <stdint.h>
#include <sys/resource.h>
#include <string.h>

#include "pd_flags.h"
#include "pd_router.h"
#include "pd_version.h"

typedef struct {
    struct event_base *base;
    pd_gw_server *gw;
    double shutdown_timeout; /* seconds */
    int n_signals;
} stopper;

static void on_drained(void *arg) {
    event_base_loopbreak(arg);
}

/* The first SIGTERM / SIGINT drains (pd_gw_server_drain: no new request,
 * those running finish, at most --shutdown-timeout s); a second one, or a
 * timeout of 0, stops at once (running requests are aborted). */
static void on_signal(evutil_socket_t sig, short what, void *arg) {
    (void)what;
    stopper *st = arg;
    pd_err err = {{0}};
    if (st->n_signals++ == 0 && st->shutdown_timeout > 0) {
        /* logged first: the drain's own lines follow it */
        PD_LOGI("gateway", "signal %d: draining (again to stop at once)", (int)sig);
        if (pd_gw_server_drain(st->gw, st->shutdown_timeout, on_drained, st->base, &err) == PD_OK)
            return;
        PD_LOGW("gateway", "cannot drain (%s): stopping at once", err.msg);
    }
    event_base_loopbreak(st->base);
}

/* Each connection is a descriptor: raise the soft RLIMIT_NOFILE towards the
 * hard one so that --max-connections can be reached (as nginx's
 * worker_rlimit_nofile); warn when the hard limit is below it. */
static void raise_fd_limit(int max_conns) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return;
    rlim_t want = (rlim_t)max_conns + 256; /* replicas' sockets, logs, the tokenizer */
    if (rl.rlim_cur < want && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max < want ? rl.rlim_max : want;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    if (rl.rlim_cur < want)
        PD_LOGW("gateway", "open-file limit %llu is below --max-connections %d + 256: accept() "
                "will fail before the limit is reached (raise ulimit -n)",
                (unsigned long long)rl.rlim_cur, max_conns);
}

int pd_gateway_main(int argc, char **argv) {
    const char *model = NULL, *host = "0.0.0.0", *control = "tcp://127.0.0.1:8001", *served = NULL;
    const char *tokenizer = NULL, *ssl_cert = NULL, *ssl_key = NULL;
    /* HTTP limits: the gateway's defaults, overridden by the flags */
    pd_gw_config gc;
    pd_gw_config_defaults(&gc);
    int max_streams = gc.max_concurrent_streams, max_conns = gc.max_connections;
    int max_header_count = gc.max_header_count;
    double max_body = (double)gc.max_request_body_bytes, max_header = (double)gc.max_header_bytes;
    double keep_alive = gc.timeout_keep_alive_s, t_headers = gc.timeout_request_headers_s;
    double t_body = gc.timeout_request_body_s, t_write = gc.timeout_write_s;
    const char *reasoning_parser = "deepseek_v3", *tool_call_parser = "deepseek_v3";
    int port = 8000, threshold = 1024, max_model_len = 0, heartbeat_ms = 500, max_stop = 16;
    int tok_pool = 2, max_logprobs = 20;
    int run_short = 256, run_long = 16, q_short = 1024, q_long = 256, prefill_jobs = 2;
    double request_timeout = 0, queue_timeout = 300, shutdown_timeout = 30;
    pd_flag flags[] = {
        {"model", PD_FLAG_STR, &model, "checkpoint directory (config.json, tokenizer.json)"},
        {"served-model-name", PD_FLAG_STR, &served, "the model name clients use (default: --model)"},
        {"tokenizer", PD_FLAG_STR, &tokenizer, "tokenizer.json (default: the model's)"},
        {"host", PD_FLAG_STR, &host, "HTTP listen address (default 0.0.0.0)"},
        {"port", PD_FLAG_INT, &port, "HTTP port (default 8000)"},
        {"control", PD_FLAG_STR, &control, "control endpoint replicas connect to (default tcp://127.0.0.1:8001)"},
        {"long-prompt-threshold", PD_FLAG_INT, &threshold, "longer prompts go through a prefill replica (1024)"},
        {"max-model-len", PD_FLAG_INT, &max_model_len, "prompt + completion tokens (default: the model's)"},
        {"max-stop-strings", PD_FLAG_INT, &max_stop, "stop strings per request (16)"},
        {"max-logprobs", PD_FLAG_INT, &max_logprobs, "largest top_logprobs (20)"},
        {"tokenizer-pool-size", PD_FLAG_INT, &tok_pool, "tokenizer threads (2)"},
        {"heartbeat-interval-ms", PD_FLAG_INT, &heartbeat_ms, "replica load report period (500)"},
        {"max-concurrent-requests-short", PD_FLAG_INT, &run_short, "short prompts dispatched at once (256)"},
        {"max-concurrent-requests-long", PD_FLAG_INT, &run_long, "long prompts dispatched at once (16)"},
        {"max-queued-requests-short", PD_FLAG_INT, &q_short, "short prompts waiting; more -> 429 (1024)"},
        {"max-queued-requests-long", PD_FLAG_INT, &q_long, "long prompts waiting; more -> 429 (256)"},
        {"max-prefill-jobs-per-replica", PD_FLAG_INT, &prefill_jobs,
         "long prompts one prefill replica holds at once (reserved, queued or computing); more wait at the gateway (2)"},
        {"request-timeout", PD_FLAG_FLOAT, &request_timeout, "seconds from arrival to the last token (0: none)"},
        {"queue-timeout", PD_FLAG_FLOAT, &queue_timeout,
         "seconds a request may wait in the gateway's queue (for a dispatch slot, a prefill job slot or a decode "
         "replica's KV room) before 503 with Retry-After (300; 0: none)"},
        {"shutdown-timeout", PD_FLAG_FLOAT, &shutdown_timeout,
         "on SIGTERM / SIGINT, seconds running requests may take to finish while new connections are refused and new "
         "requests on open ones get 503 (30; 0: stop at once; a second signal stops at once)"},
        {"ssl-certfile", PD_FLAG_STR, &ssl_cert, "PEM certificate: serve HTTPS (ALPN h2 / http/1.1)"},
        {"ssl-keyfile", PD_FLAG_STR, &ssl_key, "PEM private key of --ssl-certfile"},
        {"max-concurrent-streams", PD_FLAG_INT, &max_streams, "HTTP/2 streams per connection (100)"},
        {"max-connections", PD_FLAG_INT, &max_conns, "open client connections; one more gets 503 and is closed (16384)"},
        {"max-request-body-bytes", PD_FLAG_FLOAT, &max_body, "largest request body; larger -> 413 (33554432 = 32 MiB)"},
        {"max-header-bytes", PD_FLAG_FLOAT, &max_header, "request line + headers; more -> 431 (65536)"},
        {"max-header-count", PD_FLAG_INT, &max_header_count, "request header fields; more -> 431 (100)"},
        {"timeout-keep-alive", PD_FLAG_FLOAT, &keep_alive, "seconds a connection with no request in progress stays open (5)"},
        {"timeout-request-headers", PD_FLAG_FLOAT, &t_headers, "seconds for a request's line and headers to arrive; else 408 (30)"},
        {"timeout-request-body", PD_FLAG_FLOAT, &t_body, "seconds for a request's body to arrive after its headers; else 408 (60)"},
        {"timeout-write", PD_FLAG_FLOAT, &t_write, "seconds without write progress before a connection (h2: stream) is dropped; 0: never (60)"},
        {"reasoning-parser", PD_FLAG_STR, &reasoning_parser, "deepseek_v3 (default) or none: <think>...</think> -> reasoning_content"},
        {"tool-call-parser", PD_FLAG_STR, &tool_call_parser, "deepseek_v3 (default; V3 and V3.1 forms) or deepseek_dsml (V3.2)"},
    };
    int rc = pd_flags_parse("gateway", flags, (int)(sizeof flags / sizeof flags[0]), argc, argv);
    if (rc) return rc == 1 ? 0 : 2;
    pd_version_log("gateway");
    if (!model) {
        fprintf(stderr, "pdserve gateway: --model is required\n");
        return 2;
    }
    pd_err err = {{0}};
    pd_chat_reasoning_parser rp;
    pd_chat_tool_parser tp;
    if (pd_chat_reasoning_parser_from_str(reasoning_parser, &rp, &err) != PD_OK ||
        pd_chat_tool_parser_from_str(tool_call_parser, &tp, &err) != PD_OK) {
        fprintf(stderr, "pdserve gateway: %s\n", err.msg);
        return 2;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", model);
    pd_model_config mc;
    if (pd_config_load(path, &mc, &err) != PD_OK) {
        fprintf(stderr, "pdserve gateway: %s\n", err.msg);
        return 1;
    }
    uint64_t weights_fp = 0; /* replicas with other weights are refused (none here: the first one's) */
    pd_err werr = {{0}};
    if (pd_checkpoint_fingerprint(model, &weights_fp, &werr) != PD_OK)
        PD_LOGI("gateway", "no weights read in %s (%s): replicas' weights are compared with the first one's", model,
                werr.msg);
    char tokpath[4096];
    snprintf(tokpath, sizeof tokpath, "%s/tokenizer.json", model);
    signal(SIGPIPE, SIG_IGN);
    if (run_short < 1 || run_long < 1 || prefill_jobs < 1 || q_short < 0 || q_long < 0 || request_timeout < 0 ||
        queue_timeout < 0 || !(shutdown_timeout >= 0 && shutdown_timeout <= 1e6)) {
        fprintf(stderr, "pdserve gateway: concurrency limits (and --max-prefill-jobs-per-replica) must be >= 1, "
                        "queue sizes, --request-timeout, --queue-timeout and --shutdown-timeout (at most 1e6) "
                        ">= 0\n");
        return 2;
    }
    if (threshold < 0) {
        fprintf(stderr, "pdserve gateway: --long-prompt-threshold %d must be >= 0 (tokens)\n", threshold);
        return 2;
    }
    if (max_model_len < 0) {
        fprintf(stderr, "pdserve gateway: --max-model-len %d must be > 0 (0: the model's %d)\n", max_model_len,
                mc.max_position_embeddings);
        return 2;
    }
    if (max_model_len > mc.max_position_embeddings) {
        /* vLLM refuses it too: past the model's positions a prompt would
         * fail on a replica (500) after prefill work, not be refused (400) */
        fprintf(stderr, "pdserve gateway: --max-model-len %d is more than the model's %d positions "
                        "(max_position_embeddings in %s)\n", max_model_len, mc.max_position_embeddings, path);
        return 2;
    }
    if (!(max_body >= 1 && max_body <= (double)SIZE_MAX) || !(max_header >= 0 && max_header <= 1e12)) {
        fprintf(stderr, "pdserve gateway: --max-request-body-bytes must be >= 1, --max-header-bytes >= 0\n");
        return 2;
    }
    struct event_base *base = event_base_new(); /* after the checks: an early exit leaks nothing */
    pd_router_config rc_cfg = {.control_endpoint = control, .long_prompt_threshold = threshold,
                               .heartbeat_interval_ms = heartbeat_ms, .model_fingerprint = pd_config_fingerprint(&mc),
                               .weights_fingerprint = weights_fp,
                               .model_name = served ? served : model, .max_running = {run_short, run_long},
                               .max_queued = {q_short, q_long}, .request_timeout_s = request_timeout,
                               .queue_timeout_s = queue_timeout,
                               .max_prefill_jobs_per_replica = prefill_jobs};
    pd_router *router = NULL;
    if (pd_router_init(base, &rc_cfg, &router, &err) != PD_OK) {
        fprintf(stderr, "pdserve gateway: %s\n", err.msg);
        event_base_free(base);
        return 1;
    }
    raise_fd_limit(max_conns);
    gc.host = host;
    gc.port = port;
    gc.served_model_name = served ? served : model;
    gc.tokenizer = tokenizer ? tokenizer : tokpath;
    gc.max_model_len = max_model_len > 0 ? max_model_len : mc.max_position_embeddings;
    gc.vocab_size = mc.vocab_size;
    gc.max_stop_strings = max_stop;
    gc.max_logprobs = max_logprobs;
    gc.tokenizer_pool_size = tok_pool;
    gc.ssl_certfile = ssl_cert;
    gc.ssl_keyfile = ssl_key;
    gc.max_concurrent_streams = max_streams;
    gc.max_connections = max_conns;
    gc.max_request_body_bytes = (size_t)max_body;
    gc.max_header_bytes = (size_t)max_header;
    gc.max_header_count = max_header_count;
    gc.timeout_keep_alive_s = keep_alive;
    gc.timeout_request_headers_s = t_headers;
    gc.timeout_request_body_s = t_body;
    gc.timeout_write_s = t_write;
    gc.reasoning_parser = rp;
    gc.tool_call_parser = tp;
    pd_gw_server *gw = NULL;
    if (pd_gw_server_init(base, &gc, pd_router_engine(), router, &gw, &err) != PD_OK) {
        fprintf(stderr, "pdserve gateway: %s\n", err.msg);
        pd_router_free(&router);
        event_base_free(base);
        return 1;
    }
    pd_router_attach(router, gw);
    /* Loading tokenizer.json leaves tens of MB free inside the heap; hand
     * those pages back so that RSS shows what serving uses (memory per
     * idle connection, docs/benchmarks.md) */
    malloc_trim(0);
    stopper stop = {.base = base, .gw = gw, .shutdown_timeout = shutdown_timeout};
    struct event *sigint = evsignal_new(base, SIGINT, on_signal, &stop);
    struct event *sigterm = evsignal_new(base, SIGTERM, on_signal, &stop);
    event_add(sigint, NULL);
    event_add(sigterm, NULL);
    PD_LOGI("gateway", "listening on %s://%s:%d, control %s, model %s (max_model_len %d, long prompts > %d tokens)",
            ssl_cert ? "https" : "http", host, pd_gw_server_port(gw), control, gc.served_model_name,
            gc.max_model_len, threshold);
    event_base_dispatch(base);
    PD_LOGI("gateway", "stopping");
    pd_gw_server_free(&gw);
    pd_router_free(&router);
    event_free(sigint);
    event_free(sigterm);
    /* the bufferevents of connections that were still open finish freeing
     * from the loop (pd_gw_server_free): only they are left on the base */
    event_base_loop(base, EVLOOP_NONBLOCK);
    event_base_free(base);
    return 0;
}

/* `pdserve bench <mode> [flags]`: flags, setup (server, model name,
 * tokenizer, output directory), the run, the report. See docs/bench.md. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "pd_bench.h"
#include "pd_flags.h"

static void usage(FILE *f) {
    fputs("usage: pdserve bench <mode> [flags]   (`pdserve bench <mode> --help` lists the flags)\n"
          "modes:\n"
          "  matrix      input/output shapes x client concurrency x rounds (closed loop)\n"
          "  rate        Poisson arrivals at each rate, SLO compliance per round\n"
          "  retrieval   codes hidden at 10/50/90% of a long document, exact-match score\n"
          "  functional  chat checks: integer answer, JSON extraction, multi-turn memory,\n"
          "              streaming == non-streaming, tool call round trip\n",
          f);
}

/* "a,b,c" of positive integers into out (at most PD_BENCH_MAX_LIST). */
static int parse_ints(const char *flag, const char *s, int *out, int *n_p, int min) {
    int n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < min || v > 100000000L || (*end && *end != ',') ||
            n == PD_BENCH_MAX_LIST) {
            fprintf(stderr, "pdserve bench: --%s '%s': a list of integers >= %d (at most %d)\n",
                    flag, s, min, PD_BENCH_MAX_LIST);
            return -1;
        }
        out[n++] = (int)v;
        p = *end ? end + 1 : end;
    }
    if (n == 0) {
        fprintf(stderr, "pdserve bench: --%s is empty\n", flag);
        return -1;
    }
    *n_p = n;
    return 0;
}

static int parse_rates(const char *s, double *out, int *n_p) {
    int n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        double v = strtod(p, &end);
        if (end == p || errno || !(v > 0) || isinf(v) || (*end && *end != ',') ||
            n == PD_BENCH_MAX_LIST) {
            fprintf(stderr, "pdserve bench: --rates '%s': a list of positive requests/s\n", s);
            return -1;
        }
        out[n++] = v;
        p = *end ? end + 1 : end;
    }
    *n_p = n;
    return n ? 0 : -1;
}

/* "1024/128,8192/128" into the shape lists. */
static int parse_shapes(const char *s, pd_bench_config *c) {
    int n = 0;
    const char *p = s;
    while (*p) {
        char *end, *end2;
        long in = strtol(p, &end, 10);
        long out = *end == '/' ? strtol(end + 1, &end2, 10) : -1;
        if (end == p || *end != '/' || in < 1 || out < 1 || in > 100000000L || out > 100000000L ||
            (*end2 && *end2 != ',') || n == PD_BENCH_MAX_LIST) {
            fprintf(stderr,
                    "pdserve bench: --shapes '%s': a list of INPUT/OUTPUT token counts, "
                    "e.g. 1024/128,8192/128\n",
                    s);
            return -1;
        }
        c->shape_in[n] = (int)in, c->shape_out[n] = (int)out;
        n++;
        p = *end2 ? end2 + 1 : end2;
    }
    c->n_shapes = n;
    return n ? 0 : -1;
}

static void join_command(char *out, size_t cap, int argc, char **argv) {
    size_t k = (size_t)snprintf(out, cap, "pdserve");
    for (int i = 0; i < argc && k < cap; i++) {
        bool q = strpbrk(argv[i], " \t'\"{}$") != NULL;
        k += (size_t)snprintf(out + k, cap - k, q ? " '%s'" : " %s", argv[i]);
    }
}

static int mkdir_p(const char *dir) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", dir);
    for (char *p = tmp + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            if (mkdir(tmp, 0777) && errno != EEXIST)
                return -1;
            *p = '/';
        }
    return mkdir(tmp, 0777) && errno != EEXIST ? -1 : 0;
}

static bool file_exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

/* The flags of one mode: the common ones and its own. */
typedef struct {
    const char *shapes, *conc, *reqs, *rates, *tokens, *endpoint;
    bool no_ignore_eos;
} raw_flags;

static int parse_flags(pd_bench_config *c, raw_flags *rf, int argc, char **argv) {
    pd_flag all[40];
    int n = 0;
#define F(name, kind, dst, help) all[n++] = (pd_flag){name, kind, dst, help}
    F("base-url", PD_FLAG_STR, &c->base_url, "server, default http://127.0.0.1:8000");
    F("served-model-name", PD_FLAG_STR, &c->served_model_name,
      "model name in requests (default: the first of GET /v1/models)");
    F("model", PD_FLAG_STR, &c->model_dir, "model directory (its tokenizer.json builds prompts)");
    F("tokenizer", PD_FLAG_STR, &c->tokenizer_path, "tokenizer.json (instead of --model)");
    F("out", PD_FLAG_STR, &c->out_dir, "output directory (default bench-MODE-DATE)");
    F("http2", PD_FLAG_BOOL, &c->http2, "HTTP/2 (h2c prior knowledge on http://)");
    F("timeout", PD_FLAG_FLOAT, &c->timeout_s, "seconds a request may take (default 600)");
    F("temperature", PD_FLAG_FLOAT, &c->temperature, "sampling temperature (default 0)");
    F("seed", PD_FLAG_INT, &c->seed, "seed of the prompt text and arrivals (default 1)");
    F("api-key", PD_FLAG_STR, &c->api_key, "Authorization: Bearer KEY (default $OPENAI_API_KEY)");
    F("extra-body", PD_FLAG_STR, &c->extra_body, "JSON object merged into every request body");
    F("quiet", PD_FLAG_BOOL, &c->quiet, "no progress on stderr");
    if (c->mode == PD_BENCH_MATRIX || c->mode == PD_BENCH_RATE) {
        F("endpoint", PD_FLAG_STR, &rf->endpoint, "completions (default) or chat");
        F("no-ignore-eos", PD_FLAG_BOOL, &rf->no_ignore_eos,
          "let answers stop at EOS (then only completion_tokens <= max_tokens is checked)");
        F("rounds", PD_FLAG_INT, &c->rounds, "measured rounds per group (default 3)");
        F("warmup", PD_FLAG_INT, &c->warmup,
          "warm-up requests per group, not measured (default: matrix the concurrency, rate 1)");
        F("stop-after-failed-rounds", PD_FLAG_INT, &c->stop_after_failed_rounds,
          "stop a phase after N consecutive rounds with a failure (default 3, 0 never)");
    }
    if (c->mode == PD_BENCH_MATRIX) {
        F("shapes", PD_FLAG_STR, &rf->shapes,
          "INPUT/OUTPUT tokens list (default 1024/128,8192/128,1024/512,24576/128)");
        F("concurrency", PD_FLAG_STR, &rf->conc, "client concurrency list (default 1,8,32)");
        F("requests", PD_FLAG_STR, &rf->reqs,
          "requests per round, one per concurrency or one for all (default 8,16,64)");
    }
    if (c->mode == PD_BENCH_RATE) {
        F("shapes", PD_FLAG_STR, &rf->shapes, "one INPUT/OUTPUT shape (default 1024/128)");
        F("rates", PD_FLAG_STR, &rf->rates, "arrival rates, requests/s (default 0.3,0.48,0.66)");
        F("requests", PD_FLAG_STR, &rf->reqs, "requests per round (default 200)");
        F("slo-ttft", PD_FLAG_FLOAT, &c->slo_ttft_s, "TTFT SLO, seconds (default 3)");
        F("slo-tpot", PD_FLAG_FLOAT, &c->slo_tpot_s, "TPOT SLO, seconds (default 0.05)");
    }
    if (c->mode == PD_BENCH_RETRIEVAL) {
        F("tokens", PD_FLAG_STR, &rf->tokens,
          "document lengths in prompt tokens (default 32768,131072,1048576)");
        F("rounds", PD_FLAG_INT, &c->rounds, "documents per length (default 1)");
        F("max-tokens", PD_FLAG_INT, &c->max_tokens, "answer length limit (default 128)");
    }
    if (c->mode == PD_BENCH_FUNCTIONAL) {
        F("repeat", PD_FLAG_INT, &c->repeat, "times each check runs (default 3)");
        F("max-tokens", PD_FLAG_INT, &c->max_tokens, "answer length limit (default 256)");
    }
#undef F
    char cmd[32];
    snprintf(cmd, sizeof cmd, "bench %s", argv[0]);
    return pd_flags_parse(cmd, all, n, argc, argv);
}

static int configure(pd_bench_config *c, int argc, char **argv) {
    raw_flags rf = {0};
    c->base_url = "http://127.0.0.1:8000";
    c->timeout_s = 600;
    c->seed = 1;
    c->ignore_eos = true;
    c->warmup = -1;
    c->stop_after_failed_rounds = 3;
    c->slo_ttft_s = 3;
    c->slo_tpot_s = 0.05;
    c->rounds = c->mode == PD_BENCH_RETRIEVAL ? 1 : 3;
    c->repeat = 3;
    c->max_tokens = c->mode == PD_BENCH_FUNCTIONAL ? 256 : 128;
    c->api_key = getenv("OPENAI_API_KEY");
    int rc = parse_flags(c, &rf, argc, argv);
    if (rc)
        return rc == 1 ? 0 : 2;
    if (rf.no_ignore_eos)
        c->ignore_eos = false;
    if (rf.endpoint) {
        if (!strcmp(rf.endpoint, "chat"))
            c->endpoint = PD_BENCH_EP_CHAT;
        else if (strcmp(rf.endpoint, "completions")) {
            fprintf(stderr, "pdserve bench: --endpoint is completions or chat\n");
            return 2;
        }
    }
    if (c->rounds < 1 || c->rounds > 1000 || c->repeat < 1 || c->max_tokens < 1 ||
        !(c->timeout_s >= 0) || c->warmup < -1 || c->stop_after_failed_rounds < 0) {
        fprintf(stderr, "pdserve bench: --rounds, --repeat, --max-tokens must be >= 1, --timeout "
                        "and --warmup >= 0\n");
        return 2;
    }
    if (c->mode == PD_BENCH_MATRIX) {
        if (parse_shapes(rf.shapes ? rf.shapes : "1024/128,8192/128,1024/512,24576/128", c) ||
            parse_ints("concurrency", rf.conc ? rf.conc : "1,8,32", c->conc, &c->n_conc, 1) ||
            parse_ints("requests", rf.reqs ? rf.reqs : "8,16,64", c->reqs, &c->n_reqs, 1))
            return 2;
        if (c->n_reqs != 1 && c->n_reqs != c->n_conc) {
            fprintf(stderr, "pdserve bench: --requests needs one value or one per concurrency\n");
            return 2;
        }
    } else if (c->mode == PD_BENCH_RATE) {
        if (parse_shapes(rf.shapes ? rf.shapes : "1024/128", c) ||
            parse_rates(rf.rates ? rf.rates : "0.3,0.48,0.66", c->rates, &c->n_rates) ||
            parse_ints("requests", rf.reqs ? rf.reqs : "200", c->reqs, &c->n_reqs, 1))
            return 2;
        if (c->n_shapes != 1 || c->n_reqs != 1) {
            fprintf(stderr, "pdserve bench rate: one --shapes and one --requests value\n");
            return 2;
        }
    } else if (c->mode == PD_BENCH_RETRIEVAL) {
        if (parse_ints("tokens", rf.tokens ? rf.tokens : "32768,131072,1048576", c->tokens,
                       &c->n_tokens, 200))
            return 2;
    }
    return -1; /* go on */
}

/* The first Ctrl-C stops the run and still writes the report; a second one
 * kills the process. */
static void on_signal(int sig) {
    if (pd_bench_stop_requested()) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    pd_bench_stop_request();
}

int pd_bench_main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    pd_bench_config cfg = {0};
    const char *m = argv[1];
    if (!strcmp(m, "matrix"))
        cfg.mode = PD_BENCH_MATRIX;
    else if (!strcmp(m, "rate"))
        cfg.mode = PD_BENCH_RATE;
    else if (!strcmp(m, "retrieval"))
        cfg.mode = PD_BENCH_RETRIEVAL;
    else if (!strcmp(m, "functional"))
        cfg.mode = PD_BENCH_FUNCTIONAL;
    else {
        fprintf(stderr, "pdserve bench: unknown mode '%s'\n", m);
        usage(stderr);
        return 2;
    }
    int rc = configure(&cfg, argc - 1, argv + 1);
    if (rc >= 0)
        return rc;
    join_command(cfg.command, sizeof cfg.command, argc, argv);
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = {0}, old_int, old_term;
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);

    pd_bench_run run = {0};
    run.cfg = &cfg;
    run.t_origin = pd_now_s();
    pd_rng_seed(&run.rng, (uint64_t)cfg.seed);
    time_t now = time(NULL);
    struct tm tmv;
    gmtime_r(&now, &tmv);
    strftime(run.started_at, sizeof run.started_at, "%Y-%m-%dT%H:%M:%SZ", &tmv);
    struct utsname un;
    if (uname(&un) == 0)
        snprintf(run.host_info, sizeof run.host_info, "%s, %s %s %s, %ld CPUs", un.nodename,
                 un.sysname, un.release, un.machine, sysconf(_SC_NPROCESSORS_ONLN));
    char outbuf[128];
    if (!cfg.out_dir) {
        char ts[32];
        strftime(ts, sizeof ts, "%Y%m%d-%H%M%S", &tmv);
        snprintf(outbuf, sizeof outbuf, "bench-%s-%s", m, ts);
        cfg.out_dir = outbuf;
    }
    pd_err err = {{0}};
    rc = 2;
    char tokpath[4096];
    if (cfg.extra_body) {
        json_error_t je;
        run.extra = json_loads(cfg.extra_body, 0, &je);
        if (!json_is_object(run.extra)) {
            fprintf(stderr, "pdserve bench: --extra-body is not a JSON object: %s\n", je.text);
            goto out;
        }
    }
    pd_bench_client_opts co = {cfg.base_url, cfg.http2, cfg.timeout_s, cfg.api_key};
    if (pd_bench_client_init(&co, &run.client, &err) != PD_OK) {
        fprintf(stderr, "pdserve bench: %s\n", err.msg);
        goto out;
    }
    /* the served model name */
    if (cfg.served_model_name)
        snprintf(run.model, sizeof run.model, "%s", cfg.served_model_name);
    else {
        json_t *models = NULL;
        if (pd_bench_client_get_json(run.client, "/v1/models", &models, &err) != PD_OK) {
            fprintf(stderr, "pdserve bench: %s (is the server up? --base-url)\n", err.msg);
            goto out;
        }
        const char *id = json_string_value(
            json_object_get(json_array_get(json_object_get(models, "data"), 0), "id"));
        if (id)
            snprintf(run.model, sizeof run.model, "%s", id);
        json_decref(models);
        if (!id) {
            fprintf(stderr, "pdserve bench: /v1/models lists no model; give --served-model-name\n");
            goto out;
        }
    }
    /* the tokenizer: --tokenizer, --model DIR, or a served name that is a directory */
    if (!cfg.tokenizer_path) {
        const char *dir = cfg.model_dir ? cfg.model_dir : run.model;
        snprintf(tokpath, sizeof tokpath, "%s/tokenizer.json", dir);
        if (cfg.model_dir || file_exists(tokpath))
            cfg.tokenizer_path = tokpath;
    }
    if (!cfg.tokenizer_path && cfg.mode != PD_BENCH_FUNCTIONAL) {
        fprintf(stderr, "pdserve bench: prompts of an exact length need the model's tokenizer: "
                        "--model DIR or --tokenizer FILE\n");
        goto out;
    }
    if (cfg.tokenizer_path) {
        if (pd_bench_tok_load(cfg.tokenizer_path, &run.tok, &err) != PD_OK) {
            fprintf(stderr, "pdserve bench: %s\n", err.msg);
            goto out;
        }
        run.have_tok = true;
    }
    if (mkdir_p(cfg.out_dir)) {
        fprintf(stderr, "pdserve bench: cannot create %s: %s\n", cfg.out_dir, strerror(errno));
        goto out;
    }
    char path[4200];
    snprintf(path, sizeof path, "%s/requests.csv", cfg.out_dir);
    run.requests_csv = fopen(path, "w");
    if (!run.requests_csv) {
        fprintf(stderr, "pdserve bench: cannot write %s: %s\n", path, strerror(errno));
        goto out;
    }
    pd_bench_csv_request(run.requests_csv, &run, NULL);
    if (!cfg.quiet)
        fprintf(stderr, "pdserve bench %s: %s, model '%s', results in %s\n", m, cfg.base_url,
                run.model, cfg.out_dir);
    pd_status st = pd_bench_run_mode(&run, &err);
    if (st != PD_OK)
        fprintf(stderr, "pdserve bench: %s\n", err.msg);
    /* a report of what ran, even after an error */
    pd_err err2 = {{0}};
    if (pd_bench_report_write(&run, &err2) != PD_OK) {
        fprintf(stderr, "pdserve bench: %s\n", err2.msg);
        goto out;
    }
    if (!cfg.quiet)
        fprintf(stderr,
                "pdserve bench: wrote %s/report.html, summary.json, rounds.csv, "
                "requests.csv%s\n",
                cfg.out_dir, run.failed_files ? ", failed/" : "");
    rc = st != PD_OK ? 2 : run.interrupted ? 130 : run.any_failure ? 1 : 0;
out:
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (run.requests_csv)
        fclose(run.requests_csv);
    for (int i = 0; i < run.n_groups; i++)
        free(run.groups[i].rounds);
    free(run.groups);
    json_decref(run.extra);
    if (run.have_tok)
        pd_bench_tok_free(&run.tok);
    pd_bench_client_free(&run.client);
    return rc;
}

/* The four modes of `pdserve bench` (issue 7):
 *
 *   matrix      shapes (input/output tokens) x client concurrency x rounds,
 *               closed loop, a warm-up per group that is not measured;
 *   rate        Poisson arrivals at each rate, no concurrency cap, SLO
 *               compliance per round;
 *   retrieval   three codes hidden at 10%, 50%, 90% of a synthetic document,
 *               the answer scored by exact match;
 *   functional  a few chat checks with strict validation.
 *
 * A phase (one shape of the matrix across its concurrencies; the whole rate
 * scan) stops after --stop-after-failed-rounds consecutive rounds with a
 * failed request; the rounds left are kept as "not run". */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pd_bench.h"

/* ---- request bodies --------------------------------------------------------- */

/* The JSON body: model, prompt (completions: a string or an id array) or
 * messages (chat), max_tokens, temperature, ignore_eos, stream with usage,
 * then the fields of more and of --extra-body. Consumes prompt and more.
 * Returns the body text (heap) or NULL when out of memory. */
static char *make_body(const pd_bench_run *run, pd_bench_endpoint ep, json_t *prompt,
                       int max_tokens, bool ignore_eos, bool stream, json_t *more) {
    json_t *b = json_object();
    if (!b) {
        json_decref(prompt);
        json_decref(more);
        return NULL;
    }
    json_object_set_new(b, "model", json_string(run->model));
    json_object_set_new(b, ep == PD_BENCH_EP_CHAT ? "messages" : "prompt", prompt);
    json_object_set_new(b, "max_tokens", json_integer(max_tokens));
    json_object_set_new(b, "temperature", json_real(run->cfg->temperature));
    if (ignore_eos)
        json_object_set_new(b, "ignore_eos", json_true());
    if (stream) {
        json_object_set_new(b, "stream", json_true());
        json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
    }
    if (more)
        json_object_update(b, more);
    json_decref(more);
    if (run->extra)
        json_object_update(b, run->extra);
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

static json_t *user_messages(const char *content) {
    return json_pack("[{s:s,s:s}]", "role", "user", "content", content);
}

/* Fills r's body with a prompt the server counts as n tokens (see
 * bench_prompt.c on BOS). Text when an exact text exists, else token ids
 * (/v1/completions only). */
static pd_status load_prompt(pd_bench_run *run, pd_bench_req *r, pd_bench_endpoint ep, int n,
                             int out_tokens, pd_err *err) {
    const pd_bench_config *cfg = run->cfg;
    pd_bench_req_init(r);
    r->endpoint = ep;
    r->stream = true;
    r->max_tokens = out_tokens;
    r->exact_length = cfg->ignore_eos;
    json_t *prompt = NULL;
    if (ep == PD_BENCH_EP_CHAT) {
        int content = n - run->tok.chat_overhead;
        if (content < 1)
            return pd_err_set(err, PD_ERR_INVALID,
                              "bench: a chat prompt of %d tokens leaves no room (the template "
                              "takes %d)",
                              n, run->tok.chat_overhead);
        char *text = NULL;
        pd_status st = PD_ERR_NOTFOUND;
        for (int attempt = 0; attempt < 4 && st == PD_ERR_NOTFOUND; attempt++)
            st = pd_bench_prompt_text(run->tok.tok, &run->rng, content, &text, err);
        if (st != PD_OK)
            return st;
        r->prompt_tokens_local = pd_bench_chat_tokens(&run->tok, text);
        prompt = user_messages(text);
        free(text);
    } else {
        int bos = run->tok.add_bos ? 1 : 0;
        char *text = NULL;
        pd_status st = n - bos >= 1 ? PD_ERR_NOTFOUND : PD_ERR_INVALID;
        for (int attempt = 0; attempt < 4 && st == PD_ERR_NOTFOUND; attempt++)
            st = pd_bench_prompt_text(run->tok.tok, &run->rng, n - bos, &text, err);
        if (st == PD_OK) {
            prompt = json_string(text);
            free(text);
            r->prompt_tokens_local = n;
        } else {
            /* no exact text: token ids, BOS first as the server would add it */
            int32_t *ids = NULL;
            if (n - bos >= 1 &&
                (st = pd_bench_prompt_ids(run->tok.tok, &run->rng, n - bos, &ids, err)) != PD_OK)
                return st;
            prompt = json_array();
            if (bos)
                json_array_append_new(prompt, json_integer(run->tok.bos_id));
            for (int i = 0; i < n - bos; i++)
                json_array_append_new(prompt, json_integer(ids[i]));
            free(ids);
            r->prompt_is_ids = true;
            r->prompt_tokens_local = n;
        }
    }
    if (!prompt)
        return pd_err_set(err, PD_ERR_NOMEM, "bench: out of memory building a prompt");
    r->body = make_body(run, ep, prompt, out_tokens, cfg->ignore_eos, true, NULL);
    if (!r->body)
        return pd_err_set(err, PD_ERR_NOMEM, "bench: out of memory building a request");
    return PD_OK;
}

/* ---- recording ------------------------------------------------------------- */

static void failed_name(const pd_bench_req *r, char *out, size_t cap) {
    snprintf(out, cap, "failed/g%03d-r%d-%05d.sse", r->group, r->round, r->index);
}

static void write_failed(pd_bench_run *run, const pd_bench_req *r) {
    char rel[96], path[4200];
    failed_name(r, rel, sizeof rel);
    snprintf(path, sizeof path, "%s/failed", run->cfg->out_dir);
    mkdir(path, 0777);
    snprintf(path, sizeof path, "%s/%s", run->cfg->out_dir, rel);
    FILE *f = fopen(path, "wb");
    if (!f) {
        PD_LOGW("bench", "cannot write %s: %s", path, strerror(errno));
        return;
    }
    /* SSE comments first: the file stays a valid event stream */
    fprintf(f, ": pdserve bench failed request: group %s round %d index %d\n",
            run->groups[r->group].name, r->round, r->index);
    fprintf(f, ": outcome %s: %s\n: http_status %ld\n", pd_bench_outcome_str(r->outcome), r->detail,
            r->http_status);
    fprintf(f, ": request %s\n", r->body ? r->body : "");
    if (r->raw_truncated)
        fprintf(f, ": (raw answer truncated at %u bytes)\n", PD_BENCH_RAW_MAX);
    fprintf(f, ":\n");
    if (r->raw.len)
        fwrite(r->raw.data, 1, r->raw.len, f);
    fclose(f);
    run->failed_files++;
}

static void record(pd_bench_run *run, pd_bench_req *reqs, int n) {
    for (int i = 0; i < n; i++) {
        pd_bench_req *r = &reqs[i];
        if (r->round > 0 && r->http_version) {
            int v = r->http_version;
            run->http_versions[v == 10 ? 0 : v == 11 ? 1 : v == 20 ? 2 : 3]++;
        }
        if (run->cfg->mode == PD_BENCH_FUNCTIONAL) {
            run->fn_requests++;
            if (r->outcome == PD_BENCH_SUCCESS)
                run->fn_successes++;
            else
                run->fn_failures[r->outcome]++;
        }
        if (r->outcome != PD_BENCH_SUCCESS) {
            write_failed(run, r);
            if (r->round > 0)
                run->any_failure = true;
            if (run->n_notes < (int)(sizeof run->notes / sizeof run->notes[0])) {
                char rel[96];
                failed_name(r, rel, sizeof rel);
                snprintf(run->notes[run->n_notes++], sizeof run->notes[0],
                         "%s round %d #%d: %s: %s (%s)", run->groups[r->group].name, r->round,
                         r->index, pd_bench_outcome_str(r->outcome), r->detail, rel);
            }
        }
        if (run->requests_csv)
            pd_bench_csv_request(run->requests_csv, run, r);
    }
    if (run->requests_csv)
        fflush(run->requests_csv);
}

/* ---- progress ------------------------------------------------------------- */

typedef struct {
    const pd_bench_run *run;
    const char *group;
    int round, rounds;
} progress_ctx;

static void progress(void *arg, int started, int finished, int failed, int n, double elapsed) {
    progress_ctx *p = arg;
    if (p->run->cfg->quiet || !isatty(2))
        return;
    if (p->round)
        fprintf(stderr, "\r\033[K%s round %d/%d: %d/%d started, %d done, %d failed, %.1f s",
                p->group, p->round, p->rounds, started, n, finished, failed, elapsed);
    else
        fprintf(stderr, "\r\033[K%s warm-up: %d/%d started, %d done, %d failed, %.1f s", p->group,
                started, n, finished, failed, elapsed);
    fflush(stderr);
}

static void round_line(const pd_bench_run *run, const pd_bench_group *g, const pd_bench_round *rd) {
    if (run->cfg->quiet)
        return;
    if (isatty(2))
        fprintf(stderr, "\r\033[K");
    fprintf(stderr,
            "%s round %d/%d: %d/%d ok, %.1f tok/s, TTFT p50 %.3f p95 %.3f s, TPOT p50 %.4f s",
            g->name, rd->round, g->n_rounds, rd->successes, rd->requests, rd->throughput_tok_s,
            rd->ttft.p50, rd->ttft.p95, rd->tpot.p50);
    if (!isnan(rd->slo_ratio))
        fprintf(stderr, ", SLO %.2f", rd->slo_ratio);
    if (rd->score_max)
        fprintf(stderr, ", score %d/%d", rd->score, rd->score_max);
    for (int o = 1; o < PD_BENCH_N_OUTCOMES; o++)
        if (rd->failures[o])
            fprintf(stderr, ", %s %d", pd_bench_outcome_str(o), rd->failures[o]);
    fprintf(stderr, "\n");
}

/* ---- groups ---------------------------------------------------------------- */

static pd_status add_group(pd_bench_run *run, int n_rounds, pd_bench_group **g_p, pd_err *err) {
    pd_bench_group *gs = realloc(run->groups, (size_t)(run->n_groups + 1) * sizeof *gs);
    if (!gs)
        return pd_err_set(err, PD_ERR_NOMEM, "bench: out of memory");
    run->groups = gs;
    pd_bench_group *g = &gs[run->n_groups];
    memset(g, 0, sizeof *g);
    g->rounds = calloc((size_t)(n_rounds > 0 ? n_rounds : 1), sizeof *g->rounds);
    if (!g->rounds)
        return pd_err_set(err, PD_ERR_NOMEM, "bench: out of memory");
    g->n_rounds = n_rounds;
    for (int r = 0; r < n_rounds; r++) {
        g->rounds[r].round = r + 1;
        g->rounds[r].slo_ratio = NAN;
    }
    run->n_groups++;
    *g_p = g;
    return PD_OK;
}

static void free_reqs(pd_bench_req *reqs, int n) {
    for (int i = 0; i < n && reqs; i++)
        pd_bench_req_clear(&reqs[i]);
    free(reqs);
}

/* Builds n requests of one shape for group gi, round. arrivals: Poisson at
 * rate (> 0) or none. */
static pd_status build_round(pd_bench_run *run, int gi, int round, int n, double rate,
                             pd_bench_req **reqs_p, pd_err *err) {
    pd_bench_group *g = &run->groups[gi];
    pd_bench_req *reqs = calloc((size_t)(n > 0 ? n : 1), sizeof *reqs);
    if (!reqs)
        return pd_err_set(err, PD_ERR_NOMEM, "bench: out of memory for %d requests", n);
    double t = 0;
    for (int i = 0; i < n; i++) {
        pd_status st =
            load_prompt(run, &reqs[i], run->cfg->endpoint, g->in_tokens, g->out_tokens, err);
        if (st != PD_OK) {
            free_reqs(reqs, i + 1);
            return st;
        }
        reqs[i].group = gi, reqs[i].round = round, reqs[i].index = i;
        if (reqs[i].prompt_is_ids)
            g->prompts_ids++;
        else
            g->prompts_text++;
        if (rate > 0) {
            /* the first request at 0, then exponential gaps of mean 1/rate */
            reqs[i].arrival_s = t;
            t += -log(1.0 - pd_rng_uniform(&run->rng)) / rate;
        }
    }
    *reqs_p = reqs;
    return PD_OK;
}

static bool round_failed(const pd_bench_round *rd) {
    return rd->successes < rd->requests;
}

/* Runs warm-up and rounds of group gi; *streak counts consecutive failed
 * rounds of the phase, *stopped is set when it reaches the limit. */
static pd_status run_group(pd_bench_run *run, int gi, int n_req, int warmup, int *streak,
                           bool *stopped, pd_err *err) {
    const pd_bench_config *cfg = run->cfg;
    pd_bench_group *g = &run->groups[gi];
    bool open = g->rate > 0;
    int conc = g->concurrency > 0 ? g->concurrency : 1;
    if (*stopped || pd_bench_stop_requested())
        return PD_OK; /* every round stays "not run" */
    pd_bench_req *reqs = NULL;
    pd_status st;
    if (warmup > 0) {
        if ((st = build_round(run, gi, 0, warmup, 0, &reqs, err)) != PD_OK)
            return st;
        progress_ctx pc = {run, g->name, 0, g->n_rounds};
        st = pd_bench_client_run(run->client, reqs, warmup, conc, false, progress, &pc, NULL, NULL,
                                 err);
        if (!pd_bench_stop_requested())
            record(run, reqs, warmup);
        free_reqs(reqs, warmup);
        if (st != PD_OK)
            return st;
        if (pd_bench_stop_requested()) {
            run->interrupted = true;
            return PD_OK;
        }
    }
    for (int r = 0; r < g->n_rounds; r++) {
        if (*stopped)
            break;
        g = &run->groups[gi];
        if ((st = build_round(run, gi, r + 1, n_req, open ? g->rate : 0, &reqs, err)) != PD_OK)
            return st;
        progress_ctx pc = {run, g->name, r + 1, g->n_rounds};
        double t0 = 0, t1 = 0;
        st =
            pd_bench_client_run(run->client, reqs, n_req, conc, open, progress, &pc, &t0, &t1, err);
        if (pd_bench_stop_requested()) { /* the round stays "not run" */
            free_reqs(reqs, n_req);
            run->interrupted = true;
            return st;
        }
        pd_bench_round *rd = &g->rounds[r];
        pd_bench_round_compute(reqs, n_req, t0, t1, open ? cfg->slo_ttft_s : 0,
                               open ? cfg->slo_tpot_s : 0, rd);
        record(run, reqs, n_req);
        free_reqs(reqs, n_req);
        round_line(run, g, rd);
        if (st != PD_OK)
            return st;
        *streak = round_failed(rd) ? *streak + 1 : 0;
        if (cfg->stop_after_failed_rounds > 0 && *streak >= cfg->stop_after_failed_rounds) {
            *stopped = true;
            if (!cfg->quiet)
                fprintf(stderr, "%s: %d consecutive rounds with failures: the phase stops here\n",
                        g->name, *streak);
        }
    }
    return PD_OK;
}

static pd_status run_matrix(pd_bench_run *run, pd_err *err) {
    const pd_bench_config *cfg = run->cfg;
    for (int s = 0; s < cfg->n_shapes; s++)
        for (int c = 0; c < cfg->n_conc; c++) {
            pd_bench_group *g;
            pd_status st = add_group(run, cfg->rounds, &g, err);
            if (st != PD_OK)
                return st;
            g->in_tokens = cfg->shape_in[s], g->out_tokens = cfg->shape_out[s];
            g->concurrency = cfg->conc[c];
            g->phase = s;
            snprintf(g->name, sizeof g->name, "%d/%d c=%d", g->in_tokens, g->out_tokens,
                     g->concurrency);
        }
    for (int s = 0; s < cfg->n_shapes; s++) {
        int streak = 0;
        bool stopped = false;
        for (int c = 0; c < cfg->n_conc; c++) {
            int gi = s * cfg->n_conc + c;
            int n_req = cfg->n_reqs == 1 ? cfg->reqs[0] : cfg->reqs[c];
            int warm = cfg->warmup >= 0 ? cfg->warmup : cfg->conc[c];
            pd_status st = run_group(run, gi, n_req, warm, &streak, &stopped, err);
            if (st != PD_OK)
                return st;
        }
    }
    return PD_OK;
}

static pd_status run_rate(pd_bench_run *run, pd_err *err) {
    const pd_bench_config *cfg = run->cfg;
    for (int i = 0; i < cfg->n_rates; i++) {
        pd_bench_group *g;
        pd_status st = add_group(run, cfg->rounds, &g, err);
        if (st != PD_OK)
            return st;
        g->in_tokens = cfg->shape_in[0], g->out_tokens = cfg->shape_out[0];
        g->rate = cfg->rates[i];
        snprintf(g->name, sizeof g->name, "%d/%d rate=%g", g->in_tokens, g->out_tokens, g->rate);
    }
    int streak = 0;
    bool stopped = false;
    for (int i = 0; i < cfg->n_rates; i++) {
        int warm = cfg->warmup >= 0 ? cfg->warmup : (i == 0 ? 1 : 0);
        pd_status st = run_group(run, i, cfg->reqs[0], warm, &streak, &stopped, err);
        if (st != PD_OK)
            return st;
    }
    return PD_OK;
}

/* ---- retrieval ---------------------------------------------------------------- */

static pd_status run_retrieval(pd_bench_run *run, pd_err *err) {
    const pd_bench_config *cfg = run->cfg;
    for (int i = 0; i < cfg->n_tokens; i++) {
        pd_bench_group *g;
        pd_status st = add_group(run, cfg->rounds, &g, err);
        if (st != PD_OK)
            return st;
        g->in_tokens = cfg->tokens[i];
        g->out_tokens = cfg->max_tokens;
        g->concurrency = 1;
        snprintf(g->name, sizeof g->name, "retrieval %d", g->in_tokens);
    }
    for (int gi = 0; gi < run->n_groups && !pd_bench_stop_requested(); gi++) {
        for (int r = 0; r < cfg->rounds && !pd_bench_stop_requested(); r++) {
            pd_bench_group *g = &run->groups[gi];
            pd_bench_retrieval rt;
            pd_status st = pd_bench_retrieval_build(&run->tok, &run->rng, g->in_tokens, &rt, err);
            if (st != PD_OK)
                return st;
            pd_bench_req req;
            pd_bench_req_init(&req);
            req.endpoint = PD_BENCH_EP_CHAT;
            req.stream = true;
            req.max_tokens = cfg->max_tokens;
            req.prompt_tokens_local = rt.tokens;
            req.group = gi, req.round = r + 1;
            req.body = make_body(run, PD_BENCH_EP_CHAT, user_messages(rt.content), cfg->max_tokens,
                                 false, true, NULL);
            g->prompts_text++;
            if (!req.body) {
                pd_bench_retrieval_free(&rt);
                return pd_err_set(err, PD_ERR_NOMEM, "bench: out of memory");
            }
            progress_ctx pc = {run, g->name, r + 1, g->n_rounds};
            double t0 = 0, t1 = 0;
            st = pd_bench_client_run(run->client, &req, 1, 1, false, progress, &pc, &t0, &t1, err);
            if (pd_bench_stop_requested()) {
                pd_bench_req_clear(&req);
                pd_bench_retrieval_free(&rt);
                run->interrupted = true;
                return st;
            }
            pd_bench_round *rd = &g->rounds[r];
            rd->score = pd_bench_retrieval_score(&rt, req.text.data);
            rd->score_max = 3;
            pd_bench_round_compute(&req, 1, t0, t1, 0, 0, rd);
            record(run, &req, 1);
            round_line(run, g, rd);
            pd_bench_req_clear(&req);
            pd_bench_retrieval_free(&rt);
            if (st != PD_OK)
                return st;
        }
    }
    return PD_OK;
}

/* ---- functional --------------------------------------------------------------- */

enum { CK_INTEGER, CK_JSON, CK_MEMORY, CK_STREAM, CK_TOOL, N_CHECKS };
static const char *const check_names[N_CHECKS] = {"integer_answer", "json_extraction",
                                                  "multi_turn_memory", "stream_equals_nonstream",
                                                  "tool_call_round_trip"};

/* One chat request, run and recorded; returns the request (caller clears)
 * or a failed one. messages is consumed. */
static pd_status chat_once(pd_bench_run *run, int check, int rep, int idx, json_t *messages,
                           bool stream, json_t *more, pd_bench_req *r, pd_err *err) {
    pd_bench_req_init(r);
    r->endpoint = PD_BENCH_EP_CHAT;
    r->stream = stream;
    r->max_tokens = run->cfg->max_tokens;
    r->group = check, r->round = rep, r->index = idx;
    r->body = make_body(run, PD_BENCH_EP_CHAT, messages, run->cfg->max_tokens, false, stream, more);
    if (!r->body)
        return pd_err_set(err, PD_ERR_NOMEM, "bench: out of memory");
    progress_ctx pc = {run, check_names[check], rep, run->cfg->repeat};
    pd_status st = pd_bench_client_run(run->client, r, 1, 1, false, progress, &pc, NULL, NULL, err);
    if (!pd_bench_stop_requested())
        record(run, r, 1);
    return st;
}

/* The text with surrounding white space, quotes and a final period removed. */
static void trimmed(const char *s, char *out, size_t cap) {
    while (*s && (isspace((unsigned char)*s) || *s == '"' || *s == '`'))
        s++;
    size_t n = strlen(s);
    while (n && (isspace((unsigned char)s[n - 1]) || s[n - 1] == '.' || s[n - 1] == '"' ||
                 s[n - 1] == '`'))
        n--;
    if (n >= cap)
        n = cap - 1;
    memcpy(out, s, n);
    out[n] = 0;
}

static json_t *first_object(const char *s) {
    const char *b = s ? strchr(s, '{') : NULL;
    json_error_t je;
    json_t *o = b ? json_loads(b, JSON_DISABLE_EOF_CHECK, &je) : NULL;
    if (o && !json_is_object(o)) {
        json_decref(o);
        o = NULL;
    }
    return o;
}

static bool contains_ci(const char *hay, const char *needle) {
    size_t n = strlen(needle);
    for (; hay && *hay; hay++)
        if (!strncasecmp(hay, needle, n))
            return true;
    return false;
}

/* s cut to at most cap - 1 bytes on a character boundary, invalid UTF-8 and
 * control characters replaced, into buf (for messages that end up in JSON). */
static const char *clip(char *buf, size_t cap, const char *s) {
    size_t j = 0;
    for (size_t i = 0; s && s[i];) {
        unsigned char c = (unsigned char)s[i];
        size_t k = c < 0x80 ? 1 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : 2;
        bool ok = strnlen(s + i, k) == k && pd_tok_utf8_valid(s + i, k);
        if (!ok)
            k = 1;
        if (j + (ok ? k : 1) + 1 > cap)
            break;
        if (!ok || c < 0x20)
            buf[j++] = ok ? ' ' : '?';
        else
            memcpy(buf + j, s + i, k), j += k;
        i += k;
    }
    buf[j] = 0;
    return buf;
}

/* True when r succeeded; else why says how it failed. */
static bool req_ok(const pd_bench_req *r, char *why, size_t cap) {
    if (r->outcome == PD_BENCH_SUCCESS)
        return true;
    snprintf(why, cap, "request failed: %s: %.190s", pd_bench_outcome_str(r->outcome), r->detail);
    return false;
}

/* Runs check ck once; *why gets the reason it failed ("" when it passed). */
static pd_status run_check(pd_bench_run *run, int ck, int rep, char *why, size_t cap, pd_err *err) {
    pd_bench_req a, b;
    pd_bench_req_init(&a);
    pd_bench_req_init(&b);
    pd_status st = PD_OK;
    char t[256], c1[96], c2[40];
    why[0] = 0;
#define REQ_OK(r) req_ok(r, why, cap)
    switch (ck) {
    case CK_INTEGER:
        st = chat_once(run, ck, rep, 0,
                       user_messages("What is 17 + 25? Reply with the number only, no words."),
                       true, NULL, &a, err);
        if (st == PD_OK && REQ_OK(&a)) {
            trimmed(a.text.data, t, sizeof t);
            if (strcmp(t, "42"))
                snprintf(why, cap, "expected 42, got '%s'", clip(c1, 80, t));
        }
        break;
    case CK_JSON:
        st = chat_once(run, ck, rep, 0,
                       user_messages("Extract the person's name and age from this sentence and "
                                     "reply with only a JSON object with the keys \"name\" (a "
                                     "string) and \"age\" (an integer): \"Alice Martin is 34 years "
                                     "old and lives in Lyon.\""),
                       true, NULL, &a, err);
        if (st == PD_OK && REQ_OK(&a)) {
            json_t *o = first_object(a.text.data);
            json_t *name = json_object_get(o, "name"), *age = json_object_get(o, "age");
            if (!o)
                snprintf(why, cap, "no JSON object in '%s'", clip(c1, 80, a.text.data));
            else if (!json_is_string(name) || strcmp(json_string_value(name), "Alice Martin"))
                snprintf(why, cap, "name is not \"Alice Martin\"");
            else if (!json_is_integer(age) || json_integer_value(age) != 34)
                snprintf(why, cap, "age is not the integer 34");
            json_decref(o);
        }
        break;
    case CK_MEMORY: {
        const char *first = "Remember this: my favourite colour is teal. Reply with OK.";
        st = chat_once(run, ck, rep, 0, user_messages(first), true, NULL, &a, err);
        if (st != PD_OK || !REQ_OK(&a))
            break;
        json_t *ms = json_pack("[{s:s,s:s},{s:s,s:s},{s:s,s:s}]", "role", "user", "content", first,
                               "role", "assistant", "content", a.text.data, "role", "user",
                               "content", "What is my favourite colour? Reply with one word.");
        st = chat_once(run, ck, rep, 1, ms, true, NULL, &b, err);
        if (st == PD_OK && REQ_OK(&b) && !contains_ci(b.text.data, "teal"))
            snprintf(why, cap, "the second turn does not say teal: '%s'",
                     clip(c1, 80, b.text.data));
        break;
    }
    case CK_STREAM: {
        const char *q = "Write one sentence about rivers.";
        st = chat_once(run, ck, rep, 0, user_messages(q), true, NULL, &a, err);
        if (st == PD_OK)
            st = chat_once(run, ck, rep, 1, user_messages(q), false, NULL, &b, err);
        if (st == PD_OK && REQ_OK(&a) && REQ_OK(&b)) {
            if (strcmp(a.text.data, b.text.data))
                snprintf(why, cap, "streamed text differs from the non-streamed text");
            else if (a.completion_tokens != b.completion_tokens ||
                     a.prompt_tokens != b.prompt_tokens)
                snprintf(why, cap, "usage differs: streamed %lld+%lld, non-streamed %lld+%lld",
                         (long long)a.prompt_tokens, (long long)a.completion_tokens,
                         (long long)b.prompt_tokens, (long long)b.completion_tokens);
        }
        break;
    }
    case CK_TOOL: {
        const char *q = "What is the weather in Paris right now? Use the get_weather tool.";
        json_t *tools =
            json_pack("{s:[{s:s,s:{s:s,s:s,s:{s:s,s:{s:{s:s}},s:[s]}}}],s:s}", "tools", "type",
                      "function", "function", "name", "get_weather", "description",
                      "Current weather of a city", "parameters", "type", "object", "properties",
                      "city", "type", "string", "required", "city", "tool_choice", "auto");
        json_t *tools2 = json_deep_copy(tools);
        st = chat_once(run, ck, rep, 0, user_messages(q), false, tools, &a, err);
        if (st != PD_OK || !REQ_OK(&a)) {
            json_decref(tools2);
            break;
        }
        json_t *tc = json_array_get(a.tool_calls, 0);
        const char *name = json_string_value(json_object_get(tc, "name"));
        const char *args = json_string_value(json_object_get(tc, "arguments"));
        json_error_t je;
        json_t *ao = args ? json_loads(args, 0, &je) : NULL;
        const char *city = json_string_value(json_object_get(ao, "city"));
        if (!tc)
            snprintf(why, cap, "no tool call (finish_reason '%s', text '%s')",
                     clip(c2, 32, a.finish_reason), clip(c1, 60, a.text.data));
        else if (!name || strcmp(name, "get_weather"))
            snprintf(why, cap, "tool call names '%s', not get_weather", clip(c1, 40, name));
        else if (!city || !contains_ci(city, "paris"))
            snprintf(why, cap, "tool arguments '%s' have no city Paris", clip(c1, 80, args));
        if (why[0]) {
            json_decref(ao);
            json_decref(tools2);
            break;
        }
        const char *id = json_string_value(json_object_get(tc, "id"));
        json_t *ms = json_pack("[{s:s,s:s},{s:s,s:n,s:[{s:s,s:s,s:{s:s,s:s}}]},{s:s,s:s,s:s}]",
                               "role", "user", "content", q, "role", "assistant", "content",
                               "tool_calls", "id", id ? id : "call_0", "type", "function",
                               "function", "name", "get_weather", "arguments", args, "role", "tool",
                               "tool_call_id", id ? id : "call_0", "content",
                               "{\"city\": \"Paris\", \"temperature_c\": 18, \"sky\": \"clear\"}");
        json_decref(ao);
        st = chat_once(run, ck, rep, 1, ms, false, tools2, &b, err);
        if (st == PD_OK && REQ_OK(&b) && !strstr(b.text.data ? b.text.data : "", "18"))
            snprintf(why, cap, "the answer after the tool result does not say 18: '%s'",
                     clip(c1, 60, b.text.data));
        break;
    }
    }
#undef REQ_OK
    pd_bench_req_clear(&a);
    pd_bench_req_clear(&b);
    return st;
}

static pd_status run_functional(pd_bench_run *run, pd_err *err) {
    const pd_bench_config *cfg = run->cfg;
    for (int ck = 0; ck < N_CHECKS; ck++) {
        pd_bench_group *g;
        pd_status st = add_group(run, 0, &g, err);
        if (st != PD_OK)
            return st;
        snprintf(g->name, sizeof g->name, "functional %s", check_names[ck]);
        g->concurrency = 1;
        run->checks[ck].name = check_names[ck];
    }
    run->n_checks = N_CHECKS;
    for (int rep = 1; rep <= cfg->repeat; rep++)
        for (int ck = 0; ck < N_CHECKS; ck++) {
            char why[240];
            pd_status st = run_check(run, ck, rep, why, sizeof why, err);
            if (st != PD_OK)
                return st;
            if (pd_bench_stop_requested()) {
                run->interrupted = true;
                return PD_OK;
            }
            pd_bench_check *c = &run->checks[ck];
            c->runs++;
            if (why[0]) {
                snprintf(c->last_failure, sizeof c->last_failure, "%s", why);
                run->any_failure = true;
            } else
                c->passes++;
            if (!cfg->quiet) {
                if (isatty(2))
                    fprintf(stderr, "\r\033[K");
                fprintf(stderr, "functional %s %d/%d: %s%s\n", check_names[ck], rep, cfg->repeat,
                        why[0] ? "FAIL: " : "pass", why);
            }
        }
    return PD_OK;
}

pd_status pd_bench_run_mode(pd_bench_run *run, pd_err *err) {
    switch (run->cfg->mode) {
    case PD_BENCH_MATRIX:
        return run_matrix(run, err);
    case PD_BENCH_RATE:
        return run_rate(run, err);
    case PD_BENCH_RETRIEVAL:
        return run_retrieval(run, err);
    case PD_BENCH_FUNCTIONAL:
        return run_functional(run, err);
    }
    return pd_err_set(err, PD_ERR_INVALID, "bench: unknown mode");
}

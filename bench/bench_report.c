/* What `pdserve bench` writes into --out DIR:
 *
 *   requests.csv   one row per request (warm-up rows have round 0);
 *   rounds.csv     one row per group and round (not-run rounds included);
 *   summary.json   every group and round: requests, successes, failures by
 *                  reason, the measures, and the median / min / max over
 *                  rounds; functional checks; totals;
 *   report.html    self-contained: tables of medians over rounds, SVG charts
 *                  drawn here (median line, min-max band over rounds);
 *   failed/        the raw answer of every failed request.
 *
 * Tables show the median over rounds; charts show it as a line and the
 * min-max over rounds as a band and whiskers. */
#include <math.h>
#include <string.h>

#include "pd_bench.h"

static const char *endpoint_str(pd_bench_endpoint e) {
    return e == PD_BENCH_EP_CHAT ? "chat" : "completions";
}

static const char *mode_str(pd_bench_mode m) {
    switch (m) {
    case PD_BENCH_MATRIX:
        return "matrix";
    case PD_BENCH_RATE:
        return "rate";
    case PD_BENCH_RETRIEVAL:
        return "retrieval";
    case PD_BENCH_FUNCTIONAL:
        return "functional";
    }
    return "?";
}

/* ---- per-round metrics and aggregates over rounds ------------------------------- */

enum {
    M_THROUGHPUT,
    M_REQ_THROUGHPUT,
    M_TTFT_P50,
    M_TTFT_P95,
    M_TPOT_P50,
    M_TPOT_P95,
    M_E2E_P50,
    M_E2E_P95,
    M_SLO,
    M_SUCCESS,
    M_SCORE,
    N_METRICS
};
static const char *const metric_keys[N_METRICS] = {
    "throughput_tok_s", "request_throughput_s", "ttft_p50_s", "ttft_p95_s",
    "tpot_p50_s",       "tpot_p95_s",           "e2e_p50_s",  "e2e_p95_s",
    "slo_ratio",        "success_ratio",        "score"};

static double metric(const pd_bench_round *rd, int m) {
    switch (m) {
    case M_THROUGHPUT:
        return rd->throughput_tok_s;
    case M_REQ_THROUGHPUT:
        return rd->request_throughput_s;
    case M_TTFT_P50:
        return rd->ttft.p50;
    case M_TTFT_P95:
        return rd->ttft.p95;
    case M_TPOT_P50:
        return rd->tpot.p50;
    case M_TPOT_P95:
        return rd->tpot.p95;
    case M_E2E_P50:
        return rd->e2e.p50;
    case M_E2E_P95:
        return rd->e2e.p95;
    case M_SLO:
        return rd->slo_ratio;
    case M_SUCCESS:
        return rd->requests ? (double)rd->successes / rd->requests : NAN;
    case M_SCORE:
        return rd->score_max ? (double)rd->score : NAN;
    }
    return NAN;
}

/* Median, min and max of metric m over the rounds of g that ran. */
static void over_rounds(const pd_bench_group *g, int m, double *med, double *lo, double *hi) {
    double v[256];
    int n = 0;
    *lo = NAN, *hi = NAN;
    for (int r = 0; r < g->n_rounds && n < 256; r++) {
        if (!g->rounds[r].run)
            continue;
        double x = metric(&g->rounds[r], m);
        if (isnan(x))
            continue;
        v[n++] = x;
        if (isnan(*lo) || x < *lo)
            *lo = x;
        if (isnan(*hi) || x > *hi)
            *hi = x;
    }
    *med = pd_bench_median(v, n);
}

/* ---- CSV ------------------------------------------------------------------------ */

static void csv_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; s && *s; s++) {
        if (*s == '"')
            fputc('"', f);
        fputc(*s == '\n' || *s == '\r' ? ' ' : *s, f);
    }
    fputc('"', f);
}

static void csv_num(FILE *f, double v) {
    if (isnan(v))
        fputs(",", f);
    else
        fprintf(f, ",%.6g", v);
}

void pd_bench_csv_request(FILE *f, const pd_bench_run *run, const pd_bench_req *r) {
    if (!r) {
        fputs("group,round,index,outcome,detail,http_status,endpoint,prompt,prompt_tokens_local,"
              "prompt_tokens_server,completion_tokens,max_tokens,ttft_s,tpot_s,e2e_s,start_s,"
              "fragments,finish_reason,http\n",
              f);
        return;
    }
    csv_str(f, run->groups[r->group].name);
    fprintf(f, ",%d,%d,%s,", r->round, r->index, pd_bench_outcome_str(r->outcome));
    csv_str(f, r->detail);
    fprintf(f, ",%ld,%s,%s,%d,%lld,%lld,%d", r->http_status, endpoint_str(r->endpoint),
            r->prompt_is_ids ? "token_ids" : "text", r->prompt_tokens_local,
            (long long)r->prompt_tokens, (long long)r->completion_tokens, r->max_tokens);
    csv_num(f, pd_bench_req_ttft(r));
    csv_num(f, pd_bench_req_tpot(r));
    csv_num(f, pd_bench_req_e2e(r));
    csv_num(f, r->t_start - run->t_origin);
    fprintf(f, ",%d,%s,", r->n_fragments, r->finish_reason);
    if (r->http_version)
        fprintf(f, "%d.%d", r->http_version / 10, r->http_version % 10);
    fputc('\n', f);
}

static pd_status write_rounds_csv(const pd_bench_run *run, const char *path, pd_err *err) {
    FILE *f = fopen(path, "w");
    if (!f)
        return pd_err_set(err, PD_ERR_IO, "bench: cannot write %s", path);
    fputs("group,input_tokens,output_tokens,concurrency,rate,round,status,requests,successes", f);
    for (int o = 1; o < PD_BENCH_N_OUTCOMES; o++)
        fprintf(f, ",%s", pd_bench_outcome_str(o));
    fputs(",duration_s,output_tokens,throughput_tok_s,request_throughput_s,ttft_p50_s,ttft_p95_s,"
          "tpot_p50_s,tpot_p95_s,e2e_p50_s,e2e_p95_s,slo_ratio,prompt_tokens_local,"
          "prompt_tokens_server,prompt_mismatches,score,score_max\n",
          f);
    for (int gi = 0; gi < run->n_groups; gi++) {
        const pd_bench_group *g = &run->groups[gi];
        for (int r = 0; r < g->n_rounds; r++) {
            const pd_bench_round *rd = &g->rounds[r];
            csv_str(f, g->name);
            fprintf(f, ",%d,%d,%d,%g,%d,%s,%d,%d", g->in_tokens, g->out_tokens, g->concurrency,
                    g->rate, rd->round, rd->run ? "run" : "not_run", rd->requests, rd->successes);
            for (int o = 1; o < PD_BENCH_N_OUTCOMES; o++)
                fprintf(f, ",%d", rd->failures[o]);
            csv_num(f, rd->run ? rd->duration_s : NAN);
            fprintf(f, ",%lld", (long long)rd->output_tokens);
            for (int m = M_THROUGHPUT; m <= M_SLO; m++)
                csv_num(f, rd->run ? metric(rd, m) : NAN);
            csv_num(f, rd->run ? rd->prompt_tokens_local : NAN);
            csv_num(f, rd->run ? rd->prompt_tokens_server : NAN);
            fprintf(f, ",%d,%d,%d\n", rd->prompt_mismatches, rd->score, rd->score_max);
        }
    }
    if (fclose(f))
        return pd_err_set(err, PD_ERR_IO, "bench: cannot write %s", path);
    return PD_OK;
}

/* ---- summary.json ----------------------------------------------------------------- */

static json_t *num(double v) {
    return isnan(v) || isinf(v) ? json_null() : json_real(v);
}

static json_t *dist_json(const pd_bench_dist *d) {
    return json_pack("{s:i,s:o,s:o,s:o,s:o,s:o}", "n", d->n, "mean", num(d->mean), "p50",
                     num(d->p50), "p95", num(d->p95), "p99", num(d->p99), "max", num(d->max));
}

static json_t *failures_json(const int *failures) {
    json_t *o = json_object();
    for (int k = 1; k < PD_BENCH_N_OUTCOMES; k++)
        json_object_set_new(o, pd_bench_outcome_str(k), json_integer(failures[k]));
    return o;
}

static json_t *round_json(const pd_bench_run *run, const pd_bench_round *rd) {
    const pd_bench_config *cfg = run->cfg;
    json_t *o = json_pack("{s:i,s:s,s:i,s:i,s:o}", "round", rd->round, "status",
                          rd->run ? "run" : "not_run", "requests", rd->requests, "successes",
                          rd->successes, "failures", failures_json(rd->failures));
    if (!o || !rd->run)
        return o;
    json_object_set_new(o, "duration_s", num(rd->duration_s));
    json_object_set_new(o, "output_tokens", json_integer(rd->output_tokens));
    json_object_set_new(o, "throughput_tok_s", num(rd->throughput_tok_s));
    json_object_set_new(o, "request_throughput_s", num(rd->request_throughput_s));
    json_object_set_new(o, "ttft_s", dist_json(&rd->ttft));
    json_object_set_new(o, "tpot_s", dist_json(&rd->tpot));
    json_object_set_new(o, "e2e_s", dist_json(&rd->e2e));
    json_object_set_new(o, "prompt_tokens_local", num(rd->prompt_tokens_local));
    json_object_set_new(o, "prompt_tokens_server", num(rd->prompt_tokens_server));
    json_object_set_new(o, "prompt_tokens_mismatch", json_integer(rd->prompt_mismatches));
    if (!isnan(rd->slo_ratio))
        json_object_set_new(o, "slo",
                            json_pack("{s:o,s:o,s:i,s:o}", "ttft_s", num(cfg->slo_ttft_s), "tpot_s",
                                      num(cfg->slo_tpot_s), "compliant", rd->slo_compliant, "ratio",
                                      num(rd->slo_ratio)));
    if (rd->score_max)
        json_object_set_new(o, "retrieval",
                            json_pack("{s:i,s:i}", "score", rd->score, "max", rd->score_max));
    return o;
}

json_t *pd_bench_summary_json(const pd_bench_run *run) {
    const pd_bench_config *cfg = run->cfg;
    json_t *root = json_object();
    if (!root)
        return NULL;
    json_object_set_new(root, "tool", json_string("pdserve bench"));
    json_object_set_new(root, "mode", json_string(mode_str(cfg->mode)));
    json_object_set_new(root, "started_at", json_string(run->started_at));
    json_object_set_new(root, "command", json_string(cfg->command));
    json_object_set_new(root, "base_url", json_string(cfg->base_url));
    json_object_set_new(root, "model", json_string(run->model));
    json_object_set_new(root, "endpoint", json_string(endpoint_str(cfg->endpoint)));
    json_object_set_new(root, "http", json_string(cfg->http2 ? "2" : "1.1"));
    /* what the server actually answered with (--http2 may be refused) */
    json_object_set_new(root, "http_versions",
                        json_pack("{s:i,s:i,s:i,s:i}", "1.0", run->http_versions[0], "1.1",
                                  run->http_versions[1], "2", run->http_versions[2], "3",
                                  run->http_versions[3]));
    json_object_set_new(root, "ignore_eos", json_boolean(cfg->ignore_eos));
    json_object_set_new(root, "temperature", json_real(cfg->temperature));
    json_object_set_new(root, "timeout_s", num(cfg->timeout_s));
    json_object_set_new(root, "rounds", json_integer(cfg->rounds));
    json_object_set_new(root, "host", json_string(run->host_info));
    if (run->have_tok) {
        json_object_set_new(root, "tokenizer", json_string(cfg->tokenizer_path));
        json_object_set_new(root, "add_bos", json_boolean(run->tok.add_bos));
        json_object_set_new(root, "chat_template_tokens", json_integer(run->tok.chat_overhead));
    }
    int text = 0, ids = 0;
    for (int gi = 0; gi < run->n_groups; gi++)
        text += run->groups[gi].prompts_text, ids += run->groups[gi].prompts_ids;
    json_object_set_new(root, "prompts",
                        json_string(ids == 0    ? "text"
                                    : text == 0 ? "token_ids"
                                                : "mixed"));

    int tot_req = 0, tot_ok = 0, tot_fail[PD_BENCH_N_OUTCOMES] = {0};
    json_t *groups = json_array(), *not_run = json_array();
    for (int gi = 0; gi < run->n_groups; gi++) {
        const pd_bench_group *g = &run->groups[gi];
        if (cfg->mode == PD_BENCH_FUNCTIONAL)
            break;
        json_t *go =
            json_pack("{s:s,s:i,s:i,s:i,s:o,s:i,s:{s:i,s:i}}", "name", g->name, "input_tokens",
                      g->in_tokens, "output_tokens", g->out_tokens, "concurrency", g->concurrency,
                      "rate", g->rate > 0 ? json_real(g->rate) : json_null(), "phase", g->phase,
                      "prompts", "text", g->prompts_text, "token_ids", g->prompts_ids);
        json_t *rounds = json_array();
        for (int r = 0; r < g->n_rounds; r++) {
            const pd_bench_round *rd = &g->rounds[r];
            json_array_append_new(rounds, round_json(run, rd));
            if (!rd->run)
                json_array_append_new(not_run,
                                      json_pack("{s:s,s:i}", "group", g->name, "round", rd->round));
            tot_req += rd->requests, tot_ok += rd->successes;
            for (int k = 1; k < PD_BENCH_N_OUTCOMES; k++)
                tot_fail[k] += rd->failures[k];
        }
        json_object_set_new(go, "rounds", rounds);
        json_t *med = json_object(), *lo = json_object(), *hi = json_object();
        for (int m = 0; m < N_METRICS; m++) {
            double a, b, c;
            over_rounds(g, m, &a, &b, &c);
            json_object_set_new(med, metric_keys[m], num(a));
            json_object_set_new(lo, metric_keys[m], num(b));
            json_object_set_new(hi, metric_keys[m], num(c));
        }
        json_object_set_new(go, "median_over_rounds", med);
        json_object_set_new(go, "min_over_rounds", lo);
        json_object_set_new(go, "max_over_rounds", hi);
        json_array_append_new(groups, go);
    }
    json_object_set_new(root, "groups", groups);
    json_object_set_new(root, "not_run", not_run);
    json_object_set_new(root, "interrupted", json_boolean(run->interrupted));
    if (cfg->mode == PD_BENCH_FUNCTIONAL) {
        json_t *checks = json_array();
        for (int i = 0; i < run->n_checks; i++) {
            const pd_bench_check *c = &run->checks[i];
            json_array_append_new(checks,
                                  json_pack("{s:s,s:i,s:i,s:s}", "name", c->name, "runs", c->runs,
                                            "passes", c->passes, "last_failure", c->last_failure));
        }
        json_object_set_new(root, "checks", checks);
        tot_req = run->fn_requests, tot_ok = run->fn_successes;
        memcpy(tot_fail, run->fn_failures, sizeof tot_fail);
    }
    json_object_set_new(root, "totals",
                        json_pack("{s:i,s:i,s:o}", "requests", tot_req, "successes", tot_ok,
                                  "failures", failures_json(tot_fail)));
    json_object_set_new(root, "failed_requests_saved", json_integer(run->failed_files));
    return root;
}

/* ---- HTML --------------------------------------------------------------------------- */

static void html_esc(FILE *f, const char *s) {
    for (; s && *s; s++) {
        switch (*s) {
        case '<':
            fputs("&lt;", f);
            break;
        case '>':
            fputs("&gt;", f);
            break;
        case '&':
            fputs("&amp;", f);
            break;
        case '"':
            fputs("&quot;", f);
            break;
        default:
            fputc(*s, f);
        }
    }
}

static void fmt_num(char *out, size_t cap, double v) {
    if (isnan(v))
        snprintf(out, cap, "–");
    else if (fabs(v) >= 100)
        snprintf(out, cap, "%.1f", v);
    else
        snprintf(out, cap, "%.3g", v);
}

static double nice_step(double range) {
    if (!(range > 0))
        return 1;
    double e = pow(10, floor(log10(range / 5)));
    double f = range / 5 / e;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * e;
}

/* One chart: categories xs (labels) against a median with a min-max band.
 * NAN points are left out. ratio pins the y axis to [0, 1]. */
static void svg_chart(FILE *f, const char *title, const char *xlabel, const char *ylabel, int n,
                      char xs[][24], const double *med, const double *lo, const double *hi,
                      bool ratio) {
    const double W = 480, H = 300, L = 64, R = 16, T = 34, B = 48;
    double pw = W - L - R, ph = H - T - B, top = 0;
    for (int i = 0; i < n; i++)
        if (!isnan(hi[i]) && hi[i] > top)
            top = hi[i];
    double step = ratio ? 0.2 : nice_step(top);
    top = ratio ? 1.0 : (top > 0 ? ceil(top / step) * step : 1.0);
    if (!ratio && top <= 0)
        top = 1;
#define XP(i) (L + pw * ((i) + 0.5) / n)
#define YP(v) (T + ph - ph * ((v) / top))
    fprintf(f,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
            "viewBox=\"0 0 %.0f %.0f\" role=\"img\" font-family=\"sans-serif\">\n",
            W, H, W, H);
    fprintf(f, "<text x=\"%.0f\" y=\"20\" text-anchor=\"middle\" font-weight=\"bold\">", W / 2);
    html_esc(f, title);
    fputs("</text>\n", f);
    for (double y = 0; y <= top + step * 1e-6; y += step) {
        fprintf(f, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>", L,
                L + pw, YP(y), YP(y));
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" font-size=\"11\">%g</text>\n",
                L - 6, YP(y) + 4, fabs(y) < step * 1e-6 ? 0.0 : y);
    }
    fprintf(f, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>\n", L,
            L + pw, T + ph, T + ph);
    for (int i = 0; i < n; i++) {
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"11\">", XP(i),
                T + ph + 16);
        html_esc(f, xs[i]);
        fputs("</text>\n", f);
    }
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"12\">", L + pw / 2,
            H - 8);
    html_esc(f, xlabel);
    fprintf(f,
            "</text>\n<text transform=\"translate(14 %.1f) rotate(-90)\" text-anchor=\"middle\" "
            "font-size=\"12\">",
            T + ph / 2);
    html_esc(f, ylabel);
    fputs("</text>\n", f);
    /* band: runs of consecutive points with data */
    for (int i = 0; i < n;) {
        if (isnan(lo[i])) {
            i++;
            continue;
        }
        int j = i;
        while (j < n && !isnan(lo[j]))
            j++;
        if (j - i >= 2) {
            fputs("<polygon fill=\"#4e79a7\" fill-opacity=\"0.2\" stroke=\"none\" points=\"", f);
            for (int k = i; k < j; k++)
                fprintf(f, "%.1f,%.1f ", XP(k), YP(hi[k]));
            for (int k = j - 1; k >= i; k--)
                fprintf(f, "%.1f,%.1f ", XP(k), YP(lo[k]));
            fputs("\"/>\n", f);
        }
        i = j;
    }
    for (int i = 0; i < n; i++) {
        if (isnan(lo[i]))
            continue;
        fprintf(f, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#4e79a7\"/>",
                XP(i), XP(i), YP(lo[i]), YP(hi[i]));
        fprintf(f, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#4e79a7\"/>",
                XP(i) - 4, XP(i) + 4, YP(lo[i]), YP(lo[i]));
        fprintf(f, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#4e79a7\"/>\n",
                XP(i) - 4, XP(i) + 4, YP(hi[i]), YP(hi[i]));
    }
    fputs("<polyline fill=\"none\" stroke=\"#1f4e79\" stroke-width=\"2\" points=\"", f);
    for (int i = 0; i < n; i++)
        if (!isnan(med[i]))
            fprintf(f, "%.1f,%.1f ", XP(i), YP(med[i]));
    fputs("\"/>\n", f);
    for (int i = 0; i < n; i++)
        if (!isnan(med[i])) {
            char lab[32];
            fmt_num(lab, sizeof lab, med[i]);
            fprintf(f,
                    "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"#1f4e79\"><title>%s</title>"
                    "</circle>\n",
                    XP(i), YP(med[i]), lab);
        }
    fputs("</svg>\n", f);
#undef XP
#undef YP
}

/* Draws metric m of groups [g0, g1) against their labels. */
static void chart_groups(FILE *f, const pd_bench_run *run, int g0, int g1, int m, const char *title,
                         const char *xlabel, const char *ylabel, bool rate_labels) {
    int n = g1 - g0;
    if (n <= 0 || n > 256)
        return;
    char xs[256][24];
    double med[256], lo[256], hi[256];
    for (int i = 0; i < n; i++) {
        const pd_bench_group *g = &run->groups[g0 + i];
        if (rate_labels)
            snprintf(xs[i], sizeof xs[i], "%g", g->rate);
        else
            snprintf(xs[i], sizeof xs[i], "%d", g->concurrency);
        over_rounds(g, m, &med[i], &lo[i], &hi[i]);
    }
    svg_chart(f, title, xlabel, ylabel, n, xs, med, lo, hi, m == M_SLO || m == M_SUCCESS);
}

static void td_num(FILE *f, double v) {
    char s[32];
    fmt_num(s, sizeof s, v);
    fprintf(f, "<td>%s</td>", s);
}

static void group_table(FILE *f, const pd_bench_run *run, int g0, int g1) {
    const pd_bench_config *cfg = run->cfg;
    fputs("<table><tr><th>group</th><th>rounds run</th><th>requests</th><th>successes</th>"
          "<th>failures</th><th>throughput tok/s</th><th>TTFT p50 s</th><th>TTFT p95 s</th>"
          "<th>TPOT p50 s</th><th>TPOT p95 s</th><th>E2E p95 s</th><th>prompt tokens "
          "(here / server)</th>",
          f);
    if (cfg->mode == PD_BENCH_RATE)
        fputs("<th>SLO ratio</th>", f);
    if (cfg->mode == PD_BENCH_RETRIEVAL)
        fputs("<th>score (of 3)</th>", f);
    fputs("</tr>\n", f);
    for (int gi = g0; gi < g1; gi++) {
        const pd_bench_group *g = &run->groups[gi];
        int ran = 0, req = 0, ok = 0, fail[PD_BENCH_N_OUTCOMES] = {0};
        double pl[256], ps[256];
        int np = 0;
        for (int r = 0; r < g->n_rounds; r++) {
            const pd_bench_round *rd = &g->rounds[r];
            if (!rd->run)
                continue;
            ran++, req += rd->requests, ok += rd->successes;
            for (int k = 1; k < PD_BENCH_N_OUTCOMES; k++)
                fail[k] += rd->failures[k];
            if (np < 256)
                pl[np] = rd->prompt_tokens_local, ps[np++] = rd->prompt_tokens_server;
        }
        fputs("<tr><td>", f);
        html_esc(f, g->name);
        fprintf(f, "</td><td>%d/%d</td><td>%d</td><td>%d</td><td>", ran, g->n_rounds, req, ok);
        bool any = false;
        for (int k = 1; k < PD_BENCH_N_OUTCOMES; k++)
            if (fail[k]) {
                fprintf(f, "%s%s %d", any ? ", " : "", pd_bench_outcome_str(k), fail[k]);
                any = true;
            }
        fputs(any ? "</td>" : "none</td>", f);
        static const int cols[] = {M_THROUGHPUT, M_TTFT_P50, M_TTFT_P95,
                                   M_TPOT_P50,   M_TPOT_P95, M_E2E_P95};
        for (size_t c = 0; c < sizeof cols / sizeof cols[0]; c++) {
            double a, b, d;
            over_rounds(g, cols[c], &a, &b, &d);
            td_num(f, a);
        }
        char a[32], b[32];
        fmt_num(a, sizeof a, pd_bench_median(pl, np));
        fmt_num(b, sizeof b, pd_bench_median(ps, np));
        fprintf(f, "<td>%s / %s</td>", a, b);
        if (cfg->mode == PD_BENCH_RATE || cfg->mode == PD_BENCH_RETRIEVAL) {
            double m, lo, hi;
            over_rounds(g, cfg->mode == PD_BENCH_RATE ? M_SLO : M_SCORE, &m, &lo, &hi);
            char s1[32], s2[32], s3[32];
            fmt_num(s1, sizeof s1, m), fmt_num(s2, sizeof s2, lo), fmt_num(s3, sizeof s3, hi);
            fprintf(f, "<td>%s (%s–%s)</td>", s1, s2, s3);
        }
        fputs("</tr>\n", f);
    }
    fputs("</table>\n", f);
}

static pd_status write_html(const pd_bench_run *run, const char *path, pd_err *err) {
    const pd_bench_config *cfg = run->cfg;
    FILE *f = fopen(path, "w");
    if (!f)
        return pd_err_set(err, PD_ERR_IO, "bench: cannot write %s", path);
    fputs("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
          "<title>pdserve bench</title><style>"
          "body{font-family:system-ui,sans-serif;margin:24px;max-width:1100px}"
          "table{border-collapse:collapse;margin:8px 0 16px}"
          "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:right}"
          "th{background:#f3f3f3}td:first-child{text-align:left}"
          "code{background:#f3f3f3;padding:1px 4px}.charts svg{margin:4px 12px 4px 0}"
          ".bad{color:#b00}</style></head><body>\n",
          f);
    fprintf(f, "<h1>pdserve bench: %s</h1>\n<table>", mode_str(cfg->mode));
    char httpv[160];
    int k = snprintf(httpv, sizeof httpv, "%s asked; answered", cfg->http2 ? "HTTP/2" : "HTTP/1.1");
    static const char *const vn[4] = {"1.0", "1.1", "2", "3"};
    for (int i = 0; i < 4; i++)
        if (run->http_versions[i] && k < (int)sizeof httpv)
            k += snprintf(httpv + k, sizeof httpv - (size_t)k, " over HTTP/%s ×%d", vn[i],
                          run->http_versions[i]);
    const char *rows[][2] = {{"command", cfg->command},
                             {"started (UTC)", run->started_at},
                             {"server", cfg->base_url},
                             {"model", run->model},
                             {"endpoint", cfg->endpoint == PD_BENCH_EP_CHAT ? "/v1/chat/completions"
                                                                            : "/v1/completions"},
                             {"HTTP", httpv},
                             {"client host", run->host_info},
                             {"tokenizer", cfg->tokenizer_path ? cfg->tokenizer_path : "–"}};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        fprintf(f, "<tr><th>%s</th><td>", rows[i][0]);
        html_esc(f, rows[i][1]);
        fputs("</td></tr>", f);
    }
    int text = 0, ids = 0;
    for (int gi = 0; gi < run->n_groups; gi++)
        text += run->groups[gi].prompts_text, ids += run->groups[gi].prompts_ids;
    fprintf(f, "<tr><th>prompts</th><td>%s</td></tr>",
            cfg->mode == PD_BENCH_FUNCTIONAL ? "fixed chat checks"
            : ids == 0  ? "text of an exact token length (decoded and re-encoded with the model's "
                          "tokenizer)"
            : text == 0 ? "token ids (no text of the exact length was found)"
                        : "text where an exact text was found, token ids elsewhere");
    bool fixed = cfg->ignore_eos && (cfg->mode == PD_BENCH_MATRIX || cfg->mode == PD_BENCH_RATE);
    if (fixed)
        fprintf(f,
                "<tr><th>sampling</th><td>temperature %g, ignore_eos, fixed max_tokens</td></tr>",
                cfg->temperature);
    else
        fprintf(f, "<tr><th>sampling</th><td>temperature %g, answers stop at EOS%s</td></tr>",
                cfg->temperature,
                cfg->mode == PD_BENCH_MATRIX || cfg->mode == PD_BENCH_RATE
                    ? ""
                    : ", max_tokens from --max-tokens");
    fputs("</table>\n<p>A request counts as a success only with HTTP 200, non-empty text, "
          "<code>[DONE]</code>, valid usage, exactly <code>max_tokens</code> completion tokens "
          "under <code>ignore_eos</code>, no SSE error, and valid UTF-8 and JSON in every event. "
          "Failures stay in the denominator. Tables show the median over rounds; charts the median "
          "(line) and the min–max over rounds (band, whiskers). TTFT is to the first non-empty "
          "text fragment; TPOT = (last − first fragment) / (completion tokens − 1); throughput = "
          "successful output tokens / whole round time.</p>\n",
          f);

    if (cfg->mode == PD_BENCH_MATRIX) {
        for (int s = 0; s < cfg->n_shapes; s++) {
            int g0 = s * cfg->n_conc, g1 = g0 + cfg->n_conc;
            fprintf(f, "<h2>input %d / output %d tokens</h2>\n", cfg->shape_in[s],
                    cfg->shape_out[s]);
            group_table(f, run, g0, g1);
            fputs("<div class=\"charts\">\n", f);
            char t[96];
            snprintf(t, sizeof t, "%d/%d: output throughput", cfg->shape_in[s], cfg->shape_out[s]);
            chart_groups(f, run, g0, g1, M_THROUGHPUT, t, "client concurrency", "tokens/s", false);
            snprintf(t, sizeof t, "%d/%d: TTFT P95", cfg->shape_in[s], cfg->shape_out[s]);
            chart_groups(f, run, g0, g1, M_TTFT_P95, t, "client concurrency", "seconds", false);
            snprintf(t, sizeof t, "%d/%d: TPOT P50", cfg->shape_in[s], cfg->shape_out[s]);
            chart_groups(f, run, g0, g1, M_TPOT_P50, t, "client concurrency", "seconds", false);
            fputs("</div>\n", f);
        }
    } else if (cfg->mode == PD_BENCH_RATE) {
        fprintf(f,
                "<h2>rate scan, input %d / output %d tokens, SLO TTFT ≤ %g s, TPOT ≤ %g s</h2>\n",
                cfg->shape_in[0], cfg->shape_out[0], cfg->slo_ttft_s, cfg->slo_tpot_s);
        group_table(f, run, 0, run->n_groups);
        fputs("<div class=\"charts\">\n", f);
        chart_groups(f, run, 0, run->n_groups, M_SLO, "SLO compliance", "arrival rate (req/s)",
                     "compliant / requests", true);
        chart_groups(f, run, 0, run->n_groups, M_THROUGHPUT, "output throughput",
                     "arrival rate (req/s)", "tokens/s", true);
        chart_groups(f, run, 0, run->n_groups, M_TTFT_P95, "TTFT P95", "arrival rate (req/s)",
                     "seconds", true);
        fputs("</div>\n", f);
    } else if (cfg->mode == PD_BENCH_RETRIEVAL) {
        fputs("<h2>long-context retrieval</h2>\n<p>Three codes at 10%, 50% and 90% of a synthetic "
              "document; the answer must be a JSON object mapping each project to its code, exact "
              "match. Prompt tokens counted here are compared with the server's usage.</p>\n",
              f);
        group_table(f, run, 0, run->n_groups);
    } else {
        fputs("<h2>functional checks</h2>\n<table><tr><th>check</th><th>passes</th>"
              "<th>last failure</th></tr>\n",
              f);
        for (int i = 0; i < run->n_checks; i++) {
            const pd_bench_check *c = &run->checks[i];
            fprintf(f, "<tr><td>%s</td><td%s>%d/%d</td><td style=\"text-align:left\">", c->name,
                    c->passes < c->runs ? " class=\"bad\"" : "", c->passes, c->runs);
            html_esc(f, c->last_failure);
            fputs("</td></tr>\n", f);
        }
        fputs("</table>\n", f);
    }
    /* rounds that were not run */
    bool header = false;
    for (int gi = 0; gi < run->n_groups; gi++)
        for (int r = 0; r < run->groups[gi].n_rounds; r++)
            if (!run->groups[gi].rounds[r].run) {
                if (!header && run->interrupted)
                    fputs("<h2>rounds not run</h2><p>The run was interrupted:</p><ul>", f);
                else if (!header)
                    fprintf(f,
                            "<h2>rounds not run</h2><p>Stopped after %d consecutive rounds with "
                            "a failed request:</p><ul>",
                            cfg->stop_after_failed_rounds);
                header = true;
                fputs("<li>", f);
                html_esc(f, run->groups[gi].name);
                fprintf(f, " round %d</li>", r + 1);
            }
    if (header)
        fputs("</ul>\n", f);
    if (run->n_notes) {
        fprintf(f,
                "<h2>failures</h2><p>%d failed requests; raw answers in <code>failed/</code>. "
                "The first ones:</p><ul>",
                run->failed_files);
        for (int i = 0; i < run->n_notes; i++) {
            fputs("<li><code>", f);
            html_esc(f, run->notes[i]);
            fputs("</code></li>\n", f);
        }
        fputs("</ul>\n", f);
    }
    fputs("<p>Files: <code>summary.json</code>, <code>rounds.csv</code>, <code>requests.csv</code>"
          ", <code>failed/</code>.</p></body></html>\n",
          f);
    if (fclose(f))
        return pd_err_set(err, PD_ERR_IO, "bench: cannot write %s", path);
    return PD_OK;
}

pd_status pd_bench_report_write(const pd_bench_run *run, pd_err *err) {
    char path[4200];
    const char *dir = run->cfg->out_dir;
    snprintf(path, sizeof path, "%s/rounds.csv", dir);
    pd_status st = write_rounds_csv(run, path, err);
    if (st != PD_OK)
        return st;
    json_t *s = pd_bench_summary_json(run);
    snprintf(path, sizeof path, "%s/summary.json", dir);
    if (!s || json_dump_file(s, path, JSON_INDENT(1) | JSON_REAL_PRECISION(8))) {
        json_decref(s);
        return pd_err_set(err, PD_ERR_IO, "bench: cannot write %s", path);
    }
    json_decref(s);
    snprintf(path, sizeof path, "%s/report.html", dir);
    return write_html(run, path, err);
}

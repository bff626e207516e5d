/* Percentiles and the measures of one round (pd_bench.h, pd_bench_round).
 *
 * Throughput counts only successful output tokens over the whole round
 * (first start to last end), so failures lower it; TTFT/TPOT/E2E
 * distributions are over the successes; every request, failed or not, is in
 * the denominator of the success and SLO ratios. */
#include <math.h>
#include <string.h>

#include "pd_bench.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y ? 1 : 0;
}

/* Moves the non-NAN values to the front; returns how many there are. */
static int drop_nan(double *v, int n) {
    int k = 0;
    for (int i = 0; i < n; i++)
        if (!isnan(v[i]))
            v[k++] = v[i];
    return k;
}

double pd_bench_percentile(double *v, int n, double p) {
    if (!v || n <= 0)
        return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    if (p <= 0)
        return v[0];
    if (p >= 100)
        return v[n - 1];
    double pos = p / 100.0 * (n - 1);
    int lo = (int)floor(pos);
    double frac = pos - lo;
    return lo + 1 < n ? v[lo] + (v[lo + 1] - v[lo]) * frac : v[lo];
}

double pd_bench_median(double *v, int n) {
    if (!v)
        return NAN;
    return pd_bench_percentile(v, drop_nan(v, n), 50);
}

pd_bench_dist pd_bench_dist_of(double *v, int n) {
    pd_bench_dist d = {0, NAN, NAN, NAN, NAN, NAN};
    if (!v)
        return d;
    n = drop_nan(v, n);
    d.n = n;
    if (n == 0)
        return d;
    double s = 0;
    for (int i = 0; i < n; i++)
        s += v[i];
    d.mean = s / n;
    d.p50 = pd_bench_percentile(v, n, 50);
    d.p95 = pd_bench_percentile(v, n, 95);
    d.p99 = pd_bench_percentile(v, n, 99);
    d.max = v[n - 1];
    return d;
}

void pd_bench_round_compute(const pd_bench_req *reqs, int n, double t0, double t1,
                            double slo_ttft_s, double slo_tpot_s, pd_bench_round *rd) {
    int round = rd->round, score = rd->score, score_max = rd->score_max;
    memset(rd, 0, sizeof *rd);
    rd->round = round, rd->score = score, rd->score_max = score_max;
    rd->run = true;
    rd->requests = n;
    rd->duration_s = t1 - t0;
    rd->slo_ratio = NAN;
    double *a = calloc((size_t)(n > 0 ? n : 1) * 5, sizeof *a);
    if (!a) {
        rd->ttft = rd->tpot = rd->e2e = pd_bench_dist_of(NULL, 0);
        return;
    }
    double *ttft = a, *tpot = a + n, *e2e = a + 2 * n, *pl = a + 3 * n, *ps = a + 4 * n;
    int k = 0;
    for (int i = 0; i < n; i++) {
        const pd_bench_req *r = &reqs[i];
        pl[i] = r->prompt_tokens_local >= 0 ? r->prompt_tokens_local : NAN;
        ps[i] = r->prompt_tokens >= 0 ? (double)r->prompt_tokens : NAN;
        if (r->prompt_tokens_local >= 0 && r->prompt_tokens >= 0 &&
            r->prompt_tokens != r->prompt_tokens_local)
            rd->prompt_mismatches++;
        if (r->outcome != PD_BENCH_SUCCESS) {
            rd->failures[r->outcome]++;
            continue;
        }
        rd->successes++;
        rd->output_tokens += r->completion_tokens;
        ttft[k] = pd_bench_req_ttft(r);
        tpot[k] = pd_bench_req_tpot(r);
        e2e[k] = pd_bench_req_e2e(r);
        k++;
        if (slo_ttft_s > 0 || slo_tpot_s > 0) {
            double t = pd_bench_req_ttft(r), p = pd_bench_req_tpot(r);
            bool ok = (slo_ttft_s <= 0 || (!isnan(t) && t <= slo_ttft_s)) &&
                      (slo_tpot_s <= 0 || isnan(p) || p <= slo_tpot_s);
            rd->slo_compliant += ok;
        }
    }
    rd->ttft = pd_bench_dist_of(ttft, k);
    rd->tpot = pd_bench_dist_of(tpot, k);
    rd->e2e = pd_bench_dist_of(e2e, k);
    rd->prompt_tokens_local = pd_bench_median(pl, n);
    rd->prompt_tokens_server = pd_bench_median(ps, n);
    if (rd->duration_s > 0) {
        rd->throughput_tok_s = (double)rd->output_tokens / rd->duration_s;
        rd->request_throughput_s = rd->successes / rd->duration_s;
    }
    if (slo_ttft_s > 0 || slo_tpot_s > 0)
        rd->slo_ratio = n > 0 ? (double)rd->slo_compliant / n : NAN;
    free(a);
}

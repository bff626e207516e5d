#include "pd_metrics.h"

#include <stdarg.h>
#include <string.h>

const double pd_buckets_ttft_s[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                    2.5,   5.0,   7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const int pd_buckets_ttft_n = (int)(sizeof pd_buckets_ttft_s / sizeof pd_buckets_ttft_s[0]);
const double pd_buckets_itl_s[] = {0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                                   0.1,   0.15,  0.2,  0.3,   0.4,  0.5,   0.75, 1.0,  2.5,  5.0, 7.5, 10.0, 20.0, 80.0};
const int pd_buckets_itl_n = (int)(sizeof pd_buckets_itl_s / sizeof pd_buckets_itl_s[0]);

void pd_strbuf_printf(pd_strbuf *b, const char *fmt, ...) {
    for (;;) {
        size_t room = b->cap - b->len;
        va_list ap;
        va_start(ap, fmt);
        int n = b->data ? vsnprintf(b->data + b->len, room, fmt, ap) : -1;
        va_end(ap);
        if (n >= 0 && (size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        size_t need = b->len + (n > 0 ? (size_t)n : 256) + 1;
        size_t cap = b->cap ? b->cap * 2 : 1024;
        while (cap < need) cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d) abort();
        b->data = d;
        b->cap = cap;
    }
}

void pd_strbuf_free(pd_strbuf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

void pd_hist_init(pd_hist *h, const double *bounds, int n) {
    memset(h, 0, sizeof *h);
    if (n > PD_HIST_MAX_BUCKETS) n = PD_HIST_MAX_BUCKETS;
    h->n_buckets = n;
    memcpy(h->bounds, bounds, (size_t)n * sizeof(double));
}

void pd_hist_observe(pd_hist *h, double v) {
    int i = 0;
    while (i < h->n_buckets && v > h->bounds[i]) i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

double pd_hist_quantile(const pd_hist *h, double q) {
    if (h->count == 0) return 0.0;
    double target = q * (double)h->count;
    uint64_t cum = 0;
    for (int i = 0; i <= h->n_buckets; i++) {
        uint64_t prev = cum;
        cum += h->counts[i];
        if ((double)cum >= target && h->counts[i] > 0) {
            double lo = i == 0 ? 0.0 : h->bounds[i - 1];
            double hi = i < h->n_buckets ? h->bounds[i] : lo;
            return lo + (hi - lo) * ((target - (double)prev) / (double)h->counts[i]);
        }
    }
    return h->n_buckets ? h->bounds[h->n_buckets - 1] : 0.0;
}

void pd_hist_render(const pd_hist *h, const char *name, const char *labels, pd_strbuf *out) {
    const char *sep = labels && *labels ? "," : "";
    uint64_t cum = 0;
    for (int i = 0; i < h->n_buckets; i++) {
        cum += h->counts[i];
        pd_strbuf_printf(out, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, labels ? labels : "", sep, h->bounds[i],
                         (unsigned long long)cum);
    }
    cum += h->counts[h->n_buckets];
    pd_strbuf_printf(out, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels ? labels : "", sep, (unsigned long long)cum);
    pd_strbuf_printf(out, "%s_sum{%s} %.9g\n%s_count{%s} %llu\n", name, labels ? labels : "", h->sum, name,
                     labels ? labels : "", (unsigned long long)h->count);
}

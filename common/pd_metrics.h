/* Prometheus text exposition (format 0.0.4): counters and histograms with
 * fixed buckets, rendered into a growable text buffer. Not thread-safe:
 * each owner updates and renders its metrics on one thread. */
#ifndef PD_METRICS_H
#define PD_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "pd_common.h"

/** A growable NUL-terminated text buffer. */
typedef struct {
    char *data;
    size_t len, cap;
} pd_strbuf;

void pd_strbuf_printf(pd_strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void pd_strbuf_free(pd_strbuf *b);

#define PD_HIST_MAX_BUCKETS 32

/** A histogram of one label set: cumulative buckets ("le"), sum, count. */
typedef struct {
    int n_buckets;
    double bounds[PD_HIST_MAX_BUCKETS]; /* upper bounds, increasing; +Inf implicit */
    uint64_t counts[PD_HIST_MAX_BUCKETS + 1];
    double sum;
    uint64_t count;
} pd_hist;

/** Initialises h with bounds (n <= PD_HIST_MAX_BUCKETS, increasing). */
void pd_hist_init(pd_hist *h, const double *bounds, int n);
/** Records one observation (seconds, tokens, ...). */
void pd_hist_observe(pd_hist *h, double v);
/** The q-quantile (0..1) estimated from the buckets (linear inside a bucket). */
double pd_hist_quantile(const pd_hist *h, double q);
/** Writes the _bucket, _sum and _count lines of name{labels} (labels
 * without braces, e.g. `model_name="x",class="short"`, may be ""). */
void pd_hist_render(const pd_hist *h, const char *name, const char *labels, pd_strbuf *out);

/** Latency buckets in seconds used by vLLM for TTFT (also good for E2E). */
extern const double pd_buckets_ttft_s[];
extern const int pd_buckets_ttft_n;
/** Inter-token latency buckets in seconds. */
extern const double pd_buckets_itl_s[];
extern const int pd_buckets_itl_n;

#endif

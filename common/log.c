#include "pd_common.h"

#include <pthread.h>
#include <stdarg.h>
#include <string.h>
#include <strings.h>
#include <time.h>

static int g_level = -1;
static pthread_mutex_t g_log_mu = PTHREAD_MUTEX_INITIALIZER;

void pd_log_set_level(pd_log_level lvl) {
    g_level = (int)lvl;
}

static int log_level(void) {
    if (g_level < 0) {
        const char *e = getenv("PDSERVE_LOG_LEVEL");
        g_level = PD_LOG_INFO;
        if (e) {
            if (!strcasecmp(e, "debug")) g_level = PD_LOG_DEBUG;
            else if (!strcasecmp(e, "warn")) g_level = PD_LOG_WARN;
            else if (!strcasecmp(e, "error")) g_level = PD_LOG_ERROR;
        }
    }
    return g_level;
}

void pd_log(pd_log_level lvl, const char *module, const char *fmt, ...) {
    if ((int)lvl < log_level())
        return;
    static const char *names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char tbuf[32];
    strftime(tbuf, sizeof tbuf, "%Y-%m-%dT%H:%M:%S", &tm);
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&g_log_mu);
    fprintf(stderr, "%s.%03ldZ %-5s %s: %s\n", tbuf, ts.tv_nsec / 1000000, names[lvl], module, msg);
    pthread_mutex_unlock(&g_log_mu);
}

double pd_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

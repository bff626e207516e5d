/* A replica's own /metrics endpoint: a thread running a small libevent
 * evhttp server that answers GET /metrics (Prometheus text) and GET /health
 * from a snapshot the service publishes (pd_metrics_server_publish). The
 * service loop never blocks on it and it never touches service state. */
#ifndef PD_METRICS_SERVER_H
#define PD_METRICS_SERVER_H

#include "pd_common.h"
#include "pd_metrics.h"

typedef struct pd_metrics_server pd_metrics_server;

/** Binds host:port (port 0: none — returns PD_OK with *s_p NULL) and starts
 * the thread. Errors: PD_ERR_IO (bind failed, err names the address). */
pd_status pd_metrics_server_start(const char *host, int port, pd_metrics_server **s_p, pd_err *err);
/** Replaces the text served at /metrics (copied). Thread-safe; NULL s is a no-op. */
void pd_metrics_server_publish(pd_metrics_server *s, const char *text, size_t len);
/** Appends to b what is read at scrape time (GPU telemetry): called on the
 * server's thread for every GET /metrics, after the published snapshot, so
 * that the service loop never makes those calls. user is borrowed and must
 * outlive the server (or a later call with fn NULL). Thread-safe; NULL s is
 * a no-op. */
typedef void (*pd_metrics_scrape_fn)(void *user, pd_strbuf *b);
void pd_metrics_server_set_scrape(pd_metrics_server *s, pd_metrics_scrape_fn fn, void *user);
/** Stops the thread, closes the socket and every connection still open,
 * frees; *s_p = NULL. NULL s_p or *s_p is a no-op. */
void pd_metrics_server_stop(pd_metrics_server **s_p);

#endif

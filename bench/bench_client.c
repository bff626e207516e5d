/* The HTTP side of `pdserve bench`: one libcurl multi handle (one
 * connection pool) driving every request from the calling thread, after
 * the libcurl "multi-app" pattern: add handles, curl_multi_perform,
 * curl_multi_info_read for the finished ones, curl_multi_poll to wait.
 *
 * HTTP/1.1: one connection per request in flight, reused between
 * requests. HTTP/2 (--http2): streams multiplexed over few connections
 * (CURLOPT_PIPEWAIT), prior knowledge for http:// (h2c), ALPN for https://.
 */
#include <curl/curl.h>
#include <signal.h>
#include <string.h>
#include <sys/resource.h>

#include "pd_bench.h"

struct pd_bench_client {
    CURLM *multi;
    struct curl_slist *headers;
    char *base_url;
    bool http2, https;
    long h2_version; /* CURLOPT_HTTP_VERSION for --http2 */
    double timeout_s;
};

static int curl_refs;
static volatile sig_atomic_t stop_flag;

void pd_bench_stop_request(void) {
    stop_flag = 1;
}

bool pd_bench_stop_requested(void) {
    return stop_flag != 0;
}

pd_status pd_bench_client_init(const pd_bench_client_opts *o, pd_bench_client **c_p, pd_err *err) {
    if (!o || !c_p || !o->base_url || !o->base_url[0])
        return pd_err_set(err, PD_ERR_INVALID, "bench: a --base-url is needed");
    if (strncmp(o->base_url, "http://", 7) && strncmp(o->base_url, "https://", 8))
        return pd_err_set(err, PD_ERR_INVALID, "bench: --base-url '%s' is not http:// or https://",
                          o->base_url);
    if (curl_refs++ == 0 && curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        curl_refs--;
        return pd_err_set(err, PD_ERR_IO, "bench: curl_global_init failed");
    }
    pd_bench_client *c = calloc(1, sizeof *c);
    if (!c)
        goto nomem;
    c->base_url = strdup(o->base_url);
    if (!c->base_url)
        goto nomem;
    size_t bl = strlen(c->base_url);
    while (bl && c->base_url[bl - 1] == '/')
        c->base_url[--bl] = 0;
    c->https = !strncmp(c->base_url, "https://", 8);
    c->http2 = o->http2;
    /* h2c: prior knowledge, except on libcurl < 8.0, whose prior-knowledge
     * connections fail every request after the first ("Error in the HTTP2
     * framing layer", curl issue #10634, fixed by commit 86d4578 in 8.0.0);
     * there the first request of a connection upgrades it (Upgrade: h2c)
     * and the others multiplex over it. */
    const curl_version_info_data *vi = curl_version_info(CURLVERSION_NOW);
    c->h2_version = c->https                      ? CURL_HTTP_VERSION_2TLS
                    : vi->version_num >= 0x080000 ? CURL_HTTP_VERSION_2_PRIOR_KNOWLEDGE
                                                  : CURL_HTTP_VERSION_2_0;
    c->timeout_s = o->timeout_s;
    c->multi = curl_multi_init();
    if (!c->multi)
        goto nomem;
    curl_multi_setopt(c->multi, CURLMOPT_PIPELINING,
                      o->http2 ? CURLPIPE_MULTIPLEX : CURLPIPE_NOTHING);
    curl_multi_setopt(c->multi, CURLMOPT_MAX_HOST_CONNECTIONS, 0L);
    curl_multi_setopt(c->multi, CURLMOPT_MAXCONNECTS, 4096L);
    c->headers = curl_slist_append(NULL, "Content-Type: application/json");
    if (!c->headers)
        goto nomem;
    c->headers = curl_slist_append(c->headers, "Expect:"); /* no 100-continue round trip */
    if (o->api_key && o->api_key[0]) {
        char auth[1024];
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", o->api_key);
        c->headers = curl_slist_append(c->headers, auth);
    }
    /* thousands of streams need thousands of sockets */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    *c_p = c;
    return PD_OK;
nomem:
    if (c)
        pd_bench_client_free(&c); /* also drops the libcurl reference */
    else if (--curl_refs == 0)
        curl_global_cleanup();
    return pd_err_set(err, PD_ERR_NOMEM, "bench: out of memory starting the client");
}

void pd_bench_client_free(pd_bench_client **c_p) {
    if (!c_p || !*c_p)
        return;
    pd_bench_client *c = *c_p;
    if (c->multi)
        curl_multi_cleanup(c->multi);
    curl_slist_free_all(c->headers);
    free(c->base_url);
    free(c);
    *c_p = NULL;
    if (--curl_refs == 0)
        curl_global_cleanup();
}

static void easy_common(pd_bench_client *c, CURL *e, const char *path, char *url, size_t cap) {
    snprintf(url, cap, "%s%s", c->base_url, path);
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, c->headers);
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, 30000L);
    if (c->timeout_s > 0)
        curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)(c->timeout_s * 1000.0 + 0.5));
    if (c->http2) {
        curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)c->h2_version);
        curl_easy_setopt(e, CURLOPT_PIPEWAIT, 1L);
    } else
        curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
}

static size_t get_write(char *p, size_t sz, size_t nm, void *ud) {
    return pd_bench_buf_append(ud, p, sz * nm) ? 0 : sz * nm;
}

pd_status pd_bench_client_get_json(pd_bench_client *c, const char *path, json_t **json_p,
                                   pd_err *err) {
    CURL *e = curl_easy_init();
    if (!e)
        return pd_err_set(err, PD_ERR_NOMEM, "bench: curl_easy_init failed");
    char url[1024];
    pd_bench_buf body = {0};
    easy_common(c, e, path, url, sizeof url);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, 30000L);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, get_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &body);
    CURLcode cc = curl_easy_perform(e);
    long status = 0;
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(e);
    pd_status st = PD_OK;
    if (cc != CURLE_OK)
        st = pd_err_set(err, PD_ERR_IO, "bench: GET %s: %s", url, curl_easy_strerror(cc));
    else if (status != 200)
        st = pd_err_set(err, PD_ERR_IO, "bench: GET %s: HTTP %ld", url, status);
    else {
        json_error_t je;
        *json_p = json_loadb(body.data ? body.data : "", body.len, 0, &je);
        if (!*json_p)
            st = pd_err_set(err, PD_ERR_FORMAT, "bench: GET %s: not JSON: %s", url, je.text);
    }
    pd_bench_buf_free(&body);
    return st;
}

/* ---- runs ----------------------------------------------------------------- */

typedef struct {
    pd_bench_req *r;
    CURL *easy;
    char url[1024];
} slot;

static size_t run_write(char *p, size_t sz, size_t nm, void *ud) {
    slot *s = ud;
    if (s->r->http_status == 0) {
        long st = 0;
        curl_easy_getinfo(s->easy, CURLINFO_RESPONSE_CODE, &st);
        s->r->http_status = st;
    }
    pd_bench_req_feed(s->r, p, sz * nm, pd_now_s());
    return sz * nm;
}

static int start(pd_bench_client *c, CURLM *m, slot *s, pd_bench_req *r) {
    s->r = r;
    s->easy = curl_easy_init();
    if (!s->easy)
        return -1;
    easy_common(c, s->easy,
                r->endpoint == PD_BENCH_EP_CHAT ? "/v1/chat/completions" : "/v1/completions",
                s->url, sizeof s->url);
    curl_easy_setopt(s->easy, CURLOPT_POSTFIELDS, r->body);
    curl_easy_setopt(s->easy, CURLOPT_POSTFIELDSIZE, (long)strlen(r->body));
    curl_easy_setopt(s->easy, CURLOPT_WRITEFUNCTION, run_write);
    curl_easy_setopt(s->easy, CURLOPT_WRITEDATA, s);
    curl_easy_setopt(s->easy, CURLOPT_PRIVATE, s);
    r->t_start = pd_now_s();
    if (curl_multi_add_handle(m, s->easy) != CURLM_OK) {
        curl_easy_cleanup(s->easy);
        s->easy = NULL;
        return -1;
    }
    return 0;
}

static void finish(CURLM *m, slot *s, CURLcode cc) {
    long st = 0, ver = 0;
    curl_easy_getinfo(s->easy, CURLINFO_RESPONSE_CODE, &st);
    if (st)
        s->r->http_status = st;
    curl_easy_getinfo(s->easy, CURLINFO_HTTP_VERSION, &ver);
    s->r->http_version = ver == CURL_HTTP_VERSION_1_0   ? 10
                         : ver == CURL_HTTP_VERSION_1_1 ? 11
                         : ver == CURL_HTTP_VERSION_2_0 ? 20
                         : ver == CURL_HTTP_VERSION_3   ? 30
                                                        : 0;
    int transport = cc == CURLE_OK ? 0 : cc == CURLE_OPERATION_TIMEDOUT ? 1 : 2;
    char detail[160];
    snprintf(detail, sizeof detail, "curl %d: %s", (int)cc, curl_easy_strerror(cc));
    pd_bench_req_finish(s->r, transport, detail, pd_now_s());
    curl_multi_remove_handle(m, s->easy);
    curl_easy_cleanup(s->easy);
    s->easy = NULL;
}

pd_status pd_bench_client_run(pd_bench_client *c, pd_bench_req *reqs, int n, int concurrency,
                              bool open_loop, pd_bench_progress_fn fn, void *arg, double *t0_p,
                              double *t1_p, pd_err *err) {
    if (!c || (n > 0 && !reqs) || n < 0 || (!open_loop && concurrency < 1))
        return pd_err_set(err, PD_ERR_INVALID, "bench: bad run arguments");
    slot *slots = calloc(n ? (size_t)n : 1, sizeof *slots);
    if (!slots)
        return pd_err_set(err, PD_ERR_NOMEM, "bench: out of memory for %d requests", n);
    pd_status st = PD_OK;
    int next = 0, inflight = 0, finished = 0, failed = 0;
    double t0 = pd_now_s(), last_progress = 0;
    while (finished < n) {
        if (stop_flag) {
            /* abandon what is in flight; what never started is marked below */
            for (int i = 0; i < next; i++)
                if (slots[i].easy) {
                    pd_bench_req_finish(slots[i].r, 2, "interrupted", pd_now_s());
                    curl_multi_remove_handle(c->multi, slots[i].easy);
                    curl_easy_cleanup(slots[i].easy);
                    slots[i].easy = NULL;
                }
            break;
        }
        double now = pd_now_s();
        while (next < n && st == PD_OK) {
            if (open_loop ? t0 + reqs[next].arrival_s > now : inflight >= concurrency)
                break;
            if (start(c, c->multi, &slots[next], &reqs[next])) {
                st = pd_err_set(err, PD_ERR_IO, "bench: libcurl refused request %d", next);
                break;
            }
            next++, inflight++;
        }
        if (st != PD_OK && inflight == 0)
            break;
        int running = 0;
        curl_multi_perform(c->multi, &running);
        int ended = 0, left;
        CURLMsg *msg;
        while ((msg = curl_multi_info_read(c->multi, &left))) {
            if (msg->msg != CURLMSG_DONE)
                continue;
            slot *s = NULL;
            curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&s);
            finish(c->multi, s, msg->data.result);
            if (s->r->outcome != PD_BENCH_SUCCESS)
                failed++;
            inflight--, finished++, ended++;
        }
        now = pd_now_s();
        if (fn && now - last_progress >= 0.2) {
            fn(arg, next, finished, failed, n, now - t0);
            last_progress = now;
        }
        if (finished == n || (ended && st == PD_OK))
            continue;
        int wait_ms = 200;
        if (open_loop && next < n && st == PD_OK) {
            double dt = t0 + reqs[next].arrival_s - now;
            wait_ms = dt <= 0 ? 0 : dt < 0.2 ? (int)(dt * 1000.0) + 1 : 200;
            if (dt <= 0)
                continue;
        }
        curl_multi_poll(c->multi, NULL, 0, wait_ms, NULL);
    }
    /* requests never started (libcurl refused one, or a stop) count as
     * transport failures */
    for (int i = next; i < n; i++) {
        reqs[i].t_start = pd_now_s();
        pd_bench_req_finish(&reqs[i], 2,
                            stop_flag ? "interrupted" : "not started: libcurl refused a handle",
                            pd_now_s());
    }
    double t1 = pd_now_s();
    if (fn)
        fn(arg, next, n, failed, n, t1 - t0);
    free(slots);
    if (t0_p)
        *t0_p = t0;
    if (t1_p)
        *t1_p = t1;
    return st;
}

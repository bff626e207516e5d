/* pdserve up: the embedded default deployment on one host — a gateway, P
 * prefill and D decode replicas as child processes of this one. It prints
 * where it listens and an example request, restarts nothing silently (a
 * child that exits is reported, and the stack keeps serving with what is
 * left), and stops every child on SIGINT/SIGTERM, reporting each one's end. Exit status: 0 after
 * SIGINT/SIGTERM, 1 when the gateway exited by itself (the rest is then
 * stopped), 2 for bad flags, a model directory whose files cannot be read or
 * an HTTP or control port already in use (all checked before any child
 * starts, so a stack that cannot serve prints no banner). Flags it does not know
 * are passed to the replicas (e.g. --max-num-seqs). Every flag it routes (its
 * own and the gateway's) is accepted as "--flag value" and as "--flag=value",
 * as getopt_long accepts both in the services. */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdbool.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>

#include "pd_cli.h"
#include "pd_common.h"
#include "pd_kernels.h"
#include "pd_metrics.h"
#include "pd_model.h"
#include "pd_replica_ops.h"

#define MAX_CHILDREN 64

typedef struct {
    pid_t pid;
    char name[64];
} child;

static child g_children[MAX_CHILDREN];
static int g_n_children;
static volatile sig_atomic_t g_stop;

static volatile sig_atomic_t g_signals; /* how many SIGINT / SIGTERM so far */
static void on_signal(int sig) {
    g_stop = sig;
    g_signals++;
}

/* Reports how child C ended (STATUS from waitpid) on stderr; TAIL follows
 * ("; not restarted" while the stack serves on, "" once it is going down). */
static void report_exit(const child *c, int status, const char *tail) {
    if (WIFSIGNALED(status))
        fprintf(stderr, "pdserve up: %s (pid %d) killed by signal %d%s\n", c->name, (int)c->pid,
                WTERMSIG(status), tail);
    else
        fprintf(stderr, "pdserve up: %s (pid %d) exited with status %d%s\n", c->name, (int)c->pid,
                WEXITSTATUS(status), tail);
}

static pid_t spawn(const char *self, char **args, const char *name, const char *env) {
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "pdserve up: fork: %s\n", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        setpgid(0, 0); /* our own group: Ctrl-C reaches only the parent, which stops us in order */
        prctl(PR_SET_PDEATHSIG, SIGTERM); /* and if the parent dies (even SIGKILL), we stop too */
        if (getppid() == 1) _exit(1);    /* the parent died before prctl */
        if (env && *env)
            putenv((char *)env); /* "CUDA_VISIBLE_DEVICES=...": this replica's GPUs */
        execv(self, args);
        fprintf(stderr, "pdserve up: exec %s: %s\n", self, strerror(errno));
        _exit(127);
    }
    if (g_n_children < MAX_CHILDREN) {
        g_children[g_n_children].pid = pid;
        snprintf(g_children[g_n_children].name, sizeof g_children[0].name, "%s", name);
        g_n_children++;
    }
    return pid;
}

static const char *self_exe(void) {
    static char buf[4096];
    ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n <= 0) return "pdserve";
    buf[n] = 0;
    return buf;
}

/* Whether A is "--NAME" or "--NAME=..." for the flag NAME given with its dashes. */
static bool flag_is(const char *a, const char *name) {
    size_t n = strlen(name);
    return !strncmp(a, name, n) && (a[n] == 0 || a[n] == '=');
}

/* The value of flag NAME at argv[*i]: "--NAME value" (then *i moves to the
 * value) or "--NAME=value"; NULL when argv[*i] is another flag or NAME lacks
 * its value. Borrows from argv. */
static const char *flag_value(int argc, char **argv, int *i, const char *name) {
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, name, n)) return NULL;
    if (a[n] == '=') return a + n + 1;
    if (a[n] == 0 && *i + 1 < argc) return argv[++*i];
    return NULL;
}

/* *out = V as a whole decimal int; false (and a message naming FLAG) if V is not one. */
static bool int_value(const char *flag, const char *v, int *out) {
    char *end = NULL;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < -2147483647L || x > 2147483647L) {
        fprintf(stderr, "pdserve up: %s needs an integer, got '%s'\n", flag, v);
        return false;
    }
    *out = (int)x;
    return true;
}

/* Whether something already listens on HOST:PORT: a trial bind (with
 * SO_REUSEADDR, as the gateway's listeners have it, so connections in
 * TIME_WAIT do not count) fails with EADDRINUSE on any of HOST's addresses.
 * False when HOST does not resolve (the gateway then says why). */
static bool port_in_use(const char *host, int port) {
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    if (getaddrinfo(host, ps, &hints, &res) != 0) return false;
    bool used = false;
    for (struct addrinfo *a = res; a && !used; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 && errno == EADDRINUSE) used = true;
        close(fd);
    }
    freeaddrinfo(res);
    return used;
}

/* Whether PATH can be opened for reading; else says why, naming PATH. */
static bool readable(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "pdserve up: %s: cannot open: %s\n", path, strerror(errno));
        return false;
    }
    close(fd);
    return true;
}

/* The files every child opens first, checked before any starts (as vLLM
 * and SGLang check a model before serving): DIR/config.json read and
 * parsed, the tokenizer (TOKENIZER, else DIR/tokenizer.json) and the
 * weights (DIR/model.safetensors.index.json, else DIR/model.safetensors)
 * readable. The weights' headers are the replicas' to validate (and
 * --verify-checkpoint's). False, with a message naming the file, when one
 * fails. */
static bool model_files_ok(const char *dir, const char *tokenizer) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    pd_model_config cfg;
    pd_err err = {{0}};
    if (pd_config_load(path, &cfg, &err) != PD_OK) {
        fprintf(stderr, "pdserve up: %s\n", err.msg);
        return false;
    }
    if (tokenizer) {
        if (!readable(tokenizer)) return false;
    } else {
        snprintf(path, sizeof path, "%s/tokenizer.json", dir);
        if (!readable(path)) return false;
    }
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    if (access(path, F_OK) != 0) snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (access(path, F_OK) != 0) {
        fprintf(stderr, "pdserve up: %s: neither model.safetensors.index.json nor model.safetensors found\n",
                dir);
        return false;
    }
    return readable(path);
}

/* Flags that belong to the gateway alone (the rest go to the replicas);
 * A in either form, "--flag" or "--flag=value". */
static bool is_gateway_flag(const char *a) {
    static const char *names[] = {"--max-concurrent-requests-short", "--max-concurrent-requests-long",
                                  "--max-queued-requests-short", "--max-queued-requests-long", "--request-timeout",
                                  "--queue-timeout", "--max-prefill-jobs-per-replica",
                                  "--max-model-len", "--max-stop-strings", "--max-logprobs", "--tokenizer-pool-size",
                                  "--ssl-certfile", "--ssl-keyfile", "--max-concurrent-streams", "--tokenizer",
                                  "--max-request-body-bytes", "--timeout-keep-alive", "--max-connections",
                                  "--max-header-bytes", "--max-header-count", "--timeout-request-headers",
                                  "--timeout-request-body", "--timeout-write", "--reasoning-parser",
                                  "--tool-call-parser", "--shutdown-timeout"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (flag_is(a, names[i])) return true;
    return false;
}

/* The GPUs the replicas may use, as names CUDA_VISIBLE_DEVICES takes: the
 * entries of up's own CUDA_VISIBLE_DEVICES when it is set, else the
 * device ordinals CUDA finds (no CUDA context is made). PD_UP_FAKE_GPUS=N
 * (testing, on machines without GPUs) pretends N ordinals. Returns how many. */
static int visible_gpus(char (*vis)[64], int cap) {
    int n = 0;
    const char *fake = getenv("PD_UP_FAKE_GPUS");
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    if (fake && *fake) {
        for (int i = 0; i < atoi(fake) && n < cap; i++)
            snprintf(vis[n++], 64, "%d", i);
    } else if (cvd && *cvd) {
        char buf[1024];
        snprintf(buf, sizeof buf, "%s", cvd);
        for (char *save = NULL, *t = strtok_r(buf, ",", &save); t && n < cap; t = strtok_r(NULL, ",", &save))
            snprintf(vis[n++], 64, "%.63s", t);
    } else {
        pd_cuda_device_info info;
        pd_err err = {{0}};
        while (n < cap && pd_backend_cuda_device_info(n, false, &info, &err) == PD_OK) {
            snprintf(vis[n], 64, "%d", n);
            n++;
        }
    }
    return n;
}

/* The gateway's base URL: https with TLS, an IPv6 literal bracketed; with
 * REACHABLE, as a client on this host reaches it (a wildcard HOST, 0.0.0.0,
 * :: or empty, becomes loopback), else as it listens. */
static void gateway_url(const char *host, int port, bool tls, bool reachable, char *out, size_t n) {
    const char *h = host;
    if (reachable && (!*h || !strcmp(h, "0.0.0.0"))) h = "127.0.0.1";
    else if (reachable && !strcmp(h, "::")) h = "::1";
    bool v6 = strchr(h, ':') != NULL;
    snprintf(out, n, "%s://%s%s%s:%d", tls ? "https" : "http", v6 ? "[" : "", h, v6 ? "]" : "", port);
}

/* NAME as it goes inside the try: line's -d '...': a JSON string's content
 * (quote, backslash and control characters escaped), then each ' written
 * as '\'' for the shell. */
static void shell_json_name(const char *name, char *out, size_t n) {
    size_t k = 0;
    for (const unsigned char *p = (const unsigned char *)name; *p && k + 8 < n; p++) {
        if (*p == '"' || *p == '\\') {
            out[k++] = '\\';
            out[k++] = (char)*p;
        } else if (*p < 0x20) {
            k += (size_t)snprintf(out + k, n - k, "\\u%04x", *p);
        } else if (*p == '\'') {
            memcpy(out + k, "'\\''", 4);
            k += 4;
        } else {
            out[k++] = (char)*p;
        }
    }
    out[k] = 0;
}

static size_t collect(char *data, size_t size, size_t n, void *ud) {
    pd_strbuf *b = ud;
    pd_strbuf_printf(b, "%.*s", (int)(size * n), data);
    return size * n;
}

/* The value of `pdserve:replicas_alive{role="ROLE"}` in a /metrics text, or -1. */
static long alive_of(const char *text, const char *role) {
    char key[64];
    snprintf(key, sizeof key, "pdserve:replicas_alive{role=\"%s\"} ", role);
    const char *p = strstr(text, key);
    return p ? strtol(p + strlen(key), NULL, 10) : -1;
}

/* Whether the gateway at BASE_URL counts at least N_PREFILL prefill and
 * N_DECODE decode replicas alive (its /metrics, fetched with libcurl with a
 * 1 s timeout; TLS certificates are not checked: it is our own child). */
static bool replicas_registered(const char *base_url, int n_prefill, int n_decode) {
    CURL *c = curl_easy_init();
    if (!c) return false;
    char url[384];
    snprintf(url, sizeof url, "%s/metrics", base_url);
    pd_strbuf body = {0};
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 1000L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_SSL_VERIFYPEER, 0L);
    curl_easy_setopt(c, CURLOPT_SSL_VERIFYHOST, 0L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &body);
    long code = 0;
    bool ok = curl_easy_perform(c) == CURLE_OK && curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code) == CURLE_OK &&
              code == 200 && body.data && alive_of(body.data, "prefill") >= n_prefill &&
              alive_of(body.data, "decode") >= n_decode;
    curl_easy_cleanup(c);
    pd_strbuf_free(&body);
    return ok;
}

int pd_cmd_up(int argc, char **argv) {
    char *gw_extra[64];
    int n_gw_extra = 0;
    const char *model = NULL, *host = "127.0.0.1", *name = NULL, *hb = NULL, *tokenizer = NULL;
    int metrics_port = 0; /* replica r serves its /metrics on metrics_port + r */
    int port = 8000, n_prefill = 1, n_decode = 1, threshold = 1024;
    const char *placement = "auto"; /* --gpu-placement auto|shared */
    char *passthrough[128];
    int n_pass = 0;
    bool bad = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v;
#define TAKE(flag) ((v = flag_value(argc, argv, &i, flag)) != NULL)
        if (TAKE("--model")) model = v;
        else if (TAKE("--host")) host = v;
        else if (TAKE("--port")) bad |= !int_value("--port", v, &port);
        else if (TAKE("--prefill-replicas")) bad |= !int_value("--prefill-replicas", v, &n_prefill);
        else if (TAKE("--decode-replicas")) bad |= !int_value("--decode-replicas", v, &n_decode);
        else if (TAKE("--long-prompt-threshold")) {
            bad |= !int_value("--long-prompt-threshold", v, &threshold);
            if (threshold < 0) { /* the gateway refuses it too, after up has started it */
                fprintf(stderr, "pdserve up: --long-prompt-threshold %d must be >= 0 (tokens)\n", threshold);
                bad = true;
            }
        }
        else if (TAKE("--served-model-name")) name = v;
        else if (TAKE("--heartbeat-interval-ms")) { /* checked here: the gateway and every replica take it */
            int hb_ms = 0;
            bad |= !int_value("--heartbeat-interval-ms", v, &hb_ms);
            hb = v;
        }
        else if (TAKE("--metrics-port")) bad |= !int_value("--metrics-port", v, &metrics_port);
        else if (TAKE("--gpu-placement")) placement = v;
        else if (is_gateway_flag(a) && strchr(a, '=') && n_gw_extra < 60) {
            gw_extra[n_gw_extra++] = argv[i]; /* "--flag=value": getopt_long splits it */
            if (flag_is(a, "--tokenizer")) tokenizer = strchr(a, '=') + 1;
            if (flag_is(a, "--tokenizer") && n_pass < 120)
                passthrough[n_pass++] = argv[i]; /* the replicas read it too (constrained decoding) */
        } else if (is_gateway_flag(a) && i + 1 < argc && n_gw_extra < 60) {
            gw_extra[n_gw_extra++] = argv[i];
            gw_extra[n_gw_extra++] = argv[i + 1];
            if (flag_is(a, "--tokenizer")) tokenizer = argv[i + 1];
            if (flag_is(a, "--tokenizer") && n_pass < 119) {
                passthrough[n_pass++] = argv[i];
                passthrough[n_pass++] = argv[i + 1];
            }
            i++;
        }
        else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: pdserve up --model DIR [--host H] [--port 8000] [--prefill-replicas N]\n"
                   "                  [--decode-replicas M] [--long-prompt-threshold T] [--served-model-name NAME]\n"
                   "                  [--metrics-port P (replica r serves /metrics on P + r)]\n"
                   "                  [--gpu-placement auto|shared (--device cuda: auto gives each replica its own\n"
                   "                   --tensor-parallel-size GPUs when there are enough, else they share)]\n"
                   "                  [gateway flags, e.g. --max-model-len 4096 --ssl-certfile F --ssl-keyfile F]\n"
                   "                  [replica flags, e.g. --max-num-seqs 64 --chunked-prefill-size 512 --numa auto]\n"
                   "Starts a gateway on HOST:PORT (control on PORT+1) and the replicas as child processes,\n"
                   "prints 'pdserve up: ready' once every replica has registered with the gateway;\n"
                   "Ctrl-C stops everything. Gateway flags are passed to the gateway, the rest to every\n"
                   "replica: `pdserve gateway --help`, `pdserve prefill --help` and `pdserve decode --help`\n"
                   "list them with their defaults.\n");
            return 0;
        } else if (n_pass < 120) {
            passthrough[n_pass++] = argv[i];
        }
#undef TAKE
    }
    if (bad) return 2;
    if (!model) {
        fprintf(stderr, "pdserve up: --model is required (try: make run)\n");
        return 2;
    }
    if (n_prefill < 0 || n_decode < 1 || n_prefill + n_decode + 1 > MAX_CHILDREN || port <= 0 || port >= 65535) {
        fprintf(stderr, "pdserve up: need at least 1 decode replica, at most %d replicas, a valid --port\n",
                MAX_CHILDREN - 1);
        return 2;
    }
    if (strcmp(placement, "auto") != 0 && strcmp(placement, "shared") != 0) {
        fprintf(stderr, "pdserve up: --gpu-placement must be auto or shared, got '%s'\n", placement);
        return 2;
    }
    if (!model_files_ok(model, tokenizer)) return 2;
    /* Checked before any child starts: replicas connect to the control port
     * whoever holds it, so a second stack on a busy port would register its
     * replicas, under the same ids, with the first stack's gateway (taking
     * them over) and then die with its gateway, leaving the first stack
     * without replicas. */
    bool http_used = port_in_use(host, port), ctrl_used = port_in_use("127.0.0.1", port + 1);
    if (http_used || ctrl_used) {
        if (http_used)
            fprintf(stderr, "pdserve up: port %d (HTTP on %s) is in use", port, host);
        else
            fprintf(stderr, "pdserve up: port %d (control, --port + 1, on 127.0.0.1) is in use", port + 1);
        fprintf(stderr, ", by another pdserve up or another program; pick another --port\n");
        return 2;
    }
    /* GPU placement: the replicas' --device and --tensor-parallel-size (they pass through) */
    const char *device = "cpu";
    int tp = 1;
    for (int i = 0; i < n_pass; i++) {
        const char *a = passthrough[i], *nx = i + 1 < n_pass ? passthrough[i + 1] : NULL;
        if (!strcmp(a, "--device") && nx) device = nx;
        else if (!strncmp(a, "--device=", 9)) device = a + 9;
        else if (!strcmp(a, "--tensor-parallel-size") && nx) tp = atoi(nx);
        else if (!strncmp(a, "--tensor-parallel-size=", 23)) tp = atoi(a + 23);
    }
    char gpu_env[MAX_CHILDREN][640];
    memset(gpu_env, 0, sizeof gpu_env);
    if (!strcmp(device, "cuda") && !strcmp(placement, "auto") && tp >= 1) {
        char vis[64][64];
        int n_vis = visible_gpus(vis, 64);
        int first[MAX_CHILDREN];
        const int n_rep = n_prefill + n_decode;
        if (pd_gpu_placement_plan(n_vis, n_rep, tp, first)) {
            for (int r = 0; r < n_rep; r++) {
                char *e = gpu_env[r];
                size_t off = (size_t)snprintf(e, sizeof gpu_env[0], "CUDA_VISIBLE_DEVICES=");
                for (int g = 0; g < tp; g++)
                    off += (size_t)snprintf(e + off, sizeof gpu_env[0] - off, "%s%s", g ? "," : "", vis[first[r] + g]);
                printf("pdserve up: %s-%d on GPU%s %s\n", r < n_prefill ? "prefill" : "decode",
                       r < n_prefill ? r : r - n_prefill, tp > 1 ? "s" : "", e + strlen("CUDA_VISIBLE_DEVICES="));
            }
        } else if (n_vis > 0) {
            printf("pdserve up: %d GPU%s for %d replicas of %d: the replicas share GPU%s 0..%d (give each its share "
                   "with --gpu-memory-utilization)\n",
                   n_vis, n_vis > 1 ? "s" : "", n_rep, tp, tp > 1 ? "s" : "", tp - 1);
        }
    }
    bool tls = false;
    double shutdown_timeout = 30; /* the gateway's --shutdown-timeout (its default) */
    for (int i = 0; i < n_gw_extra; i++) {
        tls |= flag_is(gw_extra[i], "--ssl-certfile");
        if (flag_is(gw_extra[i], "--shutdown-timeout")) {
            const char *v = strchr(gw_extra[i], '=') ? strchr(gw_extra[i], '=') + 1
                            : i + 1 < n_gw_extra ? gw_extra[i + 1]
                                                 : NULL;
            double t = v ? strtod(v, NULL) : 30;
            shutdown_timeout = t >= 0 && t <= 1e6 ? t : 30; /* the gateway refuses a bad one */
        }
    }
    const char *self = self_exe();
    char portbuf[16], ctrl[64], thr[16];
    snprintf(portbuf, sizeof portbuf, "%d", port);
    snprintf(ctrl, sizeof ctrl, "tcp://127.0.0.1:%d", port + 1);
    snprintf(thr, sizeof thr, "%d", threshold);
    /* no SA_RESTART: the signal must interrupt waitpid below */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    char *gw[128] = {"pdserve", "gateway", "--model", (char *)model, "--host", (char *)host, "--port", portbuf,
                    "--control", ctrl, "--long-prompt-threshold", thr};
    int k = 12;
    if (name) {
        gw[k++] = "--served-model-name";
        gw[k++] = (char *)name;
    }
    if (hb) {
        gw[k++] = "--heartbeat-interval-ms";
        gw[k++] = (char *)hb;
    }
    for (int i = 0; i < n_gw_extra; i++) gw[k++] = gw_extra[i];
    gw[k] = NULL;
    if (spawn(self, gw, "gateway", NULL) < 0) return 1;
    for (int r = 0; r < n_prefill + n_decode; r++) {
        bool is_prefill = r < n_prefill;
        char rid[64];
        snprintf(rid, sizeof rid, "%s-%d", is_prefill ? "prefill" : "decode", is_prefill ? r : r - n_prefill);
        char *args[160] = {"pdserve", is_prefill ? "prefill" : "decode", "--model", (char *)model, "--gateway", ctrl,
                           "--replica-id", rid, "--shutdown-timeout", "0"};
        /* --shutdown-timeout 0: up drains at the gateway, and stops the
         * replicas only after it (their own drain would only wait) */
        int n = 10;
        if (hb) {
            args[n++] = "--heartbeat-interval-ms";
            args[n++] = (char *)hb;
        }
        char mport[16];
        if (metrics_port > 0) {
            snprintf(mport, sizeof mport, "%d", metrics_port + r);
            args[n++] = "--metrics-port";
            args[n++] = mport;
        }
        for (int i = 0; i < n_pass; i++) args[n++] = passthrough[i];
        args[n] = NULL;
        if (spawn(self, args, rid, gpu_env[r]) < 0) {
            g_stop = SIGTERM;
            break;
        }
    }
    char shown_url[320];
    gateway_url(host, port, tls, false, shown_url, sizeof shown_url);
    printf("pdserve up: gateway on %s (control %s), %d prefill + %d decode replicas, long prompts > %d "
           "tokens go through prefill\n",
           shown_url, ctrl, n_prefill, n_decode, threshold);
    if (n_prefill == 0)
        printf("pdserve up: no prefill replica: the decode replicas prefill every prompt, those over %d tokens "
               "too\n",
               threshold);
    fflush(stdout);
    /* Until every replica has registered, poll the gateway's /metrics every
     * 0.2 s while reaping children; then say so (the stack serves from
     * here), and block in waitpid. */
    char base_url[320];
    gateway_url(host, port, tls, true, base_url, sizeof base_url);
    bool ready = false;
    double t_start = pd_now_s();
    char shown[1024];
    shell_json_name(name ? name : model, shown, sizeof shown);
    int alive = g_n_children, rc = 0;
    while (!g_stop && alive > 0) {
        int status;
        pid_t pid = waitpid(-1, &status, ready ? 0 : WNOHANG);
        if (pid == 0) {
            if (replicas_registered(base_url, n_prefill, n_decode)) {
                ready = true;
                printf("pdserve up: ready: %d prefill + %d decode replicas registered, %.1f s after start\n"
                       "try:\n  curl %s/v1/chat/completions -H 'Content-Type: application/json'%s \\\n"
                       "    -d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], "
                       "\"max_tokens\": 32}'\n",
                       n_prefill, n_decode, pd_now_s() - t_start, base_url, tls ? " -k" : "", shown);
                fflush(stdout);
            } else {
                struct timespec ts = {0, 200 * 1000 * 1000};
                nanosleep(&ts, NULL);
            }
            continue;
        }
        if (pid < 0) {
            if (errno == EINTR) continue;
            break;
        }
        for (int i = 0; i < g_n_children; i++)
            if (g_children[i].pid == pid) {
                /* before ready, a replica that exits failed to start (a bad
                 * flag, a model it cannot load): the stack never would be
                 * whole, so stop it and exit 1, as when the gateway fails */
                report_exit(&g_children[i], status, ready ? "; not restarted" : " before the stack was ready; stopping");
                g_children[i].pid = 0;
                alive--;
                if (!strcmp(g_children[i].name, "gateway") || !ready) {
                    g_stop = SIGTERM; /* nothing to serve without it */
                    rc = 1;           /* and it was not asked to stop */
                }
            }
    }
    /* The gateway first: on SIGTERM it drains (no new request; those running
     * finish within its --shutdown-timeout) while the replicas still serve
     * them. A second Ctrl-C is passed on: the gateway then stops at once.
     * Then the replicas; SIGKILL what lingers 5 s after. Every child's end
     * is reported, those that had already exited (and were not reaped above)
     * too: a replica that failed at start-up says so here. */
    for (int i = 0; i < g_n_children; i++) {
        if (g_children[i].pid <= 0 || strcmp(g_children[i].name, "gateway") != 0) continue;
        child *gwc = &g_children[i];
        kill(gwc->pid, SIGTERM);
        int seen = g_signals;
        double gw_deadline = pd_now_s() + shutdown_timeout + 5.0;
        while (gwc->pid > 0) {
            int status;
            pid_t pid = waitpid(-1, &status, WNOHANG);
            for (int j = 0; pid > 0 && j < g_n_children; j++)
                if (g_children[j].pid == pid) {
                    report_exit(&g_children[j], status, "");
                    g_children[j].pid = 0;
                }
            if (gwc->pid <= 0) break;
            if (pd_now_s() > gw_deadline) {
                kill(gwc->pid, SIGKILL);
                if (waitpid(gwc->pid, &status, 0) == gwc->pid) report_exit(gwc, status, " after its drain");
                gwc->pid = 0;
                break;
            }
            if (g_signals != seen) { /* Ctrl-C again: stop at once */
                seen = g_signals;
                kill(gwc->pid, SIGTERM);
            }
            if (pid <= 0) {
                struct timespec ts = {0, 50 * 1000 * 1000};
                nanosleep(&ts, NULL);
            }
        }
    }
    for (int i = 0; i < g_n_children; i++)
        if (g_children[i].pid > 0) kill(g_children[i].pid, SIGTERM);
    double deadline = pd_now_s() + 5.0;
    while (pd_now_s() < deadline) {
        int left = 0;
        for (int i = 0; i < g_n_children; i++) {
            if (g_children[i].pid <= 0) continue;
            int status;
            if (waitpid(g_children[i].pid, &status, WNOHANG) == g_children[i].pid) {
                report_exit(&g_children[i], status, "");
                g_children[i].pid = 0;
            } else {
                left++;
            }
        }
        if (!left) break;
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    for (int i = 0; i < g_n_children; i++)
        if (g_children[i].pid > 0) {
            int status;
            kill(g_children[i].pid, SIGKILL);
            if (waitpid(g_children[i].pid, &status, 0) == g_children[i].pid)
                report_exit(&g_children[i], status, " after 5 s");
        }
    fprintf(stderr, "pdserve up: stopped\n");
    return rc;
}

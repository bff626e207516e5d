/* Version and build report; library versions at run time against the
 * versions of the headers this build was compiled with. */
#include "pd_version.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include <cblas.h> /* OpenBLAS: openblas_get_config, OPENBLAS_VERSION */
#include <curl/curl.h>
#include <event2/event.h>
#include <jansson.h>
#include <nghttp2/nghttp2.h>
#include <openssl/crypto.h>
#include <openssl/opensslv.h>
#include <protobuf-c/protobuf-c.h>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>
#include <zmq.h>
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#ifdef PD_HAVE_CUDA
#include "cuda/pd_cuda.h"
#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_runtime_api.h>
#endif

#include "pd_build_config.h"
#include "pd_common.h"

const char *pd_version(void) {
    return PD_VERSION;
}

const char *pd_version_commit(void) {
    return PD_BUILD_COMMIT;
}

bool pd_version_has_cuda(void) {
#ifdef PD_HAVE_CUDA
    return true;
#else
    return false;
#endif
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static char g_line[256], g_labels[160];

static void version_strings_init(void) {
    snprintf(g_line, sizeof g_line, "pdserve %s (commit %s), %s, CUDA %s, sanitizers %s, %s",
             PD_VERSION, PD_BUILD_COMMIT, PD_BUILD_TYPE[0] ? PD_BUILD_TYPE : "no build type",
             pd_version_has_cuda() ? "on (sm_90a)" : "off", PD_BUILD_SANITIZERS, PD_BUILD_COMPILER);
    snprintf(g_labels, sizeof g_labels, "version=\"%s\",commit=\"%s\",cuda=\"%s\"", PD_VERSION,
             PD_BUILD_COMMIT, pd_version_has_cuda() ? "on" : "off");
}

const char *pd_version_line(void) {
    pthread_once(&g_once, version_strings_init);
    return g_line;
}

const char *pd_version_build_info_labels(void) {
    pthread_once(&g_once, version_strings_init);
    return g_labels;
}

/* The first run of dot-separated numbers in s ("3.0.19" in "OpenSSL 3.0.19
 * 27 Jan 2026"), up to 4 of them. Returns how many were read (0: none). */
static int ver_parse(const char *s, long v[4]) {
    while (*s && (*s < '0' || *s > '9'))
        s++;
    int n = 0;
    while (n < 4 && *s >= '0' && *s <= '9') {
        long x = 0;
        while (*s >= '0' && *s <= '9')
            x = x * 10 + (*s++ - '0');
        v[n++] = x;
        if (s[0] != '.' || s[1] < '0' || s[1] > '9')
            break;
        s++;
    }
    return n;
}

/* Compares as many components as both sides have. */
static bool ver_differs(const char *a, const char *b) {
    long va[4], vb[4];
    int na = ver_parse(a, va), nb = ver_parse(b, vb);
    int n = na < nb ? na : nb;
    if (n == 0)
        return false; /* nothing to compare: not flagged */
    for (int i = 0; i < n; i++)
        if (va[i] != vb[i])
            return true;
    return false;
}

static void trim_copy(char *dst, size_t cap, const char *src) {
    while (*src == ' ')
        src++;
    snprintf(dst, cap, "%s", src);
    size_t n = strlen(dst);
    while (n > 0 && (dst[n - 1] == ' ' || dst[n - 1] == '\n'))
        dst[--n] = '\0';
}

/* Appends one library (NULL when deps is full); compares unless compiled is "-". */
static pd_dep_version *dep_add(pd_dep_version *deps, int cap, int *n, const char *name,
                               const char *compiled, const char *loaded) {
    if (*n >= cap)
        return NULL;
    pd_dep_version *d = &deps[(*n)++];
    memset(d, 0, sizeof *d);
    snprintf(d->name, sizeof d->name, "%s", name);
    trim_copy(d->compiled, sizeof d->compiled, compiled);
    trim_copy(d->loaded, sizeof d->loaded, loaded);
    if (strcmp(compiled, "-") != 0 && ver_differs(d->compiled, d->loaded)) {
        d->mismatch = true;
        snprintf(d->note, sizeof d->note, "loaded version differs from the headers the build used");
    }
    return d;
}

#ifdef PD_HAVE_CUDA
/* CUDA runtime, driver and cuBLASLt: the run-time calls only when a device
 * is present (a host without one may have no driver at all). */
static void deps_cuda(pd_dep_version *deps, int cap, int *n) {
    char compiled[64], loaded[192];
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    bool have = e == cudaSuccess && ndev > 0;
    char none[160];
    snprintf(none, sizeof none, "no device (%s)",
             e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));

    int rt = 0;
    snprintf(compiled, sizeof compiled, "%d.%d", CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
    if (have && cudaRuntimeGetVersion(&rt) == cudaSuccess)
        snprintf(loaded, sizeof loaded, "%d.%d", rt / 1000, rt % 1000 / 10);
    else
        snprintf(loaded, sizeof loaded, "%s", have ? "unknown" : "no device");
    dep_add(deps, cap, n, "CUDA runtime", compiled, loaded);

    int drv = 0;
    if (have && cudaDriverGetVersion(&drv) == cudaSuccess)
        snprintf(loaded, sizeof loaded, "%d.%d", drv / 1000, drv % 1000 / 10);
    else
        snprintf(loaded, sizeof loaded, "%s", have ? "unknown" : none);
    pd_dep_version *d = dep_add(deps, cap, n, "CUDA driver", "-", loaded);
    if (d && drv > 0 && rt > 0 && drv < rt) {
        d->mismatch = true;
        snprintf(d->note, sizeof d->note,
                 "the driver supports CUDA %d.%d, older than the runtime %d.%d", drv / 1000,
                 drv % 1000 / 10, rt / 1000, rt % 1000 / 10);
    }

    snprintf(compiled, sizeof compiled, "%d.%d.%d", CUBLAS_VER_MAJOR, CUBLAS_VER_MINOR,
             CUBLAS_VER_PATCH);
    if (have) {
        size_t v = cublasLtGetVersion(); /* major*10000 + minor*100 + patch */
        snprintf(loaded, sizeof loaded, "%zu.%zu.%zu", v / 10000, v / 100 % 100, v % 100);
    } else {
        snprintf(loaded, sizeof loaded, "no device");
    }
    dep_add(deps, cap, n, "cuBLASLt", compiled, loaded);

    /* NCCL is loaded at run time (kernels/cuda/comm.cu): no headers to compare with */
    pd_cuda_nccl_version(loaded, sizeof loaded);
    dep_add(deps, cap, n, "NCCL", "- (run time)", loaded);
}
#endif

/* UCX's transports on this host, as UCX itself finds them at run time:
 * every memory domain of every component, opened, and its transport
 * resources listed as "tl/device" ("posix/memory, tcp/eth0, ..."), the
 * resources UCP chooses among. Writes "none" when UCX finds none and the
 * failing call when a query fails. */
static void ucx_transports(char *out, size_t cap) {
    size_t off = 0;
    out[0] = '\0';
    uct_component_h *comps = NULL;
    unsigned n_comps = 0;
    if (uct_query_components(&comps, &n_comps) != UCS_OK) {
        snprintf(out, cap, "uct_query_components failed");
        return;
    }
    for (unsigned c = 0; c < n_comps; c++) {
        uct_component_attr_t ca = {.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME |
                                                 UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT};
        if (uct_component_query(comps[c], &ca) != UCS_OK || ca.md_resource_count == 0)
            continue;
        uct_md_resource_desc_t *mds = calloc(ca.md_resource_count, sizeof *mds);
        if (!mds)
            break;
        ca.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
        ca.md_resources = mds;
        if (uct_component_query(comps[c], &ca) == UCS_OK) {
            for (unsigned m = 0; m < ca.md_resource_count; m++) {
                uct_md_config_t *cfg = NULL;
                uct_md_h md = NULL;
                if (uct_md_config_read(comps[c], NULL, NULL, &cfg) != UCS_OK)
                    continue;
                if (uct_md_open(comps[c], mds[m].md_name, cfg, &md) == UCS_OK) {
                    uct_tl_resource_desc_t *tls = NULL;
                    unsigned n_tls = 0;
                    if (uct_md_query_tl_resources(md, &tls, &n_tls) == UCS_OK) {
                        for (unsigned t = 0; t < n_tls && off < cap; t++)
                            off += (size_t)snprintf(out + off, cap - off, "%s%s/%s", off ? ", " : "",
                                                    tls[t].tl_name, tls[t].dev_name);
                        uct_release_tl_resource_list(tls);
                    }
                    uct_md_close(md);
                }
                uct_config_release(cfg);
            }
        }
        free(mds);
    }
    uct_release_component_list(comps);
    if (off >= cap && cap > 4)
        memcpy(out + cap - 4, "...", 4);
    if (!out[0])
        snprintf(out, cap, "none");
}

int pd_version_deps(pd_dep_version *deps, int cap) {
    int n = 0;
    char compiled[64], loaded[192];

    int zmaj, zmin, zpat;
    zmq_version(&zmaj, &zmin, &zpat);
    snprintf(compiled, sizeof compiled, "%d.%d.%d", ZMQ_VERSION_MAJOR, ZMQ_VERSION_MINOR,
             ZMQ_VERSION_PATCH);
    snprintf(loaded, sizeof loaded, "%d.%d.%d", zmaj, zmin, zpat);
    dep_add(deps, cap, &n, "ZeroMQ", compiled, loaded);

    dep_add(deps, cap, &n, "protobuf-c", PROTOBUF_C_VERSION, protobuf_c_version());

    const nghttp2_info *h2 = nghttp2_version(0);
    dep_add(deps, cap, &n, "nghttp2", NGHTTP2_VERSION,
            h2 && h2->version_str ? h2->version_str : "unknown");

    dep_add(deps, cap, &n, "jansson", JANSSON_VERSION, jansson_version_str());

#ifdef OPENSSL_VERSION_STR
    dep_add(deps, cap, &n, "OpenSSL", OPENSSL_VERSION_STR, OpenSSL_version(OPENSSL_VERSION));
#else
    dep_add(deps, cap, &n, "OpenSSL", OPENSSL_VERSION_TEXT, OpenSSL_version(OPENSSL_VERSION));
#endif

    snprintf(compiled, sizeof compiled, "%d.%d", UCP_API_MAJOR, UCP_API_MINOR);
    dep_add(deps, cap, &n, "UCX", compiled, ucp_get_version_string());
    {
        char tl[sizeof deps[0].loaded];
        ucx_transports(tl, sizeof tl);
        dep_add(deps, cap, &n, "UCX transports", "-", tl);
    }

    dep_add(deps, cap, &n, "libevent", LIBEVENT_VERSION, event_get_version());

    snprintf(compiled, sizeof compiled, "%d.%d", PCRE2_MAJOR, PCRE2_MINOR);
    char pcre[64] = "unknown";
    if (pcre2_config(PCRE2_CONFIG_VERSION, NULL) <= (int)sizeof pcre)
        pcre2_config(PCRE2_CONFIG_VERSION, pcre);
    dep_add(deps, cap, &n, "PCRE2", compiled, pcre);

#ifdef OPENBLAS_VERSION
    dep_add(deps, cap, &n, "OpenBLAS", OPENBLAS_VERSION, openblas_get_config());
#else
    dep_add(deps, cap, &n, "OpenBLAS", "-", openblas_get_config());
#endif

    dep_add(deps, cap, &n, "libcurl", LIBCURL_VERSION, curl_version());

#ifdef PD_HAVE_CUDA
    deps_cuda(deps, cap, &n);
#endif
    return n;
}

int pd_version_deps_mismatches(const pd_dep_version *deps, int n) {
    int k = 0;
    for (int i = 0; i < n; i++)
        k += deps[i].mismatch;
    return k;
}

char *pd_version_deps_line(const pd_dep_version *deps, int n, char *buf, size_t cap) {
    if (cap == 0)
        return buf;
    buf[0] = '\0';
    size_t off = 0;
    for (int i = 0; i < n && off < cap; i++) {
        if (!strcmp(deps[i].name, "UCX transports")) /* a list, not a version: its own line */
            continue;
        /* the version number alone; the whole string when it has none or
         * says why there is none ("no device (<the driver's error>)", "not
         * loaded: <why>"), whose digits are not a version */
        const char *ld = deps[i].loaded;
        long v[4];
        int nv = strncmp(ld, "no ", 3) && strncmp(ld, "not ", 4) ? ver_parse(ld, v) : 0;
        char ver[sizeof deps[0].loaded] = "";
        if (nv == 0)
            snprintf(ver, sizeof ver, "%s", ld);
        for (int k = 0; k < nv; k++)
            snprintf(ver + strlen(ver), sizeof ver - strlen(ver), "%s%ld", k ? "." : "", v[k]);
        off +=
            (size_t)snprintf(buf + off, cap - off, "%s%s %s", off ? ", " : "", deps[i].name, ver);
    }
    return buf;
}

void pd_version_log(const char *module) {
    PD_LOGI(module, "%s", pd_version_line());
    pd_dep_version deps[PD_DEPS_MAX];
    int n = pd_version_deps(deps, PD_DEPS_MAX);
    char line[PD_VERSION_DEPS_LINE_MAX];
    PD_LOGI(module, "libraries loaded: %s", pd_version_deps_line(deps, n, line, sizeof line));
    for (int i = 0; i < n; i++)
        if (!strcmp(deps[i].name, "UCX transports"))
            PD_LOGI(module, "UCX transports: %s", deps[i].loaded);
    for (int i = 0; i < n; i++)
        if (deps[i].mismatch)
            PD_LOGW(module, "%s: loaded %s, built against %s: %s", deps[i].name, deps[i].loaded,
                    deps[i].compiled, deps[i].note);
}

double pd_startup_phase_log(const char *module, const char *who, const char *phase, double t0) {
    double now = pd_now_s();
    PD_LOGI(module, "%s: start-up: %s %.3f s", who, phase, now - t0);
    return now;
}

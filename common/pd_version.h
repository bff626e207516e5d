/* What a pdserve process says about itself when it starts: its version and
 * build options, the versions of the libraries it actually loaded (next to
 * the versions its headers promised at build time, mismatches flagged), and
 * how long each start-up phase took. `pdserve version [--deps]` prints the
 * same; the gateway exposes it as the pdserve:build_info gauge.
 *
 * The git commit and build options come from build/generated/pd_build_config.h
 * (CMakeLists.txt, configured again when HEAD moves). */
#ifndef PD_VERSION_H
#define PD_VERSION_H

#include <stdbool.h>
#include <stddef.h>

/* The release this source tree is; the commit says exactly which tree. */
#define PD_VERSION "0.1.0"

/** PD_VERSION. */
const char *pd_version(void);

/** The commit the build was configured from (12 hex digits), or "unknown"
 * outside a git checkout. */
const char *pd_version_commit(void);

/** True when the CUDA backend is compiled in. */
bool pd_version_has_cuda(void);

/** One line, static: "pdserve 0.1.0 (commit e118164abcde), RelWithDebInfo,
 * CUDA off, sanitizers off, GNU 12.2.0". */
const char *pd_version_line(void);

/** Labels of the pdserve:build_info gauge (value 1), static, thread-safe:
 * `version="0.1.0",commit="e118164abcde",cuda="off"`. Render it as
 *   pdserve:build_info{<labels>} 1 */
const char *pd_version_build_info_labels(void);

/** HELP and TYPE lines of pdserve:build_info, each ending in a newline. */
#define PD_BUILD_INFO_HELP                                                                         \
    "# HELP pdserve:build_info pdserve version, commit and build options (value 1).\n"             \
    "# TYPE pdserve:build_info gauge\n"

/** One library: the version its headers had at build time and the version
 * loaded in this process now. */
typedef struct {
    char name[24];     /* "ZeroMQ", "CUDA driver", ... */
    char compiled[64]; /* from the headers' macros; "-" when there is none (the CUDA driver) */
    char loaded[192];  /* what the library's run-time call returned; "no device" for CUDA
                          on a host without one */
    bool mismatch;     /* loaded differs from compiled (or the driver is older than the runtime) */
    char note[128];    /* why it is flagged; "" otherwise */
} pd_dep_version;

#define PD_DEPS_MAX 16

/** Fills deps (cap entries at most) with ZeroMQ, protobuf-c, nghttp2,
 * jansson, OpenSSL, UCX, libevent, PCRE2, OpenBLAS and libcurl, then "UCX
 * transports" (compiled "-"; loaded: the "tl/device" resources UCX finds on
 * this host at run time, e.g. "self/memory0, tcp/eth0, posix/memory") and,
 * in a CUDA build, the CUDA runtime, driver and cuBLASLt — whose run-time
 * calls are made only when cudaGetDeviceCount finds a device — and NCCL
 * (loaded at run time; its version or "not loaded: <why>"). Versions are compared by
 * their numeric components (as many as both sides have: UCX headers give
 * only major.minor). Returns the number filled. */
int pd_version_deps(pd_dep_version *deps, int cap);

/** The number of flagged entries among n. */
int pd_version_deps_mismatches(const pd_dep_version *deps, int n);

/** Bytes that hold the longest pd_version_deps_line of PD_DEPS_MAX entries
 * (each name, ", ", " " and the whole loaded string). */
#define PD_VERSION_DEPS_LINE_MAX (PD_DEPS_MAX * (24 + 192 + 3) + 1)

/** The "libraries loaded" list of deps[0..n) into buf (cap bytes, always
 * NUL-terminated when cap > 0; a longer list is cut at cap):
 * "ZeroMQ 4.3.4, OpenSSL 3.0.19, CUDA driver no device (<the driver's
 * error>)": each library's version number, or its whole loaded string when
 * that has no number or starts "no " / "not " (why there is none: "no
 * device (..)", "not loaded: .."); "UCX transports" is left out (a list,
 * logged on its own line). Returns buf. */
char *pd_version_deps_line(const pd_dep_version *deps, int n, char *buf, size_t cap);

/** Logs the version line, then the loaded libraries on one line, then one
 * WARN per mismatch. Every service calls it first, after its flags parse. */
void pd_version_log(const char *module);

/** Logs "<who>: start-up: <phase> <seconds since t0> s" at INFO and returns
 * the current pd_now_s(), so phases chain: t = pd_startup_phase_log(.., t). */
double pd_startup_phase_log(const char *module, const char *who, const char *phase, double t0);

#endif

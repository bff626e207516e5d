/* Version report (common/version.c): the version line, the build_info
 * labels, and every library of the contract listed with a compiled and a
 * loaded version — on this machine, built and run here, none mismatched. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "pd_common.h"
#include "pd_version.h"

static void test_line_and_labels(void **state) {
    const char *line = pd_version_line();
    assert_non_null(strstr(line, "pdserve " PD_VERSION " (commit "));
    assert_non_null(strstr(line, pd_version_has_cuda() ? "CUDA on" : "CUDA off"));
    assert_non_null(strstr(line, "sanitizers "));
    char want[256];
    snprintf(want, sizeof want, "version=\"%s\",commit=\"%s\",cuda=\"%s\"", PD_VERSION,
             pd_version_commit(), pd_version_has_cuda() ? "on" : "off");
    assert_string_equal(pd_version_build_info_labels(), want);
    assert_true(strlen(pd_version_commit()) > 0);
    assert_non_null(strstr(PD_BUILD_INFO_HELP, "# TYPE pdserve:build_info gauge\n"));
}

static void test_every_library(void **state) {
    pd_dep_version d[PD_DEPS_MAX];
    int n = pd_version_deps(d, PD_DEPS_MAX);
    const char *names[] = {"ZeroMQ", "protobuf-c", "nghttp2", "jansson",  "OpenSSL",
                           "UCX",    "libevent",   "PCRE2",   "OpenBLAS", "libcurl", "UCX transports"};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        int found = -1;
        for (int i = 0; i < n; i++)
            if (!strcmp(d[i].name, names[k]))
                found = i;
        if (found < 0)
            fail_msg("%s not reported", names[k]);
        assert_true(d[found].compiled[0] != '\0');
        assert_true(d[found].loaded[0] != '\0');
        assert_true(strcmp(d[found].loaded, "unknown") != 0);
        if (d[found].mismatch)
            fail_msg("%s: loaded %s, built against %s", names[k], d[found].loaded,
                     d[found].compiled);
    }
    /* UCX always has its loopback transport, "self" (UCX docs: UCX_TLS) */
    for (int i = 0; i < n; i++)
        if (!strcmp(d[i].name, "UCX transports") && !strstr(d[i].loaded, "self/"))
            fail_msg("UCX transports '%s' lack self", d[i].loaded);
    /* CUDA builds add the runtime, the driver, cuBLASLt and NCCL */
    int want = (int)(sizeof names / sizeof names[0]) + (pd_version_has_cuda() ? 4 : 0);
    assert_int_equal(n, want);
    assert_int_equal(pd_version_deps_mismatches(d, n), 0);
    /* a full table is not overrun */
    assert_int_equal(pd_version_deps(d, 3), 3);
}

/* The "libraries loaded" line: a library's version number alone, or its
 * whole run-time string when that has no number (CUDA on a host without a
 * device: the driver's whole error, never cut mid-word); "UCX transports"
 * is not in it (pd_version_log gives it a line of its own). */
static void test_deps_line(void **state) {
    const char *why = "no device (CUDA driver version is insufficient for CUDA runtime version)";
    pd_dep_version d[6];
    memset(d, 0, sizeof d);
    snprintf(d[0].name, sizeof d[0].name, "UCX transports");
    snprintf(d[0].loaded, sizeof d[0].loaded, "self/memory0, tcp/lo");
    snprintf(d[1].name, sizeof d[1].name, "OpenSSL");
    snprintf(d[1].loaded, sizeof d[1].loaded, "OpenSSL 3.0.19 27 Jan 2026");
    snprintf(d[2].name, sizeof d[2].name, "CUDA driver");
    snprintf(d[2].loaded, sizeof d[2].loaded, "%s", why);
    snprintf(d[3].name, sizeof d[3].name, "cuBLASLt");
    snprintf(d[3].loaded, sizeof d[3].loaded, "no device");
    /* reasons with digits in them are not versions */
    snprintf(d[4].name, sizeof d[4].name, "CUDA runtime");
    snprintf(d[4].loaded, sizeof d[4].loaded, "no device (0 devices)");
    snprintf(d[5].name, sizeof d[5].name, "NCCL");
    snprintf(d[5].loaded, sizeof d[5].loaded,
             "not loaded: libnccl.so.2: cannot open shared object file");
    char line[1024];
    assert_ptr_equal(pd_version_deps_line(d, 6, line, sizeof line), line);
    char want[1024];
    snprintf(want, sizeof want, "%s %s, %s %s, %s %s, %s %s, %s %s", d[1].name, "3.0.19", d[2].name,
             why, d[3].name, d[3].loaded, d[4].name, d[4].loaded, d[5].name, d[5].loaded);
    assert_string_equal(line, want);
    /* parentheses closed */
    int depth = 0;
    for (const char *c = line; *c; c++)
        depth += (*c == '(') - (*c == ')');
    assert_int_equal(depth, 0);
    /* a buffer too small: a NUL-terminated prefix of the whole line */
    char small[40];
    pd_version_deps_line(d, 6, small, sizeof small);
    assert_int_equal(strlen(small), sizeof small - 1);
    assert_memory_equal(small, want, sizeof small - 1);
    /* every library of this process fits the line pd_version_log uses */
    pd_dep_version all[PD_DEPS_MAX];
    int n = pd_version_deps(all, PD_DEPS_MAX);
    char big[PD_VERSION_DEPS_LINE_MAX];
    pd_version_deps_line(all, n, big, sizeof big);
    for (int i = 0; i < n; i++)
        if (strcmp(all[i].name, "UCX transports") != 0 && !strstr(big, all[i].name))
            fail_msg("%s missing from '%s'", all[i].name, big);
}

static void test_log_and_phase(void **state) {
    pd_version_log("test"); /* must not crash; the lines go to stderr */
    double t0 = pd_now_s();
    double t1 = pd_startup_phase_log("test", "replica-x", "load weights", t0);
    assert_true(t1 >= t0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_line_and_labels),
        cmocka_unit_test(test_every_library),
        cmocka_unit_test(test_deps_line),
        cmocka_unit_test(test_log_and_phase),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

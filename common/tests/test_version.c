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
        cmocka_unit_test(test_log_and_phase),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

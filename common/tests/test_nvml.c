/* GPU telemetry (common/nvml.c) against a fake NVML (fake_nvml.c, loaded
 * through $PD_NVML_LIB): the values the fake holds come out of a replica's
 * /metrics endpoint in the exported units (mW -> W, MHz -> Hz, % ->
 * fraction), a reading NVML refuses is left out, and a missing library, a
 * failing nvmlInit and an unknown GPU are reported, not fatal. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <curl/curl.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "pd_metrics_server.h"
#include "pd_test_net.h"
#include "pd_nvml.h"
#include "pd_replica_ops.h"

#ifndef PD_FAKE_NVML
#error "CMakeLists.txt defines PD_FAKE_NVML as the fake library's path"
#endif

static void (*fake_reset)(int fail_init);
static void (*fake_set)(const char *, const char *, unsigned, unsigned long long, unsigned long long, unsigned,
                        unsigned, unsigned, int);
static int (*fake_initialised)(void);

static int setup(void **state) {
    void *lib = dlopen(PD_FAKE_NVML, RTLD_NOW | RTLD_LOCAL); /* the same handle pd_nvml_open gets */
    if (!lib) {
        fprintf(stderr, "%s\n", dlerror());
        return -1;
    }
    *(void **)&fake_reset = dlsym(lib, "fake_nvml_reset");
    *(void **)&fake_set = dlsym(lib, "fake_nvml_set");
    *(void **)&fake_initialised = dlsym(lib, "fake_nvml_initialised");
    setenv("PD_NVML_LIB", PD_FAKE_NVML, 1);
    return fake_reset && fake_set && fake_initialised ? 0 : -1;
}

static size_t on_body(char *p, size_t size, size_t n, void *user) {
    pd_strbuf_printf(user, "%.*s", (int)(size * n), p);
    return size * n;
}

/* GET http://127.0.0.1:port/metrics into b. */
static void scrape(int port, pd_strbuf *b) {
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metrics", port);
    CURL *c = curl_easy_init();
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, b);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 10L);
    assert_int_equal(curl_easy_perform(c), CURLE_OK);
    curl_easy_cleanup(c);
}

/* The value of the sample line that starts with `series ` (exact label
 * set); -1 when there is none. */
static double sample(const char *text, const char *series) {
    size_t n = strlen(series);
    for (const char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        if (!strncmp(l, series, n) && l[n] == ' ')
            return strtod(l + n + 1, NULL);
    return -1;
}

static void render(void *user, pd_strbuf *b) { pd_nvml_render(user, "replica=\"t\"", b); }

static void test_values_in_metrics(void **state) {
    fake_reset(0);
    /* an H200-like GPU and a second one that does not report power */
    fake_set("00000000:18:00.0", "NVIDIA H200", 37, 12345678901ull, 150754820096ull, 1980, 312500, 55, 0);
    fake_set("00000000:2A:00.0", "NVIDIA H200", 100, 0, 150754820096ull, 345, 0, 31, 1);
    const char *bus[] = {"00000000:18:00.0", "00000000:2a:00.0"}; /* the fake ignores case, as NVML */
    pd_nvml *nv = NULL;
    pd_err err = {{0}};
    assert_int_equal(pd_nvml_open(bus, 2, &nv, &err), PD_OK);
    assert_int_equal(pd_nvml_count(nv), 2);
    assert_string_equal(pd_nvml_name(nv, 0), "NVIDIA H200");
    assert_string_equal(pd_nvml_driver_version(nv), "999.1.2");
    assert_int_equal(fake_initialised(), 1);

    int port = pd_test_free_port();
    pd_metrics_server *s = NULL;
    assert_int_equal(pd_metrics_server_start("127.0.0.1", port, &s, &err), PD_OK);
    const char *snap = "# TYPE pdserve:num_requests_running gauge\npdserve:num_requests_running{replica=\"t\"} 3\n";
    pd_metrics_server_publish(s, snap, strlen(snap));
    pd_metrics_server_set_scrape(s, render, nv);
    pd_strbuf b = {0};
    scrape(port, &b);
    const char *t = b.data;
    assert_non_null(t);
    assert_true(sample(t, "pdserve:num_requests_running{replica=\"t\"}") == 3); /* the snapshot stays first */
    assert_true(sample(t, "pdserve:gpu_utilization_perc{replica=\"t\",gpu=\"0\"}") == 0.37);
    assert_true(sample(t, "pdserve:gpu_utilization_perc{replica=\"t\",gpu=\"1\"}") == 1.0);
    assert_true(sample(t, "pdserve:gpu_memory_used_bytes{replica=\"t\",gpu=\"0\"}") == 12345678901.0);
    assert_true(sample(t, "pdserve:gpu_memory_total_bytes{replica=\"t\",gpu=\"1\"}") == 150754820096.0);
    assert_true(sample(t, "pdserve:gpu_sm_clock_hertz{replica=\"t\",gpu=\"0\"}") == 1980e6);
    assert_true(sample(t, "pdserve:gpu_sm_clock_hertz{replica=\"t\",gpu=\"1\"}") == 345e6);
    assert_true(sample(t, "pdserve:gpu_power_watts{replica=\"t\",gpu=\"0\"}") == 312.5);
    assert_true(sample(t, "pdserve:gpu_power_watts{replica=\"t\",gpu=\"1\"}") == -1); /* NOT_SUPPORTED: left out */
    assert_true(sample(t, "pdserve:gpu_temperature_celsius{replica=\"t\",gpu=\"0\"}") == 55);
    assert_true(sample(t, "pdserve:gpu_temperature_celsius{replica=\"t\",gpu=\"1\"}") == 31);
    assert_true(sample(t, "pdserve:gpu_info{replica=\"t\",gpu=\"1\",name=\"NVIDIA H200\","
                          "pci_bus_id=\"00000000:2a:00.0\"}") == 1);
    /* each family once, HELP and TYPE before its samples */
    const char *fam[] = {"gpu_info", "gpu_utilization_perc", "gpu_memory_used_bytes", "gpu_memory_total_bytes",
                         "gpu_sm_clock_hertz", "gpu_power_watts", "gpu_temperature_celsius"};
    for (size_t k = 0; k < sizeof fam / sizeof fam[0]; k++) {
        char type[96];
        snprintf(type, sizeof type, "# TYPE pdserve:%s gauge\n", fam[k]);
        const char *at = strstr(t, type);
        assert_non_null(at);
        assert_null(strstr(at + 1, type));
        char first[64];
        snprintf(first, sizeof first, "\npdserve:%s{", fam[k]);
        assert_true(strstr(t, first) > at);
    }
    /* a new reading on the next scrape, not a cached one */
    fake_reset(0);
    fake_set("00000000:18:00.0", "NVIDIA H200", 5, 1, 2, 3, 4000, 6, 0);
    fake_set("00000000:2A:00.0", "NVIDIA H200", 0, 0, 2, 3, 0, 6, 1);
    pd_strbuf b2 = {0};
    scrape(port, &b2);
    assert_true(sample(b2.data, "pdserve:gpu_power_watts{replica=\"t\",gpu=\"0\"}") == 4.0);
    assert_true(sample(b2.data, "pdserve:gpu_utilization_perc{replica=\"t\",gpu=\"0\"}") == 0.05);
    pd_metrics_server_stop(&s);
    pd_strbuf_free(&b);
    pd_strbuf_free(&b2);
    pd_nvml_close(&nv);
    assert_null(nv);
    assert_int_equal(fake_initialised(), 0); /* nvmlShutdown called */
}

static void test_absent(void **state) {
    pd_nvml *nv = NULL;
    pd_err err = {{0}};
    const char *bus[] = {"00000000:18:00.0"};
    /* no library */
    setenv("PD_NVML_LIB", "/nonexistent/libnvidia-ml.so.1", 1);
    assert_int_equal(pd_nvml_open(bus, 1, &nv, &err), PD_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "cannot load NVML"));
    assert_null(nv);
    setenv("PD_NVML_LIB", PD_FAKE_NVML, 1);
    /* nvmlInit fails (no driver) */
    fake_reset(1);
    assert_int_equal(pd_nvml_open(bus, 1, &nv, &err), PD_ERR_UNSUPPORTED);
    assert_string_equal(err.msg, "nvmlInit: Driver Not Loaded");
    /* a GPU NVML does not know */
    fake_reset(0);
    fake_set("00000000:18:00.0", "x", 0, 0, 0, 0, 0, 0, 0);
    const char *two[] = {"00000000:18:00.0", "00000000:99:00.0"};
    assert_int_equal(pd_nvml_open(two, 2, &nv, &err), PD_ERR_NOTFOUND);
    assert_non_null(strstr(err.msg, "'00000000:99:00.0' (gpu 1)"));
    assert_int_equal(fake_initialised(), 0); /* shut down again */
    assert_int_equal(pd_nvml_open(two, 0, &nv, &err), PD_ERR_INVALID);
    /* nothing rendered without NVML */
    pd_strbuf b = {0};
    pd_nvml_render(NULL, "replica=\"t\"", &b);
    assert_int_equal(b.len, 0);
    /* a CPU replica: no GPU, so no family, whatever NVML the host has */
    pd_replica_ops *o = NULL;
    pd_replica_ops_config oc = {.role = "decode", .replica_id = "d", .device = "cpu", .tp = 1};
    assert_int_equal(pd_replica_ops_init(&oc, &o, &err), PD_OK);
    pd_replica_ops_render(o, &b);
    assert_true(b.len == 0 || !strstr(b.data, "pdserve:gpu_"));
    pd_replica_ops_free(&o);
    pd_strbuf_free(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_values_in_metrics),
        cmocka_unit_test(test_absent),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}

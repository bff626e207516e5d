/* NUMA placement (common/numa.c): --numa values, the node sysfs gives a PCI
 * function (against a made-up sysfs tree), the auto rules, and a real
 * binding to node 0 of this machine checked against what the kernel then
 * reports (sched_getaffinity, get_mempolicy, the node's cpulist). */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <numa.h>
#include <numaif.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pd_numa.h"

static void test_parse(void **state) {
    pd_numa_mode m;
    int n;
    pd_err err = {{0}};
    assert_int_equal(pd_numa_parse("auto", &m, &n, &err), PD_OK);
    assert_int_equal(m, PD_NUMA_AUTO);
    assert_int_equal(pd_numa_parse("off", &m, &n, &err), PD_OK);
    assert_int_equal(m, PD_NUMA_OFF);
    assert_int_equal(pd_numa_parse("3", &m, &n, &err), PD_OK);
    assert_int_equal(m, PD_NUMA_NODE);
    assert_int_equal(n, 3);
    const char *bad[] = {"", "-1", "1x", "node0", "AUTO", "99999", " 1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(pd_numa_parse(bad[i], &m, &n, &err), PD_ERR_INVALID);
        assert_non_null(strstr(err.msg, "expected auto, off or a NUMA node number"));
    }
}

static void put(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void test_node_of_pci(void **state) {
    char root[] = "/tmp/pd_numa_sysfsXXXXXX";
    assert_non_null(mkdtemp(root));
    char p[512];
    snprintf(p, sizeof p, "%s/bus", root), mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/bus/pci", root), mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/bus/pci/devices", root), mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/bus/pci/devices/0000:3b:00.0", root), mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/bus/pci/devices/0000:3b:00.0/numa_node", root), put(p, "1\n");
    snprintf(p, sizeof p, "%s/bus/pci/devices/0000:18:00.0", root), mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/bus/pci/devices/0000:18:00.0/numa_node", root), put(p, "-1\n");
    int node = 7;
    pd_err err = {{0}};
    /* CUDA's form (upper case) and NVML's (8-digit domain) name the same function */
    assert_int_equal(pd_numa_node_of_pci(root, "0000:3B:00.0", &node, &err), PD_OK);
    assert_int_equal(node, 1);
    node = 7;
    assert_int_equal(pd_numa_node_of_pci(root, "00000000:3b:00.0", &node, &err), PD_OK);
    assert_int_equal(node, 1);
    assert_int_equal(pd_numa_node_of_pci(root, "0000:18:00.0", &node, &err), PD_OK);
    assert_int_equal(node, -1);
    assert_int_equal(pd_numa_node_of_pci(root, "0000:5e:00.0", &node, &err), PD_ERR_NOTFOUND);
    assert_non_null(strstr(err.msg, "/bus/pci/devices/0000:5e:00.0/numa_node"));
    assert_int_equal(pd_numa_node_of_pci(root, "GPU-0", &node, &err), PD_ERR_INVALID);
    assert_int_equal(pd_numa_node_of_pci(root, "0000:3b:00.0x", &node, &err), PD_ERR_INVALID);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    assert_int_equal(system(cmd), 0);
}

static void test_auto_rules(void **state) {
    pd_numa_placement pl;
    pd_err err = {{0}};
    assert_int_equal(pd_numa_place(PD_NUMA_AUTO, -1, NULL, 0, &pl, &err), PD_OK);
    assert_int_equal(pl.node, -1);
    assert_non_null(strstr(pl.why, "CPU backend"));
    int unknown[] = {0, -1};
    assert_int_equal(pd_numa_place(PD_NUMA_AUTO, -1, unknown, 2, &pl, &err), PD_OK);
    assert_int_equal(pl.node, -1);
    assert_non_null(strstr(pl.why, "no NUMA node for GPU 1"));
    int split[] = {0, 0, 1};
    assert_int_equal(pd_numa_place(PD_NUMA_AUTO, -1, split, 3, &pl, &err), PD_OK);
    assert_int_equal(pl.node, -1);
    assert_non_null(strstr(pl.why, "GPU 2 on node 1"));
    assert_int_equal(pd_numa_place(PD_NUMA_OFF, -1, split, 3, &pl, &err), PD_OK);
    assert_int_equal(pl.node, -1);
    assert_string_equal(pl.why, "--numa off");
}

/* The kernel's word on node 0's CPUs: /sys/devices/system/node/node0/cpulist
 * as a cpu_set_t, limited to the CPUs this process was allowed at start. */
static void node0_cpus(cpu_set_t *set) {
    CPU_ZERO(set);
    FILE *f = fopen("/sys/devices/system/node/node0/cpulist", "r");
    assert_non_null(f);
    char line[4096] = {0};
    assert_non_null(fgets(line, sizeof line, f));
    fclose(f);
    for (char *s = strtok(line, ",\n"); s; s = strtok(NULL, ",\n")) {
        int a, b;
        if (sscanf(s, "%d-%d", &a, &b) != 2)
            b = a = atoi(s);
        for (int c = a; c <= b; c++)
            CPU_SET(c, set);
    }
}

static void test_bind_node0(void **state) {
    if (numa_available() < 0) {
        skip(); /* a kernel without NUMA: NODE is refused, tested below */
    }
    cpu_set_t before, want, got;
    assert_int_equal(sched_getaffinity(0, sizeof before, &before), 0);
    node0_cpus(&want);
    CPU_AND(&want, &want, &before);
    pd_numa_placement pl;
    pd_err err = {{0}};
    assert_int_equal(pd_numa_place(PD_NUMA_NODE, 0, NULL, 0, &pl, &err), PD_OK);
    assert_int_equal(pl.node, 0);
    assert_string_equal(pl.why, "--numa 0");
    assert_true(pl.cpus[0] != 0);
    assert_int_equal(sched_getaffinity(0, sizeof got, &got), 0);
    assert_true(CPU_EQUAL(&got, &want));
    /* the report's CPU list is the same set */
    cpu_set_t listed;
    CPU_ZERO(&listed);
    char copy[256];
    snprintf(copy, sizeof copy, "%s", pl.cpus);
    for (char *s = strtok(copy, ","); s; s = strtok(NULL, ",")) {
        int a, b;
        if (sscanf(s, "%d-%d", &a, &b) != 2)
            b = a = atoi(s);
        for (int c = a; c <= b; c++)
            CPU_SET(c, &listed);
    }
    assert_true(CPU_EQUAL(&listed, &want));
    int mode = -1;
    unsigned long mask = 0;
    assert_int_equal(get_mempolicy(&mode, &mask, sizeof mask * 8, NULL, 0), 0);
    assert_int_equal(mode, MPOL_PREFERRED);
    assert_true(mask & 1ul);
    /* a node this machine does not have: a clear error, nothing changed */
    int bad = numa_max_node() + 1;
    assert_int_equal(pd_numa_place(PD_NUMA_NODE, bad, NULL, 0, &pl, &err), PD_ERR_INVALID);
    char want_msg[64];
    snprintf(want_msg, sizeof want_msg, "--numa %d: no such NUMA node here (nodes: 0", bad);
    assert_non_null(strstr(err.msg, want_msg));
    /* auto with GPUs on node 0 binds there too */
    int gpus[] = {0, 0};
    assert_int_equal(pd_numa_place(PD_NUMA_AUTO, -1, gpus, 2, &pl, &err), PD_OK);
    assert_int_equal(pl.node, 0);
    assert_non_null(strstr(pl.why, "auto: the node of the replica's 2 GPUs"));
    sched_setaffinity(0, sizeof before, &before);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse),
        cmocka_unit_test(test_node_of_pci),
        cmocka_unit_test(test_auto_rules),
        cmocka_unit_test(test_bind_node0),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

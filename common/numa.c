/* NUMA placement (pd_numa.h), with libnuma. */
#include "pd_numa.h"

#include <dirent.h>
#include <errno.h>
#include <numa.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

pd_status pd_numa_parse(const char *arg, pd_numa_mode *mode_p, int *node_p, pd_err *err) {
    if (arg && !strcmp(arg, "auto")) {
        *mode_p = PD_NUMA_AUTO;
        *node_p = -1;
        return PD_OK;
    }
    if (arg && !strcmp(arg, "off")) {
        *mode_p = PD_NUMA_OFF;
        *node_p = -1;
        return PD_OK;
    }
    char *end = NULL;
    errno = 0;
    long v = arg && *arg >= '0' && *arg <= '9' ? strtol(arg, &end, 10) : -1;
    if (v < 0 || errno || !end || *end || v > 4095)
        return pd_err_set(err, PD_ERR_INVALID, "--numa '%s': expected auto, off or a NUMA node number (0, 1, ...)",
                          arg ? arg : "");
    *mode_p = PD_NUMA_NODE;
    *node_p = (int)v;
    return PD_OK;
}

pd_status pd_numa_node_of_pci(const char *sysfs_root, const char *bus_id, int *node_p, pd_err *err) {
    unsigned dom, bus, dev, fn;
    char tail;
    /* hex digits, ':' and '.' only (sscanf's %x would take "0x" and signs) */
    if (!bus_id || strspn(bus_id, "0123456789abcdefABCDEF:.") != strlen(bus_id) ||
        sscanf(bus_id, "%x:%x:%x.%x%c", &dom, &bus, &dev, &fn, &tail) != 4 || dom > 0xffff || bus > 0xff ||
        dev > 0x1f || fn > 7)
        return pd_err_set(err, PD_ERR_INVALID, "'%s' is not a PCI bus id (domain:bus:device.function)",
                          bus_id ? bus_id : "");
    char path[512];
    snprintf(path, sizeof path, "%s/bus/pci/devices/%04x:%02x:%02x.%x/numa_node", sysfs_root ? sysfs_root : "/sys",
             dom, bus, dev, fn);
    FILE *f = fopen(path, "r");
    if (!f)
        return pd_err_set(err, PD_ERR_NOTFOUND, "%s: %s", path, strerror(errno));
    int node = -1;
    int ok = fscanf(f, "%d", &node);
    fclose(f);
    if (ok != 1)
        return pd_err_set(err, PD_ERR_NOTFOUND, "%s: no number in it", path);
    *node_p = node < 0 ? -1 : node;
    return PD_OK;
}

/* "0-3,8,10-11" from a CPU mask. */
static void cpus_format(const struct bitmask *m, char *out, size_t cap) {
    size_t len = 0;
    out[0] = 0;
    unsigned n = (unsigned)numa_num_possible_cpus();
    for (unsigned c = 0; c < n; c++) {
        if (!numa_bitmask_isbitset(m, c))
            continue;
        unsigned e = c;
        while (e + 1 < n && numa_bitmask_isbitset(m, e + 1))
            e++;
        int w = e > c ? snprintf(out + len, cap - len, "%s%u-%u", len ? "," : "", c, e)
                      : snprintf(out + len, cap - len, "%s%u", len ? "," : "", c);
        if (w < 0 || (size_t)w >= cap - len) { /* too long: say so rather than cut a number */
            snprintf(out + (cap > 4 ? cap - 4 : 0), cap > 4 ? 4 : cap, "...");
            return;
        }
        len += (size_t)w;
        c = e;
    }
}

/* The nodes this process may use, "0-1", for messages. */
static void nodes_format(char *out, size_t cap) {
    size_t len = 0;
    out[0] = 0;
    for (int n = 0; n <= numa_max_node() && len < cap; n++)
        if (numa_bitmask_isbitset(numa_all_nodes_ptr, (unsigned)n))
            len += (size_t)snprintf(out + len, cap - len, "%s%d", len ? ", " : "", n);
}

/* Every thread of this process onto mask. */
static pd_status affinity_all_threads(struct bitmask *mask, pd_err *err) {
    DIR *d = opendir("/proc/self/task");
    if (!d) /* no /proc: this thread at least (later threads inherit) */
        return numa_sched_setaffinity(0, mask) == 0
                   ? PD_OK
                   : pd_err_set(err, PD_ERR_IO, "sched_setaffinity: %s", strerror(errno));
    pd_status st = PD_OK;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9')
            continue;
        pid_t tid = (pid_t)atoi(e->d_name);
        if (numa_sched_setaffinity(tid, mask) != 0 && errno != ESRCH) { /* ESRCH: it just ended */
            st = pd_err_set(err, PD_ERR_IO, "sched_setaffinity(thread %d): %s", (int)tid, strerror(errno));
            break;
        }
    }
    closedir(d);
    return st;
}

pd_status pd_numa_place(pd_numa_mode mode, int node, const int *gpu_nodes, int n_gpus, pd_numa_placement *pl_p,
                        pd_err *err) {
    pd_numa_placement pl = {.node = -1};
    if (mode == PD_NUMA_OFF) {
        snprintf(pl.why, sizeof pl.why, "--numa off");
        *pl_p = pl;
        return PD_OK;
    }
    if (mode == PD_NUMA_AUTO) {
        if (n_gpus <= 0) {
            snprintf(pl.why, sizeof pl.why, "auto: no GPU to be near (CPU backend, or no CUDA device found)");
            *pl_p = pl;
            return PD_OK;
        }
        int first = gpu_nodes[0];
        for (int i = 0; i < n_gpus; i++) {
            if (gpu_nodes[i] < 0) {
                snprintf(pl.why, sizeof pl.why, "auto: the platform gives no NUMA node for GPU %d (not bound)", i);
                *pl_p = pl;
                return PD_OK;
            }
            if (gpu_nodes[i] != first) {
                snprintf(pl.why, sizeof pl.why, "auto: GPU 0 is on node %d, GPU %d on node %d (not bound)", first, i,
                         gpu_nodes[i]);
                *pl_p = pl;
                return PD_OK;
            }
        }
        if (numa_available() < 0) {
            snprintf(pl.why, sizeof pl.why, "auto: the GPUs are on node %d but this kernel has no NUMA support (not bound)",
                     first);
            *pl_p = pl;
            return PD_OK;
        }
        node = first;
    } else if (numa_available() < 0) {
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "--numa %d: this kernel has no NUMA support (use --numa off)", node);
    }
    char nodes[128];
    nodes_format(nodes, sizeof nodes);
    if (node < 0 || node > numa_max_node() || !numa_bitmask_isbitset(numa_all_nodes_ptr, (unsigned)node))
        return pd_err_set(err, PD_ERR_INVALID, "--numa %d: no such NUMA node here (nodes: %s)", node, nodes);
    struct bitmask *cpus = numa_allocate_cpumask();
    pd_status st = PD_OK;
    if (numa_node_to_cpus(node, cpus) != 0) {
        st = pd_err_set(err, PD_ERR_INVALID, "--numa %d: cannot list its CPUs: %s", node, strerror(errno));
        goto out_free_mask;
    }
    /* only the CPUs this process may use (a container's cpuset) */
    for (unsigned c = 0; c < cpus->size; c++)
        if (numa_bitmask_isbitset(cpus, c) && !numa_bitmask_isbitset(numa_all_cpus_ptr, c))
            numa_bitmask_clearbit(cpus, c);
    if (numa_bitmask_weight(cpus) == 0) {
        st = pd_err_set(err, PD_ERR_INVALID, "--numa %d: none of this node's CPUs is available to this process (nodes: %s)",
                        node, nodes);
        goto out_free_mask;
    }
    if ((st = affinity_all_threads(cpus, err)) != PD_OK)
        goto out_free_mask;
    numa_set_preferred(node);
    pl.node = node;
    cpus_format(cpus, pl.cpus, sizeof pl.cpus);
    if (mode == PD_NUMA_NODE)
        snprintf(pl.why, sizeof pl.why, "--numa %d", node);
    else
        snprintf(pl.why, sizeof pl.why, "auto: the node of the replica's %d GPU%s", n_gpus, n_gpus > 1 ? "s" : "");
    *pl_p = pl;
out_free_mask:
    numa_bitmask_free(cpus);
    return st;
}

/* NUMA placement of a replica (--numa auto|off|NODE): the process' threads
 * run on one node's CPUs and its host memory (pinned staging, the KV host
 * pool, UCX bounce buffers) is preferably allocated on that node, the one
 * its GPUs hang off. With libnuma (Debian libnuma-dev).
 *
 * auto: the node sysfs gives for the GPUs' PCI functions
 * (/sys/bus/pci/devices/<bus id>/numa_node; bus ids from
 * cudaDeviceGetPCIBusId); not bound when there is no GPU (a CPU replica:
 * the scheduler's choice is as good), when the platform gives no node (-1,
 * most single-socket machines), or when the GPUs are on different nodes.
 * NODE: that node, or an error if it does not exist here. off: nothing. */
#ifndef PD_NUMA_H
#define PD_NUMA_H

#include "pd_common.h"

typedef enum { PD_NUMA_OFF = 0, PD_NUMA_AUTO, PD_NUMA_NODE } pd_numa_mode;

/** Parses a --numa value: "auto", "off", or a node number (decimal, >= 0).
 * Errors: PD_ERR_INVALID (err quotes the value and the accepted forms). */
pd_status pd_numa_parse(const char *arg, pd_numa_mode *mode_p, int *node_p, pd_err *err);

/** The NUMA node of the PCI function bus_id ("0000:18:00.0" or NVML's
 * "00000000:18:00.0", any case), read from
 * <sysfs_root>/bus/pci/devices/<dddd:bb:dd.f>/numa_node (sysfs_root NULL:
 * "/sys"); -1 when the platform gives none. Errors: PD_ERR_INVALID (not a
 * bus id), PD_ERR_NOTFOUND (no such device or file; err names the path). */
pd_status pd_numa_node_of_pci(const char *sysfs_root, const char *bus_id, int *node_p, pd_err *err);

/** Where a replica was placed, and why. */
typedef struct {
    int node;       /* the node bound to; -1: not bound */
    char cpus[256]; /* the CPUs the process now runs on, "0-27,56-83"; "" when not bound */
    char why[256];  /* one line: "--numa 0", "auto: node 1 of the GPUs", "auto: no GPU to be near (...)", ... */
} pd_numa_placement;

/** Places the calling process. mode/node from pd_numa_parse; gpu_nodes[i]
 * the node of the replica's GPU i (pd_numa_node_of_pci; -1 unknown), n_gpus
 * 0 for a CPU replica. Binding sets the CPU affinity of every thread the
 * process has now (threads made later inherit it) to the node's CPUs
 * (those this process may use) and the memory policy of the calling thread
 * (inherited likewise) to "preferred" that node — preferred, not bind, so
 * that a full node spills rather than failing an allocation. Call before
 * the backend starts its threads and allocates host buffers. *pl_p is set
 * on success (also when nothing is bound). Errors: PD_ERR_INVALID (NODE
 * does not exist or has none of this process' CPUs; err lists the nodes),
 * PD_ERR_UNSUPPORTED (NODE on a kernel without NUMA support),
 * PD_ERR_IO (sched_setaffinity failed). */
pd_status pd_numa_place(pd_numa_mode mode, int node, const int *gpu_nodes, int n_gpus, pd_numa_placement *pl_p,
                        pd_err *err);

#endif

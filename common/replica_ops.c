/* A replica's operations around its start (pd_replica_ops.h). */
#include "pd_replica_ops.h"

#include <string.h>

#include "pd_kernels.h"
#include "pd_nvml.h"

struct pd_replica_ops {
    char module[16];
    const char *replica_id;
    char labels[256]; /* replica="..",role=".." */
    int n_gpus;
    pd_cuda_device_info gpu[PD_TP_MAX_RANKS];
    pd_nvml *nvml; /* NULL: no telemetry */
};

pd_status pd_replica_ops_init(const pd_replica_ops_config *cfg, pd_replica_ops **o_p, pd_err *err) {
    pd_replica_ops *o = pd_xcalloc(1, sizeof *o);
    snprintf(o->module, sizeof o->module, "%s", cfg->role);
    o->replica_id = cfg->replica_id;
    snprintf(o->labels, sizeof o->labels, "replica=\"%s\",role=\"%s\"", cfg->replica_id, cfg->role);
    const char *id = cfg->replica_id;
    pd_err e = {{0}};
    /* a tp outside 1 .. PD_TP_MAX_RANKS: the backend's start refuses it */
    if (cfg->device && !strcmp(cfg->device, "cuda") && cfg->tp >= 1 && cfg->tp <= PD_TP_MAX_RANKS) {
        for (int r = 0; r < cfg->tp; r++) {
            if (pd_backend_cuda_device_info(r, false, &o->gpu[r], &e) != PD_OK) {
                /* the backend's own start says so and fails: nothing to watch */
                PD_LOGW(o->module, "%s: GPU %d: %s", id, r, e.msg);
                o->n_gpus = 0;
                break;
            }
            o->n_gpus = r + 1;
        }
    }
    if (o->n_gpus == 0) {
        PD_LOGI(o->module, "%s: GPU telemetry off: %s", id,
                cfg->device && !strcmp(cfg->device, "cuda") ? "no CUDA device found" : "CPU backend, no GPU");
    } else {
        const char *bus[PD_TP_MAX_RANKS];
        for (int r = 0; r < o->n_gpus; r++)
            bus[r] = o->gpu[r].pci_bus_id;
        if (pd_nvml_open(bus, o->n_gpus, &o->nvml, &e) != PD_OK)
            PD_LOGW(o->module, "%s: GPU telemetry off (no pdserve:gpu_* metrics): %s", id, e.msg);
        else
            PD_LOGI(o->module, "%s: GPU telemetry: NVML, driver %s, %d GPUs (%s at %s%s)", id,
                    pd_nvml_driver_version(o->nvml), o->n_gpus, pd_nvml_name(o->nvml, 0), bus[0],
                    o->n_gpus > 1 ? ", ..." : "");
    }
    *o_p = o;
    return PD_OK;
}

void pd_replica_ops_render(pd_replica_ops *o, pd_strbuf *b) {
    if (!o)
        return;
    pd_nvml_render(o->nvml, o->labels, b);
}

static void on_scrape(void *user, pd_strbuf *b) { pd_replica_ops_render(user, b); }

void pd_replica_ops_attach(pd_replica_ops *o, pd_metrics_server *s) {
    if (o && s)
        pd_metrics_server_set_scrape(s, on_scrape, o);
}

void pd_replica_ops_free(pd_replica_ops **o_p) {
    if (!o_p || !*o_p)
        return;
    pd_nvml_close(&(*o_p)->nvml);
    free(*o_p);
    *o_p = NULL;
}

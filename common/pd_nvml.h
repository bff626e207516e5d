/* GPU telemetry through NVML (libnvidia-ml.so.1), loaded with dlopen at run
 * time so that builds without CUDA and hosts without a driver run the same
 * binary: where NVML cannot be had, pd_nvml_open says why and the replica's
 * /metrics simply has no pdserve:gpu_* families.
 *
 * The GPUs are named by PCI bus id (what cudaDeviceGetPCIBusId writes for
 * the replica's CUDA devices), because NVML numbers every GPU of the host
 * and ignores CUDA_VISIBLE_DEVICES; gpu i of the replica is bus_ids[i].
 *
 * Readings are taken when pd_nvml_render runs (the /metrics scrape, on the
 * metrics server's thread): no NVML call is ever made on a service loop.
 * NVML is thread-safe. Units as the NVML API reference gives them and as
 * they are exported (Prometheus base units, DCGM exporter's meanings):
 *   utilisation  nvmlDeviceGetUtilizationRates .gpu, percent of the last
 *                sample period a kernel ran   -> fraction 0..1 (vLLM's _perc)
 *   memory       nvmlDeviceGetMemoryInfo used/total, bytes
 *   SM clock     nvmlDeviceGetClockInfo(NVML_CLOCK_SM), MHz -> Hz
 *   power        nvmlDeviceGetPowerUsage, milliwatts -> W
 *   temperature  nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU), °C */
#ifndef PD_NVML_H
#define PD_NVML_H

#include <stdbool.h>

#include "pd_common.h"
#include "pd_metrics.h"

typedef struct pd_nvml pd_nvml;

/* The most GPUs one replica watches (PD_TP_MAX_RANKS). */
#define PD_NVML_MAX_GPUS 8

/** One reading of one GPU. A field NVML refused (NOT_SUPPORTED on this
 * GPU, or any error) has its has_ flag false and is not exported. */
typedef struct {
    bool has_util, has_mem, has_clock, has_power, has_temp;
    double util_frac;                       /* 0..1 */
    unsigned long long mem_used, mem_total; /* bytes */
    double sm_clock_hz;
    double power_w;
    double temp_c;
} pd_gpu_sample;

/** Loads NVML ($PD_NVML_LIB when set, else libnvidia-ml.so.1), initialises
 * it (nvmlInit_v2) and looks up each of the n_gpus PCI bus ids
 * ("0000:18:00.0"; NVML accepts upper or lower case hex). On success
 * *nv_p owns the library reference; free it with pd_nvml_close.
 * Errors: PD_ERR_INVALID (n_gpus outside 1 .. PD_NVML_MAX_GPUS),
 * PD_ERR_UNSUPPORTED (no library, a function missing, nvmlInit failed —
 * err says which, with NVML's own message), PD_ERR_NOTFOUND (NVML does not
 * know a bus id). */
pd_status pd_nvml_open(const char *const *bus_ids, int n_gpus, pd_nvml **nv_p, pd_err *err);

/** The number of GPUs watched. */
int pd_nvml_count(const pd_nvml *nv);

/** The NVML product name of gpu i ("NVIDIA H200"), "" when NVML gave none. */
const char *pd_nvml_name(const pd_nvml *nv, int i);

/** The driver version NVML reports ("570.124.06"), "" when it gave none. */
const char *pd_nvml_driver_version(const pd_nvml *nv);

/** Reads gpu i now (0 <= i < count). Never fails: see pd_gpu_sample. */
void pd_nvml_read(pd_nvml *nv, int i, pd_gpu_sample *s);

/** Appends the pdserve:gpu_* families (HELP, TYPE, one sample per GPU and
 * reading) to b. labels (without braces, e.g. `replica="decode-1"`) start
 * every sample's label set; gpu="i" (the replica's CUDA device index),
 * and on pdserve:gpu_info also name and pci_bus_id, follow. */
void pd_nvml_render(pd_nvml *nv, const char *labels, pd_strbuf *b);

/** nvmlShutdown, drops the library reference, frees; *nv_p = NULL. */
void pd_nvml_close(pd_nvml **nv_p);

#endif

/* GPU telemetry through NVML, loaded at run time (pd_nvml.h).
 *
 * The declarations below are the few parts of NVML's C ABI that are used,
 * as the NVML API reference and nvml.h state them (no NVML header is needed
 * to build): nvmlDevice_t an opaque pointer; nvmlReturn_t NVML_SUCCESS 0;
 * nvmlClockType_t NVML_CLOCK_SM 1; nvmlTemperatureSensors_t
 * NVML_TEMPERATURE_GPU 0; nvmlUtilization_t {gpu, memory} (unsigned int);
 * nvmlMemory_t {total, free, used} (unsigned long long, bytes). */
#include "pd_nvml.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef int nvmlReturn_t;
enum { NVML_SUCCESS = 0, NVML_CLOCK_SM = 1, NVML_TEMPERATURE_GPU = 0 };
typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

struct pd_nvml {
    void *lib;
    nvmlReturn_t (*shutdown)(void);
    const char *(*error_string)(nvmlReturn_t r);
    nvmlReturn_t (*get_utilization)(nvmlDevice_t d, nvmlUtilization_t *u);
    nvmlReturn_t (*get_memory)(nvmlDevice_t d, nvmlMemory_t *m);
    nvmlReturn_t (*get_clock)(nvmlDevice_t d, int type, unsigned int *mhz);
    nvmlReturn_t (*get_power)(nvmlDevice_t d, unsigned int *mw);
    nvmlReturn_t (*get_temperature)(nvmlDevice_t d, int sensor, unsigned int *c);
    int n;
    nvmlDevice_t dev[PD_NVML_MAX_GPUS];
    char bus_id[PD_NVML_MAX_GPUS][32];
    char name[PD_NVML_MAX_GPUS][96];
    char driver[80];
};

static void *sym(void *lib, const char *name, const char **missing) {
    void *p = dlsym(lib, name);
    if (!p && !*missing)
        *missing = name;
    return p;
}

pd_status pd_nvml_open(const char *const *bus_ids, int n_gpus, pd_nvml **nv_p, pd_err *err) {
    if (n_gpus < 1 || n_gpus > PD_NVML_MAX_GPUS)
        return pd_err_set(err, PD_ERR_INVALID, "NVML: %d GPUs: expected 1 to %d", n_gpus, PD_NVML_MAX_GPUS);
    const char *path = getenv("PD_NVML_LIB");
    if (!path || !*path)
        path = "libnvidia-ml.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cannot load NVML (%s)", dlerror());
    pd_nvml *nv = pd_xcalloc(1, sizeof *nv);
    nv->lib = lib;
    const char *missing = NULL;
    nvmlReturn_t (*init)(void) = (nvmlReturn_t(*)(void))sym(lib, "nvmlInit_v2", &missing);
    nvmlReturn_t (*by_bus)(const char *, nvmlDevice_t *) =
        (nvmlReturn_t(*)(const char *, nvmlDevice_t *))sym(lib, "nvmlDeviceGetHandleByPciBusId_v2", &missing);
    *(void **)&nv->shutdown = sym(lib, "nvmlShutdown", &missing);
    *(void **)&nv->error_string = sym(lib, "nvmlErrorString", &missing);
    *(void **)&nv->get_utilization = sym(lib, "nvmlDeviceGetUtilizationRates", &missing);
    *(void **)&nv->get_memory = sym(lib, "nvmlDeviceGetMemoryInfo", &missing);
    *(void **)&nv->get_clock = sym(lib, "nvmlDeviceGetClockInfo", &missing);
    *(void **)&nv->get_power = sym(lib, "nvmlDeviceGetPowerUsage", &missing);
    *(void **)&nv->get_temperature = sym(lib, "nvmlDeviceGetTemperature", &missing);
    /* optional: only for the start-up log and gpu_info */
    nvmlReturn_t (*get_name)(nvmlDevice_t, char *, unsigned int) =
        (nvmlReturn_t(*)(nvmlDevice_t, char *, unsigned int))dlsym(lib, "nvmlDeviceGetName");
    nvmlReturn_t (*get_driver)(char *, unsigned int) =
        (nvmlReturn_t(*)(char *, unsigned int))dlsym(lib, "nvmlSystemGetDriverVersion");
    pd_status st;
    if (missing) {
        st = pd_err_set(err, PD_ERR_UNSUPPORTED, "%s lacks %s", path, missing);
        goto err_close_lib;
    }
    nvmlReturn_t r = init();
    if (r != NVML_SUCCESS) {
        st = pd_err_set(err, PD_ERR_UNSUPPORTED, "nvmlInit: %s", nv->error_string(r));
        goto err_close_lib;
    }
    for (int i = 0; i < n_gpus; i++) {
        snprintf(nv->bus_id[i], sizeof nv->bus_id[i], "%s", bus_ids[i] ? bus_ids[i] : "");
        if ((r = by_bus(nv->bus_id[i], &nv->dev[i])) != NVML_SUCCESS) {
            st = pd_err_set(err, PD_ERR_NOTFOUND, "NVML has no GPU at PCI bus id '%s' (gpu %d): %s", nv->bus_id[i],
                            i, nv->error_string(r));
            goto err_shutdown;
        }
        if (!get_name || get_name(nv->dev[i], nv->name[i], sizeof nv->name[i]) != NVML_SUCCESS)
            nv->name[i][0] = 0;
        nv->name[i][sizeof nv->name[i] - 1] = 0;
    }
    if (!get_driver || get_driver(nv->driver, sizeof nv->driver) != NVML_SUCCESS)
        nv->driver[0] = 0;
    nv->driver[sizeof nv->driver - 1] = 0;
    nv->n = n_gpus;
    *nv_p = nv;
    return PD_OK;

err_shutdown:
    nv->shutdown();
err_close_lib:
    dlclose(lib);
    free(nv);
    return st;
}

int pd_nvml_count(const pd_nvml *nv) { return nv ? nv->n : 0; }

const char *pd_nvml_name(const pd_nvml *nv, int i) { return nv && i >= 0 && i < nv->n ? nv->name[i] : ""; }

const char *pd_nvml_driver_version(const pd_nvml *nv) { return nv ? nv->driver : ""; }

void pd_nvml_read(pd_nvml *nv, int i, pd_gpu_sample *s) {
    memset(s, 0, sizeof *s);
    if (!nv || i < 0 || i >= nv->n)
        return;
    nvmlDevice_t d = nv->dev[i];
    nvmlUtilization_t u;
    nvmlMemory_t m;
    unsigned int v;
    if ((s->has_util = nv->get_utilization(d, &u) == NVML_SUCCESS))
        s->util_frac = u.gpu / 100.0;
    if ((s->has_mem = nv->get_memory(d, &m) == NVML_SUCCESS)) {
        s->mem_used = m.used;
        s->mem_total = m.total;
    }
    if ((s->has_clock = nv->get_clock(d, NVML_CLOCK_SM, &v) == NVML_SUCCESS))
        s->sm_clock_hz = v * 1e6;
    if ((s->has_power = nv->get_power(d, &v) == NVML_SUCCESS))
        s->power_w = v / 1000.0;
    if ((s->has_temp = nv->get_temperature(d, NVML_TEMPERATURE_GPU, &v) == NVML_SUCCESS))
        s->temp_c = v;
}

/* A label value: NVML's names are plain ASCII, but a quote, backslash or
 * newline must not break the exposition format (escaped as it specifies). */
static void put_label_value(pd_strbuf *b, const char *v) {
    for (; *v; v++) {
        if (*v == '"' || *v == '\\')
            pd_strbuf_printf(b, "\\%c", *v);
        else if (*v == '\n')
            pd_strbuf_printf(b, "\\n");
        else
            pd_strbuf_printf(b, "%c", *v);
    }
}

void pd_nvml_render(pd_nvml *nv, const char *labels, pd_strbuf *b) {
    if (!nv || nv->n == 0)
        return;
    pd_gpu_sample s[PD_NVML_MAX_GPUS];
    for (int i = 0; i < nv->n; i++)
        pd_nvml_read(nv, i, &s[i]);
    const char *sep = labels && *labels ? "," : "";
    if (!labels)
        labels = "";
    pd_strbuf_printf(b, "# HELP pdserve:gpu_info The replica's GPUs as NVML names them (value 1).\n"
                        "# TYPE pdserve:gpu_info gauge\n");
    for (int i = 0; i < nv->n; i++) {
        pd_strbuf_printf(b, "pdserve:gpu_info{%s%sgpu=\"%d\",name=\"", labels, sep, i);
        put_label_value(b, nv->name[i]);
        pd_strbuf_printf(b, "\",pci_bus_id=\"");
        put_label_value(b, nv->bus_id[i]);
        pd_strbuf_printf(b, "\"} 1\n");
    }
#define FAMILY(metric, help, has, fmt, expr)                                                                       \
    do {                                                                                                           \
        pd_strbuf_printf(b, "# HELP " metric " " help "\n# TYPE " metric " gauge\n");                               \
        for (int i = 0; i < nv->n; i++)                                                                            \
            if (s[i].has)                                                                                          \
                pd_strbuf_printf(b, metric "{%s%sgpu=\"%d\"} " fmt "\n", labels, sep, i, expr);                      \
    } while (0)
    FAMILY("pdserve:gpu_utilization_perc", "Fraction of the last sample period a kernel ran (NVML; 1 = 100%%).",
           has_util, "%.2f", s[i].util_frac);
    FAMILY("pdserve:gpu_memory_used_bytes", "Device memory in use (NVML), bytes.", has_mem, "%llu", s[i].mem_used);
    FAMILY("pdserve:gpu_memory_total_bytes", "Device memory (NVML), bytes.", has_mem, "%llu", s[i].mem_total);
    FAMILY("pdserve:gpu_sm_clock_hertz", "Current SM clock (NVML), Hz.", has_clock, "%.0f", s[i].sm_clock_hz);
    FAMILY("pdserve:gpu_power_watts", "Power draw of the board (NVML), W.", has_power, "%.3f", s[i].power_w);
    FAMILY("pdserve:gpu_temperature_celsius", "GPU die temperature (NVML), degrees C.", has_temp, "%.0f",
           s[i].temp_c);
#undef FAMILY
}

void pd_nvml_close(pd_nvml **nv_p) {
    if (!nv_p || !*nv_p)
        return;
    pd_nvml *nv = *nv_p;
    nv->shutdown();
    dlclose(nv->lib);
    free(nv);
    *nv_p = NULL;
}

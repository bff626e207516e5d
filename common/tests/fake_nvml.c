/* A stand-in for libnvidia-ml.so.1 that test_nvml loads through
 * $PD_NVML_LIB: it exports the NVML functions common/nvml.c calls, with the
 * signatures of the NVML API reference, answering from a table the test
 * fills with fake_nvml_set (the test dlopens this same file, so both see
 * one table). Built by CMakeLists.txt as a shared library. */
#include <stdio.h>
#include <string.h>
#include <strings.h>

typedef struct fake_dev {
    char bus_id[32], name[64];
    unsigned util, clock_mhz, power_mw, temp_c;
    unsigned long long used, total;
    int power_unsupported;
} fake_dev;

static fake_dev devs[8];
static int n_devs, init_fails, initialised;

/* Test controls. */
void fake_nvml_reset(int fail_init) {
    memset(devs, 0, sizeof devs);
    n_devs = 0;
    init_fails = fail_init;
}
void fake_nvml_set(const char *bus_id, const char *name, unsigned util, unsigned long long used,
                   unsigned long long total, unsigned clock_mhz, unsigned power_mw, unsigned temp_c,
                   int power_unsupported) {
    fake_dev *d = &devs[n_devs++];
    snprintf(d->bus_id, sizeof d->bus_id, "%s", bus_id);
    snprintf(d->name, sizeof d->name, "%s", name);
    d->util = util, d->used = used, d->total = total, d->clock_mhz = clock_mhz, d->power_mw = power_mw;
    d->temp_c = temp_c, d->power_unsupported = power_unsupported;
}
int fake_nvml_initialised(void) { return initialised; }

/* NVML's C ABI, the parts used. nvmlReturn_t: 0 success, 3 not
 * supported, 6 not found, 9 driver not loaded. */
typedef fake_dev *nvmlDevice_t;
typedef struct {
    unsigned gpu, memory;
} nvmlUtilization_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

int nvmlInit_v2(void) {
    if (init_fails)
        return 9;
    initialised++;
    return 0;
}
int nvmlShutdown(void) {
    initialised--;
    return 0;
}
const char *nvmlErrorString(int r) {
    return r == 9 ? "Driver Not Loaded" : r == 6 ? "Not Found" : r == 3 ? "Not Supported" : "Unknown Error";
}
int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, nvmlDevice_t *d) {
    for (int i = 0; i < n_devs; i++)
        if (!strcasecmp(devs[i].bus_id, bus)) {
            *d = &devs[i];
            return 0;
        }
    return 6;
}
int nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned len) {
    snprintf(name, len, "%s", d->name);
    return 0;
}
int nvmlSystemGetDriverVersion(char *v, unsigned len) {
    snprintf(v, len, "999.1.2");
    return 0;
}
int nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    u->gpu = d->util;
    u->memory = 0;
    return 0;
}
int nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    m->total = d->total;
    m->used = d->used;
    m->free = d->total - d->used;
    return 0;
}
int nvmlDeviceGetClockInfo(nvmlDevice_t d, int type, unsigned *mhz) {
    if (type != 1) /* NVML_CLOCK_SM */
        return 3;
    *mhz = d->clock_mhz;
    return 0;
}
int nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned *mw) {
    if (d->power_unsupported)
        return 3;
    *mw = d->power_mw;
    return 0;
}
int nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned *c) {
    if (sensor != 0) /* NVML_TEMPERATURE_GPU */
        return 3;
    *c = d->temp_c;
    return 0;
}

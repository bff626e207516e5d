/* common/ — small shared pieces every pdserve module links: status codes,
 * logging, clocks and a few checked-allocation helpers.
 *
 * Conventions (see shared/STYLE.md): functions return pd_status (0 success,
 * negative errors); output arguments come last with a _p suffix and are set
 * only on success; the function that detects an error logs/describes it.
 */
#ifndef PD_COMMON_H
#define PD_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef enum {
    PD_OK = 0,
    PD_ERR_INVALID = -1,     /* bad argument or input value */
    PD_ERR_NOMEM = -2,       /* allocation failed */
    PD_ERR_IO = -3,          /* open/read/write/mmap failed */
    PD_ERR_FORMAT = -4,      /* malformed file contents (header, JSON, offsets) */
    PD_ERR_NOTFOUND = -5,    /* missing tensor, field or file */
    PD_ERR_UNSUPPORTED = -6, /* valid but not supported (model_type, dtype) */
    PD_ERR_SHAPE = -7,       /* tensor shape does not match the config */
    PD_ERR_LIMIT = -8,       /* a configured limit was exceeded */
} pd_status;

/** Returns a static, human-readable name for a status code. Never NULL. */
const char *pd_status_str(pd_status st);

/* An error message buffer that travels with a failing call so that the
 * caller can print exactly what went wrong (file, tensor, field). */
typedef struct {
    char msg[512];
} pd_err;

/** Formats msg into err (if err is non-NULL) and returns st, so that error
 * paths read `return pd_err_set(err, PD_ERR_FORMAT, "%s: ...", path);`. */
pd_status pd_err_set(pd_err *err, pd_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

typedef enum { PD_LOG_DEBUG = 0, PD_LOG_INFO, PD_LOG_WARN, PD_LOG_ERROR } pd_log_level;

/** Sets the minimum level printed (default INFO; env PDSERVE_LOG_LEVEL=debug|info|warn|error). */
void pd_log_set_level(pd_log_level lvl);

/** Writes one log line to stderr: ISO time, level, module, message. Thread-safe. */
void pd_log(pd_log_level lvl, const char *module, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define PD_LOGD(mod, ...) pd_log(PD_LOG_DEBUG, mod, __VA_ARGS__)
#define PD_LOGI(mod, ...) pd_log(PD_LOG_INFO, mod, __VA_ARGS__)
#define PD_LOGW(mod, ...) pd_log(PD_LOG_WARN, mod, __VA_ARGS__)
#define PD_LOGE(mod, ...) pd_log(PD_LOG_ERROR, mod, __VA_ARGS__)

/* Invariants only — never for input from a file or the network. */
#define PD_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: assertion failed: %s\n", __FILE__, __LINE__, #cond);          \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/** Monotonic clock in seconds. */
double pd_now_s(void);

/** malloc/calloc that abort on failure: for small bookkeeping allocations
 * whose failure cannot be handled usefully. Large buffers use malloc and
 * return PD_ERR_NOMEM. */
void *pd_xmalloc(size_t n);
void *pd_xcalloc(size_t count, size_t size);
char *pd_xstrdup(const char *s);

/** Reads a whole file into a NUL-terminated heap buffer (caller frees).
 * Errors: PD_ERR_IO (open/read failed; err names the path). */
pd_status pd_file_read_all(const char *path, char **data_p, size_t *len_p, pd_err *err);

/* bf16 / fp16 <-> fp32 conversion (IEEE; bf16 rounds to nearest even). */
float pd_bf16_to_f32(uint16_t h);
uint16_t pd_f32_to_bf16(float f);
float pd_f16_to_f32(uint16_t h);
uint16_t pd_f32_to_f16(float f);
/* FP8 E4M3 (OCP "fn" variant: no infinities, 0x7f/0xff are NaN, max 448). */
float pd_e4m3_to_f32(uint8_t v);
uint8_t pd_f32_to_e4m3(float f);
/** pd_e4m3_to_f32 of every code 0..255, in a table built once (thread-safe)
 * and never freed: the loader's FP8 dequantisation reads it instead of
 * calling pd_e4m3_to_f32 per value (ldexpf: ~15 ns a value, 4 minutes for
 * v3-layers' 15 G values on the H200 host; session 21). */
const float *pd_e4m3_table(void);

/* Deterministic random numbers (splitmix64 seeding xoshiro256**), used for
 * weight initialisation and per-request sampling generators. */
typedef struct {
    uint64_t s[4];
} pd_rng;
void pd_rng_seed(pd_rng *r, uint64_t seed);
uint64_t pd_rng_next(pd_rng *r);
/** Uniform in [0, 1) with 53-bit resolution. */
double pd_rng_uniform(pd_rng *r);
/** Standard normal (Box-Muller). */
double pd_rng_normal(pd_rng *r);

#include <stdlib.h>

#endif

/* Helpers the GPU benchmarks share (tests/gpu/bench_*.c): a CUDA call that
 * must succeed, the host clock, a median's comparator, "1,8,32" lists and
 * the benchmarks' fixed xorshift generator. Header only: each benchmark is
 * one translation unit. */
#ifndef PD_BENCH_UTIL_H
#define PD_BENCH_UTIL_H

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Exits with file:line, the call and CUDA's message when x fails. */
#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* Today's date (UTC) as YYYY-MM-DD into date[32], and GPU 0's properties:
 * what every benchmark's header line names. */
static inline void bench_date_and_gpu(char date[32], struct cudaDeviceProp *prop) {
    time_t tnow = time(NULL);
    strftime(date, 32, "%Y-%m-%d", gmtime(&tnow));
    CK(cudaGetDeviceProperties(prop, 0));
}

/* CLOCK_MONOTONIC, seconds. */
static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* qsort comparator of doubles, ascending. */
static inline int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* "1,8,32" into out (at most max values); returns how many. */
static inline int parse_list(const char *s, int *out, int max) {
    int n = 0;
    while (*s && n < max) {
        out[n++] = atoi(s);
        const char *c = strchr(s, ',');
        if (!c)
            break;
        s = c + 1;
    }
    return n;
}

/* xorshift64 over *state (nonzero): the benchmarks' reproducible inputs. */
static inline uint64_t bench_rnd(uint64_t *state) {
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *state = x;
}

#endif

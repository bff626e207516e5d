/* Helpers shared by the libFuzzer harnesses in tests/fuzz/ (header only, so
 * each harness stays one .c file). */
#ifndef PD_FUZZ_UTIL_H
#define PD_FUZZ_UTIL_H

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <netinet/in.h>
#include <sys/socket.h>

#include "pd_common.h"
#include "pd_tokenizer.h"

/* Fails the run with a message: libFuzzer reports the input (abort). */
#define FZ_CHECK(cond, ...)                                                                        \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "fuzz check failed at %s:%d: %s: ", __FILE__, __LINE__, #cond);       \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* The DeepSeek-V3 tokenizer.json: $PD_CACHE_DIR, else the cache the build
 * was configured with. Loaded once; exits when missing (a harness without
 * its tokenizer would fuzz nothing). */
static inline const pd_tokenizer *fz_tokenizer(void) {
    static pd_tokenizer *tok;
    if (tok)
        return tok;
    char path[4096];
    const char *cache = getenv("PD_CACHE_DIR");
    snprintf(path, sizeof path, "%s/tokenizer-deepseek_v3/tokenizer.json",
             cache && *cache ? cache : PD_FUZZ_CACHE_DIR);
    pd_err err = {{0}};
    if (pd_tok_load(path, &tok, &err) != PD_OK) {
        fprintf(stderr, "fuzz: cannot load the tokenizer %s: %s\n", path, err.msg);
        exit(1);
    }
    return tok;
}

/* A growing byte string, NUL-terminated after len; zero-initialise, free(p).
 * Out of memory aborts (libFuzzer reports the input). */
typedef struct {
    char *p;
    size_t len, cap;
} fz_buf;

/* Appends n bytes of s to b. */
static inline void fz_buf_add(fz_buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        b->cap = (b->len + n + 1) * 2;
        b->p = realloc(b->p, b->cap);
        FZ_CHECK(b->p, "out of memory");
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

/* Harnesses run quietly unless PDSERVE_LOG_LEVEL asks otherwise. */
static inline void fz_quiet_logs(void) {
    if (!getenv("PDSERVE_LOG_LEVEL"))
        pd_log_set_level((pd_log_level)(PD_LOG_ERROR + 1));
}


/* A blocking TCP connect to 127.0.0.1:port that survives a signal:
 * libFuzzer's timers (SIGALRM) can interrupt connect(), which then
 * completes in the background (EINTR): wait until the socket is writable
 * and read its result. Returns 0, or -1 with errno set. */
static inline int fz_connect_loopback(int fd, int port) {
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0)
        return 0;
    if (errno != EINTR && errno != EINPROGRESS)
        return -1;
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int r;
    while ((r = poll(&p, 1, 5000)) < 0 && errno == EINTR) {
    }
    if (r <= 0) {
        errno = r == 0 ? ETIMEDOUT : errno;
        return -1;
    }
    int e = 0;
    socklen_t len = sizeof e;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0)
        return -1;
    errno = e;
    return e ? -1 : 0;
}

#endif

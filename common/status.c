#include "pd_common.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

const char *pd_status_str(pd_status st) {
    switch (st) {
    case PD_OK: return "ok";
    case PD_ERR_INVALID: return "invalid argument";
    case PD_ERR_NOMEM: return "out of memory";
    case PD_ERR_IO: return "I/O error";
    case PD_ERR_FORMAT: return "malformed input";
    case PD_ERR_NOTFOUND: return "not found";
    case PD_ERR_UNSUPPORTED: return "unsupported";
    case PD_ERR_SHAPE: return "shape mismatch";
    case PD_ERR_LIMIT: return "limit exceeded";
    }
    return "unknown status";
}

pd_status pd_err_set(pd_err *err, pd_status st, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return st;
}

void *pd_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "pdserve: out of memory (%zu bytes)\n", n);
        abort();
    }
    return p;
}

void *pd_xcalloc(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "pdserve: out of memory (%zu x %zu bytes)\n", count, size);
        abort();
    }
    return p;
}

char *pd_xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = pd_xmalloc(n);
    memcpy(d, s, n);
    return d;
}

pd_status pd_file_read_all(const char *path, char **data_p, size_t *len_p, pd_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return pd_err_set(err, PD_ERR_IO, "%s: cannot open: %m", path);
    if (fseek(f, 0, SEEK_END) != 0) {
        fclose(f);
        return pd_err_set(err, PD_ERR_IO, "%s: cannot seek", path);
    }
    long n = ftell(f);
    if (n < 0) {
        fclose(f);
        return pd_err_set(err, PD_ERR_IO, "%s: cannot tell size", path);
    }
    rewind(f);
    char *buf = malloc((size_t)n + 1);
    if (!buf) {
        fclose(f);
        return pd_err_set(err, PD_ERR_NOMEM, "%s: out of memory reading %ld bytes", path, n);
    }
    if (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        fclose(f);
        return pd_err_set(err, PD_ERR_IO, "%s: short read", path);
    }
    fclose(f);
    buf[n] = 0;
    *data_p = buf;
    if (len_p)
        *len_p = (size_t)n;
    return PD_OK;
}

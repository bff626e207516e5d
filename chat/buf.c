/* A growable byte buffer and the marker search with hold-back. */
#define _GNU_SOURCE /* memmem */
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

pd_status chat_buf_add(chat_buf *b, const char *s, size_t len) {
    if (b->n + len + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + len + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p)
            return PD_ERR_NOMEM;
        b->p = p;
        b->cap = cap;
    }
    if (len)
        memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = 0;
    return PD_OK;
}

void chat_buf_drop(chat_buf *b, size_t k) {
    if (k >= b->n) {
        b->n = 0;
    } else {
        memmove(b->p, b->p + k, b->n - k);
        b->n -= k;
    }
    if (b->p)
        b->p[b->n] = 0;
}

void chat_buf_free(chat_buf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

bool chat_is_prefix_of(const char *s, size_t n, const char *marker) {
    size_t m = strlen(marker);
    return n < m && memcmp(s, marker, n) == 0;
}

int chat_find_marker(const char *s, size_t n, const char *const *markers, int n_markers,
                     size_t *at_p, size_t *hold_p) {
    int best = -1;
    size_t best_at = 0;
    for (int i = 0; i < n_markers; i++) {
        size_t m = strlen(markers[i]);
        if (m == 0 || m > n)
            continue;
        const char *hit = memmem(s, n, markers[i], m);
        if (hit && (best < 0 || (size_t)(hit - s) < best_at)) {
            best = i;
            best_at = (size_t)(hit - s);
        }
    }
    if (best >= 0) {
        *at_p = best_at;
        return best;
    }
    size_t hold = 0;
    for (int i = 0; i < n_markers; i++) {
        size_t m = strlen(markers[i]);
        /* the longest k < m with s's last k bytes == marker's first k */
        for (size_t k = (m - 1 < n ? m - 1 : n); k > hold; k--)
            if (memcmp(s + n - k, markers[i], k) == 0) {
                hold = k;
                break;
            }
    }
    *hold_p = hold;
    return -1;
}

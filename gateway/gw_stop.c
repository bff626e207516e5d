/* Stop strings over streamed text. The text of one choice arrives in pieces
 * (each valid UTF-8, from the incremental detokenizer); a stop string may
 * span pieces. What could still be the start of a stop string is held back
 * in a small buffer (shorter than the longest stop string), everything
 * before it is final. Before this call no stop string occurred in the held
 * text, so a match must end in the new piece; searching the whole held
 * buffer is still cheap because it stays short. */
#define _GNU_SOURCE /* memmem */
#include <string.h>

#include "gw_internal.h"

static int sb_reserve(gw_stopbuf *sb, size_t need) {
    if (need <= sb->cap)
        return 0;
    size_t cap = sb->cap ? sb->cap : 64;
    while (cap < need)
        cap *= 2;
    char *p = realloc(sb->buf, cap);
    if (!p)
        return -1;
    sb->buf = p;
    sb->cap = cap;
    return 0;
}

/* Length of the longest suffix of buf[0..len) that is a proper prefix of s. */
static size_t partial_suffix(const char *buf, size_t len, const char *s, size_t slen) {
    size_t from = len >= slen ? len - slen + 1 : 0;
    for (size_t i = from; i < len; i++)
        if (buf[i] == s[0] && memcmp(buf + i, s, len - i) == 0)
            return len - i;
    return 0;
}

int gw_stop_feed(gw_stopbuf *sb, const char *text, size_t len, char *const *stops, int n_stops,
                 bool include_stop, bool final, size_t *emit_p) {
    if (sb_reserve(sb, sb->len + len + 1))
        return -2;
    if (len)
        memcpy(sb->buf + sb->len, text, len);
    sb->len += len;
    sb->buf[sb->len] = 0;

    int best = -1;
    size_t best_pos = 0;
    for (int i = 0; i < n_stops; i++) {
        size_t slen = strlen(stops[i]);
        if (slen == 0 || slen > sb->len)
            continue;
        const char *hit = memmem(sb->buf, sb->len, stops[i], slen);
        if (!hit)
            continue;
        size_t pos = (size_t)(hit - sb->buf);
        if (best < 0 || pos < best_pos) {
            best = i;
            best_pos = pos;
        }
    }
    if (best >= 0) {
        *emit_p = best_pos + (include_stop ? strlen(stops[best]) : 0);
        return best;
    }
    size_t hold = 0;
    if (!final) {
        for (int i = 0; i < n_stops; i++) {
            size_t h = partial_suffix(sb->buf, sb->len, stops[i], strlen(stops[i]));
            if (h > hold)
                hold = h;
        }
    }
    *emit_p = sb->len - hold;
    return -1;
}

void gw_stopbuf_consume(gw_stopbuf *sb, size_t n) {
    if (n >= sb->len) {
        sb->len = 0;
    } else {
        memmove(sb->buf, sb->buf + n, sb->len - n);
        sb->len -= n;
    }
    if (sb->buf)
        sb->buf[sb->len] = 0;
}

void gw_stopbuf_free(gw_stopbuf *sb) {
    free(sb->buf);
    memset(sb, 0, sizeof *sb);
}

/* The stop-string matcher (gateway/gw_stop.c) over streamed pieces, driven
 * the way gw_request.c's feed_text drives it.
 *
 * Input: byte 0 = flags (bit 0 include_stop_str, bits 1-2 = stop strings
 * - 1); then each stop string as [len & 15][bytes]; the rest is the text as
 * pieces [len & 31][bytes]. Stop strings and pieces are UTF-8-repaired, as
 * the gateway's validation and the detokenizer guarantee.
 *
 * Properties: text is never lost or duplicated (emitted + held == fed);
 * what is held is shorter than the longest stop string; the emitted text
 * never contains a stop string (beyond the matched one when it is
 * included); a reported match is where the stop string really is; the
 * final call emits everything; every emitted run is valid UTF-8. */
#define _GNU_SOURCE /* memmem */
#include <stdint.h>
#include <string.h>

#include "fuzz_util.h"
#include "gw_internal.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fz_quiet_logs();
    return 0;
}

static bool contains_stop(const char *s, size_t n, char **stops, int n_stops) {
    for (int i = 0; i < n_stops; i++)
        if (memmem(s, n, stops[i], strlen(stops[i])))
            return true;
    return false;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1)
        return 0;
    bool include = data[0] & 1;
    int want = ((data[0] >> 1) & 3) + 1;
    size_t o = 1;
    char *stops[4];
    int n_stops = 0;
    size_t max_stop = 0;
    pd_err err = {{0}};
    for (int i = 0; i < want && o < size; i++) {
        size_t l = data[o++] & 15;
        if (l > size - o)
            l = size - o;
        char *s = NULL;
        size_t sl = 0;
        FZ_CHECK(pd_tok_utf8_repair((const char *)data + o, l, &s, &sl, &err) == PD_OK, "repair");
        o += l;
        if (sl == 0 || memchr(s, 0, sl)) { /* the gateway refuses these */
            free(s);
            continue;
        }
        stops[n_stops++] = s;
        if (sl > max_stop)
            max_stop = sl;
    }

    gw_stopbuf sb = {0};
    fz_buf fed = {0}, out = {0};
    int match = -1;
    bool final = false;
    while (!final) {
        char *piece = NULL;
        size_t plen = 0;
        if (o < size) {
            size_t l = data[o++] & 31;
            if (l > size - o)
                l = size - o;
            FZ_CHECK(pd_tok_utf8_repair((const char *)data + o, l, &piece, &plen, &err) == PD_OK,
                     "repair");
            o += l;
        } else {
            final = true; /* the flush of the detokenizer: an empty final piece */
        }
        fz_buf_add(&fed, piece ? piece : "", plen);
        size_t emit = 0;
        size_t held_before = sb.len;
        int m = gw_stop_feed(&sb, piece, plen, stops, n_stops, include, final, &emit);
        free(piece);
        FZ_CHECK(m >= -1 && m < n_stops, "returned %d", m);
        FZ_CHECK(emit <= sb.len && sb.len == held_before + plen, "emit %zu of %zu", emit, sb.len);
        FZ_CHECK(pd_tok_utf8_valid(sb.buf, emit), "emitted text is not valid UTF-8");
        if (m >= 0) {
            size_t sl = strlen(stops[m]);
            size_t pos = include ? emit - sl : emit;
            FZ_CHECK(!include || emit >= sl, "include_stop: emit %zu < %zu", emit, sl);
            FZ_CHECK(pos + sl <= sb.len && memcmp(sb.buf + pos, stops[m], sl) == 0,
                     "stop %d is not at %zu", m, pos);
            fz_buf_add(&out, sb.buf, pos);
            FZ_CHECK(!contains_stop(out.p, out.len, stops, n_stops),
                     "a stop string was emitted before the match");
            fz_buf_add(&out, stops[m], sl);
            FZ_CHECK(memcmp(out.p, fed.p, out.len) == 0, "emitted text differs from the input");
            match = m;
            break;
        }
        fz_buf_add(&out, sb.buf, emit);
        gw_stopbuf_consume(&sb, emit);
        FZ_CHECK(out.len + sb.len == fed.len && memcmp(out.p, fed.p, out.len) == 0 &&
                     (sb.len == 0 || memcmp(sb.buf, fed.p + out.len, sb.len) == 0),
                 "emitted + held != fed");
        FZ_CHECK(!final || sb.len == 0, "final call held %zu bytes", sb.len);
        FZ_CHECK(n_stops == 0 ? sb.len == 0 : sb.len < max_stop, "held %zu bytes (longest stop %zu)",
                 sb.len, max_stop);
        FZ_CHECK(!contains_stop(out.p, out.len, stops, n_stops), "a stop string was emitted");
    }
    if (match < 0)
        FZ_CHECK(!contains_stop(fed.p, fed.len, stops, n_stops), "a stop string was missed");
    gw_stopbuf_free(&sb);
    free(fed.p);
    free(out.p);
    for (int i = 0; i < n_stops; i++)
        free(stops[i]);
    return 0;
}

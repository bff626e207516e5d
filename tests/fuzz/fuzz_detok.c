/* Token ids → the incremental detokenizer (pd_detok_push / flush), with
 * and without skip_special. Input: little-endian 3-byte ids (so most land in
 * the vocabulary; values past it and negative ones are made from the top
 * bits). Properties: every piece is valid UTF-8, and the pieces joined equal
 * pd_tok_decode of the whole sequence (what a non-streamed response gets). */
#include <stdint.h>
#include <string.h>

#include "fuzz_util.h"

static const pd_tokenizer *g_tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fz_quiet_logs();
    g_tok = fz_tokenizer();
    return 0;
}

static int32_t id_at(const uint8_t *p) {
    uint32_t v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16;
    if (v >= 0xf00000u) /* a few far-out ids: negative, just past the vocab, INT32_MAX */
        return (v & 3) == 0 ? -1 - (int32_t)(v & 0xff) : (v & 3) == 1 ? INT32_MAX
                                                                      : 128815 + (int32_t)(v & 0xfff);
    return (int32_t)(v % 129280u); /* the model's padded embedding size */
}

static void check(const int32_t *ids, size_t n, bool skip) {
    pd_detok *d = pd_detok_new(g_tok, skip);
    FZ_CHECK(d != NULL, "pd_detok_new");
    size_t cap = 64, len = 0;
    char *all = malloc(cap);
    for (size_t i = 0; i <= n; i++) {
        const char *piece;
        size_t plen;
        if (i < n)
            pd_detok_push(d, ids[i], &piece, &plen);
        else
            pd_detok_flush(d, &piece, &plen);
        FZ_CHECK(piece != NULL && piece[plen] == 0, "piece not NUL-terminated");
        FZ_CHECK(pd_tok_utf8_valid(piece, plen), "piece %zu is not valid UTF-8", i);
        if (len + plen + 1 > cap) {
            while (len + plen + 1 > cap)
                cap *= 2;
            all = realloc(all, cap);
        }
        memcpy(all + len, piece, plen);
        len += plen;
    }
    char *whole = NULL;
    size_t wlen = 0;
    pd_err err = {{0}};
    FZ_CHECK(pd_tok_decode(g_tok, ids, n, skip, &whole, &wlen, &err) == PD_OK, "%s", err.msg);
    FZ_CHECK(wlen == len && memcmp(whole, all, len) == 0,
             "skip_special=%d: streamed %zu bytes, decoded %zu", skip, len, wlen);
    free(whole);
    free(all);
    pd_detok_free(&d);
    FZ_CHECK(d == NULL, "pd_detok_free");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t n = size / 3;
    if (n > 4096)
        n = 4096;
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    for (size_t i = 0; i < n; i++)
        ids[i] = id_at(data + 3 * i);
    check(ids, n, false);
    check(ids, n, true);
    free(ids);
    return 0;
}

/* Arbitrary bytes → pd_tok_encode in each added-token mode (the DeepSeek-V3
 * tokenizer, loaded once). Properties: every id names a token; byte-level
 * BPE loses nothing, so decoding the ids (specials kept) gives back the
 * input after UTF-8 repair, as Hugging Face `tokenizers` would. */
#include <stdint.h>
#include <string.h>

#include "fuzz_util.h"

static const pd_tokenizer *g_tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fz_quiet_logs();
    g_tok = fz_tokenizer();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 16384) /* encode is linear-ish; long inputs only slow the search */
        return 0;
    const char *text = (const char *)data;
    char *repaired = NULL;
    size_t rlen = 0;
    pd_err err = {{0}};
    FZ_CHECK(pd_tok_utf8_repair(text, size, &repaired, &rlen, &err) == PD_OK, "%s", err.msg);
    FZ_CHECK(pd_tok_utf8_valid(repaired, rlen), "repair output is not valid UTF-8");
    int vocab = pd_tok_vocab_size(g_tok);
    static const pd_tok_added_mode modes[] = {PD_TOK_ADDED_ALL, PD_TOK_ADDED_NONSPECIAL,
                                              PD_TOK_ADDED_NONE};
    for (size_t m = 0; m < sizeof modes / sizeof modes[0]; m++) {
        int32_t *ids = NULL;
        size_t n = 0;
        pd_status st = pd_tok_encode_ex(g_tok, text, size, modes[m], &ids, &n, &err);
        if (st == PD_ERR_LIMIT) /* the regex engine's resource limit: an explicit error */
            continue;
        FZ_CHECK(st == PD_OK, "mode %d: %s", (int)modes[m], err.msg);
        FZ_CHECK(ids != NULL, "ids NULL");
        for (size_t i = 0; i < n; i++)
            FZ_CHECK(ids[i] >= 0 && ids[i] < vocab && pd_tok_token_text(g_tok, ids[i]) != NULL,
                     "mode %d: id %d at %zu names no token", (int)modes[m], ids[i], i);
        char *back = NULL;
        size_t blen = 0;
        FZ_CHECK(pd_tok_decode(g_tok, ids, n, false, &back, &blen, &err) == PD_OK, "%s", err.msg);
        FZ_CHECK(blen == rlen && memcmp(back, repaired, rlen) == 0,
                 "mode %d: decode(encode(x)) != x (%zu vs %zu bytes)", (int)modes[m], blen, rlen);
        free(back);
        free(ids);
    }
    free(repaired);
    return 0;
}

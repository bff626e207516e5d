/* JSON Schema compile (pd_grammar_compile: the schema comes from the
 * request) and byte walks through the automaton, with masks on the real
 * vocabulary. Input: a 2-byte little-endian length L, then L bytes of
 * schema text, then bytes to feed one at a time (a refused byte is
 * skipped). Properties: compile never crashes and either succeeds or sets a
 * message; the state never accepts a refused byte; whenever the accepted
 * text is complete it parses as JSON (jansson, which alone refuses \u0000
 * in an object key); every 8 accepted bytes the
 * mask's EOS bit equals is_complete, it allows at least one token unless
 * the value is terminal, and a token it allows is accepted. */
#include <jansson.h>
#include <stdint.h>
#include <string.h>

#include "fuzz_util.h"
#include "pd_grammar.h"

#define VOCAB 129280
#define EOS   1

static pd_grammar_vocab *g_vocab;
static uint32_t g_words[(VOCAB + 31) / 32];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fz_quiet_logs();
    pd_err err = {{0}};
    if (pd_grammar_vocab_init(fz_tokenizer(), VOCAB, EOS, &g_vocab, &err) != PD_OK) {
        fprintf(stderr, "fuzz: vocab: %s\n", err.msg);
        exit(1);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2)
        return 0;
    size_t l = (size_t)data[0] | (size_t)data[1] << 8;
    if (l > size - 2)
        l = size - 2;
    const char *schema = (const char *)data + 2;
    const uint8_t *walk = data + 2 + l;
    size_t n_walk = size - 2 - l;
    pd_grammar *g = NULL;
    pd_err err = {{0}};
    if (pd_grammar_compile(schema, l, &g, &err) != PD_OK) {
        FZ_CHECK(g == NULL && err.msg[0], "failed compile without a message");
        return 0;
    }
    FZ_CHECK(pd_grammar_canonical(g) != NULL, "canonical");
    pd_grammar_state *s = NULL;
    FZ_CHECK(pd_grammar_state_init(g, g_vocab, &s, &err) == PD_OK, "%s", err.msg);
    char *text = malloc(n_walk + 1);
    size_t len = 0;
    for (size_t i = 0; i < n_walk; i++) {
        if (!pd_grammar_state_accept_bytes(s, &walk[i], 1))
            continue;
        text[len++] = (char)walk[i];
        if (pd_grammar_state_is_complete(s)) {
            json_error_t je;
            json_t *v = json_loadb(text, len, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
            /* \u0000 in an object key is JSON (RFC 8259 §7 allows any
             * escaped code point in a string) that jansson refuses even
             * with JSON_ALLOW_NUL: that one refusal is not the grammar's */
            FZ_CHECK(v != NULL || !strncmp(je.text, "NUL byte in object key", 22), "complete but not JSON: %.*s (%s)",
                     (int)len, text, je.text);
            json_decref(v);
        }
        if (len % 8 == 0) {
            int allowed = pd_grammar_state_fill_mask(s, g_words, (int64_t)(walk[i] % 64) - 1);
            bool eos = g_words[EOS >> 5] & (1u << (EOS & 31));
            FZ_CHECK(eos == pd_grammar_state_is_complete(s), "EOS bit %d", eos);
            FZ_CHECK(allowed > 0 || pd_grammar_state_is_terminal(s), "nothing allowed: %.*s", (int)len, text);
            for (int32_t t = 0; t < VOCAB; t++) {
                if (t != EOS && (g_words[t >> 5] & (1u << (t & 31)))) {
                    /* a fresh state replayed to the same text accepts it */
                    pd_grammar_state *f = NULL;
                    pd_grammar_state_init(g, g_vocab, &f, NULL);
                    FZ_CHECK(pd_grammar_state_accept_bytes(f, (const uint8_t *)text, len), "replay");
                    FZ_CHECK(pd_grammar_state_accept_token(f, t), "allowed token %d refused", (int)t);
                    pd_grammar_state_free(&f);
                    break;
                }
            }
        }
    }
    free(text);
    pd_grammar_state_free(&s);
    pd_grammar_free(&g);
    return 0;
}

/* Class mapping: making PCRE2 split text the way Oniguruma does.
 *
 * HF tokenizers runs the Split regexes with Oniguruma. Its Unicode tables
 * (Unicode 16 in tokenizers 0.23) are newer than those of the PCRE2 we link
 * (Debian 12's 10.42: Unicode 14), and the two disagree on one old
 * character: PCRE2's \s still includes U+180E, Oniguruma's (White_Space)
 * does not. Characters assigned after Unicode 14 would otherwise be
 * classified as unassigned and split differently from the reference.
 *
 * The DeepSeek-V3 patterns only ask, of a non-ASCII character, whether it
 * is \p{L}, \p{M}, \p{N}, \p{P}, \p{S} or \s, or whether it is one of the
 * characters written literally in the pattern (the CJK and kana ranges).
 * So before PCRE2 sees the text, every non-ASCII character that is not
 * written in a pattern is replaced by a fixed representative of its class
 * under our own table (tok_unicode_data.c, generated from the UCD of the
 * reference's Unicode version), with the same UTF-8 length, so byte offsets
 * of matches carry over to the original text unchanged. The representatives
 * are characters every PCRE2 of the last decade classifies the same way,
 * and are checked against the running PCRE2 at load.
 *
 * A pattern using anything whose answer the mapping would not preserve
 * (\d, \w, \b, \v, \h, other \p{..} properties, POSIX classes, inline
 * options such as (?i)) turns the mapping off for the tokenizer: PCRE2 then
 * sees the raw text and its own Unicode tables decide.
 */
#include <string.h>

#include "tok_internal.h"

/* Representatives by UTF-8 length (2, 3, 4) and TOK_UC_* class. No
 * White_Space character needs 4 bytes; that entry is never used. */
static const char REP[3][7][5] = {
    {"\xC2\x80", "\xC3\xA0", "\xCC\x80", "\xC2\xB2", "\xC2\xA1", "\xC2\xA2", "\xC2\xA0"},
    /* U+0080 Cc, U+00E0 Ll, U+0300 Mn, U+00B2 No, U+00A1 Po, U+00A2 Sc, U+00A0 Zs */
    {"\xE2\x80\x8B", "\xE0\xA0\x80", "\xE0\xA4\x81", "\xE0\xA5\xA6", "\xE2\x80\x90", "\xE2\x82\xAC",
     "\xE2\x80\x80"},
    /* U+200B Cf, U+0800 Lo, U+0901 Mn, U+0966 Nd, U+2010 Pd, U+20AC Sc, U+2000 Zs */
    {"\xF3\xA0\x80\x81", "\xF0\x90\x80\x80", "\xF0\x90\x87\xBD", "\xF0\x90\x84\x87",
     "\xF0\x90\x84\x80", "\xF0\x90\x84\xB7", "\xF3\xA0\x80\x81"},
    /* U+E0001 Cf, U+10000 Lo, U+101FD Mn, U+10107 No, U+10100 Po, U+10137 So, (unused) */
};

static uint32_t decode_utf8(const uint8_t *s, size_t *len_p) {
    if (s[0] < 0xE0) {
        *len_p = 2;
        return ((uint32_t)(s[0] & 0x1F) << 6) | (s[1] & 0x3F);
    }
    if (s[0] < 0xF0) {
        *len_p = 3;
        return ((uint32_t)(s[0] & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    }
    *len_p = 4;
    return ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
           ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
}

static pd_status keep_add(pd_tokenizer *t, uint32_t lo, uint32_t hi) {
    if (hi < 0x80)
        return PD_OK;
    if (lo < 0x80)
        lo = 0x80;
    if (t->n_keep == t->keep_cap) {
        size_t cap = t->keep_cap ? 2 * t->keep_cap : 16;
        uint32_t(*k)[2] = realloc(t->keep, cap * sizeof *k);
        if (!k)
            return PD_ERR_NOMEM;
        t->keep = k;
        t->keep_cap = cap;
    }
    t->keep[t->n_keep][0] = lo;
    t->keep[t->n_keep][1] = hi;
    t->n_keep++;
    return PD_OK;
}

static bool keep_has(const pd_tokenizer *t, uint32_t cp) {
    for (size_t i = 0; i < t->n_keep; i++)
        if (cp >= t->keep[i][0] && cp <= t->keep[i][1])
            return true;
    return false;
}

static int hexval(char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* One element of a pattern, as far as the mapping cares. */
typedef struct {
    bool literal; /* a character standing for itself */
    bool dash;    /* an unescaped '-' */
    uint32_t cp;
} pat_item;

pd_status tok_classmap_note_pattern(pd_tokenizer *t, const char *pattern, size_t len,
                                    bool literal) {
    const uint8_t *p = (const uint8_t *)pattern;
    pat_item prev2 = {0}, prev1 = {0};
    size_t i = 0;
    while (i < len) {
        pat_item it = {.literal = true};
        if (literal || (p[i] != '\\' && p[i] != '(' && p[i] != '[')) {
            if (p[i] < 0x80) {
                it.cp = p[i++];
                it.dash = !literal && it.cp == '-';
            } else {
                size_t n;
                if (i + 1 >= len || tok_utf8_valid_prefix(p + i, len - i) == 0) {
                    t->classmap_unsafe = true; /* PCRE2 will reject it anyway */
                    return PD_OK;
                }
                it.cp = decode_utf8(p + i, &n);
                i += n;
            }
        } else if (p[i] == '(') {
            /* groups and lookarounds only; (?i), (?x), ... change matching */
            if (i + 1 < len && p[i + 1] == '?') {
                bool ok =
                    i + 2 < len &&
                    (p[i + 2] == ':' || p[i + 2] == '=' || p[i + 2] == '!' ||
                     (p[i + 2] == '<' && i + 3 < len && (p[i + 3] == '=' || p[i + 3] == '!')));
                if (!ok)
                    t->classmap_unsafe = true;
            }
            it.literal = false;
            i++;
        } else if (p[i] == '[') {
            if (i + 1 < len && p[i + 1] == ':')
                t->classmap_unsafe = true; /* POSIX class */
            it.literal = false;
            i++;
        } else { /* backslash escape */
            char e = i + 1 < len ? (char)p[i + 1] : 0;
            i += 2;
            if (e == 'p' || e == 'P') {
                /* only the general categories the table knows */
                if (i + 2 < len && p[i] == '{' && strchr("LMNPS", p[i + 1]) && p[i + 2] == '}')
                    i += 3;
                else
                    t->classmap_unsafe = true;
                it.literal = false;
            } else if (e == 's' || e == 'S') {
                it.literal = false;
            } else if (e == 'r' || e == 'n' || e == 't' || e == 'f') {
                it.cp = e == 'r' ? '\r' : e == 'n' ? '\n' : e == 't' ? '\t' : '\f';
            } else if (e == 'x') {
                uint32_t v = 0;
                if (i < len && p[i] == '{') {
                    for (i++; i < len && p[i] != '}'; i++)
                        v = v * 16 + (uint32_t)(hexval((char)p[i]) < 0 ? 0 : hexval((char)p[i]));
                    i++;
                } else {
                    for (int k = 0; k < 2 && i < len && hexval((char)p[i]) >= 0; k++, i++)
                        v = v * 16 + (uint32_t)hexval((char)p[i]);
                }
                it.cp = v;
            } else if (e && !((e >= '0' && e <= '9') || (e >= 'a' && e <= 'z') ||
                              (e >= 'A' && e <= 'Z'))) {
                it.cp = (uint8_t)e; /* escaped punctuation stands for itself */
            } else {
                t->classmap_unsafe = true; /* \d \w \b \v \h \R \X \Q ... */
                it.literal = false;
            }
        }
        if (it.literal && it.cp >= 0x80 && keep_add(t, it.cp, it.cp) != PD_OK)
            return PD_ERR_NOMEM;
        /* a range a-b between literal characters: keep all of it */
        if (it.literal && prev1.dash && prev2.literal && !prev2.dash && prev2.cp <= it.cp &&
            keep_add(t, prev2.cp, it.cp) != PD_OK)
            return PD_ERR_NOMEM;
        prev2 = prev1;
        prev1 = it;
    }
    return PD_OK;
}

void tok_classmap_finish(pd_tokenizer *t) {
    t->classmap = false;
    if (t->classmap_unsafe || t->n_splits == 0)
        return;
    /* every representative must be outside keep[] and classified by the
     * running PCRE2 as its class (L M N P S \s, or none of them) */
    static const char *const CLS_RE[7] = {NULL,     "\\p{L}", "\\p{M}", "\\p{N}",
                                          "\\p{P}", "\\p{S}", "\\s"};
    pcre2_code *re[7] = {0};
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    bool ok = md != NULL;
    for (int c = 1; c < 7 && ok; c++) {
        int ec;
        PCRE2_SIZE eo;
        re[c] = pcre2_compile((PCRE2_SPTR)CLS_RE[c], PCRE2_ZERO_TERMINATED,
                              PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED, &ec, &eo, NULL);
        ok = re[c] != NULL;
    }
    for (int l = 0; l < 3 && ok; l++) {
        for (int c = 0; c < 7 && ok; c++) {
            if (l == 2 && c == TOK_UC_WS)
                continue;
            const char *r = REP[l][c];
            size_t n;
            if (keep_has(t, decode_utf8((const uint8_t *)r, &n)))
                ok = false;
            for (int k = 1; k < 7 && ok; k++) {
                int rc = pcre2_match(re[k], (PCRE2_SPTR)r, strlen(r), 0, 0, md, NULL);
                if ((rc > 0) != (k == c))
                    ok = false;
            }
        }
    }
    for (int c = 1; c < 7; c++)
        pcre2_code_free(re[c]);
    pcre2_match_data_free(md);
    if (!ok)
        PD_LOGW("tokenizer",
                "%s: class mapping disabled (representatives do not check out); "
                "splits follow PCRE2's Unicode tables",
                t->path);
    t->classmap = ok;
}

void tok_classmap_apply(const pd_tokenizer *t, const uint8_t *s, size_t n, uint8_t *out) {
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            out[i] = s[i];
            i++;
            continue;
        }
        size_t len;
        uint32_t cp = decode_utf8(s + i, &len);
        if (keep_has(t, cp))
            memcpy(out + i, s + i, len);
        else
            memcpy(out + i, REP[len - 2][tok_uc_class(cp)], len);
        i += len;
    }
}

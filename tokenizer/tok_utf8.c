/* UTF-8 well-formedness and repair.
 *
 * Repair follows Unicode 15 §3.9 "U+FFFD Substitution of Maximal Subparts"
 * (Table 3-7 for the well-formed byte sequences): at an ill-formed position
 * the longest prefix of a well-formed sequence is replaced by one U+FFFD,
 * and a byte that cannot start one is replaced by one U+FFFD. Python's
 * bytes.decode("utf-8", "replace") and Rust's String::from_utf8_lossy (which
 * HF tokenizers' decoders use) both implement exactly this, so repaired
 * input and decoded output agree with the reference byte for byte.
 */
#include <string.h>

#include "tok_internal.h"

/* Sequence length announced by a lead byte (0: never a lead byte) and the
 * allowed range of the second byte (Table 3-7). */
static int lead_info(uint8_t b, uint8_t *lo_p, uint8_t *hi_p) {
    *lo_p = 0x80;
    *hi_p = 0xBF;
    if (b < 0x80)
        return 1;
    if (b < 0xC2)
        return 0;
    if (b < 0xE0)
        return 2;
    if (b < 0xF0) {
        if (b == 0xE0)
            *lo_p = 0xA0;
        else if (b == 0xED)
            *hi_p = 0x9F;
        return 3;
    }
    if (b < 0xF5) {
        if (b == 0xF0)
            *lo_p = 0x90;
        else if (b == 0xF4)
            *hi_p = 0x8F;
        return 4;
    }
    return 0;
}

/* Examines the sequence at s[0..n): returns its length when well-formed (>0);
 * otherwise returns -k where k >= 1 is the length of the maximal subpart to
 * replace, and sets *incomplete when the input ended inside a sequence that
 * was well-formed so far. */
static int seq_check(const uint8_t *s, size_t n, bool *incomplete) {
    uint8_t lo, hi;
    int need = lead_info(s[0], &lo, &hi);
    *incomplete = false;
    if (need == 0)
        return -1;
    for (int k = 1; k < need; k++) {
        if ((size_t)k >= n) {
            *incomplete = true;
            return -k;
        }
        uint8_t c = s[k];
        if (k == 1 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF))
            return -k;
    }
    return need;
}

size_t tok_utf8_valid_prefix(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) { /* ASCII run */
            i++;
            continue;
        }
        bool inc;
        int r = seq_check(s + i, n - i, &inc);
        if (r < 0)
            return i;
        i += (size_t)r;
    }
    return n;
}

size_t tok_utf8_repair_into(const uint8_t *s, size_t n, bool final, char *out, size_t *out_len) {
    size_t i = 0, o = *out_len;
    while (i < n) {
        if (s[i] < 0x80) {
            out[o++] = (char)s[i++];
            continue;
        }
        bool inc;
        int r = seq_check(s + i, n - i, &inc);
        if (r > 0) {
            memcpy(out + o, s + i, (size_t)r);
            o += (size_t)r;
            i += (size_t)r;
            continue;
        }
        if (inc && !final)
            break; /* wait for the rest of the character */
        memcpy(out + o, "\xEF\xBF\xBD", 3);
        o += 3;
        i += (size_t)(-r);
    }
    *out_len = o;
    return i;
}

bool pd_tok_utf8_valid(const char *s, size_t len) {
    if (!s)
        return len == 0;
    return tok_utf8_valid_prefix((const uint8_t *)s, len) == len;
}

pd_status pd_tok_utf8_repair(const char *s, size_t len, char **out_p, size_t *out_len_p,
                             pd_err *err) {
    if (!out_p || (!s && len > 0))
        return pd_err_set(err, PD_ERR_INVALID, "pd_tok_utf8_repair: NULL argument");
    if (len > (SIZE_MAX - 1) / 3)
        return pd_err_set(err, PD_ERR_NOMEM, "pd_tok_utf8_repair: %zu bytes is too long", len);
    char *out = malloc(3 * len + 1);
    if (!out)
        return pd_err_set(err, PD_ERR_NOMEM, "pd_tok_utf8_repair: out of memory (%zu bytes)",
                          3 * len + 1);
    size_t o = 0;
    if (len)
        tok_utf8_repair_into((const uint8_t *)s, len, true, out, &o);
    out[o] = '\0';
    *out_p = out;
    if (out_len_p)
        *out_len_p = o;
    return PD_OK;
}

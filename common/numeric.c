/* Number formats and the deterministic generator. */
#include "pd_common.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

float pd_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t pd_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet */
        return (uint16_t)((u >> 16) | 0x40);
    uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)((u + rounding) >> 16);
}

float pd_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24);
        if (sign) f = -f;
        return f;
    }
    if (exp == 31) {
        uint32_t u = sign | 0x7f800000u | (man << 13);
        memcpy(&f, &u, 4);
        return f;
    }
    uint32_t u = sign | ((exp + 112) << 23) | (man << 13);
    memcpy(&f, &u, 4);
    return f;
}

uint16_t pd_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    float a = fabsf(f);
    if (isnan(f)) return sign | 0x7e00;
    if (a >= 65520.0f) return sign | 0x7c00;
    if (a < 6.103515625e-05f) { /* subnormal */
        int m = (int)lrintf(a * 16777216.0f);
        return sign | (uint16_t)m;
    }
    int e;
    float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    int man = (int)lrintf((m * 2.0f - 1.0f) * 1024.0f);
    int exp = e - 1 + 15;
    if (man == 1024) { man = 0; exp++; }
    if (exp >= 31) return sign | 0x7c00;
    return sign | (uint16_t)(exp << 10) | (uint16_t)man;
}

float pd_e4m3_to_f32(uint8_t v) {
    int sign = v & 0x80;
    int exp = (v >> 3) & 0xf;
    int man = v & 0x7;
    float f;
    if (exp == 0xf && man == 0x7)
        return NAN;
    if (exp == 0)
        f = ldexpf((float)man, -9); /* subnormal: man/8 * 2^-6 */
    else
        f = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return sign ? -f : f;
}

static float e4m3_tab[256];
static pthread_once_t e4m3_once = PTHREAD_ONCE_INIT;

static void e4m3_fill(void) {
    for (int c = 0; c < 256; c++)
        e4m3_tab[c] = pd_e4m3_to_f32((uint8_t)c);
}

const float *pd_e4m3_table(void) {
    pthread_once(&e4m3_once, e4m3_fill);
    return e4m3_tab;
}

uint8_t pd_f32_to_e4m3(float f) {
    if (isnan(f)) return 0x7f;
    uint8_t sign = signbit(f) ? 0x80 : 0;
    float a = fabsf(f);
    if (a >= 448.0f) /* saturate, as the published FP8 checkpoints do */
        return sign | 0x7e;
    /* Round to nearest even on the e4m3 grid: 3 mantissa bits, exponent
     * bias 7, subnormals below 2^-6 with step 2^-9. */
    int e;
    frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1): binade exponent e-1 */
    int be = e - 1;
    if (be < -6) be = -6;
    float step = ldexpf(1.0f, be - 3);
    float q = nearbyintf(a / step) * step; /* default rounding mode: ties to even */
    if (q == 0.0f) return sign;
    int qe;
    float qm = frexpf(q, &qe);
    int bexp = qe - 1 + 7;
    if (bexp <= 0) /* subnormal: value = man * 2^-9 */
        return sign | (uint8_t)lrintf(q * 512.0f);
    int man = (int)lrintf((qm * 2.0f - 1.0f) * 8.0f);
    return sign | (uint8_t)(bexp << 3) | (uint8_t)man;
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void pd_rng_seed(pd_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&x);
}

static inline uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

uint64_t pd_rng_next(pd_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double pd_rng_uniform(pd_rng *r) {
    return (double)(pd_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

double pd_rng_normal(pd_rng *r) {
    double u1 = pd_rng_uniform(r), u2 = pd_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

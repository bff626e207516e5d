/* The sampler: logits of one sequence -> the next token, with vLLM's
 * semantics and order (vllm/model_executor/layers/sampler.py, v0;
 * vllm/v1/sample/sampler.py for logit_bias):
 *
 *   0. logit_bias: each listed token's bias added to its logit (OpenAI's
 *      logit_bias; vLLM v1 applies it with the other logits processors that
 *      can change the argmax, before the penalties);
 *   1. repetition penalty (CTRL, arXiv 1909.05858 §4.1) on every token seen in
 *      the prompt or the output: a positive logit is divided by it, any other
 *      multiplied;
 *   2. frequency and presence penalties (OpenAI) on output tokens:
 *      logit -= frequency_penalty * count;  logit -= presence_penalty;
 *   3. temperature < 1e-5 (vLLM's _SAMPLING_EPS): greedy argmax, ties to the
 *      lowest id; otherwise
 *   4. logits /= temperature, then top-k, top-p (nucleus, on the top-k
 *      distribution renormalised), min-p (relative to the most likely token),
 *      and one draw from what is left, renormalised.
 *
 * On return the logits hold what the sampler drew from: biased, penalised,
 * divided by the temperature, filtered tokens at -inf (greedy: biased and
 * penalised only). Logprobs are of the logits before step 0 (vLLM's default
 * raw_logprobs): a bias changes what is sampled, not the reported logprobs.
 *
 * Memory per sampler: penalty state (5 bytes per vocabulary entry) only when
 * a penalty is on; candidate scratch (8 bytes per entry) from the first
 * random draw; a copy of the raw logits (4 bytes per entry) from the first
 * call that asks for a logprob.
 */
#include "pd_model.h"

#include <assert.h>
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SAMPLING_EPS 1e-5f

/* pd_sampler.seen_flags bits */
#define SEEN_PROMPT 1u
#define SEEN_LISTED 2u /* the token is in seen[] */

struct pd_sampler {
    pd_sampling_params p;
    int vocab_size;
    pd_rng rng;

    /* Penalty state (NULL when every penalty is off). seen[] lists each
     * token of the prompt or output once, so applying penalties costs
     * O(distinct tokens), not O(vocab). */
    bool penalties_on;
    int32_t *out_count;  /* [vocab_size] occurrences in the output */
    uint8_t *seen_flags; /* [vocab_size] SEEN_* */
    int32_t *seen;
    int n_seen, cap_seen;

    /* logit_bias, sorted by id (0 entries: off) */
    int32_t *bias_ids;
    float *bias;
    int n_bias;

    /* Scratch for random draws and logprobs, allocated on first use. */
    int32_t *cand; /* [vocab_size] candidate token ids */
    float *weight; /* [vocab_size] exp(logit - max), indexed by token id */
    float *raw;    /* [vocab_size] the logits as passed in */
};

pd_sampling_params pd_sampling_defaults(void) {
    return (pd_sampling_params){
        .temperature = 1.0f,
        .top_k = -1,
        .top_p = 1.0f,
        .min_p = 0.0f,
        .presence_penalty = 0.0f,
        .frequency_penalty = 0.0f,
        .repetition_penalty = 1.0f,
        .seed = 0,
        .has_seed = false,
    };
}

/* Ranges as vLLM's SamplingParams._verify_args. NaN fails every check. */
static pd_status sampler_params_check(const pd_sampling_params *p, pd_err *err) {
    if (!(p->temperature >= 0.0f) || !isfinite(p->temperature))
        return pd_err_set(err, PD_ERR_INVALID, "temperature must be finite and >= 0, got %g",
                          p->temperature);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return pd_err_set(err, PD_ERR_INVALID, "top_p must be in (0, 1], got %g", p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return pd_err_set(err, PD_ERR_INVALID, "min_p must be in [0, 1], got %g", p->min_p);
    if (p->top_k < -1)
        return pd_err_set(err, PD_ERR_INVALID, "top_k must be -1 (off) or >= 0, got %d", p->top_k);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return pd_err_set(err, PD_ERR_INVALID, "presence_penalty must be in [-2, 2], got %g",
                          p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return pd_err_set(err, PD_ERR_INVALID, "frequency_penalty must be in [-2, 2], got %g",
                          p->frequency_penalty);
    if (!(p->repetition_penalty > 0.0f) || !isfinite(p->repetition_penalty))
        return pd_err_set(err, PD_ERR_INVALID, "repetition_penalty must be finite and > 0, got %g",
                          p->repetition_penalty);
    if (p->text_vocab_size < 0)
        return pd_err_set(err, PD_ERR_INVALID, "text_vocab_size must be >= 0, got %d", p->text_vocab_size);
    if (p->n_logit_bias < 0 || p->n_logit_bias > PD_MAX_LOGIT_BIAS ||
        (p->n_logit_bias > 0 && (!p->logit_bias_ids || !p->logit_bias)))
        return pd_err_set(err, PD_ERR_INVALID, "logit_bias: %d entries (at most %d, with both arrays)",
                          p->n_logit_bias, PD_MAX_LOGIT_BIAS);
    for (int i = 0; i < p->n_logit_bias; i++)
        if (!(p->logit_bias[i] >= -PD_MAX_LOGIT_BIAS_VALUE &&
              p->logit_bias[i] <= PD_MAX_LOGIT_BIAS_VALUE))
            return pd_err_set(err, PD_ERR_INVALID, "logit_bias: the bias of token %d must be in [%g, %g], got %g",
                              (int)p->logit_bias_ids[i], -PD_MAX_LOGIT_BIAS_VALUE,
                              PD_MAX_LOGIT_BIAS_VALUE, p->logit_bias[i]);
    return PD_OK;
}

/* Unseeded requests still get distinct streams: a process-wide counter, so
 * two samplers created in the same nanosecond differ, mixed with the clock
 * and the address of the sampler. pd_rng_seed runs this through splitmix64. */
static uint64_t sampler_entropy(const void *salt) {
    static atomic_uint_fast64_t counter;
    uint64_t n = atomic_fetch_add(&counter, 1);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t t = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    return t ^ (n * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)(uintptr_t)salt << 17);
}

/* Adds token to seen[] the first time it appears in prompt or output. */
static void sampler_note(pd_sampler *s, int32_t token, uint8_t flag) {
    if (!(s->seen_flags[token] & SEEN_LISTED)) {
        if (s->n_seen == s->cap_seen) {
            s->cap_seen = s->cap_seen ? 2 * s->cap_seen : 256;
            s->seen = realloc(s->seen, (size_t)s->cap_seen * sizeof *s->seen);
            PD_ASSERT(s->seen);
        }
        s->seen[s->n_seen++] = token;
        s->seen_flags[token] |= SEEN_LISTED;
    }
    s->seen_flags[token] |= flag;
}

typedef struct {
    int32_t id;
    float bias;
} bias_entry;

static int bias_entry_cmp(const void *a, const void *b) {
    int32_t x = ((const bias_entry *)a)->id, y = ((const bias_entry *)b)->id;
    return (x > y) - (x < y);
}

/* Copies p's logit_bias (already range-checked by sampler_params_check)
 * sorted by id, refusing ids outside the vocabulary and repeated ids. Sets
 * *ids_p / *bias_p (NULL when there are none) only on success. */
static pd_status sampler_bias_copy(const pd_sampling_params *p, int vocab_size, int32_t **ids_p,
                                   float **bias_p, pd_err *err) {
    int n = p->n_logit_bias;
    *ids_p = NULL;
    *bias_p = NULL;
    if (n == 0)
        return PD_OK;
    bias_entry *e = pd_xmalloc((size_t)n * sizeof *e);
    for (int i = 0; i < n; i++) {
        e[i].id = p->logit_bias_ids[i];
        e[i].bias = p->logit_bias[i];
        if (e[i].id < 0 || e[i].id >= vocab_size) {
            free(e);
            return pd_err_set(err, PD_ERR_INVALID,
                              "logit_bias: token id %d is outside the vocabulary [0, %d)",
                              (int)p->logit_bias_ids[i], vocab_size);
        }
    }
    qsort(e, (size_t)n, sizeof *e, bias_entry_cmp);
    for (int i = 1; i < n; i++) {
        if (e[i].id == e[i - 1].id) {
            int32_t id = e[i].id;
            free(e);
            return pd_err_set(err, PD_ERR_INVALID, "logit_bias: token id %d is listed twice",
                              (int)id);
        }
    }
    int32_t *ids = pd_xmalloc((size_t)n * sizeof *ids);
    float *bias = pd_xmalloc((size_t)n * sizeof *bias);
    for (int i = 0; i < n; i++) {
        ids[i] = e[i].id;
        bias[i] = e[i].bias;
    }
    free(e);
    *ids_p = ids;
    *bias_p = bias;
    return PD_OK;
}

pd_status pd_sampler_init(const pd_sampling_params *p, int vocab_size, const int32_t *prompt,
                          int n_prompt, pd_sampler **s_p, pd_err *err) {
    pd_status rc = sampler_params_check(p, err);
    if (rc != PD_OK)
        return rc;
    if (vocab_size <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "vocab_size must be > 0, got %d", vocab_size);
    if (n_prompt < 0 || (n_prompt > 0 && !prompt))
        return pd_err_set(err, PD_ERR_INVALID, "prompt: invalid length %d", n_prompt);
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= vocab_size)
            return pd_err_set(err, PD_ERR_INVALID, "prompt[%d] = %d outside the vocabulary [0, %d)",
                              i, (int)prompt[i], vocab_size);

    int32_t *bias_ids = NULL;
    float *bias = NULL;
    pd_status rc_bias = sampler_bias_copy(p, vocab_size, &bias_ids, &bias, err);
    if (rc_bias != PD_OK)
        return rc_bias;

    pd_sampler *s = pd_xcalloc(1, sizeof *s);
    s->p = *p;
    s->p.logit_bias_ids = NULL; /* borrowed by the caller; s keeps its own copy */
    s->p.logit_bias = NULL;
    s->bias_ids = bias_ids;
    s->bias = bias;
    s->n_bias = p->n_logit_bias;
    s->vocab_size = vocab_size;
    pd_rng_seed(&s->rng, p->has_seed ? p->seed : sampler_entropy(s));
    s->penalties_on = p->repetition_penalty != 1.0f || p->frequency_penalty != 0.0f ||
                      p->presence_penalty != 0.0f;
    if (s->penalties_on) {
        s->out_count = pd_xcalloc((size_t)vocab_size, sizeof *s->out_count);
        s->seen_flags = pd_xcalloc((size_t)vocab_size, sizeof *s->seen_flags);
        for (int i = 0; i < n_prompt; i++)
            sampler_note(s, prompt[i], SEEN_PROMPT);
    }
    *s_p = s;
    return PD_OK;
}

void pd_sampler_free(pd_sampler **s_p) {
    if (!s_p || !*s_p)
        return;
    pd_sampler *s = *s_p;
    free(s->bias_ids);
    free(s->bias);
    free(s->out_count);
    free(s->seen_flags);
    free(s->seen);
    free(s->cand);
    free(s->weight);
    free(s->raw);
    free(s);
    *s_p = NULL;
}

/* Tokens outside the vocabulary are ignored: the sampler never produces
 * one, and a peer's bad token must not corrupt the counts. */
void pd_sampler_accept(pd_sampler *s, int32_t token) {
    if (!s->penalties_on || token < 0 || token >= s->vocab_size)
        return;
    s->out_count[token]++;
    sampler_note(s, token, 0);
}

void pd_sampler_skip_draw(pd_sampler *s) {
    if (s->p.temperature >= SAMPLING_EPS)
        (void)pd_rng_uniform(&s->rng);
}

/* Step 0 of the file comment. A masked token (-inf) stays masked. */
static void sampler_apply_bias(const pd_sampler *s, float *logits) {
    for (int i = 0; i < s->n_bias; i++)
        logits[s->bias_ids[i]] += s->bias[i];
}

/* Steps 1 and 2 of the file comment. Every listed token is in the prompt or
 * the output, so each gets the repetition penalty. */
static void sampler_apply_penalties(const pd_sampler *s, float *logits) {
    const float rep = s->p.repetition_penalty;
    const float freq = s->p.frequency_penalty;
    const float pres = s->p.presence_penalty;
    for (int i = 0; i < s->n_seen; i++) {
        int32_t t = s->seen[i];
        float l = logits[t];
        if (rep != 1.0f)
            l = l > 0.0f ? l / rep : l * rep;
        int32_t count = s->out_count[t];
        if (count > 0) {
            l -= freq * (float)count;
            l -= pres;
        }
        logits[t] = l;
    }
}

/* Highest logit, ties to the lowest id; NaN never wins. */
static int32_t sampler_argmax(const float *logits, int n) {
    int32_t best = 0;
    float best_l = -INFINITY;
    for (int i = 0; i < n; i++) {
        if (logits[i] > best_l) {
            best_l = logits[i];
            best = i;
        }
    }
    return best;
}

/* The log-softmax normaliser of logits[0, n): max and log(sum exp(l - max)),
 * the sum in double, so that log softmax(l)[i] = l[i] - max - lse. Every
 * logprob the sampler reports goes through sampler_logprob with one
 * normaliser per call, so the sampled token's logprob and its entry among
 * the top logprobs are the same float. *max_p is -inf when every logit is. */
static void sampler_log_norm(const float *logits, int n, float *max_p, double *lse_p) {
    float max = -INFINITY;
    for (int i = 0; i < n; i++)
        if (logits[i] > max)
            max = logits[i];
    *max_p = max;
    *lse_p = 0.0;
    if (max == -INFINITY)
        return;
    double sum = 0.0;
    for (int i = 0; i < n; i++)
        sum += exp((double)logits[i] - max);
    *lse_p = log(sum);
}

static float sampler_logprob(float logit, float max, double lse) {
    if (max == -INFINITY)
        return -INFINITY;
    return (float)((double)logit - max - lse);
}

/* ---- candidate selection ------------------------------------------- */

/* The order candidates are ranked in: larger key first, then lower id. A
 * strict total order (ids are distinct), so selection is deterministic. */
static inline bool cand_before(const float *key, int32_t a, int32_t b) {
    return key[a] > key[b] || (key[a] == key[b] && a < b);
}

static inline void cand_swap(int32_t *c, int i, int j) {
    int32_t t = c[i];
    c[i] = c[j];
    c[j] = t;
}

/* Partitions c[lo, hi) (hi - lo >= 2) around a median-of-three pivot:
 * returns m with c[lo, m) ranked before c[m], c(m, hi) after it. */
static int cand_partition(int32_t *c, int lo, int hi, const float *key) {
    int mid = lo + (hi - lo) / 2, last = hi - 1;
    /* order c[lo], c[mid], c[last]; the median ends at last as the pivot */
    if (cand_before(key, c[mid], c[lo]))
        cand_swap(c, mid, lo);
    if (cand_before(key, c[last], c[lo]))
        cand_swap(c, last, lo);
    if (cand_before(key, c[mid], c[last]))
        cand_swap(c, mid, last);
    int32_t pivot = c[last];
    int store = lo;
    for (int i = lo; i < last; i++)
        if (cand_before(key, c[i], pivot))
            cand_swap(c, i, store++);
    cand_swap(c, store, last);
    return store;
}

/* Restores the heap order of c[0, n) below position i. The heap keeps the
 * worst candidate at the root: every node ranks after its children. */
static void cand_sift_down(int32_t *c, int n, int i, const float *key) {
    for (;;) {
        int worst = i, l = 2 * i + 1, r = l + 1;
        if (l < n && cand_before(key, c[worst], c[l]))
            worst = l;
        if (r < n && cand_before(key, c[worst], c[r]))
            worst = r;
        if (worst == i)
            return;
        cand_swap(c, i, worst);
        i = worst;
    }
}

/* Top-k over tokens 0 .. n-1 with a bounded heap: c[0, k) ends up holding
 * the k best (in heap order). Once the heap is warm most tokens cost one
 * comparison with its root; O(n log k) at worst. */
static void cand_top_k(int32_t *c, int n, int k, const float *key) {
    for (int i = 0; i < k; i++)
        c[i] = i;
    for (int i = k / 2 - 1; i >= 0; i--)
        cand_sift_down(c, k, i, key);
    for (int i = k; i < n; i++) {
        if (cand_before(key, i, c[0])) {
            c[0] = i;
            cand_sift_down(c, k, 0, key);
        }
    }
}

/* The k (<= PD_MAX_TOP_LOGPROBS) best tokens of logits[0, n) by
 * cand_before, best first: the bounded heap of cand_top_k (one comparison
 * per token once warm), then an insertion sort of the k survivors. (A NaN
 * logit has no rank; the model never gives one.) */
static void sampler_top_ids(const float *logits, int n, int k, int32_t *top) {
    cand_top_k(top, n, k, logits);
    for (int i = 1; i < k; i++) {
        int32_t t = top[i];
        int j = i;
        for (; j > 0 && cand_before(logits, t, top[j - 1]); j--)
            top[j] = top[j - 1];
        top[j] = t;
    }
}

/* Sum of the candidates' weights, in double. Four partial sums break the
 * chain of dependent additions (a third of the time at vocab size). */
static double cand_mass(const int32_t *c, int n, const float *weight) {
    double sum[4] = {0.0, 0.0, 0.0, 0.0};
    int i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++)
            sum[j] += weight[c[i + j]];
    for (; i < n; i++)
        sum[0] += weight[c[i]];
    return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

/* Exact top-p on a few candidates: the smallest count k such that the k best
 * of c[0, n) (by weight) hold at least need; reorders c so they come first.
 * The weighted form of quickselect: expected O(n), no sort. */
static int cand_top_p_exact(int32_t *c, int n, const float *weight, double need) {
    int lo = 0, hi = n;
    /* invariant: c[0, lo) are kept and hold all but need of the target mass;
     * the answer lies in [lo + 1, hi] */
    while (hi - lo > 1) {
        int m = cand_partition(c, lo, hi, weight);
        double above = 0.0;
        for (int i = lo; i < m; i++)
            above += weight[c[i]];
        if (above >= need) {
            hi = m;
        } else if (above + weight[c[m]] >= need) {
            return m + 1;
        } else {
            need -= above + weight[c[m]];
            lo = m + 1;
        }
    }
    return hi;
}

/* Weights lie in [0, 1]; the top 12 bits of a non-negative float (exponent
 * and 3 mantissa bits) order them coarsely, in 1017 buckets. */
#define WEIGHT_BUCKETS ((0x3f800000u >> 20) + 1)
static inline unsigned weight_bucket(float w) {
    uint32_t bits;
    memcpy(&bits, &w, 4);
    return bits >> 20;
}

/* Top-p: the smallest count k such that the k best candidates of c[0, n)
 * hold at least top_p of total; reorders c so they come first.
 *   1. mass per weight bucket (one pass, no branches);
 *   2. from the heaviest bucket down, the bucket b where the mass reaches
 *      top_p * total: every candidate above b is kept, every one below
 *      dropped;
 *   3. the candidates of b go through the exact selection for what is left.
 * Linear in n; only bucket b is ever partitioned. */
static int cand_top_p(int32_t *c, int n, const float *weight, double total, float top_p) {
    static_assert(WEIGHT_BUCKETS == 1017, "bucket count");
    double mass[WEIGHT_BUCKETS] = {0.0};
    for (int i = 0; i < n; i++)
        mass[weight_bucket(weight[c[i]])] += weight[c[i]];
    double need = (double)top_p * total, above = 0.0;
    unsigned b = WEIGHT_BUCKETS - 1;
    for (; b > 0 && above + mass[b] < need; b--)
        above += mass[b];

    int kept = 0; /* candidates of bucket b and above, compacted in place */
    for (int i = 0; i < n; i++) {
        c[kept] = c[i];
        kept += weight_bucket(weight[c[i]]) >= b;
    }
    int n_above = 0; /* those strictly above b first */
    for (int i = 0; i < kept; i++)
        if (weight_bucket(weight[c[i]]) > b)
            cand_swap(c, i, n_above++);
    if (n_above == kept) /* b reached 0 and is empty: rounding kept need out of reach */
        return kept;
    return n_above + cand_top_p_exact(c + n_above, kept - n_above, weight, need - above);
}

/* Min-p: keeps candidates whose probability is at least min_p times the
 * largest, i.e. weight >= min_p since the best has weight 1. Returns the
 * new count, the survivors first and in their order. */
static int cand_min_p(int32_t *c, int n, const float *weight, float min_p) {
    int kept = 0;
    for (int i = 0; i < n; i++) {
        c[kept] = c[i];
        kept += weight[c[i]] >= min_p;
    }
    return kept;
}

/* Step 4 of the file comment on penalised logits. */
static int32_t sampler_draw(pd_sampler *s, float *logits) {
    const int V = s->vocab_size;
    const pd_sampling_params *p = &s->p;
    if (!s->cand) {
        s->cand = pd_xmalloc((size_t)V * sizeof *s->cand);
        s->weight = pd_xmalloc((size_t)V * sizeof *s->weight);
    }
    int32_t *cand = s->cand;
    float *weight = s->weight;

    float max = -INFINITY; /* the best token survives every filter */
    for (int i = 0; i < V; i++) {
        float l = logits[i] / p->temperature;
        logits[i] = isnan(l) ? -INFINITY : l; /* a NaN would break the candidate order */
        max = l > max ? l : max;
    }
    if (!isfinite(max)) /* every token masked, or one at +inf: nothing to weigh */
        return sampler_argmax(logits, V);

    int n = V;
    if (p->top_k > 0 && p->top_k < V) {
        cand_top_k(cand, V, p->top_k, logits);
        n = p->top_k;
    } else {
        for (int i = 0; i < V; i++)
            cand[i] = i;
    }
    /* probabilities up to the normalisation, relative to the best */
    for (int i = 0; i < n; i++)
        weight[cand[i]] = expf(logits[cand[i]] - max);
    double total = cand_mass(cand, n, weight);
    if (p->top_p < 1.0f) {
        n = cand_top_p(cand, n, weight, total, p->top_p);
        total = cand_mass(cand, n, weight);
    }
    if (p->min_p > 0.0f) {
        n = cand_min_p(cand, n, weight, p->min_p);
        total = cand_mass(cand, n, weight);
    }

    /* inverse CDF over the survivors, in their (deterministic) order */
    double u = pd_rng_uniform(&s->rng) * total, cum = 0.0;
    int32_t token = -1;
    for (int i = 0; i < n; i++) {
        float w = weight[cand[i]];
        if (w <= 0.0f)
            continue;
        token = cand[i];
        cum += w;
        if (cum > u)
            break;
    }
    if (token < 0) /* all survivors underflowed: the best one */
        token = sampler_argmax(logits, V);

    /* leave the filtered tokens at -inf; weight[] is free to reuse now */
    if (n < V) {
        for (int i = 0; i < n; i++)
            weight[i] = logits[cand[i]];
        for (int i = 0; i < V; i++)
            logits[i] = -INFINITY;
        for (int i = 0; i < n; i++)
            logits[cand[i]] = weight[i];
    }
    return token;
}

int32_t pd_sampler_sample_top(pd_sampler *s, float *logits, float *logprob_p, int k,
                              int32_t *top_ids_p, float *top_logprobs_p, int *n_top_p) {
    const int V = s->vocab_size;
    if (k > PD_MAX_TOP_LOGPROBS)
        k = PD_MAX_TOP_LOGPROBS;
    if (k > V)
        k = V;
    if (k < 0 || !top_ids_p || !top_logprobs_p)
        k = 0;
    /* logprobs are of the logits as given: before logit_bias, penalties and temperature */
    float max = -INFINITY;
    double lse = 0.0;
    if (logprob_p || k > 0)
        sampler_log_norm(logits, V, &max, &lse);
    if (k > 0) {
        sampler_top_ids(logits, V, k, top_ids_p);
        for (int i = 0; i < k; i++)
            top_logprobs_p[i] = sampler_logprob(logits[top_ids_p[i]], max, lse);
    }
    if (n_top_p)
        *n_top_p = k;
    if (logprob_p) {
        if (!s->raw)
            s->raw = pd_xmalloc((size_t)V * sizeof *s->raw);
        memcpy(s->raw, logits, (size_t)V * sizeof *logits);
    }
    if (s->n_bias > 0)
        sampler_apply_bias(s, logits);
    if (s->penalties_on)
        sampler_apply_penalties(s, logits);
    /* ids with no text are never drawn (after the logprobs, as on the device) */
    for (int i = s->p.text_vocab_size > 0 ? s->p.text_vocab_size : V; i < V; i++)
        logits[i] = -INFINITY;

    int32_t token;
    if (s->p.temperature < SAMPLING_EPS)
        token = sampler_argmax(logits, V);
    else
        token = sampler_draw(s, logits);

    if (logprob_p)
        *logprob_p = sampler_logprob(s->raw[token], max, lse);
    pd_sampler_accept(s, token);
    return token;
}

int pd_logprobs_row(const float *logits, int vocab_size, int32_t token, float *logprob_p, int k,
                    int32_t *top_ids_p, float *top_logprobs_p) {
    if (k > PD_MAX_TOP_LOGPROBS)
        k = PD_MAX_TOP_LOGPROBS;
    if (k > vocab_size)
        k = vocab_size;
    if (k < 0 || !top_ids_p || !top_logprobs_p)
        k = 0;
    float max = -INFINITY;
    double lse = 0.0;
    sampler_log_norm(logits, vocab_size, &max, &lse);
    if (k > 0) {
        sampler_top_ids(logits, vocab_size, k, top_ids_p);
        for (int i = 0; i < k; i++)
            top_logprobs_p[i] = sampler_logprob(logits[top_ids_p[i]], max, lse);
    }
    if (logprob_p)
        *logprob_p = token >= 0 && token < vocab_size ? sampler_logprob(logits[token], max, lse) : -INFINITY;
    return k;
}

static_assert(PD_MAX_TOP_LOGPROBS == PD_SAMPLE_MAX_TOP, "the device sampler reports as many top logprobs");

/* The entry of token t among toks[base, *n) (linear: masks are few), else
 * a new zeroed one at the end. */
static pd_sample_tok *device_entry(pd_sample_tok *toks, int base, int *n, int32_t t) {
    for (int i = base; i < *n; i++)
        if (toks[i].id == t)
            return &toks[i];
    toks[*n] = (pd_sample_tok){.id = t};
    return &toks[(*n)++];
}

void pd_sampler_device_row(pd_sampler *s, const int32_t *masked, int n_masked, bool want_logprob,
                           int top_logprobs, pd_sample_row *row, pd_sample_tok **toks_p, int *n_toks_p,
                           int *cap_toks_p) {
    const pd_sampling_params *p = &s->p;
    int k = top_logprobs < 0 ? 0 : top_logprobs > PD_MAX_TOP_LOGPROBS ? PD_MAX_TOP_LOGPROBS : top_logprobs;
    int base = *n_toks_p;
    int need = base + s->n_bias + (s->penalties_on ? s->n_seen : 0) + (n_masked > 0 ? n_masked : 0);
    if (need > *cap_toks_p) {
        int cap = *cap_toks_p ? *cap_toks_p : 256;
        while (cap < need)
            cap *= 2;
        *toks_p = realloc(*toks_p, (size_t)cap * sizeof **toks_p);
        PD_ASSERT(*toks_p);
        *cap_toks_p = cap;
    }
    pd_sample_tok *toks = *toks_p;
    int n = base;
    /* logit_bias first: its ids are sorted, so a penalised token finds its
     * entry by binary search */
    for (int i = 0; i < s->n_bias; i++)
        toks[n++] = (pd_sample_tok){.id = s->bias_ids[i], .bias = s->bias[i]};
    for (int i = 0; s->penalties_on && i < s->n_seen; i++) {
        int32_t t = s->seen[i];
        int lo = 0, hi = s->n_bias;
        while (lo < hi) {
            int mid = lo + (hi - lo) / 2;
            if (s->bias_ids[mid] < t)
                lo = mid + 1;
            else
                hi = mid;
        }
        pd_sample_tok *e;
        if (lo < s->n_bias && s->bias_ids[lo] == t) {
            e = &toks[base + lo];
        } else {
            e = &toks[n++];
            *e = (pd_sample_tok){.id = t};
        }
        e->flags |= PD_SAMPLE_SEEN;
        e->count = s->out_count[t];
    }
    for (int i = 0; i < n_masked; i++)
        if (masked[i] >= 0 && masked[i] < s->vocab_size)
            device_entry(toks, base, &n, masked[i])->flags |= PD_SAMPLE_MASKED;
    *n_toks_p = n;
    *row = (pd_sample_row){
        .row = row->row, .temperature = p->temperature, .top_k = p->top_k, .top_p = p->top_p,
        .min_p = p->min_p, .repetition_penalty = p->repetition_penalty,
        .frequency_penalty = p->frequency_penalty, .presence_penalty = p->presence_penalty,
        .u = p->temperature < SAMPLING_EPS ? 0.0 : pd_rng_uniform(&s->rng), .n_top = k,
        .want_logprob = want_logprob ? 1 : 0, .tok_off = base, .n_tok = n - base,
        .n_vocab = p->text_vocab_size,
    };
}

int32_t pd_sampler_sample(pd_sampler *s, float *logits, float *logprob_p) {
    return pd_sampler_sample_top(s, logits, logprob_p, 0, NULL, NULL, NULL);
}

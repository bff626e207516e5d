/* The continuous-batching scheduler: batching, chunking, preemption and
 * the prefill-replica route must not change what a request generates. The
 * reference is a plain one-sequence prefill + decode loop over the model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "pd_decode.h"
#include "pd_tokenizer.h"

#define MAXREQ 16
#define MAXTOK 64

static pd_backend *g_be;
static pd_model *g_m;

typedef struct {
    char id[32];
    int32_t out[MAXTOK];
    float lp[MAXTOK];
    int32_t top_id[MAXTOK][PD_MAX_TOP_LOGPROBS];
    float top_lp[MAXTOK][PD_MAX_TOP_LOGPROBS];
    int n_top[MAXTOK];
    int n_out;
    char finish[16];
    bool errored;
    /* prompt logprobs (on_prompt_logprobs), by prompt position */
    float plp[MAXTOK];
    int32_t plp_tid[MAXTOK][PD_MAX_TOP_LOGPROBS];
    float plp_tlp[MAXTOK][PD_MAX_TOP_LOGPROBS];
    int plp_seen[MAXTOK]; /* times each position was reported */
    int plp_k;
    bool plp_late; /* one came after a generated token */
} req_out;

typedef struct {
    req_out r[MAXREQ];
    int n;
} outputs;

static req_out *lookup(outputs *o, const char *id) {
    for (int i = 0; i < o->n; i++)
        if (!strcmp(o->r[i].id, id)) return &o->r[i];
    fail_msg("unknown id %s", id);
    return NULL;
}
static void on_token(void *u, const char *id, int32_t t, float lp, const int32_t *top_ids, const float *top_lps,
                     int n_top) {
    req_out *r = lookup(u, id);
    assert_true(r->n_out < MAXTOK);
    assert_true(r->finish[0] == 0);
    assert_true(n_top >= 0 && n_top <= PD_MAX_TOP_LOGPROBS);
    r->lp[r->n_out] = lp;
    r->n_top[r->n_out] = n_top;
    if (n_top > 0) {
        memcpy(r->top_id[r->n_out], top_ids, (size_t)n_top * sizeof *top_ids);
        memcpy(r->top_lp[r->n_out], top_lps, (size_t)n_top * sizeof *top_lps);
    }
    r->out[r->n_out++] = t;
}
static void on_finished(void *u, const char *id, const char *reason) {
    snprintf(lookup(u, id)->finish, 16, "%s", reason);
}
static void on_error(void *u, const char *id, const char *msg) {
    lookup(u, id)->errored = true;
}
static void on_prompt_logprobs(void *u, const char *id, int first, int n, const float *lps, const int32_t *top_ids,
                               const float *top_lps, int k) {
    req_out *r = lookup(u, id);
    assert_true(first >= 1 && n >= 1 && first + n <= MAXTOK);
    assert_true(k >= 0 && k <= PD_MAX_TOP_LOGPROBS);
    if (r->n_out > 0) r->plp_late = true;
    r->plp_k = k;
    for (int i = 0; i < n; i++) {
        r->plp[first + i] = lps[i];
        r->plp_seen[first + i]++;
        if (k > 0) {
            memcpy(r->plp_tid[first + i], top_ids + (size_t)i * k, (size_t)k * sizeof *top_ids);
            memcpy(r->plp_tlp[first + i], top_lps + (size_t)i * k, (size_t)k * sizeof *top_lps);
        }
    }
}
static const pd_sched_callbacks cbs = {on_token, on_finished, on_error, on_prompt_logprobs};

static int setup(void **state) {
    const char *bd = getenv("PD_BUILD_DIR");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/test-models-sched", bd ? bd : ".");
    mkdir(dir, 0755);
    strcat(dir, "/tiny");
    pd_err err = {{0}};
    char cfgp[4200];
    snprintf(cfgp, sizeof cfgp, "%s/config.json", dir);
    struct stat sb;
    if (stat(cfgp, &sb) != 0) {
        pd_model_config c;
        assert_int_equal(pd_preset_config("tiny", &c, &err), PD_OK);
        assert_int_equal(pd_mkmodel_write(&c, 1, dir, 0, NULL, &err), PD_OK);
    }
    assert_int_equal(pd_backend_cpu_init(1, &g_be), PD_OK);
    if (pd_model_load(dir, g_be, &g_m, &err) != PD_OK) fail_msg("%s", err.msg);
    const char *dev = getenv("PD_SAMPLE_ON_DEVICE");
    if (dev && !strcmp(dev, "1") && !pd_model_samples_on_device(g_m)) /* test_sched_device_sampling */
        fail_msg("PD_SAMPLE_ON_DEVICE=1, but the model does not sample through sample_rows");
    return 0;
}
static int teardown(void **state) {
    pd_model_free(&g_m);
    pd_backend_free(&g_be);
    return 0;
}

static void make_prompt(int32_t *p, int n, uint64_t seed) {
    pd_rng r;
    pd_rng_seed(&r, seed);
    for (int i = 0; i < n; i++) p[i] = 3 + (int32_t)(pd_rng_next(&r) % 120000);
}

/* One step of the reference: the forward pass, then the next token drawn
 * the way the scheduler draws it: through sample_rows where the model
 * samples on the device (PD_SAMPLE_ON_DEVICE=1 runs this file on the CPU
 * backend's reference op), else by the host sampler. */
static int32_t ref_step(pd_kv_cache *kv, pd_batch_seq *b, pd_sampler *smp, float *lg) {
    pd_err err = {{0}};
    if (!pd_model_samples_on_device(g_m)) {
        assert_int_equal(pd_model_forward(g_m, kv, b, 1, lg, &err), PD_OK);
        return pd_sampler_sample(smp, lg, NULL);
    }
    pd_sample_tok *toks = NULL;
    int n_toks = 0, cap = 0;
    pd_sample_row row = {.row = 0};
    pd_sample_out so;
    pd_sampler_device_row(smp, NULL, 0, false, 0, &row, &toks, &n_toks, &cap);
    pd_fwd_out o = {.logits = lg, .download_row = (const uint8_t[]){0}, .n_sample = 1, .sample = &row,
                    .toks = toks, .n_toks = n_toks, .sampled = &so};
    if (b->all_logits) fail_msg("ref_step: one row only");
    assert_int_equal(pd_model_forward_ex(g_m, kv, b, 1, &o, &err), PD_OK);
    pd_sampler_accept(smp, so.token);
    free(toks);
    return so.token;
}

/* one sequence alone, no scheduler: prefill then decode */
static int reference(const int32_t *prompt, int n, const pd_sampling_params *sp, int max_tokens, int32_t *out) {
    pd_err err = {{0}};
    pd_kv_cache *kv;
    assert_int_equal(pd_kv_cache_init(g_m, 16, (n + max_tokens) / 16 + 2, &kv, &err), PD_OK);
    pd_sampler *smp;
    int V = pd_model_config_of(g_m)->vocab_size;
    assert_int_equal(pd_sampler_init(sp, V, prompt, n, &smp, &err), PD_OK);
    float *lg = malloc((size_t)V * sizeof(float));
    pd_seq_kv s = {0};
    assert_int_equal(pd_seq_kv_reserve(kv, &s, n), PD_OK);
    pd_batch_seq b = {.kv = &s, .tokens = prompt, .n_tokens = n};
    int32_t next = ref_step(kv, &b, smp, lg);
    int k = 0;
    for (; k < max_tokens; k++) {
        out[k] = next;
        if (out[k] == pd_model_config_of(g_m)->eos_token_id) { k++; break; }
        if (k + 1 == max_tokens) { k++; break; }
        assert_int_equal(pd_seq_kv_reserve(kv, &s, 1), PD_OK);
        pd_batch_seq d = {.kv = &s, .tokens = &out[k], .n_tokens = 1};
        next = ref_step(kv, &d, smp, lg);
    }
    pd_seq_kv_release(kv, &s);
    free(s.block_table);
    free(lg);
    pd_sampler_free(&smp);
    pd_kv_cache_free(&kv);
    return k;
}

static void run_mix(const pd_sched_config *cfg, bool sampled) {
    outputs o = {0};
    pd_sched *s;
    pd_err err = {{0}};
    assert_int_equal(pd_sched_init(g_m, cfg, &cbs, &o, &s, &err), PD_OK);
    int lens[] = {1, 5, 17, 40, 3, 64, 9, 23};
    int n = 8, max_tokens = 12;
    int32_t prompts[8][64];
    pd_sampling_params sp = pd_sampling_defaults();
    sp.temperature = sampled ? 0.9f : 0.0f;
    for (int i = 0; i < n; i++) {
        make_prompt(prompts[i], lens[i], 100 + i);
        snprintf(o.r[i].id, 32, "req-%d", i);
        o.n++;
        sp.seed = 1000 + i;
        sp.has_seed = sampled;
        pd_sched_request r = {.request_id = o.r[i].id, .prompt_ids = prompts[i], .n_prompt = lens[i],
                              .sampling = sp, .max_tokens = max_tokens, .ignore_eos = true};
        assert_int_equal(pd_sched_add(s, &r, &err), PD_OK);
    }
    for (int guard = 0; guard < 10000; guard++)
        if (pd_sched_step(s) == 0) break;
    for (int i = 0; i < n; i++) {
        int32_t ref[64];
        sp.seed = 1000 + i;
        sp.has_seed = sampled;
        int k = reference(prompts[i], lens[i], &sp, max_tokens, ref);
        assert_false(o.r[i].errored);
        assert_int_equal(o.r[i].n_out, max_tokens);
        assert_int_equal(k, max_tokens);
        assert_memory_equal(o.r[i].out, ref, (size_t)k * sizeof(int32_t));
        assert_string_equal(o.r[i].finish, "length");
    }
    pd_sched_stats st;
    pd_sched_get_stats(s, &st);
    assert_int_equal(st.free_blocks, cfg->num_blocks);
    assert_int_equal(st.num_running + st.num_waiting, 0);
    pd_sched_free(&s);
}

static void test_batched_greedy_equals_alone(void **state) {
    pd_sched_config cfg = {.max_num_seqs = 8, .max_num_batched_tokens = 32, .chunked_prefill_size = 16,
                           .block_size = 4, .num_blocks = 256};
    run_mix(&cfg, false);
}

static void test_seeded_sampling_is_batch_invariant(void **state) {
    pd_sched_config cfg = {.max_num_seqs = 3, .max_num_batched_tokens = 20, .chunked_prefill_size = 7,
                           .block_size = 8, .num_blocks = 128};
    run_mix(&cfg, true);
}

/* Too few blocks for everyone at once: preemption and recompute must not
 * change outputs, and all blocks come back. */
static void test_preemption(void **state) {
    pd_sched_config cfg = {.max_num_seqs = 8, .max_num_batched_tokens = 64, .chunked_prefill_size = 64,
                           .block_size = 4, .num_blocks = 24};
    run_mix(&cfg, false);
}

/* The same with chunks smaller than the prompts: sequences that wait with
 * part of their prefill (new ones, and preempted ones recomputing) hold KV
 * that a running sequence or the head of the queue needs; they give it
 * back instead of every sequence waiting on the others for good. */
static void test_preemption_partial_prefills(void **state) {
    pd_sched_config cfg = {.max_num_seqs = 6, .max_num_batched_tokens = 24, .chunked_prefill_size = 8,
                           .block_size = 4, .num_blocks = 24};
    run_mix(&cfg, false);
    cfg.num_blocks = 20; /* the largest request (64 + 12 tokens) just fits */
    run_mix(&cfg, false);
}

/* The long route: KV computed elsewhere (here: a second cache, copied block
 * by block as kvtransfer would), reservation, then decode. */
static void test_reserved_prefilled(void **state) {
    outputs o = {0};
    pd_sched *s;
    pd_err err = {{0}};
    pd_sched_config cfg = {.max_num_seqs = 4, .max_num_batched_tokens = 64, .chunked_prefill_size = 64,
                           .block_size = 4, .num_blocks = 64};
    assert_int_equal(pd_sched_init(g_m, &cfg, &cbs, &o, &s, &err), PD_OK);
    int n = 19, max_tokens = 6;
    int32_t prompt[19];
    make_prompt(prompt, n, 5);
    snprintf(o.r[0].id, 32, "long-0");
    o.n = 1;
    int32_t *blocks;
    int nblk;
    assert_int_equal(pd_sched_alloc_blocks(s, n, &blocks, &nblk, &err), PD_OK);
    assert_int_equal(nblk, (n + 1 + 3) / 4);
    /* "prefill replica" */
    pd_kv_cache *pkv;
    assert_int_equal(pd_kv_cache_init(g_m, 4, 16, &pkv, &err), PD_OK);
    pd_seq_kv ps = {0};
    int V = pd_model_config_of(g_m)->vocab_size;
    float *lg = malloc((size_t)V * sizeof(float));
    assert_int_equal(pd_seq_kv_reserve(pkv, &ps, n), PD_OK);
    pd_batch_seq b = {.kv = &ps, .tokens = prompt, .n_tokens = n};
    assert_int_equal(pd_model_forward(g_m, pkv, &b, 1, lg, &err), PD_OK);
    int first = 0;
    for (int i = 1; i < V; i++) if (lg[i] > lg[first]) first = i;
    for (int i = 0; i < ps.num_blocks; i++)
        memcpy(pd_kv_cache_block_ptr(pd_sched_kv(s), (int)blocks[i]), pd_kv_cache_block_ptr(pkv, ps.block_table[i]),
               pd_kv_cache_block_bytes(pkv));
    pd_sampling_params sp = pd_sampling_defaults();
    sp.temperature = 0;
    pd_sched_request r = {.request_id = "long-0", .prompt_ids = prompt, .n_prompt = n, .sampling = sp,
                          .max_tokens = max_tokens, .ignore_eos = true};
    assert_int_equal(pd_sched_add_prefilled(s, &r, blocks, nblk, first, 0, &err), PD_OK);
    for (int g = 0; g < 1000 && pd_sched_step(s) > 0; g++) {}
    int32_t ref[16];
    reference(prompt, n, &sp, max_tokens, ref);
    assert_int_equal(ref[0], first);
    assert_int_equal(o.r[0].n_out, max_tokens - 1); /* the first came from the prefill side */
    assert_memory_equal(o.r[0].out, ref + 1, (size_t)(max_tokens - 1) * sizeof(int32_t));
    pd_sched_stats st;
    pd_sched_get_stats(s, &st);
    assert_int_equal(st.prefill_tokens_total, 0); /* decode did not prefill it again */
    assert_int_equal(st.free_blocks, cfg.num_blocks);
    pd_seq_kv_release(pkv, &ps);
    free(ps.block_table);
    pd_kv_cache_free(&pkv);
    free(lg);
    free(blocks);
    pd_sched_free(&s);
}

static void test_abort_frees_blocks(void **state) {
    outputs o = {0};
    pd_sched *s;
    pd_err err = {{0}};
    pd_sched_config cfg = {.max_num_seqs = 4, .max_num_batched_tokens = 8, .chunked_prefill_size = 8,
                           .block_size = 4, .num_blocks = 64};
    assert_int_equal(pd_sched_init(g_m, &cfg, &cbs, &o, &s, &err), PD_OK);
    int32_t prompt[30];
    make_prompt(prompt, 30, 9);
    snprintf(o.r[0].id, 32, "a");
    o.n = 1;
    pd_sampling_params sp = pd_sampling_defaults();
    pd_sched_request r = {.request_id = "a", .prompt_ids = prompt, .n_prompt = 30, .sampling = sp, .max_tokens = 50};
    assert_int_equal(pd_sched_add(s, &r, &err), PD_OK);
    assert_int_equal(pd_sched_add(s, &r, &err), PD_ERR_INVALID); /* duplicate id */
    pd_sched_step(s);
    pd_sched_step(s);
    int32_t *blocks;
    int nblk;
    assert_int_equal(pd_sched_alloc_blocks(s, 10, &blocks, &nblk, &err), PD_OK);
    assert_true(pd_kv_cache_num_free(pd_sched_kv(s)) < 64);
    assert_true(pd_sched_abort(s, "a"));
    pd_sched_free_blocks(s, blocks, nblk);
    free(blocks);
    assert_false(pd_sched_abort(s, "a"));
    assert_int_equal(pd_kv_cache_num_free(pd_sched_kv(s)), 64);
    assert_int_equal(pd_sched_step(s), 0);
    /* too long to ever fit */
    pd_sched_request big = {.request_id = "big", .prompt_ids = prompt, .n_prompt = 30, .sampling = sp,
                            .max_tokens = 900};
    assert_int_equal(pd_sched_add(s, &big, &err), PD_ERR_LIMIT);
    assert_int_equal(pd_sched_alloc_blocks(s, 1000, &blocks, &nblk, &err), PD_ERR_LIMIT);
    pd_sched_free(&s);
}

/* ---- top logprobs ---------------------------------------------------- */

static const float *g_key;
static int rank_cmp(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (g_key[x] != g_key[y]) return g_key[x] > g_key[y] ? -1 : 1;
    return x < y ? -1 : 1;
}

/* Independent of the sampler: a full sort of the vocabulary and a
 * log-softmax in double, checked against what the scheduler reported for
 * step k of r (which is the model's logits lg). */
static void check_top(const req_out *r, int k, const float *lg, int V, int32_t *order, int want_n) {
    assert_int_equal(r->n_top[k], want_n);
    double max = -INFINITY, sum = 0.0;
    for (int i = 0; i < V; i++) max = fmax(max, lg[i]);
    for (int i = 0; i < V; i++) sum += exp((double)lg[i] - max);
    for (int i = 0; i < V; i++) order[i] = i;
    g_key = lg;
    qsort(order, (size_t)V, sizeof *order, rank_cmp);
    double lse = max + log(sum);
    double want_lp = (double)lg[r->out[k]] - lse;
    if (fabs(r->lp[k] - want_lp) > 1e-5) fail_msg("%s step %d: logprob %.7g, want %.7g", r->id, k, r->lp[k], want_lp);
    for (int j = 0; j < want_n; j++) {
        if (r->top_id[k][j] != order[j])
            fail_msg("%s step %d: top[%d] = %d, want %d", r->id, k, j, r->top_id[k][j], order[j]);
        double want = (double)lg[order[j]] - lse;
        if (fabs(r->top_lp[k][j] - want) > 1e-5)
            fail_msg("%s step %d: top[%d] logprob %.7g, want %.7g", r->id, k, j, r->top_lp[k][j], want);
        assert_true(r->top_lp[k][j] <= 0.0f);
        if (j > 0) assert_true(r->top_lp[k][j] <= r->top_lp[k][j - 1]);
        if (r->top_id[k][j] == r->out[k]) assert_true(r->top_lp[k][j] == r->lp[k]); /* the same float */
    }
}

/* One request alone through the scheduler, then the same sequence through
 * the model by hand (feeding the tokens the scheduler chose): every step's
 * top-k against check_top. Sampled with penalties, the top-k stay those of
 * the raw logits. */
static void run_top_alone(const pd_sampling_params *sp, int k, int n, uint64_t prompt_seed) {
    static outputs o;
    memset(&o, 0, sizeof o);
    pd_sched *s;
    pd_err err = {{0}};
    pd_sched_config cfg = {.max_num_seqs = 4, .max_num_batched_tokens = 64, .chunked_prefill_size = 64,
                           .block_size = 4, .num_blocks = 64};
    assert_int_equal(pd_sched_init(g_m, &cfg, &cbs, &o, &s, &err), PD_OK);
    int32_t prompt[64];
    make_prompt(prompt, n, prompt_seed);
    snprintf(o.r[0].id, 32, "top-%d", k);
    o.n = 1;
    int max_tokens = 6;
    pd_sched_request r = {.request_id = o.r[0].id, .prompt_ids = prompt, .n_prompt = n, .sampling = *sp,
                          .max_tokens = max_tokens, .ignore_eos = true, .want_logprobs = true, .top_logprobs = k};
    assert_int_equal(pd_sched_add(s, &r, &err), PD_OK);
    for (int g = 0; g < 1000 && pd_sched_step(s) > 0; g++) {}
    const req_out *ro = &o.r[0];
    assert_int_equal(ro->n_out, max_tokens);

    int V = pd_model_config_of(g_m)->vocab_size;
    float *lg = malloc((size_t)V * sizeof(float));
    int32_t *order = malloc((size_t)V * sizeof(int32_t));
    pd_kv_cache *kv;
    assert_int_equal(pd_kv_cache_init(g_m, 4, 32, &kv, &err), PD_OK);
    pd_seq_kv sq = {0};
    assert_int_equal(pd_seq_kv_reserve(kv, &sq, n), PD_OK);
    pd_batch_seq b = {.kv = &sq, .tokens = prompt, .n_tokens = n};
    assert_int_equal(pd_model_forward(g_m, kv, &b, 1, lg, &err), PD_OK);
    for (int step = 0; step < max_tokens; step++) {
        check_top(ro, step, lg, V, order, k);
        if (sp->temperature == 0 && sp->repetition_penalty == 1.0f && k > 0) {
            assert_int_equal(ro->out[step], ro->top_id[step][0]); /* greedy: the sampled token is top-1 */
            assert_true(ro->lp[step] == ro->top_lp[step][0]);
        }
        if (step + 1 == max_tokens) break;
        assert_int_equal(pd_seq_kv_reserve(kv, &sq, 1), PD_OK);
        pd_batch_seq d = {.kv = &sq, .tokens = &ro->out[step], .n_tokens = 1};
        assert_int_equal(pd_model_forward(g_m, kv, &d, 1, lg, &err), PD_OK);
    }
    pd_seq_kv_release(kv, &sq);
    free(sq.block_table);
    pd_kv_cache_free(&kv);
    free(order);
    free(lg);
    pd_sched_free(&s);
}

static void test_top_logprobs_greedy(void **state) {
    pd_sampling_params sp = pd_sampling_defaults();
    sp.temperature = 0;
    run_top_alone(&sp, 5, 11, 31);
    run_top_alone(&sp, PD_MAX_TOP_LOGPROBS, 3, 32);
}

static void test_top_logprobs_raw_under_penalties(void **state) {
    pd_sampling_params sp = pd_sampling_defaults();
    sp.temperature = 0.8f;
    sp.repetition_penalty = 1.5f;
    sp.presence_penalty = 1.0f;
    sp.seed = 77;
    sp.has_seed = true;
    run_top_alone(&sp, 7, 9, 33);
}

/* Mixed in one batch: each request gets what it asked for (nothing, the
 * sampled logprob only, k alternatives), and the batch's tokens are those
 * of requests without logprobs. */
static void test_top_logprobs_batched(void **state) {
    static outputs o;
    memset(&o, 0, sizeof o);
    pd_sched *s;
    pd_err err = {{0}};
    pd_sched_config cfg = {.max_num_seqs = 8, .max_num_batched_tokens = 24, .chunked_prefill_size = 8,
                           .block_size = 4, .num_blocks = 128};
    assert_int_equal(pd_sched_init(g_m, &cfg, &cbs, &o, &s, &err), PD_OK);
    static const struct { bool want; int k; } asks[] = {{false, 0}, {true, 0}, {true, 1}, {true, 3}, {true, 20}};
    int n = 5, max_tokens = 5;
    int32_t prompts[5][20];
    pd_sampling_params sp = pd_sampling_defaults();
    sp.temperature = 0;
    for (int i = 0; i < n; i++) {
        make_prompt(prompts[i], 6 + 3 * i, 200 + i);
        snprintf(o.r[i].id, 32, "mix-%d", i);
        o.n++;
        pd_sched_request r = {.request_id = o.r[i].id, .prompt_ids = prompts[i], .n_prompt = 6 + 3 * i,
                              .sampling = sp, .max_tokens = max_tokens, .ignore_eos = true,
                              .want_logprobs = asks[i].want, .top_logprobs = asks[i].k};
        assert_int_equal(pd_sched_add(s, &r, &err), PD_OK);
    }
    pd_sched_request bad = {.request_id = "bad", .prompt_ids = prompts[0], .n_prompt = 3, .sampling = sp,
                            .max_tokens = 2, .want_logprobs = true, .top_logprobs = PD_MAX_TOP_LOGPROBS + 1};
    assert_int_equal(pd_sched_add(s, &bad, &err), PD_ERR_INVALID);
    bad.top_logprobs = -1;
    assert_int_equal(pd_sched_add(s, &bad, &err), PD_ERR_INVALID);
    for (int g = 0; g < 1000 && pd_sched_step(s) > 0; g++) {}
    for (int i = 0; i < n; i++) {
        const req_out *r = &o.r[i];
        assert_int_equal(r->n_out, max_tokens);
        int32_t ref[16];
        reference(prompts[i], 6 + 3 * i, &sp, max_tokens, ref);
        assert_memory_equal(r->out, ref, (size_t)max_tokens * sizeof(int32_t));
        for (int k = 0; k < max_tokens; k++) {
            assert_int_equal(r->n_top[k], asks[i].k);
            if (!asks[i].want) assert_true(r->lp[k] == 0.0f);
            else assert_true(r->lp[k] <= 0.0f);
            if (asks[i].k > 0) {
                assert_int_equal(r->top_id[k][0], r->out[k]);
                assert_true(r->top_lp[k][0] == r->lp[k]);
            }
            for (int j = 1; j < r->n_top[k]; j++) {
                assert_true(r->top_lp[k][j] <= r->top_lp[k][j - 1]);
                assert_true(r->top_id[k][j] != r->top_id[k][j - 1]);
            }
        }
    }
    pd_sched_free(&s);
}

/* response_format: constrained sequences batched together (their masks run
 * in parallel) generate what each generates alone, every output is complete
 * JSON, ended "stop" within max_tokens by the grammar's budget; a schema
 * without a vocabulary, or one that does not compile, is refused. */
static void run_constrained(pd_grammar_vocab *v, const int *which, int n, outputs *o) {
    static const char *const schemas[] = {
        PD_GRAMMAR_JSON_OBJECT,
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":6},"
        "\"n\":{\"type\":\"integer\"},\"ok\":{\"type\":\"boolean\"}},\"required\":[\"name\",\"ok\"]}",
        "{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"bb\",3]},\"minItems\":2}",
    };
    pd_sched *s;
    pd_err err = {{0}};
    pd_sched_config cfg = {.max_num_seqs = 8, .max_num_batched_tokens = 64, .chunked_prefill_size = 16,
                           .block_size = 4, .num_blocks = 256};
    assert_int_equal(pd_sched_init(g_m, &cfg, &cbs, o, &s, &err), PD_OK);
    pd_sched_set_grammar_vocab(s, v);
    for (int k = 0; k < n; k++) {
        int i = which[k];
        int32_t prompt[12];
        make_prompt(prompt, 5 + i, 300 + i);
        snprintf(o->r[o->n].id, 32, "json-%d", i);
        pd_sampling_params sp = pd_sampling_defaults();
        sp.temperature = i % 2 ? 1.0f : 0.0f;
        sp.seed = 77 + i;
        sp.has_seed = true;
        pd_sched_request r = {.request_id = o->r[o->n].id, .prompt_ids = prompt, .n_prompt = 5 + i,
                              .sampling = sp, .max_tokens = 20, .json_schema = schemas[i % 3]};
        o->n++;
        assert_int_equal(pd_sched_add(s, &r, &err), PD_OK);
    }
    for (int g = 0; g < 1000 && pd_sched_step(s) > 0; g++) {}
    pd_sched_free(&s);
}

static void test_constrained_batch(void **state) {
    const char *cache = getenv("PD_CACHE_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer-deepseek_v3/tokenizer.json", cache && *cache ? cache : PD_SOURCE_DIR "/.cache");
    pd_err err = {{0}};
    pd_tokenizer *tok = NULL;
    if (pd_tok_load(path, &tok, &err) != PD_OK) fail_msg("%s", err.msg);
    const pd_model_config *c = pd_model_config_of(g_m);
    pd_grammar_vocab *v = NULL;
    assert_int_equal(pd_grammar_vocab_init(tok, c->vocab_size, c->eos_token_id, &v, &err), PD_OK);

    static outputs all, one;
    memset(&all, 0, sizeof all);
    int which[6] = {0, 1, 2, 3, 4, 5};
    run_constrained(v, which, 6, &all);
    for (int i = 0; i < 6; i++) {
        memset(&one, 0, sizeof one);
        run_constrained(v, &which[i], 1, &one);
        const req_out *a = &all.r[i], *b = &one.r[0];
        assert_false(a->errored);
        assert_int_equal(a->n_out, b->n_out);
        assert_memory_equal(a->out, b->out, (size_t)a->n_out * sizeof(int32_t));
        assert_string_equal(a->finish, "stop");
        assert_true(a->n_out <= 20);
        char *text = NULL;
        size_t len = 0;
        int n = a->n_out;
        if (n > 0 && a->out[n - 1] == c->eos_token_id) n--;
        assert_int_equal(pd_tok_decode(tok, a->out, (size_t)n, true, &text, &len, &err), PD_OK);
        json_error_t je;
        json_t *j = json_loadb(text, len, JSON_DECODE_ANY, &je);
        if (!j) fail_msg("request %d: %s: %s", i, je.text, text);
        json_decref(j);
        free(text);
    }

    /* refusals */
    pd_sched *s;
    outputs o = {0};
    pd_sched_config cfg = {.max_num_seqs = 2, .max_num_batched_tokens = 16, .chunked_prefill_size = 8,
                           .block_size = 4, .num_blocks = 32};
    assert_int_equal(pd_sched_init(g_m, &cfg, &cbs, &o, &s, &err), PD_OK);
    int32_t prompt[3] = {5, 6, 7};
    pd_sched_request r = {.request_id = "x", .prompt_ids = prompt, .n_prompt = 3, .sampling = pd_sampling_defaults(),
                          .max_tokens = 4, .json_schema = PD_GRAMMAR_JSON_OBJECT};
    /* no vocab: the replica's failure, not the request's (500, not 400) */
    assert_int_equal(pd_sched_add(s, &r, &err), PD_ERR_IO);
    pd_sched_set_grammar_vocab(s, v);
    r.json_schema = "{\"type\":\"string\",\"pattern\":\"a\"}";
    assert_int_equal(pd_sched_add(s, &r, &err), PD_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "pattern"));
    pd_sched_free(&s);
    pd_grammar_vocab_free(&v);
    pd_tok_free(&tok);
}

/* Prompt logprobs: whatever the chunking, batching and preemption, every
 * prompt position from 1 on is reported once, before the first token, and
 * equals log_softmax of the logits after the position before it, from an
 * independent reference (the whole prompt in one forward with every row's
 * logits, log softmax in double here); the top alternatives are the
 * reference's best, sorted, and hold the token's own logprob when it ranks
 * among them. Generation is unchanged (greedy equals the plain loop). */
static void run_prompt_logprobs(const pd_sched_config *cfg) {
    outputs o = {0};
    pd_sched *s;
    pd_err err = {{0}};
    assert_int_equal(pd_sched_init(g_m, cfg, &cbs, &o, &s, &err), PD_OK);
    const int V = pd_model_config_of(g_m)->vocab_size;
    int lens[] = {1, 2, 17, 40, 9, 63};
    int ks[] = {3, 0, 5, 20, 1, 2};
    bool want[] = {true, true, true, true, false, true};
    int n = 6, max_tokens = 4;
    int32_t prompts[6][64];
    pd_sampling_params sp = pd_sampling_defaults();
    sp.temperature = 0.0f;
    for (int i = 0; i < n; i++) {
        make_prompt(prompts[i], lens[i], 500 + i);
        if (lens[i] > 32) /* a greedy continuation after position 30: those tokens rank first */
            assert_int_equal(reference(prompts[i], 30, &sp, lens[i] - 30, prompts[i] + 30), lens[i] - 30);
        snprintf(o.r[i].id, 32, "plp-%d", i);
        o.n++;
        pd_sched_request r = {.request_id = o.r[i].id, .prompt_ids = prompts[i], .n_prompt = lens[i],
                              .sampling = sp, .max_tokens = max_tokens, .ignore_eos = true,
                              .want_prompt_logprobs = want[i], .prompt_top_logprobs = ks[i]};
        assert_int_equal(pd_sched_add(s, &r, &err), PD_OK);
    }
    for (int guard = 0; guard < 10000; guard++)
        if (pd_sched_step(s) == 0) break;
    float *lg = malloc((size_t)64 * V * sizeof(float));
    int checked_in_top = 0;
    for (int i = 0; i < n; i++) {
        req_out *r = &o.r[i];
        assert_false(r->errored);
        int32_t ref[64];
        int k = reference(prompts[i], lens[i], &sp, max_tokens, ref);
        assert_int_equal(r->n_out, k);
        assert_memory_equal(r->out, ref, (size_t)k * sizeof(int32_t));
        assert_false(r->plp_late);
        assert_int_equal(r->plp_seen[0], 0);
        for (int p = 1; p < lens[i]; p++) assert_int_equal(r->plp_seen[p], want[i] ? 1 : 0);
        for (int p = lens[i]; p < MAXTOK; p++) assert_int_equal(r->plp_seen[p], 0);
        if (!want[i] || lens[i] < 2) continue;
        assert_int_equal(r->plp_k, ks[i]);
        /* the reference: the whole prompt at once, every row */
        pd_kv_cache *kv;
        assert_int_equal(pd_kv_cache_init(g_m, 16, 64 / 16 + 2, &kv, &err), PD_OK);
        pd_seq_kv sq = {0};
        assert_int_equal(pd_seq_kv_reserve(kv, &sq, lens[i]), PD_OK);
        pd_batch_seq b = {.kv = &sq, .tokens = prompts[i], .n_tokens = lens[i], .all_logits = true};
        assert_int_equal(pd_model_forward(g_m, kv, &b, 1, lg, &err), PD_OK);
        for (int p = 1; p < lens[i]; p++) {
            const float *row = lg + (size_t)(p - 1) * V;
            double mx = -INFINITY, sum = 0.0;
            for (int v = 0; v < V; v++) mx = row[v] > mx ? row[v] : mx;
            for (int v = 0; v < V; v++) sum += exp((double)row[v] - mx);
            double lse = mx + log(sum);
            double want_lp = (double)row[prompts[i][p]] - lse;
            assert_true(fabs((double)r->plp[p] - want_lp) < 1e-4);
            int rank = 0; /* tokens ahead of the prompt token */
            for (int v = 0; v < V; v++)
                rank += row[v] > row[prompts[i][p]] || (row[v] == row[prompts[i][p]] && v < prompts[i][p]);
            bool own = false;
            for (int j = 0; j < ks[i]; j++) {
                int32_t t = r->plp_tid[p][j];
                assert_true(t >= 0 && t < V);
                assert_true(fabs((double)r->plp_tlp[p][j] - ((double)row[t] - lse)) < 1e-4);
                if (j > 0) assert_true(r->plp_tlp[p][j] <= r->plp_tlp[p][j - 1]);
                int ahead = 0; /* the j-th best has exactly j tokens ahead of it */
                for (int v = 0; v < V; v++) ahead += row[v] > row[t] || (row[v] == row[t] && v < t);
                assert_int_equal(ahead, j);
                if (t == prompts[i][p]) {
                    own = true;
                    assert_true(r->plp_tlp[p][j] == r->plp[p]);
                }
            }
            assert_int_equal(own, rank < ks[i]);
            checked_in_top += own;
        }
        pd_seq_kv_release(kv, &sq);
        free(sq.block_table);
        pd_kv_cache_free(&kv);
    }
    free(lg);
    assert_true(checked_in_top > 0); /* the own-token case was met */
    pd_sched_stats st;
    pd_sched_get_stats(s, &st);
    assert_int_equal(st.free_blocks, cfg->num_blocks);
    pd_sched_free(&s);
}

static void test_prompt_logprobs_chunked(void **state) {
    pd_sched_config cfg = {.max_num_seqs = 3, .max_num_batched_tokens = 20, .chunked_prefill_size = 7,
                           .block_size = 8, .num_blocks = 128};
    run_prompt_logprobs(&cfg);
}

/* one chunk's rows a step for all of them; few blocks: preemption */
static void test_prompt_logprobs_bounded_and_preempted(void **state) {
    pd_sched_config cfg = {.max_num_seqs = 6, .max_num_batched_tokens = 128, .chunked_prefill_size = 64,
                           .block_size = 4, .num_blocks = 22};
    run_prompt_logprobs(&cfg);
}

int main(void) {
    const struct CMUnitTest t[] = {
        cmocka_unit_test(test_batched_greedy_equals_alone),
        cmocka_unit_test(test_seeded_sampling_is_batch_invariant),
        cmocka_unit_test(test_preemption),
        cmocka_unit_test(test_preemption_partial_prefills),
        cmocka_unit_test(test_reserved_prefilled),
        cmocka_unit_test(test_abort_frees_blocks),
        cmocka_unit_test(test_top_logprobs_greedy),
        cmocka_unit_test(test_top_logprobs_raw_under_penalties),
        cmocka_unit_test(test_top_logprobs_batched),
        cmocka_unit_test(test_constrained_batch),
        cmocka_unit_test(test_prompt_logprobs_chunked),
        cmocka_unit_test(test_prompt_logprobs_bounded_and_preempted),
    };
    return cmocka_run_group_tests(t, setup, teardown);
}

/* Tensor parallelism on the CPU backend: tiny and tiny-v2 loaded at TP = 2
 * and 4 (pd_backend_cpu_init_tp, pd_model_load_tp: one thread per rank,
 * all-reduce at a barrier) against the same model at TP = 1. One scenario
 * per model: chunked prefills of three prompts with every row's logits,
 * batched greedy decode steps of all three, and a step mixing decode
 * tokens with a new prompt's prefill; every logits row within 1e-5
 * normalised error (max |tp - ref| / max |ref|) of TP = 1, every greedy id
 * the same. Also: a prefill at TP = 1 moved block by block into a TP = 2
 * cache, unstaged and through staging slots (the decode replica's path,
 * pd_kv_cache_stage_in) decodes as
 * TP = 1 does, and sizes that do not divide the heads are refused.
 * Expert parallelism (pd_model_load_parallel with expert_parallel): the
 * same scenario at TP = 2 and 4 with the routed experts divided whole over
 * the ranks, the same bounds; each rank holds exactly its experts, equal to
 * the checkpoint's; a size that does not divide the experts is refused. The
 * models are made by pdserve mkmodel's code (pd_mkmodel_write, seed 1) in
 * $PD_BUILD_DIR/test-models, as test_model.c makes them. */
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

#include "model_impl.h" /* the ranks' expert tables (test_ep_rank_experts) */

#define N_PROMPTS    3
#define DECODE_STEPS 6
#define CHUNK        5
#define BLOCK        4

static void model_dir(const char *preset, char *dir, size_t n) {
    const char *bd = getenv("PD_BUILD_DIR");
    char models[2048];
    snprintf(models, sizeof models, "%s/test-models", bd ? bd : ".");
    mkdir(models, 0755);
    snprintf(dir, n, "%s/%s", models, preset);
    char cfgp[4200];
    snprintf(cfgp, sizeof cfgp, "%s/config.json", dir);
    struct stat sb;
    if (stat(cfgp, &sb) == 0)
        return;
    pd_err err = {{0}};
    pd_model_config cfg;
    assert_int_equal(pd_preset_config(preset, &cfg, &err), PD_OK);
    if (pd_mkmodel_write(&cfg, 1, dir, 0, NULL, &err) != PD_OK)
        fail_msg("mkmodel %s: %s", preset, err.msg);
}

/* A model at tensor parallel size n and the backends under it. */
typedef struct {
    int n;
    pd_backend *bes[PD_TP_MAX_RANKS];
    pd_model *m;
} tp_model;

static void par_load(const char *dir, int n, bool ep, tp_model *t) {
    pd_err err = {{0}};
    t->n = n;
    if (pd_backend_cpu_init_tp(n, 1, t->bes, &err) != PD_OK)
        fail_msg("backends: %s", err.msg);
    if (pd_model_load_parallel(dir, t->bes, n, ep, &t->m, &err) != PD_OK)
        fail_msg("load at TP = %d%s: %s", n, ep ? " EP" : "", err.msg);
    assert_int_equal(pd_model_tp_size(t->m), n);
    assert_int_equal(pd_model_expert_parallel(t->m), ep);
}

static void tp_load(const char *dir, int n, tp_model *t) {
    par_load(dir, n, false, t);
}

static void tp_free(tp_model *t) {
    pd_model_free(&t->m);
    for (int r = 0; r < t->n; r++)
        pd_backend_free(&t->bes[r]);
}

/* What a scenario produced: every logits row in order, every greedy id. */
typedef struct {
    float *rows;
    int n_rows, cap_rows;
    int32_t ids[64];
    int n_ids;
} trace;

static void trace_add(trace *tr, const float *lg, int n, int V) {
    if (tr->n_rows + n > tr->cap_rows) {
        tr->cap_rows = 2 * (tr->n_rows + n);
        tr->rows = realloc(tr->rows, (size_t)tr->cap_rows * V * sizeof(float));
        assert_non_null(tr->rows);
    }
    memcpy(tr->rows + (size_t)tr->n_rows * V, lg, (size_t)n * V * sizeof(float));
    tr->n_rows += n;
}

static int argmax(const float *v, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b])
            b = i;
    return b;
}

static void forward_ok(pd_model *m, pd_kv_cache *kv, pd_batch_seq *b, int n, float *lg) {
    pd_err err = {{0}};
    for (int i = 0; i < n; i++)
        assert_int_equal(pd_seq_kv_reserve(kv, b[i].kv, b[i].n_tokens), PD_OK);
    if (pd_model_forward(m, kv, b, n, lg, &err) != PD_OK)
        fail_msg("forward: %s", err.msg);
}

/* The scenario: three prompts (7, 13, 21 tokens) prefilled in chunks of 5
 * with every row's logits; DECODE_STEPS greedy steps of all three in one
 * batch; then one step of the three decode tokens with a fourth prompt's
 * prefill. */
static void run_scenario(pd_model *m, trace *tr) {
    int V = pd_model_config_of(m)->vocab_size;
    pd_err err = {{0}};
    pd_kv_cache *kv;
    assert_int_equal(pd_kv_cache_init(m, BLOCK, 64, &kv, &err), PD_OK);
    static const int lens[N_PROMPTS] = {7, 13, 21};
    int32_t prompts[N_PROMPTS + 1][24], last[N_PROMPTS];
    pd_rng r;
    pd_rng_seed(&r, 11);
    for (int p = 0; p <= N_PROMPTS; p++)
        for (int i = 0; i < 24; i++)
            prompts[p][i] = (int32_t)(pd_rng_next(&r) % (uint64_t)V);
    pd_seq_kv seqs[N_PROMPTS + 1] = {{0}};
    float *lg = malloc((size_t)32 * V * sizeof(float));
    for (int p = 0; p < N_PROMPTS; p++) {
        int k = 0;
        for (int done = 0; done < lens[p]; done += k) {
            k = lens[p] - done < CHUNK ? lens[p] - done : CHUNK;
            pd_batch_seq b = {
                .kv = &seqs[p], .tokens = prompts[p] + done, .n_tokens = k, .all_logits = true};
            forward_ok(m, kv, &b, 1, lg);
            trace_add(tr, lg, k, V);
        }
        last[p] = tr->ids[tr->n_ids++] = argmax(lg + (size_t)(k - 1) * V, V);
    }
    for (int s = 0; s < DECODE_STEPS; s++) {
        pd_batch_seq b[N_PROMPTS];
        for (int p = 0; p < N_PROMPTS; p++)
            b[p] = (pd_batch_seq){.kv = &seqs[p], .tokens = &last[p], .n_tokens = 1};
        forward_ok(m, kv, b, N_PROMPTS, lg);
        trace_add(tr, lg, N_PROMPTS, V);
        for (int p = 0; p < N_PROMPTS; p++)
            last[p] = tr->ids[tr->n_ids++] = argmax(lg + (size_t)p * V, V);
    }
    pd_batch_seq mixed[N_PROMPTS + 1];
    for (int p = 0; p < N_PROMPTS; p++)
        mixed[p] = (pd_batch_seq){.kv = &seqs[p], .tokens = &last[p], .n_tokens = 1};
    mixed[N_PROMPTS] =
        (pd_batch_seq){.kv = &seqs[N_PROMPTS], .tokens = prompts[N_PROMPTS], .n_tokens = 6};
    forward_ok(m, kv, mixed, N_PROMPTS + 1, lg);
    trace_add(tr, lg, N_PROMPTS + 1, V);
    for (int p = 0; p <= N_PROMPTS; p++) {
        tr->ids[tr->n_ids++] = argmax(lg + (size_t)p * V, V);
        pd_seq_kv_release(kv, &seqs[p]);
        free(seqs[p].block_table);
    }
    free(lg);
    pd_kv_cache_free(&kv);
}

/* Worst normalised error of b's rows against ref's. */
static double trace_cmp(const trace *b, const trace *ref, int V) {
    assert_int_equal(b->n_rows, ref->n_rows);
    double worst = 0;
    for (int i = 0; i < ref->n_rows; i++) {
        const float *x = b->rows + (size_t)i * V, *y = ref->rows + (size_t)i * V;
        double mx = 0, d = 0;
        for (int k = 0; k < V; k++) {
            if (!isfinite(x[k]))
                return INFINITY;
            mx = fmax(mx, fabs(y[k]));
            d = fmax(d, fabs((double)x[k] - y[k]));
        }
        worst = fmax(worst, d / mx);
    }
    return worst;
}

static void check_preset(const char *preset) {
    char dir[4096];
    model_dir(preset, dir, sizeof dir);
    tp_model one;
    tp_load(dir, 1, &one);
    int V = pd_model_config_of(one.m)->vocab_size;
    trace ref = {0};
    run_scenario(one.m, &ref);
    tp_free(&one);
    static const int sizes[] = {2, 4};
    for (size_t i = 0; i < 2 * sizeof sizes / sizeof sizes[0]; i++) {
        int n = sizes[i % 2];
        bool ep = i >= 2; /* then with --enable-expert-parallel */
        const char *how = ep ? " EP" : "";
        tp_model t;
        par_load(dir, n, ep, &t);
        trace got = {0};
        run_scenario(t.m, &got);
        double e = trace_cmp(&got, &ref, V);
        print_message("[ %s ] TP = %d%s: %d logits rows, worst normalised error %.3g against TP = 1; "
                      "%d greedy ids\n",
                      preset, n, how, got.n_rows, e, got.n_ids);
        if (!(e <= 1e-5))
            fail_msg("%s TP = %d%s: normalised error %.3g > 1e-5", preset, n, how, e);
        assert_int_equal(got.n_ids, ref.n_ids);
        for (int k = 0; k < ref.n_ids; k++)
            if (got.ids[k] != ref.ids[k])
                fail_msg("%s TP = %d%s: greedy id %d is %d, TP = 1 gave %d", preset, n, how, k,
                         got.ids[k], ref.ids[k]);
        free(got.rows);
        tp_free(&t);
    }
    free(ref.rows);
}

static void test_tiny(void **state) {
    check_preset("tiny");
}
static void test_tiny_v2(void **state) {
    check_preset("tiny-v2");
}

/* A decode replica at TP = 2 receives a prefill replica's KV blocks (TP =
 * 1) and decodes on as the prefill replica's own cache does. Unstaged:
 * the blocks land in rank 0's copy (on the CPU the cache is the transfer
 * pool) and pd_kv_cache_stage_in(NULL) gives them to every rank. Staged:
 * pd_kv_cache_stage_out copies the sender's blocks into its staging slots,
 * the "puts" copy those into the receiver's slots (another order), and
 * pd_kv_cache_stage_in copies the slots into every rank's blocks. */
static void kv_blocks_to_tp(bool staged) {
    char dir[4096];
    model_dir("tiny", dir, sizeof dir);
    tp_model one, two;
    tp_load(dir, 1, &one);
    tp_load(dir, 2, &two);
    int V = pd_model_config_of(one.m)->vocab_size;
    pd_err err = {{0}};
    pd_kv_cache *ka, *kb;
    assert_int_equal(pd_kv_cache_init(one.m, BLOCK, 16, &ka, &err), PD_OK);
    assert_int_equal(pd_kv_cache_init(two.m, BLOCK, 16, &kb, &err), PD_OK);
    const size_t bb = pd_kv_cache_block_bytes(kb);
    int32_t prompt[10] = {3, 141, 59, 2653, 58979, 323, 8462, 643, 383, 27950};
    pd_seq_kv sa = {0}, sb = {0};
    float *la = malloc((size_t)V * sizeof(float)), *lb = malloc((size_t)V * sizeof(float));
    pd_batch_seq b = {.kv = &sa, .tokens = prompt, .n_tokens = 10};
    forward_ok(one.m, ka, &b, 1, la);
    /* the transfer: blocks in another order in the receiving cache */
    assert_int_equal(pd_kv_cache_alloc(kb), 0); /* block 0 stays unused */
    assert_int_equal(pd_seq_kv_reserve(kb, &sb, 10), PD_OK);
    assert_int_equal(sb.num_blocks, sa.num_blocks);
    const int n = sa.num_blocks;
    pd_kv_staging *sta = NULL, *stb = NULL;
    int slots_a[8], slots_b[8];
    assert_true(n <= 8);
    if (staged) {
        /* pools smaller than the caches; the receiver's slots in reverse order */
        assert_int_equal(pd_kv_staging_init(ka, n, NULL, &sta, &err), PD_OK);
        assert_int_equal(pd_kv_staging_init(kb, n + 1, NULL, &stb, &err), PD_OK);
        assert_int_equal(pd_kv_staging_alloc(sta, n, slots_a), PD_OK);
        int tmp[8];
        assert_int_equal(pd_kv_staging_alloc(stb, n + 1, tmp), PD_OK);
        for (int i = 0; i < n; i++)
            slots_b[i] = tmp[n - i];
        assert_int_equal(pd_kv_cache_stage_out(ka, sta, sa.block_table, slots_a, n, &err), PD_OK);
        for (int i = 0; i < n; i++)
            memcpy(pd_kv_staging_slot_ptr(stb, slots_b[i]), pd_kv_staging_slot_ptr(sta, slots_a[i]), bb);
        assert_int_equal(pd_kv_cache_stage_in(kb, stb, slots_b, sb.block_table, n, &err), PD_OK);
        /* the slots may be reused at once: scribbling over them changes nothing below */
        for (int i = 0; i < n; i++)
            memset(pd_kv_staging_slot_ptr(stb, slots_b[i]), 0xff, bb);
        pd_kv_staging_release(sta, slots_a, n);
        pd_kv_staging_release(stb, tmp, n + 1);
        assert_int_equal(pd_kv_staging_num_free(stb), n + 1);
    } else {
        for (int i = 0; i < n; i++)
            memcpy(pd_kv_cache_block_ptr(kb, sb.block_table[i]), pd_kv_cache_block_ptr(ka, sa.block_table[i]), bb);
        assert_int_equal(pd_kv_cache_stage_in(kb, NULL, NULL, sb.block_table, n, &err), PD_OK);
    }
    sb.num_tokens = 10;
    int32_t tok_a = argmax(la, V), tok_b = tok_a;
    for (int s = 0; s < 4; s++) {
        pd_batch_seq da = {.kv = &sa, .tokens = &tok_a, .n_tokens = 1},
                     db = {.kv = &sb, .tokens = &tok_b, .n_tokens = 1};
        forward_ok(one.m, ka, &da, 1, la);
        forward_ok(two.m, kb, &db, 1, lb);
        trace ta = {la, 1, 1, {0}, 0}, tb = {lb, 1, 1, {0}, 0};
        double e = trace_cmp(&tb, &ta, V);
        if (!(e <= 1e-5))
            fail_msg("%s: decode step %d after the transfer: normalised error %.3g > 1e-5",
                     staged ? "staged" : "unstaged", s, e);
        tok_a = argmax(la, V);
        tok_b = argmax(lb, V);
        assert_int_equal(tok_a, tok_b);
    }
    int bad = 99, slot = 0;
    assert_int_equal(pd_kv_cache_stage_in(kb, stb, staged ? &slot : NULL, &bad, 1, &err), PD_ERR_INVALID);
    pd_kv_staging_free(&sta);
    pd_kv_staging_free(&stb);
    pd_seq_kv_release(ka, &sa);
    pd_seq_kv_release(kb, &sb);
    free(sa.block_table);
    free(sb.block_table);
    free(la);
    free(lb);
    pd_kv_cache_free(&ka);
    pd_kv_cache_free(&kb);
    tp_free(&one);
    tp_free(&two);
}

static void test_kv_blocks_to_tp(void **state) {
    (void)state;
    kv_blocks_to_tp(false);
}

static void test_kv_blocks_to_tp_staged(void **state) {
    (void)state;
    kv_blocks_to_tp(true);
}

/* Sizes that do not divide the heads, and backends that are not one
 * group, are refused with a message saying why. */
static void test_refusals(void **state) {
    char dir[4096];
    model_dir("tiny", dir, sizeof dir);
    pd_err err = {{0}};
    pd_backend *bes[PD_TP_MAX_RANKS] = {0};
    pd_model *m = NULL;
    assert_int_equal(pd_backend_cpu_init_tp(3, 1, bes, &err), PD_OK);
    assert_int_equal(pd_model_load_tp(dir, bes, 3, &m, &err), PD_ERR_INVALID);
    assert_null(m);
    assert_non_null(
        strstr(err.msg, "tensor parallel size 3 does not divide num_attention_heads (4)"));
    for (int r = 0; r < 3; r++)
        pd_backend_free(&bes[r]);
    /* two backends that are not ranks of one group */
    assert_int_equal(pd_backend_cpu_init(1, &bes[0]), PD_OK);
    assert_int_equal(pd_backend_cpu_init(1, &bes[1]), PD_OK);
    assert_int_equal(pd_model_load_tp(dir, bes, 2, &m, &err), PD_ERR_INVALID);
    assert_null(m);
    pd_backend_free(&bes[0]);
    pd_backend_free(&bes[1]);
    assert_int_equal(pd_backend_init_tp("cpu", 0, 1, bes, &err), PD_ERR_INVALID);
    assert_int_equal(pd_backend_init_tp("cpu", PD_TP_MAX_RANKS + 1, 1, bes, &err), PD_ERR_INVALID);
}

/* Expert parallelism: rank r of n holds exactly experts [r·E/n, (r+1)·E/n),
 * each whole — its local expert i's gate_up / down are the checkpoint's
 * expert r·E/n + i's gate_proj;up_proj / down_proj, bit for bit (fp32 on
 * the CPU backend) — and only those (its tables have E/n entries). */
static void check_rank_experts(const pd_model *m, int n, const pd_safetensors *st) {
    const pd_model_config *c = pd_model_config_of(m);
    int E = c->n_routed_experts, I = c->moe_intermediate_size, H = c->hidden_size;
    float *g = malloc((size_t)I * H * 4), *u = malloc((size_t)I * H * 4), *d = malloc((size_t)H * I * 4);
    for (int r = 0; r < n; r++) {
        int first = -1, count = -1;
        pd_model_rank_experts(m, r, &first, &count);
        assert_int_equal(first, r * E / n);
        assert_int_equal(count, E / n);
        const pd_model_rank *rk = &m->ranks[r];
        assert_int_equal(rk->n_experts, E / n);
        for (int l = 0; l < c->num_hidden_layers; l++) {
            const pd_layer_weights *L = &rk->layers[l];
            if (!L->is_moe)
                continue;
            for (int i = 0; i < count; i++) {
                char name[3][160];
                static const char *parts[3] = {"gate_proj", "up_proj", "down_proj"};
                float *dst[3] = {g, u, d};
                for (int k = 0; k < 3; k++) {
                    snprintf(name[k], sizeof name[k], "model.layers.%d.mlp.experts.%d.%s.weight", l, first + i,
                             parts[k]);
                    const pd_st_tensor *t = pd_st_find(st, name[k]);
                    assert_non_null(t);
                    pd_st_to_f32(t, dst[k]);
                }
                const pd_weight *gu = &L->experts_gate_up[i], *dn = &L->experts_down[i];
                assert_int_equal(gu->rows, 2 * I);
                assert_int_equal(gu->cols, H);
                assert_int_equal(dn->rows, H);
                assert_int_equal(dn->cols, I);
                const float *gw = gu->data, *dw = dn->data;
                if (memcmp(gw, g, (size_t)I * H * 4) || memcmp(gw + (size_t)I * H, u, (size_t)I * H * 4) ||
                    memcmp(dw, d, (size_t)H * I * 4))
                    fail_msg("rank %d/%d layer %d: local expert %d is not the checkpoint's expert %d", r, n, l, i,
                             first + i);
            }
        }
    }
    free(g);
    free(u);
    free(d);
}

static void test_ep_rank_experts(void **state) {
    char dir[4096];
    model_dir("tiny", dir, sizeof dir);
    pd_err err = {{0}};
    pd_safetensors *st;
    assert_int_equal(pd_st_open_dir(dir, &st, &err), PD_OK);
    static const int sizes[] = {2, 4};
    for (size_t i = 0; i < 2; i++) {
        tp_model t;
        par_load(dir, sizes[i], true, &t);
        check_rank_experts(t.m, sizes[i], st);
        tp_free(&t);
    }
    /* without expert parallelism every rank holds all E, split */
    tp_model t;
    tp_load(dir, 2, &t);
    for (int r = 0; r < 2; r++) {
        int first, count;
        pd_model_rank_experts(t.m, r, &first, &count);
        assert_int_equal(first, 0);
        assert_int_equal(count, pd_model_config_of(t.m)->n_routed_experts);
        assert_int_equal(t.m->ranks[r].layers[1].experts_gate_up[0].rows,
                         2 * pd_model_config_of(t.m)->moe_intermediate_size / 2);
    }
    tp_free(&t);
    pd_st_close(&st);
}

/* Expert parallelism with a size that does not divide n_routed_experts is
 * refused at load, naming the field (tiny-v2 with 6 experts at size 4: the
 * heads, intermediate sizes and groups all divide). */
static void test_ep_refusal(void **state) {
    char models[2048], dir[4096];
    const char *bd = getenv("PD_BUILD_DIR");
    snprintf(models, sizeof models, "%s/test-models", bd ? bd : ".");
    mkdir(models, 0755);
    snprintf(dir, sizeof dir, "%s/tiny-v2-e6", models);
    pd_err err = {{0}};
    pd_model_config cfg;
    assert_int_equal(pd_preset_config("tiny-v2", &cfg, &err), PD_OK);
    cfg.n_routed_experts = 6;
    if (pd_mkmodel_write(&cfg, 1, dir, 0, NULL, &err) != PD_OK)
        fail_msg("mkmodel: %s", err.msg);
    pd_backend *bes[PD_TP_MAX_RANKS] = {0};
    pd_model *m = NULL;
    assert_int_equal(pd_backend_cpu_init_tp(4, 1, bes, &err), PD_OK);
    assert_int_equal(pd_model_load_parallel(dir, bes, 4, true, &m, &err), PD_ERR_INVALID);
    assert_null(m);
    if (!strstr(err.msg, "tensor parallel size 4 does not divide n_routed_experts (6)"))
        fail_msg("unexpected message: %s", err.msg);
    /* the same size without expert parallelism loads (each expert split) */
    if (pd_model_load_parallel(dir, bes, 4, false, &m, &err) != PD_OK)
        fail_msg("TP 4 without EP: %s", err.msg);
    pd_model_free(&m);
    for (int r = 0; r < 4; r++)
        pd_backend_free(&bes[r]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny),
        cmocka_unit_test(test_tiny_v2),
        cmocka_unit_test(test_kv_blocks_to_tp),
        cmocka_unit_test(test_kv_blocks_to_tp_staged),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_ep_rank_experts),
        cmocka_unit_test(test_ep_refusal),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The KV staging pool (model/kv_staging.c): the slot allocator against a
 * model of it over random take/give-back sequences (all or none, no slot
 * handed out twice, counts), the default size's properties over random
 * geometries, blocks surviving cache → slots → other blocks byte for byte
 * on a tiny checkpoint's cache (pool memory of its own and borrowed), and
 * every error. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "pd_kernels.h"
#include "pd_model.h"

static uint64_t rs = 0x2545f4914f6cdd1dull;
static uint64_t rnd(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs;
}

typedef struct {
    char dir[64];
    pd_backend *be;
    pd_model *m;
    pd_kv_cache *kv;
} fixture;

/* A tiny checkpoint (pd_mkmodel_write, seed 1) on the CPU and a cache of
 * num_blocks blocks of 4 tokens. */
static void fixture_init(fixture *f, int num_blocks) {
    pd_err err = {{0}};
    pd_model_config c;
    assert_int_equal(pd_preset_config("tiny", &c, &err), PD_OK);
    snprintf(f->dir, sizeof f->dir, "/tmp/pd-kvstaging-XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    if (pd_mkmodel_write(&c, 1, f->dir, 0, NULL, &err) != PD_OK)
        fail_msg("mkmodel: %s", err.msg);
    assert_int_equal(pd_backend_cpu_init(1, &f->be), PD_OK);
    if (pd_model_load(f->dir, f->be, &f->m, &err) != PD_OK)
        fail_msg("load: %s", err.msg);
    assert_int_equal(pd_kv_cache_init(f->m, 4, num_blocks, &f->kv, &err), PD_OK);
}

static void fixture_free(fixture *f) {
    pd_kv_cache_free(&f->kv);
    pd_model_free(&f->m);
    pd_backend_free(&f->be);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->dir);
    assert_int_equal(system(cmd), 0);
}

/* Random takes and give-backs against a model (which slots are taken). */
static void test_allocator(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, 64);
    pd_err err = {{0}};
    enum { SLOTS = 23 };
    pd_kv_staging *st = NULL;
    assert_int_equal(pd_kv_staging_init(f.kv, SLOTS, NULL, &st, &err), PD_OK);
    assert_int_equal(pd_kv_staging_num_slots(st), SLOTS);
    assert_int_equal(pd_kv_staging_bytes(st), SLOTS * pd_kv_cache_block_bytes(f.kv));
    bool taken[SLOTS] = {0};
    int held[64][SLOTS], n_held[64] = {0}, n_batches = 0, n_taken = 0, refusals = 0;
    for (int it = 0; it < 20000; it++) {
        if (n_batches < 64 && rnd() % 2) {
            int want = (int)(rnd() % 9), got[SLOTS + 8];
            memset(got, 0xff, sizeof got);
            pd_status s = pd_kv_staging_alloc(st, want, got);
            if (want > SLOTS - n_taken) {
                assert_int_equal(s, PD_ERR_LIMIT);
                assert_int_equal(got[0], -1); /* nothing taken */
                refusals++;
                continue;
            }
            assert_int_equal(s, PD_OK);
            for (int i = 0; i < want; i++) {
                assert_true(got[i] >= 0 && got[i] < SLOTS);
                assert_false(taken[got[i]]);
                taken[got[i]] = true;
                held[n_batches][i] = got[i];
            }
            n_held[n_batches++] = want;
            n_taken += want;
        } else if (n_batches > 0) {
            int b = (int)(rnd() % (uint64_t)n_batches);
            pd_kv_staging_release(st, held[b], n_held[b]);
            for (int i = 0; i < n_held[b]; i++)
                taken[held[b][i]] = false;
            n_taken -= n_held[b];
            n_batches--;
            memcpy(held[b], held[n_batches], sizeof held[b]);
            n_held[b] = n_held[n_batches];
        }
        assert_int_equal(pd_kv_staging_num_free(st), SLOTS - n_taken);
    }
    assert_true(refusals > 0); /* the "no free slot" answer was exercised */
    /* every slot is its own block-sized piece of the pool */
    for (int s = 0; s < SLOTS; s++)
        assert_ptr_equal(pd_kv_staging_slot_ptr(st, s),
                         (char *)pd_kv_staging_base(st) +
                             (size_t)s * pd_kv_cache_block_bytes(f.kv));
    int neg[1];
    assert_int_equal(pd_kv_staging_alloc(st, -1, neg), PD_ERR_LIMIT);
    pd_kv_staging_free(&st);
    assert_null(st);
    pd_kv_staging_free(&st); /* NULL: a no-op */
    assert_int_equal(pd_kv_staging_init(f.kv, 0, NULL, &st, &err), PD_ERR_INVALID);
    assert_null(st);
    fixture_free(&f);
}

/* Blocks filled with random bytes go out into slots and come back into
 * other blocks unchanged; with memory of the pool's own and borrowed. */
static void round_trip(bool borrowed) {
    fixture f;
    fixture_init(&f, 32);
    pd_err err = {{0}};
    const size_t bb = pd_kv_cache_block_bytes(f.kv);
    enum { N = 6, SLOTS = 8 };
    void *mem = NULL;
    if (borrowed)
        mem = malloc(SLOTS * bb);
    pd_kv_staging *st = NULL;
    assert_int_equal(pd_kv_staging_init(f.kv, SLOTS, mem, &st, &err), PD_OK);
    if (borrowed)
        assert_ptr_equal(pd_kv_staging_base(st), mem);
    /* sources: runs and gaps; slots: a run, then scattered */
    int src[N] = {3, 4, 5, 9, 20, 21}, dst[N] = {30, 0, 1, 2, 17, 11},
        slots[N] = {2, 3, 4, 7, 0, 5};
    for (int i = 0; i < N; i++) {
        unsigned char *p = pd_kv_cache_block_ptr(f.kv, src[i]);
        for (size_t k = 0; k < bb; k++)
            p[k] = (unsigned char)rnd();
    }
    assert_int_equal(pd_kv_cache_stage_out(f.kv, st, src, slots, N, &err), PD_OK);
    for (int i = 0; i < N; i++)
        assert_memory_equal(pd_kv_staging_slot_ptr(st, slots[i]),
                            pd_kv_cache_block_ptr(f.kv, src[i]), bb);
    assert_int_equal(pd_kv_cache_stage_in(f.kv, st, slots, dst, N, &err), PD_OK);
    for (int i = 0; i < N; i++)
        assert_memory_equal(pd_kv_cache_block_ptr(f.kv, dst[i]),
                            pd_kv_cache_block_ptr(f.kv, src[i]), bb);
    /* errors: a block or a slot out of range, no slots with a pool */
    int bad_block[1] = {32}, bad_slot[1] = {SLOTS}, ok[1] = {0};
    assert_int_equal(pd_kv_cache_stage_out(f.kv, st, bad_block, ok, 1, &err), PD_ERR_INVALID);
    assert_non_null(strstr(err.msg, "outside the cache"));
    assert_int_equal(pd_kv_cache_stage_in(f.kv, st, bad_slot, ok, 1, &err), PD_ERR_INVALID);
    assert_non_null(strstr(err.msg, "outside the pool"));
    assert_int_equal(pd_kv_cache_stage_in(f.kv, st, NULL, ok, 1, &err), PD_ERR_INVALID);
    /* a host cache without a pool: nothing to copy with one rank, but the range is checked */
    assert_int_equal(pd_kv_cache_stage_out(f.kv, NULL, ok, NULL, 1, &err), PD_OK);
    assert_int_equal(pd_kv_cache_stage_in(f.kv, NULL, NULL, ok, 1, &err), PD_OK);
    assert_int_equal(pd_kv_cache_stage_in(f.kv, NULL, NULL, bad_block, 1, &err), PD_ERR_INVALID);
    pd_kv_staging_free(&st);
    free(mem); /* borrowed: still the caller's */
    fixture_free(&f);
}

static void test_round_trip(void **state) {
    (void)state;
    round_trip(false);
}

static void test_round_trip_borrowed(void **state) {
    (void)state;
    round_trip(true);
}

/* The default size over random geometries: at least one slot, at most the
 * cache; one prompt of the model's context fits whenever the cache holds
 * one; four when they fit in 4 GiB and the cache; never more than 4 GiB
 * unless one prompt needs more. */
static void test_default_slots(void **state) {
    (void)state;
    pd_err err = {{0}};
    pd_model_config c;
    assert_int_equal(pd_preset_config("tiny", &c, &err), PD_OK);
    const size_t four_gib = (size_t)4 << 30;
    for (int it = 0; it < 20000; it++) {
        c.num_hidden_layers = 1 + (int)(rnd() % 128);
        c.kv_lora_rank = 16 * (1 + (int)(rnd() % 64));
        c.qk_rope_head_dim = 16 * (1 + (int)(rnd() % 8));
        c.max_position_embeddings = 1 + (int)(rnd() % 200000);
        const int bs = 1 + (int)(rnd() % 64), nb = 1 + (int)(rnd() % 1000000);
        const size_t bb = pd_kv_cache_bytes_per_block(&c, bs);
        const long long one = (c.max_position_embeddings + bs - 1) / bs;
        const int n = pd_kv_staging_default_slots(&c, bs, nb);
        assert_true(n >= 1 && n <= nb);
        if (nb >= one)
            assert_true(n >= one);
        if (4 * one <= nb && (size_t)(4 * one) * bb <= four_gib)
            assert_int_equal(n, 4 * one);
        if ((size_t)n * bb > four_gib)
            assert_int_equal(n, one < nb ? one : nb);
        assert_true(n <= 4 * one);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_allocator),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_round_trip_borrowed),
        cmocka_unit_test(test_default_slots),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

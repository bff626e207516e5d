/* pd_kv_plan_blocks (--gpu-memory-utilization) and pd_kv_cache_bytes_per_block:
 * the plan's properties on random device states (never over the budget or
 * the free memory, maximal, capped, other processes' memory not counted
 * against the fraction), a worked H200 / v2-lite case with two replicas
 * sharing the GPU, every error, and the
 * block size against a real cache's. */
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

#define GiB ((size_t)1 << 30)

static uint64_t rs = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs;
}

static void test_properties(void **state) {
    (void)state;
    int planned = 0, refused = 0, by_free = 0;
    for (int it = 0; it < 20000; it++) {
        const size_t total = (size_t)(1 + rnd() % 192) * GiB;
        const size_t free_b = rnd() % (total + 1);
        const size_t own = rnd() % (total - free_b + 1); /* this replica's share of what is in use */
        const double util = (double)(1 + rnd() % 1000) / 1000.0;
        const size_t reserve = rnd() % (4 * GiB);
        const size_t bb = 1 + rnd() % (64u << 20);
        const int cap = 1 + (int)(rnd() % 2000000);
        pd_kv_plan p;
        pd_err err = {{0}};
        pd_status st = pd_kv_plan_blocks(total, free_b, own, util, reserve, bb, cap, &p, &err);
        const size_t budget = (size_t)(util * (double)total);
        if (st == PD_ERR_NOMEM) {
            /* refused only when not even one block fits the budget or the free memory */
            assert_true(budget < own + reserve + bb || free_b < reserve + bb);
            assert_non_null(strstr(err.msg, "--gpu-memory-utilization"));
            refused++;
            continue;
        }
        assert_int_equal(st, PD_OK);
        planned++;
        by_free += p.by_free;
        assert_true(p.num_blocks >= 1 && p.num_blocks <= cap);
        assert_int_equal(p.kv_bytes, (size_t)p.num_blocks * bb);
        assert_int_equal(p.mem_in_use, own);
        assert_int_equal(p.mem_others, total - free_b - own);
        /* never over the budget, never more than is free */
        assert_true(own + p.reserve + p.kv_bytes <= p.budget);
        assert_true(p.reserve + p.kv_bytes <= free_b);
        /* maximal: one more block would break one of the two, unless the cap stopped it */
        if (p.num_blocks < cap)
            assert_true(own + p.reserve + p.kv_bytes + bb > p.budget || p.reserve + p.kv_bytes + bb > free_b);
        /* what other processes hold does not count against the budget: with none
         * of it (the same replica alone on the device) the plan is never smaller */
        pd_kv_plan alone;
        assert_int_equal(pd_kv_plan_blocks(total, total - own, own, util, reserve, bb, cap, &alone, &err), PD_OK);
        assert_true(alone.num_blocks >= p.num_blocks);
    }
    /* the random states exercised every outcome */
    assert_true(planned > 1000 && refused > 1000 && by_free > 100);
}

/* v2-lite on one H200 as measured (docs/benchmarks.md): 139.8 GiB, 32.6 GiB
 * in use after the weights, block 16: 16 × 27 × 576 × 4 = 995,328 bytes. */
static void test_h200_v2lite(void **state) {
    (void)state;
    pd_model_config c;
    pd_err err = {{0}};
    assert_int_equal(pd_preset_config("v2-lite", &c, &err), PD_OK);
    const size_t bb = pd_kv_cache_bytes_per_block(&c, 16);
    assert_int_equal(bb, (size_t)16 * 27 * (512 + 64) * 4);
    const size_t total = (size_t)(139.8 * GiB), w = (size_t)(32.6 * GiB);
    pd_kv_plan p;
    assert_int_equal(pd_kv_plan_blocks(total, total - w, w, 0.9, 2 * GiB, bb, INT32_MAX, &p, &err), PD_OK);
    /* 0.9 × 139.8 − 32.6 − 2 = 91.22 GiB of KV: 98,406 blocks, 1,574,496 tokens */
    const size_t want = ((size_t)(0.9 * (double)total) - w - 2 * GiB) / bb;
    assert_int_equal(p.num_blocks, (int)want);
    assert_true(p.num_blocks > 98000 && p.num_blocks < 99000);
    assert_false(p.by_free);
    /* two replicas sharing the GPU at 0.45 each (pdserve up on one GPU), in
     * either order: the second sees the first's weights and cache as others'
     * memory, which does not count against its own fraction */
    pd_kv_plan a, b;
    assert_int_equal(pd_kv_plan_blocks(total, total - w, w, 0.45, 2 * GiB, bb, INT32_MAX, &a, &err), PD_OK);
    const size_t in_use2 = w + a.kv_bytes + w; /* the first replica's weights and cache, then the second's weights */
    assert_int_equal(pd_kv_plan_blocks(total, total - in_use2, w, 0.45, 2 * GiB, bb, INT32_MAX, &b, &err), PD_OK);
    assert_int_equal(b.num_blocks, a.num_blocks);
    assert_int_equal(b.mem_others, w + a.kv_bytes);
    /* together they stay within 0.9 of the device */
    assert_true(2 * w + a.kv_bytes + b.kv_bytes + 4 * GiB <= (size_t)(0.9 * (double)total));
    /* a third process (one with a small model, 1 GiB) at 0.45 finds less free
     * than its budget: the free memory limits it */
    const size_t in_use3 = in_use2 + b.kv_bytes + GiB;
    pd_kv_plan t;
    assert_int_equal(pd_kv_plan_blocks(total, total - in_use3, GiB, 0.45, 2 * GiB, bb, INT32_MAX, &t, &err), PD_OK);
    assert_true(t.by_free && t.num_blocks < a.num_blocks);
    assert_true(t.kv_bytes + t.reserve <= total - in_use3);
}

static void test_errors(void **state) {
    (void)state;
    pd_kv_plan p;
    pd_err err = {{0}};
    assert_int_equal(pd_kv_plan_blocks(GiB, GiB, 0, 0.0, 0, 1024, 10, &p, &err), PD_ERR_INVALID);
    assert_int_equal(pd_kv_plan_blocks(GiB, GiB, 0, 1.01, 0, 1024, 10, &p, &err), PD_ERR_INVALID);
    assert_int_equal(pd_kv_plan_blocks(GiB, GiB, 0, -0.5, 0, 1024, 10, &p, &err), PD_ERR_INVALID);
    assert_int_equal(pd_kv_plan_blocks(GiB, 2 * GiB, 0, 0.5, 0, 1024, 10, &p, &err), PD_ERR_INVALID);
    assert_int_equal(pd_kv_plan_blocks(GiB, GiB, 0, 0.5, 0, 0, 10, &p, &err), PD_ERR_INVALID);
    assert_int_equal(pd_kv_plan_blocks(GiB, GiB, 0, 0.5, 0, 1024, 0, &p, &err), PD_ERR_INVALID);
    /* utilization 1, nothing in use, no reserve: the whole device, exactly */
    assert_int_equal(pd_kv_plan_blocks(GiB, GiB, 0, 1.0, 0, 1024, INT32_MAX, &p, &err), PD_OK);
    assert_int_equal(p.num_blocks, (int)(GiB / 1024));
    /* this replica's count above what is in use: a caller's error */
    assert_int_equal(pd_kv_plan_blocks(GiB, GiB / 2, GiB / 2 + 1, 0.5, 0, 1024, 10, &p, &err), PD_ERR_INVALID);
    /* everything in use, by this replica or by others: refused, saying how the memory is taken */
    assert_int_equal(pd_kv_plan_blocks(GiB, 0, GiB, 0.9, 0, 1024, 10, &p, &err), PD_ERR_NOMEM);
    assert_non_null(strstr(err.msg, "already in use by this replica"));
    assert_int_equal(pd_kv_plan_blocks(GiB, 0, 0, 0.9, 0, 1024, 10, &p, &err), PD_ERR_NOMEM);
    assert_non_null(strstr(err.msg, "by others"));
}

/* the planned block size is the block size a cache of that model really
 * has: a tiny checkpoint (pd_mkmodel_write) loaded on the CPU, its cache
 * made, pd_kv_cache_block_bytes compared */
static void test_block_bytes_match_cache(void **state) {
    (void)state;
    pd_err err = {{0}};
    pd_model_config c;
    assert_int_equal(pd_preset_config("tiny", &c, &err), PD_OK);
    char dir[] = "/tmp/pd-kvplan-XXXXXX";
    assert_non_null(mkdtemp(dir));
    if (pd_mkmodel_write(&c, 1, dir, 0, NULL, &err) != PD_OK)
        fail_msg("mkmodel: %s", err.msg);
    pd_backend *be = NULL;
    assert_int_equal(pd_backend_cpu_init(1, &be), PD_OK);
    pd_model *m = NULL;
    if (pd_model_load(dir, be, &m, &err) != PD_OK)
        fail_msg("load: %s", err.msg);
    for (int bs = 1; bs <= 64; bs *= 4) {
        pd_kv_cache *kv = NULL;
        assert_int_equal(pd_kv_cache_init(m, bs, 3, &kv, &err), PD_OK);
        assert_int_equal(pd_kv_cache_bytes_per_block(pd_model_config_of(m), bs), pd_kv_cache_block_bytes(kv));
        pd_kv_cache_free(&kv);
    }
    pd_model_free(&m);
    pd_backend_free(&be);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_properties),
        cmocka_unit_test(test_h200_v2lite),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_block_bytes_match_cache),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

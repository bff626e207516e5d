/* The start-up all-reduce check (kernels/check.c) on CPU tensor-parallel
 * groups of 1 to 4 ranks: every element comes back N(N+1)/2; an injected
 * wrong value is found on rank 0 at the element it was put, and reported
 * with the value and the expected one. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "pd_kernels.h"

static void check_group(int n_ranks) {
    pd_backend *bes[PD_TP_MAX_RANKS] = {0};
    pd_err err = {{0}};
    assert_int_equal(pd_backend_cpu_init_tp(n_ranks, 1, bes, &err), PD_OK);
    pd_all_reduce_check r;
    size_t n = 1000003; /* not a multiple of the ranks: uneven slices */
    assert_int_equal(pd_backend_check_all_reduce(bes, n_ranks, n, false, &r, &err), PD_OK);
    assert_int_equal(r.n_ranks, n_ranks);
    assert_true(r.expected == (float)(n_ranks * (n_ranks + 1) / 2));
    assert_int_equal(r.bad_rank, -1);
    assert_true(r.seconds >= 0);
    /* injected: rank 0's element n/2 one too large */
    memset(&err, 0, sizeof err);
    assert_int_equal(pd_backend_check_all_reduce(bes, n_ranks, n, true, &r, &err), PD_ERR_IO);
    assert_int_equal(r.bad_rank, 0);
    assert_int_equal(r.bad_index, n / 2);
    assert_true(r.got == r.expected + 1.0f);
    char want[160];
    snprintf(want, sizeof want, "rank 0 element %zu of %zu is %g, expected %g", n / 2, n, (double)r.got,
             (double)r.expected);
    assert_non_null(strstr(err.msg, want));
    /* the group is still usable after a failed check (nobody left waiting) */
    assert_int_equal(pd_backend_check_all_reduce(bes, n_ranks, 7, false, &r, &err), PD_OK);
    for (int k = 0; k < n_ranks; k++)
        pd_backend_free(&bes[k]);
}

static void test_groups(void **state) {
    for (int n = 1; n <= 4; n++)
        check_group(n);
}

static void test_bad_arguments(void **state) {
    pd_backend *be = NULL;
    pd_err err = {{0}};
    pd_all_reduce_check r;
    assert_int_equal(pd_backend_cpu_init(1, &be), PD_OK);
    assert_int_equal(pd_backend_check_all_reduce(&be, 0, 10, false, &r, &err), PD_ERR_INVALID);
    assert_int_equal(pd_backend_check_all_reduce(&be, 1, 0, false, &r, &err), PD_ERR_INVALID);
    pd_backend_free(&be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_groups),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

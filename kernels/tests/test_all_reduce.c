/* all_reduce_sum on every backend, each rank on its own thread as the
 * model's rank threads call it:
 *   cpu   groups of 1 to 4 ranks (threads of this process, a barrier):
 *         the rank-ordered fp32 sum, the same bits on every rank;
 *   cuda  where the build has CUDA and the host at least two GPUs, a group
 *         of every GPU (at most PD_TP_MAX_RANKS) through NCCL, run plainly
 *         and recorded in a graph then replayed (a decode step's graph
 *         holds its all-reduces): within 1e-6 of the double sum, the same
 *         on every rank.
 * Without two GPUs, NCCL or CUDA in the build, the CUDA group is skipped
 * and says why. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_kernels.h"

typedef struct {
    pd_backend *be;
    size_t n;
    bool graph;
    const float *in; /* this rank's input, host */
    float *out;      /* host */
} rank_job;

static void *rank_main(void *p) {
    rank_job *j = p;
    pd_backend *be = j->be;
    if (be->ops->thread_bind)
        be->ops->thread_bind(be);
    size_t bytes = (j->n ? j->n : 1) * sizeof(float);
    float *d = be->ops->alloc(be, bytes);
    assert_non_null(d);
    be->ops->upload(be, d, j->in, j->n * sizeof(float));
    void *g = NULL;
    if (j->graph && be->ops->graph_begin && be->ops->graph_begin(be) == PD_OK) {
        be->ops->all_reduce_sum(be, d, j->n);
        assert_int_equal(be->ops->graph_end(be, &g), PD_OK);
        be->ops->upload(be, d, j->in, j->n * sizeof(float)); /* recording ran nothing */
        assert_int_equal(be->ops->graph_launch(be, g), PD_OK);
    } else {
        be->ops->all_reduce_sum(be, d, j->n);
    }
    be->ops->download(be, j->out, d, j->n * sizeof(float));
    if (g)
        be->ops->graph_free(be, g);
    be->ops->free(be, d);
    return NULL;
}

/* Runs one all-reduce of n floats over the group; worst normalised error
 * against the double sum; *same_p: every rank's result has the same bits. */
static double run_group(pd_backend **bes, int n_ranks, size_t n, bool graph, uint64_t seed,
                        bool *same_p) {
    pd_rng r;
    pd_rng_seed(&r, seed);
    rank_job jobs[PD_TP_MAX_RANKS];
    pthread_t th[PD_TP_MAX_RANKS];
    double *want = calloc(n ? n : 1, sizeof(double));
    for (int k = 0; k < n_ranks; k++) {
        float *in = malloc((n ? n : 1) * sizeof(float)), *out = malloc((n ? n : 1) * sizeof(float));
        for (size_t i = 0; i < n; i++) {
            in[i] = (float)pd_rng_normal(&r);
            want[i] += in[i];
            out[i] = NAN;
        }
        jobs[k] = (rank_job){bes[k], n, graph, in, out};
    }
    for (int k = 0; k < n_ranks; k++)
        assert_int_equal(pthread_create(&th[k], NULL, rank_main, &jobs[k]), 0);
    for (int k = 0; k < n_ranks; k++)
        pthread_join(th[k], NULL);
    double mx = 0, d = 0;
    *same_p = true;
    for (size_t i = 0; i < n; i++) {
        mx = fmax(mx, fabs(want[i]));
        for (int k = 0; k < n_ranks; k++) {
            float v = jobs[k].out[i];
            d = isfinite(v) ? fmax(d, fabs(v - want[i])) : INFINITY;
            if (memcmp(&v, &jobs[0].out[i], sizeof v) != 0)
                *same_p = false;
        }
    }
    for (int k = 0; k < n_ranks; k++) {
        free((void *)jobs[k].in);
        free(jobs[k].out);
    }
    free(want);
    return mx > 0 ? d / mx : d;
}

static const size_t sizes[] = {0, 1, 7, 1000, 64 * 2048 + 3};

static void test_cpu(void **state) {
    pd_err err = {{0}};
    for (int n_ranks = 1; n_ranks <= 4; n_ranks++) {
        pd_backend *bes[PD_TP_MAX_RANKS];
        assert_int_equal(pd_backend_cpu_init_tp(n_ranks, 1, bes, &err), PD_OK);
        for (int r = 0; r < n_ranks; r++) {
            assert_int_equal(bes[r]->rank, r);
            assert_int_equal(bes[r]->n_ranks, n_ranks);
        }
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            bool same;
            double e = run_group(bes, n_ranks, sizes[s], false, 100 + s, &same);
            if (!(e <= 1e-6) || !same)
                fail_msg("cpu, %d ranks, %zu floats: error %.3g, same bits on every rank: %d",
                         n_ranks, sizes[s], e, same);
        }
        for (int r = 0; r < n_ranks; r++)
            pd_backend_free(&bes[r]);
    }
}

static void test_cuda(void **state) {
    pd_err err = {{0}};
    pd_backend *bes[PD_TP_MAX_RANKS];
    pd_backend *one = NULL;
    if (pd_backend_cuda_init(0, &one, &err) != PD_OK) {
        print_message("[ cuda ] skipped: %s\n", err.msg);
        skip();
    }
    pd_backend_free(&one);
    int n_ranks = 0;
    for (int n = PD_TP_MAX_RANKS; n >= 2 && !n_ranks; n--)
        if (pd_backend_cuda_init_tp(n, bes, &err) == PD_OK)
            n_ranks = n;
        else if (strstr(err.msg, "NCCL"))
            break;
    if (!n_ranks) {
        print_message("[ cuda ] skipped: %s\n", err.msg);
        skip();
    }
    for (int g = 0; g < 2; g++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            bool same;
            double e = run_group(bes, n_ranks, sizes[s], g == 1, 200 + s, &same);
            print_message(
                "[ cuda ] %d ranks, %zu floats%s: normalised error %.3g, same on every rank: %s\n",
                n_ranks, sizes[s], g ? ", graph" : "", e, same ? "yes" : "no");
            if (!(e <= 1e-6) || !same)
                fail_msg("cuda, %d ranks, %zu floats%s: error %.3g", n_ranks, sizes[s],
                         g ? " (graph)" : "", e);
        }
    for (int r = 0; r < n_ranks; r++)
        pd_backend_free(&bes[r]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu),
        cmocka_unit_test(test_cuda),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

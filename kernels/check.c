/* Start-up self-check of a tensor-parallel group's all-reduce
 * (pd_kernels.h, pd_backend_check_all_reduce). Through the backend
 * interface only, so the same check runs on the CPU group (threads meeting
 * at a barrier) and the CUDA group (NCCL). */
#include "pd_kernels.h"

#include <pthread.h>
#include <string.h>

typedef struct {
    pthread_barrier_t bar; /* the ranks agree that every buffer exists before any all-reduce */
    bool any_nomem;         /* under the barrier's ordering: written before it, read after */
    pthread_mutex_t mu;
} group;

typedef struct {
    group *g;
    pd_backend *be;
    int n_ranks;
    size_t n;
    float expected;
    bool inject;
    float *host; /* [n] read back */
    bool nomem;
    size_t bad_index; /* n: all good */
} rank_job;

/* One rank: its own thread, as every rank's operations must be. */
static void *run_rank(void *arg) {
    rank_job *j = arg;
    pd_backend *be = j->be;
    if (be->ops->thread_bind)
        be->ops->thread_bind(be);
    float *dev = be->ops->alloc(be, j->n * sizeof(float));
    if (!dev) {
        j->nomem = true;
        pthread_mutex_lock(&j->g->mu);
        j->g->any_nomem = true;
        pthread_mutex_unlock(&j->g->mu);
    }
    /* no rank enters the all-reduce unless all can: one that could not
     * allocate would leave the others waiting in it forever */
    pthread_barrier_wait(&j->g->bar);
    pthread_mutex_lock(&j->g->mu);
    bool go = !j->g->any_nomem;
    pthread_mutex_unlock(&j->g->mu);
    if (!go) {
        if (dev)
            be->ops->free(be, dev);
        j->bad_index = j->n;
        return NULL;
    }
    for (size_t i = 0; i < j->n; i++)
        j->host[i] = (float)(be->rank + 1);
    be->ops->upload(be, dev, j->host, j->n * sizeof(float));
    memset(j->host, 0, j->n * sizeof(float));
    be->ops->all_reduce_sum(be, dev, j->n);
    be->ops->download(be, j->host, dev, j->n * sizeof(float));
    be->ops->free(be, dev);
    if (j->inject && be->rank == 0)
        j->host[j->n / 2] += 1.0f;
    j->bad_index = j->n;
    for (size_t i = 0; i < j->n; i++)
        if (j->host[i] != j->expected) {
            j->bad_index = i;
            break;
        }
    return NULL;
}

pd_status pd_backend_check_all_reduce(pd_backend *const *bes, int n_ranks, size_t n, bool inject_failure,
                                      pd_all_reduce_check *res_p, pd_err *err) {
    if (n_ranks < 1 || n_ranks > PD_TP_MAX_RANKS || n == 0)
        return pd_err_set(err, PD_ERR_INVALID, "all-reduce check: %d ranks of %zu floats", n_ranks, n);
    double t0 = pd_now_s();
    pd_all_reduce_check res = {.n_ranks = n_ranks, .n = n, .expected = (float)(n_ranks * (n_ranks + 1) / 2),
                               .bad_rank = -1};
    rank_job jobs[PD_TP_MAX_RANKS];
    pthread_t th[PD_TP_MAX_RANKS];
    group g = {.any_nomem = false};
    pd_status st = PD_OK;
    int r = 0;
    for (r = 0; r < n_ranks; r++) {
        jobs[r] = (rank_job){.g = &g, .be = bes[r], .n_ranks = n_ranks, .n = n, .expected = res.expected,
                             .inject = inject_failure, .host = malloc(n * sizeof(float))};
        if (!jobs[r].host) {
            st = pd_err_set(err, PD_ERR_NOMEM, "all-reduce check: %zu bytes of host memory", n * sizeof(float));
            goto out_free_host;
        }
    }
    pthread_barrier_init(&g.bar, NULL, (unsigned)n_ranks);
    pthread_mutex_init(&g.mu, NULL);
    for (int k = 0; k < n_ranks; k++)
        if (pthread_create(&th[k], NULL, run_rank, &jobs[k]) != 0) {
            /* the ranks already started wait at the barrier for this one:
             * no way back (as pd_xmalloc, out of resources at start-up) */
            PD_LOGE("kernels", "all-reduce check: cannot start the thread of rank %d", k);
            abort();
        }
    for (int k = 0; k < n_ranks; k++)
        pthread_join(th[k], NULL);
    pthread_barrier_destroy(&g.bar);
    pthread_mutex_destroy(&g.mu);
    for (int k = 0; k < n_ranks && st == PD_OK; k++)
        if (jobs[k].nomem)
            st = pd_err_set(err, PD_ERR_NOMEM, "all-reduce check: %zu bytes on rank %d", n * sizeof(float), k);
    for (int k = 0; k < n_ranks && st == PD_OK && res.bad_rank < 0; k++)
        if (jobs[k].bad_index < n) {
            res.bad_rank = k;
            res.bad_index = jobs[k].bad_index;
            res.got = jobs[k].host[jobs[k].bad_index];
        }
    res.seconds = pd_now_s() - t0;
    if (st == PD_OK && res.bad_rank >= 0)
        st = pd_err_set(err, PD_ERR_IO,
                        "all-reduce check failed: rank %d element %zu of %zu is %g, expected %g (sum of 1..%d over %d ranks)",
                        res.bad_rank, res.bad_index, n, (double)res.got, (double)res.expected, n_ranks, n_ranks);
    *res_p = res;
out_free_host:
    while (r-- > 0)
        free(jobs[r].host);
    return st;
}

/* The rank threads of a tensor-parallel model. Thread r runs rank r's share
 * of every call on the model (loading, forward steps, KV cache copies),
 * bound once to rank r's backend, so that a GPU rank's operations always
 * come from a thread whose current device is its own, and the ranks'
 * collectives (all_reduce_sum) meet. The caller hands one function to all
 * ranks and waits until every rank has returned; callers from several
 * threads take turns. */
#include "model_impl.h"

#include <pthread.h>

struct pd_tp_team {
    int n_ranks;
    pd_backend *bes[PD_TP_MAX_RANKS];
    pthread_t threads[PD_TP_MAX_RANKS];
    struct worker {
        pd_tp_team *t;
        int rank;
    } workers[PD_TP_MAX_RANKS];
    pthread_mutex_t run_mu; /* one call at a time */
    pthread_mutex_t mu;     /* guards what follows */
    pthread_cond_t work_cv, done_cv;
    uint64_t gen; /* bumped by every call */
    int pending;  /* ranks still running the current call */
    bool stop;
    void (*fn)(void *arg, int rank);
    void *arg;
};

static void *tp_worker(void *p) {
    struct worker *w = p;
    pd_tp_team *t = w->t;
    pd_backend *be = t->bes[w->rank];
    if (be->ops->thread_bind)
        be->ops->thread_bind(be);
    uint64_t seen = 0;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (!t->stop && t->gen == seen)
            pthread_cond_wait(&t->work_cv, &t->mu);
        if (t->stop)
            break;
        seen = t->gen;
        void (*fn)(void *, int) = t->fn;
        void *arg = t->arg;
        pthread_mutex_unlock(&t->mu);
        fn(arg, w->rank);
        pthread_mutex_lock(&t->mu);
        if (--t->pending == 0)
            pthread_cond_signal(&t->done_cv);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

static void tp_stop(pd_tp_team *t, int n_started) {
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_broadcast(&t->work_cv);
    pthread_mutex_unlock(&t->mu);
    for (int r = 0; r < n_started; r++)
        pthread_join(t->threads[r], NULL);
    pthread_cond_destroy(&t->done_cv);
    pthread_cond_destroy(&t->work_cv);
    pthread_mutex_destroy(&t->mu);
    pthread_mutex_destroy(&t->run_mu);
    free(t);
}

pd_status pd_tp_team_init(pd_backend *const *bes, int n_ranks, pd_tp_team **t_p, pd_err *err) {
    PD_ASSERT(n_ranks >= 1 && n_ranks <= PD_TP_MAX_RANKS);
    pd_tp_team *t = pd_xcalloc(1, sizeof *t);
    t->n_ranks = n_ranks;
    pthread_mutex_init(&t->run_mu, NULL);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->work_cv, NULL);
    pthread_cond_init(&t->done_cv, NULL);
    for (int r = 0; r < n_ranks; r++) {
        t->bes[r] = bes[r];
        t->workers[r] = (struct worker){t, r};
        if (pthread_create(&t->threads[r], NULL, tp_worker, &t->workers[r]) != 0) {
            tp_stop(t, r);
            return pd_err_set(err, PD_ERR_NOMEM, "cannot start the thread of rank %d", r);
        }
    }
    *t_p = t;
    return PD_OK;
}

void pd_tp_team_free(pd_tp_team **t_p) {
    if (!t_p || !*t_p)
        return;
    tp_stop(*t_p, (*t_p)->n_ranks);
    *t_p = NULL;
}

void pd_tp_run(pd_tp_team *t, int n_ranks, void (*fn)(void *arg, int rank), void *arg) {
    if (!t) {
        PD_ASSERT(n_ranks == 1);
        fn(arg, 0);
        return;
    }
    pthread_mutex_lock(&t->run_mu);
    pthread_mutex_lock(&t->mu);
    t->fn = fn;
    t->arg = arg;
    t->pending = t->n_ranks;
    t->gen++;
    pthread_cond_broadcast(&t->work_cv);
    while (t->pending > 0)
        pthread_cond_wait(&t->done_cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_unlock(&t->run_mu);
}

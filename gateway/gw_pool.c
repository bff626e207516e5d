/* Tokenizer workers: parse, validate, render and tokenize request bodies off
 * the event-loop thread (a 1M-token prompt takes seconds of BPE; JSON of a
 * 64 MiB body takes a fraction of one). Results return to the loop through a
 * pipe whose read end is an ordinary event, so the caller's event_base needs
 * no threading support.
 *
 * Ownership: gw_pool_submit consumes the job; workers own it while queued or
 * running; the done callback receives it on the loop thread. A cancelled job
 * (its stream went away) is finished by the worker if already started, then
 * freed on delivery. */
#define _GNU_SOURCE /* pipe2 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "gw_internal.h"

struct gw_pool {
    gw_server *srv;
    pthread_t *threads;
    int n_threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    gw_job *q_head, *q_tail;       /* waiting for a worker */
    gw_job *done_head, *done_tail; /* waiting for the loop */
    bool stop;
    int pipe_rd, pipe_wr;
    struct event *ev;
};

void gw_job_free(gw_job *job) {
    if (!job)
        return;
    if (job->body)
        evbuffer_free(job->body);
    gw_oai_req_clear(&job->req);
    free(job->resp);
    free(job);
}

static void *worker_main(void *arg) {
    gw_pool *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (!p->stop && !p->q_head)
            pthread_cond_wait(&p->cv, &p->mu);
        if (p->stop) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        gw_job *job = p->q_head;
        p->q_head = job->next;
        if (!p->q_head)
            p->q_tail = NULL;
        job->next = NULL;
        pthread_mutex_unlock(&p->mu);

        if (atomic_load(&job->cancelled)) {
            job->rc = -1;
        } else {
            size_t len = evbuffer_get_length(job->body);
            const char *body = len ? (const char *)evbuffer_pullup(job->body, -1) : "";
            if (!body) {
                job->rc = -1;
                job->err.status = 500;
                snprintf(job->err.message, sizeof job->err.message, "out of memory");
            } else if (job->kind == GW_KIND_TOKENIZE || job->kind == GW_KIND_DETOKENIZE) {
                job->rc = gw_oai_tokenize(&p->srv->cfg, p->srv->tok, job->kind, body, len,
                                          &job->resp, &job->err);
            } else {
                job->rc = gw_oai_prepare(&p->srv->cfg, p->srv->tok, job->kind, body, len, &job->req,
                                         &job->err);
            }
        }
        evbuffer_free(job->body); /* not needed any more */
        job->body = NULL;

        pthread_mutex_lock(&p->mu);
        if (p->done_tail)
            p->done_tail->next = job;
        else
            p->done_head = job;
        p->done_tail = job;
        pthread_mutex_unlock(&p->mu);
        char b = 1;
        ssize_t w;
        do
            w = write(p->pipe_wr, &b, 1);
        while (w < 0 && errno == EINTR);
        /* EAGAIN: the pipe is full of wake-ups already; the loop drains the list */
    }
}

static void pool_wake_cb(evutil_socket_t fd, short what, void *arg) {
    gw_pool *p = arg;
    char buf[256];
    while (read(p->pipe_rd, buf, sizeof buf) > 0) {
    }
    pthread_mutex_lock(&p->mu);
    gw_job *list = p->done_head;
    p->done_head = p->done_tail = NULL;
    pthread_mutex_unlock(&p->mu);
    while (list) {
        gw_job *job = list;
        list = job->next;
        job->next = NULL;
        if (job->ud)
            job->done(job, job->ud);
        else
            gw_job_free(job);
    }
}

pd_status gw_pool_init(gw_server *s, int n, gw_pool **p_p, pd_err *err) {
    gw_pool *p = pd_xcalloc(1, sizeof *p);
    p->srv = s;
    int fds[2];
    if (pipe2(fds, O_NONBLOCK | O_CLOEXEC) != 0) {
        free(p);
        return pd_err_set(err, PD_ERR_IO, "gateway: pipe: %s", strerror(errno));
    }
    p->pipe_rd = fds[0];
    p->pipe_wr = fds[1];
    p->ev = event_new(s->base, p->pipe_rd, EV_READ | EV_PERSIST, pool_wake_cb, p);
    if (!p->ev || event_add(p->ev, NULL) != 0) {
        if (p->ev)
            event_free(p->ev);
        close(fds[0]);
        close(fds[1]);
        free(p);
        return pd_err_set(err, PD_ERR_NOMEM, "gateway: cannot create the pool event");
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->threads = pd_xcalloc((size_t)n, sizeof *p->threads);
    for (int i = 0; i < n; i++) {
        int rc = pthread_create(&p->threads[i], NULL, worker_main, p);
        if (rc != 0) {
            gw_pool_free(&p);
            return pd_err_set(err, PD_ERR_NOMEM, "gateway: cannot start tokenizer worker: %s",
                              strerror(rc));
        }
        p->n_threads++;
    }
    *p_p = p;
    return PD_OK;
}

void gw_pool_free(gw_pool **p_p) {
    if (!p_p || !*p_p)
        return;
    gw_pool *p = *p_p;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads; i++)
        pthread_join(p->threads[i], NULL);
    for (gw_job *j = p->q_head, *next; j; j = next) {
        next = j->next;
        gw_job_free(j);
    }
    for (gw_job *j = p->done_head, *next; j; j = next) {
        next = j->next;
        gw_job_free(j);
    }
    event_free(p->ev);
    close(p->pipe_rd);
    close(p->pipe_wr);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->threads);
    free(p);
    *p_p = NULL;
}

void gw_pool_submit(gw_pool *p, gw_job *job) {
    job->next = NULL;
    pthread_mutex_lock(&p->mu);
    if (p->q_tail)
        p->q_tail->next = job;
    else
        p->q_head = job;
    p->q_tail = job;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void gw_pool_cancel(gw_job *job) {
    job->ud = NULL;
    atomic_store(&job->cancelled, true);
}

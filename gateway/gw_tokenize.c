/* POST /tokenize and /detokenize (vLLM's endpoints): the body goes to a
 * tokenizer worker (gw_oai_tokenize, gw_openai.c), which answers with the
 * whole JSON response; this file only ties the job to its stream.
 *
 * Ownership: a tok_req lives from gw_tokenize_begin until its job comes back
 * (it responds and frees itself) or its stream closes first (it cancels the
 * job, which the pool then frees, and frees itself). */
#include <stdlib.h>
#include <string.h>

#include "gw_internal.h"

typedef struct {
    gw_stream *st;
    gw_job *job;
} tok_req;

static void tok_req_done(gw_job *job, void *ud) {
    tok_req *t = ud;
    gw_stream_set_close_cb(t->st, NULL, NULL);
    if (job->rc == 0)
        gw_stream_respond(t->st, 200, "application/json", NULL, 0, job->resp, strlen(job->resp));
    else
        gw_stream_respond_error(t->st, job->err.status ? job->err.status : 400, job->err.message,
                                job->err.param, NULL, 0);
    gw_job_free(job);
    free(t);
}

static void tok_req_on_close(gw_stream *st, void *ud) {
    (void)st;
    tok_req *t = ud;
    gw_pool_cancel(t->job);
    free(t);
}

void gw_tokenize_begin(gw_stream *st, gw_kind kind) {
    gw_server *s = st->conn->srv;
    tok_req *t = calloc(1, sizeof *t);
    gw_job *job = calloc(1, sizeof *job);
    struct evbuffer *body = evbuffer_new();
    if (!t || !job || !body) {
        free(t);
        free(job);
        if (body)
            evbuffer_free(body);
        gw_stream_respond_error(st, 500, "out of memory", NULL, NULL, 0);
        return;
    }
    evbuffer_add_buffer(body, st->body); /* moves the chunks, no copy */
    t->st = st;
    t->job = job;
    job->kind = kind;
    job->body = body;
    job->done = tok_req_done;
    job->ud = t;
    gw_stream_set_close_cb(st, tok_req_on_close, t);
    gw_pool_submit(s->pool, job);
}

/* pdserve prefill: one prefill replica. One thread: the control connection
 * (ZeroMQ DEALER), the UCX agent's event fd, and prefill steps. */
#include "pd_prefill.h"

#include <math.h>
#include <string.h>
#include <unistd.h>

#include "pd_decode.h" /* pd_replay_load */
#include "pd_grammar.h"
#include "pd_replica.h"

#define LOGM "prefill"

typedef struct decode_peer {
    char id[128];
    pd_kvx_peer *peer;
    bool has_rkey;
    struct decode_peer *next;
} decode_peer;

typedef struct job {
    Pdserve__Prefill *msg; /* owned */
    pd_seq_kv kv;          /* local cache */
    int done;              /* prompt tokens computed */
    int blocks_ready;      /* local blocks complete (the last one partial at the end): may be sent */
    int blocks_sent;       /* local blocks written to the decode replica (<= blocks_ready) */
    int puts_inflight;
    bool aborted, failed, flushing, finished_compute;
    int32_t first_token;
    float first_logprob;
    int32_t first_top_ids[PD_MAX_TOP_LOGPROBS]; /* Prefill.logprobs > 0 */
    float first_top_lps[PD_MAX_TOP_LOGPROBS];
    int first_n_top;
    uint64_t bytes;
    double t_start, t_lease_end;
    /* where the job's time went (logged at debug when it is reported):
     * forward passes, device-to-host staging of its blocks, posting the
     * puts; t_computed when the last chunk was done */
    double t_compute, t_stage, t_post, t_computed;
    decode_peer *dp;
    struct job *next;
} job;

typedef struct {
    pd_replica r; /* model, control connection, heartbeat, UCX agent and pool (common/pd_replica.h) */
    pd_kv_cache *kv;
    pd_kv_staging *staging; /* r.staging: the puts read its slots; NULL: the host cache itself */
    char *kv_host;          /* r.kv_host: without staging, the host cache the puts read */
    int chunk;
    bool fail_kv_transfer; /* --debug-fail-kv-transfer */
    job *jobs; /* FIFO */
    decode_peer *peers;
    uint64_t prefill_tokens_total, kv_bytes_sent;
    float *logits;
} prefill_svc;

/* Masks the first token's logits with m's json_schema, if any. Errors:
 * the schema does not compile, or the tokenizer cannot be loaded. */
static pd_status mask_first_token(prefill_svc *p, const Pdserve__Prefill *m, pd_err *err) {
    if (!m->json_schema || !*m->json_schema) return PD_OK;
    const pd_grammar_vocab *vocab = pd_replica_vocab(&p->r); /* loaded at the first such job */
    if (!vocab)
        return pd_err_set(err, PD_ERR_IO, "response_format needs the tokenizer, which this replica could not load");
    pd_grammar *g = NULL;
    pd_grammar_state *gs = NULL;
    pd_err gerr;
    pd_status st = pd_grammar_compile(m->json_schema, strlen(m->json_schema), &g, &gerr);
    if (st != PD_OK) return pd_err_set(err, st, "response_format: %s", gerr.msg);
    st = pd_grammar_state_init(g, vocab, &gs, err);
    if (st == PD_OK) pd_grammar_state_mask_logits(gs, p->logits, -1); /* the first token: no budget known here */
    pd_grammar_state_free(&gs);
    pd_grammar_free(&g);
    return st;
}

static pd_replay *g_replay; /* --debug-replay-tokens: a request's first token is its script's
                               first (EOS when empty) instead of a sample (testing) */

/* The prefill families of the replica's /metrics, from the heartbeat's load. */
static void render_metrics(void *user, const Pdserve__Heartbeat *h, pd_strbuf *b) {
    const char *id = h->replica_id;
    pd_strbuf_printf(b,
                     "# TYPE pdserve:num_requests_running gauge\npdserve:num_requests_running{replica=\"%s\",role=\"prefill\"} %u\n"
                     "# TYPE pdserve:num_requests_waiting gauge\npdserve:num_requests_waiting{replica=\"%s\",role=\"prefill\"} %u\n"
                     "# TYPE pdserve:kv_cache_free_blocks gauge\npdserve:kv_cache_free_blocks{replica=\"%s\",role=\"prefill\"} %u\n"
                     "# TYPE pdserve:replica_prefill_tokens_total counter\npdserve:replica_prefill_tokens_total{replica=\"%s\",role=\"prefill\"} %llu\n"
                     "# TYPE pdserve:kv_transfer_bytes_total counter\npdserve:kv_transfer_bytes_total{replica=\"%s\"} %llu\n",
                     id, h->num_running, id, h->num_waiting, id, h->free_blocks, id,
                     (unsigned long long)h->prefill_tokens_total, id, (unsigned long long)h->kv_bytes_sent);
}

static void send_heartbeat(prefill_svc *p) {
    Pdserve__Heartbeat h = PDSERVE__HEARTBEAT__INIT;
    int n = 0;
    uint64_t tokens = 0;
    for (job *j = p->jobs; j; j = j->next) {
        n++;
        tokens += j->msg->n_prompt_ids - (uint64_t)j->done;
    }
    h.num_running = p->jobs ? 1 : 0;
    h.num_waiting = (uint32_t)(n > 0 ? n - 1 : 0);
    h.free_blocks = (uint32_t)pd_kv_cache_num_free(p->kv);
    h.total_blocks = (uint32_t)pd_kv_cache_num_blocks(p->kv);
    h.tokens_in_flight = tokens;
    h.prefill_tokens_total = p->prefill_tokens_total;
    h.kv_bytes_sent = p->kv_bytes_sent;
    pd_replica_heartbeat(&p->r, &h, render_metrics, p);
}

/* status: 503 when the KV transfer's peer or lease failed (transient: the
 * gateway answers 503 with Retry-After), 500 for internal errors. */
static void send_error(prefill_svc *p, const char *id, int status, const char *msg) {
    pd_replica_send_error(&p->r, id, status, msg);
}

static void job_free(prefill_svc *p, job *j) {
    pd_seq_kv_release(p->kv, &j->kv);
    free(j->kv.block_table);
    protobuf_c_message_free_unpacked(&j->msg->base, NULL);
    free(j);
}

static void job_unlink(prefill_svc *p, job *j) {
    for (job **pp = &p->jobs; *pp; pp = &(*pp)->next)
        if (*pp == j) {
            *pp = j->next;
            return;
        }
}

/* After the flush: tell the gateway (and through it the decode replica). */
static void job_report(prefill_svc *p, job *j) {
    Pdserve__KvComplete k = PDSERVE__KV_COMPLETE__INIT;
    k.request_id = j->msg->request_id;
    k.reservation_id = j->msg->reservation_id;
    k.num_tokens = (uint32_t)j->msg->n_prompt_ids;
    k.first_token = j->first_token;
    k.first_logprob = j->first_logprob;
    Pdserve__TopLogprobs top = PDSERVE__TOP_LOGPROBS__INIT;
    if (j->first_n_top > 0) {
        top.n_ids = top.n_logprobs = (size_t)j->first_n_top;
        top.ids = j->first_top_ids;
        top.logprobs = j->first_top_lps;
        k.first_top_logprobs = &top;
    }
    k.kv_bytes = j->bytes;
    k.transfer_seconds = pd_now_s() - j->t_start;
    PD_LOGD(p->r.role, "%s: request %s: %zu prompt tokens, %llu KV bytes: forward %.4f s, staging to host %.4f s, "
            "puts posted %.4f s, flushed %.4f s after the last chunk; %.4f s in all",
            p->r.replica_id, j->msg->request_id, j->msg->n_prompt_ids, (unsigned long long)j->bytes, j->t_compute,
            j->t_stage, j->t_post, j->t_computed > 0 ? pd_now_s() - j->t_computed : 0.0, k.transfer_seconds);
    k.decode_replica_id = j->msg->decode_replica_id;
    k.prefill_replica_id = (char *)p->r.replica_id;
    k.aborted = j->aborted;
    pd_msg_send(p->r.sock, NULL, 0, PD_MSG_KV_COMPLETE, &k.base);
}

static void on_flushed(void *user, uint64_t tag, pd_status st) {
    job *j = user;
    prefill_svc *p = (prefill_svc *)(uintptr_t)tag;
    if (st != PD_OK) {
        if (!j->aborted) send_error(p, j->msg->request_id, 503, "KV transfer to the decode replica failed");
    } else {
        job_report(p, j);
    }
    job_unlink(p, j);
    job_free(p, j);
}

/* One pd_kvx_put_batch of a job, and the staging slots its puts read
 * (given back when they are locally complete: the bytes have left). */
typedef struct put_batch {
    prefill_svc *p;
    job *j;
    int n_slots;
    int slots[];
} put_batch;

static void on_put_done(void *user, uint64_t tag, pd_status st) {
    (void)tag;
    put_batch *b = user;
    b->j->puts_inflight--;
    if (st != PD_OK) b->j->failed = true;
    if (b->n_slots > 0) pd_kv_staging_release(b->p->staging, b->slots, b->n_slots);
    free(b);
}

static decode_peer *peer_for(prefill_svc *p, job *j, pd_err *err) {
    const Pdserve__Prefill *m = j->msg;
    for (decode_peer *d = p->peers; d; d = d->next)
        if (!strcmp(d->id, m->decode_replica_id)) {
            /* no peer: an earlier reconnect failed (the decode replica was
             * killed while jobs for it were queued: SIGSEGV here, found by
             * the fault matrix) */
            if (d->peer && !pd_kvx_peer_failed(d->peer)) return d;
            /* the decode replica restarted or failed: reconnect */
            pd_kvx_peer_close(&d->peer);
            d->has_rkey = false;
            if (pd_kvx_peer_connect(p->r.agent, m->decode_ucx_address.data, m->decode_ucx_address.len, d, &d->peer,
                                    err) != PD_OK)
                return NULL;
            if (pd_kvx_peer_add_rkey(d->peer, m->decode_kv_rkey.data, m->decode_kv_rkey.len, err) != PD_OK) {
                pd_kvx_peer_close(&d->peer); /* not half-connected: the next job reconnects */
                return NULL;
            }
            d->has_rkey = true;
            return d;
        }
    decode_peer *d = pd_xcalloc(1, sizeof *d);
    snprintf(d->id, sizeof d->id, "%s", m->decode_replica_id);
    if (pd_kvx_peer_connect(p->r.agent, m->decode_ucx_address.data, m->decode_ucx_address.len, d, &d->peer, err) !=
            PD_OK ||
        pd_kvx_peer_add_rkey(d->peer, m->decode_kv_rkey.data, m->decode_kv_rkey.len, err) != PD_OK) {
        if (d->peer) pd_kvx_peer_close(&d->peer);
        free(d);
        return NULL;
    }
    d->has_rkey = true;
    d->next = p->peers;
    p->peers = d;
    return d;
}

/* Writes local blocks [j->blocks_sent, j->blocks_ready) to the decode
 * replica's granted blocks, as many as there are free staging slots for
 * (all without staging); the rest wait for slots that puts in flight give
 * back (advance calls again). Each block is written once, when it is
 * complete (or at the end for the last, partial one), so no two puts
 * touch the same bytes. */
static void send_blocks(prefill_svc *p, job *j) {
    if (j->blocks_ready <= j->blocks_sent || j->aborted || j->failed) return;
    if (pd_now_s() > j->t_lease_end) {
        j->failed = true;
        send_error(p, j->msg->request_id, 503, "the KV reservation's lease ran out before the prefill finished");
        return;
    }
    if (p->fail_kv_transfer) { /* testing: as if the decode replica's end had failed */
        j->failed = true;
        send_error(p, j->msg->request_id, 503, "KV transfer to the decode replica failed (--debug-fail-kv-transfer)");
        return;
    }
    size_t bb = pd_kv_cache_block_bytes(p->kv);
    int n = j->blocks_ready - j->blocks_sent;
    if (p->staging && n > pd_kv_staging_num_free(p->staging)) n = pd_kv_staging_num_free(p->staging);
    if (n == 0) return; /* every slot is in flight: the job waits for some */
    put_batch *pb = pd_xmalloc(sizeof *pb + (p->staging ? (size_t)n * sizeof(int) : 0));
    *pb = (put_batch){.p = p, .j = j, .n_slots = p->staging ? n : 0};
    const int *blocks = j->kv.block_table + j->blocks_sent;
    pd_status sa = p->staging ? pd_kv_staging_alloc(p->staging, n, pb->slots) : PD_OK;
    PD_ASSERT(sa == PD_OK); /* n is at most the free slots */
    pd_err err = {{0}};
    /* the blocks leave from host memory: into the staging slots first (a
     * no-op when the cache is host memory and not staged) */
    double t0 = pd_now_s();
    if (pd_kv_cache_stage_out(p->kv, p->staging, blocks, pb->slots, n, &err) != PD_OK) {
        if (pb->n_slots > 0) pd_kv_staging_release(p->staging, pb->slots, pb->n_slots);
        free(pb);
        j->failed = true;
        send_error(p, j->msg->request_id, 500, err.msg);
        return;
    }
    double t1 = pd_now_s();
    j->t_stage += t1 - t0;
    pd_kvx_iov *iov = pd_xmalloc((size_t)n * sizeof *iov);
    for (int i = 0; i < n; i++) {
        iov[i].local = p->staging ? pd_kv_staging_slot_ptr(p->staging, pb->slots[i])
                                  : p->kv_host + (size_t)blocks[i] * bb;
        iov[i].remote_offset = (uint64_t)j->msg->block_ids[j->blocks_sent + i] * bb;
        iov[i].bytes = bb;
    }
    if (pd_kvx_put_batch(j->dp->peer, iov, (size_t)n, (uint64_t)(uintptr_t)p, on_put_done, pb, &err) != PD_OK) {
        if (pb->n_slots > 0) pd_kv_staging_release(p->staging, pb->slots, pb->n_slots);
        free(pb);
        j->failed = true;
        send_error(p, j->msg->request_id, 503, err.msg);
    } else {
        j->puts_inflight++;
        j->t_post += pd_now_s() - t1;
        j->blocks_sent += n;
        j->bytes += (uint64_t)n * bb;
        p->kv_bytes_sent += (uint64_t)n * bb;
    }
    free(iov);
}

static void start_flush(prefill_svc *p, job *j) {
    pd_err err = {{0}};
    j->flushing = true;
    if (!j->dp || pd_kvx_flush(j->dp->peer, (uint64_t)(uintptr_t)p, on_flushed, j, &err) != PD_OK) {
        if (!j->aborted) send_error(p, j->msg->request_id, 503, err.msg[0] ? err.msg : "KV flush failed");
        else if (!j->dp) job_report(p, j); /* nothing was written: the blocks are free to reuse */
        job_unlink(p, j);
        job_free(p, j);
    }
}

/* One chunk of the oldest job that still computes. */
static bool step(prefill_svc *p) {
    job *j = p->jobs;
    while (j && (j->finished_compute || j->aborted || j->failed)) j = j->next;
    if (!j) return false;
    pd_err err = {{0}};
    const Pdserve__Prefill *m = j->msg;
    int n_prompt = (int)m->n_prompt_ids;
    int bs = pd_kv_cache_block_size(p->kv);
    if (j->done == 0) {
        int need = (n_prompt + bs - 1) / bs;
        if ((int)m->n_block_ids < need) {
            j->failed = true;
            send_error(p, m->request_id, 500, "the decode replica reserved too few blocks for the prompt");
            return true;
        }
        j->dp = peer_for(p, j, &err);
        if (!j->dp) {
            j->failed = true;
            send_error(p, m->request_id, 503, err.msg[0] ? err.msg : "cannot reach the decode replica");
            return true;
        }
    }
    int n = n_prompt - j->done < p->chunk ? n_prompt - j->done : p->chunk;
    if (pd_seq_kv_reserve(p->kv, &j->kv, n) != PD_OK)
        return false; /* local cache full: wait for earlier jobs to finish */
    pd_batch_seq b = {.kv = &j->kv, .tokens = m->prompt_ids + j->done, .n_tokens = n};
    double tf = pd_now_s();
    if (pd_model_forward(p->r.m, p->kv, &b, 1, p->logits, &err) != PD_OK) {
        j->failed = true;
        send_error(p, m->request_id, 500, err.msg);
        return true;
    }
    j->t_compute += pd_now_s() - tf;
    j->done += n;
    p->prefill_tokens_total += (uint64_t)n;
    bool last = j->done == n_prompt;
    if (last)
        j->t_computed = pd_now_s();
    j->blocks_ready = last ? j->kv.num_blocks : j->done / bs;
    send_blocks(p, j);
    if (last) {
        pd_sampling_params sp = pd_replica_sampling(m->sampling);
        pd_sampler *smp = NULL;
        pd_status sst = pd_sampler_init(&sp, pd_model_config_of(p->r.m)->vocab_size, m->prompt_ids, n_prompt, &smp, &err);
        if (sst != PD_OK) { /* the request's parameters (400), as on the decode replica */
            j->failed = true;
            send_error(p, m->request_id, pd_replica_error_status(sst), err.msg);
            return true;
        }
        if (m->min_tokens > 0) { /* vLLM min_tokens: the first token cannot end the request */
            const pd_model_config *c = pd_model_config_of(p->r.m);
            if (!m->ignore_eos) p->logits[c->eos_token_id] = -INFINITY;
            for (size_t i = 0; i < m->n_stop_token_ids; i++)
                if (m->stop_token_ids[i] >= 0 && m->stop_token_ids[i] < c->vocab_size)
                    p->logits[m->stop_token_ids[i]] = -INFINITY;
        }
        if (mask_first_token(p, m, &err) != PD_OK) {
            pd_sampler_free(&smp);
            j->failed = true;
            send_error(p, m->request_id, 500, err.msg);
            return true;
        }
        /* the gateway allows at most PD_MAX_TOP_LOGPROBS alternatives */
        int k = m->logprobs < 0 ? 0 : m->logprobs > PD_MAX_TOP_LOGPROBS ? PD_MAX_TOP_LOGPROBS : m->logprobs;
        j->first_token = pd_sampler_sample_top(smp, p->logits, &j->first_logprob, k, j->first_top_ids,
                                               j->first_top_lps, &j->first_n_top);
        if (g_replay) {
            int n_script = 0;
            const int32_t *script = pd_replay_script(g_replay, &sp, &n_script);
            j->first_token = n_script > 0 ? script[0] : pd_model_config_of(p->r.m)->eos_token_id;
        }
        pd_sampler_free(&smp);
        j->finished_compute = true;
    }
    return true;
}

/* Blocks that waited for staging slots are sent; jobs whose puts are all
 * locally complete: flush (finished and every block sent, or aborted) or
 * drop (failed). */
static void advance(prefill_svc *p) {
    for (job *j = p->jobs; j;) {
        job *next = j->next;
        if (!j->flushing) send_blocks(p, j);
        if (!j->flushing && j->puts_inflight == 0) {
            if (j->failed) {
                if (j->dp) {
                    j->aborted = true; /* flush, then tell the decode side its blocks are free */
                    start_flush(p, j);
                } else {
                    job_unlink(p, j);
                    job_free(p, j);
                }
            } else if ((j->finished_compute && j->blocks_sent == j->kv.num_blocks) || j->aborted) {
                start_flush(p, j);
            }
        }
        j = next;
    }
}

/* A message from the gateway (pd_replica_handler; RegisterReply is the session's). */
static void handle(void *user, pd_msg *msg) {
    prefill_svc *p = user;
    switch (msg->type) {
    case PD_MSG_PREFILL: {
        Pdserve__Prefill *m = (Pdserve__Prefill *)msg->msg;
        if (m->n_prompt_ids == 0 || !m->decode_replica_id || !m->decode_replica_id[0]) {
            send_error(p, m->request_id, 500, "prefill request without a prompt or a decode replica");
            break;
        }
        job *j = pd_xcalloc(1, sizeof *j);
        j->msg = m;
        msg->msg = NULL;
        j->t_start = pd_now_s();
        /* the decode replica's lease (kvtransfer/pd_kvtransfer.h, the
         * reservation protocol): its ttl less a margin, from receipt; an
         * older decode replica sends none (its ttl is 120 s) */
        j->t_lease_end = j->t_start + (m->lease_ms > 0 ? m->lease_ms / 1000.0 : 100.0);
        job **pp = &p->jobs;
        while (*pp) pp = &(*pp)->next;
        *pp = j;
        break;
    }
    case PD_MSG_ABORT: {
        Pdserve__Abort *a = (Pdserve__Abort *)msg->msg;
        for (job *j = p->jobs; j; j = j->next)
            if (!strcmp(j->msg->request_id, a->request_id)) j->aborted = true;
        break;
    }
    default:
        PD_LOGW(LOGM, "unexpected %s message from the gateway", pd_msg_type_name(msg->type));
    }
}

/* --chunked-prefill-size's default: on a GPU a chunk reads every expert's
 * weights once, so 512-token chunks made an 8K prompt's prefill 0.6-0.9 s
 * on the H200 against 0.17 s in one 8K chunk (docs/benchmarks.md, session
 * 5); SGLang's default on such GPUs is 8192 too. */
#define PREFILL_CHUNK_CPU 512
#define PREFILL_CHUNK_GPU 8192

int pd_prefill_main(int argc, char **argv) {
    int chunk = -1; /* not given: the device's default */
    int max_num_seqs = 0, max_batched = 0; /* accepted for symmetry with decode (ignored) */
    bool fail_kv_transfer = false;
    const pd_flag own[] = {
        {"debug-fail-kv-transfer", PD_FLAG_BOOL, &fail_kv_transfer,
         "testing: every KV transfer fails as if the decode replica's end had (the request gets a 503)"},
        {"chunked-prefill-size", PD_FLAG_INT, &chunk, "tokens per prefill step (default 512 on the CPU, 8192 on a GPU)"},
        {"max-num-seqs", PD_FLAG_INT, &max_num_seqs, "(decode flag, ignored here)"},
        {"max-num-batched-tokens", PD_FLAG_INT, &max_batched, "(decode flag, ignored here)"},
    };
    pd_replica_args a;
    int rc = pd_replica_flags_parse("prefill", &a, own, (int)(sizeof own / sizeof own[0]), argc, argv);
    if (rc >= 0) return rc;
    if (chunk == -1)
        chunk = a.device && !strcmp(a.device, "cuda") ? PREFILL_CHUNK_GPU : PREFILL_CHUNK_CPU;
    if (!a.model || chunk <= 0) {
        fprintf(stderr, "pdserve prefill: --model is required and --chunked-prefill-size must be positive\n");
        return 2;
    }
    prefill_svc p = {.chunk = chunk, .fail_kv_transfer = fail_kv_transfer};
    pd_replica_init(&p.r, "prefill", &a);
    const char *replica_id = p.r.replica_id;
    pd_err err = {{0}};
    if ((rc = pd_replica_load(&p.r)) != 0) goto out;
    rc = 1;
    if (pd_kv_cache_init(p.r.m, a.block_size, p.r.num_blocks, &p.kv, &err) != PD_OK) {
        fprintf(stderr, "pdserve prefill: %s\n", err.msg);
        goto out;
    }
    pd_replica_phase(&p.r, "allocate KV");
    /* the puts read the staging pool (or a host cache); decode replicas
     * name the blocks they land in */
    if (pd_replica_kv_pool(&p.r, p.kv, false) != 0) goto out;
    p.kv_host = p.r.kv_host;
    p.staging = p.r.staging;
    if (a.replay_path) {
        if (pd_replay_load(a.replay_path, pd_model_config_of(p.r.m)->vocab_size, &g_replay, &err) != PD_OK) {
            fprintf(stderr, "pdserve prefill: --debug-replay-tokens: %s\n", err.msg);
            rc = 2;
            goto out;
        }
        PD_LOGW(LOGM, "replaying scripted tokens from %s instead of sampling (testing)", a.replay_path);
    }
    p.logits = pd_xmalloc((size_t)pd_model_config_of(p.r.m)->vocab_size * sizeof(float));
    if (pd_replica_connect(&p.r) != 0) goto out;
    PD_LOGI(LOGM, "%s: model %s, chunk %d tokens, %d KV blocks of %d, gateway %s", replica_id, a.model, chunk,
            p.r.num_blocks, a.block_size, a.gateway);
    if (pd_replica_serve(&p.r) != 0) goto out;
    send_heartbeat(&p);
    rc = 0;
    while (!pd_replica_stopping()) {
        bool busy = false;
        for (job *j = p.jobs; j; j = j->next)
            if (!j->finished_compute && !j->aborted && !j->failed) busy = true;
        if (pd_kvx_agent_progress(p.r.agent)) busy = true;
        long wait_ms = pd_replica_wait_ms(&p.r, busy);
        if (p.jobs && wait_ms > 5) wait_ms = 5; /* transfers in flight: keep progressing */
        pd_replica_poll(&p.r, wait_ms);
        pd_replica_recv_all(&p.r, handle, &p);
        /* --debug-step-delay-ms: fault tests slow a replica down */
        if (step(&p) && a.step_delay_ms > 0) usleep((useconds_t)a.step_delay_ms * 1000);
        pd_kvx_agent_progress(p.r.agent);
        advance(&p);
        if (pd_replica_tick(&p.r)) send_heartbeat(&p);
        /* draining: done once no job is left (its KV sent, or it failed) */
        if (pd_replica_draining() && pd_replica_drained(&p.r, p.jobs == NULL)) break;
    }
    PD_LOGI(LOGM, "%s: stopping", replica_id);
    if (p.r.displaced) rc = 1;
out:
    /* Transfers may still be in flight: close the peers, then free the
     * agent (pd_replica_disconnect), which gives every outstanding put and
     * flush its callback, while the jobs those callbacks name still exist
     * (freeing the jobs first crashed a SIGTERM'd replica in on_flushed and
     * in the orphaned operations' send_error: found by helper-29); then the
     * jobs no callback freed. */
    while (p.peers) {
        decode_peer *d = p.peers;
        p.peers = d->next;
        pd_kvx_peer_close(&d->peer);
        free(d);
    }
    pd_replica_disconnect(&p.r);
    while (p.jobs) {
        job *j = p.jobs;
        p.jobs = j->next;
        job_free(&p, j);
    }
    free(p.logits);
    pd_kv_cache_free(&p.kv);
    pd_replay_free(&g_replay);
    pd_replica_free(&p.r);
    return rc;
}

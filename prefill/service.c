/* pdserve prefill: one prefill replica. One thread: the control connection
 * (ZeroMQ DEALER), the UCX agent's event fd, and prefill steps. */
#include "pd_prefill.h"

#include <errno.h>
#include <malloc.h>
#include <math.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "pd_flags.h"
#include "pd_grammar.h"
#include "pd_heartbeat.h"
#include "pd_metrics.h"
#include "pd_metrics_server.h"
#include "pd_kvtransfer.h"
#include "pd_model.h"
#include "pd_decode.h" /* pd_replay_load */
#include "pd_msg.h"
#include "pd_replica_ops.h"
#include "pd_version.h"

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
    int blocks_sent;       /* local blocks written to the decode replica */
    int puts_inflight;
    bool aborted, failed, flushing, finished_compute;
    int32_t first_token;
    float first_logprob;
    int32_t first_top_ids[PD_MAX_TOP_LOGPROBS]; /* Prefill.logprobs > 0 */
    float first_top_lps[PD_MAX_TOP_LOGPROBS];
    int first_n_top;
    uint64_t bytes;
    double t_start, t_lease_end;
    decode_peer *dp;
    struct job *next;
} job;

typedef struct {
    void *zctx, *sock;
    const char *replica_id;
    pd_model *m;
    pd_kv_cache *kv;
    char *kv_host; /* host pool the puts read (pd_kv_cache_host_pool) */
    int chunk;
    job *jobs; /* FIFO */
    pd_kvx_agent *agent;
    pd_kvx_pool *pool;
    decode_peer *peers;
    bool registered;
    pd_hb *hb;
    pd_metrics_server *metrics;
    double last_heartbeat, last_register;
    int heartbeat_ms;
    uint64_t prefill_tokens_total, kv_bytes_sent;
    float *logits;
    /* response_format (see decode/service.c): built at the first such job */
    const char *tokenizer_path;
    pd_grammar_vocab *vocab;
    bool vocab_tried;
} prefill_svc;

/* Masks the first token's logits with m's json_schema, if any. Errors:
 * the schema does not compile, or the tokenizer cannot be loaded. */
static pd_status mask_first_token(prefill_svc *p, const Pdserve__Prefill *m, pd_err *err) {
    if (!m->json_schema || !*m->json_schema) return PD_OK;
    const pd_model_config *c = pd_model_config_of(p->m);
    if (!p->vocab_tried) {
        p->vocab_tried = true;
        pd_err lerr = {{0}};
        if (pd_grammar_vocab_load(p->tokenizer_path, c->vocab_size, c->eos_token_id, &p->vocab, &lerr) != PD_OK)
            PD_LOGE(LOGM, "%s: response_format is unavailable: %s", p->replica_id, lerr.msg);
        else
            malloc_trim(0); /* parsing tokenizer.json left ~30 MB free in the heap; ~3 ms, once */
    }
    if (!p->vocab)
        return pd_err_set(err, PD_ERR_INVALID, "response_format needs the tokenizer, which this replica could not load");
    pd_grammar *g = NULL;
    pd_grammar_state *gs = NULL;
    pd_err gerr;
    pd_status st = pd_grammar_compile(m->json_schema, strlen(m->json_schema), &g, &gerr);
    if (st != PD_OK) return pd_err_set(err, st, "response_format: %s", gerr.msg);
    st = pd_grammar_state_init(g, p->vocab, &gs, err);
    if (st == PD_OK) pd_grammar_state_mask_logits(gs, p->logits, -1); /* the first token: no budget known here */
    pd_grammar_state_free(&gs);
    pd_grammar_free(&g);
    return st;
}

static volatile sig_atomic_t g_stop;
static int g_step_delay_ms; /* --debug-step-delay-ms: fault tests slow a replica down */
static pd_replay *g_replay; /* --debug-replay-tokens: a request's first token is its script's
                               first (EOS when empty) instead of a sample (testing) */
static void on_signal(int sig) { g_stop = 1; }

static void send_register(prefill_svc *p) {
    const pd_model_config *c = pd_model_config_of(p->m);
    Pdserve__KvGeometry geo = PDSERVE__KV_GEOMETRY__INIT;
    geo.block_size = (uint32_t)pd_kv_cache_block_size(p->kv);
    geo.num_layers = (uint32_t)c->num_hidden_layers;
    geo.kv_lora_rank = (uint32_t)c->kv_lora_rank;
    geo.qk_rope_head_dim = (uint32_t)c->qk_rope_head_dim;
    geo.dtype_bytes = 4;
    geo.num_blocks = (uint32_t)pd_kv_cache_num_blocks(p->kv);
    const void *addr;
    size_t addr_len;
    pd_kvx_agent_worker_address(p->agent, &addr, &addr_len);
    Pdserve__Register r = PDSERVE__REGISTER__INIT;
    r.role = "prefill";
    r.replica_id = (char *)p->replica_id;
    r.geometry = &geo;
    r.model_fingerprint = pd_config_fingerprint(c);
    r.ucx_worker_address.data = (uint8_t *)addr;
    r.ucx_worker_address.len = addr_len;
    r.pid = (uint32_t)getpid();
    pd_msg_send(p->sock, NULL, 0, PD_MSG_REGISTER, &r.base);
    p->last_register = pd_now_s();
}

static void send_heartbeat(prefill_svc *p) {
    Pdserve__Heartbeat h = PDSERVE__HEARTBEAT__INIT;
    h.replica_id = (char *)p->replica_id;
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
    pd_hb_update(p->hb, &h); /* the heartbeat thread sends it */
    if (p->metrics) { /* the replica's own /metrics (--metrics-port) */
        pd_strbuf b = {0};
        const char *id = p->replica_id;
        pd_strbuf_printf(&b,
                         "# TYPE pdserve:num_requests_running gauge\npdserve:num_requests_running{replica=\"%s\",role=\"prefill\"} %u\n"
                         "# TYPE pdserve:num_requests_waiting gauge\npdserve:num_requests_waiting{replica=\"%s\",role=\"prefill\"} %u\n"
                         "# TYPE pdserve:kv_cache_free_blocks gauge\npdserve:kv_cache_free_blocks{replica=\"%s\",role=\"prefill\"} %u\n"
                         "# TYPE pdserve:replica_prefill_tokens_total counter\npdserve:replica_prefill_tokens_total{replica=\"%s\",role=\"prefill\"} %llu\n"
                         "# TYPE pdserve:kv_transfer_bytes_total counter\npdserve:kv_transfer_bytes_total{replica=\"%s\"} %llu\n",
                         id, h.num_running, id, h.num_waiting, id, h.free_blocks, id,
                         (unsigned long long)p->prefill_tokens_total, id, (unsigned long long)p->kv_bytes_sent);
        pd_metrics_server_publish(p->metrics, b.data, b.len);
        pd_strbuf_free(&b);
    }
    p->last_heartbeat = pd_now_s();
}

static void send_error(prefill_svc *p, const char *id, const char *msg) {
    Pdserve__Tokens t = PDSERVE__TOKENS__INIT;
    t.request_id = (char *)id;
    t.finished = true;
    t.error = (char *)msg;
    pd_msg_send(p->sock, NULL, 0, PD_MSG_TOKENS, &t.base);
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
    k.decode_replica_id = j->msg->decode_replica_id;
    k.prefill_replica_id = (char *)p->replica_id;
    k.aborted = j->aborted;
    pd_msg_send(p->sock, NULL, 0, PD_MSG_KV_COMPLETE, &k.base);
}

static void on_flushed(void *user, uint64_t tag, pd_status st) {
    job *j = user;
    prefill_svc *p = (prefill_svc *)(uintptr_t)tag;
    if (st != PD_OK) {
        if (!j->aborted) send_error(p, j->msg->request_id, "KV transfer to the decode replica failed");
    } else {
        job_report(p, j);
    }
    job_unlink(p, j);
    job_free(p, j);
}

static void on_put_done(void *user, uint64_t tag, pd_status st) {
    job *j = user;
    j->puts_inflight--;
    if (st != PD_OK) j->failed = true;
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
            if (pd_kvx_peer_connect(p->agent, m->decode_ucx_address.data, m->decode_ucx_address.len, d, &d->peer,
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
    if (pd_kvx_peer_connect(p->agent, m->decode_ucx_address.data, m->decode_ucx_address.len, d, &d->peer, err) !=
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

/* Writes local blocks [j->blocks_sent, upto) to the decode replica's
 * granted blocks. Each block is written once, when it is complete (or at
 * the end for the last, partial one), so no two puts touch the same bytes. */
static void send_blocks(prefill_svc *p, job *j, int upto) {
    if (upto <= j->blocks_sent || j->aborted || j->failed) return;
    if (pd_now_s() > j->t_lease_end) {
        j->failed = true;
        send_error(p, j->msg->request_id, "the KV reservation's lease ran out before the prefill finished");
        return;
    }
    size_t bb = pd_kv_cache_block_bytes(p->kv);
    int n = upto - j->blocks_sent;
    pd_err err = {{0}};
    /* the blocks leave from host memory: stage them there first (a no-op
     * when the cache is host memory) */
    if (pd_kv_cache_download_blocks(p->kv, j->kv.block_table + j->blocks_sent, n, &err) != PD_OK) {
        j->failed = true;
        send_error(p, j->msg->request_id, err.msg);
        return;
    }
    pd_kvx_iov *iov = pd_xmalloc((size_t)n * sizeof *iov);
    for (int i = 0; i < n; i++) {
        int b = j->blocks_sent + i;
        iov[i].local = p->kv_host + (size_t)j->kv.block_table[b] * bb;
        iov[i].remote_offset = (uint64_t)j->msg->block_ids[b] * bb;
        iov[i].bytes = bb;
    }
    if (pd_kvx_put_batch(j->dp->peer, iov, (size_t)n, (uint64_t)(uintptr_t)p, on_put_done, j, &err) != PD_OK) {
        j->failed = true;
        send_error(p, j->msg->request_id, err.msg);
    } else {
        j->puts_inflight++;
        j->blocks_sent = upto;
        j->bytes += (uint64_t)n * bb;
        p->kv_bytes_sent += (uint64_t)n * bb;
    }
    free(iov);
}

static void start_flush(prefill_svc *p, job *j) {
    pd_err err = {{0}};
    j->flushing = true;
    if (!j->dp || pd_kvx_flush(j->dp->peer, (uint64_t)(uintptr_t)p, on_flushed, j, &err) != PD_OK) {
        if (!j->aborted) send_error(p, j->msg->request_id, err.msg[0] ? err.msg : "KV flush failed");
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
            send_error(p, m->request_id, "the decode replica reserved too few blocks for the prompt");
            return true;
        }
        j->dp = peer_for(p, j, &err);
        if (!j->dp) {
            j->failed = true;
            send_error(p, m->request_id, err.msg[0] ? err.msg : "cannot reach the decode replica");
            return true;
        }
    }
    int n = n_prompt - j->done < p->chunk ? n_prompt - j->done : p->chunk;
    if (pd_seq_kv_reserve(p->kv, &j->kv, n) != PD_OK)
        return false; /* local cache full: wait for earlier jobs to finish */
    pd_batch_seq b = {.kv = &j->kv, .tokens = m->prompt_ids + j->done, .n_tokens = n};
    if (pd_model_forward(p->m, p->kv, &b, 1, p->logits, &err) != PD_OK) {
        j->failed = true;
        send_error(p, m->request_id, err.msg);
        return true;
    }
    j->done += n;
    p->prefill_tokens_total += (uint64_t)n;
    bool last = j->done == n_prompt;
    send_blocks(p, j, last ? j->kv.num_blocks : j->done / bs);
    if (last) {
        pd_sampling_params sp = pd_sampling_defaults();
        const Pdserve__SamplingParams *s = m->sampling;
        if (s) {
            sp.temperature = s->temperature;
            sp.top_k = s->top_k;
            sp.top_p = s->top_p;
            sp.min_p = s->min_p;
            sp.presence_penalty = s->presence_penalty;
            sp.frequency_penalty = s->frequency_penalty;
            sp.repetition_penalty = s->repetition_penalty;
            sp.seed = s->seed;
            sp.has_seed = s->has_seed;
        }
        pd_sampler *smp = NULL;
        if (pd_sampler_init(&sp, pd_model_config_of(p->m)->vocab_size, m->prompt_ids, n_prompt, &smp, &err) != PD_OK) {
            j->failed = true;
            send_error(p, m->request_id, err.msg);
            return true;
        }
        if (m->min_tokens > 0) { /* vLLM min_tokens: the first token cannot end the request */
            const pd_model_config *c = pd_model_config_of(p->m);
            if (!m->ignore_eos) p->logits[c->eos_token_id] = -INFINITY;
            for (size_t i = 0; i < m->n_stop_token_ids; i++)
                if (m->stop_token_ids[i] >= 0 && m->stop_token_ids[i] < c->vocab_size)
                    p->logits[m->stop_token_ids[i]] = -INFINITY;
        }
        if (mask_first_token(p, m, &err) != PD_OK) {
            pd_sampler_free(&smp);
            j->failed = true;
            send_error(p, m->request_id, err.msg);
            return true;
        }
        /* the gateway allows at most PD_MAX_TOP_LOGPROBS alternatives */
        int k = m->logprobs < 0 ? 0 : m->logprobs > PD_MAX_TOP_LOGPROBS ? PD_MAX_TOP_LOGPROBS : m->logprobs;
        j->first_token = pd_sampler_sample_top(smp, p->logits, &j->first_logprob, k, j->first_top_ids,
                                               j->first_top_lps, &j->first_n_top);
        if (g_replay) {
            int n_script = 0;
            const int32_t *script = pd_replay_script(g_replay, &sp, &n_script);
            j->first_token = n_script > 0 ? script[0] : pd_model_config_of(p->m)->eos_token_id;
        }
        pd_sampler_free(&smp);
        j->finished_compute = true;
    }
    return true;
}

/* Jobs whose puts are all locally complete: flush (finished or aborted) or
 * drop (failed). */
static void advance(prefill_svc *p) {
    for (job *j = p->jobs; j;) {
        job *next = j->next;
        if (!j->flushing && j->puts_inflight == 0) {
            if (j->failed) {
                if (j->dp) {
                    j->aborted = true; /* flush, then tell the decode side its blocks are free */
                    start_flush(p, j);
                } else {
                    job_unlink(p, j);
                    job_free(p, j);
                }
            } else if (j->finished_compute || j->aborted) {
                start_flush(p, j);
            }
        }
        j = next;
    }
}

static void handle(prefill_svc *p, pd_msg *msg) {
    switch (msg->type) {
    case PD_MSG_REGISTER_REPLY: {
        Pdserve__RegisterReply *r = (Pdserve__RegisterReply *)msg->msg;
        p->registered = r->accepted;
        if (r->accepted) {
            if (r->heartbeat_interval_ms) {
                p->heartbeat_ms = (int)r->heartbeat_interval_ms;
                pd_hb_set_interval(p->hb, p->heartbeat_ms);
            }
            PD_LOGI(LOGM, "%s: registered with the gateway", p->replica_id);
        } else {
            PD_LOGW(LOGM, "%s: gateway refused registration: %s", p->replica_id, r->reason);
            if (strstr(r->reason, "fingerprint") || strstr(r->reason, "geometry")) g_stop = 1;
        }
        break;
    }
    case PD_MSG_PREFILL: {
        Pdserve__Prefill *m = (Pdserve__Prefill *)msg->msg;
        if (m->n_prompt_ids == 0 || !m->decode_replica_id || !m->decode_replica_id[0]) {
            send_error(p, m->request_id, "prefill request without a prompt or a decode replica");
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

int pd_prefill_main(int argc, char **argv) {
    const char *model = NULL, *gateway = "tcp://127.0.0.1:8001", *replica_id = NULL, *device = "cpu";
    const char *tokenizer = NULL;
    int chunk = 512, block_size = 16, num_blocks = 0, threads = 0, heartbeat_ms = 500, metrics_port = 0, tp = 1;
    double gpu_mem_util = 0.0; /* 0: not given */
    const char *metrics_host = "127.0.0.1";
    int max_num_seqs = 0, max_batched = 0; /* accepted for symmetry with decode (ignored) */
    bool verify_ckpt = false;
    const char *ckpt_manifest = NULL, *replay_path = NULL;
    const char *numa = "auto";
    bool inject_selfcheck_failure = false;
    bool expert_parallel = false;
    pd_flag flags[] = {
        {"model", PD_FLAG_STR, &model, "checkpoint directory"},
        {"gateway", PD_FLAG_STR, &gateway, "gateway control endpoint (default tcp://127.0.0.1:8001)"},
        {"replica-id", PD_FLAG_STR, &replica_id, "unique name of this replica (default prefill-<pid>)"},
        {"tokenizer", PD_FLAG_STR, &tokenizer,
         "tokenizer.json for response_format's token mask (default <model>/tokenizer.json; read at the first such request)"},
        {"chunked-prefill-size", PD_FLAG_INT, &chunk, "tokens per prefill step (default 512)"},
        {"block-size", PD_FLAG_INT, &block_size, "KV cache block, tokens (default 16; must match decode)"},
        {"num-kv-blocks", PD_FLAG_INT, &num_blocks,
         "local KV cache blocks (default 4096; with --gpu-memory-utilization: overrides its plan)"},
        {"gpu-memory-utilization", PD_FLAG_FLOAT, &gpu_mem_util,
         "CUDA: size the KV cache so this replica takes this fraction (0, 1] of each GPU's memory in all (vLLM's "
         "meaning; replicas sharing a GPU each take their own fraction)"},
        {"device", PD_FLAG_STR, &device, "cpu (default) or cuda"},
        {"threads", PD_FLAG_INT, &threads, "CPU threads (0: all)"},
        {"tensor-parallel-size", PD_FLAG_INT, &tp,
         "shard the model over GPUs 0..N-1 (CUDA_VISIBLE_DEVICES picks them) or N CPU threads (default 1)"},
        {"enable-expert-parallel", PD_FLAG_BOOL, &expert_parallel,
         "with --tensor-parallel-size N: routed experts divided whole over the N ranks (rank r: experts "
         "[r*E/N, (r+1)*E/N); N must divide them) instead of each split; attention and shared experts stay "
         "tensor parallel"},
        {"heartbeat-interval-ms", PD_FLAG_INT, &heartbeat_ms, "load report period (default 500)"},
        {"metrics-port", PD_FLAG_INT, &metrics_port, "serve this replica's /metrics on this port (0: off)"},
        {"metrics-host", PD_FLAG_STR, &metrics_host, "address of --metrics-port (default 127.0.0.1)"},
        {"debug-step-delay-ms", PD_FLAG_INT, &g_step_delay_ms, "testing: sleep this long after every step"},
        {"debug-replay-tokens", PD_FLAG_STR, &replay_path,
         "testing: JSON array of token ids every request generates (the first one here) instead of samples"},
        {"max-num-seqs", PD_FLAG_INT, &max_num_seqs, "(decode flag, ignored here)"},
        {"max-num-batched-tokens", PD_FLAG_INT, &max_batched, "(decode flag, ignored here)"},
        {"verify-checkpoint", PD_FLAG_BOOL, &verify_ckpt, "check files, headers and config first; refuse to start otherwise"},
        {"checkpoint-manifest", PD_FLAG_STR, &ckpt_manifest, "with --verify-checkpoint: SHA-256 of every file against it"},
        {"numa", PD_FLAG_STR, &numa,
         "auto (the NUMA node of the GPUs; none for a CPU replica), off, or a node number: bind threads and host memory"},
        {"debug-inject-selfcheck-failure", PD_FLAG_BOOL, &inject_selfcheck_failure,
         "testing: the start-up all-reduce check sees a wrong value (the replica must refuse to register)"},
    };
    int rc = pd_flags_parse("prefill", flags, (int)(sizeof flags / sizeof flags[0]), argc, argv);
    if (rc) return rc == 1 ? 0 : 2;
    pd_version_log(LOGM);
    if (!model || chunk <= 0) {
        fprintf(stderr, "pdserve prefill: --model is required and --chunked-prefill-size must be positive\n");
        return 2;
    }
    {
        pd_err ferr = {{0}};
        if (pd_replica_kv_flags_check(device, gpu_mem_util, num_blocks, &ferr) != PD_OK) {
            fprintf(stderr, "pdserve prefill: %s\n", ferr.msg);
            return 2;
        }
    }
    char rid[64];
    if (!replica_id) {
        snprintf(rid, sizeof rid, "prefill-%d", (int)getpid());
        replica_id = rid;
    }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    signal(SIGPIPE, SIG_IGN);
    prefill_svc p = {.replica_id = replica_id, .chunk = chunk, .heartbeat_ms = heartbeat_ms};
    char tokpath[4096];
    snprintf(tokpath, sizeof tokpath, "%s/tokenizer.json", model ? model : ".");
    p.tokenizer_path = tokenizer ? tokenizer : tokpath;
    pd_err err = {{0}};
    pd_backend *bes[PD_TP_MAX_RANKS] = {0}; /* tensor-parallel ranks; bes[1..] NULL with one */
    double t0 = pd_now_s(), t = t0;
    if (verify_ckpt || ckpt_manifest) {
        if (pd_verify_at_start(model, ckpt_manifest, LOGM, &err) != PD_OK) {
            fprintf(stderr, "pdserve prefill: refusing to start: %s\n", err.msg);
            return 1;
        }
        t = pd_startup_phase_log(LOGM, replica_id, "verify checkpoint", t);
    }
    pd_replica_ops *ops = NULL; /* GPUs, telemetry (common/pd_replica_ops.h) */
    pd_replica_ops_config oc = {.role = "prefill", .replica_id = replica_id, .device = device, .tp = tp, .numa = numa};
    pd_status ost = pd_replica_ops_init(&oc, &ops, &err);
    if (ost != PD_OK) {
        fprintf(stderr, "pdserve prefill: %s\n", err.msg);
        return ost == PD_ERR_INVALID ? 2 : 1;
    }
    rc = 1;
    if (pd_backend_init_tp(device, tp, threads, bes, &err) != PD_OK ||
        pd_model_load_parallel(model, bes, tp, expert_parallel, &p.m, &err) != PD_OK) {
        fprintf(stderr, "pdserve prefill: %s\n", err.msg);
        goto out;
    }
    t = pd_startup_phase_log(LOGM, replica_id, "init backend + load weights", t);
    pd_status kst = pd_replica_kv_blocks(ops, pd_model_config_of(p.m), gpu_mem_util, block_size, &num_blocks, &err);
    if (kst != PD_OK) {
        fprintf(stderr, "pdserve prefill: %s\n", err.msg);
        rc = kst == PD_ERR_UNSUPPORTED || kst == PD_ERR_INVALID ? 2 : 1;
        goto out;
    }
    if (pd_kv_cache_init(p.m, block_size, num_blocks, &p.kv, &err) != PD_OK) {
        fprintf(stderr, "pdserve prefill: %s\n", err.msg);
        goto out;
    }
    t = pd_startup_phase_log(LOGM, replica_id, "allocate KV", t);
    /* One host (no UCX_TLS given): keep shared memory (UCX peer-failure
     * detection would force TCP); same-host peers are watched by pidfd. */
    pd_kvx_config kc = {.name = replica_id, .no_ucx_peer_failure = getenv("UCX_TLS") == NULL};
    if (!(p.kv_host = pd_kv_cache_host_pool(p.kv, &err)) || pd_kvx_agent_init(&kc, &p.agent, &err) != PD_OK ||
        pd_kvx_register_pool(p.agent, p.kv_host, pd_kv_cache_block_bytes(p.kv) * (size_t)num_blocks, &p.pool,
                             &err) != PD_OK) {
        fprintf(stderr, "pdserve prefill: KV transfer: %s\n", err.msg);
        goto out;
    }
    pd_startup_phase_log(LOGM, replica_id, "register KV pool (UCX)", t);
    if (replay_path) {
        if (pd_replay_load(replay_path, pd_model_config_of(p.m)->vocab_size, &g_replay, &err) != PD_OK) {
            fprintf(stderr, "pdserve prefill: --debug-replay-tokens: %s\n", err.msg);
            return 2;
        }
        PD_LOGW(LOGM, "replaying scripted tokens from %s instead of sampling (testing)", replay_path);
    }
    p.logits = pd_xmalloc((size_t)pd_model_config_of(p.m)->vocab_size * sizeof(float));
    p.zctx = zmq_ctx_new();
    p.sock = zmq_socket(p.zctx, ZMQ_DEALER);
    int linger = 0, hwm = 100000;
    zmq_setsockopt(p.sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(p.sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(p.sock, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(p.sock, ZMQ_ROUTING_ID, replica_id, strlen(replica_id));
    if (zmq_connect(p.sock, gateway) != 0) {
        fprintf(stderr, "pdserve prefill: cannot connect to %s: %s\n", gateway, zmq_strerror(errno));
        goto out;
    }
    {
        double tc = pd_now_s();
        if (pd_replica_ops_self_check(ops, bes, tp, num_blocks, block_size, inject_selfcheck_failure, &err) != PD_OK) {
            fprintf(stderr, "pdserve prefill: refusing to start: self-check: %s\n", err.msg);
            rc = 1;
            goto out;
        }
        pd_startup_phase_log(LOGM, replica_id, "self-checks", tc);
    }
    PD_LOGI(LOGM, "%s: model %s, chunk %d tokens, %d KV blocks of %d, gateway %s", replica_id, model, chunk,
            num_blocks, block_size, gateway);
    if (pd_hb_start(p.zctx, gateway, replica_id, p.heartbeat_ms, &p.hb, &err) != PD_OK) {
        fprintf(stderr, "pdserve prefill: %s\n", err.msg);
        goto out;
    }
    pd_startup_phase_log(LOGM, replica_id, "total to registration", t0);
    if (pd_metrics_server_start(metrics_host, metrics_port, &p.metrics, &err) != PD_OK) {
        fprintf(stderr, "pdserve prefill: %s\n", err.msg);
        rc = 1;
        goto out;
    }
    pd_replica_ops_attach(ops, p.metrics);
    /* Start-up (checkpoint JSON, verification, self-checks) leaves ~5 MB
     * free inside the heap; hand it back so that RSS shows what serving uses */
    malloc_trim(0);
    send_register(&p);
    send_heartbeat(&p);
    rc = 0;
    while (!g_stop) {
        bool busy = false;
        for (job *j = p.jobs; j; j = j->next)
            if (!j->finished_compute && !j->aborted && !j->failed) busy = true;
        if (pd_kvx_agent_progress(p.agent)) busy = true;
        double now = pd_now_s();
        long wait_ms = busy ? 0 : (long)(p.heartbeat_ms - (now - p.last_heartbeat) * 1000.0);
        if (wait_ms < 0) wait_ms = 0;
        if (p.jobs && wait_ms > 5) wait_ms = 5; /* transfers in flight: keep progressing */
        zmq_pollitem_t it[2] = {{p.sock, 0, ZMQ_POLLIN, 0}, {NULL, pd_kvx_agent_event_fd(p.agent), ZMQ_POLLIN, 0}};
        zmq_poll(it, 2, wait_ms);
        for (;;) {
            pd_msg msg;
            pd_status s = pd_msg_recv(p.sock, false, &msg, &err);
            if (s == PD_ERR_LIMIT) break;
            if (s != PD_OK) {
                PD_LOGW(LOGM, "dropped a message from the gateway: %s", err.msg);
                if (s == PD_ERR_IO) break;
                continue;
            }
            handle(&p, &msg);
            pd_msg_clear(&msg);
        }
        if (step(&p) && g_step_delay_ms > 0) usleep((useconds_t)g_step_delay_ms * 1000);
        pd_kvx_agent_progress(p.agent);
        advance(&p);
        now = pd_now_s();
        if (pd_hb_take_reregister(p.hb)) {
            p.registered = false;
            p.last_register = 0;
        }
        if (!p.registered && now - p.last_register > 1.0) send_register(&p);
        if ((now - p.last_heartbeat) * 1000.0 >= p.heartbeat_ms / 4.0) send_heartbeat(&p);
    }
    PD_LOGI(LOGM, "%s: stopping", replica_id);
out:
    while (p.jobs) {
        job *j = p.jobs;
        p.jobs = j->next;
        job_free(&p, j);
    }
    while (p.peers) {
        decode_peer *d = p.peers;
        p.peers = d->next;
        pd_kvx_peer_close(&d->peer);
        free(d);
    }
    pd_kvx_pool_free(&p.pool);
    pd_kvx_agent_free(&p.agent);
    pd_hb_stop(&p.hb);
    pd_metrics_server_stop(&p.metrics);
    pd_replica_ops_free(&ops);
    if (p.sock) zmq_close(p.sock);
    if (p.zctx) zmq_ctx_term(p.zctx);
    free(p.logits);
    pd_kv_cache_free(&p.kv);
    pd_model_free(&p.m);
    pd_replay_free(&g_replay);
    pd_grammar_vocab_free(&p.vocab);
    for (int r = 0; r < PD_TP_MAX_RANKS; r++)
        pd_backend_free(&bes[r]);
    return rc;
}

/* Continuous batching with chunked prefill over the paged latent KV cache.
 *
 * Every sequence keeps its tokens (prompt + generated) and the number of
 * them whose KV is in the cache; the difference is what it still has to
 * run. A running sequence has exactly one pending token (the last one
 * sampled); a waiting one has a prompt (or, after preemption, prompt +
 * output) to prefill in chunks. When a sequence's pending tokens are all
 * processed, the step's logits row for it is sampled. */
#include "pd_decode.h"

#include <math.h>
#include <string.h>

typedef enum { SEQ_WAITING, SEQ_RUNNING } seq_state;

typedef struct seq {
    char id[128];
    seq_state state;
    int32_t *tokens;
    int n_tokens, cap, n_prompt, n_generated;
    int max_tokens, min_tokens;
    bool ignore_eos, want_logprobs;
    int top_logprobs;
    bool want_prompt_logprobs;
    int prompt_top_logprobs;
    int plp_next; /* the next prompt position whose logprob is due (from 1) */
    int32_t *stop_ids;
    int n_stop;
    const int32_t *replay; /* testing: the scripted output, or NULL */
    int n_replay;
    pd_sampler *smp;
    pd_grammar *grammar;    /* response_format: the compiled schema, or NULL */
    pd_grammar_state *gs;   /* where the output stands in it */
    pd_seq_kv kv;
    uint64_t admit_order;
    bool in_batch;
    struct seq *next;
} seq;

struct pd_sched {
    pd_model *m;
    pd_sched_config cfg;
    pd_sched_callbacks cb;
    void *user;
    pd_kv_cache *kv;
    seq *seqs; /* all sequences, a list; small counts (hundreds) */
    const pd_grammar_vocab *vocab; /* for json_schema requests (borrowed) */
    uint64_t admit_counter;
    uint64_t prefill_tokens_total, generation_tokens_total;
    float *logits;
    int logits_rows;
    /* sampling where the logits are (pd_model_samples_on_device): the
     * rows' listed tokens, kept between steps */
    pd_sample_tok *stoks;
    int cap_stoks;
};

static const pd_model_config *mcfg(const pd_sched *s) {
    return pd_model_config_of(s->m);
}

pd_status pd_sched_init(pd_model *m, const pd_sched_config *cfg, const pd_sched_callbacks *cb, void *user,
                        pd_sched **s_p, pd_err *err) {
    if (cfg->max_num_seqs <= 0 || cfg->max_num_batched_tokens <= 0 || cfg->chunked_prefill_size <= 0 ||
        cfg->block_size <= 0 || cfg->num_blocks <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "scheduler: every size must be positive");
    pd_sched *s = pd_xcalloc(1, sizeof *s);
    s->m = m;
    s->cfg = *cfg;
    s->cb = *cb;
    s->user = user;
    pd_status st = pd_kv_cache_init(m, cfg->block_size, cfg->num_blocks, &s->kv, err);
    if (st != PD_OK) {
        free(s);
        return st;
    }
    *s_p = s;
    return PD_OK;
}

static void seq_free(pd_sched *s, seq *q) {
    pd_seq_kv_release(s->kv, &q->kv);
    free(q->kv.block_table);
    pd_sampler_free(&q->smp);
    pd_grammar_state_free(&q->gs);
    pd_grammar_free(&q->grammar);
    free(q->tokens);
    free(q->stop_ids);
    free(q);
}

static void seq_unlink(pd_sched *s, seq *q) {
    for (seq **pp = &s->seqs; *pp; pp = &(*pp)->next)
        if (*pp == q) {
            *pp = q->next;
            return;
        }
}

void pd_sched_free(pd_sched **s_p) {
    if (!s_p || !*s_p)
        return;
    pd_sched *s = *s_p;
    while (s->seqs) {
        seq *q = s->seqs;
        s->seqs = q->next;
        seq_free(s, q);
    }
    pd_kv_cache_free(&s->kv);
    free(s->logits);
    free(s->stoks);
    free(s);
    *s_p = NULL;
}

static seq *find(pd_sched *s, const char *id) {
    for (seq *q = s->seqs; q; q = q->next)
        if (!strcmp(q->id, id))
            return q;
    return NULL;
}

static void append_tail(pd_sched *s, seq *q) {
    seq **pp = &s->seqs;
    while (*pp) pp = &(*pp)->next;
    q->next = NULL;
    *pp = q;
}

static pd_status seq_new(pd_sched *s, const pd_sched_request *r, seq **q_p, pd_err *err) {
    const pd_model_config *c = mcfg(s);
    if (!r->request_id || !*r->request_id || strlen(r->request_id) >= sizeof(((seq *)0)->id))
        return pd_err_set(err, PD_ERR_INVALID, "request id missing or longer than 127 bytes");
    if (find(s, r->request_id))
        return pd_err_set(err, PD_ERR_INVALID, "request %s: duplicate request id", r->request_id);
    if (r->n_prompt <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "request %s: empty prompt", r->request_id);
    if (r->top_logprobs < 0 || r->top_logprobs > PD_MAX_TOP_LOGPROBS)
        return pd_err_set(err, PD_ERR_INVALID, "request %s: top_logprobs %d outside 0..%d", r->request_id,
                          r->top_logprobs, PD_MAX_TOP_LOGPROBS);
    if (r->want_prompt_logprobs && (r->prompt_top_logprobs < 0 || r->prompt_top_logprobs > PD_MAX_TOP_LOGPROBS))
        return pd_err_set(err, PD_ERR_INVALID, "request %s: prompt_top_logprobs %d outside 0..%d", r->request_id,
                          r->prompt_top_logprobs, PD_MAX_TOP_LOGPROBS);
    if (r->max_tokens <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "request %s: max_tokens must be at least 1", r->request_id);
    if ((int64_t)r->n_prompt + r->max_tokens > c->max_position_embeddings)
        return pd_err_set(err, PD_ERR_INVALID, "request %s: prompt (%d) + max_tokens (%d) exceeds %d", r->request_id,
                          r->n_prompt, r->max_tokens, c->max_position_embeddings);
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt_ids[i] < 0 || r->prompt_ids[i] >= c->vocab_size)
            return pd_err_set(err, PD_ERR_INVALID, "request %s: token id %d outside the vocabulary", r->request_id,
                              r->prompt_ids[i]);
    int need_blocks = (r->n_prompt + r->max_tokens + s->cfg.block_size - 1) / s->cfg.block_size;
    if (need_blocks > s->cfg.num_blocks)
        return pd_err_set(err, PD_ERR_LIMIT, "request %s: %d tokens can never fit in the KV cache (%d blocks of %d)",
                          r->request_id, r->n_prompt + r->max_tokens, s->cfg.num_blocks, s->cfg.block_size);
    pd_grammar *grammar = NULL;
    pd_grammar_state *gs = NULL;
    if (r->json_schema && *r->json_schema) {
        if (!s->vocab)
            return pd_err_set(err, PD_ERR_IO, "request %s: response_format needs the tokenizer, which this replica could not load",
                              r->request_id);
        pd_err gerr;
        pd_status gst = pd_grammar_compile(r->json_schema, strlen(r->json_schema), &grammar, &gerr);
        if (gst != PD_OK)
            return pd_err_set(err, gst, "request %s: response_format: %s", r->request_id, gerr.msg);
        if (pd_grammar_state_init(grammar, s->vocab, &gs, err) != PD_OK) {
            pd_grammar_free(&grammar);
            return PD_ERR_NOMEM;
        }
    }
    seq *q = pd_xcalloc(1, sizeof *q);
    q->grammar = grammar;
    q->gs = gs;
    pd_status st = pd_sampler_init(&r->sampling, c->vocab_size, r->prompt_ids, r->n_prompt, &q->smp, err);
    if (st != PD_OK) {
        pd_grammar_state_free(&q->gs);
        pd_grammar_free(&q->grammar);
        free(q);
        return st;
    }
    snprintf(q->id, sizeof q->id, "%s", r->request_id);
    if (s->cfg.replay)
        q->replay = pd_replay_script(s->cfg.replay, &r->sampling, &q->n_replay);
    q->cap = r->n_prompt + r->max_tokens + 1;
    q->tokens = pd_xmalloc((size_t)q->cap * sizeof(int32_t));
    memcpy(q->tokens, r->prompt_ids, (size_t)r->n_prompt * sizeof(int32_t));
    q->n_tokens = q->n_prompt = r->n_prompt;
    q->max_tokens = r->max_tokens;
    q->min_tokens = r->min_tokens;
    q->ignore_eos = r->ignore_eos;
    q->want_logprobs = r->want_logprobs;
    q->top_logprobs = r->want_logprobs ? r->top_logprobs : 0;
    q->want_prompt_logprobs = r->want_prompt_logprobs && s->cb.on_prompt_logprobs;
    q->prompt_top_logprobs = q->want_prompt_logprobs ? r->prompt_top_logprobs : 0;
    q->plp_next = 1;
    if (r->n_stop_token_ids > 0) {
        q->stop_ids = pd_xmalloc((size_t)r->n_stop_token_ids * sizeof(int32_t));
        memcpy(q->stop_ids, r->stop_token_ids, (size_t)r->n_stop_token_ids * sizeof(int32_t));
        q->n_stop = r->n_stop_token_ids;
    }
    *q_p = q;
    return PD_OK;
}

void pd_sched_set_grammar_vocab(pd_sched *s, const pd_grammar_vocab *v) {
    s->vocab = v;
}

pd_status pd_sched_add(pd_sched *s, const pd_sched_request *r, pd_err *err) {
    seq *q;
    pd_status st = seq_new(s, r, &q, err);
    if (st != PD_OK)
        return st;
    q->state = SEQ_WAITING;
    append_tail(s, q);
    return PD_OK;
}

pd_status pd_sched_alloc_blocks(pd_sched *s, int n_tokens, int32_t **blocks_p, int *n_blocks_p, pd_err *err) {
    if (n_tokens < 1)
        return pd_err_set(err, PD_ERR_INVALID, "reserve: no tokens");
    int need = (n_tokens + 1 + s->cfg.block_size - 1) / s->cfg.block_size;
    if (need > pd_kv_cache_num_free(s->kv))
        return pd_err_set(err, PD_ERR_LIMIT, "reserve: %d tokens need %d KV blocks, %d are free", n_tokens + 1, need,
                          pd_kv_cache_num_free(s->kv));
    int32_t *ids = pd_xmalloc((size_t)need * sizeof(int32_t));
    for (int i = 0; i < need; i++)
        ids[i] = pd_kv_cache_alloc(s->kv);
    *blocks_p = ids;
    *n_blocks_p = need;
    return PD_OK;
}

void pd_sched_free_blocks(pd_sched *s, const int32_t *blocks, int n_blocks) {
    for (int i = 0; i < n_blocks; i++)
        pd_kv_cache_release(s->kv, blocks[i]);
}

static bool is_stop_token(const seq *q, int32_t t, int eos) {
    if (t == eos && !q->ignore_eos)
        return true;
    for (int i = 0; i < q->n_stop; i++)
        if (q->stop_ids[i] == t)
            return true;
    return false;
}

/* Appends a sampled token and decides whether the sequence is done.
 * Returns the finish reason or NULL. A constrained sequence whose value is
 * complete and cannot grow stops here ("stop", as at EOS), whatever
 * min_tokens and ignore_eos say: nothing else could follow. */
static const char *seq_accept(pd_sched *s, seq *q, int32_t t) {
    q->tokens[q->n_tokens++] = t;
    q->n_generated++;
    if (is_stop_token(q, t, mcfg(s)->eos_token_id) && q->n_generated > q->min_tokens)
        return "stop";
    if (q->gs && pd_grammar_state_is_terminal(q->gs))
        return "stop";
    if (q->n_generated >= q->max_tokens || q->n_tokens >= mcfg(s)->max_position_embeddings)
        return "length";
    return NULL;
}

pd_status pd_sched_add_prefilled(pd_sched *s, const pd_sched_request *r, const int32_t *blocks, int n_blocks,
                                 int32_t first_token, float first_logprob, pd_err *err) {
    seq *q = NULL;
    pd_status st = seq_new(s, r, &q, err);
    if (st == PD_OK && (int64_t)n_blocks * s->cfg.block_size < r->n_prompt + 1) {
        st = pd_err_set(err, PD_ERR_INVALID, "request %s: %d blocks cannot hold %d tokens", r->request_id, n_blocks,
                        r->n_prompt + 1);
        seq_free(s, q);
    }
    if (st != PD_OK) {
        pd_sched_free_blocks(s, blocks, n_blocks);
        return st;
    }
    q->kv.block_table = pd_xmalloc((size_t)n_blocks * sizeof(int));
    for (int i = 0; i < n_blocks; i++)
        q->kv.block_table[i] = blocks[i];
    q->kv.num_blocks = q->kv.cap_blocks = n_blocks;
    q->kv.num_tokens = r->n_prompt;
    q->want_prompt_logprobs = false; /* computed elsewhere: none here */
    q->state = SEQ_RUNNING;
    q->admit_order = ++s->admit_counter;
    pd_sampler_accept(q->smp, first_token);
    /* the prefill replica drew first_token with this request's seed: the
     * next token takes the generator's next draw, as on the short route */
    pd_sampler_skip_draw(q->smp);
    append_tail(s, q);
    if (q->gs && !pd_grammar_state_accept_token(q->gs, first_token)) {
        seq_unlink(s, q);
        seq_free(s, q);
        return pd_err_set(err, PD_ERR_INVALID, "request %s: the first token %d breaks the response_format grammar",
                          r->request_id, (int)first_token);
    }
    const char *fin = seq_accept(s, q, first_token);
    (void)first_logprob;
    if (fin) {
        seq_unlink(s, q);
        s->cb.on_finished(s->user, q->id, fin);
        seq_free(s, q);
    }
    return PD_OK;
}

bool pd_sched_abort(pd_sched *s, const char *request_id) {
    seq *q = find(s, request_id);
    if (!q)
        return false;
    seq_unlink(s, q);
    seq_free(s, q);
    return true;
}

/* The last sequence after `from` in the queue (from NULL: in the whole
 * queue) that waits with a partial prefill's KV and is not in this step's
 * batch, or NULL. */
static seq *last_partial_prefill(pd_sched *s, seq *from) {
    seq *found = NULL;
    for (seq *q = from ? from->next : s->seqs; q; q = q->next)
        if (q->state == SEQ_WAITING && !q->in_batch && q->kv.num_blocks > 0)
            found = q;
    return found;
}

/* Frees the KV of one sequence other than keep (vLLM's recompute
 * preemption): the most recently admitted running one, which goes back to
 * the front of the queue to wait; else, when none is left, the partial
 * prefill last in the queue, which keeps its place and prefills again from
 * its first token. Without the second, waiting sequences that a
 * preemption sent back to recompute could each hold part of their KV with
 * none left for anyone, and the replica stopped (found by a break-it round:
 * 8 requests on a 40-block cache with 8-token chunks). */
static bool preempt_one(pd_sched *s, seq *keep) {
    seq *victim = NULL;
    for (seq *q = s->seqs; q; q = q->next)
        if (q != keep && !q->in_batch && q->state == SEQ_RUNNING && q->kv.num_blocks > 0 &&
            (!victim || q->admit_order > victim->admit_order))
            victim = q;
    if (!victim) {
        victim = last_partial_prefill(s, NULL);
        if (!victim || victim == keep)
            return false;
        pd_seq_kv_release(s->kv, &victim->kv);
        return true;
    }
    pd_seq_kv_release(s->kv, &victim->kv);
    victim->state = SEQ_WAITING;
    /* to the front of the queue */
    seq_unlink(s, victim);
    victim->next = s->seqs;
    s->seqs = victim;
    return true;
}

/* Prompt logprobs of one all-logits chunk: lg holds n rows, row r the
 * logits after position p0 + r, so the distribution of the token at
 * p0 + r + 1. Positions already reported (a preempted request prefills
 * again) and those past the prompt are skipped. Rows are reduced in
 * parallel; the caller drops them after the step. */
static void report_prompt_logprobs(pd_sched *s, seq *q, int p0, int n, const float *lg) {
    const int V = mcfg(s)->vocab_size;
    int first = p0 + 1 > q->plp_next ? p0 + 1 : q->plp_next;
    int end = p0 + n + 1 < q->n_prompt ? p0 + n + 1 : q->n_prompt; /* positions [first, end) */
    if (end <= first)
        return;
    int m = end - first, k = q->prompt_top_logprobs < V ? q->prompt_top_logprobs : V;
    float *lps = pd_xmalloc((size_t)m * sizeof *lps);
    int32_t *tid = k ? pd_xmalloc((size_t)m * k * sizeof *tid) : NULL;
    float *tlp = k ? pd_xmalloc((size_t)m * k * sizeof *tlp) : NULL;
#pragma omp parallel for schedule(static) if (m > 8)
    for (int i = 0; i < m; i++) {
        int pos = first + i;
        pd_logprobs_row(lg + (size_t)(pos - 1 - p0) * V, V, q->tokens[pos], &lps[i], k,
                        k ? tid + (size_t)i * k : NULL, k ? tlp + (size_t)i * k : NULL);
    }
    q->plp_next = end;
    s->cb.on_prompt_logprobs(s->user, q->id, first, m, lps, tid, tlp, k);
    free(lps);
    free(tid);
    free(tlp);
}

/* Samples row lg (host logits) of q: min_tokens' masks, the grammar's
 * "only EOS is left" (gram_ok 1 and complete: gram_eos restored), then the
 * request's sampler with its logprobs: those of the logits as they stand
 * here (the model's, min_tokens and grammar masks applied, before
 * penalties and temperature; the top ones by a bounded selection). */
static int32_t sample_on_host(pd_sched *s, seq *q, float *lg, int gram_ok, float gram_eos, float *lp,
                              int32_t *top_id, float *top_lp, int *n_top) {
    const pd_model_config *c = mcfg(s);
    if (q->n_generated < q->min_tokens) { /* vLLM min_tokens: EOS and stop ids cannot be sampled yet */
        if (!q->ignore_eos) lg[c->eos_token_id] = -INFINITY;
        for (int k = 0; k < q->n_stop; k++)
            if (q->stop_ids[k] >= 0 && q->stop_ids[k] < c->vocab_size) lg[q->stop_ids[k]] = -INFINITY;
    }
    if (q->gs && gram_ok == 1 && pd_grammar_state_is_complete(q->gs))
        lg[c->eos_token_id] = gram_eos; /* only EOS is left: it wins over min_tokens */
    return pd_sampler_sample_top(q->smp, lg, q->want_logprobs ? lp : NULL, q->top_logprobs, top_id, top_lp,
                                 n_top);
}

int pd_sched_step(pd_sched *s) {
    const pd_model_config *c = mcfg(s);
    int max_seqs = s->cfg.max_num_seqs;
    pd_batch_seq *batch = pd_xmalloc((size_t)(max_seqs + 1) * sizeof *batch);
    seq **bseq = pd_xmalloc((size_t)(max_seqs + 1) * sizeof *bseq);
    bool *sample = pd_xmalloc((size_t)(max_seqs + 1) * sizeof *sample);
    int *p0 = pd_xmalloc((size_t)(max_seqs + 1) * sizeof *p0);     /* first position of each slice */
    size_t *row = pd_xmalloc((size_t)(max_seqs + 1) * sizeof *row); /* its last logits row */
    int nb = 0, budget = s->cfg.max_num_batched_tokens;
    int plp_rows = s->cfg.chunked_prefill_size; /* all-logits rows left this step */

    /* (a) decode: one token for each running sequence, oldest first */
    for (seq *q = s->seqs; q && nb < max_seqs && budget > 0; q = q->next) {
        if (q->state != SEQ_RUNNING)
            continue;
        while (pd_seq_kv_reserve(s->kv, &q->kv, 1) != PD_OK)
            if (!preempt_one(s, q))
                break;
        if (q->state != SEQ_RUNNING || q->kv.num_blocks * s->cfg.block_size < q->kv.num_tokens + 1)
            continue;
        batch[nb] = (pd_batch_seq){.kv = &q->kv, .tokens = &q->tokens[q->kv.num_tokens], .n_tokens = 1};
        bseq[nb] = q;
        q->in_batch = true;
        sample[nb] = true;
        nb++;
        budget--;
    }
    /* (b) prefill chunks of waiting sequences, in arrival order */
    for (seq *q = s->seqs; q && nb < max_seqs && budget > 0; q = q->next) {
        if (q->state != SEQ_WAITING)
            continue;
        int pending = q->n_tokens - q->kv.num_tokens;
        int n = pending;
        if (n > s->cfg.chunked_prefill_size) n = s->cfg.chunked_prefill_size;
        if (n > budget) n = budget;
        /* prompt logprobs: logits for every token of the chunk, within the
         * step's bound of rows (a chunk past it waits for the next step) */
        bool all = q->want_prompt_logprobs && q->plp_next < q->n_prompt;
        if (all && plp_rows <= 0)
            continue;
        if (all && n > plp_rows) n = plp_rows;
        /* FIFO: later prompts wait behind this one, and give up the KV of
         * their partial prefills (the last first) so that it can go on */
        bool room = pd_seq_kv_reserve(s->kv, &q->kv, n) == PD_OK;
        for (seq *v; !room && (v = last_partial_prefill(s, q));) {
            pd_seq_kv_release(s->kv, &v->kv);
            room = pd_seq_kv_reserve(s->kv, &q->kv, n) == PD_OK;
        }
        if (!room)
            break;
        if (all) plp_rows -= n;
        batch[nb] = (pd_batch_seq){
            .kv = &q->kv, .tokens = &q->tokens[q->kv.num_tokens], .n_tokens = n, .all_logits = all};
        bseq[nb] = q;
        q->in_batch = true;
        sample[nb] = n == pending;
        nb++;
        budget -= n;
    }
    if (nb == 0) {
        free(batch);
        free(bseq);
        free(sample);
        free(p0);
        free(row);
        return 0;
    }
    size_t rows = 0;
    for (int i = 0; i < nb; i++) {
        p0[i] = batch[i].kv->num_tokens;
        rows += batch[i].all_logits ? (size_t)batch[i].n_tokens : 1;
        row[i] = rows - 1;
    }
    if ((size_t)s->logits_rows < rows) {
        free(s->logits);
        s->logits = pd_xmalloc(rows * c->vocab_size * sizeof(float));
        s->logits_rows = (int)rows;
    }
    for (int i = 0; i < nb; i++)
        bseq[i]->in_batch = false;
    /* Rows sampled where the logits are: every row to sample that needs no
     * host pass over the whole row (a grammar mask). The host gets those
     * rows' tokens and logprobs, and the logits of the other rows it reads:
     * grammar rows and prompt logprobs. */
    pd_fwd_out out = {.logits = s->logits};
    int *dev_of = NULL; /* batch row -> its sample row, or -1 */
    if (pd_model_samples_on_device(s->m)) {
        uint8_t *dl = pd_xcalloc(rows, 1);
        pd_sample_row *srow = pd_xmalloc((size_t)nb * sizeof *srow);
        dev_of = pd_xmalloc((size_t)nb * sizeof *dev_of);
        int n_toks = 0, n_dev = 0;
        for (int i = 0; i < nb; i++) {
            seq *q = bseq[i];
            dev_of[i] = -1;
            if (batch[i].all_logits)
                memset(dl + row[i] + 1 - batch[i].n_tokens, 1, (size_t)batch[i].n_tokens);
            if (q->state == SEQ_WAITING && !sample[i])
                continue;
            if (q->gs || batch[i].all_logits) {
                dl[row[i]] = 1;
                continue;
            }
            int32_t *masked = NULL;
            int n_masked = 0;
            if (q->n_generated < q->min_tokens) { /* vLLM min_tokens, as sample_on_host */
                masked = pd_xmalloc((size_t)(1 + q->n_stop) * sizeof *masked);
                if (!q->ignore_eos) masked[n_masked++] = c->eos_token_id;
                for (int k = 0; k < q->n_stop; k++) masked[n_masked++] = q->stop_ids[k];
            }
            srow[n_dev].row = (int32_t)row[i];
            pd_sampler_device_row(q->smp, masked, n_masked, q->want_logprobs, q->top_logprobs, &srow[n_dev],
                                  &s->stoks, &n_toks, &s->cap_stoks);
            free(masked);
            dev_of[i] = n_dev++;
        }
        out = (pd_fwd_out){.logits = s->logits, .download_row = dl, .n_sample = n_dev, .sample = srow,
                           .toks = s->stoks, .n_toks = n_toks,
                           .sampled = pd_xmalloc((size_t)(n_dev > 0 ? n_dev : 1) * sizeof(pd_sample_out))};
    }
    pd_err err = {{0}};
    int processed = s->cfg.max_num_batched_tokens - budget;
    pd_status fst = pd_model_forward_ex(s->m, s->kv, batch, nb, &out, &err);
    free((void *)out.download_row);
    free((void *)out.sample);
    if (fst != PD_OK) {
        free(out.sampled);
        free(dev_of);
        for (int i = 0; i < nb; i++) {
            seq *q = bseq[i];
            seq_unlink(s, q);
            s->cb.on_error(s->user, q->id, err.msg);
            seq_free(s, q);
        }
        free(batch);
        free(bseq);
        free(sample);
        free(p0);
        free(row);
        return processed;
    }
    for (int i = 0; i < nb; i++)
        if (batch[i].all_logits)
            report_prompt_logprobs(s, bseq[i], p0[i], batch[i].n_tokens,
                                   s->logits + (row[i] + 1 - (size_t)batch[i].n_tokens) * c->vocab_size);
    /* response_format: the grammar masks of the rows about to be sampled,
     * in parallel (each state has its own scratch; the trie walks are the
     * costly part: up to ~0.5 ms a row, docs/benchmarks.md). The EOS logit
     * is kept to restore when only EOS is left (see below). */
    int n_gram = 0;
    for (int i = 0; i < nb; i++)
        n_gram += bseq[i]->gs && (bseq[i]->state != SEQ_WAITING || sample[i]);
    int *gram_ok = n_gram ? pd_xcalloc((size_t)nb, sizeof *gram_ok) : NULL;
    float *gram_eos = n_gram ? pd_xcalloc((size_t)nb, sizeof *gram_eos) : NULL;
    if (n_gram) {
#pragma omp parallel for schedule(dynamic, 1) if (n_gram > 1)
        for (int i = 0; i < nb; i++) {
            seq *q = bseq[i];
            if (!q->gs || (q->state == SEQ_WAITING && !sample[i]))
                continue;
            float *lg = s->logits + row[i] * c->vocab_size;
            gram_eos[i] = lg[c->eos_token_id];
            gram_ok[i] = pd_grammar_state_mask_logits(q->gs, lg, q->max_tokens - q->n_generated);
        }
    }
    for (int i = 0; i < nb; i++) {
        seq *q = bseq[i];
        if (q->state == SEQ_WAITING) {
            s->prefill_tokens_total += (uint64_t)batch[i].n_tokens;
            if (!sample[i])
                continue;
            q->state = SEQ_RUNNING;
            q->admit_order = ++s->admit_counter;
        }
        float lp = 0.0f, top_lp[PD_MAX_TOP_LOGPROBS];
        int32_t top_id[PD_MAX_TOP_LOGPROBS];
        int n_top = 0;
        int32_t t;
        if (dev_of && dev_of[i] >= 0) { /* sampled on the device */
            const pd_sample_out *so = &out.sampled[dev_of[i]];
            t = so->token;
            lp = so->logprob;
            n_top = so->n_top;
            memcpy(top_id, so->top_ids, (size_t)n_top * sizeof *top_id);
            memcpy(top_lp, so->top_logprobs, (size_t)n_top * sizeof *top_lp);
            pd_sampler_accept(q->smp, t);
        } else {
            t = sample_on_host(s, q, s->logits + row[i] * c->vocab_size, gram_ok ? gram_ok[i] : 0,
                               gram_eos ? gram_eos[i] : 0.0f, &lp, top_id, top_lp, &n_top);
        }
        if (q->replay) /* testing: the scripted output */
            t = q->n_generated < q->n_replay ? q->replay[q->n_generated] : c->eos_token_id;
        s->generation_tokens_total++;
        if (q->gs && !pd_grammar_state_accept_token(q->gs, t)) { /* only a replayed token: the mask allowed t */
            seq_unlink(s, q);
            s->cb.on_error(s->user, q->id, "a generated token breaks the response_format grammar");
            seq_free(s, q);
            continue;
        }
        const char *fin = seq_accept(s, q, t);
        s->cb.on_token(s->user, q->id, t, lp, top_id, top_lp, n_top);
        if (fin) {
            seq_unlink(s, q);
            s->cb.on_finished(s->user, q->id, fin);
            seq_free(s, q);
        }
    }
    free(gram_ok);
    free(gram_eos);
    free(out.sampled);
    free(dev_of);
    free(batch);
    free(bseq);
    free(sample);
    free(p0);
    free(row);
    return processed;
}

void pd_sched_get_stats(const pd_sched *s, pd_sched_stats *st) {
    memset(st, 0, sizeof *st);
    for (const seq *q = s->seqs; q; q = q->next) {
        if (q->state == SEQ_RUNNING) st->num_running++;
        else st->num_waiting++;
        st->tokens_in_flight += (uint64_t)(q->n_prompt + q->max_tokens - q->n_generated);
    }
    st->free_blocks = pd_kv_cache_num_free(s->kv);
    st->total_blocks = pd_kv_cache_num_blocks(s->kv);
    st->prefill_tokens_total = s->prefill_tokens_total;
    st->generation_tokens_total = s->generation_tokens_total;
}

pd_kv_cache *pd_sched_kv(pd_sched *s) {
    return s->kv;
}

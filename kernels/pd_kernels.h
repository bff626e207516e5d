/* kernels/ — the backend interface: one table of operations over buffers in
 * a backend's memory, implemented by cpu/ (plain C, the readable reference,
 * OpenBLAS for GEMM) and cuda/ (sm_90a). The model calls only these.
 *
 * All activations are fp32 row-major; a "row" is one token. Weights are
 * pd_weight handles in the backend's own format (fp32 on CPU). kernels/
 * knows nothing of requests, tokenizers or sockets.
 */
#ifndef PD_KERNELS_H
#define PD_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd_common.h"

/** A weight matrix in backend memory: rows × cols (nn.Linear layout,
 * out_features × in_features), row-major. */
typedef struct {
    int rows, cols;
    void *data; /* backend memory */
} pd_weight;

/** MoE routing parameters (DeepSeek-V2 §2.2; V3 §2.1.2). */
typedef struct {
    int n_experts, top_k, n_group, topk_group;
    int scoring;      /* 0 softmax (V2), 1 sigmoid (V3) */
    int topk_method;  /* 0 greedy, 1 group_limited_greedy (V2), 2 noaux_tc (V3) */
    bool norm_topk_prob;
    float routed_scaling_factor;
    const float *e_score_correction_bias; /* [n_experts] or NULL (backend memory) */
} pd_moe_route_params;

/** What a backend's routing holds at the most (pd_moe_route_check): more
 * experts than max_experts, top_k above max_top_k, or with group-limited
 * routing (topk_method 1 or 2, n_group > 1) more groups than max_groups. */
typedef struct {
    int max_experts, max_groups, max_top_k;
} pd_moe_route_limits;

struct pd_mla_prep_args; /* below */

/** Arguments of MLA attention for one sequence's n_q new tokens at
 * positions start_pos .. start_pos+n_q-1, attending causally to every cached
 * token 0 .. start_pos+n_q-1 (the new tokens' latents are already in the
 * cache). Cache layout: [block][layer][slot][kvr + dr] fp32. */
typedef struct {
    int n_heads, qk_nope_dim, qk_rope_dim, v_dim, kv_lora_rank;
    float softmax_scale;
    int n_q, start_pos;
    const float *q; /* [n_q, n_heads, qk_nope_dim + qk_rope_dim], rope applied */
    const float *cache;  /* cache base */
    int n_layers, layer, block_size;
    const int *block_table; /* host memory (the CUDA backend copies it) */
    const pd_weight *kv_b;  /* [n_heads*(qk_nope_dim+v_dim), kv_lora_rank] */
    bool absorbed;          /* W_UK folded into q, W_UV after attention */
    float *out;             /* [n_q, n_heads * v_dim] */
} pd_mla_args;

/** Arguments of batched MLA decode attention (absorbed form): n_seqs
 * sequences, one new query each, the query of sequence i attending to its
 * tokens 0 .. seq_lens[i]-1 (its own latent already in the cache). Every
 * array is backend memory, so that the call can be recorded in a graph and
 * replayed with new lengths and tables. Sequence i's block table is
 * blocks[block_off[i] ...]. Same cache layout as pd_mla_args. */
typedef struct {
    int n_heads, qk_nope_dim, qk_rope_dim, v_dim, kv_lora_rank;
    float softmax_scale;
    int n_seqs;
    const float *q; /* [n_seqs, n_heads, qk_nope_dim + qk_rope_dim], rope applied (with prep: not yet; the op
                     * ropes q_pe in place through prep->q) */
    const float *cache;
    int n_layers, layer, block_size;
    const int32_t *seq_lens;  /* [n_seqs], >= 1 */
    const int32_t *block_off; /* [n_seqs] */
    const int32_t *blocks;
    const pd_weight *kv_b; /* [n_heads*(qk_nope_dim+v_dim), kv_lora_rank] */
    float *out;            /* [n_seqs, n_heads * v_dim] */
    /* NULL, or the attention prologue of these same rows (its rows ==
     * n_seqs, its q == q, its heads and dims the call's), which the op then
     * runs first: mla_prep's rmsnorm, rope and cache store, so that a
     * backend may fold them into its first kernel (CUDA: the q_lat kernel;
     * else, or with PD_MLA_PREP=apart, mla_prep). Errors (CUDA, sticky):
     * PD_ERR_INVALID where its rows, q, heads or dims differ from the
     * call's, and mla_prep's own. The CPU backend checks only what its
     * mla_prep checks, and then writes nothing (logged). */
    const struct pd_mla_prep_args *prep;
} pd_mla_decode_args;

/** The most top logprobs sample_rows reports for a row (OpenAI's
 * top_logprobs limit; model/pd_model.h PD_MAX_TOP_LOGPROBS equals it). */
#define PD_SAMPLE_MAX_TOP 20

/* pd_sample_tok.flags */
#define PD_SAMPLE_MASKED 1u /* the token cannot be sampled: its logit is -inf from step 1 on */
#define PD_SAMPLE_SEEN 2u   /* in the prompt or the output: the repetition penalty applies */

/** One token of a row's sparse adjustments (sample_rows). A row lists each
 * token at most once. */
typedef struct {
    int32_t id;    /* in [0, vocab) */
    uint32_t flags; /* PD_SAMPLE_* */
    int32_t count; /* occurrences in the output so far (frequency and presence penalties) */
    float bias;    /* logit_bias, 0 when none */
} pd_sample_tok;

/** One row to sample (sample_rows); the meanings of pd_sampling_params
 * (model/pd_model.h). */
typedef struct {
    int32_t row;       /* which row of the logits */
    float temperature; /* < 1e-5: greedy */
    int32_t top_k;     /* <= 0 or >= vocab: off */
    float top_p;       /* in (0, 1]; 1: off */
    float min_p;       /* in [0, 1]; 0: off */
    float repetition_penalty, frequency_penalty, presence_penalty;
    double u;          /* the row's uniform draw in [0, 1) (its request's generator) */
    int32_t n_top;     /* top logprobs wanted, 0 .. PD_SAMPLE_MAX_TOP */
    int32_t want_logprob; /* nonzero: the sampled token's logprob */
    int32_t tok_off, n_tok; /* its entries: toks[tok_off, tok_off + n_tok) */
    int32_t n_vocab;        /* ids at or past this are never drawn (no text: the tokenizer's
                               size, pd_sampling_params.text_vocab_size); masked after the
                               penalties, so logprobs are unchanged; <= 0 or >= vocab: none */
} pd_sample_row;

/** What sample_rows gives back for one row. */
typedef struct {
    int32_t token;
    float logprob; /* of token, when asked (else 0) */
    int32_t n_top; /* how many of top_ids / top_logprobs hold values */
    int32_t top_ids[PD_SAMPLE_MAX_TOP];
    float top_logprobs[PD_SAMPLE_MAX_TOP];
} pd_sample_out;

/** Arguments of the attention prologue of rows new tokens (mla_prep), all
 * backend memory: what transformers' DeepseekV3Attention.forward does
 * between kv_a_proj_with_mqa and the attention (DeepSeek-V2 §2.1.2-2.1.3). */
typedef struct pd_mla_prep_args {
    int rows, n_heads, qk_nope_dim, qk_rope_dim, kv_lora_rank;
    float *q;   /* [rows, n_heads, qk_nope_dim + qk_rope_dim], row stride n_heads * (dn + dr) */
    float *ckv; /* [rows, kv_lora_rank + qk_rope_dim]: c_KV | k_pe */
    const float *kv_norm; /* [kv_lora_rank] */
    float eps;
    const int32_t *pos;     /* [rows] */
    const float *inv_freq;  /* [qk_rope_dim / 2] */
    float mscale;           /* YaRN's attention factor on cos and sin */
    float *cache;           /* as kv_store's */
    const int32_t *slots;   /* [rows] */
    size_t slot_offset;
} pd_mla_prep_args;

/** Arguments of the MoE block of rows tokens (moe_block), all backend
 * memory: transformers' DeepseekV3DecoderLayer from post_attention_layernorm
 * to the residual add, with DeepseekV3MoE between (DeepSeek-V2 §2.2, V3
 * §2.1.2):
 *   h = RMSNorm(x) · norm;  logits = h · router^T;  (ids, weights) = route(logits)
 *   x += SharedExperts(h) + Σ_j weights[r, j] · Expert_{ids[r, j]}(h)
 * with Expert(h) = down · (silu(gate · h) ⊙ up · h) and SharedExperts the
 * same MLP over the shared weights (inter_shared = n_shared × inter units).
 * One rank, no expert parallelism (the model calls the separate ops there).
 * h, logits, ids, weights, gu, act and mo are the op's scratch, of the
 * sizes given; the op may leave any of them unwritten, except h and ids /
 * weights, which hold the norm and the routing afterwards. */
typedef struct {
    int rows, hidden;
    float *x;            /* [rows, hidden] fp32, in place */
    const float *norm;   /* [hidden] */
    float eps;
    const pd_weight *router; /* [n_experts, hidden] */
    pd_moe_route_params route;
    int inter;                    /* a routed expert's intermediate units */
    const pd_weight *gate_up;     /* [n_experts] of [2 inter, hidden] (gate rows, then up rows) */
    const pd_weight *down;        /* [n_experts] of [hidden, inter] */
    const pd_weight *shared_gate_up; /* [2 inter_shared, hidden], or NULL: no shared experts */
    const pd_weight *shared_down;    /* [hidden, inter_shared] */
    float *h;                /* [rows, hidden] */
    float *logits;           /* [rows, n_experts] */
    int32_t *ids;            /* [rows, top_k] */
    float *weights;          /* [rows, top_k] */
    float *gu;               /* [rows, 2 max(inter, inter_shared)] */
    float *act;              /* [rows, max(inter, inter_shared)] */
    float *mo;               /* [rows, hidden] */
    /* Optional: the attention's output projection first, x += o_in · o_proj^T
     * (transformers DeepseekV3Attention.o_proj and the residual add before
     * post_attention_layernorm); o_proj [hidden, P], o_in [rows, P] fp32.
     * NULL: x is already final. A backend may fold the router's arithmetic
     * into that product (CUDA at one row: the logits are linear in x and
     * o_in up to the norm's scale, so they are made beside the projection
     * from router · diag(norm) and router · diag(norm) · o_proj, which it
     * keeps in fp32, [n_experts, hidden + P] a layer; no gate kernel between
     * the projection and the experts). When moe_block returns false it has
     * not applied it either. */
    const float *o_in;
    const pd_weight *o_proj;
} pd_moe_block_args;

typedef struct pd_backend pd_backend;

/** The operation table. ctx is the backend's own state. Every pointer
 * argument is backend memory unless said otherwise. */
typedef struct {
    const char *name;
    /* memory */
    void *(*alloc)(pd_backend *be, size_t bytes); /* NULL on failure; zero-filled */
    void (*free)(pd_backend *be, void *p);
    void (*upload)(pd_backend *be, void *dst, const void *src_host, size_t bytes);
    void (*download)(pd_backend *be, void *dst_host, const void *src, size_t bytes);
    void (*copy)(pd_backend *be, void *dst, const void *src, size_t bytes);
    /** Makes a weight from host fp32 data [rows × cols] (the backend keeps its own copy). */
    pd_status (*weight_from_f32)(pd_backend *be, const float *host, int rows, int cols, pd_weight *w_p);
    void (*weight_free)(pd_backend *be, pd_weight *w);
    /** y[M×N] = x[M×K] · W[N×K]^T (+ y when accumulate). x row stride K, y row stride N. */
    void (*gemm)(pd_backend *be, int M, const float *x, const pd_weight *w, float *y, bool accumulate);
    /** y[r] = x[r] / rms(x[r]) * w, fp32 statistics. Strides in elements. */
    void (*rmsnorm)(pd_backend *be, int rows, int dim, const float *x, int x_stride, const float *w,
                    float eps, float *y, int y_stride);
    /** Rotates interleaved pairs (x[2i], x[2i+1]) of a rope_dim slice of every
     * head by angle pos * inv_freq[i], scaling by mscale (YaRN attention factor).
     * x: rows × n_heads heads, head h of row r at x + r*row_stride + h*head_stride.
     * pos: [rows] host int; inv_freq: [rope_dim/2] host fp32.
     * rows or n_heads 0: nothing. Limits: the CPU backend rotates an even
     * rope_dim of at most 1024 (its cos/sin table lives on the stack); CUDA
     * rope_dim / 2 pairs up to 4096, taking a rope_dim below 2 as nothing.
     * Errors, having written nothing: the CPU backend, which has no status
     * to keep an error in, logs rows or n_heads < 0, a rope_dim that is
     * negative, odd or above its limit, and (rope_dim > 0) x, pos or
     * inv_freq NULL (as moe_route); the CUDA backend records PD_ERR_INVALID
     * as its sticky error for rows or n_heads < 0, a pointer NULL or more
     * than its limit. */
    void (*rope)(pd_backend *be, int rows, int n_heads, float *x, int row_stride, int head_stride,
                 int rope_dim, const int *pos, const float *inv_freq, float mscale);
    /** out[r, i] = silu(gu[r, i]) * gu[r, I + i], gu [rows × 2I], out [rows × I]. */
    void (*silu_mul)(pd_backend *be, int rows, int inter, const float *gu, float *out);
    /** x += y, n elements. */
    void (*add)(pd_backend *be, size_t n, float *x, const float *y);
    /** out[r] = table[ids[r]] (table [vocab × dim]); ids host int32. */
    void (*embed)(pd_backend *be, int rows, int dim, const int32_t *ids, const pd_weight *table,
                  float *out);
    /** MLA attention for one sequence (see pd_mla_args). */
    void (*mla_attention)(pd_backend *be, const pd_mla_args *a);
    /** Routes rows tokens from router logits [rows × n_experts]:
     * ids [rows × top_k] (host int32), weights [rows × top_k] (host fp32).
     * rows 0: nothing (CUDA's moe_route still wants p). Limits: the CPU
     * backend routes at most 1024 experts, top_k 256 and, group-limited,
     * 256 groups (its scores live on the stack); CUDA 4096 experts and
     * n_group 1024.
     * Errors, having written nothing: what pd_moe_route_check refuses (p,
     * logits, ids or weights NULL, rows < 0, routing parameters the routing
     * does not define, more than the backend's limits). The CPU backend,
     * which has no status to keep an error in, logs it (as sample_rows);
     * the CUDA backend records PD_ERR_INVALID as its sticky error (its
     * moe_route takes rows < 0 as nothing). */
    void (*moe_route)(pd_backend *be, int rows, const float *logits, const pd_moe_route_params *p,
                      int32_t *ids, float *weights);
    /** Routed experts: out[r] += Σ_j weights[r,j] · expert_{ids[r,j]}(x[r]) with
     * expert(x) = down · (silu(gate·x) ⊙ up·x). gate_up[e] is [2I × H] (gate rows
     * then up rows), down[e] [H × I]. ids/weights host memory. */
    void (*moe_experts)(pd_backend *be, int rows, int hidden, int inter, const float *x,
                        const int32_t *ids, const float *weights, int top_k,
                        const pd_weight *gate_up, const pd_weight *down, float *out);
    void (*destroy)(pd_backend *be);

    /* ---- step operations: index arrays in backend memory ----
     * A step uploads its host arguments (token ids, positions, cache slots,
     * block tables) once, then queues only operations that never wait on
     * the host, so that a decode step can be recorded as a graph. */
    /** embed with ids [rows] in backend memory (checked by the caller). */
    void (*embed_ids)(pd_backend *be, int rows, int dim, const int32_t *ids, const pd_weight *table, float *out);
    /** rope with pos [rows] and inv_freq [rope_dim/2] in backend memory; the
     * same limits and errors. */
    void (*rope_pos)(pd_backend *be, int rows, int n_heads, float *x, int row_stride, int head_stride, int rope_dim,
                     const int32_t *pos, const float *inv_freq, float mscale);
    /** Writes row r of src (dim values, row stride src_stride) to
     * cache + (slots[r] + slot_offset) * dim; slots [rows] backend memory. */
    void (*kv_store)(pd_backend *be, int rows, int dim, const float *src, int src_stride, float *cache,
                     const int32_t *slots, size_t slot_offset);
    /** Batched MLA decode attention (see pd_mla_decode_args). */
    void (*mla_decode)(pd_backend *be, const pd_mla_decode_args *a);
    /** moe_route with ids and weights [rows × top_k] in backend memory;
     * the same limits and errors (CPU: logged; CUDA: sticky, rows < 0
     * included, rows 0 nothing without p too; nothing written). */
    void (*moe_route_ids)(pd_backend *be, int rows, const float *logits, const pd_moe_route_params *p, int32_t *ids,
                          float *weights);
    /** moe_experts with ids and weights in backend memory. An id of -1 is
     * a dropped pair (expert parallelism: another rank's expert, see
     * moe_ids_local): it adds nothing to out; every other id is < n_experts. */
    void (*moe_experts_ids)(pd_backend *be, int rows, int hidden, int inter, const float *x, const int32_t *ids,
                            const float *weights, int top_k, int n_experts, const pd_weight *gate_up,
                            const pd_weight *down, float *out);
    /** Expert parallelism: ids [n] (backend memory, in place) from global
     * expert ids to this rank's: an id in [first, first + count) becomes
     * id - first, any other -1 (dropped by moe_experts_ids). */
    void (*moe_ids_local)(pd_backend *be, size_t n, int32_t *ids, int first, int count);

    /** Optional fused step ops (NULL: the model calls the ops they stand
     * for; where set, equal to those up to fp32 rounding). mla_prep: for
     * each row, c_KV = RMSNorm(c_KV) · kv_norm, rope on k_pe and on every
     * head's q_pe at pos[r] (rope_pos's layout), then the row's c_KV | k_pe
     * to its cache slot (kv_store): rmsnorm, rope_pos twice and kv_store in
     * one pass. With rows > 0, a qk_rope_dim that is negative, odd or
     * beyond the backend's rope limit is refused before anything is
     * written (CPU: logged; CUDA: sticky, below 2 too). */
    void (*mla_prep)(pd_backend *be, const pd_mla_prep_args *a);
    /** act[M × I] = silu(x · W_gate^T) ⊙ (x · W_up^T), w [2I × K] (gate rows
     * then up rows, as gemm's gate_up): gemm into gu [M × 2I] (scratch the
     * op may leave unused) and silu_mul in one pass where it can. */
    void (*gemm_swiglu)(pd_backend *be, int M, const float *x, const pd_weight *w, float *gu, float *act);
    /** x += y, then h = RMSNorm(x) · w (rows × dim, row stride dim both):
     * add and rmsnorm in one pass (the residual add at the end of a layer
     * and the next one's input norm). */
    void (*add_rmsnorm)(pd_backend *be, int rows, int dim, float *x, const float *y, const float *w, float eps,
                        float *h);
    /** The MoE block of a step (pd_moe_block_args): rmsnorm, router,
     * routing, shared and routed experts and the residual add in fewer
     * passes than the separate ops (CUDA, decode-sized batches: four
     * kernels, the shared experts run as experts of the grouped GEMMs).
     * Returns false, having done nothing, where the backend has no faster
     * path for these arguments (CUDA: more than 4 rows, sizes or
     * alignments its kernels do not take, PD_MOE_BLOCK=0): the caller then
     * runs the separate ops.
     * Invalid arguments (CUDA: rows < 0, a missing pointer, routing
     * parameters moe_route_ids refuses, a router, expert or shared expert
     * weight whose shape disagrees with hidden, inter and n_experts) are
     * recorded as the backend's sticky error, and it returns true having
     * queued nothing. The CPU backend always runs pd_moe_block_composed;
     * having no status to keep an error in, it logs what that refuses (the
     * same invalid arguments) and, beyond its routing's limits (more than
     * 1024 experts or 256 groups, top_k above 256), what it cannot route,
     * and returns true having written nothing. */
    bool (*moe_block)(pd_backend *be, const pd_moe_block_args *a);
    /** A layer's input norm and the two projections that read it (transformers
     * DeepseekV3DecoderLayer.input_layernorm, then DeepseekV3Attention's
     * q_proj or q_a_proj and kv_a_proj_with_mqa of the same hidden states):
     *   h  = RMSNorm(x) · norm          x, h [rows × dim], norm [dim]
     *   y1 = h · W1^T                   W1 [N1 × dim], y1 [rows × N1]
     *   y2 = h · W2^T                   W2 [N2 × dim], y2 [rows × N2]
     * all fp32 activations, row strides dim, N1, N2; weights in the
     * backend's format; the norm's arithmetic is rmsnorm's and the products
     * gemm's (without accumulate). rmsnorm, then gemm twice, in one pass
     * where the backend can (CUDA: one launch for decode-sized batches).
     * norm is a weight as W1 and W2 are (CUDA may read it before the
     * kernels queued ahead have finished: nothing queued may write it).
     * h, y1 and y2 must not overlap one another or x. Errors (CUDA, sticky):
     * PD_ERR_INVALID for rows < 0, dim <= 0, a weight whose cols is not
     * dim or whose rows <= 0, a missing pointer or overlapping buffers. */
    void (*rmsnorm_gemm_pair)(pd_backend *be, int rows, int dim, const float *x, const float *norm, float eps,
                              float *h, const pd_weight *w1, float *y1, const pd_weight *w2, float *y2);

    /* ---- tensor parallelism (pd_backend_init_tp) ---- */
    /** x[0..n) = the sum over every rank of the group of that rank's x[0..n),
     * in place, the same bits on every rank. Every rank of the group calls
     * it with the same n, in the same order, each from its own thread; it is
     * queued like any operation (a graph may record it). A no-op on a
     * backend that is a group of one. */
    void (*all_reduce_sum)(pd_backend *be, float *x, size_t n);

    /* ---- optional: NULL where the backend has no use for them ---- */
    /** Page-locked host memory for staging copies (NULL: the backend's own
     * memory is host memory, so nothing needs staging). NULL on failure. */
    void *(*host_alloc)(pd_backend *be, size_t bytes);
    void (*host_free)(pd_backend *be, void *p);
    /** upload queued without waiting for it (upload waits: its source may
     * be reused on return): src_host, page-locked (host_alloc), must stay
     * unchanged until upload_wait returns, which waits for the last
     * upload_async's copy (at once when it is done, as it is after any
     * download). Both or neither; NULL: use upload. Not while recording a
     * graph (CUDA: PD_ERR_UNSUPPORTED). The CUDA backend's
     * upload waits ~5 µs on the host for a step's few KB of arguments
     * (session 18's timeline); a step's arguments go up this way and the
     * next step waits before it rewrites them (model/forward.c). */
    void (*upload_async)(pd_backend *be, void *dst, const void *src_host, size_t bytes);
    void (*upload_wait)(pd_backend *be);
    /** Page-locks host memory the caller allocated (CUDA: cudaHostRegister,
     * portable to every device), so copies from and into it run as fast as
     * from host_alloc's; host_unregister undoes it before the memory goes.
     * Errors: PD_ERR_IO (the driver refused; logged). */
    pd_status (*host_register)(pd_backend *be, void *p, size_t bytes);
    void (*host_unregister)(pd_backend *be, void *p);
    /** Loading bf16 checkpoints without an fp32 copy: weight_alloc makes an
     * uninitialised [rows × cols] weight, weight_set_bf16 fills rows
     * [row0, row0 + n_rows) from host bf16 bits. */
    pd_status (*weight_alloc)(pd_backend *be, int rows, int cols, pd_weight *w_p);
    pd_status (*weight_set_bf16)(pd_backend *be, pd_weight *w, int row0, int n_rows, const uint16_t *src);
    /** Graphs: between graph_begin and graph_end the queued operations are
     * recorded, not run; graph_launch replays them with whatever the
     * buffers they read hold then. graph_begin: PD_ERR_UNSUPPORTED when
     * disabled. graph_end: PD_ERR_UNSUPPORTED when something in the
     * recording could not be recorded (the backend stays usable).
     * graph_launch: PD_ERR_LIMIT when the graph is stale (the backend moved
     * a buffer it reads) and must be recorded again. */
    pd_status (*graph_begin)(pd_backend *be);
    pd_status (*graph_end)(pd_backend *be, void **graph_p);
    pd_status (*graph_launch)(pd_backend *be, void *graph);
    void (*graph_free)(pd_backend *be, void *graph);
    /** Makes the calling thread's operations go to this backend's device
     * (CUDA: cudaSetDevice); a rank's thread calls it once before its first
     * operation. NULL where any thread will do. */
    void (*thread_bind)(pd_backend *be);
    /** Device memory this backend has allocated and not freed (buffers,
     * weights, scratch, workspace; not the driver's context or libraries'
     * internals), bytes: what --gpu-memory-utilization charges to this
     * replica. NULL where memory is host memory. */
    size_t (*device_bytes)(pd_backend *be);
    /** Samples one token from each of n rows of logits, where they are
     * (rows[i].row of logits [.. × vocab], backend memory), so only the
     * results cross to the host; the order and meanings of model/sampler.c
     * (vLLM's sampler) with one difference, the order of the final draw.
     * For each row, with l its logits (modified in place):
     *   1. l[t] = -inf for every listed token flagged PD_SAMPLE_MASKED;
     *   2. logprobs of l as it stands (log softmax, the normaliser in
     *      double): the n_top best tokens (logit descending, ties to the
     *      lower id) and, at the end, the sampled token's;
     *   3. logit_bias: l[t] += bias; 4. penalties on listed tokens: the
     *      repetition penalty on those flagged PD_SAMPLE_SEEN (positive l
     *      divided, others multiplied), then with count > 0
     *      l -= frequency_penalty * count and l -= presence_penalty;
     *   4b. l[t] = -inf for t >= n_vocab (0 < n_vocab < vocab): ids with no
     *      text (after the logprobs of step 2, which they keep);
     *   5. temperature < 1e-5: the argmax of l (ties to the lower id; every
     *      logit -inf: token 0); otherwise l / temperature (NaN: -inf) and,
     *      if its max is not finite, the argmax of that;
     *   6. top-k: the top_k best of l / temperature (descending, ties to the
     *      lower id); weights w = expf(l / temperature - max) of those;
     *   7. top-p: the fewest of those, best weight first (ties to the lower
     *      id), whose weights sum (double) to at least top_p of theirs;
     *   8. min-p: of those, the ones with w >= min_p;
     *   9. the draw: the survivors with w > 0 in id order, the first whose
     *      running sum of w (double) exceeds u times their sum; when
     *      rounding leaves none, the last of them; when none has w > 0, the
     *      argmax of step 5.
     * (model/sampler.c draws in the order its selection leaves the
     * candidates, so the same u can give another token there; the
     * distribution is the same.) toks [n_toks], rows [n] and out [n] are host
     * memory; the call returns when out is filled (a failed call leaves
     * every out[i].token -1). Errors (the backend's
     * status, as every op): PD_ERR_INVALID (a row or token outside the
     * logits, n_top outside [0, PD_SAMPLE_MAX_TOP]). The CPU backend's is
     * the reference; the model samples through this op only where logits
     * are not host memory (host_alloc is set), and through model/sampler.c
     * elsewhere. */
    void (*sample_rows)(pd_backend *be, int n, int vocab, float *logits, const pd_sample_row *rows,
                        const pd_sample_tok *toks, int n_toks, pd_sample_out *out);
} pd_backend_i;

/* The largest tensor-parallel group: the GPUs of one host. */
#define PD_TP_MAX_RANKS 8

struct pd_backend {
    const pd_backend_i *ops;
    void *ctx;
    int n_threads;
    int rank, n_ranks; /* place in its tensor-parallel group; 0 and 1 alone */
};

/** Creates the CPU backend with n_threads worker threads (0: all cores).
 * Errors: PD_ERR_NOMEM. */
pd_status pd_backend_cpu_init(int n_threads, pd_backend **be_p);

/** Creates the CUDA backend on device `device`. Errors: PD_ERR_UNSUPPORTED
 * when built without CUDA or no device is present. */
pd_status pd_backend_cuda_init(int device, pd_backend **be_p, pd_err *err);

/** Creates a backend by name ("cpu", "cuda"). */
pd_status pd_backend_init(const char *name, int n_threads, pd_backend **be_p, pd_err *err);

/** Tensor parallelism within one process: creates the n_ranks backends of
 * one group, bes_p[r] being rank r, joined by the communicator that
 * all_reduce_sum uses. Rank r's operations must come from one thread per
 * rank (each rank's thread calls thread_bind first, where it is set).
 *  - CPU: n_ranks backends over the same memory (n_threads workers each, 0:
 *    all cores); all_reduce_sum meets the other ranks' threads at a barrier.
 *  - CUDA: rank r on device r, NCCL communicators from ncclCommInitAll
 *    (libnccl.so.2, or $PD_NCCL_LIB, loaded at run time; not needed for a
 *    group of one).
 * n_ranks 1 gives what pd_backend_init gives. Free each with
 * pd_backend_free. Errors: PD_ERR_INVALID (n_ranks outside 1 ..
 * PD_TP_MAX_RANKS, unknown name), PD_ERR_UNSUPPORTED (fewer devices than
 * ranks, no NCCL, no CUDA in this build), PD_ERR_NOMEM, PD_ERR_IO. */
pd_status pd_backend_init_tp(const char *name, int n_ranks, int n_threads, pd_backend **bes_p, pd_err *err);
pd_status pd_backend_cpu_init_tp(int n_ranks, int n_threads, pd_backend **bes_p, pd_err *err);
pd_status pd_backend_cuda_init_tp(int n_ranks, pd_backend **bes_p, pd_err *err);

/** What a replica reports about one CUDA device (start-up self-checks,
 * NUMA placement, NVML lookup). */
typedef struct {
    char name[96];
    char pci_bus_id[32]; /* "0000:18:00.0", as cudaDeviceGetPCIBusId writes it */
    int cc_major, cc_minor; /* compute capability */
    int n_sm;
    size_t mem_total; /* bytes (cudaDeviceProp.totalGlobalMem) */
    size_t mem_free;  /* bytes (cudaMemGetInfo), with with_mem only; else 0 */
} pd_cuda_device_info;

/** Describes CUDA device `device` (an index as CUDA_VISIBLE_DEVICES leaves
 * them). with_mem also asks cudaMemGetInfo, which makes the device's
 * primary context current on the calling thread (so: after the backend is
 * up); without it no context is created. Errors: PD_ERR_UNSUPPORTED (built
 * without CUDA, no such device; err says which), PD_ERR_IO (a CUDA call
 * failed). */
pd_status pd_backend_cuda_device_info(int device, bool with_mem, pd_cuda_device_info *info_p, pd_err *err);

/** What the start-up all-reduce check found (pd_backend_check_all_reduce). */
typedef struct {
    int n_ranks;
    size_t n;         /* floats per rank */
    float expected;   /* N(N+1)/2 */
    int bad_rank;     /* -1: every element on every rank was expected */
    size_t bad_index; /* the first wrong element of bad_rank */
    float got;        /* its value */
    double seconds;   /* fill, all-reduce, read back, compare */
} pd_all_reduce_check;

/** Start-up self-check of a tensor-parallel group (DESIGN: checked before a
 * replica registers): rank r fills n floats with r + 1, all_reduce_sum runs
 * on every rank from its own thread (thread_bind first), and every element
 * read back on every rank must equal N(N+1)/2 exactly — small integers,
 * exact in fp32 whatever order the sum takes, so any difference is a fault
 * (a wrong peer, a broken link, a bad NCCL), not rounding. With one rank
 * the same fill, no-op reduce and read back check the device's memory
 * path. inject_failure (testing: --debug-inject-selfcheck-failure) changes
 * one element of rank 0's result after it is read back, as a wrong
 * all-reduce would. *res_p is filled in every case but NOMEM. Errors:
 * PD_ERR_INVALID (n_ranks outside 1 .. PD_TP_MAX_RANKS, n 0),
 * PD_ERR_NOMEM (a buffer), PD_ERR_IO (a wrong value: err names the rank,
 * the element, the value and the expected one). */
pd_status pd_backend_check_all_reduce(pd_backend *const *bes, int n_ranks, size_t n, bool inject_failure,
                                      pd_all_reduce_check *res_p, pd_err *err);

/** moe_block as the ops it stands for, on be: rmsnorm (into a->h), gemm
 * (router, into a->logits), moe_route_ids (a->ids, a->weights), with shared
 * experts gemm_swiglu (or gemm and silu_mul where the backend has no
 * gemm_swiglu) and gemm into a->mo, moe_experts_ids adding the routed
 * experts into a->mo (into a->x without shared experts), then add (x += mo).
 * The same math as moe_block (pd_moe_block_args), one rank. The CPU
 * backend's moe_block; a caller whose moe_block returned false may run it
 * (the tests do; the model runs its own separate ops, which also cover
 * tensor and expert parallelism). rows 0: nothing.
 * Errors: PD_ERR_INVALID, having queued nothing and written nothing (err
 * says what): be or a NULL; rows < 0, hidden or inter <= 0; any of x,
 * norm, router, gate_up, down, h, logits, ids, weights, gu, act, mo NULL,
 * or shared_gate_up without shared_down; routing parameters the routing
 * does not define (pd_moe_route_check without limits: n_experts <= 0,
 * top_k outside [1, n_experts], scoring outside 0..1, topk_method outside
 * 0..2, and with group-limited routing n_group not dividing n_experts or
 * topk_group outside [1, n_group]); a router
 * that is not [n_experts, hidden], an expert whose gate_up is not
 * [2 inter, hidden] or whose down is not [hidden, inter], shared experts
 * whose gate_up is not [2 Ish, hidden] with Ish > 0 or whose down is not
 * [hidden, Ish], or any of these weights without data — the checks of the
 * CUDA moe_block, without its kernels' size limits. Once the arguments
 * pass, PD_OK: the ops' own errors are recorded as each backend records
 * them (CUDA: sticky). */
pd_status pd_moe_block_composed(pd_backend *be, const pd_moe_block_args *a, pd_err *err);

/** Checks the arguments of moe_route and moe_route_ids (the routing of
 * moe_block too): rows tokens' logits [rows × n_experts] routed by p into
 * ids and weights [rows × top_k]. op starts err's message ("moe_route: ...");
 * lim: the backend's limits, NULL for none. rows 0: PD_OK, whatever else
 * (nothing to route). Reads no buffer.
 * Errors: PD_ERR_INVALID (err says what): p NULL; rows < 0; logits, ids or
 * weights NULL; n_experts <= 0 or top_k outside [1, n_experts]; scoring
 * outside 0..1 or topk_method outside 0..2; with group-limited routing
 * (topk_method 1 or 2 and n_group > 1) n_group not dividing n_experts or
 * topk_group outside [1, n_group]; more experts, groups (group-limited) or
 * top_k than lim holds. */
pd_status pd_moe_route_check(const char *op, int rows, const float *logits, const pd_moe_route_params *p,
                             const int32_t *ids, const float *weights, const pd_moe_route_limits *lim, pd_err *err);

/** Destroys a backend; *be_p set to NULL. */
void pd_backend_free(pd_backend **be_p);

#endif

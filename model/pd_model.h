/* model/ — the DeepSeek-V2/V3 model: config.json, safetensors checkpoints
 * (single file or shards, mmap), weights, the paged latent KV cache, the
 * forward pass over a kernels/ backend, and the sampler.
 *
 * Read this header first. Sources of the math: DeepSeek-V2 paper (arXiv
 * 2405.04434) §2.1 (MLA), §2.2 (DeepSeekMoE); DeepSeek-V3 paper (arXiv
 * 2412.19437) §2.1.2 (auxiliary-loss-free routing); the reference
 * implementation is Hugging Face transformers
 * models/deepseek_v3/modeling_deepseek_v3.py and models/deepseek_v2/.
 */
#ifndef PD_MODEL_H
#define PD_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd_common.h"
#include "pd_kernels.h"

/* ------------------------------------------------------------------ */
/* dtypes and safetensors                                              */
/* ------------------------------------------------------------------ */

/** Tensor element types that pdserve reads and writes. */
typedef enum {
    PD_DT_F32 = 0,
    PD_DT_BF16,
    PD_DT_F16,
    PD_DT_F8_E4M3, /* safetensors "F8_E4M3" (OCP e4m3fn) */
    PD_DT_I64,     /* read only for completeness of headers; never a weight */
    PD_DT_I32,
    PD_DT_COUNT
} pd_dtype;

/** Bytes per element of dt; 0 for an invalid value. */
size_t pd_dtype_size(pd_dtype dt);
/** Safetensors name ("F32", "BF16", "F16", "F8_E4M3", "I64", "I32"). */
const char *pd_dtype_name(pd_dtype dt);
/** Parses a safetensors dtype name. Errors: PD_ERR_UNSUPPORTED. */
pd_status pd_dtype_parse(const char *name, pd_dtype *dt_p);

#define PD_ST_MAX_DIMS 4

/** One tensor of a checkpoint, borrowed from a pd_safetensors (valid until
 * pd_st_close). data points into the read-only mmap of its file. */
typedef struct {
    const char *name;
    pd_dtype dtype;
    int ndim;
    int64_t shape[PD_ST_MAX_DIMS];
    size_t nbytes;
    const void *data;
    const char *file; /* path of the file holding it, for error messages */
} pd_st_tensor;

typedef struct pd_safetensors pd_safetensors;

/** Opens the checkpoint in dir: model.safetensors.index.json (shards) when
 * present, else model.safetensors. Every file is mmapped read-only and its
 * header validated: 8-byte length within the file, well-formed JSON, every
 * tensor's dtype known, shape × dtype size == data_offsets span, offsets
 * inside the data section, sorted spans not overlapping. The index's
 * weight_map must name files that exist and tensors they contain.
 * On success *st_p owns the maps (free with pd_st_close).
 * Errors: PD_ERR_IO (missing/unreadable file), PD_ERR_FORMAT (any header
 * violation), PD_ERR_UNSUPPORTED (unknown dtype); err names the file and the
 * tensor. */
pd_status pd_st_open_dir(const char *dir, pd_safetensors **st_p, pd_err *err);

/** Opens one .safetensors file (same validation as pd_st_open_dir). */
pd_status pd_st_open_file(const char *path, pd_safetensors **st_p, pd_err *err);

/** Looks up a tensor by exact name; NULL when absent. */
const pd_st_tensor *pd_st_find(const pd_safetensors *st, const char *name);

/** Number of tensors and the i-th (0 <= i < count), in header order. */
size_t pd_st_count(const pd_safetensors *st);
const pd_st_tensor *pd_st_at(const pd_safetensors *st, size_t i);

/** Unmaps and frees; sets *st_p to NULL. Safe on NULL. */
void pd_st_close(pd_safetensors **st_p);

/** A 64-bit fingerprint of the checkpoint in dir's weights (never 0): every
 * tensor's name and size, and the first 64 bytes of the first
 * PD_CKPT_FP_SAMPLED tensors in file and header order (a page each: cheap
 * on a checkpoint of any size). Two checkpoints of one architecture with
 * other weights (another seed, another fine-tune) differ, short of a
 * collision; the same files, copied anywhere, agree. Errors: those of
 * pd_st_open_dir. */
#define PD_CKPT_FP_SAMPLED 256
pd_status pd_checkpoint_fingerprint(const char *dir, uint64_t *fp_p, pd_err *err);

/** Converts n elements of t (F32/BF16/F16/F8_E4M3, no scaling) to fp32. */
void pd_st_to_f32(const pd_st_tensor *t, float *out);

/** Streams a safetensors file out: declare every tensor first (the header
 * needs all offsets), then write each tensor's bytes in declaration order.
 * The __metadata__ entry {"format":"pt"} is written, as transformers does. */
typedef struct pd_st_writer pd_st_writer;
/** Errors: PD_ERR_IO (cannot create path). */
pd_status pd_st_writer_open(const char *path, pd_st_writer **w_p, pd_err *err);
/** Declares a tensor. Errors: PD_ERR_INVALID (duplicate name, bad ndim, data already begun). */
pd_status pd_st_writer_declare(pd_st_writer *w, const char *name, pd_dtype dt, int ndim,
                               const int64_t *shape, pd_err *err);
/** Writes the next declared tensor's data (nbytes must equal its size; name
 * must be the next in order). The header is written before the first data.
 * Errors: PD_ERR_INVALID (order/size), PD_ERR_IO. */
pd_status pd_st_writer_write(pd_st_writer *w, const char *name, const void *data, size_t nbytes,
                             pd_err *err);
/** Finishes the file (all declared tensors must have been written), closes
 * it and frees w; *w_p is set to NULL even on error. Errors: PD_ERR_INVALID, PD_ERR_IO. */
pd_status pd_st_writer_close(pd_st_writer **w_p, pd_err *err);
/** Total bytes the file will have (header + data) given the declarations so far. */
size_t pd_st_writer_size(const pd_st_writer *w);

/* ------------------------------------------------------------------ */
/* config.json                                                         */
/* ------------------------------------------------------------------ */

typedef enum { PD_ARCH_DEEPSEEK_V2 = 2, PD_ARCH_DEEPSEEK_V3 = 3 } pd_arch;
typedef enum { PD_SCORE_SOFTMAX = 0, PD_SCORE_SIGMOID } pd_scoring;
typedef enum { PD_TOPK_GREEDY = 0, PD_TOPK_GROUP_LIMITED_GREEDY, PD_TOPK_NOAUX_TC } pd_topk_method;

/** The fields of a Hugging Face DeepSeek config.json the forward pass uses. */
typedef struct {
    pd_arch arch;
    int hidden_size, num_hidden_layers, num_attention_heads;
    int q_lora_rank; /* 0 when null: plain q_proj */
    int kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
    int intermediate_size, moe_intermediate_size;
    int n_routed_experts, n_shared_experts, num_experts_per_tok;
    int n_group, topk_group;
    pd_topk_method topk_method;
    pd_scoring scoring_func;
    bool norm_topk_prob;
    float routed_scaling_factor;
    int first_k_dense_replace, moe_layer_freq;
    float rms_norm_eps;
    double rope_theta;
    /* rope_scaling (YaRN) — has_yarn false when rope_scaling is null */
    bool has_yarn;
    double yarn_factor, yarn_beta_fast, yarn_beta_slow, yarn_mscale, yarn_mscale_all_dim;
    int yarn_original_max_position_embeddings;
    int max_position_embeddings, vocab_size;
    int bos_token_id, eos_token_id;
    bool tie_word_embeddings;
    float initializer_range;
    /* quantization_config: FP8 block quantisation when fp8 is true */
    bool fp8;
    int fp8_block[2]; /* weight_block_size, [128, 128] for DeepSeek-V3 */
    char torch_dtype[16];
} pd_model_config;

/** Parses dir/config.json. An unsupported model_type or a missing or
 * ill-typed required field is an error naming the file and the field.
 * Errors: PD_ERR_IO, PD_ERR_FORMAT (bad JSON, bad field), PD_ERR_NOTFOUND
 * (missing field), PD_ERR_UNSUPPORTED (model_type, scoring, topk_method). */
pd_status pd_config_load(const char *path, pd_model_config *cfg_p, pd_err *err);
/** Parses config JSON text; `path` is only used in messages. */
pd_status pd_config_parse(const char *json, const char *path, pd_model_config *cfg_p, pd_err *err);
/** Writes cfg as a Hugging Face config.json to path. Errors: PD_ERR_IO. */
pd_status pd_config_save(const pd_model_config *cfg, const char *path, pd_err *err);
/** True when layer l uses MoE (l >= first_k_dense_replace and l % moe_layer_freq == 0). */
bool pd_config_layer_is_moe(const pd_model_config *cfg, int layer);
/** A 64-bit fingerprint of the architecture fields (two replicas must agree). */
uint64_t pd_config_fingerprint(const pd_model_config *cfg);
/** Softmax scale qk_head_dim^-0.5 × mscale², mscale = yarn_get_mscale(factor, mscale_all_dim). */
float pd_config_softmax_scale(const pd_model_config *cfg);

/* ------------------------------------------------------------------ */
/* presets and mkmodel                                                 */
/* ------------------------------------------------------------------ */

/** Fills cfg for a preset: "tiny", "tiny-v2", "small", "v2-lite",
 * "v3-layers". Errors: PD_ERR_NOTFOUND (unknown name). */
pd_status pd_preset_config(const char *name, pd_model_config *cfg_p, pd_err *err);

/** Writes a random-initialised checkpoint of cfg into dir (created):
 * config.json, model.safetensors (or shards + index above shard_bytes),
 * weights ~ N(0, initializer_range) in cfg->torch_dtype (FP8 + 128×128
 * weight_scale_inv when cfg->fp8), norms 1, small e_score_correction_bias;
 * then tokenizer.json and tokenizer_config.json copied from tokenizer_dir
 * when non-NULL. Deterministic in seed. A tokenizer_dir without both files
 * fails before anything is written; config.json is written last, so a
 * directory holding it holds the whole checkpoint.
 * Errors: PD_ERR_IO, PD_ERR_INVALID. */
pd_status pd_mkmodel_write(const pd_model_config *cfg, uint64_t seed, const char *dir,
                           size_t shard_bytes, const char *tokenizer_dir, pd_err *err);

/* ------------------------------------------------------------------ */
/* model, KV cache, forward                                            */
/* ------------------------------------------------------------------ */

typedef struct pd_model pd_model;

/** Loads dir (config.json + safetensors) onto backend be: every tensor the
 * config implies must exist with the implied shape (an FP8 weight also
 * needs its weight_scale_inv). Weights are converted to the backend's
 * compute format (fp32 on CPU; FP8 dequantised block × scale_inv).
 * Errors: any of pd_config_load / pd_st_open_dir, PD_ERR_NOTFOUND (missing
 * tensor), PD_ERR_SHAPE (shape differs from the config); err names the file
 * and tensor. */
pd_status pd_model_load(const char *dir, pd_backend *be, pd_model **m_p, pd_err *err);

/** Tensor parallelism: loads dir sharded over the n_ranks backends of one
 * group (pd_backend_init_tp), rank r's shard on bes[r], and starts one
 * thread per rank that runs that rank's share of every later call on the
 * model and its caches. Sharding (Megatron-LM style, as DeepSeek-V2/V3 are
 * served): attention heads divided over the ranks; the MLA latent path
 * replicated, so the latent KV cache is the same on every rank; dense MLPs,
 * shared and routed experts divided along their intermediate dimension;
 * router, norms, embedding and lm_head replicated; one all-reduce after
 * o_proj and one after the MLP / MoE of every layer. Everything else in
 * this header works unchanged on the result; the logits are the same up to
 * fp32 rounding (the partial sums add up in another order).
 * n_ranks 1 is pd_model_load. The backends must outlive the model.
 * Errors: those of pd_model_load; PD_ERR_INVALID (bes are not ranks 0 ..
 * n_ranks-1 of one group, or n_ranks does not divide num_attention_heads,
 * intermediate_size or moe_intermediate_size: err names which). */
pd_status pd_model_load_tp(const char *dir, pd_backend *const *bes, int n_ranks, pd_model **m_p, pd_err *err);
/** pd_model_load_tp, and with expert_parallel (vLLM's
 * --enable-expert-parallel) the routed experts divided whole over the
 * ranks instead of each split: rank r loads and holds only experts
 * [r·E/n, (r+1)·E/n) (E = n_routed_experts), computes only the routed
 * (token, expert) pairs of those experts, and the all-reduce after the MoE
 * block adds the ranks' partial sums (forward.c says why that is the
 * reference's sum). Attention, dense MLPs and shared experts stay tensor
 * parallel. Logs each rank's experts and their size (INFO).
 * Errors: those of pd_model_load_tp, where with expert_parallel the
 * routed-expert check is PD_ERR_INVALID when n_ranks does not divide
 * n_routed_experts (err names it) or the shared experts' intermediate size,
 * and moe_intermediate_size need not be divisible. */
pd_status pd_model_load_parallel(const char *dir, pd_backend *const *bes, int n_ranks, bool expert_parallel,
                                 pd_model **m_p, pd_err *err);
void pd_model_free(pd_model **m_p);
const pd_model_config *pd_model_config_of(const pd_model *m);
/** Number of tensor-parallel ranks (1 unless loaded with pd_model_load_tp). */
int pd_model_tp_size(const pd_model *m);
/** True when loaded with expert_parallel (pd_model_load_parallel). */
bool pd_model_expert_parallel(const pd_model *m);
/** The routed experts rank `rank` (0 .. tp size - 1) holds:
 * [*first, *first + *count) of n_routed_experts — all of them (split)
 * without expert parallelism, its own E / n whole with it. */
void pd_model_rank_experts(const pd_model *m, int rank, int *first, int *count);

/** Paged latent KV cache: num_blocks blocks of block_size tokens; each
 * token slot of each layer holds kv_lora_rank (normalised latent c_KV) +
 * qk_rope_head_dim (roped k_pe) fp32 values. Layout [block][layer][slot][D]
 * with D = kv_lora_rank + qk_rope_head_dim, so one block is contiguous for
 * transfer. With tensor parallelism every rank holds a copy with the same
 * contents; block pointers and copies out (pd_kv_cache_stage_out) are
 * rank 0's, copies in (pd_kv_cache_stage_in) write every rank's. Free a cache before its model. */
typedef struct pd_kv_cache pd_kv_cache;
pd_status pd_kv_cache_init(const pd_model *m, int block_size, int num_blocks, pd_kv_cache **kv_p,
                           pd_err *err);
void pd_kv_cache_free(pd_kv_cache **kv_p);
int pd_kv_cache_block_size(const pd_kv_cache *kv);
int pd_kv_cache_num_free(const pd_kv_cache *kv);
int pd_kv_cache_num_blocks(const pd_kv_cache *kv);
/** Allocates one block; returns its index or -1 when none is free. */
int pd_kv_cache_alloc(pd_kv_cache *kv);
void pd_kv_cache_release(pd_kv_cache *kv, int block);
/** Bytes of one block (all layers) and a pointer to it (backend memory). */
size_t pd_kv_cache_block_bytes(const pd_kv_cache *kv);
void *pd_kv_cache_block_ptr(pd_kv_cache *kv, int block);

/** Bytes of one KV block (block_size tokens, every layer, kv_lora_rank +
 * qk_rope_head_dim fp32 values a token and layer) of a cache of this
 * model: what pd_kv_cache_block_bytes will return, known before the cache
 * exists (for planning its size). */
size_t pd_kv_cache_bytes_per_block(const pd_model_config *cfg, int block_size);

/** How a device's memory is split when the KV cache is sized from a
 * fraction of it (vLLM's --gpu-memory-utilization): bytes. */
typedef struct {
    size_t mem_total;  /* the device's memory */
    size_t mem_in_use; /* held by this replica when planning: its weights and buffers (the backend's count) */
    size_t mem_others; /* held by everything else: CUDA contexts, other processes (total - free - mem_in_use) */
    size_t mem_free;   /* free when planning */
    size_t budget;     /* utilization × mem_total: what this replica may occupy in all */
    size_t reserve;    /* kept out of the KV cache for the step workspace (scratch, graphs) */
    size_t kv_bytes;   /* num_blocks × block bytes */
    int num_blocks;
    bool by_free;      /* the free memory, not the budget, limited the cache */
} pd_kv_plan;

/** Plans the KV cache from a fraction of a device's memory, after the
 * weights are loaded. As vLLM's --gpu-memory-utilization (per instance, its
 * docs: two instances on one GPU can each take 0.5), the fraction is of the
 * whole device and covers what this replica holds (own_in_use: its weights
 * and buffers, as its backend counts them), not what other processes hold;
 * and the cache must fit in what is free:
 *   room = min(utilization × mem_total − own_in_use − reserve, mem_free − reserve),
 *   num_blocks = floor(room / block_bytes), at most max_blocks (the cache's
 * own limit). Two replicas sharing a GPU can so take 0.45 each, in either
 * order. (Until session 4 all memory in use counted, so the replica that
 * planned second found the first's cache and stopped.) Fills *plan.
 * Errors: PD_ERR_INVALID (utilization outside (0, 1], mem_free > mem_total,
 * own_in_use > mem_total − mem_free, block_bytes 0), PD_ERR_NOMEM (no room
 * for one block: err names the budget, this replica's memory, the others',
 * the free memory and the reserve). */
pd_status pd_kv_plan_blocks(size_t mem_total, size_t mem_free, size_t own_in_use, double utilization, size_t reserve,
                            size_t block_bytes, int max_blocks, pd_kv_plan *plan, pd_err *err);

/* ---- the KV staging pool (model/kv_staging.c) ----
 * KV blocks leave and enter a replica from host memory (the KV transfer
 * registers it with UCX). A cache in host memory (CPU) is that memory
 * itself: prefill replicas put straight into a decode replica's cache
 * blocks. A cache in device memory moves through a staging pool: slots of
 * one block each, in page-locked host memory sized apart from the cache
 * (--kv-staging-blocks), so that a large device cache does not page-lock
 * a host mirror of itself (the host pool once did: 40 GiB page-locked and
 * 45 s of UCX registration for a 40 GiB cache). */
typedef struct pd_kv_staging pd_kv_staging;

/** The staging pool's default size in slots for a cache of num_blocks
 * blocks of block_size tokens of this model: room for 4 prompts of the
 * model's context (max_position_embeddings tokens), at most 4 GiB unless
 * one such prompt needs more (a decode replica receives a prompt's blocks
 * whole, so one must fit), and at most num_blocks. At least 1. */
int pd_kv_staging_default_slots(const pd_model_config *cfg, int block_size, int num_blocks);

/** Makes a staging pool of num_slots slots of pd_kv_cache_block_bytes(kv)
 * bytes each, for kv (borrowed: the pool copies to and from its blocks on
 * every rank, so it must outlive every pd_kv_cache_stage_* call, not the
 * pool). mem NULL: the pool allocates its memory (page-locked through the
 * backend's host_alloc; ordinary page-aligned memory when the cache is
 * host memory, which only a test forcing staging asks for). mem given: the
 * caller's memory of num_slots × block bytes (e.g. a pool UCX allocated in
 * shared memory, which a writer on the same host fills by one-sided puts),
 * kept by the caller until pd_kv_staging_free and page-locked here when
 * the backend can. Every slot starts free. *st_p is the caller's
 * (pd_kv_staging_free). Errors: PD_ERR_INVALID (num_slots <= 0),
 * PD_ERR_LIMIT (the size overflows), PD_ERR_NOMEM (the allocation failed),
 * PD_ERR_UNSUPPORTED (a device backend that cannot page-lock foreign
 * memory), PD_ERR_IO (page-locking mem failed). */
pd_status pd_kv_staging_init(pd_kv_cache *kv, int num_slots, void *mem, pd_kv_staging **st_p, pd_err *err);
/** Unlocks borrowed memory, or frees the pool's own; NULLs *st_p. Call it
 * after the memory is unregistered from the KV transfer and no put reads
 * or writes it any more. NULL or *st_p NULL: a no-op. */
void pd_kv_staging_free(pd_kv_staging **st_p);
/** The pool's memory: [num_slots][block bytes], slot s at base + s × block
 * bytes; pd_kv_staging_bytes of it. */
void *pd_kv_staging_base(const pd_kv_staging *st);
size_t pd_kv_staging_bytes(const pd_kv_staging *st);
int pd_kv_staging_num_slots(const pd_kv_staging *st);
int pd_kv_staging_num_free(const pd_kv_staging *st);
/** Slot's first byte (0 <= slot < num_slots, asserted). */
void *pd_kv_staging_slot_ptr(pd_kv_staging *st, int slot);
/** Takes n free slots, all or none: their ids into slots[0..n) (the
 * caller's array). Errors: PD_ERR_LIMIT (fewer than n free, or n < 0;
 * nothing taken). */
pd_status pd_kv_staging_alloc(pd_kv_staging *st, int n, int *slots);
/** Gives n slots from pd_kv_staging_alloc back (a slot not taken, or given
 * back twice, is an invariant broken: asserted). */
void pd_kv_staging_release(pd_kv_staging *st, const int *slots, int n);

/** Cache → pool, before blocks leave: copies rank 0's blocks[i] into slot
 * slots[i] of st (i < n; every rank's copy is the same), waiting for the
 * copies. st NULL: the cache is host memory and itself the pool; nothing
 * to copy. Errors: PD_ERR_INVALID (a block or slot out of range, st NULL
 * with a device cache, slots NULL with st, a pool of another block size). */
pd_status pd_kv_cache_stage_out(pd_kv_cache *kv, pd_kv_staging *st, const int *blocks, const int *slots, int n,
                                pd_err *err);
/** Pool → cache, after blocks arrived (flushed and accepted): copies slot
 * slots[i] of st into blocks[i] of every rank's copy (i < n); the slots
 * may be reused on return. st NULL: the blocks arrived in rank 0's copy
 * (the host cache itself); they are copied to the other ranks' (tensor
 * parallelism), nothing to do with one rank. Errors: those of
 * pd_kv_cache_stage_out. */
pd_status pd_kv_cache_stage_in(pd_kv_cache *kv, pd_kv_staging *st, const int *slots, const int *blocks, int n,
                               pd_err *err);

/** A sequence's view of the cache. block_table[i] holds tokens
 * [i*block_size, (i+1)*block_size). The caller owns the arrays. */
typedef struct {
    int *block_table;
    int num_blocks; /* allocated entries of block_table */
    int cap_blocks;
    int num_tokens; /* tokens whose KV is in the cache */
} pd_seq_kv;

/** Makes room for n more tokens, allocating blocks as needed.
 * Errors: PD_ERR_LIMIT (no free block; nothing allocated is kept). */
pd_status pd_seq_kv_reserve(pd_kv_cache *kv, pd_seq_kv *s, int n);
/** Releases every block of s back to kv and resets it. */
void pd_seq_kv_release(pd_kv_cache *kv, pd_seq_kv *s);

/** One sequence's slice of a batched forward step: n_tokens new tokens at
 * positions s->num_tokens ... s->num_tokens + n_tokens - 1. */
typedef struct {
    pd_seq_kv *kv;
    const int32_t *tokens;
    int n_tokens;
    bool all_logits; /* logits for every new token, else only the last */
} pd_batch_seq;

/** Runs one forward step over a batch of sequences (any mix of prefill
 * chunks and single decode tokens). Writes the new tokens' latent KV into
 * the cache (space must have been reserved with pd_seq_kv_reserve), then
 * advances each kv->num_tokens by n_tokens. logits (HOST memory) receives,
 * in batch order, vocab_size fp32 values per requested row (all_logits:
 * n_tokens rows, else 1 row); it must hold that many rows. Token ids and
 * block tables are host memory too. Decode tokens (n_tokens == 1 with
 * history) use the absorbed MLA form; prefill chunks the expanded form.
 * Errors: PD_ERR_INVALID (token id out of range, position past
 * max_position_embeddings, KV not reserved). */
pd_status pd_model_forward(pd_model *m, pd_kv_cache *kv, pd_batch_seq *seqs, int n_seqs,
                           float *logits, pd_err *err);

/** Where pd_model_forward_ex leaves a step's output rows (n_out rows in
 * batch order, as pd_model_forward counts them). */
typedef struct {
    /** HOST [n_out × vocab_size]: the rows download_row asks for (the
     * others are left as they were). */
    float *logits;
    /** [n_out], nonzero: download that row; NULL: every row. */
    const uint8_t *download_row;
    /** Rows sampled where the logits are (kernels/ sample_rows: rows[i].row
     * is an output row); sampled[i] receives row i's token and logprobs. */
    int n_sample;
    const pd_sample_row *sample;
    const pd_sample_tok *toks;
    int n_toks;
    pd_sample_out *sampled;
} pd_fwd_out;

/** pd_model_forward with the output rows' destinations chosen: some rows
 * downloaded, some sampled on the device (only the tokens and logprobs
 * cross to the host), the rest left on the device. Use it with n_sample > 0
 * only where pd_model_samples_on_device says so. Errors: pd_model_forward's;
 * PD_ERR_INVALID (a sample row outside n_out); PD_ERR_IO (the device's
 * sampling failed: the backend logged why; the step's KV is written and
 * each num_tokens advanced, as after a successful step). */
pd_status pd_model_forward_ex(pd_model *m, pd_kv_cache *kv, pd_batch_seq *seqs, int n_seqs, const pd_fwd_out *out,
                              pd_err *err);

/** Whether this model samples where its logits are: its backend has
 * sample_rows and its memory is not host memory (so the logits would
 * otherwise cross to the host). PD_SAMPLE_ON_DEVICE=0 says no (A/B runs);
 * =1 says yes wherever the backend has sample_rows, the CPU backend's
 * reference too (tests). The CPU backend otherwise samples through
 * pd_sampler. Read once, when the model is loaded. */
bool pd_model_samples_on_device(const pd_model *m);

/* ------------------------------------------------------------------ */
/* sampler                                                             */
/* ------------------------------------------------------------------ */

/** Sampling parameters of one request (OpenAI / vLLM meanings). */
typedef struct {
    float temperature;        /* 0 = greedy */
    int top_k;                /* <= 0 or -1: off */
    float top_p;              /* 1: off */
    float min_p;              /* 0: off */
    float presence_penalty;   /* OpenAI: subtract once if token appeared in output */
    float frequency_penalty;  /* OpenAI: subtract count × penalty */
    float repetition_penalty; /* vLLM/CTRL: 1 off; divides positive / multiplies negative
                                 logits of tokens in prompt or output */
    uint64_t seed;
    bool has_seed;
    /* logit_bias (OpenAI / vLLM): logit_bias[i] is added to the logit of token
     * logit_bias_ids[i] before penalties, temperature and the filters (vLLM v1
     * sampler order: logits processors, then penalties). Ids in the
     * vocabulary, distinct; biases finite in [-PD_MAX_LOGIT_BIAS_VALUE,
     * PD_MAX_LOGIT_BIAS_VALUE]; at most PD_MAX_LOGIT_BIAS entries. Borrowed:
     * pd_sampler_init copies them. NULL / 0: off. */
    const int32_t *logit_bias_ids;
    const float *logit_bias;
    int n_logit_bias;
    /* Ids at or past this have no text in the tokenizer (DeepSeek-V3: 128815
     * of the embedding's 129280 rows; the rest pad the table): never drawn,
     * so every generated token spells something. Applied after logit_bias
     * and the penalties, before greedy / the filters; logprobs stay those of
     * the logits as given (top_logprobs may list such an id). 0: every id
     * (the gateway sets it from its tokenizer, pd_tok_vocab_size). */
    int text_vocab_size;
} pd_sampling_params;

/** Most logit_bias entries one request may carry (the gateway refuses more:
 * each costs a little on every sampled token). */
#define PD_MAX_LOGIT_BIAS 1024
/** The largest |bias| of a logit_bias entry (OpenAI's range, [-100, 100]). */
#define PD_MAX_LOGIT_BIAS_VALUE 100.0f

/** Default parameters: greedy off (temperature 1), every filter off. */
pd_sampling_params pd_sampling_defaults(void);

/** Per-request sampler state: its own generator (so the same seed gives the
 * same tokens whatever the batch) and token counts for penalties. */
typedef struct pd_sampler pd_sampler;
/** vocab_size: logits length. prompt/n_prompt: tokens for repetition
 * penalty (borrowed, copied); p's logit_bias arrays are copied too.
 * Errors: PD_ERR_INVALID (a parameter out of range; a logit_bias id outside
 * [0, vocab_size) or repeated, a bias out of range or not finite, more than
 * PD_MAX_LOGIT_BIAS entries, n_logit_bias < 0). */
pd_status pd_sampler_init(const pd_sampling_params *p, int vocab_size, const int32_t *prompt,
                          int n_prompt, pd_sampler **s_p, pd_err *err);
void pd_sampler_free(pd_sampler **s_p);
/** Samples one token from logits (modified in place: logit_bias, penalties,
 * temperature, filters). Records the token for later penalties. If logprob_p
 * is non-NULL it receives log softmax of the raw logits at the chosen token:
 * as passed in, so before logit_bias, penalties and temperature (vLLM's
 * default logprobs_mode raw_logprobs); masks the caller applied first
 * (min_tokens, response_format) are in them. Returns the token id. */
int32_t pd_sampler_sample(pd_sampler *s, float *logits, float *logprob_p);
/** Most alternatives pd_sampler_sample_top reports per token (OpenAI's
 * top_logprobs limit, vLLM's default --max-logprobs). */
#define PD_MAX_TOP_LOGPROBS 20
/** As pd_sampler_sample, and also the k most likely tokens (OpenAI
 * top_logprobs) under the same log softmax of the raw logits (before
 * logit_bias and penalties, as the sampled token's): top_ids_p and
 * top_logprobs_p (room for k each) receive them sorted by logprob
 * descending, ties to the lower id, and *n_top_p (may be NULL) how many:
 * k clamped to [0, min(PD_MAX_TOP_LOGPROBS, vocab_size)], 0 when either
 * array is NULL. One normaliser serves both, so when the sampled token is
 * among them its *logprob_p equals its top entry exactly. Cost: one pass
 * over the vocabulary for the log-sum-exp and one for a bounded selection
 * (no sort of the vocabulary). */
int32_t pd_sampler_sample_top(pd_sampler *s, float *logits, float *logprob_p, int k,
                              int32_t *top_ids_p, float *top_logprobs_p, int *n_top_p);
/** The logprob of token under the log softmax of one row of raw logits
 * (logits[0, vocab_size), not modified) and the k most likely tokens under
 * it: the same definition, normaliser and selection as
 * pd_sampler_sample_top (best first, ties to the lower id), so the two agree
 * to the bit. k is clamped to [0, min(PD_MAX_TOP_LOGPROBS, vocab_size)];
 * top_ids_p / top_logprobs_p need room for k (may be NULL when k is 0).
 * Returns the clamped k. Thread-safe (no state). Used for prompt logprobs. */
int pd_logprobs_row(const float *logits, int vocab_size, int32_t token, float *logprob_p, int k,
                    int32_t *top_ids_p, float *top_logprobs_p);
/** Records an externally chosen token (e.g. the first token sampled by a
 * prefill replica) so penalties stay consistent. */
void pd_sampler_accept(pd_sampler *s, int32_t token);
/** The draw a sampler seeded as this one took for a token another replica
 * sampled (a prefill replica's first token, drawn with the request's seed):
 * skipped here too, so that the next token takes the generator's next draw,
 * as on a replica that sampled both (the same seed gives the same text on
 * either route). None when greedy (temperature < 1e-5: no draw is taken). */
void pd_sampler_skip_draw(pd_sampler *s);
/** This sampler's next draw as a row of the sample_rows op (kernels/), for
 * sampling where the logits are (pd_model_forward_ex): fills row's
 * parameters (all but row->row) and its uniform draw u, taken from the
 * request's generator only when the row is not greedy, as
 * pd_sampler_sample_top would take it; appends to *toks_p (grown with
 * realloc; *n_toks_p entries in room for *cap_toks_p; the caller owns and
 * frees it) one entry for each token the row lists, each once: logit_bias,
 * the tokens the penalties touch (prompt and output), and masked[0,
 * n_masked) (ids the caller forbids, e.g. min_tokens' EOS and stop ids;
 * ids outside the vocabulary are skipped). top_logprobs is clamped to [0,
 * PD_MAX_TOP_LOGPROBS]. After the draw, give the token to
 * pd_sampler_accept. */
void pd_sampler_device_row(pd_sampler *s, const int32_t *masked, int n_masked, bool want_logprob,
                           int top_logprobs, pd_sample_row *row, pd_sample_tok **toks_p, int *n_toks_p,
                           int *cap_toks_p);

/* ------------------------------------------------------------------ */
/* checkpoint verification (pdserve verify, --verify-checkpoint)       */
/* ------------------------------------------------------------------ */

/** What pd_verify_checkpoint reads and compares. */
typedef struct {
    const char *manifest;       /* JSON {"<file>": {"size": N, "sha256": "<hex>"}} to compare
                                   with; NULL: none */
    const char *write_manifest; /* written (atomically) when every check holds; NULL: none */
    bool hash;                  /* SHA-256 every file; implied by manifest / write_manifest */
    int jobs;                   /* files hashed at once (<= 0: 4) */
    bool progress;              /* a progress line on stderr while hashing */
    int max_reported;           /* messages passed on; later ones only counted (<= 0: 50) */
    /* Each problem (fatal) or note (not fatal: a tensor the config does not
     * use, a file the manifest does not list) as one message naming the file
     * and, where there is one, the tensor. NULL: "verify: ..." on stderr. */
    void (*on_message)(void *user, bool problem, const char *msg);
    void *user;
} pd_verify_options;

/** What was checked; filled whatever the outcome. */
typedef struct {
    int n_files;            /* regular files in the directory */
    int n_shards;           /* safetensors files the checkpoint consists of */
    size_t n_tensors;       /* tensors in those files */
    size_t n_config_tensors; /* tensors the config implies (FP8 scales not counted) */
    int n_problems, n_notes;
    uint64_t bytes_hashed;
    double hash_seconds;
    double mb_per_s;        /* read bandwidth while hashing, 1 MB = 1e6 bytes */
    bool manifest_written;
} pd_verify_report;

/** Checks checkpoint dir without loading it:
 *  - config.json parses (pd_config_load);
 *  - the index (model.safetensors.index.json, when present) is valid JSON,
 *    names plain files that all exist, maps each tensor to a shard holding
 *    it, and its metadata.total_size is the sum of the mapped tensors' bytes;
 *  - every shard's header is valid (pd_st_open_file) and its size is exactly
 *    8 + header + data (truncated or trailing bytes named as such);
 *  - every tensor the config implies exists with the implied shape and a
 *    weight dtype; an F8_E4M3 tensor has its [ceil(rows/block), ceil(cols/
 *    block)] F32/BF16/F16 weight_scale_inv;
 *  - with hashing: SHA-256 of every regular file at the top level of dir
 *    (`jobs` files at once), compared with the manifest: a listed file that is
 *    missing or differs in size or digest is a problem, an unlisted
 *    *.safetensors, config.json or index a problem, any other unlisted file a
 *    note. The manifest files themselves are never hashed.
 * Returns PD_OK when every check holds; otherwise the status of the first
 * problem, whose message is also in err (PD_ERR_IO missing/unreadable file,
 * PD_ERR_FORMAT header/index/manifest contents or a digest, PD_ERR_NOTFOUND
 * missing tensor or file, PD_ERR_SHAPE shape against the config,
 * PD_ERR_UNSUPPORTED dtype). rep (optional) is filled in either case. */
pd_status pd_verify_checkpoint(const char *dir, const pd_verify_options *opt, pd_verify_report *rep,
                               pd_err *err);

/** A replica's --verify-checkpoint: the structural checks, and SHA-256
 * against manifest when it is non-NULL; each problem logged under module,
 * then one summary line. Errors: as pd_verify_checkpoint. */
pd_status pd_verify_at_start(const char *dir, const char *manifest, const char *module, pd_err *err);

#endif

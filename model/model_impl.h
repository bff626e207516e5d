/* Private to model/: the list of tensors a config implies, shared by the
 * checkpoint writer (mkmodel) and the loader, and the model struct. */
#ifndef PD_MODEL_IMPL_H
#define PD_MODEL_IMPL_H

#include "pd_model.h"

typedef enum {
    PD_TK_EMBED,  /* embedding / lm_head: [vocab, hidden] */
    PD_TK_LINEAR, /* nn.Linear weight; FP8-quantised in FP8 checkpoints */
    PD_TK_ROUTER, /* MoE gate weight (kept in the torch dtype, like V3) */
    PD_TK_NORM,   /* RMSNorm weight, initialised to 1 */
    PD_TK_BIAS,   /* e_score_correction_bias, F32 */
} pd_tensor_kind;

typedef struct {
    char name[128];
    pd_tensor_kind kind;
    int64_t rows, cols; /* cols 0 for 1-D tensors */
} pd_tensor_spec;

/** Fills specs (heap, caller frees) with every tensor of cfg in the
 * Hugging Face layout and names, in a stable order. */
void pd_model_tensor_specs(const pd_model_config *cfg, pd_tensor_spec **specs_p, size_t *n_p);

/* Shapes below are one rank's (tensor parallelism, Megatron-LM style, as
 * DeepSeek-V2/V3 are served): nh = num_attention_heads / n_ranks heads, I
 * = the intermediate size / n_ranks. With one rank they are the model's. */
typedef struct {
    pd_weight gate_up; /* [2I, H]: gate rows then up rows */
    pd_weight down;    /* [H, I] */
    int inter;         /* I, this rank's */
} pd_mlp_weights;

typedef struct {
    float *input_norm, *post_norm; /* [H] backend memory */
    pd_weight q_a, q_b, q;         /* q_a/q_b when q_lora_rank > 0, else q */
    float *q_a_norm;               /* [q_lora_rank] */
    pd_weight kv_a;                /* [kvr + dr, H] */
    float *kv_a_norm;              /* [kvr] */
    pd_weight kv_b;                /* [nh*(dn+dv), kvr] */
    pd_weight o;                   /* [H, nh*dv] */
    bool is_moe;
    pd_mlp_weights mlp;    /* dense layers */
    pd_weight router;      /* [E, H] */
    float *router_bias;    /* [E] or NULL */
    pd_weight *experts_gate_up; /* [E], or [E / n_ranks] with expert parallelism */
    pd_weight *experts_down;    /* the same */
    pd_mlp_weights shared; /* shared experts (inter = moe_inter * n_shared / n_ranks) */
} pd_layer_weights;

/* Decode steps of up to this many sequences are recorded as graphs. */
#define PD_FWD_MAX_GRAPH_SEQS 128

/* The forward pass's buffers, planned once and grown only when a step needs
 * more (growing drops every recorded graph: they name the old buffers).
 * Backend memory except hargs. The int32 argument block `args` holds, at
 * fixed offsets, ids [cap_t] | pos [cap_t] | slots [cap_t] | lens [cap_seqs]
 * | block_off [cap_seqs] | blocks [cap_blocks]; hargs is its host staging
 * copy (page-locked where the backend stages), uploaded once per step. */
typedef struct {
    int cap_t, cap_out, cap_seqs, cap_blocks;
    float *x, *h, *qa, *q, *ckv, *attn, *gu, *act, *mo, *rlog, *hl, *logits;
    float *zeros; /* [cap_t, H] zeros, only for ranks > 1 without shared experts */
    int32_t *eids;
    float *ew;
    int32_t *args, *hargs;
    uint64_t gen; /* bumped whenever a buffer moves */
    struct {
        void *graph;
        const void *cache; /* the KV cache it was recorded over */
        uint64_t kv_id;    /* and that cache's pd_kv_cache.id (its geometry: a new cache can reuse the address) */
        uint64_t gen;
    } graphs[PD_FWD_MAX_GRAPH_SEQS + 1]; /* by number of sequences */
    bool no_graphs; /* recording a step failed once: never again */
} pd_fwd_ws;

/* One rank's shard of the model and its forward buffers. Tensor
 * parallelism (Megatron-LM; DeepSeek-V2/V3 served this way): attention
 * heads are divided over the ranks (q_b_proj / q_proj and kv_b_proj rows,
 * o_proj columns, by head); the MLA latent path (q_a_proj, kv_a_proj_with_mqa
 * and their norms) is replicated, so every rank writes the same latent KV
 * cache; dense MLPs, shared experts and every routed expert are divided
 * along their intermediate dimension (gate/up rows, down columns); router,
 * norms, embedding and lm_head are replicated. o_proj and the MLP/MoE give
 * partial sums that all_reduce_sum adds up on every rank. */
typedef struct {
    pd_backend *be;
    int rank, n_ranks;
    int n_heads; /* this rank's heads */
    /* Routed experts held: [expert_first, expert_first + n_experts) of the
     * model's E. Tensor parallelism: all E, each its intermediate share.
     * Expert parallelism (--enable-expert-parallel): E / n_ranks whole
     * experts, rank r's being [r·E/n, (r+1)·E/n); local index i is expert
     * expert_first + i. */
    int expert_first, n_experts;
    bool expert_parallel;
    pd_weight embed, lm_head;
    float *final_norm;
    pd_layer_weights *layers;
    float *inv_freq_b; /* the model's inv_freq in this rank's memory */
    pd_fwd_ws ws;
} pd_model_rank;

void pd_fwd_ws_free(pd_model_rank *rk);

/* The rank threads of a model of several ranks (tp.c): rank r's work runs
 * on thread r, bound to rank r's backend (thread_bind). */
typedef struct pd_tp_team pd_tp_team;
pd_status pd_tp_team_init(pd_backend *const *bes, int n_ranks, pd_tp_team **t_p, pd_err *err);
void pd_tp_team_free(pd_tp_team **t_p);
/* Runs fn(arg, r) for every rank r, each on its rank's thread (team NULL:
 * rank 0 on the caller's thread), and returns when all have returned. */
void pd_tp_run(pd_tp_team *t, int n_ranks, void (*fn)(void *arg, int rank), void *arg);

struct pd_model {
    pd_model_config cfg;
    pd_backend *be; /* rank 0's */
    int n_ranks;
    pd_model_rank *ranks; /* [n_ranks] */
    pd_tp_team *team;     /* NULL with one rank */
    bool expert_parallel; /* routed experts divided whole over the ranks */
    float *inv_freq;  /* [dr/2] host: YaRN-adjusted rope frequencies */
    float rope_mscale; /* YaRN attention factor applied to cos/sin */
    float softmax_scale;
    /* read once at load (forward.c pd_model_read_switches): the fused step
     * ops (PD_FUSED_OPS, default on), among them rmsnorm_gemm_pair
     * (PD_NORM_PAIR=0 alone off: A/B runs), and sampling where the logits
     * are (PD_SAMPLE_ON_DEVICE: 0 never, 1 wherever the backend has
     * sample_rows, else where its memory is not host memory), and a
     * step's arguments uploaded without a wait where the backend has
     * upload_async (PD_ARGS_ASYNC=0: the waiting upload, A/B runs) */
    bool fused_ops, norm_pair, sample_on_device, args_async;
};

/** Sets m->fused_ops, m->norm_pair and m->sample_on_device from rank 0's backend and the
 * environment (forward.c). */
void pd_model_read_switches(pd_model *m);

/* The latent KV cache: the same on every rank (each computes the latents
 * from the same hidden states), so one block table serves all copies and
 * only rank 0's is exported. */
struct pd_kv_cache {
    const pd_model *m;
    pd_backend *be; /* rank 0's */
    int block_size, num_blocks, n_layers, dim;
    uint64_t id; /* unique in the process: recorded decode graphs bake block_size into their launches, so a
                  * graph is replayed only over the cache it was recorded over (forward.c graph_replay) */
    float *data; /* rank 0's copy, backend memory: [num_blocks][n_layers][block_size][dim] */
    float *rank_data[PD_TP_MAX_RANKS]; /* every rank's copy; rank_data[0] == data */
    int *free_list;
    int n_free;
};

#endif

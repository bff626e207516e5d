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

typedef struct {
    pd_weight gate_up; /* [2I, H]: gate rows then up rows */
    pd_weight down;    /* [H, I] */
    int inter;
} pd_mlp_weights;

typedef struct {
    float *input_norm, *post_norm; /* [H] backend memory */
    pd_weight q_a, q_b, q;         /* q_a/q_b when q_lora_rank > 0, else q */
    float *q_a_norm;               /* [q_lora_rank] */
    pd_weight kv_a;                /* [kvr + dr, H] */
    float *kv_a_norm;              /* [kvr] */
    pd_weight kv_b;                /* [nH*(dn+dv), kvr] */
    pd_weight o;                   /* [H, nH*dv] */
    bool is_moe;
    pd_mlp_weights mlp;    /* dense layers */
    pd_weight router;      /* [E, H] */
    float *router_bias;    /* [E] or NULL */
    pd_weight *experts_gate_up; /* [E] */
    pd_weight *experts_down;    /* [E] */
    pd_mlp_weights shared; /* shared experts (inter = moe_inter * n_shared) */
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
    int32_t *eids;
    float *ew;
    int32_t *args, *hargs;
    uint64_t gen; /* bumped whenever a buffer moves */
    struct {
        void *graph;
        const void *cache; /* the KV cache it was recorded over */
        uint64_t gen;
    } graphs[PD_FWD_MAX_GRAPH_SEQS + 1]; /* by number of sequences */
    bool no_graphs; /* recording a step failed once: never again */
} pd_fwd_ws;

void pd_fwd_ws_free(pd_model *m);

struct pd_model {
    pd_model_config cfg;
    pd_backend *be;
    pd_weight embed, lm_head;
    float *final_norm;
    pd_layer_weights *layers;
    float *inv_freq;  /* [dr/2] host: YaRN-adjusted rope frequencies */
    float *inv_freq_b; /* the same in backend memory */
    pd_fwd_ws ws;
    float rope_mscale; /* YaRN attention factor applied to cos/sin */
    float softmax_scale;
};

struct pd_kv_cache {
    pd_backend *be;
    int block_size, num_blocks, n_layers, dim;
    float *data; /* backend memory: [num_blocks][n_layers][block_size][dim] */
    void *host_pool; /* host mirror for transfers, when data is not host memory */
    int *free_list;
    int n_free;
};

#endif

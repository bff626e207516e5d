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

struct pd_model {
    pd_model_config cfg;
    pd_backend *be;
    pd_weight embed, lm_head;
    float *final_norm;
    pd_layer_weights *layers;
    float *inv_freq;  /* [dr/2] host: YaRN-adjusted rope frequencies */
    float rope_mscale; /* YaRN attention factor applied to cos/sin */
    float softmax_scale;
};

struct pd_kv_cache {
    pd_backend *be;
    int block_size, num_blocks, n_layers, dim;
    float *data; /* backend memory: [num_blocks][n_layers][block_size][dim] */
    int *free_list;
    int n_free;
};

#endif

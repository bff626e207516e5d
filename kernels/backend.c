/* Backend selection: the one place that knows which backends exist. */
#include "pd_kernels.h"

#include <string.h>

#ifndef PD_HAVE_CUDA
pd_status pd_backend_cuda_init(int device, pd_backend **be_p, pd_err *err) {
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "this pdserve was built without the CUDA backend");
}

pd_status pd_backend_cuda_init_tp(int n_ranks, pd_backend **bes_p, pd_err *err) {
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "this pdserve was built without the CUDA backend");
}

pd_status pd_backend_cuda_device_info(int device, bool with_mem, pd_cuda_device_info *info_p, pd_err *err) {
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "this pdserve was built without the CUDA backend");
}
#endif

pd_status pd_backend_init(const char *name, int n_threads, pd_backend **be_p, pd_err *err) {
    if (!name || !strcmp(name, "cpu"))
        return pd_backend_cpu_init(n_threads, be_p);
    if (!strcmp(name, "cuda"))
        return pd_backend_cuda_init(0, be_p, err);
    return pd_err_set(err, PD_ERR_INVALID, "unknown backend '%s' (cpu, cuda)", name);
}

pd_status pd_backend_init_tp(const char *name, int n_ranks, int n_threads, pd_backend **bes_p, pd_err *err) {
    if (n_ranks < 1 || n_ranks > PD_TP_MAX_RANKS)
        return pd_err_set(err, PD_ERR_INVALID, "tensor parallel size %d: expected 1 to %d", n_ranks,
                          PD_TP_MAX_RANKS);
    if (!name || !strcmp(name, "cpu"))
        return pd_backend_cpu_init_tp(n_ranks, n_threads, bes_p, err);
    if (!strcmp(name, "cuda"))
        return pd_backend_cuda_init_tp(n_ranks, bes_p, err);
    return pd_err_set(err, PD_ERR_INVALID, "unknown backend '%s' (cpu, cuda)", name);
}

void pd_backend_free(pd_backend **be_p) {
    if (be_p && *be_p) {
        (*be_p)->ops->destroy(*be_p);
        *be_p = NULL;
    }
}

pd_status pd_moe_route_check(const char *op, int rows, const float *logits, const pd_moe_route_params *p,
                             const int32_t *ids, const float *weights, const pd_moe_route_limits *lim, pd_err *err) {
    if (rows == 0)
        return PD_OK;
    if (rows < 0)
        return pd_err_set(err, PD_ERR_INVALID, "%s: rows %d", op, rows);
    if (!p || !logits || !ids || !weights)
        return pd_err_set(err, PD_ERR_INVALID, "%s: no %s", op,
                          !p ? "parameters" : !logits ? "logits" : !ids ? "ids" : "weights");
    const int E = p->n_experts, K = p->top_k, G = p->n_group > 0 ? p->n_group : 1;
    const bool grouped = p->topk_method != 0 && G > 1;
    if (E <= 0 || K <= 0 || K > E)
        return pd_err_set(err, PD_ERR_INVALID, "%s: %d experts, top_k %d", op, E, K);
    if (p->scoring < 0 || p->scoring > 1 || p->topk_method < 0 || p->topk_method > 2)
        return pd_err_set(err, PD_ERR_INVALID, "%s: scoring %d, topk_method %d", op, p->scoring, p->topk_method);
    if (grouped && (E % G || p->topk_group <= 0 || p->topk_group > G))
        return pd_err_set(err, PD_ERR_INVALID, "%s: %d experts in %d groups, keeping %d", op, E, G, p->topk_group);
    if (lim && (E > lim->max_experts || K > lim->max_top_k || (grouped && G > lim->max_groups)))
        return pd_err_set(err, PD_ERR_INVALID,
                          "%s: %d experts, top_k %d, %d groups: this backend routes at most %d experts, top_k %d, "
                          "%d groups",
                          op, E, K, G, lim->max_experts, lim->max_top_k, lim->max_groups);
    return PD_OK;
}

/* The checks of the CUDA moe_block (kernels/cuda/moe.cu, cu_moe_block and
 * moe_block_shapes_ok) without its kernels' size limits: every pointer the
 * block reads or writes, routing arguments pd_moe_route_check takes, and
 * weights whose shapes agree with hidden, inter and n_experts. The caller
 * has returned for rows 0. */
static pd_status moe_block_args_check(const pd_moe_block_args *a, pd_err *err) {
    const int E = a->route.n_experts, H = a->hidden, I = a->inter;
    if (a->rows < 0 || H <= 0 || I <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "moe_block: rows %d, hidden %d, inter %d", a->rows, H, I);
    const struct {
        const void *p;
        const char *name;
    } need[] = {{a->x, "x"}, {a->norm, "norm"}, {a->router, "router"}, {a->gate_up, "gate_up"}, {a->down, "down"},
                {a->h, "h"}, {a->gu, "gu"},     {a->act, "act"},       {a->mo, "mo"}};
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
        if (!need[i].p)
            return pd_err_set(err, PD_ERR_INVALID, "moe_block: no %s", need[i].name);
    if (a->shared_gate_up && !a->shared_down)
        return pd_err_set(err, PD_ERR_INVALID, "moe_block: shared experts' gate_up without their down");
    if (a->o_proj && (!a->o_in || !a->o_proj->data || a->o_proj->rows != H || a->o_proj->cols <= 0))
        return pd_err_set(err, PD_ERR_INVALID, "moe_block: o_proj [%d, %d]%s%s; want [%d, P], P > 0", a->o_proj->rows,
                          a->o_proj->cols, a->o_proj->data ? "" : " without data", a->o_in ? "" : " with no o_in", H);
    pd_status st = pd_moe_route_check("moe_block", a->rows, a->logits, &a->route, a->ids, a->weights, NULL, err);
    if (st != PD_OK)
        return st;
    const pd_weight *r = a->router;
    if (!r->data || r->rows != E || r->cols != H)
        return pd_err_set(err, PD_ERR_INVALID, "moe_block: router [%d, %d]%s; want [%d, %d]", r->rows, r->cols,
                          r->data ? "" : " without data", E, H);
    if (a->shared_gate_up) {
        const pd_weight *sg = a->shared_gate_up, *sd = a->shared_down;
        const int Ish = sg->rows / 2;
        if (!sg->data || !sd->data || sg->rows <= 0 || sg->rows % 2 || sg->cols != H || sd->rows != H ||
            sd->cols != Ish)
            return pd_err_set(err, PD_ERR_INVALID,
                              "moe_block: shared experts' gate_up [%d, %d], down [%d, %d]%s; want [2 Ish, %d], "
                              "[%d, Ish], Ish > 0",
                              sg->rows, sg->cols, sd->rows, sd->cols, sg->data && sd->data ? "" : " without data", H,
                              H);
    }
    for (int e = 0; e < E; e++) {
        const pd_weight *g = &a->gate_up[e], *d = &a->down[e];
        if (!g->data || !d->data || g->rows != 2 * I || g->cols != H || d->rows != H || d->cols != I)
            return pd_err_set(err, PD_ERR_INVALID,
                              "moe_block: expert %d has gate_up [%d, %d], down [%d, %d]%s; want [%d, %d], [%d, %d]", e,
                              g->rows, g->cols, d->rows, d->cols, g->data && d->data ? "" : " without data", 2 * I, H,
                              H, I);
    }
    return PD_OK;
}

pd_status pd_moe_block_composed(pd_backend *be, const pd_moe_block_args *a, pd_err *err) {
    if (!be || !a)
        return pd_err_set(err, PD_ERR_INVALID, "moe_block: no %s", be ? "arguments" : "backend");
    if (a->rows == 0)
        return PD_OK;
    pd_status st = moe_block_args_check(a, err);
    if (st != PD_OK)
        return st;
    const pd_backend_i *o = be->ops;
    const int T = a->rows, H = a->hidden, E = a->route.n_experts, K = a->route.top_k;
    if (a->o_proj)
        o->gemm(be, T, a->o_in, a->o_proj, a->x, true);
    o->rmsnorm(be, T, H, a->x, H, a->norm, a->eps, a->h, H);
    o->gemm(be, T, a->h, a->router, a->logits, false);
    o->moe_route_ids(be, T, a->logits, &a->route, a->ids, a->weights);
    float *out = a->x; /* no shared experts: the routed ones add into x */
    if (a->shared_gate_up) {
        if (o->gemm_swiglu) {
            o->gemm_swiglu(be, T, a->h, a->shared_gate_up, a->gu, a->act);
        } else {
            o->gemm(be, T, a->h, a->shared_gate_up, a->gu, false);
            o->silu_mul(be, T, a->shared_gate_up->rows / 2, a->gu, a->act);
        }
        o->gemm(be, T, a->act, a->shared_down, a->mo, false);
        out = a->mo;
    }
    o->moe_experts_ids(be, T, H, a->inter, a->h, a->ids, a->weights, K, E, a->gate_up, a->down, out);
    if (out != a->x)
        o->add(be, (size_t)T * H, a->x, out);
    return PD_OK;
}

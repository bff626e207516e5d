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

void pd_moe_block_composed(pd_backend *be, const pd_moe_block_args *a) {
    const pd_backend_i *o = be->ops;
    const int T = a->rows, H = a->hidden, E = a->route.n_experts, K = a->route.top_k;
    if (T <= 0)
        return;
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
}

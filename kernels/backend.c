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

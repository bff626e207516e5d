/* Tensor parallelism on the GPUs of one host: one backend per device, one
 * NCCL communicator per rank from ncclCommInitAll (one process, one thread
 * per rank), all-reduce queued on the rank's own stream so that a decode
 * step's graph records it.
 *
 * NCCL is loaded at run time (libnccl.so.2, or the file $PD_NCCL_LIB
 * names), so the build needs no NCCL headers and a host without NCCL still
 * runs a group of one. The few declarations below are NCCL's C ABI as
 * nccl.h (2.x) states it: ncclComm_t an opaque pointer, ncclResult_t,
 * ncclDataType_t and ncclRedOp_t enums (ncclSuccess 0, ncclFloat32 7,
 * ncclSum 0). */
#include "cuda_common.cuh"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct ncclComm *ncclComm_t;
typedef int ncclResult_t;
enum { NCCL_SUCCESS = 0, NCCL_FLOAT32 = 7, NCCL_SUM = 0 };

static struct {
    bool ok;
    char why[512];
    int version;
    ncclResult_t (*comm_init_all)(ncclComm_t *comms, int ndev, const int *devlist);
    ncclResult_t (*all_reduce)(const void *send, void *recv, size_t count, int dtype, int op,
                               ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*comm_destroy)(ncclComm_t comm);
    const char *(*error_string)(ncclResult_t r);
    ncclResult_t (*get_version)(int *version);
} nccl;

static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;

static void nccl_load(void) {
    const char *path = getenv("PD_NCCL_LIB");
    if (!path || !*path)
        path = "libnccl.so.2";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(nccl.why, sizeof nccl.why, "cannot load NCCL (%s; set PD_NCCL_LIB to its path)",
                 dlerror());
        return;
    }
    *(void **)&nccl.comm_init_all = dlsym(lib, "ncclCommInitAll");
    *(void **)&nccl.all_reduce = dlsym(lib, "ncclAllReduce");
    *(void **)&nccl.comm_destroy = dlsym(lib, "ncclCommDestroy");
    *(void **)&nccl.error_string = dlsym(lib, "ncclGetErrorString");
    *(void **)&nccl.get_version = dlsym(lib, "ncclGetVersion");
    if (!nccl.comm_init_all || !nccl.all_reduce || !nccl.comm_destroy || !nccl.error_string ||
        !nccl.get_version) {
        snprintf(nccl.why, sizeof nccl.why, "%s lacks an NCCL 2 function", path);
        return; /* the library stays loaded: harmless */
    }
    if (nccl.get_version(&nccl.version) != NCCL_SUCCESS || nccl.version < 20000) {
        snprintf(nccl.why, sizeof nccl.why, "%s: NCCL version %d, need 2.x", path, nccl.version);
        return;
    }
    nccl.ok = true;
}

int pd_cuda_nccl_version(char *buf, size_t n) {
    pthread_once(&nccl_once, nccl_load);
    if (!nccl.ok) {
        snprintf(buf, n, "not loaded: %s", nccl.why);
        return 0;
    }
    /* NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9 */
    snprintf(buf, n, "%d.%d.%d", nccl.version / 10000, nccl.version / 100 % 100, nccl.version % 100);
    return nccl.version;
}

void cu_all_reduce_sum(pd_backend *be, float *x, size_t n) {
    cu_ctx *c = cu_of(be);
    if (be->n_ranks <= 1 || n == 0)
        return;
    if (!x)
        return (void)cu_fail(c, PD_ERR_INVALID, "all_reduce_sum: NULL buffer");
    /* Queued even after an earlier error on this rank: the other ranks'
     * all-reduce waits for this one, and a step with an error reads NaN on
     * rank 0 anyway (pd_cuda.h). */
    ncclResult_t r =
        nccl.all_reduce(x, x, n, NCCL_FLOAT32, NCCL_SUM, (ncclComm_t)c->nccl_comm, c->stream);
    if (r != NCCL_SUCCESS)
        cu_fail(c, PD_ERR_IO, "ncclAllReduce(%zu floats, rank %d): %s", n, be->rank,
                nccl.error_string(r));
}

void cu_thread_bind(pd_backend *be) {
    cu_ctx *c = cu_of(be);
    CU_OK(c, cudaSetDevice(c->device));
}

void cu_comm_free(cu_ctx *c) {
    if (!c->nccl_comm)
        return;
    ncclResult_t r = nccl.comm_destroy((ncclComm_t)c->nccl_comm);
    if (r != NCCL_SUCCESS)
        CU_LOGW("ncclCommDestroy (device %d): %s", c->device, nccl.error_string(r));
    c->nccl_comm = NULL;
}

extern "C" pd_status pd_backend_cuda_init_tp(int n_ranks, pd_backend **bes_p, pd_err *err) {
    if (n_ranks < 1 || n_ranks > PD_TP_MAX_RANKS)
        return cu_err_set(err, PD_ERR_INVALID, "tensor parallel size %d: expected 1 to %d", n_ranks,
                          PD_TP_MAX_RANKS);
    if (n_ranks == 1)
        return pd_backend_cuda_init(0, &bes_p[0], err);
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return cu_err_set(err, PD_ERR_UNSUPPORTED, "no CUDA device: %s", cudaGetErrorString(e));
    }
    if (n_dev < n_ranks)
        return cu_err_set(err, PD_ERR_UNSUPPORTED,
                          "tensor parallel size %d needs %d GPUs; %d present", n_ranks, n_ranks,
                          n_dev);
    pthread_once(&nccl_once, nccl_load);
    if (!nccl.ok)
        return cu_err_set(err, PD_ERR_UNSUPPORTED, "tensor parallel size %d: %s", n_ranks,
                          nccl.why);
    int r = 0;
    pd_status st = PD_OK;
    for (; r < n_ranks; r++)
        if ((st = pd_backend_cuda_init(r, &bes_p[r], err)) != PD_OK)
            goto err_free_backends;
    {
        ncclComm_t comms[PD_TP_MAX_RANKS];
        int devs[PD_TP_MAX_RANKS];
        for (int i = 0; i < n_ranks; i++)
            devs[i] = i;
        ncclResult_t nr = nccl.comm_init_all(comms, n_ranks, devs);
        if (nr != NCCL_SUCCESS) {
            st = cu_err_set(err, PD_ERR_IO, "ncclCommInitAll(%d devices): %s", n_ranks,
                            nccl.error_string(nr));
            goto err_free_backends;
        }
        for (int i = 0; i < n_ranks; i++) {
            cu_of(bes_p[i])->nccl_comm = comms[i];
            bes_p[i]->rank = i;
            bes_p[i]->n_ranks = n_ranks;
        }
    }
    cudaSetDevice(0); /* the caller's thread back on rank 0's device */
    CU_LOGI("tensor-parallel group of %d ranks on devices 0-%d, NCCL %d", n_ranks, n_ranks - 1,
            nccl.version);
    return PD_OK;

err_free_backends:
    while (r-- > 0) { /* pd_backend_free is pdcore's (cuda_common.cuh says why not here) */
        bes_p[r]->ops->destroy(bes_p[r]);
        bes_p[r] = NULL;
    }
    cudaSetDevice(0);
    return st;
}

/* The CUDA backend (sm_90a). Placeholder until issue "CUDA backend" lands
 * its kernels: it reports itself unavailable, so nothing runs on it yet. */
#include <cuda_runtime.h>

extern "C" {
#include "pd_kernels.h"

pd_status pd_backend_cuda_init(int device, pd_backend **be_p, pd_err *err) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n <= device)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "no CUDA device %d", device);
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "the CUDA backend's kernels are not implemented yet");
}
}

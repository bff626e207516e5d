/* What a replica reports about a CUDA device before and after its backend is
 * up (pd_kernels.h, pd_backend_cuda_device_info), and the device query the
 * backend's init shares (cu_device_props). */
#include "cuda_common.cuh"

#include <stdio.h>
#include <string.h>

pd_status cu_device_props(int device, cudaDeviceProp *prop_p, pd_err *err) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return cu_err_set(err, PD_ERR_UNSUPPORTED, "no CUDA device: %s", cudaGetErrorString(e));
    }
    if (device < 0 || device >= n)
        return cu_err_set(err, PD_ERR_UNSUPPORTED, "no CUDA device %d (%d present)", device, n);
    if ((e = cudaGetDeviceProperties(prop_p, device)) != cudaSuccess)
        return cu_err_set(err, PD_ERR_IO, "cudaGetDeviceProperties(%d): %s", device, cudaGetErrorString(e));
    return PD_OK;
}

extern "C" pd_status pd_backend_cuda_device_info(int device, bool with_mem, pd_cuda_device_info *info_p,
                                                 pd_err *err) {
    cudaDeviceProp prop;
    pd_status st = cu_device_props(device, &prop, err);
    if (st != PD_OK)
        return st;
    pd_cuda_device_info info;
    memset(&info, 0, sizeof info);
    cudaError_t e;
    memcpy(info.name, prop.name, sizeof info.name - 1); /* prop.name is char[256], NUL-terminated */
    info.name[sizeof info.name - 1] = 0;
    info.cc_major = prop.major;
    info.cc_minor = prop.minor;
    info.n_sm = prop.multiProcessorCount;
    info.mem_total = prop.totalGlobalMem;
    if ((e = cudaDeviceGetPCIBusId(info.pci_bus_id, (int)sizeof info.pci_bus_id, device)) != cudaSuccess)
        return cu_err_set(err, PD_ERR_IO, "cudaDeviceGetPCIBusId(%d): %s", device, cudaGetErrorString(e));
    if (with_mem) {
        int prev = 0;
        size_t free_b = 0, total_b = 0;
        cudaGetDevice(&prev);
        if ((e = cudaSetDevice(device)) == cudaSuccess)
            e = cudaMemGetInfo(&free_b, &total_b);
        cudaSetDevice(prev);
        if (e != cudaSuccess)
            return cu_err_set(err, PD_ERR_IO, "cudaMemGetInfo(device %d): %s", device, cudaGetErrorString(e));
        info.mem_free = free_b;
    }
    *info_p = info;
    return PD_OK;
}

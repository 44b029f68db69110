#include "ferry/fabric/gpu_memory.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "common/cuda_check.h"

namespace ferry {

int gpu_device_count() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

Result<std::string> gpu_pci_bus_id(int device) {
    char id[32] = {0};
    FERRY_CUDA_TRY(cudaDeviceGetPCIBusId(id, sizeof(id) - 1, device));
    return std::string(id);
}

Result<GpuBuffer> GpuBuffer::allocate(size_t bytes, int device) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        return unavailable(fmt::format("no GPU to allocate {} bytes on: {}", bytes,
                                       e == cudaSuccess ? "none visible" : cudaGetErrorString(e)));
    }
    if (device < 0 || device >= n) {
        return invalid_argument(fmt::format("GPU {} does not exist ({} visible)", device, n));
    }
    GpuBuffer b;
    FERRY_CUDA_TRY(cudaSetDevice(device));
    FERRY_CUDA_TRY(cudaMalloc(&b.ptr_, bytes));
    b.len_ = bytes;
    b.device_ = device;
    return b;
}

GpuBuffer& GpuBuffer::operator=(GpuBuffer&& o) noexcept {
    if (this != &o) {
        if (ptr_) {
            cudaSetDevice(device_);
            cudaFree(ptr_);
        }
        ptr_ = o.ptr_;
        len_ = o.len_;
        device_ = o.device_;
        o.ptr_ = nullptr;
        o.len_ = 0;
    }
    return *this;
}

GpuBuffer::~GpuBuffer() {
    if (ptr_) {
        cudaSetDevice(device_);
        cudaFree(ptr_);
    }
}

Status GpuBuffer::copy_from_host(const void* src, size_t n, size_t offset) {
    if (offset > len_ || n > len_ - offset) return out_of_range("copy into GPU buffer overruns it");
    FERRY_CUDA_TRY(cudaSetDevice(device_));
    FERRY_CUDA_TRY(cudaMemcpy(static_cast<char*>(ptr_) + offset, src, n, cudaMemcpyHostToDevice));
    return ok_status();
}

Status GpuBuffer::copy_to_host(void* dst, size_t n, size_t offset) const {
    if (offset > len_ || n > len_ - offset) return out_of_range("copy from GPU buffer overruns it");
    FERRY_CUDA_TRY(cudaSetDevice(device_));
    FERRY_CUDA_TRY(
        cudaMemcpy(dst, static_cast<const char*>(ptr_) + offset, n, cudaMemcpyDeviceToHost));
    return ok_status();
}

Status GpuBuffer::fill(uint8_t value) {
    FERRY_CUDA_TRY(cudaSetDevice(device_));
    FERRY_CUDA_TRY(cudaMemset(ptr_, value, len_));
    FERRY_CUDA_TRY(cudaDeviceSynchronize());
    return ok_status();
}

Result<double> measure_gpu_copy_ceiling(int src_device, int dst_device, size_t bytes, int iters) {
    FERRY_ASSIGN_OR_RETURN(GpuBuffer src, GpuBuffer::allocate(bytes, src_device));
    FERRY_ASSIGN_OR_RETURN(GpuBuffer dst, GpuBuffer::allocate(bytes, dst_device));
    FERRY_CUDA_TRY(cudaSetDevice(src_device));
    if (src_device != dst_device) {
        cudaError_t e = cudaDeviceEnablePeerAccess(dst_device, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
            return FERRY_CUDA_ERROR(e, "cudaDeviceEnablePeerAccess");
        }
        cudaGetLastError();
    }
    cudaStream_t s;
    FERRY_CUDA_TRY(cudaStreamCreate(&s));
    cudaEvent_t a, b;
    FERRY_CUDA_TRY(cudaEventCreate(&a));
    FERRY_CUDA_TRY(cudaEventCreate(&b));
    std::vector<double> gbps;
    for (int i = 0; i < iters + 2; ++i) {
        FERRY_CUDA_TRY(cudaEventRecord(a, s));
        FERRY_CUDA_TRY(
            cudaMemcpyPeerAsync(dst.data(), dst_device, src.data(), src_device, bytes, s));
        FERRY_CUDA_TRY(cudaEventRecord(b, s));
        FERRY_CUDA_TRY(cudaEventSynchronize(b));
        float ms = 0;
        FERRY_CUDA_TRY(cudaEventElapsedTime(&ms, a, b));
        if (i >= 2) gbps.push_back(static_cast<double>(bytes) / (ms * 1e-3) / 1e9);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaStreamDestroy(s);
    std::sort(gbps.begin(), gbps.end());
    return gbps[gbps.size() / 2];
}

}  // namespace ferry

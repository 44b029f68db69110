// Builds without CUDA: the GPU all-to-all exists as an API and says why it cannot run.
#include "ferry/moe/cuda_all_to_all.h"

#ifndef FERRY_HAVE_CUDA
namespace ferry::moe {
namespace {
Status no_cuda() {
    return unavailable(
        "this build of ferry has no CUDA support (nvcc was not found at build "
        "time); the cuda all-to-all needs it");
}
}  // namespace

struct CudaAllToAll::Impl {};
CudaAllToAll::CudaAllToAll(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaAllToAll::~CudaAllToAll() = default;
Result<std::unique_ptr<CudaAllToAll>> CudaAllToAll::create(const AllToAllConfig&,
                                                           const AllGatherFn&,
                                                           const CudaAllToAllOptions&) {
    return no_cuda();
}
const AllToAllConfig& CudaAllToAll::config() const {
    static const AllToAllConfig none;
    return none;
}
int CudaAllToAll::device() const { return -1; }
Status CudaAllToAll::dispatch_send(const CudaDispatchInput&, void*) { return no_cuda(); }
Status CudaAllToAll::dispatch_recv(const CudaExpertBatch&, void*) { return no_cuda(); }
Status CudaAllToAll::combine_send(const uint16_t*, void*) { return no_cuda(); }
Status CudaAllToAll::combine_recv(float*, void*, const float*) { return no_cuda(); }
Status CudaAllToAll::combine_recv_bf16(uint16_t*, void*, const float*) { return no_cuda(); }
Status CudaAllToAll::set_combine_weights(const float*, void*) { return no_cuda(); }
Status CudaAllToAll::synchronize(void*) { return no_cuda(); }
Status CudaAllToAll::device_status() { return no_cuda(); }
Result<std::vector<CudaTraceStamp>> CudaAllToAll::last_trace() { return no_cuda(); }
Status cuda_quantize_fp8(const uint16_t*, uint32_t, uint32_t, uint8_t*, float*, void*) {
    return no_cuda();
}
Status cuda_dequantize_fp8_to_bf16(const uint8_t*, const float*, uint32_t, uint32_t, uint16_t*,
                                   void*, const uint32_t*) {
    return no_cuda();
}
Status cuda_host_gate(const uint32_t*, uint32_t, Duration, void*) { return no_cuda(); }
}  // namespace ferry::moe
#endif

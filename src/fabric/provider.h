// Choosing a libfabric provider and asking it for endpoints with the capabilities ferry needs.
#pragma once

#include <rdma/fabric.h>

#include <memory>
#include <string>

#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"

namespace ferry::detail {

struct FiInfoDeleter {
    void operator()(fi_info* i) const { fi_freeinfo(i); }
};
using FiInfoPtr = std::unique_ptr<fi_info, FiInfoDeleter>;

// "tcp" -> "tcp;ofi_rxm", "verbs" -> "verbs;ofi_rxm"; other names pass through.
std::string full_provider_name(const std::string& p);

// fi_getinfo for an RDM endpoint with RMA, messages and remote CQ data, FI_THREAD_DOMAIN,
// and every mr_mode bit ferry knows how to honour. With `hmem`, FI_HMEM is asked for too
// (and FI_MR_HMEM accepted): a provider without it then answers nothing.
Result<FiInfoPtr> get_infos(const std::string& provider, const EngineConfig& config,
                            bool hmem = false);

// Whether `provider` can register CUDA memory: FI_HMEM offered, and libfabric's CUDA
// interface present (built in, and a GPU found when libfabric started).
struct CudaHmem {
    FiInfoPtr infos;   // the provider's FI_HMEM infos when it can; null when it cannot
    std::string note;  // why not, or how it was found; for errors and logs
};
CudaHmem probe_cuda_hmem(const std::string& provider, const EngineConfig& config);

Result<std::string> resolve_provider_name(const EngineConfig& config);

}  // namespace ferry::detail

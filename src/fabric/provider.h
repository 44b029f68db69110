// Choosing a libfabric provider and asking it for endpoints with the capabilities ferry needs.
#pragma once

#include <rdma/fabric.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

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

// shm region names of ferry's endpoints start with this, followed by the process id.
inline constexpr const char* kShmNamePrefix = "ferry_";

// shm names an endpoint's region "<pid>:<n>:<m>" in /dev/shm by default, a file that a process
// ended by a signal leaves behind and nothing removes. ferry's shm endpoints are named
// "ferry_<pid>_<tag>" (kShmNamePrefix) instead: every new shm engine removes those whose
// process is gone. `set_src_name` gives an fi_info such a name before fi_endpoint.
std::string shm_endpoint_name(std::string_view tag);
void set_src_name(fi_info* info, const std::string& name);
// The process id in a ferry shm region name (kShmNamePrefix, pid, '_'), 0 if it is none.
long shm_name_pid(const std::vector<uint8_t>& addr);

// Whether libfabric's shm was told not to use cross-memory attach (FI_SHM_DISABLE_CMA, read as
// libfabric reads it): ferry's own CMA writes (EngineConfig::cma_writes) obey it too.
bool shm_cma_disabled();

}  // namespace ferry::detail

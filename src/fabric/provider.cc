#include "fabric/provider.h"

#include <fmt/format.h>
#include <rdma/fi_errno.h>

#include <cstring>
#include <vector>

namespace ferry::detail {

std::string full_provider_name(const std::string& p) {
    if (p == "tcp") return "tcp;ofi_rxm";
    if (p == "verbs") return "verbs;ofi_rxm";
    return p;
}

Result<FiInfoPtr> get_infos(const std::string& provider, const EngineConfig& config) {
    FiInfoPtr hints(fi_allocinfo());
    if (!hints) return resource_exhausted("fi_allocinfo: out of memory");
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE |
                  FI_SEND | FI_RECV;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                  FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->fabric_attr->prov_name = strdup(provider.c_str());
    bool uses_node = provider.rfind("tcp", 0) == 0 || provider.rfind("verbs", 0) == 0;
    fi_info* out = nullptr;
    int rc = fi_getinfo(FI_VERSION(1, 17), uses_node ? config.node.c_str() : nullptr, nullptr,
                        uses_node ? FI_SOURCE : 0, hints.get(), &out);
    if (rc || !out) {
        return unavailable(fmt::format("provider '{}' is not available here: {}", provider,
                                       fi_strerror(-rc)));
    }
    return FiInfoPtr(out);
}

Result<std::string> resolve_provider_name(const EngineConfig& config) {
    if (config.provider != "auto") return full_provider_name(config.provider);
    std::vector<std::string> order = {"efa", "verbs;ofi_rxm"};
    if (config.peers_on_same_host) order.push_back("shm");
    order.push_back("tcp;ofi_rxm");
    std::string tried;
    for (const auto& p : order) {
        if (get_infos(p, config).ok()) return p;
        tried += (tried.empty() ? "" : ", ") + p;
    }
    return unavailable("no usable libfabric provider found (tried " + tried + ")");
}

}  // namespace ferry::detail

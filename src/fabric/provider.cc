#include "fabric/provider.h"

#include <fmt/format.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_errno.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace ferry::detail {
namespace {

template <typename T>
struct FidCloser {
    void operator()(T* f) const { fi_close(&f->fid); }
};
template <typename T>
using FidPtr = std::unique_ptr<T, FidCloser<T>>;

}  // namespace

std::string full_provider_name(const std::string& p) {
    if (p == "tcp") return "tcp;ofi_rxm";
    if (p == "verbs") return "verbs;ofi_rxm";
    return p;
}

// "available here: shm, tcp;ofi_rxm (tcp), ..." for the capabilities of `hints` with any
// provider: what an unknown or missing provider's error lists.
std::string available_providers(const fi_info* hints) {
    FiInfoPtr any(fi_dupinfo(hints));
    if (!any) return "no provider list (out of memory)";
    std::free(any->fabric_attr->prov_name);
    any->fabric_attr->prov_name = nullptr;
    fi_info* out = nullptr;
    if (fi_getinfo(FI_VERSION(1, 17), nullptr, nullptr, 0, any.get(), &out) || !out)
        return "no provider here offers what ferry needs";
    FiInfoPtr list(out);
    std::vector<std::string> names;  // as TransferEngine takes them: "tcp" is tcp;ofi_rxm
    for (const fi_info* i = out; i; i = i->next) {
        std::string n = i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "";
        if (n == "tcp;ofi_rxm") n = "tcp";
        if (n == "verbs;ofi_rxm") n = "verbs";
        if (n.empty() || std::find(names.begin(), names.end(), n) != names.end()) continue;
        names.push_back(n);
    }
    std::string text;
    for (const std::string& n : names) text += fmt::format("{}{}", text.empty() ? "" : ", ", n);
    return "available here: " + text + " (or auto)";
}

Result<FiInfoPtr> get_infos(const std::string& provider, const EngineConfig& config, bool hmem) {
    FiInfoPtr hints(fi_allocinfo());
    if (!hints) return resource_exhausted("fi_allocinfo: out of memory");
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE |
                  FI_SEND | FI_RECV | (hmem ? FI_HMEM : 0);
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                                  FI_MR_ENDPOINT | (hmem ? FI_MR_HMEM : 0);
    hints->fabric_attr->prov_name = strdup(provider.c_str());
    bool uses_node = provider.rfind("tcp", 0) == 0 || provider.rfind("verbs", 0) == 0;
    fi_info* out = nullptr;
    int rc = fi_getinfo(FI_VERSION(1, 17), uses_node ? config.node.c_str() : nullptr, nullptr,
                        uses_node ? FI_SOURCE : 0, hints.get(), &out);
    if (rc || !out) {
        return unavailable(fmt::format("provider '{}' is not available here: {}; {}", provider,
                                       fi_strerror(-rc), available_providers(hints.get())));
    }
    return FiInfoPtr(out);
}

CudaHmem probe_cuda_hmem(const std::string& provider, const EngineConfig& config) {
    CudaHmem out;
    auto infos = get_infos(provider, config, true);
    if (!infos.ok()) {
        out.note = fmt::format("provider {} does not offer FI_HMEM", provider);
        return out;
    }
    const fi_info* info = infos->get();
    for (const fi_info* i = info; i; i = i->next) {
        if (provider == i->fabric_attr->prov_name) {
            info = i;
            break;
        }
    }
    // FI_HMEM alone does not say which device interfaces libfabric has (shm offers it in
    // builds without CUDA), and libfabric has no query for them. Registering a host buffer as
    // CUDA memory on a scratch domain tells: a missing CUDA interface (not built in, or no
    // GPU when libfabric started) is refused with FI_ENOSYS before the buffer is looked at.
    // Any other refusal comes from a provider that inspected the buffer, so it has CUDA.
    fid_fabric* f = nullptr;
    int rc = fi_fabric(info->fabric_attr, &f, nullptr);
    FidPtr<fid_fabric> fabric(f);
    fid_domain* d = nullptr;
    if (!rc) rc = fi_domain(fabric.get(), const_cast<fi_info*>(info), &d, nullptr);
    FidPtr<fid_domain> domain(d);
    if (rc) {
        out.note = fmt::format(
            "provider {} offers FI_HMEM, but opening it to check for CUDA "
            "failed: {}",
            provider, fi_strerror(-rc));
        return out;
    }
    std::array<uint8_t, 64> buf{};
    iovec iov{buf.data(), buf.size()};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
    attr.requested_key = 1;
    attr.iface = FI_HMEM_CUDA;
    attr.device.cuda = 0;
    fid_mr* m = nullptr;
    rc = fi_mr_regattr(domain.get(), &attr, 0, &m);
    FidPtr<fid_mr> mr(m);
    if (rc == -FI_ENOSYS || rc == -FI_EOPNOTSUPP) {
        out.note = fmt::format(
            "provider {} offers FI_HMEM but not for CUDA memory ({}): "
            "libfabric was built without CUDA or saw no GPU",
            provider, fi_strerror(-rc));
        return out;
    }
    out.note = rc ? fmt::format(
                        "provider {} offers FI_HMEM with CUDA (a host buffer posing as "
                        "CUDA memory was refused: {})",
                        provider, fi_strerror(-rc))
                  : fmt::format("provider {} offers FI_HMEM with CUDA", provider);
    out.infos = std::move(*infos);
    return out;
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

std::string shm_endpoint_name(std::string_view tag) {
    return fmt::format("{}{}_{}", kShmNamePrefix, ::getpid(), tag);
}

long shm_name_pid(const std::vector<uint8_t>& addr) {
    std::string_view name(reinterpret_cast<const char*>(addr.data()), addr.size());
    size_t at = name.find(kShmNamePrefix);
    if (at == std::string_view::npos) return 0;
    std::string digits;
    for (size_t i = at + std::strlen(kShmNamePrefix);
         i < name.size() && name[i] >= '0' && name[i] <= '9' && digits.size() < 10; ++i) {
        digits += name[i];
    }
    return digits.empty() ? 0 : std::strtol(digits.c_str(), nullptr, 10);
}

bool shm_cma_disabled() {
    // libfabric's own reading: fi_param_get_bool takes "1", "on", "yes", "true" (any case).
    const char* v = std::getenv("FI_SHM_DISABLE_CMA");
    if (!v) return false;
    std::string s(v);
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s == "1" || s == "on" || s == "yes" || s == "true" || s == "y";
}

void set_src_name(fi_info* info, const std::string& name) {
    free(info->src_addr);
    info->src_addr = strdup(name.c_str());
    info->src_addrlen = name.size() + 1;
    info->addr_format = FI_ADDR_STR;
}

}  // namespace ferry::detail

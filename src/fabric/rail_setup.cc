// Rail: opening a domain with its endpoint, CQ, AV, signal region and message slots;
// registration and address insertion (run on the worker); stopping and closing.
#include <fmt/format.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "fabric/rail.h"
#include "ferry/common/log.h"

namespace ferry::detail {
namespace {

template <typename T>
void close_fid(T*& obj) {
    if (obj) {
        int rc = fi_close(&obj->fid);
        if (rc) log(LogLevel::kWarn, "fabric", "fi_close: {}", fi_strerror(-rc));
        obj = nullptr;
    }
}

std::string shm_region_name(uint64_t salt, int rail, uint32_t gen) {
    std::string tag = fmt::format("{:x}_{}", salt, rail);
    if (gen) tag += fmt::format("_t{}", gen);
    return shm_endpoint_name(tag);
}

}  // namespace

void Rail::FidEpCloser::operator()(fid_ep* ep) const { close_fid(ep); }

Result<std::unique_ptr<Rail>> Rail::open(int index, const fi_info* info, const EngineConfig& config,
                                         RailHooks hooks, std::shared_ptr<uint8_t[]> signal_buf) {
    std::unique_ptr<Rail> rail(new Rail());
    rail->hooks_ = std::move(hooks);
    rail->signal_buf_ = std::move(signal_buf);
    Status s = rail->init(index, info, config);
    if (!s.ok()) {
        rail->stop(s);
        return s.with_context(
            fmt::format("opening rail {} ({})", index, info->fabric_attr->prov_name));
    }
    return rail;
}

Status Rail::init(int index, const fi_info* info, const EngineConfig& config) {
    index_ = index;
    config_ = config;
    info_ = fi_dupinfo(info);
    if (!info_) return resource_exhausted("fi_dupinfo: out of memory");
    if (std::string_view(info_->fabric_attr->prov_name) == "shm") {
        // shm names its region "<pid>:<n>:<m>" by default; a process killed with SIGKILL
        // leaves that file behind and a later process given the same pid fails fi_enable
        // with EBUSY. A name unique to this engine avoids the collision.
        set_src_name(info_, shm_region_name(config.shm_name_salt, index, 0));
    }
    int rc = fi_fabric(info_->fabric_attr, &fabric_, nullptr);
    if (rc) return fi_status("fi_fabric", rc);
    rc = fi_domain(fabric_, info_, &domain_, nullptr);
    if (rc) return fi_status("fi_domain", rc);
    mr_mode_ = info_->domain_attr->mr_mode;

    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = std::max<size_t>(info_->tx_attr->size + info_->rx_attr->size, 1024);
    rc = fi_cq_open(domain_, &cq_attr, &cq_, nullptr);
    if (rc) return fi_status("fi_cq_open", rc);

    fi_av_attr av_attr{};
    av_attr.type =
        info_->domain_attr->av_type == FI_AV_UNSPEC ? FI_AV_TABLE : info_->domain_attr->av_type;
    rc = fi_av_open(domain_, &av_attr, &av_, nullptr);
    if (rc) return fi_status("fi_av_open", rc);

    rc = fi_endpoint(domain_, info_, &ep_, nullptr);
    if (rc) return fi_status("fi_endpoint", rc);
    rc = fi_ep_bind(ep_, &av_->fid, 0);
    if (rc) return fi_status("fi_ep_bind(av)", rc);
    rc = fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV);
    if (rc) return fi_status("fi_ep_bind(cq)", rc);
    rc = fi_enable(ep_);
    if (rc) return fi_status("fi_enable", rc);
    tx_ep_ = ep_;
    // Only shm queues initiator completions behind each other (see renew_initiator); a fresh
    // endpoint needs registrations that are not bound to one (shm binds none).
    renew_on_stall_ = std::string_view(info_->fabric_attr->prov_name) == "shm" &&
                      !(info_->domain_attr->mr_mode & FI_MR_ENDPOINT);

    size_t len = 0;
    rc = fi_getname(&ep_->fid, nullptr, &len);
    if (rc != -FI_ETOOSMALL && rc != 0) return fi_status("fi_getname(size)", rc);
    name_.resize(len);
    rc = fi_getname(&ep_->fid, name_.data(), &len);
    if (rc) return fi_status("fi_getname", rc);
    name_.resize(len);

    // Queue depth from the provider, capped: above ~1k outstanding operations per rail tcp
    // and shm gain nothing and completions get slower to drain.
    tx_depth_ = std::clamp<size_t>(info_->tx_attr->size, 16, 1024);
    // Writes up to inject_size go with FI_INJECT (shm 4096, tcp;ofi_rxm 64 in libfabric 1.17).
    inject_size_ = config.inject ? info_->tx_attr->inject_size : 0;
    max_iovs_ =
        std::clamp<size_t>(std::min({info_->tx_attr->rma_iov_limit, info_->tx_attr->iov_limit,
                                     config.rma_iovs, kMaxOpIovs}),
                           1, kMaxOpIovs);
    // Recorded for describe/docs only: neither shm nor tcp;ofi_rxm orders completions
    // (tx comp_order FI_ORDER_NONE), so the engine never leans on selective completions.
    comp_ordered_ = (info_->tx_attr->comp_order & FI_ORDER_STRICT) != 0;
    inject_done_at_post_ = inject_size_ > 0 && !config.inject_completions &&
                           std::string_view(info_->fabric_attr->prov_name) == "shm";
    initiator_copies_single_rma_ = std::string_view(info_->fabric_attr->prov_name) == "shm";
    join_bytes_ = initiator_copies_single_rma_ ? UINT64_MAX : uint64_t{16} << 10;

    if (!signal_buf_) signal_buf_ = std::make_shared<uint8_t[]>(64);
    FERRY_ASSIGN_OR_RETURN(signal_mr_,
                           register_mr(signal_buf_.get(), 64, FI_REMOTE_WRITE | FI_WRITE));
    signal_key_ = fi_mr_key(signal_mr_);

    slot_size_ = config.max_message_size + 16;
    int nrecv = std::max(config.message_recv_buffers, 4);
    recv_pool_.resize(slot_size_ * nrecv);
    FERRY_ASSIGN_OR_RETURN(recv_mr_, register_mr(recv_pool_.data(), recv_pool_.size(), FI_RECV));
    recv_ctx_.resize(nrecv);
    for (int i = 0; i < nrecv; ++i) {
        recv_ctx_[i].kind = FabricCtx::kRecv;
        FERRY_RETURN_IF_ERROR(post_recv(i));
    }
    int nsend = std::max(config.message_recv_buffers / 2, 4);
    send_pool_.resize(slot_size_ * nsend);
    FERRY_ASSIGN_OR_RETURN(send_mr_, register_mr(send_pool_.data(), send_pool_.size(), FI_SEND));
    for (int i = nsend - 1; i >= 0; --i) free_send_slots_.push_back(i);
    return ok_status();
}

Result<fid_mr*> Rail::register_mr(void* ptr, size_t len, uint64_t access, int cuda_device) {
    iovec iov{ptr, len};
    fi_mr_attr attr{};
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = (mr_mode_ & FI_MR_PROV_KEY) ? 0 : next_key_.fetch_add(1);
    if (cuda_device >= 0) {
        attr.iface = FI_HMEM_CUDA;
        attr.device.cuda = cuda_device;
    }
    fid_mr* mr = nullptr;
    int rc = fi_mr_regattr(domain_, &attr, 0, &mr);
    if (rc) return fi_status(fmt::format("fi_mr_regattr of {} bytes", len).c_str(), rc);
    if (mr_mode_ & FI_MR_ENDPOINT) {
        rc = fi_mr_bind(mr, &ep_->fid, 0);
        if (!rc) rc = fi_mr_enable(mr);
        if (rc) {
            fi_close(&mr->fid);
            return fi_status("fi_mr_bind/enable", rc);
        }
    }
    return mr;
}

Result<fi_addr_t> Rail::insert_address(const std::vector<uint8_t>& addr) {
    // fi_av_insert takes no length: it reads as many bytes as the address format says.
    if (addr.empty())
        return invalid_argument(fmt::format("rail {}: the peer's address is empty", index_));
    if (info_->addr_format == FI_ADDR_STR) {
        if (std::memchr(addr.data(), 0, addr.size()) == nullptr) {
            return invalid_argument(
                fmt::format("rail {}: the peer's address ({} bytes) is not a terminated string, as "
                            "addresses of this provider are: corrupted, or another provider's?",
                            index_, addr.size()));
        }
    } else if (addr.size() != name_.size()) {
        return invalid_argument(fmt::format(
            "rail {}: the peer's address is {} bytes, this provider's are {}: corrupted, or "
            "another provider's?",
            index_, addr.size(), name_.size()));
    }
    fi_addr_t fa = FI_ADDR_UNSPEC;
    int rc = fi_av_insert(av_, addr.data(), 1, &fa, 0, nullptr);
    if (rc != 1) return fi_status("fi_av_insert", rc < 0 ? rc : -FI_EINVAL);
    stats_.peer_addresses.fetch_add(1, std::memory_order_relaxed);
    if (renew_on_stall_) {
        if (long pid = shm_name_pid(addr); pid > 0) peer_pid_[fa] = pid;
    }
    return fa;
}

Status Rail::remove_address(fi_addr_t fa) {
    int rc = fi_av_remove(av_, &fa, 1, 0);
    if (rc) return fi_status("fi_av_remove", rc);
    stats_.peer_addresses.fetch_sub(1, std::memory_order_relaxed);
    peer_pid_.erase(fa);
    dead_peers_.erase(fa);
    return ok_status();
}

Status Rail::renew_initiator() {
    fi_info* dup = fi_dupinfo(info_);
    if (!dup) return resource_exhausted("fi_dupinfo: out of memory");
    set_src_name(dup, shm_region_name(config_.shm_name_salt, index_, tx_gen_ + 1));
    fid_ep* raw = nullptr;
    int rc = fi_endpoint(domain_, dup, &raw, nullptr);
    fi_freeinfo(dup);
    if (rc) return fi_status("opening a fresh initiator endpoint: fi_endpoint", rc);
    EpPtr ep(raw);
    // Same AV (peers keep their fi_addr_t: shm lets several endpoints share one, each
    // introducing itself to a peer on first contact) and same CQ (the worker polls one).
    rc = fi_ep_bind(ep.get(), &av_->fid, 0);
    if (!rc) rc = fi_ep_bind(ep.get(), &cq_->fid, FI_TRANSMIT | FI_RECV);
    if (!rc) rc = fi_enable(ep.get());
    if (rc) return fi_status("enabling a fresh initiator endpoint", rc);
    if (fresh_tx_) retired_.push_back({std::move(fresh_tx_), tx_gen_});
    fresh_tx_ = std::move(ep);
    tx_ep_ = fresh_tx_.get();
    ++tx_gen_;
    stats_.initiator_renewals.fetch_add(1, std::memory_order_relaxed);
    return ok_status();
}

void Rail::close_idle_retired() {
    for (auto it = retired_.begin(); it != retired_.end();) {
        bool busy = false;
        for (FabricOp* o = inflight_.head; o && !busy; o = o->in_next) busy = o->tx_gen == it->gen;
        if (busy) {
            ++it;
            continue;
        }
        // Its abandoned operations stay in abandoned_: a completion of theirs may already sit
        // in the shared CQ, and is then matched to them as usual; the rest go at stop().
        it = retired_.erase(it);
    }
}

void Rail::stop(const Status& why) {
    if (wedged()) {
        // The worker is inside a provider call that may never return: it cannot be joined,
        // and nothing it may still touch can be freed. Leave it, and this rail, behind.
        if (worker_.joinable()) worker_.detach();
        return;
    }
    if (worker_.joinable()) {
        {
            std::lock_guard lk(nap_mu_);
            running_ = false;
            wake_ = true;
        }
        nap_cv_.notify_all();
        worker_.join();
    }
    running_ = false;
    retire_finished();
    // The worker is gone: this thread owns the rail now. Close the endpoints first so that
    // libfabric lets go of every context, then fail what was still outstanding.
    retired_.clear();
    fresh_tx_.reset();
    tx_ep_ = nullptr;
    close_fid(ep_);
    while (auto* op = static_cast<FabricOp*>(queue_.pop())) pending_.push_back(op);
    for (OpList* l : {&pending_, &inflight_}) {
        while (FabricOp* op = l->head) {
            l->erase(op);
            op->parent->piece_done(why);
            delete op;
        }
    }
    for (FabricOp* op : abandoned_) delete op;
    abandoned_.clear();
    // The endpoints are closed: libfabric holds nothing any more.
    auto watches = std::move(release_watches_);
    release_watches_.clear();
    for (auto& w : watches) w.then(0);
}

Rail::~Rail() {
    stop(cancelled("engine shut down"));
    if (wedged()) return;  // the engine leaks wedged rails rather than destroying them
    close_fid(signal_mr_);
    close_fid(recv_mr_);
    close_fid(send_mr_);
    close_fid(av_);
    close_fid(cq_);
    close_fid(domain_);
    close_fid(fabric_);
    if (info_) fi_freeinfo(info_);
    info_ = nullptr;
}

}  // namespace ferry::detail

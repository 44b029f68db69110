#include "bench/raw_endpoint.h"

#include <fmt/format.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <atomic>
#include <thread>

#include "fabric/provider.h"
#include "ferry/common/spin.h"

namespace ferry::detail {
namespace {
Status fi_fail(const char* what, long rc) {
    return provider_error(
        fmt::format("raw loop: {} failed: {}", what, fi_strerror(static_cast<int>(-rc))));
}
}  // namespace

Result<std::unique_ptr<RawEndpoint>> RawEndpoint::open(const EngineConfig& config, void* buf,
                                                       size_t len) {
    std::unique_ptr<RawEndpoint> e(new RawEndpoint());
    FERRY_ASSIGN_OR_RETURN(std::string prov, resolve_provider_name(config));
    FERRY_ASSIGN_OR_RETURN(auto infos, get_infos(prov, config));
    const fi_info* pick = infos.get();
    for (const fi_info* i = infos.get(); i; i = i->next) {
        if (prov == i->fabric_attr->prov_name) {
            pick = i;
            break;
        }
    }
    e->info_ = fi_dupinfo(pick);
    if (!e->info_) return resource_exhausted("raw loop: fi_dupinfo: out of memory");
    if (prov == "shm") {
        // Named as the engine's endpoints are, so that the next shm engine removes the regions
        // of a run that could not remove them (SIGKILL): 65 files of 16 MiB for `--rate`.
        static std::atomic<uint64_t> next{0};
        set_src_name(e->info_, shm_endpoint_name(fmt::format("raw{}", next++)));
    }
    e->buf_ = buf;
    e->len_ = len;
    int rc = fi_fabric(e->info_->fabric_attr, &e->fabric_, nullptr);
    if (rc) return fi_fail("fi_fabric", rc);
    rc = fi_domain(e->fabric_, e->info_, &e->domain_, nullptr);
    if (rc) return fi_fail("fi_domain", rc);
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.size = 4096;
    rc = fi_cq_open(e->domain_, &cq_attr, &e->cq_, nullptr);
    if (rc) return fi_fail("fi_cq_open", rc);
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    rc = fi_av_open(e->domain_, &av_attr, &e->av_, nullptr);
    if (rc) return fi_fail("fi_av_open", rc);
    rc = fi_endpoint(e->domain_, e->info_, &e->ep_, nullptr);
    if (rc) return fi_fail("fi_endpoint", rc);
    if ((rc = fi_ep_bind(e->ep_, &e->av_->fid, 0))) return fi_fail("fi_ep_bind", rc);
    if ((rc = fi_ep_bind(e->ep_, &e->cq_->fid, FI_TRANSMIT | FI_RECV))) {
        return fi_fail("fi_ep_bind", rc);
    }
    if ((rc = fi_enable(e->ep_))) return fi_fail("fi_enable", rc);
    uint64_t mr_mode = e->info_->domain_attr->mr_mode;
    e->virt_ = mr_mode & FI_MR_VIRT_ADDR;
    rc = fi_mr_reg(e->domain_, buf, len, FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ, 0,
                   (mr_mode & FI_MR_PROV_KEY) ? 0 : 1, 0, &e->mr_, nullptr);
    if (rc) return fi_fail("fi_mr_reg", rc);
    if (mr_mode & FI_MR_ENDPOINT) {
        if ((rc = fi_mr_bind(e->mr_, &e->ep_->fid, 0)) || (rc = fi_mr_enable(e->mr_))) {
            return fi_fail("fi_mr_bind", rc);
        }
    }
    e->key_ = fi_mr_key(e->mr_);
    size_t nlen = 0;
    fi_getname(&e->ep_->fid, nullptr, &nlen);
    e->name_.resize(nlen);
    if ((rc = fi_getname(&e->ep_->fid, e->name_.data(), &nlen))) return fi_fail("fi_getname", rc);
    e->name_.resize(nlen);
    return e;
}

RawEndpoint::~RawEndpoint() {
    if (ep_) fi_close(&ep_->fid);
    if (mr_) fi_close(&mr_->fid);
    if (av_) fi_close(&av_->fid);
    if (cq_) fi_close(&cq_->fid);
    if (domain_) fi_close(&domain_->fid);
    if (fabric_) fi_close(&fabric_->fid);
    if (info_) fi_freeinfo(info_);
}

Result<fi_addr_t> RawEndpoint::insert(std::span<const uint8_t> addr) {
    fi_addr_t fa;
    int rc = fi_av_insert(av_, addr.data(), 1, &fa, 0, nullptr);
    if (rc != 1) return fi_fail("fi_av_insert", rc < 0 ? rc : -FI_EINVAL);
    return fa;
}

void RawEndpoint::progress() {
    if (!poll()) std::this_thread::yield();
}

bool RawEndpoint::poll() {
    fi_cq_data_entry e[16];
    ssize_t n = fi_cq_read(cq_, e, 16);
    if (n == -FI_EAVAIL) {
        fi_cq_err_entry err{};
        fi_cq_readerr(cq_, &err, 0);
        return true;
    }
    return n > 0;
}

namespace {

// What a window loop did: writes completed and the seconds from its start to the last.
struct WindowRun {
    uint64_t completed = 0;
    double seconds = 0;
};

// Keeps up to `window` writes in flight for `duration` through `post(index, context)` (which
// returns fi_write's code), reading completions from `cq`; the same loop for the bandwidth and
// the rate ceilings, so they differ only in what they post.
template <typename Post>
Result<WindowRun> window_loop(fid_cq* cq, int window, Duration duration, const char* what,
                              const char* call, Post post) {
    int inflight = 0;
    uint64_t posted = 0;
    WindowRun run;
    auto start = Clock::now();
    auto stop_at = start + duration;
    fi_cq_data_entry entries[64];
    // Providers that set FI_CONTEXT own the context until completion: one per op in flight.
    std::vector<fi_context2> ctxs(window);
    std::vector<fi_context2*> free_ctx;
    for (auto& c : ctxs) free_ctx.push_back(&c);
    bool posting = true;
    IdleWait idle;
    while (posting || inflight > 0) {
        while (posting && inflight < window) {
            ssize_t rc = post(posted, free_ctx.back());
            if (rc == -FI_EAGAIN) break;
            if (rc) return fi_fail(call, rc);
            free_ctx.pop_back();
            ++inflight;
            ++posted;
        }
        ssize_t n = fi_cq_read(cq, entries, 64);
        if (n == -FI_EAGAIN) {
            // The engine's worker's policy (IdleWait), so that neither side is handicapped:
            // on a machine with fewer cores than busy threads a yield, else a pause.
            idle();
        } else if (n > 0) {
            for (ssize_t i = 0; i < n; ++i) {
                free_ctx.push_back(static_cast<fi_context2*>(entries[i].op_context));
            }
            inflight -= static_cast<int>(n);
            run.completed += n;
        } else if (n == -FI_EAVAIL) {
            fi_cq_err_entry err{};
            fi_cq_readerr(cq, &err, 0);
            return provider_error(fmt::format("{}: write failed: {}", what, fi_strerror(err.err)));
        }
        auto now = Clock::now();
        if (now >= stop_at) posting = false;
        if (now > stop_at + std::chrono::seconds(10)) {
            return timeout_error(fmt::format(
                "{}: {} writes still in flight 10 s after the last was posted", what, inflight));
        }
    }
    run.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    return run;
}

}  // namespace

Result<double> RawEndpoint::write_loop(fi_addr_t dest, uint64_t remote_base, uint64_t remote_key,
                                       size_t size, int window, int slots, Duration duration) {
    if (size * slots > len_) return invalid_argument("raw loop: buffer too small");
    void* desc = fi_mr_desc(mr_);
    FERRY_ASSIGN_OR_RETURN(
        WindowRun run, window_loop(cq_, window, duration, "raw loop", "fi_write",
                                   [&](uint64_t posted, fi_context2* ctx) {
                                       size_t slot = posted % slots;
                                       return fi_write(
                                           ep_, static_cast<uint8_t*>(buf_) + slot * size, size,
                                           desc, dest, remote_base + slot * size, remote_key, ctx);
                                   }));
    completed_ += run.completed;
    return static_cast<double>(run.completed * size) / run.seconds;
}

Result<double> RawEndpoint::rate_loop(std::span<const Target> targets, size_t size, bool imm,
                                      int window, int slots, Duration duration) {
    if (targets.empty()) return invalid_argument("raw rate loop: no targets");
    if (size * 4 > len_) return invalid_argument("raw rate loop: buffer too small");
    void* desc = fi_mr_desc(mr_);
    const size_t n = targets.size();
    FERRY_ASSIGN_OR_RETURN(
        WindowRun run,
        window_loop(cq_, window, duration, "raw rate loop", imm ? "fi_writedata" : "fi_write",
                    [&](uint64_t posted, fi_context2* ctx) {
                        const Target& t = targets[posted % n];
                        uint64_t slot = (posted / n) % slots;
                        void* src = static_cast<uint8_t*>(buf_) + (posted % 4) * size;
                        return imm ? fi_writedata(ep_, src, size, desc,
                                                  static_cast<uint32_t>(posted), t.dest,
                                                  t.base + slot * size, t.key, ctx)
                                   : fi_write(ep_, src, size, desc, t.dest, t.base + slot * size,
                                              t.key, ctx);
                    }));
    completed_ += run.completed;
    return static_cast<double>(run.completed) / run.seconds;
}

}  // namespace ferry::detail

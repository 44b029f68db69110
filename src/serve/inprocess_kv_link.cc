#include "serve/inprocess_kv_link.h"

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "ferry/common/thread_name.h"
#include "ferry/kv/block_mapping.h"

namespace ferry::serve {

struct InProcessKvLink::Endpoint {
    std::string id;
    KvPool* pool;
    std::unique_ptr<Producer> producer;
    std::unique_ptr<Consumer> consumer;
};

class InProcessKvLink::Producer : public KvProducer {
  public:
    Producer(InProcessKvLink* link, Endpoint* ep) : link_(link), ep_(ep) {}
    Result<KvTransferParams> on_prefill_done(const std::string& transfer,
                                             const KvTransferParams& params,
                                             std::vector<BlockId> blocks, size_t num_tokens,
                                             KvDoneCallback release) override {
        return link_->prefill_done(ep_, transfer, params, std::move(blocks), num_tokens,
                                   std::move(release));
    }
    void on_transfer_aborted(const std::string& transfer, const KvTransferParams& params,
                             const Status& why) override {
        link_->abort_prefill(ep_, transfer, why);
    }

  private:
    InProcessKvLink* link_;
    Endpoint* ep_;
};

class InProcessKvLink::Consumer : public KvConsumer {
  public:
    Consumer(InProcessKvLink* link, Endpoint* ep) : link_(link), ep_(ep) {}
    Status on_blocks_allocated(const std::string& transfer, const KvTransferParams& params,
                               std::vector<BlockId> blocks, size_t num_tokens,
                               KvDoneCallback arrived, KvProgressCallback) override {
        return link_->blocks_allocated(ep_, transfer, params, std::move(blocks), num_tokens,
                                       std::move(arrived));
    }
    void cancel(const std::string& transfer) override { link_->cancel(ep_, transfer); }

  private:
    InProcessKvLink* link_;
    Endpoint* ep_;
};

InProcessKvLink::InProcessKvLink(InProcessKvLinkConfig config) : config_(config) {}

InProcessKvLink::~InProcessKvLink() { stop(); }

Status InProcessKvLink::add_engine(const std::string& engine_id, KvPool* pool) {
    std::lock_guard lock(mu_);
    if (running_) return invalid_argument("add engines before starting the link");
    if (pool == nullptr) return invalid_argument("engine " + engine_id + " has no pool");
    if (endpoints_.count(engine_id)) return invalid_argument("engine id used twice: " + engine_id);
    auto ep = std::make_unique<Endpoint>();
    ep->id = engine_id;
    ep->pool = pool;
    ep->producer = std::make_unique<Producer>(this, ep.get());
    ep->consumer = std::make_unique<Consumer>(this, ep.get());
    endpoints_[engine_id] = std::move(ep);
    return ok_status();
}

KvProducer* InProcessKvLink::producer(const std::string& engine_id) {
    auto it = endpoints_.find(engine_id);
    return it == endpoints_.end() ? nullptr : it->second->producer.get();
}

KvConsumer* InProcessKvLink::consumer(const std::string& engine_id) {
    auto it = endpoints_.find(engine_id);
    return it == endpoints_.end() ? nullptr : it->second->consumer.get();
}

Status InProcessKvLink::start() {
    std::lock_guard lock(mu_);
    if (running_) return invalid_argument("link already started");
    running_ = true;
    thread_ = std::thread([this] {
        set_thread_name("ferry-kvlocal");
        run();
    });
    return ok_status();
}

void InProcessKvLink::stop() {
    {
        std::lock_guard lock(mu_);
        if (!running_) return;
        running_ = false;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    std::map<std::string, PrefillSide> prefills;
    std::map<std::string, DecodeSide> decodes;
    std::deque<Job> jobs;
    {
        std::lock_guard lock(mu_);
        prefills.swap(prefills_);
        decodes.swap(decodes_);
        jobs.swap(jobs_);
    }
    Status why = cancelled("KV link stopped");
    for (auto& [k, p] : prefills) p.release(why);
    for (auto& [k, d] : decodes) d.arrived(why);
    for (auto& j : jobs) {
        j.src.release(why);
        j.dst.arrived(why);
    }
}

uint64_t InProcessKvLink::bytes_copied() const {
    std::lock_guard lock(mu_);
    return bytes_copied_;
}

void InProcessKvLink::abort_prefill(Endpoint* ep, const std::string& transfer, const Status& why) {
    KvDoneCallback release;
    {
        std::lock_guard lock(mu_);
        auto it = prefills_.find(transfer);
        // A copy already queued or running finishes on its own, and releases then.
        if (it == prefills_.end() || it->second.ep != ep) return;
        release = std::move(it->second.release);
        prefills_.erase(it);
    }
    release(why.ok() ? cancelled("transfer aborted") : why);
}

Result<KvTransferParams> InProcessKvLink::prefill_done(Endpoint* ep, const std::string& transfer,
                                                       const KvTransferParams& params,
                                                       std::vector<BlockId> blocks, size_t tokens,
                                                       KvDoneCallback release) {
    bool push = config_.mode == kv::TransferMode::kPush;
    if (push && params.transfer_id.empty())
        return invalid_argument("push mode needs a transfer_id in kv_transfer_params");
    const std::string& key = transfer;
    KvTransferParams out;
    out.do_remote_prefill = true;
    out.transfer_id = key;
    out.remote_engine_id = ep->id;
    out.remote_block_ids = blocks;
    {
        std::lock_guard lock(mu_);
        if (!running_) return unavailable("KV link is not running");
        if (prefills_.count(key))
            return invalid_argument(fmt::format("transfer {} already has a prefill side", key));
        PrefillSide side{ep, std::move(blocks), tokens, std::move(release),
                         Clock::now() + config_.lease};
        auto d = push ? decodes_.find(key) : decodes_.end();
        if (d != decodes_.end()) {
            jobs_.push_back(Job{key, std::move(side), std::move(d->second)});
            in_flight_.insert(key);
            decodes_.erase(d);
        } else {
            prefills_.emplace(key, std::move(side));
        }
    }
    cv_.notify_all();
    return out;
}

Status InProcessKvLink::blocks_allocated(Endpoint* ep, const std::string& transfer,
                                         const KvTransferParams& params,
                                         std::vector<BlockId> blocks, size_t tokens,
                                         KvDoneCallback arrived) {
    bool pull = !params.remote_block_ids.empty();
    if (pull && config_.mode == kv::TransferMode::kPush)
        return invalid_argument("remote_block_ids given, but the link runs in push mode");
    if (!pull && config_.mode != kv::TransferMode::kPush)
        return invalid_argument("pull mode needs remote_block_ids from the prefill response");
    DecodeSide side{ep, std::move(blocks), tokens, std::move(arrived),
                    Clock::now() + config_.lease};
    std::unique_lock lock(mu_);
    if (!running_) return unavailable("KV link is not running");
    const std::string& key = transfer;
    if (!pull) {
        if (decodes_.count(key))
            return invalid_argument(fmt::format("transfer {} already has a decode side", key));
        auto p = prefills_.find(key);
        if (p == prefills_.end()) {
            decodes_.emplace(key, std::move(side));  // prefill not done yet: rendezvous later
            return ok_status();
        }
        jobs_.push_back(Job{key, std::move(p->second), std::move(side)});
        in_flight_.insert(key);
        prefills_.erase(p);
        lock.unlock();
        cv_.notify_all();
        return ok_status();
    }
    auto p = prefills_.find(key);
    if (p == prefills_.end())
        return not_found(fmt::format(
            "transfer {}: engine {} holds no KV for it (lease expired or never prefilled)", key,
            params.remote_engine_id));
    if (p->second.ep->id != params.remote_engine_id || p->second.blocks != params.remote_block_ids)
        return invalid_argument(
            fmt::format("transfer {}: remote_engine_id/remote_block_ids do not match what {} holds",
                        key, p->second.ep->id));
    Job job{key, std::move(p->second), std::move(side)};
    prefills_.erase(p);
    if (config_.mode == kv::TransferMode::kPull) {
        in_flight_.insert(key);
        jobs_.push_back(std::move(job));
        lock.unlock();
        cv_.notify_all();
        return ok_status();
    }
    // Inline baseline: the read happens here, in the decode engine's loop.
    lock.unlock();
    Status st = copy(job.src, job.dst);
    job.src.release(st);
    job.dst.arrived(st);
    return ok_status();
}

void InProcessKvLink::cancel(Endpoint* ep, const std::string& transfer) {
    KvDoneCallback arrived;
    KvDoneCallback release;
    {
        std::lock_guard lock(mu_);
        if (in_flight_.count(transfer)) {
            cancel_in_flight_[transfer] = true;  // the copy thread answers once it stopped
            return;
        }
        if (auto it = decodes_.find(transfer); it != decodes_.end() && it->second.ep == ep) {
            arrived = std::move(it->second.arrived);
            decodes_.erase(it);
        }
    }
    if (arrived) arrived(cancelled(fmt::format("transfer {} cancelled by decode", transfer)));
}

Status InProcessKvLink::copy(const PrefillSide& src, const DecodeSide& dst) {
    const kv::KvLayout& a = src.ep->pool->layout();
    const kv::KvLayout& b = dst.ep->pool->layout();
    if (a.block_bytes() != b.block_bytes() || a.block_size != b.block_size)
        return invalid_argument(fmt::format(
            "{} and {} have different KV layouts; the in-process link copies whole blocks only",
            src.ep->id, dst.ep->id));
    if (src.tokens != dst.tokens)
        return invalid_argument(
            fmt::format("prefill has {} prompt tokens, decode expects {}", src.tokens, dst.tokens));
    size_t n = kv::blocks_for_tokens(uint32_t(src.tokens), a.block_size);
    if (n > src.blocks.size() || n > dst.blocks.size())
        return out_of_range(fmt::format("{} tokens need {} blocks; prefill gave {}, decode {}",
                                        src.tokens, n, src.blocks.size(), dst.blocks.size()));
    for (size_t i = 0; i < n; ++i) {
        auto from = src.ep->pool->block(src.blocks[i]);
        auto to = dst.ep->pool->block(dst.blocks[i]);
        std::memcpy(to.data(), from.data(), from.size());
    }
    std::lock_guard lock(mu_);
    bytes_copied_ += n * a.block_bytes();
    return ok_status();
}

void InProcessKvLink::run() {
    std::unique_lock lock(mu_);
    while (running_) {
        if (!jobs_.empty()) {
            Job job = std::move(jobs_.front());
            jobs_.pop_front();
            lock.unlock();
            Status st = copy(job.src, job.dst);
            lock.lock();
            bool was_cancelled = cancel_in_flight_.erase(job.key) > 0;
            in_flight_.erase(job.key);
            lock.unlock();
            job.src.release(st);
            job.dst.arrived(was_cancelled ? cancelled("transfer cancelled by decode") : st);
            lock.lock();
            continue;
        }
        TimePoint now = Clock::now();
        TimePoint wake = now + seconds(1);
        std::vector<KvDoneCallback> expired_p, expired_d;
        for (auto it = prefills_.begin(); it != prefills_.end();) {
            if (it->second.deadline <= now) {
                expired_p.push_back(std::move(it->second.release));
                it = prefills_.erase(it);
            } else {
                wake = std::min(wake, it->second.deadline);
                ++it;
            }
        }
        for (auto it = decodes_.begin(); it != decodes_.end();) {
            if (it->second.deadline <= now) {
                expired_d.push_back(std::move(it->second.arrived));
                it = decodes_.erase(it);
            } else {
                wake = std::min(wake, it->second.deadline);
                ++it;
            }
        }
        if (!expired_p.empty() || !expired_d.empty()) {
            lock.unlock();
            for (auto& r : expired_p)
                r(timeout_error("decode did not take the KV within the lease; blocks released"));
            for (auto& a : expired_d)
                a(timeout_error("prefill did not deliver the KV within the lease"));
            lock.lock();
            continue;
        }
        cv_.wait_until(lock, wake, [&] { return !jobs_.empty() || !running_; });
    }
}

}  // namespace ferry::serve

#include "fabric/rail_group.h"

#include "ferry/common/log.h"

namespace ferry::detail {

Status RailGroup::open(std::span<const fi_info* const> candidates, const EngineConfig& config,
                       const std::function<RailHooks(int rail)>& hooks_for) {
    stripe_threshold_ = config.stripe_threshold;
    max_write_size_ = config.max_write_size;
    // One signal buffer for every rail: a peer signals any rail at the one address the
    // engine's address gives, under that rail's key. With a buffer per rail, a provider that
    // addresses by virtual address (shm, verbs) refused signals to every rail but the first,
    // and their immediates never arrived.
    auto signal_buf = std::make_shared<uint8_t[]>(64);
    for (int r = 0; r < config.num_rails; ++r) {
        FERRY_ASSIGN_OR_RETURN(auto rail, Rail::open(r, candidates[r % candidates.size()], config,
                                                     hooks_for(r), signal_buf));
        rails_.push_back(std::move(rail));
        all_ |= RailSet{1} << r;
    }
    return ok_status();
}

void RailGroup::start() {
    for (auto& r : rails_) r->start();
}

void RailGroup::stop(const Status& why) {
    for (auto& r : rails_) r->stop(why);
}

void RailGroup::release() {
    for (auto& r : rails_) {
        if (r->wedged()) {
            log(LogLevel::kWarn, "fabric", "leaving wedged rail {} behind at shutdown", r->index());
            (void)r.release();
        }
    }
    rails_.clear();
}

void RailGroup::post(const RailBatch& b) {
    for (size_t r = 0; r < b.rails(); ++r) {
        if (b.first(r)) rails_[r]->submit(b.first(r), b.last(r));
    }
}

void RailGroup::discard(const RailBatch& b) {
    for (size_t r = 0; r < b.rails(); ++r) b.for_each(r, [](FabricOp* op) { delete op; });
}

void RailGroup::wake_all() {
    for (auto& r : rails_) r->wake();
}

namespace {
// Adds a rail's counters (RailStats) or another sum (EngineStats) to `to`.
template <typename Counters>
void add_counters(EngineStats& to, const Counters& c) {
    to.ops_posted += c.ops_posted;
    to.ops_injected += c.ops_injected;
    to.posted_with_more += c.posted_with_more;
    to.post_rounds += c.post_rounds;
    to.bytes_posted += c.bytes_posted;
    to.eagain += c.eagain;
    to.op_errors += c.op_errors;
    to.op_timeouts += c.op_timeouts;
    to.imm_arrivals += c.imm_arrivals;
    to.messages_received += c.messages_received;
    to.messages_dropped += c.messages_dropped;
}
}  // namespace

EngineStats RailGroup::stats() const {
    EngineStats s;
    for (const auto& r : rails_) add_counters(s, r->stats());
    return s;
}

std::vector<EngineStats> RailGroup::rail_stats() const {
    std::vector<EngineStats> out;
    out.reserve(rails_.size());
    for (const auto& r : rails_) add_counters(out.emplace_back(), r->stats());
    return out;
}

}  // namespace ferry::detail

#include "fabric/rail_group.h"

#include "ferry/common/log.h"

namespace ferry::detail {

Status RailGroup::open(std::span<const fi_info* const> candidates, const EngineConfig& config,
                       const std::function<RailHooks(int rail)>& hooks_for) {
    stripe_threshold_ = config.stripe_threshold;
    max_write_size_ = config.max_write_size;
    for (int r = 0; r < config.num_rails; ++r) {
        FERRY_ASSIGN_OR_RETURN(
            auto rail, Rail::open(r, candidates[r % candidates.size()], config, hooks_for(r)));
        rails_.push_back(std::move(rail));
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

EngineStats RailGroup::stats() const {
    EngineStats s;
    for (const auto& r : rails_) {
        const RailStats& rs = r->stats();
        s.ops_posted += rs.ops_posted;
        s.ops_injected += rs.ops_injected;
        s.posted_with_more += rs.posted_with_more;
        s.post_rounds += rs.post_rounds;
        s.bytes_posted += rs.bytes_posted;
        s.eagain += rs.eagain;
        s.op_errors += rs.op_errors;
        s.op_timeouts += rs.op_timeouts;
        s.imm_arrivals += rs.imm_arrivals;
        s.messages_received += rs.messages_received;
        s.messages_dropped += rs.messages_dropped;
    }
    return s;
}

}  // namespace ferry::detail

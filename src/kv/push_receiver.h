// Decode side of a push: announcements waiting for SCHEDULED, and registered transfers
// counting every producer rank's segments until each sent FINAL or a closing SEGMENT (or FAIL,
// or CANCEL_ACK).
// Runs on the connector thread only; owns `announces_` and `consumers_` (private to src/kv).
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "connector_context.h"

namespace ferry::kv::detail {

class PushReceiver {
  public:
    explicit PushReceiver(ConnectorContext& ctx) : ctx_(ctx) {}

    // The engine's calls, queued by KvConnector.
    void announce(uint64_t id, uint32_t attempt, std::vector<EngineAddress> ranks);
    void register_push(PushRegistration reg);
    void cancel(uint64_t id);
    // The prefill process behind `peer` is gone: its slots and announcements end now.
    void peer_gone(PeerId peer, const Status& why);

    // Messages from prefill ranks.
    void on_scheduled(const ScheduledMsg& m);
    void on_segment(const SegmentMsg& m);
    void on_final(const FinalMsg& m);
    void on_fail(const FailMsg& m);
    void on_cancel_ack(const CancelAckMsg& m);

    void expire(TimePoint now);
    // The engine lost its rail for good (TransferEngine::health): from `at` on, every
    // announcement and registration still open ends with `why`. `at` leaves prefill's writes
    // already under way the time to fail at their end first (Leases::engine_failed).
    void engine_failed(const Status& why, TimePoint at);
    void begin_shutdown();
    void report_shut_down(const Status& why);

  private:
    // One producer rank of a registration. Open until FINAL came and every segment it
    // announced was counted (or FAIL, or CANCEL_ACK).
    enum class SlotState { kOpen, kComplete, kFailed, kAcked };
    struct Slot {
        uint32_t rank = 0;
        PeerId peer = 0;
        uint32_t imm = 0;  // segment i counts immediate imm + i
        SlotState state = SlotState::kOpen;
        uint32_t writes = 0;
        bool have_final = false;
        uint32_t final_segments = 0;
        uint32_t counted = 0;                 // segments whose writes all arrived
        std::vector<bool> seen;               // by index: SEGMENT came (a copy is stale)
        std::map<uint32_t, uint32_t> landed;  // token ranges counted beyond `prefix`
        uint32_t prefix = 0;                  // tokens [0, prefix) landed or were held
        // The lease of this producer: from the registration, renewed by its SCHEDULED (a
        // prefill still computing) and SEGMENTs.
        TimePoint deadline;
        // Chunks sent layer by layer, by token range: which layers landed.
        std::map<std::pair<uint32_t, uint32_t>, std::vector<bool>> layers_landed;
    };
    struct Consumer {
        std::vector<Slot> slots;
        TimePoint deadline;  // the latest of the slots' (waits for arrivals end by it)
        bool cancelling = false;
        Status error;
        uint64_t bytes = 0;
        uint32_t writes = 0;
        KvFrontier progress;  // last reported through on_recv_progress
        // prefill's writes need this side's polling to progress; each carries an immediate and
        // SEGMENT comes first, so the workers see them come (Expected::kSignalled) and nap
        // while prefill computes.
        ArrivalsExpected awake;
    };
    // Before registration: the prefill ranks asked to say SCHEDULED.
    struct Announce {
        std::vector<std::pair<uint32_t, PeerId>> ranks;  // (prefill rank, peer)
        std::vector<uint32_t> scheduled;
        TimePoint deadline;
    };
    Status engine_error_;                               // set by engine_failed
    TimePoint engine_fail_at_{};                        // when what is open ends with engine_error_
    using ConsumerKey = std::pair<uint64_t, uint32_t>;  // (transfer id, attempt)
    using ConsumerIt = std::map<ConsumerKey, Consumer>::iterator;
    using AnnounceIt = std::map<ConsumerKey, Announce>::iterator;

    static bool resolved(SlotState s) { return s != SlotState::kOpen; }

    void end_announce(AnnounceIt it, const Status& why, bool tell_prefill);
    void cancel_consumer(const ConsumerKey& key, Consumer& c, bool given_up);
    Slot* find_slot(const ConsumerKey& key, uint32_t producer_rank, ConsumerIt* out);
    void take_final(Consumer& c, Slot& s, const JobTotals& t);
    void on_segment_counted(const ConsumerKey& key, uint32_t rank, const SegmentMsg& m,
                            const Status& st);
    KvFrontier landed_frontier(const Consumer& c) const;
    void fail_slot(ConsumerIt it, Slot& s, const Status& why);
    void check_consumer(ConsumerIt it);
    void complete_recv(ConsumerIt it, const TransferResult& r);
    void expire_consumer(ConsumerIt it);
    void renew(Consumer& c, Slot& s);
    // Immediate spans in use: a live slot's, and a slot's whose engine waiter has not fired
    // (it would consume a new registration's arrivals).
    void hold_span(uint32_t imm);
    void release_span(uint32_t imm);
    uint32_t imm_span() const;

    ConnectorContext& ctx_;
    std::map<ConsumerKey, Announce> announces_;
    std::map<ConsumerKey, Consumer> consumers_;
    uint32_t next_imm_ = 0;
    std::map<uint32_t, uint32_t> live_spans_;  // first immediate of a span → holders
};

}  // namespace ferry::kv::detail

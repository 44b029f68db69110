// Prefill side of a push: for every transfer, the decode ranks that announced or registered it
// and the segments of writes this rank posts into their blocks as prefill makes KV final. The
// segment that drains last with the prompt complete closes the job (it carries FINAL's totals).
// Runs on the connector thread only; owns `producers_` (private to src/kv).
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "connector_context.h"

namespace ferry::kv::detail {

class PushSender {
  public:
    explicit PushSender(ConnectorContext& ctx) : ctx_(ctx) {}

    // Messages from decode ranks.
    void on_register(RegisterMsg m);
    void on_intent(IntentMsg m);
    void on_cancel(uint64_t sender, const CancelMsg& m);

    // The engine's calls, queued by KvConnector.
    void prefill_scheduled(uint64_t id);
    void prefill_progress(uint64_t id, std::vector<uint32_t> blocks, KvFrontier ready);
    void prefill_done(uint64_t id, std::vector<uint32_t> blocks, uint32_t tokens);
    void prefill_failed(uint64_t id, const Status& reason);
    void abort(uint64_t id, const Status& reason);

    // Leases: ends transfers whose lease passed; shutdown stops every job, then reports what
    // is left as cancelled.
    void expire(TimePoint now);
    void begin_shutdown();
    void report_shut_down(const Status& why);

  private:
    // One decode rank of one attempt. Its writes go out in segments, one per
    // prefill_progress (or prefill_done) that found new final tokens.
    struct SendJob {
        RegisterMsg reg;
        PeerId peer = 0;
        KvFrontier sent;          // what segments posted so far cover
        uint32_t segments = 0;    // segments posted
        uint32_t in_flight = 0;   // segments with writes not yet complete
        bool closed = false;      // the totals went out (closing SEGMENT or FINAL)
        bool cancelled = false;   // by CANCEL or a newer attempt: no FINAL
        bool ack_wanted = false;  // CANCEL came while writes were in flight
        // Nothing more will be sent for it: closed with every write complete, or answered
        // with FAIL or CANCEL_ACK.
        bool resolved = false;
        uint32_t writes = 0;
        uint64_t bytes = 0;
        Status error;
    };
    using JobKey = std::pair<uint32_t, uint32_t>;  // (attempt, decode rank)

    struct Intent {
        PeerId peer = 0;
        uint32_t decode_tp = 1;
    };

    struct Producer {
        bool have_prefill = false;
        bool scheduled = false;
        std::vector<uint32_t> blocks;
        KvFrontier ready;                  // KV that is final (progress or done)
        uint32_t tokens = 0;               // the prompt's tokens, known at prefill_done
        std::map<JobKey, Intent> intents;  // decode ranks waiting for SCHEDULED
        bool have_attempt = false;
        uint32_t attempt = 0;
        uint32_t decode_tp = 0;
        std::map<JobKey, SendJob> jobs;
        TimePoint deadline;
        // Registered, not done: when the registered decode ranks hear SCHEDULED again.
        TimePoint renew_at;
        Status failure;  // prefill_failed: later registrations get FAIL
        // Already reported; kept until the lease only to answer late messages at once: a
        // REGISTER of a newer attempt that came after the blocks were released waited for a
        // prefill_done that would never come (the whole lease).
        bool tombstone = false;
        bool served = false;           // the tombstone of a transfer that finished ok
        bool cancel_reported = false;  // on_send_cancelled went out
        // abort_send told the engine its blocks are free before the writes in flight ended:
        // they only read the blocks, for a transfer both legs of which are given up.
        bool released = false;
    };
    using ProducerIt = std::map<uint64_t, Producer>::iterator;

    // Every token of the prompt was posted: what is left to send is the totals.
    static bool all_posted(const Producer& p, const SendJob& job) {
        return p.have_prefill && job.sent == KvFrontier{p.tokens};
    }
    void mark_scheduled(uint64_t id, Producer& p);
    void renew(uint64_t id, Producer& p, TimePoint now);
    Duration renewal_period(const Producer& p) const;
    void advance_job(uint64_t id, Producer& p, JobKey key, SendJob& job);
    Status post_segment(uint64_t id, Producer& p, JobKey key, SendJob& job, const KvPiece& piece);
    void on_segment_drained(uint64_t id, JobKey key, uint32_t index, const Status& s);
    void fail_job(uint64_t id, Producer& p, JobKey key, SendJob& job, const Status& s);
    void settle_job(uint64_t id, Producer& p, JobKey key, SendJob& job);
    void maybe_finish(ProducerIt it);
    void complete_send(ProducerIt it, const TransferResult& r);
    Status finished_status(const Producer& p) const;
    void expire_producer(ProducerIt it);

    ConnectorContext& ctx_;
    std::map<uint64_t, Producer> producers_;
};

}  // namespace ferry::kv::detail

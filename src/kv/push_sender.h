// Prefill side of a push: for every transfer, the decode ranks that announced or registered it
// and the segments of writes this rank posts into their blocks as prefill makes KV final. The
// segment that drains last with the prompt complete closes the job (it carries FINAL's totals).
// A transfer's prefill and each of its jobs are an explicit state (PrefillState, SendJobState:
// docs/PROTOCOL.md, "Prefill rank", draws them), changed only through set_state.
// Runs on the connector thread only; owns `producers_` (private to src/kv).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "connector_context.h"

namespace ferry::kv::detail {

// Where prefill is with a transfer's prompt, from the engine's calls.
enum class PrefillState : uint8_t {
    kQueued,     // not scheduled yet (known from INTENT or REGISTER); registered ranks renewed
    kComputing,  // prefill_scheduled or prefill_progress: SCHEDULED went out; renewals run
    kDone,       // prefill_done: the prompt's blocks are held until every job is served
    kFailed,     // prefill_failed before prefill_done: jobs answer FAIL as their writes end
    kAborted,    // abort after prefill_done: the blocks went back at once; jobs answer FAIL
    kFinished,   // reported; kept until the lease to answer late messages (FAIL or "served")
};

// One job: the writes to one decode rank of one attempt. Open (kSending) until it is served,
// failed or cancelled; the -ing states wait for the writes in flight to end.
enum class SendJobState : uint8_t {
    kSending,     // segments go out as KV becomes final
    kClosed,      // the totals went out (closing SEGMENT or FINAL); writes in flight
    kFailing,     // an error: FAIL once no write is in flight
    kDropping,    // a newer attempt or shutdown stopped it, writes in flight: no answer owed
    kCancelling,  // CANCEL came while writes were in flight: CANCEL_ACK once they ended
    kServed,      // closed, every write complete
    kFailed,      // FAIL sent
    kCancelled,   // cancelled, nothing in flight (CANCEL_ACK sent if decode asked)
};

std::string_view to_string(PrefillState s);
std::string_view to_string(SendJobState s);

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

    // For tests and traces: the state of a transfer's prefill, and of its job for (attempt,
    // decode rank); nullopt for one this sender does not hold.
    std::optional<PrefillState> prefill_state(uint64_t id) const;
    std::optional<SendJobState> job_state(uint64_t id, uint32_t attempt,
                                          uint32_t decode_rank) const;

  private:
    // One decode rank of one attempt. Its writes go out in segments, one per
    // prefill_progress (or prefill_done) that found new final tokens.
    struct SendJob {
        RegisterMsg reg;
        PeerId peer = 0;
        SendJobState state = SendJobState::kSending;
        KvFrontier sent;         // what segments posted so far cover
        uint32_t segments = 0;   // segments posted
        uint32_t in_flight = 0;  // segments with writes not yet complete
        uint32_t writes = 0;
        uint64_t bytes = 0;
        Status error;  // the first error; FAIL carries it, the transfer's result reports it
    };
    using JobKey = std::pair<uint32_t, uint32_t>;  // (attempt, decode rank)

    struct Intent {
        PeerId peer = 0;
        uint32_t decode_tp = 1;
    };

    struct Producer {
        PrefillState state = PrefillState::kQueued;
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
        // prefill_failed or abort: later registrations get FAIL with it (also once kFinished).
        Status failure;
        bool cancel_reported = false;  // on_send_cancelled went out (decode gave up)
    };
    using ProducerIt = std::map<uint64_t, Producer>::iterator;

    // prefill_done came: the prompt's length is known and its blocks are held (or, aborted,
    // were handed back).
    static bool prompt_done(const Producer& p) {
        return p.state == PrefillState::kDone || p.state == PrefillState::kAborted;
    }
    // Every token of the prompt was posted: what is left to send is the totals.
    static bool all_posted(const Producer& p, const SendJob& job) {
        return prompt_done(p) && job.sent == KvFrontier{p.tokens};
    }
    // Nothing more will be sent for the job.
    static bool resolved(SendJobState s) {
        return s == SendJobState::kServed || s == SendJobState::kFailed ||
               s == SendJobState::kCancelled;
    }
    // The only places a state changes: an illegal transition is logged and not taken.
    void set_state(uint64_t id, Producer& p, PrefillState to);
    void set_state(uint64_t id, JobKey key, SendJob& job, SendJobState to);
    void drop_job(uint64_t id, JobKey key, SendJob& job);
    void mark_scheduled(uint64_t id, Producer& p);
    void renew(uint64_t id, Producer& p, TimePoint now);
    Duration renewal_period(const Producer& p) const;
    void advance_job(uint64_t id, Producer& p, JobKey key, SendJob& job);
    Status post_segment(uint64_t id, Producer& p, JobKey key, SendJob& job, const KvPiece& piece);
    void on_segment_drained(uint64_t id, JobKey key, uint32_t index, const Status& s);
    void fail_job(uint64_t id, Producer& p, JobKey key, SendJob& job, const Status& s);
    void fail_all(uint64_t id, Producer& p, const Status& reason);
    void settle_job(uint64_t id, Producer& p, JobKey key, SendJob& job);
    void maybe_finish(ProducerIt it);
    void complete_send(ProducerIt it, const TransferResult& r);
    Status finished_status(const Producer& p) const;
    void expire_producer(ProducerIt it);

    ConnectorContext& ctx_;
    std::map<uint64_t, Producer> producers_;
};

}  // namespace ferry::kv::detail

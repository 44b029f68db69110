// Pull: PullServer holds what prefill offered until every reader sent DONE (or the lease
// passed); Puller plans and posts decode's reads and sends the DONEs (private to src/kv).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "connector_context.h"
#include "pull_windows.h"

namespace ferry::kv::detail {

// Prefill side. Runs on the connector thread; owns `offers_`.
class PullServer {
  public:
    explicit PullServer(ConnectorContext& ctx) : ctx_(ctx) {}

    // `windows`: the offer's own registrations (PullKeys::kPerOffer), closed when it ends.
    // `params`: what offer_pull returned, the answer to a PULL_ASK while the offer runs.
    void offer(const PullParamsMsg& params, std::vector<std::unique_ptr<MemoryRegion>> windows);
    void on_done(const DoneMsg& m);
    // A decode that built its parameters from the handshake asks for the live offer's (its
    // own keys): answered with PULL_PARAMS while the offer runs, after the offer when it is
    // not made yet (within the ask's wait, capped at the lease), else with a FAIL naming why.
    void on_ask(const PullAskMsg& m);
    // abort_send of an offered transfer: the offer is withdrawn at once. False: not offered.
    bool withdraw(uint64_t id, const Status& reason);

    void expire(TimePoint now);
    void report_shut_down(const Status& why);

  private:
    struct Offer {
        TimePoint deadline;
        PullCapability capability{};  // a DONE without it is ignored
        std::vector<uint32_t> done_ranks;
        bool all_ok = true;
        ArrivalsExpected awake;  // decode's reads need this side's polling to progress
        // Closed with the offer (erasing it): a read under their keys fails from then on.
        std::vector<std::unique_ptr<MemoryRegion>> windows;
        PullParamsMsg params;  // what offer_pull returned (the answer to a PULL_ASK)
    };

    // A DONE for an offer not made yet: an engine that answers before it offers (vLLM's
    // scheduler answers, its worker offers a step later) can be read, and DONE'd, first. Kept
    // for a lease and applied by offer(); past the lease, or beyond kMaxEarlyDones, stale.
    struct EarlyDone {
        DoneMsg done;
        TimePoint deadline;
    };
    static constexpr size_t kMaxEarlyDones = 4096;

    // A PULL_ASK for an offer not made yet (vLLM: the worker offers a step after the answer).
    struct EarlyAsk {
        PeerId from = 0;
        PullAskMsg ask;
        TimePoint deadline;
    };
    static constexpr size_t kMaxEarlyAsks = 4096;
    // Offers that ended, remembered for a lease so that an ask for one is refused at once
    // (beyond kMaxEnded the ask waits for its deadline instead).
    static constexpr size_t kMaxEnded = 4096;

    void answer(PeerId from, const PullAskMsg& m, const Offer& o);
    void refuse(PeerId from, const PullAskMsg& m, const Status& why);
    void ended(uint64_t id);

    ConnectorContext& ctx_;
    std::map<uint64_t, Offer> offers_;
    std::multimap<uint64_t, EarlyDone> early_;
    std::multimap<uint64_t, EarlyAsk> asks_;
    std::map<uint64_t, TimePoint> ended_;  // id -> when it is forgotten
};

// Decode side. A pull's state is its job, held by the job's flight, so the reads can be
// planned and posted on any thread (the caller's, in PullMode::kInline); the result and the
// DONEs come on the connector thread.
class Puller {
  public:
    struct Job {
        uint64_t id = 0;
        std::vector<PullParamsMsg> params;
        std::vector<uint32_t> blocks;  // from token 0 (blocks_from_token0)
        uint32_t tokens = 0;
        uint32_t first_token = 0;  // tokens [first_token, tokens) are read
        struct Source {
            PeerId peer = 0;
            size_t param = 0;
        };
        std::vector<Source> sources;
        uint32_t reads = 0;
        uint64_t bytes = 0;
        // The reads' plans, kept until the result: a failed pull is reported (and its blocks
        // handed back) only once the engine holds no read into them.
        std::vector<TransferPlan> plans;
        bool released = false;  // the engine was asked to let go (see finish)
        bool reported = false;  // recv_done sent: what completes later is dropped
        // A read that timed out, never posted (never_posted: tcp;ofi_rxm pushes back the first
        // operations to a peer until it answers the connection) or posted and unanswered (a
        // starved prefill on a loaded host), is posted again until then: reading the same
        // bytes twice changes nothing while the offer holds them, and a read still ends before
        // the shortest of the offers' leases.
        TimePoint repost_until{};
        // When the shortest of the offers' leases ends (prefill frees the blocks itself): DONE
        // is posted again until then when the provider never took it.
        TimePoint offers_end{};
        // A read posted again after its first post timed out: the first may still land, so the
        // result waits, as a failure's does, until the engine holds no read into the blocks.
        bool late_reads = false;
        // The reads' runs split by the offer's windows (PullKeys::kPerOffer), per plan and
        // group: a read posted again points into them.
        std::vector<std::vector<std::vector<WindowRuns>>> windowed;
        // Parameters built from the handshake (ask()): the prefill ranks asked for their live
        // offer's parameters, per entry of `params`, and when decode stops waiting.
        struct Asked {
            PeerId peer = 0;
            bool answered = false;  // a part came: its offer runs (give_up ends it)
            WindowParts parts;      // complete once every part came
        };
        std::vector<Asked> asked;
        TimePoint ask_deadline{};
    };

    explicit Puller(ConnectorContext& ctx) : ctx_(ctx) {}

    // Touches no connector state, only the job, the engine and atomics.
    void start(const std::shared_ptr<Job>& job);
    // Connector thread. The job's parameters were built from the handshake: each prefill rank
    // is asked for its live offer's (PULL_ASK, waiting up to `wait` for an offer not made yet);
    // the reads start once every rank answered, under the offer's own keys. A refusal, or no
    // answer within `wait` plus the op timeout, fails the pull; nothing is read.
    void ask(const std::shared_ptr<Job>& job, Duration wait);
    // `sender`: the engine id the message came from (TransferEngine::find_peer).
    void on_params(uint64_t sender, const PullParamsMsg& m);
    // A FAIL from prefill: true when it refused one of our asks (the pull failed).
    bool on_refused(uint64_t sender, const FailMsg& m);
    void expire(TimePoint now);
    void report_shut_down(const Status& why);
    // Connector thread. The process at `peer` is gone (KvConnector::peer_gone): the pulls
    // reading from it fail now with `why`, and their blocks are handed back at once, as a gone
    // process can serve no read into them; the reads themselves end at the engine's
    // op_timeout, unheard.
    void peer_gone(PeerId peer, const Status& why);

  private:
    void finish(const std::shared_ptr<Job>& job, const Status& s);
    // A pull that asked (ask()) and will not read: fails it, ending the offers that answered.
    void give_up(const std::shared_ptr<Job>& job, const Status& why);
    // Posts one read of the job into `flight`, again after a timeout (see Job::repost_until).
    // `context` (may be null) is added to a failed read's status.
    void post_read(const std::shared_ptr<Job>& job, const ReadRunsOp& op,
                   const std::shared_ptr<Flight>& flight, uint32_t tries, const char* context);

    ConnectorContext& ctx_;
    // Connector thread's: the pulls posted and not reported, for peer_gone.
    std::vector<std::weak_ptr<Job>> running_;
    // Connector thread's: the pulls waiting for their PULL_ASK answers.
    std::map<uint64_t, std::shared_ptr<Job>> asking_;
};

}  // namespace ferry::kv::detail

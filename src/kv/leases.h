// Leases and shutdown (private to src/kv). Every role keeps its transfers' deadlines with the
// transfers (a deadline is renewed by the role's own progress: prefill_progress, a registration);
// Leases decides when they are checked and runs the shutdown sequence over all roles: stop every
// job, wait (bounded) for the writes and reads in flight, report what is left as cancelled.
#pragma once

#include "pull.h"
#include "push_receiver.h"
#include "push_sender.h"

namespace ferry::kv::detail {

class Leases {
  public:
    // How often leases are checked when nothing else happens.
    static constexpr Duration kTick = std::chrono::milliseconds(5);

    Leases(ConnectorContext& ctx, PushSender& sender, PushReceiver& receiver, PullServer& server,
           Puller& puller)
        : ctx_(ctx), sender_(sender), receiver_(receiver), server_(server), puller_(puller) {}

    // Connector thread, after every batch of tasks and at least every kTick.
    void sweep(TimePoint now);
    // The engine lost a rail for good (TransferEngine::health): what waits for arrivals ends
    // with `why` instead of at its lease; what this side posts fails with the rail already.
    void engine_failed(const Status& why, TimePoint now);
    // Cancels every transfer; flights drain until the engine's op_timeout (plus a second).
    void begin_shutdown();
    // True once shutdown began and no flight is open, or the drain deadline passed.
    bool shut_down(TimePoint now) const;
    // Reports every transfer still open as cancelled; the thread then ends.
    void report_all_as_shut_down();

  private:
    ConnectorContext& ctx_;
    PushSender& sender_;
    PushReceiver& receiver_;
    PullServer& server_;
    Puller& puller_;
    bool stopping_ = false;
    TimePoint shutdown_deadline_;
};

}  // namespace ferry::kv::detail

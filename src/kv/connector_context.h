// What the connector's roles share (private to src/kv): the engine, the pool, the config and
// callbacks, the inbox into the connector thread and the counters. The connector owns one;
// every role holds a reference. Nothing here is a transfer's state: that belongs to the role
// that runs the transfer (PushSender, PushReceiver, PullServer, Puller).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include "ferry/common/spin.h"
#include "ferry/kv/connector.h"
#include "ferry/kv/pool.h"
#include "transfer_ids.h"

namespace ferry::kv::detail {

inline constexpr const char* kLog = "kv";

// FERRY_KV_TRACE=1: one line per step of a transfer on stderr (the step, the transfer id, us
// of the steady clock, the time base of FERRY_GPU_TRACE; for tasks, how long they waited in the
// inbox), to see where a transfer's time goes between threads without a profiler.
bool kv_trace_on();
void kv_trace(const char* what, uint64_t id);

// Hand-off queue into the connector thread, and the lock that says who runs the connector's
// state machines. Engine callbacks hold it through a shared_ptr, so a completion that arrives
// after the connector is gone is dropped instead of touching freed state.
//
// Ownership: every role's state is touched only by the holder of the state lock. The connector
// thread holds it whenever it is not waiting for tasks. A public call runs its task on its own
// thread (try_run_here) only while that thread sleeps with nothing queued: it takes the lock
// without blocking, so the task runs after everything queued before it, and a call never waits
// for the connector. Waking the sleeping thread cost 6-13 us of a push's start (docs/
// BENCHMARKS.md, "KV push start-up"). User callbacks of a task run on the caller's thread are
// posted, so the callbacks still come on the connector thread only.
class Inbox {
  public:
    using Task = std::function<void()>;

    bool post(Task t);
    // Runs `t` here and now if the connector thread sleeps, nothing is queued, the inbox is
    // open and this thread does not already hold the state lock; false leaves `t` untouched.
    bool try_run_here(Task& t);
    // Connector thread: with `state` (the state lock) held, waits for tasks without it, polling
    // up to `poll_until` before it sleeps until `until`, and takes the queued ones with the lock
    // held again.
    std::deque<Task> take(std::unique_lock<std::mutex>& state, TimePoint until,
                          TimePoint poll_until = {});
    void close();

    std::mutex& state_lock() { return state_mu_; }
    // True on a caller's thread while it runs a task in place of the connector thread.
    static bool running_here();

  private:
    std::atomic<size_t> queued_{0};  // tasks_.size(), read without the lock while polling
    std::atomic<bool> sleeping_{false};
    std::mutex state_mu_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Task> tasks_;
    bool closed_ = false;
};

// The operations of one job in flight: each completion decrements, the last one posts a
// single task to the connector thread (one task per job, not per write).
struct Flight : std::enable_shared_from_this<Flight> {
    explicit Flight(std::function<void(const Status&)> drained) : on_drained(std::move(drained)) {}

    void add() { outstanding.fetch_add(1, std::memory_order_relaxed); }
    void done(const Status& s);

    std::atomic<uint32_t> outstanding{1};  // the poster holds one until everything is posted
    std::mutex mu;
    Status error;
    std::function<void(const Status&)> on_drained;
};

// Read from any thread by stats(); written by the roles.
struct Counters {
    std::atomic<uint64_t> messages_received{0}, messages_malformed{0}, messages_stale{0};
    std::atomic<uint64_t> leases_expired{0}, transfers_sent{0}, transfers_received{0};
    std::atomic<uint64_t> transfers_failed{0}, ops_posted{0}, bytes_posted{0};
    std::atomic<uint64_t> active_send{0}, active_recv{0};

    ConnectorStats snapshot() const;
};

class ConnectorContext {
  public:
    ConnectorContext(TransferEngine* engine, KvPoolRegions pool, const ConnectorConfig& config,
                     ConnectorCallbacks callbacks)
        : engine(engine),
          pool(std::move(pool)),
          pool_descriptors(this->pool.descriptors()),
          cfg(config),
          cb(std::move(callbacks)),
          inbox(std::make_shared<Inbox>()),
          poll_spin(usable_cpus() >= IdleWait::kSpinFromCpus ? cfg.idle_spin : Duration::zero()) {}

    // Queues a task for the connector thread; fails once the connector is shut down.
    Status post(Inbox::Task t);
    // A public call's task: run on the caller's thread when the connector thread sleeps
    // (Inbox::try_run_here), queued otherwise.
    Status run_or_post(Inbox::Task t);
    // Sends a KV message; a failed send is logged (the peer's lease covers a lost message).
    // `still_wanted`, when given, is asked on the connector thread (state lock held) after a
    // send the provider never took (never_posted: tcp;ofi_rxm pushes the first send to a peer
    // back until that peer answers the connection, which a loaded peer did only after
    // op_timeout): while it returns true the message is posted again, so that a transfer's
    // REGISTER is not lost while its transfer still waits for it (issue 32).
    void send(PeerId peer, const KvMessage& msg, std::function<bool()> still_wanted = {});
    // Starts a flight whose completion runs `drained` on the connector thread.
    std::shared_ptr<Flight> new_flight(std::function<void(const Status&)> drained);
    void stale(std::string_view what);

    // Report to the engine's callbacks, always on the connector thread (posted when a task
    // runs on a caller's thread).
    void send_done(const TransferResult& r);
    void recv_done(const TransferResult& r);
    void scheduled(const TransferResult& r);
    void send_cancelled(const TransferResult& r);
    void recv_progress(const TransferProgress& p);

    TransferEngine* const engine;
    const KvPoolRegions pool;  // region i holds layout region i
    const std::vector<MemoryDescriptor> pool_descriptors;
    const ConnectorConfig cfg;
    const ConnectorCallbacks cb;
    const std::shared_ptr<Inbox> inbox;
    Counters counters;
    TransferIds ids;  // claimed by the public calls, released where a transfer is reported
    std::atomic<uint64_t> flights_open{0};
    // How long the connector thread polls after a task while active() (ConnectorConfig::
    // idle_spin); zero where polling threads would outnumber the cores.
    const Duration poll_spin;

    // Writes in flight, or a send or receive not finished.
    bool active() const;

  private:
    void send_encoded(PeerId peer, std::vector<uint8_t> bytes, const char* name,
                      std::function<bool()> still_wanted, uint32_t tries);
};

// Checks a block list against the pool before any work is queued. `first_token` > 0: the list
// starts at that token's block (decode's prefix cache holds the tokens before it); it may
// equal num_tokens (everything is cached: no block is needed).
Status check_blocks(const KvLayout& layout, const std::vector<uint32_t>& blocks,
                    uint32_t num_tokens, uint32_t first_token = 0);
// A block list that starts at `first_token`'s block as the planner takes it, from token 0: the
// blocks before are filled with blocks[0] (or 0), which a plan from first_token never touches.
std::vector<uint32_t> blocks_from_token0(const std::vector<uint32_t>& blocks, uint32_t first_token,
                                         uint32_t block_size);
uint32_t to_ms_u32(Duration d);

}  // namespace ferry::kv::detail

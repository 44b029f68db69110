// A KV connector between engines in one process: it really copies the KV bytes from the
// prefill engine's pool into the decode engine's pool, with the same hand-over rules the
// libfabric connectors follow (rendezvous by transfer id in either order, release exactly once,
// leases, cancellation before reuse). It exists so the engine loop, the HTTP layer and the load
// generator can be tested end to end before the network connector is plugged in; it does not
// stand in for it in benchmarks.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "ferry/common/clock.h"
#include "ferry/kv/transfer_mode.h"
#include "serve/kv_connector.h"

namespace ferry::serve {

struct InProcessKvLinkConfig {
    // kPush: decode's allocation and prefill's completion meet, the second starts the copy;
    // kPull: decode reads after prefill finished, on the link's thread; kPullInline: decode
    // reads in the engine loop that calls on_blocks_allocated (the baseline).
    kv::TransferMode mode = kv::TransferMode::kPush;
    // How long one side waits for the other before giving up and releasing its blocks: the
    // engines' KV wait, serve::kv_lease(EngineConfig), as `ferry serve local` sets it.
    Duration lease = seconds(30);
};

class InProcessKvLink {
  public:
    explicit InProcessKvLink(InProcessKvLinkConfig config);
    ~InProcessKvLink();
    InProcessKvLink(const InProcessKvLink&) = delete;
    InProcessKvLink& operator=(const InProcessKvLink&) = delete;

    // Registers an engine's pool; the pool must outlive stop().
    Status add_engine(const std::string& engine_id, KvPool* pool);
    KvProducer* producer(const std::string& engine_id);
    KvConsumer* consumer(const std::string& engine_id);

    Status start();
    // Fails everything pending with kCancelled and joins the copy thread.
    void stop();

    uint64_t bytes_copied() const;

  private:
    class Producer;
    class Consumer;
    struct Endpoint;
    struct PrefillSide {
        Endpoint* ep;
        std::vector<BlockId> blocks;
        size_t tokens;
        KvDoneCallback release;
        TimePoint deadline;
    };
    struct DecodeSide {
        Endpoint* ep;
        std::vector<BlockId> blocks;
        size_t tokens;
        KvDoneCallback arrived;
        TimePoint deadline;
        bool cancelled = false;
    };
    struct Job {
        std::string key;
        PrefillSide src;
        DecodeSide dst;
    };

    Result<KvTransferParams> prefill_done(Endpoint* ep, const std::string& transfer,
                                          const KvTransferParams& params,
                                          std::vector<BlockId> blocks, size_t tokens,
                                          KvDoneCallback release);
    Status blocks_allocated(Endpoint* ep, const std::string& transfer,
                            const KvTransferParams& params, std::vector<BlockId> blocks,
                            size_t tokens, KvDoneCallback arrived);
    void cancel(Endpoint* ep, const std::string& transfer);
    // The prefill side of a transfer given up (KvProducer::on_transfer_aborted).
    void abort_prefill(Endpoint* ep, const std::string& transfer, const Status& why);
    // Copies the prompt's blocks; returns what the decode side should hear.
    Status copy(const PrefillSide& src, const DecodeSide& dst);
    void run();

    const InProcessKvLinkConfig config_;
    std::map<std::string, std::unique_ptr<Endpoint>> endpoints_;

    mutable std::mutex mu_;
    std::condition_variable cv_;
    bool running_ = false;
    std::map<std::string, PrefillSide> prefills_;   // by transfer id
    std::map<std::string, DecodeSide> decodes_;     // by transfer id
    std::set<std::string> in_flight_;               // transfer ids being copied
    std::map<std::string, bool> cancel_in_flight_;  // transfer id -> cancelled while copying
    std::deque<Job> jobs_;
    uint64_t bytes_copied_ = 0;
    std::thread thread_;
};

}  // namespace ferry::serve

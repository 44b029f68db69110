// The host proxy: one thread per rank between the compute side and the TransferEngine.
//
// Compute side -> fabric: "buffer ready" requests (a put of staging bytes into a remote
// peer's region) are queued here and turned into TransferEngine writes carrying an immediate
// that names (region, sender). Fabric -> compute side: the proxy drains immediate arrivals
// from the engine and adds them to the rank's arrival counters, the same counters same-node
// peers bump directly, so the compute side waits on one place for every peer.
//
// The queue is a locked deque fed by the CPU backend. The CUDA backend has a proxy of its own
// (src/moe/device_proxy.h), fed by records its kernels publish in mapped host memory.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/moe/transport.h"

namespace ferry::moe {

struct PutRequest {
    uint32_t peer = 0;  // rank
    Region region = Region::kCounts;
    uint64_t dst_offset = 0;
    uint64_t src_offset = 0;
    uint64_t len = 0;
};

// Where a remote rank's regions are, as the engine sees them.
struct RemoteRank {
    PeerId peer = 0;
    MemoryDescriptor shared;                 // the rank's peer-visible memory
    uint64_t recv_offset[kNumRegions] = {};  // region starts inside it
};

// Writes carrying the immediate that one engine write of len bytes puts on the wire (the
// engine splits long writes per rail and at max_write_size). Sender and receiver must agree,
// so AllToAll checks at setup that every rank's engine splits the same way.
uint64_t write_pieces(const EngineConfig& config, int num_rails, uint64_t len);

class HostProxy {
  public:
    struct Setup {
        TransferEngine* engine = nullptr;
        uint32_t rank = 0;
        uint32_t world = 0;
        uint32_t imm_base = 0;
        ArrivalBlock arrivals;                    // this rank's counters
        const MemoryRegion* stage = nullptr;      // staging buffers, registered
        uint64_t stage_offset[kNumRegions] = {};  // region staging starts inside it
        std::vector<bool> remote;                 // [world] peers reached through the engine
        std::vector<RemoteRank> peers;            // [world], valid where remote
    };

    explicit HostProxy(Setup setup);
    ~HostProxy();  // stops and joins the thread
    HostProxy(const HostProxy&) = delete;
    HostProxy& operator=(const HostProxy&) = delete;

    // The immediate a put of `region` from `sender` carries.
    static uint32_t imm_for(uint32_t base, Region region, uint32_t sender) {
        return base + static_cast<uint32_t>(region) * kMaxWorldSize + sender;
    }

    void start();
    void stop();

    // Queues a put; fails at once when the proxy already failed or stopped.
    Status enqueue(const PutRequest& put);
    // Waits until every queued put completed at the fabric level (staging reusable).
    Status flush(TimePoint deadline);
    // The first failure of a fabric operation, or ok.
    Status error() const;

  private:
    void loop();
    bool drain_arrivals();
    bool reap(bool* failed);
    void record(const Status& s);

    Setup s_;
    std::vector<uint32_t> watch_imm_;  // immediates of (region, remote sender)
    std::vector<std::pair<Region, uint32_t>> watch_;

    mutable std::mutex mu_;
    std::condition_variable cv_;       // wakes the loop on new work or stop
    std::condition_variable idle_cv_;  // wakes flush when in-flight work drops to zero
    std::deque<PutRequest> queue_;
    uint64_t pending_ = 0;  // queued + in flight
    bool stop_ = false;
    Status error_;

    std::vector<OpHandle> inflight_;  // owned by the loop thread
    std::thread thread_;
};

}  // namespace ferry::moe

// How the all-to-all's bytes reach a peer. The protocol (CpuBackend) only needs: this rank's
// receive regions and staging buffers, a put that copies staging bytes into a peer's region
// and then counts one arrival there, and a bounded wait on arrivals.
//
// MappedTransport serves peers whose memory this process can address: threads of one process
// (the single-process reference) or ranks of one node through POSIX shared memory. Remote
// peers go through the TransferEngine behind the same interface.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/moe/plan.h"

namespace ferry::moe {

// Peer-writable regions of a rank; also names the arrival counters (one per region and
// sender) and the staging buffer that feeds writes into that region of a peer.
enum class Region : uint8_t { kCounts = 0, kDispatch = 1, kCombine = 2 };
inline constexpr int kNumRegions = 3;
const char* region_name(Region r);

class Transport {
  public:
    virtual ~Transport() = default;

    virtual std::span<uint8_t> recv(Region r) = 0;
    virtual std::span<uint8_t> stage(Region r) = 0;

    // Copies len bytes at src_offset of stage(region) into peer's recv(region) at dst_offset,
    // then counts one arrival of (region, this rank) at peer, visible only after the bytes
    // are. len may be 0: a pure signal. Completes asynchronously on some transports: call
    // flush() before rewriting the staging bytes.
    virtual Status put(uint32_t peer, Region region, uint64_t dst_offset, uint64_t src_offset,
                       uint64_t len) = 0;
    // Arrivals that one put of len bytes from rank `from` counts here: 1 for mapped peers;
    // fabric writes may be split into pieces that each carry the immediate.
    virtual uint64_t arrivals_for(uint32_t from, uint64_t len) const { return 1; }
    // Waits until `count` arrivals of (region, from) are available here and consumes them.
    // Credits: arrivals of a later call that come early are kept for that call.
    virtual Status wait(Region region, uint32_t from, uint64_t count, TimePoint deadline) = 0;
    // Waits until every put so far has finished reading its staging bytes.
    virtual Status flush(TimePoint deadline) = 0;
};

// Arrival counters of one rank, written by peers: [region][sender]. Lives inside the memory
// peers map (heap for threads, shared memory for processes): lock-free 64-bit atomics work
// across processes.
struct ArrivalBlock {
    static size_t bytes(uint32_t world) {
        return sizeof(std::atomic<uint64_t>) * kNumRegions * world;
    }
    std::atomic<uint64_t>* counters = nullptr;
    uint32_t world = 0;
    std::atomic<uint64_t>& at(Region r, uint32_t sender) const {
        return counters[static_cast<size_t>(r) * world + sender];
    }
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// What a rank exposes to mapping peers: its receive regions and arrival counters.
struct MappedPeer {
    uint8_t* recv[kNumRegions] = {nullptr, nullptr, nullptr};
    ArrivalBlock arrivals;
    bool mapped() const { return arrivals.counters != nullptr; }
};

// One rank's memory in a single allocation, in this order: arrival counters, the receive
// regions (all peer-visible), then the staging buffers. `base` is owned by the caller (heap
// or a shared-memory mapping) and must be zeroed and 64-byte aligned.
struct RankMemoryLayout {
    size_t arrivals = 0;
    size_t recv_offset[kNumRegions] = {};
    size_t stage_offset[kNumRegions] = {};
    size_t recv_size[kNumRegions] = {};
    size_t stage_size[kNumRegions] = {};
    size_t shared_bytes = 0;  // arrivals + receive regions: what peers map
    size_t total_bytes = 0;
    static RankMemoryLayout of(const AllToAllConfig& cfg);
    MappedPeer peer_view(uint8_t* base, uint32_t world) const;
};

// Transport among peers that are all mapped into this process. put is a memcpy followed by
// a release increment of the peer's counter; wait spins with acquire loads, yielding the core
// (the test machines run more ranks than cores).
class MappedTransport : public Transport {
  public:
    // peers[r] for every rank; each must be mapped.
    MappedTransport(uint32_t rank, std::vector<MappedPeer> peers,
                    std::span<uint8_t> stage[kNumRegions], std::span<uint8_t> recv[kNumRegions]);

    std::span<uint8_t> recv(Region r) override { return recv_[static_cast<int>(r)]; }
    std::span<uint8_t> stage(Region r) override { return stage_[static_cast<int>(r)]; }
    Status put(uint32_t peer, Region region, uint64_t dst_offset, uint64_t src_offset,
               uint64_t len) override;
    Status wait(Region region, uint32_t from, uint64_t count, TimePoint deadline) override;
    Status flush(TimePoint) override { return ok_status(); }

  protected:
    Status check_put(uint32_t peer, Region region, uint64_t dst_offset, uint64_t src_offset,
                     uint64_t len) const;
    // Checked while waiting, so a failure elsewhere (a fabric write that failed) ends the
    // wait at once instead of at the deadline.
    virtual Status health() const { return ok_status(); }

  private:
    uint32_t rank_;
    std::vector<MappedPeer> peers_;
    std::span<uint8_t> stage_[kNumRegions];
    std::span<uint8_t> recv_[kNumRegions];
    std::vector<uint64_t> consumed_;  // [region][sender]
};

// Spins until pred() holds or the deadline passes; backs off from pause to yield to short
// sleeps so oversubscribed ranks make progress.
template <typename Pred>
bool spin_until(Pred pred, TimePoint deadline) {
    for (uint32_t i = 0;; ++i) {
        if (pred()) return true;
        if ((i & 63) == 63 && Clock::now() > deadline) return pred();
        if (i < 64) continue;
        if (i < 4096) {
            std::this_thread::yield();
        } else {
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    }
}

}  // namespace ferry::moe

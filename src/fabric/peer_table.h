// The peers an engine is connected to (their address on every local rail) and the groups of
// peers that scatter and barrier address. Operations look peers up without a lock.
#pragma once

#include <rdma/fabric.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "fabric/cma_fence.h"
#include "fabric/rail_group.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/fabric/types.h"

namespace ferry::detail {

struct Peer {
    PeerId id = 0;
    uint64_t engine_id = 0;
    EngineAddress address;
    size_t peer_rails = 0;  // how many rails the peer has
    // [local rail * peer_rails + peer rail]: every local rail holds the address of every peer
    // rail, so a transfer can go from the NIC near the local memory to the peer's NIC near the
    // remote memory (RailRoute), as NIXL's LIBFABRIC backend inserts all of a peer's rails.
    std::vector<fi_addr_t> fi_addr;
    // shm: the pid in the peer's endpoint name, the process the provider delivers to.
    long shm_pid = 0;
    // Whether this engine's writes into the peer's host memory go by process_vm_writev, and
    // the start time of the peer's process checked then (CmaPath::usable decides once).
    mutable std::atomic<uint8_t> cma{0};
    mutable std::atomic<uint64_t> cma_start{0};
    // The peer's fence mapped here (set before `cma` says kCopies, never changed after).
    mutable std::shared_ptr<const CmaFenceView> cma_fence;

    fi_addr_t addr(int local_rail, int peer_rail) const {
        return fi_addr[static_cast<size_t>(local_rail) * peer_rails + peer_rail];
    }
    // The peer rail that local rail `l` signals and sends control messages to: same index.
    int matching_rail(int l) const { return static_cast<int>(l % peer_rails); }
    uint64_t signal_key(int peer_rail) const {
        const auto& k = address.signal.rail_keys;
        return k.empty() ? 0 : k[peer_rail % k.size()];
    }
    // The peer's rails nearest `d`, a region of this peer (only rails the peer has).
    RailSet near_rails(const MemoryDescriptor& d) const {
        const RailSet have = peer_rails >= 64 ? ~RailSet{0} : (RailSet{1} << peer_rails) - 1;
        const RailSet held = d.held_rails() & have;
        return (d.near_rails() & have) ? d.near_rails() & have : held;
    }
};

// Immutable once created. Besides the members and their descriptors, everything a scatter or
// barrier puts in a post is laid out here once, at creation: per member its peer, the wire
// address and length of its region and its signal region, and the peer's rails near the
// region. A scatter then validates and builds each slice from one row instead of looking up
// the peer, its descriptor and the path per slice.
struct GroupMember {
    PeerId peer = 0;
    const Peer* p = nullptr;     // peers stay once connected
    uint64_t dst_wire_base = 0;  // wire address of byte 0 of the member's region
    uint64_t dst_length = 0;
    uint64_t signal_wire = 0;            // wire address of the member's signal region
    bool host_reachable = false;         // host memory here can write it over the fabric
    RailSet near = 0;                    // the peer's rails near the member's region
    const uint64_t* dst_keys = nullptr;  // per peer rail (the member's descriptor)
};

struct Group {
    std::vector<PeerId> peers;
    std::vector<MemoryDescriptor> dsts;
    std::vector<GroupMember> members;
};

class PeerTable {
  public:
    static constexpr size_t kMaxPeers = 1 << 14;
    static constexpr size_t kMaxGroups = 1 << 12;

    PeerTable();

    // Inserts every rail's address of the peer on every local rail (one task per local rail);
    // connecting twice returns the same id. Logs the peer's rails at info, as engine `self`.
    Result<PeerId> connect(const EngineAddress& a, RailGroup& rails, uint64_t self);
    std::optional<PeerId> find(uint64_t engine_id) const;
    // Lock-free; null when no peer has that id. A peer, once connected, stays. Inline: every
    // write and read looks its peer up (a call was ~7 instructions per 64 B write, 2026-12-02).
    const Peer* peer(PeerId id) const {
        if (id >= kMaxPeers) return nullptr;
        return peer_table_[id].load(std::memory_order_acquire);
    }

    Result<GroupId> create_group(std::span<const PeerId> peers,
                                 std::span<const MemoryDescriptor> dsts);
    // Null when no group has that id. A group, once created, stays.
    const Group* group(GroupId id) const;

  private:
    // Takes the addresses a connect inserted on its first rails back out of them, when a
    // later rail refused the peer's address.
    static void forget_addresses(const Peer& p, RailGroup& rails);

    mutable std::mutex peers_mu_;
    std::vector<std::unique_ptr<Peer>> peers_owned_;
    std::unique_ptr<std::atomic<const Peer*>[]> peer_table_;
    std::unordered_map<uint64_t, PeerId> by_engine_;

    mutable std::mutex groups_mu_;
    std::vector<std::unique_ptr<Group>> groups_;
};

}  // namespace ferry::detail

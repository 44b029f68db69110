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

#include "fabric/rail_group.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/fabric/types.h"

namespace ferry::detail {

struct Peer {
    PeerId id = 0;
    uint64_t engine_id = 0;
    EngineAddress address;
    std::vector<fi_addr_t> fi_addr;     // per local rail
    std::vector<uint32_t> remote_rail;  // per local rail: which of the peer's rails it talks to
    bool same_rails = false;            // remote_rail[r] == r for every local rail

    // The local rails whose peer rail holds `d`, a region of this peer.
    RailSet rails_holding(const MemoryDescriptor& d) const {
        const size_t n = d.rail_keys.size();
        const RailSet keyed = n >= 64 ? ~RailSet{0} : (RailSet{1} << n) - 1;
        if (same_rails) return d.rail_mask & keyed;
        RailSet s = 0;
        for (size_t r = 0; r < remote_rail.size(); ++r) {
            if (d.on_rail(remote_rail[r])) s |= RailSet{1} << r;
        }
        return s;
    }
};

// Immutable once created. Besides the members and their descriptors, everything a scatter or
// barrier puts in a post is laid out here once, at creation: per member the wire address and
// length of its region and its signal region, per (member, rail) the fabric address and keys.
// A scatter then validates and builds each slice from one cache-friendly row instead of
// looking up the peer, its descriptor and the path per slice.
struct GroupMember {
    PeerId peer = 0;
    uint64_t dst_wire_base = 0;  // wire address of byte 0 of the member's region
    uint64_t dst_length = 0;
    uint64_t signal_wire = 0;     // wire address of the member's signal region
    bool host_reachable = false;  // host memory here can write it over the fabric
    RailSet rails = 0;            // local rails whose peer rail holds the member's region
};

struct Group {
    std::vector<PeerId> peers;
    std::vector<MemoryDescriptor> dsts;
    size_t rails = 0;
    std::vector<GroupMember> members;
    std::vector<fi_addr_t> addr;       // [member * rails + local rail]
    std::vector<uint64_t> dst_key;     // [member * rails + local rail]
    std::vector<uint64_t> signal_key;  // [member * rails + local rail]
    size_t at(size_t member, size_t rail) const { return member * rails + rail; }
};

class PeerTable {
  public:
    static constexpr size_t kMaxPeers = 1 << 14;
    static constexpr size_t kMaxGroups = 1 << 12;

    PeerTable();

    // Inserts the peer's address on every rail (local rail r talks to the peer's rail
    // r % its rail count); connecting twice returns the same id.
    Result<PeerId> connect(const EngineAddress& a, RailGroup& rails);
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

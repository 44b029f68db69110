#include "fabric/peer_table.h"

#include <fmt/format.h>

#include "ferry/common/log.h"

namespace ferry::detail {

PeerTable::PeerTable() : peer_table_(std::make_unique<std::atomic<const Peer*>[]>(kMaxPeers)) {}

Result<PeerId> PeerTable::connect(const EngineAddress& a, RailGroup& rails, uint64_t self) {
    std::lock_guard lk(peers_mu_);
    if (auto it = by_engine_.find(a.engine_id); it != by_engine_.end()) return it->second;
    if (peers_owned_.size() >= kMaxPeers) {
        return resource_exhausted(fmt::format("too many peers (limit {})", kMaxPeers));
    }
    if (a.rail_addrs.empty() || a.rail_addrs.size() > 64) {
        return invalid_argument(
            fmt::format("engine {:x} gives {} rail addresses (1 to 64 expected)", a.engine_id,
                        a.rail_addrs.size()));
    }
    auto p = std::make_unique<Peer>();
    p->id = static_cast<PeerId>(peers_owned_.size());
    p->engine_id = a.engine_id;
    p->address = a;
    p->peer_rails = a.rail_addrs.size();
    p->shm_pid = shm_name_pid(a.rail_addrs[0]);
    p->fi_addr.reserve(rails.size() * p->peer_rails);
    for (auto& rail : rails) {
        Rail* rp = rail.get();
        // One task inserts every peer rail; one that fails part way takes back what it
        // inserted, and one that finishes after connect gave up on it takes back all.
        Result<std::vector<fi_addr_t>> fa = rp->run_on_worker<std::vector<fi_addr_t>>(
            [rp, addrs = a.rail_addrs]() -> Result<std::vector<fi_addr_t>> {
                std::vector<fi_addr_t> out;
                for (const auto& addr : addrs) {
                    Result<fi_addr_t> one = rp->insert_address(addr);
                    if (!one.ok()) {
                        for (fi_addr_t f : out) (void)rp->remove_address(f);
                        return one.status().with_context(
                            fmt::format("the peer's rail {}", out.size()));
                    }
                    out.push_back(*one);
                }
                return out;
            },
            kRailTaskTimeout,
            [rp](std::vector<fi_addr_t>& late) {
                for (fi_addr_t f : late) (void)rp->remove_address(f);
            });
        if (!fa.ok()) {
            forget_addresses(*p, rails);
            return fa.status().with_context(fmt::format("connecting to engine {:x}", a.engine_id));
        }
        p->fi_addr.insert(p->fi_addr.end(), fa->begin(), fa->end());
    }
    // Greppable next to the rail and region lines (docs/ARCHITECTURE.md, "Rails and topology").
    log(rails.size() > 1 || p->peer_rails > 1 ? LogLevel::kInfo : LogLevel::kDebug, "fabric",
        "engine {:x}: peer {} (engine {:x}): each of {} local rails reaches its {} rails", self,
        p->id, a.engine_id, rails.size(), p->peer_rails);
    PeerId id = p->id;
    peer_table_[id].store(p.get(), std::memory_order_release);
    by_engine_[a.engine_id] = id;
    peers_owned_.push_back(std::move(p));
    return id;
}

void PeerTable::forget_addresses(const Peer& p, RailGroup& rails) {
    for (size_t r = 0; r * p.peer_rails < p.fi_addr.size(); ++r) {
        Rail* rp = &rails[r];
        std::vector<fi_addr_t> fa(p.fi_addr.begin() + r * p.peer_rails,
                                  p.fi_addr.begin() + (r + 1) * p.peer_rails);
        Status s = rp->run_on_worker(
            [rp, fa] {
                Status first = ok_status();
                for (fi_addr_t f : fa) {
                    Status one = rp->remove_address(f);
                    if (first.ok() && !one.ok()) first = one;
                }
                return first;
            },
            kRailTaskTimeout);
        if (!s.ok()) {
            log(LogLevel::kWarn, "fabric",
                "rail {}: taking back the addresses of engine {:x} after a failed connect: {}", r,
                p.engine_id, s.message());
        }
    }
}

std::optional<PeerId> PeerTable::find(uint64_t engine_id) const {
    std::lock_guard lk(peers_mu_);
    auto it = by_engine_.find(engine_id);
    if (it == by_engine_.end()) return std::nullopt;
    return it->second;
}

Result<GroupId> PeerTable::create_group(std::span<const PeerId> peers,
                                        std::span<const MemoryDescriptor> dsts) {
    if (peers.size() != dsts.size()) {
        return invalid_argument(fmt::format("group of {} peers needs {} descriptors, got {}",
                                            peers.size(), peers.size(), dsts.size()));
    }
    auto g = std::make_unique<Group>();
    for (size_t i = 0; i < peers.size(); ++i) {
        const Peer* p = peer(peers[i]);
        if (!p) return not_found(fmt::format("group member {} is not a connected peer", peers[i]));
        if (dsts[i].engine_id != p->engine_id) {
            return invalid_argument(fmt::format(
                "group member {}: descriptor belongs to engine {:x}, peer is engine {:x}", i,
                dsts[i].engine_id, p->engine_id));
        }
        g->peers.push_back(peers[i]);
        g->dsts.push_back(dsts[i]);
        const MemoryDescriptor& d = dsts[i];
        GroupMember m;
        m.peer = peers[i];
        m.p = p;
        m.dst_wire_base = d.wire_address(0);
        m.dst_length = d.length;
        m.signal_wire = p->address.signal.wire_address(0);
        m.host_reachable = !d.rail_keys.empty();
        m.near = p->near_rails(d);
        g->members.push_back(m);
    }
    // The descriptors no longer move.
    for (size_t i = 0; i < g->members.size(); ++i)
        g->members[i].dst_keys = g->dsts[i].rail_keys.data();
    std::lock_guard lk(groups_mu_);
    if (groups_.size() >= kMaxGroups) return resource_exhausted("too many peer groups");
    groups_.push_back(std::move(g));
    return static_cast<GroupId>(groups_.size() - 1);
}

const Group* PeerTable::group(GroupId id) const {
    std::lock_guard lk(groups_mu_);
    return id < groups_.size() ? groups_[id].get() : nullptr;
}

}  // namespace ferry::detail

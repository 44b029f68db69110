#include "fabric/peer_table.h"

#include <fmt/format.h>

#include "ferry/common/log.h"

namespace ferry::detail {

PeerTable::PeerTable() : peer_table_(std::make_unique<std::atomic<const Peer*>[]>(kMaxPeers)) {}

Result<PeerId> PeerTable::connect(const EngineAddress& a, RailGroup& rails) {
    std::lock_guard lk(peers_mu_);
    if (auto it = by_engine_.find(a.engine_id); it != by_engine_.end()) return it->second;
    if (peers_owned_.size() >= kMaxPeers) {
        return resource_exhausted(fmt::format("too many peers (limit {})", kMaxPeers));
    }
    auto p = std::make_unique<Peer>();
    p->id = static_cast<PeerId>(peers_owned_.size());
    p->engine_id = a.engine_id;
    p->address = a;
    for (auto& rail : rails) {
        uint32_t rr = static_cast<uint32_t>(rail->index() % a.rail_addrs.size());
        Rail* rp = rail.get();
        // A task that inserts after connect gave up on it takes the address back itself.
        Result<fi_addr_t> fa = rp->run_on_worker<fi_addr_t>(
            [rp, addr = a.rail_addrs[rr]] { return rp->insert_address(addr); }, kRailTaskTimeout,
            [rp](fi_addr_t& late) { (void)rp->remove_address(late); });
        if (!fa.ok()) {
            forget_addresses(*p, rails);
            return fa.status().with_context(fmt::format("connecting to engine {:x}", a.engine_id));
        }
        p->fi_addr.push_back(*fa);
        p->remote_rail.push_back(rr);
    }
    p->same_rails = a.rail_addrs.size() >= rails.size();
    PeerId id = p->id;
    peer_table_[id].store(p.get(), std::memory_order_release);
    by_engine_[a.engine_id] = id;
    peers_owned_.push_back(std::move(p));
    return id;
}

void PeerTable::forget_addresses(const Peer& p, RailGroup& rails) {
    for (size_t r = 0; r < p.fi_addr.size(); ++r) {
        Rail* rp = &rails[r];
        fi_addr_t fa = p.fi_addr[r];
        Status s = rp->run_on_worker([rp, fa] { return rp->remove_address(fa); }, kRailTaskTimeout);
        if (!s.ok()) {
            log(LogLevel::kWarn, "fabric",
                "rail {}: taking back the address of engine {:x} after a failed connect: {}", r,
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
        m.dst_wire_base = d.wire_address(0);
        m.dst_length = d.length;
        m.signal_wire = p->address.signal.wire_address(0);
        m.host_reachable = !d.rail_keys.empty();
        m.rails = p->rails_holding(d);
        g->members.push_back(m);
        g->rails = p->fi_addr.size();
        for (size_t r = 0; r < p->fi_addr.size(); ++r) {
            uint32_t rr = p->remote_rail[r];
            g->addr.push_back(p->fi_addr[r]);
            g->dst_key.push_back(d.rail_keys.empty() ? 0 : d.rail_keys[rr % d.rail_keys.size()]);
            const auto& sk = p->address.signal.rail_keys;
            g->signal_key.push_back(sk.empty() ? 0 : sk[rr % sk.size()]);
        }
    }
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

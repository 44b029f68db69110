#include "ferry/moe/transport.h"

#include <fmt/format.h>

#include <cstring>

#include "common/enum_names.h"
#include "ferry/common/log.h"

namespace ferry::moe {
namespace {

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

}  // namespace

const char* region_name(Region r) {
    static constexpr EnumName<Region> kNames[] = {
        {Region::kCounts, "counts"},
        {Region::kDispatch, "dispatch"},
        {Region::kCombine, "combine"},
    };
    return name_of(kNames, r).data();
}

RankMemoryLayout RankMemoryLayout::of(const AllToAllConfig& cfg) {
    BufferSizes b = BufferSizes::of(cfg);
    RankMemoryLayout l;
    l.arrivals = ArrivalBlock::bytes(cfg.world_size);
    size_t recv_sizes[kNumRegions] = {b.recv_counts, b.recv_dispatch, b.recv_combine};
    size_t stage_sizes[kNumRegions] = {b.stage_counts, b.stage_dispatch, b.stage_combine};
    // 4 KiB alignment of each region: page-aligned sub-buffers register cleanly with
    // providers that pin pages.
    size_t at = round_up(l.arrivals, 4096);
    for (int r = 0; r < kNumRegions; ++r) {
        l.recv_offset[r] = at;
        l.recv_size[r] = recv_sizes[r];
        at = round_up(at + recv_sizes[r], 4096);
    }
    l.shared_bytes = at;
    for (int r = 0; r < kNumRegions; ++r) {
        l.stage_offset[r] = at;
        l.stage_size[r] = stage_sizes[r];
        at = round_up(at + stage_sizes[r], 4096);
    }
    l.total_bytes = at;
    return l;
}

MappedPeer RankMemoryLayout::peer_view(uint8_t* base, uint32_t world) const {
    MappedPeer p;
    p.arrivals.counters = reinterpret_cast<std::atomic<uint64_t>*>(base);
    p.arrivals.world = world;
    for (int r = 0; r < kNumRegions; ++r) p.recv[r] = base + recv_offset[r];
    return p;
}

MappedTransport::MappedTransport(uint32_t rank, std::vector<MappedPeer> peers,
                                 std::span<uint8_t> stage[kNumRegions],
                                 std::span<uint8_t> recv[kNumRegions])
    : rank_(rank), peers_(std::move(peers)), consumed_(size_t{kNumRegions} * peers_.size(), 0) {
    for (int r = 0; r < kNumRegions; ++r) {
        stage_[r] = stage[r];
        recv_[r] = recv[r];
    }
}

Status MappedTransport::check_put(uint32_t peer, Region region, uint64_t dst_offset,
                                  uint64_t src_offset, uint64_t len) const {
    int ri = static_cast<int>(region);
    if (peer >= peers_.size())
        return invalid_argument(
            fmt::format("put to rank {} in a world of {}", peer, peers_.size()));
    if (src_offset + len > stage_[ri].size())
        return out_of_range(fmt::format("{} put of {} bytes at staging offset {}: staging holds {}",
                                        region_name(region), len, src_offset, stage_[ri].size()));
    // Every rank has the same region sizes (same config), so our own size bounds the peer's.
    if (dst_offset + len > recv_[ri].size())
        return out_of_range(
            fmt::format("{} put of {} bytes at offset {} into rank {}: region "
                        "holds {}",
                        region_name(region), len, dst_offset, peer, recv_[ri].size()));
    return ok_status();
}

Status MappedTransport::put(uint32_t peer, Region region, uint64_t dst_offset, uint64_t src_offset,
                            uint64_t len) {
    FERRY_RETURN_IF_ERROR(check_put(peer, region, dst_offset, src_offset, len));
    if (!peers_[peer].mapped())
        return invalid_argument(fmt::format("rank {} is not mapped into rank {}", peer, rank_));
    int ri = static_cast<int>(region);
    if (len) std::memcpy(peers_[peer].recv[ri] + dst_offset, stage_[ri].data() + src_offset, len);
    peers_[peer].arrivals.at(region, rank_).fetch_add(1, std::memory_order_release);
    return ok_status();
}

Status MappedTransport::wait(Region region, uint32_t from, uint64_t count, TimePoint deadline) {
    auto& counter = peers_[rank_].arrivals.at(region, from);
    uint64_t& consumed = consumed_[static_cast<size_t>(region) * peers_.size() + from];
    uint64_t target = consumed + count;
    Status failed;
    uint32_t polls = 0;
    bool ok = spin_until(
        [&] {
            if (counter.load(std::memory_order_acquire) >= target) return true;
            if ((++polls & 1023) == 0) failed = health();
            return !failed.ok();
        },
        deadline);
    if (!failed.ok()) {
        return failed.with_context(fmt::format("rank {} waiting for {} {} arrival(s) from rank {}",
                                               rank_, count, region_name(region), from));
    }
    if (!ok) {
        uint64_t got = counter.load(std::memory_order_acquire) - consumed;
        std::string where = fmt::format(
            "rank {} waiting for {} {} arrival(s) from rank {}: {} "
            "arrived",
            rank_, count, region_name(region), from, got);
        log(LogLevel::kError, "moe", "timed out: {}", where);
        return timeout_error(where);
    }
    consumed = target;
    return ok_status();
}

}  // namespace ferry::moe

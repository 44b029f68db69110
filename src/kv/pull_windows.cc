// Pull offer windows: see pull_windows.h.
#include "pull_windows.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace ferry::kv::detail {

std::vector<PoolExtent> block_extents(const KvLayout& layout, std::span<const uint32_t> blocks) {
    std::vector<PoolExtent> pieces;
    auto add = [&](uint64_t pool_offset, uint64_t length) {
        KvLayout::RegionOffset at = layout.region_of(pool_offset);
        pieces.push_back({at.region, at.offset, length});
    };
    const uint64_t slab = layout.slab_bytes();
    for (uint32_t b : blocks) {
        if (layout.placement == KvPlacement::kBlockMajor) {
            add(uint64_t{b} * layout.block_bytes(), layout.block_bytes());
            continue;
        }
        for (uint32_t l = 0; l < layout.num_layers; ++l) {
            if (layout.head_joint()) {
                // Each head's K rows then its V rows: the block's K and V of a layer are one
                // piece starting at K's slab.
                add(layout.slab_offset(l, KvPart::kK, b), 2 * slab);
                continue;
            }
            add(layout.slab_offset(l, KvPart::kK, b), slab);
            add(layout.slab_offset(l, KvPart::kV, b), slab);
        }
    }
    std::sort(pieces.begin(), pieces.end(), [](const PoolExtent& a, const PoolExtent& b) {
        return a.region != b.region ? a.region < b.region : a.offset < b.offset;
    });
    std::vector<PoolExtent> out;
    for (const PoolExtent& p : pieces) {
        if (!out.empty() && out.back().region == p.region &&
            out.back().offset + out.back().length >= p.offset) {
            // Adjacent (or the same block named twice): one run.
            out.back().length =
                std::max(out.back().length, p.offset + p.length - out.back().offset);
            continue;
        }
        out.push_back(p);
    }
    return out;
}

Result<OfferWindows> register_offer_windows(TransferEngine& engine, const KvPoolRegions& pool,
                                            const KvLayout& layout,
                                            std::span<const uint32_t> blocks) {
    OfferWindows out;
    // A GPU region that the provider does not register (no FI_HMEM with CUDA) has no keys to
    // replace: peers reach it only through CUDA IPC, which checks none (as shm's CMA does).
    for (const MemoryRegion* r : pool.regions) {
        if (r->descriptor().kind != MemoryKind::kHost && !engine.supports_gpu_memory()) return out;
    }
    const std::vector<PoolExtent> extents = block_extents(layout, blocks);
    if (extents.size() > kMaxPullWindows) {
        return resource_exhausted(fmt::format(
            "a pull offer of {} blocks needs {} registrations of its own, more than the {} a "
            "PULL_PARAMS may carry: its blocks are scattered over a pool of {} layers; offer "
            "fewer blocks at once, or hand out the pool's keys (ConnectorConfig::pull_keys = "
            "PullKeys::kPool)",
            blocks.size(), extents.size(), kMaxPullWindows, layout.num_layers));
    }
    // One registration call per memory kind and device (one round trip to each rail's worker
    // for the whole offer; a pool's regions are usually of one kind).
    std::map<std::pair<MemoryKind, int>, std::vector<size_t>> by_kind;
    for (size_t i = 0; i < extents.size(); ++i) {
        const MemoryDescriptor& d = pool.regions[extents[i].region]->descriptor();
        by_kind[{d.kind, d.device}].push_back(i);
    }
    out.windows.resize(extents.size());
    out.regions.resize(extents.size());
    for (const auto& [kind, which] : by_kind) {
        std::vector<std::span<uint8_t>> ranges;
        ranges.reserve(which.size());
        for (size_t i : which) {
            auto* base = static_cast<uint8_t*>(pool.regions[extents[i].region]->data());
            ranges.emplace_back(base + extents[i].offset, extents[i].length);
        }
        auto mrs = engine.register_memory(ranges, kind.first, kind.second);
        if (!mrs.ok()) {
            const PoolExtent& e = extents[which[0]];
            return mrs.status().with_context(fmt::format(
                "registering a pull offer's {} runs ({} bytes at offset {} of pool region {} "
                "first) under keys of their own (PullKeys::kPerOffer)",
                which.size(), e.length, e.offset, e.region));
        }
        for (size_t j = 0; j < which.size(); ++j) {
            const PoolExtent& e = extents[which[j]];
            out.windows[which[j]] = {e.region, e.offset, (*mrs)[j]->descriptor()};
            out.regions[which[j]] = std::move((*mrs)[j]);
        }
    }
    return out;
}

Result<std::vector<WindowRuns>> runs_by_window(std::span<const PullWindow> windows, uint32_t region,
                                               std::span<const ByteRun> runs) {
    std::vector<WindowRuns> out;
    std::map<const PullWindow*, size_t> group_of;
    for (const ByteRun& run : runs) {
        // Windows come in (region, offset) order: the last one starting at or before the run.
        auto after = std::upper_bound(
            windows.begin(), windows.end(), std::pair{region, run.src_offset},
            [](const std::pair<uint32_t, uint64_t>& key, const PullWindow& w) {
                return key.first != w.region ? key.first < w.region : key.second < w.offset;
            });
        const PullWindow* w = after == windows.begin() ? nullptr : &*std::prev(after);
        if (!w || w->region != region || run.src_offset + run.length > w->offset + w->desc.length) {
            return invalid_argument(fmt::format(
                "pull: the offer registered no window holding bytes [{}, {}) of prefill pool "
                "region {} (its windows cover other blocks than decode reads: parameters of "
                "another offer, or altered)",
                run.src_offset, run.src_offset + run.length, region));
        }
        auto [g, fresh] = group_of.try_emplace(w, out.size());
        if (fresh) out.push_back(WindowRuns{w, {}});
        ByteRun r = run;
        r.src_offset -= w->offset;
        out[g->second].runs.push_back(r);
    }
    return out;
}

Status collect_part(WindowParts& a, const PullParamsMsg& m, bool first) {
    const uint32_t total =
        m.windows_total != 0 ? m.windows_total : static_cast<uint32_t>(m.windows.size());
    if (first) {
        a.windows.resize(total);
        a.have.assign(total, false);
    } else if (a.windows.size() != total) {
        return protocol_error(
            fmt::format("a part of {} windows after a part of {}", total, a.windows.size()));
    }
    // decode_body checked that [windows_first, + windows.size()) lies within the total.
    for (size_t k = 0; k < m.windows.size(); ++k) {
        const size_t at = m.windows_first + k;
        if (at >= a.have.size() || a.have[at]) {
            return protocol_error(
                fmt::format("window {} of {} came twice (or out of range)", at, total));
        }
        a.have[at] = true;
        a.windows[at] = m.windows[k];
    }
    a.got += static_cast<uint32_t>(m.windows.size());
    if (a.got < total) return ok_status();
    for (size_t k = 1; k < a.windows.size(); ++k) {
        if (std::pair{a.windows[k - 1].region, a.windows[k - 1].offset} >=
            std::pair{a.windows[k].region, a.windows[k].offset}) {
            return protocol_error(fmt::format(
                "window {} is not after window {} in (region, offset) order", k, k - 1));
        }
    }
    a.complete = true;
    return ok_status();
}

}  // namespace ferry::kv::detail

// A pull offer's own registrations (PullKeys::kPerOffer): which bytes of the pool its blocks
// occupy, registered as regions of their own on prefill, and decode's runs split among them
// (private to src/kv; docs/PROTOCOL.md, "Pull offer keys").
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "ferry/fabric/engine.h"
#include "ferry/kv/block_mapping.h"
#include "ferry/kv/layout.h"
#include "ferry/kv/messages.h"
#include "ferry/kv/pool.h"

namespace ferry::kv::detail {

// Bytes [offset, offset + length) of pool region `region`.
struct PoolExtent {
    uint32_t region = 0;
    uint64_t offset = 0;
    uint64_t length = 0;
    bool operator==(const PoolExtent&) const = default;
};

// What `blocks` occupy in the pool, every layer and K/V, in (region, offset) order, adjacent
// pieces merged (never across a region boundary): one extent per contiguous run.
std::vector<PoolExtent> block_extents(const KvLayout& layout, std::span<const uint32_t> blocks);

// The registrations of one offer; closing them (destroying this) is what ends its keys.
struct OfferWindows {
    std::vector<PullWindow> windows;  // what PULL_PARAMS carries
    std::vector<std::unique_ptr<MemoryRegion>> regions;
};

// Registers each extent of the offer's blocks as a region of its own, of the pool region's
// memory kind (GPU memory through FI_HMEM). Where the provider does not register GPU memory, a
// pool with a GPU region gets no windows (an empty result): its GPU regions have no fabric keys,
// and same-host GPU peers copy through CUDA IPC, which checks none. On failure nothing stays
// registered.
Result<OfferWindows> register_offer_windows(TransferEngine& engine, const KvPoolRegions& pool,
                                            const KvLayout& layout,
                                            std::span<const uint32_t> blocks);

// Decode: the runs of one source region, grouped by the window that holds each, their
// src_offset made relative to it. A run no window of the region holds is an error naming it
// (an offer of other blocks, or parameters that were altered).
struct WindowRuns {
    const PullWindow* window = nullptr;
    std::vector<ByteRun> runs;
};
Result<std::vector<WindowRuns>> runs_by_window(std::span<const PullWindow> windows, uint32_t region,
                                               std::span<const ByteRun> runs);

// Decode: the answer to a PULL_ASK, collected part by part (PullParamsMsg::windows_total).
struct WindowParts {
    std::vector<PullWindow> windows;
    std::vector<bool> have;
    uint32_t got = 0;
    bool complete = false;  // every window came, in (region, offset) order
};
// Adds the windows of `m` (`first`: the first part from its rank). A part that repeats
// windows, or disagrees on the count, or a whole list out of order, is an error naming it.
Status collect_part(WindowParts& parts, const PullParamsMsg& m, bool first);

}  // namespace ferry::kv::detail

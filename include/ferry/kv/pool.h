// A rank's KV pool as the regions an engine registered: one for the whole pool, one per layer
// (vLLM's register_kv_caches: a [2, num_blocks, block_size, heads, head_dim] tensor per layer),
// or one per layer and K/V (SGLang's per-layer K and V buffers). The layout's `regions` says
// which; region i holds bytes [i * region_bytes, (i + 1) * region_bytes) of the layout's offsets
// (KvLayout::region_of), so strides inside a region are the layout's.
#pragma once

#include <cstdint>
#include <vector>

#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/kv/layout.h"

namespace ferry::kv {

struct KvPoolRegions {
    // In layout order: layer-major, K before V. Registered with the connector's engine, each at
    // least layout.region_bytes() long; they must outlive the connector.
    std::vector<const MemoryRegion*> regions;

    // The one-region pool of the single-region API.
    static KvPoolRegions one(const MemoryRegion* pool) { return KvPoolRegions{{pool}}; }

    // The count matches layout.region_count() and every region is large enough; the error
    // names the region that does not fit.
    Status check(const KvLayout& layout) const;
    std::vector<MemoryDescriptor> descriptors() const;
};

// What a peer registered, as it travels in REGISTER, PULL_PARAMS and the handshake: one
// descriptor per region, checked against the layout the same way.
Status check_pool_descriptors(const std::vector<MemoryDescriptor>& pool, const KvLayout& layout);

}  // namespace ferry::kv

#include "ferry/kv/pool.h"

#include <fmt/format.h>

namespace ferry::kv {
namespace {

const char* split_name(RegionSplit s) {
    return s == RegionSplit::kOne        ? "one region"
           : s == RegionSplit::kPerLayer ? "one region per layer"
                                         : "one region per layer and K/V";
}

// The error names region i and what it should hold.
std::string region_name(const KvLayout& l, size_t i) {
    if (l.regions == RegionSplit::kOne) return "region 0 (the whole pool)";
    if (l.regions == RegionSplit::kPerLayer) return fmt::format("region {} (layer {})", i, i);
    return fmt::format("region {} (layer {} {})", i, i / 2, i % 2 == 0 ? "K" : "V");
}

}  // namespace

Status KvPoolRegions::check(const KvLayout& layout) const {
    FERRY_RETURN_IF_ERROR(layout.validate());
    if (regions.size() != layout.region_count()) {
        return invalid_argument(
            fmt::format("the KV pool has {} regions, the layout ({}, {} layers) needs {}: {}",
                        regions.size(), split_name(layout.regions), layout.num_layers,
                        layout.region_count(), layout.to_string()));
    }
    for (size_t i = 0; i < regions.size(); ++i) {
        if (regions[i] == nullptr) {
            return invalid_argument(fmt::format("KV pool {} is missing", region_name(layout, i)));
        }
        if (regions[i]->size() < layout.region_bytes()) {
            return invalid_argument(
                fmt::format("KV pool {} has {} bytes, the layout {} needs {} per region",
                            region_name(layout, i), regions[i]->size(), layout.to_string(),
                            layout.region_bytes()));
        }
    }
    return ok_status();
}

std::vector<MemoryDescriptor> KvPoolRegions::descriptors() const {
    std::vector<MemoryDescriptor> d;
    d.reserve(regions.size());
    for (const MemoryRegion* r : regions) d.push_back(r->descriptor());
    return d;
}

Status check_pool_descriptors(const std::vector<MemoryDescriptor>& pool, const KvLayout& layout) {
    if (pool.size() != layout.region_count()) {
        return protocol_error(
            fmt::format("field 'pool' has {} region descriptors, the layout "
                        "({}) needs {}",
                        pool.size(), split_name(layout.regions), layout.region_count()));
    }
    for (size_t i = 0; i < pool.size(); ++i) {
        if (pool[i].length < layout.region_bytes()) {
            return protocol_error(
                fmt::format("field 'pool[{}].length' = {} is smaller than the layout's {} bytes "
                            "per region ({})",
                            i, pool[i].length, layout.region_bytes(), region_name(layout, i)));
        }
    }
    return ok_status();
}

}  // namespace ferry::kv

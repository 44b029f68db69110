#include "ferry/kv/layout.h"

#include <fmt/format.h>

#include <initializer_list>

#include "common/enum_names.h"
#include "ferry/common/bytes.h"

namespace ferry::kv {
namespace {

constexpr uint32_t kLayoutMagic = 0x4b564c59;  // "KVLY"

// FNV-1a over the fields, so that the hash is stable across builds and platforms
// (std::hash is neither).
uint64_t fnv1a(uint64_t h, uint64_t v) {
    for (int i = 0; i < 8; ++i) {
        h ^= (v >> (8 * i)) & 0xff;
        h *= 0x100000001b3ull;
    }
    return h;
}

}  // namespace

namespace {

constexpr EnumName<KvPlacement> kPlacementNames[] = {
    {KvPlacement::kSeparate, "separate"},         {KvPlacement::kJoint, "joint"},
    {KvPlacement::kBlockMajor, "block-major"},    {KvPlacement::kHeadJoint, "head-joint"},
    {KvPlacement::kHeadJointKt, "head-joint-kt"},
};
constexpr EnumName<RegionSplit> kSplitNames[] = {
    {RegionSplit::kOne, "one"},
    {RegionSplit::kPerLayer, "per-layer"},
    {RegionSplit::kPerLayerKv, "per-layer-kv"},
};

}  // namespace

const char* placement_name(KvPlacement p) { return name_of(kPlacementNames, p).data(); }

const char* region_split_name(RegionSplit s) { return name_of(kSplitNames, s).data(); }

Result<RegionSplit> parse_region_split(const std::string& name) {
    if (auto s = parse_name(kSplitNames, name)) return *s;
    return invalid_argument(
        fmt::format("unknown region split '{}': {}", name, name_list(kSplitNames)));
}

uint64_t KvLayout::slab_offset(uint32_t layer, KvPart part, uint32_t block) const {
    uint64_t p = static_cast<uint64_t>(part);
    if (placement == KvPlacement::kSeparate) {
        return ((uint64_t{layer} * 2 + p) * num_blocks + block) * slab_bytes();
    }
    if (placement == KvPlacement::kBlockMajor) {
        return ((uint64_t{block} * num_layers + layer) * 2 + p) * slab_bytes();
    }
    if (head_joint()) {
        return (uint64_t{layer} * num_blocks + block) * 2 * slab_bytes() +
               p * uint64_t{block_size} * head_bytes();
    }
    return ((uint64_t{layer} * num_blocks + block) * 2 + p) * slab_bytes();
}

uint64_t KvLayout::offset(uint32_t layer, KvPart part, uint32_t block, uint32_t slot,
                          uint32_t head) const {
    // Head-joint: a head's K and V rows are adjacent, so heads are 2 * block_size rows apart
    // and V's slab (slab_offset) starts block_size rows after K's, inside head 0.
    uint64_t head_rows = head_joint() ? 2 * uint64_t{block_size} : uint64_t{block_size};
    if (k_transposed() && part == KvPart::kK) {
        // Head-joint-kt K: [head_dim][block_size] per head, so token `slot`'s dim 0 is the
        // page's element `slot`.
        return slab_offset(layer, part, block) + uint64_t{head} * head_rows * head_bytes() +
               uint64_t{slot} * elem_size;
    }
    uint64_t inner = order == BlockOrder::kNHD
                         ? (uint64_t{slot} * num_kv_heads + head) * head_bytes()
                         : (uint64_t{head} * head_rows + slot) * head_bytes();
    return slab_offset(layer, part, block) + inner;
}

uint64_t KvLayout::elem_offset(uint32_t layer, KvPart part, uint32_t block, uint32_t slot,
                               uint32_t head, uint32_t dim) const {
    const uint64_t dim_stride =
        k_transposed() && part == KvPart::kK ? uint64_t{block_size} * elem_size : elem_size;
    return offset(layer, part, block, slot, head) + dim * dim_stride;
}

Status KvLayout::validate() const {
    if (num_layers == 0 || num_kv_heads == 0 || head_dim == 0 || elem_size == 0 ||
        block_size == 0 || num_blocks == 0) {
        return invalid_argument(fmt::format("KV layout has a zero dimension: {}", to_string()));
    }
    // Elements are numbers of 1 (fp8), 2 (bf16, fp16), 4 or 8 bytes; any other size is a
    // mistake (elem_size=3 was accepted, and its pool could never match a tensor's).
    if (elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8) {
        return invalid_argument(fmt::format(
            "KV layout elem_size {} is not the size of an element type: 1 (fp8), 2 (bf16, fp16), "
            "4 or 8 bytes",
            elem_size));
    }
    if (static_cast<uint8_t>(placement) > 4 || static_cast<uint8_t>(order) > 1 ||
        static_cast<uint8_t>(regions) > 2) {
        return invalid_argument("KV layout has an unknown placement, block order or region split");
    }
    if (head_joint() && order != BlockOrder::kHND) {
        return invalid_argument(fmt::format(
            "a head-joint pool keeps each head's K and V rows together, so its blocks are "
            "head-major (order HND): {}",
            to_string()));
    }
    // A region must be one contiguous range of the pool's offsets.
    if (regions != RegionSplit::kOne && placement == KvPlacement::kBlockMajor) {
        return invalid_argument(fmt::format(
            "a block-major pool holds every layer in each block, so it cannot be split into "
            "regions per layer: {}",
            to_string()));
    }
    if (regions == RegionSplit::kPerLayerKv && placement != KvPlacement::kSeparate) {
        return invalid_argument(fmt::format(
            "regions per layer and K/V need K and V apart (placement separate): {}", to_string()));
    }
    // head_bytes() is below 2^64 and every other factor below 2^33: the running product,
    // checked after each step, stays below 2^97. (Checked once at the end, five factors of
    // 2^31 wrapped the 128 bits to 0, and a pool of 0 bytes passed.)
    unsigned __int128 total = head_bytes();
    for (uint64_t factor : {uint64_t{num_kv_heads}, uint64_t{block_size}, 2 * uint64_t{num_blocks},
                            uint64_t{num_layers}}) {
        total *= factor;
        if (total >> 63) {
            return invalid_argument(fmt::format("KV layout pool size overflows: {}", to_string()));
        }
    }
    return ok_status();
}

uint64_t KvLayout::compatibility_hash() const {
    uint64_t h = 0xcbf29ce484222325ull;
    h = fnv1a(h, kVersion);
    h = fnv1a(h, num_layers);
    h = fnv1a(h, head_dim);
    h = fnv1a(h, elem_size);
    return h;
}

std::string compatibility_difference(const KvLayout& a, const KvLayout& b, std::string_view a_at,
                                     std::string_view b_at) {
    std::string out;
    auto field = [&](std::string_view name, uint64_t x, uint64_t y) {
        if (x == y) return;
        out += fmt::format("{}{} differs ({} {}, {} {})", out.empty() ? "" : "; ", name, x, a_at, y,
                           b_at);
    };
    field("num_layers", a.num_layers, b.num_layers);
    field("head_dim", a.head_dim, b.head_dim);
    field("elem_size", a.elem_size, b.elem_size);
    return out;
}

std::string KvLayout::to_string() const {
    return fmt::format(
        "{{layers={} kv_heads={} head_dim={} elem={}B block={} blocks={} {} {}{}{}}}", num_layers,
        num_kv_heads, head_dim, elem_size, block_size, num_blocks, placement_name(placement),
        order == BlockOrder::kNHD ? "NHD" : "HND", regions == RegionSplit::kOne ? "" : " regions=",
        regions == RegionSplit::kOne ? "" : region_split_name(regions));
}

void KvLayout::encode(ByteWriter& w) const {
    w.put(kLayoutMagic);
    w.put(kVersion);
    w.put(num_layers);
    w.put(num_kv_heads);
    w.put(head_dim);
    w.put(elem_size);
    w.put(block_size);
    w.put(num_blocks);
    w.put(static_cast<uint8_t>(placement));
    w.put(static_cast<uint8_t>(order));
    w.put(static_cast<uint8_t>(regions));
}

Result<KvLayout> KvLayout::decode(ByteReader& r) {
    uint32_t magic = 0;
    uint16_t version = 0;
    FERRY_RETURN_IF_ERROR(r.get(&magic, "layout.magic"));
    if (magic != kLayoutMagic) {
        return protocol_error(
            fmt::format("field 'layout.magic' is {:#x}, expected {:#x}", magic, kLayoutMagic));
    }
    FERRY_RETURN_IF_ERROR(r.get(&version, "layout.version"));
    if (version != kVersion) {
        return protocol_error(
            fmt::format("field 'layout.version' is {}, this build reads {}; upgrade both sides",
                        version, kVersion));
    }
    KvLayout l;
    uint8_t placement = 0, order = 0, regions = 0;
    FERRY_RETURN_IF_ERROR(r.get(&l.num_layers, "layout.num_layers"));
    FERRY_RETURN_IF_ERROR(r.get(&l.num_kv_heads, "layout.num_kv_heads"));
    FERRY_RETURN_IF_ERROR(r.get(&l.head_dim, "layout.head_dim"));
    FERRY_RETURN_IF_ERROR(r.get(&l.elem_size, "layout.elem_size"));
    FERRY_RETURN_IF_ERROR(r.get(&l.block_size, "layout.block_size"));
    FERRY_RETURN_IF_ERROR(r.get(&l.num_blocks, "layout.num_blocks"));
    FERRY_RETURN_IF_ERROR(r.get(&placement, "layout.placement"));
    FERRY_RETURN_IF_ERROR(r.get(&order, "layout.order"));
    FERRY_RETURN_IF_ERROR(r.get(&regions, "layout.regions"));
    if (placement > 4) {
        return protocol_error(
            fmt::format("field 'layout.placement' has unknown value {}", placement));
    }
    if (order > 1) {
        return protocol_error(fmt::format("field 'layout.order' has unknown value {}", order));
    }
    l.placement = static_cast<KvPlacement>(placement);
    if (regions > 2) {
        return protocol_error(fmt::format("field 'layout.regions' has unknown value {}", regions));
    }
    l.order = static_cast<BlockOrder>(order);
    l.regions = static_cast<RegionSplit>(regions);
    Status s = l.validate();
    if (!s.ok()) return protocol_error(fmt::format("field 'layout': {}", s.message()));
    return l;
}

}  // namespace ferry::kv

// The paged KV cache of one engine rank: which byte of the pool holds which (layer, K/V,
// block, token, head, dim) element. Both sides of a transfer describe their pool with a
// KvLayout; the block mapping turns two layouts into byte runs.
#pragma once

#include <cstdint>
#include <string>

#include "ferry/common/status.h"

namespace ferry {
class ByteWriter;
class ByteReader;
}  // namespace ferry

namespace ferry::kv {

// Where K and V of one block live relative to each other.
enum class KvPlacement : uint8_t {
    // Per layer, a K region of all blocks followed by a V region of all blocks
    // (vLLM's [2, num_blocks, ...] per layer).
    kSeparate = 0,
    // Per layer and block, K then V side by side (FlashInfer's [num_blocks, 2, ...] per layer):
    // one whole block's K and V are one contiguous run.
    kJoint = 1,
    // Block-major: each block holds every layer, [layer][K,V][...] inside it (ferry serve's
    // pool). One block's whole KV is one contiguous run, so full blocks move with one write.
    kBlockMajor = 2,
    // Per layer and block, each head's K then that head's V ([num_blocks, heads, 2, block_size,
    // head_dim] per layer: vLLM's CPU backend, which stores a head's page as its K rows then its
    // V rows). Head-major inside the block, so only with BlockOrder::kHND.
    kHeadJoint = 3,
    // Head-joint with each head's K page transposed: [head_dim][block_size] (a token's K
    // elements block_size elements apart), then its V rows [block_size][head_dim]. What vLLM's
    // CPU attention writes with its vector kernels (ISA "vec", vLLM 0.32): K is stored
    // dimension-major for them. Only with BlockOrder::kHND.
    kHeadJointKt = 4,
};

// "separate", "joint", "block-major", "head-joint", "head-joint-kt".
const char* placement_name(KvPlacement p);

// Order of elements inside one block's K (or V) slab.
enum class BlockOrder : uint8_t {
    kNHD = 0,  // token-major: [block_size][heads][head_dim]
    kHND = 1,  // head-major: [heads][block_size][head_dim]
};

enum class KvPart : uint8_t { kK = 0, kV = 1 };

// How the pool is cut into registered regions (KvPoolRegions, pool.h). Offsets stay those of
// the whole pool; region i holds [i * region_bytes(), (i + 1) * region_bytes()) of them, so a
// region's strides (per K/V, block, token) are the layout's.
enum class RegionSplit : uint8_t {
    kOne = 0,         // one region for the whole pool
    kPerLayer = 1,    // one per layer (vLLM's per-layer tensors); not with kBlockMajor
    kPerLayerKv = 2,  // one per (layer, K/V) (SGLang's K and V buffers); kSeparate only
};

// "one", "per-layer", "per-layer-kv" (the CLI's spelling).
const char* region_split_name(RegionSplit s);
Result<RegionSplit> parse_region_split(const std::string& name);

struct KvLayout {
    // 2: the region split.
    static constexpr uint16_t kVersion = 2;

    uint32_t num_layers = 0;
    uint32_t num_kv_heads = 0;  // KV heads held by this rank (global heads / TP size)
    uint32_t head_dim = 0;
    uint32_t elem_size = 0;   // bytes per element: 2 for bf16/fp16, 1 for fp8
    uint32_t block_size = 0;  // tokens per block
    uint32_t num_blocks = 0;
    KvPlacement placement = KvPlacement::kSeparate;
    BlockOrder order = BlockOrder::kNHD;
    RegionSplit regions = RegionSplit::kOne;

    // Bytes of one head's vector for one token.
    uint64_t head_bytes() const { return uint64_t{head_dim} * elem_size; }
    // Bytes of one token's K (or V) vectors across this rank's heads.
    uint64_t token_bytes() const { return head_bytes() * num_kv_heads; }
    // Bytes of one block's K (or V) slab for one layer.
    uint64_t slab_bytes() const { return token_bytes() * block_size; }
    // Bytes of one layer across all blocks, K and V.
    uint64_t layer_bytes() const { return slab_bytes() * 2 * num_blocks; }
    // Bytes of one block across all layers, K and V (one contiguous run when kBlockMajor).
    uint64_t block_bytes() const { return slab_bytes() * 2 * num_layers; }
    // Bytes of the whole pool: what is registered with the TransferEngine.
    uint64_t pool_bytes() const { return layer_bytes() * num_layers; }

    uint32_t region_count() const {
        return regions == RegionSplit::kOne        ? 1
               : regions == RegionSplit::kPerLayer ? num_layers
                                                   : 2 * num_layers;
    }
    // Bytes of each region (all regions of a pool are the same size).
    uint64_t region_bytes() const { return pool_bytes() / region_count(); }
    // Which region holds pool offset `offset`, and where in it.
    struct RegionOffset {
        uint32_t region = 0;
        uint64_t offset = 0;
    };
    RegionOffset region_of(uint64_t offset) const {
        if (regions == RegionSplit::kOne) return {0, offset};
        uint64_t rb = region_bytes();
        return {static_cast<uint32_t>(offset / rb), offset % rb};
    }

    // Byte offset of the start of a (layer, part, block) slab.
    uint64_t slab_offset(uint32_t layer, KvPart part, uint32_t block) const;
    // Byte offset of element (token slot in block, local head, dim 0) of a slab.
    uint64_t offset(uint32_t layer, KvPart part, uint32_t block, uint32_t slot,
                    uint32_t head) const;
    // Byte offset of element (slot, head, dim): offset() + dim elements, except in a
    // head-joint-kt pool's K, where dims are block_size elements apart.
    uint64_t elem_offset(uint32_t layer, KvPart part, uint32_t block, uint32_t slot, uint32_t head,
                         uint32_t dim) const;
    // K rows are not contiguous per (token, head): a head-joint-kt pool's K is transposed.
    bool k_transposed() const { return placement == KvPlacement::kHeadJointKt; }
    // Each head's K and V pages side by side in a block (head-joint and head-joint-kt).
    bool head_joint() const {
        return placement == KvPlacement::kHeadJoint || placement == KvPlacement::kHeadJointKt;
    }

    // Rejects zero sizes, unknown enums, pools whose size overflows 64 bits and region splits
    // the placement does not keep contiguous.
    Status validate() const;

    // Hash of everything two sides must agree on for element-wise compatibility: head dim
    // and element size (block size, heads per rank and ordering may differ; the mapping
    // handles them). A mismatch means the pools hold different tensors.
    uint64_t compatibility_hash() const;

    std::string to_string() const;
    void encode(ByteWriter& w) const;
    static Result<KvLayout> decode(ByteReader& r);

    bool operator==(const KvLayout&) const = default;
};

// The fields of compatibility_hash() that differ between a and b, named with their values,
// e.g. "head_dim differs (128 at the peer, 64 here)" for a_at "at the peer", b_at "here";
// "" when none does. What an incompatible-layout error names.
std::string compatibility_difference(const KvLayout& a, const KvLayout& b, std::string_view a_at,
                                     std::string_view b_at);

}  // namespace ferry::kv

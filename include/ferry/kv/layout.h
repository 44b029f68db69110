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
};

// Order of elements inside one block's K (or V) slab.
enum class BlockOrder : uint8_t {
    kNHD = 0,  // token-major: [block_size][heads][head_dim]
    kHND = 1,  // head-major: [heads][block_size][head_dim]
};

enum class KvPart : uint8_t { kK = 0, kV = 1 };

struct KvLayout {
    static constexpr uint16_t kVersion = 1;

    uint32_t num_layers = 0;
    uint32_t num_kv_heads = 0;  // KV heads held by this rank (global heads / TP size)
    uint32_t head_dim = 0;
    uint32_t elem_size = 0;   // bytes per element: 2 for bf16/fp16, 1 for fp8
    uint32_t block_size = 0;  // tokens per block
    uint32_t num_blocks = 0;
    KvPlacement placement = KvPlacement::kSeparate;
    BlockOrder order = BlockOrder::kNHD;

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

    // Byte offset of the start of a (layer, part, block) slab.
    uint64_t slab_offset(uint32_t layer, KvPart part, uint32_t block) const;
    // Byte offset of element (token slot in block, local head, dim 0) of a slab.
    uint64_t offset(uint32_t layer, KvPart part, uint32_t block, uint32_t slot,
                    uint32_t head) const;

    // Rejects zero sizes, unknown enums and pools whose size overflows 64 bits.
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

}  // namespace ferry::kv

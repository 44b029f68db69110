// The KV pool of one engine rank: the memory a kv::KvLayout describes, block-major so that one
// block is one contiguous run that a transfer can move with a single write (block b starts at
// b * layout.block_bytes(); inside a block [layer][K=0, V=1][token slot][kv head][head dim]).
// Which request holds which block is kv::BlockPool's job.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "ferry/common/status.h"
#include "ferry/kv/layout.h"

namespace ferry::serve {

using BlockId = uint32_t;
using RequestId = std::string;

class KvPool {
  public:
    // Page-aligned so the whole pool can be registered as one memory region. The layout must
    // be block-major and token-major (kBlockMajor, kNHD); layout.num_blocks blocks.
    static Result<std::unique_ptr<KvPool>> create(const kv::KvLayout& layout);

    const kv::KvLayout& layout() const { return layout_; }
    size_t num_blocks() const { return layout_.num_blocks; }
    size_t block_bytes() const { return layout_.block_bytes(); }
    uint8_t* base() { return mem_.get(); }
    const uint8_t* base() const { return mem_.get(); }
    size_t size_bytes() const { return layout_.pool_bytes(); }

    std::span<uint8_t> block(BlockId b);
    std::span<const uint8_t> block(BlockId b) const;
    // One (layer, K or V, token slot) row: all heads of this rank, head_dim each.
    std::span<uint8_t> row(BlockId b, int layer, int kv, int slot);
    std::span<const uint8_t> row(BlockId b, int layer, int kv, int slot) const;

  private:
    struct FreeDeleter {
        void operator()(uint8_t* p) const;
    };
    KvPool(const kv::KvLayout& layout, uint8_t* mem) : layout_(layout), mem_(mem) {}

    kv::KvLayout layout_;
    std::unique_ptr<uint8_t, FreeDeleter> mem_;
};

}  // namespace ferry::serve

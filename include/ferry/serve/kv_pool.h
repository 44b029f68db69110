// The KV pool of one engine rank and the block manager that hands its blocks to requests.
//
// Layout (block-major, so one block is one contiguous run that a transfer can move with a
// single write): block b starts at b * block_bytes; inside a block the order is
// [layer][K=0, V=1][token slot][kv head][head dim] elements of elem_bytes each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "ferry/common/status.h"
#include "ferry/serve/cost_model.h"

namespace ferry::serve {

using BlockId = uint32_t;
using RequestId = std::string;

class KvPool {
  public:
    // Page-aligned so the whole pool can be registered as one memory region.
    static Result<std::unique_ptr<KvPool>> create(const KvShape& shape, size_t num_blocks);

    const KvShape& shape() const { return shape_; }
    size_t num_blocks() const { return num_blocks_; }
    size_t block_bytes() const { return shape_.block_bytes(); }
    uint8_t* base() { return mem_.get(); }
    const uint8_t* base() const { return mem_.get(); }
    size_t size_bytes() const { return num_blocks_ * block_bytes(); }

    std::span<uint8_t> block(BlockId b);
    std::span<const uint8_t> block(BlockId b) const;
    // One (layer, K or V, token slot) row: all heads of this rank, head_dim each.
    std::span<uint8_t> row(BlockId b, int layer, int kv, int slot);
    std::span<const uint8_t> row(BlockId b, int layer, int kv, int slot) const;

  private:
    struct FreeDeleter {
        void operator()(uint8_t* p) const;
    };
    KvPool(const KvShape& shape, size_t num_blocks, uint8_t* mem)
        : shape_(shape), num_blocks_(num_blocks), mem_(mem) {}

    KvShape shape_;
    size_t num_blocks_;
    std::unique_ptr<uint8_t, FreeDeleter> mem_;
};

// Allocation accounting over a pool of N blocks; no prefix caching, so a block belongs to at
// most one request. Thread-safe: the engine loop allocates, connector threads and /metrics read
// and free.
class BlockManager {
  public:
    explicit BlockManager(size_t num_blocks);

    static size_t blocks_for_tokens(size_t tokens, int block_size) {
        return (tokens + block_size - 1) / block_size;
    }

    // Gives `request` n more blocks (appended to the ones it holds). Fails without side effects
    // when fewer than n blocks are free.
    Result<std::vector<BlockId>> allocate(const RequestId& request, size_t n);
    // Returns every block of `request` to the pool.
    Status free(const RequestId& request);

    std::vector<BlockId> blocks_of(const RequestId& request) const;
    bool can_allocate(size_t n) const;
    size_t num_blocks() const { return num_blocks_; }
    size_t num_free() const;
    size_t num_used() const;
    size_t num_requests() const;

  private:
    const size_t num_blocks_;
    mutable std::mutex mu_;
    std::vector<BlockId> free_;  // a stack: recently freed blocks are reused first
    std::map<RequestId, std::vector<BlockId>> owned_;
};

}  // namespace ferry::serve

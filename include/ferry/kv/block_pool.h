// A free list of KV blocks with accounting, so that engines and tests can check that every
// block handed to a transfer came back.
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "ferry/common/status.h"

namespace ferry::kv {

class BlockPool {
   public:
    explicit BlockPool(uint32_t num_blocks);

    // n free blocks, in an order that is not contiguous in general (freed blocks come back
    // first), or kResourceExhausted.
    Result<std::vector<uint32_t>> allocate(uint32_t n);
    // Returns blocks; a block that is not allocated (double free, out of range) is an
    // invalid-argument error and nothing is freed.
    Status free(std::span<const uint32_t> blocks);

    uint32_t num_blocks() const { return static_cast<uint32_t>(allocated_.size()); }
    uint32_t free_count() const;
    uint32_t used_count() const { return num_blocks() - free_count(); }

   private:
    mutable std::mutex mu_;
    std::vector<uint32_t> free_;
    std::vector<bool> allocated_;
};

}  // namespace ferry::kv

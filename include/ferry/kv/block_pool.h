// A free list of KV blocks with accounting, so that engines and tests can check that every
// block handed to a transfer came back.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "ferry/common/status.h"

namespace ferry::kv {

// Thread-safe: an engine loop allocates while connector threads and /metrics read and free.
class BlockPool {
  public:
    explicit BlockPool(uint32_t num_blocks);

    // n free blocks, in an order that is not contiguous in general (freed blocks come back
    // first), or kResourceExhausted.
    Result<std::vector<uint32_t>> allocate(uint32_t n);
    // Returns blocks; a block that is not allocated (double free, out of range) is an
    // invalid-argument error and nothing is freed.
    Status free(std::span<const uint32_t> blocks);

    // Per owner (a serving engine's request): n more blocks appended to the ones `owner`
    // holds, or kResourceExhausted without side effects. An owner's blocks go back only all
    // together, through free_owner, never through free(span).
    Result<std::vector<uint32_t>> allocate(const std::string& owner, uint32_t n);
    // Every block of `owner`; kNotFound when it holds none (freed twice?).
    Status free_owner(const std::string& owner);
    // The blocks `owner` holds, in allocation order (its block table); empty if none.
    std::vector<uint32_t> blocks_of(const std::string& owner) const;
    size_t num_owners() const;

    bool can_allocate(uint32_t n) const { return n <= free_count(); }
    uint32_t num_blocks() const { return static_cast<uint32_t>(allocated_.size()); }
    uint32_t free_count() const;
    uint32_t used_count() const { return num_blocks() - free_count(); }

  private:
    Result<std::vector<uint32_t>> take_locked(uint32_t n, const std::string& why);

    mutable std::mutex mu_;
    std::vector<uint32_t> free_;
    std::vector<bool> allocated_;
    std::map<std::string, std::vector<uint32_t>> owned_;
};

}  // namespace ferry::kv

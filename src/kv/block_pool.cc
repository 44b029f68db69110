#include "ferry/kv/block_pool.h"

#include <fmt/format.h>

#include <algorithm>

namespace ferry::kv {

BlockPool::BlockPool(uint32_t num_blocks) : allocated_(num_blocks, false) {
    free_.reserve(num_blocks);
    // Highest id on top of the stack is handed out last; ids come out 0, 1, 2, ... at first.
    for (uint32_t i = num_blocks; i > 0; --i) free_.push_back(i - 1);
}

Result<std::vector<uint32_t>> BlockPool::allocate(uint32_t n) {
    std::lock_guard lk(mu_);
    if (n > free_.size()) {
        return resource_exhausted(fmt::format("{} KV blocks requested, {} of {} free", n,
                                              free_.size(), allocated_.size()));
    }
    std::vector<uint32_t> out(free_.end() - n, free_.end());
    std::reverse(out.begin(), out.end());
    free_.resize(free_.size() - n);
    for (uint32_t b : out) allocated_[b] = true;
    return out;
}

Status BlockPool::free(std::span<const uint32_t> blocks) {
    std::lock_guard lk(mu_);
    for (size_t i = 0; i < blocks.size(); ++i) {
        uint32_t b = blocks[i];
        if (b >= allocated_.size() || !allocated_[b]) {
            // All or nothing: undo this call's frees so the caller can retry correctly.
            for (size_t j = 0; j < i; ++j) allocated_[blocks[j]] = true;
            return invalid_argument(fmt::format(
                "freeing KV block {} that is not allocated (double free or foreign id)", b));
        }
        allocated_[b] = false;
    }
    // Reversed onto the stack, so that allocating the same count again returns these blocks
    // in the same order (consecutive runs stay consecutive and coalesce).
    free_.insert(free_.end(), blocks.rbegin(), blocks.rend());
    return ok_status();
}

uint32_t BlockPool::free_count() const {
    std::lock_guard lk(mu_);
    return static_cast<uint32_t>(free_.size());
}

}  // namespace ferry::kv

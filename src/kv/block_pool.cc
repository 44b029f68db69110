#include "ferry/kv/block_pool.h"

#include <fmt/format.h>

#include <algorithm>

namespace ferry::kv {

BlockPool::BlockPool(uint32_t num_blocks) : allocated_(num_blocks, false) {
    free_.reserve(num_blocks);
    // Highest id on top of the stack is handed out last; ids come out 0, 1, 2, ... at first.
    for (uint32_t i = num_blocks; i > 0; --i) free_.push_back(i - 1);
}

Result<std::vector<uint32_t>> BlockPool::take_locked(uint32_t n, const std::string& who) {
    if (n > free_.size()) {
        return resource_exhausted(fmt::format("{} KV blocks requested{}, {} of {} are free", n, who,
                                              free_.size(), allocated_.size()));
    }
    std::vector<uint32_t> out(free_.end() - n, free_.end());
    std::reverse(out.begin(), out.end());
    free_.resize(free_.size() - n);
    for (uint32_t b : out) allocated_[b] = true;
    return out;
}

Result<std::vector<uint32_t>> BlockPool::allocate(uint32_t n) {
    std::lock_guard lk(mu_);
    return take_locked(n, "");
}

Result<std::vector<uint32_t>> BlockPool::allocate(const std::string& owner, uint32_t n) {
    std::lock_guard lk(mu_);
    FERRY_ASSIGN_OR_RETURN(std::vector<uint32_t> got,
                           take_locked(n, fmt::format(" by request {}", owner)));
    auto& mine = owned_[owner];
    mine.insert(mine.end(), got.begin(), got.end());
    return got;
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

Status BlockPool::free_owner(const std::string& owner) {
    std::lock_guard lk(mu_);
    auto it = owned_.find(owner);
    if (it == owned_.end()) {
        return not_found(fmt::format("request {} holds no KV blocks (freed twice?)", owner));
    }
    for (uint32_t b : it->second) allocated_[b] = false;
    free_.insert(free_.end(), it->second.rbegin(), it->second.rend());
    owned_.erase(it);
    return ok_status();
}

std::vector<uint32_t> BlockPool::blocks_of(const std::string& owner) const {
    std::lock_guard lk(mu_);
    auto it = owned_.find(owner);
    return it == owned_.end() ? std::vector<uint32_t>{} : it->second;
}

size_t BlockPool::num_owners() const {
    std::lock_guard lk(mu_);
    return owned_.size();
}

uint32_t BlockPool::free_count() const {
    std::lock_guard lk(mu_);
    return static_cast<uint32_t>(free_.size());
}

}  // namespace ferry::kv

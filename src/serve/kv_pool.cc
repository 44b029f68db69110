#include "ferry/serve/kv_pool.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cstdlib>
#include <cstring>

namespace ferry::serve {

void KvPool::FreeDeleter::operator()(uint8_t* p) const { std::free(p); }

Result<std::unique_ptr<KvPool>> KvPool::create(const KvShape& shape, size_t num_blocks) {
    if (shape.layers < 1 || shape.kv_heads < 1 || shape.head_dim < 1 || shape.elem_bytes < 1 ||
        shape.block_size < 1)
        return invalid_argument(
            "KV shape needs positive layers, heads, head dim, element size "
            "and block size");
    if (num_blocks == 0) return invalid_argument("a KV pool needs at least one block");
    size_t page = size_t(sysconf(_SC_PAGESIZE));
    size_t bytes = num_blocks * shape.block_bytes();
    size_t rounded = (bytes + page - 1) / page * page;
    auto* mem = static_cast<uint8_t*>(std::aligned_alloc(page, rounded));
    if (mem == nullptr)
        return resource_exhausted(
            fmt::format("cannot allocate a KV pool of {} blocks ({} MiB): lower --num-blocks",
                        num_blocks, bytes >> 20));
    std::memset(mem, 0, rounded);
    return std::unique_ptr<KvPool>(new KvPool(shape, num_blocks, mem));
}

std::span<uint8_t> KvPool::block(BlockId b) {
    assert(b < num_blocks_);
    return {base() + size_t(b) * block_bytes(), block_bytes()};
}

std::span<const uint8_t> KvPool::block(BlockId b) const {
    assert(b < num_blocks_);
    return {base() + size_t(b) * block_bytes(), block_bytes()};
}

std::span<uint8_t> KvPool::row(BlockId b, int layer, int kv, int slot) {
    size_t rb = shape_.row_bytes();
    size_t off = ((size_t(layer) * 2 + kv) * shape_.block_size + slot) * rb;
    return block(b).subspan(off, rb);
}

std::span<const uint8_t> KvPool::row(BlockId b, int layer, int kv, int slot) const {
    size_t rb = shape_.row_bytes();
    size_t off = ((size_t(layer) * 2 + kv) * shape_.block_size + slot) * rb;
    return block(b).subspan(off, rb);
}

BlockManager::BlockManager(size_t num_blocks) : num_blocks_(num_blocks) {
    free_.reserve(num_blocks);
    // Pushed in reverse so the first allocation gets block 0, 1, 2, ...: readable in logs.
    for (size_t i = num_blocks; i > 0; --i) free_.push_back(BlockId(i - 1));
}

Result<std::vector<BlockId>> BlockManager::allocate(const RequestId& request, size_t n) {
    std::lock_guard lock(mu_);
    if (n > free_.size())
        return resource_exhausted(fmt::format("request {} needs {} KV blocks, {} of {} are free",
                                              request, n, free_.size(), num_blocks_));
    std::vector<BlockId> got(free_.end() - long(n), free_.end());
    std::reverse(got.begin(), got.end());
    free_.resize(free_.size() - n);
    auto& mine = owned_[request];
    mine.insert(mine.end(), got.begin(), got.end());
    return got;
}

Status BlockManager::free(const RequestId& request) {
    std::lock_guard lock(mu_);
    auto it = owned_.find(request);
    if (it == owned_.end())
        return not_found(fmt::format("request {} holds no KV blocks (freed twice?)", request));
    for (auto b = it->second.rbegin(); b != it->second.rend(); ++b) free_.push_back(*b);
    owned_.erase(it);
    return ok_status();
}

std::vector<BlockId> BlockManager::blocks_of(const RequestId& request) const {
    std::lock_guard lock(mu_);
    auto it = owned_.find(request);
    return it == owned_.end() ? std::vector<BlockId>{} : it->second;
}

bool BlockManager::can_allocate(size_t n) const {
    std::lock_guard lock(mu_);
    return n <= free_.size();
}

size_t BlockManager::num_free() const {
    std::lock_guard lock(mu_);
    return free_.size();
}

size_t BlockManager::num_used() const {
    std::lock_guard lock(mu_);
    return num_blocks_ - free_.size();
}

size_t BlockManager::num_requests() const {
    std::lock_guard lock(mu_);
    return owned_.size();
}

}  // namespace ferry::serve

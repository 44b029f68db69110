#include "serve/kv_pool.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cassert>
#include <cstdlib>
#include <cstring>

namespace ferry::serve {

void KvPool::FreeDeleter::operator()(uint8_t* p) const { std::free(p); }

Result<std::unique_ptr<KvPool>> KvPool::create(const kv::KvLayout& layout) {
    if (layout.num_blocks == 0) return invalid_argument("a KV pool needs at least one block");
    FERRY_RETURN_IF_ERROR(layout.validate().with_context("KV pool"));
    if (layout.placement != kv::KvPlacement::kBlockMajor || layout.order != kv::BlockOrder::kNHD)
        return invalid_argument(fmt::format(
            "a serving KV pool is block-major and token-major (NHD), not {}", layout.to_string()));
    size_t page = size_t(sysconf(_SC_PAGESIZE));
    size_t bytes = layout.pool_bytes();
    size_t rounded = (bytes + page - 1) / page * page;
    auto* mem = static_cast<uint8_t*>(std::aligned_alloc(page, rounded));
    if (mem == nullptr)
        return resource_exhausted(
            fmt::format("cannot allocate a KV pool of {} blocks ({} MiB): lower num_blocks",
                        layout.num_blocks, bytes >> 20));
    std::memset(mem, 0, rounded);
    return std::unique_ptr<KvPool>(new KvPool(layout, mem));
}

std::span<uint8_t> KvPool::block(BlockId b) {
    assert(b < num_blocks());
    return {base() + size_t(b) * block_bytes(), block_bytes()};
}

std::span<const uint8_t> KvPool::block(BlockId b) const {
    assert(b < num_blocks());
    return {base() + size_t(b) * block_bytes(), block_bytes()};
}

std::span<uint8_t> KvPool::row(BlockId b, int layer, int kv, int slot) {
    assert(b < num_blocks());
    return {base() + layout_.offset(uint32_t(layer), kv::KvPart(kv), b, uint32_t(slot), 0),
            layout_.token_bytes()};
}

std::span<const uint8_t> KvPool::row(BlockId b, int layer, int kv, int slot) const {
    assert(b < num_blocks());
    return {base() + layout_.offset(uint32_t(layer), kv::KvPart(kv), b, uint32_t(slot), 0),
            layout_.token_bytes()};
}

}  // namespace ferry::serve

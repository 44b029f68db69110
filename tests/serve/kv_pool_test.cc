#include "serve/kv_pool.h"

#include <gtest/gtest.h>

#include <set>

namespace ferry::serve {
namespace {

kv::KvLayout small_layout(uint32_t num_blocks) {
    kv::KvLayout l;
    l.num_layers = 2;
    l.num_kv_heads = 2;
    l.head_dim = 4;
    l.elem_size = 2;
    l.block_size = 3;
    l.num_blocks = num_blocks;
    l.placement = kv::KvPlacement::kBlockMajor;
    return l;
}

TEST(KvPool, RowsOfABlockTileItWithoutOverlap) {
    kv::KvLayout s = small_layout(5);
    auto pool = KvPool::create(s);
    ASSERT_TRUE(pool.ok());
    EXPECT_EQ((*pool)->size_bytes(), 5 * s.block_bytes());
    std::set<const uint8_t*> starts;
    for (int l = 0; l < 2; ++l)
        for (int kv = 0; kv < 2; ++kv)
            for (int slot = 0; slot < 3; ++slot) {
                auto row = (*pool)->row(2, l, kv, slot);
                EXPECT_EQ(row.size(), s.token_bytes());
                EXPECT_GE(row.data(), (*pool)->block(2).data());
                EXPECT_LE(row.data() + row.size(),
                          (*pool)->block(2).data() + (*pool)->block_bytes());
                starts.insert(row.data());
            }
    EXPECT_EQ(starts.size(), 12u);
    EXPECT_FALSE(KvPool::create(small_layout(0)).ok());
}

// The pool's memory is what its kv::KvLayout says: a transfer planned from the layout moves
// exactly the bytes the synthetic model writes into rows.
TEST(KvPool, RowsSitWhereTheLayoutPutsThem) {
    kv::KvLayout s = small_layout(4);
    auto pool = std::move(KvPool::create(s).value());
    for (uint32_t b = 0; b < 4; ++b)
        for (int l = 0; l < 2; ++l)
            for (int kv = 0; kv < 2; ++kv)
                for (int slot = 0; slot < 3; ++slot)
                    EXPECT_EQ(size_t(pool->row(b, l, kv, slot).data() - pool->base()),
                              s.offset(uint32_t(l), kv::KvPart(kv), b, uint32_t(slot), 0));
}

TEST(KvPool, RefusesALayoutItCannotServeRowsFrom) {
    kv::KvLayout s = small_layout(4);
    s.placement = kv::KvPlacement::kSeparate;
    auto r = KvPool::create(s);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("block-major"), std::string::npos);
}

}  // namespace
}  // namespace ferry::serve

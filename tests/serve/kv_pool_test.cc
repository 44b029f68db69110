#include "ferry/serve/kv_pool.h"

#include <gtest/gtest.h>

#include <set>

namespace ferry::serve {
namespace {

TEST(BlockManager, AllocatesDistinctBlocksAndAccountsForThem) {
    BlockManager bm(10);
    auto a = bm.allocate("a", 4);
    auto b = bm.allocate("b", 3);
    ASSERT_TRUE(a.ok() && b.ok());
    std::set<BlockId> all(a->begin(), a->end());
    all.insert(b->begin(), b->end());
    EXPECT_EQ(all.size(), 7u);
    EXPECT_EQ(bm.num_used(), 7u);
    EXPECT_EQ(bm.num_free(), 3u);
    EXPECT_EQ(bm.num_requests(), 2u);
    // Growing a request appends to its block table.
    auto more = bm.allocate("a", 2);
    ASSERT_TRUE(more.ok());
    EXPECT_EQ(bm.blocks_of("a").size(), 6u);
    EXPECT_EQ(bm.num_free(), 1u);
}

TEST(BlockManager, RefusesWhenFullWithoutSideEffectsAndRecoversAfterFree) {
    BlockManager bm(4);
    ASSERT_TRUE(bm.allocate("a", 3).ok());
    auto r = bm.allocate("b", 2);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(r.status().message().find("1 of 4 are free"), std::string::npos);
    EXPECT_EQ(bm.num_free(), 1u);
    EXPECT_FALSE(bm.can_allocate(2));
    ASSERT_TRUE(bm.free("a").ok());
    EXPECT_EQ(bm.num_free(), 4u);
    EXPECT_TRUE(bm.allocate("b", 4).ok());
}

TEST(BlockManager, FreeingTwiceIsAnError) {
    BlockManager bm(2);
    ASSERT_TRUE(bm.allocate("a", 1).ok());
    ASSERT_TRUE(bm.free("a").ok());
    Status s = bm.free("a");
    EXPECT_EQ(s.code(), StatusCode::kNotFound);
    EXPECT_EQ(bm.num_free(), 2u);
}

TEST(BlockManager, BlocksForTokensRoundsUp) {
    EXPECT_EQ(BlockManager::blocks_for_tokens(0, 16), 0u);
    EXPECT_EQ(BlockManager::blocks_for_tokens(1, 16), 1u);
    EXPECT_EQ(BlockManager::blocks_for_tokens(16, 16), 1u);
    EXPECT_EQ(BlockManager::blocks_for_tokens(17, 16), 2u);
}

TEST(KvPool, RowsOfABlockTileItWithoutOverlap) {
    KvShape s{.layers = 2, .kv_heads = 2, .head_dim = 4, .elem_bytes = 2, .block_size = 3};
    auto pool = KvPool::create(s, 5);
    ASSERT_TRUE(pool.ok());
    EXPECT_EQ((*pool)->size_bytes(), 5 * s.block_bytes());
    std::set<const uint8_t*> starts;
    for (int l = 0; l < 2; ++l)
        for (int kv = 0; kv < 2; ++kv)
            for (int slot = 0; slot < 3; ++slot) {
                auto row = (*pool)->row(2, l, kv, slot);
                EXPECT_EQ(row.size(), s.row_bytes());
                EXPECT_GE(row.data(), (*pool)->block(2).data());
                EXPECT_LE(row.data() + row.size(),
                          (*pool)->block(2).data() + (*pool)->block_bytes());
                starts.insert(row.data());
            }
    EXPECT_EQ(starts.size(), 12u);
    EXPECT_FALSE(KvPool::create(s, 0).ok());
}

}  // namespace
}  // namespace ferry::serve

#include "ferry/kv/block_pool.h"

#include <gtest/gtest.h>

#include <set>

#include "ferry/kv/block_mapping.h"

namespace ferry::kv {
namespace {

TEST(BlockPool, AccountsForEveryBlockAndRefusesBadFrees) {
    BlockPool pool(8);
    auto a = pool.allocate(3);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(*a, (std::vector<uint32_t>{0, 1, 2}));
    EXPECT_EQ(pool.free_count(), 5u);
    EXPECT_EQ(pool.used_count(), 3u);

    auto too_many = pool.allocate(6);
    ASSERT_FALSE(too_many.ok());
    EXPECT_EQ(too_many.status().code(), StatusCode::kResourceExhausted);
    EXPECT_EQ(pool.free_count(), 5u);  // a refused allocation takes nothing

    // Double free inside one call, a foreign id, a block never allocated: all or nothing.
    std::vector<uint32_t> dup = {0, 0};
    EXPECT_EQ(pool.free(dup).code(), StatusCode::kInvalidArgument);
    std::vector<uint32_t> foreign = {1, 99};
    EXPECT_EQ(pool.free(foreign).code(), StatusCode::kInvalidArgument);
    std::vector<uint32_t> unallocated = {5};
    EXPECT_EQ(pool.free(unallocated).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(pool.used_count(), 3u);

    ASSERT_TRUE(pool.free(*a).ok());
    EXPECT_EQ(pool.free_count(), 8u);
    EXPECT_EQ(pool.free(*a).code(), StatusCode::kInvalidArgument);  // second free of the same
}

TEST(BlockPool, ReallocationKeepsTheOrderBlocksWereFreedIn) {
    // A request's consecutive blocks, freed and taken again, stay consecutive: their KV runs
    // keep coalescing into long writes.
    BlockPool pool(16);
    auto a = pool.allocate(4);
    ASSERT_TRUE(a.ok());
    ASSERT_TRUE(pool.free(*a).ok());
    auto b = pool.allocate(4);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(*b, *a);
}

// Per-request accounting, as a serving engine uses it (formerly serve's own block manager).
TEST(BlockPool, OwnersGetDistinctBlocksAndGrowTheirTables) {
    BlockPool pool(10);
    auto a = pool.allocate("a", 4);
    auto b = pool.allocate("b", 3);
    ASSERT_TRUE(a.ok() && b.ok());
    std::set<uint32_t> all(a->begin(), a->end());
    all.insert(b->begin(), b->end());
    EXPECT_EQ(all.size(), 7u);
    EXPECT_EQ(pool.used_count(), 7u);
    EXPECT_EQ(pool.free_count(), 3u);
    EXPECT_EQ(pool.num_owners(), 2u);
    // Growing a request appends to its block table.
    auto more = pool.allocate("a", 2);
    ASSERT_TRUE(more.ok());
    EXPECT_EQ(pool.blocks_of("a").size(), 6u);
    EXPECT_EQ(pool.free_count(), 1u);
}

TEST(BlockPool, OwnerRefusedWhenFullWithoutSideEffectsAndRecoversAfterFree) {
    BlockPool pool(4);
    ASSERT_TRUE(pool.allocate("a", 3).ok());
    auto r = pool.allocate("b", 2);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(r.status().message().find("1 of 4 are free"), std::string::npos);
    EXPECT_NE(r.status().message().find("request b"), std::string::npos);
    EXPECT_EQ(pool.free_count(), 1u);
    EXPECT_EQ(pool.num_owners(), 1u);
    EXPECT_FALSE(pool.can_allocate(2));
    ASSERT_TRUE(pool.free_owner("a").ok());
    EXPECT_EQ(pool.free_count(), 4u);
    EXPECT_TRUE(pool.allocate("b", 4).ok());
}

TEST(BlockPool, FreeingAnOwnerTwiceIsAnError) {
    BlockPool pool(2);
    ASSERT_TRUE(pool.allocate("a", 1).ok());
    ASSERT_TRUE(pool.free_owner("a").ok());
    Status s = pool.free_owner("a");
    EXPECT_EQ(s.code(), StatusCode::kNotFound);
    EXPECT_NE(s.message().find("request a"), std::string::npos);
    EXPECT_EQ(pool.free_count(), 2u);
}

TEST(BlockPool, AnOwnersFreedBlocksComeBackInTheSameOrder) {
    BlockPool pool(8);
    ASSERT_TRUE(pool.allocate("x", 2).ok());
    auto a = pool.allocate("a", 3);
    ASSERT_TRUE(a.ok());
    ASSERT_TRUE(pool.free_owner("a").ok());
    auto again = pool.allocate("b", 3);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(*again, *a);
}

TEST(BlockPool, BlocksForTokensRoundsUp) {
    EXPECT_EQ(blocks_for_tokens(0, 16), 0u);
    EXPECT_EQ(blocks_for_tokens(1, 16), 1u);
    EXPECT_EQ(blocks_for_tokens(16, 16), 1u);
    EXPECT_EQ(blocks_for_tokens(17, 16), 2u);
}

}  // namespace
}  // namespace ferry::kv

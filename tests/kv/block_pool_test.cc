#include "ferry/kv/block_pool.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace ferry::kv

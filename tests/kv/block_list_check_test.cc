// check_blocks, what every connector call runs on the caller's thread before a request's block
// list is taken: ids inside the pool, enough of them, none listed twice.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "kv/connector_context.h"
#include "kv/kv_fixture.h"

namespace ferry::kv {
namespace {

KvLayout pool_of(uint32_t num_blocks) {
    return testing::test_layout(1, 16, BlockOrder::kNHD, KvPlacement::kJoint, num_blocks);
}

TEST(KvBlockListCheckTest, RandomRepeatsAreNamedWithBothPlacesAndLeaveNoTrace) {
    const uint32_t seed = std::random_device{}();
    std::printf("seed %u\n", seed);
    std::mt19937 rng(seed);
    const KvLayout layout = pool_of(100000);
    std::vector<uint32_t> ids(layout.num_blocks);
    std::iota(ids.begin(), ids.end(), 0u);
    for (int round = 0; round < 50; ++round) {
        std::shuffle(ids.begin(), ids.end(), rng);
        const size_t n = 2 + rng() % 4096;
        std::vector<uint32_t> blocks(ids.begin(), ids.begin() + n);
        ASSERT_TRUE(detail::check_blocks(layout, blocks, n * 16).ok()) << "round " << round;
        const size_t first = rng() % (n - 1);
        const size_t second = first + 1 + rng() % (n - 1 - first);
        blocks[second] = blocks[first];
        Status s = detail::check_blocks(layout, blocks, n * 16);
        EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
        EXPECT_EQ(s.message(), fmt::format("block id {} is listed twice (at {} and {})",
                                           blocks[first], first, second))
            << "round " << round;
        // The failed check left nothing behind: the same ids without the repeat pass.
        blocks[second] = ids[second];
        EXPECT_TRUE(detail::check_blocks(layout, blocks, n * 16).ok()) << "round " << round;
    }
}

TEST(KvBlockListCheckTest, IdsOutsideThePoolAndShortListsAreRefused) {
    const KvLayout layout = pool_of(64);
    Status s = detail::check_blocks(layout, {1, 2, 64}, 48);
    EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
    EXPECT_NE(s.message().find("block id 64 is outside the pool of 64 blocks"), std::string::npos);
    s = detail::check_blocks(layout, {1, 2}, 33);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("33 tokens need 3 blocks of 16, 2 given"), std::string::npos);
    // A list longer than the tokens need is checked whole: a repeat past the needed ids too.
    s = detail::check_blocks(layout, {5, 6, 7, 5}, 16);
    EXPECT_EQ(s.message(), "block id 5 is listed twice (at 0 and 3)");
    EXPECT_TRUE(detail::check_blocks(layout, {63, 0, 62}, 40).ok());
}

}  // namespace
}  // namespace ferry::kv

// The staging of a GPU paged write's page ids: both lists copied intact and each side's largest
// id found, whatever the length (the vector loop's tail) and wherever the largest id sits.
#include "fabric/page_ids.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "support/multiproc.h"

namespace ferry::detail {
namespace {

TEST(PageIds, StagedCopiesAreIntactAndLargestIdsAreFound) {
    std::mt19937_64 rng(ferry::testing::test_seed("PageIds"));
    for (int round = 0; round < 2000; ++round) {
        const size_t n = round < 40 ? round : rng() % 5000;
        std::vector<uint32_t> src(n), dst(n);
        // Ids of every magnitude, the top bit included: a signed compare would get those wrong.
        for (auto& v : src) v = static_cast<uint32_t>(rng() >> (rng() % 64));
        for (auto& v : dst) v = static_cast<uint32_t>(rng() >> (rng() % 64));
        if (n > 0 && round % 3 == 0) src[rng() % n] = 0xffffffffu;
        std::vector<uint32_t> out(2 * n + 1, 0xdeadbeefu);  // poisoned, one past the end too
        const LargestIds got = stage_page_ids(src.data(), dst.data(), n, out.data());
        const uint32_t want_src = n ? *std::max_element(src.begin(), src.end()) : 0;
        const uint32_t want_dst = n ? *std::max_element(dst.begin(), dst.end()) : 0;
        ASSERT_EQ(got.src, want_src) << n << " ids, round " << round;
        ASSERT_EQ(got.dst, want_dst) << n << " ids, round " << round;
        ASSERT_TRUE(std::equal(src.begin(), src.end(), out.begin())) << "round " << round;
        ASSERT_TRUE(std::equal(dst.begin(), dst.end(), out.begin() + n)) << "round " << round;
        ASSERT_EQ(out[2 * n], 0xdeadbeefu) << "written past the staging, round " << round;
    }
}

}  // namespace
}  // namespace ferry::detail

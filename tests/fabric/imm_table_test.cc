// ImmTable::try_take: takes arrivals that are all in, never jumps a queued waiter, and consumes
// nothing when it refuses.
#include "fabric/imm_table.h"

#include <gtest/gtest.h>

#include <vector>

namespace ferry::detail {
namespace {

TEST(ImmTable, TryTakeConsumesOnlyWhenEveryArrivalIsIn) {
    ImmTable t;
    EXPECT_TRUE(t.try_take(7, 0));   // nothing to wait for
    EXPECT_FALSE(t.try_take(7, 1));  // nothing arrived
    t.arrive(7, 2);
    EXPECT_FALSE(t.try_take(7, 3));
    EXPECT_EQ(t.available(7), 2u);  // a refusal consumes nothing
    EXPECT_TRUE(t.try_take(7, 2));
    EXPECT_EQ(t.available(7), 0u);
    t.arrive(8, 5);  // another immediate's arrivals are its own
    EXPECT_FALSE(t.try_take(7, 1));
    EXPECT_TRUE(t.try_take(8, 4));
    EXPECT_EQ(t.available(8), 1u);
}

TEST(ImmTable, TryTakeNeverJumpsAQueuedWaiter) {
    ImmTable t;
    std::vector<Status> fired;
    t.add_waiter(9, 3, deadline_after(std::chrono::seconds(10)),
                 [&](const Status& s) { fired.push_back(s); });
    t.arrive(9, 2);
    // Two are in, but they are the waiter's: the waiter came first.
    EXPECT_FALSE(t.try_take(9, 1));
    EXPECT_EQ(t.available(9), 2u);
    t.arrive(9, 1);
    ASSERT_EQ(fired.size(), 1u);
    EXPECT_TRUE(fired[0].ok());
    EXPECT_EQ(t.available(9), 0u);
    t.arrive(9, 1);
    EXPECT_TRUE(t.try_take(9, 1));
}

}  // namespace
}  // namespace ferry::detail

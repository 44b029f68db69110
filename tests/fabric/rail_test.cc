// The watchdog's view of a rail worker (CallMonitor, wedge_threshold): a healthy worker that
// is slow or descheduled is never taken for one wedged inside the provider. Time is passed in,
// so the cases are exact, whatever the load of the host running them.
#include "fabric/rail.h"

#include <gtest/gtest.h>

#include "fabric/engine_impl.h"

namespace ferry::detail {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// The CI flake behind this: a starved 2-core host stretched one pass of posts over tcp past the
// 3 s op_timeout, and the pass was timed as one span.
constexpr Duration kCiOpTimeout = seconds(3);

TEST(CallMonitorTest, ALongPassOfCallsIsNotOneStuckCall) {
    CallMonitor m;
    const Duration limit = wedge_threshold(kCiOpTimeout);
    TimePoint t = Clock::now();
    // 20 s of back-to-back calls, the watchdog looking only every 4 s (itself starved): each
    // look finds the worker inside a call, but never the same one.
    for (int look = 0; look < 5; ++look) {
        for (int call = 0; call < 1000; ++call) {
            m.enter();
            m.leave();
        }
        m.enter();
        EXPECT_EQ(m.inside_for(t), Duration::zero()) << "look " << look;
        m.leave();
        t += seconds(4);
    }
    m.enter();
    EXPECT_LE(m.inside_for(t), limit);
}

TEST(CallMonitorTest, ADescheduledCallBelowTheThresholdIsNotWedged) {
    CallMonitor m;
    const Duration limit = wedge_threshold(kCiOpTimeout);
    EXPECT_EQ(limit, kMinWedgeTime);  // never the test's short op_timeout
    TimePoint t = Clock::now();
    m.enter();
    EXPECT_EQ(m.inside_for(t), Duration::zero());
    // Longer than op_timeout inside one call (the old rule's wedge), below the threshold.
    Duration in = m.inside_for(t + kCiOpTimeout + milliseconds(500));
    EXPECT_EQ(in, kCiOpTimeout + milliseconds(500));
    EXPECT_LT(in, limit);
    m.leave();  // the call returned: the worker is healthy
    EXPECT_EQ(m.inside_for(t + seconds(60)), Duration::zero());
}

TEST(CallMonitorTest, AnIdleWorkerOutsideAnyCallIsNeverStuck) {
    CallMonitor m;
    TimePoint t = Clock::now();
    m.enter();
    m.leave();
    EXPECT_EQ(m.inside_for(t), Duration::zero());
    EXPECT_EQ(m.inside_for(t + seconds(3600)), Duration::zero());  // napping for an hour
}

TEST(CallMonitorTest, ACallThatNeverReturnsIsStuckPastTheThreshold) {
    CallMonitor m;
    const Duration limit = wedge_threshold(kCiOpTimeout);
    TimePoint t = Clock::now();
    m.enter();  // and never leaves, like a provider spinning on a dead peer's lock
    EXPECT_EQ(m.inside_for(t), Duration::zero());
    EXPECT_LE(m.inside_for(t + limit), limit);
    EXPECT_GT(m.inside_for(t + limit + milliseconds(1)), limit);
}

TEST(CallMonitorTest, TheThresholdFollowsALongerOpTimeout) {
    EXPECT_EQ(wedge_threshold(seconds(30)), seconds(30));
    EXPECT_EQ(wedge_threshold(milliseconds(200)), kMinWedgeTime);
}

}  // namespace
}  // namespace ferry::detail

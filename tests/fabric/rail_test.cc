// The watchdog's view of a rail worker (CallMonitor, wedge_threshold): a healthy worker that
// is slow or descheduled is never taken for one wedged inside the provider. Time is passed in,
// so the cases are exact, whatever the load of the host running them.
#include "fabric/rail.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>

#include "fabric/engine_impl.h"
#include "support/engine_fixture.h"
#include "support/multiproc.h"

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

// A caller that gave up on a busy worker used to leave its task queued: it ran later, wrote
// through dangling references into the caller's frame and, for a registration, left an MR
// open that no one owned. Whatever the load, a task whose caller stopped waiting before the
// worker took it never runs.
TEST(RailTaskTest, ATaskItsCallerGaveUpOnNeverRuns) {
    // In a child, like every engine test: the test binary's own process stays free of
    // libfabric state.
    auto results = ::ferry::testing::run_processes(
        1,
        [](::ferry::testing::Exchange&) -> std::string {
            auto impl = std::make_shared<EngineImpl>();
            CHILD_CHECK_OK(impl->init(::ferry::testing::test_engine_config("tcp")));
            Rail& rail = impl->rails[0];
            for (int round = 0; round < 20; ++round) {
                // The worker is busy elsewhere (a long provider call, a starved host) ...
                // (Released below, or after 10 s if a check returns first.)
                auto release = std::make_shared<std::atomic<bool>>(false);
                const TimePoint give_up = Clock::now() + seconds(10);
                OpHandle blocker(rail.post_task(
                    [release, give_up] {
                        while (!release->load() && Clock::now() < give_up)
                            std::this_thread::sleep_for(milliseconds(1));
                        return ok_status();
                    },
                    OpCallback{}));
                // ... longer than this caller waits.
                std::atomic<int> ran{0};
                Status s = rail.run_on_worker(
                    [&ran] {
                        ran.fetch_add(1);
                        return ok_status();
                    },
                    milliseconds(20));
                CHILD_CHECK_MSG(s.code() == StatusCode::kTimeout &&
                                    s.message().find("will not run") != std::string::npos,
                                "{}", s.to_string());
                release->store(true);
                CHILD_CHECK_OK(blocker.wait(seconds(10)));
                // A task queued behind the abandoned one has run: the worker went past it.
                CHILD_CHECK_OK(rail.run_on_worker([] { return ok_status(); }, seconds(10)));
                CHILD_CHECK_MSG(ran.load() == 0, "round {}: the task ran after its caller left",
                                round);
            }
            // A task the worker takes in time runs once and returns its own status.
            int runs = 0;
            Status own = rail.run_on_worker(
                [&runs] {
                    ++runs;
                    return not_found("the task's own error");
                },
                seconds(10));
            CHILD_CHECK(runs == 1 && own.code() == StatusCode::kNotFound);
            impl->shutdown();
            return "";
        },
        std::chrono::seconds(120));
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

// A task the worker is running when its caller gives up (a provider call slower than the
// caller waits) finishes later. Its result goes into state it shares with the caller, not into
// the caller's frame, which is gone by then; and what it produced, here an address inserted
// into the rail's address vector, it releases itself, since no caller will own it.
TEST(RailTaskTest, ATaskThatFinishesAfterItsCallerLeftReleasesWhatItMade) {
    auto results = ::ferry::testing::run_processes(
        1,
        [](::ferry::testing::Exchange&) -> std::string {
            auto a = std::make_shared<EngineImpl>();
            auto b = std::make_shared<EngineImpl>();
            CHILD_CHECK_OK(a->init(::ferry::testing::test_engine_config("tcp")));
            CHILD_CHECK_OK(b->init(::ferry::testing::test_engine_config("tcp")));
            Rail* rail = &a->rails[0];
            const std::vector<uint8_t> peer = b->address.rail_addrs[0];
            auto addresses = [rail] { return rail->stats().peer_addresses.load(); };
            for (int round = 0; round < 5; ++round) {
                // The task's provider call takes longer than its caller waits (twice 30 ms).
                // (Released below, or after 10 s if a check returns first.)
                auto release = std::make_shared<std::atomic<bool>>(false);
                auto released = std::make_shared<std::atomic<int>>(0);
                const TimePoint give_up = Clock::now() + seconds(10);
                const TimePoint called = Clock::now();
                Result<fi_addr_t> r = rail->run_on_worker<fi_addr_t>(
                    [rail, peer, release, give_up] {
                        while (!release->load() && Clock::now() < give_up)
                            std::this_thread::sleep_for(milliseconds(1));
                        return rail->insert_address(peer);
                    },
                    milliseconds(30),
                    [rail, released](fi_addr_t& fa) {
                        if (rail->remove_address(fa).ok()) released->fetch_add(1);
                    });
                const Duration waited = Clock::now() - called;
                CHILD_CHECK_MSG(!r.ok() && r.status().code() == StatusCode::kTimeout &&
                                    r.status().message().find("released") != std::string::npos,
                                "round {}: {}", round, r.ok() ? "ok" : r.status().to_string());
                CHILD_CHECK_MSG(waited < seconds(5), "round {}: the caller waited {:.0f} ms", round,
                                to_ms(waited));
                // The caller's frame is gone (this loop's next round reuses the stack); the
                // task now inserts the address and finds nobody waiting for it.
                release->store(true);
                // Tasks run in order: once this one ran, the abandoned one has finished.
                CHILD_CHECK_OK(rail->run_on_worker([] { return ok_status(); }, seconds(10)));
                CHILD_CHECK_MSG(released->load() == 1 && addresses() == 0,
                                "round {}: released {} time(s), {} address(es) left", round,
                                released->load(), addresses());
            }
            // A task the worker finishes in time returns its own value, or its own error, and
            // keeps what it made.
            Result<fi_addr_t> fa = rail->run_on_worker<fi_addr_t>(
                [rail, peer] { return rail->insert_address(peer); }, seconds(10),
                [rail](fi_addr_t& late) { (void)rail->remove_address(late); });
            CHILD_CHECK(fa.ok() && addresses() == 1);
            CHILD_CHECK_OK(rail->run_on_worker([rail, f = *fa] { return rail->remove_address(f); },
                                               seconds(10)));
            Result<int> err = rail->run_on_worker<int>(
                []() -> Result<int> { return not_found("the task's own error"); }, seconds(10));
            CHILD_CHECK(!err.ok() && err.status().code() == StatusCode::kNotFound);
            CHILD_CHECK(addresses() == 0);
            a->shutdown();
            b->shutdown();
            return "";
        },
        std::chrono::seconds(120));
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

}  // namespace
}  // namespace ferry::detail

// A public call runs its task on the caller's thread while the connector thread sleeps
// (Inbox::try_run_here): the ownership rule of connector_context.h. The Inbox on its own (who
// runs what, in which order, never two at once), then pushes handed over from several threads
// at once with cancels racing them, between real processes on tcp and shm.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "kv/connector_context.h"
#include "kv/kv_fixture.h"

namespace ferry::kv {
namespace {

using detail::Inbox;
using ::ferry::testing::Exchange;
using testing::kDecode;
using testing::kPoison;
using testing::kPrefill;
using testing::kWait;

// The connector thread's loop, without the connector: takes and runs tasks until stopped, then
// closes the inbox with the state lock held, as KvConnector does.
class ConnectorLoop {
  public:
    explicit ConnectorLoop(Inbox& inbox) : inbox_(inbox) {
        thread_ = std::thread([this] {
            std::unique_lock state(inbox_.state_lock());
            while (!stop_.load()) {
                auto tasks = inbox_.take(state, Clock::now() + std::chrono::milliseconds(5));
                for (auto& t : tasks) t();
            }
            inbox_.close();
        });
    }
    ~ConnectorLoop() { stop(); }
    void stop() {
        stop_.store(true);
        inbox_.post([] {});
        if (thread_.joinable()) thread_.join();
    }
    std::thread::id id() const { return thread_.get_id(); }

  private:
    Inbox& inbox_;
    std::atomic<bool> stop_{false};
    std::thread thread_;
};

// Tries until the loop sleeps and the task runs here; false after `timeout`.
bool run_here_within(Inbox& inbox, Inbox::Task& t, Duration timeout) {
    const TimePoint end = Clock::now() + timeout;
    while (Clock::now() < end) {
        if (inbox.try_run_here(t)) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
}

TEST(KvInboxTest, TaskRunsOnTheCallerWhileTheConnectorThreadSleepsAndNeverReenters) {
    Inbox inbox;
    Inbox::Task noop = [] {};
    EXPECT_FALSE(inbox.try_run_here(noop)) << "no connector thread waits yet";
    ConnectorLoop loop(inbox);
    std::thread::id ran_on;
    bool here = false, nested = true;
    Inbox::Task t = [&] {
        ran_on = std::this_thread::get_id();
        here = Inbox::running_here();
        // The holder of the state lock never runs a second task in place: that one is queued.
        Inbox::Task inner = [] {};
        nested = inbox.try_run_here(inner);
    };
    ASSERT_TRUE(run_here_within(inbox, t, kWait)) << "the connector thread never slept";
    EXPECT_EQ(ran_on, std::this_thread::get_id());
    EXPECT_TRUE(here);
    EXPECT_FALSE(nested);
    EXPECT_FALSE(Inbox::running_here());

    // On the connector thread itself a task is never run in place either.
    std::atomic<int> on_loop{-1};
    ASSERT_TRUE(inbox.post([&] {
        Inbox::Task inner = [] {};
        on_loop.store(inbox.try_run_here(inner) || Inbox::running_here() ? 1 : 0);
    }));
    const TimePoint end = Clock::now() + kWait;
    while (on_loop.load() < 0 && Clock::now() < end) std::this_thread::yield();
    EXPECT_EQ(on_loop.load(), 0);

    // Once the connector thread closed the inbox, nothing runs any more, here or there.
    loop.stop();
    bool ran = false;
    Inbox::Task late = [&] { ran = true; };
    EXPECT_FALSE(inbox.try_run_here(late));
    EXPECT_FALSE(inbox.post([&] { ran = true; }));
    EXPECT_FALSE(ran);
}

TEST(KvInboxTest, ConcurrentCallersNeverOvertakeTheirQueuedTasksNorRunTwoAtOnce) {
    const uint64_t seed = ::ferry::testing::test_seed("KvInbox.Concurrent");
    constexpr int kThreads = 4;
    constexpr int kTasks = 3000;
    Inbox inbox;
    ConnectorLoop loop(inbox);
    // Touched only by tasks, without a lock of its own: the state lock is what protects it.
    std::vector<std::pair<int, int>> log;
    int running = 0, overlaps = 0;
    std::atomic<int> here{0}, queued{0};
    std::vector<std::thread> callers;
    for (int c = 0; c < kThreads; ++c) {
        callers.emplace_back([&, c] {
            std::mt19937_64 rng(seed + c);
            for (int k = 0; k < kTasks; ++k) {
                Inbox::Task t = [&, c, k] {
                    if (running++ != 0) ++overlaps;
                    log.emplace_back(c, k);
                    --running;
                };
                if (inbox.try_run_here(t)) {
                    here.fetch_add(1);
                } else {
                    ASSERT_TRUE(inbox.post(std::move(t)));
                    queued.fetch_add(1);
                }
                if (rng() % 64 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
            }
        });
    }
    for (auto& t : callers) t.join();
    std::atomic<bool> drained{false};
    ASSERT_TRUE(inbox.post([&] { drained.store(true); }));
    const TimePoint end = Clock::now() + kWait;
    while (!drained.load() && Clock::now() < end) std::this_thread::yield();
    ASSERT_TRUE(drained.load());
    loop.stop();
    std::printf("seed %llu: %d tasks run on their caller's thread, %d queued\n",
                static_cast<unsigned long long>(seed), here.load(), queued.load());
    EXPECT_EQ(overlaps, 0);
    ASSERT_EQ(log.size(), size_t{kThreads} * kTasks);
    std::vector<int> next(kThreads, 0);
    for (const auto& [c, k] : log) {
        ASSERT_EQ(k, next[c]) << "caller " << c << "'s task " << k << " ran out of its order";
        next[c] = k + 1;
    }
}

// ---- between processes ----

constexpr uint8_t kReused = 0x3c;

class KvCallerThreadTest : public ::testing::TestWithParam<std::string> {};

// Prefill hands 24 pushes over from four threads at once while decode registers them (half
// before, half during) and cancels every fifth at a random moment. Every push that completes
// delivers every byte; a cancelled one never writes into its blocks once decode has them back;
// every report comes on the connector thread, never inside a caller's call; nothing leaks.
TEST_P(KvCallerThreadTest, PushesFromSeveralThreadsWithCancelsRacingDeliverOrLeaveBlocksAlone) {
    const uint64_t seed = ::ferry::testing::test_seed("KvCallerThread.Pushes");
    constexpr int kRequests = 24;
    constexpr int kCallers = 4;
    const KvLayout layout =
        testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 256);
    std::mt19937_64 rng(seed);
    std::vector<uint32_t> tokens(kRequests);
    for (auto& t : tokens) t = 1 + static_cast<uint32_t>(rng() % 150);
    auto id_of = [](int i) { return 0x9000 + static_cast<uint64_t>(i); };
    auto cancelled = [](int i) { return i % 5 == 2; };
    auto results = ::ferry::testing::run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            testing::NodeOptions opt;
            opt.provider = GetParam();
            KvRank self{layout, 0, 1};
            const bool prefill = ex.rank() == kPrefill;
            CHILD_ASSIGN_OK(auto node,
                            testing::make_kv_node(ex, self, opt, seed, prefill ? 0 : kPoison));
            testing::KvNode& n = *node;
            std::vector<std::vector<uint32_t>> blocks;
            for (int i = 0; i < kRequests; ++i) {
                CHILD_ASSIGN_OK(auto b, n.blocks->allocate(blocks_for_tokens(tokens[i], 16)));
                if (prefill) testing::fill_request(n, id_of(i), b, tokens[i]);
                blocks.push_back(std::move(b));
            }
            auto reg = [&](int i) {
                return n.conn->register_push(
                    {id_of(i), 1, {n.addrs[kPrefill]}, blocks[i], tokens[i]});
            };
            if (!prefill) {
                for (int i = 0; i < kRequests; i += 2) CHILD_CHECK_OK(reg(i));
            }
            CHILD_CHECK_OK(ex.barrier());
            std::vector<std::thread> threads;
            std::vector<std::string> errors(kCallers);
            std::vector<std::thread::id> caller_ids(kCallers);
            if (prefill) {
                CHILD_CHECK_OK(testing::wait_messages(n, kRequests / 2, kWait));
                for (int c = 0; c < kCallers; ++c) {
                    threads.emplace_back([&, c] {
                        caller_ids[c] = std::this_thread::get_id();
                        std::mt19937_64 r(seed + c);
                        for (int i = c; i < kRequests; i += kCallers) {
                            Status s = n.conn->prefill_done(id_of(i), blocks[i], tokens[i]);
                            if (!s.ok() && errors[c].empty()) errors[c] = s.to_string();
                            std::this_thread::sleep_for(std::chrono::microseconds(r() % 300));
                        }
                    });
                }
            } else {
                std::mt19937_64 r(seed ^ 1);
                for (int i = 1; i < kRequests; i += 2) CHILD_CHECK_OK(reg(i));
                for (int i = 0; i < kRequests; ++i) {
                    if (!cancelled(i)) continue;
                    std::this_thread::sleep_for(std::chrono::microseconds(r() % 500));
                    CHILD_CHECK_OK(n.conn->cancel(id_of(i)));
                }
            }
            for (auto& t : threads) t.join();
            for (int c = 0; prefill && c < kCallers; ++c) {
                CHILD_CHECK_MSG(errors[c].empty(), "caller {}: {}", c, errors[c]);
            }
            std::vector<uint8_t> image(n.mem.size(), kPoison);
            std::vector<bool> reused(kRequests, false);
            for (int i = 0; i < kRequests; ++i) {
                CHILD_ASSIGN_OK(auto r, n.results.wait(prefill, id_of(i), kWait));
                const bool ok = r.status.ok();
                CHILD_CHECK_MSG(ok || (cancelled(i) && r.status.code() == StatusCode::kCancelled),
                                "transfer {:x}: {}", id_of(i), r.status.to_string());
                if (prefill) continue;
                if (ok) {
                    testing::expect_request(self, image, id_of(i), blocks[i], tokens[i]);
                    continue;
                }
                // Back to decode: the blocks hold another request's data now.
                reused[i] = true;
                for (uint32_t b : blocks[i]) {
                    for (KvPart part : {KvPart::kK, KvPart::kV}) {
                        for (uint32_t l = 0; l < layout.num_layers; ++l) {
                            const uint64_t off = layout.slab_offset(l, part, b);
                            std::memset(n.mem.data() + off, kReused, layout.slab_bytes());
                            std::memset(image.data() + off, kReused, layout.slab_bytes());
                        }
                    }
                }
            }
            for (int c = 0; prefill && c < kCallers; ++c) {
                CHILD_CHECK_MSG(!n.results.delivered_on(caller_ids[c]),
                                "a report came on caller {}'s thread", c);
            }
            CHILD_CHECK_OK(ex.barrier());  // every prefill write has completed
            if (!prefill) {
                std::string diff = testing::compare_pool(n.mem, image);
                CHILD_CHECK_MSG(diff.empty(), "decode: {}", diff);
            }
            for (auto& b : blocks) CHILD_CHECK_OK(n.blocks->free(b));
            std::string leak = testing::check_no_leak(n);
            if (!leak.empty()) return leak;
            CHILD_CHECK_OK(ex.barrier());
            return "";
        },
        std::chrono::seconds(120));
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Providers, KvCallerThreadTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry::kv

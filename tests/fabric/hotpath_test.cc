// The engine's hot path between real processes: batches (submit_batch) to several peers with
// one of them killed mid-batch, FI_INJECT size boundaries, a scatter to 64 peers, and a read
// behind one to a killed shm peer.
#include <gtest/gtest.h>
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "ferry/common/bytes.h"
#include "ferry/fabric/engine.h"
#include "support/byte_pattern.h"
#include "support/engine_fixture.h"
#include "support/multiproc.h"

namespace ferry {
namespace {

using testing::check_fill;
using testing::check_pattern;
using testing::Exchange;
using testing::make_mesh_node;
using testing::MeshNode;
using testing::pattern;
using testing::run_processes;
using testing::test_engine_config;

constexpr uint8_t kPoison = 0xCD;
const auto kRunTimeout = std::chrono::seconds(150);
const auto kWait = std::chrono::seconds(20);

// The four processes of a kill test: the victim died of SIGKILL, the others finished cleanly.
void expect_only_victim_killed(const std::vector<testing::ChildResult>& results, int victim) {
    ASSERT_EQ(results.size(), 4u);
    EXPECT_EQ(results[victim].term_signal, SIGKILL);
    for (int r = 0; r < 4; ++r) {
        if (r == victim) continue;
        EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].error;
    }
}

class HotPathTest : public ::testing::TestWithParam<std::string> {
  protected:
    EngineConfig config() const { return test_engine_config(GetParam()); }
};

// Layout of every target's 1 MiB buffer: [0, 512 KiB) its own pattern (what reads fetch),
// [512 KiB, 1 MiB) poison until the initiator's writes land there.
constexpr size_t kBuf = 1 << 20;
constexpr size_t kHalf = kBuf / 2;
constexpr size_t kSlot = 32 * 1024;  // one slot per entry kind

// Lengths of the write, the write with immediate and the read to target t: both sides
// derive them from the seed.
struct EntryLens {
    uint64_t write, write_imm, read;
};
EntryLens lens_for(uint64_t seed, int t) {
    std::mt19937_64 rng(seed + t);
    return {1 + rng() % kSlot, 1 + rng() % kSlot, 1 + rng() % kSlot};
}

TEST_P(HotPathTest, BatchesToSeveralPeersSurviveOneDyingMidBatch) {
    uint64_t seed = testing::test_seed("BatchKill");
    const int kVictim = 2;
    auto results = run_processes(
        4,
        [&](Exchange& ex) -> std::string {
            EngineConfig c = config();
            c.op_timeout = std::chrono::seconds(2);
            const uint8_t fill = ex.rank() == 0 ? 0 : kPoison;
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, c, kBuf, fill));
            if (ex.rank() != 0) {
                for (size_t i = 0; i < kHalf; ++i) n.buf[i] = pattern(seed + ex.rank(), i);
            } else {
                for (size_t i = 0; i < kHalf; ++i) n.buf[i] = pattern(seed, i);
            }
            CHILD_CHECK(ex.barrier().ok());  // patterns in place before anyone reads
            if (ex.rank() == kVictim) {
                CHILD_CHECK_OK(n.engine->wait_imm(10 + kVictim, 20, kWait));
                raise(SIGKILL);  // dies with batch entries for it still being posted
            }
            if (ex.rank() == 0) {
                // Per target: a write to slot 0, a write with immediate to slot 1, a read of
                // target bytes into this side's read area for that target.
                auto entries_for = [&](int t, std::vector<BatchEntry>& out) {
                    EntryLens l = lens_for(seed, t);
                    out.push_back(WriteOp{n.peer[t], n.mr.get(), 0, &n.desc[t], kHalf, l.write,
                                          std::nullopt});
                    out.push_back(WriteOp{n.peer[t], n.mr.get(), kSlot, &n.desc[t], kHalf + kSlot,
                                          l.write_imm, 10u + t});
                    out.push_back(ReadOp{n.peer[t], n.mr.get(), kHalf + t * 2 * kSlot, &n.desc[t],
                                         64, l.read});
                };
                int victim_failures = 0, live_ok = 0, live_lost = 0, rounds = 0;
                int clean_after = 0;  // rounds without a live loss after the victim's first failure
                bool wedged = false;
                auto start = Clock::now();
                // Bounded: until the victim's entries fail and three clean rounds after that.
                while (Clock::now() - start < std::chrono::seconds(40) && clean_after < 3) {
                    std::vector<BatchEntry> batch;
                    std::vector<int> target;
                    for (int t = 1; t <= 3; ++t) {
                        entries_for(t, batch);
                        target.insert(target.end(), 3, t);
                    }
                    bool round_clean = true;
                    const bool victim_failed_before = victim_failures > 0;
                    int victim_failed_now = 0;
                    std::vector<Status> got(batch.size());
                    std::vector<TimePoint> done_at(batch.size());
                    auto posted_at = Clock::now();
                    std::vector<OpHandle> hs = n.engine->submit_batch(
                        batch, [&](size_t i, const Status&) { done_at[i] = Clock::now(); });
                    CHILD_CHECK(hs.size() == batch.size());
                    for (size_t i = 0; i < hs.size(); ++i) {
                        got[i] = hs[i].wait(c.op_timeout + std::chrono::seconds(8));
                        CHILD_CHECK_MSG(hs[i].done(),
                                        "entry {} to target {} did not finish within "
                                        "the op timeout + 8 s: {}",
                                        i, target[i], got[i].to_string());
                    }
                    ++rounds;
                    for (size_t i = 0; i < hs.size(); ++i) {
                        if (target[i] != kVictim || got[i].ok()) continue;
                        ++victim_failures;
                        ++victim_failed_now;
                        // Failed within the op timeout (plus the sweep period and slack for a
                        // loaded host), not after some unbounded hang.
                        CHILD_CHECK_MSG(
                            done_at[i] - posted_at < c.op_timeout + std::chrono::seconds(3),
                            "victim entry failed only after {:.0f} ms",
                            to_ms(done_at[i] - posted_at));
                    }
                    for (size_t i = 0; i < hs.size(); ++i) {
                        if (target[i] == kVictim) continue;
                        if (got[i].ok()) {
                            ++live_ok;
                            continue;
                        }
                        if (got[i].message().find("wedged") != std::string::npos) {
                            wedged = true;  // shm itself wedged on the dead peer (see below)
                            continue;
                        }
                        // Only in the round the victim's entries first fail, and only on shm:
                        // a live entry posted behind one to the dying victim waits for that
                        // one's answer in shm's response queue, so the engine gives it up
                        // when the victim's entry times out (it says so). Later rounds go
                        // through a fresh initiator endpoint and must all succeed.
                        CHILD_CHECK_MSG(
                            GetParam() == "shm" && !victim_failed_before && victim_failed_now > 0 &&
                                got[i].code() == StatusCode::kUnavailable &&
                                got[i].message().find("behind an operation to a peer "
                                                      "whose process died") != std::string::npos,
                            "live target {} entry {} failed: {}", target[i], i, got[i].to_string());
                        ++live_lost;
                        round_clean = false;
                    }
                    if (wedged) break;
                    if (victim_failed_before) {
                        CHILD_CHECK_MSG(round_clean,
                                        "round {} after the victim failed lost live "
                                        "entries",
                                        rounds);
                        ++clean_after;
                    }
                    if (!round_clean) continue;
                    // Reads of live targets fetched their pattern.
                    for (int t : {1, 3}) {
                        EntryLens l = lens_for(seed, t);
                        std::string d =
                            check_pattern(n.buf, kHalf + t * 2 * kSlot, l.read, seed + t, 64);
                        CHILD_CHECK_MSG(d.empty(), "read from target {}: {}", t, d);
                    }
                }
                CHILD_CHECK_MSG(victim_failures > 0,
                                "no entry to the killed target failed in {} "
                                "rounds",
                                rounds);
                CHILD_CHECK_MSG(wedged || clean_after >= 3,
                                "only {} clean rounds after the victim failed", clean_after);
                CHILD_CHECK_MSG(wedged || live_ok + live_lost >= 6 * rounds,
                                "{} live entries ok in {} rounds", live_ok, rounds);
                std::fprintf(
                    stderr,
                    "[batch-kill] %d rounds, %d victim failures, %d live ok, %d live lost%s\n",
                    rounds, victim_failures, live_ok, live_lost, wedged ? ", rail wedged" : "");
                if (wedged) {
                    // A fresh engine reaches the live targets (as in TargetKilledMidStream).
                    CHILD_ASSIGN_OK(auto fresh, TransferEngine::create(c));
                    CHILD_ASSIGN_OK(auto mr2, fresh->register_memory(n.buf.data(), n.buf.size()));
                    for (int t : {1, 3}) {
                        CHILD_ASSIGN_OK(PeerId p, fresh->connect(n.addr[t]));
                        EntryLens l = lens_for(seed, t);
                        CHILD_CHECK_OK(
                            fresh->write({p, mr2.get(), 0, &n.desc[t], kHalf, l.write, {}})
                                .wait(kWait));
                        CHILD_CHECK_OK(fresh
                                           ->write({p, mr2.get(), kSlot, &n.desc[t], kHalf + kSlot,
                                                    l.write_imm, 10u + t})
                                           .wait(kWait));
                        CHILD_CHECK_OK(fresh->signal(p, 99).wait(kWait));
                    }
                    mr2.reset();
                    fresh.reset();
                } else {
                    // One last signal per live target: everything before it has completed here.
                    for (int t : {1, 3})
                        CHILD_CHECK_OK(n.engine->signal(n.peer[t], 99).wait(kWait));
                }
                n.mr.reset();
                n.engine.reset();
            }
            if (ex.rank() == 1 || ex.rank() == 3) {
                CHILD_CHECK_OK(n.engine->wait_imm(99, 1, std::chrono::seconds(90)));
                EntryLens l = lens_for(seed, ex.rank());
                // Writes landed intact, and nothing past their lengths was touched.
                std::string d = check_pattern(n.buf, kHalf, l.write, seed, 0);
                CHILD_CHECK_MSG(d.empty(), "write: {}", d);
                d = check_fill(n.buf, kHalf + l.write, kSlot - l.write, kPoison);
                CHILD_CHECK_MSG(d.empty(), "past the write: {}", d);
                d = check_pattern(n.buf, kHalf + kSlot, l.write_imm, seed, kSlot);
                CHILD_CHECK_MSG(d.empty(), "write with immediate: {}", d);
                d = check_fill(n.buf, kHalf + kSlot + l.write_imm,
                               kBuf - kHalf - kSlot - l.write_imm, kPoison);
                CHILD_CHECK_MSG(d.empty(), "past the write with immediate: {}", d);
                CHILD_CHECK(n.engine->imm_available(10 + ex.rank()) >= 1);
            }
            return "";
        },
        kRunTimeout);
    expect_only_victim_killed(results, kVictim);
}

// Small writes with immediates (at most the inject size: on shm posted as the rail's worker
// pops them and done at their post) in batches of random sizes to three peers, one killed
// mid-stream: every entry finishes within the op timeout, every write to a live peer arrives
// exactly once with its bytes intact, and entries for the dead peer fail (shm's done-at-post
// writes to a dead peer may also "succeed" until its command queue is full).
TEST_P(HotPathTest, SmallWritesWithImmediatesSurviveAPeerKilledMidStream) {
    uint64_t seed = testing::test_seed("SmallImmKill");
    const int kVictim = 2;
    constexpr size_t kMaxLen = 64;   // at most tcp;ofi_rxm's and shm's inject sizes
    constexpr size_t kTally = 1024;  // where the initiator leaves a live target its tally
    constexpr uint32_t kImmBase = 200, kDone = 99;
    auto results = run_processes(
        4,
        [&](Exchange& ex) -> std::string {
            EngineConfig c = config();
            c.op_timeout = std::chrono::seconds(2);
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, c, 1 << 16, kPoison));
            if (ex.rank() == kVictim) {
                CHILD_CHECK_OK(n.engine->wait_imm(kImmBase + kVictim, 50, kWait));
                raise(SIGKILL);  // dies with writes for it still being posted
            }
            if (ex.rank() == 0) {
                for (int t = 1; t <= 3; ++t) {
                    for (size_t i = 0; i < kMaxLen; ++i)
                        n.buf[t * kMaxLen + i] = pattern(seed + t, i);
                }
                std::mt19937_64 rng(seed);
                // Per target: writes that succeeded, the longest of them, the longest tried.
                uint64_t live_ok[4] = {}, live_max[4] = {}, tried_max[4] = {};
                int victim_failures = 0, rounds = 0, clean_after = 0;
                bool wedged = false;
                auto start = Clock::now();
                // Bounded: until the victim's entries fail and three rounds after that.
                while (Clock::now() - start < std::chrono::seconds(40) && clean_after < 3) {
                    const size_t count = 1 + rng() % 32;
                    std::vector<BatchEntry> batch;
                    std::vector<int> target;
                    for (size_t i = 0; i < count; ++i) {
                        const int t = 1 + static_cast<int>(rng() % 3);
                        const uint64_t len = 1 + rng() % kMaxLen;
                        batch.push_back(WriteOp{n.peer[t], n.mr.get(), t * kMaxLen, &n.desc[t], 0,
                                                len, kImmBase + t});
                        target.push_back(t);
                        tried_max[t] = std::max(tried_max[t], len);
                    }
                    std::vector<TimePoint> done_at(count);
                    const auto posted_at = Clock::now();
                    std::vector<OpHandle> hs = n.engine->submit_batch(
                        batch, [&](size_t i, const Status&) { done_at[i] = Clock::now(); });
                    CHILD_CHECK(hs.size() == count);
                    const bool victim_failed_before = victim_failures > 0;
                    for (size_t i = 0; i < count; ++i) {
                        Status got = hs[i].wait(c.op_timeout + std::chrono::seconds(8));
                        CHILD_CHECK_MSG(hs[i].done(), "entry {} to target {} still running: {}", i,
                                        target[i], got.to_string());
                        const auto took = done_at[i] - posted_at;
                        CHILD_CHECK_MSG(took < c.op_timeout + std::chrono::seconds(3),
                                        "entry {} to target {} finished only after {:.0f} ms", i,
                                        target[i], to_ms(took));
                        if (target[i] == kVictim) {
                            victim_failures += !got.ok();
                        } else if (got.ok()) {
                            ++live_ok[target[i]];
                            live_max[target[i]] =
                                std::max(live_max[target[i]], std::get<WriteOp>(batch[i]).length);
                        } else if (got.message().find("wedged") != std::string::npos) {
                            wedged = true;  // shm itself wedged on the dead peer
                        } else {
                            return fmt::format("live target {} entry {} failed: {}", target[i], i,
                                               got.to_string());
                        }
                    }
                    ++rounds;
                    if (wedged) break;
                    if (victim_failed_before) ++clean_after;
                }
                CHILD_CHECK_MSG(wedged || victim_failures > 0,
                                "no entry to the killed target failed in {} rounds", rounds);
                std::fprintf(stderr,
                             "[small-imm-kill] %d rounds, %d victim failures, live ok %llu / "
                             "%llu%s\n",
                             rounds, victim_failures, static_cast<unsigned long long>(live_ok[1]),
                             static_cast<unsigned long long>(live_ok[3]),
                             wedged ? ", rail wedged" : "");
                // Each live target's tally (writes that succeeded, the longest, whether the
                // count is exact), then the signal to check it; through a fresh engine when
                // the rail wedged.
                std::unique_ptr<TransferEngine> fresh;
                std::unique_ptr<MemoryRegion> fresh_mr;
                if (wedged) {
                    CHILD_ASSIGN_OK(fresh, TransferEngine::create(c));
                    CHILD_ASSIGN_OK(fresh_mr, fresh->register_memory(n.buf.data(), n.buf.size()));
                }
                TransferEngine& e = wedged ? *fresh : *n.engine;
                MemoryRegion* mr = wedged ? fresh_mr.get() : n.mr.get();
                for (int t : {1, 3}) {
                    PeerId p = n.peer[t];
                    if (wedged) {
                        CHILD_ASSIGN_OK(p, fresh->connect(n.addr[t]));
                    }
                    const uint64_t tally[4] = {live_ok[t], live_max[t], tried_max[t],
                                               wedged ? 0u : 1u};
                    std::memcpy(n.buf.data() + kTally + 64 * t, tally, sizeof(tally));
                    CHILD_CHECK_OK(e.write({p, mr, kTally + 64 * t, &n.desc[t], kTally,
                                            sizeof(tally), std::nullopt})
                                       .wait(kWait));
                    CHILD_CHECK_OK(e.signal(p, kDone).wait(kWait));
                }
                fresh_mr.reset();
                fresh.reset();
                n.mr.reset();
                n.engine.reset();
            }
            if (ex.rank() == 1 || ex.rank() == 3) {
                CHILD_CHECK_OK(n.engine->wait_imm(kDone, 1, std::chrono::seconds(90)));
                uint64_t tally[4];  // writes ok, longest ok, longest tried, count exact
                std::memcpy(tally, n.buf.data() + kTally, sizeof(tally));
                const uint32_t imm = kImmBase + ex.rank();
                if (tally[3]) {
                    // Every write that succeeded arrived once, and nothing more.
                    CHILD_CHECK_OK(n.engine->wait_imm(imm, tally[0], kWait));
                    CHILD_CHECK_MSG(n.engine->imm_available(imm) == 0, "{} arrivals too many",
                                    n.engine->imm_available(imm));
                } else {
                    CHILD_CHECK_MSG(n.engine->imm_available(imm) >= tally[0],
                                    "{} arrivals for {} writes", n.engine->imm_available(imm),
                                    tally[0]);
                }
                std::string d = check_pattern(n.buf, 0, tally[1], seed + ex.rank(), 0);
                CHILD_CHECK_MSG(d.empty(), "writes: {}", d);
                d = check_fill(n.buf, tally[2], kTally - tally[2], kPoison);
                CHILD_CHECK_MSG(d.empty(), "past the longest write: {}", d);
            }
            return "";
        },
        kRunTimeout);
    expect_only_victim_killed(results, kVictim);
}

TEST_P(HotPathTest, WritesAtAndJustPastTheInjectSizeArriveIntact) {
    uint64_t seed = testing::test_seed("Inject");
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, config(), 1 << 16, kPoison));
            const size_t inj = n.engine->inject_size();
            // Both providers here inject (shm 4096, tcp;ofi_rxm 64 in libfabric 1.17).
            CHILD_CHECK_MSG(inj > 0 && inj + 1 < 8192, "inject size {}", inj);
            const size_t at = 0, past = 16384;  // destinations of the two writes
            if (ex.rank() == 0) {
                for (size_t i = 0; i < n.buf.size(); ++i) n.buf[i] = pattern(seed, i);
                EngineStats before = n.engine->stats();
                CHILD_CHECK_OK(
                    n.engine->write({n.peer[1], n.mr.get(), 100, &n.desc[1], at, inj, 7u})
                        .wait(kWait));
                EngineStats mid = n.engine->stats();
                CHILD_CHECK_OK(
                    n.engine->write({n.peer[1], n.mr.get(), 100, &n.desc[1], past, inj + 1, 7u})
                        .wait(kWait));
                EngineStats after = n.engine->stats();
                // Exactly inject_size bytes went with FI_INJECT, one byte more did not.
                CHILD_CHECK_MSG(mid.ops_injected == before.ops_injected + 1, "{} -> {}",
                                before.ops_injected, mid.ops_injected);
                CHILD_CHECK_MSG(after.ops_injected == mid.ops_injected, "{} -> {}",
                                mid.ops_injected, after.ops_injected);
                CHILD_CHECK(ex.barrier().ok());
            } else {
                CHILD_CHECK_OK(n.engine->wait_imm(7, 2, kWait));
                std::string d = check_pattern(n.buf, at, inj, seed, 100);
                CHILD_CHECK_MSG(d.empty(), "write of inject_size {}: {}", inj, d);
                d = check_fill(n.buf, at + inj, past - at - inj, kPoison);
                CHILD_CHECK_MSG(d.empty(), "after the inject-size write: {}", d);
                d = check_pattern(n.buf, past, inj + 1, seed, 100);
                CHILD_CHECK_MSG(d.empty(), "write of inject_size + 1: {}", d);
                d = check_fill(n.buf, past + inj + 1, n.buf.size() - past - inj - 1, kPoison);
                CHILD_CHECK_MSG(d.empty(), "after the inject_size + 1 write: {}", d);
                CHILD_CHECK(ex.barrier().ok());
            }
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// Pages [pages] of rank 0's buffer to the same pages of rank 1's.
PagedWriteOp paged_to_rank1(const MeshNode& n, uint32_t page, std::span<const uint32_t> pages) {
    return PagedWriteOp{.peer = n.peer[1],
                        .src = n.mr.get(),
                        .dst = &n.desc[1],
                        .page_size = page,
                        .src_pages = pages,
                        .dst_pages = pages,
                        .imm = std::nullopt};
}

// A KV transfer's writes posted at once on tcp (131,072 of 4 KiB in ferry.bench_peers) wait in
// the worker's pending list behind the provider's in-flight limit. The deadline sweep walked
// all of them every tick (1 ms), so the more were posted at once, the more each one cost: the
// per-write time of one paged write of 131,072 pages was several times that of 4,096 pages.
// Now the walk happens only once the earliest pending deadline may have passed.
TEST(HotPathTcpTest, ManyWritesPostedAtOnceCostNoMoreEachThanFew) {
    constexpr uint32_t kPage = 512, kSmall = 4096, kLarge = 131072;
    constexpr size_t kBytes = size_t{2} * kLarge * kPage;  // every other page: no coalescing
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, test_engine_config("tcp"), kBytes, 1));
            if (ex.rank() == 1) {
                CHILD_CHECK(ex.barrier().ok());  // rank 0 measured
                return "";
            }
            std::vector<uint32_t> pages(kLarge);
            for (uint32_t i = 0; i < kLarge; ++i) pages[i] = 2 * i;
            std::string failed;  // the last failed write's status
            auto per_write_us = [&](uint32_t count) {
                PagedWriteOp w =
                    paged_to_rank1(n, kPage, std::span<const uint32_t>(pages.data(), count));
                auto t0 = std::chrono::steady_clock::now();
                Status s = n.engine->paged_write(w).wait(std::chrono::seconds(120));
                double us =
                    std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                        .count();
                if (!s.ok()) failed = fmt::format("{} pages: {}", count, s.to_string());
                return s.ok() ? us / count : -1.0;
            };
            per_write_us(kSmall);  // warm-up: connection, first touch
            std::vector<double> small, large;
            for (int i = 0; i < 3; ++i) {  // alternating, the medians compared (a loaded host)
                double a = per_write_us(kSmall), b = per_write_us(kLarge);
                // Before the fix, the 131,072 writes outlived the op timeout.
                CHILD_CHECK_MSG(a > 0 && b > 0, "a paged write failed: {}", failed);
                small.push_back(a);
                large.push_back(b);
                std::printf("per write: %u at once %.3f us, %u at once %.3f us\n", kSmall, a,
                            kLarge, b);
            }
            std::sort(small.begin(), small.end());
            std::sort(large.begin(), large.end());
            CHILD_CHECK(ex.barrier().ok());
            CHILD_CHECK_MSG(large[1] < 4.0 * small[1],
                            "{} writes at once cost {:.3f} us each, {} at once {:.3f} us (medians)",
                            kLarge, large[1], kSmall, small[1]);
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// The second paged write of a KV transfer's size takes its 131,072 operations from the pool
// the first one filled: before, all but 1024 of them went back to malloc at completion and were
// allocated again, 32 MiB per transfer on the caller's thread (the bulk of paged_write's cost).
TEST(HotPathTcpTest, ASecondLargePagedWriteAllocatesNoNewOperations) {
    constexpr uint32_t kPage = 512, kPages = 131072;
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, test_engine_config("tcp"),
                                                       size_t{2} * kPages * kPage, 1));
            if (ex.rank() == 1) {
                CHILD_CHECK(ex.barrier().ok());
                return "";
            }
            std::vector<uint32_t> pages(kPages);
            for (uint32_t i = 0; i < kPages; ++i) pages[i] = 2 * i;  // no coalescing
            PagedWriteOp w = paged_to_rank1(n, kPage, pages);
            CHILD_CHECK_OK(n.engine->paged_write(w).wait(std::chrono::seconds(120)));
            const size_t before = mallinfo2().uordblks;
            OpHandle h = n.engine->paged_write(w);
            const size_t after = mallinfo2().uordblks;  // before its operations come back
            CHILD_CHECK_OK(h.wait(std::chrono::seconds(120)));
            CHILD_CHECK(ex.barrier().ok());
            CHILD_CHECK_MSG(after < before + (4u << 20),
                            "the second paged write of {} pages allocated {} KiB more", kPages,
                            (after > before ? after - before : 0) >> 10);
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// 64 target engines in one process (64 processes would not fit a 2-core machine's test
// budget; the engines are as separate as in two processes: own domain, endpoint, shm region).
TEST_P(HotPathTest, ScatterToSixtyFourPeersDeliversEveryByte) {
    uint64_t seed = testing::test_seed("Scatter64");
    constexpr int kPeers = 64;
    constexpr size_t kPeerBuf = 64 * 1024;
    constexpr size_t kSrc = 4 << 20;
    // tcp;ofi_rxm takes ~50 s here on the 2-core dev machine (64 engines set up, 64
    // connections made on first use), so this one gets more than kRunTimeout.
    const auto kScatterTimeout = std::chrono::seconds(250);
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            EngineConfig c = config();
            // Slices: 1 to 3 per member, random lengths (1 B .. 16 KiB), disjoint destinations.
            std::mt19937_64 rng(seed);
            std::vector<ScatterSlice> slices;
            std::vector<int> per_member(kPeers, 0);
            for (uint32_t m = 0; m < kPeers; ++m) {
                int k = 1 + static_cast<int>(rng() % 3);
                for (int j = 0; j < k; ++j) {
                    uint64_t len = 1 + rng() % 16384;
                    uint64_t dst = j * 20000 + rng() % (20000 - 16384);
                    slices.push_back({m, rng() % (kSrc - len), dst, len});
                    ++per_member[m];
                }
            }
            if (ex.rank() == 1) {
                // 64 engines in one process: with the default 100 us naps their idle workers
                // alone took both cores of the dev machine (32 idle tcp engines: 1.9 CPU-s per
                // s, 2026-12-02), and setting up the rest took minutes. Longer naps only delay
                // when an idle engine notices an arrival, by at most the nap.
                c.max_nap = std::chrono::milliseconds(5);
                std::vector<std::unique_ptr<TransferEngine>> engines;
                std::vector<std::vector<uint8_t>> bufs(kPeers,
                                                       std::vector<uint8_t>(kPeerBuf, kPoison));
                std::vector<std::unique_ptr<MemoryRegion>> mrs;
                ByteWriter w;
                for (int i = 0; i < kPeers; ++i) {
                    CHILD_ASSIGN_OK(auto e, TransferEngine::create(c));
                    CHILD_ASSIGN_OK(auto mr, e->register_memory(bufs[i].data(), bufs[i].size()));
                    e->address().encode(w);
                    mr->descriptor().encode(w);
                    engines.push_back(std::move(e));
                    mrs.push_back(std::move(mr));
                }
                CHILD_ASSIGN_OK(auto all, ex.allgather(w.bytes()));
                ByteReader rd(all[0]);
                CHILD_ASSIGN_OK(EngineAddress a0, EngineAddress::decode(rd));
                for (auto& e : engines) CHILD_CHECK(e->connect(a0).ok());
                CHILD_CHECK(ex.barrier().ok());
                for (int i = 0; i < kPeers; ++i) {
                    CHILD_CHECK_OK(engines[i]->wait_imm(5, per_member[i], kWait));
                    std::vector<uint8_t> want(kPeerBuf, kPoison);
                    for (const auto& s : slices) {
                        if (s.member != static_cast<uint32_t>(i)) continue;
                        for (uint64_t k = 0; k < s.length; ++k) {
                            want[s.dst_offset + k] = pattern(seed, s.src_offset + k);
                        }
                    }
                    if (bufs[i] != want) {
                        for (size_t k = 0; k < kPeerBuf; ++k) {
                            CHILD_CHECK_MSG(bufs[i][k] == want[k],
                                            "peer {} byte {}: got {:#x} want {:#x}", i, k,
                                            bufs[i][k], want[k]);
                        }
                    }
                }
                CHILD_CHECK(ex.barrier().ok());
                mrs.clear();
                engines.clear();
            } else {
                CHILD_ASSIGN_OK(auto e, TransferEngine::create(c));
                std::vector<uint8_t> src(kSrc);
                for (size_t i = 0; i < kSrc; ++i) src[i] = pattern(seed, i);
                CHILD_ASSIGN_OK(auto mr, e->register_memory(src.data(), src.size()));
                ByteWriter w;
                e->address().encode(w);
                CHILD_ASSIGN_OK(auto all, ex.allgather(w.bytes()));
                ByteReader rd(all[1]);
                std::vector<PeerId> peers;
                std::vector<MemoryDescriptor> dsts;
                for (int i = 0; i < kPeers; ++i) {
                    CHILD_ASSIGN_OK(EngineAddress a, EngineAddress::decode(rd));
                    CHILD_ASSIGN_OK(MemoryDescriptor d, MemoryDescriptor::decode(rd));
                    CHILD_ASSIGN_OK(PeerId p, e->connect(a));
                    peers.push_back(p);
                    dsts.push_back(d);
                }
                CHILD_ASSIGN_OK(GroupId g, e->create_group(peers, dsts));
                CHILD_CHECK(ex.barrier().ok());
                OpHandle h = e->scatter({g, mr.get(), slices, 5u});
                CHILD_CHECK_OK(h.wait(kWait));
                CHILD_CHECK(h.imm_writes() == slices.size());
                // A slice past a member's region is refused before anything moves.
                std::vector<ScatterSlice> bad = {{0, 0, 0, 16}, {kPeers - 1, 0, kPeerBuf - 8, 16}};
                Status s = e->scatter({g, mr.get(), bad, 6u}).wait(kWait);
                CHILD_CHECK_MSG(
                    s.code() == StatusCode::kOutOfRange &&
                        s.message().find("overrun the remote region") != std::string::npos,
                    "{}", s.to_string());
                CHILD_CHECK(ex.barrier().ok());
                mr.reset();
                e.reset();
            }
            return "";
        },
        kScatterTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// shm copies a large read or write inside its post (CMA) and completes it there. Each read of
// a batch is reported as soon as it is done, not once the worker has posted the whole batch:
// the first of 16 reads of 1 MiB used to complete after all 16 copies, and a submitter waiting
// for room in its window (the bench's, a KV transfer's) could refill only when the worker had
// nothing left to post.
TEST(HotPathShmTest, LargeReadsOfOneBatchCompleteOneByOne) {
    const uint64_t seed = testing::test_seed("LargeReadsOneByOne");
    constexpr int kReads = 16;
    constexpr size_t kLen = 1 << 20;
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(MeshNode n,
                            make_mesh_node(ex, test_engine_config("shm"), kReads * kLen, kPoison));
            if (ex.rank() == 1) {
                for (size_t i = 0; i < n.buf.size(); ++i) n.buf[i] = pattern(seed, i);
                CHILD_CHECK(ex.barrier().ok());  // filled
                CHILD_CHECK(ex.barrier().ok());  // read
                return "";
            }
            CHILD_CHECK(ex.barrier().ok());
            std::vector<BatchEntry> reads;
            for (int i = 0; i < kReads; ++i) {
                reads.push_back(
                    ReadOp{n.peer[1], n.mr.get(), i * kLen, &n.desc[1], i * kLen, kLen});
            }
            // Set by the first completion (on the worker, which also does the copies).
            std::atomic<int> first{-1};
            std::atomic<bool> last_still_poisoned{false};
            std::vector<OpHandle> hs = n.engine->submit_batch(reads, [&](size_t i, const Status&) {
                int none = -1;
                if (first.compare_exchange_strong(none, static_cast<int>(i))) {
                    last_still_poisoned =
                        check_fill(n.buf, (kReads - 1) * kLen, kLen, kPoison).empty();
                }
            });
            for (auto& h : hs) CHILD_CHECK_OK(h.wait(kWait));
            for (int i = 0; i < kReads; ++i) {
                std::string bad = check_pattern(n.buf, i * kLen, kLen, seed, i * kLen);
                CHILD_CHECK_MSG(bad.empty(), "read {} (seed {}): {}", i, seed, bad);
            }
            CHILD_CHECK_MSG(last_still_poisoned,
                            "the batch's first completion (read {}) came after its last read "
                            "had landed: completions wait for the whole batch",
                            first.load());
            CHILD_CHECK(ex.barrier().ok());
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// shm, a peer SIGKILLed while a read to it is in flight (stopped first, so the read waits in
// its command queue) and a read to a live peer posted after it on the same rail: shm drains
// the initiator endpoint's response queue in order, so the live read's completion waits
// behind the dead peer's entry forever. Before, both waited for the op timeout (15 s here):
// the dead peer's read failed "did not complete within", the live one was given up with it
// (a FaultE2E restart run lost 2 of 16 requests so). Now the rail's worker notices the dead
// process within a fraction of a second, fails that read naming the peer, and posts the live
// read again on a fresh initiator endpoint, where it completes with its bytes intact; a write
// with an immediate behind it (not idempotent) is still given up, as quickly.
TEST(DeadShmPeerTest, AReadBehindOneToAKilledPeerIsPostedAgainAndCompletes) {
    const uint64_t seed = testing::test_seed("DeadShmPeerRead");
    constexpr int kVictim = 1, kLive = 2;
    constexpr size_t kLen = 74496;  // the size of the FaultE2E run's reads
    constexpr size_t kBufLen = 4 * kLen;
    const auto kOpTimeout = std::chrono::seconds(15);
    auto results = run_processes(
        3,
        [&](Exchange& ex) -> std::string {
            // Without cross-memory attach (as where ptrace between sibling processes is
            // refused, Yama's ptrace_scope 1), shm serves reads through the target's command
            // queue and answers them through the initiator's response queue; with it, a read
            // is a process_vm_readv at its post that no dead peer holds up.
            ::setenv("FI_SHM_DISABLE_CMA", "1", 1);
            EngineConfig c = test_engine_config("shm");
            c.op_timeout = kOpTimeout;
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, c, kBufLen, kPoison));
            if (ex.rank() != 0) {
                for (size_t i = 0; i < kLen; ++i) n.buf[i] = pattern(seed + ex.rank(), i);
            }
            CHILD_ASSIGN_OK(std::vector<long> pids, ex.pids());
            if (ex.rank() == kVictim) {
                // Stopped, then killed, by rank 0; never gets past this.
                std::this_thread::sleep_for(std::chrono::seconds(120));
                return "the victim was never killed";
            }
            if (ex.rank() == kLive) {
                CHILD_CHECK(ex.barrier().ok());  // rank 0 is done
                return "";
            }
            const long victim = pids[kVictim];
            CHILD_CHECK(victim > 0);
            // A first read from each peer: shm pushes back operations to a peer that has not
            // yet answered its first contact, which a stopped victim never would.
            for (int p : {kVictim, kLive})
                CHILD_CHECK_OK(
                    n.engine->read({n.peer[p], n.mr.get(), 0, &n.desc[p], 0, 64}).wait(kWait));
            std::fill(n.buf.begin(), n.buf.begin() + 64, kPoison);
            CHILD_CHECK(testing::stop_process(victim, std::chrono::seconds(10)));
            // In this order on the one rail: the read the stopped victim will never answer,
            // then a read from the live peer and a write with an immediate to it.
            std::vector<BatchEntry> batch;
            batch.push_back(ReadOp{n.peer[kVictim], n.mr.get(), 0, &n.desc[kVictim], 0, kLen});
            batch.push_back(ReadOp{n.peer[kLive], n.mr.get(), kLen, &n.desc[kLive], 0, kLen});
            batch.push_back(
                WriteOp{n.peer[kLive], n.mr.get(), 2 * kLen, &n.desc[kLive], kLen, kLen, 7u});
            std::vector<TimePoint> done_at(batch.size());
            std::vector<OpHandle> hs = n.engine->submit_batch(
                batch, [&](size_t i, const Status&) { done_at[i] = Clock::now(); });
            CHILD_CHECK(hs.size() == batch.size());
            // Let the posts reach the provider before the victim dies.
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            CHILD_CHECK(::kill(static_cast<pid_t>(victim), SIGKILL) == 0);
            const TimePoint killed = Clock::now();
            std::vector<Status> got;
            for (auto& h : hs) got.push_back(h.wait(kOpTimeout + std::chrono::seconds(10)));
            for (size_t i = 0; i < hs.size(); ++i)
                CHILD_CHECK_MSG(hs[i].done(), "entry {} never finished", i);
            auto after_kill = [&](size_t i) { return to_ms(done_at[i] - killed); };
            std::fprintf(stderr,
                         "[dead-shm-peer] dead read failed %.0f ms after the kill (%s); live read "
                         "%s after %.0f ms; write with immediate after %.0f ms: %s\n",
                         after_kill(0), got[0].to_string().c_str(),
                         got[1].ok() ? "ok" : got[1].to_string().c_str(), after_kill(1),
                         after_kill(2), got[2].to_string().c_str());
            // The dead peer's read fails soon (the op timeout is 15 s), naming the peer.
            CHILD_CHECK_MSG(!got[0].ok() && got[0].code() == StatusCode::kUnavailable &&
                                got[0].message().find(fmt::format(
                                    "from peer {}", n.peer[kVictim])) != std::string::npos &&
                                got[0].message().find("process is gone") != std::string::npos,
                            "dead peer's read: {}", got[0].to_string());
            CHILD_CHECK_MSG(after_kill(0) < 4000,
                            "the dead peer's read failed only {:.0f} ms "
                            "after the kill",
                            after_kill(0));
            // The live peer's read completes, soon, with its bytes; nothing else was touched.
            CHILD_CHECK_MSG(got[1].ok(), "live peer's read: {}", got[1].to_string());
            CHILD_CHECK_MSG(after_kill(1) < 4000,
                            "the live read completed only {:.0f} ms "
                            "after the kill",
                            after_kill(1));
            std::string bad = check_pattern(n.buf, kLen, kLen, seed + kLive, 0);
            CHILD_CHECK_MSG(bad.empty(), "live read: {}", bad);
            bad = check_fill(n.buf, 0, kLen, kPoison);
            CHILD_CHECK_MSG(bad.empty(), "the dead peer's read area: {}", bad);
            bad = check_fill(n.buf, 3 * kLen, kLen, kPoison);
            CHILD_CHECK_MSG(bad.empty(), "past the reads: {}", bad);
            // The write with an immediate, if its answer waited behind the dead entry, is
            // given up (it may have been carried out), not posted again.
            CHILD_CHECK_MSG(
                got[2].ok() || got[2].message().find("whose process died") != std::string::npos,
                "write with immediate: {}", got[2].to_string());
            CHILD_CHECK_MSG(after_kill(2) < 4000,
                            "the write finished only {:.0f} ms after the kill", after_kill(2));
            // And the rail goes on: another read from the live peer.
            CHILD_CHECK_OK(
                n.engine->read({n.peer[kLive], n.mr.get(), 3 * kLen, &n.desc[kLive], 0, kLen})
                    .wait(kWait));
            bad = check_pattern(n.buf, 3 * kLen, kLen, seed + kLive, 0);
            CHILD_CHECK_MSG(bad.empty(), "read after: {}", bad);
            CHILD_CHECK(ex.barrier().ok());
            return "";
        },
        kRunTimeout);
    ASSERT_EQ(results.size(), 3u);
    EXPECT_EQ(results[kVictim].term_signal, SIGKILL);
    // The survivors exit cleanly too: a crash at teardown would be a use of something the
    // re-post gave up (the abandoned read, the closed endpoint). Survivors that segfaulted 4 of
    // 4 runs here came from a stale object compiled against an older rail.h (BENCHMARKS.md,
    // "A dead shm peer found in a fraction of a second"); a clean build never did.
    EXPECT_TRUE(results[0].ok()) << results[0].error << " signal " << results[0].term_signal;
    EXPECT_TRUE(results[kLive].ok())
        << results[kLive].error << " signal " << results[kLive].term_signal;
}

INSTANTIATE_TEST_SUITE_P(Providers, HotPathTest, ::testing::ValuesIn(testing::test_providers()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry

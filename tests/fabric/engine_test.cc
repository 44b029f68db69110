// TransferEngine between real processes, on every provider this machine has (tcp, shm).
#include "ferry/fabric/engine.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "ferry/common/bytes.h"
#include "support/byte_pattern.h"
#include "support/engine_fixture.h"
#include "support/multiproc.h"

namespace ferry {
namespace {

using testing::compare_bytes;
using testing::Exchange;
using testing::fill_pattern;
using testing::make_mesh_node;
using testing::MeshNode;
using testing::pattern;
using testing::run_processes;
using testing::test_engine_config;

constexpr uint8_t kPoison = 0xCD;
const auto kRunTimeout = std::chrono::seconds(120);
const auto kWait = std::chrono::seconds(20);

class EngineTest : public ::testing::TestWithParam<std::string> {
  protected:
    EngineConfig config() const { return test_engine_config(GetParam()); }
    void expect_all_ok(const std::vector<testing::ChildResult>& results) {
        EXPECT_EQ(testing::describe_failures(results), "");
    }
};

struct WritePlan {
    uint64_t src_off, dst_off, len;
};

// Random sizes and offsets into disjoint destination segments (writes are unordered, so
// overlapping destinations would make the expected image ambiguous).
std::vector<WritePlan> plan_writes(uint64_t seed, size_t buf, int n) {
    std::mt19937_64 rng(seed);
    std::vector<WritePlan> plan;
    size_t seg = buf / n;
    for (int i = 0; i < n; ++i) {
        uint64_t len = 1 + rng() % std::min<size_t>(seg, i % 4 == 0 ? seg : 8192);
        uint64_t dst = i * seg + rng() % (seg - len + 1);
        uint64_t src = rng() % (buf - len + 1);
        plan.push_back({src, dst, len});
    }
    return plan;
}

TEST_P(EngineTest, RandomWritesArriveIntactAndNothingElseIsTouched) {
    uint64_t seed = testing::test_seed("RandomWrites");
    const size_t kBuf = 4 << 20;
    const int kWrites = 200;
    const uint32_t kImm = 0x77;
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, config(), kBuf, kPoison));
            auto plan = plan_writes(seed, kBuf, kWrites);
            if (ex.rank() == 0) {
                fill_pattern(n.buf, seed);
                std::vector<OpHandle> ops;
                uint32_t imm_writes = 0;
                for (const auto& p : plan) {
                    WriteOp w{n.peer[1], n.mr.get(), p.src_off, &n.desc[1], p.dst_off, p.len, kImm};
                    ops.push_back(n.engine->write(w));
                }
                for (auto& h : ops) {
                    CHILD_CHECK_OK(h.wait(kWait));
                    imm_writes += h.imm_writes();
                }
                CHILD_CHECK(imm_writes >= static_cast<uint32_t>(kWrites));
                ByteWriter w;
                w.put(imm_writes);
                CHILD_CHECK(ex.allgather(w.bytes()).ok());
            } else {
                CHILD_ASSIGN_OK(auto all, ex.allgather({}));
                uint32_t expect = 0;
                std::memcpy(&expect, all[0].data(), 4);
                CHILD_CHECK_OK(n.engine->wait_imm(kImm, expect, kWait));
                std::vector<uint8_t> src(kBuf), want(kBuf, kPoison);
                fill_pattern(src, seed);
                for (const auto& p : plan) {
                    std::memcpy(want.data() + p.dst_off, src.data() + p.src_off, p.len);
                }
                std::string diff = compare_bytes(n.buf, want);
                CHILD_CHECK_MSG(diff.empty(), "{}", diff);
                CHILD_CHECK(n.engine->imm_available(kImm) == 0);
            }
            return "";
        },
        kRunTimeout);
    expect_all_ok(results);
}

TEST_P(EngineTest, LargeWritesSplitAcrossRailsCountEveryPiece) {
    uint64_t seed = testing::test_seed("LargeWrites");
    const size_t kBuf = 24 << 20;
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            EngineConfig c = config();
            c.num_rails = 2;
            c.stripe_threshold = 1 << 20;
            c.max_write_size = 4 << 20;
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, c, kBuf, kPoison));
            CHILD_CHECK(n.engine->num_rails() == 2);
            uint64_t len = kBuf - 12345;
            if (ex.rank() == 0) {
                fill_pattern(n.buf, seed);
                WriteOp w{n.peer[1], n.mr.get(), 0, &n.desc[1], 12345, len, 5u};
                OpHandle h = n.engine->write(w);
                CHILD_CHECK_OK(h.wait(kWait));
                // 2 rails, 4 MiB cap: ceil(len / 2) rounded to 4 KiB is above the cap, so pieces
                // are 4 MiB: ceil(len / 4 MiB) of them.
                CHILD_CHECK_MSG(h.imm_writes() == (len + (4 << 20) - 1) / (4 << 20), "{}",
                                h.imm_writes());
                ByteWriter bw;
                bw.put(h.imm_writes());
                CHILD_CHECK(ex.allgather(bw.bytes()).ok());
            } else {
                CHILD_ASSIGN_OK(auto all, ex.allgather({}));
                uint32_t expect = 0;
                std::memcpy(&expect, all[0].data(), 4);
                CHILD_CHECK_OK(n.engine->wait_imm(5, expect, kWait));
                std::vector<uint8_t> src(kBuf), want(kBuf, kPoison);
                fill_pattern(src, seed);
                std::memcpy(want.data() + 12345, src.data(), len);
                std::string diff = compare_bytes(n.buf, want);
                CHILD_CHECK_MSG(diff.empty(), "{}", diff);
            }
            return "";
        },
        kRunTimeout);
    expect_all_ok(results);
}

// Signals (immediates without bytes) rotate over the rails, and each rail's arrive: the
// peer's address gives one signal buffer that every rail registered. (With a buffer per rail,
// shm refused every signal but rail 0's and the target never counted them.)
TEST_P(EngineTest, SignalsArriveOnEveryRail) {
    constexpr int kRails = 3;
    constexpr uint32_t kSignals = 3 * kRails;
    constexpr uint32_t kImm = 0x5167;
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            EngineConfig c = config();
            c.num_rails = kRails;
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, c, 4096, kPoison));
            if (ex.rank() == 1) {
                for (uint32_t i = 0; i < kSignals; ++i)
                    CHILD_CHECK_OK(n.engine->signal(n.peer[0], kImm).wait(kWait));
            } else {
                CHILD_CHECK_OK(n.engine->wait_imm(kImm, kSignals, kWait));
                const std::vector<EngineStats> per_rail = n.engine->rail_stats();
                CHILD_CHECK(per_rail.size() == kRails);
                for (int r = 0; r < kRails; ++r) {
                    CHILD_CHECK_MSG(per_rail[r].imm_arrivals == kSignals / kRails,
                                    "rail {}: {} signals arrived of {}", r,
                                    per_rail[r].imm_arrivals, kSignals / kRails);
                }
            }
            CHILD_CHECK_OK(ex.allgather({}).status());
            return "";
        },
        kRunTimeout);
    expect_all_ok(results);
}

// Paged writes, adjacent pages coalesced into runs and up to rma_iovs runs joined into one
// fabric operation (one iovec each): every page lands where its id says, nothing else is
// touched, and the immediates the target counts are the operations the initiator reported.
TEST_P(EngineTest, PagedWritesWithRandomPageListsCoalesceAndArriveIntact) {
    for (size_t iovs : {size_t{1}, size_t{3}, size_t{4}}) {
        SCOPED_TRACE(fmt::format("rma_iovs {}", iovs));
        uint64_t seed = testing::test_seed("PagedWrites");
        const uint64_t kPage = 4096;
        const uint32_t kPages = 512;
        auto results = run_processes(
            2,
            [&](Exchange& ex) -> std::string {
                EngineConfig c = config();
                c.rma_iovs = iovs;
                CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, c, kPage * kPages * 3, kPoison));
                // shm and tcp;ofi_rxm take 4 iovecs (libfabric 1.17).
                const size_t k = n.engine->rma_iovs();
                CHILD_CHECK_MSG(k == iovs, "rma_iovs {} asked, the engine uses {}", iovs, k);
                std::mt19937_64 rng(seed);
                // Source: a random subset with some contiguous runs; destination: a permutation
                // with runs kept where the source has them, so coalescing has something to do.
                std::vector<uint32_t> src, dst;
                std::vector<uint32_t> perm(kPages);
                std::iota(perm.begin(), perm.end(), 0);
                std::shuffle(perm.begin(), perm.end(), rng);
                for (uint32_t i = 0; i < 200;) {
                    uint32_t run = 1 + rng() % 6;
                    uint32_t s0 = rng() % (kPages - run), d0 = perm[i] % (kPages - run);
                    for (uint32_t k = 0; k < run && i < 200; ++k, ++i) {
                        src.push_back(s0 + k);
                        dst.push_back(d0 + k);
                    }
                }
                // Keep destination pages unique (a page written twice would be ambiguous).
                std::vector<bool> used(kPages);
                std::vector<uint32_t> s2, d2;
                for (size_t i = 0; i < dst.size(); ++i) {
                    if (!used[dst[i]]) {
                        used[dst[i]] = true;
                        s2.push_back(src[i]);
                        d2.push_back(dst[i]);
                    }
                }
                const uint64_t kDstStride = kPage * 2;  // destination pages interleave with a gap
                if (ex.rank() == 0) {
                    fill_pattern(n.buf, seed);
                    PagedWriteOp p;
                    p.peer = n.peer[1];
                    p.src = n.mr.get();
                    p.dst = &n.desc[1];
                    p.page_size = kPage;
                    p.dst_stride = kDstStride;
                    p.src_pages = s2;
                    p.dst_pages = d2;
                    p.imm = 9u;
                    OpHandle h = n.engine->paged_write(p);
                    CHILD_CHECK_OK(h.wait(kWait));
                    // Strided destination: no coalescing possible, one run per page, k runs per
                    // operation.
                    CHILD_CHECK_MSG(h.imm_writes() == (s2.size() + k - 1) / k,
                                    "{} writes for {} pages", h.imm_writes(), s2.size());
                    // Same pages, dense on both sides: runs must coalesce.
                    PagedWriteOp q = p;
                    q.dst_stride = 0;
                    q.dst_offset = 2 * kPage * kPages;  // past the strided region
                    OpHandle h2 = n.engine->paged_write(q);
                    CHILD_CHECK_OK(h2.wait(kWait));
                    size_t runs = 1;
                    for (size_t i = 1; i < s2.size(); ++i)
                        runs += !(s2[i] == s2[i - 1] + 1 && d2[i] == d2[i - 1] + 1);
                    // Exactly ceil(runs / k) where runs join without a bound on their bytes
                    // (shm); tcp joins them only up to 16 KiB (Rail::join_bytes).
                    const bool exact = GetParam() == "shm";
                    CHILD_CHECK_MSG(runs < s2.size() && h2.imm_writes() >= (runs + k - 1) / k &&
                                        h2.imm_writes() <= runs &&
                                        (!exact || h2.imm_writes() == (runs + k - 1) / k),
                                    "{} writes for {} runs of {} pages", h2.imm_writes(), runs,
                                    s2.size());
                    ByteWriter bw;
                    bw.put(h.imm_writes() + h2.imm_writes());
                    CHILD_CHECK(ex.allgather(bw.bytes()).ok());
                } else {
                    CHILD_ASSIGN_OK(auto all, ex.allgather({}));
                    uint32_t expect = 0;
                    std::memcpy(&expect, all[0].data(), 4);
                    CHILD_CHECK_OK(n.engine->wait_imm(9, expect, kWait));
                    std::vector<uint8_t> srcb(n.buf.size()), want(n.buf.size(), kPoison);
                    fill_pattern(srcb, seed);
                    for (size_t i = 0; i < s2.size(); ++i) {
                        std::memcpy(want.data() + d2[i] * kDstStride, srcb.data() + s2[i] * kPage,
                                    kPage);
                        std::memcpy(want.data() + 2 * kPage * kPages + d2[i] * kPage,
                                    srcb.data() + s2[i] * kPage, kPage);
                    }
                    std::string diff = compare_bytes(n.buf, want);
                    CHILD_CHECK_MSG(diff.empty(), "{}", diff);
                }
                return "";
            },
            kRunTimeout);
        expect_all_ok(results);
    }
}

// 20 runs of random lengths (up to 256 KiB, some above the stripe threshold) from anywhere in a
// buffer of buf bytes to disjoint 256 KiB slots of another, in random order.
std::vector<WriteRun> random_runs(uint64_t seed, uint64_t buf) {
    std::mt19937_64 rng(seed);
    const uint64_t kSlot = 256 << 10;
    std::vector<uint64_t> slots(buf / kSlot);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<WriteRun> runs;
    for (int i = 0; i < 20; ++i) {
        uint64_t len = 1 + rng() % kSlot;
        runs.push_back({rng() % (buf - len), slots[i] * kSlot + rng() % (kSlot - len + 1), len});
    }
    return runs;
}

// What a poisoned buffer of `size` bytes holds after `runs` copied into it from a buffer
// filled with fill_pattern(seed).
std::vector<uint8_t> after_runs(size_t size, uint64_t seed, const std::vector<WriteRun>& runs) {
    std::vector<uint8_t> src(size), want(size, kPoison);
    fill_pattern(src, seed);
    for (const WriteRun& r : runs)
        std::memcpy(want.data() + r.dst_offset, src.data() + r.src_offset, r.length);
    return want;
}

// Runs of random lengths (some above the stripe threshold, so split across rails) to disjoint
// destinations as one operation: every byte lands, nothing else is touched, the target counts
// as many immediates as imm_writes() says, and a run out of range fails the whole operation
// before anything is posted, naming the run.
TEST_P(EngineTest, WriteRunsDeliversEveryRunAsOneOperation) {
    uint64_t seed = testing::test_seed("WriteRuns");
    const size_t kBuf = 8 << 20;
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, config(), kBuf, kPoison));
            std::vector<WriteRun> runs = random_runs(seed, kBuf);
            if (ex.rank() == 0) {
                fill_pattern(n.buf, seed);
                WriteRunsOp bad;
                bad.peer = n.peer[1];
                bad.src = n.mr.get();
                bad.dst = &n.desc[1];
                std::vector<WriteRun> with_bad = runs;
                with_bad[7].dst_offset = kBuf - with_bad[7].length + 1;  // one byte past the end
                bad.runs = with_bad;
                bad.imm = 5u;
                Status refused = n.engine->write_runs(bad).wait(kWait);
                CHILD_CHECK_MSG(
                    !refused.ok() && refused.message().find("run 7") != std::string::npos,
                    "out-of-range run: {}", refused.to_string());
                WriteRunsOp op = bad;
                op.runs = runs;
                OpHandle h = n.engine->write_runs(op);
                CHILD_CHECK_OK(h.wait(kWait));
                // Up to rma_iovs runs to an operation; a run above the stripe threshold or
                // max_write_size is split.
                const size_t k = n.engine->rma_iovs();
                CHILD_CHECK_MSG(h.imm_writes() >= (runs.size() + k - 1) / k,
                                "{} immediates for {} runs", h.imm_writes(), runs.size());
                ByteWriter bw;
                bw.put(h.imm_writes());
                CHILD_CHECK(ex.allgather(bw.bytes()).ok());
            } else {
                CHILD_ASSIGN_OK(auto all, ex.allgather({}));
                uint32_t expect = 0;
                std::memcpy(&expect, all[0].data(), 4);
                CHILD_CHECK_OK(n.engine->wait_imm(5, expect, kWait));
                CHILD_CHECK_MSG(n.engine->imm_available(5) == 0,
                                "{} immediates more than the writes posted",
                                n.engine->imm_available(5));
                std::string diff = compare_bytes(n.buf, after_runs(n.buf.size(), seed, runs));
                CHILD_CHECK_MSG(diff.empty(), "{}", diff);
            }
            return "";
        },
        kRunTimeout);
    expect_all_ok(results);
}

// The read side of the same: runs of random lengths from a peer's region into disjoint local
// slots as one operation; every byte arrives, nothing else is touched, and a run out of range
// fails the operation before anything is read, naming the run.
TEST_P(EngineTest, ReadRunsFetchesEveryRunAsOneOperation) {
    uint64_t seed = testing::test_seed("ReadRuns");
    const size_t kBuf = 8 << 20;
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, config(), kBuf, kPoison));
            std::vector<WriteRun> runs = random_runs(seed, kBuf);  // src at the peer, dst here
            if (ex.rank() == 1) {
                fill_pattern(n.buf, seed);
                CHILD_CHECK(ex.barrier().ok());  // filled before rank 0 reads
                CHILD_CHECK(ex.barrier().ok());  // rank 0 is done reading
                return "";
            }
            CHILD_CHECK(ex.barrier().ok());
            ReadRunsOp op;
            op.peer = n.peer[1];
            op.dst = n.mr.get();
            op.src = &n.desc[1];
            std::vector<WriteRun> with_bad = runs;
            with_bad[11].src_offset = kBuf - with_bad[11].length + 1;  // one byte past the end
            op.runs = with_bad;
            Status refused = n.engine->read_runs(op).wait(kWait);
            CHILD_CHECK_MSG(!refused.ok() && refused.message().find("run 11") != std::string::npos,
                            "out-of-range run: {}", refused.to_string());
            std::string untouched =
                compare_bytes(n.buf, std::vector<uint8_t>(n.buf.size(), kPoison));
            CHILD_CHECK_MSG(untouched.empty(), "a refused read_runs wrote: {}", untouched);
            op.runs = runs;
            CHILD_CHECK_OK(n.engine->read_runs(op).wait(kWait));
            std::string diff = compare_bytes(n.buf, after_runs(n.buf.size(), seed, runs));
            CHILD_CHECK(ex.barrier().ok());
            CHILD_CHECK_MSG(diff.empty(), "{}", diff);
            return "";
        },
        kRunTimeout);
    expect_all_ok(results);
}

TEST_P(EngineTest, ScatterToFourPeersDeliversEachItsSlice) {
    uint64_t seed = testing::test_seed("Scatter");
    const size_t kBuf = 1 << 20;
    auto results = run_processes(
        5,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, config(), kBuf, kPoison));
            std::mt19937_64 rng(seed);
            std::vector<ScatterSlice> slices;
            for (uint32_t m = 0; m < 4; ++m) {
                for (int k = 0; k < 3; ++k) {  // three slices per member, disjoint destinations
                    uint64_t len = 1 + rng() % 60000;
                    slices.push_back({m, rng() % (kBuf - len), k * 300000 + rng() % 1000, len});
                }
            }
            if (ex.rank() == 0) {
                fill_pattern(n.buf, seed);
                std::vector<PeerId> peers = {n.peer[1], n.peer[2], n.peer[3], n.peer[4]};
                std::vector<MemoryDescriptor> dsts = {n.desc[1], n.desc[2], n.desc[3], n.desc[4]};
                CHILD_ASSIGN_OK(GroupId g, n.engine->create_group(peers, dsts));
                OpHandle h = n.engine->scatter({g, n.mr.get(), slices, 3u});
                CHILD_CHECK_OK(h.wait(kWait));
                CHILD_CHECK(h.imm_writes() == slices.size());
                CHILD_CHECK(ex.barrier().ok());
            } else {
                CHILD_CHECK(ex.barrier().ok());
                uint32_t me = ex.rank() - 1;
                CHILD_CHECK_OK(n.engine->wait_imm(3, 3, kWait));
                std::vector<uint8_t> src(kBuf), want(kBuf, kPoison);
                fill_pattern(src, seed);
                for (const auto& s : slices) {
                    if (s.member == me) {
                        std::memcpy(want.data() + s.dst_offset, src.data() + s.src_offset,
                                    s.length);
                    }
                }
                std::string diff = compare_bytes(n.buf, want);
                CHILD_CHECK_MSG(diff.empty(), "{}", diff);
            }
            return "";
        },
        kRunTimeout);
    expect_all_ok(results);
}

TEST_P(EngineTest, BarrierOfFourHoldsEveryoneUntilAllArrived) {
    const int kRanks = 4, kRounds = 25;
    auto results = run_processes(
        kRanks,
        [&](Exchange& ex) -> std::string {
            // Each rank owns one 8-byte slot per writer in every peer's buffer.
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, config(), 64 * kRanks, 0));
            std::vector<PeerId> peers;
            std::vector<MemoryDescriptor> dsts;
            for (int r = 0; r < kRanks; ++r) {
                if (r == ex.rank()) continue;
                peers.push_back(n.peer[r]);
                dsts.push_back(n.desc[r]);
            }
            CHILD_ASSIGN_OK(GroupId g, n.engine->create_group(peers, dsts));
            std::mt19937 rng(ex.rank());
            auto* mine = reinterpret_cast<uint64_t*>(n.buf.data()) + kRanks;  // my send staging
            for (uint64_t round = 1; round <= kRounds; ++round) {
                // Uneven arrival: some ranks dawdle before entering the barrier.
                std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
                *mine = round;
                for (int r = 0; r < kRanks; ++r) {
                    if (r == ex.rank()) continue;
                    WriteOp w{n.peer[r],
                              n.mr.get(),
                              uint64_t(8 * kRanks),
                              &n.desc[r],
                              uint64_t(8 * ex.rank()),
                              8,
                              std::nullopt};
                    CHILD_CHECK_OK(n.engine->write(w).wait(kWait));
                }
                CHILD_CHECK_OK(n.engine->barrier(g, 0xB0, kWait));
                // Everyone wrote this round's value before entering: all slots show it now.
                auto* slots = reinterpret_cast<volatile uint64_t*>(n.buf.data());
                for (int r = 0; r < kRanks; ++r) {
                    if (r == ex.rank()) continue;
                    CHILD_CHECK_MSG(slots[r] >= round, "round {}: rank {} slot shows {}", round, r,
                                    slots[r]);
                }
                // A second barrier so nobody overwrites a slot before all have checked it.
                CHILD_CHECK_OK(n.engine->barrier(g, 0xB1, kWait));
            }
            return "";
        },
        kRunTimeout);
    expect_all_ok(results);
}

TEST_P(EngineTest, ImmediateCountersFromEightThreadsCountExactly) {
    const int kThreads = 8, kPerThread = 300;
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, config(), 1 << 16, 0));
            if (ex.rank() == 0) {
                std::vector<std::thread> threads;
                std::atomic<int> failures{0};
                for (int t = 0; t < kThreads; ++t) {
                    threads.emplace_back([&, t] {
                        std::vector<OpHandle> hs;
                        for (int i = 0; i < kPerThread; ++i) {
                            WriteOp w{n.peer[1],        n.mr.get(), uint64_t(t * 64), &n.desc[1],
                                      uint64_t(t * 64), 64,         uint32_t(100 + t)};
                            hs.push_back(n.engine->write(w));
                            hs.push_back(n.engine->signal(n.peer[1], 200));  // shared counter
                        }
                        for (auto& h : hs) {
                            if (!h.wait(kWait).ok()) failures++;
                        }
                    });
                }
                for (auto& t : threads) t.join();
                CHILD_CHECK(failures == 0);
                CHILD_CHECK(ex.barrier().ok());
            } else {
                // Waiters registered before the writes arrive, and a callback form too; the shared
                // counter is consumed in rounds of kPerThread (credit style, no reset between).
                std::atomic<int> fired{0};
                for (int t = 0; t < kThreads; ++t) {
                    n.engine->on_imm(100 + t, kPerThread, kWait, [&](const Status& s) {
                        if (s.ok()) fired++;
                    });
                }
                for (int round = 0; round < kThreads; ++round) {
                    CHILD_CHECK_OK(n.engine->wait_imm(200, kPerThread, kWait));
                }
                CHILD_CHECK(ex.barrier().ok());
                auto deadline = deadline_after(kWait);
                while (fired < kThreads && Clock::now() < deadline) {
                    std::this_thread::sleep_for(std::chrono::milliseconds(1));
                }
                CHILD_CHECK_MSG(fired == kThreads, "{} of {} counters fired", fired.load(),
                                kThreads);
                CHILD_CHECK(n.engine->imm_available(200) == 0);
                // Nothing extra arrives: one more write's worth times out with a clear message.
                Status s = n.engine->wait_imm(200, 1, std::chrono::milliseconds(50));
                CHILD_CHECK(s.code() == StatusCode::kTimeout);
                CHILD_CHECK_MSG(s.message().find("0xc8") != std::string::npos, "{}", s.message());
            }
            return "";
        },
        kRunTimeout);
    expect_all_ok(results);
}

TEST_P(EngineTest, OutOfRangeAndForeignDescriptorsAreRejectedBeforePosting) {
    auto results = run_processes(
        3,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, config(), 4096, kPoison));
            if (ex.rank() == 0) {
                WriteOp w{n.peer[1], n.mr.get(), 0, &n.desc[1], 4000, 200, 1u};
                Status s = n.engine->write(w).wait(kWait);
                CHILD_CHECK(s.code() == StatusCode::kOutOfRange);
                CHILD_CHECK_MSG(s.message().find("200 bytes at offset 4000 overrun the remote "
                                                 "region of 4096 bytes") != std::string::npos,
                                "{}", s.message());
                // Rank 2's descriptor used for a write to rank 1.
                WriteOp f{n.peer[1], n.mr.get(), 0, &n.desc[2], 0, 16, 1u};
                s = n.engine->write(f).wait(kWait);
                CHILD_CHECK(s.code() == StatusCode::kInvalidArgument);
                CHILD_CHECK_MSG(
                    s.message().find("descriptor belongs to engine") != std::string::npos, "{}",
                    s.message());
                ReadOp r{n.peer[1], n.mr.get(), 0, &n.desc[1], 1, 4096};
                s = n.engine->read(r).wait(kWait);
                CHILD_CHECK(s.code() == StatusCode::kOutOfRange);
                std::vector<uint32_t> pages = {0, 1, 7};
                PagedWriteOp p;
                p.peer = n.peer[1];
                p.src = n.mr.get();
                p.dst = &n.desc[1];
                p.page_size = 512;
                p.src_pages = pages;
                p.dst_pages = pages;  // page 7 at 512 bytes ends exactly at 4096: fine
                CHILD_CHECK_OK(n.engine->paged_write(p).wait(kWait));
                std::vector<uint32_t> bad = {0, 1, 8};
                p.dst_pages = bad;
                s = n.engine->paged_write(p).wait(kWait);
                CHILD_CHECK(s.code() == StatusCode::kOutOfRange);
                CHILD_CHECK_MSG(s.message().find("page 2") != std::string::npos, "{}", s.message());
                // A stride whose page offsets wrap past 2^64 (page 2 x 2^63 = 0): refused by
                // name, never posted (the wrapped offset passed the bounds check and the
                // provider copied from a wild address).
                std::vector<uint32_t> wrap_src = {0, 2, 1}, wrap_dst = {0, 2, 4};
                p.dst_pages = pages;
                p.src_pages = wrap_src;
                p.src_stride = uint64_t{1} << 63;
                s = n.engine->paged_write(p).wait(kWait);
                CHILD_CHECK(s.code() == StatusCode::kOutOfRange);
                CHILD_CHECK_MSG(s.message().find("does not fit in 64 bits") != std::string::npos &&
                                    s.message().find("page 1 (2 -> 1)") != std::string::npos,
                                "{}", s.message());
                p.src_pages = pages;
                p.src_stride = 0;
                p.dst_stride = (uint64_t{1} << 63) + 512;
                p.dst_pages = wrap_dst;
                s = n.engine->paged_write(p).wait(kWait);
                CHILD_CHECK(s.code() == StatusCode::kOutOfRange);
                CHILD_CHECK_MSG(s.message().find("does not fit in 64 bits") != std::string::npos &&
                                    s.message().find("page 1 (1 -> 2)") != std::string::npos,
                                "{}", s.message());
                // A callback is told too.
                std::atomic<int> code{-1};
                n.engine->write(w, [&](const Status& st) { code = static_cast<int>(st.code()); });
                CHILD_CHECK(code == static_cast<int>(StatusCode::kOutOfRange));
            }
            CHILD_CHECK(ex.barrier().ok());
            if (ex.rank() == 1) {
                // Only the good paged write landed: pages 0, 1 and 7 carry rank 0's poison value
                // (same as ours), everything else untouched; no immediates arrived.
                CHILD_CHECK(n.engine->imm_available(1) == 0);
                for (uint8_t b : n.buf) CHILD_CHECK(b == kPoison);
            }
            return "";
        },
        kRunTimeout);
    expect_all_ok(results);
}

TEST_P(EngineTest, ReadsFetchRemoteBytes) {
    uint64_t seed = testing::test_seed("Reads");
    const size_t kBuf = 2 << 20;
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, config(), kBuf, kPoison));
            if (ex.rank() == 1) fill_pattern(n.buf, seed);
            CHILD_CHECK(ex.barrier().ok());
            if (ex.rank() == 0) {
                auto plan = plan_writes(seed ^ 1, kBuf, 50);
                std::vector<OpHandle> hs;
                for (const auto& p : plan) {
                    hs.push_back(n.engine->read(
                        {n.peer[1], n.mr.get(), p.dst_off, &n.desc[1], p.src_off, p.len}));
                }
                for (auto& h : hs) CHILD_CHECK_OK(h.wait(kWait));
                std::vector<uint8_t> src(kBuf), want(kBuf, kPoison);
                fill_pattern(src, seed);
                for (const auto& p : plan) {
                    std::memcpy(want.data() + p.dst_off, src.data() + p.src_off, p.len);
                }
                std::string diff = compare_bytes(n.buf, want);
                CHILD_CHECK_MSG(diff.empty(), "{}", diff);
            }
            CHILD_CHECK(ex.barrier().ok());
            return "";
        },
        kRunTimeout);
    expect_all_ok(results);
}

TEST_P(EngineTest, ControlMessagesCarryPayloadAndSender) {
    auto results = run_processes(
        3,
        [&](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, config(), 4096, 0));
            std::mutex mu;
            std::vector<std::pair<uint64_t, std::string>> got;
            n.engine->set_message_handler([&](uint64_t sender, std::span<const uint8_t> p) {
                std::lock_guard lk(mu);
                got.emplace_back(sender, std::string(p.begin(), p.end()));
            });
            CHILD_ASSIGN_OK(auto ids, ex.allgather([&] {
                ByteWriter w;
                w.put(n.engine->engine_id());
                return w.take();
            }()));
            const int kEach = 50;
            for (int r = 0; r < ex.size(); ++r) {
                if (r == ex.rank()) continue;
                for (int i = 0; i < kEach; ++i) {
                    std::string m = fmt::format("from {} #{}", ex.rank(), i);
                    std::vector<uint8_t> b(m.begin(), m.end());
                    CHILD_CHECK_OK(n.engine->send_message(n.peer[r], b).wait(kWait));
                }
            }
            std::vector<uint8_t> huge(n.engine->config().max_message_size + 1);
            Status s = n.engine->send_message(n.peer[(ex.rank() + 1) % 3], huge).wait(kWait);
            CHILD_CHECK(s.code() == StatusCode::kInvalidArgument);
            auto deadline = deadline_after(kWait);
            while (Clock::now() < deadline) {
                {
                    std::lock_guard lk(mu);
                    if (got.size() >= 2 * kEach) break;
                }
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
            std::lock_guard lk(mu);
            CHILD_CHECK_MSG(got.size() == 2 * kEach, "got {} messages", got.size());
            for (const auto& [sender, text] : got) {
                int from = std::stoi(text.substr(5));
                uint64_t id = 0;
                std::memcpy(&id, ids[from].data(), 8);
                CHILD_CHECK_MSG(sender == id, "message '{}' reported sender {:x}", text, sender);
            }
            CHILD_CHECK(ex.barrier().ok());
            return "";
        },
        kRunTimeout);
    expect_all_ok(results);
}

// Rank 1 is killed while rank 0 streams writes with immediates above the inject size into it.
// Rank 0 must get errors, not a hang; then reach the live rank 2 and a peer started after the
// kill (rank 3, a process whose engine is created only then: a restarted peer at a new
// address) with the same engine, writes above the inject size, bytes verified. On shm this
// needs the fresh initiator endpoint (see Rail::renew_initiator): the dead rank's unanswered
// write blocks the old one's response queue for every peer.
TEST_P(EngineTest, TargetKilledMidStreamGivesErrorsNotAHang) {
    uint64_t seed = testing::test_seed("TargetKilled");
    const size_t kBuf = 1 << 20, kLen = 65536;
    const int kLate[] = {3};
    auto results = run_processes(
        4,
        [&](Exchange& ex) -> std::string {
            EngineConfig c = config();
            c.op_timeout = std::chrono::seconds(2);
            if (ex.rank() == 3) {
                CHILD_CHECK_OK(ex.allgather({}).status());  // not started yet
                CHILD_CHECK(ex.barrier().ok());
                CHILD_CHECK_OK(ex.allgather({}).status());  // rank 0 saw the victim fail
                // "Restart": this process's first engine, at an address never seen before.
                CHILD_ASSIGN_OK(auto e, TransferEngine::create(c));
                std::vector<uint8_t> buf(kBuf, kPoison);
                CHILD_ASSIGN_OK(auto mr, e->register_memory(buf.data(), buf.size()));
                ByteWriter w;
                e->address().encode(w);
                mr->descriptor().encode(w);
                CHILD_CHECK_OK(ex.allgather(w.bytes()).status());
                CHILD_CHECK_OK(e->wait_imm(3, 1, std::chrono::seconds(60)));
                std::vector<uint8_t> want(kBuf, kPoison);
                for (size_t i = 0; i < kLen; ++i) want[4096 + i] = pattern(seed, i);
                std::string diff = compare_bytes(buf, want);
                CHILD_CHECK_MSG(diff.empty(), "restarted peer: {}", diff);
                CHILD_CHECK(ex.barrier().ok());
                return "";
            }
            CHILD_ASSIGN_OK(MeshNode n, make_mesh_node(ex, c, kBuf, 0, kLate));
            if (ex.rank() == 1) {
                CHILD_CHECK(ex.barrier().ok());
                CHILD_CHECK_OK(n.engine->wait_imm(1, 50, kWait));
                raise(SIGKILL);  // dies with writes still streaming in
            }
            if (ex.rank() == 0) {
                CHILD_CHECK(ex.barrier().ok());
                auto start = Clock::now();
                Status first_error;
                int ok_count = 0;
                // Keep streaming until the dead target turns into errors; bounded in time.
                while (Clock::now() - start < std::chrono::seconds(30)) {
                    std::vector<OpHandle> hs;
                    for (int i = 0; i < 16; ++i) {
                        hs.push_back(
                            n.engine->write({n.peer[1], n.mr.get(), 0, &n.desc[1], 0, kLen, 1u}));
                    }
                    for (auto& h : hs) {
                        Status s = h.wait(std::chrono::seconds(10));
                        CHILD_CHECK_MSG(
                            s.code() != StatusCode::kTimeout ||
                                s.message().find("did not complete within") != std::string::npos ||
                                s.message().find("could not be posted") != std::string::npos,
                            "handle wait itself timed out: {}", s.message());
                        if (s.ok())
                            ++ok_count;
                        else if (first_error.ok())
                            first_error = s;
                    }
                    if (!first_error.ok()) break;
                }
                CHILD_CHECK_MSG(!first_error.ok(),
                                "no error within 30 s of the target dying ({} ok)", ok_count);
                CHILD_CHECK_MSG(ok_count >= 48, "only {} writes succeeded; first error: {}",
                                ok_count, first_error.to_string());
                // The initiator stays healthy: writes above the inject size reach a live peer
                // and a restarted one. Only where the provider itself wedged on the dead peer
                // (shm, when the victim died holding a lock in its region) does the error say
                // so, and a fresh engine carries on.
                for (size_t i = 0; i < kLen; ++i) n.buf[i] = pattern(seed, i);
                Status s = n.engine->write({n.peer[2], n.mr.get(), 0, &n.desc[2], 4096, kLen, 2u})
                               .wait(kWait);
                CHILD_ASSIGN_OK(auto late, ex.allgather({}));
                CHILD_ASSIGN_OK(auto joined, ex.allgather({}));
                ByteReader rd(joined[3]);
                CHILD_ASSIGN_OK(EngineAddress addr3, EngineAddress::decode(rd));
                CHILD_ASSIGN_OK(MemoryDescriptor desc3, MemoryDescriptor::decode(rd));
                if (s.ok()) {
                    CHILD_ASSIGN_OK(PeerId p3, n.engine->connect(addr3));
                    CHILD_CHECK_OK(
                        n.engine->write({p3, n.mr.get(), 0, &desc3, 4096, kLen, 3u}).wait(kWait));
                } else {
                    CHILD_CHECK_MSG(s.message().find("wedged") != std::string::npos, "{}",
                                    s.to_string());
                    CHILD_ASSIGN_OK(auto fresh, TransferEngine::create(c));
                    CHILD_ASSIGN_OK(auto mr2, fresh->register_memory(n.buf.data(), n.buf.size()));
                    CHILD_ASSIGN_OK(PeerId p2, fresh->connect(n.addr[2]));
                    CHILD_CHECK_OK(
                        fresh->write({p2, mr2.get(), 0, &n.desc[2], 4096, kLen, 2u}).wait(kWait));
                    CHILD_ASSIGN_OK(PeerId p3, fresh->connect(addr3));
                    CHILD_CHECK_OK(
                        fresh->write({p3, mr2.get(), 0, &desc3, 4096, kLen, 3u}).wait(kWait));
                    mr2.reset();
                    fresh.reset();
                }
                auto t0 = Clock::now();
                n.mr.reset();
                n.engine.reset();  // shutting down must not hang, wedged rail or not
                CHILD_CHECK(Clock::now() - t0 < std::chrono::seconds(15));
                CHILD_CHECK(ex.barrier().ok());
            }
            if (ex.rank() == 2) {
                CHILD_CHECK(ex.barrier().ok());
                CHILD_CHECK_OK(ex.allgather({}).status());
                CHILD_CHECK_OK(ex.allgather({}).status());
                CHILD_CHECK_OK(n.engine->wait_imm(2, 1, std::chrono::seconds(60)));
                std::vector<uint8_t> want(kBuf, 0);
                for (size_t i = 0; i < kLen; ++i) want[4096 + i] = pattern(seed, i);
                std::string diff = compare_bytes(n.buf, want);
                CHILD_CHECK_MSG(diff.empty(), "live peer: {}", diff);
                CHILD_CHECK(ex.barrier().ok());
            }
            return "";
        },
        kRunTimeout);
    ASSERT_EQ(results.size(), 4u);
    EXPECT_EQ(results[1].term_signal, SIGKILL);
    for (int r : {0, 2, 3})
        EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].error;
}

INSTANTIATE_TEST_SUITE_P(Providers, EngineTest, ::testing::ValuesIn(testing::test_providers()),
                         [](const auto& info) { return info.param; });

// Creating an engine with `c` (in a child) fails with `code`, the message holding `words`.
void expect_create_refused(const EngineConfig& c, StatusCode code, const std::string& words) {
    auto results = run_processes(
        1,
        [&](Exchange&) -> std::string {
            auto e = TransferEngine::create(c);
            CHILD_CHECK(!e.ok());
            CHILD_CHECK(e.status().code() == code);
            CHILD_CHECK_MSG(e.status().message().find(words) != std::string::npos, "{}",
                            e.status().message());
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

TEST(EngineConfigTest, UnknownProviderIsAClearError) {
    EngineConfig c;
    c.provider = "nosuchprovider";
    expect_create_refused(c, StatusCode::kUnavailable,
                          "provider 'nosuchprovider' is not available");
}

TEST(EngineConfigTest, GpuMemoryWithoutAGpuIsRefusedClearly) {
    // In a child, like every engine test: the test binary's own process stays free of
    // libfabric state so later forks start clean.
    auto results = run_processes(
        1,
        [](Exchange&) -> std::string {
            CHILD_ASSIGN_OK(auto e, TransferEngine::create(testing::test_engine_config("shm")));
            std::vector<uint8_t> b(64);
            auto r = e->register_memory(b.data(), b.size(), MemoryKind::kCuda, 0);
            CHILD_CHECK(!r.ok());
            // Without a GPU (or without CUDA in the build) the message says so; with one, the
            // host pointer is named as not being device memory.
            const std::string& m = r.status().message();
            CHILD_CHECK_MSG(m.find("CUDA") != std::string::npos ||
                                m.find("is not device memory") != std::string::npos,
                            "{}", m);
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

TEST(EngineConfigTest, UnknownGpuCopyModeIsAClearError) {
    EngineConfig c = testing::test_engine_config("tcp");
    c.gpu_copy = "fastest";  // was taken silently as "kernel"
    expect_create_refused(c, StatusCode::kInvalidArgument, "gpu_copy must be");
}

// shutdown() from another thread ends a wait in progress with kCancelled, refuses later calls,
// and leaves the object valid (regions outlive it); regions_registered counts registrations.
TEST(EngineConfigTest, ShutdownEndsWaitsAndRegistrationsAreCounted) {
    auto results = run_processes(
        1,
        [](Exchange&) -> std::string {
            CHILD_ASSIGN_OK(auto e, TransferEngine::create(testing::test_engine_config("tcp")));
            std::vector<uint8_t> b(4096);
            CHILD_ASSIGN_OK(auto r1, e->register_memory(b.data(), b.size()));
            CHILD_ASSIGN_OK(auto r2, e->register_memory(b.data(), 64));  // same memory again
            CHILD_CHECK(e->stats().regions_registered == 2);
            r2.reset();
            CHILD_CHECK(e->stats().regions_registered == 1);
            std::thread closer([&] {
                std::this_thread::sleep_for(std::chrono::milliseconds(100));
                e->shutdown();
            });
            auto t0 = Clock::now();
            Status s = e->wait_imm(5, 1, std::chrono::seconds(10));
            closer.join();
            CHILD_CHECK_MSG(s.code() == StatusCode::kCancelled, "{}", s.to_string());
            CHILD_CHECK(Clock::now() - t0 < std::chrono::seconds(5));
            e->shutdown();  // idempotent
            CHILD_CHECK(e->register_memory(b.data(), 64).status().code() == StatusCode::kCancelled);
            r1.reset();  // after shutdown: nothing to deregister, no crash
            e.reset();
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// Several ranges registered in one call: a region each, in order, with keys of their own (a
// KV pull offer's windows); a bad range anywhere registers none of them.
TEST(EngineConfigTest, RangesRegisteredAtOnceAreRegionsOfTheirOwnAllOrNothing) {
    auto results = run_processes(
        1,
        [](Exchange&) -> std::string {
            for (const char* provider : {"tcp", "shm"}) {
                CHILD_ASSIGN_OK(auto e,
                                TransferEngine::create(testing::test_engine_config(provider)));
                std::vector<uint8_t> b(1 << 20);
                std::vector<std::span<uint8_t>> ranges;
                for (size_t i = 0; i < 128; ++i) ranges.emplace_back(b.data() + i * 8192, 4096);
                CHILD_ASSIGN_OK(auto regions, e->register_memory(ranges, MemoryKind::kHost, -1,
                                                                 RemoteAccess::kRead));
                CHILD_CHECK(regions.size() == ranges.size());
                CHILD_CHECK(e->stats().regions_registered == ranges.size());
                std::set<uint32_t> ids;
                for (size_t i = 0; i < regions.size(); ++i) {
                    CHILD_CHECK(regions[i]->data() == ranges[i].data());
                    CHILD_CHECK(regions[i]->size() == 4096);
                    CHILD_CHECK(regions[i]->descriptor().base ==
                                reinterpret_cast<uint64_t>(ranges[i].data()));
                    CHILD_CHECK(regions[i]->remote_access() == RemoteAccess::kRead);
                    ids.insert(regions[i]->id());
                }
                CHILD_CHECK(ids.size() == regions.size());
                regions.clear();
                CHILD_CHECK(e->stats().regions_registered == 0);
                ranges[77] = {b.data(), size_t{0}};
                auto bad = e->register_memory(ranges);
                CHILD_CHECK(bad.status().code() == StatusCode::kInvalidArgument);
                CHILD_CHECK_MSG(bad.status().message().find("range 77 of 128") != std::string::npos,
                                "{}", bad.status().to_string());
                CHILD_CHECK(e->stats().regions_registered == 0);
                CHILD_ASSIGN_OK(auto none, e->register_memory(std::span<std::span<uint8_t>>()));
                CHILD_CHECK(none.empty());
            }
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// An address of an engine of this process that was shut down (a Python user's closed
// engine, a test's earlier one) is refused by connect. As the first peer of an shm engine it
// crashed the process inside libfabric (fi_av_insert on the rail worker, SIGSEGV), every time.
TEST(EngineConfigTest, ConnectingToAShutDownEngineOfThisProcessIsRefused) {
    for (const char* provider : {"shm", "tcp"}) {
        auto results = run_processes(
            1,
            [provider](Exchange&) -> std::string {
                const EngineConfig c = testing::test_engine_config(provider);
                CHILD_ASSIGN_OK(auto a, TransferEngine::create(c));
                CHILD_ASSIGN_OK(auto gone, TransferEngine::create(c));
                const EngineAddress addr = gone->address();
                gone.reset();
                auto p = a->connect(addr);
                CHILD_CHECK_MSG(!p.ok() && p.status().code() == StatusCode::kUnavailable &&
                                    p.status().message().find("was shut down") != std::string::npos,
                                "{}: {}", provider, p.status().to_string());
                // A live engine of this process is still reached.
                CHILD_ASSIGN_OK(auto live, TransferEngine::create(c));
                CHILD_ASSIGN_OK(auto q, a->connect(live->address()));
                std::vector<uint8_t> src(64, 7), dst(64, 0);
                CHILD_ASSIGN_OK(auto rs, a->register_memory(src.data(), src.size()));
                CHILD_ASSIGN_OK(auto rd, live->register_memory(dst.data(), dst.size()));
                // The immediate says when the bytes are in at the target.
                CHILD_CHECK_OK(a->write({q, rs.get(), 0, &rd->descriptor(), 0, 64, 77})
                                   .wait(std::chrono::seconds(10)));
                CHILD_CHECK_OK(live->wait_imm(77, 1, std::chrono::seconds(10)));
                CHILD_CHECK_MSG(dst == src, "{}: the write to a live engine did not land",
                                provider);
                return "";
            },
            kRunTimeout);
        EXPECT_EQ(testing::describe_failures(results), "") << provider;
    }
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

// Regions of engines whose process died (SIGKILL) are removed by the next shm engine; those
// of live processes stay.
TEST(EngineConfigTest, StaleShmRegionsOfDeadProcessesAreRemoved) {
    pid_t dead = fork();
    if (dead == 0) _exit(0);
    int st = 0;
    waitpid(dead, &st, 0);  // reaped: the pid no longer exists
    std::string stale = fmt::format("/dev/shm/ferry_{}_feed_0", dead);
    std::string live = fmt::format("/dev/shm/ferry_{}_beef_0", getpid());
    for (const auto& p : {stale, live}) {
        FILE* f = std::fopen(p.c_str(), "w");
        ASSERT_NE(f, nullptr) << p;
        std::fclose(f);
    }
    auto results = testing::run_processes(
        1,
        [](testing::Exchange&) -> std::string {
            CHILD_ASSIGN_OK(auto e, TransferEngine::create(testing::test_engine_config("shm")));
            return "";
        },
        std::chrono::seconds(60));
    EXPECT_EQ(testing::describe_failures(results), "");
    EXPECT_NE(access(stale.c_str(), F_OK), 0) << stale << " was left behind";
    EXPECT_EQ(access(live.c_str(), F_OK), 0) << live << " of a live process was removed";
    unlink(live.c_str());
}

// CPU time (clock ticks) the rail workers of this process used so far.
long rail_worker_ticks() {
    long ticks = 0;
    DIR* d = opendir("/proc/self/task");
    if (!d) return -1;
    while (dirent* t = readdir(d)) {
        if (t->d_name[0] == '.') continue;
        const std::string base = fmt::format("/proc/self/task/{}/", t->d_name);
        std::ifstream comm(base + "comm");
        std::string name;
        std::getline(comm, name);
        if (name.rfind("ferry-rail", 0) != 0) continue;
        std::ifstream stat(base + "stat");
        std::string line;
        std::getline(stat, line);
        // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
        std::istringstream rest(line.substr(line.rfind(')') + 2));
        std::string field;
        long utime = 0, stime = 0;
        for (int i = 3; i <= 15 && rest >> field; ++i) {
            if (i == 14) utime = std::stol(field);
            if (i == 15) stime = std::stol(field);
        }
        ticks += utime + stime;
    }
    closedir(d);
    return ticks;
}

// An engine with nothing to do naps up to quiet_nap once quiet_after has passed: with every
// nap at max_nap (100 us) one rail of an idle serve engine took ~11% of a core, and 32 idle
// engines both cores of a small host. Same process, one engine after the other, each measured
// over 2 s of idleness after its quiet spell began.
TEST(EngineConfigTest, AQuietEngineNapsLonger) {
    auto results = testing::run_processes(
        1,
        [](testing::Exchange&) -> std::string {
            long used[2] = {0, 0};
            for (int quiet = 0; quiet < 2; ++quiet) {
                EngineConfig c = testing::test_engine_config("tcp");
                c.quiet_after = std::chrono::milliseconds(200);
                c.quiet_nap = quiet ? std::chrono::milliseconds(2) : c.max_nap;
                CHILD_ASSIGN_OK(auto e, TransferEngine::create(c));
                std::this_thread::sleep_for(std::chrono::milliseconds(400));
                const long before = rail_worker_ticks();
                std::this_thread::sleep_for(std::chrono::seconds(2));
                used[quiet] = rail_worker_ticks() - before;
                CHILD_CHECK_MSG(before >= 0, "cannot read /proc/self/task");
            }
            CHILD_CHECK_MSG(used[0] >= 4 && used[1] * 3 <= used[0],
                            "idle rail workers used {} ticks in 2 s with naps of max_nap, {} with "
                            "quiet naps (want at least 4, and a third of that at most)",
                            used[0], used[1]);
            return "";
        },
        std::chrono::seconds(60));
    EXPECT_EQ(testing::describe_failures(results), "");
}

// An expectation of signalled arrivals keeps the workers polling for expect_spin only, then
// they nap as when idle: a decode engine expects a push for all of prefill's compute, and its
// polling worker took a core from the prefill engine on the same host (issue 32). One of any
// arrivals (reads, which a target never sees) keeps them polling. Same process, the same 1.5 s
// of an open expectation measured three times, from 400 ms after it began: signalled with an
// expect_spin longer than the run (the polling of before), signalled with 100 ms, any with
// 100 ms.
TEST(EngineConfigTest, ASignalledExpectationPollsForExpectSpinThenNaps) {
    auto results = testing::run_processes(
        1,
        [](testing::Exchange&) -> std::string {
            struct Case {
                Expected what;
                Duration spin;
                long used = 0;
            } cases[] = {{Expected::kSignalled, std::chrono::hours(1)},
                         {Expected::kSignalled, std::chrono::milliseconds(100)},
                         {Expected::kAny, std::chrono::milliseconds(100)}};
            for (Case& c : cases) {
                EngineConfig config = testing::test_engine_config("tcp");
                config.expect_spin = c.spin;
                CHILD_ASSIGN_OK(auto e, TransferEngine::create(config));
                ArrivalsExpected expecting(e.get(), c.what);
                std::this_thread::sleep_for(std::chrono::milliseconds(400));
                const long before = rail_worker_ticks();
                std::this_thread::sleep_for(std::chrono::milliseconds(1500));
                c.used = rail_worker_ticks() - before;
                CHILD_CHECK_MSG(before >= 0, "cannot read /proc/self/task");
            }
            CHILD_CHECK_MSG(cases[0].used >= 15 && cases[1].used * 3 <= cases[0].used &&
                                cases[2].used * 3 > cases[0].used,
                            "a rail worker expecting arrivals used {} ticks in 1.5 s polling "
                            "throughout, {} with expect_spin 100 ms, {} expecting any arrivals "
                            "(want at least 15, at most a third of that, more than a third)",
                            cases[0].used, cases[1].used, cases[2].used);
            return "";
        },
        std::chrono::seconds(60));
    EXPECT_EQ(testing::describe_failures(results), "");
}

// With no immediate waiter the watchdog ticks every 20 ms; a first waiter pokes it back to a
// sweep every millisecond, so a short wait on a quiet engine still times out on time (without
// the poke a 5 ms wait ended ~5 ms late in the median, up to 15 ms). The median of 11 waits of
// 5 ms, each after 203-273 ms idle.
TEST(EngineConfigTest, AWaitOnAQuietEngineTimesOutOnTime) {
    auto results = testing::run_processes(
        1,
        [](testing::Exchange&) -> std::string {
            CHILD_ASSIGN_OK(auto e, TransferEngine::create(testing::test_engine_config("tcp")));
            std::vector<double> late;
            for (int i = 0; i < 11; ++i) {
                // Not a multiple of the 20 ms tick, so the waits fall at every phase of it.
                std::this_thread::sleep_for(std::chrono::milliseconds(203 + 7 * i));
                const auto t0 = std::chrono::steady_clock::now();
                Status s = e->wait_imm(0x77, 1, std::chrono::milliseconds(5));
                const double ms =
                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                        .count();
                CHILD_CHECK_MSG(s.code() == StatusCode::kTimeout, "wait returned {}",
                                s.to_string());
                late.push_back(ms - 5);
            }
            std::sort(late.begin(), late.end());
            CHILD_CHECK_MSG(late[5] < 3, "a 5 ms wait ended a median {:.1f} ms late", late[5]);
            return "";
        },
        std::chrono::seconds(60));
    EXPECT_EQ(testing::describe_failures(results), "");
}

}  // namespace
}  // namespace ferry

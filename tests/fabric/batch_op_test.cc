// submit_all: many writes, writes with immediates and reads to several peers as one operation
// with one completion, between real processes; an invalid entry fails it before anything moves.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "ferry/fabric/engine.h"
#include "support/byte_pattern.h"
#include "support/engine_fixture.h"
#include "support/multiproc.h"

namespace ferry {
namespace {

using testing::Exchange;
using testing::make_mesh_node;
using testing::MeshNode;
using testing::pattern;
using testing::run_processes;
using testing::test_engine_config;

constexpr uint8_t kPoison = 0xA5;
constexpr size_t kBuf = 256 * 1024;
constexpr size_t kHalf = kBuf / 2;  // [0, kHalf): each rank's pattern; above: poison
constexpr size_t kSlot = 10000;     // one destination slot per entry
constexpr int kTargets = 2;         // ranks 1 and 2
constexpr int kPerTarget = 6;
constexpr uint32_t kImmBase = 40;
const auto kWait = std::chrono::seconds(20);

enum class Kind { kWrite, kWriteImm, kRead };
struct Entry {
    int target;  // rank
    Kind kind;
    uint64_t src, dst, len;  // for a read, src is in the target, dst here
};

// The same plan on every rank. Writes go to slot j of the target's upper half, reads into the
// initiator's upper half; the first two entries per target are writes of exactly inject_size
// and one byte more.
std::vector<Entry> plan(uint64_t seed, size_t inject) {
    std::mt19937_64 rng(seed);
    std::vector<Entry> out;
    for (int t = 1; t <= kTargets; ++t) {
        for (int j = 0; j < kPerTarget; ++j) {
            Kind k = j < 2 ? Kind::kWriteImm : static_cast<Kind>(rng() % 3);
            uint64_t len = 1 + rng() % 9000;
            if (j < 2 && inject + 1 < kSlot) len = inject + j;
            uint64_t src = rng() % (kHalf - len);
            uint64_t dst = kHalf + ((t - 1) * kPerTarget + j) * kSlot;
            if (k != Kind::kRead) dst = kHalf + j * kSlot;
            out.push_back({t, k, src, dst, len});
        }
    }
    return out;
}

std::string first_diff(const std::vector<uint8_t>& b, size_t off, size_t len,
                       const std::function<uint8_t(size_t)>& want) {
    for (size_t k = 0; k < len; ++k) {
        if (b[off + k] != want(k)) {
            return fmt::format("byte {} (+{} of {}): got {:#x} want {:#x}", off + k, k, len,
                               b[off + k], want(k));
        }
    }
    return "";
}

class BatchOpTest : public ::testing::TestWithParam<std::string> {};

TEST_P(BatchOpTest, SubmitAllMovesEveryEntryAndRefusesABadOneBeforeAnythingMoves) {
    uint64_t seed = testing::test_seed("SubmitAll");
    auto results = run_processes(
        1 + kTargets,
        [&](Exchange& ex) -> std::string {
            const int me = ex.rank();
            CHILD_ASSIGN_OK(MeshNode n,
                            make_mesh_node(ex, test_engine_config(GetParam()), kBuf, kPoison));
            for (size_t i = 0; i < kHalf; ++i) n.buf[i] = pattern(seed + me, i);
            // Every rank's engine has the same provider, so the same inject size.
            const std::vector<Entry> entries = plan(seed, n.engine->inject_size());
            CHILD_CHECK(ex.barrier().ok());  // patterns in place before anyone reads
            // The refused batch's valid write would land in slot kPerTarget of rank 1.
            const uint64_t refused_dst = kHalf + kPerTarget * kSlot;
            if (me == 0) {
                std::vector<BatchEntry> ops;
                uint32_t imm_writes = 0;
                for (const Entry& e : entries) {
                    if (e.kind == Kind::kRead) {
                        ops.push_back(ReadOp{n.peer[e.target], n.mr.get(), e.dst, &n.desc[e.target],
                                             e.src, e.len});
                        continue;
                    }
                    std::optional<uint32_t> imm;
                    if (e.kind == Kind::kWriteImm) {
                        imm = kImmBase + e.target;
                        ++imm_writes;
                    }
                    ops.push_back(WriteOp{n.peer[e.target], n.mr.get(), e.src, &n.desc[e.target],
                                          e.dst, e.len, imm});
                }
                int calls = 0;
                OpHandle h = n.engine->submit_all(ops, [&](const Status&) { ++calls; });
                CHILD_CHECK_OK(h.wait(kWait));
                CHILD_CHECK_MSG(h.imm_writes() == imm_writes, "imm_writes {} want {}",
                                h.imm_writes(), imm_writes);
                CHILD_CHECK_MSG(calls == 1, "callback ran {} times", calls);
                for (const Entry& e : entries) {
                    if (e.kind != Kind::kRead) continue;
                    std::string d = first_diff(n.buf, e.dst, e.len, [&](size_t k) {
                        return pattern(seed + e.target, e.src + k);
                    });
                    CHILD_CHECK_MSG(d.empty(), "read from rank {}: {}", e.target, d);
                    d = first_diff(n.buf, e.dst + e.len, kSlot - e.len,
                                   [](size_t) { return kPoison; });
                    CHILD_CHECK_MSG(d.empty(), "past a read from rank {}: {}", e.target, d);
                }
                // A valid write and one to a peer that does not exist: nothing is posted.
                std::vector<BatchEntry> bad = {
                    WriteOp{n.peer[1], n.mr.get(), 0, &n.desc[1], refused_dst, 512, 77u},
                    WriteOp{999, n.mr.get(), 0, &n.desc[1], refused_dst, 512, 77u}};
                Status s = n.engine->submit_all(bad).wait(kWait);
                CHILD_CHECK_MSG(
                    s.code() == StatusCode::kNotFound &&
                        s.message().find("peer 999 is not connected") != std::string::npos,
                    "{}", s.to_string());
                Status empty = n.engine->submit_all({}).wait(kWait);
                CHILD_CHECK_MSG(empty.code() == StatusCode::kInvalidArgument, "{}",
                                empty.to_string());
                // Everything above completed here; a signal per target says so.
                for (int t = 1; t <= kTargets; ++t)
                    CHILD_CHECK_OK(n.engine->signal(n.peer[t], 99).wait(kWait));
            } else {
                CHILD_CHECK_OK(n.engine->wait_imm(99, 1, kWait));
                uint64_t imms = 0;
                for (const Entry& e : entries) {
                    if (e.target != me || e.kind == Kind::kRead) continue;
                    imms += e.kind == Kind::kWriteImm;
                    std::string d = first_diff(n.buf, e.dst, e.len,
                                               [&](size_t k) { return pattern(seed, e.src + k); });
                    CHILD_CHECK_MSG(d.empty(), "write of {} bytes: {}", e.len, d);
                    d = first_diff(n.buf, e.dst + e.len, kSlot - e.len,
                                   [](size_t) { return kPoison; });
                    CHILD_CHECK_MSG(d.empty(), "past a write of {} bytes: {}", e.len, d);
                }
                CHILD_CHECK_OK(n.engine->wait_imm(kImmBase + me, imms, kWait));
                std::string d =
                    first_diff(n.buf, refused_dst, kSlot, [](size_t) { return kPoison; });
                CHILD_CHECK_MSG(d.empty(), "the refused batch wrote: {}", d);
                CHILD_CHECK(n.engine->imm_available(77) == 0);
            }
            CHILD_CHECK(ex.barrier().ok());  // reads done before targets go away
            return "";
        },
        std::chrono::seconds(120));
    EXPECT_EQ(testing::describe_failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Providers, BatchOpTest, ::testing::ValuesIn(testing::test_providers()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry

// AllToAll between real processes, one per rank: same-node ranks through shared memory,
// the others through the TransferEngine on the tcp and shm providers.
#include "ferry/moe/all_to_all.h"

#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "ferry/fabric/engine.h"
#include "ferry/moe/host_proxy.h"
#include "moe/test_util.h"
#include "support/engine_fixture.h"
#include "support/multiproc.h"

namespace ferry::moe {
namespace {

using ferry::testing::Exchange;
using testing::BatchStorage;
using testing::RankInput;
using testing::Routing;

const auto kRunTimeout = std::chrono::seconds(60);

struct Shape {
    uint32_t world;
    uint32_t ranks_per_node;
    DType dtype = DType::kBf16;
    uint32_t max_tokens = 24;
    uint32_t private_slots = 4;
    int calls = 3;
    Routing routing = Routing::kUniform;
    // Two rails and tiny pieces: every fabric put of more than 2 KiB becomes several writes,
    // each carrying the immediate, which receivers must count.
    bool split_writes = false;
    CombineMode combine = CombineMode::kPerHit;
};

AllToAllConfig config_of(const Shape& s, uint32_t rank) {
    AllToAllConfig c;
    c.max_tokens_per_rank = s.max_tokens;
    c.hidden = 256;
    c.dtype = s.dtype;
    c.num_experts = 16;
    c.experts_per_token = 4;
    c.rank = rank;
    c.world_size = s.world;
    c.ranks_per_node = s.ranks_per_node;
    c.private_slots_per_sender = s.private_slots;
    c.group_alignment = 4;
    c.combine = s.combine;
    return c;
}

// Every rank builds every rank's inputs from the same seed, so each can check what it got.
std::vector<RankInput> inputs_for_call(const AllToAllConfig& cfg, const Shape& s, uint64_t seed,
                                       int call) {
    std::mt19937_64 rng(seed * 1000003 + call);
    std::vector<RankInput> all;
    for (uint32_t r = 0; r < cfg.world_size; ++r) {
        // Rank 1 is empty on every other call: empty ranks mixed with full ones.
        uint32_t n =
            (r == 1 && call % 2 == 1) ? 0 : static_cast<uint32_t>(rng() % (s.max_tokens + 1));
        all.push_back(testing::make_input(cfg, r, n, s.routing, 0.15, rng));
    }
    return all;
}

std::string run_rank(Exchange& ex, const std::string& provider, const Shape& s, uint64_t seed) {
    AllToAllConfig cfg = config_of(s, static_cast<uint32_t>(ex.rank()));
    EngineConfig ec = ferry::testing::test_engine_config(provider);
    if (s.split_writes) {
        ec.num_rails = 2;
        ec.stripe_threshold = 2048;
        ec.max_write_size = 4096;
    }
    CHILD_ASSIGN_OK(auto engine, TransferEngine::create(ec));
    if (s.split_writes) CHILD_CHECK(write_pieces(engine->config(), engine->num_rails(), 20000) > 2);
    AllGatherFn allgather = [&ex](std::span<const uint8_t> b) { return ex.allgather(b); };
    AllToAllOptions opts;
    opts.timeout = std::chrono::seconds(20);
    CHILD_ASSIGN_OK(auto a2a, AllToAll::create(cfg, engine.get(), allgather, opts));
    BatchStorage batch(cfg);
    std::mt19937_64 jitter(seed + ex.rank());
    for (int call = 0; call < s.calls; ++call) {
        std::vector<RankInput> all = inputs_for_call(cfg, s, seed, call);
        const RankInput& mine = all[cfg.rank];
        // Uneven starts: a fast rank must not overwrite a slow rank's buffers.
        std::this_thread::sleep_for(std::chrono::microseconds(jitter() % 3000));
        CHILD_CHECK_OK(a2a->dispatch_send(mine.input()));
        CHILD_CHECK_OK(a2a->dispatch_recv(batch.batch()));
        std::string err = testing::check_dispatch(cfg, all, batch);
        CHILD_CHECK_MSG(err.empty(), "call {}: {}", call, err);
        bool per_expert = call % 2 == 0;
        auto expert_out = testing::run_experts(cfg, batch, per_expert);
        std::this_thread::sleep_for(std::chrono::microseconds(jitter() % 3000));
        CHILD_CHECK_OK(a2a->combine_send(expert_out));
        std::vector<float> out(size_t{mine.num_tokens} * cfg.hidden, -1.0f);
        CHILD_CHECK_OK(a2a->combine_recv(out));
        err = testing::check_combine(cfg, mine, out, per_expert);
        CHILD_CHECK_MSG(err.empty(), "call {}: {}", call, err);
    }
    // Nobody frees its buffers while a peer may still write into them.
    CHILD_CHECK_OK(ex.barrier());
    return "";
}

using Param = std::tuple<std::string, uint32_t, uint32_t>;  // provider, world, ranks per node

class AllToAllTest : public ::testing::TestWithParam<Param> {};

TEST_P(AllToAllTest, DispatchAndCombineAreExactAcrossCalls) {
    auto [provider, world, rpn] = GetParam();
    Shape s{world, rpn};
    // fp8 on half of the shapes keeps the suite short while covering both dtypes.
    if ((world + rpn) % 2 == 1) s.dtype = DType::kFp8E4M3;
    // Per-rank partials (one combine row per dispatched row) on the two-ranks-per-node shapes.
    if (rpn == 2) s.combine = CombineMode::kPerRank;
    uint64_t seed =
        ferry::testing::test_seed(::testing::UnitTest::GetInstance()->current_test_info()->name());
    auto results = ferry::testing::run_processes(
        static_cast<int>(world), [&](Exchange& ex) { return run_rank(ex, provider, s, seed); },
        kRunTimeout);
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Shapes, AllToAllTest,
                         ::testing::Values(Param{"tcp", 2, 1}, Param{"tcp", 2, 2},
                                           Param{"tcp", 4, 1}, Param{"tcp", 4, 2},
                                           Param{"tcp", 4, 4}, Param{"tcp", 8, 1},
                                           Param{"tcp", 8, 2}, Param{"tcp", 8, 4},
                                           Param{"shm", 2, 1}, Param{"shm", 2, 2},
                                           Param{"shm", 4, 1}, Param{"shm", 4, 2},
                                           Param{"shm", 4, 4}, Param{"shm", 8, 1},
                                           Param{"shm", 8, 2}, Param{"shm", 8, 4}),
                         [](const ::testing::TestParamInfo<Param>& i) {
                             return fmt::format("{}_world{}_pernode{}", std::get<0>(i.param),
                                                std::get<1>(i.param), std::get<2>(i.param));
                         });

TEST(AllToAllSetup, SkewedRoutingOverflowsAcrossNodes) {
    Shape s{4, 2, DType::kFp8E4M3, 32, 2, 2, Routing::kSkewed};
    uint64_t seed = ferry::testing::test_seed("AllToAllSetup.SkewedRoutingOverflowsAcrossNodes");
    auto results = ferry::testing::run_processes(
        4, [&](Exchange& ex) { return run_rank(ex, "tcp", s, seed); }, kRunTimeout);
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
}

TEST(AllToAllSetup, WritesSplitIntoPiecesAreCountedPerPiece) {
    Shape s{4, 2, DType::kBf16, 24, 2, 2};
    s.split_writes = true;
    uint64_t seed =
        ferry::testing::test_seed("AllToAllSetup.WritesSplitIntoPiecesAreCountedPerPiece");
    auto results = ferry::testing::run_processes(
        4, [&](Exchange& ex) { return run_rank(ex, "tcp", s, seed); }, kRunTimeout);
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
}

TEST(AllToAllSetup, MismatchedConfigIsRefusedOnEveryRank) {
    auto results = ferry::testing::run_processes(
        2,
        [](Exchange& ex) -> std::string {
            AllToAllConfig cfg = config_of(Shape{2, 1}, static_cast<uint32_t>(ex.rank()));
            if (ex.rank() == 1) cfg.hidden = 512;
            CHILD_ASSIGN_OK(auto engine,
                            TransferEngine::create(ferry::testing::test_engine_config("tcp")));
            AllGatherFn ag = [&ex](std::span<const uint8_t> b) { return ex.allgather(b); };
            auto a2a = AllToAll::create(cfg, engine.get(), ag);
            CHILD_CHECK_MSG(!a2a.ok(), "a mismatched config was accepted");
            CHILD_CHECK_MSG(
                a2a.status().message().find("AllToAllConfig differs on rank(s) " +
                                            std::to_string(1 - ex.rank())) != std::string::npos,
                "{}", a2a.status().to_string());
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
}

TEST(AllToAllSetup, ADeadPeerTurnsIntoATimeoutNotAHang) {
    auto results = ferry::testing::run_processes(
        2,
        [](Exchange& ex) -> std::string {
            AllToAllConfig cfg = config_of(Shape{2, 1}, static_cast<uint32_t>(ex.rank()));
            CHILD_ASSIGN_OK(auto engine,
                            TransferEngine::create(ferry::testing::test_engine_config("tcp")));
            AllGatherFn ag = [&ex](std::span<const uint8_t> b) { return ex.allgather(b); };
            AllToAllOptions opts;
            opts.timeout = std::chrono::milliseconds(1500);
            CHILD_ASSIGN_OK(auto a2a, AllToAll::create(cfg, engine.get(), ag, opts));
            if (ex.rank() == 1) _exit(0);  // dies without a word
            std::mt19937_64 rng(7);
            RankInput in = testing::make_input(cfg, 0, 8, Routing::kUniform, 0.0, rng);
            auto t0 = Clock::now();
            Status st = a2a->dispatch_send(in.input());
            CHILD_CHECK_MSG(!st.ok(), "dispatch with a dead peer succeeded");
            CHILD_CHECK_MSG(Clock::now() - t0 < std::chrono::seconds(8), "took {} ms",
                            to_ms(Clock::now() - t0));
            CHILD_CHECK_MSG(st.message().find("rank 1") != std::string::npos, "{}", st.to_string());
            return "";
        },
        kRunTimeout);
    ASSERT_EQ(results.size(), 2u);
    EXPECT_TRUE(results[0].ok()) << ferry::testing::describe_failures(results);
}

}  // namespace
}  // namespace ferry::moe

// The full protocol, every rank a thread of this process (LocalWorld).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "ferry/moe/local_world.h"
#include "moe/test_util.h"
#include "support/multiproc.h"

namespace ferry::moe {
namespace {

using testing::BatchStorage;
using testing::RankInput;
using testing::Routing;

struct Case {
    const char* name;
    uint32_t world = 4;
    DType dtype = DType::kBf16;
    uint32_t num_experts = 16;
    uint32_t topk = 4;
    uint32_t max_tokens = 32;
    uint32_t private_slots = 4;
    uint32_t alignment = 1;
    Routing routing = Routing::kUniform;
    double hole = 0.15;
    std::vector<uint32_t> tokens = {};  // per rank; empty: random in [0, max_tokens]
    bool per_expert = false;
    int calls = 1;
    bool bf16_out = false;  // combine_recv_bf16 instead of fp32 output
    CombineMode combine = CombineMode::kPerHit;
    // Dispatch with wrong weights, give the right ones with set_combine_weights (what the
    // Python interfaces do: DeepEP and pplx-garden pass weights to combine).
    bool weights_at_combine = false;
};

AllToAllConfig config_of(const Case& k) {
    AllToAllConfig c;
    c.max_tokens_per_rank = k.max_tokens;
    c.hidden = 256;
    c.dtype = k.dtype;
    c.num_experts = k.num_experts;
    c.experts_per_token = k.topk;
    c.world_size = k.world;
    c.ranks_per_node = k.world;
    c.private_slots_per_sender = k.private_slots;
    c.group_alignment = k.alignment;
    c.combine = k.combine;
    return c;
}

// Runs `calls` full dispatch/combine rounds and checks every rank's outputs in each.
void run_case(const Case& k) {
    std::mt19937_64 rng(ferry::testing::test_seed(k.name));
    AllToAllConfig cfg = config_of(k);
    auto world = LocalWorld::create(cfg, std::chrono::seconds(20));
    ASSERT_TRUE(world.ok()) << world.status().to_string();
    for (int call = 0; call < k.calls; ++call) {
        std::vector<RankInput> inputs;
        for (uint32_t r = 0; r < k.world; ++r) {
            uint32_t n =
                k.tokens.empty() ? static_cast<uint32_t>(rng() % (k.max_tokens + 1)) : k.tokens[r];
            inputs.push_back(testing::make_input(cfg, r, n, k.routing, k.hole, rng));
        }
        std::vector<uint64_t> jitter(k.world);
        for (auto& j : jitter) j = rng() % 3;
        std::vector<std::string> errors(k.world);
        Status st = (*world)->run([&](uint32_t r, CpuBackend& b) -> Status {
            AllToAllConfig mine = cfg;
            mine.rank = r;
            // A rank that starts late must not see its buffers overwritten by fast ones.
            std::this_thread::sleep_for(std::chrono::milliseconds(jitter[r]));
            DispatchInput in = inputs[r].input();
            std::vector<float> wrong(inputs[r].weights.size(), 0.375f);
            if (k.weights_at_combine) in.weights = wrong;
            FERRY_RETURN_IF_ERROR(b.dispatch_send(in));
            // Per-expert counts of what we sent equal a bincount of our routing.
            std::vector<uint32_t> bincount(cfg.num_experts, 0);
            for (int32_t e : inputs[r].indices)
                if (e >= 0) ++bincount[e];
            if (b.sent_expert_counts() != bincount) {
                errors[r] = "sent expert counts differ from the bincount of the indices";
                return ok_status();
            }
            BatchStorage batch(mine);
            FERRY_RETURN_IF_ERROR(b.dispatch_recv(batch.batch()));
            errors[r] = testing::check_dispatch(mine, inputs, batch);
            auto expert_out = testing::run_experts(mine, batch, k.per_expert);
            std::this_thread::sleep_for(std::chrono::milliseconds(jitter[(r + 1) % k.world]));
            FERRY_RETURN_IF_ERROR(b.combine_send(expert_out));
            if (k.weights_at_combine)
                FERRY_RETURN_IF_ERROR(b.set_combine_weights(inputs[r].weights));
            std::vector<float> out(size_t{inputs[r].num_tokens} * cfg.hidden, -1.0f);
            float tol = 1e-5f;
            if (k.bf16_out) {
                std::vector<uint16_t> ob(out.size(), 0xffff);
                FERRY_RETURN_IF_ERROR(b.combine_recv_bf16(ob));
                for (size_t i = 0; i < ob.size(); ++i) out[i] = bf16_to_float(ob[i]);
                tol = 1.0f / 256;
            } else {
                FERRY_RETURN_IF_ERROR(b.combine_recv(out));
            }
            if (errors[r].empty())
                errors[r] = testing::check_combine(mine, inputs[r], out, k.per_expert, tol);
            return ok_status();
        });
        ASSERT_TRUE(st.ok()) << "call " << call << ": " << st.to_string();
        for (uint32_t r = 0; r < k.world; ++r)
            ASSERT_EQ(errors[r], "") << "call " << call << " rank " << r;
    }
}

TEST(MoeReference, UniformRoutingWithHolesBf16) {
    run_case({.name = "MoeReference.UniformRoutingWithHolesBf16", .calls = 3});
}

TEST(MoeReference, UniformRoutingFp8) {
    run_case({.name = "MoeReference.UniformRoutingFp8", .dtype = DType::kFp8E4M3, .calls = 3});
}

TEST(MoeReference, PerExpertOutputsReturnToTheirSlots) {
    run_case({.name = "MoeReference.PerExpertOutputsReturnToTheirSlots",
              .world = 4,
              .num_experts = 8,
              .topk = 4,
              .per_expert = true,
              .calls = 3});
}

TEST(MoeReference, SkewedRoutingOverflowsPrivateSlots) {
    run_case({.name = "MoeReference.SkewedRoutingOverflowsPrivateSlots",
              .world = 4,
              .num_experts = 32,
              .topk = 4,
              .max_tokens = 48,
              .private_slots = 2,
              .routing = Routing::kSkewed,
              .hole = 0.05,
              .tokens = {48, 48, 40, 48}});
}

TEST(MoeReference, EmptyRanks) {
    run_case({.name = "MoeReference.EmptyRanks", .tokens = {0, 17, 0, 5}, .calls = 2});
    run_case({.name = "MoeReference.AllRanksEmpty", .tokens = {0, 0, 0, 0}});
}

TEST(MoeReference, NoPrivateSlotsAndAllPrivateSlots) {
    run_case({.name = "MoeReference.NoPrivateSlots", .private_slots = 0, .calls = 2});
    run_case({.name = "MoeReference.AllPrivateSlots", .private_slots = 32, .calls = 2});
}

TEST(MoeReference, AlignedGroupsAndMoreExpertsThanTopk) {
    run_case({.name = "MoeReference.AlignedGroups",
              .world = 2,
              .dtype = DType::kFp8E4M3,
              .num_experts = 64,
              .topk = 8,
              .alignment = 16,
              .per_expert = true});
}

TEST(MoeReference, EightRanksManyCallsReuseBuffers) {
    run_case({.name = "MoeReference.EightRanksManyCalls",
              .world = 8,
              .num_experts = 32,
              .topk = 6,
              .max_tokens = 16,
              .private_slots = 3,
              .calls = 12});
}

TEST(MoeReference, Bf16CombineOutput) {
    run_case({.name = "MoeReference.Bf16CombineOutput",
              .dtype = DType::kFp8E4M3,
              .per_expert = true,
              .calls = 2,
              .bf16_out = true});
}

TEST(MoeReference, SingleRank) {
    run_case(
        {.name = "MoeReference.SingleRank", .world = 1, .num_experts = 4, .topk = 2, .calls = 2});
}

// The expert's rank sums a token's outputs before sending: one row per (token, rank).
TEST(MoeReference, PerRankCombine) {
    run_case({.name = "MoeReference.PerRankCombine",
              .dtype = DType::kFp8E4M3,
              .per_expert = true,
              .calls = 3,
              .combine = CombineMode::kPerRank});
    run_case({.name = "MoeReference.PerRankCombineManyRanksOverflow",
              .world = 8,
              .num_experts = 32,
              .topk = 6,
              .max_tokens = 16,
              .private_slots = 1,
              .routing = Routing::kSkewed,
              .per_expert = true,
              .calls = 6,
              .combine = CombineMode::kPerRank});
    run_case({.name = "MoeReference.PerRankCombineBf16Out",
              .world = 2,
              .num_experts = 64,
              .topk = 8,
              .alignment = 16,
              .calls = 2,
              .bf16_out = true,
              .combine = CombineMode::kPerRank});
    run_case({.name = "MoeReference.PerRankCombineSingleRank",
              .world = 1,
              .num_experts = 4,
              .topk = 3,
              .per_expert = true,
              .combine = CombineMode::kPerRank});
}

TEST(MoeReference, WeightsGivenAtCombineReplaceTheDispatchedOnes) {
    run_case(
        {.name = "WeightsAtCombine", .per_expert = true, .calls = 3, .weights_at_combine = true});
}

TEST(MoeReference, SetCombineWeightsIsRefusedOutsideACallAndForPerRankCombine) {
    AllToAllConfig cfg = config_of({.name = "", .world = 1, .num_experts = 4, .topk = 2});
    auto world = LocalWorld::create(cfg, std::chrono::seconds(5));
    ASSERT_TRUE(world.ok());
    CpuBackend& b = (*world)->rank(0);
    std::vector<float> w = {0.5f, 0.5f};
    Status s = b.set_combine_weights(w);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("between dispatch_send and combine_recv"), std::string::npos)
        << s.message();
    std::vector<int32_t> idx = {3, 0};
    std::vector<uint8_t> x(cfg.payload_bytes());
    ASSERT_TRUE(b.dispatch_send({1, x, {}, idx, w}).ok());
    std::vector<float> short_w = {0.5f};
    s = b.set_combine_weights(short_w);
    EXPECT_NE(s.message().find("need 2"), std::string::npos) << s.message();
    EXPECT_TRUE(b.set_combine_weights(w).ok());

    AllToAllConfig pr = cfg;
    pr.combine = CombineMode::kPerRank;
    auto world2 = LocalWorld::create(pr, std::chrono::seconds(5));
    ASSERT_TRUE(world2.ok());
    CpuBackend& b2 = (*world2)->rank(0);
    ASSERT_TRUE(b2.dispatch_send({1, x, {}, idx, w}).ok());
    s = b2.set_combine_weights(w);
    EXPECT_NE(s.message().find("kPerHit"), std::string::npos) << s.message();
}

// A NaN or infinite weight made every output row it touched NaN, silently; refused by position,
// at dispatch and at combine, and the call then goes through with finite ones.
TEST(MoeReference, NonFiniteWeightsAreRefusedNamingTheEntry) {
    AllToAllConfig cfg = config_of({.name = "", .world = 1, .num_experts = 4, .topk = 2});
    auto world = LocalWorld::create(cfg, std::chrono::seconds(5));
    ASSERT_TRUE(world.ok());
    CpuBackend& b = (*world)->rank(0);
    std::vector<int32_t> idx = {3, 0, 1, -1};
    std::vector<uint8_t> x(2 * cfg.payload_bytes());
    for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
        std::vector<float> w = {0.5f, 0.5f, 1.0f, bad};
        Status s = b.dispatch_send({2, x, {}, idx, w});
        EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
        EXPECT_NE(s.message().find(fmt::format("dispatch_send: weights[1, 1] is {}", bad)),
                  std::string::npos)
            << s.message();
    }
    std::vector<float> w = {0.5f, 0.5f, 1.0f, 0.0f};
    ASSERT_TRUE(b.dispatch_send({2, x, {}, idx, w}).ok());
    std::vector<float> nan_w = {std::nanf(""), 0.5f, 1.0f, 0.0f};
    Status s = b.set_combine_weights(nan_w);
    EXPECT_NE(s.message().find("set_combine_weights: weights[0, 0] is nan"), std::string::npos)
        << s.message();
    EXPECT_TRUE(b.set_combine_weights(w).ok());
}

TEST(MoeReference, CallsOutOfOrderAreRefusedWithTheExpectedOrder) {
    AllToAllConfig cfg = config_of({.name = "", .world = 1, .num_experts = 4, .topk = 2});
    auto world = LocalWorld::create(cfg, std::chrono::seconds(5));
    ASSERT_TRUE(world.ok());
    CpuBackend& b = (*world)->rank(0);
    std::vector<uint16_t> none;
    Status s = b.combine_send(none);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("dispatch_send, dispatch_recv, combine_send, combine_recv"),
              std::string::npos)
        << s.message();
    // A bad input is refused without breaking the object.
    std::vector<int32_t> idx = {7, 0};
    std::vector<float> w = {0.5f, 0.5f};
    std::vector<uint8_t> x(cfg.payload_bytes());
    DispatchInput in{1, x, {}, idx, w};
    s = b.dispatch_send(in);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    idx = {3, 0};
    in.indices = idx;
    EXPECT_TRUE(b.dispatch_send(in).ok());
}

TEST(MoeReference, AMissingPeerTimesOutNamingWhatItWaitedFor) {
    AllToAllConfig cfg = config_of({.name = "", .world = 2, .num_experts = 4, .topk = 2});
    auto world = LocalWorld::create(cfg, std::chrono::milliseconds(200));
    ASSERT_TRUE(world.ok());
    std::vector<int32_t> idx = {0, 3};
    std::vector<float> w = {0.5f, 0.5f};
    std::vector<uint8_t> x(cfg.payload_bytes());
    // Only rank 0 calls; rank 1 never sends its counts.
    Status s = (*world)->rank(0).dispatch_send(DispatchInput{1, x, {}, idx, w});
    EXPECT_EQ(s.code(), StatusCode::kTimeout);
    EXPECT_NE(s.message().find("rank 0 waiting for 1 counts arrival(s) from rank 1"),
              std::string::npos)
        << s.message();
    // The object is now unusable, and says why.
    s = (*world)->rank(0).dispatch_send(DispatchInput{1, x, {}, idx, w});
    EXPECT_NE(s.message().find("recreate"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace ferry::moe

#include "serve/engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <numeric>
#include <thread>

#include "serve/inprocess_kv_link.h"

namespace ferry::serve {
namespace {

CostModel tiny_cost() { return CostModel::create(tiny_test_model(), h200(), 1).value(); }

std::unique_ptr<Engine> make_engine(EngineConfig cfg, CostModel cost = tiny_cost()) {
    auto e = Engine::create(std::move(cfg), std::move(cost));
    EXPECT_TRUE(e.ok()) << e.status().to_string();
    return std::move(e).value();
}

std::vector<int32_t> prompt_of(size_t n, int32_t seed) {
    std::vector<int32_t> p(n);
    for (size_t i = 0; i < n; ++i) p[i] = int32_t((seed * 131 + i * 7) % 1000);
    return p;
}

struct Collected {
    std::vector<int32_t> tokens;
    std::vector<TimePoint> at;
    Status status;
};

Collected collect(RequestHandle& h, Duration budget = seconds(10)) {
    Collected c;
    TimePoint deadline = Clock::now() + budget;
    while (true) {
        auto e = h.next(deadline);
        if (!e.ok()) {
            c.status = e.status();
            return c;
        }
        if (e->finished) {
            c.status = h.status();
            return c;
        }
        c.tokens.push_back(e->token);
        c.at.push_back(Clock::now());
    }
}

// Waits until `pred` holds, for at most `budget`.
template <typename F>
bool eventually(F pred, Duration budget = seconds(5)) {
    TimePoint deadline = Clock::now() + budget;
    while (Clock::now() < deadline) {
        if (pred()) return true;
        std::this_thread::sleep_for(milliseconds(2));
    }
    return pred();
}

TEST(Engine, ColocatedRequestStreamsTheTokensTheVerifierExpects) {
    auto e = make_engine({.engine_id = "e", .num_blocks = 64});
    ASSERT_TRUE(e->start().ok());
    auto prompt = prompt_of(40, 1);
    auto h = e->submit({.prompt = prompt, .max_tokens = 12});
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    Collected c = collect(**h);
    ASSERT_TRUE(c.status.ok()) << c.status.to_string();
    EXPECT_EQ(c.tokens, expected_tokens(e->kv_slice(), prompt, 12));
    EXPECT_TRUE(eventually([&] { return e->stats().blocks_free == 64; }));
    EXPECT_EQ(e->stats().generated_tokens, 12u);
}

TEST(Engine, ChunkedPrefillGivesTheSameTokensInOneStepPerChunk) {
    // Chunks of 40 end on block boundaries (32) unless they finish the prompt.
    auto e = make_engine({.engine_id = "e", .prefill_chunk_tokens = 40, .num_blocks = 64});
    ASSERT_TRUE(e->start().ok());
    for (size_t n : {1, 31, 100, 161}) {
        auto prompt = prompt_of(n, int32_t(n));
        auto h = e->submit({.prompt = prompt, .max_tokens = 5});
        ASSERT_TRUE(h.ok()) << h.status().to_string();
        Collected c = collect(**h);
        ASSERT_TRUE(c.status.ok()) << c.status.to_string();
        EXPECT_EQ(c.tokens, expected_tokens(e->kv_slice(), prompt, 5)) << n << " tokens";
    }
    // 1 + 1 + 3 (32, 32, 36) + 5 (4 x 32, 33) prefill steps: a rest that fits the budget
    // runs whole.
    EXPECT_EQ(e->stats().prefill_steps, 10u);
    EXPECT_TRUE(eventually([&] { return e->stats().blocks_free == 64; }));
}

TEST(Engine, RejectsRequestsBeyondItsLimitsWithAClearMessage) {
    auto e = make_engine({.engine_id = "e", .max_model_len = 100, .num_blocks = 64});
    ASSERT_TRUE(e->start().ok());
    auto too_long = e->submit({.prompt = prompt_of(90, 1), .max_tokens = 20});
    ASSERT_FALSE(too_long.ok());
    EXPECT_EQ(too_long.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(too_long.status().message().find("exceeds max_model_len 100"), std::string::npos);
    auto bad_token = e->submit({.prompt = {1, 2, 5000}, .max_tokens = 2});
    ASSERT_FALSE(bad_token.ok());
    EXPECT_NE(bad_token.status().message().find("outside the vocabulary"), std::string::npos);
    EXPECT_FALSE(e->submit({.prompt = {}, .max_tokens = 2}).ok());
    // No connector attached: a disaggregated leg is refused up front, not left hanging.
    GenerateRequest remote{.prompt = {1, 2}, .max_tokens = 2};
    remote.kv.do_remote_prefill = true;
    remote.kv.transfer_id = "t";
    auto r = e->submit(remote);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
}

// The library speaks of its own settings: an embedder has no flags (the `ferry` command puts
// its flag names in, cli_flags_test.cc checks those).
TEST(Engine, ConfigErrorsNameTheSettingsNotTheCommandsFlags) {
    struct Case {
        EngineConfig config;
        std::string says;
    };
    std::vector<Case> cases = {
        {{.engine_id = "e", .max_num_seqs = 0}, "max_num_seqs must be in [1, "},
        {{.engine_id = "e", .max_model_len = 0}, "max_model_len must be at least 1"},
        {{.engine_id = "e", .max_num_batched_tokens = 0},
         "max_num_batched_tokens must be at least"},
        {{.engine_id = "e", .block_size = 0}, "block_size must be at least 1"},
        {{.engine_id = "e", .prefill_chunk_tokens = 8, .block_size = 16},
         "prefill_chunk_tokens 8 is below block_size 16"},
        {{.engine_id = "e", .num_blocks = 0}, "num_blocks 0 is outside [1, 2^32)"},
        {{.engine_id = ""}, "engine_id must not be empty"},
        // 0 failed every decode leg as it arrived.
        {{.engine_id = "e", .kv_wait_timeout = Duration::zero()},
         "kv_wait_timeout must be positive, got 0 ms"},
    };
    for (const auto& c : cases) {
        auto e = Engine::create(c.config, tiny_cost());
        ASSERT_FALSE(e.ok()) << c.says;
        EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
        EXPECT_NE(e.status().message().find(c.says), std::string::npos) << e.status().to_string();
        EXPECT_EQ(e.status().message().find("--"), std::string::npos) << e.status().to_string();
    }
}

TEST(Engine, ContinuousBatchingRunsUpToMaxNumSeqsTogether) {
    // Each request takes ~20 decode steps; with room for all four they overlap in time, with
    // max_num_seqs 1 they run one after the other.
    auto run = [](size_t max_seqs) {
        auto e = make_engine({.engine_id = "e", .max_num_seqs = max_seqs, .num_blocks = 256});
        EXPECT_TRUE(e->start().ok());
        std::vector<std::shared_ptr<RequestHandle>> hs;
        for (int i = 0; i < 4; ++i)
            hs.push_back(e->submit({.prompt = prompt_of(16, i), .max_tokens = 20}).value());
        for (auto& h : hs) EXPECT_TRUE(collect(*h).status.ok());
        // Did the second request start before the first one ended?
        return hs[1]->timing().first_token < hs[0]->timing().finished;
    };
    EXPECT_TRUE(run(4));
    EXPECT_FALSE(run(1));
}

// Requests that arrive together are admitted together, up to max_num_seqs, and share one
// prefill step. Before, a round counted the prompts it admitted twice against max_num_seqs:
// with one request decoding and room for four, two of three arrivals were admitted and the
// third waited a whole prefill step.
TEST(Engine, ArrivalsFillTheBatchUpToMaxNumSeqsInOneRound) {
    // Steps of ~0.3 s, so the three arrive while one decode step of the first runs.
    auto e =
        make_engine({.engine_id = "e", .max_num_seqs = 4, .num_blocks = 64, .time_scale = 1000});
    ASSERT_TRUE(e->start().ok());
    auto first = e->submit({.prompt = prompt_of(16, 9), .max_tokens = 30}).value();
    ASSERT_TRUE(first->next(Clock::now() + seconds(10)).ok());
    // Four arrive; the batch has room for three of them.
    std::vector<std::shared_ptr<RequestHandle>> hs;
    for (int i = 0; i < 4; ++i)
        hs.push_back(e->submit({.prompt = prompt_of(16, i), .max_tokens = 1}).value());
    for (auto& h : hs) EXPECT_TRUE(collect(*h).status.ok());
    const TimePoint together = hs[0]->timing().prefill_start;
    for (size_t i = 0; i < 3; ++i)
        EXPECT_EQ(hs[i]->timing().prefill_start, together)
            << "prefill of " << hs[i]->id() << " started "
            << to_ms(hs[i]->timing().prefill_start - together) << " ms after the first arrival's";
    EXPECT_GT(hs[3]->timing().prefill_start, together);  // max_num_seqs still holds
    first->cancel();
    EXPECT_EQ(collect(*first).status.code(), StatusCode::kCancelled);
}

TEST(Engine, SchedulerWaitsForFreeBlocksAndFinishesEveryone) {
    // 4 blocks of 16 tokens: one request of 40 + 10 tokens needs all of them.
    auto e = make_engine({.engine_id = "e", .num_blocks = 4});
    ASSERT_TRUE(e->start().ok());
    auto p1 = prompt_of(40, 1), p2 = prompt_of(40, 2);
    auto h1 = e->submit({.prompt = p1, .max_tokens = 10}).value();
    auto h2 = e->submit({.prompt = p2, .max_tokens = 10}).value();
    Collected c1 = collect(*h1), c2 = collect(*h2);
    ASSERT_TRUE(c1.status.ok() && c2.status.ok());
    EXPECT_GT(h2->timing().first_token, h1->timing().finished);
    EXPECT_EQ(c2.tokens, expected_tokens(e->kv_slice(), p2, 10));
    EXPECT_TRUE(eventually([&] { return e->stats().blocks_free == 4; }));
}

TEST(Engine, DecodeStepsTakeTheModelledTime) {
    auto cost = CostModel::create(qwen3_32b(), h200(), 8).value();
    std::vector<int> ctx{48};
    double step = cost.decode_seconds(ctx);
    auto e = make_engine({.engine_id = "e", .num_blocks = 16}, cost);
    ASSERT_TRUE(e->start().ok());
    auto h = e->submit({.prompt = prompt_of(32, 3), .max_tokens = 30}).value();
    Collected c = collect(*h);
    ASSERT_TRUE(c.status.ok()) << c.status.to_string();
    double itl = std::chrono::duration<double>(c.at.back() - c.at[1]).count() / 28;
    EXPECT_GT(itl, 0.9 * step);
    EXPECT_LT(itl, 3.0 * step);  // sleeps overshoot on a loaded machine, never by 3x
}

TEST(Engine, CancelledRequestReturnsItsBlocks) {
    auto e = make_engine({.engine_id = "e", .num_blocks = 64});
    ASSERT_TRUE(e->start().ok());
    auto h = e->submit({.prompt = prompt_of(20, 1), .max_tokens = 1000}).value();
    ASSERT_TRUE(h->next(Clock::now() + seconds(5)).ok());
    EXPECT_LT(e->stats().blocks_free, 64u);
    h->cancel();
    Collected c = collect(*h);
    EXPECT_EQ(c.status.code(), StatusCode::kCancelled);
    EXPECT_TRUE(eventually([&] { return e->stats().blocks_free == 64; }));
}

// A request the client cancels while it waits for blocks leaves at once, and once every request
// ended the engine holds no block and counts no request in any stage.
TEST(Engine, RequestCancelledWhileWaitingForBlocksLeavesNothingBehind) {
    // Steps of ~0.3 s: the first request is still decoding when the test cancels it.
    auto e = make_engine({.engine_id = "e", .num_blocks = 4, .time_scale = 1000});
    ASSERT_TRUE(e->start().ok());
    // 20 + 40 - 1 tokens: the whole pool of 4 blocks of 16.
    auto running = e->submit({.prompt = prompt_of(20, 1), .max_tokens = 40}).value();
    ASSERT_TRUE(running->next(Clock::now() + seconds(5)).ok());
    auto queued = e->submit({.prompt = prompt_of(20, 2), .max_tokens = 2}).value();
    ASSERT_TRUE(eventually([&] { return e->stats().waiting == 1; }));
    queued->cancel();
    EXPECT_EQ(collect(*queued, seconds(5)).status.code(), StatusCode::kCancelled);
    running->cancel();
    EXPECT_EQ(collect(*running, seconds(5)).status.code(), StatusCode::kCancelled);
    EXPECT_TRUE(eventually([&] {
        EngineStats st = e->stats();
        return st.blocks_free == 4 && st.waiting == 0 && st.running == 0 &&
               st.waiting_for_kv == 0 && st.waiting_for_prefill == 0 && st.held_for_transfer == 0;
    }));
}

TEST(Engine, StopFailsRequestsInFlight) {
    auto e = make_engine({.engine_id = "e", .num_blocks = 64});
    ASSERT_TRUE(e->start().ok());
    auto h2 = e->submit({.prompt = prompt_of(20, 1), .max_tokens = 500}).value();
    e->stop();
    Collected c = collect(*h2, seconds(2));
    EXPECT_EQ(c.status.code(), StatusCode::kCancelled);
    EXPECT_NE(c.status.message().find("shutting down"), std::string::npos);
}

// ---- Disaggregated: two engines joined by the in-process link ---------------------------------

struct PD {
    std::unique_ptr<Engine> prefill, decode;
    std::unique_ptr<InProcessKvLink> link;

    PD(kv::TransferMode mode, Duration lease = seconds(10), Duration kv_wait = seconds(10),
       EngineConfig decode_config = {.engine_id = "d", .num_blocks = 64}) {
        prefill = make_engine({.engine_id = "p", .num_blocks = 64});
        decode_config.kv_wait_timeout = kv_wait;
        decode = make_engine(decode_config);
        link = std::make_unique<InProcessKvLink>(InProcessKvLinkConfig{mode, lease});
        EXPECT_TRUE(link->add_engine("p", &prefill->pool()).ok());
        EXPECT_TRUE(link->add_engine("d", &decode->pool()).ok());
        prefill->attach_connector(link->producer("p"), nullptr);
        decode->attach_connector(nullptr, link->consumer("d"));
        EXPECT_TRUE(link->start().ok());
        EXPECT_TRUE(prefill->start().ok());
        EXPECT_TRUE(decode->start().ok());
    }
    ~PD() {
        prefill->stop();
        decode->stop();
        link->stop();
    }
    GenerateRequest prefill_leg(std::vector<int32_t> prompt, std::string tid) {
        GenerateRequest r{.prompt = std::move(prompt), .max_tokens = 1};
        r.kv.do_remote_decode = true;
        r.kv.transfer_id = std::move(tid);
        return r;
    }
    GenerateRequest decode_leg(std::vector<int32_t> prompt, size_t max_tokens,
                               KvTransferParams kv) {
        GenerateRequest r{.prompt = std::move(prompt), .max_tokens = max_tokens};
        r.kv = std::move(kv);
        return r;
    }
    bool pools_full() {
        return prefill->stats().blocks_free == 64 && decode->stats().blocks_free == 64;
    }
};

KvTransferParams push_params(const std::string& tid) {
    KvTransferParams kv;
    kv.do_remote_prefill = true;
    kv.transfer_id = tid;
    kv.remote_engine_id = "p";
    return kv;
}

TEST(DisaggregatedEngines, PushDeliversVerifiedTokensInEitherArrivalOrder) {
    PD pd(kv::TransferMode::kPush);
    auto prompt = prompt_of(50, 9);
    auto expected = expected_tokens(pd.decode->kv_slice(), prompt, 8);
    for (bool decode_first : {true, false}) {
        std::string tid = decode_first ? "t-decode-first" : "t-prefill-first";
        std::shared_ptr<RequestHandle> hd, hp;
        if (decode_first) {
            hd = pd.decode->submit(pd.decode_leg(prompt, 8, push_params(tid))).value();
            ASSERT_TRUE(eventually([&] { return pd.decode->stats().blocks_used > 0; }));
        }
        hp = pd.prefill->submit(pd.prefill_leg(prompt, tid)).value();
        Collected cp = collect(*hp);
        ASSERT_TRUE(cp.status.ok()) << cp.status.to_string();
        EXPECT_EQ(cp.tokens, std::vector<int32_t>{expected[0]});
        EXPECT_TRUE(hp->kv_out().do_remote_prefill);
        if (!decode_first)
            hd = pd.decode->submit(pd.decode_leg(prompt, 8, push_params(tid))).value();
        Collected cd = collect(*hd);
        ASSERT_TRUE(cd.status.ok()) << cd.status.to_string();
        EXPECT_EQ(cd.tokens, expected);
        RequestTiming t = hd->timing();
        EXPECT_NE(t.kv_ready, TimePoint{});
        EXPECT_GE(t.first_token, t.kv_ready);
    }
    EXPECT_TRUE(eventually([&] { return pd.pools_full(); }));
    EXPECT_EQ(pd.decode->stats().kv_transfers, 2u);
    EXPECT_EQ(pd.prefill->stats().kv_transfers, 2u);
    EXPECT_EQ(pd.link->bytes_copied(), 2u * 4 * pd.prefill->pool().block_bytes());
}

TEST(DisaggregatedEngines, PullAndPullInlineDeliverVerifiedTokens) {
    for (kv::TransferMode mode : {kv::TransferMode::kPull, kv::TransferMode::kPullInline}) {
        PD pd(mode);
        auto prompt = prompt_of(33, 4);
        auto hp = pd.prefill->submit(pd.prefill_leg(prompt, "t1")).value();
        ASSERT_TRUE(collect(*hp).status.ok());
        KvTransferParams kv = hp->kv_out();
        ASSERT_EQ(kv.remote_block_ids.size(), 3u);
        EXPECT_EQ(kv.remote_engine_id, "p");
        // Prefill holds its blocks until decode has read them.
        EXPECT_EQ(pd.prefill->stats().blocks_used, 3u);
        auto hd = pd.decode->submit(pd.decode_leg(prompt, 5, kv)).value();
        Collected cd = collect(*hd);
        ASSERT_TRUE(cd.status.ok()) << cd.status.to_string();
        EXPECT_EQ(cd.tokens, expected_tokens(pd.decode->kv_slice(), prompt, 5));
        EXPECT_TRUE(eventually([&] { return pd.pools_full(); }));
    }
}

TEST(DisaggregatedEngines, FirstTokenComesWithTheKvOrAfterDecodesFirstStep) {
    // Decode steps of ~150 ms make the difference plain: the token prefill sampled streams as
    // soon as the KV is in, the other one step later; both are the tokens the KV implies.
    const auto prompt = prompt_of(40, 6);
    const double step_s = tiny_cost().decode_seconds(std::vector<int>{int(prompt.size())});
    for (auto first : {EngineConfig::FirstToken::kPrefill, EngineConfig::FirstToken::kDecode}) {
        bool from_prefill = first == EngineConfig::FirstToken::kPrefill;
        SCOPED_TRACE(from_prefill ? "first token from prefill" : "first token from decode");
        PD pd(kv::TransferMode::kPull, seconds(10), seconds(10),
              {.engine_id = "d",
               .first_token = first,
               .num_blocks = 64,
               .time_scale = 0.15 / step_s});
        auto hp = pd.prefill->submit(pd.prefill_leg(prompt, "t-first")).value();
        ASSERT_TRUE(collect(*hp).status.ok());
        auto hd = pd.decode->submit(pd.decode_leg(prompt, 3, hp->kv_out())).value();
        Collected cd = collect(*hd);
        ASSERT_TRUE(cd.status.ok()) << cd.status.to_string();
        EXPECT_EQ(cd.tokens, expected_tokens(pd.decode->kv_slice(), prompt, 3));
        RequestTiming t = hd->timing();
        double after_kv_ms = to_ms(t.first_token - t.kv_ready);
        if (from_prefill)
            EXPECT_LT(after_kv_ms, 75.0);
        else
            EXPECT_GT(after_kv_ms, 140.0);
        EXPECT_TRUE(eventually([&] { return pd.pools_full(); }));
    }
}

TEST(DisaggregatedEngines, KvCorruptedBeforeTheTransferChangesTheTokens) {
    PD pd(kv::TransferMode::kPull);
    auto prompt = prompt_of(33, 4);
    auto hp = pd.prefill->submit(pd.prefill_leg(prompt, "t1")).value();
    ASSERT_TRUE(collect(*hp).status.ok());
    KvTransferParams kv = hp->kv_out();
    pd.prefill->pool().block(kv.remote_block_ids[1])[100] ^= 0x40;
    auto hd = pd.decode->submit(pd.decode_leg(prompt, 5, kv)).value();
    Collected cd = collect(*hd);
    ASSERT_TRUE(cd.status.ok());
    EXPECT_NE(cd.tokens, expected_tokens(pd.decode->kv_slice(), prompt, 5));
}

TEST(DisaggregatedEngines, DecodeLegWhosePrefillNeverComesFailsAndFreesItsBlocks) {
    PD pd(kv::TransferMode::kPush, seconds(10), milliseconds(200));
    auto hd = pd.decode->submit(pd.decode_leg(prompt_of(20, 1), 4, push_params("lost"))).value();
    Collected cd = collect(*hd, seconds(5));
    EXPECT_EQ(cd.status.code(), StatusCode::kTimeout);
    EXPECT_NE(cd.status.message().find("did not arrive within 200 ms"), std::string::npos);
    EXPECT_TRUE(eventually([&] { return pd.pools_full(); }));
    EXPECT_EQ(pd.decode->stats().requests_failed, 1u);
}

TEST(DisaggregatedEngines, AbortedTransferEndsItsDecodeLegEvenWhenTheAbortComesFirst) {
    PD pd(kv::TransferMode::kPush);
    auto waiting = pd.decode->submit(pd.decode_leg(prompt_of(20, 1), 4, push_params("a1"))).value();
    ASSERT_TRUE(eventually([&] { return pd.decode->stats().blocks_used > 0; }));
    ASSERT_TRUE(pd.decode->abort_transfer("a1", "prefill leg failed").ok());
    Collected c = collect(*waiting, seconds(2));
    EXPECT_EQ(c.status.code(), StatusCode::kCancelled);
    EXPECT_NE(c.status.message().find("prefill leg failed"), std::string::npos);
    // The abort overtook this one.
    ASSERT_TRUE(pd.decode->abort_transfer("a2", "prefill leg failed").ok());
    auto late = pd.decode->submit(pd.decode_leg(prompt_of(20, 1), 4, push_params("a2"))).value();
    EXPECT_EQ(collect(*late, seconds(2)).status.code(), StatusCode::kCancelled);
    EXPECT_TRUE(eventually([&] { return pd.pools_full(); }));
}

TEST(DisaggregatedEngines, PrefillLegNobodyCollectsIsReleasedAfterTheLease) {
    PD pd(kv::TransferMode::kPush, milliseconds(200));
    auto hp = pd.prefill->submit(pd.prefill_leg(prompt_of(20, 1), "orphan")).value();
    ASSERT_TRUE(collect(*hp).status.ok());
    EXPECT_GT(pd.prefill->stats().blocks_used, 0u);
    EXPECT_TRUE(eventually([&] { return pd.pools_full(); }));
    EXPECT_EQ(pd.prefill->stats().kv_transfer_failures, 1u);
    EXPECT_NE(pd.prefill->prometheus_text().find("ferry_kv_transfer_failures_total 1"),
              std::string::npos);
}

// The router aborts a prefill leg whose decode leg failed: its blocks, held for decode (push:
// waiting for a registration; pull: offered under the lease), come back at once, not after
// the 10 s lease. An abort of an unknown or finished transfer changes nothing.
TEST(DisaggregatedEngines, AbortFreesAHandedOverPrefillLegAtOnceInPushAndPull) {
    for (kv::TransferMode mode : {kv::TransferMode::kPush, kv::TransferMode::kPull}) {
        SCOPED_TRACE(mode == kv::TransferMode::kPush ? "push" : "pull");
        PD pd(mode, seconds(10));
        auto hp = pd.prefill->submit(pd.prefill_leg(prompt_of(40, 1), "held")).value();
        ASSERT_TRUE(collect(*hp).status.ok());
        ASSERT_GT(pd.prefill->stats().blocks_used, 0u);
        ASSERT_TRUE(eventually([&] { return pd.prefill->stats().held_for_transfer == 1; }));
        ASSERT_TRUE(pd.prefill->abort_transfer("unknown", "nothing to abort").ok());
        std::this_thread::sleep_for(milliseconds(50));
        EXPECT_GT(pd.prefill->stats().blocks_used, 0u);
        ASSERT_TRUE(pd.prefill->abort_transfer("held", "decode leg failed").ok());
        EXPECT_TRUE(eventually([&] { return pd.pools_full(); }, milliseconds(500)));
        EXPECT_TRUE(eventually([&] { return pd.prefill->stats().held_for_transfer == 0; }));
        // Twice, and after the end: harmless.
        ASSERT_TRUE(pd.prefill->abort_transfer("held", "again").ok());
        auto next = pd.prefill->submit(pd.prefill_leg(prompt_of(40, 2), "next")).value();
        EXPECT_TRUE(collect(*next).status.ok());
        ASSERT_TRUE(pd.prefill->abort_transfer("next", "done with it").ok());
        EXPECT_TRUE(eventually([&] { return pd.pools_full(); }, milliseconds(500)));
    }
}

// A pull prefill leg sent without a transfer id is known by the id its answer gives out (the
// request id, which the decode leg then carries): an abort naming that id frees its blocks at
// once. Before, the connector knew the leg by the request id but the engine matched aborts by
// the empty transfer_id, and the blocks stayed for the whole lease.
TEST(DisaggregatedEngines, APullLegSentWithoutATransferIdIsAbortedByTheIdItsAnswerGave) {
    PD pd(kv::TransferMode::kPull, seconds(10));
    auto hp = pd.prefill->submit(pd.prefill_leg(prompt_of(40, 1), "")).value();
    ASSERT_TRUE(collect(*hp).status.ok());
    const std::string id = hp->kv_out().transfer_id;
    ASSERT_FALSE(id.empty());
    ASSERT_TRUE(eventually([&] { return pd.prefill->stats().held_for_transfer == 1; }));
    ASSERT_TRUE(pd.prefill->abort_transfer(id, "decode leg failed").ok());
    EXPECT_TRUE(eventually([&] { return pd.pools_full(); }, milliseconds(500)));
    EXPECT_TRUE(eventually([&] { return pd.prefill->stats().held_for_transfer == 0; }));
}

// A decode leg aborted while it decodes frees its blocks (waiting for KV: see
// AbortedTransferEndsItsDecodeLegEvenWhenTheAbortComesFirst).
TEST(DisaggregatedEngines, AbortEndsADecodingLegAndFreesItsBlocks) {
    // Decode steps of about 5 ms, so that the abort lands mid-stream.
    std::vector<int> one_seq = {64};
    EngineConfig dc{.engine_id = "d", .num_blocks = 64};
    dc.time_scale = 0.005 / tiny_cost().decode_seconds(one_seq);
    PD pd(kv::TransferMode::kPull, seconds(10), seconds(10), dc);
    auto hp = pd.prefill->submit(pd.prefill_leg(prompt_of(40, 3), "run")).value();
    ASSERT_TRUE(collect(*hp).status.ok());
    auto running = pd.decode->submit(pd.decode_leg(prompt_of(40, 3), 500, hp->kv_out())).value();
    ASSERT_TRUE(running->next(Clock::now() + seconds(5)).ok());
    ASSERT_TRUE(pd.decode->abort_transfer("run", "client gone").ok());
    Collected c = collect(*running, seconds(2));
    EXPECT_EQ(c.status.code(), StatusCode::kCancelled);
    EXPECT_LT(c.tokens.size(), 500u);
    EXPECT_TRUE(eventually([&] { return pd.pools_full(); }, seconds(2)));
}

TEST(DisaggregatedEngines, PullWithUnknownBlocksIsRefusedCleanly) {
    PD pd(kv::TransferMode::kPull);
    KvTransferParams kv = push_params("never-prefilled");
    kv.remote_block_ids = {1, 2};
    auto hd = pd.decode->submit(pd.decode_leg(prompt_of(20, 1), 4, kv)).value();
    Collected cd = collect(*hd);
    EXPECT_EQ(cd.status.code(), StatusCode::kNotFound);
    EXPECT_NE(cd.status.message().find("holds no KV"), std::string::npos);
    EXPECT_TRUE(eventually([&] { return pd.pools_full(); }));
}

// A model of 8 layers whose prefill step for the last chunk of a 100-token prompt (chunks of
// 64) lasts about `step`.
struct LayeredSetup {
    CostModel cost;
    double time_scale = 1;
    static constexpr size_t kPrompt = 100, kChunk = 64;
    explicit LayeredSetup(Duration step)
        : cost([] {
              ModelShape m = tiny_test_model();
              m.layers = 8;
              return CostModel::create(m, h200(), 1).value();
          }()) {
        std::vector<PrefillChunk> last = {
            {.tokens = int(kPrompt - kChunk), .context = int(kChunk), .last = true}};
        time_scale = std::chrono::duration<double>(step).count() / cost.prefill_seconds(last);
    }
};

// Records what a prefill engine hands to its connector, and when.
struct RecordingProducer : KvProducer {
    size_t limit = SIZE_MAX;
    size_t max_progress_handovers() const override { return limit; }
    std::mutex mu;
    std::vector<std::pair<kv::KvFrontier, TimePoint>> progress;
    TimePoint done_at{};
    void on_prefill_progress(const std::string&, const KvTransferParams&,
                             const std::vector<BlockId>&, const kv::KvFrontier& ready) override {
        std::lock_guard lock(mu);
        progress.emplace_back(ready, Clock::now());
    }
    Result<KvTransferParams> on_prefill_done(const std::string&, const KvTransferParams&,
                                             std::vector<BlockId>, size_t,
                                             KvDoneCallback release) override {
        {
            std::lock_guard lock(mu);
            done_at = Clock::now();
        }
        release(ok_status());
        return KvTransferParams{};
    }
};

using HandOver = std::tuple<size_t, size_t, int>;  // KvFrontier's tokens, partial_end, layers

// Runs one push prefill leg of `prompt_len` tokens (chunks of 64, 4 layer groups) and returns
// what the engine handed to `producer`, in order.
std::vector<HandOver> push_prefill(RecordingProducer& producer, const LayeredSetup& setup,
                                   size_t prompt_len, const std::string& tid) {
    auto e = make_engine({.engine_id = "p",
                          .prefill_chunk_tokens = LayeredSetup::kChunk,
                          .push_layer_groups = 4,
                          .num_blocks = 64,
                          .time_scale = setup.time_scale},
                         setup.cost);
    e->attach_connector(&producer, nullptr);
    EXPECT_TRUE(e->start().ok());
    GenerateRequest r{.prompt = prompt_of(prompt_len, 3), .max_tokens = 1};
    r.kv.do_remote_decode = true;
    r.kv.transfer_id = tid;
    auto h = e->submit(r).value();
    Collected c = collect(*h);
    EXPECT_TRUE(c.status.ok()) << c.status.to_string();
    e->stop();
    std::lock_guard lock(producer.mu);
    std::vector<HandOver> got;
    for (auto& [ready, at] : producer.progress)
        got.emplace_back(ready.tokens, ready.partial_end, int(ready.partial_layers));
    return got;
}

TEST(Engine, PushLegsChunksAreHandedOverLayerGroupByGroupWhileTheirStepsRun) {
    LayeredSetup setup(milliseconds(80));
    RecordingProducer producer;
    auto got = push_prefill(producer, setup, LayeredSetup::kPrompt, "t-layered");
    // Each chunk's first 3, 6 and 7 of 8 layers as its step runs (groups of 3, 3, 1, 1), the
    // first chunk whole at its end; the last chunk's last layer goes with on_prefill_done.
    std::vector<HandOver> want = {{0, 64, 3},   {0, 64, 6},   {0, 64, 7},  {64, 0, 0},
                                  {64, 100, 3}, {64, 100, 6}, {64, 100, 7}};
    ASSERT_EQ(got, want);
    // The last chunk's first group left about five eighths of the 80 ms step before the step
    // ended.
    std::lock_guard lock(producer.mu);
    double ahead_ms = to_ms(producer.done_at - producer.progress[4].second);
    EXPECT_GT(ahead_ms, 40.0);
}

TEST(Engine, LayerGroupsShrinkTowardsTheEndAndCoverEveryLayerOnce) {
    auto sizes = [](int groups, int layers) {
        std::vector<int> out;
        for (int g = 0; g < groups; ++g)
            out.push_back(layer_group_end(g + 1, groups, layers) -
                          layer_group_end(g, groups, layers));
        return out;
    };
    EXPECT_EQ(sizes(8, 64), (std::vector<int>{15, 13, 11, 9, 7, 5, 3, 1}));
    EXPECT_EQ(sizes(1, 64), (std::vector<int>{64}));
    EXPECT_EQ(sizes(4, 4), (std::vector<int>{1, 1, 1, 1}));
    for (int layers : {1, 2, 7, 8, 61, 64, 80}) {
        for (int groups = 1; groups <= layers; ++groups) {
            auto s = sizes(groups, layers);
            EXPECT_EQ(std::accumulate(s.begin(), s.end(), 0), layers) << groups << "/" << layers;
            for (size_t g = 0; g < s.size(); ++g) {
                EXPECT_GE(s[g], 1) << g << " of " << groups << "/" << layers;
                if (g > 0) {
                    EXPECT_LE(s[g], s[g - 1] + 1) << g << " of " << groups << "/" << layers;
                }
            }
        }
    }
}

TEST(Engine, PushHandOversStayWithinTheConnectorsLimitAndTheLastChunkGetsEveryGroup) {
    LayeredSetup setup(milliseconds(10));
    RecordingProducer producer;
    producer.limit = 8;
    // 300 tokens: four chunks of 64, then 44.
    auto got = push_prefill(producer, setup, 300, "t-limited");
    // The first chunk gets the two hand-overs the limit leaves after reserving one per later
    // chunk and three for the last; every earlier chunk ends with one.
    std::vector<HandOver> want = {{0, 64, 6},  {64, 0, 0},    {128, 0, 0},   {192, 0, 0},
                                  {256, 0, 0}, {256, 300, 3}, {256, 300, 6}, {256, 300, 7}};
    EXPECT_EQ(got, want);
    EXPECT_LE(got.size(), producer.limit);
}

// Writes a prompt's KV into a decode engine's blocks as a layer-wise push would: the first
// chunk whole, then the last chunk in layer groups, reporting each before the next lands.
struct LayeredConsumer : KvConsumer {
    Engine* engine = nullptr;
    std::vector<int32_t> prompt;
    std::thread writer;
    std::atomic<int64_t> arrived_ns{0};  // when `arrived` was called, steady clock
    ~LayeredConsumer() override {
        if (writer.joinable()) writer.join();
    }
    Status on_blocks_allocated(const std::string&, const KvTransferParams&,
                               std::vector<BlockId> blocks, size_t, KvDoneCallback arrived,
                               KvProgressCallback progress) override {
        writer = std::thread([this, blocks, arrived, progress] {
            const KvSlice slice = engine->kv_slice();
            const size_t chunk = LayeredSetup::kChunk, n = prompt.size();
            Status st =
                write_prompt_kv_range(engine->pool(), blocks, slice, prompt, 0, chunk).status();
            progress(kv::KvFrontier{uint32_t(chunk)});
            for (int l = 0; st.ok() && l < int(slice.layout.num_layers); l += 2) {
                std::this_thread::sleep_for(milliseconds(5));
                st = write_prompt_kv_range(engine->pool(), blocks, slice, prompt, chunk, n,
                                           {l, l + 2})
                         .status();
                if (l + 2 < int(slice.layout.num_layers))
                    progress(kv::KvFrontier{uint32_t(chunk), uint32_t(n), uint32_t(l + 2)});
            }
            arrived_ns = Clock::now().time_since_epoch().count();
            arrived(st);
        });
        return ok_status();
    }
    void cancel(const std::string&) override {}
};

// A decode engine fed by a LayeredConsumer.
struct LayeredDecode {
    LayeredConsumer consumer;
    std::unique_ptr<Engine> engine;
    LayeredDecode(const CostModel& cost, double time_scale, int32_t seed) {
        engine = make_engine({.engine_id = "d", .num_blocks = 64, .time_scale = time_scale}, cost);
        consumer.engine = engine.get();
        consumer.prompt = prompt_of(LayeredSetup::kPrompt, seed);
        engine->attach_connector(nullptr, &consumer);
        EXPECT_TRUE(engine->start().ok());
    }
    std::shared_ptr<RequestHandle> submit_leg(size_t max_tokens) {
        GenerateRequest r{.prompt = consumer.prompt, .max_tokens = max_tokens};
        r.kv.do_remote_prefill = true;
        r.kv.transfer_id = "t-layered";
        return engine->submit(r).value();
    }
};

TEST(Engine, DecodeDigestsALastChunkPushedLayerByLayerIntoTheVerifiedTokens) {
    LayeredSetup setup(milliseconds(10));
    LayeredDecode d(setup.cost, 1.0, 4);
    Collected c = collect(*d.submit_leg(6));
    ASSERT_TRUE(c.status.ok()) << c.status.to_string();
    EXPECT_EQ(c.tokens, expected_tokens(d.engine->kv_slice(), d.consumer.prompt, 6));
    EXPECT_TRUE(eventually([&] { return d.engine->stats().blocks_free == 64; }));
}

// KV that lands while the engine runs a decode step for others is taken (and digested) then,
// not at the step's end: ferry_timing's kv_ready is when it came.
TEST(Engine, DecodeLegsKvIsTakenWhileADecodeStepForOthersRuns) {
    LayeredSetup setup(milliseconds(10));
    std::vector<int> one_seq = {200};
    double scale = 0.15 / setup.cost.decode_seconds(one_seq);  // decode steps of ~150 ms
    LayeredDecode d(setup.cost, scale, 5);
    // A local request keeps the engine in decode steps.
    auto busy = d.engine->submit({.prompt = prompt_of(40, 6), .max_tokens = 8}).value();
    ASSERT_TRUE(eventually([&] { return d.engine->stats().decode_steps > 0; }));
    auto h = d.submit_leg(2);
    Collected c = collect(*h);
    ASSERT_TRUE(c.status.ok()) << c.status.to_string();
    EXPECT_EQ(c.tokens, expected_tokens(d.engine->kv_slice(), d.consumer.prompt, 2));
    TimePoint arrived{Duration(d.consumer.arrived_ns.load())};
    // The writes take ~20 ms from the leg's admission at a step boundary: at the step's end
    // the arrival would be taken ~130 ms late.
    EXPECT_LT(to_ms(h->timing().kv_ready - arrived), 50.0);
    collect(*busy);
}

TEST(Engine, MetricsTextHasTheSeriesOperatorsLookFor) {
    auto e = make_engine({.engine_id = "e", .num_blocks = 64});
    ASSERT_TRUE(e->start().ok());
    auto h = e->submit({.prompt = prompt_of(20, 1), .max_tokens = 3}).value();
    ASSERT_TRUE(collect(*h).status.ok());
    ASSERT_TRUE(eventually([&] { return e->stats().blocks_free == 64; }));
    std::string m = e->prometheus_text();
    for (const char* s : {"ferry_requests_total 1", "ferry_kv_blocks_free 64",
                          "ferry_kv_blocks_used 0", "ferry_generation_tokens_total 3",
                          "ferry_kv_transfer_latency_seconds_bucket{le=\"+Inf\"} 0",
                          "# TYPE ferry_kv_transfer_latency_seconds histogram"})
        EXPECT_NE(m.find(s), std::string::npos) << s << "\n" << m;
}

}  // namespace
}  // namespace ferry::serve

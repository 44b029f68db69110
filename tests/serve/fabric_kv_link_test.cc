#include "serve/fabric_kv_link.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "serve/cost_model.h"
#include "serve/kv_params_auth.h"

namespace ferry::serve {
namespace {

// One link over the shm provider with no peer: what it accepts and refuses is decided before
// anything goes on the wire.
struct LinkFixture {
    Secret secret = Secret::generate().value();
    std::unique_ptr<KvPool> pool;
    std::unique_ptr<FabricKvLink> link;

    explicit LinkFixture(std::function<uint64_t(std::string_view)> hash) {
        auto cost = CostModel::create(tiny_test_model(), h200(), 1).value();
        pool = std::move(KvPool::create(cost.kv_layout(16, 64)).value());
        FabricKvLinkConfig cfg;
        cfg.engine_id = "prefill-0";
        cfg.secret = secret;
        cfg.transfer_hash = std::move(hash);
        auto l = FabricKvLink::create(cfg, pool.get());
        EXPECT_TRUE(l.ok()) << l.status().to_string();
        if (l.ok()) link = std::move(l).value();
        if (link) link->set_http_address("127.0.0.1", 1);
    }

    KvTransferParams prefill_leg(const std::string& transfer_id) const {
        KvTransferParams kv;
        kv.do_remote_decode = true;
        kv.transfer_id = transfer_id;
        sign_kv_params(secret, &kv, {}, unix_ms_now() + 30'000);
        return kv;
    }
    KvTransferParams decode_leg(const std::string& transfer_id) const {
        KvTransferParams kv;
        kv.do_remote_prefill = true;
        kv.transfer_id = transfer_id;
        kv.remote_host = "127.0.0.1";
        kv.remote_port = 1;
        sign_kv_params(secret, &kv, {}, unix_ms_now() + 30'000);
        return kv;
    }
};

struct Calls {
    std::atomic<int> n{0};
    std::atomic<int> last_code{-1};
    KvDoneCallback callback() {
        return [this](Status s) {
            last_code = int(s.code());
            n++;
        };
    }
};

// A link whose engine lost its rail (the watchdog found the worker spinning inside one
// provider call; here held there by the test hook) is not ready, for good, and says to restart:
// the engine's /health turns 503 "failed" and the router stops sending it legs.
TEST(FabricKvLink, ALinkWhoseEngineLostItsRailIsNotReadyAndSaysRestart) {
    LinkFixture f(nullptr);
    ASSERT_TRUE(f.link);
    ASSERT_TRUE(f.link->ready().ok()) << f.link->ready().to_string();
    ASSERT_TRUE(
        detail::wedge_rail_for_test(f.link->transfer_engine(), 0, std::chrono::seconds(30)).ok());
    Status r = f.link->ready();
    EXPECT_EQ(r.code(), StatusCode::kProvider) << r.to_string();
    EXPECT_NE(r.message().find("lost a rail"), std::string::npos) << r.message();
    EXPECT_NE(r.message().find("restart this engine"), std::string::npos) << r.message();
    f.link->stop();
}

TEST(FabricKvLink, ASecondTransferIdOnAKeyInUseIsRefusedNotMixedIn) {
    // Every id hashes to the same key: the worst case of the 64-bit hash, forced.
    LinkFixture f([](std::string_view) { return uint64_t{7}; });
    ASSERT_TRUE(f.link);
    Calls first, second, decode;
    auto out =
        f.link->on_prefill_done("nonce-1", f.prefill_leg("nonce-1"), {0, 1}, 20, first.callback());
    ASSERT_TRUE(out.ok()) << out.status().to_string();
    EXPECT_EQ(f.link->stats().active, 1u);

    auto refused =
        f.link->on_prefill_done("nonce-2", f.prefill_leg("nonce-2"), {2, 3}, 20, second.callback());
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("nonce-2"), std::string::npos);
    EXPECT_NE(refused.status().message().find("nonce-1"), std::string::npos);
    EXPECT_NE(refused.status().message().find("another transfer id"), std::string::npos);

    // A decode leg of yet another id on the same key: refused before anything is queued.
    Status st =
        f.link->await_prefill_scheduled("nonce-3", f.decode_leg("nonce-3"), decode.callback());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("nonce-1"), std::string::npos);

    // An abort naming the refused id must not touch the transfer that holds the key.
    f.link->on_transfer_aborted("nonce-2", f.prefill_leg("nonce-2"), cancelled("client left"));
    EXPECT_EQ(f.link->stats().active, 1u);
    EXPECT_EQ(first.n.load(), 0);

    f.link->stop();
    EXPECT_EQ(first.n.load(), 1);  // released exactly once, by the stop
    EXPECT_EQ(first.last_code.load(), int(StatusCode::kCancelled));
    EXPECT_EQ(second.n.load(), 0);  // refused: the engine frees those blocks itself
    EXPECT_EQ(decode.n.load(), 0);
    EXPECT_EQ(f.link->stats().active, 0u);
}

TEST(FabricKvLink, AKeyIsFreeAgainOnceItsTransferReleasedTheBlocks) {
    LinkFixture f([](std::string_view) { return uint64_t{7}; });
    ASSERT_TRUE(f.link);
    Calls first, second;
    ASSERT_TRUE(
        f.link->on_prefill_done("nonce-1", f.prefill_leg("nonce-1"), {0}, 10, first.callback())
            .ok());
    // The router gives the transfer up: the connector lets the blocks go, and the key with them.
    f.link->on_transfer_aborted("nonce-1", f.prefill_leg("nonce-1"), cancelled("decode failed"));
    for (int i = 0; i < 200 && first.n.load() == 0; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_EQ(first.n.load(), 1);
    EXPECT_EQ(first.last_code.load(), int(StatusCode::kCancelled));
    auto out =
        f.link->on_prefill_done("nonce-2", f.prefill_leg("nonce-2"), {1}, 10, second.callback());
    EXPECT_TRUE(out.ok()) << out.status().to_string();
    f.link->stop();
    EXPECT_EQ(second.n.load(), 1);
}

TEST(FabricKvLink, DistinctTransferIdsGetDistinctKeys) {
    LinkFixture f(nullptr);  // the real key: kv::transfer_key
    ASSERT_TRUE(f.link);
    Calls calls[8];
    for (int i = 0; i < 8; ++i) {
        const std::string id = "nonce-" + std::to_string(i);
        auto out =
            f.link->on_prefill_done(id, f.prefill_leg(id), {BlockId(i)}, 10, calls[i].callback());
        EXPECT_TRUE(out.ok()) << out.status().to_string();
    }
    EXPECT_EQ(f.link->stats().active, 8u);
    f.link->stop();
    for (auto& c : calls) EXPECT_EQ(c.n.load(), 1);
}

}  // namespace
}  // namespace ferry::serve

#include "serve/kv_params_auth.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "serve/openai_api.h"

namespace ferry::serve {
namespace {

constexpr int64_t kNow = 1'800'000'000'000;  // ms since the epoch

struct Signer {
    Secret secret = Secret::generate().value();
    std::vector<int32_t> prompt{5, 6, 7, 8};

    KvTransferParams leg(const std::string& transfer_id, int64_t expires = kNow + 30'000,
                         size_t max_tokens = 4, const std::string& engine = "decode-1",
                         const std::string& incarnation = "") const {
        KvTransferParams kv;
        kv.incarnation = incarnation;
        kv.do_remote_prefill = true;
        kv.transfer_id = transfer_id;
        kv.remote_host = "127.0.0.1";
        kv.remote_port = 8100;
        sign_kv_params(secret, &kv, leg_content_digest({prompt_digest(prompt), max_tokens, engine}),
                       expires);
        return kv;
    }
    // The leg as an engine sees it: its content from the request it came with.
    KvTransferParams received(KvTransferParams kv, const std::vector<int32_t>& p,
                              size_t max_tokens = 4, const std::string& engine = "decode-1") const {
        kv.content = leg_content_digest({prompt_digest(p), max_tokens, engine});
        return kv;
    }
};

void expect_denied(const Status& st, const std::string& words) {
    EXPECT_EQ(st.code(), StatusCode::kPermissionDenied) << st.to_string();
    EXPECT_NE(st.message().find(words), std::string::npos) << st.to_string();
}

TEST(LegTagLedger, ALegIsTakenOnceAndOtherLegsStillPass) {
    Signer s;
    LegTagLedger ledger;
    KvTransferParams a = s.leg("t-1"), b = s.leg("t-2");
    EXPECT_TRUE(ledger.admit(s.secret, a, kNow).ok());
    expect_denied(ledger.admit(s.secret, a, kNow + 1), "already used");
    EXPECT_TRUE(ledger.admit(s.secret, b, kNow + 1).ok());
    expect_denied(ledger.admit(s.secret, b, kNow + 2), "already used");
}

TEST(LegTagLedger, AnExpiredLegIsRefusedAndForgottenTagsDoNotGrowTheLedger) {
    Signer s;
    LegTagLedger ledger;
    expect_denied(ledger.admit(s.secret, s.leg("t-1", kNow - 1), kNow), "expired");
    for (int i = 0; i < 100; ++i)
        ASSERT_TRUE(ledger.admit(s.secret, s.leg(fmt::format("t-{}", i), kNow + i), kNow).ok());
    EXPECT_EQ(ledger.size(), 100u);
    // Once they expired, the next admit forgets them.
    EXPECT_TRUE(ledger.admit(s.secret, s.leg("t-new", kNow + 60'000), kNow + 1'000).ok());
    EXPECT_EQ(ledger.size(), 1u);
}

TEST(LegTagLedger, ALegForAnotherPromptMaxTokensOrEngineDoesNotMatch) {
    Signer s;
    LegTagLedger ledger;
    KvTransferParams kv = s.leg("t-1");
    expect_denied(ledger.admit(s.secret, s.received(kv, {5, 6, 7, 9}), kNow), "does not match");
    expect_denied(ledger.admit(s.secret, s.received(kv, s.prompt, 400), kNow), "does not match");
    expect_denied(ledger.admit(s.secret, s.received(kv, s.prompt, 4, "decode-2"), kNow),
                  "does not match");
    KvTransferParams later = kv;
    later.expires_unix_ms += 3'600'000;  // an expiry moved later under the same tag
    expect_denied(ledger.admit(s.secret, later, kNow), "does not match");
    // None of those took the leg.
    EXPECT_TRUE(ledger.admit(s.secret, s.received(kv, s.prompt), kNow).ok());
}

TEST(LegTagLedger, AtCapacityAForgottenTagIsRefusedNotTakenAgain) {
    Signer s;
    LegTagLedger ledger(2);
    KvTransferParams first = s.leg("t-1", kNow + 10'000);
    ASSERT_TRUE(ledger.admit(s.secret, first, kNow).ok());
    ASSERT_TRUE(ledger.admit(s.secret, s.leg("t-2", kNow + 20'000), kNow).ok());
    // A third makes room by forgetting the one expiring first...
    ASSERT_TRUE(ledger.admit(s.secret, s.leg("t-3", kNow + 30'000), kNow).ok());
    EXPECT_EQ(ledger.size(), 2u);
    // ...which cannot be taken again.
    expect_denied(ledger.admit(s.secret, first, kNow), "no longer remembers");
    EXPECT_LE(ledger.size(), 2u);
}

// Issue 30: the ledger is in memory, so an engine restarted on its ports took again a leg the
// process before it had taken. Each ledger has an incarnation and takes only legs signed for it.
TEST(LegTagLedger, ALegSignedForAnotherIncarnationIsRefusedAndNotTaken) {
    Signer s;
    LegTagLedger before(LegTagLedger::kDefaultCapacity, "incarnation-a");
    LegTagLedger after(LegTagLedger::kDefaultCapacity, "incarnation-b");
    KvTransferParams kv = s.leg("t-1", kNow + 30'000, 4, "decode-1", "incarnation-a");
    EXPECT_TRUE(before.admit(s.secret, kv, kNow).ok());
    Status refused = after.admit(s.secret, kv, kNow + 1);
    expect_denied(refused, kOtherIncarnation);
    EXPECT_NE(refused.message().find("incarnation-a"), std::string::npos) << refused.to_string();
    EXPECT_NE(refused.message().find("incarnation-b"), std::string::npos) << refused.to_string();
    EXPECT_EQ(after.size(), 0u);
    // The incarnation is signed: naming the new one under the old tag does not pass.
    KvTransferParams renamed = kv;
    renamed.incarnation = "incarnation-b";
    expect_denied(after.admit(s.secret, renamed, kNow + 1), "does not match");
    // A leg signed for the new incarnation is taken, once.
    KvTransferParams fresh = s.leg("t-2", kNow + 30'000, 4, "decode-1", "incarnation-b");
    EXPECT_TRUE(after.admit(s.secret, fresh, kNow + 1).ok());
    expect_denied(after.admit(s.secret, fresh, kNow + 2), "already used");
    // Two incarnations drawn are distinct.
    EXPECT_NE(new_incarnation(), new_incarnation());
    EXPECT_EQ(new_incarnation().size(), 16u);
}

TEST(KvParamsAuth, TheRoutersJsonFormCarriesTheExpiryAndIncarnationAndVerifiesAsParsed) {
    Signer s;
    nlohmann::json kv = {{"do_remote_decode", true}, {"transfer_id", "t-1"}};
    Digest content = leg_content_digest({prompt_digest(s.prompt), 1, "prefill-1"});
    ASSERT_TRUE(sign_kv_params_json(s.secret, &kv, content, kNow + 5, "inc-1").ok());
    EXPECT_EQ(kv["ferry_expires"], kNow + 5);
    EXPECT_EQ(kv["ferry_incarnation"], "inc-1");
    KvTransferParams parsed = kv_params_from_json(kv).value();
    parsed.content = content;
    EXPECT_TRUE(verify_kv_params(s.secret, parsed).ok());
    EXPECT_EQ(kv_params_to_json(parsed)["ferry_incarnation"], "inc-1");
    parsed.incarnation = "inc-2";
    expect_denied(verify_kv_params(s.secret, parsed), "does not match");
}

// The pull offer's keys travel signed: a leg whose keys were swapped (for those of another
// offer) is refused before decode reads anything.
TEST(KvParamsAuth, ThePullOffersKeysAreSigned) {
    Signer s;
    nlohmann::json kv = {
        {"do_remote_prefill", true}, {"transfer_id", "t-1"}, {"ferry_pull_keys", "0a0b"}};
    Digest content = leg_content_digest({prompt_digest(s.prompt), 4, "decode-1"});
    ASSERT_TRUE(sign_kv_params_json(s.secret, &kv, content, kNow + 5, "inc-1").ok());
    KvTransferParams parsed = kv_params_from_json(kv).value();
    parsed.content = content;
    EXPECT_EQ(parsed.pull_keys, "0a0b");
    EXPECT_TRUE(verify_kv_params(s.secret, parsed).ok());
    EXPECT_EQ(kv_params_to_json(parsed)["ferry_pull_keys"], "0a0b");
    parsed.pull_keys = "0a0c";
    expect_denied(verify_kv_params(s.secret, parsed), "does not match");
}

}  // namespace
}  // namespace ferry::serve

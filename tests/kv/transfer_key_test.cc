#include "ferry/kv/transfer_key.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>

namespace ferry::kv {
namespace {

// Two router-style ids whose keys collide under `hash`, found by search over a bounded space.
std::pair<std::string, std::string> colliding_ids(const TransferKeys::Hash& hash) {
    std::map<uint64_t, std::string> seen;
    for (int i = 0; i < 100000; ++i) {
        std::string id = fmt::format("nonce-{}", i);
        auto [it, fresh] = seen.emplace(hash(id), id);
        if (!fresh) return {it->second, id};
    }
    ADD_FAILURE() << "no collision in 100000 ids";
    return {};
}

TEST(TransferKey, IsFnv1aOfTheIdsBytes) {
    // FNV-1a 64 of "" and "a" (reference values of the algorithm).
    EXPECT_EQ(transfer_key(""), 0xcbf29ce484222325ull);
    EXPECT_EQ(transfer_key("a"), 0xaf63dc4c8601ec8cull);
    EXPECT_NE(transfer_key("r-1"), transfer_key("r-2"));
}

TEST(TransferKeys, TheSameIdMayBeHeldTwiceAndIsFreeAfterEveryRelease) {
    TransferKeys keys;
    auto a = keys.acquire("t-1");
    auto b = keys.acquire("t-1");
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(*a, *b);
    EXPECT_EQ(*a, transfer_key("t-1"));
    EXPECT_EQ(keys.size(), 1u);
    keys.release("t-1");
    EXPECT_EQ(keys.size(), 1u);
    keys.release("t-1");
    EXPECT_EQ(keys.size(), 0u);
    keys.release("t-1");  // not held: nothing
    EXPECT_EQ(keys.size(), 0u);
}

TEST(TransferKeys, ASecondIdWithTheSameKeyIsRefusedWhileTheFirstIsInUse) {
    // A 12-bit hash: two router ids collide within a few hundred.
    TransferKeys::Hash small = [](std::string_view id) { return transfer_key(id) & 0xfff; };
    auto [first, second] = colliding_ids(small);
    ASSERT_NE(first, second);
    ASSERT_EQ(small(first), small(second));
    TransferKeys keys(small);
    ASSERT_TRUE(keys.acquire(first).ok());
    auto refused = keys.acquire(second);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find(first), std::string::npos);
    EXPECT_NE(refused.status().message().find(second), std::string::npos);
    EXPECT_FALSE(keys.key_of(second).ok());
    // Refusing held nothing, and releasing the refused id does not free the first.
    keys.release(second);
    EXPECT_EQ(keys.size(), 1u);
    EXPECT_FALSE(keys.acquire(second).ok());
    keys.release(first);
    auto later = keys.acquire(second);
    ASSERT_TRUE(later.ok());
    EXPECT_EQ(*later, small(second));
}

}  // namespace
}  // namespace ferry::kv

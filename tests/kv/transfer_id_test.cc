// Transfer ids are 64 bits (serve derives them from longer request ids), so two requests can
// meet on one id. The connector refuses a registration, announcement, pull or offer whose id a
// live transfer of another request holds, at once and with an error naming the id, and the
// live transfer completes untouched.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "kv/kv_fixture.h"

namespace ferry::kv {
namespace {

using namespace testing;

std::string expect_collision(const Status& s, uint64_t id) {
    CHILD_CHECK_MSG(s.code() == StatusCode::kAlreadyExists, "{}", s.to_string());
    CHILD_CHECK_MSG(s.message().find(fmt::format("{:x}", id)) != std::string::npos,
                    "the error does not name the id: {}", s.message());
    return "";
}

TEST(KvTransferIdTest, ACollidingIdIsRefusedAndTheLiveTransferCompletes) {
    KvLayout layout = testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 64);
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            NodeOptions opt;
            opt.provider = "shm";
            opt.lease = std::chrono::seconds(10);
            KvRank self{layout, 0, 1};
            CHILD_ASSIGN_OK(auto node,
                            make_kv_node(ex, self, opt, 7, ex.rank() == kPrefill ? 0 : kPoison));
            KvNode& n = *node;
            const uint64_t push_id = 0x5eed0001, offer_id = 0x5eed0002, ann_id = 0x5eed0003;
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(3));
            CHILD_ASSIGN_OK(auto other, n.blocks->allocate(3));
            if (ex.rank() == kPrefill) {
                // Offers: a second offer of a live id is refused; once the first ended, the id
                // is free again.
                CHILD_ASSIGN_OK(auto params, n.conn->offer_pull(offer_id, blocks, 40));
                (void)params;
                auto again = n.conn->offer_pull(offer_id, other, 40);
                CHILD_CHECK(!again.ok());
                std::string e = expect_collision(again.status(), offer_id);
                if (!e.empty()) return e;
                CHILD_CHECK_OK(n.conn->abort_send(offer_id, cancelled("test ends the offer")));
                CHILD_ASSIGN_OK(auto r, n.results.wait(true, offer_id, kWait));
                CHILD_CHECK(r.status.code() == StatusCode::kCancelled);
                CHILD_ASSIGN_OK(auto reoffer, n.conn->offer_pull(offer_id, other, 40));
                (void)reoffer;
                CHILD_CHECK_OK(n.conn->abort_send(offer_id, cancelled("test ends the offer")));
                CHILD_ASSIGN_OK(auto r2, n.results.wait(true, offer_id, kWait));
                (void)r2;
                testing::fill_request(n, push_id, blocks, 40);
            }
            CHILD_CHECK_OK(ex.barrier());
            if (ex.rank() == kDecode) {
                // Announcements: one (id, attempt) once.
                CHILD_CHECK_OK(n.conn->announce(ann_id, 0, {n.addrs[kPrefill]}));
                std::string e =
                    expect_collision(n.conn->announce(ann_id, 0, {n.addrs[kPrefill]}), ann_id);
                if (!e.empty()) return e;
                CHILD_CHECK_OK(n.conn->cancel(ann_id));
                CHILD_ASSIGN_OK(auto a, n.scheduled.wait(false, ann_id, kWait));
                CHILD_CHECK(a.status.code() == StatusCode::kCancelled);
                // Registrations: the same id and attempt for other blocks (another request
                // hashed to this id) is refused, and so is a pull of it.
                CHILD_CHECK_OK(
                    n.conn->register_push({push_id, 0, {n.addrs[kPrefill]}, blocks, 40}));
                e = expect_collision(
                    n.conn->register_push({push_id, 0, {n.addrs[kPrefill]}, other, 40}), push_id);
                if (!e.empty()) return e;
                PullParamsMsg fake;
                fake.transfer_id = push_id;
                e = expect_collision(n.conn->pull(push_id, {fake}, other, 40), push_id);
                if (!e.empty()) return e;
            }
            CHILD_CHECK_OK(ex.barrier());
            if (ex.rank() == kPrefill) {
                CHILD_CHECK_OK(n.conn->prefill_done(push_id, blocks, 40));
                CHILD_ASSIGN_OK(auto r, n.results.wait(true, push_id, kWait));
                CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
            } else {
                CHILD_ASSIGN_OK(auto r, n.results.wait(false, push_id, kWait));
                CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
                // Exactly one result: the refused registration never reported.
                CHILD_CHECK(!n.results.wait(false, push_id, std::chrono::milliseconds(200)).ok());
                std::vector<uint8_t> want(n.mem.size(), kPoison);
                testing::expect_request(self, want, push_id, blocks, 40);
                CHILD_CHECK_MSG(testing::compare_pool(n.mem, want).empty(), "{}",
                                testing::compare_pool(n.mem, want));
            }
            CHILD_CHECK_OK(n.blocks->free(blocks));
            CHILD_CHECK_OK(n.blocks->free(other));
            CHILD_CHECK_OK(ex.barrier());
            return testing::check_no_leak(n);
        },
        std::chrono::seconds(60));
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

}  // namespace
}  // namespace ferry::kv

// A pull offer's capability: only a DONE that carries it releases the offer, so
// a reader that names a transfer it was not offered (another request's id, a
// guessed id) cannot end it or free its blocks under the reader it was offered
// to.
#include <gtest/gtest.h>

#include <thread>

#include "kv/kv_fixture.h"

namespace ferry::kv {
namespace {

using namespace testing;

TEST(PullCapability, DoneWithAnotherCapabilityLeavesTheOfferToItsReader) {
    constexpr uint64_t kId = 0x5151;
    constexpr uint32_t kTokens = 40;
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            bool prefill = ex.rank() == 0;
            testing::NodeOptions opt;
            opt.provider = "shm";
            KvRank self{testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kJoint, 32), 0,
                        1};
            CHILD_ASSIGN_OK(auto node,
                            testing::make_kv_node(ex, self, opt, 7, prefill ? 0 : kPoison));
            auto& n = *node;
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(3));
            ByteWriter w;
            if (prefill) {
                testing::fill_request(n, kId, blocks, kTokens);
                CHILD_ASSIGN_OK(auto offer, n.conn->offer_pull(kId, blocks, kTokens));
                w.put_bytes(encode_message(offer));
            }
            CHILD_ASSIGN_OK(auto all, ex.allgather(w.bytes()));
            if (!prefill) {
                ByteReader rd(all[0]);
                std::vector<uint8_t> m;
                CHILD_CHECK_OK(rd.get_bytes(&m, "offer", 1 << 20));
                CHILD_ASSIGN_OK(auto msg, decode_message(m));
                PullParamsMsg real = std::get<PullParamsMsg>(msg);
                PullParamsMsg forged = real;
                forged.capability[0] ^= 1;
                CHILD_CHECK_OK(n.conn->pull(kId, {forged}, blocks, kTokens));
                CHILD_ASSIGN_OK(auto r, n.results.wait(false, kId, std::chrono::seconds(20)));
                (void)r;
            }
            CHILD_CHECK_OK(ex.barrier());  // the forged DONE has left decode
            if (prefill) {
                // Ignored: the offer is still held, nothing was released.
                TimePoint until = Clock::now() + std::chrono::seconds(3);
                while (n.conn->stats().messages_stale == 0 && Clock::now() < until)
                    std::this_thread::sleep_for(std::chrono::milliseconds(10));
                CHILD_CHECK_MSG(n.conn->stats().messages_stale >= 1, "the forged DONE not seen");
                CHILD_CHECK(n.conn->stats().active_send == 1);
                auto early = n.results.wait(true, kId, std::chrono::milliseconds(100));
                CHILD_CHECK_MSG(!early.ok(), "a DONE with a wrong capability released the offer");
            }
            CHILD_CHECK_OK(ex.barrier());
            if (!prefill) {
                ByteReader rd(all[0]);
                std::vector<uint8_t> m;
                CHILD_CHECK_OK(rd.get_bytes(&m, "offer", 1 << 20));
                CHILD_ASSIGN_OK(auto msg, decode_message(m));
                CHILD_CHECK_OK(n.conn->pull(kId, {std::get<PullParamsMsg>(msg)}, blocks, kTokens));
                CHILD_ASSIGN_OK(auto r, n.results.wait(false, kId, std::chrono::seconds(20)));
                CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
                std::vector<uint8_t> image(n.mem.size(), kPoison);
                testing::expect_request(self, image, kId, blocks, kTokens);
                std::string diff = testing::compare_pool(n.mem, image);
                CHILD_CHECK_MSG(diff.empty(), "{}", diff);
            } else {
                // Released once, by the reader it was offered to.
                CHILD_ASSIGN_OK(auto r, n.results.wait(true, kId, std::chrono::seconds(20)));
                CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
                CHILD_CHECK(n.conn->stats().active_send == 0);
            }
            CHILD_CHECK_OK(n.blocks->free(blocks));
            std::string leak = testing::check_no_leak(n);
            if (!leak.empty()) return leak;
            CHILD_CHECK_OK(ex.barrier());
            return "";
        },
        std::chrono::seconds(60));
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

}  // namespace
}  // namespace ferry::kv

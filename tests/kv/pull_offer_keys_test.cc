// A pull offer's keys end with the offer (PullKeys::kPerOffer): a reader that kept the
// parameters of an offer that ended (DONE sent, withdrawn, lease passed) and reads again gets
// a read error from the provider, never the bytes another request put in those blocks since.
// Two processes, the real TransferEngine, over tcp. Not over shm: its fast RMA path copies
// with process_vm_readv from the reader's side and checks no key (docs/PROTOCOL.md, "Offer
// keys"), so there a late read still returns the blocks' new contents.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include "ferry/common/auth.h"
#include "kv/kv_fixture.h"
#include "kv/pull_windows.h"

namespace ferry::kv {
namespace {

using namespace testing;

enum class Ending { kDone, kWithdrawn, kLease };

struct Case {
    const char* provider;
    Ending ending;
    const char* name;
};

class PullOfferKeysTest : public ::testing::TestWithParam<Case> {};

Result<PullParamsMsg> params_of(const std::vector<uint8_t>& blob) {
    ByteReader rd(blob);
    std::vector<uint8_t> m;
    FERRY_RETURN_IF_ERROR(rd.get_bytes(&m, "offer", 1 << 20));
    FERRY_ASSIGN_OR_RETURN(auto msg, decode_message(m));
    if (!std::holds_alternative<PullParamsMsg>(msg)) return invalid_argument("not PULL_PARAMS");
    return std::get<PullParamsMsg>(std::move(msg));
}

// Four layers, blocks of 16 tokens, 32 blocks: one TP rank.
KvRank small_rank() {
    return {testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kJoint, 32), 0, 1};
}

// Decode pulls `params` into `blocks` of a pool that was all poison: "" when every byte of
// request `id` landed and nothing else changed.
std::string pull_intact(testing::KvNode& n, const KvRank& self, uint64_t id,
                        const PullParamsMsg& params, const std::vector<uint32_t>& blocks,
                        uint32_t tokens) {
    CHILD_CHECK_OK(n.conn->pull(id, {params}, blocks, tokens));
    CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
    CHILD_CHECK_MSG(r.status.ok(), "the offer's pull: {}", r.status.to_string());
    std::vector<uint8_t> image(n.mem.size(), kPoison);
    testing::expect_request(self, image, id, blocks, tokens);
    std::string diff = testing::compare_pool(n.mem, image);
    CHILD_CHECK_MSG(diff.empty(), "the offer's pull: {}", diff);
    return "";
}

// After a refused read: the next offer of `blocks` (holding request `content`'s KV) is read in
// full. tcp drops the connection the refused read came on, so operations between the two fail
// until it is made again (about 0.5 s: retried here every 50 ms for up to 100 rounds; the time
// it took is printed). "" when served.
std::string pull_after_refusal(Exchange& ex, testing::KvNode& n, const KvRank& self,
                               const std::vector<uint32_t>& blocks, uint32_t tokens,
                               uint64_t content, const char* name) {
    const bool prefill = ex.rank() == 0;
    const TimePoint start = Clock::now();
    bool served = false;
    for (uint64_t round = 0; round < 100 && !served; ++round) {
        if (round > 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
        const uint64_t id = 0x0f00 + round;
        ByteWriter w2;
        if (prefill) {
            CHILD_ASSIGN_OK(auto offer, n.conn->offer_pull(id, blocks, tokens));
            w2.put_bytes(encode_message(offer));
        }
        CHILD_ASSIGN_OK(auto all2, ex.allgather(w2.bytes()));
        ByteWriter ok;
        if (!prefill) {
            CHILD_ASSIGN_OK(PullParamsMsg after, params_of(all2[0]));
            CHILD_CHECK_OK(n.conn->pull(id, {after}, blocks, tokens));
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
            std::printf("next pull after a refused read (%s), round %d, %.0f ms on: %s\n", name,
                        int(round), to_ms(Clock::now() - start), r.status.to_string().c_str());
            ok.put<uint8_t>(r.status.ok());
            if (r.status.ok()) {
                std::vector<uint8_t> want = n.mem;
                testing::expect_request(self, want, content, blocks, tokens);
                std::string diff = testing::compare_pool(n.mem, want);
                CHILD_CHECK_MSG(diff.empty(), "the next pull: {}", diff);
            }
        }
        CHILD_ASSIGN_OK(auto oks, ex.allgather(ok.bytes()));
        served = oks[1].size() == 1 && oks[1][0] == 1;
        if (prefill) {
            if (!served) (void)n.conn->abort_send(id, cancelled("decode's read failed"));
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
            CHILD_CHECK_MSG(r.status.ok() == served, "the next offer: {}", r.status.to_string());
        }
    }
    CHILD_CHECK_MSG(served, "no pull succeeded after the refused read");
    return "";
}

TEST_P(PullOfferKeysTest, ALateReadOfAnEndedOfferFailsAndGetsNoneOfTheNextRequestsBytes) {
    const Case c = GetParam();
    constexpr uint64_t kId = 0x0ffe;    // the offer whose parameters the reader keeps
    constexpr uint64_t kNext = 0x0ffd;  // the request whose KV lands in its blocks afterwards
    constexpr uint32_t kTokens = 40;    // 3 blocks of 16
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            bool prefill = ex.rank() == 0;
            testing::NodeOptions opt;
            opt.provider = c.provider;
            if (c.ending == Ending::kLease) opt.lease = std::chrono::seconds(1);
            const KvRank self = small_rank();
            CHILD_ASSIGN_OK(auto node,
                            testing::make_kv_node(ex, self, opt, 11, prefill ? 0 : kPoison));
            auto& n = *node;
            const uint64_t regions_before = n.engine->stats().regions_registered;
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(3));
            ByteWriter w;
            if (prefill) {
                testing::fill_request(n, kId, blocks, kTokens);
                CHILD_ASSIGN_OK(auto offer, n.conn->offer_pull(kId, blocks, kTokens));
                CHILD_CHECK_MSG(!offer.windows.empty(), "the offer carries no key of its own");
                CHILD_CHECK_MSG(n.engine->stats().regions_registered > regions_before,
                                "the offer registered nothing");
                w.put_bytes(encode_message(offer));
            }
            CHILD_ASSIGN_OK(auto all, ex.allgather(w.bytes()));
            CHILD_ASSIGN_OK(PullParamsMsg params, params_of(all[0]));
            if (!prefill && c.ending == Ending::kDone) {
                // The real read: it works, and its DONE ends the offer.
                std::string real = pull_intact(n, self, kId, params, blocks, kTokens);
                if (!real.empty()) return real;
            }
            if (prefill) {
                if (c.ending == Ending::kWithdrawn)
                    CHILD_CHECK_OK(n.conn->abort_send(kId, cancelled("the decode leg failed")));
                CHILD_ASSIGN_OK(auto r, n.results.wait(true, kId, kWait));
                CHILD_CHECK_MSG(r.status.ok() == (c.ending == Ending::kDone), "offer ended: {}",
                                r.status.to_string());
                // Ended: its registrations are closed, and the engine reuses the blocks for
                // another request.
                CHILD_CHECK_MSG(n.engine->stats().regions_registered == regions_before,
                                "{} of the offer's regions left open",
                                n.engine->stats().regions_registered - regions_before);
                testing::fill_request(n, kNext, blocks, kTokens);
            }
            CHILD_CHECK_OK(ex.barrier());
            if (!prefill) {
                // The reader that kept the parameters reads again, into blocks it holds free.
                CHILD_ASSIGN_OK(auto late, n.blocks->allocate(3));
                CHILD_CHECK_OK(n.conn->pull(kId, {params}, late, kTokens));
                std::vector<uint8_t> next = n.mem;
                testing::expect_request(self, next, kNext, late, kTokens);
                CHILD_ASSIGN_OK(auto r, n.results.wait(false, kId, kWait));
                bool got_next = testing::compare_pool(n.mem, next).empty();
                CHILD_CHECK_MSG(!got_next, "the late read returned the next request's KV");
                CHILD_CHECK_MSG(!r.status.ok(),
                                "a read under the parameters of an ended offer succeeded");
                CHILD_CHECK_MSG(r.status.message().find("which prefill closes when the offer "
                                                        "ends") != std::string::npos,
                                "the error does not say why: {}", r.status.to_string());
                std::printf("late read (%s): %s\n", c.name, r.status.to_string().c_str());
                CHILD_CHECK_OK(n.blocks->free(late));
            }
            CHILD_CHECK_OK(ex.barrier());
            // The refused read leaves the two engines able to transfer.
            std::string next = pull_after_refusal(ex, n, self, blocks, kTokens, kNext, c.name);
            if (!next.empty()) return next;
            CHILD_CHECK_OK(ex.barrier());
            CHILD_CHECK_OK(n.blocks->free(blocks));
            std::string leak = testing::check_no_leak(n);
            if (!leak.empty()) return leak;
            CHILD_CHECK_MSG(n.engine->stats().regions_registered == regions_before,
                            "{} regions leaked",
                            n.engine->stats().regions_registered - regions_before);
            CHILD_CHECK_OK(ex.barrier());
            return "";
        },
        std::chrono::seconds(90));
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(ProvidersAndEndings, PullOfferKeysTest,
                         ::testing::Values(Case{"tcp", Ending::kDone, "tcp_done"},
                                           Case{"tcp", Ending::kWithdrawn, "tcp_withdrawn"},
                                           Case{"tcp", Ending::kLease, "tcp_lease"}),
                         [](const auto& info) { return std::string(info.param.name); });

// The pool's own keys are in the handshake, which every decode holds. Under per-offer keys
// prefill registers its pool without peer reads: parameters built from the handshake (the pool's
// descriptor, no window) read nothing, while the offer's own deliver every byte. On shm with
// cross-memory attach the reader copies with process_vm_readv and no key is checked
// (docs/SERVING.md, "Known limits"): there the read under the pool's key still succeeds, as
// documented. Without it (FI_SHM_DISABLE_CMA=1) prefill's side checks the key.
struct PoolKeyCase {
    const char* provider;
    bool no_cma;   // FI_SHM_DISABLE_CMA=1
    bool refused;  // the provider checks the key
    const char* name;
};
class PullPoolKeyTest : public ::testing::TestWithParam<PoolKeyCase> {};

// libfabric reads FI_SHM_DISABLE_CMA once, when it loads its providers, which an earlier test
// of this process may have done: such a case runs alone in a fresh process of this binary.
std::string run_alone_with(const char* var, const char* value, Duration timeout) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    const std::string filter =
        fmt::format("--gtest_filter={}.{}", info->test_suite_name(), info->name());
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) return "fork failed";
    if (pid == 0) {
        ::setenv(var, value, 1);
        ::execl("/proc/self/exe", "kv_tests", filter.c_str(), static_cast<char*>(nullptr));
        ::_exit(127);
    }
    const TimePoint deadline = deadline_after(timeout);
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
        if (Clock::now() > deadline) {
            ::kill(pid, SIGKILL);
            ::waitpid(pid, &status, 0);
            return fmt::format("{} still running after {:.0f} s: killed", filter,
                               to_ms(timeout) / 1e3);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return WIFEXITED(status) && WEXITSTATUS(status) == 0
               ? ""
               : fmt::format("{} with {}={} failed (status {:#x})", filter, var, value, status);
}

TEST_P(PullPoolKeyTest, AReadUnderThePoolsKeyIsRefusedAndTheOffersOwnKeysDeliverEveryByte) {
    const PoolKeyCase c = GetParam();
    const char* cma = std::getenv("FI_SHM_DISABLE_CMA");
    const bool cma_off = cma && std::string(cma) == "1";
    if (std::string(c.provider) == "shm" && cma_off != c.no_cma) {
        EXPECT_EQ(
            run_alone_with("FI_SHM_DISABLE_CMA", c.no_cma ? "1" : "0", std::chrono::seconds(120)),
            "");
        return;
    }
    constexpr uint64_t kId = 0x0e01;
    constexpr uint64_t kForged = 0x0e02;  // decode's read under the pool's key
    constexpr uint32_t kTokens = 40;
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            bool prefill = ex.rank() == 0;
            testing::NodeOptions opt;
            opt.provider = c.provider;
            const KvRank self = small_rank();
            CHILD_ASSIGN_OK(auto node,
                            testing::make_kv_node(ex, self, opt, 12, prefill ? 0 : kPoison));
            auto& n = *node;
            // Peers only write into a host pool under per-offer keys (pool_remote_access).
            CHILD_CHECK_MSG(n.mr->remote_access() == RemoteAccess::kWrite,
                            "the pool is registered for peers' reads");
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(3));
            // Decode gets the pool's descriptor (what prefill's handshake carries), then the
            // offer of request kId.
            CHILD_ASSIGN_OK(auto pools, ex.allgather(prefill ? n.mr->descriptor().serialize()
                                                             : std::vector<uint8_t>{}));
            if (prefill) testing::fill_request(n, kId, blocks, kTokens);
            ByteWriter offered;
            if (prefill) {
                CHILD_ASSIGN_OK(auto offer, n.conn->offer_pull(kId, blocks, kTokens));
                offered.put_bytes(encode_message(offer));
            }
            CHILD_ASSIGN_OK(auto offers, ex.allgather(offered.bytes()));
            if (!prefill) {
                CHILD_ASSIGN_OK(PullParamsMsg params, params_of(offers[0]));
                CHILD_ASSIGN_OK(MemoryDescriptor pool_desc,
                                MemoryDescriptor::deserialize(pools[0]));
                // The offer's own keys: every byte lands, in a destination that starts poisoned.
                std::string real = pull_intact(n, self, kId, params, blocks, kTokens);
                if (!real.empty()) return real;
                // Parameters built from the handshake: the pool's descriptor, no window.
                PullParamsMsg forged = params;
                forged.transfer_id = kForged;
                forged.windows.clear();
                forged.pool = {pool_desc};
                CHILD_CHECK_OK(random_bytes(forged.capability));
                CHILD_ASSIGN_OK(auto other, n.blocks->allocate(3));
                const std::vector<uint8_t> before = n.mem;
                CHILD_CHECK_OK(n.conn->pull(kForged, {forged}, other, kTokens));
                CHILD_ASSIGN_OK(auto f, n.results.wait(false, kForged, kWait));
                std::printf("read under the pool's key (%s): %s\n", c.name,
                            f.status.to_string().c_str());
                if (c.refused) {
                    CHILD_CHECK_MSG(!f.status.ok(), "a read under the pool's key succeeded");
                    CHILD_CHECK_MSG(
                        f.status.message().find("under the pool's own keys") != std::string::npos,
                        "the error does not say why: {}", f.status.to_string());
                    CHILD_CHECK_MSG(n.mem == before, "the refused read wrote into decode's pool");
                } else {
                    CHILD_CHECK_MSG(f.status.ok(),
                                    "shm refused a read under the pool's key "
                                    "(update docs/SERVING.md): {}",
                                    f.status.to_string());
                }
                CHILD_CHECK_OK(n.blocks->free(other));
            } else {
                CHILD_ASSIGN_OK(auto r, n.results.wait(true, kId, kWait));
                CHILD_CHECK_MSG(r.status.ok(), "the offer: {}", r.status.to_string());
            }
            CHILD_CHECK_OK(ex.barrier());
            std::string next = pull_after_refusal(ex, n, self, blocks, kTokens, kId, c.name);
            if (!next.empty()) return next;
            CHILD_CHECK_OK(ex.barrier());
            CHILD_CHECK_OK(n.blocks->free(blocks));
            return testing::check_no_leak(n);
        },
        std::chrono::seconds(90));
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Providers, PullPoolKeyTest,
                         ::testing::Values(PoolKeyCase{"tcp", false, true, "tcp"},
                                           PoolKeyCase{"shm", false, false, "shm"},
                                           PoolKeyCase{"shm", true, true, "shm_no_cma"}),
                         [](const auto& info) { return std::string(info.param.name); });

// What an offer registers: every layer's K and V of its blocks, one region per contiguous
// run, never across a region boundary.
TEST(PullOfferWindows, OneExtentPerContiguousRunCutAtRegions) {
    KvLayout l = testing::test_layout(2, 16, BlockOrder::kNHD, KvPlacement::kJoint, 8);
    const uint64_t slab = l.slab_bytes();
    // Blocks 2 and 3 are adjacent (K, V of 2 then of 3), 6 stands alone; per layer.
    auto one = detail::block_extents(l, std::vector<uint32_t>{3, 6, 2});
    ASSERT_EQ(one.size(), 2 * l.num_layers);
    EXPECT_EQ(one[0], (detail::PoolExtent{0, l.slab_offset(0, KvPart::kK, 2), 4 * slab}));
    EXPECT_EQ(one[1], (detail::PoolExtent{0, l.slab_offset(0, KvPart::kK, 6), 2 * slab}));
    // Blocks 7 of layer 0 and 0 of layer 1 touch in the pool, not in per-layer regions.
    l.regions = RegionSplit::kPerLayer;
    auto split = detail::block_extents(l, std::vector<uint32_t>{0, 7});
    ASSERT_EQ(split.size(), 2 * l.num_layers);
    EXPECT_EQ(split[0], (detail::PoolExtent{0, 0, 2 * slab}));
    EXPECT_EQ(split[1], (detail::PoolExtent{0, 7 * 2 * slab, 2 * slab}));
    EXPECT_EQ(split[2], (detail::PoolExtent{1, 0, 2 * slab}));
}

// More runs than a PULL_PARAMS may carry: refused before anything is registered, naming the
// setting that avoids it.
TEST(PullOfferWindows, AnOfferNeedingTooManyRegistrationsIsRefusedNamingTheSetting) {
    KvLayout l = testing::test_layout(1, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 130);
    l.num_layers = 512;
    l.head_dim = 1;
    std::vector<uint32_t> blocks;
    for (uint32_t b = 0; b < 130; b += 2) blocks.push_back(b);  // none adjacent: 512 * 2 * 65
    auto engine = TransferEngine::create(::ferry::testing::test_engine_config("tcp"));
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    std::vector<uint8_t> mem(l.pool_bytes());
    auto mr = (*engine)->register_memory(mem.data(), mem.size());
    ASSERT_TRUE(mr.ok()) << mr.status().to_string();
    const uint64_t before = (*engine)->stats().regions_registered;
    auto w = detail::register_offer_windows(**engine, KvPoolRegions::one(mr->get()), l, blocks);
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.status().message().find("needs 66560 registrations"), std::string::npos)
        << w.status().to_string();
    EXPECT_NE(w.status().message().find("PullKeys::kPool"), std::string::npos);
    EXPECT_EQ((*engine)->stats().regions_registered, before);
}

TEST(PullOfferWindows, ARunOutsideEveryWindowIsRefusedNamingIt) {
    std::vector<PullWindow> windows(2);
    windows[0] = {0, 1000, {}};
    windows[0].desc.length = 100;
    windows[1] = {1, 0, {}};
    windows[1].desc.length = 4096;
    std::vector<ByteRun> runs = {{1010, 0, 50}, {1060, 64, 50}};
    auto ok = detail::runs_by_window(windows, 0, std::span<const ByteRun>(runs).first(1));
    ASSERT_TRUE(ok.ok()) << ok.status().to_string();
    ASSERT_EQ(ok->size(), 1u);
    EXPECT_EQ((*ok)[0].runs[0].src_offset, 10u);
    auto bad = detail::runs_by_window(windows, 0, runs);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("no window holding bytes [1060, 1110) of prefill pool "
                                          "region 0"),
              std::string::npos)
        << bad.status().to_string();
}

// The answer to a PULL_ASK in parts (PROTOCOL.md, "Pull offer keys"): the parts in any order
// give the whole list; a repeated part, another count or an out-of-order list is an error.
TEST(PullOfferWindows, AnAnswerInPartsIsCollectedAndARepeatedPartIsRefused) {
    std::vector<PullWindow> all(5);
    for (uint32_t i = 0; i < all.size(); ++i) {
        all[i] = {i / 2, (i % 2) * 4096u, {}};
        all[i].desc.length = 64;
    }
    auto part = [&](uint32_t first, uint32_t end, uint32_t total = 5) {
        PullParamsMsg m;
        m.windows_first = first;
        m.windows_total = total;
        m.windows.assign(all.begin() + first, all.begin() + end);
        return m;
    };
    detail::WindowParts parts;
    ASSERT_TRUE(detail::collect_part(parts, part(3, 5), true).ok());
    ASSERT_TRUE(detail::collect_part(parts, part(0, 3), false).ok());
    ASSERT_TRUE(parts.complete);
    ASSERT_EQ(parts.windows.size(), 5u);
    EXPECT_EQ(parts.windows[3].region, 1u);
    EXPECT_EQ(parts.windows[3].offset, 4096u);

    detail::WindowParts twice;
    ASSERT_TRUE(detail::collect_part(twice, part(0, 3), true).ok());
    Status s = detail::collect_part(twice, part(2, 4), false);
    EXPECT_NE(s.message().find("window 2 of 5 came twice"), std::string::npos) << s.to_string();
    EXPECT_FALSE(twice.complete);

    detail::WindowParts other;
    ASSERT_TRUE(detail::collect_part(other, part(0, 3), true).ok());
    s = detail::collect_part(other, part(3, 4, 4), false);
    EXPECT_NE(s.message().find("a part of 4 windows after a part of 5"), std::string::npos)
        << s.to_string();

    detail::WindowParts unordered;
    std::swap(all[1], all[4]);
    ASSERT_TRUE(detail::collect_part(unordered, part(0, 3), true).ok());
    s = detail::collect_part(unordered, part(3, 5), false);
    EXPECT_NE(s.message().find("is not after window"), std::string::npos) << s.to_string();
    EXPECT_FALSE(unordered.complete);
}

}  // namespace
}  // namespace ferry::kv

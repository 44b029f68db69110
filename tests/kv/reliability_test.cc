// What happens when a transfer does not go as planned: a registration that never comes, a
// failed prefill, cancellation (with and without writes in flight), re-registration with a
// newer attempt, a killed peer, malformed messages. Each between real processes, on tcp and
// shm, with block accounting checked at the end.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstring>
#include <thread>
#include <utility>

#include "kv/kv_fixture.h"

namespace ferry::kv {
namespace {

using namespace testing;

class KvReliabilityTest : public ::testing::TestWithParam<std::string> {
  protected:
    // 1 prefill rank (process 0) and 1 decode rank (process 1) with the small test layout;
    // prefill_lease, when set, is prefill's lease (`lease` decode's).
    std::vector<::ferry::testing::ChildResult> run_1p1d(
        Duration lease, const std::function<std::string(Exchange&, KvNode&)>& body,
        KvLayout layout = testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 64),
        Duration prefill_lease = Duration::zero()) {
        std::string provider = GetParam();
        return run_processes(
            2,
            [&](Exchange& ex) -> std::string {
                NodeOptions opt;
                opt.provider = provider;
                opt.lease = ex.rank() == kPrefill && prefill_lease > Duration::zero()
                                ? prefill_lease
                                : lease;
                KvRank self{layout, 0, 1};
                CHILD_ASSIGN_OK(auto node, make_kv_node(ex, self, opt, 42,
                                                        ex.rank() == kPrefill ? 0 : kPoison));
                std::string e = body(ex, *node);
                if (!e.empty()) return e;
                return testing::check_no_leak(*node);
            },
            kRunTimeout);
    }
};

#define EXPECT_ALL_OK(results) EXPECT_EQ(::ferry::testing::describe_failures(results), "")

TEST_P(KvReliabilityTest, UnregisteredTransferIsReleasedAfterTheLease) {
    const auto lease = std::chrono::milliseconds(300);
    auto results = run_1p1d(lease, [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t id = 0x77;
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(3));
        if (ex.rank() == kPrefill) {
            testing::fill_request(n, id, blocks, 40);
            TimePoint t0 = Clock::now();
            CHILD_CHECK_OK(n.conn->prefill_done(id, blocks, 40));
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
            Duration took = Clock::now() - t0;
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kTimeout, "{}", r.status.to_string());
            CHILD_CHECK_MSG(r.status.message().find("registration") != std::string::npos, "{}",
                            r.status.message());
            CHILD_CHECK_MSG(took >= lease && took < lease + std::chrono::seconds(3),
                            "released after {:.0f} ms", to_ms(took));
            CHILD_CHECK(n.conn->stats().leases_expired == 1);
        }
        CHILD_CHECK_OK(ex.barrier());
        if (ex.rank() == kDecode) {
            // A registration after prefill gave up finds nothing to wait for and ends in an
            // error, not a hang; the blocks come back.
            CHILD_CHECK_OK(n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, 40}));
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kTimeout, "{}", r.status.to_string());
            CHILD_CHECK(
                std::all_of(n.mem.begin(), n.mem.end(), [](uint8_t b) { return b == kPoison; }));
        }
        CHILD_CHECK_OK(n.blocks->free(blocks));
        CHILD_CHECK_OK(ex.barrier());
        return "";
    });
    EXPECT_ALL_OK(results);
}

// Issue 32: inside vLLM, decode registers as soon as it allocated its blocks and prefill
// computes the prompt afterwards, one step that took 27 s for 1500 tokens on the loaded 2-core
// VM. The lease ran from the registration on both sides: at 30 s decode gave up ("prefill
// ranks 0 did not complete transfer"), prefill dropped the registration with it, and the
// prefill_done that came a few seconds later waited a whole lease for a registration that had
// come and gone ("no registration from every decode rank"). A prefill that said it computes
// (prefill_scheduled) keeps the registration alive, however long the compute takes.
// Second round: prefill's lease is longer than decode's (in vLLM each engine has its own
// config; the renewals must come often enough for the shorter, which REGISTER carries), and
// prefill says it computes before the REGISTER arrives (vLLM's order).
TEST_P(KvReliabilityTest, PrefillComputingLongerThanTheLeaseStillDelivers) {
    for (bool vllm_order : {false, true}) {
        SCOPED_TRACE(vllm_order ? "prefill lease 10 s, scheduled first" : "same lease");
        const auto lease = std::chrono::milliseconds(600);
        const Duration prefill_lease = vllm_order ? Duration(std::chrono::seconds(10)) : lease;
        auto results = run_1p1d(
            lease,
            [&](Exchange& ex, KvNode& n) -> std::string {
                const uint64_t id = 0x7f1;
                CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(3));
                if (ex.rank() == kDecode) {
                    CHILD_CHECK_OK(n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, 40}));
                    CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
                    CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
                    std::string diff = testing::pool_holds_only(n, id, blocks, 40);
                    CHILD_CHECK_MSG(diff.empty(), "{}", diff);
                    CHILD_CHECK(n.conn->stats().leases_expired == 0);
                } else {
                    if (vllm_order) CHILD_CHECK_OK(n.conn->prefill_scheduled(id));
                    CHILD_CHECK_OK(testing::wait_messages(n, 1, kWait));  // the REGISTER
                    CHILD_CHECK_OK(n.conn->prefill_scheduled(id));  // again: a no-op the 2nd time
                    // Computing: four of decode's leases.
                    std::this_thread::sleep_for(4 * lease);
                    testing::fill_request(n, id, blocks, 40);
                    CHILD_CHECK_OK(n.conn->prefill_done(id, blocks, 40));
                    CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
                    CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
                    CHILD_CHECK(n.conn->stats().leases_expired == 0);
                }
                CHILD_CHECK_OK(n.blocks->free(blocks));
                CHILD_CHECK_OK(ex.barrier());
                return "";
            },
            testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 64),
            prefill_lease);
        EXPECT_ALL_OK(results);
    }
}

// Issue 32, the loaded vllm_pd failure: decode registered, and prefill's vLLM scheduled the
// request only later (its engine starved, or the request queued behind a long step): renewals
// started with prefill_scheduled, so nothing renewed decode's lease in between, and decode
// gave up ("prefill ranks 0 did not complete transfer ... within the lease") a moment before
// prefill computed the request (traced: REGISTER in at prefill, decode's 3 s lease out 2.9 s
// later, prefill_done 0.3 s after that). A live prefill holding the registration renews it
// while the request is queued, within prefill's own lease: first round, queued for three of
// decode's leases, then computed: delivered. Second round, never scheduled: decode's load
// fails by prefill's lease (FAIL), not later.
TEST_P(KvReliabilityTest, PrefillQueuedLongerThanTheLeaseStillDelivers) {
    // Decode's lease long enough for renewals (a third of it apart) to get through on a loaded
    // 2-core host, where 600 ms did not always.
    const auto lease = std::chrono::seconds(2);
    for (bool scheduled : {true, false}) {
        SCOPED_TRACE(scheduled ? "queued, then computed" : "never scheduled");
        const Duration prefill_lease =
            scheduled ? Duration(std::chrono::seconds(20)) : Duration(std::chrono::seconds(5));
        auto results = run_1p1d(
            lease,
            [&](Exchange& ex, KvNode& n) -> std::string {
                const uint64_t id = 0x7f2;
                CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(3));
                if (ex.rank() == kDecode) {
                    TimePoint t0 = Clock::now();
                    CHILD_CHECK_OK(n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, 40}));
                    CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
                    Duration took = Clock::now() - t0;
                    if (scheduled) {
                        CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
                        std::string diff = testing::pool_holds_only(n, id, blocks, 40);
                        CHILD_CHECK_MSG(diff.empty(), "{}", diff);
                    } else {
                        CHILD_CHECK_MSG(
                            r.status.code() == StatusCode::kTimeout &&
                                r.status.message().find("prefill rank 0") != std::string::npos,
                            "{}", r.status.to_string());
                        CHILD_CHECK_MSG(took >= prefill_lease - lease &&
                                            took < prefill_lease + std::chrono::seconds(5),
                                        "failed after {:.0f} ms", to_ms(took));
                    }
                } else {
                    CHILD_CHECK_OK(testing::wait_messages(n, 1, kWait));  // the REGISTER
                    if (scheduled) {
                        // Queued: three of decode's leases before vLLM schedules the request.
                        std::this_thread::sleep_for(3 * lease);
                        CHILD_CHECK_OK(n.conn->prefill_scheduled(id));
                        testing::fill_request(n, id, blocks, 40);
                        CHILD_CHECK_OK(n.conn->prefill_done(id, blocks, 40));
                        CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
                        CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
                        CHILD_CHECK(n.conn->stats().leases_expired == 0);
                    } else {
                        std::this_thread::sleep_for(prefill_lease + std::chrono::seconds(1));
                    }
                }
                CHILD_CHECK_OK(n.blocks->free(blocks));
                CHILD_CHECK_OK(ex.barrier());
                return "";
            },
            testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 64),
            prefill_lease);
        EXPECT_ALL_OK(results);
    }
}

TEST_P(KvReliabilityTest, FailedPrefillReachesDecodeAsFail) {
    auto results = run_1p1d(std::chrono::seconds(10), [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t id = 0x78;
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(2));
        if (ex.rank() == kDecode) {
            TimePoint t0 = Clock::now();
            CHILD_CHECK_OK(n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, 20}));
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kResourceExhausted, "{}",
                            r.status.to_string());
            CHILD_CHECK_MSG(
                r.status.message().find("prefill ran out of blocks") != std::string::npos, "{}",
                r.status.message());
            CHILD_CHECK(Clock::now() - t0 < std::chrono::seconds(5));
        } else {
            CHILD_CHECK_OK(testing::wait_messages(n, 1, kWait));
            CHILD_CHECK_OK(
                n.conn->prefill_failed(id, resource_exhausted("prefill ran out of blocks")));
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
            CHILD_CHECK(r.status.code() == StatusCode::kResourceExhausted);
        }
        CHILD_CHECK_OK(n.blocks->free(blocks));
        CHILD_CHECK_OK(ex.barrier());
        return "";
    });
    EXPECT_ALL_OK(results);
}

TEST_P(KvReliabilityTest, MismatchedRegistrationFailsBothSidesAtOnce) {
    auto results = run_1p1d(std::chrono::seconds(30), [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t id = 0x7e;
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(3));
        TimePoint t0 = Clock::now();
        if (ex.rank() == kPrefill) {
            CHILD_CHECK_OK(n.conn->prefill_done(id, blocks, 30));
        }
        CHILD_CHECK_OK(ex.barrier());
        if (ex.rank() == kDecode) {
            // Decode believes the prompt has 40 tokens, prefill computed 30.
            CHILD_CHECK_OK(n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, 40}));
        }
        CHILD_ASSIGN_OK(auto r, n.results.wait(ex.rank() == kPrefill, id, kWait));
        CHILD_CHECK_MSG(r.status.code() == StatusCode::kInvalidArgument, "{}",
                        r.status.to_string());
        CHILD_CHECK_MSG(r.status.message().find("40 tokens") != std::string::npos, "{}",
                        r.status.message());
        // Well before the 30 s lease.
        CHILD_CHECK(Clock::now() - t0 < std::chrono::seconds(10));
        CHILD_CHECK_OK(n.blocks->free(blocks));
        CHILD_CHECK_OK(ex.barrier());
        return "";
    });
    EXPECT_ALL_OK(results);
}

TEST_P(KvReliabilityTest, PullOfferWithoutDoneIsReleasedAfterTheLease) {
    const auto lease = std::chrono::milliseconds(300);
    auto results = run_1p1d(lease, [&](Exchange& ex, KvNode& n) -> std::string {
        if (ex.rank() == kPrefill) {
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(2));
            CHILD_ASSIGN_OK(auto params, n.conn->offer_pull(0x7f, blocks, 20));
            CHILD_CHECK(params.blocks == blocks && params.num_tokens == 20);
            // Decode never reads: the lease gives the blocks back.
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, 0x7f, kWait));
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kTimeout, "{}", r.status.to_string());
            CHILD_CHECK(n.conn->stats().leases_expired == 1);
            CHILD_CHECK_OK(n.blocks->free(blocks));
        }
        CHILD_CHECK_OK(ex.barrier());
        return "";
    });
    EXPECT_ALL_OK(results);
}

// The router aborted the transfer (its decode leg failed): prefill's blocks come back at once,
// not at the lease, in pull and in push; a late registration hears FAIL and nothing lands; an
// unknown transfer is ignored.
TEST_P(KvReliabilityTest, AbortSendReleasesAtOnceAndALateRegistrationFails) {
    auto results = run_1p1d(std::chrono::seconds(10), [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t pull_id = 0x90, push_id = 0x91;
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(3));
        if (ex.rank() == kPrefill) {
            auto released_at_once = [&](uint64_t id) -> std::string {
                TimePoint t0 = Clock::now();
                CHILD_CHECK_OK(n.conn->abort_send(id, cancelled("router aborted the transfer")));
                CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
                CHILD_CHECK_MSG(r.status.code() == StatusCode::kCancelled, "{}",
                                r.status.to_string());
                CHILD_CHECK_MSG(r.status.message().find("router aborted") != std::string::npos,
                                "{}", r.status.message());
                CHILD_CHECK_MSG(Clock::now() - t0 < std::chrono::seconds(1),
                                "released after {:.0f} ms", to_ms(Clock::now() - t0));
                return "";
            };
            CHILD_ASSIGN_OK(auto params, n.conn->offer_pull(pull_id, blocks, 40));
            (void)params;
            std::string e = released_at_once(pull_id);
            if (!e.empty()) return e;
            testing::fill_request(n, push_id, blocks, 40);
            CHILD_CHECK_OK(n.conn->prefill_done(push_id, blocks, 40));
            e = released_at_once(push_id);
            if (!e.empty()) return e;
            CHILD_CHECK_OK(n.conn->abort_send(0x999, cancelled("nothing to abort")));
            CHILD_CHECK(!n.results.wait(true, 0x999, std::chrono::milliseconds(200)).ok());
            CHILD_CHECK(n.conn->stats().active_send == 0);
            CHILD_CHECK(n.conn->stats().leases_expired == 0);
        }
        CHILD_CHECK_OK(ex.barrier());
        if (ex.rank() == kDecode) {
            CHILD_CHECK_OK(n.conn->register_push({push_id, 1, {n.addrs[kPrefill]}, blocks, 40}));
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, push_id, kWait));
            CHILD_CHECK_MSG(!r.status.ok(), "{}", r.status.to_string());
            CHILD_CHECK(
                std::all_of(n.mem.begin(), n.mem.end(), [](uint8_t b) { return b == kPoison; }));
        }
        CHILD_CHECK_OK(n.blocks->free(blocks));
        CHILD_CHECK_OK(ex.barrier());
        return "";
    });
    EXPECT_ALL_OK(results);
}

TEST_P(KvReliabilityTest, CancelBeforePrefillDoneIsAcknowledgedAndNothingLands) {
    auto results = run_1p1d(std::chrono::seconds(10), [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t id = 0x79;
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(4));
        if (ex.rank() == kDecode) {
            CHILD_CHECK_OK(n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, 60}));
            CHILD_CHECK_OK(n.conn->cancel(id));
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kCancelled, "{}", r.status.to_string());
            CHILD_CHECK_OK(n.blocks->free(blocks));
        }
        CHILD_CHECK_OK(ex.barrier());
        if (ex.rank() == kPrefill) {
            // Prefill finishes after the cancel: nothing is written, the blocks come back.
            testing::fill_request(n, id, blocks, 60);
            CHILD_CHECK_OK(n.conn->prefill_done(id, blocks, 60));
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kCancelled, "{}", r.status.to_string());
            CHILD_CHECK(r.writes == 0);
            CHILD_CHECK_OK(n.blocks->free(blocks));
        }
        CHILD_CHECK_OK(ex.barrier());
        if (ex.rank() == kDecode) {
            CHILD_CHECK(
                std::all_of(n.mem.begin(), n.mem.end(), [](uint8_t b) { return b == kPoison; }));
        }
        return "";
    });
    EXPECT_ALL_OK(results);
}

TEST_P(KvReliabilityTest, CancelWithWritesInFlightNeverTouchesReusedBlocks) {
    // Big enough (12 MiB per request) that the cancel usually finds writes in flight.
    KvLayout big = testing::test_layout(4, 16, BlockOrder::kHND, KvPlacement::kSeparate, 64);
    big.num_layers = 24;
    big.head_dim = 128;
    const uint32_t kTokens = 512;
    auto results = run_1p1d(
        std::chrono::seconds(10),
        [&](Exchange& ex, KvNode& n) -> std::string {
            for (uint64_t id = 0x100; id < 0x104; ++id) {
                CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(kTokens / 16));
                if (ex.rank() == kPrefill) {
                    testing::fill_request(n, id, blocks, kTokens);
                    CHILD_CHECK_OK(n.conn->prefill_done(id, blocks, kTokens));
                }
                CHILD_CHECK_OK(ex.barrier());
                if (ex.rank() == kDecode) {
                    CHILD_CHECK_OK(
                        n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, kTokens}));
                    std::this_thread::sleep_for(std::chrono::milliseconds(id % 4));
                    CHILD_CHECK_OK(n.conn->cancel(id));
                    CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
                    CHILD_CHECK_MSG(r.status.code() == StatusCode::kCancelled, "{}",
                                    r.status.to_string());
                    // Reuse: the blocks now hold another request's data, which must survive.
                    for (uint32_t b : blocks) {
                        uint64_t off = big.slab_offset(0, KvPart::kK, b);
                        std::memset(n.mem.data() + off, 0x3c, big.slab_bytes());
                    }
                }
                if (ex.rank() == kPrefill) {
                    // Cancelled, or ok when every write had completed before the CANCEL came.
                    CHILD_ASSIGN_OK(auto done, n.results.wait(true, id, kWait));
                    CHILD_CHECK_MSG(
                        done.status.ok() || done.status.code() == StatusCode::kCancelled, "{}",
                        done.status.to_string());
                }
                CHILD_CHECK_OK(ex.barrier());  // prefill's writes for id are all complete now
                if (ex.rank() == kDecode) {
                    std::this_thread::sleep_for(std::chrono::milliseconds(20));
                    for (uint32_t b : blocks) {
                        uint64_t off = big.slab_offset(0, KvPart::kK, b);
                        for (uint64_t i = 0; i < big.slab_bytes(); ++i) {
                            CHILD_CHECK_MSG(n.mem[off + i] == 0x3c,
                                            "a write landed in reused block {} after the cancel "
                                            "was acknowledged",
                                            b);
                        }
                    }
                }
                CHILD_CHECK_OK(n.blocks->free(blocks));
            }
            CHILD_CHECK_OK(ex.barrier());
            return "";
        },
        big);
    EXPECT_ALL_OK(results);
}

// Prefill's process is stopped while decode pulls: the reads time out and the pull fails (the
// offer's 5 s lease leaves no time to read again after op_timeout, 3 s), but tcp still carries
// the reads out when prefill resumes. Decode must report the failure only once no read can land
// any more, so blocks reused right after the report keep their data.
TEST_P(KvReliabilityTest, FailedPullIsReportedOnlyWhenNoLateReadCanLand) {
    constexpr uint64_t kWarm = 0x51, kId = 0x52;
    constexpr uint32_t kTokens = 64;
    KvLayout layout = testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 64);
    auto results = run_1p1d(
        std::chrono::seconds(20),
        [&](Exchange& ex, KvNode& n) -> std::string {
            CHILD_ASSIGN_OK(auto warm, n.blocks->allocate(kTokens / 16));
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(kTokens / 16));
            ByteWriter w;
            if (ex.rank() == kPrefill) {
                const long pid = static_cast<long>(getpid());
                w.put_bytes({reinterpret_cast<const uint8_t*>(&pid), sizeof(pid)});
                for (auto [id, b] : {std::pair{kWarm, &warm}, std::pair{kId, &blocks}}) {
                    testing::fill_request(n, id, *b, kTokens);
                    CHILD_ASSIGN_OK(auto offer, n.conn->offer_pull(id, *b, kTokens));
                    w.put_bytes(encode_message(offer));
                }
            }
            CHILD_ASSIGN_OK(auto all, ex.allgather(w.bytes()));
            if (ex.rank() == kDecode) {
                ByteReader rd(all[kPrefill]);
                std::vector<uint8_t> pid_bytes, warm_offer, offer;
                CHILD_CHECK_OK(rd.get_bytes(&pid_bytes, "pid", 8));
                CHILD_CHECK_OK(rd.get_bytes(&warm_offer, "offer", 1 << 20));
                CHILD_CHECK_OK(rd.get_bytes(&offer, "offer", 1 << 20));
                long prefill_pid = 0;
                std::memcpy(&prefill_pid, pid_bytes.data(), sizeof(prefill_pid));
                auto params = [](const std::vector<uint8_t>& m) -> Result<PullParamsMsg> {
                    FERRY_ASSIGN_OR_RETURN(auto msg, decode_message(m));
                    return std::get<PullParamsMsg>(msg);
                };
                // The connection exists before prefill stops.
                CHILD_ASSIGN_OK(auto wp, params(warm_offer));
                CHILD_CHECK_OK(n.conn->pull(kWarm, {wp}, warm, kTokens));
                CHILD_ASSIGN_OK(auto wr, n.results.wait(false, kWarm, kWait));
                CHILD_CHECK_MSG(wr.status.ok(), "{}", wr.status.to_string());

                CHILD_CHECK(::ferry::testing::stop_process(prefill_pid, std::chrono::seconds(2)));
                CHILD_ASSIGN_OK(auto p, params(offer));
                CHILD_CHECK_OK(n.conn->pull(kId, {p}, blocks, kTokens));
                // Resumed after the reads timed out (op_timeout 3 s).
                std::thread resume([prefill_pid] {
                    std::this_thread::sleep_for(std::chrono::seconds(4));
                    ::kill(static_cast<pid_t>(prefill_pid), SIGCONT);
                });
                auto r = n.results.wait(false, kId, std::chrono::seconds(30));
                bool failed = r.ok() && !r->status.ok();
                if (failed) {
                    // Reused at once: another request's data, which must survive.
                    for (uint32_t l = 0; l < layout.num_layers; ++l) {
                        for (KvPart part : {KvPart::kK, KvPart::kV}) {
                            for (uint32_t b : blocks) {
                                std::memset(n.mem.data() + layout.slab_offset(l, part, b), 0x3c,
                                            layout.slab_bytes());
                            }
                        }
                    }
                }
                resume.join();
                CHILD_CHECK_OK(r.status());
                // shm may serve reads without the target (CMA); tcp cannot.
                CHILD_CHECK_MSG(failed || GetParam() != "tcp",
                                "a pull from a stopped prefill "
                                "succeeded over tcp");
                std::this_thread::sleep_for(std::chrono::milliseconds(500));
                for (uint32_t l = 0; failed && l < layout.num_layers; ++l) {
                    for (KvPart part : {KvPart::kK, KvPart::kV}) {
                        for (uint32_t b : blocks) {
                            const uint8_t* p = n.mem.data() + layout.slab_offset(l, part, b);
                            for (uint64_t i = 0; i < layout.slab_bytes(); ++i) {
                                CHILD_CHECK_MSG(p[i] == 0x3c,
                                                "a late read landed in block {} (layer {}) after "
                                                "the failed pull was reported",
                                                b, l);
                            }
                        }
                    }
                }
            } else {
                CHILD_ASSIGN_OK(auto r, n.results.wait(true, kWarm, kWait));
                CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
                CHILD_ASSIGN_OK(auto r2, n.results.wait(true, kId, std::chrono::seconds(40)));
                (void)r2;  // cancelled (decode gave up) or ok (shm read it all)
            }
            CHILD_CHECK_OK(ex.barrier());
            CHILD_CHECK_OK(n.blocks->free(warm));
            CHILD_CHECK_OK(n.blocks->free(blocks));
            return "";
        },
        layout, std::chrono::seconds(5));
    EXPECT_ALL_OK(results);
}

// Issue 32: the first message to a peer waits for the provider's connection (tcp;ofi_rxm
// connects on the first send and pushes the send back meanwhile). Under load the peer answered
// the connection only after op_timeout, and the REGISTER was dropped with a warning: decode's
// request hung for its lease and failed. Below, prefill's process is stopped before decode's
// first message to it and resumed after two op_timeouts (3 s, NodeOptions): decode's first
// REGISTER, or its first reads, must still get through, well within the lease.
constexpr auto kStoppedFor = std::chrono::seconds(7);

// Stops a process now (SIGSTOP) and resumes it after kStoppedFor, as a loaded host answers
// late; the destructor waits for the resumption.
class StoppedForAWhile {
  public:
    explicit StoppedForAWhile(long pid)
        : stopped_(::ferry::testing::stop_process(pid, std::chrono::seconds(2))), resume_([pid] {
              std::this_thread::sleep_for(kStoppedFor);
              ::kill(static_cast<pid_t>(pid), SIGCONT);
          }) {}
    ~StoppedForAWhile() { resume_.join(); }
    bool stopped() const { return stopped_; }

  private:
    bool stopped_;
    std::thread resume_;
};

// Prefill's pid (put first into prefill's allgather bytes) as decode reads it.
Result<long> prefill_pid(ByteReader& rd) {
    std::vector<uint8_t> bytes;
    FERRY_RETURN_IF_ERROR(rd.get_bytes(&bytes, "pid", 8));
    long pid = 0;
    std::memcpy(&pid, bytes.data(), sizeof(pid));
    return pid;
}

void put_pid(ByteWriter& w) {
    const long pid = static_cast<long>(getpid());
    w.put_bytes({reinterpret_cast<const uint8_t*>(&pid), sizeof(pid)});
}

// Decode: the transfer ended ok (within `r`'s wait) and the pool is `image` (the requests
// landed before, from kPoison) with this request's KV added.
std::string landed(KvNode& n, std::vector<uint8_t>& image, const Result<TransferResult>& r,
                   TimePoint t0, uint64_t id, const std::vector<uint32_t>& blocks,
                   uint32_t tokens) {
    CHILD_CHECK_OK(r.status());
    CHILD_CHECK_MSG(r->status.ok(), "after {:.0f} ms: {}", to_ms(Clock::now() - t0),
                    r->status.to_string());
    testing::expect_request(n.self, image, id, blocks, tokens);
    std::string diff = testing::compare_pool(n.mem, image);
    CHILD_CHECK_MSG(diff.empty(), "{}", diff);
    return "";
}

TEST_P(KvReliabilityTest, FirstRegisterToAPeerThatAnswersLateStillArrives) {
    constexpr uint64_t kId = 0x5f;
    constexpr uint32_t kTokens = 40;
    auto results = run_1p1d(std::chrono::seconds(15), [&](Exchange& ex, KvNode& n) -> std::string {
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(3));
        ByteWriter w;
        put_pid(w);
        CHILD_ASSIGN_OK(auto all, ex.allgather(w.bytes()));
        if (ex.rank() == kDecode) {
            ByteReader rd(all[kPrefill]);
            CHILD_ASSIGN_OK(long pid, prefill_pid(rd));
            TimePoint t0 = Clock::now();
            Result<TransferResult> r = internal_error("not waited");
            {
                StoppedForAWhile stop(pid);
                CHILD_CHECK(stop.stopped());
                CHILD_CHECK_OK(
                    n.conn->register_push({kId, 1, {n.addrs[kPrefill]}, blocks, kTokens}));
                r = n.results.wait(false, kId, std::chrono::seconds(40));
            }
            std::vector<uint8_t> image(n.mem.size(), kPoison);
            std::string e = landed(n, image, r, t0, kId, blocks, kTokens);
            if (!e.empty()) return e;
        } else {
            CHILD_CHECK_OK(testing::wait_messages(n, 1, std::chrono::seconds(40)));  // REGISTER
            testing::fill_request(n, kId, blocks, kTokens);
            CHILD_CHECK_OK(n.conn->prefill_done(kId, blocks, kTokens));
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, kId, kWait));
            CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
        }
        CHILD_CHECK_OK(n.blocks->free(blocks));
        CHILD_CHECK_OK(ex.barrier());
        return "";
    });
    EXPECT_ALL_OK(results);
}

// Twice: the first pull's reads wait for the connection (never posted), the second's are
// posted on it and unanswered (a starved prefill); both are read again until prefill answers.
TEST_P(KvReliabilityTest, PullFromAPeerThatAnswersLateStillReads) {
    // shm reads a stopped process's memory itself (CMA) once the peer is mapped, so whether a
    // read is pushed back at all depends on timing there; and once, with the whole kv_tests
    // suite and three vLLM engines beside it, prefill never heard either DONE sent to it while
    // stopped (lease expired; not understood yet, issue 32). tcp needs the peer for every read.
    if (GetParam() != "tcp") GTEST_SKIP() << "tcp: reads need the peer's process (see above)";
    constexpr uint64_t kIds[] = {0x60, 0x61};
    constexpr uint32_t kTokens = 48;
    auto results = run_1p1d(std::chrono::seconds(20), [&](Exchange& ex, KvNode& n) -> std::string {
        std::vector<std::vector<uint32_t>> blocks;
        for (size_t i = 0; i < std::size(kIds); ++i) {
            CHILD_ASSIGN_OK(auto b, n.blocks->allocate(kTokens / 16));
            blocks.push_back(std::move(b));
        }
        ByteWriter w;
        if (ex.rank() == kPrefill) {
            put_pid(w);
            for (size_t i = 0; i < std::size(kIds); ++i) {
                testing::fill_request(n, kIds[i], blocks[i], kTokens);
                CHILD_ASSIGN_OK(auto offer, n.conn->offer_pull(kIds[i], blocks[i], kTokens));
                w.put_bytes(encode_message(offer));
            }
        }
        CHILD_ASSIGN_OK(auto all, ex.allgather(w.bytes()));
        if (ex.rank() == kDecode) {
            ByteReader rd(all[kPrefill]);
            CHILD_ASSIGN_OK(long pid, prefill_pid(rd));
            std::vector<uint8_t> image(n.mem.size(), kPoison);
            for (size_t i = 0; i < std::size(kIds); ++i) {
                SCOPED_TRACE(i == 0 ? "first pull" : "on a connection");
                std::vector<uint8_t> offer;
                CHILD_CHECK_OK(rd.get_bytes(&offer, "offer", 1 << 20));
                CHILD_ASSIGN_OK(auto msg, decode_message(offer));
                CHILD_CHECK(std::holds_alternative<PullParamsMsg>(msg));
                TimePoint t0 = Clock::now();
                Result<TransferResult> r = internal_error("not waited");
                {
                    StoppedForAWhile stop(pid);
                    CHILD_CHECK(stop.stopped());
                    CHILD_CHECK_OK(
                        n.conn->pull(kIds[i], {std::get<PullParamsMsg>(msg)}, blocks[i], kTokens));
                    r = n.results.wait(false, kIds[i], std::chrono::seconds(40));
                }
                std::string e = landed(n, image, r, t0, kIds[i], blocks[i], kTokens);
                if (!e.empty()) return e;
            }
        } else {
            for (uint64_t id : kIds) {
                CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, std::chrono::seconds(40)));
                CHILD_CHECK_MSG(r.status.ok(), "{:#x}: {}", id, r.status.to_string());
            }
        }
        for (const auto& b : blocks) CHILD_CHECK_OK(n.blocks->free(b));
        CHILD_CHECK_OK(ex.barrier());
        return "";
    });
    EXPECT_ALL_OK(results);
}

// Issue 32: decode's DONE ends prefill's offer and frees its blocks, also when decode gives the
// pull up. Sent while prefill did not answer (stopped for two op_timeouts, as a loaded host),
// the first message to it (tcp;ofi_rxm: no connection yet; shm: not mapped yet) was never taken
// by the provider and dropped with a warning: prefill held the blocks until its lease (20 s
// here). DONE is now posted again while the offer may still hold them, so prefill's offer ends
// soon after prefill answers again. Decode gives up (peer_gone) while prefill is stopped.
TEST_P(KvReliabilityTest, DoneToAPeerThatAnswersLateStillArrives) {
    constexpr uint64_t kId = 0x62;
    constexpr uint32_t kTokens = 48;
    const auto lease = std::chrono::seconds(20);
    auto results = run_1p1d(lease, [&](Exchange& ex, KvNode& n) -> std::string {
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(kTokens / 16));
        ByteWriter w;
        if (ex.rank() == kPrefill) {
            put_pid(w);
            testing::fill_request(n, kId, blocks, kTokens);
            CHILD_ASSIGN_OK(auto offer, n.conn->offer_pull(kId, blocks, kTokens));
            w.put_bytes(encode_message(offer));
        }
        CHILD_ASSIGN_OK(auto all, ex.allgather(w.bytes()));
        TimePoint t0 = Clock::now();
        if (ex.rank() == kDecode) {
            ByteReader rd(all[kPrefill]);
            CHILD_ASSIGN_OK(long pid, prefill_pid(rd));
            std::vector<uint8_t> offer;
            CHILD_CHECK_OK(rd.get_bytes(&offer, "offer", 1 << 20));
            CHILD_ASSIGN_OK(auto msg, decode_message(offer));
            CHILD_CHECK(std::holds_alternative<PullParamsMsg>(msg));
            StoppedForAWhile stop(pid);
            CHILD_CHECK(stop.stopped());
            CHILD_CHECK_OK(n.conn->pull(kId, {std::get<PullParamsMsg>(msg)}, blocks, kTokens));
            std::this_thread::sleep_for(std::chrono::seconds(1));  // the reads wait
            CHILD_CHECK_OK(n.conn->peer_gone(n.addrs[kPrefill], unavailable("given up")));
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, kId, std::chrono::seconds(40)));
            CHILD_CHECK_MSG(!r.status.ok(), "the pull given up ended ok");
        } else {
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, kId, std::chrono::seconds(40)));
            Duration took = Clock::now() - t0;
            // Ended by decode's DONE ("gave up reading"), well before the lease.
            CHILD_CHECK_MSG(
                r.status.code() == StatusCode::kCancelled && took < lease - std::chrono::seconds(5),
                "prefill's offer ended after {:.0f} ms (lease {:.0f} ms): {}", to_ms(took),
                to_ms(lease), r.status.to_string());
        }
        CHILD_CHECK_OK(n.blocks->free(blocks));
        CHILD_CHECK_OK(ex.barrier());
        return "";
    });
    EXPECT_ALL_OK(results);
}

TEST_P(KvReliabilityTest, NewerAttemptSupersedesAndOldWritesNeverCount) {
    auto results = run_1p1d(std::chrono::seconds(10), [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t id = 0x7a;
        const uint32_t kTokens = 70;
        CHILD_ASSIGN_OK(auto first, n.blocks->allocate(5));
        CHILD_ASSIGN_OK(auto second, n.blocks->allocate(5));
        if (ex.rank() == kDecode) {
            CHILD_CHECK_OK(n.conn->register_push({id, 1, {n.addrs[kPrefill]}, first, kTokens}));
            CHILD_CHECK_OK(ex.barrier());  // prefill saw attempt 1
            // Preempted and re-admitted with other blocks.
            CHILD_CHECK_OK(n.conn->register_push({id, 2, {n.addrs[kPrefill]}, second, kTokens}));
            CHILD_ASSIGN_OK(auto old, n.results.wait(false, id, kWait, 1));
            CHILD_CHECK_MSG(old.status.code() == StatusCode::kCancelled, "{}",
                            old.status.to_string());
            CHILD_CHECK_OK(n.blocks->free(first));
            CHILD_CHECK_OK(ex.barrier());
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait, 2));
            CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
            std::string diff = testing::pool_holds_only(n, id, second, kTokens);
            CHILD_CHECK_MSG(diff.empty(), "{}", diff);
            CHILD_CHECK_OK(n.blocks->free(second));
        } else {
            CHILD_CHECK_OK(testing::wait_messages(n, 1, kWait));
            CHILD_CHECK_OK(ex.barrier());
            // REGISTER attempt 2 and CANCEL attempt 1.
            CHILD_CHECK_OK(testing::wait_messages(n, 3, kWait));
            CHILD_CHECK_OK(ex.barrier());
            testing::fill_request(n, id, first, kTokens);
            CHILD_CHECK_OK(n.conn->prefill_done(id, first, kTokens));
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
            CHILD_CHECK_MSG(r.status.ok() && r.attempt == 2, "attempt {}: {}", r.attempt,
                            r.status.to_string());
            CHILD_CHECK_OK(n.blocks->free(first));
            CHILD_CHECK_OK(n.blocks->free(second));
        }
        CHILD_CHECK_OK(ex.barrier());
        return "";
    });
    EXPECT_ALL_OK(results);
}

// Second round: prefill computes (its renewals reach decode) for three leases, then dies; the
// renewals stop with it, and decode still gives up about a lease after the last one.
TEST_P(KvReliabilityTest, KilledPrefillFreesDecodeBlocksWithinTheLease) {
    for (bool computing : {false, true}) {
        SCOPED_TRACE(computing ? "killed while computing" : "killed before computing");
        const auto lease = std::chrono::milliseconds(800);
        const Duration computed = computing ? 3 * lease : Duration::zero();
        auto results = run_1p1d(lease, [&](Exchange& ex, KvNode& n) -> std::string {
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(2));
            if (ex.rank() == kPrefill) {
                CHILD_CHECK_OK(testing::wait_messages(n, 1, kWait));
                if (computing) CHILD_CHECK_OK(n.conn->prefill_scheduled(0x7b));
                std::this_thread::sleep_for(computed);
                testing::drop_shm_names_of_this_process();
                raise(SIGKILL);
            }
            TimePoint t0 = Clock::now();
            CHILD_CHECK_OK(n.conn->register_push({0x7b, 1, {n.addrs[kPrefill]}, blocks, 30}));
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, 0x7b, kWait));
            Duration took = Clock::now() - t0;
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kTimeout, "{}", r.status.to_string());
            CHILD_CHECK_MSG(took < computed + lease + std::chrono::seconds(4),
                            "freed after {:.0f} ms", to_ms(took));
            CHILD_CHECK_OK(n.blocks->free(blocks));
            return "";
        });
        ASSERT_EQ(results.size(), 2u);
        EXPECT_EQ(results[kPrefill].term_signal, SIGKILL);
        EXPECT_TRUE(results[kDecode].ok()) << results[kDecode].error;
    }
}

// Issue 30, item 3: attempt 2 registered after prefill served attempt 1 and released its
// blocks waited for a prefill_done that never came, the whole lease (30 s by default).
TEST_P(KvReliabilityTest, ANewerAttemptAfterPrefillServedTheOldOneIsRefusedAtOnce) {
    const auto lease = std::chrono::seconds(10);
    auto results = run_1p1d(lease, [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t id = 0xb0;
        const uint32_t kTokens = 40;
        CHILD_ASSIGN_OK(auto first, n.blocks->allocate(3));
        CHILD_ASSIGN_OK(auto second, n.blocks->allocate(3));
        if (ex.rank() == kDecode) {
            CHILD_CHECK_OK(n.conn->register_push({id, 1, {n.addrs[kPrefill]}, first, kTokens}));
            CHILD_ASSIGN_OK(auto r1, n.results.wait(false, id, kWait, 1));
            CHILD_CHECK_MSG(r1.status.ok(), "{}", r1.status.to_string());
            CHILD_CHECK_OK(ex.barrier());  // prefill released its blocks
            TimePoint t0 = Clock::now();
            CHILD_CHECK_OK(n.conn->register_push({id, 2, {n.addrs[kPrefill]}, second, kTokens}));
            CHILD_ASSIGN_OK(auto r2, n.results.wait(false, id, kWait, 2));
            Duration took = Clock::now() - t0;
            CHILD_CHECK_MSG(r2.status.code() == StatusCode::kUnavailable, "{}",
                            r2.status.to_string());
            CHILD_CHECK_MSG(
                r2.status.message().find("already served attempt 1") != std::string::npos, "{}",
                r2.status.to_string());
            CHILD_CHECK_MSG(took < lease / 2, "refused after {:.0f} ms", to_ms(took));
            // Nothing landed in the second attempt's blocks.
            std::string diff = testing::pool_holds_only(n, id, first, kTokens);
            CHILD_CHECK_MSG(diff.empty(), "{}", diff);
        } else {
            testing::fill_request(n, id, first, kTokens);
            CHILD_CHECK_OK(n.conn->prefill_done(id, first, kTokens));
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
            CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
            CHILD_CHECK_OK(ex.barrier());
        }
        CHILD_CHECK_OK(n.blocks->free(first));
        CHILD_CHECK_OK(n.blocks->free(second));
        CHILD_CHECK_OK(ex.barrier());
        return "";
    });
    EXPECT_ALL_OK(results);
}

// Issue 30, item 5: decode's cancel reached prefill's engine only at its own prefill_done, so
// prefill computed prompts nobody wanted. A newer attempt is no reason to stop computing.
TEST_P(KvReliabilityTest, DecodeGivingUpBeforePrefillDoneIsReportedToPrefillAtOnce) {
    auto results = run_1p1d(std::chrono::seconds(10), [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t superseded = 0xb1, given_up = 0xb2;
        CHILD_ASSIGN_OK(auto a, n.blocks->allocate(2));
        CHILD_ASSIGN_OK(auto b, n.blocks->allocate(2));
        CHILD_ASSIGN_OK(auto c, n.blocks->allocate(2));
        if (ex.rank() == kDecode) {
            CHILD_CHECK_OK(n.conn->register_push({superseded, 1, {n.addrs[kPrefill]}, a, 20}));
            CHILD_CHECK_OK(n.conn->register_push({superseded, 2, {n.addrs[kPrefill]}, b, 20}));
            CHILD_CHECK_OK(n.conn->register_push({given_up, 1, {n.addrs[kPrefill]}, c, 20}));
            CHILD_CHECK_OK(n.conn->cancel(given_up));
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, given_up, kWait));
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kCancelled, "{}", r.status.to_string());
            CHILD_ASSIGN_OK(auto old, n.results.wait(false, superseded, kWait, 1));
            CHILD_CHECK(old.status.code() == StatusCode::kCancelled);
            CHILD_CHECK_OK(ex.barrier());
            CHILD_ASSIGN_OK(auto r2, n.results.wait(false, superseded, kWait, 2));
            CHILD_CHECK_MSG(r2.status.ok(), "{}", r2.status.to_string());
        } else {
            // Nothing was computed yet: the engine hears of the cancel without prefill_done.
            TimePoint t0 = Clock::now();
            CHILD_ASSIGN_OK(auto g, n.gave_up.wait(true, given_up, kWait));
            CHILD_CHECK_MSG(g.status.code() == StatusCode::kCancelled, "{}", g.status.to_string());
            CHILD_CHECK_MSG(Clock::now() - t0 < std::chrono::seconds(5), "heard after {:.0f} ms",
                            to_ms(Clock::now() - t0));
            CHILD_CHECK_OK(testing::wait_messages(n, 4, kWait));
            auto wrong = n.gave_up.wait(true, superseded, std::chrono::milliseconds(300));
            CHILD_CHECK_MSG(!wrong.ok(), "a superseded attempt was reported as given up");
            CHILD_CHECK_OK(ex.barrier());
            testing::fill_request(n, superseded, a, 20);
            CHILD_CHECK_OK(n.conn->prefill_done(superseded, a, 20));
            CHILD_ASSIGN_OK(auto s, n.results.wait(true, superseded, kWait));
            CHILD_CHECK_MSG(s.status.ok() && s.attempt == 2, "{}", s.status.to_string());
            CHILD_CHECK_OK(n.conn->prefill_failed(given_up, cancelled("decode gave up")));
            CHILD_ASSIGN_OK(auto f, n.results.wait(true, given_up, kWait));
            (void)f;
        }
        for (auto* blocks : {&a, &b, &c}) CHILD_CHECK_OK(n.blocks->free(*blocks));
        CHILD_CHECK_OK(ex.barrier());
        return "";
    });
    EXPECT_ALL_OK(results);
}

// Issue 30, item 4: a prefill known to be gone ends decode's transfers with it at once, not
// at the lease: announcements and registrations alike.
TEST_P(KvReliabilityTest, APeerKnownGoneEndsItsTransfersAtOnce) {
    const auto lease = std::chrono::seconds(20);
    auto results = run_1p1d(lease, [&](Exchange& ex, KvNode& n) -> std::string {
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(2));
        if (ex.rank() == kPrefill) {
            CHILD_CHECK_OK(testing::wait_messages(n, 2, kWait));  // INTENT and REGISTER
            testing::drop_shm_names_of_this_process();
            raise(SIGKILL);
        }
        CHILD_CHECK_OK(n.conn->announce(0xb3, 1, {n.addrs[kPrefill]}));
        CHILD_CHECK_OK(n.conn->register_push({0xb4, 1, {n.addrs[kPrefill]}, blocks, 30}));
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        TimePoint t0 = Clock::now();
        CHILD_CHECK_OK(n.conn->peer_gone(n.addrs[kPrefill], unavailable("prefill is gone")));
        CHILD_ASSIGN_OK(auto a, n.scheduled.wait(false, 0xb3, kWait));
        CHILD_ASSIGN_OK(auto r, n.results.wait(false, 0xb4, kWait));
        Duration took = Clock::now() - t0;
        for (const Status* st : {&a.status, &r.status})
            CHILD_CHECK_MSG(st->code() == StatusCode::kUnavailable &&
                                st->message().find("prefill is gone") != std::string::npos,
                            "{}", st->to_string());
        CHILD_CHECK_MSG(took < std::chrono::seconds(2), "ended after {:.0f} ms", to_ms(took));
        CHILD_CHECK_OK(n.blocks->free(blocks));
        return "";
    });
    ASSERT_EQ(results.size(), 2u);
    EXPECT_EQ(results[kPrefill].term_signal, SIGKILL);
    EXPECT_TRUE(results[kDecode].ok()) << results[kDecode].error;
}

TEST_P(KvReliabilityTest, KilledDecodeFreesPrefillBlocksInBoundedTime) {
    auto results =
        run_1p1d(std::chrono::milliseconds(800), [&](Exchange& ex, KvNode& n) -> std::string {
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(4));
            if (ex.rank() == kDecode) {
                CHILD_CHECK_OK(n.conn->register_push({0x7c, 1, {n.addrs[kPrefill]}, blocks, 60}));
                // Die only once prefill has the REGISTER: a fixed 200 ms was too little over tcp
                // on a loaded 2-core machine (the message was never sent).
                CHILD_CHECK_OK(ex.barrier());
                testing::drop_shm_names_of_this_process();
                raise(SIGKILL);
            }
            CHILD_CHECK_OK(testing::wait_messages(n, 1, kWait));
            CHILD_CHECK_OK(ex.barrier());
            // Let the decode process die before prefill writes into it.
            std::this_thread::sleep_for(std::chrono::milliseconds(400));
            TimePoint t0 = Clock::now();
            CHILD_CHECK_OK(n.conn->prefill_done(0x7c, blocks, 60));
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, 0x7c, kWait));
            Duration took = Clock::now() - t0;
            // Some providers complete writes to a dead peer's memory locally (the status may be
            // ok); what matters is that prefill gets its blocks back in bounded time.
            CHILD_CHECK_MSG(took < std::chrono::seconds(8), "released after {:.0f} ms: {}",
                            to_ms(took), r.status.to_string());
            CHILD_CHECK_OK(n.blocks->free(blocks));
            return "";
        });
    ASSERT_EQ(results.size(), 2u);
    EXPECT_EQ(results[kDecode].term_signal, SIGKILL);
    EXPECT_TRUE(results[kPrefill].ok()) << results[kPrefill].error;
}

// ---- chunked push: prefill_progress between REGISTER and prefill_done ----

constexpr uint32_t kChunkedTokens = 100;  // chunks of 40: 40, 80, then 100 at prefill_done

TEST_P(KvReliabilityTest, CancelBetweenChunksStopsTheWritesAndLeaksNothing) {
    auto results = run_1p1d(std::chrono::seconds(10), [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t id = 0x90;
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(7));
        if (ex.rank() == kDecode) {
            CHILD_CHECK_OK(
                n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, kChunkedTokens}));
            CHILD_CHECK_OK(testing::wait_progress(n, id, 40, kWait));
            CHILD_CHECK_OK(n.conn->cancel(id));
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kCancelled, "{}", r.status.to_string());
            // Acknowledged: the blocks are reused, and no later chunk may land in them.
            std::memset(n.mem.data(), 0x3c, n.mem.size());
            CHILD_CHECK_OK(ex.barrier());
        } else {
            testing::fill_request(n, id, blocks, kChunkedTokens);
            CHILD_CHECK_OK(testing::wait_messages(n, 1, kWait));
            CHILD_CHECK_OK(n.conn->prefill_progress(id, blocks, 40));
            CHILD_CHECK_OK(testing::wait_messages(n, 2, kWait));  // the CANCEL
            CHILD_CHECK_OK(n.conn->prefill_progress(id, blocks, 80));
            CHILD_CHECK_OK(n.conn->prefill_done(id, blocks, kChunkedTokens));
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kCancelled, "{}", r.status.to_string());
            CHILD_CHECK_MSG(r.bytes > 0 && r.bytes < 80 * n.self.layout.token_bytes() * 2 *
                                                         n.self.layout.num_layers,
                            "{} bytes written: chunks after the cancel went out", r.bytes);
            CHILD_CHECK_OK(ex.barrier());
        }
        CHILD_CHECK_OK(ex.barrier());
        if (ex.rank() == kDecode) {
            CHILD_CHECK(
                std::all_of(n.mem.begin(), n.mem.end(), [](uint8_t b) { return b == 0x3c; }));
        }
        CHILD_CHECK_OK(n.blocks->free(blocks));
        return "";
    });
    EXPECT_ALL_OK(results);
}

TEST_P(KvReliabilityTest, PrefillFailingBetweenChunksReachesDecodeAsFail) {
    auto results = run_1p1d(std::chrono::seconds(10), [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t id = 0x91;
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(7));
        if (ex.rank() == kDecode) {
            CHILD_CHECK_OK(
                n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, kChunkedTokens}));
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kCancelled &&
                                r.status.message().find("client went away") != std::string::npos,
                            "{}", r.status.to_string());
        } else {
            testing::fill_request(n, id, blocks, kChunkedTokens);
            CHILD_CHECK_OK(testing::wait_messages(n, 1, kWait));
            CHILD_CHECK_OK(n.conn->prefill_progress(id, blocks, 40));
            CHILD_CHECK_OK(n.conn->prefill_failed(id, cancelled("client went away")));
            // Released once the first chunk's writes completed, with prefill's reason.
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kCancelled, "{}", r.status.to_string());
        }
        CHILD_CHECK_OK(n.blocks->free(blocks));
        return "";
    });
    EXPECT_ALL_OK(results);
}

TEST_P(KvReliabilityTest, PrefillKilledBetweenChunksFreesDecodeBlocksWithinTheLease) {
    const auto lease = std::chrono::milliseconds(800);
    auto results = run_1p1d(lease, [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t id = 0x92;
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(7));
        if (ex.rank() == kPrefill) {
            testing::fill_request(n, id, blocks, kChunkedTokens);
            CHILD_CHECK_OK(testing::wait_messages(n, 1, kWait));
            CHILD_CHECK_OK(n.conn->prefill_progress(id, blocks, 40));
            // Die only once decode has seen the first chunk land: fixed sleeps were too little
            // over tcp on a loaded 2-core machine (decode saw no progress).
            CHILD_CHECK_OK(ex.barrier());
            testing::drop_shm_names_of_this_process();
            raise(SIGKILL);
        }
        TimePoint t0 = Clock::now();
        CHILD_CHECK_OK(n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, kChunkedTokens}));
        CHILD_CHECK_OK(testing::wait_progress(n, id, 40, kWait));
        CHILD_CHECK_OK(ex.barrier());  // prefill dies now
        CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
        Duration took = Clock::now() - t0;
        CHILD_CHECK_MSG(r.status.code() == StatusCode::kTimeout, "{}", r.status.to_string());
        CHILD_CHECK_MSG(took < lease + std::chrono::seconds(4), "freed after {:.0f} ms",
                        to_ms(took));
        auto p = n.progress_of(id);
        CHILD_CHECK_MSG(!p.empty() && p.back() == 40, "progress before the kill: {}",
                        p.empty() ? 0 : p.back());
        CHILD_CHECK_OK(n.blocks->free(blocks));
        return "";
    });
    ASSERT_EQ(results.size(), 2u);
    EXPECT_EQ(results[kPrefill].term_signal, SIGKILL);
    EXPECT_TRUE(results[kDecode].ok()) << results[kDecode].error;
}

TEST_P(KvReliabilityTest, DecodeKilledBetweenChunksFreesPrefillBlocksInBoundedTime) {
    auto results =
        run_1p1d(std::chrono::milliseconds(800), [&](Exchange& ex, KvNode& n) -> std::string {
            const uint64_t id = 0x93;
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(7));
            if (ex.rank() == kDecode) {
                CHILD_CHECK_OK(
                    n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, kChunkedTokens}));
                CHILD_CHECK_OK(testing::wait_progress(n, id, 40, kWait));
                testing::drop_shm_names_of_this_process();
                raise(SIGKILL);
            }
            testing::fill_request(n, id, blocks, kChunkedTokens);
            CHILD_CHECK_OK(testing::wait_messages(n, 1, kWait));
            CHILD_CHECK_OK(n.conn->prefill_progress(id, blocks, 40));
            std::this_thread::sleep_for(std::chrono::milliseconds(400));  // decode is gone
            TimePoint t0 = Clock::now();
            CHILD_CHECK_OK(n.conn->prefill_progress(id, blocks, 80));
            CHILD_CHECK_OK(n.conn->prefill_done(id, blocks, kChunkedTokens));
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
            Duration took = Clock::now() - t0;
            CHILD_CHECK_MSG(took < std::chrono::seconds(8), "released after {:.0f} ms: {}",
                            to_ms(took), r.status.to_string());
            CHILD_CHECK_OK(n.blocks->free(blocks));
            return "";
        });
    ASSERT_EQ(results.size(), 2u);
    EXPECT_EQ(results[kDecode].term_signal, SIGKILL);
    EXPECT_TRUE(results[kPrefill].ok()) << results[kPrefill].error;
}

TEST_P(KvReliabilityTest, AnnouncementIsAnsweredWhenPrefillSchedulesFailsOrIsCancelled) {
    auto results = run_1p1d(std::chrono::seconds(10), [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t scheduled = 0xa0, failed = 0xa1, cancelled_id = 0xa2;
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(2));
        if (ex.rank() == kDecode) {
            for (uint64_t id : {scheduled, failed, cancelled_id})
                CHILD_CHECK_OK(n.conn->announce(id, 1, {n.addrs[kPrefill]}));
            // Prefill has not scheduled anything yet: no answer.
            auto early = n.scheduled.wait(false, scheduled, std::chrono::milliseconds(300));
            CHILD_CHECK_MSG(!early.ok(), "SCHEDULED before prefill scheduled the transfer");
            CHILD_CHECK_OK(n.conn->cancel(cancelled_id));
            CHILD_ASSIGN_OK(auto c, n.scheduled.wait(false, cancelled_id, kWait));
            CHILD_CHECK_MSG(c.status.code() == StatusCode::kCancelled, "{}", c.status.to_string());
            CHILD_CHECK_OK(ex.barrier());
            CHILD_ASSIGN_OK(auto s, n.scheduled.wait(false, scheduled, kWait));
            CHILD_CHECK_MSG(s.status.ok(), "{}", s.status.to_string());
            CHILD_ASSIGN_OK(auto f, n.scheduled.wait(false, failed, kWait));
            CHILD_CHECK_MSG(f.status.code() == StatusCode::kResourceExhausted, "{}",
                            f.status.to_string());
        } else {
            CHILD_CHECK_OK(testing::wait_messages(n, 4, kWait));  // 3 INTENTs and a CANCEL
            CHILD_CHECK_OK(ex.barrier());
            CHILD_CHECK_OK(n.conn->prefill_scheduled(scheduled));
            CHILD_CHECK_OK(n.conn->prefill_failed(failed, resource_exhausted("out of blocks")));
            CHILD_ASSIGN_OK(auto f, n.results.wait(true, failed, kWait));
            CHILD_CHECK(f.status.code() == StatusCode::kResourceExhausted);
            // The cancelled announcement never registers: prefill's blocks come back at
            // prefill_done, without waiting for the lease.
            TimePoint t0 = Clock::now();
            CHILD_CHECK_OK(n.conn->prefill_done(cancelled_id, blocks, 20));
            CHILD_ASSIGN_OK(auto c, n.results.wait(true, cancelled_id, kWait));
            CHILD_CHECK_MSG(c.status.code() == StatusCode::kCancelled, "{}", c.status.to_string());
            CHILD_CHECK_MSG(Clock::now() - t0 < std::chrono::seconds(2), "released after {:.0f} ms",
                            to_ms(Clock::now() - t0));
            CHILD_CHECK_OK(n.conn->prefill_failed(scheduled, cancelled("test over")));
            CHILD_ASSIGN_OK(auto s, n.results.wait(true, scheduled, kWait));
            (void)s;
        }
        CHILD_CHECK_OK(n.blocks->free(blocks));
        return "";
    });
    EXPECT_ALL_OK(results);
}

TEST_P(KvReliabilityTest, MalformedAndUnknownMessagesAreCountedAndDropped) {
    auto results = run_1p1d(std::chrono::seconds(10), [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t id = 0x7d;
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(2));
        if (ex.rank() == kDecode) {
            CHILD_ASSIGN_OK(PeerId p, n.engine->connect(n.addrs[kPrefill]));
            std::vector<uint8_t> garbage = {1, 2, 3, 4, 5, 6, 7};
            CHILD_CHECK_OK(n.engine->send_message(p, garbage).wait(kWait));
            auto truncated = encode_message(CancelMsg{id, 1, 0});
            truncated.pop_back();
            CHILD_CHECK_OK(n.engine->send_message(p, truncated).wait(kWait));
            // Well formed but for a transfer nobody knows.
            auto unknown = encode_message(CancelAckMsg{0xdead, 1, 0});
            CHILD_CHECK_OK(n.engine->send_message(p, unknown).wait(kWait));
            CHILD_CHECK_OK(ex.barrier());
            // The connector still works afterwards.
            CHILD_CHECK_OK(n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, 20}));
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
            CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
            std::string diff = testing::pool_holds_only(n, id, blocks, 20);
            CHILD_CHECK_MSG(diff.empty(), "{}", diff);
        } else {
            CHILD_CHECK_OK(testing::wait_messages(n, 1, kWait));
            CHILD_CHECK_OK(ex.barrier());
            testing::fill_request(n, id, blocks, 20);
            CHILD_CHECK_OK(n.conn->prefill_done(id, blocks, 20));
            CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
            CHILD_CHECK(r.status.ok());
        }
        ConnectorStats s = n.conn->stats();
        if (ex.rank() == kPrefill) {
            CHILD_CHECK_MSG(s.messages_malformed == 2, "{} malformed", s.messages_malformed);
            CHILD_CHECK_MSG(s.messages_stale == 1, "{} stale", s.messages_stale);
        } else {
            CHILD_CHECK_MSG(s.messages_malformed == 0, "{} malformed", s.messages_malformed);
        }
        CHILD_CHECK_OK(n.blocks->free(blocks));
        CHILD_CHECK_OK(ex.barrier());
        return "";
    });
    EXPECT_ALL_OK(results);
}

// 2 prefill ranks feed 1 decode rank; one prefill rank fails while the other writes. Decode
// must report the failure only after the other producer stopped (FINAL or CANCEL_ACK), so that
// blocks reused right after the report are never written.
TEST_P(KvReliabilityTest, OneFailingProducerOfTwoStopsTheOtherBeforeDecodeReuses) {
    std::string provider = GetParam();
    auto results = run_processes(
        3,
        [&](Exchange& ex) -> std::string {
            bool prefill = ex.rank() < 2;
            KvLayout l = testing::test_layout(prefill ? 2 : 4, 16, BlockOrder::kNHD,
                                              KvPlacement::kSeparate, 64);
            l.num_layers = 16;
            l.head_dim = 128;
            KvRank self{l, prefill ? static_cast<uint32_t>(ex.rank()) : 0u, prefill ? 2u : 1u};
            NodeOptions opt;
            opt.provider = provider;
            CHILD_ASSIGN_OK(auto node, make_kv_node(ex, self, opt, 5, prefill ? 0 : kPoison));
            KvNode& n = *node;
            const uint64_t id = 0x80;
            const uint32_t kTokens = 512;
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(kTokens / 16));
            if (!prefill) {
                CHILD_CHECK_OK(
                    n.conn->register_push({id, 1, {n.addrs[0], n.addrs[1]}, blocks, kTokens}));
            } else {
                CHILD_CHECK_OK(testing::wait_messages(n, 1, kWait));
            }
            CHILD_CHECK_OK(ex.barrier());
            if (ex.rank() == 0) {
                testing::fill_request(n, id, blocks, kTokens);
                CHILD_CHECK_OK(n.conn->prefill_done(id, blocks, kTokens));
                CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
                CHILD_CHECK_MSG(r.status.ok() || r.status.code() == StatusCode::kCancelled, "{}",
                                r.status.to_string());
            } else if (ex.rank() == 1) {
                CHILD_CHECK_OK(n.conn->prefill_failed(id, resource_exhausted("rank 1 ran out")));
                CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
                CHILD_CHECK(r.status.code() == StatusCode::kResourceExhausted);
            } else {
                CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
                CHILD_CHECK_MSG(r.status.code() == StatusCode::kResourceExhausted &&
                                    r.status.message().find("prefill rank 1") != std::string::npos,
                                "{}", r.status.to_string());
                // Reuse the blocks at once: nothing may land in them any more.
                std::fill(n.mem.begin(), n.mem.end(), uint8_t{0x3c});
            }
            CHILD_CHECK_OK(ex.barrier());
            if (!prefill) {
                std::this_thread::sleep_for(std::chrono::milliseconds(20));
                CHILD_CHECK_MSG(
                    std::all_of(n.mem.begin(), n.mem.end(), [](uint8_t b) { return b == 0x3c; }),
                    "a write landed after decode reported the failure");
            }
            CHILD_CHECK_OK(n.blocks->free(blocks));
            CHILD_CHECK_OK(ex.barrier());
            return testing::check_no_leak(n);
        },
        kRunTimeout);
    EXPECT_ALL_OK(results);
}

// Decode's engine loses its rail for good (the watchdog finds its worker spinning inside one
// provider call: libfabric 1.17's shm did so in a vLLM sweep, 2026-12-07, and decode then waited
// its whole 120 s lease for five transfers whose FAIL could not reach it). The registration
// waiting for prefill ends with the engine's error op_timeout and a second later, not at its
// lease, and new transfers are refused at once, naming what to do. Nothing lands; nothing leaks.
TEST_P(KvReliabilityTest, DecodeEngineThatLostItsRailEndsWaitingTransfersSoon) {
    const auto lease = std::chrono::seconds(30);
    // Prefill's registration (never computed here) ends by its own lease, before the test does.
    const auto prefill_lease = std::chrono::seconds(8);
    auto body = [&](Exchange& ex, KvNode& n) -> std::string {
        const uint64_t id = 0x5e;
        CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(3));
        if (ex.rank() == kDecode) {
            CHILD_CHECK_OK(n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, 40}));
        } else {
            CHILD_CHECK_OK(wait_messages(n, 1, kWait));  // the REGISTER came: prefill computes
        }
        CHILD_CHECK_OK(ex.barrier());
        if (ex.rank() == kDecode) {
            CHILD_CHECK_OK(n.engine->health());
            CHILD_CHECK_OK(detail::wedge_rail_for_test(*n.engine, 0, std::chrono::seconds(30)));
            const TimePoint wedged = Clock::now();
            CHILD_CHECK(!n.engine->health().ok());
            CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
            const Duration took = Clock::now() - wedged;
            CHILD_CHECK_MSG(r.status.code() == StatusCode::kUnavailable, "{}",
                            r.status.to_string());
            CHILD_CHECK_MSG(
                r.status.message().find("stuck inside one provider call") != std::string::npos,
                "{}", r.status.message());
            // op_timeout (3 s) and a second, with room for a loaded host; the lease (30 s from
            // the registration, ~6 s before the wedge) would end it ~24 s after.
            CHILD_CHECK_MSG(took < std::chrono::seconds(14), "ended {:.0f} ms after the wedge",
                            to_ms(took));
            Status again = n.conn->register_push({id + 1, 1, {n.addrs[kPrefill]}, blocks, 40});
            CHILD_CHECK_MSG(
                again.code() == StatusCode::kUnavailable &&
                    again.message().find("can take no new transfer") != std::string::npos,
                "{}", again.to_string());
            CHILD_CHECK(
                std::all_of(n.mem.begin(), n.mem.end(), [](uint8_t b) { return b == kPoison; }));
        }
        CHILD_CHECK_OK(ex.barrier());
        CHILD_CHECK_OK(n.blocks->free(blocks));
        CHILD_CHECK_OK(ex.barrier());
        return "";
    };
    auto results = run_1p1d(
        lease, body, testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 64),
        prefill_lease);
    EXPECT_ALL_OK(results);
}

INSTANTIATE_TEST_SUITE_P(Providers, KvReliabilityTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry::kv

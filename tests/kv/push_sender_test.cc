// PushSender's states (PrefillState, SendJobState: docs/PROTOCOL.md, "Prefill rank") after each
// phase of a push. The test thread is the connector thread: it makes the sender's calls and runs
// the write completions only when it chooses, so a job with writes in flight stays so until the
// test lets them end. A bare engine plays the decode rank and records what prefill sends it.
// Pinned: the state each phase leaves, and that a job cancelled, superseded or failed gets no
// further SEGMENT or FINAL (and a cancelled one no FAIL). One process per case, tcp and shm.
#include "kv/push_sender.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>

#include "kv/kv_fixture.h"

namespace ferry::kv {
namespace {

using namespace testing;
using detail::PrefillState;
using detail::SendJobState;

constexpr uint64_t kId = 0x35a0;
constexpr uint32_t kTokens = 40;  // 3 blocks of 16: a first chunk of 16, then the rest

KvLayout small_layout() {
    return testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 64);
}

// A prefill rank's PushSender without a connector thread, and a decode rank that is an engine
// with a pool and a message log.
struct Rig {
    KvRank self{small_layout(), 0, 1};
    std::unique_ptr<TransferEngine> prefill_engine, decode_engine;
    std::vector<uint8_t> prefill_mem, decode_mem;
    std::unique_ptr<MemoryRegion> prefill_mr, decode_mr;
    std::unique_ptr<detail::ConnectorContext> ctx;
    std::unique_ptr<detail::PushSender> sender;
    std::vector<uint32_t> prefill_blocks{5, 9, 2}, decode_blocks{7, 1, 30};

    std::mutex mu;
    std::condition_variable cv;
    std::vector<KvMessage> got;        // what decode received, in order
    std::vector<TransferResult> done;  // on_send_done, in order

    ~Rig() {
        sender.reset();
        ctx.reset();
        prefill_mr.reset();
        prefill_engine.reset();
        decode_mr.reset();
        decode_engine.reset();
    }

    RegisterMsg reg(uint32_t attempt) const {
        RegisterMsg m;
        m.transfer_id = kId;
        m.attempt = attempt;
        m.imm = 0x100 * (attempt + 1);
        m.imm_span = 64;
        m.num_tokens = kTokens;
        m.lease_ms = 10000;
        m.decode_address = decode_engine->address();
        m.pool = {decode_mr->descriptor()};
        m.layout = self.layout;
        m.blocks = decode_blocks;
        return m;
    }
    CancelMsg cancel(uint32_t attempt) const { return CancelMsg{kId, attempt, 0, true}; }

    std::optional<SendJobState> job(uint32_t attempt) const {
        return sender->job_state(kId, attempt, 0);
    }

    // Messages of type T for attempt `attempt` of kId decode got; for SEGMENT, those with
    // `last` as asked.
    template <typename T>
    size_t count(uint32_t attempt, int last = -1) {
        std::lock_guard lk(mu);
        size_t n = 0;
        for (const KvMessage& m : got) {
            const T* t = std::get_if<T>(&m);
            if (!t || t->transfer_id != kId || t->attempt != attempt) continue;
            if constexpr (std::is_same_v<T, SegmentMsg>) {
                if (last >= 0 && t->last.has_value() != (last == 1)) continue;
            }
            ++n;
        }
        return n;
    }

    // Runs the connector's queued work (write completions) until `until` holds.
    Status run_until(const std::function<bool()>& until, std::string_view what) {
        const TimePoint deadline = Clock::now() + kWait;
        while (!until()) {
            if (Clock::now() > deadline)
                return timeout_error(fmt::format("{}: not after 20 s", what));
            std::unique_lock state(ctx->inbox->state_lock());
            for (auto& t : ctx->inbox->take(state, Clock::now() + std::chrono::milliseconds(2)))
                t();
        }
        return ok_status();
    }

    // Everything prefill sent so far has reached decode: a marker sent after it came (one
    // engine's messages to one peer arrive in order). Runs no queued work: writes in flight
    // stay in flight.
    Status flush(uint32_t marker_attempt) {
        auto peer = prefill_engine->connect(decode_engine->address());
        if (!peer.ok()) return peer.status();
        ctx->send(*peer, ScheduledMsg{kId + 1, marker_attempt, 0});
        std::unique_lock lk(mu);
        bool came = cv.wait_for(lk, kWait, [&] {
            for (const KvMessage& m : got) {
                const auto* s = std::get_if<ScheduledMsg>(&m);
                if (s && s->transfer_id == kId + 1 && s->attempt == marker_attempt) return true;
            }
            return false;
        });
        return came ? ok_status() : timeout_error("the marker message did not come in 20 s");
    }

    size_t results() {
        std::lock_guard lk(mu);
        return done.size();
    }
};

Result<std::unique_ptr<Rig>> make_rig(const std::string& provider) {
    auto r = std::make_unique<Rig>();
    const EngineConfig ec = ::ferry::testing::test_engine_config(provider);
    FERRY_ASSIGN_OR_RETURN(r->prefill_engine, TransferEngine::create(ec));
    FERRY_ASSIGN_OR_RETURN(r->decode_engine, TransferEngine::create(ec));
    r->prefill_mem.assign(r->self.layout.pool_bytes(), 0);
    r->decode_mem.assign(r->self.layout.pool_bytes(), kPoison);
    expect_request(r->self, r->prefill_mem, kId, r->prefill_blocks, kTokens);
    FERRY_ASSIGN_OR_RETURN(r->prefill_mr, r->prefill_engine->register_memory(
                                              r->prefill_mem.data(), r->prefill_mem.size()));
    FERRY_ASSIGN_OR_RETURN(r->decode_mr, r->decode_engine->register_memory(r->decode_mem.data(),
                                                                           r->decode_mem.size()));
    Rig* raw = r.get();
    r->decode_engine->set_message_handler([raw](uint64_t, std::span<const uint8_t> bytes) {
        auto m = decode_message(bytes);
        if (!m.ok()) return;
        std::lock_guard lk(raw->mu);
        raw->got.push_back(std::move(*m));
        raw->cv.notify_all();
    });
    ConnectorConfig cc;
    cc.self = r->self;
    cc.lease = std::chrono::seconds(10);
    ConnectorCallbacks cb;
    cb.on_send_done = [raw](const TransferResult& res) {
        std::lock_guard lk(raw->mu);
        raw->done.push_back(res);
    };
    cb.on_send_cancelled = [](const TransferResult&) {};
    r->ctx = std::make_unique<detail::ConnectorContext>(
        r->prefill_engine.get(), KvPoolRegions::one(r->prefill_mr.get()), cc, cb);
    r->sender = std::make_unique<detail::PushSender>(*r->ctx);
    return r;
}

class PushSenderStateTest : public ::testing::TestWithParam<std::string> {};

// Runs `body` in a child process on a fresh rig.
void run_case(const std::function<std::string(Rig&)>& body) {
    const std::string provider = PushSenderStateTest::GetParam();
    auto results = run_processes(
        1,
        [&](Exchange&) -> std::string {
            CHILD_ASSIGN_OK(auto rig, make_rig(provider));
            return body(*rig);
        },
        kRunTimeout);
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

#define CHILD_CHECK_STATE(got, want)                                                      \
    CHILD_CHECK_MSG((got) == (want), "state {}, want {}",                                 \
                    (got) ? std::string(detail::to_string(*(got))) : std::string("none"), \
                    detail::to_string(want))

TEST_P(PushSenderStateTest, ServedPushPassesSendingClosedAndFinishes) {
    run_case([](Rig& r) -> std::string {
        r.sender->on_register(r.reg(1));
        CHILD_CHECK_STATE(r.sender->prefill_state(kId), PrefillState::kQueued);
        CHILD_CHECK_STATE(r.job(1), SendJobState::kSending);
        r.sender->prefill_progress(kId, r.prefill_blocks, KvFrontier{16});
        CHILD_CHECK_STATE(r.sender->prefill_state(kId), PrefillState::kComputing);
        CHILD_CHECK_STATE(r.job(1), SendJobState::kSending);
        r.sender->prefill_done(kId, r.prefill_blocks, kTokens);
        CHILD_CHECK_STATE(r.sender->prefill_state(kId), PrefillState::kDone);
        // The closing SEGMENT went out with its writes in flight.
        CHILD_CHECK_STATE(r.job(1), SendJobState::kClosed);
        CHILD_CHECK(r.results() == 0);
        CHILD_CHECK_OK(r.run_until([&] { return r.results() == 1; }, "the send result"));
        CHILD_CHECK_MSG(r.done[0].status.ok(), "{}", r.done[0].status.to_string());
        // Served: a tombstone that answers late messages, holding no job.
        CHILD_CHECK_STATE(r.sender->prefill_state(kId), PrefillState::kFinished);
        CHILD_CHECK(!r.job(1).has_value());
        CHILD_CHECK_OK(r.flush(1));
        CHILD_CHECK(r.count<SegmentMsg>(1, 0) == 1 && r.count<SegmentMsg>(1, 1) == 1);
        CHILD_CHECK(r.count<FinalMsg>(1) == 0 && r.count<FailMsg>(1) == 0);
        std::vector<uint8_t> image(r.decode_mem.size(), kPoison);
        expect_request(r.self, image, kId, r.decode_blocks, kTokens);
        std::string diff = compare_pool(r.decode_mem, image);
        CHILD_CHECK_MSG(diff.empty(), "{}", diff);
        return "";
    });
}

// CANCEL while a segment's writes are in flight: acknowledged only once they ended, and the
// job gets nothing more, also when prefill_done comes after.
TEST_P(PushSenderStateTest, CancelWithWritesInFlightIsAckedOnceTheyEndAndGetsNoMore) {
    run_case([](Rig& r) -> std::string {
        r.sender->on_register(r.reg(1));
        r.sender->prefill_progress(kId, r.prefill_blocks, KvFrontier{16});
        CHILD_CHECK_STATE(r.job(1), SendJobState::kSending);
        r.sender->on_cancel(0, r.cancel(1));
        CHILD_CHECK_STATE(r.job(1), SendJobState::kCancelling);
        CHILD_CHECK_OK(r.flush(1));
        CHILD_CHECK(r.count<CancelAckMsg>(1) == 0);
        CHILD_CHECK_OK(r.run_until([&] { return r.job(1) == SendJobState::kCancelled; },
                                   "the cancelled job's writes"));
        r.sender->prefill_done(kId, r.prefill_blocks, kTokens);
        CHILD_CHECK(r.results() == 1);
        CHILD_CHECK_MSG(r.done[0].status.code() == StatusCode::kCancelled, "{}",
                        r.done[0].status.to_string());
        CHILD_CHECK_OK(r.flush(2));
        CHILD_CHECK(r.count<CancelAckMsg>(1) == 1);
        CHILD_CHECK_MSG(
            r.count<SegmentMsg>(1) == 1 && r.count<FinalMsg>(1) == 0 && r.count<FailMsg>(1) == 0,
            "decode got {} SEGMENTs, {} FINALs, {} FAILs", r.count<SegmentMsg>(1),
            r.count<FinalMsg>(1), r.count<FailMsg>(1));
        return "";
    });
}

// A newer attempt's REGISTER drops the older job whose writes are in flight: it is answered
// with nothing (decode cancelled it itself) and erased once they ended; the new one is served.
TEST_P(PushSenderStateTest, ANewerAttemptDropsTheOlderJobAndServesItself) {
    run_case([](Rig& r) -> std::string {
        r.sender->on_register(r.reg(1));
        r.sender->prefill_progress(kId, r.prefill_blocks, KvFrontier{16});
        r.sender->on_register(r.reg(2));
        CHILD_CHECK_STATE(r.job(1), SendJobState::kDropping);
        CHILD_CHECK_STATE(r.job(2), SendJobState::kSending);
        CHILD_CHECK_OK(r.run_until([&] { return !r.job(1).has_value(); }, "the old job's writes"));
        r.sender->prefill_done(kId, r.prefill_blocks, kTokens);
        CHILD_CHECK_STATE(r.job(2), SendJobState::kClosed);
        CHILD_CHECK_OK(r.run_until([&] { return r.results() == 1; }, "the send result"));
        CHILD_CHECK_MSG(r.done[0].status.ok() && r.done[0].attempt == 2, "attempt {}: {}",
                        r.done[0].attempt, r.done[0].status.to_string());
        CHILD_CHECK_OK(r.flush(1));
        CHILD_CHECK(r.count<SegmentMsg>(1) == 1);
        CHILD_CHECK(r.count<FinalMsg>(1) == 0 && r.count<FailMsg>(1) == 0 &&
                    r.count<CancelAckMsg>(1) == 0);
        CHILD_CHECK(r.count<SegmentMsg>(2, 1) == 1);
        return "";
    });
}

// abort after prefill_done, the closing SEGMENT's writes in flight: the blocks are reported
// free at once, the job answers FAIL once the writes ended (decode may be counting).
TEST_P(PushSenderStateTest, AbortWithTheClosingWritesInFlightFailsTheJobOnceTheyEnd) {
    run_case([](Rig& r) -> std::string {
        r.sender->on_register(r.reg(1));
        r.sender->prefill_done(kId, r.prefill_blocks, kTokens);
        CHILD_CHECK_STATE(r.job(1), SendJobState::kClosed);
        r.sender->abort(kId, unavailable("the router gave the request up"));
        CHILD_CHECK_STATE(r.sender->prefill_state(kId), PrefillState::kAborted);
        CHILD_CHECK_STATE(r.job(1), SendJobState::kFailing);
        CHILD_CHECK(r.results() == 1);  // reported before the writes ended
        CHILD_CHECK_OK(r.flush(1));
        CHILD_CHECK(r.count<FailMsg>(1) == 0);
        CHILD_CHECK_OK(
            r.run_until([&] { return r.sender->prefill_state(kId) == PrefillState::kFinished; },
                        "the aborted job's writes"));
        CHILD_CHECK(r.results() == 1);  // not reported twice
        CHILD_CHECK_OK(r.flush(2));
        CHILD_CHECK(r.count<FailMsg>(1) == 1 && r.count<SegmentMsg>(1, 1) == 1);
        return "";
    });
}

// prefill_failed with a chunk's writes in flight: FAIL once they ended, then the tombstone
// answers a late REGISTER of a newer attempt with FAIL at once.
TEST_P(PushSenderStateTest, PrefillFailingWithWritesInFlightFailsTheJobOnceTheyEnd) {
    run_case([](Rig& r) -> std::string {
        r.sender->on_register(r.reg(1));
        r.sender->prefill_progress(kId, r.prefill_blocks, KvFrontier{16});
        r.sender->prefill_failed(kId, internal_error("the model step failed"));
        CHILD_CHECK_STATE(r.sender->prefill_state(kId), PrefillState::kFailed);
        CHILD_CHECK_STATE(r.job(1), SendJobState::kFailing);
        CHILD_CHECK_OK(r.run_until([&] { return r.results() == 1; }, "the send result"));
        CHILD_CHECK_STATE(r.sender->prefill_state(kId), PrefillState::kFinished);
        CHILD_CHECK_MSG(r.done[0].status.message().find("model step") != std::string::npos, "{}",
                        r.done[0].status.to_string());
        r.sender->on_register(r.reg(2));
        CHILD_CHECK(!r.job(2).has_value());
        CHILD_CHECK_OK(r.flush(1));
        CHILD_CHECK(r.count<FailMsg>(1) == 1 && r.count<FailMsg>(2) == 1);
        CHILD_CHECK(r.count<SegmentMsg>(1) == 1 && r.count<FinalMsg>(1) == 0);
        return "";
    });
}

// A rank that announced, was scheduled and cancelled before it registered: its job is created
// CANCELLED, so the REGISTER that comes late (posted again after the provider pushed it back)
// writes nothing into blocks decode reused after the CANCEL_ACK.
TEST_P(PushSenderStateTest, ARegisterAfterTheCancelOfAnAnnouncedRankWritesNothing) {
    run_case([](Rig& r) -> std::string {
        r.sender->on_intent(IntentMsg{kId, 1, 0, 1, r.decode_engine->address()});
        CHILD_CHECK_STATE(r.sender->prefill_state(kId), PrefillState::kQueued);
        r.sender->prefill_scheduled(kId);
        CHILD_CHECK_STATE(r.sender->prefill_state(kId), PrefillState::kComputing);
        r.sender->on_cancel(r.decode_engine->engine_id(), r.cancel(1));
        CHILD_CHECK_STATE(r.job(1), SendJobState::kCancelled);
        r.sender->on_register(r.reg(1));
        CHILD_CHECK_STATE(r.job(1), SendJobState::kCancelled);
        r.sender->prefill_progress(kId, r.prefill_blocks, KvFrontier{16});
        r.sender->prefill_done(kId, r.prefill_blocks, kTokens);
        CHILD_CHECK(r.results() == 1);
        CHILD_CHECK_MSG(r.done[0].status.code() == StatusCode::kCancelled, "{}",
                        r.done[0].status.to_string());
        CHILD_CHECK_OK(r.flush(1));
        CHILD_CHECK(r.count<ScheduledMsg>(1) == 1 && r.count<CancelAckMsg>(1) == 1);
        CHILD_CHECK_MSG(r.count<SegmentMsg>(1) == 0 && r.count<FinalMsg>(1) == 0,
                        "decode got {} SEGMENTs, {} FINALs", r.count<SegmentMsg>(1),
                        r.count<FinalMsg>(1));
        const std::vector<uint8_t> untouched(r.decode_mem.size(), kPoison);
        std::string diff = compare_pool(r.decode_mem, untouched);
        CHILD_CHECK_MSG(diff.empty(), "{}", diff);
        return "";
    });
}

INSTANTIATE_TEST_SUITE_P(Providers, PushSenderStateTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry::kv

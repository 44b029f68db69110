// The SEGMENT that closes a push (protocol version 6; sent once the writes are posted since
// version 7): the segment that completes the prompt announces itself and ends the transfer in
// one message, where version 5 sent SEGMENT and then FINAL. Decode must treat it exactly as that
// pair: bytes intact, a cancel racing it resolved safely, duplicates and stale copies ignored
// and counted, truncated ones refused. Real processes on tcp and shm; a hand-driven producer (an
// engine without a connector) sends the messages a connector would never send.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include "kv/kv_fixture.h"

namespace ferry::kv {
namespace {

using namespace testing;

class KvClosingSegmentTest : public ::testing::TestWithParam<std::string> {};

#define EXPECT_ALL_OK(results) EXPECT_EQ(::ferry::testing::describe_failures(results), "")

KvLayout small_layout() {
    return testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 64);
}

// 1 prefill rank (process 0) and 1 decode rank (process 1), each with a connector; nothing held
// or leaked once `body` returned.
std::vector<::ferry::testing::ChildResult> run_1p1d(
    const KvLayout& layout, uint64_t seed,
    const std::function<std::string(Exchange&, KvNode&, bool prefill)>& body,
    NodeOptions opt = {}) {
    opt.provider = ::testing::TestWithParam<std::string>::GetParam();
    return run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            const bool prefill = ex.rank() == kPrefill;
            CHILD_ASSIGN_OK(auto node, make_kv_node(ex, KvRank{layout, 0, 1}, opt, seed,
                                                    prefill ? 0 : kPoison));
            std::string e = body(ex, *node, prefill);
            if (e.empty()) e = testing::check_no_leak(*node);
            if (!e.empty()) return e;
            CHILD_CHECK_OK(ex.barrier());
            return "";
        },
        kRunTimeout);
}

// How prefill hands a request's KV over, and the messages decode gets for it (version 5 sent
// one more in the first two: the FINAL after the last SEGMENT).
enum class Shape {
    kOneSegment,     // prefill_done only: one closing SEGMENT (was SEGMENT + FINAL)
    kTwoSegments,    // a chunk, then prefill_done: SEGMENT + closing SEGMENT (was + FINAL)
    kFinalAfterAll,  // every token by prefill_progress, drained, then prefill_done: SEGMENT,
                     // then a plain FINAL (nothing left to close with)
};

uint64_t messages_for(Shape s) { return s == Shape::kOneSegment ? 1 : 2; }

TEST_P(KvClosingSegmentTest, LastSegmentAndFinalInOneMessageDeliverEveryByte) {
    uint64_t seed = ::ferry::testing::test_seed("KvClosingSegment.OneMessage");
    std::mt19937_64 rng(seed);
    struct Req {
        uint64_t id;
        uint32_t tokens;
        Shape shape;
    };
    std::vector<Req> reqs;
    for (int i = 0; i < 9; ++i) {
        Shape s = static_cast<Shape>(i % 3);
        // 2..190 tokens: partial last blocks, and a chunk of at least one token.
        reqs.push_back(
            {0x6000 + static_cast<uint64_t>(i), 2 + static_cast<uint32_t>(rng() % 189), s});
    }
    auto results =
        run_1p1d(small_layout(), seed, [&](Exchange& ex, KvNode& n, bool prefill) -> std::string {
            std::vector<uint8_t> image(n.mem.size(), kPoison);
            uint64_t expect_messages = 0;
            for (size_t i = 0; i < reqs.size(); ++i) {
                const Req& r = reqs[i];
                CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(blocks_for_tokens(r.tokens, 16)));
                if (!prefill) {
                    CHILD_CHECK_OK(
                        n.conn->register_push({r.id, 1, {n.addrs[kPrefill]}, blocks, r.tokens}));
                } else {
                    CHILD_CHECK_OK(testing::wait_messages(n, i + 1, kWait));  // the REGISTER
                    testing::fill_request(n, r.id, blocks, r.tokens);
                    if (r.shape == Shape::kTwoSegments)
                        CHILD_CHECK_OK(n.conn->prefill_progress(r.id, blocks, r.tokens / 2));
                    if (r.shape == Shape::kFinalAfterAll)
                        CHILD_CHECK_OK(n.conn->prefill_progress(r.id, blocks, r.tokens));
                }
                CHILD_CHECK_OK(ex.barrier());
                // Every token's segment counted on decode, so prefill_done finds nothing left.
                if (!prefill && r.shape == Shape::kFinalAfterAll)
                    CHILD_CHECK_OK(testing::wait_progress(n, r.id, r.tokens, kWait));
                CHILD_CHECK_OK(ex.barrier());
                if (prefill) CHILD_CHECK_OK(n.conn->prefill_done(r.id, blocks, r.tokens));
                CHILD_ASSIGN_OK(auto res, n.results.wait(prefill, r.id, kWait));
                CHILD_CHECK_MSG(res.status.ok(), "transfer {:x}: {}", r.id, res.status.to_string());
                CHILD_CHECK(res.writes > 0 && res.bytes > 0);
                if (!prefill) {
                    expect_messages += messages_for(r.shape);
                    ConnectorStats s = n.conn->stats();
                    CHILD_CHECK_MSG(s.messages_received == expect_messages,
                                    "transfer {:x} (shape {}): decode got {} messages in all, "
                                    "want {}",
                                    r.id, static_cast<int>(r.shape), s.messages_received,
                                    expect_messages);
                    testing::expect_request(n.self, image, r.id, blocks, r.tokens);
                    std::string diff = testing::compare_pool(n.mem, image);
                    CHILD_CHECK_MSG(diff.empty(), "transfer {:x}: {}", r.id, diff);
                }
                // A later request may reuse the blocks: the image keeps what each write left.
                CHILD_CHECK_OK(n.blocks->free(blocks));
                CHILD_CHECK_OK(ex.barrier());
            }
            ConnectorStats s = n.conn->stats();
            CHILD_CHECK_MSG(s.messages_malformed == 0 && s.messages_stale == 0,
                            "{} malformed, {} stale", s.messages_malformed, s.messages_stale);
            return "";
        });
    EXPECT_ALL_OK(results);
}

// Decode cancels at a random moment around the end of the writes, so that the CANCEL races
// the closing SEGMENT: the transfer ends either complete (every byte right) or cancelled, and
// blocks reused right after the result never see a late write.
TEST_P(KvClosingSegmentTest, CancelRacingTheClosingSegmentNeverWritesReusedBlocks) {
    uint64_t seed = ::ferry::testing::test_seed("KvClosingSegment.CancelRace");
    KvLayout big = testing::test_layout(4, 16, BlockOrder::kHND, KvPlacement::kSeparate, 64);
    big.num_layers = 24;
    big.head_dim = 128;
    const uint32_t kTokens = 512;  // 12 MiB per request
    auto results = run_1p1d(big, seed, [&](Exchange& ex, KvNode& n, bool prefill) -> std::string {
        std::mt19937_64 rng(seed);
        std::vector<uint8_t> image(n.mem.size(), kPoison);
        int done_ok = 0;
        // The first two transfers are not cancelled: the second one's time (connections up)
        // places the later cancels around the end of the writes (0.2x to 1.2x of it).
        Duration whole{};
        for (uint64_t id = 0x7200; id < 0x720c; ++id) {
            const bool cancel = id >= 0x7202;
            const auto delay = whole * (0.2 + static_cast<double>(rng() % 1000) / 1000);
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(kTokens / 16));
            if (prefill) {
                testing::fill_request(n, id, blocks, kTokens);
                CHILD_CHECK_OK(n.conn->prefill_done(id, blocks, kTokens));
            }
            CHILD_CHECK_OK(ex.barrier());
            if (!prefill) {
                CHILD_CHECK_OK(
                    n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, kTokens}));
                TimePoint t0 = Clock::now();
                if (cancel) {
                    std::this_thread::sleep_for(delay);
                    CHILD_CHECK_OK(n.conn->cancel(id));
                }
                CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
                if (!cancel) whole = Clock::now() - t0;
                CHILD_CHECK_MSG(
                    r.status.ok() || (cancel && r.status.code() == StatusCode::kCancelled),
                    "transfer {:x}: {}", id, r.status.to_string());
                if (r.status.ok()) {
                    done_ok += cancel;
                    testing::expect_request(n.self, image, id, blocks, kTokens);
                    std::string diff = testing::compare_pool(n.mem, image);
                    CHILD_CHECK_MSG(diff.empty(), "transfer {:x} completed: {}", id, diff);
                }
                // Reused at once: another request's bytes, which must survive.
                for (uint32_t b : blocks)
                    for (uint32_t l = 0; l < big.num_layers; ++l)
                        for (KvPart part : {KvPart::kK, KvPart::kV}) {
                            uint64_t off = big.slab_offset(l, part, b);
                            std::memset(n.mem.data() + off, 0x3c, big.slab_bytes());
                            std::memset(image.data() + off, 0x3c, big.slab_bytes());
                        }
            } else {
                CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, kWait));
                CHILD_CHECK_MSG(r.status.ok() || r.status.code() == StatusCode::kCancelled,
                                "transfer {:x}: {}", id, r.status.to_string());
            }
            CHILD_CHECK_OK(ex.barrier());  // prefill's writes for id all completed
            if (!prefill) {
                std::this_thread::sleep_for(std::chrono::milliseconds(20));
                std::string diff = testing::compare_pool(n.mem, image);
                CHILD_CHECK_MSG(diff.empty(), "after transfer {:x} ended: {}", id, diff);
            }
            CHILD_CHECK_OK(n.blocks->free(blocks));
        }
        if (!prefill)
            std::fprintf(stderr, "%d of 10 cancelled transfers completed first\n", done_ok);
        CHILD_CHECK(n.conn->stats().messages_malformed == 0);
        return "";
    });
    EXPECT_ALL_OK(results);
}

// Decode with room for two spans of immediates: a third registration while two transfers hold
// them is refused (kResourceExhausted) instead of sharing a span, and once they ended their
// spans serve new ones.
TEST_P(KvClosingSegmentTest, ImmediateSpansAreNotReusedWhileHeld) {
    uint64_t seed = ::ferry::testing::test_seed("KvClosingSegment.Spans");
    NodeOptions opt;
    opt.imm_span = 4;
    opt.imm_count = 8;
    const uint32_t kTokens = 20;
    auto results = run_1p1d(
        small_layout(), seed,
        [&](Exchange& ex, KvNode& n, bool prefill) -> std::string {
            std::vector<std::vector<uint32_t>> blocks;
            for (int i = 0; i < 4; ++i) {
                CHILD_ASSIGN_OK(auto b, n.blocks->allocate(blocks_for_tokens(kTokens, 16)));
                blocks.push_back(std::move(b));
            }
            if (!prefill) {
                for (uint64_t i = 0; i < 3; ++i) {
                    CHILD_CHECK_OK(n.conn->register_push(
                        {0x7300 + i, 1, {n.addrs[kPrefill]}, blocks[i], kTokens}));
                }
                CHILD_ASSIGN_OK(auto r, n.results.wait(false, 0x7302, kWait));
                CHILD_CHECK_MSG(r.status.code() == StatusCode::kResourceExhausted &&
                                    r.status.message().find("immediate spans") != std::string::npos,
                                "third registration: {}", r.status.to_string());
            } else {
                CHILD_CHECK_OK(testing::wait_messages(n, 2, kWait));
            }
            CHILD_CHECK_OK(ex.barrier());
            if (prefill) {
                for (uint64_t i = 0; i < 2; ++i) {
                    testing::fill_request(n, 0x7300 + i, blocks[i], kTokens);
                    CHILD_CHECK_OK(n.conn->prefill_done(0x7300 + i, blocks[i], kTokens));
                }
            }
            std::vector<uint8_t> image(n.mem.size(), kPoison);
            for (uint64_t i = 0; i < 2; ++i) {
                CHILD_ASSIGN_OK(auto r, n.results.wait(prefill, 0x7300 + i, kWait));
                CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
                if (!prefill)
                    testing::expect_request(n.self, image, 0x7300 + i, blocks[i], kTokens);
            }
            CHILD_CHECK_OK(ex.barrier());
            // Both spans are free again.
            if (!prefill) {
                CHILD_CHECK_OK(
                    n.conn->register_push({0x7303, 1, {n.addrs[kPrefill]}, blocks[3], kTokens}));
            } else {
                CHILD_CHECK_OK(testing::wait_messages(n, 3, kWait));
                testing::fill_request(n, 0x7303, blocks[3], kTokens);
                CHILD_CHECK_OK(n.conn->prefill_done(0x7303, blocks[3], kTokens));
            }
            CHILD_ASSIGN_OK(auto r, n.results.wait(prefill, 0x7303, kWait));
            CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
            if (!prefill) {
                testing::expect_request(n.self, image, 0x7303, blocks[3], kTokens);
                std::string diff = testing::compare_pool(n.mem, image);
                CHILD_CHECK_MSG(diff.empty(), "{}", diff);
            }
            for (auto& b : blocks) CHILD_CHECK_OK(n.blocks->free(b));
            return "";
        },
        opt);
    EXPECT_ALL_OK(results);
}

// A producer driven by hand: an engine without a connector that answers a REGISTER with the
// writes and the messages the test chooses, in the order it chooses.
struct HandProducer {
    KvRank self{small_layout(), 0, 1};
    std::unique_ptr<TransferEngine> engine;
    std::vector<uint8_t> mem;
    std::unique_ptr<MemoryRegion> mr;
    BlockPool pool{small_layout().num_blocks};
    std::mutex mu;
    std::condition_variable cv;
    std::deque<RegisterMsg> regs;
    int cancels = 0;  // CANCELs received

    struct Job {
        RegisterMsg reg;
        PeerId peer = 0;
        TransferPlan plan;
        SegmentMsg closing;  // one segment of every token, closing the transfer
    };

    // The next REGISTER, the request's KV in fresh blocks of this pool, and its plan.
    Result<Job> next_job() {
        Job j;
        {
            std::unique_lock lk(mu);
            if (!cv.wait_for(lk, kWait, [&] { return !regs.empty(); }))
                return timeout_error("no REGISTER came");
            j.reg = std::move(regs.front());
            regs.pop_front();
        }
        FERRY_ASSIGN_OR_RETURN(j.peer, engine->connect(j.reg.decode_address));
        const uint32_t tokens = j.reg.num_tokens;
        FERRY_ASSIGN_OR_RETURN(auto blocks, pool.allocate(blocks_for_tokens(tokens, 16)));
        testing::expect_request(self, mem, j.reg.transfer_id, blocks, tokens);
        KvRank dst{j.reg.layout, j.reg.decode_rank, j.reg.decode_tp};
        FERRY_ASSIGN_OR_RETURN(j.plan, plan_transfer({self, blocks, dst, j.reg.blocks, 0, tokens}));
        // Runs of a few KiB: one write (one immediate) each.
        auto writes = static_cast<uint32_t>(j.plan.runs.size());
        j.closing = SegmentMsg{j.reg.transfer_id,
                               j.reg.attempt,
                               0,
                               0,
                               0,
                               tokens,
                               writes,
                               j.plan.bytes,
                               0,
                               0,
                               JobTotals{writes, j.plan.bytes, 1}};
        return j;
    }

    // The writes of segment 0, with its immediate; done once they completed.
    Status write(const Job& j) {
        OpHandle h = engine->write_runs({j.peer, mr.get(), &j.reg.pool[0], j.plan.runs, j.reg.imm});
        FERRY_RETURN_IF_ERROR(h.wait(kWait));
        if (h.imm_writes() != j.closing.writes) {
            return internal_error(
                fmt::format("{} writes carried the immediate, the SEGMENT says {}", h.imm_writes(),
                            j.closing.writes));
        }
        return ok_status();
    }

    Status send(const Job& j, const std::vector<uint8_t>& bytes) {
        return engine->send_message(j.peer, bytes).wait(kWait);
    }

    Status wait_cancels(int n) {
        std::unique_lock lk(mu);
        if (!cv.wait_for(lk, kWait, [&] { return cancels >= n; }))
            return timeout_error(fmt::format("{} CANCELs came, want {}", cancels, n));
        return ok_status();
    }
};

Result<std::unique_ptr<HandProducer>> make_hand_producer(Exchange& ex,
                                                         const std::string& provider) {
    auto h = std::make_unique<HandProducer>();
    // One fabric operation per run (EngineConfig::rma_iovs), so that the closing SEGMENT,
    // which this producer may send before the writes, can count them in advance.
    EngineConfig config = ::ferry::testing::test_engine_config(provider);
    config.rma_iovs = 1;
    FERRY_ASSIGN_OR_RETURN(h->engine, TransferEngine::create(config));
    h->mem.assign(h->self.layout.pool_bytes(), 0);
    FERRY_ASSIGN_OR_RETURN(h->mr, h->engine->register_memory(h->mem.data(), h->mem.size()));
    HandProducer* raw = h.get();
    h->engine->set_message_handler([raw](uint64_t, std::span<const uint8_t> bytes) {
        auto m = decode_message(bytes);
        if (!m.ok()) return;
        std::lock_guard lk(raw->mu);
        if (std::holds_alternative<CancelMsg>(*m)) raw->cancels++;
        if (std::holds_alternative<RegisterMsg>(*m))
            raw->regs.push_back(std::get<RegisterMsg>(std::move(*m)));
        raw->cv.notify_all();
    });
    // Both processes exchange addresses once, as make_kv_node does.
    FERRY_RETURN_IF_ERROR(ex.allgather(h->engine->address().serialize()).status());
    return h;
}

// The decode rank facing a hand-driven producer: a connector on the small layout, pool poisoned.
Result<std::unique_ptr<KvNode>> make_hand_decode(Exchange& ex, const std::string& provider,
                                                 uint64_t seed) {
    NodeOptions opt;
    opt.provider = provider;
    return make_kv_node(ex, KvRank{small_layout(), 0, 1}, opt, seed, kPoison);
}

// Decode counts a closing SEGMENT once. A: its writes landed; a copy cut short is malformed,
// one of another attempt and one after the transfer ended are stale. B: it comes before any
// write, with a copy: decode waits for the immediates once and the copy is stale. Neither
// changes a result, and decode's blocks hold the producer's bytes.
TEST_P(KvClosingSegmentTest, StaleDuplicateAndTruncatedClosingSegmentsAreDropped) {
    uint64_t seed = ::ferry::testing::test_seed("KvClosingSegment.Stale");
    const std::string provider = GetParam();
    const uint32_t kTokens[2] = {1 + static_cast<uint32_t>(seed % 150), 21};
    const uint64_t kIds[2] = {0x7100, 0x7101};
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            if (ex.rank() == kPrefill) {
                CHILD_ASSIGN_OK(auto h, make_hand_producer(ex, provider));
                CHILD_ASSIGN_OK(auto a, h->next_job());
                CHILD_CHECK_OK(h->write(a));
                auto cut = encode_message(a.closing);
                cut.resize(cut.size() - 5);  // inside the totals
                CHILD_CHECK_OK(h->send(a, cut));
                SegmentMsg other = a.closing;
                other.attempt = a.reg.attempt + 5;
                CHILD_CHECK_OK(h->send(a, encode_message(other)));
                CHILD_CHECK_OK(h->send(a, encode_message(a.closing)));
                CHILD_CHECK_OK(ex.barrier());  // 1: decode completed A
                CHILD_CHECK_OK(h->send(a, encode_message(a.closing)));
                CHILD_CHECK_OK(ex.barrier());  // 2
                CHILD_ASSIGN_OK(auto b, h->next_job());
                CHILD_CHECK_OK(h->send(b, encode_message(b.closing)));
                CHILD_CHECK_OK(h->send(b, encode_message(b.closing)));
                CHILD_CHECK_OK(ex.barrier());  // 3: decode counted the copy, still waits
                CHILD_CHECK_OK(h->write(b));
                CHILD_CHECK_OK(ex.barrier());  // 4: decode completed B
                return "";
            }
            CHILD_ASSIGN_OK(auto node, make_hand_decode(ex, provider, seed));
            KvNode& n = *node;
            std::vector<uint8_t> image(n.mem.size(), kPoison);
            auto wait_counts = [&](uint64_t malformed, uint64_t stale) -> std::string {
                TimePoint until = Clock::now() + kWait;
                ConnectorStats s = n.conn->stats();
                while ((s.messages_malformed < malformed || s.messages_stale < stale) &&
                       Clock::now() < until) {
                    std::this_thread::sleep_for(std::chrono::milliseconds(1));
                    s = n.conn->stats();
                }
                CHILD_CHECK_MSG(s.messages_malformed == malformed && s.messages_stale == stale,
                                "{} malformed (want {}), {} stale (want {})", s.messages_malformed,
                                malformed, s.messages_stale, stale);
                return "";
            };
            auto complete = [&](int i, const std::vector<uint32_t>& blocks) -> std::string {
                CHILD_ASSIGN_OK(auto r, n.results.wait(false, kIds[i], kWait));
                CHILD_CHECK_MSG(r.status.ok(), "transfer {:x}: {}", kIds[i], r.status.to_string());
                testing::expect_request(n.self, image, kIds[i], blocks, kTokens[i]);
                std::string diff = testing::compare_pool(n.mem, image);
                CHILD_CHECK_MSG(diff.empty(), "transfer {:x}: {}", kIds[i], diff);
                CHILD_CHECK_OK(n.blocks->free(blocks));
                return "";
            };
            std::string e;
            CHILD_ASSIGN_OK(auto blocks_a, n.blocks->allocate(blocks_for_tokens(kTokens[0], 16)));
            CHILD_CHECK_OK(
                n.conn->register_push({kIds[0], 1, {n.addrs[kPrefill]}, blocks_a, kTokens[0]}));
            if (!(e = complete(0, blocks_a)).empty()) return e;
            if (!(e = wait_counts(1, 1)).empty()) return e;  // the cut one, the other attempt's
            CHILD_CHECK_OK(ex.barrier());                    // 1
            CHILD_CHECK_OK(ex.barrier());                    // 2
            if (!(e = wait_counts(1, 2)).empty()) return e;  // the copy after the end
            CHILD_ASSIGN_OK(auto blocks_b, n.blocks->allocate(blocks_for_tokens(kTokens[1], 16)));
            CHILD_CHECK_OK(
                n.conn->register_push({kIds[1], 1, {n.addrs[kPrefill]}, blocks_b, kTokens[1]}));
            if (!(e = wait_counts(1, 3)).empty()) return e;  // the copy while B waits
            CHILD_CHECK(n.conn->stats().transfers_received == 1);
            CHILD_CHECK_OK(ex.barrier());  // 3
            if (!(e = complete(1, blocks_b)).empty()) return e;
            CHILD_CHECK_OK(ex.barrier());  // 4
            CHILD_CHECK(n.conn->stats().transfers_received == 2);
            return testing::check_no_leak(n);
        },
        kRunTimeout);
    EXPECT_ALL_OK(results);
}

// Since version 7 the closing SEGMENT goes out when the writes are posted, so it no longer says
// they ended: a decode that cancels around it must hold its blocks until the CANCEL_ACK (version
// 6 completed a cancelling slot on the closing SEGMENT, and the writes still in flight here would
// have landed in blocks the engine was told it could reuse). Both orders: the CANCEL before the
// closing SEGMENT comes, and after.
TEST_P(KvClosingSegmentTest, CancelAroundTheClosingSegmentWaitsForTheAck) {
    uint64_t seed = ::ferry::testing::test_seed("KvClosingSegment.CancelAroundClose");
    const std::string provider = GetParam();
    const uint32_t kTokens = 1 + static_cast<uint32_t>(seed % 150);
    const uint64_t kIds[2] = {0x7400, 0x7401};  // cancel first; closing SEGMENT first
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            if (ex.rank() == kPrefill) {
                CHILD_ASSIGN_OK(auto h, make_hand_producer(ex, provider));
                for (int i = 0; i < 2; ++i) {
                    CHILD_ASSIGN_OK(auto a, h->next_job());
                    if (i == 0) CHILD_CHECK_OK(h->wait_cancels(1));
                    CHILD_CHECK_OK(h->send(a, encode_message(a.closing)));  // writes in flight
                    if (i == 1) CHILD_CHECK_OK(h->wait_cancels(2));
                    CHILD_CHECK_OK(ex.barrier());  // decode saw no result for 300 ms
                    CHILD_CHECK_OK(h->write(a));   // the writes end, then the acknowledgement
                    CHILD_CHECK_OK(h->send(
                        a, encode_message(CancelAckMsg{a.reg.transfer_id, a.reg.attempt, 0})));
                    CHILD_CHECK_OK(ex.barrier());
                }
                return "";
            }
            CHILD_ASSIGN_OK(auto node, make_hand_decode(ex, provider, seed));
            KvNode& n = *node;
            auto wait_received = [&](uint64_t want) {
                TimePoint until = Clock::now() + kWait;
                while (n.conn->stats().messages_received < want && Clock::now() < until)
                    std::this_thread::sleep_for(std::chrono::milliseconds(1));
                return n.conn->stats().messages_received >= want;
            };
            for (int i = 0; i < 2; ++i) {
                const uint64_t id = kIds[i];
                CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(blocks_for_tokens(kTokens, 16)));
                CHILD_CHECK_OK(
                    n.conn->register_push({id, 1, {n.addrs[kPrefill]}, blocks, kTokens}));
                if (i == 0) CHILD_CHECK_OK(n.conn->cancel(id));
                CHILD_CHECK_MSG(wait_received(i + 1), "the closing SEGMENT of {:x} never came", id);
                if (i == 1) CHILD_CHECK_OK(n.conn->cancel(id));
                auto early = n.results.wait(false, id, std::chrono::milliseconds(300));
                CHILD_CHECK_MSG(!early.ok(),
                                "transfer {:x} ended before prefill acknowledged the cancel: {}",
                                id, early->status.to_string());
                CHILD_CHECK_OK(ex.barrier());
                CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, kWait));
                CHILD_CHECK_MSG(r.status.code() == StatusCode::kCancelled, "transfer {:x}: {}", id,
                                r.status.to_string());
                CHILD_CHECK_OK(ex.barrier());
                CHILD_CHECK_OK(n.blocks->free(blocks));
            }
            return testing::check_no_leak(n);
        },
        kRunTimeout);
    EXPECT_ALL_OK(results);
}

INSTANTIATE_TEST_SUITE_P(Providers, KvClosingSegmentTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry::kv

// The CUDA all-to-all's host proxy between real processes, without a GPU: the test plays the
// kernels (bytes into the outbox, then a published record; reads of the inbox, which kernels
// map), so what arrives in the inbox and when each arrival counter there moves is checked
// exactly, over tcp and shm, with writes split into many pieces.
#include "moe/device_proxy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "ferry/fabric/engine.h"
#include "ferry/moe/config.h"
#include "ferry/moe/host_proxy.h"
#include "support/engine_fixture.h"
#include "support/multiproc.h"

namespace ferry::moe {
namespace {

using ferry::testing::Exchange;

constexpr uint64_t kCountsBytes = 64;
constexpr uint64_t kDispatchBlocks = 3, kCombineBlocks = 5;
constexpr uint8_t kPoison = 0xee;
constexpr uint32_t kStreamMaxPieces = 64;

// Room for every sender's runs of puts_of (the counts messages up to world 12).
SharedLayout test_layout(uint32_t world) {
    SharedLayout l;
    l.ctr_counts = 0;
    l.ctr_dispatch = 8ull * world;
    l.ctr_combine = 16ull * world;
    l.counts = 256;
    l.dispatch = 1024;
    l.combine = l.dispatch + 8192 + 16384ull * world;
    l.total = l.combine + 40000ull * world;
    return l;
}

// One rank: engine, inbox (the mesh buffer), outbox slabs, published records, proxy.
struct ProxyRank {
    uint32_t rank = 0, world = 0;
    SharedLayout lay;
    uint64_t slab = 0;
    ferry::testing::MeshNode mesh;
    std::vector<uint8_t> outbox;
    std::unique_ptr<MemoryRegion> outbox_mr;
    std::vector<proxy::Publish> publish;
    std::vector<uint32_t> stream_ready;  // [world][kStreamMaxPieces] piece flags
    uint64_t stream_piece = 0;           // DeviceProxySetup::stream_piece_bytes
    std::unique_ptr<DeviceProxy> proxy;
    std::vector<bool> remote;  // [world] ranks on other nodes, reached through the proxy

    uint8_t* outbox_of(uint32_t peer) { return outbox.data() + slab * peer; }

    // What a kernel does: bytes into the peer's outbox, then the record, call number last.
    void put(uint32_t peer, uint32_t part, uint32_t seq, uint64_t offset, uint64_t len,
             uint8_t fill) {
        std::memset(outbox_of(peer) + offset, fill, len);
        publish_only(peer, part, seq, offset, len);
    }
    void publish_only(uint32_t peer, uint32_t part, uint32_t seq, uint64_t offset, uint64_t len,
                      bool streamed = false) {
        volatile proxy::Publish& p = publish[size_t{peer} * proxy::kParts + part];
        p.offset = offset;
        p.len = len;
        p.streamed = streamed ? 1 : 0;
        std::atomic_thread_fence(std::memory_order_release);
        p.seq = seq;
    }
    // What the streamed combine kernel does once piece i of a put published streamed is in the
    // outbox: its bytes, then its flag.
    void stream_piece_ready(uint32_t peer, uint32_t seq, uint64_t offset, uint64_t len, uint32_t i,
                            uint8_t fill) {
        const uint64_t at = i * stream_piece, n = std::min(stream_piece, len - at);
        std::memset(outbox_of(peer) + offset + at, fill, n);
        std::atomic_ref<uint32_t>(stream_ready[size_t{peer} * kStreamMaxPieces + i])
            .store(seq, std::memory_order_release);
    }
    // What kernels read: the inbox, its counters (acquire) and its abort word.
    const uint8_t* inbox() const { return mesh.buf.data(); }
    uint64_t counter(uint64_t offset, uint32_t sender) {
        return std::atomic_ref<uint64_t>(
                   *reinterpret_cast<uint64_t*>(mesh.buf.data() + offset + 8ull * sender))
            .load(std::memory_order_acquire);
    }
    // The inbox's piece word of `sender` (acquire): (call << 32) | pieces of its combine in.
    uint64_t piece_word(uint32_t sender) {
        return std::atomic_ref<uint64_t>(
                   *reinterpret_cast<uint64_t*>(mesh.buf.data() +
                                                proxy_piece_word_offset(lay, world, sender)))
            .load(std::memory_order_acquire);
    }
    bool aborted() {
        return std::atomic_ref<uint32_t>(
                   *reinterpret_cast<uint32_t*>(mesh.buf.data() + proxy_abort_offset(lay, world)))
                   .load(std::memory_order_acquire) != 0;
    }
};

// ranks_per_node 0: every other rank is remote. chunk_bytes, stream_piece: DeviceProxySetup's
// chunk_bytes and stream_piece_bytes (0: streamed puts refused).
Result<std::unique_ptr<ProxyRank>> make_rank(Exchange& ex, const EngineConfig& ec,
                                             uint32_t ranks_per_node = 0, uint64_t chunk_bytes = 0,
                                             uint64_t stream_piece = 0) {
    auto r = std::make_unique<ProxyRank>();
    r->rank = static_cast<uint32_t>(ex.rank());
    r->world = static_cast<uint32_t>(ex.size());
    r->lay = test_layout(r->world);
    r->slab = proxy_inbox_bytes(r->lay, r->world);
    FERRY_ASSIGN_OR_RETURN(r->mesh, ferry::testing::make_mesh_node(ex, ec, r->slab, kPoison));
    // One slab per rank (the own one unused) keeps the indexing plain.
    r->outbox.assign(r->slab * r->world, 0);
    FERRY_ASSIGN_OR_RETURN(r->outbox_mr,
                           r->mesh.engine->register_memory(r->outbox.data(), r->outbox.size()));
    r->publish.assign(size_t{r->world} * proxy::kParts, proxy::Publish{});
    r->stream_ready.assign(size_t{r->world} * kStreamMaxPieces, 0);
    r->stream_piece = stream_piece;
    // Zeroed like the real inbox (the rest stays poisoned); nobody puts before the proxies run.
    std::memset(r->mesh.buf.data(), 0, 24ull * r->world);  // the counters
    std::memset(r->mesh.buf.data() + proxy_abort_offset(r->lay, r->world), 0, 4);
    std::memset(r->mesh.buf.data() + proxy_piece_word_offset(r->lay, r->world, 0), 0,
                8ull * r->world);
    DeviceProxySetup s;
    s.engine = r->mesh.engine.get();
    s.rank = r->rank;
    s.world = r->world;
    s.imm_base = 0x6d670000;
    s.layout = r->lay;
    s.counts_bytes = kCountsBytes;
    s.dispatch_blocks = kDispatchBlocks;
    s.combine_blocks = kCombineBlocks;
    s.timeout = std::chrono::seconds(5);
    s.chunk_bytes = chunk_bytes;
    const uint32_t rpn = ranks_per_node ? ranks_per_node : 1;
    for (uint32_t p = 0; p < r->world; ++p) s.remote.push_back(p / rpn != r->rank / rpn);
    r->remote = s.remote;
    s.peer = r->mesh.peer;
    s.inbox = r->mesh.desc;
    s.publish = r->publish.data();
    if (stream_piece) {
        s.stream_ready = r->stream_ready.data();
        s.stream_piece_bytes = stream_piece;
        s.stream_max_pieces = kStreamMaxPieces;
    }
    s.outbox = r->outbox_mr.get();
    for (uint32_t p = 0; p < r->world; ++p) s.outbox_offset.push_back(r->slab * p);
    s.inbox_data = r->mesh.buf.data();
    r->proxy = std::make_unique<DeviceProxy>(std::move(s));
    r->proxy->start();
    return r;
}

// The puts sender s makes to rank d in call c: every rank derives the same. Senders' runs do
// not overlap (test_layout makes room for them).
struct CallPuts {
    uint64_t private_len, overflow_at, overflow_len, combine_at, combine_len;
};
CallPuts puts_of(uint64_t seed, uint32_t s, uint32_t d, uint32_t c, const SharedLayout& l) {
    std::mt19937_64 rng(seed ^ (uint64_t{s} << 40) ^ (uint64_t{d} << 32) ^ c);
    CallPuts p;
    // Zero-length parts on some calls: they must still complete the call.
    p.private_len = rng() % 4 == 0 ? 0 : rng() % 2048;
    p.overflow_at = l.dispatch + 8192 + s * 16384 + rng() % 1024;
    p.overflow_len = rng() % 3 == 0 ? 0 : rng() % 12000;
    p.combine_at = l.combine + s * 40000 + rng() % 1000;
    p.combine_len = rng() % 28000;
    return p;
}

uint8_t fill_of(uint32_t s, uint32_t c, uint32_t part) {
    return static_cast<uint8_t>(1 + s * 37 + c * 11 + part * 3);
}

bool all_equal(const uint8_t* p, uint64_t len, uint8_t v) {
    for (uint64_t i = 0; i < len; ++i)
        if (p[i] != v) return false;
    return true;
}

template <typename Pred>
bool wait_for(Pred pred, Duration timeout) {
    TimePoint deadline = deadline_after(timeout);
    while (!pred()) {
        if (Clock::now() > deadline) return pred();
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return true;
}

// streamed: the combine parts are published first and their pieces made ready afterwards in
// a random order, as the streamed combine kernel does.
std::string run_calls(Exchange& ex, const std::string& provider, bool split,
                      uint32_t ranks_per_node, uint64_t seed, bool streamed = false) {
    EngineConfig ec = ferry::testing::test_engine_config(provider);
    if (split) {
        ec.num_rails = 2;
        ec.stripe_threshold = 2048;
        ec.max_write_size = 4096;
    }
    // Split runs also cut puts into several proxy writes (of several engine pieces each: the
    // record must count them all); shm at world 3 cuts them into single-piece writes.
    const uint64_t chunk = split ? 3000 : provider == "shm" && ex.size() == 3 ? 5000 : 0;
    // Pieces that a proxy chunk cuts again (split), or one write each.
    const uint64_t piece = !streamed ? 0 : split ? 4500 : 1000;
    CHILD_ASSIGN_OK(auto r, make_rank(ex, ec, ranks_per_node, chunk, piece));
    std::mt19937_64 order_rng(seed ^ 0x5eed ^ ex.rank());
    if (split) CHILD_CHECK(write_pieces(r->mesh.engine->config(), 2, 28000) > 4);
    const SharedLayout& l = r->lay;
    const uint32_t me = r->rank, w = r->world;
    const uint32_t kCalls = 4;
    for (uint32_t c = 1; c <= kCalls; ++c) {
        // Counts and private rows first, as the kernels publish them.
        for (uint32_t d = 0; d < w; ++d) {
            if (!r->remote[d]) continue;
            CallPuts p = puts_of(seed, me, d, c, l);
            r->put(d, proxy::kCounts, c, l.counts + me * kCountsBytes, kCountsBytes,
                   fill_of(me, c, proxy::kCounts));
            r->put(d, proxy::kPrivate, c, l.dispatch + me * 2048, p.private_len,
                   fill_of(me, c, proxy::kPrivate));
        }
        // Counts and private rows land, but the dispatch counter waits for the overflow part.
        for (uint32_t s = 0; s < w; ++s) {
            if (!r->remote[s]) continue;
            CallPuts p = puts_of(seed, s, me, c, l);
            CHILD_CHECK_MSG(wait_for([&] { return r->counter(l.ctr_counts, s) == c; },
                                     std::chrono::seconds(10)),
                            "call {}: counts counter of rank {} at {}", c, s,
                            r->counter(l.ctr_counts, s));
            CHILD_CHECK_MSG(all_equal(r->inbox() + l.counts + s * kCountsBytes, kCountsBytes,
                                      fill_of(s, c, proxy::kCounts)),
                            "call {}: counts bytes of rank {}", c, s);
            const uint8_t* priv = r->inbox() + l.dispatch + s * 2048;
            CHILD_CHECK_MSG(
                wait_for(
                    [&] { return all_equal(priv, p.private_len, fill_of(s, c, proxy::kPrivate)); },
                    std::chrono::seconds(10)),
                "call {}: private rows of rank {} did not arrive", c, s);
            CHILD_CHECK_MSG(r->counter(l.ctr_dispatch, s) == (c - 1) * kDispatchBlocks,
                            "call {}: dispatch counter of rank {} at {} before its overflow part",
                            c, s, r->counter(l.ctr_dispatch, s));
        }
        CHILD_CHECK_OK(ex.barrier());
        for (uint32_t d = 0; d < w; ++d) {
            if (!r->remote[d]) continue;
            CallPuts p = puts_of(seed, me, d, c, l);
            r->put(d, proxy::kOverflow, c, p.overflow_at, p.overflow_len,
                   fill_of(me, c, proxy::kOverflow));
            if (!streamed) {
                r->put(d, proxy::kCombine, c, p.combine_at, p.combine_len,
                       fill_of(me, c, proxy::kCombine));
                continue;
            }
            r->publish_only(d, proxy::kCombine, c, p.combine_at, p.combine_len, true);
            std::vector<uint32_t> order((p.combine_len + piece - 1) / piece);
            for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
            std::shuffle(order.begin(), order.end(), order_rng);
            for (uint32_t i : order)
                r->stream_piece_ready(d, c, p.combine_at, p.combine_len, i,
                                      fill_of(me, c, proxy::kCombine));
        }
        for (uint32_t s = 0; s < w; ++s) {
            if (!r->remote[s]) continue;
            CallPuts p = puts_of(seed, s, me, c, l);
            CHILD_CHECK_MSG(wait_for(
                                [&] {
                                    return r->counter(l.ctr_dispatch, s) == c * kDispatchBlocks &&
                                           r->counter(l.ctr_combine, s) == c * kCombineBlocks;
                                },
                                std::chrono::seconds(10)),
                            "call {}: counters of rank {} at dispatch {}, combine {}", c, s,
                            r->counter(l.ctr_dispatch, s), r->counter(l.ctr_combine, s));
            // The counter is raised after the copy: the bytes are all there already.
            CHILD_CHECK_MSG(all_equal(r->inbox() + p.overflow_at, p.overflow_len,
                                      fill_of(s, c, proxy::kOverflow)),
                            "call {}: overflow rows of rank {}", c, s);
            CHILD_CHECK_MSG(
                all_equal(r->inbox() + p.combine_at, p.combine_len, fill_of(s, c, proxy::kCombine)),
                "call {}: combine rows of rank {}", c, s);
            // Nothing past the announced run was touched.
            CHILD_CHECK_MSG(
                r->inbox()[p.combine_at + p.combine_len] != fill_of(s, c, proxy::kCombine),
                "call {}: bytes past rank {}'s combine run were written", c, s);
        }
        CHILD_CHECK_OK(r->proxy->error());
        CHILD_CHECK_OK(ex.barrier());
    }
    CHILD_CHECK(!r->aborted());
    return "";
}

// provider, world, split writes, ranks per node (0: one each)
using Param = std::tuple<std::string, uint32_t, bool, uint32_t>;

class DeviceProxyTest : public ::testing::TestWithParam<Param> {};

std::string param_name(const ::testing::TestParamInfo<Param>& i) {
    const uint32_t rpn = std::get<3>(i.param);
    return fmt::format("{}_world{}{}{}", std::get<0>(i.param), std::get<1>(i.param),
                       rpn ? fmt::format("_{}_per_node", rpn) : "",
                       std::get<2>(i.param) ? "_split" : "");
}

TEST_P(DeviceProxyTest, PutsArriveWholeAndCountersFollowTheirBytes) {
    auto [provider, world, split, ranks_per_node] = GetParam();
    uint64_t seed =
        ferry::testing::test_seed(::testing::UnitTest::GetInstance()->current_test_info()->name());
    auto results = ferry::testing::run_processes(
        static_cast<int>(world),
        [&](Exchange& ex) { return run_calls(ex, provider, split, ranks_per_node, seed); },
        std::chrono::seconds(60));
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
}

// The same calls with every combine put streamed: pieces made ready in a random order arrive
// whole, and the counter follows the last of them.
class DeviceProxyStreamTest : public ::testing::TestWithParam<Param> {};

TEST_P(DeviceProxyStreamTest, StreamedPutsArriveWholeInAnyPieceOrder) {
    auto [provider, world, split, ranks_per_node] = GetParam();
    uint64_t seed =
        ferry::testing::test_seed(::testing::UnitTest::GetInstance()->current_test_info()->name());
    auto results = ferry::testing::run_processes(
        static_cast<int>(world),
        [&](Exchange& ex) { return run_calls(ex, provider, split, ranks_per_node, seed, true); },
        std::chrono::seconds(60));
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Providers, DeviceProxyTest,
                         // World 8 in four nodes of two: the CUDA EP8 case's shape.
                         ::testing::Values(Param{"tcp", 2, false, 0}, Param{"tcp", 3, true, 0},
                                           Param{"shm", 2, false, 0}, Param{"shm", 3, false, 0},
                                           Param{"tcp", 8, false, 2}, Param{"shm", 8, true, 2}),
                         param_name);

INSTANTIATE_TEST_SUITE_P(Providers, DeviceProxyStreamTest,
                         ::testing::Values(Param{"tcp", 3, true, 0}, Param{"shm", 2, false, 0},
                                           Param{"shm", 8, true, 2}),
                         param_name);

// A kernel record pointing outside its part's region is refused and stops the rank's waits.
TEST(DeviceProxySetup, AnOutOfBoundsPutIsRefusedAndAbortsTheKernels) {
    auto results = ferry::testing::run_processes(
        2,
        [](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(auto r, make_rank(ex, ferry::testing::test_engine_config("tcp")));
            if (ex.rank() == 0) {
                r->publish_only(1, proxy::kCombine, 1, r->lay.total - 100, 8000);
                CHILD_CHECK(
                    wait_for([&] { return !r->proxy->error().ok(); }, std::chrono::seconds(5)));
                Status st = r->proxy->error();
                CHILD_CHECK_MSG(st.code() == StatusCode::kProtocol &&
                                    st.message().find("rank 0, combine put of call 1 to rank 1") !=
                                        std::string::npos &&
                                    st.message().find("outside") != std::string::npos,
                                "{}", st.to_string());
                CHILD_CHECK(r->aborted());
            }
            CHILD_CHECK_OK(ex.barrier());
            return "";
        },
        std::chrono::seconds(60));
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
}

// A peer whose engine is gone turns a put into an error naming it, within the op timeout.
TEST(DeviceProxySetup, APeerWhoseEngineIsGoneTurnsIntoAnErrorNamingIt) {
    auto results = ferry::testing::run_processes(
        2,
        [](Exchange& ex) -> std::string {
            EngineConfig ec = ferry::testing::test_engine_config("tcp");
            ec.op_timeout = std::chrono::seconds(2);
            CHILD_ASSIGN_OK(auto r, make_rank(ex, ec));
            if (ex.rank() == 1) {
                r->proxy.reset();
                r->outbox_mr.reset();
                r->mesh.mr.reset();
                r->mesh.engine.reset();
                CHILD_CHECK_OK(ex.barrier());
                return "";
            }
            CHILD_CHECK_OK(ex.barrier());
            auto t0 = Clock::now();
            // Puts until one fails: a tcp write may still complete into a closing socket.
            for (uint32_t c = 1; c <= 50 && r->proxy->error().ok(); ++c) {
                r->put(1, proxy::kCounts, c, r->lay.counts, kCountsBytes, 1);
                wait_for([&] { return !r->proxy->error().ok(); }, std::chrono::milliseconds(200));
            }
            Status st = r->proxy->error();
            CHILD_CHECK_MSG(!st.ok(), "puts to a peer without an engine kept succeeding");
            CHILD_CHECK_MSG(Clock::now() - t0 < std::chrono::seconds(15), "took {} ms",
                            to_ms(Clock::now() - t0));
            CHILD_CHECK_MSG(st.message().find("to rank 1") != std::string::npos, "{}",
                            st.to_string());
            CHILD_CHECK(r->aborted());
            return "";
        },
        std::chrono::seconds(60));
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
}

// A streamed put's first piece is on the wire while the kernel still writes the rest: the
// peer sees its bytes before the other pieces are ready, and the counter only after all. Each
// piece is one write here, so the peer's proxy counts it as it comes: the piece word names the
// call and the pieces in (what the combine kernel reads a piece's rows by).
TEST(DeviceProxySetup, AStreamedPutsFirstPieceArrivesBeforeTheRestIsReady) {
    constexpr uint64_t kPiece = 3000, kLen = 4 * kPiece - 500;
    auto results = ferry::testing::run_processes(
        2,
        [](Exchange& ex) -> std::string {
            CHILD_ASSIGN_OK(auto r,
                            make_rank(ex, ferry::testing::test_engine_config("shm"), 0, 0, kPiece));
            const SharedLayout& l = r->lay;
            const uint64_t at = l.combine + 64;
            if (ex.rank() == 0) {
                r->publish_only(1, proxy::kCombine, 1, at, kLen, true);
                r->stream_piece_ready(1, 1, at, kLen, 0, 0x31);
                CHILD_CHECK_OK(ex.barrier());  // the peer saw piece 0
                for (uint32_t i = 1; i < 4; ++i) r->stream_piece_ready(1, 1, at, kLen, i, 0x31);
                CHILD_CHECK_OK(ex.barrier());
            } else {
                CHILD_CHECK_MSG(wait_for([&] { return all_equal(r->inbox() + at, kPiece, 0x31); },
                                         std::chrono::seconds(10)),
                                "the first piece did not arrive while the others were not ready");
                CHILD_CHECK_MSG(all_equal(r->inbox() + at + kPiece, kLen - kPiece, kPoison),
                                "bytes of pieces not ready yet arrived");
                CHILD_CHECK(r->counter(l.ctr_combine, 0) == 0);
                CHILD_CHECK_MSG(wait_for([&] { return r->piece_word(0) == (1ull << 32 | 1); },
                                         std::chrono::seconds(10)),
                                "piece word {:x} after the first piece", r->piece_word(0));
                CHILD_CHECK_OK(ex.barrier());
                CHILD_CHECK_MSG(
                    wait_for([&] { return r->counter(l.ctr_combine, 0) == kCombineBlocks; },
                             std::chrono::seconds(10)),
                    "combine counter at {}", r->counter(l.ctr_combine, 0));
                CHILD_CHECK(all_equal(r->inbox() + at, kLen, 0x31));
                CHILD_CHECK(r->inbox()[at + kLen] == kPoison);
                CHILD_CHECK_MSG(r->piece_word(0) == (1ull << 32 | 4), "piece word {:x} at the end",
                                r->piece_word(0));
                CHILD_CHECK_OK(ex.barrier());
            }
            CHILD_CHECK_OK(r->proxy->error());
            return "";
        },
        std::chrono::seconds(60));
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
}

// A streamed put longer than the proxy's piece flags can describe, or to a proxy set up
// without them, is a protocol error naming the put.
TEST(DeviceProxySetup, AStreamedPutThatTheProxyCannotFollowIsRefused) {
    for (uint64_t piece : {uint64_t{0}, uint64_t{100}}) {
        auto results = ferry::testing::run_processes(
            2,
            [piece](Exchange& ex) -> std::string {
                CHILD_ASSIGN_OK(
                    auto r, make_rank(ex, ferry::testing::test_engine_config("tcp"), 0, 0, piece));
                if (ex.rank() == 0) {
                    // 65 pieces of 100 bytes: one more than the flags hold.
                    r->publish_only(1, proxy::kCombine, 1, r->lay.combine, 6410, true);
                    CHILD_CHECK(
                        wait_for([&] { return !r->proxy->error().ok(); }, std::chrono::seconds(5)));
                    Status st = r->proxy->error();
                    CHILD_CHECK_MSG(st.code() == StatusCode::kProtocol &&
                                        st.message().find("rank 0, combine put of call 1 to "
                                                          "rank 1") != std::string::npos &&
                                        st.message().find("streamed") != std::string::npos,
                                    "{}", st.to_string());
                    CHILD_CHECK(r->aborted());
                }
                CHILD_CHECK_OK(ex.barrier());
                return "";
            },
            std::chrono::seconds(60));
        EXPECT_EQ(ferry::testing::describe_failures(results), "") << "piece bytes " << piece;
    }
}

}  // namespace
}  // namespace ferry::moe

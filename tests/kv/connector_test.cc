// Push and pull KV transfer between real processes over tcp and shm: every KV byte checked
// on decode against what prefill wrote, every block back in its pool at the end.
#include <gtest/gtest.h>
#include <signal.h>

#include <random>
#include <thread>

#include "kv/kv_fixture.h"

namespace ferry::kv {
namespace {

using namespace testing;

constexpr uint32_t kTotalHeads = 4;
constexpr uint32_t kPoolBlocks = 64;

struct Topology {
    const char* name;
    uint32_t ptp, dtp;        // prefill and decode TP sizes
    uint32_t pblock, dblock;  // block sizes in tokens
    BlockOrder porder, dorder;
    KvPlacement pplace, dplace;
};

const Topology kTopologies[] = {
    {"1P1D_b16", 1, 1, 16, 16, BlockOrder::kNHD, BlockOrder::kNHD, KvPlacement::kSeparate,
     KvPlacement::kSeparate},
    {"2P1D_b16to32", 2, 1, 16, 32, BlockOrder::kNHD, BlockOrder::kNHD, KvPlacement::kSeparate,
     KvPlacement::kSeparate},
    {"1P2D_b32to16_HND", 1, 2, 32, 16, BlockOrder::kHND, BlockOrder::kHND, KvPlacement::kJoint,
     KvPlacement::kJoint},
    {"1P1D_b16to64_mixed", 1, 1, 16, 64, BlockOrder::kHND, BlockOrder::kNHD, KvPlacement::kJoint,
     KvPlacement::kSeparate},
    {"2P2D_b16", 2, 2, 16, 16, BlockOrder::kNHD, BlockOrder::kHND, KvPlacement::kSeparate,
     KvPlacement::kJoint},
};

void PrintTo(const Topology& t, std::ostream* os) { *os << t.name; }

// No peer dies in these tests: the engine's op_timeout only bounds a lost operation, and a
// short one failed healthy runs on a loaded host. An operation's deadline runs from when it
// was built, through its wait behind the rest of its batch: the mixed-layout pull posts five
// requests' reads at once, 10,000-13,000 reads of 32 bytes (a run per token and head), against
// a hundred or two where both sides order a block alike. That pull takes 0.16 s on an idle
// dev machine; squeezed to a few % of one core (the test and 64 spinners pinned to one CPU at
// nice 19) it took 5 s and its last reads missed a 3 s op_timeout in 3 runs of 3. What bounds
// these tests is kWait (20 s for each result): the op_timeout has only to report a lost read
// before that wait gives up, so that the failure names the read. Half of kWait does; the lease
// stays above the op_timeout as ConnectorConfig requires, and below kWait.
NodeOptions data_options(const std::string& provider) {
    NodeOptions opt;
    opt.provider = provider;
    opt.op_timeout = kWait / 2;
    opt.lease = kWait * 3 / 4;
    return opt;
}

bool is_prefill(const Topology& t, const Exchange& ex) {
    return static_cast<uint32_t>(ex.rank()) < t.ptp;
}

KvRank rank_of(const Topology& t, const Exchange& ex) {
    if (is_prefill(t, ex)) {
        return {
            testing::test_layout(kTotalHeads / t.ptp, t.pblock, t.porder, t.pplace, kPoolBlocks),
            static_cast<uint32_t>(ex.rank()), t.ptp};
    }
    return {testing::test_layout(kTotalHeads / t.dtp, t.dblock, t.dorder, t.dplace, kPoolBlocks),
            static_cast<uint32_t>(ex.rank()) - t.ptp, t.dtp};
}

struct Request {
    uint64_t id;
    uint32_t tokens;
    bool register_first;
};

std::vector<Request> make_requests(uint64_t seed, int n) {
    std::mt19937_64 rng(seed);
    std::vector<Request> reqs;
    for (int i = 0; i < n; ++i) {
        // Up to 190 tokens: partial last blocks on every block size, 1 token sometimes.
        uint32_t tokens = i == 0 ? 1 : 1 + static_cast<uint32_t>(rng() % 190);
        reqs.push_back({0x5000 + static_cast<uint64_t>(i), tokens, i % 2 == 0});
    }
    return reqs;
}

std::vector<EngineAddress> prefill_addrs(const Topology& t, const KvNode& n) {
    return {n.addrs.begin(), n.addrs.begin() + t.ptp};
}

class KvConnectorTest : public ::testing::TestWithParam<std::tuple<std::string, Topology>> {
  protected:
    std::string provider() const { return std::get<0>(GetParam()); }
    const Topology& topo() const { return std::get<1>(GetParam()); }
    void expect_all_ok(const std::vector<::ferry::testing::ChildResult>& results) {
        EXPECT_EQ(::ferry::testing::describe_failures(results), "");
    }
};

TEST_P(KvConnectorTest, PushDeliversEveryByteInBothArrivalOrders) {
    const Topology& t = topo();
    uint64_t seed = ::ferry::testing::test_seed("KvConnector.Push");
    auto reqs = make_requests(seed, 6);
    auto results = run_processes(
        static_cast<int>(t.ptp + t.dtp),
        [&](Exchange& ex) -> std::string {
            KvRank self = rank_of(t, ex);
            bool prefill = is_prefill(t, ex);
            NodeOptions opt = data_options(provider());
            CHILD_ASSIGN_OK(auto node, make_kv_node(ex, self, opt, seed, prefill ? 0 : kPoison));
            KvNode& n = *node;
            std::vector<std::vector<uint32_t>> blocks;
            for (const Request& r : reqs) {
                CHILD_ASSIGN_OK(auto b, n.blocks->allocate(
                                            blocks_for_tokens(r.tokens, self.layout.block_size)));
                blocks.push_back(std::move(b));
                if (prefill) testing::fill_request(n, r.id, blocks.back(), r.tokens);
            }
            auto do_register = [&](bool first) -> std::string {
                for (size_t i = 0; i < reqs.size(); ++i) {
                    if (reqs[i].register_first != first) continue;
                    PushRegistration reg{reqs[i].id, 1, prefill_addrs(t, n), blocks[i],
                                         reqs[i].tokens};
                    CHILD_CHECK_OK(n.conn->register_push(std::move(reg)));
                }
                return "";
            };
            // Order A (register first): REGISTERs arrive before prefill_done is called.
            if (!prefill) {
                std::string e = do_register(true);
                if (!e.empty()) return e;
            }
            CHILD_CHECK_OK(ex.barrier());
            if (prefill) {
                CHILD_ASSIGN_OK(auto readers,
                                consumers_for_producer(kTotalHeads, t.ptp, t.dtp, self.tp_rank));
                uint64_t first = std::count_if(reqs.begin(), reqs.end(),
                                               [](const Request& r) { return r.register_first; });
                CHILD_CHECK_OK(testing::wait_messages(n, first * readers.size(), kWait));
                for (size_t i = 0; i < reqs.size(); ++i) {
                    CHILD_CHECK_OK(n.conn->prefill_done(reqs[i].id, blocks[i], reqs[i].tokens));
                }
            }
            // Order B (prefill first): prefill_done was handed over before these REGISTERs exist.
            CHILD_CHECK_OK(ex.barrier());
            if (!prefill) {
                std::string e = do_register(false);
                if (!e.empty()) return e;
            }
            std::vector<uint8_t> image(n.mem.size(), kPoison);
            for (size_t i = 0; i < reqs.size(); ++i) {
                CHILD_ASSIGN_OK(auto r, n.results.wait(prefill, reqs[i].id, kWait));
                CHILD_CHECK_MSG(r.status.ok(), "transfer {:x}: {}", reqs[i].id,
                                r.status.to_string());
                CHILD_CHECK(r.writes > 0 && r.bytes > 0);
                if (!prefill)
                    testing::expect_request(self, image, reqs[i].id, blocks[i], reqs[i].tokens);
                CHILD_CHECK_OK(n.blocks->free(blocks[i]));
            }
            if (!prefill) {
                // Every byte of every request, and poison everywhere else.
                std::string diff = testing::compare_pool(n.mem, image);
                CHILD_CHECK_MSG(diff.empty(), "decode rank {}: {}", self.tp_rank, diff);
                CHILD_CHECK(n.conn->stats().transfers_received == reqs.size());
            } else {
                CHILD_CHECK(n.conn->stats().transfers_sent == reqs.size());
            }
            CHILD_CHECK(n.conn->stats().messages_malformed == 0);
            std::string leak = testing::check_no_leak(n);
            if (!leak.empty()) return leak;
            CHILD_CHECK_OK(ex.barrier());
            return "";
        },
        kRunTimeout);
    expect_all_ok(results);
}

// `layered`: each request's last chunk goes out layer by layer before prefill_done, as prefill
// computes it.
void chunked_push_body(const Topology& t, const std::string& provider, bool layered, uint64_t seed,
                       std::vector<::ferry::testing::ChildResult>* out) {
    // Chunks of 40 tokens: a multiple of no block size here, so chunk ends fall inside blocks.
    constexpr uint32_t kChunk = 40;
    auto reqs = make_requests(seed, 6);
    *out = run_processes(
        static_cast<int>(t.ptp + t.dtp),
        [&](Exchange& ex) -> std::string {
            KvRank self = rank_of(t, ex);
            bool prefill = is_prefill(t, ex);
            NodeOptions opt = data_options(provider);
            CHILD_ASSIGN_OK(auto node, make_kv_node(ex, self, opt, seed, prefill ? 0 : kPoison));
            KvNode& n = *node;
            std::vector<std::vector<uint32_t>> blocks;
            for (const Request& r : reqs) {
                CHILD_ASSIGN_OK(auto b, n.blocks->allocate(
                                            blocks_for_tokens(r.tokens, self.layout.block_size)));
                blocks.push_back(std::move(b));
                if (prefill) testing::fill_request(n, reqs.size() + r.id, blocks.back(), r.tokens);
            }
            CHILD_ASSIGN_OK(auto readers, consumers_for_producer(kTotalHeads, t.ptp, t.dtp,
                                                                 prefill ? self.tp_rank : 0));
            if (!prefill) {
                // Decode holds its blocks only once every prefill rank scheduled the transfer.
                for (const Request& r : reqs)
                    CHILD_CHECK_OK(n.conn->announce(r.id, 1, prefill_addrs(t, n)));
                for (const Request& r : reqs) {
                    CHILD_ASSIGN_OK(auto s, n.scheduled.wait(false, r.id, kWait));
                    CHILD_CHECK_MSG(s.status.ok(), "{}", s.status.to_string());
                }
                for (size_t i = 0; i < reqs.size(); ++i) {
                    CHILD_CHECK_OK(n.conn->register_push(
                        {reqs[i].id, 1, prefill_addrs(t, n), blocks[i], reqs[i].tokens}));
                }
                // The first chunk is reported in place before prefill sends the others: on a
                // loaded machine decode may otherwise take every chunk in at once and report
                // each transfer once, and the count of reports below would prove nothing.
                for (const Request& r : reqs) {
                    if (r.tokens <= kChunk) continue;
                    CHILD_CHECK_OK(testing::wait_progress(n, r.id, 1, kWait));
                    break;
                }
                CHILD_CHECK_OK(ex.barrier());
            } else {
                CHILD_CHECK_OK(testing::wait_messages(n, reqs.size() * readers.size(), kWait));
                for (const Request& r : reqs) CHILD_CHECK_OK(n.conn->prefill_scheduled(r.id));
                // INTENTs and REGISTERs in: every chunk goes out as its own segment.
                CHILD_CHECK_OK(testing::wait_messages(n, 2 * reqs.size() * readers.size(), kWait));
                for (uint32_t end = kChunk;; end += kChunk) {
                    bool more = false;
                    for (size_t i = 0; i < reqs.size(); ++i) {
                        // The chunk's KV becomes final only now, as a computed chunk's would.
                        if (end - kChunk >= reqs[i].tokens) continue;
                        uint32_t upto = std::min(end, reqs[i].tokens);
                        if (layered && upto == reqs[i].tokens) {
                            // The last chunk: its layers become final one after another.
                            const uint32_t layers = self.layout.num_layers;
                            for (uint32_t l = 1; l < layers; ++l) {
                                testing::expect_request_part(self, n.mem, reqs[i].id, blocks[i],
                                                             end - kChunk, upto, l - 1, l);
                                CHILD_CHECK_OK(n.conn->prefill_progress(
                                    reqs[i].id, blocks[i], KvFrontier{end - kChunk, upto, l}));
                            }
                        }
                        testing::fill_request(n, reqs[i].id, blocks[i], upto);
                        if (upto < reqs[i].tokens) {
                            more = true;
                            CHILD_CHECK_OK(n.conn->prefill_progress(reqs[i].id, blocks[i], upto));
                        } else {
                            CHILD_CHECK_OK(n.conn->prefill_done(reqs[i].id, blocks[i], upto));
                        }
                    }
                    if (end == kChunk) CHILD_CHECK_OK(ex.barrier());  // decode saw chunk one
                    if (!more) break;
                }
            }
            std::vector<uint8_t> image(n.mem.size(), kPoison);
            size_t reports = 0;
            for (size_t i = 0; i < reqs.size(); ++i) {
                CHILD_ASSIGN_OK(auto r, n.results.wait(prefill, reqs[i].id, kWait));
                CHILD_CHECK_MSG(r.status.ok(), "transfer {:x}: {}", reqs[i].id,
                                r.status.to_string());
                if (!prefill) {
                    testing::expect_request(self, image, reqs[i].id, blocks[i], reqs[i].tokens);
                    auto p = n.progress_of(reqs[i].id);
                    CHILD_CHECK_MSG(!p.empty() && p.back() == reqs[i].tokens,
                                    "transfer {:x} of {} tokens: last progress {}", reqs[i].id,
                                    reqs[i].tokens, p.empty() ? 0 : p.back());
                    CHILD_CHECK(std::is_sorted(p.begin(), p.end()) &&
                                std::adjacent_find(p.begin(), p.end()) == p.end());
                    reports += p.size();
                }
                CHILD_CHECK_OK(n.blocks->free(blocks[i]));
            }
            if (!prefill) {
                std::string diff = testing::compare_pool(n.mem, image);
                CHILD_CHECK_MSG(diff.empty(), "decode rank {}: {}", self.tp_rank, diff);
                CHILD_CHECK_MSG(reports > reqs.size(), "{} progress reports for {} transfers",
                                reports, reqs.size());
                if (layered) {
                    // Some last chunk's first layers were reported in place before the rest.
                    std::lock_guard lk(n.progress_mu);
                    CHILD_CHECK_MSG(!n.partial_layers.empty(),
                                    "no layer of a last chunk was reported ahead of the rest");
                }
            }
            CHILD_CHECK(n.conn->stats().messages_malformed == 0);
            std::string leak = testing::check_no_leak(n);
            if (!leak.empty()) return leak;
            CHILD_CHECK_OK(ex.barrier());
            return "";
        },
        kRunTimeout);
}

TEST_P(KvConnectorTest, ChunkedPushAfterAnnounceDeliversEveryByteAndReportsProgress) {
    std::vector<::ferry::testing::ChildResult> results;
    chunked_push_body(topo(), provider(), false,
                      ::ferry::testing::test_seed("KvConnector.ChunkedPush"), &results);
    expect_all_ok(results);
}

TEST_P(KvConnectorTest, LastChunkLayerByLayerDeliversEveryByteAndReportsItsLayers) {
    std::vector<::ferry::testing::ChildResult> results;
    chunked_push_body(topo(), provider(), true,
                      ::ferry::testing::test_seed("KvConnector.LayeredPush"), &results);
    expect_all_ok(results);
}

void pull_body(const Topology& t, const std::string& provider, PullMode mode, uint64_t seed,
               std::vector<::ferry::testing::ChildResult>* out) {
    auto reqs = make_requests(seed, 5);
    *out = run_processes(
        static_cast<int>(t.ptp + t.dtp),
        [&](Exchange& ex) -> std::string {
            KvRank self = rank_of(t, ex);
            bool prefill = is_prefill(t, ex);
            NodeOptions opt = data_options(provider);
            opt.pull_mode = mode;
            CHILD_ASSIGN_OK(auto node, make_kv_node(ex, self, opt, seed, prefill ? 0 : kPoison));
            KvNode& n = *node;
            std::vector<std::vector<uint32_t>> blocks;
            ByteWriter offers;
            for (const Request& r : reqs) {
                CHILD_ASSIGN_OK(auto b, n.blocks->allocate(
                                            blocks_for_tokens(r.tokens, self.layout.block_size)));
                blocks.push_back(std::move(b));
                if (prefill) {
                    testing::fill_request(n, r.id, blocks.back(), r.tokens);
                    CHILD_ASSIGN_OK(auto params, n.conn->offer_pull(r.id, blocks.back(), r.tokens));
                    offers.put_bytes(encode_message(params));
                }
            }
            // The router's part: hand every prefill rank's parameters to decode.
            CHILD_ASSIGN_OK(auto all, ex.allgather(offers.bytes()));
            if (!prefill) {
                for (size_t i = 0; i < reqs.size(); ++i) {
                    std::vector<PullParamsMsg> params;
                    for (uint32_t p = 0; p < t.ptp; ++p) {
                        ByteReader rd(all[p]);
                        std::vector<uint8_t> m;
                        for (size_t k = 0; k <= i; ++k)
                            CHILD_CHECK_OK(rd.get_bytes(&m, "offer", 1 << 20));
                        CHILD_ASSIGN_OK(auto msg, decode_message(m));
                        params.push_back(std::get<PullParamsMsg>(msg));
                    }
                    CHILD_CHECK_OK(
                        n.conn->pull(reqs[i].id, std::move(params), blocks[i], reqs[i].tokens));
                }
            }
            std::vector<uint8_t> image(n.mem.size(), kPoison);
            for (size_t i = 0; i < reqs.size(); ++i) {
                CHILD_ASSIGN_OK(auto r, n.results.wait(prefill, reqs[i].id, kWait));
                CHILD_CHECK_MSG(r.status.ok(), "transfer {:x}: {}", reqs[i].id,
                                r.status.to_string());
                if (!prefill) {
                    CHILD_CHECK(r.writes > 0 && r.bytes > 0);
                    testing::expect_request(self, image, reqs[i].id, blocks[i], reqs[i].tokens);
                }
                CHILD_CHECK_OK(n.blocks->free(blocks[i]));
            }
            if (!prefill) {
                std::string diff = testing::compare_pool(n.mem, image);
                CHILD_CHECK_MSG(diff.empty(), "decode rank {}: {}", self.tp_rank, diff);
            }
            std::string leak = testing::check_no_leak(n);
            if (!leak.empty()) return leak;
            CHILD_CHECK_OK(ex.barrier());
            return "";
        },
        kRunTimeout);
}

TEST_P(KvConnectorTest, PullBackgroundDeliversEveryByte) {
    std::vector<::ferry::testing::ChildResult> results;
    pull_body(topo(), provider(), PullMode::kBackground,
              ::ferry::testing::test_seed("KvConnector.PullBackground"), &results);
    expect_all_ok(results);
}

TEST_P(KvConnectorTest, PullInlineDeliversEveryByte) {
    std::vector<::ferry::testing::ChildResult> results;
    pull_body(topo(), provider(), PullMode::kInline,
              ::ferry::testing::test_seed("KvConnector.PullInline"), &results);
    expect_all_ok(results);
}

// Immediates past 2^32 wrapped, and a registration whose span straddled 2^32 or held more than
// kMaxImmSpan immediates was dropped by every prefill rank as malformed: the transfer ended
// only at its lease, as a timeout. Such a config is refused when the connector is created;
// the largest range that fits still works.
TEST(KvConnectorConfigTest, ImmediatesPastTwoToThe32OrAnOversizedSpanAreRefused) {
    auto results = run_processes(
        1,
        [](Exchange&) -> std::string {
            CHILD_ASSIGN_OK(auto engine,
                            TransferEngine::create(::ferry::testing::test_engine_config("tcp")));
            KvLayout layout =
                testing::test_layout(2, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 8);
            std::vector<uint8_t> mem(layout.pool_bytes());
            CHILD_ASSIGN_OK(auto mr, engine->register_memory(mem.data(), mem.size()));
            auto refused = [&](uint32_t base, uint32_t count, uint32_t span,
                               const std::string& words) -> std::string {
                ConnectorConfig cc;
                cc.self = {layout, 0, 1};
                cc.imm_base = base;
                cc.imm_count = count;
                cc.imm_span = span;
                auto c = KvConnector::create(engine.get(), mr.get(), cc, {});
                CHILD_CHECK_MSG(!c.ok() && c.status().code() == StatusCode::kInvalidArgument &&
                                    c.status().message().find(words) != std::string::npos,
                                "base {:#x} count {} span {}: {}", base, count, span,
                                c.ok() ? "created" : c.status().to_string());
                return "";
            };
            for (auto [base, count] : {std::pair<uint32_t, uint32_t>{0xffffff00u, 1u << 20},
                                       {0xffffffffu, 2},
                                       {0x80000000u, 0x80000001u}}) {
                std::string e = refused(base, count, 64, "run past the largest 32-bit immediate");
                if (!e.empty()) return e;
            }
            std::string e = refused(0x4b000000, 1 << 20, kMaxImmSpan + 1, "imm_span 4097");
            if (!e.empty()) return e;
            ConnectorConfig edge;
            edge.self = {layout, 0, 1};
            edge.imm_base = 0xffffffffu - (1u << 20) + 1;  // the last immediate is 2^32 - 1
            edge.imm_count = 1u << 20;
            edge.imm_span = kMaxImmSpan;
            CHILD_ASSIGN_OK(auto ok, KvConnector::create(engine.get(), mr.get(), edge, {}));
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

std::vector<std::string> providers() { return {"tcp", "shm"}; }

INSTANTIATE_TEST_SUITE_P(All, KvConnectorTest,
                         ::testing::Combine(::testing::ValuesIn(providers()),
                                            ::testing::ValuesIn(kTopologies)),
                         [](const auto& info) {
                             return std::get<0>(info.param) + "_" + std::get<1>(info.param).name;
                         });

}  // namespace
}  // namespace ferry::kv

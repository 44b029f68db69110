// Block copies (plan_block_copy, TransferEngine::copy_blocks): a KV transfer as both layouts'
// strides and the block lists, the addresses computed where the copy runs. On the host, the
// address arithmetic the copy kernel runs (fabric/block_copy_geom.h) is applied with memcpy and
// must move exactly what the planner's runs move; on a GPU, pushes and pulls between GPU pools
// (which take this path) must leave every byte as the CPU path's runs do. Random layouts on
// both sides: block sizes 16/32/64, NHD/HND, separate/joint/block-major, TP 2->1, 1->2, 2->2,
// pools of several regions, token and layer sub-ranges; seed printed.
#include "fabric/block_copy.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "ferry/fabric/gpu_memory.h"
#include "kv/kv_fixture.h"
#include "support/gpu.h"

namespace ferry::kv {
namespace {

using namespace testing;

// Two TP groups exchanging KV, each rank with its own random layout.
struct Case {
    uint32_t layers = 2;
    uint32_t head_dim = 16;
    uint32_t total_heads = 4;
    uint32_t ptp = 1, dtp = 1;
    std::vector<KvRank> prefill, decode;
    uint32_t tokens = 1;
    std::string describe() const {
        std::string s = fmt::format("TP {}->{}, {} tokens:", ptp, dtp, tokens);
        for (const auto& r : prefill) s += " P" + r.layout.to_string();
        for (const auto& r : decode) s += " D" + r.layout.to_string();
        return s;
    }
};

KvLayout random_layout(std::mt19937_64& rng, const Case& c, uint32_t heads, uint32_t tokens) {
    KvLayout l;
    l.num_layers = c.layers;
    l.num_kv_heads = heads;
    l.head_dim = c.head_dim;
    l.elem_size = 2;
    const uint32_t sizes[] = {16, 32, 64};
    l.block_size = sizes[rng() % 3];
    l.num_blocks = blocks_for_tokens(tokens, l.block_size) + 2 + static_cast<uint32_t>(rng() % 6);
    l.order = rng() % 2 ? BlockOrder::kHND : BlockOrder::kNHD;
    l.placement = static_cast<KvPlacement>(rng() % 3);
    // Region splits the placement keeps contiguous (KvLayout::validate).
    const uint32_t splits = l.placement == KvPlacement::kSeparate ? 3
                            : l.placement == KvPlacement::kJoint  ? 2
                                                                  : 1;
    l.regions = static_cast<RegionSplit>(rng() % splits);
    return l;
}

Case random_case(std::mt19937_64& rng, uint32_t max_tokens) {
    Case c;
    c.layers = 1 + static_cast<uint32_t>(rng() % 3);
    const uint32_t dims[] = {8, 16, 64};
    c.head_dim = dims[rng() % 3];
    const std::pair<uint32_t, uint32_t> tps[] = {{2, 1}, {1, 2}, {2, 2}, {1, 1}};
    std::tie(c.ptp, c.dtp) = tps[rng() % 4];
    c.total_heads = rng() % 2 ? 2 : 4;
    c.tokens = 1 + static_cast<uint32_t>(rng() % max_tokens);
    for (uint32_t r = 0; r < c.ptp; ++r) {
        c.prefill.push_back({random_layout(rng, c, c.total_heads / c.ptp, c.tokens), r, c.ptp});
    }
    for (uint32_t r = 0; r < c.dtp; ++r) {
        c.decode.push_back({random_layout(rng, c, c.total_heads / c.dtp, c.tokens), r, c.dtp});
    }
    return c;
}

// Distinct block ids in a random order, enough for the request.
std::vector<uint32_t> random_blocks(std::mt19937_64& rng, const KvLayout& l, uint32_t tokens) {
    std::vector<uint32_t> all(l.num_blocks);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(blocks_for_tokens(tokens, l.block_size));
    return all;
}

// What the CPU path moves: the planner's runs, applied region by region to whole-pool images.
std::string apply_runs(const TransferSpec& spec, const std::vector<uint8_t>& src,
                       std::vector<uint8_t>& dst, uint64_t* bytes) {
    auto plan = plan_transfer(spec);
    if (!plan.ok()) return plan.status().to_string();
    const uint64_t srb = spec.src.layout.region_bytes(), drb = spec.dst.layout.region_bytes();
    for (const RegionRuns& g : plan->groups) {
        for (size_t i = g.first; i < g.first + g.count; ++i) {
            const ByteRun& r = plan->runs[i];
            std::memcpy(dst.data() + g.dst_region * drb + r.dst_offset,
                        src.data() + g.src_region * srb + r.src_offset, r.length);
        }
    }
    *bytes = plan->bytes;
    return "";
}

// Each plane's address as copy_blocks hands it to the GPU: block 0, the side's first head.
std::vector<uint64_t> plane_bases(const BlockCopySide& side, uint64_t pool, uint64_t region_bytes) {
    std::vector<uint64_t> v;
    for (const BlockPlane& p : side.planes) {
        v.push_back(pool + p.region * region_bytes + p.offset +
                    uint64_t{side.first_head} * side.head_stride);
    }
    return v;
}

// The block copy as the kernel runs it, item by item, row by row, with memcpy; every address
// checked inside the pools first.
std::string apply_block_copy(const TransferSpec& spec, const std::vector<uint8_t>& src,
                             std::vector<uint8_t>& dst, uint64_t* bytes) {
    auto plan = plan_block_copy(spec);
    if (!plan.ok()) return plan.status().to_string();
    *bytes = plan->bytes;
    if (plan->bytes == 0) return "";
    const BlockCopyOp op = plan->op();
    auto geom = detail::make_block_copy_geom(op);
    if (!geom.ok()) return geom.status().to_string();
    if (geom->bytes() != plan->bytes) {
        return fmt::format("geometry moves {} bytes, the plan {}", geom->bytes(), plan->bytes);
    }
    const uint64_t s0 = reinterpret_cast<uint64_t>(src.data());
    const uint64_t d0 = reinterpret_cast<uint64_t>(dst.data());
    const auto sp = plane_bases(op.src, s0, spec.src.layout.region_bytes());
    const auto dp = plane_bases(op.dst, d0, spec.dst.layout.region_bytes());
    uint64_t moved = 0;
    for (uint64_t item = 0; item < geom->items; ++item) {
        detail::BlockCopyItem it;
        if (!detail::block_copy_item(*geom, op.src.blocks.data(), op.dst.blocks.data(), sp.data(),
                                     dp.data(), item, &it)) {
            continue;
        }
        for (uint32_t r = it.row_begin; r < it.row_end; ++r) {
            uint64_t so = 0, dof = 0;
            detail::block_copy_row(*geom, r, &so, &dof);
            const uint64_t s = it.src + so, d = it.dst + dof;
            if (s < s0 || s + it.len > s0 + src.size() || d < d0 || d + it.len > d0 + dst.size()) {
                return fmt::format("item {} row {} leaves the pools", item, r);
            }
            std::memcpy(reinterpret_cast<void*>(d), reinterpret_cast<const void*>(s), it.len);
            moved += it.len;
        }
    }
    if (moved != plan->bytes)
        return fmt::format("items moved {} bytes, want {}", moved, plan->bytes);
    return "";
}

std::vector<uint8_t> random_bytes(std::mt19937_64& rng, size_t n) {
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = static_cast<uint8_t>(rng());
    return v;
}

TEST(KvBlockCopyPlanTest, DeviceAddressArithmeticMovesWhatTheRunsMove) {
    const uint64_t seed = ::ferry::testing::test_seed("KvBlockCopyPlan");
    std::mt19937_64 rng(seed);
    for (int n = 0; n < 300; ++n) {
        const Case c = random_case(rng, 300);
        for (const KvRank& p : c.prefill) {
            for (const KvRank& d : c.decode) {
                // Token and layer sub-ranges, as push segments and layer-by-layer chunks have.
                uint32_t first = rng() % 3 == 0 ? static_cast<uint32_t>(rng() % c.tokens) : 0;
                uint32_t first_layer = 0, end_layer = 0;
                if (rng() % 3 == 0) {
                    first_layer = static_cast<uint32_t>(rng() % c.layers);
                    end_layer =
                        first_layer + 1 + static_cast<uint32_t>(rng() % (c.layers - first_layer));
                }
                const auto sb = random_blocks(rng, p.layout, c.tokens);
                const auto db = random_blocks(rng, d.layout, c.tokens);
                const TransferSpec spec{p, sb, d, db, first, c.tokens, first_layer, end_layer};
                SCOPED_TRACE(
                    fmt::format("seed {} case {}: {}, tokens [{}, {}), layers [{}, {}), "
                                "prefill rank {} -> decode rank {}",
                                seed, n, c.describe(), first, c.tokens, first_layer, end_layer,
                                p.tp_rank, d.tp_rank));
                const auto src = random_bytes(rng, p.layout.pool_bytes());
                std::vector<uint8_t> want(d.layout.pool_bytes(), kPoison), got = want;
                uint64_t want_bytes = 0, got_bytes = 0;
                ASSERT_EQ(apply_runs(spec, src, want, &want_bytes), "");
                ASSERT_EQ(apply_block_copy(spec, src, got, &got_bytes), "");
                EXPECT_EQ(got_bytes, want_bytes);
                ASSERT_EQ(testing::compare_pool(got, want), "");
            }
        }
    }
}

// Block ids one after another from a random start, as a pool hands them out before traffic
// scatters it; half the time the list breaks once into two such stretches.
std::vector<uint32_t> consecutive_blocks(std::mt19937_64& rng, const KvLayout& l, uint32_t tokens) {
    const uint32_t n = blocks_for_tokens(tokens, l.block_size);
    const uint32_t start = static_cast<uint32_t>(rng() % (l.num_blocks - n));  // room for a gap
    std::vector<uint32_t> ids(n);
    std::iota(ids.begin(), ids.end(), start);
    if (n >= 2 && rng() % 2) {
        const uint32_t k = 1 + static_cast<uint32_t>(rng() % (n - 1));
        for (uint32_t i = k; i < n; ++i) ids[i] += 1;  // a one-block gap after block k - 1
    }
    return ids;
}

// Every rank's layout NHD, K and V in planes of their own, one block size: the layouts whose
// consecutive blocks copy_blocks sends as stretches (with all heads on both sides).
void qualify_for_stretches(Case& c, std::mt19937_64& rng) {
    const uint32_t sizes[] = {16, 32, 64};
    const uint32_t bs = sizes[rng() % 3];
    for (auto* side : {&c.prefill, &c.decode}) {
        for (KvRank& r : *side) {
            r.layout.order = BlockOrder::kNHD;
            r.layout.placement = KvPlacement::kSeparate;
            r.layout.block_size = bs;
            r.layout.num_blocks = blocks_for_tokens(c.tokens, bs) + 2;
        }
    }
}

// The stretches copy_blocks sends as runs where blocks are consecutive on both sides (packed
// NHD blocks of one size, all heads): applied plane by plane with memcpy they must move what
// the planner's runs move, one stretch per plane where both lists are unbroken. Layouts that
// do not qualify must give no stretches.
TEST(KvBlockCopyPlanTest, ConsecutiveBlocksAsStretchesMoveWhatTheRunsMove) {
    const uint64_t seed = ::ferry::testing::test_seed("KvBlockCopyStretches");
    std::mt19937_64 rng(seed);
    int stretched = 0, refused = 0;
    for (int n = 0; n < 200; ++n) {
        Case c = random_case(rng, 300);
        // Mostly layouts that qualify.
        if (rng() % 4 != 0) qualify_for_stretches(c, rng);
        for (const KvRank& p : c.prefill) {
            for (const KvRank& d : c.decode) {
                const uint32_t first = rng() % 3 == 0 ? static_cast<uint32_t>(rng() % c.tokens) : 0;
                const bool src_random = rng() % 5 == 0, dst_random = rng() % 5 == 0;
                const auto sb = src_random ? random_blocks(rng, p.layout, c.tokens)
                                           : consecutive_blocks(rng, p.layout, c.tokens);
                const auto db = dst_random ? random_blocks(rng, d.layout, c.tokens)
                                           : consecutive_blocks(rng, d.layout, c.tokens);
                const TransferSpec spec{p, sb, d, db, first, c.tokens};
                SCOPED_TRACE(
                    fmt::format("seed {} case {}: {}, tokens [{}, {}), prefill rank {} -> "
                                "decode rank {}",
                                seed, n, c.describe(), first, c.tokens, p.tp_rank, d.tp_rank));
                auto plan = plan_block_copy(spec);
                ASSERT_TRUE(plan.ok()) << plan.status().to_string();
                if (plan->bytes == 0) continue;
                const BlockCopyOp op = plan->op();
                auto geom = detail::make_block_copy_geom(op);
                ASSERT_TRUE(geom.ok()) << geom.status().to_string();
                const auto stretches =
                    detail::block_copy_stretches(*geom, op.src.blocks, op.dst.blocks, 0);
                const bool qualifies =
                    p.layout.order == BlockOrder::kNHD && d.layout.order == BlockOrder::kNHD &&
                    p.layout.placement == KvPlacement::kSeparate &&
                    d.layout.placement == KvPlacement::kSeparate &&
                    p.layout.block_size == d.layout.block_size && geom->rows == detail::kRowsWhole;
                if (!qualifies) {
                    EXPECT_TRUE(stretches.empty());
                    refused++;
                    continue;
                }
                ASSERT_FALSE(stretches.empty());
                stretched++;
                const bool unbroken = [](const std::vector<uint32_t>& v) {
                    for (size_t i = 1; i < v.size(); ++i)
                        if (v[i] != v[i - 1] + 1) return false;
                    return true;
                }(sb) && [](const std::vector<uint32_t>& v) {
                    for (size_t i = 1; i < v.size(); ++i)
                        if (v[i] != v[i - 1] + 1) return false;
                    return true;
                }(db);
                if (unbroken) {
                    EXPECT_EQ(stretches.size(), 1u);
                }
                const auto src = random_bytes(rng, p.layout.pool_bytes());
                std::vector<uint8_t> want(d.layout.pool_bytes(), kPoison), got = want;
                uint64_t want_bytes = 0, moved = 0;
                ASSERT_EQ(apply_runs(spec, src, want, &want_bytes), "");
                const uint64_t s0 = reinterpret_cast<uint64_t>(src.data());
                const uint64_t d0 = reinterpret_cast<uint64_t>(got.data());
                const auto sp = plane_bases(op.src, s0, p.layout.region_bytes());
                const auto dp = plane_bases(op.dst, d0, d.layout.region_bytes());
                for (size_t i = 0; i < sp.size(); ++i) {
                    for (const auto& st : stretches) {
                        const uint64_t from = sp[i] + st.src_off, to = dp[i] + st.dst_off;
                        ASSERT_TRUE(from >= s0 && from + st.len <= s0 + src.size() && to >= d0 &&
                                    to + st.len <= d0 + got.size())
                            << "plane " << i << " stretch leaves the pools";
                        std::memcpy(reinterpret_cast<void*>(to),
                                    reinterpret_cast<const void*>(from), st.len);
                        moved += st.len;
                    }
                }
                EXPECT_EQ(moved, want_bytes);
                ASSERT_EQ(testing::compare_pool(got, want), "");
            }
        }
    }
    // Both kinds came up (the generator makes sure of it; a run that took neither path would
    // check nothing).
    EXPECT_GT(stretched, 40);
    EXPECT_GT(refused, 5);
}

TEST(KvBlockCopyPlanTest, BadBlockListsAreRefusedByName) {
    KvRank src{testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 8), 0, 1};
    KvRank dst{testing::test_layout(4, 32, BlockOrder::kHND, KvPlacement::kJoint, 8), 0, 1};
    std::vector<uint32_t> sb = {0, 1, 2}, db = {3, 9};
    auto plan = plan_block_copy({src, sb, dst, db, 0, 40});
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), StatusCode::kOutOfRange);
    EXPECT_NE(plan.status().message().find("consumer block id 9"), std::string::npos)
        << plan.status().message();
    db = {3};
    plan = plan_block_copy({src, sb, dst, db, 0, 40});
    ASSERT_FALSE(plan.ok());
    EXPECT_NE(plan.status().message().find("consumer has 1 block ids"), std::string::npos)
        << plan.status().message();
}

// The reach a bounds check compares with each region: exact where it fits in 64 bits, the
// largest offset there is where block id x stride does not (a wrapped reach would pass the
// check and let the kernel write anywhere).
TEST(KvBlockCopyPlanTest, BlockReachThatOverflowsIsOutOfEveryRegion) {
    BlockCopySide side;
    side.block_size = 16;
    side.block_stride = 1 << 20;
    side.token_stride = 256;
    side.head_stride = 64;
    side.first_head = 2;
    // Block 9's last token, heads 2..3, 64 bytes each.
    EXPECT_EQ(detail::block_copy_reach(side, 2, 64, 9), 9u * (1 << 20) + 15 * 256 + 3 * 64 + 64);
    side.block_stride = uint64_t{1} << 63;
    EXPECT_EQ(detail::block_copy_reach(side, 2, 64, 2), UINT64_MAX);
    side.block_stride = 1;
    side.head_stride = UINT64_MAX / 2;
    EXPECT_EQ(detail::block_copy_reach(side, 2, 64, 0), UINT64_MAX);
}

// Host memory: no GPU path, so copy_blocks refuses with a message that says where the runs go.
TEST(KvBlockCopyPlanTest, CopyBlocksOutsideGpuMemoryIsRefusedClearly) {
    auto a = TransferEngine::create(::ferry::testing::test_engine_config("tcp"));
    auto b = TransferEngine::create(::ferry::testing::test_engine_config("tcp"));
    ASSERT_TRUE(a.ok() && b.ok());
    KvRank r{testing::test_layout(2, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 4), 0, 1};
    std::vector<uint8_t> ma(r.layout.pool_bytes()), mb(r.layout.pool_bytes());
    auto ra = (*a)->register_memory(ma.data(), ma.size());
    auto rb = (*b)->register_memory(mb.data(), mb.size());
    ASSERT_TRUE(ra.ok() && rb.ok());
    auto peer = (*a)->connect((*b)->address());
    ASSERT_TRUE(peer.ok());
    EXPECT_FALSE((*a)->copies_on_gpu(*peer, **ra, (*rb)->descriptor()));
    std::vector<uint32_t> blocks = {1, 0};
    auto plan = plan_block_copy({r, blocks, r, blocks, 0, 20});
    ASSERT_TRUE(plan.ok());
    BlockCopyOp op = plan->op();
    op.peer = *peer;
    const MemoryRegion* local[] = {ra->get()};
    op.local = local;
    op.remote = std::span<const MemoryDescriptor>(&(*rb)->descriptor(), 1);
    Status s = (*a)->copy_blocks(op).wait(std::chrono::seconds(5));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("write_runs"), std::string::npos) << s.message();
}

// ---- on a GPU: pushes and pulls through connectors, pools in GPU memory ----

struct GpuRank {
    KvRank self;
    std::unique_ptr<TransferEngine> engine;
    GpuBuffer mem;
    std::vector<std::unique_ptr<MemoryRegion>> regions;
    testing::ResultLog results;
    std::unique_ptr<KvConnector> conn;
    std::vector<uint8_t> image;  // what the pool held before the transfer
    ~GpuRank() {
        conn.reset();
        regions.clear();
    }
};

Result<std::unique_ptr<GpuRank>> make_gpu_rank(const KvRank& self, std::vector<uint8_t> image) {
    auto g = std::make_unique<GpuRank>();
    g->self = self;
    g->image = std::move(image);
    FERRY_ASSIGN_OR_RETURN(g->engine,
                           TransferEngine::create(::ferry::testing::test_engine_config("tcp")));
    FERRY_ASSIGN_OR_RETURN(g->mem, GpuBuffer::allocate(g->image.size(), 0));
    FERRY_RETURN_IF_ERROR(g->mem.copy_from_host(g->image.data(), g->image.size()));
    KvPoolRegions pool;
    const uint64_t rb = self.layout.region_bytes();
    for (uint32_t i = 0; i < self.layout.region_count(); ++i) {
        FERRY_ASSIGN_OR_RETURN(
            auto r, g->engine->register_memory(static_cast<uint8_t*>(g->mem.data()) + i * rb, rb,
                                               MemoryKind::kCuda, 0));
        pool.regions.push_back(r.get());
        g->regions.push_back(std::move(r));
    }
    ConnectorConfig cc;
    cc.self = self;
    cc.lease = std::chrono::seconds(20);
    ConnectorCallbacks cb;
    GpuRank* raw = g.get();
    cb.on_recv_done = [raw](const TransferResult& r) { raw->results.add(false, r); };
    cb.on_send_done = [raw](const TransferResult& r) { raw->results.add(true, r); };
    FERRY_ASSIGN_OR_RETURN(g->conn, KvConnector::create(g->engine.get(), pool, cc, cb));
    return g;
}

Status wait_registers(const KvConnector& conn, uint64_t count, Duration timeout) {
    const TimePoint deadline = Clock::now() + timeout;
    while (conn.stats().messages_received < count) {
        if (Clock::now() > deadline) {
            return timeout_error(fmt::format("{} of {} REGISTER messages arrived",
                                             conn.stats().messages_received, count));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return ok_status();
}

// One request of case c, pushed (with a first segment of half the tokens) or pulled; "" or
// what went wrong.
std::string run_gpu_case(const Case& c, std::mt19937_64& rng, bool pull, uint64_t id,
                         bool consecutive) {
    const auto wait = std::chrono::seconds(20);
    std::vector<std::unique_ptr<GpuRank>> prefill, decode;
    std::vector<std::vector<uint32_t>> pblocks, dblocks;
    for (const KvRank& r : c.prefill) {
        CHILD_ASSIGN_OK(auto g, make_gpu_rank(r, random_bytes(rng, r.layout.pool_bytes())));
        prefill.push_back(std::move(g));
        // A third of the lists consecutive: where both sides' are and the layouts qualify, the
        // copy goes as runs (block_copy_stretches) to the tiled kernel.
        pblocks.push_back(consecutive || rng() % 3 == 0
                              ? consecutive_blocks(rng, r.layout, c.tokens)
                              : random_blocks(rng, r.layout, c.tokens));
    }
    for (const KvRank& r : c.decode) {
        CHILD_ASSIGN_OK(auto g,
                        make_gpu_rank(r, std::vector<uint8_t>(r.layout.pool_bytes(), kPoison)));
        decode.push_back(std::move(g));
        dblocks.push_back(consecutive || rng() % 3 == 0
                              ? consecutive_blocks(rng, r.layout, c.tokens)
                              : random_blocks(rng, r.layout, c.tokens));
    }
    std::vector<EngineAddress> paddrs;
    for (auto& p : prefill) paddrs.push_back(p->engine->address());
    if (pull) {
        std::vector<PullParamsMsg> params;
        for (size_t p = 0; p < prefill.size(); ++p) {
            CHILD_ASSIGN_OK(auto offer, prefill[p]->conn->offer_pull(id, pblocks[p], c.tokens));
            params.push_back(std::move(offer));
        }
        for (size_t d = 0; d < decode.size(); ++d) {
            CHILD_CHECK_OK(decode[d]->conn->pull(id, params, dblocks[d], c.tokens));
        }
    } else {
        for (size_t d = 0; d < decode.size(); ++d) {
            CHILD_CHECK_OK(decode[d]->conn->register_push({id, 1, paddrs, dblocks[d], c.tokens}));
        }
        for (size_t p = 0; p < prefill.size(); ++p) {
            CHILD_ASSIGN_OK(auto readers, consumers_for_producer(c.total_heads, c.ptp, c.dtp,
                                                                 static_cast<uint32_t>(p)));
            // REGISTER in place first, so that the first half goes out as a segment of its own
            // (a one-token request has no first half: progress needs at least one token).
            CHILD_CHECK_OK(wait_registers(*prefill[p]->conn, readers.size(), wait));
            if (c.tokens / 2 > 0) {
                CHILD_CHECK_OK(prefill[p]->conn->prefill_progress(id, pblocks[p], c.tokens / 2));
            }
            CHILD_CHECK_OK(prefill[p]->conn->prefill_done(id, pblocks[p], c.tokens));
        }
    }
    for (auto& d : decode) {
        CHILD_ASSIGN_OK(auto r, d->results.wait(false, id, wait));
        CHILD_CHECK_OK(r.status);
    }
    for (auto& p : prefill) {
        CHILD_ASSIGN_OK(auto r, p->results.wait(true, id, wait));
        CHILD_CHECK_OK(r.status);
    }
    for (size_t d = 0; d < decode.size(); ++d) {
        std::vector<uint8_t> want = decode[d]->image;
        for (size_t p = 0; p < prefill.size(); ++p) {
            uint64_t bytes = 0;
            std::string e =
                apply_runs({prefill[p]->self, pblocks[p], decode[d]->self, dblocks[d], 0, c.tokens},
                           prefill[p]->image, want, &bytes);
            CHILD_CHECK_MSG(e.empty(), "{}", e);
        }
        std::vector<uint8_t> got(want.size());
        CHILD_CHECK_OK(decode[d]->mem.copy_to_host(got.data(), got.size()));
        const std::string diff = testing::compare_pool(got, want);
        CHILD_CHECK_MSG(diff.empty(), "decode rank {}: {}", d, diff);
    }
    // The block-copy path was taken: one operation per (producer, consumer) and segment, not a
    // run per (layer, K/V, block).
    const auto& posters = pull ? decode : prefill;
    for (size_t i = 0; i < posters.size(); ++i) {
        const KvRank& r = posters[i]->self;
        CHILD_ASSIGN_OK(auto peers,
                        pull ? producers_for_consumer(c.total_heads, c.ptp, c.dtp, r.tp_rank)
                             : consumers_for_producer(c.total_heads, c.ptp, c.dtp, r.tp_rank));
        const uint64_t segments = pull || c.tokens / 2 == 0 ? 1 : 2;
        const uint64_t ops = posters[i]->conn->stats().ops_posted;
        CHILD_CHECK_MSG(ops == peers.size() * segments,
                        "{} rank {} posted {} operations, want {} block copies",
                        pull ? "decode" : "prefill", i, ops, peers.size() * segments);
    }
    return "";
}

TEST(KvBlockCopyGpuTest, RandomLayoutsPushedAndPulledMatchTheCpuPath) {
    if (::ferry::testing::gpu_count() == 0) GTEST_SKIP() << ::ferry::testing::no_gpu_reason();
    const uint64_t seed = ::ferry::testing::test_seed("KvBlockCopyGpu");
    // CUDA only in a child: a parent that initialised it could not fork GPU children later.
    auto results = ::ferry::testing::run_processes(
        1,
        [&](::ferry::testing::Exchange&) -> std::string {
            std::mt19937_64 rng(seed);
            for (int n = 0; n < 24; ++n) {
                Case c = random_case(rng, 400);
                const bool pull = n % 2 == 1;
                // Half the cases consecutive blocks in layouts that qualify for stretches,
                // long enough (up to 400 tokens x 64 x 2 bytes x heads) to be sent as runs.
                const bool consecutive = n % 4 < 2;
                if (consecutive) {
                    qualify_for_stretches(c, rng);
                    c.head_dim = 64;
                    for (auto* side : {&c.prefill, &c.decode})
                        for (KvRank& r : *side) r.layout.head_dim = 64;
                }
                std::string e = run_gpu_case(c, rng, pull, 0x5100 + n, consecutive);
                if (!e.empty()) {
                    return fmt::format("seed {} case {} ({}, {}): {}", seed, n,
                                       pull ? "pull" : "push", c.describe(), e);
                }
            }
            return "";
        },
        std::chrono::seconds(240));
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

}  // namespace
}  // namespace ferry::kv

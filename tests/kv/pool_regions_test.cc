// Pools of several regions: one region, one per layer (vLLM's per-layer tensors) or one per
// layer and K/V (SGLang's K and V buffers), on either side of a transfer, independently. The
// plans never cross a region, and between real processes (push and pull, shm and tcp, block
// size and TP differences) every KV byte arrives, nothing else is touched, no block leaks. A
// pool whose regions do not fit the layout is refused with a message naming the region.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>

#include "kv/kv_fixture.h"

namespace ferry::kv {
namespace {

using namespace testing;

constexpr RegionSplit kSplits[] = {RegionSplit::kOne, RegionSplit::kPerLayer,
                                   RegionSplit::kPerLayerKv};

const char* split_name(RegionSplit s) {
    return s == RegionSplit::kOne ? "one" : s == RegionSplit::kPerLayer ? "perlayer" : "perlayerkv";
}

KvLayout layout_of(uint32_t heads, uint32_t block, RegionSplit split, uint32_t blocks = 64) {
    KvLayout l =
        testing::test_layout(heads, block, BlockOrder::kNHD, KvPlacement::kSeparate, blocks);
    l.regions = split;
    return l;
}

// ---- plans ----

// Copies a plan region by region between pools kept as one buffer per region, and checks that
// the result equals the one-region plan's copy between whole pools.
TEST(KvPoolRegionsPlanTest, EverySplitPairCopiesWhatOneRegionCopies) {
    uint64_t seed = ::ferry::testing::test_seed("KvPoolRegionsPlan");
    std::mt19937_64 rng(seed);
    for (RegionSplit ss : kSplits) {
        for (RegionSplit ds : kSplits) {
            for (auto [sb, db] : {std::pair{16u, 16u}, {16u, 32u}, {32u, 16u}}) {
                SCOPED_TRACE(fmt::format("{} -> {}, block {} -> {}, seed {}", split_name(ss),
                                         split_name(ds), sb, db, seed));
                KvRank src{layout_of(4, sb, ss), 0, 1}, dst{layout_of(4, db, ds), 0, 1};
                KvRank src1{layout_of(4, sb, RegionSplit::kOne), 0, 1};
                KvRank dst1{layout_of(4, db, RegionSplit::kOne), 0, 1};
                const uint32_t tokens = 100 + static_cast<uint32_t>(rng() % 200);
                std::vector<uint32_t> sblocks(64), dblocks(64);
                std::iota(sblocks.begin(), sblocks.end(), 0);
                std::iota(dblocks.begin(), dblocks.end(), 0);
                std::shuffle(sblocks.begin(), sblocks.end(), rng);
                // Consecutive destination blocks on one side: runs coalesce across blocks, so
                // the cut at region boundaries is exercised.
                auto plan = plan_transfer({src, sblocks, dst, dblocks, 0, tokens});
                auto plan1 = plan_transfer({src1, sblocks, dst1, dblocks, 0, tokens});
                ASSERT_TRUE(plan.ok()) << plan.status().to_string();
                ASSERT_TRUE(plan1.ok());
                EXPECT_EQ(plan->bytes, plan1->bytes);
                std::vector<uint8_t> spool(src.layout.pool_bytes());
                for (auto& b : spool) b = static_cast<uint8_t>(rng());
                std::vector<uint8_t> want(dst.layout.pool_bytes(), kPoison), got = want;
                for (const ByteRun& r : plan1->runs)
                    std::memcpy(want.data() + r.dst_offset, spool.data() + r.src_offset, r.length);
                const uint64_t srb = src.layout.region_bytes(), drb = dst.layout.region_bytes();
                size_t covered = 0;
                for (const RegionRuns& g : plan->groups) {
                    ASSERT_LT(g.src_region, src.layout.region_count());
                    ASSERT_LT(g.dst_region, dst.layout.region_count());
                    ASSERT_EQ(g.first, covered);
                    covered += g.count;
                    for (size_t i = g.first; i < g.first + g.count; ++i) {
                        const ByteRun& r = plan->runs[i];
                        ASSERT_LE(r.src_offset + r.length, srb) << "run crosses a source region";
                        ASSERT_LE(r.dst_offset + r.length, drb) << "run crosses a target region";
                        std::memcpy(got.data() + g.dst_region * drb + r.dst_offset,
                                    spool.data() + g.src_region * srb + r.src_offset, r.length);
                    }
                }
                EXPECT_EQ(covered, plan->runs.size());
                EXPECT_EQ(testing::compare_pool(got, want), "");
                // Coalescing stays where regions allow it: at most one more run per region.
                EXPECT_LE(plan->runs.size(), plan1->runs.size() + src.layout.region_count() +
                                                 dst.layout.region_count());
            }
        }
    }
}

TEST(KvPoolRegionsPlanTest, SplitsThePlacementDoesNotKeepContiguousAreRefused) {
    KvLayout l = layout_of(4, 16, RegionSplit::kPerLayer);
    l.placement = KvPlacement::kBlockMajor;
    Status s = l.validate();
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("block-major"), std::string::npos) << s.message();
    l.placement = KvPlacement::kJoint;
    EXPECT_TRUE(l.validate().ok());
    l.regions = RegionSplit::kPerLayerKv;
    s = l.validate();
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("K and V apart"), std::string::npos) << s.message();
}

// ---- a pool that does not fit its layout ----

TEST(KvPoolRegionsTest, RegionsThatDoNotFitTheLayoutAreRefusedByName) {
    auto engine = TransferEngine::create(::ferry::testing::test_engine_config("tcp"));
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    KvLayout l = layout_of(4, 16, RegionSplit::kPerLayerKv, 8);
    const uint64_t rb = l.region_bytes();
    std::vector<uint8_t> mem(l.pool_bytes());
    std::vector<std::unique_ptr<MemoryRegion>> mrs;
    KvPoolRegions pool;
    for (uint32_t i = 0; i < l.region_count(); ++i) {
        // Region 3 (layer 1, V) one byte short.
        auto r = (*engine)->register_memory(mem.data() + i * rb, i == 3 ? rb - 1 : rb);
        ASSERT_TRUE(r.ok());
        pool.regions.push_back(r->get());
        mrs.push_back(std::move(*r));
    }
    ConnectorConfig cc;
    cc.self = KvRank{l, 0, 1};
    auto c = KvConnector::create(engine->get(), pool, cc, {});
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("region 3 (layer 1 V)"), std::string::npos)
        << c.status().message();

    KvPoolRegions fewer = pool;
    fewer.regions.pop_back();
    c = KvConnector::create(engine->get(), fewer, cc, {});
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("5 regions"), std::string::npos) << c.status().message();
    EXPECT_NE(c.status().message().find("needs 6"), std::string::npos) << c.status().message();

    // The single-region API with a per-layer layout: one region where three are needed.
    cc.self.layout.regions = RegionSplit::kPerLayer;
    c = KvConnector::create(engine->get(), mrs[0].get(), cc, {});
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("1 regions"), std::string::npos) << c.status().message();
    mrs.clear();
}

// ---- between processes ----

struct Case {
    RegionSplit prefill, decode;
    uint32_t ptp = 1, dtp = 1;
    uint32_t pblock = 16, dblock = 32;
    bool pull = false;
    std::string provider = "shm";
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
    const Case& c = info.param;
    return fmt::format("{}_to_{}_tp{}to{}_b{}to{}_{}_{}", split_name(c.prefill),
                       split_name(c.decode), c.ptp, c.dtp, c.pblock, c.dblock,
                       c.pull ? "pull" : "push", c.provider);
}

class KvPoolRegionsTransferTest : public ::testing::TestWithParam<Case> {};

TEST_P(KvPoolRegionsTransferTest, EveryByteArrivesAndNothingLeaks) {
    const Case c = GetParam();
    const uint32_t total_heads = 4;
    const std::vector<std::pair<uint64_t, uint32_t>> reqs = {
        {0x7001, 77}, {0x7002, 130}, {0x7003, 16}};
    const int procs = static_cast<int>(c.ptp + c.dtp);
    auto results = run_processes(
        procs,
        [&](Exchange& ex) -> std::string {
            const bool prefill = ex.rank() < static_cast<int>(c.ptp);
            const uint32_t tp = prefill ? c.ptp : c.dtp;
            const uint32_t rank = prefill ? ex.rank() : ex.rank() - c.ptp;
            KvRank self{layout_of(total_heads / tp, prefill ? c.pblock : c.dblock,
                                  prefill ? c.prefill : c.decode),
                        rank, tp};
            NodeOptions opt;
            opt.provider = c.provider;
            CHILD_ASSIGN_OK(auto node, make_kv_node(ex, self, opt, 11, prefill ? 0 : kPoison));
            KvNode& n = *node;
            std::vector<EngineAddress> prefill_addrs(n.addrs.begin(), n.addrs.begin() + c.ptp);
            std::vector<std::vector<uint32_t>> blocks;
            for (auto [id, tokens] : reqs) {
                CHILD_ASSIGN_OK(
                    auto b, n.blocks->allocate(blocks_for_tokens(tokens, self.layout.block_size)));
                blocks.push_back(std::move(b));
                if (prefill) testing::fill_request(n, id, blocks.back(), tokens);
            }
            if (c.pull) {
                // Prefill offers, the offers travel to every decode rank (as the router would
                // carry them), decode reads.
                // Each offer as u32 length + message bytes.
                std::vector<uint8_t> mine;
                if (prefill) {
                    for (size_t i = 0; i < reqs.size(); ++i) {
                        CHILD_ASSIGN_OK(
                            auto m, n.conn->offer_pull(reqs[i].first, blocks[i], reqs[i].second));
                        auto bytes = encode_message(m);
                        uint32_t len = static_cast<uint32_t>(bytes.size());
                        const auto* lp = reinterpret_cast<const uint8_t*>(&len);
                        mine.insert(mine.end(), lp, lp + 4);
                        mine.insert(mine.end(), bytes.begin(), bytes.end());
                    }
                }
                CHILD_ASSIGN_OK(auto all, ex.allgather(mine));
                if (!prefill) {
                    std::vector<std::vector<PullParamsMsg>> params(reqs.size());
                    for (uint32_t p = 0; p < c.ptp; ++p) {
                        const std::vector<uint8_t>& blob = all[p];
                        for (size_t at = 0, i = 0; at + 4 <= blob.size() && i < reqs.size(); ++i) {
                            uint32_t len = 0;
                            std::memcpy(&len, blob.data() + at, 4);
                            auto m = decode_message(std::span(blob.data() + at + 4, len));
                            at += 4 + len;
                            CHILD_CHECK_MSG(m.ok(), "{}", m.status().to_string());
                            params[i].push_back(std::get<PullParamsMsg>(*m));
                        }
                    }
                    for (size_t i = 0; i < reqs.size(); ++i) {
                        CHILD_CHECK_OK(
                            n.conn->pull(reqs[i].first, params[i], blocks[i], reqs[i].second));
                    }
                }
            } else {
                if (!prefill) {
                    for (size_t i = 0; i < reqs.size(); ++i) {
                        CHILD_CHECK_OK(n.conn->register_push(
                            {reqs[i].first, 0, prefill_addrs, blocks[i], reqs[i].second}));
                    }
                }
                CHILD_CHECK_OK(ex.barrier());
                if (prefill) {
                    for (size_t i = 0; i < reqs.size(); ++i) {
                        CHILD_CHECK_OK(
                            n.conn->prefill_done(reqs[i].first, blocks[i], reqs[i].second));
                    }
                }
            }
            std::vector<uint8_t> image(n.mem.size(), kPoison);
            for (size_t i = 0; i < reqs.size(); ++i) {
                CHILD_ASSIGN_OK(auto r, n.results.wait(prefill, reqs[i].first, kWait));
                CHILD_CHECK_MSG(r.status.ok(), "transfer {:x}: {}", reqs[i].first,
                                r.status.to_string());
                if (!prefill) {
                    testing::expect_request(self, image, reqs[i].first, blocks[i], reqs[i].second);
                }
                CHILD_CHECK_OK(n.blocks->free(blocks[i]));
            }
            if (!prefill) {
                std::string diff = testing::compare_pool(n.mem, image);
                CHILD_CHECK_MSG(diff.empty(), "decode rank {}: {}", rank, diff);
            }
            CHILD_CHECK_OK(ex.barrier());
            return testing::check_no_leak(n);
        },
        std::chrono::seconds(60));
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

std::vector<Case> all_cases() {
    std::vector<Case> out;
    for (RegionSplit p : kSplits) {
        for (RegionSplit d : kSplits) {
            for (bool pull : {false, true}) {
                // Block size differences on every pair; TP differences on the pairs that mix
                // splits.
                out.push_back({p, d, 1, 1, 16, 32, pull, "shm"});
                if (p != d) {
                    out.push_back({p, d, 2, 1, 32, 16, pull, "shm"});
                    out.push_back({p, d, 1, 2, 16, 16, pull, "shm"});
                }
            }
        }
    }
    // tcp: the one <-> per-layer pairs both ways, and per-layer-kv against per-layer.
    out.push_back({RegionSplit::kPerLayer, RegionSplit::kOne, 1, 1, 16, 32, false, "tcp"});
    out.push_back({RegionSplit::kOne, RegionSplit::kPerLayer, 2, 1, 16, 16, true, "tcp"});
    out.push_back({RegionSplit::kPerLayerKv, RegionSplit::kPerLayer, 1, 2, 32, 16, false, "tcp"});
    return out;
}

INSTANTIATE_TEST_SUITE_P(Splits, KvPoolRegionsTransferTest, ::testing::ValuesIn(all_cases()),
                         case_name);

}  // namespace
}  // namespace ferry::kv

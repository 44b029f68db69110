// Byte-level reference model of the block mapping: fill producer pools with bytes derived
// from (layer, K/V, token, global head, dim, byte), apply the planned runs with memcpy into
// poisoned consumer pools, and check every consumer byte.
#include "ferry/kv/block_mapping.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "support/multiproc.h"

namespace ferry::kv {
namespace {

constexpr uint8_t kPoison = 0xa5;

uint8_t expected_byte(uint32_t layer, KvPart part, uint32_t token, uint32_t ghead, uint32_t dim,
                      uint32_t byte) {
    uint64_t x = (uint64_t{layer} << 48) ^ (uint64_t{static_cast<uint8_t>(part)} << 44) ^
                 (uint64_t{token} << 20) ^ (uint64_t{ghead} << 12) ^ (dim << 4) ^ byte;
    x *= 0x9e3779b97f4a7c15ull;
    return static_cast<uint8_t>(x >> 56);
}

struct Side {
    KvRank rank;
    std::vector<uint32_t> blocks;
    std::vector<uint8_t> pool;
};

// Visits every element byte of the request's tokens in a rank's pool.
template <typename F>
void for_each_token_byte(const Side& s, uint32_t tokens, F&& f) {
    const KvLayout& l = s.rank.layout;
    for (uint32_t layer = 0; layer < l.num_layers; ++layer) {
        for (KvPart part : {KvPart::kK, KvPart::kV}) {
            for (uint32_t t = 0; t < tokens; ++t) {
                uint32_t block = s.blocks[t / l.block_size];
                for (uint32_t h = 0; h < l.num_kv_heads; ++h) {
                    for (uint32_t d = 0; d < l.head_dim; ++d) {
                        uint64_t off = l.elem_offset(layer, part, block, t % l.block_size, h, d);
                        for (uint32_t b = 0; b < l.elem_size; ++b) {
                            f(off + b,
                              expected_byte(layer, part, t, s.rank.first_head() + h, d, b));
                        }
                    }
                }
            }
        }
    }
}

std::vector<uint32_t> random_blocks(std::mt19937_64& rng, uint32_t pool_blocks, uint32_t n) {
    std::vector<uint32_t> ids(pool_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(n);
    return ids;
}

struct Combo {
    uint32_t src_block, dst_block, src_tp, dst_tp;
    BlockOrder src_order, dst_order;
    KvPlacement src_place, dst_place;
};

std::string combo_name(const Combo& c) {
    auto o = [](BlockOrder x) { return x == BlockOrder::kNHD ? "NHD" : "HND"; };
    auto p = [](KvPlacement x) {
        return x == KvPlacement::kSeparate      ? "sep"
               : x == KvPlacement::kJoint       ? "joint"
               : x == KvPlacement::kHeadJoint   ? "hjoint"
               : x == KvPlacement::kHeadJointKt ? "hjoint-kt"
                                                : "bmaj";
    };
    return fmt::format("block {}->{} tp {}->{} {}/{}->{}/{}", c.src_block, c.dst_block, c.src_tp,
                       c.dst_tp, o(c.src_order), p(c.src_place), o(c.dst_order), p(c.dst_place));
}

// Runs one request through the mapping for every producer/consumer rank pair and checks every
// byte of every consumer pool. Returns the total number of runs.
size_t check_combo(const Combo& c, uint32_t tokens, std::mt19937_64& rng) {
    constexpr uint32_t kTotalHeads = 4, kLayers = 2, kHeadDim = 4, kElem = 2;
    auto make_layout = [&](uint32_t block, uint32_t tp, BlockOrder o, KvPlacement p) {
        KvLayout l;
        l.num_layers = kLayers;
        l.num_kv_heads = kTotalHeads / tp;
        l.head_dim = kHeadDim;
        l.elem_size = kElem;
        l.block_size = block;
        l.num_blocks = blocks_for_tokens(tokens, block) + 3;  // spare blocks stay untouched
        l.placement = p;
        l.order = o;
        return l;
    };
    std::vector<Side> producers(c.src_tp), consumers(c.dst_tp);
    for (uint32_t r = 0; r < c.src_tp; ++r) {
        Side& s = producers[r];
        s.rank = {make_layout(c.src_block, c.src_tp, c.src_order, c.src_place), r, c.src_tp};
        s.blocks =
            random_blocks(rng, s.rank.layout.num_blocks, blocks_for_tokens(tokens, c.src_block));
        s.pool.resize(s.rank.layout.pool_bytes());
        for (auto& b : s.pool) b = static_cast<uint8_t>(rng());  // garbage outside the request
        for_each_token_byte(s, tokens, [&](uint64_t off, uint8_t v) { s.pool[off] = v; });
    }
    size_t runs = 0;
    for (uint32_t r = 0; r < c.dst_tp; ++r) {
        Side& d = consumers[r];
        d.rank = {make_layout(c.dst_block, c.dst_tp, c.dst_order, c.dst_place), r, c.dst_tp};
        d.blocks =
            random_blocks(rng, d.rank.layout.num_blocks, blocks_for_tokens(tokens, c.dst_block));
        d.pool.assign(d.rank.layout.pool_bytes(), kPoison);
        auto writers = producers_for_consumer(kTotalHeads, c.src_tp, c.dst_tp, r);
        EXPECT_TRUE(writers.ok()) << writers.status().to_string();
        for (uint32_t p = 0; p < c.src_tp; ++p) {
            TransferSpec spec{producers[p].rank, producers[p].blocks, d.rank, d.blocks, 0, tokens};
            auto plan = plan_transfer(spec);
            EXPECT_TRUE(plan.ok()) << plan.status().to_string();
            if (!plan.ok()) return 0;
            bool writes = std::find(writers->begin(), writers->end(), p) != writers->end();
            EXPECT_EQ(!plan->runs.empty(), writes)
                << combo_name(c) << ": producer " << p << " consumer " << r;
            uint64_t bytes = 0;
            for (size_t i = 0; i < plan->runs.size(); ++i) {
                const ByteRun& run = plan->runs[i];
                EXPECT_LE(run.src_offset + run.length, producers[p].pool.size());
                EXPECT_LE(run.dst_offset + run.length, d.pool.size());
                if (i > 0) {
                    const ByteRun& prev = plan->runs[i - 1];
                    EXPECT_FALSE(prev.src_offset + prev.length == run.src_offset &&
                                 prev.dst_offset + prev.length == run.dst_offset)
                        << "runs " << i - 1 << " and " << i << " were not coalesced";
                }
                std::memcpy(d.pool.data() + run.dst_offset,
                            producers[p].pool.data() + run.src_offset, run.length);
                bytes += run.length;
            }
            EXPECT_EQ(bytes, plan->bytes);
            runs += plan->descriptor_count();
            // Each consumer rank gets every producer's consumer-visible heads exactly once.
            auto readers = consumers_for_producer(kTotalHeads, c.src_tp, c.dst_tp, p);
            EXPECT_TRUE(readers.ok());
            EXPECT_EQ(std::find(readers->begin(), readers->end(), r) != readers->end(), writes);
        }
        // Every byte of the request's tokens carries the producer's value; every other byte is
        // still poison.
        std::vector<uint8_t> expect(d.pool.size(), kPoison);
        for_each_token_byte(d, tokens, [&](uint64_t off, uint8_t v) { expect[off] = v; });
        size_t bad = 0;
        uint64_t first_bad = 0;
        for (size_t i = 0; i < expect.size(); ++i) {
            if (expect[i] != d.pool[i] && bad++ == 0) first_bad = i;
        }
        EXPECT_EQ(bad, 0u) << combo_name(c) << " tokens " << tokens << " consumer rank " << r
                           << ": " << bad << " wrong bytes, first at offset " << first_bad;
    }
    return runs;
}

TEST(BlockMapping, EveryByteArrivesForAllBlockSizeTpAndLayoutCombos) {
    std::mt19937_64 rng(testing::test_seed("BlockMapping.EveryByteArrives"));
    const std::pair<uint32_t, uint32_t> block_sizes[] = {{16, 16}, {16, 32}, {32, 16},
                                                         {16, 64}, {64, 16}, {8, 24}};
    const std::pair<uint32_t, uint32_t> tps[] = {{1, 1}, {2, 1}, {1, 2}, {4, 2}, {2, 4}, {4, 1}};
    int cases = 0;
    for (auto [sb, db] : block_sizes) {
        for (auto [stp, dtp] : tps) {
            for (int orders = 0; orders < 4; ++orders) {
                for (int places = 0; places < 9; ++places) {
                    Combo c{sb,
                            db,
                            stp,
                            dtp,
                            static_cast<BlockOrder>(orders & 1),
                            static_cast<BlockOrder>(orders >> 1),
                            static_cast<KvPlacement>(places % 3),
                            static_cast<KvPlacement>(places / 3)};
                    // A partial last block on at least one side, and sometimes an exact fit.
                    uint32_t tokens = 1 + static_cast<uint32_t>(rng() % 150);
                    if (cases % 5 == 0) tokens = std::max(sb, db) * 2;
                    check_combo(c, tokens, rng);
                    if (::testing::Test::HasFailure()) return;
                    ++cases;
                }
            }
        }
    }
    EXPECT_EQ(cases, 6 * 6 * 4 * 9);
}

TEST(BlockMapping, SingleTokenAndSubrangeOfTokens) {
    std::mt19937_64 rng(testing::test_seed("BlockMapping.SingleToken"));
    Combo c{16,
            32,
            2,
            1,
            BlockOrder::kHND,
            BlockOrder::kNHD,
            KvPlacement::kJoint,
            KvPlacement::kSeparate};
    check_combo(c, 1, rng);
}

KvLayout simple_layout(uint32_t blocks, KvPlacement p, BlockOrder o) {
    KvLayout l;
    l.num_layers = 3;
    l.num_kv_heads = 2;
    l.head_dim = 8;
    l.elem_size = 2;
    l.block_size = 16;
    l.num_blocks = blocks;
    l.placement = p;
    l.order = o;
    return l;
}

// vLLM's CPU backend (vLLM 0.32) keeps each layer as [num_blocks, heads, block_size, 2 *
// head_dim] and reads a (block, head) page as block_size K rows then block_size V rows: the
// head-joint placement. Its offsets, written out here from that shape, not from KvLayout.
TEST(BlockMapping, HeadJointOffsetsAreVllmCpuPages) {
    KvLayout l = simple_layout(5, KvPlacement::kHeadJoint, BlockOrder::kHND);
    ASSERT_TRUE(l.validate().ok()) << l.validate().to_string();
    const uint64_t row = l.head_dim * l.elem_size;
    const uint64_t page = 2 * l.block_size * row;  // one head's K and V rows
    const uint64_t layer_bytes = l.num_blocks * l.num_kv_heads * page;
    EXPECT_EQ(l.layer_bytes(), layer_bytes);
    for (uint32_t layer = 0; layer < l.num_layers; ++layer) {
        for (KvPart part : {KvPart::kK, KvPart::kV}) {
            for (uint32_t b = 0; b < l.num_blocks; ++b) {
                for (uint32_t h = 0; h < l.num_kv_heads; ++h) {
                    for (uint32_t t = 0; t < l.block_size; ++t) {
                        uint64_t want = layer * layer_bytes + (b * l.num_kv_heads + h) * page +
                                        (part == KvPart::kV ? l.block_size * row : 0) + t * row;
                        ASSERT_EQ(l.offset(layer, part, b, t, h), want)
                            << "layer " << layer << " part " << int(part) << " block " << b
                            << " head " << h << " token " << t;
                    }
                }
            }
        }
    }
    KvLayout nhd = l;
    nhd.order = BlockOrder::kNHD;
    Status s = nhd.validate();
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("order HND"), std::string::npos) << s.message();
}

// vLLM's CPU attention with its vector kernels (ISA "vec", vLLM 0.32) writes a head's K page
// dimension-major: element (token t, dim d) at d * block_size + t, then the V rows
// [block_size][head_dim] (read off vLLM's cpu_attn_reshape_and_cache, 2026-12-07): the
// head-joint-kt placement. Its offsets, written out here from that page, not from KvLayout.
TEST(BlockMapping, HeadJointKtOffsetsAreVllmCpuVecPages) {
    KvLayout l = simple_layout(5, KvPlacement::kHeadJointKt, BlockOrder::kHND);
    ASSERT_TRUE(l.validate().ok()) << l.validate().to_string();
    const uint64_t e = l.elem_size, row = l.head_dim * e;
    const uint64_t page = 2 * l.block_size * row;  // one head's K and V
    const uint64_t layer_bytes = l.num_blocks * l.num_kv_heads * page;
    for (uint32_t layer = 0; layer < l.num_layers; ++layer) {
        for (uint32_t b = 0; b < l.num_blocks; ++b) {
            for (uint32_t h = 0; h < l.num_kv_heads; ++h) {
                const uint64_t at = layer * layer_bytes + (b * l.num_kv_heads + h) * page;
                for (uint32_t t = 0; t < l.block_size; ++t) {
                    for (uint32_t d = 0; d < l.head_dim; ++d) {
                        ASSERT_EQ(l.elem_offset(layer, KvPart::kK, b, t, h, d),
                                  at + (uint64_t{d} * l.block_size + t) * e)
                            << "K layer " << layer << " block " << b << " head " << h << " token "
                            << t << " dim " << d;
                        ASSERT_EQ(l.elem_offset(layer, KvPart::kV, b, t, h, d),
                                  at + l.block_size * row + t * row + d * e)
                            << "V layer " << layer << " block " << b << " head " << h << " token "
                            << t << " dim " << d;
                    }
                }
            }
        }
    }
    KvLayout nhd = l;
    nhd.order = BlockOrder::kNHD;
    EXPECT_FALSE(nhd.validate().ok());
    // The GPU block copy moves (token, head) rows, which a transposed K lacks: refused.
    std::vector<uint32_t> ids = {0, 1};
    auto copy = plan_block_copy({{l, 0, 1}, ids, {l, 0, 1}, ids, 0, 8});
    ASSERT_FALSE(copy.ok());
    EXPECT_NE(copy.status().message().find("head-joint-kt"), std::string::npos)
        << copy.status().message();
}

// Head-joint (and head-joint-kt) pools to and from every other placement and order, across
// block sizes and TP.
void check_head_joint_both_ways(KvPlacement hj, const char* seed) {
    std::mt19937_64 rng(testing::test_seed(seed));
    const std::pair<uint32_t, uint32_t> block_sizes[] = {{32, 16}, {16, 32}, {32, 32}, {8, 24}};
    const std::pair<uint32_t, uint32_t> tps[] = {{1, 1}, {2, 1}, {1, 2}};
    const KvPlacement others[] = {KvPlacement::kSeparate, KvPlacement::kJoint,
                                  KvPlacement::kBlockMajor, hj};
    int cases = 0;
    for (auto [sb, db] : block_sizes) {
        for (auto [stp, dtp] : tps) {
            for (KvPlacement other : others) {
                for (int o = 0; o < 2; ++o) {
                    BlockOrder oo = other == hj ? BlockOrder::kHND : static_cast<BlockOrder>(o);
                    for (bool from_head_joint : {true, false}) {
                        Combo c{sb, db, stp, dtp, BlockOrder::kHND, oo, hj, other};
                        if (!from_head_joint) {
                            c = Combo{sb, db, stp, dtp, oo, BlockOrder::kHND, other, hj};
                        }
                        uint32_t tokens = 1 + static_cast<uint32_t>(rng() % 150);
                        check_combo(c, tokens, rng);
                        if (::testing::Test::HasFailure()) return;
                        ++cases;
                    }
                }
            }
        }
    }
    EXPECT_EQ(cases, 4 * 3 * 4 * 2 * 2);
}

TEST(BlockMapping, HeadJointMapsToAndFromEveryPlacement) {
    check_head_joint_both_ways(KvPlacement::kHeadJoint, "BlockMapping.HeadJoint");
}

// vLLM CPU pages of one block size into another (prefill 32, decode 64 and back), and into
// every other placement: every byte checked.
TEST(BlockMapping, HeadJointKtMapsToAndFromEveryPlacement) {
    check_head_joint_both_ways(KvPlacement::kHeadJointKt, "BlockMapping.HeadJointKt");
}

TEST(BlockMapping, ContiguousBlocksCoalesceIntoOneRunPerSlabRegion) {
    std::vector<uint32_t> ids = {0, 1, 2, 3};
    KvLayout sep = simple_layout(4, KvPlacement::kSeparate, BlockOrder::kNHD);
    auto plan = plan_transfer({{sep, 0, 1}, ids, {sep, 0, 1}, ids, 0, 64});
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    // Separate K and V regions per layer, all blocks in order: the pool is one run.
    EXPECT_EQ(plan->descriptor_count(), 1u);
    EXPECT_EQ(plan->bytes, sep.pool_bytes());

    KvLayout joint = simple_layout(4, KvPlacement::kJoint, BlockOrder::kHND);
    plan = plan_transfer({{joint, 0, 1}, ids, {joint, 0, 1}, ids, 0, 64});
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(plan->descriptor_count(), 1u);

    // Blocks 0,1,2 -> 1,2,3 stay one run, 3 -> 0 is a second one, in each of the 3 layers x
    // K/V regions.
    std::vector<uint32_t> rotated = {1, 2, 3, 0};
    plan = plan_transfer({{sep, 0, 1}, ids, {sep, 0, 1}, rotated, 0, 64});
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(plan->descriptor_count(), 3u * 2 * 2);

    // Block-major (ferry serve's pool): consecutive blocks are one run for all layers, and a
    // scattered block list costs one write per block, not one per layer and K/V.
    KvLayout bm = simple_layout(4, KvPlacement::kBlockMajor, BlockOrder::kNHD);
    plan = plan_transfer({{bm, 0, 1}, ids, {bm, 0, 1}, ids, 0, 64});
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(plan->descriptor_count(), 1u);
    EXPECT_EQ(plan->bytes, bm.pool_bytes());
    std::vector<uint32_t> scattered = {3, 0, 2, 1};
    plan = plan_transfer({{bm, 0, 1}, ids, {bm, 0, 1}, scattered, 0, 64});
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(plan->descriptor_count(), 4u);
}

TEST(BlockMapping, RejectsWhatDoesNotFitWithAUsefulMessage) {
    KvLayout a = simple_layout(4, KvPlacement::kSeparate, BlockOrder::kNHD);
    KvLayout b = a;
    b.head_dim = 16;
    std::vector<uint32_t> ids = {0, 1};
    auto plan = plan_transfer({{a, 0, 1}, ids, {b, 0, 1}, ids, 0, 20});
    ASSERT_FALSE(plan.ok());
    EXPECT_NE(plan.status().message().find(fmt::format(
                  "head_dim differs ({} at the producer, 16 at the consumer)", a.head_dim)),
              std::string::npos)
        << plan.status().message();

    plan = plan_transfer({{a, 0, 1}, ids, {a, 0, 1}, ids, 0, 33});
    ASSERT_FALSE(plan.ok());
    EXPECT_NE(plan.status().message().find("needs 3"), std::string::npos)
        << plan.status().message();

    std::vector<uint32_t> bad = {0, 9};
    plan = plan_transfer({{a, 0, 1}, ids, {a, 0, 1}, bad, 0, 20});
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), StatusCode::kOutOfRange);
    EXPECT_NE(plan.status().message().find("block id 9"), std::string::npos);

    KvLayout half = a;
    half.num_kv_heads = 1;
    // TP 2 with 1 head each is 2 heads in total, like a; TP 3 would be 3.
    EXPECT_TRUE(plan_transfer({{half, 1, 2}, ids, {a, 0, 1}, ids, 0, 20}).ok());
    plan = plan_transfer({{half, 1, 3}, ids, {a, 0, 1}, ids, 0, 20});
    ASSERT_FALSE(plan.ok());
    EXPECT_NE(plan.status().message().find("KV heads in total"), std::string::npos);

    EXPECT_FALSE(producers_for_consumer(6, 4, 1, 0).ok());
    EXPECT_FALSE(producers_for_consumer(8, 2, 2, 2).ok());
}

TEST(BlockMapping, RankAssignmentHelpersAgree) {
    auto p = producers_for_consumer(8, 4, 2, 1);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(*p, (std::vector<uint32_t>{2, 3}));
    auto c = consumers_for_producer(8, 1, 4, 0);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(*c, (std::vector<uint32_t>{0, 1, 2, 3}));
    c = consumers_for_producer(8, 4, 2, 3);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(*c, (std::vector<uint32_t>{1}));
}

}  // namespace
}  // namespace ferry::kv

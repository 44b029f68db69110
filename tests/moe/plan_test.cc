#include "ferry/moe/plan.h"

#include <gtest/gtest.h>

#include <vector>

namespace ferry::moe {
namespace {

AllToAllConfig small() {
    AllToAllConfig c;
    c.max_tokens_per_rank = 4;
    c.hidden = 128;
    c.num_experts = 4;
    c.experts_per_token = 2;
    c.world_size = 2;
    c.private_slots_per_sender = 1;
    c.group_alignment = 4;
    return c;
}

TEST(MoePlan, CountsRowsHitsAndCombineSlotsInReceiverOrder) {
    AllToAllConfig c = small();
    // Experts 0,1 live on rank 0; 2,3 on rank 1.
    std::vector<int32_t> idx = {0, 3, 1, -1, 3, 2, -1, -1};
    auto p = plan_send(c, idx, 4);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    EXPECT_EQ(p->expert_counts, (std::vector<uint32_t>{1, 1, 1, 2}));
    EXPECT_EQ(p->rows_to, (std::vector<uint32_t>{2, 2}));
    EXPECT_EQ(p->row_begin, (std::vector<uint32_t>{0, 2, 4}));
    EXPECT_EQ(p->row_token, (std::vector<uint32_t>{0, 1, 0, 2}));
    EXPECT_EQ(p->hits_to, (std::vector<uint32_t>{2, 3}));
    EXPECT_EQ(p->combine_begin, (std::vector<uint32_t>{0, 2, 5}));
    // Rank 1 returns hits row by row (token 0 then 2), top-k order inside a row.
    EXPECT_EQ(p->combine_slot, (std::vector<int32_t>{0, 2, 1, -1, 3, 4, -1, -1}));
}

TEST(MoePlan, PerRankCombineGivesEachRanksFirstChoiceTheRowOfItsPartial) {
    AllToAllConfig c = small();
    c.combine = CombineMode::kPerRank;
    // Token 2 picks experts 3 and 2, both on rank 1: one partial, at its first choice.
    std::vector<int32_t> idx = {0, 3, 1, -1, 3, 2, -1, -1};
    auto p = plan_send(c, idx, 4);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    EXPECT_EQ(p->hits_to, (std::vector<uint32_t>{2, 3}));
    // A row per dispatched row: 2 to each rank.
    EXPECT_EQ(p->combine_begin, (std::vector<uint32_t>{0, 2, 4}));
    EXPECT_EQ(p->combine_slot, (std::vector<int32_t>{0, 2, 1, -1, 3, -1, -1, -1}));
}

TEST(MoePlan, RejectsBadIndicesWithThePlace) {
    AllToAllConfig c = small();
    std::vector<int32_t> idx = {0, 4};
    auto p = plan_send(c, idx, 1);
    ASSERT_FALSE(p.ok());
    EXPECT_NE(p.status().message().find("expert 4 is outside [-1, 4)"), std::string::npos)
        << p.status().message();
    idx = {2, 2};
    p = plan_send(c, idx, 1);
    ASSERT_FALSE(p.ok());
    EXPECT_NE(p.status().message().find("selects expert 2 twice"), std::string::npos);
    p = plan_send(c, idx, 5);
    ASSERT_FALSE(p.ok());
    EXPECT_NE(p.status().message().find("exceeds max_tokens_per_rank"), std::string::npos);
    std::vector<int32_t> few = {0};
    EXPECT_FALSE(plan_send(c, few, 1).ok());
}

TEST(MoePlan, ReceiveLayoutFillsPrivateSlotsThenOneRunPerSender) {
    AllToAllConfig c = small();
    c.world_size = 3;
    c.num_experts = 6;
    c.private_slots_per_sender = 2;
    std::vector<uint32_t> rows_from = {4, 1, 3};
    RecvLayout l(c, rows_from);
    // Private slots: sender s owns rows [2s, 2s+2). Overflow starts at row 6: sender 0's two
    // extra rows, none for sender 1, then sender 2's one.
    EXPECT_EQ(l.row_index(0, 0), 0u);
    EXPECT_EQ(l.row_index(0, 1), 1u);
    EXPECT_EQ(l.row_index(0, 2), 6u);
    EXPECT_EQ(l.row_index(0, 3), 7u);
    EXPECT_EQ(l.row_index(1, 0), 2u);
    EXPECT_EQ(l.row_index(2, 1), 5u);
    EXPECT_EQ(l.row_index(2, 2), 8u);
    EXPECT_EQ(l.overflow_rows(0), 2u);
    EXPECT_EQ(l.overflow_rows(1), 0u);
    EXPECT_EQ(l.overflow_row(2), 8u);
    // Worst case stays inside the region: every sender sends max_tokens rows.
    std::vector<uint32_t> full(3, c.max_tokens_per_rank);
    RecvLayout f(c, full);
    EXPECT_EQ(f.row_index(2, c.max_tokens_per_rank - 1) + 1,
              uint64_t{c.world_size} * c.max_tokens_per_rank);
}

TEST(MoePlan, ExpertGroupsArePaddedToTheAlignment) {
    AllToAllConfig c = small();
    std::vector<uint32_t> hits = {5, 0};
    ExpertLayout l = expert_layout(c, hits);
    EXPECT_EQ(l.offsets, (std::vector<uint32_t>{0, 8, 8}));
    EXPECT_EQ(l.total_rows(), 8u);
    EXPECT_LE(l.total_rows(), max_expert_rows(c));
}

TEST(MoePlan, RowsAreSixteenByteAligned) {
    AllToAllConfig c = small();
    c.dtype = DType::kFp8E4M3;
    c.experts_per_token = 5;
    c.num_experts = 8;
    RowFormat f = RowFormat::of(c);
    // 8-byte header + 5 int16 ids, 5 uint32 places from 20, the hit base at 40, 5 float
    // weights from 44, rounded.
    EXPECT_EQ(f.place_offset, 20u);
    EXPECT_EQ(f.hit_base_offset, 40u);
    EXPECT_EQ(f.weight_offset, 44u);
    EXPECT_EQ(f.header_bytes, 64u);
    EXPECT_EQ(f.scale_offset, 64u + 128u);
    EXPECT_EQ(f.row_bytes, 64u + 128u + 16u);
    EXPECT_EQ(CountsFormat::of(c).bytes % 64, 0u);
}

}  // namespace
}  // namespace ferry::moe

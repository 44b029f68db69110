#include "ferry/moe/config.h"

#include <gtest/gtest.h>

#include <vector>

namespace ferry::moe {
namespace {

AllToAllConfig valid() {
    AllToAllConfig c;
    c.max_tokens_per_rank = 128;
    c.hidden = 7168;
    c.dtype = DType::kFp8E4M3;
    c.num_experts = 256;
    c.experts_per_token = 8;
    c.rank = 3;
    c.world_size = 8;
    c.ranks_per_node = 4;
    c.private_slots_per_sender = 16;
    c.group_alignment = 8;
    return c;
}

void expect_invalid(const AllToAllConfig& c, const std::string& needle) {
    Status s = c.validate();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find(needle), std::string::npos)
        << "message '" << s.message() << "' does not name '" << needle << "'";
}

TEST(MoeConfig, AcceptsDecodeShape) {
    AllToAllConfig c = valid();
    EXPECT_TRUE(c.validate().ok()) << c.validate().to_string();
    EXPECT_EQ(c.num_local_experts(), 32u);
    EXPECT_EQ(c.expert_owner(100), 3u);
    EXPECT_EQ(c.local_expert(100), 4u);
    EXPECT_EQ(c.node_of(5), 1u);
    EXPECT_TRUE(c.same_node(4, 7));
    EXPECT_FALSE(c.same_node(3, 4));
    EXPECT_EQ(c.scales_per_token(), 56u);
    EXPECT_EQ(c.payload_bytes(), 7168u);
}

TEST(MoeConfig, RejectsEachBadFieldWithItsName) {
    struct Bad {
        void (*mutate)(AllToAllConfig&);
        const char* needle;
    };
    const Bad cases[] = {
        {[](AllToAllConfig& c) { c.rank = 8; }, "rank 8"},
        {[](AllToAllConfig& c) { c.ranks_per_node = 3; }, "ranks_per_node 3"},
        {[](AllToAllConfig& c) { c.max_tokens_per_rank = 0; }, "max_tokens_per_rank"},
        {[](AllToAllConfig& c) { c.hidden = 7000; }, "multiple of 128"},
        {[](AllToAllConfig& c) { c.dtype = DType::kBf16, c.hidden = 12; }, "hidden % 8"},
        {[](AllToAllConfig& c) { c.num_experts = 250; }, "num_experts 250"},
        {[](AllToAllConfig& c) { c.experts_per_token = 0; }, "experts_per_token 0"},
        {[](AllToAllConfig& c) { c.num_experts = 8, c.experts_per_token = 9; },
         "experts_per_token 9"},
        {[](AllToAllConfig& c) { c.private_slots_per_sender = 129; },
         "private_slots_per_sender 129"},
        {[](AllToAllConfig& c) { c.group_alignment = 0; }, "group_alignment 0"},
        {[](AllToAllConfig& c) { c.world_size = 0; }, "world_size 0"},
        {[](AllToAllConfig& c) { c.combine = static_cast<CombineMode>(7); }, "combine mode 7"},
    };
    for (const Bad& b : cases) {
        AllToAllConfig c = valid();
        b.mutate(c);
        expect_invalid(c, b.needle);
    }
}

TEST(MoeConfig, HashCoversEveryAgreedFieldButNotRank) {
    const AllToAllConfig base = valid();
    AllToAllConfig c = base;
    c.rank = 5;
    EXPECT_EQ(c.hash(), base.hash());
    std::vector<AllToAllConfig> changed(10, base);
    changed[0].max_tokens_per_rank = 64;
    changed[1].hidden = 4096;
    changed[2].dtype = DType::kBf16;
    changed[3].num_experts = 128;
    changed[4].experts_per_token = 6;
    changed[5].world_size = 16;
    changed[6].ranks_per_node = 8;
    changed[7].private_slots_per_sender = 8;
    changed[8].group_alignment = 16;
    changed[9].combine = CombineMode::kPerRank;
    for (size_t i = 0; i < changed.size(); ++i)
        EXPECT_NE(changed[i].hash(), base.hash()) << "field " << i << " is not hashed";
}

TEST(MoeConfig, SetupCheckNamesTheRanksThatDisagree) {
    AllToAllConfig c = valid();
    AllToAllConfig other = valid();
    other.hidden = 4096;
    std::vector<uint64_t> hashes(8, c.hash());
    EXPECT_TRUE(check_same_config(c, hashes).ok());
    hashes[2] = other.hash();
    hashes[6] = other.hash();
    Status s = check_same_config(c, hashes);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("rank(s) 2, 6"), std::string::npos) << s.message();
}

TEST(MoeConfig, ParsesDtypeNames) {
    DType d;
    EXPECT_TRUE(parse_dtype("fp8", &d));
    EXPECT_EQ(d, DType::kFp8E4M3);
    EXPECT_TRUE(parse_dtype("bf16", &d));
    EXPECT_EQ(d, DType::kBf16);
    EXPECT_FALSE(parse_dtype("fp16", &d));
    EXPECT_EQ(dtype_name(DType::kFp8E4M3), "fp8_e4m3");
}

TEST(MoeConfig, ParsesCombineModeNames) {
    CombineMode m = CombineMode::kPerHit;
    EXPECT_TRUE(parse_combine_mode("per-rank", &m));
    EXPECT_EQ(m, CombineMode::kPerRank);
    EXPECT_TRUE(parse_combine_mode("per-hit", &m));
    EXPECT_EQ(m, CombineMode::kPerHit);
    EXPECT_FALSE(parse_combine_mode("rank", &m));
    EXPECT_EQ(combine_mode_name(CombineMode::kPerRank), "per-rank");
}

}  // namespace
}  // namespace ferry::moe

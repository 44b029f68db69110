#include "serve/synthetic_model.h"

#include <gtest/gtest.h>

#include <numeric>

#include "ferry/kv/block_mapping.h"
#include "ferry/kv/block_pool.h"

namespace ferry::serve {
namespace {

KvSlice tiny_slice() {
    KvSlice s;
    s.layout.num_layers = 2;
    s.layout.num_kv_heads = 2;
    s.layout.head_dim = 16;
    s.layout.elem_size = 2;
    s.layout.block_size = 4;
    s.layout.num_blocks = 16;
    s.layout.placement = kv::KvPlacement::kBlockMajor;
    s.vocab = 1000;
    return s;
}

struct Fixture {
    KvSlice slice = tiny_slice();
    std::unique_ptr<KvPool> pool;
    kv::BlockPool bm{16};
    std::vector<int32_t> prompt;
    std::vector<BlockId> blocks;

    explicit Fixture(size_t prompt_len, size_t max_tokens) {
        pool = std::move(KvPool::create(slice.layout).value());
        prompt.resize(prompt_len);
        std::iota(prompt.begin(), prompt.end(), 7);
        blocks = bm.allocate("r", kv::blocks_for_tokens(uint32_t(prompt_len + max_tokens),
                                                        slice.layout.block_size))
                     .value();
    }

    std::vector<int32_t> decode(size_t n) {
        DecodeStream d(*pool, blocks, slice, prompt);
        std::vector<int32_t> out;
        for (size_t i = 0; i < n; ++i) out.push_back(d.next(*pool, blocks).value());
        return out;
    }
};

TEST(SyntheticModel, DecodeOfPrefilledKvMatchesTheClientVerifier) {
    Fixture f(10, 6);
    ASSERT_TRUE(write_prompt_kv(*f.pool, f.blocks, f.slice, f.prompt).ok());
    auto got = f.decode(6);
    EXPECT_EQ(got, expected_tokens(f.slice, f.prompt, 6));
    // The prefilling engine decodes from the digest of what it wrote: same tokens.
    auto digest = write_prompt_kv(*f.pool, f.blocks, f.slice, f.prompt);
    DecodeStream local(f.slice, f.prompt, *digest);
    EXPECT_EQ(*local.next(*f.pool, f.blocks), got[0]);
    EXPECT_EQ(*local.next(*f.pool, f.blocks), got[1]);
    // Tokens are not all the same value: the verifier would notice a stuck generator.
    EXPECT_NE(got[0], got[1]);
}

TEST(SyntheticModel, OneCorruptedKvByteChangesTheTokens) {
    Fixture f(10, 4);
    ASSERT_TRUE(write_prompt_kv(*f.pool, f.blocks, f.slice, f.prompt).ok());
    auto good = f.decode(4);
    // Flip one byte in the V row of layer 1 of the last prompt position.
    auto row = f.pool->row(f.blocks[9 / 4], 1, 1, 9 % 4);
    row[5] ^= 0x01;
    EXPECT_NE(f.decode(4), good);
    EXPECT_NE(f.decode(4), expected_tokens(f.slice, f.prompt, 4));
}

TEST(SyntheticModel, MissingKvChangesTheTokens) {
    Fixture f(10, 4);
    ASSERT_TRUE(write_prompt_kv(*f.pool, f.blocks, f.slice, f.prompt).ok());
    // KV that never arrived: one block still zero.
    std::fill(f.pool->block(f.blocks[1]).begin(), f.pool->block(f.blocks[1]).end(), 0);
    EXPECT_NE(f.decode(4), expected_tokens(f.slice, f.prompt, 4));
}

TEST(SyntheticModel, KvDependsOnThePromptPrefixOnly) {
    Fixture a(8, 1), b(8, 1);
    b.prompt[7] = 999;  // differs only in the last token
    ASSERT_TRUE(write_prompt_kv(*a.pool, a.blocks, a.slice, a.prompt).ok());
    ASSERT_TRUE(write_prompt_kv(*b.pool, b.blocks, b.slice, b.prompt).ok());
    // Causal: positions 0..6 hold the same KV, position 7 differs.
    for (int l = 0; l < 2; ++l) {
        auto ra = a.pool->row(a.blocks[1], l, 0, 2), rb = b.pool->row(b.blocks[1], l, 0, 2);
        EXPECT_TRUE(std::equal(ra.begin(), ra.end(), rb.begin()));
        auto la = a.pool->row(a.blocks[1], l, 0, 3), lb = b.pool->row(b.blocks[1], l, 0, 3);
        EXPECT_FALSE(std::equal(la.begin(), la.end(), lb.begin()));
    }
    EXPECT_NE(expected_tokens(a.slice, a.prompt, 3), expected_tokens(b.slice, b.prompt, 3));
}

TEST(SyntheticModel, RanksOfTwoHeadSlicesHoldHalvesOfTheOneHeadPerRankCache) {
    // TP 1 holds heads {0,1}; TP 2's rank 1 holds head 1 alone: same bytes for that head.
    KvSlice full = tiny_slice();
    KvSlice rank1 = full;
    rank1.layout.num_kv_heads = 1;
    rank1.head_offset = 1;
    std::vector<uint8_t> a(full.layout.token_bytes()), b(rank1.layout.token_bytes());
    fill_kv_row(full, 42, 1, 0, a);
    fill_kv_row(rank1, 42, 1, 0, b);
    EXPECT_TRUE(std::equal(b.begin(), b.end(), a.begin() + a.size() / 2));
}

TEST(SyntheticModel, DecodeFailsCleanlyWhenBlocksRunOut) {
    Fixture f(4, 0);  // exactly one block, no room for generated KV
    ASSERT_TRUE(write_prompt_kv(*f.pool, f.blocks, f.slice, f.prompt).ok());
    DecodeStream d(*f.pool, f.blocks, f.slice, f.prompt);
    EXPECT_TRUE(d.next(*f.pool, f.blocks).ok());
    auto r = d.next(*f.pool, f.blocks);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace ferry::serve

namespace ferry::serve {
namespace {

TEST(SyntheticModel, TokensDoNotDependOnTheBlockSize) {
    // A transfer between engines with different block sizes must give the same tokens.
    std::vector<int32_t> prompt(37);
    std::iota(prompt.begin(), prompt.end(), 100);
    std::vector<int32_t> first;
    for (int bs : {4, 8, 16}) {
        KvSlice s = tiny_slice();
        s.layout.block_size = uint32_t(bs);
        s.layout.num_blocks = 32;
        auto pool = std::move(KvPool::create(s.layout).value());
        std::vector<BlockId> blocks(kv::blocks_for_tokens(37 + 3, uint32_t(bs)));
        std::iota(blocks.rbegin(), blocks.rend(), 0);  // scattered, descending ids
        auto digest = write_prompt_kv(*pool, blocks, s, prompt);
        ASSERT_TRUE(digest.ok());
        DecodeStream d(*pool, blocks, s, prompt);
        std::vector<int32_t> got;
        for (int i = 0; i < 4; ++i) got.push_back(*d.next(*pool, blocks));
        EXPECT_EQ(got, expected_tokens(s, prompt, 4)) << "block size " << bs;
        if (first.empty()) first = got;
        EXPECT_EQ(got, first);
    }
}

TEST(SyntheticModel, RowsSwappedBetweenSlotsChangeTheTokens) {
    KvSlice s = tiny_slice();
    s.layout.num_blocks = 8;
    auto pool = std::move(KvPool::create(s.layout).value());
    std::vector<int32_t> prompt{5, 6, 7, 8, 9, 10};
    std::vector<BlockId> blocks{0, 1};
    ASSERT_TRUE(write_prompt_kv(*pool, blocks, s, prompt).ok());
    auto a = pool->row(0, 0, 0, 1), b = pool->row(0, 0, 0, 2);
    std::swap_ranges(a.begin(), a.end(), b.begin());
    DecodeStream d(*pool, blocks, s, prompt);
    EXPECT_NE(*d.next(*pool, blocks), expected_tokens(s, prompt, 1)[0]);
}

}  // namespace
}  // namespace ferry::serve

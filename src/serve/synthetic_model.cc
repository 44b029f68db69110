#include "ferry/serve/synthetic_model.h"

#include <fmt/format.h>

#include <cstring>

namespace ferry::serve {
namespace {

inline uint64_t mix64(uint64_t x) {  // splitmix64 finalizer: cheap and well distributed
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

inline uint64_t combine(uint64_t a, uint64_t b) { return mix64(a ^ (b + 0x9e3779b97f4a7c15ULL)); }

// Row of one position: heads after each other, each head a stream of words from its own seed.
void fill_row_from(const KvSlice& s, uint64_t state, int layer, int kv, uint8_t* out) {
    const size_t head_bytes = size_t(s.shape.head_dim) * s.shape.elem_bytes;
    uint64_t base = combine(combine(state, uint64_t(layer) * 2 + kv), 0);
    for (int h = 0; h < s.shape.kv_heads; ++h) {
        uint64_t seed = combine(base, uint64_t(s.head_offset + h));
        uint8_t* dst = out + size_t(h) * head_bytes;
        size_t off = 0;
        for (uint64_t k = 0; off < head_bytes; ++k, off += 8) {
            uint64_t w = mix64(seed + k * 0x9e3779b97f4a7c15ULL);
            std::memcpy(dst + off, &w, std::min<size_t>(8, head_bytes - off));
        }
    }
}

// Position p of a request lives in block p / block_size, slot p % block_size.
struct Where {
    BlockId block;
    int slot;
};
Result<Where> locate(std::span<const BlockId> blocks, int block_size, size_t pos,
                     size_t num_blocks) {
    size_t i = pos / block_size;
    if (i >= blocks.size())
        return out_of_range(fmt::format("position {} needs block #{}, the request has {} blocks",
                                        pos, i, blocks.size()));
    if (blocks[i] >= num_blocks)
        return out_of_range(
            fmt::format("block id {} outside the pool of {}", blocks[i], num_blocks));
    return Where{blocks[i], int(pos % block_size)};
}

}  // namespace

uint64_t prefix_state(uint64_t previous, int32_t token, int64_t position) {
    return combine(combine(previous, uint64_t(uint32_t(token))), uint64_t(position));
}

void fill_kv_row(const KvSlice& slice, uint64_t state, int layer, int kv, std::span<uint8_t> row) {
    assert(row.size() == slice.shape.row_bytes());
    fill_row_from(slice, state, layer, kv, row.data());
}

uint64_t fold_row(uint64_t digest, std::span<const uint8_t> row) {
    // Four independent lanes keep the multiply chain off the critical path (~4x faster than one
    // lane); combined at the end so every byte still reaches the result.
    uint64_t lane[4] = {digest, digest ^ 1, digest ^ 2, digest ^ 3};
    size_t i = 0;
    for (; i + 32 <= row.size(); i += 32) {
        for (int l = 0; l < 4; ++l) {
            uint64_t w;
            std::memcpy(&w, row.data() + i + 8 * l, 8);
            lane[l] = (lane[l] ^ w) * 0x100000001b3ULL + 0x9e3779b97f4a7c15ULL;
            lane[l] ^= lane[l] >> 29;
        }
    }
    uint64_t tail = 0;
    for (size_t k = 0; i < row.size(); ++i, ++k) tail = tail * 131 + row[i] + 1;
    return combine(combine(combine(lane[0], lane[1]), combine(lane[2], lane[3])), tail);
}

int32_t token_from_digest(uint64_t digest, int vocab) {
    return int32_t(mix64(digest) % uint64_t(vocab));
}

Result<uint64_t> write_prompt_kv(KvPool& pool, std::span<const BlockId> blocks,
                                 const KvSlice& slice, std::span<const int32_t> tokens) {
    uint64_t state = kEmptyPrefixState;
    uint64_t digest = kEmptyPrefixState;
    for (size_t p = 0; p < tokens.size(); ++p) {
        state = prefix_state(state, tokens[p], int64_t(p));
        FERRY_ASSIGN_OR_RETURN(Where w,
                               locate(blocks, slice.shape.block_size, p, pool.num_blocks()));
        for (int layer = 0; layer < slice.shape.layers; ++layer)
            for (int kv = 0; kv < 2; ++kv) {
                auto row = pool.row(w.block, layer, kv, w.slot);
                fill_row_from(slice, state, layer, kv, row.data());
                digest = fold_row(digest, row);
            }
    }
    return digest;
}

DecodeStream::DecodeStream(const KvSlice& slice, std::span<const int32_t> prompt,
                           uint64_t prompt_digest)
    : slice_(slice),
      prompt_len_(prompt.size()),
      digest_(prompt_digest),
      prefix_(kEmptyPrefixState) {
    for (size_t p = 0; p < prompt.size(); ++p)
        prefix_ = prefix_state(prefix_, prompt[p], int64_t(p));
}

DecodeStream::DecodeStream(const KvPool& pool, std::span<const BlockId> blocks,
                           const KvSlice& slice, std::span<const int32_t> prompt)
    : slice_(slice),
      prompt_len_(prompt.size()),
      digest_(kEmptyPrefixState),
      prefix_(kEmptyPrefixState) {
    for (size_t p = 0; p < prompt.size(); ++p) {
        prefix_ = prefix_state(prefix_, prompt[p], int64_t(p));
        auto w = locate(blocks, slice.shape.block_size, p, pool.num_blocks());
        if (!w.ok()) {
            // Missing KV is folded as a marker so the tokens come out wrong, as they would.
            digest_ = combine(digest_, 0xdeadULL + p);
            continue;
        }
        for (int layer = 0; layer < slice.shape.layers; ++layer)
            for (int kv = 0; kv < 2; ++kv)
                digest_ = fold_row(digest_, pool.row(w->block, layer, kv, w->slot));
    }
}

Result<int32_t> DecodeStream::next(KvPool& pool, std::span<const BlockId> blocks) {
    if (generated_ > 0) {
        size_t pos = prompt_len_ + generated_ - 1;
        prefix_ = prefix_state(prefix_, last_, int64_t(pos));
        FERRY_ASSIGN_OR_RETURN(Where w,
                               locate(blocks, slice_.shape.block_size, pos, pool.num_blocks()));
        for (int layer = 0; layer < slice_.shape.layers; ++layer) {
            for (int kv = 0; kv < 2; ++kv) {
                auto row = pool.row(w.block, layer, kv, w.slot);
                fill_row_from(slice_, prefix_, layer, kv, row.data());
                digest_ = fold_row(digest_, row);
            }
        }
    }
    last_ = token_from_digest(digest_, slice_.vocab);
    ++generated_;
    return last_;
}

std::vector<int32_t> expected_tokens(const KvSlice& slice, std::span<const int32_t> prompt,
                                     size_t max_tokens) {
    std::vector<uint8_t> row(slice.shape.row_bytes());
    uint64_t digest = kEmptyPrefixState, prefix = kEmptyPrefixState;
    auto fold_position = [&](uint64_t state) {
        for (int layer = 0; layer < slice.shape.layers; ++layer) {
            for (int kv = 0; kv < 2; ++kv) {
                fill_row_from(slice, state, layer, kv, row.data());
                digest = fold_row(digest, row);
            }
        }
    };
    for (size_t p = 0; p < prompt.size(); ++p) {
        prefix = prefix_state(prefix, prompt[p], int64_t(p));
        fold_position(prefix);
    }
    std::vector<int32_t> out;
    out.reserve(max_tokens);
    for (size_t i = 0; i < max_tokens; ++i) {
        if (i > 0) {
            prefix = prefix_state(prefix, out.back(), int64_t(prompt.size() + i - 1));
            fold_position(prefix);
        }
        out.push_back(token_from_digest(digest, slice.vocab));
    }
    return out;
}

}  // namespace ferry::serve

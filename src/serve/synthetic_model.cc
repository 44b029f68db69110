#include "serve/synthetic_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace ferry::serve {
namespace {

constexpr uint64_t mix64(uint64_t x) {  // splitmix64 finalizer: cheap and well distributed
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

inline uint64_t combine(uint64_t a, uint64_t b) { return mix64(a ^ (b + 0x9e3779b97f4a7c15ULL)); }

// Per-word constants of the fill and of the digest, indexed by the word's place in a head (a
// place past kWordTable wraps and is told apart by a multiple of its wrap count).
constexpr size_t kWordTable = 512;
struct WordTables {
    uint64_t fill[kWordTable] = {};
    uint64_t weight[kWordTable] = {};  // odd: a change in any word changes the weighted sum
    constexpr WordTables() {
        for (size_t i = 0; i < kWordTable; ++i) {
            fill[i] = mix64(0x6b5f0000ULL + i);
            weight[i] = mix64(0x77e10000ULL + i) | 1;
        }
    }
};
// A constant object: the compiler knows stores into rows cannot change it, so the loops over
// it vectorize.
constexpr WordTables kTables{};

// Row of one position: heads after each other, each head its seed xor a fixed word pattern.
// The seed carries position, prefix, layer, K/V and head; the pattern the place in the head.
// The fill and the digest are real CPU work inside modelled steps on the same cores as the
// transfers they feed, so both are kept at memory speed: a splitmix per word filled at 1.3
// GB/s, a multiply per word at 5.5 GB/s, this at 13 GB/s (2026-12-01).
void fill_row_from(const KvSlice& s, uint64_t state, int layer, int kv, uint8_t* out) {
    const size_t head_bytes = size_t(s.layout.head_dim) * s.layout.elem_size;
    const size_t words = head_bytes / 8;
    const uint64_t* pattern = kTables.fill;
    uint64_t base = combine(state, uint64_t(layer) * 2 + kv);
    for (int h = 0; h < int(s.layout.num_kv_heads); ++h) {
        // One mix per row, not per head: rows are small (256 bytes at TP 8), so per-row
        // arithmetic costs as much as the words.
        const uint64_t head = uint64_t(s.head_offset + h);
        uint64_t seed = base ^ (kTables.fill[head % kWordTable] * 0x9e3779b97f4a7c15ULL + head);
        uint8_t* dst = out + size_t(h) * head_bytes;
        for (size_t k = 0; k < words; ++k) {
            uint64_t x =
                seed ^ pattern[k % kWordTable] ^ ((k / kWordTable) * 0x9e3779b97f4a7c15ULL);
            std::memcpy(dst + 8 * k, &x, 8);
        }
        if (size_t tail = head_bytes - 8 * words) {
            uint64_t x = mix64(seed + words);
            std::memcpy(dst + 8 * words, &x, tail);
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
    assert(row.size() == slice.layout.token_bytes());
    fill_row_from(slice, state, layer, kv, row.data());
}

uint64_t row_term(std::span<const uint8_t> row, size_t position, int layer, int kv) {
    // A weighted sum of the row's words, each with an odd weight of its place: a change in any
    // word changes the sum, and so does moving a word. The products are independent, so four
    // lanes run at memory speed (a chained hash per lane reached 6 GB/s, this 8-10).
    const uint64_t* weight = kTables.weight;
    uint64_t lane[4] = {0, 0, 0, 0};
    const size_t words = row.size() / 8;
    auto w_of = [&](size_t k) {
        uint64_t w;
        std::memcpy(&w, row.data() + 8 * k, 8);
        return w * (weight[k % kWordTable] + 2 * (k / kWordTable));
    };
    size_t k = 0;
    for (; k + 4 <= words; k += 4)
        for (int l = 0; l < 4; ++l) lane[l] += w_of(k + l);
    for (; k < words; ++k) lane[0] += w_of(k);
    uint64_t tail = 0;
    for (size_t i = 8 * words; i < row.size(); ++i) tail = tail * 131 + row[i] + 1;
    uint64_t h = lane[0] + lane[1] + lane[2] + lane[3] + mix64(tail);
    // The place is part of the term: the right bytes in the wrong slot still count as wrong.
    const uint64_t place = (uint64_t(position) << 16) | (uint64_t(layer) << 1) | uint64_t(kv);
    return mix64(h + place * 0xd6e8feb86659fd93ULL);
}

int32_t token_from_digest(uint64_t digest, int vocab) {
    return int32_t(mix64(digest) % uint64_t(vocab));
}

Result<uint64_t> write_prompt_kv(KvPool& pool, std::span<const BlockId> blocks,
                                 const KvSlice& slice, std::span<const int32_t> tokens) {
    if (tokens.empty()) return kEmptyPrefixState;
    FERRY_ASSIGN_OR_RETURN(uint64_t terms,
                           write_prompt_kv_range(pool, blocks, slice, tokens, 0, tokens.size()));
    return kEmptyPrefixState + terms;
}

Result<uint64_t> write_prompt_kv_range(KvPool& pool, std::span<const BlockId> blocks,
                                       const KvSlice& slice, std::span<const int32_t> tokens,
                                       size_t first, size_t end, LayerRange layers) {
    const size_t bs = size_t(slice.layout.block_size);
    const int num_layers = int(slice.layout.num_layers);
    const int layer_end = layers.end < 0 ? num_layers : layers.end;
    if (layers.first < 0 || layers.first >= layer_end || layer_end > num_layers)
        return invalid_argument(fmt::format("layer range [{}, {}) outside the model's {} layers",
                                            layers.first, layer_end, slice.layout.num_layers));
    if (first > end || end > tokens.size())
        return invalid_argument(
            fmt::format("token range [{}, {}) outside a prompt of {}", first, end, tokens.size()));
    if (first == end) return uint64_t{0};
    FERRY_RETURN_IF_ERROR(locate(blocks, int(bs), end - 1, pool.num_blocks()).status());
    for (size_t i = first / bs; i * bs < end; ++i)
        if (blocks[i] >= pool.num_blocks())
            return out_of_range(fmt::format("block id {} outside the pool", blocks[i]));
    // The prefix state is a running hash from the prompt's start: cheap next to the rows.
    std::vector<uint64_t> state(end - first);
    uint64_t st = kEmptyPrefixState;
    for (size_t p = 0; p < end; ++p) {
        st = prefix_state(st, tokens[p], int64_t(p));
        if (p >= first) state[p - first] = st;
    }
    // Block by block in memory order: the rows of consecutive slots are adjacent.
    uint64_t terms = 0;
    for (size_t i = first / bs; i * bs < end; ++i) {
        size_t lo = std::max(first, i * bs), hi = std::min(end, (i + 1) * bs);
        for (int layer = layers.first; layer < layer_end; ++layer)
            for (int kv = 0; kv < 2; ++kv)
                for (size_t p = lo; p < hi; ++p) {
                    auto row = pool.row(blocks[i], layer, kv, int(p - i * bs));
                    fill_row_from(slice, state[p - first], layer, kv, row.data());
                    terms += row_term(row, p, layer, kv);
                }
    }
    return terms;
}

uint64_t prompt_kv_terms(const KvPool& pool, std::span<const BlockId> blocks, const KvSlice& slice,
                         size_t first, size_t end, LayerRange layers) {
    const size_t bs = size_t(slice.layout.block_size);
    const int num_layers = int(slice.layout.num_layers);
    const int layer_end = layers.end < 0 ? num_layers : std::min(layers.end, num_layers);
    uint64_t terms = 0;
    for (size_t i = first / bs; i * bs < end; ++i) {
        if (i >= blocks.size() || blocks[i] >= pool.num_blocks()) {
            // Missing KV is folded as a marker so the tokens come out wrong, as they would;
            // once per block, by the range holding its first position and first layer.
            if (i * bs >= first && layers.first == 0) terms += mix64(0xdead0000ULL + i);
            continue;
        }
        size_t lo = std::max(first, i * bs), hi = std::min(end, (i + 1) * bs);
        for (int layer = layers.first; layer < layer_end; ++layer)
            for (int kv = 0; kv < 2; ++kv)
                for (size_t p = lo; p < hi; ++p)
                    terms +=
                        row_term(pool.row(blocks[i], layer, kv, int(p - i * bs)), p, layer, kv);
    }
    return terms;
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
    : DecodeStream(slice, prompt,
                   kEmptyPrefixState + prompt_kv_terms(pool, blocks, slice, 0, prompt.size())) {}

Result<int32_t> DecodeStream::next(KvPool& pool, std::span<const BlockId> blocks) {
    if (generated_ > 0) {
        size_t pos = prompt_len_ + generated_ - 1;
        prefix_ = prefix_state(prefix_, last_, int64_t(pos));
        FERRY_ASSIGN_OR_RETURN(Where w,
                               locate(blocks, slice_.layout.block_size, pos, pool.num_blocks()));
        for (int layer = 0; layer < int(slice_.layout.num_layers); ++layer) {
            for (int kv = 0; kv < 2; ++kv) {
                auto row = pool.row(w.block, layer, kv, w.slot);
                fill_row_from(slice_, prefix_, layer, kv, row.data());
                digest_ += row_term(row, pos, layer, kv);
            }
        }
    }
    last_ = token_from_digest(digest_, slice_.vocab);
    ++generated_;
    return last_;
}

std::vector<int32_t> expected_tokens(const KvSlice& slice, std::span<const int32_t> prompt,
                                     size_t max_tokens) {
    std::vector<uint8_t> row(slice.layout.token_bytes());
    uint64_t digest = kEmptyPrefixState, prefix = kEmptyPrefixState;
    auto add_position = [&](uint64_t state, size_t pos) {
        for (int layer = 0; layer < int(slice.layout.num_layers); ++layer) {
            for (int kv = 0; kv < 2; ++kv) {
                fill_row_from(slice, state, layer, kv, row.data());
                digest += row_term(row, pos, layer, kv);
            }
        }
    };
    for (size_t p = 0; p < prompt.size(); ++p) {
        prefix = prefix_state(prefix, prompt[p], int64_t(p));
        add_position(prefix, p);
    }
    std::vector<int32_t> out;
    out.reserve(max_tokens);
    for (size_t i = 0; i < max_tokens; ++i) {
        if (i > 0) {
            size_t pos = prompt.size() + i - 1;
            prefix = prefix_state(prefix, out.back(), int64_t(pos));
            add_position(prefix, pos);
        }
        out.push_back(token_from_digest(digest, slice.vocab));
    }
    return out;
}

}  // namespace ferry::serve

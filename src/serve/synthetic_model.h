// A deterministic stand-in for the model's numerics. Compute *time* comes from the cost model;
// what this file provides are real KV bytes and tokens that depend on them:
//  - prefill writes, for every prompt position, layer, K/V and head, values derived from the
//    prompt prefix up to that position (causal, like real KV) and from layer, head and dim;
//  - decode folds every KV byte it holds into a digest and derives each generated token from
//    it, writing the KV of each generated token back into its blocks and folding that in too;
//  - a verifier recomputes the expected tokens from the prompt alone.
// So KV that is corrupted, missing or put in the wrong block changes the output, and a client
// can check every token it receives.
//
// Values depend on the *global* head index (head_offset + local head), so ranks of any TP degree
// hold slices of one consistent cache, as a KV transfer between TP degrees needs.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "serve/kv_pool.h"

namespace ferry::serve {

// Which part of the model's KV one engine rank holds.
struct KvSlice {
    kv::KvLayout layout;  // this rank's pool (KvPool); num_blocks unused by the model
    int head_offset = 0;  // global index of this rank's first KV head
    int vocab = 1000;
};

// Running hash of a prompt prefix: state after token p = mix(state before, token p, p).
uint64_t prefix_state(uint64_t previous, int32_t token, int64_t position);
inline constexpr uint64_t kEmptyPrefixState = 0x243f6a8885a308d3ULL;

// Fills one (layer, K/V) row for the position whose prefix state is `state`.
void fill_kv_row(const KvSlice& slice, uint64_t state, int layer, int kv, std::span<uint8_t> row);
// A row's contribution to a decode digest: every byte counts, and so does where the row sits.
// The digest is the sum of its rows' terms, so it can be taken in memory order and does not
// depend on the block size.
uint64_t row_term(std::span<const uint8_t> row, size_t position, int layer, int kv);
// The generated token a digest stands for.
int32_t token_from_digest(uint64_t digest, int vocab);

// Writes the KV of tokens[0, n) at positions [0, n) into `blocks` (prefill). Returns the digest
// of what it wrote, so the engine that prefilled can decode without a second pass.
Result<uint64_t> write_prompt_kv(KvPool& pool, std::span<const BlockId> blocks,
                                 const KvSlice& slice, std::span<const int32_t> tokens);
// Layers [first, end) of a model; end -1: up to the last layer.
struct LayerRange {
    int first = 0;
    int end = -1;
};

// Chunked prefill: writes positions [first, end) only (of the given layers) and returns their
// digest terms (without the digest's start value); kEmptyPrefixState plus the terms of every
// chunk and layer is the digest write_prompt_kv returns.
Result<uint64_t> write_prompt_kv_range(KvPool& pool, std::span<const BlockId> blocks,
                                       const KvSlice& slice, std::span<const int32_t> tokens,
                                       size_t first, size_t end, LayerRange layers = {});
// Decode: the digest terms of the KV the pool holds for positions [first, end) of a prompt
// (of the given layers), as it lands; the terms of every range plus kEmptyPrefixState give
// DecodeStream's digest.
uint64_t prompt_kv_terms(const KvPool& pool, std::span<const BlockId> blocks, const KvSlice& slice,
                         size_t first, size_t end, LayerRange layers = {});

// Decode of one request over the KV its blocks hold. `prompt` is needed only to continue the
// prefix hash for generated positions; the digest comes from the pool's bytes.
class DecodeStream {
  public:
    // Reads the prompt's KV (positions [0, prompt.size())) from the pool.
    DecodeStream(const KvPool& pool, std::span<const BlockId> blocks, const KvSlice& slice,
                 std::span<const int32_t> prompt);
    // Continues from the digest write_prompt_kv returned (the KV was written here, not sent).
    DecodeStream(const KvSlice& slice, std::span<const int32_t> prompt, uint64_t prompt_digest);

    // Produces the next token; from the second token on, first writes the previous token's KV
    // at its position (so blocks must cover prompt + generated - 1 tokens).
    Result<int32_t> next(KvPool& pool, std::span<const BlockId> blocks);
    size_t generated() const { return generated_; }

  private:
    KvSlice slice_;
    size_t prompt_len_;
    uint64_t digest_;
    uint64_t prefix_;
    int32_t last_ = -1;
    size_t generated_ = 0;
};

// Client-side verification: the tokens a correct engine returns, from the prompt alone.
std::vector<int32_t> expected_tokens(const KvSlice& slice, std::span<const int32_t> prompt,
                                     size_t max_tokens);

}  // namespace ferry::serve

// How much of a prompt's KV is final, when prefill reports it layer by layer inside a chunk,
// and the pieces that take one such state to a later one. The prefill side of the connector
// sends those pieces as segments; the decode engine digests them as they land.
#pragma once

#include <cstdint>
#include <vector>

namespace ferry::kv {

// Tokens [0, tokens) are final in every layer; tokens [tokens, partial_end) in layers
// [0, partial_layers) (the chunk being computed). partial_layers 0: nothing beyond `tokens`.
struct KvFrontier {
    uint32_t tokens = 0;
    uint32_t partial_end = 0;
    uint32_t partial_layers = 0;

    bool has_partial() const { return partial_layers > 0 && partial_end > tokens; }
    bool operator==(const KvFrontier&) const = default;
};

// Tokens [first_token, end_token) x layers [first_layer, end_layer).
struct KvPiece {
    uint32_t first_token = 0;
    uint32_t end_token = 0;
    uint32_t first_layer = 0;
    uint32_t end_layer = 0;
    bool operator==(const KvPiece&) const = default;
};

// The next piece that moves `from` towards `to` (at most one partial chunk in each, the later
// one's partial chunk starting where its whole tokens end); false when `to` holds nothing
// `from` lacks. `layers`: the model's layer count.
bool next_piece(const KvFrontier& from, const KvFrontier& to, uint32_t layers, KvPiece* piece);
// `from` with `piece` (from next_piece) added.
KvFrontier add_piece(const KvFrontier& from, const KvPiece& piece, uint32_t layers);
// Every piece from `from` to `to`, in order.
std::vector<KvPiece> pieces_between(KvFrontier from, const KvFrontier& to, uint32_t layers);

}  // namespace ferry::kv

#include "ferry/kv/kv_frontier.h"

#include <algorithm>

namespace ferry::kv {

bool next_piece(const KvFrontier& from, const KvFrontier& to, uint32_t layers, KvPiece* piece) {
    if (from.has_partial()) {
        // The rest of the chunk under way: its remaining layers once the chunk is whole, or the
        // layers computed since.
        if (to.tokens >= from.partial_end) {
            *piece = {from.tokens, from.partial_end, from.partial_layers, layers};
            return true;
        }
        if (to.has_partial() && to.tokens == from.tokens && to.partial_end == from.partial_end &&
            to.partial_layers > from.partial_layers) {
            *piece = {from.tokens, from.partial_end, from.partial_layers,
                      std::min(to.partial_layers, layers)};
            return true;
        }
        return false;
    }
    if (to.tokens > from.tokens) {
        *piece = {from.tokens, to.tokens, 0, layers};
        return true;
    }
    if (to.has_partial() && to.tokens == from.tokens) {
        *piece = {to.tokens, to.partial_end, 0, std::min(to.partial_layers, layers)};
        return true;
    }
    return false;
}

KvFrontier add_piece(const KvFrontier& from, const KvPiece& piece, uint32_t layers) {
    if (piece.end_layer >= layers) return {piece.end_token, 0, 0};
    return {piece.first_token, piece.end_token, piece.end_layer};
}

std::vector<KvPiece> pieces_between(KvFrontier from, const KvFrontier& to, uint32_t layers) {
    std::vector<KvPiece> out;
    KvPiece p;
    while (next_piece(from, to, layers, &p)) {
        out.push_back(p);
        from = add_piece(from, p, layers);
    }
    return out;
}

}  // namespace ferry::kv

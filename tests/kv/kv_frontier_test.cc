#include "ferry/kv/kv_frontier.h"

#include <gtest/gtest.h>

namespace ferry::kv {
namespace {

constexpr uint32_t kLayers = 8;

// What a sender posts, or a digest reads, as prefill reports a 3-chunk prompt: whole chunks,
// then the last chunk's layers in groups; every (token, layer) exactly once.
TEST(KvFrontier, PiecesCoverEveryTokenAndLayerOnceInOrder) {
    std::vector<KvFrontier> reports = {{64}, {128}, {128, 160, 2}, {128, 160, 6}, {160}};
    std::vector<std::vector<int>> seen(160, std::vector<int>(kLayers, 0));
    KvFrontier at;
    std::vector<KvPiece> all;
    for (const KvFrontier& r : reports) {
        for (const KvPiece& p : pieces_between(at, r, kLayers)) {
            all.push_back(p);
            for (uint32_t t = p.first_token; t < p.end_token; ++t)
                for (uint32_t l = p.first_layer; l < p.end_layer; ++l) seen[t][l]++;
            at = add_piece(at, p, kLayers);
        }
        EXPECT_EQ(at, r);
    }
    std::vector<KvPiece> want = {
        {0, 64, 0, 8}, {64, 128, 0, 8}, {128, 160, 0, 2}, {128, 160, 2, 6}, {128, 160, 6, 8}};
    EXPECT_EQ(all, want);
    for (auto& token : seen)
        for (int n : token) EXPECT_EQ(n, 1);
}

// A receiver that falls behind gets one piece per kind of gap: the rest of a chunk sent layer
// by layer, then whole tokens, then the next chunk's layers.
TEST(KvFrontier, ALaggingFrontierCatchesUpInAtMostThreePieces) {
    auto p = pieces_between({64, 128, 3}, {192, 256, 4}, kLayers);
    std::vector<KvPiece> want = {{64, 128, 3, 8}, {128, 192, 0, 8}, {192, 256, 0, 4}};
    EXPECT_EQ(p, want);
    EXPECT_TRUE(pieces_between({128}, {128}, kLayers).empty());
    EXPECT_TRUE(pieces_between({64, 128, 4}, {64, 128, 4}, kLayers).empty());
}

}  // namespace
}  // namespace ferry::kv

// plan_block_copy: a KV transfer as both layouts' strides and the block lists, for copies whose
// addresses the GPU computes (TransferEngine::copy_blocks).
#include <fmt/format.h>

#include "ferry/kv/block_mapping.h"

namespace ferry::kv {
namespace {

// One side's strides, read off the layout's own offsets so that every placement and block
// order is what KvLayout says it is. Block b's slab of a (layer, K/V) is at b * block_stride
// from block 0's in every placement.
BlockCopySide side_of(const KvLayout& l, std::span<const uint32_t> blocks, uint32_t first_head) {
    BlockCopySide s;
    s.blocks = blocks;
    s.block_size = l.block_size;
    const uint64_t at0 = l.offset(0, KvPart::kK, 0, 0, 0);
    s.block_stride = l.slab_offset(0, KvPart::kK, 1) - l.slab_offset(0, KvPart::kK, 0);
    s.token_stride = l.offset(0, KvPart::kK, 0, 1, 0) - at0;
    s.head_stride = l.offset(0, KvPart::kK, 0, 0, 1) - at0;
    s.first_head = first_head;
    return s;
}

std::vector<BlockPlane> planes_of(const KvLayout& l, uint32_t first_layer, uint32_t end_layer) {
    std::vector<BlockPlane> planes;
    planes.reserve(2 * (end_layer - first_layer));
    for (uint32_t layer = first_layer; layer < end_layer; ++layer) {
        for (KvPart part : {KvPart::kK, KvPart::kV}) {
            const auto at = l.region_of(l.slab_offset(layer, part, 0));
            planes.push_back({at.region, at.offset});
        }
    }
    return planes;
}

}  // namespace

Result<BlockCopyPlan> plan_block_copy(const TransferSpec& spec) {
    FERRY_ASSIGN_OR_RETURN(const SharedHeads shared, check_transfer(spec));
    const KvLayout& sl = spec.src.layout;
    const KvLayout& dl = spec.dst.layout;
    if (sl.k_transposed() || dl.k_transposed()) {
        // The GPU copy moves (token, head) rows by strides; a transposed K has no such rows.
        return invalid_argument(fmt::format(
            "a block copy moves (token, head) rows, which a head-joint-kt pool's K does not "
            "have (vLLM's CPU pages): producer {}, consumer {}",
            sl.to_string(), dl.to_string()));
    }
    const uint32_t end_layer = spec.end_layer == 0 ? sl.num_layers : spec.end_layer;
    BlockCopyPlan plan;
    if (spec.first_token == spec.end_token || shared.count == 0) return plan;
    plan.src = side_of(sl, spec.src_blocks, shared.src_first);
    plan.dst = side_of(dl, spec.dst_blocks, shared.dst_first);
    plan.src_planes = planes_of(sl, spec.first_layer, end_layer);
    plan.dst_planes = planes_of(dl, spec.first_layer, end_layer);
    plan.first_token = spec.first_token;
    plan.end_token = spec.end_token;
    plan.heads = shared.count;
    plan.head_bytes = sl.head_bytes();
    plan.bytes = uint64_t{2} * (end_layer - spec.first_layer) *
                 (spec.end_token - spec.first_token) * shared.count * sl.head_bytes();
    return plan;
}

BlockCopyOp BlockCopyPlan::op() const {
    BlockCopyOp op;
    op.src = src;
    op.src.planes = src_planes;
    op.dst = dst;
    op.dst.planes = dst_planes;
    op.first_token = first_token;
    op.end_token = end_token;
    op.heads = heads;
    op.head_bytes = head_bytes;
    return op;
}

}  // namespace ferry::kv

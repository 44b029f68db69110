#include "segment_writes.h"

namespace ferry::kv::detail {
namespace {

// Pages per paged write: bounds one operation's batch so that the rails start on the first
// pages while later groups are still being built.
constexpr size_t kPagesPerOp = 1024;

}  // namespace

uint32_t post_writes(TransferEngine& engine, const MemoryRegion* src, PeerId peer,
                     const MemoryDescriptor* dst, std::span<const ByteRun> runs, uint32_t imm,
                     Flight& flight) {
    auto cb = [f = flight.shared_from_this()](const Status& s) { f->done(s); };
    uint32_t writes = 0;
    std::vector<uint32_t> src_pages, dst_pages;
    std::vector<ByteRun> long_runs;
    uint64_t page = 0;
    auto flush = [&] {
        if (src_pages.empty()) return;
        flight.add();
        PagedWriteOp op;
        op.peer = peer;
        op.src = src;
        op.dst = dst;
        op.page_size = page;
        op.src_pages = src_pages;
        op.dst_pages = dst_pages;
        op.imm = imm;
        writes += engine.paged_write(op, cb).imm_writes();
        src_pages.clear();
        dst_pages.clear();
    };
    auto pageable = [&](const ByteRun& r) {
        return r.length < engine.config().stripe_threshold && r.src_offset % r.length == 0 &&
               r.dst_offset % r.length == 0 && r.src_offset / r.length <= UINT32_MAX &&
               r.dst_offset / r.length <= UINT32_MAX;
    };
    for (const ByteRun& run : runs) {
        if (!pageable(run)) {
            long_runs.push_back(run);
            continue;
        }
        if (run.length != page || src_pages.size() == kPagesPerOp) {
            flush();
            page = run.length;
        }
        src_pages.push_back(static_cast<uint32_t>(run.src_offset / page));
        dst_pages.push_back(static_cast<uint32_t>(run.dst_offset / page));
    }
    flush();
    if (!long_runs.empty()) {
        flight.add();
        WriteRunsOp op;
        op.peer = peer;
        op.src = src;
        op.dst = dst;
        op.runs = long_runs;
        op.imm = imm;
        writes += engine.write_runs(op, cb).imm_writes();
    }
    return writes;
}

bool pools_on_gpu(TransferEngine& engine, PeerId peer, const KvPoolRegions& local,
                  std::span<const MemoryDescriptor> remote) {
    if (local.regions.empty() || remote.empty()) return false;
    const int device = local.regions[0]->descriptor().device;
    for (const MemoryRegion* r : local.regions) {
        if (r->descriptor().device != device || !engine.copies_on_gpu(peer, *r, remote[0])) {
            return false;
        }
    }
    for (const MemoryDescriptor& d : remote) {
        if (!engine.copies_on_gpu(peer, *local.regions[0], d)) return false;
    }
    return true;
}

Result<SegmentPlan> plan_segment(const TransferSpec& spec, bool on_gpu) {
    SegmentPlan plan;
    plan.on_gpu = on_gpu;
    if (on_gpu) {
        FERRY_ASSIGN_OR_RETURN(plan.copy, plan_block_copy(spec));
    } else {
        FERRY_ASSIGN_OR_RETURN(plan.runs, plan_transfer(spec));
    }
    return plan;
}

uint32_t post_block_copy(TransferEngine& engine, const SegmentPlan& plan, PeerId peer, bool read,
                         const KvPoolRegions& local, std::span<const MemoryDescriptor> remote,
                         std::optional<uint32_t> imm, Flight& flight) {
    if (plan.copy.bytes == 0) return 0;
    BlockCopyOp op = plan.copy.op();
    op.peer = peer;
    op.read = read;
    op.local = local.regions;
    op.remote = remote;
    op.imm = imm;
    flight.add();
    return engine.copy_blocks(op, [f = flight.shared_from_this()](const Status& s) { f->done(s); })
        .imm_writes();
}

}  // namespace ferry::kv::detail

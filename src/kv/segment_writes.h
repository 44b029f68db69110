// How a transfer becomes engine operations: one block copy between GPUs of one host, the
// planner's runs elsewhere (private to src/kv).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "connector_context.h"

namespace ferry::kv::detail {

// Both pools are GPU memory of this host (every pair of regions copies over CUDA IPC) and the
// local regions sit on one GPU: then a transfer goes as one block copy whose addresses the GPU
// computes (TransferEngine::copy_blocks), else as the planner's runs.
bool pools_on_gpu(TransferEngine& engine, PeerId peer, const KvPoolRegions& local,
                  std::span<const MemoryDescriptor> remote);

// One transfer (a push segment, a pull from one producer) planned before anything is posted.
struct SegmentPlan {
    bool on_gpu = false;
    BlockCopyPlan copy;  // on_gpu
    TransferPlan runs;   // otherwise
    uint64_t bytes() const { return on_gpu ? copy.bytes : runs.bytes; }
    // Engine operations before any splitting: the runs, or the one block copy.
    size_t operations() const { return on_gpu ? (copy.bytes ? 1 : 0) : runs.runs.size(); }
};
Result<SegmentPlan> plan_segment(const TransferSpec& spec, bool on_gpu);

// Posts plan.copy between the local pool and the peer's (a read when `read`: the peer's pool is
// the source); returns the immediates it delivers (0 or 1).
uint32_t post_block_copy(TransferEngine& engine, const SegmentPlan& plan, PeerId peer, bool read,
                         const KvPoolRegions& local, std::span<const MemoryDescriptor> remote,
                         std::optional<uint32_t> imm, Flight& flight);

// Posts the runs as writes carrying `imm`; returns how many immediates they deliver. Short
// runs of one length (one block or one head slice each, the scattered-blocks case) go out
// as paged writes of up to 1024 pages; the long runs (one per layer and K/V when
// blocks are consecutive) go out together as one write_runs. Either way one engine
// operation and one completion per group instead of one per run: between GPUs a 16k-token
// push was 128 copies and 128 immediates (2026-12-01). On fabric paths the engine still
// stripes long runs across rails.
uint32_t post_writes(TransferEngine& engine, const MemoryRegion* src, PeerId peer,
                     const MemoryDescriptor* dst, std::span<const ByteRun> runs, uint32_t imm,
                     Flight& flight);

}  // namespace ferry::kv::detail

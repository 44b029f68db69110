// How a segment's byte runs become engine operations (private to src/kv).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "connector_context.h"

namespace ferry::kv::detail {

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

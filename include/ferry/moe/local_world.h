// The single-process reference: every rank of a group as a thread of this process, each with
// its own memory, joined by MappedTransport (memcpy + arrival counters). It runs the exact
// protocol of the multi-process all-to-all, which makes it the oracle for the other backends
// and a way to test models' MoE layers without a fabric.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/moe/config.h"
#include "ferry/moe/cpu_backend.h"
#include "ferry/moe/transport.h"

namespace ferry::moe {

class LocalWorld {
  public:
    // cfg.rank is ignored: one rank per 0..world_size-1 is built.
    static Result<std::unique_ptr<LocalWorld>> create(const AllToAllConfig& cfg, Duration timeout);
    ~LocalWorld();

    uint32_t size() const { return static_cast<uint32_t>(ranks_.size()); }
    CpuBackend& rank(uint32_t r);

    // Runs fn(rank) on one thread per rank and joins them all; the first error (by rank)
    // wins, with the rank named.
    Status run(const std::function<Status(uint32_t rank, CpuBackend& backend)>& fn);

  private:
    struct Rank;
    LocalWorld() = default;
    std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace ferry::moe

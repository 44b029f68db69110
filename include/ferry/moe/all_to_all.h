// Expert-parallel all-to-all over the TransferEngine: one object per rank, one process per
// rank. Ranks of one node (ranks_per_node consecutive ranks) map each other's buffers through
// POSIX shared memory and copy directly; other ranks are reached by engine writes with
// immediates, issued by a host proxy thread. The compute side is the CPU backend.
//
//   auto a2a = AllToAll::create(cfg, engine, allgather);
//   a2a->dispatch_send(in);          // returns once every row is on its way
//   a2a->dispatch_recv(batch);       // rows grouped per local expert
//   ... experts ...
//   a2a->combine_send(expert_out);
//   a2a->combine_recv(out);          // weighted sum per token
//
// All ranks call in the same order; buffers are reused from call to call (see
// cpu_backend.h for why that is safe). Before destroying, make sure every rank has finished
// its last combine_recv (a barrier), or a late peer may write into freed memory.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/moe/config.h"
#include "ferry/moe/cpu_backend.h"

namespace ferry::moe {

struct AllToAllOptions {
    // Deadline of every wait inside one call (peers' counts, rows, results).
    Duration timeout = std::chrono::seconds(10);
    // Immediates used are [imm_base, imm_base + 3 * kMaxWorldSize): keep clear of other users
    // of the same engine.
    uint32_t imm_base = 0x6d6f0000;
};

// Collective exchange among all ranks at setup (the caller's bootstrap: MPI, a store, the
// test harness): every rank's blob, indexed by rank.
using AllGatherFn =
    std::function<Result<std::vector<std::vector<uint8_t>>>(std::span<const uint8_t>)>;

class AllToAll {
  public:
    // Collective: every rank calls it with the same config (except rank). Fails with a clear
    // error if configs differ, or if ranks of one node are not on one host.
    static Result<std::unique_ptr<AllToAll>> create(const AllToAllConfig& cfg,
                                                    TransferEngine* engine,
                                                    const AllGatherFn& allgather,
                                                    const AllToAllOptions& options = {});
    ~AllToAll();  // stops and joins the proxy, deregisters and unmaps everything

    AllToAll(const AllToAll&) = delete;
    AllToAll& operator=(const AllToAll&) = delete;

    const AllToAllConfig& config() const;

    Status dispatch_send(const DispatchInput& in);
    Status dispatch_recv(const ExpertBatch& out);
    Status combine_send(std::span<const uint16_t> expert_out);
    Status combine_recv(std::span<float> out);
    Status combine_recv_bf16(std::span<uint16_t> out);
    // See CpuBackend::set_combine_weights.
    Status set_combine_weights(std::span<const float> weights);

    const std::vector<uint32_t>& sent_expert_counts() const;
    PhaseBytes last_bytes() const;

  private:
    struct Impl;
    explicit AllToAll(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::moe

// A plain libfabric endpoint driven by one thread, as a user would write a write loop by
// hand. The benchmark measures it beside the engine on the same provider, so the engine's
// overhead is a ratio against the provider's own ceiling measured in the same run.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"

namespace ferry::detail {

class RawEndpoint {
  public:
    static Result<std::unique_ptr<RawEndpoint>> open(const EngineConfig& config, void* buf,
                                                     size_t len);
    ~RawEndpoint();

    const std::vector<uint8_t>& name() const { return name_; }
    uint64_t key() const { return key_; }
    // Remote address of byte 0 of the registered buffer as peers must put it on the wire.
    uint64_t wire_base() const { return virt_ ? reinterpret_cast<uint64_t>(buf_) : 0; }

    Result<fi_addr_t> insert(std::span<const uint8_t> addr);
    // Writes `size`-byte messages, `window` in flight, source and destination rotating over
    // `slots` slots of `size` bytes, for `duration`; returns bytes per second.
    Result<double> write_loop(fi_addr_t dest, uint64_t remote_base, uint64_t remote_key,
                              size_t size, int window, int slots, Duration duration);
    // Message rate: `size`-byte writes (with remote CQ data when `imm`), `window` in flight,
    // posted one at a time round robin over the targets, each target's destination rotating
    // over `slots` slots of `size` bytes from its base, for `duration`; returns writes per
    // second. The ceiling for the engine's many-peer writes and scatters.
    struct Target {
        fi_addr_t dest = FI_ADDR_UNSPEC;
        uint64_t base = 0;
        uint64_t key = 0;
    };
    Result<double> rate_loop(std::span<const Target> targets, size_t size, bool imm, int window,
                             int slots, Duration duration);
    // Target side: polls the completion queue (tcp needs the target to drive progress),
    // yielding the core when nothing came.
    void progress();
    // One poll without yielding; true when it found completions. For a thread that sweeps
    // many endpoints and yields once per sweep (a yield per empty endpoint starved the busy
    // one: tcp at 16 KiB fell to 0.07 GB/s with 65 endpoints swept).
    bool poll();
    bool virt_addr() const { return virt_; }
    // Writes completed by write_loop and rate_loop so far: with the engine's ops_posted, what a
    // per-operation cost (CPU time, or instructions under callgrind) is divided by.
    uint64_t completed() const { return completed_; }

  private:
    RawEndpoint() = default;
    fi_info* info_ = nullptr;
    fid_fabric* fabric_ = nullptr;
    fid_domain* domain_ = nullptr;
    fid_ep* ep_ = nullptr;
    fid_av* av_ = nullptr;
    fid_cq* cq_ = nullptr;
    fid_mr* mr_ = nullptr;
    void* buf_ = nullptr;
    size_t len_ = 0;
    uint64_t key_ = 0;
    bool virt_ = true;
    std::vector<uint8_t> name_;
    uint64_t completed_ = 0;
};

}  // namespace ferry::detail

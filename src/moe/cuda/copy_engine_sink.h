// The host proxy's way onto the GPU without GDRCopy: a put's bytes go from the pinned inbox to
// the rank's region with cudaMemcpyAsync, and an arrival counter is set by another
// cudaMemcpyAsync behind it on the same non-blocking stream, so kernels that see the counter
// see the bytes. Copies, not kernels: the proxy thread must never launch (see kernels.h
// preload_*), and the copy engine runs while the rank's kernels spin.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "ferry/common/status.h"
#include "moe/device_proxy.h"

namespace ferry::moe::cuda {

class CopyEngineSink final : public DeviceSink {
  public:
    // inbox: pinned host memory laid out like `region` (device); counters: the 3 * world
    // arrival counters at the start of the region; error_claimed: the device flag that makes
    // this rank's waits give up.
    static Result<std::unique_ptr<CopyEngineSink>> create(int device, const uint8_t* inbox,
                                                          uint8_t* region, uint32_t counters,
                                                          uint32_t* error_claimed);
    ~CopyEngineSink() override;  // waits for the copies still queued

    Status copy(uint64_t offset, uint64_t len) override;
    Status raise(uint64_t offset, uint64_t value) override;
    void abort() override;

  private:
    CopyEngineSink() = default;
    Status on_device();

    int device_ = 0;
    bool device_set_ = false;  // the proxy thread selected device_
    const uint8_t* inbox_ = nullptr;
    uint8_t* region_ = nullptr;
    uint32_t* error_claimed_ = nullptr;
    cudaStream_t stream_ = nullptr;
    // One pinned value slot per counter (slot 0 after the counters: the abort flag's 1), and
    // the event of its last copy: a slot is rewritten only once that copy has read it.
    uint64_t* values_ = nullptr;
    std::vector<cudaEvent_t> done_;
};

}  // namespace ferry::moe::cuda

// Registered memory: each region's registration on its rails (those RailPlacement picks), the ids
// regions are known by, and where GPU memory goes (registered with the provider under FI_HMEM,
// exported through CUDA IPC, or both). Fills a region's descriptor; MemoryRegion itself is built by
// the engine.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "fabric/gpu_copy_path.h"
#include "fabric/rail_group.h"
#include "fabric/rail_placement.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/fabric/types.h"

namespace ferry::detail {

class MemoryRegistry {
  public:
    struct Settings {
        uint64_t engine_id = 0;
        std::string provider;
        bool gpu_ipc = true;          // EngineConfig::gpu_ipc
        bool fabric_gpu = false;      // rails opened with FI_HMEM, CUDA memory registered there
        std::string fabric_gpu_note;  // why (not), for errors and logs
        // EngineConfig::op_timeout: how long remove() waits, at most, for operations on the
        // memory that libfabric still holds (Rail::settle_local).
        Duration op_timeout = std::chrono::seconds(10);
        RailPlacement placement;  // which rails each region goes on
    };
    // What a region needs to know about its registration.
    struct Registration {
        uint32_t id = 0;
        MemoryDescriptor desc;
        std::vector<void*> local_descs;  // per rail, fi_mr_desc (null without registration)
    };

    MemoryRegistry(RailGroup& rails, GpuCopyPath& gpu) : rails_(rails), gpu_(gpu) {}
    void configure(Settings s) { settings_ = std::move(s); }

    bool fabric_gpu() const { return settings_.fabric_gpu; }
    const std::string& fabric_gpu_note() const { return settings_.fabric_gpu_note; }

    // Registers [ptr, len): host memory on the rails its placement picks; kCuda memory through
    // CUDA IPC and, where the provider takes it, on the rails its placement picks. On failure
    // nothing stays registered. `access`: what peers may do through the rails' registrations
    // (without kRead the provider refuses their reads); the default is what every caller had.
    Result<Registration> add(void* ptr, size_t len, MemoryKind kind, int device,
                             RemoteAccess access = RemoteAccess::kReadWrite);
    // add() for each of `ranges`, with one task on each rail's worker for all of them where
    // they are host memory (a KV pull offer registers one region per run of its blocks: 128
    // one by one took 2.2 ms of its caller's time). All or nothing.
    Result<std::vector<Registration>> add(std::span<const std::span<uint8_t>> ranges,
                                          MemoryKind kind, int device, RemoteAccess access);
    // Closes the region's registrations (a no-op once close_all ran), once libfabric has
    // returned every operation on its memory (timed-out ones too), or after op_timeout.
    void remove(uint32_t id);
    // Shutdown, after the rails stopped: closes every registration left, except on wedged
    // rails (their domain is never closed either).
    void close_all();
    // Registrations live now.
    size_t count() const {
        std::lock_guard lk(mu_);
        return mrs_.size();
    }

  private:
    // Registers on the rails of `on` (CUDA memory on cuda_device when >= 0), filling keys, the
    // rail mask and local descriptors; on failure what was registered is closed again.
    Status register_on_rails(void* ptr, size_t len, int cuda_device, RailSet on,
                             RemoteAccess access, Registration& reg);

    RailGroup& rails_;
    GpuCopyPath& gpu_;
    Settings settings_;

    mutable std::mutex mu_;
    uint32_t next_id_ = 1;
    struct Registered {
        const void* base = nullptr;
        size_t len = 0;
        std::vector<fid_mr*> mrs;  // per rail, null on rails without the region
    };
    std::map<uint32_t, Registered> mrs_;
};

}  // namespace ferry::detail

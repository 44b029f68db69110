// Same-host GPU transfers (CUDA IPC over NVLink), behind an interface free of CUDA headers so
// the engine compiles the same with or without CUDA. Created on first use of GPU memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "fabric/block_copy_geom.h"
#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/fabric/types.h"

namespace ferry::detail {

// Host memory the GPU transport uploads from as it is, without another copy: page-locked with
// CUDA (taken from a process-wide pool, given back when freed), plain heap memory without.
// Page ids were copied twice on the host before their upload (into the operation, then into
// the launch's pinned list), and the vectors' fresh pages faulted on every call.
void* staging_alloc(size_t bytes);
void staging_free(void* p, size_t bytes) noexcept;

template <typename T>
struct StagingAllocator {
    using value_type = T;
    StagingAllocator() = default;
    template <typename U>
    StagingAllocator(const StagingAllocator<U>&) {}  // NOLINT: allocator rebinding
    T* allocate(size_t n) { return static_cast<T*>(staging_alloc(n * sizeof(T))); }
    void deallocate(T* p, size_t n) noexcept { staging_free(p, n * sizeof(T)); }
    // resize() leaves the ids unset: the caller writes every one (no zeroing pass first).
    template <typename U>
    void construct(U* p) noexcept {
        ::new (static_cast<void*>(p)) U;
    }
    template <typename U, typename... A>
    void construct(U* p, A&&... a) {
        ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
    }
    friend bool operator==(const StagingAllocator&, const StagingAllocator&) { return true; }
    friend bool operator!=(const StagingAllocator&, const StagingAllocator&) { return false; }
};

using StagedIds = std::vector<uint32_t, StagingAllocator<uint32_t>>;

// Runs and pages at least this long are copied by the tiled kernel (a block per 64 or 128 KiB
// tile); shorter ones in pieces, one warp each.
constexpr uint64_t kTiledRunMin = 64 * 1024;

struct GpuCopy {
    uint64_t dst;  // device-visible addresses
    uint64_t src;
    uint64_t len;
};

// Pages of one size: page k goes from src + ids[k] * src_stride to
// dst + ids[pages() + k] * dst_stride. The device computes the addresses from the ids, so a paged
// write costs the host 8 bytes a page instead of a copy descriptor per run.
struct GpuPagedCopy {
    uint64_t dst;  // device-visible addresses of page 0
    uint64_t src;
    uint64_t page_size;
    uint64_t src_stride;
    uint64_t dst_stride;
    // Every page's source id, then every page's destination id (2 x pages() entries), staged:
    // the launch uploads them straight from here, one copy for both.
    StagedIds ids;
    size_t pages() const { return ids.size() / 2; }
};

// A block copy (BlockCopyOp): the kernel computes each piece's addresses from the geometry,
// the block ids and the planes' addresses (block 0, first head applied; device-visible).
struct GpuBlockCopy {
    BlockCopyGeom geom;
    std::vector<uint32_t> src_blocks;
    std::vector<uint32_t> dst_blocks;
    std::vector<uint64_t> src_planes;
    std::vector<uint64_t> dst_planes;
};

// What one operation hands the transport: irregular runs, paged copies, block copies.
struct GpuWork {
    std::vector<GpuCopy> copies;
    std::vector<GpuPagedCopy> paged;
    std::vector<GpuBlockCopy> blocks;
    uint64_t bytes() const;
};

class GpuTransport {
  public:
    virtual ~GpuTransport() = default;
    // Fills the descriptor's IPC fields for device memory [ptr, ptr+len) on `device`.
    virtual Status export_memory(void* ptr, size_t len, int device, MemoryDescriptor* d) = 0;
    // Maps a same-host peer's GPU region into this process (opened once, cached); returns the
    // address of its byte 0 as seen from `local_device`.
    virtual Result<uint64_t> map_remote(const MemoryDescriptor& d, int local_device) = 0;
    // Runs the copies on `device` (the source of a push, the destination of a pull) and calls
    // done once they all completed. Never blocks the caller.
    virtual void submit(int device, GpuWork work, std::function<void(const Status&)> done) = 0;
    // Jobs submitted and not completed yet.
    virtual size_t in_flight() const = 0;
};

// Fails with a clear message when ferry was built without CUDA or no GPU is visible.
Result<std::unique_ptr<GpuTransport>> create_gpu_transport(const EngineConfig& config);

}  // namespace ferry::detail

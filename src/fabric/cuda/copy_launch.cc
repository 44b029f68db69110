#include "fabric/cuda/copy_launch.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_set>

#include "common/cuda_check.h"
#include "fabric/cuda/copy_kernel.h"

namespace ferry::detail {
namespace {

// Runs at least this long go to the tiled kernel as one page each rather than being cut into
// chunks on the host: listing a 256 MiB write as 16k chunks and uploading them before the
// kernel could start held it at 0.60x of the copy ceiling; as one page it ran at 0.77x
// (165.8 us, one H200, 2026-12-02). From 1 MiB down to kTiledRunMin with the tiled kernel.
constexpr uint64_t kRunAsPage = kTiledRunMin;
static_assert(kTilePage == kTiledRunMin, "runs as pages go to the tiled kernel");

size_t align8(size_t n) { return (n + 7) & ~size_t{7}; }

// Pinned host memory for staged ids, in power-of-two classes from 4 KiB, kept for reuse: the
// same sizes come back call after call. Taken on the callers' threads, freed on the
// transport's. Where pinning fails the memory comes from the heap (the upload then goes
// through the driver's own staging).
class StagingPool {
  public:
    void* take(size_t bytes) {
        const int k = size_class(bytes);
        {
            std::lock_guard lk(mu_);
            if (!free_[k].empty()) {
                void* p = free_[k].back();
                free_[k].pop_back();
                return p;
            }
        }
        void* p = nullptr;
        if (cudaHostAlloc(&p, kMin << k, cudaHostAllocPortable) != cudaSuccess) {
            cudaGetLastError();
            p = ::operator new(kMin << k);
            std::lock_guard lk(mu_);
            heap_.insert(p);
        }
        return p;
    }
    void give(void* p, size_t bytes) noexcept {
        const int k = size_class(bytes);
        std::unique_lock lk(mu_);
        if (heap_.erase(p) > 0) {
            lk.unlock();
            ::operator delete(p);
            return;
        }
        if (free_[k].size() < kKeep) {
            free_[k].push_back(p);
            return;
        }
        lk.unlock();
        cudaFreeHost(p);
    }

  private:
    static constexpr size_t kMin = 4096;
    static constexpr size_t kKeep = 16;  // per class
    static int size_class(size_t bytes) {
        int k = 0;
        while ((kMin << k) < bytes) ++k;
        return k;
    }
    std::mutex mu_;
    std::vector<void*> free_[48];
    std::unordered_set<void*> heap_;
};

// Never destroyed: pinned memory may still be freed by threads ending at exit.
StagingPool& staging_pool() {
    static auto* pool = new StagingPool();
    return *pool;
}

}  // namespace

void* staging_alloc(size_t bytes) { return staging_pool().take(bytes); }
void staging_free(void* p, size_t bytes) noexcept {
    if (p) staging_pool().give(p, bytes);
}

PinnedBufferPool::~PinnedBufferPool() {
    for (auto& b : free_) free(b);
}

void PinnedBufferPool::free(PinnedBuffer& b) {
    if (b.ptr) cudaFreeHost(b.ptr);
    if (b.dev) cudaFree(b.dev);
    b = PinnedBuffer{};
}

PinnedBuffer PinnedBufferPool::take(size_t bytes, int device) {
    for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].capacity >= bytes && free_[i].device == device) {
            PinnedBuffer b = free_[i];
            free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
            return b;
        }
    }
    size_t cap = 64 * 1024;
    while (cap < bytes) cap *= 2;
    PinnedBuffer b;
    if (cudaHostAlloc(reinterpret_cast<void**>(&b.ptr), cap, cudaHostAllocPortable) !=
        cudaSuccess) {
        b.ptr = nullptr;
        return b;
    }
    if (cudaMalloc(reinterpret_cast<void**>(&b.dev), cap) != cudaSuccess) {
        cudaFreeHost(b.ptr);
        return PinnedBuffer{};
    }
    b.device = device;
    b.capacity = cap;
    return b;
}

void PinnedBufferPool::give(PinnedBuffer b) {
    if (b.ptr) free_.push_back(b);
}

Status launch_copy_work(const std::vector<const GpuWork*>& works, uint64_t bytes, int device,
                        int sms, bool with_runs, cudaStream_t stream, PinnedBufferPool& pool,
                        PinnedBuffer* buf, LaunchStamps* stamps) {
    // Chunks of 16 KiB give every warp work even for one 4 MiB run; for hundreds of MiB they
    // only lengthen the list the host builds and uploads (32k entries took ~150 us for a
    // 512 MiB KV push, 2026-12-01), so large launches use larger chunks, still about two per
    // warp.
    const uint64_t warps = uint64_t(kCopyBlocksPerSm) * sms * kCopyWarpsPerBlock;
    const uint64_t chunk = std::clamp<uint64_t>(bytes / (2 * warps) / kMaxChunk * kMaxChunk,
                                                kMaxChunk, 16 * kMaxChunk);
    size_t num_chunks = 0, num_segs = 0, num_ids = 0, num_block_segs = 0, num_planes = 0;
    size_t num_tile_segs = 0;
    uint64_t shortest_tiled = UINT64_MAX;  // picks the tile size (kTileThreadsLarge or Small)
    size_t num_staged = 0;  // paged copies' ids, uploaded from where the operation staged them
    auto count_segment = [&](uint64_t page_size) {
        if (page_size >= kTilePage) {
            num_tile_segs++;
            shortest_tiled = std::min(shortest_tiled, page_size);
        } else {
            num_segs++;
        }
    };
    for (const GpuWork* w : works) {
        for (size_t r = 0; with_runs && r < w->copies.size(); ++r) {
            const uint64_t len = w->copies[r].len;
            if (len >= kRunAsPage) {
                count_segment(len);
            } else {
                num_chunks += (len + chunk - 1) / chunk;
            }
        }
        for (const auto& p : w->paged) {
            if (p.pages() == 0) continue;
            count_segment(p.page_size);
            num_staged += p.ids.size();
        }
        for (const auto& b : w->blocks) {
            num_block_segs++;
            num_planes += b.src_planes.size() + b.dst_planes.size();
            num_ids += b.src_blocks.size() + b.dst_blocks.size();
        }
    }
    // One list: [chunks][paged segments][tiled segments][block segments][plane addresses][ids],
    // passed to the kernels as their parameter when it is short, else uploaded in one copy;
    // then on the device only [staged ids], each paged copy's uploaded from its staging.
    const size_t seg_at = align8(num_chunks * sizeof(CopyChunk));
    const size_t tile_seg_at = seg_at + num_segs * sizeof(PagedSegment);
    const size_t block_seg_at = tile_seg_at + num_tile_segs * sizeof(PagedSegment);
    const size_t planes_at = block_seg_at + num_block_segs * sizeof(BlockCopySegment);
    const size_t ids_at = planes_at + num_planes * sizeof(uint64_t);
    const size_t list_bytes = ids_at + num_ids * sizeof(uint32_t);
    const size_t staged_at = (list_bytes + 15) & ~size_t{15};
    const size_t total = staged_at + num_staged * sizeof(uint32_t);
    if (list_bytes == 0 && num_staged == 0) return ok_status();
    const bool inline_list = list_bytes <= inline_list_limit();
    alignas(16) char inline_bytes[kInlineListLarge];
    if (!inline_list || num_staged > 0) {
        *buf = pool.take(total, device);
        if (!buf->ptr) return resource_exhausted("allocating the GPU copy list failed");
    }
    char* host = inline_list ? inline_bytes : buf->ptr;
    auto* chunks = reinterpret_cast<CopyChunk*>(host);
    auto* segs = reinterpret_cast<PagedSegment*>(host + seg_at);
    auto* tile_segs = reinterpret_cast<PagedSegment*>(host + tile_seg_at);
    const int tile_threads = shortest_tiled >= kTileLarge ? kTileThreadsLarge : kTileThreadsSmall;
    const uint64_t tile = static_cast<uint64_t>(tile_threads) * kTileBytesPerThread;
    auto* ids = reinterpret_cast<uint32_t*>(host + ids_at);
    auto* dev_staged = buf->dev ? reinterpret_cast<uint32_t*>(buf->dev + staged_at) : nullptr;
    struct Upload {
        void* dst;
        const void* src;
        size_t bytes;
    };
    std::vector<Upload> uploads;
    size_t k = 0, s = 0, ts = 0, id = 0, staged = 0;
    uint64_t items = 0, tiles = 0;
    // A page of at least kTilePage goes to the tiled kernel, cut into tiles; a shorter one to
    // the paged kernel, cut into pieces of kPagePiece.
    auto add_segment = [&](uint64_t src, uint64_t dst, uint64_t page_size, uint64_t src_stride,
                           uint64_t dst_stride, const uint32_t* src_ids, const uint32_t* dst_ids,
                           size_t n) {
        const bool tiled = page_size >= kTilePage;
        const uint64_t piece = tiled ? tile : kPagePiece;
        uint64_t& first = tiled ? tiles : items;
        const auto pieces = static_cast<uint32_t>((page_size + piece - 1) / piece);
        (tiled ? tile_segs[ts++] : segs[s++]) = {reinterpret_cast<const char*>(src),
                                                 reinterpret_cast<char*>(dst),
                                                 src_ids,
                                                 dst_ids,
                                                 page_size,
                                                 src_stride,
                                                 dst_stride,
                                                 first,
                                                 pieces,
                                                 static_cast<uint32_t>(n)};
        first += uint64_t{pieces} * n;
    };
    for (const GpuWork* w : works) {
        for (size_t r = 0; with_runs && r < w->copies.size(); ++r) {
            const GpuCopy& c = w->copies[r];
            if (c.len >= kRunAsPage) {
                add_segment(c.src, c.dst, c.len, 0, 0, nullptr, nullptr, 1);
                continue;
            }
            for (uint64_t off = 0; off < c.len; off += chunk) {
                chunks[k++] = {reinterpret_cast<const void*>(c.src + off),
                               reinterpret_cast<void*>(c.dst + off),
                               std::min<uint64_t>(chunk, c.len - off)};
            }
        }
        for (const auto& p : w->paged) {
            const size_t n = p.pages();
            if (n == 0) continue;
            uint32_t* at = dev_staged + staged;
            add_segment(p.src, p.dst, p.page_size, p.src_stride, p.dst_stride, at, at + n, n);
            uploads.push_back({at, p.ids.data(), p.ids.size() * sizeof(uint32_t)});
            staged += p.ids.size();
        }
    }
    auto* block_segs = reinterpret_cast<BlockCopySegment*>(host + block_seg_at);
    auto* planes = reinterpret_cast<uint64_t*>(host + planes_at);
    size_t bs = 0, pl = 0;
    uint64_t block_items = 0;
    // Copies v into the list at *at (counted in v's elements from `first`, the section's
    // offset) and returns where it went as a byte offset from the list's start.
    auto put = [&](auto* section, size_t first, size_t& at, const auto& v) {
        std::memcpy(section + at, v.data(), v.size() * sizeof(v[0]));
        at += v.size();
        return first + (at - v.size()) * sizeof(v[0]);
    };
    for (const GpuWork* w : works) {
        for (const auto& b : w->blocks) {
            BlockCopySegment& seg = block_segs[bs++];
            seg.g = b.geom;
            seg.src_planes_at = put(planes, planes_at, pl, b.src_planes);
            seg.dst_planes_at = put(planes, planes_at, pl, b.dst_planes);
            seg.src_blocks_at = put(ids, ids_at, id, b.src_blocks);
            seg.dst_blocks_at = put(ids, ids_at, id, b.dst_blocks);
            seg.first_item = block_items;
            block_items += b.geom.items;
        }
    }
    if (stamps) stamps->list_built = Clock::now();
    CopyList list;
    list.bytes = list_bytes;
    if (inline_list) {
        list.host = inline_bytes;
    } else {
        list.device = buf->dev;
        FERRY_CUDA_TRY(
            cudaMemcpyAsync(buf->dev, buf->ptr, list_bytes, cudaMemcpyHostToDevice, stream));
    }
    for (const Upload& u : uploads) {
        FERRY_CUDA_TRY(cudaMemcpyAsync(u.dst, u.src, u.bytes, cudaMemcpyHostToDevice, stream));
    }
    if (stamps) stamps->uploaded = Clock::now();
    // Two blocks of 16 warps per SM keep enough stores in flight to hide NVLink latency; the
    // grid asks for kCopyGridFactor times that.
    const int grid = kCopyGridFactor * kCopyBlocksPerSm * sms;
    FERRY_CUDA_TRY(launch_batched_copy(list, 0, static_cast<int>(num_chunks), grid, stream));
    FERRY_CUDA_TRY(
        launch_paged_copy(list, seg_at, static_cast<int>(num_segs), items, grid, stream));
    FERRY_CUDA_TRY(launch_tiled_copy(list, tile_seg_at, static_cast<int>(num_tile_segs), tiles,
                                     tile_threads, stream));
    FERRY_CUDA_TRY(launch_block_copy(list, block_seg_at, static_cast<int>(num_block_segs),
                                     block_items, grid, stream));
    if (stamps) stamps->launched = Clock::now();
    return ok_status();
}

}  // namespace ferry::detail

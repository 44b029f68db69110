// CUDA IPC transport: same-host GPU peers map each other's memory and writes become copies
// over NVLink, run by one worker thread that launches batched copy kernels (or copy-engine
// memcpys) and polls their events.
#include <cuda.h>
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "common/cuda_check.h"
#include "fabric/cuda/copy_kernel.h"
#include "fabric/cuda/copy_launch.h"
#include "fabric/gpu_transport.h"
#include "ferry/common/clock.h"
#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"

namespace ferry::detail {
namespace {

// Jobs wait for a busy device unless this much piled up: then a second launch is worth it.
constexpr uint64_t kLaunchWhileBusyBytes = 256ull << 20;

// Above this a single contiguous copy goes to the copy engine when the mode is auto.
constexpr uint64_t kCopyEngineThreshold = 64ull << 20;

class CudaTransport final : public GpuTransport {
  public:
    explicit CudaTransport(const EngineConfig& config) : config_(config) {}
    ~CudaTransport() override;
    Status init();

    Status export_memory(void* ptr, size_t len, int device, MemoryDescriptor* d) override;
    Result<uint64_t> map_remote(const MemoryDescriptor& d, int local_device) override;
    void submit(int device, GpuWork work, std::function<void(const Status&)> done) override;
    size_t in_flight() const override { return pending_.load(std::memory_order_relaxed); }

  private:
    struct Job {
        int device;
        GpuWork work;
        std::function<void(const Status&)> done;
        TimePoint submitted = Clock::now();
    };
    struct InFlight {
        int device = -1;
        cudaEvent_t event;
        PinnedBuffer buf;
        std::vector<std::function<void(const Status&)>> done;
        uint64_t bytes = 0;          // of every job launched together (sizes the copy chunks)
        std::vector<GpuWork> works;  // their staged ids, until the stream passed the uploads
        // For FERRY_GPU_TRACE: what went out together and when.
        TimePoint first_submitted, launch_begin, launch_end;
        LaunchStamps steps;
        size_t copies = 0;
    };
    void trace_completion(const InFlight& f) const;
    void run();
    // Launches every job in `jobs` (one device) as one kernel, or copy-engine copies.
    Status launch(int device, std::vector<Job>& jobs, InFlight* out);
    Result<cudaStream_t> stream_for(int device);

    EngineConfig config_;
    // FERRY_GPU_TRACE=1: one line per launch on stderr (jobs merged, bytes, waits), to see
    // where a transfer's time goes without a profiler.
    const bool trace_ = std::getenv("FERRY_GPU_TRACE") != nullptr;
    uint64_t trace_launches_ = 0;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Job> jobs_;
    bool stop_ = false;
    std::thread worker_;

    // Worker-thread state.
    std::map<int, cudaStream_t> streams_;
    std::map<int, int> sm_count_;
    PinnedBufferPool buffers_;
    std::deque<InFlight> inflight_;
    std::map<int, std::vector<Job>> waiting_;  // jobs held while their device copies
    std::map<int, uint64_t> waiting_bytes_;
    std::map<int, int> busy_;  // launches in flight per device
    static uint64_t job_bytes(const Job& j) { return j.work.bytes(); }
    std::vector<cudaEvent_t> free_events_;

    std::atomic<size_t> pending_{0};  // submitted, not completed

    std::mutex map_mu_;
    std::map<std::pair<int, std::string>, uint64_t> opened_;  // (device, handle) -> base
};

Status CudaTransport::init() {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        return unavailable(
            fmt::format("no CUDA device is visible ({}); GPU memory cannot be "
                        "registered on this host",
                        e == cudaSuccess ? "0 devices" : cudaGetErrorString(e)));
    }
    worker_ = std::thread([this] {
        set_thread_name("ferry-gpucopy");
        run();
    });
    return ok_status();
}

CudaTransport::~CudaTransport() {
    {
        std::lock_guard lk(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    for (auto& f : inflight_) {
        cudaEventSynchronize(f.event);
        for (auto& d : f.done) d(cancelled("the transfer engine was shut down"));
        cudaEventDestroy(f.event);
        PinnedBufferPool::free(f.buf);
    }
    for (auto& j : jobs_) j.done(cancelled("the transfer engine was shut down"));
    for (auto& [dev, group] : waiting_) {
        for (auto& j : group) j.done(cancelled("the transfer engine was shut down"));
    }
    for (auto ev : free_events_) cudaEventDestroy(ev);
    for (auto& [dev, s] : streams_) cudaStreamDestroy(s);
    for (auto& [key, base] : opened_) {
        cudaSetDevice(key.first);
        cudaIpcCloseMemHandle(reinterpret_cast<void*>(base));
    }
}

Status CudaTransport::export_memory(void* ptr, size_t len, int device, MemoryDescriptor* d) {
    cudaPointerAttributes attr{};
    FERRY_CUDA_TRY(cudaPointerGetAttributes(&attr, ptr));
    if (attr.type != cudaMemoryTypeDevice) {
        return invalid_argument(
            fmt::format("{} is not device memory (cudaMalloc it, or register "
                        "it as host memory)",
                        ptr));
    }
    if (device >= 0 && attr.device != device) {
        return invalid_argument(
            fmt::format("memory at {} lives on GPU {}, not GPU {}", ptr, attr.device, device));
    }
    // IPC handles name whole allocations: find the allocation and our offset inside it.
    // Through the runtime's entry point: ferry does not link the driver library, so the same
    // binary runs (and refuses GPU memory clearly) on hosts without a driver.
    using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
    static GetRange get_range = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                             &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess) {
            fn = nullptr;
        }
        return reinterpret_cast<GetRange>(fn);
    }();
    if (!get_range) return unavailable("the CUDA driver has no cuMemGetAddressRange");
    CUdeviceptr base = 0;
    size_t alloc_len = 0;
    CUresult cr = get_range(&base, &alloc_len, reinterpret_cast<CUdeviceptr>(ptr));
    if (cr != CUDA_SUCCESS) {
        return provider_error(
            fmt::format("cuMemGetAddressRange failed ({})", static_cast<int>(cr)));
    }
    if (reinterpret_cast<CUdeviceptr>(ptr) + len > base + alloc_len) {
        return out_of_range(
            fmt::format("registering {} bytes at {} runs past the end of its "
                        "allocation ({} bytes)",
                        len, ptr, alloc_len));
    }
    cudaIpcMemHandle_t h;
    FERRY_CUDA_TRY(cudaSetDevice(attr.device));
    FERRY_CUDA_TRY(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)));
    static_assert(sizeof(h) == 64);
    std::memcpy(d->ipc_handle.data(), &h, sizeof(h));
    d->has_ipc = true;
    d->ipc_offset = reinterpret_cast<CUdeviceptr>(ptr) - base;
    d->ipc_pid = static_cast<int32_t>(getpid());
    d->device = attr.device;
    return ok_status();
}

Result<uint64_t> CudaTransport::map_remote(const MemoryDescriptor& d, int local_device) {
    if (!d.has_ipc) return invalid_argument("remote GPU region carries no CUDA IPC handle");
    if (d.ipc_pid == static_cast<int32_t>(getpid())) {
        // Both engines live in this process (a process driving several GPUs): CUDA refuses to
        // open a handle in its exporter, and needs none: the pointer is valid here already.
        if (d.device != local_device) {
            FERRY_CUDA_TRY(cudaSetDevice(local_device));
            cudaError_t e = cudaDeviceEnablePeerAccess(d.device, 0);
            if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
                return FERRY_CUDA_ERROR(e, "cudaDeviceEnablePeerAccess");
            }
            cudaGetLastError();  // clear a sticky "already enabled"
        }
        return d.base;
    }
    std::string key(reinterpret_cast<const char*>(d.ipc_handle.data()), d.ipc_handle.size());
    std::lock_guard lk(map_mu_);
    auto it = opened_.find({local_device, key});
    if (it == opened_.end()) {
        cudaIpcMemHandle_t h;
        std::memcpy(&h, d.ipc_handle.data(), sizeof(h));
        void* p = nullptr;
        FERRY_CUDA_TRY(cudaSetDevice(local_device));
        cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) {
            return FERRY_CUDA_ERROR(e,
                                    "cudaIpcOpenMemHandle (is the peer on this host, and is "
                                    "its GPU reachable from this one?)");
        }
        it =
            opened_.emplace(std::make_pair(local_device, key), reinterpret_cast<uint64_t>(p)).first;
    }
    return it->second + d.ipc_offset;
}

void CudaTransport::submit(int device, GpuWork work, std::function<void(const Status&)> done) {
    {
        std::lock_guard lk(mu_);
        if (!stop_) {
            pending_.fetch_add(1, std::memory_order_relaxed);
            auto counted = [this, d = std::move(done)](const Status& s) {
                pending_.fetch_sub(1, std::memory_order_relaxed);
                d(s);
            };
            jobs_.push_back({device, std::move(work), std::move(counted)});
            cv_.notify_one();
            return;
        }
    }
    done(cancelled("the transfer engine was shut down"));
}

Result<cudaStream_t> CudaTransport::stream_for(int device) {
    auto it = streams_.find(device);
    if (it != streams_.end()) return it->second;
    cudaStream_t s;
    FERRY_CUDA_TRY(cudaSetDevice(device));
    FERRY_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int sms = 0;
    FERRY_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    sm_count_[device] = sms;
    streams_[device] = s;
    return s;
}

void CudaTransport::trace_completion(const InFlight& f) const {
    // Microseconds of the steady clock, the time base of FERRY_KV_TRACE too.
    auto at = [](TimePoint t) { return to_us(t.time_since_epoch()); };
    auto span = [](TimePoint a, TimePoint b) { return b > a ? to_us(b - a) : 0.0; };
    std::fprintf(stderr,
                 "ferry gpu trace: device %d, %zu jobs, %zu copies, %.2f MiB: first job in at "
                 "%.1f us, launch %.1f-%.1f us (list %.1f, uploads %.1f, kernels %.1f, event "
                 "%.1f), done by %.1f us\n",
                 f.device, f.done.size(), f.copies, f.bytes / 1048576.0, at(f.first_submitted),
                 at(f.launch_begin), at(f.launch_end), span(f.launch_begin, f.steps.list_built),
                 span(f.steps.list_built, f.steps.uploaded),
                 span(f.steps.uploaded, f.steps.launched), span(f.steps.launched, f.launch_end),
                 at(Clock::now()));
}

Status CudaTransport::launch(int device, std::vector<Job>& jobs, InFlight* out) {
    out->launch_begin = Clock::now();
    out->first_submitted = out->launch_begin;
    for (const auto& j : jobs) {
        out->first_submitted = std::min(out->first_submitted, j.submitted);
        out->copies += j.work.copies.size();
        for (const auto& p : j.work.paged) out->copies += p.pages();
        for (const auto& b : j.work.blocks) out->copies += b.geom.items;
        out->bytes += job_bytes(j);
    }
    FERRY_ASSIGN_OR_RETURN(cudaStream_t stream, stream_for(device));
    FERRY_CUDA_TRY(cudaSetDevice(device));
    for (auto& j : jobs) out->done.push_back(std::move(j.done));
    bool copy_engine =
        config_.gpu_copy == "copy-engine" ||
        (config_.gpu_copy == "auto" && jobs.size() == 1 && jobs[0].work.paged.empty() &&
         jobs[0].work.blocks.empty() && jobs[0].work.copies.size() == 1 &&
         jobs[0].work.copies[0].len >= kCopyEngineThreshold);
    std::vector<const GpuWork*> works;
    works.reserve(jobs.size());
    for (const auto& j : jobs) works.push_back(&j.work);
    if (copy_engine) {
        for (const auto& j : jobs) {
            for (const auto& c : j.work.copies) {
                FERRY_CUDA_TRY(cudaMemcpyAsync(reinterpret_cast<void*>(c.dst),
                                               reinterpret_cast<const void*>(c.src), c.len,
                                               cudaMemcpyDefault, stream));
            }
        }
    }
    // Paged copies always go to the kernel: the copy engine would take a call per page.
    FERRY_RETURN_IF_ERROR(launch_copy_work(works, out->bytes, device, sm_count_[device],
                                           !copy_engine, stream, buffers_, &out->buf,
                                           trace_ ? &out->steps : nullptr));
    if (free_events_.empty()) {
        cudaEvent_t ev;
        FERRY_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        free_events_.push_back(ev);
    }
    out->event = free_events_.back();
    free_events_.pop_back();
    FERRY_CUDA_TRY(cudaEventRecord(out->event, stream));
    out->launch_end = Clock::now();
    return ok_status();
}

void CudaTransport::run() {
    TimePoint last_active = Clock::now();
    while (true) {
        std::deque<Job> jobs;
        {
            std::unique_lock lk(mu_);
            // Sleep only when nothing is copying and nothing is held back for a busy device:
            // held jobs must go out as soon as their device's copy completes. Like the engine's
            // workers, poll through idle_spin after the last activity (always with busy_poll)
            // before sleeping: a wake from the condition variable took 15-55 us, which the first
            // copy of every KV transfer paid (2026-12-01).
            bool held = false;
            for (const auto& [dev, group] : waiting_) held = held || !group.empty();
            if (inflight_.empty() && !held && !stop_ && jobs_.empty()) {
                if (config_.busy_poll || Clock::now() - last_active < config_.idle_spin) {
                    lk.unlock();
                    std::this_thread::yield();
                    continue;
                }
                cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
            }
            if (stop_) return;
            jobs.swap(jobs_);
        }
        if (!jobs.empty() || !inflight_.empty()) last_active = Clock::now();
        // Everything queued for one device goes out as one launch: a KV transfer hands over
        // one operation per (layer, K/V) run, and a launch each cost more than the copies.
        // While a device still copies, new jobs wait for it (unless much has piled up): small
        // launches in a row each keep only a few warps per SM busy, serialised on the stream
        // (a 16k-token push ran at 0.34x of NVLink that way, 2026-11-30).
        for (auto& j : jobs) {
            waiting_bytes_[j.device] += job_bytes(j);
            waiting_[j.device].push_back(std::move(j));
        }
        for (auto& [device, group] : waiting_) {
            if (group.empty()) continue;
            if (busy_[device] > 0 && waiting_bytes_[device] < kLaunchWhileBusyBytes) continue;
            waiting_bytes_[device] = 0;
            busy_[device]++;
            InFlight f{};
            f.device = device;
            Status s = launch(device, group, &f);
            std::vector<Job> launched = std::move(group);
            group.clear();
            if (!s.ok()) {
                busy_[device]--;
                buffers_.give(f.buf);
                for (auto& d : f.done) d(s);
                for (auto& j : launched) {
                    if (j.done) j.done(s);
                }
                continue;
            }
            for (auto& j : launched) f.works.push_back(std::move(j.work));
            inflight_.push_back(std::move(f));
        }
        // Copies in flight: poll their events without sleeping (a timed wait sleeps ~60 us
        // with timer slack, each completion later by that much), yielding the core between.
        if (!inflight_.empty()) std::this_thread::yield();
        while (!inflight_.empty()) {
            cudaError_t e = cudaEventQuery(inflight_.front().event);
            if (e == cudaErrorNotReady) break;
            InFlight f = std::move(inflight_.front());
            inflight_.pop_front();
            if (trace_) trace_completion(f);
            busy_[f.device]--;
            buffers_.give(f.buf);
            free_events_.push_back(f.event);
            Status st = FERRY_CUDA_ERROR(e, "GPU copy");
            for (auto& d : f.done) d(st);
        }
    }
}

}  // namespace

Result<std::unique_ptr<GpuTransport>> create_gpu_transport(const EngineConfig& config) {
    auto t = std::make_unique<CudaTransport>(config);
    FERRY_RETURN_IF_ERROR(t->init());
    return std::unique_ptr<GpuTransport>(std::move(t));
}

}  // namespace ferry::detail

// `ferry bench gpu` measurement: two processes, one GPU each, engine over shm for signals and
// CUDA IPC for data.
#include "bench/gpu.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>

#include "bench/target_process.h"
#include "common/cuda_check.h"
#include "ferry/common/bytes.h"
#include "ferry/fabric/engine.h"
#include "ferry/fabric/gpu_memory.h"

namespace ferry {
namespace {

using bench::recv_frame;
using bench::send_frame;

EngineConfig bench_engine(const std::string& mode) {
    EngineConfig c;
    c.provider = "shm";
    c.gpu_copy = mode;
    c.op_timeout = std::chrono::seconds(30);
    return c;
}

int target_main(int fd, const GpuBenchConfig& c, int dev) {
    if (cudaSetDevice(dev) != cudaSuccess) return 1;
    void* d = nullptr;
    if (cudaMalloc(&d, c.bytes * 2) != cudaSuccess) return 1;
    auto engine = TransferEngine::create(bench_engine("auto"));
    if (!engine.ok()) return 1;
    auto mr = (*engine)->register_memory(d, c.bytes * 2, MemoryKind::kCuda, dev);
    if (!mr.ok()) return 1;
    // The target waits for the writes, as a KV decode with transfers registered does: its
    // workers keep polling (a write's immediate goes over shm, which the target's worker must
    // progress; napping, it held each paged write's completion back ~60 us, 2026-12-03).
    ArrivalsExpected expecting(engine->get());
    ByteWriter w;
    (*engine)->address().encode(w);
    (*mr)->descriptor().encode(w);
    if (!send_frame(fd, w.bytes())) return 1;
    std::vector<uint8_t> done;
    recv_frame(fd, &done);
    expecting.reset();
    mr->reset();
    engine->reset();
    cudaFree(d);
    return 0;
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

Status measure(const GpuBenchConfig& c, int src_dev, int dst_dev, int fd, GpuBenchReport* rep) {
    FERRY_CUDA_TRY(cudaSetDevice(src_dev));
    void* src = nullptr;
    FERRY_CUDA_TRY(cudaMalloc(&src, c.bytes));
    FERRY_CUDA_TRY(cudaMemset(src, 0x3C, c.bytes));
    // Ceiling: the plain peer copy a user would write, same size, in this process.
    FERRY_ASSIGN_OR_RETURN(rep->ceiling_gbps,
                           measure_gpu_copy_ceiling(src_dev, dst_dev, c.bytes, c.iters));
    rep->rows.push_back({"ceiling memcpy peer", "copy-engine", c.bytes, rep->ceiling_gbps,
                         c.bytes / rep->ceiling_gbps / 1e3, 1.0});
    if (c.progress) c.progress(fmt::format("ceiling {:.1f} GB/s", rep->ceiling_gbps));
    FERRY_CUDA_TRY(cudaSetDevice(src_dev));
    std::vector<uint8_t> blob;
    if (!recv_frame(fd, &blob, std::chrono::seconds(120)))
        return unavailable("gpu bench target died or did not answer during set-up");
    ByteReader rd(blob);
    FERRY_ASSIGN_OR_RETURN(auto taddr, EngineAddress::decode(rd));
    FERRY_ASSIGN_OR_RETURN(auto tdesc, MemoryDescriptor::decode(rd));
    for (const auto& mode : c.copy_modes) {
        FERRY_ASSIGN_OR_RETURN(auto engine, TransferEngine::create(bench_engine(mode)));
        FERRY_ASSIGN_OR_RETURN(auto mr,
                               engine->register_memory(src, c.bytes, MemoryKind::kCuda, src_dev));
        FERRY_ASSIGN_OR_RETURN(PeerId peer, engine->connect(taddr));
        auto timed = [&](auto&& submit) -> Result<double> {
            std::vector<double> us;
            for (int i = 0; i < c.iters + 2; ++i) {
                auto t0 = Clock::now();
                OpHandle h = submit();
                // Polling, as the ceiling's cudaEventSynchronize does: asleep on the handle,
                // the wake-up (15-55 us on the lent H200 host) was counted against the engine.
                FERRY_RETURN_IF_ERROR(
                    h.wait(std::chrono::seconds(30), std::chrono::milliseconds(50)));
                if (i >= 2) us.push_back(to_us(Clock::now() - t0));
            }
            return median(us);
        };
        FERRY_ASSIGN_OR_RETURN(
            double us, timed([&] {
                return engine->write({peer, mr.get(), 0, &tdesc, 0, c.bytes, std::nullopt});
            }));
        double gbps = c.bytes / us / 1e3;
        rep->rows.push_back({"write", mode, c.bytes, gbps, us, gbps / rep->ceiling_gbps});
        if (c.progress) c.progress(fmt::format("write {} {:.1f} GB/s", mode, gbps));
        for (size_t page : c.pages) {
            // Random block ids on both sides, as a paged KV cache has them.
            uint32_t n = static_cast<uint32_t>(c.bytes / page);
            std::vector<uint32_t> s(n), d(n);
            std::iota(s.begin(), s.end(), 0);
            std::iota(d.begin(), d.end(), 0);
            std::mt19937 rng(42);
            std::shuffle(s.begin(), s.end(), rng);
            std::shuffle(d.begin(), d.end(), rng);
            PagedWriteOp p;
            p.peer = peer;
            p.src = mr.get();
            p.dst = &tdesc;
            p.page_size = page;
            p.src_pages = s;
            p.dst_pages = d;
            p.imm = 1u;
            FERRY_ASSIGN_OR_RETURN(double pus, timed([&] { return engine->paged_write(p); }));
            double pg = c.bytes / pus / 1e3;
            rep->rows.push_back(
                {"paged write (random)", mode, page, pg, pus, pg / rep->ceiling_gbps});
            if (c.progress) c.progress(fmt::format("paged {} {} B {:.1f} GB/s", mode, page, pg));
        }
    }
    FERRY_CUDA_TRY(cudaFree(src));
    return ok_status();
}

}  // namespace

Result<GpuBenchReport> run_gpu_bench(const GpuBenchConfig& c) {
    FERRY_RETURN_IF_ERROR(check_gpu_bench_config(c));
    // Fork before this process touches CUDA: a child of a CUDA-initialised process cannot use
    // the GPU. The target picks its own device.
    FERRY_ASSIGN_OR_RETURN(auto target, bench::TargetProcess::start([&c](int fd) {
                               int n = 0;
                               if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return 1;
                               return target_main(fd, c,
                                                  n > 1 ? c.dst_device % n : c.src_device % n);
                           }));
    GpuBenchReport rep;
    Status s = [&]() -> Status {
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);
        if (e != cudaSuccess || n == 0) {
            return unavailable(
                fmt::format("bench gpu needs a GPU: {}",
                            e == cudaSuccess ? "none visible" : cudaGetErrorString(e)));
        }
        int src_dev = c.src_device % n, dst_dev = n > 1 ? c.dst_device % n : src_dev;
        cudaDeviceProp prop{};
        FERRY_CUDA_TRY(cudaGetDeviceProperties(&prop, src_dev));
        rep.devices = fmt::format("{} GPU(s) {}; GPU {} -> GPU {}", n, prop.name, src_dev, dst_dev);
        return measure(c, src_dev, dst_dev, target.fd(), &rep);
    }();
    const uint8_t done = 1;
    send_frame(target.fd(), {&done, 1});
    (void)target.finish(std::chrono::seconds(30));
    if (!s.ok()) return s;
    return rep;
}

}  // namespace ferry

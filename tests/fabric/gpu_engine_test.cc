// TransferEngine between GPU memory of two processes on one host (CUDA IPC over NVLink).
// Runs on a GPU machine (scripts/gpu_check.sh); skips with the reason elsewhere.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "ferry/common/bytes.h"
#include "support/engine_fixture.h"
#include "support/gpu.h"
#include "support/multiproc.h"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace ferry {
namespace {

#ifdef FERRY_HAVE_CUDA
using testing::Exchange;

#define CHILD_CUDA(expr)                                                                     \
    do {                                                                                     \
        cudaError_t e_ = (expr);                                                             \
        CHILD_CHECK_MSG(e_ == cudaSuccess, "{}: {}", #expr, cudaGetErrorString(e_));         \
    } while (0)

// Two processes, one GPU each when there are two (else both on GPU 0): random writes and
// paged writes into poisoned GPU memory, every byte checked on the host afterwards.
TEST(GpuEngine, WritesAndPagedWritesBetweenGpusArriveIntact) {
    if (testing::gpu_count() == 0) GTEST_SKIP() << testing::no_gpu_reason();
    uint64_t seed = testing::test_seed("GpuWrites");
    const size_t kBuf = 64 << 20;
    const uint64_t kPage = 16384;
    auto results = testing::run_processes(2, [&](Exchange& ex) -> std::string {
        int dev = ex.rank() % testing::gpu_count();
        CHILD_CUDA(cudaSetDevice(dev));
        void* d = nullptr;
        CHILD_CUDA(cudaMalloc(&d, kBuf));
        std::vector<uint8_t> host(kBuf);
        std::mt19937_64 rng(seed);
        for (auto& b : host) b = static_cast<uint8_t>(rng());
        if (ex.rank() == 0) {
            CHILD_CUDA(cudaMemcpy(d, host.data(), kBuf, cudaMemcpyHostToDevice));
        } else {
            CHILD_CUDA(cudaMemset(d, 0xCD, kBuf));
        }
        CHILD_ASSIGN_OK(auto engine, TransferEngine::create(testing::test_engine_config("shm")));
        CHILD_ASSIGN_OK(auto mr, engine->register_memory(d, kBuf, MemoryKind::kCuda, dev));
        ByteWriter w;
        engine->address().encode(w);
        mr->descriptor().encode(w);
        CHILD_ASSIGN_OK(auto all, ex.allgather(w.bytes()));
        ByteReader rd(all[1 - ex.rank()]);
        CHILD_ASSIGN_OK(auto addr, EngineAddress::decode(rd));
        CHILD_ASSIGN_OK(auto desc, MemoryDescriptor::decode(rd));
        CHILD_ASSIGN_OK(PeerId peer, engine->connect(addr));
        // Pages: a random permutation of the first half into the second half.
        uint32_t half_pages = kBuf / 2 / kPage;
        std::vector<uint32_t> src(half_pages), dst(half_pages);
        for (uint32_t i = 0; i < half_pages; ++i) src[i] = dst[i] = i;
        std::shuffle(dst.begin(), dst.end(), rng);
        if (ex.rank() == 0) {
            // One plain write of the first 1 MiB + 3 bytes at an odd offset.
            CHILD_CHECK_OK(engine->write({peer, mr.get(), 5, &desc, 7, (1 << 20) + 3, 1u})
                               .wait(std::chrono::seconds(20)));
            PagedWriteOp p;
            p.peer = peer;
            p.src = mr.get();
            p.dst = &desc;
            p.page_size = kPage;
            p.dst_offset = kBuf / 2;
            p.src_pages = src;
            p.dst_pages = dst;
            p.imm = 2u;
            CHILD_CHECK_OK(engine->paged_write(p).wait(std::chrono::seconds(20)));
            CHILD_CHECK(ex.barrier().ok());
        } else {
            CHILD_CHECK_OK(engine->wait_imm(1, 1, std::chrono::seconds(20)));
            CHILD_CHECK_OK(engine->wait_imm(2, 1, std::chrono::seconds(20)));
            std::vector<uint8_t> got(kBuf);
            CHILD_CUDA(cudaMemcpy(got.data(), d, kBuf, cudaMemcpyDeviceToHost));
            std::vector<uint8_t> want(kBuf, 0xCD);
            std::memcpy(want.data() + 7, host.data() + 5, (1 << 20) + 3);
            for (uint32_t i = 0; i < half_pages; ++i) {
                std::memcpy(want.data() + kBuf / 2 + dst[i] * kPage, host.data() + src[i] * kPage,
                            kPage);
            }
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < kBuf; ++i) {
                if (got[i] != want[i] && bad++ == 0) first = i;
            }
            CHILD_CHECK_MSG(bad == 0, "{} bytes wrong, first at {}", bad, first);
            CHILD_CHECK(ex.barrier().ok());
        }
        mr.reset();
        engine.reset();
        cudaFree(d);
        return "";
    }, std::chrono::seconds(120));
    EXPECT_EQ(testing::describe_failures(results), "");
}
#else
TEST(GpuEngine, WritesAndPagedWritesBetweenGpusArriveIntact) {
    GTEST_SKIP() << testing::no_gpu_reason();
}
#endif

}  // namespace
}  // namespace ferry

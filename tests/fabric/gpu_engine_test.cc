// TransferEngine with GPU memory: between two processes on one host over CUDA IPC (NVLink), and
// through the provider where it registers CUDA memory (FI_HMEM). Runs on a GPU machine
// (scripts/gpu_check.sh); what needs a GPU or a CUDA-capable provider skips with the reason
// elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "ferry/common/bytes.h"
#include "support/engine_fixture.h"
#include "support/gpu.h"
#include "support/multiproc.h"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>

#include "common/cuda_check.h"
#endif

namespace ferry {
namespace {

#ifdef FERRY_HAVE_CUDA
using testing::Exchange;

#define CHILD_CUDA(expr)                                        \
    do {                                                        \
        ::ferry::Status cuda_s_ = FERRY_CUDA_CHECK(expr);       \
        CHILD_CHECK_MSG(cuda_s_.ok(), "{}", cuda_s_.message()); \
    } while (0)

// Rank 0's GPU buffer gets random bytes (kept in `host` to check against), the others' are poisoned
// with 0xCD. Returns "" or what failed.
std::string fill_gpu(int rank, void* d, std::vector<uint8_t>& host, std::mt19937_64& rng) {
    for (auto& b : host) b = static_cast<uint8_t>(rng());
    if (rank == 0) {
        CHILD_CUDA(cudaMemcpy(d, host.data(), host.size(), cudaMemcpyHostToDevice));
    } else {
        CHILD_CUDA(cudaMemset(d, 0xCD, host.size()));
    }
    return "";
}

struct OtherRank {
    PeerId peer = 0;
    MemoryDescriptor desc;  // the other rank's GPU region
};

// Two ranks swap engine addresses and region descriptors and connect to each other.
Result<OtherRank> connect_other(Exchange& ex, TransferEngine& engine, const MemoryRegion& mr) {
    ByteWriter w;
    engine.address().encode(w);
    mr.descriptor().encode(w);
    FERRY_ASSIGN_OR_RETURN(auto all, ex.allgather(w.bytes()));
    ByteReader rd(all[1 - ex.rank()]);
    OtherRank o;
    FERRY_ASSIGN_OR_RETURN(auto addr, EngineAddress::decode(rd));
    FERRY_ASSIGN_OR_RETURN(o.desc, MemoryDescriptor::decode(rd));
    FERRY_ASSIGN_OR_RETURN(o.peer, engine.connect(addr));
    return o;
}

// Page i of the first half of a buffer goes to page perm[i] of the second half.
struct PagePlan {
    PagePlan(size_t buf, uint64_t page, std::mt19937_64& rng)
        : page(page), src(buf / 2 / page), dst(buf / 2 / page), half(buf / 2) {
        for (uint32_t i = 0; i < src.size(); ++i) src[i] = dst[i] = i;
        std::shuffle(dst.begin(), dst.end(), rng);
    }
    PagedWriteOp op(PeerId peer, const MemoryRegion* from, const MemoryDescriptor* to,
                    uint32_t imm) const {
        PagedWriteOp p;
        p.peer = peer;
        p.src = from;
        p.dst = to;
        p.page_size = page;
        p.dst_offset = half;
        p.src_pages = src;
        p.dst_pages = dst;
        p.imm = imm;
        return p;
    }
    void apply(std::vector<uint8_t>& want, const std::vector<uint8_t>& host) const {
        for (size_t i = 0; i < src.size(); ++i) {
            std::memcpy(want.data() + half + dst[i] * page, host.data() + src[i] * page, page);
        }
    }
    uint64_t page;
    std::vector<uint32_t> src, dst;
    uint64_t half;
};

// The GPU buffer against `want`: "" when every byte matches.
std::string check_gpu(const void* d, const std::vector<uint8_t>& want) {
    std::vector<uint8_t> got(want.size());
    CHILD_CUDA(cudaMemcpy(got.data(), d, got.size(), cudaMemcpyDeviceToHost));
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (got[i] != want[i] && bad++ == 0) first = i;
    }
    CHILD_CHECK_MSG(bad == 0, "{} bytes wrong, first at {}", bad, first);
    return "";
}

#define CHILD_RUN(expr)                             \
    do {                                            \
        std::string child_err_ = (expr);            \
        if (!child_err_.empty()) return child_err_; \
    } while (0)

// Two processes, one GPU each when there are two (else both on GPU 0): writes (one at odd
// offsets, one aligned and long enough for the tiled kernel's 128 KiB tiles, with a partial last
// tile) and paged writes of 16 KiB pages (one warp a page) and of 256 KiB pages (tiles) into
// poisoned GPU memory, every byte checked on the host after each round.
TEST(GpuEngine, WritesAndPagedWritesBetweenGpusArriveIntact) {
    if (testing::gpu_count() == 0) GTEST_SKIP() << testing::no_gpu_reason();
    uint64_t seed = testing::test_seed("GpuWrites");
    const size_t kBuf = 64 << 20;
    const uint64_t kPages[] = {16384, 256 << 10};
    const uint64_t kLongAt = 2 << 20, kLongLen = (3 << 20) + 4112;
    auto results = testing::run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            int dev = ex.rank() % testing::gpu_count();
            CHILD_CUDA(cudaSetDevice(dev));
            void* d = nullptr;
            CHILD_CUDA(cudaMalloc(&d, kBuf));
            std::vector<uint8_t> host(kBuf);
            std::mt19937_64 rng(seed);
            CHILD_RUN(fill_gpu(ex.rank(), d, host, rng));
            CHILD_ASSIGN_OK(auto engine,
                            TransferEngine::create(testing::test_engine_config("shm")));
            CHILD_ASSIGN_OK(auto mr, engine->register_memory(d, kBuf, MemoryKind::kCuda, dev));
            CHILD_ASSIGN_OK(OtherRank other, connect_other(ex, *engine, *mr));
            std::vector<uint8_t> want(kBuf, 0xCD);
            for (int round = 0; round < 2; ++round) {
                PagePlan pages(kBuf, kPages[round], rng);
                const auto imm = static_cast<uint32_t>(3 * round);
                if (ex.rank() == 0) {
                    if (round == 0) {
                        // The first 1 MiB + 3 bytes at an odd offset; a long aligned run.
                        CHILD_CHECK_OK(engine
                                           ->write({other.peer, mr.get(), 5, &other.desc, 7,
                                                    (1 << 20) + 3, imm + 1})
                                           .wait(std::chrono::seconds(20)));
                        CHILD_CHECK_OK(engine
                                           ->write({other.peer, mr.get(), 16, &other.desc, kLongAt,
                                                    kLongLen, imm + 2})
                                           .wait(std::chrono::seconds(20)));
                    }
                    CHILD_CHECK_OK(
                        engine->paged_write(pages.op(other.peer, mr.get(), &other.desc, imm + 3))
                            .wait(std::chrono::seconds(20)));
                    CHILD_CHECK(ex.barrier().ok());
                } else {
                    if (round == 0) {
                        CHILD_CHECK_OK(engine->wait_imm(imm + 1, 1, std::chrono::seconds(20)));
                        CHILD_CHECK_OK(engine->wait_imm(imm + 2, 1, std::chrono::seconds(20)));
                        std::memcpy(want.data() + 7, host.data() + 5, (1 << 20) + 3);
                        std::memcpy(want.data() + kLongAt, host.data() + 16, kLongLen);
                    }
                    CHILD_CHECK_OK(engine->wait_imm(imm + 3, 1, std::chrono::seconds(20)));
                    pages.apply(want, host);
                    CHILD_RUN(check_gpu(d, want));
                    CHILD_CHECK(ex.barrier().ok());
                }
            }
            mr.reset();
            engine.reset();
            cudaFree(d);
            return "";
        },
        std::chrono::seconds(120));
    EXPECT_EQ(testing::describe_failures(results), "");
}

// One paged write's shape: page size, strides, offsets of page 0 and how many pages; the
// destination ids are a permutation, the source ids random (a source page may go twice).
struct PagedShape {
    uint64_t page, src_stride, dst_stride, src_offset, dst_offset;
    uint32_t pages;
};

// Several paged writes of different shapes (pages of 4 KiB and of odd sizes, strides apart from
// the page size, unaligned offsets) and a plain write, all in flight at once so that the GPU
// transport launches them together: each op lands in its own 16 MiB area of a poisoned buffer,
// and every byte is checked against the same copies done on the host.
TEST(GpuEngine, PagedWritesOfMixedShapesInOneLaunchArriveIntact) {
    if (testing::gpu_count() == 0) GTEST_SKIP() << testing::no_gpu_reason();
    uint64_t seed = testing::test_seed("GpuPagedShapes");
    constexpr uint64_t kArea = 16 << 20;
    const std::vector<PagedShape> shapes = {
        {4096, 4096, 4096, 0, 0, 2048},
        {4100, 4100, 4104, 3, 5, 2000},
        {65552, 65552, 70000, 16, 32, 200},
        {16384, 3 * 16384, 16384, 0, 16, 900},
        {(256 << 10) + 4096, (256 << 10) + 4096, (264 << 10), 48, 16, 40},
        {(128 << 10) + 8, (128 << 10) + 8, (128 << 10) + 8, 3, 1, 60},
    };
    const size_t kBuf = (shapes.size() + 1) * kArea;
    auto results = testing::run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            int dev = ex.rank() % testing::gpu_count();
            CHILD_CUDA(cudaSetDevice(dev));
            void* d = nullptr;
            CHILD_CUDA(cudaMalloc(&d, kBuf));
            std::vector<uint8_t> host(kBuf);
            std::mt19937_64 rng(seed);
            CHILD_RUN(fill_gpu(ex.rank(), d, host, rng));
            CHILD_ASSIGN_OK(auto engine,
                            TransferEngine::create(testing::test_engine_config("shm")));
            CHILD_ASSIGN_OK(auto mr, engine->register_memory(d, kBuf, MemoryKind::kCuda, dev));
            CHILD_ASSIGN_OK(OtherRank other, connect_other(ex, *engine, *mr));
            // Both ranks draw the same ids from the shared seed.
            std::vector<std::vector<uint32_t>> src_ids(shapes.size()), dst_ids(shapes.size());
            for (size_t k = 0; k < shapes.size(); ++k) {
                const PagedShape& s = shapes[k];
                uint64_t src_cap = (kBuf - s.src_offset - s.page) / s.src_stride + 1;
                for (uint32_t i = 0; i < s.pages; ++i) {
                    src_ids[k].push_back(static_cast<uint32_t>(rng() % src_cap));
                    dst_ids[k].push_back(i);
                }
                std::shuffle(dst_ids[k].begin(), dst_ids[k].end(), rng);
            }
            const uint64_t write_at = shapes.size() * kArea + 7;
            if (ex.rank() == 0) {
                std::vector<OpHandle> ops;
                for (size_t k = 0; k < shapes.size(); ++k) {
                    const PagedShape& s = shapes[k];
                    PagedWriteOp p;
                    p.peer = other.peer;
                    p.src = mr.get();
                    p.dst = &other.desc;
                    p.page_size = s.page;
                    p.src_stride = s.src_stride;
                    p.dst_stride = s.dst_stride;
                    p.src_offset = s.src_offset;
                    p.dst_offset = k * kArea + s.dst_offset;
                    p.src_pages = src_ids[k];
                    p.dst_pages = dst_ids[k];
                    p.imm = static_cast<uint32_t>(10 + k);
                    ops.push_back(engine->paged_write(p));
                }
                ops.push_back(
                    engine->write({other.peer, mr.get(), 5, &other.desc, write_at, (1 << 20) + 3,
                                   static_cast<uint32_t>(10 + shapes.size())}));
                for (auto& h : ops) CHILD_CHECK_OK(h.wait(std::chrono::seconds(20)));
                CHILD_CHECK(ex.barrier().ok());
            } else {
                for (size_t k = 0; k <= shapes.size(); ++k) {
                    CHILD_CHECK_OK(engine->wait_imm(static_cast<uint32_t>(10 + k), 1,
                                                    std::chrono::seconds(20)));
                }
                std::vector<uint8_t> want(kBuf, 0xCD);
                for (size_t k = 0; k < shapes.size(); ++k) {
                    const PagedShape& s = shapes[k];
                    for (uint32_t i = 0; i < s.pages; ++i) {
                        std::memcpy(
                            want.data() + k * kArea + s.dst_offset + dst_ids[k][i] * s.dst_stride,
                            host.data() + s.src_offset + src_ids[k][i] * s.src_stride, s.page);
                    }
                }
                std::memcpy(want.data() + write_at, host.data() + 5, (1 << 20) + 3);
                CHILD_RUN(check_gpu(d, want));
                CHILD_CHECK(ex.barrier().ok());
            }
            mr.reset();
            engine.reset();
            cudaFree(d);
            return "";
        },
        std::chrono::seconds(120));
    EXPECT_EQ(testing::describe_failures(results), "");
}
#else
TEST(GpuEngine, WritesAndPagedWritesBetweenGpusArriveIntact) {
    GTEST_SKIP() << testing::no_gpu_reason();
}
TEST(GpuEngine, PagedWritesOfMixedShapesInOneLaunchArriveIntact) {
    GTEST_SKIP() << testing::no_gpu_reason();
}
#endif

// A child body that cannot run here returns kSkip + why; the test then skips with that reason.
constexpr std::string_view kSkip = "skip: ";

// The reason when every child skipped, else "".
std::string skip_reason(const std::vector<testing::ChildResult>& results) {
    // A child that returns a message exits with 1, a skip included: the message decides.
    for (const auto& r : results) {
        if (r.exit_code < 0 || r.error.rfind(kSkip, 0) != 0) return "";
    }
    return results.empty() ? "" : results[0].error.substr(kSkip.size());
}

class GpuMemoryQueryTest : public ::testing::TestWithParam<std::string> {};

// supports_gpu_memory() says what register_memory(kCuda) then does: where it says yes, GPU memory
// gets a key on every rail; where it says no, it gets none (IPC at most) and a refusal names the
// provider and CUDA. Runs with and without a GPU; the fabric_gpu_memory = false engine must always
// say no.
TEST_P(GpuMemoryQueryTest, CudaRegistrationMatchesSupportsGpuMemory) {
    const bool have_gpu = testing::gpu_count() > 0;
    auto results = testing::run_processes(
        1,
        [&](testing::Exchange&) -> std::string {
            for (bool fabric_gpu : {true, false}) {
                EngineConfig c = testing::test_engine_config(GetParam());
                c.fabric_gpu_memory = fabric_gpu;
                c.num_rails = 2;
                CHILD_ASSIGN_OK(auto e, TransferEngine::create(c));
                const std::string& note = e->gpu_memory_note();
                CHILD_CHECK_MSG(note.find(e->provider()) != std::string::npos, "{}", note);
                if (!fabric_gpu) {
                    CHILD_CHECK_MSG(!e->supports_gpu_memory(), "{}", note);
                    CHILD_CHECK_MSG(note.find("fabric_gpu_memory") != std::string::npos, "{}",
                                    note);
                }
                const size_t kLen = 1 << 16;
                std::vector<uint8_t> host(kLen);
                void* mem = host.data();
#ifdef FERRY_HAVE_CUDA
                if (have_gpu) CHILD_CUDA(cudaMalloc(&mem, kLen));
#endif
                if (e->supports_gpu_memory() && !have_gpu) {
                    return std::string(kSkip) + note + ", but there is no GPU here to register";
                }
                auto r = e->register_memory(mem, kLen, MemoryKind::kCuda, 0);
                // Printed so a GPU machine's log shows what the provider offered.
                fmt::print(stderr, "{}; registering {} memory: {}\n", note,
                           have_gpu ? "GPU" : "host (as CUDA)",
                           r.ok() ? "ok" : r.status().to_string());
                if (e->supports_gpu_memory()) {
                    CHILD_CHECK_MSG(r.ok(), "{}: {}", note, r.status().to_string());
                    CHILD_CHECK_MSG((*r)->descriptor().rail_keys.size() == 2, "{} keys",
                                    (*r)->descriptor().rail_keys.size());
                } else if (r.ok()) {
                    // A GPU and CUDA IPC: same-host GPU peers only.
                    CHILD_CHECK((*r)->descriptor().rail_keys.empty());
                    CHILD_CHECK((*r)->descriptor().has_ipc);
                } else {
                    const std::string& m = r.status().message();
                    CHILD_CHECK_MSG(m.find(e->provider()) != std::string::npos &&
                                        m.find("CUDA") != std::string::npos,
                                    "{}", m);
                }
                if (r.ok()) r->reset();
#ifdef FERRY_HAVE_CUDA
                if (have_gpu) cudaFree(mem);
#endif
            }
            return "";
        },
        std::chrono::seconds(60));
    std::string skipped = skip_reason(results);
    if (!skipped.empty()) GTEST_SKIP() << skipped;
    EXPECT_EQ(testing::describe_failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Providers, GpuMemoryQueryTest,
                         ::testing::ValuesIn(testing::test_providers()));

#ifdef FERRY_HAVE_CUDA
class GpuFabricTest : public ::testing::TestWithParam<std::string> {};

// GPU memory to GPU memory of another engine through the provider (FI_HMEM_CUDA), with the CUDA IPC
// path switched off on both sides: a write at odd offsets, a paged write of permuted pages and a
// read, into poisoned memory, every byte checked; the bytes must have gone through the provider
// (its byte counters). Skips where the provider cannot register CUDA memory.
TEST_P(GpuFabricTest, GpuToGpuThroughProviderArrivesIntact) {
    if (testing::gpu_count() == 0) GTEST_SKIP() << testing::no_gpu_reason();
    uint64_t seed = testing::test_seed("GpuFabric");
    const size_t kBuf = 8 << 20;
    const uint64_t kPage = 16384;
    const uint64_t kWriteLen = (1 << 20) + 3;
    const uint64_t kReadLen = 64 << 10;
    const uint64_t kReadAt = kBuf / 2 - kReadLen;  // poisoned on rank 1, beyond the write
    auto results = testing::run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            int dev = ex.rank() % testing::gpu_count();
            CHILD_CUDA(cudaSetDevice(dev));
            EngineConfig c = testing::test_engine_config(GetParam());
            c.peers_on_same_host = true;
            c.gpu_ipc = false;
            c.num_rails = 2;
            c.stripe_threshold = 256 << 10;  // the 1 MiB write is split over both rails
            CHILD_ASSIGN_OK(auto engine, TransferEngine::create(c));
            if (!engine->supports_gpu_memory())
                return std::string(kSkip) + engine->gpu_memory_note();
            void* d = nullptr;
            CHILD_CUDA(cudaMalloc(&d, kBuf));
            std::vector<uint8_t> host(kBuf);
            std::mt19937_64 rng(seed);
            CHILD_RUN(fill_gpu(ex.rank(), d, host, rng));
            CHILD_ASSIGN_OK(auto mr, engine->register_memory(d, kBuf, MemoryKind::kCuda, dev));
            CHILD_CHECK(!mr->descriptor().has_ipc);
            CHILD_CHECK(mr->descriptor().rail_keys.size() == 2);
            CHILD_ASSIGN_OK(OtherRank other, connect_other(ex, *engine, *mr));
            PagePlan pages(kBuf, kPage, rng);
            if (ex.rank() == 0) {
                OpHandle h1 =
                    engine->write({other.peer, mr.get(), 5, &other.desc, 7, kWriteLen, 1u});
                CHILD_CHECK_OK(h1.wait(std::chrono::seconds(20)));
                OpHandle h2 = engine->paged_write(pages.op(other.peer, mr.get(), &other.desc, 2));
                CHILD_CHECK_OK(h2.wait(std::chrono::seconds(20)));
                CHILD_CHECK_MSG(engine->stats().bytes_posted >= kWriteLen + kBuf / 2,
                                "only {} bytes went through the provider",
                                engine->stats().bytes_posted);
                ByteWriter counts;
                counts.put<uint32_t>(h1.imm_writes());
                counts.put<uint32_t>(h2.imm_writes());
                CHILD_CHECK(ex.allgather(counts.bytes()).ok());
                CHILD_CHECK(ex.barrier().ok());  // rank 1 read from us and checked
            } else {
                CHILD_ASSIGN_OK(auto counts, ex.allgather({}));
                ByteReader cr(counts[0]);
                uint32_t n1 = 0, n2 = 0;
                CHILD_CHECK_OK(cr.get(&n1, "writes with imm 1"));
                CHILD_CHECK_OK(cr.get(&n2, "writes with imm 2"));
                CHILD_CHECK_OK(engine->wait_imm(1, n1, std::chrono::seconds(20)));
                CHILD_CHECK_OK(engine->wait_imm(2, n2, std::chrono::seconds(20)));
                // Rank 0's first bytes read back into a poisoned stretch of this GPU buffer.
                CHILD_CHECK_OK(
                    engine->read({other.peer, mr.get(), kReadAt, &other.desc, 0, kReadLen})
                        .wait(std::chrono::seconds(20)));
                std::vector<uint8_t> want(kBuf, 0xCD);
                std::memcpy(want.data() + 7, host.data() + 5, kWriteLen);
                std::memcpy(want.data() + kReadAt, host.data(), kReadLen);
                pages.apply(want, host);
                CHILD_RUN(check_gpu(d, want));
                CHILD_CHECK(ex.barrier().ok());
            }
            mr.reset();
            engine.reset();
            cudaFree(d);
            return "";
        },
        std::chrono::seconds(120));
    std::string skipped = skip_reason(results);
    if (!skipped.empty()) GTEST_SKIP() << skipped;
    EXPECT_EQ(testing::describe_failures(results), "");
}
#else
class GpuFabricTest : public ::testing::TestWithParam<std::string> {};
TEST_P(GpuFabricTest, GpuToGpuThroughProviderArrivesIntact) {
    GTEST_SKIP() << testing::no_gpu_reason();
}
#endif

INSTANTIATE_TEST_SUITE_P(Providers, GpuFabricTest, ::testing::ValuesIn(testing::test_providers()));

}  // namespace
}  // namespace ferry

// The CUDA all-to-all against the CPU backend on the same inputs: batches must be
// byte-identical (same group order, same rows, same fp8 bytes and scales), combine outputs
// equal to the CPU's fp32 sums, plus the independent checks of test_util.h. Outputs are
// poisoned before every call. Cases with ranks_per_node below the world run the ranks of
// other "nodes" through the host proxy and a TransferEngine (tcp or shm), even on one GPU.
//
// CUDA is only ever initialised in forked children (the harness forks; a process that has
// touched CUDA cannot fork usable children), so every case runs inside run_processes: one
// child with a thread per rank (several ranks per GPU: EP4/EP8 on two GPUs), or one child per
// rank (one rank per GPU, CUDA IPC between processes).
#include "ferry/moe/cuda_all_to_all.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "bench/moe_internal.h"
#include "ferry/moe/local_world.h"
#include "moe/test_util.h"
#include "support/engine_fixture.h"
#include "support/gpu.h"
#include "support/multiproc.h"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>

#include "common/cuda_check.h"
#endif

namespace ferry::moe {
namespace {

using testing::BatchStorage;
using testing::RankInput;
using testing::Routing;

struct CudaCase {
    const char* name;
    uint32_t world = 2;
    DType dtype = DType::kFp8E4M3;
    uint32_t hidden = 512;
    uint32_t num_experts = 32;
    uint32_t topk = 4;
    uint32_t max_tokens = 64;
    uint32_t private_slots = 8;
    uint32_t alignment = 1;
    Routing routing = Routing::kUniform;
    double hole = 0.15;
    bool empty_rank = false;  // rank world-1 dispatches no tokens
    bool full = false;        // every rank dispatches max_tokens
    int calls = 3;
    bool processes = false;  // one process per rank instead of one thread per rank
    bool bf16_out = false;
    bool graph = false;            // capture each half once, replay it for every call
    uint32_t ranks_per_node = 0;   // 0: every rank on one node; else the others via the proxy
    const char* provider = "tcp";  // the engines' provider between nodes
    // CUDA_DEVICE_MAX_CONNECTIONS in the child (0: CUDA's default, 8). Streams beyond it
    // share hardware queues, where work waits behind another stream's running kernel.
    int hw_queues = 0;
    CombineMode combine = CombineMode::kPerHit;
    // dispatch_recv writes per-expert slabs (CudaExpertBatch::capacity) and combine_send reads
    // the expert outputs there: the layout of the Python interfaces.
    bool slabs = false;
    bool indices64 = false;        // the routing as int64 (CudaDispatchInput::indices64)
    bool combine_weights = false;  // dispatch wrong weights, give the right ones at combine
    // Remote ranks: the proxy's write size (0: the default), which also sets the streamed
    // combine's pieces (whole rows within it); whole_combine: no streaming.
    uint64_t proxy_chunk = 0;
    bool whole_combine = false;
};

void PrintTo(const CudaCase& c, std::ostream* os) { *os << c.name; }

// The decode shape of DeepSeek-style models on top of a case: 128 tokens, hidden 7168, top-8
// of 256 experts, 32 private slots.
CudaCase decode_shape(CudaCase c) {
    c.hidden = 7168;
    c.num_experts = 256;
    c.topk = 8;
    c.max_tokens = 128;
    c.private_slots = 32;
    return c;
}

#ifdef FERRY_HAVE_CUDA

AllToAllConfig config_of(const CudaCase& k) {
    AllToAllConfig c;
    c.max_tokens_per_rank = k.max_tokens;
    c.hidden = k.hidden;
    c.dtype = k.dtype;
    c.num_experts = k.num_experts;
    c.experts_per_token = k.topk;
    c.world_size = k.world;
    c.ranks_per_node = k.ranks_per_node ? k.ranks_per_node : k.world;
    c.private_slots_per_sender = k.private_slots;
    c.group_alignment = k.alignment;
    c.combine = k.combine;
    return c;
}

// Every rank's inputs of every call, from one seed: each process derives the same.
std::vector<std::vector<RankInput>> make_calls(const CudaCase& k, uint64_t seed) {
    std::mt19937_64 rng(seed);
    AllToAllConfig cfg = config_of(k);
    std::vector<std::vector<RankInput>> calls(k.calls);
    for (int c = 0; c < k.calls; ++c) {
        for (uint32_t r = 0; r < k.world; ++r) {
            uint32_t n = k.full ? k.max_tokens : static_cast<uint32_t>(rng() % (k.max_tokens + 1));
            if (k.empty_rank && r + 1 == k.world) n = 0;
            calls[c].push_back(testing::make_input(cfg, r, n, k.routing, k.hole, rng));
        }
    }
    return calls;
}

struct CpuRef {
    std::vector<std::vector<std::unique_ptr<BatchStorage>>> batch;  // [call][rank]
    std::vector<std::vector<std::vector<float>>> out;               // [call][rank]
};

Result<CpuRef> cpu_reference(const CudaCase& k, const std::vector<std::vector<RankInput>>& in) {
    AllToAllConfig cfg = config_of(k);
    FERRY_ASSIGN_OR_RETURN(auto world, LocalWorld::create(cfg, std::chrono::seconds(30)));
    CpuRef ref;
    ref.batch.resize(k.calls);
    ref.out.resize(k.calls);
    for (int c = 0; c < k.calls; ++c) {
        for (uint32_t r = 0; r < k.world; ++r) {
            AllToAllConfig rc = cfg;
            rc.rank = r;
            ref.batch[c].push_back(std::make_unique<BatchStorage>(rc));
            ref.out[c].emplace_back(size_t{k.max_tokens} * k.hidden, 0.0f);
        }
        FERRY_RETURN_IF_ERROR(world->run([&](uint32_t r, CpuBackend& b) -> Status {
            FERRY_RETURN_IF_ERROR(b.dispatch_send(in[c][r].input()));
            BatchStorage& bs = *ref.batch[c][r];
            FERRY_RETURN_IF_ERROR(b.dispatch_recv(bs.batch()));
            std::vector<uint16_t> y = testing::run_experts(b.config(), bs, true);
            FERRY_RETURN_IF_ERROR(b.combine_send(y));
            return b.combine_recv(ref.out[c][r]);
        }));
    }
    return ref;
}

#define RANK_CUDA(expr)                                                      \
    do {                                                                     \
        if (::ferry::Status cuda_s_ = FERRY_CUDA_CHECK(expr); !cuda_s_.ok()) \
            return cuda_s_.message();                                        \
    } while (0)

// Device memory of one rank's test: freed on every return path.
struct DevMem {
    std::vector<void*> ptrs;
    ~DevMem() {
        for (void* p : ptrs) cudaFree(p);
    }
    template <typename T>
    T* alloc(size_t count) {
        void* p = nullptr;
        if (cudaMalloc(&p, std::max<size_t>(count * sizeof(T), 16)) != cudaSuccess) return nullptr;
        ptrs.push_back(p);
        return static_cast<T*>(p);
    }
};

// One rank: every call through the GPU, outputs compared with the CPU reference.
std::string run_gpu_rank(const CudaCase& k, uint32_t rank, int device, const AllGatherFn& ag,
                         const std::vector<std::vector<RankInput>>& in, const CpuRef& ref) {
    RANK_CUDA(cudaSetDevice(device));
    AllToAllConfig cfg = config_of(k);
    cfg.rank = rank;
    CudaAllToAllOptions opts;
    // Covers the other ranks' host-side checks between phases (about a second at the decode
    // shape) while keeping a broken case well inside gpu_check.sh's time bound.
    opts.timeout = std::chrono::seconds(8);
    opts.device = device;
    if (k.proxy_chunk) opts.proxy_chunk_bytes = k.proxy_chunk;
    opts.stream_combine = !k.whole_combine;
    std::unique_ptr<TransferEngine> engine;  // outlives the all-to-all
    if (cfg.world_size > cfg.ranks_per_node) {
        auto e = TransferEngine::create(ferry::testing::test_engine_config(k.provider));
        if (!e.ok()) return "engine: " + e.status().to_string();
        engine = std::move(e).value();
        opts.engine = engine.get();
    }
    auto created = CudaAllToAll::create(cfg, ag, opts);
    if (!created.ok()) return "create: " + created.status().to_string();
    auto& a2a = **created;
    cudaStream_t stream;
    RANK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    struct StreamGuard {
        cudaStream_t s;
        ~StreamGuard() { cudaStreamDestroy(s); }
    } guard{stream};

    const uint32_t t = k.max_tokens, h = k.hidden, kk = k.topk, nl = cfg.num_local_experts();
    const size_t rows = max_expert_rows(cfg), pb = cfg.payload_bytes(),
                 spt = cfg.scales_per_token();
    DevMem mem;
    auto* x = mem.alloc<uint8_t>(size_t{t} * pb);
    auto* xs = mem.alloc<float>(size_t{t} * spt);
    auto* idx = mem.alloc<int32_t>(size_t{t} * kk);
    auto* wt = mem.alloc<float>(size_t{t} * kk);
    auto* ntok = mem.alloc<uint32_t>(1);
    auto* bc = mem.alloc<uint32_t>(nl);
    auto* bo = mem.alloc<uint32_t>(nl + 1);
    auto* bsrc = mem.alloc<RowSource>(rows);
    auto* out = mem.alloc<float>(size_t{t} * h);
    auto* out16 = mem.alloc<uint16_t>(size_t{t} * h);
    // Slabs: every token of every rank may land in one expert.
    const uint32_t cap = k.slabs ? (k.world * t + k.alignment - 1) / k.alignment * k.alignment : 0;
    const size_t xrows = k.slabs ? size_t{nl} * cap : rows;  // rows of bx, bs and y
    auto* bx = mem.alloc<uint8_t>(xrows * pb);
    auto* bs = mem.alloc<float>(xrows * spt);
    auto* y = mem.alloc<uint16_t>(xrows * h);
    auto* idx64 = mem.alloc<int64_t>(size_t{t} * kk);
    auto* cwt = mem.alloc<float>(size_t{t} * kk);
    if (!x || !xs || !idx || !wt || !ntok || !bx || !bs || !bc || !bo || !bsrc || !y || !out ||
        !out16 || !idx64 || !cwt)
        return "cudaMalloc failed";

    CudaDispatchInput din{x,    spt ? xs : nullptr,           k.indices64 ? nullptr : idx, wt,
                          ntok, k.indices64 ? idx64 : nullptr};
    CudaExpertBatch batch{bx, spt ? bs : nullptr, bc, bo, bsrc, cap};
    const float* combine_w = k.combine_weights ? cwt : nullptr;
    // Graph mode: the calls run once on the host while capturing; replays then rely on the
    // token count and the call number living on the device.
    struct Graphs {
        cudaGraphExec_t dispatch = nullptr, combine = nullptr;
        ~Graphs() {
            if (dispatch) cudaGraphExecDestroy(dispatch);
            if (combine) cudaGraphExecDestroy(combine);
        }
    } graphs;
    auto capture = [&](cudaGraphExec_t* exec, auto&& body) -> std::string {
        cudaGraph_t g = nullptr;
        RANK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        Status s = body();
        RANK_CUDA(cudaStreamEndCapture(stream, &g));
        if (!s.ok()) {
            cudaGraphDestroy(g);
            return "capture: " + s.to_string();
        }
        cudaError_t e = cudaGraphInstantiate(exec, g, 0);
        cudaGraphDestroy(g);
        RANK_CUDA(e);
        return "";
    };
    if (k.graph) {
        std::string err = capture(&graphs.dispatch, [&]() -> Status {
            FERRY_RETURN_IF_ERROR(a2a.dispatch_send(din, stream));
            return a2a.dispatch_recv(batch, stream);
        });
        if (!err.empty()) return err;
        err = capture(&graphs.combine, [&]() -> Status {
            FERRY_RETURN_IF_ERROR(a2a.combine_send(y, stream));
            return k.bf16_out ? a2a.combine_recv_bf16(out16, stream, combine_w)
                              : a2a.combine_recv(out, stream, combine_w);
        });
        if (!err.empty()) return err;
    }

    // Ranks sharing a GPU: cudaMalloc and friends may wait for the whole device, so no rank's
    // kernels may be waiting for a peer that is still allocating.
    if (auto ready = ag({}); !ready.ok()) return "set-up barrier: " + ready.status().to_string();
    for (int c = 0; c < k.calls; ++c) {
        const RankInput& mine = in[c][rank];
        const uint32_t n = mine.num_tokens;
        RANK_CUDA(cudaMemcpyAsync(x, mine.payload.data(), mine.payload.size(),
                                  cudaMemcpyHostToDevice, stream));
        if (spt)
            RANK_CUDA(cudaMemcpyAsync(xs, mine.scales.data(), mine.scales.size() * sizeof(float),
                                      cudaMemcpyHostToDevice, stream));
        RANK_CUDA(cudaMemcpyAsync(idx, mine.indices.data(), mine.indices.size() * 4,
                                  cudaMemcpyHostToDevice, stream));
        const std::vector<int64_t> wide(mine.indices.begin(), mine.indices.end());
        RANK_CUDA(
            cudaMemcpyAsync(idx64, wide.data(), wide.size() * 8, cudaMemcpyHostToDevice, stream));
        // combine_weights: the dispatch carries wrong weights; the right ones come at combine.
        std::vector<float> dispatched = mine.weights;
        if (k.combine_weights)
            for (float& v : dispatched) v = v * 3.0f + 0.25f;
        RANK_CUDA(cudaMemcpyAsync(wt, dispatched.data(), dispatched.size() * 4,
                                  cudaMemcpyHostToDevice, stream));
        RANK_CUDA(cudaMemcpyAsync(cwt, mine.weights.data(), mine.weights.size() * 4,
                                  cudaMemcpyHostToDevice, stream));
        // The host copies above read vectors that die with this iteration.
        RANK_CUDA(cudaStreamSynchronize(stream));
        RANK_CUDA(cudaMemcpyAsync(ntok, &n, 4, cudaMemcpyHostToDevice, stream));
        // Poison: every byte compared below must have been written by this call.
        RANK_CUDA(cudaMemsetAsync(bx, 0xa5, xrows * pb, stream));
        if (spt) RANK_CUDA(cudaMemsetAsync(bs, 0xa5, xrows * spt * 4, stream));
        RANK_CUDA(cudaMemsetAsync(bsrc, 0xa5, rows * sizeof(RowSource), stream));
        RANK_CUDA(cudaMemsetAsync(out, 0xff, size_t{t} * h * 4, stream));
        RANK_CUDA(cudaMemsetAsync(out16, 0xff, size_t{t} * h * 2, stream));
        if (k.graph) {
            RANK_CUDA(cudaGraphLaunch(graphs.dispatch, stream));
        } else {
            CHILD_CHECK_OK(a2a.dispatch_send(din, stream));
            CHILD_CHECK_OK(a2a.dispatch_recv(batch, stream));
        }
        CHILD_CHECK_OK(a2a.synchronize(stream));

        BatchStorage got(cfg);
        RANK_CUDA(cudaMemcpy(got.counts.data(), bc, nl * 4, cudaMemcpyDeviceToHost));
        RANK_CUDA(cudaMemcpy(got.offsets.data(), bo, (nl + 1) * 4, cudaMemcpyDeviceToHost));
        const uint32_t total = got.offsets[nl];
        CHILD_CHECK_MSG(total <= rows, "call {}: {} rows exceed the maximum {}", c, total, rows);
        if (k.slabs) {
            // Each slab holds its group (padding included) at its start and nothing after.
            std::vector<uint8_t> px(xrows * pb);
            std::vector<float> ps(xrows * spt);
            RANK_CUDA(cudaMemcpy(px.data(), bx, px.size(), cudaMemcpyDeviceToHost));
            if (spt) RANK_CUDA(cudaMemcpy(ps.data(), bs, ps.size() * 4, cudaMemcpyDeviceToHost));
            for (uint32_t e = 0; e < nl; ++e) {
                const uint32_t g0 = got.offsets[e], g1 = got.offsets[e + 1];
                CHILD_CHECK_MSG(g1 - g0 <= cap, "call {}: group {} of {} rows > capacity {}", c, e,
                                g1 - g0, cap);
                const size_t slab = size_t{e} * cap;
                std::memcpy(got.x.data() + size_t{g0} * pb, px.data() + slab * pb,
                            size_t{g1 - g0} * pb);
                if (spt)
                    std::memcpy(got.scales.data() + size_t{g0} * spt, ps.data() + slab * spt,
                                size_t{g1 - g0} * spt * 4);
                for (size_t b = (slab + g1 - g0) * pb; b < (slab + cap) * pb; ++b)
                    CHILD_CHECK_MSG(px[b] == 0xa5,
                                    "call {} rank {}: slab {} written past its group (byte {})", c,
                                    rank, e, b - slab * pb);
            }
        } else {
            RANK_CUDA(cudaMemcpy(got.x.data(), bx, total * pb, cudaMemcpyDeviceToHost));
            if (spt)
                RANK_CUDA(
                    cudaMemcpy(got.scales.data(), bs, total * spt * 4, cudaMemcpyDeviceToHost));
        }
        RANK_CUDA(cudaMemcpy(got.sources.data(), bsrc, total * sizeof(RowSource),
                             cudaMemcpyDeviceToHost));

        const BatchStorage& want = *ref.batch[c][rank];
        CHILD_CHECK_MSG(got.counts == want.counts && got.offsets == want.offsets,
                        "call {} rank {}: group counts/offsets differ from the cpu backend", c,
                        rank);
        std::string err = testing::check_dispatch(cfg, in[c], got);
        CHILD_CHECK_MSG(err.empty(), "call {}: {}", c, err);
        CHILD_CHECK_MSG(std::memcmp(got.x.data(), want.x.data(), total * pb) == 0,
                        "call {} rank {}: batch payload bytes differ from the cpu backend", c,
                        rank);
        CHILD_CHECK_MSG(
            spt == 0 || std::memcmp(got.scales.data(), want.scales.data(), total * spt * 4) == 0,
            "call {} rank {}: batch scales differ from the cpu backend", c, rank);
        for (uint32_t o = 0; o < total; ++o)
            CHILD_CHECK_MSG(got.sources[o].rank == want.sources[o].rank &&
                                got.sources[o].token == want.sources[o].token &&
                                got.sources[o].k == want.sources[o].k,
                            "call {} rank {} row {}: source ({},{},{}) but cpu has ({},{},{})", c,
                            rank, o, got.sources[o].rank, got.sources[o].token, got.sources[o].k,
                            want.sources[o].rank, want.sources[o].token, want.sources[o].k);

        std::vector<uint16_t> ys = testing::run_experts(cfg, got, true);
        if (k.slabs && !ys.empty()) {
            // The expert outputs in slabs too; the rest of each slab is poison, never read.
            std::vector<uint16_t> py(xrows * h, 0xffff);
            for (uint32_t e = 0; e < nl; ++e)
                std::memcpy(py.data() + size_t{e} * cap * h, ys.data() + size_t{got.offsets[e]} * h,
                            size_t{got.offsets[e + 1] - got.offsets[e]} * h * 2);
            ys = std::move(py);
        }
        if (!ys.empty()) {
            RANK_CUDA(cudaMemcpyAsync(y, ys.data(), ys.size() * 2, cudaMemcpyHostToDevice, stream));
            RANK_CUDA(cudaStreamSynchronize(stream));  // ys dies with this iteration
        }
        if (k.graph) {
            RANK_CUDA(cudaGraphLaunch(graphs.combine, stream));
        } else {
            CHILD_CHECK_OK(a2a.combine_send(y, stream));
            if (k.bf16_out) {
                CHILD_CHECK_OK(a2a.combine_recv_bf16(out16, stream, combine_w));
            } else {
                CHILD_CHECK_OK(a2a.combine_recv(out, stream, combine_w));
            }
        }
        CHILD_CHECK_OK(a2a.synchronize(stream));
        std::vector<float> res(size_t{n} * h);
        if (k.bf16_out) {
            std::vector<uint16_t> r16(size_t{n} * h);
            RANK_CUDA(cudaMemcpy(r16.data(), out16, r16.size() * 2, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < r16.size(); ++i) res[i] = bf16_to_float(r16[i]);
        } else {
            RANK_CUDA(cudaMemcpy(res.data(), out, res.size() * 4, cudaMemcpyDeviceToHost));
        }
        const std::vector<float>& cpu = ref.out[c][rank];
        for (size_t i = 0; i < res.size(); ++i) {
            // Same operations in the same order as the CPU; the margin only covers a host
            // compiler that fuses multiply-add (aarch64), and one bf16 step when rounded.
            float want_v = k.bf16_out ? bf16_to_float(float_to_bf16(cpu[i])) : cpu[i];
            float tol = k.bf16_out ? std::fabs(want_v) / 128 : std::fabs(want_v) * 1e-6f;
            CHILD_CHECK_MSG(std::fabs(res[i] - want_v) <= tol,
                            "call {} rank {} token {} channel {}: gpu combine {} vs cpu {}", c,
                            rank, i / h, i % h, res[i], want_v);
        }
        err = testing::check_combine(cfg, mine, res, true, k.bf16_out ? 1.0f / 256 : 1e-5f);
        CHILD_CHECK_MSG(err.empty(), "call {}: {}", c, err);
    }
    // Nobody frees buffers a slower rank may still write into.
    auto done = ag({});
    if (!done.ok()) return "final barrier: " + done.status().to_string();
    return "";
}

// Inputs of a call with no tokens (a device token count of 0), in `mem`.
std::string no_tokens(const CudaCase& k, DevMem& mem, CudaDispatchInput* in) {
    auto* x = mem.alloc<uint8_t>(size_t{k.max_tokens} * k.hidden);
    auto* xs = mem.alloc<float>(size_t{k.max_tokens} * k.hidden / 128);
    auto* idx = mem.alloc<int32_t>(size_t{k.max_tokens} * k.topk);
    auto* wt = mem.alloc<float>(size_t{k.max_tokens} * k.topk);
    auto* n = mem.alloc<uint32_t>(1);
    CHILD_CHECK(x && xs && idx && wt && n);
    RANK_CUDA(cudaMemset(n, 0, 4));
    RANK_CUDA(cudaDeviceSynchronize());
    *in = {x, xs, idx, wt, n};
    return "";
}

int visible_gpus() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::string run_case_in_child(const CudaCase& k, uint64_t seed, ferry::testing::Exchange& ex) {
    // Before CUDA starts in this child.
    if (k.hw_queues) setenv("CUDA_DEVICE_MAX_CONNECTIONS", std::to_string(k.hw_queues).c_str(), 1);
    auto calls = make_calls(k, seed);
    auto ref = cpu_reference(k, calls);
    if (!ref.ok()) return "cpu reference: " + ref.status().to_string();
    int gpus = visible_gpus();
    if (gpus == 0) return "no GPU visible in the child";
    if (k.processes) {
        uint32_t r = static_cast<uint32_t>(ex.rank());
        AllGatherFn ag = [&ex](std::span<const uint8_t> b) { return ex.allgather(b); };
        return run_gpu_rank(k, r, static_cast<int>(r % gpus), ag, calls, *ref);
    }
    bench_detail::ThreadExchange tg(k.world);
    std::vector<std::string> errors(k.world);
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < k.world; ++r) {
        threads.emplace_back([&, r] {
            AllGatherFn ag = [&tg, r](std::span<const uint8_t> b) {
                return tg.allgather(r, b, std::chrono::seconds(60));
            };
            errors[r] = run_gpu_rank(k, r, static_cast<int>(r % gpus), ag, calls, *ref);
        });
    }
    for (auto& th : threads) th.join();
    std::string all;
    for (uint32_t r = 0; r < k.world; ++r)
        if (!errors[r].empty()) all += fmt::format("[rank {}] {}\n", r, errors[r]);
    return all;
}

#endif  // FERRY_HAVE_CUDA

class CudaAllToAllTest : public ::testing::TestWithParam<CudaCase> {};

TEST_P(CudaAllToAllTest, MatchesCpuBackendAcrossCalls) {
    if (ferry::testing::gpu_count() == 0) GTEST_SKIP() << ferry::testing::no_gpu_reason();
#ifdef FERRY_HAVE_CUDA
    const CudaCase& k = GetParam();
    uint64_t seed = ferry::testing::test_seed(k.name);
    int procs = k.processes ? static_cast<int>(k.world) : 1;
    auto results = ferry::testing::run_processes(
        procs, [&](ferry::testing::Exchange& ex) { return run_case_in_child(k, seed, ex); },
        std::chrono::seconds(120));
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
#endif
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAllToAllTest,
    ::testing::Values(
        CudaCase{.name = "ep2_fp8_threads"},
        CudaCase{.name = "ep2_bf16_threads", .dtype = DType::kBf16, .bf16_out = true},
        CudaCase{.name = "ep2_fp8_processes", .processes = true},
        CudaCase{.name = "ep2_skewed_overflow",
                 .private_slots = 2,
                 .alignment = 8,
                 .routing = Routing::kSkewed,
                 .full = true},
        CudaCase{.name = "ep2_empty_rank", .empty_rank = true},
        CudaCase{.name = "ep2_no_private_slots", .private_slots = 0, .alignment = 4},
        decode_shape(CudaCase{
            .name = "ep2_decode_shape", .full = true, .calls = 2, .processes = true}),
        CudaCase{.name = "ep4_threads", .world = 4, .hole = 0.3, .calls = 4},
        CudaCase{
            .name = "ep4_graph_replay", .world = 4, .private_slots = 4, .calls = 4, .graph = true},
        CudaCase{.name = "ep2_graph_replay_processes",
                 .dtype = DType::kBf16,
                 .calls = 4,
                 .processes = true,
                 .bf16_out = true,
                 .graph = true},
        CudaCase{.name = "ep4_processes_skewed",
                 .world = 4,
                 .private_slots = 4,
                 .routing = Routing::kSkewed,
                 .processes = true},
        CudaCase{.name = "ep8_threads",
                 .world = 8,
                 .num_experts = 64,
                 .topk = 6,
                 .alignment = 16,
                 .calls = 3},
        CudaCase{.name = "ep8_processes_bf16",
                 .world = 8,
                 .dtype = DType::kBf16,
                 .hidden = 256,
                 .num_experts = 64,
                 .empty_rank = true,
                 .processes = true},
        // Remote ranks through the host proxy: every rank its own node, then 2 nodes x 2.
        CudaCase{.name = "ep2_remote_fp8", .ranks_per_node = 1},
        CudaCase{.name = "ep2_remote_bf16_shm",
                 .dtype = DType::kBf16,
                 .bf16_out = true,
                 .ranks_per_node = 1,
                 .provider = "shm"},
        CudaCase{.name = "ep2_remote_skewed_overflow",
                 .private_slots = 2,
                 .alignment = 8,
                 .routing = Routing::kSkewed,
                 .full = true,
                 .ranks_per_node = 1},
        CudaCase{.name = "ep2_remote_no_private_slots",
                 .private_slots = 0,
                 .alignment = 4,
                 .empty_rank = true,
                 .ranks_per_node = 1},
        decode_shape(CudaCase{
            .name = "ep2_remote_decode_shape", .full = true, .calls = 3, .ranks_per_node = 1}),
        CudaCase{.name = "ep2_remote_graph_replay",
                 .dtype = DType::kBf16,
                 .calls = 4,
                 .bf16_out = true,
                 .graph = true,
                 .ranks_per_node = 1},
        CudaCase{
            .name = "ep4_two_nodes_fp8", .world = 4, .hole = 0.3, .calls = 4, .ranks_per_node = 2},
        CudaCase{.name = "ep4_two_nodes_skewed_bf16_shm",
                 .world = 4,
                 .dtype = DType::kBf16,
                 .private_slots = 4,
                 .routing = Routing::kSkewed,
                 .full = true,
                 .ranks_per_node = 2,
                 .provider = "shm"},
        decode_shape(CudaCase{.name = "ep4_two_nodes_decode_processes",
                              .world = 4,
                              .calls = 2,
                              .processes = true,
                              .ranks_per_node = 2}),
        // 8 threads' streams plus the proxies' share CUDA's 8 hardware queues by default: a
        // proxy that copied onto the GPU through a stream waited behind a spinning kernel.
        CudaCase{.name = "ep8_four_nodes",
                 .world = 8,
                 .num_experts = 64,
                 .topk = 6,
                 .alignment = 16,
                 .calls = 3,
                 .ranks_per_node = 2},
        // Every stream of a process in one hardware queue (what Megatron sets): the remote
        // path must not need stream work while this rank's kernels wait.
        CudaCase{.name = "ep2_remote_processes_one_hw_queue",
                 .calls = 2,
                 .processes = true,
                 .ranks_per_node = 1,
                 .hw_queues = 1},
        // Per-rank partials: the expert's rank sums, one combine row per dispatched row.
        CudaCase{.name = "ep2_per_rank_threads", .combine = CombineMode::kPerRank},
        decode_shape(CudaCase{.name = "ep2_per_rank_decode_processes",
                              .full = true,
                              .calls = 2,
                              .processes = true,
                              .combine = CombineMode::kPerRank}),
        CudaCase{.name = "ep4_per_rank_graph_bf16_out",
                 .world = 4,
                 .private_slots = 4,
                 .calls = 4,
                 .bf16_out = true,
                 .graph = true,
                 .combine = CombineMode::kPerRank},
        CudaCase{.name = "ep8_per_rank_skewed",
                 .world = 8,
                 .num_experts = 64,
                 .topk = 6,
                 .alignment = 16,
                 .routing = Routing::kSkewed,
                 .calls = 3,
                 .combine = CombineMode::kPerRank},
        CudaCase{.name = "ep2_remote_per_rank_overflow",
                 .private_slots = 2,
                 .routing = Routing::kSkewed,
                 .full = true,
                 .ranks_per_node = 1,
                 .combine = CombineMode::kPerRank},
        CudaCase{.name = "ep4_two_nodes_per_rank_graph",
                 .world = 4,
                 .hole = 0.3,
                 .calls = 4,
                 .graph = true,
                 .ranks_per_node = 2,
                 .combine = CombineMode::kPerRank},
        // The Python interfaces' calls: slabs, int64 routing, weights given at combine.
        CudaCase{.name = "ep2_slabs_int64_combine_weights",
                 .alignment = 4,
                 .routing = Routing::kSkewed,
                 .slabs = true,
                 .indices64 = true,
                 .combine_weights = true},
        decode_shape(CudaCase{.name = "ep2_slabs_decode_graph_processes",
                              .full = true,
                              .calls = 3,
                              .processes = true,
                              .bf16_out = true,
                              .graph = true,
                              .slabs = true,
                              .indices64 = true,
                              .combine_weights = true}),
        // The streamed combine in pieces of three rows (every run many pieces, finished out of
        // order by the warps), into slabs; and the whole-put combine it replaces.
        CudaCase{.name = "ep4_two_nodes_streamed_small_pieces_slabs",
                 .world = 4,
                 .routing = Routing::kSkewed,
                 .full = true,
                 .ranks_per_node = 2,
                 .slabs = true,
                 .proxy_chunk = 3 * 512 * 2},
        CudaCase{.name = "ep2_remote_whole_combine",
                 .calls = 2,
                 .ranks_per_node = 1,
                 .whole_combine = true},
        CudaCase{.name = "ep4_two_nodes_per_rank_slabs",
                 .world = 4,
                 .alignment = 8,
                 .hole = 0.3,
                 .ranks_per_node = 2,
                 .combine = CombineMode::kPerRank,
                 .slabs = true}),
    [](const ::testing::TestParamInfo<CudaCase>& i) { return std::string(i.param.name); });

// A rank that never calls turns into a timeout that names it, not a hang.
TEST(CudaAllToAllSetup, ASilentPeerTurnsIntoATimeoutNamingIt) {
    if (ferry::testing::gpu_count() == 0) GTEST_SKIP() << ferry::testing::no_gpu_reason();
#ifdef FERRY_HAVE_CUDA
    CudaCase k{.name = "silent"};
    auto results = ferry::testing::run_processes(
        2,
        [&](ferry::testing::Exchange& ex) -> std::string {
            int gpus = visible_gpus();
            CHILD_CHECK(gpus > 0);
            AllToAllConfig cfg = config_of(k);
            cfg.rank = static_cast<uint32_t>(ex.rank());
            RANK_CUDA(cudaSetDevice(ex.rank() % gpus));
            CudaAllToAllOptions opts;
            opts.timeout = std::chrono::milliseconds(300);
            AllGatherFn ag = [&ex](std::span<const uint8_t> b) { return ex.allgather(b); };
            CHILD_ASSIGN_OK(auto a2a, CudaAllToAll::create(cfg, ag, opts));
            if (ex.rank() == 0) {
                DevMem mem;
                CudaDispatchInput in;
                if (std::string err = no_tokens(k, mem, &in); !err.empty()) return err;
                CHILD_CHECK_OK(a2a->dispatch_send(in, nullptr));
                Status s = a2a->synchronize(nullptr);
                CHILD_CHECK_MSG(s.code() == StatusCode::kTimeout, "got {}", s.to_string());
                CHILD_CHECK_MSG(s.message().find("rank 1") != std::string::npos &&
                                    s.message().find("waiting for counts") != std::string::npos,
                                "message: {}", s.message());
                // Broken now: later calls are refused with the cause.
                Status again = a2a->dispatch_recv({}, nullptr);
                CHILD_CHECK_MSG(
                    !again.ok() && again.message().find("recreate") != std::string::npos,
                    "second call: {}", again.to_string());
            }
            auto done = ex.barrier();
            return done.ok() ? "" : done.to_string();
        },
        std::chrono::seconds(60));
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
#endif
}

#ifdef FERRY_HAVE_CUDA
// Two ranks on two "nodes" (processes on this host's GPUs, engines over tcp). Rank 1 makes no
// call; with engine_gone it also destroys its all-to-all and its engine first. Rank 0's
// dispatch_send must end in an error naming rank 1, within the deadline, and the object must
// refuse further calls.
std::string remote_failure_rank(ferry::testing::Exchange& ex, bool engine_gone) {
    int gpus = visible_gpus();
    CHILD_CHECK(gpus > 0);
    CudaCase k{.name = "remote_failure", .ranks_per_node = 1};
    AllToAllConfig cfg = config_of(k);
    cfg.rank = static_cast<uint32_t>(ex.rank());
    RANK_CUDA(cudaSetDevice(ex.rank() % gpus));
    EngineConfig ec = ferry::testing::test_engine_config("tcp");
    ec.op_timeout = std::chrono::seconds(1);
    CHILD_ASSIGN_OK(auto engine, TransferEngine::create(ec));
    CudaAllToAllOptions opts;
    // Silent peer: the kernel's own deadline. Engine gone: well above the engine's, so the
    // proxy's failure must be what stops the kernels.
    opts.timeout = engine_gone ? std::chrono::seconds(6) : std::chrono::milliseconds(400);
    opts.engine = engine.get();
    AllGatherFn ag = [&ex](std::span<const uint8_t> b) { return ex.allgather(b); };
    CHILD_ASSIGN_OK(auto a2a, CudaAllToAll::create(cfg, ag, opts));
    if (ex.rank() == 1) {
        if (engine_gone) {
            a2a.reset();
            engine.reset();
        }
        CHILD_CHECK_OK(ex.barrier());  // rank 0 calls now
        CHILD_CHECK_OK(ex.barrier());  // and is done
        return "";
    }
    DevMem mem;
    CudaDispatchInput in;
    if (std::string err = no_tokens(k, mem, &in); !err.empty()) return err;
    CHILD_CHECK_OK(ex.barrier());
    auto t0 = Clock::now();
    CHILD_CHECK_OK(a2a->dispatch_send(in, nullptr));
    Status s = a2a->synchronize(nullptr);
    const auto took = Clock::now() - t0;
    CHILD_CHECK_MSG(!s.ok(), "dispatch_send with rank 1 {} succeeded",
                    engine_gone ? "gone" : "silent");
    CHILD_CHECK_MSG(s.message().find("rank 1") != std::string::npos, "message: {}", s.to_string());
    if (engine_gone) {
        CHILD_CHECK_MSG(s.message().find("host proxy") != std::string::npos, "message: {}",
                        s.to_string());
        CHILD_CHECK_MSG(took < std::chrono::seconds(4), "took {} ms: {}", to_ms(took),
                        s.to_string());
    } else {
        CHILD_CHECK_MSG(s.code() == StatusCode::kTimeout &&
                            s.message().find("waiting for counts") != std::string::npos,
                        "message: {}", s.to_string());
        CHILD_CHECK_MSG(took < std::chrono::seconds(3), "took {} ms", to_ms(took));
    }
    Status again = a2a->dispatch_recv({}, nullptr);
    CHILD_CHECK_MSG(!again.ok() && again.message().find("recreate") != std::string::npos,
                    "second call: {}", again.to_string());
    CHILD_CHECK_OK(ex.barrier());
    return "";
}
#endif  // FERRY_HAVE_CUDA

// false: a silent peer turns into a timeout naming it and the phase; true: a peer whose engine
// is gone turns into an error naming it, not a hang.
class CudaAllToAllRemoteFailure : public ::testing::TestWithParam<bool> {};

TEST_P(CudaAllToAllRemoteFailure, EndsInAnErrorNamingThePeerWithinTheDeadline) {
    if (ferry::testing::gpu_count() == 0) GTEST_SKIP() << ferry::testing::no_gpu_reason();
#ifdef FERRY_HAVE_CUDA
    const bool engine_gone = GetParam();
    auto results = ferry::testing::run_processes(
        2, [&](ferry::testing::Exchange& ex) { return remote_failure_rank(ex, engine_gone); },
        std::chrono::seconds(60));
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
#endif
}

INSTANTIATE_TEST_SUITE_P(Peers, CudaAllToAllRemoteFailure, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) {
                             return std::string(i.param ? "engine_gone" : "silent");
                         });

#ifdef FERRY_HAVE_CUDA
// Two ranks on two "nodes", the first streaming its combine in pieces, the second not: each
// would read the other's combine rows by pieces it never sends, so create() refuses on both.
std::string mismatched_streaming_rank(ferry::testing::Exchange& ex) {
    int gpus = visible_gpus();
    CHILD_CHECK(gpus > 0);
    CudaCase k{.name = "mismatched_streaming", .ranks_per_node = 1};
    AllToAllConfig cfg = config_of(k);
    cfg.rank = static_cast<uint32_t>(ex.rank());
    RANK_CUDA(cudaSetDevice(ex.rank() % gpus));
    CHILD_ASSIGN_OK(auto engine, TransferEngine::create(ferry::testing::test_engine_config("tcp")));
    CudaAllToAllOptions opts;
    opts.engine = engine.get();
    opts.stream_combine = ex.rank() == 0;
    AllGatherFn ag = [&ex](std::span<const uint8_t> b) { return ex.allgather(b); };
    auto a2a = CudaAllToAll::create(cfg, ag, opts);
    CHILD_CHECK_MSG(!a2a.ok(), "create() accepted ranks that stream the combine differently");
    CHILD_CHECK_MSG(a2a.status().code() == StatusCode::kInvalidArgument &&
                        a2a.status().message().find("stream_combine and proxy_chunk_bytes") !=
                            std::string::npos,
                    "message: {}", a2a.status().to_string());
    // An immediate base whose range would wrap past 2^32 is refused before any exchange.
    opts.stream_combine = true;
    opts.imm_base = 0xffffff00u;
    auto wrapped = CudaAllToAll::create(cfg, ag, opts);
    CHILD_CHECK_MSG(!wrapped.ok() && wrapped.status().code() == StatusCode::kInvalidArgument &&
                        wrapped.status().message().find("imm_base 0xffffff00") != std::string::npos,
                    "imm_base 0xffffff00: {}",
                    wrapped.ok() ? "accepted" : wrapped.status().to_string());
    return "";
}
#endif  // FERRY_HAVE_CUDA

TEST(CudaAllToAllSetup, RanksThatStreamTheCombineDifferentlyAreRefused) {
    if (ferry::testing::gpu_count() == 0) GTEST_SKIP() << ferry::testing::no_gpu_reason();
#ifdef FERRY_HAVE_CUDA
    auto results =
        ferry::testing::run_processes(2, mismatched_streaming_rank, std::chrono::seconds(60));
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
#endif
}

// The device quantizer writes the bytes and scales of the CPU reference.
TEST(CudaQuantize, MatchesCpuQuantizerBitForBit) {
    if (ferry::testing::gpu_count() == 0) GTEST_SKIP() << ferry::testing::no_gpu_reason();
#ifdef FERRY_HAVE_CUDA
    auto results = ferry::testing::run_processes(
        1,
        [](ferry::testing::Exchange&) -> std::string {
            const uint32_t tokens = 77, hidden = 1024;
            std::mt19937_64 rng(ferry::testing::test_seed("CudaQuantize"));
            std::normal_distribution<float> d(0.0f, 3.0f);
            std::vector<uint16_t> x(size_t{tokens} * hidden);
            for (size_t i = 0; i < x.size(); ++i) {
                // Some blocks tiny or zero, to cover the amax floor.
                float scale = (i / 128) % 7 == 0 ? 1e-7f : ((i / 128) % 11 == 0 ? 0.0f : 1.0f);
                x[i] = float_to_bf16(d(rng) * scale);
            }
            std::vector<uint8_t> q(x.size()), gq(x.size());
            std::vector<float> s(x.size() / 128), gs(x.size() / 128);
            CHILD_CHECK_OK(quantize_fp8_bf16(x, tokens, hidden, q, s));
            DevMem mem;
            auto* dx = mem.alloc<uint16_t>(x.size());
            auto* dq = mem.alloc<uint8_t>(x.size());
            auto* ds = mem.alloc<float>(s.size());
            auto* dy = mem.alloc<uint16_t>(x.size());
            RANK_CUDA(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
            CHILD_CHECK_OK(cuda_quantize_fp8(dx, tokens, hidden, dq, ds, nullptr));
            CHILD_CHECK_OK(cuda_dequantize_fp8_to_bf16(dq, ds, tokens, hidden, dy, nullptr));
            RANK_CUDA(cudaDeviceSynchronize());
            RANK_CUDA(cudaMemcpy(gq.data(), dq, gq.size(), cudaMemcpyDeviceToHost));
            RANK_CUDA(cudaMemcpy(gs.data(), ds, gs.size() * 4, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < q.size(); ++i)
                CHILD_CHECK_MSG(q[i] == gq[i], "element {}: gpu fp8 {:02x}, cpu {:02x}", i, gq[i],
                                q[i]);
            for (size_t i = 0; i < s.size(); ++i)
                CHILD_CHECK_MSG(s[i] == gs[i], "block {}: gpu scale {}, cpu {}", i, gs[i], s[i]);
            std::vector<uint16_t> y(x.size()), gy(x.size());
            CHILD_CHECK_OK(dequantize_fp8_to_bf16(q, s, tokens, hidden, y));
            RANK_CUDA(cudaMemcpy(gy.data(), dy, gy.size() * 2, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < y.size(); ++i)
                CHILD_CHECK_MSG(y[i] == gy[i], "element {}: gpu dequant {:04x}, cpu {:04x}", i,
                                gy[i], y[i]);
            return "";
        },
        std::chrono::seconds(60));
    EXPECT_EQ(ferry::testing::describe_failures(results), "");
#endif
}

// Without CUDA the API exists and says why it cannot run; with it, ranks on other nodes need
// an engine, which is checked before any GPU is touched.
TEST(CudaAllToAllSetup, RemotePeersWithoutAnEngineAreRefusedWithAClearError) {
    AllToAllConfig cfg;
    cfg.max_tokens_per_rank = 8;
    cfg.hidden = 256;
    cfg.num_experts = 8;
    cfg.experts_per_token = 2;
    cfg.world_size = 4;
    cfg.ranks_per_node = 2;
    auto r = CudaAllToAll::create(cfg, [](std::span<const uint8_t>) {
        return Result<std::vector<std::vector<uint8_t>>>(std::vector<std::vector<uint8_t>>{});
    });
    ASSERT_FALSE(r.ok());
#ifdef FERRY_HAVE_CUDA
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
    EXPECT_NE(r.status().message().find("set CudaAllToAllOptions::engine"), std::string::npos)
        << r.status().to_string();
#else
    EXPECT_NE(r.status().message().find("no CUDA support"), std::string::npos)
        << r.status().to_string();
#endif
}

}  // namespace
}  // namespace ferry::moe

// ferry._ferry.MoeAllToAll: one rank's expert-parallel all-to-all for ferry.moe, on the CPU
// backend (ferry::moe::AllToAll) or the CUDA one (CudaAllToAll). Tensors arrive as raw data
// pointers: python/ferry/moe.py checks their shapes, dtypes, devices and contiguity (where
// it can name the argument) and owns every buffer; this layer only builds spans or device
// pointers and does the layout change between ferry's grouped batch and the padded
// [local experts, capacity, hidden] tensors the Python interfaces use. The GIL is released
// around every call that waits; the setup all-gather takes it back to call Python.
#include "moe.h"

#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "errors.h"
#include "ferry/moe/all_to_all.h"
#include "ferry/moe/cuda_all_to_all.h"
#include "ferry/moe/numerics.h"
#include "ferry/moe/plan.h"
#include "ferry/moe/transport.h"
#include "fork.h"

namespace py = pybind11;

namespace ferry::python {
namespace {

using moe::AllToAllConfig;

template <typename T>
T* ptr(uint64_t p) {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(p));
}

// The caller's all-gather (bytes -> list of bytes, one per rank) as ferry's AllGatherFn.
// Runs on the thread that called create(), which released the GIL: take it back.
moe::AllGatherFn wrap_allgather(py::function fn) {
    return [fn = std::move(fn)](
               std::span<const uint8_t> blob) -> Result<std::vector<std::vector<uint8_t>>> {
        py::gil_scoped_acquire gil;
        try {
            py::object got = fn(py::bytes(reinterpret_cast<const char*>(blob.data()), blob.size()));
            std::vector<std::vector<uint8_t>> out;
            for (py::handle item : got) {
                if (item.is_none()) {
                    out.emplace_back();
                    continue;
                }
                if (!PyBytes_Check(item.ptr()))
                    return invalid_argument(
                        "allgather must return a list of bytes (one per rank), got an item of "
                        "type " +
                        std::string(py::str(py::type::handle_of(item).attr("__name__"))));
                std::string_view s(PyBytes_AS_STRING(item.ptr()),
                                   static_cast<size_t>(PyBytes_GET_SIZE(item.ptr())));
                out.emplace_back(s.begin(), s.end());
            }
            return out;
        } catch (py::error_already_set& e) {
            return unavailable(std::string("the setup all-gather raised: ") + e.what());
        }
    };
}

// A bf16 all-to-all's config of rank 0, alignment 1: the fields the callers set alike.
AllToAllConfig config_of(uint32_t max_tokens, uint32_t hidden, uint32_t num_experts, uint32_t topk,
                         uint32_t world, uint32_t ranks_per_node, uint32_t private_slots) {
    AllToAllConfig c;
    c.max_tokens_per_rank = max_tokens;
    c.hidden = hidden;
    c.num_experts = num_experts;
    c.experts_per_token = topk;
    c.world_size = world;
    c.ranks_per_node = ranks_per_node;
    c.private_slots_per_sender = private_slots;
    return c;
}

// Group e of a grouped batch (rows offsets[e] .. offsets[e + 1]) <-> slab e of a padded
// [experts, capacity, row] tensor, on the host.
void copy_groups_host(uint8_t* grouped, uint8_t* padded, const uint32_t* offsets, uint32_t experts,
                      size_t row_bytes, uint32_t capacity, bool to_padded) {
    for (uint32_t e = 0; e < experts; ++e) {
        const size_t rows = std::min<size_t>(offsets[e + 1] - offsets[e], capacity);
        uint8_t* g = grouped + size_t{offsets[e]} * row_bytes;
        uint8_t* p = padded + size_t{e} * capacity * row_bytes;
        if (rows == 0) continue;
        if (to_padded) {
            std::memcpy(p, g, rows * row_bytes);
        } else {
            std::memcpy(g, p, rows * row_bytes);
        }
    }
}

class MoeAllToAll {
  public:
    MoeAllToAll(const AllToAllConfig& cfg, bool cuda, int device,
                std::shared_ptr<TransferEngine> engine, py::function allgather, Duration timeout,
                uint32_t imm_offset)
        : cfg_(cfg), cuda_(cuda), parts_(std::make_shared<Parts>()) {
        parts_->engine = std::move(engine);
        TransferEngine* engine_ptr = parts_->engine.get();
        moe::AllGatherFn ag = wrap_allgather(std::move(allgather));
        if (cuda) {
            moe::CudaAllToAllOptions o;
            o.timeout = timeout;
            o.imm_base += imm_offset;
            o.device = device;
            o.engine = engine_ptr;
            Result<std::unique_ptr<moe::CudaAllToAll>> r = internal_error("unset");
            {
                py::gil_scoped_release nogil;
                r = moe::CudaAllToAll::create(cfg, ag, o);
            }
            parts_->gpu = take(std::move(r));
        } else {
            if (!engine_ptr)
                throw StatusError(invalid_argument(
                    "the CPU all-to-all needs a TransferEngine (it registers its buffers)"));
            moe::AllToAllOptions o;
            o.timeout = timeout;
            o.imm_base += imm_offset;
            Result<std::unique_ptr<moe::AllToAll>> r = internal_error("unset");
            {
                py::gil_scoped_release nogil;
                r = moe::AllToAll::create(cfg, engine_ptr, ag, o);
            }
            parts_->cpu = take(std::move(r));
        }
    }

    // A call running on another thread keeps what it uses: the last of them frees it.
    void close() {
        std::shared_ptr<Parts> parts;
        {
            std::lock_guard lk(mu_);
            parts = std::move(parts_);
        }
        py::gil_scoped_release nogil;
        parts.reset();
    }

    // num_tokens (CPU) or num_tokens_dev (CUDA: a uint32 on the device). indices: int32, or
    // int64 where indices64 (CUDA only: the kernel narrows them, no copy before the call).
    void dispatch_send(uint32_t num_tokens, uint64_t num_tokens_dev, uint64_t x, uint64_t x_scale,
                       uint64_t indices, bool indices64, uint64_t weights, uint64_t stream) {
        const size_t n = num_tokens, k = cfg_.experts_per_token;
        if (indices64 && !cuda_)
            throw StatusError(invalid_argument("int64 indices are narrowed on the GPU only"));
        Status s;
        py::gil_scoped_release nogil;
        if (cuda_) {
            moe::CudaDispatchInput in{ptr<const void>(x),
                                      ptr<const float>(x_scale),
                                      indices64 ? nullptr : ptr<const int32_t>(indices),
                                      ptr<const float>(weights),
                                      ptr<const uint32_t>(num_tokens_dev),
                                      indices64 ? ptr<const int64_t>(indices) : nullptr};
            s = gpu()->dispatch_send(in, ptr<void>(stream));
        } else {
            moe::DispatchInput in;
            in.num_tokens = num_tokens;
            in.x = {ptr<const uint8_t>(x), n * cfg_.payload_bytes()};
            in.x_scale = {ptr<const float>(x_scale), n * cfg_.scales_per_token()};
            in.indices = {ptr<const int32_t>(indices), n * k};
            in.weights = {ptr<const float>(weights), n * k};
            s = cpu()->dispatch_send(in);
        }
        py::gil_scoped_acquire gil;
        check(s);
    }

    // Receives into slab e of out_x / out_scale ([local experts, capacity, ...]): on the GPU
    // the kernel writes there itself (CudaExpertBatch::capacity); on the CPU into the grouped
    // batch (batch_*: max_expert_rows rows), then every group is copied into its slab. counts:
    // the caller's int32 [local experts], written as uint32 (counts fit in 31 bits).
    void dispatch_recv(uint64_t batch_x, uint64_t batch_scale, uint64_t offsets, uint64_t counts,
                       uint64_t out_x, uint64_t out_scale, uint32_t capacity, uint64_t stream) {
        const uint32_t nl = cfg_.num_local_experts();
        const size_t rows = moe::max_expert_rows(cfg_), spt = cfg_.scales_per_token();
        const bool fp8 = cfg_.dtype == moe::DType::kFp8E4M3;
        Status s;
        py::gil_scoped_release nogil;
        if (cuda_) {
            // At the decode shape the copy into slabs after a grouped receive was a pass over
            // 2048 rows per rank each way (docs/BENCHMARKS.md, issue 16).
            moe::CudaExpertBatch b{ptr<void>(out_x),
                                   ptr<float>(out_scale),
                                   ptr<uint32_t>(counts),
                                   ptr<uint32_t>(offsets),
                                   nullptr,
                                   capacity};
            s = gpu()->dispatch_recv(b, ptr<void>(stream));
        } else {
            moe::ExpertBatch b;
            b.x = {ptr<uint8_t>(batch_x), rows * cfg_.payload_bytes()};
            b.x_scale = {ptr<float>(batch_scale), fp8 ? rows * spt : 0};
            b.counts = {ptr<uint32_t>(counts), nl};
            b.offsets = {ptr<uint32_t>(offsets), size_t{nl} + 1};
            s = cpu()->dispatch_recv(b);
            if (s.ok()) {
                copy_groups_host(b.x.data(), ptr<uint8_t>(out_x), b.offsets.data(), nl,
                                 cfg_.payload_bytes(), capacity, true);
                if (fp8)
                    copy_groups_host(reinterpret_cast<uint8_t*>(b.x_scale.data()),
                                     ptr<uint8_t>(out_scale), b.offsets.data(), nl,
                                     spt * sizeof(float), capacity, true);
            }
        }
        py::gil_scoped_acquire gil;
        check(s);
    }

    // expert_y: bf16 [local experts, capacity, hidden], the slabs of dispatch_recv (the GPU
    // kernel reads them there); on the CPU copied into batch_y, the grouped staging
    // (max_expert_rows bf16 rows), by offsets, those dispatch_recv wrote.
    void combine_send(uint64_t expert_y, uint32_t capacity, uint64_t batch_y, uint64_t offsets,
                      uint64_t stream) {
        const uint32_t nl = cfg_.num_local_experts();
        const size_t row = size_t{cfg_.hidden} * 2, rows = moe::max_expert_rows(cfg_);
        Status s;
        py::gil_scoped_release nogil;
        if (cuda_) {
            s = gpu()->combine_send(ptr<const uint16_t>(expert_y), ptr<void>(stream));
        } else {
            copy_groups_host(ptr<uint8_t>(batch_y), ptr<uint8_t>(expert_y),
                             ptr<const uint32_t>(offsets), nl, row, capacity, false);
            s = cpu()->combine_send({ptr<const uint16_t>(batch_y), rows * cfg_.hidden});
        }
        py::gil_scoped_acquire gil;
        check(s);
    }

    // weights: 0 keeps the dispatched ones; else num_tokens * top-k floats (CUDA: at least
    // as many rows as the dispatch's token count, read by the combine kernel).
    void combine_recv(uint32_t num_tokens, uint64_t out, bool bf16, uint64_t weights,
                      uint64_t stream) {
        const size_t n = num_tokens, h = cfg_.hidden, k = cfg_.experts_per_token;
        Status s;
        py::gil_scoped_release nogil;
        if (cuda_) {
            void* st = ptr<void>(stream);
            const float* w = ptr<const float>(weights);
            s = bf16 ? gpu()->combine_recv_bf16(ptr<uint16_t>(out), st, w)
                     : gpu()->combine_recv(ptr<float>(out), st, w);
        } else {
            if (weights) s = cpu()->set_combine_weights({ptr<const float>(weights), n * k});
            if (s.ok())
                s = bf16 ? cpu()->combine_recv_bf16({ptr<uint16_t>(out), n * h})
                         : cpu()->combine_recv({ptr<float>(out), n * h});
        }
        py::gil_scoped_acquire gil;
        check(s);
    }

    void synchronize(uint64_t stream) {
        if (!cuda_) {
            parts();  // raises once closed, as on CUDA
            return;
        }
        Status s;
        {
            py::gil_scoped_release nogil;
            s = gpu()->synchronize(ptr<void>(stream));
        }
        check(s);
    }

    void device_status() {
        if (cuda_) check(gpu()->device_status());
    }

    const AllToAllConfig& config() const { return cfg_; }
    bool is_cuda() const { return cuda_; }

  private:
    // What close() lets go of, shared with the calls still inside one (a close() on another
    // thread during a dispatch frees nothing in use). Destroyed bottom-up: the all-to-all, then
    // (maybe) the engine it runs on.
    struct Parts {
        std::shared_ptr<TransferEngine> engine;
        std::unique_ptr<moe::AllToAll> cpu;
        std::unique_ptr<moe::CudaAllToAll> gpu;
        MadeIn made;

        Parts() = default;
        Parts(const Parts&) = delete;
        Parts& operator=(const Parts&) = delete;
        ~Parts() {
            if (!made.inherited()) return;
            abandon(std::move(gpu));  // a fork child: the parent's (fork.h)
            abandon(std::move(cpu));
            abandon(std::move(engine));
        }
    };
    std::shared_ptr<Parts> parts() {
        std::lock_guard lk(mu_);
        if (!parts_) throw StatusError(cancelled("the all-to-all is closed"));
        return parts_;
    }
    // A reference to the all-to-all that keeps it (and its engine) alive for one call.
    std::shared_ptr<moe::AllToAll> cpu() {
        std::shared_ptr<Parts> p = parts();
        return std::shared_ptr<moe::AllToAll>(p, p->cpu.get());
    }
    std::shared_ptr<moe::CudaAllToAll> gpu() {
        std::shared_ptr<Parts> p = parts();
        return std::shared_ptr<moe::CudaAllToAll>(p, p->gpu.get());
    }

    AllToAllConfig cfg_;
    bool cuda_;
    std::mutex mu_;  // parts_
    std::shared_ptr<Parts> parts_;
};

}  // namespace

void register_moe(py::module_& m, EngineShare engine_share) {
    py::class_<MoeAllToAll>(m, "MoeAllToAll",
                            "One rank's C++ all-to-all (CPU backend or CUDA kernels); ferry.moe "
                            "drives it with raw data pointers after checking every tensor.")
        .def(
            py::init([engine_share](uint32_t max_tokens, uint32_t hidden, const std::string& dtype,
                                    uint32_t num_experts, uint32_t topk, uint32_t rank,
                                    uint32_t world, uint32_t ranks_per_node, uint32_t private_slots,
                                    uint32_t alignment, bool cuda, int device, py::object engine,
                                    py::function allgather, double timeout_s, uint32_t imm_offset) {
                // ferry.moe checked timeout_s with _ferry.seconds(); zero is refused here.
                auto timeout =
                    std::chrono::duration_cast<Duration>(std::chrono::duration<double>(timeout_s));
                if (timeout <= Duration::zero())
                    throw StatusError(invalid_argument("timeout must be > 0 seconds"));
                AllToAllConfig c = config_of(max_tokens, hidden, num_experts, topk, world,
                                             ranks_per_node, private_slots);
                if (!moe::parse_dtype(dtype, &c.dtype))
                    throw StatusError(invalid_argument("unknown MoE dtype " + dtype));
                c.rank = rank;
                c.group_alignment = alignment;
                c.combine = moe::CombineMode::kPerHit;
                std::shared_ptr<TransferEngine> e =
                    engine.is_none() ? nullptr : engine_share(engine);
                return std::make_unique<MoeAllToAll>(c, cuda, device, std::move(e),
                                                     std::move(allgather), timeout, imm_offset);
            }),
            py::arg("max_tokens"), py::arg("hidden"), py::arg("dtype"), py::arg("num_experts"),
            py::arg("topk"), py::arg("rank"), py::arg("world"), py::arg("ranks_per_node"),
            py::arg("private_slots"), py::arg("alignment"), py::arg("cuda"), py::arg("device"),
            py::arg("engine"), py::arg("allgather"), py::arg("timeout"),
            // Added to the C++ all-to-all's imm_base: two of them on one engine (AllToAll's
            // second dispatch in flight) keep their immediates apart.
            py::arg("imm_offset") = 0)
        .def("dispatch_send", &MoeAllToAll::dispatch_send)
        .def("dispatch_recv", &MoeAllToAll::dispatch_recv)
        .def("combine_send", &MoeAllToAll::combine_send)
        .def("combine_recv", &MoeAllToAll::combine_recv)
        .def("synchronize", &MoeAllToAll::synchronize)
        .def("device_status", &MoeAllToAll::device_status)
        .def("close", &MoeAllToAll::close)
        .def_property_readonly("is_cuda", &MoeAllToAll::is_cuda)
        .def_property_readonly(
            "max_expert_rows",
            [](const MoeAllToAll& a) { return moe::max_expert_rows(a.config()); })
        .def_property_readonly("num_local_experts",
                               [](const MoeAllToAll& a) { return a.config().num_local_experts(); });

    // Bytes one rank of a bf16 all-to-all of this shape holds (receive regions and staging,
    // what it registers with the engine): Buffer.get_low_latency_rdma_size_hint's answer.
    m.def("moe_rank_bytes", [](uint32_t max_tokens, uint32_t hidden, uint32_t num_experts,
                               uint32_t topk, uint32_t world, uint32_t private_slots) {
        AllToAllConfig c =
            config_of(max_tokens, hidden, num_experts, topk, world, world, private_slots);
        check(c.validate());
        return moe::RankMemoryLayout::of(c).total_bytes;
    });

    // The benchmarks' start gate (cuda_host_gate): flag is pinned host memory (a pinned torch
    // tensor's data pointer).
    m.def(
        "cuda_host_gate",
        [](uint64_t flag, uint32_t want, double timeout_s, uint64_t stream) {
            if (!(timeout_s > 0))
                throw StatusError(invalid_argument("timeout must be > 0 seconds"));
            auto timeout =
                std::chrono::duration_cast<Duration>(std::chrono::duration<double>(timeout_s));
            Status s;
            {
                py::gil_scoped_release nogil;
                s = moe::cuda_host_gate(ptr<const uint32_t>(flag), want, timeout,
                                        ptr<void>(stream));
            }
            check(s);
        },
        "Holds `stream` until the uint32 at `flag` (pinned host memory) is >= want (benchmarks).");

    // fp8 block quantization (numerics.h): bf16 [tokens, hidden] -> e4m3 bytes + fp32 scales.
    m.def("moe_quantize_fp8", [](uint64_t x, uint32_t tokens, uint32_t hidden, uint64_t q,
                                 uint64_t scales, bool cuda, uint64_t stream) {
        Status s;
        {
            py::gil_scoped_release nogil;
            if (cuda) {
                s = moe::cuda_quantize_fp8(ptr<const uint16_t>(x), tokens, hidden, ptr<uint8_t>(q),
                                           ptr<float>(scales), ptr<void>(stream));
            } else {
                const size_t n = size_t{tokens} * hidden;
                s = moe::quantize_fp8_bf16({ptr<const uint16_t>(x), n}, tokens, hidden,
                                           {ptr<uint8_t>(q), n},
                                           {ptr<float>(scales), n / moe::kScaleBlock});
            }
        }
        check(s);
    });
    m.def("moe_dequantize_fp8",
          [](uint64_t q, uint64_t scales, uint32_t tokens, uint32_t hidden, uint64_t out) {
              const size_t n = size_t{tokens} * hidden;
              check(moe::dequantize_fp8_to_bf16({ptr<const uint8_t>(q), n},
                                                {ptr<const float>(scales), n / moe::kScaleBlock},
                                                tokens, hidden, {ptr<uint16_t>(out), n}));
          });
}

}  // namespace ferry::python

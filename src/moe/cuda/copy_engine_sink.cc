#include "moe/cuda/copy_engine_sink.h"

#include <fmt/format.h>

#include <thread>

#include "ferry/common/clock.h"

namespace ferry::moe::cuda {
namespace {

Status cuda_failed(cudaError_t e, std::string_view what) {
    return provider_error(
        fmt::format("{} failed: {} ({})", what, cudaGetErrorString(e), static_cast<int>(e)));
}

// A counter's previous copy is long done by the protocol's order (its kernel has seen the
// value); the bound only guards against a wedged copy engine.
constexpr Duration kSlotWait = std::chrono::seconds(2);

}  // namespace

Result<std::unique_ptr<CopyEngineSink>> CopyEngineSink::create(int device, const uint8_t* inbox,
                                                               uint8_t* region, uint32_t counters,
                                                               uint32_t* error_claimed) {
    std::unique_ptr<CopyEngineSink> s(new CopyEngineSink());
    s->device_ = device;
    s->inbox_ = inbox;
    s->region_ = region;
    s->error_claimed_ = error_claimed;
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
        return cuda_failed(e, "cudaSetDevice");
    if (cudaError_t e = cudaStreamCreateWithFlags(&s->stream_, cudaStreamNonBlocking);
        e != cudaSuccess)
        return cuda_failed(e, "cudaStreamCreateWithFlags for the host proxy");
    if (cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(&s->values_),
                                      sizeof(uint64_t) * (counters + 1), cudaHostAllocDefault);
        e != cudaSuccess)
        return cuda_failed(e, "cudaHostAlloc of the proxy's counter values");
    for (uint32_t i = 0; i <= counters; ++i) {
        s->values_[i] = 0;
        cudaEvent_t ev = nullptr;
        if (cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); e != cudaSuccess)
            return cuda_failed(e, "cudaEventCreate for the host proxy");
        s->done_.push_back(ev);
    }
    return s;
}

CopyEngineSink::~CopyEngineSink() {
    cudaSetDevice(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    for (cudaEvent_t ev : done_) cudaEventDestroy(ev);
    if (stream_) cudaStreamDestroy(stream_);
    if (values_) cudaFreeHost(values_);
}

Status CopyEngineSink::on_device() {
    if (device_set_) return ok_status();
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess)
        return cuda_failed(e, "cudaSetDevice on the host proxy thread");
    device_set_ = true;
    return ok_status();
}

Status CopyEngineSink::copy(uint64_t offset, uint64_t len) {
    FERRY_RETURN_IF_ERROR(on_device());
    cudaError_t e =
        cudaMemcpyAsync(region_ + offset, inbox_ + offset, len, cudaMemcpyHostToDevice, stream_);
    return e == cudaSuccess ? ok_status() : cuda_failed(e, "cudaMemcpyAsync of a remote put");
}

Status CopyEngineSink::raise(uint64_t offset, uint64_t value) {
    FERRY_RETURN_IF_ERROR(on_device());
    const size_t slot = offset / sizeof(uint64_t);  // the counters open the region
    if (slot + 1 >= done_.size())
        return internal_error(fmt::format("arrival counter at offset {} is not a counter", offset));
    TimePoint deadline = deadline_after(kSlotWait);
    for (;;) {
        cudaError_t q = cudaEventQuery(done_[slot]);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) return cuda_failed(q, "cudaEventQuery of a counter copy");
        if (Clock::now() > deadline)
            return timeout_error(fmt::format(
                "the previous copy of the arrival counter at offset {} did not run within {} ms",
                offset, to_ms(kSlotWait)));
        std::this_thread::yield();
    }
    values_[slot] = value;
    cudaError_t e = cudaMemcpyAsync(region_ + offset, &values_[slot], sizeof(uint64_t),
                                    cudaMemcpyHostToDevice, stream_);
    if (e == cudaSuccess) e = cudaEventRecord(done_[slot], stream_);
    return e == cudaSuccess ? ok_status() : cuda_failed(e, "raising an arrival counter");
}

void CopyEngineSink::abort() {
    if (!on_device().ok()) return;
    const size_t slot = done_.size() - 1;
    // Written once: a second abort finds the same 1 in place.
    reinterpret_cast<uint32_t*>(&values_[slot])[0] = 1;
    cudaMemcpyAsync(error_claimed_, &values_[slot], sizeof(uint32_t), cudaMemcpyHostToDevice,
                    stream_);
}

}  // namespace ferry::moe::cuda

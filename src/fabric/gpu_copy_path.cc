#include "fabric/gpu_copy_path.h"

namespace ferry::detail {

Result<GpuTransport*> GpuCopyPath::transport() {
    std::lock_guard lk(mu_);
    if (!transport_) {
        FERRY_ASSIGN_OR_RETURN(transport_, create_gpu_transport(config_));
    }
    return transport_.get();
}

Status GpuCopyPath::export_memory(void* ptr, size_t len, MemoryDescriptor* d) {
    FERRY_ASSIGN_OR_RETURN(GpuTransport * t, transport());
    return t->export_memory(ptr, len, d->device, d);
}

Result<uint64_t> GpuCopyPath::map_peer(const MemoryDescriptor& remote, int local_device) {
    FERRY_ASSIGN_OR_RETURN(GpuTransport * t, transport());
    return t->map_remote(remote, local_device);
}

uint64_t GpuWork::bytes() const {
    uint64_t b = 0;
    for (const auto& c : copies) b += c.len;
    for (const auto& p : paged) b += p.page_size * p.pages();
    for (const auto& c : blocks) b += c.geom.bytes();
    return b;
}

void GpuCopyPath::submit(GpuTransport* t, int device, GpuWork work,
                         std::function<void(const Status&)> done) {
    in_flight_.fetch_add(1, std::memory_order_relaxed);
    t->submit(device, std::move(work), [this, done = std::move(done)](const Status& s) {
        // After done, which queues the copy's signal: a rail that saw no copy in flight
        // before the signal was queued could nap, and the signal would wait for its wake.
        done(s);
        in_flight_.fetch_sub(1, std::memory_order_relaxed);
    });
}

void GpuCopyPath::shutdown() {
    std::unique_ptr<GpuTransport> t;
    {
        std::lock_guard lk(mu_);
        t = std::move(transport_);
    }
    t.reset();
}

}  // namespace ferry::detail

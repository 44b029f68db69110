#include "fabric/memory_registry.h"

#include <fmt/format.h>
#include <rdma/fi_errno.h>

#include <algorithm>

#include "ferry/common/log.h"

namespace ferry::detail {
namespace {

// The libfabric access of a registration peers may use as `remote` says. Messages never come
// from or land in registered regions (the engine sends its own buffers), so FI_SEND / FI_RECV
// only matter to rxm, which adds FI_REMOTE_READ to a region registered for FI_SEND (its
// rendezvous reads large sends from the sender's memory): a region peers may not read is
// registered without them.
uint64_t fabric_access(RemoteAccess remote) {
    const auto bits = static_cast<uint8_t>(remote);
    uint64_t access = FI_READ | FI_WRITE;
    if (bits & static_cast<uint8_t>(RemoteAccess::kRead))
        access |= FI_REMOTE_READ | FI_SEND | FI_RECV;
    if (bits & static_cast<uint8_t>(RemoteAccess::kWrite)) access |= FI_REMOTE_WRITE;
    return access;
}

}  // namespace

Result<MemoryRegistry::Registration> MemoryRegistry::add(void* ptr, size_t len, MemoryKind kind,
                                                         int device, RemoteAccess access) {
    Registration reg;
    reg.desc.engine_id = settings_.engine_id;
    reg.desc.base = reinterpret_cast<uint64_t>(ptr);
    reg.desc.length = len;
    reg.desc.kind = kind;
    reg.desc.device = device;
    reg.desc.virt_addr = rails_[0].virt_addr();
    reg.local_descs.assign(rails_.size(), nullptr);
    if (kind == MemoryKind::kCuda && !settings_.fabric_gpu) {
        // GPU memory travels through CUDA IPC only.
        Status s = gpu_.export_memory(ptr, len, &reg.desc);
        if (!s.ok()) {
            return s.with_context(fmt::format(
                "registering {} bytes of GPU memory on device {} ({}; CUDA IPC is the only "
                "way left)",
                len, device, settings_.fabric_gpu_note));
        }
        reg.desc.rail_mask = 0;
        std::lock_guard lk(mu_);
        reg.id = next_id_++;
        return reg;
    }
    if (kind == MemoryKind::kCuda && settings_.gpu_ipc) {
        // Same-host GPU peers still copy over NVLink; without the export they use the fabric.
        Status s = gpu_.export_memory(ptr, len, &reg.desc);
        if (!s.ok()) {
            log(LogLevel::kWarn, "fabric",
                "GPU memory at {} ({} bytes, device {}) has no CUDA IPC export, so same-host "
                "GPU peers reach it through provider {}: {}",
                ptr, len, device, settings_.provider, s.message());
        }
    }
    const RailPlacement::Placed placed = settings_.placement.place(ptr, len, kind, device);
    Status s = register_on_rails(ptr, len, kind == MemoryKind::kCuda ? device : -1,
                                 placed.registered, access, reg);
    if (!s.ok()) {
        if (kind == MemoryKind::kCuda) {
            return s.with_context(
                fmt::format("provider {} cannot register CUDA memory ({} bytes on device {})",
                            settings_.provider, len, device));
        }
        return s.with_context(fmt::format("registering {} bytes", len));
    }
    reg.desc.near_mask = placed.send;
    // Greppable like NIXL's "mapped to rail"; one rail leaves nothing to choose.
    log(rails_.size() > 1 ? LogLevel::kInfo : LogLevel::kDebug, "fabric",
        "engine {:x}: region {} ({} bytes of {}) mapped to rails {} ({}): registered there, sent "
        "from and reached on those",
        settings_.engine_id, reg.id, len, placed.where, rail_set_text(placed.send), placed.why);
    return reg;
}

Result<std::vector<MemoryRegistry::Registration>> MemoryRegistry::add(
    std::span<const std::span<uint8_t>> ranges, MemoryKind kind, int device, RemoteAccess access) {
    std::vector<Registration> regs;
    auto undo = [&] {
        for (const Registration& r : regs) remove(r.id);
    };
    if (kind != MemoryKind::kHost) {
        // GPU memory: an IPC export each, which the rails' batching would not spare.
        for (std::span<uint8_t> r : ranges) {
            Result<Registration> reg = add(r.data(), r.size(), kind, device, access);
            if (!reg.ok()) {
                undo();
                return reg.status();
            }
            regs.push_back(std::move(*reg));
        }
        return regs;
    }
    std::vector<RailSet> on(ranges.size());
    regs.resize(ranges.size());
    for (size_t i = 0; i < ranges.size(); ++i) {
        const RailPlacement::Placed placed =
            settings_.placement.place(ranges[i].data(), ranges[i].size(), kind, device);
        Registration& reg = regs[i];
        reg.desc.engine_id = settings_.engine_id;
        reg.desc.base = reinterpret_cast<uint64_t>(ranges[i].data());
        reg.desc.length = ranges[i].size();
        reg.desc.kind = kind;
        reg.desc.device = device;
        reg.desc.virt_addr = rails_[0].virt_addr();
        reg.desc.rail_keys.assign(rails_.size(), 0);
        reg.desc.rail_mask = placed.registered;
        reg.desc.near_mask = placed.send;
        reg.local_descs.assign(rails_.size(), nullptr);
        on[i] = placed.registered;
    }
    // mrs[i][rail]: what range i got on each rail; closed again if any registration fails.
    std::vector<std::vector<fid_mr*>> mrs(ranges.size(), std::vector<fid_mr*>(rails_.size()));
    auto close_made = [&] {
        for (size_t r = 0; r < rails_.size(); ++r) {
            std::vector<fid_mr*> made;
            for (auto& m : mrs)
                if (m[r]) made.push_back(m[r]);
            if (made.empty()) continue;
            (void)rails_[r].run_on_worker(
                [made] {
                    for (fid_mr* m : made) fi_close(&m->fid);
                    return ok_status();
                },
                kRailTaskTimeout);
        }
    };
    const uint64_t fi_access = fabric_access(access);
    for (auto& rail : rails_) {
        Rail* rp = rail.get();
        std::vector<std::span<uint8_t>> mine;
        std::vector<size_t> which;
        for (size_t i = 0; i < ranges.size(); ++i) {
            if (on[i] >> rp->index() & 1) {
                mine.push_back(ranges[i]);
                which.push_back(i);
            }
        }
        if (mine.empty()) continue;
        // Registrations that finish after this gave up on them are closed by the worker.
        Result<std::vector<fid_mr*>> made = rp->run_on_worker<std::vector<fid_mr*>>(
            [rp, mine, fi_access]() -> Result<std::vector<fid_mr*>> {
                std::vector<fid_mr*> out;
                for (std::span<uint8_t> r : mine) {
                    Result<fid_mr*> mr = rp->register_mr(r.data(), r.size(), fi_access);
                    if (!mr.ok()) {
                        for (fid_mr* m : out) fi_close(&m->fid);
                        return mr.status().with_context(
                            fmt::format("registering {} bytes", r.size()));
                    }
                    out.push_back(*mr);
                }
                return out;
            },
            kRailTaskTimeout,
            [](std::vector<fid_mr*>& late) {
                for (fid_mr* m : late) fi_close(&m->fid);
            });
        if (!made.ok()) {
            close_made();
            return made.status().with_context(
                fmt::format("rail {}, registering {} regions at once", rp->index(), mine.size()));
        }
        for (size_t j = 0; j < which.size(); ++j) {
            Registration& reg = regs[which[j]];
            reg.desc.rail_keys[rp->index()] = fi_mr_key((*made)[j]);
            reg.local_descs[rp->index()] = fi_mr_desc((*made)[j]);
            mrs[which[j]][rp->index()] = (*made)[j];
        }
    }
    std::lock_guard lk(mu_);
    for (size_t i = 0; i < ranges.size(); ++i) {
        regs[i].id = next_id_++;
        mrs_[regs[i].id] = {ranges[i].data(), ranges[i].size(), std::move(mrs[i])};
    }
    log(LogLevel::kDebug, "fabric", "engine {:x}: {} regions registered at once",
        settings_.engine_id, ranges.size());
    return regs;
}

Status MemoryRegistry::register_on_rails(void* ptr, size_t len, int cuda_device, RailSet on,
                                         RemoteAccess remote, Registration& reg) {
    std::vector<fid_mr*> mrs(rails_.size(), nullptr);
    reg.desc.rail_keys.assign(rails_.size(), 0);
    reg.desc.rail_mask = on;
    const uint64_t access = fabric_access(remote);
    for (auto& rail : rails_) {
        Rail* rp = rail.get();
        if (!(on >> rp->index() & 1)) continue;
        // A registration that finishes after this gave up on it closes its MR itself.
        Result<fid_mr*> mr = rp->run_on_worker<fid_mr*>(
            [rp, ptr, len, access, cuda_device] {
                return rp->register_mr(ptr, len, access, cuda_device);
            },
            kRailTaskTimeout, [](fid_mr*& late) { fi_close(&late->fid); });
        if (!mr.ok()) {
            for (size_t i = 0; i < mrs.size(); ++i) {
                fid_mr* m = mrs[i];
                if (!m) continue;
                (void)rails_[i].run_on_worker(
                    [m] {
                        fi_close(&m->fid);
                        return ok_status();
                    },
                    kRailTaskTimeout);
            }
            reg.desc.rail_keys.clear();
            std::fill(reg.local_descs.begin(), reg.local_descs.end(), nullptr);
            return mr.status().with_context(fmt::format("rail {}", rp->index()));
        }
        reg.desc.rail_keys[rp->index()] = fi_mr_key(*mr);
        reg.local_descs[rp->index()] = fi_mr_desc(*mr);
        mrs[rp->index()] = *mr;
    }
    std::lock_guard lk(mu_);
    reg.id = next_id_++;
    mrs_[reg.id] = {ptr, len, std::move(mrs)};
    return ok_status();
}

void MemoryRegistry::remove(uint32_t id) {
    Registered r;
    {
        std::lock_guard lk(mu_);
        auto it = mrs_.find(id);
        if (it == mrs_.end()) return;  // closed at shutdown already
        r = std::move(it->second);
        mrs_.erase(it);
    }
    // The owner frees the memory once this returns. An operation that timed out was reported
    // failed but may still be held by the provider, and a software provider (tcp) copies a late
    // read's data into the buffer, registered or not: seen as heap corruption in a KV pull over
    // tcp that timed out under load (2026-12-01). Each rail first waits for those.
    const TimePoint settle_by = deadline_after(settings_.op_timeout);
    for (size_t i = 0; i < r.mrs.size() && i < rails_.size(); ++i) {
        if (!r.mrs[i] || rails_[i].wedged()) continue;  // wedged: its domain is never closed
        fid_mr* m = r.mrs[i];
        Rail* rail = &rails_[i];
        Status s = rail->run_on_worker(
            [m, rail, base = r.base, len = r.len, settle_by] {
                rail->settle_local(base, len, settle_by);
                int rc = fi_close(&m->fid);
                return rc ? provider_error(fmt::format("fi_close(mr): {}", fi_strerror(-rc)))
                          : ok_status();
            },
            settings_.op_timeout + kRailTaskTimeout);
        if (!s.ok()) log(LogLevel::kWarn, "fabric", "deregistering memory: {}", s.message());
    }
}

void MemoryRegistry::close_all() {
    std::lock_guard lk(mu_);
    for (auto& [id, r] : mrs_) {
        for (size_t i = 0; i < r.mrs.size(); ++i) {
            if (!r.mrs[i] || (i < rails_.size() && rails_[i].wedged())) continue;
            fi_close(&r.mrs[i]->fid);
        }
    }
    mrs_.clear();
}

}  // namespace ferry::detail

#include "fabric/cma_path.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <vector>

#include "fabric/peer_table.h"
#include "fabric/provider.h"
#include "ferry/common/log.h"

namespace ferry::detail {
namespace {

// iovecs one process_vm_writev takes (the kernel's UIO_MAXIOV).
constexpr size_t kMaxIov = 1024;

}  // namespace

uint64_t process_start(int32_t pid) {
    std::ifstream f(fmt::format("/proc/{}/stat", pid));
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    // "pid (comm) S ppid ...": the fields after the last ')' start at field 3; starttime is 22.
    size_t close = stat.rfind(')');
    if (close == std::string::npos) return 0;
    std::istringstream rest(stat.substr(close + 1));
    std::string field;
    for (int i = 3; i <= 22; ++i) {
        if (!(rest >> field)) return 0;
    }
    return std::strtoull(field.c_str(), nullptr, 10);
}

ProcessIdentity this_process() {
    ProcessIdentity me;
    struct stat ns {};
    if (::stat("/proc/self/ns/pid", &ns) != 0) return me;
    const int32_t pid = static_cast<int32_t>(::getpid());
    const uint64_t start = process_start(pid);
    if (start == 0) return me;
    me.pid = pid;
    me.pid_ns = ns.st_ino;
    me.start = start;
    return me;
}

void CmaPath::configure(bool asked, const std::string& provider, uint64_t engine_id,
                        std::string host_id) {
    engine_id_ = engine_id;
    host_id_ = std::move(host_id);
    if (!asked) return;
    std::string why;
    if (provider != "shm") {
        why = fmt::format("provider {} is not shm", provider);
    } else if (shm_cma_disabled()) {
        why = "FI_SHM_DISABLE_CMA is set";
    } else if (ProcessIdentity me = this_process(); me.pid == 0) {
        why = "/proc does not tell this process's pid namespace and start time";
    } else if (Status f = fence_.open(engine_id); !f.ok()) {
        why = fmt::format("its fence cannot be made: {}", f.message());
    } else {
        self_ = me;
        log(LogLevel::kInfo, "fabric",
            "engine {:x}: cma_writes on: writes into same-host peers' host regions that offer "
            "it are copied by this process (process_vm_writev), their immediates signalled "
            "through shm",
            engine_id_);
        return;
    }
    log(LogLevel::kWarn, "fabric", "engine {:x}: cma_writes asked for but off: {}", engine_id_,
        why);
}

void CmaPath::offer(MemoryDescriptor* d, RemoteAccess access) {
    if (!on() || d->kind != MemoryKind::kHost ||
        !(static_cast<uint8_t>(access) & static_cast<uint8_t>(RemoteAccess::kWrite))) {
        return;
    }
    std::optional<CmaFenceTicket> t = fence_.publish(d->base, d->length);
    if (!t) {
        log(LogLevel::kWarn, "fabric",
            "engine {:x}: {} regions are offered for process_vm_writev already; peers write the "
            "region of {} bytes at {:#x} through shm",
            engine_id_, CmaFence::kSlots - 1, d->length, d->base);
        return;
    }
    d->cma_pid = self_.pid;
    d->cma_pid_ns = self_.pid_ns;
    d->cma_start = self_.start;
    d->cma_fence_fd = fence_.fd();
    d->cma_fence_slot = t->slot;
    d->cma_fence_gen = t->generation;
}

void CmaPath::withdraw(const MemoryDescriptor& d, Duration timeout) {
    if (d.cma_pid == 0 || d.cma_pid != self_.pid) return;
    if (!fence_.close({d.cma_fence_slot, d.cma_fence_gen}, timeout)) {
        log(LogLevel::kWarn, "fabric",
            "engine {:x}: a peer's process_vm_writev into the region of {} bytes at {:#x} began "
            "over {:.0f} ms ago and has not ended (its process stopped or died mid-write); the "
            "region is deregistered, its fence slot {} is not reused",
            engine_id_, d.length, d.base, to_ms(timeout), d.cma_fence_slot);
    }
}

void CmaPath::withdraw_all(Duration timeout) { fence_.close_all(timeout); }

void CmaPath::give_up(const Peer& p, const std::string& why) const {
    // Logged by the thread that made the decision, once per peer.
    if (p.cma.exchange(kProvider, std::memory_order_acq_rel) == kProvider) return;
    log(LogLevel::kWarn, "fabric",
        "engine {:x}: peer {} (engine {:x}): writes go through shm, not process_vm_writev: {}",
        engine_id_, p.id, p.engine_id, why);
}

bool CmaPath::usable(const Peer& p, const MemoryDescriptor& remote) const {
    if (remote.cma_pid == 0 || !on()) return false;
    uint8_t d = p.cma.load(std::memory_order_acquire);
    if (d == kUndecided) {
        // Once per peer: whether the pid its descriptors name is the process the provider
        // reaches, in this pid namespace, and the one that registered the region.
        std::string why;
        if (p.address.host_id != host_id_) {
            why = "the peer is on another host";
        } else if (remote.cma_pid_ns != self_.pid_ns) {
            why = "the peer is in another pid namespace";
        } else if (p.shm_pid != remote.cma_pid) {
            why = fmt::format("its descriptor names pid {} but its shm endpoint is process {}",
                              remote.cma_pid, p.shm_pid);
        } else if (process_start(remote.cma_pid) != remote.cma_start) {
            why = fmt::format(
                "process {} is not the one that registered the region (started "
                "at another time, or gone)",
                remote.cma_pid);
        }
        std::lock_guard lk(decide_mu_);
        if (p.cma.load(std::memory_order_acquire) == kUndecided && why.empty()) {
            auto fence = CmaFenceView::map(remote.cma_pid, remote.cma_fence_fd, p.engine_id);
            if (fence.ok()) {
                p.cma_fence = *std::move(fence);
            } else {
                why = fence.status().message();
            }
        }
        if (!why.empty()) {
            give_up(p, why);
            return false;
        }
        if (p.cma.load(std::memory_order_acquire) == kUndecided) {
            p.cma_start = remote.cma_start;
            p.cma.store(kCopies, std::memory_order_release);
        }
        d = p.cma.load(std::memory_order_acquire);
    }
    // Every descriptor of this peer must name the process and the fence checked above.
    return d == kCopies && remote.cma_pid_ns == self_.pid_ns && remote.cma_start == p.cma_start &&
           remote.cma_pid == p.shm_pid && remote.cma_fence_fd == p.cma_fence->fd();
}

Status CmaPath::copy(const Peer& p, const MemoryDescriptor& remote,
                     std::span<const CmaPiece> pieces, bool* refused) const {
    *refused = false;
    // The target's fence: the region still registered, every byte inside what it registered;
    // held until the last byte is copied, so that its deregistration waits for this copy.
    uint64_t lo = UINT64_MAX, hi = 0;
    for (const CmaPiece& piece : pieces) {
        if (piece.len == 0) continue;
        lo = std::min(lo, piece.remote);
        hi = std::max(hi, piece.remote + piece.len);
    }
    if (hi == 0) return ok_status();
    const CmaFenceTicket ticket{remote.cma_fence_slot, remote.cma_fence_gen};
    FERRY_RETURN_IF_ERROR(
        p.cma_fence->pin(ticket, lo, hi)
            .with_context(
                fmt::format("writing into peer engine {:x} by process_vm_writev", p.engine_id)));
    struct Unpin {
        const CmaFenceView& f;
        CmaFenceTicket t;
        ~Unpin() { f.unpin(t); }
    } unpin{*p.cma_fence, ticket};
    // On the heap: 32 KiB of iovecs would be a lot of a caller thread's stack.
    std::vector<iovec> local(std::min(pieces.size(), kMaxIov)), far(local.size());
    size_t i = 0;       // the first piece not fully written
    uint64_t done = 0;  // bytes of pieces[i] written
    while (i < pieces.size()) {
        size_t k = 0;
        uint64_t want = 0;
        for (size_t j = i; j < pieces.size() && k < kMaxIov; ++j) {
            const uint64_t skip = j == i ? done : 0;
            if (pieces[j].len == skip) continue;
            local[k].iov_base =
                const_cast<uint8_t*>(static_cast<const uint8_t*>(pieces[j].local) + skip);
            local[k].iov_len = pieces[j].len - skip;
            far[k].iov_base = reinterpret_cast<void*>(pieces[j].remote + skip);
            far[k].iov_len = pieces[j].len - skip;
            want += far[k].iov_len;
            ++k;
        }
        if (k == 0) break;
        const ssize_t n = ::process_vm_writev(remote.cma_pid, local.data(), k, far.data(), k, 0);
        if (n < 0) {
            const int err = errno;
            if (err == EINTR) continue;
            if (err == EPERM) {
                *refused = true;
                give_up(p, fmt::format("process_vm_writev into process {} is not permitted "
                                       "(EPERM: Yama's ptrace scope, another user, or a process "
                                       "that is not dumpable)",
                                       remote.cma_pid));
                return ok_status();
            }
            if (err == ESRCH) {
                return unavailable(fmt::format(
                    "writing into peer engine {:x}: its process {} is gone; reconnect to its new "
                    "incarnation",
                    p.engine_id, remote.cma_pid));
            }
            if (err == EFAULT) {
                return out_of_range(fmt::format(
                    "process_vm_writev into process {} of engine {:x}: an address is not mapped "
                    "(the peer's region of {} bytes at {:#x} was freed, or the local source was)",
                    remote.cma_pid, p.engine_id, remote.length, remote.base));
            }
            return provider_error(fmt::format("process_vm_writev into process {}: {}",
                                              remote.cma_pid, std::strerror(err)));
        }
        if (n == 0 && want > 0) {
            return out_of_range(fmt::format(
                "process_vm_writev into process {} of engine {:x} wrote nothing of {} bytes",
                remote.cma_pid, p.engine_id, want));
        }
        // Advance over what was written (whole iovecs, or part of the last one).
        uint64_t left = static_cast<uint64_t>(n);
        while (left > 0 && i < pieces.size()) {
            const uint64_t rest = pieces[i].len - done;
            if (left >= rest) {
                left -= rest;
                ++i;
                done = 0;
            } else {
                done += left;
                left = 0;
            }
        }
        while (i < pieces.size() && pieces[i].len == done) {
            ++i;
            done = 0;
        }
    }
    uint64_t total = 0;
    for (const CmaPiece& piece : pieces) total += piece.len;
    bytes_.fetch_add(total, std::memory_order_relaxed);
    return ok_status();
}

}  // namespace ferry::detail

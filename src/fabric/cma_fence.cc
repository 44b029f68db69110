#include "fabric/cma_fence.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

namespace ferry::detail {
namespace {

constexpr size_t kPageBytes = size_t{CmaFence::kSlots} * sizeof(CmaFenceSlot);

// Slot 0 of the page: the magic and the owner's engine id, in the first two words.
void write_header(CmaFenceSlot* s, uint64_t engine_id) {
    s[0].base.store(engine_id, std::memory_order_relaxed);
    s[0].generation.store(CmaFence::kMagic, std::memory_order_release);
}

}  // namespace

CmaFence::~CmaFence() {
    if (slots_) ::munmap(slots_, kPageBytes);
    if (fd_ >= 0) ::close(fd_);
}

Status CmaFence::open(uint64_t engine_id) {
    const int fd = ::memfd_create("ferry-cma-fence", MFD_CLOEXEC);
    if (fd < 0) return provider_error(fmt::format("memfd_create: {}", std::strerror(errno)));
    if (::ftruncate(fd, static_cast<off_t>(kPageBytes)) != 0) {
        const int err = errno;
        ::close(fd);
        return provider_error(fmt::format("ftruncate of the fence: {}", std::strerror(err)));
    }
    void* p = ::mmap(nullptr, kPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        return provider_error(fmt::format("mmap of the fence: {}", std::strerror(err)));
    }
    fd_ = fd;
    slots_ = static_cast<CmaFenceSlot*>(p);  // zero-filled: every slot closed, generation 0
    write_header(slots_, engine_id);
    return ok_status();
}

std::optional<CmaFenceTicket> CmaFence::publish(uint64_t base, uint64_t length) {
    if (!slots_) return std::nullopt;
    uint32_t slot = 0;
    {
        std::lock_guard lk(mu_);
        if (!free_.empty()) {
            slot = free_.back();
            free_.pop_back();
        } else if (next_ < kSlots) {
            slot = next_++;
        } else {
            return std::nullopt;
        }
    }
    CmaFenceSlot& s = slots_[slot];
    s.base.store(base, std::memory_order_relaxed);
    s.length.store(length, std::memory_order_relaxed);
    // Closed slots have an even generation; the next odd one opens it for this region.
    const uint64_t g = s.generation.load(std::memory_order_relaxed) + 1;
    s.generation.store(g, std::memory_order_seq_cst);
    return CmaFenceTicket{slot, g};
}

bool CmaFence::close(const CmaFenceTicket& t, Duration timeout) {
    if (!slots_ || t.slot == 0 || t.slot >= kSlots) return true;
    CmaFenceSlot& s = slots_[t.slot];
    // After this no writer gets past its check (pin: count, then read the generation; here:
    // the generation, then read the count; both sequentially consistent, so one of the two
    // sees the other). Those already inside are waited for. A slot closed already (close_all
    // at shutdown, then the region's own close) is left as it is.
    uint64_t open = t.generation;
    if (!s.generation.compare_exchange_strong(open, t.generation + 1, std::memory_order_seq_cst))
        return true;
    const TimePoint until = deadline_after(timeout);
    for (int spins = 0; s.writers.load(std::memory_order_seq_cst) != 0; ++spins) {
        if (Clock::now() >= until) return false;  // the slot stays taken
        if (spins < 64) {
            std::this_thread::yield();
        } else {
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
    }
    std::lock_guard lk(mu_);
    free_.push_back(t.slot);
    return true;
}

void CmaFence::close_all(Duration timeout) {
    if (!slots_) return;
    uint32_t used = 0;
    {
        std::lock_guard lk(mu_);
        used = next_;
    }
    const TimePoint until = deadline_after(timeout);
    for (uint32_t i = 1; i < used; ++i) {
        const uint64_t g = slots_[i].generation.load(std::memory_order_acquire);
        if (g & 1) close({i, g}, std::max<Duration>(until - Clock::now(), Duration::zero()));
    }
}

CmaFenceView::~CmaFenceView() {
    if (slots_) ::munmap(slots_, count_ * sizeof(CmaFenceSlot));
}

Result<std::shared_ptr<const CmaFenceView>> CmaFenceView::map(int32_t pid, int32_t fd,
                                                              uint64_t engine_id) {
    const std::string path = fmt::format("/proc/{}/fd/{}", pid, fd);
    const int mine = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (mine < 0) {
        const int err = errno;
        if (err == EACCES || err == EPERM) {
            return permission_denied(fmt::format(
                "opening its fence {} is not permitted ({}: Yama's ptrace scope, another user, "
                "or a process that is not dumpable)",
                path, err == EACCES ? "EACCES" : "EPERM"));
        }
        return unavailable(fmt::format("opening its fence {}: {}", path, std::strerror(err)));
    }
    struct stat st {};
    const bool sized = ::fstat(mine, &st) == 0 && static_cast<size_t>(st.st_size) == kPageBytes;
    void* p = sized ? ::mmap(nullptr, kPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, mine, 0)
                    : MAP_FAILED;
    ::close(mine);  // the mapping keeps the memory
    if (!sized) {
        return protocol_error(fmt::format("{} is not a ferry fence ({} bytes, expected {})", path,
                                          st.st_size, kPageBytes));
    }
    if (p == MAP_FAILED) {
        return provider_error(fmt::format("mmap of {}: {}", path, std::strerror(errno)));
    }
    std::shared_ptr<CmaFenceView> v(new CmaFenceView());
    v->fd_ = fd;
    v->slots_ = static_cast<CmaFenceSlot*>(p);
    v->count_ = CmaFence::kSlots;
    const uint64_t magic = v->slots_[0].generation.load(std::memory_order_acquire);
    const uint64_t owner = v->slots_[0].base.load(std::memory_order_relaxed);
    if (magic != CmaFence::kMagic || owner != engine_id) {
        return protocol_error(
            fmt::format("{} is not engine {:x}'s fence (magic {:#x}, engine {:x})", path, engine_id,
                        magic, owner));
    }
    return std::shared_ptr<const CmaFenceView>(std::move(v));
}

Status CmaFenceView::pin(const CmaFenceTicket& t, uint64_t lo, uint64_t hi) const {
    if (t.slot == 0 || t.slot >= count_ || (t.generation & 1) == 0) {
        return protocol_error(fmt::format(
            "the descriptor names fence slot {} generation {}, which no region can have", t.slot,
            t.generation));
    }
    CmaFenceSlot& s = slots_[t.slot];
    s.writers.fetch_add(1, std::memory_order_seq_cst);
    const uint64_t g = s.generation.load(std::memory_order_seq_cst);
    if (g != t.generation) {
        unpin(t);
        return not_found(fmt::format(
            "the peer deregistered the region (fence slot {}: generation {}, the descriptor's "
            "{}); nothing was written",
            t.slot, g, t.generation));
    }
    const uint64_t base = s.base.load(std::memory_order_relaxed);
    const uint64_t length = s.length.load(std::memory_order_relaxed);
    if (lo < base || hi < lo || hi - base > length) {
        unpin(t);
        return out_of_range(
            fmt::format("bytes [{:#x}, {:#x}) are outside the region of {} bytes at {:#x} the peer "
                        "registered; nothing was written",
                        lo, hi, length, base));
    }
    return ok_status();
}

void CmaFenceView::unpin(const CmaFenceTicket& t) const {
    slots_[t.slot].writers.fetch_sub(1, std::memory_order_release);
}

}  // namespace ferry::detail

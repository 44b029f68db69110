// The target's say over process_vm_writev into its memory (EngineConfig::cma_writes): a page of
// slots in shared memory, one per region offered for such writes, holding the region's bounds,
// a generation and a count of the writers inside it. The owner publishes a slot when it
// registers the region and closes it at deregistration: it moves the generation on, then waits
// until no writer holds the slot. A writer pins the slot, checks the generation its descriptor
// names and the bounds the owner published, copies, and unpins. So a write either lands while
// the region is still registered or is refused, as shm's key check refuses it, and a
// descriptor whose bounds were altered writes nothing outside what the owner registered.
//
// The page is a memfd of the owner's process; a peer opens it as /proc/<pid>/fd/<fd>, which the
// kernel allows exactly where it allows process_vm_writev (ptrace access).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"

namespace ferry::detail {

// One slot of the shared page. Slot 0 is the page's header (magic, the owner's engine id).
struct alignas(32) CmaFenceSlot {
    std::atomic<uint64_t> generation;  // odd: the region is registered; even: closed
    std::atomic<uint64_t> base;
    std::atomic<uint64_t> length;
    std::atomic<uint32_t> writers;  // writers inside the region now
    uint32_t pad;
};
static_assert(sizeof(CmaFenceSlot) == 32);
static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the fence's words are shared between processes: they must be lock-free");

// What a region's descriptor names of its slot.
struct CmaFenceTicket {
    uint32_t slot = 0;
    uint64_t generation = 0;
};

// The owner's side: the memfd and its slots.
class CmaFence {
  public:
    static constexpr uint64_t kMagic = 0x65636e6566797266;  // "fryfence"
    static constexpr uint32_t kSlots = 1 << 16;             // 2 MiB of address space, sparse

    CmaFence() = default;
    ~CmaFence();
    CmaFence(const CmaFence&) = delete;
    CmaFence& operator=(const CmaFence&) = delete;

    // Creates the memfd and maps it; the error says why (regions are then not offered).
    Status open(uint64_t engine_id);
    bool is_open() const { return slots_ != nullptr; }
    int fd() const { return fd_; }

    // A slot for `length` bytes at `base`, published before this returns; nullopt when every
    // slot is taken (the region is then not offered for process_vm_writev).
    std::optional<CmaFenceTicket> publish(uint64_t base, uint64_t length);
    // Closes the slot: no write can start in the region after this; waits up to `timeout` for
    // the writers inside it. True when none was left; false when some writer still holds it
    // then (its process died between pin and unpin, or it is stopped): the slot is not reused.
    bool close(const CmaFenceTicket& t, Duration timeout);
    // Closes every open slot (the engine shuts down), waiting up to `timeout` in all.
    void close_all(Duration timeout);

  private:
    int fd_ = -1;
    CmaFenceSlot* slots_ = nullptr;
    std::mutex mu_;
    std::vector<uint32_t> free_;  // closed slots to reuse
    uint32_t next_ = 1;           // slots [next_, kSlots) never used
};

// A peer's page mapped into this process, for writes into that peer's regions.
class CmaFenceView {
  public:
    ~CmaFenceView();
    CmaFenceView(const CmaFenceView&) = delete;
    CmaFenceView& operator=(const CmaFenceView&) = delete;

    // Opens process `pid`'s fd `fd` through /proc and checks it is engine `engine_id`'s fence.
    // kPermissionDenied when the kernel refuses (as it would refuse process_vm_writev).
    static Result<std::shared_ptr<const CmaFenceView>> map(int32_t pid, int32_t fd,
                                                           uint64_t engine_id);
    int32_t fd() const { return fd_; }

    // Pins the slot for a write of [lo, hi) (addresses in the owner's process): refused when
    // the region was deregistered (its generation moved on) or the range is outside what the
    // owner registered there. unpin() after the copy, whatever it gave.
    Status pin(const CmaFenceTicket& t, uint64_t lo, uint64_t hi) const;
    void unpin(const CmaFenceTicket& t) const;

  private:
    CmaFenceView() = default;
    int32_t fd_ = -1;  // the owner's fd number
    CmaFenceSlot* slots_ = nullptr;
    size_t count_ = 0;
};

}  // namespace ferry::detail

// Same-host host memory written by the initiator itself: one process_vm_writev into a peer's
// registered region (cross-memory attach, what UCX's cma transport does), where libfabric
// 1.17's shm hands each write to the target's worker, which carries it out and answers: two
// cross-process hand-offs and both sides' workers per write (docs/BENCHMARKS.md, "ferry beside
// NIXL and Mooncake"). The immediate follows as a signal through the provider, once the bytes
// are in place, as after a same-host GPU copy. Each copy passes the target's fence first
// (cma_fence.h): the region must still be registered and the bytes inside what its owner
// registered, the checks shm makes at the target with the region's key.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>

#include "fabric/cma_fence.h"
#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/types.h"

namespace ferry::detail {

struct Peer;

// What tells one process of a host from every other: its pid, its pid namespace (the inode of
// /proc/self/ns/pid) and its start time (clock ticks after boot, /proc/<pid>/stat field 22).
struct ProcessIdentity {
    int32_t pid = 0;
    uint64_t pid_ns = 0;
    uint64_t start = 0;
};

// This process's identity; pid 0 when /proc cannot tell.
ProcessIdentity this_process();
// The start time of process `pid` as this process sees it; 0 when it cannot be read.
uint64_t process_start(int32_t pid);

// `len` bytes at `local` go to address `remote` of the peer's process.
struct CmaPiece {
    const void* local = nullptr;
    uint64_t remote = 0;
    uint64_t len = 0;
};

class CmaPath {
  public:
    // on: EngineConfig::cma_writes on an shm engine whose CMA is not disabled
    // (FI_SHM_DISABLE_CMA). Logs why it stays off when asked for.
    void configure(bool asked, const std::string& provider, uint64_t engine_id,
                   std::string host_id);
    bool on() const { return self_.pid != 0; }

    // Fills d's cma fields when peers may write this host region that way: on, the region is
    // registered for peer writes (a write under its key would be refused otherwise) and the
    // fence has a slot for it (its bounds published there).
    void offer(MemoryDescriptor* d, RemoteAccess access);
    // The region of `d` is deregistered: writes that passed the fence end before this returns
    // (up to `timeout`; a writer still inside then is logged), later ones are refused.
    void withdraw(const MemoryDescriptor& d, Duration timeout);
    // Every region at once (the engine shuts down).
    void withdraw_all(Duration timeout);

    // Whether this write into p's region `remote` goes by process_vm_writev: the descriptor
    // offers it, this engine is on, p is on this host and its descriptor names the process the
    // provider reaches (the pid of p's shm endpoint name), in this pid namespace, started when
    // the descriptor says (not a later process given the same pid), and the peer did not
    // refuse a first copy, and its fence could be mapped here. Checked against /proc once per
    // peer (Peer::cma), logged when no; after that a load and a few compares per write.
    bool usable(const Peer& p, const MemoryDescriptor& remote) const;

    // Copies every piece into the peer's process (remote.cma_pid). `refused` is set, and
    // nothing was written, when the kernel refuses this peer's first copy (EPERM: Yama's
    // ptrace scope, another user, a process that is not dumpable): the peer is then marked
    // for the provider's path, logged once, and the caller sends the write that way. Any other
    // failure (the region was deregistered, the bytes are outside it, the process is gone, the
    // address is not mapped there) is an error naming it, and nothing of it was written unless
    // the process or the mapping went away mid-copy.
    Status copy(const Peer& p, const MemoryDescriptor& remote, std::span<const CmaPiece> pieces,
                bool* refused) const;

    // Bytes copied so far (EngineStats::cma_bytes).
    uint64_t bytes() const { return bytes_.load(std::memory_order_relaxed); }

  private:
    enum Decision : uint8_t { kUndecided = 0, kCopies = 1, kProvider = 2 };
    void give_up(const Peer& p, const std::string& why) const;

    ProcessIdentity self_;
    CmaFence fence_;                // this engine's regions, for the peers that write them
    mutable std::mutex decide_mu_;  // one thread decides a peer (maps its fence)
    uint64_t engine_id_ = 0;
    std::string host_id_;
    mutable std::atomic<uint64_t> bytes_{0};
};

}  // namespace ferry::detail

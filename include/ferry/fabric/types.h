// Serializable identities of engines and memory: what one process hands another so that
// the other can write into or read from it.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ferry/common/status.h"

namespace ferry {

// One contiguous piece of a multi-run transfer: `length` bytes at src_offset of the source
// region go to dst_offset of the destination region.
struct WriteRun {
    uint64_t src_offset = 0;
    uint64_t dst_offset = 0;
    uint64_t length = 0;
    bool operator==(const WriteRun&) const = default;
};

enum class MemoryKind : uint8_t { kHost = 0, kCuda = 1 };

// What peers may do to a registered region through the fabric (TransferEngine::register_memory):
// the provider refuses a peer's read of a region registered without kRead (tcp, verbs, efa
// check keys; shm's direct copy path checks none, docs/SERVING.md "Known limits"). This
// engine's own operations on the region are not limited.
enum class RemoteAccess : uint8_t { kNone = 0, kRead = 1, kWrite = 2, kReadWrite = 3 };

// Which remote memory an operation targets: base address, length, one key per rail of the
// owning engine and which of those rails hold the region. Versioned so that an engine refuses a
// blob from an incompatible build with a clear error instead of writing to the wrong place.
struct MemoryDescriptor {
    static constexpr uint16_t kVersion = 5;

    uint64_t engine_id = 0;  // the engine that registered the memory
    uint64_t base = 0;       // address of byte 0 in the owner's address space
    uint64_t length = 0;
    MemoryKind kind = MemoryKind::kHost;
    int32_t device = -1;    // CUDA device ordinal for kCuda
    bool virt_addr = true;  // provider addresses remote memory by virtual address, else offset
    std::vector<uint64_t> rail_keys;  // empty for GPU memory reachable only through CUDA IPC
    // Bit r: the owner's rail r holds the region (its key is rail_keys[r]; keys of other rails
    // are 0): those its owner's EngineConfig::rails picks (the NICs nearest its memory under
    // "nearest"); transfers reach it only there.
    uint64_t rail_mask = ~uint64_t{0};
    // Bit r: the owner's rail r is one of the NICs nearest the region's memory (its PCIe
    // switch, its NUMA node; every held rail when none is nearer or the owner lists NICs), a
    // subset of rail_mask. A peer writing or reading the region aims at these rails, so the
    // bytes land next to the memory (docs/ARCHITECTURE.md, "Rails and topology").
    uint64_t near_mask = ~uint64_t{0};
    // Same-host GPU peers: the CUDA IPC handle of the allocation holding the region, and the
    // region's offset inside that allocation.
    bool has_ipc = false;
    std::array<uint8_t, 64> ipc_handle{};
    uint64_t ipc_offset = 0;
    int32_t ipc_pid = 0;  // exporting process: a peer in the same process uses base directly
    // Same-host host memory its owner lets peers write with process_vm_writev
    // (EngineConfig::cma_writes; 0: not offered), and what tells a peer that this pid is the
    // registering process itself and not one of another pid namespace or a later process
    // given the same pid: the namespace's inode and the process's start time (clock ticks
    // after boot, /proc/<pid>/stat).
    int32_t cma_pid = 0;
    uint64_t cma_pid_ns = 0;
    uint64_t cma_start = 0;
    // Where such a writer checks that the region is still registered and the bytes inside it
    // (src/fabric/cma_fence.h): the owner's fence (a memfd, this fd of cma_pid) and the
    // region's slot there with the generation it had at registration.
    int32_t cma_fence_fd = -1;
    uint32_t cma_fence_slot = 0;
    uint64_t cma_fence_gen = 0;

    // Remote address to put on the wire for byte `offset` of this region.
    uint64_t wire_address(uint64_t offset) const { return (virt_addr ? base : 0) + offset; }
    bool on_rail(size_t r) const { return r < rail_keys.size() && (rail_mask >> r & 1); }
    // The rails holding the region (rail_mask, limited to the rails with a key).
    uint64_t held_rails() const {
        const uint64_t keyed =
            rail_keys.size() >= 64 ? ~uint64_t{0} : (uint64_t{1} << rail_keys.size()) - 1;
        return rail_mask & keyed;
    }
    // The held rails nearest its memory (near_mask; all held rails if it names none of them).
    uint64_t near_rails() const {
        const uint64_t held = held_rails();
        return (near_mask & held) ? near_mask & held : held;
    }

    std::vector<uint8_t> serialize() const;
    static Result<MemoryDescriptor> deserialize(std::span<const uint8_t> blob);
    void encode(class ByteWriter& w) const;
    static Result<MemoryDescriptor> decode(class ByteReader& r);
};

// Everything a peer needs to reach an engine: provider, one fabric address per rail, and the
// small signal region that immediate-only writes (barriers, notifications) target.
struct EngineAddress {
    static constexpr uint16_t kVersion = 1;

    uint64_t engine_id = 0;
    std::string provider;  // libfabric provider name, e.g. "tcp;ofi_rxm"
    std::string host_id;   // identifies the host, to pick same-host transports
    std::vector<std::vector<uint8_t>> rail_addrs;
    MemoryDescriptor signal;

    std::vector<uint8_t> serialize() const;
    static Result<EngineAddress> deserialize(std::span<const uint8_t> blob);
    void encode(class ByteWriter& w) const;
    static Result<EngineAddress> decode(class ByteReader& r);
};

// Hex text form of a blob, for passing addresses through text channels (HTTP, files).
std::string to_hex(std::span<const uint8_t> bytes);
Result<std::vector<uint8_t>> from_hex(std::string_view text);

}  // namespace ferry

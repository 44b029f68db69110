// The host proxy of the CUDA all-to-all: one thread per rank between its kernels and the
// TransferEngine, for peers on other nodes. CUDA-free: the kernels are reached only through
// mapped host memory, both ways (what they publish, and the inbox they read), so the wire
// protocol runs and is tested on machines without a GPU.
//
// Sending. Kernels store a remote peer's bytes into that peer's outbox (mapped pinned host
// memory laid out like the peer's region) and then publish {offset, len, call} per (peer,
// part) in mapped host memory. The proxy polls the published records and, for each new one,
// writes the bytes from the outbox to the same offsets of the peer's inbox, every piece with
// the data immediate of (part, sender), then a PutRecord into the peer's record slot of
// (part, sender) with the record immediate. The record names the piece count, so the receiver
// needs no knowledge of how this engine splits writes.
//
// Receiving. Record and data may land in any order (EFA does not order writes): a put is
// complete once its record and as many data immediates as it names are here. The inbox is
// mapped pinned memory laid out like the rank's region, and kernels read what remote peers
// sent straight from it: when a counter's call is complete (both dispatch parts for the
// dispatch counter), the proxy stores the value the kernels wait for into the inbox's copy of
// that counter (a release store; the kernels load it with acquire at system scope).
//
// No stream work on the way: a copy or memset queued on a CUDA stream can wait behind a
// spinning kernel of another stream that shares its hardware queue (more streams in the
// process than CUDA_DEVICE_MAX_CONNECTIONS, 8 by default; 1 under Megatron). An earlier
// version copied each put onto the GPU with cudaMemcpyAsync; at EP8 with eight ranks in one
// process (8 kernel streams + 8 copy streams) no remote counter ever moved (2026-12-01).
//
// Buffer reuse follows the protocol's own order (see cpu_backend.h): a peer's put of call N+1
// into a (part, sender) slot needs this rank to have consumed call N of it, so inbox bytes and
// records are never overwritten before the kernels read them, as with a same-node peer's
// stores into the region.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "moe/device_layout.h"

namespace ferry::moe {

struct DeviceProxySetup {
    TransferEngine* engine = nullptr;
    uint32_t rank = 0;
    uint32_t world = 0;
    uint32_t imm_base = 0;
    SharedLayout layout;
    uint64_t counts_bytes = 0;                    // one counts message
    uint64_t dispatch_blocks = 0;                 // what one call adds to a dispatch counter
    uint64_t combine_blocks = 0;                  // ... and to a combine counter
    Duration timeout = std::chrono::seconds(10);  // a put's data pieces after its record
    // Polling: spin (yielding the core) this long after the last activity, then nap 20 us at
    // a time; nothing can wake a nap, since the kernels signal through host memory.
    Duration idle_spin = std::chrono::microseconds(200);
    // Largest single write: a put above it goes as several writes, each with the data
    // immediate (the record counts them all). 0: one write per put.
    uint64_t chunk_bytes = 0;
    // Stamps of the last call per (peer, part), for CudaAllToAllOptions::trace: host clock
    // (system_clock ns) plus clock_offset_ns, the GPU global timer's lead over it.
    bool trace = false;
    int64_t clock_offset_ns = 0;
    std::vector<bool> remote;             // [world] peers reached through the proxy
    std::vector<PeerId> peer;             // [world] engine peers, where remote
    std::vector<MemoryDescriptor> inbox;  // [world] peers' inboxes, where remote

    // Sending: the kernels' records [world][kParts]; the outboxes, registered, one per remote
    // peer at outbox_offset[peer], each followed by kParts PutRecords to send from.
    const proxy::Publish* publish = nullptr;
    // Streamed puts (Publish::streamed): pieces of stream_piece_bytes (the last one shorter),
    // piece i of the put to peer d ready once stream_ready[d * stream_max_pieces + i] holds
    // the call number. Null/0: the kernels publish whole puts only.
    const uint32_t* stream_ready = nullptr;
    uint64_t stream_piece_bytes = 0;
    uint32_t stream_max_pieces = 0;
    const MemoryRegion* outbox = nullptr;
    std::vector<uint64_t> outbox_offset;
    // Receiving: this rank's inbox (proxy_inbox_bytes: layout.total bytes, the record slots,
    // the abort word), zeroed before any peer learns where it is. The proxy writes the
    // counters at the region's counter offsets and the abort word; peers write the rest.
    uint8_t* inbox_data = nullptr;
};

// The host clock the proxy stamps with (system_clock, ns since the epoch).
uint64_t system_clock_ns();

// Bytes of an inbox (an outbox slab is the same size: its PutRecords fit in the same area).
uint64_t proxy_inbox_bytes(const SharedLayout& layout, uint32_t world);
// Offset of the record slot (part, sender) in an inbox.
uint64_t proxy_record_offset(const SharedLayout& layout, uint32_t world, uint32_t part,
                             uint32_t sender);
// Offset of the inbox's abort word (uint32): set to 1 when the proxy fails, so the rank's
// waiting kernels give up at once.
uint64_t proxy_abort_offset(const SharedLayout& layout, uint32_t world);
// Offset of the inbox's piece word of `sender` (uint64): (call << 32) | n once pieces 0..n-1
// of that call's combine put from `sender`, sent piece by piece (PutRecord::by_piece), are in
// the inbox (a release store), so kernels can read each piece's rows before the rest.
uint64_t proxy_piece_word_offset(const SharedLayout& layout, uint32_t world, uint32_t sender);

// Where one put of the last call got to, in GPU global-timer ns (0: not there yet).
// published: the kernel handed it over (its stamp); seen: the proxy read the record; posted:
// its writes were handed to the engine; written: its last data write completed here;
// arrived: (the receiving side, from `peer`) record and every data write were in and the
// counter raised or the part counted.
struct ProxyStamps {
    uint32_t peer = 0, part = 0;
    uint64_t published = 0, seen = 0, posted = 0, written = 0, arrived = 0;
};

class DeviceProxy {
  public:
    explicit DeviceProxy(DeviceProxySetup setup);
    ~DeviceProxy();  // stops and joins the thread
    DeviceProxy(const DeviceProxy&) = delete;
    DeviceProxy& operator=(const DeviceProxy&) = delete;

    // Immediates: [imm_base, imm_base + 2 * kParts * kMaxWorldSize), then the piece
    // immediates of streamed puts, `world` per piece index (piece i of a streamed put from
    // `sender`, sent as one write: PutRecord::by_piece).
    static uint32_t data_imm(uint32_t base, uint32_t part, uint32_t sender);
    static uint32_t record_imm(uint32_t base, uint32_t part, uint32_t sender);
    static uint32_t piece_imm(uint32_t base, uint32_t world, uint32_t sender, uint32_t piece);

    void start();
    // Joins the thread, then waits (bounded by the engine's op_timeout) for writes still
    // reading the outbox.
    void stop();
    // The first failure (a fabric write, a bad record, a copy), naming rank, peer and part.
    Status error() const;
    // setup.trace: per remote peer and part, the last call's stamps. Read while the proxy
    // runs (each stamp is an atomic); a put still under way shows zeros where it is not yet.
    std::vector<ProxyStamps> last_stamps() const;

  private:
    struct Outgoing {
        uint32_t sent_seq = 0;   // the last call whose put is posted whole, record included
        uint32_t call = 0;       // the call being posted, or the last one
        uint32_t data_left = 0;  // data writes of that call not yet completed
        uint32_t pieces = 0;     // immediates its data writes put on the wire so far
        OpHandle record;  // the last record write; its slot is rewritten only after it is done
        // A streamed put under way (streaming): its bytes, and pieces posted of how many;
        // by_piece: each piece one write with its piece immediate (PutRecord::by_piece).
        bool streaming = false, by_piece = false;
        uint64_t offset = 0, len = 0;
        uint32_t stream_posted = 0, stream_pieces = 0;
    };
    struct Inflight {
        OpHandle op;
        uint32_t peer, part, seq;
        bool data;
    };
    enum Stamp : uint32_t { kPublished, kSeen, kPosted, kWritten, kArrived, kStamps };
    void stamp(uint32_t peer, uint32_t part, Stamp what, uint64_t gpu_ns = 0);
    uint64_t gpu_now() const;
    struct Incoming {
        uint32_t next_seq = 1;
        bool have_record = false;
        proxy::PutRecord record{};
        TimePoint record_at;
        uint32_t pieces_in = 0;  // piece immediates taken for call next_seq (combine only)
    };

    void loop();
    bool send();
    // Posts the pieces of a streamed put to peer d that the kernels finished since last time;
    // the record once every piece is posted.
    bool stream(uint32_t d, uint32_t part, Outgoing& o);
    // Posts [offset, offset + len) of the put to d as writes of at most chunk_bytes, each
    // with the data immediate. False once the proxy failed.
    bool post_data(uint32_t d, uint32_t part, Outgoing& o, uint64_t offset, uint64_t len);
    // The put's record, after its last data write was posted.
    void post_record(uint32_t d, uint32_t part, Outgoing& o, uint64_t offset, uint64_t len);
    std::string put_name(uint32_t d, uint32_t part, uint32_t seq) const;
    // Outbox bytes (offset into the outbox region) to peer d's inbox, carrying imm.
    OpHandle write(uint32_t d, uint64_t src_offset, uint64_t dst_offset, uint64_t len,
                   uint32_t imm);
    bool receive();
    // Takes the piece immediates of sender s's combine put that are in, in piece order, and
    // stores the inbox's piece word when that moved it.
    bool take_pieces(uint32_t s, Incoming& in);
    bool reap();
    void complete(uint32_t part, uint32_t sender, const proxy::PutRecord& rec);
    // Stores the 64-bit counter at `offset` of the inbox (release).
    void raise(uint64_t offset, uint64_t value);
    // Whether [offset, offset + len) is where `sender` may put `part` (counts: its own slot).
    bool in_bounds(uint32_t part, uint32_t sender, uint64_t offset, uint64_t len) const;
    void fail(const Status& s);

    DeviceProxySetup s_;
    std::vector<uint32_t> remotes_;
    std::vector<Outgoing> out_;              // [world * kParts]
    std::vector<Incoming> in_;               // [world * kParts]
    std::vector<uint32_t> raised_dispatch_;  // [world] call whose dispatch counter is set
    std::vector<Inflight> inflight_;         // data and record writes, owned by the thread
    std::unique_ptr<std::atomic<uint64_t>[]> stamps_;  // [world][kParts][kStamps], trace only

    std::atomic<bool> stop_{false};
    std::atomic<bool> failed_{false};
    mutable std::mutex mu_;
    Status error_;
    std::thread thread_;
};

}  // namespace ferry::moe

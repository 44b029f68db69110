// KV-cache transfer between a prefill rank and the decode ranks it feeds, on a TransferEngine.
//
// Push (the default product path): decode announces the transfer (INTENT) and registers its
// destination blocks once prefill scheduled it, while prefill is still computing; prefill
// writes the KV straight into decode's pool from the connector's background thread as it
// becomes final (prefill_progress per computed chunk, prefill_done for the rest), one segment
// of writes per chunk, each segment with its own immediate; a SEGMENT message per segment says
// how many writes to count, so decode learns which tokens landed while prefill still computes,
// and FINAL closes the transfer; decode reports the request ready once every producer rank is
// complete.
//
// Pull (the baseline): prefill offers its blocks under a lease, decode reads them and sends
// DONE so prefill frees them. `inline` mode prepares and posts the reads in the caller's
// thread, as engines that do it in their scheduling loop do.
//
// One connector per engine rank. It owns the engine's message handler (give other users of
// messages their own engine). Every public call validates and hands work to the background
// thread, or, while that thread sleeps, does the work itself (ConnectorConfig::run_on_caller);
// results come back through the callbacks, always on the background thread.
// docs/PROTOCOL.md has the state machines and what each timeout frees.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/kv/block_mapping.h"
#include "ferry/kv/kv_frontier.h"
#include "ferry/kv/messages.h"
#include "ferry/kv/pool.h"

namespace ferry::kv {

enum class PullMode : uint8_t {
    kBackground = 0,  // plan and post reads on the connector thread
    kInline = 1,      // plan and post reads in the caller's thread (classic baseline)
};

// What a pull offer's reads go through (docs/PROTOCOL.md, "Pull offer keys").
enum class PullKeys : uint8_t {
    // The offer's blocks are registered for it alone (one region per contiguous run) and
    // closed when the offer ends (DONE, withdrawn, lease, shutdown): a read with its
    // parameters after that fails in the provider, whoever sends it. Host memory only; a GPU
    // pool region is read under the pool's keys.
    kPerOffer = 0,
    // The offer carries the pool's own keys (protocol 9's behaviour): no registration per
    // offer, and a reader that kept the parameters can read the blocks after the offer ended.
    kPool = 1,
};

// How to register a pool region of `kind` for a connector under `keys`
// (TransferEngine::register_memory's `access`). kPerOffer: peers only write into it (push); its
// reads go through each offer's own registrations, so the pool's keys, which any handshake
// holder has, read nothing. Host and GPU memory alike (a GPU region has fabric keys only where
// the provider registers GPU memory; CUDA IPC exports are not limited by access). kPool: read
// under the pool's keys.
RemoteAccess pool_remote_access(PullKeys keys, MemoryKind kind);

struct ConnectorConfig {
    KvRank self;  // this rank's pool layout and TP position
    // How long a side holds blocks for a transfer that does not progress: prefill waiting for
    // a registration (or decode waiting for prefill) and decode waiting for every producer.
    // Keep it above the engine's op_timeout so that a lease never frees blocks under a write
    // the engine still considers alive.
    Duration lease = std::chrono::seconds(30);
    // Immediates [imm_base, imm_base + imm_count) are used by this connector (the range must
    // end at or below 2^32); keep them apart from other users of the same engine. A fresh one
    // per (transfer, attempt, producer rank) is what keeps an old attempt's writes from
    // counting for a new one.
    uint32_t imm_base = 0x4b000000;
    uint32_t imm_count = 1u << 20;
    // Immediates one push registration reserves: one per segment (computed chunk). A producer
    // with more chunks than this holds the rest back and sends it as the last segment. 64
    // covers a 32k prompt in chunks of 512 tokens. At most kMaxImmSpan (4096).
    uint32_t imm_span = 64;
    PullMode pull_mode = PullMode::kBackground;
    PullKeys pull_keys = PullKeys::kPerOffer;
    // While a transfer is active (writes in flight, a send or receive not finished), the
    // connector thread polls for its next task for up to this long after its last one before
    // it sleeps: a push hands over between threads three times (prefill_done in, the writes'
    // completion back, decode's SEGMENT and FINAL in), and each wake from a sleep took
    // 15-55 us. It costs a core meanwhile; zero always sleeps, and so does a host with fewer
    // than 4 usable CPUs (IdleWait::kSpinFromCpus), where the poll would take a busy core.
    Duration idle_spin = std::chrono::milliseconds(1);
    // A public call (prefill_done, register_push, pull, ...) made while the connector thread
    // sleeps with nothing queued runs its work on the caller's thread instead of waking that
    // thread: a push's planning and posting then start at once rather than after the wake
    // (6-13 us on the 16-core host, docs/BENCHMARKS.md), at the price of the caller's thread
    // doing them. Callbacks still come on the connector thread. false: always hand over.
    bool run_on_caller = true;
};

// What decode registers for one request (push).
struct PushRegistration {
    uint64_t transfer_id = 0;
    // A larger attempt supersedes a smaller one (preemption, retry); the older attempt is
    // cancelled and reported as such once its producers acknowledged.
    uint32_t attempt = 0;
    // The prefill instance: engine address of each TP rank, in rank order.
    std::vector<EngineAddress> prefill_ranks;
    // Destination blocks on this rank, token order, from the block of token first_token on.
    std::vector<uint32_t> blocks;
    uint32_t num_tokens = 0;
    // Tokens [first_token, num_tokens) move: decode's prefix cache already holds the ones
    // before (vLLM asks its connector for the tokens beyond its local hits). Prefill's blocks
    // still start at token 0. first_token == num_tokens moves nothing and frees prefill's
    // blocks (a whole-prompt hit).
    uint32_t first_token = 0;
};

struct TransferResult {
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;
    // ok: every byte arrived (decode) or was written (prefill). Otherwise why not:
    // kCancelled, kTimeout (lease), or the peer's FAIL reason.
    Status status;
    uint64_t bytes = 0;   // bytes this rank wrote or received
    uint32_t writes = 0;  // writes (push) or reads (pull) this rank posted or counted
};

// Decode, push: tokens [0, tokens) of the attempt's KV are in place (every producer's writes
// of those tokens counted), ahead of on_recv_done; and of the chunk after them, tokens
// [tokens, partial_end), layers [0, partial_layers) (prefill sent it layer by layer).
struct TransferProgress {
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;
    uint32_t tokens = 0;
    uint32_t partial_end = 0;
    uint32_t partial_layers = 0;
};

struct ConnectorCallbacks {
    // Decode: no write or read of this transfer attempt is outstanding any more; the blocks
    // belong to the engine again. status ok means the KV is complete and intact.
    std::function<void(const TransferResult&)> on_recv_done;
    // Prefill: the connector no longer uses this transfer's blocks; free them.
    std::function<void(const TransferResult&)> on_send_done;
    // Decode: prefix of the KV that landed so far (push); optional.
    std::function<void(const TransferProgress&)> on_recv_progress;
    // Decode: every prefill rank of an announce() scheduled the transfer (ok), or why not
    // (FAIL from prefill, kTimeout after the lease, kCancelled). Exactly once per announce.
    std::function<void(const TransferResult&)> on_scheduled;
    // Prefill, push: a decode rank gave the transfer up (its request was cancelled, its lease
    // passed) before prefill_done, so nobody wants the prompt computed: the engine may stop
    // computing it and call prefill_failed. Optional; at most once per transfer.
    std::function<void(const TransferResult&)> on_send_cancelled;
};

struct ConnectorStats {
    uint64_t messages_received = 0;
    uint64_t messages_malformed = 0;  // did not decode; logged and dropped
    uint64_t messages_stale = 0;      // unknown transfer or superseded attempt; dropped
    uint64_t leases_expired = 0;
    uint64_t transfers_sent = 0;      // prefill side, finished ok
    uint64_t transfers_received = 0;  // decode side, finished ok
    uint64_t transfers_failed = 0;    // either side, finished with an error or cancelled
    uint64_t ops_posted = 0;          // writes (push) and reads (pull) handed to the engine
    uint64_t bytes_posted = 0;
    uint64_t active_send = 0;  // prefill-side transfers holding blocks now
    uint64_t active_recv = 0;  // decode-side transfers holding blocks now
};

class KvConnector {
  public:
    // `pool` is this rank's KV pool, registered with `engine` (access:
    // pool_remote_access(config.pull_keys, kind); a host region peers may read under
    // PullKeys::kPerOffer is logged as a warning), at least layout.pool_bytes() long. Both
    // must outlive the connector.
    static Result<std::unique_ptr<KvConnector>> create(TransferEngine* engine,
                                                       const MemoryRegion* pool,
                                                       const ConnectorConfig& config,
                                                       ConnectorCallbacks callbacks);
    // A pool of several regions (one per layer, or per layer and K/V; config.self.layout's
    // `regions` says which), each registered with `engine`. A region that does not match the
    // layout (count, size) is refused with an error naming it. Peers may split their pools
    // differently.
    static Result<std::unique_ptr<KvConnector>> create(TransferEngine* engine, KvPoolRegions pool,
                                                       const ConnectorConfig& config,
                                                       ConnectorCallbacks callbacks);
    // Cancels what is still running, waits (bounded by the engine's op_timeout) for posted
    // operations, reports every open transfer as cancelled, and joins the thread.
    ~KvConnector();
    KvConnector(const KvConnector&) = delete;
    KvConnector& operator=(const KvConnector&) = delete;

    // --- push, decode side ---
    // Before holding any block: sends INTENT to every prefill rank whose heads this rank
    // holds; on_scheduled reports once all of them scheduled the transfer (or failed, or the
    // lease passed).
    Status announce(uint64_t transfer_id, uint32_t attempt,
                    std::vector<EngineAddress> prefill_ranks);
    // Sends REGISTER to every prefill rank whose heads this rank holds.
    Status register_push(PushRegistration registration);
    // Stops the transfer; on_recv_done(kCancelled) comes once every producer acknowledged
    // (or the lease passed), and only then may the blocks be reused. An announcement not yet
    // registered is reported on_scheduled(kCancelled) at once (it holds no blocks).
    Status cancel(uint64_t transfer_id);
    // The prefill process at `peer` is known to be gone: it exited, or another process now
    // answers where it did. Announcements and registrations with it, and pulls reading from
    // it, end now with `why` (on_scheduled / on_recv_done), without waiting for
    // acknowledgements it can no longer send or reads it can no longer serve (they would end
    // at the engine's op_timeout). Call it only once that process can write nothing more and
    // serve no read; a peer that is merely slow
    // is the lease's to end. An unknown peer: nothing happens.
    Status peer_gone(const EngineAddress& peer, Status why);

    // --- push, prefill side ---
    // Prefill admitted the request: decode ranks that announced it may reserve their blocks.
    Status prefill_scheduled(uint64_t transfer_id);
    // Tokens [0, tokens_ready) of the KV are final in these blocks (a chunk was computed):
    // registered decode ranks get them written now. The blocks stay the engine's; it must not
    // reuse them before prefill_done's or prefill_failed's on_send_done.
    Status prefill_progress(uint64_t transfer_id, std::vector<uint32_t> blocks,
                            uint32_t tokens_ready);
    // Layer by layer inside a chunk: also tokens [ready.tokens, ready.partial_end) in layers
    // [0, ready.partial_layers) are final; they go out as a segment of those layers.
    Status prefill_progress(uint64_t transfer_id, std::vector<uint32_t> blocks, KvFrontier ready);
    // The KV of these blocks is computed; write it to whichever decode ranks registered.
    Status prefill_done(uint64_t transfer_id, std::vector<uint32_t> blocks, uint32_t num_tokens);
    // Prefill could not produce the KV: registered and announced decode ranks get FAIL, once
    // writes of earlier progress completed; on_send_done(reason) then says the blocks are no
    // longer read.
    Status prefill_failed(uint64_t transfer_id, Status reason);

    // Prefill, push or pull, after prefill_done / offer_pull: the transfer is given up (its
    // other leg failed, or the client left). Registered decode ranks get FAIL once writes in
    // flight completed (bounded by the op timeout); an offer is withdrawn at once. Then
    // on_send_done(reason) frees the blocks. An unknown or finished transfer: nothing happens.
    Status abort_send(uint64_t transfer_id, Status reason);

    // --- pull ---
    // Prefill: hold the blocks under the lease and return what decode needs to read them.
    Result<PullParamsMsg> offer_pull(uint64_t transfer_id, std::vector<uint32_t> blocks,
                                     uint32_t num_tokens);
    // The same with the capability the caller drew (16 random bytes, not all zero): for an
    // engine whose decode side builds the parameters itself from the handshake (HandshakeInfo)
    // and what the request carried (vLLM: the scheduler answers the request before the worker
    // that holds the connector offers the blocks).
    Result<PullParamsMsg> offer_pull(uint64_t transfer_id, std::vector<uint32_t> blocks,
                                     uint32_t num_tokens, const PullCapability& capability);
    // Decode: read from every prefill rank whose heads this rank holds (params from all
    // prefill ranks, any order), then send DONE to each. Tokens [first_token, num_tokens) are
    // read, into `blocks`, which start at first_token's block (as PushRegistration's).
    Status pull(uint64_t transfer_id, std::vector<PullParamsMsg> params,
                std::vector<uint32_t> blocks, uint32_t num_tokens, uint32_t first_token = 0);
    // The same with parameters built from the handshake (pull_params: vLLM): each prefill rank
    // is first asked for its live offer's parameters (PULL_ASK), which carry the offer's own
    // keys (PullKeys::kPerOffer) and the lease it has left, waiting up to `wait` for an offer
    // not made yet. An offer that ended (its blocks may hold another request's KV), a wrong
    // capability, or no offer within `wait` fails the pull (recv_done) and nothing is read.
    Status pull_live_offer(uint64_t transfer_id, std::vector<PullParamsMsg> params,
                           std::vector<uint32_t> blocks, uint32_t num_tokens, uint32_t first_token,
                           Duration wait);

    ConnectorStats stats() const;
    const ConnectorConfig& config() const;

    class Impl;

  private:
    explicit KvConnector(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::kv

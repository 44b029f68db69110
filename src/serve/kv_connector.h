// The seam between an engine's step loop and the KV connector that moves KV between engines.
//
// Its types are kv's (kv::KvFrontier for what is final or in place, kv::BlockPool's block ids);
// what it adds is the request-level view: a leg's transfer id and its kv_transfer_params.
// A connector knows a leg by its transfer id alone, the `transfer` of every call below: the
// kv_transfer_params' transfer_id, the same on both legs of a request (the router makes it, one
// per request); for a prefill leg that came without one, the engine's request id, which the
// prefill answer then carries to the decode leg as its transfer_id (Engine picks it, once: its
// Seq::transfer()). The engine's own request ids stay inside the engine. The engine
// owns its KV pool and its kv::BlockPool; the connector only ever touches the blocks it
// is handed, and hands them back through exactly one callback. Callbacks may run on any thread;
// the engine queues them into its loop. Every method here must return at once: a connector does
// its work on its own threads (except a deliberately inline baseline, see InProcessKvLink).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ferry/common/auth.h"
#include "ferry/common/status.h"
#include "ferry/kv/kv_frontier.h"
#include "serve/kv_pool.h"

namespace ferry::serve {

// Transfer parameters carried by a request, with the field names of vLLM's disaggregated
// serving (`kv_transfer_params` in the request and response JSON).
struct KvTransferParams {
    bool do_remote_decode = false;   // prefill leg: the KV leaves for a decode engine
    bool do_remote_prefill = false;  // decode leg: the KV comes from a prefill engine
    std::string transfer_id;         // the same on both legs; push mode's rendezvous key
    uint32_t attempt = 0;            // a newer attempt supersedes an older one
    std::string remote_engine_id;    // the engine on the other side
    std::string remote_host;         // its side channel (empty when in-process)
    int remote_port = 0;
    std::vector<BlockId> remote_block_ids;  // pull: where the prefill engine holds the KV
    int tp_size = 1;                        // TP degree of the remote engine
    // ferry's own fields (kv_params_auth.h): the pull offer's capability and keys (hex, from
    // the prefill response), the wall-clock time (ms since the epoch) after which engines refuse
    // the leg, the target engine's incarnation, and the HMAC under the deployment secret over all
    // of the above and `content`.
    std::string capability;  // "ferry_capability"
    // The pull offer's own keys (kv::encode_pull_windows, hex, from the prefill response):
    // decode reads through these, which prefill closes when the offer ends.
    std::string pull_keys;        // "ferry_pull_keys"
    int64_t expires_unix_ms = 0;  // "ferry_expires"
    // The incarnation of the engine the leg is for (its /health's "incarnation", drawn at
    // random when its KV link starts): a leg is taken only by that process, not by one
    // restarted on its ports.
    std::string incarnation;  // "ferry_incarnation"
    std::string auth;         // "ferry_auth"
    // Not on the wire: the digest of the request this leg travels in (leg_content_digest), which
    // the tag binds. The engine sets it from the request it parsed, the router when it signs.
    Digest content{};

    bool empty() const { return !do_remote_decode && !do_remote_prefill; }
};

// Called exactly once per hand-over.
using KvDoneCallback = std::function<void(Status)>;
// Decode, push: what of the prompt's KV is in place (kv::KvFrontier: whole tokens, and the
// layers of the chunk under way); called as it grows while prefill still computes, before
// `arrived`. Optional for a connector.
using KvProgressCallback = std::function<void(const kv::KvFrontier& landed)>;

// What a prefill engine needs.
class KvProducer {
  public:
    virtual ~KvProducer() = default;

    // Before the engine admits a leg that names this connector: may these kv_transfer_params
    // be acted on? An error (kPermissionDenied: not signed by this deployment's router for this
    // request, expired, or used before) is the client's answer, and nothing is connected to or
    // looked up. A yes takes the leg: the same parameters are refused from then on. A connector
    // that never leaves the process may accept everything.
    virtual Status authorize(const KvTransferParams& params) const { return ok_status(); }

    // Prefill admitted the leg (blocks allocated, compute starts). Push: decode engines that
    // wait for this transfer may now reserve their blocks.
    virtual void on_prefill_scheduled(const std::string& transfer, const KvTransferParams& params) {
    }

    // Chunked prefill: `ready` says what KV is final in `blocks` (a chunk computed, or the
    // first layers of the last chunk). Push sends it now, while the rest computes. The engine
    // keeps the blocks until the release of on_prefill_done or on_prefill_aborted.
    virtual void on_prefill_progress(const std::string& transfer, const KvTransferParams& params,
                                     const std::vector<BlockId>& blocks,
                                     const kv::KvFrontier& ready) {}
    // How many on_prefill_progress calls per prompt are sent as pieces of their own; later
    // ones wait for on_prefill_done. The engine spreads its hand-overs within this.
    virtual size_t max_progress_handovers() const { return SIZE_MAX; }

    // The prompt KV of the leg (tokens [0, num_tokens)) is complete in `blocks`. The connector
    // sends it (push: to the blocks decode registered under `transfer`; pull: holds it
    // for decode to read) and calls `release` once prefill may free and reuse the blocks: after
    // the writes completed, after decode read them, or on failure or lease expiry (error status).
    // Returns the kv_transfer_params the prefill response carries back to the router (for pull:
    // this engine's id and block ids), or an error if the hand-over was refused — then `release`
    // is not called and the engine frees the blocks itself.
    virtual Result<KvTransferParams> on_prefill_done(const std::string& transfer,
                                                     const KvTransferParams& params,
                                                     std::vector<BlockId> blocks, size_t num_tokens,
                                                     KvDoneCallback release) = 0;

    // The transfer was given up after on_prefill_done returned (the router aborted it: the
    // decode leg failed or the client left). The connector stops what it still sends and calls
    // on_prefill_done's `release` (an error) once nothing reads the blocks, instead of holding
    // them until decode reads or the lease ends. Unknown or released transfers: nothing.
    virtual void on_transfer_aborted(const std::string& transfer, const KvTransferParams& params,
                                     const Status& why) {}

    // The engine gave up on a request after on_prefill_scheduled (client gone, error): decode
    // is told, and `release` comes once no write of earlier progress reads the blocks any more.
    virtual void on_prefill_aborted(const std::string& transfer, const KvTransferParams& params,
                                    const Status& why, KvDoneCallback release) {
        release(why);
    }

    // Push: the consumer gave a transfer up before its prompt was computed (decode's request
    // was cancelled). The connector calls `stop(transfer_id, why)` so that the engine stops
    // computing a prompt nobody wants; any thread, possibly after the engine stopped. The
    // engine sets it once, in attach_connector. A connector that cannot tell ignores it.
    using GaveUpHandler = std::function<void(const std::string& transfer_id, const Status& why)>;
    virtual void on_consumer_gave_up(GaveUpHandler stop) {}
};

// What a decode engine needs.
class KvConsumer {
  public:
    virtual ~KvConsumer() = default;

    // As KvProducer::authorize, for decode legs.
    virtual Status authorize(const KvTransferParams& params) const { return ok_status(); }

    // A push decode leg, before the engine reserves any block for it: `scheduled` is called
    // once, ok when the prefill engine scheduled the transfer (its KV is being computed), an
    // error when it will not be. So decode holds blocks only from then on, not for the whole
    // time the request queues at prefill. A connector without the notion answers at once.
    virtual Status await_prefill_scheduled(const std::string& transfer,
                                           const KvTransferParams& params,
                                           KvDoneCallback scheduled) {
        scheduled(ok_status());
        return ok_status();
    }

    // Blocks for the remote-prefill leg `transfer` are allocated; the first num_tokens token
    // slots must receive the prompt KV. The connector calls `arrived` once: ok when every byte
    // is there, an error when the transfer failed. Until then it may write into the blocks.
    // `progress` (optional for the connector) reports the prefix that landed so far.
    virtual Status on_blocks_allocated(const std::string& transfer, const KvTransferParams& params,
                                       std::vector<BlockId> blocks, size_t num_tokens,
                                       KvDoneCallback arrived, KvProgressCallback progress) = 0;

    // The engine gave up on the leg `transfer` (client gone, deadline). The connector stops writes
    // and then calls `arrived` with an error; the engine frees the blocks only at that call, so a
    // late write can never land in reused blocks. A wait of await_prefill_scheduled ends with
    // `scheduled(kCancelled)`.
    virtual void cancel(const std::string& transfer) = 0;
};

}  // namespace ferry::serve

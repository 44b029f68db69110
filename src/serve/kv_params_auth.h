// kv_transfer_params signed under the deployment secret. The router signs the
// parameters it puts on each leg; engines act on a leg's parameters (connect to
// remote_host, read remote_block_ids) only when the tag proves a holder of the
// secret chose them, so a client that talks to an engine directly can name
// neither a host to connect to nor blocks to read.
//
// The tag ("ferry_auth", hex HMAC-SHA256) covers a canonical encoding of every
// field an engine acts on: transfer_id, attempt,
// do_remote_decode/do_remote_prefill, remote_engine_id, remote_host,
// remote_port, tp_size, remote_block_ids, the pull capability and the expiry
// ("ferry_expires"), the incarnation of the engine process the leg is for
// ("ferry_incarnation"), and the leg's content: a digest of the prompt's token
// ids, max_tokens and the id of the engine the leg is for. So a captured leg
// cannot carry another prompt, be sent to another engine (nor to the same one
// restarted), be used after it expired, or (LegTagLedger) be used twice.
// docs/SERVING.md has the trust model.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <unordered_map>

#include "ferry/common/auth.h"
#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "serve/kv_connector.h"

namespace ferry::serve {

// How long a signed leg may be used after the router signed it: it covers the HTTP hop to the
// engine (engines check the expiry when the leg arrives, not when it is scheduled), with room
// for clock differences between hosts. An engine remembers each tag it took this long.
inline constexpr Duration kDefaultLegTtl = seconds(30);

// What a leg's tag binds of the request it travels in, besides its kv_transfer_params.
struct LegContent {
    Digest prompt{};          // prompt_digest of the prompt's token ids
    size_t max_tokens = 0;    // as the engine takes it (a prefill leg's is 1)
    std::string engine_id{};  // the engine the leg is sent to (its /health's engine_id)
};
// SHA-256 of the token ids (little-endian int32), as the engine tokenizes the body's prompt.
Digest prompt_digest(std::span<const int32_t> tokens);
// The value of KvTransferParams::content for a leg with this content.
Digest leg_content_digest(const LegContent& content);
// The wall clock in ms since the epoch: what ferry_expires is compared with.
int64_t unix_ms_now();

// A fresh incarnation id (16 hex digits of 64 random bits): what an engine's KV link draws when
// it starts and states in /health, and what the router signs into each leg for that engine.
std::string new_incarnation();
// In the engine's refusal of a leg signed for another incarnation: the router refreshes its view
// of the engine (/health) when a leg's error says this.
inline constexpr const char* kOtherIncarnation = "signed for another incarnation of this engine";

// The tag of `kv`'s fields and content (its `auth` is not one of them).
std::string kv_params_tag(const Secret& secret, const KvTransferParams& kv);
// Sets kv->content and kv->expires_unix_ms, then kv->auth to its tag.
void sign_kv_params(const Secret& secret, KvTransferParams* kv, const Digest& content,
                    int64_t expires_unix_ms);
// ok when kv.auth is the tag of kv's fields and content under `secret`; kPermissionDenied
// naming the problem otherwise. Checks neither expiry nor reuse (LegTagLedger does).
Status verify_kv_params(const Secret& secret, const KvTransferParams& kv);
// The router's form: the kv_transfer_params object of a leg, checked as an
// engine parses it, then signed in place for the target engine's `incarnation` (its
// "ferry_incarnation", "ferry_expires" and "ferry_auth" set).
Status sign_kv_params_json(const Secret& secret, nlohmann::json* kv, const Digest& content,
                           int64_t expires_unix_ms, const std::string& incarnation);

// The tags an engine took, each kept until it expires, so that a leg is taken once: a leg
// captured between router and engine and sent again (decode re-reading prefill blocks that
// hold another request's KV by then, prefill computing and pinning a prompt again) is refused.
// Memory is bounded: past `capacity` tags the one expiring first is forgotten and every tag
// expiring no later than it is refused from then on (as if expired), so no forgotten tag can
// pass. The ledger is in memory: a process restarted on the engine's ports starts an empty
// one, so each ledger has an incarnation of its own and takes only legs signed for it (a leg
// taken by the process before the restart is refused by the one after). Thread-safe.
class LegTagLedger {
  public:
    // 2^18 tags is 8,700 legs a second for the default TTL; about 200 bytes each.
    static constexpr size_t kDefaultCapacity = size_t{1} << 18;
    // `incarnation` empty: legs of any incarnation are taken (unit tests only; an engine's
    // link always draws one, new_incarnation()).
    explicit LegTagLedger(size_t capacity = kDefaultCapacity, std::string incarnation = {})
        : capacity_(std::max<size_t>(capacity, 1)), incarnation_(std::move(incarnation)) {}

    // ok, and the tag remembered, when `kv` is signed (verify_kv_params), for this ledger's
    // incarnation, not expired at `now_unix_ms`, and its tag was not taken before;
    // kPermissionDenied naming which otherwise.
    Status admit(const Secret& secret, const KvTransferParams& kv, int64_t now_unix_ms);
    size_t size() const;
    const std::string& incarnation() const { return incarnation_; }

  private:
    void forget_expired_locked(int64_t now_unix_ms);

    const size_t capacity_;
    const std::string incarnation_;
    mutable std::mutex mu_;
    std::unordered_map<std::string, int64_t> taken_;  // tag -> expiry
    std::multimap<int64_t, std::string> by_expiry_;
    int64_t refused_through_ = 0;  // tags expiring at or before this were forgotten
};

// POST /ferry/abort ends a transfer's leg and frees its blocks, so an engine with a secret
// takes it only from the router: the body's "ferry_auth" is this tag of the transfer id
// (its own domain label, so no kv_transfer_params tag can pass for it).
std::string abort_tag(const Secret& secret, const std::string& transfer_id);
// The largest POST /ferry/abort body an engine reads (a router's is a transfer id, a reason of
// at most kMaxAbortReasonBytes and a tag).
inline constexpr size_t kMaxAbortBodyBytes = 64 << 10;
inline constexpr size_t kMaxAbortReasonBytes = 4096;
// ok when `tag` is abort_tag(secret, transfer_id); kPermissionDenied naming the problem.
Status verify_abort(const Secret& secret, const std::string& transfer_id, const std::string& tag);

}  // namespace ferry::serve

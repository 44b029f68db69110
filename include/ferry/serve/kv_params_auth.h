// kv_transfer_params signed under the deployment secret. The router signs the
// parameters it puts on each leg; engines act on a leg's parameters (connect to
// remote_host, read remote_block_ids) only when the tag proves a holder of the
// secret chose them, so a client that talks to an engine directly can name
// neither a host to connect to nor blocks to read.
//
// The tag ("ferry_auth", hex HMAC-SHA256) covers a canonical encoding of every
// field an engine acts on: transfer_id, attempt,
// do_remote_decode/do_remote_prefill, remote_engine_id, remote_host,
// remote_port, tp_size, remote_block_ids and the pull capability.
// docs/SERVING.md has the trust model.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>

#include "ferry/common/auth.h"
#include "ferry/common/status.h"
#include "ferry/serve/kv_connector.h"

namespace ferry::serve {

// The tag of `kv`'s fields (its `auth` is not one of them).
std::string kv_params_tag(const Secret& secret, const KvTransferParams& kv);
// Sets kv->auth to its tag.
void sign_kv_params(const Secret& secret, KvTransferParams* kv);
// ok when kv.auth is the tag of kv's fields under `secret`; kPermissionDenied
// naming the problem otherwise.
Status verify_kv_params(const Secret& secret, const KvTransferParams& kv);
// The router's form: the kv_transfer_params object of a leg, checked as an
// engine parses it, then signed in place (its "ferry_auth" set).
Status sign_kv_params_json(const Secret& secret, nlohmann::json* kv);

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

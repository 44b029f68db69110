#include "ferry/serve/kv_params_auth.h"

#include "ferry/common/bytes.h"
#include "ferry/fabric/types.h"
#include "ferry/serve/openai_api.h"

namespace ferry::serve {
namespace {

// Every field length-prefixed or fixed-size, so that no two parameter sets
// encode alike.
std::vector<uint8_t> canonical(const KvTransferParams& kv) {
    ByteWriter w;
    w.put_string("ferry kv_transfer_params v1");
    w.put<uint8_t>(uint8_t(kv.do_remote_decode) | uint8_t(kv.do_remote_prefill) << 1);
    w.put_string(kv.transfer_id);
    w.put(kv.attempt);
    w.put_string(kv.remote_engine_id);
    w.put_string(kv.remote_host);
    w.put<int32_t>(kv.remote_port);
    w.put<int32_t>(kv.tp_size);
    w.put_vector(std::vector<uint32_t>(kv.remote_block_ids.begin(), kv.remote_block_ids.end()));
    w.put_string(kv.capability);
    return w.take();
}

}  // namespace

std::string kv_params_tag(const Secret& secret, const KvTransferParams& kv) {
    return to_hex(hmac_sha256(secret, canonical(kv)));
}

void sign_kv_params(const Secret& secret, KvTransferParams* kv) {
    kv->auth = kv_params_tag(secret, *kv);
}

Status verify_kv_params(const Secret& secret, const KvTransferParams& kv) {
    constexpr const char* kWhat = "kv_transfer_params are not signed by this deployment's router";
    if (secret.empty())
        return permission_denied(std::string(kWhat) + ": this engine has no secret");
    if (kv.auth.empty())
        return permission_denied(std::string(kWhat) +
                                 " (no ferry_auth): send completions through the router");
    std::string want = kv_params_tag(secret, kv);
    if (!constant_time_equal({reinterpret_cast<const uint8_t*>(kv.auth.data()), kv.auth.size()},
                             {reinterpret_cast<const uint8_t*>(want.data()), want.size()}))
        return permission_denied(std::string(kWhat) +
                                 " (ferry_auth does not match the fields: altered, or signed "
                                 "under another secret)");
    return ok_status();
}

std::string abort_tag(const Secret& secret, const std::string& transfer_id) {
    ByteWriter w;
    w.put_string("ferry abort v1");
    w.put_string(transfer_id);
    return to_hex(hmac_sha256(secret, w.take()));
}

Status verify_abort(const Secret& secret, const std::string& transfer_id, const std::string& tag) {
    constexpr const char* kWhat = "POST /ferry/abort is not signed by this deployment's router";
    if (tag.empty()) return permission_denied(std::string(kWhat) + " (no ferry_auth)");
    std::string want = abort_tag(secret, transfer_id);
    if (!constant_time_equal({reinterpret_cast<const uint8_t*>(tag.data()), tag.size()},
                             {reinterpret_cast<const uint8_t*>(want.data()), want.size()}))
        return permission_denied(std::string(kWhat) +
                                 " (ferry_auth does not match the transfer id: altered, or signed "
                                 "under another secret)");
    return ok_status();
}

Status sign_kv_params_json(const Secret& secret, nlohmann::json* kv) {
    if (secret.empty()) return invalid_argument("no deployment secret to sign kv_transfer_params");
    FERRY_ASSIGN_OR_RETURN(KvTransferParams p, kv_params_from_json(*kv));
    (*kv)["ferry_auth"] = kv_params_tag(secret, p);
    return ok_status();
}

}  // namespace ferry::serve

#include "serve/kv_params_auth.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "ferry/common/bytes.h"
#include "ferry/fabric/types.h"
#include "serve/openai_api.h"

namespace ferry::serve {
namespace {

constexpr const char* kNotSigned = "kv_transfer_params are not signed by this deployment's router";

// Every field length-prefixed or fixed-size, so that no two parameter sets
// encode alike. v2: the expiry and the leg's content; v3: the target engine's incarnation;
// v4: the pull offer's keys.
std::vector<uint8_t> canonical(const KvTransferParams& kv) {
    ByteWriter w;
    w.put_string("ferry kv_transfer_params v4");
    w.put<uint8_t>(uint8_t(kv.do_remote_decode) | uint8_t(kv.do_remote_prefill) << 1);
    w.put_string(kv.transfer_id);
    w.put(kv.attempt);
    w.put_string(kv.remote_engine_id);
    w.put_string(kv.remote_host);
    w.put<int32_t>(kv.remote_port);
    w.put<int32_t>(kv.tp_size);
    w.put_vector(std::vector<uint32_t>(kv.remote_block_ids.begin(), kv.remote_block_ids.end()));
    w.put_string(kv.capability);
    w.put(kv.expires_unix_ms);
    w.put(kv.content);
    w.put_string(kv.incarnation);
    w.put_string(kv.pull_keys);
    return w.take();
}

std::span<const uint8_t> bytes_of(const std::string& s) {
    return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace

Digest prompt_digest(std::span<const int32_t> tokens) {
    // The ids' own bytes: little-endian, as ByteWriter writes everything.
    return sha256({reinterpret_cast<const uint8_t*>(tokens.data()), tokens.size_bytes()});
}

Digest leg_content_digest(const LegContent& c) {
    ByteWriter w;
    w.put_string("ferry leg content v1");
    w.put(c.prompt);
    w.put<uint64_t>(c.max_tokens);
    w.put_string(c.engine_id);
    return sha256(w.take());
}

int64_t unix_ms_now() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
}

std::string new_incarnation() {
    uint8_t bytes[8] = {};
    if (!random_bytes(bytes).ok()) {
        // No strong randomness: still distinct per process start, which is all it must be.
        std::random_device rd;
        uint64_t v =
            (uint64_t(rd()) << 32 | rd()) ^ uint64_t(unix_ms_now()) ^ (uint64_t(::getpid()) << 40);
        std::memcpy(bytes, &v, sizeof v);
    }
    return to_hex(std::span<const uint8_t>(bytes, sizeof bytes));
}

std::string kv_params_tag(const Secret& secret, const KvTransferParams& kv) {
    return to_hex(hmac_sha256(secret, canonical(kv)));
}

void sign_kv_params(const Secret& secret, KvTransferParams* kv, const Digest& content,
                    int64_t expires_unix_ms) {
    kv->content = content;
    kv->expires_unix_ms = expires_unix_ms;
    kv->auth = kv_params_tag(secret, *kv);
}

Status verify_kv_params(const Secret& secret, const KvTransferParams& kv) {
    if (secret.empty())
        return permission_denied(std::string(kNotSigned) + ": this engine has no secret");
    if (kv.auth.empty())
        return permission_denied(std::string(kNotSigned) +
                                 " (no ferry_auth): send completions through the router");
    if (!constant_time_equal(bytes_of(kv.auth), bytes_of(kv_params_tag(secret, kv))))
        return permission_denied(std::string(kNotSigned) +
                                 " (ferry_auth does not match the leg: its kv_transfer_params, "
                                 "prompt or max_tokens were altered, it was signed for another "
                                 "engine, or under another secret)");
    return ok_status();
}

Status sign_kv_params_json(const Secret& secret, nlohmann::json* kv, const Digest& content,
                           int64_t expires_unix_ms, const std::string& incarnation) {
    if (secret.empty()) return invalid_argument("no deployment secret to sign kv_transfer_params");
    FERRY_ASSIGN_OR_RETURN(KvTransferParams p, kv_params_from_json(*kv));
    p.incarnation = incarnation;
    sign_kv_params(secret, &p, content, expires_unix_ms);
    if (incarnation.empty())
        kv->erase("ferry_incarnation");
    else
        (*kv)["ferry_incarnation"] = incarnation;
    (*kv)["ferry_expires"] = p.expires_unix_ms;
    (*kv)["ferry_auth"] = p.auth;
    return ok_status();
}

Status LegTagLedger::admit(const Secret& secret, const KvTransferParams& kv, int64_t now_unix_ms) {
    FERRY_RETURN_IF_ERROR(verify_kv_params(secret, kv));
    if (!incarnation_.empty() && kv.incarnation != incarnation_)
        return permission_denied(fmt::format(
            "kv_transfer_params were {} (the leg's incarnation '{}', this process's '{}'): the "
            "engine restarted since the router signed the leg, or the leg was sent to another "
            "process; send the request through the router again",
            kOtherIncarnation, kv.incarnation, incarnation_));
    if (kv.expires_unix_ms < now_unix_ms)
        return permission_denied(fmt::format(
            "kv_transfer_params expired {} ms ago (ferry_expires {}): a leg is taken only "
            "until its expiry; send the request through the router again (and check that the "
            "router's and engines' clocks agree)",
            now_unix_ms - kv.expires_unix_ms, kv.expires_unix_ms));
    std::lock_guard lk(mu_);
    forget_expired_locked(now_unix_ms);
    if (taken_.count(kv.auth))
        return permission_denied(
            "kv_transfer_params were already used: a signed leg is taken once (a replayed "
            "leg); send the request through the router again");
    if (kv.expires_unix_ms > refused_through_ && taken_.size() >= capacity_) {
        // Room for this tag: the one expiring first is forgotten, and with it every tag that
        // expires no later.
        auto first = by_expiry_.begin();
        refused_through_ = first->first;
        taken_.erase(first->second);
        by_expiry_.erase(first);
    }
    if (kv.expires_unix_ms <= refused_through_)
        return permission_denied(fmt::format(
            "kv_transfer_params refused: this engine took {} legs that have not expired yet and "
            "no longer remembers whether this one (ferry_expires {}) was used; send the request "
            "through the router again",
            capacity_, kv.expires_unix_ms));
    taken_.emplace(kv.auth, kv.expires_unix_ms);
    by_expiry_.emplace(kv.expires_unix_ms, kv.auth);
    return ok_status();
}

size_t LegTagLedger::size() const {
    std::lock_guard lk(mu_);
    return taken_.size();
}

void LegTagLedger::forget_expired_locked(int64_t now_unix_ms) {
    while (!by_expiry_.empty() && by_expiry_.begin()->first < now_unix_ms) {
        taken_.erase(by_expiry_.begin()->second);
        by_expiry_.erase(by_expiry_.begin());
    }
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
    if (!constant_time_equal(bytes_of(tag), bytes_of(abort_tag(secret, transfer_id))))
        return permission_denied(std::string(kWhat) +
                                 " (ferry_auth does not match the transfer id: altered, or signed "
                                 "under another secret)");
    return ok_status();
}

}  // namespace ferry::serve

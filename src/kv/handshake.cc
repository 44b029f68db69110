// The handshake client (fetch_handshake) and the per-endpoint cache.
#include "ferry/kv/handshake.h"

#include <fmt/format.h>

#include <algorithm>

#include "ferry/common/log.h"
#include "handshake_wire.h"

namespace ferry::kv {

using namespace handshake_wire;

namespace {

// A server frame's header and type; a REFUSED frame becomes the error it carries.
Result<Frame> read_server_frame(ByteReader& r, Frame expected) {
    FERRY_RETURN_IF_ERROR(check_header(r, kReplyMagic, "handshake reply"));
    uint8_t type = 0;
    FERRY_RETURN_IF_ERROR(r.get(&type, "type"));
    if (type == uint8_t(Frame::kRefused)) {
        std::string why;
        FERRY_RETURN_IF_ERROR(r.get_string(&why, "reason", 1024));
        if (why == kAuthFailed)
            return permission_denied(
                "the peer refused: authentication failed (both sides need the same deployment "
                "secret: --secret-file)");
        return protocol_error(fmt::format("the peer refused: {}", why));
    }
    if (type != uint8_t(expected))
        return protocol_error(
            fmt::format("field 'type' is {}, expected {}", type, uint8_t(expected)));
    return expected;
}

}  // namespace

Result<HandshakeInfo> fetch_handshake(const std::string& host, uint16_t port,
                                      uint64_t expected_compat_hash, const Secret& secret,
                                      Duration timeout, bool* refused, const KvLayout* mine) {
    if (refused) *refused = false;
    auto ctx = [&](const Status& s) {
        return s.with_context(fmt::format("handshake with {}:{}", host, port));
    };
    if (secret.empty()) return ctx(invalid_argument("no deployment secret to handshake with"));
    TimePoint deadline = Clock::now() + timeout;
    auto exchange = [&]() -> Result<HandshakeInfo> {
        FERRY_ASSIGN_OR_RETURN(Fd fd, connect_to(host, port, deadline, refused));
        Nonce client{}, server{};
        FERRY_RETURN_IF_ERROR(random_bytes(client));
        ByteWriter hello;
        hello.put(kRequestMagic);
        hello.put(HandshakeInfo::kVersion);
        hello.put(uint8_t(Frame::kHello));
        hello.put(client);
        FERRY_RETURN_IF_ERROR(send_frame(fd.get(), hello.bytes(), deadline));

        FERRY_ASSIGN_OR_RETURN(auto challenge, recv_frame(fd.get(), deadline));
        ByteReader cr(challenge);
        FERRY_RETURN_IF_ERROR(read_server_frame(cr, Frame::kChallenge).status());
        Digest server_proof{};
        FERRY_RETURN_IF_ERROR(cr.get(&server, "nonce"));
        FERRY_RETURN_IF_ERROR(cr.get(&server_proof, "proof"));
        // Checked before this side proves anything or says what it expects.
        if (!constant_time_equal(server_proof, proof(secret, kServerLabel, client, server)))
            return permission_denied(
                "the peer did not prove the deployment secret: it is not an engine of this "
                "deployment (check --secret-file on both)");

        ByteWriter auth;
        auth.put(kRequestMagic);
        auth.put(HandshakeInfo::kVersion);
        auth.put(uint8_t(Frame::kAuth));
        auth.put(proof(secret, kClientLabel, client, server));
        auth.put(expected_compat_hash);
        FERRY_RETURN_IF_ERROR(send_frame(fd.get(), auth.bytes(), deadline));

        FERRY_ASSIGN_OR_RETURN(auto answer, recv_frame(fd.get(), deadline));
        ByteReader ar(answer);
        FERRY_RETURN_IF_ERROR(read_server_frame(ar, Frame::kAnswer).status());
        if (answer.size() < sizeof(Digest))
            return protocol_error("handshake answer too short for its MAC");
        std::span<const uint8_t> body(answer.data(), answer.size() - sizeof(Digest));
        std::span<const uint8_t> mac(answer.data() + body.size(), sizeof(Digest));
        if (!constant_time_equal(mac, proof(secret, kAnswerLabel, client, server, body)))
            return permission_denied(
                "the handshake answer's MAC is wrong: not from this "
                "deployment, or altered on the way");
        ByteReader r(body);
        FERRY_RETURN_IF_ERROR(read_server_frame(r, Frame::kAnswer).status());
        uint8_t ok = 0;
        FERRY_RETURN_IF_ERROR(r.get(&ok, "ok"));
        if (!ok) {
            std::string why;
            FERRY_RETURN_IF_ERROR(r.get_string(&why, "error", kMaxFrame));
            // A server of before 2026-12-06 sends the message only.
            Result<KvLayout> theirs =
                r.remaining() ? KvLayout::decode(r) : Result<KvLayout>(not_found(""));
            if (!mine || !theirs.ok()) return invalid_argument(why);
            return invalid_argument(
                fmt::format("incompatible KV layout: {}: the peer holds {}, this side {}",
                            compatibility_difference(*theirs, *mine, "at the peer", "here"),
                            theirs->to_string(), mine->to_string()));
        }
        std::vector<uint8_t> blob;
        FERRY_RETURN_IF_ERROR(r.get_bytes(&blob, "info", kMaxFrame));
        FERRY_ASSIGN_OR_RETURN(auto info, HandshakeInfo::deserialize(blob));
        // The server checked too; checking here as well protects against a server that lies.
        if (info.layout.compatibility_hash() != expected_compat_hash) {
            return invalid_argument(fmt::format("peer layout {} does not match the expected hash",
                                                info.layout.to_string()));
        }
        return info;
    };
    auto got = exchange();
    if (!got.ok()) return ctx(got.status());
    return got;
}

Result<HandshakeInfo> HandshakeCache::get(const std::string& host, uint16_t port,
                                          Duration timeout) {
    std::string key = endpoint_key(host, port);
    {
        std::lock_guard lk(mu_);
        auto it = entries_.find(key);
        if (it != entries_.end()) return it->second;
    }
    // Fetched without the lock: a slow peer must not hold up lookups of other peers.
    FERRY_ASSIGN_OR_RETURN(auto info, fetch_handshake(host, port, hash_, secret_, timeout, nullptr,
                                                      mine_ ? &*mine_ : nullptr));
    std::lock_guard lk(mu_);
    return entries_.insert_or_assign(key, std::move(info)).first->second;
}

Result<HandshakeCache::Refreshed> HandshakeCache::refresh(const std::string& host, uint16_t port,
                                                          Duration timeout) {
    std::string key = endpoint_key(host, port);
    FERRY_ASSIGN_OR_RETURN(auto info, fetch_handshake(host, port, hash_, secret_, timeout, nullptr,
                                                      mine_ ? &*mine_ : nullptr));
    std::lock_guard lk(mu_);
    Refreshed out;
    auto it = entries_.find(key);
    out.restarted = it != entries_.end() && it->second.epoch != info.epoch;
    out.info = info;
    entries_.insert_or_assign(key, std::move(info));
    return out;
}

HandshakeCache::Probe HandshakeCache::probe(const std::string& host, uint16_t port,
                                            Duration timeout) {
    std::string key = endpoint_key(host, port);
    Probe out;
    {
        std::lock_guard lk(mu_);
        if (auto it = entries_.find(key); it != entries_.end()) out.previous = it->second;
    }
    bool refused = false;
    auto info =
        fetch_handshake(host, port, hash_, secret_, timeout, &refused, mine_ ? &*mine_ : nullptr);
    std::lock_guard lk(mu_);
    if (!info.ok()) {
        out.why = info.status();
        out.state = refused ? Probe::State::kGone : Probe::State::kUnknown;
        if (refused) entries_.erase(key);
        return out;
    }
    bool restarted = out.previous && out.previous->epoch != info->epoch;
    out.state = restarted ? Probe::State::kRestarted : Probe::State::kSame;
    entries_.insert_or_assign(key, std::move(info).value());
    return out;
}

void HandshakeCache::forget(const std::string& host, uint16_t port) {
    std::lock_guard lk(mu_);
    entries_.erase(endpoint_key(host, port));
}

size_t HandshakeCache::size() const {
    std::lock_guard lk(mu_);
    return entries_.size();
}

}  // namespace ferry::kv

#include "handshake_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ferry/kv/handshake.h"
#include "ferry/kv/messages.h"
#include "ferry/kv/pool.h"

namespace ferry::kv {
namespace handshake_wire {

// HMAC under the secret over a domain label, both nonces and `extra`: the label keeps a
// server's proof from passing as a client's, the nonces make every exchange unique.
Digest proof(const Secret& secret, std::string_view label, const Nonce& client, const Nonce& server,
             std::span<const uint8_t> extra) {
    std::vector<uint8_t> m(label.begin(), label.end());
    m.insert(m.end(), client.begin(), client.end());
    m.insert(m.end(), server.begin(), server.end());
    m.insert(m.end(), extra.begin(), extra.end());
    return hmac_sha256(secret, m);
}

int ms_left(TimePoint deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    return static_cast<int>(std::max<int64_t>(0, left.count()));
}

Status wait_fd(int fd, short events, TimePoint deadline, const char* what) {
    while (true) {
        pollfd p{fd, events, 0};
        int rc = ::poll(&p, 1, ms_left(deadline));
        if (rc > 0) return ok_status();
        if (rc == 0) return timeout_error(fmt::format("handshake: {} timed out", what));
        if (errno != EINTR) return unavailable(fmt::format("handshake: poll: {}", strerror(errno)));
    }
}

Status send_all(int fd, const uint8_t* p, size_t n, TimePoint deadline) {
    while (n) {
        FERRY_RETURN_IF_ERROR(wait_fd(fd, POLLOUT, deadline, "sending"));
        ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (w <= 0) return unavailable(fmt::format("handshake: send: {}", strerror(errno)));
        p += w;
        n -= static_cast<size_t>(w);
    }
    return ok_status();
}

Status recv_all(int fd, uint8_t* p, size_t n, TimePoint deadline) {
    while (n) {
        FERRY_RETURN_IF_ERROR(wait_fd(fd, POLLIN, deadline, "receiving"));
        ssize_t r = ::recv(fd, p, n, 0);
        if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (r == 0) return unavailable("handshake: the peer closed the connection");
        if (r < 0) return unavailable(fmt::format("handshake: recv: {}", strerror(errno)));
        p += r;
        n -= static_cast<size_t>(r);
    }
    return ok_status();
}

// One send per frame: a length and a payload sent apart made Nagle hold the payload until
// the peer's delayed ACK, 40 ms per frame (a handshake took 45 ms instead of under 1 ms).
Status send_frame(int fd, std::span<const uint8_t> payload, TimePoint deadline) {
    uint32_t len = static_cast<uint32_t>(payload.size());
    std::vector<uint8_t> frame(4 + payload.size());
    std::memcpy(frame.data(), &len, 4);
    if (!payload.empty()) std::memcpy(frame.data() + 4, payload.data(), payload.size());
    return send_all(fd, frame.data(), frame.size(), deadline);
}

Result<std::vector<uint8_t>> recv_frame(int fd, TimePoint deadline) {
    uint32_t len = 0;
    FERRY_RETURN_IF_ERROR(recv_all(fd, reinterpret_cast<uint8_t*>(&len), 4, deadline));
    if (len > kMaxFrame) {
        // Four printable bytes are text, not a length: most likely an HTTP server (an engine's
        // HTTP port given where its KV side-channel port belongs) answering "HTTP/1.1 400".
        char text[4];
        std::memcpy(text, &len, 4);
        if (std::all_of(text, text + 4, [](char c) { return c >= 0x20 && c < 0x7f; })) {
            return protocol_error(fmt::format(
                "the peer answered in text (\"{}...\"), not with a handshake frame: it is no ferry "
                "KV side channel{}",
                std::string_view(text, 4),
                std::string_view(text, 4) == "HTTP"
                    ? " but an HTTP server (an engine's HTTP port given instead of its KV port?)"
                    : ""));
        }
        return protocol_error(
            fmt::format("handshake frame of {} bytes exceeds {}", len, kMaxFrame));
    }
    std::vector<uint8_t> buf(len);
    FERRY_RETURN_IF_ERROR(recv_all(fd, buf.data(), len, deadline));
    return buf;
}

Status check_header(ByteReader& r, uint32_t magic, const char* what) {
    uint32_t m = 0;
    uint16_t v = 0;
    FERRY_RETURN_IF_ERROR(r.get(&m, "magic"));
    if (m != magic) {
        return protocol_error(fmt::format("field 'magic' is {:#x}: not a ferry {}", m, what));
    }
    FERRY_RETURN_IF_ERROR(r.get(&v, "version"));
    if (v != HandshakeInfo::kVersion) {
        return protocol_error(
            fmt::format("field 'version' is {}, this build speaks {}; upgrade "
                        "both sides",
                        v, HandshakeInfo::kVersion));
    }
    return ok_status();
}

Result<Fd> connect_to(const std::string& host, uint16_t port, TimePoint deadline, bool* refused) {
    if (refused) *refused = false;
    size_t tried = 0, refusals = 0;
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    std::string service = std::to_string(port);
    int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
    if (rc != 0) {
        return unavailable(fmt::format("handshake: cannot resolve {}: {}", host, gai_strerror(rc)));
    }
    Status last = unavailable(fmt::format("handshake: no address for {}", host));
    for (addrinfo* ai = res; ai; ai = ai->ai_next) {
        Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                       ai->ai_protocol));
        if (fd.get() < 0) continue;
        ++tried;
        if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
            refusals += errno == ECONNREFUSED;
            last = unavailable(
                fmt::format("handshake: connect to {}:{}: {}", host, port, strerror(errno)));
            continue;
        }
        Status s = wait_fd(fd.get(), POLLOUT, deadline, "connecting");
        int err = 0;
        socklen_t len = sizeof(err);
        if (s.ok()) ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        if (s.ok() && err == 0) {
            ::freeaddrinfo(res);
            return fd;
        }
        refusals += s.ok() && err == ECONNREFUSED;
        last = s.ok() ? unavailable(fmt::format("handshake: connect to {}:{}: {}", host, port,
                                                strerror(err)))
                      : s;
    }
    ::freeaddrinfo(res);
    if (refused) *refused = tried > 0 && refusals == tried;
    return last;
}

std::string endpoint_key(const std::string& host, uint16_t port) {
    return fmt::format("{}:{}", host, port);
}

}  // namespace handshake_wire

using namespace handshake_wire;

std::vector<uint8_t> HandshakeInfo::serialize() const {
    ByteWriter w;
    w.put(kInfoMagic);
    w.put(kVersion);
    w.put(epoch);
    address.encode(w);
    w.put(static_cast<uint32_t>(pool.size()));
    for (const MemoryDescriptor& d : pool) d.encode(w);
    layout.encode(w);
    w.put(tp_rank);
    w.put(tp_size);
    return w.take();
}

Result<HandshakeInfo> HandshakeInfo::deserialize(std::span<const uint8_t> blob) {
    ByteReader r(blob);
    FERRY_RETURN_IF_ERROR(check_header(r, kInfoMagic, "handshake answer"));
    HandshakeInfo h;
    FERRY_RETURN_IF_ERROR(r.get(&h.epoch, "epoch"));
    FERRY_ASSIGN_OR_RETURN(h.address, EngineAddress::decode(r));
    uint32_t regions = 0;
    FERRY_RETURN_IF_ERROR(r.get(&regions, "pool.count"));
    if (regions == 0 || regions > kMaxPoolRegions) {
        return protocol_error(
            fmt::format("field 'pool.count' = {} is not in [1, {}]", regions, kMaxPoolRegions));
    }
    for (uint32_t i = 0; i < regions; ++i) {
        FERRY_ASSIGN_OR_RETURN(auto d, MemoryDescriptor::decode(r));
        h.pool.push_back(std::move(d));
    }
    FERRY_ASSIGN_OR_RETURN(h.layout, KvLayout::decode(r));
    FERRY_RETURN_IF_ERROR(check_pool_descriptors(h.pool, h.layout));
    FERRY_RETURN_IF_ERROR(r.get(&h.tp_rank, "tp_rank"));
    FERRY_RETURN_IF_ERROR(r.get(&h.tp_size, "tp_size"));
    if (h.tp_size == 0 || h.tp_rank >= h.tp_size) {
        return protocol_error(
            fmt::format("field 'tp_rank' = {} is not below 'tp_size' = {}", h.tp_rank, h.tp_size));
    }
    if (r.remaining()) {
        return protocol_error(
            fmt::format("{} trailing bytes after the handshake answer", r.remaining()));
    }
    return h;
}

}  // namespace ferry::kv

#include "ferry/kv/handshake.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "ferry/common/bytes.h"
#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"

namespace ferry::kv {
namespace {

constexpr uint32_t kInfoMagic = 0x4652484e;     // "FRHN"
constexpr uint32_t kRequestMagic = 0x46524851;  // "FRHQ"
constexpr uint32_t kReplyMagic = 0x46524852;    // "FRHR"
constexpr uint32_t kMaxFrame = 64 * 1024;
// A client that connects and then says nothing holds the server this long at most.
constexpr Duration kServerIoTimeout = std::chrono::seconds(1);
constexpr int kAcceptPollMs = 50;

// Owns a socket descriptor.
class Fd {
   public:
    Fd() = default;
    explicit Fd(int fd) : fd_(fd) {}
    Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
    Fd& operator=(Fd&& o) noexcept {
        reset();
        fd_ = std::exchange(o.fd_, -1);
        return *this;
    }
    ~Fd() { reset(); }
    int get() const { return fd_; }
    void reset() {
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }

   private:
    int fd_ = -1;
};

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

Status send_frame(int fd, std::span<const uint8_t> payload, TimePoint deadline) {
    uint32_t len = static_cast<uint32_t>(payload.size());
    FERRY_RETURN_IF_ERROR(send_all(fd, reinterpret_cast<uint8_t*>(&len), 4, deadline));
    return send_all(fd, payload.data(), payload.size(), deadline);
}

Result<std::vector<uint8_t>> recv_frame(int fd, TimePoint deadline) {
    uint32_t len = 0;
    FERRY_RETURN_IF_ERROR(recv_all(fd, reinterpret_cast<uint8_t*>(&len), 4, deadline));
    if (len > kMaxFrame) {
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

Result<Fd> connect_to(const std::string& host, uint16_t port, TimePoint deadline) {
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
        if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
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
        last = s.ok() ? unavailable(fmt::format("handshake: connect to {}:{}: {}", host, port,
                                                strerror(err)))
                      : s;
    }
    ::freeaddrinfo(res);
    return last;
}

std::string endpoint_key(const std::string& host, uint16_t port) {
    return fmt::format("{}:{}", host, port);
}

}  // namespace

std::vector<uint8_t> HandshakeInfo::serialize() const {
    ByteWriter w;
    w.put(kInfoMagic);
    w.put(kVersion);
    w.put(epoch);
    address.encode(w);
    pool.encode(w);
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
    FERRY_ASSIGN_OR_RETURN(h.pool, MemoryDescriptor::decode(r));
    FERRY_ASSIGN_OR_RETURN(h.layout, KvLayout::decode(r));
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

class HandshakeServer::Impl {
   public:
    Impl(Fd listener, uint16_t port, HandshakeInfo info)
        : listener_(std::move(listener)), port_(port), info_(std::move(info)) {}

    void start() {
        thread_ = std::thread([this] {
            set_thread_name("ferry-handshake");
            run();
        });
    }
    void stop() {
        stop_.store(true);
        if (thread_.joinable()) thread_.join();
    }

    uint16_t port() const { return port_; }
    uint64_t epoch() const { return info_.epoch; }
    uint64_t served() const { return served_.load(); }

   private:
    void run() {
        while (!stop_.load()) {
            pollfd p{listener_.get(), POLLIN, 0};
            int rc = ::poll(&p, 1, kAcceptPollMs);
            if (rc <= 0) continue;
            Fd conn(::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
            if (conn.get() < 0) continue;
            Status s = serve(conn.get());
            if (!s.ok()) log(LogLevel::kWarn, "kv", "handshake request failed: {}", s.to_string());
        }
    }

    Status serve(int fd) {
        TimePoint deadline = Clock::now() + kServerIoTimeout;
        FERRY_ASSIGN_OR_RETURN(auto req, recv_frame(fd, deadline));
        ByteReader r(req);
        uint64_t hash = 0;
        Status parsed = check_header(r, kRequestMagic, "handshake request");
        if (parsed.ok()) parsed = r.get(&hash, "compat_hash");
        ByteWriter w;
        w.put(kReplyMagic);
        w.put(HandshakeInfo::kVersion);
        if (!parsed.ok()) {
            w.put<uint8_t>(0);
            w.put_string(parsed.message());
        } else if (hash != info_.layout.compatibility_hash()) {
            w.put<uint8_t>(0);
            w.put_string(
                fmt::format("incompatible KV layout: this rank holds {} (hash {:#x}), "
                            "the caller expects hash {:#x}",
                            info_.layout.to_string(), info_.layout.compatibility_hash(), hash));
        } else {
            w.put<uint8_t>(1);
            w.put_bytes(info_.serialize());
        }
        // Counted before the answer leaves, so a caller that got it sees the count.
        served_.fetch_add(1);
        FERRY_RETURN_IF_ERROR(send_frame(fd, w.bytes(), deadline));
        return parsed;
    }

    Fd listener_;
    uint16_t port_;
    HandshakeInfo info_;
    std::thread thread_;
    std::atomic<bool> stop_{false};
    std::atomic<uint64_t> served_{0};
};

Result<std::unique_ptr<HandshakeServer>> HandshakeServer::start(const std::string& host,
                                                                uint16_t port, HandshakeInfo info) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* res = nullptr;
    std::string service = std::to_string(port);
    int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
    if (rc != 0) {
        return invalid_argument(
            fmt::format("handshake server: cannot resolve '{}': {}", host, gai_strerror(rc)));
    }
    Fd fd(::socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol));
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    bool bound = fd.get() >= 0 && ::bind(fd.get(), res->ai_addr, res->ai_addrlen) == 0 &&
                 ::listen(fd.get(), 64) == 0;
    ::freeaddrinfo(res);
    if (!bound) {
        return unavailable(fmt::format("handshake server: cannot listen on {}:{}: {}", host, port,
                                       strerror(errno)));
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
    uint16_t actual = ss.ss_family == AF_INET6
                          ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                          : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    std::random_device rd;
    info.epoch = (uint64_t{rd()} << 32 | rd()) | 1;  // never 0: 0 means "unknown"
    auto impl = std::make_unique<Impl>(std::move(fd), actual, std::move(info));
    impl->start();
    return std::unique_ptr<HandshakeServer>(new HandshakeServer(std::move(impl)));
}

HandshakeServer::HandshakeServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HandshakeServer::~HandshakeServer() { impl_->stop(); }
uint16_t HandshakeServer::port() const { return impl_->port(); }
uint64_t HandshakeServer::epoch() const { return impl_->epoch(); }
uint64_t HandshakeServer::requests_served() const { return impl_->served(); }

Result<HandshakeInfo> fetch_handshake(const std::string& host, uint16_t port,
                                      uint64_t expected_compat_hash, Duration timeout) {
    TimePoint deadline = Clock::now() + timeout;
    auto ctx = [&](const Status& s) {
        return s.with_context(fmt::format("handshake with {}:{}", host, port));
    };
    auto fd = connect_to(host, port, deadline);
    if (!fd.ok()) return ctx(fd.status());
    ByteWriter w;
    w.put(kRequestMagic);
    w.put(HandshakeInfo::kVersion);
    w.put(expected_compat_hash);
    Status s = send_frame(fd->get(), w.bytes(), deadline);
    if (!s.ok()) return ctx(s);
    auto reply = recv_frame(fd->get(), deadline);
    if (!reply.ok()) return ctx(reply.status());
    ByteReader r(*reply);
    s = check_header(r, kReplyMagic, "handshake reply");
    if (!s.ok()) return ctx(s);
    uint8_t ok = 0;
    s = r.get(&ok, "ok");
    if (!s.ok()) return ctx(s);
    if (!ok) {
        std::string why;
        s = r.get_string(&why, "error", kMaxFrame);
        if (!s.ok()) return ctx(s);
        return ctx(invalid_argument(why));
    }
    std::vector<uint8_t> blob;
    s = r.get_bytes(&blob, "info", kMaxFrame);
    if (!s.ok()) return ctx(s);
    auto info = HandshakeInfo::deserialize(blob);
    if (!info.ok()) return ctx(info.status());
    // The server checked too; checking here as well protects against a server that lies.
    if (info->layout.compatibility_hash() != expected_compat_hash) {
        return ctx(invalid_argument(fmt::format("peer layout {} does not match the expected hash",
                                                info->layout.to_string())));
    }
    return info;
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
    FERRY_ASSIGN_OR_RETURN(auto info, fetch_handshake(host, port, hash_, timeout));
    std::lock_guard lk(mu_);
    return entries_.insert_or_assign(key, std::move(info)).first->second;
}

Result<HandshakeCache::Refreshed> HandshakeCache::refresh(const std::string& host, uint16_t port,
                                                          Duration timeout) {
    std::string key = endpoint_key(host, port);
    FERRY_ASSIGN_OR_RETURN(auto info, fetch_handshake(host, port, hash_, timeout));
    std::lock_guard lk(mu_);
    Refreshed out;
    auto it = entries_.find(key);
    out.restarted = it != entries_.end() && it->second.epoch != info.epoch;
    out.info = info;
    entries_.insert_or_assign(key, std::move(info));
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

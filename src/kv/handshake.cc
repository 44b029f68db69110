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

#include <algorithm>
#include <array>
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
// Client frames are small and fixed (HELLO 39, AUTH 47 bytes); anything bigger is refused
// before it is read, so a client cannot make the server buffer much.
constexpr uint32_t kMaxClientFrame = 256;
constexpr int kPollMs = 50;  // how soon stop() is seen
constexpr size_t kNonceBytes = 32;
using Nonce = std::array<uint8_t, kNonceBytes>;

enum class Frame : uint8_t { kHello = 1, kChallenge = 2, kAuth = 3, kAnswer = 4, kRefused = 5 };
constexpr const char* kAuthFailed = "authentication failed";

// HMAC under the secret over a domain label, both nonces and `extra`: the label keeps a
// server's proof from passing as a client's, the nonces make every exchange unique.
Digest proof(const Secret& secret, std::string_view label, const Nonce& client, const Nonce& server,
             std::span<const uint8_t> extra = {}) {
    std::vector<uint8_t> m(label.begin(), label.end());
    m.insert(m.end(), client.begin(), client.end());
    m.insert(m.end(), server.begin(), server.end());
    m.insert(m.end(), extra.begin(), extra.end());
    return hmac_sha256(secret, m);
}
constexpr std::string_view kServerLabel = "ferry-handshake-v2 server";
constexpr std::string_view kClientLabel = "ferry-handshake-v2 client";
constexpr std::string_view kAnswerLabel = "ferry-handshake-v2 answer";

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
    Impl(Fd listener, uint16_t port, HandshakeInfo info, HandshakeServerOptions opts)
        : listener_(std::move(listener)),
          port_(port),
          info_(std::move(info)),
          opts_(std::move(opts)) {}

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
    uint64_t auth_failures() const { return auth_failures_.load(); }
    uint64_t refused() const { return refused_.load(); }

   private:
    // One client's exchange, advanced by the poll loop as its bytes come and go.
    struct Conn {
        Fd fd;
        TimePoint deadline;
        Frame expect = Frame::kHello;
        std::vector<uint8_t> in;
        std::vector<uint8_t> out;
        size_t sent = 0;
        bool last = false;  // close once `out` is sent
        Nonce client{}, server{};
    };

    void run() {
        std::vector<pollfd> fds;
        while (!stop_.load()) {
            fds.clear();
            fds.push_back({listener_.get(), POLLIN, 0});
            TimePoint wake = Clock::now() + std::chrono::milliseconds(kPollMs);
            for (const auto& c : conns_) {
                short ev = c->sent < c->out.size() ? POLLOUT : POLLIN;
                fds.push_back({c->fd.get(), ev, 0});
                wake = std::min(wake, c->deadline);
            }
            int rc = ::poll(fds.data(), fds.size(), ms_left(wake));
            if (rc < 0 && errno != EINTR) {
                log(LogLevel::kWarn, "kv", "handshake server: poll: {}", strerror(errno));
                std::this_thread::sleep_for(std::chrono::milliseconds(kPollMs));
                continue;
            }
            TimePoint now = Clock::now();
            size_t before = conns_.size();  // accept() below appends; their revents are 0
            for (size_t i = 0; i < before; ++i) {
                Conn& c = *conns_[i];
                short re = rc > 0 ? fds[i + 1].revents : 0;
                if (re & (POLLERR | POLLNVAL)) c.fd.reset();
                if (c.fd.get() >= 0 && (re & POLLOUT)) flush(c);
                if (c.fd.get() >= 0 && (re & (POLLIN | POLLHUP))) receive(c);
                if (c.fd.get() >= 0 && now >= c.deadline) c.fd.reset();
            }
            if (rc > 0 && (fds[0].revents & POLLIN)) accept_all(now);
            std::erase_if(conns_, [](const auto& c) { return c->fd.get() < 0; });
        }
        conns_.clear();
    }

    void accept_all(TimePoint now) {
        while (true) {
            Fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
            if (fd.get() < 0) return;  // EAGAIN: drained (or a transient error: next round)
            if (conns_.size() >= opts_.max_connections) {
                refused_.fetch_add(1);  // closed by Fd's destructor, now
                continue;
            }
            auto c = std::make_unique<Conn>();
            c->fd = std::move(fd);
            c->deadline = now + opts_.connection_deadline;
            conns_.push_back(std::move(c));
        }
    }

    void receive(Conn& c) {
        uint8_t buf[512];
        while (c.fd.get() >= 0 && c.out.size() == c.sent && !c.last) {
            ssize_t r = ::recv(c.fd.get(), buf, sizeof(buf), 0);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
            if (r <= 0) return c.fd.reset();  // closed, or reset
            c.in.insert(c.in.end(), buf, buf + r);
            while (c.in.size() >= 4 && c.out.size() == c.sent && !c.last) {
                uint32_t len = 0;
                std::memcpy(&len, c.in.data(), 4);
                if (len > kMaxClientFrame) return refuse(c, kAuthFailed);
                if (c.in.size() < 4 + size_t{len}) break;
                std::vector<uint8_t> frame(c.in.begin() + 4, c.in.begin() + 4 + len);
                c.in.erase(c.in.begin(), c.in.begin() + 4 + len);
                on_frame(c, frame);
            }
        }
    }

    void on_frame(Conn& c, std::span<const uint8_t> frame) {
        ByteReader r(frame);
        Status header = check_header(r, kRequestMagic, "handshake request");
        // Only a version mismatch is worth telling an unauthenticated peer about: it says
        // nothing about this rank, and saves an operator a puzzle.
        if (!header.ok())
            return refuse(c, header.message().find("'version'") != std::string::npos
                                 ? header.message()
                                 : std::string(kAuthFailed));
        uint8_t type = 0;
        if (!r.get(&type, "type").ok() || type != uint8_t(c.expect)) return refuse(c, kAuthFailed);
        if (c.expect == Frame::kHello) {
            if (!r.get(&c.client, "nonce").ok() || r.remaining()) return refuse(c, kAuthFailed);
            if (!random_bytes(c.server).ok()) return c.fd.reset();
            ByteWriter w;
            w.put(kReplyMagic);
            w.put(HandshakeInfo::kVersion);
            w.put(uint8_t(Frame::kChallenge));
            w.put(c.server);
            w.put(proof(opts_.secret, kServerLabel, c.client, c.server));
            c.expect = Frame::kAuth;
            return queue(c, w.take(), false);
        }
        Digest theirs{};
        uint64_t hash = 0;
        if (!r.get(&theirs, "proof").ok() || !r.get(&hash, "compat_hash").ok() || r.remaining())
            return refuse(c, kAuthFailed);
        Digest want = proof(opts_.secret, kClientLabel, c.client, c.server);
        if (!constant_time_equal(theirs, want)) return refuse(c, kAuthFailed);
        ByteWriter w;
        w.put(kReplyMagic);
        w.put(HandshakeInfo::kVersion);
        w.put(uint8_t(Frame::kAnswer));
        if (hash != info_.layout.compatibility_hash()) {
            w.put<uint8_t>(0);
            w.put_string(
                fmt::format("incompatible KV layout: this rank holds {} (hash {:#x}), "
                            "the caller expects hash {:#x}",
                            info_.layout.to_string(), info_.layout.compatibility_hash(), hash));
        } else {
            w.put<uint8_t>(1);
            w.put_bytes(info_.serialize());
        }
        w.put(proof(opts_.secret, kAnswerLabel, c.client, c.server, w.bytes()));
        // Counted before the answer leaves, so a caller that got it sees the count.
        served_.fetch_add(1);
        queue(c, w.take(), true);
    }

    // One short frame that reveals nothing, then a close.
    void refuse(Conn& c, const std::string& why) {
        auth_failures_.fetch_add(1);
        ByteWriter w;
        w.put(kReplyMagic);
        w.put(HandshakeInfo::kVersion);
        w.put(uint8_t(Frame::kRefused));
        w.put_string(why);
        queue(c, w.take(), true);
    }

    void queue(Conn& c, std::vector<uint8_t> payload, bool last) {
        uint32_t len = uint32_t(payload.size());
        c.out.assign(reinterpret_cast<uint8_t*>(&len), reinterpret_cast<uint8_t*>(&len) + 4);
        c.out.insert(c.out.end(), payload.begin(), payload.end());
        c.sent = 0;
        c.last = last;
        flush(c);
    }

    void flush(Conn& c) {
        while (c.sent < c.out.size()) {
            ssize_t w =
                ::send(c.fd.get(), c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
            if (w < 0 && errno == EINTR) continue;
            if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
            if (w <= 0) return c.fd.reset();
            c.sent += size_t(w);
        }
        c.out.clear();
        c.sent = 0;
        if (c.last) c.fd.reset();
    }

    Fd listener_;
    uint16_t port_;
    HandshakeInfo info_;
    HandshakeServerOptions opts_;
    std::vector<std::unique_ptr<Conn>> conns_;  // the loop thread's only
    std::thread thread_;
    std::atomic<bool> stop_{false};
    std::atomic<uint64_t> served_{0}, auth_failures_{0}, refused_{0};
};

Result<std::unique_ptr<HandshakeServer>> HandshakeServer::start(const std::string& host,
                                                                uint16_t port, HandshakeInfo info,
                                                                HandshakeServerOptions options) {
    if (options.secret.empty())
        return invalid_argument("handshake server: no deployment secret given");
    if (options.max_connections == 0)
        return invalid_argument("handshake server: max_connections must be at least 1");
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
    Fd fd(::socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                   res->ai_protocol));
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    // The backlog holds connections between two poll rounds; the cap is enforced on accept.
    bool bound = fd.get() >= 0 && ::bind(fd.get(), res->ai_addr, res->ai_addrlen) == 0 &&
                 ::listen(fd.get(), 1024) == 0;
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
    auto impl = std::make_unique<Impl>(std::move(fd), actual, std::move(info), std::move(options));
    impl->start();
    return std::unique_ptr<HandshakeServer>(new HandshakeServer(std::move(impl)));
}

HandshakeServer::HandshakeServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HandshakeServer::~HandshakeServer() { impl_->stop(); }
uint16_t HandshakeServer::port() const { return impl_->port(); }
uint64_t HandshakeServer::epoch() const { return impl_->epoch(); }
uint64_t HandshakeServer::requests_served() const { return impl_->served(); }
uint64_t HandshakeServer::auth_failures() const { return impl_->auth_failures(); }
uint64_t HandshakeServer::refused_over_cap() const { return impl_->refused(); }

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
                                      Duration timeout) {
    auto ctx = [&](const Status& s) {
        return s.with_context(fmt::format("handshake with {}:{}", host, port));
    };
    if (secret.empty()) return ctx(invalid_argument("no deployment secret to handshake with"));
    TimePoint deadline = Clock::now() + timeout;
    auto exchange = [&]() -> Result<HandshakeInfo> {
        FERRY_ASSIGN_OR_RETURN(Fd fd, connect_to(host, port, deadline));
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
            return invalid_argument(why);
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
    FERRY_ASSIGN_OR_RETURN(auto info, fetch_handshake(host, port, hash_, secret_, timeout));
    std::lock_guard lk(mu_);
    return entries_.insert_or_assign(key, std::move(info)).first->second;
}

Result<HandshakeCache::Refreshed> HandshakeCache::refresh(const std::string& host, uint16_t port,
                                                          Duration timeout) {
    std::string key = endpoint_key(host, port);
    FERRY_ASSIGN_OR_RETURN(auto info, fetch_handshake(host, port, hash_, secret_, timeout));
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

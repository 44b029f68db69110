// HandshakeServer: one poll loop serving every connection within its deadline.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>
#include <unordered_map>
#include <utility>

#include "common/enum_names.h"
#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"
#include "ferry/kv/handshake.h"
#include "handshake_wire.h"

namespace ferry::kv {

using namespace handshake_wire;

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
        TimePoint accepted;
        TimePoint deadline;  // proof_deadline until a valid AUTH, then connection_deadline
        Frame expect = Frame::kHello;
        std::vector<uint8_t> in;
        std::vector<uint8_t> out;
        size_t sent = 0;
        bool last = false;    // close once `out` is sent
        bool proven = false;  // a valid AUTH came
        Nonce client{}, server{};
        std::string address;  // the client's, without the port: the per-client cap's key
        std::string peer;     // "address:port", for the log
        size_t received = 0;  // bytes, for the log
    };

    void run() {
        std::vector<pollfd> fds;
        while (!stop_.load()) {
            fds.clear();
            TimePoint wake = Clock::now() + std::chrono::milliseconds(kPollMs);
            bool paused = Clock::now() < accept_paused_until_;
            fds.push_back({listener_.get(), short(paused ? 0 : POLLIN), 0});
            if (paused) wake = std::min(wake, accept_paused_until_);
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
                if (c.fd.get() >= 0 && now >= c.deadline) {
                    note_failure(c, expired(c));
                    c.fd.reset();
                }
            }
            if (rc > 0 && (fds[0].revents & POLLIN)) accept_all(now);
            std::erase_if(conns_, [this](const auto& c) {
                if (c->fd.get() >= 0) return false;
                auto it = per_client_.find(c->address);
                if (it != per_client_.end() && --it->second == 0) per_client_.erase(it);
                return true;
            });
        }
        conns_.clear();
    }

    std::string expired(const Conn& c) const {
        if (c.proven)
            return fmt::format(
                "the answer not taken within {:.0f} ms (connection_deadline): closed",
                to_ms(opts_.connection_deadline));
        bool proof = opts_.proof_deadline < opts_.connection_deadline;
        return fmt::format("no valid AUTH within {:.0f} ms ({}; {} bytes received): closed",
                           to_ms(c.deadline - c.accepted),
                           proof ? "proof_deadline" : "connection_deadline", c.received);
    }

    void accept_all(TimePoint now) {
        while (true) {
            sockaddr_storage ss{};
            socklen_t ss_len = sizeof ss;
            Fd fd(::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&ss), &ss_len,
                            SOCK_NONBLOCK | SOCK_CLOEXEC));
            if (fd.get() < 0 && errno == EINTR) continue;
            if (fd.get() < 0 &&
                (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)) {
                // The connection stays queued and the listener readable: polled again at once,
                // the loop took a whole core until descriptors came back.
                if (!accept_failing_)
                    log(LogLevel::kWarn, "kv",
                        "handshake server: accept failed ({}); retrying every {} ms until "
                        "descriptors are free",
                        strerror(errno), kPollMs);
                accept_failing_ = true;
                accept_paused_until_ = now + std::chrono::milliseconds(kPollMs);
                return;
            }
            if (fd.get() < 0) return;  // EAGAIN: drained (or a transient error: next round)
            accept_failing_ = false;
            auto c = std::make_unique<Conn>();
            auto [host, port] = peer_address(ss);
            c->address = host;
            c->peer = fmt::format("{}:{}", host, port);
            size_t mine = 0;
            if (auto it = per_client_.find(c->address); it != per_client_.end()) mine = it->second;
            if (conns_.size() >= opts_.max_connections ||
                mine >= opts_.max_connections_per_client) {
                refused_.fetch_add(1);  // closed by Fd's destructor, now
                note_failure(*c, mine >= opts_.max_connections_per_client
                                     ? fmt::format("{} connections open from {}, the "
                                                   "per-client cap: closed at once",
                                                   mine, c->address)
                                     : fmt::format("{} connections open, the cap: closed at once",
                                                   opts_.max_connections));
                continue;
            }
            ++per_client_[c->address];
            c->fd = std::move(fd);
            c->accepted = now;
            c->deadline = now + std::min(opts_.proof_deadline, opts_.connection_deadline);
            conns_.push_back(std::move(c));
        }
    }

    void receive(Conn& c) {
        uint8_t buf[512];
        while (c.fd.get() >= 0 && c.out.size() == c.sent && !c.last) {
            ssize_t r = ::recv(c.fd.get(), buf, sizeof(buf), 0);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
            if (r <= 0) {
                // A bare connect and close is a port check; a peer gone mid-exchange is not. A
                // client with another secret hangs up once it fails to verify the CHALLENGE.
                if (c.expect == Frame::kAuth && c.in.empty())
                    note_failure(c,
                                 "hung up after the CHALLENGE without sending AUTH: it could "
                                 "not verify this server's proof (a peer holding another "
                                 "deployment's secret?)");
                else if (c.received > 0)
                    note_failure(c, fmt::format("hung up mid-exchange after {} bytes{}", c.received,
                                                r < 0 ? " (reset)" : ""));
                return c.fd.reset();
            }
            c.received += size_t(r);
            c.in.insert(c.in.end(), buf, buf + r);
            while (c.in.size() >= 4 && c.out.size() == c.sent && !c.last) {
                uint32_t len = 0;
                std::memcpy(&len, c.in.data(), 4);
                if (len > kMaxClientFrame)
                    return refuse(c, kAuthFailed,
                                  fmt::format("a frame of {} bytes, more than the {} a handshake "
                                              "request may have: not a ferry handshake client",
                                              len, kMaxClientFrame));
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
            return refuse(c,
                          header.message().find("'version'") != std::string::npos
                              ? header.message()
                              : std::string(kAuthFailed),
                          header.message());
        uint8_t type = 0;
        if (!r.get(&type, "type").ok() || type != uint8_t(c.expect))
            return refuse(c, kAuthFailed,
                          fmt::format("a frame of type {} ({}) where {} was due", type,
                                      frame_name(type), frame_name(uint8_t(c.expect))));
        if (c.expect == Frame::kHello) {
            if (!r.get(&c.client, "nonce").ok() || r.remaining())
                return refuse(c, kAuthFailed,
                              fmt::format("a malformed HELLO of {} bytes", frame.size()));
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
            return refuse(c, kAuthFailed, fmt::format("an AUTH of {} bytes", frame.size()));
        Digest want = proof(opts_.secret, kClientLabel, c.client, c.server);
        if (!constant_time_equal(theirs, want))
            return refuse(c, kAuthFailed,
                          "a wrong proof: the peer does not hold this deployment's secret");
        ByteWriter w;
        w.put(kReplyMagic);
        w.put(HandshakeInfo::kVersion);
        w.put(uint8_t(Frame::kAnswer));
        if (hash != info_.layout.compatibility_hash()) {
            std::string why = fmt::format(
                "incompatible KV layout: this rank holds {} (hash {:#x}), "
                "the caller expects hash {:#x}",
                info_.layout.to_string(), info_.layout.compatibility_hash(), hash);
            note_failure(c, why);
            w.put<uint8_t>(0);
            w.put_string(why);
            // Then this rank's layout, for a caller that names the differing field (one that
            // reads only the message stops before it).
            info_.layout.encode(w);
        } else {
            w.put<uint8_t>(1);
            w.put_bytes(info_.serialize());
        }
        w.put(proof(opts_.secret, kAnswerLabel, c.client, c.server, w.bytes()));
        // Proven: what is left is taking the answer, within the whole exchange's deadline.
        c.proven = true;
        c.deadline = c.accepted + opts_.connection_deadline;
        // Counted before the answer leaves, so a caller that got it sees the count.
        served_.fetch_add(1);
        queue(c, w.take(), true);
    }

    // One short frame that reveals nothing (`why`), then a close; the log says what was wrong.
    void refuse(Conn& c, const std::string& why, std::string_view logged) {
        auth_failures_.fetch_add(1);
        note_failure(c, fmt::format("{}: refused", logged));
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

    // A peer whose exchange failed is logged with its address and what was wrong (it is told
    // only "authentication failed"): a deployment with a mismatched secret or a stray client
    // showed nothing but a counter. At most one line a second, so that a flood of garbage does
    // not flood the log; the next line counts the ones held back.
    void note_failure(const Conn& c, std::string_view why) {
        TimePoint now = Clock::now();
        if (now < next_log_) {
            ++held_back_;
            return;
        }
        next_log_ = now + std::chrono::seconds(1);
        std::string more =
            held_back_ > 0 ? fmt::format(" ({} more failed exchanges not logged)", held_back_) : "";
        held_back_ = 0;
        log(LogLevel::kWarn, "kv", "handshake server on port {}: client {}: {}{}", port_, c.peer,
            why, more);
    }

    static const char* frame_name(uint8_t type) {
        static constexpr EnumName<Frame> kNames[] = {
            {Frame::kHello, "HELLO"},   {Frame::kChallenge, "CHALLENGE"}, {Frame::kAuth, "AUTH"},
            {Frame::kAnswer, "ANSWER"}, {Frame::kRefused, "REFUSED"},
        };
        return name_of(kNames, Frame(type), "no frame of this protocol").data();
    }

    static std::pair<std::string, uint16_t> peer_address(const sockaddr_storage& ss) {
        char host[INET6_ADDRSTRLEN] = "?";
        uint16_t port = 0;
        if (ss.ss_family == AF_INET) {
            const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
            ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
            port = ntohs(a->sin_port);
        } else if (ss.ss_family == AF_INET6) {
            const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
            ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
            port = ntohs(a->sin6_port);
        }
        return {host, port};
    }

    Fd listener_;
    uint16_t port_;
    HandshakeInfo info_;
    HandshakeServerOptions opts_;
    std::vector<std::unique_ptr<Conn>> conns_;            // the loop thread's only
    std::unordered_map<std::string, size_t> per_client_;  // the loop thread's only: open ones
    TimePoint accept_paused_until_{};                     // the loop thread's only
    bool accept_failing_ = false;                         // the loop thread's only: warned once
    TimePoint next_log_{};                                // the loop thread's only (note_failure)
    uint64_t held_back_ = 0;                              // the loop thread's only (note_failure)
    std::thread thread_;
    std::atomic<bool> stop_{false};
    std::atomic<uint64_t> served_{0}, auth_failures_{0}, refused_{0};
};

Result<std::unique_ptr<HandshakeServer>> HandshakeServer::start(const std::string& host,
                                                                uint16_t port, HandshakeInfo info,
                                                                HandshakeServerOptions options) {
    if (options.secret.empty())
        return invalid_argument("handshake server: no deployment secret given");
    if (options.max_connections == 0 || options.max_connections_per_client == 0)
        return invalid_argument(
            "handshake server: max_connections and max_connections_per_client must be at least "
            "1");
    if (options.connection_deadline <= Duration::zero() ||
        options.proof_deadline <= Duration::zero())
        return invalid_argument(
            "handshake server: connection_deadline and proof_deadline must be above 0 (every "
            "connection would be closed before its first frame)");
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

}  // namespace ferry::kv

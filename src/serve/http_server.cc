// HttpServer: an HTTP/1.1 server made to survive hostile clients.
//
// One I/O thread owns every connection while its request is read: epoll, non-blocking reads, an
// absolute deadline per phase (headers, body, keep-alive idle) and size limits checked as bytes
// arrive. Only a complete request reaches a worker, which runs the handler and writes the
// response itself; meanwhile the I/O thread keeps watching the connection so that a handler can
// ask client_gone(). Quick routes (/health, /metrics) and answers that need no handler go to
// workers of their own, so long requests holding every worker never queue them. cpp-httplib, used
// before, gave each connection a thread from its pool for the connection's whole life and restarted
// its read timeout on every byte: 200 clients sending a byte every few seconds held all 128 threads
// and /health stopped answering.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <unordered_map>

#include "common/fd.h"
#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"
#include "serve/http.h"

namespace ferry::serve {
namespace {

const char* reason_phrase(int status) {
    switch (status) {
        case 100:
            return "Continue";
        case 102:
            return "Processing";
        case 200:
            return "OK";
        case 400:
            return "Bad Request";
        case 403:
            return "Forbidden";
        case 404:
            return "Not Found";
        case 405:
            return "Method Not Allowed";
        case 408:
            return "Request Timeout";
        case 415:
            return "Unsupported Media Type";
        case 413:
            return "Content Too Large";
        case 429:
            return "Too Many Requests";
        case 431:
            return "Request Header Fields Too Large";
        case 500:
            return "Internal Server Error";
        case 501:
            return "Not Implemented";
        case 502:
            return "Bad Gateway";
        case 503:
            return "Service Unavailable";
        case 504:
            return "Gateway Timeout";
        case 505:
            return "HTTP Version Not Supported";
        default:
            return status < 400 ? "OK" : "Error";
    }
}

// The names Status codes have (status_code_name), as the handlers' own errors carry them.
std::string_view error_type(int status) {
    switch (status) {
        case 403:
            return status_code_name(StatusCode::kPermissionDenied);
        case 404:
            return status_code_name(StatusCode::kNotFound);
        case 408:
        case 504:
            return status_code_name(StatusCode::kTimeout);
        case 499:  // the client went away
            return status_code_name(StatusCode::kCancelled);
        case 413:
        case 429:
        case 431:
            return status_code_name(StatusCode::kResourceExhausted);
        case 502:
        case 503:
            return status_code_name(StatusCode::kUnavailable);
        default:
            return status_code_name(status < 500 ? StatusCode::kInvalidArgument
                                                 : StatusCode::kInternal);
    }
}

}  // namespace

std::string http_error_body(int status, const std::string& message) {
    nlohmann::json j = {
        {"error",
         {{"message", message}, {"type", std::string(error_type(status))}, {"code", status}}}};
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

namespace {

std::string status_line_and_headers(int status, const std::string& content_type,
                                    std::string_view framing, bool keep_alive) {
    return fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\n{}Connection: {}\r\n\r\n", status,
                       reason_phrase(status), content_type, framing,
                       keep_alive ? "keep-alive" : "close");
}

std::string ms_text(Duration d) { return fmt::format("{:.0f} ms", to_ms(d)); }

bool is_tchar(char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("!#$%&'*+-.^_`|~", c);
}

std::string_view trim(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
    return s;
}

bool iequals(std::string_view a, std::string_view b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
        if (std::tolower(static_cast<unsigned char>(a[i])) !=
            std::tolower(static_cast<unsigned char>(b[i])))
            return false;
    return true;
}

// What went wrong with a request before a handler saw it: the status and the message.
struct Refusal {
    int status = 0;
    std::string message;
};

enum class Phase {
    kHeaders,   // reading the request line and headers (or idle between requests)
    kBody,      // reading the body
    kHandling,  // a worker owns the request; the I/O thread only watches for a close
    kDraining,  // an error was answered; unread bytes are discarded until close
};

enum class ChunkState { kSize, kData, kDataEnd, kTrailer };

struct Conn {
    Fd fd;
    std::string peer;      // client address, the per-client cap's key
    bool counted = false;  // holds a place in the connection caps
    Phase phase = Phase::kHeaders;
    bool idle = false;  // between requests of a keep-alive connection, no byte of the next yet
    TimePoint deadline{};
    std::string in;  // read and not yet consumed

    // The request being read.
    HttpRequest req;
    bool http10 = false;
    bool keep_alive = true;
    bool chunked = false;
    size_t content_length = 0;
    ChunkState chunk_state = ChunkState::kSize;
    size_t chunk_left = 0;

    // Shared between the I/O thread and the worker while handling.
    std::shared_ptr<std::atomic<bool>> gone = std::make_shared<std::atomic<bool>>(false);
    std::atomic<bool> peer_shut_write{false};  // FIN seen: no further request will come
    TimePoint next_probe{};                    // I/O thread only; {} = none due
    std::mutex write_mu;                       // orders the probe against the response
    bool response_started = false;             // guarded by write_mu
    bool close_after = false;                  // set by the worker
    bool quick = false;                        // on the quick lane; set before it is queued
    bool queued = false;                       // in its lane's queue; guarded by work_mu
};

using ConnPtr = std::shared_ptr<Conn>;

// Workers fed by one queue, started on demand up to `max`; guarded by Impl::work_mu.
struct Lane {
    const char* thread_name;
    size_t max = 0;
    std::deque<ConnPtr> work{};
    std::vector<std::thread> workers{};
    size_t idle = 0;
    std::condition_variable cv{};
};

}  // namespace

struct HttpServer::Impl {
    HttpServerOptions options;
    // What the operator calls a setting, for answers that name the limit a request ran into.
    std::string named(std::string_view setting) const {
        return setting_name(options.setting_names, setting);
    }
    std::vector<HttpRoute> routes;
    Fd listener, epoll, wake;
    int port = 0;
    std::atomic<bool> stopping{false};
    TimePoint stop_at{};
    std::thread io_thread;

    // I/O thread only.
    std::unordered_map<int, ConnPtr> conns;
    std::unordered_map<std::string, size_t> per_client;
    size_t counted = 0;
    size_t draining_uncounted = 0;
    TimePoint listen_paused_until{};
    TimePoint next_sweep{};

    // Handlers, up to options.threads; quick routes and answers without a handler, up to
    // options.quick_threads.
    std::mutex work_mu;
    Lane handlers{"http-worker"}, quick{"http-quick"};

    // Connections workers are done with, back to the I/O thread.
    std::mutex back_mu;
    std::vector<ConnPtr> back;

    void io_loop();
    void accept_all();
    void on_event(const ConnPtr& c, uint32_t events);
    void probe(Conn& c);
    void feed(const ConnPtr& c, const char* data, size_t n);
    void parse_chunks(const ConnPtr& c);
    std::optional<Refusal> parse_head(Conn& c, std::string_view head);
    bool is_quick(const HttpRequest& req) const;
    void dispatch(const ConnPtr& c);
    bool unqueue(Conn& c);
    void refuse(const ConnPtr& c, int status, const std::string& message);
    void close_conn(const ConnPtr& c);
    void on_back(const ConnPtr& c);
    void sweep(TimePoint now);
    void watch(const Conn& c, uint32_t events);
    void wake_io();

    void worker_loop(Lane& lane);
    void serve(const ConnPtr& c);
    bool write_all(Conn& c, std::string_view data, TimePoint deadline);
};

// ---- I/O thread --------------------------------------------------------------------------------

void HttpServer::Impl::wake_io() {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake.get(), &one, sizeof one);
}

void HttpServer::Impl::watch(const Conn& c, uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.fd = c.fd.get();
    ::epoll_ctl(epoll.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
}

void HttpServer::Impl::io_loop() {
    set_thread_name("http-io");
    std::vector<epoll_event> events(256);
    while (!stopping.load()) {
        TimePoint now = Clock::now();
        int wait_ms = 100;
        if (next_sweep > now)
            wait_ms = std::min<int>(wait_ms, int(to_ms(next_sweep - now)) + 1);
        else
            wait_ms = 0;
        int n = ::epoll_wait(epoll.get(), events.data(), int(events.size()), wait_ms);
        if (n < 0 && errno != EINTR) {
            log_line(LogLevel::kError, "http",
                     fmt::format("epoll_wait failed: {}", strerror(errno)));
            return;
        }
        for (int i = 0; i < n; ++i) {
            int fd = events[i].data.fd;
            if (fd == listener.get()) {
                accept_all();
            } else if (fd == wake.get()) {
                uint64_t v;
                [[maybe_unused]] ssize_t r = ::read(wake.get(), &v, sizeof v);
                std::vector<ConnPtr> done;
                {
                    std::lock_guard lock(back_mu);
                    done.swap(back);
                }
                for (const ConnPtr& c : done) on_back(c);
            } else if (auto it = conns.find(fd); it != conns.end()) {
                ConnPtr c = it->second;  // on_event may erase it
                on_event(c, events[i].events);
            }
        }
        now = Clock::now();
        if (now >= next_sweep) sweep(now);
    }
}

void HttpServer::Impl::sweep(TimePoint now) {
    TimePoint next = now + milliseconds(100);
    std::vector<ConnPtr> expired;
    for (auto& [fd, c] : conns) {
        if (c->phase == Phase::kHandling && c->deadline <= now && unqueue(*c)) {
            expired.push_back(c);
            continue;
        }
        if (c->phase == Phase::kHandling) {
            if (c->deadline != TimePoint::max()) next = std::min(next, c->deadline);
            if (c->next_probe == TimePoint{} || c->next_probe == TimePoint::max() ||
                c->gone->load())
                continue;
            if (c->next_probe <= now) probe(*c);
            next = std::min(next, c->next_probe);
            continue;
        }
        if (c->deadline <= now)
            expired.push_back(c);
        else
            next = std::min(next, c->deadline);
    }
    for (const ConnPtr& c : expired) {
        if (c->phase == Phase::kHandling && c->gone->load())
            close_conn(c);
        else if (c->phase == Phase::kHandling)
            refuse(
                c, 503,
                fmt::format("no worker became free within {}: all {} are busy ({}; {}); "
                            "retry later",
                            ms_text(options.queue_timeout),
                            c->quick ? options.quick_threads : options.threads,
                            named("queue_timeout"), named(c->quick ? "quick_threads" : "threads")));
        else if (c->phase == Phase::kDraining || (c->phase == Phase::kHeaders && c->idle))
            close_conn(c);
        else if (c->phase == Phase::kHeaders)
            refuse(c, 408,
                   fmt::format("request headers not complete within {} ({})",
                               ms_text(options.header_timeout), named("header_timeout")));
        else
            refuse(c, 408,
                   fmt::format("request body not complete within {} ({})",
                               ms_text(options.body_timeout), named("body_timeout")));
    }
    if (listen_paused_until != TimePoint{}) {
        if (now >= listen_paused_until) {
            listen_paused_until = {};
            epoll_event ev{};
            ev.events = EPOLLIN;
            ev.data.fd = listener.get();
            ::epoll_ctl(epoll.get(), EPOLL_CTL_MOD, listener.get(), &ev);
        } else {
            next = std::min(next, listen_paused_until);
        }
    }
    // Deadlines are checked at least every 10 ms apart, so that a thousand connections each
    // sending a byte do not make every wakeup walk all of them.
    next_sweep = std::max(next, now + milliseconds(10));
}

void HttpServer::Impl::accept_all() {
    for (int i = 0; i < 64; ++i) {
        sockaddr_storage addr{};
        socklen_t len = sizeof addr;
        int fd = ::accept4(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                // Out of descriptors: stop polling the listener for a while rather than spin
                // on a connection that cannot be taken.
                log_line(
                    LogLevel::kWarn, "http",
                    fmt::format("accept failed ({}); pausing accepts for 100 ms", strerror(errno)));
                epoll_event ev{};
                ev.data.fd = listener.get();
                ::epoll_ctl(epoll.get(), EPOLL_CTL_MOD, listener.get(), &ev);
                listen_paused_until = Clock::now() + milliseconds(100);
                next_sweep = std::min(next_sweep, listen_paused_until);
            }
            return;
        }
        auto c = std::make_shared<Conn>();
        c->fd = Fd(fd);
        char host[INET6_ADDRSTRLEN] = "?";
        if (addr.ss_family == AF_INET)
            ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&addr)->sin_addr, host,
                        sizeof host);
        else if (addr.ss_family == AF_INET6)
            ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr, host,
                        sizeof host);
        c->peer = host;
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        epoll_event ev{};
        ev.events = EPOLLIN | EPOLLRDHUP;
        ev.data.fd = fd;
        if (::epoll_ctl(epoll.get(), EPOLL_CTL_ADD, fd, &ev) != 0) continue;
        conns[fd] = c;
        c->deadline = Clock::now() + options.header_timeout;
        next_sweep = std::min(next_sweep, c->deadline);
        size_t& mine = per_client[c->peer];
        if (counted >= options.max_connections) {
            refuse(c, 503,
                   fmt::format("the server has its limit of {} open connections ({}); retry "
                               "later",
                               options.max_connections, named("max_connections")));
        } else if (mine >= options.max_connections_per_client) {
            refuse(c, 429,
                   fmt::format("{} has its limit of {} open connections to this server ({}); "
                               "close some or reuse them (keep-alive)",
                               c->peer, options.max_connections_per_client,
                               named("max_connections_per_client")));
        } else {
            c->counted = true;
            ++mine;
            ++counted;
        }
        if (mine == 0) per_client.erase(c->peer);
    }
}

void HttpServer::Impl::close_conn(const ConnPtr& c) {
    if (c->counted) {
        auto it = per_client.find(c->peer);
        if (it != per_client.end() && --it->second == 0) per_client.erase(it);
        --counted;
        c->counted = false;
    } else if (c->phase == Phase::kDraining) {
        --draining_uncounted;
    }
    ::epoll_ctl(epoll.get(), EPOLL_CTL_DEL, c->fd.get(), nullptr);
    conns.erase(c->fd.get());
    c->fd.reset();
}

// Answers an error from the I/O thread and closes: the response goes out at once (it is small
// and the socket buffer empty), then the connection drains what the client still sends for a
// moment, so that closing with unread bytes does not reset the connection under the response.
void HttpServer::Impl::refuse(const ConnPtr& c, int status, const std::string& message) {
    std::string body = http_error_body(status, message);
    std::string out =
        status_line_and_headers(status, "application/json",
                                fmt::format("Content-Length: {}\r\n", body.size()), false) +
        body;
    [[maybe_unused]] ssize_t n =
        ::send(c->fd.get(), out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    ::shutdown(c->fd.get(), SHUT_WR);
    c->in = std::string();
    c->req = HttpRequest{};
    if (!c->counted) {
        // Refused at accept: the drain is a courtesy, skipped under a flood.
        if (draining_uncounted >= 1024) {
            c->phase = Phase::kDraining;
            ++draining_uncounted;
            return close_conn(c);
        }
        ++draining_uncounted;
    }
    c->phase = Phase::kDraining;
    c->deadline = Clock::now() + milliseconds(1000);
    watch(*c, EPOLLIN | EPOLLRDHUP);
}

// A client that shut its sending side and then closed sends nothing more: it is probed again
// every kReprobe while its handler runs, so that such a close is seen within that.
constexpr Duration kReprobe = milliseconds(250);

void HttpServer::Impl::probe(Conn& c) {
    c.next_probe = Clock::now() + kReprobe;
    next_sweep = std::min(next_sweep, c.next_probe);
    std::unique_lock lock(c.write_mu, std::try_to_lock);
    if (!lock.owns_lock() || c.response_started) {
        c.next_probe = TimePoint::max();  // the response's own writes will tell
        return;
    }
    static constexpr std::string_view kProbe = "HTTP/1.1 102 Processing\r\n\r\n";
    if (::send(c.fd.get(), kProbe.data(), kProbe.size(), MSG_NOSIGNAL | MSG_DONTWAIT) < 0 &&
        errno != EAGAIN && errno != EWOULDBLOCK)
        c.gone->store(true);
}

void HttpServer::Impl::on_event(const ConnPtr& c, uint32_t events) {
    if (c->phase == Phase::kHandling) {
        if (events & (EPOLLERR | EPOLLHUP)) {
            c->gone->store(true);
            return;
        }
        if (!(events & EPOLLRDHUP)) return;
        c->peer_shut_write = true;
        // The client shut its sending side: either a half-close (it still reads) or a full
        // close. Only sending tells them apart: a closed socket answers data with a reset,
        // which comes back as EPOLLERR. An interim 1xx is the one thing a server may send
        // before its response (RFC 9110 15.2: clients must accept one they did not expect);
        // HTTP/1.0 clients may not get one, so for them the close stays unknown.
        if (c->http10 || c->next_probe != TimePoint{}) return;
        probe(*c);
        return;
    }
    char buf[64 << 10];
    // Bounded per wakeup so that one fast sender does not starve the others.
    for (int round = 0; round < 16; ++round) {
        if (c->phase == Phase::kHandling || c->fd.get() < 0) return;
        ssize_t n = ::recv(c->fd.get(), buf, sizeof buf, 0);
        if (n > 0) {
            if (c->phase == Phase::kDraining) continue;
            feed(c, buf, size_t(n));
            if (c->fd.get() < 0) return;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (n < 0 && errno == EINTR) continue;
        // End of stream part way through a request: the client shut its sending side and may
        // still read (a Content-Length larger than the body it sent got no answer at all).
        if (n == 0 && c->phase == Phase::kBody)
            return refuse(c, 400,
                          c->chunked ? std::string("the request ended before the last chunk of "
                                                   "its chunked body")
                                     : fmt::format("the request ended after {} of the {} body "
                                                   "bytes its Content-Length announced",
                                                   c->req.body.size(), c->content_length));
        if (n == 0 && c->phase == Phase::kHeaders && !c->in.empty())
            return refuse(c, 400, "the request ended before the blank line that ends its headers");
        // Otherwise (an idle connection closed, an error): nobody to answer.
        return close_conn(c);
    }
}

void HttpServer::Impl::feed(const ConnPtr& c, const char* data, size_t n) {
    if (c->phase == Phase::kHeaders) {
        if (c->idle) {
            c->idle = false;
            c->deadline = Clock::now() + options.header_timeout;
        }
        size_t before = c->in.size();
        c->in.append(data, n);
        // Blank lines before a request line are allowed (RFC 9112 2.2).
        if (before == 0) {
            size_t skip = 0;
            while (skip < c->in.size() && (c->in[skip] == '\r' || c->in[skip] == '\n')) ++skip;
            c->in.erase(0, skip);
            before = 0;
        }
        size_t from = before >= 3 ? before - 3 : 0;
        size_t end = c->in.find("\r\n\r\n", from);
        if (end == std::string::npos) {
            // A blank line of bare LFs (`printf 'GET / HTTP/1.1\n\n' | nc`) ends nothing here:
            // the client waited for the header deadline and got 408 for a slow request.
            if (c->in.find("\n\n", from) != std::string::npos)
                return refuse(c, 400, "request lines end with CRLF (\\r\\n), not a bare LF (\\n)");
            if (c->in.size() > options.max_header_bytes)
                refuse(c, 431,
                       fmt::format("request line and headers exceed the limit of {} bytes",
                                   options.max_header_bytes));
            return;
        }
        if (end + 4 > options.max_header_bytes)
            return refuse(c, 431,
                          fmt::format("request line and headers exceed the limit of {} bytes",
                                      options.max_header_bytes));
        if (auto bad = parse_head(*c, std::string_view(c->in).substr(0, end + 2)))
            return refuse(c, bad->status, bad->message);
        std::string rest = c->in.substr(end + 4);
        c->in.clear();
        if (!c->chunked && c->content_length == 0) {
            c->in = std::move(rest);
            return dispatch(c);
        }
        c->phase = Phase::kBody;
        c->deadline = Clock::now() + options.body_timeout;
        if (!c->chunked) c->req.body.reserve(c->content_length);
        if (!rest.empty()) feed(c, rest.data(), rest.size());
        return;
    }
    if (c->phase != Phase::kBody) return;
    if (c->chunked) {
        c->in.append(data, n);
        return parse_chunks(c);
    }
    size_t take = std::min(n, c->content_length - c->req.body.size());
    c->req.body.append(data, take);
    if (take < n) c->in.append(data + take, n - take);  // the next request, pipelined
    if (c->req.body.size() == c->content_length) dispatch(c);
}

void HttpServer::Impl::parse_chunks(const ConnPtr& c) {
    std::string& in = c->in;
    size_t pos = 0;
    auto too_large = [&] {
        refuse(c, 413,
               fmt::format("chunked request body grew past the limit of {} bytes ({})",
                           options.max_body_bytes, named("max_body_bytes")));
    };
    while (true) {
        if (c->chunk_state == ChunkState::kData) {
            size_t take = std::min(c->chunk_left, in.size() - pos);
            c->req.body.append(in, pos, take);
            pos += take;
            c->chunk_left -= take;
            if (c->chunk_left > 0) break;
            c->chunk_state = ChunkState::kDataEnd;
            continue;
        }
        if (c->chunk_state == ChunkState::kDataEnd) {
            if (in.size() - pos < 2) break;
            if (in.compare(pos, 2, "\r\n") != 0)
                return refuse(c, 400, "chunked request body: a chunk does not end with CRLF");
            pos += 2;
            c->chunk_state = ChunkState::kSize;
            continue;
        }
        size_t eol = in.find("\r\n", pos);
        if (eol == std::string::npos) {
            if (in.size() - pos > 1024)
                return refuse(c, 400, "chunked request body: a chunk-size line over 1024 bytes");
            break;
        }
        std::string_view line(in.data() + pos, eol - pos);
        pos = eol + 2;
        if (c->chunk_state == ChunkState::kTrailer) {
            if (line.empty()) {
                in.erase(0, pos);
                return dispatch(c);
            }
            continue;  // trailer fields are ignored
        }
        std::string_view hex = trim(line.substr(0, line.find(';')));
        size_t size = 0;
        bool valid = !hex.empty() && hex.size() <= 15;
        for (char ch : hex) {
            int d = std::isdigit(static_cast<unsigned char>(ch)) ? ch - '0'
                    : (ch >= 'a' && ch <= 'f')                   ? ch - 'a' + 10
                    : (ch >= 'A' && ch <= 'F')                   ? ch - 'A' + 10
                                                                 : -1;
            if (d < 0) valid = false;
            size = size * 16 + size_t(d < 0 ? 0 : d);
        }
        if (!valid)
            return refuse(c, 400,
                          fmt::format("chunked request body: invalid chunk size '{}'",
                                      std::string(line.substr(0, 40))));
        if (size == 0) {
            c->chunk_state = ChunkState::kTrailer;
            continue;
        }
        if (size > options.max_body_bytes - c->req.body.size()) return too_large();
        c->chunk_left = size;
        c->chunk_state = ChunkState::kData;
    }
    in.erase(0, pos);
    // Trailers are bounded as headers are.
    if (c->chunk_state == ChunkState::kTrailer && in.size() > options.max_header_bytes)
        refuse(c, 431, "chunked request body: trailer fields too large");
}

std::optional<Refusal> HttpServer::Impl::parse_head(Conn& c, std::string_view head) {
    size_t eol = head.find("\r\n");
    std::string_view line = head.substr(0, eol);
    size_t sp1 = line.find(' ');
    size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    if (sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos)
        return Refusal{400, fmt::format("malformed request line '{}': expected METHOD PATH "
                                        "HTTP/1.1",
                                        std::string(line.substr(0, 80)))};
    std::string_view method = line.substr(0, sp1);
    std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
    std::string_view version = line.substr(sp2 + 1);
    bool method_ok = !method.empty();
    for (char ch : method) method_ok = method_ok && is_tchar(ch);
    if (!method_ok || target.empty() || target[0] != '/')
        return Refusal{400, fmt::format("malformed request line '{}': expected METHOD PATH "
                                        "HTTP/1.1",
                                        std::string(line.substr(0, 80)))};
    for (char ch : target)
        if (static_cast<unsigned char>(ch) <= 0x20 || ch == 0x7f)
            return Refusal{400, "malformed request target: control characters"};
    if (version == "HTTP/1.0") {
        c.http10 = true;
        c.keep_alive = false;
    } else if (version != "HTTP/1.1") {
        if (version.starts_with("HTTP/") && version.size() == 8)
            return Refusal{505, fmt::format("HTTP version {} not supported: send HTTP/1.1",
                                            std::string(version))};
        return Refusal{400, fmt::format("malformed request line '{}': expected METHOD PATH "
                                        "HTTP/1.1",
                                        std::string(line.substr(0, 80)))};
    }
    c.req.method = std::string(method);
    c.req.path = std::string(target.substr(0, target.find('?')));

    std::optional<size_t> length;
    bool has_te = false;
    bool expect_continue = false;
    size_t pos = eol + 2;
    while (pos < head.size()) {
        size_t e = head.find("\r\n", pos);
        std::string_view h = head.substr(pos, e - pos);
        pos = e + 2;
        if (h.front() == ' ' || h.front() == '\t')
            return Refusal{400,
                           "header line folding (a line starting with a space) is not "
                           "allowed"};
        size_t colon = h.find(':');
        std::string_view name = h.substr(0, colon);
        bool name_ok = colon != std::string_view::npos && !name.empty();
        for (char ch : name) name_ok = name_ok && is_tchar(ch);
        if (!name_ok)
            return Refusal{400,
                           fmt::format("malformed header line '{}'", std::string(h.substr(0, 80)))};
        std::string_view value = trim(h.substr(colon + 1));
        for (char ch : value)
            if ((static_cast<unsigned char>(ch) < 0x20 && ch != '\t') || ch == 0x7f)
                return Refusal{
                    400, fmt::format("header {} holds control characters", std::string(name))};
        if (iequals(name, "Content-Length")) {
            // A list ("5, 5") is allowed when all agree (RFC 9110 8.6); values that differ
            // would let two parsers disagree on where the body ends.
            std::string_view rest = value;
            while (true) {
                size_t comma = rest.find(',');
                std::string_view v = trim(rest.substr(0, comma));
                bool digits = !v.empty() && v.size() <= 18;
                for (char ch : v) digits = digits && std::isdigit(static_cast<unsigned char>(ch));
                if (!digits)
                    return Refusal{400, fmt::format("invalid Content-Length '{}': expected a "
                                                    "non-negative decimal byte count",
                                                    std::string(value.substr(0, 40)))};
                size_t n = std::stoull(std::string(v));
                if (length && *length != n)
                    return Refusal{400, fmt::format("conflicting Content-Length values {} and {}",
                                                    *length, n)};
                length = n;
                if (comma == std::string_view::npos) break;
                rest = rest.substr(comma + 1);
            }
        } else if (iequals(name, "Transfer-Encoding")) {
            if (!iequals(value, "chunked"))
                return Refusal{501, fmt::format("Transfer-Encoding '{}' not supported: send "
                                                "chunked or a Content-Length",
                                                std::string(value.substr(0, 40)))};
            has_te = true;
        } else if (iequals(name, "Content-Type")) {
            c.req.content_type = std::string(value);
        } else if (iequals(name, "Connection")) {
            if (iequals(value, "close")) c.keep_alive = false;
        } else if (iequals(name, "Expect")) {
            expect_continue = iequals(value, "100-continue");
        }
    }
    if (has_te && c.http10) return Refusal{400, "Transfer-Encoding in an HTTP/1.0 request"};
    if (has_te && length)
        return Refusal{400, "both Content-Length and Transfer-Encoding: send one"};
    c.chunked = has_te;
    c.content_length = length.value_or(0);
    if (c.content_length > options.max_body_bytes)
        return Refusal{
            413, fmt::format("request body of {} bytes is larger than the limit of {} "
                             "bytes ({})",
                             c.content_length, options.max_body_bytes, named("max_body_bytes"))};
    if (expect_continue && !c.http10 && (c.chunked || c.content_length > 0)) {
        static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
        [[maybe_unused]] ssize_t n =
            ::send(c.fd.get(), kContinue.data(), kContinue.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    return std::nullopt;
}

// Takes a request whose queue_timeout passed out of the queue: true if no worker had it yet.
// Once a worker has it, its deadline is dropped (the handler's own deadlines apply).
bool HttpServer::Impl::unqueue(Conn& c) {
    std::lock_guard lock(work_mu);
    if (!c.queued) {
        c.deadline = TimePoint::max();
        return false;
    }
    c.queued = false;
    std::erase_if((c.quick ? quick : handlers).work,
                  [&](const ConnPtr& w) { return w.get() == &c; });
    return true;
}

// A quick route, or a request no handler answers (404, 405).
bool HttpServer::Impl::is_quick(const HttpRequest& req) const {
    for (const HttpRoute& r : routes)
        if (r.path == req.path && r.method == req.method) return r.quick;
    return true;
}

void HttpServer::Impl::dispatch(const ConnPtr& c) {
    c->phase = Phase::kHandling;
    c->quick = is_quick(c->req);
    Lane& lane = c->quick ? quick : handlers;
    c->deadline = Clock::now() + options.queue_timeout;
    next_sweep = std::min(next_sweep, c->deadline);
    // Only a close matters now; edge-triggered so that bytes of a pipelined next request,
    // left unread until this one is answered, do not wake the loop again and again.
    watch(*c, EPOLLRDHUP | EPOLLET);
    {
        std::lock_guard lock(work_mu);
        c->queued = true;
        lane.work.push_back(c);
        // Each idle worker takes one request; any beyond them needs a new worker.
        if (lane.work.size() > lane.idle && lane.workers.size() < lane.max)
            lane.workers.emplace_back([this, &lane] { worker_loop(lane); });
    }
    lane.cv.notify_one();
}

void HttpServer::Impl::on_back(const ConnPtr& c) {
    if (c->fd.get() < 0) return;
    if (c->close_after || stopping.load()) return close_conn(c);
    std::string pipelined = std::move(c->in);
    c->in.clear();
    c->req = HttpRequest{};
    c->http10 = false;
    c->keep_alive = true;
    c->chunked = false;
    c->content_length = 0;
    c->chunk_state = ChunkState::kSize;
    c->chunk_left = 0;
    c->gone = std::make_shared<std::atomic<bool>>(false);
    c->next_probe = TimePoint{};
    c->response_started = false;
    c->phase = Phase::kHeaders;
    c->idle = true;
    c->deadline = Clock::now() + options.idle_timeout;
    next_sweep = std::min(next_sweep, c->deadline);
    watch(*c, EPOLLIN | EPOLLRDHUP);
    if (!pipelined.empty()) feed(c, pipelined.data(), pipelined.size());
}

// ---- workers -----------------------------------------------------------------------------------

void HttpServer::Impl::worker_loop(Lane& lane) {
    set_thread_name(lane.thread_name);
    while (true) {
        ConnPtr c;
        {
            std::unique_lock lock(work_mu);
            ++lane.idle;
            lane.cv.wait(lock, [&] { return stopping.load() || !lane.work.empty(); });
            --lane.idle;
            if (stopping.load()) return;  // requests not started are dropped with their conns
            c = std::move(lane.work.front());
            lane.work.pop_front();
            c->queued = false;
        }
        serve(c);
        {
            std::lock_guard lock(back_mu);
            back.push_back(std::move(c));
        }
        wake_io();
    }
}

bool HttpServer::Impl::write_all(Conn& c, std::string_view data, TimePoint deadline) {
    std::lock_guard lock(c.write_mu);
    c.response_started = true;
    while (!data.empty()) {
        ssize_t n = ::send(c.fd.get(), data.data(), data.size(), MSG_NOSIGNAL);
        if (n > 0) {
            data.remove_prefix(size_t(n));
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            TimePoint now = Clock::now();
            // A stopping server gives a slow reader one more second, not write_timeout.
            if (stopping.load()) deadline = std::min(deadline, stop_at + seconds(1));
            if (now >= deadline) return false;
            pollfd p{c.fd.get(), POLLOUT, 0};
            ::poll(&p, 1, std::max(1, std::min(100, int(to_ms(deadline - now)))));
            continue;
        }
        c.gone->store(true);  // EPIPE, ECONNRESET: the client closed
        return false;
    }
    return true;
}

namespace {

// Every POST route takes a JSON body. A body sent as another media type (text, multipart) is
// refused rather than guessed at; a body without a Content-Type is taken as JSON, and so is
// a form's type: `curl -d '{...}'` sends JSON under it, and a body that is not JSON still
// gets a 400 from the handler's parser.
bool json_media_type(std::string_view content_type) {
    std::string_view type = trim(content_type.substr(0, content_type.find(';')));
    if (type.empty()) return true;
    if (iequals(type, "application/json")) return true;
    if (iequals(type, "application/x-www-form-urlencoded")) return true;
    size_t slash = type.find('/');
    return slash != std::string_view::npos && iequals(type.substr(0, slash), "application") &&
           type.size() >= 5 && iequals(type.substr(type.size() - 5), "+json");
}

}  // namespace

void HttpServer::Impl::serve(const ConnPtr& c) {
    HttpRequest req = std::move(c->req);
    c->req = HttpRequest{};
    req.client_gone = [gone = c->gone] { return gone->load(); };
    HttpReply reply;
    const HttpRoute* route = nullptr;
    std::string allowed;  // methods the path has, for a 405
    for (const HttpRoute& r : routes) {
        if (r.path != req.path) continue;
        if (r.method == req.method) route = &r;
        allowed += (allowed.empty() ? "" : ", ") + r.method;
    }
    std::string extra_headers;
    auto fail = [&](int status, std::string message) {
        reply = HttpReply{};
        reply.status = status;
        reply.body = http_error_body(status, message);
    };
    if (route == nullptr && allowed.empty()) {
        fail(404, fmt::format("no route {} {}", req.method, req.path));
    } else if (route == nullptr) {
        fail(405,
             fmt::format("method {} not allowed on {}: use {}", req.method, req.path, allowed));
        extra_headers = fmt::format("Allow: {}\r\n", allowed);
    } else if (route->method == "POST" && !json_media_type(req.content_type)) {
        fail(415, fmt::format("Content-Type '{}' not supported on POST {}: send the body as "
                              "application/json",
                              req.content_type.substr(0, 80), req.path));
    } else {
        try {
            route->handler(req, reply);
        } catch (const std::exception& e) {
            fail(500,
                 fmt::format("the handler of {} {} failed: {}", req.method, req.path, e.what()));
        } catch (...) {
            fail(500, fmt::format("the handler of {} {} failed with an unknown exception",
                                  req.method, req.path));
        }
    }
    bool keep = c->keep_alive && !stopping.load();
    const Duration write_timeout = c->quick ? options.quick_write_timeout : options.write_timeout;
    if (!reply.stream) {
        std::string out = status_line_and_headers(
            reply.status, reply.content_type,
            extra_headers + fmt::format("Content-Length: {}\r\n", reply.body.size()), keep);
        out += reply.body;
        bool ok = write_all(*c, out, Clock::now() + write_timeout);
        c->close_after = !ok || !keep || c->peer_shut_write.load() || c->gone->load();
        return;
    }
    // HTTP/1.0 has no chunked encoding: the end of the connection ends the body.
    bool chunked = !c->http10;
    std::string framing = "Cache-Control: no-cache\r\n";
    if (chunked) framing += "Transfer-Encoding: chunked\r\n";
    bool ok = write_all(
        *c, status_line_and_headers(reply.status, reply.content_type, framing, keep && chunked),
        Clock::now() + write_timeout);
    ChunkWriter write = [&](std::string_view chunk) {
        if (!ok) return false;
        if (chunk.empty()) return !c->gone->load();  // an empty chunk would end the body
        std::string framed =
            chunked ? fmt::format("{:x}\r\n{}\r\n", chunk.size(), chunk) : std::string(chunk);
        ok = write_all(*c, framed, Clock::now() + write_timeout);
        return ok;
    };
    if (ok) {
        try {
            reply.stream(write);
        } catch (const std::exception& e) {
            log_line(LogLevel::kError, "http",
                     fmt::format("stream of {} {} failed: {}; closing it", req.method, req.path,
                                 e.what()));
            ok = false;  // the client sees a body without its end, not a clean one
        } catch (...) {
            log_line(LogLevel::kError, "http",
                     fmt::format("stream of {} {} failed; closing it", req.method, req.path));
            ok = false;
        }
    }
    if (ok && chunked) ok = write_all(*c, "0\r\n\r\n", Clock::now() + write_timeout);
    c->close_after = !ok || !keep || !chunked || c->peer_shut_write.load() || c->gone->load();
}

// ---- HttpServer --------------------------------------------------------------------------------

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { stop(); }

int HttpServer::port() const { return impl_->port; }

bool HttpServer::stopping() const { return impl_->stopping.load(); }

namespace {

using AddrInfo = std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)>;

Result<AddrInfo> resolve(const std::string& host, int port, int flags) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = flags;
    addrinfo* res = nullptr;
    if (host.empty()) return invalid_argument("the host is empty: give an address or a name");
    const std::string port_text = std::to_string(port);
    if (int rc = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res); rc != 0)
        return invalid_argument(
            fmt::format("'{}' is neither an IP address nor a name this machine resolves ({})", host,
                        gai_strerror(rc)));
    return AddrInfo(res, &::freeaddrinfo);
}

}  // namespace

Status check_host_resolves(const std::string& host) { return resolve(host, 0, 0).status(); }

Status check_listen_host(const std::string& host) {
    FERRY_ASSIGN_OR_RETURN(AddrInfo res, resolve(host, 0, AI_PASSIVE));
    // Port 0: the address alone is tested, not the port (in use or not).
    Fd fd(::socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol));
    if (fd.get() < 0)
        return unavailable(
            fmt::format("cannot create a socket for '{}': {}", host, strerror(errno)));
    if (::bind(fd.get(), res->ai_addr, res->ai_addrlen) != 0)
        return invalid_argument(
            fmt::format("'{}' is not an address of this machine: {}", host, strerror(errno)));
    return ok_status();
}

Result<std::unique_ptr<HttpServer>> HttpServer::start(HttpServerOptions options,
                                                      std::vector<HttpRoute> routes) {
    for (const HttpRoute& r : routes)
        if (r.method != "GET" && r.method != "POST")
            return invalid_argument("HTTP routes are GET or POST, not " + r.method);
    if (options.max_connections == 0 || options.max_connections_per_client == 0)
        return invalid_argument("max_connections and max_connections_per_client must be >= 1");
    if (options.queue_timeout <= Duration::zero())
        return invalid_argument("queue_timeout must be above 0 (every request would get 503)");
    for (size_t n : {options.threads, options.quick_threads})
        if (n > kMaxHttpThreads)
            return invalid_argument(fmt::format(
                "{} HTTP threads asked for, at most {} (each is a thread)", n, kMaxHttpThreads));
    options.threads = std::max<size_t>(options.threads, 1);
    options.quick_threads = std::max<size_t>(options.quick_threads, 1);
    // Each connection is a descriptor: a cap above the process's limit would turn into failed
    // accepts instead of a clear 503.
    rlimit lim{};
    if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY &&
        lim.rlim_cur > 128 && options.max_connections > lim.rlim_cur - 128) {
        log_line(LogLevel::kWarn, "http",
                 fmt::format("{} {} lowered to {}: the process may open {} files (ulimit -n)",
                             setting_name(options.setting_names, "max_connections"),
                             options.max_connections, lim.rlim_cur - 128, lim.rlim_cur));
        options.max_connections = lim.rlim_cur - 128;
    }
    auto impl = std::make_unique<Impl>();
    impl->options = options;
    impl->routes = std::move(routes);
    impl->handlers.max = options.threads;
    impl->quick.max = options.quick_threads;

    FERRY_ASSIGN_OR_RETURN(AddrInfo guard, resolve(options.host, options.port, AI_PASSIVE));
    const addrinfo* res = guard.get();
    Fd fd(::socket(res->ai_family, res->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                   res->ai_protocol));
    if (fd.get() < 0)
        return unavailable(fmt::format("cannot create an HTTP socket: {}", strerror(errno)));
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), res->ai_addr, res->ai_addrlen) != 0)
        return unavailable(fmt::format("cannot bind {}:{}: {} (in use? pick another {})",
                                       options.host, options.port, strerror(errno),
                                       setting_name(options.setting_names, "port")));
    // A full backlog loses SYNs and the client retries only after a second.
    if (::listen(fd.get(), SOMAXCONN) != 0)
        return unavailable(
            fmt::format("cannot listen on {}:{}: {}", options.host, options.port, strerror(errno)));
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
    impl->port = bound.ss_family == AF_INET6
                     ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                     : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    impl->listener = std::move(fd);
    impl->epoll = Fd(::epoll_create1(EPOLL_CLOEXEC));
    impl->wake = Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (impl->epoll.get() < 0 || impl->wake.get() < 0)
        return unavailable(fmt::format("cannot create the HTTP event loop: {}", strerror(errno)));
    for (int f : {impl->listener.get(), impl->wake.get()}) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.fd = f;
        ::epoll_ctl(impl->epoll.get(), EPOLL_CTL_ADD, f, &ev);
    }
    Impl* p = impl.get();
    p->io_thread = std::thread([p] { p->io_loop(); });
    return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

void HttpServer::stop() {
    if (!impl_ || impl_->stopping.exchange(true)) return;
    impl_->stop_at = Clock::now();
    impl_->wake_io();
    if (impl_->io_thread.joinable()) impl_->io_thread.join();
    {
        std::lock_guard lock(impl_->work_mu);  // no worker between its check and its wait
    }
    // Handlers see stopping() and return; streams end within their 200 ms wait slices.
    for (Lane* lane : {&impl_->handlers, &impl_->quick}) lane->cv.notify_all();
    for (Lane* lane : {&impl_->handlers, &impl_->quick}) {
        for (std::thread& t : lane->workers) t.join();
        lane->workers.clear();
        lane->work.clear();
    }
    impl_->back.clear();
    impl_->conns.clear();
    impl_->listener.reset();
}

}  // namespace ferry::serve

// The HTTP clients (the server is http_server.cc), on cpp-httplib.
#include "serve/http.h"

#include <fmt/format.h>
#include <httplib.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <time.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "ferry/common/log.h"

namespace ferry::serve {

// ---- clients -----------------------------------------------------------------------------------

namespace {

// Debian's cpp-httplib is built with CPPHTTPLIB_SEND_FLAGS 0: its client writes without
// MSG_NOSIGNAL, so sending a body to a peer that just died raises SIGPIPE, whose default action
// ends the whole process silently (seen: a router killed while relaying a leg to a decode engine
// SIGKILLed under load). Each client call blocks SIGPIPE on its own thread and drops one that
// became pending meanwhile; the failed write then surfaces as the call's error. The process's
// signal dispositions are left alone.
class SigpipeBlocked {
  public:
    SigpipeBlocked() {
        sigemptyset(&pipe_);
        sigaddset(&pipe_, SIGPIPE);
        sigset_t pending;
        sigpending(&pending);
        was_pending_ = sigismember(&pending, SIGPIPE) == 1;
        blocked_ = pthread_sigmask(SIG_BLOCK, &pipe_, &old_) == 0;
    }
    ~SigpipeBlocked() {
        if (!blocked_) return;
        sigset_t pending;
        sigpending(&pending);
        if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
            timespec zero{0, 0};
            while (sigtimedwait(&pipe_, nullptr, &zero) < 0 && errno == EINTR) {
            }
        }
        pthread_sigmask(SIG_SETMASK, &old_, nullptr);
    }
    SigpipeBlocked(const SigpipeBlocked&) = delete;
    SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;

  private:
    sigset_t pipe_{};
    sigset_t old_{};
    bool was_pending_ = false;
    bool blocked_ = false;
};

std::unique_ptr<httplib::Client> client_for(const std::string& host, int port, Duration timeout) {
    auto c = std::make_unique<httplib::Client>(host, port);
    auto us = std::chrono::duration_cast<std::chrono::microseconds>(timeout);
    c->set_connection_timeout(us);
    c->set_read_timeout(us);
    c->set_write_timeout(us);
    return c;
}

Status transport_error(const std::string& host, int port, const std::string& path,
                       httplib::Error err) {
    std::string what = httplib::to_string(err);
    if (err == httplib::Error::Connection) what = "cannot connect (is the server up?)";
    if (err == httplib::Error::Read) what = "connection closed or read timed out";
    return unavailable(fmt::format("HTTP {}:{}{} failed: {}", host, port, path, what));
}

}  // namespace

Result<HttpResponse> http_get(const std::string& host, int port, const std::string& path,
                              Duration timeout) {
    SigpipeBlocked no_sigpipe;
    auto c = client_for(host, port, timeout);
    auto r = c->Get(path);
    if (!r) return transport_error(host, port, path, r.error());
    return HttpResponse{r->status, r->body};
}

Result<HttpResponse> http_post_json(const std::string& host, int port, const std::string& path,
                                    const std::string& body, Duration timeout) {
    SigpipeBlocked no_sigpipe;
    auto c = client_for(host, port, timeout);
    auto r = c->Post(path, body, "application/json");
    if (!r) return transport_error(host, port, path, r.error());
    return HttpResponse{r->status, r->body};
}

Status http_post_stream(const std::string& host, int port, const std::string& path,
                        const std::string& body, Duration timeout, int* status,
                        const std::function<bool(std::string_view)>& on_data) {
    SigpipeBlocked no_sigpipe;
    auto c = client_for(host, port, timeout);
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.body = body;
    req.set_header("Content-Type", "application/json");
    req.set_header("Accept", "text/event-stream");
    bool stopped_by_caller = false;
    req.response_handler = [&](const httplib::Response& res) {
        if (status) *status = res.status;
        return true;
    };
    req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
        if (on_data(std::string_view(data, len))) return true;
        stopped_by_caller = true;
        return false;
    };
    auto r = c->send(req);
    if (r && status) *status = r->status;
    if (!r && !stopped_by_caller) return transport_error(host, port, path, r.error());
    return ok_status();
}

struct HttpStream::Impl {
    std::unique_ptr<httplib::Client> client;
    std::thread thread;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::string> chunks;
    bool ended = false;
    Status error;
    std::atomic<int> status{0};
    std::atomic<bool> cancelled{false};
};

HttpStream::HttpStream(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpStream::~HttpStream() { cancel(); }

std::unique_ptr<HttpStream> HttpStream::post(const std::string& host, int port,
                                             const std::string& path, std::string body,
                                             Duration timeout) {
    auto impl = std::make_unique<Impl>();
    impl->client = client_for(host, port, timeout);
    Impl* p = impl.get();
    // The body moves, not copies, all the way: a 16k-token prompt is 100 KB.
    p->thread = std::thread([p, host, port, path, body = std::move(body)]() mutable {
        SigpipeBlocked no_sigpipe;  // this thread only makes this call
        httplib::Request req;
        req.method = "POST";
        req.path = path;
        req.body = std::move(body);
        req.set_header("Content-Type", "application/json");
        req.response_handler = [p](const httplib::Response& res) {
            p->status = res.status;
            return true;
        };
        req.content_receiver = [p](const char* data, size_t len, uint64_t, uint64_t) {
            if (p->cancelled) return false;
            {
                std::lock_guard lock(p->mu);
                p->chunks.emplace_back(data, len);
            }
            p->cv.notify_all();
            return true;
        };
        auto r = p->client->send(req);
        std::lock_guard lock(p->mu);
        if (r) p->status = r->status;
        if (!r && !p->cancelled) p->error = transport_error(host, port, path, r.error());
        if (!r && p->cancelled) p->error = cancelled("HTTP call cancelled");
        p->ended = true;
        p->cv.notify_all();
    });
    return std::unique_ptr<HttpStream>(new HttpStream(std::move(impl)));
}

Result<std::optional<std::string>> HttpStream::next(TimePoint deadline) {
    std::unique_lock lock(impl_->mu);
    if (!impl_->cv.wait_until(lock, deadline,
                              [&] { return !impl_->chunks.empty() || impl_->ended; }))
        return timeout_error("no response data before the deadline");
    if (!impl_->chunks.empty()) {
        std::string c = std::move(impl_->chunks.front());
        impl_->chunks.pop_front();
        return std::optional<std::string>(std::move(c));
    }
    if (!impl_->error.ok()) return impl_->error;
    return std::optional<std::string>();
}

int HttpStream::status() const { return impl_->status.load(); }

void HttpStream::cancel() {
    if (!impl_) return;
    impl_->cancelled = true;
    impl_->client->stop();
    if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace ferry::serve

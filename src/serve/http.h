// Minimal HTTP/1.1 server and clients; engine and router servers build on them. The server is our
// own (src/serve/http_server.cc): one I/O thread reads every connection's request without blocking
// a worker, under absolute deadlines and size limits, and a bounded worker pool runs the handlers,
// so slow or idle clients cost a file descriptor, not a thread. The clients use cpp-httplib, which
// stays behind this header (it is heavy to compile): only src/serve/http.cc includes it.
// Quick routes (/health, /metrics) have workers of their own, so that requests holding every
// handler worker (streams) never queue them.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "serve/setting_names.h"

namespace ferry::serve {

// Every limit answers with a JSON error {"error": {"message": ..., "code": N}} that names it, then
// closes the connection.
// Most worker threads one server runs (HttpServerOptions::threads): each is an OS thread,
// started as requests come, so the bound is what a burst can start.
inline constexpr size_t kMaxHttpThreads = 4096;

struct HttpServerOptions {
    std::string host = "127.0.0.1";
    int port = 0;  // 0: any free port, see port()
    // Worker threads running handlers. Streams hold one each for their whole life, so this bounds
    // concurrent requests; reading requests and idle connections take none.
    size_t threads = 128;
    // Workers for quick routes (HttpRoute::quick) and for requests answered without a handler
    // (404, 405), apart from `threads`: a burst of 300 streams on 128 workers kept an engine's
    // /health queued for ~20 s and its router declared it dead. Their answers take microseconds;
    // two, so that one writing to a client that does not read does not hold up the rest.
    size_t quick_threads = 2;
    // Larger bodies get 413 as soon as their Content-Length is read (chunked ones once they grow
    // past it), before the body is read. 16 MiB: a 128k-token prompt of ids is ~1 MiB.
    size_t max_body_bytes = size_t(16) << 20;
    // Request line and headers together; larger gets 431.
    size_t max_header_bytes = size_t(64) << 10;
    // Absolute deadlines, not per read: the whole header block within header_timeout of the
    // connection's first byte (or of its accept), the whole body within body_timeout of the end of
    // the headers. Past them: 408 and close.
    Duration header_timeout = seconds(10);
    Duration body_timeout = seconds(60);
    // A keep-alive connection with no new request for this long is closed.
    Duration idle_timeout = seconds(5);
    // A response (or one chunk of a stream) the client does not take within this is abandoned.
    Duration write_timeout = seconds(30);
    // The same for a quick route's response (a few hundred bytes to a few KiB): a client that
    // does not take it within this holds a quick worker no longer.
    Duration quick_write_timeout = seconds(1);
    // A complete request waiting this long for a worker (all `threads` busy, e.g. holding
    // streams) gets 503 and a close, rather than waiting for as long as they run. As long as a
    // router's request_timeout: a router opens up to 256 streams to an engine of 128 workers,
    // and a shorter wait would fail requests of a loaded sweep that are served today.
    Duration queue_timeout = seconds(600);
    // Open connections in all (503 beyond) and from one client address (429 beyond). The per-client
    // cap stays above the 256 streams a router opens to an engine at its default --router-threads,
    // all from one address.
    size_t max_connections = 4096;
    size_t max_connections_per_client = 1024;
    // What answers call these settings (setting_names.h); empty: their field names.
    SettingNames setting_names{};
};

struct HttpRequest {
    std::string method{};
    std::string path{};
    std::string body{};
    // The Content-Type header as sent (empty: none). POST routes take JSON: a body of another
    // media type is refused with 415 before the handler runs.
    std::string content_type{};
    // True once the client closed or reset its connection (a half-close, shutdown(SHUT_WR) after
    // the request, is not gone: it still gets its response). Empty: unknown.
    std::function<bool()> client_gone{};
};

// Writes one chunk of a streamed body; false once the client is gone.
using ChunkWriter = std::function<bool(std::string_view)>;

struct HttpReply {
    int status = 200;
    std::string content_type = "application/json";
    std::string body{};
    // When set, the body is streamed (chunked): this runs after the headers went out, writing
    // chunks until it returns. It must return promptly once `write` fails or the server is
    // stopping. An exception a handler throws becomes a 500 naming it.
    std::function<void(const ChunkWriter& write)> stream{};
};

using HttpHandler = std::function<void(const HttpRequest&, HttpReply&)>;

struct HttpRoute {
    std::string method;  // GET or POST
    std::string path;
    HttpHandler handler;
    // The handler answers at once, waiting on nothing (no lock held for long, no I/O): it runs
    // on the quick workers, never queued behind long requests, and its response must reach the
    // client within a second (quick_write_timeout) or the connection is closed.
    bool quick = false;
};

class HttpServer {
  public:
    static Result<std::unique_ptr<HttpServer>> start(HttpServerOptions options,
                                                     std::vector<HttpRoute> routes);
    ~HttpServer();
    HttpServer(const HttpServer&) = delete;
    HttpServer& operator=(const HttpServer&) = delete;

    int port() const;
    // Streams poll this to end early when the server stops.
    bool stopping() const;
    // Stops accepting, lets streams see stopping(), and joins the server threads.
    void stop();

  private:
    struct Impl;
    explicit HttpServer(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

// Up-front checks of a host flag, so that the error names it rather than the first socket that
// fails on it (a KV side channel, a request): `host` resolves (an IP address or a name), and, for
// a host to listen on, is an address of this machine.
Status check_host_resolves(const std::string& host);
Status check_listen_host(const std::string& host);

// The body of every ferry error, {"error": {"message": ..., "type": ..., "code": status}}, the
// type being the name of the Status code the HTTP status stands for (404 "not found", ...).
std::string http_error_body(int status, const std::string& message);

struct HttpResponse {
    int status = 0;
    std::string body{};
};

// Blocking client calls, each bounded by `timeout` (connect and every read).
Result<HttpResponse> http_get(const std::string& host, int port, const std::string& path,
                              Duration timeout);
Result<HttpResponse> http_post_json(const std::string& host, int port, const std::string& path,
                                    const std::string& body, Duration timeout);
// POSTs and hands each piece of the response body to `on_data` as it arrives (return false to
// stop). `status` receives the HTTP status.
Status http_post_stream(const std::string& host, int port, const std::string& path,
                        const std::string& body, Duration timeout, int* status,
                        const std::function<bool(std::string_view)>& on_data);

// A POST whose response body is read piece by piece by the caller, with a deadline per read,
// and that another thread can cancel (closing the connection). Runs the call on its own thread.
class HttpStream {
  public:
    static std::unique_ptr<HttpStream> post(const std::string& host, int port,
                                            const std::string& path, std::string body,
                                            Duration timeout);
    ~HttpStream();  // cancels and joins
    HttpStream(const HttpStream&) = delete;
    HttpStream& operator=(const HttpStream&) = delete;

    // The next piece of the body; nullopt once the body ended. Errors: transport failure, or
    // kTimeout when `deadline` passed (the call is still alive then; call again or cancel).
    Result<std::optional<std::string>> next(TimePoint deadline);
    // HTTP status once the headers arrived (0 before).
    int status() const;
    void cancel();

  private:
    struct Impl;
    explicit HttpStream(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::serve

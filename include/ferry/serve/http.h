// Minimal HTTP server and clients. cpp-httplib stays behind this header (it is heavy to
// compile), so only src/serve/http.cc includes it; engine and router servers build on it.
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

namespace ferry::serve {

struct HttpServerOptions {
    std::string host = "127.0.0.1";
    int port = 0;  // 0: any free port, see port()
    // Streams hold a thread each for their whole life, so the pool bounds concurrent requests.
    size_t threads = 128;
};

struct HttpRequest {
    std::string method{};
    std::string path{};
    std::string body{};
    std::function<bool()> client_gone{};
};

// Writes one chunk of a streamed body; false once the client is gone.
using ChunkWriter = std::function<bool(std::string_view)>;

struct HttpReply {
    int status = 200;
    std::string content_type = "application/json";
    std::string body{};
    // When set, the body is streamed: this runs after the headers went out, writing chunks until
    // it returns. It must return promptly once `write` fails or the server is stopping.
    std::function<void(const ChunkWriter& write)> stream{};
};

using HttpHandler = std::function<void(const HttpRequest&, HttpReply&)>;

struct HttpRoute {
    std::string method;  // GET or POST
    std::string path;
    HttpHandler handler;
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

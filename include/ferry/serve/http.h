// HTTP for engines and clients. cpp-httplib stays behind this header (it is heavy to compile),
// so only src/serve/http.cc includes it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/serve/engine.h"

namespace ferry::serve {

struct HttpServerOptions {
    std::string host = "127.0.0.1";
    int port = 0;  // 0: any free port, see port()
    // Streams hold a thread each for their whole life, so the pool bounds concurrent requests.
    size_t threads = 128;
    // Longest a request may take end to end before the server gives up on it.
    Duration request_timeout = seconds(600);
    std::string model_name{};  // echoed in responses; the engine's model shape when empty
};

// Serves POST /v1/completions, GET /health and GET /metrics for one engine.
class EngineServer {
  public:
    static Result<std::unique_ptr<EngineServer>> start(Engine* engine, HttpServerOptions options);
    ~EngineServer();
    EngineServer(const EngineServer&) = delete;
    EngineServer& operator=(const EngineServer&) = delete;

    int port() const;
    // Stops accepting, ends streams in progress and joins the server threads.
    void stop();

  private:
    struct Impl;
    explicit EngineServer(std::unique_ptr<Impl> impl);
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

}  // namespace ferry::serve

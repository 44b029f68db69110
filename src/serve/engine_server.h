// An engine behind the OpenAI-style HTTP API: POST /v1/completions (stream or not),
// GET /health (200 once ready, with the limits a router checks requests against and the role and
// KV mode it checks its engines against; 503 with the reason before), GET /metrics (Prometheus
// text), POST /ferry/abort.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "ferry/common/auth.h"
#include "serve/engine.h"
#include "serve/http.h"

namespace ferry::serve {

struct EngineServerOptions {
    HttpServerOptions http{};
    // Longest a request may take end to end before the server gives up on it.
    Duration request_timeout = seconds(600);
    std::string model_name{};  // echoed in responses; the engine's model shape when empty
    // Set when a network KV connector is attached: /health names its side-channel port and
    // provider so that peers find it from the HTTP address the router gives them.
    int kv_side_channel_port = 0;
    std::string kv_provider{};
    // What this engine serves, stated in /health so that a router refuses an engine it cannot
    // use before any request does: its role ("prefill" or "decode") and its KV transfer mode
    // ("push", "pull", "pull-inline" or "none"). Empty: not stated, and not checked.
    std::string role{};
    std::string kv_mode{};
    // The KV link's incarnation (FabricKvLink::incarnation), stated in /health: the router signs
    // it into each leg for this engine. Empty: not stated (no network connector).
    std::string incarnation{};
    // Appended to /metrics (the connector's own counters).
    std::function<std::string()> extra_metrics{};
    // Readiness beyond the engine itself (the KV link's side channel): /health answers 503
    // with the error's message until this is ok. Empty: ready once the server is up.
    std::function<Status()> ready{};
    // The deployment's, when the engine has one: POST /ferry/abort must then carry the router's
    // tag (kv_params_auth.h, abort_tag), so no client can end another's transfer. Empty: any
    // abort is taken (in-process tests, `ferry serve local`).
    Secret secret{};
};

class EngineServer {
  public:
    static Result<std::unique_ptr<EngineServer>> start(Engine* engine, EngineServerOptions options);
    int port() const { return http_->port(); }
    // Ends streams in progress and joins the server threads; the engine keeps running.
    void stop() { http_->stop(); }

  private:
    EngineServer() = default;
    void completions(const HttpRequest& req, HttpReply& reply);
    // The /health body; *http_status 200 when ready, 503 (and a reason) before.
    std::string health(int* http_status) const;

    Engine* engine_ = nullptr;
    EngineServerOptions options_;
    std::unique_ptr<HttpServer> http_;
};

}  // namespace ferry::serve

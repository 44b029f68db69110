// The disaggregated-serving router: OpenAI-style /v1/completions in front of prefill and decode
// engines, picked round robin.
//  - push: both legs leave at once with one transfer id; the decode engine registers its blocks
//    while prefill computes, and its stream is relayed to the client.
//  - pull: the prefill leg first; its kv_transfer_params (engine, block ids) go into the decode
//    leg, whose stream is relayed.
// A leg that fails reaches the client as an HTTP error naming the leg; a client that goes away
// closes the decode leg so the engines free its blocks.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/common/auth.h"
#include "ferry/serve/http.h"
#include "ferry/serve/metrics.h"

namespace ferry::serve {

enum class RouterMode { kPush, kPull };

struct EngineAddress {
    std::string host;
    int port = 0;
    std::string to_string() const { return host + ":" + std::to_string(port); }
};

// "host:port,host:port" -> addresses.
Result<std::vector<EngineAddress>> parse_engine_addresses(std::string_view list);

struct RouterConfig {
    HttpServerOptions http{};
    std::vector<EngineAddress> prefill{};
    std::vector<EngineAddress> decode{};
    RouterMode mode = RouterMode::kPush;
    Duration request_timeout = seconds(600);
    // The deployment's: signs each leg's kv_transfer_params (kv_params_auth.h). Required.
    Secret secret{};
};

class Router {
  public:
    static Result<std::unique_ptr<Router>> start(RouterConfig config);
    ~Router();
    int port() const { return http_->port(); }
    void stop();

  private:
    Router() = default;
    void completions(const HttpRequest& req, HttpReply& reply);
    std::string prometheus_text() const;
    // The engine id an engine reports on /health, cached after the first success.
    Result<std::string> engine_id(const EngineAddress& a);

    RouterConfig config_;
    std::unique_ptr<HttpServer> http_;
    std::atomic<uint64_t> next_prefill_{0}, next_decode_{0}, next_transfer_{0};
    std::string nonce_;
    std::mutex ids_mu_;
    std::vector<std::pair<std::string, std::string>> ids_;  // address -> engine id
    std::atomic<uint64_t> requests_{0}, failures_{0}, prefill_failures_{0}, decode_failures_{0};
    Histogram overhead_{{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1}};
};

}  // namespace ferry::serve

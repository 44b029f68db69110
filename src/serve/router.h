// The disaggregated-serving router: OpenAI-style /v1/completions in front of prefill and decode
// engines, picked round robin.
//  - push: both legs leave at once with one transfer id; the decode engine registers its blocks
//    while prefill computes, and its stream is relayed to the client.
//  - pull: the prefill leg first; its kv_transfer_params (engine, block ids) go into the decode
//    leg, whose stream is relayed.
// A leg that fails reaches the client as an HTTP error naming the leg, and the engine holding
// the other leg is told to abort it (POST /ferry/abort, from a background sender), as it is for
// both legs when the client goes away: an orphaned leg would otherwise keep its KV blocks for
// the whole lease. A request the engines' limits refuse (max_model_len, vocabulary, pool size,
// learnt from their /health) gets its 400 before any leg leaves.
// Readiness: a prober refreshes every engine's /health in the background; the router's
// /health is 200 only while at least one prefill and one decode engine are ready, and requests
// skip engines known unreachable while another is available. An engine whose /health states
// another role or KV mode than the router gives it, or that is a router (itself included), is
// never ready: requests get 503 naming the mismatch instead of a hang or a 400. What the router
// relays of an engine's words (reasons, leg errors) is bounded.
// vLLM engines (RouterConfig::engines, `--engines vllm`): OpenAI servers that load ferry's
// connector (ferry.vllm.FerryConnector, docs/VLLM.md). The legs carry the connector's
// kv_transfer_params (an integer ferry_transfer_id; in push, prefill's side channel for decode),
// /v1/chat/completions is routed too, and the prober reads each engine's /metrics for the
// connector's vllm:ferry_connector_info (its mode and side channel): a prefill engine of another
// mode, or an engine without the connector, is never ready. vLLM has no /ferry/abort: a leg is
// aborted by closing its connection (vLLM aborts a request whose client left).
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/worker_queue.h"
#include "ferry/common/auth.h"
#include "serve/http.h"
#include "serve/kv_params_auth.h"
#include "serve/metrics.h"

namespace ferry::serve {

enum class RouterMode { kPush, kPull };

// What the router fronts: ferry's own engines (`ferry serve prefill|decode`) or vLLM OpenAI
// servers loading ferry.vllm.FerryConnector.
enum class EngineKind { kFerry, kVllm };

// A vLLM engine's FerryConnector, as its /metrics states it (vllm:ferry_connector_info).
struct VllmConnectorInfo {
    std::string mode{};  // "push" or "pull": what its prefill requests do
    std::string host{};  // its side channel
    int port = 0;
    int tp_size = 1;
};
// Reads vllm:ferry_connector_info{mode=..,host=..,port=..,tp_size=..} 1 from a vLLM /metrics
// text; an error naming what is missing or malformed.
Result<VllmConnectorInfo> parse_vllm_connector_info(std::string_view metrics);

struct EngineAddress {
    std::string host;
    int port = 0;
    std::string to_string() const { return host + ":" + std::to_string(port); }
};

// "host:port,host:port" -> addresses.
Result<std::vector<EngineAddress>> parse_engine_addresses(std::string_view list);

struct RouterConfig {
    // http.setting_names also names the router's own settings in its answers and /health
    // reasons: leg_answer_timeout, those whose field name is an ordinary word qualified
    // (RouterConfig::mode, ::engines, ::prefill, ::decode), and the engines' kv_mode (their
    // /health's). Empty: those names as written here.
    HttpServerOptions http{};
    std::vector<EngineAddress> prefill{};
    std::vector<EngineAddress> decode{};
    RouterMode mode = RouterMode::kPush;
    EngineKind engines = EngineKind::kFerry;
    Duration request_timeout = seconds(600);
    // Every engine's /health is fetched this often, each with probe_timeout: a dead engine is
    // known within about a period, a stopped one within period + timeout.
    Duration probe_period = milliseconds(500);
    Duration probe_timeout = milliseconds(300);
    // An engine that leaves this many probes in a row unanswered (no answer within
    // probe_timeout: dead, frozen, or cut off) is declared down: the requests in flight to it
    // fail at once with a 502 naming it, and no abort is sent to it. One missed probe only
    // stops new requests going there: an engine that answers again keeps what it holds.
    unsigned down_after_unanswered = 2;
    // How long a leg may go without the first byte of its engine's answer (zero: no limit but
    // request_timeout). A leg past it fails with 504 naming the engine; an engine that leaves
    // down_after_leg_timeouts legs in a row unanswered so is declared down like one whose
    // probes go unanswered (its requests in flight fail at once, no new ones go to it) for
    // legs_down_period, after which legs are tried again. For an engine that answers /health
    // but never its legs (a wedged worker). It must exceed the longest first token a loaded
    // engine may take (queue, prefill of the longest prompt): the first byte of a leg is its
    // first token (decode) or its whole answer (prefill).
    Duration leg_answer_timeout = Duration::zero();
    unsigned down_after_leg_timeouts = 2;
    Duration legs_down_period = seconds(10);
    // Each POST /ferry/abort; at most abort_queue of them wait (more are dropped and logged:
    // the engines' leases still free what an abort would have).
    Duration abort_timeout = seconds(1);
    size_t abort_queue = 4096;
    // The deployment's: signs each leg's kv_transfer_params (kv_params_auth.h). Required for
    // ferry's engines (vLLM's connector checks no signature).
    Secret secret{};
    // How long an engine takes a signed leg after the router signed it (kDefaultLegTtl says
    // why 30 s); engines' clocks must agree with the router's within it.
    Duration leg_ttl = kDefaultLegTtl;
};

class Router {
  public:
    static Result<std::unique_ptr<Router>> start(RouterConfig config);
    ~Router();
    int port() const { return http_->port(); }
    void stop();

    // What the prober last learnt of one engine from its /health.
    struct EngineState {
        EngineAddress address;
        bool probed = false;
        bool ready = false;
        std::string why{};  // not ready: what the probe saw
        std::string engine_id{};
        // The engine process's incarnation (its /health's): signed into each leg for it, so that
        // a process restarted on its ports takes none of them. Empty: the engine states none.
        std::string incarnation{};
        // Probes in a row that got no answer (this one included); see down_after_unanswered.
        unsigned unanswered = 0;
        // Legs in a row that got no first byte within leg_answer_timeout, and until when the
        // engine is down for it (down_after_leg_timeouts); kept across probes.
        unsigned leg_timeouts = 0;
        TimePoint legs_down_until{};
        // Limits (0: not known yet).
        size_t max_model_len = 0, vocab = 0, block_size = 0, blocks_total = 0;
        // vLLM engines: their connector's mode and side channel (host: where decode reaches it).
        VllmConnectorInfo vllm{};
        // vLLM engines: /health answered, /metrics (rendered by the API server, slow when it is
        // starved) did not within the probe's timeout; store() keeps what the last answer said.
        bool metrics_late = false;
    };

  private:
    Router() = default;
    // `path`: /v1/completions, or /v1/chat/completions (vLLM engines); the legs go to the same.
    void completions(const HttpRequest& req, HttpReply& reply, const char* path);
    void health(HttpReply& reply) const;
    std::string prometheus_text() const;
    // Round robin over the engines of one role, skipping those known not ready while another
    // is; their state as last probed (probed now if never yet).
    EngineState pick(bool prefill);
    // Not ready also when the engine's /health says it is a router, or of the other role, or
    // of a KV mode other than config_.mode.
    EngineState probe(const EngineAddress& a, bool prefill) const;
    // probe() of a vLLM engine, from its /health's status and body (`j`, discarded when not
    // JSON): then /metrics, for its connector's info.
    EngineState probe_vllm(EngineState st, int health_status, const nlohmann::json& j,
                           bool prefill) const;
    void store(bool prefill, size_t index, EngineState st);
    // A leg to `engine` answered (its first byte came) or not within leg_answer_timeout.
    void note_leg_answer(bool prefill, const EngineAddress& engine, bool answered);
    // True once leg_answer_timeout passed since `sent` (never when it is zero).
    bool leg_overdue(TimePoint sent) const;
    // A leg refused as signed for another incarnation (its engine restarted since the last
    // probe): the /health of both engines of the request is read again now, so the next request
    // is signed for the new incarnations rather than failing until the next probe.
    void refresh_if_restarted(int http_status, const std::string& body, const EngineAddress& P,
                              const EngineAddress& D);
    // Empty while `engine` is not declared down (down_after_unanswered); else why, naming it.
    std::string down_reason(const EngineAddress& engine) const;
    void prober();
    // What answers call `name`, one of the settings RouterConfig::http names.
    std::string setting(std::string_view name) const {
        return setting_name(config_.http.setting_names, name);
    }
    // Queues POST /ferry/abort for `transfer_id` to `engine`; never blocks the caller.
    void abort_leg(const EngineAddress& engine, const std::string& transfer_id,
                   const std::string& reason);
    void send_abort(const EngineAddress& engine, const std::string& transfer_id,
                    const std::string& reason);

    RouterConfig config_;
    std::unique_ptr<HttpServer> http_;
    std::atomic<uint64_t> next_prefill_{0}, next_decode_{0}, next_transfer_{0};
    std::string nonce_;
    mutable std::mutex state_mu_;
    std::vector<EngineState> prefill_state_, decode_state_;  // as config_.prefill / decode

    std::mutex bg_mu_;
    std::condition_variable bg_cv_;
    bool bg_stop_ = false;
    std::thread prober_thread_;
    // Aborts to engines, sent one at a time; at most config_.abort_queue wait, and those still
    // waiting at stop() are dropped: the engines' leases free what they would have.
    std::unique_ptr<WorkerQueue> aborts_;
    std::atomic<uint64_t> requests_{0}, failures_{0}, prefill_failures_{0}, decode_failures_{0};
    std::atomic<uint64_t> aborts_sent_{0}, aborts_dropped_{0}, rejected_early_{0};
    Histogram overhead_{{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1}};
};

}  // namespace ferry::serve

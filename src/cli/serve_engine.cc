// `ferry serve prefill|decode|router|local`: engines behind the OpenAI-style HTTP API, the
// router in front of them, or all of it in one process.
// Compute is modelled by the cost model; the KV bytes are real.
#include <fmt/format.h>

#include <cctype>
#include <cstdlib>
#include <initializer_list>
#include <string_view>
#include <thread>
#include <utility>

#include "cli/commands.h"
#include "cli/setting_flags.h"
#include "cli/stop_signal.h"
#include "ferry/common/spin.h"
#include "serve/engine_server.h"
#include "serve/fabric_kv_link.h"
#include "serve/inprocess_kv_link.h"
#include "serve/router.h"

namespace ferry::cli {
namespace {

// The HTTP server's limits against slow, idle or oversized clients; the defaults are
// HttpServerOptions' (docs/SERVING.md, "Limits").
struct HttpLimitFlags {
    serve::HttpServerOptions o;
    double header_timeout_s = to_ms(o.header_timeout) / 1000;
    double body_timeout_s = to_ms(o.body_timeout) / 1000;
    double idle_timeout_s = to_ms(o.idle_timeout) / 1000;
    double queue_timeout_s = to_ms(o.queue_timeout) / 1000;
};

void add_http_limit_flags(CLI::App* cmd, HttpLimitFlags& f) {
    cmd->add_option("--max-body-bytes", f.o.max_body_bytes,
                    "largest request body; larger gets 413 before it is read")
        ->check(positive_number())
        ->capture_default_str();
    cmd->add_option("--header-timeout", f.header_timeout_s,
                    "seconds for a request's whole header block (408 after)")
        ->capture_default_str()
        ->check(positive_number());
    cmd->add_option("--body-timeout", f.body_timeout_s,
                    "seconds for a request's whole body (408 after)")
        ->capture_default_str()
        ->check(positive_number());
    cmd->add_option("--queue-timeout", f.queue_timeout_s,
                    "seconds a complete request waits for a free worker (503 after)")
        ->capture_default_str()
        ->check(positive_number());
    cmd->add_option("--idle-timeout", f.idle_timeout_s,
                    "seconds an idle keep-alive connection stays open")
        ->capture_default_str()
        ->check(positive_number());
    cmd->add_option("--max-connections", f.o.max_connections,
                    "open HTTP connections in all (503 beyond)")
        ->capture_default_str()
        ->check(positive_number());
    cmd->add_option("--max-connections-per-client", f.o.max_connections_per_client,
                    "open HTTP connections from one client address (429 beyond)")
        ->capture_default_str()
        ->check(positive_number());
}

// Each is a thread, started as requests come: 10^9 let a burst start threads until the process
// or the host ran out.
std::string http_threads_help() {
    return fmt::format("concurrent HTTP requests (threads), 1..{}", serve::kMaxHttpThreads);
}

CLI::Validator http_threads_limit() {
    return at_most(double(serve::kMaxHttpThreads), "each is a thread");
}

// `names`: what the server's answers call its settings (the flags of this command).
serve::HttpServerOptions http_options(const std::string& host, int port, size_t threads,
                                      const HttpLimitFlags& f, serve::SettingNames names) {
    auto secs = [](double s) {
        return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
    };
    serve::HttpServerOptions o = f.o;
    o.host = host;
    o.port = port;
    o.threads = threads;
    o.header_timeout = secs(f.header_timeout_s);
    o.body_timeout = secs(f.body_timeout_s);
    o.idle_timeout = secs(f.idle_timeout_s);
    o.queue_timeout = secs(f.queue_timeout_s);
    o.setting_names = std::move(names);
    return o;
}

// The deployment secret: --secret-file, else the user's default file, generated on first use
// (so a one-host deployment needs no flag): $XDG_CONFIG_HOME/ferry/deployment.secret, or
// ~/.config/ferry/deployment.secret.
Result<Secret> deployment_secret(const std::string& flag) {
    if (!flag.empty()) return load_secret_file(flag);
    std::string path;
    if (const char* x = std::getenv("XDG_CONFIG_HOME"); x != nullptr && x[0] == '/')
        path = fmt::format("{}/ferry/deployment.secret", x);
    else if (const char* h = std::getenv("HOME"); h != nullptr && h[0] == '/')
        path = fmt::format("{}/.config/ferry/deployment.secret", h);
    else
        return invalid_argument("no HOME to keep the deployment secret in: pass --secret-file");
    auto s = load_or_create_secret_file(path);
    if (!s.ok())
        return s.status().with_context("default deployment secret (or pass --secret-file)");
    return s;
}

void add_secret_flag(CLI::App* cmd, std::string& path) {
    cmd->add_option("--secret-file", path,
                    "file holding the deployment secret every engine and the router share "
                    "(default: $XDG_CONFIG_HOME/ferry/deployment.secret or "
                    "~/.config/ferry/deployment.secret, generated on first use)");
}

struct EngineFlags {
    std::string host = "127.0.0.1";
    int port = 0;
    std::string engine_id;
    std::string model = "qwen3-32b";
    std::string gpu = "h200";
    int tp = 8;
    serve::CostModelConfig cost;
    serve::EngineConfig engine;
    double kv_wait_timeout_s = 30;
    size_t http_threads = 128;
    HttpLimitFlags http_limits;
    // The KV connector (prefill and decode only).
    std::string kv_mode = "push";
    std::string provider = "shm";
    int kv_port = -1;       // -1: HTTP port + 1000 (0 when the HTTP port is 0: a free one)
    double kv_lease_s = 0;  // 0: serve::kv_lease (the --kv-wait-timeout)
    double kv_op_timeout_s = 10;
    std::string kv_pull_keys = "offer";
    int kv_num_rails = 1;
    std::string kv_rails = "nearest";
    size_t kv_max_connections_per_client =
        serve::FabricKvLinkConfig{}.side_max_connections_per_client;
    double kv_proof_deadline_s =
        std::chrono::duration<double>(serve::FabricKvLinkConfig{}.side_proof_deadline).count();
    std::string secret_file;  // empty: the default (deployment_secret)
};

void add_engine_flags(CLI::App* cmd, EngineFlags& f, bool with_address = true) {
    if (with_address) {
        cmd->add_option("--host", f.host, "address to listen on")->capture_default_str();
        cmd->add_option("--port", f.port, "HTTP port")->capture_default_str();
    }
    cmd->add_option("--engine-id", f.engine_id,
                    with_address ? "engine id (default: <role>-<port>)"
                                 : "engine ids <id>-prefill and <id>-decode (default: "
                                   "<role>-<port>)");
    cmd->add_option("--model", f.model, "model shape: qwen3-32b | tiny")->capture_default_str();
    cmd->add_option("--gpu", f.gpu, "GPU the cost model assumes: h200")->capture_default_str();
    cmd->add_option("--tp", f.tp, "tensor-parallel degree the cost model assumes")
        ->capture_default_str();
    cmd->add_option("--compute-efficiency", f.cost.compute_efficiency,
                    "achieved fraction of peak FLOP/s")
        ->capture_default_str();
    cmd->add_option("--bandwidth-efficiency", f.cost.bandwidth_efficiency,
                    "achieved fraction of HBM bandwidth")
        ->capture_default_str();
    cmd->add_option("--step-overhead-us", f.cost.step_overhead_us, "fixed cost per step")
        ->capture_default_str();
    cmd->add_option("--max-num-seqs", f.engine.max_num_seqs,
                    fmt::format("sequences per batch, 1..{}", serve::kMaxNumSeqs))
        ->capture_default_str();
    cmd->add_option("--max-model-len", f.engine.max_model_len, "prompt + output tokens")
        ->capture_default_str();
    cmd->add_option("--max-num-batched-tokens", f.engine.max_num_batched_tokens,
                    "prompt tokens per prefill step")
        ->capture_default_str();
    cmd->add_option("--prefill-chunk", f.engine.prefill_chunk_tokens,
                    "chunked prefill: prompt tokens per prefill step, at least --block-size "
                    "(0: whole prompts); push sends each chunk's KV while the next computes")
        ->capture_default_str();
    cmd->add_option("--push-layer-groups", f.engine.push_layer_groups,
                    "push: the last chunk's KV goes out in this many layer groups as they are "
                    "computed (1: whole, after the step)")
        ->capture_default_str();
    cmd->add_option("--first-token", f.engine.first_token,
                    "decode legs: prefill = stream the token prefill sampled as soon as the KV "
                    "is in (SGLang-style); decode = compute it in decode's first step "
                    "(vLLM-style)")
        // CLI11's CheckedTransformer answered a typo with "Check bogus value in
        // {decode->1,prefill->0} OR {1,0} FAILED", and took 0 and 1.
        ->transform(CLI::Validator(
            [](std::string& v) -> std::string {
                using FirstToken = serve::EngineConfig::FirstToken;
                std::string lower = v;
                for (char& ch : lower) ch = char(std::tolower(static_cast<unsigned char>(ch)));
                if (lower != "prefill" && lower != "decode")
                    return "must be prefill or decode, got " + v;
                v = std::to_string(
                    int(lower == "prefill" ? FirstToken::kPrefill : FirstToken::kDecode));
                return {};
            },
            ""))
        ->type_name("prefill|decode")
        ->default_str("prefill");
    cmd->add_option("--num-blocks", f.engine.num_blocks, "KV blocks in the pool")
        ->capture_default_str();
    cmd->add_option("--block-size", f.engine.block_size, "tokens per KV block")
        ->capture_default_str();
    cmd->add_option("--time-scale", f.engine.time_scale,
                    "multiplies modelled step times (1 = real time)")
        ->capture_default_str();
    cmd->add_option("--kv-wait-timeout", f.kv_wait_timeout_s,
                    "seconds a decode leg waits for its KV")
        ->capture_default_str()
        ->check(positive_number());
    cmd->add_option("--http-threads", f.http_threads, http_threads_help())
        ->capture_default_str()
        ->check(positive_number())
        ->check(http_threads_limit());
    add_http_limit_flags(cmd, f.http_limits);
}

Result<std::unique_ptr<serve::Engine>> make_engine(const std::string& role, EngineFlags f,
                                                   int port) {
    FERRY_ASSIGN_OR_RETURN(auto model, serve::model_by_name(f.model));
    FERRY_ASSIGN_OR_RETURN(auto gpu, serve::gpu_by_name(f.gpu));
    auto cost = serve::CostModel::create(model, gpu, f.tp, f.cost);
    if (!cost.ok()) return in_flag_names(cost.status());
    f.engine.engine_id = f.engine_id.empty() ? fmt::format("{}-{}", role, port) : f.engine_id;
    f.engine.kv_wait_timeout =
        std::chrono::duration_cast<Duration>(std::chrono::duration<double>(f.kv_wait_timeout_s));
    auto engine = serve::Engine::create(f.engine, *cost);
    if (!engine.ok()) return in_flag_names(engine.status());
    return engine;
}

// `kv_mode`: the KV link's mode as the flag gave it; with `role`, stated in /health for the
// router to check against its own --mode. `port_flag`: the flag that gave `port`.
Result<std::unique_ptr<serve::EngineServer>> serve_engine(serve::Engine& e, const EngineFlags& f,
                                                          int port, std::string_view port_flag,
                                                          const std::string& role,
                                                          const std::string& kv_mode,
                                                          serve::FabricKvLink* link = nullptr,
                                                          const Secret& secret = Secret()) {
    FERRY_RETURN_IF_ERROR(e.start());
    serve::EngineServerOptions so{.http = http_options(f.host, port, f.http_threads, f.http_limits,
                                                       flag_names(port_flag, "--http-threads"))};
    so.role = role;
    so.kv_mode = kv_mode;
    if (link != nullptr) {
        so.kv_side_channel_port = link->side_port();
        so.kv_provider = link->provider();
        so.incarnation = link->incarnation();
        so.extra_metrics = [link] { return link->prometheus_text(); };
        so.ready = [link] { return link->ready(); };
        so.secret = secret;
    }
    FERRY_ASSIGN_OR_RETURN(auto server, serve::EngineServer::start(&e, so));
    if (link != nullptr) link->set_http_address(f.host, server->port());
    const kv::KvLayout& kv = e.kv_slice().layout;
    const serve::CostModel& cm = e.cost_model();
    fmt::print(stderr,
               "engine {} on http://{}:{}  model {} on {} x TP{} (compute modelled, KV real)\n"
               "  KV pool: {} blocks x {} tokens, {:.1f} MiB\n",
               e.config().engine_id, f.host, server->port(), cm.model().name, cm.gpu().name,
               cm.tp(), e.config().num_blocks, kv.block_size,
               double(e.pool().size_bytes()) / (1 << 20));
    return server;
}

int fail(const Status& st) {
    fmt::print(stderr, "error: {}\n", st.to_string());
    return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

// Until SIGINT, SIGTERM or SIGHUP, then says which one stops the process (it exits 0 once
// stopped).
void wait_for_stop() {
    const auto& stop = stop_requested();
    while (!stop.load()) std::this_thread::sleep_for(milliseconds(100));
    fmt::print(stderr, "{}: stopping\n", stop_signal_name());
}

Result<kv::TransferMode> kv_link_mode(const std::string& mode) {
    auto m = kv::parse_transfer_mode(mode);
    if (!m.ok())
        return invalid_argument("--kv-mode must be push, pull, pull-inline or none, not " + mode);
    return m;
}

// Checked before anything opens a socket on it: `--host 999.1.1.1` was reported as a failure of
// the KV side channel, the first thing an engine binds.
Status check_listen_flag(const char* flag, const std::string& host) {
    return serve::check_listen_host(host).with_context(flag);
}

// The second bind of a port given to two flags failed as "in use? pick another --port",
// whichever flag it was. Ports <= 0 (a free one, or a default derived later) are not compared.
Status distinct_ports(std::initializer_list<std::pair<const char*, int>> ports) {
    for (auto i = ports.begin(); i != ports.end(); ++i)
        for (auto k = ports.begin(); k != i; ++k)
            if (i->second > 0 && i->second == k->second)
                return invalid_argument(
                    fmt::format("{} {} is {} too: give each its own port (or 0 for a free one)",
                                i->first, i->second, k->first));
    return ok_status();
}

int run_engine(const std::string& role, const EngineFlags& f) {
    stop_requested();  // handlers in place before anything starts
    if (Status st = check_listen_flag("--host", f.host); !st.ok()) return fail(st);
    if (Status st = distinct_ports({{"--port", f.port}, {"--kv-port", f.kv_port}}); !st.ok())
        return fail(st);
    // libfabric 1.17's shm copies a large write with CMA while holding the target region's
    // spinlock, and the initiator's next post spins on that lock for the whole copy. With more
    // busy threads than cores the spinner takes the copier's CPU and a loaded stack never
    // recovers (8 QPS of 4096-token prompts on 2 cores: transfer wait ~1 s instead of ~2 ms).
    // Its bounce-buffer path holds the lock only per chunk. Only where busy threads can
    // outnumber the cores (as IdleWait decides; hosts of 4+ CPUs were measured with CMA and
    // keep it). A value the user set wins.
    if (f.provider == "shm" && usable_cpus() < IdleWait::kSpinFromCpus)
        ::setenv("FI_SHM_DISABLE_CMA", "1", 0);
    auto engine = make_engine(role, f, f.port);
    if (!engine.ok()) return fail(engine.status());
    std::unique_ptr<serve::FabricKvLink> link;
    Secret deployment;  // the link's, and the check of /ferry/abort
    if (f.kv_mode != "none") {
        auto mode = kv_link_mode(f.kv_mode);
        if (!mode.ok()) return fail(mode.status());
        serve::FabricKvLinkConfig lc;
        lc.engine_id = (*engine)->config().engine_id;
        lc.mode = *mode;
        lc.provider = f.provider;
        lc.host = f.host;
        lc.side_port = f.kv_port >= 0 ? f.kv_port : (f.port > 0 ? f.port + 1000 : 0);
        auto secs = [](double s) {
            return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
        };
        lc.lease = f.kv_lease_s > 0 ? secs(f.kv_lease_s) : serve::kv_lease((*engine)->config());
        lc.op_timeout = secs(f.kv_op_timeout_s);
        lc.pull_keys = f.kv_pull_keys == "pool" ? kv::PullKeys::kPool : kv::PullKeys::kPerOffer;
        lc.num_rails = f.kv_num_rails;
        lc.rails = f.kv_rails;
        lc.side_max_connections_per_client = f.kv_max_connections_per_client;
        lc.side_proof_deadline = secs(f.kv_proof_deadline_s);
        lc.setting_names = flag_names();
        auto secret = deployment_secret(f.secret_file);
        if (!secret.ok()) return fail(secret.status());
        lc.secret = *secret;
        deployment = std::move(secret).value();
        auto l = serve::FabricKvLink::create(lc, &(*engine)->pool());
        if (!l.ok()) return fail(in_flag_names(l.status()));
        link = std::move(l).value();
        bool prefill = role == "prefill";
        (*engine)->attach_connector(prefill ? link.get() : nullptr, prefill ? nullptr : link.get());
    }
    auto server =
        serve_engine(**engine, f, f.port, "--port", role, f.kv_mode, link.get(), deployment);
    if (!server.ok()) return fail(server.status());
    if (link)
        fmt::print(stderr, "  KV connector: {} over {}, side channel {}:{}\n", f.kv_mode,
                   f.provider, f.host, link->side_port());
    else
        fmt::print(stderr, "  no KV connector (--kv-mode none): disaggregated legs get 503\n");
    wait_for_stop();
    (*server)->stop();
    (*engine)->stop();
    if (link) link->stop();
    return 0;
}

struct RouterFlags {
    std::string host = "127.0.0.1";
    int port = 8000;
    std::string prefill = "127.0.0.1:8100";
    std::string decode = "127.0.0.1:8200";
    std::string mode = "push";
    std::string engines = "ferry";
    size_t http_threads = 256;
    double timeout_s = 600;
    double leg_ttl_s = to_ms(serve::kDefaultLegTtl) / 1000;
    double leg_answer_timeout_s = 0;
    HttpLimitFlags http_limits;
    std::string secret_file;
};

Result<serve::RouterMode> router_mode(const std::string& mode) {
    if (mode == "push") return serve::RouterMode::kPush;
    // pull-inline differs from pull only inside the decode engine's connector.
    if (mode == "pull" || mode == "pull-inline") return serve::RouterMode::kPull;
    return invalid_argument("--mode must be push, pull or pull-inline, not " + mode);
}

int run_router(const RouterFlags& f) {
    stop_requested();
    if (Status st = check_listen_flag("--host", f.host); !st.ok()) return fail(st);
    serve::RouterConfig rc;
    auto mode = router_mode(f.mode);
    if (!mode.ok()) return fail(mode.status());
    rc.mode = *mode;
    if (f.engines == "vllm") {
        rc.engines = serve::EngineKind::kVllm;
        if (f.mode == "pull-inline")
            return fail(invalid_argument(
                "--mode pull-inline is for ferry's engines; with --engines vllm use push or pull"));
        // A vLLM API server on a busy host answers /health and /metrics in seconds, not
        // milliseconds: shorter, and the prober declared its engines down mid-request.
        rc.probe_period = std::chrono::seconds(1);
        rc.probe_timeout = std::chrono::seconds(5);
    } else if (f.engines != "ferry") {
        return fail(invalid_argument("--engines must be ferry or vllm, not " + f.engines));
    }
    auto p = serve::parse_engine_addresses(f.prefill);
    if (!p.ok()) return fail(p.status().with_context("--prefill"));
    auto d = serve::parse_engine_addresses(f.decode);
    if (!d.ok()) return fail(d.status().with_context("--decode"));
    rc.prefill = *p;
    rc.decode = *d;
    rc.http = http_options(f.host, f.port, f.http_threads, f.http_limits,
                           flag_names("--port", "--router-threads"));
    rc.request_timeout =
        std::chrono::duration_cast<Duration>(std::chrono::duration<double>(f.timeout_s));
    rc.leg_ttl = std::chrono::duration_cast<Duration>(std::chrono::duration<double>(f.leg_ttl_s));
    rc.leg_answer_timeout =
        std::chrono::duration_cast<Duration>(std::chrono::duration<double>(f.leg_answer_timeout_s));
    // vLLM's connector checks no signature: no secret (nor its default file) for it.
    if (rc.engines == serve::EngineKind::kFerry) {
        auto secret = deployment_secret(f.secret_file);
        if (!secret.ok()) return fail(secret.status());
        rc.secret = std::move(secret).value();
    }
    auto router = serve::Router::start(rc);
    if (!router.ok()) return fail(router.status());
    fmt::print(stderr, "router on http://{}:{} ({}, {} engines): prefill {} decode {}\n", f.host,
               (*router)->port(), f.mode, f.engines, f.prefill, f.decode);
    wait_for_stop();
    (*router)->stop();
    return 0;
}

struct LocalFlags {
    EngineFlags engine;
    RouterFlags router;
    int prefill_port = 8100;
    int decode_port = 8200;
    double lease_s = 0;  // 0: serve::kv_lease (the --kv-wait-timeout)
};

// One process: prefill and decode engines joined by the in-process KV link (a memcpy between
// their pools) behind the router. For trying the stack before the network connector exists.
int run_local(const LocalFlags& f) {
    stop_requested();
    if (Status st = check_listen_flag("--host", f.router.host); !st.ok()) return fail(st);
    if (Status st = distinct_ports({{"--port", f.router.port},
                                    {"--prefill-port", f.prefill_port},
                                    {"--decode-port", f.decode_port}});
        !st.ok())
        return fail(st);
    auto mode = router_mode(f.router.mode);
    if (!mode.ok()) return fail(mode.status());
    auto link_mode = kv_link_mode(f.router.mode);
    if (!link_mode.ok()) return fail(link_mode.status());
    auto secs = [](double s) {
        return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
    };
    serve::InProcessKvLink link(
        {*link_mode, f.lease_s > 0
                         ? secs(f.lease_s)
                         : serve::kv_lease({.kv_wait_timeout = secs(f.engine.kv_wait_timeout_s)})});
    // One --engine-id names both engines: "<id>-prefill" and "<id>-decode" (the same id for
    // both was refused, "engine id used twice", whatever the id).
    EngineFlags pf = f.engine, df = f.engine;
    if (!f.engine.engine_id.empty()) {
        pf.engine_id += "-prefill";
        df.engine_id += "-decode";
    }
    auto pe = make_engine("prefill", pf, f.prefill_port);
    if (!pe.ok()) return fail(pe.status());
    auto de = make_engine("decode", df, f.decode_port);
    if (!de.ok()) return fail(de.status());
    std::string pid = (*pe)->config().engine_id, did = (*de)->config().engine_id;
    if (Status st = link.add_engine(pid, &(*pe)->pool()); !st.ok()) return fail(st);
    if (Status st = link.add_engine(did, &(*de)->pool()); !st.ok()) return fail(st);
    (*pe)->attach_connector(link.producer(pid), nullptr);
    (*de)->attach_connector(nullptr, link.consumer(did));
    if (Status st = link.start(); !st.ok()) return fail(st);
    auto ps =
        serve_engine(**pe, f.engine, f.prefill_port, "--prefill-port", "prefill", f.router.mode);
    if (!ps.ok()) return fail(ps.status());
    auto ds = serve_engine(**de, f.engine, f.decode_port, "--decode-port", "decode", f.router.mode);
    if (!ds.ok()) return fail(ds.status());
    serve::RouterConfig rc;
    rc.mode = *mode;
    rc.prefill = {{f.engine.host, (*ps)->port()}};
    rc.decode = {{f.engine.host, (*ds)->port()}};
    rc.http = http_options(f.router.host, f.router.port, f.router.http_threads,
                           f.engine.http_limits, flag_names("--port", "--router-threads"));
    // The engines here take the router's legs over the in-process link and connect nowhere:
    // a secret of this process alone is enough.
    auto secret = Secret::generate();
    if (!secret.ok()) return fail(secret.status());
    rc.secret = std::move(secret).value();
    auto router = serve::Router::start(rc);
    if (!router.ok()) return fail(router.status());
    fmt::print(stderr,
               "router on http://{}:{} ({}), KV over the in-process link (memcpy between the "
               "two pools; the libfabric connector replaces it)\n",
               f.router.host, (*router)->port(), f.router.mode);
    wait_for_stop();
    (*router)->stop();
    (*ps)->stop();
    (*ds)->stop();
    (*pe)->stop();
    (*de)->stop();
    link.stop();
    return 0;
}

void add_router_flags(CLI::App* cmd, RouterFlags& f, bool with_engines) {
    cmd->add_option("--host", f.host, "address to listen on")->capture_default_str();
    cmd->add_option("--port", f.port, "HTTP port")->capture_default_str();
    cmd->add_option("--mode", f.mode, "push | pull | pull-inline")->capture_default_str();
    cmd->add_option("--router-threads", f.http_threads, http_threads_help())
        ->capture_default_str()
        ->check(positive_number())
        ->check(http_threads_limit());
    cmd->add_option("--request-timeout", f.timeout_s, "seconds per request")
        ->capture_default_str()
        ->check(positive_number());
    // `serve local` takes the engines' limit flags for its router too (one set per command).
    if (with_engines) add_http_limit_flags(cmd, f.http_limits);
    if (with_engines) {
        cmd->add_option("--prefill", f.prefill, "prefill engines HOST:PORT[,HOST:PORT...]")
            ->capture_default_str();
        cmd->add_option("--decode", f.decode, "decode engines HOST:PORT[,HOST:PORT...]")
            ->capture_default_str();
        cmd->add_option("--engines", f.engines,
                        "ferry (engines of `ferry serve prefill|decode`) | vllm (vLLM OpenAI "
                        "servers loading ferry.vllm.FerryConnector, docs/VLLM.md)")
            ->capture_default_str();
        cmd->add_option("--leg-ttl", f.leg_ttl_s,
                        "seconds an engine takes a signed leg after the router sent it (each is "
                        "taken once); the hosts' clocks must agree within it")
            ->capture_default_str()
            ->check(positive_number());
        cmd->add_option("--leg-answer-timeout", f.leg_answer_timeout_s,
                        "seconds a leg may wait for the first byte of its engine's answer "
                        "(0: only --request-timeout); 2 such legs in a row take the engine out "
                        "for 10 s. Above the longest first token a loaded engine may take")
            ->capture_default_str();
    }
}

}  // namespace

constexpr size_t kDefaultPrefillChunk = 512;
// Eight groups leave an eighth of the last chunk's bytes to copy after its step (2 of 16 MiB
// at Qwen3-32B TP 8; `bench kv` over shm on the dev machine: 0.7 against 4.2 ms), for 7 more
// segments per request. In the 2-core serving sweep the gain was smaller, as the copies queue
// behind earlier chunks' (BENCHMARKS.md).
constexpr int kDefaultPushLayerGroups = 8;

void register_serve(CLI::App& app) {
    auto* serve = app.add_subcommand("serve", "disaggregated serving processes");
    serve->require_subcommand(1);
    for (auto [role, port] : {std::pair{"prefill", 8100}, std::pair{"decode", 8200}}) {
        auto flags = std::make_shared<EngineFlags>();
        flags->port = port;
        // Push overlaps each chunk's KV transfer with the next chunk's compute; the chunk
        // size trades the exposed last chunk against per-step costs (BENCHMARKS.md).
        if (std::string(role) == "prefill") {
            flags->engine.prefill_chunk_tokens = kDefaultPrefillChunk;
            flags->engine.push_layer_groups = kDefaultPushLayerGroups;
        }
        auto* cmd = serve->add_subcommand(role, fmt::format("run a {} engine", role));
        add_engine_flags(cmd, *flags);
        cmd->add_option("--kv-mode", flags->kv_mode,
                        "KV connector: push | pull | pull-inline (match the router's --mode), "
                        "or none")
            ->capture_default_str();
        cmd->add_option("--provider", flags->provider,
                        "libfabric provider for KV: shm (one host) | tcp | efa | verbs")
            ->capture_default_str();
        cmd->add_option("--kv-port", flags->kv_port,
                        "KV side-channel port (default: HTTP port + 1000)");
        cmd->add_option("--kv-lease", flags->kv_lease_s,
                        "seconds a side holds blocks for a transfer that does not progress "
                        "(default: --kv-wait-timeout)")
            ->check(positive_number());
        cmd->add_option("--kv-num-rails", flags->kv_num_rails,
                        "NICs (libfabric domains) the KV engine opens; large writes stripe "
                        "across them")
            ->capture_default_str()
            ->check(CLI::Range(1, 64));
        cmd->add_option("--kv-rails", flags->kv_rails,
                        "which NICs carry each KV region: nearest (its GPU's PCIe switch or NUMA "
                        "node), all, or NIC domain names separated by commas (ferry topo)")
            ->capture_default_str();
        cmd->add_option("--kv-op-timeout", flags->kv_op_timeout_s,
                        "seconds before a KV write or read to a dead peer fails")
            ->capture_default_str()
            ->check(positive_number());
        cmd->add_option("--kv-pull-keys", flags->kv_pull_keys,
                        "pull offers: offer = registered on their own, closed when the offer "
                        "ends, so a late read fails; pool = read under the pool's keys (no "
                        "registration per offer)")
            ->capture_default_str()
            ->check(CLI::Validator(
                [](std::string& v) -> std::string {
                    return v == "offer" || v == "pool" ? std::string()
                                                       : "must be offer or pool, got " + v;
                },
                ""));
        // The side channel's limits against idle and unproven connections (issue 30, item 7).
        const serve::FabricKvLinkConfig link_defaults;
        cmd->add_option("--kv-max-connections-per-client", flags->kv_max_connections_per_client,
                        "open KV side-channel connections from one address (closed beyond)")
            ->capture_default_str()
            ->check(positive_number())
            ->check(at_most(double(link_defaults.side_max_connections),
                            "the side channel's connections in all"));
        cmd->add_option("--kv-proof-deadline", flags->kv_proof_deadline_s,
                        "seconds a KV side-channel connection may stay open before its client "
                        "proved the deployment secret")
            ->capture_default_str()
            ->check(positive_number())
            ->check(at_most(
                std::chrono::duration<double>(kv::HandshakeServerOptions{}.connection_deadline)
                    .count(),
                "a connection's whole exchange ends within it"));
        add_secret_flag(cmd, flags->secret_file);
        std::string r = role;
        cmd->callback([flags, r] { set_exit_code(run_engine(r, *flags)); });
    }
    auto rf = std::make_shared<RouterFlags>();
    auto* router = serve->add_subcommand("router", "route completions to prefill and decode");
    add_router_flags(router, *rf, true);
    add_secret_flag(router, rf->secret_file);
    router->callback([rf] { set_exit_code(run_router(*rf)); });

    auto lf = std::make_shared<LocalFlags>();
    auto* local = serve->add_subcommand(
        "local", "prefill + decode + router in one process, KV over the in-process link");
    add_engine_flags(local, lf->engine, false);
    add_router_flags(local, lf->router, false);
    local->add_option("--prefill-port", lf->prefill_port, "the prefill engine's HTTP port")
        ->capture_default_str();
    local->add_option("--decode-port", lf->decode_port, "the decode engine's HTTP port")
        ->capture_default_str();
    local
        ->add_option("--lease", lf->lease_s,
                     "seconds a side waits for the other (default: --kv-wait-timeout)")
        ->check(positive_number());
    local->callback([lf] { set_exit_code(run_local(*lf)); });
}

}  // namespace ferry::cli

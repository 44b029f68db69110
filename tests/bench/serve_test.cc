#include "bench/serve.h"

#include <gtest/gtest.h>

#include "serve/engine_server.h"

namespace ferry::serve {
namespace {

struct Target {
    std::unique_ptr<Engine> engine;
    std::unique_ptr<EngineServer> server;
    Target() {
        auto cost = CostModel::create(tiny_test_model(), h200(), 1).value();
        engine = Engine::create({.engine_id = "e", .num_blocks = 256}, cost).value();
        EXPECT_TRUE(engine->start().ok());
        server =
            EngineServer::start(engine.get(), {.http = {.host = "127.0.0.1", .port = 0}}).value();
    }
    ~Target() {
        server->stop();
        engine->stop();
    }
    BenchServeConfig config() {
        BenchServeConfig c;
        c.host = "127.0.0.1";
        c.port = server->port();
        c.model = "tiny";
        c.num_prompts = 12;
        c.input_len = 20;
        c.input_len_max = 60;
        c.output_len = 6;
        c.vocab = engine->kv_slice().vocab;
        c.verify = true;
        c.verify_slice = engine->kv_slice();
        c.request_timeout = seconds(10);
        return c;
    }
};

TEST(BenchServe, BurstCompletesAndVerifiesEveryRequest) {
    Target t;
    BenchServeConfig c = t.config();
    size_t progress_calls = 0;
    c.on_progress = [&](const BenchProgress& p) {
        progress_calls++;
        EXPECT_LE(p.done, p.total);
    };
    auto r = run_bench_serve(c);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    nlohmann::json j = r->to_json();
    EXPECT_EQ(j["completed"], 12);
    EXPECT_EQ(j["failed"], 0);
    EXPECT_EQ(j["verification_failures"], 0);
    EXPECT_EQ(progress_calls, 13u);  // one per request, one once the tokens are verified
    for (const char* k : {"mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                          "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "request_throughput",
                          "output_throughput", "total_token_throughput"}) {
        ASSERT_TRUE(j.contains(k)) << k;
        EXPECT_GT(j[k].get<double>(), 0) << k;
    }
    EXPECT_EQ(j["total_output_tokens"], 12 * 6);
    EXPECT_GE(j["p99_ttft_ms"].get<double>(), j["median_ttft_ms"].get<double>());
    EXPECT_NE(j["note"].get<std::string>().find("transfers are real"), std::string::npos);
    for (auto& len : j["input_lens"]) {
        EXPECT_GE(len.get<int>(), 20);
        EXPECT_LE(len.get<int>(), 60);
    }
}

TEST(BenchServe, VerifierCatchesTokensFromTheWrongKv) {
    Target t;
    BenchServeConfig c = t.config();
    c.num_prompts = 3;
    c.verify_slice.head_offset = 1;  // expects the KV of other heads than the engine holds
    auto r = run_bench_serve(c);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->to_json()["completed"], 3);
    EXPECT_EQ(r->to_json()["verification_failures"], 3);
}

TEST(BenchServe, PoissonArrivalsSpreadRequestsOverTime) {
    Target t;
    BenchServeConfig c = t.config();
    c.num_prompts = 10;
    c.request_rate = 20;  // ~0.5 s of arrivals
    auto r = run_bench_serve(c);
    ASSERT_TRUE(r.ok());
    EXPECT_GT(r->duration_s, 0.15);
    EXPECT_LT(r->duration_s, 3.0);
    c.request_rate = std::numeric_limits<double>::infinity();
    auto burst = run_bench_serve(c);
    ASSERT_TRUE(burst.ok());
    EXPECT_LT(burst->duration_s, r->duration_s);
}

TEST(BenchServe, UnreachableServerCountsAsFailedRequests) {
    Target t;
    BenchServeConfig c = t.config();
    c.port = t.server->port();
    t.server->stop();
    c.num_prompts = 2;
    c.request_timeout = seconds(2);
    auto r = run_bench_serve(c);
    ASSERT_TRUE(r.ok());
    nlohmann::json j = r->to_json();
    EXPECT_EQ(j["failed"], 2);
    EXPECT_FALSE(j["errors"][0].get<std::string>().empty());
}

TEST(BenchServe, PercentileMatchesNumpy) {
    std::vector<double> v{1, 2, 3, 4};
    EXPECT_DOUBLE_EQ(percentile(v, 50), 2.5);
    EXPECT_DOUBLE_EQ(percentile(v, 99), 3.97);
    EXPECT_DOUBLE_EQ(percentile({7}, 99), 7);
}

}  // namespace
}  // namespace ferry::serve

// The `ferry` binary as a new user or a script with a typo runs it: every bad flag value ends
// the process at once with a non-zero status and a line naming the flag, never an abort, a
// hang or a run with a wrapped value (`--num-prompts -1` was 2^64 - 1 prompts and took the
// machine's memory; `--port 70000` listened on 4464; `bench xfer` with an unknown provider died
// of SIGPIPE without a word).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <set>

#include "ferry/fabric/engine.h"
#include "serve/engine.h"
#include "serve_procs.h"

namespace ferry::serve::testing {
namespace {

struct Bad {
    std::vector<std::string> args;
    std::string says;  // in the output
};

class CliFlags : public ::testing::Test {
  protected:
    void SetUp() override {
        dir_ = std::filesystem::temp_directory_path() / fmt::format("ferry-cli-{}", ::getpid());
        std::filesystem::create_directories(dir_);
    }
    void TearDown() override { std::filesystem::remove_all(dir_); }

    Proc start(const std::vector<std::string>& args) {
        std::vector<std::string> argv = {ferry_binary()};
        argv.insert(argv.end(), args.begin(), args.end());
        return Proc::spawn(argv, (dir_ / fmt::format("run{}.log", runs_++)).string());
    }
    // Runs `ferry args...`; its exit status (-1: still running after the budget) and output.
    std::pair<int, std::string> run(const std::vector<std::string>& args,
                                    Duration budget = seconds(20)) {
        Proc p = start(args);
        int code = p.wait_exit(budget);
        return {code, p.log_text()};
    }

    std::filesystem::path dir_;
    int runs_ = 0;
};

std::string joined(const std::vector<std::string>& args) {
    std::string s;
    for (const auto& a : args) s += a + " ";
    return s;
}

TEST_F(CliFlags, BadValuesEndTheProcessWithAnErrorNamingTheFlag) {
    // The engines' flags are checked before any pool is allocated; tiny keeps a case that gets
    // further cheap.
    const std::vector<std::string> tiny = {"--model", "tiny", "--tp", "1", "--port", "0"};
    auto engine = [&](std::vector<std::string> extra) {
        std::vector<std::string> a = {"serve", "prefill"};
        a.insert(a.end(), tiny.begin(), tiny.end());
        a.insert(a.end(), extra.begin(), extra.end());
        return a;
    };
    const std::vector<Bad> cases = {
        {engine({"--port", "-5"}), "--port: must not be negative, got -5"},
        {engine({"--port", "70000"}), "--port: Value 70000 not in range 0 to 65535"},
        {engine({"--kv-port", "70000"}), "--kv-port: Value 70000 not in range"},
        {engine({"--max-num-seqs", "-1"}), "--max-num-seqs: must not be negative"},
        {engine({"--num-blocks", "-3"}), "--num-blocks: must not be negative"},
        {engine({"--max-num-seqs", "ten"}), "--max-num-seqs"},
        {engine({"--http-threads", "0"}), "--http-threads: must be greater than 0"},
        {engine({"--max-body-bytes", "0"}), "--max-body-bytes: must be greater than 0"},
        {engine({"--header-timeout", "-1"}), "--header-timeout: must be greater than 0"},
        {engine({"--body-timeout", "nan"}), "--body-timeout"},
        {engine({"--queue-timeout", "0"}), "--queue-timeout: must be greater than 0"},
        {engine({"--queue-timeout", "1e12"}), "--queue-timeout: must be at most 1e9"},
        {engine({"--kv-lease", "0"}), "--kv-lease: must be greater than 0"},
        {engine({"--kv-op-timeout", "-2"}), "--kv-op-timeout"},
        {engine({"--kv-pull-keys", "none"}), "--kv-pull-keys: must be offer or pool, got none"},
        {engine({"--kv-num-rails", "0"}), "--kv-num-rails"},
        {engine({"--kv-rails", "rdmap99s0"}),
         "--kv-rails: rail selection names NIC 'rdmap99s0', which is not here"},
        {engine({"--kv-wait-timeout", "0"}), "--kv-wait-timeout: must be greater than 0"},
        {engine({"--kv-max-connections-per-client", "0"}),
         "--kv-max-connections-per-client: must be greater than 0"},
        {engine({"--kv-max-connections-per-client", "300"}),
         "--kv-max-connections-per-client: must be at most 256"},
        {engine({"--kv-proof-deadline", "0"}), "--kv-proof-deadline: must be greater than 0"},
        {engine({"--kv-proof-deadline", "5"}), "--kv-proof-deadline: must be at most 1"},
        {engine({"--time-scale", "nan"}), "--time-scale: must be a finite number, not nan"},
        {engine({"--time-scale", "inf"}), "--time-scale: must be a finite number, not inf"},
        {engine({"--max-model-len", "10000000000"}), "--max-model-len 10000000000 is above"},
        {engine({"--kv-mode", "bogus"}), "--kv-mode must be push, pull, pull-inline or none"},
        // CLI11's own words were "Check bogus value in {decode->1,prefill->0} OR {1,0} FAILED".
        {engine({"--first-token", "bogus"}), "--first-token: must be prefill or decode, got bogus"},
        {engine({"--first-token", "1"}), "--first-token: must be prefill or decode, got 1"},
        {{"serve", "prefill", "--model", "gpt5"}, "unknown model shape 'gpt5'"},
        {engine({"--secret-file", "/nonexistent/ferry.secret"}), "/nonexistent/ferry.secret"},
        {{"serve", "router", "--port", "0", "--request-timeout", "0"},
         "--request-timeout: must be greater than 0"},
        {{"serve", "router", "--port", "0", "--router-threads", "-1"}, "--router-threads"},
        {{"serve", "router", "--port", "0", "--prefill", "nohost"}, "'nohost' is not HOST:PORT"},
        {{"serve", "local", "--prefill-port", "99999"}, "--prefill-port: Value 99999"},
        {{"bench", "serve", "--num-prompts", "-1"}, "--num-prompts: must not be negative"},
        {{"bench", "serve", "--port", "1", "--request-rate", "-1"},
         "--request-rate must be a number above 0 or inf, not '-1'"},
        {{"bench", "serve", "--port", "1", "--request-rate", "nan"}, "--request-rate"},
        {{"bench", "serve", "--port", "1", "--result-file", "/nonexistent/dir/r.json"},
         "--result-file: /nonexistent/dir/r.json: cannot write in /nonexistent/dir"},
        // Refused as the flags are parsed, not after a run of minutes (the table is not
        // printed: checked below).
        {{"bench", "relay", "--input-len", "64", "--iters", "2000", "--json",
          "/nonexistent/dir/r.json"},
         "--json: /nonexistent/dir/r.json: cannot write in /nonexistent/dir"},
        {{"bench", "xfer", "--json", "/"}, "--json: / is a directory"},
        // An empty value (an unset shell variable) was 0 for a number and the default for a
        // string: a free port, a 0-byte body limit, the default engine id or secret. (CLI11
        // drops empty items of a list: "4096,,8192" is two sizes.)
        {engine({"--port", ""}), "--port: needs a value, got an empty string"},
        {engine({"--tp", ""}), "--tp: needs a value, got an empty string"},
        {engine({"--max-body-bytes", ""}), "--max-body-bytes: needs a value, got an empty"},
        {engine({"--engine-id", ""}), "--engine-id: needs a value, got an empty string"},
        {engine({"--secret-file", ""}), "--secret-file: needs a value, got an empty string"},
        {engine({"--host", ""}), "--host: needs a value, got an empty string"},
        {{"serve", "router", "--port", "0", "--prefill", ""}, "--prefill: needs a value"},
        {{"bench", "xfer", "--seconds", ""}, "--seconds: needs a value, got an empty string"},
        {{"bench", "xfer", "--sizes", ""}, "--sizes: needs a value, got an empty string"},
        {{"bench", "relay", "--input-len", ""}, "--input-len: needs a value, got an empty"},
        {{"bench", "serve", "--label", ""}, "--label: needs a value, got an empty string"},
        {{"--log-level", "", "bench", "relay"}, "--log-level: needs a value"},
        // 0 admitted one prompt per step whatever its length; 0 groups was taken as 1.
        {engine({"--max-num-batched-tokens", "0"}),
         "--max-num-batched-tokens must be at least 1, got 0"},
        {engine({"--push-layer-groups", "0"}),
         "--push-layer-groups must be at least 1 (1: each chunk whole after its step; at most "
         "one group per layer, 2 for tiny), got 0"},
        // Accepted before: an idle timeout of 0 closed every keep-alive connection at once, a
        // chunk below a block computed a fraction of a block per step, and 10^9 sequences or
        // HTTP threads were no bound at all (a burst started threads until the host ran out).
        {engine({"--idle-timeout", "0"}), "--idle-timeout: must be greater than 0, got 0"},
        {{"serve", "router", "--port", "0", "--idle-timeout", "0"}, "--idle-timeout: must be"},
        {engine({"--prefill-chunk", "8"}),
         "--prefill-chunk 8 is below --block-size 16: a chunk is at least one block"},
        {engine({"--max-num-seqs", "1000000000"}),
         "--max-num-seqs must be in [1, 65536], got 1000000000"},
        {engine({"--http-threads", "1000000000"}),
         "--http-threads: must be at most 4096 (each is a thread), got 1000000000"},
        {{"serve", "router", "--port", "0", "--router-threads", "1e9"},
         "--router-threads: must be at most 4096 (each is a thread), got 1e9"},
        {{"serve", "local", "--router-threads", "5000"}, "--router-threads: must be at most 4096"},
        {engine({"--max-connections", "0"}), "--max-connections: must be greater than 0"},
        {engine({"--max-connections-per-client", "0"}),
         "--max-connections-per-client: must be greater than 0"},
        // 10^8 writes in flight ran for minutes before the first point; 10^8 pages per paged
        // write indexed past the page list (SIGSEGV); 10^11 relay iterations ran for days.
        {{"bench", "xfer", "--window", "100000000"},
         "bench xfer: --window must be in [1, 65536], got 100000000"},
        {{"bench", "xfer", "--pages-per-op", "100000000"},
         "bench xfer: --pages-per-op must be in [1, 512], got 100000000"},
        {{"bench", "relay", "--input-len", "16", "--iters", "100000000000"},
         "bench relay: --iters must be in [1, 1000000], got 100000000000"},
        // Every byte its own write: minutes per request.
        {{"bench", "kv", "--max-write", "1"},
         "bench kv: --max-write 1 is below 4096 bytes (0: the engine's default, 67108864)"},
        // Named as the flag it is, not as the KV side channel that bound it first.
        {engine({"--host", "999.1.1.1"}),
         "--host: '999.1.1.1' is neither an IP address nor a name this machine resolves"},
        {engine({"--host", "192.0.2.1"}), "--host: '192.0.2.1' is not an address of this machine"},
        {{"serve", "router", "--port", "0", "--host", "999.1.1.1"}, "--host: '999.1.1.1' is"},
        {{"serve", "local", "--host", "192.0.2.1"}, "--host: '192.0.2.1' is not an address"},
        {{"serve", "local", "--prefill-port", "8300", "--decode-port", "8300"},
         "--decode-port 8300 is --prefill-port too: give each its own port"},
        {{"serve", "decode", "--model", "tiny", "--tp", "1", "--port", "8301", "--kv-port", "8301"},
         "--kv-port 8301 is --port too: give each its own port"},
        // The schedule overflowed and every request went out at once.
        {{"bench", "serve", "--request-rate", "1e-300", "--num-prompts", "3"},
         "--request-rate 1e-300 makes 3 prompts a run of about 3e+300 s, more than 1e9 s"},
        {{"serve", "router", "--port", "0", "--decode", "127.0.0.1:8200,999.1.1.1:8200"},
         "--decode: '999.1.1.1:8200': 999.1.1.1 is not an IPv4 address"},
        // bench serve sent every request to these and reported them all failed.
        {{"bench", "serve", "--port", "0"}, "--port must be in [1, 65535], got 0"},
        {{"bench", "serve", "--host", "999.1.1.1"},
         "--host: '999.1.1.1' is neither an IP address nor a name"},
        {{"bench", "serve", "--endpoint", "v1/completions"},
         "--endpoint 'v1/completions' must be a path starting with '/'"},
        {{"bench", "serve", "--input-len", "10", "--input-len-max", "5"},
         "--input-len-max 5 is below --input-len 10"},
        {{"bench", "serve", "--output-len", "10", "--output-len-max", "5"},
         "--output-len-max 5 is below --output-len 10"},
        {{"bench", "serve", "--verify", "--head-offset", "8"},
         "--head-offset 8 with --tp 8 leaves the 8 KV heads of qwen3-32b"},
        {{"bench", "relay", "--input-len", "-5"}, "--input-len: must not be negative"},
        {{"bench", "relay", "--input-len", "0"}, "input lengths must be at least 1"},
        {{"bench", "xfer", "--sizes", "-1"}, "--sizes: must not be negative"},
        {{"bench", "xfer", "--provider", "bogus", "--sizes", "4096", "--pages", "4096"},
         "provider 'bogus' is not available"},
        {{"bench", "moe", "--ranks", "0"}, "bench moe: --ranks must be in [1, 64], got 0"},
        {{"bench", "moe", "--backend", "bogus"}, "unknown backend 'bogus' (cpu or cuda)"},
        {{"bench", "moe", "--dtype", "fp4"}, "--dtype fp4: use fp8 or bf16"},
        // --tokens 0 ran and reported 0 bytes moved; the counts below ran for days or spawned
        // a thread and its buffers per rank.
        {{"bench", "moe", "--tokens", "0"}, "bench moe: --tokens must be in [1, 65536], got 0"},
        {{"bench", "moe", "--ranks", "1024", "--experts", "1024"},
         "bench moe: --ranks must be in [1, 64], got 1024"},
        {{"bench", "moe", "--iters", "1000000000"},
         "bench moe: --iters must be in [1, 1000000], got 1000000000"},
        {{"bench", "moe", "--iters", "1e11"}, "--iters"},
        {{"bench", "moe", "--warmup", "-1"}, "--warmup: must not be negative, got -1"},
        // cuda flags did nothing on the cpu backend, without a word; a --ranks-per-node that
        // does not divide --ranks was named by the library's field name.
        {{"bench", "moe", "--graph"}, "bench moe: --graph is for --backend cuda, not cpu"},
        {{"bench", "moe", "--backend", "cpu", "--proxy-chunk", "4096"},
         "bench moe: --proxy-chunk is for --backend cuda, not cpu"},
        {{"bench", "moe", "--ranks", "6", "--ranks-per-node", "4"},
         "bench moe: --ranks-per-node 4 must divide --ranks 6 (whole nodes)"},
        {{"bench", "moe", "--ranks-per-node", "0"},
         "bench moe: --ranks-per-node 0 must divide --ranks 8"},
        {{"bench", "moe", "--warmup", "2000000"},
         "bench moe: --warmup must be in [0, 1000000], got 2000000"},
        {{"bench", "kv", "--iters", "1000000000"},
         "bench kv: --iters must be in [1, 1000000], got 1000000000"},
        {{"bench", "kv", "--iters", "1e11"}, "--iters"},
        {{"bench", "kv", "--tp-prefill", "1024", "--kv-heads", "1024"},
         "bench kv: --tp-prefill must be in [1, 64], got 1024"},
        {{"bench", "xfer", "--repeat", "1000000000"},
         "bench xfer: --repeat must be in [1, 1000000], got 1000000000"},
        {{"bench", "xfer", "--latency-iters", "1000000000"},
         "bench xfer: --latency-iters must be in [0, 1000000], got 1000000000"},
        // bench gpu refuses these before it looks for a GPU (there is none here).
        {{"bench", "gpu", "--bytes", "0"}, "bench gpu: --bytes must be in [1, 68719476736], got 0"},
        {{"bench", "gpu", "--bytes", "100000000000"},
         "bench gpu: --bytes must be in [1, 68719476736], got 100000000000"},
        {{"bench", "gpu", "--iters", "0"}, "bench gpu: --iters must be in [1, 1000000], got 0"},
        {{"bench", "gpu", "--iters", "1000000000"},
         "bench gpu: --iters must be in [1, 1000000], got 1000000000"},
        {{"bench", "gpu", "--iters", "-1"}, "--iters: must not be negative, got -1"},
        {{"bench", "gpu", "--iters", "1e11"}, "--iters"},
        {{"bench", "gpu", "--pages", "1"},
         "bench gpu: --pages: 1 B pages make 268435456 pages of --bytes 268435456, at most"},
        {{"bench", "gpu", "--modes", "fastest"},
         "bench gpu: --modes: 'fastest' is not a copy mode (kernel, copy-engine or auto)"},
        {{"bench", "gpu", "--bytes", "4096", "--pages", "8192"},
         "bench gpu: --pages: 8192 is not in [1, --bytes 4096]"},
        {{"bench", "kv", "--block-size", "0"}, "bench kv: --block-size must be at least 1"},
        {{"bench", "kv", "--layers", "0"}, "bench kv: --layers must be at least 1"},
        {{"bench", "kv", "--elem-size", "0"}, "bench kv: --elem-size must be at least 1"},
        {{"bench", "kv", "--tokens", "0"}, "bench kv: --tokens: every count must be at least 1"},
        {{"bench", "kv", "--tokens", "1000000000000"}, "--tokens"},
        {{"bench", "kv", "--mode", "bogus"}, "unknown mode 'bogus'"},
        {{"bench", "kv", "--regions", "bogus"}, "--regions"},
        {{"bench", "xfer", "--sizes", "0"}, "bench xfer: --sizes: every size must be at least 1"},
        {{"bench", "xfer", "--pages", "0"}, "bench xfer: --pages: every size must be at least 1"},
        {{"bench", "xfer", "--rails", "0"}, "bench xfer: --rails must be 1..32, got 0"},
        {{"bench", "xfer", "--seconds", "0"}, "bench xfer: --seconds must be above 0"},
        {{"bench", "xfer", "--seconds", "1e9"},
         "bench xfer: --seconds is per measurement, at most 3600, got 1000000000"},
        {{"bench", "xfer", "--sizes"}, "--sizes: 1 required"},
        {{"bench", "relay", "--input-len", "100000000000"},
         "ferry: out of memory: a size or count flag asks for more than this machine has"},
        {{"bench", "serve", "--port", "1", "--num-prompts", "100000000000"},
         "--num-prompts 100000000000 is above the limit of 100000"},
        {{"bench", "serve", "--port", "1", "--input-len", "100000000000"},
         "--input-len 100000000000 is above the limit"},
        {{"bench", "serve", "--port", "1", "--wait-health", "1e300"},
         "--wait-health: must be at most 1e9, got 1e300"},
        {{"--log-level", "loud", "bench", "relay"}, "--log-level"},
        {{}, "ferry: a command is required: one of bench, topo, serve"},
        {{"serv", "prefill"}, "ferry: unknown command 'serv': use one of bench, topo, serve"},
        {{"--log-level", "info", "bench", "nosuch"},
         "ferry bench: unknown command 'nosuch': use one of xfer"},
        {{"serve"}, "ferry serve: a command is required: one of prefill, decode, router, local"},
        // Both were "a command is required", naming no option.
        {{"--verbose", "bench", "relay"}, "ferry: unknown option '--verbose' (ferry --help)"},
        {{"bench", "--iters=3", "relay"}, "ferry bench: unknown option '--iters'"},
    };
    // All at once: each should end within a fraction of a second.
    std::vector<Proc> procs;
    for (const Bad& k : cases) procs.push_back(start(k.args));
    for (size_t i = 0; i < cases.size(); ++i) {
        const Bad& k = cases[i];
        int code = procs[i].wait_exit(seconds(20));
        std::string out = procs[i].log_text();
        SCOPED_TRACE(joined(k.args));
        EXPECT_GT(code, 0) << out;    // failed, and did not run on (-1)
        EXPECT_LT(code, 128) << out;  // by itself, not by a signal (abort, SIGPIPE)
        EXPECT_NE(out.find(k.says), std::string::npos) << out;
        EXPECT_EQ(out.find("terminate called"), std::string::npos) << out;
        EXPECT_EQ(out.find("KV side channel"), std::string::npos) << out;
        EXPECT_EQ(out.find("relay p50"), std::string::npos) << out;  // no run before the error
    }
}

// The serving library speaks of its own settings (an embedder of serve::Engine has no flags);
// `ferry serve` puts the flag that sets each one in its place. Before, KvPool's and the cost
// model's messages named the command's flags to a library user, and a command user read
// "tp"/"compute_efficiency", not the flags he passed.
TEST_F(CliFlags, TheEngineNamesItsSettingsAndTheCommandItsFlags) {
    struct Case {
        std::function<Status()> library;
        std::vector<std::string> command;
        std::string library_says, command_says;
    };
    auto engine = [](EngineConfig config, ModelShape model, int tp) {
        return [=] {
            auto cost = CostModel::create(model, h200(), tp);
            if (!cost.ok()) return cost.status();
            return Engine::create(config, *cost).status();
        };
    };
    auto cost = [](CostModelConfig config) {
        return [=] { return CostModel::create(tiny_test_model(), h200(), 1, config).status(); };
    };
    // 4*10^9 blocks of Qwen3-32B at TP 8 are 2 PB: more than any address space.
    const std::vector<Case> cases = {
        {engine({.engine_id = "e", .num_blocks = 4000000000}, qwen3_32b(), 8),
         {"serve", "prefill", "--port", "0", "--num-blocks", "4000000000"},
         "lower num_blocks",
         "lower --num-blocks"},
        {engine({.engine_id = "e"}, tiny_test_model(), 3),
         {"serve", "decode", "--port", "0", "--model", "tiny", "--tp", "3"},
         "tp 3 does not divide the 4 query heads and 2 KV heads of 'tiny': pick a tp that "
         "divides both (tp 2 works)",
         "--tp 3 does not divide the 4 query heads and 2 KV heads of 'tiny': pick a --tp that "
         "divides both (--tp 2 works)"},
        {cost({.compute_efficiency = 2}),
         {"serve", "prefill", "--port", "0", "--model", "tiny", "--tp", "1", "--compute-efficiency",
          "2"},
         "compute_efficiency and bandwidth_efficiency must lie in (0, 1], got 2 and 0.8",
         "--compute-efficiency and --bandwidth-efficiency must lie in (0, 1], got 2 and 0.8"},
        {engine({.engine_id = "e", .max_num_seqs = 0}, tiny_test_model(), 1),
         {"serve", "prefill", "--port", "0", "--model", "tiny", "--tp", "1", "--max-num-seqs", "0"},
         "max_num_seqs must be in [1, 65536], got 0",
         "--max-num-seqs must be in [1, 65536], got 0"},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(joined(c.command));
        Status lib = c.library();
        EXPECT_NE(lib.message().find(c.library_says), std::string::npos) << lib.to_string();
        EXPECT_EQ(lib.message().find("--"), std::string::npos) << lib.to_string();
        auto [code, out] = run(c.command);
        EXPECT_GT(code, 0) << out;
        EXPECT_LT(code, 128) << out;
        EXPECT_NE(out.find(c.command_says), std::string::npos) << out;
    }
}

// What an HTTP client is told when it runs into a server's limit names the flag an operator
// raises, on an engine and on a router alike; bench serve --verify's model errors likewise.
// Before, the serving library put the flags' names in its own messages.
TEST_F(CliFlags, AnswersAtALimitNameTheFlagThatSetsIt) {
    const int eport = free_port(), rport = free_port();
    Proc engine =
        start({"serve", "decode", "--model", "tiny", "--tp", "1", "--num-blocks", "64", "--kv-mode",
               "none", "--port", std::to_string(eport), "--max-body-bytes", "200"});
    Proc router = start({"serve", "router", "--port", std::to_string(rport), "--prefill",
                         fmt::format("127.0.0.1:{}", eport), "--decode",
                         fmt::format("127.0.0.1:{}", eport), "--max-body-bytes", "300"});
    ASSERT_TRUE(wait_healthy("127.0.0.1", eport)) << engine.log_text();
    ASSERT_TRUE(eventually([&] { return http_get("127.0.0.1", rport, "/health", seconds(1)).ok(); },
                           seconds(15)))
        << router.log_text();
    const std::string body =
        fmt::format(R"({{"prompt": "{}", "max_tokens": 1}})", std::string(1000, 'a'));
    for (int port : {eport, rport}) {
        auto r = http_post_json("127.0.0.1", port, "/v1/completions", body, seconds(5));
        ASSERT_TRUE(r.ok()) << r.status().to_string();
        EXPECT_EQ(r->status, 413) << r->body;
        EXPECT_NE(r->body.find("(--max-body-bytes)"), std::string::npos) << r->body;
    }
    // The router's own reasons: the decode engine it was given as prefill too.
    std::string health;
    EXPECT_TRUE(eventually([&] {
        auto h = http_get("127.0.0.1", rport, "/health", seconds(1));
        health = h.ok() ? h->body : "";
        return health.find("a decode engine given as a prefill engine: move it to --decode") !=
               std::string::npos;
    })) << health;
    auto [code, out] = run({"bench", "serve", "--port", std::to_string(eport), "--model", "tiny",
                            "--tp", "3", "--verify", "--num-prompts", "1"});
    EXPECT_GT(code, 0) << out;
    EXPECT_LT(code, 128) << out;
    EXPECT_NE(out.find("--tp 3 does not divide"), std::string::npos) << out;
    engine.interrupt();
    router.interrupt();
    EXPECT_EQ(engine.wait_exit(seconds(10)), 0) << engine.log_text();
    EXPECT_EQ(router.wait_exit(seconds(10)), 0) << router.log_text();
}

// A result file appears whole under its name, written beside it and renamed (nothing else is
// left in the folder); a second run replaces it.
TEST_F(CliFlags, JsonResultsAreWrittenWholeUnderTheirName) {
    const std::string path = (dir_ / "relay.json").string();
    for (const std::string len : {"64", "64,128"}) {
        auto [code, out] =
            run({"bench", "relay", "--input-len", len, "--iters", "20", "--json", path});
        ASSERT_EQ(code, 0) << out;
        std::ifstream in(path);
        json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
        ASSERT_FALSE(j.is_discarded()) << out;
        EXPECT_EQ(j["rows"].size(), len == "64" ? 1u : 2u);
        for (const auto& e : std::filesystem::directory_iterator(dir_)) {
            const std::string name = e.path().filename().string();
            EXPECT_TRUE(name == "relay.json" || name.ends_with(".log")) << name;
        }
    }
}

// The temporary file renamed over the name replaced what the name was: a symlink became a file
// (its target untouched), a FIFO a file its reader never saw, and as root `--json /dev/stdout`
// would have replaced /dev/stdout itself. A symlink is now followed and a FIFO written into.
TEST_F(CliFlags, JsonFollowsASymlinkAndWritesIntoAFifo) {
    const std::filesystem::path target = dir_ / "target.json", link = dir_ / "link.json",
                                fifo = dir_ / "results.fifo";
    std::ofstream(target) << "old";
    std::filesystem::create_symlink(target, link);
    ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
    auto [code, out] =
        run({"bench", "relay", "--input-len", "16", "--iters", "2", "--json", link.string()});
    ASSERT_EQ(code, 0) << out;
    EXPECT_TRUE(std::filesystem::is_symlink(link));
    std::ifstream in(target);
    EXPECT_FALSE(json::parse(in, nullptr, false).is_discarded()) << "target not rewritten";

    // Open for reading first (without waiting for a writer): the JSON fits the pipe's buffer,
    // so it is all there once ferry has exited.
    int fd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
    ASSERT_GE(fd, 0);
    std::tie(code, out) =
        run({"bench", "relay", "--input-len", "16", "--iters", "2", "--json", fifo.string()});
    std::string read;
    char buf[4096];
    for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) read.append(buf, size_t(n));
    ::close(fd);
    ASSERT_EQ(code, 0) << out;
    EXPECT_EQ(std::filesystem::status(fifo).type(), std::filesystem::file_type::fifo);
    EXPECT_FALSE(json::parse(read, nullptr, false).is_discarded()) << read;
}

// A provider that does not exist is named once, under one code: the benchmarks' target process
// sent its whole error string, which the parent wrapped under a second code ("unavailable:
// bench target: unavailable: ..."), and at once: bench kv filled a 1 GiB region for its ceiling
// (30 s) before the ceiling's target found the provider missing.
TEST_F(CliFlags, AnUnknownProviderIsOneErrorUnderOneCode) {
    for (const std::string bench : {"kv", "xfer"}) {
        auto [code, out] = run({"bench", bench, "--provider", "bogus"}, seconds(10));
        SCOPED_TRACE(bench + ": " + out);
        EXPECT_EQ(code, 1);
        EXPECT_NE(out.find("provider 'bogus' is not available"), std::string::npos);
        const size_t first = out.find("unavailable:");
        ASSERT_NE(first, std::string::npos);
        EXPECT_EQ(out.find("unavailable:", first + 1), std::string::npos);
    }
}

// bench gpu's target exits at once where there is no GPU: the parent's first frame to it died of
// SIGPIPE (status 141) in about half of the runs, without a word. Here it says why, every time;
// on a GPU host the tiny run succeeds.
TEST_F(CliFlags, BenchGpuWithoutAGpuSaysSoEveryTime) {
    std::vector<Proc> procs;
    for (int i = 0; i < 8; ++i)
        procs.push_back(start({"bench", "gpu", "--bytes", "65536", "--pages", "4096", "--iters",
                               "1", "--modes", "kernel"}));
    for (Proc& p : procs) {
        int code = p.wait_exit(seconds(60));
        std::string out = p.log_text();
        if (code == 0) continue;  // a GPU is there
        EXPECT_EQ(code, 1) << out;
        EXPECT_TRUE(out.find("bench gpu needs a GPU") != std::string::npos ||
                    out.find("no CUDA support") != std::string::npos)
            << out;
    }
}

// A size flag that asks for more memory than the host has is refused before the target
// process is forked, naming the flags and the sum: it was a std::bad_alloc out of both
// processes (two "ferry:" lines, one from the child's copy of the CLI), and below what
// overcommit refuses, minutes of zero-filling and the OOM killer.
TEST_F(CliFlags, SizesPastTheHostsMemoryAreRefusedBeforeAnythingRuns) {
    const std::vector<Bad> cases = {
        {{"bench", "xfer", "--sizes", "99999999999999999999"},
         "bench xfer: the buffers for --sizes up to"},
        {{"bench", "xfer", "--pages", "1099511627776"}, "--pages up to 1099511627776"},
        {{"bench", "xfer", "--rate", "--rate-sizes", "1099511627776"},
         "--rate-sizes up to 1099511627776 for 64 peers"},
        {{"bench", "kv", "--tokens", "4000000000"},
         "bench kv: the prefill and decode pools for --tokens 4000000000 x --layers 64"},
        {{"bench", "kv", "--tokens", "16", "--layers", "4000000000"}, "--layers 4000000000"},
        // Was "cannot allocate 144500006912 bytes of MoE staging" from rank 0, naming no flag.
        {{"bench", "moe", "--hidden", "1000000000", "--ranks", "4", "--experts", "8", "--topk", "2",
          "--tokens", "8"},
         "bench moe: the receive regions and staging of --ranks 4 x --tokens 8 x --hidden "
         "1000000000"},
    };
    for (const Bad& k : cases) {
        auto [code, out] = run(k.args, seconds(10));
        SCOPED_TRACE(joined(k.args));
        EXPECT_EQ(code, 1) << out;
        EXPECT_NE(out.find(k.says), std::string::npos) << out;
        EXPECT_NE(out.find("of this host's"), std::string::npos) << out;
        const size_t first = out.find("ferry:");
        ASSERT_NE(first, std::string::npos) << out;
        EXPECT_EQ(out.find("ferry:", first + 1), std::string::npos) << out;  // one process
    }
}

// Every ferry process had libinfinipath's handlers (loaded with libfabric) for SIGINT, SIGTERM
// and the crash signals, which print a backtrace and call exit(1): Ctrl-C ended a benchmark with
// status 1, and SIGTERM ran the exit path inside the handler, once hanging on a lock (a
// benchmark left running after `timeout`). Now a signal ends the process as that signal.
TEST_F(CliFlags, ASignalEndsABenchmarkAsThatSignal) {
    Proc p = start({"bench", "relay", "--input-len", "4096", "--iters", "1000000"});
    std::this_thread::sleep_for(milliseconds(500));
    p.interrupt();
    int code = p.wait_exit(seconds(5));
    EXPECT_EQ(code, 128 + SIGINT) << p.log_text();
    EXPECT_EQ(p.log_text().find("Backtrace"), std::string::npos) << p.log_text();
}

// libinfinipath's constructor also spends ~0.1-0.2 s calibrating its clock after installing those
// handlers, before main runs: a SIGTERM then (a supervisor stopping what it just started) ended
// `ferry serve` with status 1 and no word. Now the signal waits until main's handling is in
// place: the process ends as SIGTERM, or, once serve's handler is in, stops saying so with 0.
TEST_F(CliFlags, SigtermInServesFirstMomentsIsNeverAFailure) {
    int clean = 0;
    for (int ms : {0, 20, 40, 60, 80, 100, 130, 160, 200, 250, 300, 400, 600}) {
        Proc p = start({"serve", "prefill", "--model", "tiny", "--tp", "1", "--port", "0",
                        "--kv-mode", "none"});
        std::this_thread::sleep_for(milliseconds(ms));
        p.signal(SIGTERM);
        const int code = p.wait_exit(seconds(10));
        const std::string out = p.log_text();
        SCOPED_TRACE(fmt::format("SIGTERM after {} ms", ms));
        EXPECT_TRUE(code == 128 + SIGTERM || code == 0) << "status " << code << ": " << out;
        if (code == 0) {
            ++clean;
            EXPECT_NE(out.find("SIGTERM: stopping"), std::string::npos) << out;
        }
    }
    EXPECT_GT(clean, 0);  // the late ones reached serve's own handler
}

// SIGHUP (the terminal a serve process was started from closing) stops it as cleanly as
// SIGTERM: it said so and exited 0, where by default the signal ended it on the spot.
TEST_F(CliFlags, SighupStopsServeCleanly) {
    Proc p = start(
        {"serve", "prefill", "--model", "tiny", "--tp", "1", "--port", "0", "--kv-mode", "none"});
    const auto deadline = std::chrono::steady_clock::now() + seconds(30);
    while (p.log_text().find("engine ") == std::string::npos &&
           std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(milliseconds(50));
    }
    ASSERT_NE(p.log_text().find("engine "), std::string::npos) << p.log_text();
    p.signal(SIGHUP);
    const int code = p.wait_exit(seconds(10));
    EXPECT_EQ(code, 0) << p.log_text();
    EXPECT_NE(p.log_text().find("SIGHUP: stopping"), std::string::npos) << p.log_text();
}

// bench serve waits for the router's /health itself, saying so, and gives up at its deadline
// naming the URL; requests go out only once it answers 200.
TEST_F(CliFlags, BenchServeWaitsForHealthThenRunsOrFailsNamingTheUrl) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);  // bound, not listening
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    std::string dead = std::to_string(ntohs(a.sin_port));
    TimePoint t0 = Clock::now();
    // 1.5 s: a fraction was printed rounded ("--wait-health 0.5": "waiting up to 0 s").
    auto [code, out] = run({"bench", "serve", "--port", dead, "--wait-health", "1.5",
                            "--num-prompts", "1", "--input-len", "8", "--output-len", "2"});
    double ms = to_ms(Clock::now() - t0);
    EXPECT_EQ(code, 2) << out;
    EXPECT_NE(out.find("waiting up to 1.5 s for http://127.0.0.1:" + dead + "/health"),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("http://127.0.0.1:" + dead + "/health did not answer 200 within 1.5 s"),
              std::string::npos)
        << out;
    EXPECT_LT(ms, 5000.0);

    // Ctrl-C while it waits: it stops at once, with the status of an interrupted run.
    Proc waiting = start({"bench", "serve", "--port", dead, "--wait-health", "60"});
    EXPECT_TRUE(
        eventually([&] { return waiting.log_text().find("waiting up to") != std::string::npos; },
                   seconds(10)));
    waiting.interrupt();
    EXPECT_EQ(waiting.wait_exit(seconds(3)), 130) << waiting.log_text();
    EXPECT_NE(waiting.log_text().find("interrupted while waiting for http://127.0.0.1:" + dead),
              std::string::npos)
        << waiting.log_text();
    ::close(fd);

    // Healthy after 1.5 s: no request before that.
    TimePoint healthy_at = Clock::now() + milliseconds(1500);
    std::atomic<int> early{0}, requests{0};
    std::vector<HttpRoute> routes;
    routes.push_back({"GET", "/health", [&](const HttpRequest&, HttpReply& r) {
                          if (Clock::now() >= healthy_at) return;
                          r.status = 503;
                          r.body = R"({"error": {"message": "engines not ready"}})";
                      }});
    routes.push_back({"POST", "/v1/completions", [&](const HttpRequest&, HttpReply& r) {
                          if (Clock::now() < healthy_at) ++early;
                          ++requests;
                          r.status = 400;
                          r.body = R"({"error": {"message": "test server"}})";
                      }});
    auto server = HttpServer::start({}, std::move(routes));
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    std::string port = std::to_string((*server)->port());
    auto [code2, out2] = run({"bench", "serve", "--port", port, "--num-prompts", "2", "--input-len",
                              "8", "--output-len", "2"});
    EXPECT_EQ(code2, 3) << out2;  // ran, and both requests failed (the test server's 400)
    EXPECT_NE(out2.find("engines not ready"), std::string::npos) << out2;
    EXPECT_NE(out2.find("/health is up after"), std::string::npos) << out2;
    EXPECT_EQ(requests.load(), 2);
    EXPECT_EQ(early.load(), 0);
}

// Against a server of another make (or a proxy), events and error bodies of other shapes fail
// their requests, naming what came: value(), [] and get<> threw in the request threads, and
// the process died with "terminate called".
TEST_F(CliFlags, BenchServeAgainstAServerOfAnotherShapeFailsItsRequestsNamingWhy) {
    struct Odd {
        int status;
        std::string body;  // an SSE event's data when status is 200
        std::string says;
    };
    const std::vector<Odd> cases = {
        {200, R"({"error": "overloaded"})", "failed x2: overloaded"},
        {200, R"({"error": {"message": 5}})", "failed x2: 5"},
        {200, R"({"choices": "x"})", "choices[0].token_ids is not an array of token ids"},
        {200, R"({"choices": [{"token_ids": ["a"]}]})", "is not an array of token ids"},
        {200, R"({"choices": [{"token_ids": [1e40]}]})", "is not an array of token ids"},
        {400, R"({"error": {"message": ["x"]}})", R"(failed x2: HTTP 400: ["x"])"},
        {400, R"({"error": 7})", "failed x2: HTTP 400: 7"},
    };
    for (const Odd& k : cases) {
        SCOPED_TRACE(k.body);
        std::vector<HttpRoute> routes;
        routes.push_back({"POST", "/v1/completions", [k](const HttpRequest&, HttpReply& r) {
                              r.status = k.status;
                              if (k.status != 200) {
                                  r.body = k.body;
                                  return;
                              }
                              r.content_type = "text/event-stream";
                              std::string ev = "data: " + k.body + "\n\n";
                              r.stream = [ev](const ChunkWriter& write) { write(ev); };
                          }});
        auto server = HttpServer::start({}, std::move(routes));
        ASSERT_TRUE(server.ok()) << server.status().to_string();
        auto [code, out] =
            run({"bench", "serve", "--port", std::to_string((*server)->port()), "--num-prompts",
                 "2", "--input-len", "4", "--output-len", "2", "--wait-health", "0"});
        EXPECT_EQ(code, 3) << out;  // ran, and both requests failed
        EXPECT_NE(out.find(k.says), std::string::npos) << out;
        EXPECT_EQ(out.find("terminate called"), std::string::npos) << out;
    }
}

TEST_F(CliFlags, APortInUseIsNamedAndHelpExitsZero) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    ASSERT_EQ(::listen(fd, 1), 0);
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    std::string port = std::to_string(ntohs(a.sin_port));
    auto [code, out] = run({"serve", "router", "--port", port});
    EXPECT_GT(code, 0) << out;
    EXPECT_LT(code, 128) << out;
    EXPECT_NE(out.find("cannot bind 127.0.0.1:" + port), std::string::npos) << out;
    EXPECT_NE(out.find("pick another --port"), std::string::npos) << out;
    // The same port given to serve local's prefill engine, and to an engine's side channel:
    // each message names the flag that gave it.
    const std::string free1 = std::to_string(free_port()), free2 = std::to_string(free_port());
    for (const auto& [args, flag] :
         {std::pair<std::vector<std::string>, std::string>{
              {"serve", "local", "--model", "tiny", "--tp", "1", "--port", free1, "--prefill-port",
               port, "--decode-port", free2},
              "pick another --prefill-port"},
          {{"serve", "decode", "--model", "tiny", "--tp", "1", "--port", free1, "--kv-port", port},
           "pick another --kv-port"}}) {
        auto [c, o] = run(args);
        EXPECT_GT(c, 0) << joined(args) << o;
        EXPECT_LT(c, 128) << joined(args) << o;
        EXPECT_NE(o.find(flag), std::string::npos) << joined(args) << o;
    }
    ::close(fd);

    for (std::vector<std::string> args : {std::vector<std::string>{"--help"},
                                          {"serve", "prefill", "--help"},
                                          {"bench", "serve", "--help"}}) {
        auto [help_code, help] = run(args);
        EXPECT_EQ(help_code, 0) << joined(args) << help;
        EXPECT_NE(help.find("Usage:"), std::string::npos) << help;
    }
}

// --latency-iters 0 is in range: the run skips the latency point. It crashed (a ping-pong of
// zero round trips never ended, and its callbacks wrote into the returned call's stack).
// --repeat 3 adds the median of the pairs' ratios.
TEST_F(CliFlags, BenchXferWithoutLatencyItersRunsAndPrintsTheMedian) {
    auto [code, out] = run({"bench", "xfer", "--provider", "shm", "--sizes", "4096", "--pages",
                            "4096", "--latency-iters", "0", "--repeat", "3", "--seconds", "0.02"},
                           seconds(60));
    SCOPED_TRACE(out);
    EXPECT_EQ(code, 0);
    EXPECT_NE(out.find("median"), std::string::npos);
    EXPECT_NE(out.find("write            4 KiB"), std::string::npos);
    EXPECT_EQ(out.find("one-way"), std::string::npos);  // no latency point
}

// `bench moe --ranks 2` on the cpu backend was refused ("ranks_per_node 4 must divide
// world_size 2"): the default of 4 ranks per node now gives way to the largest divisor of --ranks.
TEST_F(CliFlags, BenchMoeOnCpuDefaultsToNodesThatDivideTheRanks) {
    for (const std::string ranks : {"2", "6"}) {
        auto [code, out] =
            run({"bench", "moe", "--ranks", ranks, "--tokens", "4", "--hidden", "128", "--experts",
                 "12", "--topk", "2", "--iters", "1", "--warmup", "0"},
                seconds(60));
        SCOPED_TRACE(out);
        EXPECT_EQ(code, 0);
        EXPECT_NE(out.find(fmt::format("{} ranks ({} per node", ranks, ranks == "2" ? 2 : 3)),
                  std::string::npos);
    }
}

// `ferry --version` said "a command is required".
TEST_F(CliFlags, VersionPrintsTheVersionAndExitsZero) {
    auto [code, out] = run({"--version"});
    EXPECT_EQ(code, 0) << out;
    EXPECT_EQ(out, "ferry " FERRY_VERSION_OF_TEST "\n");
}

// `serve local --engine-id X` gave both engines the id X and stopped at once ("engine id used
// twice: X"), whatever X was: the engines are now X-prefill and X-decode.
TEST_F(CliFlags, ServeLocalEngineIdNamesBothEngines) {
    const int port = free_port(), prefill = free_port(), decode = free_port();
    Proc p = start({"serve", "local", "--engine-id", "X", "--model", "tiny", "--tp", "1", "--port",
                    std::to_string(port), "--prefill-port", std::to_string(prefill),
                    "--decode-port", std::to_string(decode)});
    ASSERT_TRUE(wait_healthy("127.0.0.1", port)) << p.log_text();
    for (const auto& [at, id] : {std::pair{prefill, "X-prefill"}, std::pair{decode, "X-decode"}}) {
        auto r = http_get("127.0.0.1", at, "/health", seconds(5));
        ASSERT_TRUE(r.ok()) << r.status().to_string();
        EXPECT_EQ(nlohmann::json::parse(r->body)["engine_id"], id) << r->body;
    }
    p.interrupt();
    EXPECT_EQ(p.wait_exit(seconds(10)), 0) << p.log_text();
}

// serve local's KV lease is the KV wait (--kv-wait-timeout) unless --lease is given: a prefill
// leg nobody collects holds its blocks that long. Before, the lease was 30 s whatever
// --kv-wait-timeout said: a decode leg gave up after 1 s while prefill held blocks for it 29 s
// more.
TEST_F(CliFlags, ServeLocalHoldsALegsBlocksForTheKvWait) {
    const int port = free_port(), prefill = free_port(), decode = free_port();
    Proc p = start({"serve", "local", "--model", "tiny", "--tp", "1", "--port",
                    std::to_string(port), "--prefill-port", std::to_string(prefill),
                    "--decode-port", std::to_string(decode), "--kv-wait-timeout", "1"});
    ASSERT_TRUE(wait_healthy("127.0.0.1", port)) << p.log_text();
    const json leg = {
        {"prompt", prompt_of(40, 1)},
        {"max_tokens", 1},
        {"kv_transfer_params", {{"do_remote_decode", true}, {"transfer_id", "orphan"}}}};
    auto r = http_post_json("127.0.0.1", prefill, "/v1/completions", leg.dump(), seconds(10));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    ASSERT_EQ(r->status, 200) << r->body;
    // The lease ends the hand-over as failed and gives the blocks back; 15 s is well past 1 s
    // on a loaded machine and well before 30.
    EXPECT_TRUE(eventually(
        [&] {
            return metric("127.0.0.1", prefill, "ferry_kv_transfer_failures_total") == 1 &&
                   metric("127.0.0.1", prefill, "ferry_kv_blocks_used") == 0;
        },
        seconds(15)))
        << "blocks used " << metric("127.0.0.1", prefill, "ferry_kv_blocks_used");
    p.interrupt();
    EXPECT_EQ(p.wait_exit(seconds(10)), 0) << p.log_text();
}

// /dev/shm entries of processes that no longer exist, by the pid in their name: libfabric's
// default "<pid>:<n>:<m>" or ferry's "ferry_<pid>_...".
std::set<std::string> shm_files_of_dead_processes() {
    std::set<std::string> out;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
        std::string name = e.path().filename().string();
        std::string digits = name.starts_with("ferry_") ? name.substr(6) : name;
        long pid = std::strtol(digits.c_str(), nullptr, 10);
        if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) out.insert(name);
    }
    return out;
}

size_t shm_file_count() {
    std::error_code ec;
    size_t n = 0;
    for (auto it = std::filesystem::directory_iterator("/dev/shm", ec);
         it != std::filesystem::directory_iterator(); it.increment(ec))
        ++n;
    return n;
}

// `bench xfer --rate` over shm opens 65 raw endpoints in its target process, a 16 MiB file in
// /dev/shm each. A run ended by Ctrl-C, `timeout` or SIGKILL left them all there under
// libfabric's default names, which nothing removes (1 GiB after a few runs; a container's
// /dev/shm is 64 MiB). Now the target ends with its parent by SIGTERM, which removes its files,
// and what a SIGKILLed parent leaves carries ferry's name: the next shm engine removes it.
TEST_F(CliFlags, ABenchEndedByASignalLeavesNoShmFileBehind) {
    for (int sig : {SIGINT, SIGTERM, SIGKILL}) {
        SCOPED_TRACE(strsignal(sig));
        const std::set<std::string> before = shm_files_of_dead_processes();
        const size_t files_before = shm_file_count();
        Proc p = start({"bench", "xfer", "--provider", "shm", "--rate-only", "--rate-peers", "8",
                        "--rate-rows", "batch", "--seconds", "5"});
        // The target's 65 endpoints are open once /dev/shm holds them.
        TimePoint deadline = Clock::now() + seconds(30);
        while (shm_file_count() < files_before + 60 && Clock::now() < deadline)
            std::this_thread::sleep_for(milliseconds(20));
        ASSERT_GE(shm_file_count(), files_before + 60) << p.log_text();
        p.signal(sig);
        EXPECT_EQ(p.wait_exit(seconds(10)), 128 + sig) << p.log_text();
        // The target goes with its parent; a fresh shm engine then sweeps what is left.
        std::set<std::string> left;
        deadline = Clock::now() + seconds(10);
        do {
            std::this_thread::sleep_for(milliseconds(100));
            ferry::EngineConfig cfg;
            cfg.provider = "shm";
            auto engine = TransferEngine::create(cfg);
            ASSERT_TRUE(engine.ok()) << engine.status().to_string();
            left.clear();
            for (const std::string& f : shm_files_of_dead_processes())
                if (!before.count(f)) left.insert(f);
        } while (!left.empty() && Clock::now() < deadline);
        EXPECT_TRUE(left.empty()) << left.size() << " files left, e.g. " << *left.begin();
    }
}

}  // namespace
}  // namespace ferry::serve::testing

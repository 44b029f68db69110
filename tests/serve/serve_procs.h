// Real `ferry serve …` processes for end-to-end tests: spawned from the built binary, logs in
// a temporary folder (printed when a test fails), stopped with SIGTERM and then SIGKILL, each
// wait bounded. Header only: the test glob builds *_test.cc files alone.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "serve/cost_model.h"
#include "serve/http.h"
#include "serve/openai_api.h"
#include "serve/synthetic_model.h"

extern char** environ;

namespace ferry::serve::testing {

using nlohmann::json;

// A port free right now on `host` (the kernel's pick) and not handed out before by this test
// process: the kernel picks again a port just closed, and two picks of one test (prefill's HTTP
// port and decode's --kv-port, say) once came out equal before either process bound it. The
// process that binds it next races nobody but other tests of this machine.
inline int free_port(const std::string& host = "127.0.0.1") {
    static std::mutex mu;
    static std::set<int> handed_out;
    std::lock_guard<std::mutex> lock(mu);
    for (int attempt = 0; attempt < 64; ++attempt) {
        int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        ::inet_pton(AF_INET, host.c_str(), &a.sin_addr);
        if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
            ::close(fd);
            return 0;
        }
        socklen_t len = sizeof a;
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
        ::close(fd);
        int port = ntohs(a.sin_port);
        if (handed_out.insert(port).second) return port;
    }
    return 0;
}

class Proc {
  public:
    Proc() = default;
    Proc(const Proc&) = delete;
    Proc& operator=(const Proc&) = delete;
    Proc(Proc&& o) noexcept : pid_(o.pid_), log_(std::move(o.log_)) { o.pid_ = -1; }
    // Stops the process this one held first.
    Proc& operator=(Proc&& o) noexcept {
        if (this == &o) return *this;
        stop();
        pid_ = o.pid_;
        log_ = std::move(o.log_);
        o.pid_ = -1;
        return *this;
    }
    ~Proc() { stop(); }

    // argv[0] is the program; output goes to `log`.
    static Proc spawn(const std::vector<std::string>& argv, const std::string& log) {
        Proc p;
        p.log_ = log;
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        posix_spawn_file_actions_adddup2(&fa, 1, 2);
        std::vector<char*> args;
        for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
        args.push_back(nullptr);
        pid_t pid = -1;
        if (posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ) != 0) pid = -1;
        posix_spawn_file_actions_destroy(&fa);
        p.pid_ = pid;
        return p;
    }

    bool running() const {
        if (pid_ <= 0) return false;
        int st = 0;
        return ::waitpid(pid_, &st, WNOHANG) == 0;
    }
    void interrupt() { signal(SIGINT); }
    void signal(int sig) {
        if (pid_ > 0) ::kill(pid_, sig);
    }
    void kill_now() {
        if (pid_ <= 0) return;
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        pid_ = -1;
    }
    // Waits up to `budget` for the process to end by itself: its exit status, 128 + the signal
    // that ended it, or -1 when it still ran (it is killed then).
    int wait_exit(Duration budget) {
        if (pid_ <= 0) return -1;
        TimePoint deadline = Clock::now() + budget;
        while (Clock::now() < deadline) {
            int st = 0;
            if (::waitpid(pid_, &st, WNOHANG) == pid_) {
                pid_ = -1;
                return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        kill_now();
        return -1;
    }
    // SIGTERM, then SIGKILL after 5 s.
    void stop() {
        if (pid_ <= 0) return;
        ::kill(pid_, SIGTERM);
        for (int i = 0; i < 500; ++i) {
            if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
                pid_ = -1;
                return;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        kill_now();
    }
    std::string log_text() const {
        std::ifstream in(log_);
        std::stringstream ss;
        ss << in.rdbuf();
        return ss.str();
    }

  private:
    pid_t pid_ = -1;
    std::string log_;
};

inline std::string ferry_binary() { return FERRY_CLI_PATH; }

// `ferry serve <role>` (prefill or decode) of the tiny model at TP 1 on `port`, then `flags`
// as given (each test adds its KV mode, provider, deadlines; a flag given twice is an error).
inline std::vector<std::string> engine_argv(const std::string& role, int port,
                                            const std::vector<std::string>& flags = {}) {
    std::vector<std::string> argv = {
        ferry_binary(), "serve", role,   "--port", std::to_string(port),
        "--model",      "tiny",  "--tp", "1"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    return argv;
}

// a, then b.
inline std::vector<std::string> operator+(std::vector<std::string> a,
                                          const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

// The deadlines of tests that check blocks come back: a small pool, a 3 s KV lease, decode legs
// waiting 5 s for their KV, a side channel on a free port.
inline std::vector<std::string> short_kv_deadlines() {
    return {"--num-blocks", "256", "--kv-port", "0", "--kv-lease", "3", "--kv-wait-timeout", "5"};
}

// Until /health answers 200, which means ready: an engine's KV link is reachable, a router
// has at least one ready prefill and one ready decode engine (503 before, with the reason).
inline bool wait_healthy(const std::string& host, int port, Duration budget = seconds(15)) {
    TimePoint deadline = Clock::now() + budget;
    while (Clock::now() < deadline) {
        auto r = http_get(host, port, "/health", milliseconds(500));
        if (r.ok() && r->status == 200) return true;
        std::this_thread::sleep_for(milliseconds(50));
    }
    return false;
}

// Until a router's /health lists every engine of both roles as ready. 200 needs only one of
// each: a test that counts how requests were spread waits for all, or the router's prober may
// not have seen the second engine yet and send every request to the first.
inline bool wait_router_sees_all(const std::string& host, int port, Duration budget = seconds(15)) {
    TimePoint deadline = Clock::now() + budget;
    while (Clock::now() < deadline) {
        auto r = http_get(host, port, "/health", milliseconds(500));
        if (r.ok() && r->status == 200) {
            auto j = nlohmann::json::parse(r->body, nullptr, false);
            bool all = !j.is_discarded();
            for (const char* role : {"prefill", "decode"}) {
                if (!all || !j.contains(role)) {
                    all = false;
                    break;
                }
                for (const auto& e : j[role]) all = all && e.value("ready", false);
            }
            if (all) return true;
        }
        std::this_thread::sleep_for(milliseconds(50));
    }
    return false;
}

// A metric's value (first series of that name), -1 when missing or unreachable.
inline double metric(const std::string& host, int port, const std::string& name) {
    auto r = http_get(host, port, "/metrics", seconds(5));
    if (!r.ok()) return -1;
    size_t at = r->body.find("\n" + name + " ");
    if (at == std::string::npos) return -1;
    return std::stod(r->body.substr(at + name.size() + 2));
}

template <typename F>
bool eventually(F pred, Duration budget = seconds(5)) {
    TimePoint deadline = Clock::now() + budget;
    while (Clock::now() < deadline) {
        if (pred()) return true;
        std::this_thread::sleep_for(milliseconds(20));
    }
    return pred();
}

struct Streamed {
    Status transport;
    int status = 0;
    std::vector<int32_t> tokens;
    bool error_event = false;
    bool done = false;
    std::string raw;
};

// Streams a completion; `on_token` (optional) runs after every token.
inline Streamed stream(const std::string& host, int port, const json& body, Duration timeout,
                       const std::function<void(size_t)>& on_token = {}) {
    Streamed s;
    SseParser parser;
    s.transport = http_post_stream(host, port, "/v1/completions", body.dump(), timeout, &s.status,
                                   [&](std::string_view d) {
                                       s.raw.append(d);
                                       if (s.status != 200) return true;
                                       for (auto& ev : parser.feed(d)) {
                                           if (ev == "[DONE]") {
                                               s.done = true;
                                               continue;
                                           }
                                           json j = json::parse(ev, nullptr, false);
                                           if (j.is_discarded() || j.contains("error")) {
                                               s.error_event = true;
                                               continue;
                                           }
                                           for (auto& t : j["choices"][0]["token_ids"]) {
                                               s.tokens.push_back(t.get<int32_t>());
                                               if (on_token) on_token(s.tokens.size());
                                           }
                                       }
                                       return true;
                                   });
    return s;
}

inline std::vector<int32_t> prompt_of(size_t n, int seed) {
    std::vector<int32_t> p(n);
    for (size_t i = 0; i < n; ++i) p[i] = int32_t((i * 31 + seed * 7 + i * i) % 1000);
    return p;
}

// What a decode engine of the tiny model at TP 1 generates for `prompt`.
inline std::vector<int32_t> tiny_expected(const std::vector<int32_t>& prompt, int n) {
    auto model = tiny_test_model();
    auto cost = CostModel::create(model, h200(), 1).value();
    KvSlice slice{.layout = cost.kv_layout(16, 1), .head_offset = 0, .vocab = model.vocab};
    return expected_tokens(slice, prompt, n);
}

}  // namespace ferry::serve::testing

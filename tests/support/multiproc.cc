#include "support/multiproc.h"

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <thread>

namespace ferry::testing {
namespace {

enum FrameType : uint32_t { kAllgather = 1, kResult = 2 };

bool write_full(int fd, const void* p, size_t n) {
    auto* c = static_cast<const char*>(p);
    while (n) {
        ssize_t w = ::write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        c += w;
        n -= static_cast<size_t>(w);
    }
    return true;
}

bool read_full(int fd, void* p, size_t n) {
    auto* c = static_cast<char*>(p);
    while (n) {
        ssize_t r = ::read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        c += r;
        n -= static_cast<size_t>(r);
    }
    return true;
}

bool send_frame(int fd, uint32_t type, std::span<const uint8_t> payload) {
    uint32_t hdr[2] = {type, static_cast<uint32_t>(payload.size())};
    return write_full(fd, hdr, sizeof(hdr)) && write_full(fd, payload.data(), payload.size());
}

bool recv_frame(int fd, uint32_t* type, std::vector<uint8_t>* payload) {
    uint32_t hdr[2];
    if (!read_full(fd, hdr, sizeof(hdr))) return false;
    *type = hdr[0];
    payload->resize(hdr[1]);
    return read_full(fd, payload->data(), hdr[1]);
}

// A child killed by a signal cannot unlink its shm regions; the engine names them
// "ferry_<pid>_...", so the parent can.
void remove_shm_regions(pid_t pid) {
    std::string prefix = "ferry_" + std::to_string(pid) + "_";
    DIR* d = opendir("/dev/shm");
    if (!d) return;
    while (dirent* e = readdir(d)) {
        if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) {
            ::unlink((std::string("/dev/shm/") + e->d_name).c_str());
        }
    }
    closedir(d);
}

}  // namespace

Result<std::vector<std::vector<uint8_t>>> Exchange::allgather(std::span<const uint8_t> mine) {
    if (!send_frame(fd_, kAllgather, mine)) return unavailable("test hub is gone");
    uint32_t type = 0;
    std::vector<uint8_t> reply;
    if (!recv_frame(fd_, &type, &reply)) return unavailable("test hub is gone");
    std::vector<std::vector<uint8_t>> out(size_);
    size_t pos = 0;
    for (int i = 0; i < size_; ++i) {
        uint32_t len = 0;
        std::memcpy(&len, reply.data() + pos, 4);
        pos += 4;
        out[i].assign(reply.begin() + pos, reply.begin() + pos + len);
        pos += len;
    }
    return out;
}

Status Exchange::barrier() {
    auto r = allgather({});
    return r.ok() ? ok_status() : r.status();
}

Result<std::vector<long>> Exchange::pids() {
    const long me = static_cast<long>(::getpid());
    auto all = allgather({reinterpret_cast<const uint8_t*>(&me), sizeof(me)});
    if (!all.ok()) return all.status();
    std::vector<long> out(all->size(), 0);
    for (size_t i = 0; i < out.size(); ++i) {
        if ((*all)[i].size() == sizeof(long)) std::memcpy(&out[i], (*all)[i].data(), sizeof(long));
    }
    return out;
}

std::vector<ChildResult> run_processes(int n, const ChildFn& fn, Duration timeout) {
    std::fflush(stdout);
    std::fflush(stderr);
    std::vector<int> fds(n, -1);
    std::vector<pid_t> pids(n, -1);
    std::vector<ChildResult> results(n);
    for (int i = 0; i < n; ++i) {
        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
            results[i].error = std::string("socketpair failed: ") + std::strerror(errno);
            continue;
        }
        pid_t pid = fork();
        if (pid == 0) {
            ::close(sv[0]);
            for (int j = 0; j < i; ++j)
                if (fds[j] >= 0) ::close(fds[j]);
            Exchange ex(i, n, sv[1]);
            std::string err;
            try {
                err = fn(ex);
            } catch (const std::exception& e) {
                err = std::string("exception: ") + e.what();
            }
            send_frame(sv[1], kResult, {reinterpret_cast<const uint8_t*>(err.data()), err.size()});
            std::fflush(stdout);
            std::fflush(stderr);
            _exit(err.empty() ? 0 : 1);
        }
        ::close(sv[1]);
        fds[i] = sv[0];
        pids[i] = pid;
        results[i].rank = i;
    }

    // Hub: serve allgather rounds until every child closed its end.
    std::vector<bool> open(n), in_round(n, false);
    std::vector<std::vector<uint8_t>> round(n);
    for (int i = 0; i < n; ++i) open[i] = fds[i] >= 0;
    auto deadline = deadline_after(timeout);
    auto maybe_complete_round = [&] {
        bool any = false;
        for (int i = 0; i < n; ++i) {
            if (open[i] && !in_round[i]) return;
            any = any || in_round[i];
        }
        if (!any) return;
        std::vector<uint8_t> reply;
        for (int i = 0; i < n; ++i) {
            uint32_t len = in_round[i] ? static_cast<uint32_t>(round[i].size()) : 0;
            reply.insert(reply.end(), reinterpret_cast<uint8_t*>(&len),
                         reinterpret_cast<uint8_t*>(&len) + 4);
            if (in_round[i]) reply.insert(reply.end(), round[i].begin(), round[i].end());
        }
        for (int i = 0; i < n; ++i) {
            if (open[i] && in_round[i]) send_frame(fds[i], kAllgather, reply);
            in_round[i] = false;
            round[i].clear();
        }
    };
    bool timed_out = false;
    while (true) {
        std::vector<pollfd> pfds;
        std::vector<int> idx;
        for (int i = 0; i < n; ++i) {
            if (open[i]) {
                pfds.push_back({fds[i], POLLIN, 0});
                idx.push_back(i);
            }
        }
        if (pfds.empty()) break;
        if (Clock::now() > deadline) {
            timed_out = true;
            break;
        }
        int rc = ::poll(pfds.data(), pfds.size(), 100);
        if (rc <= 0) continue;
        for (size_t k = 0; k < pfds.size(); ++k) {
            if (!(pfds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            int i = idx[k];
            uint32_t type = 0;
            std::vector<uint8_t> payload;
            if (!recv_frame(fds[i], &type, &payload)) {
                open[i] = false;
                in_round[i] = false;
                ::close(fds[i]);
                continue;
            }
            if (type == kAllgather) {
                round[i] = std::move(payload);
                in_round[i] = true;
            } else if (type == kResult) {
                results[i].error.assign(payload.begin(), payload.end());
            }
        }
        maybe_complete_round();
    }
    for (int i = 0; i < n; ++i) {
        if (pids[i] <= 0) continue;
        if (timed_out) ::kill(pids[i], SIGKILL);
        int status = 0;
        while (waitpid(pids[i], &status, 0) < 0 && errno == EINTR) {
        }
        if (WIFEXITED(status)) {
            results[i].exit_code = WEXITSTATUS(status);
        } else if (WIFSIGNALED(status)) {
            results[i].term_signal = WTERMSIG(status);
            remove_shm_regions(pids[i]);
        }
        if (timed_out && results[i].error.empty() && open[i]) {
            results[i].error = "still running at the test's deadline: killed (hang?)";
        }
        if (open[i]) ::close(fds[i]);
    }
    return results;
}

std::string describe_failures(const std::vector<ChildResult>& results) {
    std::string out;
    for (const auto& r : results) {
        if (r.ok()) continue;
        out += fmt::format("rank {}: exit={} signal={} {}\n", r.rank, r.exit_code, r.term_signal,
                           r.error);
    }
    return out;
}

uint64_t test_seed(const char* test_name) {
    uint64_t seed;
    if (const char* env = std::getenv("FERRY_TEST_SEED")) {
        seed = std::strtoull(env, nullptr, 0);
    } else {
        seed = std::random_device{}();
        seed = seed << 32 | std::random_device{}();
    }
    std::printf("[seed] %s: FERRY_TEST_SEED=%llu\n", test_name,
                static_cast<unsigned long long>(seed));
    std::fflush(stdout);
    return seed;
}

bool stop_process(long pid, Duration timeout) {
    if (::kill(static_cast<pid_t>(pid), SIGSTOP) != 0) return false;
    TimePoint until = Clock::now() + timeout;
    do {
        // /proc/<pid>/stat: "pid (comm) S ...", the state after the last ')'; 'T' once stopped.
        std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
        std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
        size_t close = stat.rfind(')');
        if (close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'T') {
            return true;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    } while (Clock::now() < until);
    return false;
}

}  // namespace ferry::testing

#include "bench/target_process.h"

#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

namespace ferry::bench {
namespace {

// Waits until `fd` has something to read (or its peer closed it) or `deadline` passes.
bool readable_by(int fd, std::optional<TimePoint> deadline) {
    if (!deadline) return true;
    for (;;) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now());
        if (left.count() < 0) return false;
        pollfd p{fd, POLLIN, 0};
        int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
        if (r > 0) return true;
        if (r < 0 && errno != EINTR) return false;
    }
}

bool read_all(int fd, void* into, size_t n, std::optional<TimePoint> deadline) {
    auto* c = static_cast<uint8_t*>(into);
    while (n) {
        if (!readable_by(fd, deadline)) return false;
        ssize_t r = ::read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        c += r;
        n -= r;
    }
    return true;
}

}  // namespace

bool send_frame(int fd, std::span<const uint8_t> b) {
    uint32_t n = static_cast<uint32_t>(b.size());
    std::vector<uint8_t> f(reinterpret_cast<uint8_t*>(&n), reinterpret_cast<uint8_t*>(&n) + 4);
    f.insert(f.end(), b.begin(), b.end());
    size_t off = 0;
    while (off < f.size()) {
        ssize_t w = ::send(fd, f.data() + off, f.size() - off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        off += w;
    }
    return true;
}

bool recv_frame(int fd, std::vector<uint8_t>* out, std::optional<Duration> within) {
    std::optional<TimePoint> deadline;
    if (within) deadline = Clock::now() + *within;
    uint32_t n = 0;
    if (!read_all(fd, &n, 4, deadline)) return false;
    out->resize(n);
    return read_all(fd, out->data(), n, deadline);
}

Result<TargetProcess> TargetProcess::start(const std::function<int(int fd)>& main) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return unavailable(std::string("socketpair: ") + std::strerror(errno));
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid < 0) {
        int e = errno;
        ::close(sv[0]);
        ::close(sv[1]);
        return unavailable(std::string("fork: ") + std::strerror(e));
    }
    if (pid == 0) {
        ::close(sv[0]);
        // SIGTERM, not SIGKILL: libfabric's shm provider removes its regions in /dev/shm on
        // SIGTERM (a SIGKILLed target left `--rate`'s 65 of 16 MiB each when its parent was
        // stopped). The parent may have died between fork and prctl: then nothing would send
        // the signal.
        if (::prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || ::getppid() != parent) _exit(1);
        int code = 1;
        try {
            code = main(sv[1]);
        } catch (...) {
            // The parent reports the failure (the target is gone); nothing of the parent's
            // stack or exit path may run here.
        }
        _exit(code);
    }
    ::close(sv[1]);
    TargetProcess t;
    t.pid_ = pid;
    t.fd_ = sv[0];
    return t;
}

TargetProcess::TargetProcess(TargetProcess&& o) noexcept : pid_(o.pid_), fd_(o.fd_) {
    o.pid_ = -1;
    o.fd_ = -1;
}

TargetProcess& TargetProcess::operator=(TargetProcess&& o) noexcept {
    if (this != &o) {
        (void)finish(std::chrono::seconds(10));
        pid_ = o.pid_;
        fd_ = o.fd_;
        o.pid_ = -1;
        o.fd_ = -1;
    }
    return *this;
}

int TargetProcess::finish(Duration grace) {
    if (fd_ >= 0) {
        ::close(fd_);
        fd_ = -1;
    }
    if (pid_ <= 0) return -1;
    const TimePoint deadline = Clock::now() + grace;
    int status = 0;
    pid_t r = 0;
    while ((r = ::waitpid(pid_, &status, WNOHANG)) == 0 && Clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (r == 0) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        pid_ = -1;
        return -1;
    }
    pid_ = -1;
    return r == -1 || !WIFEXITED(status) ? -1 : WEXITSTATUS(status);
}

}  // namespace ferry::bench

// The second process of `bench xfer` and `bench gpu`: forked from the benchmark, talking to it
// over a socket pair in length-prefixed frames.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"

namespace ferry::bench {

// One frame: a 4-byte length and the bytes. False when the peer is gone (never SIGPIPE: a
// target that exited must not kill the benchmark before it prints why the run failed).
bool send_frame(int fd, std::span<const uint8_t> bytes);
// False when the peer closed its end or, given `within`, no whole frame came in that time.
bool recv_frame(int fd, std::vector<uint8_t>* out, std::optional<Duration> within = std::nullopt);

class TargetProcess {
  public:
    // Forks a child that runs `main` on its end of the socket pair and exits with its result.
    // The child dies with this process (it was left running when a test killed a benchmark),
    // and an exception out of `main` ends it with status 1 instead of unwinding into its copy
    // of the caller's stack (the CLI then printed the error twice and ran its exit path in the
    // child). Call before this process opened any libfabric or CUDA object.
    static Result<TargetProcess> start(const std::function<int(int fd)>& main);

    TargetProcess() = default;
    TargetProcess(TargetProcess&& o) noexcept;
    TargetProcess& operator=(TargetProcess&& o) noexcept;
    TargetProcess(const TargetProcess&) = delete;
    TargetProcess& operator=(const TargetProcess&) = delete;
    ~TargetProcess() { (void)finish(std::chrono::seconds(10)); }

    int fd() const { return fd_; }
    // Closes this end (the target sees the end of its commands), waits up to `grace` for the
    // target to exit and kills it after that: its exit status, or -1 when it had to be killed
    // or ended by a signal.
    int finish(Duration grace);

  private:
    pid_t pid_ = -1;
    int fd_ = -1;
};

}  // namespace ferry::bench

// Runs test bodies in real, separate processes (fork), with a parent hub for exchanging
// blobs (engine addresses, descriptors) between them. Fork happens before any libfabric
// object exists in the children, so each child is a clean process.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"

namespace ferry::testing {

// A child's view of the group: its rank, the group size, and collective exchange through
// the parent. A rank that died contributes an empty blob, so survivors never hang.
class Exchange {
  public:
    Exchange(int rank, int size, int fd) : rank_(rank), size_(size), fd_(fd) {}
    int rank() const { return rank_; }
    int size() const { return size_; }
    // Every rank's blob, indexed by rank. Fails if the parent is gone.
    Result<std::vector<std::vector<uint8_t>>> allgather(std::span<const uint8_t> mine);
    Status barrier();
    // Every rank's process id, indexed by rank (tests that stop or kill a peer).
    Result<std::vector<long>> pids();

  private:
    int rank_;
    int size_;
    int fd_;
};

// A child body returns "" on success or a description of what went wrong.
using ChildFn = std::function<std::string(Exchange&)>;

struct ChildResult {
    int rank = 0;
    int exit_code = -1;   // exit status, -1 if killed by a signal
    int term_signal = 0;  // signal that ended it, 0 if it exited
    std::string error;    // what the body returned, or why the parent judged it failed
    bool ok() const { return exit_code == 0 && error.empty(); }
};

// Forks n children running fn, serves their exchanges, waits for all (killing every child
// still running after timeout) and returns one result per rank.
std::vector<ChildResult> run_processes(int n, const ChildFn& fn, Duration timeout);

// Formats all failures of a run, for a gtest message; empty when every child succeeded.
std::string describe_failures(const std::vector<ChildResult>& results);

// Stops process pid (SIGSTOP) and waits until it is stopped, up to timeout; false if it did
// not stop. SIGCONT lets it go on.
bool stop_process(long pid, Duration timeout);

// Random seed for a test: FERRY_TEST_SEED if set, otherwise random; printed either way so a
// failing run can be repeated.
uint64_t test_seed(const char* test_name);

}  // namespace ferry::testing

// Checks for child bodies: return a message naming the place and the failed condition.
#define CHILD_CHECK(cond)                                                                        \
    do {                                                                                         \
        if (!(cond)) return ::fmt::format("{}:{}: check failed: {}", __FILE__, __LINE__, #cond); \
    } while (0)
#define CHILD_CHECK_MSG(cond, ...)                                                         \
    do {                                                                                   \
        if (!(cond))                                                                       \
            return ::fmt::format("{}:{}: check failed: {}: {}", __FILE__, __LINE__, #cond, \
                                 ::fmt::format(__VA_ARGS__));                              \
    } while (0)
#define CHILD_CHECK_OK(expr)                                                        \
    do {                                                                            \
        ::ferry::Status child_status_ = (expr);                                     \
        if (!child_status_.ok())                                                    \
            return ::fmt::format("{}:{}: {} failed: {}", __FILE__, __LINE__, #expr, \
                                 child_status_.to_string());                        \
    } while (0)
#define CHILD_ASSIGN_OK(lhs, expr) \
    CHILD_ASSIGN_OK_IMPL(FERRY_CONCAT(child_result_, __LINE__), lhs, expr)
#define CHILD_ASSIGN_OK_IMPL(tmp, lhs, expr)                                    \
    auto tmp = (expr);                                                          \
    if (!tmp.ok())                                                              \
        return ::fmt::format("{}:{}: {} failed: {}", __FILE__, __LINE__, #expr, \
                             tmp.status().to_string());                         \
    lhs = std::move(tmp).value()

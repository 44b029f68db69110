// The library logs from its own threads, some of them holding its locks; calling into Python
// there (taking the GIL) could wait on a Python thread that waits on those locks. So the sink
// only queues the line, and a Python thread takes the queue (log_take, GIL released while it
// waits) and hands each line to logging.
#include "log_sink.h"

#include <pthread.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "ferry/common/log.h"

namespace py = pybind11;

namespace ferry::python {
namespace {

// Lines kept for Python at most: past that (no one takes them) new lines are counted, not kept.
constexpr size_t kMaxQueued = 10000;

struct Line {
    int level;
    std::string component, message;
    double time;
};

struct Queue {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Line> lines;
    size_t dropped = 0;
    bool woken = false;  // log_wake(): the waiter returns (Python is shutting down)
};

// Leaked: library threads may log during static destruction. Replaced in a fork child, whose
// copy's mutex may be held by a thread the child does not have.
Queue* g_queue = new Queue();

void queue_line(LogLevel level, std::string_view component, std::string_view message, double time) {
    Queue* q = g_queue;
    {
        std::lock_guard lk(q->mu);
        if (q->lines.size() >= kMaxQueued) {
            ++q->dropped;
            return;
        }
        q->lines.push_back(
            {static_cast<int>(level), std::string(component), std::string(message), time});
    }
    q->cv.notify_one();
}

using Taken = std::vector<std::tuple<int, std::string, std::string, double>>;

// Waits up to timeout_s for a line or log_wake(); true if there is a line.
bool wait(double timeout_s) {
    Queue* q = g_queue;
    std::unique_lock lk(q->mu);
    q->cv.wait_for(lk, std::chrono::duration<double>(timeout_s),
                   [q] { return !q->lines.empty() || q->dropped > 0 || q->woken; });
    q->woken = false;
    return !q->lines.empty() || q->dropped > 0;
}

void wake() {
    Queue* q = g_queue;
    {
        std::lock_guard lk(q->mu);
        q->woken = true;
    }
    q->cv.notify_all();
}

// Every queued line; a line saying how many were dropped comes first where the queue
// overflowed.
Taken take() {
    Queue* q = g_queue;
    std::lock_guard lk(q->mu);
    Taken out;
    if (q->dropped) {
        out.emplace_back(
            static_cast<int>(LogLevel::kWarn), "log",
            std::to_string(q->dropped) + " log lines dropped: more than were taken in time", 0.0);
        q->dropped = 0;
    }
    for (Line& l : q->lines)
        out.emplace_back(l.level, std::move(l.component), std::move(l.message), l.time);
    q->lines.clear();
    return out;
}

}  // namespace

void register_log(py::module_& m) {
    static const bool at_fork = [] {
        ::pthread_atfork(nullptr, nullptr, [] { g_queue = new Queue(); });
        return true;
    }();
    (void)at_fork;
    m.def(
        "log_route", [](bool to_python) { set_log_sink(to_python ? &queue_line : nullptr); },
        py::arg("to_python"));
    m.def(
        "log_wait",
        [](double timeout_s) {
            py::gil_scoped_release nogil;
            return wait(timeout_s);
        },
        py::arg("timeout_s"));
    m.def("log_take", &take);
    m.def("log_wake", &wake);
    m.def(
        "log_set_level",
        [](int level) { set_log_level(static_cast<LogLevel>(std::clamp(level, 0, 4))); },
        py::arg("level"));
}

}  // namespace ferry::python

// Conversions between Python values and ferry's types that every binding file needs: seconds
// as a Duration (checked, so a NaN or negative timeout is a clear error, not a hang) and bytes
// objects as byte spans.
#pragma once

#include <fmt/format.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "errors.h"
#include "ferry/common/clock.h"
#include "ferry/fabric/engine.h"

namespace ferry::python {

// Turns a _ferry.Engine into a share of its TransferEngine (module.cc owns that class): a KV
// connector or an all-to-all keeps the engine running for as long as it runs on it.
using EngineShare = std::shared_ptr<TransferEngine> (*)(pybind11::handle engine);

inline std::string type_name(pybind11::handle obj) {
    return pybind11::str(pybind11::type::handle_of(obj).attr("__name__"));
}

// Longer than any wait means (about 31 years): a bigger value would overflow the deadline
// (now + timeout in nanoseconds) into the past, and a wait would end at once or never.
constexpr double kMaxSeconds = 1e9;

// x as Python prints it ("-1.0", "nan", "1e+300"): what the caller passed, as they would write it.
inline std::string float_text(double x) { return pybind11::repr(pybind11::float_(x)); }

// A Python number (int, float, numpy scalar) as a double; anything else (None, a string, a
// bool) is an InvalidType "<what> must be a number of <unit><also>, got <type>", not
// pybind11's TypeError. An int too large for a double is out of `range` (the values allowed,
// for the message).
inline double number_arg(pybind11::handle v, const char* what, const char* unit,
                         const std::string& range, const char* also = "") {
    if (!PyBool_Check(v.ptr())) {
        double x = PyFloat_AsDouble(v.ptr());
        if (!(x == -1.0 && PyErr_Occurred())) return x;
        bool overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
        PyErr_Clear();
        if (overflow) {
            throw StatusError(invalid_argument(
                fmt::format("{} must be {}, got an int too large for a float", what, range)));
        }
    }
    throw StatusError::wrong_type(
        fmt::format("{} must be a number of {}{}, got {}", what, unit, also, type_name(v)));
}

// A Python number of seconds in [0, 1e9] (int, float, numpy scalar) as a Duration; anything
// else is an InvalidArgument naming `what`. The one check of every timeout, lease and
// deadline ferry's Python API takes.
inline Duration seconds_arg(pybind11::handle v, const char* what) {
    constexpr const char* kRange = "a finite number of seconds >= 0 (at most 1e9)";
    double s = number_arg(v, what, "seconds", kRange);
    if (!std::isfinite(s) || s < 0 || s > kMaxSeconds) {
        throw StatusError(
            invalid_argument(fmt::format("{} must be {}, got {}", what, kRange, float_text(s))));
    }
    return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

// A Python int in [0, 2^32) (numpy integers too); None, a bool, a float, a string or an
// int out of range is an InvalidArgument naming `what`, not pybind11's TypeError.
inline uint32_t u32_arg(pybind11::handle v, const char* what) {
    constexpr unsigned long long kMax = 0xFFFFFFFFull;
    if (!PyBool_Check(v.ptr()) && PyIndex_Check(v.ptr())) {
        pybind11::object i = pybind11::reinterpret_steal<pybind11::object>(PyNumber_Index(v.ptr()));
        if (i) {
            int overflow = 0;
            long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
            if (overflow == 0 && x >= 0 && static_cast<unsigned long long>(x) <= kMax) {
                return static_cast<uint32_t>(x);
            }
            if (!PyErr_Occurred()) {
                throw StatusError(invalid_argument(std::string(what) + " must be in [0, " +
                                                   std::to_string(kMax) + "], got " +
                                                   std::string(pybind11::str(i))));
            }
        }
        PyErr_Clear();
    }
    throw StatusError::wrong_type(std::string(what) + " must be an integer, got " + type_name(v));
}

inline std::string str_arg(pybind11::handle v, const char* what) {
    if (!PyUnicode_Check(v.ptr())) {
        throw StatusError::wrong_type(std::string(what) + " must be a string, got " + type_name(v));
    }
    return v.cast<std::string>();
}

// Bytes-like Python objects (bytes, bytearray, memoryview) as a copy of their bytes; anything
// else is an InvalidArgument naming `what`.
inline std::vector<uint8_t> bytes_arg(pybind11::handle v, const char* what) {
    if (PyBytes_Check(v.ptr()) || PyByteArray_Check(v.ptr()) || PyMemoryView_Check(v.ptr())) {
        Py_buffer view;
        if (PyObject_GetBuffer(v.ptr(), &view, PyBUF_C_CONTIGUOUS) == 0) {
            const auto* p = static_cast<const uint8_t*>(view.buf);
            std::vector<uint8_t> out(p, p + view.len);
            PyBuffer_Release(&view);
            return out;
        }
        PyErr_Clear();
    }
    throw StatusError::wrong_type(std::string(what) + " must be bytes, got " + type_name(v));
}

// A Python number of microseconds in [0, max_us] as a Duration (a spin or nap length);
// anything else is an InvalidArgument naming `what` (`also`: other values the caller takes,
// for the message).
inline Duration micros_arg(pybind11::handle v, const char* what, double max_us,
                           const char* also = "") {
    const std::string range =
        fmt::format("a number of microseconds in [0, {}]", static_cast<uint64_t>(max_us));
    double us = number_arg(v, what, "microseconds", range, also);
    if (!std::isfinite(us) || us < 0 || us > max_us) {
        throw StatusError(
            invalid_argument(fmt::format("{} must be {}, got {}", what, range, float_text(us))));
    }
    return std::chrono::duration_cast<Duration>(std::chrono::duration<double, std::micro>(us));
}

// cv.wait_for(l, t, ready), except that t <= 0 only tests ready(): a wait whose time is
// already up still sleeps in the kernel (100-110 us on the 2-core dev VM, the timer's slack),
// where wait(timeout=0), "poll once", should cost what poll() costs.
template <typename Ready>
bool wait_for_or_test(std::condition_variable& cv, std::unique_lock<std::mutex>& l, Duration t,
                      Ready&& ready) {
    if (t <= Duration::zero()) return ready();
    return cv.wait_for(l, t, std::forward<Ready>(ready));
}

// How long a wait runs without the GIL before it looks at Python's signals: Ctrl-C during
// wait(timeout=600) raised KeyboardInterrupt only when the 600 s had passed.
constexpr Duration kSignalSlice = std::chrono::milliseconds(100);

// Waits up to `timeout` in slices of at most kSignalSlice, the GIL released in each and taken
// between them to run Python's signal handlers: a KeyboardInterrupt (or whatever a handler
// raises) propagates within a slice. `step(slice)` waits at most `slice` and returns the final
// status, or nullopt when it is not finished (it must leave nothing armed then); it runs at
// least once, so a timeout of 0 polls. When the deadline passes first, `timed_out()` is
// returned. Called with the GIL held.
template <typename Step, typename TimedOut>
Status wait_interruptible(Duration timeout, Step&& step, TimedOut&& timed_out) {
    const TimePoint deadline = deadline_after(timeout);
    for (;;) {
        const Duration left = std::max(Duration::zero(), deadline - Clock::now());
        std::optional<Status> s;
        {
            pybind11::gil_scoped_release nogil;
            s = step(std::min(left, kSignalSlice));
        }
        if (s) return *s;
        if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
        if (Clock::now() >= deadline) return timed_out();
    }
}

inline std::span<const uint8_t> bytes_span(const pybind11::bytes& b) {
    char* data = nullptr;
    Py_ssize_t len = 0;
    if (PyBytes_AsStringAndSize(b.ptr(), &data, &len) != 0) throw pybind11::error_already_set();
    return {reinterpret_cast<const uint8_t*>(data), static_cast<size_t>(len)};
}

inline pybind11::bytes to_bytes(const std::vector<uint8_t>& v) {
    return pybind11::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

}  // namespace ferry::python

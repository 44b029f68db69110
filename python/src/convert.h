// Conversions between Python values and ferry's types that every binding file needs: seconds
// as a Duration (checked, so a NaN or negative timeout is a clear error, not a hang) and bytes
// objects as byte spans.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "errors.h"
#include "ferry/common/clock.h"

namespace ferry::python {

inline Duration seconds_to_duration(double s, const char* what) {
    if (!std::isfinite(s) || s < 0) {
        throw StatusError(invalid_argument(std::string(what) +
                                           " must be a finite number of "
                                           "seconds >= 0, got " +
                                           std::to_string(s)));
    }
    return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

// Microseconds in [0, max_us] as a Duration (a spin or nap length).
inline Duration micros_to_duration(double us, const char* what, double max_us) {
    if (!std::isfinite(us) || us < 0 || us > max_us) {
        throw StatusError(invalid_argument(
            std::string(what) + " must be a number of microseconds in [0, " +
            std::to_string(static_cast<uint64_t>(max_us)) + "], got " + std::to_string(us)));
    }
    return std::chrono::duration_cast<Duration>(std::chrono::duration<double, std::micro>(us));
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

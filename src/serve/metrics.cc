#include "serve/metrics.h"

#include <fmt/format.h>

#include <algorithm>

namespace ferry::serve {

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
    size_t i = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin());
    std::lock_guard lock(mu_);
    counts_[i]++;
    sum_ += value;
    n_++;
}

uint64_t Histogram::count() const {
    std::lock_guard lock(mu_);
    return n_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
    std::lock_guard lock(mu_);
    out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
    uint64_t cumulative = 0;
    for (size_t i = 0; i < bounds_.size(); ++i) {
        cumulative += counts_[i];
        out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cumulative);
    }
    cumulative += counts_.back();
    out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n", name, cumulative);
    out += fmt::format("{}_sum {}\n{}_count {}\n", name, sum_, name, n_);
}

std::vector<double> latency_buckets_seconds() {
    return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

void render_counter(std::string& out, const std::string& name, const std::string& help,
                    double value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} counter\n{} {}\n", name, help, name, name, value);
}

void render_gauge(std::string& out, const std::string& name, const std::string& help,
                  double value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} gauge\n{} {}\n", name, help, name, name, value);
}

}  // namespace ferry::serve

// Counters, gauges and histograms rendered in the Prometheus text format for GET /metrics.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace ferry::serve {

class Histogram {
  public:
    // `bounds` are the upper bounds of the buckets, ascending (the +Inf bucket is implicit).
    explicit Histogram(std::vector<double> bounds);
    void observe(double value);
    // Appends `name_bucket{le=..}`, `name_sum` and `name_count` lines.
    void render(std::string& out, const std::string& name, const std::string& help) const;
    uint64_t count() const;

  private:
    std::vector<double> bounds_;
    mutable std::mutex mu_;
    std::vector<uint64_t> counts_;  // per bucket, not cumulative
    double sum_ = 0;
    uint64_t n_ = 0;
};

// Latency buckets in seconds from 1 ms to 60 s.
std::vector<double> latency_buckets_seconds();

void render_counter(std::string& out, const std::string& name, const std::string& help,
                    double value);
void render_gauge(std::string& out, const std::string& name, const std::string& help, double value);

}  // namespace ferry::serve

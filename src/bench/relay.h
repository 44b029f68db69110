// `ferry bench relay`: the router's own work on one /v1/completions body, without sockets or
// engines: check the body and build both legs (prefill: max_tokens 1, stream false, transfer
// parameters; decode: transfer parameters), the way the router relays it (scan, splice) beside
// a full nlohmann parse and two dumps (what it did before). Token-id prompts of the given
// lengths, ids drawn below the vocabulary as `ferry bench serve` draws them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/common/status.h"

namespace ferry::serve {

struct RelayBenchConfig {
    std::vector<size_t> input_lens{1024, 4096, 16384};
    int vocab = 151936;
    size_t iters = 200;  // timed bodies per length and way
    uint64_t seed = 0;
};

struct RelayBenchRow {
    size_t input_len = 0;
    size_t body_bytes = 0;
    double relay_p50_us = 0, relay_p99_us = 0;
    double full_p50_us = 0, full_p99_us = 0;
};

Result<std::vector<RelayBenchRow>> run_relay_bench(const RelayBenchConfig& c);
std::string format_relay_table(const std::vector<RelayBenchRow>& rows);

}  // namespace ferry::serve

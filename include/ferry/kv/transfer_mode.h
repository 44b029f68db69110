// How the KV of one request moves from prefill to decode, as a deployment picks it (the
// serving stack's --kv-mode, the router's legs, `ferry bench kv --mode`).
#pragma once

#include <cstdint>
#include <string_view>

#include "ferry/common/status.h"

namespace ferry::kv {

enum class TransferMode : uint8_t {
    kPush,        // decode registers its blocks early; prefill writes as the KV becomes final
    kPull,        // prefill offers its blocks; decode reads them on the connector's thread
    kPullInline,  // as kPull, but decode plans and posts the reads in its caller's thread
};

// "push", "pull", "pull-inline".
std::string_view to_string(TransferMode mode);
Result<TransferMode> parse_transfer_mode(std::string_view name);

}  // namespace ferry::kv

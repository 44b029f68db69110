#include "ferry/kv/transfer_mode.h"

#include <fmt/format.h>

namespace ferry::kv {

std::string_view to_string(TransferMode mode) {
    switch (mode) {
        case TransferMode::kPush:
            return "push";
        case TransferMode::kPull:
            return "pull";
        case TransferMode::kPullInline:
            return "pull-inline";
    }
    return "unknown";
}

Result<TransferMode> parse_transfer_mode(std::string_view name) {
    for (TransferMode m : {TransferMode::kPush, TransferMode::kPull, TransferMode::kPullInline}) {
        if (name == to_string(m)) return m;
    }
    return invalid_argument(
        fmt::format("unknown KV transfer mode '{}': use push, pull or pull-inline", name));
}

}  // namespace ferry::kv

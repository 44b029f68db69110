#include "ferry/kv/transfer_mode.h"

#include <fmt/format.h>

#include "common/enum_names.h"

namespace ferry::kv {

namespace {

constexpr EnumName<TransferMode> kModeNames[] = {
    {TransferMode::kPush, "push"},
    {TransferMode::kPull, "pull"},
    {TransferMode::kPullInline, "pull-inline"},
};

}  // namespace

std::string_view to_string(TransferMode mode) { return name_of(kModeNames, mode); }

Result<TransferMode> parse_transfer_mode(std::string_view name) {
    if (auto m = parse_name(kModeNames, name)) return *m;
    return invalid_argument(
        fmt::format("unknown KV transfer mode '{}': use {}", name, name_list(kModeNames)));
}

}  // namespace ferry::kv
